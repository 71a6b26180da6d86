/* The decode-attention benchmark table of the runtime (kernels/kvrt_bench.c):
 * its option rules in the library's words and a caller's, and a small
 * table whose bytes are checked against the shapes it was given. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt.h"
#include "testutil.h"

static const char *const flags[KVRT_BENCH_OPT_COUNT] = {
    [KVRT_BENCH_OPT_CTX] = "--ctx", [KVRT_BENCH_OPT_KEEP] = "--keep",
    [KVRT_BENCH_OPT_ITERS] = "--iters", [KVRT_BENCH_OPT_LAYERS] = "--layers",
    [KVRT_BENCH_OPT_KV_BITS] = "--kv-bits"};

Test(kvrt_bench, option_rules_in_the_library_words_or_the_callers) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t top = kvrt_max_ctx() - 1;
    cr_assert_eq(kvrt_bench_check_ctx(1, flags, &err), KV_OK);
    cr_assert_eq(kvrt_bench_check_ctx(top, flags, &err), KV_OK);
    cr_assert_eq(kvrt_bench_check_ctx(0, flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--ctx length 0 is outside 1..1048575");
    cr_assert_eq(kvrt_bench_check_ctx(top + 1, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "context length 1048576 is outside 1..1048575");
    cr_assert_eq(kvrt_bench_check_keep(1, flags, &err), KV_OK);
    cr_assert_eq(kvrt_bench_check_keep(0, flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--keep 0 is not within (0, 1]");
    cr_assert_eq(kvrt_bench_check_keep(NAN, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "keep nan is not within (0, 1]");
    cr_assert_eq(kvrt_bench_check(1, 1, flags, &err), KV_OK);
    cr_assert_eq(kvrt_bench_check(0, 1, flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--iters must be at least 1, got 0");
    cr_assert_eq(kvrt_bench_check(3, -2, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "layers must be at least 1, got -2");
    cr_assert_eq(kvrt_bench_check_bits(16, flags, &err), KV_OK);
    cr_assert_eq(kvrt_bench_check_bits(3, NULL, &err), KV_OK);
    cr_assert_eq(kvrt_bench_check_bits(5, flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--kv-bits 5 is not one of 16, 8, 4, 3, 2");
    cr_assert_eq(kvrt_bench_check_bits(0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "kv bits 0 is not one of 16, 8, 4, 3, 2");
    cr_assert_eq(kvrt_bench_default_iters(KVRT_BACKEND_TWIN), 3);
    cr_assert_eq(kvrt_bench_default_iters(KVRT_BACKEND_CUDA), 50);
    cr_assert(kvrt_synth_preset_valid("llama7b") && kvrt_synth_preset_valid("gpt2-xl"));
    cr_assert(!kvrt_synth_preset_valid("llama9") && !kvrt_synth_preset_valid(NULL));
}

struct count {
    int64_t calls, last_done, last_total, stop_at;
};

static int count_steps(void *ctx, int64_t done, int64_t total, int64_t tokens) {
    struct count *c = ctx;
    cr_assert_eq(done, c->last_done + 1);
    cr_assert_eq(tokens, 0);
    c->calls++, c->last_done = done, c->last_total = total;
    return c->stop_at && done == c->stop_at;
}

Test(kvrt_bench, a_table_of_every_configuration_cache_and_context, .timeout = 120) {
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_model("gpt2-xl", 2, &m, &err), KV_OK, "%s", err.msg);
    const struct kv_config *c = kv_model_config(m);
    struct kvrt_bench b;
    memset(&b, 0, sizeof b);
    b.backend = KVRT_BACKEND_TWIN;
    b.ctx[0] = 8, b.ctx[1] = 20, b.n_ctx = 2;
    b.caches[0] = KVRT_DTYPE_F16, b.caches[1] = KVRT_DTYPE_F32, b.n_cache = 2;
    b.iters = 1, b.keep = 0.5, b.m = m;
    struct count n = {0};
    cr_assert_eq(kvrt_bench_run(&b, count_steps, &n, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(n.calls, 3 * 2 * 2 * 2, "configurations x caches x layers x contexts");
    cr_assert_eq(n.last_total, n.calls);
    cr_assert_eq(b.n_cfg, 3);
    cr_assert_str_eq(b.cfgs[0].name, "full");
    cr_assert_str_eq(b.cfgs[1].name, "fused_query+fused_output", "no rope: fused query keys");
    cr_assert_str_eq(b.cfgs[2].name, "postrope_rotation+fused_output");
    /* full: K and V of every KV head per token and layer, 2 or 4 bytes each */
    int64_t kv = 2 * c->n_kv_heads * c->head_dim;
    cr_assert_eq(b.cfgs[0].kv_total[KVRT_DTYPE_F16], 2 * kv * c->n_layers);
    cr_assert_eq(b.cfgs[0].kv_total[KVRT_DTYPE_F32], 4 * kv * c->n_layers);
    cr_assert(b.cfgs[0].lk == KV_LR_FULL && b.cfgs[0].lv == KV_LR_FULL && !b.cfgs[0].mixed);
    cr_assert(b.cfgs[0].kv_bits == 16 && b.cfgs[1].kv_bits == 16 && b.cfgs[2].kv_bits == 16);
    cr_assert(b.cfgs[1].lk == KV_LR_FUSED_QUERY && b.cfgs[1].lv == KV_LR_FUSED_OUTPUT);
    for (int g = 0; g < b.n_cfg; g++)
        for (int t = 0; t < 2; t++) {
            double per_layer = (double)b.cfgs[g].kv_total[t] / (double)c->n_layers;
            for (int i = 0; i < b.n_ctx; i++) {
                const struct kvrt_bench_cell *x = kvrt_bench_cell(&b, g, t, i);
                cr_assert(x->us_step > 0 && x->us_attn > 0 && x->us_attn < x->us_step,
                          "cfg %d cache %d ctx %d: %g %g", g, t, i, x->us_step, x->us_attn);
                cr_assert_float_eq(x->kv_layer, per_layer, 1e-9);
                /* the weights a step reads are the same at every context */
                double w = x->bytes - (double)(b.ctx[i] + 1) * x->kv_layer;
                const struct kvrt_bench_cell *x0 = kvrt_bench_cell(&b, g, t, 0);
                cr_assert(w > 0 && fabs(w - (x0->bytes - (double)(b.ctx[0] + 1) * x0->kv_layer)) < 1e-6,
                          "weights %g", w);
            }
        }
    cr_assert_lt(b.cfgs[1].kv_total[KVRT_DTYPE_F32], b.cfgs[0].kv_total[KVRT_DTYPE_F32]);
    /* a progress callback stops the run */
    struct count stop = {.stop_at = 3};
    cr_assert_eq(kvrt_bench_run(&b, count_steps, &stop, &err), KV_EINVAL);
    cr_assert(strstr(err.msg, "interrupted") && strstr(err.msg, "configuration 'full'"), "%s",
              err.msg);
    cr_assert_eq(stop.calls, 3);
    kvrt_bench_release(&b);
    cr_assert_null(b.cells);
    kv_model_close(m);
}

