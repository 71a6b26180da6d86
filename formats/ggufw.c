/* GGUF v3 writer. Layout in gguf.h; behaviour in ggufw.h.
 *
 * Everything the reader (gguf.c) would refuse is refused here when it is
 * added, so a file this writes always parses: non-empty keys and names within
 * the limits of limits.h, unique keys and names, 1..4 positive dims, and a
 * general.alignment (if given at all) equal to the alignment used. The file
 * ends at the aligned end of the last tensor (as ggml writes it), so a reader
 * that loads the data section as one padded blob finds all of it. */
#include "ggufw.h"
#include "mapfile.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "model.h"
#include "gguf.h"
#include "limits.h"

#define GGUFW_ALIGNMENT 32u
#define GGUFW_VERSION 3u
#define GGUFW_STAGE (1u << 20)  /* staging buffer for the header */
#define GGUFW_CHUNK (1u << 30)  /* largest single write(2) */

struct wkv {
    char *key;
    enum kv_gguf_type type;
    uint64_t u;                /* scalars: the value's bits (f64 as IEEE bits) */
    char *str;                 /* STRING: copy */
    uint64_t slen;
    enum kv_gguf_type arr_type; /* ARRAY: U32, U64 or STRING */
    uint64_t arr_n;
    void *arr;                 /* uint32_t[], uint64_t[] or char *[] (copies) */
};

struct wtensor {
    char *name;
    uint32_t ggml_type;
    uint32_t n_dims;
    uint64_t ne[4];            /* innermost first, as stored */
    const void *data;          /* borrowed, or NULL with gen */
    kv_ggufw_gen_fn gen;       /* fills the data piece by piece instead */
    void *gen_ctx;
    uint64_t nbytes;
    uint64_t rel;              /* offset in the data section */
};

/* Open-addressing set of borrowed C strings (the entries' own copies). */
struct strset {
    const char **slot;
    uint64_t cap, n;
};

struct kv_ggufw {
    struct wkv *kv;
    int64_t n_kv, cap_kv;
    struct wtensor *t;
    int64_t n_t, cap_t;
    uint64_t data_end;         /* unaligned end of the last tensor's data */
    struct strset keys, names;
};

/* ------------------------------------------------------------ string set */

static uint64_t hash_str(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (; *s; s++) {
        h ^= (uint8_t)*s;
        h *= 0x100000001b3ull;
    }
    return h;
}

static uint64_t set_probe(const struct strset *s, const char *k) {
    uint64_t i = hash_str(k) & (s->cap - 1);
    while (s->slot[i] && strcmp(s->slot[i], k) != 0) i = (i + 1) & (s->cap - 1);
    return i;
}

static int set_has(const struct strset *s, const char *k) {
    return s->cap && s->slot[set_probe(s, k)] != NULL;
}

/* Insert k (not present); 0 when out of memory. */
static int set_add(struct strset *s, const char *k) {
    if ((s->n + 1) * 2 > s->cap) {
        struct strset g = {NULL, s->cap ? s->cap * 2 : 64, s->n};
        g.slot = calloc(g.cap, sizeof *g.slot);
        if (!g.slot) return 0;
        for (uint64_t i = 0; i < s->cap; i++)
            if (s->slot[i]) g.slot[set_probe(&g, s->slot[i])] = s->slot[i];
        free(s->slot);
        *s = g;
    }
    s->slot[set_probe(s, k)] = k;
    s->n++;
    return 1;
}

/* ------------------------------------------------------------ lifecycle */

int kv_ggufw_init(struct kv_ggufw **out, struct kv_err *err) {
    struct kv_ggufw *w = calloc(1, sizeof *w);
    if (!w) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    *out = w;
    return KV_OK;
}

static void free_kv(struct wkv *kv) {
    free(kv->key);
    free(kv->str);
    if (kv->type == KV_GGUF_ARRAY && kv->arr_type == KV_GGUF_STRING && kv->arr)
        for (uint64_t i = 0; i < kv->arr_n; i++) free(((char **)kv->arr)[i]);
    free(kv->arr);
}

void kv_ggufw_free(struct kv_ggufw *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->n_kv; i++) free_kv(&w->kv[i]);
    for (int64_t i = 0; i < w->n_t; i++) free(w->t[i].name);
    free(w->kv);
    free(w->t);
    free(w->keys.slot);
    free(w->names.slot);
    free(w);
}

