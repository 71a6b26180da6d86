/* safetensors writer. Layout in safetensors.h; behaviour in stwrite.h.
 *
 * Tensors are kept in a table in insertion order; their data offsets are
 * fixed when they are added (each begins where the previous ends), so the
 * header can be built with jansson at write time and the data streamed
 * behind it in the same order. A jansson object doubles as the set of names
 * (hashed lookups, however many tensors). */
#include "stwrite.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "limits.h"
#include "mapfile.h"
#include "model.h"

#define STW_ALIGN 8u           /* the header is padded so the data starts here */
#define STW_STAGE (1u << 20)   /* staging buffer for small tensors and copies */
#define STW_CHUNK (1u << 30)   /* largest single write(2) */
/* keeps every data offset, and the file size, within int64 (JSON integers,
 * off_t) whatever the header length */
#define STW_MAX_DATA ((uint64_t)INT64_MAX - 8 - KV_MAX_ST_HEADER - STW_ALIGN)

struct stw_tensor {
    char *name;
    enum kv_dtype dtype;
    int ndim;
    int64_t shape[KV_MAX_DIMS];
    const void *data;     /* borrowed, or == owned */
    uint64_t nbytes;
    uint64_t begin;       /* offset in the data section */
    void *owned;          /* converted copy from kv_stw_add_f32, the fill context of
                           * kv_stw_add_fn_copy, or NULL */
    kv_stw_fill_fn fill;  /* kv_stw_add_fn: bytes produced as they are written */
    void *fill_ctx;
};

struct kv_stw {
    struct stw_tensor *t;
    int64_t n_t, cap_t;
    uint64_t data_end;    /* end of the last tensor's data */
    json_t *names;        /* set of tensor names (values are null) */
    json_t *meta;         /* __metadata__: string values, insertion order */
};

int kv_stw_init(struct kv_stw **out, struct kv_err *err) {
    KV_ASSERT(out);
    *out = NULL;
    struct kv_stw *w = calloc(1, sizeof *w);
    if (w) {
        w->names = json_object();
        w->meta = json_object();
    }
    if (!w || !w->names || !w->meta) {
        kv_stw_free(w);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    *out = w;
    return KV_OK;
}

void kv_stw_free(struct kv_stw *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->n_t; i++) {
        free(w->t[i].name);
        free(w->t[i].owned);
    }
    free(w->t);
    json_decref(w->names);
    json_decref(w->meta);
    free(w);
}

/* ------------------------------------------------------------ checks */

/* 1 if s is well-formed UTF-8 (no overlong forms, surrogates or code points
 * above U+10FFFF), as jansson requires of every string. */
static int utf8_ok(const char *s) {
    const uint8_t *p = (const uint8_t *)s;
    while (*p) {
        uint32_t c = *p, cp;
        int n;
        if (c < 0x80) {
            p++;
            continue;
        }
        if (c >= 0xc2 && c <= 0xdf) n = 1, cp = c & 0x1f;
        else if (c >= 0xe0 && c <= 0xef) n = 2, cp = c & 0x0f;
        else if (c >= 0xf0 && c <= 0xf4) n = 3, cp = c & 0x07;
        else return 0;
        for (int i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80) return 0; /* also stops at the NUL */
            cp = cp << 6 | (p[i] & 0x3fu);
        }
        if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10ffff ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        p += n + 1;
    }
    return 1;
}

