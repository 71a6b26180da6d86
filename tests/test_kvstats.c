/* Statistics files (.kvstats, formats/kvstats.c) and kv_stats_merge.
 *
 * kvstats_write: a round trip of every field and tensor bit for bit, the
 *   probe, the writer's refusals (non-finite sums, unwritable paths), and an
 *   independent writer, built here from the layout in kvstats.h with the raw
 *   GGUF writer, that must reproduce kv_stats_write byte for byte.
 * kvstats_parse: a corruption table over a valid file this test writes
 *   (byte mutations at offsets found with kv_gguf_parse, never hard-coded)
 *   and over files from the independent writer with one piece overridden;
 *   every prefix and every single-byte flip must fail cleanly.
 * kvstats_merge: exact sums, counts and inputs, and the refusals. */
#include <dirent.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "gguf.h"
#include "ggufw.h"
#include "kvstats.h"
#include "testutil.h"

#include <criterion/parameterized.h>

/* ------------------------------------------------------------ fixtures */

#define FP_A "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
#define FP_B "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
#define SHA_1 "1111111111111111111111111111111111111111111111111111111111111111"
#define SHA_2 "2222222222222222222222222222222222222222222222222222222222222222"
#define SHA_3 "33333333333333333333333333333333333333333333333333333333333333cc"
#define SHA_4 "44444444444444444444444444444444444444444444444444444444444444dd"
#define SEQ_LEN 32
#define GGML_F32 0u
#define GGML_F64 28u

/* dim 16, 2 layers, 4 heads of 4, 2 kv heads: tensors of 2048, 128, 512 and
 * 256 bytes per layer, every one a multiple of the 32-byte alignment. */
static struct kv_config small_cfg(void) {
    struct kv_config c = {0};
    c.dim = 16, c.hidden_dim = 24, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 4, c.vocab_size = 32, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.tied_embeddings = 1, c.bos_id = 1, c.eos_id = 2;
    return c;
}

static const char *fmt_err(const struct kv_err *e) {
    static char buf[2200];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

static int64_t numel(const int64_t *shape, int nd) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    return n;
}

/* Element (a, b) of matrix m of tensor id: symmetric in (a, b), distinct for
 * every unordered pair, matrix and tensor, and not a short binary fraction. */
static double sym_val(int64_t id, int64_t m, int64_t a, int64_t b, double scale) {
    int64_t lo = a < b ? a : b, hi = a < b ? b : a;
    return scale * (double)(((id * 64 + m) * 64 + lo) * 64 + hi + 1) / 3.0;
}

/* Every tensor of s gets distinct deterministic values (matrices symmetric;
 * Fisher sums positive, and so the gradient covariances' diagonals). */
static void fill(struct kv_stats *s, double scale) {
    int64_t d = s->dim, hd = s->head_dim, kd = s->n_kv_heads * hd;
    for (int64_t l = 0; l < s->n_layers; l++) {
        struct kv_stats_layer *y = &s->layers[l];
        int64_t id = l * (KV_STATS_PER_LAYER + KV_STATS_FISHER_PER_LAYER);
        if (s->has_fisher) {
            for (int64_t r = 0; r < kd; r++) {
                y->fisher_k[r] = fabs(scale) * (double)((id + 4) * 4096 + r + 1) / 11.0;
                y->fisher_v[r] = fabs(scale) * (double)((id + 5) * 4096 + r + 1) / 13.0;
            }
            for (int64_t m = 0; m < s->n_kv_heads; m++)
                for (int64_t i = 0; i < hd; i++)
                    for (int64_t j = 0; j < hd; j++) {
                        double sg = i == j ? fabs(scale) : -scale; /* negative off-diagonals */
                        y->grad_k_cov[(m * hd + i) * hd + j] = sg * sym_val(id + 6, m, i, j, 1.0);
                        y->grad_v_cov[(m * hd + i) * hd + j] = sg * sym_val(id + 7, m, i, j, 1.0);
                    }
        }
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < d; j++) y->xtx[i * d + j] = sym_val(id, 0, i, j, scale);
        for (int64_t i = 0; i < d; i++) y->xsum[i] = -scale * (double)((id + 1) * 4096 + i) / 7.0;
        for (int64_t m = 0; m < s->n_heads; m++)
            for (int64_t i = 0; i < hd; i++)
                for (int64_t j = 0; j < hd; j++)
                    y->q_cov[(m * hd + i) * hd + j] = sym_val(id + 2, m, i, j, scale);
        for (int64_t m = 0; m < s->n_kv_heads; m++)
            for (int64_t i = 0; i < hd; i++)
                for (int64_t j = 0; j < hd; j++)
                    y->k_cov[(m * hd + i) * hd + j] = sym_val(id + 3, m, i, j, scale);
    }
}

/* Statistics of two inputs (3 + 4 windows of SEQ_LEN), plan finished. */
static struct kv_stats *make_stats(const struct kv_config *c, double scale) {
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(c, &s, &err), KV_OK, "%s", fmt_err(&err));
    fill(s, scale);
    snprintf(s->fingerprint, sizeof s->fingerprint, "%s", FP_A);
    s->seq_len = SEQ_LEN;
    cr_assert_eq(kv_stats_add_input(s, "data/a.txt", SHA_1, 1234, 600, 3, &err), KV_OK);
    cr_assert_eq(kv_stats_add_input(s, "data/b.txt", SHA_2, 99999, 5000, 4, &err), KV_OK);
    s->windows = 7;
    s->tokens = s->windows * SEQ_LEN;
    snprintf(s->sampling, sizeof s->sampling, "random");
    s->seed = 0xfedcba9876543210ull;
    s->samples = 7;
    s->shard_index = 1;
    s->shard_count = 3;
    s->plan_windows = 7;
    s->next_window = 7;
    return s;
}

/* make_stats with Fisher statistics. */
static struct kv_stats *make_fisher_stats(const struct kv_config *c, double scale) {
    struct kv_stats *s = make_stats(c, scale);
    struct kv_err err;
    kv_err_clear(&err);
    int64_t windows = s->windows;
    s->windows = 0; /* fisher sums start with the first window */
    cr_assert_eq(kv_stats_add_fisher(s, &err), KV_OK, "%s", fmt_err(&err));
    s->windows = windows;
    cr_assert_eq(s->has_fisher, 1);
    fill(s, scale);
    return s;
}

/* Every field and every tensor of a and b agree bit for bit. */
static void assert_stats_eq(const struct kv_stats *a, const struct kv_stats *b) {
    cr_assert_eq(a->n_layers, b->n_layers);
    cr_assert_eq(a->dim, b->dim);
    cr_assert_eq(a->n_heads, b->n_heads);
    cr_assert_eq(a->n_kv_heads, b->n_kv_heads);
    cr_assert_eq(a->head_dim, b->head_dim);
    cr_assert_str_eq(a->fingerprint, b->fingerprint);
    cr_assert_str_eq(a->version, b->version);
    cr_assert_eq(a->seq_len, b->seq_len);
    cr_assert_eq(a->tokens, b->tokens);
    cr_assert_eq(a->windows, b->windows);
    cr_assert_str_eq(a->sampling, b->sampling);
    cr_assert_eq(a->seed, b->seed);
    cr_assert_eq(a->samples, b->samples);
    cr_assert_eq(a->shard_index, b->shard_index);
    cr_assert_eq(a->shard_count, b->shard_count);
    cr_assert_eq(a->plan_windows, b->plan_windows);
    cr_assert_eq(a->next_window, b->next_window);
    cr_assert_eq(a->has_fisher, b->has_fisher);
    cr_assert_eq(a->n_inputs, b->n_inputs);
    for (int64_t i = 0; i < a->n_inputs; i++) {
        cr_assert_str_eq(a->inputs[i].path, b->inputs[i].path, "input %lld", (long long)i);
        cr_assert_str_eq(a->inputs[i].sha256, b->inputs[i].sha256, "input %lld", (long long)i);
        cr_assert_eq(a->inputs[i].bytes, b->inputs[i].bytes, "input %lld", (long long)i);
        cr_assert_eq(a->inputs[i].tokens, b->inputs[i].tokens, "input %lld", (long long)i);
        cr_assert_eq(a->inputs[i].windows, b->inputs[i].windows, "input %lld", (long long)i);
    }
    for (int64_t l = 0; l < a->n_layers; l++)
        for (int t = 0; t < kv_stats_layer_tensors(a); t++) {
            char name[64];
            int64_t shape[3];
            int nd = kv_stats_tensor_desc(a, l, t, name, sizeof name, shape);
            cr_assert(!memcmp(kv_stats_tensor_data(a, l, t), kv_stats_tensor_data(b, l, t),
                              (size_t)numel(shape, nd) * 8),
                      "tensor '%s' differs", name);
        }
}

