/* A Llama-family model's attention rewritten as DeepSeek-V2's multi-head
 * latent attention (docs/design.md, "Export as Multi-head Latent
 * Attention"): per RoPE pair, the KV heads mixed so that one component
 * carries most of the key energy and keeps its rotation in the shared
 * k^pe; the rest of the keys and all values in one latent per token, the
 * top directions of their calibration covariance; the latent's RMSNorm
 * made linear by scaling its input far below the norm's epsilon. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "ggufmodelw.h"
#include "kvcalib.h"
#include "kvstats.h"
#include "linalg.h"
#include "model.h"

/* The epsilon the engine normalizes the latent with (o->latent_eps, else
 * the model's). */
static float kv_mla_latent_eps(const struct kv_config *c, const struct kv_mla_opts *o) {
    if (o->latent_eps > 0) return (float)o->latent_eps;
    return c->norm_eps > 0 ? c->norm_eps : 1e-6f;
}

int kv_mla_check(const struct kv_config *c, const struct kv_mla_opts *o, struct kv_err *err) {
    if (c->arch != KV_ARCH_LLAMA && c->arch != KV_ARCH_MISTRAL)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "architecture '%s' has no deepseek2 form: only llama and mistral layers "
                       "(RMSNorm, RoPE, SwiGLU, no attention biases) convert",
                       kv_arch_name(c->arch));
    if (c->has_qkv_bias)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "q/k/v biases have no place in llama.cpp's deepseek2");
    if (c->sliding_window > 0)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "a sliding window of %lld positions has no deepseek2 key",
                       (long long)c->sliding_window);
    if (c->rope_scaling.type != KV_ROPE_SCALING_NONE)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "rope scaling '%s' has no deepseek2 form (its frequencies must be "
                       "theta^(-2i/R))",
                       kv_rope_scaling_name(c->rope_scaling.type));
    if (kv_rope_dim(c) != c->head_dim)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET, "partial rotary dimensions");
    int64_t dh = c->head_dim, full = 2 * c->n_kv_heads * dh;
    if (o->rope_dim < 2 || o->rope_dim % 2 || o->rope_dim > dh)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "rope dims %lld must be even, from 2 to the head size %lld",
                       (long long)o->rope_dim, (long long)dh);
    if (o->rope_step < 1 || (o->rope_dim / 2 - 1) * o->rope_step >= dh / 2)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "rope step %lld over %lld pairs passes the head's %lld pairs",
                       (long long)o->rope_step, (long long)(o->rope_dim / 2), (long long)(dh / 2));
    if (o->kv_lora_rank < 1 || o->kv_lora_rank > full)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "kv lora rank %lld must be from 1 to %lld (keys and values of every KV head)",
                       (long long)o->kv_lora_rank, (long long)full);
    if (!(o->latent_eps >= 0 && o->latent_eps < 1) || (o->latent_eps > 0 && (float)o->latent_eps <= 0))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "latent norm epsilon %g must be positive and below 1", o->latent_eps);
    return KV_OK;
}

/* The two coordinates of RoPE pair f in a head of dh under layout. */
static void pair_coords(enum kv_rope_layout layout, int64_t dh, int64_t f, int64_t *a, int64_t *b) {
    if (layout == KV_ROPE_HALF)
        *a = f, *b = f + dh / 2;
    else
        *a = 2 * f, *b = 2 * f + 1;
}

/* Per layer scratch, float64. */
struct work {
    double *wq, *wk, *wv, *kpe, *b, *cov, *t, *eig, *vec, *a, *aat, *aeig;
};

static void work_free(struct work *w) {
    free(w->wq), free(w->wk), free(w->wv), free(w->kpe), free(w->b), free(w->cov);
    free(w->t), free(w->eig), free(w->vec), free(w->a), free(w->aat), free(w->aeig);
}

static void widen(double *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = (double)src[i];
}

/* ---------------------------------------------------------------- mixing */

/* Step 1 for kept slot i of layer l: m_f, the top eigenvector across KV
 * heads of pair f's pre-RoPE key covariance (ckk [G dh]², from the
 * statistics), into gmix [G]; *e0 its energy. cov, eig, vec: scratch of
 * G², G, G². */
