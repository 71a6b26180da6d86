/* Decomposition internals shared by calib/decompose*.c (internal).
 *
 * Every method reduces to the same objects. A *slot* is what gets one rank:
 * one or more units (KV heads head0.. of one layer's K or V) and the spectra
 * the allocation reads. Each unit has an orthonormal basis (the eigenvectors
 * of its allocation Gram matrix, columns in descending order) and a
 * reporting covariance C (the calibration second moment of what it
 * reconstructs). Keeping the first r basis columns V_r gives
 *   down = V_rᵀ W_u (+ V_rᵀ b_u),  up = V_r          (latent modes)
 *   rot  = V_rᵀ                                    (post-RoPE rotation)
 * and the predicted error Σ over dropped columns of vᵀ C v, which for the
 * whitened methods is exactly the sum of the dropped eigenvalues.
 *
 * The modules, in the order a run uses them:
 *   decompose_check.c    the option rules (kv_decompose_check, _check_model)
 *   decompose_slots.c    the bases: one slot list per method (build_slots)
 *   decompose_alloc.c    rank allocation: a parameter's ranks, the searches,
 *                        global greedy, LoRC conditions, Fisher scores
 *   decompose_budget.c   Eigen Attention's measured per-layer error budget
 *   decompose_factors.c  the factors of the chosen ranks (build_lowrank)
 *   decompose.c          the driver, kv_decompose
 *   decompose_records.c  the manifest's records and kv_decompose_write */
#ifndef KV_DECOMPOSE_CTX_H
#define KV_DECOMPOSE_CTX_H

#include <stdint.h>
#include <stdlib.h>

#include "kvcalib.h"

struct kv_dec_unit {
    int64_t head0, nh;
    const double *vec; /* [m, m] row-major, column j = basis vector j */
    double *cov;       /* [m, m] reporting covariance (owned) */
};

struct kv_dec_slot {
    int64_t layer;
    int side;     /* 0 = K, 1 = V */
    int rotation; /* post-RoPE key rotation */
    int64_t m, n_units, n_spec;
    double *lam;  /* [n_spec, m] descending, negatives clamped to 0 */
    double *vecs; /* owned bases, n_spec of them */
    struct kv_dec_unit *units;
    double energy; /* Σ of all spectra */
    double *tail;  /* [m+1]: Σ over spectra of λ_i for i >= r, relative to energy */
    double fisher, logcond;
    int skip;
    int64_t rank;
};

/* One run: the inputs, the slots of every layer and the time in LAPACK. */
struct kv_dec_ctx {
    const struct kv_model *m;
    const struct kv_stats *s;
    struct kv_decompose_opts *o;
    const char *const *names; /* how messages name the options (never NULL) */
    struct kv_dec_slot *slots;
    int64_t n_slots;
    double lapack_s;
    struct kv_err *err;
};

/* calloc of n (at least 1) elements. */
static inline void *kv_dec_calloc(int64_t n, size_t sz) {
    return calloc((size_t)(n > 0 ? n : 1), sz);
}

/* ---- decompose_check.c */

/* kv_decompose_check with the inputs' presence given: have_stats (a
 * statistics file or handle) and have_text (calibration text or tokens). */
int kv_dec_check_opts(const struct kv_decompose_opts *o, int have_stats, int have_text,
                      const char *const *names, struct kv_err *err);
/* names, or the quantity names when NULL. */
const char *const *kv_dec_names(const char *const *names);

/* ---- decompose_slots.c */

/* Every layer's slots, with their spectra, energies and tails. */
int kv_dec_build_slots(struct kv_dec_ctx *x);
void kv_dec_slots_free(struct kv_dec_slot *sl, int64_t n);
/* Gram W_u W_uᵀ of rows r0 .. r0+mm-1 of a [*, d] weight, into out [mm, mm]. */
int kv_dec_weight_gram(const float *w, int64_t r0, int64_t mm, int64_t d, double *out,
                       struct kv_err *err);
/* kv_la_eigh timed into x->lapack_s, negative eigenvalues set to 0. */
int kv_dec_eigh(struct kv_dec_ctx *x, const double *a, int64_t n, double *w, double *vec,
                const char *what);

/* ---- decompose_alloc.c */

/* r raised to min_rank and rounded up to rank_multiple, at most mm. */
int64_t kv_dec_round_rank(const struct kv_decompose_opts *o, int64_t r, int64_t mm);
/* KV bytes per token of every slot at its rank. */
int64_t kv_dec_total_bytes(const struct kv_dec_ctx *x);
/* Ranks of every slot for parameter t in [0, 1] (larger t keeps more). */
void kv_dec_param_ranks(struct kv_dec_ctx *x, enum kv_alloc a, double t);
/* Binary search of t for the smallest byte count that reaches target; sets
 * the ranks and returns t. */
double kv_dec_search_param(struct kv_dec_ctx *x, enum kv_alloc a, int64_t target);
/* Greedy ranks down to target bytes (target > 0) or a mean error of 1 - eps. */
void kv_dec_global_ranks(struct kv_dec_ctx *x, int64_t target, double eps);
/* LoRC eq. 12 per slot (logcond), and the --cond-skip layers marked skip. */
int kv_dec_lorc_conditions(struct kv_dec_ctx *x);
/* Per-slot Fisher scores, from o->fisher or the statistics. */
int kv_dec_fisher_scores(struct kv_dec_ctx *x);

/* ---- decompose_budget.c */

/* layer-budget ranks: at e_b = o->error_budget (target 0), or the largest
 * e_b whose cache reaches target bytes; sets o->param (and least_bytes). */
int kv_dec_layer_budget(struct kv_dec_ctx *x, int64_t target);

/* ---- decompose_factors.c */

/* The compressed model of the slots at their ranks (skipped slots stay full). */
int kv_dec_build_lowrank(struct kv_dec_ctx *x, struct kv_lowrank **out);

#endif
