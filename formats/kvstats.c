/* Statistics file: in-memory form, writer and validating reader. */
#include "kvstats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "err.h"
#include "gguf.h"
#include "ggufw.h"
#include "limits.h"
#include "mapfile.h"
#include "model.h"

_Static_assert(sizeof(double) == 8, "float64 is 8 bytes");

static const char *const tensor_suffix[KV_STATS_PER_LAYER + KV_STATS_FISHER_PER_LAYER] = {
    "attn_in.xtx", "attn_in.sum", "q_rope.cov", "k_rope.cov",
    "fisher.k",    "fisher.v",    "grad_k.cov", "grad_v.cov"};

int kv_stats_layer_tensors(const struct kv_stats *s) {
    return KV_STATS_PER_LAYER + (s->info.has_fisher ? KV_STATS_FISHER_PER_LAYER : 0);
}

int kv_stats_tensor_desc(const struct kv_stats *s, int64_t layer, int t, char *name, size_t cap,
                         int64_t shape[3]) {
    KV_ASSERT(t >= 0 && t < KV_STATS_PER_LAYER + KV_STATS_FISHER_PER_LAYER);
    snprintf(name, cap, "blk.%lld.%s", (long long)layer, tensor_suffix[t]);
    switch (t) {
    case 0: shape[0] = s->info.dim, shape[1] = s->info.dim; return 2;
    case 1: shape[0] = s->info.dim; return 1;
    case 2: shape[0] = s->info.n_heads, shape[1] = s->info.head_dim, shape[2] = s->info.head_dim; return 3;
    case 4:
    case 5: shape[0] = s->info.n_kv_heads * s->info.head_dim; return 1;
    default: shape[0] = s->info.n_kv_heads, shape[1] = s->info.head_dim, shape[2] = s->info.head_dim; return 3;
    }
}

double *kv_stats_tensor_data(const struct kv_stats *s, int64_t layer, int t) {
    struct kv_stats_layer *l = &s->layers[layer];
    double *const p[KV_STATS_PER_LAYER + KV_STATS_FISHER_PER_LAYER] = {
        l->xtx, l->xsum, l->q_cov, l->k_cov, l->fisher_k, l->fisher_v, l->grad_k_cov, l->grad_v_cov};
    KV_ASSERT(t >= 0 && t < kv_stats_layer_tensors(s));
    return p[t];
}

static int64_t numel(const int64_t *shape, int nd) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    return n;
}

/* The side of tensor t's symmetric matrices, or 0 for a vector. */
static int64_t sym_side(const struct kv_stats *s, int t) {
    return t == 0 ? s->info.dim : (t == 2 || t == 3 || t == 6 || t == 7) ? s->info.head_dim : 0;
}

static void mirror(double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = i + 1; j < n; j++) a[j * n + i] = a[i * n + j];
}

void kv_stats_mirror(struct kv_stats *s) {
    if (!s->upper) return;
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int t = 0; t < kv_stats_layer_tensors(s); t++) {
            int64_t n = sym_side(s, t), shape[3];
            char name[64];
            if (!n) continue;
            int nd = kv_stats_tensor_desc(s, l, t, name, sizeof name, shape);
            int64_t mats = nd == 3 ? shape[0] : 1;
            double *p = kv_stats_tensor_data(s, l, t);
            for (int64_t i = 0; i < mats; i++) mirror(p + i * n * n, n);
        }
    s->upper = 0;
}

/* Tensor data as the file holds it: p's elements, with a symmetric matrix's
 * lower triangle read from its upper one when only that is kept. */
struct sym_view {
    const double *p;
    int64_t side; /* 0: p as is */
};

static double view_elem(const struct sym_view *v, int64_t e) {
    if (!v->side) return v->p[e];
    int64_t nn = v->side * v->side, m = e / nn, i = e % nn / v->side, j = e % v->side;
    return v->p[m * nn + (i <= j ? i * v->side + j : j * v->side + i)];
}

/* kv_ggufw_gen_fn: bytes [off, off + n) of a view's little-endian doubles */
static void view_gen(void *ctx, uint64_t off, void *out, uint64_t n) {
    uint8_t *o = out;
    while (n) {
        uint64_t e = off / 8, b = off % 8, k = 8 - b < n ? 8 - b : n;
        double x = view_elem(ctx, (int64_t)e);
        memcpy(o, (const uint8_t *)&x + b, (size_t)k);
        o += k, off += k, n -= k;
    }
}

/* The first element of tensor t's data p [n] that no stats file holds, or
 * -1: a non-finite value anywhere, or a negative one where a sum of squares
 * belongs (the Fisher sums, the gradient covariances' diagonals). */
static int64_t bad_element(const struct kv_stats *s, int t, const struct sym_view *v, int64_t n,
                           int *negative) {
    int64_t dh = s->info.head_dim;
    int squares = t == 4 || t == 5, diagonals = t == 6 || t == 7;
    for (int64_t i = 0; i < n; i++) {
        *negative = 0;
        double x = view_elem(v, i);
        if (!isfinite(x)) return i;
        /* element i of a [.., d_h, d_h] tensor is diagonal when its offset
         * within its matrix is a multiple of d_h + 1 */
        if (x < 0 && (squares || (diagonals && i % (dh * dh) % (dh + 1) == 0))) {
            *negative = 1;
            return i;
        }
    }
    return -1;
}

