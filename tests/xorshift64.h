/* The xorshift64 generator test_stwrite.c and test_f16.c draw their
 * deterministic inputs from. */
#ifndef KV_XORSHIFT64_H
#define KV_XORSHIFT64_H

#include <stdint.h>

/* Deterministic bytes (xorshift64). */
static inline uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

#endif
