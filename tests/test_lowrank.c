/* Low-rank numerics. kv_la_eigh and kv_la_svd are checked against their
 * defining identities with naive loops; the Cholesky-whitened SVD against the
 * eigen route W V_r V_rᵀ (DESIGN §3.1); the eigen route's error against the
 * dropped eigenvalues and against random rank-r projections; Hadamard
 * matrices against orthonormality and the Sylvester recursion, and the
 * Hadamard fusion (kv_lr_fuse_hadamard) against the latent forward pass's
 * logits before and after. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linalg.h"
#include "lrmodel.h"
#include "testutil.h"

/* ---------------------------------------------------------------- helpers */

struct rng {
    uint64_t s;
};

static uint64_t rng_next(struct rng *g) {
    g->s ^= g->s << 13;
    g->s ^= g->s >> 7;
    g->s ^= g->s << 17;
    return g->s;
}

/* uniform in (0, 1) */
static double rng_unif(struct rng *g) {
    return ((double)(rng_next(g) >> 11) + 0.5) / 9007199254740992.0;
}

/* standard normal (Box-Muller; one value per call keeps it simple) */
static double rng_normal(struct rng *g) {
    double u1 = rng_unif(g), u2 = rng_unif(g);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static double *randn(struct rng *g, int64_t n) {
    double *a = malloc((size_t)n * sizeof *a);
    cr_assert(a);
    for (int64_t i = 0; i < n; i++) a[i] = rng_normal(g);
    return a;
}

/* c [m, n] = a [m, k] · b [k, n], naive, with optional transposes of the
 * stored operands (ta: a is stored [k, m]; tb: b is stored [n, k]). */
static void matmul(const double *a, const double *b, double *c, int64_t m, int64_t k, int64_t n,
                   int ta, int tb) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0;
            for (int64_t p = 0; p < k; p++)
                s += (ta ? a[p * m + i] : a[i * k + p]) * (tb ? b[j * k + p] : b[p * n + j]);
            c[i * n + j] = s;
        }
}

static double frob(const double *a, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * a[i];
    return sqrt(s);
}

/* ‖got − ref‖_F <= rtol·‖ref‖_F + atol, reporting the worst element. */
static void assert_rel_frob(const double *got, const double *ref, int64_t n, double rtol,
                            double atol, const char *what) {
    double diff = 0, worst = -1;
    int64_t wi = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(got[i] - ref[i]);
        diff += e * e;
        if (e > worst) worst = e, wi = i;
    }
    diff = sqrt(diff);
    double nr = frob(ref, n);
    cr_assert(diff <= rtol * nr + atol,
              "%s: relative Frobenius error %.3g (atol %.3g) exceeds %.3g; worst element %lld: "
              "got %.17g, want %.17g",
              what, nr > 0 ? diff / nr : diff, atol, rtol, (long long)wi, got[wi], ref[wi]);
}

/* VᵀV = I for the k columns of the [rows, k] matrix v. */
static void assert_orthonormal_cols(const double *v, int64_t rows, int64_t k, double tol,
                                    const char *what) {
    double *g = malloc((size_t)(k * k) * sizeof *g), *eye = calloc((size_t)(k * k), sizeof *eye);
    matmul(v, v, g, k, rows, k, 1, 0);
    for (int64_t i = 0; i < k; i++) eye[i * k + i] = 1;
    kvt_assert_close_f64(g, eye, k * k, tol, 0, what);
    free(g);
    free(eye);
}

/* The first entry of largest magnitude of column j is positive. */
static void assert_sign_convention(const double *a, int64_t rows, int64_t ld, int64_t j,
                                   const char *what) {
    int64_t best = 0;
    for (int64_t i = 1; i < rows; i++)
        if (fabs(a[i * ld + j]) > fabs(a[best * ld + j])) best = i;
    cr_assert(a[best * ld + j] > 0, "%s: column %lld has its largest entry %g negative", what,
              (long long)j, a[best * ld + j]);
}

static void assert_descending(const double *w, int64_t n, const char *what) {
    for (int64_t i = 1; i < n; i++)
        cr_assert(w[i] <= w[i - 1], "%s: value %lld (%g) exceeds value %lld (%g)", what,
                  (long long)i, w[i], (long long)(i - 1), w[i - 1]);
}

/* ---------------------------------------------------------------- eigh */

