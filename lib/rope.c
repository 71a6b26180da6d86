/* RoPE frequencies and their scaling (model.h).
 *
 * Each scaling type computes the inverse frequencies of the rotated pairs
 * as the Hugging Face reference does (transformers' modeling_rope_utils),
 * in double: see docs/design.md, "RoPE and its scalings". */
#include <math.h>
#include <string.h>

#include "err.h"
#include "model.h"

const char *kv_rope_scaling_name(enum kv_rope_scaling t) {
    switch (t) {
    case KV_ROPE_SCALING_NONE: return "default";
    case KV_ROPE_SCALING_LINEAR: return "linear";
    case KV_ROPE_SCALING_DYNAMIC: return "dynamic";
    case KV_ROPE_SCALING_LLAMA3: return "llama3";
    case KV_ROPE_SCALING_YARN: return "yarn";
    case KV_ROPE_SCALING_LONGROPE: return "longrope";
    case KV_ROPE_SCALING_FREQS: return "freqs";
    }
    return "?";
}

int kv_rope_depends_on_length(const struct kv_config *c) {
    enum kv_rope_scaling t = c->rope_scaling.type;
    return t == KV_ROPE_SCALING_DYNAMIC || t == KV_ROPE_SCALING_LONGROPE;
}

/* yarn's dimension at which a frequency turns n_rot times over ctx positions */
static double yarn_corr_dim(double n_rot, double dim, double base, double ctx) {
    return dim * log(ctx / (n_rot * 2 * M_PI)) / (2 * log(base));
}

static double yarn_mscale(double scale) { return scale <= 1 ? 1.0 : 0.1 * log(scale) + 1.0; }

/* yarn: the ramp from extrapolation (kept frequencies) to interpolation
 * (frequencies / factor) between the correction dimensions of beta_fast
 * and beta_slow turns. */
