/* Low-rank K/V decomposition (calib/decompose.c) and the latent-cache
 * forward pass, each against a computation written here:
 *
 *   decompose_identity  --eps 1 and --ratio 1 keep every rank, so the
 *                       compressed perplexity equals the base one (shared
 *                       models, every method, text held out from calibration);
 *   decompose_error     each unit's predicted `dropped` equals ‖Y − Y'‖²_F
 *                       measured with naive loops over the calibration windows
 *                       (Y = X Wᵀ + b from captured attention inputs, Y' from
 *                       the emitted factors), and `energy` equals ‖Y‖²_F;
 *                       post-RoPE rotations against captured post-RoPE keys;
 *   latent_forward      the latent cache equals the plain forward of a dense
 *                       model whose K/V weights are up·down, and a naive
 *                       float64 forward of it (post-RoPE rotations: scores
 *                       q rotᵀ rot kᵀ); quantized latents degrade gracefully;
 *   decompose_alloc     every allocation against its defining rule, recomputed
 *                       from eigenvalues / singular values computed here;
 *   decompose_opts      impossible options are KV_EINVAL naming the option.
 *
 * Statistics come from kv_accum over a few windows. The shared-model tests use
 * stories260K (.bin + tok512.bin), tinystories-656K (HF) and val1k.txt, and
 * skip without them. */
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

static const char *fmt_err(const struct kv_err *e) {
    static __thread char buf[2600];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

static char *shared_copy(const char *rel) {
    KVT_NEED_SHARED(p, rel);
    char *s = strdup(p);
    cr_assert(s);
    return s;
}

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

static int32_t *random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
    int32_t *t = malloc((size_t)n * sizeof *t);
    cr_assert(t);
    for (int64_t i = 0; i < n; i++) t[i] = (int32_t)(lcg(&seed) % (uint64_t)vocab);
    return t;
}

/* One thread: Criterion runs two tests at once on two cores. */
static struct kv_model *random_model_cfg(struct kv_config c, uint64_t seed) {
    kv_set_threads(1);
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &err), KV_OK, "%s", fmt_err(&err));
    sharpen(m);
    return m;
}

/* tiny_cfg: d 48, GQA 6/2, d_h 8, 2 layers, vocab 97. */
static struct kv_model *random_model(enum kv_rope_layout layout, int bias, uint64_t seed) {
    return random_model_cfg(tiny_cfg(layout, bias, 1), seed);
}

struct shared {
    struct kv_model *m;
    int32_t *tok;
    int64_t n;
};

/* which 0: stories260K, 1: tinystories-656K; with the first TEXT_BYTES of
 * val1k.txt tokenized (BOS first). */
static struct shared open_shared(int which) {
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

static void shared_free(struct shared *sh) {
    free(sh->tok);
    kv_model_close(sh->m);
}

/* Statistics of nwin windows of seq tokens, as kvcal collect sums them. */
static struct kv_stats *collect(const struct kv_model *m, const int32_t *tok, int64_t seq,
                                int64_t nwin) {
    struct kv_stats *s = NULL;
    struct kv_accum *a = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(kv_model_config(m), &s, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_model_fingerprint(m, s->fingerprint, &err), KV_OK, "%s", fmt_err(&err));
    s->seq_len = seq;
    cr_assert_eq(kv_accum_init(m, s, seq, &a, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t w = 0; w < nwin; w++) {
        cr_assert_eq(kv_accum_window(a, tok + w * seq, &err), KV_OK, "%s", fmt_err(&err));
        s->tokens += seq;
        s->windows++;
    }
    kv_accum_sync(a);
    kv_accum_free(a);
    return s;
}

static struct kv_decompose_opts opts_of(enum kv_method method, enum kv_alloc alloc, double eps,
                                        double ratio, int64_t group) {
    struct kv_decompose_opts o;
    memset(&o, 0, sizeof o);
    o.method = method, o.alloc = alloc, o.eps = eps, o.ratio = ratio, o.group_size = group;
    o.kv_bits = 16;
    return o;
}

static struct kv_lowrank *decompose_ok(const struct kv_model *m, const struct kv_stats *s,
                                       struct kv_decompose_opts o, const char *what) {
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(m, s, &o, &lr, &err), KV_OK, "%s: %s", what, fmt_err(&err));
    cr_assert(lr);
    return lr;
}

static const struct kv_lr_side *side_of(const struct kv_lowrank *lr, int64_t l, int side) {
    return side ? &lr->layers[l].v : &lr->layers[l].k;
}

/* Width a unit's rank is out of: n_heads·d_h for latents, d_h for a rotation. */
static int64_t unit_width(const struct kv_lr_side *sd, const struct kv_lr_unit *u, int64_t dh) {
    return sd->mode == KV_LR_POSTROPE_ROTATION ? dh : u->n_heads * dh;
}

/* KV bytes per token from the header's definition, counted here. */
static int64_t bytes_by_definition(const struct kv_lowrank *lr, int bits) {
    int64_t b = 0;
    for (int64_t l = 0; l < lr->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            if (sd->mode == KV_LR_FULL) {
                b += lr->n_kv_heads * lr->head_dim * 2;
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
static double *out_cov_naive(const struct kv_stats *s, const struct kv_model *m, int64_t l,
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
        double n = (double)s->tokens;
        for (int64_t a = 0; a < mm; a++)
            for (int64_t e = 0; e < mm; e++)
                C[a * mm + e] += ws[a] * b[e] + (double)b[a] * ws[e] + n * (double)b[a] * b[e];
    }
    free(t), free(ws);
    return C;
}

/* Eigenvalues (descending, negatives set to 0) of a symmetric n×n matrix. */
static double *eigvals(const double *a, int64_t n) {
    double *w = malloc((size_t)n * sizeof *w), *v = malloc((size_t)(n * n) * sizeof *v);
    cr_assert(w && v);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_la_eigh(a, n, w, v, "test gram", &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t i = 0; i < n; i++) w[i] = w[i] > 0 ? w[i] : 0;
    free(v);
    return w;
}

static double sum_from(const double *a, int64_t n, int64_t k) {
    double s = 0;
    for (int64_t i = k; i < n; i++) s += a[i];
    return s;
}

/* Logits [n, vocab] of one window at positions 0.., through the latent cache
 * when lr is non-NULL. malloc'd. */
static float *run_logits(const struct kv_model *m, const struct kv_lowrank *lr, int bits,
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

static double max_abs_f32(const float *a, int64_t n) {
    double mx = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs((double)a[i]));
    return mx;
}

static double max_abs_diff_f32(const float *a, const float *b, int64_t n) {
    double mx = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs((double)a[i] - (double)b[i]));
    return mx;
}

/* Mean KL(p‖q) over rows of two logit arrays, in float64. */
static double mean_kl(const float *p, const float *q, int64_t rows, int64_t V) {
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

/* ================================================================ identity */

/* The keys' expected mode per method (values are always fused_output). */
static enum kv_lr_mode key_mode(enum kv_method m) {
    return m == KV_METHOD_FDC || m == KV_METHOD_ZACK ? KV_LR_POSTROPE_ROTATION
                                                     : KV_LR_PREROPE_LATENT;
}

static void identity_every_method(int which) {
    struct shared sh = open_shared(which);
    const struct kv_config *c = kv_model_config(sh.m);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, CAL_WINDOWS);
    int64_t base = c->n_layers * 2 * c->n_kv_heads * c->head_dim * 2;
    cr_assert_eq(kv_lr_base_bytes(c), base);
    for (int method = 0; method < KV_METHOD_COUNT; method++)
        for (int setting = 0; setting < 2; setting++) {
            char what[96];
            snprintf(what, sizeof what, "%s with %s", kv_method_name(method),
                     setting ? "--ratio 1" : "--eps 1");
            struct kv_decompose_opts o =
                opts_of(method, KV_ALLOC_DEFAULT, setting ? 0 : 1.0, setting ? 1.0 : 0, 1);
            struct kv_lowrank *lr = decompose_ok(sh.m, s, o, what);
            for (int64_t l = 0; l < c->n_layers; l++)
                for (int side = 0; side < 2; side++) {
                    const struct kv_lr_side *sd = side_of(lr, l, side);
                    enum kv_lr_mode want = side ? KV_LR_FUSED_OUTPUT : key_mode(method);
                    cr_assert_eq(sd->mode, want, "%s: layer %lld %s mode %s, expected %s", what,
                                 (long long)l, side ? "v" : "k", kv_lr_mode_name(sd->mode),
                                 kv_lr_mode_name(want));
                    int64_t covered = 0;
                    for (int64_t u = 0; u < sd->n_units; u++) {
                        const struct kv_lr_unit *un = &sd->units[u];
                        int64_t wdt = unit_width(sd, un, c->head_dim);
                        cr_assert_eq(un->rank, wdt, "%s: layer %lld %s unit %lld rank %lld of %lld",
                                     what, (long long)l, side ? "v" : "k", (long long)u,
                                     (long long)un->rank, (long long)wdt);
                        covered += un->n_heads;
                    }
                    cr_assert_eq(covered, c->n_kv_heads, "%s: units cover %lld kv heads", what,
                                 (long long)covered);
                }
            cr_assert_eq(kv_lr_bytes(lr, 16), base, "%s: %lld bytes, base %lld", what,
                         (long long)kv_lr_bytes(lr, 16), (long long)base);
            cr_assert_eq(bytes_by_definition(lr, 16), base);
            struct kv_compare_result r;
            struct kv_err err;
            kv_err_clear(&err);
            cr_assert_eq(kv_ppl_compare(sh.m, lr, 16, sh.tok + EVAL_AT, EVAL_WINDOWS * SEQ, SEQ, 0,
                                        NULL, NULL, &r, &err),
                         KV_OK, "%s: %s", what, fmt_err(&err));
            cr_assert_eq(r.comp.windows, EVAL_WINDOWS);
            kvt_assert_close_f64(&r.comp.ppl, &r.base.ppl, 1, 0, 1e-4, what);
            cr_assert_lt(r.kl, 1e-6, "%s: kl %g", what, r.kl);
            kv_lr_free(lr);
        }
    kv_stats_free(s);
    shared_free(&sh);
}

Test(decompose_identity, stories260K_every_method_keeps_the_base_ppl, .timeout = 300) {
    identity_every_method(0);
}

Test(decompose_identity, tinystories656K_every_method_keeps_the_base_ppl, .timeout = 300) {
    identity_every_method(1);
}

/* ================================================================ error */

/* Measured ‖Y − Y'‖² and ‖Y‖² per unit, summed over every forward pass. */
struct meas {
    const struct kv_model *m;
    const struct kv_lowrank *lr;
    int64_t g;
    double *dropped, *energy; /* [(layer*2 + side)*g + unit] */
};

/* Latent units: Y = x Wᵀ + b against Y' = (x downᵀ + down_bias) upᵀ, in
 * float64 from the fp32 attention input. */
static int meas_x(void *ctx, int64_t l, const float *x, int64_t n, int64_t pos0) {
    struct meas *M = ctx;
    const struct kv_config *c = kv_model_config(M->m);
    int64_t d = c->dim, dh = c->head_dim, kd = c->n_kv_heads * dh;
    double *z = malloc((size_t)kd * sizeof *z);
    for (int side = 0; side < 2; side++) {
        const struct kv_lr_side *sd = side_of(M->lr, l, side);
        if (sd->mode != KV_LR_PREROPE_LATENT && sd->mode != KV_LR_FUSED_OUTPUT) continue;
        const float *W = M->m->layers[l].w[side ? KV_W_V : KV_W_K];
        const float *B = M->m->layers[l].w[side ? KV_W_BV : KV_W_BK];
        for (int64_t u = 0; u < sd->n_units; u++) {
            const struct kv_lr_unit *un = &sd->units[u];
            int64_t mm = un->n_heads * dh, r = un->rank, row0 = un->head0 * dh;
            double e = 0, en = 0;
            for (int64_t t = 0; t < n; t++) {
                const float *xt = x + t * d;
                for (int64_t k = 0; k < r; k++) {
                    double acc = un->down_bias ? un->down_bias[k] : 0;
                    for (int64_t j = 0; j < d; j++) acc += (double)un->down[k * d + j] * xt[j];
                    z[k] = acc;
                }
                for (int64_t a = 0; a < mm; a++) {
                    double acc = B ? B[row0 + a] : 0, rec = 0;
                    for (int64_t j = 0; j < d; j++) acc += (double)W[(row0 + a) * d + j] * xt[j];
                    for (int64_t k = 0; k < r; k++) rec += (double)un->up[a * r + k] * z[k];
                    e += (acc - rec) * (acc - rec);
                    en += acc * acc;
                }
            }
            M->dropped[(l * 2 + side) * M->g + u] += e;
            M->energy[(l * 2 + side) * M->g + u] += en;
        }
    }
    free(z);
    return 0;
}

/* Rotation units: the post-RoPE key k_j against k_j rotᵀ rot. */
static int meas_qk(void *ctx, int64_t l, const float *q, const float *k, int64_t n,
                   int64_t pos0) {
    struct meas *M = ctx;
    const struct kv_config *c = kv_model_config(M->m);
    int64_t dh = c->head_dim, kd = c->n_kv_heads * dh;
    const struct kv_lr_side *sd = side_of(M->lr, l, 0);
    if (sd->mode != KV_LR_POSTROPE_ROTATION) return 0;
    double z[64];
    for (int64_t u = 0; u < sd->n_units; u++) {
        const struct kv_lr_unit *un = &sd->units[u];
        int64_t r = un->rank;
        double e = 0, en = 0;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + t * kd + un->head0 * dh;
            for (int64_t i = 0; i < r; i++) {
                double acc = 0;
                for (int64_t a = 0; a < dh; a++) acc += (double)un->rot[i * dh + a] * kt[a];
                z[i] = acc;
            }
            for (int64_t a = 0; a < dh; a++) {
                double rec = 0;
                for (int64_t i = 0; i < r; i++) rec += (double)un->rot[i * dh + a] * z[i];
                e += (kt[a] - rec) * (kt[a] - rec);
                en += (double)kt[a] * kt[a];
            }
        }
        M->dropped[(l * 2) * M->g + u] += e;
        M->energy[(l * 2) * M->g + u] += en;
    }
    return 0;
}

/* Decompose with o, rerun the same windows capturing X and post-RoPE K, and
 * compare every unit's dropped and energy with the measured sums. */
static void check_predicted_error(const struct kv_model *m, const struct kv_stats *s,
                                  const int32_t *tok, int64_t seq, int64_t nwin,
                                  struct kv_decompose_opts o, const char *what) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, g = c->n_kv_heads, dh = c->head_dim;
    struct kv_lowrank *lr = decompose_ok(m, s, o, what);
    cr_assert(c->head_dim <= 64);
    struct meas M = {m, lr, g, calloc((size_t)(L * 2 * g), sizeof(double)),
                     calloc((size_t)(L * 2 * g), sizeof(double))};
    struct kv_fwd *f = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, seq, &f, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_fwd_hooks hk = {0};
    hk.ctx = &M, hk.attn_in = meas_x, hk.qk_rope = meas_qk, hk.hooks_only = 1;
    kv_fwd_set_hooks(f, &hk);
    for (int64_t w = 0; w < nwin; w++)
        cr_assert_eq(kv_fwd_run(f, tok + w * seq, seq, 0, NULL, &err), KV_OK, "%s", fmt_err(&err));
    kv_fwd_free(f);

