/* Forward pass against a naive float64 reference written here from the
 * Llama definition (no BLAS, no shared code with lib/forward.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "testutil.h"

/* Reference logits [n, vocab] of tokens at positions 0..n-1. */
static double *naive_forward(const struct kv_model *m, const int32_t *tok, int64_t n) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, h = c->n_heads, g = c->n_kv_heads, dh = c->head_dim, hid = c->hidden_dim;
    int64_t V = c->vocab_size;
    double *x = calloc((size_t)(n * d), sizeof(double));
    double *xn = calloc((size_t)(n * d), sizeof(double));
    double *q = calloc((size_t)(n * h * dh), sizeof(double));
    double *k = calloc((size_t)(n * g * dh), sizeof(double));
    double *v = calloc((size_t)(n * g * dh), sizeof(double));
    double *o = calloc((size_t)(n * h * dh), sizeof(double));
    double *a = calloc((size_t)hid, sizeof(double));
    double *logits = calloc((size_t)(n * V), sizeof(double));
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++) x[t * d + j] = m->tok_emb[tok[t] * d + j];
#define NORM(w)                                                                             \
    for (int64_t t = 0; t < n; t++) {                                                        \
        double ss = 0;                                                                       \
        for (int64_t j = 0; j < d; j++) ss += x[t * d + j] * x[t * d + j];                   \
        double r = 1.0 / sqrt(ss / d + c->norm_eps);                                         \
        for (int64_t j = 0; j < d; j++) xn[t * d + j] = x[t * d + j] * r * (w)[j];           \
    }
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *w = m->layers[l].w;
        NORM(w[KV_W_ATTN_NORM]);
        /* projections: out[t][r] = sum_j W[r][j] xn[t][j] + b[r] */
        struct {
            double *out;
            const float *W, *b;
            int64_t rows;
        } pr[3] = {{q, w[KV_W_Q], w[KV_W_BQ], h * dh},
                   {k, w[KV_W_K], w[KV_W_BK], g * dh},
                   {v, w[KV_W_V], w[KV_W_BV], g * dh}};
        for (int p = 0; p < 3; p++)
            for (int64_t t = 0; t < n; t++)
                for (int64_t r = 0; r < pr[p].rows; r++) {
                    double s = pr[p].b ? pr[p].b[r] : 0;
                    for (int64_t j = 0; j < d; j++) s += pr[p].W[r * d + j] * xn[t * d + j];
                    pr[p].out[t * pr[p].rows + r] = s;
                }
        /* rope: rotate pair (a, b) of each head by t * theta^(-2i/dh) */
        for (int p = 0; p < 2; p++) {
            double *buf = p ? k : q;
            int64_t nh = p ? g : h;
            for (int64_t t = 0; t < n; t++)
                for (int64_t hh = 0; hh < nh; hh++)
                    for (int64_t i = 0; i < dh / 2; i++) {
                        int64_t ia = c->rope_layout == KV_ROPE_HALF ? i : 2 * i;
                        int64_t ib = c->rope_layout == KV_ROPE_HALF ? i + dh / 2 : 2 * i + 1;
                        double ang = t * pow(c->rope_theta, -2.0 * i / dh);
                        double *e = buf + (t * nh + hh) * dh;
                        double re = e[ia], im = e[ib];
                        e[ia] = re * cos(ang) - im * sin(ang);
                        e[ib] = re * sin(ang) + im * cos(ang);
                    }
        }
        /* causal softmax attention, query head hh reads kv head hh / (h/g) */
        for (int64_t hh = 0; hh < h; hh++) {
            int64_t kvh = hh / (h / g);
            for (int64_t t = 0; t < n; t++) {
                double *sc = calloc((size_t)(t + 1), sizeof(double)), mx = -INFINITY, z = 0;
                for (int64_t s = 0; s <= t; s++) {
                    double dot = 0;
                    for (int64_t i = 0; i < dh; i++)
                        dot += q[(t * h + hh) * dh + i] * k[(s * g + kvh) * dh + i];
                    sc[s] = dot / sqrt((double)dh);
                    if (sc[s] > mx) mx = sc[s];
                }
                for (int64_t s = 0; s <= t; s++) z += sc[s] = exp(sc[s] - mx);
                for (int64_t i = 0; i < dh; i++) {
                    double acc = 0;
                    for (int64_t s = 0; s <= t; s++) acc += sc[s] / z * v[(s * g + kvh) * dh + i];
                    o[(t * h + hh) * dh + i] = acc;
                }
                free(sc);
            }
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < d; r++) {
                double s = 0;
                for (int64_t j = 0; j < h * dh; j++) s += w[KV_W_O][r * h * dh + j] * o[t * h * dh + j];
                x[t * d + r] += s;
            }
        NORM(w[KV_W_FFN_NORM]);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t r = 0; r < hid; r++) {
                double gt = 0, up = 0;
                for (int64_t j = 0; j < d; j++) {
                    gt += w[KV_W_GATE][r * d + j] * xn[t * d + j];
                    up += w[KV_W_UP][r * d + j] * xn[t * d + j];
                }
                a[r] = gt / (1 + exp(-gt)) * up;
            }
            for (int64_t r = 0; r < d; r++) {
                double s = 0;
                for (int64_t j = 0; j < hid; j++) s += w[KV_W_DOWN][r * hid + j] * a[j];
                x[t * d + r] += s;
            }
        }
    }
    NORM(m->out_norm);
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < V; r++) {
            double s = 0;
            for (int64_t j = 0; j < d; j++) s += m->lm_head[r * d + j] * xn[t * d + j];
            logits[t * V + r] = s;
        }
    free(x), free(xn), free(q), free(k), free(v), free(o), free(a);
    return logits;
}

