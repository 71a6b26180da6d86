/* Helpers of the decomposition suites (test_decompose.c, test_latent.c,
 * test_decompose_alloc.c, test_decompose_opts.c): random and shared models,
 * statistics as kvcal collect sums them, and naive references. The shared
 * models are stories260K (.bin + tok512.bin), tinystories-656K (HF) and
 * val1k.txt; tests that need them skip without them. */
#ifndef KV_DECOMPOSE_FIXTURES_H
#define KV_DECOMPOSE_FIXTURES_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstats.h"
#include "linalg.h"
#include "lrmodel.h"
#include "model.h"
#include "naive_llama.h"
#include "testutil.h"

#define M260_REL "models/stories260K/stories260K.bin"
#define TOK260_REL "models/stories260K/tok512.bin"
#define M656_REL "models/tinystories-656K"
#define VAL_REL "text/tinystories/val1k.txt"

#define SEQ 128          /* window length on the shared models */
#define CAL_WINDOWS 3    /* calibration: the first windows of val1k */
#define EVAL_AT 2048     /* evaluation starts at this token (held-out text) */
#define EVAL_WINDOWS 4
#define TEXT_BYTES 30000 /* the prefix of val1k that is tokenized */

/* ---------------------------------------------------------------- helpers */

static inline const char *fmt_err(const struct kv_err *e) {
    static __thread char buf[2600];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

static inline char *shared_copy(const char *rel) {
    KVT_NEED_SHARED(p, rel);
    char *s = strdup(p);
    cr_assert(s);
    return s;
}

static inline uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

static inline int32_t *random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
    int32_t *t = malloc((size_t)n * sizeof *t);
    cr_assert(t);
    for (int64_t i = 0; i < n; i++) t[i] = (int32_t)(lcg(&seed) % (uint64_t)vocab);
    return t;
}

/* One thread: Criterion runs two tests at once on two cores. */
static inline struct kv_model *random_model_cfg(struct kv_config c, uint64_t seed) {
    kv_set_threads(1);
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &err), KV_OK, "%s", fmt_err(&err));
    sharpen(m);
    return m;
}

/* tiny_cfg: d 48, GQA 6/2, d_h 8, 2 layers, vocab 97. */
static inline struct kv_model *random_model(enum kv_rope_layout layout, int bias, uint64_t seed) {
    return random_model_cfg(tiny_cfg(layout, bias, 1), seed);
}

struct shared {
    struct kv_model *m;
    int32_t *tok;
    int64_t n;
};

/* which 0: stories260K, 1: tinystories-656K; with the first TEXT_BYTES of
 * val1k.txt tokenized (BOS first). */