static int pair_mixing(const struct kv_config *c, const struct kv_mla_opts *o, int64_t l, int64_t i,
                       const double *ckk, double *cov, double *eig, double *vec, double *gmix,
                       double *e0, struct kv_err *err) {
    int64_t G = c->n_kv_heads, dh = c->head_dim, f = i * o->rope_step, pa, pb;
    pair_coords(c->rope_layout, dh, f, &pa, &pb);
    for (int64_t g = 0; g < G; g++)
        for (int64_t h = 0; h < G; h++)
            cov[g * G + h] = ckk[(g * dh + pa) * G * dh + h * dh + pa] +
                             ckk[(g * dh + pb) * G * dh + h * dh + pb];
    char what[64];
    snprintf(what, sizeof what, "layer %lld rope pair %lld across kv heads", (long long)l, (long long)f);
    int rc = kv_la_eigh(cov, G, eig, vec, what, err);
    if (rc) return rc;
    double e = 0;
    for (int64_t g = 0; g < G; g++) gmix[g] = vec[g * G]; /* column 0 */
    for (int64_t g = 0; g < G; g++)
        for (int64_t h = 0; h < G; h++) e += gmix[g] * gmix[h] * cov[g * G + h];
    *e0 = e > 0 ? e : 0;
    return KV_OK;
}

/* Steps 1-2 for every layer: the mixing m_f of each kept slot into mix
 * [L][R/2][G], and the share of the pre-RoPE key energy the kept
 * components carry into share [L] (the statistics' K output covariance,
 * one layer at a time). Computed once, read by the turn's fit and by the
 * conversion. */
static int all_mixing(const struct kv_model *m, const struct kv_stats *s, const struct kv_mla_opts *o,
                      double *mix, double *share, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, G = c->n_kv_heads, dh = c->head_dim, R2 = o->rope_dim / 2;
    double *ckk = malloc((size_t)(G * dh * G * dh) * sizeof *ckk);
    double *cov = malloc((size_t)(G * G) * sizeof *cov), *eig = malloc((size_t)G * sizeof *eig);
    double *vec = malloc((size_t)(G * G) * sizeof *vec);
    int rc = !ckk || !cov || !eig || !vec ? kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory")
                                          : KV_OK;
    for (int64_t l = 0; l < L && !rc; l++) {
        rc = kv_stats_out_cov(s, m, l, 0, 0, G, ckk, err); /* [G dh]² pre-RoPE keys */
        double total = 0, kept = 0, e0 = 0;
        for (int64_t i = 0; !rc && i < G * dh; i++) total += ckk[i * G * dh + i];
        for (int64_t i = 0; i < R2 && !rc; i++) {
            rc = pair_mixing(c, o, l, i, ckk, cov, eig, vec, mix + (l * R2 + i) * G, &e0, err);
            kept += e0;
        }
        share[l] = total > 0 ? kept / total : 0;
    }
    free(ckk), free(cov), free(eig), free(vec);
    return rc;
}

/* ---------------------------------------------------------------- the turn */

/* Fitting the turn (docs/design.md, step 3'): for layer l, KV head g and
 * RoPE pair f, the map M = [[c, s], [−s, c]] that stands for R(−ωΔ) on the
 * residual key r (what loses RoPE), so that q·R(−ωΔ)r ≈ q·Mr. With A = q·r
 * and B = q_a r_b − q_b r_a, q·R(−ωΔ)r = y = cos(ωΔ) A + sin(ωΔ) B and
 * q·Mr = c A + s B: a least-squares fit of y over every query q of a head
 * of group g and every key r up to it, weighed by the query's attention
 * weights p and centred per query (softmax ignores a shift common to a
 * query's scores). sums[l][g][f] = Σ (Ã², ÃB̃, B̃², ỹÃ, ỹB̃). */
