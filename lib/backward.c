/* Training forward and backward pass for the Llama and GPT-2 families.
 *
 * The forward keeps every activation of one window (positions 0..n-1) and
 * the backward walks the layers in reverse, writing the gradient of the mean
 * next-token cross-entropy with respect to every weight. All matrix products
 * are OpenBLAS sgemm; row reductions (norms, softmax) accumulate in double.
 *
 * Shapes (row-major, n tokens): x [n, d]; q, att [n, h*d_h]; k, v [n, g*d_h];
 * probabilities P [h, n, n] (row i is query position i, zero above the
 * diagonal); ffn a, b, act [n, hidden]; logits [n, vocab].
 *
 * Linear y = x Wᵀ + b with W [out, in] has dW += dyᵀ x, dx += dy W and
 * db += Σ_rows dy. RoPE is a rotation per pair, so its backward rotates by
 * the opposite angle. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backward.h"
#include "act.h"
#include "arch.h"
#include "err.h"
#include "limits.h"
#include "model.h"

struct gtensor {
    enum kv_wkind kind;
    int64_t layer;  /* -1 for globals */
    int64_t count;
    float *grad;    /* into g->gbuf */
    char name[48];
};

struct glayer { /* saved activations of one layer */
    float *x_in, *xn1, *mu1, *rs1; /* residual input, normed input, norm stats [n] */
    float *q, *k, *v;              /* post-RoPE q, k; v */
    float *P;                      /* [h, n, n] */
    float *att;                    /* [n, h*d_h] attention output before W_o */
    float *x_mid, *xn2, *mu2, *rs2;
    float *a, *b, *act;            /* ffn pre-activations and activation [n, hidden] */
    float *gk, *gv;                /* ∂L/∂k, ∂L/∂v before RoPE [n, g*d_h] */
    /* Gemma 2: attention's and the MLP's outputs before their norms, with
     * those norms' row stats, and tanh(s / cap) of the capped scores
     * [h, n, n]; NULL without */
    float *pa_in, *pa_mu, *pa_rs, *pf_in, *pf_mu, *pf_rs, *T;
    /* per-head q/k norm (Qwen3): the projections before it and its row
     * stats [n*h], [n*g]; NULL without */
    float *qraw, *kraw, *qmu, *qrs, *kmu, *krs;
};

struct kv_grad {
    const struct kv_model *m;
    int64_t max_n, n;
    struct glayer *ly;
    float *xf, *xnf, *muf, *rsf, *logits;
    float *rope_cos, *rope_sin;   /* [max_n][d_h/2] */
    /* backward scratch */
    float *dx, *dxn, *dq, *dk, *dv, *datt, *dh, *da, *db, *dP; /* dP: [threads][n][n] */
    float *dqr, *dkr;             /* per-head norm inputs' gradients (Qwen3), or NULL */
    float *dxo;                   /* ∂L/∂ the layer's output (parallel residual), or NULL */
    float *dpost;                 /* ∂L/∂ a post-norm's input (Gemma 2), or NULL */
    float *gbuf;                  /* every gradient, contiguous */
    int64_t n_gbuf;
    struct gtensor *t;
    int64_t n_t;
    int n_threads;
};

static float *falloc(int64_t n) { return malloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }

void kv_grad_free(struct kv_grad *g) {
    if (!g) return;
    if (g->ly)
        for (int64_t l = 0; l < g->m->cfg.n_layers; l++) {
            struct glayer *y = &g->ly[l];
            float *p[] = {y->x_in, y->xn1, y->mu1, y->rs1, y->q,    y->k,   y->v,
                          y->P,    y->att, y->x_mid, y->xn2, y->mu2, y->rs2, y->a,
                          y->b,    y->act, y->gk,    y->gv,  y->qraw, y->kraw, y->qmu,
                          y->qrs,  y->kmu, y->krs, y->pa_in, y->pa_mu, y->pa_rs, y->pf_in,
                          y->pf_mu, y->pf_rs, y->T};
            for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
        }
    free(g->ly);
    float *p[] = {g->xf, g->xnf, g->muf, g->rsf, g->logits, g->rope_cos, g->rope_sin, g->dx,
                  g->dxn, g->dq, g->dk, g->dv, g->datt, g->dh, g->da, g->db, g->dP, g->gbuf,
                  g->dqr, g->dkr, g->dxo, g->dpost};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
    free(g->t);
    free(g);
}

