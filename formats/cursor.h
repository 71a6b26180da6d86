/* Bounded little-endian cursor over untrusted bytes.
 *
 * Every read checks the bytes left and, on failure, records a KV_EFORMAT
 * error naming the path and the offset where the read started. Values are
 * decoded byte by byte; file bytes are never cast onto structs. */
#ifndef KV_CURSOR_H
#define KV_CURSOR_H

#include <string.h>

#include "err.h"

struct kv_cursor {
    const uint8_t *base;  /* start of the buffer (offset 0) */
    uint64_t len;         /* total bytes */
    uint64_t pos;         /* current offset */
    const char *path;     /* for messages */
    struct kv_err *err;
};

static inline void kv_cur_init(struct kv_cursor *c, const void *buf, uint64_t len,
                               const char *path, struct kv_err *err) {
    c->base = (const uint8_t *)buf;
    c->len = len;
    c->pos = 0;
    c->path = path;
    c->err = err;
}

static inline uint64_t kv_cur_left(const struct kv_cursor *c) { return c->len - c->pos; }

/* Fail with "truncated: need N bytes for WHAT, have M" at the current offset. */
static inline int kv_cur_need(struct kv_cursor *c, uint64_t n, const char *what) {
    if (n <= kv_cur_left(c)) return KV_OK;
    return kv_fail(c->err, KV_EFORMAT, c->path, c->pos,
                   "truncated: need %llu bytes for %s, have %llu", (unsigned long long)n, what,
                   (unsigned long long)kv_cur_left(c));
}

static inline int kv_cur_u8(struct kv_cursor *c, uint8_t *v, const char *what) {
    int rc = kv_cur_need(c, 1, what);
    if (rc) return rc;
    *v = c->base[c->pos++];
    return KV_OK;
}

static inline uint32_t kv_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t kv_le64(const uint8_t *p) {
    return (uint64_t)kv_le32(p) | (uint64_t)kv_le32(p + 4) << 32;
}

static inline int kv_cur_u16(struct kv_cursor *c, uint16_t *v, const char *what) {
    int rc = kv_cur_need(c, 2, what);
    if (rc) return rc;
    *v = (uint16_t)(c->base[c->pos] | c->base[c->pos + 1] << 8);
    c->pos += 2;
    return KV_OK;
}
static inline int kv_cur_u32(struct kv_cursor *c, uint32_t *v, const char *what) {
    int rc = kv_cur_need(c, 4, what);
    if (rc) return rc;
    *v = kv_le32(c->base + c->pos);
    c->pos += 4;
    return KV_OK;
}
static inline int kv_cur_u64(struct kv_cursor *c, uint64_t *v, const char *what) {
    int rc = kv_cur_need(c, 8, what);
    if (rc) return rc;
    *v = kv_le64(c->base + c->pos);
    c->pos += 8;
    return KV_OK;
}
static inline int kv_cur_i32(struct kv_cursor *c, int32_t *v, const char *what) {
    uint32_t u;
    int rc = kv_cur_u32(c, &u, what);
    if (!rc) memcpy(v, &u, 4);
    return rc;
}
static inline int kv_cur_f32(struct kv_cursor *c, float *v, const char *what) {
    uint32_t u;
    int rc = kv_cur_u32(c, &u, what);
    if (!rc) memcpy(v, &u, 4);
    return rc;
}
static inline int kv_cur_f64(struct kv_cursor *c, double *v, const char *what) {
    uint64_t u;
    int rc = kv_cur_u64(c, &u, what);
    if (!rc) memcpy(v, &u, 8);
    return rc;
}
/* Borrow n bytes in place (no copy). */
static inline int kv_cur_bytes(struct kv_cursor *c, uint64_t n, const uint8_t **p,
                               const char *what) {
    int rc = kv_cur_need(c, n, what);
    if (rc) return rc;
    *p = c->base + c->pos;
    c->pos += n;
    return KV_OK;
}
static inline int kv_cur_skip(struct kv_cursor *c, uint64_t n, const char *what) {
    const uint8_t *p;
    return kv_cur_bytes(c, n, &p, what);
}

#endif
