/* kvcal bench-attn: time one decode-attention step of the runtime (kvrt.h)
 * over full and latent KV caches, on a synthetic preset or a manifest's
 * ranks. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"
#include "kvrt.h"

#define MAX_CTXS 64
#define SEED_FILL 0x5eedull
#define SEED_FACTORS 7ull

/* One configuration timed at every context: a name and how its compressed
 * attention is made (synthetic modes, or the manifest's own). */
struct bench_cfg {
    const char *name;
    enum kv_lr_mode kmode, vmode;
    int manifest;
    /* filled as it is timed, per cache dtype (index enum kvrt_dtype) */
    int64_t kv_total[2];    /* KV bytes per token over the timed layers */
    enum kv_lr_mode lk, lv; /* modes of layer 0 as the runtime runs them */
    int mixed;              /* layers differ in modes */
};

/* The mean over the timed layers of one (configuration, cache, context). */
struct bench_cell {
    double us_step, us_attn, bytes, kv_layer;
};

struct bench {
    /* inputs */
    enum kvrt_backend backend;
    int64_t ctx[MAX_CTXS];
    int n_ctx;
    int caches[2], n_cache;
    int64_t iters, layers;
    int json, quiet;
    /* what runs */
    struct kv_model *m;
    struct kv_lowrank *lr; /* manifest (factors filled), NULL for a preset */
    double keep;
    struct bench_cfg cfgs[4];
    int n_cfg;
    struct bench_cell *cells; /* [cfg][cache][ctx] */
    struct kvrt_device dev;
    int threads;
};

static struct bench_cell *cell(struct bench *b, int c, int t, int i) {
    return &b->cells[((size_t)c * 2 + (size_t)t) * MAX_CTXS + (size_t)i];
}

/* "1024,4K,64K": lengths (K = 1024), sorted and without repeats. */
static int parse_ctx(const struct cli_cmd *cmd, const char *s, int64_t *ctx, int *n) {
    *n = 0;
    const char *p = s;
    for (;;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char item[32];
        char *end;
        if (len == 0 || len >= sizeof item)
            return cli_usage_error(
                cmd, "--ctx '%s' is not a list of context lengths (e.g. 1K,4096,64K)", s);
        memcpy(item, p, len);
        item[len] = 0;
        errno = 0;
        long long v = strtoll(item, &end, 10);
        if (end != item && (*end == 'K' || *end == 'k') && end[1] == 0 && v <= (1ll << 40))
            v *= 1024, end++;
        if (errno || end == item || *end)
            return cli_usage_error(
                cmd, "--ctx item '%s' is not a context length (an integer, K for 1024: 4096, 64K)",
                item);
        if (v < 1 || v > kvrt_max_ctx() - 1)
            return cli_usage_error(cmd, "--ctx length %lld is outside 1..%lld", v,
                                   (long long)kvrt_max_ctx() - 1);
        if (*n >= MAX_CTXS) return cli_usage_error(cmd, "--ctx has more than %d lengths", MAX_CTXS);
        int at = *n;
        while (at > 0 && ctx[at - 1] > v) at--;
        if (at > 0 && ctx[at - 1] == v) goto next;
        memmove(ctx + at + 1, ctx + at, (size_t)(*n - at) * sizeof *ctx);
        ctx[at] = v, (*n)++;
    next:
        if (!e) return -1;
        p = e + 1;
    }
}

/* The compressed attention configuration c runs: NULL for full, the
 * manifest's, or a fresh synthetic one (*made set, the caller frees). */
static int cfg_lowrank(struct bench *b, int c, struct kv_lowrank **lr, int *made,
                       struct kv_err *err) {
    const struct bench_cfg *g = &b->cfgs[c];
    *lr = NULL, *made = 0;
    if (g->manifest) {
        *lr = b->lr;
        return KV_OK;
    }
    if (g->kmode == KV_LR_FULL && g->vmode == KV_LR_FULL) return KV_OK;
    *made = 1;
    return kvrt_synth_lowrank(b->m, g->kmode, g->vmode, b->keep, SEED_FACTORS, lr, err);
}

/* Say which run a runtime error came from (a big context may not fit). */
static void err_context(struct kv_err *err, const char *cfg, int t, int64_t positions) {
    char m[sizeof err->msg + 128];
    snprintf(m, sizeof m, "%s (configuration '%s', %s cache, %lld positions)", err->msg, cfg,
             kvrt_dtype_name((enum kvrt_dtype)t), (long long)positions);
    memcpy(err->msg, m, sizeof err->msg - 1);
    err->msg[sizeof err->msg - 1] = 0;
}