int kv_grad_init(const struct kv_model *m, int64_t max_n, struct kv_grad **out,
                 struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    int64_t lim = kv_arch_desc(c->arch)->rope ? KV_MAX_CTX : c->max_seq_len;
    if (max_n <= 0 || max_n > lim)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "window of %lld tokens is outside 1..%lld",
                       (long long)max_n, (long long)lim);
    if (kv_arch_desc(c->arch)->rope) {
        int rc = kv_rope_check_length(c, max_n, err);
        if (rc) return rc;
    }
    struct kv_grad *g = calloc(1, sizeof *g);
    if (!g) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    g->m = m, g->max_n = max_n;
    g->n_threads = omp_get_max_threads();
    int64_t n = max_n, d = c->dim, h = c->n_heads, dh = c->head_dim, hid = c->hidden_dim;
    int64_t qd = h * dh, kd = c->n_kv_heads * dh, L = c->n_layers;
    int ok = (g->ly = calloc((size_t)L, sizeof *g->ly)) != NULL;
    for (int64_t l = 0; ok && l < L; l++) {
        struct glayer *y = &g->ly[l];
        y->x_in = falloc(n * d), y->xn1 = falloc(n * d), y->mu1 = falloc(n), y->rs1 = falloc(n);
        y->q = falloc(n * qd), y->k = falloc(n * kd), y->v = falloc(n * kd);
        y->P = falloc(h * n * n), y->att = falloc(n * qd);
        y->x_mid = falloc(n * d), y->xn2 = falloc(n * d), y->mu2 = falloc(n), y->rs2 = falloc(n);
        y->a = falloc(n * hid), y->b = falloc(n * hid), y->act = falloc(n * hid);
        y->gk = falloc(n * kd), y->gv = falloc(n * kd);
        ok = y->x_in && y->xn1 && y->mu1 && y->rs1 && y->q && y->k && y->v && y->P && y->att &&
             y->x_mid && y->xn2 && y->mu2 && y->rs2 && y->a && y->b && y->act && y->gk && y->gv;
        if (ok && kv_arch_desc(c->arch)->post_norms) {
            y->pa_in = falloc(n * d), y->pa_mu = falloc(n), y->pa_rs = falloc(n);
            y->pf_in = falloc(n * d), y->pf_mu = falloc(n), y->pf_rs = falloc(n);
            ok = y->pa_in && y->pa_mu && y->pa_rs && y->pf_in && y->pf_mu && y->pf_rs;
        }
        if (ok && c->attn_softcap > 0) ok = (y->T = falloc(h * n * n)) != NULL;
        if (ok && kv_arch_desc(c->arch)->qk_norm) {
            y->qraw = falloc(n * qd), y->kraw = falloc(n * kd);
            y->qmu = falloc(n * h), y->qrs = falloc(n * h);
            y->kmu = falloc(n * c->n_kv_heads), y->krs = falloc(n * c->n_kv_heads);
            ok = y->qraw && y->kraw && y->qmu && y->qrs && y->kmu && y->krs;
        }
    }
    if (ok) {
        g->xf = falloc(n * d), g->xnf = falloc(n * d), g->muf = falloc(n), g->rsf = falloc(n);
        g->logits = falloc(n * c->vocab_size);
        g->rope_cos = falloc(n * (dh / 2 + 1)), g->rope_sin = falloc(n * (dh / 2 + 1));
        g->dx = falloc(n * d), g->dxn = falloc(n * d), g->dq = falloc(n * qd);
        g->dk = falloc(n * kd), g->dv = falloc(n * kd), g->datt = falloc(n * qd);
        g->dh = falloc(n * hid), g->da = falloc(n * hid), g->db = falloc(n * hid);
        g->dP = falloc((int64_t)g->n_threads * n * n);
        ok = g->xf && g->xnf && g->muf && g->rsf && g->logits && g->rope_cos && g->rope_sin &&
             g->dx && g->dxn && g->dq && g->dk && g->dv && g->datt && g->dh && g->da && g->db &&
             g->dP;
        if (ok && kv_arch_desc(c->arch)->qk_norm)
            ok = (g->dqr = falloc(n * qd)) != NULL && (g->dkr = falloc(n * kd)) != NULL;
        if (ok && c->parallel_residual) ok = (g->dxo = falloc(n * d)) != NULL;
        if (ok && kv_arch_desc(c->arch)->post_norms) ok = (g->dpost = falloc(n * d)) != NULL;
    }
    /* the parameter table: every bound weight, globals first */
    int64_t cap = KV_W_FIRST_LAYER + L * (KV_W_COUNT - KV_W_FIRST_LAYER);
    if (ok) ok = (g->t = calloc((size_t)cap, sizeof *g->t)) != NULL;
    for (int k = 0; ok && k < KV_W_COUNT; k++) {
        int64_t nl = k < KV_W_FIRST_LAYER ? 1 : L;
        for (int64_t l = 0; l < nl; l++) {
            if (k == KV_W_LM_HEAD && c->tied_embeddings) continue;
            if (!kv_model_has(m, k, l)) continue;
            int64_t s[2];
            int nd = kv_model_expected_shape(c, k, s);
            struct gtensor *t = &g->t[g->n_t++];
            t->kind = k, t->layer = k < KV_W_FIRST_LAYER ? -1 : l;
            t->count = nd == 2 ? s[0] * s[1] : s[0];
            if (t->layer < 0)
                snprintf(t->name, sizeof t->name, "%s", kv_wkind_name(k));
            else
                snprintf(t->name, sizeof t->name, "blk.%lld.%s", (long long)l, kv_wkind_name(k));
            g->n_gbuf += t->count;
        }
    }
    if (ok) ok = (g->gbuf = falloc(g->n_gbuf)) != NULL;
    if (!ok) {
        kv_grad_free(g);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory for the activations of a %lld-token window", (long long)n);
    }
    int64_t off = 0;
    for (int64_t i = 0; i < g->n_t; i++) g->t[i].grad = g->gbuf + off, off += g->t[i].count;
    if (kv_arch_desc(c->arch)->rope) /* the same angles as the inference forward */
        kv_rope_table(c, n, n, g->rope_cos, g->rope_sin);
    *out = g;
    return KV_OK;
}