static void put_file(const char *path, const void *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    cr_assert(fp, "cannot create %s", path);
    cr_assert_eq(fwrite(p, 1, n, fp), n);
    cr_assert_eq(fclose(fp), 0);
}

static int dir_entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert(d, "cannot open %s", dir);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* Remove a temporary directory this test made (flat) and free its path. */
static void rm_tree(char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        for (struct dirent *e; (e = readdir(d));) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char *p = kvt_path(dir, e->d_name);
            unlink(p);
            free(p);
        }
        closedir(d);
    }
    rmdir(dir);
    free(dir);
}

static char *write_stats(const struct kv_stats *s, const char *dir, const char *name) {
    char *path = kvt_path(dir, name);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_OK, "%s", fmt_err(&err));
    return path;
}

static void set_le(uint8_t *p, uint64_t v, int nbytes) {
    for (int i = 0; i < nbytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t crc_of(const void *p, uint64_t n) {
    return (uint32_t)crc32(crc32(0L, Z_NULL, 0), p, (uInt)n);
}

/* ------------------------------------------------------------ independent writer */

/* A stats-like GGUF written from the documented layout (kvstats.h) with the
 * raw GGUF writer; each field overrides one piece. */
struct hspec {
    const char *drop_key;     /* metadata key left out */
    uint32_t format_version;  /* kvcal.format_version */
    const char *drop_tensor;  /* tensor left out (and out of kvcal.crc32) */
    const char *f32_tensor;   /* tensor stored as F32 */
    int64_t xtx_cols;         /* columns of blk.0.attn_in.xtx; 0 = d */
    int swap_first;           /* the first two tensors swapped */
    int extra_tensor;         /* a layer-n_layers attn_in.xtx at the end */
    int crc_extra;            /* extra 0 entries at the end of kvcal.crc32 */
    int crc_wide;             /* kvcal.crc32 as uint64 with 2^32 added to entry 0 */
    int short_sha;            /* kvcal.datasets.sha256 one entry short */
    int64_t drop_fisher_of;   /* layer N-1's four Fisher tensors left out; 0 = none */
};

static struct hspec hspec_default(void) { return (struct hspec){.format_version = 1}; }

struct htensor {
    char name[64];
    uint32_t type;
    int nd;
    int64_t shape[3];
    void *data; /* malloc'd copy */
    uint64_t nbytes;
};

static const char *const suffix[8] = {"attn_in.xtx", "attn_in.sum", "q_rope.cov", "k_rope.cov",
                                      "fisher.k",    "fisher.v",    "grad_k.cov", "grad_v.cov"};

/* Tensors per layer per kvstats.h: four, and four more with Fisher sums. */
static int hper(const struct kv_stats *s) { return s->has_fisher ? 8 : 4; }

/* Tensor k of layer l per kvstats.h: name, row-major shape, a copy of the data. */
static void htensor_make(const struct kv_stats *s, int64_t l, int k, struct htensor *t) {
    int64_t d = s->dim, h = s->n_heads, g = s->n_kv_heads, dh = s->head_dim;
    const struct kv_stats_layer *y = &s->layers[l];
    const double *src[8] = {y->xtx,      y->xsum,     y->q_cov,      y->k_cov,
                            y->fisher_k, y->fisher_v, y->grad_k_cov, y->grad_v_cov};
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "blk.%lld.%s", (long long)l, suffix[k]);
    t->type = GGML_F64;
    switch (k) {
    case 0: t->nd = 2, t->shape[0] = d, t->shape[1] = d; break;
    case 1: t->nd = 1, t->shape[0] = d; break;
    case 2: t->nd = 3, t->shape[0] = h, t->shape[1] = dh, t->shape[2] = dh; break;
    case 4:
    case 5: t->nd = 1, t->shape[0] = g * dh; break;
    default: t->nd = 3, t->shape[0] = g, t->shape[1] = dh, t->shape[2] = dh; break;
    }
    t->nbytes = (uint64_t)numel(t->shape, t->nd) * 8;
    t->data = malloc(t->nbytes);
    cr_assert(t->data);
    memcpy(t->data, src[k], t->nbytes);
}

static char *hand_write(const struct kv_stats *s, const struct hspec *h, const char *dir,
                        const char *name) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t cap = s->n_layers * hper(s) + 1, nt = 0;
    struct htensor *t = calloc((size_t)cap, sizeof *t);
    cr_assert(t);
    for (int64_t l = 0; l < s->n_layers; l++)
        for (int k = 0; k < hper(s); k++) {
            struct htensor *x = &t[nt];
            htensor_make(s, l, k, x);
            if ((h->drop_tensor && !strcmp(x->name, h->drop_tensor)) ||
                (k >= 4 && l == h->drop_fisher_of - 1)) {
                free(x->data);
                continue;
            }
            if (l == 0 && k == 0 && h->xtx_cols) {
                x->shape[1] = h->xtx_cols; /* the first d*cols values */
                x->nbytes = (uint64_t)(x->shape[0] * x->shape[1]) * 8;
            }
            if (h->f32_tensor && !strcmp(x->name, h->f32_tensor)) {
                uint64_t n = x->nbytes / 8;
                float *f = malloc(n * sizeof *f);
                cr_assert(f);
                for (uint64_t i = 0; i < n; i++) f[i] = (float)((double *)x->data)[i];
                free(x->data);
                x->data = f;
                x->nbytes = n * 4;
                x->type = GGML_F32;
            }
            nt++;
        }
    if (h->swap_first) {
        struct htensor tmp = t[0];
        t[0] = t[1];
        t[1] = tmp;
    }
    if (h->extra_tensor) {
        htensor_make(s, 0, 0, &t[nt]);
        snprintf(t[nt].name, sizeof t[nt].name, "blk.%lld.%s", (long long)s->n_layers, suffix[0]);
        nt++;
    }
    int64_t ncrc = nt + h->crc_extra;
    uint32_t *crc = calloc((size_t)ncrc, sizeof *crc);
    uint64_t *crc64 = calloc((size_t)ncrc, sizeof *crc64);
    cr_assert(crc && crc64);
    for (int64_t i = 0; i < nt; i++) crc64[i] = crc[i] = crc_of(t[i].data, t[i].nbytes);
    if (h->crc_wide) crc64[0] += 1ull << 32;

    int64_t ni = s->n_inputs;
    const char **paths = calloc((size_t)ni + 1, sizeof *paths);
    const char **shas = calloc((size_t)ni + 1, sizeof *shas);
    uint64_t *bytes = calloc((size_t)ni + 1, 8), *toks = calloc((size_t)ni + 1, 8);
    uint64_t *wins = calloc((size_t)ni + 1, 8);
    cr_assert(paths && shas && bytes && toks && wins);
    for (int64_t i = 0; i < ni; i++) {
        paths[i] = s->inputs[i].path;
        shas[i] = s->inputs[i].sha256;
        bytes[i] = s->inputs[i].bytes;
        toks[i] = (uint64_t)s->inputs[i].tokens;
        wins[i] = (uint64_t)s->inputs[i].windows;
    }

    struct kv_ggufw *w;
    cr_assert_eq(kv_ggufw_init(&w, &err), KV_OK);
#define KEY(key, call)                                                                         \
    do {                                                                                       \
        if (!h->drop_key || strcmp(h->drop_key, key))                                          \
            cr_assert_eq((call), KV_OK, "%s: %s", key, fmt_err(&err));                         \
    } while (0)
#define STR(key, v) KEY(key, kv_ggufw_add_str(w, key, v, &err))
#define U64(key, v) KEY(key, kv_ggufw_add_u64(w, key, (uint64_t)(v), &err))
    STR("general.type", "kvcal.stats");
    KEY("kvcal.format_version", kv_ggufw_add_u32(w, "kvcal.format_version", h->format_version, &err));
    STR("kvcal.version", s->version);
    STR("kvcal.model.fingerprint", s->fingerprint);
    U64("kvcal.model.n_layers", s->n_layers);
    U64("kvcal.model.dim", s->dim);
    U64("kvcal.model.n_heads", s->n_heads);
    U64("kvcal.model.n_kv_heads", s->n_kv_heads);
    U64("kvcal.model.head_dim", s->head_dim);
    U64("kvcal.seq_len", s->seq_len);
    U64("kvcal.tokens", s->tokens);
    U64("kvcal.sequences", s->windows);
    STR("kvcal.sampling", s->sampling);
    U64("kvcal.seed", s->seed);
    U64("kvcal.samples", s->samples);
    U64("kvcal.shard.index", s->shard_index);
    U64("kvcal.shard.count", s->shard_count);
    U64("kvcal.plan.windows", s->plan_windows);
    U64("kvcal.plan.next_window", s->next_window);
    uint64_t n = (uint64_t)ni;
    KEY("kvcal.datasets", kv_ggufw_add_arr_str(w, "kvcal.datasets", paths, n, &err));
    KEY("kvcal.datasets.sha256",
        kv_ggufw_add_arr_str(w, "kvcal.datasets.sha256", shas, n - (h->short_sha ? 1 : 0), &err));
    KEY("kvcal.datasets.bytes", kv_ggufw_add_arr_u64(w, "kvcal.datasets.bytes", bytes, n, &err));
    KEY("kvcal.datasets.tokens", kv_ggufw_add_arr_u64(w, "kvcal.datasets.tokens", toks, n, &err));
    KEY("kvcal.datasets.windows", kv_ggufw_add_arr_u64(w, "kvcal.datasets.windows", wins, n, &err));
    if (h->crc_wide)
        KEY("kvcal.crc32", kv_ggufw_add_arr_u64(w, "kvcal.crc32", crc64, (uint64_t)ncrc, &err));
    else
        KEY("kvcal.crc32", kv_ggufw_add_arr_u32(w, "kvcal.crc32", crc, (uint64_t)ncrc, &err));
#undef U64
#undef STR
#undef KEY
    for (int64_t i = 0; i < nt; i++)
        cr_assert_eq(kv_ggufw_add_tensor(w, t[i].name, t[i].type, t[i].nd, t[i].shape, t[i].data,
                                         t[i].nbytes, &err),
                     KV_OK, "%s", fmt_err(&err));
    char *path = kvt_path(dir, name);
    cr_assert_eq(kv_ggufw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_ggufw_free(w);
    for (int64_t i = 0; i < nt; i++) free(t[i].data);
    free(t), free(crc), free(crc64), free(paths), free(shas), free(bytes), free(toks), free(wins);
    return path;
}

/* ------------------------------------------------------------ the valid file */

/* A valid file's bytes (mutable) and kv_gguf_parse of them for offsets. */
struct fx {
    struct kv_stats *s;
    char *dir;
    uint8_t *p;
    size_t len;
    struct kv_gguf_file g;
};

static void fx_load(struct fx *f, const char *path) {
    kv_gguf_release(&f->g);
    free(f->p);
    f->p = (uint8_t *)kvt_read_file(path, &f->len);
    cr_assert(f->p, "cannot read %s", path);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_gguf_parse(f->p, f->len, path, &f->g, &err), KV_OK, "%s", fmt_err(&err));
}

