/* kvcal report: one self-contained HTML page (and each figure as an SVG
 * file) of what a calibration and a compression did. The numbers are the
 * library's (kv_report_spectra, kv_report_measure in calib/) and so is the
 * page (kv_report_* in formats/): this file parses, loads, calls and
 * prints. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

static struct {
    const char *model, *tokenizer, *stats, *comp, *eval, *out, *title;
    struct cli_list results, verify;
    int64_t threads;
    int quiet;
} A;

static const struct cli_opt opts[] = {
    {"model", 'm', OPT_STR, &A.model, "PATH",
     "the base model (needed by --stats, and to read --compressed's factors)"},
    {"tokenizer", 0, OPT_STR, &A.tokenizer, "FILE", "tokenizer to load alongside the model"},
    {"stats", 's', OPT_STR, &A.stats, "FILE",
     "calibration statistics (kvcal collect): the spectra figures"},
    {"compressed", 'c', OPT_STR, &A.comp, "DIR",
     "a directory written by kvcal decompose: the ranks and bytes figures"},
    {"eval-stats", 0, OPT_STR, &A.eval, "FILE",
     "statistics of held-out text (kvcal collect on other text): the error\n"
     "figure, each unit's error measured on them (needs --model and --compressed)"},
    {"results", 0, OPT_LIST, &A.results, "FILE",
     "JSON lines of make results or make results-kjv (repeatable): the quality figure"},
    {"verify", 0, OPT_LIST, &A.verify, "FILE",
     "the output of kvcal verify --json (repeatable): points on the quality figure"},
    {"output", 'o', OPT_STR, &A.out, "FILE.html",
     "the page to write; each figure goes beside it as FILE-NAME.svg"},
    {"title", 0, OPT_STR, &A.title, "TEXT", "the page's heading (default \"kvcal report\")"},
    CLI_OPT_THREADS(&A.threads),
    CLI_OPT_QUIET(&A.quiet),
};

static const struct cli_cmd cmd = {
    "report", "-o FILE.html [-m MODEL] [-s STATS] [-c DIR] [--eval-stats STATS] [--results FILE] [--verify FILE]",
    "Write one self-contained HTML page (inline SVG; no script, nothing fetched) that\n"
    "shows what a calibration and a compression did, and each figure again as its own\n"
    "SVG file beside the page: for -o out/report.html, out/report-spectra.svg,\n"
    "out/report-energy.svg, ... (FILE less a final .html, a dash, the figure's name).\n"
    "Each part appears when its inputs are given; at least one of --stats,\n"
    "--compressed, --results and --verify is needed. The same inputs give the same\n"
    "bytes, so a report can be committed and diffed.\n"
    "\n"
    "figures:\n"
    "  spectra   (-m, -s) per layer, K and V: the eigenvalues of each unit's output\n"
    "            covariance Σ yᵀy, over the largest, on a log axis; a steep curve\n"
    "            compresses well\n"
    "  energy    (-m, -s) the fraction of the calibration variance the first r\n"
    "            directions explain (what decompose --eps thresholds), with the rank\n"
    "            each unit of --compressed has marked, and its --eps dashed\n"
    "  ranks     (-c) a heat map of each unit's rank over its width, layers by KV heads\n"
    "  bytes     (-c) KV cache bytes per token per layer, base against K + V\n"
    "  error     (-m, -c, --eval-stats) each unit's predicted error (the manifest's\n"
    "            dropped / energy, on the calibration text) against its error measured\n"
    "            exactly on the held-out statistics, Σ‖y − ŷ‖² / Σ‖y‖² from their XᵀX,\n"
    "            Σx and token count; log-log, with y = x. Above the line, a unit loses\n"
    "            more on new text than calibration promised. Post-RoPE rotation units\n"
    "            have no down/up factors and are listed as not measured.\n"
    "  quality   (--results, --verify) perplexity against KV bytes kept for each row\n"
    "            and verify run, one panel per model and text, the Pareto front drawn\n"
    "A last section says how it was made: the model and its config, the statistics\n"
    "(tokens, windows, seed), the manifest's options and the results' protocol.",
    "examples:\n"
    "  kvcal collect -m data/kjv-llama -t data/kjv/train.txt --samples 64 -o cal.kvstats\n"
    "  kvcal collect -m data/kjv-llama -t data/kjv/gospels.txt --samples 64 -o eval.kvstats\n"
    "  kvcal decompose -m data/kjv-llama -s cal.kvstats --eps 0.9 -o kjv-eps0.9\n"
    "  kvcal verify -m data/kjv-llama --compressed kjv-eps0.9 -t data/kjv/gospels.txt \\\n"
    "      --max-windows 50 --json > verify.json\n"
    "  kvcal report -m data/kjv-llama -s cal.kvstats -c kjv-eps0.9 \\\n"
    "      --eval-stats eval.kvstats --verify verify.json -o report.html\n"
    "  kvcal report --results build/results-kjv/kjv-llama.jsonl -o results.html\n",
    opts, (int)(sizeof opts / sizeof opts[0]), 0};

/* The inputs, loaded and checked against each other; released by done(). */
struct inputs {
    struct kv_model *m;
    struct kv_stats *s, *eval;
    struct kv_lowrank *lr;
    struct kv_report *rep;
};