#define FIT_N 5
struct fit {
    const struct kv_config *c;
    const struct kv_mla_opts *o;
    const double *mix;   /* [L][R/2][G] */
    const double *omega; /* [dh/2] the model's frequencies */
    double *sums;        /* [L][G][dh/2][FIT_N] */
    double *dist;        /* [L][2]: Σ p Δ, Σ p */
    double *part;        /* [H][dh/2][FIT_N] one layer's, per query head */
    double *pd;          /* [H][2] */
    double *qp, *kp;     /* [T][H dh], [T][G dh] pre-RoPE queries, residual keys */
    double *cs, *sn;     /* [T][dh/2] cos, sin of ω Δ */
    float *sc;           /* [threads][T][T] one head's scores */
    double *pw;          /* [threads][T] one query's weights */
};

/* x [n][nh][dh] (post-RoPE, position t in row t) turned back by R(−ω t)
 * per pair into out. */
static void unrope(const struct kv_config *c, const double *omega, const float *x, double *out,
                   int64_t n, int64_t nh) {
    int64_t dh = c->head_dim;
    for (int64_t t = 0; t < n; t++)
        for (int64_t f = 0; f < dh / 2; f++) {
            int64_t pa, pb;
            pair_coords(c->rope_layout, dh, f, &pa, &pb);
            double cw = cos(omega[f] * (double)t), sw = sin(omega[f] * (double)t);
            for (int64_t h = 0; h < nh; h++) {
                const float *e = x + (t * nh + h) * dh;
                double *o = out + (t * nh + h) * dh;
                o[pa] = cw * e[pa] + sw * e[pb], o[pb] = -sw * e[pa] + cw * e[pb];
            }
        }
}

static int fit_hook(void *ctx, int64_t l, const float *q, const float *k, int64_t n, int64_t pos0) {
    struct fit *F = ctx;
    const struct kv_config *c = F->c;
    int64_t H = c->n_heads, G = c->n_kv_heads, dh = c->head_dim, gs = H / G, half = dh / 2;
    int64_t R2 = F->o->rope_dim / 2, T = F->o->seq_len;
    KV_ASSERT(pos0 == 0 && n <= T);
    unrope(c, F->omega, q, F->qp, n, H);
    unrope(c, F->omega, k, F->kp, n, G);
    /* the residual: component 0 of each kept pair taken out */
    for (int64_t i = 0; i < R2; i++) {
        const double *m = F->mix + (l * R2 + i) * G;
        int64_t pa, pb;
        pair_coords(c->rope_layout, dh, i * F->o->rope_step, &pa, &pb);
        for (int64_t t = 0; t < n; t++) {
            double *kt = F->kp + t * G * dh, ca = 0, cb = 0;
            for (int64_t g = 0; g < G; g++) ca += m[g] * kt[g * dh + pa], cb += m[g] * kt[g * dh + pb];
            for (int64_t g = 0; g < G; g++) kt[g * dh + pa] -= m[g] * ca, kt[g * dh + pb] -= m[g] * cb;
        }
    }
    memset(F->part, 0, (size_t)(H * half * FIT_N) * sizeof *F->part);
    memset(F->pd, 0, (size_t)(H * 2) * sizeof *F->pd);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t h = 0; h < H; h++) {
        int64_t g = h / gs, th = omp_get_thread_num();
        float *sc = F->sc + th * T * T;
        double *pw = F->pw + th * T, *part = F->part + h * half * FIT_N, *pd = F->pd + h * 2;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)dh,
                    kv_attn_scale(c), q + h * dh, (int)(H * dh), k + g * dh, (int)(G * dh), 0.0f,
                    sc, (int)n);
        for (int64_t t = 0; t < n; t++) {
            const float *row = sc + t * n;
            double mx = row[0], z = 0;
            for (int64_t u = 1; u <= t; u++) mx = row[u] > mx ? row[u] : mx;
            for (int64_t u = 0; u <= t; u++) z += pw[u] = exp((double)row[u] - mx);
            for (int64_t u = 0; u <= t; u++) {
                pw[u] /= z;
                pd[0] += pw[u] * (double)(t - u);
            }
            pd[1] += 1.0;
            const double *qt = F->qp + (t * H + h) * dh;
            for (int64_t f = 0; f < half; f++) {
                int64_t pa, pb;
                pair_coords(c->rope_layout, dh, f, &pa, &pb);
                double qa = qt[pa], qb = qt[pb];
                double mA = 0, mB = 0, mY = 0, sAA = 0, sAB = 0, sBB = 0, sYA = 0, sYB = 0;
                for (int64_t u = 0; u <= t; u++) {
                    const double *r = F->kp + (u * G + g) * dh;
                    double A = qa * r[pa] + qb * r[pb], B = qa * r[pb] - qb * r[pa];
                    double y = F->cs[(t - u) * half + f] * A + F->sn[(t - u) * half + f] * B;
                    double p = pw[u];
                    mA += p * A, mB += p * B, mY += p * y;
                    sAA += p * A * A, sAB += p * A * B, sBB += p * B * B;
                    sYA += p * y * A, sYB += p * y * B;
                }
                double *o = part + f * FIT_N;
                o[0] += sAA - mA * mA, o[1] += sAB - mA * mB, o[2] += sBB - mB * mB;
                o[3] += sYA - mY * mA, o[4] += sYB - mY * mB;
            }
        }
    }
    for (int64_t h = 0; h < H; h++) { /* in head order: the same sums whatever the threads */
        double *dst = F->sums + (l * G + h / gs) * half * FIT_N;
        for (int64_t i = 0; i < half * FIT_N; i++) dst[i] += F->part[h * half * FIT_N + i];
        F->dist[l * 2] += F->pd[h * 2], F->dist[l * 2 + 1] += F->pd[h * 2 + 1];
    }
    return KV_OK;
}