static void fx_init(struct fx *f) {
    memset(f, 0, sizeof *f);
    struct kv_config c = small_cfg();
    f->s = make_stats(&c, 1.0);
    f->dir = kvt_temp_dir();
    char *path = write_stats(f->s, f->dir, "valid.kvstats");
    fx_load(f, path);
    free(path);
}

/* The valid file becomes one with Fisher statistics. */
static void fx_fisher(struct fx *f) {
    struct kv_config c = small_cfg();
    kv_stats_free(f->s);
    f->s = make_fisher_stats(&c, 1.0);
    char *path = write_stats(f->s, f->dir, "fisher.kvstats");
    fx_load(f, path);
    free(path);
}

/* Replace the bytes with a file from the independent writer. */
static void fx_hand(struct fx *f, const struct hspec *h) {
    char *path = hand_write(f->s, h, f->dir, "hand.kvstats");
    fx_load(f, path);
    free(path);
}

static void fx_free(struct fx *f) {
    kv_gguf_release(&f->g);
    free(f->p);
    kv_stats_free(f->s);
    rm_tree(f->dir);
}

static const struct kv_gguf_tensor *fx_tensor(const struct fx *f, const char *name) {
    const struct kv_gguf_tensor *t = kv_gguf_find_tensor(&f->g, name);
    cr_assert(t, "fixture has no tensor %s", name);
    return t;
}

static const struct kv_gguf_kv *fx_kv(const struct fx *f, const char *key) {
    const struct kv_gguf_kv *kv = kv_gguf_find(&f->g, key);
    cr_assert(kv, "fixture has no key %s", key);
    return kv;
}

static int64_t fx_tensor_index(const struct fx *f, const char *name) {
    return fx_tensor(f, name) - f->g.tensors;
}

/* Overwrite a scalar integer value in place (its stored width). */
static void fx_set_int(struct fx *f, const char *key, uint64_t v) {
    const struct kv_gguf_kv *kv = fx_kv(f, key);
    cr_assert(kv->type == KV_GGUF_U64 || kv->type == KV_GGUF_U32, "%s is not an integer", key);
    set_le(f->p + kv->val_off, v, kv->type == KV_GGUF_U64 ? 8 : 4);
}

/* Store x as element k of tensor name, with the tensor's crc32 fixed up. */
static uint64_t fx_poke_f64(struct fx *f, const char *name, int64_t k, double x) {
    const struct kv_gguf_tensor *t = fx_tensor(f, name);
    memcpy(f->p + t->t.offset + (uint64_t)k * 8, &x, 8);
    const struct kv_gguf_kv *kc = fx_kv(f, "kvcal.crc32");
    cr_assert_eq(kc->arr_type, KV_GGUF_U32);
    set_le(f->p + kc->arr_off + 4 * (uint64_t)fx_tensor_index(f, name),
           crc_of(f->p + t->t.offset, t->t.nbytes), 4);
    return t->t.offset + (uint64_t)k * 8;
}

/* ------------------------------------------------------------ write */