/* Time every (configuration, cache, layer, context). */
static int run_all(struct bench *b, struct kv_err *err) {
    int64_t nl = kv_model_config(b->m)->n_layers, max_ctx = b->ctx[b->n_ctx - 1] + 1;
    struct cli_progress prog;
    cli_progress_start(&prog, "timings", b->quiet || b->json);
    int64_t total = (int64_t)b->n_cfg * b->n_cache * nl * b->n_ctx, done = 0;
    int rc = KV_OK;
    for (int c = 0; c < b->n_cfg && !rc; c++) {
        struct bench_cfg *g = &b->cfgs[c];
        struct kv_lowrank *lr;
        int made;
        if ((rc = cfg_lowrank(b, c, &lr, &made, err))) break;
        for (int ti = 0; ti < b->n_cache && !rc; ti++) {
            int t = b->caches[ti];
            struct kvrt_opts o;
            kvrt_opts_default(&o);
            o.backend = b->backend, o.cache = (enum kvrt_dtype)t, o.max_ctx = max_ctx;
            struct kvrt *rt;
            if ((rc = kvrt_open(b->m, lr, &o, &rt, err))) {
                err_context(err, g->name, t, max_ctx);
                break;
            }
            if ((rc = kvrt_cache_fits(rt, max_ctx, err))) {
                kvrt_close(rt);
                err_context(err, g->name, t, max_ctx);
                break;
            }
            g->kv_total[t] = 0;
            for (int i = 0; i < b->n_ctx; i++) *cell(b, c, t, i) = (struct bench_cell){0};
            for (int64_t l = 0; l < nl && !rc; l++) {
                struct kvrt_layer_info li;
                kvrt_layer_info(rt, l, &li);
                g->kv_total[t] += li.cache_bytes_per_token;
                if (l == 0)
                    g->lk = li.kmode, g->lv = li.vmode, g->mixed = 0;
                else if (li.kmode != g->lk || li.vmode != g->lv)
                    g->mixed = 1;
                /* one fill to the longest context; then the contexts from the
                 * longest down, each step appending at ctx over 0..ctx-1 */
                if ((rc = kvrt_fill(rt, l, max_ctx - 1, SEED_FILL + (uint64_t)l, err))) break;
                for (int i = b->n_ctx - 1; i >= 0; i--) {
                    double us, ua;
                    if ((rc = kvrt_time_step(rt, l, b->ctx[i], b->iters, &us, &ua, err))) break;
                    struct bench_cell *x = cell(b, c, t, i);
                    x->us_step += us / (double)nl, x->us_attn += ua / (double)nl;
                    x->bytes +=
                        (double)((b->ctx[i] + 1) * li.cache_bytes_per_token + li.weight_bytes) /
                        (double)nl;
                    x->kv_layer += (double)li.cache_bytes_per_token / (double)nl;
                    cli_progress_cb(&prog, ++done, total, 0);
                }
            }
            kvrt_close(rt);
            if (rc) err_context(err, g->name, t, max_ctx);
        }
        if (made) kv_lr_free(lr);
    }
    cli_progress_end(&prog);
    return rc;
}

static const char *mode_pair(const struct bench_cfg *g, char *buf, size_t cap) {
    if (g->mixed)
        snprintf(buf, cap, "modes differ between layers");
    else
        snprintf(buf, cap, "keys %s, values %s", kv_lr_mode_name(g->lk), kv_lr_mode_name(g->lv));
    return buf;
}