int64_t kv_grad_n_tensors(const struct kv_grad *g) { return g->n_t; }

const char *kv_grad_tensor(const struct kv_grad *g, int64_t i, int64_t *count,
                           const float **weight, const float **grad) {
    if (i < 0 || i >= g->n_t) return NULL;
    const struct gtensor *t = &g->t[i];
    if (count) *count = t->count;
    if (weight) *weight = kv_model_weight(g->m, t->kind, t->layer);
    if (grad) *grad = t->grad;
    return t->name;
}

enum kv_wkind kv_grad_tensor_kind(const struct kv_grad *g, int64_t i, int64_t *layer) {
    KV_ASSERT(i >= 0 && i < g->n_t);
    if (layer) *layer = g->t[i].layer;
    return g->t[i].kind;
}

float *kv_grad_of(const struct kv_grad *g, enum kv_wkind kind, int64_t layer) {
    if (kind == KV_W_LM_HEAD && g->m->cfg.tied_embeddings) kind = KV_W_TOK_EMB;
    for (int64_t i = 0; i < g->n_t; i++)
        if (g->t[i].kind == kind && (kind < KV_W_FIRST_LAYER || g->t[i].layer == layer))
            return g->t[i].grad;
    return NULL;
}

const float *kv_grad_k(const struct kv_grad *g, int64_t layer) {
    return layer >= 0 && layer < g->m->cfg.n_layers ? g->ly[layer].gk : NULL;
}
const float *kv_grad_v(const struct kv_grad *g, int64_t layer) {
    return layer >= 0 && layer < g->m->cfg.n_layers ? g->ly[layer].gv : NULL;
}

/* ---------------------------------------------------------------- building blocks */

/* y [n, outd] = x [n, in] Wᵀ (+ bias) */
static void lin_fwd(float *y, const float *x, const float *w, const float *bias, int64_t n,
                    int64_t in, int64_t outd) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)outd, (int)in, 1.0f, x,
                (int)in, w, (int)in, 0.0f, y, (int)outd);
    if (bias)
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < outd; j++) y[i * outd + j] += bias[j];
}

/* dW += dyᵀ x; db += Σ dy; dx = dy W (+ dx when accum). Any of dW, db, dx may be NULL. */
static void lin_bwd(const float *dy, const float *x, const float *w, int64_t n, int64_t in,
                    int64_t outd, float *dw, float *db, float *dx, int accum) {
    if (dw)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)outd, (int)in, (int)n, 1.0f, dy,
                    (int)outd, x, (int)in, 1.0f, dw, (int)in);
    if (db)
        for (int64_t j = 0; j < outd; j++) {
            double s = 0;
            for (int64_t i = 0; i < n; i++) s += dy[i * outd + j];
            db[j] += (float)s;
        }
    if (dx)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)in, (int)outd, 1.0f,
                    dy, (int)outd, w, (int)in, accum ? 1.0f : 0.0f, dx, (int)in);
}

/* RMSNorm (bias NULL, mu unused) or LayerNorm of rows x [n, d] into y; saves
 * the per-row mean (LayerNorm) and reciprocal deviation. */
static void norm_fwd(const struct kv_config *c, float *y, float *mu, float *rs, const float *x,
                     const float *w, const float *bias, int64_t n, int64_t d, float off) {
    int ln = kv_arch_desc(c->arch)->layernorm;
#pragma omp parallel for if (n * d > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d;
        double m = 0, ss = 0;
        if (ln) {
            for (int64_t j = 0; j < d; j++) m += xi[j];
            m /= (double)d;
        }
        for (int64_t j = 0; j < d; j++) ss += ((double)xi[j] - m) * ((double)xi[j] - m);
        float r = (float)(1.0 / sqrt(ss / (double)d + (double)c->norm_eps));
        mu[i] = (float)m, rs[i] = r;
        float *o = y + i * d;
        for (int64_t j = 0; j < d; j++)
            o[j] = ((xi[j] - (float)m) * r) * (off + w[j]) + (bias ? bias[j] : 0.0f);
    }
}

