/* The runtime's host side: the plan (kvrt_plan.h) built from a model and
 * its compressed attention, validation, sequence chunking, and dispatch to
 * the CPU twin or the CUDA backend. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arch.h"
#include "err.h"
#include "kvrt.h"
#include "kvrt_plan.h"
#include "limits.h"
#include "lrmodel.h"
#include "model.h"

struct kvrt {
    struct kvrt_plan p;
    enum kvrt_backend backend;
    struct kvrt_twin *twin;
    struct kvrt_cuda *cuda;
    int64_t *len;   /* [L] cached positions per layer */
    int64_t *qpos;  /* [L] position of the last append (-1: none) */
    float *yrow;    /* [d] scratch of kvrt_fwd_attn */
    struct kv_err last;
};

const char *kvrt_backend_name(enum kvrt_backend b) { return b == KVRT_BACKEND_CUDA ? "cuda" : "twin"; }
const char *kvrt_dtype_name(enum kvrt_dtype t) { return t == KVRT_DTYPE_F16 ? "f16" : "f32"; }
int kvrt_backend_parse(const char *s) {
    return !strcmp(s, "twin") ? KVRT_BACKEND_TWIN : !strcmp(s, "cuda") ? KVRT_BACKEND_CUDA : -1;
}
int kvrt_dtype_parse(const char *s) {
    return !strcmp(s, "f32") ? KVRT_DTYPE_F32 : !strcmp(s, "f16") ? KVRT_DTYPE_F16 : -1;
}

void kvrt_opts_default(struct kvrt_opts *o) {
    memset(o, 0, sizeof *o);
    o->backend = KVRT_BACKEND_TWIN;
    o->cache = KVRT_DTYPE_F32;
    o->max_ctx = 2048;
}

int kvrt_device_count(int *count, struct kv_err *err) { return kvrt_cuda_device_count(count, err); }
int kvrt_device_query(int dev, struct kvrt_device *out, struct kv_err *err) {
    return kvrt_cuda_device_query(dev, out, err);
}

/* ---------------------------------------------------------------- chunking */

int64_t kvrt_max_ctx(void) { return KV_MAX_CTX; }

int64_t kvrt_chunk_len(const struct kvrt *rt, int64_t T, int64_t *n_tasks) {
    int64_t len, full, n = kvrt_plan_chunks(&rt->p, T, &len, &full);
    if (n_tasks) *n_tasks = n * rt->p.n_kv_heads;
    return len;
}

/* ---------------------------------------------------------------- plan */

static void plan_free(struct kvrt_plan *p) {
    if (p->layers)
        for (int64_t l = 0; l < p->n_layers; l++) {
            struct kvrt_lplan *lp = &p->layers[l];
            free(lp->wcat), free(lp->bcat), free(lp->up), free(lp->rot), free(lp->wo);
            free(lp->hk), free(lp->hq), free(lp->order);
        }
    free(p->layers), free(p->rope_cos), free(p->rope_sin);
    memset(p, 0, sizeof *p);
}

static int64_t unit_of(const struct kv_lr_side *s, int64_t j) {
    for (int64_t u = 0; u < s->n_units; u++)
        if (j >= s->units[u].head0 && j < s->units[u].head0 + s->units[u].n_heads) return u;
    return -1;
}

/* rows [n, d] of w (+ bias, zeros when NULL) into wcat/bcat at row r0 */
static void put_rows(struct kvrt_lplan *lp, int64_t d, int64_t r0, const float *w, const float *b,
                     int64_t n) {
    memcpy(lp->wcat + r0 * d, w, (size_t)(n * d) * sizeof(float));
    if (b) memcpy(lp->bcat + r0, b, (size_t)n * sizeof(float));
}

static int plan_fail(struct kvrt_plan *p, struct kv_err *err, int code, int64_t l, const char *what) {
    plan_free(p);
    if (l < 0) return kv_fail(err, code, NULL, KV_NO_OFFSET, "%s", what);
    return kv_fail(err, code, NULL, KV_NO_OFFSET, "layer %lld: %s", (long long)l, what);
}

static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

/* Offsets the tables keep as int32 (device-friendly): everything a layer
 * holds must stay below 2^31 elements. */
