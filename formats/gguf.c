/* GGUF v2/v3 container: parser, lookups and metadata getters. Layout and
 * rules are described in gguf.h; what a llama model reads from the container
 * is in ggufmodel.c. */
#include "gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cursor.h"
#include "err.h"
#include "limits.h"

#define GGUF_DEFAULT_ALIGNMENT 32u
/* Smallest encodings, used to bound counts by the bytes left: a tensor info
 * is a u64 name length, a 1-byte name, u32 n_dims, one u64 dim, u32 type and
 * u64 offset; a pair is a u64 key length, a 1-byte key, u32 type and a 1-byte
 * value. */
#define GGUF_MIN_TENSOR_INFO 33u
#define GGUF_MIN_KV 14u

/* ------------------------------------------------------------ type tables */

static const char *const value_type_names[KV_GGUF_TYPE_COUNT] = {
    "uint8", "int8",   "uint16", "int16", "uint32", "int32",  "float32",
    "bool",  "string", "array",  "uint64", "int64", "float64",
};
/* Element size of fixed-size value types; 0 for string and array. */
static const uint8_t value_type_size[KV_GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char *kv_gguf_type_name(enum kv_gguf_type t) {
    return (unsigned)t < KV_GGUF_TYPE_COUNT ? value_type_names[t] : "?";
}

struct ggml_type_info {
    const char *name; /* NULL: not a ggml type (removed or never assigned) */
    uint32_t block;   /* elements per block */
    uint32_t size;    /* bytes per block */
    int quantized;
    int dtype;        /* enum kv_dtype, or -1 */
};

/* Block sizes and bytes per block of every ggml type, by its number. */
static const struct ggml_type_info ggml_types[] = {
    [0] = {"F32", 1, 4, 0, KV_DTYPE_F32},
    [1] = {"F16", 1, 2, 0, KV_DTYPE_F16},
    [2] = {"Q4_0", 32, 18, 1, -1},
    [3] = {"Q4_1", 32, 20, 1, -1},
    [6] = {"Q5_0", 32, 22, 1, -1},
    [7] = {"Q5_1", 32, 24, 1, -1},
    [8] = {"Q8_0", 32, 34, 1, -1},
    [9] = {"Q8_1", 32, 36, 1, -1},
    [10] = {"Q2_K", 256, 84, 1, -1},
    [11] = {"Q3_K", 256, 110, 1, -1},
    [12] = {"Q4_K", 256, 144, 1, -1},
    [13] = {"Q5_K", 256, 176, 1, -1},
    [14] = {"Q6_K", 256, 210, 1, -1},
    [15] = {"Q8_K", 256, 292, 1, -1},
    [16] = {"IQ2_XXS", 256, 66, 1, -1},
    [17] = {"IQ2_XS", 256, 74, 1, -1},
    [18] = {"IQ3_XXS", 256, 98, 1, -1},
    [19] = {"IQ1_S", 256, 50, 1, -1},
    [20] = {"IQ4_NL", 32, 18, 1, -1},
    [21] = {"IQ3_S", 256, 110, 1, -1},
    [22] = {"IQ2_S", 256, 82, 1, -1},
    [23] = {"IQ4_XS", 256, 136, 1, -1},
    [24] = {"I8", 1, 1, 0, KV_DTYPE_I8},
    [25] = {"I16", 1, 2, 0, KV_DTYPE_I16},
    [26] = {"I32", 1, 4, 0, KV_DTYPE_I32},
    [27] = {"I64", 1, 8, 0, KV_DTYPE_I64},
    [28] = {"F64", 1, 8, 0, KV_DTYPE_F64},
    [29] = {"IQ1_M", 256, 56, 1, -1},
    [30] = {"BF16", 1, 2, 0, KV_DTYPE_BF16},
    [34] = {"TQ1_0", 256, 54, 1, -1},
    [35] = {"TQ2_0", 256, 66, 1, -1},
    [39] = {"MXFP4", 32, 17, 1, -1},
};
#define N_GGML_TYPES (sizeof ggml_types / sizeof ggml_types[0])

static const struct ggml_type_info *ggml_type(uint32_t t) {
    return t < N_GGML_TYPES && ggml_types[t].name ? &ggml_types[t] : NULL;
}

const char *kv_ggml_type_name(uint32_t type) {
    const struct ggml_type_info *ti = ggml_type(type);
    return ti ? ti->name : "?";
}

int kv_ggml_is_quantized(uint32_t type) {
    const struct ggml_type_info *ti = ggml_type(type);
    return ti && ti->quantized;
}

/* ------------------------------------------------------------ hashing */

uint64_t kv_gguf_hash(const char *p, uint64_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (uint64_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static uint64_t table_cap(int64_t n) {
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap *= 2;
    return cap;
}

static int64_t *table_new(uint64_t cap) {
    int64_t *t = malloc(cap * sizeof *t);
    if (t)
        for (uint64_t i = 0; i < cap; i++) t[i] = -1;
    return t;
}

static int str_eq(struct kv_gguf_str a, const char *b, uint64_t blen) {
    return a.len == blen && memcmp(a.p, b, blen) == 0;
}

int kv_gguf_str_eq(struct kv_gguf_str s, const char *lit) { return str_eq(s, lit, strlen(lit)); }

static uint64_t kv_slot(const struct kv_gguf_file *f, const char *k, uint64_t n, int *found) {
    uint64_t i = kv_gguf_hash(k, n) & (f->kv_index_cap - 1);
    *found = 0;
    while (f->kv_index[i] >= 0) {
        if (str_eq(f->kv[f->kv_index[i]].key, k, n)) {
            *found = 1;
            break;
        }
        i = (i + 1) & (f->kv_index_cap - 1);
    }
    return i;
}

static uint64_t tensor_slot(const struct kv_gguf_file *f, const char *k, uint64_t n, int *found) {
    uint64_t i = kv_gguf_hash(k, n) & (f->tensor_index_cap - 1);
    *found = 0;
    while (f->tensor_index[i] >= 0) {
        const struct kv_tensor *t = &f->tensors[f->tensor_index[i]].t;
        if (strlen(t->name) == n && memcmp(t->name, k, n) == 0) {
            *found = 1;
            break;
        }
        i = (i + 1) & (f->tensor_index_cap - 1);
    }
    return i;
}

/* ------------------------------------------------------------ parsing */

/* Printable excerpt of untrusted bytes for messages: at most about cap-8
 * characters, non-printables and quotes as \xNN, "..." when cut. */
const char *kv_gguf_excerpt(const char *p, uint64_t n, char *buf, size_t cap) {
    KV_ASSERT(cap >= 16);
    size_t o = 0, room = cap - 8;
    uint64_t i = 0;
    for (; i < n && o + 4 <= room; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch >= 0x20 && ch < 0x7f && ch != '\'' && ch != '\\')
            buf[o++] = (char)ch;
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
    }
    if (i < n) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = 0;
    return buf;
}

static int read_str(struct kv_cursor *c, struct kv_gguf_str *s, uint64_t max, const char *what) {
    uint64_t off = c->pos, n;
    int rc = kv_cur_u64(c, &n, what);
    if (rc) return rc;
    if (n > max)
        return kv_fail(c->err, KV_EFORMAT, c->path, off, "%s is %llu bytes, limit %llu", what,
                       (unsigned long long)n, (unsigned long long)max);
    const uint8_t *p;
    rc = kv_cur_bytes(c, n, &p, what);
    if (rc) return rc;
    s->p = (const char *)p;
    s->len = n;
    return KV_OK;
}

/* Read one scalar (or string) value of type t into kv. */
static int read_scalar(struct kv_cursor *c, enum kv_gguf_type t, struct kv_gguf_kv *kv,
                       const char *what) {
    int rc = KV_OK;
    uint8_t u8;
    uint16_t u16;
    uint32_t u32;
    uint64_t u64;
    switch (t) {
    case KV_GGUF_U8:
    case KV_GGUF_BOOL:
        if (!(rc = kv_cur_u8(c, &u8, what))) kv->v.u = u8;
        break;
    case KV_GGUF_I8:
        if (!(rc = kv_cur_u8(c, &u8, what))) kv->v.i = (int8_t)u8;
        break;
    case KV_GGUF_U16:
        if (!(rc = kv_cur_u16(c, &u16, what))) kv->v.u = u16;
        break;
    case KV_GGUF_I16:
        if (!(rc = kv_cur_u16(c, &u16, what))) kv->v.i = (int16_t)u16;
        break;
    case KV_GGUF_U32:
        if (!(rc = kv_cur_u32(c, &u32, what))) kv->v.u = u32;
        break;
    case KV_GGUF_I32:
        if (!(rc = kv_cur_u32(c, &u32, what))) kv->v.i = (int32_t)u32;
        break;
    case KV_GGUF_U64:
        if (!(rc = kv_cur_u64(c, &u64, what))) kv->v.u = u64;
        break;
    case KV_GGUF_I64:
        if (!(rc = kv_cur_u64(c, &u64, what))) kv->v.i = (int64_t)u64;
        break;
    case KV_GGUF_F32: {
        float x;
        if (!(rc = kv_cur_f32(c, &x, what))) kv->v.f = x;
        break;
    }
    case KV_GGUF_F64: {
        double x;
        if (!(rc = kv_cur_f64(c, &x, what))) kv->v.f = x;
        break;
    }
    case KV_GGUF_STRING: rc = read_str(c, &kv->str, KV_MAX_STRING, what); break;
    case KV_GGUF_ARRAY:
    case KV_GGUF_TYPE_COUNT: KV_ASSERT(0);
    }
    return rc;
}

#define KEYFMT "key '%s'"

static int parse_kv(struct kv_cursor *c, struct kv_gguf_file *f, int64_t idx) {
    struct kv_gguf_kv *kv = &f->kv[idx];
    char what[400], kb[256];
    kv->key_off = c->pos;
    snprintf(what, sizeof what, "the key of metadata pair %lld", (long long)idx);
    int rc = read_str(c, &kv->key, KV_MAX_STRING, what);
    if (rc) return rc;
    if (kv->key.len == 0)
        return kv_fail(c->err, KV_EFORMAT, c->path, kv->key_off, "metadata pair %lld has an empty key",
                       (long long)idx);
    kv_gguf_excerpt(kv->key.p, kv->key.len, kb, sizeof kb);
    int found;
    uint64_t slot = kv_slot(f, kv->key.p, kv->key.len, &found);
    if (found)
        return kv_fail(c->err, KV_EFORMAT, c->path, kv->key_off,
                       "duplicate " KEYFMT " (first at offset %llu)", kb,
                       (unsigned long long)f->kv[f->kv_index[slot]].key_off);
    f->kv_index[slot] = idx;

    kv->type_off = c->pos;
    snprintf(what, sizeof what, "the value type of " KEYFMT, kb);
    uint32_t t;
    if ((rc = kv_cur_u32(c, &t, what))) return rc;
    if (t >= KV_GGUF_TYPE_COUNT)
        return kv_fail(c->err, KV_EFORMAT, c->path, kv->type_off,
                       KEYFMT " has unknown value type %u, expected 0..%d", kb, t,
                       KV_GGUF_TYPE_COUNT - 1);
    kv->type = (enum kv_gguf_type)t;
    kv->val_off = c->pos;
    snprintf(what, sizeof what, "the value of " KEYFMT, kb);
    if (kv->type != KV_GGUF_ARRAY) return read_scalar(c, kv->type, kv, what);

    uint32_t et;
    if ((rc = kv_cur_u32(c, &et, what))) return rc;
    if (et == KV_GGUF_ARRAY)
        return kv_fail(c->err, KV_EFORMAT, c->path, kv->val_off,
                       KEYFMT " is an array of arrays; gguf arrays do not nest", kb);
    if (et >= KV_GGUF_TYPE_COUNT)
        return kv_fail(c->err, KV_EFORMAT, c->path, kv->val_off,
                       KEYFMT " has unknown array element type %u, expected 0..%d", kb, et,
                       KV_GGUF_TYPE_COUNT - 1);
    kv->arr_type = (enum kv_gguf_type)et;
    uint64_t n_off = c->pos, n;
    if ((rc = kv_cur_u64(c, &n, what))) return rc;
    if (n > KV_MAX_ARRAY)
        return kv_fail(c->err, KV_EFORMAT, c->path, n_off,
                       KEYFMT " has %llu array elements, limit %u", kb, (unsigned long long)n,
                       KV_MAX_ARRAY);
    kv->arr_n = n;
    kv->arr_off = c->pos;
    if (kv->arr_type == KV_GGUF_STRING) {
        for (uint64_t i = 0; i < n; i++) {
            struct kv_gguf_str s;
            snprintf(what, sizeof what, "element %llu of " KEYFMT, (unsigned long long)i, kb);
            if ((rc = read_str(c, &s, KV_MAX_STRING, what))) return rc;
        }
        return KV_OK;
    }
    uint64_t bytes;
    if (!kv_mul_u64(n, value_type_size[et], &bytes))
        return kv_fail(c->err, KV_EFORMAT, c->path, n_off, KEYFMT " array size overflows", kb);
    return kv_cur_skip(c, bytes, what);
}

static int parse_tensor_info(struct kv_cursor *c, struct kv_gguf_file *f, int64_t idx) {
    struct kv_gguf_tensor *ti = &f->tensors[idx];
    char what[400];
    ti->info_off = c->pos;
    snprintf(what, sizeof what, "the name of tensor %lld", (long long)idx);
    struct kv_gguf_str name;
    int rc = read_str(c, &name, KV_MAX_NAME_LEN, what);
    if (rc) return rc;
    if (name.len == 0)
        return kv_fail(c->err, KV_EFORMAT, c->path, ti->info_off, "tensor %lld has an empty name",
                       (long long)idx);
    if (memchr(name.p, 0, name.len)) {
        char nb[300];
        return kv_fail(c->err, KV_EFORMAT, c->path, ti->info_off,
                       "tensor name '%s' contains a nul byte",
                       kv_gguf_excerpt(name.p, name.len, nb, sizeof nb));
    }
    memcpy(ti->t.name, name.p, name.len);
    ti->t.name[name.len] = 0;
    const char *nm = ti->t.name;
    int found;
    uint64_t slot = tensor_slot(f, name.p, name.len, &found);
    if (found)
        return kv_fail(c->err, KV_EFORMAT, c->path, ti->info_off,
                       "duplicate tensor name '%s' (first at offset %llu)", nm,
                       (unsigned long long)f->tensors[f->tensor_index[slot]].info_off);
    f->tensor_index[slot] = idx;

    snprintf(what, sizeof what, "tensor '%s'", nm);
    uint64_t nd_off = c->pos;
    uint32_t nd;
    if ((rc = kv_cur_u32(c, &nd, what))) return rc;
    if (nd < 1 || nd > KV_MAX_DIMS)
        return kv_fail(c->err, KV_EFORMAT, c->path, nd_off,
                       "tensor '%s' has %u dimensions, expected 1 to %d", nm, nd, KV_MAX_DIMS);
    ti->n_dims = (int)nd;
    uint64_t numel = 1;
    for (uint32_t d = 0; d < nd; d++) {
        uint64_t d_off = c->pos, v;
        if ((rc = kv_cur_u64(c, &v, what))) return rc;
        if (v == 0 || v > (uint64_t)INT64_MAX)
            return kv_fail(c->err, KV_EFORMAT, c->path, d_off,
                           "tensor '%s' has ne[%u] = %llu, expected 1 to 2^63-1", nm, d,
                           (unsigned long long)v);
        if (!kv_mul_u64(numel, v, &numel) || numel > (uint64_t)INT64_MAX)
            return kv_fail(c->err, KV_EFORMAT, c->path, d_off,
                           "tensor '%s' element count overflows", nm);
        ti->ne[d] = (int64_t)v;
    }
    ti->type_off = c->pos;
    if ((rc = kv_cur_u32(c, &ti->ggml_type, what))) return rc;
    const struct ggml_type_info *gt = ggml_type(ti->ggml_type);
    if (!gt)
        return kv_fail(c->err, KV_EFORMAT, c->path, ti->type_off,
                       "tensor '%s' has unknown ggml type %u", nm, ti->ggml_type);
    if ((uint64_t)ti->ne[0] % gt->block)
        return kv_fail(c->err, KV_EFORMAT, c->path, ti->type_off,
                       "tensor '%s' has ne[0] = %lld, not a multiple of the %s block size %u",
                       nm, (long long)ti->ne[0], gt->name, gt->block);
    uint64_t nbytes;
    if (!kv_mul_u64(numel / gt->block, gt->size, &nbytes))
        return kv_fail(c->err, KV_EFORMAT, c->path, ti->type_off,
                       "tensor '%s' byte size overflows", nm);
    ti->offset_off = c->pos;
    if ((rc = kv_cur_u64(c, &ti->rel_offset, what))) return rc;
    if (ti->rel_offset % f->alignment)
        return kv_fail(c->err, KV_EFORMAT, c->path, ti->offset_off,
                       "tensor '%s' offset %llu is not a multiple of the alignment %u", nm,
                       (unsigned long long)ti->rel_offset, f->alignment);

    ti->t.ndim = (int)nd;
    for (int i = 0; i < (int)nd; i++) ti->t.shape[i] = ti->ne[nd - 1 - (unsigned)i];
    ti->t.nbytes = nbytes;
    ti->has_dtype = gt->dtype >= 0;
    ti->t.dtype = gt->dtype >= 0 ? (enum kv_dtype)gt->dtype : KV_DTYPE_COUNT;
    ti->t.block_type = gt->quantized ? ti->ggml_type : 0;
    ti->t.file = 0;
    return KV_OK;
}

static int set_alignment(struct kv_gguf_file *f, struct kv_err *err) {
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const struct kv_gguf_kv *kv = kv_gguf_find(f, "general.alignment");
    if (!kv) return KV_OK;
    if (kv->type != KV_GGUF_U32)
        return kv_fail(err, KV_EFORMAT, f->path, kv->type_off,
                       "key 'general.alignment' has type %s, expected uint32",
                       kv_gguf_type_name(kv->type));
    uint64_t a = kv->v.u;
    if (a == 0 || (a & (a - 1)))
        return kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                       "key 'general.alignment' is %llu, expected a power of two",
                       (unsigned long long)a);
    f->alignment = (uint32_t)a;
    return KV_OK;
}

struct by_offset {
    uint64_t rel_offset, info_off;
    int64_t idx;
};
static int cmp_by_offset(const void *a, const void *b) {
    const struct by_offset *x = a, *y = b;
    if (x->rel_offset != y->rel_offset) return x->rel_offset < y->rel_offset ? -1 : 1;
    return x->info_off < y->info_off ? -1 : x->info_off > y->info_off;
}

static int align_up(uint64_t v, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (!kv_add_u64(v, a - 1, &t)) return 0;
    *out = t & ~(a - 1);
    return 1;
}

/* Check extents and contiguity, then fill absolute offsets and data. */
static int check_layout(struct kv_gguf_file *f, uint64_t header_end, struct kv_err *err) {
    if (!align_up(header_end, f->alignment, &f->data_off))
        return kv_fail(err, KV_EFORMAT, f->path, header_end, "data section offset overflows");
    if (f->n_tensors == 0) return KV_OK;
    if (f->data_off > f->len)
        return kv_fail(err, KV_EFORMAT, f->path, header_end,
                       "data section starts at %llu, past the end of the file (%llu bytes)",
                       (unsigned long long)f->data_off, (unsigned long long)f->len);
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct kv_gguf_tensor *ti = &f->tensors[i];
        uint64_t abs, end;
        if (!kv_add_u64(f->data_off, ti->rel_offset, &abs) || !kv_add_u64(abs, ti->t.nbytes, &end) ||
            end > f->len)
            return kv_fail(err, KV_EFORMAT, f->path, ti->offset_off,
                           "tensor '%s' at data offset %llu needs %llu bytes but the data section "
                           "holds %llu",
                           ti->t.name, (unsigned long long)ti->rel_offset,
                           (unsigned long long)ti->t.nbytes,
                           (unsigned long long)(f->len - f->data_off));
        ti->t.offset = abs;
    }
    struct by_offset *order = malloc((size_t)f->n_tensors * sizeof *order);
    if (!order) return kv_fail(err, KV_ENOMEM, f->path, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < f->n_tensors; i++)
        order[i] = (struct by_offset){f->tensors[i].rel_offset, f->tensors[i].info_off, i};
    qsort(order, (size_t)f->n_tensors, sizeof *order, cmp_by_offset);
    uint64_t expect = 0;
    int rc = KV_OK;
    for (int64_t k = 0; k < f->n_tensors && !rc; k++) {
        const struct kv_gguf_tensor *ti = &f->tensors[order[k].idx];
        const struct kv_gguf_tensor *prev = k ? &f->tensors[order[k - 1].idx] : NULL;
        if (ti->rel_offset != expect) {
            if (!prev)
                rc = kv_fail(err, KV_EFORMAT, f->path, ti->offset_off,
                             "tensor '%s' is first in the data section at offset %llu, expected 0",
                             ti->t.name, (unsigned long long)ti->rel_offset);
            else if (ti->rel_offset < expect)
                rc = kv_fail(err, KV_EFORMAT, f->path, ti->offset_off,
                             "tensor '%s' at data offset %llu overlaps tensor '%s' (%llu..%llu)",
                             ti->t.name, (unsigned long long)ti->rel_offset, prev->t.name,
                             (unsigned long long)prev->rel_offset,
                             (unsigned long long)(prev->rel_offset + prev->t.nbytes));
            else
                rc = kv_fail(err, KV_EFORMAT, f->path, ti->offset_off,
                             "tensor '%s' at data offset %llu leaves a gap after tensor '%s', "
                             "expected offset %llu",
                             ti->t.name, (unsigned long long)ti->rel_offset, prev->t.name,
                             (unsigned long long)expect);
            break;
        }
        /* cannot overflow: the extent was checked against the file size */
        if (!align_up(ti->rel_offset + ti->t.nbytes, f->alignment, &expect))
            rc = kv_fail(err, KV_EFORMAT, f->path, ti->offset_off, "tensor '%s' end overflows",
                         ti->t.name);
    }
    free(order);
    if (rc) return rc;
    for (int64_t i = 0; i < f->n_tensors; i++)
        f->tensors[i].t.data = f->buf + f->tensors[i].t.offset;
    return KV_OK;
}

