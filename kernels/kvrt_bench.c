/* The decode-attention benchmark table (kvrt.h, "benchmark tables"): every
 * configuration x cache dtype x layer x context of `kvcal bench-attn`,
 * timed with kvrt_time_step, and the rules of its options. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvrt.h"

#define SEED_FILL 0x5eedull
#define SEED_FACTORS 7ull

/* The library's own names of the options, for messages without the caller's. */
static const char *const own_names[KVRT_BENCH_OPT_COUNT] = {
    [KVRT_BENCH_OPT_CTX] = "context",
    [KVRT_BENCH_OPT_KEEP] = "keep",
    [KVRT_BENCH_OPT_ITERS] = "iterations",
    [KVRT_BENCH_OPT_LAYERS] = "layers",
    [KVRT_BENCH_OPT_KV_BITS] = "kv bits",
};

int kvrt_bench_check_ctx(int64_t ctx, const char *const *names, struct kv_err *err) {
    /* a step at ctx appends one position after ctx cached ones */
    if (ctx < 1 || ctx > kvrt_max_ctx() - 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s length %lld is outside 1..%lld",
                       (names ? names : own_names)[KVRT_BENCH_OPT_CTX], (long long)ctx,
                       (long long)kvrt_max_ctx() - 1);
    return KV_OK;
}

int kvrt_bench_check_keep(double keep, const char *const *names, struct kv_err *err) {
    if (!(keep > 0 && keep <= 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %g is not within (0, 1]",
                       (names ? names : own_names)[KVRT_BENCH_OPT_KEEP], keep);
    return KV_OK;
}

int kvrt_bench_check_bits(int64_t bits, const char *const *names, struct kv_err *err) {
    if (!kv_lr_bits_valid(bits))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %lld is not one of " KV_LR_BITS_LIST,
                       (names ? names : own_names)[KVRT_BENCH_OPT_KV_BITS], (long long)bits);
    return KV_OK;
}

int kvrt_bench_check(int64_t iters, int64_t layers, const char *const *names,
                     struct kv_err *err) {
    const char *const *n = names ? names : own_names;
    if (iters < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 1, got %lld",
                       n[KVRT_BENCH_OPT_ITERS], (long long)iters);
    if (layers < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 1, got %lld",
                       n[KVRT_BENCH_OPT_LAYERS], (long long)layers);
    return KV_OK;
}

int64_t kvrt_bench_default_iters(enum kvrt_backend backend) {
    return backend == KVRT_BACKEND_CUDA ? 50 : 3;
}

int kvrt_bench_check_manifest(const struct kv_lowrank *lr, int64_t layers,
                              const char *const *names, struct kv_err *err) {
    int64_t n = kv_lr_info(lr).n_layers;
    if (layers > n)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %lld exceeds the manifest's %lld layers",
                       (names ? names : own_names)[KVRT_BENCH_OPT_LAYERS], (long long)layers,
                       (long long)n);
    return KV_OK;
}

int kvrt_bench_manifest(struct kv_lowrank *lr, int64_t layers, struct kv_model **m,
                        struct kv_err *err) {
    struct kv_lr_info li = kv_lr_info(lr);
    *m = NULL;
    int rc = kvrt_bench_check_manifest(lr, layers, NULL, err);
    if (rc) return rc;
    /* only the timed layers get factors and a model */
    if ((rc = kv_lr_truncate(lr, layers > 0 ? layers : li.n_layers, err))) return rc;
    if ((rc = kvrt_synth_fits(lr, err))) return rc;
    if ((rc = kvrt_synth_fill_factors(lr, SEED_FACTORS, err))) return rc;
    return kvrt_synth_model_for(lr, m, err);
}

const struct kvrt_bench_cell *kvrt_bench_cell(const struct kvrt_bench *b, int cfg, int cache,
                                              int ctx_i) {
    return &b->cells[((size_t)cfg * 2 + (size_t)cache) * KVRT_BENCH_MAX_CTXS + (size_t)ctx_i];
}

static struct kvrt_bench_cell *cell_mut(struct kvrt_bench *b, int cfg, int cache, int ctx_i) {
    return (struct kvrt_bench_cell *)kvrt_bench_cell(b, cfg, cache, ctx_i);
}

/* The configurations: full and the manifest's, or full and two synthetic
 * latent ones (fused_query keys where there is no RoPE, prerope otherwise). */
static void set_configs(struct kvrt_bench *b) {
#define CFG(n, k, v) {.name = n, .kmode = KV_LR_##k, .vmode = KV_LR_##v}
    static const struct kvrt_bench_cfg rope_cfgs[] = {
        CFG("full", FULL, FULL),
        CFG("prerope_latent+fused_output", PREROPE_LATENT, FUSED_OUTPUT),
        CFG("postrope_rotation+fused_output", POSTROPE_ROTATION, FUSED_OUTPUT),
    };
    static const struct kvrt_bench_cfg norope_cfgs[] = {
        CFG("full", FULL, FULL),
        CFG("fused_query+fused_output", FUSED_QUERY, FUSED_OUTPUT),
        CFG("postrope_rotation+fused_output", POSTROPE_ROTATION, FUSED_OUTPUT),
    };
#undef CFG
    if (b->lr) {
        b->cfgs[0] = rope_cfgs[0];
        b->cfgs[1] = (struct kvrt_bench_cfg){.name = "manifest", .manifest = 1};
        b->n_cfg = 2;
    } else {
        int rope = kv_arch_has_rope(kv_model_config(b->m)->arch);
        memcpy(b->cfgs, rope ? rope_cfgs : norope_cfgs, sizeof rope_cfgs);
        b->n_cfg = 3;
    }
}

