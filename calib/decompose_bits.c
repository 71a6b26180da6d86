/* --kv-bits auto: every slot's rank and bands of bits chosen together
 * under the byte target (docs/design.md, "Rank and bits together").
 *
 * The model (docs/design.md has the derivation and its check). A slot keeps
 * its first r basis directions in bands [a, e) of strictly falling bits. A
 * band's n latents are rotated by kv_la_hadamard(n) (kv_lr_unit_hadamard)
 * and quantized per token over the band (lrmodel.h): step (max - min) /
 * (2^b - 1), rounding noise step²/12 on n - 2 of the n values (the token's
 * min and max are stored exactly). E[range²] is that of normals:
 * c(n_eff) λ_r, c(n) = E[range²] of n standard normals, λ_r the mean energy
 * of the first Hadamard block's directions after the band's first (whose
 * shift of the whole block the zero point absorbs), n_eff the values
 * counted by their variance over λ_r; with more than one block, the first
 * direction's energy past λ_r per value, ex, adds ex + √(2/π)·√(ex·that).
 * E[range²] scales with the token's variance, so the same holds for the
 * energies summed over tokens. The rotation is orthonormal, so each of the
 * band's directions j carries the noise per value, at a cost w_j per unit
 * of energy: w_j = c_j / Λ_j, with c_j what keeping direction j lowers
 * global's cost and Λ_j its latent energy (summed over the slot's units).
 * fp16 bands, and bands of one or two values, carry fp16's rounding,
 * 2^-22/3 of their energy. A configuration costs global's cost at its rank
 * plus its bands' noise, and takes n_units Σ kv_lr_unit_bytes(n, b) bytes
 * per token.
 *
 * The search. For a price μ per byte every slot's cheapest cost + μ bytes
 * is an exact dynamic program over (where the last band ends, its width);
 * μ is bisected for the target and the bytes left over go to the slots
 * whose next-cheaper choice buys the most cost per byte. The same search
 * held to one width gives each fixed width's choice at the same target;
 * of the six, the one of lowest measured KL on the calibration windows is
 * kept when there are some, else the one of lowest modelled cost. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decompose_ctx.h"
#include "err.h"
#include "lrmodel.h"

const int KV_DECOMPOSE_WIDTHS[KV_DECOMPOSE_N_WIDTHS] = {16, 8, 4, 3, 2};
#define NW KV_DECOMPOSE_N_WIDTHS
#define FP16_REL (0x1p-22 / 3.0) /* mean square of fp16's relative rounding */
#define START (-2)                 /* kv_dec_best_bands' arg of a first band */

/* ---- c(n) */

#define QH 0.05  /* quadrature step */
#define QN 281   /* points over x in [-7, 7] and r in [0, 14] */

static double phi_cdf(double z) { return 0.5 * erfc(-z / sqrt(2.0)); }

/* Simpson's weight of point i of QN (QN - 1 intervals, an even count) */
static double simpson(int i) { return i == 0 || i == QN - 1 ? 1.0 / 3 : (i & 1 ? 4.0 / 3 : 2.0 / 3); }

int kv_dec_range_sq(int64_t nmax, double *c) {
    /* P(R <= r) = n ∫ φ(x) (Φ(x + r) - Φ(x))^(n-1) dx and
     * E[R²] = ∫ 2r P(R > r) dr, both by Simpson's rule on a lattice
     * where x + r stays on it; log of the differences kept once */
    double *ld = malloc((size_t)QN * QN * sizeof *ld), *ph = malloc(QN * sizeof *ph);
    if (!ld || !ph) {
        free(ld), free(ph);
        return KV_ENOMEM;
    }
    for (int i = 0; i < QN; i++) {
        double x = -7.0 + QH * i;
        ph[i] = exp(-0.5 * x * x) / sqrt(2.0 * M_PI) * simpson(i) * QH;
        for (int k = 0; k < QN; k++) {
            double r = QH * k;
            /* upper tails where x > 0, so the difference keeps its digits */
            double dif = x > 0 ? phi_cdf(-x) - phi_cdf(-(x + r)) : phi_cdf(x + r) - phi_cdf(x);
            ld[i * QN + k] = dif > 0 ? log(dif) : -INFINITY;
        }
    }
    c[0] = 0;
    if (nmax >= 1) c[1] = 0;
    for (int64_t n = 2; n <= nmax; n++) {
        double e2 = 0;
        for (int k = 1; k < QN; k++) {
            double F = 0;
            for (int i = 0; i < QN; i++) F += ph[i] * exp((double)(n - 1) * ld[i * QN + k]);
            F *= (double)n;
            double tail = 1.0 - F > 0 ? 1.0 - F : 0;
            e2 += 2.0 * QH * k * tail * simpson(k) * QH;
        }
        c[n] = e2;
    }
    free(ld), free(ph);
    return KV_OK;
}

