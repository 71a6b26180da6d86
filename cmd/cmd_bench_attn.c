/* kvcal bench-attn: time one decode-attention step of the runtime (kvrt.h)
 * over full and latent KV caches, on a synthetic preset or a manifest's
 * ranks. The table is the runtime's (kvrt_bench_run); this file reads the
 * command line and prints it. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "kvrt.h"

/* What the command line gives (file scope: the option table points into it). */
static struct bench_args {
    const char *preset, *dir, *device, *ctx, *cache;
    double keep;            /* NaN: not given */
    int64_t iters, layers, kv_bits; /* INT64_MIN: not given */
    int json, quiet;
} A = {.device = "cuda", .ctx = "1K,2K,4K,8K,16K,32K,64K", .cache = "both", .keep = NAN,
       .iters = INT64_MIN, .layers = INT64_MIN, .kv_bits = INT64_MIN};

static const struct cli_opt bench_opts[] = {
    {"synthetic", 0, OPT_STR, &A.preset, "PRESET",
     "random weights of real attention shapes: llama7b (MHA, 32 heads\n"
     "of 128), llama3-8b (GQA, 8 kv heads), gpt2-xl (25 heads of 64, no rope)"},
    {"manifest", 0, OPT_STR, &A.dir, "DIR",
     "a compressed model directory ('kvcal decompose'): its modes and\n"
     "ranks, timed with random factor values (only DIR/kvcal.json is read)"},
    {"device", 0, OPT_STR, &A.device, "D", "cuda (default) or twin (the runtime's cpu twin)"},
    {"ctx", 0, OPT_STR, &A.ctx, "LIST",
     "context lengths, K = 1024 (default 1K,2K,4K,8K,16K,32K,64K)"},
    {"keep", 0, OPT_DOUBLE, &A.keep, "F",
     "with --synthetic: mean latent rank per kv head as a fraction of\n"
     "head_dim, in (0, 1] (default 0.5)"},
    {"cache", 0, OPT_STR, &A.cache, "T", "cache storage: f16, f32 or both (default)"},
    {"kv-bits", 0, OPT_INT, &A.kv_bits, "B",
     "latent storage: 16 (as --cache) or 8, 4, 3, 2-bit codes with\n"
     "an fp16 scale and zero per unit and token (default 16; with\n"
     "--manifest the manifest's own, which B replaces); full keys\n"
     "and values stay as --cache"},
    {"iters", 0, OPT_INT, &A.iters, "N",
     "timed steps per layer and context (default 50 cuda, 3 twin)"},
    {"layers", 0, OPT_INT, &A.layers, "N",
     "layers to time: the preset's model gets N (default 1); a\n"
     "manifest's first N (default all)"},
    CLI_OPT_JSON(&A.json),
    CLI_OPT_QUIET(&A.quiet),
};

static const struct cli_cmd bench_cmd = {
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
    "and ranks), timed on random weights of those shapes: a manifest whose weights\n"
    "would not fit in 90% of the memory available is refused before any is made.\n"
    "Below 16 kv bits (--kv-bits, or a manifest's own) every latent is\n"
    "cached as codes plus an fp16 scale and zero per unit: 'kv bytes' then names the\n"
    "bits and counts ceil(rank x bits / 8) + 4 bytes per unit, whatever the cache dtype.\n"
    "\nnumbers: bytes a step moves = (ctx+1) x KV bytes per token and layer (as cached:\n"
    "f16, f32 or codes) + the fp32 weights it reads; GB/s = bytes / µs/step / 1e3; % peak\n"
    "against the device's memory bandwidth (cuda only); speedup = µs/step of full /\n"
    "µs/step of the row, at the same ctx and cache dtype. The table is markdown.\n"
    "\nexamples:\n"
    "  kvcal bench-attn --synthetic llama3-8b\n"
    "  kvcal bench-attn --synthetic gpt2-xl --ctx 4K,16K,64K --cache f16 --json\n"
    "  kvcal bench-attn --synthetic llama3-8b --kv-bits 4 --cache f16\n"
    "  kvcal bench-attn --manifest out-656K --device twin --ctx 256,1K\n",
    bench_opts, (int)(sizeof bench_opts / sizeof bench_opts[0]), 0};

/* The options as the library's messages name them. */
static const char *const bench_names[KVRT_BENCH_OPT_COUNT] = {
    [KVRT_BENCH_OPT_CTX] = "--ctx",
    [KVRT_BENCH_OPT_KEEP] = "--keep",
    [KVRT_BENCH_OPT_ITERS] = "--iters",
    [KVRT_BENCH_OPT_LAYERS] = "--layers",
    [KVRT_BENCH_OPT_KV_BITS] = "--kv-bits",
};