/* Everything about a new tensor but its data; *need is its byte size. */
static int check_tensor(const struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                        const int64_t *shape, uint64_t *need, struct kv_err *err) {
    size_t nlen = strlen(name);
    if (nlen == 0) return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "empty tensor name");
    if (nlen > KV_MAX_NAME_LEN)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor name '%.64s...' is %zu bytes, limit %d", name, nlen,
                       KV_MAX_NAME_LEN);
    if (!utf8_ok(name))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor name '%s' is not valid utf-8", name);
    if (strcmp(name, "__metadata__") == 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor name '%s' is reserved for the metadata", name);
    if (json_object_get(w->names, name))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "duplicate tensor name '%s'", name);
    if (w->n_t >= KV_MAX_TENSORS)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' would be tensor %lld, limit %d", name, (long long)w->n_t + 1,
                       KV_MAX_TENSORS);
    if ((unsigned)dtype >= KV_DTYPE_COUNT)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "tensor '%s' has unknown dtype %d",
                       name, (int)dtype);
    if (ndim < 0 || ndim > KV_MAX_DIMS)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' has %d dimensions, expected 0 to %d", name, ndim, KV_MAX_DIMS);
    KV_ASSERT(shape || ndim == 0);
    char sb[128];
    kv_shape_str(sb, sizeof sb, shape, (int)ndim);
    uint64_t n = kv_dtype_size(dtype);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "tensor '%s' has shape %s, expected non-negative dimensions", name, sb);
        if (!kv_mul_u64(n, (uint64_t)shape[i], &n))
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "tensor '%s' byte size overflows for shape %s %s", name, sb,
                           kv_dtype_name(dtype));
    }
    uint64_t end;
    if (!kv_add_u64(w->data_end, n, &end) || end > STW_MAX_DATA)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s' would end past the largest file offset", name);
    *need = n;
    return KV_OK;
}

/* Append a checked tensor; owned (may be NULL) passes to the writer only on
 * success. */
static int append(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                  const int64_t *shape, const void *data, uint64_t nbytes, void *owned,
                  struct kv_err *err) {
    if (w->n_t == w->cap_t) {
        int64_t cap = w->cap_t ? w->cap_t * 2 : 16;
        struct stw_tensor *p = realloc(w->t, (size_t)cap * sizeof *p);
        if (!p) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        w->t = p;
        w->cap_t = cap;
    }
    struct stw_tensor t = {.dtype = dtype, .ndim = ndim, .data = data, .nbytes = nbytes,
                           .begin = w->data_end, .owned = owned};
    for (int i = 0; i < ndim; i++) t.shape[i] = shape[i];
    if (!(t.name = strdup(name)) || json_object_set_new(w->names, name, json_null()) != 0) {
        free(t.name);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    w->t[w->n_t++] = t;
    w->data_end += nbytes;
    return KV_OK;
}

/* ------------------------------------------------------------ adding */

int kv_stw_add_meta(struct kv_stw *w, const char *key, const char *val, struct kv_err *err) {
    KV_ASSERT(w && key && val);
    if (!utf8_ok(key))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "metadata key '%s' is not valid utf-8",
                       key);
    if (!utf8_ok(val))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "value of metadata key '%s' is not valid utf-8", key);
    if (json_object_get(w->meta, key))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "duplicate metadata key '%s'", key);
    if (json_object_size(w->meta) >= KV_MAX_KV_PAIRS)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "metadata key '%s' would be pair %zu, limit %d", key,
                       json_object_size(w->meta) + 1, KV_MAX_KV_PAIRS);
    if (json_object_set_new(w->meta, key, json_string(val)) != 0)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    return KV_OK;
}

int kv_stw_add(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
               const int64_t *shape, const void *data, uint64_t nbytes, struct kv_err *err) {
    KV_ASSERT(w && name);
    uint64_t need;
    int rc = check_tensor(w, name, dtype, ndim, shape, &need, err);
    if (rc) return rc;
    if (nbytes != need) {
        char sb[128];
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s': data is %llu bytes but shape %s %s needs %llu", name,
                       (unsigned long long)nbytes, kv_shape_str(sb, sizeof sb, shape, (int)ndim),
                       kv_dtype_name(dtype), (unsigned long long)need);
    }
    KV_ASSERT(data || nbytes == 0);
    return append(w, name, dtype, ndim, shape, data, nbytes, NULL, err);
}

int kv_stw_add_fn(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                  const int64_t *shape, kv_stw_fill_fn fill, void *ctx, struct kv_err *err) {
    KV_ASSERT(w && name && fill);
    uint64_t need;
    int rc = check_tensor(w, name, dtype, ndim, shape, &need, err);
    if (!rc) rc = append(w, name, dtype, ndim, shape, NULL, need, NULL, err);
    if (!rc) w->t[w->n_t - 1].fill = fill, w->t[w->n_t - 1].fill_ctx = ctx;
    return rc;
}

