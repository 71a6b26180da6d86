#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

int cli_verbose = 0;
int cli_parse_special = 0;

int cli_tok_flags(const struct kv_tokenizer *tok) {
    return kv_tok_policy(tok) | (cli_parse_special ? KV_TOK_PARSE_SPECIAL : 0);
}

const char *cli_special_mode(void) { return cli_parse_special ? "parsed" : "text"; }

double cli_peak_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_maxrss / 1024.0; /* ru_maxrss is KiB on Linux */
}

char *openblas_get_corename(void); /* OpenBLAS's own, not in every cblas.h */

const char *cli_blas_kernels(const char **better) {
    const char *k = openblas_get_corename();
    k = k ? k : "unknown";
    *better = NULL;
    static const char *const avx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
    int has = 0;
    for (size_t i = 0; i < sizeof avx512 / sizeof avx512[0]; i++) has |= !strcmp(k, avx512[i]);
    __builtin_cpu_init();
    if (!has && __builtin_cpu_supports("avx512f"))
        *better = __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
    return k;
}

const char *cli_blas_note(char *buf, size_t cap) {
    const char *better, *k = cli_blas_kernels(&better);
    if (better)
        snprintf(buf, cap, "OpenBLAS %s kernels; OPENBLAS_CORETYPE=%s is faster here, docs/performance.md",
                 k, better);
    else
        snprintf(buf, cap, "OpenBLAS %s kernels", k);
    return buf;
}

void cli_json_blas(json_t *o) {
    const char *better, *k = cli_blas_kernels(&better);
    if (!o) return;
    json_object_set_new(o, "blas_kernels", json_string(k));
    json_object_set_new(o, "blas_faster", better ? json_string(better) : json_null());
}

static const int mix_widths[KV_LR_MAX_BANDS] = {16, 8, 4, 3, 2};

/* Latent coordinates per token at each of mix_widths over lr's bands. */
static void bits_mix(const struct kv_lowrank *lr, int64_t n[KV_LR_MAX_BANDS]) {
    struct kv_lr_info li = kv_lr_info(lr);
    for (int w = 0; w < KV_LR_MAX_BANDS; w++) n[w] = 0;
    for (int64_t l = 0; l < li.n_layers; l++)
        for (int side = 0; side < 2; side++) {
            if (kv_lr_mode_of(lr, l, side) == KV_LR_FULL) continue;
            for (int64_t u = 0; u < kv_lr_n_units(lr, l, side); u++) {
                struct kv_lr_unit_info ui = kv_lr_unit_info(lr, l, side, u);
                for (int b = 0; b < ui.n_bands; b++)
                    for (int w = 0; w < KV_LR_MAX_BANDS; w++)
                        if (ui.bands[b].bits == mix_widths[w]) n[w] += ui.bands[b].n;
            }
        }
}

const char *cli_bits_mix(const struct kv_lowrank *lr, char *buf, size_t cap) {
    int64_t n[KV_LR_MAX_BANDS];
    bits_mix(lr, n);
    size_t at = 0;
    buf[0] = 0;
    for (int w = 0; w < KV_LR_MAX_BANDS && at < cap; w++)
        if (n[w])
            at += (size_t)snprintf(buf + at, cap - at, "%s%d-bit %lld", at ? ", " : "", mix_widths[w],
                                   (long long)n[w]);
    if (at < cap) snprintf(buf + at, cap - at, " latent coordinates per token");
    return buf;
}

void cli_unit_rank(const struct kv_lr_unit_info *ui, int first, char *buf, size_t cap, size_t *at) {
    if (!ui->n_bands && *at < cap)
        *at += (size_t)snprintf(buf + *at, cap - *at, "%s%lld", first ? "" : ",", (long long)ui->rank);
    for (int b = 0; b < ui->n_bands && *at < cap; b++)
        *at += (size_t)snprintf(buf + *at, cap - *at, "%s%lld@%d", b ? "+" : first ? "" : ",",
                                (long long)ui->bands[b].n, ui->bands[b].bits);
}

