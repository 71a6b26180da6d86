/* The metrics of the output- and loss-aware bases (docs/design.md, "Bases
 * that see the output"). A unit's error Δy costs E[Δyᵀ M Δy] per token,
 * with M per KV head j:
 *   keys, output   Σ over j's query heads of E[q qᵀ] (pre-RoPE), averaged
 *                  over the relative rotations R(-tθ) of every causal
 *                  (query, key) pair of a calibration window: the expected
 *                  squared score error E[(q·Δk)²]
 *   values, output Σ over j's query heads i of O_iᵀ O_i (O_i the output
 *                  projection's d_h columns of head i): E‖Δv O_iᵀ‖²
 *   loss           E[g gᵀ] of g = ∂L/∂k or ∂L/∂v (collect --fisher's
 *                  grad_k/grad_v covariances): the Fisher form of the
 *                  second-order Taylor term of the loss
 * and the basis minimising it is the eigenvectors of S C S with S = M^½. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "decompose_ctx.h"
#include "err.h"
#include "kvstats.h"
#include "linalg.h"
#include "model.h"

int kv_dec_o_gram(const struct kv_model *m, int64_t l, int64_t j, double *out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, dh = c->head_dim, grp = c->n_heads / c->n_kv_heads, qd = c->n_heads * dh;
    const float *wo = kv_model_weight(m, KV_W_O, l); /* [d, h*d_h] */
    double *blk = malloc((size_t)(d * dh) * sizeof *blk);
    if (!blk) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    memset(out, 0, (size_t)(dh * dh) * sizeof *out);
    for (int64_t i = j * grp; i < (j + 1) * grp; i++) {
        for (int64_t r = 0; r < d; r++)
            for (int64_t a = 0; a < dh; a++) blk[r * dh + a] = (double)wo[r * qd + i * dh + a];
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)dh, (int)d, 1.0, blk, (int)dh, 1.0,
                    out, (int)dh);
    }
    for (int64_t a = 0; a < dh; a++)
        for (int64_t b = 0; b < a; b++) out[a * dh + b] = out[b * dh + a];
    free(blk);
    return KV_OK;
}

/* The average over t = 0 .. T-1, weighted by the T - t causal pairs at
 * distance t, of (cos φt, sin φt); the turns by recurrence, no trig per t. */
static void mean_turn(double phi, int64_t T, double *cs, double *sn) {
    double c = 0, s = 0, w = 0, ct = 1, st = 0, c1 = cos(phi), s1 = sin(phi);
    for (int64_t t = 0; t < T; t++) {
        double wt = (double)(T - t);
        c += wt * ct, s += wt * st, w += wt;
        double cn = ct * c1 - st * s1;
        st = st * c1 + ct * s1, ct = cn;
    }
    *cs = c / w, *sn = s / w;
}

double *kv_dec_rope_turns(const struct kv_config *c, int64_t T) {
    int64_t half = kv_rope_dim(c) / 2;
    double inv[KV_MAX_ROPE_FACTORS];
    KV_ASSERT(half <= KV_MAX_ROPE_FACTORS);
    kv_rope_freqs(c, T, inv);
    double *tab = malloc((size_t)(half * (half + 1) * 4 + 1) * sizeof *tab);
    if (!tab) return NULL;
    for (int64_t p = 0; p < half; p++) {
        for (int64_t q = 0; q < half; q++) {
            double *e = tab + (p * half + q) * 4;
            mean_turn(inv[p] - inv[q], T, &e[0], &e[1]);
            mean_turn(-(inv[p] + inv[q]), T, &e[2], &e[3]);
        }
        mean_turn(inv[p], T, &tab[half * half * 4 + p * 2], &tab[half * half * 4 + p * 2 + 1]);
    }
    return tab;
}