static void done(struct inputs *in) {
    kv_model_close(in->m);
    kv_stats_free(in->s);
    kv_stats_free(in->eval);
    kv_lr_free(in->lr);
    kv_report_free(in->rep);
}

/* A statistics file that matches the model, or cli_report's exit code. */
static int open_stats(const char *path, const struct kv_model *m, struct kv_stats **s) {
    struct kv_err err;
    kv_err_clear(&err);
    if (kv_stats_open(path, s, &err) || kv_stats_check_complete(*s, path, &err) ||
        !kv_stats_matches_model(*s, m, path, &err))
        return cli_report(&err);
    return EXIT_OK;
}

/* The compressed directory: with the model, every factor read and checked
 * against it; without, the manifest alone. */
static int open_compressed(const char *dir, const struct kv_model *m, struct kv_lowrank **lr) {
    struct kv_err err;
    kv_err_clear(&err);
    if (m) return kv_lr_dir_open(dir, m, lr, &err) ? cli_report(&err) : EXIT_OK;
    size_t n = strlen(dir) + sizeof "/kvcal.json";
    char *mp = malloc(n);
    if (!mp) return cli_report(&(struct kv_err){.code = KV_ENOMEM, .off = KV_NO_OFFSET, .msg = "out of memory"});
    snprintf(mp, n, "%s/kvcal.json", dir);
    int rc = kv_lr_manifest_read(mp, lr, &err);
    free(mp);
    return rc ? cli_report(&err) : EXIT_OK;
}

int cmd_report(int argc, char **argv) {
    memset(&A, 0, sizeof A);
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!A.out) return cli_usage_error(&cmd, "missing --output");
    if (!A.stats && !A.comp && !A.results.n && !A.verify.n)
        return cli_usage_error(&cmd, "nothing to report: give --stats, --compressed, --results or --verify");
    if (A.stats && !A.model) return cli_usage_error(&cmd, "--stats needs --model (the spectra are of its K and V outputs)");
    if (A.eval && (!A.model || !A.comp))
        return cli_usage_error(&cmd, "--eval-stats needs --model and --compressed (it measures the factors)");
    if (A.tokenizer && !A.model) return cli_usage_error(&cmd, "--tokenizer needs --model");
    if (A.threads < 0) return cli_usage_error(&cmd, "--threads must be 0 (all cores) or more");
    kv_set_threads((int)A.threads);

    struct kv_err err;
    kv_err_clear(&err);
    if (kv_report_check_output(A.out, &err)) return cli_report_refusal(&err);
    struct inputs in = {0};
    if (kv_report_init(&in.rep, &err)) return cli_report(&err);
    rc = EXIT_OK;
    if (A.title && kv_report_set_title(in.rep, A.title, &err)) rc = cli_report(&err);
    if (!rc && A.model && !(rc = cli_load_model(A.model, A.tokenizer, &in.m)) &&
        kv_report_set_model(in.rep, A.model, in.m, &err))
        rc = cli_report(&err);
    if (!rc && A.stats && !(rc = open_stats(A.stats, in.m, &in.s)) &&
        kv_report_add_stats(in.rep, "calibration", A.stats, in.s, &err))
        rc = cli_report(&err);
    if (!rc && A.eval && !(rc = open_stats(A.eval, in.m, &in.eval)) &&
        kv_report_add_stats(in.rep, "evaluation", A.eval, in.eval, &err))
        rc = cli_report(&err);
    if (!rc && A.comp && !(rc = open_compressed(A.comp, in.m, &in.lr)) &&
        kv_report_set_compressed(in.rep, A.comp, in.lr, &err))
        rc = cli_report(&err);
    for (int i = 0; !rc && i < A.results.n; i++)
        if (kv_report_add_results(in.rep, A.results.v[i], &err)) rc = cli_report(&err);
    for (int i = 0; !rc && i < A.verify.n; i++)
        if (kv_report_add_verify(in.rep, A.verify.v[i], &err)) rc = cli_report(&err);
    if (!rc && in.s && kv_report_spectra(in.rep, in.s, in.m, &err)) rc = cli_report(&err);
    if (!rc && in.eval && kv_report_measure(in.rep, A.eval, in.eval, in.m, in.lr, &err))
        rc = cli_report(&err);
    int n_svg = 0;
    const char *names[16];
    if (!rc && kv_report_figures(in.rep, names, 16) == 0) { /* say so rather than write a bare page */
        fprintf(stderr, "kvcal: nothing to draw: the inputs hold no results rows, verify runs or "
                        "statistics; %s was not written\n", A.out);
        rc = EXIT_ERR;
    }
    if (!rc && kv_report_write(in.rep, A.out, &n_svg, &err)) rc = cli_report(&err);
    if (!rc && !A.quiet) {
        char *first = kv_report_svg_path(A.out, "NAME");
        printf("wrote     %s and %d figure%s (%s)\n", A.out, n_svg, n_svg == 1 ? "" : "s",
               first ? first : "?");
        free(first);
    }
    done(&in);
    return rc;
}
