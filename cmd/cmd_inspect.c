/* kvcal inspect: what a model file or directory holds. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "commands.h"

static void shape_str(const struct kv_tensor *t, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static void rank_text(int64_t a, int64_t b, char *buf, size_t cap) {
    if (a < 0)
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%lld/%lld", (long long)a, (long long)b);
}

/* The header of `kvcal inspect STATS`: the run, its inputs and the table's title. */
static void stats_header_text(const char *path, const struct kv_stats *s) {
    struct kv_stats_info si = kv_stats_info(s);
    printf("stats      %s (kvcal.stats, written by kvcal %s)\n", path, si.version);
    printf("model      fingerprint %s\n           dim %lld, %lld layers, %lld heads (%lld kv), "
           "head_dim %lld\n", si.fingerprint, (long long)si.dim, (long long)si.n_layers,
           (long long)si.n_heads, (long long)si.n_kv_heads, (long long)si.head_dim);
    printf("tokens     %lld in %lld windows of %lld (%s", (long long)si.tokens,
           (long long)si.windows, (long long)si.seq_len, si.sampling);
    if (!strcmp(si.sampling, "random")) printf(", seed %llu", (unsigned long long)si.seed);
    if (si.shard_count > 1) printf(", shard %lld/%lld", (long long)si.shard_index, (long long)si.shard_count);
    printf(")\n");
    if (si.next_window < si.plan_windows)
        printf("checkpoint %lld of %lld planned windows done; finish with 'kvcal collect --resume'\n",
               (long long)si.next_window, (long long)si.plan_windows);
    for (int64_t i = 0; i < si.n_inputs; i++) {
        const struct kv_stats_input *in = kv_stats_input(s, i);
        printf("input      %s: %llu bytes, sha256 %.16s…, %lld tokens, %lld windows\n",
               in->path, (unsigned long long)in->bytes, in->sha256, (long long)in->tokens,
               (long long)in->windows);
    }
    if (si.has_fisher)
        printf("fisher     yes: squared W_k/W_v gradients and ∂L/∂k, ∂L/∂v Grams of %lld "
               "windows (per layer below)\n", (long long)si.windows);
    else
        printf("fisher     none ('kvcal collect --fisher' adds them; --alloc fisher needs "
               "them)\n");
    printf("\neffective rank = fewest eigen-directions keeping 90%%/99%% of the energy\n");
    printf("%-6s %12s %12s %14s   per kv head 0..%lld: K|V|K post-rope, of %lld\n", "layer",
           "trace(XtX)", "cond(XtX)", "XtX rank", (long long)(si.n_kv_heads - 1),
           (long long)si.head_dim);
}

/* Layer l's spectrum as a JSON object (with K/V ranks when there is a model). */
static json_t *stats_layer_json(const struct kv_stats *s, int with_model, int64_t l,
                                const struct kv_layer_spectrum *sp) {
    struct kv_stats_info si = kv_stats_info(s);
    const struct kv_head_spectrum *heads = sp->heads;
    json_t *hs = json_array();
    for (int64_t j = 0; j < si.n_kv_heads; j++) {
        json_t *h = json_pack("{s:I, s:[I,I]}", "kv_head", (json_int_t)j,
                              "k_rope_rank", (json_int_t)heads[j].krope90,
                              (json_int_t)heads[j].krope99);
        if (h && with_model) {
            json_object_set_new(h, "k_rank", json_pack("[I,I]", (json_int_t)heads[j].k90, (json_int_t)heads[j].k99));
            json_object_set_new(h, "v_rank", json_pack("[I,I]", (json_int_t)heads[j].v90, (json_int_t)heads[j].v99));
        }
        json_array_append_new(hs, h);
    }
    json_t *fi = si.has_fisher ? json_pack("{s:o, s:o}", "k",
                                           cli_json_real(kv_stats_fisher_total(s, l, 0)), "v",
                                           cli_json_real(kv_stats_fisher_total(s, l, 1)))
                               : json_null();
    return json_pack("{s:I, s:o, s:o, s:o, s:o, s:[I,I], s:o, s:o}", "layer", (json_int_t)l,
                     "trace", cli_json_real(sp->trace), "lambda_max", cli_json_real(sp->lambda_max),
                     "lambda_min", cli_json_real(sp->lambda_min), "cond", cli_json_real(sp->cond),
                     "xtx_rank", (json_int_t)sp->x90, (json_int_t)sp->x99, "heads", hs, "fisher",
                     fi);
}

