/* kvcal collect: float64 calibration statistics into a .kvstats file. The
 * checks, the resume and the run are the library's (kv_collect_*); this
 * file reads the command line, handles Ctrl-C and prints. */
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"

static volatile sig_atomic_t interrupted = 0;
static void on_signal(int sig) {
    (void)sig;
    interrupted = 1;
}

static int progress(void *ctx, int64_t done, int64_t total, int64_t tokens_done) {
    cli_progress_cb(ctx, done, total, tokens_done);
    return interrupted != 0;
}

/* "I/N": two integers; whether they name a shard is the library's rule
 * (kv_calib_shard_valid). */
static int parse_shard(const char *s, int64_t *idx, int64_t *cnt) {
    char *end;
    long long a = strtoll(s, &end, 10);
    if (end == s || *end != '/') return -1;
    const char *b = end + 1;
    long long c = strtoll(b, &end, 10);
    if (end == b || *end) return -1;
    *idx = a, *cnt = c;
    return 0;
}

/* The options as the library's messages name them. */
static const char *const collect_names[KV_COLLECT_OPT_COUNT] = {
    [KV_COLLECT_OPT_SEQ_LEN] = "--seq-len",
    [KV_COLLECT_OPT_SAMPLES] = "--samples",
    [KV_COLLECT_OPT_SHARD] = "--shard",
    [KV_COLLECT_OPT_CHECKPOINT_EVERY] = "--checkpoint-every",
    [KV_COLLECT_OPT_TEXT] = "--text",
    [KV_COLLECT_OPT_OUTPUT] = "--output",
    [KV_COLLECT_OPT_RESUME] = "--resume",
};

/* What the command line gives (file scope: the option table points into it). */
static struct collect_args {
    const char *model, *tokenizer, *output, *shard;
    struct cli_list texts;
    int64_t seq_len, samples, seed, every, threads;
    int sequential, resume, json, quiet, fisher;
} A = {.seq_len = 256};

static const struct cli_opt collect_opts[] = {
    CLI_OPT_MODEL(&A.model),
    {"tokenizer", 0, OPT_STR, &A.tokenizer, "FILE",
     "override the model's tokenizer (tokenizer.bin, tokenizer.json or .gguf)"},
    {"text", 't', OPT_LIST, &A.texts, "FILE",
     "calibration text: .txt, .gz, .jsonl or .jsonl.gz; repeat for more files"},
    {"output", 'o', OPT_STR, &A.output, "FILE", "statistics file to write (.kvstats)"},
    CLI_OPT_PARSE_SPECIAL,
    {"seq-len", 0, OPT_INT, &A.seq_len, "N", "window length in tokens (default 256)"},
    {"samples", 'n', OPT_INT, &A.samples, "N", "windows to use (default: every window)"},
    {"seed", 0, OPT_INT, &A.seed, "S", "seed of the random window draw (default 0)"},
    {"sequential", 0, OPT_FLAG, &A.sequential, NULL,
     "take the first --samples windows instead of a random draw"},
    {"fisher", 0, OPT_FLAG, &A.fisher, NULL,
     "also Fisher statistics for --alloc fisher: a backward pass per window\n"
     "(about 3.5x the time)"},
    {"shard", 0, OPT_STR, &A.shard, "I/N",
     "keep every N-th planned window starting at I (0-based), for merging later"},
    {"checkpoint-every", 0, OPT_INT, &A.every, "K",
     "rewrite the output every K windows so an interrupted run can --resume"},
    {"resume", 0, OPT_FLAG, &A.resume, NULL,
     "continue from the checkpoint in --output (same options and inputs)"},
    CLI_OPT_THREADS(&A.threads),
    {"json", 0, OPT_FLAG, &A.json, NULL, "print one JSON summary on stdout"},
    CLI_OPT_QUIET(&A.quiet),
};

