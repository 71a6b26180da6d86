/* Reference forward pass for every architecture (fp32 activations).
 *
 * One pass serves every architecture: the differences (norm, positions,
 * MLP) come from its row of the architecture table (arch.h) and from which
 * weights the model binds (biases absent from an architecture are NULL and
 * add nothing).
 *
 * One call runs n tokens at positions pos0.. against a per-layer KV cache.
 * Every projection is one OpenBLAS sgemm over the whole window; attention is
 * a pair of sgemms per (head, block of query rows), parallel over OpenMP.
 *
 * Shapes (row-major): x, xn [n, d]; q [n, h*d_h]; k/v cache [max_ctx, g*d_h]
 * per layer; att [n, h*d_h]; ffn a, b [n, hidden]; logits [n, vocab]. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "act.h"
#include "arch.h"
#include "err.h"
#include "limits.h"
#include "lrmodel.h"
#include "mlamodel.h"
#include "model.h"

#define QBLOCK 128 /* query rows per attention block */
#define HEAD_ROWS 4096 /* rows of a streamed head converted at a time */
/* The FFN runs on at most this many bytes of hidden activations per block of
 * rows (one block, as before, for every model whose window fits) */
#define FFN_BYTES ((int64_t)32 << 20)

/* Where attention reads and writes, per query head i: scores use
 * q[:, qoff[i] .. +kw[i]] · k[:, koff[i] .. +kw[i]]ᵀ, the output
 * o[:, ooff[i] .. +vw[i]] = softmax · v[:, voff[i] .. +vw[i]]. The full path
 * has kw = vw = d_h; the latent paths read latents (width = unit rank). */
struct attn_desc {
    int64_t ldq, ldk, ldv, ldo;
    int64_t *qoff, *koff, *kw, *voff, *vw, *ooff; /* [n_heads] each */
    int64_t qw_total, o_total;                    /* widths of the q and o rows */
};

struct lr_plan {
    struct attn_desc desc;
    int64_t zkw, zvw;     /* latent row widths (0 when that side is full) */
    int64_t zk_at, zv_at; /* offsets of this layer's caches */
    int64_t *kunit_off, *vunit_off; /* latent column of each unit */
};

struct kv_fwd {
    const struct kv_model *m;
    const struct kv_arch_desc *arch;
    int64_t max_ctx;
    struct kv_fwd_hooks hooks;
    float *x, *xn, *q, *att, *a, *b, *logits;
    float *xn2;             /* [max_ctx][d] the MLP's normed input (parallel residual only) */
    float *y;               /* [max_ctx][d] attention output for the attn_out hook */
    float *kc, *vc;         /* [L][max_ctx][g*d_h] */
    int one_window;         /* kv_fwd_one_window: every layer uses layer 0's caches */
    int defer_head;         /* kv_fwd_defer_head: runs stop at the final norm */
    int64_t ffn_rows;       /* rows per FFN block: a and b hold [ffn_rows][hidden] */
    int64_t last_n;         /* positions of the last run (0 before one) */
    float *rope_cos, *rope_sin; /* [max_ctx][d_h/2], rotary architectures only */
    float *scores;          /* [threads][QBLOCK][max_ctx] */
    float *head_buf;        /* [HEAD_ROWS][d] a streamed model's head, converted in slices */
    const float *last_logits; /* where the last run wrote its logits */
    int n_threads;
    struct attn_desc *base_desc; /* full K/V attention (every layer alike) */
    /* latent cache (kv_fwd_set_lowrank) */
    const struct kv_lowrank *lr;
    int kv_bits;
    struct lr_plan *plan;   /* [n_layers] */
    float *zk, *zv;         /* latent caches, layer l at plan[l].zk_at / zv_at */
    float *kfull;           /* [max_ctx][g*d_h] reconstructed or fresh keys */
    float *qrot;            /* [max_ctx][Σ_i r(i)] rotated or fused queries */
    float *attl;            /* [max_ctx][o_cols] latent attention outputs */
    /* multi-head latent attention (kv_fwd_set_mla) */
    const struct kv_mla *mla;
    struct attn_desc *mla_desc;
    float *mc;              /* [L][max_ctx][d_c + R]: the normed latent, then the roped key */
    float *mq, *mqa, *mo;   /* [max_ctx][H*(n+R)], [max_ctx][H*(d_c+R)], [max_ctx][H*d_c] */
    float *mcos, *msin;     /* [max_ctx][R/2] at the MLA's own base */
};

