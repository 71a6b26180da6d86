/* The objectives of decompose's bases, centring and eps, each against a
 * naive float64 evaluation of its definition (docs/design.md, "Centred
 * latents", "Bases that see the output", "What eps means"):
 *
 *   decompose_metric   the RoPE average of the query metric against the sum
 *                      over distances with explicit rotations; every basis's
 *                      reported error against its objective evaluated from
 *                      the raw input sums and the emitted factors, and the
 *                      output and loss bases no worse than the energy basis
 *                      on their own objective; eps against the explained
 *                      variance; centred factors at full rank against the
 *                      base model; global against uniform on its objective. */
#include "decompose_ctx.h"
#include "decompose_fixtures.h"
#include "naive_rope.h"

/* ================================================================ naive */

/* Σ_t w_t Dᵀ C D / Σ w_t, w_t = T - t, D = (mscale² · rotation by -angle(t))
 * on each rotated pair, identity elsewhere, built as a dense matrix. */
static void naive_rope_average(const struct kv_config *c, int64_t T, const double *C, double *M) {
    int64_t dh = c->head_dim, half = (c->rope_dim ? c->rope_dim : dh) / 2;
    int il = c->rope_layout == KV_ROPE_INTERLEAVED;
    double *D = calloc((size_t)(dh * dh), sizeof *D), *CD = malloc((size_t)(dh * dh) * sizeof *CD);
    double wsum = 0;
    memset(M, 0, (size_t)(dh * dh) * sizeof *M);
    for (int64_t t = 0; t < T; t++) {
        memset(D, 0, (size_t)(dh * dh) * sizeof *D);
        for (int64_t a = 0; a < dh; a++) D[a * dh + a] = 1;
        for (int64_t i = 0; i < half; i++) {
            double ms = 1, ang = naive_rope_angle(c, T, t, i, &ms), s2 = ms * ms;
            int64_t a = il ? 2 * i : i, b = il ? 2 * i + 1 : i + half;
            /* R(-ang) = [[cos, sin], [-sin, cos]] */
            D[a * dh + a] = s2 * cos(ang), D[a * dh + b] = s2 * sin(ang);
            D[b * dh + a] = -s2 * sin(ang), D[b * dh + b] = s2 * cos(ang);
        }
        double w = (double)(T - t);
        wsum += w;
        for (int64_t a = 0; a < dh; a++)
            for (int64_t b = 0; b < dh; b++) {
                double acc = 0;
                for (int64_t k = 0; k < dh; k++) acc += C[a * dh + k] * D[k * dh + b];
                CD[a * dh + b] = acc;
            }
        for (int64_t a = 0; a < dh; a++)
            for (int64_t b = 0; b < dh; b++) {
                double acc = 0;
                for (int64_t k = 0; k < dh; k++) acc += D[k * dh + a] * CD[k * dh + b];
                M[a * dh + b] += w * acc;
            }
    }
    for (int64_t i = 0; i < dh * dh; i++) M[i] /= wsum;
    free(D), free(CD);
}

/* A random symmetric positive semi-definite n×n matrix A Aᵀ. */
static void random_psd(int64_t n, uint64_t seed, double *out) {
    double *a = malloc((size_t)(n * n) * sizeof *a);
    for (int64_t i = 0; i < n * n; i++) a[i] = (double)(lcg(&seed) % 2001) / 1000.0 - 1.0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) {
            double acc = 0;
            for (int64_t k = 0; k < n; k++) acc += a[i * n + k] * a[j * n + k];
            out[i * n + j] = acc;
        }
    free(a);
}