/* ------------------------------------------------------------ metadata */

static int check_key(const struct kv_ggufw *w, const char *key, struct kv_err *err) {
    KV_ASSERT(w && key);
    size_t n = strlen(key);
    if (n == 0) return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "empty metadata key");
    if (n > KV_MAX_STRING)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "key '%.64s...' is %zu bytes, limit %u", key, n, KV_MAX_STRING);
    if (set_has(&w->keys, key))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "duplicate key '%s'", key);
    if (w->n_kv >= KV_MAX_KV_PAIRS)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "key '%s' would be metadata pair %lld, limit %d", key,
                       (long long)w->n_kv + 1, KV_MAX_KV_PAIRS);
    return KV_OK;
}

/* Take ownership of kv's value (freed on failure), copy the key, append. */
static int add_kv(struct kv_ggufw *w, const char *key, struct wkv *kv, struct kv_err *err) {
    int rc = check_key(w, key, err);
    /* the reader aligns by this key; the writer always uses GGUFW_ALIGNMENT */
    if (!rc && !strcmp(key, "general.alignment")) {
        if (kv->type != KV_GGUF_U32)
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                         "key 'general.alignment' has type %s, expected uint32 %u",
                         kv->type == KV_GGUF_ARRAY ? "array" : kv_gguf_type_name(kv->type),
                         GGUFW_ALIGNMENT);
        else if (kv->u != GGUFW_ALIGNMENT)
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                         "key 'general.alignment' is %llu, expected %u (the writer's alignment)",
                         (unsigned long long)kv->u, GGUFW_ALIGNMENT);
    }
    if (!rc && w->n_kv == w->cap_kv) {
        int64_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        struct wkv *p = realloc(w->kv, (size_t)cap * sizeof *p);
        if (p) {
            w->kv = p;
            w->cap_kv = cap;
        } else {
            rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        }
    }
    if (!rc && !(kv->key = strdup(key)))
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    if (!rc && !set_add(&w->keys, kv->key))
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    if (rc) {
        free_kv(kv);
        return rc;
    }
    w->kv[w->n_kv++] = *kv;
    return KV_OK;
}

static int add_scalar(struct kv_ggufw *w, const char *key, enum kv_gguf_type t, uint64_t bits,
                      struct kv_err *err) {
    struct wkv kv = {.type = t, .u = bits};
    return add_kv(w, key, &kv, err);
}

int kv_ggufw_add_u32(struct kv_ggufw *w, const char *key, uint32_t val, struct kv_err *err) {
    return add_scalar(w, key, KV_GGUF_U32, val, err);
}

int kv_ggufw_add_u64(struct kv_ggufw *w, const char *key, uint64_t val, struct kv_err *err) {
    return add_scalar(w, key, KV_GGUF_U64, val, err);
}

int kv_ggufw_add_i64(struct kv_ggufw *w, const char *key, int64_t val, struct kv_err *err) {
    return add_scalar(w, key, KV_GGUF_I64, (uint64_t)val, err);
}

int kv_ggufw_add_f64(struct kv_ggufw *w, const char *key, double val, struct kv_err *err) {
    uint64_t bits;
    memcpy(&bits, &val, sizeof bits);
    return add_scalar(w, key, KV_GGUF_F64, bits, err);
}

int kv_ggufw_add_bool(struct kv_ggufw *w, const char *key, int val, struct kv_err *err) {
    return add_scalar(w, key, KV_GGUF_BOOL, val != 0, err);
}

/* Length of a string value, or KV_EINVAL when the reader would refuse it. */
static int str_len(const char *key, const char *s, uint64_t idx, int is_elem, uint64_t *len,
                   struct kv_err *err) {
    KV_ASSERT(s);
    size_t n = strlen(s);
    if (n > KV_MAX_STRING) {
        if (is_elem)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "element %llu of key '%s' is %zu bytes, limit %u",
                           (unsigned long long)idx, key, n, KV_MAX_STRING);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "value of key '%s' is %zu bytes, limit %u", key, n, KV_MAX_STRING);
    }
    *len = n;
    return KV_OK;
}

