/* Compressed-model directories (formats/kvdir.c).
 *
 * kvdir_write: a hand-made kv_lowrank with every mode (prerope_latent K in
 *   units of 2 heads with a latent bias, postrope_rotation K, fused_output V
 *   with o_fused, full) on a random GQA model, with and without qkv biases,
 *   and fused_query K with q_fused (+ fused_output V) on a random gpt2
 *   model, written and read back factor for factor; the safetensors holds exactly
 *   the tensors the layout names, each equal to the model's or the factors'
 *   bytes (checked against a list built here); the manifest's fields, order,
 *   byte counts and errors are recomputed here; what the output path may
 *   already hold; and the writer's refusals.
 * kvdir_open: a corruption table over a valid llama or gpt2 directory (each
 *   row a clean error naming the file, the key or tensor, the offset when
 *   known) and models that are not the one the directory was made from.
 * kvdir_hf: an all-full directory from the shared HF model is itself a
 *   loadable HF checkpoint with the same fingerprint.
 * kvdir_inspect: `kvcal inspect DIR` in text and JSON. */
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

#include <criterion/parameterized.h>

/* ------------------------------------------------------------ fixtures */

/* dim 32, 3 layers, 8 query heads, 4 kv heads (GQA, 2 per group), head_dim 4. */
static struct kv_config small_cfg(int bias) {
    struct kv_config c = {0};
    c.dim = 32, c.hidden_dim = 40, c.n_layers = 3, c.n_heads = 8, c.n_kv_heads = 4;
    c.head_dim = 4, c.vocab_size = 50, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF, c.bos_id = 1, c.eos_id = 2;
    c.has_qkv_bias = bias;
    c.tied_embeddings = !bias; /* cover both heads */
    return c;
}

/* gpt2: dim 32, 3 layers, 8 heads (n_kv_heads = n_heads), head_dim 4, biases. */
static struct kv_config gpt2_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPT2;
    c.dim = 32, c.hidden_dim = 40, c.n_layers = 3, c.n_heads = 8, c.n_kv_heads = 8;
    c.head_dim = 4, c.vocab_size = 50, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_layout = KV_ROPE_HALF, c.bos_id = 1, c.eos_id = 2;
    c.has_qkv_bias = 1, c.tied_embeddings = 1;
    return c;
}

static const char *fmt_err(const struct kv_err *e) {
    static char buf[2200];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double urand(uint64_t *s) { return (double)(splitmix(s) >> 11) * 0x1.0p-53; }

static float *rand_floats(int64_t n, uint64_t *s) {
    float *p = malloc((size_t)n * sizeof *p);
    cr_assert_not_null(p);
    for (int64_t i = 0; i < n; i++) p[i] = (float)(2 * urand(s) - 1);
    return p;
}

/* Units of `sizes` kv heads each with `ranks`, random factors for mode. */
static void make_side(struct kv_lr_side *s, enum kv_lr_mode mode, int n, const int64_t *sizes,
                      const int64_t *ranks, int bias, const struct kv_config *c, uint64_t *seed) {
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
static int64_t o_cols_of(const struct kv_lr_side *s, const struct kv_config *c) {
    int64_t cols = 0, per = c->n_heads / c->n_kv_heads;
    for (int64_t i = 0; i < c->n_heads; i++)
        for (int64_t u = 0; u < s->n_units; u++)
            if (i / per >= s->units[u].head0 && i / per < s->units[u].head0 + s->units[u].n_heads)
                cols += s->units[u].rank;
    return cols;
}

/* fused_query keys: q_fused [q_cols, d] and its bias (the model has q biases). */
static void make_q_fused(struct kv_lr_layer *y, const struct kv_config *c, uint64_t *seed) {
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
static struct kv_lowrank *make_lr(const struct kv_model *m, int kv_bits, int hadamard,
                                  uint64_t seed) {
    const struct kv_config *c = kv_model_config(m);
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    cr_assert_not_null(lr);
    snprintf(lr->method, sizeof lr->method, "palu");
    snprintf(lr->alloc, sizeof lr->alloc, "uniform");
    lr->n_layers = c->n_layers, lr->dim = c->dim, lr->n_heads = c->n_heads;
    lr->n_kv_heads = c->n_kv_heads, lr->head_dim = c->head_dim;
    lr->kv_bits = kv_bits, lr->hadamard = hadamard;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_fingerprint(m, lr->model_fingerprint, &err), KV_OK);
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

static struct kv_model *model_of(struct kv_config c, uint64_t seed) {
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &err), KV_OK, "%s", fmt_err(&err));
    return m;
}

static struct kv_model *make_model(int bias, uint64_t seed) { return model_of(small_cfg(bias), seed); }

static const char *OPTIONS = "{\"ratio\": 0.5, \"rank_multiple\": 1, \"eps\": null}";
static const char *STATS = "{\"fingerprint\": \"abc\", \"tokens\": 4096}";

/* A fresh directory name inside a fresh temporary directory. */
static char *out_dir(char **parent) {
    *parent = kvt_temp_dir();
    return kvt_path(*parent, "out");
}

static void write_dir(const struct kv_model *m, const struct kv_lowrank *lr, const char *dir) {
    struct kv_lr_dir_info info = {"models/base", NULL, OPTIONS, STATS};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_OK, "%s", fmt_err(&err));
}