static void print_text(struct bench *b, const char *source, const char *note) {
    const struct kv_config *c = kv_model_config(b->m);
    int cuda = b->backend == KVRT_BACKEND_CUDA;
    if (cuda)
        printf("device     %s, sm_%d%d, %d SMs, peak %.0f GB/s\n", b->dev.name, b->dev.cc_major,
               b->dev.cc_minor, b->dev.sm_count, b->dev.peak_gbs);
    else
        printf("device     cpu twin, %d threads\n", b->threads);
    printf("shapes     %s: d %lld, %lld heads, %lld kv heads, head_dim %lld, %lld layer%s timed, ",
           source, (long long)c->dim, (long long)c->n_heads, (long long)c->n_kv_heads,
           (long long)c->head_dim, (long long)c->n_layers, c->n_layers == 1 ? "" : "s");
    if (c->arch == KV_ARCH_LLAMA)
        printf("rope theta %g\n", (double)c->rope_theta);
    else
        printf("no rope (learned positions)\n");
    if (b->lr)
        printf("manifest   method %s, alloc %s\n", kv_lr_info(b->lr).method,
               kv_lr_info(b->lr).alloc);
    else
        printf("latents    rank round(%g x head_dim) on average per kv head\n", b->keep);
    if (note) printf("note       %s\n", note);
    printf("timing     %lld step%s per layer and context after 3 untimed ones\n",
           (long long)b->iters, b->iters == 1 ? "" : "s");
    printf("kv bytes   per token, all timed layers (per layer):\n");
    for (int g = 0; g < b->n_cfg; g++) {
        char mp[96];
        printf("  %-31s", b->cfgs[g].name);
        for (int ti = 0; ti < b->n_cache; ti++) {
            int t = b->caches[ti];
            printf(" %s %7lld (%6.0f)", kvrt_dtype_name((enum kvrt_dtype)t),
                   (long long)b->cfgs[g].kv_total[t],
                   (double)b->cfgs[g].kv_total[t] / (double)c->n_layers);
        }
        printf("   %s\n", mode_pair(&b->cfgs[g], mp, sizeof mp));
    }
    /* "µ" takes two bytes: its columns get one more */
    printf("\n| %7s | %-30s | %-5s | %14s | %11s | %11s | %8s | %6s | %7s |\n", "ctx", "config",
           "cache", "KV B/tok/layer", "µs/step", "µs attn", "GB/s", "% peak", "speedup");
    printf("|--------:|:-------------------------------|:------|---------------:|-----------:|"
           "-----------:|---------:|-------:|--------:|\n");
    for (int i = 0; i < b->n_ctx; i++)
        for (int g = 0; g < b->n_cfg; g++)
            for (int ti = 0; ti < b->n_cache; ti++) {
                int t = b->caches[ti];
                const struct bench_cell *x = cell(b, g, t, i), *f = cell(b, 0, t, i);
                double gbs = x->bytes / x->us_step / 1e3;
                char peak[16] = "-";
                if (cuda && b->dev.peak_gbs > 0)
                    snprintf(peak, sizeof peak, "%.1f", 100 * gbs / b->dev.peak_gbs);
                printf(
                    "| %7lld | %-30s | %-5s | %14.0f | %10.1f | %10.1f | %8.1f | %6s | %6.2fx |\n",
                    (long long)b->ctx[i], b->cfgs[g].name, kvrt_dtype_name((enum kvrt_dtype)t),
                    x->kv_layer, x->us_step, x->us_attn, gbs, peak, f->us_step / x->us_step);
            }
}

