/* Covariances derived from the stats, and the per-layer spectrum summary. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvcalib.h"
#include "kvstats.h"
#include "linalg.h"
#include "model.h"

/* Diagonal blocks of `block` heads each of the output covariance of heads
 * head0 .. head0+nh-1, out [nh/block][block*d_h][block*d_h]. Each block is
 * its own T = W_k C_x and T W_kᵀ: one product over all rows is the same work
 * but a working set that leaves the cache (measured slower by make bench). */
static int out_cov_core(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                        int which, int64_t head0, int64_t nh, int64_t block, double *out,
                        struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    KV_ASSERT(layer >= 0 && layer < s->info.n_layers && s->info.dim == c->dim);
    KV_ASSERT(which >= 0 && which <= 2);
    KV_ASSERT(head0 >= 0 && nh > 0 && head0 + nh <= (which == 2 ? c->n_heads : c->n_kv_heads));
    KV_ASSERT(block > 0 && nh % block == 0);
    int64_t d = c->dim, dh = c->head_dim, bw = block * dh;
    static const enum kv_wkind wk[3] = {KV_W_K, KV_W_V, KV_W_Q}, bk[3] = {KV_W_BK, KV_W_BV, KV_W_BQ};
    const float *bias = kv_model_weight(m, bk[which], layer);
    const struct kv_stats_layer *L = &s->layers[layer];
    double *wd = malloc((size_t)(bw * d) * sizeof *wd), *t = malloc((size_t)(bw * d) * sizeof *t);
    if (!wd || !t) {
        free(wd), free(t);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    for (int64_t k = 0; k < nh / block; k++) {
        int64_t r0 = (head0 + k * block) * dh; /* first row of the block in W */
        /* W_k: rows r0 .. r0+bw-1 of the [heads*d_h, d] projection (HF layout) */
        const float *w = kv_model_weight(m, wk[which], layer) + r0 * d;
        double *o = out + k * bw * bw;
        for (int64_t i = 0; i < bw * d; i++) wd[i] = (double)w[i];
        /* t = W_k C_x [bw, d]; o = t W_kᵀ [bw, bw] */
        cblas_dsymm(CblasRowMajor, CblasRight, CblasUpper, (int)bw, (int)d, 1.0, L->xtx, (int)d, wd,
                    (int)d, 0.0, t, (int)d);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bw, (int)bw, (int)d, 1.0, t, (int)d,
                    wd, (int)d, 0.0, o, (int)bw);
        if (!bias) continue;
        const float *b = bias + r0;
        double n = (double)s->info.tokens;
        /* ws = W_k Σx [bw] */
        cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)bw, (int)d, 1.0, wd, (int)d, L->xsum, 1, 0.0,
                    t, 1);
        for (int64_t i = 0; i < bw; i++)
            for (int64_t j = 0; j < bw; j++)
                o[i * bw + j] += t[i] * b[j] + (double)b[i] * t[j] + n * (double)b[i] * b[j];
    }
    free(wd), free(t);
    return KV_OK;
}

int kv_stats_out_mean(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                      int which, int64_t head0, int64_t nh, double *out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    KV_ASSERT(layer >= 0 && layer < s->info.n_layers && s->info.dim == c->dim);
    KV_ASSERT(which >= 0 && which <= 2 && head0 >= 0 && nh > 0);
    if (s->info.tokens <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "the statistics hold no tokens, so no calibration mean");
    static const enum kv_wkind wk[3] = {KV_W_K, KV_W_V, KV_W_Q}, bk[3] = {KV_W_BK, KV_W_BV, KV_W_BQ};
    int64_t d = c->dim, r0 = head0 * c->head_dim, rows = nh * c->head_dim;
    const float *w = kv_model_weight(m, wk[which], layer) + r0 * d;
    const float *b = kv_model_weight(m, bk[which], layer);
    const double *xs = s->layers[layer].xsum, inv = 1.0 / (double)s->info.tokens;
    for (int64_t i = 0; i < rows; i++) {
        double acc = 0;
        for (int64_t j = 0; j < d; j++) acc += (double)w[i * d + j] * xs[j];
        out[i] = acc * inv + (b ? (double)b[r0 + i] : 0.0);
    }
    return KV_OK;
}

int kv_stats_out_cov(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                     int which, int64_t head0, int64_t nh, double *out, struct kv_err *err) {
    return out_cov_core(s, m, layer, which, head0, nh, nh, out, err);
}

int kv_stats_out_cov_blocks(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                            int which, int64_t block, double *out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    return out_cov_core(s, m, layer, which, 0, which == 2 ? c->n_heads : c->n_kv_heads, block, out,
                        err);
}

int kv_stats_layer_spectrum(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                            struct kv_layer_spectrum *out, struct kv_err *err) {
    int64_t d = s->info.dim, dh = s->info.head_dim, g = s->info.n_kv_heads;
    const struct kv_stats_layer *L = &s->layers[layer];
    double *lam = malloc((size_t)(d > dh ? d : dh) * sizeof *lam);
    /* every kv head's K and V output covariance: one blocked call each */
    double *kcov = m ? malloc((size_t)(g * dh * dh) * sizeof *kcov) : NULL;
    double *vcov = m ? malloc((size_t)(g * dh * dh) * sizeof *vcov) : NULL;
    int rc = KV_OK;
    char what[96];
    if (!lam || (m && (!kcov || !vcov))) {
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    if (m && ((rc = kv_stats_out_cov_blocks(s, m, layer, 0, 1, kcov, err)) ||
              (rc = kv_stats_out_cov_blocks(s, m, layer, 1, 1, vcov, err))))
        goto done;
    out->trace = 0;
    for (int64_t i = 0; i < d; i++) out->trace += L->xtx[i * d + i];
    snprintf(what, sizeof what, "layer %lld attention input XᵀX", (long long)layer);
    if ((rc = kv_la_eigh(L->xtx, d, lam, NULL, what, err))) goto done;
    out->lambda_max = lam[0];
    out->lambda_min = lam[d - 1];
    out->cond = lam[d - 1] > 0 ? lam[0] / lam[d - 1] : INFINITY;
    out->x90 = kv_la_energy_rank(lam, d, 0.90);
    out->x99 = kv_la_energy_rank(lam, d, 0.99);
    for (int64_t j = 0; j < g; j++) {
        struct kv_head_spectrum *h = &out->heads[j];
        snprintf(what, sizeof what, "layer %lld kv head %lld post-rope K covariance",
                 (long long)layer, (long long)j);
        if ((rc = kv_la_eigh(L->k_cov + j * dh * dh, dh, lam, NULL, what, err))) goto done;
        h->krope90 = kv_la_energy_rank(lam, dh, 0.90);
        h->krope99 = kv_la_energy_rank(lam, dh, 0.99);
        h->k90 = h->k99 = h->v90 = h->v99 = -1;
        if (!m) continue;
        for (int which = 0; which < 2; which++) {
            const double *cv = (which ? vcov : kcov) + j * dh * dh;
            snprintf(what, sizeof what, "layer %lld kv head %lld %s output covariance",
                     (long long)layer, (long long)j, which ? "V" : "K");
            if ((rc = kv_la_eigh(cv, dh, lam, NULL, what, err))) goto done;
            int64_t r90 = kv_la_energy_rank(lam, dh, 0.90), r99 = kv_la_energy_rank(lam, dh, 0.99);
            if (which)
                h->v90 = r90, h->v99 = r99;
            else
                h->k90 = r90, h->k99 = r99;
        }
    }
done:
    free(lam), free(kcov), free(vcov);
    return rc;
}
