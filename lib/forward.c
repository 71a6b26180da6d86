/* Reference forward pass for the Llama family (fp32 activations).
 *
 * One call runs n tokens at positions pos0.. against a per-layer KV cache.
 * Every projection is one OpenBLAS sgemm over the whole window; attention is
 * a pair of sgemms per (head, block of query rows), parallel over OpenMP.
 *
 * Shapes (row-major): x, xn [n, d]; q [n, h*d_h]; k/v cache [max_ctx, g*d_h]
 * per layer; att [n, h*d_h]; ffn a, b [n, hidden]; logits [n, vocab]. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "limits.h"
#include "model.h"

#define QBLOCK 128 /* query rows per attention block */

struct kv_fwd {
    const struct kv_model *m;
    int64_t max_ctx;
    struct kv_fwd_hooks hooks;
    float *x, *xn, *q, *att, *a, *b, *logits;
    float *kc, *vc;         /* [L][max_ctx][g*d_h] */
    float *rope_cos, *rope_sin; /* [max_ctx][d_h/2] */
    float *scores;          /* [threads][QBLOCK][max_ctx] */
    const float *last_logits; /* where the last run wrote its logits */
    int n_threads;
};

void kv_set_threads(int n) {
    if (n <= 0) return;
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

void kv_fwd_free(struct kv_fwd *f) {
    if (!f) return;
    free(f->x), free(f->xn), free(f->q), free(f->att), free(f->a), free(f->b);
    free(f->logits), free(f->kc), free(f->vc), free(f->rope_cos), free(f->rope_sin);
    free(f->scores);
    free(f);
}

static float *falloc(int64_t n) { return malloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }

int kv_fwd_init(const struct kv_model *m, int64_t max_ctx, struct kv_fwd **out,
                struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    if (max_ctx <= 0 || max_ctx > KV_MAX_CTX)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "context length %lld is outside 1..%d",
                       (long long)max_ctx, KV_MAX_CTX);
    struct kv_fwd *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    f->m = m;
    f->max_ctx = max_ctx;
    f->n_threads = omp_get_max_threads();
    int64_t d = c->dim, qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    int64_t half = c->head_dim / 2;
    f->x = falloc(max_ctx * d);
    f->xn = falloc(max_ctx * d);
    f->q = falloc(max_ctx * qd);
    f->att = falloc(max_ctx * qd);
    f->a = falloc(max_ctx * c->hidden_dim);
    f->b = falloc(max_ctx * c->hidden_dim);
    f->logits = falloc(max_ctx * c->vocab_size);
    f->kc = falloc(c->n_layers * max_ctx * kd);
    f->vc = falloc(c->n_layers * max_ctx * kd);
    f->rope_cos = falloc(max_ctx * half);
    f->rope_sin = falloc(max_ctx * half);
    f->scores = falloc((int64_t)f->n_threads * QBLOCK * max_ctx);
    if (!f->x || !f->xn || !f->q || !f->att || !f->a || !f->b || !f->logits || !f->kc ||
        !f->vc || !f->rope_cos || !f->rope_sin || !f->scores) {
        kv_fwd_free(f);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory for a forward state of %lld positions", (long long)max_ctx);
    }
    /* Angles in double: theta^(-2i/d_h) * pos, rounded once to float. */
    for (int64_t p = 0; p < max_ctx; p++)
        for (int64_t i = 0; i < half; i++) {
            double freq = pow((double)c->rope_theta, -2.0 * (double)i / (double)c->head_dim);
            double ang = (double)p * freq;
            f->rope_cos[p * half + i] = (float)cos(ang);
            f->rope_sin[p * half + i] = (float)sin(ang);
        }
    *out = f;
    return KV_OK;
}

void kv_fwd_set_hooks(struct kv_fwd *f, const struct kv_fwd_hooks *hooks) {
    if (hooks)
        f->hooks = *hooks;
    else
        memset(&f->hooks, 0, sizeof f->hooks);
}

const float *kv_fwd_logits(const struct kv_fwd *f) { return f->last_logits; }

/* out[i,:] = x[i,:] / rms(x[i,:]) * w, accumulated in double. */
static void rmsnorm(float *out, const float *x, const float *w, int64_t n, int64_t d, float eps) {
#pragma omp parallel for if (n * d > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d;
        double ss = 0;
        for (int64_t j = 0; j < d; j++) ss += (double)xi[j] * xi[j];
        float r = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
        float *o = out + i * d;
        for (int64_t j = 0; j < d; j++) o[j] = xi[j] * r * w[j];
    }
}

