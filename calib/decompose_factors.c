/* The factors of the chosen ranks: per unit down/up (or a rotation), the
 * value side fused into the output projection, keys without RoPE fused into
 * the query, and the optional Hadamard rotation. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "decompose_ctx.h"
#include "err.h"
#include "kvstats.h"
#include "lrmodel.h"
#include "model.h"

static int build_unit(struct kv_dec_ctx *x, const struct kv_dec_slot *sl, const struct kv_dec_unit *un,
                      struct kv_lr_unit *out) {
    const struct kv_config *c = &x->m->cfg;
    int64_t mm = sl->m, r = sl->rank, d = c->dim, dh = c->head_dim;
    const double *V = un->vec;
    out->head0 = un->head0, out->n_heads = un->nh, out->rank = r;
    if (x->o->kv_bits == KV_DECOMPOSE_BITS_AUTO) {
        out->n_bands = sl->n_bands;
        memcpy(out->bands, sl->bands, sizeof out->bands);
    }
    /* reporting metric: energy = tr C, dropped = Σ_{j>=r} v_jᵀ C v_j */
    double *cv = malloc((size_t)(mm * mm) * sizeof *cv);
    if (!cv) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    cblas_dsymm(CblasRowMajor, CblasLeft, CblasUpper, (int)mm, (int)mm, 1.0, un->cov, (int)mm, V,
                (int)mm, 0.0, cv, (int)mm);
    double energy = 0, dropped = 0;
    for (int64_t j = 0; j < mm; j++) {
        double q = 0;
        for (int64_t a = 0; a < mm; a++) q += V[a * mm + j] * cv[a * mm + j];
        energy += q;
        if (j >= r) dropped += q;
    }
    free(cv);
    out->energy = energy;
    out->dropped = dropped > 0 ? dropped : 0;

    /* basis B = V[:, :r] (mm × r) */
    double *B = malloc((size_t)(mm * r) * sizeof *B);
    if (!B) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t a = 0; a < mm; a++)
        for (int64_t j = 0; j < r; j++) B[a * r + j] = V[a * mm + j];
    if (sl->rotation) {
        /* rot [r, d_h] = Bᵀ */
        int rc = KV_OK;
        if ((out->rot = malloc((size_t)(r * dh) * sizeof(float))))
            for (int64_t j = 0; j < r; j++)
                for (int64_t a = 0; a < dh; a++) out->rot[j * dh + a] = (float)B[a * r + j];
        else
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        free(B);
        return rc;
    }
    /* down [r, d] = Bdᵀ W_u, up [mm, r] = Bu, down_bias = Bdᵀ (b_u - μ),
     * up_bias = μ: Bd = Bu = B for the plain metric; with a metric B is a
     * basis of S y, so Bd = S B and Bu = S⁻¹ B. μ is the calibration mean
     * of centred factors (0 otherwise): y ≈ Bu Bdᵀ (y - μ) + μ. */
    const float *w = kv_model_weight(x->m, sl->side ? KV_W_V : KV_W_K, sl->layer) + un->head0 * dh * d;
    const float *bias = kv_model_weight(x->m, sl->side ? KV_W_BV : KV_W_BK, sl->layer);
    double *Bd = malloc((size_t)(mm * r) * sizeof *Bd), *Bu = malloc((size_t)(mm * r) * sizeof *Bu);
    double *wd = malloc((size_t)(mm * d) * sizeof *wd), *dn = malloc((size_t)(r * d) * sizeof *dn);
    double *mu = x->o->center ? malloc((size_t)mm * sizeof *mu) : NULL;
    out->down = malloc((size_t)(r * d) * sizeof(float));
    out->up = malloc((size_t)(mm * r) * sizeof(float));
    int rc = KV_OK;
    if (!Bd || !Bu || !wd || !dn || !out->down || !out->up || (x->o->center && !mu)) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    if (un->msqrt) {
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)mm, (int)r, (int)mm, 1.0,
                    un->msqrt, (int)mm, B, (int)r, 0.0, Bd, (int)r);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)mm, (int)r, (int)mm, 1.0,
                    un->misqrt, (int)mm, B, (int)r, 0.0, Bu, (int)r);
    } else {
        memcpy(Bd, B, (size_t)(mm * r) * sizeof *B);
        memcpy(Bu, B, (size_t)(mm * r) * sizeof *B);
    }
    for (int64_t i = 0; i < mm * d; i++) wd[i] = (double)w[i];
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)r, (int)d, (int)mm, 1.0, Bd, (int)r,
                wd, (int)d, 0.0, dn, (int)d);
    for (int64_t i = 0; i < r * d; i++) out->down[i] = (float)dn[i];
    for (int64_t i = 0; i < mm * r; i++) out->up[i] = (float)Bu[i];
    if (mu) {
        if (!(out->up_bias = malloc((size_t)mm * sizeof(float)))) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            goto done;
        }
        if ((rc = kv_stats_out_mean(x->s, x->m, sl->layer, sl->side, un->head0, un->nh, mu, x->err)))
            goto done;
        for (int64_t a = 0; a < mm; a++) out->up_bias[a] = (float)mu[a];
    }
    if (bias || mu) {
        if (!(out->down_bias = malloc((size_t)r * sizeof(float)))) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            goto done;
        }
        const float *bu = bias ? bias + un->head0 * dh : NULL;
        for (int64_t j = 0; j < r; j++) {
            double acc = 0;
            for (int64_t a = 0; a < mm; a++)
                acc += Bd[a * r + j] * ((bu ? (double)bu[a] : 0.0) - (mu ? mu[a] : 0.0));
            out->down_bias[j] = (float)acc;
        }
    }
