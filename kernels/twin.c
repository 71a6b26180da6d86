/* The CPU twin of the CUDA kernels (kvrt_cuda.cu): the same plan, the same
 * five stages (kvrt_plan.h), the same tiles of KVRT_TILE positions, the
 * same sequence chunks and the same order of operations inside every dot
 * product and accumulation, written as plain loops. The GPU is tested
 * against it; it is tested against the reference forward (lib/forward.c).
 * The two GEMVs go through OpenBLAS here and cuBLAS there. Quantized
 * latents (kvrt_plan.h, "Low-bit latent caches") are quantized as they
 * enter the cache by lib's reference quantizer (lrmodel.h) and read back
 * wherever the kernels read a cached element. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvrt.h"
#include "kvrt_plan.h"
#include "lrmodel.h"
#include "model.h"

struct kvrt_twin {
    const struct kvrt_plan *p;
    void **kc, **vc;       /* [L] caches [max_ctx][kld] / [max_ctx][vld], f32 or f16;
                              a quantized side's code bytes, unit-major (kvrt_code_at) */
    uint16_t **ksz, **vsz; /* [L] a quantized side's (scale, zero) [units][max_ctx][2], fp16 */
    float **qv;            /* [L] query of the last append [qw_total] */
    float *proj;           /* [rows_max] */
    float *att;            /* [o_total max] */
    float *tmp;            /* [max(2 d_h, ksrc, vw)] for prep */
    float *pm, *pl, *pacc; /* partials [h][max_chunks] and [h][max_chunks][vw_max] */
    float *scratch;        /* [threads][scratch_len] */
    int64_t scratch_len, vw_max;
    int threads;
};