void kv_gguf_release(struct kv_gguf_file *f) {
    if (!f) return;
    free(f->path);
    free(f->kv);
    free(f->tensors);
    free(f->kv_index);
    free(f->tensor_index);
    f->path = NULL;
    f->kv = NULL;
    f->tensors = NULL;
    f->kv_index = f->tensor_index = NULL;
    f->n_kv = f->n_tensors = 0;
}

static int parse_body(struct kv_gguf_file *f, struct kv_err *err) {
    struct kv_cursor cur, *c = &cur;
    kv_cur_init(c, f->buf, f->len, f->path, err);
    const uint8_t *magic;
    int rc = kv_cur_bytes(c, 4, &magic, "the magic");
    if (rc) return rc;
    if (memcmp(magic, "GGUF", 4) != 0) {
        char mb[32];
        return kv_fail(err, KV_EFORMAT, f->path, 0, "bad magic '%s', expected 'GGUF'",
                       kv_gguf_excerpt((const char *)magic, 4, mb, sizeof mb));
    }
    if ((rc = kv_cur_u32(c, &f->version, "the version"))) return rc;
    if (f->version != 2 && f->version != 3) {
        uint32_t v = f->version, sw = __builtin_bswap32(v);
        if (sw >= 1 && sw <= 3)
            return kv_fail(err, KV_EUNSUPPORTED, f->path, 4,
                           "gguf version field is 0x%08x, which is version %u byte-swapped: the "
                           "file is big-endian, which kvcal does not support",
                           v, sw);
        return kv_fail(err, KV_EUNSUPPORTED, f->path, 4,
                       "unsupported gguf version %u, expected 2 or 3", v);
    }
    uint64_t nt, nkv;
    if ((rc = kv_cur_u64(c, &nt, "the tensor count"))) return rc;
    if ((rc = kv_cur_u64(c, &nkv, "the metadata count"))) return rc;
    uint64_t left = kv_cur_left(c);
    if (nt > KV_MAX_TENSORS)
        return kv_fail(err, KV_EFORMAT, f->path, 8, "tensor count %llu exceeds the limit %d",
                       (unsigned long long)nt, KV_MAX_TENSORS);
    if (nt * GGUF_MIN_TENSOR_INFO > left)
        return kv_fail(err, KV_EFORMAT, f->path, 8,
                       "tensor count %llu needs at least %llu bytes of tensor info but only %llu "
                       "bytes follow the header",
                       (unsigned long long)nt, (unsigned long long)(nt * GGUF_MIN_TENSOR_INFO),
                       (unsigned long long)left);
    if (nkv > KV_MAX_KV_PAIRS)
        return kv_fail(err, KV_EFORMAT, f->path, 16, "metadata count %llu exceeds the limit %d",
                       (unsigned long long)nkv, KV_MAX_KV_PAIRS);
    if (nkv * GGUF_MIN_KV > left)
        return kv_fail(err, KV_EFORMAT, f->path, 16,
                       "metadata count %llu needs at least %llu bytes but only %llu bytes follow "
                       "the header",
                       (unsigned long long)nkv, (unsigned long long)(nkv * GGUF_MIN_KV),
                       (unsigned long long)left);
    f->n_kv = (int64_t)nkv;
    f->n_tensors = (int64_t)nt;
    f->kv = calloc(nkv ? nkv : 1, sizeof *f->kv);
    f->tensors = calloc(nt ? nt : 1, sizeof *f->tensors);
    f->kv_index_cap = table_cap(f->n_kv);
    f->tensor_index_cap = table_cap(f->n_tensors);
    f->kv_index = table_new(f->kv_index_cap);
    f->tensor_index = table_new(f->tensor_index_cap);
    if (!f->kv || !f->tensors || !f->kv_index || !f->tensor_index)
        return kv_fail(err, KV_ENOMEM, f->path, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < f->n_kv; i++)
        if ((rc = parse_kv(c, f, i))) return rc;
    if ((rc = set_alignment(f, err))) return rc;
    for (int64_t i = 0; i < f->n_tensors; i++)
        if ((rc = parse_tensor_info(c, f, i))) return rc;
    return check_layout(f, c->pos, err);
}

