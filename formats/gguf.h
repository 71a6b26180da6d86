/* GGUF v2/v3 reader (internal).
 *
 * Layout (all little-endian; strings are a u64 byte length then the bytes,
 * with no terminator):
 *
 *   u32 magic "GGUF" (bytes 47 47 55 46)
 *   u32 version (2 or 3; 1 used u32 counts and is refused)
 *   u64 n_tensors
 *   u64 n_kv
 *   n_kv times:      string key, u32 value type, value
 *                    (type 9 = array: u32 element type, u64 count, elements;
 *                     arrays never nest)
 *   n_tensors times: string name, u32 n_dims, u64 ne[n_dims], u32 ggml type,
 *                    u64 offset (relative to the data section)
 *   padding to the alignment (general.alignment, u32, default 32)
 *   data section: tensors at aligned offsets
 *
 * ne[0] is the innermost (contiguous) axis, so a linear weight of HF shape
 * [out, in] is stored with ne = {in, out}. The parser converts to kv_tensor's
 * row-major shape (shape[i] = ne[n_dims-1-i]) and absolute file offsets.
 *
 * kv_gguf_parse validates the whole header before it exposes any data: bounded
 * counts, unique keys and tensor names, known value and ggml types, a
 * power-of-two alignment, and tensor extents that are aligned, inside the
 * file and contiguous (sorted by offset, the first at 0 and each at the
 * aligned end of the previous one). Every error names the path, the offset
 * where the offending field starts, and the key or tensor. */
#ifndef KV_GGUF_H
#define KV_GGUF_H

#include <stdint.h>

#include "kvformats.h"
#include "mapfile.h"

/* Metadata value types, numbered as in the file. */
enum kv_gguf_type {
    KV_GGUF_U8 = 0,
    KV_GGUF_I8 = 1,
    KV_GGUF_U16 = 2,
    KV_GGUF_I16 = 3,
    KV_GGUF_U32 = 4,
    KV_GGUF_I32 = 5,
    KV_GGUF_F32 = 6,
    KV_GGUF_BOOL = 7,
    KV_GGUF_STRING = 8,
    KV_GGUF_ARRAY = 9,
    KV_GGUF_U64 = 10,
    KV_GGUF_I64 = 11,
    KV_GGUF_F64 = 12,
    KV_GGUF_TYPE_COUNT
};

/* ggml tensor types kvcal can load directly; every other known type (the
 * quantized ones, integers, F64) is recognised by the parser and sized, and
 * refused by kv_gguf_load (ggufmodel.h). */
enum {
    KV_GGML_F32 = 0,
    KV_GGML_F16 = 1,
    KV_GGML_Q4_0 = 2,
    KV_GGML_BF16 = 30,
};

/* Bytes borrowed from the buffer given to kv_gguf_parse (not NUL-terminated). */
struct kv_gguf_str {
    const char *p;
    uint64_t len;
};

struct kv_gguf_kv {
    struct kv_gguf_str key;
    uint64_t key_off;          /* where the key's length prefix starts */
    uint64_t type_off;         /* where the u32 value type starts */
    uint64_t val_off;          /* where the value starts (arrays: element type) */
    enum kv_gguf_type type;
    /* scalars: u for unsigned and bool, i for signed, f for floats */
    union {
        uint64_t u;
        int64_t i;
        double f;
    } v;
    struct kv_gguf_str str;    /* type STRING */
    enum kv_gguf_type arr_type; /* type ARRAY: element type (never ARRAY) */
    uint64_t arr_n;            /* type ARRAY: element count */
    uint64_t arr_off;          /* type ARRAY: offset of the first element */
};

struct kv_gguf_tensor {
    /* name, shape (row-major), absolute offset, nbytes and data are always
     * set; dtype is meaningful only when has_dtype (the ggml type has a
     * kv_dtype equivalent). */
    struct kv_tensor t;
    int has_dtype;
    uint32_t ggml_type;
    int n_dims;
    int64_t ne[4];             /* as stored: ne[0] innermost */
    uint64_t rel_offset;       /* as stored: relative to the data section */
    uint64_t info_off;         /* where this tensor's info (its name) starts */
    uint64_t type_off;         /* where its u32 ggml type starts */
    uint64_t offset_off;       /* where its u64 offset starts */
};

/* A parsed GGUF header. Strings and tensor data point into the parsed
 * buffer, which must outlive this struct. */
