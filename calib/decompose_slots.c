/* The bases of a decomposition: the slots of every layer, one list per
 * method, each unit with its basis and reporting covariance
 * (decompose_ctx.h).
 *
 * With o->center every K and V output covariance below is centred,
 * Σ (y-μ)(y-μ)ᵀ (the post-RoPE statistics of rotation keys are not).
 *
 * Allocation Gram per method (m = unit width):
 *   svd, lorc       W_u W_uᵀ                     (C_x = I; lorc units = all g heads)
 *   palu, fdc V     output covariance W C_x Wᵀ   (units of group_size heads)
 *   eigen K         Σ_i C_q,i + Σ_j C_k,j pre-RoPE, one basis shared by all heads
 *   eigen V         C_v,j per head, one rank per layer (the max over heads)
 *   fdc/zack K      Σ_{i→j} q_rope_i + k_rope_j per KV head (post-RoPE stats)
 *   zack V          C_v,j / tr C_v,j + M_j / tr M_j per KV head, with
 *                   M_j = Σ_{i→j} W_O,i W_O,iᵀ (each term of unit trace:
 *                   docs/design.md, "ZACK's value rotation") */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "decompose_ctx.h"
#include "err.h"
#include "kvstats.h"
#include "linalg.h"
#include "model.h"

void kv_dec_slots_free(struct kv_dec_slot *sl, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        free(sl[i].lam), free(sl[i].vecs), free(sl[i].tail), free(sl[i].ltail);
        if (sl[i].units)
            for (int64_t u = 0; u < sl[i].n_units; u++) {
                struct kv_dec_unit *un = &sl[i].units[u];
                free(un->cov), free(un->msqrt), free(un->misqrt), free(un->err), free(un->lvar);
            }
        free(sl[i].units);
    }
    free(sl);
}

/* Gram W_u W_uᵀ of rows r0 .. r0+mm-1 of a [*, d] weight. */
int kv_dec_weight_gram(const float *w, int64_t r0, int64_t mm, int64_t d, double *out,
                       struct kv_err *err) {
    double *wd = malloc((size_t)(mm * d) * sizeof *wd);
    if (!wd) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < mm * d; i++) wd[i] = (double)w[r0 * d + i];
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)mm, (int)d, 1.0, wd, (int)d, 0.0,
                out, (int)mm);
    for (int64_t i = 0; i < mm; i++)
        for (int64_t j = 0; j < i; j++) out[i * mm + j] = out[j * mm + i];
    free(wd);
    return KV_OK;
}

/* Σ (y-μ)(y-μ)ᵀ = Σ yyᵀ - N μμᵀ in place, for the blocks of out_covs. */
static int center_blocks(struct kv_dec_ctx *x, int64_t l, int which, int64_t block, double *o) {
    const struct kv_config *c = &x->m->cfg;
    int64_t heads = c->n_kv_heads, bw = block * c->head_dim;
    double *mu = malloc((size_t)(heads * c->head_dim) * sizeof *mu), n = (double)x->s->info.tokens;
    if (!mu) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = kv_stats_out_mean(x->s, x->m, l, which, 0, heads, mu, x->err);
    for (int64_t k = 0; k < heads / block && !rc; k++) {
        const double *m = mu + k * bw;
        double *b = o + k * bw * bw;
        for (int64_t i = 0; i < bw; i++)
            for (int64_t j = 0; j < bw; j++) b[i * bw + j] -= n * m[i] * m[j];
    }
    free(mu);
    return rc;
}

/* One W C_x product for all the blocks. */
int kv_dec_out_covs(struct kv_dec_ctx *x, int64_t l, int which, int64_t block, double **out) {
    const struct kv_config *c = &x->m->cfg;
    int64_t heads = which == 2 ? c->n_heads : c->n_kv_heads, bw = block * c->head_dim;
    double *o = malloc((size_t)(heads * bw * c->head_dim) * sizeof *o);
    if (!o) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = KV_OK;
    if (x->s) {
        rc = kv_stats_out_cov_blocks(x->s, x->m, l, which, block, o, x->err);
        if (!rc && x->o->center && which != 2) rc = center_blocks(x, l, which, block, o);
    } else {
        static const enum kv_wkind wk[3] = {KV_W_K, KV_W_V, KV_W_Q};
        for (int64_t k = 0; k < heads / block && !rc; k++)
            rc = kv_dec_weight_gram(kv_model_weight(x->m, wk[which], l), k * bw, bw, c->dim, o + k * bw * bw, x->err);
    }
    if (rc) {
        free(o);
        return rc;
    }
    *out = o;
    return KV_OK;
}

