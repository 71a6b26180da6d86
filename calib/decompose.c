/* kvcal decompose: units, spectra, rank allocation and factors (DESIGN §3–§5).
 *
 * Every method reduces to the same objects. A *slot* is what gets one rank:
 * one or more units (KV heads head0.. of one layer's K or V) and the spectra
 * the allocation reads. Each unit has an orthonormal basis (the eigenvectors
 * of its allocation Gram matrix, columns in descending order) and a
 * reporting covariance C (the calibration second moment of what it
 * reconstructs). Keeping the first r basis columns V_r gives
 *   down = V_rᵀ W_u (+ V_rᵀ b_u),  up = V_r          (latent modes)
 *   rot  = V_rᵀ                                    (post-RoPE rotation)
 * and the predicted error Σ over dropped columns of vᵀ C v, which for the
 * whitened methods is exactly the sum of the dropped eigenvalues.
 *
 * Allocation Gram per method (m = unit width):
 *   svd, lorc       W_u W_uᵀ                     (C_x = I; lorc units = all g heads)
 *   palu, fdc V     output covariance W C_x Wᵀ   (units of group_size heads)
 *   eigen K         Σ_i C_q,i + Σ_j C_k,j pre-RoPE, one basis shared by all heads
 *   eigen V         C_v,j per head, one rank per layer (the max over heads)
 *   fdc/zack K      Σ_{i→j} q_rope_i + k_rope_j per KV head (post-RoPE stats)
 *   zack V          C_v,j + Σ_{i→j} W_O,i W_O,iᵀ per KV head */
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

static const char *const method_names[KV_METHOD_COUNT] = {"svd", "palu", "eigen",
                                                           "lorc", "fdc", "zack"};
static const char *const alloc_names[KV_ALLOC_COUNT] = {
    "default", "eps", "uniform", "fisher", "progressive", "removal", "layer-budget", "global"};

const char *kv_method_name(enum kv_method m) {
    return (unsigned)m < KV_METHOD_COUNT ? method_names[m] : "?";
}
const char *kv_alloc_name(enum kv_alloc a) {
    return (unsigned)a < KV_ALLOC_COUNT ? alloc_names[a] : "?";
}
int kv_method_parse(const char *s) {
    for (int i = 0; i < KV_METHOD_COUNT; i++)
        if (!strcmp(s, method_names[i])) return i;
    return -1;
}
int kv_alloc_parse(const char *s) {
    for (int i = 1; i < KV_ALLOC_COUNT; i++)
        if (!strcmp(s, alloc_names[i])) return i;
    return -1;
}

struct unit {
    int64_t head0, nh;
    const double *vec; /* [m, m] row-major, column j = basis vector j */
    double *cov;       /* [m, m] reporting covariance (owned) */
};

struct slot {
    int64_t layer;
    int side;     /* 0 = K, 1 = V */
    int rotation; /* post-RoPE key rotation */
    int64_t m, n_units, n_spec;
    double *lam;  /* [n_spec, m] descending, negatives clamped to 0 */
    double *vecs; /* owned bases, n_spec of them */
    struct unit *units;
    double energy; /* Σ of all spectra */
    double *tail;  /* [m+1]: Σ over spectra of λ_i for i >= r, relative to energy */
    double fisher, logcond;
    int skip;
    int64_t rank;
};

struct dctx {
    const struct kv_model *m;
    const struct kv_stats *s;
    struct kv_decompose_opts *o;
    struct slot *slots;
    int64_t n_slots;
    double lapack_s;
    struct kv_err *err;
};

static void *xcalloc(int64_t n, size_t sz) { return calloc((size_t)(n > 0 ? n : 1), sz); }

static void slots_free(struct slot *sl, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        free(sl[i].lam), free(sl[i].vecs), free(sl[i].tail);
        if (sl[i].units)
            for (int64_t u = 0; u < sl[i].n_units; u++) free(sl[i].units[u].cov);
        free(sl[i].units);
    }
    free(sl);
}