/* Y[n, out] (leading dim ldy) = X[n, in] · Wᵀ, W is [out, in] row-major. */
static void linear(float *y, int64_t ldy, const float *x, const float *w, int64_t n, int64_t in,
                   int64_t outd, float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)outd, (int)in, 1.0f, x,
                (int)in, w, (int)in, beta, y, (int)ldy);
}

static void add_bias(float *y, const float *bias, int64_t n, int64_t dd) {
    if (!bias) return;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < dd; j++) y[i * dd + j] += bias[j];
}

/* Rotate every head of rows [n, nh*d_h] at positions pos0.. */
static void rope(const struct kv_fwd *f, float *v, int64_t n, int64_t nh, int64_t pos0) {
    const struct kv_config *c = &f->m->cfg;
    int64_t dh = c->head_dim, half = dh / 2;
    int interleaved = c->rope_layout == KV_ROPE_INTERLEAVED;
#pragma omp parallel for if (n * nh * dh > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *cs = f->rope_cos + (pos0 + i) * half, *sn = f->rope_sin + (pos0 + i) * half;
        for (int64_t hh = 0; hh < nh; hh++) {
            float *p = v + (i * nh + hh) * dh;
            for (int64_t j = 0; j < half; j++) {
                int64_t a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + half;
                float x0 = p[a], x1 = p[b];
                p[a] = x0 * cs[j] - x1 * sn[j];
                p[b] = x0 * sn[j] + x1 * cs[j];
            }
        }
    }
}

/* Causal GQA attention of n query rows (positions pos0..) over cache rows
 * [0, pos0+n) of one layer; writes att [n, h*d_h]. */
static void attention(struct kv_fwd *f, const float *kc, const float *vc, int64_t n, int64_t pos0) {
    const struct kv_config *c = &f->m->cfg;
    int64_t dh = c->head_dim, h = c->n_heads, g = c->n_kv_heads;
    int64_t qd = h * dh, kd = g * dh, group = h / g;
    int64_t nblk = (n + QBLOCK - 1) / QBLOCK;
    float scale = (float)(1.0 / sqrt((double)dh));
    int64_t ld = f->max_ctx;
    /* scores has one slab per thread counted at init: never run more */
    int nt = omp_get_max_threads() < f->n_threads ? omp_get_max_threads() : f->n_threads;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nt)
    for (int64_t hh = 0; hh < h; hh++)
        for (int64_t bi = 0; bi < nblk; bi++) {
            float *S = f->scores + (int64_t)omp_get_thread_num() * QBLOCK * ld;
            int64_t r0 = bi * QBLOCK, nb = n - r0 < QBLOCK ? n - r0 : QBLOCK;
            int64_t kvlen = pos0 + r0 + nb; /* keys visible to the last row of the block */
            const float *Q = f->q + r0 * qd + hh * dh;
            const float *K = kc + (hh / group) * dh, *V = vc + (hh / group) * dh;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nb, (int)kvlen, (int)dh,
                        scale, Q, (int)qd, K, (int)kd, 0.0f, S, (int)ld);
            for (int64_t i = 0; i < nb; i++) {
                float *s = S + i * ld;
                int64_t vis = pos0 + r0 + i + 1;
                float mx = s[0];
                for (int64_t j = 1; j < vis; j++) mx = s[j] > mx ? s[j] : mx;
                double sum = 0;
                for (int64_t j = 0; j < vis; j++) {
                    s[j] = expf(s[j] - mx);
                    sum += s[j];
                }
                float inv = (float)(1.0 / sum);
                for (int64_t j = 0; j < vis; j++) s[j] *= inv;
                for (int64_t j = vis; j < kvlen; j++) s[j] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nb, (int)dh, (int)kvlen,
                        1.0f, S, (int)ld, V, (int)kd, 0.0f, f->att + r0 * qd + hh * dh, (int)qd);
        }
}