int kv_dec_eigh(struct kv_dec_ctx *x, const double *a, int64_t n, double *w, double *vec,
                const char *what) {
    double t0 = kv_now();
    int rc = kv_la_eigh(a, n, w, vec, what, x->err);
    x->lapack_s += kv_now() - t0;
    for (int64_t i = 0; i < n; i++)
        if (w[i] < 0) w[i] = 0;
    return rc;
}

/* un->var: the trace of its plain covariance (un->cov before any metric),
 * less N‖μ‖² for uncentred K/V outputs with statistics (rotation keys: the
 * post-RoPE mean is not in the statistics, so their energy). */
static int unit_var(struct kv_dec_ctx *x, int64_t l, int side, int rotation, struct kv_dec_unit *un,
                    int64_t mm) {
    double tr = 0;
    for (int64_t a = 0; a < mm; a++) tr += un->cov[a * mm + a];
    un->var = tr;
    if (!x->s || x->o->center || rotation) return KV_OK;
    double *mu = malloc((size_t)mm * sizeof *mu);
    if (!mu) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = kv_stats_out_mean(x->s, x->m, l, side, un->head0, un->nh, mu, x->err);
    double n2 = 0;
    for (int64_t a = 0; a < mm && !rc; a++) n2 += mu[a] * mu[a];
    free(mu);
    un->var = tr - (double)x->s->info.tokens * n2;
    if (un->var < 0) un->var = 0;
    return rc;
}

/* What the eps rule and global's loss cost read of a unit's basis U (its
 * columns u_j): un->err [m+1] = Σ_{j>=r} var_j ‖d_j‖², the plain squared
 * error of keeping u_0 .. u_{r-1}, un->lvar [m] = var_j, and, when F is not NULL, Σ_{j>=r} var_j
 * d_jᵀ F d_j added into ltail [m+1] (the predicted loss; F the unit's
 * gradient Gram per token). var_j = u_jᵀ G u_j (G = un->cov) is latent j's
 * energy and d_j = S⁻¹ u_j its direction in plain output space (u_j
 * without a metric). With a metric U diagonalises G = S C S, so the cross
 * terms vanish; for a basis that does not diagonalise G (eigen's shared
 * keys, weight-only bases) err is still exact (U is orthonormal) and ltail
 * keeps the diagonal terms. */
static int unit_costs(struct kv_dec_ctx *x, struct kv_dec_unit *un, int64_t mm, const double *F,
                      double *ltail) {
    const double *V = un->vec;
    double *gv = malloc((size_t)(mm * mm) * sizeof *gv), *D = malloc((size_t)(mm * mm) * sizeof *D);
    double *FD = F ? malloc((size_t)(mm * mm) * sizeof *FD) : NULL;
    if (!gv || !D || (F && !FD) || !(un->err = kv_dec_calloc(mm + 1, sizeof *un->err)) ||
        !(un->lvar = kv_dec_calloc(mm, sizeof *un->lvar))) {
        free(gv), free(D), free(FD);
        return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    cblas_dsymm(CblasRowMajor, CblasLeft, CblasUpper, (int)mm, (int)mm, 1.0, un->cov, (int)mm, V, (int)mm,
                0.0, gv, (int)mm);
    if (un->misqrt)
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)mm, (int)mm, (int)mm, 1.0, un->misqrt,
                    (int)mm, V, (int)mm, 0.0, D, (int)mm);
    else
        memcpy(D, V, (size_t)(mm * mm) * sizeof *D);
    if (F)
        cblas_dsymm(CblasRowMajor, CblasLeft, CblasUpper, (int)mm, (int)mm, 1.0, F, (int)mm, D, (int)mm, 0.0,
                    FD, (int)mm);
    double lacc = 0;
    for (int64_t j = mm - 1; j >= 0; j--) {
        double var = 0, dd = 0, dfd = 0;
        for (int64_t a = 0; a < mm; a++) {
            var += V[a * mm + j] * gv[a * mm + j];
            dd += D[a * mm + j] * D[a * mm + j];
            if (F) dfd += D[a * mm + j] * FD[a * mm + j];
        }
        var = var > 0 ? var : 0;
        un->lvar[j] = var;
        un->err[j] = un->err[j + 1] + var * dd;
        if (F) {
            lacc += var * (dfd > 0 ? dfd : 0);
            ltail[j] += lacc;
        }
    }
    free(gv), free(D), free(FD);
    return KV_OK;
}