/* Layer l's spectrum as one row of the text table. */
static void stats_layer_text(const struct kv_stats *s, int64_t l, const struct kv_layer_spectrum *sp) {
    struct kv_stats_info si = kv_stats_info(s);
    char xr[32], cond[32];
    snprintf(xr, sizeof xr, "%lld/%lld of %lld", (long long)sp->x90, (long long)sp->x99,
             (long long)si.dim);
    if (isfinite(sp->cond))
        snprintf(cond, sizeof cond, "%.3e", sp->cond);
    else
        snprintf(cond, sizeof cond, "inf");
    printf("%-6lld %12.4e %12s %14s  ", (long long)l, sp->trace, cond, xr);
    for (int64_t j = 0; j < si.n_kv_heads; j++) {
        char a[24], b[24], c[24];
        rank_text(sp->heads[j].k90, sp->heads[j].k99, a, sizeof a);
        rank_text(sp->heads[j].v90, sp->heads[j].v99, b, sizeof b);
        rank_text(sp->heads[j].krope90, sp->heads[j].krope99, c, sizeof c);
        printf(" %s|%s|%s", a, b, c);
    }
    printf("\n");
}

/* The whole statistics file as one JSON object; layers is consumed. */
static int stats_json(const char *path, const struct kv_stats *s, json_t *layers) {
    struct kv_stats_info si = kv_stats_info(s);
    json_t *ins = cli_json_stats_inputs(s);
    json_t *o = json_pack("{s:o, s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:s, s:I, s:I, s:o, s:o}",
                          "path", cli_json_text(path), "type", "kvcal.stats", "version", si.version,
                          "fingerprint", si.fingerprint, "n_layers", (json_int_t)si.n_layers,
                          "dim", (json_int_t)si.dim, "n_heads", (json_int_t)si.n_heads,
                          "n_kv_heads", (json_int_t)si.n_kv_heads, "head_dim",
                          (json_int_t)si.head_dim, "seq_len", (json_int_t)si.seq_len, "tokens",
                          (json_int_t)si.tokens, "windows", (json_int_t)si.windows, "sampling",
                          si.sampling, "plan_windows", (json_int_t)si.plan_windows,
                          "next_window", (json_int_t)si.next_window, "inputs", ins, "layers", layers);
    if (o) json_object_set_new(o, "fisher", json_boolean(si.has_fisher));
    return cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
}

/* Each layer's Fisher information and its share of the total. */
static void stats_fisher_text(const struct kv_stats *s) {
    int64_t n_layers = kv_stats_info(s).n_layers;
    double all = 0;
    for (int64_t l = 0; l < n_layers; l++) all += kv_stats_fisher_total(s, l, 0) + kv_stats_fisher_total(s, l, 1);
    printf("\nfisher information Σ (∂L/∂W)² of each layer's K and V projection, and its "
           "share of the total\n%-6s %12s %12s %8s %8s\n", "layer", "K", "V", "K %", "V %");
    for (int64_t l = 0; l < n_layers; l++) {
        double k = kv_stats_fisher_total(s, l, 0), v = kv_stats_fisher_total(s, l, 1);
        printf("%-6lld %12.4e %12.4e %7.2f%% %7.2f%%\n", (long long)l, k, v,
               all > 0 ? 100 * k / all : 0.0, all > 0 ? 100 * v / all : 0.0);
    }
}

/* `kvcal inspect STATS`: the run and, per layer, the spectra (with a
 * model, its K and V output ranks too). */