void kv_set_threads(int n) {
    if (n <= 0) return;
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

static void desc_free(struct attn_desc *d) {
    if (d) free(d->qoff);
}

static void mla_free(struct kv_fwd *f) {
    if (f->mla_desc) desc_free(f->mla_desc);
    free(f->mla_desc), free(f->mc), free(f->mq), free(f->mqa), free(f->mo), free(f->mcos), free(f->msin);
    f->mla_desc = NULL, f->mc = f->mq = f->mqa = f->mo = f->mcos = f->msin = NULL;
    f->mla = NULL;
}

static void plan_free(struct kv_fwd *f) {
    if (f->plan && f->lr)
        for (int64_t l = 0; l < f->lr->info.n_layers; l++) {
            desc_free(&f->plan[l].desc);
            free(f->plan[l].kunit_off), free(f->plan[l].vunit_off);
        }
    free(f->plan), free(f->zk), free(f->zv), free(f->kfull), free(f->qrot), free(f->attl);
    f->plan = NULL, f->zk = f->zv = f->kfull = f->qrot = f->attl = NULL;
    f->lr = NULL;
}

/* Allocate the six per-head arrays of d in one block. */
static int desc_alloc(struct attn_desc *d, int64_t h) {
    memset(d, 0, sizeof *d);
    int64_t *a = calloc((size_t)(6 * h), sizeof *a);
    if (!a) return -1;
    d->qoff = a, d->koff = a + h, d->kw = a + 2 * h, d->voff = a + 3 * h, d->vw = a + 4 * h;
    d->ooff = a + 5 * h;
    return 0;
}

void kv_fwd_free(struct kv_fwd *f) {
    if (!f) return;
    plan_free(f);
    mla_free(f);
    if (f->base_desc) desc_free(f->base_desc);
    free(f->base_desc);
    free(f->x), free(f->xn), free(f->xn2), free(f->q), free(f->att), free(f->a), free(f->b);
    free(f->logits), free(f->y), free(f->kc), free(f->vc), free(f->rope_cos), free(f->rope_sin);
    free(f->scores);
    free(f->head_buf);
    free(f);
}

static float *falloc(int64_t n) { return malloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }

int kv_fwd_init(const struct kv_model *m, int64_t max_ctx, struct kv_fwd **out,
                struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    if (max_ctx <= 0 || max_ctx > KV_MAX_CTX)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "context length %lld is outside 1..%d",
                       (long long)max_ctx, KV_MAX_CTX);
    const struct kv_arch_desc *arch = kv_arch_desc(c->arch);
    if (!arch->rope && max_ctx > c->max_seq_len)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "context length %lld exceeds the %lld learned positions of this %s model",
                       (long long)max_ctx, (long long)c->max_seq_len, kv_arch_name(c->arch));
    if (arch->rope) {
        int rc = kv_rope_check_length(c, max_ctx, err);
        if (rc) return rc;
    }
    struct kv_fwd *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    f->m = m;
    f->arch = arch;
    f->max_ctx = max_ctx;
    f->n_threads = omp_get_max_threads();
    int64_t d = c->dim, qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    int64_t half = arch->rope ? kv_rope_dim(c) / 2 : 0;
    f->x = falloc(max_ctx * d);
    if (c->parallel_residual && !(f->xn2 = falloc(max_ctx * d))) {
        kv_fwd_free(f);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory for a forward state of %lld positions", (long long)max_ctx);
    }
    f->xn = falloc(max_ctx * d);
    f->q = falloc(max_ctx * qd);
    f->att = falloc(max_ctx * qd);
    f->ffn_rows = FFN_BYTES / ((int64_t)sizeof(float) * (c->hidden_dim > 0 ? c->hidden_dim : 1));
    if (f->ffn_rows < 1) f->ffn_rows = 1;
    if (f->ffn_rows >= max_ctx) f->ffn_rows = max_ctx;
    f->a = falloc(f->ffn_rows * c->hidden_dim);
    f->b = falloc(f->ffn_rows * c->hidden_dim);
    f->logits = falloc(max_ctx * c->vocab_size);
    f->y = falloc(max_ctx * d);
    f->kc = falloc(c->n_layers * max_ctx * kd);
    f->vc = falloc(c->n_layers * max_ctx * kd);
    f->rope_cos = falloc(max_ctx * half);
    f->rope_sin = falloc(max_ctx * half);
    f->scores = falloc((int64_t)f->n_threads * QBLOCK * max_ctx);
    if (!m->lm_head) f->head_buf = falloc((c->vocab_size < HEAD_ROWS ? c->vocab_size : HEAD_ROWS) * d);
    if (!f->x || !f->xn || !f->q || !f->att || !f->a || !f->b || !f->logits || !f->y || !f->kc ||
        !f->vc || !f->rope_cos || !f->rope_sin || !f->scores || (!m->lm_head && !f->head_buf)) {
        kv_fwd_free(f);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory for a forward state of %lld positions", (long long)max_ctx);
    }
    f->base_desc = malloc(sizeof *f->base_desc);
    if (!f->base_desc || desc_alloc(f->base_desc, c->n_heads)) {
        kv_fwd_free(f);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    {
        struct attn_desc *bd = f->base_desc;
        int64_t dh = c->head_dim, grp = c->n_heads / c->n_kv_heads;
        bd->ldq = bd->ldo = qd, bd->ldk = bd->ldv = kd;
        bd->qw_total = bd->o_total = qd;
        for (int64_t i = 0; i < c->n_heads; i++) {
            bd->qoff[i] = bd->ooff[i] = i * dh;
            bd->koff[i] = bd->voff[i] = (i / grp) * dh;
            bd->kw[i] = bd->vw[i] = dh;
        }
    }
    if (half) kv_rope_table(c, max_ctx, max_ctx, f->rope_cos, f->rope_sin);
    *out = f;
    return KV_OK;
}

void kv_fwd_set_hooks(struct kv_fwd *f, const struct kv_fwd_hooks *hooks) {
    if (hooks)
        f->hooks = *hooks;
    else
        memset(&f->hooks, 0, sizeof f->hooks);
}

const float *kv_fwd_logits(const struct kv_fwd *f) { return f->last_logits; }

/* out[i,:] = x[i,:] / rms(x[i,:]) * (off + w), accumulated in double (off:
 * Gemma's stored gains are the gain minus 1). */
static void rmsnorm(float *out, const float *x, const float *w, int64_t n, int64_t d, float eps,
                    float off) {
#pragma omp parallel for if (n * d > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d;
        double ss = 0;
        for (int64_t j = 0; j < d; j++) ss += (double)xi[j] * xi[j];
        float r = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
        float *o = out + i * d;
        for (int64_t j = 0; j < d; j++) o[j] = xi[j] * r * (off + w[j]);
    }
}

/* Y[n, out] (leading dim ldy) = X[n, in] · Wᵀ, W is [out, in] row-major. */
static void linear(float *y, int64_t ldy, const float *x, const float *w, int64_t n, int64_t in,
                   int64_t outd, float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)outd, (int)in, 1.0f, x,
                (int)in, w, (int)in, beta, y, (int)ldy);
}

static void add_bias(float *y, const float *bias, int64_t n, int64_t dd) {
    if (!bias) return;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < dd; j++) y[i * dd + j] += bias[j];
}

/* y[i,:] += r[i,:] for n rows of dd (both contiguous). */
static void add_rows(float *y, const float *r, int64_t n, int64_t dd) {
    for (int64_t i = 0; i < n * dd; i++) y[i] += r[i];
}

/* out[i,:] = (x[i,:] - mean) / sqrt(var + eps) * w + b (biased variance),
 * mean and variance accumulated in double. */
static void layernorm(float *out, const float *x, const float *w, const float *b, int64_t n,
                      int64_t d, float eps) {
#pragma omp parallel for if (n * d > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d;
        double s = 0, ss = 0;
        for (int64_t j = 0; j < d; j++) s += xi[j];
        double mean = s / (double)d;
        for (int64_t j = 0; j < d; j++) ss += ((double)xi[j] - mean) * ((double)xi[j] - mean);
        float mu = (float)mean, r = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
        float *o = out + i * d;
        for (int64_t j = 0; j < d; j++) o[j] = (xi[j] - mu) * r * w[j] + b[j];
    }
}

/* The architecture's norm of n rows: weight of kind wk, bias of kind bk
 * (layer l; global kinds ignore it). */