json_t *cli_side_bands_json(const struct kv_lowrank *lr, int64_t l, int which) {
    if (kv_lr_info(lr).kv_bits != KV_LR_BITS_MIXED) return NULL;
    json_t *all = json_array();
    for (int64_t u = 0; all && u < kv_lr_n_units(lr, l, which); u++) {
        struct kv_lr_unit_info ui = kv_lr_unit_info(lr, l, which, u);
        json_t *ub = json_array();
        for (int b = 0; ub && b < ui.n_bands; b++)
            json_array_append_new(ub, json_pack("[I, i]", (json_int_t)ui.bands[b].n, ui.bands[b].bits));
        json_array_append_new(all, ub);
    }
    return all;
}

json_t *cli_bits_mix_json(const struct kv_lowrank *lr) {
    int64_t n[KV_LR_MAX_BANDS];
    bits_mix(lr, n);
    json_t *o = json_object();
    for (int w = 0; o && w < KV_LR_MAX_BANDS; w++) {
        char k[8];
        snprintf(k, sizeof k, "%d", mix_widths[w]);
        json_object_set_new(o, k, json_integer((json_int_t)n[w]));
    }
    return o;
}

static void print_help(const struct cli_cmd *cmd) {
    printf("usage: kvcal %s %s\n\n%s\n", cmd->name, cmd->usage, cmd->summary);
    if (cmd->n_opts) printf("\noptions:\n");
    for (int i = 0; i < cmd->n_opts; i++) {
        const struct cli_opt *o = &cmd->opts[i];
        char left[64];
        int n = 0;
        if (o->short_name)
            n = snprintf(left, sizeof left, "-%c, --%s", o->short_name, o->name);
        else
            n = snprintf(left, sizeof left, "    --%s", o->name);
        if (o->type != OPT_FLAG && (size_t)n < sizeof left)
            snprintf(left + n, sizeof left - (size_t)n, " %s", o->metavar ? o->metavar : "X");
        /* continuation lines of a multi-line help align under its first */
        printf("  %-26s ", left);
        for (const char *h = o->help; *h; h++) {
            putchar(*h);
            if (*h == '\n') printf("%29s", "");
        }
        putchar('\n');
    }
    printf("  %-26s %s\n", "-h, --help", "show this help and exit");
    if (cmd->details) printf("\n%s", cmd->details);
}

/* msg on stderr after prefix, each byte that starts no valid UTF-8
 * character shown as U+FFFD: a path or a file's string that is not text
 * never reaches the terminal raw. */
static void print_message(const char *prefix, const char *msg) {
    char *r = kv_utf8_repair(msg), rank[48] = "";
    /* under mpirun, whose ranks share one stderr: which rank says it */
    if (cli_mpi_size() > 1) snprintf(rank, sizeof rank, "rank %d of %d: ", cli_mpi_rank(), cli_mpi_size());
    fprintf(stderr, "%s%s%s\n", prefix, rank, r ? r : msg);
    free(r);
}

int cli_usage_error(const struct cli_cmd *cmd, const char *fmt, ...) {
    char msg[4096], prefix[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(prefix, sizeof prefix, "kvcal %s: ", cmd->name);
    if (cli_mpi_rank() > 0) return EXIT_USAGE; /* every rank has the same command line: rank 0 says it */
    char *r = kv_utf8_repair(msg);
    fprintf(stderr, "%s%s\n", prefix, r ? r : msg);
    free(r);
    fprintf(stderr, "usage: kvcal %s %s (see 'kvcal %s --help')\n", cmd->name, cmd->usage,
            cmd->name);
    return EXIT_USAGE;
}

static int set_value(const struct cli_cmd *cmd, const struct cli_opt *o, const char *v) {
    char *end;
    switch (o->type) {
    case OPT_STR: *(const char **)o->dst = v; return 0;
    case OPT_INT: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end)
            return cli_usage_error(cmd, "option '--%s' needs an integer, got '%s'", o->name, v);
        *(int64_t *)o->dst = x;
        return 0;
    }
    case OPT_DOUBLE: {
        errno = 0;
        double x = strtod(v, &end);
        if (errno || end == v || *end)
            return cli_usage_error(cmd, "option '--%s' needs a number, got '%s'", o->name, v);
        if (!isfinite(x)) /* no option takes nan or inf; some use nan for "not given" */
            return cli_usage_error(cmd, "option '--%s' needs a finite number, got '%s'", o->name, v);
        *(double *)o->dst = x;
        return 0;
    }
    case OPT_LIST: {
        struct cli_list *l = o->dst;
        if (l->n >= CLI_MAX_LIST)
            return cli_usage_error(cmd, "option '--%s' given more than %d times", o->name,
                                   CLI_MAX_LIST);
        l->v[l->n++] = v;
        return 0;
    }
    case OPT_FLAG: break;
    }
    return 0;
}

