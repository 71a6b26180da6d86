/* Forward pass against naive float64 references written from the Llama and
 * GPT-2 definitions (no BLAS, no shared code with lib/forward.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lrmodel.h"
#include "model.h"
#include "naive_gpt2.h"
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
    kv_model_close(m);
}

/* The largest |Δ logit| between random models of configs a and b (the same
 * seed, sharpened) on n tokens, over positions < split into *first and the
 * rest into *later. */
static void logit_diff(struct kv_config a, struct kv_config b, int64_t n, int64_t split,
                       double *first, double *later) {
    struct kv_model *ma, *mb;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&a, 7, &ma, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_init_random(&b, 7, &mb, &err), KV_OK, "%s", err.msg);
    sharpen(ma), sharpen(mb);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 5 + 3) % a.vocab_size);
    struct kv_fwd *fa, *fb;
    cr_assert_eq(kv_fwd_init(ma, n, &fa, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_init(mb, n, &fb, &err), KV_OK, "%s", err.msg);
    kv_fwd_run(fa, tok, n, 0, NULL, &err);
    kv_fwd_run(fb, tok, n, 0, NULL, &err);
    *first = *later = 0;
    for (int64_t i = 0; i < n * a.vocab_size; i++) {
        double dd = fabs(kv_fwd_logits(fa)[i] - kv_fwd_logits(fb)[i]);
        if (i < split * a.vocab_size) *first = fmax(*first, dd);
        else *later = fmax(*later, dd);
    }
    free(tok);
    kv_fwd_free(fa), kv_fwd_free(fb), kv_model_close(ma), kv_model_close(mb);
}

Test(forward, matches_naive_interleaved_rope_gqa) { check_against_naive(tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), 40); }
Test(forward, matches_naive_rotate_half_with_bias_untied) { check_against_naive(tiny_cfg(KV_ROPE_HALF, 1, 0), 40); }
/* A hidden width of 8192 makes the FFN run in blocks of 1024 rows (its
 * 32 MiB of activations), so 1100 tokens take two blocks. */
Test(forward, matches_naive_across_ffn_row_blocks, .timeout = 120) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 1, 0);
    c.hidden_dim = 8192, c.n_layers = 1, c.max_seq_len = 1100;
    check_against_naive(c, 1100);
}

Test(forward, matches_naive_across_query_blocks) {
    /* more rows than one attention block (128) exercises the block loop */
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c.n_layers = 1;
    check_against_naive(c, 150);
}

/* Every rope scaling, at contexts short enough that its bands fall inside
 * a 40-token window of 8-wide heads, against the oracle's llama.cpp-style
 * angles; each must also change the logits. */
static struct kv_config scaled_cfg(enum kv_rope_scaling t) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 1, 0);
    c.n_layers = 1;
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = t, s->factor = 4, s->original_ctx = 48;
    s->low_freq_factor = 1, s->high_freq_factor = 4;
    s->beta_fast = 32, s->beta_slow = 1, s->truncate = 1;
    s->n_factors = c.head_dim / 2;
    for (int64_t i = 0; i < s->n_factors; i++)
        s->short_factor[i] = 1.0f + 1.5f * (float)i, s->long_factor[i] = 3.0f + (float)i;
    if (t == KV_ROPE_SCALING_YARN) c.rope_theta = 100.0f, s->original_ctx = 32;
    /* wavelengths 6.3, 63, 628, 6283: one kept, one mixed, two divided */
    if (t == KV_ROPE_SCALING_LLAMA3) s->low_freq_factor = 0.1;
    return c;
}