    int64_t nu = 0, compressed = 0, real_drop = 0;
    double *got_d = calloc((size_t)(L * 2 * g), sizeof(double));
    double *ref_d = calloc((size_t)(L * 2 * g), sizeof(double));
    double *got_e = calloc((size_t)(L * 2 * g), sizeof(double));
    double *ref_e = calloc((size_t)(L * 2 * g), sizeof(double));
    double emax = 0;
    for (int64_t l = 0; l < L; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            cr_assert_neq(sd->mode, KV_LR_FULL, "%s: layer %lld side %d is full", what, (long long)l,
                          side);
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                got_d[nu] = un->dropped, ref_d[nu] = M.dropped[(l * 2 + side) * g + u];
                got_e[nu] = un->energy, ref_e[nu] = M.energy[(l * 2 + side) * g + u];
                emax = fmax(emax, ref_e[nu]);
                compressed += un->rank < unit_width(sd, un, dh);
                real_drop += un->dropped > 1e-3 * un->energy;
                nu++;
            }
        }
    /* not vacuous: a good share of the units drop real energy */
    cr_assert_geq(4 * compressed, nu, "%s: only %lld of %lld units are compressed", what,
                  (long long)compressed, (long long)nu);
    cr_assert_geq(real_drop, 1, "%s: no unit drops energy", what);
    char w2[256];
    snprintf(w2, sizeof w2, "%s: unit energy vs measured ‖Y‖²", what);
    kvt_assert_close_f64(got_e, ref_e, nu, 0, 1e-9, w2);
    /* full-rank units measure fp32 rounding only (~1e-14 of the energy) */
    snprintf(w2, sizeof w2, "%s: unit dropped vs measured ‖Y − Y'‖²", what);
    kvt_assert_close_f64(got_d, ref_d, nu, 1e-11 * emax, 1e-6, w2);
    free(got_d), free(ref_d), free(got_e), free(ref_e), free(M.dropped), free(M.energy);
    kv_lr_free(lr);
}

/* Every method whose units a measurement can check, at about half the bytes. */
static void predicted_error_every_method(const struct kv_model *m, const int32_t *tok, int64_t seq,
                                         int64_t nwin, const char *model) {
    struct kv_stats *s = collect(m, tok, seq, nwin);
    struct {
        enum kv_method method;
        enum kv_alloc alloc;
        double eps, ratio;
        int64_t group;
    } cases[] = {
        {KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0, 0.5, 1},  {KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0, 0.5, 2},
        {KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1},   {KV_METHOD_EIGEN, KV_ALLOC_DEFAULT, 0, 0.5, 1},
        {KV_METHOD_EIGEN, KV_ALLOC_DEFAULT, 0.9, 0, 1}, {KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0.5, 1},
        {KV_METHOD_FDC, KV_ALLOC_DEFAULT, 0, 0.5, 1},   {KV_METHOD_ZACK, KV_ALLOC_DEFAULT, 0, 0.5, 1},
        {KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.4, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[128];
        snprintf(what, sizeof what, "%s %s group %lld %s %g", model, kv_method_name(cases[i].method),
                 (long long)cases[i].group, cases[i].eps > 0 ? "eps" : "ratio",
                 cases[i].eps > 0 ? cases[i].eps : cases[i].ratio);
        check_predicted_error(m, s, tok, seq, nwin,
                              opts_of(cases[i].method, cases[i].alloc, cases[i].eps, cases[i].ratio,
                                      cases[i].group),
                              what);
    }
    kv_stats_free(s);
}

Test(decompose_error, random_gqa_without_bias_dropped_is_measured_error, .timeout = 120) {
    struct kv_model *m = random_model(KV_ROPE_INTERLEAVED, 0, 21);
    int32_t *tok = random_tokens(3 * 64, 97, 5);
    predicted_error_every_method(m, tok, 64, 3, "random gqa");
    free(tok);
    kv_model_close(m);
}

Test(decompose_error, random_gqa_with_bias_dropped_is_measured_error, .timeout = 120) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 22);
    int32_t *tok = random_tokens(3 * 64, 97, 6);
    predicted_error_every_method(m, tok, 64, 3, "random gqa + bias");
    free(tok);
    kv_model_close(m);
}

Test(decompose_error, stories260K_dropped_is_measured_error, .timeout = 300) {
    struct shared sh = open_shared(0);
    predicted_error_every_method(sh.m, sh.tok, SEQ, CAL_WINDOWS, "stories260K");
    shared_free(&sh);
}

/* Without statistics svd measures in the weight metric: dropped is
 * ‖W_u − up·down‖²_F and energy ‖W_u‖²_F. */
Test(decompose_error, svd_without_stats_is_the_weight_error) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 23);
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, dh = c->head_dim;
    for (int64_t group = 1; group <= 2; group++) {
        struct kv_lowrank *lr =
            decompose_ok(m, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, group), "svd");
        double got[16], ref[16], gote[16], refe[16];
        int64_t nu = 0;
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                const struct kv_lr_side *sd = side_of(lr, l, side);
                const float *W = m->layers[l].w[side ? KV_W_V : KV_W_K];
                for (int64_t u = 0; u < sd->n_units; u++) {
                    const struct kv_lr_unit *un = &sd->units[u];
                    int64_t mm = un->n_heads * dh, r = un->rank, row0 = un->head0 * dh;
                    cr_assert_lt(r, mm);
                    double e = 0, en = 0;
                    for (int64_t a = 0; a < mm; a++)
                        for (int64_t j = 0; j < d; j++) {
                            double w = W[(row0 + a) * d + j], p = 0;
                            for (int64_t k = 0; k < r; k++)
                                p += (double)un->up[a * r + k] * un->down[k * d + j];
                            e += (w - p) * (w - p), en += w * w;
                        }
                    got[nu] = un->dropped, ref[nu] = e, gote[nu] = un->energy, refe[nu] = en;
                    nu++;
                }
            }
        kvt_assert_close_f64(got, ref, nu, 0, 1e-6, "svd weight-metric dropped");
        kvt_assert_close_f64(gote, refe, nu, 0, 1e-9, "svd weight-metric energy");
        kv_lr_free(lr);
    }
    kv_model_close(m);
}

/* ================================================================ latent forward */

/* A model with the same random weights as random_model(layout, bias, seed)
 * whose K and V projections are replaced, for every latent side of lr, by
 * W = up·down and b = up·down_bias (float64 products rounded once). */
static struct kv_model *dense_copy(enum kv_rope_layout layout, int bias, uint64_t seed,
                                   const struct kv_lowrank *lr) {
    struct kv_model *m2 = random_model(layout, bias, seed);
    const struct kv_config *c = kv_model_config(m2);
    int64_t d = c->dim, dh = c->head_dim;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            if (sd->mode != KV_LR_PREROPE_LATENT && sd->mode != KV_LR_FUSED_OUTPUT) continue;
            /* init_random weights are owned heap blocks */
            float *W = (float *)m2->layers[l].w[side ? KV_W_V : KV_W_K];
            float *B = (float *)m2->layers[l].w[side ? KV_W_BV : KV_W_BK];
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                int64_t mm = un->n_heads * dh, r = un->rank, row0 = un->head0 * dh;
                cr_assert_eq(B != NULL, un->down_bias != NULL, "layer %lld: bias and down_bias",
                             (long long)l);
                for (int64_t a = 0; a < mm; a++) {
                    for (int64_t j = 0; j < d; j++) {
                        double p = 0;
                        for (int64_t k = 0; k < r; k++)
                            p += (double)un->up[a * r + k] * un->down[k * d + j];
                        W[(row0 + a) * d + j] = (float)p;
                    }
                    if (B) {
                        double p = 0;
                        for (int64_t k = 0; k < r; k++) p += (double)un->up[a * r + k] * un->down_bias[k];
                        B[row0 + a] = (float)p;
                    }
                }
            }
        }
    return m2;
}