/* Gram W_u W_uᵀ of rows r0 .. r0+mm-1 of a [*, d] weight. */
static int weight_gram(const float *w, int64_t r0, int64_t mm, int64_t d, double *out,
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

/* Output covariances of every head of `which` (0 K, 1 V, 2 Q) as blocks of
 * `block` heads, [heads/block][block*d_h][block*d_h] in a malloc'd *out
 * (one W C_x product for all of them); weight Grams without statistics. */
static int out_covs(struct dctx *x, int64_t l, int which, int64_t block, double **out) {
    const struct kv_config *c = &x->m->cfg;
    int64_t heads = which == 2 ? c->n_heads : c->n_kv_heads, bw = block * c->head_dim;
    double *o = malloc((size_t)(heads * bw * c->head_dim) * sizeof *o);
    if (!o) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = KV_OK;
    if (x->s) {
        rc = kv_stats_out_cov_blocks(x->s, x->m, l, which, block, o, x->err);
    } else {
        static const enum kv_wkind wk[3] = {KV_W_K, KV_W_V, KV_W_Q};
        for (int64_t k = 0; k < heads / block && !rc; k++)
            rc = weight_gram(x->m->layers[l].w[wk[which]], k * bw, bw, c->dim, o + k * bw * bw, x->err);
    }
    if (rc) {
        free(o);
        return rc;
    }
    *out = o;
    return KV_OK;
}

static int eigh(struct dctx *x, const double *a, int64_t n, double *w, double *vec,
                const char *what) {
    double t0 = kv_now();
    int rc = kv_la_eigh(a, n, w, vec, what, x->err);
    x->lapack_s += kv_now() - t0;
    for (int64_t i = 0; i < n; i++)
        if (w[i] < 0) w[i] = 0;
    return rc;
}

static struct slot *new_slot(struct dctx *x, int64_t l, int side, int64_t mm, int64_t n_units,
                             int64_t n_spec) {
    struct slot *tmp = realloc(x->slots, (size_t)(x->n_slots + 1) * sizeof *tmp);
    if (!tmp) return NULL;
    x->slots = tmp;
    struct slot *sl = &x->slots[x->n_slots++];
    memset(sl, 0, sizeof *sl);
    sl->layer = l, sl->side = side, sl->m = mm, sl->n_units = n_units, sl->n_spec = n_spec;
    sl->lam = xcalloc(n_spec * mm, sizeof *sl->lam);
    sl->vecs = xcalloc(n_spec * mm * mm, sizeof *sl->vecs);
    sl->units = xcalloc(n_units, sizeof *sl->units);
    if (!sl->lam || !sl->vecs || !sl->units) return NULL;
    for (int64_t u = 0; u < n_units; u++)
        if (!(sl->units[u].cov = xcalloc(mm * mm, sizeof(double)))) return NULL;
    return sl;
}

static void add_to(double *acc, const double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += a[i];
}

/* One slot per unit of s heads, covering the g KV heads: the allocation
 * Gram is the output covariance, or the weight Gram when weight_metric. */
static int plain_slots(struct dctx *x, int64_t l, int side, int64_t s, int weight_metric) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, dh = c->head_dim, mm = s * dh;
    double *covs, *wg = NULL;
    int rc = out_covs(x, l, side, s, &covs);
    if (rc) return rc;
    if (weight_metric && x->s && !(wg = malloc((size_t)(mm * mm) * sizeof *wg)))
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t h0 = 0; h0 < g && !rc; h0 += s) {
        struct slot *sl = new_slot(x, l, side, mm, 1, 1);
        if (!sl) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            break;
        }
        sl->units[0].head0 = h0, sl->units[0].nh = s, sl->units[0].vec = sl->vecs;
        memcpy(sl->units[0].cov, covs + (h0 / s) * mm * mm, (size_t)(mm * mm) * sizeof *covs);
        const double *gram = sl->units[0].cov;
        if (wg) {
            if ((rc = weight_gram(x->m->layers[l].w[side ? KV_W_V : KV_W_K], h0 * dh, mm, c->dim, wg,
                                  x->err)))
                break;
            gram = wg;
        }
        char what[96];
        snprintf(what, sizeof what, "layer %lld %s unit of heads %lld..%lld", (long long)l,
                 side ? "v" : "k", (long long)h0, (long long)(h0 + s - 1));
        rc = eigh(x, gram, mm, sl->lam, sl->vecs, what);
    }
    free(covs), free(wg);
    return rc;
}

/* fdc/zack keys: per KV head, Gram of the stacked post-RoPE [Q; K]. */
static int rotation_key_slots(struct dctx *x, int64_t l) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, dh = c->head_dim, grp = c->n_heads / g, n2 = dh * dh;
    const struct kv_stats_layer *L = &x->s->layers[l];
    double *gram = malloc((size_t)n2 * sizeof *gram);
    if (!gram) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = KV_OK;
    for (int64_t j = 0; j < g && !rc; j++) {
        struct slot *sl = new_slot(x, l, 0, dh, 1, 1);
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
        rc = eigh(x, gram, dh, sl->lam, sl->vecs, what);
    }
    free(gram);
    return rc;
}

/* Eigen Attention keys: with RoPE one pre-RoPE basis from Σ C_q + Σ C_k
 * shared by all heads (paper §4.3); without RoPE (gpt2, the paper's OPT/MPT
 * form) a basis per head from its own C_q + C_k, which queries and keys
 * share, so attention runs in the low-rank space (fused_query). Values: a
 * basis per head, one rank per layer. */
static int eigen_slots(struct dctx *x, int64_t l) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, h = c->n_heads, dh = c->head_dim, n2 = dh * dh;
    int per_head = c->arch != KV_ARCH_LLAMA; /* then h == g */
    double *gram = xcalloc(n2, sizeof *gram), *qc = NULL, *kc = NULL, *vc = NULL;
    struct slot *sk = new_slot(x, l, 0, dh, g, per_head ? g : 1);
    int rc = KV_OK;
    if (!gram || !sk) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    if ((rc = out_covs(x, l, 2, 1, &qc)) || (rc = out_covs(x, l, 0, 1, &kc)) ||
        (rc = out_covs(x, l, 1, 1, &vc)))
        goto done;
    char what[96];
    if (per_head) {
        for (int64_t j = 0; j < g && !rc; j++) {
            sk->units[j].head0 = j, sk->units[j].nh = 1, sk->units[j].vec = sk->vecs + j * n2;
            memcpy(sk->units[j].cov, kc + j * n2, (size_t)n2 * sizeof *kc);
            memcpy(gram, qc + j * n2, (size_t)n2 * sizeof *gram);
            add_to(gram, kc + j * n2, n2);
            snprintf(what, sizeof what, "layer %lld q-k basis of head %lld", (long long)l, (long long)j);
            rc = eigh(x, gram, dh, sk->lam + j * dh, sk->vecs + j * n2, what);
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
        if ((rc = eigh(x, gram, dh, sk->lam, sk->vecs, what))) goto done;
    }
    struct slot *sv = new_slot(x, l, 1, dh, g, g);
    if (!sv) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    for (int64_t j = 0; j < g && !rc; j++) {
        sv->units[j].head0 = j, sv->units[j].nh = 1, sv->units[j].vec = sv->vecs + j * n2;
        memcpy(sv->units[j].cov, vc + j * n2, (size_t)n2 * sizeof *vc);
        snprintf(what, sizeof what, "layer %lld v head %lld", (long long)l, (long long)j);
        rc = eigh(x, sv->units[j].cov, dh, sv->lam + j * dh, sv->vecs + j * n2, what);
    }
done:
    free(gram), free(qc), free(kc), free(vc);
    return rc;
}