Test(forward, matches_naive_under_every_rope_scaling) {
    enum kv_rope_scaling types[] = {KV_ROPE_SCALING_LINEAR,   KV_ROPE_SCALING_DYNAMIC,
                                    KV_ROPE_SCALING_LLAMA3,   KV_ROPE_SCALING_YARN,
                                    KV_ROPE_SCALING_LONGROPE, KV_ROPE_SCALING_FREQS};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        struct kv_config c = scaled_cfg(types[k]);
        check_against_naive(c, 40);
        /* and the scaling shows in the logits */
        struct kv_config plain = c;
        plain.rope_scaling.type = KV_ROPE_SCALING_NONE;
        double none, diff;
        logit_diff(c, plain, 40, 0, &none, &diff);
        /* dynamic is plain RoPE within its original context */
        if (types[k] == KV_ROPE_SCALING_DYNAMIC)
            cr_assert_eq(diff, 0, "dynamic changed a window inside its context (%g)", diff);
        else
            cr_assert_gt(diff, 1e-3, "rope scaling '%s' left the logits alone (max diff %g)",
                         kv_rope_scaling_name(types[k]), diff);
    }
}

/* Sliding windows (Mistral: every layer; Gemma 2: every other layer) against
 * the oracle's mask, and the window must matter at this length. */
Test(forward, matches_naive_with_sliding_windows) {
    struct {
        int64_t w;
        int32_t from, period;
    } rows[] = {{5, 0, 1}, {7, 0, 2}, {3, 1, 1}};
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        struct kv_config c = tiny_cfg(KV_ROPE_HALF, 1, 0);
        c.sliding_window = rows[k].w, c.window_from = rows[k].from, c.window_period = rows[k].period;
        check_against_naive(c, 40);
        check_against_naive(c, 150); /* windows across query blocks */
    }
    struct kv_config a = tiny_cfg(KV_ROPE_HALF, 1, 0), b = a;
    b.sliding_window = 5, b.window_period = 1;
    double first, later;
    logit_diff(a, b, 40, 5, &first, &later);
    cr_assert_eq(first, 0, "positions inside the window changed (%g)", first);
    cr_assert_gt(later, 1e-3, "the window changed nothing (max diff %g)", later);
}

/* Qwen3: per-head RMSNorm of q and k before RoPE, norms away from 1 */
Test(forward, matches_naive_with_per_head_qk_norms) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 1, 0);
    c.arch = KV_ARCH_QWEN3;
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, 42, &m, &err), KV_OK, "%s", err.msg);
    kv_model_close(m);
    check_against_naive(c, 40);
}

Test(forward, refuses_a_length_dependent_scaling_past_its_context) {
    struct kv_config c = scaled_cfg(KV_ROPE_SCALING_LONGROPE);
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, 7, &m, &err), KV_OK, "%s", err.msg);
    struct kv_fwd *f;
    cr_assert_eq(kv_fwd_init(m, 49, &f, &err), KV_EUNSUPPORTED);
    cr_assert_str_eq(err.msg,
                     "rope scaling 'longrope' changes its frequencies with the sequence length; "
                     "sequences longer than its original context (48) are not supported, found 49");
    cr_assert_eq(kv_fwd_init(m, 48, &f, &err), KV_OK, "%s", err.msg);
    kv_fwd_free(f);
    kv_model_close(m);
}

Test(forward, rope_layouts_differ) {
    /* guard against a test that cannot tell the layouts apart */
    struct kv_config a = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), b = tiny_cfg(KV_ROPE_HALF, 0, 1);
    double none, diff;
    logit_diff(a, b, 16, 0, &none, &diff);
    cr_assert_gt(diff, 1e-3, "interleaved and rotate-half gave the same logits (max diff %g)", diff);
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
    kv_fwd_free(whole), kv_fwd_free(inc), kv_model_close(m);
}