void kv_stats_free(struct kv_stats *s) {
    if (!s) return;
    if (s->layers)
        for (int64_t l = 0; l < s->info.n_layers; l++) {
            free(s->layers[l].block);
            free(s->layers[l].fisher_k);
        }
    free(s->layers);
    for (int64_t i = 0; i < s->info.n_inputs; i++) free(s->inputs[i].path);
    free(s->inputs);
    free(s);
}

struct kv_stats_info kv_stats_info(const struct kv_stats *s) { return s->info; }

const struct kv_stats_input *kv_stats_input(const struct kv_stats *s, int64_t i) {
    KV_ASSERT(i >= 0 && i < s->info.n_inputs);
    return &s->inputs[i];
}

double kv_stats_fisher_total(const struct kv_stats *s, int64_t l, int which) {
    KV_ASSERT(l >= 0 && l < s->info.n_layers);
    if (!s->info.has_fisher) return NAN;
    const double *f = which ? s->layers[l].fisher_v : s->layers[l].fisher_k;
    double t = 0;
    for (int64_t r = 0; r < s->info.n_kv_heads * s->info.head_dim; r++) t += f[r];
    return t;
}

#define PAGE_DOUBLES 512 /* a 4 KiB page */

/* Shape fields must be set and validated; allocates zeroed sums. */
static int alloc_layers(struct kv_stats *s, const char *path, struct kv_err *err) {
    s->layers = calloc((size_t)s->info.n_layers, sizeof *s->layers);
    if (!s->layers) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int64_t d = s->info.dim, hd = s->info.head_dim;
    int64_t per = d * d + d + (s->info.n_heads + s->info.n_kv_heads) * hd * hd;
    for (int64_t l = 0; l < s->info.n_layers; l++) {
        /* xtx starts on a page: a row of d = 512k doubles is then k whole
         * pages, and the pages wholly below the diagonal are never touched
         * by sums that only write upper triangles (kv_stats.upper) */
        double *b = calloc((size_t)(per + PAGE_DOUBLES), sizeof *b);
        if (!b)
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET,
                           "out of memory for the statistics of %lld layers of dim %lld",
                           (long long)s->info.n_layers, (long long)d);
        uintptr_t mis = (uintptr_t)b % (PAGE_DOUBLES * sizeof *b);
        double *p = mis ? b + (PAGE_DOUBLES * sizeof *b - mis) / sizeof *b : b;
        s->layers[l].block = b;
        s->layers[l].xtx = p;
        s->layers[l].xsum = p + d * d;
        s->layers[l].q_cov = p + d * d + d;
        s->layers[l].k_cov = p + d * d + d + s->info.n_heads * hd * hd;
    }
    return KV_OK;
}

/* Zeroed Fisher sums in every layer (one block per layer, owned by fisher_k). */
static int alloc_fisher(struct kv_stats *s, const char *path, struct kv_err *err) {
    int64_t kd = s->info.n_kv_heads * s->info.head_dim, hd = s->info.head_dim;
    int64_t per = 2 * kd + 2 * s->info.n_kv_heads * hd * hd;
    for (int64_t l = 0; l < s->info.n_layers; l++) {
        struct kv_stats_layer *y = &s->layers[l];
        if (y->fisher_k) continue;
        double *p = calloc((size_t)per, sizeof *p);
        if (!p)
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET,
                           "out of memory for the fisher statistics of %lld layers",
                           (long long)s->info.n_layers);
        y->fisher_k = p;
        y->fisher_v = p + kd;
        y->grad_k_cov = p + 2 * kd;
        y->grad_v_cov = p + 2 * kd + s->info.n_kv_heads * hd * hd;
    }
    s->info.has_fisher = 1;
    return KV_OK;
}

int kv_stats_add_fisher(struct kv_stats *s, struct kv_err *err) {
    /* Fisher sums over fewer windows than the rest would be misread */
    if (!s->info.has_fisher && s->info.windows > 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "statistics of %lld windows have no fisher sums to extend; fisher sums "
                       "start with the first window", (long long)s->info.windows);
    return alloc_fisher(s, NULL, err);
}

static void set_defaults(struct kv_stats *s) {
    snprintf(s->info.version, sizeof s->info.version, "%s", KVCAL_VERSION);
    snprintf(s->info.sampling, sizeof s->info.sampling, "sequential");
    s->info.shard_count = 1;
}

int kv_stats_init(const struct kv_config *cfg, struct kv_stats **out, struct kv_err *err) {
    struct kv_stats *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    s->info.n_layers = cfg->n_layers;
    s->info.dim = cfg->dim;
    s->info.n_heads = cfg->n_heads;
    s->info.n_kv_heads = cfg->n_kv_heads;
    s->info.head_dim = cfg->head_dim;
    set_defaults(s);
    int rc = alloc_layers(s, NULL, err);
    if (rc) {
        kv_stats_free(s);
        return rc;
    }
    *out = s;
    return KV_OK;
}

