/* Perplexity under the windows protocol (DESIGN §8). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "err.h"
#include "lrmodel.h"
#include "model.h"

double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Given names, a message is the caller's ("--seq-len must be at least 2,
 * got 1"); without, the library's own wording, as its callers know it. */
int kv_ppl_check(int64_t seq_len, int64_t max_windows, const char *const *names,
                 struct kv_err *err) {
    if (seq_len < 2)
        return names ? kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 2, got %lld",
                               names[KV_PPL_OPT_SEQ_LEN], (long long)seq_len)
                     : kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "seq-len %lld is too short, need at least 2", (long long)seq_len);
    if (max_windows < 0)
        return names ? kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be 0 (every window) or more",
                               names[KV_PPL_OPT_MAX_WINDOWS])
                     : kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "max windows must be 0 (every window) or more, found %lld",
                               (long long)max_windows);
    return KV_OK;
}

int kv_ppl_check_tol(double tol, const char *const *names, struct kv_err *err) {
    if (tol < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 0, got %g",
                       names ? names[KV_PPL_OPT_DEVICE_TOL] : "device tolerance", tol);
    return KV_OK;
}

/* The run the device is compared with: the compressed one when there is one. */
static const struct kv_ppl_result *dev_reference(const struct kv_compare_result *r) {
    return r->comp.windows > 0 ? &r->comp : &r->base;
}

double kv_compare_dev_rel(const struct kv_compare_result *r) {
    return r->dev.ppl / dev_reference(r)->ppl - 1;
}

int kv_ppl_device_verdict(const struct kv_compare_result *r, double tol, const char *const *names,
                          struct kv_err *err) {
    double rel = kv_compare_dev_rel(r);
    if (!r->has_dev || fabs(rel) <= tol) return KV_OK;
    return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                   "device ppl %.6f differs from the cpu's %.6f by %.2e relative, more than %s %g",
                   r->dev.ppl, dev_reference(r)->ppl, fabs(rel),
                   names ? names[KV_PPL_OPT_DEVICE_TOL] : "the tolerance", tol);
}

/* Windows of the protocol: n_tokens / seq_len, at most max_windows (> 0;
 * <= 0 is every window). */
static int count_windows(int64_t n_tokens, int64_t seq_len, int64_t max_windows, int64_t *out,
                         struct kv_err *err) {
    int rc = kv_ppl_check(seq_len, 0, NULL, err);
    if (rc) return rc;
    int64_t windows = n_tokens / seq_len;
    if (windows == 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "text has %lld tokens, fewer than one window of %lld", (long long)n_tokens,
                       (long long)seq_len);
    *out = max_windows > 0 && max_windows < windows ? max_windows : windows;
    return KV_OK;
}

/* Positions scored per slice of logits: the whole window while its logits
 * take at most SLICE_BYTES, else as many rows as fit (a deferred head). */
static int64_t slice_bytes = (int64_t)256 << 20;
void kv_ppl_slice_bytes(int64_t bytes) { slice_bytes = bytes > 0 ? bytes : (int64_t)256 << 20; }

static int64_t slice_rows(int64_t seq_len, int64_t vocab) {
    if (seq_len * vocab * (int64_t)sizeof(float) <= slice_bytes) return seq_len;
    int64_t r = slice_bytes / (vocab * (int64_t)sizeof(float));
    return r > 0 ? r : 1;
}

/* The logits of scored rows i0..i0+n-1 of f's last run: computed now into
 * f's buffer when its head is deferred (adding the time to *sec), else a
 * view of the whole window's. */
static const float *rows_of(struct kv_fwd *f, int sliced, int64_t i0, int64_t n, int64_t vocab,
                            double *sec, int *rc, struct kv_err *err) {
    if (!f) return NULL;
    if (!sliced) return kv_fwd_logits(f) + i0 * vocab;
    double t0 = kv_now();
    if ((*rc = kv_fwd_head(f, i0, n, NULL, err))) return NULL;
    if (sec) *sec += kv_now() - t0;
    return kv_fwd_logits(f);
}

/* An array as a kv_token_src. */
struct array_src {
    const int32_t *tokens;
};

