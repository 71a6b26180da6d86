/* Plain and gzip text, and little-endian uint32 token files. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "err.h"
#include "mapfile.h"

/* zlib counts in uInt: feed and drain at most this much per call. */
#define ZCHUNK ((size_t)1 << 30)

static int gunzip(const struct kv_map *mp, const char *path, char **out, size_t *len,
                  struct kv_err *err) {
    size_t cap = (size_t)mp->len * 4 + 4096, n = 0, in_pos = 0;
    char *buf = malloc(cap);
    if (!buf) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, 15 + 32) != Z_OK) { /* +32: detect the gzip header */
        free(buf);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "cannot start the gzip decoder");
    }
    int rc = KV_OK;
    for (;;) {
        if (zs.avail_in == 0 && in_pos < mp->len) {
            size_t chunk = mp->len - in_pos < ZCHUNK ? (size_t)(mp->len - in_pos) : ZCHUNK;
            zs.next_in = (Bytef *)mp->data + in_pos;
            zs.avail_in = (uInt)chunk;
            in_pos += chunk;
        }
        if (cap - n < 65536) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t room = cap - n - 1 < ZCHUNK ? cap - n - 1 : ZCHUNK;
        zs.next_out = (Bytef *)buf + n;
        zs.avail_out = (uInt)room;
        int zr = inflate(&zs, Z_NO_FLUSH);
        n += room - zs.avail_out;
        uint64_t consumed = in_pos - zs.avail_in;
        if (zr == Z_STREAM_END) {
            if (consumed == mp->len) break;
            inflateReset(&zs); /* another gzip member follows */
            continue;
        }
        if (zr == Z_BUF_ERROR && consumed == mp->len) {
            rc = kv_fail(err, KV_EFORMAT, path, mp->len, "gzip: truncated stream");
            break;
        }
        if (zr != Z_OK && zr != Z_BUF_ERROR) {
            rc = kv_fail(err, KV_EFORMAT, path, consumed, "gzip: %s",
                         zr == Z_MEM_ERROR ? "out of memory" : zs.msg ? zs.msg : "corrupt data");
            break;
        }
    }
    inflateEnd(&zs);
    if (rc) {
        free(buf);
        return rc;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return KV_OK;
}

int kv_text_read(const char *path, char **out, size_t *len, struct kv_err *err) {
    struct kv_map mp;
    int rc = kv_map_open(path, &mp, err);
    if (rc) return rc;
    if (mp.len >= 2 && mp.data[0] == 0x1f && mp.data[1] == 0x8b) {
        rc = gunzip(&mp, path, out, len, err);
        kv_map_close(&mp);
        return rc;
    }
    char *buf = malloc((size_t)mp.len + 1);
    if (!buf) {
        kv_map_close(&mp);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
    }
    if (mp.len) memcpy(buf, mp.data, (size_t)mp.len);
    buf[mp.len] = 0;
    *out = buf;
    *len = (size_t)mp.len;
    kv_map_close(&mp);
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