int cli_parse(const struct cli_cmd *cmd, int argc, char **argv, const char **pos, int *n_pos) {
    *n_pos = 0;
    int only_pos = 0;
    unsigned char given[CLI_MAX_OPTS] = {0}; /* a value option given twice is an error, not "the last wins" */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (only_pos || a[0] != '-' || a[1] == 0) {
            if (*n_pos >= cmd->max_positional)
                return cli_usage_error(cmd, "unexpected argument '%s'", a);
            pos[(*n_pos)++] = a;
            continue;
        }
        if (!strcmp(a, "--")) {
            only_pos = 1;
            continue;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            print_help(cmd);
            return EXIT_OK;
        }
        if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
            cli_verbose = 1;
            continue;
        }
        const struct cli_opt *o = NULL;
        const char *inline_val = NULL;
        if (a[1] == '-') {
            const char *nm = a + 2, *eq = strchr(nm, '=');
            size_t len = eq ? (size_t)(eq - nm) : strlen(nm);
            for (int k = 0; k < cmd->n_opts; k++)
                if (strlen(cmd->opts[k].name) == len && !strncmp(cmd->opts[k].name, nm, len))
                    o = &cmd->opts[k];
            if (eq) inline_val = eq + 1;
        } else if (a[2] == 0) {
            for (int k = 0; k < cmd->n_opts; k++)
                if (cmd->opts[k].short_name == a[1]) o = &cmd->opts[k];
        }
        if (!o) return cli_usage_error(cmd, "unknown option '%s'", a);
        if (o->type == OPT_FLAG) {
            if (inline_val) return cli_usage_error(cmd, "option '--%s' takes no value", o->name);
            *(int *)o->dst = 1;
            continue;
        }
        const char *v = inline_val;
        if (!v) {
            if (i + 1 >= argc) return cli_usage_error(cmd, "option '%s' needs a value", a);
            v = argv[++i];
        }
        int k = (int)(o - cmd->opts);
        if (o->type != OPT_LIST && k < CLI_MAX_OPTS && given[k]++)
            return cli_usage_error(cmd, "option '--%s' given twice", o->name);
        int rc = set_value(cmd, o, v);
        if (rc) return rc;
    }
    return -1;
}

int cli_report(const struct kv_err *err) {
    char buf[2400];
    kv_err_format(err, buf, sizeof buf, cli_verbose);
    print_message("kvcal: ", buf);
    return EXIT_ERR;
}

int cli_report_refusal(const struct kv_err *err) {
    char buf[2400];
    kv_err_format(err, buf, sizeof buf, 0);
    print_message("kvcal: ", buf);
    return EXIT_ERR;
}

void cli_progress_start(struct cli_progress *p, const char *what, int quiet) {
    p->what = what;
    p->t0 = kv_now();
    p->tty = isatty(2);
    p->quiet = quiet;
    p->last_decile = 0;
}

static void fmt_eta(double s, char *buf, size_t cap) {
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, cap, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else
        snprintf(buf, cap, "%ld:%02ld", t / 60, t % 60);
}

int cli_progress_cb(void *ctx, int64_t done, int64_t total, int64_t tokens_done) {
    struct cli_progress *p = ctx;
    if (p->quiet || total <= 0) return 0;
    double el = kv_now() - p->t0, rate = el > 0 ? (double)tokens_done / el : 0;
    double eta = done > 0 ? el * (double)(total - done) / (double)done : 0;
    char e[32], r[48] = "";
    fmt_eta(eta, e, sizeof e);
    if (tokens_done > 0) snprintf(r, sizeof r, "  %.0f tok/s", rate); /* none for layer counts */
    if (p->tty) {
        int w = 30, fill = (int)(w * done / total);
        char bar[64];
        for (int i = 0; i < w; i++) bar[i] = i < fill ? '#' : '.';
        bar[w] = 0;
        fprintf(stderr, "\r[%s] %lld/%lld %s%s  eta %s ", bar, (long long)done,
                (long long)total, p->what, r, e);
        fflush(stderr);
    } else {
        int dec = (int)(10 * done / total);
        if (dec > p->last_decile) {
            p->last_decile = dec;
            fprintf(stderr, "progress: %lld/%lld %s%s%s, eta %s\n", (long long)done,
                    (long long)total, p->what, r[0] ? "," : "", r + (r[0] ? 1 : 0), e);
        }
    }
    return 0;
}