int kv_stats_add_input(struct kv_stats *s, const char *path, const char sha256[65],
                       uint64_t bytes, int64_t tokens, int64_t windows, struct kv_err *err) {
    struct kv_stats_input *ni = realloc(s->inputs, (size_t)(s->info.n_inputs + 1) * sizeof *ni);
    if (!ni) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    s->inputs = ni;
    struct kv_stats_input *in = &ni[s->info.n_inputs];
    memset(in, 0, sizeof *in);
    in->path = strdup(path);
    if (!in->path) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    snprintf(in->sha256, sizeof in->sha256, "%s", sha256);
    in->bytes = bytes;
    in->tokens = tokens;
    in->windows = windows;
    s->info.n_inputs++;
    return KV_OK;
}

static uint32_t crc_of(const void *data, uint64_t n) {
    uLong c = crc32(0L, Z_NULL, 0);
    const Bytef *p = data;
    while (n) {
        uInt k = n < (1u << 30) ? (uInt)n : (1u << 30);
        c = crc32(c, p, k);
        p += k;
        n -= k;
    }
    return (uint32_t)c;
}

/* crc_of the n elements of a view, as the file holds them */
static uint32_t crc_of_view(const struct sym_view *v, int64_t n) {
    if (!v->side) return crc_of(v->p, (uint64_t)n * 8);
    uLong c = crc32(0L, Z_NULL, 0);
    double buf[4096];
    for (int64_t e = 0; e < n; e += 4096) {
        int64_t k = n - e < 4096 ? n - e : 4096;
        view_gen((void *)v, (uint64_t)e * 8, buf, (uint64_t)k * 8);
        c = crc32(c, (const Bytef *)buf, (uInt)(k * 8));
    }
    return (uint32_t)c;
}

/* zlib crc32 of the metadata (every key but the crcs, and has_fisher,
 * which the tensors carry) as one canonical text: what kvcal.meta_crc32
 * holds, so a changed count, seed, plan or dataset record is detected as a
 * changed tensor is. */
static uint32_t meta_crc(const struct kv_stats *s) {
    const struct kv_stats_info *i = &s->info;
    char buf[512];
    uLong c = crc32(0L, Z_NULL, 0);
    int n = snprintf(buf, sizeof buf,
                     "%s\n%s\n%lld %lld %lld %lld %lld\n%lld %lld %lld\n%s %llu %lld %lld %lld "
                     "%lld %lld\n",
                     i->version, i->fingerprint, (long long)i->n_layers, (long long)i->dim,
                     (long long)i->n_heads, (long long)i->n_kv_heads, (long long)i->head_dim,
                     (long long)i->seq_len, (long long)i->tokens, (long long)i->windows,
                     i->sampling, (unsigned long long)i->seed, (long long)i->samples,
                     (long long)i->shard_index, (long long)i->shard_count,
                     (long long)i->plan_windows, (long long)i->next_window);
    c = crc32(c, (const Bytef *)buf, (uInt)n);
    if (i->tokenization[0]) /* files from before the key keep their checksum */
        c = crc32(c, (const Bytef *)i->tokenization, (uInt)strlen(i->tokenization));
    for (int64_t k = 0; k < i->n_inputs; k++) {
        const struct kv_stats_input *in = &s->inputs[k];
        c = crc32(c, (const Bytef *)in->path, (uInt)strlen(in->path));
        n = snprintf(buf, sizeof buf, "\n%s %llu %lld %lld\n", in->sha256,
                     (unsigned long long)in->bytes, (long long)in->tokens, (long long)in->windows);
        c = crc32(c, (const Bytef *)buf, (uInt)n);
    }
    return (uint32_t)c;
}

static int is_hex64(const char *s) {
    if (strlen(s) != 64) return 0;
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}

/* ------------------------------------------------------------------ write */

int kv_stats_write(const struct kv_stats *s, const char *path, struct kv_err *err) {
    int per = kv_stats_layer_tensors(s);
    int64_t nt = s->info.n_layers * per;
    uint32_t *crc = malloc((size_t)(nt ? nt : 1) * sizeof *crc);
    struct sym_view *views = malloc((size_t)(nt ? nt : 1) * sizeof *views);
    const char **names = malloc((size_t)(s->info.n_inputs ? s->info.n_inputs : 1) * sizeof *names);
    const char **shas = malloc((size_t)(s->info.n_inputs ? s->info.n_inputs : 1) * sizeof *shas);
    uint64_t *arr = malloc((size_t)(s->info.n_inputs ? s->info.n_inputs : 1) * 3 * sizeof *arr);
    struct kv_ggufw *w = NULL;
    int rc = KV_OK;
    if (!crc || !views || !names || !shas || !arr) {
        rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    /* refuse to write what the reader would refuse to read */
    uint64_t prod;
    if (!is_hex64(s->info.fingerprint) || s->info.seq_len < 1 || s->info.seq_len > KV_MAX_CTX ||
        s->info.windows < 0 || s->info.next_window < 0 || s->info.next_window > s->info.plan_windows ||
        s->info.shard_count < 1 || s->info.shard_index < 0 || s->info.shard_index >= s->info.shard_count ||
        !kv_mul_u64((uint64_t)s->info.windows, (uint64_t)s->info.seq_len, &prod) ||
        prod != (uint64_t)s->info.tokens) {
        rc = kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                     "statistics are incomplete (fingerprint, seq-len, counts or plan unset or "
                     "inconsistent); not written");
        goto done;
    }
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int t = 0; t < per; t++) {
            char name[64];
            int64_t shape[3];
            int nd = kv_stats_tensor_desc(s, l, t, name, sizeof name, shape);
            struct sym_view *v = &views[l * per + t];
            *v = (struct sym_view){kv_stats_tensor_data(s, l, t), s->upper ? sym_side(s, t) : 0};
            int64_t n = numel(shape, nd);
            int neg;
            int64_t i = bad_element(s, t, v, n, &neg);
            if (i >= 0) {
                rc = neg ? kv_fail(err, KV_ENUMERIC, path, KV_NO_OFFSET,
                                   "tensor '%s': negative value %g at element %lld, where a sum "
                                   "of squares belongs; not written", name, view_elem(v, i), (long long)i)
                         : kv_fail(err, KV_ENUMERIC, path, KV_NO_OFFSET,
                                   "tensor '%s': non-finite value %g at element %lld; not written",
                                   name, view_elem(v, i), (long long)i);
                goto done;
            }
            crc[l * per + t] = crc_of_view(v, n);
        }
    for (int64_t i = 0; i < s->info.n_inputs; i++) {
        names[i] = s->inputs[i].path;
        shas[i] = s->inputs[i].sha256;
    }
    if ((rc = kv_ggufw_init(&w, err))) goto done;
