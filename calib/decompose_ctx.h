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
 *   decompose_metric.c   the metrics of the output- and loss-aware bases
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
    /* output- and loss-aware bases: S = M^½ and S⁻¹ of the unit's metric
     * (owned; NULL for the plain metric). vec and cov are then of the
     * whitened output S y, and the factors are down = V_rᵀ S W_u,
     * up = S⁻¹ V_r. */
    double *msqrt, *misqrt;
    /* what --eps reads (docs/design.md, "What eps means"): var, the unit's
     * calibration variance Σ‖y - μ‖² in plain output units (its energy for
     * post-RoPE rotation keys, whose mean the statistics do not hold, and
     * for weight-only units without statistics), and err [m+1], the plain
     * squared error Σ‖y - ŷ‖² of the factors at each rank (the mean's own
     * error included when they are not centred). */
    double var;
    double *err;
    /* [m]: latent j's calibration energy u_jᵀ G u_j (G = cov), what
     * --kv-bits auto's quantization model reads as its range */
    double *lvar;
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
    /* [m+1] with Fisher statistics (NULL otherwise, and for post-RoPE
     * rotation keys): the predicted loss of rank r, Σ over units and
     * dropped directions j of var_j · d_jᵀ F d_j / N, d_j the direction in
     * plain output space (S⁻¹u_j with a metric), var_j its calibration
     * energy, F the unit's gradient Gram (docs/design.md, "Global
     * allocation against uniform"). */
    double *ltail;
    double fisher, logcond;
    int skip;
    int64_t rank;
    /* --kv-bits auto: the bands of the rank (their n add up to it) */
    int n_bands;
    struct kv_lr_band bands[KV_LR_MAX_BANDS];
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
    double *turns; /* kv_dec_rope_turns of the model, made once on first use */
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

/* Output covariances of every head of `which` (0 K, 1 V, 2 Q) as blocks of
 * `block` heads, centred for K and V with o->center, [heads/block][block*d_h]²
 * in a malloc'd *out; weight Grams without statistics. */
int kv_dec_out_covs(struct kv_dec_ctx *x, int64_t l, int which, int64_t block, double **out);

/* ---- decompose_metric.c */

/* M_j = Σ over KV head j's query heads i of O_iᵀ O_i, out [d_h, d_h]. */
int kv_dec_o_gram(const struct kv_model *m, int64_t l, int64_t j, double *out, struct kv_err *err);
/* The turn averages kv_dec_rope_average reads, for c's rope over windows
 * of T (malloc'd; NULL when out of memory). */
double *kv_dec_rope_turns(const struct kv_config *c, int64_t T);
/* M = Σ_t w_t Dᵀ_t C D_t / Σ_t w_t over t = 0 .. T-1 with w_t = T - t, D_t
 * the rope turn of -t (times c's rope scale, on the rotated pairs only):
 * the pre-RoPE query covariance C as seen by a key t positions back.
 * turns from kv_dec_rope_turns(c, T). KV_ENOMEM or KV_OK. */
int kv_dec_rope_average(const struct kv_config *c, int64_t T, const double *turns, const double *C,
                        double *M);
/* The metric of every KV head of layer l's side for o->basis (output or
 * loss), out [g][d_h][d_h], per token. */
int kv_dec_head_metrics(struct kv_dec_ctx *x, int64_t l, int side, double *out);
/* S = M^½ and S⁻¹ of the n×n metric M (eigenvalues under 1e-10 of the
 * largest floored there); KV_ENUMERIC when M is zero. */
int kv_dec_metric_sqrt(struct kv_dec_ctx *x, const double *M, int64_t n, double *S, double *Sinv,
                       const char *what);

/* ---- decompose_alloc.c */

/* The smallest rank at which every unit of the slot explains the fraction
 * eps of its variance, err[r] <= (1 - eps) var (eps >= 1: full rank),
 * before kv_dec_round_rank. */
int64_t kv_dec_eps_rank(const struct kv_dec_slot *sl, double eps);
/* r raised to min_rank and rounded up to rank_multiple, at most mm. */
int64_t kv_dec_round_rank(const struct kv_decompose_opts *o, int64_t r, int64_t mm);
/* KV bytes per token of every slot at its rank. */
int64_t kv_dec_total_bytes(const struct kv_dec_ctx *x);
/* Ranks of every slot for parameter t in [0, 1] (larger t keeps more). */
void kv_dec_param_ranks(struct kv_dec_ctx *x, enum kv_alloc a, double t);
/* Binary search of t for the smallest byte count that reaches target; sets
 * the ranks and returns t. */
