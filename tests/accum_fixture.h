/* What the calibration-statistics suites share (test_accum.c for kv_accum,
 * test_collectrun.c for kv_collect_run): the shared stories260K model, and a
 * naive float64 oracle written here. Our own forward hooks copy the fp32
 * activations and plain triple loops sum XᵀX, Σx, QᵀQ per query head and KᵀK
 * per KV head (no BLAS, nothing shared with calib/accum.c); the comparisons
 * name the worst layer and tensor. */
#ifndef KV_ACCUM_FIXTURE_H
#define KV_ACCUM_FIXTURE_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstats.h"
#include "model.h"
#include "testutil.h"

/* The shared data the real-model tests use (they skip without it). */
#define MODEL_REL "models/stories260K/stories260K.bin"
#define TOK_REL "models/stories260K/tok512.bin"
#define VAL_REL "text/tinystories/val1k.txt"

/* Sums equal up to summation order: far tighter than any fp32 effect. */
#define STATS_RTOL 1e-12

/* An error as one line, with the detection site (any thread). */
static inline const char *fmt_err(const struct kv_err *e) {
    static __thread char buf[2600];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

/* Copy of a shared path (kvt_shared's buffer is reused); skips when absent. */
static inline char *shared_copy(const char *rel) {
    KVT_NEED_SHARED(p, rel);
    char *s = strdup(p);
    cr_assert(s);
    return s;
}

/* One thread: Criterion runs two tests at once on two cores, and spinning
 * OpenMP teams of two in each would oversubscribe them many times over. */
static inline struct kv_model *open_stories(void) {
    kv_set_threads(1);
    char *mp = shared_copy(MODEL_REL), *tp = shared_copy(TOK_REL);
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(mp, tp, &m, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert(kv_model_tokenizer(m));
    free(mp), free(tp);
    return m;
}

/* Empty statistics shaped for m. */
static inline struct kv_stats *stats_for(const struct kv_model *m) {
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(kv_model_config(m), &s, &err), KV_OK, "%s", fmt_err(&err));
    return s;
}

/* ---------------------------------------------------------------- the oracle */

/* Our own hooks keep the fp32 activations of every layer of one window. */
struct naive {
    int64_t L, d, qd, kd, max_n;
    int64_t n;                 /* rows of the last window */
    float *x, *q, *k;          /* [L][max_n, d], [L][max_n, h*d_h], [L][max_n, g*d_h] */
    int64_t calls_in, calls_qk;
};

/* The hooks: copy one layer's attention input, and its post-rope q and k. */
static inline int naive_attn_in(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0) {
    struct naive *nv = ctx;
    cr_assert(layer >= 0 && layer < nv->L && n <= nv->max_n && pos0 == 0);
    memcpy(nv->x + layer * nv->max_n * nv->d, x, (size_t)(n * nv->d) * sizeof *x);
    nv->n = n;
    nv->calls_in++;
    return 0;
}

static inline int naive_qk(void *ctx, int64_t layer, const float *q, const float *k, int64_t n,
                           int64_t pos0) {
    struct naive *nv = ctx;
    cr_assert(layer >= 0 && layer < nv->L && n == nv->n && pos0 == 0);
    memcpy(nv->q + layer * nv->max_n * nv->qd, q, (size_t)(n * nv->qd) * sizeof *q);
    memcpy(nv->k + layer * nv->max_n * nv->kd, k, (size_t)(n * nv->kd) * sizeof *k);
    nv->calls_qk++;
    return 0;
}

/* cov[i] += Σ_t b[t, i*dh + a] b[t, i*dh + c] for each of nh heads of b [n, nh*dh]. */
static inline void naive_head_grams(double *cov, const float *b, int64_t n, int64_t nh, int64_t dh) {
    for (int64_t i = 0; i < nh; i++)
        for (int64_t a = 0; a < dh; a++)
            for (int64_t c = 0; c < dh; c++) {
                double s = 0;
                for (int64_t t = 0; t < n; t++)
                    s += (double)b[t * nh * dh + i * dh + a] * (double)b[t * nh * dh + i * dh + c];
                cov[(i * dh + a) * dh + c] += s;
            }
}

/* Add the captured window to ref, every element of both triangles. */
static inline void naive_add(const struct naive *nv, struct kv_stats *ref) {
    int64_t d = nv->d, n = nv->n, h = ref->info.n_heads, g = ref->info.n_kv_heads, dh = ref->info.head_dim;
    for (int64_t l = 0; l < nv->L; l++) {
        const float *x = nv->x + l * nv->max_n * d;
        struct kv_stats_layer *R = &ref->layers[l];
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < d; j++) {
                double s = 0;
                for (int64_t t = 0; t < n; t++) s += (double)x[t * d + i] * (double)x[t * d + j];
                R->xtx[i * d + j] += s;
            }
        for (int64_t j = 0; j < d; j++) {
            double s = 0;
            for (int64_t t = 0; t < n; t++) s += (double)x[t * d + j];
            R->xsum[j] += s;
        }
        naive_head_grams(R->q_cov, nv->q + l * nv->max_n * nv->qd, n, h, dh);
        naive_head_grams(R->k_cov, nv->k + l * nv->max_n * nv->kd, n, g, dh);
    }
}

/* Run n_windows windows of seq_len tokens (ids, consecutive) through a full
 * forward pass with our hooks and sum them into ref. */
