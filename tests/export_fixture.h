/* What the dense-export suites share (test_export.c, test_export_refusals.c):
 * hand-built factors for a loaded model (prerope_latent keys in 2-head
 * units, fused_output values per head, fused_query keys, some sides left
 * full) and the check that an export's K/V weights equal up·down computed
 * here with naive float64 loops, every other weight equal to the source. */
#ifndef KV_EXPORT_FIXTURE_H
#define KV_EXPORT_FIXTURE_H

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export.h"
#include "lrmodel.h"
#include "model.h"
#include "testutil.h"

/* A seeded xorshift64 stream of standard normals. */
struct rng {
    uint64_t s;
};

static inline double rng_normal(struct rng *g) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        g->s ^= g->s << 13;
        g->s ^= g->s >> 7;
        g->s ^= g->s << 17;
        u[i] = ((double)(g->s >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

/* n normals times scale, malloc'd. */
static inline float *randn_f(struct rng *g, int64_t n, double scale) {
    float *a = malloc((size_t)n * sizeof *a);
    cr_assert(a);
    for (int64_t i = 0; i < n; i++) a[i] = (float)(scale * rng_normal(g));
    return a;
}

/* Remove path, a file or a directory tree. */
static inline void rm_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (d) {
            struct dirent *e;
            while ((e = readdir(d)))
                if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
                    char *p = kvt_path(path, e->d_name);
                    rm_tree(p);
                    free(p);
                }
            closedir(d);
        }
        rmdir(path);
    } else {
        unlink(path);
    }
}

/* Entries of dir, besides . and .. */
static inline int n_entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "cannot open %s", dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

/* Write len bytes as the file path. */
static inline void write_bytes(const char *path, const void *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    cr_assert_eq(fwrite(buf, 1, len, f), len);
    fclose(f);
}

/* Open the model at path; fails the test on an error. */
static inline struct kv_model *open_ok(const char *path) {
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_model_open(path, NULL, &m, &err);
    char line[2200];
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, KV_OK, "loading %s: %s", path, line);
    return m;
}

/* Export m (loaded from path) under lr as out; fails the test on an error. */
static inline void export_ok(const struct kv_model *m, const char *path, const struct kv_lowrank *lr,
                             const char *out) {
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_lr_export_dense(m, path, lr, out, NULL, &err);
    char line[2200];
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, KV_OK, "export of %s: %s", path, line);
}

/* ---------------------------------------------------------------- factors */

/* Key modes of make_lr: full (no factors), prerope_latent, postrope_rotation,
 * fused_query. */
enum { K_LATENT = 1, K_FULL = 0, K_POSTROPE = 2, K_FUSED_QUERY = 3 };

/* Random factors for unit x: nh heads from head0, of rank rank. */
static inline void fill_unit(struct kv_lr_unit *x, int64_t head0, int64_t nh, int64_t rank, int64_t d,
                             int64_t dh, int bias, struct rng *g) {
    x->head0 = head0;
    x->n_heads = nh;
    x->rank = rank;
    x->energy = 1;
    x->dropped = 0;
    x->down = randn_f(g, rank * d, 0.2);
    x->up = randn_f(g, nh * dh * rank, 0.3);
    x->down_bias = bias ? randn_f(g, rank, 0.5) : NULL;
}

/* q_fused of layer l (see make_lr), in float64. */
static inline void fuse_query(const struct kv_model *m, int64_t l, struct kv_lr_layer *ly) {
    const struct kv_config *c = kv_model_config(m);
    const int64_t d = c->dim, dh = c->head_dim, h = c->n_heads, grp = h / c->n_kv_heads;
    const float *wq = kv_model_weight(m, KV_W_Q, l), *bq = kv_model_weight(m, KV_W_BQ, l);
    ly->q_cols = 0;
    for (int64_t i = 0; i < h; i++) ly->q_cols += ly->k.units[i / grp / 2].rank;
    ly->q_fused = calloc((size_t)(ly->q_cols * d), sizeof *ly->q_fused);
    ly->q_fused_bias = bq ? calloc((size_t)ly->q_cols, sizeof *ly->q_fused_bias) : NULL;
    int64_t row = 0;
    for (int64_t i = 0; i < h; i++) {
        const struct kv_lr_unit *x = &ly->k.units[i / grp / 2];
        const float *up = x->up + (i / grp - x->head0) * dh * x->rank; /* [dh, rank] */
        for (int64_t k = 0; k < x->rank; k++, row++) {
            for (int64_t col = 0; col < d; col++) {
                double acc = 0;
                for (int64_t e = 0; e < dh; e++)
                    acc += (double)up[e * x->rank + k] * wq[(i * dh + e) * d + col];
                ly->q_fused[row * d + col] = (float)acc;
            }
            double acc = 0;
            for (int64_t e = 0; bq && e < dh; e++) acc += (double)up[e * x->rank + k] * bq[i * dh + e];
            if (bq) ly->q_fused_bias[row] = (float)acc;
        }
    }
}