static void eigh_case(int64_t n, uint64_t seed) {
    struct rng g = {seed};
    double *a = randn(&g, n * n);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < i; j++) a[i * n + j] = a[j * n + i];
    double *w = malloc((size_t)n * sizeof *w), *v = malloc((size_t)(n * n) * sizeof *v);
    double *av = malloc((size_t)(n * n) * sizeof *av), *vw = malloc((size_t)(n * n) * sizeof *vw);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(a, n, w, v, "test matrix", &err), KV_OK, "n %lld: %s", (long long)n,
                 err.msg);

    matmul(a, v, av, n, n, n, 0, 0);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) vw[i * n + j] = v[i * n + j] * w[j];
    char what[64];
    snprintf(what, sizeof what, "A V = V diag(w), n %lld", (long long)n);
    assert_rel_frob(av, vw, n * n, 0, 1e-10 * frob(a, n * n), what);
    snprintf(what, sizeof what, "VᵀV = I, n %lld", (long long)n);
    assert_orthonormal_cols(v, n, n, 1e-10, what);
    assert_descending(w, n, "eigenvalues");
    for (int64_t j = 0; j < n; j++) assert_sign_convention(v, n, n, j, "eigenvectors");
    /* the trace is the eigenvalue sum */
    double tr = 0, sw = 0;
    for (int64_t i = 0; i < n; i++) tr += a[i * n + i], sw += w[i];
    cr_assert(fabs(tr - sw) <= 1e-10 * (frob(a, n * n) * n + 1), "trace %g, eigenvalue sum %g", tr,
              sw);

    /* only the upper triangle is read: finite garbage below changes nothing */
    double *a2 = malloc((size_t)(n * n) * sizeof *a2), *w2 = malloc((size_t)n * sizeof *w2);
    double *v2 = malloc((size_t)(n * n) * sizeof *v2);
    memcpy(a2, a, (size_t)(n * n) * sizeof *a2);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < i; j++) a2[i * n + j] = 1e3 * (double)(i - j);
    cr_assert_eq(kv_la_eigh(a2, n, w2, v2, "test matrix", &err), KV_OK, "%s", err.msg);
    kvt_assert_close_f64(w2, w, n, 0, 0, "eigenvalues with a junk lower triangle");
    kvt_assert_close_f64(v2, v, n * n, 0, 0, "eigenvectors with a junk lower triangle");
    free(a), free(w), free(v), free(av), free(vw), free(a2), free(w2), free(v2);
}

Test(lr_eigh, random_symmetric_identities) {
    eigh_case(1, 11);
    eigh_case(2, 12);
    eigh_case(7, 13);
    eigh_case(64, 14);
}

Test(lr_eigh, known_spectrum_with_repeats_sorted_descending) {
    /* A = Q diag(lam) Qᵀ with a random orthogonal Q (from eigh of a random
     * symmetric matrix, checked orthonormal above) */
    int64_t n = 9;
    struct rng g = {21};
    double *s = randn(&g, n * n), q[81], lam0[9], a[81], w[9], v[81];
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < i; j++) s[i * n + j] = s[j * n + i];
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(s, n, lam0, q, "q", &err), KV_OK);
    double lam[9] = {-3, 5, 0.5, 5, 2, -0.25, 7, 1, 0};
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) {
            double t = 0;
            for (int64_t k = 0; k < n; k++) t += q[i * n + k] * lam[k] * q[j * n + k];
            a[i * n + j] = t;
        }
    cr_assert_eq(kv_la_eigh(a, n, w, v, "a", &err), KV_OK);
    double want[9] = {7, 5, 5, 2, 1, 0.5, 0, -0.25, -3};
    kvt_assert_close_f64(w, want, n, 1e-12, 1e-12, "eigenvalues");
    free(s);
}

Test(lr_eigh, rejects_nan_naming_the_matrix) {
    double a[9] = {1, 2, 3, 2, 4, 5, 3, 5, 6}, w[3], v[9];
    a[7] = NAN;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(a, 3, w, v, "layer 3 k unit 1", &err), KV_ENUMERIC);
    cr_assert_str_eq(err.msg, "layer 3 k unit 1: non-finite value nan at row 2, column 1");
    a[7] = -INFINITY;
    cr_assert_eq(kv_la_eigh(a, 3, w, v, "layer 0 v unit 2", &err), KV_ENUMERIC);
    cr_assert_str_eq(err.msg, "layer 0 v unit 2: non-finite value -inf at row 2, column 1");
}

