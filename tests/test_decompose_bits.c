/* --kv-bits auto (calib/decompose_bits.c): the range constant against a
 * Monte Carlo, the band noise model against quantizing Gaussian latents
 * with the cache's own quantizer, the dynamic program against brute force
 * over every band layout, and a whole run on a random model: within the
 * target, its bands in the model the forward pass runs, bytes counted
 * band by band, and a mix no worse in the model than any one width. */
#include <cblas.h>
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decompose_ctx.h"
#include "decompose_fixtures.h"
#include "linalg.h"
#include "lrmodel.h"

/* A standard normal from a fixed-seed generator (Box–Muller). */
static double gauss(uint64_t *s) {
    double u1 = ((double)lcg(s) + 1.0) / 2147483649.0, u2 = (double)lcg(s) / 2147483648.0;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

Test(decompose_bits, range_constant_matches_monte_carlo) {
    int64_t nmax = 64;
    double *c = calloc((size_t)nmax + 1, sizeof *c);
    cr_assert(c);
    cr_assert_eq(kv_dec_range_sq(nmax, c), KV_OK);
    /* exact: no range for one value; X1 - X2 ~ N(0, 2) for two */
    double z = 0, two = 2.0;
    kvt_assert_close_f64(&c[1], &z, 1, 1e-12, 0, "c(1)");
    kvt_assert_close_f64(&c[2], &two, 1, 0, 1e-6, "c(2) = E[(X1 - X2)²] = 2");
    /* Monte Carlo: 200000 draws each, relative standard error under 0.4% */
    const int64_t ns[] = {3, 8, 13, 32, 64};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        int64_t n = ns[k], draws = 200000;
        uint64_t seed = 11 + (uint64_t)n;
        double acc = 0;
        for (int64_t t = 0; t < draws; t++) {
            double lo = INFINITY, hi = -INFINITY;
            for (int64_t i = 0; i < n; i++) {
                double v = gauss(&seed);
                lo = v < lo ? v : lo, hi = v > hi ? v : hi;
            }
            acc += (hi - lo) * (hi - lo);
        }
        double mc = acc / (double)draws;
        char what[64];
        snprintf(what, sizeof what, "c(%lld) against Monte Carlo", (long long)n);
        kvt_assert_close_f64(&c[n], &mc, 1, 0, 0.015, what);
        cr_log_info("c(%lld) = %.5f, Monte Carlo %.5f", (long long)n, c[n], mc);
    }
    free(c);
}

/* Quantize one band of n Gaussian latents with energies lam (descending)
 * as the cache does: rotated by kv_la_hadamard(n), per token at bits, back
 * to the basis; the measured Σ_t Σ_j w_j e_j² against kv_dec_band_noise. */
static void band_case(int64_t n, int bits, double spread, int dominant, const double *c, double *pred,
                      double *meas) {
    int64_t T = 20000;
    double *lam = calloc((size_t)n, sizeof *lam), *w = calloc((size_t)n, sizeof *w);
    double *H = calloc((size_t)(n * n), sizeof *H), *P = calloc((size_t)n + 1, sizeof *P);
    double *W = calloc((size_t)n + 1, sizeof *W), *C = calloc((size_t)n + 1, sizeof *C);
    float *y = calloc((size_t)n, sizeof *y);
    double *zz = calloc((size_t)n, sizeof *zz);
    cr_assert(lam && w && H && P && W && C && y && zz);
    kv_la_hadamard(n, H);
    uint64_t seed = 5 + (uint64_t)(n * 31 + bits);
    for (int64_t j = 0; j < n; j++) {
        lam[j] = pow(spread, -(double)j / (double)(n > 1 ? n - 1 : 1)); /* 1 down to 1/spread */
        w[j] = 0.5 + (double)(lcg(&seed) % 1000) / 1000.0;
    }
    if (dominant) lam[0] = 25; /* a mean direction, as uncentred latents have */
    double err = 0;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < n; j++) zz[j] = gauss(&seed) * sqrt(lam[j]);
        for (int64_t j = 0; j < n; j++) P[j + 1] += zz[j] * zz[j]; /* energies as sums, P below */
        /* cached row y = z H (row vector), quantized, back: ẑ = ŷ Hᵀ */
        for (int64_t b = 0; b < n; b++) {
            double s = 0;
            for (int64_t a = 0; a < n; a++) s += zz[a] * H[a * n + b];
            y[b] = (float)s;
        }
        float scale, zero, qmax = kv_lr_qmax(bits);
        kv_lr_qparams(y, n, bits, &scale, &zero);
        for (int64_t b = 0; b < n; b++) y[b] = kv_lr_dequant(kv_lr_qcode(y[b], scale, zero, qmax), scale, zero);
        for (int64_t a = 0; a < n; a++) {
            double s = 0;
            for (int64_t b = 0; b < n; b++) s += (double)y[b] * H[a * n + b];
            err += w[a] * (s - zz[a]) * (s - zz[a]);
        }
    }
    /* prefix sums: energies (summed over the tokens), w, and c_j = w_j Λ_j */
    for (int64_t j = 0; j < n; j++) {
        double en = P[j + 1];
        P[j + 1] = P[j] + en;
        W[j + 1] = W[j] + w[j];
        C[j + 1] = C[j] + w[j] * en;
    }
    *pred = kv_dec_band_noise(c, P, W, C, 0, n, bits);
    *meas = err;
    free(lam), free(w), free(H), free(P), free(W), free(C), free(y), free(zz);
}

