/* A GGUF written by kvcal's writer with one value patched in place, and
 * the check that loading it fails at that value's offset: the corruption
 * tests of the architectures' own keys (test_neox.c, test_gemma2.c,
 * test_ggufmodelw.c). Header-only. */
#ifndef KV_GGUF_PATCH_H
#define KV_GGUF_PATCH_H

#include <stdlib.h>
#include <string.h>

#include "ggufmodelw.h"
#include "kvformats.h"
#include "testutil.h"

/* m written as GGUF with the bytes after key (its u32 type, then the value)
 * patched: value bytes v of n at the value; returns the temporary's path and
 * in *val the value's offset. */
static inline char *patched_gguf(const struct kv_model *m, const char *key, const void *v, size_t n,
                          uint64_t *val) {
    char *dir = kvt_temp_dir(), *path = kvt_path(dir, "m.gguf");
    struct kv_err err = {0};
    cr_assert_eq(kv_gguf_write_model(m, path, NULL, &err), KV_OK, "%s", err.msg);
    size_t len;
    char *b = kvt_read_file(path, &len);
    cr_assert_not_null(b);
    const char *hit = memmem(b, len, key, strlen(key));
    cr_assert_not_null(hit, "no key %s in the written file", key);
    *val = (uint64_t)(hit - b) + strlen(key) + 4;
    memcpy(b + *val, v, n);
    char *out = kvt_write_temp(b, len, ".gguf");
    free(b), free(path);
    kvt_rm_dir(dir);
    return out;
}

static inline void refused_at(const char *path, uint64_t off, const char *msg) {
    struct kv_model *r;
    struct kv_err err = {0};
    cr_assert_neq(kv_model_open(path, NULL, &r, &err), KV_OK, "%s loaded", path);
    cr_assert(strstr(err.msg, msg), "'%s' lacks '%s'", err.msg, msg);
    cr_assert(!strcmp(err.path, path), "the error names %s, not %s", err.path, path);
    cr_assert_eq(err.off, off, "offset %llu, expected %llu", (unsigned long long)err.off,
                 (unsigned long long)off);
}

#endif