#define U64(k, v) (rc = kv_ggufw_add_u64(w, k, (uint64_t)(v), err))
    if ((rc = kv_ggufw_add_str(w, "general.type", KV_STATS_TYPE, err)) ||
        (rc = kv_ggufw_add_u32(w, "kvcal.format_version", KV_STATS_FORMAT_VERSION, err)) ||
        (rc = kv_ggufw_add_str(w, "kvcal.version", s->info.version, err)) ||
        (rc = kv_ggufw_add_str(w, "kvcal.model.fingerprint", s->info.fingerprint, err)) ||
        U64("kvcal.model.n_layers", s->info.n_layers) || U64("kvcal.model.dim", s->info.dim) ||
        U64("kvcal.model.n_heads", s->info.n_heads) || U64("kvcal.model.n_kv_heads", s->info.n_kv_heads) ||
        U64("kvcal.model.head_dim", s->info.head_dim) || U64("kvcal.seq_len", s->info.seq_len) ||
        U64("kvcal.tokens", s->info.tokens) || U64("kvcal.sequences", s->info.windows) ||
        (rc = kv_ggufw_add_str(w, "kvcal.sampling", s->info.sampling, err)) ||
        U64("kvcal.seed", s->info.seed) || U64("kvcal.samples", s->info.samples) ||
        U64("kvcal.shard.index", s->info.shard_index) || U64("kvcal.shard.count", s->info.shard_count) ||
        U64("kvcal.plan.windows", s->info.plan_windows) ||
        U64("kvcal.plan.next_window", s->info.next_window) ||
        (s->info.tokenization[0] &&
         (rc = kv_ggufw_add_str(w, "kvcal.tokenization", s->info.tokenization, err))))
        goto done;
#undef U64
    uint64_t ni = (uint64_t)s->info.n_inputs, *by = arr, *tk = arr + ni, *wn = arr + 2 * ni;
    for (int64_t i = 0; i < s->info.n_inputs; i++) {
        by[i] = s->inputs[i].bytes;
        tk[i] = (uint64_t)s->inputs[i].tokens;
        wn[i] = (uint64_t)s->inputs[i].windows;
    }
    if ((rc = kv_ggufw_add_arr_str(w, "kvcal.datasets", names, ni, err)) ||
        (rc = kv_ggufw_add_arr_str(w, "kvcal.datasets.sha256", shas, ni, err)) ||
        (rc = kv_ggufw_add_arr_u64(w, "kvcal.datasets.bytes", by, ni, err)) ||
        (rc = kv_ggufw_add_arr_u64(w, "kvcal.datasets.tokens", tk, ni, err)) ||
        (rc = kv_ggufw_add_arr_u64(w, "kvcal.datasets.windows", wn, ni, err)) ||
        (rc = kv_ggufw_add_arr_u32(w, "kvcal.crc32", crc, (uint64_t)nt, err)) ||
        (rc = kv_ggufw_add_u32(w, "kvcal.meta_crc32", meta_crc(s), err)))
        goto done;
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int t = 0; t < per; t++) {
            char name[64];
            int64_t shape[3];
            int nd = kv_stats_tensor_desc(s, l, t, name, sizeof name, shape);
            const struct sym_view *v = &views[l * per + t];
            uint64_t nb = (uint64_t)numel(shape, nd) * 8;
            if ((rc = v->side ? kv_ggufw_add_tensor_gen(w, name, 28 /* F64 */, nd, shape, nb,
                                                        view_gen, (void *)v, err)
                              : kv_ggufw_add_tensor(w, name, 28, nd, shape, v->p, nb, err)))
                goto done;
        }
    rc = kv_ggufw_write(w, path, err);
done:
    kv_ggufw_free(w);
    free(crc), free(views), free(names), free(shas), free(arr);
    if (rc && !err->path[0]) snprintf(err->path, sizeof err->path, "%s", path);
    return rc;
}

/* ------------------------------------------------------------------ read */

