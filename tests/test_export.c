/* Dense export (kv_lr_export_dense). Real and hand-written models in every
 * source format get hand-built factors (prerope_latent keys in 2-head units,
 * fused_output values per head, some sides left full), are exported and
 * reloaded: the K/V weights must equal up·down computed here with naive
 * float64 loops (within the stored dtype's rounding), every other weight and
 * every byte outside the overwritten tensors must equal the source, and file
 * names and sizes must match. GPT-2 directories (Conv1D c_attn holding q, k
 * and v) get fused_query and prerope_latent keys: only the K/V columns of
 * c_attn may change, and the F32 export's ordinary forward pass must give
 * the compressed model's latent-cache logits. Then the refusals: postrope_rotation keys,
 * OUT naming the source, a non-empty directory, mismatched factors or model,
 * with nothing written. Last, `kvcal export` on directories written by
 * kv_lr_dir_write: usage errors, a success, and the exact refusal line. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export.h"
#include "kvdir.h"
#include "lrmodel.h"
#include "model.h"
#include "safetensors.h"
#include "testutil.h"

/* ---------------------------------------------------------------- helpers */

struct rng {
    uint64_t s;
};

static double rng_normal(struct rng *g) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        g->s ^= g->s << 13;
        g->s ^= g->s >> 7;
        g->s ^= g->s << 17;
        u[i] = ((double)(g->s >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

static float *randn_f(struct rng *g, int64_t n, double scale) {
    float *a = malloc((size_t)n * sizeof *a);
    cr_assert(a);
    for (int64_t i = 0; i < n; i++) a[i] = (float)(scale * rng_normal(g));
    return a;
}

static void rm_tree(const char *path) {
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

static int n_entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "cannot open %s", dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

static void write_bytes(const char *path, const void *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    cr_assert_eq(fwrite(buf, 1, len, f), len);
    fclose(f);
}

static void copy_file(const char *src, const char *dst) {
    size_t n;
    char *b = kvt_read_file(src, &n);
    cr_assert_not_null(b, "cannot read %s", src);
    write_bytes(dst, b, n);
    free(b);
}

static struct kv_model *open_ok(const char *path) {
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_model_open(path, NULL, &m, &err);
    char line[2200];
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, KV_OK, "loading %s: %s", path, line);
    return m;
}

static void export_ok(const struct kv_model *m, const char *path, const struct kv_lowrank *lr,
                      const char *out) {
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_lr_export_dense(m, path, lr, out, &err);
    char line[2200];
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, KV_OK, "export of %s: %s", path, line);
}

/* Expects a refusal with code and a message containing each of the (up to
 * three) fragments. */
static void export_fails(const struct kv_model *m, const char *path, const struct kv_lowrank *lr,
                         const char *out, int code, const char *f1, const char *f2,
                         const char *f3) {
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_lr_export_dense(m, path, lr, out, &err);
    char line[2200];
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, code, "expected %s, got %s: %s", kv_status_name(code), kv_status_name(rc), line);
    const char *frag[3] = {f1, f2, f3};
    for (int i = 0; i < 3; i++)
        if (frag[i]) cr_assert(strstr(line, frag[i]), "message '%s' lacks '%s'", line, frag[i]);
    cr_assert(!(err.msg[0] >= 'A' && err.msg[0] <= 'Z'), "message '%s' starts uppercase", err.msg);
}

/* ---------------------------------------------------------------- factors */

enum { K_LATENT = 1, K_FULL = 0, K_POSTROPE = 2, K_FUSED_QUERY = 3 };