#define KVRT_MAX_ELEMS ((int64_t)1 << 31)

static int side_ok(const struct kv_lr_side *s, int64_t g, int64_t dh, int key, int rope,
                   int64_t l, struct kv_err *err) {
    const char *what = key ? "key" : "value";
    if (key && s->mode != KV_LR_FULL && s->mode != KV_LR_PREROPE_LATENT &&
        s->mode != KV_LR_FUSED_QUERY && s->mode != KV_LR_POSTROPE_ROTATION)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET, "layer %lld: key mode %s is not run by the runtime",
                       (long long)l, kv_lr_mode_name(s->mode));
    if (!key && s->mode != KV_LR_FULL && s->mode != KV_LR_FUSED_OUTPUT)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET, "layer %lld: value mode %s is not run by the runtime",
                       (long long)l, kv_lr_mode_name(s->mode));
    if (key && s->mode == KV_LR_FUSED_QUERY && rope)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "layer %lld: fused_query keys need a model without rope", (long long)l);
    if (s->mode == KV_LR_FULL) return KV_OK;
    for (int64_t j = 0; j < g; j++) {
        int64_t u = unit_of(s, j);
        if (u < 0)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: kv head %lld is in no %s unit",
                           (long long)l, (long long)j, what);
        const struct kv_lr_unit *un = &s->units[u];
        if (un->rank < 1 || un->rank > un->n_heads * dh)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: %s unit %lld has rank %lld, not 1..%lld",
                           (long long)l, what, (long long)u, (long long)un->rank,
                           (long long)(un->n_heads * dh));
        int rot = s->mode == KV_LR_POSTROPE_ROTATION;
        if ((rot && (un->n_heads != 1 || !un->rot)) || (!rot && !un->down))
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: %s unit %lld lacks its %s factor",
                           (long long)l, what, (long long)u, rot ? "rotation" : "down");
        if (s->mode == KV_LR_PREROPE_LATENT && !un->up)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: key unit %lld lacks its up factor",
                           (long long)l, (long long)u);
    }
    return KV_OK;
}