static struct kv_config tiny_cfg(enum kv_rope_layout layout, int bias, int tied) {
    struct kv_config c = {0};
    c.dim = 48;
    c.hidden_dim = 80;
    c.n_layers = 2;
    c.n_heads = 6;
    c.n_kv_heads = 2;
    c.head_dim = 8;
    c.vocab_size = 97;
    c.max_seq_len = 64;
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.rope_layout = layout;
    c.has_qkv_bias = bias;
    c.tied_embeddings = tied;
    c.bos_id = 1;
    c.eos_id = 2;
    return c;
}

/* Random weights are N(0, 0.02); scale them up so attention is not uniform
 * and errors in RoPE or masking show in the logits. */
static void sharpen(struct kv_model *m) {
    const struct kv_config *c = &m->cfg;
    int64_t qd = c->n_heads * c->head_dim * c->dim, kd = c->n_kv_heads * c->head_dim * c->dim;
    for (int64_t l = 0; l < c->n_layers; l++) {
        float *wq = (float *)m->layers[l].w[KV_W_Q], *wk = (float *)m->layers[l].w[KV_W_K];
        for (int64_t i = 0; i < qd; i++) wq[i] *= 20;
        for (int64_t i = 0; i < kd; i++) wk[i] *= 20;
    }
}

static void check_against_naive(struct kv_config c, int64_t n) {
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, 42, &m, &err), KV_OK, "%s", err.msg);
    sharpen(m);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 37 + 11) % c.vocab_size);
    struct kv_fwd *f;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", err.msg);
    double *ref = naive_forward(m, tok, n);
    float *reff = malloc((size_t)(n * c.vocab_size) * sizeof *reff);
    for (int64_t i = 0; i < n * c.vocab_size; i++) reff[i] = (float)ref[i];
    kvt_assert_close_f32(kv_fwd_logits(f), reff, n * c.vocab_size, 2e-5, 1e-4, "logits");
    free(reff), free(ref), free(tok);
    kv_fwd_free(f);
    kv_model_free(m);
}

Test(forward, matches_naive_interleaved_rope_gqa) { check_against_naive(tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), 40); }
Test(forward, matches_naive_rotate_half_with_bias_untied) { check_against_naive(tiny_cfg(KV_ROPE_HALF, 1, 0), 40); }
Test(forward, matches_naive_across_query_blocks) {
    /* more rows than one attention block (128) exercises the block loop */
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c.n_layers = 1;
    check_against_naive(c, 150);
}

Test(forward, rope_layouts_differ) {
    /* guard against a test that cannot tell the layouts apart */
    struct kv_config a = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), b = tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_model *ma, *mb;
    struct kv_err err;
    kv_model_init_random(&a, 7, &ma, &err);
    kv_model_init_random(&b, 7, &mb, &err);
    sharpen(ma), sharpen(mb);
    int32_t tok[16];
    for (int i = 0; i < 16; i++) tok[i] = (i * 5 + 3) % 97;
    struct kv_fwd *fa, *fb;
    kv_fwd_init(ma, 16, &fa, &err);
    kv_fwd_init(mb, 16, &fb, &err);
    kv_fwd_run(fa, tok, 16, 0, NULL, &err);
    kv_fwd_run(fb, tok, 16, 0, NULL, &err);
    double diff = 0;
    for (int i = 0; i < 16 * 97; i++) diff = fmax(diff, fabs(kv_fwd_logits(fa)[i] - kv_fwd_logits(fb)[i]));
    cr_assert_gt(diff, 1e-3, "interleaved and rotate-half gave the same logits (max diff %g)", diff);
    kv_fwd_free(fa), kv_fwd_free(fb), kv_model_free(ma), kv_model_free(mb);
}

