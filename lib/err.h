/* Error record helpers (internal). The public types live in kvcal_core.h. */
#ifndef KV_ERR_H
#define KV_ERR_H
#include "kvcal_core.h"

#ifdef __cplusplus /* the CUDA backend (kernels/kvrt_cuda.cu) is C++ */
extern "C" {
#define KV_NORETURN [[noreturn]]
#else
#define KV_NORETURN _Noreturn
#endif

/* Prefix err's message with "ctx: " when rc is an error; returns rc. */
int kv_err_in(int rc, struct kv_err *err, const char *ctx);

/* Record an error; returns code so callers can `return kv_fail(...)`. */
int kv_fail_at(struct kv_err *err, int code, const char *path, uint64_t off,
               const char *src_file, int src_line, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
#define kv_fail(err, code, path, off, ...)                                     \
    kv_fail_at((err), (code), (path), (off), __FILE__, __LINE__, __VA_ARGS__)

/* Always-on assertion for programmer errors (never for file contents). */
#define KV_ASSERT(c)                                                           \
    do {                                                                       \
        if (!(c)) kv_assert_fail(#c, __FILE__, __LINE__);                      \
    } while (0)

KV_NORETURN void kv_assert_fail(const char *expr, const char *file, int line);

/* The shortest %g form of v that reads back as v, in buf (for messages and
 * metadata: 1.0000001 stays 1.0000001, not %g's 1); returns buf. */
const char *kv_num_str(char *buf, size_t cap, double v);
/* For a float: %g's six digits, or more until it reads back as that float
 * (1e-05, not the 9.99999975e-06 of its double; 10000, not 1e+04). */
const char *kv_float_str(char *buf, size_t cap, float v);

/* Checked arithmetic on sizes read from files: return 0 on overflow. */
static inline int kv_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static inline int kv_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

#ifdef __cplusplus
}
#endif
#endif
