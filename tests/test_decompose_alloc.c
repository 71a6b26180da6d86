/* Rank allocation of kv_decompose:
 *
 *   decompose_alloc     every allocation against its defining rule, recomputed
 *                       from eigenvalues / singular values computed here. */
#include "decompose_fixtures.h"

/* ================================================================ allocation */

struct alloc_env {
    struct shared sh;
    struct kv_stats *s;
};

static struct alloc_env alloc_env_656K(void) {
    struct alloc_env e;
    e.sh = open_shared(1);
    e.s = collect(e.sh.m, e.sh.tok, SEQ, CAL_WINDOWS);
    return e;
}

static void alloc_env_free(struct alloc_env *e) {
    kv_stats_free(e->s);
    shared_free(&e->sh);
}

/* Ranks of every unit in slot order (layer, K units, V units). */
static int64_t unit_ranks(const struct kv_lowrank *lr, int64_t *out) {
    int64_t n = 0;
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            for (int64_t u = 0; u < sd->n_units; u++) out[n++] = sd->units[u].rank;
        }
    return n;
}

/* With --ratio R the target is T = round(R·base) bytes. The byte count is a
 * step function of the allocation's parameter; a byte step of the search is
 * at most J, the bytes that one threshold adds:
 *   uniform  every unit of equal width moves at the same threshold, each by
 *            one rank-multiple step: J = Σ_units kv_lr_unit_bytes step
 *            = n_units · 2 · rank_multiple at 16 bits; the search returns the
 *            smallest count >= T, and the count below it is <= T − 1, so
 *            T <= bytes <= T − 1 + J;
 *   global   each greedy step lowers one slot (here one unit) by one
 *            rank-multiple step, J = 2 · rank_multiple; it stops at the first
 *            count <= T, the one before being >= T + 1, so T + 1 − J <= bytes <= T.
 * With |T − R·base| <= 1/2: |bytes/base − R| <= (J − 1/2)/base. */
Test(decompose_alloc, ratio_is_reached_within_one_rank_step, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t base = kv_lr_base_bytes(c), dh = c->head_dim;
    cr_assert_eq(base, c->n_layers * 2 * c->n_kv_heads * dh * 2);
    int64_t n_units = c->n_layers * 2 * c->n_kv_heads;
    enum kv_alloc allocs[] = {KV_ALLOC_UNIFORM, KV_ALLOC_GLOBAL};
    int64_t mults[] = {1, 4};
    double ratios[] = {0.3, 0.55, 0.7};
    for (int ai = 0; ai < 2; ai++)
        for (int mi = 0; mi < 2; mi++)
            for (int ri = 0; ri < 3; ri++) {
                double R = ratios[ri];
                int64_t mult = mults[mi], T = llround(R * (double)base);
                struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, allocs[ai], 0, R, 1);
                o.rank_multiple = mult;
                char what[96];
                snprintf(what, sizeof what, "%s ratio %g rank-multiple %lld", kv_alloc_name(allocs[ai]),
                         R, (long long)mult);
                struct kv_lowrank *lr = decompose_ok(e.sh.m, e.s, o, what);
                int64_t bytes = kv_lr_bytes(lr, 16);
                cr_assert_eq(bytes, bytes_by_definition(lr, 16), "%s", what);
                int64_t ranks[64], nr = unit_ranks(lr, ranks);
                cr_assert_eq(nr, n_units);
                for (int64_t i = 0; i < nr; i++)
                    cr_assert(ranks[i] % mult == 0 || ranks[i] == dh, "%s: rank %lld", what,
                              (long long)ranks[i]);
                int64_t J;
                if (allocs[ai] == KV_ALLOC_UNIFORM) {
                    J = n_units * 2 * mult;
                    cr_assert(bytes >= T && bytes <= T - 1 + J, "%s: %lld bytes, target %lld, J %lld",
                              what, (long long)bytes, (long long)T, (long long)J);
                    /* exactly: the smallest admissible common rank reaching T */
                    int64_t r = admissible(1, 1, mult, dh);
                    while (n_units * 2 * r < T && r < dh) r = admissible(r + 1, 1, mult, dh);
                    for (int64_t i = 0; i < nr; i++)
                        cr_assert_eq(ranks[i], r, "%s: unit %lld rank %lld, expected %lld", what,
                                     (long long)i, (long long)ranks[i], (long long)r);
                } else {
                    J = 2 * mult;
                    cr_assert(bytes <= T && bytes >= T + 1 - J, "%s: %lld bytes, target %lld, J %lld",
                              what, (long long)bytes, (long long)T, (long long)J);
                }
                double achieved = (double)bytes / (double)base;
                cr_assert_leq(fabs(achieved - R), ((double)J - 0.5) / (double)base,
                              "%s: achieved %g", what, achieved);
                kv_lr_free(lr);
            }
    alloc_env_free(&e);
}

/* eps: each unit keeps at least eps of its output energy, with the smallest
 * rank that does (palu: the allocation spectrum is the reported metric). */
