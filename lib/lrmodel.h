/* The compressed-attention description, inside (internal to the library
 * layers: lib, formats, calib and kernels read and build it; programs use
 * the accessors of kvcal_core.h).
 *
 * Factors are in weight layout ([out, in], as HF stores a linear) and
 * float32; every pointer is owned by the struct and freed by kv_lr_free. */
#ifndef KV_LRMODEL_H
#define KV_LRMODEL_H

#include <math.h>

#include "kvcal_core.h"

/* One unit: KV heads head0 .. head0+n_heads-1 of one layer's K or V, with
 * one rank. Weight-layout factors ([out, in], as HF stores a linear):
 *   down [rank, d], down_bias [rank] or NULL:  z = x downᵀ + down_bias
 *   up   [n_heads*d_h, rank], up_bias [n_heads*d_h] or NULL:
 *                                              y = z upᵀ + up_bias
 *        up_bias is the calibration mean μ of y when the factors are
 *        centred (decompose --center; then down_bias = upᵀ(b_u - μ)). The
 *        runtime adds it to rebuilt prerope_latent keys before RoPE; a
 *        fused_query key's mean shifts every score of a query equally and
 *        drops out of the softmax, so it is only read by the dense export;
 *        a fused_output value's mean is applied as the layer's
 *        o_fused_bias (softmax weights sum to 1).
 *   rot  [rank, d_h] (postrope_rotation only): z_j = k_j rotᵀ for the one
 *        KV head j of the unit, and q'_i = q_i rotᵀ for its query heads.
 * energy and dropped are calibration sums (Σ over tokens of squared norms in
 * the unit's metric); dropped/energy is the predicted relative error. */
struct kv_lr_unit {
    int64_t head0, n_heads;
    int64_t rank;
    double energy, dropped;
    float *down, *down_bias, *up, *up_bias, *rot;
    /* mixed storage (info.kv_bits KV_LR_BITS_MIXED): the bands of the
     * latent coordinates in order, their n adding up to rank; 0 bands
     * otherwise */
    int n_bands;
    struct kv_lr_band bands[KV_LR_MAX_BANDS];
};

/* The orthonormal rotation fused into unit un's latents by
 * kv_lr_fuse_hadamard, into h [rank, rank]: kv_la_hadamard of each band's
 * n on the diagonal (of the whole rank without bands). */
void kv_lr_unit_hadamard(const struct kv_lr_unit *un, double *h);

/* The bands unit un is stored in at kv_bits: its own at KV_LR_BITS_MIXED,
 * else one band of its whole rank at kv_bits. Returns their count. */
int kv_lr_unit_bands(const struct kv_lr_unit *un, int kv_bits, struct kv_lr_band out[KV_LR_MAX_BANDS]);
/* The bytes per token of n bands: Σ kv_lr_unit_bytes(b[i].n, b[i].bits). */
int64_t kv_lr_bands_bytes(const struct kv_lr_band *b, int n);
/* The bytes per token of unit un at kv_bits (kv_lr_unit_bands). */
int64_t kv_lr_unit_bytes_at(const struct kv_lr_unit *un, int kv_bits);
/* Whether n bands b are well formed for a unit of rank r: 1 ..
 * KV_LR_MAX_BANDS bands, each n >= 1 and its bits valid, bits strictly
 * falling, the n adding up to r. KV_OK, or KV_EINVAL with the reason in
 * why (the caller names the file and unit). */
int kv_lr_bands_check(const struct kv_lr_band *b, int n, int64_t r, char *why, size_t why_len);
/* Every compressed unit of a mixed-bit lr has well-formed bands
 * (kv_lr_bands_check): KV_OK, else KV_EINVAL naming path (may be NULL),
 * the layer, side and unit. KV_OK at once when lr's bits are not mixed. */
int kv_lr_check_all_bands(const struct kv_lowrank *lr, const char *path, struct kv_err *err);

struct kv_lr_side {
    enum kv_lr_mode mode;
    int64_t n_units;         /* 0 for KV_LR_FULL */
    struct kv_lr_unit *units;
};

struct kv_lr_layer {
    struct kv_lr_side k, v;
    /* fused_output values: the output projection with each query head's
     * d_h input columns replaced by its unit's latent columns, [d, o_cols]
     * weight layout with o_cols = Σ over query heads i of rank(unit of i),
     * query heads in order. NULL otherwise. */
    float *o_fused;
    int64_t o_cols;
    /* centred fused_output values: [d], Σ over query heads i of O_i μ_u(i)
     * (O_i = o_proj[:, i*d_h ..], μ_u(i) the up_bias rows of i's KV head),
     * added to the fused projection's output before any post-norm, on top
     * of the model's own o bias. NULL when the value units have no
     * up_bias. */
    float *o_fused_bias;
    /* fused_query keys: the query projection folded with each query head's
     * unit up-block, q'_i = q_i up_i = x (up_iᵀ W_q,i)ᵀ + up_iᵀ b_q,i, stored
     * [q_cols, d] weight layout (+ bias [q_cols], NULL when the model has no
     * q bias) with q_cols = Σ over query heads i of rank(unit of i), query
     * heads in order. NULL otherwise. */
    float *q_fused, *q_fused_bias;
    int64_t q_cols;
};

/* A compressed model's attention: what kvcal decompose builds, what the
 * output directory stores and what the latent-cache forward pass runs. */
struct kv_lowrank {
    struct kv_lr_info info;      /* method, shapes, latent storage (kvcal_core.h) */
    struct kv_lr_layer *layers;  /* [info.n_layers] */
};


/* Per-token asymmetric quantization of one latent row z [r] to kv_bits
 * 8, 4, 3 or 2, the reference every cache of quantized latents follows
 * (the forward pass, the runtime's twin and its GPU kernels):
 *   lo, hi = min, max of z; zero = f16(lo); scale = f16((hi - zero) / qmax)
 *   with qmax = 2^bits - 1 (f16: rounded to fp16 and back);
 *   code_i = clamp(rint((z_i - zero) / scale), 0, qmax), 0 when scale is 0;
 *   read back as code_i * scale + zero, the product rounded before the sum.
 * kv_lr_qparams gives scale and zero (fp16 values, as floats). */
void kv_lr_qparams(const float *z, int64_t r, int bits, float *scale, float *zero);
static inline float kv_lr_qmax(int bits) { return (float)((1 << bits) - 1); }
/* The code of z as a float (an integer in 0 .. qmax; NaN stays NaN). */
static inline float kv_lr_qcode(float z, float scale, float zero, float qmax) {
    float q = scale > 0 ? nearbyintf((z - zero) / scale) : 0.0f;
    return q < 0 ? 0 : (q > qmax ? qmax : q);
}
/* code * scale + zero with the product rounded to float before the sum:
 * the volatile keeps any compiler from fusing the two into one fma (on a
 * GPU: __fmul_rn, then __fadd_rn). */
static inline float kv_lr_dequant(float code, float scale, float zero) {
    volatile float p = code * scale;
    return p + zero;
}

/* Layer l's keys (which 0) or values (which 1). */
static inline struct kv_lr_side *kv_lr_side(const struct kv_lowrank *lr, int64_t l, int which) {
    return which ? &lr->layers[l].v : &lr->layers[l].k;
}

#endif