static void norm(const struct kv_fwd *f, float *out, const float *x, enum kv_wkind wk,
                 enum kv_wkind bk, int64_t l, int64_t n) {
    const struct kv_config *c = &f->m->cfg;
    const float *w = kv_model_weight(f->m, wk, l);
    if (f->arch->layernorm)
        layernorm(out, x, w, kv_model_weight(f->m, bk, l), n, c->dim, c->norm_eps);
    else
        rmsnorm(out, x, w, n, c->dim, c->norm_eps, c->norm_offset);
}

/* Qwen3's per-head RMSNorm of q or k (rows [n, nh*d_h], weight w [d_h]), in
 * place, before RoPE; nothing for an architecture without it (w NULL). */
static void head_norm(const struct kv_fwd *f, float *v, int64_t n, int64_t nh, const float *w) {
    if (!w) return;
    rmsnorm(v, v, w, n * nh, f->m->cfg.head_dim, f->m->cfg.norm_eps, 0.0f);
}

/* Rotate every head of rows [n, nh*d_h] at positions pos0.. (nothing for an
 * architecture without rope: its queries and keys are used as projected);
 * with partial rope, only each head's first kv_rope_dim dimensions. */
static void rope(const struct kv_fwd *f, float *v, int64_t n, int64_t nh, int64_t pos0) {
    if (!f->arch->rope) return;
    const struct kv_config *c = &f->m->cfg;
    int64_t dh = c->head_dim, half = kv_rope_dim(c) / 2;
    int interleaved = c->rope_layout == KV_ROPE_INTERLEAVED;
#pragma omp parallel for if (n * nh * dh > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *cs = f->rope_cos + (pos0 + i) * half, *sn = f->rope_sin + (pos0 + i) * half;
        for (int64_t hh = 0; hh < nh; hh++) {
            float *p = v + (i * nh + hh) * dh;
            for (int64_t j = 0; j < half; j++) {
                int64_t a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + half;
                float x0 = p[a], x1 = p[b];
                p[a] = x0 * cs[j] - x1 * sn[j];
                p[b] = x0 * sn[j] + x1 * cs[j];
            }
        }
    }
}

/* Causal attention of n query rows (positions pos0..) over cache rows
 * [0, pos0+n): for every query head, scores from q and k, softmax, and the
 * weighted sum of v, as laid out by desc (scale 1/sqrt(d_h) always). With
 * a sliding window win > 0 the row at position p sees keys p-win+1..p. */
static void attention(struct kv_fwd *f, const struct attn_desc *D, const float *qb,
                      const float *kb, const float *vb, float *ob, int64_t n, int64_t pos0,
                      int64_t win) {
    const struct kv_config *c = &f->m->cfg;
    int64_t h = c->n_heads;
    int64_t nblk = (n + QBLOCK - 1) / QBLOCK;
    float scale = kv_attn_scale(c), cap = c->attn_softcap;
    int64_t ld = f->max_ctx;
    /* scores has one slab per thread counted at init: never run more */
    int nt = omp_get_max_threads() < f->n_threads ? omp_get_max_threads() : f->n_threads;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nt)
    for (int64_t hh = 0; hh < h; hh++)
        for (int64_t bi = 0; bi < nblk; bi++) {
            float *S = f->scores + (int64_t)omp_get_thread_num() * QBLOCK * ld;
            int64_t r0 = bi * QBLOCK, nb = n - r0 < QBLOCK ? n - r0 : QBLOCK;
            int64_t kvlen = pos0 + r0 + nb; /* keys visible to the last row of the block */
            const float *Q = qb + r0 * D->ldq + D->qoff[hh];
            const float *K = kb + D->koff[hh], *V = vb + D->voff[hh];
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nb, (int)kvlen,
                        (int)D->kw[hh], scale, Q, (int)D->ldq, K, (int)D->ldk, 0.0f, S, (int)ld);
            for (int64_t i = 0; i < nb; i++) {
                float *s = S + i * ld;
                int64_t vis = pos0 + r0 + i + 1, lo = win > 0 && vis > win ? vis - win : 0;
                if (cap > 0) /* Gemma 2: cap · tanh(s / cap) */
                    for (int64_t j = lo; j < vis; j++) s[j] = cap * tanhf(s[j] / cap);
                float mx = s[lo];
                for (int64_t j = lo + 1; j < vis; j++) mx = s[j] > mx ? s[j] : mx;
                double sum = 0;
                for (int64_t j = lo; j < vis; j++) {
                    s[j] = expf(s[j] - mx);
                    sum += s[j];
                }
                float inv = (float)(1.0 / sum);
                for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
                for (int64_t j = lo; j < vis; j++) s[j] *= inv;
                for (int64_t j = vis; j < kvlen; j++) s[j] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nb, (int)D->vw[hh],
                        (int)kvlen, 1.0f, S, (int)ld, V, (int)D->ldv, 0.0f,
                        ob + r0 * D->ldo + D->ooff[hh], (int)D->ldo);
        }
}

/* Simulated per-token asymmetric quantization of latent columns
 * [off, off+r) of n rows (kv_lr_qparams, lrmodel.h): codes in 0 ..
 * 2^bits-1, an fp16 scale and an fp16 zero point (the row minimum) per
 * row, dequantized in place. */
static void quantize_rows(float *z, int64_t n, int64_t ld, int64_t off, int64_t r, int bits) {
    float qmax = kv_lr_qmax(bits);
    for (int64_t i = 0; i < n; i++) {
        float *p = z + i * ld + off, scale, zero;
        kv_lr_qparams(p, r, bits, &scale, &zero);
        for (int64_t j = 0; j < r; j++)
            p[j] = kv_lr_dequant(kv_lr_qcode(p[j], scale, zero, qmax), scale, zero);
    }
}

/* quantize_rows over unit un's columns [off, off+rank) band by band at
 * kv_bits (kv_lr_unit_bands; fp16 bands are left as they are). */
static void quantize_unit(float *z, int64_t n, int64_t ld, const struct kv_lr_unit *un, int kv_bits) {
    struct kv_lr_band b[KV_LR_MAX_BANDS];
    int nb = kv_lr_unit_bands(un, kv_bits, b);
    for (int i = 0, at = 0; i < nb; at += (int)b[i].n, i++)
        if (b[i].bits < 16) quantize_rows(z, n, ld, at, b[i].n, b[i].bits);
}

static int lr_alloc_fail(struct kv_fwd *f, struct kv_err *err) {
    plan_free(f);
    return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for the latent cache");
}

/* The unit of side s holding KV head j. */
static int64_t unit_of(const struct kv_lr_side *s, int64_t j) {
    for (int64_t u = 0; u < s->n_units; u++)
        if (j >= s->units[u].head0 && j < s->units[u].head0 + s->units[u].n_heads) return u;
    return -1;
}