static void check_eps(const struct kv_model *m, const struct kv_stats *s, double eps,
                      const char *model) {
    const struct kv_config *c = kv_model_config(m);
    int64_t dh = c->head_dim;
    struct kv_lowrank *lr = decompose_ok(m, s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, eps, 0, 1), "eps");
    int64_t compressed = 0;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                double *C = out_cov_naive(s, m, l, side, un->head0, 1), *lam = eigvals(C, dh);
                double tot = sum_from(lam, dh, 0), r = (double)un->rank;
                /* the error Σ_{j>=r} λ_j of the uncentred factors, within
                 * (1 - eps) of the variance, and not one latent fewer */
                double var = out_var_naive(s, m, l, side, un->head0, 1), allow = (1 - eps) * var;
                cr_assert_leq(sum_from(lam, dh, un->rank), allow * (1 + 1e-12) + 1e-12 * tot,
                              "%s eps %g: layer %lld %s unit %lld explains %.9g of the variance", model,
                              eps, (long long)l, side ? "v" : "k", (long long)u,
                              1 - sum_from(lam, dh, un->rank) / var);
                if (un->rank > 1)
                    cr_assert_gt(sum_from(lam, dh, un->rank - 1), allow * (1 - 1e-12),
                                 "%s eps %g: layer %lld %s unit %lld: rank %g is not the smallest",
                                 model, eps, (long long)l, side ? "v" : "k", (long long)u, r);
                cr_assert_geq(1 - un->dropped / un->energy, eps - 1e-9, "%s: reported kept %.9g < eps %g",
                              model, 1 - un->dropped / un->energy, eps);
                double want = sum_from(lam, dh, un->rank);
                kvt_assert_close_f64(&un->dropped, &want, 1, 1e-10 * tot, 1e-7, "eps dropped");
                compressed += un->rank < dh;
                free(C), free(lam);
            }
        }
    cr_assert_gt(compressed, 0, "%s eps %g compresses nothing", model, eps);
    kv_lr_free(lr);
}

Test(decompose_alloc, eps_explains_the_variance_with_the_smallest_rank, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    check_eps(e.sh.m, e.s, 0.8, "656K");
    check_eps(e.sh.m, e.s, 0.95, "656K");
    alloc_env_free(&e);
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 61);
    int32_t *tok = random_tokens(3 * 64, 97, 62);
    struct kv_stats *s = collect(m, tok, 64, 3);
    check_eps(m, s, 0.9, "random + bias");
    kv_stats_free(s);
    free(tok);
    kv_model_close(m);
}

/* The allocation Gram of a removal unit, built here from the sums and weights:
 * fdc/zack keys Σ_{i→j} q_rope_i + k_rope_j, fdc values the output covariance,
 * zack values C_v / tr C_v + M / tr M with M = Σ_{i→j} W_O,i W_O,iᵀ. */
static double *removal_gram(const struct kv_model *m, const struct kv_stats *s,
                            enum kv_method method, int64_t l, int side, int64_t j) {
    const struct kv_config *c = kv_model_config(m);
    int64_t dh = c->head_dim, n2 = dh * dh, grp = c->n_heads / c->n_kv_heads, d = c->dim;
    int64_t qd = c->n_heads * dh;
    if (side == 0) {
        double *G = malloc((size_t)n2 * sizeof *G);
        for (int64_t i = 0; i < n2; i++) G[i] = s->layers[l].k_cov[j * n2 + i];
        for (int64_t qh = j * grp; qh < (j + 1) * grp; qh++)
            for (int64_t i = 0; i < n2; i++) G[i] += s->layers[l].q_cov[qh * n2 + i];
        return G;
    }
    double *G = out_cov_naive(s, m, l, 1, j, 1);
    if (method == KV_METHOD_ZACK) {
        const float *wo = m->layers[l].w[KV_W_O]; /* [d, h*d_h] */
        double *M = calloc((size_t)n2, sizeof *M), tv = 0, tm = 0;
        for (int64_t qh = j * grp; qh < (j + 1) * grp; qh++)
            for (int64_t a = 0; a < dh; a++)
                for (int64_t b = 0; b < dh; b++) {
                    double acc = 0;
                    for (int64_t r = 0; r < d; r++)
                        acc += (double)wo[r * qd + qh * dh + a] * wo[r * qd + qh * dh + b];
                    M[a * dh + b] += acc;
                }
        for (int64_t a = 0; a < dh; a++) tv += G[a * dh + a], tm += M[a * dh + a];
        for (int64_t i = 0; i < n2; i++) G[i] = G[i] / tv + M[i] / tm;
        free(M);
    }
    return G;
}

/* ZACK eq. 6 / FDC eq. 1: with singular values σ (√ of the Gram's eigenvalues)
 * and tail(k) = Σ_{i>=k} σ_i, a unit of rank r under removal rate ρ satisfies
 * tail(r) <= ρ·tail(0) and, when r > 1, tail(r−1) > ρ·tail(0). One global ρ
 * must fit every unit: the intersection [max lo, min hi) is not empty. */
static void removal_interval(const struct kv_model *m, const struct kv_stats *s,
                             enum kv_method method, const struct kv_lowrank *lr, double *lo_out,
                             double *hi_out) {
    const struct kv_config *c = kv_model_config(m);
    int64_t dh = c->head_dim;
    double lo = 0, hi = INFINITY;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                cr_assert_eq(un->n_heads, 1);
                double *G = removal_gram(m, s, method, l, side, un->head0), *lam = eigvals(G, dh);
                for (int64_t i = 0; i < dh; i++) lam[i] = sqrt(lam[i]);
                double tot = sum_from(lam, dh, 0);
                lo = fmax(lo, sum_from(lam, dh, un->rank) / tot);
                if (un->rank > 1) hi = fmin(hi, sum_from(lam, dh, un->rank - 1) / tot);
                free(G), free(lam);
            }
        }
    *lo_out = lo, *hi_out = hi;
}