Test(decompose_bits, band_noise_model_matches_measured_quantization, .timeout = 120) {
    int64_t nmax = 64;
    double *c = calloc((size_t)nmax + 1, sizeof *c);
    cr_assert(c);
    cr_assert_eq(kv_dec_range_sq(nmax, c), KV_OK);
    const int64_t ns[] = {4, 8, 13, 24, 32, 64};
    const int bitsv[] = {8, 4, 3, 2};
    /* energies equal, falling 4x across the band, and falling with a
     * first direction 25 times the next (a mean) */
    const double spreads[] = {1.0, 4.0, 4.0};
    const int dominant[] = {0, 0, 1};
    double worst = 0;
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (size_t b = 0; b < sizeof bitsv / sizeof bitsv[0]; b++)
            for (size_t s = 0; s < sizeof spreads / sizeof spreads[0]; s++) {
                double pred, meas;
                band_case(ns[a], bitsv[b], spreads[s], dominant[s], c, &pred, &meas);
                double rel = pred / meas - 1;
                cr_log_info("n %2lld, %d bits, energies 1 .. 1/%g%s: predicted %.4g, measured %.4g (%+.1f%%)",
                            (long long)ns[a], bitsv[b], spreads[s], dominant[s] ? " after 25" : "", pred,
                            meas, 100 * rel);
                worst = fabs(rel) > fabs(worst) ? rel : worst;
                char what[96];
                snprintf(what, sizeof what, "band noise, n %lld, %d bits, spread %g%s", (long long)ns[a],
                         bitsv[b], spreads[s], dominant[s] ? ", dominant first" : "");
                /* the model's approximations: Gaussian ranges, the
                 * smaller Hadamard blocks of n 13 counted by variance
                 * (seen: within 1.5% but at n 13 with falling energies,
                 * +6%); without the first direction's shift taken out
                 * the falling rows were +37% at n 4 */
                cr_assert(rel > -0.05 && rel < 0.15, "%s: predicted %g, measured %g (%+.1f%%)", what,
                          pred, meas, 100 * rel);
            }
    cr_log_info("worst relative model error %+.1f%%", 100 * worst);
    free(c);
}

/* ================================================================ search */

/* Every band layout of ranks floor..m (bands of strictly falling widths in
 * mask), the least cost + mu * bytes by enumeration. */
static void brute(const struct kv_dec_band_slot *sm, const double *c, double mu, unsigned mask,
                  int64_t at, int prev, double acc, double *best) {
    /* stop here: a rank of `at` */
    if (at >= sm->floor && (at % sm->mult == 0 || at == sm->m) && at > 0) {
        double t = acc + sm->T[at];
        if (t < *best) *best = t;
    }
    for (int w = prev + 1; w < KV_DECOMPOSE_N_WIDTHS; w++) {
        if (!(mask >> w & 1)) continue;
        int bits = KV_DECOMPOSE_WIDTHS[w];
        for (int64_t e = at + 1; e <= sm->m; e++) {
            double add = kv_dec_band_noise(c, sm->P, sm->W, sm->C, at, e, bits) +
                         mu * (double)(sm->nu * kv_lr_unit_bytes(e - at, bits));
            brute(sm, c, mu, mask, e, w, acc + add, best);
        }
    }
}