static inline float ld(const void *c, int f16, int64_t i) {
    return f16 ? kv_f16_to_f32(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}
static inline void st(void *c, int f16, int64_t i, float v) {
    if (f16)
        ((uint16_t *)c)[i] = kv_f32_to_f16(v);
    else
        ((float *)c)[i] = v;
}

/* Quantize a unit's latent row z [r] (lrmodel.h's reference) into its
 * codes (ceil(r·bits/8) bytes, cleared first) and its (scale, zero). */
static void qstore(const float *z, int64_t r, int bits, uint8_t *codes, uint16_t *sz) {
    float scale, zero, qmax = kv_lr_qmax(bits);
    kv_lr_qparams(z, r, bits, &scale, &zero);
    memset(codes, 0, (size_t)kvrt_code_bytes(r, bits));
    for (int64_t i = 0; i < r; i++) {
        float q = kv_lr_qcode(z[i], scale, zero, qmax);
        kvrt_code_put(codes, bits, i, q >= 0 && q <= qmax ? (unsigned)q : 0u);
    }
    sz[0] = kv_f32_to_f16(scale), sz[1] = kv_f32_to_f16(zero);
}

/* Elements [0, n) of a unit's quantized latent at one position, read back:
 * code * scale + zero (lrmodel.h, kv_lr_dequant), into out. */
static void qload(const uint8_t *codes, const uint16_t *sz, int bits, int64_t n, float *out) {
    float scale = kv_f16_to_f32(sz[0]), zero = kv_f16_to_f32(sz[1]);
    for (int64_t i = 0; i < n; i++) out[i] = kv_lr_dequant((float)kvrt_code_get(codes, bits, i), scale, zero);
}

void kvrt_twin_close(struct kvrt_twin *t) {
    if (!t) return;
    for (int64_t l = 0; t->kc && l < t->p->n_layers; l++) {
        free(t->kc[l]), free(t->vc[l]), free(t->qv[l]);
        free(t->ksz[l]), free(t->vsz[l]);
    }
    free(t->kc), free(t->vc), free(t->qv), free(t->ksz), free(t->vsz);
    free(t->proj), free(t->att), free(t->tmp), free(t->pm), free(t->pl), free(t->pacc), free(t->scratch);
    free(t);
}

int kvrt_twin_open(const struct kvrt_plan *p, struct kvrt_twin **out, struct kv_err *err) {
    struct kvrt_twin *t = calloc(1, sizeof *t);
    if (!t) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    t->p = p;
    int64_t L = p->n_layers, es = p->f16 ? 2 : 4, rows = 1, ot = 1, kw = 1, ks = 1, vw = 1;
    t->kc = calloc((size_t)L, sizeof *t->kc);
    t->vc = calloc((size_t)L, sizeof *t->vc);
    t->qv = calloc((size_t)L, sizeof *t->qv);
    t->ksz = calloc((size_t)L, sizeof *t->ksz);
    t->vsz = calloc((size_t)L, sizeof *t->vsz);
    int ok = t->kc && t->vc && t->qv && t->ksz && t->vsz;
    for (int64_t l = 0; ok && l < L; l++) {
        const struct kvrt_lplan *lp = &p->layers[l];
        int kq = lp->kbits < 16, vq = lp->vbits < 16;
        t->kc[l] = malloc((size_t)(p->max_ctx * lp->kld * (kq ? 1 : es)));
        t->vc[l] = malloc((size_t)(p->max_ctx * lp->vld * (vq ? 1 : es)));
        t->qv[l] = calloc((size_t)lp->qw_total, sizeof(float));
        if (kq) t->ksz[l] = malloc((size_t)(p->max_ctx * lp->kunits * 2) * sizeof(uint16_t));
        if (vq) t->vsz[l] = malloc((size_t)(p->max_ctx * lp->vunits * 2) * sizeof(uint16_t));
        ok = t->kc[l] && t->vc[l] && t->qv[l] && (!kq || t->ksz[l]) && (!vq || t->vsz[l]);
        int64_t r = lp->qrows + lp->krows + lp->vrows;
        rows = r > rows ? r : rows, ot = lp->o_total > ot ? lp->o_total : ot;
        kw = lp->kw_max > kw ? lp->kw_max : kw, ks = lp->ksrc_max > ks ? lp->ksrc_max : ks;
        vw = lp->vw_max > vw ? lp->vw_max : vw;
    }
    int64_t h = p->n_heads, grp = p->grp;
    t->vw_max = vw;
    t->threads = omp_get_max_threads();
    /* per task: q [grp][kw], m, l, alpha [grp], acc [grp][vw], K [TILE][kw], Z [TILE][ks],
     * s [grp][TILE], V [TILE][vw] (quantized values, read back) */
    t->scratch_len = grp * kw + 3 * grp + grp * vw + KVRT_TILE * kw + KVRT_TILE * ks + grp * KVRT_TILE +
                     KVRT_TILE * vw;
    int64_t tl = 2 * p->head_dim; /* prep: a head's vector and its rotation, or a unit's latent */
    tl = ks > tl ? ks : tl, tl = vw > tl ? vw : tl;
    if (ok) {
        t->proj = malloc((size_t)rows * sizeof(float));
        t->att = malloc((size_t)ot * sizeof(float));
        t->tmp = malloc((size_t)tl * sizeof(float));
        t->pm = malloc((size_t)(h * p->max_chunks) * sizeof(float));
        t->pl = malloc((size_t)(h * p->max_chunks) * sizeof(float));
        t->pacc = malloc((size_t)(h * p->max_chunks * vw) * sizeof(float));
        t->scratch = malloc((size_t)(t->threads * t->scratch_len) * sizeof(float));
        ok = t->proj && t->att && t->tmp && t->pm && t->pl && t->pacc && t->scratch;
    }
    if (!ok) {
        kvrt_twin_close(t);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory for the twin's caches of %lld positions", (long long)p->max_ctx);
    }
    *out = t;
    return KV_OK;
}

/* RoPE of one head vector v [d_h] at position pos (pairs as the plan says). */
static void rope_vec(const struct kvrt_plan *p, float *v, int64_t pos) {
    int64_t half = p->head_dim / 2;
    const float *cs = p->rope_cos + pos * half, *sn = p->rope_sin + pos * half;
    for (int64_t i = 0; i < half; i++) {
        int64_t a = p->rope_half ? i : 2 * i, b = p->rope_half ? i + half : 2 * i + 1;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * cs[i] - x1 * sn[i];
        v[b] = x0 * sn[i] + x1 * cs[i];
    }
}

/* out[a] = Σ_e R[a, e] v[e] for the rotation R [r, d_h] (e in order). */
static void rotate(const float *R, int64_t r, int64_t dh, const float *v, float *out) {
    for (int64_t a = 0; a < r; a++) {
        float s = 0.0f;
        for (int64_t e = 0; e < dh; e++) s += R[a * dh + e] * v[e];
        out[a] = s;
    }
}

/* Stage 2 for KV head j: biases, RoPE, rotations; the query of its query
 * heads into qv and its cache entries into row pos (a quantized side's
 * codes and (scale, zero) pair: ksz, vsz). tmp
 * [max(2 d_h, KSRC, VW)]. */
static void prep(const struct kvrt_plan *p, const struct kvrt_lplan *lp, int64_t j,
                 const float *proj, int64_t pos, float *qv, void *kc, void *vc, uint16_t *ksz,
                 uint16_t *vsz, float *tmp) {
    int64_t dh = p->head_dim, grp = p->grp;
    const int32_t *hk = lp->hk + j * KVRT_HK_N;
    const float *b = lp->bcat;
    int fq = lp->kmode == KV_LR_FUSED_QUERY, rot = lp->kmode == KV_LR_POSTROPE_ROTATION;
    int64_t kw = hk[KVRT_HK_KW];
    const float *R = rot ? lp->rot + hk[KVRT_HK_ROTOFF] : NULL;
    for (int64_t gi = 0; gi < grp; gi++) {
        int64_t i = j * grp + gi, qo = lp->hq[i * KVRT_HQ_N + KVRT_HQ_QOFF];
        if (fq) {
            for (int64_t e = 0; e < kw; e++) qv[qo + e] = proj[qo + e] + b[qo + e];
            continue;
        }
        for (int64_t e = 0; e < dh; e++) tmp[e] = proj[i * dh + e] + b[i * dh + e];
        if (p->rope) rope_vec(p, tmp, pos);
        if (rot)
            rotate(R, kw, dh, tmp, qv + qo);
        else
            memcpy(qv + qo, tmp, (size_t)dh * sizeof(float));
    }
    int64_t kb = lp->qrows + hk[KVRT_HK_KPROJ], vb = lp->qrows + lp->krows + hk[KVRT_HK_VPROJ];
    int64_t kat = pos * lp->kld + hk[KVRT_HK_KCOL], vat = pos * lp->vld + hk[KVRT_HK_VCOL];
    int kq = lp->kbits < 16, vq = lp->vbits < 16;
    uint8_t *kcodes = kq ? (uint8_t *)kc + kvrt_code_at(p->max_ctx, hk[KVRT_HK_KCOL],
                                                        kvrt_unit_pitch(hk[KVRT_HK_KSRC], lp->kbits), pos)
                         : NULL;
    uint8_t *vcodes = vq ? (uint8_t *)vc + kvrt_code_at(p->max_ctx, hk[KVRT_HK_VCOL],
                                                        kvrt_unit_pitch(hk[KVRT_HK_VW], lp->vbits), pos)
                         : NULL;
    uint16_t *kpair = kq ? ksz + kvrt_pair_at(p->max_ctx, hk[KVRT_HK_KU], pos) * 2 : NULL;
    uint16_t *vpair = vq ? vsz + kvrt_pair_at(p->max_ctx, hk[KVRT_HK_VU], pos) * 2 : NULL;
    if (lp->kmode == KV_LR_FULL || rot) {
        int64_t k0 = lp->qrows + j * dh;
        for (int64_t e = 0; e < dh; e++) tmp[e] = proj[k0 + e] + b[k0 + e];
        if (p->rope) rope_vec(p, tmp, pos);
        if (rot) {
            rotate(R, kw, dh, tmp, tmp + dh);
            if (kq)
                qstore(tmp + dh, kw, lp->kbits, kcodes, kpair);
            else
                for (int64_t a = 0; a < kw; a++) st(kc, p->f16, kat + a, tmp[dh + a]);
        } else {
            for (int64_t e = 0; e < dh; e++) st(kc, p->f16, kat + e, tmp[e]);
        }
    } else if (hk[KVRT_HK_KOWN]) {
        int64_t ks = hk[KVRT_HK_KSRC];
        if (kq) {
            for (int64_t e = 0; e < ks; e++) tmp[e] = proj[kb + e] + b[kb + e];
            qstore(tmp, ks, lp->kbits, kcodes, kpair);
        } else {
            for (int64_t e = 0; e < ks; e++) st(kc, p->f16, kat + e, proj[kb + e] + b[kb + e]);
        }
    }
    if (hk[KVRT_HK_VOWN]) {
        int64_t vw = hk[KVRT_HK_VW];
        if (vq) {
            for (int64_t e = 0; e < vw; e++) tmp[e] = proj[vb + e] + b[vb + e];
            qstore(tmp, vw, lp->vbits, vcodes, vpair);
        } else {
            for (int64_t e = 0; e < vw; e++) st(vc, p->f16, vat + e, proj[vb + e] + b[vb + e]);
        }
    }
}

/* Stage 3, task (j, c): the query heads of KV head j over positions
 * [c·len, min((c+1)·len, T)) in tiles, with an online softmax; writes the
 * partial max, sum and accumulator of each head for chunk c. */
static void task(const struct kvrt_plan *p, const struct kvrt_lplan *lp, int64_t j, int64_t c,
                 int64_t len, int64_t T, const float *qv, const void *kc, const void *vc,
                 const uint16_t *ksz, const uint16_t *vsz, float *pm, float *pl, float *pacc,
                 int64_t vw_max, float *scr) {
    int64_t grp = p->grp, dh = p->head_dim;
    const int32_t *hk = lp->hk + j * KVRT_HK_N;
    int64_t kw = hk[KVRT_HK_KW], ks = hk[KVRT_HK_KSRC], vw = hk[KVRT_HK_VW];
    int64_t kcol = hk[KVRT_HK_KCOL], vcol = hk[KVRT_HK_VCOL];
    int pre = lp->kmode == KV_LR_PREROPE_LATENT;
    const float *up = pre ? lp->up + hk[KVRT_HK_UPOFF] : NULL;
    int64_t P = kvrt_score_parts(grp), cw = (kw + P - 1) / P;
    float *q = scr, *m = q + grp * kw, *l = m + grp, *alpha = l + grp, *acc = alpha + grp;
    float *K = acc + grp * vw, *Z = K + KVRT_TILE * kw, *s = Z + KVRT_TILE * ks, *V = s + grp * KVRT_TILE;
    int kq = lp->kbits < 16, vq = lp->vbits < 16;
    /* a quantized unit's rows: from kb8 / vb8, kup / vup bytes apart */
    const uint8_t *kb8 = (const uint8_t *)kc + kcol * p->max_ctx, *vb8 = (const uint8_t *)vc + vcol * p->max_ctx;
    int64_t kup = kq ? kvrt_unit_pitch(ks, lp->kbits) : 0, vup = vq ? kvrt_unit_pitch(vw, lp->vbits) : 0;
    const uint16_t *kp = kq ? ksz + kvrt_pair_at(p->max_ctx, hk[KVRT_HK_KU], 0) * 2 : NULL;
    const uint16_t *vp = vq ? vsz + kvrt_pair_at(p->max_ctx, hk[KVRT_HK_VU], 0) * 2 : NULL;
    for (int64_t gi = 0; gi < grp; gi++) {
        const float *qi = qv + lp->hq[(j * grp + gi) * KVRT_HQ_N + KVRT_HQ_QOFF];
        memcpy(q + gi * kw, qi, (size_t)kw * sizeof(float));
        m[gi] = -INFINITY, l[gi] = 0.0f;
    }
    memset(acc, 0, (size_t)(grp * vw) * sizeof(float));
    int64_t t0 = c * len, t1 = t0 + len < T ? t0 + len : T;
    for (int64_t s0 = t0; s0 < t1; s0 += KVRT_TILE) {
        int64_t ts = t1 - s0 < KVRT_TILE ? t1 - s0 : KVRT_TILE;
        if (pre) { /* rebuild k = z upᵀ per position, then RoPE */
            for (int64_t t = 0; t < ts; t++)
                if (kq)
                    qload(kb8 + (s0 + t) * kup, kp + (s0 + t) * 2, lp->kbits, ks, Z + t * ks);
                else
                    for (int64_t k = 0; k < ks; k++) Z[t * ks + k] = ld(kc, p->f16, (s0 + t) * lp->kld + kcol + k);
            for (int64_t t = 0; t < ts; t++) {
                for (int64_t e = 0; e < dh; e++) {
                    float a = 0.0f;
                    for (int64_t k = 0; k < ks; k++) a += Z[t * ks + k] * up[e * ks + k];
                    K[t * kw + e] = a;
                }
                if (p->rope) rope_vec(p, K + t * kw, s0 + t);
            }
        } else {
            for (int64_t t = 0; t < ts; t++)
                if (kq)
                    qload(kb8 + (s0 + t) * kup, kp + (s0 + t) * 2, lp->kbits, kw, K + t * kw);
                else
                    for (int64_t e = 0; e < kw; e++) K[t * kw + e] = ld(kc, p->f16, (s0 + t) * lp->kld + kcol + e);
        }
        for (int64_t t = 0; vq && t < ts; t++)
            qload(vb8 + (s0 + t) * vup, vp + (s0 + t) * 2, lp->vbits, vw, V + t * vw);
        for (int64_t gi = 0; gi < grp; gi++) /* in the kernel's parts (kvrt_score_parts) */
            for (int64_t t = 0; t < ts; t++) {
                float a = 0.0f;
                for (int64_t r = 0; r < P; r++) {
                    int64_t e0 = r * cw, e1 = e0 + cw < kw ? e0 + cw : kw;
                    float b = 0.0f;
                    for (int64_t e = e0; e < e1; e++) b += q[gi * kw + e] * K[t * kw + e];
                    a = r ? a + b : b;
                }
                s[gi * KVRT_TILE + t] = a * p->scale;
            }
        for (int64_t gi = 0; gi < grp; gi++) {
            float *sg = s + gi * KVRT_TILE, mt = sg[0];
            for (int64_t t = 1; t < ts; t++) mt = sg[t] > mt ? sg[t] : mt;
            float mn = m[gi] > mt ? m[gi] : mt;
            alpha[gi] = expf(m[gi] - mn); /* 0 on the first tile: m = -inf */
            float sum = 0.0f;
            for (int64_t t = 0; t < ts; t++) {
                sg[t] = expf(sg[t] - mn);
                sum += sg[t];
            }
            l[gi] = l[gi] * alpha[gi] + sum;
            m[gi] = mn;
        }
        for (int64_t gi = 0; gi < grp; gi++)
            for (int64_t col = 0; col < vw; col++) {
                float a = acc[gi * vw + col] * alpha[gi];
                for (int64_t t = 0; t < ts; t++)
                    a += s[gi * KVRT_TILE + t] *
                         (vq ? V[t * vw + col] : ld(vc, p->f16, (s0 + t) * lp->vld + vcol + col));
                acc[gi * vw + col] = a;
            }
    }
    for (int64_t gi = 0; gi < grp; gi++) {
        int64_t i = j * grp + gi, at = i * p->max_chunks + c;
        pm[at] = m[gi], pl[at] = l[gi];
        memcpy(pacc + at * vw_max, acc + gi * vw, (size_t)vw * sizeof(float));
    }
}

/* Stage 4 for query head i: merge its n chunks into att. */
static void combine(const struct kvrt_plan *p, const struct kvrt_lplan *lp, int64_t i, int64_t n,
                    const float *pm, const float *pl, const float *pacc, int64_t vw_max, float *att) {
    int64_t vw = lp->hk[(i / p->grp) * KVRT_HK_N + KVRT_HK_VW];
    const float *m = pm + i * p->max_chunks, *l = pl + i * p->max_chunks;
    float M = m[0];
    for (int64_t c = 1; c < n; c++) M = m[c] > M ? m[c] : M;
    float L = 0.0f;
    for (int64_t c = 0; c < n; c++) L += expf(m[c] - M) * l[c];
    float *o = att + lp->hq[i * KVRT_HQ_N + KVRT_HQ_OOFF];
    for (int64_t col = 0; col < vw; col++) {
        float a = 0.0f;
        for (int64_t c = 0; c < n; c++) a += expf(m[c] - M) * pacc[(i * p->max_chunks + c) * vw_max + col];
        o[col] = a / L;
    }
}

void kvrt_twin_append(struct kvrt_twin *t, int64_t layer, int64_t pos, const float *xn) {
    const struct kvrt_plan *p = t->p;
    const struct kvrt_lplan *lp = &p->layers[layer];
    int64_t rows = lp->qrows + lp->krows + lp->vrows;
    /* proj [rows] = wcat [rows, d] · xn */
    cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)rows, (int)p->dim, 1.0f, lp->wcat, (int)p->dim, xn, 1,
                0.0f, t->proj, 1);
    for (int64_t j = 0; j < p->n_kv_heads; j++)
        prep(p, lp, j, t->proj, pos, t->qv[layer], t->kc[layer], t->vc[layer], t->ksz[layer],
             t->vsz[layer], t->tmp);
}