static int print_json(struct bench *b, const char *preset, const char *dir, const char *note) {
    const struct kv_config *c = kv_model_config(b->m);
    int cuda = b->backend == KVRT_BACKEND_CUDA;
    json_t *dev =
        cuda ? json_pack("{s:s, s:o, s:i, s:i, s:o}", "backend", "cuda", "name",
                         cli_json_text(b->dev.name), "cc", b->dev.cc_major * 10 + b->dev.cc_minor,
                         "sm_count", b->dev.sm_count, "peak_gbs", cli_json_real(b->dev.peak_gbs))
             : json_pack("{s:s, s:i}", "backend", "twin", "threads", b->threads);
    json_t *shapes =
        json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:b, s:o}", "arch", kv_arch_name(c->arch), "dim",
                  (json_int_t)c->dim, "n_heads", (json_int_t)c->n_heads, "n_kv_heads",
                  (json_int_t)c->n_kv_heads, "head_dim", (json_int_t)c->head_dim, "layers_timed",
                  (json_int_t)c->n_layers, "rope", c->arch == KV_ARCH_LLAMA, "rope_theta",
                  c->arch == KV_ARCH_LLAMA ? cli_json_real(c->rope_theta) : json_null());
    json_t *cfgs = json_array(), *rows = json_array();
    for (int g = 0; g < b->n_cfg; g++) {
        const struct bench_cfg *x = &b->cfgs[g];
        json_t *kv = json_object();
        for (int ti = 0; ti < b->n_cache; ti++) {
            int t = b->caches[ti];
            json_object_set_new(kv, kvrt_dtype_name((enum kvrt_dtype)t),
                                json_integer(x->kv_total[t]));
        }
        json_array_append_new(
            cfgs, json_pack("{s:s, s:o, s:o, s:o}", "name", x->name, "kmode",
                            x->mixed ? json_null() : json_string(kv_lr_mode_name(x->lk)), "vmode",
                            x->mixed ? json_null() : json_string(kv_lr_mode_name(x->lv)),
                            "kv_bytes_per_token", kv));
    }
    for (int i = 0; i < b->n_ctx; i++)
        for (int g = 0; g < b->n_cfg; g++)
            for (int ti = 0; ti < b->n_cache; ti++) {
                int t = b->caches[ti];
                const struct bench_cell *x = cell(b, g, t, i), *f = cell(b, 0, t, i);
                double gbs = x->bytes / x->us_step / 1e3;
                json_array_append_new(
                    rows,
                    json_pack("{s:I, s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:o, s:o}", "ctx",
                              (json_int_t)b->ctx[i], "config", b->cfgs[g].name, "cache",
                              kvrt_dtype_name((enum kvrt_dtype)t), "kv_bytes_per_token_layer",
                              cli_json_real(x->kv_layer), "us_step", cli_json_real(x->us_step),
                              "us_attn", cli_json_real(x->us_attn), "bytes",
                              cli_json_real(x->bytes), "gbs", cli_json_real(gbs), "pct_peak",
                              cuda && b->dev.peak_gbs > 0
                                  ? cli_json_real(100 * gbs / b->dev.peak_gbs)
                                  : json_null(),
                              "speedup", cli_json_real(f->us_step / x->us_step)));
            }
    json_t *o = json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:I, s:o, s:o}", "device", dev,
                          "synthetic", preset ? json_string(preset) : json_null(), "manifest",
                          dir ? cli_json_text(dir) : json_null(), "shapes", shapes, "keep",
                          b->lr ? json_null() : cli_json_real(b->keep), "note",
                          note ? json_string(note) : json_null(), "iters", (json_int_t)b->iters,
                          "configs", cfgs, "rows", rows);
    return cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
}

/* The manifest's first `layers` layers (unset: all) with random factors, and
 * a random model of its shapes. */
static int open_manifest(const struct cli_cmd *cmd, struct bench *b, const char *dir,
                         int64_t layers, char *note, size_t note_cap) {
    struct kv_err err;
    kv_err_clear(&err);
    size_t n = strlen(dir) + 16;
    char *path = malloc(n);
    if (!path) return EXIT_ERR;
    snprintf(path, n, "%s/kvcal.json", dir);
    int rc = kv_lr_manifest_read(path, &b->lr, &err);
    free(path);
    if (rc) return cli_report(&err);
    int64_t n_layers = kv_lr_info(b->lr).n_layers;
    int bits = kv_lr_info(b->lr).kv_bits;
    if (layers > n_layers)
        return cli_usage_error(cmd, "--layers %lld exceeds the manifest's %lld layers",
                               (long long)layers, (long long)n_layers);
    b->layers = layers > 0 ? layers : n_layers;
    if (bits < 16) {
        snprintf(note, note_cap,
                 "the manifest quantizes latents to %d bits; the runtime caches them unquantized "
                 "(fp16/fp32), as timed here",
                 bits);
        kv_lr_set_kv_bits(b->lr, 16, &err);
    }
    /* only the timed layers get factors and a model */
    if (kv_lr_truncate(b->lr, b->layers, &err)) return cli_report(&err);
    if (kvrt_synth_fill_factors(b->lr, SEED_FACTORS, &err) ||
        kvrt_synth_model_for(b->lr, &b->m, &err))
        return cli_report(&err);
    return EXIT_OK;
}

/* The device the rows are timed on, for the header. */
static int probe_device(struct bench *b) {
    struct kv_err err;
    kv_err_clear(&err);
    if (b->backend == KVRT_BACKEND_TWIN) {
        b->threads = omp_get_max_threads();
        return EXIT_OK;
    }
    int count = 0;
    if (kvrt_device_count(&count, &err)) return cli_report(&err);
    if (count < 1) {
        fprintf(stderr, "kvcal: no cuda device is visible (the driver reports none); "
                        "use --device twin for the cpu twin\n");
        return EXIT_ERR;
    }
    if (kvrt_device_query(0, &b->dev, &err)) return cli_report(&err);
    return EXIT_OK;
}

