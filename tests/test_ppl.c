/* Perplexity: the windows protocol against a naive oracle, the reference
 * values of independent float64 runs on the shared models, and the device
 * comparison (kv_ppl_compare_attn) with a naive attention hook as device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lrmodel.h"
#include "model.h"
#include "naive_gpt2.h"
#include "naive_llama.h"
#include "testutil.h"

Test(ppl, equals_naive_nll_over_windows) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 11, &m, &err);
    sharpen(m);
    int64_t n = 70, T = 16; /* 4 windows, remainder 6 dropped */
    int32_t tok[70];
    for (int i = 0; i < n; i++) tok[i] = (i * 29 + 1) % 97;
    struct kv_ppl_result r;
    cr_assert_eq(kv_ppl_run(m, tok, n, T, 0, NULL, NULL, &r, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(r.windows, 4);
    cr_assert_eq(r.scored, 4 * 15);
    double nll = 0;
    for (int64_t w = 0; w < 4; w++) {
        double *lg = naive_forward(m, tok + w * T, T);
        for (int64_t i = 0; i + 1 < T; i++) {
            const double *row = lg + i * 97;
            double mx = row[0], z = 0;
            for (int j = 1; j < 97; j++) mx = fmax(mx, row[j]);
            for (int j = 0; j < 97; j++) z += exp(row[j] - mx);
            nll += log(z) + mx - row[tok[w * T + i + 1]];
        }
        free(lg);
    }
    nll /= 60;
    kvt_assert_close_f64(&r.nll, &nll, 1, 1e-6, 1e-5, "mean nll");
    cr_assert_float_eq(r.ppl, exp(r.nll), 1e-12);
    cr_assert_eq(kv_ppl_run(m, tok, n, T, 2, NULL, NULL, &r, &err), KV_OK);
    cr_assert_eq(r.windows, 2);
    cr_assert_eq(kv_ppl_run(m, tok, 10, T, 0, NULL, NULL, &r, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "text has 10 tokens, fewer than one window of 16");
    kv_model_close(m);
}

/* Reference values from a separate float64 implementation (issue 2); for
 * tinystories-656K, whose tokenizer.json now follows the tokenizers crate's
 * unknown rule, from tests/ref/ppl_naive.c (the naive float64 forward of
 * tests/naive_llama.h) on the same ids. */
static void check_reference(const char *model, const char *tok, const char *text, double want,
                            int64_t want_tokens, int64_t want_windows, int64_t want_scored) {
    KVT_NEED_SHARED(mp, model);
    char mpath[4096], tpath[4096], kpath[4096];
    snprintf(mpath, sizeof mpath, "%s", mp);
    KVT_NEED_SHARED(tp, text);
    snprintf(tpath, sizeof tpath, "%s", tp);
    if (tok) {
        KVT_NEED_SHARED(kp, tok);
        snprintf(kpath, sizeof kpath, "%s", kp);
    }
    kv_set_threads(1);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(mpath, tok ? kpath : NULL, &m, &err), KV_OK, "%s", err.msg);
    char *txt;
    size_t len;
    cr_assert_eq(kv_text_read(tpath, &txt, &len, &err), KV_OK);
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(kv_model_tokenizer(m), txt, len, kv_tok_policy(kv_model_tokenizer(m)),
                               &ids, &n, &err),
                 KV_OK);
    struct kv_ppl_result r;
    cr_assert_eq(kv_ppl_run(m, ids, n, 256, 0, NULL, NULL, &r, &err), KV_OK, "%s", err.msg);
    if (want_tokens) cr_assert_eq(r.tokens, want_tokens);
    if (want_windows) cr_assert_eq(r.windows, want_windows);
    if (want_scored) cr_assert_eq(r.scored, want_scored);
    cr_assert_eq(r.windows, n / 256);
    kvt_assert_close_f64(&r.ppl, &want, 1, 0, 5e-4, "perplexity (0.05% of the reference)");
    free(ids), free(txt);
    kv_model_close(m);
}

Test(ppl_reference, stories260K_val1k, .timeout = 600) {
    check_reference("models/stories260K/stories260K.bin", "models/stories260K/tok512.bin",
                    "text/tinystories/val1k.txt", 7.6905, 404019, 1578, 0);
}
Test(ppl_reference, stories260K_wikitext2, .timeout = 600) {
    check_reference("models/stories260K/stories260K.gguf", NULL,
                    "text/wikitext-2-raw/wiki.test.raw", 112.736, 0, 3161, 806055);
}
Test(ppl_reference, tinystories656K_val1k, .timeout = 600) {
    check_reference("models/tinystories-656K", NULL, "text/tinystories/val1k.txt", 48.398509, 200347,
                    782, 199410);
}
Test(ppl_reference, tinystories656K_wikitext2, .timeout = 600) {
    check_reference("models/tinystories-656K", NULL, "text/wikitext-2-raw/wiki.test.raw", 788.192107,
                    554432, 2165, 552075);
}