static int array_window(void *ctx, int64_t w, int64_t seq_len, const int32_t **ids,
                        struct kv_err *err) {
    *ids = ((const struct array_src *)ctx)->tokens + w * seq_len;
    return KV_OK;
}

int kv_ppl_run(const struct kv_model *m, const int32_t *tokens, int64_t n_tokens,
               int64_t seq_len, int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
               struct kv_ppl_result *out, struct kv_err *err) {
    struct array_src a = {tokens};
    struct kv_token_src src = {array_window, &a, n_tokens};
    return kv_ppl_run_src(m, &src, seq_len, max_windows, progress, progress_ctx, out, err);
}

int kv_ppl_run_src(const struct kv_model *m, const struct kv_token_src *src, int64_t seq_len,
                   int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
                   struct kv_ppl_result *out, struct kv_err *err) {
    int64_t n_tokens = src->n_tokens;
    int64_t windows;
    int rc0 = count_windows(n_tokens, seq_len, max_windows, &windows, err);
    if (rc0) return rc0;
    struct kv_fwd *f;
    int rc = kv_fwd_init(m, seq_len, &f, err);
    if (rc) return rc;
    kv_fwd_one_window(f); /* windows from position 0: one layer's cache serves all */
    int64_t vocab = m->cfg.vocab_size, rows = slice_rows(seq_len, vocab);
    int sliced = rows < seq_len;
    if (sliced) kv_fwd_defer_head(f);
    double nll = 0, t0 = kv_now();
    for (int64_t w = 0; w < windows; w++) {
        const int32_t *tw;
        if ((rc = src->window(src->ctx, w, seq_len, &tw, err))) break;
        rc = kv_fwd_run(f, tw, seq_len, 0, NULL, err);
        if (rc) break;
        double s = 0;
        for (int64_t i0 = 0; i0 < seq_len - 1 && !rc; i0 += rows) {
            int64_t nr = seq_len - 1 - i0 < rows ? seq_len - 1 - i0 : rows;
            const float *lg = rows_of(f, sliced, i0, nr, vocab, NULL, &rc, err);
            if (rc) break;
            const int32_t *tg = tw + i0 + 1;
            double s1 = 0;
#pragma omp parallel for reduction(+ : s1) schedule(static)
            for (int64_t i = 0; i < nr; i++) s1 += kv_nll_row(lg + i * vocab, vocab, tg[i]);
            s += s1;
        }
        if (rc) break;
        if (!isfinite(s)) {
            rc = kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                         "non-finite loss in window %lld (tokens %lld..%lld)", (long long)w,
                         (long long)(w * seq_len), (long long)((w + 1) * seq_len - 1));
            break;
        }
        nll += s;
        if (progress && progress(progress_ctx, w + 1, windows, (w + 1) * seq_len)) {
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "interrupted after %lld windows",
                         (long long)(w + 1));
            break;
        }
    }
    kv_fwd_free(f);
    if (rc) return rc;
    out->tokens = n_tokens;
    out->windows = windows;
    out->scored = windows * (seq_len - 1);
    out->nll_sum = nll;
    out->nll = nll / (double)out->scored;
    out->ppl = exp(out->nll);
    out->seconds = kv_now() - t0;
    return KV_OK;
}

/* KL(p‖q) of two logit rows, with both log-softmaxes in float64. */
static double kl_row(const float *lp, const float *lq, int64_t vocab) {
    double mp = lp[0], mq = lq[0];
    for (int64_t j = 1; j < vocab; j++) {
        mp = lp[j] > mp ? lp[j] : mp;
        mq = lq[j] > mq ? lq[j] : mq;
    }
    double sp = 0, sq = 0;
    for (int64_t j = 0; j < vocab; j++) {
        sp += exp((double)lp[j] - mp);
        sq += exp((double)lq[j] - mq);
    }
    double zp = mp + log(sp), zq = mq + log(sq), kl = 0;
    for (int64_t j = 0; j < vocab; j++) {
        double a = (double)lp[j] - zp, b = (double)lq[j] - zq;
        kl += exp(a) * (a - b);
    }
    return kl > 0 ? kl : 0;
}