/* ---- one slot */

double kv_dec_band_noise(const double *c, const double *P, const double *W, const double *C,
                         int64_t a, int64_t e, int bits) {
    int64_t n = e - a;
    /* fp16 numbers, and a band of one or two values (its zero point and
     * top code), carry fp16's rounding; codes are read from the rounded
     * zero and scale, so a longer band's values carry its step's alone */
    if (bits >= 16 || n <= 2) return (C[e] - C[a]) * FP16_REL;
    int64_t p = (int64_t)1 << (63 - __builtin_clzll((unsigned long long)n));
    /* the band's first direction enters every value of the first block
     * alike (the Sylvester block's first row is constant), a shift the zero
     * point absorbs: the range is that of the block's other directions, at
     * their mean energy */
    double top = (P[a + p] - P[a + 1]) / (double)(p - 1), q = (double)((1 << bits) - 1);
    if (!(top > 0)) top = 0; /* no energy in the first block past its first direction */
    double r2 = 0;           /* E[range²] */
    if (top > 0) {
        /* the smaller blocks' values widen the range less: count each
         * rotated value by its variance over the first block's, n_eff in
         * [p, n], and read c between its neighbours */
        double neff = 1.0 + (P[e] - P[a + 1]) / top;
        neff = neff < (double)p ? (double)p : neff > (double)n ? (double)n : neff;
        int64_t k = (int64_t)neff;
        double cn = k >= n ? c[n] : c[k] + (neff - (double)k) * (c[k + 1] - c[k]);
        r2 = cn * top;
    }
    if (n > p) {
        /* with more blocks the first direction's shift s moves the first
         * block against the others: its energy beyond the others', per
         * value, widens the range by |s| on top of the rest (E|s| of a
         * normal s, and half the rest's range beside it) */
        double ex = (P[a + 1] - P[a] - top) / (double)p;
        if (ex > 0) r2 += ex + sqrt(2.0 / M_PI) * sqrt(ex * r2);
    }
    /* the row's min and max are stored exactly: n - 2 of n values round */
    double per = r2 / (12.0 * q * q) * (double)(n - 2) / (double)n;
    return per * (W[e] - W[a]);
}

double kv_dec_best_bands(const struct kv_dec_band_slot *sm, const double *c, double mu, unsigned mask,
                        double *dp, int64_t *arg, struct kv_dec_bands *out) {
    int64_t m = sm->m;
    for (int64_t i = 0; i < (m + 1) * NW; i++) dp[i] = INFINITY, arg[i] = -1;
    /* dp[e][w]: the best bands covering [0, e) whose last has width w;
     * arg = a * NW + the previous band's width v, the band being [a, e)
     * (START when it is the first, a = 0) */
    for (int64_t e = 1; e <= m; e++)
        for (int w = 0; w < NW; w++) {
            if (!(mask >> w & 1)) continue;
            int bits = KV_DECOMPOSE_WIDTHS[w];
            double best = INFINITY;
            int64_t barg = -1;
            for (int64_t a = 0; a < e; a++) {
                double add = kv_dec_band_noise(c, sm->P, sm->W, sm->C, a, e, bits) +
                             mu * (double)(sm->nu * kv_lr_unit_bytes(e - a, bits));
                if (a == 0) {
                    if (add < best) best = add, barg = START;
                    continue;
                }
                for (int v = 0; v < w; v++) { /* earlier bands have more bits */
                    double t = dp[a * NW + v] + add;
                    if (t < best) best = t, barg = a * NW + v;
                }
            }
            dp[e * NW + w] = best, arg[e * NW + w] = barg;
        }
    double best = INFINITY;
    int64_t be = -1;
    int bw = -1;
    for (int64_t e = sm->floor; e <= m; e++) {
        if (e % sm->mult && e != m) continue;
        for (int w = 0; w < NW; w++) {
            double t = dp[e * NW + w] + sm->T[e];
            if (t < best) best = t, be = e, bw = w;
        }
    }
    if (be < 0) return INFINITY;
    /* walk back, then put the bands in order */
    struct kv_lr_band rev[KV_LR_MAX_BANDS];
    int nb = 0;
    int64_t e = be;
    int w = bw;
    double noise = 0;
    int64_t bytes = 0;
    for (;;) {
        int64_t g = arg[e * NW + w], a = g == START ? 0 : g / NW;
        KV_ASSERT(nb < KV_LR_MAX_BANDS && (g == START || g >= NW));
        rev[nb++] = (struct kv_lr_band){e - a, KV_DECOMPOSE_WIDTHS[w]};
        noise += kv_dec_band_noise(c, sm->P, sm->W, sm->C, a, e, KV_DECOMPOSE_WIDTHS[w]);
        bytes += sm->nu * kv_lr_unit_bytes(e - a, KV_DECOMPOSE_WIDTHS[w]);
        if (g == START) break;
        e = a, w = (int)(g % NW);
    }
    out->rank = be, out->n_bands = nb, out->bytes = bytes, out->cost = sm->T[be] + noise;
    for (int i = 0; i < nb; i++) out->bands[i] = rev[nb - 1 - i];
    return best;
}