/* The turn on o's windows, given the mixing of every layer (all_mixing). */
static int fit_turn(const struct kv_model *m, const struct kv_mla_opts *o, const double *mix,
                    double *turn, double *mean_distance, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, H = c->n_heads, G = c->n_kv_heads, dh = c->head_dim, half = dh / 2;
    int64_t T = o->seq_len;
    double omega[KV_MAX_ROPE_FACTORS];
    kv_rope_freqs(c, T, omega);
    struct fit F = {.c = c, .o = o, .mix = mix, .omega = omega};
    int rc;
    F.sums = calloc((size_t)(L * G * half * FIT_N), sizeof *F.sums);
    F.dist = calloc((size_t)(L * 2), sizeof *F.dist);
    F.part = malloc((size_t)(H * half * FIT_N) * sizeof *F.part);
    F.pd = malloc((size_t)(H * 2) * sizeof *F.pd);
    F.qp = malloc((size_t)(T * H * dh) * sizeof *F.qp);
    F.kp = malloc((size_t)(T * G * dh) * sizeof *F.kp);
    F.cs = malloc((size_t)(T * half) * sizeof *F.cs);
    F.sn = malloc((size_t)(T * half) * sizeof *F.sn);
    int64_t nth = omp_get_max_threads();
    F.sc = malloc((size_t)(nth * T * T) * sizeof *F.sc);
    F.pw = malloc((size_t)(nth * T) * sizeof *F.pw);
    rc = !F.sums || !F.dist || !F.part || !F.pd || !F.qp || !F.kp || !F.cs || !F.sn || !F.sc || !F.pw
             ? kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory")
             : KV_OK;
    for (int64_t d = 0; !rc && d < T; d++)
        for (int64_t f = 0; f < half; f++) {
            F.cs[d * half + f] = cos(omega[f] * (double)d);
            F.sn[d * half + f] = sin(omega[f] * (double)d);
        }
    struct kv_fwd *f = NULL;
    if (!rc) rc = kv_fwd_init(m, T, &f, err);
    if (!rc) {
        struct kv_fwd_hooks hk = {.ctx = &F, .qk_rope = fit_hook, .hooks_only = 1};
        kv_fwd_one_window(f);
        kv_fwd_set_hooks(f, &hk);
    }
    for (int64_t w = 0; w < o->calib_windows && !rc; w++)
        rc = kv_fwd_run(f, o->calib_tokens + w * T, T, 0, NULL, err);
    kv_fwd_free(f);
    /* each 2x2 system solved; where the residual is nil (one KV head, a
     * kept pair) or the system degenerate, the turn is the identity */
    for (int64_t i = 0; !rc && i < L * G * half; i++) {
        const double *S = F.sums + i * FIT_N;
        double tr = S[0] + S[2], det = S[0] * S[2] - S[1] * S[1], *tc = turn + i * 2;
        if (!(tr > 0) || !(det > 1e-12 * tr * tr)) {
            tc[0] = 1.0, tc[1] = 0.0;
            continue;
        }
        tc[0] = (S[3] * S[2] - S[4] * S[1]) / det;
        tc[1] = (S[4] * S[0] - S[3] * S[1]) / det;
    }
    for (int64_t l = 0; !rc && mean_distance && l < L; l++)
        mean_distance[l] = F.dist[l * 2 + 1] > 0 ? F.dist[l * 2] / F.dist[l * 2 + 1] : 0;
    free(F.sums), free(F.dist), free(F.part), free(F.pd), free(F.qp), free(F.kp), free(F.cs);
    free(F.sn), free(F.sc), free(F.pw);
    return rc;
}