/* u64 key bounded to [lo, hi]. */
static int get_bounded(const struct kv_gguf_file *f, const char *key, uint64_t lo, uint64_t hi,
                       int64_t *out, struct kv_err *err) {
    uint64_t v;
    int rc = kv_gguf_get_u64(f, key, &v, err);
    if (rc) return rc;
    if (v < lo || v > hi)
        return kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, key)->val_off,
                       "key '%s' is %llu, outside %llu..%llu", key, (unsigned long long)v,
                       (unsigned long long)lo, (unsigned long long)hi);
    *out = (int64_t)v;
    return KV_OK;
}

/* String key copied into buf; too long is an error. */
static int get_string(const struct kv_gguf_file *f, const char *key, char *buf, size_t cap,
                      struct kv_err *err) {
    struct kv_gguf_str v;
    int rc = kv_gguf_get_str(f, key, &v, err);
    if (rc) return rc;
    if (v.len >= cap || memchr(v.p, 0, v.len))
        return kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, key)->val_off,
                       "key '%s' is not a string of at most %zu bytes", key, cap - 1);
    memcpy(buf, v.p, v.len);
    buf[v.len] = 0;
    return KV_OK;
}

static int read_header(const struct kv_gguf_file *f, struct kv_stats *s, struct kv_err *err) {
    const char *path = f->path;
    struct kv_gguf_str ty;
    const struct kv_gguf_kv *kt = kv_gguf_find(f, "general.type");
    if (!kt)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "not a kvcal stats file: no 'general.type' key (a model file?)");
    int rc = kv_gguf_get_str(f, "general.type", &ty, err);
    if (rc) return rc;
    if (ty.len != strlen(KV_STATS_TYPE) || memcmp(ty.p, KV_STATS_TYPE, ty.len))
        return kv_fail(err, KV_EFORMAT, path, kt->val_off,
                       "not a kvcal stats file: general.type is '%.*s', expected '%s'",
                       (int)(ty.len > 64 ? 64 : ty.len), ty.p, KV_STATS_TYPE);
    uint32_t fv;
    if ((rc = kv_gguf_get_u32(f, "kvcal.format_version", &fv, err))) return rc;
    if (fv < 1 || fv > KV_STATS_FORMAT_VERSION)
        return kv_fail(err, KV_EUNSUPPORTED, path, kv_gguf_find(f, "kvcal.format_version")->val_off,
                       "key 'kvcal.format_version': stats format version %u is not supported "
                       "(this kvcal reads versions up to %d)",
                       fv, KV_STATS_FORMAT_VERSION);
    if ((rc = get_string(f, "kvcal.version", s->info.version, sizeof s->info.version, err)) ||
        (rc = get_string(f, "kvcal.model.fingerprint", s->info.fingerprint, sizeof s->info.fingerprint, err)))
        return rc;
    if (!is_hex64(s->info.fingerprint))
        return kv_fail(err, KV_EFORMAT, path, kv_gguf_find(f, "kvcal.model.fingerprint")->val_off,
                       "key 'kvcal.model.fingerprint' is not 64 lowercase hex digits");
    if ((rc = get_bounded(f, "kvcal.model.n_layers", 1, KV_MAX_LAYERS, &s->info.n_layers, err)) ||
        (rc = get_bounded(f, "kvcal.model.dim", 1, KV_MAX_DIM, &s->info.dim, err)) ||
        (rc = get_bounded(f, "kvcal.model.n_heads", 1, KV_MAX_DIM, &s->info.n_heads, err)) ||
        (rc = get_bounded(f, "kvcal.model.n_kv_heads", 1, KV_MAX_DIM, &s->info.n_kv_heads, err)) ||
        (rc = get_bounded(f, "kvcal.model.head_dim", 1, KV_MAX_DIM, &s->info.head_dim, err)) ||
        (rc = get_bounded(f, "kvcal.seq_len", 1, KV_MAX_CTX, &s->info.seq_len, err)) ||
        (rc = get_bounded(f, "kvcal.tokens", 0, INT64_MAX, &s->info.tokens, err)) ||
        (rc = get_bounded(f, "kvcal.sequences", 0, INT64_MAX, &s->info.windows, err)) ||
        (rc = get_string(f, "kvcal.sampling", s->info.sampling, sizeof s->info.sampling, err)) ||
        (rc = kv_gguf_get_u64(f, "kvcal.seed", &s->info.seed, err)) ||
        (rc = get_bounded(f, "kvcal.samples", 0, INT64_MAX, &s->info.samples, err)) ||
        (rc = get_bounded(f, "kvcal.shard.count", 1, INT64_MAX, &s->info.shard_count, err)) ||
        (rc = get_bounded(f, "kvcal.shard.index", 0, (uint64_t)s->info.shard_count - 1, &s->info.shard_index, err)) ||
        (rc = get_bounded(f, "kvcal.plan.windows", 0, INT64_MAX, &s->info.plan_windows, err)) ||
        (rc = get_bounded(f, "kvcal.plan.next_window", 0, (uint64_t)s->info.plan_windows,
                          &s->info.next_window, err)))
        return rc;
    if (s->info.n_heads % s->info.n_kv_heads)
        return kv_fail(err, KV_EFORMAT, path, kv_gguf_find(f, "kvcal.model.n_kv_heads")->val_off,
                       "%lld heads are not a multiple of %lld kv heads", (long long)s->info.n_heads,
                       (long long)s->info.n_kv_heads);
    uint64_t total;
    if (!kv_mul_u64((uint64_t)s->info.windows, (uint64_t)s->info.seq_len, &total) ||
        total != (uint64_t)s->info.tokens)
        return kv_fail(err, KV_EFORMAT, path, kv_gguf_find(f, "kvcal.tokens")->val_off,
                       "kvcal.tokens is %lld but %lld windows of %lld tokens make %llu",
                       (long long)s->info.tokens, (long long)s->info.windows, (long long)s->info.seq_len,
                       (unsigned long long)total);
    if (kv_gguf_find(f, "kvcal.tokenization") &&
        (rc = get_string(f, "kvcal.tokenization", s->info.tokenization,
                         sizeof s->info.tokenization, err)))
        return rc;
    if (strcmp(s->info.sampling, "sequential") && strcmp(s->info.sampling, "random") &&
        strcmp(s->info.sampling, "merged"))
        return kv_fail(err, KV_EFORMAT, path, kv_gguf_find(f, "kvcal.sampling")->val_off,
                       "key 'kvcal.sampling' is '%s', expected sequential, random or merged",
                       s->info.sampling);
    return KV_OK;
}