/* The table and what the header says about where it was timed. */
struct bench_out {
    struct kvrt_bench b;
    struct kvrt_device dev; /* cuda */
    int threads;            /* twin */
};

/* "1024,4K,64K": lengths (K = 1024), sorted and without repeats. */
static int parse_ctx(const struct cli_cmd *cmd, const char *s, int64_t *ctx, int *n) {
    *n = 0;
    const char *p = s;
    struct kv_err err;
    kv_err_clear(&err);
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
        if (kvrt_bench_check_ctx(v, bench_names, &err)) return cli_usage_error(cmd, "%s", err.msg);
        if (*n >= KVRT_BENCH_MAX_CTXS)
            return cli_usage_error(cmd, "--ctx has more than %d lengths", KVRT_BENCH_MAX_CTXS);
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

static const char *mode_pair(const struct kvrt_bench_cfg *g, char *buf, size_t cap) {
    if (g->mixed)
        snprintf(buf, cap, "modes differ between layers");
    else
        snprintf(buf, cap, "keys %s, values %s", kv_lr_mode_name(g->lk), kv_lr_mode_name(g->lv));
    if (g->kv_bits < 16)
        snprintf(buf + strlen(buf), cap - strlen(buf), ", %d-bit latents", g->kv_bits);
    return buf;
}

/* The latents' storage as the header names it: "" unquantized. */
static const char *bits_note(int bits, char *buf, size_t cap) {
    if (bits >= 16) return "";
    snprintf(buf, cap, ", %d-bit codes with an fp16 scale and zero per unit", bits);
    return buf;
}

static void print_text(const struct bench_out *p, const char *source) {
    const struct kvrt_bench *b = &p->b;
    const struct kv_config *c = kv_model_config(b->m);
    int cuda = b->backend == KVRT_BACKEND_CUDA;
    if (cuda)
        printf("device     %s, sm_%d%d, %d SMs, peak %.0f GB/s\n", p->dev.name, p->dev.cc_major,
               p->dev.cc_minor, p->dev.sm_count, p->dev.peak_gbs);
    else
        printf("device     cpu twin, %d threads\n", p->threads);
    printf("shapes     %s: d %lld, %lld heads, %lld kv heads, head_dim %lld, %lld layer%s timed, ",
           source, (long long)c->dim, (long long)c->n_heads, (long long)c->n_kv_heads,
           (long long)c->head_dim, (long long)c->n_layers, c->n_layers == 1 ? "" : "s");
    if (kv_arch_has_rope(c->arch))
        printf("rope theta %g\n", (double)c->rope_theta);
    else
        printf("no rope (learned positions)\n");
    char bn[96];
    if (b->lr)
        printf("manifest   method %s, alloc %s%s\n", kv_lr_info(b->lr).method,
               kv_lr_info(b->lr).alloc, bits_note(kv_lr_info(b->lr).kv_bits, bn, sizeof bn));
    else
        printf("latents    rank round(%g x head_dim) on average per kv head%s\n", b->keep,
               bits_note(b->kv_bits, bn, sizeof bn));
    printf("timing     %lld step%s per layer and context after 3 untimed ones\n",
           (long long)b->iters, b->iters == 1 ? "" : "s");
    printf("kv bytes   per token, all timed layers (per layer):\n");
    for (int g = 0; g < b->n_cfg; g++) {
        char mp[128];
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
                const struct kvrt_bench_cell *x = kvrt_bench_cell(b, g, t, i);
                const struct kvrt_bench_cell *f = kvrt_bench_cell(b, 0, t, i); /* full */
                double gbs = x->bytes / x->us_step / 1e3;
                char peak[16] = "-";
                if (cuda && p->dev.peak_gbs > 0)
                    snprintf(peak, sizeof peak, "%.1f", 100 * gbs / p->dev.peak_gbs);
                printf(
                    "| %7lld | %-30s | %-5s | %14.0f | %10.1f | %10.1f | %8.1f | %6s | %6.2fx |\n",
                    (long long)b->ctx[i], b->cfgs[g].name, kvrt_dtype_name((enum kvrt_dtype)t),
                    x->kv_layer, x->us_step, x->us_attn, gbs, peak, f->us_step / x->us_step);
            }
}

static int print_json(const struct bench_out *p, const char *preset, const char *dir) {
    const struct kvrt_bench *b = &p->b;
    const struct kv_config *c = kv_model_config(b->m);
    int cuda = b->backend == KVRT_BACKEND_CUDA;
    json_t *dev =
        cuda ? json_pack("{s:s, s:o, s:i, s:i, s:o}", "backend", "cuda", "name",
                         cli_json_text(p->dev.name), "cc", p->dev.cc_major * 10 + p->dev.cc_minor,
                         "sm_count", p->dev.sm_count, "peak_gbs", cli_json_real(p->dev.peak_gbs))
             : json_pack("{s:s, s:i}", "backend", "twin", "threads", p->threads);
    json_t *shapes =
        json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:b, s:o}", "arch", kv_arch_name(c->arch), "dim",
                  (json_int_t)c->dim, "n_heads", (json_int_t)c->n_heads, "n_kv_heads",
                  (json_int_t)c->n_kv_heads, "head_dim", (json_int_t)c->head_dim, "layers_timed",
                  (json_int_t)c->n_layers, "rope", kv_arch_has_rope(c->arch), "rope_theta",
                  kv_arch_has_rope(c->arch) ? cli_json_real(c->rope_theta) : json_null());
    json_t *cfgs = json_array(), *rows = json_array();
    for (int g = 0; g < b->n_cfg; g++) {
        const struct kvrt_bench_cfg *x = &b->cfgs[g];
        json_t *kv = json_object();
        for (int ti = 0; ti < b->n_cache; ti++) {
            int t = b->caches[ti];
            json_object_set_new(kv, kvrt_dtype_name((enum kvrt_dtype)t),
                                json_integer(x->kv_total[t]));
        }
        json_array_append_new(
            cfgs, json_pack("{s:s, s:o, s:o, s:i, s:o}", "name", x->name, "kmode",
                            x->mixed ? json_null() : json_string(kv_lr_mode_name(x->lk)), "vmode",
                            x->mixed ? json_null() : json_string(kv_lr_mode_name(x->lv)),
                            "kv_bits", x->kv_bits, "kv_bytes_per_token", kv));
    }
    for (int i = 0; i < b->n_ctx; i++)
        for (int g = 0; g < b->n_cfg; g++)
            for (int ti = 0; ti < b->n_cache; ti++) {
                int t = b->caches[ti];
                const struct kvrt_bench_cell *x = kvrt_bench_cell(b, g, t, i);
                const struct kvrt_bench_cell *f = kvrt_bench_cell(b, 0, t, i); /* full */
                double gbs = x->bytes / x->us_step / 1e3;
                json_array_append_new(
                    rows,
                    json_pack("{s:I, s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:o, s:o}", "ctx",
                              (json_int_t)b->ctx[i], "config", b->cfgs[g].name, "cache",
                              kvrt_dtype_name((enum kvrt_dtype)t), "kv_bytes_per_token_layer",
                              cli_json_real(x->kv_layer), "us_step", cli_json_real(x->us_step),
                              "us_attn", cli_json_real(x->us_attn), "bytes",
                              cli_json_real(x->bytes), "gbs", cli_json_real(gbs), "pct_peak",
                              cuda && p->dev.peak_gbs > 0
                                  ? cli_json_real(100 * gbs / p->dev.peak_gbs)
                                  : json_null(),
                              "speedup", cli_json_real(f->us_step / x->us_step)));
            }
    json_t *o = json_pack("{s:o, s:o, s:o, s:o, s:o, s:i, s:I, s:o, s:o}", "device", dev,
                          "synthetic", preset ? json_string(preset) : json_null(), "manifest",
                          dir ? cli_json_text(dir) : json_null(), "shapes", shapes, "keep",
                          b->lr ? json_null() : cli_json_real(b->keep), "kv_bits",
                          b->lr ? kv_lr_info(b->lr).kv_bits : b->kv_bits, "iters",
                          (json_int_t)b->iters, "configs", cfgs, "rows", rows);
    return cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
}