static void yarn_freqs(const struct kv_rope_scaling_cfg *s, double base, int64_t dim,
                       double *inv_freq) {
    double lo = yarn_corr_dim(s->beta_fast, (double)dim, base, (double)s->original_ctx);
    double hi = yarn_corr_dim(s->beta_slow, (double)dim, base, (double)s->original_ctx);
    if (s->truncate) lo = floor(lo), hi = ceil(hi);
    if (lo < 0) lo = 0;
    if (hi > (double)(dim - 1)) hi = (double)(dim - 1);
    if (lo == hi) hi += 0.001;
    for (int64_t i = 0; i < dim / 2; i++) {
        double ramp = ((double)i - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double extra = 1 - ramp; /* the share kept unscaled */
        double f = inv_freq[i];
        inv_freq[i] = f / s->factor * (1 - extra) + f * extra;
    }
}

/* llama3: wavelengths beyond original_ctx / low_freq_factor are divided by
 * factor, those below original_ctx / high_freq_factor kept, and the band
 * between mixes the two smoothly. */
static void llama3_freqs(const struct kv_rope_scaling_cfg *s, int64_t half, double *inv_freq) {
    double ctx = (double)s->original_ctx;
    double low_wl = ctx / s->low_freq_factor, high_wl = ctx / s->high_freq_factor;
    for (int64_t i = 0; i < half; i++) {
        double f = inv_freq[i], wl = 2 * M_PI / f;
        if (wl > low_wl) {
            inv_freq[i] = f / s->factor;
        } else if (!(wl < high_wl)) {
            double smooth = (ctx / wl - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
            inv_freq[i] = (1 - smooth) * f / s->factor + smooth * f;
        }
    }
}

double kv_rope_freqs(const struct kv_config *c, int64_t seq_len, double *inv_freq) {
    const struct kv_rope_scaling_cfg *s = &c->rope_scaling;
    int64_t dim = kv_rope_dim(c), half = dim / 2;
    double base = (double)c->rope_theta, scale = 1.0;
    int past = s->original_ctx > 0 && seq_len > s->original_ctx;
    if (s->type == KV_ROPE_SCALING_DYNAMIC && past)
        base *= pow(s->factor * (double)seq_len / (double)s->original_ctx - (s->factor - 1),
                    (double)dim / (double)(dim - 2));
    for (int64_t i = 0; i < half; i++) inv_freq[i] = pow(base, -2.0 * (double)i / (double)dim);
    switch (s->type) {
    case KV_ROPE_SCALING_NONE:
    case KV_ROPE_SCALING_DYNAMIC: break;
    case KV_ROPE_SCALING_LINEAR:
        for (int64_t i = 0; i < half; i++) inv_freq[i] /= s->factor;
        break;
    case KV_ROPE_SCALING_LLAMA3: llama3_freqs(s, half, inv_freq); break;
    case KV_ROPE_SCALING_YARN:
        yarn_freqs(s, base, dim, inv_freq);
        scale = s->attention_factor > 0 ? s->attention_factor : yarn_mscale(s->factor);
        break;
    case KV_ROPE_SCALING_LONGROPE:
    case KV_ROPE_SCALING_FREQS: {
        const float *ext = s->type == KV_ROPE_SCALING_LONGROPE && past ? s->long_factor
                                                                       : s->short_factor;
        for (int64_t i = 0; i < half && i < s->n_factors; i++) inv_freq[i] /= (double)ext[i];
        if (s->type == KV_ROPE_SCALING_LONGROPE)
            scale = s->attention_factor > 0 ? s->attention_factor
                    : s->factor <= 1      ? 1.0
                                          : sqrt(1 + log(s->factor) / log((double)s->original_ctx));
        break;
    }
    }
    return scale;
}

void kv_rope_table(const struct kv_config *c, int64_t seq_len, int64_t n_pos, float *cos_out,
                   float *sin_out) {
    int64_t half = kv_rope_dim(c) / 2;
    double inv_freq[KV_MAX_ROPE_FACTORS];
    KV_ASSERT(half <= KV_MAX_ROPE_FACTORS);
    double scale = kv_rope_freqs(c, seq_len, inv_freq);
    for (int64_t p = 0; p < n_pos; p++)
        for (int64_t i = 0; i < half; i++) {
            double ang = (double)p * inv_freq[i];
            cos_out[p * half + i] = (float)(cos(ang) * scale);
            sin_out[p * half + i] = (float)(sin(ang) * scale);
        }
}

int kv_rope_same(const struct kv_config *a, const struct kv_config *b) {
    if (a->head_dim != b->head_dim || kv_rope_dim(a) != kv_rope_dim(b) ||
        a->rope_theta != b->rope_theta)
        return 0;
    int64_t lens[] = {1, a->rope_scaling.original_ctx + 1, b->rope_scaling.original_ctx + 1};
    for (int k = 0; k < 3; k++) {
        double fa[KV_MAX_ROPE_FACTORS], fb[KV_MAX_ROPE_FACTORS];
        if (kv_rope_freqs(a, lens[k], fa) != kv_rope_freqs(b, lens[k], fb)) return 0;
        for (int64_t i = 0; i < kv_rope_dim(a) / 2; i++)
            if ((float)fa[i] != (float)fb[i]) return 0;
    }
    return 1;
}

int kv_rope_check(const struct kv_config *c, const char *path, struct kv_err *err) {
    const struct kv_rope_scaling_cfg *s = &c->rope_scaling;
    const char *name = kv_rope_scaling_name(s->type);
    int needs_factor = s->type == KV_ROPE_SCALING_LINEAR || s->type == KV_ROPE_SCALING_DYNAMIC ||
                       s->type == KV_ROPE_SCALING_LLAMA3 || s->type == KV_ROPE_SCALING_YARN;
    if (needs_factor && !(s->factor > 0 && isfinite(s->factor)))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope scaling '%s' needs a positive factor, found %g", name, s->factor);
    int needs_ctx = s->type == KV_ROPE_SCALING_LLAMA3 || s->type == KV_ROPE_SCALING_YARN ||
                    s->type == KV_ROPE_SCALING_DYNAMIC || s->type == KV_ROPE_SCALING_LONGROPE;
    if (needs_ctx && s->original_ctx <= 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope scaling '%s' needs original_max_position_embeddings", name);
    if (s->type == KV_ROPE_SCALING_LLAMA3 &&
        !(s->low_freq_factor > 0 && s->high_freq_factor > s->low_freq_factor &&
          isfinite(s->high_freq_factor)))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope scaling 'llama3' needs 0 < low_freq_factor < high_freq_factor, "
                       "found %g and %g",
                       s->low_freq_factor, s->high_freq_factor);
    if (s->type == KV_ROPE_SCALING_YARN &&
        !(s->beta_fast > 0 && s->beta_slow > 0 && isfinite(s->beta_fast) && isfinite(s->beta_slow)))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope scaling 'yarn' needs positive beta_fast and beta_slow, found %g and %g",
                       s->beta_fast, s->beta_slow);
    if (!(s->attention_factor >= 0 && isfinite(s->attention_factor)))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope scaling '%s': attention_factor %g must be positive", name,
                       s->attention_factor);
    if (s->type == KV_ROPE_SCALING_LONGROPE || s->type == KV_ROPE_SCALING_FREQS) {
        if (s->n_factors != kv_rope_dim(c) / 2)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "rope scaling '%s' has %lld factors, expected one per rotated pair (%lld)",
                           name, (long long)s->n_factors, (long long)(kv_rope_dim(c) / 2));
        for (int64_t i = 0; i < s->n_factors; i++) {
            int bad_long = s->type == KV_ROPE_SCALING_LONGROPE &&
                           !(s->long_factor[i] > 0 && isfinite(s->long_factor[i]));
            if (!(s->short_factor[i] > 0 && isfinite(s->short_factor[i])) || bad_long)
                return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                               "rope scaling '%s': factor %lld is not a positive finite number",
                               name, (long long)i);
        }
    }
    return KV_OK;
}

int kv_rope_check_length(const struct kv_config *c, int64_t seq_len, struct kv_err *err) {
    if (!kv_rope_depends_on_length(c) || seq_len <= c->rope_scaling.original_ctx) return KV_OK;
    return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                   "rope scaling '%s' changes its frequencies with the sequence length; sequences "
                   "longer than its original context (%lld) are not supported, found %lld",
                   kv_rope_scaling_name(c->rope_scaling.type), (long long)c->rope_scaling.original_ctx,
                   (long long)seq_len);
}
