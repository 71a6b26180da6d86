/* Naive float64 Gemma 2 forward written from the model definition, the
 * independent oracle of the gemma2 tests (no BLAS, no code shared with
 * lib/forward.c). Header-only: static functions.
 *
 * x = embed[tok] · sqrt(d) (the factor rounded to float, as HF does);
 * every RMSNorm multiplies by (off + w), off the config's norm_offset (1
 * for HF's stored weights); per layer
 *   x += post_attn_norm(attn(input_norm(x))),
 *   x += post_ffn_norm(down(gelu_tanh(gate(h)) ⊙ up(h))), h = pre_ffn_norm(x);
 * attention: scores q·k · attn_scale (0: 1/sqrt(d_h)), then cap·tanh(s/cap)
 * when attn_softcap > 0, causal, a window where the config puts one; RoPE
 * on rotate-half pairs (naive_rope.h); logits = norm(x) · embedᵀ, then
 * final_softcap·tanh(l/final_softcap). */
#ifndef KV_NAIVE_GEMMA2_H
#define KV_NAIVE_GEMMA2_H

#include <math.h>
#include <stdlib.h>

#include "model.h"
#include "naive_gelu.h"
#include "naive_rope.h"

static inline void naive_gemma2_norm(double *out, const double *x, const float *w, int64_t n,
                                     int64_t d, double eps, double off) {
    for (int64_t t = 0; t < n; t++) {
        double ss = 0;
        for (int64_t j = 0; j < d; j++) ss += x[t * d + j] * x[t * d + j];
        double r = 1.0 / sqrt(ss / (double)d + eps);
        for (int64_t j = 0; j < d; j++) out[t * d + j] = x[t * d + j] * r * (off + w[j]);
    }
}

/* out[t][r] = Σ_j W[r][j] in[t][j] */
static inline void naive_gemma2_linear(double *out, const double *in, const float *W, int64_t n,
                                       int64_t rows, int64_t cols) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < rows; r++) {
            double s = 0;
            for (int64_t j = 0; j < cols; j++) s += (double)W[r * cols + j] * in[t * cols + j];
            out[t * rows + r] = s;
        }
}

static inline double *naive_gemma2_forward(const struct kv_model *m, const int32_t *tok, int64_t n) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, h = c->n_heads, g = c->n_kv_heads, dh = c->head_dim, hid = c->hidden_dim;
    int64_t V = c->vocab_size, qd = h * dh, kd = g * dh;
    double eps = c->norm_eps, off = c->norm_offset;
    double scale = c->attn_scale > 0 ? c->attn_scale : 1.0 / sqrt((double)dh);
    double *x = calloc((size_t)(n * d), sizeof(double)), *xn = calloc((size_t)(n * d), sizeof(double));
    double *q = calloc((size_t)(n * qd), sizeof(double)), *k = calloc((size_t)(n * kd), sizeof(double));
    double *v = calloc((size_t)(n * kd), sizeof(double)), *o = calloc((size_t)(n * qd), sizeof(double));
    double *y = calloc((size_t)(n * d), sizeof(double)), *a = calloc((size_t)(n * hid), sizeof(double));
    double *b = calloc((size_t)(n * hid), sizeof(double)), *logits = calloc((size_t)(n * V), sizeof(double));
    const float *emb = kv_model_weight(m, KV_W_TOK_EMB, 0);
    double es = (double)(float)sqrt((double)d);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++) x[t * d + j] = emb[tok[t] * d + j] * es;