Test(forward, a_deferred_head_gives_the_logits_of_any_rows) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 1, 0);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, 5, &m, &err), KV_OK);
    sharpen(m);
    int64_t n = 24, V = c.vocab_size;
    int32_t tok[24];
    for (int i = 0; i < n; i++) tok[i] = (i * 7 + 3) % 97;
    struct kv_fwd *whole, *def;
    cr_assert_eq(kv_fwd_init(m, n, &whole, &err), KV_OK);
    cr_assert_eq(kv_fwd_init(m, n, &def, &err), KV_OK);
    cr_assert_eq(kv_fwd_head(def, 0, 1, NULL, &err), KV_EINVAL, "no deferred head yet");
    kv_fwd_defer_head(def);
    cr_assert_eq(kv_fwd_run(whole, tok, n, 0, NULL, &err), KV_OK);
    cr_assert_eq(kv_fwd_run(def, tok, n, 0, NULL, &err), KV_OK);
    cr_assert_null(kv_fwd_logits(def), "a deferred run computes no logits");
    float *rows = malloc((size_t)(5 * V) * sizeof *rows);
    cr_assert_eq(kv_fwd_head(def, 17, 5, rows, &err), KV_OK, "%s", err.msg);
    kvt_assert_close_f32(rows, kv_fwd_logits(whole) + 17 * V, 5 * V, 1e-6, 1e-5, "rows 17..21");
    cr_assert_eq(kv_fwd_head(def, 0, n, NULL, &err), KV_OK);
    kvt_assert_close_f32(kv_fwd_logits(def), kv_fwd_logits(whole), n * V, 1e-6, 1e-5, "all rows");
    cr_assert_eq(kv_fwd_head(def, 20, 5, rows, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "no deferred head for positions 20..24 (the last run had 24)");
    free(rows);
    kv_fwd_free(whole), kv_fwd_free(def), kv_model_close(m);
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
    struct kv_fwd_hooks hk = {.ctx = &rec, .attn_in = h_x, .qk_rope = h_qk, .kv_replace = h_kv_zero};
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
    kv_fwd_free(f), kv_model_close(m);
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
    kv_fwd_free(f), kv_model_close(m);
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
    kv_fwd_free(f), kv_model_close(m);
}

/* ---------------------------------------------------------------- gpt2 */

static struct kv_model *gpt2_model(struct kv_config c, uint64_t seed) {
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &err), KV_OK, "%s", err.msg);
    sharpen(m);
    return m;
}

static int32_t *test_tokens(int64_t n, int64_t vocab) {
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 37 + 11) % vocab);
    return tok;
}