void kv_fwd_one_window(struct kv_fwd *f) { f->one_window = 1; }

int kv_fwd_set_lowrank(struct kv_fwd *f, const struct kv_lowrank *lr, int kv_bits,
                       struct kv_err *err) {
    plan_free(f);
    if (!lr) return KV_OK;
    if (f->mla)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "a forward state runs a latent cache or MLA, not both");
    const struct kv_config *c = &f->m->cfg;
    if (!kv_shapes_match(c, lr->info.n_layers, lr->info.dim, lr->info.n_heads, lr->info.n_kv_heads, lr->info.head_dim,
                         "compressed attention factors", NULL, err))
        return KV_EINVAL;
    if (kv_bits != KV_LR_BITS_MIXED && !kv_lr_bits_valid(kv_bits))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "kv bits %d is not one of " KV_LR_BITS_LIST " or 0 (the units' own bands)",
                       kv_bits);
    if (kv_bits == KV_LR_BITS_MIXED && lr->info.kv_bits != KV_LR_BITS_MIXED)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "kv bits 0 (the units' own bands) needs a mixed-bit model; this one's "
                       "latents are %d bits",
                       lr->info.kv_bits);
    if (kv_bits == KV_LR_BITS_MIXED && kv_lr_check_all_bands(lr, NULL, err)) return KV_EINVAL;
    int64_t L = c->n_layers, h = c->n_heads, g = c->n_kv_heads, dh = c->head_dim;
    int64_t grp = h / g, qd = h * dh, kd = g * dh;
    f->lr = lr, f->kv_bits = kv_bits;
    if (!(f->plan = calloc((size_t)L, sizeof *f->plan))) return lr_alloc_fail(f, err);
    int64_t zk_tot = 0, zv_tot = 0, qrot_max = 0, ocols_max = 0;
    for (int64_t l = 0; l < L; l++) {
        const struct kv_lr_layer *Y = &lr->layers[l];
        struct lr_plan *P = &f->plan[l];
        struct attn_desc *D = &P->desc;
        if (desc_alloc(D, h)) return lr_alloc_fail(f, err);
        P->kunit_off = calloc((size_t)(Y->k.n_units + 1), sizeof(int64_t));
        P->vunit_off = calloc((size_t)(Y->v.n_units + 1), sizeof(int64_t));
        if (!P->kunit_off || !P->vunit_off) return lr_alloc_fail(f, err);
        for (int64_t u = 0; u < Y->k.n_units; u++) P->kunit_off[u + 1] = P->kunit_off[u] + Y->k.units[u].rank;
        for (int64_t u = 0; u < Y->v.n_units; u++) P->vunit_off[u + 1] = P->vunit_off[u] + Y->v.units[u].rank;
        P->zkw = Y->k.mode == KV_LR_FULL ? 0 : P->kunit_off[Y->k.n_units];
        P->zvw = Y->v.mode == KV_LR_FULL ? 0 : P->vunit_off[Y->v.n_units];
        P->zk_at = zk_tot, P->zv_at = zv_tot;
        zk_tot += P->zkw * f->max_ctx, zv_tot += P->zvw * f->max_ctx;
        /* fused_query folds up into W_q, exact only when nothing acts
         * between the key projection and the score (no rope) */
        if (Y->k.mode != KV_LR_FULL && Y->k.mode != KV_LR_PREROPE_LATENT &&
            Y->k.mode != KV_LR_POSTROPE_ROTATION &&
            !(Y->k.mode == KV_LR_FUSED_QUERY && !f->arch->rope)) {
            plan_free(f);
            return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                           "layer %lld: key mode %s is not supported for this architecture",
                           (long long)l, kv_lr_mode_name(Y->k.mode));
        }
        if (Y->v.mode != KV_LR_FULL && Y->v.mode != KV_LR_FUSED_OUTPUT) {
            plan_free(f);
            return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                           "layer %lld: value mode %s is not supported", (long long)l,
                           kv_lr_mode_name(Y->v.mode));
        }
        /* keys: full and prerope_latent score full post-RoPE q·k; rotation
         * and fused_query score a latent query against the latent cache */
        int rot = Y->k.mode == KV_LR_POSTROPE_ROTATION, fq = Y->k.mode == KV_LR_FUSED_QUERY;
        D->ldq = qd, D->ldk = kd, D->qw_total = qd;
        int64_t qo = 0, oo = 0;
        for (int64_t i = 0; i < h; i++) {
            int64_t j = i / grp;
            if (rot || fq) {
                int64_t u = unit_of(&Y->k, j);
                if (u < 0 || (rot && (Y->k.units[u].n_heads != 1 || !Y->k.units[u].rot))) {
                    plan_free(f);
                    return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                   "layer %lld: kv head %lld has no key %s unit", (long long)l,
                                   (long long)j, rot ? "rotation" : "latent");
                }
                D->qoff[i] = qo, D->koff[i] = P->kunit_off[u], D->kw[i] = Y->k.units[u].rank;
                qo += Y->k.units[u].rank;
            } else {
                if (Y->k.mode == KV_LR_PREROPE_LATENT && unit_of(&Y->k, j) < 0) {
                    plan_free(f);
                    return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                   "layer %lld: kv head %lld is in no key unit", (long long)l, (long long)j);
                }
                D->qoff[i] = i * dh, D->koff[i] = j * dh, D->kw[i] = dh;
            }
            if (Y->v.mode == KV_LR_FUSED_OUTPUT) {
                int64_t u = unit_of(&Y->v, j);
                if (u < 0 || !Y->o_fused) {
                    plan_free(f);
                    return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                   "layer %lld: kv head %lld is in no value unit", (long long)l,
                                   (long long)j);
                }
                D->voff[i] = P->vunit_off[u], D->vw[i] = Y->v.units[u].rank, D->ooff[i] = oo;
                oo += Y->v.units[u].rank;
            } else {
                D->voff[i] = j * dh, D->vw[i] = dh, D->ooff[i] = i * dh;
                oo += dh;
            }
        }
        if (fq && !Y->q_fused) {
            plan_free(f);
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "layer %lld: fused query keys have no fused query projection",
                           (long long)l);
        }
        if (fq && qo != Y->q_cols) {
            plan_free(f);
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "layer %lld: fused query has %lld rows, the units need %lld",
                           (long long)l, (long long)Y->q_cols, (long long)qo);
        }
        if (rot || fq) D->ldq = qo, D->qw_total = qo, D->ldk = P->zkw;
        if (Y->v.mode == KV_LR_FUSED_OUTPUT) {
            if (oo != Y->o_cols) {
                plan_free(f);
                return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "layer %lld: fused output has %lld columns, the units need %lld",
                               (long long)l, (long long)Y->o_cols, (long long)oo);
            }
            D->ldv = P->zvw, D->ldo = oo;
        } else {
            D->ldv = kd, D->ldo = qd;
        }
        D->o_total = oo;
        qrot_max = qo > qrot_max ? qo : qrot_max;
        ocols_max = oo > ocols_max ? oo : ocols_max;
    }
    f->zk = falloc(zk_tot), f->zv = falloc(zv_tot);
    f->kfull = falloc(f->max_ctx * kd);
    f->qrot = falloc(f->max_ctx * (qrot_max > 0 ? qrot_max : 1));
    f->attl = falloc(f->max_ctx * (ocols_max > 0 ? ocols_max : 1));
    if (!f->zk || !f->zv || !f->kfull || !f->qrot || !f->attl) return lr_alloc_fail(f, err);
    return KV_OK;
}

