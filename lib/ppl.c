/* Perplexity under the windows protocol (DESIGN §8). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <time.h>

#include "err.h"
#include "model.h"

double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Windows of the protocol: n_tokens / seq_len, at most max_windows (> 0). */
static int count_windows(int64_t n_tokens, int64_t seq_len, int64_t max_windows, int64_t *out,
                         struct kv_err *err) {
    if (seq_len < 2)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "seq-len %lld is too short, need at least 2",
                       (long long)seq_len);
    int64_t windows = n_tokens / seq_len;
    if (windows == 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "text has %lld tokens, fewer than one window of %lld", (long long)n_tokens,
                       (long long)seq_len);
    *out = max_windows > 0 && max_windows < windows ? max_windows : windows;
    return KV_OK;
}

int kv_ppl_run(const struct kv_model *m, const int32_t *tokens, int64_t n_tokens,
               int64_t seq_len, int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
               struct kv_ppl_result *out, struct kv_err *err) {
    int64_t windows;
    int rc0 = count_windows(n_tokens, seq_len, max_windows, &windows, err);
    if (rc0) return rc0;
    struct kv_fwd *f;
    int rc = kv_fwd_init(m, seq_len, &f, err);
    if (rc) return rc;
    int64_t vocab = m->cfg.vocab_size;
    double nll = 0, t0 = kv_now();
    for (int64_t w = 0; w < windows; w++) {
        const int32_t *tw = tokens + w * seq_len;
        rc = kv_fwd_run(f, tw, seq_len, 0, NULL, err);
        if (rc) break;
        const float *lg = kv_fwd_logits(f);
        double s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
        for (int64_t i = 0; i < seq_len - 1; i++) s += kv_nll_row(lg + i * vocab, vocab, tw[i + 1]);
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

int kv_ppl_compare(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                   const int32_t *tokens, int64_t n_tokens, int64_t seq_len,
                   int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
                   struct kv_compare_result *out, struct kv_err *err) {
    int64_t windows;
    int rc0 = count_windows(n_tokens, seq_len, max_windows, &windows, err);
    if (rc0) return rc0;
    struct kv_fwd *fb = NULL, *fc = NULL;
    int rc = kv_fwd_init(m, seq_len, &fb, err);
    if (!rc) rc = kv_fwd_init(m, seq_len, &fc, err);
    if (!rc) rc = kv_fwd_set_lowrank(fc, lr, kv_bits, err);
    int64_t vocab = m->cfg.vocab_size;
    double nb = 0, nc = 0, kl = 0, tb = 0, tc = 0;
    int64_t agree = 0;
    for (int64_t w = 0; w < windows && !rc; w++) {
        const int32_t *tw = tokens + w * seq_len;
        double t0 = kv_now();
        if ((rc = kv_fwd_run(fb, tw, seq_len, 0, NULL, err))) break;
        double t1 = kv_now();
        if ((rc = kv_fwd_run(fc, tw, seq_len, 0, NULL, err))) break;
        tb += t1 - t0, tc += kv_now() - t1;
        const float *lb = kv_fwd_logits(fb), *lc = kv_fwd_logits(fc);
        double sb = 0, sc = 0, sk = 0;
        int64_t ag = 0;
#pragma omp parallel for reduction(+ : sb, sc, sk, ag) schedule(static)
        for (int64_t i = 0; i < seq_len - 1; i++) {
            const float *rb = lb + i * vocab, *rcmp = lc + i * vocab;
            sb += kv_nll_row(rb, vocab, tw[i + 1]);
            sc += kv_nll_row(rcmp, vocab, tw[i + 1]);
            sk += kl_row(rb, rcmp, vocab);
            ag += argmax_row(rb, vocab) == argmax_row(rcmp, vocab);
        }
        if (!isfinite(sb) || !isfinite(sc) || !isfinite(sk)) {
            rc = kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                         "non-finite loss in window %lld (tokens %lld..%lld) of the %s model",
                         (long long)w, (long long)(w * seq_len), (long long)((w + 1) * seq_len - 1),
                         isfinite(sb) ? "compressed" : "base");
            break;
        }
        nb += sb, nc += sc, kl += sk, agree += ag;
        if (progress && progress(progress_ctx, w + 1, windows, (w + 1) * seq_len)) {
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "interrupted after %lld windows",
                         (long long)(w + 1));
            break;
        }
    }
    kv_fwd_free(fb);
    kv_fwd_free(fc);
    if (rc) return rc;
    int64_t scored = windows * (seq_len - 1);
    struct kv_ppl_result *r[2] = {&out->base, &out->comp};
    double nll[2] = {nb, nc}, sec[2] = {tb, tc};
    for (int i = 0; i < 2; i++) {
        r[i]->tokens = n_tokens, r[i]->windows = windows, r[i]->scored = scored;
        r[i]->nll_sum = nll[i], r[i]->nll = nll[i] / (double)scored;
        r[i]->ppl = exp(r[i]->nll), r[i]->seconds = sec[i];
    }
    out->kl = kl / (double)scored;
    out->top1 = (double)agree / (double)scored;
    return KV_OK;
}
