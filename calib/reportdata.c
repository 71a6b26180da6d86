/* The numbers of `kvcal report`: each unit's eigen-spectrum from the
 * calibration statistics, and each compressed unit's output error measured
 * exactly on other statistics. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvcalib.h"
#include "kvstats.h"
#include "linalg.h"
#include "lrmodel.h"
#include "model.h"
#include "report.h"

/* Σ over tokens of ‖M x + v‖² from the sums XᵀX [d, d] (upper triangle
 * read), Σx [d] and the count n: tr(M XᵀX Mᵀ) + 2 vᵀ M Σx + n ‖v‖², M
 * [rows, d] row-major, v [rows] or NULL. t is scratch of rows*d. */
static double sum_sq(const double *mat, const double *v, int64_t rows, int64_t d,
                     const double *xtx, const double *xsum, double n, double *t) {
    /* t = M XᵀX [rows, d]; tr(M XᵀX Mᵀ) = Σ_ij t_ij M_ij */
    cblas_dsymm(CblasRowMajor, CblasRight, CblasUpper, (int)rows, (int)d, 1.0, xtx, (int)d, mat,
                (int)d, 0.0, t, (int)d);
    double s = cblas_ddot((int)(rows * d), t, 1, mat, 1);
    if (!v) return s;
    /* t[0..rows) = M Σx */
    cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)rows, (int)d, 1.0, mat, (int)d, xsum, 1, 0.0, t, 1);
    return s + 2 * cblas_ddot((int)rows, v, 1, t, 1) + n * cblas_ddot((int)rows, v, 1, v, 1);
}

int kv_lr_unit_error(const struct kv_stats *s, const struct kv_model *m,
                     const struct kv_lowrank *lr, int64_t layer, int which, int64_t u,
                     double *resid, double *total, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    KV_ASSERT(layer >= 0 && layer < lr->info.n_layers && layer < s->info.n_layers);
    KV_ASSERT(which == 0 || which == 1);
    KV_ASSERT(s->info.dim == c->dim && lr->info.head_dim == c->head_dim);
    const struct kv_lr_side *sd = kv_lr_side(lr, layer, which);
    const char *sn = which ? "v" : "k";
    if (sd->mode == KV_LR_FULL)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "layer %lld %s is not compressed", (long long)layer, sn);
    KV_ASSERT(u >= 0 && u < sd->n_units);
    const struct kv_lr_unit *un = &sd->units[u];
    if (sd->mode == KV_LR_POSTROPE_ROTATION)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "layer %lld %s unit %lld: post-RoPE rotation keys have no down/up factors "
                       "(their error depends on the position)",
                       (long long)layer, sn, (long long)u);
    if (!un->down || !un->up)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "layer %lld %s unit %lld: the factors were not read (a manifest alone)",
                       (long long)layer, sn, (long long)u);
    int64_t d = c->dim, dh = c->head_dim, rows = un->n_heads * dh, r = un->rank;
    int64_t r0 = un->head0 * dh;
    const float *w = kv_model_weight(m, which ? KV_W_V : KV_W_K, layer) + r0 * d;
    const float *bias = kv_model_weight(m, which ? KV_W_BV : KV_W_BK, layer);
    const struct kv_stats_layer *L = &s->layers[layer];
    double n = (double)s->info.tokens;
    /* W [rows, d], A = W − up·down [rows, d], up [rows, r], down [r, d];
     * b [rows] and c = b − up·down_bias − up_bias [rows] */
    size_t big = (size_t)(rows * d);
    double *wd = malloc(big * sizeof *wd), *a = malloc(big * sizeof *a);
    double *t = malloc(big * sizeof *t), *up = malloc((size_t)(rows * r) * sizeof *up);
    double *down = malloc((size_t)(r * d) * sizeof *down);
    double *b = calloc((size_t)rows, sizeof *b), *cv = calloc((size_t)rows, sizeof *cv);
    double *db = calloc((size_t)r, sizeof *db);
    int rc = KV_OK;
    if (!wd || !a || !t || !up || !down || !b || !cv || !db) {
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < big; i++) wd[i] = a[i] = (double)w[i];
    for (int64_t i = 0; i < rows * r; i++) up[i] = (double)un->up[i];
    for (int64_t i = 0; i < r * d; i++) down[i] = (double)un->down[i];
    for (int64_t i = 0; i < rows; i++) {
        b[i] = bias ? (double)bias[r0 + i] : 0.0;
        cv[i] = b[i] - (un->up_bias ? (double)un->up_bias[i] : 0.0);
    }
    if (un->down_bias)
        for (int64_t i = 0; i < r; i++) db[i] = (double)un->down_bias[i];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)d, (int)r, -1.0, up,
                (int)r, down, (int)d, 1.0, a, (int)d);
    cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)rows, (int)r, -1.0, up, (int)r, db, 1, 1.0, cv, 1);
    *resid = sum_sq(a, cv, rows, d, L->xtx, L->xsum, n, t);
    *total = sum_sq(wd, b, rows, d, L->xtx, L->xsum, n, t);
    if (!isfinite(*resid) || !isfinite(*total))
        rc = kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                     "layer %lld %s unit %lld: the measured error is not finite", (long long)layer,
                     sn, (long long)u);
