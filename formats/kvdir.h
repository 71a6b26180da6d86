/* The compressed-model output directory of `kvcal decompose` (internal).
 * The API (struct kv_lr_dir_info, kv_lr_dir_write, kv_lr_dir_check,
 * kv_lr_dir_open) is declared in kvformats.h; this module holds the
 * directory logic (the atomic replace of an earlier output, the files
 * copied from the source) and reads and writes its two files through
 * formats/kvmanifest.h (the manifest) and formats/lrweights.h (the weights),
 * with the names and rules of formats/lrlayout.h.
 *
 * Layout (DESIGN §7):
 *
 *     kvcal.json          the manifest (schema in kvmanifest.h)
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
 * A reader trusts nothing: names come from the manifest and every tensor's
 * shape must be the one the ranks imply. */
#ifndef KV_KVDIR_H
#define KV_KVDIR_H

#include "kvformats.h"

#endif