done:
    free(B), free(Bd), free(Bu), free(wd), free(dn), free(mu);
    return rc;
}

/* o_fused [d, o_cols]: query head i's block is O_i · up_slice (d × r_u),
 * with O_i = o_proj[:, i*d_h ..] and up_slice the d_h rows of its KV head. */
static int fuse_output(const struct kv_model *m, int64_t l, struct kv_lr_layer *L,
                       struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, dh = c->head_dim, h = c->n_heads, grp = h / c->n_kv_heads, qd = h * dh;
    const struct kv_lr_side *v = &L->v;
    int64_t cols = 0;
    for (int64_t i = 0; i < h; i++)
        for (int64_t u = 0; u < v->n_units; u++) {
            const struct kv_lr_unit *un = &v->units[u];
            if (i / grp >= un->head0 && i / grp < un->head0 + un->n_heads) cols += un->rank;
        }
    L->o_cols = cols;
    L->o_fused = calloc((size_t)(d * cols), sizeof(float));
    if (!L->o_fused) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    const float *wo = kv_model_weight(m, KV_W_O, l);
    int64_t off = 0;
    for (int64_t i = 0; i < h; i++) {
        int64_t j = i / grp;
        const struct kv_lr_unit *un = NULL;
        for (int64_t u = 0; u < v->n_units; u++)
            if (j >= v->units[u].head0 && j < v->units[u].head0 + v->units[u].n_heads) un = &v->units[u];
        KV_ASSERT(un);
        const float *up = un->up + (j - un->head0) * dh * un->rank; /* [d_h, r] */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)d, (int)un->rank, (int)dh, 1.0f,
                    wo + i * dh, (int)qd, up, (int)un->rank, 0.0f, L->o_fused + off, (int)cols);
        off += un->rank;
    }
    /* centred values: Σ_i O_i μ_u(i), the mean each head's weights (summing
     * to 1) carry through unchanged */
    if (v->n_units && v->units[0].up_bias) {
        double *acc = calloc((size_t)d, sizeof *acc);
        if (!acc || !(L->o_fused_bias = malloc((size_t)d * sizeof(float)))) {
            free(acc);
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        }
        for (int64_t i = 0; i < h; i++) {
            int64_t j = i / grp;
            const struct kv_lr_unit *un = NULL;
            for (int64_t u = 0; u < v->n_units; u++)
                if (j >= v->units[u].head0 && j < v->units[u].head0 + v->units[u].n_heads) un = &v->units[u];
            const float *mu = un->up_bias + (j - un->head0) * dh;
            for (int64_t r = 0; r < d; r++)
                for (int64_t a = 0; a < dh; a++) acc[r] += (double)wo[r * qd + i * dh + a] * mu[a];
        }
        for (int64_t r = 0; r < d; r++) L->o_fused_bias[r] = (float)acc[r];
        free(acc);
    }
    return KV_OK;
}

/* Non-RoPE keys (fused_query): the query projection folded with each query
 * head's unit up-block U_i [d_h, r] (the d_h rows of its KV head):
 * q_fused rows [r, d] = U_iᵀ W_q,i and bias U_iᵀ b_q,i, query heads in
 * order, so q'_i · z = q_i · (U_i z) with no key ever rebuilt. */
