/* Naive float64 forward of a model rewritten as DeepSeek-V2 multi-head
 * latent attention (struct kv_mla): what llama.cpp's deepseek2 graph
 * computes, written from its definition (docs/design.md, "Export as
 * Multi-head Latent Attention"), with the latent's RMSNorm as the engine
 * applies it (not linearised). No BLAS, nothing shared with calib/mla.c.
 * Header-only. */
#ifndef KV_NAIVE_MLA_H
#define KV_NAIVE_MLA_H

#include <math.h>
#include <stdlib.h>

#include "mlamodel.h"
#include "model.h"
#include "naive_llama.h"

/* Logits [n, vocab] of tokens at positions 0..n-1 of m's embedding, norms,
 * FFN and head with mla's attention. */
static inline double *naive_mla_forward(const struct kv_model *m, const struct kv_mla *mla,
                                        const int32_t *tok, int64_t n) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, H = mla->n_heads, dc = mla->kv_lora_rank, R = mla->rope_dim;
    int64_t nn = mla->nope_dim, vd = mla->v_dim, hid = c->hidden_dim, V = c->vocab_size, qw = nn + R;
    double *x = calloc((size_t)(n * d), sizeof(double)), *xn = calloc((size_t)(n * d), sizeof(double));
    double *q = calloc((size_t)(n * H * qw), sizeof(double)), *kv = calloc((size_t)(n * (dc + R)), sizeof(double));
    double *knope = calloc((size_t)(n * H * nn), sizeof(double)), *val = calloc((size_t)(n * H * vd), sizeof(double));
    double *o = calloc((size_t)(n * H * vd), sizeof(double)), *a = calloc((size_t)hid, sizeof(double));
    double *logits = calloc((size_t)(n * V), sizeof(double));
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++) x[t * d + j] = m->tok_emb[tok[t] * d + j];
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *w = m->layers[l].w;
        const struct kv_mla_layer *y = &mla->layers[l];
        naive_rmsnorm(x, xn, w[KV_W_ATTN_NORM], n, d, c->norm_eps);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t r = 0; r < H * qw; r++) {
                double s = 0;
                for (int64_t j = 0; j < d; j++) s += y->wq[r * d + j] * xn[t * d + j];
                q[t * H * qw + r] = s;
            }
            double *e = kv + t * (dc + R);
            for (int64_t r = 0; r < dc + R; r++) {
                double s = 0;
                for (int64_t j = 0; j < d; j++) s += y->wkv_a[r * d + j] * xn[t * d + j];
                e[r] = s;
            }
            /* the latent's RMSNorm, as the engine applies it */
            double ss = 0;
            for (int64_t r = 0; r < dc; r++) ss += e[r] * e[r];
            double inv = 1.0 / sqrt(ss / (double)dc + (double)mla->latent_eps);
            for (int64_t r = 0; r < dc; r++) e[r] = e[r] * inv * y->kv_norm[r];
            /* RoPE (pairs 2i, 2i+1, base rope_base over R) on k^pe and each q^pe */
            for (int64_t i = 0; i < R / 2; i++) {
                double ang = (double)t * pow((double)mla->rope_base, -2.0 * (double)i / (double)R);
                double cs = cos(ang), sn = sin(ang);
                double *pk = e + dc + 2 * i, r0 = pk[0], r1 = pk[1];
                pk[0] = r0 * cs - r1 * sn, pk[1] = r0 * sn + r1 * cs;
                for (int64_t h = 0; h < H; h++) {
                    double *pq = q + t * H * qw + h * qw + nn + 2 * i, q0 = pq[0], q1 = pq[1];
                    pq[0] = q0 * cs - q1 * sn, pq[1] = q0 * sn + q1 * cs;
                }
            }
            /* each head's k^nope = W_UK,h c and value W_UV,h c */
            for (int64_t h = 0; h < H; h++) {
                for (int64_t j = 0; j < nn; j++) {
                    double s = 0;
                    for (int64_t r = 0; r < dc; r++) s += (double)y->wk_b[(h * dc + r) * nn + j] * e[r];
                    knope[(t * H + h) * nn + j] = s;
                }
                for (int64_t j = 0; j < vd; j++) {
                    double s = 0;
                    for (int64_t r = 0; r < dc; r++) s += (double)y->wv_b[(h * vd + j) * dc + r] * e[r];
                    val[(t * H + h) * vd + j] = s;
                }
            }
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < n; t++) {
                double *sc = calloc((size_t)(t + 1), sizeof(double)), mx = -INFINITY, z = 0;
                const double *qt = q + t * H * qw + h * qw;
                for (int64_t s = 0; s <= t; s++) {
                    double dot = 0;
                    for (int64_t j = 0; j < nn; j++) dot += qt[j] * knope[(s * H + h) * nn + j];
                    for (int64_t j = 0; j < R; j++) dot += qt[nn + j] * kv[s * (dc + R) + dc + j];
                    sc[s] = dot / sqrt((double)qw);
                    if (sc[s] > mx) mx = sc[s];
                }
                for (int64_t s = 0; s <= t; s++) z += sc[s] = exp(sc[s] - mx);
                for (int64_t j = 0; j < vd; j++) {
                    double acc = 0;
                    for (int64_t s = 0; s <= t; s++) acc += sc[s] / z * val[(s * H + h) * vd + j];
                    o[(t * H + h) * vd + j] = acc;
                }
                free(sc);
            }
        naive_out_add(w[KV_W_O], o, x, n, d, H * vd);
        naive_rmsnorm(x, xn, w[KV_W_FFN_NORM], n, d, c->norm_eps);
        naive_swiglu_add(w, x, xn, a, n, d, hid);
    }
    naive_rmsnorm(x, xn, m->out_norm, n, d, c->norm_eps);
    naive_head(m, xn, n, logits);
    free(x), free(xn), free(q), free(kv), free(knope), free(val), free(o), free(a);
    return logits;
}

#endif