Test(latent_forward, prerope_latent_and_fused_output_equal_the_dense_model, .timeout = 120) {
    struct {
        enum kv_rope_layout layout;
        int bias;
    } models[] = {{KV_ROPE_INTERLEAVED, 0}, {KV_ROPE_HALF, 1}};
    struct {
        enum kv_method method;
        int64_t group;
        int with_stats;
    } cases[] = {{KV_METHOD_PALU, 1, 1}, {KV_METHOD_PALU, 2, 1}, {KV_METHOD_EIGEN, 1, 1},
                 {KV_METHOD_SVD, 1, 0}, {KV_METHOD_LORC, 1, 0}};
    int64_t n = 48, V = 97;
    for (size_t mi = 0; mi < 2; mi++) {
        uint64_t seed = 31 + mi;
        struct kv_model *m = random_model(models[mi].layout, models[mi].bias, seed);
        int32_t *cal = random_tokens(3 * 64, V, 100 + mi), *tok = random_tokens(n, V, 200 + mi);
        struct kv_stats *s = collect(m, cal, 64, 3);
        float *plain = run_logits(m, NULL, 16, tok, n);
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            char what[128];
            snprintf(what, sizeof what, "%s group %lld, %s rope%s", kv_method_name(cases[ci].method),
                     (long long)cases[ci].group, models[mi].layout ? "half" : "interleaved",
                     models[mi].bias ? " + bias" : "");
            struct kv_lowrank *lr =
                decompose_ok(m, cases[ci].with_stats ? s : NULL,
                             opts_of(cases[ci].method, KV_ALLOC_DEFAULT, 0, 0.5, cases[ci].group), what);
            cr_assert_eq(lr->layers[0].k.mode, KV_LR_PREROPE_LATENT);
            cr_assert_eq(lr->layers[0].v.mode, KV_LR_FUSED_OUTPUT);
            float *lat = run_logits(m, lr, 16, tok, n);
            struct kv_model *m2 = dense_copy(models[mi].layout, models[mi].bias, seed, lr);
            float *dense = run_logits(m2, NULL, 16, tok, n);
            double scale = max_abs_f32(dense, n * V);
            /* the compression is visible in the logits, so the comparison bites */
            cr_assert_gt(max_abs_diff_f32(plain, dense, n * V), 1e-3 * scale, "%s: no effect", what);
            char w2[192];
            snprintf(w2, sizeof w2, "%s: latent cache vs dense model", what);
            kvt_assert_close_f32(lat, dense, n * V, 1e-4 * scale, 0, w2);
            double *nv = naive_forward(m2, tok, n);
            double *latd = malloc((size_t)(n * V) * sizeof *latd);
            for (int64_t i = 0; i < n * V; i++) latd[i] = lat[i];
            snprintf(w2, sizeof w2, "%s: latent cache vs naive float64 dense model", what);
            kvt_assert_close_f64(latd, nv, n * V, 1e-4 * scale, 0, w2);
            free(nv), free(latd), free(lat), free(dense);
            kv_model_close(m2);
            kv_lr_free(lr);
        }
        free(plain), free(cal), free(tok);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

/* Naive float64 forward from the Llama definition where the post-RoPE key of
 * KV head j in layer l is replaced by k P (P = kproj[l] + j·d_h², row-major,
 * or kproj[l] NULL to leave the layer's keys alone). */
static double *naive_forward_kproj(const struct kv_model *m, const int32_t *tok, int64_t n,
                                   double *const *kproj) {
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, h = c->n_heads, g = c->n_kv_heads, dh = c->head_dim, hid = c->hidden_dim;
    int64_t V = c->vocab_size, qd = h * dh, kd = g * dh;
    double *x = calloc((size_t)(n * d), sizeof *x), *xn = calloc((size_t)(n * d), sizeof *xn);
    double *q = calloc((size_t)(n * qd), sizeof *q), *k = calloc((size_t)(n * kd), sizeof *k);
    double *v = calloc((size_t)(n * kd), sizeof *v), *o = calloc((size_t)(n * qd), sizeof *o);
    double *p = calloc((size_t)n, sizeof *p), *tmp = calloc((size_t)dh, sizeof *tmp);
    double *a = calloc((size_t)hid, sizeof *a), *out = calloc((size_t)(n * V), sizeof *out);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++) x[t * d + j] = m->tok_emb[(int64_t)tok[t] * d + j];
    for (int64_t l = 0; l <= c->n_layers; l++) {
        const float *const *w = l < c->n_layers ? m->layers[l].w : NULL;
        const float *nw = w ? w[KV_W_ATTN_NORM] : m->out_norm;
        for (int64_t t = 0; t < n; t++) {
            double ss = 0;
            for (int64_t j = 0; j < d; j++) ss += x[t * d + j] * x[t * d + j];
            double rs = 1.0 / sqrt(ss / (double)d + (double)c->norm_eps);
            for (int64_t j = 0; j < d; j++) xn[t * d + j] = x[t * d + j] * rs * nw[j];
        }
        if (!w) break;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t r = 0; r < qd; r++) {
                double acc = w[KV_W_BQ] ? w[KV_W_BQ][r] : 0;
                for (int64_t j = 0; j < d; j++) acc += (double)w[KV_W_Q][r * d + j] * xn[t * d + j];
                q[t * qd + r] = acc;
            }
            for (int64_t r = 0; r < kd; r++) {
                double ak = w[KV_W_BK] ? w[KV_W_BK][r] : 0, av = w[KV_W_BV] ? w[KV_W_BV][r] : 0;
                for (int64_t j = 0; j < d; j++) {
                    ak += (double)w[KV_W_K][r * d + j] * xn[t * d + j];
                    av += (double)w[KV_W_V][r * d + j] * xn[t * d + j];
                }
                k[t * kd + r] = ak, v[t * kd + r] = av;
            }
            /* RoPE on every head of q and k at position t */
            for (int which = 0; which < 2; which++) {
                double *base = which ? k + t * kd : q + t * qd;
                for (int64_t hh = 0; hh < (which ? g : h); hh++)
                    for (int64_t i = 0; i < dh / 2; i++) {
                        int64_t ia = c->rope_layout == KV_ROPE_HALF ? i : 2 * i;
                        int64_t ib = c->rope_layout == KV_ROPE_HALF ? i + dh / 2 : 2 * i + 1;
                        double ang = (double)t * pow((double)c->rope_theta, -2.0 * (double)i / (double)dh);
                        double *e = base + hh * dh, re = e[ia], im = e[ib];
                        e[ia] = re * cos(ang) - im * sin(ang);
                        e[ib] = re * sin(ang) + im * cos(ang);
                    }
            }
            if (kproj[l])
                for (int64_t j = 0; j < g; j++) {
                    const double *P = kproj[l] + j * dh * dh;
                    double *kj = k + t * kd + j * dh;
                    for (int64_t b = 0; b < dh; b++) {
                        tmp[b] = 0;
                        for (int64_t e = 0; e < dh; e++) tmp[b] += kj[e] * P[e * dh + b];
                    }
                    memcpy(kj, tmp, (size_t)dh * sizeof *tmp);
                }
        }
        for (int64_t hh = 0; hh < h; hh++) {
            int64_t j = hh / (h / g);
            for (int64_t t = 0; t < n; t++) {
                double mx = -INFINITY, zs = 0;
                for (int64_t s2 = 0; s2 <= t; s2++) {
                    double dot = 0;
                    for (int64_t i = 0; i < dh; i++) dot += q[t * qd + hh * dh + i] * k[s2 * kd + j * dh + i];
                    p[s2] = dot / sqrt((double)dh);
                    mx = fmax(mx, p[s2]);
                }
                for (int64_t s2 = 0; s2 <= t; s2++) zs += p[s2] = exp(p[s2] - mx);
                for (int64_t i = 0; i < dh; i++) {
                    double acc = 0;
                    for (int64_t s2 = 0; s2 <= t; s2++) acc += p[s2] / zs * v[s2 * kd + j * dh + i];
                    o[t * qd + hh * dh + i] = acc;
                }
            }
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < d; r++) {
                double acc = 0;
                for (int64_t j = 0; j < qd; j++) acc += (double)w[KV_W_O][r * qd + j] * o[t * qd + j];
                x[t * d + r] += acc;
            }
        for (int64_t t = 0; t < n; t++) {
            double ss = 0;
            for (int64_t j = 0; j < d; j++) ss += x[t * d + j] * x[t * d + j];
            double rs = 1.0 / sqrt(ss / (double)d + (double)c->norm_eps);
            for (int64_t j = 0; j < d; j++) xn[t * d + j] = x[t * d + j] * rs * w[KV_W_FFN_NORM][j];
            for (int64_t r = 0; r < hid; r++) {
                double gt = 0, up = 0;
                for (int64_t j = 0; j < d; j++) {
                    gt += (double)w[KV_W_GATE][r * d + j] * xn[t * d + j];
                    up += (double)w[KV_W_UP][r * d + j] * xn[t * d + j];
                }
                a[r] = gt / (1.0 + exp(-gt)) * up;
            }
            for (int64_t r = 0; r < d; r++) {
                double acc = 0;
                for (int64_t j = 0; j < hid; j++) acc += (double)w[KV_W_DOWN][r * hid + j] * a[j];
                x[t * d + r] += acc;
            }
        }
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < V; r++) {
            double acc = 0;
            for (int64_t j = 0; j < d; j++) acc += (double)m->lm_head[r * d + j] * xn[t * d + j];
            out[t * V + r] = acc;
        }
    free(x), free(xn), free(q), free(k), free(v), free(o), free(p), free(tmp), free(a);
    return out;
}

Test(latent_forward, postrope_rotation_scores_are_q_rot_rot_k, .timeout = 120) {
    struct {
        enum kv_rope_layout layout;
        int bias;
    } models[] = {{KV_ROPE_INTERLEAVED, 0}, {KV_ROPE_HALF, 1}};
    enum kv_method methods[] = {KV_METHOD_FDC, KV_METHOD_ZACK};
    int64_t n = 48, V = 97;
    for (size_t mi = 0; mi < 2; mi++) {
        uint64_t seed = 41 + mi;
        struct kv_model *m = random_model(models[mi].layout, models[mi].bias, seed);
        const struct kv_config *c = kv_model_config(m);
        int64_t L = c->n_layers, g = c->n_kv_heads, dh = c->head_dim;
        int32_t *cal = random_tokens(3 * 64, V, 300 + mi), *tok = random_tokens(n, V, 400 + mi);
        struct kv_stats *s = collect(m, cal, 64, 3);
        /* the oracle itself: no projection is the plain naive forward */
        double *none[4] = {NULL, NULL, NULL, NULL};
        double *o1 = naive_forward_kproj(m, tok, n, none), *o2 = naive_forward(m, tok, n);
        kvt_assert_close_f64(o1, o2, n * V, 1e-9, 1e-9, "naive oracle without projection");
        free(o1), free(o2);
        for (size_t ci = 0; ci < 2; ci++) {
            char what[96];
            snprintf(what, sizeof what, "%s, %s rope%s", kv_method_name(methods[ci]),
                     models[mi].layout ? "half" : "interleaved", models[mi].bias ? " + bias" : "");
            struct kv_lowrank *lr =
                decompose_ok(m, s, opts_of(methods[ci], KV_ALLOC_DEFAULT, 0, 0.5, 1), what);
            double *P[4] = {NULL, NULL, NULL, NULL};
            int64_t reduced = 0;
            cr_assert(L <= 4);
            for (int64_t l = 0; l < L; l++) {
                const struct kv_lr_side *sd = &lr->layers[l].k;
                cr_assert_eq(sd->mode, KV_LR_POSTROPE_ROTATION, "%s", what);
                cr_assert_eq(lr->layers[l].v.mode, KV_LR_FUSED_OUTPUT, "%s", what);
                cr_assert_eq(sd->n_units, g);
                P[l] = calloc((size_t)(g * dh * dh), sizeof(double));
                for (int64_t u = 0; u < g; u++) {
                    const struct kv_lr_unit *un = &sd->units[u];
                    cr_assert_eq(un->n_heads, 1);
                    reduced += un->rank < dh;
                    double *Pj = P[l] + un->head0 * dh * dh; /* rotᵀ rot */
                    for (int64_t a = 0; a < dh; a++)
                        for (int64_t b = 0; b < dh; b++)
                            for (int64_t i = 0; i < un->rank; i++)
                                Pj[a * dh + b] += (double)un->rot[i * dh + a] * un->rot[i * dh + b];
                }
            }
            cr_assert_gt(reduced, 0, "%s: no key rotation drops a direction", what);
            /* values are latent: the oracle runs the dense model for them */
            struct kv_model *m2 = dense_copy(models[mi].layout, models[mi].bias, seed, lr);
            double *ref = naive_forward_kproj(m2, tok, n, P);
            float *lat = run_logits(m, lr, 16, tok, n);
            double scale = 0;
            for (int64_t i = 0; i < n * V; i++) scale = fmax(scale, fabs(ref[i]));
            double *latd = malloc((size_t)(n * V) * sizeof *latd);
            for (int64_t i = 0; i < n * V; i++) latd[i] = lat[i];
            char w2[160];
            snprintf(w2, sizeof w2, "%s: latent cache vs naive q rotᵀ rot kᵀ", what);
            kvt_assert_close_f64(latd, ref, n * V, 1e-4 * scale, 0, w2);
            /* and the rotation matters: the plain dense model differs */
            double *plain = naive_forward(m2, tok, n), diff = 0;
            for (int64_t i = 0; i < n * V; i++) diff = fmax(diff, fabs(plain[i] - ref[i]));
            cr_assert_gt(diff, 1e-3 * scale, "%s: the key rotation has no effect", what);
            free(plain), free(latd), free(lat), free(ref);
            for (int64_t l = 0; l < L; l++) free(P[l]);
            kv_model_close(m2);
            kv_lr_free(lr);
        }
        free(cal), free(tok);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

Test(latent_forward, incremental_latent_cache_equals_whole_window) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 51);
    int64_t n = 40, V = 97;
    int32_t *cal = random_tokens(3 * 64, V, 500), *tok = random_tokens(n, V, 501);
    struct kv_stats *s = collect(m, cal, 64, 3);
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC};
    int bits[] = {16, 8};
    struct kv_err err;
    kv_err_clear(&err);
    for (int mi = 0; mi < 2; mi++)
        for (int bi = 0; bi < 2; bi++) {
            struct kv_lowrank *lr =
                decompose_ok(m, s, opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1), "incremental");
            float *whole = run_logits(m, lr, bits[bi], tok, n);
            struct kv_fwd *f;
            cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
            cr_assert_eq(kv_fwd_set_lowrank(f, lr, bits[bi], &err), KV_OK, "%s", fmt_err(&err));
            float *step = malloc((size_t)(n * V) * sizeof *step);
            /* prefill 25, then 10, then one token at a time */
            cr_assert_eq(kv_fwd_run(f, tok, 25, 0, step, &err), KV_OK, "%s", fmt_err(&err));
            cr_assert_eq(kv_fwd_run(f, tok + 25, 10, 25, step + 25 * V, &err), KV_OK);
            for (int64_t p = 35; p < n; p++)
                cr_assert_eq(kv_fwd_run(f, tok + p, 1, p, step + p * V, &err), KV_OK);
            char what[96];
            snprintf(what, sizeof what, "%s kv_bits %d: incremental latent logits",
                     kv_method_name(methods[mi]), bits[bi]);
            kvt_assert_close_f32(step, whole, n * V, 1e-5 * max_abs_f32(whole, n * V), 1e-4, what);
            /* NULL restores the full path exactly */
            cr_assert_eq(kv_fwd_set_lowrank(f, NULL, 16, &err), KV_OK);
            cr_assert_eq(kv_fwd_run(f, tok, n, 0, step, &err), KV_OK);
            float *plain = run_logits(m, NULL, 16, tok, n);
            cr_assert(!memcmp(step, plain, (size_t)(n * V) * sizeof *step),
                      "set_lowrank(NULL) does not restore the plain forward");
            free(plain), free(step), free(whole);
            kv_fwd_free(f);
            kv_lr_free(lr);
        }
    free(cal), free(tok);
    kv_stats_free(s);
    kv_model_close(m);
}