/* Factors for m: per layer, K is k_mode (latent or fused_query: 2-head
 * units of rank 3 + l, the first unit with a down bias when k_bias) and V
 * is fused_output with one unit per head of rank 2 unless v_full has bit l
 * set. o_fused and q_fused follow struct kv_lr_layer: [d, Σ_i rank(unit of
 * i)] with query head i's columns W_o^(i) · up_i, and [Σ_i rank, d] with
 * query head i's rows up_iᵀ W_q^(i) (bias up_iᵀ b_q^(i)), up_i being the
 * rows of up_u of i's KV head; so the compressed forward computes exactly
 * the attention of the dense export. */
static inline struct kv_lowrank *make_lr(const struct kv_model *m, const int *k_mode, unsigned v_full,
                                         int k_bias, uint64_t seed) {
    const struct kv_config *c = kv_model_config(m);
    const int64_t d = c->dim, dh = c->head_dim, g = c->n_kv_heads, h = c->n_heads, L = c->n_layers;
    cr_assert_eq(g % 2, 0, "test factors need an even kv head count");
    struct rng r = {seed * 0x9e3779b97f4a7c15ull + 1};
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    cr_assert(lr);
    snprintf(lr->info.method, sizeof lr->info.method, "test");
    snprintf(lr->info.alloc, sizeof lr->info.alloc, "uniform");
    lr->info.n_layers = L, lr->info.dim = d, lr->info.n_heads = h, lr->info.n_kv_heads = g, lr->info.head_dim = dh;
    lr->info.kv_bits = 16;
    lr->layers = calloc((size_t)L, sizeof *lr->layers);
    cr_assert(lr->layers);
    for (int64_t l = 0; l < L; l++) {
        struct kv_lr_layer *ly = &lr->layers[l];
        if (k_mode[l] == K_LATENT || k_mode[l] == K_FUSED_QUERY) {
            ly->k.mode = k_mode[l] == K_LATENT ? KV_LR_PREROPE_LATENT : KV_LR_FUSED_QUERY;
            ly->k.n_units = g / 2;
            ly->k.units = calloc((size_t)(g / 2), sizeof *ly->k.units);
            for (int64_t u = 0; u < g / 2; u++)
                fill_unit(&ly->k.units[u], 2 * u, 2, 3 + l, d, dh, k_bias && u == 0, &r);
            if (k_mode[l] == K_FUSED_QUERY) fuse_query(m, l, ly);
        } else if (k_mode[l] == K_POSTROPE) {
            ly->k.mode = KV_LR_POSTROPE_ROTATION;
            ly->k.n_units = g;
            ly->k.units = calloc((size_t)g, sizeof *ly->k.units);
            for (int64_t u = 0; u < g; u++) {
                struct kv_lr_unit *x = &ly->k.units[u];
                x->head0 = u, x->n_heads = 1, x->rank = 2;
                x->rot = randn_f(&r, 2 * dh, 0.3);
            }
        }
        if (v_full >> l & 1) continue;
        ly->v.mode = KV_LR_FUSED_OUTPUT;
        ly->v.n_units = g;
        ly->v.units = calloc((size_t)g, sizeof *ly->v.units);
        for (int64_t u = 0; u < g; u++) fill_unit(&ly->v.units[u], u, 1, 2, d, dh, 0, &r);
        ly->o_cols = h * 2;
        ly->o_fused = calloc((size_t)(d * ly->o_cols), sizeof *ly->o_fused);
        const float *wo = m->layers[l].w[KV_W_O]; /* [d, h*dh] */
        for (int64_t i = 0; i < h; i++) {
            const struct kv_lr_unit *x = &ly->v.units[i / (h / g)]; /* up [dh, 2] */
            for (int64_t row = 0; row < d; row++)
                for (int64_t k = 0; k < 2; k++) {
                    double s = 0;
                    for (int64_t e = 0; e < dh; e++)
                        s += (double)wo[row * h * dh + i * dh + e] * x->up[e * 2 + k];
                    ly->o_fused[row * ly->o_cols + i * 2 + k] = (float)s;
                }
        }
    }
    return lr;
}

/* The K or V side of layer l of lr. */
static inline const struct kv_lr_side *side(const struct kv_lowrank *lr, int64_t l, enum kv_wkind k) {
    return k == KV_W_K || k == KV_W_BK ? &lr->layers[l].k : &lr->layers[l].v;
}