int kv_gguf_parse(const uint8_t *buf, uint64_t len, const char *path, struct kv_gguf_file *out,
                  struct kv_err *err) {
    memset(out, 0, sizeof *out);
    out->path = strdup(path ? path : "");
    if (!out->path) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    out->buf = buf;
    out->len = len;
    out->alignment = GGUF_DEFAULT_ALIGNMENT;
    int rc = parse_body(out, err);
    if (rc) {
        kv_gguf_release(out);
        memset(out, 0, sizeof *out);
    }
    return rc;
}

int kv_gguf_open(const char *path, struct kv_gguf_file **out, struct kv_err *err) {
    struct kv_gguf_file *f = malloc(sizeof *f);
    if (!f) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    struct kv_map map;
    int rc = kv_map_open(path, &map, err);
    if (rc) {
        free(f);
        return rc;
    }
    rc = kv_gguf_parse(map.data, map.len, path, f, err);
    if (rc) {
        kv_map_close(&map);
        free(f);
        return rc;
    }
    f->map = map;
    *out = f;
    return KV_OK;
}

void kv_gguf_close(struct kv_gguf_file *f) {
    if (!f) return;
    kv_gguf_release(f);
    kv_map_close(&f->map);
    free(f);
}

/* ------------------------------------------------------------ lookups */