Test(latent_forward, rejects_another_models_factors_and_bad_bits) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 0, 52);
    struct kv_config c2 = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c2.dim = 64;
    struct kv_model *m2 = random_model_cfg(c2, 53);
    struct kv_lowrank *lr =
        decompose_ok(m2, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1), "svd");
    struct kv_lowrank *lr1 =
        decompose_ok(m, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1), "svd");
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, 8, &f, &err), KV_OK);
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_EINVAL);
    cr_assert(strstr(err.msg, "compressed attention factors are for 2 layers, dim 64") && strstr(err.msg, "but the model has 2 layers, dim 48"), "%s", err.msg);
    for (int bits = 0; bits <= 17; bits++) {
        int ok = bits == 16 || bits == 8 || bits == 4 || bits == 3 || bits == 2;
        kv_err_clear(&err);
        cr_assert_eq(kv_fwd_set_lowrank(f, lr1, bits, &err), ok ? KV_OK : KV_EINVAL, "bits %d", bits);
        if (!ok) cr_assert(strstr(err.msg, "bits"), "%s", err.msg);
    }
    kv_fwd_free(f);
    kv_lr_free(lr), kv_lr_free(lr1);
    kv_model_close(m), kv_model_close(m2);
}

/* The quantize-dequantize of one latent row as the header describes it:
 * per token and unit, asymmetric codes 0 .. 2^bits − 1 with an fp16 zero
 * point (the row minimum) and an fp16 scale, z = q·scale + zero. */
static void fake_quant(float *z, int64_t r, int bits) {
    if (bits >= 16) return;
    float lo = z[0], hi = z[0], qmax = (float)((1 << bits) - 1);
    for (int64_t j = 1; j < r; j++) lo = fminf(lo, z[j]), hi = fmaxf(hi, z[j]);
    float zero = kv_f16_to_f32(kv_f32_to_f16(lo));
    float scale = kv_f16_to_f32(kv_f32_to_f16((hi - zero) / qmax));
    for (int64_t j = 0; j < r; j++) {
        float code = scale > 0 ? nearbyintf((z[j] - zero) / scale) : 0.0f;
        code = code < 0 ? 0 : (code > qmax ? qmax : code);
        z[j] = code * scale + zero;
    }
}

/* The plain forward with K and V replaced by their (quantized) latent
 * reconstructions: prerope k = RoPE(Q(x downᵀ + c) upᵀ), rotation
 * k = Q(k rotᵀ) rot, values v = Q(x downᵀ + c) upᵀ. */
struct qctx {
    const struct kv_model *m;
    const struct kv_lowrank *lr;
    int bits;
};

static void rope_row(const struct kv_config *c, float *p, int64_t pos) {
    int64_t dh = c->head_dim, half = dh / 2;
    for (int64_t i = 0; i < half; i++) {
        double ang = (double)pos * pow((double)c->rope_theta, -2.0 * (double)i / (double)dh);
        float cs = (float)cos(ang), sn = (float)sin(ang);
        int64_t a = c->rope_layout == KV_ROPE_HALF ? i : 2 * i;
        int64_t b = c->rope_layout == KV_ROPE_HALF ? i + half : 2 * i + 1;
        float x0 = p[a], x1 = p[b];
        p[a] = x0 * cs - x1 * sn;
        p[b] = x0 * sn + x1 * cs;
    }
}

static int q_replace(void *ctx, int64_t l, const float *x, float *k, float *v, int64_t n,
                     int64_t pos0) {
    struct qctx *Q = ctx;
    const struct kv_config *c = kv_model_config(Q->m);
    int64_t d = c->dim, dh = c->head_dim, kd = c->n_kv_heads * dh;
    float z[256];
    for (int side = 0; side < 2; side++) {
        const struct kv_lr_side *sd = side_of(Q->lr, l, side);
        float *out = side ? v : k;
        for (int64_t u = 0; u < sd->n_units; u++) {
            const struct kv_lr_unit *un = &sd->units[u];
            int64_t r = un->rank, mm = un->n_heads * dh;
            for (int64_t t = 0; t < n; t++) {
                float *row = out + t * kd + un->head0 * dh;
                if (sd->mode == KV_LR_POSTROPE_ROTATION) {
                    for (int64_t i = 0; i < r; i++) {
                        double acc = 0;
                        for (int64_t a = 0; a < dh; a++) acc += (double)un->rot[i * dh + a] * row[a];
                        z[i] = (float)acc;
                    }
                    fake_quant(z, r, Q->bits);
                    for (int64_t a = 0; a < dh; a++) {
                        double acc = 0;
                        for (int64_t i = 0; i < r; i++) acc += (double)un->rot[i * dh + a] * z[i];
                        row[a] = (float)acc;
                    }
                    continue;
                }
                for (int64_t i = 0; i < r; i++) {
                    double acc = un->down_bias ? un->down_bias[i] : 0;
                    for (int64_t j = 0; j < d; j++) acc += (double)un->down[i * d + j] * x[t * d + j];
                    z[i] = (float)acc;
                }
                fake_quant(z, r, Q->bits);
                for (int64_t a = 0; a < mm; a++) {
                    double acc = 0;
                    for (int64_t i = 0; i < r; i++) acc += (double)un->up[a * r + i] * z[i];
                    row[a] = (float)acc;
                }
                if (!side)
                    for (int64_t hh = 0; hh < un->n_heads; hh++) rope_row(c, row + hh * dh, pos0 + t);
            }
        }
    }
    return 0;
}

/* Quantized logits against their oracle: a code that flips because fp32
 * rounding put a latent on a rounding edge moves a few logits by one
 * quantization step (one such flip is about 1% of the 8-bit effect here), so
 * the comparison is in RMS: the mismatch must be below frac of the change the
 * quantization itself makes (got against the fp16 latents); a side left
 * unquantized, or the wrong bit width, is a mismatch of the order of the
 * effect. The worst element is printed. */
static void assert_small_beside(const float *got, const float *ref, const float *unquant, int64_t n,
                                double frac, const char *what) {
    double mis = 0, eff = 0, worst = -1;
    int64_t wi = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = (double)got[i] - ref[i], q = (double)got[i] - unquant[i];
        mis += e * e, eff += q * q;
        if (fabs(e) > worst) worst = fabs(e), wi = i;
    }
    mis = sqrt(mis / (double)n), eff = sqrt(eff / (double)n);
    cr_assert(mis <= frac * eff,
              "%s: rms mismatch %.3g > %g of the quantization effect %.3g; worst element %lld: got "
              "%.9g ref %.9g", what, mis, frac, eff, (long long)wi, (double)got[wi], (double)ref[wi]);
}

Test(latent_forward, quantized_latents_equal_the_dequantized_reconstruction, .timeout = 120) {
    struct {
        enum kv_rope_layout layout;
        int bias;
    } models[] = {{KV_ROPE_INTERLEAVED, 0}, {KV_ROPE_HALF, 1}};
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC, KV_METHOD_EIGEN};
    int bits[] = {16, 8, 4, 2};
    int64_t n = 48, V = 97;
    struct kv_err err;
    kv_err_clear(&err);
    for (size_t mi = 0; mi < 2; mi++) {
        struct kv_model *m = random_model(models[mi].layout, models[mi].bias, 91 + mi);
        int32_t *cal = random_tokens(3 * 64, V, 600 + mi), *tok = random_tokens(n, V, 700 + mi);
        struct kv_stats *s = collect(m, cal, 64, 3);
        for (int ci = 0; ci < 3; ci++) {
            struct kv_lowrank *lr =
                decompose_ok(m, s, opts_of(methods[ci], KV_ALLOC_DEFAULT, 0, 0.6, 1), "quantized");
            float *l16 = NULL, *prev = NULL; /* bits[0] is 16 */
            for (int bi = 0; bi < 4; bi++) {
                float *lat = run_logits(m, lr, bits[bi], tok, n);
                struct qctx Q = {m, lr, bits[bi]};
                struct kv_fwd_hooks hk = {0};
                hk.ctx = &Q, hk.kv_replace = q_replace;
                struct kv_fwd *f;
                cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
                kv_fwd_set_hooks(f, &hk);
                cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", fmt_err(&err));
                char what[128];
                snprintf(what, sizeof what, "%s kv_bits %d, %s rope%s: latent cache vs dequantized "
                         "reconstruction", kv_method_name(methods[ci]), bits[bi],
                         models[mi].layout ? "half" : "interleaved", models[mi].bias ? " + bias" : "");
                if (bits[bi] == 16)
                    kvt_assert_close_f32(lat, kv_fwd_logits(f), n * V, 1e-4 * max_abs_f32(lat, n * V),
                                         0, what);
                else /* a code may flip where fp32 rounding meets a rounding edge */
                    assert_small_beside(lat, kv_fwd_logits(f), l16, n * V, 0.15, what);
                /* each bit width changes the logits */
                if (prev)
                    cr_assert_gt(max_abs_diff_f32(lat, prev, n * V), 1e-6 * max_abs_f32(lat, n * V),
                                 "%s: same logits as the wider latents", what);
                if (prev != l16) free(prev);
                if (bits[bi] == 16) l16 = lat;
                prev = lat;
                kv_fwd_free(f);
            }
            if (prev != l16) free(prev);
            free(l16);
            kv_lr_free(lr);
        }
        free(cal), free(tok);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

/* Quantized latents: 8 bits barely move the logits, fewer bits move them
 * more (KL against the fp16-latent logits of the same factors). */
Test(latent_forward, quantized_latents_stay_close_and_fewer_bits_move_more, .timeout = 120) {
    struct shared sh = open_shared(0);
    int64_t V = kv_model_config(sh.m)->vocab_size;
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, CAL_WINDOWS);
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC};
    for (int mi = 0; mi < 2; mi++) {
        struct kv_lowrank *lr =
            decompose_ok(sh.m, s, opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1), "quantized");
        const int32_t *tok = sh.tok + EVAL_AT;
        float *l16 = run_logits(sh.m, lr, 16, tok, SEQ);
        float *l8 = run_logits(sh.m, lr, 8, tok, SEQ);
        float *l4 = run_logits(sh.m, lr, 4, tok, SEQ);
        float *l2 = run_logits(sh.m, lr, 2, tok, SEQ);
        double k8 = mean_kl(l16, l8, SEQ, V), k4 = mean_kl(l16, l4, SEQ, V);
        double k2 = mean_kl(l16, l2, SEQ, V);
        const char *nm = kv_method_name(methods[mi]);
        cr_assert_gt(k8, 0, "%s: 8-bit latents change nothing", nm);
        cr_assert_lt(k8, 2e-3, "%s: 8-bit latents move the logits by kl %g", nm, k8);
        cr_assert_lt(k8, k4, "%s: kl 8 bits %g, 4 bits %g", nm, k8, k4);
        cr_assert_lt(k4, k2, "%s: kl 4 bits %g, 2 bits %g", nm, k4, k2);
        /* the byte accounting: at rank 4, 8 bits cost as much as fp16 (the
         * codes plus an fp16 scale and zero point per unit and token) */
        cr_assert_leq(kv_lr_bytes(lr, 8), kv_lr_bytes(lr, 16));
        cr_assert_lt(kv_lr_bytes(lr, 2), kv_lr_bytes(lr, 8));
        cr_assert_eq(kv_lr_bytes(lr, 16), bytes_by_definition(lr, 16));
        cr_assert_eq(kv_lr_bytes(lr, 8), bytes_by_definition(lr, 8));
        cr_assert_eq(kv_lr_bytes(lr, 2), bytes_by_definition(lr, 2));
        free(l16), free(l8), free(l4), free(l2);
        kv_lr_free(lr);
    }
    kv_stats_free(s);
    shared_free(&sh);
}