static void fill_unit(struct kv_lr_unit *x, int64_t head0, int64_t nh, int64_t rank, int64_t d,
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
static void fuse_query(const struct kv_model *m, int64_t l, struct kv_lr_layer *ly) {
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
static struct kv_lowrank *make_lr(const struct kv_model *m, const int *k_mode, unsigned v_full,
                                  int k_bias, uint64_t seed) {
    const struct kv_config *c = kv_model_config(m);
    const int64_t d = c->dim, dh = c->head_dim, g = c->n_kv_heads, h = c->n_heads, L = c->n_layers;
    cr_assert_eq(g % 2, 0, "test factors need an even kv head count");
    struct rng r = {seed * 0x9e3779b97f4a7c15ull + 1};
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    cr_assert(lr);
    snprintf(lr->method, sizeof lr->method, "test");
    snprintf(lr->alloc, sizeof lr->alloc, "uniform");
    lr->n_layers = L, lr->dim = d, lr->n_heads = h, lr->n_kv_heads = g, lr->head_dim = dh;
    lr->kv_bits = 16;
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

static const struct kv_lr_side *side(const struct kv_lowrank *lr, int64_t l, enum kv_wkind k) {
    return k == KV_W_K || k == KV_W_BK ? &lr->layers[l].k : &lr->layers[l].v;
}

/* up·down (or up·down_bias, 0 without one) of a side, naive float64:
 * [g*dh, d] for a weight, [g*dh] for a bias. */
static double *naive_dense(const struct kv_lowrank *lr, int64_t l, enum kv_wkind kind) {
    const struct kv_lr_side *s = side(lr, l, kind);
    int bias = kind == KV_W_BK || kind == KV_W_BV;
    int64_t d = lr->dim, dh = lr->head_dim, cols = bias ? 1 : d;
    double *w = calloc((size_t)(lr->n_kv_heads * dh * cols), sizeof *w);
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
static double dtype_rtol(enum kv_dtype t) {
    return t == KV_DTYPE_F16 ? 0x1p-11 + 0x1p-24 : t == KV_DTYPE_BF16 ? 0x1p-8 + 0x1p-24 : 0x1p-24;
}
static double dtype_atol(enum kv_dtype t) {
    return t == KV_DTYPE_F16 ? 0x1p-25 : 1e-40; /* f16 subnormal spacing 2^-24 */
}

/* Stored dtype of a K/V tensor of m2 (looked up by the name the format uses). */
static enum kv_dtype stored_dtype(const struct kv_model *m, int64_t l, enum kv_wkind k) {
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
static int check_weights(const struct kv_model *m, const struct kv_model *m2,
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

/* Every byte of dst equals src except inside the named tensors of table
 * (K/V tensors of compressed sides); the sizes are equal. */
static void check_bytes(const char *src, const char *dst, const struct kv_tensor *tab, int64_t n,
                        const struct kv_model *m, const struct kv_lowrank *lr) {
    size_t ns, nd;
    char *a = kvt_read_file(src, &ns), *b = kvt_read_file(dst, &nd);
    cr_assert(a && b);
    cr_assert_eq(ns, nd, "%s has %zu bytes, source %s has %zu", dst, nd, src, ns);
    /* allowed ranges: tensors named as a compressed side's K/V in any format */
    char *allow = calloc(ns ? ns : 1, 1);
    for (int64_t i = 0; i < n; i++) {
        const char *nm = tab[i].name;
        long long l = -1;
        char what[32] = "";
        if (sscanf(nm, "model.layers.%lld.self_attn.%31s", &l, what) == 2 ||
            sscanf(nm, "blk.%lld.attn_%31s", &l, what) == 2 ||
            sscanf(nm, "layers.%lld.%31s", &l, what) == 2) {
            enum kv_wkind k = KV_W_COUNT;
            if (!strcmp(what, "k_proj.weight") || !strcmp(what, "k.weight") || !strcmp(what, "wk"))
                k = KV_W_K;
            if (!strcmp(what, "v_proj.weight") || !strcmp(what, "v.weight") || !strcmp(what, "wv"))
                k = KV_W_V;
            if (!strcmp(what, "k_proj.bias") || !strcmp(what, "k.bias")) k = KV_W_BK;
            if (!strcmp(what, "v_proj.bias") || !strcmp(what, "v.bias")) k = KV_W_BV;
            if (k != KV_W_COUNT && l < m->cfg.n_layers && side(lr, l, k)->mode != KV_LR_FULL)
                memset(allow + tab[i].offset, 1, tab[i].nbytes);
        }
        /* gpt2's c_attn [d, qd + 2 kd] (bias [qd + 2 kd]): only the K or V
         * columns of a compressed side */
        if (sscanf(nm, "transformer.h.%lld.attn.c_attn.%31s", &l, what) == 2 ||
            sscanf(nm, "h.%lld.attn.c_attn.%31s", &l, what) == 2) {
            const struct kv_config *c = &m->cfg;
            int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
            int64_t out = qd + 2 * kd, in = strcmp(what, "bias") ? c->dim : 1;
            size_t es = kv_dtype_size(tab[i].dtype);
            for (int s = 0; s < 2; s++) {
                if (l >= c->n_layers || side(lr, l, s ? KV_W_V : KV_W_K)->mode == KV_LR_FULL)
                    continue;
                for (int64_t r = 0; r < in; r++)
                    memset(allow + tab[i].offset + (size_t)(r * out + qd + s * kd) * es, 1,
                           (size_t)kd * es);
            }
        }
    }
    for (size_t i = 0; i < ns; i++)
        cr_assert(a[i] == b[i] || allow[i],
                  "%s: byte %zu differs from the source outside the K/V tensors", dst, i);
    free(allow);
    free(a);
    free(b);
}

/* Single-file source (GGUF or llama2.c): export to dir/out.EXT, reload,
 * check. */
static void roundtrip_file(const char *src, const char *ext, const int *k_mode, unsigned v_full) {
    struct kv_model *m = open_ok(src);
    struct kv_lowrank *lr = make_lr(m, k_mode, v_full, 0, 7);
    kv_model_fingerprint(m, lr->model_fingerprint, NULL);
    char *dir = kvt_temp_dir();
    char name[32];
    snprintf(name, sizeof name, "out%s", ext);
    char *out = kvt_path(dir, name);
    export_ok(m, src, lr, out);
    cr_assert_eq(n_entries(dir), 1, "only the output file is left in its folder");
    struct kv_model *m2 = open_ok(out);
    cr_assert_eq(kv_model_format(m2), kv_model_format(m));
    int products = check_weights(m, m2, lr);
    cr_assert_gt(products, 0);
    check_bytes(src, out, m2->tensors, m2->n_tensors, m, lr);
    kv_model_close(m2);
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(out);
    free(dir);
}

/* Logits of tokens 0..n-1 (malloc'd), through lr's latent cache when lr is
 * non-NULL. */
static float *logits_of(const struct kv_model *m, const struct kv_lowrank *lr, int64_t n) {
    int64_t V = kv_model_config(m)->vocab_size;
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 7 + 3) % V);
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", err.msg);
    if (lr) cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_OK, "%s", err.msg);
    float *out = malloc((size_t)(n * V) * sizeof *out);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, out, &err), KV_OK, "%s", err.msg);
    kv_fwd_free(f);
    free(tok);
    return out;
}

/* Directory source: export to a fresh dir/out, check the file list, every
 * file's bytes and the reloaded weights; with same_logits, the exported
 * model's ordinary forward pass must also give the compressed model's
 * logits (for an F32 source, where the dense weights are not rounded). */
static void roundtrip_dir(const char *src, const int *k_mode, unsigned v_full, int k_bias,
                          int same_logits) {
    struct kv_model *m = open_ok(src);
    struct kv_lowrank *lr = make_lr(m, k_mode, v_full, k_bias, 11);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out");
    export_ok(m, src, lr, out);
    cr_assert_eq(n_entries(dir), 1, "only the output directory is left in its folder");
    struct kv_model *m2 = open_ok(out);
    cr_assert_eq(kv_model_format(m2), KV_FORMAT_HF);
    int products = check_weights(m, m2, lr);
    cr_assert_gt(products, 0);
    if (same_logits) {
        int64_t n = 12, nv = n * kv_model_config(m)->vocab_size;
        float *comp = logits_of(m, lr, n), *dense = logits_of(m2, NULL, n);
        float *base = logits_of(m, NULL, n);
        kvt_assert_close_f32(dense, comp, nv, 1e-5, 1e-4, "dense export vs compressed logits");
        double diff = 0;
        for (int64_t i = 0; i < nv; i++) diff = fmax(diff, fabs((double)base[i] - comp[i]));
        cr_assert_gt(diff, 1e-3, "the factors left the logits unchanged (max diff %g)", diff);
        free(comp), free(dense), free(base);
    }

    DIR *d = opendir(src);
    cr_assert(d);
    int regular = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *sp = kvt_path(src, e->d_name), *op = kvt_path(out, e->d_name);
        struct stat st, so;
        cr_assert_eq(stat(sp, &st), 0);
        if (!S_ISREG(st.st_mode)) {
            cr_assert_neq(stat(op, &so), 0, "%s is not a regular file but was copied", sp);
        } else {
            regular++;
            size_t len = strlen(e->d_name);
            struct kv_st_file *stf = NULL;
            struct kv_err err;
            if (len > 12 && !strcmp(e->d_name + len - 12, ".safetensors"))
                cr_assert_eq(kv_st_open(op, &stf, &err), KV_OK, "%s: %s", op, err.msg);
            check_bytes(sp, op, stf ? stf->tensors : NULL, stf ? stf->n_tensors : 0, m, lr);
            kv_st_close(stf);
        }
        free(sp);
        free(op);
    }
    closedir(d);
    cr_assert_eq(n_entries(out), regular, "the export holds exactly the source's regular files");
    kv_model_close(m2);
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(out);
    free(dir);
}