const struct kv_gguf_kv *kv_gguf_find(const struct kv_gguf_file *f, const char *key) {
    if (!f->kv_index) return NULL;
    int found;
    uint64_t s = kv_slot(f, key, strlen(key), &found);
    return found ? &f->kv[f->kv_index[s]] : NULL;
}

const struct kv_gguf_tensor *kv_gguf_find_tensor(const struct kv_gguf_file *f, const char *name) {
    if (!f->tensor_index) return NULL;
    int found;
    uint64_t s = tensor_slot(f, name, strlen(name), &found);
    return found ? &f->tensors[f->tensor_index[s]] : NULL;
}

static const struct kv_gguf_kv *need_key(const struct kv_gguf_file *f, const char *key,
                                         struct kv_err *err) {
    const struct kv_gguf_kv *kv = kv_gguf_find(f, key);
    if (!kv) kv_fail(err, KV_EFORMAT, f->path, KV_NO_OFFSET, "missing key '%s'", key);
    return kv;
}

static int wrong_type(const struct kv_gguf_file *f, const struct kv_gguf_kv *kv, const char *key,
                      const char *want, struct kv_err *err) {
    if (kv->type == KV_GGUF_ARRAY)
        return kv_fail(err, KV_EFORMAT, f->path, kv->type_off,
                       "key '%s' has type array of %s, expected %s", key,
                       kv_gguf_type_name(kv->arr_type), want);
    return kv_fail(err, KV_EFORMAT, f->path, kv->type_off, "key '%s' has type %s, expected %s",
                   key, kv_gguf_type_name(kv->type), want);
}