/* ------------------------------------------------------------- device attention hooks */


/* The tests' stand-in for a device runtime: each layer's attention computed
 * naively in float64 from the model's weights, with its own K/V cache. It
 * can scale its output at one (layer, position) by 1 + perturb, and fail
 * on its fail_call-th call with fail_code. */
struct naive_dev {
    const struct kv_model *m;
    int64_t max_ctx;
    double *kc, *vc; /* [L][max_ctx][g*d_h] */
    int64_t perturb_layer, perturb_pos;
    double perturb;
    int64_t calls, fail_call;
    int fail_code;
};

static struct naive_dev naive_dev_new(const struct kv_model *m, int64_t max_ctx) {
    const struct kv_config *c = kv_model_config(m);
    size_t len = (size_t)(c->n_layers * max_ctx * c->n_kv_heads * c->head_dim);
    struct naive_dev D = {.m = m, .max_ctx = max_ctx, .perturb_layer = -1};
    D.kc = calloc(len, sizeof(double));
    D.vc = calloc(len, sizeof(double));
    cr_assert(D.kc && D.vc);
    return D;
}

/* out[r] = Σ_j W[r][j] x[j] + b[r] (b may be NULL). */
static void naive_proj(double *out, const float *W, const float *b, const float *x, int64_t rows,
                       int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        double s = b ? b[r] : 0;
        for (int64_t j = 0; j < cols; j++) s += (double)W[r * cols + j] * x[j];
        out[r] = s;
    }
}

/* Rotate each of nh heads of e at position p: pair i by p · θ^(-2i/d_h). */
static void naive_rope(double *e, int64_t nh, int64_t p, const struct kv_config *c) {
    int64_t dh = c->head_dim;
    for (int64_t hh = 0; hh < nh; hh++)
        for (int64_t i = 0; i < dh / 2; i++) {
            int64_t ia = c->rope_layout == KV_ROPE_HALF ? i : 2 * i;
            int64_t ib = c->rope_layout == KV_ROPE_HALF ? i + dh / 2 : 2 * i + 1;
            double ang = (double)p * pow((double)c->rope_theta, -2.0 * (double)i / (double)dh);
            double *h = e + hh * dh, re = h[ia], im = h[ib];
            h[ia] = re * cos(ang) - im * sin(ang);
            h[ib] = re * sin(ang) + im * cos(ang);
        }
}

static int naive_attn(void *ctx, int64_t l, const float *x, int64_t n, int64_t pos0, float *res) {
    struct naive_dev *D = ctx;
    if (D->fail_call && ++D->calls == D->fail_call) return D->fail_code;
    const struct kv_model *m = D->m;
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, h = c->n_heads, g = c->n_kv_heads, dh = c->head_dim;
    int64_t qd = h * dh, kd = g * dh;
    double *kc = D->kc + l * D->max_ctx * kd, *vc = D->vc + l * D->max_ctx * kd;
    double *q = malloc((size_t)qd * sizeof *q), *o = malloc((size_t)qd * sizeof *o);
    double *sc = malloc((size_t)D->max_ctx * sizeof *sc);
    const float *wo = kv_model_weight(m, KV_W_O, l);
    for (int64_t t = 0; t < n; t++) {
        int64_t p = pos0 + t;
        const float *xr = x + t * d;
        naive_proj(q, kv_model_weight(m, KV_W_Q, l), kv_model_weight(m, KV_W_BQ, l), xr, qd, d);
        naive_proj(kc + p * kd, kv_model_weight(m, KV_W_K, l), kv_model_weight(m, KV_W_BK, l), xr,
                   kd, d);
        naive_proj(vc + p * kd, kv_model_weight(m, KV_W_V, l), kv_model_weight(m, KV_W_BV, l), xr,
                   kd, d);
        if (c->arch == KV_ARCH_LLAMA) {
            naive_rope(q, h, p, c);
            naive_rope(kc + p * kd, g, p, c);
        }
        for (int64_t hh = 0; hh < h; hh++) {
            int64_t kvh = hh / (h / g);
            double mx = -INFINITY, z = 0;
            for (int64_t s = 0; s <= p; s++) {
                double dot = 0;
                for (int64_t i = 0; i < dh; i++) dot += q[hh * dh + i] * kc[s * kd + kvh * dh + i];
                sc[s] = dot / sqrt((double)dh);
                mx = fmax(mx, sc[s]);
            }
            for (int64_t s = 0; s <= p; s++) z += sc[s] = exp(sc[s] - mx);
            for (int64_t i = 0; i < dh; i++) {
                double acc = 0;
                for (int64_t s = 0; s <= p; s++) acc += sc[s] / z * vc[s * kd + kvh * dh + i];
                o[hh * dh + i] = acc;
            }
        }
        double scale = l == D->perturb_layer && p == D->perturb_pos ? 1 + D->perturb : 1;
        for (int64_t r = 0; r < d; r++) {
            double y = 0;
            for (int64_t j = 0; j < qd; j++) y += (double)wo[r * qd + j] * o[j];
            res[t * d + r] += (float)(scale * y);
        }
    }
    free(q), free(o), free(sc);
    return KV_OK;
}