/* ZACK values: per KV head, Gram of [V_j; W_O,iᵀ for its query heads]. */
static int zack_value_slots(struct dctx *x, int64_t l) {
    const struct kv_config *c = &x->m->cfg;
    int64_t g = c->n_kv_heads, dh = c->head_dim, d = c->dim, grp = c->n_heads / g;
    int64_t qd = c->n_heads * dh;
    const float *wo = x->m->layers[l].w[KV_W_O]; /* [d, h*d_h] */
    double *gram = malloc((size_t)(dh * dh) * sizeof *gram);
    double *blk = malloc((size_t)(d * dh) * sizeof *blk), *vc = NULL;
    if (!gram || !blk) {
        free(gram), free(blk);
        return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    int rc = out_covs(x, l, 1, 1, &vc);
    for (int64_t j = 0; j < g && !rc; j++) {
        struct slot *sl = new_slot(x, l, 1, dh, 1, 1);
        if (!sl) {
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            break;
        }
        sl->units[0].head0 = j, sl->units[0].nh = 1, sl->units[0].vec = sl->vecs;
        memcpy(sl->units[0].cov, vc + j * dh * dh, (size_t)(dh * dh) * sizeof *vc);
        memcpy(gram, vc + j * dh * dh, (size_t)(dh * dh) * sizeof *gram);
        /* W_O,i W_O,iᵀ = B_iᵀ B_i with B_i = o_proj[:, i*d_h ..] (d × d_h) */
        for (int64_t i = j * grp; i < (j + 1) * grp; i++) {
            for (int64_t r = 0; r < d; r++)
                for (int64_t a = 0; a < dh; a++) blk[r * dh + a] = (double)wo[r * qd + i * dh + a];
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)dh, (int)d, 1.0, blk, (int)dh,
                        1.0, gram, (int)dh);
        }
        for (int64_t a = 0; a < dh; a++)
            for (int64_t b = 0; b < a; b++) gram[a * dh + b] = gram[b * dh + a];
        char what[96];
        snprintf(what, sizeof what, "layer %lld v-o rotation of head %lld", (long long)l, (long long)j);
        rc = eigh(x, gram, dh, sl->lam, sl->vecs, what);
    }
    free(gram), free(blk), free(vc);
    return rc;
}

static int build_slots(struct dctx *x) {
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
        struct slot *sl = &x->slots[i];
        for (int64_t k = 0; k < sl->n_spec * sl->m; k++) sl->energy += sl->lam[k];
        if (!(sl->tail = xcalloc(sl->m + 1, sizeof *sl->tail)))
            return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        for (int64_t r = sl->m - 1; r >= 0; r--) {
            double t = 0;
            for (int64_t k = 0; k < sl->n_spec; k++) t += sl->lam[k * sl->m + r];
            sl->tail[r] = sl->tail[r + 1] + (sl->energy > 0 ? t / sl->energy : 0);
        }
    }
    return KV_OK;
}

/* ------------------------------------------------------------ allocation */

static int64_t round_rank(const struct kv_decompose_opts *o, int64_t r, int64_t mm) {
    int64_t mult = o->rank_multiple > 0 ? o->rank_multiple : 1;
    int64_t floor = o->min_rank > 0 ? o->min_rank : 1;
    if (r < floor) r = floor;
    if (r >= mm || mult >= mm) return mm;
    r = (r + mult - 1) / mult * mult;
    return r > mm ? mm : r;
}

/* Smallest k >= 1 whose dropped tail of singular values σ_k.. is at most
 * rho of their sum (ZACK eq. 6, FDC eq. 1). */
static int64_t removal_rank(const double *lam, int64_t mm, double rho) {
    double tot = 0;
    for (int64_t i = 0; i < mm; i++) tot += sqrt(lam[i]);
    if (tot <= 0) return 1;
    double tail = 0;
    int64_t k = mm;
    for (int64_t i = mm - 1; i >= 1; i--) {
        tail += sqrt(lam[i]);
        if (tail > rho * tot) break;
        k = i;
    }
    return k;
}

static int64_t slot_bytes(const struct slot *sl, int64_t rank, int bits) {
    if (sl->skip) return sl->n_units * sl->m * 2;
    return sl->n_units * kv_lr_unit_bytes(rank, bits);
}

static int64_t total_bytes(const struct dctx *x) {
    int64_t b = 0;
    for (int64_t i = 0; i < x->n_slots; i++)
        b += slot_bytes(&x->slots[i], x->slots[i].rank, x->o->kv_bits);
    return b;
}