static int is_unsigned(enum kv_gguf_type t) {
    return t == KV_GGUF_U8 || t == KV_GGUF_U16 || t == KV_GGUF_U32 || t == KV_GGUF_U64;
}
static int is_signed(enum kv_gguf_type t) {
    return t == KV_GGUF_I8 || t == KV_GGUF_I16 || t == KV_GGUF_I32 || t == KV_GGUF_I64;
}

/* Integer value of kv within [lo, hi]; *v gets it as a signed 128-free pair. */
static int get_int(const struct kv_gguf_file *f, const char *key, const char *tname, int64_t lo,
                   uint64_t hi, uint64_t *uv, int64_t *sv, struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_key(f, key, err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    if (is_unsigned(kv->type)) {
        if (kv->v.u > hi)
            return kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                           "key '%s' is %llu, which does not fit in %s", key,
                           (unsigned long long)kv->v.u, tname);
        *uv = kv->v.u;
        *sv = (int64_t)kv->v.u; /* hi <= INT64_MAX unless the caller wants u64 */
        return KV_OK;
    }
    if (is_signed(kv->type)) {
        if (kv->v.i < lo || (kv->v.i >= 0 && (uint64_t)kv->v.i > hi))
            return kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                           "key '%s' is %lld, which does not fit in %s", key,
                           (long long)kv->v.i, tname);
        *uv = (uint64_t)kv->v.i;
        *sv = kv->v.i;
        return KV_OK;
    }
    return wrong_type(f, kv, key, tname, err);
}