/* ---------------------------------------------------------------- an HF model with biases */

/* d 32, 8 heads of 4, 4 KV heads, FFN 48, 3 layers, vocab 64, q/k/v biases. */
#define H_DIM 32
#define H_FFN 48
#define H_LAYERS 3
#define H_KVD 16
#define H_VOCAB 64

struct st_entry {
    char name[96];
    int64_t shape[2];
    int nd;
    enum kv_dtype dtype;
};

/* Write a safetensors file of the given entries with random values,
 * converted to each entry's dtype. */
static void write_st(const char *path, const struct st_entry *t, int n, struct rng *g) {
    size_t hcap = 1 << 16, hl = 0, dcap = 1 << 20, dl = 0;
    char *hdr = malloc(hcap);
    uint8_t *data = malloc(dcap);
    hl += (size_t)snprintf(hdr, hcap, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        int64_t cnt = t[i].nd == 2 ? t[i].shape[0] * t[i].shape[1] : t[i].shape[0];
        float *v = randn_f(g, cnt, 0.1);
        size_t begin = dl, nb = (size_t)cnt * kv_dtype_size(t[i].dtype);
        cr_assert(dl + nb <= dcap);
        kv_convert_from_f32(t[i].dtype, v, data + dl, cnt);
        dl += nb;
        free(v);
        char shape[64];
        if (t[i].nd == 2)
            snprintf(shape, sizeof shape, "[%lld,%lld]", (long long)t[i].shape[0],
                     (long long)t[i].shape[1]);
        else
            snprintf(shape, sizeof shape, "[%lld]", (long long)t[i].shape[0]);
        hl += (size_t)snprintf(hdr + hl, hcap - hl,
                               ",\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                               t[i].name, kv_dtype_name(t[i].dtype), shape, begin, dl);
        cr_assert(hl < hcap);
    }
    hl += (size_t)snprintf(hdr + hl, hcap - hl, "}");
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    fwrite(len8, 1, 8, f);
    fwrite(hdr, 1, hl, f);
    fwrite(data, 1, dl, f);
    fclose(f);
    free(hdr);
    free(data);
}

/* A sharded checkpoint: tensors alternate between an F16 and a BF16 shard
 * (so K and V weights and biases land in both dtypes), plus an index, a
 * README and a subdirectory that the export must leave out. */
static char *make_hf_bias_dir(void) {
    char *dir = kvt_temp_dir();
    char text[2048];
    snprintf(text, sizeof text,
             "{\"model_type\": \"llama\", \"hidden_size\": %d, \"intermediate_size\": %d, "
             "\"num_hidden_layers\": %d, \"num_attention_heads\": 8, \"num_key_value_heads\": 4, "
             "\"vocab_size\": %d, \"rms_norm_eps\": 1e-05, \"max_position_embeddings\": 64, "
             "\"tie_word_embeddings\": false, \"attention_bias\": true, \"hidden_act\": "
             "\"silu\"}\n",
             H_DIM, H_FFN, H_LAYERS, H_VOCAB);
    char *p = kvt_path(dir, "config.json");
    write_bytes(p, text, strlen(text));
    free(p);
    p = kvt_path(dir, "README.md");
    write_bytes(p, "# test\n", 7);
    free(p);
    p = kvt_path(dir, "original");
    cr_assert_eq(mkdir(p, 0755), 0);
    char *q = kvt_path(p, "consolidated.bin");
    write_bytes(q, "x", 1);
    free(q);
    free(p);

    struct st_entry all[64];
    int n = 0;
    const struct {
        const char *suffix;
        int64_t a, b;
    } per_layer[] = {
        {"input_layernorm.weight", H_DIM, 0},       {"self_attn.q_proj.weight", H_DIM, H_DIM},
        {"self_attn.k_proj.weight", H_KVD, H_DIM},  {"self_attn.v_proj.weight", H_KVD, H_DIM},
        {"self_attn.o_proj.weight", H_DIM, H_DIM},  {"self_attn.q_proj.bias", H_DIM, 0},
        {"self_attn.k_proj.bias", H_KVD, 0},        {"self_attn.v_proj.bias", H_KVD, 0},
        {"post_attention_layernorm.weight", H_DIM, 0}, {"mlp.gate_proj.weight", H_FFN, H_DIM},
        {"mlp.up_proj.weight", H_FFN, H_DIM},       {"mlp.down_proj.weight", H_DIM, H_FFN},
    };
    struct st_entry glob[3] = {{"model.embed_tokens.weight", {H_VOCAB, H_DIM}, 2, 0},
                               {"lm_head.weight", {H_VOCAB, H_DIM}, 2, 0},
                               {"model.norm.weight", {H_DIM, 0}, 1, 0}};
    for (int i = 0; i < 3; i++) all[n++] = glob[i];
    for (int l = 0; l < H_LAYERS; l++)
        for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++) {
            struct st_entry *e = &all[n++];
            snprintf(e->name, sizeof e->name, "model.layers.%d.%s", l, per_layer[i].suffix);
            e->shape[0] = per_layer[i].a;
            e->shape[1] = per_layer[i].b;
            e->nd = per_layer[i].b ? 2 : 1;
        }
    struct st_entry sh[2][64];
    int ns[2] = {0, 0};
    static const char *const shard[2] = {"model-00001-of-00002.safetensors",
                                         "model-00002-of-00002.safetensors"};
    char *idx = malloc(16384);
    size_t il = (size_t)snprintf(idx, 16384, "{\"metadata\": {}, \"weight_map\": {");
    for (int i = 0; i < n; i++) {
        int s = i % 2;
        all[i].dtype = s ? KV_DTYPE_BF16 : KV_DTYPE_F16;
        sh[s][ns[s]++] = all[i];
        il += (size_t)snprintf(idx + il, 16384 - il, "%s\"%s\": \"%s\"", i ? ", " : "",
                               all[i].name, shard[s]);
    }
    snprintf(idx + il, 16384 - il, "}}\n");
    p = kvt_path(dir, "model.safetensors.index.json");
    write_bytes(p, idx, strlen(idx));
    free(p);
    free(idx);
    struct rng g = {42};
    for (int s = 0; s < 2; s++) {
        p = kvt_path(dir, shard[s]);
        write_st(p, sh[s], ns[s], &g);
        free(p);
    }
    return dir;
}