int kv_ggufw_add_str(struct kv_ggufw *w, const char *key, const char *val, struct kv_err *err) {
    int rc = check_key(w, key, err);
    if (rc) return rc;
    struct wkv kv = {.type = KV_GGUF_STRING};
    if ((rc = str_len(key, val, 0, 0, &kv.slen, err))) return rc;
    if (!(kv.str = strdup(val)))
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    return add_kv(w, key, &kv, err);
}

static int check_arr(const char *key, const void *vals, uint64_t n, struct kv_err *err) {
    KV_ASSERT(vals || n == 0);
    if (n > KV_MAX_ARRAY)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "key '%s' has %llu array elements, limit %u", key, (unsigned long long)n,
                       KV_MAX_ARRAY);
    return KV_OK;
}

/* Array of n fixed-size elements, copied. */
static int add_arr_fixed(struct kv_ggufw *w, const char *key, enum kv_gguf_type et,
                         const void *vals, uint64_t n, size_t size, struct kv_err *err) {
    int rc = check_key(w, key, err);
    if (rc || (rc = check_arr(key, vals, n, err))) return rc;
    struct wkv kv = {.type = KV_GGUF_ARRAY, .arr_type = et, .arr_n = n};
    kv.arr = malloc(n ? (size_t)n * size : 1);
    if (!kv.arr) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    if (n) memcpy(kv.arr, vals, (size_t)n * size);
    return add_kv(w, key, &kv, err);
}

int kv_ggufw_add_arr_u32(struct kv_ggufw *w, const char *key, const uint32_t *vals, uint64_t n,
                         struct kv_err *err) {
    return add_arr_fixed(w, key, KV_GGUF_U32, vals, n, sizeof *vals, err);
}

int kv_ggufw_add_arr_u64(struct kv_ggufw *w, const char *key, const uint64_t *vals, uint64_t n,
                         struct kv_err *err) {
    return add_arr_fixed(w, key, KV_GGUF_U64, vals, n, sizeof *vals, err);
}

int kv_ggufw_add_arr_str(struct kv_ggufw *w, const char *key, const char *const *vals, uint64_t n,
                         struct kv_err *err) {
    int rc = check_key(w, key, err);
    if (rc || (rc = check_arr(key, vals, n, err))) return rc;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t len;
        if ((rc = str_len(key, vals[i], i, 1, &len, err))) return rc;
    }
    struct wkv kv = {.type = KV_GGUF_ARRAY, .arr_type = KV_GGUF_STRING, .arr_n = 0};
    char **a = calloc(n ? (size_t)n : 1, sizeof *a);
    kv.arr = a;
    if (!a) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (uint64_t i = 0; i < n; i++, kv.arr_n++)
        if (!(a[i] = strdup(vals[i]))) {
            free_kv(&kv);
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        }
    return add_kv(w, key, &kv, err);
}

/* ------------------------------------------------------------ tensors */

/* Bytes per element of the non-quantized ggml types; 0 for the rest. */
static uint64_t elem_size(uint32_t t) {
    switch (t) {
    case 0: return 4;  /* F32 */
    case 1: return 2;  /* F16 */
    case 24: return 1; /* I8 */
    case 25: return 2; /* I16 */
    case 26: return 4; /* I32 */
    case 27: return 8; /* I64 */
    case 28: return 8; /* F64 */
    case 30: return 2; /* BF16 */
    default: return 0;
    }
}

