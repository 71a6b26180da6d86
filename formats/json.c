#include "json.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "limits.h"
#include "mapfile.h"

void kv_json_error_text(const json_error_t *je, char *out, size_t cap) {
    size_t i = 0;
    for (; i + 1 < cap && je->text[i]; i++) out[i] = (char)tolower((unsigned char)je->text[i]);
    out[i] = 0;
}

static int parse_flags(const char *buf, size_t len, const char *path, uint64_t base_off,
                       size_t flags, json_t **out, struct kv_err *err) {
    json_error_t je;
    memset(&je, 0, sizeof je);
    json_t *j = json_loadb(len ? buf : "", len, JSON_REJECT_DUPLICATES | flags, &je);
    if (!j) {
        /* jansson capitalises some words (JSON_ALLOW_NUL); our lines are lowercase. */
        char text[sizeof je.text];
        kv_json_error_text(&je, text, sizeof text);
        uint64_t pos = je.position > 0 ? (uint64_t)je.position : 0;
        if (pos > len) pos = len;
        return kv_fail(err, KV_EFORMAT, path, base_off + pos, "invalid json: %s", text);
    }
    *out = j;
    return KV_OK;
}

int kv_json_parse(const char *buf, size_t len, const char *path, uint64_t base_off,
                  json_t **out, struct kv_err *err) {
    return parse_flags(buf, len, path, base_off, 0, out, err);
}

static int load_flags(const char *path, size_t flags, json_t **out, struct kv_err *err) {
    struct kv_map m;
    int rc = kv_map_open(path, &m, err);
    if (rc) return rc;
    if (m.len > KV_MAX_JSON_BYTES) {
        kv_map_close(&m);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "file is %llu bytes, above the json limit of %llu",
                       (unsigned long long)m.len, (unsigned long long)KV_MAX_JSON_BYTES);
    }
    rc = parse_flags((const char *)m.data, (size_t)m.len, path, 0, flags, out, err);
    kv_map_close(&m);
    return rc;
}

int kv_json_load(const char *path, json_t **out, struct kv_err *err) {
    return load_flags(path, 0, out, err);
}

int kv_json_load_reals(const char *path, json_t **out, struct kv_err *err) {
    return load_flags(path, JSON_DECODE_INT_AS_REAL, out, err);
}

const char *kv_json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "real";
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

void kv_json_repr(const json_t *v, char *buf, size_t cap) {
    KV_ASSERT(cap >= 8);
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT | JSON_REAL_PRECISION(10));
    if (!s) {
        snprintf(buf, cap, "a %s", kv_json_type_name(v));
        return;
    }
    size_t n = strlen(s);
    if (n < cap) {
        memcpy(buf, s, n + 1);
    } else {
        memcpy(buf, s, cap - 4);
        memcpy(buf + cap - 4, "...", 4);
    }
    free(s);
}

/* Member lookup shared by the getters: *v is NULL when absent (or null) and
 * optional; an absent required key is an error. */
static int member(const json_t *obj, const char *key, const char *path, int required,
                  json_t **v, struct kv_err *err) {
    *v = json_is_object(obj) ? json_object_get(obj, key) : NULL;
    if (*v && json_is_null(*v)) *v = NULL;
    if (*v || !required) return KV_OK;
    return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "missing key '%s'", key);
}

int kv_json_get_int(const json_t *obj, const char *key, const char *path, int64_t lo,
                    int64_t hi, int required, int64_t *out, struct kv_err *err) {
    json_t *v;
    int rc = member(obj, key, path, required, &v, err);
    if (rc || !v) return rc;
    const char *want = lo == 1 ? "a positive integer" : lo == 0 ? "a non-negative integer" : NULL;
    if (!json_is_integer(v) || json_integer_value(v) < lo) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        if (want)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key '%s' must be %s, found %s",
                           key, want, found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key '%s' must be an integer in %lld..%lld, found %s", key, (long long)lo,
                       (long long)hi, found);
    }
    json_int_t x = json_integer_value(v);
    if (x > hi)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key '%s' is %lld, above the limit %lld",
                       key, (long long)x, (long long)hi);
    *out = (int64_t)x;
    return KV_OK;
}

int kv_json_get_num(const json_t *obj, const char *key, const char *path, int positive,
                    int required, double *out, struct kv_err *err) {
    json_t *v;
    int rc = member(obj, key, path, required, &v, err);
    if (rc || !v) return rc;
    double x = json_is_number(v) ? json_number_value(v) : NAN;
    if (!isfinite(x) || (positive && !(x > 0))) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key '%s' must be %s, found %s", key,
                       positive ? "a positive number" : "a number", found);
    }
    *out = x;
    return KV_OK;
}

int kv_json_get_str(const json_t *obj, const char *key, const char *path, int required,
                    const char **out, struct kv_err *err) {
    json_t *v;
    int rc = member(obj, key, path, required, &v, err);
    if (rc || !v) return rc;
    if (!json_is_string(v)) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key '%s' must be a string, found %s",
                       key, found);
    }
    *out = json_string_value(v);
    return KV_OK;
}

int kv_json_get_bool(const json_t *obj, const char *key, const char *path, int required,
                     int *out, struct kv_err *err) {
    json_t *v;
    int rc = member(obj, key, path, required, &v, err);
    if (rc || !v) return rc;
    if (!json_is_boolean(v)) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key '%s' must be true or false, found %s", key, found);
    }
    *out = json_is_true(v);
    return KV_OK;
}

char *kv_utf8_repair(const char *s) {
    size_t n = strlen(s), o = 0;
    char *buf = malloc(3 * n + 1);
    if (!buf) return NULL;
    for (size_t i = 0; i < n;) {
        size_t k = 1; /* the shortest prefix jansson's UTF-8 check accepts */
        for (; k <= 4 && i + k <= n; k++) {
            json_t *t = json_stringn(s + i, k);
            if (t) {
                json_decref(t);
                break;
            }
        }
        if (k <= 4 && i + k <= n) {
            memcpy(buf + o, s + i, k);
            o += k;
            i += k;
        } else {
            memcpy(buf + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    buf[o] = 0;
    return buf;
}
