/* Low-rank K/V decomposition (calib/decompose*.c), each against a
 * computation written here:
 *
 *   decompose_identity  --eps 1 and --ratio 1 keep every rank, so the
 *                       compressed perplexity equals the base one (shared
 *                       models, every method, text held out from calibration);
 *   decompose_error     each unit's predicted `dropped` equals ‖Y − Y'‖²_F
 *                       measured with naive loops over the calibration windows
 *                       (Y = X Wᵀ + b from captured attention inputs, Y' from
 *                       the emitted factors), and `energy` equals ‖Y‖²_F;
 *                       post-RoPE rotations against captured post-RoPE keys;
 *   decompose_outputs   the summaries beside the factors (predicted errors,
 *                       odd-rank units, target reached) recounted from them.
 *
 * The allocations are test_decompose_alloc.c's, the options
 * test_decompose_opts.c's and the latent-cache forward test_latent.c's.
 * Statistics come from kv_accum over a few windows (decompose_fixtures.h). */
#include "decompose_fixtures.h"

/* ================================================================ identity */

/* The keys' expected mode per method (values are always fused_output). */
static enum kv_lr_mode key_mode(enum kv_method m) {
    return m == KV_METHOD_FDC || m == KV_METHOD_ZACK ? KV_LR_POSTROPE_ROTATION
                                                     : KV_LR_PREROPE_LATENT;
}

static void identity_every_method(int which) {
    struct shared sh = open_shared(which);
    const struct kv_config *c = kv_model_config(sh.m);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, CAL_WINDOWS);
    int64_t base = c->n_layers * 2 * c->n_kv_heads * c->head_dim * 2;
    cr_assert_eq(kv_lr_base_bytes(c), base);
    for (int method = 0; method < KV_METHOD_COUNT; method++)
        for (int setting = 0; setting < 2; setting++) {
            char what[96];
            snprintf(what, sizeof what, "%s with %s", kv_method_name(method),
                     setting ? "--ratio 1" : "--eps 1");
            struct kv_decompose_opts o =
                opts_of(method, KV_ALLOC_DEFAULT, setting ? 0 : 1.0, setting ? 1.0 : 0, 1);
            struct kv_lowrank *lr = decompose_ok(sh.m, s, o, what);
            for (int64_t l = 0; l < c->n_layers; l++)
                for (int side = 0; side < 2; side++) {
                    const struct kv_lr_side *sd = side_of(lr, l, side);
                    enum kv_lr_mode want = side ? KV_LR_FUSED_OUTPUT : key_mode(method);
                    cr_assert_eq(sd->mode, want, "%s: layer %lld %s mode %s, expected %s", what,
                                 (long long)l, side ? "v" : "k", kv_lr_mode_name(sd->mode),
                                 kv_lr_mode_name(want));
                    int64_t covered = 0;
                    for (int64_t u = 0; u < sd->n_units; u++) {
                        const struct kv_lr_unit *un = &sd->units[u];
                        int64_t wdt = unit_width(sd, un, c->head_dim);
                        cr_assert_eq(un->rank, wdt, "%s: layer %lld %s unit %lld rank %lld of %lld",
                                     what, (long long)l, side ? "v" : "k", (long long)u,
                                     (long long)un->rank, (long long)wdt);
                        covered += un->n_heads;
                    }
                    cr_assert_eq(covered, c->n_kv_heads, "%s: units cover %lld kv heads", what,
                                 (long long)covered);
                }
            cr_assert_eq(kv_lr_bytes(lr, 16), base, "%s: %lld bytes, base %lld", what,
                         (long long)kv_lr_bytes(lr, 16), (long long)base);
            cr_assert_eq(bytes_by_definition(lr, 16), base);
            struct kv_compare_result r;
            struct kv_err err;
            kv_err_clear(&err);
            cr_assert_eq(kv_ppl_compare(sh.m, lr, 16, sh.tok + EVAL_AT, EVAL_WINDOWS * SEQ, SEQ, 0,
                                        NULL, NULL, &r, &err),
                         KV_OK, "%s: %s", what, fmt_err(&err));
            cr_assert_eq(r.comp.windows, EVAL_WINDOWS);
            kvt_assert_close_f64(&r.comp.ppl, &r.base.ppl, 1, 0, 1e-4, what);
            cr_assert_lt(r.kl, 1e-6, "%s: kl %g", what, r.kl);
            kv_lr_free(lr);
        }
    kv_stats_free(s);
    shared_free(&sh);
}

