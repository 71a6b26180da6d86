/* Derived covariances and spectra: kv_stats_out_cov against naive float64
 * projections of the same activations, kv_la_eigh against the identity
 * A = V diag(λ) Vᵀ of a matrix built from known eigenvalues, and the energy
 * rank rule on hand-computed cases. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvstats.h"
#include "linalg.h"
#include "model.h"
#include "testutil.h"

/* Random orthogonal Q (n×n) by Gram-Schmidt of a fixed pseudo-random matrix. */
static void orthogonal(double *q, int n, unsigned seed) {
    for (int i = 0; i < n * n; i++) {
        seed = seed * 1103515245u + 12345u;
        q[i] = (double)(seed >> 8) / 16777216.0 - 0.5;
    }
    for (int j = 0; j < n; j++) {
        for (int k = 0; k < j; k++) {
            double dot = 0;
            for (int i = 0; i < n; i++) dot += q[i * n + j] * q[i * n + k];
            for (int i = 0; i < n; i++) q[i * n + j] -= dot * q[i * n + k];
        }
        double nn = 0;
        for (int i = 0; i < n; i++) nn += q[i * n + j] * q[i * n + j];
        for (int i = 0; i < n; i++) q[i * n + j] /= sqrt(nn);
    }
}

Test(linalg, eigvals_recover_known_spectrum) {
    int n = 12;
    double q[144], a[144], lam[12], got[12];
    orthogonal(q, n, 7);
    for (int i = 0; i < n; i++) lam[i] = (i % 3 == 0 ? -1.0 : 1.0) * pow(2.0, -i) * 10.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int k = 0; k < n; k++) s += q[i * n + k] * lam[k] * q[j * n + k];
            a[i * n + j] = s;
        }
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(a, n, got, NULL, "test matrix", &err), KV_OK, "%s", err.msg);
    /* expected: lam sorted descending */
    double want[12];
    memcpy(want, lam, sizeof want);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (want[j] > want[i]) {
                double t = want[i];
                want[i] = want[j];
                want[j] = t;
            }
    kvt_assert_close_f64(got, want, n, 1e-12, 1e-12, "eigenvalues");
}

Test(linalg, eigvals_refuse_nan_naming_the_matrix) {
    double a[4] = {1, 0, 0, NAN}, w[2];
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(a, 2, w, NULL, "layer 3 xtx", &err), KV_ENUMERIC);
    cr_assert_str_eq(err.msg, "layer 3 xtx: non-finite value nan at row 1, column 1");
}

Test(linalg, energy_rank_rule) {
    double l[5] = {5, 3, 1, 0.5, 0.5}; /* total 10 */
    cr_assert_eq(kv_la_energy_rank(l, 5, 0.5), 1);
    cr_assert_eq(kv_la_energy_rank(l, 5, 0.8), 2);
    cr_assert_eq(kv_la_energy_rank(l, 5, 0.81), 3);
    cr_assert_eq(kv_la_energy_rank(l, 5, 0.9), 3);
    cr_assert_eq(kv_la_energy_rank(l, 5, 0.95), 4);
    cr_assert_eq(kv_la_energy_rank(l, 5, 1.0), 5);
    double neg[3] = {2, 0, -1e-9}; /* rounding negatives count as 0 */
    cr_assert_eq(kv_la_energy_rank(neg, 3, 1.0), 1);
    double zero[2] = {0, 0};
    cr_assert_eq(kv_la_energy_rank(zero, 2, 0.9), 0);
}

/* Accumulate stats on a biased GQA model; the K/V output covariance derived
 * from C_x and Σx must equal Σ yᵀy of y = x Wᵀ + b computed naively. */
struct capture {
    int64_t d, kd, dh;
    const struct kv_model *m;
    double *ck[2]; /* per layer: [kd, kd] naive Σ yᵀy of K (which 0) and V (1) */
    int64_t layers;
};

static int grab(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0) {
    struct capture *c = ctx;
    for (int which = 0; which < 2; which++) {
        const float *w = c->m->layers[layer].w[which ? KV_W_V : KV_W_K];
        const float *b = c->m->layers[layer].w[which ? KV_W_BV : KV_W_BK];
        double *acc = c->ck[which] + layer * c->kd * c->kd;
        double *y = calloc((size_t)c->kd, sizeof *y);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t o = 0; o < c->kd; o++) {
                double s = b ? (double)b[o] : 0;
                for (int64_t i = 0; i < c->d; i++) s += (double)x[t * c->d + i] * w[o * c->d + i];
                y[o] = s;
            }
            for (int64_t i = 0; i < c->kd; i++)
                for (int64_t j = 0; j < c->kd; j++) acc[i * c->kd + j] += y[i] * y[j];
        }
        free(y);
    }
    return 0;
}