Test(decompose_bits, dynamic_program_is_the_brute_force_minimum) {
    int64_t m = 7;
    double c[8], P[8], W[8], C[8], T[8];
    cr_assert_eq(kv_dec_range_sq(m, c), KV_OK);
    uint64_t seed = 3;
    double dp[8 * KV_DECOMPOSE_N_WIDTHS];
    int64_t arg[8 * KV_DECOMPOSE_N_WIDTHS];
    for (int trial = 0; trial < 40; trial++) {
        P[0] = W[0] = C[0] = 0;
        double lam = 10.0;
        for (int64_t j = 0; j < m; j++) {
            lam *= 0.3 + 0.6 * (double)(lcg(&seed) % 1000) / 1000.0;
            double w = 0.2 + (double)(lcg(&seed) % 1000) / 500.0;
            P[j + 1] = P[j] + lam, W[j + 1] = W[j] + w, C[j + 1] = C[j] + w * lam;
        }
        for (int64_t r = 0; r <= m; r++) T[r] = C[m] - C[r];
        struct kv_dec_band_slot sm = {m, 1 + trial % 3, 1 + trial % 2, trial % 4 == 3 ? 2 : 1, 0, P, W, C, T};
        unsigned mask = trial % 5 == 4 ? (1u << (trial % KV_DECOMPOSE_N_WIDTHS)) : 31u;
        double mu = pow(10.0, -4.0 + 0.2 * trial) * C[m] / 16.0;
        struct kv_dec_bands got;
        double v = kv_dec_best_bands(&sm, c, mu, mask, dp, arg, &got);
        double want = INFINITY;
        brute(&sm, c, mu, mask, 0, -1, 0, &want);
        char what[64];
        snprintf(what, sizeof what, "trial %d: cheapest cost + mu bytes", trial);
        kvt_assert_close_f64(&v, &want, 1, 1e-12, 1e-12, what);
        /* the layout returned is what it says: bands in order, its cost and bytes */
        char why[160];
        cr_assert_eq(kv_lr_bands_check(got.bands, got.n_bands, got.rank, why, sizeof why), KV_OK,
                     "trial %d: %s", trial, why);
        double cost = T[got.rank];
        int64_t bytes = 0, at = 0;
        for (int i = 0; i < got.n_bands; i++) {
            cost += kv_dec_band_noise(c, P, W, C, at, at + got.bands[i].n, got.bands[i].bits);
            bytes += sm.nu * kv_lr_unit_bytes(got.bands[i].n, got.bands[i].bits);
            at += got.bands[i].n;
        }
        cr_assert_eq(bytes, got.bytes, "trial %d: bytes %lld, reported %lld", trial, (long long)bytes,
                     (long long)got.bytes);
        kvt_assert_close_f64(&got.cost, &cost, 1, 1e-12, 1e-12, "reported cost");
        double total = cost + mu * (double)bytes;
        kvt_assert_close_f64(&total, &v, 1, 1e-12, 1e-12, "cost + mu bytes of the layout");
    }
}

/* ================================================================ a run */