static const struct cli_cmd collect_cmd = {
    "collect", "--model PATH --text FILE [--text FILE ...] -o OUT.kvstats [options]",
    "Stream calibration text through the model and sum, in float64, the second-order\n"
    "statistics the decompositions need: per layer the attention input XᵀX and Σx,\n"
    "and the post-RoPE QᵀQ per query head and KᵀK per KV head. Memory does not grow\n"
    "with the number of windows.",
    "windows: each input file is one token stream with BOS at its start, cut into\n"
    "non-overlapping windows of --seq-len (remainder dropped); windows never span two\n"
    "files. Documents in a .jsonl file (one {\"text\": ...} per line) are joined with\n"
    "a blank line. With --samples N, N windows are drawn at random (--seed) from all\n"
    "inputs, or the first N are taken with --sequential, and run in file order.\n"
    "\n"
    "--fisher also runs a forward and backward pass per window (its first seq-len - 1\n"
    "tokens predicting the next ones) and sums, per layer, the squared gradient of\n"
    "the window's mean loss for every row of W_k and W_v, the Fisher information\n"
    "that 'kvcal decompose --alloc fisher' allocates ranks by and '--alloc global'\n"
    "weights errors by, and the Gram of the loss gradient with respect to each KV\n"
    "head's keys and values. The backward pass keeps the window's activations and\n"
    "makes a run about 3.5x as long. Shards merge only with shards collected alike.\n"
    "\n"
    "the output is a GGUF file (general.type kvcal.stats) of float64 sums plus the\n"
    "model fingerprint and each input's sha256. Sums merge exactly: collect shards\n"
    "(different files, or --shard I/N of the same plan) on several machines and\n"
    "combine them with 'kvcal merge'. With --checkpoint-every K the output is\n"
    "rewritten atomically every K windows; after a crash or Ctrl-C, run the same\n"
    "command with --resume and the result is bit-identical to an uninterrupted run\n"
    "with the same thread count.\n"
    "\n"
    "under mpirun (the MPI build, build/mpi/kvcal) rank I of N takes --shard I/N,\n"
    "writing OUT.rankIofN (checkpointed; --resume continues each rank's), and rank 0\n"
    "receives the others' in rank order and merges them into OUT: the bytes of\n"
    "--shard I/N on every I then 'kvcal merge'. --threads is per rank. A rank that\n"
    "fails says so in one line naming its rank, and no OUT is written. When a rank\n"
    "dies (killed, crashed), mpirun stops the others; each saves its checkpoint and\n"
    "the lowest rank still running names the dead one (on its host) in one line\n"
    "(mpirun -q keeps mpirun's own banner out); rerun with --resume.\n"
    "\nexamples:\n"
    "  kvcal collect -m stories260K.bin --tokenizer tok512.bin -t val1k.txt -o s.kvstats\n"
    "  kvcal collect -m tinystories-656K -t c4-part1.jsonl.gz -t c4-part2.jsonl.gz \\\n"
    "      --samples 512 --seed 1 --seq-len 256 --checkpoint-every 64 -o 656K.kvstats\n"
    "  kvcal collect ... --shard 0/2 -o a.kvstats   # and --shard 1/2 -o b.kvstats\n"
    "  mpirun -n 8 build/mpi/kvcal collect ... --threads 16 -o all.kvstats\n"
    "  kvcal collect -m tinystories-656K -t val1k.txt --samples 256 --fisher -o f.kvstats\n"
    "  kvcal inspect 656K.kvstats --model tinystories-656K\n",
    collect_opts, (int)(sizeof collect_opts / sizeof collect_opts[0]), 0};

/* Special-token strings the inputs held that were read as text. */
static int64_t C_specials;