/* Latents of rows pos0.. of every unit of side S: z = xn downᵀ + down_bias
 * into columns unit_off[u].. of the cache zc (row width ld), quantized as
 * they enter it (quantize_unit). */
static void lr_latents(const struct kv_fwd *f, const struct kv_lr_side *S, float *zc, int64_t ld,
                       const int64_t *unit_off, int64_t n, int64_t pos0) {
    int64_t d = f->m->cfg.dim;
    for (int64_t u = 0; u < S->n_units; u++) {
        const struct kv_lr_unit *un = &S->units[u];
        float *z = zc + pos0 * ld + unit_off[u];
        linear(z, ld, f->xn, un->down, n, d, un->rank, 0.0f);
        if (un->down_bias)
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < un->rank; j++) z[i * ld + j] += un->down_bias[j];
        quantize_unit(z, n, ld, un, f->kv_bits);
    }
}

/* x += att Woᵀ (+ bias, when not NULL: centred values' mean) for the
 * attention rows att [n, cols] and the output projection wo [d, cols];
 * through f->y when the attn_out hook wants the block's output on its own. */
static int out_proj(struct kv_fwd *f, int64_t l, const float *att, const float *wo,
                    const float *bias, int64_t cols, int64_t n, int64_t pos0) {
    int64_t d = f->m->cfg.dim;
    const struct kv_fwd_hooks *hk = &f->hooks;
    if (!hk->attn_out && !f->arch->post_norms) {
        linear(f->x, d, att, wo, n, cols, d, 1.0f);
        add_bias(f->x, bias, n, d);
        return KV_OK;
    }
    linear(f->y, d, att, wo, n, cols, d, 0.0f);
    add_bias(f->y, bias, n, d);
    int rc = hk->attn_out ? hk->attn_out(hk->ctx, l, f->y, n, pos0) : KV_OK;
    if (rc) return rc;
    if (f->arch->post_norms) /* Gemma 2: the output normed before the residual add */
        norm(f, f->y, f->y, KV_W_POST_ATTN_NORM, KV_W_COUNT, l, n);
    add_rows(f->x, f->y, n, d);
    return KV_OK;
}

/* ---------------------------------------------------------------- MLA */

int64_t kv_mla_bytes(const struct kv_mla *mla) {
    return (mla->kv_lora_rank + mla->rope_dim) * 2 * mla->n_layers;
}

int kv_fwd_set_mla(struct kv_fwd *f, const struct kv_mla *mla, struct kv_err *err) {
    const struct kv_config *c = &f->m->cfg;
    if (f->lr)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "a forward state runs a latent cache or MLA, not both");
    if (mla->n_layers != c->n_layers || mla->n_heads != c->n_heads || mla->v_dim != c->head_dim ||
        !f->arch->rope || f->arch->layernorm || mla->rope_dim < 2 || mla->rope_dim % 2 ||
        mla->kv_lora_rank < 1 || mla->nope_dim < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "an MLA of %lld layers and %lld heads (values of %lld) is not this model's "
                       "attention (%lld layers, %lld heads of %lld)",
                       (long long)mla->n_layers, (long long)mla->n_heads, (long long)mla->v_dim,
                       (long long)c->n_layers, (long long)c->n_heads, (long long)c->head_dim);
    mla_free(f);
    int64_t T = f->max_ctx, H = mla->n_heads, dc = mla->kv_lora_rank, R = mla->rope_dim;
    int64_t w = dc + R, nq = H * (mla->nope_dim + R), L = f->one_window ? 1 : c->n_layers;
    f->mc = falloc(L * T * w);
    f->mq = falloc(T * nq);
    f->mqa = falloc(T * H * w);
    f->mo = falloc(T * H * dc);
    f->mcos = falloc(T * (R / 2));
    f->msin = falloc(T * (R / 2));
    f->mla_desc = malloc(sizeof *f->mla_desc);
    if (!f->mc || !f->mq || !f->mqa || !f->mo || !f->mcos || !f->msin || !f->mla_desc ||
        desc_alloc(f->mla_desc, H)) {
        mla_free(f);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for an MLA cache of %lld positions",
                       (long long)T);
    }
    /* every head scores its absorbed query against the one shared cache
     * row [c ; k_pe] and reads the latent c */
    struct attn_desc *D = f->mla_desc;
    D->ldq = H * w, D->ldk = D->ldv = w, D->ldo = H * dc;
    D->qw_total = H * w, D->o_total = H * dc;
    for (int64_t i = 0; i < H; i++) {
        D->qoff[i] = i * w, D->koff[i] = 0, D->kw[i] = w;
        D->voff[i] = 0, D->vw[i] = dc, D->ooff[i] = i * dc;
    }
    for (int64_t t = 0; t < T; t++) /* llama.cpp's NORM rope: pairs (2i, 2i+1), θ'^(-2i/R) */
        for (int64_t i = 0; i < R / 2; i++) {
            double ang = (double)t * pow((double)mla->rope_base, -2.0 * (double)i / (double)R);
            f->mcos[t * (R / 2) + i] = (float)cos(ang), f->msin[t * (R / 2) + i] = (float)sin(ang);
        }
    f->mla = mla;
    return KV_OK;
}