/* Backward of norm_fwd (gain off + w): dx += ∂/∂x, dw += Σ dy x̂, db += Σ dy. */
static void norm_bwd(const struct kv_config *c, const float *dy, const float *x, const float *mu,
                     const float *rs, const float *w, int64_t n, int64_t d, float *dx, float *dw,
                     float *db, float off) {
    int ln = kv_arch_desc(c->arch)->layernorm;
#pragma omp parallel for if (n * d > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d, *gi = dy + i * d;
        double r = rs[i], m = ln ? mu[i] : 0.0, s1 = 0, s2 = 0;
        for (int64_t j = 0; j < d; j++) {
            double gw = (double)gi[j] * (off + w[j]), xh = ((double)xi[j] - m) * r;
            s1 += gw, s2 += gw * xh;
        }
        s1 /= (double)d, s2 /= (double)d;
        float *o = dx + i * d;
        for (int64_t j = 0; j < d; j++) {
            double gw = (double)gi[j] * (off + w[j]), xh = ((double)xi[j] - m) * r;
            o[j] += (float)(r * (gw - (ln ? s1 : 0.0) - xh * s2));
        }
    }
    for (int64_t j = 0; j < d; j++) {
        double sw = 0, sb = 0;
        for (int64_t i = 0; i < n; i++) {
            double xh = ((double)x[i * d + j] - (ln ? mu[i] : 0.0)) * rs[i];
            sw += (double)dy[i * d + j] * xh, sb += dy[i * d + j];
        }
        dw[j] += (float)sw;
        if (db) db[j] += (float)sb;
    }
}

/* Rotate (sign +1) or un-rotate (sign -1) every head of rows [n, nh*d_h]. */
static void rope_apply(const struct kv_grad *g, float *v, int64_t n, int64_t nh, float sign) {
    const struct kv_config *c = &g->m->cfg;
    int64_t dh = c->head_dim, half = kv_rope_dim(c) / 2; /* partial rope: the first dims */
    int il = c->rope_layout == KV_ROPE_INTERLEAVED;
    for (int64_t i = 0; i < n; i++) {
        const float *cs = g->rope_cos + i * half, *sn = g->rope_sin + i * half;
        for (int64_t hh = 0; hh < nh; hh++) {
            float *p = v + (i * nh + hh) * dh;
            for (int64_t j = 0; j < half; j++) {
                int64_t a = il ? 2 * j : j, b = il ? 2 * j + 1 : j + half;
                float x0 = p[a], x1 = p[b], s = sign * sn[j];
                p[a] = x0 * cs[j] - x1 * s;
                p[b] = x0 * s + x1 * cs[j];
            }
        }
    }
}


/* ---------------------------------------------------------------- forward */

static int forward(struct kv_grad *g, const int32_t *tok, int64_t n, double *loss,
                   struct kv_err *err) {
    const struct kv_model *m = g->m;
    const struct kv_config *c = &m->cfg;
    if (n <= 0 || n > g->max_n)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "window of %lld tokens is outside 1..%lld", (long long)n,
                       (long long)g->max_n);
    for (int64_t i = 0; i <= n; i++)
        if (tok[i] < 0 || tok[i] >= c->vocab_size)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "token id %d at position %lld is outside the vocabulary of %lld", tok[i],
                           (long long)i, (long long)c->vocab_size);
    g->n = n;
    const struct kv_arch_desc *arch = kv_arch_desc(c->arch);
    int64_t d = c->dim, h = c->n_heads, dh = c->head_dim, hid = c->hidden_dim, V = c->vocab_size;
    int64_t qd = h * dh, kd = c->n_kv_heads * dh, grp = h / c->n_kv_heads;
    float scale = kv_attn_scale(c), cap = c->attn_softcap, off = c->norm_offset;
    float es = arch->embed_scale ? (float)sqrt((double)d) : 1.0f; /* Gemma: sqrt(d) */
    float *x = g->dx; /* the running residual (dx is free during the forward) */
    /* a streamed model's embedding is converted once here (the backward needs all of it) */
    const float *emb = kv_model_weight(m, KV_W_TOK_EMB, 0), *pos = kv_model_weight(m, KV_W_POS_EMB, 0);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < d; j++)
            x[i * d + j] =
                emb[(int64_t)tok[i] * d + j] * es + (pos ? pos[i * d + j] : 0.0f);
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *w = kv_model_layer(m, l);
        struct glayer *y = &g->ly[l];
        memcpy(y->x_in, x, (size_t)(n * d) * sizeof(float));
        norm_fwd(c, y->xn1, y->mu1, y->rs1, x, w[KV_W_ATTN_NORM], w[KV_W_ATTN_NORM_B], n, d, off);
        if (c->parallel_residual) { /* the MLP reads the layer's input */
            memcpy(y->x_mid, x, (size_t)(n * d) * sizeof(float));
            norm_fwd(c, y->xn2, y->mu2, y->rs2, x, w[KV_W_FFN_NORM], w[KV_W_FFN_NORM_B], n, d, off);
        }
        lin_fwd(y->q, y->xn1, w[KV_W_Q], w[KV_W_BQ], n, d, qd);
        lin_fwd(y->k, y->xn1, w[KV_W_K], w[KV_W_BK], n, d, kd);
        lin_fwd(y->v, y->xn1, w[KV_W_V], w[KV_W_BV], n, d, kd);
        if (arch->qk_norm) { /* per-head RMSNorm of q and k, before RoPE */
            memcpy(y->qraw, y->q, (size_t)(n * qd) * sizeof(float));
            memcpy(y->kraw, y->k, (size_t)(n * kd) * sizeof(float));
            norm_fwd(c, y->q, y->qmu, y->qrs, y->qraw, w[KV_W_QNORM], NULL, n * h, dh, 0.0f);
            norm_fwd(c, y->k, y->kmu, y->krs, y->kraw, w[KV_W_KNORM], NULL, n * c->n_kv_heads, dh, 0.0f);
        }
        if (arch->rope) {
            rope_apply(g, y->q, n, h, 1.0f);
            rope_apply(g, y->k, n, c->n_kv_heads, 1.0f);
        }
        int64_t win = kv_layer_window(c, l); /* the backward needs no mask: P is 0 there */
