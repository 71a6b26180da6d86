/* GGUF v3 writer (internal).
 *
 * Collects metadata and tensor descriptions in memory, then streams the file
 * in the layout formats/gguf.h reads: header, metadata in insertion order,
 * tensor infos in insertion order, padding to the alignment (32), and each
 * tensor's bytes at the next aligned offset (zero padding between them).
 * Shapes are given row-major, as in struct kv_tensor; the writer stores
 * ne[] innermost first. Tensor data is borrowed: it must stay valid until
 * kv_ggufw_write returns.
 *
 * kv_ggufw_write writes PATH.tmp, fsyncs it, renames it over PATH and
 * fsyncs the directory, so PATH is always either the old or the new file. */
#ifndef KV_GGUFW_H
#define KV_GGUFW_H

#include <stdint.h>

#include "kvformats.h"

struct kv_ggufw;

int kv_ggufw_init(struct kv_ggufw **out, struct kv_err *err);
void kv_ggufw_free(struct kv_ggufw *w);

/* Metadata. Keys must be unique (KV_EINVAL otherwise); strings are copied. */
int kv_ggufw_add_str(struct kv_ggufw *w, const char *key, const char *val, struct kv_err *err);
int kv_ggufw_add_u32(struct kv_ggufw *w, const char *key, uint32_t val, struct kv_err *err);
int kv_ggufw_add_u64(struct kv_ggufw *w, const char *key, uint64_t val, struct kv_err *err);
int kv_ggufw_add_i64(struct kv_ggufw *w, const char *key, int64_t val, struct kv_err *err);
int kv_ggufw_add_f64(struct kv_ggufw *w, const char *key, double val, struct kv_err *err);
int kv_ggufw_add_bool(struct kv_ggufw *w, const char *key, int val, struct kv_err *err);
int kv_ggufw_add_arr_str(struct kv_ggufw *w, const char *key, const char *const *vals, uint64_t n,
                         struct kv_err *err);
int kv_ggufw_add_arr_u32(struct kv_ggufw *w, const char *key, const uint32_t *vals, uint64_t n,
                         struct kv_err *err);
int kv_ggufw_add_arr_u64(struct kv_ggufw *w, const char *key, const uint64_t *vals, uint64_t n,
                         struct kv_err *err);

/* A tensor of ggml type ggml_type (F32 = 0, F16 = 1, F64 = 28, ...) with a
 * row-major shape of ndim (1..4) dims; nbytes must equal the element count
 * times the element size. Names must be unique. */
int kv_ggufw_add_tensor(struct kv_ggufw *w, const char *name, uint32_t ggml_type, int ndim,
                        const int64_t *shape, const void *data, uint64_t nbytes,
                        struct kv_err *err);

/* Writes bytes [off, off + n) of a generated tensor's data into out. */
typedef void (*kv_ggufw_gen_fn)(void *ctx, uint64_t off, void *out, uint64_t n);

/* A tensor as kv_ggufw_add_tensor, whose nbytes of data gen produces while
 * the file is written, in pieces of any size and offset, in order; ctx must
 * outlive kv_ggufw_write. */
int kv_ggufw_add_tensor_gen(struct kv_ggufw *w, const char *name, uint32_t ggml_type, int ndim,
                            const int64_t *shape, uint64_t nbytes, kv_ggufw_gen_fn gen, void *ctx,
                            struct kv_err *err);

/* Write the file atomically (see above). Errors are KV_EIO naming path. */
int kv_ggufw_write(struct kv_ggufw *w, const char *path, struct kv_err *err);

#endif