struct kv_gguf_file {
    char *path;                /* copy of the path for messages */
    const uint8_t *buf;
    uint64_t len;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_off;         /* absolute start of the data section */
    int64_t n_kv;
    struct kv_gguf_kv *kv;     /* [n_kv], file order */
    int64_t n_tensors;
    struct kv_gguf_tensor *tensors; /* [n_tensors], file order */
    /* lookup tables (open addressing over indices, -1 = empty) */
    int64_t *kv_index, *tensor_index;
    uint64_t kv_index_cap, tensor_index_cap;
    struct kv_map map;         /* set by kv_gguf_open only */
};

/* Parse len bytes of a GGUF file into *out (which the caller provides; it is
 * zeroed first). path is used in messages only. On failure *out holds nothing
 * to release. On success release with kv_gguf_release. */
int kv_gguf_parse(const uint8_t *buf, uint64_t len, const char *path, struct kv_gguf_file *out,
                  struct kv_err *err);

/* Free what kv_gguf_parse allocated (not the buffer). NULL is a no-op. */
void kv_gguf_release(struct kv_gguf_file *f);

/* Map path read-only and parse it. *out owns the mapping; kv_gguf_close
 * releases both. */
int kv_gguf_open(const char *path, struct kv_gguf_file **out, struct kv_err *err);
void kv_gguf_close(struct kv_gguf_file *f);

/* FNV-1a of n bytes: the lookup tables' hash (and the GGUF writer's). */
uint64_t kv_gguf_hash(const char *p, uint64_t n);

/* Name of a ggml type ("F32", "Q4_0", ...) or "?" when unknown. */
const char *kv_ggml_type_name(uint32_t type);
/* 1 if type is a block-quantized ggml type. */
int kv_ggml_is_quantized(uint32_t type);
/* Name of a metadata value type ("uint32", "string", ...). */
const char *kv_gguf_type_name(enum kv_gguf_type t);

/* Metadata lookup; NULL when absent. */
const struct kv_gguf_kv *kv_gguf_find(const struct kv_gguf_file *f, const char *key);
/* Tensor lookup; NULL when absent. */
const struct kv_gguf_tensor *kv_gguf_find_tensor(const struct kv_gguf_file *f, const char *name);

/* Typed getters. A missing key is KV_EFORMAT "missing key 'K'". Integer
 * getters accept any integer type whose value fits; f32 accepts float32 and
 * float64; a wrong type is KV_EFORMAT "key 'K' has type T, expected U" at the
 * value type's offset. */
int kv_gguf_get_u32(const struct kv_gguf_file *f, const char *key, uint32_t *out,
                    struct kv_err *err);
int kv_gguf_get_i32(const struct kv_gguf_file *f, const char *key, int32_t *out,
                    struct kv_err *err);
int kv_gguf_get_u64(const struct kv_gguf_file *f, const char *key, uint64_t *out,
                    struct kv_err *err);
int kv_gguf_get_f32(const struct kv_gguf_file *f, const char *key, float *out,
                    struct kv_err *err);
int kv_gguf_get_bool(const struct kv_gguf_file *f, const char *key, int *out,
                     struct kv_err *err);
/* The string borrows the file's bytes (not NUL-terminated). */
int kv_gguf_get_str(const struct kv_gguf_file *f, const char *key, struct kv_gguf_str *out,
                    struct kv_err *err);

/* Array getters: *out is malloc'd (caller frees; never NULL on success, even
 * for an empty array) and *n receives the element count. String elements
 * borrow the file's bytes. */
int kv_gguf_get_arr_str(const struct kv_gguf_file *f, const char *key,
                        struct kv_gguf_str **out, uint64_t *n, struct kv_err *err);
int kv_gguf_get_arr_f32(const struct kv_gguf_file *f, const char *key, float **out,
                        uint64_t *n, struct kv_err *err);
int kv_gguf_get_arr_i32(const struct kv_gguf_file *f, const char *key, int32_t **out,
                        uint64_t *n, struct kv_err *err);
/* Any integer element type; negative elements are an error. */
int kv_gguf_get_arr_u64(const struct kv_gguf_file *f, const char *key, uint64_t **out,
                        uint64_t *n, struct kv_err *err);

/* Absolute file offset of element i of an array value whose elements have a
 * fixed size (any type but string); asserts i < arr_n. */
uint64_t kv_gguf_elem_off(const struct kv_gguf_kv *kv, uint64_t i);

/* 1 if s holds exactly the bytes of the C string lit. */
int kv_gguf_str_eq(struct kv_gguf_str s, const char *lit);

/* A printable excerpt of the n untrusted bytes at p for messages, written to
 * buf (cap >= 16) and returned: at most about cap-8 characters, non-printables
 * and quotes as \xNN, "..." when cut. */
const char *kv_gguf_excerpt(const char *p, uint64_t n, char *buf, size_t cap);

#endif
