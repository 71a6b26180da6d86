/* Helpers shared by the make-bench programs (tests/bench/bench_*.c). */
#ifndef KV_BENCH_UTIL_H
#define KV_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "kvcal.h"

/* $KVCAL_SHARED/rel (default ../shared) in buf, or NULL when it does not
 * exist: the real-model benchmarks skip without the shared test data. */
static inline const char *shared(const char *rel, char *buf, size_t cap) {
    const char *root = getenv("KVCAL_SHARED");
    if (!root || !*root) root = "../shared";
    snprintf(buf, cap, "%s/%s", root, rel);
    struct stat st;
    return stat(buf, &st) == 0 ? buf : NULL;
}

/* Print the error with its detection site; returns main's exit status 1. */
static inline int die(const struct kv_err *e) {
    char buf[2400];
    kv_err_format(e, buf, sizeof buf, 1);
    fprintf(stderr, "bench: %s\n", buf);
    return 1;
}

/* The synthetic Llama the benchmarks share: d=2048, ffn 5632, 4 layers, 16
 * heads, 4 KV heads of 128, vocab 32000, rotate-half RoPE, untied head. */
static inline struct kv_config bench_synthetic_config(void) {
    struct kv_config c = {0};
    c.dim = 2048, c.hidden_dim = 5632, c.n_layers = 4, c.n_heads = 16, c.n_kv_heads = 4;
    c.head_dim = 128, c.vocab_size = 32000, c.max_seq_len = 512, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF, c.tied_embeddings = 0;
    c.bos_id = 1, c.eos_id = 2;
    return c;
}

#endif