/* ---- the search */

struct search {
    struct kv_dec_ctx *x;
    struct kv_dec_band_slot *sm;
    const double *c;
    double *dp;
    int64_t *arg;
    int64_t fixed_bytes; /* skipped slots */
};

/* Every slot's choice at mu into ch; total bytes and cost. */
static void at_price(struct search *S, double mu, unsigned mask, struct kv_dec_bands *ch, int64_t *bytes,
                     double *cost) {
    *bytes = S->fixed_bytes, *cost = 0;
    for (int64_t i = 0; i < S->x->n_slots; i++) {
        if (S->sm[i].skip) continue;
        kv_dec_best_bands(&S->sm[i], S->c, mu, mask, S->dp, S->arg, &ch[i]);
        *bytes += ch[i].bytes, *cost += ch[i].cost;
    }
}

/* The choices for target bytes over the widths in mask into best (n_slots);
 * their modelled cost, INFINITY when even the highest price misses. */
static double search_target(struct search *S, int64_t target, unsigned mask, struct kv_dec_bands *best,
                            struct kv_dec_bands *other) {
    int64_t n = S->x->n_slots, bytes;
    double cost, all = 0;
    for (int64_t i = 0; i < n; i++)
        if (!S->sm[i].skip) all += S->sm[i].T[0];
    /* the cheapest choices at no price: when they fit, nothing to search */
    at_price(S, 0, mask, best, &bytes, &cost);
    if (bytes <= target) return cost;
    /* a bracket [lo, hi] of prices, hi's choices within the target and
     * lo's not: raise a price until it fits, then lower it until not */
    double hi = (all > 0 ? all : 1.0) / (double)(target > 0 ? target : 1), lo;
    int it = 0;
    for (at_price(S, hi, mask, best, &bytes, &cost); bytes > target && it < 200; it++)
        at_price(S, hi *= 4, mask, best, &bytes, &cost);
    if (bytes > target) return INFINITY;
    for (lo = hi / 4, it = 0; it < 200; it++, lo /= 4) {
        at_price(S, lo, mask, other, &bytes, &cost);
        if (bytes > target) break;
        hi = lo;
        memcpy(best, other, (size_t)n * sizeof *best);
    }
    for (it = 0; it < 50 && hi / lo > 1 + 1e-9; it++) {
        double mid = sqrt(lo * hi);
        at_price(S, mid, mask, other, &bytes, &cost);
        if (bytes <= target) {
            hi = mid;
            memcpy(best, other, (size_t)n * sizeof *best);
        } else {
            lo = mid;
        }
    }
    /* the bytes left: the slots' choices at the lower price, best cost per
     * byte first, while they fit */
    at_price(S, lo, mask, other, &bytes, &cost);
    int64_t used = S->fixed_bytes;
    for (int64_t i = 0; i < n; i++) used += S->sm[i].skip ? 0 : best[i].bytes;
    for (;;) {
        int64_t pick = -1;
        double gain = 0;
        for (int64_t i = 0; i < n; i++) {
            if (S->sm[i].skip) continue;
            int64_t db = other[i].bytes - best[i].bytes;
            double dc = best[i].cost - other[i].cost;
            if (db <= 0 || dc <= 0 || used + db > target) continue;
            if (dc / (double)db > gain) gain = dc / (double)db, pick = i;
        }
        if (pick < 0) break;
        used += other[pick].bytes - best[pick].bytes;
        best[pick] = other[pick];
    }
    double total = 0;
    for (int64_t i = 0; i < n; i++) total += S->sm[i].skip ? 0 : best[i].cost;
    return total;
}