/* Logits of kv_fwd_run on tokens 0..n-1 (malloc'd), with lr set when non-NULL. */
static float *run_logits(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                         const int32_t *tok, int64_t n) {
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", err.msg);
    if (lr) cr_assert_eq(kv_fwd_set_lowrank(f, lr, kv_bits, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", err.msg);
    int64_t V = kv_model_config(m)->vocab_size;
    float *out = malloc((size_t)(n * V) * sizeof *out);
    memcpy(out, kv_fwd_logits(f), (size_t)(n * V) * sizeof *out);
    kv_fwd_free(f);
    return out;
}

static float *naive_gpt2_f32(const struct kv_model *m, const int32_t *tok, int64_t n) {
    double *ref = naive_gpt2_forward(m, tok, n);
    int64_t nv = n * kv_model_config(m)->vocab_size;
    float *r = malloc((size_t)nv * sizeof *r);
    for (int64_t i = 0; i < nv; i++) r[i] = (float)ref[i];
    free(ref);
    return r;
}

static void check_gpt2_against_naive(struct kv_config c, int64_t n) {
    struct kv_model *m = gpt2_model(c, 42);
    int32_t *tok = test_tokens(n, c.vocab_size);
    float *got = run_logits(m, NULL, 16, tok, n), *ref = naive_gpt2_f32(m, tok, n);
    kvt_assert_close_f32(got, ref, n * c.vocab_size, 2e-5, 1e-4, "gpt2 logits");
    free(got), free(ref), free(tok);
    kv_model_close(m);
}

Test(forward, gpt2_matches_naive) { check_gpt2_against_naive(tiny_gpt2_cfg(), 40); }
Test(forward, gpt2_untied_matches_naive) {
    struct kv_config c = tiny_gpt2_cfg();
    c.tied_embeddings = 0;
    check_gpt2_against_naive(c, 33);
}
Test(forward, gpt2_matches_naive_across_query_blocks) {
    struct kv_config c = tiny_gpt2_cfg();
    c.n_layers = 1;
    c.max_seq_len = 150;
    check_gpt2_against_naive(c, 150);
}

Test(forward, gpt2_incremental_cache_equals_whole_window) {
    /* learned positions must follow pos0 */
    struct kv_config c = tiny_gpt2_cfg();
    struct kv_model *m = gpt2_model(c, 3);
    int64_t n = 24, V = c.vocab_size;
    int32_t *tok = test_tokens(n, V);
    float *whole = run_logits(m, NULL, 16, tok, n);
    float *step = malloc((size_t)(n * V) * sizeof *step);
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
    cr_assert_eq(kv_fwd_run(f, tok, 10, 0, step, &err), KV_OK);
    for (int64_t p = 10; p < n; p++)
        cr_assert_eq(kv_fwd_run(f, tok + p, 1, p, step + p * V, &err), KV_OK);
    kvt_assert_close_f32(step, whole, n * V, 1e-5, 1e-4, "incremental gpt2 logits");
    free(step), free(whole), free(tok);
    kv_fwd_free(f), kv_model_close(m);
}

Test(forward, gpt2_refuses_a_context_beyond_its_positions) {
    struct kv_config c = tiny_gpt2_cfg();
    struct kv_model *m = gpt2_model(c, 3);
    struct kv_fwd *f = NULL;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, 65, &f, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "context length 65 exceeds the 64 learned positions of this gpt2 model");
    cr_assert_null(f);
    cr_assert_eq(kv_fwd_init(m, 64, &f, &err), KV_OK, "%s", err.msg);
    kv_fwd_free(f), kv_model_close(m);
}

struct qk_capture {
    float *xn, *q, *k;
    int64_t n;
};
static int cap_x(void *ctx, int64_t l, const float *x, int64_t n, int64_t pos0) {
    struct qk_capture *c = ctx;
    if (l == 1) memcpy(c->xn, x, (size_t)(n * 48) * sizeof *x);
    return 0;
}
static int cap_qk(void *ctx, int64_t l, const float *q, const float *k, int64_t n, int64_t pos0) {
    struct qk_capture *c = ctx;
    if (l == 1) {
        memcpy(c->q, q, (size_t)(n * 48) * sizeof *q);
        memcpy(c->k, k, (size_t)(n * 48) * sizeof *k);
    }
    return 0;
}

Test(forward, gpt2_qk_hook_sees_the_plain_projections) {
    /* no rope: the "post-rope" hook gets x W_qᵀ + b_q and x W_kᵀ + b_k */
    struct kv_config c = tiny_gpt2_cfg();
    struct kv_model *m = gpt2_model(c, 9);
    int64_t n = 12, d = c.dim, qd = c.n_heads * c.head_dim;
    int32_t *tok = test_tokens(n, c.vocab_size);
    struct qk_capture cap = {malloc(sizeof(float) * 12 * 48), malloc(sizeof(float) * 12 * 48),
                             malloc(sizeof(float) * 12 * 48), n};
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, n + 5, &f, &err), KV_OK);
    struct kv_fwd_hooks hk = {.ctx = &cap, .attn_in = cap_x, .qk_rope = cap_qk};
    kv_fwd_set_hooks(f, &hk);
    cr_assert_eq(kv_fwd_run(f, tok, n, 5, NULL, &err), KV_OK);
    for (int p = 0; p < 2; p++) {
        enum kv_wkind wk = p ? KV_W_K : KV_W_Q, bk = p ? KV_W_BK : KV_W_BQ;
        const float *W = kv_model_weight(m, wk, 1), *b = kv_model_weight(m, bk, 1);
        float *ref = malloc((size_t)(n * qd) * sizeof *ref);
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < qd; r++) {
                double s = b[r];
                for (int64_t j = 0; j < d; j++) s += (double)W[r * d + j] * cap.xn[t * d + j];
                ref[t * qd + r] = (float)s;
            }
        kvt_assert_close_f32(p ? cap.k : cap.q, ref, n * qd, 1e-6, 1e-5, p ? "hook k" : "hook q");
        free(ref);
    }
    free(cap.xn), free(cap.q), free(cap.k), free(tok);
    kv_fwd_free(f), kv_model_close(m);
}