/* A device that leaves the attention out. */
static int no_attn(void *ctx, int64_t l, const float *x, int64_t n, int64_t pos0, float *res) {
    return KV_OK;
}

/* A random model whose attention is sharp (sharpen) and loud: values and
 * output projection scaled up so the block's output is of the residual's
 * size and an error in it shows in the logits. */
static struct kv_model *attn_model(struct kv_config c) {
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, 23, &m, &err), KV_OK, "%s", err.msg);
    sharpen(m);
    int64_t vd = c.n_kv_heads * c.head_dim * c.dim, od = c.dim * c.n_heads * c.head_dim;
    for (int64_t l = 0; l < c.n_layers; l++) {
        float *wv = kv_model_weight_mut(m, KV_W_V, l), *wo = kv_model_weight_mut(m, KV_W_O, l);
        for (int64_t i = 0; i < vd; i++) wv[i] *= 8;
        for (int64_t i = 0; i < od; i++) wo[i] *= 8;
    }
    return m;
}

#define DEV_N 70
#define DEV_T 16 /* 4 windows, remainder 6 dropped */
static void dev_tokens(int32_t *tok) {
    for (int i = 0; i < DEV_N; i++) tok[i] = (i * 37 + 5) % 97;
}

/* The naive device reproduces the CPU base: ppl within 1e-5 relative,
 * logits within 1e-4 of the largest. */
static void check_device_equals_base(struct kv_config c, const char *what) {
    struct kv_model *m = attn_model(c);
    int32_t tok[DEV_N];
    dev_tokens(tok);
    struct naive_dev D = naive_dev_new(m, DEV_T);
    struct kv_fwd_hooks hk = {.ctx = &D, .attn = naive_attn};
    struct kv_compare_result r;
    struct kv_err err;
    cr_assert_eq(kv_ppl_compare_attn(m, NULL, 16, &hk, tok, DEV_N, DEV_T, 0, NULL, NULL, &r, &err),
                 KV_OK, "%s: %s", what, err.msg);
    cr_assert(r.has_dev, "%s", what);
    cr_assert_eq(r.dev.windows, 4, "%s", what);
    cr_assert_eq(r.dev.scored, 4 * 15, "%s", what);
    cr_assert_eq(r.comp.windows, 0, "%s: no compressed run without lr", what);
    struct kv_ppl_result b;
    cr_assert_eq(kv_ppl_run(m, tok, DEV_N, DEV_T, 0, NULL, NULL, &b, &err), KV_OK);
    kvt_assert_close_f64(&r.base.ppl, &b.ppl, 1, 0, 1e-12, what);
    kvt_assert_close_f64(&r.dev.ppl, &r.base.ppl, 1, 0, 1e-5, what);
    cr_assert_lt(r.max_rel_logit, 1e-4, "%s: max rel logit %g", what, r.max_rel_logit);
    cr_assert_lt(r.dev_kl, 1e-8, "%s: kl %g", what, r.dev_kl);
    cr_assert_geq(r.dev_top1, 0.95, "%s: top-1 %g", what, r.dev_top1);
    /* the check can fail: a device without attention is far off */
    hk.attn = no_attn;
    cr_assert_eq(kv_ppl_compare_attn(m, NULL, 16, &hk, tok, DEV_N, DEV_T, 0, NULL, NULL, &r, &err),
                 KV_OK);
    cr_assert_gt(r.max_rel_logit, 0.5, "%s: without attention %g", what, r.max_rel_logit);
    free(D.kc), free(D.vc);
    kv_model_close(m);
}

Test(ppl_device, naive_attention_equals_base_llama_interleaved) {
    check_device_equals_base(tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), "llama interleaved");
}
Test(ppl_device, naive_attention_equals_base_llama_half_bias) {
    check_device_equals_base(tiny_cfg(KV_ROPE_HALF, 1, 0), "llama half, qkv bias");
}
Test(ppl_device, naive_attention_equals_base_gpt2) {
    check_device_equals_base(tiny_gpt2_cfg(), "gpt2");
}

/* Logits of one window with the given hooks (NULL: the CPU path). */
static float *window_logits(const struct kv_model *m, const struct kv_lowrank *lr,
                            const struct kv_fwd_hooks *hk, const int32_t *tok, int64_t T) {
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, T, &f, &err), KV_OK);
    if (lr) cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_OK, "%s", err.msg);
    kv_fwd_set_hooks(f, hk);
    int64_t V = kv_model_config(m)->vocab_size;
    float *lg = malloc((size_t)(T * V) * sizeof *lg);
    cr_assert_eq(kv_fwd_run(f, tok, T, 0, lg, &err), KV_OK, "%s", err.msg);
    kv_fwd_free(f);
    return lg;
}