Test(lr_eigh, empty_is_a_no_op) {
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(NULL, 0, NULL, NULL, "empty", &err), KV_OK);
}

/* ---------------------------------------------------------------- svd */

static void svd_case(int64_t m, int64_t n, uint64_t seed) {
    struct rng g = {seed};
    int64_t k = m < n ? m : n;
    double *a = randn(&g, m * n);
    double *u = malloc((size_t)(m * k) * sizeof *u), *s = malloc((size_t)k * sizeof *s);
    double *vt = malloc((size_t)(k * n) * sizeof *vt), *rec = malloc((size_t)(m * n) * sizeof *rec);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_svd(a, m, n, u, s, vt, "test matrix", &err), KV_OK, "%lldx%lld: %s",
                 (long long)m, (long long)n, err.msg);
    /* A = U diag(s) Vᵀ */
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double t = 0;
            for (int64_t p = 0; p < k; p++) t += u[i * k + p] * s[p] * vt[p * n + j];
            rec[i * n + j] = t;
        }
    char what[64];
    snprintf(what, sizeof what, "U S Vt reconstruction %lldx%lld", (long long)m, (long long)n);
    assert_rel_frob(rec, a, m * n, 1e-12, 0, what);
    assert_orthonormal_cols(u, m, k, 1e-12, "UᵀU = I");
    /* rows of vt orthonormal: columns of its transpose */
    double *v = malloc((size_t)(n * k) * sizeof *v);
    for (int64_t p = 0; p < k; p++)
        for (int64_t j = 0; j < n; j++) v[j * k + p] = vt[p * n + j];
    assert_orthonormal_cols(v, n, k, 1e-12, "V Vᵀ = I");
    assert_descending(s, k, "singular values");
    cr_assert(s[k - 1] >= 0, "negative singular value %g", s[k - 1]);
    for (int64_t j = 0; j < k; j++) assert_sign_convention(u, m, k, j, "U");
    free(a), free(u), free(s), free(vt), free(rec), free(v);
}

Test(lr_svd, reconstructs_tall_wide_and_square) {
    svd_case(1, 1, 31);
    svd_case(1, 5, 32);
    svd_case(6, 1, 33);
    svd_case(30, 12, 34);
    svd_case(12, 30, 35);
    svd_case(17, 17, 36);
}

Test(lr_svd, rejects_nan_naming_the_matrix) {
    double a[6] = {1, 2, 3, 4, 5, 6}, u[4], s[2], vt[6];
    a[5] = NAN;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_svd(a, 2, 3, u, s, vt, "layer 1 o proj", &err), KV_ENUMERIC);
    cr_assert_str_eq(err.msg, "layer 1 o proj: non-finite value nan at row 1, column 2");
}

/* ---------------------------------------------------------------- whitened */

/* A calibration problem: X [n, d], W [d, m], C_x = XᵀX, C_y = Wᵀ C_x W with
 * its descending eigenvalues lam and eigenvectors v (columns). */
struct problem {
    int64_t n, d, m;
    double *x, *w, *cx, *cy, *lam, *v;
};

static void problem_init(struct problem *p, int64_t n, int64_t d, int64_t m, uint64_t seed) {
    struct rng g = {seed};
    p->n = n, p->d = d, p->m = m;
    p->x = randn(&g, n * d);
    p->w = randn(&g, d * m);
    p->cx = malloc((size_t)(d * d) * sizeof(double));
    p->cy = malloc((size_t)(m * m) * sizeof(double));
    p->lam = malloc((size_t)m * sizeof(double));
    p->v = malloc((size_t)(m * m) * sizeof(double));
    double *cxw = malloc((size_t)(d * m) * sizeof *cxw);
    matmul(p->x, p->x, p->cx, d, n, d, 1, 0);
    matmul(p->cx, p->w, cxw, d, d, m, 0, 0);
    matmul(p->w, cxw, p->cy, m, d, m, 1, 0);
    free(cxw);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(p->cy, m, p->lam, p->v, "c_y", &err), KV_OK, "%s", err.msg);
}

static void problem_free(struct problem *p) {
    free(p->x), free(p->w), free(p->cx), free(p->cy), free(p->lam), free(p->v);
}