Test(decompose_identity, stories260K_every_method_keeps_the_base_ppl, .timeout = 300) {
    identity_every_method(0);
}

Test(decompose_identity, tinystories656K_every_method_keeps_the_base_ppl, .timeout = 300) {
    identity_every_method(1);
}

/* ================================================================ error */

/* Measured ‖Y − Y'‖² and ‖Y‖² per unit, summed over every forward pass. */
struct meas {
    const struct kv_model *m;
    const struct kv_lowrank *lr;
    int64_t g;
    double *dropped, *energy; /* [(layer*2 + side)*g + unit] */
};

/* Latent units: Y = x Wᵀ + b against Y' = (x downᵀ + down_bias) upᵀ, in
 * float64 from the fp32 attention input. */
static int meas_x(void *ctx, int64_t l, const float *x, int64_t n, int64_t pos0) {
    struct meas *M = ctx;
    const struct kv_config *c = kv_model_config(M->m);
    int64_t d = c->dim, dh = c->head_dim, kd = c->n_kv_heads * dh;
    double *z = malloc((size_t)kd * sizeof *z);
    for (int side = 0; side < 2; side++) {
        const struct kv_lr_side *sd = side_of(M->lr, l, side);
        if (sd->mode != KV_LR_PREROPE_LATENT && sd->mode != KV_LR_FUSED_OUTPUT) continue;
        const float *W = M->m->layers[l].w[side ? KV_W_V : KV_W_K];
        const float *B = M->m->layers[l].w[side ? KV_W_BV : KV_W_BK];
        for (int64_t u = 0; u < sd->n_units; u++) {
            const struct kv_lr_unit *un = &sd->units[u];
            int64_t mm = un->n_heads * dh, r = un->rank, row0 = un->head0 * dh;
            double e = 0, en = 0;
            for (int64_t t = 0; t < n; t++) {
                const float *xt = x + t * d;
                for (int64_t k = 0; k < r; k++) {
                    double acc = un->down_bias ? un->down_bias[k] : 0;
                    for (int64_t j = 0; j < d; j++) acc += (double)un->down[k * d + j] * xt[j];
                    z[k] = acc;
                }
                for (int64_t a = 0; a < mm; a++) {
                    double acc = B ? B[row0 + a] : 0, rec = 0;
                    for (int64_t j = 0; j < d; j++) acc += (double)W[(row0 + a) * d + j] * xt[j];
                    for (int64_t k = 0; k < r; k++) rec += (double)un->up[a * r + k] * z[k];
                    e += (acc - rec) * (acc - rec);
                    en += acc * acc;
                }
            }
            M->dropped[(l * 2 + side) * M->g + u] += e;
            M->energy[(l * 2 + side) * M->g + u] += en;
        }
    }
    free(z);
    return 0;
}

/* Rotation units: the post-RoPE key k_j against k_j rotᵀ rot. */
static int meas_qk(void *ctx, int64_t l, const float *q, const float *k, int64_t n,
                   int64_t pos0) {
    struct meas *M = ctx;
    const struct kv_config *c = kv_model_config(M->m);
    int64_t dh = c->head_dim, kd = c->n_kv_heads * dh;
    const struct kv_lr_side *sd = side_of(M->lr, l, 0);
    if (sd->mode != KV_LR_POSTROPE_ROTATION) return 0;
    double z[64];
    for (int64_t u = 0; u < sd->n_units; u++) {
        const struct kv_lr_unit *un = &sd->units[u];
        int64_t r = un->rank;
        double e = 0, en = 0;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + t * kd + un->head0 * dh;
            for (int64_t i = 0; i < r; i++) {
                double acc = 0;
                for (int64_t a = 0; a < dh; a++) acc += (double)un->rot[i * dh + a] * kt[a];
                z[i] = acc;
            }
            for (int64_t a = 0; a < dh; a++) {
                double rec = 0;
                for (int64_t i = 0; i < r; i++) rec += (double)un->rot[i * dh + a] * z[i];
                e += (kt[a] - rec) * (kt[a] - rec);
                en += (double)kt[a] * kt[a];
            }
        }
        M->dropped[(l * 2) * M->g + u] += e;
        M->energy[(l * 2) * M->g + u] += en;
    }
    return 0;
}

