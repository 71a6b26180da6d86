/* Perplexity: the windows protocol against a naive oracle, and the
 * reference values of independent float64 runs on the shared models. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "naive_llama.h"
#include "testutil.h"

Test(ppl, equals_naive_nll_over_windows) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 11, &m, &err);
    sharpen(m);
    int64_t n = 70, T = 16; /* 4 windows, remainder 6 dropped */
    int32_t tok[70];
    for (int i = 0; i < n; i++) tok[i] = (i * 29 + 1) % 97;
    struct kv_ppl_result r;
    cr_assert_eq(kv_ppl_run(m, tok, n, T, 0, NULL, NULL, &r, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(r.windows, 4);
    cr_assert_eq(r.scored, 4 * 15);
    double nll = 0;
    for (int64_t w = 0; w < 4; w++) {
        double *lg = naive_forward(m, tok + w * T, T);
        for (int64_t i = 0; i + 1 < T; i++) {
            const double *row = lg + i * 97;
            double mx = row[0], z = 0;
            for (int j = 1; j < 97; j++) mx = fmax(mx, row[j]);
            for (int j = 0; j < 97; j++) z += exp(row[j] - mx);
            nll += log(z) + mx - row[tok[w * T + i + 1]];
        }
        free(lg);
    }
    nll /= 60;
    kvt_assert_close_f64(&r.nll, &nll, 1, 1e-6, 1e-5, "mean nll");
    cr_assert_float_eq(r.ppl, exp(r.nll), 1e-12);
    cr_assert_eq(kv_ppl_run(m, tok, n, T, 2, NULL, NULL, &r, &err), KV_OK);
    cr_assert_eq(r.windows, 2);
    cr_assert_eq(kv_ppl_run(m, tok, 10, T, 0, NULL, NULL, &r, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "text has 10 tokens, fewer than one window of 16");
    kv_model_free(m);
}

/* Reference values from a separate float64 implementation (issue 2). */
static void check_reference(const char *model, const char *tok, const char *text, double want,
                            int64_t want_tokens, int64_t want_windows, int64_t want_scored) {
    KVT_NEED_SHARED(mp, model);
    char mpath[4096], tpath[4096], kpath[4096];
    snprintf(mpath, sizeof mpath, "%s", mp);
    KVT_NEED_SHARED(tp, text);
    snprintf(tpath, sizeof tpath, "%s", tp);
    if (tok) {
        KVT_NEED_SHARED(kp, tok);
        snprintf(kpath, sizeof kpath, "%s", kp);
    }
    kv_set_threads(1);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(mpath, tok ? kpath : NULL, &m, &err), KV_OK, "%s", err.msg);
    char *txt;
    size_t len;
    cr_assert_eq(kv_text_read(tpath, &txt, &len, &err), KV_OK);
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(kv_model_tokenizer(m), txt, len, 1, &ids, &n, &err), KV_OK);
    struct kv_ppl_result r;
    cr_assert_eq(kv_ppl_run(m, ids, n, 256, 0, NULL, NULL, &r, &err), KV_OK, "%s", err.msg);
    if (want_tokens) cr_assert_eq(r.tokens, want_tokens);
    if (want_windows) cr_assert_eq(r.windows, want_windows);
    if (want_scored) cr_assert_eq(r.scored, want_scored);
    cr_assert_eq(r.windows, n / 256);
    kvt_assert_close_f64(&r.ppl, &want, 1, 0, 5e-4, "perplexity (0.05% of the reference)");
    free(ids), free(txt);
    kv_model_free(m);
}

Test(ppl_reference, stories260K_val1k, .timeout = 600) {
    check_reference("models/stories260K/stories260K.bin", "models/stories260K/tok512.bin",
                    "text/tinystories/val1k.txt", 7.6905, 404019, 1578, 0);
}
Test(ppl_reference, stories260K_wikitext2, .timeout = 600) {
    check_reference("models/stories260K/stories260K.gguf", NULL,
                    "text/wikitext-2-raw/wiki.test.raw", 112.736, 0, 3161, 806055);
}
Test(ppl_reference, tinystories656K_val1k, .timeout = 600) {
    check_reference("models/tinystories-656K", NULL, "text/tinystories/val1k.txt", 54.178, 0, 0, 0);
}
Test(ppl_reference, tinystories656K_wikitext2, .timeout = 600) {
    check_reference("models/tinystories-656K", NULL, "text/wikitext-2-raw/wiki.test.raw", 835.69, 0,
                    0, 0);
}