int kv_stw_add_fn_copy(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                       const int64_t *shape, kv_stw_fill_fn fill, const void *ctx,
                       size_t ctx_size, struct kv_err *err) {
    KV_ASSERT(ctx && ctx_size);
    void *copy = malloc(ctx_size);
    if (!copy) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for '%s'", name);
    memcpy(copy, ctx, ctx_size);
    int rc = kv_stw_add_fn(w, name, dtype, ndim, shape, fill, copy, err);
    if (rc) free(copy);
    else w->t[w->n_t - 1].owned = copy; /* freed with the writer */
    return rc;
}

int kv_stw_add_f32(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                   const int64_t *shape, const float *data, struct kv_err *err) {
    KV_ASSERT(w && name);
    if (dtype != KV_DTYPE_F32 && dtype != KV_DTYPE_F16 && dtype != KV_DTYPE_BF16)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "tensor '%s': cannot convert f32 to %s, expected F32, F16 or BF16", name,
                       kv_dtype_name(dtype));
    uint64_t need;
    int rc = check_tensor(w, name, dtype, ndim, shape, &need, err);
    if (rc) return rc;
    if (need > SIZE_MAX)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "tensor '%s' needs %llu bytes, more than memory can hold", name,
                       (unsigned long long)need);
    int64_t numel = (int64_t)(need / kv_dtype_size(dtype));
    KV_ASSERT(data || numel == 0);
    void *buf = malloc(need ? (size_t)need : 1);
    if (!buf)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory for %llu bytes of tensor '%s'", (unsigned long long)need,
                       name);
    if (numel) kv_convert_from_f32(dtype, data, buf, numel);
    rc = append(w, name, dtype, ndim, shape, buf, need, buf, err);
    if (rc) free(buf);
    return rc;
}

/* ------------------------------------------------------------ output */

/* write(2) all of p, in chunks, retrying on EINTR; 0 or the errno. */
static int write_all(int fd, const void *p, uint64_t n) {
    const uint8_t *b = p;
    while (n) {
        size_t chunk = n > STW_CHUNK ? STW_CHUNK : (size_t)n;
        ssize_t r = write(fd, b, chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO; /* 0 bytes for a regular file: an i/o error */
        b += r;
        n -= (uint64_t)r;
    }
    return 0;
}

/* Staged output with a sticky errno. */
struct sink {
    int fd;
    uint8_t *buf;
    size_t len, cap;
    int e;
};

static void sink_flush(struct sink *s) {
    if (!s->e) s->e = write_all(s->fd, s->buf, s->len);
    s->len = 0;
}

static void sink_put(struct sink *s, const void *p, uint64_t n) {
    if (s->e || n == 0) return;
    if (n > s->cap - s->len) sink_flush(s);
    if (n >= s->cap) { /* large: straight from the caller's memory */
        if (!s->e) s->e = write_all(s->fd, p, n);
        return;
    }
    memcpy(s->buf + s->len, p, (size_t)n);
    s->len += (size_t)n;
}

/* The header JSON: __metadata__ (if any) then the tensors, both in insertion
 * order. NULL when out of memory. */
static json_t *build_header(const struct kv_stw *w) {
    json_t *root = json_object();
    if (!root) return NULL;
    if (json_object_size(w->meta) && json_object_set(root, "__metadata__", w->meta) != 0)
        goto fail;
    for (int64_t i = 0; i < w->n_t; i++) {
        const struct stw_tensor *t = &w->t[i];
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        int bad = !e || !shape || !offs;
        for (int d = 0; d < t->ndim && !bad; d++)
            bad = json_array_append_new(shape, json_integer((json_int_t)t->shape[d])) != 0;
        bad = bad || json_array_append_new(offs, json_integer((json_int_t)t->begin)) != 0 ||
              json_array_append_new(offs, json_integer((json_int_t)(t->begin + t->nbytes))) != 0;
        bad = bad || json_object_set_new(e, "dtype", json_string(kv_dtype_name(t->dtype))) != 0 ||
              json_object_set(e, "shape", shape) != 0 ||
              json_object_set(e, "data_offsets", offs) != 0;
        json_decref(shape);
        json_decref(offs);
        if (bad || json_object_set_new(root, t->name, e) != 0) {
            if (bad) json_decref(e); /* set_new releases e itself when it fails */
            goto fail;
        }
    }
    return root;
fail:
    json_decref(root);
    return NULL;
}

struct stw_out {
    const struct kv_stw *w;
    const uint8_t *head; /* length field, JSON and padding */
    size_t head_len;
};

/* kv_write_atomic's fill: header, then every tensor's bytes in order. */
static int fill_st(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    const struct stw_out *o = ctx;
    char eb[128];
    struct sink s = {.fd = fd, .cap = STW_STAGE};
    if (!(s.buf = calloc(1, s.cap)))
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    sink_put(&s, o->head, o->head_len);
    uint8_t *chunk = NULL;
    int frc = KV_OK;
    for (int64_t i = 0; i < o->w->n_t && !frc; i++) {
        const struct stw_tensor *t = &o->w->t[i];
        if (!t->fill) {
            sink_put(&s, t->data, t->nbytes);
            continue;
        }
        if (!chunk && !(chunk = malloc(STW_STAGE))) {
            frc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
            break;
        }
        for (uint64_t off = 0; off < t->nbytes && !frc; off += STW_STAGE) {
            uint64_t n = t->nbytes - off < STW_STAGE ? t->nbytes - off : STW_STAGE;
            if ((frc = t->fill(t->fill_ctx, off, n, chunk, err))) break;
            sink_put(&s, chunk, n);
        }
    }
    free(chunk);
    if (frc) {
        free(s.buf);
        return frc;
    }
    sink_flush(&s);
    free(s.buf);
    if (s.e)
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                       kv_errtext(s.e, eb, sizeof eb));
    return KV_OK;
}