double kv_dec_search_param(struct kv_dec_ctx *x, enum kv_alloc a, int64_t target);
/* global's calibration objective at the slots' ranks: Σ over slots of the
 * predicted loss (ltail) when every slot has one, else of the relative
 * dropped error weighted by the slot's Fisher score over the mean (1
 * without scores). */
double kv_dec_objective(const struct kv_dec_ctx *x);
/* Whether every slot has its predicted loss (ltail), global's cost then. */
int kv_dec_loss_costs(const struct kv_dec_ctx *x);
/* The mean Fisher score of the slots (0 without scores). */
double kv_dec_fisher_mean(const struct kv_dec_ctx *x);
/* A slot's cost at rank r in global's objective: ltail[r] with loss, else
 * tail[r] weighted by its Fisher score over fmean (1 when fmean is 0). */
double kv_dec_slot_cost(const struct kv_dec_slot *sl, int64_t r, int loss, double fmean);
/* Greedy ranks down to target bytes (target > 0) or a mean error of 1 - eps. */
void kv_dec_global_ranks(struct kv_dec_ctx *x, int64_t target, double eps);
/* LoRC eq. 12 per slot (logcond), and the --cond-skip layers marked skip. */
int kv_dec_lorc_conditions(struct kv_dec_ctx *x);
/* Per-slot Fisher scores, from o->fisher or the statistics. */
int kv_dec_fisher_scores(struct kv_dec_ctx *x);

/* ---- decompose.c */

/* The mean KL(base ‖ compressed) per token of the slots at their ranks
 * (and bands) on the calibration windows o->calib_tokens. */
int kv_dec_probe_kl(struct kv_dec_ctx *x, double *kl);

/* ---- decompose_bits.c */

/* c[n] = E[(max - min)²] of n independent standard normals, n = 0 ..
 * nmax (c[0] = c[1] = 0), by quadrature. KV_ENOMEM or KV_OK (no message). */
int kv_dec_range_sq(int64_t nmax, double *c);
/* The modelled cost of quantizing directions [a, e) of a slot as one band
 * of bits (16: fp16 rounding), from c (kv_dec_range_sq) and the prefix
 * sums P of the directions' latent energies, W of their cost per unit of
 * energy and C of their costs (decompose_bits.c says how). */
double kv_dec_band_noise(const double *c, const double *P, const double *W, const double *C,
                         int64_t a, int64_t e, int bits);
/* One slot as --kv-bits auto models it: m directions over nu units, the
 * ranks it may take (>= floor, a multiple of mult or m), prefix sums
 * [m+1] of the directions' latent energies P, costs per unit of energy W
 * and costs C, and global's cost T[r] at rank r. */
struct kv_dec_band_slot {
    int64_t m, nu, floor, mult;
    int skip;
    double *P, *W, *C, *T;
};
/* A slot's choice: its rank in bands, their bytes per token (all units)
 * and modelled cost. */
struct kv_dec_bands {
    int64_t rank, bytes;
    double cost;
    int n_bands;
    struct kv_lr_band bands[KV_LR_MAX_BANDS];
};
/* The slot's cheapest cost + mu * bytes over the widths in mask (bit w for
 * KV_DECOMPOSE_WIDTHS[w]), an exact dynamic program, into *out; dp and arg
 * hold (m+1) * KV_DECOMPOSE_N_WIDTHS entries. Returns that minimum,
 * INFINITY when no allowed rank exists. */
double kv_dec_best_bands(const struct kv_dec_band_slot *sm, const double *c, double mu,
                         unsigned mask, double *dp, int64_t *arg, struct kv_dec_bands *out);
/* --kv-bits auto: every slot's rank and bands for target bytes (> 0): the
 * mix and each single width's choice by the model (o->objective,
 * objective_fixed), the lowest kept; with calibration tokens the lowest
 * measured KL on them instead (probed, probe_kl, probe_kl_fixed); the
 * width kept alone in fixed_kept. */
int kv_dec_auto_bits(struct kv_dec_ctx *x, int64_t target);

/* ---- decompose_budget.c */

/* layer-budget ranks: at e_b = o->error_budget (target 0), or the largest
 * e_b whose cache reaches target bytes; sets o->param (and least_bytes). */
int kv_dec_layer_budget(struct kv_dec_ctx *x, int64_t target);

/* ---- decompose_factors.c */

/* The compressed model of the slots at their ranks (skipped slots stay full). */
int kv_dec_build_lowrank(struct kv_dec_ctx *x, struct kv_lowrank **out);

#endif