/* out [d, m] = W Q Qᵀ for the r columns of q [m, ldq] */
static void project(const double *w, const double *q, int64_t ldq, int64_t d, int64_t m,
                    int64_t r, double *out) {
    for (int64_t i = 0; i < d; i++)
        for (int64_t j = 0; j < m; j++) {
            double t = 0;
            for (int64_t c = 0; c < r; c++) {
                double wq = 0;
                for (int64_t k = 0; k < m; k++) wq += w[i * m + k] * q[k * ldq + c];
                t += wq * q[j * ldq + c];
            }
            out[i * m + j] = t;
        }
}

/* ‖X (W − W')‖²_F by plain loops */
static double proj_error(const struct problem *p, const double *wp) {
    double e = 0;
    for (int64_t t = 0; t < p->n; t++)
        for (int64_t j = 0; j < p->m; j++) {
            double y = 0;
            for (int64_t i = 0; i < p->d; i++)
                y += p->x[t * p->d + i] * (p->w[i * p->m + j] - wp[i * p->m + j]);
            e += y * y;
        }
    return e;
}

Test(lr_whiten, cholesky_route_equals_eigen_route_at_every_rank) {
    struct problem p;
    problem_init(&p, 400, 24, 8, 41);
    double *we = malloc((size_t)(p.d * p.m) * sizeof *we), *wc = malloc((size_t)(p.d * p.m) * sizeof *wc);
    struct kv_err err;
    kv_err_clear(&err);
    for (int64_t r = 1; r <= p.m; r++) {
        project(p.w, p.v, p.m, p.d, p.m, r, we);
        cr_assert_eq(kv_la_whitened_chol(p.w, p.d, p.m, p.cx, 0, r, wc, "unit", &err), KV_OK,
                     "%s", err.msg);
        char what[64];
        snprintf(what, sizeof what, "whitened vs eigen, rank %lld", (long long)r);
        assert_rel_frob(wc, we, p.d * p.m, 1e-8, 0, what);
    }
    /* rank m keeps W itself */
    assert_rel_frob(wc, p.w, p.d * p.m, 1e-8, 0, "whitened at full rank vs W");
    free(we), free(wc);
    problem_free(&p);
}

Test(lr_whiten, rank_zero_is_zero_and_bad_rank_is_rejected) {
    struct problem p;
    problem_init(&p, 50, 6, 4, 42);
    double wc[24];
    for (int i = 0; i < 24; i++) wc[i] = 1;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_whitened_chol(p.w, p.d, p.m, p.cx, 0, 0, wc, "unit", &err), KV_OK);
    for (int i = 0; i < 24; i++) cr_assert_eq(wc[i], 0.0);
    cr_assert_eq(kv_la_whitened_chol(p.w, p.d, p.m, p.cx, 0, 5, wc, "layer 2 v unit 0", &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.msg, "layer 2 v unit 0: rank 5 is out of range: expected 0 to 4");
    cr_assert_eq(kv_la_whitened_chol(p.w, p.d, p.m, p.cx, 0, -1, wc, "u", &err), KV_EINVAL);
    problem_free(&p);
}

Test(lr_whiten, predicted_error_is_the_dropped_eigenvalue_sum) {
    struct problem p;
    problem_init(&p, 400, 24, 8, 43);
    double *we = malloc((size_t)(p.d * p.m) * sizeof *we);
    double total = 0;
    for (int64_t j = 0; j < p.m; j++) total += p.lam[j];
    int64_t ranks[] = {1, 2, 4, 7, 8};
    for (size_t q = 0; q < sizeof ranks / sizeof ranks[0]; q++) {
        int64_t r = ranks[q];
        project(p.w, p.v, p.m, p.d, p.m, r, we);
        double dropped = 0;
        for (int64_t j = r; j < p.m; j++) dropped += p.lam[j];
        double measured = proj_error(&p, we);
        cr_assert(fabs(measured - dropped) <= 1e-6 * fabs(dropped) + 1e-12 * total,
                  "rank %lld: measured error %.17g, dropped eigenvalues %.17g", (long long)r,
                  measured, dropped);
    }
    free(we);
    problem_free(&p);
}