/* Decompose with o, rerun the same windows capturing X and post-RoPE K, and
 * compare every unit's dropped and energy with the measured sums. */
static void check_predicted_error(const struct kv_model *m, const struct kv_stats *s,
                                  const int32_t *tok, int64_t seq, int64_t nwin,
                                  struct kv_decompose_opts o, const char *what) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, g = c->n_kv_heads, dh = c->head_dim;
    struct kv_lowrank *lr = decompose_ok(m, s, o, what);
    cr_assert(c->head_dim <= 64);
    struct meas M = {m, lr, g, calloc((size_t)(L * 2 * g), sizeof(double)),
                     calloc((size_t)(L * 2 * g), sizeof(double))};
    struct kv_fwd *f = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, seq, &f, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_fwd_hooks hk = {0};
    hk.ctx = &M, hk.attn_in = meas_x, hk.qk_rope = meas_qk, hk.hooks_only = 1;
    kv_fwd_set_hooks(f, &hk);
    for (int64_t w = 0; w < nwin; w++)
        cr_assert_eq(kv_fwd_run(f, tok + w * seq, seq, 0, NULL, &err), KV_OK, "%s", fmt_err(&err));
    kv_fwd_free(f);

    int64_t nu = 0, compressed = 0, real_drop = 0;
    double *got_d = calloc((size_t)(L * 2 * g), sizeof(double));
    double *ref_d = calloc((size_t)(L * 2 * g), sizeof(double));
    double *got_e = calloc((size_t)(L * 2 * g), sizeof(double));
    double *ref_e = calloc((size_t)(L * 2 * g), sizeof(double));
    double emax = 0;
    for (int64_t l = 0; l < L; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            cr_assert_neq(sd->mode, KV_LR_FULL, "%s: layer %lld side %d is full", what, (long long)l,
                          side);
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                got_d[nu] = un->dropped, ref_d[nu] = M.dropped[(l * 2 + side) * g + u];
                got_e[nu] = un->energy, ref_e[nu] = M.energy[(l * 2 + side) * g + u];
                emax = fmax(emax, ref_e[nu]);
                compressed += un->rank < unit_width(sd, un, dh);
                real_drop += un->dropped > 1e-3 * un->energy;
                nu++;
            }
        }
    /* not vacuous: a good share of the units drop real energy */
    cr_assert_geq(4 * compressed, nu, "%s: only %lld of %lld units are compressed", what,
                  (long long)compressed, (long long)nu);
    cr_assert_geq(real_drop, 1, "%s: no unit drops energy", what);
    char w2[256];
    snprintf(w2, sizeof w2, "%s: unit energy vs measured ‖Y‖²", what);
    kvt_assert_close_f64(got_e, ref_e, nu, 0, 1e-9, w2);
    /* full-rank units measure fp32 rounding only (~1e-14 of the energy) */
    snprintf(w2, sizeof w2, "%s: unit dropped vs measured ‖Y − Y'‖²", what);
    kvt_assert_close_f64(got_d, ref_d, nu, 1e-11 * emax, 1e-6, w2);
    free(got_d), free(ref_d), free(got_e), free(ref_e), free(M.dropped), free(M.energy);
    kv_lr_free(lr);
}

