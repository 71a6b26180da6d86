/* Dense float64 numerics: the one symmetric eigensolver (values, or values
 * and vectors), thin SVD, the Cholesky-whitened truncated SVD kept as a
 * cross-check of the eigen route, block Walsh-Hadamard matrices and energy
 * ranks. All row-major, on top of OpenBLAS (cblas) and LAPACKE. */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "linalg.h"

/* Reject NaN/Inf, naming the matrix and the first bad element. */
static int check_finite(const double *a, int64_t rows, int64_t cols, const char *what,
                        struct kv_err *err) {
    for (int64_t i = 0; i < rows * cols; i++)
        if (!isfinite(a[i]))
            return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                           "%s: non-finite value %g at row %lld, column %lld", what, a[i],
                           (long long)(i / cols), (long long)(i % cols));
    return KV_OK;
}

/* Index of the first entry of largest magnitude in column j of the
 * rows×ld row-major matrix a. */
static int64_t col_argmax_abs(const double *a, int64_t rows, int64_t ld, int64_t j) {
    int64_t best = 0;
    for (int64_t i = 1; i < rows; i++)
        if (fabs(a[i * ld + j]) > fabs(a[best * ld + j])) best = i;
    return best;
}

int kv_la_eigh(const double *a, int64_t n, double *w, double *vec, const char *what,
               struct kv_err *err) {
    if (n <= 0) return KV_OK;
    KV_ASSERT(n <= INT32_MAX / n);
    int rc = check_finite(a, n, n, what, err);
    if (rc) return rc;
    /* the working copy: dsyevd overwrites it with the eigenvectors (vec), or
     * with nothing of use (values only) */
    double *c = vec ? vec : malloc((size_t)(n * n) * sizeof *c);
    if (!c) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "%s: out of memory", what);
    memcpy(c, a, (size_t)(n * n) * sizeof *c);
    lapack_int info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, vec ? 'V' : 'N', 'U', (lapack_int)n, c,
                                     (lapack_int)n, w);
    if (!vec) free(c);
    KV_ASSERT(info >= 0);
    if (info > 0)
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                       "%s: dsyevd did not converge (info %d)", what, (int)info);
    /* ascending from LAPACK; reverse the values and the columns together */
    for (int64_t lo = 0, hi = n - 1; lo < hi; lo++, hi--) {
        double t = w[lo];
        w[lo] = w[hi];
        w[hi] = t;
        for (int64_t i = 0; vec && i < n; i++) {
            t = vec[i * n + lo];
            vec[i * n + lo] = vec[i * n + hi];
            vec[i * n + hi] = t;
        }
    }
    for (int64_t j = 0; vec && j < n; j++)
        if (vec[col_argmax_abs(vec, n, n, j) * n + j] < 0)
            for (int64_t i = 0; i < n; i++) vec[i * n + j] = -vec[i * n + j];
    return KV_OK;
}

int kv_la_svd(const double *a, int64_t m, int64_t n, double *u, double *s, double *vt,
              const char *what, struct kv_err *err) {
    if (m <= 0 || n <= 0) return KV_OK;
    KV_ASSERT(m <= INT32_MAX / n);
    int rc = check_finite(a, m, n, what, err);
    if (rc) return rc;
    int64_t k = m < n ? m : n;
    double *c = malloc((size_t)(m * n) * sizeof *c);
    if (!c) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "%s: out of memory", what);
    memcpy(c, a, (size_t)(m * n) * sizeof *c);
    /* a is [m, n] (lda n); u is [m, k] (ldu k); vt is [k, n] (ldvt n) */
    lapack_int info = LAPACKE_dgesdd(LAPACK_ROW_MAJOR, 'S', (lapack_int)m, (lapack_int)n, c,
                                     (lapack_int)n, s, u, (lapack_int)k, vt, (lapack_int)n);
    free(c);
    KV_ASSERT(info >= 0);
    if (info > 0)
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                       "%s: dgesdd did not converge (info %d)", what, (int)info);
    /* u_j vt_j is invariant under flipping both; pick the sign from u */
    for (int64_t j = 0; j < k; j++)
        if (u[col_argmax_abs(u, m, k, j) * k + j] < 0) {
            for (int64_t i = 0; i < m; i++) u[i * k + j] = -u[i * k + j];
            for (int64_t i = 0; i < n; i++) vt[j * n + i] = -vt[j * n + i];
        }
    return KV_OK;
}

