/* The tanh GELU of the float64 oracles, and the way llama.cpp's CPU backend
 * evaluates it, for comparisons with llama.cpp. Its GELU looks the result
 * up in a table indexed by the input rounded to fp16, whose entries are the
 * GELU rounded to fp16. With *naive_gelu_fp16() set, naive_gelu_tanh rounds
 * its input and its output to fp16 the same way (to nearest, ties to even:
 * kv_f32_to_f16), so an oracle computes what llama.cpp's graph does; unset
 * (the default) it is the exact tanh GELU. Header-only. */
#ifndef KV_NAIVE_GELU_H
#define KV_NAIVE_GELU_H

#include <math.h>

#include "model.h"

static inline int *naive_gelu_fp16(void) {
    static int on;
    return &on;
}

static inline double naive_gelu_tanh(double a) {
    int f16 = *naive_gelu_fp16();
    if (f16) a = kv_f16_to_f32(kv_f32_to_f16((float)a));
    double g = 0.5 * a * (1.0 + tanh(sqrt(2.0 / M_PI) * (a + 0.044715 * a * a * a)));
    return f16 ? kv_f16_to_f32(kv_f32_to_f16((float)g)) : g;
}

#endif