static inline struct shared open_shared(int which) {
    kv_set_threads(1);
    char *mp = shared_copy(which ? M656_REL : M260_REL);
    char *tp = which ? NULL : shared_copy(TOK260_REL);
    char *vp = shared_copy(VAL_REL);
    struct shared sh = {0};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(mp, tp, &sh.m, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert(kv_model_tokenizer(sh.m));
    char *text;
    size_t len;
    cr_assert_eq(kv_text_read(vp, &text, &len, &err), KV_OK, "%s", fmt_err(&err));
    size_t cut = len < TEXT_BYTES ? len : TEXT_BYTES;
    while (cut > 0 && text[cut - 1] != '\n') cut--; /* whole lines only */
    cr_assert_eq(kv_tok_encode(kv_model_tokenizer(sh.m), text, cut, 1, &sh.tok, &sh.n, &err), KV_OK,
                 "%s", fmt_err(&err));
    cr_assert_geq(sh.n, EVAL_AT + EVAL_WINDOWS * SEQ, "only %lld tokens", (long long)sh.n);
    free(text), free(mp), free(tp), free(vp);
    return sh;
}

static inline void shared_free(struct shared *sh) {
    free(sh->tok);
    kv_model_close(sh->m);
}

/* Statistics of nwin windows of seq tokens, as kvcal collect sums them. */
static inline struct kv_stats *collect(const struct kv_model *m, const int32_t *tok, int64_t seq,
                                int64_t nwin) {
    struct kv_stats *s = NULL;
    struct kv_accum *a = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(kv_model_config(m), &s, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_model_fingerprint(m, s->info.fingerprint, &err), KV_OK, "%s", fmt_err(&err));
    s->info.seq_len = seq;
    cr_assert_eq(kv_accum_init(m, s, seq, &a, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t w = 0; w < nwin; w++) {
        cr_assert_eq(kv_accum_window(a, tok + w * seq, &err), KV_OK, "%s", fmt_err(&err));
        s->info.tokens += seq;
        s->info.windows++;
    }
    kv_accum_sync(a);
    kv_accum_free(a);
    return s;
}

/* kvcal decompose's flags, the names the CLI-facing tests expect in the
 * library's messages (kv_decompose_opts.names). */
static const char *const kv_decompose_flag_names[KV_DECOMPOSE_OPT_COUNT] = {
    [KV_DECOMPOSE_OPT_METHOD] = "--method",
    [KV_DECOMPOSE_OPT_ALLOC] = "--alloc",
    [KV_DECOMPOSE_OPT_EPS] = "--eps",
    [KV_DECOMPOSE_OPT_RATIO] = "--ratio",
    [KV_DECOMPOSE_OPT_GROUP_SIZE] = "--group-size",
    [KV_DECOMPOSE_OPT_RANK_MULTIPLE] = "--rank-multiple",
    [KV_DECOMPOSE_OPT_MIN_RANK] = "--min-rank",
    [KV_DECOMPOSE_OPT_D_MIN] = "--d-min",
    [KV_DECOMPOSE_OPT_D_MAX] = "--d-max",
    [KV_DECOMPOSE_OPT_COND_SKIP] = "--cond-skip",
    [KV_DECOMPOSE_OPT_ERROR_BUDGET] = "--error-budget",
    [KV_DECOMPOSE_OPT_STATS] = "--stats",
    [KV_DECOMPOSE_OPT_TEXT] = "--text",
    [KV_DECOMPOSE_OPT_SEQ_LEN] = "--seq-len",
    [KV_DECOMPOSE_OPT_WINDOWS] = "--windows",
    [KV_DECOMPOSE_OPT_KV_BITS] = "--kv-bits",
    [KV_DECOMPOSE_OPT_CENTER] = "--center",
    [KV_DECOMPOSE_OPT_BASIS] = "--basis",
};


static inline struct kv_decompose_opts opts_of(enum kv_method method, enum kv_alloc alloc, double eps,
                                        double ratio, int64_t group) {
    struct kv_decompose_opts o;
    memset(&o, 0, sizeof o);
    o.method = method, o.alloc = alloc, o.eps = eps, o.ratio = ratio, o.group_size = group;
    o.kv_bits = 16;
    o.names = kv_decompose_flag_names;
    return o;
}

static inline struct kv_lowrank *decompose_ok(const struct kv_model *m, const struct kv_stats *s,
                                       struct kv_decompose_opts o, const char *what) {
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(m, s, &o, &lr, &err), KV_OK, "%s: %s", what, fmt_err(&err));
    cr_assert(lr);
    return lr;
}

static inline const struct kv_lr_side *side_of(const struct kv_lowrank *lr, int64_t l, int side) {
    return side ? &lr->layers[l].v : &lr->layers[l].k;
}

/* Width a unit's rank is out of: n_heads·d_h for latents, d_h for a rotation. */
static inline int64_t unit_width(const struct kv_lr_side *sd, const struct kv_lr_unit *u, int64_t dh) {
    return sd->mode == KV_LR_POSTROPE_ROTATION ? dh : u->n_heads * dh;
}

/* KV bytes per token from the header's definition, counted here. */
static inline int64_t bytes_by_definition(const struct kv_lowrank *lr, int bits) {
    int64_t b = 0;
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            if (sd->mode == KV_LR_FULL) {
                b += lr->info.n_kv_heads * lr->info.head_dim * 2;
                continue;
            }
            for (int64_t u = 0; u < sd->n_units; u++) {
                int64_t r = sd->units[u].rank;
                b += bits >= 16 ? 2 * r : (r * bits + 7) / 8 + 4;
            }
        }
    return b;
}

/* The output covariance Σ yᵀy of heads h0.. of K (which 0), V (1) or Q (2,
 * pre-RoPE) with y = x Wᵀ + b over the calibration tokens, from the raw sums
 * with naive loops: W C_x Wᵀ + W Σx bᵀ + b Σxᵀ Wᵀ + N b bᵀ ([nh·d_h]²). */
static inline double *out_cov_naive(const struct kv_stats *s, const struct kv_model *m, int64_t l,
                             int which, int64_t h0, int64_t nh) {
    static const enum kv_wkind wk[3] = {KV_W_K, KV_W_V, KV_W_Q}, bk[3] = {KV_W_BK, KV_W_BV, KV_W_BQ};
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, dh = c->head_dim, mm = nh * dh;
    const float *W = m->layers[l].w[wk[which]] + h0 * dh * d;
    const float *B = m->layers[l].w[bk[which]];
    const double *xtx = s->layers[l].xtx, *xs = s->layers[l].xsum;
    double *t = calloc((size_t)(mm * d), sizeof *t), *C = calloc((size_t)(mm * mm), sizeof *C);
    double *ws = calloc((size_t)mm, sizeof *ws);
    cr_assert(t && C && ws);
    for (int64_t a = 0; a < mm; a++)
        for (int64_t j = 0; j < d; j++) {
            double acc = 0;
            for (int64_t i = 0; i < d; i++) acc += (double)W[a * d + i] * xtx[i * d + j];
            t[a * d + j] = acc;
        }
    for (int64_t a = 0; a < mm; a++) {
        for (int64_t b = 0; b < mm; b++) {
            double acc = 0;
            for (int64_t j = 0; j < d; j++) acc += t[a * d + j] * (double)W[b * d + j];
            C[a * mm + b] = acc;
        }
        for (int64_t j = 0; j < d; j++) ws[a] += (double)W[a * d + j] * xs[j];
    }
    if (B) {
        const float *b = B + h0 * dh;
        double n = (double)s->info.tokens;
        for (int64_t a = 0; a < mm; a++)
            for (int64_t e = 0; e < mm; e++)
                C[a * mm + e] += ws[a] * b[e] + (double)b[a] * ws[e] + n * (double)b[a] * b[e];
    }
    free(t), free(ws);
    return C;
}