void cli_progress_end(struct cli_progress *p) {
    if (!p->quiet && p->tty) fprintf(stderr, "\r%*s\r", 78, "");
}

int cli_load_model(const char *path, const char *tok_path, struct kv_model **m) {
    struct kv_err err;
    kv_err_clear(&err);
    if (kv_model_open(path, tok_path, m, &err)) return cli_report(&err);
    return 0;
}

int cli_load_tokens(const struct kv_model *m, const char *text_path, const char *tokens_path,
                    int32_t **ids, int64_t *n, size_t *n_bytes) {
    struct kv_err err;
    kv_err_clear(&err);
    *n_bytes = 0;
    if (tokens_path) {
        if (kv_tokens_read(tokens_path, ids, n, (int32_t)kv_model_config(m)->vocab_size, &err))
            return cli_report(&err);
        return 0;
    }
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    if (!tok) {
        fprintf(stderr, "kvcal: the model has no tokenizer: pass --tokenizer FILE "
                        "(llama2.c tokenizer.bin, tokenizer.json or .gguf) or --tokens FILE\n");
        return EXIT_ERR;
    }
    char *text;
    size_t len;
    if (kv_text_read(text_path, &text, &len, &err)) return cli_report(&err);
    int rc = kv_tok_encode(tok, text, len, cli_tok_flags(tok), ids, n, &err);
    free(text);
    if (rc) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", text_path);
        return cli_report(&err);
    }
    *n_bytes = len;
    return 0;
}

static int ids_window(void *ctx, int64_t w, int64_t seq_len, const int32_t **ids,
                      struct kv_err *err) {
    *ids = ((const struct cli_tokens *)ctx)->ids + w * seq_len;
    return KV_OK;
}

int cli_open_tokens(const struct kv_model *m, const char *text_path, const char *tokens_path,
                    struct cli_tokens *t) {
    struct kv_err err;
    kv_err_clear(&err);
    memset(t, 0, sizeof *t);
    t->src.ctx = t;
    if (tokens_path) {
        t->path = tokens_path;
        t->src.window = ids_window;
        if (kv_tokens_read(tokens_path, &t->ids, &t->src.n_tokens,
                           (int32_t)kv_model_config(m)->vocab_size, &err))
            return cli_report(&err);
        return 0;
    }
    t->path = text_path;
    t->src.window = kv_text_tokens_window;
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    if (!tok) {
        fprintf(stderr, "kvcal: the model has no tokenizer: pass --tokenizer FILE "
                        "(llama2.c tokenizer.bin, tokenizer.json or .gguf) or --tokens FILE\n");
        return EXIT_ERR;
    }
    /* a first pass counts the tokens; the second reads the windows */
    uint64_t bytes = 0;
    int rc = kv_text_tokens_open(text_path, tok, cli_tok_flags(tok), &t->tt, &err);
    if (!rc) rc = kv_text_tokens_finish(t->tt, &t->src.n_tokens, NULL, NULL, &bytes, &err);
    if (!rc) t->specials = kv_text_tokens_specials(t->tt);
    kv_text_tokens_close(t->tt);
    t->tt = NULL;
    if (!rc) rc = kv_text_tokens_open(text_path, tok, cli_tok_flags(tok), &t->tt, &err);
    t->src.ctx = t->tt;
    if (rc) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", text_path);
        return cli_report(&err);
    }
    t->n_bytes = (size_t)bytes;
    return 0;
}

void cli_close_tokens(struct cli_tokens *t) {
    free(t->ids);
    kv_text_tokens_close(t->tt);
    memset(t, 0, sizeof *t);
}

