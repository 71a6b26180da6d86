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

/* The device run's own measures, outside the per-window sums. */
struct dev_extra {
    double best;          /* largest relative logit difference, -1 before any */
    int64_t best_w, best_i;
};

/* Base, compressed (lr's latent cache, or mla's attention, on the CPU) and
 * device (when dev: attention through dev's hooks) on windows w of
 * 0..windows-1 with w % part_n == part_i, each window's sums into its row
 * of sums (KV_PPL_SUMS columns), the forward passes' seconds into sec.
 * Every sum of a window is taken position by position in order, so a row
 * does not depend on the thread count nor on which process ran it. */
static int compare(const struct kv_model *m, const struct kv_lowrank *lr, const struct kv_mla *mla,
                   int kv_bits, const struct kv_fwd_hooks *dev, const struct kv_token_src *src,
                   int64_t seq_len, int64_t windows, int64_t part_i, int64_t part_n,
                   kv_progress_fn progress, void *progress_ctx, double *sums,
                   double sec[N_RUNS], struct dev_extra *dx, struct kv_err *err) {
    kv_err_clear(err);
    struct kv_fwd *f[N_RUNS] = {NULL};
    int rc = kv_fwd_init(m, seq_len, &f[RUN_BASE], err);
    if (!rc && (lr || mla) && !(rc = kv_fwd_init(m, seq_len, &f[RUN_COMP], err)))
        rc = mla ? kv_fwd_set_mla(f[RUN_COMP], mla, err) : kv_fwd_set_lowrank(f[RUN_COMP], lr, kv_bits, err);
    if (!rc && dev && !(rc = kv_fwd_init(m, seq_len, &f[RUN_DEV], err)))
        kv_fwd_set_hooks(f[RUN_DEV], dev);
    int64_t vocab = m->cfg.vocab_size, rows = slice_rows(seq_len, vocab);
    int sliced = rows < seq_len;
    for (int k = 0; k < N_RUNS && !rc; k++) /* windows from position 0 */
        if (f[k]) {
            kv_fwd_one_window(f[k]);
            if (sliced) kv_fwd_defer_head(f[k]);
        }
    /* per position of a window: each column's term, and the device's
     * relative logit difference */
    double *pos = rc ? NULL : malloc((size_t)seq_len * (KV_PPL_SUMS + 1) * sizeof *pos);
    if (!rc && !pos)
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for %lld positions' sums",
                     (long long)seq_len);
    double *rel = pos ? pos + seq_len * KV_PPL_SUMS : NULL;
    int64_t mine = part_n > 0 && part_i < windows ? (windows - part_i + part_n - 1) / part_n : 0, done = 0;
    for (int64_t w = part_i; w < windows && !rc; w += part_n) {
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
        for (int64_t i0 = 0; i0 < seq_len - 1 && !rc; i0 += rows) { /* one slice of positions */
            int64_t nr = seq_len - 1 - i0 < rows ? seq_len - 1 - i0 : rows;
            const float *lb = rows_of(f[RUN_BASE], sliced, i0, nr, vocab, &sec[RUN_BASE], &rc, err);
            const float *lc = rc ? NULL : rows_of(f[RUN_COMP], sliced, i0, nr, vocab, &sec[RUN_COMP], &rc, err);
            const float *ld = rc ? NULL : rows_of(f[RUN_DEV], sliced, i0, nr, vocab, &sec[RUN_DEV], &rc, err);
            if (rc) break;
            const float *lref = lc ? lc : lb; /* what the device run is compared with */
            const int32_t *tg = tw + i0 + 1;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < nr; i++) {
                double *p = pos + (i0 + i) * KV_PPL_SUMS;
                const float *rb = lb + i * vocab;
                for (int c = 0; c < KV_PPL_SUMS; c++) p[c] = 0;
                p[KV_PPL_BASE] = kv_nll_row(rb, vocab, tg[i]);
                if (lc) {
                    const float *rcmp = lc + i * vocab;
                    p[KV_PPL_COMP] = kv_nll_row(rcmp, vocab, tg[i]);
                    p[KV_PPL_KL] = kl_row(rb, rcmp, vocab);
                    p[KV_PPL_AGREE] = argmax_row(rb, vocab) == argmax_row(rcmp, vocab);
                }
                if (ld) {
                    const float *rd = ld + i * vocab, *rr = lref + i * vocab;
                    p[KV_PPL_DEV] = kv_nll_row(rd, vocab, tg[i]);
                    p[KV_PPL_DEV_KL] = kl_row(rr, rd, vocab);
                    p[KV_PPL_DEV_AGREE] = argmax_row(rr, vocab) == argmax_row(rd, vocab);
                    rel[i0 + i] = rel_row(rr, rd, vocab);
                }
            }
        }
        if (rc) break;
        double *row = sums + w * KV_PPL_SUMS;
        for (int c = 0; c < KV_PPL_SUMS; c++) row[c] = 0;
        for (int64_t i = 0; i < seq_len - 1; i++)
            for (int c = 0; c < KV_PPL_SUMS; c++) row[c] += pos[i * KV_PPL_SUMS + c];
        int bad = !isfinite(row[KV_PPL_BASE]) ? RUN_BASE
                  : !isfinite(row[KV_PPL_COMP]) || !isfinite(row[KV_PPL_KL]) ? RUN_COMP
                  : !isfinite(row[KV_PPL_DEV]) || !isfinite(row[KV_PPL_DEV_KL]) ? RUN_DEV : -1;
        if (bad >= 0) {
            rc = kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                         "non-finite loss in window %lld (tokens %lld..%lld) of the %s model",
                         (long long)w, (long long)(w * seq_len), (long long)((w + 1) * seq_len - 1),
                         run_name[bad]);
            break;
        }
        for (int64_t i = 0; dev && i < seq_len - 1; i++)
            if (!(rel[i] <= dx->best)) dx->best = rel[i], dx->best_w = w, dx->best_i = i;
        done++;
        if (progress && progress(progress_ctx, done, mine, done * seq_len)) {
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "interrupted after %lld windows",
                         (long long)done);
            break;
        }
    }
    for (int k = 0; k < N_RUNS; k++) kv_fwd_free(f[k]);
    free(pos);
    return rc;
}