static int print_json(const struct collect_args *a, const struct kv_stats *s,
                      const struct kv_collect_opts *o) {
    struct kv_stats_info si = kv_stats_info(s);
    json_t *ins = cli_json_stats_inputs(s);
    json_t *out = json_pack(
        "{s:o, s:o, s:s, s:I, s:I, s:I, s:s, s:I, s:I, s:o, s:I, s:I, s:o, s:o, s:i, s:o}",
        "output", cli_json_text(a->output), "model", cli_json_text(a->model), "fingerprint",
        si.fingerprint, "seq_len", (json_int_t)a->seq_len, "tokens", (json_int_t)si.tokens,
        "windows", (json_int_t)si.windows, "sampling", si.sampling, "seed", (json_int_t)si.seed,
        "plan_windows", (json_int_t)si.plan_windows, "inputs", ins, "resumed_from",
        (json_int_t)o->resumed_from, "checkpoints", (json_int_t)o->checkpoints_written,
        "tokens_per_s", cli_json_real(o->tokens_per_s), "seconds", cli_json_real(o->seconds),
        "threads", omp_get_max_threads(), "peak_rss_mib", cli_json_real(cli_peak_rss_mib()));
    if (out) {
        cli_json_blas(out);
        json_object_set_new(out, "fisher", json_boolean(si.has_fisher));
        json_object_set_new(out, "tokenization", json_string(si.tokenization));
        json_object_set_new(out, "special_strings", json_integer(C_specials));
        json_object_set_new(out, "mean_loss", si.has_fisher && o->run_windows > 0
                                                  ? cli_json_real(o->loss) : json_null());
    }
    return cli_print_json(out, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
}

static void print_text(const struct collect_args *a, const struct kv_model *m,
                       const struct kv_stats *s, const struct kv_collect_opts *o) {
    struct kv_stats_info si = kv_stats_info(s);
    char desc[512];
    cli_describe_config(kv_model_config(m), desc, sizeof desc);
    printf("model     %s\n          %s\n          fingerprint %s\n", a->model, desc, si.fingerprint);
    for (int64_t i = 0; i < si.n_inputs; i++) {
        const struct kv_stats_input *in = kv_stats_input(s, i);
        printf("input     %s: %llu bytes, sha256 %.16s…, %lld tokens, %lld windows used\n",
               in->path, (unsigned long long)in->bytes, in->sha256, (long long)in->tokens,
               (long long)in->windows);
    }
    printf("tokens    %s", si.tokenization);
    if (C_specials)
        printf("; %lld special-token string%s read as text (--parse-special reads them as "
               "control tokens)", (long long)C_specials, C_specials == 1 ? "" : "s");
    printf("\n");
    if (!strcmp(si.sampling, "random"))
        printf("plan      %lld windows of %lld, drawn at random (seed %llu)", (long long)si.plan_windows,
               (long long)a->seq_len, (unsigned long long)si.seed);
    else
        printf("plan      %lld windows of %lld, in order", (long long)si.plan_windows, (long long)a->seq_len);
    if (si.shard_count > 1)
        printf(", shard %lld/%lld", (long long)si.shard_index, (long long)si.shard_count);
    printf("\n");
    printf("summed    %lld tokens in %lld windows", (long long)si.tokens, (long long)si.windows);
    if (o->resumed_from >= 0) printf(" (resumed at window %lld)", (long long)o->resumed_from);
    printf("\n");
    if (si.has_fisher) {
        printf("fisher    a backward pass per window");
        if (o->run_windows > 0)
            printf(", mean loss %.4f (ppl %.2f) over %lld windows", o->loss, exp(o->loss),
                   (long long)o->run_windows);
        printf("\n");
    }
    char bn[160];
    if (o->run_windows > 0)
        printf("speed     %.0f tokens/s (%d threads, %.2f s), peak rss %.1f MiB\n"
               "blas      %s\n",
               o->tokens_per_s, omp_get_max_threads(), o->seconds, cli_peak_rss_mib(),
               cli_blas_note(bn, sizeof bn));
    if (o->run_windows > 0)
        printf("wrote     %s\n", a->output);
    else
        printf("kept      %s: it was already complete, nothing to do\n", a->output);
}

/* kv_collect_run with its progress on stderr, stopped by Ctrl-C or SIGTERM. */
static int run_windows(const struct kv_model *m, struct kv_calib *c, struct kv_stats *s,
                       struct kv_collect_opts *o, int quiet, struct kv_err *err) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND; /* a second Ctrl-C stops at once */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    struct cli_progress bar;
    cli_progress_start(&bar, "windows", quiet);
    o->progress = progress, o->progress_ctx = &bar;
    int rc = kv_collect_run(m, c, s, o, err);
    cli_progress_end(&bar);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    return rc;
}

/* Under mpirun, this rank stopped by a signal: mpirun stops every rank
 * when one dies. The lowest rank still running says so once, naming the
 * dead when they ran on its host; without one known dead (the user
 * stopped the job, or the dead ran elsewhere) rank 0 says it was
 * interrupted. Each rank has saved its checkpoint. */
static void say_stopped(const struct collect_args *a, const struct kv_err *err) {
    char dead[256];
    int speak = 0, n = cli_mpi_dead_ranks(dead, sizeof dead, &speak);
    if (n > 0 && speak)
        fprintf(stderr,
                "kvcal: rank%s %s of %d: ended before finishing (killed or crashed); %s was not "
                "written, and each other rank's checkpoint is kept for --resume\n",
                n > 1 ? "s" : "", dead, cli_mpi_size(), a->output);
    else if (n == 0 && cli_mpi_rank() == 0)
        cli_report(err);
}

/* Everything after the checks: the model, the inputs, the statistics to
 * continue or start, the run and its summary. */
