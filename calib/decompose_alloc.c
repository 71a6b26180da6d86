/* Rank allocation: the ranks of every slot for one parameter of an
 * allocation, the search of that parameter for a byte target, the global
 * greedy, and what the allocations read besides the spectra (LoRC's
 * condition numbers, Fisher scores). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "decompose_ctx.h"
#include "err.h"
#include "kvstats.h"
#include "linalg.h"
#include "lrmodel.h"
#include "model.h"

int64_t kv_dec_round_rank(const struct kv_decompose_opts *o, int64_t r, int64_t mm) {
    int64_t mult = o->rank_multiple > 0 ? o->rank_multiple : 1;
    int64_t floor = o->min_rank > 0 ? o->min_rank : 1;
    if (r < floor) r = floor;
    if (r >= mm || mult >= mm) return mm;
    r = (r + mult - 1) / mult * mult;
    return r > mm ? mm : r;
}

/* Smallest k >= 1 whose dropped tail of singular values σ_k.. is at most
 * rho of their sum (ZACK eq. 6, FDC eq. 1). */
static int64_t removal_rank(const double *lam, int64_t mm, double rho) {
    double tot = 0;
    for (int64_t i = 0; i < mm; i++) tot += sqrt(lam[i]);
    if (tot <= 0) return 1;
    double tail = 0;
    int64_t k = mm;
    for (int64_t i = mm - 1; i >= 1; i--) {
        tail += sqrt(lam[i]);
        if (tail > rho * tot) break;
        k = i;
    }
    return k;
}

int64_t kv_dec_eps_rank(const struct kv_dec_slot *sl, double eps) {
    if (eps >= 1.0) return sl->m;
    int64_t r = 0;
    for (int64_t u = 0; u < sl->n_units; u++) {
        const struct kv_dec_unit *un = &sl->units[u];
        double allow = (1.0 - eps) * un->var;
        int64_t ru = sl->m;
        while (ru > 0 && un->err[ru - 1] <= allow) ru--;
        r = ru > r ? ru : r;
    }
    return r;
}

static int64_t slot_bytes(const struct kv_dec_slot *sl, int64_t rank, int bits) {
    if (sl->skip) return sl->n_units * sl->m * 2;
    if (bits == KV_DECOMPOSE_BITS_AUTO) /* the slot's bands (kv_dec_auto_bits) */
        return sl->n_units * kv_lr_bands_bytes(sl->bands, sl->n_bands);
    return sl->n_units * kv_lr_unit_bytes(rank, bits);
}

int64_t kv_dec_total_bytes(const struct kv_dec_ctx *x) {
    int64_t b = 0;
    for (int64_t i = 0; i < x->n_slots; i++)
        b += slot_bytes(&x->slots[i], x->slots[i].rank, x->o->kv_bits);
    return b;
}

/* Ranks of every slot for parameter t in [0, 1] (larger t keeps more). */
void kv_dec_param_ranks(struct kv_dec_ctx *x, enum kv_alloc a, double t) {
    const struct kv_decompose_opts *o = x->o;
    double maxlog = -INFINITY, minlog = INFINITY, ftot = 0, wtot = 0;
    for (int64_t i = 0; i < x->n_slots; i++) {
        const struct kv_dec_slot *sl = &x->slots[i];
        maxlog = fmax(maxlog, sl->logcond), minlog = fmin(minlog, sl->logcond);
        ftot += sl->fisher;
        wtot += (double)(sl->m * sl->n_units);
    }
    for (int64_t i = 0; i < x->n_slots; i++) {
        struct kv_dec_slot *sl = &x->slots[i];
        int64_t mm = sl->m, r = mm;
        switch (a) {
        case KV_ALLOC_EPS:
        case KV_ALLOC_LAYER_BUDGET: r = kv_dec_eps_rank(sl, t); break;
        case KV_ALLOC_UNIFORM: r = (int64_t)llround(t * (double)mm); break;
        case KV_ALLOC_REMOVAL:
            r = 0;
            for (int64_t k = 0; k < sl->n_spec; k++) {
                int64_t rk = removal_rank(sl->lam + k * mm, mm, 1.0 - t);
                r = rk > r ? rk : r;
            }
            break;
        case KV_ALLOC_FISHER: {
            /* the total width t·Σm shared in proportion to Fisher; clamped
             * units give their excess back to the rest (water filling) */
            r = (int64_t)llround(t * wtot * sl->fisher / (ftot > 0 ? ftot : 1) / (double)sl->n_units);
            break;
        }
        case KV_ALLOC_PROGRESSIVE: {
            double dmax = o->d_max > 0 ? o->d_max : 1.0, dmin = t * dmax;
            double span = maxlog - minlog, frac = dmax;
            if (span > 0) frac = dmax * (1.0 - (maxlog - sl->logcond) / span * (1.0 - dmin / dmax));
            r = (int64_t)llround(frac * (double)mm);
            break;
        }
        default: KV_ASSERT(0);
        }
        sl->rank = kv_dec_round_rank(o, r, mm);
    }
    if (a == KV_ALLOC_FISHER) {
        /* water filling: hand the width lost to clamping at m to unclamped slots */
        for (int it = 0; it < 8; it++) {
            double spare = 0, fopen = 0;
            for (int64_t i = 0; i < x->n_slots; i++) {
                struct kv_dec_slot *sl = &x->slots[i];
                double want = t * wtot * sl->fisher / (ftot > 0 ? ftot : 1) / (double)sl->n_units;
                if (want > (double)sl->m) spare += (want - (double)sl->m) * (double)sl->n_units;
                else fopen += sl->fisher;
            }
            if (spare <= 0.5 || fopen <= 0) break;
            for (int64_t i = 0; i < x->n_slots; i++) {
                struct kv_dec_slot *sl = &x->slots[i];
                double want = t * wtot * sl->fisher / (ftot > 0 ? ftot : 1) / (double)sl->n_units;
                if (want >= (double)sl->m) continue;
                want += spare * sl->fisher / fopen / (double)sl->n_units;
                sl->rank = kv_dec_round_rank(o, (int64_t)llround(want), sl->m);
            }
            break;
        }
    }
}