/* ---------------------------------------------------------------- a gpt2 model */

/* d 16, 4 heads of 4, n_inner 4d, 2 layers, vocab 24, 16 positions, tied:
 * Conv1D weights stored [in, out], c_attn holding q, k and v. Names with
 * the "transformer." prefix or without (as the hub's gpt2 has them); every
 * tensor F32, or alternately F16 and BF16. */
#define G_DIM 16
#define G_FFN 64
#define G_VOCAB 24
#define G_POS 16

static char *make_gpt2_dir(int prefixed, int half) {
    char *dir = kvt_temp_dir();
    char text[512];
    snprintf(text, sizeof text,
             "{\"model_type\": \"gpt2\", \"n_embd\": %d, \"n_layer\": 2, \"n_head\": 4, "
             "\"n_positions\": %d, \"vocab_size\": %d, \"layer_norm_epsilon\": 1e-05}\n",
             G_DIM, G_POS, G_VOCAB);
    char *p = kvt_path(dir, "config.json");
    write_bytes(p, text, strlen(text));
    free(p);
    const struct {
        const char *suffix;
        int64_t a, b;
    } glob[] = {{"wte.weight", G_VOCAB, G_DIM}, {"wpe.weight", G_POS, G_DIM},
                {"ln_f.weight", G_DIM, 0},      {"ln_f.bias", G_DIM, 0}},
      per_layer[] = {
          {"ln_1.weight", G_DIM, 0},          {"ln_1.bias", G_DIM, 0},
          {"attn.c_attn.weight", G_DIM, 3 * G_DIM}, {"attn.c_attn.bias", 3 * G_DIM, 0},
          {"attn.c_proj.weight", G_DIM, G_DIM}, {"attn.c_proj.bias", G_DIM, 0},
          {"ln_2.weight", G_DIM, 0},          {"ln_2.bias", G_DIM, 0},
          {"mlp.c_fc.weight", G_DIM, G_FFN},  {"mlp.c_fc.bias", G_FFN, 0},
          {"mlp.c_proj.weight", G_FFN, G_DIM}, {"mlp.c_proj.bias", G_DIM, 0},
      };
    const char *pre = prefixed ? "transformer." : "";
    struct st_entry all[40];
    int n = 0;
    for (size_t i = 0; i < sizeof glob / sizeof glob[0]; i++, n++) {
        snprintf(all[n].name, sizeof all[n].name, "%s%s", pre, glob[i].suffix);
        all[n].shape[0] = glob[i].a, all[n].shape[1] = glob[i].b, all[n].nd = glob[i].b ? 2 : 1;
    }
    for (int l = 0; l < 2; l++)
        for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++, n++) {
            snprintf(all[n].name, sizeof all[n].name, "%sh.%d.%s", pre, l, per_layer[i].suffix);
            all[n].shape[0] = per_layer[i].a, all[n].shape[1] = per_layer[i].b;
            all[n].nd = per_layer[i].b ? 2 : 1;
        }
    for (int i = 0; i < n; i++)
        all[i].dtype = !half ? KV_DTYPE_F32 : i % 2 ? KV_DTYPE_BF16 : KV_DTYPE_F16;
    struct rng g = {prefixed * 2 + half + 5};
    p = kvt_path(dir, "model.safetensors");
    write_st(p, all, n, &g);
    free(p);
    return dir;
}