static int inspect_stats(const char *path, const char *model, const char *tokenizer, int json) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stats *s;
    if (kv_stats_open(path, &s, &err)) return cli_report(&err);
    struct kv_model *m = NULL;
    int rc;
    if (model) {
        if ((rc = cli_load_model(model, tokenizer, &m))) {
            kv_stats_free(s);
            return rc;
        }
        if (!kv_stats_matches_model(s, m, path, &err)) {
            kv_stats_free(s);
            kv_model_close(m);
            return cli_report(&err);
        }
    }
    struct kv_stats_info si = kv_stats_info(s);
    struct kv_head_spectrum *heads = calloc((size_t)si.n_kv_heads, sizeof *heads);
    json_t *layers = json ? json_array() : NULL;
    if (!json) stats_header_text(path, s);
    rc = EXIT_OK;
    for (int64_t l = 0; l < si.n_layers && heads; l++) {
        struct kv_layer_spectrum sp = {.heads = heads};
        if (kv_stats_layer_spectrum(s, m, l, &sp, &err)) {
            snprintf(err.path, sizeof err.path, "%s", path);
            rc = cli_report(&err);
            break;
        }
        if (json)
            json_array_append_new(layers, stats_layer_json(s, m != NULL, l, &sp));
        else
            stats_layer_text(s, l, &sp);
    }
    if (!heads) rc = cli_report(&(struct kv_err){.code = KV_ENOMEM, .off = KV_NO_OFFSET, .msg = "out of memory"});
    if (json && rc == EXIT_OK) {
        rc = stats_json(path, s, layers);
        layers = NULL;
    } else if (!json && rc == EXIT_OK && !m) {
        printf("\n(K and V output ranks need the model: add --model PATH)\n");
    }
    if (!json && rc == EXIT_OK && si.has_fisher) stats_fisher_text(s);
    json_decref(layers);
    free(heads);
    kv_stats_free(s);
    kv_model_close(m);
    return rc;
}

/* ---------------------------------------------------------------- compressed directories */

/* The manifest of a compressed-model directory (DIR/kvcal.json), or path
 * itself when it names a kvcal.json file; NULL otherwise. malloc'd. */
static char *manifest_of(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) return NULL;
    if (!S_ISDIR(st.st_mode)) {
        const char *b = strrchr(path, '/');
        return !strcmp(b ? b + 1 : path, "kvcal.json") ? strdup(path) : NULL;
    }
    size_t n = strlen(path) + sizeof "/kvcal.json";
    char *p = malloc(n);
    if (!p) return NULL;
    snprintf(p, n, "%s/kvcal.json", path);
    if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) return p;
    free(p);
    return NULL;
}

/* Directory holding the manifest path (malloc'd). */
static char *dir_of_manifest(const char *mpath) {
    const char *slash = strrchr(mpath, '/');
    if (!slash) return strdup(".");
    size_t n = slash == mpath ? 1 : (size_t)(slash - mpath);
    char *d = malloc(n + 1);
    if (d) memcpy(d, mpath, n), d[n] = 0;
    return d;
}

struct lr_side_view {
    char ranks[512];      /* "12,12" or "-" */
    double energy, dropped;
    int64_t bytes;        /* per token */
};

static void side_view(const struct kv_lowrank *lr, int64_t l, int which, int bits,
                      struct lr_side_view *v) {
    memset(v, 0, sizeof *v);
    v->bytes = kv_lr_side_bytes(lr, l, which, bits);
    if (kv_lr_mode_of(lr, l, which) == KV_LR_FULL) {
        snprintf(v->ranks, sizeof v->ranks, "-");
        return;
    }
    size_t n = 0;
    for (int64_t u = 0; u < kv_lr_n_units(lr, l, which); u++) {
        struct kv_lr_unit_info x = kv_lr_unit_info(lr, l, which, u);
        cli_unit_rank(&x, u == 0, v->ranks, sizeof v->ranks, &n);
    }
    kv_lr_side_error(lr, l, which, &v->energy, &v->dropped);
}

static double rel_err(double dropped, double energy) { return energy > 0 ? dropped / energy : 0; }

static void pct_text(enum kv_lr_mode mode, double dropped, double energy, char *buf, size_t cap) {
    if (mode == KV_LR_FULL)
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%.2f%%", 100 * rel_err(dropped, energy));
}