/* Σ‖y - μ‖² of heads h0 .. h0+nh-1 of `which`: tr of out_cov_naive less
 * N‖μ‖², μ = (W Σx + N b) / N summed here by loops. */
static inline double out_var_naive(const struct kv_stats *s, const struct kv_model *m, int64_t l,
                                   int which, int64_t h0, int64_t nh) {
    static const enum kv_wkind wk[3] = {KV_W_K, KV_W_V, KV_W_Q}, bk[3] = {KV_W_BK, KV_W_BV, KV_W_BQ};
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, dh = c->head_dim, mm = nh * dh;
    const float *W = m->layers[l].w[wk[which]] + h0 * dh * d, *B = m->layers[l].w[bk[which]];
    double n = (double)s->info.tokens, var = 0, *C = out_cov_naive(s, m, l, which, h0, nh);
    for (int64_t a = 0; a < mm; a++) {
        double mu = 0;
        for (int64_t j = 0; j < d; j++) mu += (double)W[a * d + j] * s->layers[l].xsum[j];
        mu = mu / n + (B ? (double)B[h0 * dh + a] : 0.0);
        var += C[a * mm + a] - n * mu * mu;
    }
    free(C);
    return var;
}

/* Eigenvalues (descending, negatives set to 0) of a symmetric n×n matrix. */
static inline double *eigvals(const double *a, int64_t n) {
    double *w = malloc((size_t)n * sizeof *w), *v = malloc((size_t)(n * n) * sizeof *v);
    cr_assert(w && v);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(a, n, w, v, "test gram", &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t i = 0; i < n; i++) w[i] = w[i] > 0 ? w[i] : 0;
    free(v);
    return w;
}

static inline double sum_from(const double *a, int64_t n, int64_t k) {
    double s = 0;
    for (int64_t i = k; i < n; i++) s += a[i];
    return s;
}

/* Logits [n, vocab] of one window at positions 0.., through the latent cache
 * when lr is non-NULL. malloc'd. */
static inline float *run_logits(const struct kv_model *m, const struct kv_lowrank *lr, int bits,
                         const int32_t *tok, int64_t n) {
    struct kv_fwd *f = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int64_t V = kv_model_config(m)->vocab_size;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", fmt_err(&err));
    if (lr) cr_assert_eq(kv_fwd_set_lowrank(f, lr, bits, &err), KV_OK, "%s", fmt_err(&err));
    float *out = malloc((size_t)(n * V) * sizeof *out);
    cr_assert(out);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, out, &err), KV_OK, "%s", fmt_err(&err));
    kv_fwd_free(f);
    return out;
}

static inline double max_abs_f32(const float *a, int64_t n) {
    double mx = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs((double)a[i]));
    return mx;
}

static inline double max_abs_diff_f32(const float *a, const float *b, int64_t n) {
    double mx = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs((double)a[i] - (double)b[i]));
    return mx;
}

/* Mean KL(p‖q) over rows of two logit arrays, in float64. */
static inline double mean_kl(const float *p, const float *q, int64_t rows, int64_t V) {
    double tot = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *a = p + r * V, *b = q + r * V;
        double ma = a[0], mb = b[0], za = 0, zb = 0, kl = 0;
        for (int64_t j = 1; j < V; j++) ma = fmax(ma, a[j]), mb = fmax(mb, b[j]);
        for (int64_t j = 0; j < V; j++) za += exp(a[j] - ma), zb += exp(b[j] - mb);
        for (int64_t j = 0; j < V; j++) {
            double la = a[j] - ma - log(za), lb = b[j] - mb - log(zb);
            kl += exp(la) * (la - lb);
        }
        tot += kl;
    }
    return tot / (double)rows;
}

/* Smallest rank the options allow (min_rank, then rounded up to rank_multiple,
 * at most the width). */
static inline int64_t admissible(int64_t r, int64_t min_rank, int64_t mult, int64_t width) {
    if (r < min_rank) r = min_rank;
    r = (r + mult - 1) / mult * mult;
    return r < width ? r : width;
}

#endif