static int add_tensor(struct kv_ggufw *w, const char *name, uint32_t ggml_type, int ndim,
                      const int64_t *shape, const void *data, kv_ggufw_gen_fn gen, void *gen_ctx,
                      uint64_t nbytes, struct kv_err *err) {
    KV_ASSERT(w && name && shape && (data || gen));
    size_t nlen = strlen(name);
    if (nlen == 0) return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "empty tensor name");
    if (nlen > KV_MAX_NAME_LEN)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor name '%.64s...' is %zu bytes, limit %d", name, nlen,
                       KV_MAX_NAME_LEN);
    if (set_has(&w->names, name))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "duplicate tensor name '%s'", name);
    if (w->n_t >= KV_MAX_TENSORS)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' would be tensor %lld, limit %d", name, (long long)w->n_t + 1,
                       KV_MAX_TENSORS);
    if (ndim < 1 || ndim > KV_MAX_DIMS)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' has %d dimensions, expected 1 to %d", name, ndim, KV_MAX_DIMS);
    char sb[128];
    kv_shape_str(sb, sizeof sb, shape, (int)ndim);
    uint64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 1)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "tensor '%s' has shape %s, expected positive dimensions", name, sb);
        if (!kv_mul_u64(numel, (uint64_t)shape[i], &numel) || numel > (uint64_t)INT64_MAX)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "tensor '%s' element count overflows for shape %s", name, sb);
    }
    uint64_t esz = elem_size(ggml_type), need;
    if (!esz)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "unsupported ggml type %u (%s) for tensor '%s', expected F32, F16, BF16, "
                       "F64 or an integer type",
                       ggml_type, kv_ggml_type_name(ggml_type), name);
    if (!kv_mul_u64(numel, esz, &need))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' byte size overflows for shape %s %s", name, sb,
                       kv_ggml_type_name(ggml_type));
    if (nbytes != need)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s': data is %llu bytes but shape %s %s needs %llu", name,
                       (unsigned long long)nbytes, sb, kv_ggml_type_name(ggml_type),
                       (unsigned long long)need);
    uint64_t rel = 0, end;
    if (w->n_t && !kv_add_u64(w->data_end, GGUFW_ALIGNMENT - 1, &rel))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' would start past the largest file offset", name);
    rel &= ~(uint64_t)(GGUFW_ALIGNMENT - 1);
    /* the file also holds the header and the final padding: keep headroom */
    if (!kv_add_u64(rel, nbytes, &end) || end > (UINT64_MAX >> 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' would end past the largest file offset", name);

    if (w->n_t == w->cap_t) {
        int64_t cap = w->cap_t ? w->cap_t * 2 : 16;
        struct wtensor *p = realloc(w->t, (size_t)cap * sizeof *p);
        if (!p) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        w->t = p;
        w->cap_t = cap;
    }
    struct wtensor t = {.ggml_type = ggml_type, .n_dims = (uint32_t)ndim, .data = data,
                        .gen = gen, .gen_ctx = gen_ctx, .nbytes = nbytes, .rel = rel};
    for (int i = 0; i < ndim; i++) t.ne[i] = (uint64_t)shape[ndim - 1 - i];
    if (!(t.name = strdup(name)) || !set_add(&w->names, t.name)) {
        free(t.name);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    w->t[w->n_t++] = t;
    w->data_end = end;
    return KV_OK;
}

int kv_ggufw_add_tensor(struct kv_ggufw *w, const char *name, uint32_t ggml_type, int ndim,
                        const int64_t *shape, const void *data, uint64_t nbytes,
                        struct kv_err *err) {
    KV_ASSERT(data);
    return add_tensor(w, name, ggml_type, ndim, shape, data, NULL, NULL, nbytes, err);
}

int kv_ggufw_add_tensor_gen(struct kv_ggufw *w, const char *name, uint32_t ggml_type, int ndim,
                            const int64_t *shape, uint64_t nbytes, kv_ggufw_gen_fn gen, void *ctx,
                            struct kv_err *err) {
    KV_ASSERT(gen);
    return add_tensor(w, name, ggml_type, ndim, shape, NULL, gen, ctx, nbytes, err);
}

/* ------------------------------------------------------------ output */

/* Buffered file output with a sticky error: after the first failure every
 * call is a no-op and e/op say what failed. */
struct out {
    int fd;
    uint8_t *buf;
    size_t len, cap;
    uint64_t pos;     /* bytes written so far, buffered included */
    int e;            /* errno of the first failure, 0 if none */
    const char *op;   /* what failed */
};

static void write_all(struct out *o, const uint8_t *p, uint64_t n) {
    while (n && !o->e) {
        size_t chunk = n > GGUFW_CHUNK ? GGUFW_CHUNK : (size_t)n;
        ssize_t r = write(o->fd, p, chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            o->e = r < 0 ? errno : EIO; /* 0 bytes for a regular file: treat as an i/o error */
            o->op = "cannot write";
            return;
        }
        p += r;
        n -= (uint64_t)r;
    }
}

static void flush(struct out *o) {
    write_all(o, o->buf, o->len);
    o->len = 0;
}

static void put(struct out *o, const void *p, uint64_t n) {
    const uint8_t *b = p;
    if (o->e) return;
    o->pos += n;
    if (n >= o->cap) { /* large: straight from the caller's memory */
        flush(o);
        write_all(o, b, n);
        return;
    }
    while (n) {
        size_t k = o->cap - o->len < n ? o->cap - o->len : (size_t)n;
        memcpy(o->buf + o->len, b, k);
        o->len += k;
        b += k;
        n -= k;
        if (o->len == o->cap) flush(o);
    }
}

static void put_u8(struct out *o, uint8_t v) { put(o, &v, 1); }

static void put_u32(struct out *o, uint32_t v) {
    uint8_t b[4];
    for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i));
    put(o, b, 4);
}