static void out_cov_case(int bias) {
    struct kv_config cfg = {0};
    cfg.dim = 24, cfg.hidden_dim = 40, cfg.n_layers = 2, cfg.n_heads = 4, cfg.n_kv_heads = 2;
    cfg.head_dim = 6, cfg.vocab_size = 61, cfg.max_seq_len = 64, cfg.norm_eps = 1e-5f;
    cfg.rope_theta = 10000, cfg.has_qkv_bias = bias, cfg.bos_id = 1, cfg.eos_id = 2;
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 11, &m, &err), KV_OK, "%s", err.msg);
    if (bias) /* the random init leaves biases tiny; make them matter */
        for (int64_t l = 0; l < cfg.n_layers; l++)
            for (int k = KV_W_BK; k <= KV_W_BV; k++) {
                float *b = (float *)m->layers[l].w[k];
                for (int64_t i = 0; i < cfg.n_kv_heads * cfg.head_dim; i++)
                    b[i] = 0.3f * (float)((i * 37 + l * 11 + k) % 7) - 0.9f;
            }
    struct kv_stats *s;
    cr_assert_eq(kv_stats_init(&cfg, &s, &err), KV_OK);
    int64_t seq = 20, nw = 5, kd = cfg.n_kv_heads * cfg.head_dim;
    struct kv_accum *a;
    cr_assert_eq(kv_accum_init(m, s, seq, &a, &err), KV_OK, "%s", err.msg);
    struct capture cap = {cfg.dim, kd, cfg.head_dim, m, {NULL, NULL}, cfg.n_layers};
    for (int w = 0; w < 2; w++) cap.ck[w] = calloc((size_t)(cfg.n_layers * kd * kd), sizeof(double));
    struct kv_fwd *f;
    cr_assert_eq(kv_fwd_init(m, seq, &f, &err), KV_OK);
    struct kv_fwd_hooks hk = {.ctx = &cap, .attn_in = grab, .hooks_only = 1};
    kv_fwd_set_hooks(f, &hk);
    int32_t ids[20];
    for (int64_t w = 0; w < nw; w++) {
        for (int64_t i = 0; i < seq; i++) ids[i] = (int32_t)((w * 13 + i * 7 + 1) % cfg.vocab_size);
        cr_assert_eq(kv_accum_window(a, ids, &err), KV_OK, "%s", err.msg);
        cr_assert_eq(kv_fwd_run(f, ids, seq, 0, NULL, &err), KV_OK);
        s->info.tokens += seq, s->info.windows++;
    }
    kv_accum_sync(a);
    int64_t dh = cfg.head_dim;
    double *got = malloc((size_t)(kd * kd) * sizeof *got), *want = malloc((size_t)(kd * kd) * sizeof *want);
    for (int64_t l = 0; l < cfg.n_layers; l++)
        for (int which = 0; which < 2; which++) {
            const double *ref = cap.ck[which] + l * kd * kd;
            /* both heads together (a unit of 2), and each head alone */
            cr_assert_eq(kv_stats_out_cov(s, m, l, which, 0, 2, got, &err), KV_OK, "%s", err.msg);
            kvt_assert_close_f64(got, ref, kd * kd, 1e-9, 1e-9, "unit of both kv heads");
            for (int64_t h = 0; h < 2; h++) {
                cr_assert_eq(kv_stats_out_cov(s, m, l, which, h, 1, got, &err), KV_OK);
                for (int64_t i = 0; i < dh; i++)
                    for (int64_t j = 0; j < dh; j++)
                        want[i * dh + j] = ref[(h * dh + i) * kd + h * dh + j];
                kvt_assert_close_f64(got, want, dh * dh, 1e-9, 1e-9, "one kv head");
            }
            /* every head's block in one call: blocks of 1 head, then of 2 */
            cr_assert_eq(kv_stats_out_cov_blocks(s, m, l, which, 1, got, &err), KV_OK);
            for (int64_t h = 0; h < 2; h++) {
                for (int64_t i = 0; i < dh; i++)
                    for (int64_t j = 0; j < dh; j++)
                        want[i * dh + j] = ref[(h * dh + i) * kd + h * dh + j];
                kvt_assert_close_f64(got + h * dh * dh, want, dh * dh, 1e-9, 1e-9, "block of one head");
            }
            cr_assert_eq(kv_stats_out_cov_blocks(s, m, l, which, 2, got, &err), KV_OK);
            kvt_assert_close_f64(got, ref, kd * kd, 1e-9, 1e-9, "block of both kv heads");
        }
    /* C_x is read from its upper triangle only: NaN below the diagonal
     * changes nothing */
    for (int64_t l = 0; l < cfg.n_layers; l++) {
        double *x = s->layers[l].xtx;
        for (int64_t i = 0; i < cfg.dim; i++)
            for (int64_t j = 0; j < i; j++) x[i * cfg.dim + j] = NAN;
        for (int which = 0; which < 2; which++) {
            cr_assert_eq(kv_stats_out_cov_blocks(s, m, l, which, 2, got, &err), KV_OK);
            kvt_assert_close_f64(got, cap.ck[which] + l * kd * kd, kd * kd, 1e-9, 1e-9,
                                 "upper triangle of C_x only");
        }
    }
    free(got), free(want), free(cap.ck[0]), free(cap.ck[1]);
    kv_fwd_free(f);
    kv_accum_free(a);
    kv_stats_free(s);
    kv_model_close(m);
}

