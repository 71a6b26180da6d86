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

#endif