Test(decompose_metric, rope_average_is_the_mean_over_causal_distances) {
    struct {
        const char *what;
        int64_t dh, rope_dim, T;
        enum kv_rope_layout layout;
        enum kv_rope_scaling scaling;
    } rows[] = {
        {"interleaved, d_h 8, 16 positions", 8, 0, 16, KV_ROPE_INTERLEAVED, KV_ROPE_SCALING_NONE},
        {"rotate-half, d_h 8, 33 positions", 8, 0, 33, KV_ROPE_HALF, KV_ROPE_SCALING_NONE},
        {"rotate-half, 8 of d_h 12 rotated", 12, 8, 20, KV_ROPE_HALF, KV_ROPE_SCALING_NONE},
        {"llama3 scaling, 64 positions", 8, 0, 64, KV_ROPE_HALF, KV_ROPE_SCALING_LLAMA3},
        {"linear scaling", 8, 0, 24, KV_ROPE_INTERLEAVED, KV_ROPE_SCALING_LINEAR},
        {"yarn, its attention factor", 8, 0, 40, KV_ROPE_HALF, KV_ROPE_SCALING_YARN},
    };
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        struct kv_config c = {0};
        c.head_dim = rows[r].dh, c.rope_dim = rows[r].rope_dim, c.rope_theta = 500.0f;
        c.rope_layout = rows[r].layout;
        struct kv_rope_scaling_cfg *s = &c.rope_scaling;
        s->type = rows[r].scaling;
        s->factor = 4, s->original_ctx = 16, s->low_freq_factor = 1, s->high_freq_factor = 4;
        s->beta_fast = 32, s->beta_slow = 1;
        if (s->type == KV_ROPE_SCALING_YARN) s->attention_factor = 1.3;
        int64_t dh = c.head_dim, n2 = dh * dh;
        double *C = malloc((size_t)n2 * sizeof *C), *M = malloc((size_t)n2 * sizeof *M);
        double *want = malloc((size_t)n2 * sizeof *want);
        random_psd(dh, 11 + r, C);
        double *turns = kv_dec_rope_turns(&c, rows[r].T);
        cr_assert(turns);
        cr_assert_eq(kv_dec_rope_average(&c, rows[r].T, turns, C, M), KV_OK);
        naive_rope_average(&c, rows[r].T, C, want);
        kvt_assert_close_f64(M, want, n2, 1e-12, 1e-9, rows[r].what);
        free(C), free(M), free(want), free(turns);
    }
}

/* ================================================================ objectives */

/* A random biased GQA model (6 query heads on 2 KV heads, d_h 8) and its
 * statistics with Fisher sums over 6 windows of 32 random tokens. */
struct env {
    struct kv_model *m;
    struct kv_stats *s;
};