/* Remove dir's files, dir, and the parent (test clean-up). */
static void rm_tree(const char *dir) {
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

static int64_t side_rank(const struct kv_lr_side *s) {
    int64_t r = 0;
    for (int64_t u = 0; u < s->n_units; u++) r += s->units[u].rank;
    return r;
}

/* ------------------------------------------------------------ comparisons */

static void assert_floats_eq(const float *a, const float *b, int64_t n, const char *what) {
    cr_assert((a == NULL) == (b == NULL), "%s: one is NULL", what);
    if (!a) return;
    for (int64_t i = 0; i < n; i++)
        cr_assert(memcmp(&a[i], &b[i], sizeof *a) == 0, "%s: element %lld is %.9g, want %.9g",
                  what, (long long)i, (double)a[i], (double)b[i]);
}

/* Everything of a and b agrees; with factors, bit for bit. */
static void assert_lr_eq(const struct kv_lowrank *a, const struct kv_lowrank *b, int factors) {
    cr_assert_str_eq(a->method, b->method);
    cr_assert_str_eq(a->alloc, b->alloc);
    cr_assert_str_eq(a->model_fingerprint, b->model_fingerprint);
    cr_assert_eq(a->n_layers, b->n_layers);
    cr_assert_eq(a->dim, b->dim);
    cr_assert_eq(a->n_heads, b->n_heads);
    cr_assert_eq(a->n_kv_heads, b->n_kv_heads);
    cr_assert_eq(a->head_dim, b->head_dim);
    cr_assert_eq(a->kv_bits, b->kv_bits);
    cr_assert_eq(a->hadamard, b->hadamard);
    int64_t d = a->dim, dh = a->head_dim;
    for (int64_t l = 0; l < a->n_layers; l++) {
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

/* ------------------------------------------------------------ round trip */

static void round_trip(struct kv_config cfg, int kv_bits, int hadamard) {
    struct kv_model *m = model_of(cfg, 7);
    struct kv_lowrank *lr = make_lr(m, kv_bits, hadamard, 99);
    char *parent, *dir = out_dir(&parent);
    write_dir(m, lr, dir);

    struct kv_lowrank *back = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(dir, m, &back, &err), KV_OK, "%s", fmt_err(&err));
    assert_lr_eq(lr, back, 1);
    cr_assert_eq(kv_lr_bytes(back, back->kv_bits), kv_lr_bytes(lr, lr->kv_bits));

    /* the manifest alone: same shapes, no factors */
    struct kv_lowrank *mf = NULL;
    char *mpath = kvt_path(dir, "kvcal.json");
    cr_assert_eq(kv_lr_manifest_read(mpath, &mf, &err), KV_OK, "%s", fmt_err(&err));
    assert_lr_eq(lr, mf, 0);

    /* nothing else is left beside the output */
    DIR *d = opendir(parent);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    cr_assert_eq(n, 1, "the temporary directory was left behind");

    kv_lr_free(mf);
    kv_lr_free(back);
    kv_lr_free(lr);
    kv_model_close(m);
    free(mpath);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvdir_write, round_trip_every_mode_without_bias) { round_trip(small_cfg(0), 16, 0); }
Test(kvdir_write, round_trip_every_mode_with_qkv_bias_quantized) {
    round_trip(small_cfg(1), 4, 1);
}
Test(kvdir_write, round_trip_gpt2_fused_query_and_fused_output) { round_trip(gpt2_cfg(), 16, 0); }
Test(kvdir_write, round_trip_gpt2_quantized) { round_trip(gpt2_cfg(), 3, 1); }

/* ------------------------------------------------------------ safetensors */

struct want_t {
    char name[128];
    int64_t rows, cols; /* cols 0: a vector */
    const float *data;
};

struct wants {
    struct want_t t[256];
    int n;
    float *bufs[64];
    int nb;
};

static void want(struct wants *w, const char *name, int64_t rows, int64_t cols, const float *data) {
    cr_assert(w->n < 256);
    cr_assert_not_null(data, "%s: no data", name);
    struct want_t *t = &w->t[w->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows, t->cols = cols, t->data = data;
}

/* The layout of kvdir.h, spelt out independently of the writer. */
static void expected_tensors(const struct kv_model *m, const struct kv_lowrank *lr,
                             struct wants *w) {
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, dh = c->head_dim, qd = c->n_heads * dh, kvd = c->n_kv_heads * dh;
    int64_t ff = c->hidden_dim;
    int gpt2 = c->arch == KV_ARCH_GPT2;
    const char *P = gpt2 ? "transformer.h" : "model.layers", *A = gpt2 ? "attn" : "self_attn";
    char nm[128];
    if (gpt2) {
        want(w, "transformer.wte.weight", c->vocab_size, d, m->tok_emb);
        want(w, "transformer.wpe.weight", c->max_seq_len, d, m->pos_emb);
        want(w, "transformer.ln_f.weight", d, 0, m->out_norm);
        want(w, "transformer.ln_f.bias", d, 0, m->out_norm_b);
    } else {
        want(w, "model.embed_tokens.weight", c->vocab_size, d, m->tok_emb);
        want(w, "model.norm.weight", d, 0, m->out_norm);
    }
    if (!c->tied_embeddings) want(w, "lm_head.weight", c->vocab_size, d, m->lm_head);
    /* per-layer tensors that are neither attention projections nor K/V */
    static const struct {
        const char *name;
        enum kv_wkind kind;
        int gpt2;
    } plain[] = {
        {"input_layernorm.weight", KV_W_ATTN_NORM, 0},
        {"post_attention_layernorm.weight", KV_W_FFN_NORM, 0},
        {"mlp.gate_proj.weight", KV_W_GATE, 0},
        {"mlp.up_proj.weight", KV_W_UP, 0},
        {"mlp.down_proj.weight", KV_W_DOWN, 0},
        {"ln_1.weight", KV_W_ATTN_NORM, 1},
        {"ln_1.bias", KV_W_ATTN_NORM_B, 1},
        {"attn.o_proj.bias", KV_W_BO, 1},
        {"ln_2.weight", KV_W_FFN_NORM, 1},
        {"ln_2.bias", KV_W_FFN_NORM_B, 1},
        {"mlp.c_fc.weight", KV_W_UP, 1},
        {"mlp.c_fc.bias", KV_W_BUP, 1},
        {"mlp.c_proj.weight", KV_W_DOWN, 1},
        {"mlp.c_proj.bias", KV_W_BDOWN, 1},
    };
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *W = m->layers[l].w;
        const struct kv_lr_layer *y = &lr->layers[l];
#define N(fmt, ...) (snprintf(nm, sizeof nm, "%s.%lld." fmt, P, (long long)l, __VA_ARGS__), nm)
        for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
            if (plain[i].gpt2 != gpt2) continue;
            enum kv_wkind k = plain[i].kind;
            int64_t rows = k == KV_W_GATE || k == KV_W_UP || k == KV_W_BUP ? ff : d;
            int64_t cols = k == KV_W_GATE || k == KV_W_UP ? d : k == KV_W_DOWN ? ff : 0;
            want(w, N("%s", plain[i].name), rows, cols, W[k]);
        }
        if (y->k.mode == KV_LR_FUSED_QUERY) {
            want(w, N("%s.q_fused.weight", A), y->q_cols, d, y->q_fused);
            if (c->has_qkv_bias) want(w, N("%s.q_fused.bias", A), y->q_cols, 0, y->q_fused_bias);
        } else {
            want(w, N("%s.q_proj.weight", A), qd, d, W[KV_W_Q]);
            if (c->has_qkv_bias) want(w, N("%s.q_proj.bias", A), qd, 0, W[KV_W_BQ]);
        }
        if (y->v.mode == KV_LR_FUSED_OUTPUT)
            want(w, N("%s.o_proj.weight", A), d, y->o_cols, y->o_fused);
        else
            want(w, N("%s.o_proj.weight", A), d, qd, W[KV_W_O]);
        for (int s = 0; s < 2; s++) {
            const struct kv_lr_side *sd = s ? &y->v : &y->k;
            char p = "kv"[s];
            if (sd->mode == KV_LR_FULL || sd->mode == KV_LR_POSTROPE_ROTATION) {
                want(w, N("%s.%c_proj.weight", A, p), kvd, d, W[s ? KV_W_V : KV_W_K]);
                if (c->has_qkv_bias)
                    want(w, N("%s.%c_proj.bias", A, p), kvd, 0, W[s ? KV_W_BV : KV_W_BK]);
                for (int64_t u = 0; u < sd->n_units; u++)
                    want(w, N("%s.%c_rot.%lld.weight", A, p, (long long)u), sd->units[u].rank, dh,
                         sd->units[u].rot);
                continue;
            }
            /* stacked down (and bias) in unit order */
            int64_t r = side_rank(sd), off = 0;
            float *down = malloc((size_t)(r * d) * sizeof *down);
            float *bias = sd->units[0].down_bias ? malloc((size_t)r * sizeof *bias) : NULL;
            for (int64_t u = 0; u < sd->n_units; u++) {
                for (int64_t i = 0; i < sd->units[u].rank * d; i++)
                    down[off * d + i] = sd->units[u].down[i];
                for (int64_t i = 0; bias && i < sd->units[u].rank; i++)
                    bias[off + i] = sd->units[u].down_bias[i];
                off += sd->units[u].rank;
                want(w, N("%s.%c_up.%lld.weight", A, p, (long long)u), sd->units[u].n_heads * dh,
                     sd->units[u].rank, sd->units[u].up);
            }
            w->bufs[w->nb++] = down;
            want(w, N("%s.%c_down.weight", A, p), r, d, down);
            if (bias) {
                w->bufs[w->nb++] = bias;
                want(w, N("%s.%c_down.bias", A, p), r, 0, bias);
            }
        }
#undef N
    }
}

static void check_safetensors(struct kv_config cfg) {
    struct kv_model *m = model_of(cfg, 11);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 5);
    char *parent, *dir = out_dir(&parent);
    write_dir(m, lr, dir);
    char *wpath = kvt_path(dir, "model.safetensors");
    struct kv_st_file *f = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_st_open(wpath, &f, &err), KV_OK, "%s", fmt_err(&err));
    struct wants *w = calloc(1, sizeof *w);
    expected_tensors(m, lr, w);
    cr_assert_eq(f->n_tensors, w->n, "the file holds %lld tensors, the layout names %d",
                 (long long)f->n_tensors, w->n);
    for (int i = 0; i < w->n; i++) {
        const struct want_t *x = &w->t[i];
        const struct kv_tensor *t = kv_st_find(f, x->name);
        cr_assert_not_null(t, "missing tensor '%s'", x->name);
        cr_assert_eq(t->dtype, KV_DTYPE_F32, "%s", x->name);
        int nd = x->cols ? 2 : 1;
        cr_assert_eq(t->ndim, nd, "%s", x->name);
        cr_assert_eq(t->shape[0], x->rows, "%s", x->name);
        if (nd == 2) cr_assert_eq(t->shape[1], x->cols, "%s", x->name);
        int64_t n = x->rows * (x->cols ? x->cols : 1);
        cr_assert_eq(t->nbytes, (uint64_t)n * 4, "%s", x->name);
        cr_assert(memcmp(t->data, x->data, (size_t)n * 4) == 0, "%s: bytes differ", x->name);
    }
    cr_assert_str_eq(kv_st_meta(f, "format"), "pt");
    for (int i = 0; i < w->nb; i++) free(w->bufs[i]);
    free(w);
    kv_st_close(f);
    kv_lr_free(lr);
    kv_model_close(m);
    free(wpath);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvdir_write, safetensors_holds_exactly_the_layout_without_bias) {
    check_safetensors(small_cfg(0));
}
Test(kvdir_write, safetensors_holds_exactly_the_layout_with_bias) {
    check_safetensors(small_cfg(1));
}
Test(kvdir_write, safetensors_holds_exactly_the_gpt2_layout) { check_safetensors(gpt2_cfg()); }
Test(kvdir_write, safetensors_holds_exactly_the_untied_gpt2_layout) {
    struct kv_config c = gpt2_cfg();
    c.tied_embeddings = 0;
    check_safetensors(c);
}