static json_t *side_json(const struct kv_lowrank *lr, int64_t l, int which,
                         const struct lr_side_view *v) {
    json_t *ranks = json_array();
    int64_t total = 0;
    for (int64_t u = 0; u < kv_lr_n_units(lr, l, which); u++) {
        int64_t r = kv_lr_unit_info(lr, l, which, u).rank;
        json_array_append_new(ranks, json_integer(r));
        total += r;
    }
    json_t *o = json_pack("{s:s, s:o, s:I, s:o}", "mode", kv_lr_mode_name(kv_lr_mode_of(lr, l, which)),
                          "ranks", ranks, "rank", (json_int_t)total, "predicted_error",
                          cli_json_real(rel_err(v->dropped, v->energy)));
    json_t *bands = cli_side_bands_json(lr, l, which); /* mixed bits: [[n, bits], ...] per unit */
    if (o && bands) json_object_set_new(o, "bands", bands);
    else json_decref(bands);
    return o;
}

/* `kvcal inspect DIR`: the manifest of a compressed model; with a model,
 * the factors are read and checked against it too. */
static int inspect_lowrank(const char *path, const char *mpath, const char *model,
                           const char *tokenizer, int json) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_lowrank *lr = NULL;
    if (kv_lr_manifest_read(mpath, &lr, &err)) return cli_report(&err);
    int rc = EXIT_OK;
    if (model) {
        struct kv_model *m = NULL;
        struct kv_lowrank *full = NULL;
        char *dir = dir_of_manifest(mpath);
        if ((rc = cli_load_model(model, tokenizer, &m)) == EXIT_OK && dir &&
            kv_lr_dir_open(dir, m, &full, &err))
            rc = cli_report(&err);
        kv_lr_free(full);
        kv_model_close(m);
        free(dir);
        if (rc) {
            kv_lr_free(lr);
            return rc;
        }
    }
    /* informational parts the struct does not carry; the file parsed above */
    json_t *doc = json_load_file(mpath, 0, NULL);
    json_t *opts = doc ? json_object_get(doc, "options") : NULL;
    json_t *mo = doc ? json_object_get(doc, "model") : NULL;
    json_t *lat = doc ? json_object_get(doc, "latent") : NULL;
    const char *written = doc ? json_string_value(json_object_get(doc, "kvcal_version")) : NULL;

    struct kv_lr_info li = kv_lr_info(lr);
    struct kv_config cfg = {.n_layers = li.n_layers, .n_kv_heads = li.n_kv_heads,
                            .head_dim = li.head_dim};
    int64_t base = kv_lr_base_bytes(&cfg), comp = kv_lr_bytes(lr, li.kv_bits);
    int64_t layer_base = 2 * li.n_kv_heads * li.head_dim * 2;
    double en[2] = {0, 0}, dr[2] = {0, 0};
    struct lr_side_view *views = calloc((size_t)(2 * li.n_layers), sizeof *views);
    if (!views) {
        json_decref(doc);
        kv_lr_free(lr);
        return cli_report(&(struct kv_err){.code = KV_ENOMEM, .off = KV_NO_OFFSET, .msg = "out of memory"});
    }
    int width = 7;
    for (int64_t l = 0; l < li.n_layers; l++) {
        side_view(lr, l, 0, li.kv_bits, &views[2 * l]);
        side_view(lr, l, 1, li.kv_bits, &views[2 * l + 1]);
        for (int w = 0; w < 2; w++) {
            en[w] += views[2 * l + w].energy, dr[w] += views[2 * l + w].dropped;
            int n = (int)strlen(views[2 * l + w].ranks);
            if (n > width) width = n;
        }
    }

    if (json) {
        json_t *layers = json_array();
        for (int64_t l = 0; l < li.n_layers; l++) {
            const struct lr_side_view *vk = &views[2 * l], *vv = &views[2 * l + 1];
            json_array_append_new(
                layers, json_pack("{s:I, s:o, s:o, s:{s:I, s:I}}", "layer", (json_int_t)l, "k",
                                  side_json(lr, l, 0, vk), "v",
                                  side_json(lr, l, 1, vv), "kv_bytes_per_token", "base",
                                  (json_int_t)layer_base, "compressed",
                                  (json_int_t)(vk->bytes + vv->bytes)));
        }
        json_t *o = json_pack(
            "{s:o, s:s, s:i, s:s?, s:s, s:s, s:O?, s:O?, s:O?, s:{s:I, s:I, s:o}, s:{s:o, s:o}, s:o, s:o}",
            "path", cli_json_text(path), "type", "kvcal.manifest", "version", 1, "kvcal_version",
            written, "method", li.method, "alloc", li.alloc, "options", opts, "model", mo,
            "latent", lat, "kv_bytes_per_token", "base", (json_int_t)base, "compressed",
            (json_int_t)comp, "ratio", cli_json_real((double)comp / (double)base),
            "predicted_error", "k", cli_json_real(rel_err(dr[0], en[0])), "v",
            cli_json_real(rel_err(dr[1], en[1])), "checked_against",
            model ? cli_json_text(model) : json_null(), "layers", layers);
        rc = cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    } else {
        printf("compressed %s (kvcal.manifest version 1, written by kvcal %s)\n", path,
               written ? written : "?");
        printf("method     %s, allocation %s\n", li.method, li.alloc);
        char *os = opts ? json_dumps(opts, JSON_COMPACT | JSON_REAL_PRECISION(10)) : NULL;
        printf("options    %s\n", os ? os : "{}");
        free(os);
        const char *src = mo ? json_string_value(json_object_get(mo, "source")) : NULL;
        const char *fmt = mo ? json_string_value(json_object_get(mo, "format")) : NULL;
        printf("model      fingerprint %.16s…, %s%s%s\n", li.model_fingerprint, fmt ? fmt : "?",
               src ? " from " : "", src ? src : "");
        printf("           dim %lld, %lld layers, %lld heads (%lld kv), head_dim %lld\n",
               (long long)li.dim, (long long)li.n_layers, (long long)li.n_heads,
               (long long)li.n_kv_heads, (long long)li.head_dim);
        char mix[160];
        if (li.kv_bits == KV_LR_BITS_MIXED)
            printf("latent     mixed bits, each unit in bands (n@bits below; per band per-token "
                   "asymmetric with an f16 scale and zero point below 16 bits): %s",
                   cli_bits_mix(lr, mix, sizeof mix));
        else if (li.kv_bits >= 16)
            printf("latent     f16, no quantization");
        else
            printf("latent     int%d codes, per-token asymmetric per unit with an f16 scale and "
                   "zero point",
                   li.kv_bits);
        printf(", hadamard %s\n", li.hadamard ? "yes" : "no");
        printf("kv cache   %lld bytes/token compressed, %lld base (ratio %.4f, %.2fx smaller)\n",
               (long long)comp, (long long)base, (double)comp / (double)base,
               comp ? (double)base / (double)comp : 0.0);
        printf("predicted  relative K/V output error %.2f%% / %.2f%% (dropped / total energy of "
               "the units)\n",
               100 * rel_err(dr[0], en[0]), 100 * rel_err(dr[1], en[1]));
        if (model) printf("factors    read and checked against %s\n", model);
        printf("\n%-6s %-18s %-*s %7s  %-13s %-*s %7s  %s\n", "layer", "K mode", width, "K ranks",
               "K err", "V mode", width, "V ranks", "V err", "bytes/token base -> compressed");
        for (int64_t l = 0; l < li.n_layers; l++) {
            enum kv_lr_mode km = kv_lr_mode_of(lr, l, 0), vm = kv_lr_mode_of(lr, l, 1);
            const struct lr_side_view *vk = &views[2 * l], *vv = &views[2 * l + 1];
            char ek[24], ev[24];
            pct_text(km, vk->dropped, vk->energy, ek, sizeof ek);
            pct_text(vm, vv->dropped, vv->energy, ev, sizeof ev);
            printf("%-6lld %-18s %-*s %7s  %-13s %-*s %7s  %lld -> %lld\n", (long long)l,
                   kv_lr_mode_name(km), width, vk->ranks, ek, kv_lr_mode_name(vm),
                   width, vv->ranks, ev, (long long)layer_base, (long long)(vk->bytes + vv->bytes));
        }
        char tk[24], tv[24];
        snprintf(tk, sizeof tk, "%.2f%%", 100 * rel_err(dr[0], en[0]));
        snprintf(tv, sizeof tv, "%.2f%%", 100 * rel_err(dr[1], en[1]));
        printf("%-6s %-18s %-*s %7s  %-13s %-*s %7s  %lld -> %lld (ratio %.4f)\n", "total", "",
               width, "", tk, "", width, "", tv, (long long)base, (long long)comp,
               (double)comp / (double)base);
    }
    free(views);
    json_decref(doc);
    kv_lr_free(lr);
    return rc;
}

