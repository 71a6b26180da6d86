/* kvcal collect: float64 calibration statistics into a .kvstats file. */
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
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

/* "I/N" with 0 <= I < N. */
static int parse_shard(const char *s, int64_t *idx, int64_t *cnt) {
    char *end;
    long long a = strtoll(s, &end, 10);
    if (end == s || *end != '/') return -1;
    const char *b = end + 1;
    long long c = strtoll(b, &end, 10);
    if (end == b || *end || c < 1 || a < 0 || a >= c) return -1;
    *idx = a, *cnt = c;
    return 0;
}

static int same_file(const struct stat *a, const char *path) {
    struct stat b;
    return stat(path, &b) == 0 && a->st_dev == b.st_dev && a->st_ino == b.st_ino;
}

/* Before any work: the output must not be an input or the model, its folder
 * must be writable, and an unfinished checkpoint is never overwritten by a
 * run that forgot --resume. */
static int check_output(const char *out, const char *model, const struct cli_list *texts,
                        int resume) {
    struct stat st;
    if (stat(out, &st) == 0) {
        if (S_ISDIR(st.st_mode)) {
            fprintf(stderr, "kvcal: %s: is a directory; --output names the statistics file\n", out);
            return EXIT_ERR;
        }
        int clash = same_file(&st, model);
        for (int i = 0; i < texts->n && !clash; i++) clash = same_file(&st, texts->v[i]);
        if (clash) {
            fprintf(stderr, "kvcal: %s: is also the model or a --text input; refusing to overwrite it\n", out);
            return EXIT_ERR;
        }
        if (!resume && kv_stats_probe(out)) {
            struct kv_stats *s;
            struct kv_err err;
            kv_err_clear(&err);
            if (kv_stats_open(out, &s, &err) == KV_OK) {
                struct kv_stats_info si = kv_stats_info(s);
                int unfinished = si.next_window < si.plan_windows;
                int64_t done = si.next_window, plan = si.plan_windows;
                kv_stats_free(s);
                if (unfinished) {
                    fprintf(stderr, "kvcal: %s: holds an unfinished checkpoint (%lld of %lld windows); "
                                    "add --resume to continue it, or remove the file to start over\n",
                            out, (long long)done, (long long)plan);
                    return EXIT_ERR;
                }
            }
        }
    }
    /* the folder must take OUT.tmp now, not after hours of windows */
    size_t n = strlen(out);
    char *tmp = malloc(n + 16);
    if (!tmp) return EXIT_ERR;
    snprintf(tmp, n + 16, "%s.probe", out);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) {
        char eb[256];
        snprintf(eb, sizeof eb, "%s", strerror(errno));
        for (char *p = eb; *p; p++) *p = (char)tolower((unsigned char)*p);
        fprintf(stderr, "kvcal: %s: cannot write there: %s\n", out, eb);
        free(tmp);
        return EXIT_ERR;
    }
    if (fd >= 0) {
        close(fd);
        unlink(tmp);
    }
    free(tmp);
    return 0;
}

