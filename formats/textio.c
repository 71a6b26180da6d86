/* Plain and gzip text, and little-endian uint32 token files. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "err.h"
#include "mapfile.h"

int kv_text_read(const char *path, char **out, size_t *len, struct kv_err *err) {
    struct kv_map mp;
    int rc = kv_map_open(path, &mp, err);
    if (rc) return rc;
    int gz = mp.len >= 2 && mp.data[0] == 0x1f && mp.data[1] == 0x8b;
    size_t cap = gz ? (size_t)mp.len * 4 + 4096 : (size_t)mp.len + 1, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        kv_map_close(&mp);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
    }
    if (!gz) {
        if (mp.len) memcpy(buf, mp.data, (size_t)mp.len);
        n = (size_t)mp.len;
    } else {
        z_stream zs;
        memset(&zs, 0, sizeof zs);
        if (inflateInit2(&zs, 15 + 32) != Z_OK) { /* +32: gzip header, concatenated members */
            free(buf);
            kv_map_close(&mp);
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "cannot start gzip decoder");
        }
        zs.next_in = (Bytef *)mp.data;
        zs.avail_in = (uInt)mp.len;
        for (;;) {
            if (cap - n < 65536) {
                char *nb = realloc(buf, cap * 2);
                if (!nb) {
                    inflateEnd(&zs);
                    free(buf);
                    kv_map_close(&mp);
                    return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
                }
                buf = nb;
                cap *= 2;
            }
            zs.next_out = (Bytef *)buf + n;
            zs.avail_out = (uInt)(cap - n - 1);
            int zr = inflate(&zs, Z_NO_FLUSH);
            n = cap - 1 - zs.avail_out;
            if (zr == Z_STREAM_END) {
                if (zs.avail_in == 0) break;
                inflateReset(&zs); /* another gzip member follows */
                continue;
            }
            if (zr != Z_OK && zr != Z_BUF_ERROR) {
                uint64_t off = (uint64_t)(zs.total_in);
                const char *zm = zs.msg ? zs.msg : "corrupt data";
                char msg[256];
                snprintf(msg, sizeof msg, "%s", zm);
                inflateEnd(&zs);
                free(buf);
                kv_map_close(&mp);
                return kv_fail(err, KV_EFORMAT, path, off, "gzip: %s", msg);
            }
            if (zr == Z_BUF_ERROR && zs.avail_in == 0) {
                uint64_t off = mp.len;
                inflateEnd(&zs);
                free(buf);
                kv_map_close(&mp);
                return kv_fail(err, KV_EFORMAT, path, off, "gzip: truncated stream");
            }
        }
        inflateEnd(&zs);
    }
    kv_map_close(&mp);
    buf[n] = 0;
    *out = buf;
    *len = n;
    return KV_OK;
}

int kv_tokens_read(const char *path, int32_t **ids, int64_t *n, int32_t n_vocab,
                   struct kv_err *err) {
    struct kv_map mp;
    int rc = kv_map_open(path, &mp, err);
    if (rc) return rc;
    if (mp.len % 4) {
        uint64_t len = mp.len;
        kv_map_close(&mp);
        return kv_fail(err, KV_EFORMAT, path, len - len % 4,
                       "token file is %llu bytes, not a multiple of 4 (little-endian uint32 ids)",
                       (unsigned long long)len);
    }
    int64_t cnt = (int64_t)(mp.len / 4);
    int32_t *v = malloc((size_t)(cnt ? cnt : 1) * sizeof *v);
    if (!v) {
        kv_map_close(&mp);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    for (int64_t i = 0; i < cnt; i++) {
        const uint8_t *p = mp.data + 4 * i;
        uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        if (n_vocab > 0 && u >= (uint32_t)n_vocab) {
            kv_map_close(&mp);
            free(v);
            return kv_fail(err, KV_EFORMAT, path, (uint64_t)(4 * i),
                           "token id %u is outside the vocabulary of %d", u, n_vocab);
        }
        v[i] = (int32_t)u;
    }
    kv_map_close(&mp);
    *ids = v;
    *n = cnt;
    return KV_OK;
}