/* The compressed attention configuration c runs: NULL for full, the
 * manifest's, or a fresh synthetic one (*made set, the caller frees). */
static int cfg_lowrank(const struct kvrt_bench *b, int c, struct kv_lowrank **lr, int *made,
                       struct kv_err *err) {
    const struct kvrt_bench_cfg *g = &b->cfgs[c];
    *lr = NULL, *made = 0;
    if (g->manifest) {
        *lr = b->lr;
        return KV_OK;
    }
    if (g->kmode == KV_LR_FULL && g->vmode == KV_LR_FULL) return KV_OK;
    *made = 1;
    int rc = kvrt_synth_lowrank(b->m, g->kmode, g->vmode, b->keep, SEED_FACTORS, lr, err);
    if (!rc && (rc = kv_lr_set_kv_bits(*lr, b->kv_bits ? b->kv_bits : 16, err))) {
        kv_lr_free(*lr);
        *lr = NULL, *made = 0;
    }
    return rc;
}

/* Say which run a runtime error came from (a big context may not fit). */
static void err_context(struct kv_err *err, const char *cfg, int t, int64_t positions) {
    char m[sizeof err->msg + 128];
    snprintf(m, sizeof m, "%s (configuration '%s', %s cache, %lld positions)", err->msg, cfg,
             kvrt_dtype_name((enum kvrt_dtype)t), (long long)positions);
    memcpy(err->msg, m, sizeof err->msg - 1);
    err->msg[sizeof err->msg - 1] = 0;
}

/* Every layer and context of configuration c on a runtime rt with cache t:
 * one fill of each layer to the longest context, then the contexts from
 * the longest down, each step appending at ctx over 0..ctx-1. */
static int time_layers(struct kvrt_bench *b, int c, int t, struct kvrt *rt, int64_t *done,
                       int64_t total, kv_progress_fn progress, void *ctx, struct kv_err *err) {
    struct kvrt_bench_cfg *g = &b->cfgs[c];
    int64_t nl = kv_model_config(b->m)->n_layers, max_ctx = b->ctx[b->n_ctx - 1] + 1;
    g->kv_total[t] = 0;
    for (int i = 0; i < b->n_ctx; i++) *cell_mut(b, c, t, i) = (struct kvrt_bench_cell){0};
    int rc = KV_OK;
    for (int64_t l = 0; l < nl && !rc; l++) {
        struct kvrt_layer_info li;
        kvrt_layer_info(rt, l, &li);
        g->kv_total[t] += li.cache_bytes_per_token;
        if (l == 0)
            g->lk = li.kmode, g->lv = li.vmode, g->mixed = 0;
        else if (li.kmode != g->lk || li.vmode != g->lv)
            g->mixed = 1;
        if ((rc = kvrt_fill(rt, l, max_ctx - 1, SEED_FILL + (uint64_t)l, err))) break;
        for (int i = b->n_ctx - 1; i >= 0; i--) {
            double us, ua;
            if ((rc = kvrt_time_step(rt, l, b->ctx[i], b->iters, &us, &ua, err))) break;
            struct kvrt_bench_cell *x = cell_mut(b, c, t, i);
            x->us_step += us / (double)nl, x->us_attn += ua / (double)nl;
            x->bytes += (double)((b->ctx[i] + 1) * li.cache_bytes_per_token + li.weight_bytes) /
                        (double)nl;
            x->kv_layer += (double)li.cache_bytes_per_token / (double)nl;
            if (progress && progress(ctx, ++*done, total, 0))
                return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "interrupted");
        }
    }
    return rc;
}

int kvrt_bench_run(struct kvrt_bench *b, kv_progress_fn progress, void *ctx,
                   struct kv_err *err) {
    KV_ASSERT(b->m && b->n_ctx >= 1 && b->n_ctx <= KVRT_BENCH_MAX_CTXS && b->n_cache >= 1);
    int rc = b->kv_bits ? kvrt_bench_check_bits(b->kv_bits, NULL, err) : KV_OK;
    if (rc) return rc;
    set_configs(b);
    free(b->cells);
    b->cells = calloc((size_t)b->n_cfg * 2 * KVRT_BENCH_MAX_CTXS, sizeof *b->cells);
    if (!b->cells) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int64_t nl = kv_model_config(b->m)->n_layers, max_ctx = b->ctx[b->n_ctx - 1] + 1;
    int64_t total = (int64_t)b->n_cfg * b->n_cache * nl * b->n_ctx, done = 0;
    for (int c = 0; c < b->n_cfg && !rc; c++) {
        const char *name = b->cfgs[c].name;
        struct kv_lowrank *lr;
        int made;
        if ((rc = cfg_lowrank(b, c, &lr, &made, err))) break;
        b->cfgs[c].kv_bits = lr ? kv_lr_info(lr).kv_bits : 16;
        for (int ti = 0; ti < b->n_cache && !rc; ti++) {
            int t = b->caches[ti];
            struct kvrt_opts o;
            kvrt_opts_default(&o);
            o.backend = b->backend, o.cache = (enum kvrt_dtype)t, o.max_ctx = max_ctx;
            struct kvrt *rt;
            if ((rc = kvrt_open(b->m, lr, &o, &rt, err))) {
                err_context(err, name, t, max_ctx);
                break;
            }
            if (!(rc = kvrt_cache_fits(rt, max_ctx, err)))
                rc = time_layers(b, c, t, rt, &done, total, progress, ctx, err);
            kvrt_close(rt);
            if (rc) err_context(err, name, t, max_ctx);
        }
        if (made) kv_lr_free(lr);
    }
    return rc;
}

void kvrt_bench_release(struct kvrt_bench *b) {
    free(b->cells);
    b->cells = NULL;
}