/* log softmax of a row, float64. */
static void log_softmax(const float *l, int64_t V, double *out) {
    double mx = -INFINITY, z = 0;
    for (int64_t j = 0; j < V; j++) mx = fmax(mx, l[j]);
    for (int64_t j = 0; j < V; j++) z += exp(l[j] - mx);
    for (int64_t j = 0; j < V; j++) out[j] = l[j] - mx - log(z);
}

/* Every device metric of kv_ppl_compare_attn recomputed here from the
 * logits of separate forward passes (ref: lr's latent path, or the base). */
struct dev_metrics {
    double nll, kl, top1, max_rel;
    int64_t w, pos;
};
static struct dev_metrics metrics_of(const struct kv_model *m, const struct kv_lowrank *lr,
                                     const struct kv_fwd_hooks *hk, const int32_t *tok,
                                     int64_t windows, int64_t T) {
    int64_t V = kv_model_config(m)->vocab_size;
    struct dev_metrics o = {.max_rel = -1};
    double *a = malloc((size_t)V * sizeof *a), *b = malloc((size_t)V * sizeof *b);
    for (int64_t w = 0; w < windows; w++) {
        float *lr_ = window_logits(m, lr, NULL, tok + w * T, T);
        float *ld = window_logits(m, NULL, hk, tok + w * T, T);
        for (int64_t i = 0; i + 1 < T; i++) {
            const float *x = lr_ + i * V, *y = ld + i * V;
            log_softmax(x, V, a), log_softmax(y, V, b);
            o.nll -= b[tok[w * T + i + 1]];
            int64_t ax = 0, ay = 0;
            double num = 0, den = 0;
            for (int64_t j = 0; j < V; j++) {
                o.kl += exp(a[j]) * (a[j] - b[j]);
                if (x[j] > x[ax]) ax = j;
                if (y[j] > y[ay]) ay = j;
                num = fmax(num, fabs((double)y[j] - x[j]));
                den = fmax(den, fabs((double)x[j]));
            }
            o.top1 += ax == ay;
            if (num / den > o.max_rel) o.max_rel = num / den, o.w = w, o.pos = i;
        }
        free(lr_), free(ld);
    }
    double scored = (double)(windows * (T - 1));
    o.nll /= scored, o.kl /= scored, o.top1 /= scored;
    free(a), free(b);
    return o;
}

static void check_metrics(const struct kv_compare_result *r, const struct dev_metrics *want,
                          const char *what) {
    kvt_assert_close_f64(&r->dev.nll, &want->nll, 1, 1e-9, 1e-9, what);
    double ppl = exp(want->nll);
    kvt_assert_close_f64(&r->dev.ppl, &ppl, 1, 0, 1e-9, what);
    kvt_assert_close_f64(&r->dev_kl, &want->kl, 1, 1e-12, 1e-6, what);
    kvt_assert_close_f64(&r->dev_top1, &want->top1, 1, 0, 1e-12, what);
    kvt_assert_close_f64(&r->max_rel_logit, &want->max_rel, 1, 0, 1e-9, what);
    cr_assert_eq(r->max_rel_window, want->w, "%s: window %lld, want %lld", what,
                 (long long)r->max_rel_window, (long long)want->w);
    cr_assert_eq(r->max_rel_pos, want->pos, "%s: position %lld, want %lld", what,
                 (long long)r->max_rel_pos, (long long)want->pos);
}

/* A device whose output at one position is off by 5% shows there: the
 * maximum relative logit difference, its place, ppl, kl and top-1 all
 * match a recomputation from separate forward passes. */
Test(ppl_device, a_perturbed_device_is_detected_where_it_differs) {
    struct kv_model *m = attn_model(tiny_cfg(KV_ROPE_HALF, 0, 1));
    int32_t tok[DEV_N];
    dev_tokens(tok);
    struct naive_dev D = naive_dev_new(m, DEV_T);
    D.perturb_layer = 1, D.perturb_pos = 5, D.perturb = 0.05;
    struct kv_fwd_hooks hk = {.ctx = &D, .attn = naive_attn};
    struct kv_compare_result r;
    struct kv_err err;
    cr_assert_eq(kv_ppl_compare_attn(m, NULL, 16, &hk, tok, DEV_N, DEV_T, 0, NULL, NULL, &r, &err),
                 KV_OK, "%s", err.msg);
    struct dev_metrics want = metrics_of(m, NULL, &hk, tok, 4, DEV_T);
    check_metrics(&r, &want, "perturbed device");
    cr_assert_eq(r.max_rel_pos, 5, "the perturbed position, got %lld", (long long)r.max_rel_pos);
    cr_assert_gt(r.max_rel_logit, 1e-3, "max rel logit %g", r.max_rel_logit);
    cr_assert_gt(fabs(r.dev.ppl / r.base.ppl - 1), 1e-6, "ppl %g vs %g", r.dev.ppl, r.base.ppl);
    free(D.kc), free(D.vc);
    kv_model_close(m);
}