/* Random orthonormal [m, r] by Gram-Schmidt (twice) of a Gaussian matrix. */
static void random_orthonormal(struct rng *g, double *q, int64_t m, int64_t r) {
    for (int64_t i = 0; i < m * r; i++) q[i] = rng_normal(g);
    for (int64_t j = 0; j < r; j++) {
        for (int pass = 0; pass < 2; pass++)
            for (int64_t k = 0; k < j; k++) {
                double dot = 0;
                for (int64_t i = 0; i < m; i++) dot += q[i * r + j] * q[i * r + k];
                for (int64_t i = 0; i < m; i++) q[i * r + j] -= dot * q[i * r + k];
            }
        double nn = 0;
        for (int64_t i = 0; i < m; i++) nn += q[i * r + j] * q[i * r + j];
        for (int64_t i = 0; i < m; i++) q[i * r + j] /= sqrt(nn);
    }
}

Test(lr_whiten, no_random_projection_beats_the_eigen_route) {
    struct problem p;
    problem_init(&p, 400, 24, 8, 44);
    struct rng g = {45};
    double *we = malloc((size_t)(p.d * p.m) * sizeof *we);
    double *wq = malloc((size_t)(p.d * p.m) * sizeof *wq);
    double q[64];
    for (int64_t r = 1; r < p.m; r++) {
        project(p.w, p.v, p.m, p.d, p.m, r, we);
        double best = proj_error(&p, we);
        for (int trial = 0; trial < 25; trial++) {
            random_orthonormal(&g, q, p.m, r);
            assert_orthonormal_cols(q, p.m, r, 1e-12, "random Q");
            project(p.w, q, r, p.d, p.m, r, wq);
            double e = proj_error(&p, wq);
            cr_assert(e >= best * (1 - 1e-12), "rank %lld trial %d: random error %.17g < eigen %.17g",
                      (long long)r, trial, e, best);
        }
    }
    free(we), free(wq);
    problem_free(&p);
}

Test(lr_whiten, singular_covariance_needs_a_ridge) {
    struct problem p;
    problem_init(&p, 60, 10, 4, 46);
    /* zero input feature 3: row and column 3 of C_x vanish exactly */
    for (int64_t t = 0; t < p.n; t++) p.x[t * p.d + 3] = 0;
    matmul(p.x, p.x, p.cx, p.d, p.n, p.d, 1, 0);
    double wc[40], we[40];
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_whitened_chol(p.w, p.d, p.m, p.cx, 0, 2, wc, "layer 5 k unit 3", &err),
                 KV_ENUMERIC);
    cr_assert_str_eq(err.msg,
                     "layer 5 k unit 3: input covariance is not positive definite (dpotrf info 4)");

    /* with a ridge it succeeds and matches the eigen route on C_x + λI */
    double lambda = 0.5;
    cr_assert_eq(kv_la_whitened_chol(p.w, p.d, p.m, p.cx, lambda, 2, wc, "u", &err), KV_OK,
                 "%s", err.msg);
    for (int64_t i = 0; i < p.d; i++) p.cx[i * p.d + i] += lambda;
    double cxw[40], cy[16], lam[4], v[16];
    matmul(p.cx, p.w, cxw, p.d, p.d, p.m, 0, 0);
    matmul(p.w, cxw, cy, p.m, p.d, p.m, 1, 0);
    cr_assert_eq(kv_la_eigh(cy, p.m, lam, v, "c_y", &err), KV_OK);
    project(p.w, v, p.m, p.d, p.m, 2, we);
    assert_rel_frob(wc, we, p.d * p.m, 1e-8, 0, "ridged whitened vs eigen");
    problem_free(&p);
}

Test(lr_whiten, rejects_nan_in_weights_or_covariance) {
    struct problem p;
    problem_init(&p, 40, 5, 3, 47);
    double wc[15];
    struct kv_err err;
    kv_err_clear(&err);
    p.cx[2 * 5 + 4] = NAN;
    cr_assert_eq(kv_la_whitened_chol(p.w, 5, 3, p.cx, 0, 1, wc, "cx check", &err), KV_ENUMERIC);
    cr_assert_str_eq(err.msg, "cx check: non-finite value nan at row 2, column 4");
    p.cx[2 * 5 + 4] = 0;
    p.w[1 * 3 + 2] = INFINITY;
    cr_assert_eq(kv_la_whitened_chol(p.w, 5, 3, p.cx, 0, 1, wc, "w check", &err), KV_ENUMERIC);
    cr_assert_str_eq(err.msg, "w check: non-finite value inf at row 1, column 2");
    problem_free(&p);
}

/* ---------------------------------------------------------------- hadamard */