done:
    free(wd), free(a), free(t), free(up), free(down), free(b), free(cv), free(db);
    return rc;
}

int kv_report_spectra(struct kv_report *r, const struct kv_stats *s, const struct kv_model *m,
                      struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    KV_ASSERT(s->info.dim == c->dim && s->info.n_layers == c->n_layers);
    KV_ASSERT(r->n_layers == c->n_layers && r->head_dim == c->head_dim);
    int rc;
    if (!r->n_units && (rc = kv_report_head_units(r, err))) return rc;
    int64_t dh = c->head_dim, wmax = dh;
    for (int64_t i = 0; i < r->n_units; i++)
        if (r->units[i].width > wmax) wmax = r->units[i].width;
    double *cov = malloc((size_t)(wmax * wmax) * sizeof *cov);
    if (!cov) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    rc = KV_OK;
    for (int64_t i = 0; i < r->n_units && !rc; i++) {
        struct kv_report_unit *u = &r->units[i];
        int64_t n = u->width;
        if (u->mode == KV_LR_POSTROPE_ROTATION) /* its rank is of the post-RoPE keys */
            memcpy(cov, s->layers[u->layer].k_cov + u->head0 * dh * dh, (size_t)(dh * dh) * sizeof *cov);
        else
            rc = kv_stats_out_cov(s, m, u->layer, u->which, u->head0, u->n_heads, cov, err);
        free(u->eig);
        u->eig = rc ? NULL : malloc((size_t)n * sizeof *u->eig);
        if (!rc && !u->eig) rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        char what[96];
        snprintf(what, sizeof what, "layer %lld %s heads %lld..%lld output covariance",
                 (long long)u->layer, u->which ? "v" : "k", (long long)u->head0,
                 (long long)(u->head0 + u->n_heads - 1));
        if (!rc) rc = kv_la_eigh(cov, n, u->eig, NULL, what, err);
        if (rc) break;
        /* the variance: the energy less N‖μ‖² (rotation keys: their post-RoPE
         * mean is not in the statistics, so decompose takes the energy) */
        double tr = 0, n2 = 0;
        for (int64_t k = 0; k < n; k++) tr += u->eig[k] > 0 ? u->eig[k] : 0;
        if (u->mode != KV_LR_POSTROPE_ROTATION) {
            rc = kv_stats_out_mean(s, m, u->layer, u->which, u->head0, u->n_heads, cov, err);
            for (int64_t k = 0; k < n && !rc; k++) n2 += cov[k] * cov[k];
        }
        u->var = tr - (double)s->info.tokens * n2;
        if (!(u->var > 0)) u->var = tr;
    }
    free(cov);
    if (!rc) r->has_spectra = 1;
    return rc;
}

int kv_report_measure(struct kv_report *r, const char *eval_path, const struct kv_stats *s,
                      const struct kv_model *m, const struct kv_lowrank *lr, struct kv_err *err) {
    free(r->eval_path);
    if (!(r->eval_path = strdup(eval_path ? eval_path : "")))
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < r->n_units; i++) {
        struct kv_report_unit *u = &r->units[i];
        if (u->rank <= 0 || u->unit < 0) continue;
        struct kv_err e;
        kv_err_clear(&e);
        int rc = kv_lr_unit_error(s, m, lr, u->layer, u->which, u->unit, &u->resid, &u->total, &e);
        if (rc == KV_EUNSUPPORTED) {
            snprintf(u->why, sizeof u->why, "%.150s", e.msg);
            continue;
        }
        if (rc) {
            *err = e;
            if (!err->path[0] && eval_path) snprintf(err->path, sizeof err->path, "%s", eval_path);
            return rc;
        }
        if (u->total > 0)
            u->measured = u->resid / u->total;
        else
            snprintf(u->why, sizeof u->why, "no output energy on these statistics");
    }
    r->has_measured = 1;
    return KV_OK;
}