static int layer_plan(struct kvrt_plan *p, const struct kv_model *m, const struct kv_lowrank *lr,
                      int64_t l, struct kv_err *err) {
    struct kvrt_lplan *lp = &p->layers[l];
    int64_t d = p->dim, h = p->n_heads, g = p->n_kv_heads, dh = p->head_dim, grp = p->grp;
    static const struct kv_lr_side full = {KV_LR_FULL, 0, NULL};
    const struct kv_lr_layer *Y = lr ? &lr->layers[l] : NULL;
    const struct kv_lr_side *K = Y ? &Y->k : &full, *V = Y ? &Y->v : &full;
    int rc;
    if ((rc = side_ok(K, g, dh, 1, p->rope, l, err)) || (rc = side_ok(V, g, dh, 0, p->rope, l, err)))
        return rc;
    /* centred factors: the means of prerope_latent keys (added to the
     * rebuilt key before rope) and of fused_output values (o_fused_bias) are
     * not implemented; a fused_query key's mean drops out of the softmax,
     * so those run as they are */
    int kmean = 0, vmean = Y && Y->o_fused_bias;
    for (int64_t u = 0; K->mode == KV_LR_PREROPE_LATENT && u < K->n_units; u++) kmean |= K->units[u].up_bias != NULL;
    for (int64_t u = 0; V->mode == KV_LR_FUSED_OUTPUT && u < V->n_units; u++) vmean |= V->units[u].up_bias != NULL;
    if (kmean || vmean)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "layer %lld: centred factors (a mean bias on the %s) are not supported by the "
                       "runtime; decompose without centring",
                       (long long)l, kmean ? "keys" : "values");
    if (K->mode == KV_LR_FUSED_QUERY && !Y->q_fused)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: fused query keys have no fused query projection", (long long)l);
    if (V->mode == KV_LR_FUSED_OUTPUT && !Y->o_fused)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: fused output values have no fused output projection", (long long)l);
    lp->kmode = K->mode, lp->vmode = V->mode;
    int fq = K->mode == KV_LR_FUSED_QUERY, rot = K->mode == KV_LR_POSTROPE_ROTATION;
    int klat = K->mode == KV_LR_PREROPE_LATENT || fq, vlat = V->mode == KV_LR_FUSED_OUTPUT;
    /* quantized latents (kvrt_plan.h, "Low-bit latent caches"): every
     * latent side of a model whose kv_bits is below 16 */
    int bits = lr && lr->info.kv_bits < 16 ? lr->info.kv_bits : 16;
    lp->kbits = K->mode != KV_LR_FULL ? bits : 16, lp->vbits = V->mode != KV_LR_FULL ? bits : 16;
    int kq = lp->kbits < 16, vq = lp->vbits < 16;
    /* latent column of each unit (kuo, vuo) and, quantized, the byte
     * offset of its codes (kbo, vbo: multiples of KVRT_QALIGN) */
    int64_t zkw, zvw;
    int64_t *kuo = calloc((size_t)(2 * (K->n_units + 1)), sizeof *kuo), *kbo = kuo + K->n_units + 1;
    int64_t *vuo = calloc((size_t)(2 * (V->n_units + 1)), sizeof *vuo), *vbo = vuo + V->n_units + 1;
    lp->hk = calloc((size_t)(g * KVRT_HK_N), sizeof *lp->hk);
    lp->hq = calloc((size_t)(h * KVRT_HQ_N), sizeof *lp->hq);
    lp->order = calloc((size_t)g, sizeof *lp->order);
    if (!kuo || !vuo || !lp->hk || !lp->hq || !lp->order) {
        free(kuo), free(vuo);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for the runtime plan");
    }
    for (int64_t u = 0; u < K->n_units; u++) {
        kuo[u + 1] = kuo[u] + K->units[u].rank;
        kbo[u + 1] = kbo[u] + kvrt_unit_pitch(K->units[u].rank, lp->kbits); /* code columns */
    }
    for (int64_t u = 0; u < V->n_units; u++) {
        vuo[u + 1] = vuo[u] + V->units[u].rank;
        vbo[u + 1] = vbo[u] + kvrt_unit_pitch(V->units[u].rank, lp->vbits);
    }
    zkw = kuo[K->n_units], zvw = vuo[V->n_units];
    /* per KV head tables */
    int64_t up_len = 0, rot_len = 0;
    for (int64_t j = 0; j < g; j++) {
        int32_t *hk = lp->hk + j * KVRT_HK_N;
        int64_t ku = unit_of(K, j), vu = unit_of(V, j);
        if (K->mode == KV_LR_FULL) {
            hk[KVRT_HK_KCOL] = hk[KVRT_HK_KPROJ] = (int32_t)(j * dh), hk[KVRT_HK_KSRC] = hk[KVRT_HK_KW] = (int32_t)dh;
            hk[KVRT_HK_KOWN] = 1;
        } else {
            const struct kv_lr_unit *un = &K->units[ku];
            hk[KVRT_HK_KCOL] = (int32_t)(kq ? kbo[ku] : kuo[ku]), hk[KVRT_HK_KSRC] = (int32_t)un->rank;
            hk[KVRT_HK_KU] = (int32_t)(kq ? ku : 0), hk[KVRT_HK_KPROJ] = (int32_t)kuo[ku];
            hk[KVRT_HK_KW] = (int32_t)(K->mode == KV_LR_PREROPE_LATENT ? dh : un->rank);
            hk[KVRT_HK_KOWN] = j == un->head0;
            if (K->mode == KV_LR_PREROPE_LATENT) {
                int64_t base = 0;
                for (int64_t u = 0; u < ku; u++) base += K->units[u].n_heads * dh * K->units[u].rank;
                hk[KVRT_HK_UPOFF] = (int32_t)(base + (j - un->head0) * dh * un->rank);
            }
            if (rot) hk[KVRT_HK_ROTOFF] = (int32_t)(kuo[ku] * dh);
        }
        if (V->mode == KV_LR_FULL) {
            hk[KVRT_HK_VCOL] = hk[KVRT_HK_VPROJ] = (int32_t)(j * dh), hk[KVRT_HK_VW] = (int32_t)dh;
            hk[KVRT_HK_VOWN] = 1;
        } else {
            const struct kv_lr_unit *un = &V->units[vu];
            hk[KVRT_HK_VCOL] = (int32_t)(vq ? vbo[vu] : vuo[vu]), hk[KVRT_HK_VW] = (int32_t)un->rank;
            hk[KVRT_HK_VU] = (int32_t)(vq ? vu : 0), hk[KVRT_HK_VPROJ] = (int32_t)vuo[vu];
            hk[KVRT_HK_VOWN] = j == un->head0;
        }
        lp->kw_max = hk[KVRT_HK_KW] > lp->kw_max ? hk[KVRT_HK_KW] : lp->kw_max;
        lp->ksrc_max = hk[KVRT_HK_KSRC] > lp->ksrc_max ? hk[KVRT_HK_KSRC] : lp->ksrc_max;
        lp->vw_max = hk[KVRT_HK_VW] > lp->vw_max ? hk[KVRT_HK_VW] : lp->vw_max;
    }
    if (K->mode == KV_LR_PREROPE_LATENT)
        for (int64_t u = 0; u < K->n_units; u++) up_len += K->units[u].n_heads * dh * K->units[u].rank;
    if (rot) rot_len = zkw * dh;
    /* per query head: query and output offsets */
    int64_t qo = 0, oo = 0;
    for (int64_t i = 0; i < h; i++) {
        const int32_t *hk = lp->hk + (i / grp) * KVRT_HK_N;
        lp->hq[i * KVRT_HQ_N + KVRT_HQ_QOFF] = (int32_t)qo;
        lp->hq[i * KVRT_HQ_N + KVRT_HQ_OOFF] = (int32_t)oo;
        qo += (fq || rot) ? hk[KVRT_HK_KW] : dh;
        oo += hk[KVRT_HK_VW];
    }
    lp->qw_total = qo, lp->o_total = oo;
    if (fq && qo != Y->q_cols) {
        free(kuo), free(vuo);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: fused query has %lld rows, the units need %lld",
                       (long long)l, (long long)Y->q_cols, (long long)qo);
    }
    if (vlat && oo != Y->o_cols) {
        free(kuo), free(vuo);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: fused output has %lld columns, the units need %lld",
                       (long long)l, (long long)Y->o_cols, (long long)oo);
    }
    /* head order: costliest first (cache elements per position) */
    for (int64_t j = 0; j < g; j++) lp->order[j] = (int32_t)j;
    for (int64_t a = 1; a < g; a++) { /* insertion sort: stable, g is small */
        int32_t x = lp->order[a];
        int64_t cx = lp->hk[x * KVRT_HK_N + KVRT_HK_KSRC] + lp->hk[x * KVRT_HK_N + KVRT_HK_VW];
        int64_t b = a - 1;
        while (b >= 0 && lp->hk[lp->order[b] * KVRT_HK_N + KVRT_HK_KSRC] +
                                 lp->hk[lp->order[b] * KVRT_HK_N + KVRT_HK_VW] < cx) {
            lp->order[b + 1] = lp->order[b];
            b--;
        }
        lp->order[b + 1] = x;
    }
    /* stacked projections */
    lp->qrows = fq ? qo : h * dh;
    lp->krows = klat ? zkw : g * dh;
    lp->vrows = vlat ? zvw : g * dh;
    lp->kld = kq ? align_up(kbo[K->n_units], 16) : (klat || rot ? zkw : g * dh);
    lp->vld = vq ? align_up(vbo[V->n_units], 16) : (vlat ? zvw : g * dh);
    lp->kunits = kq ? K->n_units : 0, lp->vunits = vq ? V->n_units : 0;
    int64_t es = p->f16 ? 2 : 4;
    lp->kbytes = kq ? 0 : lp->kld * es, lp->vbytes = vq ? 0 : lp->vld * es;
    for (int64_t u = 0; kq && u < K->n_units; u++) lp->kbytes += kv_lr_unit_bytes(K->units[u].rank, lp->kbits);
    for (int64_t u = 0; vq && u < V->n_units; u++) lp->vbytes += kv_lr_unit_bytes(V->units[u].rank, lp->vbits);
    int64_t rows = lp->qrows + lp->krows + lp->vrows;
    if (rows * d >= KVRT_MAX_ELEMS || d * oo >= KVRT_MAX_ELEMS || up_len >= KVRT_MAX_ELEMS) {
        free(kuo), free(vuo);
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "layer %lld: %lld projection rows of %lld are beyond the runtime's 2^31-element tables",
                       (long long)l, (long long)rows, (long long)d);
    }
    lp->wcat = malloc((size_t)(rows * d) * sizeof(float));
    lp->bcat = calloc((size_t)rows, sizeof(float));
    lp->wo = malloc((size_t)(d * oo) * sizeof(float));
    lp->up_len = up_len, lp->rot_len = rot_len;
    lp->up = up_len ? malloc((size_t)up_len * sizeof(float)) : NULL;
    lp->rot = rot_len ? malloc((size_t)rot_len * sizeof(float)) : NULL;
    if (!lp->wcat || !lp->bcat || !lp->wo || (up_len && !lp->up) || (rot_len && !lp->rot)) {
        free(kuo), free(vuo);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for the runtime's weights");
    }
    if (fq)
        put_rows(lp, d, 0, Y->q_fused, Y->q_fused_bias, qo);
    else
        put_rows(lp, d, 0, kv_model_weight(m, KV_W_Q, l), kv_model_weight(m, KV_W_BQ, l), h * dh);
    if (klat)
        for (int64_t u = 0; u < K->n_units; u++)
            put_rows(lp, d, lp->qrows + kuo[u], K->units[u].down, K->units[u].down_bias, K->units[u].rank);
    else
        put_rows(lp, d, lp->qrows, kv_model_weight(m, KV_W_K, l), kv_model_weight(m, KV_W_BK, l), g * dh);
    int64_t vr = lp->qrows + lp->krows;
    if (vlat)
        for (int64_t u = 0; u < V->n_units; u++)
            put_rows(lp, d, vr + vuo[u], V->units[u].down, V->units[u].down_bias, V->units[u].rank);
    else
        put_rows(lp, d, vr, kv_model_weight(m, KV_W_V, l), kv_model_weight(m, KV_W_BV, l), g * dh);
    memcpy(lp->wo, vlat ? Y->o_fused : kv_model_weight(m, KV_W_O, l), (size_t)(d * oo) * sizeof(float));
    for (int64_t u = 0, at = 0; lp->up && u < K->n_units; u++) {
        int64_t n = K->units[u].n_heads * dh * K->units[u].rank;
        memcpy(lp->up + at, K->units[u].up, (size_t)n * sizeof(float));
        at += n;
    }
    for (int64_t u = 0; lp->rot && u < K->n_units; u++)
        memcpy(lp->rot + kuo[u] * dh, K->units[u].rot, (size_t)(K->units[u].rank * dh) * sizeof(float));
    free(kuo), free(vuo);
    return KV_OK;
}