/* A model, its svd at ratio 0.5, the device tokens and a naive device. */
struct svd_case {
    struct kv_model *m;
    struct kv_lowrank *lr;
    int32_t tok[DEV_N];
    struct naive_dev D;
};

static void svd_case_init(struct svd_case *k) {
    k->m = attn_model(tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1));
    struct kv_decompose_opts o = {.method = KV_METHOD_SVD, .ratio = 0.5, .kv_bits = 16};
    struct kv_err err;
    cr_assert_eq(kv_decompose(k->m, NULL, &o, &k->lr, &err), KV_OK, "%s", err.msg);
    dev_tokens(k->tok);
    k->D = naive_dev_new(k->m, DEV_T);
}

/* With lr the device run is compared with the compressed CPU run: a device
 * that computes the base model's attention differs from it by what the
 * compression changed, and the base/compressed numbers are kv_ppl_compare's. */
Test(ppl_device, with_lr_the_device_is_compared_with_the_compressed_run) {
    struct svd_case K;
    svd_case_init(&K);
    struct kv_model *m = K.m;
    struct kv_lowrank *lr = K.lr;
    int32_t *tok = K.tok;
    struct kv_err err;
    struct kv_fwd_hooks hk = {.ctx = &K.D, .attn = naive_attn};
    struct kv_compare_result r, c;
    cr_assert_eq(kv_ppl_compare_attn(m, lr, 16, &hk, tok, DEV_N, DEV_T, 0, NULL, NULL, &r, &err),
                 KV_OK, "%s", err.msg);
    cr_assert_eq(kv_ppl_compare(m, lr, 16, tok, DEV_N, DEV_T, 0, NULL, NULL, &c, &err), KV_OK);
    cr_assert(!c.has_dev);
    kvt_assert_close_f64(&r.comp.ppl, &c.comp.ppl, 1, 0, 1e-12, "compressed ppl");
    kvt_assert_close_f64(&r.base.ppl, &c.base.ppl, 1, 0, 1e-12, "base ppl");
    kvt_assert_close_f64(&r.kl, &c.kl, 1, 1e-15, 1e-9, "kl");
    cr_assert_gt(r.kl, 1e-6, "the compression changes the model (kl %g)", r.kl);
    struct dev_metrics want = metrics_of(m, lr, &hk, tok, 4, DEV_T);
    check_metrics(&r, &want, "base device against compressed cpu");
    kvt_assert_close_f64(&r.dev.ppl, &r.base.ppl, 1, 0, 1e-5, "device ppl is the base's");
    kv_lr_free(lr);
    free(K.D.kc), free(K.D.vc);
    kv_model_close(m);
}

/* Scoring a slice of positions at a time (a deferred head) gives the
 * whole window's results: base, compressed and device runs (to fp32
 * rounding: a head of 1 row runs as another sgemm than one of 15). */
Test(ppl_device, slices_of_positions_score_as_the_whole_window) {
    struct svd_case K;
    svd_case_init(&K);
    struct kv_err err;
    struct kv_fwd_hooks hk = {.ctx = &K.D, .attn = naive_attn};
    struct kv_compare_result whole, part;
    struct kv_ppl_result pw, pp;
    cr_assert_eq(kv_ppl_compare_attn(K.m, K.lr, 16, &hk, K.tok, DEV_N, DEV_T, 0, NULL, NULL, &whole, &err),
                 KV_OK, "%s", err.msg);
    cr_assert_eq(kv_ppl_run(K.m, K.tok, DEV_N, DEV_T, 0, NULL, NULL, &pw, &err), KV_OK, "%s", err.msg);
    int64_t V = K.m->cfg.vocab_size;
    int64_t sizes[] = {1, 3, DEV_T - 1}; /* rows per slice: 1, 3 and one short of the window */
    for (int i = 0; i < 3; i++) {
        kv_ppl_slice_bytes(sizes[i] * V * (int64_t)sizeof(float));
        int rc = kv_ppl_compare_attn(K.m, K.lr, 16, &hk, K.tok, DEV_N, DEV_T, 0, NULL, NULL, &part, &err);
        int rc2 = kv_ppl_run(K.m, K.tok, DEV_N, DEV_T, 0, NULL, NULL, &pp, &err);
        kv_ppl_slice_bytes(0);
        cr_assert_eq(rc, KV_OK, "%s", err.msg);
        cr_assert_eq(rc2, KV_OK, "%s", err.msg);
        char what[64];
        snprintf(what, sizeof what, "%lld rows a slice", (long long)sizes[i]);
        kvt_assert_close_f64(&part.base.nll, &whole.base.nll, 1, 0, 1e-7, what);
        kvt_assert_close_f64(&part.comp.nll, &whole.comp.nll, 1, 0, 1e-7, what);
        kvt_assert_close_f64(&part.dev.nll, &whole.dev.nll, 1, 0, 1e-7, what);
        kvt_assert_close_f64(&part.kl, &whole.kl, 1, 1e-12, 1e-5, what);
        kvt_assert_close_f64(&part.dev_kl, &whole.dev_kl, 1, 1e-12, 1e-5, what);
        kvt_assert_close_f64(&pp.nll, &pw.nll, 1, 0, 1e-7, what);
        cr_assert_eq(part.top1, whole.top1, "%s: top1", what);
        cr_assert_eq(part.dev_top1, whole.dev_top1, "%s: device top1", what);
        cr_assert_eq(part.max_rel_window, whole.max_rel_window, "%s", what);
        cr_assert_eq(part.max_rel_pos, whole.max_rel_pos, "%s", what);
        kvt_assert_close_f64(&part.max_rel_logit, &whole.max_rel_logit, 1, 0, 1e-6, what);
    }
    kv_lr_free(K.lr);
    free(K.D.kc), free(K.D.vc);
    kv_model_close(K.m);
}