static void put_u64(struct out *o, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
    put(o, b, 8);
}

static void put_str(struct out *o, const char *s, uint64_t n) {
    put_u64(o, n);
    put(o, s, n);
}

/* Zero bytes up to the next multiple of the alignment. */
static void put_pad(struct out *o) {
    static const uint8_t zeros[GGUFW_ALIGNMENT];
    put(o, zeros, (GGUFW_ALIGNMENT - o->pos % GGUFW_ALIGNMENT) % GGUFW_ALIGNMENT);
}

static void put_kv(struct out *o, const struct wkv *kv) {
    put_str(o, kv->key, strlen(kv->key));
    put_u32(o, (uint32_t)kv->type);
    switch (kv->type) {
    case KV_GGUF_U32: put_u32(o, (uint32_t)kv->u); break;
    case KV_GGUF_BOOL: put_u8(o, (uint8_t)kv->u); break;
    case KV_GGUF_U64:
    case KV_GGUF_I64:
    case KV_GGUF_F64: put_u64(o, kv->u); break;
    case KV_GGUF_STRING: put_str(o, kv->str, kv->slen); break;
    case KV_GGUF_ARRAY:
        put_u32(o, (uint32_t)kv->arr_type);
        put_u64(o, kv->arr_n);
        for (uint64_t i = 0; i < kv->arr_n; i++) {
            if (kv->arr_type == KV_GGUF_U32)
                put_u32(o, ((const uint32_t *)kv->arr)[i]);
            else if (kv->arr_type == KV_GGUF_U64)
                put_u64(o, ((const uint64_t *)kv->arr)[i]);
            else {
                const char *s = ((char *const *)kv->arr)[i];
                put_str(o, s, strlen(s));
            }
        }
        break;
    default: KV_ASSERT(0);
    }
}

static void put_file(struct out *o, const struct kv_ggufw *w) {
    put(o, "GGUF", 4);
    put_u32(o, GGUFW_VERSION);
    put_u64(o, (uint64_t)w->n_t);
    put_u64(o, (uint64_t)w->n_kv);
    for (int64_t i = 0; i < w->n_kv; i++) put_kv(o, &w->kv[i]);
    for (int64_t i = 0; i < w->n_t; i++) {
        const struct wtensor *t = &w->t[i];
        put_str(o, t->name, strlen(t->name));
        put_u32(o, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) put_u64(o, t->ne[d]);
        put_u32(o, t->ggml_type);
        put_u64(o, t->rel);
    }
    put_pad(o);
    uint64_t data_off = o->pos;
    for (int64_t i = 0; i < w->n_t && !o->e; i++) {
        const struct wtensor *t = &w->t[i];
        KV_ASSERT(o->pos == data_off + t->rel);
        if (t->data) {
            put(o, t->data, t->nbytes);
        } else { /* generated into the staging buffer, a piece at a time */
            for (uint64_t at = 0; at < t->nbytes && !o->e;) {
                if (o->len == o->cap) flush(o);
                uint64_t k = t->nbytes - at < o->cap - o->len ? t->nbytes - at : o->cap - o->len;
                t->gen(t->gen_ctx, at, o->buf + o->len, k);
                o->len += k, o->pos += k, at += k;
            }
        }
        put_pad(o);
    }
    flush(o);
}

/* kv_write_atomic's fill: the whole file through a staging buffer. */
static int fill_file(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    char eb[128];
    struct out o = {.fd = fd, .cap = GGUFW_STAGE};
    if (!(o.buf = malloc(o.cap)))
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    put_file(&o, ctx);
    free(o.buf);
    if (o.e)
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "%s '%s': %s", o.op, tmp,
                       kv_errtext(o.e, eb, sizeof eb));
    return KV_OK;
}

int kv_ggufw_write(struct kv_ggufw *w, const char *path, struct kv_err *err) {
    KV_ASSERT(w && path);
    return kv_write_atomic(path, fill_file, w, err);
}