static int plan_build(struct kvrt_plan *p, const struct kv_model *m, const struct kv_lowrank *lr,
                      const struct kvrt_opts *o, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    memset(p, 0, sizeof *p);
    if (lr && !kv_shapes_match(c, lr->info.n_layers, lr->info.dim, lr->info.n_heads, lr->info.n_kv_heads, lr->info.head_dim,
                               "compressed attention factors", NULL, err))
        return KV_EINVAL;
    /* mixed bands (decompose --kv-bits auto) are not implemented in the
     * runtime's cache layout: verify runs them on the CPU */
    if (lr && lr->info.kv_bits == KV_LR_BITS_MIXED)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "mixed latent bits (each unit's own bands) are not supported by the "
                       "runtime; run the factors at one width");
    if (lr && !kv_lr_bits_valid(lr->info.kv_bits))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "kv bits %d is not one of " KV_LR_BITS_LIST,
                       lr->info.kv_bits);
    if (o->max_ctx < 1 || o->max_ctx > KV_MAX_CTX)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "context length %lld is outside 1..%d",
                       (long long)o->max_ctx, KV_MAX_CTX);
    if (kv_arch_desc(c->arch)->rope) {
        int rc = kv_rope_check_length(c, o->max_ctx, err);
        if (rc) return rc;
    }
    if (kv_arch_desc(c->arch)->qk_norm)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "the runtime has no per-head q/k norm (%s models)", kv_arch_name(c->arch));
    if (kv_arch_desc(c->arch)->post_norms || c->attn_softcap > 0 || c->attn_scale > 0)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "the runtime has no %s attention (scaled and soft-capped scores, a norm "
                       "of the output)",
                       kv_arch_name(c->arch));
    if (kv_arch_desc(c->arch)->rope && kv_rope_dim(c) != c->head_dim)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "the runtime has no partial rope: this model turns %lld of each head's %lld "
                       "dimensions",
                       (long long)kv_rope_dim(c), (long long)c->head_dim);
    if (c->sliding_window > 0 && c->sliding_window < o->max_ctx)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "the runtime has no sliding-window attention: this model's window of %lld "
                       "is shorter than the context of %lld",
                       (long long)c->sliding_window, (long long)o->max_ctx);
    p->n_layers = c->n_layers, p->dim = c->dim, p->n_heads = c->n_heads;
    p->n_kv_heads = c->n_kv_heads, p->head_dim = c->head_dim, p->grp = c->n_heads / c->n_kv_heads;
    p->max_ctx = o->max_ctx;
    p->rope = kv_arch_desc(c->arch)->rope, p->rope_half = c->rope_layout == KV_ROPE_HALF;
    p->scale = (float)(1.0 / sqrt((double)c->head_dim));
    p->f16 = o->cache == KVRT_DTYPE_F16;
    p->sm_count = o->sm_count > 0 ? o->sm_count : 132;
    for (int64_t T = 1; T <= p->max_ctx; T++) {
        int64_t len, full, n = kvrt_plan_chunks(p, T, &len, &full);
        p->max_chunks = n > p->max_chunks ? n : p->max_chunks;
    }
    int64_t half = c->head_dim / 2;
    if (p->rope) {
        p->rope_cos = malloc((size_t)(p->max_ctx * half) * sizeof(float));
        p->rope_sin = malloc((size_t)(p->max_ctx * half) * sizeof(float));
        if (!p->rope_cos || !p->rope_sin) return plan_fail(p, err, KV_ENOMEM, -1, "out of memory for the rope table");
        kv_rope_table(c, p->max_ctx, p->max_ctx, p->rope_cos, p->rope_sin);
    }
    if (!(p->layers = calloc((size_t)p->n_layers, sizeof *p->layers)))
        return plan_fail(p, err, KV_ENOMEM, -1, "out of memory for the runtime plan");
    for (int64_t l = 0; l < p->n_layers; l++) {
        int rc = layer_plan(p, m, lr, l, err);
        if (rc) {
            plan_free(p);
            return rc;
        }
    }
    return KV_OK;
}