Test(forward, incremental_cache_equals_whole_window) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 1, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 3, &m, &err);
    sharpen(m);
    int64_t n = 24;
    int32_t tok[24];
    for (int i = 0; i < n; i++) tok[i] = (i * 13 + 5) % 97;
    struct kv_fwd *whole, *inc;
    kv_fwd_init(m, n, &whole, &err);
    kv_fwd_init(m, n, &inc, &err);
    kv_fwd_run(whole, tok, n, 0, NULL, &err);
    float *step = malloc((size_t)(n * 97) * sizeof *step);
    /* prefill 10, then one token at a time */
    cr_assert_eq(kv_fwd_run(inc, tok, 10, 0, step, &err), KV_OK);
    for (int64_t p = 10; p < n; p++)
        cr_assert_eq(kv_fwd_run(inc, tok + p, 1, p, step + p * 97, &err), KV_OK);
    kvt_assert_close_f32(step, kv_fwd_logits(whole), n * 97, 1e-5, 1e-4, "incremental logits");
    free(step);
    kv_fwd_free(whole), kv_fwd_free(inc), kv_model_free(m);
}

struct hook_rec {
    int calls_x, calls_qk, calls_kv;
    double x_sum;
};
static int h_x(void *ctx, int64_t l, const float *x, int64_t n, int64_t pos0) {
    struct hook_rec *r = ctx;
    r->calls_x++;
    for (int64_t i = 0; i < n * 48; i++) r->x_sum += x[i];
    return 0;
}
static int h_qk(void *ctx, int64_t l, const float *q, const float *k, int64_t n, int64_t pos0) {
    ((struct hook_rec *)ctx)->calls_qk++;
    return 0;
}
static int h_kv_zero(void *ctx, int64_t l, const float *x, float *k, float *v, int64_t n, int64_t pos0) {
    ((struct hook_rec *)ctx)->calls_kv++;
    memset(v, 0, (size_t)(n * 16) * sizeof *v); /* g*d_h = 16 */
    return 0;
}

Test(forward, hooks_fire_and_kv_replacement_takes_effect) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 5, &m, &err);
    int32_t tok[12];
    for (int i = 0; i < 12; i++) tok[i] = (i * 7 + 2) % 97;
    struct kv_fwd *f;
    kv_fwd_init(m, 12, &f, &err);
    kv_fwd_run(f, tok, 12, 0, NULL, &err);
    float *base = malloc(12 * 97 * sizeof *base);
    memcpy(base, kv_fwd_logits(f), 12 * 97 * sizeof *base);
    struct hook_rec rec = {0};
    struct kv_fwd_hooks hk = {&rec, h_x, h_qk, h_kv_zero};
    kv_fwd_set_hooks(f, &hk);
    kv_fwd_run(f, tok, 12, 0, NULL, &err);
    cr_assert_eq(rec.calls_x, 2);
    cr_assert_eq(rec.calls_qk, 2);
    cr_assert_eq(rec.calls_kv, 2);
    cr_assert(isfinite(rec.x_sum) && rec.x_sum != 0);
    /* with V zeroed attention contributes nothing: logits must change */
    double diff = 0;
    for (int i = 0; i < 12 * 97; i++) diff = fmax(diff, fabs(kv_fwd_logits(f)[i] - base[i]));
    cr_assert_gt(diff, 1e-4);
    free(base);
    kv_fwd_free(f), kv_model_free(m);
}

Test(forward, rejects_out_of_vocab_and_overflowing_positions) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_model *m;
    struct kv_err err;
    kv_model_init_random(&c, 5, &m, &err);
    struct kv_fwd *f;
    kv_fwd_init(m, 8, &f, &err);
    int32_t tok[9] = {1, 2, 3, 97, 4, 5, 6, 7, 8};
    cr_assert_eq(kv_fwd_run(f, tok, 4, 0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "token id 97 at position 3 is outside the vocabulary of 97");
    cr_assert_eq(kv_fwd_run(f, tok, 9, 0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "positions 0..8 exceed the context of 8");
    kv_fwd_free(f), kv_model_free(m);
}

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
    kv_model_free(m);
}