int kv_dec_rope_average(const struct kv_config *c, int64_t T, const double *turns, const double *C,
                        double *M) {
    int64_t dh = c->head_dim, half = kv_rope_dim(c) / 2;
    int il = c->rope_layout == KV_ROPE_INTERLEAVED;
    double inv[KV_MAX_ROPE_FACTORS];
    KV_ASSERT(half <= KV_MAX_ROPE_FACTORS);
    double sc = kv_rope_freqs(c, T, inv), s2 = sc * sc, s4 = s2 * s2;
    /* the pair of each coordinate, -1 for an unrotated one */
    int64_t *pair_of = malloc((size_t)dh * sizeof *pair_of);
    if (!pair_of) return KV_ENOMEM;
    for (int64_t a = 0; a < dh; a++) pair_of[a] = -1;
    for (int64_t p = 0; p < half; p++) pair_of[il ? 2 * p : p] = pair_of[il ? 2 * p + 1 : p + half] = p;
#define PA(p) (il ? 2 * (p) : (p))
#define PB(p) (il ? 2 * (p) + 1 : (p) + half)
    /* unrotated × unrotated: unchanged (the scale turns only rotated pairs) */
    for (int64_t a = 0; a < dh; a++)
        for (int64_t b = 0; b < dh; b++)
            if (pair_of[a] < 0 && pair_of[b] < 0) M[a * dh + b] = C[a * dh + b];
    for (int64_t p = 0; p < half; p++) {
        int64_t a0 = PA(p), a1 = PB(p);
        /* rotated pair p × unrotated e: R̄(α) C_pe, R(φ) = [[cos, -sin], [sin, cos]] */
        double cp = turns[half * half * 4 + p * 2], sp = turns[half * half * 4 + p * 2 + 1];
        for (int64_t e = 0; e < dh; e++) {
            if (pair_of[e] >= 0) continue;
            double x0 = C[a0 * dh + e], x1 = C[a1 * dh + e];
            M[a0 * dh + e] = M[e * dh + a0] = s2 * (cp * x0 - sp * x1);
            M[a1 * dh + e] = M[e * dh + a1] = s2 * (sp * x0 + cp * x1);
        }
        /* pair p × pair q: R(tα) C_pq R(-tβ) = A R(t(α-β)) + B R(-t(α+β)),
         * C_pq = A + B with A = [[x, -y], [y, x]] commuting with every
         * rotation and B = [[u, v], [v, -u]] with B R(φ) = R(-φ) B */
        for (int64_t q = 0; q < half; q++) {
            int64_t b0 = PA(q), b1 = PB(q);
            const double *e = turns + (p * half + q) * 4;
            double cm = e[0], sm = e[1], cpl = e[2], spl = e[3];
            double P = C[a0 * dh + b0], Q = C[a0 * dh + b1], R = C[a1 * dh + b0], S = C[a1 * dh + b1];
            double x = 0.5 * (P + S), y = 0.5 * (R - Q), u = 0.5 * (P - S), v = 0.5 * (Q + R);
            /* A R̄(α-β) + B R̄(-(α+β)), R̄ the averaged turn */
            double A00 = x * cm - y * sm, A01 = -x * sm - y * cm, A10 = y * cm + x * sm, A11 = -y * sm + x * cm;
            double B00 = u * cpl + v * spl, B01 = -u * spl + v * cpl, B10 = v * cpl - u * spl, B11 = -v * spl - u * cpl;
            M[a0 * dh + b0] = s4 * (A00 + B00), M[a0 * dh + b1] = s4 * (A01 + B01);
            M[a1 * dh + b0] = s4 * (A10 + B10), M[a1 * dh + b1] = s4 * (A11 + B11);
        }
    }
#undef PA
#undef PB
    free(pair_of);
    return KV_OK;
}

int kv_dec_head_metrics(struct kv_dec_ctx *x, int64_t l, int side, double *out) {
    const struct kv_config *c = &x->m->cfg;
    const struct kv_stats *s = x->s;
    int64_t g = c->n_kv_heads, h = c->n_heads, grp = h / g, dh = c->head_dim, n2 = dh * dh;
    double n = s->info.tokens > 0 ? (double)s->info.tokens : 1.0;
    int rc = KV_OK;
    if (x->o->basis == KV_BASIS_LOSS) {
        const double *gc = side ? s->layers[l].grad_v_cov : s->layers[l].grad_k_cov;
        for (int64_t i = 0; i < g * n2; i++) out[i] = gc[i] / n;
        return KV_OK;
    }
    if (side) {
        for (int64_t j = 0; j < g && !rc; j++) rc = kv_dec_o_gram(x->m, l, j, out + j * n2, x->err);
        return rc;
    }
    double *qc = NULL, *sum = malloc((size_t)n2 * sizeof *sum);
    if (!sum) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    if ((rc = kv_dec_out_covs(x, l, 2, 1, &qc))) {
        free(sum);
        return rc;
    }
    int64_t T = s->info.seq_len > 1 ? s->info.seq_len : 1;
    int rope = kv_arch_desc(c->arch)->rope;
    if (rope && !x->turns && !(x->turns = kv_dec_rope_turns(c, T)))
        rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    const double *turns = rope ? x->turns : NULL;
    for (int64_t j = 0; j < g && !rc; j++) {
        memset(sum, 0, (size_t)n2 * sizeof *sum);
        for (int64_t i = j * grp; i < (j + 1) * grp; i++)
            for (int64_t a = 0; a < n2; a++) sum[a] += qc[i * n2 + a] / n;
        if (turns && kv_dec_rope_average(c, T, turns, sum, out + j * n2))
            rc = kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        else if (!turns) memcpy(out + j * n2, sum, (size_t)n2 * sizeof *sum);
    }
    free(qc), free(sum);
    return rc;
}

int kv_dec_metric_sqrt(struct kv_dec_ctx *x, const double *M, int64_t n, double *S, double *Sinv,
                       const char *what) {
    double *w = malloc((size_t)n * sizeof *w), *q = malloc((size_t)(n * n) * sizeof *q);
    double *qs = malloc((size_t)(n * n) * sizeof *qs);
    int rc = w && q && qs ? kv_dec_eigh(x, M, n, w, q, what)
                          : kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    if (!rc && !(w[0] > 0))
        rc = kv_fail(x->err, KV_ENUMERIC, NULL, KV_NO_OFFSET, "%s is zero: no direction has a cost", what);
    if (!rc) {
        /* S = Q diag(√w) Qᵀ and S⁻¹ = Q diag(1/√w) Qᵀ; directions costing
         * under 1e-10 of the largest are floored there, so S⁻¹ stays
         * bounded (their error is all but free anyway) */
        double floor = w[0] * 1e-10;
        for (int inv = 0; inv < 2; inv++) {
            for (int64_t a = 0; a < n; a++)
                for (int64_t k = 0; k < n; k++) {
                    double r = sqrt(w[k] > floor ? w[k] : floor);
                    qs[a * n + k] = q[a * n + k] * (inv ? 1.0 / r : r);
                }
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)n, 1.0, qs, (int)n, q,
                        (int)n, 0.0, inv ? Sinv : S, (int)n);
        }
    }
    free(w), free(q), free(qs);
    return rc;
}