/* Rotate pairs (2i, 2i+1) of the R values at p by position t's angles. */
static void mla_rope(const struct kv_fwd *f, float *p, int64_t R, int64_t t) {
    const float *cs = f->mcos + t * (R / 2), *sn = f->msin + t * (R / 2);
    for (int64_t i = 0; i < R / 2; i++) {
        float x0 = p[2 * i], x1 = p[2 * i + 1];
        p[2 * i] = x0 * cs[i] - x1 * sn[i];
        p[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
    }
}

/* One layer's multi-head latent attention, as llama.cpp's deepseek2 graph
 * computes it (docs/design.md): x += W_o [W_UV,h softmax(...) c]. */
static int mla_attention(struct kv_fwd *f, int64_t l, int64_t n, int64_t pos0) {
    const struct kv_config *c = &f->m->cfg;
    const struct kv_mla *M = f->mla;
    const struct kv_mla_layer *Y = &M->layers[l];
    int64_t d = c->dim, H = M->n_heads, dc = M->kv_lora_rank, R = M->rope_dim, nn = M->nope_dim;
    int64_t vd = M->v_dim, w = dc + R, nq = H * (nn + R);
    float *cache = f->mc + (f->one_window ? 0 : l) * f->max_ctx * w, *kv = cache + pos0 * w;
    linear(f->mq, nq, f->xn, Y->wq, n, d, nq, 0.0f);
    linear(kv, w, f->xn, Y->wkv_a, n, d, w, 0.0f);
    /* the engine's score scale 1/sqrt(n + R), where attention() applies the model's */
    float qs = (float)(1.0 / sqrt((double)(nn + R))) / kv_attn_scale(c);
#pragma omp parallel for if (n * H * w > 65536) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *e = kv + i * w; /* the latent's RMSNorm, at the epsilon it was made for */
        double ss = 0;
        for (int64_t r = 0; r < dc; r++) ss += (double)e[r] * e[r];
        float inv = (float)(1.0 / sqrt(ss / (double)dc + (double)M->latent_eps));
        for (int64_t r = 0; r < dc; r++) e[r] = e[r] * inv * Y->kv_norm[r];
        mla_rope(f, e + dc, R, pos0 + i);
        for (int64_t h = 0; h < H; h++) { /* q^pe, roped, after each head's q̂ */
            float *q = f->mq + i * nq + h * (nn + R), *qa = f->mqa + i * H * w + h * w + dc;
            mla_rope(f, q + nn, R, pos0 + i);
            for (int64_t j = 0; j < R; j++) qa[j] = q[nn + j] * qs;
        }
    }
    /* q̂_h = W_UK,hᵀ q^nope_h for every row at once (wk_b[h] is [d_c][n]) */
    for (int64_t h = 0; h < H; h++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)dc, (int)nn, qs,
                    f->mq + h * (nn + R), (int)nq, Y->wk_b + h * dc * nn, (int)nn, 0.0f,
                    f->mqa + h * w, (int)(H * w));
    attention(f, f->mla_desc, f->mqa, cache, cache, f->mo, n, pos0, 0);
    /* each head's value W_UV,h o_h (wv_b[h] is [v][d_c]) into att [n, H*v] */
    for (int64_t h = 0; h < H; h++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)vd, (int)dc, 1.0f,
                    f->mo + h * dc, (int)(H * dc), Y->wv_b + h * vd * dc, (int)dc, 0.0f,
                    f->att + h * vd, (int)(H * vd));
    return out_proj(f, l, f->att, kv_model_layer(f->m, l)[KV_W_O], NULL, H * vd, n, pos0);
}

/* One layer's attention from the latent cache: x += attention output
 * (without the output projection's bias). */
static int lr_attention(struct kv_fwd *f, int64_t l, int64_t n, int64_t pos0) {
    const struct kv_config *c = &f->m->cfg;
    const float *const *w = kv_model_layer(f->m, l);
    const struct kv_lr_layer *Y = &f->lr->layers[l];
    const struct lr_plan *P = &f->plan[l];
    int64_t d = c->dim, g = c->n_kv_heads, dh = c->head_dim, h = c->n_heads;
    int64_t qd = h * dh, kd = g * dh, grp = h / g, T = pos0 + n;
    int64_t cl = f->one_window ? 0 : l;
    float *kc = f->kc + cl * f->max_ctx * kd, *vc = f->vc + cl * f->max_ctx * kd;
    float *zk = f->zk + (f->one_window ? 0 : P->zk_at), *zv = f->zv + (f->one_window ? 0 : P->zv_at);
    const float *qb = f->q, *kb = kc, *vb = vc;
    float *ob = f->att;

    /* queries: fused_query computes q' from xn directly, q is never formed */
    if (Y->k.mode == KV_LR_FUSED_QUERY) {
        linear(f->qrot, P->desc.ldq, f->xn, Y->q_fused, n, d, Y->q_cols, 0.0f);
        add_bias(f->qrot, Y->q_fused_bias, n, Y->q_cols);
    } else {
        linear(f->q, qd, f->xn, w[KV_W_Q], n, d, qd, 0.0f);
        add_bias(f->q, w[KV_W_BQ], n, qd);
        head_norm(f, f->q, n, h, w[KV_W_QNORM]);
        rope(f, f->q, n, h, pos0);
    }
    /* keys */
    if (Y->k.mode == KV_LR_FULL) {
        float *k = kc + pos0 * kd;
        linear(k, kd, f->xn, w[KV_W_K], n, d, kd, 0.0f);
        add_bias(k, w[KV_W_BK], n, kd);
        head_norm(f, k, n, g, w[KV_W_KNORM]);
        rope(f, k, n, g, pos0);
    } else if (Y->k.mode == KV_LR_PREROPE_LATENT) {
        lr_latents(f, &Y->k, zk, P->zkw, P->kunit_off, n, pos0);
        /* reconstruct every cached position, then RoPE: k = z upᵀ (+ the
         * calibration mean of centred factors) */
        for (int64_t u = 0; u < Y->k.n_units; u++) {
            const struct kv_lr_unit *un = &Y->k.units[u];
            int64_t w_u = un->n_heads * dh;
            float *kf = f->kfull + un->head0 * dh;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)w_u,
                        (int)un->rank, 1.0f, zk + P->kunit_off[u], (int)P->zkw, un->up,
                        (int)un->rank, 0.0f, kf, (int)kd);
            if (un->up_bias)
                for (int64_t t = 0; t < T; t++)
                    for (int64_t a = 0; a < w_u; a++) kf[t * kd + a] += un->up_bias[a];
        }
        head_norm(f, f->kfull, T, g, w[KV_W_KNORM]); /* the rebuilt key, normalised, then rotated */
        rope(f, f->kfull, T, g, 0);
        kb = f->kfull;
    } else if (Y->k.mode == KV_LR_FUSED_QUERY) { /* score q'·z, no reconstruction */
        lr_latents(f, &Y->k, zk, P->zkw, P->kunit_off, n, pos0);
        qb = f->qrot, kb = zk;
    } else { /* post-RoPE rotation: z = RoPE(k) rotᵀ, q' = q rotᵀ */
        float *k = f->kfull;
        linear(k, kd, f->xn, w[KV_W_K], n, d, kd, 0.0f);
        add_bias(k, w[KV_W_BK], n, kd);
        head_norm(f, k, n, g, w[KV_W_KNORM]);
        rope(f, k, n, g, pos0);
        for (int64_t u = 0; u < Y->k.n_units; u++) {
            const struct kv_lr_unit *un = &Y->k.units[u];
            float *z = zk + pos0 * P->zkw + P->kunit_off[u];
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)un->rank, (int)dh,
                        1.0f, k + un->head0 * dh, (int)kd, un->rot, (int)dh, 0.0f, z, (int)P->zkw);
            quantize_unit(z, n, P->zkw, un, f->kv_bits);
        }
        for (int64_t i = 0; i < h; i++) {
            const struct kv_lr_unit *un = &Y->k.units[unit_of(&Y->k, i / grp)];
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)un->rank, (int)dh,
                        1.0f, f->q + i * dh, (int)qd, un->rot, (int)dh, 0.0f,
                        f->qrot + P->desc.qoff[i], (int)P->desc.ldq);
        }
        qb = f->qrot, kb = zk;
    }
    /* values */
    if (Y->v.mode == KV_LR_FULL) {
        float *v = vc + pos0 * kd;
        linear(v, kd, f->xn, w[KV_W_V], n, d, kd, 0.0f);
        add_bias(v, w[KV_W_BV], n, kd);
    } else {
        lr_latents(f, &Y->v, zv, P->zvw, P->vunit_off, n, pos0);
        vb = zv, ob = f->attl;
    }
    attention(f, &P->desc, qb, kb, vb, ob, n, pos0, kv_layer_window(c, l));
    if (Y->v.mode == KV_LR_FULL) return out_proj(f, l, f->att, w[KV_W_O], NULL, qd, n, pos0);
    return out_proj(f, l, f->attl, Y->o_fused, Y->o_fused_bias, Y->o_cols, n, pos0);
}