static int read_inputs(const struct kv_gguf_file *f, struct kv_stats *s, struct kv_err *err) {
    struct kv_gguf_str *names = NULL, *shas = NULL;
    uint64_t *by = NULL, *tk = NULL, *wn = NULL, n[5];
    int rc;
    if ((rc = kv_gguf_get_arr_str(f, "kvcal.datasets", &names, &n[0], err)) ||
        (rc = kv_gguf_get_arr_str(f, "kvcal.datasets.sha256", &shas, &n[1], err)) ||
        (rc = kv_gguf_get_arr_u64(f, "kvcal.datasets.bytes", &by, &n[2], err)) ||
        (rc = kv_gguf_get_arr_u64(f, "kvcal.datasets.tokens", &tk, &n[3], err)) ||
        (rc = kv_gguf_get_arr_u64(f, "kvcal.datasets.windows", &wn, &n[4], err)))
        goto done;
    static const char *const keys[5] = {"kvcal.datasets", "kvcal.datasets.sha256",
                                        "kvcal.datasets.bytes", "kvcal.datasets.tokens",
                                        "kvcal.datasets.windows"};
    for (int k = 1; k < 5; k++)
        if (n[k] != n[0]) {
            rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, keys[k])->val_off,
                         "key '%s' has %llu entries but 'kvcal.datasets' has %llu", keys[k],
                         (unsigned long long)n[k], (unsigned long long)n[0]);
            goto done;
        }
    uint64_t wsum = 0;
    for (uint64_t i = 0; i < n[0]; i++) {
        char path[4096], sha[65];
        uint64_t off = kv_gguf_find(f, "kvcal.datasets.sha256")->val_off;
        if (names[i].len >= sizeof path || memchr(names[i].p, 0, names[i].len)) {
            rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, "kvcal.datasets")->val_off,
                         "dataset %llu: path is not a string of at most %zu bytes",
                         (unsigned long long)i, sizeof path - 1);
            goto done;
        }
        memcpy(path, names[i].p, names[i].len);
        path[names[i].len] = 0;
        if (shas[i].len != 64) {
            rc = kv_fail(err, KV_EFORMAT, f->path, off, "dataset %llu: sha256 is not 64 hex digits",
                         (unsigned long long)i);
            goto done;
        }
        memcpy(sha, shas[i].p, 64);
        sha[64] = 0;
        if (!is_hex64(sha)) {
            rc = kv_fail(err, KV_EFORMAT, f->path, off, "dataset %llu: sha256 is not 64 hex digits",
                         (unsigned long long)i);
            goto done;
        }
        if (tk[i] > INT64_MAX || wn[i] > INT64_MAX) {
            rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, "kvcal.datasets.tokens")->val_off,
                         "dataset %llu: token or window count out of range", (unsigned long long)i);
            goto done;
        }
        if (wn[i] > tk[i] / (uint64_t)s->info.seq_len) {
            rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, "kvcal.datasets.windows")->val_off,
                         "dataset %llu ('%s') counts %llu windows but its %llu tokens hold %llu",
                         (unsigned long long)i, path, (unsigned long long)wn[i],
                         (unsigned long long)tk[i], (unsigned long long)(tk[i] / (uint64_t)s->info.seq_len));
            goto done;
        }
        if (!kv_add_u64(wsum, wn[i], &wsum)) {
            rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, "kvcal.datasets.windows")->val_off,
                         "the datasets' windows overflow a 64-bit count at dataset %llu",
                         (unsigned long long)i);
            goto done;
        }
        if ((rc = kv_stats_add_input(s, path, sha, by[i], (int64_t)tk[i], (int64_t)wn[i], err)))
            goto done;
    }
    if (n[0] && wsum != (uint64_t)s->info.windows)
        rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, "kvcal.datasets.windows")->val_off,
                     "the datasets' windows add up to %llu but kvcal.sequences is %lld",
                     (unsigned long long)wsum, (long long)s->info.windows);
done:
    free(names), free(shas), free(by), free(tk), free(wn);
    return rc;
}