void kvrt_twin_attn_only(struct kvrt_twin *t, int64_t layer, int64_t T) {
    const struct kvrt_plan *p = t->p;
    const struct kvrt_lplan *lp = &p->layers[layer];
    int64_t len, n_full, n = kvrt_plan_chunks(p, T, &len, &n_full), g = p->n_kv_heads;
#pragma omp parallel for schedule(dynamic) num_threads(t->threads)
    for (int64_t k = 0; k < n * g; k++) {
        int64_t j, c;
        kvrt_task(lp->order, lp->hk, g, n_full, len, T - n_full * len, k, &j, &c);
        task(p, lp, j, c, len, T, t->qv[layer], t->kc[layer], t->vc[layer], t->ksz[layer],
             t->vsz[layer], t->pm, t->pl, t->pacc, t->vw_max,
             t->scratch + (int64_t)omp_get_thread_num() * t->scratch_len);
    }
    for (int64_t i = 0; i < p->n_heads; i++) combine(p, lp, i, n, t->pm, t->pl, t->pacc, t->vw_max, t->att);
}

void kvrt_twin_attend(struct kvrt_twin *t, int64_t layer, int64_t T, float *y) {
    const struct kvrt_plan *p = t->p;
    const struct kvrt_lplan *lp = &p->layers[layer];
    kvrt_twin_attn_only(t, layer, T);
    /* y [d] = wo [d, o_total] · att */
    cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)p->dim, (int)lp->o_total, 1.0f, lp->wo,
                (int)lp->o_total, t->att, 1, 0.0f, y, 1);
}