static int model_slots(struct kv_dec_ctx *x, struct kv_dec_band_slot *sm, int64_t *fixed_bytes) {
    const struct kv_decompose_opts *o = x->o;
    int loss = kv_dec_loss_costs(x);
    double fmean = kv_dec_fisher_mean(x);
    *fixed_bytes = 0;
    for (int64_t i = 0; i < x->n_slots; i++) {
        const struct kv_dec_slot *sl = &x->slots[i];
        struct kv_dec_band_slot *s = &sm[i];
        int64_t m = sl->m;
        s->m = m, s->nu = sl->n_units, s->skip = sl->skip;
        s->floor = kv_dec_round_rank(o, 0, m);
        s->mult = o->rank_multiple > 0 ? o->rank_multiple : 1;
        if (sl->skip) {
            *fixed_bytes += sl->n_units * m * 2;
            continue;
        }
        s->P = kv_dec_calloc(4 * (m + 1), sizeof *s->P);
        if (!s->P) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        s->W = s->P + (m + 1), s->C = s->W + (m + 1), s->T = s->C + (m + 1);
        for (int64_t r = 0; r <= m; r++) s->T[r] = kv_dec_slot_cost(sl, r, loss, fmean);
        for (int64_t j = 0; j < m; j++) {
            double lam = 0;
            for (int64_t u = 0; u < sl->n_units; u++) lam += sl->units[u].lvar ? sl->units[u].lvar[j] : 0;
            double cj = s->T[j] - s->T[j + 1];
            cj = cj > 0 ? cj : 0;
            s->P[j + 1] = s->P[j] + lam;
            s->C[j + 1] = s->C[j] + cj;
            s->W[j + 1] = s->W[j] + (lam > 0 ? cj / lam : 0);
        }
    }
    return KV_OK;
}

/* The slots' ranks and bands from one choice per slot. */
static void set_slots(struct kv_dec_ctx *x, const struct kv_dec_bands *ch) {
    for (int64_t i = 0; i < x->n_slots; i++) {
        struct kv_dec_slot *sl = &x->slots[i];
        if (sl->skip) continue;
        sl->rank = ch[i].rank, sl->n_bands = ch[i].n_bands;
        memcpy(sl->bands, ch[i].bands, sizeof sl->bands);
    }
}

int kv_dec_auto_bits(struct kv_dec_ctx *x, int64_t target) {
    struct kv_decompose_opts *o = x->o;
    int64_t n = x->n_slots, mmax = 1;
    for (int64_t i = 0; i < n; i++) mmax = x->slots[i].m > mmax ? x->slots[i].m : mmax;
    struct kv_dec_band_slot *sm = kv_dec_calloc(n, sizeof *sm);
    struct kv_dec_bands *other = kv_dec_calloc(n, sizeof *other);
    /* cand[0]: the mix; cand[1 + w]: width w alone */
    struct kv_dec_bands *cand = kv_dec_calloc((NW + 1) * n, sizeof *cand);
    double *c = kv_dec_calloc(mmax + 1, sizeof *c), *dp = kv_dec_calloc((mmax + 1) * NW, sizeof *dp);
    int64_t *arg = kv_dec_calloc((mmax + 1) * NW, sizeof *arg);
    int rc = KV_OK;
    if (!sm || !other || !cand || !c || !dp || !arg || kv_dec_range_sq(mmax, c)) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    struct search S = {x, sm, c, dp, arg, 0};
    if ((rc = model_slots(x, sm, &S.fixed_bytes))) goto done;
    double obj[NW + 1], kl[NW + 1];
    obj[0] = search_target(&S, target, (1u << NW) - 1, cand, other);
    for (int w = 0; w < NW; w++)
        o->objective_fixed[w] = obj[1 + w] = search_target(&S, target, 1u << w, cand + (1 + w) * n, other);
    /* measured on the calibration windows when there are some, else the
     * model's cost: the lowest of the mix and the five widths */
    int probe = o->calib_tokens && o->calib_windows > 0 && o->seq_len >= 2, pick = -1;
    for (int k = 0; k <= NW && !rc; k++) {
        kl[k] = INFINITY;
        if (!isfinite(obj[k])) continue;
        if (probe) {
            set_slots(x, cand + k * n);
            rc = kv_dec_probe_kl(x, &kl[k]);
        }
        double score = probe ? kl[k] : obj[k];
        double now = pick < 0 ? INFINITY : probe ? kl[pick] : obj[pick];
        if (!rc && score < now) pick = k;
    }
    if (!rc && pick < 0) /* check_floor keeps this from happening */
        rc = kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET, "no bits reach the byte target");
    if (rc) goto done;
    set_slots(x, cand + pick * n);
    o->objective = obj[pick], o->objective_mix = obj[0];
    o->fixed_kept = pick ? KV_DECOMPOSE_WIDTHS[pick - 1] : 0;
    o->probed = probe;
    o->probe_kl = probe ? kl[0] : 0;
    for (int w = 0; w < NW; w++) o->probe_kl_fixed[w] = probe ? kl[1 + w] : 0;
done:
    for (int64_t i = 0; sm && i < n; i++) free(sm[i].P);
    free(sm), free(other), free(cand), free(c), free(dp), free(arg);
    return rc;
}
