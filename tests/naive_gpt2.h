/* Naive float64 GPT-2 forward written from the model definition, the
 * independent oracle of the GPT-2 tests (no BLAS, no code shared with
 * lib/forward.c). Header-only: static functions.
 *
 * x = wte[tok] + wpe[pos]; per layer
 *   x += c_proj(attn(ln_1(x))), attention with biases, scale 1/sqrt(d_h), causal;
 *   x += down(gelu_tanh(up(ln_2(x)))), both with biases;
 * logits = ln_f(x) · wteᵀ (or the untied head). LayerNorm uses the biased
 * variance: y = (x - mean) / sqrt(var + eps) * w + b. */
#ifndef KV_NAIVE_GPT2_H
#define KV_NAIVE_GPT2_H

#include <math.h>
#include <stdlib.h>

#include "model.h"

static inline double naive_gpt2_gelu(double a) {
    return 0.5 * a * (1.0 + tanh(sqrt(2.0 / M_PI) * (a + 0.044715 * a * a * a)));
}

/* out[t] = LayerNorm(x[t]) * w + b for n rows of d. */
static inline void naive_gpt2_layernorm(double *out, const double *x, const float *w,
                                        const float *b, int64_t n, int64_t d, double eps) {
    for (int64_t t = 0; t < n; t++) {
        double mean = 0, var = 0;
        for (int64_t j = 0; j < d; j++) mean += x[t * d + j];
        mean /= (double)d;
        for (int64_t j = 0; j < d; j++) var += (x[t * d + j] - mean) * (x[t * d + j] - mean);
        var /= (double)d;
        double r = 1.0 / sqrt(var + eps);
        for (int64_t j = 0; j < d; j++) out[t * d + j] = (x[t * d + j] - mean) * r * w[j] + b[j];
    }
}

/* out[t][r] = Σ_j W[r][j] in[t][j] + b[r] (b may be NULL); acc adds into out. */
static inline void naive_gpt2_linear(double *out, const double *in, const float *W, const float *b,
                                     int64_t n, int64_t rows, int64_t cols, int acc) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < rows; r++) {
            double s = b ? b[r] : 0;
            for (int64_t j = 0; j < cols; j++) s += (double)W[r * cols + j] * in[t * cols + j];
            out[t * rows + r] = acc ? out[t * rows + r] + s : s;
        }
}

/* Causal softmax attention of h heads of dh from q, k, v [n, h*dh] into o. */
static inline void naive_gpt2_attend(double *o, const double *q, const double *k, const double *v,
                                     int64_t n, int64_t h, int64_t dh) {
    double *sc = malloc((size_t)n * sizeof *sc);
    for (int64_t hh = 0; hh < h; hh++)
        for (int64_t t = 0; t < n; t++) {
            double mx = -INFINITY, z = 0;
            for (int64_t s = 0; s <= t; s++) {
                double dot = 0;
                for (int64_t i = 0; i < dh; i++)
                    dot += q[(t * h + hh) * dh + i] * k[(s * h + hh) * dh + i];
                sc[s] = dot / sqrt((double)dh);
                if (sc[s] > mx) mx = sc[s];
            }
            for (int64_t s = 0; s <= t; s++) z += sc[s] = exp(sc[s] - mx);
            for (int64_t i = 0; i < dh; i++) {
                double acc = 0;
                for (int64_t s = 0; s <= t; s++) acc += sc[s] / z * v[(s * h + hh) * dh + i];
                o[(t * h + hh) * dh + i] = acc;
            }
        }
    free(sc);
}

/* Reference logits [n, vocab] of tokens at positions 0..n-1 (malloc'd). */
static inline double *naive_gpt2_forward(const struct kv_model *m, const int32_t *tok, int64_t n) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, h = c->n_heads, dh = c->head_dim, hid = c->hidden_dim, V = c->vocab_size;
    int64_t qd = h * dh;
    double eps = c->norm_eps;
    double *x = calloc((size_t)(n * d), sizeof(double));
    double *xn = calloc((size_t)(n * d), sizeof(double));
    double *q = calloc((size_t)(n * qd), sizeof(double));
    double *k = calloc((size_t)(n * qd), sizeof(double));
    double *v = calloc((size_t)(n * qd), sizeof(double));
    double *o = calloc((size_t)(n * qd), sizeof(double));
    double *a = calloc((size_t)(n * hid), sizeof(double));
    double *logits = calloc((size_t)(n * V), sizeof(double));
    const float *wte = kv_model_weight(m, KV_W_TOK_EMB, 0), *wpe = kv_model_weight(m, KV_W_POS_EMB, 0);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++)
            x[t * d + j] = (double)wte[tok[t] * d + j] + (double)wpe[t * d + j];
#define W_(kind) kv_model_weight(m, (kind), l)
    for (int64_t l = 0; l < c->n_layers; l++) {
        naive_gpt2_layernorm(xn, x, W_(KV_W_ATTN_NORM), W_(KV_W_ATTN_NORM_B), n, d, eps);
        naive_gpt2_linear(q, xn, W_(KV_W_Q), W_(KV_W_BQ), n, qd, d, 0);
        naive_gpt2_linear(k, xn, W_(KV_W_K), W_(KV_W_BK), n, qd, d, 0);
        naive_gpt2_linear(v, xn, W_(KV_W_V), W_(KV_W_BV), n, qd, d, 0);
        naive_gpt2_attend(o, q, k, v, n, h, dh);
        naive_gpt2_linear(x, o, W_(KV_W_O), W_(KV_W_BO), n, d, qd, 1);
        naive_gpt2_layernorm(xn, x, W_(KV_W_FFN_NORM), W_(KV_W_FFN_NORM_B), n, d, eps);
        naive_gpt2_linear(a, xn, W_(KV_W_UP), W_(KV_W_BUP), n, hid, d, 0);
        for (int64_t i = 0; i < n * hid; i++) a[i] = naive_gpt2_gelu(a[i]);
        naive_gpt2_linear(x, a, W_(KV_W_DOWN), W_(KV_W_BDOWN), n, d, hid, 1);
    }
#undef W_
    naive_gpt2_layernorm(xn, x, kv_model_weight(m, KV_W_OUT_NORM, 0),
                         kv_model_weight(m, KV_W_OUT_NORM_B, 0), n, d, eps);
    const float *head = c->tied_embeddings ? wte : kv_model_weight(m, KV_W_LM_HEAD, 0);
    naive_gpt2_linear(logits, xn, head, NULL, n, V, d, 0);
    free(x), free(xn), free(q), free(k), free(v), free(o), free(a);
    return logits;
}

/* A small GPT-2 configuration (n_kv_heads == n_heads, learned positions). */
static inline struct kv_config tiny_gpt2_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPT2;
    c.dim = 48;
    c.hidden_dim = 192;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.head_dim = 12;
    c.vocab_size = 97;
    c.max_seq_len = 64;
    c.norm_eps = 1e-5f;
    c.tied_embeddings = 1;
    c.has_qkv_bias = 1;
    c.bos_id = -1;
    c.eos_id = 96;
    return c;
}

#endif