Test(forward, flops_count_two_mlp_matrices_for_gpt2) {
    /* same shapes, llama has the extra gate matrix: 2 d hidden flops per token and layer */
    struct kv_config g = tiny_gpt2_cfg(), l = g;
    l.arch = KV_ARCH_LLAMA;
    l.rope_theta = 10000.0f;
    struct kv_model *mg = gpt2_model(g, 1), *ml;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&l, 1, &ml, &err), KV_OK, "%s", err.msg);
    int64_t n = 7, pos0 = 5;
    double diff = kv_fwd_flops(ml, n, pos0) - kv_fwd_flops(mg, n, pos0);
    double want = 2.0 * (double)(g.dim * g.hidden_dim * g.n_layers * n);
    cr_assert(fabs(diff - want) <= 1e-9 * want, "llama - gpt2 flops %g, expected %g", diff, want);
    kv_model_close(mg), kv_model_close(ml);
}

/* ---------------------------------------------------------------- gpt2 latent cache */

/* Rows of R [r, m] orthonormal (Gram-Schmidt of a seeded random matrix). */
static void orth_rows(double *R, int64_t r, int64_t m, uint64_t *seed) {
    for (int64_t i = 0; i < r; i++) {
        double nrm;
        do {
            for (int64_t j = 0; j < m; j++) {
                *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
                R[i * m + j] = (double)(*seed >> 11) * 0x1.0p-53 - 0.5;
            }
            for (int pass = 0; pass < 2; pass++)
                for (int64_t p = 0; p < i; p++) {
                    double dot = 0;
                    for (int64_t j = 0; j < m; j++) dot += R[i * m + j] * R[p * m + j];
                    for (int64_t j = 0; j < m; j++) R[i * m + j] -= dot * R[p * m + j];
                }
            nrm = 0;
            for (int64_t j = 0; j < m; j++) nrm += R[i * m + j] * R[i * m + j];
            nrm = sqrt(nrm);
        } while (nrm < 1e-3);
        for (int64_t j = 0; j < m; j++) R[i * m + j] /= nrm;
    }
}

static float *fcopy(const double *a, int64_t n) {
    float *p = malloc((size_t)n * sizeof *p);
    for (int64_t i = 0; i < n; i++) p[i] = (float)a[i];
    return p;
}

/* out [r, cols] = R [r, m] · W [m, cols] (W float, R double). */
static double *rmul(const double *R, int64_t r, int64_t m, const float *W, int64_t cols) {
    double *o = calloc((size_t)(r * cols), sizeof *o);
    for (int64_t i = 0; i < r; i++)
        for (int64_t k = 0; k < m; k++)
            for (int64_t j = 0; j < cols; j++) o[i * cols + j] += R[i * m + k] * W[k * cols + j];
    return o;
}

/* W [m, cols] := Rᵀ R W in place: the oracle's projected keys or values. */
static void project_rows(float *W, const double *R, int64_t r, int64_t m, int64_t cols) {
    double *t = rmul(R, r, m, W, cols);
    for (int64_t k = 0; k < m; k++)
        for (int64_t j = 0; j < cols; j++) {
            double s = 0;
            for (int64_t i = 0; i < r; i++) s += R[i * m + k] * t[i * cols + j];
            W[k * cols + j] = (float)s;
        }
    free(t);
}