static inline void naive_run(const struct kv_model *m, struct kv_stats *ref, const int32_t *ids,
                             int64_t n_windows, int64_t seq_len) {
    const struct kv_config *c = kv_model_config(m);
    struct naive nv = {0};
    nv.L = c->n_layers;
    nv.d = c->dim;
    nv.qd = c->n_heads * c->head_dim;
    nv.kd = c->n_kv_heads * c->head_dim;
    nv.max_n = seq_len;
    nv.x = malloc((size_t)(nv.L * seq_len * nv.d) * sizeof *nv.x);
    nv.q = malloc((size_t)(nv.L * seq_len * nv.qd) * sizeof *nv.q);
    nv.k = malloc((size_t)(nv.L * seq_len * nv.kd) * sizeof *nv.k);
    cr_assert(nv.x && nv.q && nv.k);
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, seq_len, &f, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_fwd_hooks hk = {0};
    hk.ctx = &nv;
    hk.attn_in = naive_attn_in;
    hk.qk_rope = naive_qk;
    /* a full pass, not hooks_only: the library's shortcut must not matter */
    kv_fwd_set_hooks(f, &hk);
    for (int64_t w = 0; w < n_windows; w++) {
        nv.calls_in = nv.calls_qk = 0;
        cr_assert_eq(kv_fwd_run(f, ids + w * seq_len, seq_len, 0, NULL, &err), KV_OK, "%s",
                     fmt_err(&err));
        cr_assert_eq(nv.calls_in, nv.L, "attn_in hook ran %lld times for %lld layers",
                     (long long)nv.calls_in, (long long)nv.L);
        cr_assert_eq(nv.calls_qk, nv.L);
        naive_add(&nv, ref);
    }
    kv_fwd_free(f);
    free(nv.x), free(nv.q), free(nv.k);
}

/* ---------------------------------------------------------------- comparisons */

/* One forward-statistics tensor of a layer: name, data, element count. */
struct tensor_view {
    const char *name;
    double *p;
    int64_t n;
};

/* The four forward-statistics tensors of layer l of s; returns 4. */
static inline int layer_tensors(const struct kv_stats *s, int64_t l, struct tensor_view t[4]) {
    int64_t d = s->info.dim, dh = s->info.head_dim;
    const struct kv_stats_layer *L = &s->layers[l];
    t[0] = (struct tensor_view){"xtx", L->xtx, d * d};
    t[1] = (struct tensor_view){"xsum", L->xsum, d};
    t[2] = (struct tensor_view){"q_cov", L->q_cov, s->info.n_heads * dh * dh};
    t[3] = (struct tensor_view){"k_cov", L->k_cov, s->info.n_kv_heads * dh * dh};
    return 4;
}

/* ||a - b||_F / ||b||_F (b must not be all zero). */
static inline double rel_frob(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = a[i] - b[i];
        num += e * e;
        den += b[i] * b[i];
    }
    return sqrt(num / den);
}

/* Every tensor of got within tol of ref in relative Frobenius norm; the
 * worst layer/tensor is logged and named on failure. Returns the worst. */
static inline double assert_stats_close(const struct kv_stats *got, const struct kv_stats *ref,
                                        double tol, const char *what) {
    cr_assert(got->info.n_layers == ref->info.n_layers && got->info.dim == ref->info.dim &&
                  got->info.n_heads == ref->info.n_heads && got->info.n_kv_heads == ref->info.n_kv_heads &&
                  got->info.head_dim == ref->info.head_dim,
              "%s: shapes differ", what);
    double worst = -1;
    int64_t wl = -1;
    const char *wt = "";
    for (int64_t l = 0; l < ref->info.n_layers; l++) {
        struct tensor_view a[4], b[4];
        int nt = layer_tensors(got, l, a);
        layer_tensors(ref, l, b);
        for (int t = 0; t < nt; t++) {
            double norm = 0;
            for (int64_t i = 0; i < b[t].n; i++) norm += b[t].p[i] * b[t].p[i];
            cr_assert_gt(norm, 0, "%s: reference layer %lld %s is all zero", what, (long long)l,
                         b[t].name);
            double e = rel_frob(a[t].p, b[t].p, b[t].n);
            if (isnan(e)) e = INFINITY;
            if (e > worst) worst = e, wl = l, wt = b[t].name;
        }
    }
    cr_log_info("%s: worst relative Frobenius error %.3g (layer %lld %s)", what, worst,
                (long long)wl, wt);
    cr_assert(worst <= tol, "%s: layer %lld %s: relative Frobenius error %.3g > %.0e", what,
              (long long)wl, wt, worst, tol);
    return worst;
}

/* Matrix a [n, n] of layer l (head head) equals its transpose exactly. */
static inline void assert_square_symmetric(const double *a, int64_t n, const char *what, int64_t l,
                                           int64_t head) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = i + 1; j < n; j++)
            cr_assert(a[i * n + j] == a[j * n + i],
                      "layer %lld %s head %lld: [%lld,%lld] = %.17g but [%lld,%lld] = %.17g",
                      (long long)l, what, (long long)head, (long long)i, (long long)j,
                      a[i * n + j], (long long)j, (long long)i, a[j * n + i]);
}

/* Both triangles stored and exactly equal. */
static inline void assert_symmetric(const struct kv_stats *s) {
    int64_t dh = s->info.head_dim;
    for (int64_t l = 0; l < s->info.n_layers; l++) {
        assert_square_symmetric(s->layers[l].xtx, s->info.dim, "xtx", l, 0);
        for (int64_t i = 0; i < s->info.n_heads; i++)
            assert_square_symmetric(s->layers[l].q_cov + i * dh * dh, dh, "q_cov", l, i);
        for (int64_t i = 0; i < s->info.n_kv_heads; i++)
            assert_square_symmetric(s->layers[l].k_cov + i * dh * dh, dh, "k_cov", l, i);
    }
}

#endif