/* ================================================================ allocation */

struct alloc_env {
    struct shared sh;
    struct kv_stats *s;
};

static struct alloc_env alloc_env_656K(void) {
    struct alloc_env e;
    e.sh = open_shared(1);
    e.s = collect(e.sh.m, e.sh.tok, SEQ, CAL_WINDOWS);
    return e;
}

static void alloc_env_free(struct alloc_env *e) {
    kv_stats_free(e->s);
    shared_free(&e->sh);
}

/* Ranks of every unit in slot order (layer, K units, V units). */
static int64_t unit_ranks(const struct kv_lowrank *lr, int64_t *out) {
    int64_t n = 0;
    for (int64_t l = 0; l < lr->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            for (int64_t u = 0; u < sd->n_units; u++) out[n++] = sd->units[u].rank;
        }
    return n;
}

/* Smallest rank the options allow (min_rank, then rounded up to rank_multiple,
 * at most the width). */
static int64_t admissible(int64_t r, int64_t min_rank, int64_t mult, int64_t width) {
    if (r < min_rank) r = min_rank;
    r = (r + mult - 1) / mult * mult;
    return r < width ? r : width;
}

/* With --ratio R the target is T = round(R·base) bytes. The byte count is a
 * step function of the allocation's parameter; a byte step of the search is
 * at most J, the bytes that one threshold adds:
 *   uniform  every unit of equal width moves at the same threshold, each by
 *            one rank-multiple step: J = Σ_units kv_lr_unit_bytes step
 *            = n_units · 2 · rank_multiple at 16 bits; the search returns the
 *            smallest count >= T, and the count below it is <= T − 1, so
 *            T <= bytes <= T − 1 + J;
 *   global   each greedy step lowers one slot (here one unit) by one
 *            rank-multiple step, J = 2 · rank_multiple; it stops at the first
 *            count <= T, the one before being >= T + 1, so T + 1 − J <= bytes <= T.
 * With |T − R·base| <= 1/2: |bytes/base − R| <= (J − 1/2)/base. */
Test(decompose_alloc, ratio_is_reached_within_one_rank_step, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t base = kv_lr_base_bytes(c), dh = c->head_dim;
    cr_assert_eq(base, c->n_layers * 2 * c->n_kv_heads * dh * 2);
    int64_t n_units = c->n_layers * 2 * c->n_kv_heads;
    enum kv_alloc allocs[] = {KV_ALLOC_UNIFORM, KV_ALLOC_GLOBAL};
    int64_t mults[] = {1, 4};
    double ratios[] = {0.3, 0.55, 0.7};
    for (int ai = 0; ai < 2; ai++)
        for (int mi = 0; mi < 2; mi++)
            for (int ri = 0; ri < 3; ri++) {
                double R = ratios[ri];
                int64_t mult = mults[mi], T = llround(R * (double)base);
                struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, allocs[ai], 0, R, 1);
                o.rank_multiple = mult;
                char what[96];
                snprintf(what, sizeof what, "%s ratio %g rank-multiple %lld", kv_alloc_name(allocs[ai]),
                         R, (long long)mult);
                struct kv_lowrank *lr = decompose_ok(e.sh.m, e.s, o, what);
                int64_t bytes = kv_lr_bytes(lr, 16);
                cr_assert_eq(bytes, bytes_by_definition(lr, 16), "%s", what);
                int64_t ranks[64], nr = unit_ranks(lr, ranks);
                cr_assert_eq(nr, n_units);
                for (int64_t i = 0; i < nr; i++)
                    cr_assert(ranks[i] % mult == 0 || ranks[i] == dh, "%s: rank %lld", what,
                              (long long)ranks[i]);
                int64_t J;
                if (allocs[ai] == KV_ALLOC_UNIFORM) {
                    J = n_units * 2 * mult;
                    cr_assert(bytes >= T && bytes <= T - 1 + J, "%s: %lld bytes, target %lld, J %lld",
                              what, (long long)bytes, (long long)T, (long long)J);
                    /* exactly: the smallest admissible common rank reaching T */
                    int64_t r = admissible(1, 1, mult, dh);
                    while (n_units * 2 * r < T && r < dh) r = admissible(r + 1, 1, mult, dh);
                    for (int64_t i = 0; i < nr; i++)
                        cr_assert_eq(ranks[i], r, "%s: unit %lld rank %lld, expected %lld", what,
                                     (long long)i, (long long)ranks[i], (long long)r);
                } else {
                    J = 2 * mult;
                    cr_assert(bytes <= T && bytes >= T + 1 - J, "%s: %lld bytes, target %lld, J %lld",
                              what, (long long)bytes, (long long)T, (long long)J);
                }
                double achieved = (double)bytes / (double)base;
                cr_assert_leq(fabs(achieved - R), ((double)J - 0.5) / (double)base,
                              "%s: achieved %g", what, achieved);
                kv_lr_free(lr);
            }
    alloc_env_free(&e);
}

/* eps: each unit keeps at least eps of its output energy, with the smallest
 * rank that does (palu: the allocation spectrum is the reported metric). */
static void check_eps(const struct kv_model *m, const struct kv_stats *s, double eps,
                      const char *model) {
    const struct kv_config *c = kv_model_config(m);
    int64_t dh = c->head_dim;
    struct kv_lowrank *lr = decompose_ok(m, s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, eps, 0, 1), "eps");
    int64_t compressed = 0;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                double *C = out_cov_naive(s, m, l, side, un->head0, 1), *lam = eigvals(C, dh);
                double tot = sum_from(lam, dh, 0), r = (double)un->rank;
                double kept = tot - sum_from(lam, dh, un->rank);
                cr_assert_geq(kept, eps * tot * (1 - 1e-12), "%s eps %g: layer %lld %s unit %lld keeps "
                              "%.9g of %.9g", model, eps, (long long)l, side ? "v" : "k", (long long)u,
                              kept / tot, eps);
                if (un->rank > 1)
                    cr_assert_lt(tot - sum_from(lam, dh, un->rank - 1), eps * tot * (1 + 1e-12),
                                 "%s eps %g: layer %lld %s unit %lld: rank %g is not the smallest",
                                 model, eps, (long long)l, side ? "v" : "k", (long long)u, r);
                cr_assert_geq(1 - un->dropped / un->energy, eps - 1e-9, "%s: reported kept %.9g < eps %g",
                              model, 1 - un->dropped / un->energy, eps);
                double want = sum_from(lam, dh, un->rank);
                kvt_assert_close_f64(&un->dropped, &want, 1, 1e-10 * tot, 1e-7, "eps dropped");
                compressed += un->rank < dh;
                free(C), free(lam);
            }
        }
    cr_assert_gt(compressed, 0, "%s eps %g compresses nothing", model, eps);
    kv_lr_free(lr);
}

Test(decompose_alloc, eps_keeps_the_energy_with_the_smallest_rank, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    check_eps(e.sh.m, e.s, 0.8, "656K");
    check_eps(e.sh.m, e.s, 0.95, "656K");
    alloc_env_free(&e);
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 61);
    int32_t *tok = random_tokens(3 * 64, 97, 62);
    struct kv_stats *s = collect(m, tok, 64, 3);
    check_eps(m, s, 0.9, "random + bias");
    kv_stats_free(s);
    free(tok);
    kv_model_close(m);
}

/* The allocation Gram of a removal unit, built here from the sums and weights:
 * fdc/zack keys Σ_{i→j} q_rope_i + k_rope_j, fdc values the output covariance,
 * zack values C_v + Σ_{i→j} W_O,i W_O,iᵀ. */
static double *removal_gram(const struct kv_model *m, const struct kv_stats *s,
                            enum kv_method method, int64_t l, int side, int64_t j) {
    const struct kv_config *c = kv_model_config(m);
    int64_t dh = c->head_dim, n2 = dh * dh, grp = c->n_heads / c->n_kv_heads, d = c->dim;
    int64_t qd = c->n_heads * dh;
    if (side == 0) {
        double *G = malloc((size_t)n2 * sizeof *G);
        for (int64_t i = 0; i < n2; i++) G[i] = s->layers[l].k_cov[j * n2 + i];
        for (int64_t qh = j * grp; qh < (j + 1) * grp; qh++)
            for (int64_t i = 0; i < n2; i++) G[i] += s->layers[l].q_cov[qh * n2 + i];
        return G;
    }
    double *G = out_cov_naive(s, m, l, 1, j, 1);
    if (method == KV_METHOD_ZACK) {
        const float *wo = m->layers[l].w[KV_W_O]; /* [d, h*d_h] */
        for (int64_t qh = j * grp; qh < (j + 1) * grp; qh++)
            for (int64_t a = 0; a < dh; a++)
                for (int64_t b = 0; b < dh; b++) {
                    double acc = 0;
                    for (int64_t r = 0; r < d; r++)
                        acc += (double)wo[r * qd + qh * dh + a] * wo[r * qd + qh * dh + b];
                    G[a * dh + b] += acc;
                }
    }
    return G;
}

/* ZACK eq. 6 / FDC eq. 1: with singular values σ (√ of the Gram's eigenvalues)
 * and tail(k) = Σ_{i>=k} σ_i, a unit of rank r under removal rate ρ satisfies
 * tail(r) <= ρ·tail(0) and, when r > 1, tail(r−1) > ρ·tail(0). One global ρ
 * must fit every unit: the intersection [max lo, min hi) is not empty. */
static void removal_interval(const struct kv_model *m, const struct kv_stats *s,
                             enum kv_method method, const struct kv_lowrank *lr, double *lo_out,
                             double *hi_out) {
    const struct kv_config *c = kv_model_config(m);
    int64_t dh = c->head_dim;
    double lo = 0, hi = INFINITY;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                cr_assert_eq(un->n_heads, 1);
                double *G = removal_gram(m, s, method, l, side, un->head0), *lam = eigvals(G, dh);
                for (int64_t i = 0; i < dh; i++) lam[i] = sqrt(lam[i]);
                double tot = sum_from(lam, dh, 0);
                lo = fmax(lo, sum_from(lam, dh, un->rank) / tot);
                if (un->rank > 1) hi = fmin(hi, sum_from(lam, dh, un->rank - 1) / tot);
                free(G), free(lam);
            }
        }
    *lo_out = lo, *hi_out = hi;
}

Test(decompose_alloc, removal_ranks_follow_one_rate_by_zack_eq6, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    enum kv_method methods[] = {KV_METHOD_FDC, KV_METHOD_ZACK};
    double ratios[] = {0.35, 0.6};
    for (int mi = 0; mi < 2; mi++)
        for (int ri = 0; ri < 2; ri++) {
            struct kv_lowrank *lr = decompose_ok(
                e.sh.m, e.s, opts_of(methods[mi], KV_ALLOC_REMOVAL, 0, ratios[ri], 1), "removal");
            double lo, hi;
            removal_interval(e.sh.m, e.s, methods[mi], lr, &lo, &hi);
            cr_assert_leq(lo, hi + 1e-9, "%s ratio %g: no single removal rate fits every unit "
                          "(needs rho >= %.12g and < %.12g)", kv_method_name(methods[mi]), ratios[ri], lo, hi);
            int64_t ranks[64], nr = unit_ranks(lr, ranks), differ = 0;
            for (int64_t i = 1; i < nr; i++) differ += ranks[i] != ranks[0];
            cr_assert_gt(differ, 0, "%s: removal gave every unit the same rank", kv_method_name(methods[mi]));
            cr_assert_geq(kv_lr_bytes(lr, 16),
                          llround(ratios[ri] * (double)kv_lr_base_bytes(c)));
            kv_lr_free(lr);
        }
    alloc_env_free(&e);
}

/* The header promises o.param is "the searched parameter (eps, fraction,
 * removal rate, ...)": for removal it must be a rate that fits every unit. */