#define W_(kind) kv_model_weight(m, (kind), l)
    for (int64_t l = 0; l < c->n_layers; l++) {
        naive_gemma2_norm(xn, x, W_(KV_W_ATTN_NORM), n, d, eps, off);
        naive_gemma2_linear(q, xn, W_(KV_W_Q), n, qd, d);
        naive_gemma2_linear(k, xn, W_(KV_W_K), n, kd, d);
        naive_gemma2_linear(v, xn, W_(KV_W_V), n, kd, d);
        for (int p = 0; p < 2; p++) { /* rope, rotate-half pairs */
            double *buf = p ? k : q;
            int64_t nh = p ? g : h;
            for (int64_t t = 0; t < n; t++)
                for (int64_t hh = 0; hh < nh; hh++)
                    for (int64_t i = 0; i < dh / 2; i++) {
                        double ms, ang = naive_rope_angle(c, n, t, i, &ms);
                        double *e = buf + (t * nh + hh) * dh, re = e[i], im = e[i + dh / 2];
                        e[i] = (re * cos(ang) - im * sin(ang)) * ms;
                        e[i + dh / 2] = (re * sin(ang) + im * cos(ang)) * ms;
                    }
        }
        int windowed = c->sliding_window > 0 && l >= c->window_from &&
                       (l - c->window_from) % (c->window_period ? c->window_period : 1) == 0;
        double *sc = malloc((size_t)n * sizeof *sc);
        for (int64_t hh = 0; hh < h; hh++) {
            int64_t kvh = hh / (h / g);
            for (int64_t t = 0; t < n; t++) {
                double mx = -INFINITY, z = 0;
                for (int64_t s2 = 0; s2 <= t; s2++) {
                    double dot = 0;
                    for (int64_t i = 0; i < dh; i++) dot += q[(t * h + hh) * dh + i] * k[(s2 * g + kvh) * dh + i];
                    dot *= scale;
                    if (c->attn_softcap > 0) dot = c->attn_softcap * tanh(dot / c->attn_softcap);
                    sc[s2] = windowed && t - s2 >= c->sliding_window ? -INFINITY : dot;
                    if (sc[s2] > mx) mx = sc[s2];
                }
                for (int64_t s2 = 0; s2 <= t; s2++) z += sc[s2] = exp(sc[s2] - mx);
                for (int64_t i = 0; i < dh; i++) {
                    double acc = 0;
                    for (int64_t s2 = 0; s2 <= t; s2++) acc += sc[s2] / z * v[(s2 * g + kvh) * dh + i];
                    o[(t * h + hh) * dh + i] = acc;
                }
            }
        }
        free(sc);
        naive_gemma2_linear(y, o, W_(KV_W_O), n, d, qd);
        naive_gemma2_norm(y, y, W_(KV_W_POST_ATTN_NORM), n, d, eps, off);
        for (int64_t i = 0; i < n * d; i++) x[i] += y[i];
        naive_gemma2_norm(xn, x, W_(KV_W_FFN_NORM), n, d, eps, off);
        naive_gemma2_linear(a, xn, W_(KV_W_GATE), n, hid, d);
        naive_gemma2_linear(b, xn, W_(KV_W_UP), n, hid, d);
        for (int64_t i = 0; i < n * hid; i++) a[i] = naive_gelu_tanh(a[i]) * b[i];
        naive_gemma2_linear(y, a, W_(KV_W_DOWN), n, d, hid);
        naive_gemma2_norm(y, y, W_(KV_W_POST_FFN_NORM), n, d, eps, off);
        for (int64_t i = 0; i < n * d; i++) x[i] += y[i];
    }
#undef W_
    naive_gemma2_norm(xn, x, kv_model_weight(m, KV_W_OUT_NORM, 0), n, d, eps, off);
    const float *head = c->tied_embeddings ? emb : kv_model_weight(m, KV_W_LM_HEAD, 0);
    naive_gemma2_linear(logits, xn, head, n, V, d);
    if (c->final_softcap > 0)
        for (int64_t i = 0; i < n * V; i++) logits[i] = c->final_softcap * tanh(logits[i] / c->final_softcap);
    free(x), free(xn), free(q), free(k), free(v), free(o), free(y), free(a), free(b);
    return logits;
}

/* A small Gemma 2: GQA 2:1, heads wider than dim / heads, a window of 6 on
 * even layers, query_pre_attn_scalar 24 (not d_h), soft-caps 50 and 30
 * (Gemma 2's), HF's norm offset, tied head. */
static inline struct kv_config tiny_gemma2_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GEMMA2;
    c.dim = 48, c.hidden_dim = 96, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 16, c.vocab_size = 97, c.max_seq_len = 64;
    c.norm_eps = 1e-6f, c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF;
    c.sliding_window = 6, c.window_from = 0, c.window_period = 2;
    c.attn_scale = (float)(1.0 / sqrt(24.0)), c.attn_softcap = 50.0f, c.final_softcap = 30.0f;
    c.norm_offset = 1.0f, c.tied_embeddings = 1;
    c.bos_id = c.eos_id = -1;
    return c;
}

#endif