int kv_fwd_run(struct kv_fwd *f, const int32_t *tokens, int64_t n, int64_t pos0, float *logits,
               struct kv_err *err) {
    const struct kv_model *m = f->m;
    const struct kv_config *c = &m->cfg;
    if (n <= 0 || pos0 < 0 || pos0 + n > f->max_ctx)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "positions %lld..%lld exceed the context of %lld", (long long)pos0,
                       (long long)(pos0 + n - 1), (long long)f->max_ctx);
    int64_t d = c->dim, hid = c->hidden_dim, qd = c->n_heads * c->head_dim;
    int64_t kd = c->n_kv_heads * c->head_dim;
    for (int64_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "token id %d at position %lld is outside the vocabulary of %lld",
                           tokens[i], (long long)(pos0 + i), (long long)c->vocab_size);
        memcpy(f->x + i * d, m->tok_emb + (int64_t)tokens[i] * d, (size_t)d * sizeof(float));
    }
    const struct kv_fwd_hooks *hk = &f->hooks;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *w = m->layers[l].w;
        float *kc = f->kc + l * f->max_ctx * kd, *vc = f->vc + l * f->max_ctx * kd;
        float *k = kc + pos0 * kd, *v = vc + pos0 * kd;
        rmsnorm(f->xn, f->x, w[KV_W_ATTN_NORM], n, d, c->norm_eps);
        int rc;
        if (hk->attn_in && (rc = hk->attn_in(hk->ctx, l, f->xn, n, pos0))) return rc;
        linear(f->q, qd, f->xn, w[KV_W_Q], n, d, qd, 0.0f);
        linear(k, kd, f->xn, w[KV_W_K], n, d, kd, 0.0f);
        linear(v, kd, f->xn, w[KV_W_V], n, d, kd, 0.0f);
        add_bias(f->q, w[KV_W_BQ], n, qd);
        add_bias(k, w[KV_W_BK], n, kd);
        add_bias(v, w[KV_W_BV], n, kd);
        rope(f, f->q, n, c->n_heads, pos0);
        rope(f, k, n, c->n_kv_heads, pos0);
        if (hk->qk_rope && (rc = hk->qk_rope(hk->ctx, l, f->q, k, n, pos0))) return rc;
        if (hk->kv_replace && (rc = hk->kv_replace(hk->ctx, l, f->xn, k, v, n, pos0))) return rc;
        if (hk->hooks_only && l == c->n_layers - 1) {
            f->last_logits = NULL;
            return KV_OK;
        }
        attention(f, kc, vc, n, pos0);
        linear(f->x, d, f->att, w[KV_W_O], n, qd, d, 1.0f); /* residual: x += att Woᵀ */
        rmsnorm(f->xn, f->x, w[KV_W_FFN_NORM], n, d, c->norm_eps);
        linear(f->a, hid, f->xn, w[KV_W_GATE], n, d, hid, 0.0f);
        linear(f->b, hid, f->xn, w[KV_W_UP], n, d, hid, 0.0f);
        int64_t nh = n * hid;
        float *a = f->a, *b = f->b;
#pragma omp parallel for if (nh > 65536) schedule(static)
        for (int64_t i = 0; i < nh; i++) a[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
        linear(f->x, d, f->a, w[KV_W_DOWN], n, hid, d, 1.0f); /* x += silu(a)*b W2ᵀ */
    }
    rmsnorm(f->xn, f->x, m->out_norm, n, d, c->norm_eps);
    float *lg = logits ? logits : f->logits;
    linear(lg, c->vocab_size, f->xn, m->lm_head, n, d, c->vocab_size, 0.0f);
    f->last_logits = lg;
    return KV_OK;
}

double kv_fwd_flops(const struct kv_model *m, int64_t n, int64_t pos0) {
    const struct kv_config *c = &m->cfg;
    double d = (double)c->dim, qd = (double)(c->n_heads * c->head_dim);
    double kd = (double)(c->n_kv_heads * c->head_dim), hid = (double)c->hidden_dim;
    double per_tok = 2.0 * (d * (qd + 2 * kd) + qd * d + 3 * d * hid) * (double)c->n_layers +
                     2.0 * d * (double)c->vocab_size;
    /* causal attention: row at position p scores p+1 keys, QKᵀ and PV */
    double keys = (double)n * (double)pos0 + (double)n * (double)(n + 1) / 2.0;
    double att = 4.0 * qd * keys * (double)c->n_layers;
    return per_tok * (double)n + att;
}

double kv_nll_row(const float *logits, int64_t vocab, int32_t target) {
    double mx = logits[0];
    for (int64_t j = 1; j < vocab; j++) mx = logits[j] > mx ? logits[j] : mx;
    double s = 0;
    for (int64_t j = 0; j < vocab; j++) s += exp((double)logits[j] - mx);
    return log(s) + mx - (double)logits[target];
}