static int64_t argmax_row(const float *l, int64_t vocab) {
    int64_t best = 0;
    for (int64_t j = 1; j < vocab; j++)
        if (l[j] > l[best]) best = j;
    return best;
}

/* max_j |got_j − ref_j| / max_j |ref_j| of two logit rows in float64; NaN
 * propagates. */
static double rel_row(const float *ref, const float *got, int64_t vocab) {
    double num = 0, den = 0;
    for (int64_t j = 0; j < vocab; j++) {
        double e = fabs((double)got[j] - (double)ref[j]), a = fabs((double)ref[j]);
        if (!(e <= num)) num = e;
        if (!(a <= den)) den = a;
    }
    if (den > 0 || isnan(den)) return num / den;
    return num > 0 || isnan(num) ? INFINITY : 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* splitmix64: the resampling's generator */
static uint64_t mix_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int kv_bootstrap_ci(const double *d, const double *k, int64_t n, int64_t scored, int64_t draws,
                    uint64_t seed, double dppl_ci[2], double kl_ci[2], struct kv_err *err) {
    double *bd = malloc((size_t)(draws > 0 ? draws : 1) * sizeof *bd);
    double *bk = malloc((size_t)(draws > 0 ? draws : 1) * sizeof *bk);
    if (!bd || !bk) {
        free(bd), free(bk);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for %lld bootstrap draws",
                       (long long)draws);
    }
    double den = (double)n * (double)scored;
    for (int64_t b = 0; b < draws; b++) {
        double sd = 0, sk = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t j = (int64_t)(mix_next(&seed) % (uint64_t)n);
            sd += d[j], sk += k[j];
        }
        bd[b] = expm1(sd / den), bk[b] = sk / den;
    }
    qsort(bd, (size_t)draws, sizeof *bd, cmp_double);
    qsort(bk, (size_t)draws, sizeof *bk, cmp_double);
    /* the 2.5th and 97.5th percentiles, by the nearest rank */
    int64_t lo = (int64_t)floor(0.025 * (double)draws), hi = (int64_t)ceil(0.975 * (double)draws) - 1;
    if (hi < lo) hi = lo;
    dppl_ci[0] = bd[lo], dppl_ci[1] = bd[hi], kl_ci[0] = bk[lo], kl_ci[1] = bk[hi];
    free(bd), free(bk);
    return KV_OK;
}

/* The runs of a comparison, each with its own forward state. */
enum { RUN_BASE, RUN_COMP, RUN_DEV, N_RUNS };
static const char *const run_name[N_RUNS] = {"base", "compressed", "device"};

/* Base, compressed (when with_comp: lr's latent cache on the CPU) and
 * device (when dev: attention through dev's hooks) on the same windows. */