Test(kvstats_write, round_trips_every_field_and_tensor_bit_for_bit) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    /* a checkpoint, and values at the edges of float64 */
    s->plan_windows = 10;
    s->next_window = 7;
    double *sum = s->layers[1].xsum;
    sum[0] = -0.0, sum[1] = DBL_TRUE_MIN, sum[2] = DBL_MAX, sum[3] = -DBL_MIN, sum[4] = -DBL_MAX;
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "rt.kvstats");
    cr_assert_eq(dir_entries(dir), 1, "only the file, no .tmp left over");

    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(s, r);
    cr_assert_str_eq(r->version, KVCAL_VERSION);
    cr_assert_eq(r->n_inputs, 2);
    cr_assert(signbit(r->layers[1].xsum[0]), "-0.0 keeps its sign");

    /* the byte parser agrees with open */
    size_t len;
    char *bytes = kvt_read_file(path, &len);
    struct kv_stats *q = NULL;
    cr_assert_eq(kv_stats_parse(bytes, len, path, &q, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(s, q);
    kv_stats_free(q);
    free(bytes);
    kv_stats_free(r);
    kv_stats_free(s);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, layout_matches_an_independent_writer_byte_for_byte) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *a = write_stats(s, dir, "lib.kvstats");
    struct hspec h = hspec_default();
    char *b = hand_write(s, &h, dir, "hand.kvstats");
    size_t la, lb;
    char *pa = kvt_read_file(a, &la), *pb = kvt_read_file(b, &lb);
    cr_assert_eq(la, lb, "sizes %zu and %zu", la, lb);
    size_t i = 0;
    while (i < la && pa[i] == pb[i]) i++;
    cr_assert_eq(i, la, "first difference at byte %zu", i);
    free(pa), free(pb), free(a), free(b);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, round_trips_fisher_statistics_and_matches_an_independent_writer) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_fisher_stats(&c, 1.0);
    /* an empty sum of squares is 0, and off-diagonals of a Gram may be negative */
    s->layers[1].fisher_v[0] = 0.0;
    cr_assert_lt(s->layers[0].grad_k_cov[1], 0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "f.kvstats");
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(r->has_fisher, 1);
    assert_stats_eq(s, r);
    kv_stats_free(r);

    struct hspec h = hspec_default();
    char *b = hand_write(s, &h, dir, "hand.kvstats");
    size_t la, lb;
    char *pa = kvt_read_file(path, &la), *pb = kvt_read_file(b, &lb);
    cr_assert_eq(la, lb, "sizes %zu and %zu", la, lb);
    size_t i = 0;
    while (i < la && pa[i] == pb[i]) i++;
    cr_assert_eq(i, la, "first difference at byte %zu", i);
    free(pa), free(pb), free(b), free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, a_file_without_fisher_reads_as_none) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    cr_assert_eq(s->has_fisher, 0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "old.kvstats");
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(r->has_fisher, 0);
    cr_assert_eq(kv_stats_layer_tensors(r), 4);
    for (int64_t l = 0; l < r->n_layers; l++)
        cr_assert(!r->layers[l].fisher_k && !r->layers[l].fisher_v && !r->layers[l].grad_k_cov &&
                  !r->layers[l].grad_v_cov, "layer %lld has fisher pointers", (long long)l);
    /* its 7 windows have no fisher sums, and none can be added after them */
    cr_assert_eq(kv_stats_add_fisher(r, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "statistics of 7 windows have no fisher sums to extend; fisher sums "
                              "start with the first window");
    cr_assert_eq(r->has_fisher, 0);
    cr_assert_null(r->layers[0].fisher_k);
    kv_stats_free(r), kv_stats_free(s);

    /* fresh statistics take zeroed sums, once */
    cr_assert_eq(kv_stats_init(&c, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_stats_add_fisher(r, &err), KV_OK, "%s", fmt_err(&err));
    double *fk = r->layers[0].fisher_k;
    cr_assert_eq(kv_stats_add_fisher(r, &err), KV_OK, "a second call is a no-op");
    cr_assert_eq(r->layers[0].fisher_k, fk);
    cr_assert_eq(kv_stats_layer_tensors(r), 8);
    for (int64_t k = 0; k < c.n_kv_heads * c.head_dim; k++)
        cr_assert(r->layers[1].fisher_v[k] == 0 && r->layers[0].grad_v_cov[k] == 0);
    kv_stats_free(r);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, probe_recognises_only_stats_files) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "p.kvstats");
    cr_assert_eq(kv_stats_probe(path), 1);
    char *txt = kvt_path(dir, "notes.txt");
    put_file(txt, "Once upon a time\n", 17);
    cr_assert_eq(kv_stats_probe(txt), 0);
    char *magic = kvt_path(dir, "magic.gguf");
    put_file(magic, "GGUF", 4);
    cr_assert_eq(kv_stats_probe(magic), 0);
    char *none = kvt_path(dir, "absent.kvstats");
    cr_assert_eq(kv_stats_probe(none), 0);
    cr_assert_eq(kv_stats_probe(dir), 0);
    free(txt), free(magic), free(none), free(path);
    kv_stats_free(s);
    rm_tree(dir);
    KVT_NEED_SHARED(model, "models/stories260K/stories260K.gguf");
    cr_assert_eq(kv_stats_probe(model), 0);
}

static void expect_no_write_of_nonfinite(int64_t layer, int t, int64_t k, double x,
                                         const char *name) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    kv_stats_tensor_data(s, layer, t)[k] = x;
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "nan.kvstats");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_ENUMERIC, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, path);
    char want[128];
    snprintf(want, sizeof want, "tensor '%s': non-finite value", name);
    cr_assert(strstr(err.msg, want), "message '%s' lacks '%s'", err.msg, want);
    snprintf(want, sizeof want, "element %lld", (long long)k);
    cr_assert(strstr(err.msg, want), "message '%s' lacks '%s'", err.msg, want);
    cr_assert_eq(dir_entries(dir), 0, "neither the file nor a .tmp may exist");
    free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, refuses_non_finite_sums_and_writes_nothing) {
    expect_no_write_of_nonfinite(1, 2, 7, NAN, "blk.1.q_rope.cov");
    expect_no_write_of_nonfinite(0, 0, 16 * 3 + 5, INFINITY, "blk.0.attn_in.xtx");
    expect_no_write_of_nonfinite(1, 3, 31, -INFINITY, "blk.1.k_rope.cov");
}

/* A negative value where a sum of squares belongs: KV_ENUMERIC, nothing written. */
static void expect_no_write_of_negative(int64_t layer, int t, int64_t k, const char *name) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_fisher_stats(&c, 1.0);
    kv_stats_tensor_data(s, layer, t)[k] = -0.25;
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "neg.kvstats");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_ENUMERIC, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, path);
    char want[256];
    snprintf(want, sizeof want,
             "tensor '%s': negative value -0.25 at element %lld, where a sum of squares belongs; "
             "not written", name, (long long)k);
    cr_assert_str_eq(err.msg, want);
    cr_assert_eq(dir_entries(dir), 0, "neither the file nor a .tmp may exist");
    free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, refuses_negative_sums_of_squares_and_writes_nothing) {
    expect_no_write_of_negative(0, 4, 5, "blk.0.fisher.k");
    expect_no_write_of_negative(1, 5, 0, "blk.1.fisher.v");
    expect_no_write_of_negative(1, 6, 4 * 4 * 1 + 3 * 5, "blk.1.grad_k.cov"); /* head 1 (3, 3) */
    expect_no_write_of_negative(0, 7, 0, "blk.0.grad_v.cov");
    expect_no_write_of_nonfinite(1, 3, 31, NAN, "blk.1.k_rope.cov");
}

Test(kvstats_write, refused_write_keeps_the_previous_file) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "keep.kvstats");
    s->layers[0].xsum[3] = NAN;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_ENUMERIC);
    struct kv_stats *r = NULL;
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(r->layers[0].xsum[3], -(double)(1 * 4096 + 3) / 7.0);
    cr_assert_eq(dir_entries(dir), 1);
    kv_stats_free(r);
    kv_stats_free(s);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, replaces_an_existing_file) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0), *t = make_stats(&c, -2.5);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "twice.kvstats");
    free(write_stats(t, dir, "twice.kvstats"));
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(t, r);
    cr_assert_eq(dir_entries(dir), 1);
    kv_stats_free(r), kv_stats_free(s), kv_stats_free(t);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, names_the_path_it_cannot_create) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *sub = kvt_path(dir, "no-such-dir");
    char *path = kvt_path(sub, "out.kvstats");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_EIO, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, path);
    cr_assert_eq(err.off, KV_NO_OFFSET);
    cr_assert(strstr(err.msg, "cannot create"), "%s", err.msg);
    cr_assert(strstr(err.msg, "no such file or directory"), "%s", err.msg);
    cr_assert_eq(dir_entries(dir), 0);
    free(sub), free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

/* ------------------------------------------------------------ parse: corruption table */

struct want {
    uint64_t off;  /* expected error offset, or KV_NO_OFFSET */
    char msg[512]; /* a further substring computed from the file, or "" */
};
typedef void (*mutate_fn)(struct fx *f, struct want *w);