int kv_mla_fit_turn(const struct kv_model *m, const struct kv_stats *s, const struct kv_mla_opts *o,
                    double *turn, double *mean_distance, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    int rc = kv_mla_check(c, o, err);
    if (rc) return rc;
    if (!o->calib_tokens || o->calib_windows < 1 || o->seq_len < 2)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "no calibration windows to fit the turn on");
    int64_t L = c->n_layers, G = c->n_kv_heads;
    double *mix = calloc((size_t)(L * (o->rope_dim / 2) * G), sizeof *mix);
    double *share = malloc((size_t)L * sizeof *share);
    rc = !mix || !share ? kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory")
                        : all_mixing(m, s, o, mix, share, err);
    if (!rc) rc = fit_turn(m, o, mix, turn, mean_distance, err);
    free(mix), free(share);
    return rc;
}

/* ---------------------------------------------------------------- layers */

static int convert_layer(const struct kv_model *m, const struct kv_stats *s, const struct kv_mla_opts *o,
                         int64_t l, const double *mix, const double *turn, struct work *w,
                         struct kv_mla_layer *y, struct kv_mla_layer_info *info, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, H = c->n_heads, G = c->n_kv_heads, dh = c->head_dim, gs = H / G;
    int64_t R = o->rope_dim, dc = o->kv_lora_rank, n = dh, ny = 2 * G * dh;
    widen(w->wq, kv_model_weight(m, KV_W_Q, l), H * dh * d);
    widen(w->wk, kv_model_weight(m, KV_W_K, l), G * dh * d);
    widen(w->wv, kv_model_weight(m, KV_W_V, l), G * dh * d);
    int rc;
    /* 1-2: per kept pair f, its mixing m_f across heads (all_mixing) */
    memcpy(w->b, w->wk, (size_t)(G * dh * d) * sizeof *w->b); /* K_res starts as W_k */
    for (int64_t i = 0; i < R / 2; i++) {
        int64_t f = i * o->rope_step, pa, pb;
        const double *gmix = mix + i * G;
        pair_coords(c->rope_layout, dh, f, &pa, &pb);
        /* k^pe rows 2i, 2i+1: Σ_g m_f[g] W_k rows (g, pa), (g, pb) */
        double *ka = w->kpe + (2 * i) * d, *kb = w->kpe + (2 * i + 1) * d;
        memset(ka, 0, (size_t)(2 * d) * sizeof *ka);
        for (int64_t g = 0; g < G; g++) {
            cblas_daxpy((int)d, gmix[g], w->wk + (g * dh + pa) * d, 1, ka, 1);
            cblas_daxpy((int)d, gmix[g], w->wk + (g * dh + pb) * d, 1, kb, 1);
        }
        /* the residual keys: component 0 taken out */
        for (int64_t g = 0; g < G; g++) {
            cblas_daxpy((int)d, -gmix[g], ka, 1, w->b + (g * dh + pa) * d, 1);
            cblas_daxpy((int)d, -gmix[g], kb, 1, w->b + (g * dh + pb) * d, 1);
        }
        /* q^pe of every head, slot i: m_f[g(h)] times its rows (pa, pb) */
        for (int64_t h = 0; h < H; h++) {
            double mg = gmix[h / gs];
            float *qa = y->wq + (h * (n + R) + n + 2 * i) * d, *qb = qa + d;
            for (int64_t j = 0; j < d; j++) {
                qa[j] = (float)(mg * w->wq[(h * dh + pa) * d + j]);
                qb[j] = (float)(mg * w->wq[(h * dh + pb) * d + j]);
            }
        }
    }
    /* 3': what loses RoPE turned by the fitted map M = [[c, s], [−s, c]] of
     * its pair and KV head (kv_mla_fit_turn), r ← M r */
    for (int64_t g = 0; turn && g < G; g++)
        for (int64_t f = 0; f < dh / 2; f++) {
            double cs = turn[(g * (dh / 2) + f) * 2], sn = turn[(g * (dh / 2) + f) * 2 + 1];
            int64_t pa, pb;
            pair_coords(c->rope_layout, dh, f, &pa, &pb);
            double *ra = w->b + (g * dh + pa) * d, *rb = w->b + (g * dh + pb) * d;
            for (int64_t j = 0; j < d; j++) {
                double x = ra[j], z = rb[j];
                ra[j] = cs * x + sn * z, rb[j] = -sn * x + cs * z;
            }
        }
    /* q^nope: every head's query unrotated */
    for (int64_t h = 0; h < H; h++)
        for (int64_t r = 0; r < dh; r++)
            for (int64_t j = 0; j < d; j++)
                y->wq[(h * (n + R) + r) * d + j] = (float)w->wq[(h * dh + r) * d + j];
    /* the score scale: the model's, where the engine divides by sqrt(n + R) */
    float qs = kv_attn_scale(c) * sqrtf((float)(n + R));
    for (int64_t i = 0; i < H * (n + R) * d; i++) y->wq[i] *= qs;
    /* 4: Y = [K_res; V] = B x, its covariance B C Bᵀ, K and V balanced */
    memcpy(w->b + G * dh * d, w->wv, (size_t)(G * dh * d) * sizeof *w->b);
    const struct kv_stats_layer *L = &s->layers[l];
    cblas_dsymm(CblasRowMajor, CblasRight, CblasUpper, (int)ny, (int)d, 1.0, L->xtx, (int)d, w->b,
                (int)d, 0.0, w->t, (int)d);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)ny, (int)ny, (int)d, 1.0, w->t, (int)d,
                w->b, (int)d, 0.0, w->cov, (int)ny);
    double ek = 0, ev = 0;
    for (int64_t i = 0; i < G * dh; i++) ek += w->cov[i * ny + i], ev += w->cov[(G * dh + i) * ny + G * dh + i];
    double beta = o->balance && ek > 0 && ev > 0 ? sqrt(ev / ek) : 1.0;
    for (int64_t i = 0; i < ny; i++)
        for (int64_t j = 0; j < ny; j++)
            w->cov[i * ny + j] *= (i < G * dh ? beta : 1.0) * (j < G * dh ? beta : 1.0);
    char what[64];
    snprintf(what, sizeof what, "layer %lld joint key-value output covariance", (long long)l);
    if ((rc = kv_la_eigh(w->cov, ny, w->eig, w->vec, what, err))) return rc;
    double tot = 0, kept = 0;
    for (int64_t i = 0; i < ny; i++) {
        double e = w->eig[i] > 0 ? w->eig[i] : 0;
        tot += e;
        if (i < dc) kept += e;
    }
    info->latent_share = tot > 0 ? kept / tot : 1;
    /* A = P_rᵀ D B [dc, d] (B's key rows weighed in place: B is not needed
     * after); U = D⁻¹ P_r */
    cblas_dscal((int)(G * dh * d), beta, w->b, 1);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)dc, (int)d, (int)ny, 1.0, w->vec,
                (int)ny, w->b, (int)d, 0.0, w->a, (int)d);
    for (int64_t h = 0; h < H; h++) {
        int64_t g = h / gs;
        for (int64_t r = 0; r < dc; r++)
            for (int64_t j = 0; j < n; j++) /* wk_b[h][r][j] = U[K row g dh + j][r] */
                y->wk_b[(h * dc + r) * n + j] = (float)(w->vec[(g * dh + j) * ny + r] / beta);
        for (int64_t j = 0; j < dh; j++) /* wv_b[h][j][r] = U[V row g dh + j][r] */
            for (int64_t r = 0; r < dc; r++)
                y->wv_b[(h * dh + j) * dc + r] = (float)w->vec[(G * dh + g * dh + j) * ny + r];
    }
    /* 5: the latent's RMSNorm linear: α² σ_max(A)² max|g|² d / dc = 1e-6 ε */
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)dc, (int)dc, (int)d, 1.0, w->a, (int)d,
                w->a, (int)d, 0.0, w->aat, (int)dc);
    if ((rc = kv_la_eigh(w->aat, dc, w->aeig, NULL, what, err))) return rc;
    const float *gain = kv_model_weight(m, KV_W_ATTN_NORM, l);
    double gmax = 0;
    for (int64_t j = 0; j < d; j++) gmax = fabs(gain[j]) > gmax ? fabs(gain[j]) : gmax;
    double bound = w->aeig[0] * gmax * gmax * (double)d / (double)dc; /* mean(c̃²) over any token */
    double eps = (double)kv_mla_latent_eps(c, o);
    double alpha = bound > 0 ? sqrt(1e-6 * eps / bound) : 1.0;
    info->alpha = alpha, info->latent_rms_bound = sqrt(bound);
    for (int64_t r = 0; r < dc; r++) {
        y->kv_norm[r] = (float)(sqrt(eps) / alpha);
        for (int64_t j = 0; j < d; j++) y->wkv_a[r * d + j] = (float)(alpha * w->a[r * d + j]);
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < d; j++) y->wkv_a[(dc + r) * d + j] = (float)w->kpe[r * d + j];
    return KV_OK;
}