/* A fused_query / fused_output model of gpt2 model m by hand: units of
 * `span` heads, key rank rk and value rank rv, each unit's down = R W
 * (+ R b) and up = Rᵀ for a random R with orthonormal rows; q_fused and
 * o_fused fold each head's up-block into W_q and W_o. Units of one head
 * also get rot = R (postrope_rotation). When proj is non-NULL its K and V
 * weights and biases become Rᵀ R W, Rᵀ R b: the attention the factors
 * compute, for the naive oracle. */
static struct kv_lowrank *fused_gpt2(const struct kv_model *m, int64_t span, int64_t rk,
                                     int64_t rv, struct kv_model *proj) {
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, h = c->n_heads, dh = c->head_dim, mw = span * dh, nu = h / span;
    uint64_t seed = 12345;
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    strcpy(lr->info.method, "test"), strcpy(lr->info.alloc, "test");
    lr->info.n_layers = c->n_layers, lr->info.dim = d, lr->info.n_heads = h, lr->info.n_kv_heads = c->n_kv_heads;
    lr->info.head_dim = dh, lr->info.kv_bits = 16;
    lr->layers = calloc((size_t)c->n_layers, sizeof *lr->layers);
    for (int64_t l = 0; l < c->n_layers; l++) {
        struct kv_lr_layer *Y = &lr->layers[l];
        Y->k.mode = KV_LR_FUSED_QUERY, Y->v.mode = KV_LR_FUSED_OUTPUT;
        Y->k.n_units = Y->v.n_units = nu;
        Y->k.units = calloc((size_t)nu, sizeof *Y->k.units);
        Y->v.units = calloc((size_t)nu, sizeof *Y->v.units);
        Y->q_cols = h * rk, Y->o_cols = h * rv;
        Y->q_fused = malloc((size_t)(Y->q_cols * d) * sizeof(float));
        Y->q_fused_bias = malloc((size_t)Y->q_cols * sizeof(float));
        Y->o_fused = malloc((size_t)(d * Y->o_cols) * sizeof(float));
        const float *Wq = kv_model_weight(m, KV_W_Q, l), *bq = kv_model_weight(m, KV_W_BQ, l);
        const float *Wo = kv_model_weight(m, KV_W_O, l);
        for (int side = 0; side < 2; side++) {
            struct kv_lr_side *S = side ? &Y->v : &Y->k;
            int64_t r = side ? rv : rk;
            const float *W = kv_model_weight(m, side ? KV_W_V : KV_W_K, l);
            const float *b = kv_model_weight(m, side ? KV_W_BV : KV_W_BK, l);
            for (int64_t u = 0; u < nu; u++) {
                struct kv_lr_unit *un = &S->units[u];
                double *R = malloc((size_t)(r * mw) * sizeof *R);
                orth_rows(R, r, mw, &seed);
                un->head0 = u * span, un->n_heads = span, un->rank = r;
                double *dn = rmul(R, r, mw, W + u * mw * d, d), *db = rmul(R, r, mw, b + u * mw, 1);
                un->down = fcopy(dn, r * d), un->down_bias = fcopy(db, r);
                un->up = malloc((size_t)(mw * r) * sizeof(float)); /* Rᵀ */
                for (int64_t i = 0; i < r; i++)
                    for (int64_t j = 0; j < mw; j++) un->up[j * r + i] = (float)R[i * mw + j];
                if (span == 1) un->rot = fcopy(R, r * dh);
                for (int64_t a = 0; a < span; a++) {
                    int64_t i = u * span + a; /* query head; its up-block is R[:, a*dh..] */
                    for (int64_t x = 0; x < r; x++)
                        if (!side) {
                            double sb = 0;
                            for (int64_t e = 0; e < dh; e++) sb += R[x * mw + a * dh + e] * bq[i * dh + e];
                            Y->q_fused_bias[i * r + x] = (float)sb;
                            for (int64_t j = 0; j < d; j++) {
                                double s = 0;
                                for (int64_t e = 0; e < dh; e++)
                                    s += R[x * mw + a * dh + e] * Wq[(i * dh + e) * d + j];
                                Y->q_fused[(i * r + x) * d + j] = (float)s;
                            }
                        } else {
                            for (int64_t j = 0; j < d; j++) {
                                double s = 0;
                                for (int64_t e = 0; e < dh; e++)
                                    s += Wo[j * h * dh + i * dh + e] * R[x * mw + a * dh + e];
                                Y->o_fused[j * Y->o_cols + i * r + x] = (float)s;
                            }
                        }
                }
                if (proj) {
                    project_rows(kv_model_weight_mut(proj, side ? KV_W_V : KV_W_K, l) + u * mw * d,
                                 R, r, mw, d);
                    project_rows(kv_model_weight_mut(proj, side ? KV_W_BV : KV_W_BK, l) + u * mw,
                                 R, r, mw, 1);
                }
                free(R), free(dn), free(db);
            }
        }
    }
    return lr;
}