/* Every unit's err, and with Fisher statistics (not for post-RoPE rotation
 * keys, whose gradients are pre-RoPE) the slot's ltail: unit_costs with F
 * the block-diagonal gradient Gram of the unit's heads, per token. */
static int slot_costs(struct kv_dec_ctx *x, struct kv_dec_slot *sl) {
    int64_t mm = sl->m, dh = x->m->cfg.head_dim;
    int loss = x->s && x->s->info.has_fisher && !sl->rotation;
    double *F = loss ? malloc((size_t)(mm * mm) * sizeof *F) : NULL;
    if ((loss && !F) || (loss && !(sl->ltail = kv_dec_calloc(mm + 1, sizeof *sl->ltail)))) {
        free(F);
        return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    int rc = KV_OK;
    for (int64_t u = 0; u < sl->n_units && !rc; u++) {
        struct kv_dec_unit *un = &sl->units[u];
        if (!un->msqrt && (rc = unit_var(x, sl->layer, sl->side, sl->rotation, un, mm))) break;
        if (loss) {
            const struct kv_stats_layer *L = &x->s->layers[sl->layer];
            const double *gc = sl->side ? L->grad_v_cov : L->grad_k_cov;
            double n = x->s->info.tokens > 0 ? (double)x->s->info.tokens : 1.0;
            memset(F, 0, (size_t)(mm * mm) * sizeof *F);
            for (int64_t k = 0; k < mm / dh; k++)
                for (int64_t a = 0; a < dh; a++)
                    for (int64_t b = 0; b < dh; b++)
                        F[(k * dh + a) * mm + k * dh + b] = gc[(un->head0 + k) * dh * dh + a * dh + b] / n;
        }
        rc = unit_costs(x, un, mm, F, sl->ltail);
    }
    free(F);
    return rc;
}

static struct kv_dec_slot *new_slot(struct kv_dec_ctx *x, int64_t l, int side, int64_t mm, int64_t n_units,
                             int64_t n_spec) {
    struct kv_dec_slot *tmp = realloc(x->slots, (size_t)(x->n_slots + 1) * sizeof *tmp);
    if (!tmp) return NULL;
    x->slots = tmp;
    struct kv_dec_slot *sl = &x->slots[x->n_slots++];
    memset(sl, 0, sizeof *sl);
    sl->layer = l, sl->side = side, sl->m = mm, sl->n_units = n_units, sl->n_spec = n_spec;
    sl->lam = kv_dec_calloc(n_spec * mm, sizeof *sl->lam);
    sl->vecs = kv_dec_calloc(n_spec * mm * mm, sizeof *sl->vecs);
    sl->units = kv_dec_calloc(n_units, sizeof *sl->units);
    if (!sl->lam || !sl->vecs || !sl->units) return NULL;
    for (int64_t u = 0; u < n_units; u++)
        if (!(sl->units[u].cov = kv_dec_calloc(mm * mm, sizeof(double)))) return NULL;
    return sl;
}

static void add_to(double *acc, const double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += a[i];
}

/* One slot per unit of s heads, covering the g KV heads: the allocation
 * Gram is the output covariance, or the weight Gram when weight_metric. */
static int plain_slots(struct kv_dec_ctx *x, int64_t l, int side, int64_t s, int weight_metric) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, dh = c->head_dim, mm = s * dh;
    double *covs, *wg = NULL, *hm = NULL, *um = NULL, *tmp = NULL;
    int rc = kv_dec_out_covs(x, l, side, s, &covs);
    if (rc) return rc;
    if (weight_metric && x->s && !(wg = malloc((size_t)(mm * mm) * sizeof *wg)))
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int metric = !weight_metric && x->s && x->o->basis != KV_BASIS_ENERGY;
    if (metric && !rc) {
        hm = malloc((size_t)(g * dh * dh) * sizeof *hm);
        um = malloc((size_t)(mm * mm) * sizeof *um), tmp = malloc((size_t)(mm * mm) * sizeof *tmp);
        rc = hm && um && tmp ? kv_dec_head_metrics(x, l, side, hm)
                             : kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    for (int64_t h0 = 0; h0 < g && !rc; h0 += s) {
        struct kv_dec_slot *sl = new_slot(x, l, side, mm, 1, 1);
        if (!sl) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            break;
        }
        sl->units[0].head0 = h0, sl->units[0].nh = s, sl->units[0].vec = sl->vecs;
        memcpy(sl->units[0].cov, covs + (h0 / s) * mm * mm, (size_t)(mm * mm) * sizeof *covs);
        const double *gram = sl->units[0].cov;
        char what[96];
        if (metric) {
            /* the unit's metric: block-diagonal over its heads; the basis
             * and the reporting covariance are then of S y, S = M^½ */
            struct kv_dec_unit *un = &sl->units[0];
            if ((rc = unit_var(x, l, side, 0, un, mm))) break; /* of the plain output */
            memset(um, 0, (size_t)(mm * mm) * sizeof *um);
            for (int64_t k = 0; k < s; k++)
                for (int64_t a = 0; a < dh; a++)
                    memcpy(um + (k * dh + a) * mm + k * dh, hm + (h0 + k) * dh * dh + a * dh,
                           (size_t)dh * sizeof *um);
            un->msqrt = malloc((size_t)(mm * mm) * sizeof *un->msqrt);
            un->misqrt = malloc((size_t)(mm * mm) * sizeof *un->misqrt);
            if (!un->msqrt || !un->misqrt) {
                rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
                break;
            }
            snprintf(what, sizeof what, "layer %lld %s %s metric of heads %lld..%lld", (long long)l,
                     side ? "v" : "k", kv_basis_name(x->o->basis), (long long)h0, (long long)(h0 + s - 1));
            if ((rc = kv_dec_metric_sqrt(x, um, mm, un->msqrt, un->misqrt, what))) break;
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)mm, (int)mm, (int)mm, 1.0,
                        un->msqrt, (int)mm, un->cov, (int)mm, 0.0, tmp, (int)mm);
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)mm, (int)mm, (int)mm, 1.0, tmp,
                        (int)mm, un->msqrt, (int)mm, 0.0, un->cov, (int)mm);
            for (int64_t a = 0; a < mm; a++) /* exactly symmetric for the eigensolver */
                for (int64_t b = 0; b < a; b++)
                    un->cov[a * mm + b] = un->cov[b * mm + a] = 0.5 * (un->cov[a * mm + b] + un->cov[b * mm + a]);
        }
        if (wg) {
            if ((rc = kv_dec_weight_gram(kv_model_weight(x->m, side ? KV_W_V : KV_W_K, l), h0 * dh, mm, c->dim, wg,
                                  x->err)))
                break;
            gram = wg;
        }
        snprintf(what, sizeof what, "layer %lld %s unit of heads %lld..%lld", (long long)l,
                 side ? "v" : "k", (long long)h0, (long long)(h0 + s - 1));
        rc = kv_dec_eigh(x, gram, mm, sl->lam, sl->vecs, what);
    }
    free(covs), free(wg), free(hm), free(um), free(tmp);
    return rc;
}

