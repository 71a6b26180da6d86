/* make bench: `kvcal collect` throughput against verify's forward pass on the
 * same model and windows, and its memory against the number of windows.
 *
 *   1. synthetic random Llama (d=2048, 16 heads, 4 kv heads, 4 layers, ffn
 *      5632, vocab 32000), 6 windows of 512 random tokens: kv_ppl_run vs the
 *      accumulator (kv_accum_window), best of 3 each, interleaved;
 *   2. tinystories-656K on WikiText-2, the first 256 windows of 256:
 *      kv_ppl_run vs kv_collect_run on the same windows, best of 3;
 *   3. peak RSS of `kvcal collect` (a child process) with --samples 16 and
 *      --samples 256 on the 656K model and WikiText-2.
 *
 * Targets (exit 1 if missed): collect >= 85% of verify's tokens/s in 1 and
 * 2; the two peak RSS values differ by under 5%. Threads: $BENCH_THREADS,
 * default 2. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "kvcal.h"
#include "kvstats.h"

/* tokens/s of the accumulator over windows of ids [n_win, seq]. */
static int accum_rate(const struct kv_model *m, const int32_t *ids, int64_t n_win, int64_t seq,
                      double *tps, struct kv_err *err) {
    struct kv_stats *s;
    struct kv_accum *a;
    int rc = kv_stats_init(kv_model_config(m), &s, err);
    if (rc) return rc;
    if ((rc = kv_accum_init(m, s, seq, &a, err))) {
        kv_stats_free(s);
        return rc;
    }
    double t0 = kv_now();
    for (int64_t w = 0; w < n_win && !rc; w++) rc = kv_accum_window(a, ids + w * seq, err);
    *tps = (double)(n_win * seq) / (kv_now() - t0);
    kv_accum_free(a);
    kv_stats_free(s);
    return rc;
}

/* Peak RSS in MiB of a child running cmd (through /bin/sh), or -1. */
static double child_rss_mib(const char *cmd) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int st;
    struct rusage ru;
    if (wait4(pid, &st, 0, &ru) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return -1;
    return (double)ru.ru_maxrss / 1024.0;
}

static void report(const char *what, double verify, double collect, int *failed) {
    double r = collect / verify;
    printf("  verify forward %.0f tokens/s, collect %.0f tokens/s = %.0f%% (target >= 85%%) %s\n",
           verify, collect, 100 * r, r >= 0.85 ? "ok" : "MISSED");
    (void)what;
    *failed |= r < 0.85;
}