static struct env env_open(void) {
    struct env e;
    e.m = random_model(KV_ROPE_HALF, 1, 7);
    const struct kv_config *c = kv_model_config(e.m);
    int64_t seq = 32, nwin = 6;
    int32_t *tok = random_tokens(seq * nwin, c->vocab_size, 5);
    struct kv_accum *a = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(c, &e.s, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_model_fingerprint(e.m, e.s->info.fingerprint, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_stats_add_fisher(e.s, &err), KV_OK, "%s", fmt_err(&err));
    e.s->info.seq_len = seq;
    cr_assert_eq(kv_accum_init(e.m, e.s, seq, &a, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t w = 0; w < nwin; w++) {
        cr_assert_eq(kv_accum_window(a, tok + w * seq, &err), KV_OK, "%s", fmt_err(&err));
        e.s->info.tokens += seq, e.s->info.windows++;
    }
    kv_accum_sync(a);
    kv_accum_free(a);
    free(tok);
    return e;
}

static void env_free(struct env *e) {
    kv_stats_free(e->s);
    kv_model_close(e->m);
}

/* The metric of KV head j of layer l's side for a basis, per token, from
 * the model's weights and the raw sums by loops: keys (output) the group's
 * query covariance W_q C W_qᵀ (with the q bias terms) / N averaged over
 * the turns as naive_rope_average; values (output) Σ O_iᵀ O_i; loss the
 * gradient Gram / N; energy the identity. out [d_h, d_h]. */
static void naive_head_metric(const struct env *e, enum kv_basis basis, int64_t l, int side, int64_t j,
                              double *out) {
    const struct kv_config *c = kv_model_config(e->m);
    int64_t d = c->dim, dh = c->head_dim, grp = c->n_heads / c->n_kv_heads, n2 = dh * dh;
    const struct kv_stats_layer *L = &e->s->layers[l];
    double n = (double)e->s->info.tokens;
    memset(out, 0, (size_t)n2 * sizeof *out);
    if (basis == KV_BASIS_ENERGY) {
        for (int64_t a = 0; a < dh; a++) out[a * dh + a] = 1;
        return;
    }
    if (basis == KV_BASIS_LOSS) {
        const double *g = (side ? L->grad_v_cov : L->grad_k_cov) + j * n2;
        for (int64_t i = 0; i < n2; i++) out[i] = g[i] / n;
        return;
    }
    if (side) {
        const float *wo = kv_model_weight(e->m, KV_W_O, l);
        int64_t qd = c->n_heads * dh;
        for (int64_t i = j * grp; i < (j + 1) * grp; i++)
            for (int64_t a = 0; a < dh; a++)
                for (int64_t b = 0; b < dh; b++)
                    for (int64_t r = 0; r < d; r++)
                        out[a * dh + b] += (double)wo[r * qd + i * dh + a] * wo[r * qd + i * dh + b];
        return;
    }
    const float *wq = kv_model_weight(e->m, KV_W_Q, l), *bq = kv_model_weight(e->m, KV_W_BQ, l);
    double *cq = calloc((size_t)n2, sizeof *cq);
    for (int64_t i = j * grp; i < (j + 1) * grp; i++)
        for (int64_t a = 0; a < dh; a++)
            for (int64_t b = 0; b < dh; b++) {
                const float *wa = wq + (i * dh + a) * d, *wb = wq + (i * dh + b) * d;
                double acc = 0, sa = 0, sb = 0;
                for (int64_t p = 0; p < d; p++) {
                    for (int64_t r = 0; r < d; r++) acc += (double)wa[p] * L->xtx[p * d + r] * wb[r];
                    sa += (double)wa[p] * L->xsum[p], sb += (double)wb[p] * L->xsum[p];
                }
                if (bq) {
                    double ba = bq[i * dh + a], bb = bq[i * dh + b];
                    acc += sa * bb + ba * sb + n * ba * bb;
                }
                cq[a * dh + b] += acc / n;
            }
    naive_rope_average(c, e->s->info.seq_len, cq, out);
    free(cq);
}

/* Σ over the calibration tokens of (y - ŷ)ᵀ M (y - ŷ) for one unit, from
 * the raw sums: with E = W_u - up·down and e = b_u - up·down_bias - up_bias,
 * y - ŷ = E x + e, so the sum is tr(M E C Eᵀ) + 2 eᵀ M E Σx + N eᵀ M e.
 * M is block-diagonal over the unit's heads (naive_head_metric); r < rank
 * keeps only the first r latents (the nested basis of a lower rank). */
static double naive_objective(const struct env *e, const struct kv_lowrank *lr, enum kv_basis basis,
                              int64_t l, int side, int64_t u, int64_t r) {
    const struct kv_config *c = kv_model_config(e->m);
    int64_t d = c->dim, dh = c->head_dim;
    const struct kv_lr_unit *un = &side_of(lr, l, side)->units[u];
    int64_t mm = un->n_heads * dh, R = un->rank;
    const float *w = kv_model_weight(e->m, side ? KV_W_V : KV_W_K, l) + un->head0 * dh * d;
    const float *b = kv_model_weight(e->m, side ? KV_W_BV : KV_W_BK, l);
    const struct kv_stats_layer *L = &e->s->layers[l];
    double n = (double)e->s->info.tokens;
    double *E = malloc((size_t)(mm * d) * sizeof *E), *ev = malloc((size_t)mm * sizeof *ev);
    double *M = calloc((size_t)(mm * mm), sizeof *M), *hm = malloc((size_t)(dh * dh) * sizeof *hm);
    for (int64_t a = 0; a < mm; a++) {
        for (int64_t p = 0; p < d; p++) {
            double acc = 0;
            for (int64_t k = 0; k < r; k++) acc += (double)un->up[a * R + k] * un->down[k * d + p];
            E[a * d + p] = (double)w[a * d + p] - acc;
        }
        double acc = 0;
        for (int64_t k = 0; k < r; k++) acc += (double)un->up[a * R + k] * (un->down_bias ? un->down_bias[k] : 0);
        ev[a] = (b ? (double)b[un->head0 * dh + a] : 0) - acc - (un->up_bias ? un->up_bias[a] : 0);
    }
    for (int64_t h = 0; h < un->n_heads; h++) {
        naive_head_metric(e, basis, l, side, un->head0 + h, hm);
        for (int64_t a = 0; a < dh; a++)
            for (int64_t bb = 0; bb < dh; bb++) M[(h * dh + a) * mm + h * dh + bb] = hm[a * dh + bb];
    }
    double obj = 0;
    for (int64_t a = 0; a < mm; a++)
        for (int64_t bb = 0; bb < mm; bb++) {
            if (M[a * mm + bb] == 0) continue;
            /* (E C Eᵀ)[a][bb] + 2 e_a (E Σx)_bb + N e_a e_bb */
            double ece = 0, exs = 0;
            for (int64_t p = 0; p < d; p++) {
                double cp = 0;
                for (int64_t q = 0; q < d; q++) cp += L->xtx[p * d + q] * E[bb * d + q];
                ece += E[a * d + p] * cp;
                exs += E[bb * d + p] * L->xsum[p];
            }
            obj += M[a * mm + bb] * (ece + 2 * ev[a] * exs + n * ev[a] * ev[bb]);
        }
    free(E), free(ev), free(M), free(hm);
    return obj;
}

/* palu with a basis, centring, unit size and allocation; *o gets the
 * options as run. */
static struct kv_lowrank *run(const struct env *e, enum kv_basis basis, int center, int64_t group,
                              enum kv_alloc alloc, double eps, double ratio, struct kv_decompose_opts *o) {
    *o = opts_of(KV_METHOD_PALU, alloc, eps, ratio, group);
    o->basis = basis, o->center = center, o->stats_path = "s.kvstats";
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(e->m, e->s, o, &lr, &err), KV_OK, "%s: %s", kv_basis_name(basis), fmt_err(&err));
    return lr;
}

/* Every unit's reported error is its basis's objective, evaluated naively
 * from the factors; the output and loss bases are at least as good on
 * their own objective as the energy basis at the same ranks. */
Test(decompose_metric, every_basis_reports_and_meets_its_objective, .timeout = 240) {
    struct env e = env_open();
    const struct kv_config *c = kv_model_config(e.m);
    double worst_rel = 0;
    char where[160] = "";
    for (int center = 0; center < 2; center++)
        for (int64_t group = 1; group <= 2; group++) {
            struct kv_decompose_opts o;
            struct kv_lowrank *lr[KV_BASIS_COUNT];
            for (int b = 0; b < KV_BASIS_COUNT; b++)
                lr[b] = run(&e, (enum kv_basis)b, center, group, KV_ALLOC_UNIFORM, 0, 0.5, &o);
            for (int64_t l = 0; l < c->n_layers; l++)
                for (int side = 0; side < 2; side++)
                    for (int64_t u = 0; u < side_of(lr[0], l, side)->n_units; u++) {
                        double own[KV_BASIS_COUNT];
                        for (int b = 0; b < KV_BASIS_COUNT; b++) {
                            const struct kv_lr_unit *un = &side_of(lr[b], l, side)->units[u];
                            cr_assert_eq(un->rank, side_of(lr[0], l, side)->units[u].rank);
                            own[b] = naive_objective(&e, lr[b], (enum kv_basis)b, l, side, u, un->rank);
                            double rel = fabs(own[b] - un->dropped) / (un->energy > 0 ? un->energy : 1);
                            if (rel > worst_rel) {
                                worst_rel = rel;
                                snprintf(where, sizeof where, "%s, center %d, group %lld, layer %lld %s unit %lld: "
                                         "reported %.9g, naive %.9g of %.9g",
                                         kv_basis_name((enum kv_basis)b), center, (long long)group, (long long)l,
                                         side ? "v" : "k", (long long)u, un->dropped, own[b], un->energy);
                            }
                            cr_assert(rel <= 1e-5, "%s", where);
                        }
                        /* each basis against the energy basis's factors, on its objective */
                        for (int b = 1; b < KV_BASIS_COUNT; b++) {
                            double other = naive_objective(&e, lr[0], (enum kv_basis)b, l, side, u,
                                                           side_of(lr[0], l, side)->units[u].rank);
                            cr_assert(own[b] <= other * (1 + 1e-6) + 1e-9,
                                      "%s, center %d, group %lld, layer %lld %s unit %lld: %.9g, the energy "
                                      "basis %.9g", kv_basis_name((enum kv_basis)b), center, (long long)group,
                                      (long long)l, side ? "v" : "k", (long long)u, own[b], other);
                        }
                    }
            for (int b = 0; b < KV_BASIS_COUNT; b++) kv_lr_free(lr[b]);
        }
    cr_log_info("worst |reported - naive| / energy %.3g (%s)", worst_rel, where);
    env_free(&e);
}

/* --eps E keeps, per unit, the fewest latents whose plain error Σ‖y - ŷ‖²
 * is at most (1 - E) of the unit's variance Σ‖y - μ‖², for every basis,
 * centred or not: the error at its rank is within, one latent fewer is not
 * (the bases are nested, so the first r - 1 latents are that rank's). */
Test(decompose_metric, eps_is_the_fraction_of_the_variance_explained, .timeout = 240) {
    struct env e = env_open();
    const struct kv_config *c = kv_model_config(e.m);
    int64_t d = c->dim, dh = c->head_dim;
    double n = (double)e.s->info.tokens;
    double epss[] = {0.5, 0.8, 0.95};
    for (int b = 0; b < KV_BASIS_COUNT; b++)
        for (int center = 0; center < 2; center++)
            for (int k = 0; k < 3; k++) {
                struct kv_decompose_opts o;
                struct kv_lowrank *lr = run(&e, (enum kv_basis)b, center, 1, KV_ALLOC_EPS, epss[k], 0, &o);
                for (int64_t l = 0; l < c->n_layers; l++)
                    for (int side = 0; side < 2; side++)
                        for (int64_t u = 0; u < side_of(lr, l, side)->n_units; u++) {
                            const struct kv_lr_unit *un = &side_of(lr, l, side)->units[u];
                            /* the variance by its definition, Σ‖y‖² - N‖μ‖², y = W x + b */
                            const float *w = kv_model_weight(e.m, side ? KV_W_V : KV_W_K, l) + un->head0 * dh * d;
                            const float *bb = kv_model_weight(e.m, side ? KV_W_BV : KV_W_BK, l);
                            const struct kv_stats_layer *L = &e.s->layers[l];
                            double var = 0;
                            for (int64_t a = 0; a < un->n_heads * dh; a++) {
                                double sq = 0, sx = 0, ba = bb ? bb[un->head0 * dh + a] : 0;
                                for (int64_t p = 0; p < d; p++) {
                                    for (int64_t q = 0; q < d; q++) sq += (double)w[a * d + p] * L->xtx[p * d + q] * w[a * d + q];
                                    sx += (double)w[a * d + p] * L->xsum[p];
                                }
                                double sum_y2 = sq + 2 * ba * sx + n * ba * ba, mu = sx / n + ba;
                                var += sum_y2 - n * mu * mu;
                            }
                            double allow = (1 - epss[k]) * var;
                            double at = naive_objective(&e, lr, KV_BASIS_ENERGY, l, side, u, un->rank);
                            char what[128];
                            snprintf(what, sizeof what, "%s center %d eps %g layer %lld %s unit %lld rank %lld",
                                     kv_basis_name((enum kv_basis)b), center, epss[k], (long long)l,
                                     side ? "v" : "k", (long long)u, (long long)un->rank);
                            cr_assert(at <= allow * (1 + 1e-6) + 1e-9 * var, "%s: error %.9g over %.9g", what, at, allow);
                            if (un->rank > 1) {
                                double below = naive_objective(&e, lr, KV_BASIS_ENERGY, l, side, u, un->rank - 1);
                                cr_assert(below > allow * (1 - 1e-6), "%s: rank - 1 already within: %.9g <= %.9g",
                                          what, below, allow);
                            }
                        }
                kv_lr_free(lr);
            }
    env_free(&e);
}

/* Centred factors at full rank compute the base model: the mean comes back
 * through up_bias (keys, before RoPE) and o_fused_bias (values), or drops
 * out of the softmax (fused_query keys, gpt2). The in-repo models, one
 * window of byte tokens. */
Test(decompose_metric, centred_full_rank_is_the_base_model, .timeout = 240) {
    const char *models[] = {"data/kjv-llama", "data/kjv-gpt2"};
    for (int i = 0; i < 2; i++) {
        struct kv_model *m = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        kv_set_threads(1);
        cr_assert_eq(kv_model_open(models[i], NULL, &m, &err), KV_OK, "%s", fmt_err(&err));
        const struct kv_config *c = kv_model_config(m);
        int64_t seq = 64, V = c->vocab_size;
        int32_t *tok = random_tokens(seq * 3, 256, 9 + i);
        struct kv_stats *s = collect(m, tok, seq, 2);
        for (int b = 0; b < 2; b++) {
            struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_DEFAULT, 1.0, 0, 1);
            o.center = 1, o.basis = (enum kv_basis)b, o.stats_path = "s.kvstats";
            struct kv_lowrank *lr = decompose_ok(m, s, o, models[i]);
            struct kv_fwd *fb = NULL, *fc = NULL;
            float *lb = malloc((size_t)(seq * V) * sizeof *lb), *lc = malloc((size_t)(seq * V) * sizeof *lc);
            cr_assert_eq(kv_fwd_init(m, seq, &fb, &err), KV_OK, "%s", fmt_err(&err));
            cr_assert_eq(kv_fwd_init(m, seq, &fc, &err), KV_OK, "%s", fmt_err(&err));
            cr_assert_eq(kv_fwd_set_lowrank(fc, lr, 16, &err), KV_OK, "%s", fmt_err(&err));
            const int32_t *w = tok + 2 * seq; /* a window the statistics did not see */
            cr_assert_eq(kv_fwd_run(fb, w, seq, 0, lb, &err), KV_OK, "%s", fmt_err(&err));
            cr_assert_eq(kv_fwd_run(fc, w, seq, 0, lc, &err), KV_OK, "%s", fmt_err(&err));
            double worst = 0, big = 0, nb = 0, nc = 0;
            for (int64_t k = 0; k < seq * V; k++) {
                worst = fmax(worst, fabs((double)lc[k] - lb[k]));
                big = fmax(big, fabs((double)lb[k]));
            }
            for (int64_t t = 0; t + 1 < seq; t++)
                nb += kv_nll_row(lb + t * V, V, w[t + 1]), nc += kv_nll_row(lc + t * V, V, w[t + 1]);
            double rel = fabs(nc - nb) / nb;
            cr_log_info("%s %s basis: nll rel diff %.3g; max |Δlogit| %.3g of max |logit| %.3g", models[i],
                        kv_basis_name((enum kv_basis)b), rel, worst, big);
            cr_assert(rel <= 1e-6, "%s %s basis: nll %.9g against the base's %.9g", models[i],
                      kv_basis_name((enum kv_basis)b), nc, nb);
            /* logits: float rounding of up·down (seen: 9.9e-7 of the
             * largest logit on kjv-llama for the orthonormal energy basis,
             * 1.1e-6 for the output basis, whose up = S⁻¹ B is not) */
            cr_assert(worst <= 5e-6 * big, "%s %s basis: max |Δlogit| %.3g > 5e-6 of %.3g", models[i],
                      kv_basis_name((enum kv_basis)b), worst, big);
            /* the mean is really carried: the latents are centred */
            const struct kv_lr_unit *k0 = &lr->layers[0].k.units[0];
            cr_assert(k0->up_bias && lr->layers[0].o_fused_bias, "%s: no mean biases", models[i]);
            kv_fwd_free(fb), kv_fwd_free(fc);
            free(lb), free(lc);
            kv_lr_free(lr);
        }
        kv_stats_free(s);
        free(tok);
        kv_model_close(m);
    }
}