/* fdc/zack keys: per KV head, Gram of the stacked post-RoPE [Q; K]. */
static int rotation_key_slots(struct kv_dec_ctx *x, int64_t l) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, dh = c->head_dim, grp = c->n_heads / g, n2 = dh * dh;
    const struct kv_stats_layer *L = &x->s->layers[l];
    double *gram = malloc((size_t)n2 * sizeof *gram);
    if (!gram) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = KV_OK;
    for (int64_t j = 0; j < g && !rc; j++) {
        struct kv_dec_slot *sl = new_slot(x, l, 0, dh, 1, 1);
        if (!sl) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            break;
        }
        sl->rotation = 1;
        sl->units[0].head0 = j, sl->units[0].nh = 1, sl->units[0].vec = sl->vecs;
        memcpy(sl->units[0].cov, L->k_cov + j * n2, (size_t)n2 * sizeof *gram);
        memcpy(gram, L->k_cov + j * n2, (size_t)n2 * sizeof *gram);
        for (int64_t i = j * grp; i < (j + 1) * grp; i++) add_to(gram, L->q_cov + i * n2, n2);
        char what[96];
        snprintf(what, sizeof what, "layer %lld k rotation of head %lld", (long long)l, (long long)j);
        rc = kv_dec_eigh(x, gram, dh, sl->lam, sl->vecs, what);
    }
    free(gram);
    return rc;
}

