/* Fixtures shared by the compressed-model suites (test_kvdir.c: the
 * directory and its weights; test_kvmanifest.c: the manifest): configs, a
 * hand-made kv_lowrank with every mode on a random llama (GQA) or gpt2
 * model, directories written from it, comparisons, and the corruption
 * driver both suites' tables run. Header-only: static functions. */
#ifndef KV_LRFIXTURE_H
#define KV_LRFIXTURE_H

#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvdir.h"
#include "lrmodel.h"
#include "model.h"
#include "safetensors.h"
#include "stwrite.h"
#include "testutil.h"

/* ------------------------------------------------------------ fixtures */

/* dim 32, 3 layers, 8 query heads, 4 kv heads (GQA, 2 per group), head_dim 4. */
static inline struct kv_config small_cfg(int bias) {
    struct kv_config c = {0};
    c.dim = 32, c.hidden_dim = 40, c.n_layers = 3, c.n_heads = 8, c.n_kv_heads = 4;
    c.head_dim = 4, c.vocab_size = 50, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF, c.bos_id = 1, c.eos_id = 2;
    c.has_qkv_bias = bias;
    c.tied_embeddings = !bias; /* cover both heads */
    return c;
}

/* gpt2: dim 32, 3 layers, 8 heads (n_kv_heads = n_heads), head_dim 4, biases. */
static inline struct kv_config gpt2_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPT2;
    c.dim = 32, c.hidden_dim = 40, c.n_layers = 3, c.n_heads = 8, c.n_kv_heads = 8;
    c.head_dim = 4, c.vocab_size = 50, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_layout = KV_ROPE_HALF, c.bos_id = 1, c.eos_id = 2;
    c.has_qkv_bias = 1, c.tied_embeddings = 1;
    return c;
}