int cmd_inspect(int argc, char **argv) {
    const char *tokenizer = NULL, *model = NULL;
    int json = 0;
    const struct cli_opt opts[] = {
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE", "tokenizer to load alongside the model"},
        {"model", 'm', OPT_STR, &model, "PATH",
         "base model: K/V spectra of a .kvstats file, factor checks of a directory"},
        CLI_OPT_JSON(&json),
    };
    const struct cli_cmd cmd = {
        "inspect", "PATH [--json]  |  STATS.kvstats [--model PATH] [--json]",
        "Print the config, tokenizer and tensor table of a model: an HF Llama directory, a\n"
        "GGUF file or a llama2.c .bin. Loading runs every check the other commands run, so\n"
        "a file that inspects cleanly will load.\n"
        "\n"
        "Given a statistics file from 'kvcal collect', print its tokens, windows and inputs\n"
        "and, per layer, the trace and condition number of XᵀX and the effective rank (the\n"
        "fewest eigen-directions keeping 90% / 99% of the energy) of each KV head's\n"
        "post-RoPE key covariance and, with --model, of its K and V output covariances\n"
        "W C_x Wᵀ. Low ranks mean a head compresses well; look here before choosing --eps.\n"
        "\n"
        "Given a directory written by 'kvcal decompose' (it holds kvcal.json), print the\n"
        "method, options and latent format and, per layer, the K and V modes, the rank of\n"
        "each unit, the predicted relative output error and the KV cache bytes per token\n"
        "before and after, with the totals. With --model, every factor is also read and\n"
        "checked against that base model.",
        "examples:\n"
        "  kvcal inspect stories260K.gguf\n"
        "  kvcal inspect tinystories-656K --json\n"
        "  kvcal inspect 656K.kvstats --model tinystories-656K\n"
        "  kvcal inspect 656K-palu --json\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 1};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (n_pos != 1) return cli_usage_error(&cmd, "missing PATH");
    if (kv_stats_probe(pos[0])) return inspect_stats(pos[0], model, tokenizer, json);
    char *mpath = manifest_of(pos[0]);
    if (mpath) {
        rc = inspect_lowrank(pos[0], mpath, model, tokenizer, json);
        free(mpath);
        return rc;
    }
    if (model) return cli_usage_error(&cmd, "--model applies to a .kvstats file, and '%s' is not one", pos[0]);
    struct kv_model *m;
    if ((rc = cli_load_model(pos[0], tokenizer, &m))) return rc;
    const struct kv_config *c = kv_model_config(m);
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    int64_t nt = kv_model_n_tensors(m);
    if (json) {
        json_t *ts = json_array();
        for (int64_t i = 0; i < nt; i++) {
            const struct kv_tensor *t = kv_model_tensor(m, i);
            json_t *sh = json_array();
            for (int k = 0; k < t->ndim; k++) json_array_append_new(sh, json_integer(t->shape[k]));
            json_array_append_new(ts, json_pack("{s:o, s:s, s:o, s:I, s:I, s:i}", "name", cli_json_text(t->name),
                                                "dtype", kv_dtype_name(t->dtype), "shape", sh,
                                                "offset", (json_int_t)t->offset, "bytes",
                                                (json_int_t)t->nbytes, "file", t->file));
        }
        json_t *cfg = json_pack(
            "{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o, s:o, s:s, s:b, s:b, s:i, s:i}",
            "arch", kv_arch_name(c->arch), "dim", (json_int_t)c->dim, "hidden_dim", (json_int_t)c->hidden_dim,
            "n_layers", (json_int_t)c->n_layers, "n_heads", (json_int_t)c->n_heads, "n_kv_heads",
            (json_int_t)c->n_kv_heads, "head_dim", (json_int_t)c->head_dim, "vocab_size",
            (json_int_t)c->vocab_size, "max_seq_len", (json_int_t)c->max_seq_len, "norm_eps",
            cli_json_real(c->norm_eps), "rope_theta", cli_json_real(c->rope_theta), "rope_layout",
            c->rope_layout == KV_ROPE_INTERLEAVED ? "interleaved" : "rotate-half",
            "tied_embeddings", c->tied_embeddings, "qkv_bias", c->has_qkv_bias, "bos_id",
            c->bos_id, "eos_id", c->eos_id);
        if (cfg && c->arch == KV_ARCH_GPTNEOX) {
            json_object_set_new(cfg, "rotary_dim", json_integer(kv_rope_dim(c)));
            json_object_set_new(cfg, "parallel_residual", json_boolean(c->parallel_residual));
            json_object_set_new(cfg, "activation", json_string(c->gelu_erf ? "gelu" : "gelu_new"));
        }
        if (cfg && c->arch == KV_ARCH_GEMMA2) {
            json_object_set_new(cfg, "attn_scale", cli_json_real(kv_attn_scale(c)));
            json_object_set_new(cfg, "attn_softcap", c->attn_softcap > 0 ? cli_json_real(c->attn_softcap) : json_null());
            json_object_set_new(cfg, "final_softcap", c->final_softcap > 0 ? cli_json_real(c->final_softcap) : json_null());
            json_object_set_new(cfg, "norm_offset", cli_json_real(c->norm_offset));
        }
        if (cfg && kv_arch_has_rope(c->arch))
            json_object_set_new(cfg, "rope_scaling",
                                c->rope_scaling.type == KV_ROPE_SCALING_NONE
                                    ? json_null()
                                    : json_string(kv_rope_scaling_name(c->rope_scaling.type)));
        json_t *o = json_pack("{s:o, s:s, s:o, s:I, s:o}", "path", cli_json_text(pos[0]), "format",
                              kv_format_name(kv_model_format(m)), "config", cfg, "params",
                              (json_int_t)kv_model_n_params(m), "tensors", ts);
        if (o)
            json_object_set_new(o, "tokenizer_vocab",
                                tok ? json_integer(kv_tok_n_vocab(tok)) : json_null());
        rc = cli_print_json(o, JSON_INDENT(2));
    } else {
        char desc[512], np[32];
        cli_describe_config(c, desc, sizeof desc);
        cli_human_count((double)kv_model_n_params(m), np, sizeof np);
        printf("model      %s\nformat     %s\nconfig     %s\n", pos[0],
               kv_format_name(kv_model_format(m)), desc);
        printf("           norm eps %g, trained context %lld, bos %d, eos %d, qkv bias %s\n",
               (double)c->norm_eps, (long long)c->max_seq_len, c->bos_id, c->eos_id,
               c->has_qkv_bias ? "yes" : "no");
        printf("params     %s\n", np);
        printf("kv cache   %lld bytes/token at f16 (%lld layers x 2 x %lld kv heads x %lld)\n",
               (long long)(c->n_layers * 2 * c->n_kv_heads * c->head_dim * 2),
               (long long)c->n_layers, (long long)c->n_kv_heads, (long long)c->head_dim);
        if (tok)
            printf("tokenizer  %d pieces, bos %d, eos %d\n", kv_tok_n_vocab(tok), kv_tok_bos(tok),
                   kv_tok_eos(tok));
        else
            printf("tokenizer  none (pass --tokenizer FILE)\n");
        printf("\n%-52s %-5s %-16s %12s %12s\n", "tensor", "dtype", "shape", "offset", "bytes");
        for (int64_t i = 0; i < nt; i++) {
            const struct kv_tensor *t = kv_model_tensor(m, i);
            char sh[64];
            shape_str(t, sh, sizeof sh);
            printf("%-52s %-5s %-16s %12llu %12llu\n", t->name, kv_dtype_name(t->dtype), sh,
                   (unsigned long long)t->offset, (unsigned long long)t->nbytes);
        }
    }
    kv_model_close(m);
    return rc; /* 0 unless the JSON could not be encoded */
}