/* logits [n, vocab] = xn headᵀ: the head as bound, or for a streamed model
 * converted HEAD_ROWS rows at a time into f->head_buf */
/* lg [n, vocab] = the head applied to normed rows xn [n, d] */
static void head(struct kv_fwd *f, const float *xn, float *lg, int64_t n) {
    const struct kv_model *m = f->m;
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, V = c->vocab_size;
    if (m->lm_head) {
        linear(lg, V, xn, m->lm_head, n, d, V, 0.0f);
    } else {
        for (int64_t r0 = 0; r0 < V; r0 += HEAD_ROWS) {
            int64_t nr = V - r0 < HEAD_ROWS ? V - r0 : HEAD_ROWS;
            kv_model_rows(m, KV_W_LM_HEAD, 0, r0, nr, f->head_buf);
            linear(lg + r0, V, xn, f->head_buf, n, d, nr, 0.0f);
        }
    }
    float cap = c->final_softcap;
    if (cap > 0) { /* Gemma 2: cap · tanh(logit / cap) */
#pragma omp parallel for if (n * V > 65536) schedule(static)
        for (int64_t i = 0; i < n * V; i++) lg[i] = cap * tanhf(lg[i] / cap);
    }
}

void kv_fwd_defer_head(struct kv_fwd *f) { f->defer_head = 1; }

int kv_fwd_head(struct kv_fwd *f, int64_t i0, int64_t n, float *logits, struct kv_err *err) {
    if (!f->defer_head || i0 < 0 || n <= 0 || i0 + n > f->last_n)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "no deferred head for positions %lld..%lld (the last run had %lld)",
                       (long long)i0, (long long)(i0 + n - 1), (long long)f->last_n);
    float *lg = logits ? logits : f->logits;
    head(f, f->xn + i0 * f->m->cfg.dim, lg, n);
    f->last_logits = lg;
    return KV_OK;
}