int cmd_collect(int argc, char **argv) {
    const char *model = NULL, *tokenizer = NULL, *output = NULL, *shard = NULL;
    static struct cli_list texts;
    int64_t seq_len = 256, samples = 0, seed = 0, every = 0, threads = 0;
    int sequential = 0, resume = 0, json = 0, quiet = 0, fisher = 0;
    const struct cli_opt opts[] = {
        {"model", 'm', OPT_STR, &model, "PATH", "model: HF directory, .gguf or llama2.c .bin"},
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE",
         "override the model's tokenizer (tokenizer.bin, tokenizer.json or .gguf)"},
        {"text", 't', OPT_LIST, &texts, "FILE",
         "calibration text: .txt, .gz, .jsonl or .jsonl.gz; repeat for more files"},
        {"output", 'o', OPT_STR, &output, "FILE", "statistics file to write (.kvstats)"},
        {"seq-len", 0, OPT_INT, &seq_len, "N", "window length in tokens (default 256)"},
        {"samples", 'n', OPT_INT, &samples, "N", "windows to use (default: every window)"},
        {"seed", 0, OPT_INT, &seed, "S", "seed of the random window draw (default 0)"},
        {"sequential", 0, OPT_FLAG, &sequential, NULL,
         "take the first --samples windows instead of a random draw"},
        {"fisher", 0, OPT_FLAG, &fisher, NULL,
         "also Fisher statistics for --alloc fisher: a backward pass per window\n"
         "(about 3.5x the time)"},
        {"shard", 0, OPT_STR, &shard, "I/N",
         "keep every N-th planned window starting at I (0-based), for merging later"},
        {"checkpoint-every", 0, OPT_INT, &every, "K",
         "rewrite the output every K windows so an interrupted run can --resume"},
        {"resume", 0, OPT_FLAG, &resume, NULL,
         "continue from the checkpoint in --output (same options and inputs)"},
        {"threads", 0, OPT_INT, &threads, "N", "threads for BLAS and OpenMP (default: all cores)"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON summary on stdout"},
        {"quiet", 'q', OPT_FLAG, &quiet, NULL, "no progress on stderr"},
    };
    const struct cli_cmd cmd = {
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
        "\nexamples:\n"
        "  kvcal collect -m stories260K.bin --tokenizer tok512.bin -t val1k.txt -o s.kvstats\n"
        "  kvcal collect -m tinystories-656K -t c4-part1.jsonl.gz -t c4-part2.jsonl.gz \\\n"
        "      --samples 512 --seed 1 --seq-len 256 --checkpoint-every 64 -o 656K.kvstats\n"
        "  kvcal collect ... --shard 0/2 -o a.kvstats   # and --shard 1/2 -o b.kvstats\n"
        "  kvcal collect -m tinystories-656K -t val1k.txt --samples 256 --fisher -o f.kvstats\n"
        "  kvcal inspect 656K.kvstats --model tinystories-656K\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!model) return cli_usage_error(&cmd, "missing --model");
    if (texts.n == 0) return cli_usage_error(&cmd, "missing --text");
    if (!output) return cli_usage_error(&cmd, "missing --output");
    if (seq_len < 2) return cli_usage_error(&cmd, "--seq-len must be at least 2, got %lld", (long long)seq_len);
    if (samples < 0) return cli_usage_error(&cmd, "--samples must be 0 (every window) or more, got %lld", (long long)samples);
    if (seed < 0) return cli_usage_error(&cmd, "--seed must be 0 or more, got %lld", (long long)seed);
    if (every < 0) return cli_usage_error(&cmd, "--checkpoint-every must be 0 (never) or more, got %lld", (long long)every);
    if (threads < 0) return cli_usage_error(&cmd, "--threads must be positive");
    if (sequential && samples == 0)
        return cli_usage_error(&cmd, "--sequential needs --samples N (without it every window is used, in order)");
    struct kv_calib_opts copt = {seq_len, samples, sequential, (uint64_t)seed, 0, 1};
    if (shard && parse_shard(shard, &copt.shard_index, &copt.shard_count))
        return cli_usage_error(&cmd, "--shard needs I/N with 0 <= I < N, got '%s'", shard);
    kv_set_threads((int)threads);
    if ((rc = check_output(output, model, &texts, resume))) return rc;

    struct kv_model *m = NULL;
    struct kv_calib *c = NULL;
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    if ((rc = cli_load_model(model, tokenizer, &m))) return rc;
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    if (!tok) {
        fprintf(stderr, "kvcal: the model has no tokenizer: pass --tokenizer FILE "
                        "(llama2.c tokenizer.bin, tokenizer.json or .gguf)\n");
        kv_model_close(m);
        return EXIT_ERR;
    }
    if (!quiet && !json) fprintf(stderr, "reading and tokenizing %d input%s\n", texts.n, texts.n > 1 ? "s" : "");
    if (kv_calib_open(texts.v, texts.n, tok, &copt, &c, &err)) goto fail;

    int64_t resumed_from = -1;
    struct stat st;
    if (resume && stat(output, &st) == 0) {
        if (kv_stats_open(output, &s, &err)) goto fail;
        resumed_from = kv_stats_info(s).next_window;
    } else {
        if (resume && !quiet && !json)
            fprintf(stderr, "kvcal: %s: no checkpoint yet; starting from the first window\n", output);
        if (kv_stats_init(kv_model_config(m), &s, &err)) goto fail;
    }
    if (resumed_from >= 0 && !quiet && !json)
        fprintf(stderr, "resuming %s at window %lld of %lld\n", output, (long long)resumed_from,
                (long long)kv_stats_info(s).plan_windows);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND; /* a second Ctrl-C stops at once */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    struct cli_progress bar;
    cli_progress_start(&bar, "windows", quiet || json);
    struct kv_collect_opts o = {.out_path = output, .data = &copt, .resume = resumed_from >= 0,
                                .fisher = fisher, .checkpoint_every = every, .progress = progress,
                                .progress_ctx = &bar};
    rc = kv_collect_run(m, c, s, &o, &err);
    cli_progress_end(&bar);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    if (rc && interrupted) {
        cli_report(&err);
        kv_stats_free(s);
        kv_calib_free(c);
        kv_model_close(m);
        return 128 + SIGINT; /* as a shell reports an interrupted command */
    }
    if (rc) goto fail;

    struct kv_stats_info si = kv_stats_info(s);
    int64_t run_windows = si.next_window - (resumed_from >= 0 ? resumed_from : 0);
    double tps = o.seconds > 0 ? (double)(run_windows * seq_len) / o.seconds : 0;
    int nthreads = omp_get_max_threads();
    if (json) {
        json_t *ins = cli_json_stats_inputs(s);
        json_t *out = json_pack(
            "{s:o, s:o, s:s, s:I, s:I, s:I, s:s, s:I, s:I, s:o, s:I, s:I, s:o, s:o, s:i, s:o}",
            "output", cli_json_text(output), "model", cli_json_text(model), "fingerprint",
            si.fingerprint, "seq_len", (json_int_t)seq_len, "tokens", (json_int_t)si.tokens,
            "windows", (json_int_t)si.windows, "sampling", si.sampling, "seed",
            (json_int_t)si.seed, "plan_windows", (json_int_t)si.plan_windows, "inputs", ins,
            "resumed_from", (json_int_t)resumed_from, "checkpoints",
            (json_int_t)o.checkpoints_written, "tokens_per_s", cli_json_real(tps), "seconds",
            cli_json_real(o.seconds), "threads", nthreads, "peak_rss_mib",
            cli_json_real(cli_peak_rss_mib()));
        if (out) {
            json_object_set_new(out, "fisher", json_boolean(si.has_fisher));
            json_object_set_new(out, "mean_loss", si.has_fisher && run_windows > 0
                                                      ? cli_json_real(o.loss) : json_null());
        }
        rc = cli_print_json(out, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    } else {
        char desc[512];
        cli_describe_config(kv_model_config(m), desc, sizeof desc);
        printf("model     %s\n          %s\n          fingerprint %s\n", model, desc, si.fingerprint);
        for (int64_t i = 0; i < si.n_inputs; i++) {
            const struct kv_stats_input *in = kv_stats_input(s, i);
            printf("input     %s: %llu bytes, sha256 %.16s…, %lld tokens, %lld windows used\n",
                   in->path, (unsigned long long)in->bytes, in->sha256, (long long)in->tokens,
                   (long long)in->windows);
        }
        if (!strcmp(si.sampling, "random"))
            printf("plan      %lld windows of %lld, drawn at random (seed %llu)", (long long)si.plan_windows,
                   (long long)seq_len, (unsigned long long)si.seed);
        else
            printf("plan      %lld windows of %lld, in order", (long long)si.plan_windows, (long long)seq_len);
        if (si.shard_count > 1)
            printf(", shard %lld/%lld", (long long)si.shard_index, (long long)si.shard_count);
        printf("\n");
        printf("summed    %lld tokens in %lld windows", (long long)si.tokens, (long long)si.windows);
        if (resumed_from >= 0) printf(" (resumed at window %lld)", (long long)resumed_from);
        printf("\n");
        if (si.has_fisher) {
            printf("fisher    a backward pass per window");
            if (run_windows > 0)
                printf(", mean loss %.4f (ppl %.2f) over %lld windows", o.loss, exp(o.loss),
                       (long long)run_windows);
            printf("\n");
        }
        if (run_windows > 0)
            printf("speed     %.0f tokens/s (%d threads, %.2f s), peak rss %.1f MiB\n", tps, nthreads,
                   o.seconds, cli_peak_rss_mib());
        if (run_windows > 0)
            printf("wrote     %s\n", output);
        else
            printf("kept      %s: it was already complete, nothing to do\n", output);
    }
    kv_stats_free(s);
    kv_calib_free(c);
    kv_model_close(m);
    return rc;
fail:
    rc = cli_report(&err);
    kv_stats_free(s);
    kv_calib_free(c);
    kv_model_close(m);
    return rc;
}