Test(spectrum, out_cov_equals_naive_projection_without_bias) { out_cov_case(0); }
Test(spectrum, out_cov_equals_naive_projection_with_bias) { out_cov_case(1); }

/* The layer spectrum's pieces agree with direct eigenvalue calls. */
Test(spectrum, layer_summary_matches_its_definition) {
    struct kv_config cfg = {0};
    cfg.dim = 16, cfg.hidden_dim = 24, cfg.n_layers = 1, cfg.n_heads = 2, cfg.n_kv_heads = 1;
    cfg.head_dim = 8, cfg.vocab_size = 31, cfg.max_seq_len = 32, cfg.norm_eps = 1e-5f;
    cfg.rope_theta = 10000, cfg.bos_id = 1, cfg.eos_id = 2;
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 3, &m, &err), KV_OK);
    struct kv_stats *s;
    cr_assert_eq(kv_stats_init(&cfg, &s, &err), KV_OK);
    struct kv_accum *a;
    cr_assert_eq(kv_accum_init(m, s, 32, &a, &err), KV_OK);
    int32_t ids[32];
    for (int i = 0; i < 32; i++) ids[i] = (i * 5 + 2) % 31;
    cr_assert_eq(kv_accum_window(a, ids, &err), KV_OK);
    kv_accum_sync(a);
    s->info.tokens = 32, s->info.windows = 1;
    struct kv_head_spectrum hs[1];
    struct kv_layer_spectrum sp = {.heads = hs};
    cr_assert_eq(kv_stats_layer_spectrum(s, m, 0, &sp, &err), KV_OK, "%s", err.msg);
    double lam[16], tr = 0;
    for (int i = 0; i < 16; i++) tr += s->layers[0].xtx[i * 16 + i];
    cr_assert_eq(kv_la_eigh(s->layers[0].xtx, 16, lam, NULL, "x", &err), KV_OK);
    double sum = 0;
    for (int i = 0; i < 16; i++) sum += lam[i];
    cr_assert(fabs(sum - tr) <= 1e-10 * tr, "eigenvalues sum %g, trace %g", sum, tr);
    cr_assert(fabs(sp.trace - tr) <= 1e-12 * tr);
    cr_assert_eq(sp.x90, kv_la_energy_rank(lam, 16, 0.9));
    cr_assert(fabs(sp.cond - lam[0] / lam[15]) <= 1e-9 * sp.cond);
    double kc[64], kl[8];
    cr_assert_eq(kv_stats_out_cov(s, m, 0, 1, 0, 1, kc, &err), KV_OK);
    cr_assert_eq(kv_la_eigh(kc, 8, kl, NULL, "v", &err), KV_OK);
    cr_assert_eq(hs[0].v99, kv_la_energy_rank(kl, 8, 0.99));
    cr_assert_eq(kv_la_eigh(s->layers[0].k_cov, 8, kl, NULL, "k", &err), KV_OK);
    cr_assert_eq(hs[0].krope90, kv_la_energy_rank(kl, 8, 0.9));
    /* without a model the K/V ranks are absent */
    cr_assert_eq(kv_stats_layer_spectrum(s, NULL, 0, &sp, &err), KV_OK);
    cr_assert_eq(hs[0].k90, -1);
    kv_accum_free(a);
    kv_stats_free(s);
    kv_model_close(m);
}