static inline const char *fmt_err(const struct kv_err *e) {
    static char buf[2200];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

static inline uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline double urand(uint64_t *s) { return (double)(splitmix(s) >> 11) * 0x1.0p-53; }
                           
                           static inline float *rand_floats(int64_t n, uint64_t *s) {
    float *p = malloc((size_t)n * sizeof *p);
    cr_assert_not_null(p);
    for (int64_t i = 0; i < n; i++) p[i] = (float)(2 * urand(s) - 1);
    return p;
}

/* Units of `sizes` kv heads each with `ranks`, random factors for mode. */
static inline void make_side(struct kv_lr_side *s, enum kv_lr_mode mode, int n,
                             const int64_t *sizes, const int64_t *ranks, int bias,
                             const struct kv_config *c, uint64_t *seed) {
    s->mode = mode;
    s->n_units = n;
    s->units = n ? calloc((size_t)n, sizeof *s->units) : NULL;
    int64_t h0 = 0;
    for (int u = 0; u < n; u++) {
        struct kv_lr_unit *x = &s->units[u];
        x->head0 = h0, x->n_heads = sizes[u], x->rank = ranks[u];
        h0 += sizes[u];
        x->energy = 1000.0 * urand(seed) + 1.0 / 3.0;
        x->dropped = x->energy * urand(seed) * 0.1;
        if (mode == KV_LR_POSTROPE_ROTATION) {
            x->rot = rand_floats(x->rank * c->head_dim, seed);
        } else {
            x->down = rand_floats(x->rank * c->dim, seed);
            x->up = rand_floats(x->n_heads * c->head_dim * x->rank, seed);
            if (bias) x->down_bias = rand_floats(x->rank, seed);
        }
    }
}

/* Σ over query heads of the rank of the unit holding their kv head. */
static inline int64_t o_cols_of(const struct kv_lr_side *s, const struct kv_config *c) {
    int64_t cols = 0, per = c->n_heads / c->n_kv_heads;
    for (int64_t i = 0; i < c->n_heads; i++)
        for (int64_t u = 0; u < s->n_units; u++)
            if (i / per >= s->units[u].head0 && i / per < s->units[u].head0 + s->units[u].n_heads)
                cols += s->units[u].rank;
    return cols;
}

/* fused_query keys: q_fused [q_cols, d] and its bias (the model has q biases). */
static inline void make_q_fused(struct kv_lr_layer *y, const struct kv_config *c, uint64_t *seed) {
    y->q_cols = o_cols_of(&y->k, c);
    y->q_fused = rand_floats(y->q_cols * c->dim, seed);
    if (c->has_qkv_bias) y->q_fused_bias = rand_floats(y->q_cols, seed);
}

/* llama (GQA, 4 kv heads):
 * Layer 0: K prerope_latent, units {0,1} r5 and {2,3} r3 with a latent bias;
 *          V fused_output, one head per unit, r 2,3,4,1.
 * Layer 1: K postrope_rotation, r 4,2,3,1; V full.
 * Layer 2: K full; V fused_output, one unit of all heads, r 6, biased.
 * gpt2 (8 kv heads):
 * Layer 0: K fused_query, units {0,1} r5, {2,3} r3, {4..7} r6, biased, with
 *          q_fused; V fused_output, one head per unit, r 1,2,3,4,4,3,2,1.
 * Layer 1: K prerope_latent, units {0..3} r7, {4..7} r2, biased; V full.
 * Layer 2: K fused_query, one unit of all heads r 9, no latent bias; V
 *          fused_output, units of 2 heads r 3,5,2,4, biased. */
static inline struct kv_lowrank *make_lr(const struct kv_model *m, int kv_bits, int hadamard,
                                         uint64_t seed) {
    const struct kv_config *c = kv_model_config(m);
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    cr_assert_not_null(lr);
    snprintf(lr->info.method, sizeof lr->info.method, "palu");
    snprintf(lr->info.alloc, sizeof lr->info.alloc, "uniform");
    lr->info.n_layers = c->n_layers, lr->info.dim = c->dim, lr->info.n_heads = c->n_heads;
    lr->info.n_kv_heads = c->n_kv_heads, lr->info.head_dim = c->head_dim;
    lr->info.kv_bits = kv_bits, lr->info.hadamard = hadamard;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_fingerprint(m, lr->info.model_fingerprint, &err), KV_OK);
    lr->layers = calloc((size_t)c->n_layers, sizeof *lr->layers);
    uint64_t s = seed;
    static const int64_t two[] = {2, 2}, one[] = {1, 1, 1, 1}, four[] = {4};
    static const int64_t r0k[] = {5, 3}, r0v[] = {2, 3, 4, 1}, r1k[] = {4, 2, 3, 1}, r2v[] = {6};
    struct kv_lr_layer *y = lr->layers;
    if (c->arch == KV_ARCH_GPT2) {
        static const int64_t g0k[] = {2, 2, 4}, g0kr[] = {5, 3, 6}, ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        static const int64_t g0vr[] = {1, 2, 3, 4, 4, 3, 2, 1}, g1k[] = {4, 4}, g1kr[] = {7, 2};
        static const int64_t g2k[] = {8}, g2kr[] = {9}, g2v[] = {2, 2, 2, 2}, g2vr[] = {3, 5, 2, 4};
        make_side(&y[0].k, KV_LR_FUSED_QUERY, 3, g0k, g0kr, 1, c, &s);
        make_side(&y[0].v, KV_LR_FUSED_OUTPUT, 8, ones, g0vr, 0, c, &s);
        make_side(&y[1].k, KV_LR_PREROPE_LATENT, 2, g1k, g1kr, 1, c, &s);
        make_side(&y[1].v, KV_LR_FULL, 0, NULL, NULL, 0, c, &s);
        make_side(&y[2].k, KV_LR_FUSED_QUERY, 1, g2k, g2kr, 0, c, &s);
        make_side(&y[2].v, KV_LR_FUSED_OUTPUT, 4, g2v, g2vr, 1, c, &s);
        make_q_fused(&y[0], c, &s);
        make_q_fused(&y[2], c, &s);
    } else {
        make_side(&y[0].k, KV_LR_PREROPE_LATENT, 2, two, r0k, 1, c, &s);
        make_side(&y[0].v, KV_LR_FUSED_OUTPUT, 4, one, r0v, 0, c, &s);
        make_side(&y[1].k, KV_LR_POSTROPE_ROTATION, 4, one, r1k, 0, c, &s);
        make_side(&y[1].v, KV_LR_FULL, 0, NULL, NULL, 0, c, &s);
        make_side(&y[2].k, KV_LR_FULL, 0, NULL, NULL, 0, c, &s);
        make_side(&y[2].v, KV_LR_FUSED_OUTPUT, 1, four, r2v, 1, c, &s);
    }
    for (int l = 0; l < 3; l++)
        if (y[l].v.mode == KV_LR_FUSED_OUTPUT) {
            y[l].o_cols = o_cols_of(&y[l].v, c);
            y[l].o_fused = rand_floats(c->dim * y[l].o_cols, &s);
        }
    return lr;
}

static inline struct kv_model *model_of(struct kv_config c, uint64_t seed) {
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &err), KV_OK, "%s", fmt_err(&err));
    return m;
}