/* up·down (or up·down_bias, 0 without one) of a side, naive float64:
 * [g*dh, d] for a weight, [g*dh] for a bias. */
static inline double *naive_dense(const struct kv_lowrank *lr, int64_t l, enum kv_wkind kind) {
    const struct kv_lr_side *s = side(lr, l, kind);
    int bias = kind == KV_W_BK || kind == KV_W_BV;
    int64_t d = lr->info.dim, dh = lr->info.head_dim, cols = bias ? 1 : d;
    double *w = calloc((size_t)(lr->info.n_kv_heads * dh * cols), sizeof *w);
    for (int64_t u = 0; u < s->n_units; u++) {
        const struct kv_lr_unit *x = &s->units[u];
        for (int64_t i = 0; i < x->n_heads * dh; i++)
            for (int64_t j = 0; j < cols; j++) {
                double acc = 0;
                for (int64_t k = 0; k < x->rank; k++) {
                    double right = bias ? (x->down_bias ? x->down_bias[k] : 0.0)
                                        : x->down[k * d + j];
                    acc += (double)x->up[i * x->rank + k] * right;
                }
                w[(x->head0 * dh + i) * cols + j] = acc;
            }
    }
    return w;
}

/* Relative rounding of one stored element: half an ulp of the dtype, plus
 * half an f32 ulp for the f32 the product passes through on the way. */
static inline double dtype_rtol(enum kv_dtype t) {
    return t == KV_DTYPE_F16 ? 0x1p-11 + 0x1p-24 : t == KV_DTYPE_BF16 ? 0x1p-8 + 0x1p-24 : 0x1p-24;
}
static inline double dtype_atol(enum kv_dtype t) {
    return t == KV_DTYPE_F16 ? 0x1p-25 : 1e-40; /* f16 subnormal spacing 2^-24 */
}

/* Stored dtype of a K/V tensor of m2 (looked up by the name the format uses). */
static inline enum kv_dtype stored_dtype(const struct kv_model *m, int64_t l, enum kv_wkind k) {
    char name[128];
    const char *s = k == KV_W_K || k == KV_W_BK ? "k" : "v";
    int bias = k == KV_W_BK || k == KV_W_BV;
    if (m->format == KV_FORMAT_HF && m->cfg.arch == KV_ARCH_GPT2) { /* K and V in c_attn */
        for (int pre = 0; pre < 2; pre++) {
            snprintf(name, sizeof name, "%sh.%lld.attn.c_attn.%s", pre ? "transformer." : "",
                     (long long)l, bias ? "bias" : "weight");
            for (int64_t i = 0; i < m->n_tensors; i++)
                if (!strcmp(m->tensors[i].name, name)) return m->tensors[i].dtype;
        }
    } else if (m->format == KV_FORMAT_HF)
        snprintf(name, sizeof name, "model.layers.%lld.self_attn.%s_proj.%s", (long long)l, s,
                 bias ? "bias" : "weight");
    else if (m->format == KV_FORMAT_GGUF)
        snprintf(name, sizeof name, "blk.%lld.attn_%s.%s", (long long)l, s, bias ? "bias" : "weight");
    else
        snprintf(name, sizeof name, "layers.%lld.w%s", (long long)l, s);
    for (int64_t i = 0; i < m->n_tensors; i++)
        if (!strcmp(m->tensors[i].name, name)) return m->tensors[i].dtype;
    cr_assert_fail("tensor %s not in the table", name);
    return KV_DTYPE_F32;
}

/* The export m2 of m under lr: compressed K/V (and their biases) equal the
 * naive products, everything else is bit-identical. Returns the number of
 * tensors checked against products. */