static int compare(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                   int with_comp, const struct kv_fwd_hooks *dev, const struct kv_token_src *src,
                   int64_t seq_len, int64_t max_windows,
                   kv_progress_fn progress, void *progress_ctx, struct kv_compare_result *out,
                   struct kv_err *err) {
    kv_err_clear(err);
    int64_t n_tokens = src->n_tokens, windows;
    int rc = count_windows(n_tokens, seq_len, max_windows, &windows, err);
    if (rc) return rc;
    struct kv_fwd *f[N_RUNS] = {NULL};
    rc = kv_fwd_init(m, seq_len, &f[RUN_BASE], err);
    if (!rc && with_comp && !(rc = kv_fwd_init(m, seq_len, &f[RUN_COMP], err)))
        rc = kv_fwd_set_lowrank(f[RUN_COMP], lr, kv_bits, err);
    if (!rc && dev && !(rc = kv_fwd_init(m, seq_len, &f[RUN_DEV], err)))
        kv_fwd_set_hooks(f[RUN_DEV], dev);
    int64_t vocab = m->cfg.vocab_size, rows = slice_rows(seq_len, vocab);
    int sliced = rows < seq_len;
    for (int k = 0; k < N_RUNS && !rc; k++) /* windows from position 0 */
        if (f[k]) {
            kv_fwd_one_window(f[k]);
            if (sliced) kv_fwd_defer_head(f[k]);
        }
    double *rel = dev ? malloc((size_t)seq_len * sizeof *rel) : NULL;
    /* per window: compressed minus base nll, and KL, for the intervals */
    double *wdiff = with_comp ? malloc((size_t)(windows > 0 ? windows : 1) * 2 * sizeof *wdiff) : NULL;
    if (!rc && with_comp && !wdiff)
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for %lld windows' sums",
                     (long long)windows);
    if (!rc && dev && !rel)
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for %lld logit differences",
                     (long long)seq_len);
    double nll[N_RUNS] = {0}, sec[N_RUNS] = {0}, kl = 0, dkl = 0, best = -1;
    int64_t agree = 0, dagree = 0, best_w = 0, best_i = 0;
    for (int64_t w = 0; w < windows && !rc; w++) {
        const int32_t *tw;
        if ((rc = src->window(src->ctx, w, seq_len, &tw, err))) break;
        for (int k = 0; k < N_RUNS && !rc; k++) {
            if (!f[k]) continue;
            double t0 = kv_now();
            rc = kv_fwd_run(f[k], tw, seq_len, 0, NULL, err);
            sec[k] += kv_now() - t0;
            /* a hook's status comes back as is, with err untouched */
            if (rc && (!err || err->code == KV_OK))
                kv_fail(err, rc, NULL, KV_NO_OFFSET, "%s run failed in window %lld (tokens %lld..%lld)",
                        run_name[k], (long long)w, (long long)(w * seq_len),
                        (long long)((w + 1) * seq_len - 1));
        }
        if (rc) break;
        double sb = 0, sc = 0, sd = 0, sk = 0, skd = 0;
        int64_t ag = 0, agd = 0;
        for (int64_t i0 = 0; i0 < seq_len - 1 && !rc; i0 += rows) { /* one slice of positions */
            int64_t nr = seq_len - 1 - i0 < rows ? seq_len - 1 - i0 : rows;
            const float *lb = rows_of(f[RUN_BASE], sliced, i0, nr, vocab, &sec[RUN_BASE], &rc, err);
            const float *lc = rc ? NULL : rows_of(f[RUN_COMP], sliced, i0, nr, vocab, &sec[RUN_COMP], &rc, err);
            const float *ld = rc ? NULL : rows_of(f[RUN_DEV], sliced, i0, nr, vocab, &sec[RUN_DEV], &rc, err);
            if (rc) break;
            const float *lref = lc ? lc : lb; /* what the device run is compared with */
            const int32_t *tg = tw + i0 + 1;
            double *rl = rel ? rel + i0 : NULL;
            double b1 = 0, c1 = 0, d1 = 0, k1 = 0, kd1 = 0;
            int64_t ag1 = 0, agd1 = 0;
#pragma omp parallel for reduction(+ : b1, c1, d1, k1, kd1, ag1, agd1) schedule(static)
            for (int64_t i = 0; i < nr; i++) {
                const float *rb = lb + i * vocab;
                b1 += kv_nll_row(rb, vocab, tg[i]);
                if (lc) {
                    const float *rcmp = lc + i * vocab;
                    c1 += kv_nll_row(rcmp, vocab, tg[i]);
                    k1 += kl_row(rb, rcmp, vocab);
                    ag1 += argmax_row(rb, vocab) == argmax_row(rcmp, vocab);
                }
                if (ld) {
                    const float *rd = ld + i * vocab, *rr = lref + i * vocab;
                    d1 += kv_nll_row(rd, vocab, tg[i]);
                    kd1 += kl_row(rr, rd, vocab);
                    agd1 += argmax_row(rr, vocab) == argmax_row(rd, vocab);
                    rl[i] = rel_row(rr, rd, vocab);
                }
            }
            sb += b1, sc += c1, sd += d1, sk += k1, skd += kd1, ag += ag1, agd += agd1;
        }
        if (rc) break;
        int bad = !isfinite(sb) ? RUN_BASE
                  : !isfinite(sc) || !isfinite(sk) ? RUN_COMP
                  : !isfinite(sd) || !isfinite(skd) ? RUN_DEV : -1;
        if (bad >= 0) {
            rc = kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                         "non-finite loss in window %lld (tokens %lld..%lld) of the %s model",
                         (long long)w, (long long)(w * seq_len), (long long)((w + 1) * seq_len - 1),
                         run_name[bad]);
            break;
        }
        for (int64_t i = 0; rel && i < seq_len - 1; i++)
            if (!(rel[i] <= best)) best = rel[i], best_w = w, best_i = i;
        nll[RUN_BASE] += sb, nll[RUN_COMP] += sc, nll[RUN_DEV] += sd;
        if (wdiff) wdiff[w] = sc - sb, wdiff[windows + w] = sk;
        kl += sk, dkl += skd, agree += ag, dagree += agd;
        if (progress && progress(progress_ctx, w + 1, windows, (w + 1) * seq_len)) {
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "interrupted after %lld windows",
                         (long long)(w + 1));
            break;
        }
    }
    for (int k = 0; k < N_RUNS; k++) kv_fwd_free(f[k]);
    free(rel);
    if (rc) {
        free(wdiff);
        return rc;
    }
    int64_t scored = windows * (seq_len - 1);
    memset(out, 0, sizeof *out);
    struct kv_ppl_result *r[N_RUNS] = {&out->base, &out->comp, &out->dev};
    for (int k = 0; k < N_RUNS; k++) {
        if (k != RUN_BASE && (k == RUN_COMP ? !with_comp : !dev)) continue;
        r[k]->tokens = n_tokens, r[k]->windows = windows, r[k]->scored = scored;
        r[k]->nll_sum = nll[k], r[k]->nll = nll[k] / (double)scored;
        r[k]->ppl = exp(r[k]->nll), r[k]->seconds = sec[k];
    }
    if (with_comp) {
        out->kl = kl / (double)scored;
        out->top1 = (double)agree / (double)scored;
        rc = kv_bootstrap_ci(wdiff, wdiff + windows, windows, seq_len - 1, KV_BOOTSTRAP_DRAWS, 1,
                             out->dppl_ci, out->kl_ci, err);
        free(wdiff);
        if (rc) return rc;
    }
    if (dev) {
        out->has_dev = 1;
        out->max_rel_logit = best;
        out->max_rel_window = best_w, out->max_rel_pos = best_i;
        out->dev_kl = dkl / (double)scored;
        out->dev_top1 = (double)dagree / (double)scored;
    }
    return KV_OK;
}