static void shape_text(const int64_t *shape, int nd, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < nd && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* 1 when the file holds any Fisher tensor: then every layer must have all
 * four, and a partial set is reported as the first one missing. */
static int file_has_fisher(const struct kv_gguf_file *f) {
    for (int64_t i = 0; i < f->n_tensors; i++) {
        const char *name = f->tensors[i].t.name;
        size_t n = strlen(name);
        if (strncmp(name, "blk.", 4)) continue;
        for (int t = KV_STATS_PER_LAYER; t < KV_STATS_PER_LAYER + KV_STATS_FISHER_PER_LAYER; t++) {
            size_t k = strlen(tensor_suffix[t]);
            if (n > k && name[n - k - 1] == '.' && !strcmp(name + n - k, tensor_suffix[t])) return 1;
        }
    }
    return 0;
}

static int read_tensors(const struct kv_gguf_file *f, struct kv_stats *s, struct kv_err *err) {
    const char *path = f->path;
    int per = kv_stats_layer_tensors(s);
    int64_t want = s->info.n_layers * per;
    /* why a missing Fisher tensor is an error at all */
    static const char fisher_why[] =
        "; fisher statistics are fisher.k, fisher.v, grad_k.cov and grad_v.cov in every layer";
    uint64_t *crc64 = NULL, ncrc;
    const struct kv_gguf_kv *kc = kv_gguf_find(f, "kvcal.crc32");
    int rc = kv_gguf_get_arr_u64(f, "kvcal.crc32", &crc64, &ncrc, err);
    if (rc) return rc;
    if (ncrc != (uint64_t)f->n_tensors) {
        rc = kv_fail(err, KV_EFORMAT, path, kc->val_off,
                     "key 'kvcal.crc32' has %llu entries but the file has %lld tensors",
                     (unsigned long long)ncrc, (long long)f->n_tensors);
        goto done;
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        const struct kv_gguf_tensor *gt = &f->tensors[i];
        /* every tensor must be one we expect, at its place */
        int64_t l = i / per;
        int t = (int)(i % per);
        char name[64], got[64], exp[64];
        int64_t shape[3];
        if (i >= want) {
            rc = kv_fail(err, KV_EFORMAT, path, gt->info_off,
                         "unexpected tensor '%s': %lld layers have %lld tensors", gt->t.name,
                         (long long)s->info.n_layers, (long long)want);
            goto done;
        }
        int nd = kv_stats_tensor_desc(s, l, t, name, sizeof name, shape);
        if (strcmp(gt->t.name, name)) {
            const struct kv_gguf_tensor *w = kv_gguf_find_tensor(f, name);
            rc = w ? kv_fail(err, KV_EFORMAT, path, gt->info_off,
                             "tensor '%s' is at position %lld, expected '%s' there", gt->t.name,
                             (long long)i, name)
                   : kv_fail(err, KV_EFORMAT, path, gt->info_off,
                             "missing tensor '%s' (found '%s' in its place)%s", name, gt->t.name,
                             t >= KV_STATS_PER_LAYER ? fisher_why : "");
            goto done;
        }
        if (gt->ggml_type != 28) {
            rc = kv_fail(err, KV_EFORMAT, path, gt->type_off, "tensor '%s' has type %s, expected F64",
                         name, kv_ggml_type_name(gt->ggml_type));
            goto done;
        }
        int same = gt->n_dims == nd;
        for (int k = 0; same && k < nd; k++) same = gt->t.shape[k] == shape[k];
        if (!same) {
            shape_text(gt->t.shape, gt->n_dims, got, sizeof got);
            shape_text(shape, nd, exp, sizeof exp);
            rc = kv_fail(err, KV_EFORMAT, path, gt->info_off,
                         "tensor '%s' has shape %s, expected %s", name, got, exp);
            goto done;
        }
        uint64_t nb = (uint64_t)numel(shape, nd) * 8;
        KV_ASSERT(gt->t.nbytes == nb); /* the parser sized it from the same shape */
        if (crc64[i] > UINT32_MAX) {
            rc = kv_fail(err, KV_EFORMAT, path, kc->val_off,
                         "key 'kvcal.crc32': entry %lld is not a 32-bit value", (long long)i);
            goto done;
        }
        uint32_t c = crc_of(gt->t.data, nb);
        if (c != (uint32_t)crc64[i]) {
            rc = kv_fail(err, KV_EFORMAT, path, gt->t.offset,
                         "tensor '%s': crc32 mismatch (stored %08x, computed %08x): the data "
                         "is corrupt", name, (unsigned)crc64[i], (unsigned)c);
            goto done;
        }
        double *dst = kv_stats_tensor_data(s, l, t);
        memcpy(dst, gt->t.data, nb); /* little-endian host and file */
        int neg;
        int64_t k = bad_element(s, t, &(struct sym_view){dst, 0}, numel(shape, nd), &neg);
        if (k >= 0) {
            rc = neg ? kv_fail(err, KV_EFORMAT, path, gt->t.offset + (uint64_t)k * 8,
                               "tensor '%s': negative value %g at element %lld, expected a sum "
                               "of squares >= 0", name, dst[k], (long long)k)
                     : kv_fail(err, KV_EFORMAT, path, gt->t.offset + (uint64_t)k * 8,
                               "tensor '%s': non-finite value at element %lld", name, (long long)k);
            goto done;
        }
    }
    if (f->n_tensors < want) {
        char name[64];
        int64_t shape[3];
        int t = (int)(f->n_tensors % per);
        kv_stats_tensor_desc(s, f->n_tensors / per, t, name, sizeof name, shape);
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "missing tensor '%s': %lld layers need %lld tensors, the file has %lld%s", name,
                     (long long)s->info.n_layers, (long long)want, (long long)f->n_tensors,
                     t >= KV_STATS_PER_LAYER ? fisher_why : "");
    }
done:
    free(crc64);
    return rc;
}

