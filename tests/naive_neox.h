/* Naive float64 GPT-NeoX (Pythia) forward written from the model
 * definition, the independent oracle of the gpt_neox tests (no BLAS, no code
 * shared with lib/forward.c). Header-only: static functions.
 *
 * x = embed_in[tok]; per layer, with LayerNorms ln1, ln2 (biased variance):
 *   q, k, v = projections of ln1(x) (with biases); RoPE turns the first
 *     r = rope_dim dimensions of each head, pairs (i, i + r/2), angle
 *     t · θ^(-2i/r); the other d_h - r dimensions pass unchanged;
 *   a = attn(q, k, v) W_oᵀ + b_o (scale 1/sqrt(d_h), causal);
 *   m = down(gelu(up(ln2(·)))) with biases, gelu x Φ(x) (erf) or the tanh
 *     approximation;
 *   parallel residual:   x = x + a(ln1 x) + m(ln2 x)
 *   sequential residual: x = x + a;  x = x + m(ln2 x)
 * logits = ln_f(x) · embed_outᵀ. */
#ifndef KV_NAIVE_NEOX_H
#define KV_NAIVE_NEOX_H

#include <math.h>
#include <stdlib.h>

#include "model.h"
#include "naive_gelu.h"
#include "naive_gpt2.h"
#include "naive_rope.h"

static inline double naive_neox_gelu(double a, int erf_gelu) {
    return erf_gelu ? 0.5 * a * (1.0 + erf(a / sqrt(2.0))) : naive_gelu_tanh(a);
}

/* Rotate the first r dimensions of each of nh heads of rows [n, nh*dh]. */
static inline void naive_neox_rope(const struct kv_config *c, double *buf, int64_t n, int64_t nh) {
    int64_t dh = c->head_dim, r = c->rope_dim ? c->rope_dim : dh;
    for (int64_t t = 0; t < n; t++)
        for (int64_t hh = 0; hh < nh; hh++)
            for (int64_t i = 0; i < r / 2; i++) {
                double ms, ang = naive_rope_angle(c, n, t, i, &ms);
                double *e = buf + (t * nh + hh) * dh, re = e[i], im = e[i + r / 2];
                e[i] = (re * cos(ang) - im * sin(ang)) * ms;
                e[i + r / 2] = (re * sin(ang) + im * cos(ang)) * ms;
            }
}

/* Reference logits [n, vocab] of tokens at positions 0..n-1 (malloc'd). */
static inline double *naive_neox_forward(const struct kv_model *m, const int32_t *tok, int64_t n) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, h = c->n_heads, dh = c->head_dim, hid = c->hidden_dim, V = c->vocab_size;
    int64_t qd = h * dh;
    double eps = c->norm_eps;
    double *x = calloc((size_t)(n * d), sizeof(double));
    double *xn = calloc((size_t)(n * d), sizeof(double));
    double *xm = calloc((size_t)(n * d), sizeof(double)); /* the MLP's normed input */
    double *q = calloc((size_t)(n * qd), sizeof(double));
    double *k = calloc((size_t)(n * qd), sizeof(double));
    double *v = calloc((size_t)(n * qd), sizeof(double));
    double *o = calloc((size_t)(n * qd), sizeof(double));
    double *att = calloc((size_t)(n * d), sizeof(double));
    double *a = calloc((size_t)(n * hid), sizeof(double));
    double *logits = calloc((size_t)(n * V), sizeof(double));
    const float *emb = kv_model_weight(m, KV_W_TOK_EMB, 0);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++) x[t * d + j] = emb[tok[t] * d + j];
#define W_(kind) kv_model_weight(m, (kind), l)
    for (int64_t l = 0; l < c->n_layers; l++) {
        naive_gpt2_layernorm(xn, x, W_(KV_W_ATTN_NORM), W_(KV_W_ATTN_NORM_B), n, d, eps);
        if (c->parallel_residual)
            naive_gpt2_layernorm(xm, x, W_(KV_W_FFN_NORM), W_(KV_W_FFN_NORM_B), n, d, eps);
        naive_gpt2_linear(q, xn, W_(KV_W_Q), W_(KV_W_BQ), n, qd, d, 0);
        naive_gpt2_linear(k, xn, W_(KV_W_K), W_(KV_W_BK), n, qd, d, 0);
        naive_gpt2_linear(v, xn, W_(KV_W_V), W_(KV_W_BV), n, qd, d, 0);
        naive_neox_rope(c, q, n, h);
        naive_neox_rope(c, k, n, h);
        naive_gpt2_attend(o, q, k, v, n, h, dh);
        naive_gpt2_linear(att, o, W_(KV_W_O), W_(KV_W_BO), n, d, qd, 0);
        for (int64_t i = 0; i < n * d; i++) x[i] += att[i];
        if (!c->parallel_residual)
            naive_gpt2_layernorm(xm, x, W_(KV_W_FFN_NORM), W_(KV_W_FFN_NORM_B), n, d, eps);
        naive_gpt2_linear(a, xm, W_(KV_W_UP), W_(KV_W_BUP), n, hid, d, 0);
        for (int64_t i = 0; i < n * hid; i++) a[i] = naive_neox_gelu(a[i], c->gelu_erf);
        naive_gpt2_linear(x, a, W_(KV_W_DOWN), W_(KV_W_BDOWN), n, d, hid, 1);
    }
#undef W_
    naive_gpt2_layernorm(xn, x, kv_model_weight(m, KV_W_OUT_NORM, 0),
                         kv_model_weight(m, KV_W_OUT_NORM_B, 0), n, d, eps);
    const float *head = c->tied_embeddings ? emb : kv_model_weight(m, KV_W_LM_HEAD, 0);
    naive_gpt2_linear(logits, xn, head, NULL, n, V, d, 0);
    free(x), free(xn), free(xm), free(q), free(k), free(v), free(o), free(att), free(a);
    return logits;
}

/* A small GPT-NeoX: MHA heads of 16 with the first 4 dimensions turned
 * (Pythia's rotary_pct 0.25), parallel residual, erf GELU, untied head. */
static inline struct kv_config tiny_neox_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPTNEOX;
    c.dim = 64, c.hidden_dim = 128, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 4;
    c.head_dim = 16, c.rope_dim = 4, c.vocab_size = 97, c.max_seq_len = 64;
    c.norm_eps = 1e-5f, c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF;
    c.parallel_residual = 1, c.gelu_erf = 1, c.has_qkv_bias = 1;
    c.bos_id = -1, c.eos_id = -1;
    return c;
}

#endif