int kv_fwd_run(struct kv_fwd *f, const int32_t *tokens, int64_t n, int64_t pos0, float *logits,
               struct kv_err *err) {
    const struct kv_model *m = f->m;
    const struct kv_config *c = &m->cfg;
    if (n <= 0 || pos0 < 0 || pos0 + n > f->max_ctx)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "positions %lld..%lld exceed the context of %lld", (long long)pos0,
                       (long long)(pos0 + n - 1), (long long)f->max_ctx);
    f->last_n = 0;
    if (pos0 && f->one_window)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "this forward state keeps no cache between runs (kv_fwd_one_window); "
                       "a run must start at position 0, not %lld", (long long)pos0);
    int64_t d = c->dim, hid = c->hidden_dim, qd = c->n_heads * c->head_dim;
    int64_t kd = c->n_kv_heads * c->head_dim;
    for (int64_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "token id %d at position %lld is outside the vocabulary of %lld",
                           tokens[i], (long long)(pos0 + i), (long long)c->vocab_size);
        kv_model_rows(m, KV_W_TOK_EMB, 0, tokens[i], 1, f->x + i * d);
        if (f->arch->embed_scale) { /* Gemma: times sqrt(d), rounded to float as HF does */
            float s = (float)sqrt((double)d);
            for (int64_t j = 0; j < d; j++) f->x[i * d + j] *= s;
        }
    }
    if (kv_model_has(m, KV_W_POS_EMB, 0)) /* learned positions */
        add_rows(f->x, kv_model_weight(m, KV_W_POS_EMB, 0) + pos0 * d, n, d);
    const struct kv_fwd_hooks *hk = &f->hooks;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *w = kv_model_layer(m, l);
        int64_t cl = f->one_window ? 0 : l; /* which layer's cache slab */
        float *kc = f->kc + cl * f->max_ctx * kd, *vc = f->vc + cl * f->max_ctx * kd;
        float *k = kc + pos0 * kd, *v = vc + pos0 * kd;
        norm(f, f->xn, f->x, KV_W_ATTN_NORM, KV_W_ATTN_NORM_B, l, n);
        if (c->parallel_residual) /* the MLP reads the layer's input, not attention's output */
            norm(f, f->xn2, f->x, KV_W_FFN_NORM, KV_W_FFN_NORM_B, l, n);
        int rc;
        if (hk->attn_in && (rc = hk->attn_in(hk->ctx, l, f->xn, n, pos0))) return rc;
        if (hk->attn) {
            if ((rc = hk->attn(hk->ctx, l, f->xn, n, pos0, f->x))) return rc;
        } else if (f->lr) {
            if ((rc = lr_attention(f, l, n, pos0))) return rc;
        } else if (f->mla) {
            if ((rc = mla_attention(f, l, n, pos0))) return rc;
        } else {
            linear(f->q, qd, f->xn, w[KV_W_Q], n, d, qd, 0.0f);
            linear(k, kd, f->xn, w[KV_W_K], n, d, kd, 0.0f);
            linear(v, kd, f->xn, w[KV_W_V], n, d, kd, 0.0f);
            add_bias(f->q, w[KV_W_BQ], n, qd);
            add_bias(k, w[KV_W_BK], n, kd);
            add_bias(v, w[KV_W_BV], n, kd);
            head_norm(f, f->q, n, c->n_heads, w[KV_W_QNORM]);
            head_norm(f, k, n, c->n_kv_heads, w[KV_W_KNORM]);
            rope(f, f->q, n, c->n_heads, pos0);
            rope(f, k, n, c->n_kv_heads, pos0);
            if (hk->qk_rope && (rc = hk->qk_rope(hk->ctx, l, f->q, k, n, pos0))) return rc;
            if (hk->kv_replace && (rc = hk->kv_replace(hk->ctx, l, f->xn, k, v, n, pos0)))
                return rc;
            if (hk->hooks_only && l == c->n_layers - 1) {
                f->last_logits = NULL;
                return KV_OK;
            }
            attention(f, f->base_desc, f->q, kc, vc, f->att, n, pos0, kv_layer_window(c, l));
            if ((rc = out_proj(f, l, f->att, w[KV_W_O], NULL, qd, n, pos0))) return rc; /* x += att Woᵀ */
        }
        add_bias(f->x, w[KV_W_BO], n, d);
        const float *ffn_in = f->xn2; /* parallel residual: normed before attention */
        if (!c->parallel_residual) {
            norm(f, f->xn, f->x, KV_W_FFN_NORM, KV_W_FFN_NORM_B, l, n);
            ffn_in = f->xn;
        }
        float *a = f->a, *b = f->b;
        for (int64_t r0 = 0; r0 < n; r0 += f->ffn_rows) { /* blocks of rows: see FFN_BYTES */
            int64_t nr = n - r0 < f->ffn_rows ? n - r0 : f->ffn_rows, nh = nr * hid;
            const float *xn = ffn_in + r0 * d;
            if (f->arch->gelu_mlp) {
                linear(a, hid, xn, w[KV_W_UP], nr, d, hid, 0.0f);
                add_bias(a, w[KV_W_BUP], nr, hid);
                if (c->gelu_erf) {
#pragma omp parallel for if (nh > 65536) schedule(static)
                    for (int64_t i = 0; i < nh; i++) a[i] = kv_gelu_erf(a[i]);
                } else {
#pragma omp parallel for if (nh > 65536) schedule(static)
                    for (int64_t i = 0; i < nh; i++) a[i] = kv_gelu_tanh(a[i]);
                }
            } else if (f->arch->geglu) {
                linear(a, hid, xn, w[KV_W_GATE], nr, d, hid, 0.0f);
                linear(b, hid, xn, w[KV_W_UP], nr, d, hid, 0.0f);
#pragma omp parallel for if (nh > 65536) schedule(static)
                for (int64_t i = 0; i < nh; i++) a[i] = kv_gelu_tanh(a[i]) * b[i];
            } else {
                linear(a, hid, xn, w[KV_W_GATE], nr, d, hid, 0.0f);
                linear(b, hid, xn, w[KV_W_UP], nr, d, hid, 0.0f);
#pragma omp parallel for if (nh > 65536) schedule(static)
                for (int64_t i = 0; i < nh; i++) a[i] = kv_silu(a[i]) * b[i];
            }
            if (f->arch->post_norms) { /* Gemma 2: x += norm(act(a) W2ᵀ) */
                float *yb = f->y + r0 * d;
                linear(yb, d, a, w[KV_W_DOWN], nr, hid, d, 0.0f);
                norm(f, yb, yb, KV_W_POST_FFN_NORM, KV_W_COUNT, l, nr);
                add_rows(f->x + r0 * d, yb, nr, d);
                continue;
            }
            linear(f->x + r0 * d, d, a, w[KV_W_DOWN], nr, hid, d, 1.0f); /* x += act(a) W2ᵀ */
        }
        add_bias(f->x, w[KV_W_BDOWN], n, d);
        if (hk->layer_out && (rc = hk->layer_out(hk->ctx, l, f->x, n, pos0))) return rc;
    }
    norm(f, f->xn, f->x, KV_W_OUT_NORM, KV_W_OUT_NORM_B, 0, n);
    f->last_n = n;
    if (f->defer_head) { /* kv_fwd_head computes the logits from f->xn */
        f->last_logits = NULL;
        return KV_OK;
    }
    float *lg = logits ? logits : f->logits;
    head(f, f->xn, lg, n);
    f->last_logits = lg;
    return KV_OK;
}

double kv_fwd_flops(const struct kv_model *m, int64_t n, int64_t pos0) {
    const struct kv_config *c = &m->cfg;
    double d = (double)c->dim, qd = (double)(c->n_heads * c->head_dim);
    double kd = (double)(c->n_kv_heads * c->head_dim), hid = (double)c->hidden_dim;
    double mlp = kv_arch_desc(c->arch)->gelu_mlp ? 2 : 3; /* matrices of d x hidden */
    double per_tok = 2.0 * (d * (qd + 2 * kd) + qd * d + mlp * d * hid) * (double)c->n_layers +
                     2.0 * d * (double)c->vocab_size;
    /* causal attention: row at position p scores p+1 keys, QKᵀ and PV */
    double keys = (double)n * (double)pos0 + (double)n * (double)(n + 1) / 2.0;
    double att = 4.0 * qd * keys * (double)c->n_layers;
    return per_tok * (double)n + att;
}

double kv_nll_row(const float *logits, int64_t vocab, int32_t target) {
    double mx = logits[0];
    for (int64_t j = 1; j < vocab; j++) mx = logits[j] > mx ? logits[j] : mx;
    double s = 0;
    for (int64_t j = 0; j < vocab; j++) s += exp((double)logits[j] - mx);
    return log(s) + mx - (double)logits[target];
}
