/* safetensors writer (internal).
 *
 * Collects tensor descriptions and __metadata__ pairs in memory, then
 * streams a file in the layout formats/safetensors.h reads:
 *
 *     offset 0   u64 LE   N, a multiple of 8
 *     offset 8   N bytes  compact JSON object, then spaces up to N:
 *                           "__metadata__": {key: value, ...}  only if any,
 *                                                              insertion order
 *                           "<tensor>": {"dtype": "F16", "shape": [...],
 *                                        "data_offsets": [begin, end]}
 *                                                              insertion order
 *     offset 8+N          the data section, 8-byte aligned: each tensor's
 *                         bytes, contiguous in insertion order (the first
 *                         begins at 0, each next at the previous end, no
 *                         padding between), row-major, little-endian
 *
 * Everything the reader would refuse is refused when it is added (KV_EINVAL
 * naming the tensor or key), so a file this writes always parses: non-empty
 * names of at most KV_MAX_NAME_LEN bytes, unique and other than
 * "__metadata__"; valid UTF-8 names, keys and values; 0..KV_MAX_DIMS
 * non-negative dims; nbytes equal to the element count times the dtype size;
 * and a header of at most KV_MAX_ST_HEADER bytes (checked at write). Tensors
 * of zero elements are allowed (their data may be NULL).
 *
 * kv_stw_write writes PATH.tmp, fsyncs it, renames it over PATH and fsyncs
 * the directory (kv_write_atomic), so PATH is always either the old or the
 * new file. */
#ifndef KV_STWRITE_H
#define KV_STWRITE_H

#include <stddef.h>
#include <stdint.h>

#include "kvformats.h"

struct kv_stw;

/* New empty writer in *out; release with kv_stw_free. Errors: KV_ENOMEM. */
int kv_stw_init(struct kv_stw **out, struct kv_err *err);
/* Free the writer and the buffers it owns (not borrowed data). NULL is a
 * no-op. */
void kv_stw_free(struct kv_stw *w);

/* A __metadata__ string pair; both are copied. Keys must be unique.
 * Errors: KV_EINVAL, KV_ENOMEM. */
int kv_stw_add_meta(struct kv_stw *w, const char *key, const char *val, struct kv_err *err);

/* A tensor of dtype with a row-major shape of ndim (0..4) dims. data is
 * borrowed: it must stay valid until kv_stw_write returns. nbytes must equal
 * the element count times kv_dtype_size(dtype). Errors: KV_EINVAL naming the
 * tensor, KV_ENOMEM. */
int kv_stw_add(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
               const int64_t *shape, const void *data, uint64_t nbytes, struct kv_err *err);

/* Produces n bytes of a tensor's data starting at byte off into out (off
 * and n are multiples of 1 MiB but for the last piece); returns KV_OK or an
 * error recorded in err, which ends the write. */
typedef int (*kv_stw_fill_fn)(void *ctx, uint64_t off, uint64_t n, void *out, struct kv_err *err);

/* A tensor whose bytes fill produces while the file is written, a piece at
 * a time (for data too large to hold: a streamed model's weights). ctx
 * must stay valid until kv_stw_write returns. Errors as kv_stw_add. */
int kv_stw_add_fn(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                  const int64_t *shape, kv_stw_fill_fn fill, void *ctx, struct kv_err *err);

/* As kv_stw_add_fn, with ctx_size bytes of ctx copied into memory the
 * writer owns (freed by kv_stw_free), so ctx need not outlive the call.
 * Errors as kv_stw_add. */
int kv_stw_add_fn_copy(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                       const int64_t *shape, kv_stw_fill_fn fill, const void *ctx,
                       size_t ctx_size, struct kv_err *err);

/* As kv_stw_add, from f32 values converted to dtype (F32, F16 or BF16,
 * rounding to nearest even) into a buffer the writer owns, so data need not
 * outlive the call. Errors: KV_EINVAL (also for another dtype), KV_ENOMEM. */
int kv_stw_add_f32(struct kv_stw *w, const char *name, enum kv_dtype dtype, int ndim,
                   const int64_t *shape, const float *data, struct kv_err *err);

/* Write the file atomically (see above). The writer is unchanged and may be
 * written again. Errors: KV_EIO naming path, KV_EINVAL (header too large),
 * KV_ENOMEM. */
int kv_stw_write(struct kv_stw *w, const char *path, struct kv_err *err);

/* Copy the file src byte for byte to dst atomically (dst.tmp, fsync, rename,
 * directory fsync); dst may be src itself, but src may not be dst.tmp.
 * Errors: KV_EIO naming src (cannot open or read it, or it is a directory)
 * or dst (cannot write it), KV_EINVAL (src is dst.tmp), KV_ENOMEM. */
int kv_file_copy(const char *src, const char *dst, struct kv_err *err);

#endif