int kv_ppl_windows(int64_t n_tokens, int64_t seq_len, int64_t max_windows, int64_t *windows,
                   struct kv_err *err) {
    return count_windows(n_tokens, seq_len, max_windows, windows, err);
}

int kv_ppl_compare_part(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                        const struct kv_token_src *src, int64_t seq_len, int64_t max_windows,
                        int64_t part_index, int64_t part_count, kv_progress_fn progress,
                        void *progress_ctx, double *sums, double seconds[2], struct kv_err *err) {
    int64_t windows;
    int rc = count_windows(src->n_tokens, seq_len, max_windows, &windows, err);
    if (rc) return rc;
    if (part_count < 1 || part_index < 0 || part_index >= part_count)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "part %lld of %lld does not exist",
                       (long long)part_index, (long long)part_count);
    double sec[N_RUNS] = {0};
    rc = compare(m, lr, NULL, kv_bits, NULL, src, seq_len, windows, part_index, part_count,
                 progress, progress_ctx, sums, sec, NULL, err);
    seconds[0] = sec[RUN_BASE], seconds[1] = sec[RUN_COMP];
    return rc;
}

/* One run's totals from the sums' column col, in window order. */
static void run_totals(const double *sums, int col, int64_t windows, int64_t n_tokens,
                       int64_t seq_len, double seconds, struct kv_ppl_result *r) {
    double nll = 0;
    for (int64_t w = 0; w < windows; w++) nll += sums[w * KV_PPL_SUMS + col];
    r->tokens = n_tokens, r->windows = windows, r->scored = windows * (seq_len - 1);
    r->nll_sum = nll, r->nll = nll / (double)r->scored;
    r->ppl = exp(r->nll), r->seconds = seconds;
}

static double column_sum(const double *sums, int col, int64_t windows) {
    double s = 0;
    for (int64_t w = 0; w < windows; w++) s += sums[w * KV_PPL_SUMS + col];
    return s;
}