/* Binary search of t for the smallest byte count that reaches target. */
double kv_dec_search_param(struct kv_dec_ctx *x, enum kv_alloc a, int64_t target) {
    double lo = 0, hi = 1;
    for (int it = 0; it < 60; it++) {
        double mid = 0.5 * (lo + hi);
        kv_dec_param_ranks(x, a, mid);
        if (kv_dec_total_bytes(x) >= target) hi = mid;
        else lo = mid;
    }
    kv_dec_param_ranks(x, a, hi);
    return hi;
}

/* Whether every slot has its predicted loss (Fisher statistics, no
 * rotation keys): then global's cost is that loss, in one unit for keys,
 * values and every layer. */
int kv_dec_loss_costs(const struct kv_dec_ctx *x) {
    for (int64_t i = 0; i < x->n_slots; i++)
        if (!x->slots[i].ltail) return 0;
    return x->n_slots > 0;
}

/* A slot's cost at rank r in global's objective: its predicted loss with
 * loss_costs; else its relative error weighted by its Fisher score over
 * the mean score (1 without scores). */
double kv_dec_slot_cost(const struct kv_dec_slot *sl, int64_t r, int loss, double fmean) {
    if (loss) return sl->ltail[r];
    return sl->tail[r] * (fmean > 0 ? sl->fisher / fmean : 1.0);
}

double kv_dec_fisher_mean(const struct kv_dec_ctx *x) {
    double fmean = 0;
    for (int64_t i = 0; i < x->n_slots; i++) fmean += x->slots[i].fisher / (double)x->n_slots;
    return fmean;
}

double kv_dec_objective(const struct kv_dec_ctx *x) {
    double fmean = kv_dec_fisher_mean(x), obj = 0;
    int loss = kv_dec_loss_costs(x);
    for (int64_t i = 0; i < x->n_slots; i++) {
        const struct kv_dec_slot *sl = &x->slots[i];
        if (!sl->skip) obj += kv_dec_slot_cost(sl, sl->rank, loss, fmean);
    }
    return obj;
}

/* The next rank below a slot's that saves bytes: the largest multiple of
 * mult under it, and lower while the packed codes of quantized latents
 * take as many bytes (at 4 bits ranks 2k and 2k - 1 both take k); -1 at
 * the floor. */
static int64_t next_rank_down(const struct kv_dec_slot *sl, int64_t floor, int64_t mult, int bits) {
    int64_t now = slot_bytes(sl, sl->rank, bits);
    for (int64_t r2 = (sl->rank - 1) / mult * mult; r2 >= floor && r2 >= 1; r2 = (r2 - 1) / mult * mult)
        if (slot_bytes(sl, r2, bits) < now) return r2;
    return -1;
}

/* kvcal's global strategy: from full rank, repeatedly take the rank step
 * with the least cost per byte saved (slot_cost: the predicted loss with
 * Fisher statistics, else the weighted relative error), until the byte
 * target is met (target > 0) or the cost would pass 1 - eps of its value
 * at rank 0. */
