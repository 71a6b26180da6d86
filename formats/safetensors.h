/* safetensors reader (internal).
 *
 * Layout (https://github.com/huggingface/safetensors):
 *
 *     offset 0   u64 LE   N, the header length in bytes
 *     offset 8   N bytes  UTF-8 JSON object (may be padded with spaces):
 *                           "__metadata__": {string: string, ...}   optional
 *                           "<tensor>": {"dtype": "F32",
 *                                        "shape": [d0, d1, ...],
 *                                        "data_offsets": [begin, end]}
 *     offset 8+N          the data section; a tensor's bytes are
 *                         [8+N+begin, 8+N+end), row-major, little-endian
 *
 * kv_st_parse validates the whole header before any data is touched: the
 * length fits the file and KV_MAX_ST_HEADER; the JSON is an object without
 * duplicate keys; dtypes come from the closed list F64 F32 F16 BF16 I64 I32
 * I16 I8 U8 BOOL; shapes have at most KV_MAX_DIMS non-negative dims; each
 * tensor's byte size (checked math) equals end - begin; and sorted by begin
 * the tensors tile the data section exactly: from 0, no gap, no overlap, the
 * last end equal to the file size - 8 - N.
 *
 * Error offsets: 0 for the length field, 8 for problems in a tensor's header
 * entry, 8 + jansson's position for JSON syntax, and the tensor's absolute
 * data offset for layout problems (gap, overlap, truncation, trailing bytes). */
#ifndef KV_SAFETENSORS_H
#define KV_SAFETENSORS_H

#include "kvformats.h"
#include "mapfile.h"

struct kv_st_file {
    struct kv_tensor *tensors; /* [n_tensors] sorted by offset; file == 0 */
    int64_t n_tensors;
    char **meta_keys;          /* __metadata__, in header order (owned) */
    char **meta_vals;
    int64_t n_meta;
    uint64_t header_len;       /* N */
    uint64_t data_start;       /* 8 + N: absolute offset of data_offsets 0 */
    struct kv_map map;         /* set by kv_st_open only */
};

/* Parse and validate a whole safetensors file held in buf[0..len). Tensor
 * data pointers point into buf, which must outlive *out. path names the file
 * in messages. On success release *out's tables with kv_st_clear; on failure
 * *out is left empty. Errors: KV_EFORMAT, KV_EUNSUPPORTED (a safetensors
 * dtype kvcal does not read, e.g. F8_E4M3), KV_ENOMEM. */
int kv_st_parse(const uint8_t *buf, uint64_t len, const char *path, struct kv_st_file *out,
                struct kv_err *err);

/* Free the tables kv_st_parse allocated (not buf). NULL is a no-op. */
void kv_st_clear(struct kv_st_file *f);

/* Map path read-only and parse it. *out owns the mapping; tensor data stays
 * valid until kv_st_close. Errors: KV_EIO plus those of kv_st_parse. */
int kv_st_open(const char *path, struct kv_st_file **out, struct kv_err *err);

/* Unmap and free. NULL is a no-op. */
void kv_st_close(struct kv_st_file *f);

/* Tensor called name, or NULL. Linear in the tensor count. */
const struct kv_tensor *kv_st_find(const struct kv_st_file *f, const char *name);

/* __metadata__ value of key, or NULL. */
const char *kv_st_meta(const struct kv_st_file *f, const char *key);

#endif