/* ---------------------------------------------------------------- tests */

Test(export_dense, hf_shared_model_roundtrips) {
    KVT_NEED_SHARED(src, "models/tinystories-656K");
    char *s = strdup(src);
    int k_mode[2] = {K_LATENT, K_LATENT};
    roundtrip_dir(s, k_mode, 0, 0, 0);
    free(s);
}

Test(export_dense, hf_sharded_f16_bf16_with_biases_roundtrips) {
    char *src = make_hf_bias_dir();
    /* layer 0: both compressed, K bias from a down bias on unit 0 and 0 on
     * unit 1, V bias 0 (no down bias); layer 1: K full; layer 2: V full */
    int k_mode[H_LAYERS] = {K_LATENT, K_FULL, K_LATENT};
    roundtrip_dir(src, k_mode, 1u << 2, 1, 0);
    rm_tree(src);
    free(src);
}

Test(export_dense, gpt2_c_attn_k_and_v_columns_roundtrip_with_the_compressed_logits) {
    /* layer 0: fused_query keys with a down bias, fused_output values;
     * layer 1: keys full, values fused_output */
    char *src = make_gpt2_dir(0, 0);
    int k_mode[2] = {K_FUSED_QUERY, K_FULL};
    roundtrip_dir(src, k_mode, 0, 1, 1);
    rm_tree(src);
    free(src);
}