int cmd_bench_attn(int argc, char **argv) {
    const char *preset = NULL, *dir = NULL, *device = "cuda", *ctx_s = "1K,2K,4K,8K,16K,32K,64K";
    const char *cache = "both";
    double keep = NAN;
    int64_t iters = INT64_MIN, layers = INT64_MIN;
    int json = 0, quiet = 0;
    const struct cli_opt opts[] = {
        {"synthetic", 0, OPT_STR, &preset, "PRESET",
         "random weights of real attention shapes: llama7b (MHA, 32 heads\n"
         "of 128), llama3-8b (GQA, 8 kv heads), gpt2-xl (25 heads of 64, no rope)"},
        {"manifest", 0, OPT_STR, &dir, "DIR",
         "a compressed model directory ('kvcal decompose'): its modes and\n"
         "ranks, timed with random factor values (only DIR/kvcal.json is read)"},
        {"device", 0, OPT_STR, &device, "D", "cuda (default) or twin (the runtime's cpu twin)"},
        {"ctx", 0, OPT_STR, &ctx_s, "LIST",
         "context lengths, K = 1024 (default 1K,2K,4K,8K,16K,32K,64K)"},
        {"keep", 0, OPT_DOUBLE, &keep, "F",
         "with --synthetic: mean latent rank per kv head as a fraction of\n"
         "head_dim, in (0, 1] (default 0.5)"},
        {"cache", 0, OPT_STR, &cache, "T", "cache storage: f16, f32 or both (default)"},
        {"iters", 0, OPT_INT, &iters, "N",
         "timed steps per layer and context (default 50 cuda, 3 twin)"},
        {"layers", 0, OPT_INT, &layers, "N",
         "layers to time: the preset's model gets N (default 1); a\n"
         "manifest's first N (default all)"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON object on stdout"},
        {"quiet", 'q', OPT_FLAG, &quiet, NULL, "no progress on stderr"},
    };
    const struct cli_cmd cmd = {
        "bench-attn", "(--synthetic PRESET | --manifest DIR) [options]",
        "Time one decode-attention step of the runtime over full and latent KV caches.",
        "what is timed: one decode step of one layer at position ctx, over a cache holding the\n"
        "ctx earlier positions (filled with random entries): the query and key/value (or\n"
        "latent) projections, the cache append, the attention kernels and the output\n"
        "projection. 'µs/step' is the mean of --iters steps (after 3 untimed ones) averaged\n"
        "over the timed layers; 'µs attn' is the attention kernels alone (scores, softmax,\n"
        "P·V and the combine of sequence chunks). cuda times with events on the device's\n"
        "stream, the twin with the wall clock.\n"
        "\nconfigurations at every ctx and cache dtype:\n"
        "  full                            the model's own K/V cache\n"
        "  prerope_latent+fused_output     keys cached as latents, rebuilt and RoPE'd tile by\n"
        "                                  tile; values cached as latents, the output\n"
        "                                  projection fused with their up factor\n"
        "  postrope_rotation+fused_output  keys rotated after RoPE, ranks alternately 0.5x\n"
        "                                  and 1.5x the mean (unequal heads)\n"
        "  fused_query+fused_output        gpt2-xl (no rope) instead of prerope: the key up\n"
        "                                  factor folded into the query\n"
        "with --synthetic every latent has rank round(keep x head_dim) on average; with\n"
        "--manifest the rows are 'full' (the manifest's shapes) and 'manifest' (its modes\n"
        "and ranks). Quantized latents (kv bits < 16) are timed unquantized, with a note.\n"
        "\nnumbers: bytes a step moves = (ctx+1) x KV bytes per token and layer (as cached,\n"
        "f16 or f32) + the fp32 weights it reads; GB/s = bytes / µs/step / 1e3; % peak\n"
        "against the device's memory bandwidth (cuda only); speedup = µs/step of full /\n"
        "µs/step of the row, at the same ctx and cache dtype. The table is markdown.\n"
        "\nexamples:\n"
        "  kvcal bench-attn --synthetic llama3-8b\n"
        "  kvcal bench-attn --synthetic gpt2-xl --ctx 4K,16K,64K --cache f16 --json\n"
        "  kvcal bench-attn --manifest out-656K --device twin --ctx 256,1K\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!preset == !dir)
        return cli_usage_error(&cmd, "give exactly one of --synthetic or --manifest");
    if (preset) {
        const char *const *names = kvrt_synth_presets();
        int ok = 0;
        char list[256] = "";
        for (int i = 0; names[i]; i++) {
            ok |= !strcmp(preset, names[i]);
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "",
                     names[i]);
        }
        if (!ok)
            return cli_usage_error(&cmd, "unknown preset '%s', expected one of %s", preset, list);
    }
    struct bench b;
    memset(&b, 0, sizeof b);
    int be = kvrt_backend_parse(device);
    if (be < 0) return cli_usage_error(&cmd, "--device '%s' is not one of cuda, twin", device);
    b.backend = (enum kvrt_backend)be;
    if ((rc = parse_ctx(&cmd, ctx_s, b.ctx, &b.n_ctx)) >= 0) return rc;
    if (!isnan(keep) && dir)
        return cli_usage_error(&cmd, "--keep needs --synthetic (a manifest has its own ranks)");
    if (isnan(keep)) keep = 0.5;
    if (!(keep > 0 && keep <= 1))
        return cli_usage_error(&cmd, "--keep %g is not within (0, 1]", keep);
    if (!strcmp(cache, "both"))
        b.caches[0] = KVRT_DTYPE_F16, b.caches[1] = KVRT_DTYPE_F32, b.n_cache = 2;
    else if (kvrt_dtype_parse(cache) >= 0)
        b.caches[0] = kvrt_dtype_parse(cache), b.n_cache = 1;
    else
        return cli_usage_error(&cmd, "--cache '%s' is not one of f16, f32, both", cache);
    if (iters == INT64_MIN) iters = b.backend == KVRT_BACKEND_CUDA ? 50 : 3;
    if (iters < 1)
        return cli_usage_error(&cmd, "--iters must be at least 1, got %lld", (long long)iters);
    if (layers != INT64_MIN && layers < 1)
        return cli_usage_error(&cmd, "--layers must be at least 1, got %lld", (long long)layers);
    b.iters = iters, b.keep = keep, b.json = json, b.quiet = quiet;
    if ((rc = probe_device(&b))) return rc;

    struct kv_err err;
    kv_err_clear(&err);
    char note[256] = "";
    if (dir) {
        rc = open_manifest(&cmd, &b, dir, layers, note, sizeof note);
    } else {
        b.layers = layers == INT64_MIN ? 1 : layers;
        if (kvrt_synth_model(preset, b.layers, &b.m, &err)) rc = cli_report(&err);
    }
    if (rc) goto done;
#define CFG(n, k, v) {.name = n, .kmode = KV_LR_##k, .vmode = KV_LR_##v}
    static const struct bench_cfg rope_cfgs[] = {
        CFG("full", FULL, FULL),
        CFG("prerope_latent+fused_output", PREROPE_LATENT, FUSED_OUTPUT),
        CFG("postrope_rotation+fused_output", POSTROPE_ROTATION, FUSED_OUTPUT),
    };
    static const struct bench_cfg norope_cfgs[] = {
        CFG("full", FULL, FULL),
        CFG("fused_query+fused_output", FUSED_QUERY, FUSED_OUTPUT),
        CFG("postrope_rotation+fused_output", POSTROPE_ROTATION, FUSED_OUTPUT),
    };
#undef CFG
    if (dir) {
        b.cfgs[0] = rope_cfgs[0];
        b.cfgs[1] = (struct bench_cfg){.name = "manifest", .manifest = 1};
        b.n_cfg = 2;
    } else {
        int rope = kv_model_config(b.m)->arch == KV_ARCH_LLAMA;
        memcpy(b.cfgs, rope ? rope_cfgs : norope_cfgs, sizeof rope_cfgs);
        b.n_cfg = 3;
    }
    if (!(b.cells = calloc((size_t)b.n_cfg * 2 * MAX_CTXS, sizeof *b.cells))) {
        fprintf(stderr, "kvcal: out of memory\n");
        rc = EXIT_ERR;
        goto done;
    }
    if (run_all(&b, &err)) {
        rc = cli_report(&err);
        goto done;
    }
    if (json) {
        rc = print_json(&b, preset, dir, note[0] ? note : NULL);
    } else {
        char src[1100];
        snprintf(src, sizeof src, "%s%s", dir ? "manifest " : "", dir ? dir : preset);
        print_text(&b, src, note[0] ? note : NULL);
    }
done:
    kv_lr_free(b.lr);
    kv_model_close(b.m);
    free(b.cells);
    return rc;
}