/* Eigen Attention keys: with RoPE one pre-RoPE basis from Σ C_q + Σ C_k
 * shared by all heads (paper §4.3); without RoPE (gpt2, the paper's OPT/MPT
 * form) a basis per head from its own C_q + C_k, which queries and keys
 * share, so attention runs in the low-rank space (fused_query). Values: a
 * basis per head, one rank per layer. */
static int eigen_slots(struct kv_dec_ctx *x, int64_t l) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, h = c->n_heads, dh = c->head_dim, n2 = dh * dh;
    int per_head = !kv_arch_desc(c->arch)->rope; /* fused_query keys; then h == g */
    double *gram = kv_dec_calloc(n2, sizeof *gram), *qc = NULL, *kc = NULL, *vc = NULL;
    struct kv_dec_slot *sk = new_slot(x, l, 0, dh, g, per_head ? g : 1);
    int rc = KV_OK;
    if (!gram || !sk) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    if ((rc = kv_dec_out_covs(x, l, 2, 1, &qc)) || (rc = kv_dec_out_covs(x, l, 0, 1, &kc)) ||
        (rc = kv_dec_out_covs(x, l, 1, 1, &vc)))
        goto done;
    char what[96];
    if (per_head) {
        for (int64_t j = 0; j < g && !rc; j++) {
            sk->units[j].head0 = j, sk->units[j].nh = 1, sk->units[j].vec = sk->vecs + j * n2;
            memcpy(sk->units[j].cov, kc + j * n2, (size_t)n2 * sizeof *kc);
            memcpy(gram, qc + j * n2, (size_t)n2 * sizeof *gram);
            add_to(gram, kc + j * n2, n2);
            snprintf(what, sizeof what, "layer %lld q-k basis of head %lld", (long long)l, (long long)j);
            rc = kv_dec_eigh(x, gram, dh, sk->lam + j * dh, sk->vecs + j * n2, what);
        }
        if (rc) goto done;
    } else {
        for (int64_t i = 0; i < h; i++) add_to(gram, qc + i * n2, n2);
        for (int64_t j = 0; j < g; j++) {
            sk->units[j].head0 = j, sk->units[j].nh = 1, sk->units[j].vec = sk->vecs;
            memcpy(sk->units[j].cov, kc + j * n2, (size_t)n2 * sizeof *kc);
            add_to(gram, kc + j * n2, n2);
        }
        snprintf(what, sizeof what, "layer %lld shared key basis", (long long)l);
        if ((rc = kv_dec_eigh(x, gram, dh, sk->lam, sk->vecs, what))) goto done;
    }
    struct kv_dec_slot *sv = new_slot(x, l, 1, dh, g, g);
    if (!sv) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    for (int64_t j = 0; j < g && !rc; j++) {
        sv->units[j].head0 = j, sv->units[j].nh = 1, sv->units[j].vec = sv->vecs + j * n2;
        memcpy(sv->units[j].cov, vc + j * n2, (size_t)n2 * sizeof *vc);
        snprintf(what, sizeof what, "layer %lld v head %lld", (long long)l, (long long)j);
        rc = kv_dec_eigh(x, sv->units[j].cov, dh, sv->lam + j * dh, sv->vecs + j * n2, what);
    }
done:
    free(gram), free(qc), free(kc), free(vc);
    return rc;
}

/* ZACK values: per KV head, the Gram of [V_j; W_O,iᵀ for its query heads]
 * with each block scaled to unit energy: C_v,j / tr C_v,j + M_j / tr M_j.
 * Unscaled, C_v (a sum over every calibration token) drowns M and the
 * rotation is fdc's. */