/* ---------------------------------------------------------------- runtime */

int kvrt_open(const struct kv_model *m, const struct kv_lowrank *lr, const struct kvrt_opts *o,
              struct kvrt **out, struct kv_err *err) {
    struct kvrt *rt = calloc(1, sizeof *rt);
    if (!rt) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    kv_err_clear(&rt->last);
    rt->backend = o->backend;
    int rc = KV_OK;
    int sm = o->sm_count;
    if (o->backend == KVRT_BACKEND_CUDA && sm <= 0) { /* chunk for the device's width */
        struct kvrt_device dv;
        if ((rc = kvrt_cuda_device_query(o->device, &dv, err))) {
            free(rt);
            return rc;
        }
        sm = dv.sm_count;
    }
    struct kvrt_opts oo = *o;
    oo.sm_count = sm;
    if ((rc = plan_build(&rt->p, m, lr, &oo, err))) {
        free(rt);
        return rc;
    }
    rt->len = calloc((size_t)rt->p.n_layers, sizeof *rt->len);
    rt->qpos = malloc((size_t)rt->p.n_layers * sizeof *rt->qpos);
    rt->yrow = malloc((size_t)rt->p.dim * sizeof *rt->yrow);
    if (!rt->len || !rt->qpos || !rt->yrow) {
        kvrt_close(rt);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    for (int64_t l = 0; l < rt->p.n_layers; l++) rt->qpos[l] = -1;
    if (o->backend == KVRT_BACKEND_CUDA)
        rc = kvrt_cuda_open(&rt->p, o->device, &rt->cuda, err);
    else
        rc = kvrt_twin_open(&rt->p, &rt->twin, err);
    if (rc) {
        kvrt_close(rt);
        return rc;
    }
    *out = rt;
    return KV_OK;
}

void kvrt_close(struct kvrt *rt) {
    if (!rt) return;
    kvrt_twin_close(rt->twin);
    kvrt_cuda_close(rt->cuda);
    plan_free(&rt->p);
    free(rt->len), free(rt->qpos), free(rt->yrow);
    free(rt);
}

enum kvrt_backend kvrt_backend_of(const struct kvrt *rt) { return rt->backend; }
const struct kvrt_plan *kvrt_plan_of(const struct kvrt *rt) { return &rt->p; }
const struct kv_err *kvrt_error(const struct kvrt *rt) { return &rt->last; }

static int check_layer(const struct kvrt *rt, int64_t layer, struct kv_err *err) {
    if (layer < 0 || layer >= rt->p.n_layers)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld is outside 0..%lld", (long long)layer,
                       (long long)(rt->p.n_layers - 1));
    return KV_OK;
}