/* One side's rows 0..len-1 (kvrt_plan.h: kvrt_fill_value per entry, or a
 * quantized side's kvrt_fill_byte per code byte and kvrt_fill_sz per pair). */
static void fill_side(void *c, uint16_t *sz, int64_t ld, int bits, int64_t units, int64_t max_ctx, int f16,
                      int64_t len, uint64_t seed) {
    if (bits < 16) { /* the whole arrays: a unit's rows 0..len-1 are not one range of them */
        for (int64_t i = 0; i < max_ctx * ld; i++) ((uint8_t *)c)[i] = kvrt_fill_byte(seed, (uint64_t)i);
        for (int64_t i = 0; i < units * max_ctx; i++) kvrt_fill_sz(seed, (uint64_t)i, &sz[2 * i], &sz[2 * i + 1]);
        return;
    }
    for (int64_t i = 0; i < len * ld; i++) st(c, f16, i, kvrt_fill_value(seed, (uint64_t)i));
}

void kvrt_twin_fill(struct kvrt_twin *t, int64_t layer, int64_t len, uint64_t seed) {
    const struct kvrt_plan *p = t->p;
    const struct kvrt_lplan *lp = &p->layers[layer];
    fill_side(t->kc[layer], t->ksz[layer], lp->kld, lp->kbits, lp->kunits, p->max_ctx, p->f16, len, seed);
    fill_side(t->vc[layer], t->vsz[layer], lp->vld, lp->vbits, lp->vunits, p->max_ctx, p->f16, len,
              seed ^ 0x5bd1e995ull);
    memset(t->qv[layer], 0, (size_t)lp->qw_total * sizeof(float));
}
