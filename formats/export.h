/* Dense export of a compressed model (`kvcal export --dense`).
 *
 * The result is an ordinary model in the source's own format whose K/V
 * projections are the low-rank products W' = up·down, so any engine loads it
 * and computes the same keys and values as the compressed model (no memory
 * saving: it is a quality proxy).
 *
 * Layout of the output: the source copied byte for byte, with only the K/V
 * projection tensors (and the K/V biases when the model has them) of the
 * compressed layer sides overwritten in place, in each tensor's stored dtype
 * (F32, F16 or BF16). Tensor order, offsets, headers and file sizes are
 * those of the source:
 *
 *   HF directory  OUT is a directory holding a copy of every regular file of
 *                 the source directory (symbolic links are followed;
 *                 subdirectories are not copied), the safetensors file(s)
 *                 patched: model.safetensors, or every shard named by
 *                 model.safetensors.index.json. Llama: the tensors
 *                 model.layers.N.self_attn.{k,v}_proj.{weight,bias}. GPT-2:
 *                 the K and V parts of transformer.h.N.attn.c_attn.weight,
 *                 a Conv1D stored [in, out] = [d, qd + 2 kd] whose columns
 *                 qd.. are K and qd+kd.. are V (so W'ᵀ goes there), and of
 *                 c_attn.bias [qd + 2 kd]; the Q columns keep their bytes
 *   GGUF file     OUT is one file; blk.N.attn_{k,v}.{weight,bias} patched.
 *                 When a compressed K/V tensor is block-quantized (Q4_K,
 *                 ...), the file is rewritten instead: the same key-value
 *                 section and tensors in the same order, those K/V tensors
 *                 as F16 (the dense product rounded once), every other
 *                 tensor's bytes copied, offsets recomputed
 *   llama2.c .bin OUT is one file; layers.N.w{k,v} patched
 *
 * No other loader permutes or transposes these tensors (GGUF's ne[] =
 * {in, out} is the row-major [out, in] kvcal uses), so W' is written as
 * computed. */
#ifndef KV_EXPORT_H
#define KV_EXPORT_H

#include "kvformats.h"

/*  Write the dense form of lr applied to model m to out. m must have been
 * loaded from model_path (kv_model_open: an HF directory, a .gguf or a
 * llama2.c .bin); before anything is written every K/V tensor to overwrite
 * is read back from model_path and must decode to exactly m's weight, and
 * lr must match m's shapes (and its fingerprint, when lr carries one).
 *
 * Per layer and side (K, V), with struct kv_lr_unit's factors:
 *   full                              unchanged
 *   prerope_latent, fused_query,      rows [head0*d_h, (head0+n_heads)*d_h) of
 *   fused_output                        W' are up_u·down_u ([n_heads*d_h, rank]
 *                                       · [rank, d], in float64, rounded once)
 *   postrope_rotation                 KV_EUNSUPPORTED (the projection acts after
 *                                       RoPE: no dense weight expresses it)
 * Values in fused_output mode keep the ORIGINAL o_proj: out = P (x W_v'ᵀ) W_oᵀ
 * is exactly what the fused form (P z) o_fusedᵀ computes, so lr->layers[].o_fused
 * is not used. Likewise fused_query keys keep the original q projection:
 * q·(x W_k'ᵀ) = (up_iᵀ q)·z is what q_fused scores, so q_fused is not used.
 *
 * Biases: the compressed side computes z = x downᵀ + c, y = z upᵀ + μ, so
 * y = x (up·down)ᵀ + up·c + μ (μ = up_bias, the calibration mean of
 * centred factors; 0 without). When the model has a K (V) bias, the bias
 * rows of unit u become up_u·down_bias_u + up_bias_u (in float64, rounded
 * once), each term 0 when its factor is NULL (the original bias is not part
 * of the compressed computation). A unit with a down_bias or an up_bias in a
 * model without that bias tensor is KV_EUNSUPPORTED (there is no tensor to
 * hold up·c or the mean). Centred fused_output values need no more: their
 * layer's o_fused_bias is the runtime form of the same mean (O·μ), which
 * the dense W_v', b_v' and the original o_proj compute. Latent quantization
 * (lr->kv_bits < 16) is not reproduced: the export carries the
 * factorization alone.
 *
 * Output (see the layout above) is written atomically: a file through
 * OUT.tmp, fsync and rename; a directory as OUT.tmp-<pid>/ (each file synced)
 * renamed to OUT, then the parent directory synced. Replacing an existing
 * file or an empty directory is fine; out naming the source itself (same
 * inode, for a file also OUT.tmp), a non-empty directory, a directory where
 * a file is due, or a file where a directory is due is KV_EINVAL before
 * anything is written.
 *
 * Errors: KV_EINVAL (mismatched shapes or model, bad output path, a
 * synthetic model), KV_EUNSUPPORTED (as above, naming the layer and mode),
 * KV_EFORMAT (a source file no longer as loaded), KV_ENUMERIC (a non-finite
 * product, or one that overflows the stored dtype), KV_EIO, KV_ENOMEM. On
 * failure out is left as it was. kv_lr_export_dense is declared in kvcal.h. */


#endif
