/* Naive float64 Llama forward written from the model definition, shared by
 * the forward and perplexity suites as their independent oracle (no BLAS, no
 * code shared with lib/forward.c). Header-only: static functions. */
#ifndef KV_NAIVE_LLAMA_H
#define KV_NAIVE_LLAMA_H

#include <math.h>
#include <stdlib.h>

#include "model.h"
#include "naive_rope.h"

/* x[t] += W_down (silu(W_gate xn[t]) * W_up xn[t]) for n rows, a [hid] scratch. */
static inline void naive_swiglu_add(const float *const *w, double *x, const double *xn, double *a,
                                    int64_t n, int64_t d, int64_t hid) {
    for (int64_t t = 0; t < n; t++) {
        for (int64_t r = 0; r < hid; r++) {
            double gt = 0, up = 0;
            for (int64_t j = 0; j < d; j++) {
                gt += w[KV_W_GATE][r * d + j] * xn[t * d + j];
                up += w[KV_W_UP][r * d + j] * xn[t * d + j];
            }
            a[r] = gt / (1 + exp(-gt)) * up;
        }
        for (int64_t r = 0; r < d; r++) {
            double s = 0;
            for (int64_t j = 0; j < hid; j++) s += w[KV_W_DOWN][r * hid + j] * a[j];
            x[t * d + r] += s;
        }
    }
}

/* logits [n, vocab] = xn lm_headᵀ. */
static inline void naive_head(const struct kv_model *m, const double *xn, int64_t n, double *logits) {
    int64_t d = m->cfg.dim, V = m->cfg.vocab_size;
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < V; r++) {
            double s = 0;
            for (int64_t j = 0; j < d; j++) s += m->lm_head[r * d + j] * xn[t * d + j];
            logits[t * V + r] = s;
        }
}

/* Reference logits [n, vocab] of tokens at positions 0..n-1. */
/* RMSNorm of the n rows of x [n][d] with gain w into xn. */
static inline void naive_rmsnorm(const double *x, double *xn, const float *w, int64_t n, int64_t d,
                                 double eps) {
    for (int64_t t = 0; t < n; t++) {
        double ss = 0;
        for (int64_t j = 0; j < d; j++) ss += x[t * d + j] * x[t * d + j];
        double r = 1.0 / sqrt(ss / d + eps);
        for (int64_t j = 0; j < d; j++) xn[t * d + j] = x[t * d + j] * r * w[j];
    }
}

/* x [n][d] += o [n][k] W_oᵀ (W_o [d][k]): the attention output added to the
 * residual stream. */
static inline void naive_out_add(const float *wo, const double *o, double *x, int64_t n, int64_t d,
                                 int64_t k) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < d; r++) {
            double s = 0;
            for (int64_t j = 0; j < k; j++) s += wo[r * k + j] * o[t * k + j];
            x[t * d + r] += s;
        }
}

/* When set, naive_forward hands it each layer's queries q [n][h][dh] and
 * keys k [n][g][dh] before RoPE (an oracle's inputs for kv_mla_fit_turn). */
static void (*naive_qk_pre)(int64_t layer, const double *q, const double *k, int64_t n);

