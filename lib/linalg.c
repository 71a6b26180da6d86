/* Small dense float64 linear algebra on top of LAPACKE. */
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"

int kv_sym_eigvals(const double *a, int64_t n, double *w, const char *what, struct kv_err *err) {
    if (n <= 0) return KV_OK;
    for (int64_t i = 0; i < n * n; i++)
        if (!isfinite(a[i]))
            return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                           "%s: non-finite value %g at row %lld, column %lld", what, a[i],
                           (long long)(i / n), (long long)(i % n));
    double *c = malloc((size_t)(n * n) * sizeof *c);
    if (!c) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "%s: out of memory", what);
    memcpy(c, a, (size_t)(n * n) * sizeof *c);
    /* only the upper triangle (row-major) is read */
    lapack_int info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'N', 'U', (lapack_int)n, c, (lapack_int)n, w);
    free(c);
    KV_ASSERT(info >= 0);
    if (info > 0)
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                       "%s: dsyevd did not converge (info %d)", what, (int)info);
    /* ascending from LAPACK; callers want descending */
    for (int64_t i = 0, j = n - 1; i < j; i++, j--) {
        double t = w[i];
        w[i] = w[j];
        w[j] = t;
    }
    return KV_OK;
}

int64_t kv_energy_rank(const double *lambda, int64_t n, double energy) {
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
