/* kvcal's forward against llama.cpp's prompt processing on the same GGUF
 * (tests/bench/llamacpp_vs.sh drives it with tests/llamacpp/bench.mjs;
 * docs/bench-8b.md has the numbers).
 *
 *   bench_llamacpp write OUT.gguf CONFIG.json [--layers N]
 *       a random-weight model of config.json's shape (N layers; default
 *       the config's), norms 1, written as GGUF with F16 matrices (what
 *       both engines then read: the same bytes)
 *   bench_llamacpp time MODEL.gguf N_TOKENS
 *       kvcal's forward on N_TOKENS ids in one window, the head applied to
 *       the last position only (as llama.cpp's prompt processing computes
 *       only the last token's logits): the best of 3 runs after a warm-up,
 *       one JSON line {"tokens_per_s", "gflop_per_s", "n", "threads"}.
 *       Threads: OMP_NUM_THREADS / OpenBLAS's default.
 *
 * With no arguments it prints this usage and exits 0, so `make bench`,
 * which runs every build/bench binary bare, passes over it at once. */
#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ggufmodelw.h"
#include "hfdir.h"
#include "kvformats.h"
#include "model.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void usage(FILE *f) {
    fprintf(f, "usage: bench_llamacpp write OUT.gguf CONFIG.json [--layers N]\n"
               "       bench_llamacpp time MODEL.gguf N_TOKENS\n"
               "Run by tests/bench/llamacpp_vs.sh; with no arguments this prints usage and exits 0.\n");
}

static int write_model(const char *out, const char *config, int64_t layers) {
    struct kv_config c;
    struct kv_err e = {0};
    if (kv_hf_read_config(config, &c, &e)) return die(&e);
    if (layers > 0) c.n_layers = layers;
    c.sliding_window = 0, c.window_period = 0; /* the GGUF writer refuses windows it cannot state */
    struct kv_model *m;
    if (kv_model_init_random(&c, 1234, &m, &e)) return die(&e);
    struct kv_gguf_write_opts o = {.matrix_type = 1}; /* F16 */
    int rc = kv_gguf_write_model(m, out, &o, &e);
    kv_model_close(m);
    if (rc) return die(&e);
    fprintf(stderr, "wrote %s: %s shape, %lld layers, F16 matrices\n", out, kv_arch_name(c.arch),
            (long long)c.n_layers);
    return 0;
}

static int time_model(const char *path, int64_t n) {
    struct kv_model *m;
    struct kv_err e = {0};
    if (kv_model_open(path, NULL, &m, &e)) return die(&e);
    const struct kv_config *c = kv_model_config(m);
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    uint32_t s = 0x9e3779b9u;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 17, s ^= s << 5;
        ids[i] = (int32_t)(s % (uint32_t)c->vocab_size);
    }
    struct kv_fwd *f;
    if (kv_fwd_init(m, n, &f, &e)) return die(&e);
    kv_fwd_one_window(f);
    kv_fwd_defer_head(f);
    float *last = malloc((size_t)c->vocab_size * sizeof *last);
    double best = 1e30;
    for (int r = 0; r < 4; r++) { /* run 0 is the warm-up */
        double t0 = now_s();
        if (kv_fwd_run(f, ids, n, 0, NULL, &e) || kv_fwd_head(f, n - 1, 1, last, &e)) return die(&e);
        double dt = now_s() - t0;
        if (r > 0 && dt < best) best = dt;
    }
    /* the forward's FLOPs less the head of every position but the last */
    double flops = kv_fwd_flops(m, n, 0) - 2.0 * (double)c->dim * (double)c->vocab_size * (double)(n - 1);
    printf("{\"tokens_per_s\": %.2f, \"gflop_per_s\": %.1f, \"n\": %lld, \"threads\": %d, "
           "\"seconds\": %.3f, \"blas\": \"OpenBLAS %s kernels\"}\n",
           (double)n / best, flops / best * 1e-9, (long long)n, omp_get_max_threads(), best,
           openblas_get_corename());
    kv_fwd_free(f);
    free(last), free(ids);
    kv_model_close(m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 1) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "write") && (argc == 4 || (argc == 6 && !strcmp(argv[4], "--layers"))))
        return write_model(argv[2], argv[3], argc == 6 ? atoll(argv[5]) : 0);
    if (!strcmp(argv[1], "time") && argc == 4 && atoll(argv[3]) > 0)
        return time_model(argv[2], atoll(argv[3]));
    usage(stderr);
    return 2;
}