static void set_key_mode(struct kv_lowrank *lr, enum kv_lr_mode mode) {
    for (int64_t l = 0; l < lr->info.n_layers; l++) lr->layers[l].k.mode = mode;
}

Test(forward, gpt2_full_rank_fused_query_and_output_equal_the_base) {
    struct kv_config c = tiny_gpt2_cfg();
    struct kv_model *m = gpt2_model(c, 21);
    int64_t n = 30, nv = n * c.vocab_size;
    int32_t *tok = test_tokens(n, c.vocab_size);
    float *base = run_logits(m, NULL, 16, tok, n);
    for (int64_t span = 1; span <= 2; span++) {
        struct kv_lowrank *lr = fused_gpt2(m, span, span * c.head_dim, span * c.head_dim, NULL);
        float *got = run_logits(m, lr, 16, tok, n);
        kvt_assert_close_f32(got, base, nv, 1e-5, 1e-4, "full-rank fused logits");
        free(got);
        if (span == 1) { /* rotation of the plain keys, same factors */
            set_key_mode(lr, KV_LR_POSTROPE_ROTATION);
            got = run_logits(m, lr, 16, tok, n);
            kvt_assert_close_f32(got, base, nv, 1e-5, 1e-4, "full-rank rotation logits");
            free(got);
        }
        kv_lr_free(lr);
    }
    free(base), free(tok);
    kv_model_close(m);
}

Test(forward, gpt2_reduced_rank_latents_equal_naive_projected_attention) {
    struct kv_config c = tiny_gpt2_cfg();
    int64_t n = 30, nv = n * c.vocab_size;
    int32_t *tok = test_tokens(n, c.vocab_size);
    enum kv_lr_mode modes[] = {KV_LR_FUSED_QUERY, KV_LR_PREROPE_LATENT, KV_LR_POSTROPE_ROTATION};
    for (int64_t span = 1; span <= 2; span++) {
        struct kv_model *m = gpt2_model(c, 22), *proj = gpt2_model(c, 22);
        struct kv_lowrank *lr = fused_gpt2(m, span, span == 1 ? 5 : 13, span == 1 ? 7 : 10, proj);
        float *ref = naive_gpt2_f32(proj, tok, n), *base = run_logits(m, NULL, 16, tok, n);
        for (int i = 0; i < (span == 1 ? 3 : 2); i++) {
            set_key_mode(lr, modes[i]);
            float *got = run_logits(m, lr, 16, tok, n);
            kvt_assert_close_f32(got, ref, nv, 2e-5, 1e-4, kv_lr_mode_name(modes[i]));
            free(got);
        }
        /* guard: the projection changed the logits */
        double diff = 0;
        for (int64_t i = 0; i < nv; i++) diff = fmax(diff, fabs(base[i] - ref[i]));
        cr_assert_gt(diff, 1e-3, "rank reduction left the logits unchanged (max diff %g)", diff);
        free(ref), free(base);
        kv_lr_free(lr);
        kv_model_close(m), kv_model_close(proj);
    }
    free(tok);
}

