/* The compressed-model output directory of `kvcal decompose` (internal).
 *
 * Layout (DESIGN §7; manifest version 1):
 *
 *     kvcal.json          the manifest (jansson, indent 2), fields in order:
 *                           format "kvcal.manifest", version 1, kvcal_version,
 *                           method, alloc, options {..}, model {fingerprint,
 *                           source, format, arch ("llama" or "gpt2"), dim,
 *                           hidden_dim, n_layers, n_heads, n_kv_heads,
 *                           head_dim, vocab_size, norm_eps, tied_embeddings,
 *                           qkv_bias, ..}, stats, rope {layout, pairs, theta,
 *                           scaling} (null for gpt2: no rope), latent {dtype,
 *                           bits, quantization, hadamard}, weights,
 *                           weight_layout "linear [out, in]",
 *                           kv_bytes_per_token {base, compressed, ratio},
 *                           predicted_error {k, v}, layers [..]
 *     model.safetensors   every weight the forward pass uses, F32, each matrix
 *                         [out, in] (y = x Wᵀ, kvcal's layout: gpt2's Conv1D
 *                         [in, out] tensors are stored transposed and c_attn
 *                         split into q, k and v). Names are HF's with a
 *                         per-layer prefix P: "model.layers.N." and attention
 *                         module A "self_attn." (llama), "transformer.h.N."
 *                         and "attn." (gpt2). Globals: model.embed_tokens,
 *                         model.norm, lm_head (llama); transformer.wte,
 *                         transformer.wpe, transformer.ln_f.{weight,bias},
 *                         lm_head when untied (gpt2). Per layer, besides K/V:
 *                           llama: P input_layernorm, P A q_proj (+ .bias),
 *                                  P A o_proj, P post_attention_layernorm,
 *                                  P mlp.{gate,up,down}_proj
 *                           gpt2:  P ln_1.{weight,bias}, P A q_proj.{weight,
 *                                  bias}, P A o_proj.{weight,bias}, P
 *                                  ln_2.{weight,bias}, P mlp.c_fc.{weight,
 *                                  bias}, P mlp.c_proj.{weight,bias}
 *                         and K/V (names under P A):
 *                           K full:              k_proj.weight (+ .bias)
 *                           K prerope_latent,    k_down.weight [Σ rank_u, d]
 *                             fused_query:       (+ k_down.bias [Σ rank_u]),
 *                                                k_up.U.weight [s_u*d_h, rank_u]
 *                           K fused_query also:  q_proj replaced by
 *                                                q_fused.weight [q_cols, d]
 *                                                (+ q_fused.bias [q_cols])
 *                           K postrope_rotation: k_proj.weight (+ .bias),
 *                                                k_rot.U.weight [rank_u, d_h]
 *                           V full:              v_proj.weight (+ .bias)
 *                           V fused_output:      v_down / v_up as for K, and
 *                                                o_proj.weight [d, o_cols]
 *                                                replaced by the fused one
 *     config.json, generation_config.json, tokenizer.json,
 *     tokenizer_config.json, special_tokens_map.json
 *                         copied from an HF source directory when present;
 *                         for another source the --tokenizer file, under its
 *                         own base name
 *
 * Each layer side of the manifest ("k", "v") holds mode, rank (Σ rank_u),
 * predicted_error, the tensor names down, down_bias, proj (and proj_bias),
 * for V o_proj (and o_cols when fused), for fused_query K q_proj, q_proj_bias
 * (null without q biases) and q_cols, and units [{heads, rank,
 * latent_offset, up, rot, energy, dropped, predicted_error}]. Units cover
 * the layer's KV heads in order, each exactly once; latent_offset is the
 * unit's first row in down (its first column of the cached latent). q_cols
 * and o_cols are Σ over query heads of their unit's rank, query heads in
 * order. fused_query needs a model without rope (gpt2).
 *
 * A reader trusts nothing: names come from the manifest and every tensor's
 * shape must be the one the ranks imply. */
#ifndef KV_KVDIR_H
#define KV_KVDIR_H

#include "kvformats.h"

/* The API (struct kv_lr_dir_info, kv_lr_dir_write, kv_lr_dir_open,
 * kv_lr_manifest_read) is declared in kvcal.h. */

#endif