/* Version 2 files carry kvcal.meta_crc32 (version 1 files, from before
 * it, have none): it must match the metadata read. */
static int check_meta_crc(const struct kv_gguf_file *f, const struct kv_stats *s,
                          struct kv_err *err) {
    uint32_t fv = 0, stored;
    int rc = kv_gguf_get_u32(f, "kvcal.format_version", &fv, err);
    if (rc) return rc;
    const struct kv_gguf_kv *k = kv_gguf_find(f, "kvcal.meta_crc32");
    if (!k && fv < 2) return KV_OK;
    if (!k)
        return kv_fail(err, KV_EFORMAT, f->path, KV_NO_OFFSET,
                       "no key 'kvcal.meta_crc32', which format version %u files carry", fv);
    if ((rc = kv_gguf_get_u32(f, "kvcal.meta_crc32", &stored, err))) return rc;
    uint32_t c = meta_crc(s);
    if (c != stored)
        return kv_fail(err, KV_EFORMAT, f->path, k->val_off,
                       "key 'kvcal.meta_crc32': metadata crc32 mismatch (stored %08x, computed "
                       "%08x): a count, the seed, the plan or a dataset record was changed",
                       (unsigned)stored, (unsigned)c);
    return KV_OK;
}

int kv_stats_parse(const void *buf, uint64_t len, const char *path, struct kv_stats **out,
                   struct kv_err *err) {
    struct kv_gguf_file f;
    int rc = kv_gguf_parse(buf, len, path, &f, err);
    if (rc) return rc;
    struct kv_stats *s = calloc(1, sizeof *s);
    if (!s) {
        kv_gguf_release(&f);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    set_defaults(s);
    if (!(rc = read_header(&f, s, err))) {
        int fisher = file_has_fisher(&f);
        /* bound the allocation by what the file can hold before making it */
        uint64_t per, all;
        uint64_t d = (uint64_t)s->info.dim, hd = (uint64_t)s->info.head_dim;
        uint64_t g = (uint64_t)s->info.n_kv_heads;
        int ok = kv_mul_u64(d, d, &per) && kv_add_u64(per, d, &per);
        uint64_t hh, fs;
        ok = ok && kv_mul_u64(hd, hd, &hh) &&
             kv_mul_u64(hh, (uint64_t)(s->info.n_heads + s->info.n_kv_heads), &hh) &&
             kv_add_u64(per, hh, &per);
        /* Fisher: 2 g*d_h rows and 2 g*d_h*d_h covariances */
        ok = ok && kv_mul_u64(hd + 1, hd * g * 2, &fs) && kv_add_u64(per, fisher ? fs : 0, &per);
        ok = ok && kv_mul_u64(per, (uint64_t)s->info.n_layers, &all) && kv_mul_u64(all, 8, &all);
        if (!ok || all > len)
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "truncated or inconsistent: %lld layers of dim %lld need %s bytes of "
                         "tensors, the file has %llu bytes",
                         (long long)s->info.n_layers, (long long)s->info.dim, ok ? "more" : "too many",
                         (unsigned long long)len);
        else if (!(rc = alloc_layers(s, path, err)) && (!fisher || !(rc = alloc_fisher(s, path, err))) &&
                 !(rc = read_inputs(&f, s, err)) && !(rc = check_meta_crc(&f, s, err)))
            rc = read_tensors(&f, s, err);
    }
    kv_gguf_release(&f);
    if (rc) {
        kv_stats_free(s);
        return rc;
    }
    *out = s;
    return KV_OK;
}

int kv_stats_probe(const char *path) {
    char buf[4096];
    ssize_t n = kv_read_head(path, buf, sizeof buf);
    return n >= 4 && !memcmp(buf, "GGUF", 4) &&
           memmem(buf, (size_t)n, KV_STATS_TYPE, strlen(KV_STATS_TYPE)) != NULL;
}

int kv_stats_open(const char *path, struct kv_stats **out, struct kv_err *err) {
    struct kv_map m;
    int rc = kv_map_open(path, &m, err);
    if (rc) return rc;
    rc = kv_stats_parse(m.data, m.len, path, out, err);
    kv_map_close(&m);
    return rc;
}

int kv_stats_matches_model(const struct kv_stats *s, const struct kv_model *m, const char *path,
                           struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    if (!kv_shapes_match(c, s->info.n_layers, s->info.dim, s->info.n_heads, s->info.n_kv_heads, s->info.head_dim,
                         "statistics", path, err))
        return 0;
    char fp[65];
    if (kv_model_fingerprint(m, fp, err)) return 0;
    if (strcmp(fp, s->info.fingerprint)) {
        kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                "statistics were collected on another model (fingerprint %.12s, this model "
                "is %.12s)", s->info.fingerprint, fp);
        return 0;
    }
    return 1;
}