static inline struct kv_model *make_model(int bias, uint64_t seed) {
    return model_of(small_cfg(bias), seed);
}

#define OPTIONS "{\"ratio\": 0.5, \"rank_multiple\": 1, \"eps\": null}"
#define STATS "{\"fingerprint\": \"abc\", \"tokens\": 4096}"

/* A fresh directory name inside a fresh temporary directory. */
static inline char *out_dir(char **parent) {
    *parent = kvt_temp_dir();
    return kvt_path(*parent, "out");
}

static inline void write_dir(const struct kv_model *m, const struct kv_lowrank *lr,
                             const char *dir) {
    struct kv_lr_dir_info info = {"models/base", NULL, OPTIONS, STATS};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_OK, "%s", fmt_err(&err));
}

/* Remove dir's files, dir, and the parent (test clean-up). */
static inline void rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *p = kvt_path(dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
            rm_tree(p);
        else
            unlink(p);
        free(p);
    }
    closedir(d);
    rmdir(dir);
}

static inline int64_t side_rank(const struct kv_lr_side *s) {
    int64_t r = 0;
    for (int64_t u = 0; u < s->n_units; u++) r += s->units[u].rank;
    return r;
}

/* ------------------------------------------------------------ comparisons */

static inline void assert_floats_eq(const float *a, const float *b, int64_t n, const char *what) {
    cr_assert((a == NULL) == (b == NULL), "%s: one is NULL", what);
    if (!a) return;
    for (int64_t i = 0; i < n; i++)
        cr_assert(memcmp(&a[i], &b[i], sizeof *a) == 0, "%s: element %lld is %.9g, want %.9g",
                  what, (long long)i, (double)a[i], (double)b[i]);
}

/* Everything of a and b agrees; with factors, bit for bit. */
static inline void assert_lr_eq(const struct kv_lowrank *a, const struct kv_lowrank *b,
                                int factors) {
    cr_assert_str_eq(a->info.method, b->info.method);
    cr_assert_str_eq(a->info.alloc, b->info.alloc);
    cr_assert_str_eq(a->info.model_fingerprint, b->info.model_fingerprint);
    cr_assert_eq(a->info.n_layers, b->info.n_layers);
    cr_assert_eq(a->info.dim, b->info.dim);
    cr_assert_eq(a->info.n_heads, b->info.n_heads);
    cr_assert_eq(a->info.n_kv_heads, b->info.n_kv_heads);
    cr_assert_eq(a->info.head_dim, b->info.head_dim);
    cr_assert_eq(a->info.kv_bits, b->info.kv_bits);
    cr_assert_eq(a->info.hadamard, b->info.hadamard);
    int64_t d = a->info.dim, dh = a->info.head_dim;
    for (int64_t l = 0; l < a->info.n_layers; l++) {
        const struct kv_lr_layer *x = &a->layers[l], *y = &b->layers[l];
        for (int w = 0; w < 2; w++) {
            const struct kv_lr_side *s = w ? &x->v : &x->k, *t = w ? &y->v : &y->k;
            cr_assert_eq(s->mode, t->mode, "layer %lld side %d", (long long)l, w);
            cr_assert_eq(s->n_units, t->n_units, "layer %lld side %d", (long long)l, w);
            for (int64_t u = 0; u < s->n_units; u++) {
                const struct kv_lr_unit *p = &s->units[u], *q = &t->units[u];
                char what[64];
                snprintf(what, sizeof what, "layer %lld %c unit %lld", (long long)l, "kv"[w],
                         (long long)u);
                cr_assert_eq(p->head0, q->head0, "%s", what);
                cr_assert_eq(p->n_heads, q->n_heads, "%s", what);
                cr_assert_eq(p->rank, q->rank, "%s", what);
                cr_assert(memcmp(&p->energy, &q->energy, sizeof p->energy) == 0,
                          "%s energy %.17g vs %.17g", what, p->energy, q->energy);
                cr_assert(memcmp(&p->dropped, &q->dropped, sizeof p->dropped) == 0,
                          "%s dropped %.17g vs %.17g", what, p->dropped, q->dropped);
                if (!factors) {
                    cr_assert(!q->down && !q->up && !q->rot && !q->down_bias, "%s", what);
                    continue;
                }
                assert_floats_eq(p->down, q->down, p->rank * d, what);
                assert_floats_eq(p->down_bias, q->down_bias, p->rank, what);
                assert_floats_eq(p->up, q->up, p->n_heads * dh * p->rank, what);
                assert_floats_eq(p->rot, q->rot, p->rank * dh, what);
            }
        }
        cr_assert_eq(x->o_cols, y->o_cols, "layer %lld", (long long)l);
        cr_assert_eq(x->q_cols, y->q_cols, "layer %lld", (long long)l);
        if (factors) {
            assert_floats_eq(x->o_fused, y->o_fused, d * x->o_cols, "o_fused");
            assert_floats_eq(x->q_fused, y->q_fused, x->q_cols * d, "q_fused");
            assert_floats_eq(x->q_fused_bias, y->q_fused_bias, x->q_cols, "q_fused_bias");
        } else {
            cr_assert(!y->o_fused && !y->q_fused && !y->q_fused_bias, "layer %lld", (long long)l);
        }
    }
}