#pragma omp parallel for schedule(dynamic)
        for (int64_t hh = 0; hh < h; hh++) {
            float *P = y->P + hh * n * n;
            const float *K = y->k + (hh / grp) * dh, *Vv = y->v + (hh / grp) * dh;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)dh, scale,
                        y->q + hh * dh, (int)qd, K, (int)kd, 0.0f, P, (int)n);
            for (int64_t i = 0; i < n; i++) {
                int64_t lo = win > 0 && i + 1 > win ? i + 1 - win : 0;
                float *s = P + i * n;
                if (cap > 0) { /* Gemma 2: s = cap · tanh(s / cap), tanh kept for the backward */
                    float *t = y->T + hh * n * n + i * n;
                    for (int64_t j = 0; j < n; j++) t[j] = 0.0f;
                    for (int64_t j = lo; j <= i; j++) t[j] = tanhf(s[j] / cap), s[j] = cap * t[j];
                }
                float mx = s[lo];
                for (int64_t j = lo + 1; j <= i; j++) mx = s[j] > mx ? s[j] : mx;
                double sum = 0;
                for (int64_t j = lo; j <= i; j++) sum += (s[j] = expf(s[j] - mx));
                float inv = (float)(1.0 / sum);
                for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
                for (int64_t j = lo; j <= i; j++) s[j] *= inv;
                for (int64_t j = i + 1; j < n; j++) s[j] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)dh, (int)n, 1.0f,
                        P, (int)n, Vv, (int)kd, 0.0f, y->att + hh * dh, (int)qd);
        }
        /* x += att W_oᵀ + b_o (Gemma 2: x += norm(att W_oᵀ)) */
        if (arch->post_norms) {
            lin_fwd(y->pa_in, y->att, w[KV_W_O], NULL, n, qd, d);
            norm_fwd(c, g->dxn, y->pa_mu, y->pa_rs, y->pa_in, w[KV_W_POST_ATTN_NORM], NULL, n, d, off);
            for (int64_t i = 0; i < n * d; i++) x[i] += g->dxn[i];
        } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)d, (int)qd, 1.0f,
                        y->att, (int)qd, w[KV_W_O], (int)qd, 1.0f, x, (int)d);
        }
        if (w[KV_W_BO])
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < d; j++) x[i * d + j] += w[KV_W_BO][j];
        if (!c->parallel_residual) {
            memcpy(y->x_mid, x, (size_t)(n * d) * sizeof(float));
            norm_fwd(c, y->xn2, y->mu2, y->rs2, x, w[KV_W_FFN_NORM], w[KV_W_FFN_NORM_B], n, d, off);
        }
        int64_t nh = n * hid;
        if (arch->gelu_mlp) {
            lin_fwd(y->a, y->xn2, w[KV_W_UP], w[KV_W_BUP], n, d, hid);
            int erf_gelu = c->gelu_erf;
#pragma omp parallel for if (nh > 65536) schedule(static)
            for (int64_t i = 0; i < nh; i++) {
                float a = y->a[i];
                y->act[i] = erf_gelu ? kv_gelu_erf(a) : kv_gelu_tanh(a);
            }
        } else {
            lin_fwd(y->a, y->xn2, w[KV_W_GATE], NULL, n, d, hid);
            lin_fwd(y->b, y->xn2, w[KV_W_UP], NULL, n, d, hid);
            int geglu = arch->geglu;
#pragma omp parallel for if (nh > 65536) schedule(static)
            for (int64_t i = 0; i < nh; i++) {
                float a = y->a[i];
                y->act[i] = (geglu ? kv_gelu_tanh(a) : kv_silu(a)) * y->b[i];
            }
        }
        if (arch->post_norms) { /* Gemma 2: x += norm(act W_downᵀ) */
            lin_fwd(y->pf_in, y->act, w[KV_W_DOWN], NULL, n, hid, d);
            norm_fwd(c, g->dxn, y->pf_mu, y->pf_rs, y->pf_in, w[KV_W_POST_FFN_NORM], NULL, n, d, off);
            for (int64_t i = 0; i < n * d; i++) x[i] += g->dxn[i];
        } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)d, (int)hid, 1.0f,
                        y->act, (int)hid, w[KV_W_DOWN], (int)hid, 1.0f, x, (int)d);
        }
        if (w[KV_W_BDOWN])
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < d; j++) x[i * d + j] += w[KV_W_BDOWN][j];
    }
    memcpy(g->xf, x, (size_t)(n * d) * sizeof(float));
    norm_fwd(c, g->xnf, g->muf, g->rsf, x, kv_model_weight(m, KV_W_OUT_NORM, 0),
             kv_model_weight(m, KV_W_OUT_NORM_B, 0), n, d, off);
    lin_fwd(g->logits, g->xnf, kv_model_weight(m, KV_W_LM_HEAD, 0), NULL, n, d, V);
    if (c->final_softcap > 0) /* Gemma 2: cap · tanh(logit / cap) */
        for (int64_t i = 0; i < n * V; i++)
            g->logits[i] = c->final_softcap * tanhf(g->logits[i] / c->final_softcap);
    double nll = 0;
    for (int64_t i = 0; i < n; i++) nll += kv_nll_row(g->logits + i * V, V, tok[i + 1]);
    *loss = nll / (double)n;
    if (!isfinite(*loss))
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET, "the window's loss is %s",
                       isnan(*loss) ? "nan" : "inf");
    return KV_OK;
}