Test(decompose_alloc, removal_ranks_follow_one_rate_by_zack_eq6, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    enum kv_method methods[] = {KV_METHOD_FDC, KV_METHOD_ZACK};
    double ratios[] = {0.35, 0.6};
    for (int mi = 0; mi < 2; mi++)
        for (int ri = 0; ri < 2; ri++) {
            struct kv_lowrank *lr = decompose_ok(
                e.sh.m, e.s, opts_of(methods[mi], KV_ALLOC_REMOVAL, 0, ratios[ri], 1), "removal");
            double lo, hi;
            removal_interval(e.sh.m, e.s, methods[mi], lr, &lo, &hi);
            cr_assert_leq(lo, hi + 1e-9, "%s ratio %g: no single removal rate fits every unit "
                          "(needs rho >= %.12g and < %.12g)", kv_method_name(methods[mi]), ratios[ri], lo, hi);
            int64_t ranks[64], nr = unit_ranks(lr, ranks), differ = 0;
            for (int64_t i = 1; i < nr; i++) differ += ranks[i] != ranks[0];
            cr_assert_gt(differ, 0, "%s: removal gave every unit the same rank", kv_method_name(methods[mi]));
            cr_assert_geq(kv_lr_bytes(lr, 16),
                          llround(ratios[ri] * (double)kv_lr_base_bytes(c)));
            kv_lr_free(lr);
        }
    alloc_env_free(&e);
}

/* The header promises o.param is "the searched parameter (eps, fraction,
 * removal rate, ...)": for removal it must be a rate that fits every unit. */
Test(decompose_alloc, removal_param_is_the_removal_rate, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    struct kv_decompose_opts o = opts_of(KV_METHOD_FDC, KV_ALLOC_REMOVAL, 0, 0.35, 1);
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(e.sh.m, e.s, &o, &lr, &err), KV_OK, "%s", fmt_err(&err));
    double lo, hi;
    removal_interval(e.sh.m, e.s, KV_METHOD_FDC, lr, &lo, &hi);
    cr_assert(o.param >= lo - 1e-9 && o.param <= hi + 1e-9,
              "param %.9g is not a removal rate that gives these ranks (the rate is in [%.9g, %.9g]; "
              "1 - param = %.9g)", o.param, lo, hi, 1 - o.param);
    kv_lr_free(lr);
    alloc_env_free(&e);
}

Test(decompose_alloc, fisher_gives_larger_scores_larger_ranks, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t n_slots = c->n_layers * 2 * c->n_kv_heads, dh = c->head_dim; /* palu group 1 */
    double f[64];
    cr_assert(n_slots <= 64);
    for (int64_t i = 0; i < n_slots; i++) f[i] = 1.0 + (double)((i * 7) % n_slots);
    struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0.5, 1);
    o.fisher = f;
    struct kv_lowrank *lr = decompose_ok(e.sh.m, e.s, o, "fisher");
    struct kv_lowrank *lu =
        decompose_ok(e.sh.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, 1), "uniform");
    int64_t rf[64], ru[64];
    cr_assert_eq(unit_ranks(lr, rf), n_slots);
    cr_assert_eq(unit_ranks(lu, ru), n_slots);
    int64_t differ = 0;
    for (int64_t a = 0; a < n_slots; a++) {
        differ += rf[a] != ru[a];
        cr_assert(rf[a] >= 1 && rf[a] <= dh);
        for (int64_t b = 0; b < n_slots; b++)
            if (f[a] > f[b])
                cr_assert_geq(rf[a], rf[b], "slot %lld (score %g) has rank %lld < slot %lld (score %g) "
                              "rank %lld", (long long)a, f[a], (long long)rf[a], (long long)b, f[b],
                              (long long)rf[b]);
    }
    cr_assert_gt(differ, 0, "fisher ranks equal uniform ranks");
    int64_t lo = rf[0], hi = rf[0];
    for (int64_t a = 0; a < n_slots; a++) lo = rf[a] < lo ? rf[a] : lo, hi = rf[a] > hi ? rf[a] : hi;
    cr_assert_geq(hi - lo, dh / 2, "fisher ranks span only %lld..%lld", (long long)lo, (long long)hi);
    int64_t T = llround(0.5 * (double)kv_lr_base_bytes(c)), bytes = kv_lr_bytes(lr, 16);
    cr_assert(bytes >= T && bytes <= T + 2 * n_slots, "fisher: %lld bytes for target %lld",
              (long long)bytes, (long long)T);
    kv_lr_free(lr), kv_lr_free(lu);
    alloc_env_free(&e);
}

/* Fisher rows of e.s: per layer and side, a value per KV head (rows of a
 * head share it, times a small per-row ripple), far apart between heads. */
static void set_fisher_rows(struct kv_stats *s) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t windows = s->info.windows;
    s->info.windows = 0; /* the library adds fisher sums only before the first window */
    cr_assert_eq(kv_stats_add_fisher(s, &err), KV_OK, "%s", fmt_err(&err));
    s->info.windows = windows;
    int64_t dh = s->info.head_dim;
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int64_t r = 0; r < s->info.n_kv_heads * dh; r++) {
            double head = (double)(1 + (l * 5 + r / dh * 3) % 7);
            s->layers[l].fisher_k[r] = head * head * head * (1.0 + 0.01 * (double)(r % dh));
            s->layers[l].fisher_v[r] = head * (1.0 + 0.02 * (double)(r % dh));
        }
}