/* Ranks of every slot for parameter t in [0, 1] (larger t keeps more). */
static void param_ranks(struct dctx *x, enum kv_alloc a, double t) {
    const struct kv_decompose_opts *o = x->o;
    double maxlog = -INFINITY, minlog = INFINITY, ftot = 0, wtot = 0;
    for (int64_t i = 0; i < x->n_slots; i++) {
        const struct slot *sl = &x->slots[i];
        maxlog = fmax(maxlog, sl->logcond), minlog = fmin(minlog, sl->logcond);
        ftot += sl->fisher;
        wtot += (double)(sl->m * sl->n_units);
    }
    for (int64_t i = 0; i < x->n_slots; i++) {
        struct slot *sl = &x->slots[i];
        int64_t mm = sl->m, r = mm;
        switch (a) {
        case KV_ALLOC_EPS:
        case KV_ALLOC_LAYER_BUDGET:
            r = 0;
            for (int64_t k = 0; k < sl->n_spec; k++) {
                int64_t rk = t >= 1.0 ? mm : kv_la_energy_rank(sl->lam + k * mm, mm, t);
                r = rk > r ? rk : r;
            }
            break;
        case KV_ALLOC_UNIFORM: r = (int64_t)llround(t * (double)mm); break;
        case KV_ALLOC_REMOVAL:
            r = 0;
            for (int64_t k = 0; k < sl->n_spec; k++) {
                int64_t rk = removal_rank(sl->lam + k * mm, mm, 1.0 - t);
                r = rk > r ? rk : r;
            }
            break;
        case KV_ALLOC_FISHER: {
            /* the total width t·Σm shared in proportion to Fisher; clamped
             * units give their excess back to the rest (water filling) */
            r = (int64_t)llround(t * wtot * sl->fisher / (ftot > 0 ? ftot : 1) / (double)sl->n_units);
            break;
        }
        case KV_ALLOC_PROGRESSIVE: {
            double dmax = o->d_max > 0 ? o->d_max : 1.0, dmin = t * dmax;
            double span = maxlog - minlog, frac = dmax;
            if (span > 0) frac = dmax * (1.0 - (maxlog - sl->logcond) / span * (1.0 - dmin / dmax));
            r = (int64_t)llround(frac * (double)mm);
            break;
        }
        default: KV_ASSERT(0);
        }
        sl->rank = round_rank(o, r, mm);
    }
    if (a == KV_ALLOC_FISHER) {
        /* water filling: hand the width lost to clamping at m to unclamped slots */
        for (int it = 0; it < 8; it++) {
            double spare = 0, fopen = 0;
            for (int64_t i = 0; i < x->n_slots; i++) {
                struct slot *sl = &x->slots[i];
                double want = t * wtot * sl->fisher / (ftot > 0 ? ftot : 1) / (double)sl->n_units;
                if (want > (double)sl->m) spare += (want - (double)sl->m) * (double)sl->n_units;
                else fopen += sl->fisher;
            }
            if (spare <= 0.5 || fopen <= 0) break;
            for (int64_t i = 0; i < x->n_slots; i++) {
                struct slot *sl = &x->slots[i];
                double want = t * wtot * sl->fisher / (ftot > 0 ? ftot : 1) / (double)sl->n_units;
                if (want >= (double)sl->m) continue;
                want += spare * sl->fisher / fopen / (double)sl->n_units;
                sl->rank = round_rank(o, (int64_t)llround(want), sl->m);
            }
            break;
        }
    }
}

/* Binary search of t for the smallest byte count that reaches target. */
static double search_param(struct dctx *x, enum kv_alloc a, int64_t target) {
    double lo = 0, hi = 1;
    for (int it = 0; it < 60; it++) {
        double mid = 0.5 * (lo + hi);
        param_ranks(x, a, mid);
        if (total_bytes(x) >= target) hi = mid;
        else lo = mid;
    }
    param_ranks(x, a, hi);
    return hi;
}

static double slot_dropped_rel(const struct slot *sl, int64_t r) { return sl->tail[r]; }

/* kvcal's global strategy: from full rank, repeatedly take the rank step
 * with the least (Fisher-weighted) relative error per byte saved, until the
 * byte target is met (target > 0) or the mean relative error would pass
 * 1 - eps. */
static void global_ranks(struct dctx *x, int64_t target, double eps) {
    const struct kv_decompose_opts *o = x->o;
    int64_t mult = o->rank_multiple > 0 ? o->rank_multiple : 1;
    int64_t floor = o->min_rank > 0 ? o->min_rank : 1;
    double fmean = 0;
    for (int64_t i = 0; i < x->n_slots; i++) {
        x->slots[i].rank = x->slots[i].m;
        fmean += x->slots[i].fisher / (double)x->n_slots;
    }
    double err_sum = 0;
    int64_t bytes = total_bytes(x);
    for (;;) {
        if (target > 0 && bytes <= target) break;
        int64_t best = -1;
        double best_score = INFINITY, best_derr = 0;
        for (int64_t i = 0; i < x->n_slots; i++) {
            struct slot *sl = &x->slots[i];
            int64_t r2 = (sl->rank - 1) / mult * mult;
            if (r2 < floor || r2 < 1) continue;
            double derr = slot_dropped_rel(sl, r2) - slot_dropped_rel(sl, sl->rank);
            if (fmean > 0) derr *= sl->fisher / fmean;
            int64_t db = slot_bytes(sl, sl->rank, o->kv_bits) - slot_bytes(sl, r2, o->kv_bits);
            double score = db > 0 ? derr / (double)db : INFINITY;
            if (score < best_score) best_score = score, best = i, best_derr = derr;
        }
        if (best < 0) break;
        if (target <= 0 && (err_sum + best_derr) / (double)x->n_slots > 1.0 - eps + 1e-15) break;
        struct slot *sl = &x->slots[best];
        int64_t r2 = (sl->rank - 1) / mult * mult;
        bytes -= slot_bytes(sl, sl->rank, o->kv_bits) - slot_bytes(sl, r2, o->kv_bits);
        err_sum += best_derr;
        sl->rank = r2;
    }
}

/* LoRC eq. 12: log of the cumulative condition numbers of W_k, W_v from
 * this layer to the last, from the singular values of the weights. */