Test(decompose_alloc, removal_param_is_the_removal_rate, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    struct kv_decompose_opts o = opts_of(KV_METHOD_FDC, KV_ALLOC_REMOVAL, 0, 0.35, 1);
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(e.sh.m, e.s, &o, &lr, &err), KV_OK, "%s", fmt_err(&err));
    double lo, hi;
    removal_interval(e.sh.m, e.s, KV_METHOD_FDC, lr, &lo, &hi);
    cr_assert(o.param >= lo - 1e-9 && o.param <= hi + 1e-9,
              "param %.9g is not a removal rate that gives these ranks (the rate is in [%.9g, %.9g]; "
              "1 - param = %.9g)", o.param, lo, hi, 1 - o.param);
    kv_lr_free(lr);
    alloc_env_free(&e);
}

Test(decompose_alloc, fisher_gives_larger_scores_larger_ranks, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t n_slots = c->n_layers * 2 * c->n_kv_heads, dh = c->head_dim; /* palu group 1 */
    double f[64];
    cr_assert(n_slots <= 64);
    for (int64_t i = 0; i < n_slots; i++) f[i] = 1.0 + (double)((i * 7) % n_slots);
    struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0.5, 1);
    o.fisher = f;
    struct kv_lowrank *lr = decompose_ok(e.sh.m, e.s, o, "fisher");
    struct kv_lowrank *lu =
        decompose_ok(e.sh.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, 1), "uniform");
    int64_t rf[64], ru[64];
    cr_assert_eq(unit_ranks(lr, rf), n_slots);
    cr_assert_eq(unit_ranks(lu, ru), n_slots);
    int64_t differ = 0;
    for (int64_t a = 0; a < n_slots; a++) {
        differ += rf[a] != ru[a];
        cr_assert(rf[a] >= 1 && rf[a] <= dh);
        for (int64_t b = 0; b < n_slots; b++)
            if (f[a] > f[b])
                cr_assert_geq(rf[a], rf[b], "slot %lld (score %g) has rank %lld < slot %lld (score %g) "
                              "rank %lld", (long long)a, f[a], (long long)rf[a], (long long)b, f[b],
                              (long long)rf[b]);
    }
    cr_assert_gt(differ, 0, "fisher ranks equal uniform ranks");
    int64_t lo = rf[0], hi = rf[0];
    for (int64_t a = 0; a < n_slots; a++) lo = rf[a] < lo ? rf[a] : lo, hi = rf[a] > hi ? rf[a] : hi;
    cr_assert_geq(hi - lo, dh / 2, "fisher ranks span only %lld..%lld", (long long)lo, (long long)hi);
    int64_t T = llround(0.5 * (double)kv_lr_base_bytes(c)), bytes = kv_lr_bytes(lr, 16);
    cr_assert(bytes >= T && bytes <= T + 2 * n_slots, "fisher: %lld bytes for target %lld",
              (long long)bytes, (long long)T);
    kv_lr_free(lr), kv_lr_free(lu);
    alloc_env_free(&e);
}

/* Fisher rows of e.s: per layer and side, a value per KV head (rows of a
 * head share it, times a small per-row ripple), far apart between heads. */
static void set_fisher_rows(struct kv_stats *s) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t windows = s->windows;
    s->windows = 0; /* the library adds fisher sums only before the first window */
    cr_assert_eq(kv_stats_add_fisher(s, &err), KV_OK, "%s", fmt_err(&err));
    s->windows = windows;
    int64_t dh = s->head_dim;
    for (int64_t l = 0; l < s->n_layers; l++)
        for (int64_t r = 0; r < s->n_kv_heads * dh; r++) {
            double head = (double)(1 + (l * 5 + r / dh * 3) % 7);
            s->layers[l].fisher_k[r] = head * head * head * (1.0 + 0.01 * (double)(r % dh));
            s->layers[l].fisher_v[r] = head * (1.0 + 0.02 * (double)(r % dh));
        }
}

/* Σ of fisher_k (side 0) or fisher_v over KV heads h0 .. h0+nh-1 of layer l. */
static double fisher_rows(const struct kv_stats *s, int64_t l, int side, int64_t h0, int64_t nh) {
    const double *f = side ? s->layers[l].fisher_v : s->layers[l].fisher_k;
    double t = 0;
    for (int64_t r = h0 * s->head_dim; r < (h0 + nh) * s->head_dim; r++) t += f[r];
    return t;
}

/* With Fisher statistics, --alloc fisher (and global's weighting) reads each
 * slot's score as the sum of its heads' rows: the same ranks as those
 * scores given explicitly, and not the ranks without them. */
Test(decompose_alloc, fisher_scores_from_stats_are_row_sums_of_the_units, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t g = c->n_kv_heads, L = c->n_layers;
    /* global before the stats have fisher: unweighted */
    struct kv_lowrank *gu =
        decompose_ok(e.sh.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.5, 1), "global");
    struct kv_decompose_opts nofisher = opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0.5, 1);
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(e.sh.m, e.s, &nofisher, &lr, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--alloc fisher needs fisher statistics (blk.N.fisher.k/v), which "
                              "this stats file does not have");
    set_fisher_rows(e.s);
    /* palu with units of 1 and 2 heads, eigen (one K slot of every head, one V
     * slot of g units): slot order is layer, K slots, V slots */
    struct { enum kv_method method; int64_t group; } cases[] = {
        {KV_METHOD_PALU, 1}, {KV_METHOD_PALU, 2}, {KV_METHOD_EIGEN, 1}};
    for (int ci = 0; ci < 3; ci++) {
        double f[64];
        int64_t ns = 0, grp = cases[ci].method == KV_METHOD_EIGEN ? g : cases[ci].group;
        for (int64_t l = 0; l < L; l++)
            for (int side = 0; side < 2; side++)
                for (int64_t h0 = 0; h0 < g; h0 += grp) f[ns++] = fisher_rows(e.s, l, side, h0, grp);
        cr_assert(ns <= 64);
        char what[64];
        snprintf(what, sizeof what, "%s group %lld", kv_method_name(cases[ci].method),
                 (long long)cases[ci].group);
        struct kv_decompose_opts o = opts_of(cases[ci].method, KV_ALLOC_FISHER, 0, 0.5, cases[ci].group);
        struct kv_lowrank *from_stats = decompose_ok(e.sh.m, e.s, o, what);
        o.fisher = f;
        struct kv_lowrank *given = decompose_ok(e.sh.m, e.s, o, what);
        struct kv_lowrank *uni = decompose_ok(
            e.sh.m, e.s, opts_of(cases[ci].method, KV_ALLOC_UNIFORM, 0, 0.5, cases[ci].group), what);
        int64_t ra[64], rb[64], rc[64];
        int64_t n = unit_ranks(from_stats, ra);
        cr_assert_eq(unit_ranks(given, rb), n);
        cr_assert_eq(unit_ranks(uni, rc), n);
        int64_t differ = 0;
        for (int64_t u = 0; u < n; u++) {
            cr_assert_eq(ra[u], rb[u], "%s: unit %lld has rank %lld from the stats, %lld from the "
                         "scores", what, (long long)u, (long long)ra[u], (long long)rb[u]);
            differ += ra[u] != rc[u];
        }
        cr_assert_gt(differ, 0, "%s: fisher ranks equal uniform ranks", what);
        kv_lr_free(from_stats), kv_lr_free(given), kv_lr_free(uni);
    }
    /* global weights by the same scores */
    double f[64];
    int64_t ns = 0;
    for (int64_t l = 0; l < L; l++)
        for (int side = 0; side < 2; side++)
            for (int64_t h = 0; h < g; h++) f[ns++] = fisher_rows(e.s, l, side, h, 1);
    struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.5, 1);
    struct kv_lowrank *gs = decompose_ok(e.sh.m, e.s, o, "global with fisher");
    o.fisher = f;
    struct kv_lowrank *gg = decompose_ok(e.sh.m, e.s, o, "global with scores");
    int64_t ra[64], rb[64], rc[64];
    int64_t n = unit_ranks(gs, ra);
    cr_assert_eq(unit_ranks(gg, rb), n);
    cr_assert_eq(unit_ranks(gu, rc), n);
    int64_t differ = 0;
    for (int64_t u = 0; u < n; u++) {
        cr_assert_eq(ra[u], rb[u], "global: unit %lld has rank %lld from the stats, %lld from the "
                     "scores", (long long)u, (long long)ra[u], (long long)rb[u]);
        differ += ra[u] != rc[u];
    }
    cr_assert_gt(differ, 0, "global ranks ignore the fisher statistics");
    kv_lr_free(gs), kv_lr_free(gg), kv_lr_free(gu);
    alloc_env_free(&e);
}

/* LoRC eqs. 12–13 recomputed from the singular values of W_k and W_v:
 * log κ^cum_l = Σ_{j>=l} (log κ(W_k^j) + log κ(W_v^j)),
 * d_c^l = d_min + (d_max − d_min)·(log κ^cum_l − min)/(max − min),
 * rank = round(d_c^l · g·d_h). Layers whose log10 κ^cum exceeds --cond-skip
 * stay full. */
static double *lorc_logcond(const struct kv_model *m) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, d = c->dim, kd = c->n_kv_heads * c->head_dim, k = kd < d ? kd : d;
    double *lc = calloc((size_t)L, sizeof *lc), *w = malloc((size_t)(kd * d) * sizeof *w);
    double *u = malloc((size_t)(kd * k) * sizeof *u), *sv = malloc((size_t)k * sizeof *sv);
    double *vt = malloc((size_t)(k * d) * sizeof *vt);
    struct kv_err err;
    kv_err_clear(&err);
    for (int64_t l = 0; l < L; l++)
        for (int side = 0; side < 2; side++) {
            const float *W = m->layers[l].w[side ? KV_W_V : KV_W_K];
            for (int64_t i = 0; i < kd * d; i++) w[i] = W[i];
            cr_assert_eq(kv_la_svd(w, kd, d, u, sv, vt, "test weight", &err), KV_OK, "%s", fmt_err(&err));
            cr_assert_gt(sv[k - 1], 0);
            lc[l] += log(sv[0] / sv[k - 1]);
        }
    for (int64_t l = L - 2; l >= 0; l--) lc[l] += lc[l + 1];
    free(w), free(u), free(sv), free(vt);
    return lc;
}

static void check_lorc(const struct kv_model *m, double d_min, double d_max, double cond_skip,
                       const char *model) {
    const struct kv_config *c = kv_model_config(m);
    int64_t L = c->n_layers, kd = c->n_kv_heads * c->head_dim;
    double *lc = lorc_logcond(m), mx = -INFINITY, mn = INFINITY;
    for (int64_t l = 0; l < L; l++) mx = fmax(mx, lc[l]), mn = fmin(mn, lc[l]);
    struct kv_decompose_opts o = opts_of(KV_METHOD_LORC, KV_ALLOC_PROGRESSIVE, 0, 0, 1);
    o.d_min = d_min, o.d_max = d_max, o.cond_skip = cond_skip;
    struct kv_lowrank *lr = decompose_ok(m, NULL, o, "lorc");
    int64_t prev = INT64_MAX, skipped = 0;
    for (int64_t l = 0; l < L; l++) {
        double frac = d_min + (d_max - d_min) * (lc[l] - mn) / (mx - mn);
        int64_t want = admissible(llround(frac * (double)kd), 1, 1, kd);
        int skip = cond_skip > 0 && lc[l] / log(10.0) > cond_skip;
        skipped += skip;
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            if (skip) {
                cr_assert_eq(sd->mode, KV_LR_FULL, "%s: layer %lld (log10 κ %g > %g) is not full", model,
                             (long long)l, lc[l] / log(10.0), cond_skip);
                continue;
            }
            cr_assert_eq(sd->mode, side ? KV_LR_FUSED_OUTPUT : KV_LR_PREROPE_LATENT);
            cr_assert_eq(sd->n_units, 1, "lorc: one joint unit per layer side");
            cr_assert_eq(sd->units[0].n_heads, c->n_kv_heads);
            cr_assert_eq(sd->units[0].rank, want,
                         "%s d_min %g d_max %g: layer %lld %s rank %lld, eq. 13 gives %lld (%.4f·%lld)",
                         model, d_min, d_max, (long long)l, side ? "v" : "k",
                         (long long)sd->units[0].rank, (long long)want, frac, (long long)kd);
        }
        if (!skip) {
            /* shallow layers carry the larger cumulative condition number */
            cr_assert_leq(want, prev, "%s: rank grows with depth at layer %lld", model, (long long)l);
            prev = want;
        }
    }
    if (cond_skip > 0) cr_assert_gt(skipped, 0, "%s: --cond-skip %g skips nothing", model, cond_skip);
    kv_lr_free(lr);
    free(lc);
}