static int count_progress(void *ctx, int64_t done, int64_t total, int64_t tokens_done) {
    ++*(int *)ctx;
    return 0;
}

/* A failing device stops the run in the window where it failed and its
 * status comes back as is, with a generic message. */
Test(ppl_device, a_failing_device_stops_the_run_with_its_status) {
    struct kv_model *m = attn_model(tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1));
    int32_t tok[DEV_N];
    dev_tokens(tok);
    struct naive_dev D = naive_dev_new(m, DEV_T);
    struct kv_fwd_hooks hk = {.ctx = &D, .attn = naive_attn};
    int codes[2] = {KV_EDEVICE, 42};
    for (int k = 0; k < 2; k++) {
        D.calls = 0, D.fail_call = 2 + 2, D.fail_code = codes[k]; /* window 1, layer 1 */
        struct kv_compare_result r;
        struct kv_err err;
        int windows = 0;
        int rc = kv_ppl_compare_attn(m, NULL, 16, &hk, tok, DEV_N, DEV_T, 0, count_progress,
                                     &windows, &r, &err);
        cr_assert_eq(rc, codes[k], "status %d, want %d", rc, codes[k]);
        cr_assert_eq(err.code, codes[k]);
        cr_assert_str_eq(err.msg, "device run failed in window 1 (tokens 16..31)");
        cr_assert_eq(windows, 1, "progress after %d windows", windows);
    }
    struct kv_fwd_hooks none = {.ctx = &D};
    struct kv_compare_result r;
    struct kv_err err;
    cr_assert_eq(kv_ppl_compare_attn(m, NULL, 16, &none, tok, DEV_N, DEV_T, 0, NULL, NULL, &r, &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.msg, "device hooks without an attn hook");
    free(D.kc), free(D.vc);
    kv_model_close(m);
}

/* ------------------------------------------------------------ checks */

static const char *const ppl_flags[KV_PPL_OPT_COUNT] = {
    [KV_PPL_OPT_SEQ_LEN] = "--seq-len", [KV_PPL_OPT_MAX_WINDOWS] = "--max-windows",
    [KV_PPL_OPT_DEVICE_TOL] = "--device-tol"};

