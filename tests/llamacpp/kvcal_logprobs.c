/* kvcal's next-token log-probabilities for a token sequence, in the layout of
 * logprobs.mjs (llama.cpp's), so the two can be compared position by position
 * over the whole vocabulary (compare.mjs).
 *
 *   kvcal_logprobs [--naive] [--threads N] MODEL IDS.txt OUT.bin
 *
 * MODEL: anything kvcal loads (HF directory, .gguf, llama2.c .bin); IDS.txt:
 * whitespace-separated token ids, fed exactly (no BOS added). Without
 * --naive the logits come from kvcal's forward (lib/forward.c, float32, the
 * one `kvcal verify` uses) over the whole sequence in one run from position
 * 0; with --naive from the float64 forward of tests/naive_llama.h (Llama
 * only; no BLAS, no code shared with lib/forward.c).
 *
 * OUT.bin, little-endian: u32 n_positions (= number of ids - 1), u32 n_vocab,
 * then per position i = 0..n_positions-1, n_vocab float32 log p(v | ids[0..i])
 * (log-softmax in float64 of the logits). stdout: one JSON line.
 *
 * Build from the repository root after `make`:
 *   cc -std=c11 -O2 -D_GNU_SOURCE -fopenmp -Ilib -Iformats -Ibuild/include -Itests \
 *      -I/usr/include/$(gcc -print-multiarch)/openblas-openmp \
 *      tests/llamacpp/kvcal_logprobs.c build/libkvcal.a -o build/kvcal_logprobs \
 *      <the LDLIBS of the Makefile>
 * (tests/llamacpp/build.sh does exactly this.) */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcal_core.h"
#include "kvformats.h"
#include "naive_llama.h"

static void die(const char *msg, const char *arg) {
    if (arg)
        fprintf(stderr, "kvcal_logprobs: %s: %s\n", arg, msg);
    else
        fprintf(stderr, "kvcal_logprobs: %s\n", msg);
    exit(1);
}

static int32_t *read_ids(const char *path, int64_t *n_out) {
    FILE *f = fopen(path, "r");
    if (!f) die(strerror(errno), path);
    int64_t n = 0, cap = 1024;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    for (;;) {
        long long v;
        int r = fscanf(f, "%lld", &v);
        if (r == EOF) break;
        if (r != 1 || v < 0 || v > INT32_MAX) die("not a list of token ids", path);
        if (n == cap) ids = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
        ids[n++] = (int32_t)v;
    }
    fclose(f);
    if (n < 2) die("need at least 2 token ids", path);
    *n_out = n;
    return ids;
}

int main(int argc, char **argv) {
    int naive = 0, threads = 0;
    const char *pos[3];
    int np = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--naive"))
            naive = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (np < 3 && argv[i][0] != '-')
            pos[np++] = argv[i];
        else
            np = 99;
    }
    if (np != 3) {
        fprintf(stderr, "usage: kvcal_logprobs [--naive] [--threads N] MODEL IDS.txt OUT.bin\n");
        return 1;
    }
    if (threads > 0) omp_set_num_threads(threads);
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_model *m;
    if (kv_model_open(pos[0], NULL, &m, &err)) die(err.msg, NULL);
    int64_t n;
    int32_t *ids = read_ids(pos[1], &n);
    const int64_t V = kv_model_config(m)->vocab_size, P = n - 1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= V) die("a token id is outside the vocabulary", pos[1]);
    if (naive && kv_model_config(m)->arch != KV_ARCH_LLAMA) die("--naive is for Llama models", pos[0]);

    double t0 = kv_now();
    double *lg64 = NULL;
    float *lg32 = NULL;
    if (naive) {
        lg64 = naive_forward(m, ids, P);
    } else {
        struct kv_fwd *f;
        if (kv_fwd_init(m, P, &f, &err)) die(err.msg, NULL);
        lg32 = malloc((size_t)(P * V) * sizeof *lg32);
        if (!lg32 || kv_fwd_run(f, ids, P, 0, lg32, &err)) die(err.msg[0] ? err.msg : "out of memory", NULL);
        kv_fwd_free(f);
    }
    double secs = kv_now() - t0;

    char *tmp = malloc(strlen(pos[2]) + 8);
    sprintf(tmp, "%s.tmp", pos[2]);
    FILE *out = fopen(tmp, "wb");
    if (!out) die(strerror(errno), tmp);
    uint32_t hdr[2] = {(uint32_t)P, (uint32_t)V}; /* x86-64/aarch64: little-endian */
    fwrite(hdr, sizeof hdr, 1, out);
    float *row = malloc((size_t)V * sizeof *row);
    double nll = 0;
    for (int64_t i = 0; i < P; i++) {
        double mx = -INFINITY, s = 0;
        for (int64_t v = 0; v < V; v++) {
            double x = naive ? lg64[i * V + v] : lg32[i * V + v];
            mx = x > mx ? x : mx;
        }
        for (int64_t v = 0; v < V; v++) s += exp((naive ? lg64[i * V + v] : lg32[i * V + v]) - mx);
        double lse = mx + log(s);
        for (int64_t v = 0; v < V; v++) row[v] = (float)((naive ? lg64[i * V + v] : lg32[i * V + v]) - lse);
        nll -= (naive ? lg64[i * V + ids[i + 1]] : lg32[i * V + ids[i + 1]]) - lse;
        if (fwrite(row, sizeof *row, (size_t)V, out) != (size_t)V) die("write failed", tmp);
    }
    if (fclose(out) || rename(tmp, pos[2])) die(strerror(errno), pos[2]);
    printf("{\"n\": %lld, \"n_positions\": %lld, \"n_vocab\": %lld, \"nll_sum\": %.12g, \"ppl\": %.12g, "
           "\"forward\": \"%s\", \"seconds\": %.6f}\n",
           (long long)n, (long long)P, (long long)V, nll, exp(nll / (double)P),
           naive ? "naive float64 (tests/naive_llama.h)" : "kvcal float32 (kv_fwd_run)", secs);
    free(row), free(tmp), free(lg64), free(lg32), free(ids);
    kv_model_close(m);
    return 0;
}