Test(decompose_bits, auto_run_meets_the_target_and_its_bands_run, .timeout = 240) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 7);
    const struct kv_config *c = kv_model_config(m);
    int64_t seq = 32, nwin = 6;
    int32_t *tok = random_tokens(seq * nwin, c->vocab_size, 5);
    struct kv_stats *s = NULL;
    struct kv_accum *a = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(c, &s, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_model_fingerprint(m, s->info.fingerprint, &err), KV_OK, "%s", fmt_err(&err));
    s->info.seq_len = seq;
    cr_assert_eq(kv_accum_init(m, s, seq, &a, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t w = 0; w < nwin; w++) {
        cr_assert_eq(kv_accum_window(a, tok + w * seq, &err), KV_OK, "%s", fmt_err(&err));
        s->info.tokens += seq, s->info.windows++;
    }
    kv_accum_sync(a);
    kv_accum_free(a);
    const double ratios[] = {0.15, 0.25, 0.4, 1.0};
    for (size_t k = 0; k < sizeof ratios / sizeof ratios[0]; k++) {
        struct kv_decompose_opts o;
        kv_decompose_defaults(&o);
        o.kv_bits = KV_DECOMPOSE_BITS_AUTO, o.ratio = ratios[k];
        struct kv_lowrank *lr = NULL;
        cr_assert_eq(kv_decompose(m, s, &o, &lr, &err), KV_OK, "%s", fmt_err(&err));
        struct kv_lr_info li = kv_lr_info(lr);
        /* mixed, or one width when every unit came out one band of it */
        cr_assert(li.kv_bits == KV_LR_BITS_MIXED || kv_lr_bits_valid(li.kv_bits), "kv_bits %d", li.kv_bits);
        cr_assert(li.hadamard && o.hadamard && o.alloc == KV_ALLOC_GLOBAL);
        /* bytes counted band by band from the public unit records */
        int64_t bytes = 0, base = kv_lr_base_bytes(c);
        for (int64_t l = 0; l < li.n_layers; l++)
            for (int side = 0; side < 2; side++) {
                if (kv_lr_mode_of(lr, l, side) == KV_LR_FULL) {
                    bytes += c->n_kv_heads * c->head_dim * 2;
                    continue;
                }
                for (int64_t u = 0; u < kv_lr_n_units(lr, l, side); u++) {
                    struct kv_lr_unit_info ui = kv_lr_unit_info(lr, l, side, u);
                    if (li.kv_bits != KV_LR_BITS_MIXED) { /* one width: no bands left */
                        cr_assert_eq(ui.n_bands, 0);
                        ui.n_bands = 1, ui.bands[0] = (struct kv_lr_band){ui.rank, li.kv_bits};
                    }
                    char why[160];
                    cr_assert_eq(kv_lr_bands_check(ui.bands, ui.n_bands, ui.rank, why, sizeof why), KV_OK,
                                 "layer %lld side %d unit %lld: %s", (long long)l, side, (long long)u, why);
                    for (int b = 0; b < ui.n_bands; b++)
                        bytes += ui.bands[b].bits >= 16 ? 2 * ui.bands[b].n
                                                        : (ui.bands[b].n * ui.bands[b].bits + 7) / 8 + 4;
                }
            }
        cr_assert_eq(bytes, kv_lr_bytes(lr, li.kv_bits), "bytes by hand %lld, kv_lr_bytes %lld",
                     (long long)bytes, (long long)kv_lr_bytes(lr, li.kv_bits));
        cr_assert_leq(bytes, o.target_bytes, "ratio %g: %lld bytes over the target %lld", ratios[k],
                      (long long)bytes, (long long)o.target_bytes);
        cr_assert_eq(o.achieved_bytes, bytes);
        /* the choice kept is the least modelled cost of the mix and the
         * widths, and says which (the mix's own search can lose to one
         * width's: each bisects its own price, and the byte overhead of a
         * quantized band leaves gaps; seen at 0.15 on this model) */
        double least = o.objective_mix;
        int want_kept = 0;
        for (int w = 0; w < KV_DECOMPOSE_N_WIDTHS; w++)
            if (o.objective_fixed[w] < least) least = o.objective_fixed[w], want_kept = KV_DECOMPOSE_WIDTHS[w];
        cr_assert(o.objective == least && o.fixed_kept == want_kept,
                  "ratio %g: kept %g (width %d), least %g (width %d)", ratios[k], o.objective,
                  o.fixed_kept, least, want_kept);
        if (want_kept) cr_assert_eq(li.kv_bits, want_kept, "ratio %g: %d-bit kept", ratios[k], want_kept);
        cr_log_info("ratio %g: %lld of %lld bytes, modelled cost %.4g (16 %.4g, 8 %.4g, 4 %.4g, 3 %.4g, 2 %.4g)",
                    ratios[k], (long long)bytes, (long long)base, o.objective_mix, o.objective_fixed[0],
                    o.objective_fixed[1], o.objective_fixed[2], o.objective_fixed[3],
                    o.objective_fixed[4]);
        /* and it runs: the forward pass takes the bands */
        struct kv_compare_result r;
        cr_assert_eq(kv_ppl_compare(m, lr, li.kv_bits, tok, seq * 2, seq, 2, NULL, NULL, &r, &err),
                     KV_OK, "%s", fmt_err(&err));
        cr_assert(isfinite(r.kl) && r.kl >= 0);
        if (ratios[k] == 1.0) { /* every byte: full rank in fp16, the base model */
            cr_assert_eq(li.kv_bits, 16, "ratio 1: kv_bits %d", li.kv_bits);
            for (int64_t l = 0; l < li.n_layers; l++)
                for (int side = 0; side < 2; side++)
                    for (int64_t u = 0; u < kv_lr_n_units(lr, l, side); u++) {
                        struct kv_lr_unit_info ui = kv_lr_unit_info(lr, l, side, u);
                        cr_assert(ui.rank == ui.n_heads * c->head_dim,
                                  "ratio 1: layer %lld side %d unit %lld: rank %lld", (long long)l,
                                  side, (long long)u, (long long)ui.rank);
                    }
            double want = r.base.nll;
            kvt_assert_close_f64(&r.comp.nll, &want, 1, 0, 1e-6, "ratio 1: nll against the base");
        }
        kv_lr_free(lr);
    }
    free(tok);
    kv_stats_free(s);
    kv_model_close(m);
}