/* Σ of fisher_k (side 0) or fisher_v over KV heads h0 .. h0+nh-1 of layer l. */
static double fisher_rows(const struct kv_stats *s, int64_t l, int side, int64_t h0, int64_t nh) {
    const double *f = side ? s->layers[l].fisher_v : s->layers[l].fisher_k;
    double t = 0;
    for (int64_t r = h0 * s->info.head_dim; r < (h0 + nh) * s->info.head_dim; r++) t += f[r];
    return t;
}

/* With Fisher statistics, --alloc fisher (and global's weighting) reads each
 * slot's score as the sum of its heads' rows: the same ranks as those
 * scores given explicitly, and not the ranks without them. */
Test(decompose_alloc, fisher_scores_from_stats_are_row_sums_of_the_units, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t g = c->n_kv_heads, L = c->n_layers;
    /* global before the stats have fisher: unweighted */
    struct kv_lowrank *gu =
        decompose_ok(e.sh.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.5, 1), "global");
    struct kv_decompose_opts nofisher = opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0.5, 1);
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(e.sh.m, e.s, &nofisher, &lr, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--alloc fisher needs fisher statistics (blk.N.fisher.k/v), which "
                              "this stats file does not have");
    set_fisher_rows(e.s);
    /* palu with units of 1 and 2 heads, eigen (one K slot of every head, one V
     * slot of g units): slot order is layer, K slots, V slots */
    struct { enum kv_method method; int64_t group; } cases[] = {
        {KV_METHOD_PALU, 1}, {KV_METHOD_PALU, 2}, {KV_METHOD_EIGEN, 1}};
    for (int ci = 0; ci < 3; ci++) {
        double f[64];
        int64_t ns = 0, grp = cases[ci].method == KV_METHOD_EIGEN ? g : cases[ci].group;
        for (int64_t l = 0; l < L; l++)
            for (int side = 0; side < 2; side++)
                for (int64_t h0 = 0; h0 < g; h0 += grp) f[ns++] = fisher_rows(e.s, l, side, h0, grp);
        cr_assert(ns <= 64);
        char what[64];
        snprintf(what, sizeof what, "%s group %lld", kv_method_name(cases[ci].method),
                 (long long)cases[ci].group);
        struct kv_decompose_opts o = opts_of(cases[ci].method, KV_ALLOC_FISHER, 0, 0.5, cases[ci].group);
        struct kv_lowrank *from_stats = decompose_ok(e.sh.m, e.s, o, what);
        o.fisher = f;
        struct kv_lowrank *given = decompose_ok(e.sh.m, e.s, o, what);
        struct kv_lowrank *uni = decompose_ok(
            e.sh.m, e.s, opts_of(cases[ci].method, KV_ALLOC_UNIFORM, 0, 0.5, cases[ci].group), what);
        int64_t ra[64], rb[64], rc[64];
        int64_t n = unit_ranks(from_stats, ra);
        cr_assert_eq(unit_ranks(given, rb), n);
        cr_assert_eq(unit_ranks(uni, rc), n);
        int64_t differ = 0;
        for (int64_t u = 0; u < n; u++) {
            cr_assert_eq(ra[u], rb[u], "%s: unit %lld has rank %lld from the stats, %lld from the "
                         "scores", what, (long long)u, (long long)ra[u], (long long)rb[u]);
            differ += ra[u] != rc[u];
        }
        cr_assert_gt(differ, 0, "%s: fisher ranks equal uniform ranks", what);
        kv_lr_free(from_stats), kv_lr_free(given), kv_lr_free(uni);
    }
    /* global weights by the same scores */
    double f[64];
    int64_t ns = 0;
    for (int64_t l = 0; l < L; l++)
        for (int side = 0; side < 2; side++)
            for (int64_t h = 0; h < g; h++) f[ns++] = fisher_rows(e.s, l, side, h, 1);
    struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.5, 1);
    struct kv_lowrank *gs = decompose_ok(e.sh.m, e.s, o, "global with fisher");
    o.fisher = f;
    struct kv_lowrank *gg = decompose_ok(e.sh.m, e.s, o, "global with scores");
    int64_t ra[64], rb[64], rc[64];
    int64_t n = unit_ranks(gs, ra);
    cr_assert_eq(unit_ranks(gg, rb), n);
    cr_assert_eq(unit_ranks(gu, rc), n);
    int64_t differ = 0;
    for (int64_t u = 0; u < n; u++) {
        cr_assert_eq(ra[u], rb[u], "global: unit %lld has rank %lld from the stats, %lld from the "
                     "scores", (long long)u, (long long)ra[u], (long long)rb[u]);
        differ += ra[u] != rc[u];
    }
    cr_assert_gt(differ, 0, "global ranks ignore the fisher statistics");
    kv_lr_free(gs), kv_lr_free(gg), kv_lr_free(gu);
    alloc_env_free(&e);
}

/* LoRC eqs. 12–13 recomputed from the singular values of W_k and W_v:
 * log κ^cum_l = Σ_{j>=l} (log κ(W_k^j) + log κ(W_v^j)),
 * d_c^l = d_min + (d_max − d_min)·(log κ^cum_l − min)/(max − min),
 * rank = round(d_c^l · g·d_h). Layers whose log10 κ^cum exceeds --cond-skip
 * stay full. */
