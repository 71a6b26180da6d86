/* make bench: forward-pass throughput against OpenBLAS sgemm, measured in
 * the same run on the same threads.
 *
 *   1. sgemm GFLOP/s on the synthetic model's projection shapes;
 *   2. synthetic random Llama (d=2048, 16 heads, 4 kv heads, 4 layers,
 *      ffn 5632, vocab 32000) at seq 512: tokens/s and achieved GFLOP/s;
 *   3. tinystories-656K forward tokens/s on WikiText-2 (seq 256);
 *   3b. the 32k Llama tokenizer on the same text;
 *   4. `kvcal verify` on stories260K over WikiText-2 (seq 256, 2 threads).
 *
 * Targets (exit 1 if missed): synthetic >= 60% of the sgemm rate;
 * stories260K verify >= 5200 tokens/s. Threads: $BENCH_THREADS, default 2. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "bench_util.h"
#include "kvcal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double peak_rss_mib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0;
}

/* GFLOP/s of C[m,n] = A[m,k] Bᵀ over repeated calls (best of 3 runs). */
static double sgemm_gflops(int m, int n, int k) {
    float *a = malloc((size_t)m * k * sizeof *a), *b = malloc((size_t)n * k * sizeof *b);
    float *c = malloc((size_t)m * n * sizeof *c);
    for (size_t i = 0; i < (size_t)m * k; i++) a[i] = (float)((i * 7) % 13) * 0.01f;
    for (size_t i = 0; i < (size_t)n * k; i++) b[i] = (float)((i * 5) % 11) * 0.01f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1, a, k, b, k, 0, c, n);
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        int iters = 0;
        double t0 = now_s(), t;
        do {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1, a, k, b, k, 0, c, n);
            iters++;
        } while ((t = now_s() - t0) < 0.5);
        double g = 2.0 * m * n * k * iters / t / 1e9;
        if (g > best) best = g;
    }
    free(a), free(b), free(c);
    return best;
}