/* The device the rows are timed on, for the header. */
static int probe_device(struct bench_out *p) {
    struct kv_err err;
    kv_err_clear(&err);
    if (p->b.backend == KVRT_BACKEND_TWIN) {
        p->threads = omp_get_max_threads();
        return EXIT_OK;
    }
    int count = 0;
    if (kvrt_device_count(&count, &err)) return cli_report(&err);
    if (count < 1) {
        fprintf(stderr, "kvcal: no cuda device is visible (the driver reports none); "
                        "use --device twin for the cpu twin\n");
        return EXIT_ERR;
    }
    if (kvrt_device_query(0, &p->dev, &err)) return cli_report(&err);
    return EXIT_OK;
}

/* The checks, in the order the command has always made them: the command
 * line's own, and the library's rules with its names. Fills b. Returns -1
 * to go on, or EXIT_USAGE after the message. */
static int check_args(const struct cli_cmd *cmd, struct bench_args *a, struct kvrt_bench *b) {
    struct kv_err err;
    kv_err_clear(&err);
    if (!a->preset == !a->dir)
        return cli_usage_error(cmd, "give exactly one of --synthetic or --manifest");
    if (a->preset && !kvrt_synth_preset_valid(a->preset)) {
        const char *const *names = kvrt_synth_presets();
        char list[256] = "";
        for (int i = 0; names[i]; i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "",
                     names[i]);
        return cli_usage_error(cmd, "unknown preset '%s', expected one of %s", a->preset, list);
    }
    int be = kvrt_backend_parse(a->device), rc;
    if (be < 0) return cli_usage_error(cmd, "--device '%s' is not one of cuda, twin", a->device);
    b->backend = (enum kvrt_backend)be;
    if ((rc = parse_ctx(cmd, a->ctx, b->ctx, &b->n_ctx)) >= 0) return rc;
    if (!isnan(a->keep) && a->dir)
        return cli_usage_error(cmd, "--keep needs --synthetic (a manifest has its own ranks)");
    b->keep = isnan(a->keep) ? 0.5 : a->keep;
    if (kvrt_bench_check_keep(b->keep, bench_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    b->kv_bits = a->kv_bits == INT64_MIN ? 16 : (int)a->kv_bits;
    if (a->kv_bits != INT64_MIN && kvrt_bench_check_bits(a->kv_bits, bench_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    if (!strcmp(a->cache, "both"))
        b->caches[0] = KVRT_DTYPE_F16, b->caches[1] = KVRT_DTYPE_F32, b->n_cache = 2;
    else if (kvrt_dtype_parse(a->cache) >= 0)
        b->caches[0] = kvrt_dtype_parse(a->cache), b->n_cache = 1;
    else
        return cli_usage_error(cmd, "--cache '%s' is not one of f16, f32, both", a->cache);
    b->iters = a->iters == INT64_MIN ? kvrt_bench_default_iters(b->backend) : a->iters;
    if (kvrt_bench_check(b->iters, a->layers == INT64_MIN ? 1 : a->layers, bench_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    return -1;
}

/* The model timed (and with --manifest its compressed attention): a
 * manifest's first --layers layers with random factors, or the preset. */
static int open_model(const struct cli_cmd *cmd, const struct bench_args *a, struct kvrt_bench *b,
                      struct kv_model **m) {
    struct kv_err err;
    kv_err_clear(&err);
    if (a->preset) {
        if (kvrt_synth_model(a->preset, a->layers == INT64_MIN ? 1 : a->layers, m, &err))
            return cli_report(&err);
        b->m = *m;
        return EXIT_OK;
    }
    size_t n = strlen(a->dir) + 16;
    char *path = malloc(n);
    if (!path) return EXIT_ERR;
    snprintf(path, n, "%s/kvcal.json", a->dir);
    int rc = kv_lr_manifest_read(path, &b->lr, &err);
    free(path);
    if (rc) return cli_report(&err);
    int64_t layers = a->layers == INT64_MIN ? 0 : a->layers;
    if (kv_lr_info(b->lr).kv_bits == KV_LR_BITS_MIXED && a->kv_bits == INT64_MIN) {
        fprintf(stderr,
                "kvcal: %s: mixed latent bits (each unit's own bands, decompose --kv-bits auto) "
                "are not supported by the runtime; time the same factors at one width with "
                "--kv-bits B\n",
                a->dir);
        return EXIT_ERR;
    }
    if (kvrt_bench_check_manifest(b->lr, layers, bench_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    if (kvrt_bench_manifest(b->lr, layers, m, &err)) return cli_report(&err);
    b->m = *m;
    /* --kv-bits replaces the manifest's own (checked) */
    if (a->kv_bits != INT64_MIN && kv_lr_set_kv_bits(b->lr, (int)a->kv_bits, &err))
        return cli_report(&err);
    return EXIT_OK;
}

int cmd_bench_attn(int argc, char **argv) {
    const struct cli_cmd *cmd = &bench_cmd;
    struct bench_args *a = &A;
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    struct bench_out p;
    memset(&p, 0, sizeof p);
    if ((rc = check_args(cmd, a, &p.b)) >= 0) return rc;
    if ((rc = probe_device(&p))) return rc;
    struct kv_model *m = NULL;
    if (!(rc = open_model(cmd, a, &p.b, &m))) {
        struct kv_err err;
        kv_err_clear(&err);
        struct cli_progress prog;
        cli_progress_start(&prog, "timings", a->quiet || a->json);
        rc = kvrt_bench_run(&p.b, cli_progress_cb, &prog, &err);
        cli_progress_end(&prog);
        if (rc) {
            rc = cli_report(&err);
        } else if (a->json) {
            rc = print_json(&p, a->preset, a->dir);
        } else {
            char src[1100];
            snprintf(src, sizeof src, "%s%s", a->dir ? "manifest " : "",
                     a->dir ? a->dir : a->preset);
            print_text(&p, src);
        }
    }
    kvrt_bench_release(&p.b);
    kv_lr_free(p.b.lr);
    kv_model_close(m);
    return rc;
}