/* Every method whose units a measurement can check, at about half the bytes. */
static void predicted_error_every_method(const struct kv_model *m, const int32_t *tok, int64_t seq,
                                         int64_t nwin, const char *model) {
    struct kv_stats *s = collect(m, tok, seq, nwin);
    struct {
        enum kv_method method;
        enum kv_alloc alloc;
        double eps, ratio;
        int64_t group;
    } cases[] = {
        {KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0, 0.5, 1},  {KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0, 0.5, 2},
        {KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1},   {KV_METHOD_EIGEN, KV_ALLOC_DEFAULT, 0, 0.5, 1},
        {KV_METHOD_EIGEN, KV_ALLOC_DEFAULT, 0.9, 0, 1}, {KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0.5, 1},
        {KV_METHOD_FDC, KV_ALLOC_DEFAULT, 0, 0.5, 1},   {KV_METHOD_ZACK, KV_ALLOC_DEFAULT, 0, 0.5, 1},
        {KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.4, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[128];
        snprintf(what, sizeof what, "%s %s group %lld %s %g", model, kv_method_name(cases[i].method),
                 (long long)cases[i].group, cases[i].eps > 0 ? "eps" : "ratio",
                 cases[i].eps > 0 ? cases[i].eps : cases[i].ratio);
        check_predicted_error(m, s, tok, seq, nwin,
                              opts_of(cases[i].method, cases[i].alloc, cases[i].eps, cases[i].ratio,
                                      cases[i].group),
                              what);
    }
    kv_stats_free(s);
}

Test(decompose_error, random_gqa_without_bias_dropped_is_measured_error, .timeout = 120) {
    struct kv_model *m = random_model(KV_ROPE_INTERLEAVED, 0, 21);
    int32_t *tok = random_tokens(3 * 64, 97, 5);
    predicted_error_every_method(m, tok, 64, 3, "random gqa");
    free(tok);
    kv_model_close(m);
}

Test(decompose_error, random_gqa_with_bias_dropped_is_measured_error, .timeout = 120) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 22);
    int32_t *tok = random_tokens(3 * 64, 97, 6);
    predicted_error_every_method(m, tok, 64, 3, "random gqa + bias");
    free(tok);
    kv_model_close(m);
}

Test(decompose_error, stories260K_dropped_is_measured_error, .timeout = 300) {
    struct shared sh = open_shared(0);
    predicted_error_every_method(sh.m, sh.tok, SEQ, CAL_WINDOWS, "stories260K");
    shared_free(&sh);
}

/* Without statistics svd measures in the weight metric: dropped is
 * ‖W_u − up·down‖²_F and energy ‖W_u‖²_F. */
Test(decompose_error, svd_without_stats_is_the_weight_error) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 23);
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, dh = c->head_dim;
    for (int64_t group = 1; group <= 2; group++) {
        struct kv_lowrank *lr =
            decompose_ok(m, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, group), "svd");
        double got[16], ref[16], gote[16], refe[16];
        int64_t nu = 0;
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                const struct kv_lr_side *sd = side_of(lr, l, side);
                const float *W = m->layers[l].w[side ? KV_W_V : KV_W_K];
                for (int64_t u = 0; u < sd->n_units; u++) {
                    const struct kv_lr_unit *un = &sd->units[u];
                    int64_t mm = un->n_heads * dh, r = un->rank, row0 = un->head0 * dh;
                    cr_assert_lt(r, mm);
                    double e = 0, en = 0;
                    for (int64_t a = 0; a < mm; a++)
                        for (int64_t j = 0; j < d; j++) {
                            double w = W[(row0 + a) * d + j], p = 0;
                            for (int64_t k = 0; k < r; k++)
                                p += (double)un->up[a * r + k] * un->down[k * d + j];
                            e += (w - p) * (w - p), en += w * w;
                        }
                    got[nu] = un->dropped, ref[nu] = e, gote[nu] = un->energy, refe[nu] = en;
                    nu++;
                }
            }
        kvt_assert_close_f64(got, ref, nu, 0, 1e-6, "svd weight-metric dropped");
        kvt_assert_close_f64(gote, refe, nu, 0, 1e-9, "svd weight-metric energy");
        kv_lr_free(lr);
    }
    kv_model_close(m);
}

/* ================================================================ outputs */