/* ------------------------------------------------------------ manifest JSON */

static inline json_t *load_manifest(const char *dir) {
    char *p = kvt_path(dir, "kvcal.json");
    json_error_t je;
    json_t *root = json_load_file(p, JSON_REJECT_DUPLICATES, &je);
    cr_assert_not_null(root, "%s: %s", p, je.text);
    free(p);
    return root;
}


static inline double jnum(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "key '%s' is not a number", key);
    return json_number_value(v);
}

static inline int64_t jint(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_integer(v), "key '%s' is not an integer", key);
    return (int64_t)json_integer_value(v);
}

static inline const char *jstr(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}


/* ------------------------------------------------------------ corruption */

/* A valid directory to corrupt. */
struct fx {
    struct kv_model *m;
    struct kv_lowrank *lr;
    char *parent, *dir, *mpath, *wpath;
};

static inline void fx_init_arch(struct fx *f, int gpt2) {
    f->m = gpt2 ? model_of(gpt2_cfg(), 17) : make_model(0, 17);
    f->lr = make_lr(f->m, 16, 0, 23);
    f->dir = out_dir(&f->parent);
    write_dir(f->m, f->lr, f->dir);
    f->mpath = kvt_path(f->dir, "kvcal.json");
    f->wpath = kvt_path(f->dir, "model.safetensors");
}

static inline void fx_init(struct fx *f) { fx_init_arch(f, 0); }
                           
                           static inline void fx_free(struct fx *f) {
    kv_lr_free(f->lr);
    kv_model_close(f->m);
    rm_tree(f->parent);
    free(f->dir), free(f->parent), free(f->mpath), free(f->wpath);
}

static inline void edit_json(struct fx *f, void (*fn)(json_t *root)) {
    json_t *root = load_manifest(f->dir);
    fn(root);
    cr_assert_eq(json_dump_file(root, f->mpath, JSON_INDENT(2) | JSON_REAL_PRECISION(17)), 0);
    json_decref(root);
}

static inline json_t *side_json(json_t *root, int64_t l, const char *side) {
    return json_object_get(json_array_get(json_object_get(root, "layers"), (size_t)l), side);
}

static inline json_t *unit_json(json_t *root, int64_t l, const char *side, int64_t u) {
    return json_array_get(json_object_get(side_json(root, l, side), "units"), (size_t)u);
}

/* Rewrite model.safetensors without `drop` and with `narrow` one column
 * short; *off receives narrow's offset in the new file. */
static inline void rewrite_weights(struct fx *f, const char *drop, const char *narrow,
                                   uint64_t *off) {
    struct kv_st_file *st = NULL;
    struct kv_stw *w = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_st_open(f->wpath, &st, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_stw_init(&w, &err), KV_OK);
    int hit = 0;
    for (int64_t i = 0; i < st->n_tensors; i++) {
        const struct kv_tensor *t = &st->tensors[i];
        if (drop && !strcmp(t->name, drop)) {
            hit = 1;
            continue;
        }
        int64_t shape[4];
        memcpy(shape, t->shape, sizeof shape);
        uint64_t nb = t->nbytes;
        if (narrow && !strcmp(t->name, narrow)) {
            hit = 1;
            nb = nb / (uint64_t)shape[t->ndim - 1] * (uint64_t)(shape[t->ndim - 1] - 1);
            shape[t->ndim - 1]--;
        }
        cr_assert_eq(kv_stw_add(w, t->name, t->dtype, t->ndim, shape, t->data, nb, &err), KV_OK,
                     "%s", fmt_err(&err));
    }
    cr_assert(hit, "no tensor to drop or narrow");
    cr_assert_eq(kv_stw_write(w, f->wpath, &err), KV_OK, "%s", fmt_err(&err));
    kv_stw_free(w);
    kv_st_close(st);
    if (narrow) {
        cr_assert_eq(kv_st_open(f->wpath, &st, &err), KV_OK);
        *off = kv_st_find(st, narrow)->offset;
        kv_st_close(st);
    }
}