void kv_dec_global_ranks(struct kv_dec_ctx *x, int64_t target, double eps) {
    const struct kv_decompose_opts *o = x->o;
    int64_t mult = o->rank_multiple > 0 ? o->rank_multiple : 1;
    int64_t floor = o->min_rank > 0 ? o->min_rank : 1;
    double fmean = kv_dec_fisher_mean(x);
    int loss = kv_dec_loss_costs(x);
    /* with eps: stop where the cost passes 1 - eps of every slot's cost at
     * rank 0 (for relative errors, the weighted mean error passes 1 - eps) */
    double cost = 0, all = 0;
    for (int64_t i = 0; i < x->n_slots; i++) {
        x->slots[i].rank = x->slots[i].m;
        all += kv_dec_slot_cost(&x->slots[i], 0, loss, fmean);
    }
    if (!(all > 0)) all = 1;
    int64_t bytes = kv_dec_total_bytes(x);
    for (;;) {
        if (target > 0 && bytes <= target) break;
        int64_t best = -1;
        double best_score = INFINITY, best_derr = 0;
        int64_t best_r2 = 0;
        for (int64_t i = 0; i < x->n_slots; i++) {
            struct kv_dec_slot *sl = &x->slots[i];
            int64_t r2 = next_rank_down(sl, floor, mult, (int)o->kv_bits);
            if (r2 < 0) continue;
            double derr = kv_dec_slot_cost(sl, r2, loss, fmean) - kv_dec_slot_cost(sl, sl->rank, loss, fmean);
            int64_t db = slot_bytes(sl, sl->rank, o->kv_bits) - slot_bytes(sl, r2, o->kv_bits);
            double score = derr / (double)db;
            if (best < 0 || score < best_score) best_score = score, best = i, best_derr = derr, best_r2 = r2;
        }
        if (best < 0) break;
        if (target <= 0 && (cost + best_derr) / all > 1.0 - eps + 1e-15) break;
        struct kv_dec_slot *sl = &x->slots[best];
        bytes -= slot_bytes(sl, sl->rank, o->kv_bits) - slot_bytes(sl, best_r2, o->kv_bits);
        cost += best_derr;
        sl->rank = best_r2;
    }
}

/* LoRC eq. 12: log of the cumulative condition numbers of W_k, W_v from
 * this layer to the last, from the singular values of the weights. */
int kv_dec_lorc_conditions(struct kv_dec_ctx *x) {
    const struct kv_config *c = &x->m->cfg;
    int64_t L = c->n_layers, d = c->dim, kd = c->n_kv_heads * c->head_dim;
    double *logk = kv_dec_calloc(L, sizeof *logk), *g = kv_dec_calloc(kd * kd, sizeof *g);
    double *w = kv_dec_calloc(kd, sizeof *w), *v = kv_dec_calloc(kd * kd, sizeof *v);
    int rc = KV_OK;
    if (!logk || !g || !w || !v) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    for (int64_t l = 0; l < L && !rc; l++)
        for (int side = 0; side < 2 && !rc; side++) {
            if ((rc = kv_dec_weight_gram(kv_model_weight(x->m, side ? KV_W_V : KV_W_K, l), 0, kd, d, g, x->err)))
                break;
            char what[64];
            snprintf(what, sizeof what, "layer %lld %s weight", (long long)l, side ? "v" : "k");
            if ((rc = kv_dec_eigh(x, g, kd, w, v, what))) break;
            /* κ = σ_max/σ_min = sqrt(λ_max/λ_min); a singular W counts as 1e300 */
            double lmin = w[kd - 1] > 0 ? w[kd - 1] : w[0] * 1e-300;
            logk[l] += w[0] > 0 ? 0.5 * log(w[0] / lmin) : 0;
        }
    for (int64_t l = L - 2; l >= 0 && !rc; l--) logk[l] += logk[l + 1];
    for (int64_t i = 0; i < x->n_slots && !rc; i++) {
        struct kv_dec_slot *sl = &x->slots[i];
        sl->logcond = logk[sl->layer];
        if (x->o->cond_skip > 0 && logk[sl->layer] / log(10.0) > x->o->cond_skip) sl->skip = 1;
    }
done:
    free(logk), free(g), free(w), free(v);
    return rc;
}

/* Per-slot Fisher scores: o->fisher when given, else from the statistics,
 * Palu §3.3: Σ of fisher_k (or fisher_v) over the output rows of the slot's
 * units (its KV heads × d_h). */
int kv_dec_fisher_scores(struct kv_dec_ctx *x) {
    const struct kv_stats *s = x->s;
    KV_ASSERT(x->o->fisher || (s && s->info.has_fisher)); /* kv_decompose_check_model */
    int64_t dh = x->m->cfg.head_dim;
    for (int64_t i = 0; i < x->n_slots; i++) {
        const struct kv_dec_slot *sl = &x->slots[i];
        double f = 0;
        if (x->o->fisher) {
            f = x->o->fisher[i];
        } else {
            const struct kv_stats_layer *L = &s->layers[sl->layer];
            const double *rows = sl->side ? L->fisher_v : L->fisher_k;
            for (int64_t u = 0; u < sl->n_units; u++) {
                const struct kv_dec_unit *un = &sl->units[u];
                for (int64_t r = un->head0 * dh; r < (un->head0 + un->nh) * dh; r++) f += rows[r];
            }
        }
        if (!isfinite(f) || f < 0)
            return kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "fisher score %lld (layer %lld %s) is %g, expected a finite value >= 0",
                           (long long)i, (long long)sl->layer, sl->side ? "v" : "k", f);
        x->slots[i].fisher = f;
    }
    return KV_OK;
}