static int fuse_query(const struct kv_model *m, int64_t l, struct kv_lr_layer *L,
                      struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, dh = c->head_dim, h = c->n_heads, grp = h / c->n_kv_heads;
    const struct kv_lr_side *k = &L->k;
    const float *wq = kv_model_weight(m, KV_W_Q, l), *bq = kv_model_weight(m, KV_W_BQ, l);
    const struct kv_lr_unit **of = calloc((size_t)h, sizeof *of);
    if (!of) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int64_t cols = 0;
    for (int64_t i = 0; i < h; i++) {
        for (int64_t u = 0; u < k->n_units; u++)
            if (i / grp >= k->units[u].head0 && i / grp < k->units[u].head0 + k->units[u].n_heads)
                of[i] = &k->units[u];
        KV_ASSERT(of[i]);
        cols += of[i]->rank;
    }
    L->q_cols = cols;
    L->q_fused = malloc((size_t)(cols * d) * sizeof(float));
    L->q_fused_bias = bq ? calloc((size_t)cols, sizeof(float)) : NULL;
    if (!L->q_fused || (bq && !L->q_fused_bias)) {
        free(of);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    int64_t off = 0;
    for (int64_t i = 0; i < h; i++) {
        const struct kv_lr_unit *un = of[i];
        const float *up = un->up + (i / grp - un->head0) * dh * un->rank; /* [d_h, r] */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)un->rank, (int)d, (int)dh, 1.0f,
                    up, (int)un->rank, wq + i * dh * d, (int)d, 0.0f, L->q_fused + off * d, (int)d);
        if (bq)
            for (int64_t a = 0; a < un->rank; a++) {
                double acc = 0;
                for (int64_t b = 0; b < dh; b++) acc += (double)up[b * un->rank + a] * bq[i * dh + b];
                L->q_fused_bias[off + a] = (float)acc;
            }
        off += un->rank;
    }
    free(of);
    return KV_OK;
}

/* --kv-bits auto: when every compressed unit is one band of one width B,
 * the model is plain B bits (the band's rotation is the whole rank's), so
 * a runtime without bands runs it. */
static void one_width(struct kv_lowrank *lr) {
    int width = 0;
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int w = 0; w < 2; w++) {
            const struct kv_lr_side *sd = kv_lr_side(lr, l, w);
            for (int64_t u = 0; sd->mode != KV_LR_FULL && u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                if (un->n_bands != 1 || (width && un->bands[0].bits != width)) return;
                width = un->bands[0].bits;
            }
        }
    struct kv_err ignore;
    if (width) kv_lr_set_kv_bits(lr, width, &ignore); /* a listed width: cannot fail */
}

int kv_dec_build_lowrank(struct kv_dec_ctx *x, struct kv_lowrank **out) {
    const struct kv_model *m = x->m;
    const struct kv_config *c = &m->cfg;
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    if (!lr) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    snprintf(lr->info.method, sizeof lr->info.method, "%s", kv_method_name(x->o->method));
    snprintf(lr->info.alloc, sizeof lr->info.alloc, "%s", kv_alloc_name(x->o->alloc));
    lr->info.n_layers = c->n_layers, lr->info.dim = c->dim, lr->info.n_heads = c->n_heads;
    lr->info.n_kv_heads = c->n_kv_heads, lr->info.head_dim = c->head_dim;
    lr->info.kv_bits = x->o->kv_bits == KV_DECOMPOSE_BITS_AUTO ? KV_LR_BITS_MIXED : (int)x->o->kv_bits;
    int rc = KV_OK;
    if (x->s) snprintf(lr->info.model_fingerprint, sizeof lr->info.model_fingerprint, "%s", x->s->info.fingerprint);
    else rc = kv_model_fingerprint(m, lr->info.model_fingerprint, x->err); /* memoised in m */
    if (!rc && !(lr->layers = calloc((size_t)c->n_layers, sizeof *lr->layers)))
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < x->n_slots && !rc; i++) {
        const struct kv_dec_slot *sl = &x->slots[i];
        struct kv_lr_side *sd = sl->side ? &lr->layers[sl->layer].v : &lr->layers[sl->layer].k;
        if (sl->skip) continue;
        /* keys without RoPE fold their up projection into the query */
        enum kv_lr_mode kmode =
            kv_arch_desc(c->arch)->rope ? KV_LR_PREROPE_LATENT : KV_LR_FUSED_QUERY;
        sd->mode = sl->side ? KV_LR_FUSED_OUTPUT : (sl->rotation ? KV_LR_POSTROPE_ROTATION : kmode);
        struct kv_lr_unit *nu = realloc(sd->units, (size_t)(sd->n_units + sl->n_units) * sizeof *nu);
        if (!nu) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            break;
        }
        sd->units = nu;
        for (int64_t u = 0; u < sl->n_units && !rc; u++) {
            struct kv_lr_unit *un = &sd->units[sd->n_units];
            memset(un, 0, sizeof *un);
            sd->n_units++;
            rc = build_unit(x, sl, &sl->units[u], un);
        }
    }
    for (int64_t l = 0; l < c->n_layers && !rc; l++) {
        if (lr->layers[l].v.mode == KV_LR_FUSED_OUTPUT) rc = fuse_output(m, l, &lr->layers[l], x->err);
        if (!rc && lr->layers[l].k.mode == KV_LR_FUSED_QUERY)
            rc = fuse_query(m, l, &lr->layers[l], x->err);
    }
    if (!rc && x->o->hadamard) rc = kv_lr_fuse_hadamard(lr, x->err);
    if (!rc && x->o->kv_bits == KV_DECOMPOSE_BITS_AUTO) one_width(lr);
    if (rc) {
        kv_lr_free(lr);
        return rc;
    }
    *out = lr;
    return KV_OK;
}