static int lorc_conditions(struct dctx *x) {
    const struct kv_config *c = &x->m->cfg;
    int64_t L = c->n_layers, d = c->dim, kd = c->n_kv_heads * c->head_dim;
    double *logk = xcalloc(L, sizeof *logk), *g = xcalloc(kd * kd, sizeof *g);
    double *w = xcalloc(kd, sizeof *w), *v = xcalloc(kd * kd, sizeof *v);
    int rc = KV_OK;
    if (!logk || !g || !w || !v) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    for (int64_t l = 0; l < L && !rc; l++)
        for (int side = 0; side < 2 && !rc; side++) {
            if ((rc = weight_gram(x->m->layers[l].w[side ? KV_W_V : KV_W_K], 0, kd, d, g, x->err)))
                break;
            char what[64];
            snprintf(what, sizeof what, "layer %lld %s weight", (long long)l, side ? "v" : "k");
            if ((rc = eigh(x, g, kd, w, v, what))) break;
            /* κ = σ_max/σ_min = sqrt(λ_max/λ_min); a singular W counts as 1e300 */
            double lmin = w[kd - 1] > 0 ? w[kd - 1] : w[0] * 1e-300;
            logk[l] += w[0] > 0 ? 0.5 * log(w[0] / lmin) : 0;
        }
    for (int64_t l = L - 2; l >= 0 && !rc; l--) logk[l] += logk[l + 1];
    for (int64_t i = 0; i < x->n_slots && !rc; i++) {
        struct slot *sl = &x->slots[i];
        sl->logcond = logk[sl->layer];
        if (x->o->cond_skip > 0 && logk[sl->layer] / log(10.0) > x->o->cond_skip) sl->skip = 1;
    }
done:
    free(logk), free(g), free(w), free(v);
    return rc;
}

/* Per-slot Fisher scores: o->fisher when given, else from the statistics,
 * Palu §3.3: Σ of fisher_k (or fisher_v) over the output rows of the slot's
 * units (its KV heads × d_h). */
static int fisher_scores(struct dctx *x) {
    const struct kv_stats *s = x->s;
    if (!x->o->fisher && !(s && s->has_fisher))
        return kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--alloc fisher needs fisher statistics (blk.N.fisher.k/v), which this "
                       "stats file does not have");
    int64_t dh = x->m->cfg.head_dim;
    for (int64_t i = 0; i < x->n_slots; i++) {
        const struct slot *sl = &x->slots[i];
        double f = 0;
        if (x->o->fisher) {
            f = x->o->fisher[i];
        } else {
            const struct kv_stats_layer *L = &s->layers[sl->layer];
            const double *rows = sl->side ? L->fisher_v : L->fisher_k;
            for (int64_t u = 0; u < sl->n_units; u++) {
                const struct unit *un = &sl->units[u];
                for (int64_t r = un->head0 * dh; r < (un->head0 + un->nh) * dh; r++) f += rows[r];
            }
        }
        if (!isfinite(f) || f < 0)
            return kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "fisher score %lld (layer %lld %s) is %g, expected a finite value >= 0",
                           (long long)i, (long long)sl->layer, sl->side ? "v" : "k", f);
        x->slots[i].fisher = f;
    }
    return KV_OK;
}

/* ------------------------------------------------------------ factors */

static int build_unit(struct dctx *x, const struct slot *sl, const struct unit *un,
                      struct kv_lr_unit *out) {
    const struct kv_config *c = &x->m->cfg;
    int64_t mm = sl->m, r = sl->rank, d = c->dim, dh = c->head_dim;
    const double *V = un->vec;
    out->head0 = un->head0, out->n_heads = un->nh, out->rank = r;
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
    int rc = KV_OK;
    if (sl->rotation) {
        /* rot [r, d_h] = Bᵀ */
        if (!(out->rot = malloc((size_t)(r * dh) * sizeof(float)))) goto oom;
        for (int64_t j = 0; j < r; j++)
            for (int64_t a = 0; a < dh; a++) out->rot[j * dh + a] = (float)B[a * r + j];
    } else {
        /* down [r, d] = Bᵀ W_u; up [mm, r] = B; down_bias = Bᵀ b_u */
        const float *w = x->m->layers[sl->layer].w[sl->side ? KV_W_V : KV_W_K] + un->head0 * dh * d;
        const float *bias = x->m->layers[sl->layer].w[sl->side ? KV_W_BV : KV_W_BK];
        double *wd = malloc((size_t)(mm * d) * sizeof *wd), *dn = malloc((size_t)(r * d) * sizeof *dn);
        out->down = malloc((size_t)(r * d) * sizeof(float));
        out->up = malloc((size_t)(mm * r) * sizeof(float));
        if (!wd || !dn || !out->down || !out->up) {
            free(wd), free(dn);
            goto oom;
        }
        for (int64_t i = 0; i < mm * d; i++) wd[i] = (double)w[i];
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)r, (int)d, (int)mm, 1.0, B,
                    (int)r, wd, (int)d, 0.0, dn, (int)d);
        for (int64_t i = 0; i < r * d; i++) out->down[i] = (float)dn[i];
        for (int64_t i = 0; i < mm * r; i++) out->up[i] = (float)B[i];
        free(wd), free(dn);
        if (bias) {
            if (!(out->down_bias = malloc((size_t)r * sizeof(float)))) goto oom;
            const float *bu = bias + un->head0 * dh;
            for (int64_t j = 0; j < r; j++) {
                double acc = 0;
                for (int64_t a = 0; a < mm; a++) acc += B[a * r + j] * bu[a];
                out->down_bias[j] = (float)acc;
            }
        }
    }
    free(B);
    return rc;