Test(export_dense, gpt2_prefixed_f16_bf16_roundtrips) {
    /* layer 0: fused_query keys, values full; layer 1: prerope_latent keys
     * and fused_output values, in F16 and BF16 tensors */
    char *src = make_gpt2_dir(1, 1);
    int k_mode[2] = {K_FUSED_QUERY, K_LATENT};
    roundtrip_dir(src, k_mode, 1u << 0, 1, 0);
    rm_tree(src);
    free(src);
}

Test(export_dense, llama2c_roundtrips) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    int k_mode[5] = {K_LATENT, K_LATENT, K_FULL, K_LATENT, K_LATENT};
    roundtrip_file(s, ".bin", k_mode, 1u << 4);
    free(s);
}

Test(export_dense, gguf_roundtrips) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.gguf");
    char *s = strdup(src);
    int k_mode[5] = {K_FULL, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    roundtrip_file(s, ".gguf", k_mode, 1u << 1);
    free(s);
}

Test(export_dense, postrope_rotation_is_refused_before_writing) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_LATENT, K_POSTROPE, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 3);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out.bin");
    export_fails(m, s, lr, out, KV_EUNSUPPORTED, "layer 2 k", "'postrope_rotation'", "rope");
    cr_assert_eq(n_entries(dir), 0, "nothing may be written");
    kv_model_close(m);
    kv_lr_free(lr);

    /* the same for a directory export */
    KVT_NEED_SHARED(hf, "models/tinystories-656K");
    char *h = strdup(hf);
    m = open_ok(h);
    int k2[2] = {K_LATENT, K_POSTROPE};
    lr = make_lr(m, k2, 0, 0, 3);
    export_fails(m, h, lr, out, KV_EUNSUPPORTED, "layer 1 k", "'postrope_rotation'", NULL);
    cr_assert_eq(n_entries(dir), 0, "nothing may be written");
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(out);
    free(dir);
    free(h);
    free(s);
}