static int zack_value_slots(struct kv_dec_ctx *x, int64_t l) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, dh = c->head_dim;
    double *gram = malloc((size_t)(dh * dh) * sizeof *gram), *vc = NULL;
    if (!gram) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = kv_dec_out_covs(x, l, 1, 1, &vc);
    for (int64_t j = 0; j < g && !rc; j++) {
        struct kv_dec_slot *sl = new_slot(x, l, 1, dh, 1, 1);
        if (!sl) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            break;
        }
        sl->units[0].head0 = j, sl->units[0].nh = 1, sl->units[0].vec = sl->vecs;
        const double *cv = vc + j * dh * dh;
        memcpy(sl->units[0].cov, cv, (size_t)(dh * dh) * sizeof *vc);
        /* M_j = Σ W_O,i W_O,iᵀ = Σ B_iᵀ B_i with B_i = o_proj[:, i*d_h ..] (d × d_h) */
        if ((rc = kv_dec_o_gram(x->m, l, j, gram, x->err))) break;
        double tv = 0, tm = 0;
        for (int64_t a = 0; a < dh; a++) tv += cv[a * dh + a], tm += gram[a * dh + a];
        double sv = tv > 0 ? 1.0 / tv : 0, sm = tm > 0 ? 1.0 / tm : 0;
        for (int64_t a = 0; a < dh; a++)
            for (int64_t b = a; b < dh; b++)
                gram[a * dh + b] = gram[b * dh + a] = sv * cv[a * dh + b] + sm * gram[a * dh + b];
        char what[96];
        snprintf(what, sizeof what, "layer %lld v-o rotation of head %lld", (long long)l, (long long)j);
        rc = kv_dec_eigh(x, gram, dh, sl->lam, sl->vecs, what);
    }
    free(gram), free(vc);
    return rc;
}

int kv_dec_build_slots(struct kv_dec_ctx *x) {
    const struct kv_config *c = &x->m->cfg;
    struct kv_decompose_opts *o = x->o;
    int64_t g = c->n_kv_heads, s = o->group_size > 0 ? o->group_size : 1;
    for (int64_t l = 0; l < c->n_layers; l++) {
        int rc = KV_OK;
        switch (o->method) {
        case KV_METHOD_SVD:
            if (!(rc = plain_slots(x, l, 0, s, 1))) rc = plain_slots(x, l, 1, s, 1);
            break;
        case KV_METHOD_LORC:
            if (!(rc = plain_slots(x, l, 0, g, 1))) rc = plain_slots(x, l, 1, g, 1);
            break;
        case KV_METHOD_PALU:
            if (!(rc = plain_slots(x, l, 0, s, 0))) rc = plain_slots(x, l, 1, s, 0);
            break;
        case KV_METHOD_EIGEN: rc = eigen_slots(x, l); break;
        case KV_METHOD_FDC:
            if (!(rc = rotation_key_slots(x, l))) rc = plain_slots(x, l, 1, s, 0);
            break;
        case KV_METHOD_ZACK:
            if (!(rc = rotation_key_slots(x, l))) rc = zack_value_slots(x, l);
            break;
        default: KV_ASSERT(0);
        }
        if (rc) return rc;
        if (o->progress) o->progress(o->progress_ctx, l + 1, c->n_layers, 0);
    }
    for (int64_t i = 0; i < x->n_slots; i++) {
        struct kv_dec_slot *sl = &x->slots[i];
        int rc = slot_costs(x, sl);
        if (rc) return rc;
        for (int64_t k = 0; k < sl->n_spec * sl->m; k++) sl->energy += sl->lam[k];
        if (!(sl->tail = kv_dec_calloc(sl->m + 1, sizeof *sl->tail)))
            return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        for (int64_t r = sl->m - 1; r >= 0; r--) {
            double t = 0;
            for (int64_t k = 0; k < sl->n_spec; k++) t += sl->lam[k * sl->m + r];
            sl->tail[r] = sl->tail[r + 1] + (sl->energy > 0 ? t / sl->energy : 0);
        }
    }
    return KV_OK;
}