int kvrt_append(struct kvrt *rt, int64_t layer, int64_t pos, const float *xn, struct kv_err *err) {
    int rc = check_layer(rt, layer, err);
    if (rc) return rc;
    if (pos < 0 || pos >= rt->p.max_ctx || pos > rt->len[layer])
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "layer %lld: position %lld is outside 0..%lld (cached %lld, context %lld)",
                       (long long)layer, (long long)pos,
                       (long long)(rt->len[layer] < rt->p.max_ctx - 1 ? rt->len[layer] : rt->p.max_ctx - 1),
                       (long long)rt->len[layer], (long long)rt->p.max_ctx);
    if (rt->cuda) {
        if ((rc = kvrt_cuda_append(rt->cuda, layer, pos, xn, err))) return rc;
    } else {
        kvrt_twin_append(rt->twin, layer, pos, xn);
    }
    rt->len[layer] = pos + 1;
    rt->qpos[layer] = pos;
    return KV_OK;
}

int kvrt_attend(struct kvrt *rt, int64_t layer, float *y, struct kv_err *err) {
    int rc = check_layer(rt, layer, err);
    if (rc) return rc;
    if (rt->qpos[layer] < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "layer %lld: no query appended to attend from",
                       (long long)layer);
    int64_t T = rt->qpos[layer] + 1;
    if (rt->cuda) return kvrt_cuda_attend(rt->cuda, layer, T, y, err);
    kvrt_twin_attend(rt->twin, layer, T, y);
    return KV_OK;
}