/* global with a byte target keeps the better of its greedy ranks and
 * uniform's on its objective, which with Fisher statistics is the
 * predicted loss Σ over units of (y - ŷ)ᵀ (F/N) (y - ŷ), F the gradient
 * Gram: recomputed here from each run's factors (naive_objective with the
 * loss metric), for every basis, against a separate uniform run at the
 * same target. */
Test(decompose_metric, global_is_never_worse_than_uniform_on_its_objective, .timeout = 240) {
    struct env e = env_open();
    double ratios[] = {0.2, 0.35, 0.5, 0.75};
    for (int b = 0; b < KV_BASIS_COUNT; b++)
        for (int k = 0; k < 4; k++) {
            struct kv_decompose_opts og, ou;
            struct kv_lowrank *g = run(&e, (enum kv_basis)b, 0, 1, KV_ALLOC_GLOBAL, 0, ratios[k], &og);
            struct kv_lowrank *u = run(&e, (enum kv_basis)b, 0, 1, KV_ALLOC_UNIFORM, 0, ratios[k], &ou);
            double obj[2] = {0, 0};
            const struct kv_lowrank *both[2] = {g, u};
            for (int t = 0; t < 2; t++)
                for (int64_t l = 0; l < g->info.n_layers; l++)
                    for (int side = 0; side < 2; side++) {
                        const struct kv_lr_side *sd = side_of(both[t], l, side);
                        for (int64_t x = 0; x < sd->n_units; x++)
                            obj[t] += naive_objective(&e, both[t], KV_BASIS_LOSS, l, side, x, sd->units[x].rank);
                    }
            cr_log_info("%s ratio %g: global %.9g, uniform %.9g, kept %s", kv_basis_name((enum kv_basis)b),
                        ratios[k], obj[0], obj[1], og.kept_uniform ? "uniform" : "global");
            cr_assert(kv_lr_bytes(g, 16) <= kv_lr_bytes(u, 16), "global's cache is the larger");
            cr_assert(obj[0] <= obj[1] * (1 + 1e-9), "%s ratio %g: global %.9g above uniform %.9g",
                      kv_basis_name((enum kv_basis)b), ratios[k], obj[0], obj[1]);
            cr_assert(fabs(og.objective - obj[0]) <= 1e-6 * obj[0], "%s ratio %g: reported objective %.9g, "
                      "counted %.9g", kv_basis_name((enum kv_basis)b), ratios[k], og.objective, obj[0]);
            kv_lr_free(g), kv_lr_free(u);
        }
    env_free(&e);
}