Test(kvrt_bench, a_manifest_has_the_layers_asked_for) {
    struct kv_model *m;
    struct kv_lowrank *lr;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_model("llama3-8b", 2, &m, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kvrt_synth_lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FUSED_OUTPUT, 0.25, 1, &lr, &err),
                 KV_OK, "%s", err.msg);
    cr_assert_eq(kvrt_bench_check_manifest(lr, 2, flags, &err), KV_OK);
    cr_assert_eq(kvrt_bench_check_manifest(lr, 0, flags, &err), KV_OK, "0: every layer");
    cr_assert_eq(kvrt_bench_check_manifest(lr, 3, flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--layers 3 exceeds the manifest's 2 layers");
    cr_assert_eq(kvrt_bench_check_manifest(lr, 5, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "layers 5 exceeds the manifest's 2 layers");
    kv_lr_free(lr);
    kv_model_close(m);
}

/* Synthetic latents at kv_bits 4: every latent configuration stores codes,
 * its bytes per token those of kvrt_layer_info (codes plus an fp16 scale
 * and zero per unit, whatever the cache dtype), full unchanged; a width
 * kvcal does not run is refused. */
Test(kvrt_bench, quantized_latents_count_their_codes, .timeout = 120) {
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_model("gpt2-xl", 2, &m, &err), KV_OK, "%s", err.msg);
    struct kvrt_bench b;
    memset(&b, 0, sizeof b);
    b.backend = KVRT_BACKEND_TWIN;
    b.ctx[0] = 8, b.n_ctx = 1;
    b.caches[0] = KVRT_DTYPE_F16, b.caches[1] = KVRT_DTYPE_F32, b.n_cache = 2;
    b.iters = 1, b.keep = 0.5, b.m = m, b.kv_bits = 5;
    cr_assert_eq(kvrt_bench_run(&b, NULL, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "kv bits 5 is not one of 16, 8, 4, 3, 2");
    b.kv_bits = 4;
    cr_assert_eq(kvrt_bench_run(&b, NULL, NULL, &err), KV_OK, "%s", err.msg);
    cr_assert(b.cfgs[0].kv_bits == 16 && b.cfgs[1].kv_bits == 4 && b.cfgs[2].kv_bits == 4);
    cr_assert_eq(b.cfgs[0].kv_total[KVRT_DTYPE_F16], 2 * 2 * 25 * 64 * 2);
    /* 25 kv heads of rank 32, 4 bits: 16 bytes of codes + 4 per unit, keys
     * and values; postrope keys of ranks 16 and 48 alternately and 32 last:
     * 12 x (8 + 4) + 12 x (24 + 4) + (16 + 4) = 500, the same */
    for (int g = 1; g < 3; g++)
        for (int t = 0; t < 2; t++)
            cr_assert_eq(b.cfgs[g].kv_total[t], 2 * 1000, "cfg %d cache %d: %lld bytes", g, t,
                         (long long)b.cfgs[g].kv_total[t]);
    const struct kvrt_bench_cell *x = kvrt_bench_cell(&b, 1, KVRT_DTYPE_F32, 0);
    cr_assert(x->us_step > 0 && x->kv_layer == 1000, "%g", x->kv_layer);
    kvrt_bench_release(&b);
    kv_model_close(m);
}