oom:
    free(B);
    return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
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
    const float *wo = m->layers[l].w[KV_W_O];
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
    const float *wq = m->layers[l].w[KV_W_Q], *bq = m->layers[l].w[KV_W_BQ];
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

static int build_lowrank(struct dctx *x, struct kv_lowrank **out) {
    const struct kv_model *m = x->m;
    const struct kv_config *c = &m->cfg;
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    if (!lr) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    snprintf(lr->method, sizeof lr->method, "%s", kv_method_name(x->o->method));
    snprintf(lr->alloc, sizeof lr->alloc, "%s", kv_alloc_name(x->o->alloc));
    lr->n_layers = c->n_layers, lr->dim = c->dim, lr->n_heads = c->n_heads;
    lr->n_kv_heads = c->n_kv_heads, lr->head_dim = c->head_dim;
    lr->kv_bits = x->o->kv_bits;
    int rc = KV_OK;
    if (x->s) snprintf(lr->model_fingerprint, sizeof lr->model_fingerprint, "%s", x->s->fingerprint);
    else rc = kv_model_fingerprint(m, lr->model_fingerprint, x->err); /* memoised in m */
    if (!rc && !(lr->layers = calloc((size_t)c->n_layers, sizeof *lr->layers)))
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < x->n_slots && !rc; i++) {
        const struct slot *sl = &x->slots[i];
        struct kv_lr_side *sd = sl->side ? &lr->layers[sl->layer].v : &lr->layers[sl->layer].k;
        if (sl->skip) continue;
        /* keys without RoPE fold their up projection into the query */
        enum kv_lr_mode kmode = c->arch == KV_ARCH_LLAMA ? KV_LR_PREROPE_LATENT : KV_LR_FUSED_QUERY;
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
    if (rc) {
        kv_lr_free(lr);
        return rc;
    }
    *out = lr;
    return KV_OK;
}

/* ------------------------------------------------------------ layer budget */

/* Eigen Attention §4.4: per layer, eps walks down from 1 in steps of 0.02
 * while the normalised output error of that decoder layer, measured with
 * only this layer compressed and its exact input, stays within e_b. The
 * errors are memoised per (layer, rank tuple), so a search over e_b for a
 * byte target reruns no forward pass it has run before. */
#define LB_STEPS 50 /* eps = 1, 0.98, .., 0.02 */

struct lbctx {
    struct dctx *x;
    struct kv_fwd *f;
    int64_t layer;      /* capture target */
    float *ref;         /* [windows][seq][d] base output of every layer, layer-major */
    double *err;        /* [L][LB_STEPS], NaN = not measured */
    int64_t **tuple;    /* [L][LB_STEPS] rank tuples measured (by slot of the layer) */
    double acc_num, acc_den;
    int64_t win;
    int capture_base;
};

static int lb_hook(void *ctx, int64_t layer, const float *xo, int64_t n, int64_t pos0) {
    struct lbctx *b = ctx;
    const struct kv_config *c = &b->x->m->cfg;
    int64_t d = c->dim, seq = b->x->o->seq_len, W = b->x->o->calib_windows;
    float *ref = b->ref + ((layer * W + b->win) * seq) * d;
    if (b->capture_base) {
        memcpy(ref, xo, (size_t)(n * d) * sizeof(float));
        return 0;
    }
    if (layer != b->layer) return 0;
    double num = 0, den = 0;
    for (int64_t i = 0; i < n * d; i++) {
        double e = (double)xo[i] - ref[i];
        num += e * e, den += (double)ref[i] * ref[i];
    }
    b->acc_num += num, b->acc_den += den;
    return -1; /* stop: later layers do not matter */
}

static void eps_ranks_layer(struct dctx *x, int64_t l, double t) {
    for (int64_t i = 0; i < x->n_slots; i++) {
        struct slot *sl = &x->slots[i];
        if (sl->layer != l) continue;
        int64_t r = 0;
        for (int64_t k = 0; k < sl->n_spec; k++) {
            int64_t rk = t >= 1.0 ? sl->m : kv_la_energy_rank(sl->lam + k * sl->m, sl->m, t);
            r = rk > r ? rk : r;
        }
        sl->rank = round_rank(x->o, r, sl->m);
    }
}

/* Measured error of layer l at grid step k. */
static int lb_error(struct lbctx *b, int64_t l, int k, double *out) {
    struct dctx *x = b->x;
    double *e = &b->err[l * LB_STEPS + k];
    if (!isnan(*e)) {
        *out = *e;
        return KV_OK;
    }
    eps_ranks_layer(x, l, 1.0 - 0.02 * k);
    int64_t ns = 0;
    for (int64_t i = 0; i < x->n_slots; i++) ns += x->slots[i].layer == l;
    int64_t *tup = malloc((size_t)(ns > 0 ? ns : 1) * sizeof *tup), j = 0;
    if (!tup) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < x->n_slots; i++)
        if (x->slots[i].layer == l) tup[j++] = x->slots[i].rank;
    /* the same ranks as an earlier step: the same error */
    for (int kk = 0; kk < LB_STEPS; kk++)
        if (b->tuple[l * LB_STEPS + kk] && !memcmp(b->tuple[l * LB_STEPS + kk], tup, (size_t)ns * sizeof *tup)) {
            *e = *out = b->err[l * LB_STEPS + kk];
            free(tup);
            return KV_OK;
        }
    for (int64_t i = 0; i < x->n_slots; i++) x->slots[i].skip = x->slots[i].layer != l;
    struct kv_lowrank *lr = NULL;
    int rc = build_lowrank(x, &lr);
    for (int64_t i = 0; i < x->n_slots; i++) x->slots[i].skip = 0;
    if (!rc) rc = kv_fwd_set_lowrank(b->f, lr, x->o->kv_bits, x->err);
    b->layer = l, b->acc_num = b->acc_den = 0;
    for (int64_t w = 0; w < x->o->calib_windows && !rc; w++) {
        b->win = w;
        rc = kv_fwd_run(b->f, x->o->calib_tokens + w * x->o->seq_len, x->o->seq_len, 0, NULL, x->err);
        if (rc == -1) rc = KV_OK;
    }
    kv_fwd_set_lowrank(b->f, NULL, 16, x->err);
    kv_lr_free(lr);
    if (rc) {
        free(tup);
        return rc;
    }
    *e = *out = b->acc_den > 0 ? sqrt(b->acc_num / b->acc_den) : 0;
    b->tuple[l * LB_STEPS + k] = tup;
    return KV_OK;
}