static inline double *naive_forward(const struct kv_model *m, const int32_t *tok, int64_t n) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, h = c->n_heads, g = c->n_kv_heads, dh = c->head_dim, hid = c->hidden_dim;
    int64_t V = c->vocab_size;
    double *x = calloc((size_t)(n * d), sizeof(double));
    double *xn = calloc((size_t)(n * d), sizeof(double));
    double *q = calloc((size_t)(n * h * dh), sizeof(double));
    double *k = calloc((size_t)(n * g * dh), sizeof(double));
    double *v = calloc((size_t)(n * g * dh), sizeof(double));
    double *o = calloc((size_t)(n * h * dh), sizeof(double));
    double *a = calloc((size_t)hid, sizeof(double));
    double *logits = calloc((size_t)(n * V), sizeof(double));
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++) x[t * d + j] = m->tok_emb[tok[t] * d + j];
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *w = m->layers[l].w;
        naive_rmsnorm(x, xn, w[KV_W_ATTN_NORM], n, d, c->norm_eps);
        /* projections: out[t][r] = sum_j W[r][j] xn[t][j] + b[r] */
        struct {
            double *out;
            const float *W, *b;
            int64_t rows;
        } pr[3] = {{q, w[KV_W_Q], w[KV_W_BQ], h * dh},
                   {k, w[KV_W_K], w[KV_W_BK], g * dh},
                   {v, w[KV_W_V], w[KV_W_BV], g * dh}};
        for (int p = 0; p < 3; p++)
            for (int64_t t = 0; t < n; t++)
                for (int64_t r = 0; r < pr[p].rows; r++) {
                    double s = pr[p].b ? pr[p].b[r] : 0;
                    for (int64_t j = 0; j < d; j++) s += pr[p].W[r * d + j] * xn[t * d + j];
                    pr[p].out[t * pr[p].rows + r] = s;
                }
        /* Qwen3: RMSNorm of each head of q and k with its [dh] weight */
        for (int p = 0; p < 2; p++) {
            const float *nw = w[p ? KV_W_KNORM : KV_W_QNORM];
            double *buf = p ? k : q;
            int64_t nh = p ? g : h;
            for (int64_t r = 0; nw && r < n * nh; r++) {
                double ss = 0, *e = buf + r * dh;
                for (int64_t i = 0; i < dh; i++) ss += e[i] * e[i];
                double inv = 1.0 / sqrt(ss / (double)dh + c->norm_eps);
                for (int64_t i = 0; i < dh; i++) e[i] = e[i] * inv * nw[i];
            }
        }
        if (naive_qk_pre) naive_qk_pre(l, q, k, n);
        /* rope: rotate pair (a, b) of each head by its angle (naive_rope.h) */
        for (int p = 0; p < 2; p++) {
            double *buf = p ? k : q;
            int64_t nh = p ? g : h;
            for (int64_t t = 0; t < n; t++)
                for (int64_t hh = 0; hh < nh; hh++)
                    for (int64_t i = 0; i < dh / 2; i++) {
                        int64_t ia = c->rope_layout == KV_ROPE_HALF ? i : 2 * i;
                        int64_t ib = c->rope_layout == KV_ROPE_HALF ? i + dh / 2 : 2 * i + 1;
                        double ms, ang = naive_rope_angle(c, n, t, i, &ms);
                        double *e = buf + (t * nh + hh) * dh;
                        double re = e[ia], im = e[ib];
                        e[ia] = (re * cos(ang) - im * sin(ang)) * ms;
                        e[ib] = (re * sin(ang) + im * cos(ang)) * ms;
                    }
        }
        /* causal softmax attention, query head hh reads kv head hh / (h/g);
         * a windowed layer's query t sees keys s with t - s < window */
        int windowed = c->sliding_window > 0 && l >= c->window_from &&
                       (l - c->window_from) % (c->window_period ? c->window_period : 1) == 0;
        for (int64_t hh = 0; hh < h; hh++) {
            int64_t kvh = hh / (h / g);
            for (int64_t t = 0; t < n; t++) {
                double *sc = calloc((size_t)(t + 1), sizeof(double)), mx = -INFINITY, z = 0;
                for (int64_t s = 0; s <= t; s++) {
                    double dot = 0;
                    for (int64_t i = 0; i < dh; i++)
                        dot += q[(t * h + hh) * dh + i] * k[(s * g + kvh) * dh + i];
                    sc[s] = windowed && t - s >= c->sliding_window ? -INFINITY : dot / sqrt((double)dh);
                    if (sc[s] > mx) mx = sc[s];
                }
                for (int64_t s = 0; s <= t; s++) z += sc[s] = exp(sc[s] - mx);
                for (int64_t i = 0; i < dh; i++) {
                    double acc = 0;
                    for (int64_t s = 0; s <= t; s++) acc += sc[s] / z * v[(s * g + kvh) * dh + i];
                    o[(t * h + hh) * dh + i] = acc;
                }
                free(sc);
            }
        }
        naive_out_add(w[KV_W_O], o, x, n, d, h * dh);
        naive_rmsnorm(x, xn, w[KV_W_FFN_NORM], n, d, c->norm_eps);
        naive_swiglu_add(w, x, xn, a, n, d, hid);
    }
    naive_rmsnorm(x, xn, m->out_norm, n, d, c->norm_eps);
    naive_head(m, xn, n, logits);
    free(x), free(xn), free(q), free(k), free(v), free(o), free(a);
    return logits;
}

static inline struct kv_config tiny_cfg(enum kv_rope_layout layout, int bias, int tied) {
    struct kv_config c = {0};
    c.dim = 48;
    c.hidden_dim = 80;
    c.n_layers = 2;
    c.n_heads = 6;
    c.n_kv_heads = 2;
    c.head_dim = 8;
    c.vocab_size = 97;
    c.max_seq_len = 64;
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.rope_layout = layout;
    c.has_qkv_bias = bias;
    c.tied_embeddings = tied;
    c.bos_id = 1;
    c.eos_id = 2;
    return c;
}

/* Random weights are N(0, 0.02); scale them up so attention is not uniform
 * and errors in RoPE or masking show in the logits. */
static inline void sharpen(struct kv_model *m) {
    const struct kv_config *c = &m->cfg;
    int64_t qd = c->n_heads * c->head_dim * c->dim, kd = c->n_kv_heads * c->head_dim * c->dim;
    for (int64_t l = 0; l < c->n_layers; l++) {
        float *wq = (float *)m->layers[l].w[KV_W_Q], *wk = (float *)m->layers[l].w[KV_W_K];
        for (int64_t i = 0; i < qd; i++) wq[i] *= 20;
        for (int64_t i = 0; i < kd; i++) wk[i] *= 20;
        /* Qwen3's per-head norms: uneven gains, large enough for sharp scores */
        for (int k = KV_W_QNORM; k <= KV_W_KNORM; k++) {
            float *nw = (float *)m->layers[l].w[k];
            for (int64_t i = 0; nw && i < c->head_dim; i++) nw[i] = 0.5f + 0.4f * (float)((i * 5 + k + l) % 7);
        }
    }
}

#endif