/* truncations */
static void m_cut_header(struct fx *f, struct want *w) {
    f->len = 12; /* inside the u64 tensor count at 8 */
    w->off = 8;
}
static void m_cut_metadata(struct fx *f, struct want *w) {
    /* late enough that the bytes left could still hold the tensor infos */
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.datasets.sha256");
    f->len = kv->arr_off + 8 + 64 + 8 + 10; /* 10 digits of the second entry */
    w->off = kv->arr_off + 8 + 64 + 8;
}
static void m_cut_tensor_info(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.0.q_rope.cov");
    f->len = t->type_off + 2;
    w->off = t->type_off;
}
static void m_cut_tensor_data(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.1.q_rope.cov");
    f->len = t->t.offset + t->t.nbytes / 2;
    w->off = t->offset_off;
    snprintf(w->msg, sizeof w->msg,
             "tensor 'blk.1.q_rope.cov' at data offset %llu needs %llu bytes but the data "
             "section holds %llu",
             (unsigned long long)t->rel_offset, (unsigned long long)t->t.nbytes,
             (unsigned long long)(f->len - f->g.data_off));
}
static void m_cut_last_byte(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.1.k_rope.cov");
    cr_assert_eq(t->t.offset + t->t.nbytes, f->len, "the last tensor ends the file");
    f->len -= 1;
    w->off = t->offset_off;
    snprintf(w->msg, sizeof w->msg, "needs %llu bytes but the data section holds %llu",
             (unsigned long long)t->t.nbytes, (unsigned long long)(f->len - f->g.data_off));
}

/* tensor data */
static void m_crc(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.1.q_rope.cov");
    f->p[t->t.offset + 13] ^= 0x01;
    w->off = t->t.offset;
}
static void m_nan(struct fx *f, struct want *w) {
    w->off = fx_poke_f64(f, "blk.1.attn_in.sum", 5, NAN);
}
static void m_inf(struct fx *f, struct want *w) {
    w->off = fx_poke_f64(f, "blk.0.q_rope.cov", 17, -INFINITY);
}