/* ------------------------------------------------------------ manifest */

static json_t *load_manifest(const char *dir) {
    char *p = kvt_path(dir, "kvcal.json");
    json_error_t je;
    json_t *root = json_load_file(p, JSON_REJECT_DUPLICATES, &je);
    cr_assert_not_null(root, "%s: %s", p, je.text);
    free(p);
    return root;
}

static void assert_keys(const json_t *o, const char *const *keys, size_t n, const char *what) {
    size_t i = 0;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)o, k, v) {
        cr_assert(i < n, "%s: unexpected key '%s'", what, k);
        cr_assert_str_eq(k, keys[i], "%s: key %zu", what, i);
        i++;
    }
    cr_assert_eq(i, n, "%s: %zu keys, want %zu", what, i, n);
}

static double jnum(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "key '%s' is not a number", key);
    return json_number_value(v);
}

static int64_t jint(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_integer(v), "key '%s' is not an integer", key);
    return (int64_t)json_integer_value(v);
}

static const char *jstr(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* KV bytes/token recomputed from the description of kv_lr_bytes. */
static int64_t unit_bytes(int64_t rank, int bits) {
    return bits >= 16 ? 2 * rank : (rank * bits + 7) / 8 + 2 + 2;
}

static void check_manifest(struct kv_config cfg, int bits) {
    struct kv_model *m = model_of(cfg, 3);
    const struct kv_config *c = kv_model_config(m);
    int bias = c->has_qkv_bias, gpt2 = c->arch == KV_ARCH_GPT2;
    struct kv_lowrank *lr = make_lr(m, bits, bits < 16, 21);
    char *parent, *dir = out_dir(&parent);
    write_dir(m, lr, dir);
    json_t *root = load_manifest(dir);

    static const char *const top[] = {
        "format", "version", "kvcal_version", "method", "alloc", "options", "model", "stats",
        "rope", "latent", "weights", "weight_layout", "kv_bytes_per_token", "predicted_error",
        "layers"};
    assert_keys(root, top, sizeof top / sizeof top[0], "manifest");
    cr_assert_str_eq(jstr(root, "format"), "kvcal.manifest");
    cr_assert_eq(jint(root, "version"), 1);
    cr_assert_str_eq(jstr(root, "method"), "palu");
    cr_assert_str_eq(jstr(root, "alloc"), "uniform");
    cr_assert_str_eq(jstr(root, "weights"), "model.safetensors");
    cr_assert_str_eq(jstr(root, "weight_layout"), "linear [out, in]");
    json_t *opt = json_loads(OPTIONS, 0, NULL), *st = json_loads(STATS, 0, NULL);
    cr_assert(json_equal(json_object_get(root, "options"), opt), "options not copied verbatim");
    cr_assert(json_equal(json_object_get(root, "stats"), st), "stats not copied verbatim");
    json_decref(opt), json_decref(st);

    json_t *mo = json_object_get(root, "model");
    static const char *const mkeys[] = {"fingerprint", "source", "format", "arch", "dim",
                                        "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                        "head_dim", "vocab_size", "norm_eps", "tied_embeddings",
                                        "qkv_bias"};
    size_t i = 0;
    const char *k;
    json_t *v;
    json_object_foreach(mo, k, v) {
        if (i < sizeof mkeys / sizeof mkeys[0]) cr_assert_str_eq(k, mkeys[i], "model key %zu", i);
        i++;
    }
    cr_assert_str_eq(jstr(mo, "fingerprint"), lr->model_fingerprint);
    cr_assert_str_eq(jstr(mo, "source"), "models/base");
    cr_assert_str_eq(jstr(mo, "format"), "synthetic");
    cr_assert_str_eq(jstr(mo, "arch"), gpt2 ? "gpt2" : "llama");
    cr_assert_eq(jint(mo, "dim"), c->dim);
    cr_assert_eq(jint(mo, "n_kv_heads"), c->n_kv_heads);
    cr_assert_eq(jint(mo, "head_dim"), c->head_dim);
    cr_assert_eq((float)jnum(mo, "norm_eps"), c->norm_eps);
    cr_assert_eq(json_is_true(json_object_get(mo, "qkv_bias")), bias);
    cr_assert_eq(json_is_true(json_object_get(mo, "tied_embeddings")), c->tied_embeddings);

    json_t *ro = json_object_get(root, "rope");
    if (gpt2) {
        cr_assert(json_is_null(ro), "gpt2 has no rope: 'rope' must be null");
    } else {
        cr_assert_str_eq(jstr(ro, "layout"), "half");
        cr_assert_str_eq(jstr(ro, "pairs"), "(i, i + d_h/2)");
        cr_assert_eq(jnum(ro, "theta"), 10000.0);
        cr_assert(json_is_null(json_object_get(ro, "scaling")));
    }

    json_t *lo = json_object_get(root, "latent");
    cr_assert_eq(jint(lo, "bits"), bits);
    cr_assert_str_eq(jstr(lo, "dtype"), bits == 16 ? "f16" : "int");
    json_t *q = json_object_get(lo, "quantization");
    if (bits == 16) {
        cr_assert(json_is_null(q));
    } else {
        cr_assert_str_eq(jstr(q, "scheme"), "per-token asymmetric");
        cr_assert_str_eq(jstr(q, "group"), "unit");
        cr_assert_str_eq(jstr(q, "dequant"), "z = q * scale + zero");
    }
    cr_assert_eq(json_is_true(json_object_get(lo, "hadamard")), bits < 16);

    /* bytes and errors, recomputed */
    int64_t base = c->n_layers * 2 * c->n_kv_heads * c->head_dim * 2, comp = 0;
    double en[2] = {0, 0}, dr[2] = {0, 0};
    json_t *layers = json_object_get(root, "layers");
    cr_assert_eq((int64_t)json_array_size(layers), c->n_layers);
    for (int64_t l = 0; l < c->n_layers; l++) {
        json_t *yo = json_array_get(layers, (size_t)l);
        cr_assert_eq(jint(yo, "index"), l);
        for (int s = 0; s < 2; s++) {
            const struct kv_lr_side *sd = s ? &lr->layers[l].v : &lr->layers[l].k;
            json_t *so = json_object_get(yo, s ? "v" : "k");
            char attn[96], pre[100];
            snprintf(attn, sizeof attn, gpt2 ? "transformer.h.%lld.attn." : "model.layers.%lld.self_attn.",
                     (long long)l);
            snprintf(pre, sizeof pre, "%s%c", attn, "kv"[s]);
            char nm[160];
            cr_assert_str_eq(jstr(so, "mode"), kv_lr_mode_name(sd->mode));
            cr_assert_eq(jint(so, "rank"), side_rank(sd));
            int latent = sd->mode == KV_LR_PREROPE_LATENT || sd->mode == KV_LR_FUSED_QUERY ||
                         sd->mode == KV_LR_FUSED_OUTPUT;
            snprintf(nm, sizeof nm, "%s_down.weight", pre);
            if (latent)
                cr_assert_str_eq(jstr(so, "down"), nm);
            else
                cr_assert(json_is_null(json_object_get(so, "down")));
            snprintf(nm, sizeof nm, "%s_down.bias", pre);
            if (latent && sd->units[0].down_bias)
                cr_assert_str_eq(jstr(so, "down_bias"), nm);
            else
                cr_assert(json_is_null(json_object_get(so, "down_bias")));
            snprintf(nm, sizeof nm, "%s_proj.weight", pre);
            if (!latent)
                cr_assert_str_eq(jstr(so, "proj"), nm);
            else
                cr_assert(json_is_null(json_object_get(so, "proj")));
            if (s) {
                snprintf(nm, sizeof nm, "%so_proj.weight", attn);
                cr_assert_str_eq(jstr(so, "o_proj"), nm);
                if (sd->mode == KV_LR_FUSED_OUTPUT)
                    cr_assert_eq(jint(so, "o_cols"), o_cols_of(sd, c));
                else
                    cr_assert_null(json_object_get(so, "o_cols"));
            } else if (sd->mode == KV_LR_FUSED_QUERY) {
                /* the query heads' unit ranks, as for o_cols */
                cr_assert_eq(jint(so, "q_cols"), o_cols_of(sd, c));
                snprintf(nm, sizeof nm, "%sq_fused.weight", attn);
                cr_assert_str_eq(jstr(so, "q_proj"), nm);
                snprintf(nm, sizeof nm, "%sq_fused.bias", attn);
                cr_assert_str_eq(jstr(so, "q_proj_bias"), nm);
            } else {
                cr_assert(!json_object_get(so, "q_proj") && !json_object_get(so, "q_proj_bias") &&
                          !json_object_get(so, "q_cols"));
            }
            json_t *units = json_object_get(so, "units");
            cr_assert_eq((int64_t)json_array_size(units), sd->n_units);
            double se = 0, sdr = 0;
            int64_t off = 0;
            if (sd->mode == KV_LR_FULL) comp += c->n_kv_heads * c->head_dim * 2;
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *x = &sd->units[u];
                json_t *uo = json_array_get(units, (size_t)u), *hs = json_object_get(uo, "heads");
                cr_assert_eq((int64_t)json_array_size(hs), x->n_heads);
                for (int64_t j = 0; j < x->n_heads; j++)
                    cr_assert_eq(json_integer_value(json_array_get(hs, (size_t)j)), x->head0 + j);
                cr_assert_eq(jint(uo, "rank"), x->rank);
                cr_assert_eq(jint(uo, "latent_offset"), off);
                snprintf(nm, sizeof nm, "%s_up.%lld.weight", pre, (long long)u);
                if (latent) cr_assert_str_eq(jstr(uo, "up"), nm);
                snprintf(nm, sizeof nm, "%s_rot.%lld.weight", pre, (long long)u);
                if (sd->mode == KV_LR_POSTROPE_ROTATION)
                    cr_assert_str_eq(jstr(uo, "rot"), nm);
                else
                    cr_assert(json_is_null(json_object_get(uo, "rot")));
                cr_assert_eq(jnum(uo, "energy"), x->energy);
                cr_assert_eq(jnum(uo, "dropped"), x->dropped);
                kvt_assert_close_f64((double[]){jnum(uo, "predicted_error")},
                                     (double[]){x->dropped / x->energy}, 1, 0, 1e-15,
                                     "unit predicted_error");
                off += x->rank;
                se += x->energy, sdr += x->dropped;
                comp += unit_bytes(x->rank, bits);
            }
            kvt_assert_close_f64((double[]){jnum(so, "predicted_error")},
                                 (double[]){se > 0 ? sdr / se : 0}, 1, 0, 1e-15,
                                 "side predicted_error");
            en[s] += se, dr[s] += sdr;
        }
    }
    json_t *bo = json_object_get(root, "kv_bytes_per_token");
    cr_assert_eq(jint(bo, "base"), base);
    cr_assert_eq(jint(bo, "compressed"), comp);
    cr_assert(comp < base, "the example compresses");
    kvt_assert_close_f64((double[]){jnum(bo, "ratio")}, (double[]){(double)comp / (double)base},
                         1, 0, 1e-15, "ratio");
    json_t *po = json_object_get(root, "predicted_error");
    kvt_assert_close_f64((double[]){jnum(po, "k"), jnum(po, "v")},
                         (double[]){dr[0] / en[0], dr[1] / en[1]}, 2, 0, 1e-15,
                         "predicted_error");
    json_decref(root);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvdir_write, manifest_fields_f16) { check_manifest(small_cfg(0), 16); }
