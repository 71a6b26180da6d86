/* Error record helpers. The public types live in kvcal.h. */
#ifndef KV_ERR_H
#define KV_ERR_H
#include "kvcal.h"

/* Always-on assertion for programmer errors (never for file contents). */
#define KV_ASSERT(c)                                                           \
    do {                                                                       \
        if (!(c)) kv_assert_fail(#c, __FILE__, __LINE__);                      \
    } while (0)

_Noreturn void kv_assert_fail(const char *expr, const char *file, int line);

/* Checked arithmetic on sizes read from files: return 0 on overflow. */
static inline int kv_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static inline int kv_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

#endif