Test(export_dense, output_that_is_the_source_is_refused) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *dir = kvt_temp_dir();
    char *copy = kvt_path(dir, "model.bin");
    copy_file(src, copy);
    size_t n0;
    char *before = kvt_read_file(copy, &n0);
    struct kv_model *m = open_ok(copy);
    int k_mode[5] = {K_LATENT, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 5);
    export_fails(m, copy, lr, copy, KV_EINVAL, "is the source model", NULL, NULL);
    /* a hard link is the same file */
    char *link_path = kvt_path(dir, "alias.bin");
    cr_assert_eq(link(copy, link_path), 0);
    export_fails(m, copy, lr, link_path, KV_EINVAL, "is the source model", NULL, NULL);
    /* and OUT whose temporary OUT.tmp is the source */
    char *tmp_src = kvt_path(dir, "x.bin.tmp");
    cr_assert_eq(rename(link_path, tmp_src), 0);
    char *x = kvt_path(dir, "x.bin");
    export_fails(m, copy, lr, x, KV_EINVAL, "x.bin.tmp", "source model", NULL);
    size_t n1;
    char *after = kvt_read_file(copy, &n1);
    cr_assert(n0 == n1 && !memcmp(before, after, n0), "the source changed");
    cr_assert_eq(n_entries(dir), 2);
    kv_model_close(m);

    /* a directory source named as its own output */
    KVT_NEED_SHARED(hf, "models/tinystories-656K");
    char *h = strdup(hf);
    m = open_ok(h);
    kv_lr_free(lr);
    int k2[2] = {K_LATENT, K_LATENT};
    lr = make_lr(m, k2, 0, 0, 5);
    export_fails(m, h, lr, h, KV_EINVAL, "is the source model", NULL, NULL);
    kv_model_close(m);
    kv_lr_free(lr);
    free(before), free(after), free(copy), free(link_path), free(tmp_src), free(x), free(h);
    rm_tree(dir);
    free(dir);
}

Test(export_dense, existing_outputs) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 9);
    char *dir = kvt_temp_dir();
    /* an existing file is replaced */
    char *out = kvt_path(dir, "out.bin");
    write_bytes(out, "old", 3);
    export_ok(m, s, lr, out);
    struct stat st, ss;
    cr_assert_eq(stat(out, &st), 0);
    cr_assert_eq(stat(s, &ss), 0);
    cr_assert_eq(st.st_size, ss.st_size);
    /* a directory where the file is due */
    char *sub = kvt_path(dir, "sub");
    cr_assert_eq(mkdir(sub, 0755), 0);
    export_fails(m, s, lr, sub, KV_EINVAL, "is a directory", NULL, NULL);
    kv_model_close(m);
    kv_lr_free(lr);

    KVT_NEED_SHARED(hf, "models/tinystories-656K");
    char *h = strdup(hf);
    m = open_ok(h);
    int k2[2] = {K_LATENT, K_FULL};
    lr = make_lr(m, k2, 0, 0, 9);
    /* an empty directory is replaced; "OUT/" names OUT */
    char *with_slash = malloc(strlen(sub) + 2);
    sprintf(with_slash, "%s/", sub);
    export_ok(m, h, lr, with_slash);
    cr_assert_eq(n_entries(sub), n_entries(h));
    /* now it is not empty */
    export_fails(m, h, lr, sub, KV_EINVAL, "not empty", NULL, NULL);
    /* a file where the directory is due */
    export_fails(m, h, lr, out, KV_EINVAL, "not a directory", NULL, NULL);
    cr_assert_eq(n_entries(dir), 2, "no temporaries left behind");
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(dir), free(out), free(sub), free(with_slash), free(h), free(s);
}

Test(export_dense, mismatched_factors_or_model_are_refused) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 13);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out.bin");

    lr->head_dim++;
    export_fails(m, s, lr, out, KV_EINVAL, "factors are for 5 layers, dim 64, 8 heads (4 kv) of 9, but the model has", NULL, NULL);
    lr->head_dim--;

    memset(lr->model_fingerprint, 'a', 64);
    export_fails(m, s, lr, out, KV_EINVAL, "fingerprint", NULL, NULL);
    lr->model_fingerprint[0] = 0;

    /* a head in two units, a head in none */
    struct kv_lr_unit *u0 = &lr->layers[1].k.units[0];
    u0->head0 = 1;
    export_fails(m, s, lr, out, KV_EINVAL, "layer 1 k", "kv head 2 is in two units", NULL);
    u0->head0 = 0;
    lr->layers[1].k.n_units = 1;
    export_fails(m, s, lr, out, KV_EINVAL, "layer 1 k", "kv head 2 is in no unit", NULL);
    lr->layers[1].k.n_units = 2;

    /* a down bias where the model has no bias tensor */
    struct rng g = {1};
    lr->layers[3].v.units[1].down_bias = randn_f(&g, lr->layers[3].v.units[1].rank, 1);
    export_fails(m, s, lr, out, KV_EUNSUPPORTED, "layer 3 v unit 1", "no v bias tensor", NULL);
    free(lr->layers[3].v.units[1].down_bias);
    lr->layers[3].v.units[1].down_bias = NULL;

    /* the file named is not the one the model was loaded from */
    char *other = kvt_path(dir, "other.bin");
    size_t n;
    char *bytes = kvt_read_file(s, &n);
    const struct kv_tensor *wv = NULL;
    for (int64_t i = 0; i < m->n_tensors; i++)
        if (!strcmp(m->tensors[i].name, "layers.4.wv")) wv = &m->tensors[i];
    cr_assert(wv);
    bytes[wv->offset + 5] ^= 0x40;
    write_bytes(other, bytes, n);
    free(bytes);
    export_fails(m, other, lr, out, KV_EINVAL, "layers.4.wv", "differs from the", NULL);

    /* a synthetic model has no files */
    struct kv_model *syn;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(kv_model_config(m), 1, &syn, &err), KV_OK);
    export_fails(syn, s, lr, out, KV_EINVAL, "synthetic", NULL, NULL);
    kv_model_close(syn);

    cr_assert_eq(n_entries(dir), 1, "only other.bin: nothing written");
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(dir), free(out), free(other), free(s);
}