/* Per layer, the lowest grid eps before the error passes e_b; sets ranks. */
static int lb_apply(struct lbctx *b, double eb) {
    struct dctx *x = b->x;
    for (int64_t l = 0; l < x->m->cfg.n_layers; l++) {
        int k = 0;
        for (int kk = 1; kk < LB_STEPS; kk++) {
            double e = 0;
            int rc = lb_error(b, l, kk, &e);
            if (rc) return rc;
            if (e > eb) break;
            k = kk;
        }
        eps_ranks_layer(x, l, 1.0 - 0.02 * k);
    }
    return KV_OK;
}

static int layer_budget(struct dctx *x, int64_t target) {
    const struct kv_decompose_opts *o = x->o;
    const struct kv_config *c = &x->m->cfg;
    if (!o->calib_tokens || o->calib_windows <= 0 || o->seq_len < 2)
        return kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--alloc layer-budget measures layer outputs and needs calibration text (--text)");
    int64_t L = c->n_layers, W = o->calib_windows, seq = o->seq_len;
    struct lbctx b = {x, NULL, 0, NULL, NULL, NULL, 0, 0, 0, 0};
    int rc = kv_fwd_init(x->m, seq, &b.f, x->err);
    if (rc) return rc;
    b.ref = malloc((size_t)(L * W * seq * c->dim) * sizeof(float));
    b.err = malloc((size_t)(L * LB_STEPS) * sizeof *b.err);
    b.tuple = calloc((size_t)(L * LB_STEPS), sizeof *b.tuple);
    if (!b.ref || !b.err || !b.tuple) {
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                     "out of memory for %lld layer outputs of %lld windows", (long long)L, (long long)W);
        goto done;
    }
    for (int64_t i = 0; i < L * LB_STEPS; i++) b.err[i] = NAN;
    struct kv_fwd_hooks hk = {0};
    hk.ctx = &b, hk.layer_out = lb_hook;
    kv_fwd_set_hooks(b.f, &hk);
    b.capture_base = 1;
    for (int64_t w = 0; w < W && !rc; w++) {
        b.win = w;
        rc = kv_fwd_run(b.f, o->calib_tokens + w * seq, seq, 0, NULL, x->err);
    }
    b.capture_base = 0;
    if (rc) goto done;
    if (target <= 0) {
        rc = lb_apply(&b, o->error_budget);
        x->o->param = o->error_budget;
    } else {
        /* the largest e_b whose cache still reaches the target bytes */
        double lo = 0, hi = 1;
        for (int it = 0; it < 30 && !rc; it++) {
            double mid = 0.5 * (lo + hi);
            if ((rc = lb_apply(&b, mid))) break;
            if (total_bytes(x) >= target) lo = mid;
            else hi = mid;
        }
        /* the smallest cache it reaches: every layer at its lowest eps */
        if (!rc && !(rc = lb_apply(&b, INFINITY))) x->o->least_bytes = total_bytes(x);
        if (!rc) rc = lb_apply(&b, lo);
        x->o->param = lo;
    }
done:
    kv_fwd_free(b.f);
    free(b.ref), free(b.err);
    if (b.tuple)
        for (int64_t i = 0; i < L * LB_STEPS; i++) free(b.tuple[i]);
    free(b.tuple);
    return rc;
}