/* metadata */
static void m_type_statz(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "general.type");
    cr_assert_eq(kv->str.len, 11);
    f->p[kv->val_off + 8 + 10] = 'z';
    w->off = kv->val_off;
}
static void m_model_gguf(struct fx *f, struct want *w) {
    KVT_NEED_SHARED(model, "models/stories260K/stories260K.gguf");
    fx_load(f, model);
    cr_assert_null(kv_gguf_find(&f->g, "general.type"), "the shared model has no general.type");
    w->off = KV_NO_OFFSET;
}
static void m_no_type(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_key = "general.type";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_version2(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.format_version", 2);
    w->off = fx_kv(f, "kvcal.format_version")->val_off;
}
static void m_tokens(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.tokens", 7 * SEQ_LEN + 1);
    w->off = fx_kv(f, "kvcal.tokens")->val_off;
}
static void m_sampling(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.sampling");
    cr_assert_eq(kv->str.len, 6);
    f->p[kv->val_off + 8 + 5] = 'X'; /* "random" -> "randoX" */
    w->off = kv->val_off;
}
static void m_fingerprint(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.model.fingerprint");
    f->p[kv->val_off + 8 + 10] = 'A'; /* uppercase hex */
    w->off = kv->val_off;
}
static void m_next_window(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.plan.next_window", 8);
    w->off = fx_kv(f, "kvcal.plan.next_window")->val_off;
}
static void m_shard_index(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.shard.index", 3);
    w->off = fx_kv(f, "kvcal.shard.index")->val_off;
}
static void m_no_layers(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.model.n_layers", 0);
    w->off = fx_kv(f, "kvcal.model.n_layers")->val_off;
}
static void m_huge_dim(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.model.dim", 1u << 20);
    w->off = KV_NO_OFFSET;
}
static void m_kv_heads(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.model.n_kv_heads", 3);
    w->off = fx_kv(f, "kvcal.model.n_kv_heads")->val_off;
}
static void m_seq_len_type(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.seq_len");
    set_le(f->p + kv->type_off, KV_GGUF_F64, 4); /* same width as uint64 */
    w->off = kv->type_off;
}
static void m_dataset_windows(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.datasets.windows");
    cr_assert_eq(kv->arr_type, KV_GGUF_U64);
    set_le(f->p + kv->arr_off, 4, 8); /* 3 -> 4 */
    w->off = kv->val_off;
}
static void m_dataset_sha(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.datasets.sha256");
    f->p[kv->arr_off + 8 + 63] = 'g'; /* first element: u64 length, then the digits */
    w->off = kv->val_off;
}

/* files from the independent writer */
static void m_shape(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.xtx_cols = f->s->dim - 1;
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.0.attn_in.xtx")->info_off;
}
static void m_dtype(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.f32_tensor = "blk.1.attn_in.sum";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.1.attn_in.sum")->type_off;
}
static void m_missing_last(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.1.k_rope.cov";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_missing_middle(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.0.q_rope.cov";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.0.k_rope.cov")->info_off;
}
static void m_swapped(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.swap_first = 1;
    fx_hand(f, &h);
    w->off = f->g.tensors[0].info_off;
}
static void m_extra_tensor(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.extra_tensor = 1;
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.2.attn_in.xtx")->info_off;
}
static void m_crc_count(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.crc_extra = 1;
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.crc32")->val_off;
}
static void m_crc_wide(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.crc_wide = 1;
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.crc32")->val_off;
}
static void m_short_sha(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.short_sha = 1;
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.datasets.sha256")->val_off;
}
/* Forty inputs, each holding as many windows as its tokens allow: every
 * count is valid alone, and only their uint64 sum wraps. The reader must see
 * the overflow rather than compare a wrapped sum. */
static void m_windows_wrap(struct fx *f, struct want *w) {
    struct kv_err err;
    kv_err_clear(&err);
    for (int i = 0; i < 40; i++)
        cr_assert_eq(kv_stats_add_input(f->s, "data/big.txt", SHA_3, 1, INT64_MAX,
                                        INT64_MAX / SEQ_LEN, &err), KV_OK);
    struct hspec h = hspec_default();
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.datasets.windows")->val_off;
}
static void m_no_seq_len(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_key = "kvcal.seq_len";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}

/* Fisher statistics */
static void m_fisher_missing_last(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.1.grad_v.cov";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_fisher_missing_first_layer(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.0.grad_v.cov";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.1.attn_in.xtx")->info_off;
}
static void m_fisher_one_layer_only(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.drop_fisher_of = 2;
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_fisher_nan(struct fx *f, struct want *w) {
    fx_fisher(f);
    w->off = fx_poke_f64(f, "blk.0.fisher.k", 3, NAN);
}
static void m_fisher_negative(struct fx *f, struct want *w) {
    fx_fisher(f);
    w->off = fx_poke_f64(f, "blk.1.fisher.v", 6, -1.5);
}
static void m_grad_cov_negative_diagonal(struct fx *f, struct want *w) {
    fx_fisher(f);
    /* head 1, diagonal element (2, 2) of a 4x4 */
    w->off = fx_poke_f64(f, "blk.1.grad_k.cov", 16 + 2 * 4 + 2, -2.0);
}
static void m_grad_cov_f32(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.f32_tensor = "blk.0.grad_v.cov";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.0.grad_v.cov")->type_off;
}

struct row {
    const char *name;
    mutate_fn fn;
    int code;
    const char *substr; /* names the tensor or key */
};

static const struct row rows[] = {
    {"cut inside the header", m_cut_header, KV_EFORMAT,
     "truncated: need 8 bytes for the tensor count, have 4"},
    {"cut inside the metadata", m_cut_metadata, KV_EFORMAT,
     "truncated: need 64 bytes for element 1 of key 'kvcal.datasets.sha256', have 10"},
    {"cut inside a tensor info", m_cut_tensor_info, KV_EFORMAT,
     "truncated: need 4 bytes for tensor 'blk.0.q_rope.cov', have 2"},
    {"cut inside a tensor's data", m_cut_tensor_data, KV_EFORMAT, "tensor 'blk.1.q_rope.cov'"},
    {"one byte short", m_cut_last_byte, KV_EFORMAT, "tensor 'blk.1.k_rope.cov'"},
    {"flipped data byte", m_crc, KV_EFORMAT, "tensor 'blk.1.q_rope.cov': crc32 mismatch"},
    {"nan with a matching crc", m_nan, KV_EFORMAT,
     "tensor 'blk.1.attn_in.sum': non-finite value at element 5"},
    {"-inf with a matching crc", m_inf, KV_EFORMAT,
     "tensor 'blk.0.q_rope.cov': non-finite value at element 17"},
    {"general.type kvcal.statz", m_type_statz, KV_EFORMAT,
     "not a kvcal stats file: general.type is 'kvcal.statz', expected 'kvcal.stats'"},
    {"a model gguf", m_model_gguf, KV_EFORMAT,
     "not a kvcal stats file: no 'general.type' key"},
    {"general.type missing", m_no_type, KV_EFORMAT,
     "not a kvcal stats file: no 'general.type' key"},
    {"format version 2", m_version2, KV_EUNSUPPORTED,
     "stats format version 2 is not supported (this kvcal reads version 1)"},
    {"tokens not sequences * seq_len", m_tokens, KV_EFORMAT,
     "kvcal.tokens is 225 but 7 windows of 32 tokens make 224"},
    {"unknown sampling", m_sampling, KV_EFORMAT,
     "key 'kvcal.sampling' is 'randoX', expected sequential, random or merged"},
    {"uppercase fingerprint", m_fingerprint, KV_EFORMAT,
     "key 'kvcal.model.fingerprint' is not 64 lowercase hex digits"},
    {"next window past the plan", m_next_window, KV_EFORMAT,
     "key 'kvcal.plan.next_window' is 8, outside 0..7"},
    {"shard index = count", m_shard_index, KV_EFORMAT, "key 'kvcal.shard.index' is 3, outside 0..2"},
    {"zero layers", m_no_layers, KV_EFORMAT, "key 'kvcal.model.n_layers' is 0, outside 1..1024"},
    {"dim the file cannot hold", m_huge_dim, KV_EFORMAT,
     "truncated or inconsistent: 2 layers of dim 1048576 need more bytes"},
    {"heads not a multiple of kv heads", m_kv_heads, KV_EFORMAT,
     "4 heads are not a multiple of 3 kv heads"},
    {"seq_len of type float64", m_seq_len_type, KV_EFORMAT,
     "key 'kvcal.seq_len' has type float64, expected uint64"},
    {"dataset windows do not add up", m_dataset_windows, KV_EFORMAT,
     "the datasets' windows add up to 8 but kvcal.sequences is 7"},
    {"dataset sha256 not hex", m_dataset_sha, KV_EFORMAT, "dataset 0: sha256 is not 64 hex digits"},
    {"wrong shape", m_shape, KV_EFORMAT,
     "tensor 'blk.0.attn_in.xtx' has shape [16, 15], expected [16, 16]"},
    {"wrong dtype", m_dtype, KV_EFORMAT, "tensor 'blk.1.attn_in.sum' has type F32, expected F64"},
    {"missing last tensor", m_missing_last, KV_EFORMAT,
     "missing tensor 'blk.1.k_rope.cov': 2 layers need 8 tensors, the file has 7"},
    {"missing middle tensor", m_missing_middle, KV_EFORMAT,
     "missing tensor 'blk.0.q_rope.cov' (found 'blk.0.k_rope.cov' in its place)"},
    {"tensors out of order", m_swapped, KV_EFORMAT,
     "tensor 'blk.0.attn_in.sum' is at position 0, expected 'blk.0.attn_in.xtx' there"},
    {"an extra tensor", m_extra_tensor, KV_EFORMAT,
     "unexpected tensor 'blk.2.attn_in.xtx': 2 layers have 8 tensors"},
    {"crc32 with an extra entry", m_crc_count, KV_EFORMAT,
     "key 'kvcal.crc32' has 9 entries but the file has 8 tensors"},
    {"crc32 entry wider than 32 bits", m_crc_wide, KV_EFORMAT,
     "key 'kvcal.crc32': entry 0 is not a 32-bit value"},
    {"dataset arrays of different lengths", m_short_sha, KV_EFORMAT,
     "key 'kvcal.datasets.sha256' has 1 entries but 'kvcal.datasets' has 2"},
    {"dataset windows whose sum wraps", m_windows_wrap, KV_EFORMAT, "the datasets' windows"},
    {"seq_len missing", m_no_seq_len, KV_EFORMAT, "missing key 'kvcal.seq_len'"},
    {"fisher: last layer's grad_v.cov missing", m_fisher_missing_last, KV_EFORMAT,
     "missing tensor 'blk.1.grad_v.cov': 2 layers need 16 tensors, the file has 15; fisher "
     "statistics are fisher.k, fisher.v, grad_k.cov and grad_v.cov in every layer"},
    {"fisher: first layer's grad_v.cov missing", m_fisher_missing_first_layer, KV_EFORMAT,
     "missing tensor 'blk.0.grad_v.cov' (found 'blk.1.attn_in.xtx' in its place); fisher "
     "statistics are fisher.k, fisher.v, grad_k.cov and grad_v.cov in every layer"},
    {"fisher: in one layer only", m_fisher_one_layer_only, KV_EFORMAT,
     "missing tensor 'blk.1.fisher.k': 2 layers need 16 tensors, the file has 12"},
    {"fisher: nan with a matching crc", m_fisher_nan, KV_EFORMAT,
     "tensor 'blk.0.fisher.k': non-finite value at element 3"},
    {"fisher: negative sum of squares", m_fisher_negative, KV_EFORMAT,
     "tensor 'blk.1.fisher.v': negative value -1.5 at element 6, expected a sum of squares >= 0"},
    {"fisher: negative gradient covariance diagonal", m_grad_cov_negative_diagonal, KV_EFORMAT,
     "tensor 'blk.1.grad_k.cov': negative value -2 at element 26, expected a sum of squares >= 0"},
    {"fisher: gradient covariance as F32", m_grad_cov_f32, KV_EFORMAT,
     "tensor 'blk.0.grad_v.cov' has type F32, expected F64"},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

ParameterizedTestParameters(kvstats_parse, rejects_corruption) {
    static int idx[N_ROWS];
    for (size_t i = 0; i < N_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_ROWS);
}

ParameterizedTest(int *ip, kvstats_parse, rejects_corruption) {
    const struct row *r = &rows[*ip];
    struct fx f;
    fx_init(&f);
    struct want w = {.off = KV_NO_OFFSET};
    r->fn(&f, &w);
    char *path = kvt_path(f.dir, "bad.kvstats");
    put_file(path, f.p, f.len);

    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_stats_open(path, &s, &err);
    cr_assert_eq(rc, r->code, "%s: code %d (%s), expected %d", r->name, rc, fmt_err(&err),
                 r->code);
    cr_assert_null(s, "%s: *out set on failure", r->name);
    cr_assert_str_eq(err.path, path, "%s", r->name);
    cr_assert(strstr(err.msg, r->substr), "%s: message '%s' lacks '%s'", r->name, err.msg,
              r->substr);
    if (w.msg[0])
        cr_assert(strstr(err.msg, w.msg), "%s: message '%s' lacks '%s'", r->name, err.msg, w.msg);
    cr_assert_null(strchr(err.msg, '\n'), "%s: one line", r->name);
    cr_assert_eq(err.off, w.off, "%s: offset %llu, expected %llu (%s)", r->name,
                 (unsigned long long)err.off, (unsigned long long)w.off, fmt_err(&err));

    /* the byte parser reports the same error */
    struct kv_err e2;
    kv_err_clear(&e2);
    cr_assert_eq(kv_stats_parse(f.p, f.len, path, &s, &e2), r->code, "%s", r->name);
    cr_assert_null(s);
    cr_assert_eq(e2.off, err.off, "%s", r->name);
    cr_assert_str_eq(e2.msg, err.msg, "%s", r->name);
    cr_assert_str_eq(e2.path, path, "%s", r->name);
    free(path);
    fx_free(&f);
}

Test(kvstats_parse, names_a_file_it_cannot_open) {
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "absent.kvstats");
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &s, &err), KV_EIO);
    cr_assert_str_eq(err.path, path);
    cr_assert_null(s);
    char *empty = kvt_path(dir, "empty.kvstats");
    put_file(empty, "", 0);
    cr_assert_eq(kv_stats_open(empty, &s, &err), KV_EFORMAT, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, empty);
    free(path), free(empty);
    rm_tree(dir);
}