static inline int check_weights(const struct kv_model *m, const struct kv_model *m2,
                                const struct kv_lowrank *lr) {
    const struct kv_config *c = kv_model_config(m), *c2 = kv_model_config(m2);
    cr_assert(c->dim == c2->dim && c->hidden_dim == c2->hidden_dim &&
                  c->n_layers == c2->n_layers && c->n_heads == c2->n_heads &&
                  c->n_kv_heads == c2->n_kv_heads && c->head_dim == c2->head_dim &&
                  c->vocab_size == c2->vocab_size && c->max_seq_len == c2->max_seq_len &&
                  c->norm_eps == c2->norm_eps && c->rope_theta == c2->rope_theta &&
                  c->rope_layout == c2->rope_layout &&
                  c->tied_embeddings == c2->tied_embeddings &&
                  c->has_qkv_bias == c2->has_qkv_bias && c->bos_id == c2->bos_id &&
                  c->eos_id == c2->eos_id,
              "config changed");
    int products = 0;
    for (int k = 0; k < KV_W_COUNT; k++) {
        int64_t reps = k < KV_W_FIRST_LAYER ? 1 : c->n_layers;
        for (int64_t l = 0; l < reps; l++) {
            const float *a = kv_model_weight(m, (enum kv_wkind)k, l);
            const float *b = kv_model_weight(m2, (enum kv_wkind)k, l);
            cr_assert_eq(!a, !b, "%s of layer %lld present in one model only",
                         kv_wkind_name((enum kv_wkind)k), (long long)l);
            if (!a) continue;
            int64_t s[2];
            int nd = kv_model_expected_shape(c, (enum kv_wkind)k, s);
            int64_t n = nd == 2 ? s[0] * s[1] : s[0];
            int kv = k == KV_W_K || k == KV_W_V || k == KV_W_BK || k == KV_W_BV;
            if (!kv || side(lr, l, (enum kv_wkind)k)->mode == KV_LR_FULL) {
                cr_assert(!memcmp(a, b, (size_t)n * sizeof *a), "%s of layer %lld changed",
                          kv_wkind_name((enum kv_wkind)k), (long long)l);
                continue;
            }
            double *ref = naive_dense(lr, l, (enum kv_wkind)k);
            double *got = malloc((size_t)n * sizeof *got);
            for (int64_t i = 0; i < n; i++) got[i] = b[i];
            enum kv_dtype dt = stored_dtype(m2, l, (enum kv_wkind)k);
            char what[128];
            snprintf(what, sizeof what, "layer %lld %s (%s)", (long long)l,
                     kv_wkind_name((enum kv_wkind)k), kv_dtype_name(dt));
            double rtol = dtype_rtol(dt) * 1.0001, worst_rel = 0;
            int64_t at = 0;
            for (int64_t i = 0; i < n; i++) {
                double e = fabs(got[i] - ref[i]) / fmax(fabs(ref[i]), 1e-30);
                if (e > worst_rel) worst_rel = e, at = i;
            }
            cr_log_info("%s: worst relative error %.3g at element %lld (got %.9g, ref %.9g), "
                        "rtol %.3g", what, worst_rel, (long long)at, got[at], ref[at], rtol);
            kvt_assert_close_f64(got, ref, n, dtype_atol(dt), rtol, what);
            /* and the product really replaced the original */
            double worst = 0;
            for (int64_t i = 0; i < n; i++) worst = fmax(worst, fabs((double)a[i] - ref[i]));
            int zero_bias = 1;
            for (int64_t i = 0; i < n; i++) zero_bias &= ref[i] == 0;
            cr_assert(worst > 0 || zero_bias, "%s: original equals the product", what);
            free(ref);
            free(got);
            products++;
        }
    }
    return products;
}

/* Centred factors: a mean μ_u (up_bias) on every K and V unit, and each
 * fused_output layer's o_fused_bias = Σ_i O_i μ_u(i) (O_i query head i's
 * columns of the original o_proj), so the compressed forward computes the
 * dense export's attention. */
static inline void fx_centre(const struct kv_model *m, struct kv_lowrank *lr, uint64_t seed) {
    const struct kv_config *c = kv_model_config(m);
    const int64_t d = c->dim, dh = c->head_dim, h = c->n_heads, grp = h / c->n_kv_heads;
    struct rng g = {seed};
    for (int64_t l = 0; l < c->n_layers; l++) {
        struct kv_lr_layer *ly = &lr->layers[l];
        for (int w = 0; w < 2; w++) {
            struct kv_lr_side *s = w ? &ly->v : &ly->k;
            for (int64_t u = 0; s->mode != KV_LR_FULL && u < s->n_units; u++)
                s->units[u].up_bias = randn_f(&g, s->units[u].n_heads * dh, 0.4);
        }
        if (ly->v.mode != KV_LR_FUSED_OUTPUT) continue;
        const float *wo = kv_model_weight(m, KV_W_O, l); /* [d, h*dh] */
        ly->o_fused_bias = malloc((size_t)d * sizeof *ly->o_fused_bias);
        for (int64_t row = 0; row < d; row++) {
            double acc = 0;
            for (int64_t i = 0; i < h; i++) {
                const struct kv_lr_unit *x = &ly->v.units[i / grp];
                const float *mu = x->up_bias + (i / grp - x->head0) * dh;
                for (int64_t e = 0; e < dh; e++) acc += (double)wo[row * h * dh + i * dh + e] * mu[e];
            }
            ly->o_fused_bias[row] = (float)acc;
        }
    }
}

#endif
