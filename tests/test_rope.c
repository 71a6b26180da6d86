/* RoPE frequencies under every scaling (lib/rope.c) against the oracle of
 * naive_rope.h, written from llama.cpp's formulation, at the parameters of
 * real models; and the checks on the parameters. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model.h"
#include "naive_rope.h"
#include "testutil.h"

static struct kv_config rope_cfg(int64_t head_dim, float theta) {
    struct kv_config c = {0};
    c.head_dim = head_dim;
    c.rope_theta = theta;
    c.rope_scaling.truncate = 1;
    c.rope_scaling.beta_fast = 32, c.rope_scaling.beta_slow = 1;
    return c;
}

/* kv_rope_freqs against the oracle's angle at position 1000 for seq_len. */
static void check_freqs(const struct kv_config *c, int64_t seq_len, const char *what) {
    double inv[KV_MAX_ROPE_FACTORS];
    double scale = kv_rope_freqs(c, seq_len, inv);
    double worst = 0;
    int64_t wi = 0;
    for (int64_t i = 0; i < c->head_dim / 2; i++) {
        double ms, ref = naive_rope_angle(c, seq_len, 1000, i, &ms) / 1000.0;
        double e = fabs(inv[i] - ref) / fabs(ref);
        if (e > worst) worst = e, wi = i;
        cr_assert_float_eq(scale, ms, 1e-12, "%s: attention factor %.17g, oracle %.17g", what, scale, ms);
    }
    cr_assert_leq(worst, 1e-12, "%s: inverse frequency %lld off by %.3g relative", what,
                  (long long)wi, worst);
}

Test(rope, plain_frequencies_are_theta_powers) {
    struct kv_config c = rope_cfg(128, 500000.0f);
    check_freqs(&c, 4096, "default");
    double inv[KV_MAX_ROPE_FACTORS];
    cr_assert_eq(kv_rope_freqs(&c, 10, inv), 1.0);
    cr_assert_eq(inv[0], 1.0);
    cr_assert_float_eq(inv[32], pow(500000.0, -0.5), 1e-15);
}

Test(rope, llama3_at_llama_3_1_8b_parameters) {
    struct kv_config c = rope_cfg(128, 500000.0f);
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = KV_ROPE_SCALING_LLAMA3, s->factor = 8, s->low_freq_factor = 1;
    s->high_freq_factor = 4, s->original_ctx = 8192;
    check_freqs(&c, 2048, "llama3");
    /* the published rule: wavelengths under 2048 kept, over 8192 divided by 8 */
    struct kv_config plain = rope_cfg(128, 500000.0f);
    double a[KV_MAX_ROPE_FACTORS], b[KV_MAX_ROPE_FACTORS];
    kv_rope_freqs(&c, 2048, a);
    kv_rope_freqs(&plain, 2048, b);
    int kept = 0, divided = 0, mixed = 0;
    for (int i = 0; i < 64; i++) {
        double wl = 2 * M_PI / b[i];
        if (wl < 2048) kept += a[i] == b[i];
        else if (wl > 8192) divided += fabs(a[i] * 8 - b[i]) <= 1e-15 * b[i];
        else mixed += a[i] < b[i] && a[i] > b[i] / 8;
    }
    cr_assert_eq(kept + divided + mixed, 64, "kept %d, divided %d, mixed %d", kept, divided, mixed);
    cr_assert(kept > 0 && divided > 0 && mixed > 0, "kept %d, divided %d, mixed %d", kept, divided,
              mixed);
}

Test(rope, linear_and_dynamic) {
    struct kv_config c = rope_cfg(64, 10000.0f);
    c.rope_scaling.type = KV_ROPE_SCALING_LINEAR, c.rope_scaling.factor = 2;
    check_freqs(&c, 512, "linear");
    c.rope_scaling.type = KV_ROPE_SCALING_DYNAMIC, c.rope_scaling.original_ctx = 2048;
    check_freqs(&c, 512, "dynamic within");
    check_freqs(&c, 6000, "dynamic past");
    double in[KV_MAX_ROPE_FACTORS], past[KV_MAX_ROPE_FACTORS];
    kv_rope_freqs(&c, 2048, in);
    kv_rope_freqs(&c, 2049, past);
    cr_assert_eq(in[0], 1.0);
    cr_assert_eq(in[1], pow(10000.0, -2.0 / 64));
    cr_assert_lt(past[1], in[1], "dynamic did not raise theta past its context");
}

Test(rope, yarn_at_qwen_parameters) {
    struct kv_config c = rope_cfg(128, 1000000.0f);
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = KV_ROPE_SCALING_YARN, s->factor = 4, s->original_ctx = 32768;
    check_freqs(&c, 1024, "yarn");
    s->truncate = 0;
    check_freqs(&c, 1024, "yarn without truncation");
    s->attention_factor = 1.25;
    check_freqs(&c, 1024, "yarn with an attention factor");
    double inv[KV_MAX_ROPE_FACTORS];
    cr_assert_eq(kv_rope_freqs(&c, 1, inv), 1.25);
}