/* ------------------------------------------------------------ parse: garbage */

Test(kvstats_parse, every_prefix_fails_cleanly) {
    struct fx f;
    fx_init(&f);
    for (size_t n = 0; n < f.len; n++) {
        struct kv_stats *s = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        int rc = kv_stats_parse(f.p, n, "cut.kvstats", &s, &err);
        cr_assert_neq(rc, KV_OK, "prefix of %zu bytes accepted", n);
        cr_assert_null(s);
        cr_assert(err.msg[0], "prefix %zu: empty message", n);
        cr_assert_str_eq(err.path, "cut.kvstats", "prefix %zu", n);
        cr_assert(err.off == KV_NO_OFFSET || err.off <= n, "prefix %zu: offset %llu", n,
                  (unsigned long long)err.off);
    }
    struct kv_stats *s = NULL;
    struct kv_err err;
    cr_assert_eq(kv_stats_parse(f.p, f.len, "whole.kvstats", &s, &err), KV_OK, "%s",
                 fmt_err(&err));
    kv_stats_free(s);
    fx_free(&f);
}

Test(kvstats_parse, header_byte_flips_fail_cleanly) {
    struct fx f;
    fx_init(&f);
    uint8_t *copy = malloc(f.len);
    cr_assert(copy);
    int accepted = 0;
    for (uint64_t i = 0; i < f.g.data_off; i++) {
        memcpy(copy, f.p, f.len);
        copy[i] ^= 0xff;
        struct kv_stats *s = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        int rc = kv_stats_parse(copy, f.len, "flip.kvstats", &s, &err);
        if (rc == KV_OK) {
            cr_assert_not_null(s);
            kv_stats_free(s);
            accepted++;
            continue;
        }
        cr_assert(rc > KV_OK && rc <= KV_EUNSUPPORTED, "byte %llu: code %d",
                  (unsigned long long)i, rc);
        cr_assert_null(s);
        cr_assert(err.msg[0], "byte %llu: empty message", (unsigned long long)i);
        cr_assert_str_eq(err.path, "flip.kvstats", "byte %llu", (unsigned long long)i);
        cr_assert(err.off == KV_NO_OFFSET || err.off < f.len, "byte %llu: offset %llu",
                  (unsigned long long)i, (unsigned long long)err.off);
    }
    /* flips in the seed, a dataset's byte count or a path's text are legal */
    cr_assert(accepted > 0 && (uint64_t)accepted < f.g.data_off / 2, "%d flips accepted", accepted);
    free(copy);
    fx_free(&f);
}

Test(kvstats_parse, every_data_byte_flip_is_a_crc_mismatch) {
    struct fx f;
    fx_init(&f);
    cr_assert_eq(f.g.tensors[f.g.n_tensors - 1].t.offset + f.g.tensors[f.g.n_tensors - 1].t.nbytes,
                 f.len, "no padding after the data");
    for (int64_t k = 0; k < f.g.n_tensors; k++) {
        const struct kv_gguf_tensor *t = &f.g.tensors[k];
        char want[320];
        snprintf(want, sizeof want, "tensor '%s': crc32 mismatch", t->t.name);
        for (uint64_t i = t->t.offset; i < t->t.offset + t->t.nbytes; i++) {
            f.p[i] ^= 0xff;
            struct kv_stats *s = NULL;
            struct kv_err err;
            kv_err_clear(&err);
            int rc = kv_stats_parse(f.p, f.len, "flip.kvstats", &s, &err);
            f.p[i] ^= 0xff;
            cr_assert_eq(rc, KV_EFORMAT, "byte %llu: code %d", (unsigned long long)i, rc);
            cr_assert(strstr(err.msg, want), "byte %llu: '%s'", (unsigned long long)i, err.msg);
            cr_assert_eq(err.off, t->t.offset, "byte %llu", (unsigned long long)i);
        }
    }
    fx_free(&f);
}

Test(kvstats_parse, matches_model_checks_shape_and_fingerprint) {
    struct kv_config c = small_cfg();
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, 5, &m, &err), KV_OK, "%s", fmt_err(&err));
    char fp[65];
    cr_assert_eq(kv_model_fingerprint(m, fp, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_stats *s = make_stats(&c, 1.0);
    snprintf(s->fingerprint, sizeof s->fingerprint, "%s", fp);
    cr_assert_eq(kv_stats_matches_model(s, m, "s.kvstats", &err), 1, "%s", fmt_err(&err));

    s->fingerprint[0] = s->fingerprint[0] == '0' ? '1' : '0';
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_matches_model(s, m, "s.kvstats", &err), 0);
    cr_assert_eq(err.code, KV_EINVAL);
    cr_assert_str_eq(err.path, "s.kvstats");
    cr_assert(strstr(err.msg, "collected on another model"), "%s", err.msg);
    kv_stats_free(s);

    struct kv_config c2 = c;
    c2.n_layers = 1;
    s = make_stats(&c2, 1.0);
    snprintf(s->fingerprint, sizeof s->fingerprint, "%s", fp);
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_matches_model(s, m, "s.kvstats", &err), 0);
    cr_assert_eq(err.code, KV_EINVAL);
    cr_assert_str_eq(err.path, "s.kvstats");
    cr_assert(strstr(err.msg, "statistics are for 1 layers, dim 16"), "%s", err.msg);
    kv_stats_free(s);
    kv_model_close(m);
}

/* ------------------------------------------------------------ merge */