/* global with calibration tokens measures its ranks and uniform's: the
 * cache it returns is uniform's exactly when uniform's KL is the lower and
 * its cache no larger than the target or global's (a separate uniform run
 * gives its bytes), and the KL it reports for the cache kept is what an
 * independent comparison of the returned cache on the same windows gives. */
Test(decompose_metric, global_keeps_the_lower_measured_kl, .timeout = 240) {
    struct env e = env_open();
    const struct kv_config *c = kv_model_config(e.m);
    int64_t seq = 32, nwin = 3;
    int32_t *tok = random_tokens(seq * nwin, c->vocab_size, 77);
    int kept[2] = {0, 0};
    /* widths of 8: each a whole rank, so uniform lands on its target */
    double ratios[] = {0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875};
    for (int k = 0; k < 7; k++) {
        struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, ratios[k], 1);
        o.stats_path = "s.kvstats", o.calib_tokens = tok, o.seq_len = seq, o.calib_windows = nwin;
        struct kv_lowrank *lr = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose(e.m, e.s, &o, &lr, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert(o.probed, "ratio %g: not measured", ratios[k]);
        struct kv_compare_result r;
        cr_assert_eq(kv_ppl_compare(e.m, lr, 16, tok, seq * nwin, seq, nwin, NULL, NULL, &r, &err), KV_OK, "%s",
                     fmt_err(&err));
        double want = o.kept_uniform ? o.probe_kl_uniform : o.probe_kl;
        cr_log_info("ratio %g: global %.6g, uniform %.6g, kept %s, returned %.6g", ratios[k], o.probe_kl,
                    o.probe_kl_uniform, o.kept_uniform ? "uniform" : "global", r.kl);
        cr_assert(fabs(r.kl - want) <= 1e-9 * fmax(want, 1e-12), "ratio %g: the cache returned measures %.9g, "
                  "the kept one %.9g", ratios[k], r.kl, want);
        struct kv_decompose_opts ou;
        struct kv_lowrank *u = run(&e, KV_BASIS_ENERGY, 0, 1, KV_ALLOC_UNIFORM, 0, ratios[k], &ou);
        int64_t ub = kv_lr_bytes(u, 16), target = llround(ratios[k] * (double)kv_lr_base_bytes(c));
        int64_t gb = o.kept_uniform ? -1 : kv_lr_bytes(lr, 16);
        int should = o.probe_kl_uniform < o.probe_kl && (ub <= target || (gb >= 0 && ub <= gb));
        cr_assert_eq(o.kept_uniform, should, "ratio %g: kept %s; uniform's KL %.9g against %.9g, %lld bytes "
                     "against the target %lld", ratios[k], o.kept_uniform ? "uniform" : "global",
                     o.probe_kl_uniform, o.probe_kl, (long long)ub, (long long)target);
        if (o.kept_uniform) cr_assert_eq(kv_lr_bytes(lr, 16), ub);
        kv_lr_free(u);
        kept[o.kept_uniform]++;
        kv_lr_free(lr);
    }
    cr_log_info("kept global %d, uniform %d times", kept[0], kept[1]);
    cr_assert(kept[0] > 0 && kept[1] > 0, "both choices should occur on these ratios");
    free(tok);
    env_free(&e);
}