Test(kvdir_write, manifest_fields_quantized) { check_manifest(small_cfg(1), 3); }
Test(kvdir_write, manifest_fields_gpt2) { check_manifest(gpt2_cfg(), 16); }

Test(kvdir_write, copies_the_tokenizer_of_a_non_hf_source) {
    struct kv_model *m = make_model(0, 1);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    char *parent, *dir = out_dir(&parent);
    char *tok = kvt_path(parent, "tok512.bin");
    static const char bytes[] = "not really a tokenizer \x01\x02";
    FILE *f = fopen(tok, "wb");
    cr_assert_not_null(f);
    fwrite(bytes, 1, sizeof bytes, f);
    fclose(f);
    struct kv_lr_dir_info info = {"model.bin", tok, NULL, NULL};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_OK, "%s", fmt_err(&err));
    char *copy = kvt_path(dir, "tok512.bin");
    size_t n = 0;
    char *got = kvt_read_file(copy, &n);
    cr_assert_not_null(got);
    cr_assert_eq(n, sizeof bytes);
    cr_assert(memcmp(got, bytes, n) == 0);
    char *cfg = kvt_path(dir, "config.json");
    cr_assert_neq(access(cfg, F_OK), 0, "no config.json is invented");
    json_t *root = load_manifest(dir);
    json_t *empty = json_object();
    cr_assert(json_equal(json_object_get(root, "options"), empty));
    json_decref(empty);
    cr_assert(json_is_null(json_object_get(root, "stats")));
    cr_assert_str_eq(jstr(json_object_get(root, "model"), "tokenizer"), "tok512.bin");
    json_decref(root);
    free(got), free(copy), free(cfg), free(tok);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ output path */

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