static int collect(const struct collect_args *a, struct kv_collect_opts *o) {
    struct kv_model *m = NULL;
    struct kv_calib *c = NULL;
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int mpi = cli_mpi_size() > 1; /* rank 0 prints for all, after the merge */
    int rc, quiet = a->quiet || a->json || (mpi && cli_mpi_rank() > 0);
    if ((rc = cli_load_model(a->model, a->tokenizer, &m))) return rc;
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    if (!tok) {
        fprintf(stderr, "kvcal: the model has no tokenizer: pass --tokenizer FILE "
                        "(llama2.c tokenizer.bin, tokenizer.json or .gguf)\n");
        kv_model_close(m);
        return EXIT_ERR;
    }
    if (!quiet)
        fprintf(stderr, "reading and tokenizing %d input%s\n", a->texts.n,
                a->texts.n > 1 ? "s" : "");
    if (!(rc = kv_calib_open(a->texts.v, a->texts.n, tok, o->data, &c, &err))) {
        for (int64_t i = 0; i < kv_calib_n_inputs(c); i++) C_specials += kv_calib_input(c, i)->specials;
        if (C_specials && !quiet)
            fprintf(stderr, "kvcal: the text holds %lld special-token string%s (such as \"<s>\"); "
                            "they are read as text (--parse-special reads them as control tokens)\n",
                    (long long)C_specials, C_specials == 1 ? "" : "s");
        rc = kv_collect_start(m, a->resume, o, &s, &err);
    }
    if (!rc && a->resume && !o->resume && !quiet)
        fprintf(stderr, "kvcal: %s: no checkpoint yet; starting from the first window\n", a->output);
    if (!rc && o->resume && !quiet)
        fprintf(stderr, "resuming %s at window %lld of %lld\n", a->output,
                (long long)o->resumed_from, (long long)kv_stats_info(s).plan_windows);
    if (!rc) rc = run_windows(m, c, s, o, quiet, &err);
    if (rc && interrupted && mpi) {
        say_stopped(a, &err);
        rc = 128 + SIGINT;
    } else if (rc) {
        cli_report(&err);
        rc = interrupted ? 128 + SIGINT : EXIT_ERR; /* as a shell reports an interrupted command */
    } else if (mpi) {
        /* each rank's shard is written; the merge and the summary follow */
    } else if (a->json) {
        rc = print_json(a, s, o);
    } else {
        print_text(a, m, s, o);
    }
    kv_stats_free(s);
    kv_calib_free(c);
    kv_model_close(m);
    return rc;
}

/* Under mpirun (the MPI build): every rank has written its shard (rank I
 * of N is --shard I/N) to OUT.rankIofN; rank 0 receives the others' in rank
 * order and merges them into OUT (kv_stats_merge_files: the bytes of
 * collect --shard then merge), then the shards go. A failure anywhere
 * leaves no OUT; the failing rank has said why, and each rank's shard is
 * kept for --resume. */
static int mpi_merge(const struct collect_args *a, int rc) {
    int rank = cli_mpi_rank(), n = cli_mpi_size();
    if (cli_mpi_any_failed(rc)) return rc ? rc : EXIT_ERR;
    size_t cap = strlen(a->output) + 48;
    char **paths = calloc((size_t)n, sizeof *paths), msg[1024] = "";
    int fail = !paths;
    for (int r = 0; r < n && !fail; r++) {
        if (!(paths[r] = malloc(cap))) fail = 1;
        else snprintf(paths[r], cap, r ? "%s.rank%dof%d.recv" : "%s.rank%dof%d", a->output, r, n);
    }
    if (fail) snprintf(msg, sizeof msg, "out of memory");
    char own[4096];
    snprintf(own, sizeof own, "%s.rank%dof%d", a->output, rank, n);
    for (int r = 1; r < n && !cli_mpi_any_failed(fail); r++)
        fail = cli_mpi_file_to_root(r, own, paths ? paths[r] : "", msg, sizeof msg);
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stats *acc = NULL;
    if (rank == 0 && !fail && kv_stats_merge_files((const char *const *)paths, n, a->output, &acc, &err)) {
        kv_err_format(&err, msg, sizeof msg, 0);
        fail = 1;
    }
    if (fail) fprintf(stderr, "kvcal: rank %d of %d: %s\n", rank, n, msg);
    for (int r = 1; rank == 0 && paths && r < n; r++)
        if (paths[r]) unlink(paths[r]);
    int any = cli_mpi_any_failed(fail);
    if (!any) unlink(own); /* merged into OUT */
    if (!any && rank == 0) {
        struct kv_stats_info si = kv_stats_info(acc);
        if (a->json)
            any = cli_print_json(json_pack("{s:o, s:i, s:s, s:I, s:I, s:I, s:b}", "output",
                                           cli_json_text(a->output), "ranks", n, "fingerprint",
                                           si.fingerprint, "seq_len", (json_int_t)si.seq_len,
                                           "tokens", (json_int_t)si.tokens, "windows",
                                           (json_int_t)si.windows, "fisher", si.has_fisher),
                                 JSON_INDENT(2)) != EXIT_OK;
        else
            printf("merged    %d ranks (rank I took --shard I/%d): %lld tokens in %lld windows of "
                   "%lld%s\nwrote     %s\n",
                   n, n, (long long)si.tokens, (long long)si.windows, (long long)si.seq_len,
                   si.has_fisher ? ", with fisher statistics" : "", a->output);
    }
    kv_stats_free(acc);
    for (int r = 0; paths && r < n; r++) free(paths[r]);
    free(paths);
    return any ? EXIT_ERR : EXIT_OK;
}