Test(ppl_check, options_in_the_library_words_or_the_callers) {
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_ppl_check(2, 0, NULL, &err), KV_OK);
    cr_assert_eq(kv_ppl_check(1, 0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "seq-len 1 is too short, need at least 2");
    cr_assert_eq(kv_ppl_check(0, 0, ppl_flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--seq-len must be at least 2, got 0");
    cr_assert_eq(kv_ppl_check(16, -1, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "max windows must be 0 (every window) or more, found -1");
    cr_assert_eq(kv_ppl_check(16, -3, ppl_flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--max-windows must be 0 (every window) or more");
    cr_assert_eq(kv_ppl_check_tol(0, ppl_flags, &err), KV_OK);
    cr_assert_eq(kv_ppl_check_tol(NAN, ppl_flags, &err), KV_OK, "NaN is 'not given'");
    cr_assert_eq(kv_ppl_check_tol(-1, ppl_flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--device-tol must be at least 0, got -1");
    cr_assert_eq(kv_ppl_check_tol(-0.5, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "device tolerance must be at least 0, got -0.5");
    /* the runs refuse short windows with the same rule */
    int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    struct kv_config c = {0};
    c.dim = 8, c.hidden_dim = 16, c.n_layers = 1, c.n_heads = 2, c.n_kv_heads = 2;
    c.head_dim = 4, c.vocab_size = 16, c.max_seq_len = 8, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.bos_id = 1, c.eos_id = 2;
    struct kv_model *m;
    cr_assert_eq(kv_model_init_random(&c, 1, &m, &err), KV_OK, "%s", err.msg);
    struct kv_ppl_result r;
    cr_assert_eq(kv_ppl_run(m, ids, 8, 1, 0, NULL, NULL, &r, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "seq-len 1 is too short, need at least 2");
    kv_model_close(m);
}

Test(ppl_check, the_device_verdict_compares_with_the_compressed_run_when_there_is_one) {
    struct kv_compare_result r;
    memset(&r, 0, sizeof r);
    r.base.ppl = 10, r.base.windows = 2;
    r.has_dev = 1, r.dev.ppl = 10.02, r.dev.windows = 2;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_float_eq(kv_compare_dev_rel(&r), 0.002, 1e-12);
    cr_assert_eq(kv_ppl_device_verdict(&r, 1e-3, ppl_flags, &err), KV_ENUMERIC);
    cr_assert_str_eq(err.msg, "device ppl 10.020000 differs from the cpu's 10.000000 by 2.00e-03 "
                              "relative, more than --device-tol 0.001");
    cr_assert_eq(kv_ppl_device_verdict(&r, 1e-3, NULL, &err), KV_ENUMERIC);
    cr_assert(strstr(err.msg, "more than the tolerance 0.001"), "%s", err.msg);
    cr_assert_eq(kv_ppl_device_verdict(&r, 3e-3, ppl_flags, &err), KV_OK);
    /* with a compressed run, the device is held against it */
    r.comp.ppl = 10.02, r.comp.windows = 2;
    cr_assert_float_eq(kv_compare_dev_rel(&r), 0, 1e-15);
    cr_assert_eq(kv_ppl_device_verdict(&r, 0, ppl_flags, &err), KV_OK);
    r.dev.ppl = NAN;
    cr_assert_eq(kv_ppl_device_verdict(&r, 1, ppl_flags, &err), KV_ENUMERIC, "NaN never passes");
    /* no device run: nothing to judge */
    r.has_dev = 0;
    cr_assert_eq(kv_ppl_device_verdict(&r, 0, ppl_flags, &err), KV_OK);
}

/* kv_bootstrap_ci against what a bootstrap of a mean must give: one value
 * repeated, a zero-width interval at it; for 400 windows of independent
 * draws, the interval of the mean KL within 15% of mean ± 1.96 sd/√n (the
 * normal limit), around the point, and ΔPPL's the exp of the same bounds of
 * the nll difference (monotone, so the percentiles map through). */
Test(ppl, bootstrap_intervals_of_the_window_means) {
    int64_t n = 400, scored = 7;
    double *d = malloc((size_t)n * sizeof *d), *k = malloc((size_t)n * sizeof *k);
    struct kv_err err;
    kv_err_clear(&err);
    for (int64_t i = 0; i < n; i++) d[i] = 0.7, k[i] = 0.3;
    double dc[2], kc[2];
    cr_assert_eq(kv_bootstrap_ci(d, k, n, scored, 500, 3, dc, kc, &err), KV_OK);
    cr_assert(fabs(dc[0] - expm1(0.1)) < 1e-12 && fabs(dc[1] - expm1(0.1)) < 1e-12, "%g %g", dc[0], dc[1]);
    cr_assert(fabs(kc[0] - 0.3 / 7) < 1e-15 && fabs(kc[1] - 0.3 / 7) < 1e-15);
    uint64_t s = 12345;
    double mean_k = 0, mean_d = 0;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        double u = (double)(s >> 11) / 9007199254740992.0;
        k[i] = 7 * u * u, d[i] = 7 * (u - 0.4);
        mean_k += k[i] / (double)n, mean_d += d[i] / (double)n;
    }
    double var_k = 0, var_d = 0;
    for (int64_t i = 0; i < n; i++)
        var_k += (k[i] - mean_k) * (k[i] - mean_k), var_d += (d[i] - mean_d) * (d[i] - mean_d);
    double half_k = 1.96 * sqrt(var_k / (double)(n - 1) / (double)n) / (double)scored;
    double half_d = 1.96 * sqrt(var_d / (double)(n - 1) / (double)n) / (double)scored;
    cr_assert_eq(kv_bootstrap_ci(d, k, n, scored, KV_BOOTSTRAP_DRAWS, 1, dc, kc, &err), KV_OK);
    double pk = mean_k / (double)scored, pd = mean_d / (double)scored;
    cr_log_info("kl %.6g in [%.6g, %.6g], normal [%.6g, %.6g]", pk, kc[0], kc[1], pk - half_k, pk + half_k);
    cr_assert(kc[0] < pk && pk < kc[1]);
    cr_assert(fabs((kc[1] - kc[0]) / (2 * half_k) - 1) < 0.15, "kl width %g, normal %g", kc[1] - kc[0], 2 * half_k);
    cr_assert(fabs(pk - half_k - kc[0]) < 0.15 * half_k && fabs(pk + half_k - kc[1]) < 0.15 * half_k);
    cr_assert(dc[0] < expm1(pd) && expm1(pd) < dc[1]);
    cr_assert(fabs(log1p(dc[0]) - (pd - half_d)) < 0.15 * half_d, "%g vs %g", log1p(dc[0]), pd - half_d);
    cr_assert(fabs(log1p(dc[1]) - (pd + half_d)) < 0.15 * half_d, "%g vs %g", log1p(dc[1]), pd + half_d);
    free(d), free(k);
}

/* tokens[] as a kv_token_src */
static int tokens_window(void *ctx, int64_t w, int64_t seq_len, const int32_t **ids,
                         struct kv_err *err) {
    (void)err;
    *ids = (const int32_t *)ctx + w * seq_len;
    return KV_OK;
}
static struct kv_token_src array_src(const int32_t *tokens, int64_t n) {
    return (struct kv_token_src){tokens_window, (void *)tokens, n};
}

/* A window at a time: parts 0, 1 and 2 of 3 (windows w ≡ i mod 3) fill
 * only their own rows; the rows added element-wise, as mpirun's reduction
 * does, give kv_ppl_compare's numbers bit for bit, and a thread count
 * does not change a row. */
Test(ppl, parts_added_up_are_the_whole_comparison) {
    struct svd_case K;
    svd_case_init(&K);
    struct kv_err err;
    struct kv_compare_result whole, got;
    cr_assert_eq(kv_ppl_compare(K.m, K.lr, 16, K.tok, DEV_N, DEV_T, 0, NULL, NULL, &whole, &err), KV_OK,
                 "%s", err.msg);
    int64_t windows;
    cr_assert_eq(kv_ppl_windows(DEV_N, DEV_T, 0, &windows, &err), KV_OK);
    cr_assert_eq(windows, DEV_N / DEV_T);
    double *sum = calloc((size_t)windows * KV_PPL_SUMS, sizeof *sum);
    double *part = malloc((size_t)windows * KV_PPL_SUMS * sizeof *part);
    double sec[2], total_sec[2] = {0, 0};
    for (int64_t i = 0; i < 3; i++) {
        for (int64_t j = 0; j < windows * KV_PPL_SUMS; j++) part[j] = 0;
        kv_set_threads((int)(i + 1)); /* 1, 2, 3 threads */
        struct kv_token_src src = array_src(K.tok, DEV_N);
        cr_assert_eq(kv_ppl_compare_part(K.m, K.lr, 16, &src, DEV_T, 0, i, 3, NULL, NULL, part, sec, &err),
                     KV_OK, "%s", err.msg);
        for (int64_t w = 0; w < windows; w++)
            for (int c = 0; c < KV_PPL_SUMS; c++) {
                double v = part[w * KV_PPL_SUMS + c];
                if (w % 3 != i) cr_assert(v == 0, "part %lld wrote window %lld", (long long)i, (long long)w);
                sum[w * KV_PPL_SUMS + c] += v;
            }
        total_sec[0] += sec[0], total_sec[1] += sec[1];
    }
    kv_set_threads(0);
    cr_assert_eq(kv_ppl_compare_finish(sum, windows, DEV_N, DEV_T, 1, total_sec, &got, &err), KV_OK);
    cr_assert(got.base.nll_sum == whole.base.nll_sum && got.comp.nll_sum == whole.comp.nll_sum,
              "nll sums %.17g %.17g against %.17g %.17g", got.base.nll_sum, got.comp.nll_sum,
              whole.base.nll_sum, whole.comp.nll_sum);
    cr_assert(got.kl == whole.kl && got.top1 == whole.top1, "kl %.17g top1 %.17g against %.17g %.17g",
              got.kl, got.top1, whole.kl, whole.top1);
    cr_assert(got.dppl_ci[0] == whole.dppl_ci[0] && got.dppl_ci[1] == whole.dppl_ci[1] &&
              got.kl_ci[0] == whole.kl_ci[0] && got.kl_ci[1] == whole.kl_ci[1], "intervals differ");
    cr_assert_gt(whole.kl, 0, "the compression changes the model");
    /* a part that does not exist */
    struct kv_token_src src = array_src(K.tok, DEV_N);
    cr_assert_eq(kv_ppl_compare_part(K.m, K.lr, 16, &src, DEV_T, 0, 3, 3, NULL, NULL, part, sec, &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.msg, "part 3 of 3 does not exist");
    free(sum), free(part);
    kv_lr_free(K.lr);
    free(K.D.kc), free(K.D.vc);
    kv_model_close(K.m);
}
