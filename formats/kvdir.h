/* The compressed-model output directory of `kvcal decompose` (internal).
 *
 * Layout (DESIGN §7; manifest version 1):
 *
 *     kvcal.json          the manifest (jansson, indent 2), fields in order:
 *                           format "kvcal.manifest", version 1, kvcal_version,
 *                           method, alloc, options {..}, model {fingerprint,
 *                           source, format, arch, dim, hidden_dim, n_layers,
 *                           n_heads, n_kv_heads, head_dim, vocab_size,
 *                           norm_eps, tied_embeddings, qkv_bias, ..}, stats,
 *                           rope {layout, pairs, theta, scaling}, latent
 *                           {dtype, bits, quantization, hadamard}, weights,
 *                           kv_bytes_per_token {base, compressed, ratio},
 *                           predicted_error {k, v}, layers [..]
 *     model.safetensors   every weight, F32, HF Llama names; per layer N
 *                         (prefix model.layers.N.self_attn.):
 *                           K full:              k_proj.weight (+ .bias)
 *                           K prerope_latent:    k_down.weight [Σ rank_u, d]
 *                                                (+ k_down.bias [Σ rank_u]),
 *                                                k_up.U.weight [s_u*d_h, rank_u]
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
 * for V o_proj (and o_cols when fused), and units [{heads, rank,
 * latent_offset, up, rot, energy, dropped, predicted_error}]. Units cover
 * the layer's KV heads in order, each exactly once; latent_offset is the
 * unit's first row in down (its first column of the cached latent).
 *
 * A reader trusts nothing: names come from the manifest and every tensor's
 * shape must be the one the ranks imply. */
#ifndef KV_KVDIR_H
#define KV_KVDIR_H

#include "kvcal.h"

/* The API (struct kv_lr_dir_info, kv_lr_dir_write, kv_lr_dir_open,
 * kv_lr_manifest_read) is declared in kvcal.h. */

#endif
