/* --alloc layer-budget (Eigen Attention §4.4): ranks from measured layer
 * output errors on calibration windows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decompose_ctx.h"
#include "err.h"
#include "linalg.h"
#include "lrmodel.h"
#include "model.h"

/* Eigen Attention §4.4: per layer, eps walks down from 1 in steps of 0.02
 * while the normalised output error of that decoder layer, measured with
 * only this layer compressed and its exact input, stays within e_b. The
 * errors are memoised per (layer, rank tuple), so a search over e_b for a
 * byte target reruns no forward pass it has run before. */
#define LB_STEPS 50 /* eps = 1, 0.98, .., 0.02 */

struct lbctx {
    struct kv_dec_ctx *x;
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

static void eps_ranks_layer(struct kv_dec_ctx *x, int64_t l, double t) {
    for (int64_t i = 0; i < x->n_slots; i++) {
        struct kv_dec_slot *sl = &x->slots[i];
        if (sl->layer != l) continue;
        sl->rank = kv_dec_round_rank(x->o, kv_dec_eps_rank(sl, t), sl->m);
    }
}

/* Measured error of layer l at grid step k. */
static int lb_error(struct lbctx *b, int64_t l, int k, double *out) {
    struct kv_dec_ctx *x = b->x;
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
    int rc = kv_dec_build_lowrank(x, &lr);
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
    struct kv_dec_ctx *x = b->x;
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

int kv_dec_layer_budget(struct kv_dec_ctx *x, int64_t target) {
    const struct kv_decompose_opts *o = x->o;
    const struct kv_config *c = &x->m->cfg;
    if (!o->calib_tokens || o->calib_windows <= 0 || o->seq_len < 2)
        return kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s layer-budget measures layer outputs and needs calibration text (%s)",
                       x->names[KV_DECOMPOSE_OPT_ALLOC], x->names[KV_DECOMPOSE_OPT_TEXT]);
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
            if (kv_dec_total_bytes(x) >= target) lo = mid;
            else hi = mid;
        }
        /* the smallest cache it reaches: every layer at its lowest eps */
        if (!rc && !(rc = lb_apply(&b, INFINITY))) x->o->least_bytes = kv_dec_total_bytes(x);
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