static double *lorc_logcond(const struct kv_model *m) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, d = c->dim, kd = c->n_kv_heads * c->head_dim, k = kd < d ? kd : d;
    double *lc = calloc((size_t)L, sizeof *lc), *w = malloc((size_t)(kd * d) * sizeof *w);
    double *u = malloc((size_t)(kd * k) * sizeof *u), *sv = malloc((size_t)k * sizeof *sv);
    double *vt = malloc((size_t)(k * d) * sizeof *vt);
    struct kv_err err;
    kv_err_clear(&err);
    for (int64_t l = 0; l < L; l++)
        for (int side = 0; side < 2; side++) {
            const float *W = m->layers[l].w[side ? KV_W_V : KV_W_K];
            for (int64_t i = 0; i < kd * d; i++) w[i] = W[i];
            cr_assert_eq(kv_la_svd(w, kd, d, u, sv, vt, "test weight", &err), KV_OK, "%s", fmt_err(&err));
            cr_assert_gt(sv[k - 1], 0);
            lc[l] += log(sv[0] / sv[k - 1]);
        }
    for (int64_t l = L - 2; l >= 0; l--) lc[l] += lc[l + 1];
    free(w), free(u), free(sv), free(vt);
    return lc;
}

static void check_lorc(const struct kv_model *m, double d_min, double d_max, double cond_skip,
                       const char *model) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, kd = c->n_kv_heads * c->head_dim;
    double *lc = lorc_logcond(m), mx = -INFINITY, mn = INFINITY;
    for (int64_t l = 0; l < L; l++) mx = fmax(mx, lc[l]), mn = fmin(mn, lc[l]);
    struct kv_decompose_opts o = opts_of(KV_METHOD_LORC, KV_ALLOC_PROGRESSIVE, 0, 0, 1);
    o.d_min = d_min, o.d_max = d_max, o.cond_skip = cond_skip;
    struct kv_lowrank *lr = decompose_ok(m, NULL, o, "lorc");
    int64_t prev = INT64_MAX, skipped = 0;
    for (int64_t l = 0; l < L; l++) {
        double frac = d_min + (d_max - d_min) * (lc[l] - mn) / (mx - mn);
        int64_t want = admissible(llround(frac * (double)kd), 1, 1, kd);
        int skip = cond_skip > 0 && lc[l] / log(10.0) > cond_skip;
        skipped += skip;
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            if (skip) {
                cr_assert_eq(sd->mode, KV_LR_FULL, "%s: layer %lld (log10 κ %g > %g) is not full", model,
                             (long long)l, lc[l] / log(10.0), cond_skip);
                continue;
            }
            cr_assert_eq(sd->mode, side ? KV_LR_FUSED_OUTPUT : KV_LR_PREROPE_LATENT);
            cr_assert_eq(sd->n_units, 1, "lorc: one joint unit per layer side");
            cr_assert_eq(sd->units[0].n_heads, c->n_kv_heads);
            cr_assert_eq(sd->units[0].rank, want,
                         "%s d_min %g d_max %g: layer %lld %s rank %lld, eq. 13 gives %lld (%.4f·%lld)",
                         model, d_min, d_max, (long long)l, side ? "v" : "k",
                         (long long)sd->units[0].rank, (long long)want, frac, (long long)kd);
        }
        if (!skip) {
            /* shallow layers carry the larger cumulative condition number */
            cr_assert_leq(want, prev, "%s: rank grows with depth at layer %lld", model, (long long)l);
            prev = want;
        }
    }
    if (cond_skip > 0) cr_assert_gt(skipped, 0, "%s: --cond-skip %g skips nothing", model, cond_skip);
    kv_lr_free(lr);
    free(lc);
}

Test(decompose_alloc, progressive_matches_lorc_eq13, .timeout = 120) {
    struct shared s260 = open_shared(0);
    check_lorc(s260.m, 0.25, 0.9, 0, "stories260K");
    check_lorc(s260.m, 0.5, 1.0, 0, "stories260K");
    /* --cond-skip between layer 0 and layer 1 keeps layer 0 full */
    double *lc = lorc_logcond(s260.m);
    check_lorc(s260.m, 0.25, 0.9, 0.5 * (lc[0] + lc[1]) / log(10.0), "stories260K cond-skip");
    free(lc);
    /* --ratio searches d_min: the bytes reach the target, ranks still fall with depth */
    const struct kv_config *c = kv_model_config(s260.m);
    struct kv_lowrank *lr =
        decompose_ok(s260.m, NULL, opts_of(KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0.5, 1), "lorc ratio");
    int64_t T = llround(0.5 * (double)kv_lr_base_bytes(c));
    cr_assert_geq(kv_lr_bytes(lr, 16), T);
    cr_assert_leq(kv_lr_bytes(lr, 16), T + 2 * 2 * c->n_layers);
    for (int64_t l = 1; l < c->n_layers; l++)
        cr_assert_leq(lr->layers[l].k.units[0].rank, lr->layers[l - 1].k.units[0].rank);
    cr_assert_lt(lr->layers[c->n_layers - 1].k.units[0].rank, lr->layers[0].k.units[0].rank);
    kv_lr_free(lr);
    shared_free(&s260);
    struct shared s656 = open_shared(1);
    check_lorc(s656.m, 0.3, 1.0, 0, "656K");
    shared_free(&s656);
}

/* global with --eps: the mean relative error over units stays within 1 − eps,
 * and (every step costs the same bytes here) no single further rank step
 * would fit. */