int kv_ppl_compare_finish(const double *sums, int64_t windows, int64_t n_tokens, int64_t seq_len,
                          int with_comp, const double seconds[2], struct kv_compare_result *out,
                          struct kv_err *err) {
    memset(out, 0, sizeof *out);
    if (windows < 1 || seq_len < 2)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "no windows to sum (%lld of %lld tokens)",
                       (long long)windows, (long long)seq_len);
    run_totals(sums, KV_PPL_BASE, windows, n_tokens, seq_len, seconds[0], &out->base);
    if (!with_comp) return KV_OK;
    run_totals(sums, KV_PPL_COMP, windows, n_tokens, seq_len, seconds[1], &out->comp);
    double scored = (double)out->base.scored;
    out->kl = column_sum(sums, KV_PPL_KL, windows) / scored;
    out->top1 = column_sum(sums, KV_PPL_AGREE, windows) / scored;
    /* per window: compressed minus base nll, and KL, for the intervals */
    double *d = malloc((size_t)windows * 2 * sizeof *d);
    if (!d)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for %lld windows' sums",
                       (long long)windows);
    for (int64_t w = 0; w < windows; w++) {
        const double *row = sums + w * KV_PPL_SUMS;
        d[w] = row[KV_PPL_COMP] - row[KV_PPL_BASE], d[windows + w] = row[KV_PPL_KL];
    }
    int rc = kv_bootstrap_ci(d, d + windows, windows, seq_len - 1, KV_BOOTSTRAP_DRAWS, 1,
                             out->dppl_ci, out->kl_ci, err);
    free(d);
    return rc;
}

/* The whole comparison in one process: every window, then the totals. */
static int compare_all(const struct kv_model *m, const struct kv_lowrank *lr,
                       const struct kv_mla *mla, int kv_bits,
                       const struct kv_fwd_hooks *dev, const struct kv_token_src *src,
                       int64_t seq_len, int64_t max_windows, kv_progress_fn progress,
                       void *progress_ctx, struct kv_compare_result *out, struct kv_err *err) {
    kv_err_clear(err);
    int64_t windows;
    int rc = count_windows(src->n_tokens, seq_len, max_windows, &windows, err);
    if (rc) return rc;
    double *sums = calloc((size_t)windows * KV_PPL_SUMS, sizeof *sums);
    if (!sums)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for %lld windows' sums",
                       (long long)windows);
    double sec[N_RUNS] = {0};
    struct dev_extra dx = {-1, 0, 0};
    int with_comp = lr != NULL || mla != NULL;
    rc = compare(m, lr, mla, kv_bits, dev, src, seq_len, windows, 0, 1, progress,
                 progress_ctx, sums, sec, &dx, err);
    if (!rc) rc = kv_ppl_compare_finish(sums, windows, src->n_tokens, seq_len, with_comp, sec, out, err);
    if (!rc && dev) {
        run_totals(sums, KV_PPL_DEV, windows, src->n_tokens, seq_len, sec[RUN_DEV], &out->dev);
        double scored = (double)out->dev.scored;
        out->has_dev = 1;
        out->max_rel_logit = dx.best;
        out->max_rel_window = dx.best_w, out->max_rel_pos = dx.best_i;
        out->dev_kl = column_sum(sums, KV_PPL_DEV_KL, windows) / scored;
        out->dev_top1 = column_sum(sums, KV_PPL_DEV_AGREE, windows) / scored;
    }
    free(sums);
    return rc;
}

int kv_ppl_run_src(const struct kv_model *m, const struct kv_token_src *src, int64_t seq_len,
                   int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
                   struct kv_ppl_result *out, struct kv_err *err) {
    struct kv_compare_result r;
    int rc = compare_all(m, NULL, NULL, 16, NULL, src, seq_len, max_windows, progress, progress_ctx, &r, err);
    if (!rc) *out = r.base;
    return rc;
}

int kv_ppl_compare(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                   const int32_t *tokens, int64_t n_tokens, int64_t seq_len,
                   int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
                   struct kv_compare_result *out, struct kv_err *err) {
    struct array_src a = {tokens};
    struct kv_token_src src = {array_window, &a, n_tokens};
    return compare_all(m, lr, NULL, kv_bits, NULL, &src, seq_len, max_windows, progress, progress_ctx,
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
    return compare_all(m, lr, NULL, kv_bits, dev, &src, seq_len, max_windows, progress, progress_ctx,
                       out, err);
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
    return compare_all(m, lr, NULL, kv_bits, dev, src, seq_len, max_windows, progress, progress_ctx,
                       out, err);
}

int kv_ppl_compare_mla_src(const struct kv_model *m, const struct kv_mla *mla,
                           const struct kv_token_src *src, int64_t seq_len, int64_t max_windows,
                           kv_progress_fn progress, void *progress_ctx,
                           struct kv_compare_result *out, struct kv_err *err) {
    return compare_all(m, NULL, mla, 16, NULL, src, seq_len, max_windows, progress, progress_ctx,
                       out, err);
}