Test(rope, longrope_and_per_pair_divisors) {
    struct kv_config c = rope_cfg(96, 10000.0f);
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = KV_ROPE_SCALING_LONGROPE, s->original_ctx = 4096, s->factor = 32;
    s->n_factors = 48;
    for (int i = 0; i < 48; i++) s->short_factor[i] = 1 + 0.05f * (float)i, s->long_factor[i] = 1 + 1.3f * (float)i;
    check_freqs(&c, 4096, "longrope short");
    check_freqs(&c, 4097, "longrope long");
    double inv[KV_MAX_ROPE_FACTORS];
    /* Phi-3's factor: sqrt(1 + ln 32 / ln 4096) */
    cr_assert_float_eq(kv_rope_freqs(&c, 10, inv), sqrt(1 + log(32.0) / log(4096.0)), 1e-15);
    s->type = KV_ROPE_SCALING_FREQS;
    check_freqs(&c, 100000, "freqs");
}

Test(rope, table_is_the_rounded_product) {
    struct kv_config c = rope_cfg(8, 100.0f);
    c.rope_scaling.type = KV_ROPE_SCALING_YARN, c.rope_scaling.factor = 4, c.rope_scaling.original_ctx = 32;
    float cs[40 * 4], sn[40 * 4];
    kv_rope_table(&c, 40, 40, cs, sn);
    for (int64_t p = 0; p < 40; p++)
        for (int64_t i = 0; i < 4; i++) {
            double ms, ang = naive_rope_angle(&c, 40, p, i, &ms);
            cr_assert_float_eq(cs[p * 4 + i], cos(ang) * ms, 2e-7, "cos at %lld/%lld", (long long)p, (long long)i);
            cr_assert_float_eq(sn[p * 4 + i], sin(ang) * ms, 2e-7, "sin at %lld/%lld", (long long)p, (long long)i);
        }
}

Test(rope, checks_parameters) {
    struct {
        enum kv_rope_scaling t;
        double factor, lo, hi;
        int64_t ctx, n;
        const char *msg;
    } rows[] = {
        {KV_ROPE_SCALING_LINEAR, 0, 0, 0, 0, 0, "m: rope scaling 'linear' needs a positive factor, found 0"},
        {KV_ROPE_SCALING_LLAMA3, 8, 1, 4, 0, 0, "m: rope scaling 'llama3' needs original_max_position_embeddings"},
        {KV_ROPE_SCALING_LLAMA3, 8, 4, 1, 8192, 0,
         "m: rope scaling 'llama3' needs 0 < low_freq_factor < high_freq_factor, found 4 and 1"},
        {KV_ROPE_SCALING_LONGROPE, 1, 0, 0, 4096, 3,
         "m: rope scaling 'longrope' has 3 factors, expected one per rotated pair (4)"},
        {KV_ROPE_SCALING_FREQS, 1, 0, 0, 0, 4, "m: rope scaling 'freqs': factor 0 is not a positive finite number"},
    };
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        struct kv_config c = rope_cfg(8, 10000.0f);
        struct kv_rope_scaling_cfg *s = &c.rope_scaling;
        s->type = rows[k].t, s->factor = rows[k].factor, s->low_freq_factor = rows[k].lo;
        s->high_freq_factor = rows[k].hi, s->original_ctx = rows[k].ctx, s->n_factors = rows[k].n;
        for (int i = 0; i < 4; i++) s->short_factor[i] = s->long_factor[i] = 1;
        if (rows[k].t == KV_ROPE_SCALING_FREQS) s->short_factor[0] = 0;
        struct kv_err err;
        cr_assert_eq(kv_rope_check(&c, "m", &err), KV_EFORMAT, "row %zu accepted", k);
        char full[2100];
        snprintf(full, sizeof full, "%s: %s", err.path, err.msg);
        cr_assert_str_eq(full, rows[k].msg);
    }
}

Test(rope, same_compares_frequencies_not_spelling) {
    struct kv_config a = rope_cfg(64, 10000.0f), b = a;
    cr_assert(kv_rope_same(&a, &b));
    b.rope_scaling.type = KV_ROPE_SCALING_DYNAMIC, b.rope_scaling.factor = 2, b.rope_scaling.original_ctx = 512;
    cr_assert(!kv_rope_same(&a, &b), "dynamic differs past its context");
    b = a;
    b.rope_scaling.type = KV_ROPE_SCALING_LINEAR, b.rope_scaling.factor = 1;
    cr_assert(kv_rope_same(&a, &b), "linear by 1 is plain rope");
    b.rope_scaling.factor = 2;
    cr_assert(!kv_rope_same(&a, &b));
}