int main(void) {
    int threads = getenv("BENCH_THREADS") ? atoi(getenv("BENCH_THREADS")) : 2;
    kv_set_threads(threads);
    int failed = 0;
    struct kv_err err;
    kv_err_clear(&err);
    printf("threads: %d\n\n", threads);

    /* 1. sgemm reference on the synthetic model's shapes (n = 512 tokens). */
    struct {
        const char *what;
        int m, n, k;
    } shapes[] = {{"q/o proj 512x2048x2048", 512, 2048, 2048},
                  {"ffn up   512x5632x2048", 512, 5632, 2048},
                  {"ffn down 512x2048x5632", 512, 2048, 5632}};
    double sg = 0;
    printf("%-28s %10s\n", "sgemm shape (m x n x k)", "GFLOP/s");
    for (int i = 0; i < 3; i++) {
        double g = sgemm_gflops(shapes[i].m, shapes[i].n, shapes[i].k);
        printf("%-28s %10.1f\n", shapes[i].what, g);
        if (g > sg) sg = g;
    }
    printf("sgemm rate (best shape): %.1f GFLOP/s\n\n", sg);

    /* 2. synthetic Llama at real shapes */
    struct kv_config c = bench_synthetic_config();
    struct kv_model *m;
    if (kv_model_init_random(&c, 1234, &m, &err)) return die(&err);
    int64_t T = 512, reps = 6;
    int32_t *tok = malloc((size_t)T * sizeof *tok);
    for (int64_t i = 0; i < T; i++) tok[i] = (int32_t)((i * 7919) % c.vocab_size);
    struct kv_fwd *f;
    if (kv_fwd_init(m, T, &f, &err)) return die(&err);
    if (kv_fwd_run(f, tok, T, 0, NULL, &err)) return die(&err); /* warm-up */
    double t0 = now_s();
    for (int64_t r = 0; r < reps; r++)
        if (kv_fwd_run(f, tok, T, 0, NULL, &err)) return die(&err);
    double dt = now_s() - t0;
    double gf = kv_fwd_flops(m, T, 0) * (double)reps / dt / 1e9;
    double ratio = gf / sg;
    printf("synthetic llama d=2048 L=4 h=16 g=4 ffn=5632 vocab=32000 seq=512\n");
    printf("  forward: %.0f tokens/s, %.1f GFLOP/s = %.0f%% of sgemm (target >= 60%%) %s\n",
           (double)(T * reps) / dt, gf, 100 * ratio, ratio >= 0.60 ? "ok" : "MISSED");
    printf("  peak rss so far: %.0f MiB\n\n", peak_rss_mib());
    failed |= ratio < 0.60;
    kv_fwd_free(f);
    kv_model_close(m);
    free(tok);

    /* 3. tinystories-656K forward on WikiText-2 */
    char p1[4096], p2[4096];
    const char *wiki = shared("text/wikitext-2-raw/wiki.test.raw", p1, sizeof p1);
    const char *ts = shared("models/tinystories-656K", p2, sizeof p2);
    if (!wiki || !ts) {
        printf("shared test data is absent: skipping the real-model benchmarks\n");
        return failed;
    }
    if (kv_model_open(ts, NULL, &m, &err)) return die(&err);
    char *text;
    size_t len;
    if (kv_text_read(wiki, &text, &len, &err)) return die(&err);
    int32_t *ids;
    int64_t n;
    t0 = now_s();
    if (kv_tok_encode(kv_model_tokenizer(m), text, len, 1, &ids, &n, &err)) return die(&err);
    double tok_s = now_s() - t0;
    struct kv_ppl_result pr;
    if (kv_ppl_run(m, ids, n, 256, 0, NULL, NULL, &pr, &err)) return die(&err);
    printf("tinystories-656K on wiki.test.raw (seq 256)\n");
    printf("  tokenize: %lld tokens from %zu bytes in %.2f s\n", (long long)n, len, tok_s);
    printf("  forward: %.0f tokens/s, %.2f GFLOP/s, ppl %.3f\n\n",
           (double)(pr.windows * 256) / pr.seconds,
           kv_fwd_flops(m, 256, 0) * (double)pr.windows / pr.seconds / 1e9, pr.ppl);
    free(ids);
    kv_model_close(m);

    /* 3b. the 32k Llama tokenizer on the same 1.3 MB */
    char p5[4096];
    const char *l32 = shared("models/llama2-tokenizer/tokenizer.bin", p5, sizeof p5);
    if (l32) {
        struct kv_tokenizer *tk;
        if (kv_tok_open(l32, &tk, &err)) return die(&err);
        t0 = now_s();
        if (kv_tok_encode(tk, text, len, 1, &ids, &n, &err)) return die(&err);
        double tt = now_s() - t0;
        printf("llama2 32k tokenizer on wiki.test.raw\n");
        printf("  %lld tokens from %zu bytes in %.2f s (%.2f MB/s)\n\n", (long long)n, len, tt,
               (double)len / tt / 1e6);
        free(ids);
        kv_tok_free(tk);
    }
    free(text);

    /* 4. the verify command itself on stories260K */
    char p3[4096], p4[4096], cmd[16384];
    const char *bin = getenv("KVCAL_BIN") ? getenv("KVCAL_BIN") : "build/kvcal";
    const char *s260 = shared("models/stories260K/stories260K.bin", p3, sizeof p3);
    const char *tok512 = shared("models/stories260K/tok512.bin", p4, sizeof p4);
    snprintf(cmd, sizeof cmd,
             "%s verify --model %s --tokenizer %s --text %s --seq-len 256 --threads 2 --json",
             bin, s260, tok512, wiki);
    double best_tps = 0;
    for (int rep = 0; rep < 3; rep++) {
        FILE *pp = popen(cmd, "r");
        if (!pp) return 1;
        char line[512];
        double tps = 0;
        while (fgets(line, sizeof line, pp)) {
            const char *k = strstr(line, "\"tokens_per_s\":");
            if (k) tps = atof(k + 15);
        }
        if (pclose(pp) != 0) {
            fprintf(stderr, "bench: '%s' failed\n", cmd);
            return 1;
        }
        if (tps > best_tps) best_tps = tps;
    }
    printf("kvcal verify stories260K on wiki.test.raw (seq 256, 2 threads, best of 3)\n");
    printf("  %.0f tokens/s (target >= 5200) %s\n", best_tps, best_tps >= 5200 ? "ok" : "MISSED");
    failed |= best_tps < 5200;
    return failed;
}