int kv_gguf_get_u32(const struct kv_gguf_file *f, const char *key, uint32_t *out,
                    struct kv_err *err) {
    uint64_t u;
    int64_t s;
    int rc = get_int(f, key, "uint32", 0, UINT32_MAX, &u, &s, err);
    if (!rc) *out = (uint32_t)u;
    return rc;
}

int kv_gguf_get_i32(const struct kv_gguf_file *f, const char *key, int32_t *out,
                    struct kv_err *err) {
    uint64_t u;
    int64_t s;
    int rc = get_int(f, key, "int32", INT32_MIN, INT32_MAX, &u, &s, err);
    if (!rc) *out = (int32_t)s;
    return rc;
}

int kv_gguf_get_u64(const struct kv_gguf_file *f, const char *key, uint64_t *out,
                    struct kv_err *err) {
    uint64_t u;
    int64_t s;
    int rc = get_int(f, key, "uint64", 0, UINT64_MAX, &u, &s, err);
    if (!rc) *out = u;
    return rc;
}

int kv_gguf_get_f32(const struct kv_gguf_file *f, const char *key, float *out,
                    struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_key(f, key, err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    if (kv->type != KV_GGUF_F32 && kv->type != KV_GGUF_F64)
        return wrong_type(f, kv, key, "float32", err);
    *out = (float)kv->v.f;
    return KV_OK;
}

int kv_gguf_get_bool(const struct kv_gguf_file *f, const char *key, int *out,
                     struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_key(f, key, err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    if (kv->type != KV_GGUF_BOOL) return wrong_type(f, kv, key, "bool", err);
    if (kv->v.u > 1)
        return kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                       "key '%s' is bool %llu, expected 0 or 1", key, (unsigned long long)kv->v.u);
    *out = (int)kv->v.u;
    return KV_OK;
}

int kv_gguf_get_str(const struct kv_gguf_file *f, const char *key, struct kv_gguf_str *out,
                    struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_key(f, key, err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    if (kv->type != KV_GGUF_STRING) return wrong_type(f, kv, key, "string", err);
    *out = kv->str;
    return KV_OK;
}

/* Array kv of key with an element type accepted by ok(); else a type error. */
static const struct kv_gguf_kv *need_array(const struct kv_gguf_file *f, const char *key,
                                           int (*ok)(enum kv_gguf_type), const char *want,
                                           struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_key(f, key, err);
    if (!kv) return NULL;
    if (kv->type != KV_GGUF_ARRAY || !ok(kv->arr_type)) {
        wrong_type(f, kv, key, want, err);
        return NULL;
    }
    return kv;
}

static int elem_is_str(enum kv_gguf_type t) { return t == KV_GGUF_STRING; }
static int elem_is_float(enum kv_gguf_type t) { return t == KV_GGUF_F32 || t == KV_GGUF_F64; }
static int elem_is_int(enum kv_gguf_type t) { return is_signed(t) || is_unsigned(t); }

int kv_gguf_get_arr_str(const struct kv_gguf_file *f, const char *key,
                        struct kv_gguf_str **out, uint64_t *n, struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_array(f, key, elem_is_str, "array of string", err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    struct kv_gguf_str *a = malloc((kv->arr_n ? kv->arr_n : 1) * sizeof *a);
    if (!a) return kv_fail(err, KV_ENOMEM, f->path, kv->val_off, "out of memory");
    struct kv_cursor c;
    kv_cur_init(&c, f->buf, f->len, f->path, err);
    c.pos = kv->arr_off;
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        int rc = read_str(&c, &a[i], KV_MAX_STRING, key); /* validated by the parser */
        if (rc) {
            free(a);
            return rc;
        }
    }
    *out = a;
    *n = kv->arr_n;
    return KV_OK;
}

uint64_t kv_gguf_elem_off(const struct kv_gguf_kv *kv, uint64_t i) {
    KV_ASSERT(kv->type == KV_GGUF_ARRAY && value_type_size[kv->arr_type] && i < kv->arr_n);
    return kv->arr_off + i * value_type_size[kv->arr_type];
}

static const uint8_t *arr_elem(const struct kv_gguf_file *f, const struct kv_gguf_kv *kv,
                               uint64_t i) {
    return f->buf + kv_gguf_elem_off(kv, i);
}

int kv_gguf_get_arr_f32(const struct kv_gguf_file *f, const char *key, float **out,
                        uint64_t *n, struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_array(f, key, elem_is_float, "array of float32", err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    float *a = malloc((kv->arr_n ? kv->arr_n : 1) * sizeof *a);
    if (!a) return kv_fail(err, KV_ENOMEM, f->path, kv->val_off, "out of memory");
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        const uint8_t *p = arr_elem(f, kv, i);
        if (kv->arr_type == KV_GGUF_F32) {
            uint32_t u = kv_le32(p);
            memcpy(&a[i], &u, 4);
        } else {
            uint64_t u = kv_le64(p);
            double d;
            memcpy(&d, &u, 8);
            a[i] = (float)d;
        }
    }
    *out = a;
    *n = kv->arr_n;
    return KV_OK;
}

int kv_gguf_get_arr_i32(const struct kv_gguf_file *f, const char *key, int32_t **out,
                        uint64_t *n, struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_array(f, key, elem_is_int, "array of int32", err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    int32_t *a = malloc((kv->arr_n ? kv->arr_n : 1) * sizeof *a);
    if (!a) return kv_fail(err, KV_ENOMEM, f->path, kv->val_off, "out of memory");
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        const uint8_t *p = arr_elem(f, kv, i);
        int64_t v = 0;
        int ok = 1;
        switch (kv->arr_type) {
        case KV_GGUF_U8: v = p[0]; break;
        case KV_GGUF_I8: v = (int8_t)p[0]; break;
        case KV_GGUF_U16: v = (uint16_t)(p[0] | p[1] << 8); break;
        case KV_GGUF_I16: v = (int16_t)(uint16_t)(p[0] | p[1] << 8); break;
        case KV_GGUF_U32: v = kv_le32(p); break;
        case KV_GGUF_I32: v = (int32_t)kv_le32(p); break;
        case KV_GGUF_U64: {
            uint64_t u = kv_le64(p);
            ok = u <= INT32_MAX;
            v = ok ? (int64_t)u : 0;
            break;
        }
        case KV_GGUF_I64: v = (int64_t)kv_le64(p); break;
        default: KV_ASSERT(0);
        }
        if (!ok || v < INT32_MIN || v > INT32_MAX) {
            free(a);
            return kv_fail(err, KV_EFORMAT, f->path, (uint64_t)(p - f->buf),
                           "element %llu of key '%s' does not fit in int32",
                           (unsigned long long)i, key);
        }
        a[i] = (int32_t)v;
    }
    *out = a;
    *n = kv->arr_n;
    return KV_OK;
}

int kv_gguf_get_arr_u64(const struct kv_gguf_file *f, const char *key, uint64_t **out,
                        uint64_t *n, struct kv_err *err) {
    const struct kv_gguf_kv *kv = need_array(f, key, elem_is_int, "array of uint64", err);
    if (!kv) return err ? err->code : KV_EFORMAT;
    uint64_t *a = malloc((kv->arr_n ? kv->arr_n : 1) * sizeof *a);
    if (!a) return kv_fail(err, KV_ENOMEM, f->path, kv->val_off, "out of memory");
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        const uint8_t *p = arr_elem(f, kv, i);
        int64_t sv = 0;
        uint64_t v = 0;
        int sgn = is_signed(kv->arr_type);
        switch (kv->arr_type) {
        case KV_GGUF_U8: v = p[0]; break;
        case KV_GGUF_I8: sv = (int8_t)p[0]; break;
        case KV_GGUF_U16: v = (uint16_t)(p[0] | p[1] << 8); break;
        case KV_GGUF_I16: sv = (int16_t)(uint16_t)(p[0] | p[1] << 8); break;
        case KV_GGUF_U32: v = kv_le32(p); break;
        case KV_GGUF_I32: sv = (int32_t)kv_le32(p); break;
        case KV_GGUF_U64: v = kv_le64(p); break;
        case KV_GGUF_I64: sv = (int64_t)kv_le64(p); break;
        default: KV_ASSERT(0);
        }
        if (sgn && sv < 0) {
            free(a);
            return kv_fail(err, KV_EFORMAT, f->path, (uint64_t)(p - f->buf),
                           "element %llu of key '%s' is negative (%lld)", (unsigned long long)i,
                           key, (long long)sv);
        }
        a[i] = sgn ? (uint64_t)sv : v;
    }
    *out = a;
    *n = kv->arr_n;
    return KV_OK;
}