Test(decompose_alloc, global_eps_stops_at_the_mean_error_budget, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t dh = c->head_dim;
    double epss[] = {0.9, 0.97};
    for (int ei = 0; ei < 2; ei++) {
        double eps = epss[ei];
        struct kv_lowrank *lr =
            decompose_ok(e.sh.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_GLOBAL, eps, 0, 1), "global eps");
        double rel[64], next[64], mean = 0;
        int64_t nu = 0, compressed = 0;
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                const struct kv_lr_side *sd = side_of(lr, l, side);
                for (int64_t u = 0; u < sd->n_units; u++) {
                    const struct kv_lr_unit *un = &sd->units[u];
                    double *C = out_cov_naive(e.s, e.sh.m, l, side, un->head0, 1), *lam = eigvals(C, dh);
                    double tot = sum_from(lam, dh, 0);
                    rel[nu] = sum_from(lam, dh, un->rank) / tot;
                    next[nu] = un->rank > 1 ? lam[un->rank - 1] / tot : INFINITY;
                    kvt_assert_close_f64(&rel[nu], &(double){un->dropped / un->energy}, 1, 1e-12, 1e-7,
                                         "global unit relative error");
                    compressed += un->rank < dh;
                    mean += rel[nu];
                    nu++;
                    free(C), free(lam);
                }
            }
        mean /= (double)nu;
        cr_assert_gt(compressed, 0, "global eps %g compresses nothing", eps);
        cr_assert_leq(mean, 1 - eps + 1e-12, "global eps %g: mean relative error %.9g", eps, mean);
        for (int64_t i = 0; i < nu; i++)
            cr_assert_gt(mean + next[i] / (double)nu, 1 - eps - 1e-12,
                         "global eps %g: unit %lld could drop one more rank (mean %.9g + %.9g)", eps,
                         (long long)i, mean, next[i] / (double)nu);
        kv_lr_free(lr);
    }
    alloc_env_free(&e);
}

/* Every allocation honours --rank-multiple (a multiple, or the full width) and
 * --min-rank (never below, unless the width is smaller). stories260K has
 * d_h 8, so a multiple of 3 cannot reach the width. */
Test(decompose_alloc, rank_multiple_and_min_rank_hold_for_every_allocation, .timeout = 120) {
    struct shared sh = open_shared(0);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, 2);
    int64_t dh = kv_model_config(sh.m)->head_dim;
    struct {
        enum kv_method method;
        enum kv_alloc alloc;
        double eps, ratio;
        int64_t group;
    } cases[] = {
        {KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.8, 1}, {KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.8, 1},
        {KV_METHOD_PALU, KV_ALLOC_EPS, 0.9, 0, 1},     {KV_METHOD_PALU, KV_ALLOC_EPS, 0, 0.8, 2},
        {KV_METHOD_EIGEN, KV_ALLOC_EPS, 0, 0.8, 1},    {KV_METHOD_FDC, KV_ALLOC_REMOVAL, 0, 0.8, 1},
        {KV_METHOD_ZACK, KV_ALLOC_REMOVAL, 0, 0.8, 1}, {KV_METHOD_SVD, KV_ALLOC_GLOBAL, 0.8, 0, 1},
        {KV_METHOD_LORC, KV_ALLOC_PROGRESSIVE, 0, 0.8, 1},
    };
    /* ratios low enough that the admissible ranks ({3, 6, 8}, {5..8}, {6, 8},
     * {4, 8}) leave something to compress, at or above each floor */
    struct {
        int64_t mult, min_rank;
        double ratio;
    } rules[] = {{3, 1, 0.6}, {1, 5, 0.7}, {2, 5, 0.75}, {4, 3, 0.5}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ri = 0; ri < sizeof rules / sizeof rules[0]; ri++) {
            struct kv_decompose_opts o = opts_of(cases[ci].method, cases[ci].alloc, cases[ci].eps,
                                                 cases[ci].ratio > 0 ? rules[ri].ratio : 0,
                                                 cases[ci].group);
            o.rank_multiple = rules[ri].mult, o.min_rank = rules[ri].min_rank;
            char what[128];
            snprintf(what, sizeof what, "%s %s group %lld, rank-multiple %lld min-rank %lld",
                     kv_method_name(cases[ci].method), kv_alloc_name(cases[ci].alloc),
                     (long long)cases[ci].group, (long long)rules[ri].mult, (long long)rules[ri].min_rank);
            struct kv_lowrank *lr = decompose_ok(sh.m, s, o, what);
            int64_t reduced = 0;
            for (int64_t l = 0; l < lr->info.n_layers; l++)
                for (int side = 0; side < 2; side++) {
                    const struct kv_lr_side *sd = side_of(lr, l, side);
                    for (int64_t u = 0; u < sd->n_units; u++) {
                        const struct kv_lr_unit *un = &sd->units[u];
                        int64_t wdt = unit_width(sd, un, dh), r = un->rank;
                        int64_t floor = admissible(rules[ri].min_rank, rules[ri].min_rank, rules[ri].mult, wdt);
                        cr_assert(r % rules[ri].mult == 0 || r == wdt, "%s: rank %lld of %lld", what,
                                  (long long)r, (long long)wdt);
                        cr_assert(r >= floor, "%s: rank %lld below the floor %lld", what, (long long)r,
                                  (long long)floor);
                        reduced += r < wdt;
                    }
                }
            cr_assert_gt(reduced, 0, "%s: nothing is compressed", what);
            kv_lr_free(lr);
        }
    kv_stats_free(s);
    shared_free(&sh);
}

