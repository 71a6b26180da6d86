/* Forward pass against a naive float64 reference written here from the
 * Llama definition (no BLAS, no shared code with lib/forward.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "naive_llama.h"
#include "testutil.h"

static void check_against_naive(struct kv_config c, int64_t n) {
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, 42, &m, &err), KV_OK, "%s", err.msg);
    sharpen(m);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 37 + 11) % c.vocab_size);
    struct kv_fwd *f;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", err.msg);
    double *ref = naive_forward(m, tok, n);
    float *reff = malloc((size_t)(n * c.vocab_size) * sizeof *reff);
    for (int64_t i = 0; i < n * c.vocab_size; i++) reff[i] = (float)ref[i];
    kvt_assert_close_f32(kv_fwd_logits(f), reff, n * c.vocab_size, 2e-5, 1e-4, "logits");
    free(reff), free(ref), free(tok);
    kv_fwd_free(f);
    kv_model_free(m);
}

Test(forward, matches_naive_interleaved_rope_gqa) { check_against_naive(tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), 40); }
Test(forward, matches_naive_rotate_half_with_bias_untied) { check_against_naive(tiny_cfg(KV_ROPE_HALF, 1, 0), 40); }
Test(forward, matches_naive_across_query_blocks) {
    /* more rows than one attention block (128) exercises the block loop */
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c.n_layers = 1;
    check_against_naive(c, 150);
}

Test(forward, rope_layouts_differ) {
    /* guard against a test that cannot tell the layouts apart */
    struct kv_config a = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), b = tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_model *ma, *mb;
    struct kv_err err;
    kv_model_init_random(&a, 7, &ma, &err);
    kv_model_init_random(&b, 7, &mb, &err);
    sharpen(ma), sharpen(mb);
    int32_t tok[16];
    for (int i = 0; i < 16; i++) tok[i] = (i * 5 + 3) % 97;
    struct kv_fwd *fa, *fb;
    kv_fwd_init(ma, 16, &fa, &err);
    kv_fwd_init(mb, 16, &fb, &err);
    kv_fwd_run(fa, tok, 16, 0, NULL, &err);
    kv_fwd_run(fb, tok, 16, 0, NULL, &err);
    double diff = 0;
    for (int i = 0; i < 16 * 97; i++) diff = fmax(diff, fabs(kv_fwd_logits(fa)[i] - kv_fwd_logits(fb)[i]));
    cr_assert_gt(diff, 1e-3, "interleaved and rotate-half gave the same logits (max diff %g)", diff);
    kv_fwd_free(fa), kv_fwd_free(fb), kv_model_free(ma), kv_model_free(mb);
}

Test(forward, incremental_cache_equals_whole_window) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 1, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 3, &m, &err);
    sharpen(m);
    int64_t n = 24;
    int32_t tok[24];
    for (int i = 0; i < n; i++) tok[i] = (i * 13 + 5) % 97;
    struct kv_fwd *whole, *inc;
    kv_fwd_init(m, n, &whole, &err);
    kv_fwd_init(m, n, &inc, &err);
    kv_fwd_run(whole, tok, n, 0, NULL, &err);
    float *step = malloc((size_t)(n * 97) * sizeof *step);
    /* prefill 10, then one token at a time */
    cr_assert_eq(kv_fwd_run(inc, tok, 10, 0, step, &err), KV_OK);
    for (int64_t p = 10; p < n; p++)
        cr_assert_eq(kv_fwd_run(inc, tok + p, 1, p, step + p * 97, &err), KV_OK);
    kvt_assert_close_f32(step, kv_fwd_logits(whole), n * 97, 1e-5, 1e-4, "incremental logits");
    free(step);
    kv_fwd_free(whole), kv_fwd_free(inc), kv_model_free(m);
}

struct hook_rec {
    int calls_x, calls_qk, calls_kv;
    double x_sum;
};
static int h_x(void *ctx, int64_t l, const float *x, int64_t n, int64_t pos0) {
    struct hook_rec *r = ctx;
    r->calls_x++;
    for (int64_t i = 0; i < n * 48; i++) r->x_sum += x[i];
    return 0;
}
static int h_qk(void *ctx, int64_t l, const float *q, const float *k, int64_t n, int64_t pos0) {
    ((struct hook_rec *)ctx)->calls_qk++;
    return 0;
}
static int h_kv_zero(void *ctx, int64_t l, const float *x, float *k, float *v, int64_t n, int64_t pos0) {
    ((struct hook_rec *)ctx)->calls_kv++;
    memset(v, 0, (size_t)(n * 16) * sizeof *v); /* g*d_h = 16 */
    return 0;
}

Test(forward, hooks_fire_and_kv_replacement_takes_effect) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 5, &m, &err);
    int32_t tok[12];
    for (int i = 0; i < 12; i++) tok[i] = (i * 7 + 2) % 97;
    struct kv_fwd *f;
    kv_fwd_init(m, 12, &f, &err);
    kv_fwd_run(f, tok, 12, 0, NULL, &err);
    float *base = malloc(12 * 97 * sizeof *base);
    memcpy(base, kv_fwd_logits(f), 12 * 97 * sizeof *base);
    struct hook_rec rec = {0};
    struct kv_fwd_hooks hk = {&rec, h_x, h_qk, h_kv_zero};
    kv_fwd_set_hooks(f, &hk);
    kv_fwd_run(f, tok, 12, 0, NULL, &err);
    cr_assert_eq(rec.calls_x, 2);
    cr_assert_eq(rec.calls_qk, 2);
    cr_assert_eq(rec.calls_kv, 2);
    cr_assert(isfinite(rec.x_sum) && rec.x_sum != 0);
    /* with V zeroed attention contributes nothing: logits must change */
    double diff = 0;
    for (int i = 0; i < 12 * 97; i++) diff = fmax(diff, fabs(kv_fwd_logits(f)[i] - base[i]));
    cr_assert_gt(diff, 1e-4);
    free(base);
    kv_fwd_free(f), kv_model_free(m);
}

Test(forward, rejects_out_of_vocab_and_overflowing_positions) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 5, &m, &err);
    struct kv_fwd *f;
    kv_fwd_init(m, 8, &f, &err);
    int32_t tok[9] = {1, 2, 3, 97, 4, 5, 6, 7, 8};
    cr_assert_eq(kv_fwd_run(f, tok, 4, 0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "token id 97 at position 3 is outside the vocabulary of 97");
    cr_assert_eq(kv_fwd_run(f, tok, 9, 0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "positions 0..8 exceed the context of 8");
    kv_fwd_free(f), kv_model_free(m);
}


Test(forward, more_threads_after_init_stay_within_the_scratch_buffers) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 5, &m, &err);
    int32_t tok[64];
    for (int i = 0; i < 64; i++) tok[i] = (i * 7 + 2) % 97;
    kv_set_threads(1);
    struct kv_fwd *f;
    kv_fwd_init(m, 64, &f, &err);
    kv_fwd_run(f, tok, 64, 0, NULL, &err);
    float *one = malloc(64 * 97 * sizeof *one);
    memcpy(one, kv_fwd_logits(f), 64 * 97 * sizeof *one);
    kv_set_threads(8); /* more than the state was sized for */
    cr_assert_eq(kv_fwd_run(f, tok, 64, 0, NULL, &err), KV_OK);
    kvt_assert_close_f32(kv_fwd_logits(f), one, 64 * 97, 1e-6, 1e-5, "logits after raising threads");
    free(one);
    kv_fwd_free(f), kv_model_free(m);
}
