/* Covariances derived from the stats, and the per-layer spectrum summary. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "model.h"

int kv_stats_out_cov(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                     int which, int64_t head0, int64_t nh, double *out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    KV_ASSERT(layer >= 0 && layer < s->n_layers && s->dim == c->dim);
    KV_ASSERT(which >= 0 && which <= 2);
    KV_ASSERT(head0 >= 0 && nh > 0 && head0 + nh <= (which == 2 ? c->n_heads : c->n_kv_heads));
    int64_t d = c->dim, dh = c->head_dim, mm = nh * dh;
    static const enum kv_wkind wk[3] = {KV_W_K, KV_W_V, KV_W_Q}, bk[3] = {KV_W_BK, KV_W_BV, KV_W_BQ};
    /* W rows head0*d_h .. : [mm, d] of the [heads*d_h, d] projection (HF layout) */
    const float *w = m->layers[layer].w[wk[which]] + head0 * dh * d;
    const float *bias = m->layers[layer].w[bk[which]];
    double *wd = malloc((size_t)(mm * d) * sizeof *wd), *t = malloc((size_t)(mm * d) * sizeof *t);
    if (!wd || !t) {
        free(wd), free(t);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    for (int64_t i = 0; i < mm * d; i++) wd[i] = (double)w[i];
    const struct kv_stats_layer *L = &s->layers[layer];
    /* t = W C_x  [mm, d]; out = t Wᵀ  [mm, mm] */
    cblas_dsymm(CblasRowMajor, CblasRight, CblasUpper, (int)mm, (int)d, 1.0, L->xtx, (int)d, wd,
                (int)d, 0.0, t, (int)d);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)mm, (int)mm, (int)d, 1.0, t, (int)d,
                wd, (int)d, 0.0, out, (int)mm);
    if (bias) {
        const float *b = bias + head0 * dh;
        double n = (double)s->tokens;
        /* ws = W Σx [mm] */
        cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)mm, (int)d, 1.0, wd, (int)d, L->xsum, 1, 0.0,
                    t, 1);
        for (int64_t i = 0; i < mm; i++)
            for (int64_t j = 0; j < mm; j++)
                out[i * mm + j] += t[i] * b[j] + (double)b[i] * t[j] + n * (double)b[i] * b[j];
    }
    free(wd), free(t);
    return KV_OK;
}

int kv_stats_layer_spectrum(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                            struct kv_layer_spectrum *out, struct kv_err *err) {
    int64_t d = s->dim, dh = s->head_dim, g = s->n_kv_heads;
    const struct kv_stats_layer *L = &s->layers[layer];
    double *lam = malloc((size_t)(d > dh ? d : dh) * sizeof *lam), *cov = malloc((size_t)(dh * dh) * sizeof *cov);
    int rc = KV_OK;
    char what[96];
    if (!lam || !cov) {
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    out->trace = 0;
    for (int64_t i = 0; i < d; i++) out->trace += L->xtx[i * d + i];
    snprintf(what, sizeof what, "layer %lld attention input XᵀX", (long long)layer);
    if ((rc = kv_sym_eigvals(L->xtx, d, lam, what, err))) goto done;
    out->lambda_max = lam[0];
    out->lambda_min = lam[d - 1];
    out->cond = lam[d - 1] > 0 ? lam[0] / lam[d - 1] : INFINITY;
    out->x90 = kv_energy_rank(lam, d, 0.90);
    out->x99 = kv_energy_rank(lam, d, 0.99);
    for (int64_t j = 0; j < g; j++) {
        struct kv_head_spectrum *h = &out->heads[j];
        snprintf(what, sizeof what, "layer %lld kv head %lld post-rope K covariance",
                 (long long)layer, (long long)j);
        if ((rc = kv_sym_eigvals(L->k_cov + j * dh * dh, dh, lam, what, err))) goto done;
        h->krope90 = kv_energy_rank(lam, dh, 0.90);
        h->krope99 = kv_energy_rank(lam, dh, 0.99);
        h->k90 = h->k99 = h->v90 = h->v99 = -1;
        if (!m) continue;
        for (int which = 0; which < 2; which++) {
            if ((rc = kv_stats_out_cov(s, m, layer, which, j, 1, cov, err))) goto done;
            snprintf(what, sizeof what, "layer %lld kv head %lld %s output covariance",
                     (long long)layer, (long long)j, which ? "V" : "K");
            if ((rc = kv_sym_eigvals(cov, dh, lam, what, err))) goto done;
            int64_t r90 = kv_energy_rank(lam, dh, 0.90), r99 = kv_energy_rank(lam, dh, 0.99);
            if (which)
                h->v90 = r90, h->v99 = r99;
            else
                h->k90 = r90, h->k99 = r99;
        }
    }
done:
    free(lam), free(cov);
    return rc;
}