int kvrt_step(struct kvrt *rt, int64_t layer, int64_t pos, const float *xn, float *y,
              struct kv_err *err) {
    int rc = kvrt_append(rt, layer, pos, xn, err);
    return rc ? rc : kvrt_attend(rt, layer, y, err);
}

int kvrt_fwd_attn(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0, float *res) {
    struct kvrt *rt = ctx;
    int64_t d = rt->p.dim;
    kv_err_clear(&rt->last);
    for (int64_t i = 0; i < n; i++) {
        int rc = kvrt_step(rt, layer, pos0 + i, x + i * d, rt->yrow, &rt->last);
        if (rc) return rc;
        for (int64_t e = 0; e < d; e++) res[i * d + e] += rt->yrow[e];
    }
    return KV_OK;
}

int kvrt_layer_info(const struct kvrt *rt, int64_t layer, struct kvrt_layer_info *out) {
    if (layer < 0 || layer >= rt->p.n_layers) return KV_EINVAL;
    const struct kvrt_lplan *lp = &rt->p.layers[layer];
    out->kmode = (enum kv_lr_mode)lp->kmode, out->vmode = (enum kv_lr_mode)lp->vmode;
    out->cache_bytes_per_token = lp->kbytes + lp->vbytes;
    out->up_bytes = lp->up_len * 4;
    out->weight_bytes = ((lp->qrows + lp->krows + lp->vrows) * (rt->p.dim + 1) +
                         rt->p.dim * lp->o_total + lp->up_len + lp->rot_len) * 4;
    return KV_OK;
}