int kv_ppl_compare(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                   const int32_t *tokens, int64_t n_tokens, int64_t seq_len,
                   int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
                   struct kv_compare_result *out, struct kv_err *err) {
    struct array_src a = {tokens};
    struct kv_token_src src = {array_window, &a, n_tokens};
    return compare(m, lr, kv_bits, 1, NULL, &src, seq_len, max_windows, progress, progress_ctx,
                   out, err);
}

int kv_ppl_compare_attn(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                        const struct kv_fwd_hooks *dev, const int32_t *tokens, int64_t n_tokens,
                        int64_t seq_len, int64_t max_windows, kv_progress_fn progress,
                        void *progress_ctx, struct kv_compare_result *out, struct kv_err *err) {
    if (!dev || !dev->attn)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "device hooks without an attn hook");
    struct array_src a = {tokens};
    struct kv_token_src src = {array_window, &a, n_tokens};
    return compare(m, lr, kv_bits, lr != NULL, dev, &src, seq_len, max_windows, progress,
                   progress_ctx, out, err);
}

int kv_ppl_compare_src(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                       const struct kv_fwd_hooks *dev, const struct kv_token_src *src,
                       int64_t seq_len, int64_t max_windows, kv_progress_fn progress,
                       void *progress_ctx, struct kv_compare_result *out, struct kv_err *err) {
    if (dev && !dev->attn)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "device hooks without an attn hook");
    if (!lr && !dev)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "a comparison needs a compressed model or device hooks");
    return compare(m, lr, kv_bits, lr != NULL, dev, src, seq_len, max_windows, progress,
                   progress_ctx, out, err);
}