int kv_grad_loss(struct kv_grad *g, const int32_t *tokens, int64_t n, double *loss,
                 struct kv_err *err) {
    return forward(g, tokens, n, loss, err);
}

/* ---------------------------------------------------------------- backward */

/* Attention backward of one layer: datt [n, h*d_h] → dq, dk, dv (post-RoPE). */
static void attn_bwd(struct kv_grad *g, const struct glayer *y, int64_t n) {
    const struct kv_config *c = &g->m->cfg;
    int64_t h = c->n_heads, gk = c->n_kv_heads, dh = c->head_dim, grp = h / gk;
    int64_t qd = h * dh, kd = gk * dh;
    float scale = kv_attn_scale(c);
    memset(g->dk, 0, (size_t)(n * kd) * sizeof(float));
    memset(g->dv, 0, (size_t)(n * kd) * sizeof(float));
    int nt = omp_get_max_threads() < g->n_threads ? omp_get_max_threads() : g->n_threads;
    /* one KV head per task: its query heads write only its dk, dv columns */
#pragma omp parallel for schedule(dynamic) num_threads(nt)
    for (int64_t j = 0; j < gk; j++) {
        float *dP = g->dP + (int64_t)omp_get_thread_num() * n * n;
        const float *K = y->k + j * dh, *Vv = y->v + j * dh;
        for (int64_t hh = j * grp; hh < (j + 1) * grp; hh++) {
            const float *P = y->P + hh * n * n, *dO = g->datt + hh * dh;
            /* dP = dO Vᵀ; dV += Pᵀ dO */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)dh, 1.0f, dO,
                        (int)qd, Vv, (int)kd, 0.0f, dP, (int)n);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)dh, (int)n, 1.0f, P,
                        (int)n, dO, (int)qd, 1.0f, g->dv + j * dh, (int)kd);
            /* dS = P ∘ (dP − Σ_j dP∘P) */
            for (int64_t i = 0; i < n; i++) {
                const float *p = P + i * n;
                float *s = dP + i * n;
                double dot = 0;
                for (int64_t t = 0; t <= i; t++) dot += (double)p[t] * s[t];
                for (int64_t t = 0; t <= i; t++) s[t] = p[t] * (s[t] - (float)dot);
                for (int64_t t = i + 1; t < n; t++) s[t] = 0.0f;
                if (y->T) { /* through the soft-cap: d(cap tanh(z/cap))/dz = 1 − tanh² */
                    const float *tt = y->T + hh * n * n + i * n;
                    for (int64_t t = 0; t <= i; t++) s[t] *= 1.0f - tt[t] * tt[t];
                }
            }
            /* dQ = scale dS K; dK += scale dSᵀ Q */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)dh, (int)n, scale,
                        dP, (int)n, K, (int)kd, 0.0f, g->dq + hh * dh, (int)qd);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)dh, (int)n, scale,
                        dP, (int)n, y->q + hh * dh, (int)qd, 1.0f, g->dk + j * dh, (int)kd);
        }
    }
}

