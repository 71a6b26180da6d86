/* RoPE angles of the naive oracles, written from llama.cpp's formulation
 * of each scaling (a per-pair frequency divisor, or ggml's yarn ramp), not
 * from lib/rope.c's transformers-style one. Header-only. */
#ifndef KV_NAIVE_ROPE_H
#define KV_NAIVE_ROPE_H

#include <math.h>

#include "kvcal_core.h"

/* The angle of pair i at position t in a sequence of seq_len positions, and
 * in *mscale the factor the rotated values are multiplied by. */
static inline double naive_rope_angle(const struct kv_config *c, int64_t seq_len, int64_t t,
                                      int64_t i, double *mscale) {
    const struct kv_rope_scaling_cfg *s = &c->rope_scaling;
    /* partial rope (gpt_neox): frequencies over the rotated dimensions only */
    double n_dims = (double)(c->rope_dim ? c->rope_dim : c->head_dim), base = c->rope_theta;
    *mscale = 1;
    int past = s->original_ctx > 0 && seq_len > s->original_ctx;
    if (s->type == KV_ROPE_SCALING_DYNAMIC && past) {
        double a = s->factor * (double)seq_len / (double)s->original_ctx - (s->factor - 1);
        base *= exp(log(a) * n_dims / (n_dims - 2));
    }
    double extrap = (double)t * exp(-2.0 * (double)i / n_dims * log(base));
    switch (s->type) {
    case KV_ROPE_SCALING_LINEAR: return extrap / s->factor;
    case KV_ROPE_SCALING_LLAMA3: { /* llama.cpp's converter: rope_freqs divisors */
        double freq = exp(-2.0 * (double)i / n_dims * log(base)), wavelen = 2 * M_PI / freq;
        double lo = (double)s->original_ctx / s->low_freq_factor;
        double hi = (double)s->original_ctx / s->high_freq_factor;
        double div;
        if (wavelen < hi)
            div = 1;
        else if (wavelen > lo)
            div = s->factor;
        else {
            double smooth = ((double)s->original_ctx / wavelen - s->low_freq_factor) /
                            (s->high_freq_factor - s->low_freq_factor);
            div = 1 / ((1 - smooth) / s->factor + smooth);
        }
        return extrap / div;
    }
    case KV_ROPE_SCALING_YARN: { /* ggml's rope_yarn with ext_factor 1 */
        double ctx = (double)s->original_ctx;
        double start = floor(n_dims * log(ctx / (s->beta_fast * 2 * M_PI)) / (2 * log(base)));
        double end = ceil(n_dims * log(ctx / (s->beta_slow * 2 * M_PI)) / (2 * log(base)));
        if (!s->truncate) {
            start = n_dims * log(ctx / (s->beta_fast * 2 * M_PI)) / (2 * log(base));
            end = n_dims * log(ctx / (s->beta_slow * 2 * M_PI)) / (2 * log(base));
        }
        double d0 = fmax(0, start), d1 = fmin(n_dims - 1, end);
        double y = ((double)i - d0) / fmax(0.001, d1 - d0);
        double mix = 1 - fmin(1, fmax(0, y));
        double interp = extrap / s->factor;
        *mscale = s->attention_factor > 0 ? s->attention_factor : 1 + 0.1 * log(s->factor);
        return interp * (1 - mix) + extrap * mix;
    }
    case KV_ROPE_SCALING_LONGROPE:
        *mscale = s->attention_factor > 0 ? s->attention_factor
                  : s->factor <= 1      ? 1
                                        : sqrt(1 + log(s->factor) / log((double)s->original_ctx));
        return extrap / (past ? s->long_factor[i] : s->short_factor[i]);
    case KV_ROPE_SCALING_FREQS: return extrap / s->short_factor[i];
    default: return extrap;
    }
}

#endif