int kv_stw_write(struct kv_stw *w, const char *path, struct kv_err *err) {
    KV_ASSERT(w && path);
    json_t *root = build_header(w);
    char *text = root ? json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(root);
    if (!text) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory for the header");
    size_t tlen = strlen(text);
    size_t n = (tlen + STW_ALIGN - 1) / STW_ALIGN * STW_ALIGN;
    if (n > KV_MAX_ST_HEADER) {
        free(text);
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "header of %lld tensors is %zu bytes, limit %u", (long long)w->n_t, n,
                       KV_MAX_ST_HEADER);
    }
    uint8_t *head = malloc(8 + n);
    if (!head) {
        free(text);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory for the header");
    }
    for (int i = 0; i < 8; i++) head[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(head + 8, text, tlen);
    memset(head + 8 + tlen, ' ', n - tlen);
    free(text);
    struct stw_out o = {.w = w, .head = head, .head_len = 8 + n};
    int rc = kv_write_atomic(path, fill_st, &o, err);
    free(head);
    return rc;
}

/* ------------------------------------------------------------ copy */

struct copy_in {
    int fd;
    const char *src;
};

static int fill_copy(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    const struct copy_in *in = ctx;
    char eb[128];
    uint8_t *buf = malloc(STW_STAGE);
    if (!buf) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int rc = KV_OK;
    uint64_t off = 0;
    for (;;) {
        ssize_t r = read(in->fd, buf, STW_STAGE);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = kv_fail(err, KV_EIO, in->src, off, "cannot read: %s",
                         kv_errtext(errno, eb, sizeof eb));
            break;
        }
        if (r == 0) break;
        int e = write_all(fd, buf, (uint64_t)r);
        if (e) {
            rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                         kv_errtext(e, eb, sizeof eb));
            break;
        }
        off += (uint64_t)r;
    }
    free(buf);
    return rc;
}

int kv_file_copy(const char *src, const char *dst, struct kv_err *err) {
    KV_ASSERT(src && dst);
    char eb[128];
    struct copy_in in = {.fd = open(src, O_RDONLY | O_CLOEXEC), .src = src};
    if (in.fd < 0)
        return kv_fail(err, KV_EIO, src, KV_NO_OFFSET, "cannot open: %s",
                       kv_errtext(errno, eb, sizeof eb));
    struct stat st;
    int rc = KV_OK;
    if (fstat(in.fd, &st) != 0) {
        rc = kv_fail(err, KV_EIO, src, KV_NO_OFFSET, "cannot stat: %s",
                     kv_errtext(errno, eb, sizeof eb));
    } else if (S_ISDIR(st.st_mode)) {
        rc = kv_fail(err, KV_EIO, src, KV_NO_OFFSET, "is a directory, expected a file");
    }
    if (rc == KV_OK) rc = kv_write_atomic(dst, fill_copy, &in, err);
    close(in.fd);
    return rc;
}