int kv_grad_run(struct kv_grad *g, const int32_t *tok, int64_t n, double *loss,
                struct kv_err *err) {
    int rc = forward(g, tok, n, loss, err);
    if (rc) return rc;
    const struct kv_model *m = g->m;
    const struct kv_config *c = &m->cfg;
    const struct kv_arch_desc *arch = kv_arch_desc(c->arch);
    int64_t d = c->dim, h = c->n_heads, dh = c->head_dim, hid = c->hidden_dim, V = c->vocab_size;
    int64_t qd = h * dh, kd = c->n_kv_heads * dh;
    float off = c->norm_offset, es = arch->embed_scale ? (float)sqrt((double)d) : 1.0f;
    memset(g->gbuf, 0, (size_t)g->n_gbuf * sizeof(float));

    /* dlogits = (softmax − onehot) / n, in place */
    float *dl = g->logits;
#pragma omp parallel for if (n * V > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *r = dl + i * V, mx = r[0], cap = c->final_softcap;
        for (int64_t j = 1; j < V; j++) mx = r[j] > mx ? r[j] : mx;
        double s = 0;
        for (int64_t j = 0; j < V; j++) s += exp((double)r[j] - mx);
        for (int64_t j = 0; j < V; j++) {
            double gj = exp((double)r[j] - mx) / s / (double)n - (j == tok[i + 1] ? 1.0 / (double)n : 0.0);
            if (cap > 0) gj *= 1.0 - ((double)r[j] / cap) * ((double)r[j] / cap); /* r is capped */
            r[j] = (float)gj;
        }
    }
    float *dhead = kv_grad_of(g, KV_W_LM_HEAD, 0);
    lin_bwd(dl, g->xnf, kv_model_weight(m, KV_W_LM_HEAD, 0), n, d, V, dhead, NULL, g->dxn, 0);
    float *dx = g->dx;
    memset(dx, 0, (size_t)(n * d) * sizeof(float));
    norm_bwd(c, g->dxn, g->xf, g->muf, g->rsf, kv_model_weight(m, KV_W_OUT_NORM, 0), n, d, dx,
             kv_grad_of(g, KV_W_OUT_NORM, 0),
             kv_model_has(m, KV_W_OUT_NORM_B, 0) ? kv_grad_of(g, KV_W_OUT_NORM_B, 0) : NULL, off);

    for (int64_t l = c->n_layers - 1; l >= 0; l--) {
        const float *const *w = kv_model_layer(m, l);
        struct glayer *y = &g->ly[l];
#define GW(kind) kv_grad_of(g, kind, l)
        /* ffn: x_out = x_mid + act W_downᵀ + b_down; dx carries ∂/∂x_out (with a
         * parallel residual x_mid is x_in, and attention's branch also sees
         * ∂/∂x_out: kept in dxo) */
        if (c->parallel_residual) memcpy(g->dxo, dx, (size_t)(n * d) * sizeof(float));
        const float *dffn = dx; /* ∂/∂ (act W_downᵀ): through the post-norm for Gemma 2 */
        if (arch->post_norms) {
            memset(g->dpost, 0, (size_t)(n * d) * sizeof(float));
            norm_bwd(c, dx, y->pf_in, y->pf_mu, y->pf_rs, w[KV_W_POST_FFN_NORM], n, d, g->dpost,
                     GW(KV_W_POST_FFN_NORM), NULL, off);
            dffn = g->dpost;
        }
        lin_bwd(dffn, y->act, w[KV_W_DOWN], n, hid, d, GW(KV_W_DOWN),
                w[KV_W_BDOWN] ? GW(KV_W_BDOWN) : NULL, g->dh, 0);
        int64_t nh = n * hid;
        if (arch->gelu_mlp) {
#pragma omp parallel for if (nh > 65536) schedule(static)
            for (int64_t i = 0; i < nh; i++)
                g->da[i] = g->dh[i] * (c->gelu_erf ? kv_gelu_erf_grad(y->a[i]) : kv_gelu_tanh_grad(y->a[i]));
            lin_bwd(g->da, y->xn2, w[KV_W_UP], n, d, hid, GW(KV_W_UP), GW(KV_W_BUP), g->dxn, 0);
        } else {
#pragma omp parallel for if (nh > 65536) schedule(static)
            for (int64_t i = 0; i < nh; i++) {
                float a = y->a[i];
                if (arch->geglu) { /* act = gelu_tanh(a) · b */
                    g->db[i] = g->dh[i] * kv_gelu_tanh(a);
                    g->da[i] = g->dh[i] * y->b[i] * kv_gelu_tanh_grad(a);
                    continue;
                }
                float s = 1.0f / (1.0f + expf(-a));
                g->db[i] = g->dh[i] * a * s;
                g->da[i] = g->dh[i] * y->b[i] * s * (1.0f + a * (1.0f - s));
            }
            lin_bwd(g->da, y->xn2, w[KV_W_GATE], n, d, hid, GW(KV_W_GATE), NULL, g->dxn, 0);
            lin_bwd(g->db, y->xn2, w[KV_W_UP], n, d, hid, GW(KV_W_UP), NULL, g->dxn, 1);
        }
        norm_bwd(c, g->dxn, y->x_mid, y->mu2, y->rs2, w[KV_W_FFN_NORM], n, d, dx,
                 GW(KV_W_FFN_NORM), w[KV_W_FFN_NORM_B] ? GW(KV_W_FFN_NORM_B) : NULL, off);
        /* attention: x_mid = x_in + att W_oᵀ + b_o */
        const float *dattn = c->parallel_residual ? g->dxo : dx; /* ∂/∂ (att W_oᵀ) */
        if (arch->post_norms) {
            memset(g->dpost, 0, (size_t)(n * d) * sizeof(float));
            norm_bwd(c, dattn, y->pa_in, y->pa_mu, y->pa_rs, w[KV_W_POST_ATTN_NORM], n, d,
                     g->dpost, GW(KV_W_POST_ATTN_NORM), NULL, off);
            dattn = g->dpost;
        }
        lin_bwd(dattn, y->att, w[KV_W_O], n, qd, d, GW(KV_W_O), w[KV_W_BO] ? GW(KV_W_BO) : NULL,
                g->datt, 0);
        attn_bwd(g, y, n);
        if (arch->rope) {
            rope_apply(g, g->dq, n, h, -1.0f);
            rope_apply(g, g->dk, n, c->n_kv_heads, -1.0f);
        }
        if (arch->qk_norm) { /* back through the per-head norms to the projections */
            memset(g->dqr, 0, (size_t)(n * qd) * sizeof(float));
            memset(g->dkr, 0, (size_t)(n * kd) * sizeof(float));
            norm_bwd(c, g->dq, y->qraw, y->qmu, y->qrs, w[KV_W_QNORM], n * h, dh, g->dqr,
                     GW(KV_W_QNORM), NULL, 0.0f);
            norm_bwd(c, g->dk, y->kraw, y->kmu, y->krs, w[KV_W_KNORM], n * c->n_kv_heads, dh,
                     g->dkr, GW(KV_W_KNORM), NULL, 0.0f);
            memcpy(g->dq, g->dqr, (size_t)(n * qd) * sizeof(float));
            memcpy(g->dk, g->dkr, (size_t)(n * kd) * sizeof(float));
        }
        memcpy(y->gk, g->dk, (size_t)(n * kd) * sizeof(float));
        memcpy(y->gv, g->dv, (size_t)(n * kd) * sizeof(float));
        lin_bwd(g->dq, y->xn1, w[KV_W_Q], n, d, qd, GW(KV_W_Q), w[KV_W_BQ] ? GW(KV_W_BQ) : NULL,
                g->dxn, 0);
        lin_bwd(g->dk, y->xn1, w[KV_W_K], n, d, kd, GW(KV_W_K), w[KV_W_BK] ? GW(KV_W_BK) : NULL,
                g->dxn, 1);
        lin_bwd(g->dv, y->xn1, w[KV_W_V], n, d, kd, GW(KV_W_V), w[KV_W_BV] ? GW(KV_W_BV) : NULL,
                g->dxn, 1);
        norm_bwd(c, g->dxn, y->x_in, y->mu1, y->rs1, w[KV_W_ATTN_NORM], n, d, dx,
                 GW(KV_W_ATTN_NORM), w[KV_W_ATTN_NORM_B] ? GW(KV_W_ATTN_NORM_B) : NULL, off);
#undef GW
    }
    /* embeddings: x0 = tok_emb[tok] (+ pos_emb) */
    float *de = kv_grad_of(g, KV_W_TOK_EMB, 0),
          *dpos = kv_model_has(m, KV_W_POS_EMB, 0) ? kv_grad_of(g, KV_W_POS_EMB, 0) : NULL;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < d; j++) {
            de[(int64_t)tok[i] * d + j] += dx[i * d + j] * es;
            if (dpos) dpos[i * d + j] += dx[i * d + j];
        }
    return KV_OK;
}
