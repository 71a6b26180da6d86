#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kv_fail_at(struct kv_err *err, int code, const char *path, uint64_t off,
               const char *src_file, int src_line, const char *fmt, ...) {
    if (!err) return code;
    err->code = code;
    err->off = off;
    err->src_file = src_file;
    err->src_line = src_line;
    snprintf(err->path, sizeof err->path, "%s", path ? path : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return code;
}

void kv_err_clear(struct kv_err *err) {
    if (!err) return;
    memset(err, 0, sizeof *err);
    err->off = KV_NO_OFFSET;
}

size_t kv_err_format(const struct kv_err *err, char *buf, size_t cap, int verbose) {
    if (!cap) return 0;
    int n = 0;
    if (err->path[0]) n += snprintf(buf + n, cap - (size_t)n, "%s: ", err->path);
    if ((size_t)n < cap && err->off != KV_NO_OFFSET)
        n += snprintf(buf + n, cap - (size_t)n, "offset %llu: ", (unsigned long long)err->off);
    if ((size_t)n < cap) n += snprintf(buf + n, cap - (size_t)n, "%s", err->msg);
    if (verbose && err->src_file && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, " [%s:%d]", err->src_file, err->src_line);
    return (size_t)n < cap ? (size_t)n : cap - 1;
}

const char *kv_status_name(int code) {
    switch (code) {
    case KV_OK: return "ok";
    case KV_EIO: return "i/o error";
    case KV_EFORMAT: return "format error";
    case KV_EINVAL: return "invalid argument";
    case KV_ENOMEM: return "out of memory";
    case KV_ENUMERIC: return "numerical error";
    case KV_EDEVICE: return "device error";
    case KV_EUNSUPPORTED: return "unsupported";
    default: return "unknown error";
    }
}

_Noreturn void kv_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "kvcal: internal error: assertion '%s' failed at %s:%d\n", expr, file, line);
    abort();
}

/* The shortest %.Pg form of v, P from p0 up, that reads back as v (as a
 * float: as (float)v). */
static const char *shortest(char *buf, size_t cap, double v, int as_float, int p0) {
    for (int p = p0; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, v);
        double back = strtod(buf, NULL);
        if (as_float ? (float)back == (float)v : back == v) break;
    }
    return buf;
}

const char *kv_num_str(char *buf, size_t cap, double v) { return shortest(buf, cap, v, 0, 1); }

const char *kv_float_str(char *buf, size_t cap, float v) { return shortest(buf, cap, (double)v, 1, 6); }

int kv_err_in(int rc, struct kv_err *err, const char *ctx) {
    size_t a = ctx ? strlen(ctx) : 0, cap = sizeof err->msg;
    if (rc && err && a && a + 3 < cap) {
        size_t n = strlen(err->msg);
        if (a + 2 + n >= cap) n = cap - 1 - a - 2;
        memmove(err->msg + a + 2, err->msg, n);
        memcpy(err->msg, ctx, a);
        err->msg[a] = ':', err->msg[a + 1] = ' ', err->msg[a + 2 + n] = 0;
    }
    return rc;
}