Test(kvdir_write, refuses_a_non_empty_directory_without_manifest) {
    struct kv_model *m = make_model(0, 1);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    char *parent, *dir = out_dir(&parent);
    cr_assert_eq(mkdir(dir, 0755), 0);
    char *keep = kvt_path(dir, "keep.txt");
    FILE *f = fopen(keep, "w");
    fputs("mine", f);
    fclose(f);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, NULL, dir, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, dir);
    cr_assert(strstr(err.msg, "not empty"), "%s", err.msg);
    cr_assert_eq(access(keep, F_OK), 0, "the user's file was removed");
    cr_assert_eq(count_entries(dir), 1);
    cr_assert_eq(count_entries(parent), 1, "a temporary was left behind");

    /* a plain file at the path */
    char *file = kvt_path(parent, "file");
    f = fopen(file, "w");
    fclose(f);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, NULL, file, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert(strstr(err.msg, "not a directory"), "%s", err.msg);
    free(file), free(keep);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvdir_write, replaces_an_empty_directory_and_an_earlier_output) {
    struct kv_model *m = make_model(0, 1);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    char *parent, *dir = out_dir(&parent);
    cr_assert_eq(mkdir(dir, 0755), 0);
    write_dir(m, lr, dir);
    char *stale = kvt_path(dir, "stale.bin");
    FILE *f = fopen(stale, "w");
    fclose(f);
    snprintf(lr->method, sizeof lr->method, "eigen");
    char *slash = malloc(strlen(dir) + 2);
    sprintf(slash, "%s/", dir); /* a trailing slash names the same directory */
    write_dir(m, lr, slash);
    cr_assert_neq(access(stale, F_OK), 0, "the earlier output's file survived");
    json_t *root = load_manifest(dir);
    cr_assert_str_eq(jstr(root, "method"), "eigen");
    json_decref(root);
    cr_assert_eq(count_entries(parent), 1);
    free(slash), free(stale);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ writer refusals */

Test(kvdir_write, refuses_factors_that_do_not_describe_the_model) {
    struct kv_model *m = make_model(0, 1);
    char *parent, *dir = out_dir(&parent);
    struct kv_err err;
    static const struct {
        const char *what, *needle;
    } rows[] = {
        {"overlap", "overlap"},
        {"gap", "in no unit"},
        {"rank", "rank 0 is not within"},
        {"fingerprint", "made from model"},
        {"o_cols", "fused output projection"},
        {"bias", "down_bias"},
        {"bits", "latent bits"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
        struct kv_lr_side *k0 = &lr->layers[0].k;
        switch (i) {
        case 0: k0->units[1].head0 = 1; break;
        case 1: k0->units[1].head0 = 3, k0->units[1].n_heads = 1; break;
        case 2: lr->layers[1].k.units[2].rank = 0; break;
        case 3: lr->model_fingerprint[0] = lr->model_fingerprint[0] == '0' ? '1' : '0'; break;
        case 4: lr->layers[0].o_cols--; break;
        case 5: free(k0->units[1].down_bias), k0->units[1].down_bias = NULL; break;
        case 6: lr->kv_bits = 5; break;
        }
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_dir_write(m, lr, NULL, dir, &err), KV_EINVAL, "%s: %s", rows[i].what,
                     fmt_err(&err));
        cr_assert(strstr(err.msg, rows[i].needle), "%s: '%s' lacks '%s'", rows[i].what, err.msg,
                  rows[i].needle);
        cr_assert_neq(access(dir, F_OK), 0, "%s: the directory was created", rows[i].what);
        kv_lr_free(lr);
    }
    /* fused query keys: on gpt2 only, with q_fused of the units' rows and a
     * bias exactly when the model has a q bias */
    struct kv_model *g2 = model_of(gpt2_cfg(), 1);
    static const struct {
        const char *what, *needle;
    } qrows[] = {
        {"q_cols", "layer 0 k: fused query projection is set with 39 rows, expected 40"},
        {"q_fused", "layer 2 k: fused query projection is NULL"},
        {"q bias", "layer 0 k: fused query bias is NULL but the model has a q bias"},
        {"stray q_fused", "layer 1 k: a fused query projection is set but the mode is "
                          "'prerope_latent'"},
        {"llama", "layer 0 k: mode 'fused_query' needs a model without rope"},
    };
    for (size_t i = 0; i < sizeof qrows / sizeof qrows[0]; i++) {
        struct kv_lowrank *lr = make_lr(g2, 16, 0, 2);
        struct kv_lr_layer *y = lr->layers;
        struct kv_model *llama = NULL;
        const struct kv_model *target = g2;
        switch (i) {
        case 0: y[0].q_cols--; break;
        case 1: free(y[2].q_fused), y[2].q_fused = NULL; break;
        case 2: free(y[0].q_fused_bias), y[0].q_fused_bias = NULL; break;
        case 3: y[1].q_fused = malloc(sizeof(float)); break;
        case 4: { /* the same factors for a llama model of gpt2's shapes */
            struct kv_config lc = gpt2_cfg();
            lc.arch = KV_ARCH_LLAMA, lc.rope_theta = 10000.0f;
            target = llama = model_of(lc, 1);
            cr_assert_eq(kv_model_fingerprint(llama, lr->model_fingerprint, &err), KV_OK);
            break;
        }
        }
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_dir_write(target, lr, NULL, dir, &err), KV_EINVAL, "%s: %s",
                     qrows[i].what, fmt_err(&err));
        cr_assert(strstr(err.msg, qrows[i].needle), "%s: '%s' lacks '%s'", qrows[i].what,
                  err.msg, qrows[i].needle);
        cr_assert_neq(access(dir, F_OK), 0, "%s: the directory was created", qrows[i].what);
        kv_lr_free(lr);
        kv_model_close(llama);
    }
    kv_model_close(g2);
    /* options that are not an object */
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    struct kv_lr_dir_info info = {NULL, NULL, "[1, 2]", NULL};
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert(strstr(err.msg, "options"), "%s", err.msg);
    cr_assert_eq(count_entries(parent), 0, "a temporary was left behind");
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ corruption */

/* A valid directory to corrupt. */
struct fx {
    struct kv_model *m;
    struct kv_lowrank *lr;
    char *parent, *dir, *mpath, *wpath;
};

static void fx_init_arch(struct fx *f, int gpt2) {
    f->m = gpt2 ? model_of(gpt2_cfg(), 17) : make_model(0, 17);
    f->lr = make_lr(f->m, 16, 0, 23);
    f->dir = out_dir(&f->parent);
    write_dir(f->m, f->lr, f->dir);
    f->mpath = kvt_path(f->dir, "kvcal.json");
    f->wpath = kvt_path(f->dir, "model.safetensors");
}

static void fx_init(struct fx *f) { fx_init_arch(f, 0); }

static void fx_free(struct fx *f) {
    kv_lr_free(f->lr);
    kv_model_close(f->m);
    rm_tree(f->parent);
    free(f->dir), free(f->parent), free(f->mpath), free(f->wpath);
}

static void edit_json(struct fx *f, void (*fn)(json_t *root)) {
    json_t *root = load_manifest(f->dir);
    fn(root);
    cr_assert_eq(json_dump_file(root, f->mpath, JSON_INDENT(2) | JSON_REAL_PRECISION(17)), 0);
    json_decref(root);
}

static json_t *side_json(json_t *root, int64_t l, const char *side) {
    return json_object_get(json_array_get(json_object_get(root, "layers"), (size_t)l), side);
}

static json_t *unit_json(json_t *root, int64_t l, const char *side, int64_t u) {
    return json_array_get(json_object_get(side_json(root, l, side), "units"), (size_t)u);
}

/* Rewrite model.safetensors without `drop` and with `narrow` one column
 * short; *off receives narrow's offset in the new file. */
static void rewrite_weights(struct fx *f, const char *drop, const char *narrow, uint64_t *off) {
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

static void set(json_t *o, const char *key, json_t *v) {
    cr_assert(json_is_object(o));
    cr_assert_eq(json_object_set_new(o, key, v), 0);
}

/* o[key] += delta */
static void bump(json_t *o, const char *key, json_int_t delta) {
    set(o, key, json_integer(json_integer_value(json_object_get(o, key)) + delta));
}

static void j_format(json_t *r) { set(r, "format", json_string("kvcal.other")); }
static void j_version(json_t *r) { set(r, "version", json_integer(2)); }
static void j_bytes(json_t *r) { bump(json_object_get(r, "kv_bytes_per_token"), "compressed", -2); }
static void j_overlap(json_t *r) {
    /* layer 0 k: units {0,1} and {2,3} become {0,1} and {1,2,3} */
    set(unit_json(r, 0, "k", 1), "heads", json_pack("[i,i,i]", 1, 2, 3));
}
static void j_gap(json_t *r) {
    set(unit_json(r, 0, "k", 1), "heads", json_pack("[i]", 3));
}
static void j_heads_order(json_t *r) {
    set(unit_json(r, 1, "k", 2), "heads", json_pack("[i,i]", 3, 2));
}
static void j_rank_range(json_t *r) {
    set(unit_json(r, 1, "k", 0), "rank", json_integer(5)); /* d_h is 4 */
}
static void j_side_rank(json_t *r) {
    set(side_json(r, 0, "k"), "rank", json_integer(9));
}
static void j_offset(json_t *r) {
    set(unit_json(r, 0, "v", 2), "latent_offset", json_integer(4));
}
static void j_o_cols(json_t *r) { bump(side_json(r, 2, "v"), "o_cols", 1); }
static void j_mode(json_t *r) { set(side_json(r, 1, "v"), "mode", json_string("prerope_latent")); }
static void j_fused_query(json_t *r) {
    set(side_json(r, 0, "k"), "mode", json_string("fused_query"));
}
static void j_arch(json_t *r) { set(json_object_get(r, "model"), "arch", json_string("mamba")); }
static void j_rope_null(json_t *r) { set(r, "rope", json_null()); }
static void j_rope_object(json_t *r) {
    set(r, "rope", json_pack("{s:s, s:f}", "layout", "half", "theta", 10000.0));
}
static void j_layout(json_t *r) { set(r, "weight_layout", json_string("linear [in, out]")); }
static void j_q_cols(json_t *r) { bump(side_json(r, 0, "k"), "q_cols", 1); }
static void j_q_cols_missing(json_t *r) {
    cr_assert_eq(json_object_del(side_json(r, 2, "k"), "q_cols"), 0);
}
static void j_q_proj_null(json_t *r) { set(side_json(r, 2, "k"), "q_proj", json_null()); }
static void j_q_bias_null(json_t *r) { set(side_json(r, 0, "k"), "q_proj_bias", json_null()); }
static void j_q_proj_stray(json_t *r) {
    set(side_json(r, 1, "k"), "q_proj", json_string("transformer.h.1.attn.q_proj.weight"));
}
static void j_missing_name(json_t *r) {
    set(unit_json(r, 0, "k", 1), "up", json_string("model.layers.0.self_attn.k_up.7.weight"));
}
static void j_weights_path(json_t *r) { set(r, "weights", json_string("../w.safetensors")); }
static void j_dim(json_t *r) { set(json_object_get(r, "model"), "hidden_dim", json_integer(41)); }
static void j_energy(json_t *r) { set(unit_json(r, 0, "k", 0), "energy", json_string("lots")); }
/* layer 1 k unit 3: rank 1 -> 2 with the side rank, bytes and ratio to match,
 * so only the tensor's shape disagrees */
static void j_rank_consistent(json_t *r) {
    bump(unit_json(r, 1, "k", 3), "rank", 1);
    bump(side_json(r, 1, "k"), "rank", 1);
    json_t *b = json_object_get(r, "kv_bytes_per_token");
    bump(b, "compressed", 2);
    set(b, "ratio", json_real((double)json_integer_value(json_object_get(b, "compressed")) /
                              (double)json_integer_value(json_object_get(b, "base"))));
}
static void j_layers(json_t *r) {
    cr_assert_eq(json_array_remove(json_object_get(r, "layers"), 2), 0);
}

struct row {
    const char *name;
    void (*json_fn)(json_t *);
    int kind; /* 0 json edit, 1 unlink manifest, 2 truncate manifest, 3 drop tensor,
                 4 narrow tensor, 5 json edit with the error at tensor's offset */
    const char *tensor;
    struct want_err w;
    int gpt2; /* the directory of a gpt2 model (else llama) */
};

static const struct row rows[] = {
    {"missing manifest", NULL, 1, NULL,
     {KV_EIO, 0, KV_NO_OFFSET, 0, "cannot open"}, 0},
    {"bad json", NULL, 2, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 1, "invalid json"}, 0},
    {"wrong format", j_format, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "format 'kvcal.other'"}, 0},
    {"newer version", j_version, 0, NULL,
     {KV_EUNSUPPORTED, 0, KV_NO_OFFSET, 0, "version 2"}, 0},
    {"wrong kv bytes", j_bytes, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "kv_bytes_per_token"}, 0},
    {"heads overlap", j_overlap, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 0 k unit 1: kv heads 1..3 overlap"}, 0},
    {"heads gap", j_gap, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "kv head 2 is in no unit"}, 0},
    {"heads out of order", j_heads_order, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "consecutive kv heads"}, 0},
    {"rank above d_h", j_rank_range, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "rank 5 is not within 1..4"}, 0},
    {"side rank", j_side_rank, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "rank is 9 but its units"}, 0},
    {"latent offset", j_offset, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "latent_offset is 4, expected 5"}, 0},
    {"o_cols", j_o_cols, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "o_cols"}, 0},
    {"mode for values", j_mode, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "mode 'prerope_latent' is not one of"}, 0},
    {"fused_query on llama", j_fused_query, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k: mode 'fused_query' needs a model without rope, found arch 'llama'"}, 0},
    {"unknown arch", j_arch, 0, NULL,
     {KV_EUNSUPPORTED, 0, KV_NO_OFFSET, 0,
      "model: arch 'mamba' is not supported, expected 'llama' or 'gpt2'"}, 0},
    {"llama rope null", j_rope_null, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "key 'rope' must be an object, found null"}, 0},
    {"weight layout", j_layout, 0, NULL,
     {KV_EUNSUPPORTED, 0, KV_NO_OFFSET, 0,
      "weight_layout 'linear [in, out]' is not supported, expected 'linear [out, in]'"}, 0},
    {"gpt2 rope object", j_rope_object, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "key 'rope' must be null for arch 'gpt2' (no rope)"}, 1},
    {"q_cols", j_q_cols, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k: q_cols is 41, expected 40 (each query head's unit rank)"}, 1},
    {"q_cols missing", j_q_cols_missing, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 2 k: missing key 'q_cols'"}, 1},
    {"q_proj null", j_q_proj_null, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 2 k: key 'q_proj' must be a tensor name, found null"},
     1},
    {"q_proj_bias null", j_q_bias_null, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k: key 'q_proj_bias' is null, but the model has q biases"}, 1},
    {"q_proj on another mode", j_q_proj_stray, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 1 k: key 'q_proj' must be null for mode "
                                      "'prerope_latent'"}, 1},
    {"q_fused dropped", NULL, 3, "transformer.h.2.attn.q_fused.weight",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'transformer.h.2.attn.q_fused.weight' "
                                      "(named by kvcal.json layer 2 k 'q_proj', q_cols)"}, 1},
    {"q_fused bias dropped", NULL, 3, "transformer.h.0.attn.q_fused.bias",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'transformer.h.0.attn.q_fused.bias'"}, 1},
    {"q_fused shape", NULL, 4, "transformer.h.0.attn.q_fused.weight",
     {KV_EFORMAT, 1, 0, 0, "has shape [40, 31] but kvcal.json (layer 0 k 'q_proj', q_cols) "
                           "implies [40, 32]"}, 1},
    {"q_fused bias shape", NULL, 4, "transformer.h.2.attn.q_fused.bias",
     {KV_EFORMAT, 1, 0, 0, "has shape [71] but kvcal.json (layer 2 k 'q_proj_bias', q_cols) "
                           "implies [72]"}, 1},
    {"gpt2 factor dropped", NULL, 3, "transformer.h.1.attn.k_up.1.weight",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'transformer.h.1.attn.k_up.1.weight'"}, 1},
    {"named tensor absent", j_missing_name, 0, NULL,
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'model.layers.0.self_attn.k_up.7.weight'"}, 0},
    {"weights outside", j_weights_path, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "key 'weights'"}, 0},
    {"model dims", j_dim, 0, NULL,
     {KV_EINVAL, 0, KV_NO_OFFSET, 0, "hidden_dim 41"}, 0},
    {"energy type", j_energy, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 0 k unit 0: key 'energy'"}, 0},
    {"layer count", j_layers, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "2 entries, expected n_layers 3"}, 0},
    {"tensor dropped", NULL, 3, "model.layers.1.self_attn.k_rot.2.weight",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'model.layers.1.self_attn.k_rot.2.weight'"}, 0},
    {"bias dropped", NULL, 3, "model.layers.0.self_attn.k_down.bias",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'model.layers.0.self_attn.k_down.bias'"}, 0},
    {"rank vs shape", NULL, 4, "model.layers.0.self_attn.k_up.1.weight",
     {KV_EFORMAT, 1, 0, 0,
      "has shape [8, 2] but kvcal.json (layer 0 k unit 1 'up', rank 3) implies [8, 3]"}, 0},
    {"rank vs shape in the manifest", j_rank_consistent, 5,
     "model.layers.1.self_attn.k_rot.3.weight",
     {KV_EFORMAT, 1, 0, 0, "has shape [1, 4] but kvcal.json (layer 1 k unit 3 'rot', rank 2) "
                           "implies [2, 4]"}, 0},
    {"fused o_proj shape", NULL, 4, "model.layers.0.self_attn.o_proj.weight",
     {KV_EFORMAT, 1, 0, 0, "o_proj"}, 0},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

ParameterizedTestParameters(kvdir_open, rejects_corruption) {
    static int idx[N_ROWS];
    for (size_t i = 0; i < N_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_ROWS);
}

ParameterizedTest(int *ip, kvdir_open, rejects_corruption) {
    const struct row *r = &rows[*ip];
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
    cr_assert(strstr(err.msg, w.needle), "%s: message '%s' lacks '%s'", r->name, err.msg,
              w.needle);
    /* the manifest reader agrees wherever the manifest alone is at fault */
    if (!w.in_weights && w.code != KV_EINVAL) {
        struct kv_err e2;
        kv_err_clear(&e2);
        cr_assert_eq(kv_lr_manifest_read(f.mpath, &lr, &e2), w.code, "%s", r->name);
        cr_assert_str_eq(e2.msg, err.msg, "%s", r->name);
    }
    fx_free(&f);
}

Test(kvdir_open, refuses_another_model) {
    struct fx f;
    fx_init(&f);
    struct kv_model *other = make_model(0, 18); /* same shapes, other weights */
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, f.mpath);
    char want[128];
    snprintf(want, sizeof want, "made from model %.12s, but the given model is ",
             f.lr->model_fingerprint);
    cr_assert(strstr(err.msg, want), "'%s' lacks '%s'", err.msg, want);
    kv_model_close(other);

    /* other shapes: named before any fingerprint is computed */
    other = make_model(1, 17);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert(strstr(err.msg, "tied_embeddings") || strstr(err.msg, "qkv_bias"), "%s", err.msg);
    kv_model_close(other);
    fx_free(&f);

    /* a gpt2 directory and a llama model of the same shapes */
    fx_init_arch(&f, 1);
    struct kv_config lc = gpt2_cfg();
    lc.arch = KV_ARCH_LLAMA, lc.rope_theta = 10000.0f;
    other = model_of(lc, 17);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.msg, "made from a gpt2 model, but the given model is llama");
    kv_model_close(other);
    fx_free(&f);
}

Test(kvdir_open, reads_f16_and_bf16_factors) {
    struct fx f;
    fx_init(&f);
    /* store k_up.0 of layer 0 as BF16 and o_proj of layer 2 as F16 */
    const char *bf = "model.layers.0.self_attn.k_up.0.weight";
    const char *hf = "model.layers.2.self_attn.o_proj.weight";
    struct kv_st_file *st = NULL;
    struct kv_stw *w = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_st_open(f.wpath, &st, &err), KV_OK);
    cr_assert_eq(kv_stw_init(&w, &err), KV_OK);
    for (int64_t i = 0; i < st->n_tensors; i++) {
        const struct kv_tensor *t = &st->tensors[i];
        enum kv_dtype dt = !strcmp(t->name, bf)   ? KV_DTYPE_BF16
                           : !strcmp(t->name, hf) ? KV_DTYPE_F16
                                                  : KV_DTYPE_F32;
        if (dt == KV_DTYPE_F32)
            cr_assert_eq(kv_stw_add(w, t->name, dt, t->ndim, t->shape, t->data, t->nbytes, &err),
                         KV_OK);
        else
            cr_assert_eq(kv_stw_add_f32(w, t->name, dt, t->ndim, t->shape, t->data, &err), KV_OK);
    }
    cr_assert_eq(kv_stw_write(w, f.wpath, &err), KV_OK, "%s", fmt_err(&err));
    kv_stw_free(w);
    kv_st_close(st);
    struct kv_lowrank *lr = NULL;
    cr_assert_eq(kv_lr_dir_open(f.dir, f.m, &lr, &err), KV_OK, "%s", fmt_err(&err));
    /* rounding to 8 (bf16) and 11 (f16) significant bits; values are in [-1, 1) */
    const struct kv_lr_unit *a = &lr->layers[0].k.units[0], *b = &f.lr->layers[0].k.units[0];
    int64_t n = a->n_heads * f.lr->head_dim * a->rank;
    kvt_assert_close_f32(a->up, b->up, n, 0, 0x1.0p-8, "bf16 up");
    n = f.lr->dim * lr->layers[2].o_cols;
    kvt_assert_close_f32(lr->layers[2].o_fused, f.lr->layers[2].o_fused, n, 0x1.0p-25, 0x1.0p-11,
                         "f16 o_fused");
    kv_lr_free(lr);
    fx_free(&f);
}

/* ------------------------------------------------------------ HF source */

Test(kvdir_hf, all_full_output_is_the_same_hf_checkpoint) {
    KVT_NEED_SHARED(src, "models/tinystories-656K");
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(src, NULL, &m, &err), KV_OK, "%s", fmt_err(&err));
    const struct kv_config *c = kv_model_config(m);
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    snprintf(lr->method, sizeof lr->method, "none");
    snprintf(lr->alloc, sizeof lr->alloc, "none");
    lr->n_layers = c->n_layers, lr->dim = c->dim, lr->n_heads = c->n_heads;
    lr->n_kv_heads = c->n_kv_heads, lr->head_dim = c->head_dim, lr->kv_bits = 16;
    lr->layers = calloc((size_t)c->n_layers, sizeof *lr->layers);
    char *parent, *dir = out_dir(&parent);
    struct kv_lr_dir_info info = {src, NULL, NULL, NULL};
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_OK, "%s", fmt_err(&err));
    static const char *const copied[] = {"config.json", "generation_config.json", "tokenizer.json",
                                         "tokenizer_config.json", "special_tokens_map.json"};
    for (size_t i = 0; i < sizeof copied / sizeof copied[0]; i++) {
        char *a = kvt_path(src, copied[i]), *b = kvt_path(dir, copied[i]);
        size_t na = 0, nb = 0;
        char *x = kvt_read_file(a, &na), *y = kvt_read_file(b, &nb);
        cr_assert_not_null(y, "%s was not copied", copied[i]);
        cr_assert(na == nb && memcmp(x, y, na) == 0, "%s differs", copied[i]);
        free(a), free(b), free(x), free(y);
    }
    json_t *root = load_manifest(dir);
    json_t *mo = json_object_get(root, "model");
    cr_assert_str_eq(jstr(mo, "format"), "hf");
    cr_assert_str_eq(jstr(mo, "tokenizer"), "tokenizer.json");
    cr_assert_eq(jint(json_object_get(root, "kv_bytes_per_token"), "compressed"),
                 jint(json_object_get(root, "kv_bytes_per_token"), "base"));
    json_decref(root);

    /* the directory loads as an HF checkpoint with the same weights */
    struct kv_model *again = NULL;
    cr_assert_eq(kv_model_open(dir, NULL, &again, &err), KV_OK, "%s", fmt_err(&err));
    char fa[65], fb[65];
    cr_assert_eq(kv_model_fingerprint(m, fa, &err), KV_OK);
    cr_assert_eq(kv_model_fingerprint(again, fb, &err), KV_OK);
    cr_assert_str_eq(fa, fb);
    struct kv_lowrank *back = NULL;
    cr_assert_eq(kv_lr_dir_open(dir, again, &back, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_lr_bytes(back, 16), kv_lr_base_bytes(c));
    kv_lr_free(back);
    kv_model_close(again);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ inspect */

Test(kvdir_inspect, prints_ranks_bytes_and_json) {
    struct fx f;
    fx_init(&f);
    char args[4200];
    char *out = NULL, *errs = NULL;
    snprintf(args, sizeof args, "inspect '%s' --json", f.dir);
    int rc = kvt_run_cli(args, &out, &errs);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, errs);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "%s: %s", je.text, out);
    cr_assert_str_eq(jstr(o, "type"), "kvcal.manifest");
    cr_assert_str_eq(jstr(o, "method"), "palu");
    json_t *layers = json_object_get(o, "layers");
    cr_assert_eq(json_array_size(layers), 3);
    int64_t total = 0;
    for (int64_t l = 0; l < 3; l++) {
        json_t *yo = json_array_get(layers, (size_t)l);
        int64_t lb = 0;
        for (int s = 0; s < 2; s++) {
            const struct kv_lr_side *sd = s ? &f.lr->layers[l].v : &f.lr->layers[l].k;
            json_t *so = json_object_get(yo, s ? "v" : "k");
            cr_assert_str_eq(jstr(so, "mode"), kv_lr_mode_name(sd->mode));
            json_t *ranks = json_object_get(so, "ranks");
            cr_assert_eq((int64_t)json_array_size(ranks), sd->n_units);
            for (int64_t u = 0; u < sd->n_units; u++)
                cr_assert_eq(json_integer_value(json_array_get(ranks, (size_t)u)),
                             sd->units[u].rank);
            lb += sd->mode == KV_LR_FULL ? 4 * 4 * 2 : 2 * side_rank(sd);
        }
        cr_assert_eq(jint(json_object_get(yo, "kv_bytes_per_token"), "compressed"), lb);
        cr_assert_eq(jint(json_object_get(yo, "kv_bytes_per_token"), "base"), 2 * 4 * 4 * 2);
        total += lb;
    }
    cr_assert_eq(jint(json_object_get(o, "kv_bytes_per_token"), "compressed"), total);
    json_decref(o);
    free(out), free(errs);

    snprintf(args, sizeof args, "inspect '%s'", f.dir);
    rc = kvt_run_cli(args, &out, &errs);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, errs);
    cr_assert(strstr(out, "palu"), "%s", out);
    cr_assert(strstr(out, "prerope_latent") && strstr(out, "5,3"), "%s", out);
    cr_assert(strstr(out, "2,3,4,1"), "%s", out);
    free(out), free(errs);

    /* a broken manifest is an error naming it */
    edit_json(&f, j_version);
    rc = kvt_run_cli(args, &out, &errs);
    cr_assert_eq(rc, 1, "exit %d", rc);
    cr_assert(strstr(errs, "kvcal.json") && strstr(errs, "version 2"), "%s", errs);
    free(out), free(errs);
    fx_free(&f);
}