/* A mixed model whose every unit is one band at b runs exactly as the same
 * factors at kv_bits b: the band path is the unit path. */
Test(decompose_bits, one_band_is_the_single_width_path, .timeout = 120) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 9);
    const struct kv_config *c = kv_model_config(m);
    int64_t seq = 24;
    int32_t *tok = random_tokens(seq * 2, c->vocab_size, 6);
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_decompose_opts o;
    kv_decompose_defaults(&o);
    o.method = KV_METHOD_SVD, o.ratio = 0.4;
    struct kv_lowrank *lr = NULL;
    cr_assert_eq(kv_decompose(m, NULL, &o, &lr, &err), KV_OK, "%s", fmt_err(&err));
    const int widths[] = {16, 8, 4, 3, 2};
    for (size_t k = 0; k < 5; k++) {
        struct kv_compare_result ra, rb;
        cr_assert_eq(kv_lr_set_kv_bits(lr, widths[k], &err), KV_OK);
        cr_assert_eq(kv_ppl_compare(m, lr, widths[k], tok, seq * 2, seq, 2, NULL, NULL, &ra, &err), KV_OK,
                     "%s", fmt_err(&err));
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                struct kv_lr_side *sd = kv_lr_side(lr, l, side);
                for (int64_t u = 0; u < sd->n_units; u++)
                    sd->units[u].n_bands = 1, sd->units[u].bands[0] = (struct kv_lr_band){sd->units[u].rank, widths[k]};
            }
        lr->info.kv_bits = KV_LR_BITS_MIXED;
        cr_assert_eq(kv_lr_bytes(lr, KV_LR_BITS_MIXED), kv_lr_bytes(lr, widths[k]));
        cr_assert_eq(kv_ppl_compare(m, lr, KV_LR_BITS_MIXED, tok, seq * 2, seq, 2, NULL, NULL, &rb, &err),
                     KV_OK, "%s", fmt_err(&err));
        cr_assert(ra.comp.nll == rb.comp.nll, "%d bits: nll %.17g as one width, %.17g as one band",
                  widths[k], ra.comp.nll, rb.comp.nll);
        /* kv_lr_set_kv_bits drops the bands */
        cr_assert_eq(kv_lr_set_kv_bits(lr, 16, &err), KV_OK);
        cr_assert_eq(lr->layers[0].k.units[0].n_bands, 0);
    }
    kv_lr_free(lr);
    free(tok);
    kv_model_close(m);
}

/* The rotation of a unit with bands: block diagonal, one kv_la_hadamard
 * per band, orthonormal. */
Test(decompose_bits, band_rotation_is_block_diagonal_and_orthonormal) {
    struct kv_lr_unit un = {0};
    un.rank = 23, un.n_bands = 3;
    un.bands[0] = (struct kv_lr_band){5, 16}, un.bands[1] = (struct kv_lr_band){8, 4};
    un.bands[2] = (struct kv_lr_band){10, 2};
    double H[23 * 23], B[10 * 10], hht[23 * 23], eye[23 * 23];
    kv_lr_unit_hadamard(&un, H);
    int64_t at = 0;
    for (int b = 0; b < 3; b++) {
        int64_t n = un.bands[b].n;
        kv_la_hadamard(n, B);
        for (int64_t i = 0; i < 23; i++)
            for (int64_t j = 0; j < 23; j++) {
                int in_i = i >= at && i < at + n, in_j = j >= at && j < at + n;
                if (in_i && in_j)
                    cr_assert(H[i * 23 + j] == B[(i - at) * n + (j - at)], "band %d (%lld, %lld)", b,
                              (long long)i, (long long)j);
                else if (in_i || in_j)
                    cr_assert(H[i * 23 + j] == 0, "outside band %d (%lld, %lld)", b, (long long)i, (long long)j);
            }
        at += n;
    }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 23, 23, 23, 1.0, H, 23, H, 23, 0.0, hht, 23);
    for (int i = 0; i < 23 * 23; i++) eye[i] = i % 24 == 0;
    kvt_assert_close_f64(hht, eye, 23 * 23, 1e-14, 0, "H Hᵀ = I");
}