Test(decompose_alloc, progressive_matches_lorc_eq13, .timeout = 120) {
    struct shared s260 = open_shared(0);
    check_lorc(s260.m, 0.25, 0.9, 0, "stories260K");
    check_lorc(s260.m, 0.5, 1.0, 0, "stories260K");
    /* --cond-skip between layer 0 and layer 1 keeps layer 0 full */
    double *lc = lorc_logcond(s260.m);
    check_lorc(s260.m, 0.25, 0.9, 0.5 * (lc[0] + lc[1]) / log(10.0), "stories260K cond-skip");
    free(lc);
    /* --ratio searches d_min: the bytes reach the target, ranks still fall with depth */
    const struct kv_config *c = kv_model_config(s260.m);
    struct kv_lowrank *lr =
        decompose_ok(s260.m, NULL, opts_of(KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0.5, 1), "lorc ratio");
    int64_t T = llround(0.5 * (double)kv_lr_base_bytes(c));
    cr_assert_geq(kv_lr_bytes(lr, 16), T);
    cr_assert_leq(kv_lr_bytes(lr, 16), T + 2 * 2 * c->n_layers);
    for (int64_t l = 1; l < c->n_layers; l++)
        cr_assert_leq(lr->layers[l].k.units[0].rank, lr->layers[l - 1].k.units[0].rank);
    cr_assert_lt(lr->layers[c->n_layers - 1].k.units[0].rank, lr->layers[0].k.units[0].rank);
    kv_lr_free(lr);
    shared_free(&s260);
    struct shared s656 = open_shared(1);
    check_lorc(s656.m, 0.3, 1.0, 0, "656K");
    shared_free(&s656);
}

/* global with --eps: the mean relative error over units stays within 1 − eps,
 * and (every step costs the same bytes here) no single further rank step
 * would fit. */
Test(decompose_alloc, global_eps_stops_at_the_mean_error_budget, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t dh = c->head_dim;
    double epss[] = {0.9, 0.97};
    for (int ei = 0; ei < 2; ei++) {
        double eps = epss[ei];
        struct kv_lowrank *lr =
            decompose_ok(e.sh.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_GLOBAL, eps, 0, 1), "global eps");
        double rel[64], next[64], mean = 0;
        int64_t nu = 0, compressed = 0;
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                const struct kv_lr_side *sd = side_of(lr, l, side);
                for (int64_t u = 0; u < sd->n_units; u++) {
                    const struct kv_lr_unit *un = &sd->units[u];
                    double *C = out_cov_naive(e.s, e.sh.m, l, side, un->head0, 1), *lam = eigvals(C, dh);
                    double tot = sum_from(lam, dh, 0);
                    rel[nu] = sum_from(lam, dh, un->rank) / tot;
                    next[nu] = un->rank > 1 ? lam[un->rank - 1] / tot : INFINITY;
                    kvt_assert_close_f64(&rel[nu], &(double){un->dropped / un->energy}, 1, 1e-12, 1e-7,
                                         "global unit relative error");
                    compressed += un->rank < dh;
                    mean += rel[nu];
                    nu++;
                    free(C), free(lam);
                }
            }
        mean /= (double)nu;
        cr_assert_gt(compressed, 0, "global eps %g compresses nothing", eps);
        cr_assert_leq(mean, 1 - eps + 1e-12, "global eps %g: mean relative error %.9g", eps, mean);
        for (int64_t i = 0; i < nu; i++)
            cr_assert_gt(mean + next[i] / (double)nu, 1 - eps - 1e-12,
                         "global eps %g: unit %lld could drop one more rank (mean %.9g + %.9g)", eps,
                         (long long)i, mean, next[i] / (double)nu);
        kv_lr_free(lr);
    }
    alloc_env_free(&e);
}

/* Every allocation honours --rank-multiple (a multiple, or the full width) and
 * --min-rank (never below, unless the width is smaller). stories260K has
 * d_h 8, so a multiple of 3 cannot reach the width. */
Test(decompose_alloc, rank_multiple_and_min_rank_hold_for_every_allocation, .timeout = 120) {
    struct shared sh = open_shared(0);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, 2);
    int64_t dh = kv_model_config(sh.m)->head_dim;
    struct {
        enum kv_method method;
        enum kv_alloc alloc;
        double eps, ratio;
        int64_t group;
    } cases[] = {
        {KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.8, 1}, {KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0, 0.8, 1},
        {KV_METHOD_PALU, KV_ALLOC_EPS, 0.9, 0, 1},     {KV_METHOD_PALU, KV_ALLOC_EPS, 0, 0.8, 2},
        {KV_METHOD_EIGEN, KV_ALLOC_EPS, 0, 0.8, 1},    {KV_METHOD_FDC, KV_ALLOC_REMOVAL, 0, 0.8, 1},
        {KV_METHOD_ZACK, KV_ALLOC_REMOVAL, 0, 0.8, 1}, {KV_METHOD_SVD, KV_ALLOC_GLOBAL, 0.8, 0, 1},
        {KV_METHOD_LORC, KV_ALLOC_PROGRESSIVE, 0, 0.8, 1},
    };
    /* ratios low enough that the admissible ranks ({3, 6, 8}, {5..8}, {6, 8},
     * {4, 8}) leave something to compress, at or above each floor */
    struct {
        int64_t mult, min_rank;
        double ratio;
    } rules[] = {{3, 1, 0.6}, {1, 5, 0.7}, {2, 5, 0.75}, {4, 3, 0.5}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ri = 0; ri < sizeof rules / sizeof rules[0]; ri++) {
            struct kv_decompose_opts o = opts_of(cases[ci].method, cases[ci].alloc, cases[ci].eps,
                                                 cases[ci].ratio > 0 ? rules[ri].ratio : 0,
                                                 cases[ci].group);
            o.rank_multiple = rules[ri].mult, o.min_rank = rules[ri].min_rank;
            char what[128];
            snprintf(what, sizeof what, "%s %s group %lld, rank-multiple %lld min-rank %lld",
                     kv_method_name(cases[ci].method), kv_alloc_name(cases[ci].alloc),
                     (long long)cases[ci].group, (long long)rules[ri].mult, (long long)rules[ri].min_rank);
            struct kv_lowrank *lr = decompose_ok(sh.m, s, o, what);
            int64_t reduced = 0;
            for (int64_t l = 0; l < lr->n_layers; l++)
                for (int side = 0; side < 2; side++) {
                    const struct kv_lr_side *sd = side_of(lr, l, side);
                    for (int64_t u = 0; u < sd->n_units; u++) {
                        const struct kv_lr_unit *un = &sd->units[u];
                        int64_t wdt = unit_width(sd, un, dh), r = un->rank;
                        int64_t floor = admissible(rules[ri].min_rank, rules[ri].min_rank, rules[ri].mult, wdt);
                        cr_assert(r % rules[ri].mult == 0 || r == wdt, "%s: rank %lld of %lld", what,
                                  (long long)r, (long long)wdt);
                        cr_assert(r >= floor, "%s: rank %lld below the floor %lld", what, (long long)r,
                                  (long long)floor);
                        reduced += r < wdt;
                    }
                }
            cr_assert_gt(reduced, 0, "%s: nothing is compressed", what);
            kv_lr_free(lr);
        }
    kv_stats_free(s);
    shared_free(&sh);
}

/* Eigen Attention (§4.3, eq. 5): one key basis per layer shared by every KV
 * head, the top eigenvectors of Σ_i C_q,i + Σ_j C_k,j (pre-RoPE), with the
 * smallest rank keeping eps of that spectrum; values get a basis per head
 * and one rank per layer, the largest energy rank over the heads' C_v,j. */
Test(decompose_alloc, eigen_shares_the_qk_key_basis_and_one_value_rank, .timeout = 120) {
    struct shared sh = open_shared(0);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, 2);
    const struct kv_config *c = kv_model_config(sh.m);
    int64_t dh = c->head_dim, g = c->n_kv_heads, n2 = dh * dh;
    double epss[] = {0.8, 0.95};
    for (int ei = 0; ei < 2; ei++) {
        double eps = epss[ei];
        struct kv_lowrank *lr =
            decompose_ok(sh.m, s, opts_of(KV_METHOD_EIGEN, KV_ALLOC_DEFAULT, eps, 0, 1), "eigen");
        int64_t compressed = 0;
        for (int64_t l = 0; l < c->n_layers; l++) {
            double *G = calloc((size_t)n2, sizeof *G);
            for (int64_t i = 0; i < c->n_heads; i++) {
                double *C = out_cov_naive(s, sh.m, l, 2, i, 1);
                for (int64_t e = 0; e < n2; e++) G[e] += C[e];
                free(C);
            }
            for (int64_t j = 0; j < g; j++) {
                double *C = out_cov_naive(s, sh.m, l, 0, j, 1);
                for (int64_t e = 0; e < n2; e++) G[e] += C[e];
                free(C);
            }
            double *lam = eigvals(G, dh), tot = sum_from(lam, dh, 0);
            const struct kv_lr_side *k = &lr->layers[l].k;
            cr_assert_eq(k->n_units, g);
            int64_t r = k->units[0].rank;
            compressed += r < dh;
            cr_assert_geq(tot - sum_from(lam, dh, r), eps * tot * (1 - 1e-12),
                          "eigen eps %g layer %lld: key rank %lld keeps too little", eps, (long long)l,
                          (long long)r);
            if (r > 1)
                cr_assert_lt(tot - sum_from(lam, dh, r - 1), eps * tot * (1 + 1e-12),
                             "eigen eps %g layer %lld: key rank %lld is not the smallest", eps,
                             (long long)l, (long long)r);
            /* the shared basis U (= up, orthonormal) captures the top-r energy
             * of G: tr(Uᵀ G U) = λ_1 + .. + λ_r */
            const float *U = k->units[0].up;
            double cap = 0;
            for (int64_t i = 0; i < r; i++)
                for (int64_t a = 0; a < dh; a++)
                    for (int64_t b = 0; b < dh; b++) cap += (double)U[a * r + i] * G[a * dh + b] * U[b * r + i];
            double top = tot - sum_from(lam, dh, r);
            kvt_assert_close_f64(&cap, &top, 1, 0, 1e-5, "eigen shared key basis captures the top of C_q + C_k");
            for (int64_t j = 1; j < g; j++) {
                cr_assert_eq(k->units[j].rank, r);
                kvt_assert_close_f32(k->units[j].up, U, dh * r, 0, 0, "every head shares the key basis");
            }
            /* values: one rank, the largest per-head energy rank */
            const struct kv_lr_side *v = &lr->layers[l].v;
            int64_t want = 0;
            for (int64_t j = 0; j < g; j++) {
                double *C = out_cov_naive(s, sh.m, l, 1, j, 1), *lv = eigvals(C, dh);
                double tv = sum_from(lv, dh, 0);
                int64_t rj = 1;
                while (rj < dh && tv - sum_from(lv, dh, rj) < eps * tv) rj++;
                want = rj > want ? rj : want;
                free(C), free(lv);
            }
            for (int64_t j = 0; j < g; j++)
                cr_assert_eq(v->units[j].rank, want, "eigen eps %g layer %lld v head %lld: rank %lld, "
                             "expected %lld", eps, (long long)l, (long long)j,
                             (long long)v->units[j].rank, (long long)want);
            free(G), free(lam);
        }
        cr_assert_gt(compressed, 0, "eigen eps %g compresses no key", eps);
        kv_lr_free(lr);
    }
    kv_stats_free(s);
    shared_free(&sh);
}

/* Orthonormal block Sylvester matrix of size r, written from its definition:
 * blocks of b = the largest power of two dividing r, H_ij = ±1/√b with the
 * sign (−1)^popcount(i & j). */
static double *sylvester(int64_t r) {
    int64_t b = 1;
    while (r % (2 * b) == 0) b *= 2;
    double *H = calloc((size_t)(r * r), sizeof *H);
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < r; j++) {
            if (i / b != j / b) continue;
            int64_t x = (i % b) & (j % b), par = 0;
            while (x) par ^= x & 1, x >>= 1;
            H[i * r + j] = (par ? -1.0 : 1.0) / sqrt((double)b);
        }
    return H;
}

/* --hadamard rotates every basis by H (orthonormal): down' = Hᵀ down,
 * up' = up H, rot' = Hᵀ rot. The products, and so the fp16-latent PPL, are
 * unchanged while the factors differ. */