Test(lr_hadamard, orthonormal_block_sylvester) {
    int64_t sizes[] = {1, 2, 3, 8, 12, 13, 16, 24, 31};
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        int64_t n = sizes[c];
        int64_t want_b = 1;
        while (2 * want_b <= n) want_b *= 2;
        double *h = malloc((size_t)(n * n) * sizeof *h), *hh = malloc((size_t)(n * n) * sizeof *hh);
        for (int64_t i = 0; i < n * n; i++) h[i] = NAN; /* every entry must be written */
        int64_t b = kv_la_hadamard(n, h);
        cr_assert_eq(b, want_b, "n %lld: first block %lld, expected %lld", (long long)n, (long long)b,
                     (long long)want_b);
        /* the blocks: n's binary expansion, largest first */
        int64_t off[64], sz[64], nb = 0, o = 0;
        for (int64_t s = want_b; s >= 1; s /= 2)
            if (n & s) off[nb] = o, sz[nb++] = s, o += s;
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < n; j++) {
                int64_t bi = 0, bj = 0;
                while (i >= off[bi] + sz[bi]) bi++;
                while (j >= off[bj] + sz[bj]) bj++;
                double x = h[i * n + j], e = 1 / sqrt((double)sz[bi]);
                if (bi == bj)
                    cr_assert(fabs(fabs(x) - e) <= 1e-15, "n %lld: h[%lld][%lld] = %g, want ±%g",
                              (long long)n, (long long)i, (long long)j, x, e);
                else
                    cr_assert_eq(x, 0.0, "n %lld: h[%lld][%lld] = %g off the blocks",
                                 (long long)n, (long long)i, (long long)j, x);
            }
        /* Sylvester recursion inside each block: [[H, H], [H, -H]] */
        for (int64_t k = 0; k < nb; k++)
            for (int64_t half = sz[k] / 2; half >= 1; half /= 2)
                for (int64_t i = 0; i < sz[k]; i++)
                    for (int64_t j = 0; j < sz[k]; j++) {
                        if ((i & half) || (j & half)) continue;
                        const double *at = h + (off[k] + i) * n + off[k] + j;
                        cr_assert_eq(at[half], at[0]);
                        cr_assert_eq(at[half * n], at[0]);
                        cr_assert_eq(at[half * n + half], -at[0]);
                    }
        cr_assert_gt(h[0], 0.0);
        matmul(h, h, hh, n, n, n, 0, 1);
        double *eye = calloc((size_t)(n * n), sizeof *eye);
        for (int64_t i = 0; i < n; i++) eye[i * n + i] = 1;
        kvt_assert_close_f64(hh, eye, n * n, 1e-14, 0, "H Hᵀ = I");
        free(h), free(hh), free(eye);
    }
}

/* a [n] scaled to floats (a is freed) */
static float *to_f32(double *a, int64_t n, double scale) {
    float *f = malloc((size_t)n * sizeof *f);
    cr_assert(f);
    for (int64_t i = 0; i < n; i++) f[i] = (float)(scale * a[i]);
    free(a);
    return f;
}

/* A random gpt2 lowrank model: per layer fused_query keys and fused_output
 * values with random factors (not an approximation of m: the transform must
 * keep whatever the factors compute). Layer 0: key units {0,1} r 8 and
 * {2,3} r 6 with a latent bias, values one head per unit r 4,5,8,2; layer 1:
 * one key unit of all heads r 12, one value unit r 16. */
