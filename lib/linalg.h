/* Dense float64 numerics (internal): the library's one symmetric
 * eigensolver and its SVD, whitening and Hadamard helpers, on LAPACKE and
 * OpenBLAS. All matrices are row-major. */
#ifndef KV_LINALG_H
#define KV_LINALG_H

#include "kvcal_core.h"

/* Symmetric eigendecomposition of the n×n float64 matrix a (row-major, both
 * triangles; only the upper one is read), by LAPACKE dsyevd on a copy. w[n]
 * receives the eigenvalues in descending order. With vec non-NULL, vec[n*n]
 * (row-major) receives the matching orthonormal eigenvectors as columns:
 * column j of vec belongs to w[j], its sign fixed so that its
 * largest-magnitude entry is positive (deterministic output); with vec NULL
 * only the values are computed. NaN/Inf input and non-convergence are
 * KV_ENUMERIC naming `what` (e.g. "layer 3 k unit 1"). */
int kv_la_eigh(const double *a, int64_t n, double *w, double *vec, const char *what,
               struct kv_err *err);

/* Thin SVD of the m×n float64 matrix a (row-major) by LAPACKE dgesdd on a
 * copy: a = U diag(s) Vᵀ with k = min(m, n); u is [m, k], s [k] descending,
 * vt [k, n], all row-major. Errors as kv_la_eigh. */
int kv_la_svd(const double *a, int64_t m, int64_t n, double *u, double *s, double *vt,
              const char *what, struct kv_err *err);

/* The Cholesky-whitened truncation-aware SVD of SVD-LLM / Palu appendix K,
 * kept as an independent cross-check of the eigen route (docs/design.md).
 * W is d×m (math layout, row-major), cx the d×d input second moment XᵀX,
 * lambda a ridge added to its diagonal. With S = chol(cx + lambda I) lower
 * triangular, Sᵀ W = U Σ Vᵀ, it returns W' = S⁻ᵀ U_r Σ_r V_rᵀ (d×m, row-major)
 * by a triangular solve (no inverse is formed). A non-positive-definite cx
 * is KV_ENUMERIC naming `what`. */
int kv_la_whitened_chol(const double *w, int64_t d, int64_t m, const double *cx, double lambda,
                        int64_t r, double *w_out, const char *what, struct kv_err *err);

/* Orthonormal n×n Walsh-Hadamard-type matrix (row-major): block diagonal
 * with one Sylvester block per power of two in n's binary expansion,
 * largest first (n = 12: 8 and 4; n = 13: 8, 4 and 1), each scaled by
 * 1/√(its size). Returns the first block's size, the largest power of two
 * not above n. */
int64_t kv_la_hadamard(int64_t n, double *h);

/* Smallest r with λ_1 + .. + λ_r >= energy · Σλ (λ descending, negatives
 * counted as 0); 0 when Σλ is 0. */
int64_t kv_la_energy_rank(const double *lambda, int64_t n, double energy);

#endif