Test(forward, gpt2_fused_query_quantizes_the_cached_latents) {
    /* the same quantized latents scored two ways: q'·ẑ (fused) and q·(ẑ upᵀ)
     * (prerope reconstruction); one layer, so both see bit-identical latents
     * (a later layer's rounding could move a latent across a code boundary) */
    struct kv_config c = tiny_gpt2_cfg();
    c.n_layers = 1;
    struct kv_model *m = gpt2_model(c, 23);
    int64_t n = 30, nv = n * c.vocab_size;
    int32_t *tok = test_tokens(n, c.vocab_size);
    struct kv_lowrank *lr = fused_gpt2(m, 2, 16, 16, NULL);
    float *fp = run_logits(m, lr, 16, tok, n);
    for (int bits = 8; bits >= 3; bits -= 5) {
        set_key_mode(lr, KV_LR_FUSED_QUERY);
        float *fused = run_logits(m, lr, bits, tok, n);
        set_key_mode(lr, KV_LR_PREROPE_LATENT);
        float *rec = run_logits(m, lr, bits, tok, n);
        kvt_assert_close_f32(fused, rec, nv, 1e-5, 1e-4, "fused vs reconstructed quantized keys");
        double diff = 0;
        for (int64_t i = 0; i < nv; i++) diff = fmax(diff, fabs(fused[i] - fp[i]));
        cr_assert_gt(diff, 1e-6, "%d-bit latents gave the fp16 logits", bits);
        free(fused), free(rec);
    }
    free(fp), free(tok);
    kv_lr_free(lr);
    kv_model_close(m);
}

Test(forward, gpt2_latent_incremental_cache_equals_whole_window) {
    struct kv_config c = tiny_gpt2_cfg();
    struct kv_model *m = gpt2_model(c, 24);
    int64_t n = 20, V = c.vocab_size;
    int32_t *tok = test_tokens(n, V);
    struct kv_lowrank *lr = fused_gpt2(m, 1, 6, 9, NULL);
    float *whole = run_logits(m, lr, 16, tok, n);
    float *step = malloc((size_t)(n * V) * sizeof *step);
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_run(f, tok, 7, 0, step, &err), KV_OK);
    for (int64_t p = 7; p < n; p++)
        cr_assert_eq(kv_fwd_run(f, tok + p, 1, p, step + p * V, &err), KV_OK);
    kvt_assert_close_f32(step, whole, n * V, 1e-5, 1e-4, "incremental latent logits");
    free(step), free(whole), free(tok);
    kv_fwd_free(f), kv_lr_free(lr), kv_model_close(m);
}

Test(forward, fused_query_is_refused_where_it_is_not_exact_or_complete) {
    struct kv_config c = tiny_gpt2_cfg();
    struct kv_model *m = gpt2_model(c, 25);
    struct kv_lowrank *lr = fused_gpt2(m, 1, 4, 4, NULL);
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, 8, &f, &err), KV_OK);
    lr->layers[1].q_cols = 15;
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "layer 1: fused query has 15 rows, the units need 16");
    lr->layers[1].q_cols = 16;
    float *qf = lr->layers[0].q_fused;
    lr->layers[0].q_fused = NULL;
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "layer 0: fused query keys have no fused query projection");
    lr->layers[0].q_fused = qf;
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_OK, "%s", err.msg);
    kv_fwd_free(f);
    /* llama: rope sits between the key projection and the score */
    struct kv_config lc = c;
    lc.arch = KV_ARCH_LLAMA;
    lc.rope_theta = 10000.0f;
    struct kv_model *ml;
    cr_assert_eq(kv_model_init_random(&lc, 1, &ml, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_init(ml, 8, &f, &err), KV_OK);
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_EUNSUPPORTED);
    cr_assert_str_eq(err.msg, "layer 0: key mode fused_query is not supported for this architecture");
    kv_fwd_free(f), kv_model_close(ml);
    kv_lr_free(lr), kv_model_close(m);
}