static struct kv_lowrank *random_fused_gpt2(const struct kv_config *c, struct rng *g) {
    static const int64_t kn[2][4] = {{2, 2}, {4}}, kr[2][4] = {{8, 6}, {12}};
    static const int64_t vn[2][4] = {{1, 1, 1, 1}, {4}}, vr[2][4] = {{4, 5, 8, 2}, {16}};
    int64_t d = c->dim, dh = c->head_dim;
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    cr_assert(lr);
    snprintf(lr->info.method, sizeof lr->info.method, "test");
    snprintf(lr->info.alloc, sizeof lr->info.alloc, "test");
    lr->info.n_layers = c->n_layers, lr->info.dim = d, lr->info.n_heads = c->n_heads;
    lr->info.n_kv_heads = c->n_kv_heads, lr->info.head_dim = dh, lr->info.kv_bits = 16;
    lr->layers = calloc((size_t)c->n_layers, sizeof *lr->layers);
    for (int64_t l = 0; l < c->n_layers; l++) {
        struct kv_lr_layer *y = &lr->layers[l];
        for (int s = 0; s < 2; s++) {
            struct kv_lr_side *sd = s ? &y->v : &y->k;
            const int64_t *nh = s ? vn[l] : kn[l], *rk = s ? vr[l] : kr[l];
            sd->mode = s ? KV_LR_FUSED_OUTPUT : KV_LR_FUSED_QUERY;
            for (sd->n_units = 0; sd->n_units < 4 && nh[sd->n_units]; sd->n_units++) {}
            sd->units = calloc((size_t)sd->n_units, sizeof *sd->units);
            int64_t h0 = 0;
            for (int64_t u = 0; u < sd->n_units; u++) {
                struct kv_lr_unit *x = &sd->units[u];
                x->head0 = h0, x->n_heads = nh[u], x->rank = rk[u], h0 += nh[u];
                x->down = to_f32(randn(g, x->rank * d), x->rank * d, 0.3);
                x->up = to_f32(randn(g, x->n_heads * dh * x->rank), x->n_heads * dh * x->rank, 0.3);
                if (!s && l == 0) x->down_bias = to_f32(randn(g, x->rank), x->rank, 0.3);
            }
            /* one block of rank(unit of i) rows (columns) per query head i */
            int64_t cols = 0;
            for (int64_t u = 0; u < sd->n_units; u++) cols += sd->units[u].n_heads * sd->units[u].rank;
            if (s) {
                y->o_cols = cols;
                y->o_fused = to_f32(randn(g, d * cols), d * cols, 0.3);
            } else {
                y->q_cols = cols;
                y->q_fused = to_f32(randn(g, cols * d), cols * d, 0.3);
                y->q_fused_bias = to_f32(randn(g, cols), cols, 0.3);
            }
        }
    }
    return lr;
}

static float *lr_logits(const struct kv_model *m, const struct kv_lowrank *lr, const int32_t *tok,
                        int64_t n) {
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_OK, "%s", err.msg);
    int64_t nv = n * kv_model_config(m)->vocab_size;
    float *out = malloc((size_t)nv * sizeof *out);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, out, &err), KV_OK, "%s", err.msg);
    kv_fwd_free(f);
    return out;
}

static double max_abs_diff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - (double)b[i]));
    return m;
}

Test(lr_hadamard, fused_query_and_output_logits_are_unchanged) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPT2;
    c.dim = 32, c.hidden_dim = 64, c.n_layers = 2, c.n_heads = c.n_kv_heads = 4, c.head_dim = 8;
    c.vocab_size = 40, c.max_seq_len = 24, c.norm_eps = 1e-5f, c.has_qkv_bias = 1;
    c.tied_embeddings = 1, c.bos_id = c.eos_id = -1;
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, 5, &m, &err), KV_OK, "%s", err.msg);
    struct rng g = {77};
    struct kv_lowrank *lr = random_fused_gpt2(&c, &g);
    int64_t n = 24, nv = n * c.vocab_size, q0 = lr->layers[0].q_cols * c.dim;
    int32_t tok[24];
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 13 + 5) % c.vocab_size);
    float *before = lr_logits(m, lr, tok, n);
    float *q_plain = malloc((size_t)q0 * sizeof *q_plain);
    memcpy(q_plain, lr->layers[0].q_fused, (size_t)q0 * sizeof *q_plain);

    cr_assert_eq(kv_lr_fuse_hadamard(lr, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(lr->info.hadamard, 1);
    cr_assert_eq(kv_lr_fuse_hadamard(lr, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "a hadamard rotation is already fused in");
    /* H of ranks 8, 6, 12 has blocks 8, 2, 4: the query rows really moved */
    cr_assert_gt(max_abs_diff(lr->layers[0].q_fused, q_plain, q0), 1e-2);
    float *after = lr_logits(m, lr, tok, n);
    kvt_assert_close_f32(after, before, nv, 1e-5, 1e-4, "logits after the hadamard transform");

    /* guard: the latent z H against the untransformed queries of layer 0
     * scores differently, so the comparison above can fail */
    float *q_rot = lr->layers[0].q_fused;
    lr->layers[0].q_fused = q_plain;
    float *stale = lr_logits(m, lr, tok, n);
    double diff = max_abs_diff(stale, before, nv);
    cr_assert_gt(diff, 1e-2, "stale queries left the logits within %g", diff);
    lr->layers[0].q_fused = q_rot;
    free(before), free(after), free(stale), free(q_plain);
    kv_lr_free(lr);
    kv_model_close(m);
}