int kv_decompose(const struct kv_model *m, const struct kv_stats *s,
                 struct kv_decompose_opts *o, struct kv_lowrank **out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    double t0 = kv_now();
    if ((unsigned)o->method >= KV_METHOD_COUNT || (unsigned)o->alloc >= KV_ALLOC_COUNT)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "unknown method or allocation");
    if (o->alloc == KV_ALLOC_DEFAULT) {
        static const enum kv_alloc def[KV_METHOD_COUNT] = {
            KV_ALLOC_UNIFORM, KV_ALLOC_UNIFORM, KV_ALLOC_EPS,
            KV_ALLOC_PROGRESSIVE, KV_ALLOC_REMOVAL, KV_ALLOC_REMOVAL};
        o->alloc = o->eps > 0 && o->ratio <= 0 ? KV_ALLOC_EPS : def[o->method];
    }
    if (!o->kv_bits) o->kv_bits = 16;
    o->least_bytes = o->achieved_bytes = o->target_bytes = 0;
    if (!s && o->method != KV_METHOD_SVD && o->method != KV_METHOD_LORC)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--method %s needs calibration statistics (--stats)", kv_method_name(o->method));
    if (o->eps != 0 && !(o->eps > 0 && o->eps <= 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--eps %g is outside (0, 1]", o->eps);
    if (o->ratio != 0 && !(o->ratio > 0 && o->ratio <= 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--ratio %g is outside (0, 1]", o->ratio);
    if (o->eps > 0 && o->ratio > 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "give --eps or --ratio, not both");
    enum kv_alloc a = o->alloc;
    int needs_ratio = a == KV_ALLOC_UNIFORM || a == KV_ALLOC_FISHER || a == KV_ALLOC_REMOVAL;
    if (needs_ratio && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--alloc %s needs --ratio", kv_alloc_name(a));
    if (a == KV_ALLOC_EPS && o->eps <= 0 && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--alloc eps needs --eps or --ratio");
    if (a == KV_ALLOC_GLOBAL && o->eps <= 0 && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--alloc global needs --ratio or --eps");
    if (a == KV_ALLOC_PROGRESSIVE && o->ratio <= 0 && o->d_min <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--alloc progressive needs --ratio or --d-min");
    if (a == KV_ALLOC_LAYER_BUDGET && o->error_budget <= 0 && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--alloc layer-budget needs --error-budget or --ratio");
    if (o->eps > 0 && a != KV_ALLOC_EPS && a != KV_ALLOC_GLOBAL)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--eps applies to --alloc eps or global, not %s", kv_alloc_name(a));
    if (o->group_size < 0 || o->group_size > c->n_kv_heads || (o->group_size && c->n_kv_heads % o->group_size))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--group-size %lld does not divide the %lld kv heads", (long long)o->group_size,
                       (long long)c->n_kv_heads);
    if (o->kv_bits != 16 && o->kv_bits != 8 && o->kv_bits != 4 && o->kv_bits != 3 && o->kv_bits != 2)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--kv-bits %d is not one of 16, 8, 4, 3, 2",
                       o->kv_bits);
    if (s && !kv_shapes_match(c, s->n_layers, s->dim, s->n_heads, s->n_kv_heads, s->head_dim,
                              "statistics", NULL, err))
        return KV_EINVAL;

    struct dctx x = {m, s, o, NULL, 0, 0, err};
    int rc = build_slots(&x);
    if (!rc && a == KV_ALLOC_PROGRESSIVE) rc = lorc_conditions(&x);
    if (!rc && (a == KV_ALLOC_FISHER || (a == KV_ALLOC_GLOBAL && (o->fisher || (s && s->has_fisher)))))
        rc = fisher_scores(&x);
    int64_t base = kv_lr_base_bytes(c);
    int64_t target = o->ratio > 0 ? (int64_t)llround(o->ratio * (double)base) : 0;
    if (!rc && target > 0) {
        /* the floor: every slot at its smallest rank */
        for (int64_t i = 0; i < x.n_slots; i++) x.slots[i].rank = round_rank(o, 0, x.slots[i].m);
        int64_t floor = total_bytes(&x), skipped = 0;
        for (int64_t i = 0; i < x.n_slots; i++) skipped += x.slots[i].skip;
        if (floor > target && skipped)
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                         "--ratio %g is below %.4f, the smallest cache with the %lld units that "
                         "--cond-skip %g leaves uncompressed",
                         o->ratio, (double)floor / (double)base, (long long)skipped, o->cond_skip);
        else if (floor > target)
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                         "--ratio %g is below %.4f, the smallest cache that --min-rank %lld and "
                         "--rank-multiple %lld allow",
                         o->ratio, (double)floor / (double)base, (long long)(o->min_rank > 0 ? o->min_rank : 1),
                         (long long)(o->rank_multiple > 0 ? o->rank_multiple : 1));
    }
    if (!rc) {
        switch (a) {
        case KV_ALLOC_GLOBAL: global_ranks(&x, target, o->eps); o->param = 0; break;
        case KV_ALLOC_LAYER_BUDGET: rc = layer_budget(&x, target); break;
        case KV_ALLOC_PROGRESSIVE:
            if (target > 0) o->param = search_param(&x, a, target);
            else param_ranks(&x, a, o->param = o->d_min / (o->d_max > 0 ? o->d_max : 1.0));
            break;
        case KV_ALLOC_EPS:
            if (target > 0) o->param = search_param(&x, a, target);
            else param_ranks(&x, a, o->param = o->eps);
            break;
        case KV_ALLOC_REMOVAL: o->param = 1.0 - search_param(&x, a, target); break;
        default: o->param = search_param(&x, a, target); break;
        }
    }
    o->target_bytes = target;
    o->achieved_bytes = rc ? 0 : total_bytes(&x);
    if (!rc && target > 0 && a != KV_ALLOC_GLOBAL && a != KV_ALLOC_UNIFORM) {
        /* the allocation's own parameter at its most aggressive end still
         * keeps more than the target (e.g. progressive with d_max = 1 keeps
         * the most sensitive layer whole): say so instead of pretending */
        int64_t *save = malloc((size_t)(x.n_slots > 0 ? x.n_slots : 1) * sizeof *save);
        if (save) {
            for (int64_t i = 0; i < x.n_slots; i++) save[i] = x.slots[i].rank;
            if (a != KV_ALLOC_LAYER_BUDGET) {
                param_ranks(&x, a, 0.0);
                o->least_bytes = total_bytes(&x);
            }
            for (int64_t i = 0; i < x.n_slots; i++) x.slots[i].rank = save[i];
            free(save);
        }
    }
    if (!rc) rc = build_lowrank(&x, out);
    slots_free(x.slots, x.n_slots);
    o->lapack_seconds = x.lapack_s;
    o->seconds = kv_now() - t0;
    return rc;
}