/* Eigen Attention (§4.3, eq. 5): one key basis per layer shared by every KV
 * head, the top eigenvectors of Σ_i C_q,i + Σ_j C_k,j (pre-RoPE), with the
 * smallest rank keeping eps of that spectrum; values get a basis per head
 * and one rank per layer, the largest energy rank over the heads' C_v,j. */
Test(decompose_alloc, eigen_shares_the_qk_key_basis_and_one_value_rank, .timeout = 120) {
    struct shared sh = open_shared(0);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, 2);
    const struct kv_config *c = kv_model_config(sh.m);
    int64_t dh = c->head_dim, g = c->n_kv_heads, n2 = dh * dh;
    double epss[] = {0.8, 0.95};
    for (int ei = 0; ei < 2; ei++) {
        double eps = epss[ei];
        struct kv_lowrank *lr =
            decompose_ok(sh.m, s, opts_of(KV_METHOD_EIGEN, KV_ALLOC_DEFAULT, eps, 0, 1), "eigen");
        int64_t compressed = 0;
        for (int64_t l = 0; l < c->n_layers; l++) {
            double *G = calloc((size_t)n2, sizeof *G);
            for (int64_t i = 0; i < c->n_heads; i++) {
                double *C = out_cov_naive(s, sh.m, l, 2, i, 1);
                for (int64_t e = 0; e < n2; e++) G[e] += C[e];
                free(C);
            }
            for (int64_t j = 0; j < g; j++) {
                double *C = out_cov_naive(s, sh.m, l, 0, j, 1);
                for (int64_t e = 0; e < n2; e++) G[e] += C[e];
                free(C);
            }
            double *lam = eigvals(G, dh), tot = sum_from(lam, dh, 0);
            const struct kv_lr_side *k = &lr->layers[l].k;
            cr_assert_eq(k->n_units, g);
            int64_t r = k->units[0].rank;
            compressed += r < dh;
            /* the key rank: the largest over heads j of the fewest basis
             * vectors u_0.. whose error Σ_{i>=r} u_iᵀ C_k,j u_i is within
             * (1 - eps) of head j's key variance (the basis as stored) */
            int64_t want_k = 1;
            double *vecs = malloc((size_t)n2 * sizeof *vecs), *lw = malloc((size_t)dh * sizeof *lw);
            struct kv_err e2;
            kv_err_clear(&e2);
            cr_assert_eq(kv_la_eigh(G, dh, lw, vecs, "G", &e2), KV_OK);
            for (int64_t j = 0; j < g; j++) {
                double *C = out_cov_naive(s, sh.m, l, 0, j, 1);
                double allow = (1 - eps) * out_var_naive(s, sh.m, l, 0, j, 1);
                double *tail = calloc((size_t)(dh + 1), sizeof *tail);
                for (int64_t i = dh - 1; i >= 0; i--) {
                    double q = 0;
                    for (int64_t a = 0; a < dh; a++)
                        for (int64_t b = 0; b < dh; b++) q += vecs[a * dh + i] * C[a * dh + b] * vecs[b * dh + i];
                    tail[i] = tail[i + 1] + q;
                }
                int64_t rj = dh;
                while (rj > 0 && tail[rj - 1] <= allow) rj--;
                want_k = rj > want_k ? rj : want_k;
                free(C), free(tail);
            }
            free(vecs), free(lw);
            cr_assert_eq(r, want_k, "eigen eps %g layer %lld: key rank %lld, expected %lld", eps,
                         (long long)l, (long long)r, (long long)want_k);
            /* the shared basis U (= up, orthonormal) captures the top-r energy
             * of G: tr(Uᵀ G U) = λ_1 + .. + λ_r */
            const float *U = k->units[0].up;
            double cap = 0;
            for (int64_t i = 0; i < r; i++)
                for (int64_t a = 0; a < dh; a++)
                    for (int64_t b = 0; b < dh; b++) cap += (double)U[a * r + i] * G[a * dh + b] * U[b * r + i];
            double top = tot - sum_from(lam, dh, r);
            kvt_assert_close_f64(&cap, &top, 1, 0, 1e-5, "eigen shared key basis captures the top of C_q + C_k");
            for (int64_t j = 1; j < g; j++) {
                cr_assert_eq(k->units[j].rank, r);
                kvt_assert_close_f32(k->units[j].up, U, dh * r, 0, 0, "every head shares the key basis");
            }
            /* values: one rank, the largest per-head energy rank */
            const struct kv_lr_side *v = &lr->layers[l].v;
            int64_t want = 0;
            for (int64_t j = 0; j < g; j++) {
                double *C = out_cov_naive(s, sh.m, l, 1, j, 1), *lv = eigvals(C, dh);
                double allow = (1 - eps) * out_var_naive(s, sh.m, l, 1, j, 1);
                int64_t rj = 1;
                while (rj < dh && sum_from(lv, dh, rj) > allow) rj++;
                want = rj > want ? rj : want;
                free(C), free(lv);
            }
            for (int64_t j = 0; j < g; j++)
                cr_assert_eq(v->units[j].rank, want, "eigen eps %g layer %lld v head %lld: rank %lld, "
                             "expected %lld", eps, (long long)l, (long long)j,
                             (long long)v->units[j].rank, (long long)want);
            free(G), free(lam);
        }
        cr_assert_gt(compressed, 0, "eigen eps %g compresses no key", eps);
        kv_lr_free(lr);
    }
    kv_stats_free(s);
    shared_free(&sh);
}