Test(decompose_alloc, hadamard_changes_the_factors_not_the_ppl, .timeout = 120) {
    struct alloc_env e = alloc_env_656K();
    const struct kv_config *c = kv_model_config(e.sh.m);
    int64_t d = c->dim, dh = c->head_dim;
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC, KV_METHOD_EIGEN};
    for (int mi = 0; mi < 3; mi++) {
        struct kv_decompose_opts o = opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1);
        o.rank_multiple = 2; /* even ranks: H is not the identity */
        struct kv_lowrank *plain = decompose_ok(e.sh.m, e.s, o, "plain");
        o.hadamard = 1;
        struct kv_lowrank *had = decompose_ok(e.sh.m, e.s, o, "hadamard");
        cr_assert_eq(had->hadamard, 1);
        const char *nm = kv_method_name(methods[mi]);
        int64_t differ = 0;
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                const struct kv_lr_side *a = side_of(plain, l, side), *b = side_of(had, l, side);
                cr_assert_eq(a->n_units, b->n_units);
                for (int64_t u = 0; u < a->n_units; u++) {
                    const struct kv_lr_unit *ua = &a->units[u], *ub = &b->units[u];
                    int64_t r = ua->rank;
                    cr_assert_eq(ub->rank, r);
                    double *H = sylvester(r);
                    int rot = a->mode == KV_LR_POSTROPE_ROTATION;
                    int64_t cols = rot ? dh : d;
                    const float *fa = rot ? ua->rot : ua->down, *fb = rot ? ub->rot : ub->down;
                    /* fb = Hᵀ fa, row by row */
                    double *want = calloc((size_t)(r * cols), sizeof *want);
                    double *got = malloc((size_t)(r * cols) * sizeof *got), dmax = 0, mx = 0;
                    for (int64_t k = 0; k < r; k++)
                        for (int64_t j = 0; j < cols; j++) {
                            for (int64_t i = 0; i < r; i++) want[k * cols + j] += H[i * r + k] * fa[i * cols + j];
                            got[k * cols + j] = fb[k * cols + j];
                            dmax = fmax(dmax, fabs(got[k * cols + j] - fa[k * cols + j]));
                            mx = fmax(mx, fabs(want[k * cols + j]));
                        }
                    char what[96];
                    snprintf(what, sizeof what, "%s layer %lld %s unit %lld: factor = Hᵀ·plain", nm,
                             (long long)l, side ? "v" : "k", (long long)u);
                    kvt_assert_close_f64(got, want, r * cols, 1e-5 * mx, 0, what);
                    differ += dmax > 1e-3 * mx;
                    if (!rot) { /* up' = up H */
                        int64_t mm = ua->n_heads * dh;
                        double *wu = calloc((size_t)(mm * r), sizeof *wu), *gu = malloc((size_t)(mm * r) * sizeof *gu);
                        for (int64_t a2 = 0; a2 < mm; a2++)
                            for (int64_t k = 0; k < r; k++) {
                                for (int64_t i = 0; i < r; i++) wu[a2 * r + k] += ua->up[a2 * r + i] * H[i * r + k];
                                gu[a2 * r + k] = ub->up[a2 * r + k];
                            }
                        kvt_assert_close_f64(gu, wu, mm * r, 1e-6, 0, "up = up·H");
                        free(wu), free(gu);
                    }
                    free(want), free(got), free(H);
                }
            }
        cr_assert_gt(differ, 0, "%s: --hadamard leaves every factor as it was", nm);
        struct kv_compare_result ra, rb;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_ppl_compare(e.sh.m, plain, 16, e.sh.tok + EVAL_AT, 2 * SEQ, SEQ, 0, NULL, NULL,
                                    &ra, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(kv_ppl_compare(e.sh.m, had, 16, e.sh.tok + EVAL_AT, 2 * SEQ, SEQ, 0, NULL, NULL,
                                    &rb, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_gt(fabs(ra.comp.ppl - ra.base.ppl), 1e-4 * ra.base.ppl, "%s: compression has no effect", nm);
        char what[64];
        snprintf(what, sizeof what, "%s: ppl with --hadamard", nm);
        kvt_assert_close_f64(&rb.comp.ppl, &ra.comp.ppl, 1, 0, 1e-5, what);
        kv_lr_free(plain), kv_lr_free(had);
    }
    alloc_env_free(&e);
}

/* ================================================================ options */

/* GQA 8/4 so that a group size can fail to divide g. */
static struct kv_config opts_cfg(void) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    c.n_heads = 8, c.n_kv_heads = 4;
    return c;
}

struct opts_env {
    struct kv_model *m;
    struct kv_stats *s;
};

static struct opts_env opts_env(void) {
    struct opts_env e;
    e.m = random_model_cfg(opts_cfg(), 71);
    int32_t *tok = random_tokens(2 * 64, 97, 72);
    e.s = collect(e.m, tok, 64, 2);
    free(tok);
    return e;
}

static void opts_env_free(struct opts_env *e) {
    kv_stats_free(e->s);
    kv_model_close(e->m);
}

/* kv_decompose must fail with code, a message containing each of the
 * NULL-terminated needles, and no result. */
static void expect_refusal(const struct kv_model *m, const struct kv_stats *s,
                           struct kv_decompose_opts o, int code, const char *what, ...) {
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_decompose(m, s, &o, &lr, &err);
    cr_assert_eq(rc, code, "%s: status %s (%s), expected %s", what, kv_status_name(rc), err.msg,
                 kv_status_name(code));
    cr_assert_eq(err.code, code, "%s: err.code", what);
    cr_assert_null(lr, "%s: a result came back with the error", what);
    va_list ap;
    va_start(ap, what);
    for (const char *needle; (needle = va_arg(ap, const char *));)
        cr_assert(strstr(err.msg, needle), "%s: message '%s' does not contain '%s'", what, err.msg,
                  needle);
    va_end(ap);
}

Test(decompose_opts, rejects_eps_outside_the_unit_interval) {
    struct opts_env e = opts_env();
    double bad[] = {-0.1, -1, 1.0000001, 1.5, 7};
    for (int i = 0; i < 5; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, bad[i], 0, 1), KV_EINVAL, "eps",
                       "--eps", "(0, 1]", NULL);
    /* the edges of the interval are accepted */
    kv_lr_free(decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, 1.0, 0, 1), "eps 1"));
    kv_lr_free(decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, 1e-9, 0, 1), "eps tiny"));
    opts_env_free(&e);
}

Test(decompose_opts, rejects_ratio_outside_the_unit_interval) {
    struct opts_env e = opts_env();
    double bad[] = {-0.2, -1, 1.01, 2};
    for (int i = 0; i < 4; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, bad[i], 1), KV_EINVAL,
                       "ratio", "--ratio", "(0, 1]", NULL);
    kv_lr_free(decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 1.0, 1), "ratio 1"));
    opts_env_free(&e);
}

/* NaN is outside (0, 1] too; the library must not take it for "not given". */
Test(decompose_opts, rejects_nan_eps_and_ratio) {
    struct opts_env e = opts_env();
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_DEFAULT, NAN, 0.5, 1), KV_EINVAL,
                   "nan eps with a ratio", "--eps", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, 0.9, NAN, 1), KV_EINVAL,
                   "nan ratio with an eps", "--ratio", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, NAN, 1), KV_EINVAL,
                   "nan ratio", "--ratio", "outside", NULL);
    opts_env_free(&e);
}

Test(decompose_opts, rejects_eps_together_with_ratio) {
    struct opts_env e = opts_env();
    enum kv_alloc allocs[] = {KV_ALLOC_DEFAULT, KV_ALLOC_EPS, KV_ALLOC_GLOBAL};
    for (int i = 0; i < 3; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, allocs[i], 0.9, 0.5, 1), KV_EINVAL,
                       "eps and ratio", "--eps", "--ratio", NULL);
    opts_env_free(&e);
}

/* The smallest cache: every unit at max(min_rank, 1) rounded up to the rank
 * multiple, fp16. A ratio below it is refused naming it; the floor itself is
 * accepted. */
Test(decompose_opts, rejects_a_ratio_below_the_floor_naming_the_floor) {
    struct opts_env e = opts_env();
    const struct kv_config *c = kv_model_config(e.m);
    int64_t base = kv_lr_base_bytes(c), dh = c->head_dim;
    struct {
        int64_t group, min_rank, mult;
    } cases[] = {{1, 1, 1}, {1, 3, 1}, {1, 1, 4}, {2, 3, 2}, {4, 5, 1}};
    for (int i = 0; i < 5; i++) {
        int64_t units = c->n_layers * 2 * (c->n_kv_heads / cases[i].group);
        int64_t r = admissible(cases[i].min_rank, cases[i].min_rank, cases[i].mult, cases[i].group * dh);
        double floor = (double)(units * 2 * r) / (double)base;
        char fl[32], what[64];
        snprintf(fl, sizeof fl, "%.4f", floor);
        snprintf(what, sizeof what, "floor %s", fl);
        struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, floor * 0.9, cases[i].group);
        o.min_rank = cases[i].min_rank, o.rank_multiple = cases[i].mult;
        expect_refusal(e.m, e.s, o, KV_EINVAL, what, "--ratio", fl, NULL);
        o.ratio = floor;
        struct kv_lowrank *lr = decompose_ok(e.m, e.s, o, what);
        cr_assert_eq(kv_lr_bytes(lr, 16), units * 2 * r, "%s: the floor itself", what);
        kv_lr_free(lr);
    }
    opts_env_free(&e);
}

Test(decompose_opts, rejects_a_group_size_that_does_not_divide_the_kv_heads) {
    struct opts_env e = opts_env(); /* g = 4 */
    int64_t bad[] = {3, 5, 8, -1};
    for (int i = 0; i < 4; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, bad[i]), KV_EINVAL,
                       "group size", "--group-size", NULL);
    int64_t good[] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        struct kv_lowrank *lr =
            decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, good[i]), "group");
        cr_assert_eq(lr->layers[0].k.n_units, 4 / good[i]);
        cr_assert_eq(lr->layers[0].k.units[0].n_heads, good[i]);
        kv_lr_free(lr);
    }
    opts_env_free(&e);
}

Test(decompose_opts, rejects_fisher_without_scores) {
    struct opts_env e = opts_env();
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0.5, 1), KV_EINVAL, "fisher",
                   "fisher", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0, 1), KV_EINVAL,
                   "fisher without a ratio", "--ratio", NULL);
    opts_env_free(&e);
}

Test(decompose_opts, rejects_data_methods_without_statistics) {
    struct opts_env e = opts_env();
    enum kv_method need[] = {KV_METHOD_PALU, KV_METHOD_EIGEN, KV_METHOD_FDC, KV_METHOD_ZACK};
    for (int i = 0; i < 4; i++)
        expect_refusal(e.m, NULL, opts_of(need[i], KV_ALLOC_DEFAULT, 0, 0.5, 1), KV_EINVAL,
                       kv_method_name(need[i]), kv_method_name(need[i]), "--stats", NULL);
    /* svd and lorc work from the weights alone */
    kv_lr_free(decompose_ok(e.m, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1), "svd"));
    kv_lr_free(decompose_ok(e.m, NULL, opts_of(KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0.5, 1), "lorc"));
    opts_env_free(&e);
}

Test(decompose_opts, rejects_statistics_of_another_model) {
    struct opts_env e = opts_env();
    struct kv_config shapes[3];
    for (int i = 0; i < 3; i++) shapes[i] = opts_cfg();
    shapes[0].dim = 64;
    shapes[1].n_layers = 3;
    shapes[2].n_heads = 4, shapes[2].n_kv_heads = 2, shapes[2].head_dim = 12;
    for (int i = 0; i < 3; i++) {
        struct kv_model *other = random_model_cfg(shapes[i], 73 + i);
        int32_t *tok = random_tokens(64, 97, 80 + i);
        struct kv_stats *s2 = collect(other, tok, 64, 1);
        enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_SVD};
        for (int mi = 0; mi < 2; mi++)
            expect_refusal(e.m, s2, opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1), KV_EINVAL,
                           "stats of another shape", "statistics", NULL);
        kv_stats_free(s2);
        free(tok);
        kv_model_close(other);
    }
    opts_env_free(&e);
}

Test(decompose_opts, rejects_bad_kv_bits_and_allocation_mismatches) {
    struct opts_env e = opts_env();
    struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, 1);
    o.kv_bits = 5;
    expect_refusal(e.m, e.s, o, KV_EINVAL, "kv bits", "--kv-bits", NULL);
    o = opts_of(KV_METHOD_LORC, KV_ALLOC_PROGRESSIVE, 0.9, 0, 1);
    o.d_min = 0.3;
    expect_refusal(e.m, e.s, o, KV_EINVAL, "eps with progressive", "--eps", "progressive", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_FDC, KV_ALLOC_REMOVAL, 0, 0, 1), KV_EINVAL,
                   "removal without ratio", "--ratio", NULL);
    opts_env_free(&e);
}