int cmd_collect(int argc, char **argv) {
    const struct cli_cmd *cmd = &collect_cmd;
    struct collect_args *a = &A;
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!a->model) return cli_usage_error(cmd, "missing --model");
    if (a->texts.n == 0) return cli_usage_error(cmd, "missing --text");
    if (!a->output) return cli_usage_error(cmd, "missing --output");
    struct kv_calib_opts copt = {a->seq_len, a->samples, a->sequential, (uint64_t)a->seed, 0, 1,
                                 cli_parse_special};
    struct kv_collect_opts o = {.out_path = a->output, .data = &copt, .fisher = a->fisher,
                                .checkpoint_every = a->every, .upper_only = 1};
    struct kv_err err;
    kv_err_clear(&err);
    /* the library's rules and the command line's own, in the order the
     * command has always checked them. The command line's: the seed is read
     * signed; a negative thread count is a typing mistake (the library reads
     * it as every core); and --sequential alone is a flag that changes
     * nothing (the plan of every window is in order already) */
    if (kv_calib_check(&copt, collect_names, &err)) return cli_usage_error(cmd, "%s", err.msg);
    if (a->seed < 0)
        return cli_usage_error(cmd, "--seed must be 0 or more, got %lld", (long long)a->seed);
    if (kv_collect_check_options(&o, collect_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    if (a->threads < 0) return cli_usage_error(cmd, "--threads must be 0 (all cores) or more");
    if (a->sequential && a->samples == 0)
        return cli_usage_error(cmd, "--sequential needs --samples N (without it every window is "
                                    "used, in order)");
    if (a->shard && (parse_shard(a->shard, &copt.shard_index, &copt.shard_count) ||
                     !kv_calib_shard_valid(copt.shard_index, copt.shard_count)))
        return cli_usage_error(cmd, "--shard needs I/N with 0 <= I < N, got '%s'", a->shard);
    int n_ranks = cli_mpi_size();
    char rank_out[4096];
    if (n_ranks > 1) { /* rank I of N takes --shard I/N into OUT.rankIofN */
        if (a->shard)
            return cli_usage_error(cmd, "--shard splits the plan by hand; under mpirun each rank "
                                        "takes its own share already");
        copt.shard_index = cli_mpi_rank(), copt.shard_count = n_ranks;
        snprintf(rank_out, sizeof rank_out, "%s.rank%dof%d", a->output, cli_mpi_rank(), n_ranks);
        o.out_path = rank_out;
    }
    kv_set_threads((int)a->threads);
    if (n_ranks > 1) { /* OUT itself, before any rank starts: rank 0 writes it at the end */
        struct kv_collect_opts whole = o;
        whole.out_path = a->output;
        int bad = cli_mpi_rank() == 0 && kv_collect_check_output(&whole, 1, a->model, a->texts.v,
                                                                  a->texts.n, collect_names, &err);
        if (bad) cli_report_refusal(&err);
        if (cli_mpi_any_failed(bad)) return EXIT_ERR;
    }
    if (kv_collect_check_output(&o, a->resume, a->model, a->texts.v, a->texts.n, collect_names,
                                &err))
        return n_ranks > 1 ? mpi_merge(a, cli_report_refusal(&err)) : cli_report_refusal(&err);
    rc = collect(a, &o);
    /* stopped by mpirun (or the user): no merge, the ranks keep their checkpoints */
    if (n_ranks > 1 && interrupted) return rc;
    return n_ranks > 1 ? mpi_merge(a, rc) : rc;
}