/* Orthonormal block Sylvester matrix of size r, written from its definition:
 * one block per power of two in r's binary expansion, largest first, and
 * in a block of size b at offset o, H_ij = ±1/√b with the sign
 * (−1)^popcount((i−o) & (j−o)). */
static double *sylvester(int64_t r) {
    double *H = calloc((size_t)(r * r), sizeof *H);
    int64_t o = 0;
    for (int bit = 62; bit >= 0; bit--) {
        int64_t b = (int64_t)1 << bit;
        if (!(r & b)) continue;
        for (int64_t i = 0; i < b; i++)
            for (int64_t j = 0; j < b; j++) {
                int64_t x = i & j, par = 0;
                while (x) par ^= x & 1, x >>= 1;
                H[(o + i) * r + o + j] = (par ? -1.0 : 1.0) / sqrt((double)b);
            }
        o += b;
    }
    return H;
}

/* --hadamard rotates every basis by H (orthonormal): down' = Hᵀ down,
 * up' = up H, rot' = Hᵀ rot. The products, and so the fp16-latent PPL, are
 * unchanged while the factors differ. */
Test(decompose_alloc, hadamard_changes_the_factors_not_the_ppl, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t d = c->dim, dh = c->head_dim;
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC, KV_METHOD_EIGEN};
    for (int mi = 0; mi < 3; mi++) {
        struct kv_decompose_opts o = opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1);
        o.rank_multiple = 2; /* even ranks: H is not the identity */
        struct kv_lowrank *plain = decompose_ok(e.sh.m, e.s, o, "plain");
        o.hadamard = 1;
        struct kv_lowrank *had = decompose_ok(e.sh.m, e.s, o, "hadamard");
        cr_assert_eq(had->info.hadamard, 1);
        const char *nm = kv_method_name(methods[mi]);
        int64_t differ = 0;
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                const struct kv_lr_side *a = side_of(plain, l, side), *b = side_of(had, l, side);
                cr_assert_eq(a->n_units, b->n_units);
                for (int64_t u = 0; u < a->n_units; u++) {
                    const struct kv_lr_unit *ua = &a->units[u], *ub = &b->units[u];
                    int64_t r = ua->rank;
                    cr_assert_eq(ub->rank, r);
                    double *H = sylvester(r);
                    int rot = a->mode == KV_LR_POSTROPE_ROTATION;
                    int64_t cols = rot ? dh : d;
                    const float *fa = rot ? ua->rot : ua->down, *fb = rot ? ub->rot : ub->down;
                    /* fb = Hᵀ fa, row by row */
                    double *want = calloc((size_t)(r * cols), sizeof *want);
                    double *got = malloc((size_t)(r * cols) * sizeof *got), dmax = 0, mx = 0;
                    for (int64_t k = 0; k < r; k++)
                        for (int64_t j = 0; j < cols; j++) {
                            for (int64_t i = 0; i < r; i++) want[k * cols + j] += H[i * r + k] * fa[i * cols + j];
                            got[k * cols + j] = fb[k * cols + j];
                            dmax = fmax(dmax, fabs(got[k * cols + j] - fa[k * cols + j]));
                            mx = fmax(mx, fabs(want[k * cols + j]));
                        }
                    char what[96];
                    snprintf(what, sizeof what, "%s layer %lld %s unit %lld: factor = Hᵀ·plain", nm,
                             (long long)l, side ? "v" : "k", (long long)u);
                    kvt_assert_close_f64(got, want, r * cols, 1e-5 * mx, 0, what);
                    differ += dmax > 1e-3 * mx;
                    if (!rot) { /* up' = up H */
                        int64_t mm = ua->n_heads * dh;
                        double *wu = calloc((size_t)(mm * r), sizeof *wu), *gu = malloc((size_t)(mm * r) * sizeof *gu);
                        for (int64_t a2 = 0; a2 < mm; a2++)
                            for (int64_t k = 0; k < r; k++) {
                                for (int64_t i = 0; i < r; i++) wu[a2 * r + k] += ua->up[a2 * r + i] * H[i * r + k];
                                gu[a2 * r + k] = ub->up[a2 * r + k];
                            }
                        kvt_assert_close_f64(gu, wu, mm * r, 1e-6, 0, "up = up·H");
                        free(wu), free(gu);
                    }
                    free(want), free(got), free(H);
                }
            }
        cr_assert_gt(differ, 0, "%s: --hadamard leaves every factor as it was", nm);
        struct kv_compare_result ra, rb;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_ppl_compare(e.sh.m, plain, 16, e.sh.tok + EVAL_AT, 2 * SEQ, SEQ, 0, NULL, NULL,
                                    &ra, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(kv_ppl_compare(e.sh.m, had, 16, e.sh.tok + EVAL_AT, 2 * SEQ, SEQ, 0, NULL, NULL,
                                    &rb, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_gt(fabs(ra.comp.ppl - ra.base.ppl), 1e-4 * ra.base.ppl, "%s: compression has no effect", nm);
        char what[64];
        snprintf(what, sizeof what, "%s: ppl with --hadamard", nm);
        kvt_assert_close_f64(&rb.comp.ppl, &ra.comp.ppl, 1, 0, 1e-5, what);
        kv_lr_free(plain), kv_lr_free(had);
    }
    alloc_env_free(&e);
}