struct want_err {
    int code;
    int in_weights;  /* the error names model.safetensors (else kvcal.json) */
    uint64_t off;    /* KV_NO_OFFSET, or the offset expected */
    int any_off;     /* some offset, value not pinned */
    const char *needle;
};

static inline void set(json_t *o, const char *key, json_t *v) {
    cr_assert(json_is_object(o));
    cr_assert_eq(json_object_set_new(o, key, v), 0);
}

/* o[key] += delta */
static inline void bump(json_t *o, const char *key, json_int_t delta) {
    set(o, key, json_integer(json_integer_value(json_object_get(o, key)) + delta));
}


/* A newer manifest version (a row of the manifest table; `kvcal inspect`
 * reports it too). */
static inline void j_version(json_t *r) { set(r, "version", json_integer(2)); }

struct row {
    const char *name;
    void (*json_fn)(json_t *);
    int kind; /* 0 json edit, 1 unlink manifest, 2 truncate manifest, 3 drop tensor,
                 4 narrow tensor, 5 json edit with the error at tensor's offset */
    const char *tensor;
    struct want_err w;
    int gpt2; /* the directory of a gpt2 model (else llama) */
};

/* What kv_lr_dir_open says of the corrupted directory f (code, file,
 * offset, message: w->needle contained, or equal when exact) and, where
 * the manifest alone is at fault, that kv_lr_manifest_read agrees. */
static inline void check_opened(struct fx *pf, const struct row *r, const struct want_err *pw, int exact) {
    struct fx f = *pf;
    struct want_err w = *pw;
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_lr_dir_open(f.dir, f.m, &lr, &err);
    cr_assert_eq(rc, w.code, "%s: code %d, want %d (%s)", r->name, rc, w.code, fmt_err(&err));
    cr_assert_null(lr, "%s", r->name);
    cr_assert_str_eq(err.path, w.in_weights ? f.wpath : f.mpath, "%s", r->name);
    if (w.any_off)
        cr_assert_neq(err.off, KV_NO_OFFSET, "%s: no offset", r->name);
    else
        cr_assert_eq(err.off, w.off, "%s: offset %llu, want %llu", r->name,
                     (unsigned long long)err.off, (unsigned long long)w.off);
    if (exact)
        cr_assert_str_eq(err.msg, w.needle, "%s", r->name);
    else
        cr_assert(strstr(err.msg, w.needle), "%s: message '%s' lacks '%s'", r->name, err.msg,
                  w.needle);
    /* the manifest reader agrees wherever the manifest alone is at fault */
    if (!w.in_weights && w.code != KV_EINVAL) {
        struct kv_err e2;
        kv_err_clear(&e2);
        cr_assert_eq(kv_lr_manifest_read(f.mpath, &lr, &e2), w.code, "%s", r->name);
        cr_assert_str_eq(e2.msg, err.msg, "%s", r->name);
    }
}

/* Apply row r to a fresh valid directory and check what kv_lr_dir_open
 * says (code, file, offset, message) and, where the manifest alone is at
 * fault, that kv_lr_manifest_read agrees; also, when not NULL, runs on the
 * corrupted directory before it is removed. */
static inline void check_corruption(const struct row *r,
                                    void (*also)(const struct fx *, const struct row *,
                                                 const struct want_err *)) {
    struct fx f;
    fx_init_arch(&f, r->gpt2);
    struct want_err w = r->w;
    switch (r->kind) {
    case 0: edit_json(&f, r->json_fn); break;
    case 1: cr_assert_eq(unlink(f.mpath), 0); break;
    case 2: {
        size_t n = 0;
        char *b = kvt_read_file(f.mpath, &n);
        FILE *o = fopen(f.mpath, "wb");
        fwrite(b, 1, n / 2, o);
        fclose(o);
        free(b);
        break;
    }
    case 3: rewrite_weights(&f, r->tensor, NULL, NULL); break;
    case 4: rewrite_weights(&f, NULL, r->tensor, &w.off); break;
    case 5: {
        edit_json(&f, r->json_fn);
        struct kv_st_file *st = NULL;
        struct kv_err e;
        cr_assert_eq(kv_st_open(f.wpath, &st, &e), KV_OK);
        w.off = kv_st_find(st, r->tensor)->offset;
        kv_st_close(st);
        break;
    }
    }
    check_opened(&f, r, &w, 0);
    if (also) also(&f, r, &w);
    fx_free(&f);
}

#endif