int main(void) {
    int threads = getenv("BENCH_THREADS") ? atoi(getenv("BENCH_THREADS")) : 2;
    kv_set_threads(threads);
    int failed = 0;
    struct kv_err err;
    kv_err_clear(&err);
    printf("threads: %d\n\n", threads);

    /* 1. synthetic model */
    struct kv_config c = bench_synthetic_config();
    struct kv_model *m;
    if (kv_model_init_random(&c, 1234, &m, &err)) return die(&err);
    int64_t seq = 512, nw = 6;
    int32_t *tok = malloc((size_t)(seq * nw) * sizeof *tok);
    for (int64_t i = 0; i < seq * nw; i++) tok[i] = (int32_t)((i * 7919 + 13) % c.vocab_size);
    double best_v = 0, best_c = 0, tps;
    for (int rep = 0; rep < 3; rep++) {
        struct kv_ppl_result pr;
        if (kv_ppl_run(m, tok, seq * nw, seq, 0, NULL, NULL, &pr, &err)) return die(&err);
        tps = (double)(pr.windows * seq) / pr.seconds;
        if (tps > best_v) best_v = tps;
        if (accum_rate(m, tok, nw, seq, &tps, &err)) return die(&err);
        if (tps > best_c) best_c = tps;
    }
    printf("synthetic llama d=2048 L=4 h=16 g=4 ffn=5632 vocab=32000, %lld windows of %lld "
           "(best of 3)\n", (long long)nw, (long long)seq);
    report("synthetic", best_v, best_c, &failed);
    printf("  statistics per layer: %.1f MiB of float64 sums\n\n",
           8.0 * (double)(c.dim * c.dim + c.dim + (c.n_heads + c.n_kv_heads) * c.head_dim * c.head_dim) /
               (1 << 20));
    free(tok);
    kv_model_close(m);

    /* 2. tinystories-656K on WikiText-2 */
    char p1[4096], p2[4096];
    const char *wiki = shared("text/wikitext-2-raw/wiki.test.raw", p1, sizeof p1);
    const char *ts = shared("models/tinystories-656K", p2, sizeof p2);
    if (!wiki || !ts) {
        printf("shared test data is absent: skipping the real-model benchmarks\n");
        return failed;
    }
    if (kv_model_open(ts, NULL, &m, &err)) return die(&err);
    seq = 256, nw = 256;
    struct kv_calib_opts co = {seq, nw, 1, 0, 0, 1, 0};
    struct kv_calib *cal;
    const char *paths[1] = {wiki};
    if (kv_calib_open(paths, 1, kv_model_tokenizer(m), &co, &cal, &err)) return die(&err);
    char *text;
    size_t len;
    int32_t *ids;
    int64_t n;
    if (kv_text_read(wiki, &text, &len, &err)) return die(&err);
    if (kv_tok_encode(kv_model_tokenizer(m), text, len, 1, &ids, &n, &err)) return die(&err);
    free(text);
    best_v = best_c = 0;
    for (int rep = 0; rep < 3; rep++) {
        struct kv_ppl_result pr;
        if (kv_ppl_run(m, ids, n, seq, nw, NULL, NULL, &pr, &err)) return die(&err);
        tps = (double)(pr.windows * seq) / pr.seconds;
        if (tps > best_v) best_v = tps;
        struct kv_stats *s;
        if (kv_stats_init(kv_model_config(m), &s, &err)) return die(&err);
        struct kv_collect_opts o = {.data = &co};
        if (kv_collect_run(m, cal, s, &o, &err)) return die(&err);
        tps = (double)(s->info.windows * seq) / o.seconds;
        if (tps > best_c) best_c = tps;
        kv_stats_free(s);
    }
    printf("tinystories-656K on wiki.test.raw, the first %lld windows of %lld (best of 3)\n",
           (long long)nw, (long long)seq);
    report("656K", best_v, best_c, &failed);
    free(ids);
    kv_calib_free(cal);
    kv_model_close(m);

    /* 3. memory against windows, as a user runs it */
    const char *bin = getenv("KVCAL_BIN") ? getenv("KVCAL_BIN") : "build/kvcal";
    char dir[] = "/tmp/kvcal-bench-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    double rss[2];
    int samples[2] = {16, 256};
    for (int i = 0; i < 2; i++) {
        char cmd[16384];
        snprintf(cmd, sizeof cmd,
                 "%s collect -m %s -t %s --samples %d --seed 1 --threads %d -q -o %s/s.kvstats "
                 ">/dev/null",
                 bin, ts, wiki, samples[i], threads, dir);
        rss[i] = child_rss_mib(cmd);
        if (rss[i] < 0) {
            fprintf(stderr, "bench: '%s' failed\n", cmd);
            return 1;
        }
    }
    char f[4200];
    snprintf(f, sizeof f, "%s/s.kvstats", dir);
    unlink(f);
    rmdir(dir);
    double diff = (rss[1] - rss[0]) / rss[0];
    printf("\nkvcal collect tinystories-656K on wiki.test.raw: peak rss\n");
    printf("  16 windows %.1f MiB, 256 windows %.1f MiB: %+.1f%% (target under 5%%) %s\n",
           rss[0], rss[1], 100 * diff, diff < 0.05 && diff > -0.05 ? "ok" : "MISSED");
    failed |= !(diff < 0.05 && diff > -0.05);
    return failed;
}
