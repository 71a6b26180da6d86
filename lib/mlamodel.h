/* A model's attention as DeepSeek-V2 multi-head latent attention
 * (internal to the library layers: lib runs it, formats reads and writes
 * it, calib builds it). */
#ifndef KV_MLAMODEL_H
#define KV_MLAMODEL_H

#include "kvcal_core.h"

/* A Llama-family model rewritten as DeepSeek-V2's multi-head latent
 * attention (docs/design.md, "Export as Multi-head Latent Attention"):
 * per layer, in weight layout ([out, in], float32):
 *   wq      [H*(n+R), d]  each head's q^nope (n rows) then q^pe (R rows),
 *                         the score scale folded in
 *   wkv_a   [d_c+R, d]    the latent's rows (scaled by alpha) then k^pe's
 *   kv_norm [d_c]         the latent RMSNorm's gain (sqrt(latent_eps) / alpha)
 *   wk_b    [H, d_c, n]   W_UK,h transposed (attn_k_b)
 *   wv_b    [H, v, d_c]   W_UV,h (attn_v_b)
 * with H the model's query heads, d_c kv_lora_rank, R rope_dim (pairs
 * (2i, 2i+1), base rope_base), n nope_dim, v v_dim. The other weights
 * (embedding, norms, W_o, the FFN, the head) are the model's. */
struct kv_mla_layer {
    float *wq, *wkv_a, *kv_norm, *wk_b, *wv_b;
};
struct kv_mla {
    int64_t n_layers, n_heads, kv_lora_rank, rope_dim, nope_dim, v_dim;
    float rope_base;
    /* the epsilon of the latent's RMSNorm the gain was made for: the
     * model's rms_norm_eps in GGUF (llama.cpp's one epsilon), either that or
     * 1e-6 (transformers' fixed kv_a_layernorm) in an HF directory */
    float latent_eps;
    char base_fingerprint[65]; /* the model it was made from (kv_model_fingerprint) */
    struct kv_mla_layer *layers;
};

#endif