int kv_la_whitened_chol(const double *w, int64_t d, int64_t m, const double *cx, double lambda,
                        int64_t r, double *w_out, const char *what, struct kv_err *err) {
    int64_t k = d < m ? d : m;
    if (r < 0 || r > (k > 0 ? k : 0))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s: rank %lld is out of range: expected 0 to %lld", what, (long long)r,
                       (long long)(k > 0 ? k : 0));
    if (d <= 0 || m <= 0) return KV_OK;
    KV_ASSERT(d <= INT32_MAX / d && d <= INT32_MAX / m);
    if (!isfinite(lambda))
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET, "%s: non-finite ridge %g", what,
                       lambda);
    int rc = check_finite(w, d, m, what, err);
    if (!rc) rc = check_finite(cx, d, d, what, err);
    if (rc) return rc;

    /* s [d, d], mw [d, m], u [d, k], sv [k], vt [k, m] in one block */
    size_t nd = (size_t)d, nm = (size_t)m, nk = (size_t)k;
    double *s = malloc((nd * nd + nd * nm + nd * nk + nk + nk * nm) * sizeof *s);
    if (!s) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "%s: out of memory", what);
    double *mw = s + nd * nd, *u = mw + nd * nm, *sv = u + nd * nk, *vt = sv + nk;

    /* S = chol(cx + lambda I), lower; only the lower triangle is read and
     * written, the upper one keeps cx and is never used */
    memcpy(s, cx, nd * nd * sizeof *s);
    for (int64_t i = 0; i < d; i++) s[i * d + i] += lambda;
    lapack_int info = LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'L', (lapack_int)d, s, (lapack_int)d);
    KV_ASSERT(info >= 0);
    if (info > 0) {
        free(s);
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                       "%s: input covariance is not positive definite (dpotrf info %d)", what,
                       (int)info);
    }

    /* M = Sᵀ W: [d, m]; MᵀM = Wᵀ (cx + lambda I) W is the whitened C_y */
    memcpy(mw, w, nd * nm * sizeof *mw);
    cblas_dtrmm(CblasRowMajor, CblasLeft, CblasLower, CblasTrans, CblasNonUnit, (int)d, (int)m,
                1.0, s, (int)d, mw, (int)m);
    rc = kv_la_svd(mw, d, m, u, sv, vt, what, err);
    if (rc) {
        free(s);
        return rc;
    }

    /* T = U_r Σ_r V_rᵀ into w_out: scale U_r's columns, then one GEMM */
    if (r == 0) {
        memset(w_out, 0, nd * nm * sizeof *w_out);
        free(s);
        return KV_OK;
    }
    for (int64_t i = 0; i < d; i++)
        for (int64_t j = 0; j < r; j++) u[i * k + j] *= sv[j];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)d, (int)m, (int)r, 1.0, u, (int)k,
                vt, (int)m, 0.0, w_out, (int)m);
    /* W' = S⁻ᵀ T: solve Sᵀ W' = T in place */
    cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, CblasTrans, CblasNonUnit, (int)d, (int)m,
                1.0, s, (int)d, w_out, (int)m);
    free(s);
    return KV_OK;
}

int64_t kv_la_hadamard(int64_t n, double *h) {
    KV_ASSERT(n >= 1);
    memset(h, 0, (size_t)(n * n) * sizeof *h);
    /* blocks of the powers of two in n's binary expansion, largest first;
     * Sylvester within each: H[i][j] = (-1)^popcount(i & j) / √b */
    int64_t first = 0;
    for (int64_t b = (int64_t)1 << (63 - __builtin_clzll((unsigned long long)n)), blk = 0; b >= 1; b >>= 1) {
        if (!(n & b)) continue;
        if (!first) first = b;
        double scale = 1.0 / sqrt((double)b);
        for (int64_t i = 0; i < b; i++)
            for (int64_t j = 0; j < b; j++)
                h[(blk + i) * n + blk + j] =
                    __builtin_popcountll((unsigned long long)(i & j)) & 1 ? -scale : scale;
        blk += b;
    }
    return first;
}

int64_t kv_la_energy_rank(const double *lambda, int64_t n, double energy) {
    double total = 0;
    for (int64_t i = 0; i < n; i++) total += lambda[i] > 0 ? lambda[i] : 0;
    if (total <= 0) return 0;
    double acc = 0, goal = energy * total;
    for (int64_t i = 0; i < n; i++) {
        acc += lambda[i] > 0 ? lambda[i] : 0;
        if (acc >= goal) return i + 1;
    }
    return n;
}