/* What kv_decompose reports beside the factors, recounted from them: the
 * predicted error of all K and V units, the units of odd rank a Hadamard
 * rotation leaves out, and whether a ratio out of the allocation's reach
 * was missed. */
Test(decompose_outputs, summaries_match_the_factors, .timeout = 120) {
    struct shared sh = open_shared(1);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, CAL_WINDOWS);
    struct {
        enum kv_method method;
        double ratio;
        int64_t mult;
        int hadamard, reached;
    } cases[] = {
        {KV_METHOD_ZACK, 0.5, 3, 1, 1}, {KV_METHOD_ZACK, 0.5, 3, 0, 1}, {KV_METHOD_PALU, 0.5, 1, 1, 1},
        {KV_METHOD_LORC, 0.2, 1, 0, 0}, {KV_METHOD_EIGEN, 0, 1, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kv_decompose_opts o = opts_of(cases[i].method, KV_ALLOC_DEFAULT, cases[i].ratio > 0 ? 0 : 0.9,
                                             cases[i].ratio, 1);
        o.rank_multiple = cases[i].mult, o.hadamard = cases[i].hadamard;
        char what[96];
        snprintf(what, sizeof what, "%s ratio %g multiple %lld%s", kv_method_name(cases[i].method),
                 cases[i].ratio, (long long)cases[i].mult, cases[i].hadamard ? " hadamard" : "");
        struct kv_lowrank *lr = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose(sh.m, s, &o, &lr, &err), KV_OK, "%s: %s", what, fmt_err(&err));
        double e[2] = {0, 0}, d[2] = {0, 0};
        int64_t odd = 0;
        for (int64_t l = 0; l < lr->info.n_layers; l++)
            for (int side = 0; side < 2; side++) {
                const struct kv_lr_side *sd = side_of(lr, l, side);
                for (int64_t u = 0; u < sd->n_units; u++) {
                    e[side] += sd->units[u].energy, d[side] += sd->units[u].dropped;
                    odd += sd->units[u].rank > 1 && sd->units[u].rank % 2;
                }
            }
        double want_k = e[0] > 0 ? d[0] / e[0] : 0, want_v = e[1] > 0 ? d[1] / e[1] : 0;
        kvt_assert_close_f64(&o.error_k, &want_k, 1, 0, 1e-12, what);
        kvt_assert_close_f64(&o.error_v, &want_v, 1, 0, 1e-12, what);
        cr_assert_eq(o.odd_rank_units, cases[i].hadamard ? odd : 0, "%s: %lld odd-rank units, counted %lld",
                     what, (long long)o.odd_rank_units, (long long)odd);
        if (cases[i].hadamard && cases[i].mult == 3) cr_assert_gt(odd, 0, "%s: no odd rank to count", what);
        cr_assert_eq(o.target_reached, cases[i].reached, "%s: target_reached %d", what, o.target_reached);
        if (!cases[i].reached)
            cr_assert(o.least_bytes > o.target_bytes && kv_lr_bytes(lr, 16) > o.target_bytes,
                      "%s: least %lld, target %lld", what, (long long)o.least_bytes,
                      (long long)o.target_bytes);
        kv_lr_free(lr);
    }
    kv_stats_free(s);
    shared_free(&sh);
}

/* A numerical failure names the statistics file when the options have it. */
Test(decompose_outputs, numerical_errors_name_the_statistics_file) {
    struct kv_model *m = random_model(KV_ROPE_INTERLEAVED, 0, 91);
    int32_t *tok = random_tokens(64, 97, 92);
    struct kv_stats *s = collect(m, tok, 64, 1);
    s->layers[1].xtx[3] = NAN;
    for (int named = 0; named < 2; named++) {
        struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, 1);
        o.stats_path = named ? "bad.kvstats" : NULL;
        struct kv_lowrank *lr = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose(m, s, &o, &lr, &err), KV_ENUMERIC, "%s", fmt_err(&err));
        cr_assert_null(lr);
        cr_assert_str_eq(err.path, named ? "bad.kvstats" : "");
    }
    kv_stats_free(s);
    free(tok);
    kv_model_close(m);
}
