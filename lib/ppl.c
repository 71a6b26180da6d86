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

int kv_ppl_run(const struct kv_model *m, const int32_t *tokens, int64_t n_tokens,
               int64_t seq_len, int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
               struct kv_ppl_result *out, struct kv_err *err) {
    if (seq_len < 2)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "seq-len %lld is too short, need at least 2",
                       (long long)seq_len);
    int64_t windows = n_tokens / seq_len;
    if (windows == 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "text has %lld tokens, fewer than one window of %lld", (long long)n_tokens,
                       (long long)seq_len);
    if (max_windows > 0 && max_windows < windows) windows = max_windows;
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