int kvrt_fill(struct kvrt *rt, int64_t layer, int64_t len, uint64_t seed, struct kv_err *err) {
    int rc = check_layer(rt, layer, err);
    if (rc) return rc;
    if (len < 0 || len > rt->p.max_ctx)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "fill of %lld positions exceeds the context of %lld",
                       (long long)len, (long long)rt->p.max_ctx);
    if (rt->cuda) {
        if ((rc = kvrt_cuda_fill(rt->cuda, layer, len, seed, err))) return rc;
    } else {
        kvrt_twin_fill(rt->twin, layer, len, seed);
    }
    rt->len[layer] = len;
    rt->qpos[layer] = -1;
    return KV_OK;
}

int kvrt_time_step(struct kvrt *rt, int64_t layer, int64_t pos, int64_t iters, double *us_step,
                   double *us_attn, struct kv_err *err) {
    int rc = check_layer(rt, layer, err);
    if (rc) return rc;
    if (iters < 1) return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "iterations must be at least 1");
    if (pos < 0 || pos > rt->len[layer] || pos >= rt->p.max_ctx)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "layer %lld: timing position %lld needs the cache filled to it (it holds %lld of %lld)",
                       (long long)layer, (long long)pos, (long long)rt->len[layer], (long long)rt->p.max_ctx);
    if (rt->cuda) {
        rc = kvrt_cuda_time(rt->cuda, layer, pos, iters, us_step, us_attn, err);
    } else {
        int64_t d = rt->p.dim;
        float *xn = malloc((size_t)d * sizeof *xn);
        if (!xn) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        for (int64_t e = 0; e < d; e++) xn[e] = kvrt_fill_value(12345, (uint64_t)e);
        double ts = 0, ta = 0;
        for (int64_t it = -3; it < iters; it++) {
            double t0 = kv_now();
            kvrt_twin_append(rt->twin, layer, pos, xn);
            double t1 = kv_now();
            kvrt_twin_attn_only(rt->twin, layer, pos + 1);
            double t2 = kv_now();
            kvrt_twin_attend(rt->twin, layer, pos + 1, rt->yrow);
            double t3 = kv_now();
            if (it >= 0) ts += (t1 - t0) + (t3 - t2), ta += t2 - t1;
        }
        free(xn);
        *us_step = 1e6 * ts / (double)iters, *us_attn = 1e6 * ta / (double)iters;
    }
    if (!rc) rt->len[layer] = pos + 1, rt->qpos[layer] = pos;
    return rc;
}

/* Bytes one position of a cache side takes as the twin allocates it: a
 * quantized side's padded code row and its (scale, zero) pairs, else
 * ld floats or halves. */
static int64_t side_alloc(int64_t ld, int bits, int64_t units, int f16) {
    return bits < 16 ? ld + 4 * units : ld * (f16 ? 2 : 4);
}

double kvrt_mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
    if (f) fclose(f);
    if (kib >= 0) return 1024.0 * (double)kib;
    double pages = (double)sysconf(_SC_PHYS_PAGES), size = (double)sysconf(_SC_PAGE_SIZE);
    return pages > 0 && size > 0 ? pages * size : 0;
}

int kvrt_cache_fits(const struct kvrt *rt, int64_t max_ctx, struct kv_err *err) {
    if (kvrt_backend_of(rt) != KVRT_BACKEND_TWIN) return KV_OK;
    double need = 0, have = kvrt_mem_available();
    for (int64_t l = 0; l < rt->p.n_layers; l++) {
        const struct kvrt_lplan *lp = &rt->p.layers[l];
        need += (double)max_ctx * (double)(side_alloc(lp->kld, lp->kbits, lp->kunits, rt->p.f16) +
                                           side_alloc(lp->vld, lp->vbits, lp->vunits, rt->p.f16));
    }
    if (have <= 0 || need <= 0.9 * have) return KV_OK;
    return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                   "the twin's caches need %.1f GiB but %.1f GiB of memory is available",
                   need / (1 << 30), have / (1 << 30));
}