/* ---------------------------------------------------------------- the command */

/* Write lr for the model at model_path as a compressed-model directory. */
static char *write_lr_dir(const struct kv_model *m, const char *model_path,
                          const struct kv_lowrank *lr, const char *parent, const char *name) {
    char *dir = kvt_path(parent, name);
    struct kv_lr_dir_info info = {model_path, NULL, NULL, NULL};
    struct kv_err err;
    kv_err_clear(&err);
    char line[2200];
    int rc = kv_lr_dir_write(m, lr, &info, dir, &err);
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, KV_OK, "writing %s: %s", dir, line);
    return dir;
}

Test(export_cli, usage_errors_exit_2) {
    char *out, *errs;
    int rc = kvt_run_cli("export --model m.bin -o x.bin", &out, &errs);
    cr_assert_eq(rc, 2, "exit %d, stderr: %s", rc, errs);
    cr_assert_str_eq(errs, "kvcal export: missing --dense DIR\n"
                           "usage: kvcal export --dense DIR --model PATH -o OUT [options] "
                           "(see 'kvcal export --help')\n");
    cr_assert_str_eq(out, "");
    free(out), free(errs);
    rc = kvt_run_cli("export --dense d --model m.bin", &out, &errs);
    cr_assert_eq(rc, 2);
    cr_assert(!strncmp(errs, "kvcal export: missing --output\n", 31), "stderr: %s", errs);
    free(out), free(errs);
    rc = kvt_run_cli("export --help", &out, &errs);
    cr_assert_eq(rc, 0);
    cr_assert(strstr(out, "quality proxy") && strstr(out, "fdc and zack") && strstr(out, "examples:"),
              "help: %s", out);
    free(out), free(errs);
}

Test(export_cli, exports_a_decomposed_directory_and_refuses_postrope) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_FULL, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 1u << 3, 0, 17);
    kv_model_fingerprint(m, lr->model_fingerprint, NULL);
    char *dir = kvt_temp_dir();
    char *lrdir = write_lr_dir(m, s, lr, dir, "lr");
    char *out = kvt_path(dir, "dense.bin");
    char args[4096], *o, *e;
    snprintf(args, sizeof args, "export --dense %s --model %s -o %s", lrdir, s, out);
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 0, "exit %d, stderr: %s", rc, e);
    cr_assert(strstr(o, "replaced  k in 4 of 5 layers, v in 4 of 5"), "stdout: %s", o);
    free(o), free(e);
    struct kv_model *m2 = open_ok(out);
    cr_assert_gt(check_weights(m, m2, lr), 0);
    kv_model_close(m2);
    kv_lr_free(lr);

    int k2[5] = {K_LATENT, K_LATENT, K_POSTROPE, K_LATENT, K_LATENT};
    lr = make_lr(m, k2, 0, 0, 19);
    kv_model_fingerprint(m, lr->model_fingerprint, NULL);
    char *rotdir = write_lr_dir(m, s, lr, dir, "rot");
    char *out2 = kvt_path(dir, "rot.bin");
    snprintf(args, sizeof args, "export --dense %s --model %s -o %s", rotdir, s, out2);
    rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 1, "exit %d, stderr: %s", rc, e);
    char want[1200];
    snprintf(want, sizeof want,
             "kvcal: %s: layer 2 k: mode 'postrope_rotation' cannot be exported dense: its "
             "projection acts after rope, which no k_proj weight expresses\n",
             rotdir);
    cr_assert_str_eq(e, want);
    cr_assert_str_eq(o, "");
    struct stat st;
    cr_assert_neq(stat(out2, &st), 0, "nothing may be written");
    free(o), free(e);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(dir);
    free(dir), free(lrdir), free(rotdir), free(out), free(out2), free(s);
}
