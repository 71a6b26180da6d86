/* The compressed-attention description, inside (internal to the library
 * layers: lib, formats, calib and kernels read and build it; programs use
 * the accessors of kvcal_core.h).
 *
 * Factors are in weight layout ([out, in], as HF stores a linear) and
 * float32; every pointer is owned by the struct and freed by kv_lr_free. */
#ifndef KV_LRMODEL_H
#define KV_LRMODEL_H

#include "kvcal_core.h"

/* One unit: KV heads head0 .. head0+n_heads-1 of one layer's K or V, with
 * one rank. Weight-layout factors ([out, in], as HF stores a linear):
 *   down [rank, d], down_bias [rank] or NULL:  z = x downᵀ + down_bias
 *   up   [n_heads*d_h, rank]:                  y = z upᵀ
 *   rot  [rank, d_h] (postrope_rotation only): z_j = k_j rotᵀ for the one
 *        KV head j of the unit, and q'_i = q_i rotᵀ for its query heads.
 * energy and dropped are calibration sums (Σ over tokens of squared norms in
 * the unit's metric); dropped/energy is the predicted relative error. */
struct kv_lr_unit {
    int64_t head0, n_heads;
    int64_t rank;
    double energy, dropped;
    float *down, *down_bias, *up, *rot;
};

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


/* Layer l's keys (which 0) or values (which 1). */
static inline struct kv_lr_side *kv_lr_side(const struct kv_lowrank *lr, int64_t l, int which) {
    return which ? &lr->layers[l].v : &lr->layers[l].k;
}

#endif