json_t *cli_json_text(const char *s) {
    char *r = kv_utf8_repair(s);
    json_t *j = r ? json_string(r) : NULL;
    free(r);
    return j;
}

json_t *cli_json_stats_inputs(const struct kv_stats *s) {
    json_t *a = json_array();
    for (int64_t i = 0, n = kv_stats_info(s).n_inputs; a && i < n; i++) {
        const struct kv_stats_input *in = kv_stats_input(s, i);
        json_array_append_new(a, json_pack("{s:o, s:s, s:I, s:I, s:I}", "path",
                                           cli_json_text(in->path), "sha256", in->sha256, "bytes",
                                           (json_int_t)in->bytes, "tokens", (json_int_t)in->tokens,
                                           "windows", (json_int_t)in->windows));
    }
    return a;
}

json_t *cli_json_real(double v) { return isfinite(v) ? json_real(v) : json_null(); }

int cli_print_json(json_t *o, size_t flags) {
    char *s = o ? json_dumps(o, flags) : NULL;
    json_decref(o);
    if (!s) {
        fprintf(stderr, "kvcal: cannot encode the JSON output\n");
        return EXIT_ERR;
    }
    printf("%s\n", s);
    free(s);
    return EXIT_OK;
}

void cli_human_count(double v, char *buf, size_t cap) {
    if (v >= 1e9)
        snprintf(buf, cap, "%.2fB", v / 1e9);
    else if (v >= 1e6)
        snprintf(buf, cap, "%.2fM", v / 1e6);
    else if (v >= 1e3)
        snprintf(buf, cap, "%.1fK", v / 1e3);
    else
        snprintf(buf, cap, "%.0f", v);
}

void cli_describe_config(const struct kv_config *c, char *buf, size_t cap) {
    char pos[128], sc[64] = "";
    const struct kv_rope_scaling_cfg *rs = &c->rope_scaling;
    if (rs->type == KV_ROPE_SCALING_FREQS)
        snprintf(sc, sizeof sc, " scaled by per-pair factors");
    else if (rs->type != KV_ROPE_SCALING_NONE && rs->original_ctx > 0)
        snprintf(sc, sizeof sc, " %s x%g from %lld", kv_rope_scaling_name(rs->type), rs->factor,
                 (long long)rs->original_ctx);
    else if (rs->type != KV_ROPE_SCALING_NONE)
        snprintf(sc, sizeof sc, " %s x%g", kv_rope_scaling_name(rs->type), rs->factor);
    if (!kv_arch_has_rope(c->arch))
        snprintf(pos, sizeof pos, "%lld learned positions", (long long)c->max_seq_len);
    else if (kv_rope_dim(c) != c->head_dim) /* partial: the first dimensions of each head */
        snprintf(pos, sizeof pos, "rope %s on %lld of %lld dims theta %g%s",
                 c->rope_layout == KV_ROPE_INTERLEAVED ? "interleaved" : "rotate-half",
                 (long long)kv_rope_dim(c), (long long)c->head_dim, (double)c->rope_theta, sc);
    else
        snprintf(pos, sizeof pos, "rope %s theta %g%s",
                 c->rope_layout == KV_ROPE_INTERLEAVED ? "interleaved" : "rotate-half",
                 (double)c->rope_theta, sc);
    char win[96] = "";
    if (c->sliding_window > 0 && c->window_from == 0 && c->window_period == 1)
        snprintf(win, sizeof win, ", sliding window %lld", (long long)c->sliding_window);
    else if (c->sliding_window > 0)
        snprintf(win, sizeof win, ", sliding window %lld from layer %d every %d",
                 (long long)c->sliding_window, c->window_from, c->window_period);
    snprintf(buf, cap,
             "%s, dim %lld, %lld layers, %lld heads (%lld kv), head_dim %lld, ffn %lld, "
             "vocab %lld, %s%s, %s head",
             kv_arch_name(c->arch), (long long)c->dim, (long long)c->n_layers,
             (long long)c->n_heads, (long long)c->n_kv_heads, (long long)c->head_dim,
             (long long)c->hidden_dim, (long long)c->vocab_size, pos, win,
             c->tied_embeddings ? "tied" : "untied");
}