int kv_mla_convert(const struct kv_model *m, const struct kv_stats *s, const struct kv_mla_opts *o,
                   struct kv_mla **out, struct kv_mla_layer_info *info, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    int rc = kv_mla_check(c, o, err);
    if (rc) return rc;
    if (c->n_kv_heads > 64)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET, "more than 64 kv heads");
    int64_t d = c->dim, H = c->n_heads, G = c->n_kv_heads, dh = c->head_dim, L = c->n_layers;
    int64_t R = o->rope_dim, dc = o->kv_lora_rank, n = dh, ny = 2 * G * dh;
    struct kv_mla *mla = calloc(1, sizeof *mla);
    if (!mla || !(mla->layers = calloc((size_t)L, sizeof *mla->layers))) {
        free(mla);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    if ((rc = kv_model_fingerprint(m, mla->base_fingerprint, err))) {
        kv_mla_free(mla);
        return rc;
    }
    mla->n_layers = L, mla->n_heads = H, mla->kv_lora_rank = dc, mla->rope_dim = R;
    mla->nope_dim = n, mla->v_dim = dh, mla->latent_eps = kv_mla_latent_eps(c, o);
    /* slot i is pair i*step: θ'^(-2i/R) = θ^(-2 i step / dh) */
    mla->rope_base = (float)pow((double)c->rope_theta, (double)(o->rope_step * R) / (double)dh);
    /* steps 1-2 for every layer first: the turn (3') reads them too */
    double *mix = calloc((size_t)(L * (R / 2) * G), sizeof *mix), *share = malloc((size_t)L * sizeof *share);
    double *turn = NULL, *mdist = NULL;
    rc = !mix || !share ? kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory")
                        : all_mixing(m, s, o, mix, share, err);
    if (!rc && o->calib_tokens && o->calib_windows > 0) {
        turn = malloc((size_t)(L * G * (dh / 2) * 2) * sizeof *turn);
        mdist = malloc((size_t)L * sizeof *mdist);
        rc = turn && mdist ? fit_turn(m, o, mix, turn, mdist, err)
                           : kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    if (rc) {
        free(mix), free(share), free(turn), free(mdist);
        kv_mla_free(mla);
        return rc;
    }
    struct work w = {0};
    size_t big = (size_t)(ny > H * dh ? ny : H * dh) * (size_t)d;
    w.wq = malloc((size_t)(H * dh * d) * sizeof *w.wq);
    w.wk = malloc((size_t)(G * dh * d) * sizeof *w.wk);
    w.wv = malloc((size_t)(G * dh * d) * sizeof *w.wv);
    w.kpe = malloc((size_t)(R * d) * sizeof *w.kpe);
    w.b = malloc((size_t)(ny * d) * sizeof *w.b);
    w.cov = malloc((size_t)(ny * ny) * sizeof *w.cov);
    w.t = malloc(big * sizeof *w.t);
    w.eig = malloc((size_t)ny * sizeof *w.eig);
    w.vec = malloc((size_t)(ny * ny) * sizeof *w.vec);
    w.a = malloc((size_t)(dc * d) * sizeof *w.a);
    w.aat = malloc((size_t)(dc * dc) * sizeof *w.aat);
    w.aeig = malloc((size_t)dc * sizeof *w.aeig);
    rc = !w.wq || !w.wk || !w.wv || !w.kpe || !w.b || !w.cov || !w.t || !w.eig || !w.vec ||
                 !w.a || !w.aat || !w.aeig
             ? kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory")
             : KV_OK;
    for (int64_t l = 0; l < L && !rc; l++) {
        struct kv_mla_layer *y = &mla->layers[l];
        y->wq = malloc((size_t)(H * (n + R) * d) * sizeof *y->wq);
        y->wkv_a = malloc((size_t)((dc + R) * d) * sizeof *y->wkv_a);
        y->kv_norm = malloc((size_t)dc * sizeof *y->kv_norm);
        y->wk_b = malloc((size_t)(H * dc * n) * sizeof *y->wk_b);
        y->wv_b = malloc((size_t)(H * dh * dc) * sizeof *y->wv_b);
        if (!y->wq || !y->wkv_a || !y->kv_norm || !y->wk_b || !y->wv_b) {
            rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            break;
        }
        struct kv_mla_layer_info li = {0};
        rc = convert_layer(m, s, o, l, mix + l * (R / 2) * G, turn ? turn + l * G * (dh / 2) * 2 : NULL,
                           &w, y, &li, err);
        li.rope_share = share[l], li.mean_distance = turn ? mdist[l] : 0;
        if (info) info[l] = li;
    }
    work_free(&w);
    free(mix), free(share), free(turn), free(mdist);
    if (rc) {
        kv_mla_free(mla);
        return rc;
    }
    *out = mla;
    return KV_OK;
}

int kv_mla_export_gguf(const struct kv_model *m, const struct kv_stats *s,
                       const struct kv_mla_opts *o, const char *path,
                       struct kv_mla_layer_info *info, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    if (kv_mla_latent_eps(c, o) != (c->norm_eps > 0 ? c->norm_eps : 1e-6f))
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "llama.cpp's deepseek2 normalizes the latent with the model's epsilon %g; "
                       "a latent norm epsilon of %g is for an HF directory",
                       (double)c->norm_eps, o->latent_eps);
    struct kv_mla *mla = NULL;
    int rc = kv_mla_convert(m, s, o, &mla, info, err);
    if (!rc) rc = kv_gguf_write_mla(m, mla, path, NULL, err);
    kv_mla_free(mla);
    return rc;
}

int kv_mla_export_hf(const struct kv_model *m, const struct kv_stats *s,
                     const struct kv_mla_opts *o, const char *dir, const char *const *files,
                     int n_files, struct kv_mla_layer_info *info, struct kv_err *err) {
    struct kv_mla *mla = NULL;
    int rc = kv_mla_convert(m, s, o, &mla, info, err);
    if (!rc) rc = kv_hf_write_mla(m, mla, dir, files, n_files, err);
    kv_mla_free(mla);
    return rc;
}