Test(kvstats_merge, adds_sums_counts_and_inputs_exactly) {
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_stats(&c, 1.0), *a = make_stats(&c, 1.0);
    struct kv_stats *b = make_stats(&c, -0.7);
    struct kv_err err;
    kv_err_clear(&err);
    /* b: b.txt again (same path and sha: windows add), a new c.txt, and a.txt
     * with other contents (another sha: a new input) */
    for (int64_t i = 0; i < b->n_inputs; i++) free(b->inputs[i].path);
    b->n_inputs = 0;
    cr_assert_eq(kv_stats_add_input(b, "data/b.txt", SHA_2, 99999, 5000, 5, &err), KV_OK);
    cr_assert_eq(kv_stats_add_input(b, "data/c.txt", SHA_3, 10, 200, 2, &err), KV_OK);
    cr_assert_eq(kv_stats_add_input(b, "data/a.txt", SHA_4, 77, 88, 1, &err), KV_OK);
    b->windows = 8;
    b->tokens = 8 * SEQ_LEN;
    b->plan_windows = b->next_window = 8;
    b->shard_index = 2;

    cr_assert_eq(kv_stats_merge(acc, b, "b.kvstats", &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int t = 0; t < KV_STATS_PER_LAYER; t++) {
            char name[64];
            int64_t shape[3];
            int64_t n = numel(shape, kv_stats_tensor_desc(acc, l, t, name, sizeof name, shape));
            const double *x = kv_stats_tensor_data(a, l, t), *y = kv_stats_tensor_data(b, l, t);
            double *want = malloc((size_t)n * 8);
            for (int64_t i = 0; i < n; i++) want[i] = x[i] + y[i];
            cr_assert(!memcmp(kv_stats_tensor_data(acc, l, t), want, (size_t)n * 8),
                      "tensor '%s' is not the exact element-wise sum", name);
            free(want);
        }
    cr_assert_eq(acc->windows, 15);
    cr_assert_eq(acc->tokens, 15 * SEQ_LEN);
    cr_assert_str_eq(acc->sampling, "merged");
    cr_assert_eq(acc->plan_windows, 15);
    cr_assert_eq(acc->next_window, 15);
    cr_assert_eq(acc->seed, 0);
    cr_assert_eq(acc->samples, 0);
    cr_assert_eq(acc->shard_index, 0);
    cr_assert_eq(acc->shard_count, 1);
    cr_assert_str_eq(acc->fingerprint, FP_A);
    cr_assert_eq(acc->seq_len, SEQ_LEN);
    static const struct {
        const char *path, *sha;
        uint64_t bytes;
        int64_t tokens, windows;
    } in[] = {{"data/a.txt", SHA_1, 1234, 600, 3},
              {"data/b.txt", SHA_2, 99999, 5000, 9},
              {"data/c.txt", SHA_3, 10, 200, 2},
              {"data/a.txt", SHA_4, 77, 88, 1}};
    cr_assert_eq(acc->n_inputs, 4);
    for (int i = 0; i < 4; i++) {
        cr_assert_str_eq(acc->inputs[i].path, in[i].path, "input %d", i);
        cr_assert_str_eq(acc->inputs[i].sha256, in[i].sha, "input %d", i);
        cr_assert_eq(acc->inputs[i].bytes, in[i].bytes, "input %d", i);
        cr_assert_eq(acc->inputs[i].tokens, in[i].tokens, "input %d", i);
        cr_assert_eq(acc->inputs[i].windows, in[i].windows, "input %d", i);
    }

    /* the merged statistics are a valid file */
    char *dir = kvt_temp_dir();
    char *path = write_stats(acc, dir, "merged.kvstats");
    struct kv_stats *r = NULL;
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(acc, r);
    kv_stats_free(r);
    free(path);
    rm_tree(dir);
    kv_stats_free(acc), kv_stats_free(a), kv_stats_free(b);
}

Test(kvstats_merge, adds_fisher_sums_exactly) {
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_fisher_stats(&c, 1.0), *a = make_fisher_stats(&c, 1.0);
    struct kv_stats *b = make_fisher_stats(&c, -0.7);
    b->shard_index = 2;
    struct kv_err err;
    kv_err_clear(&err);
    /* b's inputs are a's (same windows again), so make room for them */
    for (int64_t i = 0; i < b->n_inputs; i++) acc->inputs[i].tokens = b->inputs[i].tokens = 1 << 20;
    cr_assert_eq(kv_stats_merge(acc, b, "b.kvstats", &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(acc->has_fisher, 1);
    cr_assert_eq(kv_stats_layer_tensors(acc), 8);
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int t = 0; t < 8; t++) {
            char name[64];
            int64_t shape[3];
            int64_t n = numel(shape, kv_stats_tensor_desc(acc, l, t, name, sizeof name, shape));
            const double *x = kv_stats_tensor_data(a, l, t), *y = kv_stats_tensor_data(b, l, t);
            const double *got = kv_stats_tensor_data(acc, l, t);
            for (int64_t i = 0; i < n; i++)
                cr_assert(got[i] == x[i] + y[i], "tensor '%s' element %lld: %.17g, expected %.17g",
                          name, (long long)i, got[i], x[i] + y[i]);
        }
    kv_stats_free(acc), kv_stats_free(a), kv_stats_free(b);
}

Test(kvstats_merge, refuses_fisher_with_non_fisher_either_way) {
    struct kv_config c = small_cfg();
    for (int k = 0; k < 2; k++) {
        struct kv_stats *acc = k ? make_fisher_stats(&c, 1.0) : make_stats(&c, 1.0);
        struct kv_stats *b = k ? make_stats(&c, 2.0) : make_fisher_stats(&c, 2.0);
        b->shard_index = 2;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_stats_merge(acc, b, "shards/b.kvstats", &err), KV_EINVAL, "%s",
                     fmt_err(&err));
        cr_assert_str_eq(err.path, "shards/b.kvstats");
        cr_assert_str_eq(err.msg, k ? "has no fisher statistics and the first shard has them; "
                                      "collect every shard with --fisher, or none"
                                    : "has fisher statistics and the first shard has none; "
                                      "collect every shard with --fisher, or none");
        cr_assert_eq(acc->windows, 7, "a refusal changes nothing");
        cr_assert_eq(acc->has_fisher, k);
        kv_stats_free(acc), kv_stats_free(b);
    }
}

typedef struct kv_stats *(*make_b_fn)(void);

static struct kv_stats *b_other_model(void) {
    struct kv_config c = small_cfg();
    struct kv_stats *b = make_stats(&c, 2.0);
    snprintf(b->fingerprint, sizeof b->fingerprint, "%s", FP_B);
    return b;
}
static struct kv_stats *b_other_seq_len(void) {
    struct kv_config c = small_cfg();
    struct kv_stats *b = make_stats(&c, 2.0);
    b->seq_len = 2 * SEQ_LEN;
    b->tokens = b->windows * b->seq_len;
    return b;
}
static struct kv_stats *b_other_shape(void) {
    struct kv_config c = small_cfg();
    c.dim = 8, c.n_heads = 2, c.n_kv_heads = 1;
    return make_stats(&c, 2.0);
}
static struct kv_stats *b_checkpoint(void) {
    struct kv_config c = small_cfg();
    struct kv_stats *b = make_stats(&c, 2.0);
    b->plan_windows = 10;
    return b;
}

struct merge_row {
    const char *name;
    make_b_fn make;
    const char *substr;
};

static const struct merge_row merge_rows[] = {
    {"another fingerprint", b_other_model,
     "collected on another model (fingerprint fedcba987654, the first shard has 0123456789ab)"},
    {"another seq_len", b_other_seq_len, "seq-len 64 differs from the first shard's 32"},
    {"another shape", b_other_shape,
     "shaped for another model (dim 8, 2 layers; the first shard has dim 16, 2 layers)"},
    {"an unfinished checkpoint", b_checkpoint,
     "an unfinished checkpoint (7 of 10 windows); finish it with 'kvcal collect --resume' first"},
};
#define N_MERGE_ROWS (sizeof merge_rows / sizeof merge_rows[0])

ParameterizedTestParameters(kvstats_merge, refuses_shards_that_do_not_add_up) {
    static int idx[N_MERGE_ROWS];
    for (size_t i = 0; i < N_MERGE_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_MERGE_ROWS);
}

ParameterizedTest(int *ip, kvstats_merge, refuses_shards_that_do_not_add_up) {
    const struct merge_row *r = &merge_rows[*ip];
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_stats(&c, 1.0), *before = make_stats(&c, 1.0);
    struct kv_stats *b = r->make();
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_stats_merge(acc, b, "shards/b.kvstats", &err);
    cr_assert_eq(rc, KV_EINVAL, "%s: code %d (%s)", r->name, rc, fmt_err(&err));
    cr_assert_str_eq(err.path, "shards/b.kvstats", "%s", r->name);
    cr_assert_eq(err.off, KV_NO_OFFSET, "%s", r->name);
    cr_assert(strstr(err.msg, r->substr), "%s: message '%s' lacks '%s'", r->name, err.msg,
              r->substr);
    cr_assert_null(strchr(err.msg, '\n'), "%s: one line", r->name);
    assert_stats_eq(acc, before); /* a refusal changes nothing */
    kv_stats_free(acc), kv_stats_free(before), kv_stats_free(b);
}

/* Counts that fit a file each (tokens = windows * seq_len <= INT64_MAX) but
 * not their sum: the merge must refuse instead of wrapping into a negative
 * count that kv_stats_write stores as a huge uint64 the reader rejects. */
Test(kvstats_merge, refuses_counts_that_overflow) {
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_stats(&c, 1.0), *b = make_stats(&c, 1.0);
    for (int k = 0; k < 2; k++) {
        struct kv_stats *s = k ? b : acc;
        for (int64_t i = 0; i < s->n_inputs; i++) free(s->inputs[i].path);
        s->n_inputs = 0;
        s->seq_len = 1;
        s->windows = s->tokens = INT64_MAX / 4 * 3;
        s->plan_windows = s->next_window = s->windows;
    }
    /* each is a file kv_stats_open accepts */
    char *dir = kvt_temp_dir();
    char *path = write_stats(b, dir, "big.kvstats");
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    kv_stats_free(r);

    kv_err_clear(&err);
    int rc = kv_stats_merge(acc, b, path, &err);
    cr_assert_neq(rc, KV_OK, "merge wrapped the token count to %lld", (long long)acc->tokens);
    cr_assert_str_eq(err.path, path);
    cr_assert_eq(acc->tokens, INT64_MAX / 4 * 3, "a refusal changes nothing");
    free(path);
    rm_tree(dir);
    kv_stats_free(acc), kv_stats_free(b);
}
