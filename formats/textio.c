/* Plain and gzip text, and little-endian uint32 token files. */
#include <errno.h>
#include <nettle/sha2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "err.h"
#include "mapfile.h"

/* Raw bytes read from the file at a time. */
#define SRC_IN ((size_t)1 << 20)

struct kv_text_src {
    char *path;
    int fd;
    uint64_t size, raw_pos; /* raw_pos: file bytes read (and hashed) so far */
    uint64_t text_pos;      /* text bytes handed out */
    int gz, zinit, done;
    z_stream zs;
    unsigned char *in; /* gzip input */
    struct sha256_ctx sha;
};

void kv_text_src_close(struct kv_text_src *s) {
    if (!s) return;
    if (s->zinit) inflateEnd(&s->zs);
    if (s->fd >= 0) close(s->fd);
    free(s->in);
    free(s->path);
    free(s);
}

int kv_text_src_open(const char *path, struct kv_text_src **out, struct kv_err *err) {
    *out = NULL;
    uint64_t size = 0;
    int fd = kv_open_regular(path, &size, err);
    if (fd < 0) return KV_EIO;
    struct kv_text_src *s = calloc(1, sizeof *s);
    if (!s || !(s->path = strdup(path))) {
        close(fd);
        free(s);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
    }
    s->fd = fd;
    s->size = size;
    sha256_init(&s->sha);
    unsigned char magic[2];
    ssize_t got;
    do got = pread(fd, magic, 2, 0);
    while (got < 0 && errno == EINTR);
    if (got == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
        s->gz = 1;
        s->in = malloc(SRC_IN);
        if (!s->in || inflateInit2(&s->zs, 15 + 32) != Z_OK) { /* +32: the gzip header */
            kv_text_src_close(s);
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "cannot start the gzip decoder");
        }
        s->zinit = 1;
    }
    *out = s;
    return KV_OK;
}

/* Up to cap raw bytes of the file into buf, hashed; *n 0 at its end. */
static int raw_read(struct kv_text_src *s, void *buf, size_t cap, size_t *n, struct kv_err *err) {
    ssize_t r;
    do r = read(s->fd, buf, cap);
    while (r < 0 && errno == EINTR);
    if (r < 0) {
        char eb[128];
        return kv_fail(err, KV_EIO, s->path, s->raw_pos, "cannot read: %s",
                       kv_errtext(errno, eb, sizeof eb));
    }
    if (r == 0 && s->raw_pos != s->size)
        return kv_fail(err, KV_EIO, s->path, s->raw_pos,
                       "the file shrank while it was read (%llu of %llu bytes)",
                       (unsigned long long)s->raw_pos, (unsigned long long)s->size);
    sha256_update(&s->sha, (size_t)r, buf);
    s->raw_pos += (uint64_t)r;
    *n = (size_t)r;
    return KV_OK;
}

int kv_text_src_read(struct kv_text_src *s, char *buf, size_t cap, size_t *n, struct kv_err *err) {
    *n = 0;
    if (s->done || cap == 0) return KV_OK;
    if (cap > (uInt)-1) cap = (uInt)-1; /* zlib counts in uInt */
    if (!s->gz) {
        int rc = raw_read(s, buf, cap, n, err);
        if (rc) return rc;
        s->done = *n == 0;
        s->text_pos += *n;
        return KV_OK;
    }
    while (*n == 0 && !s->done) {
        if (s->zs.avail_in == 0 && s->raw_pos < s->size) {
            size_t got;
            int rc = raw_read(s, s->in, SRC_IN, &got, err);
            if (rc) return rc;
            s->zs.next_in = s->in;
            s->zs.avail_in = (uInt)got;
        }
        s->zs.next_out = (Bytef *)buf;
        s->zs.avail_out = (uInt)cap;
        int zr = inflate(&s->zs, Z_NO_FLUSH);
        *n = cap - s->zs.avail_out;
        uint64_t consumed = s->raw_pos - s->zs.avail_in;
        if (zr == Z_STREAM_END) {
            if (consumed == s->size) s->done = 1;
            else inflateReset(&s->zs); /* another gzip member follows */
        } else if (zr == Z_BUF_ERROR && consumed == s->size && *n == 0) {
            return kv_fail(err, KV_EFORMAT, s->path, s->size, "gzip: truncated stream");
        } else if (zr != Z_OK && zr != Z_BUF_ERROR) {
            return kv_fail(err, KV_EFORMAT, s->path, consumed, "gzip: %s",
                           zr == Z_MEM_ERROR ? "out of memory" : s->zs.msg ? s->zs.msg : "corrupt data");
        }
    }
    s->text_pos += *n;
    return KV_OK;
}

uint64_t kv_text_src_file_bytes(const struct kv_text_src *s) { return s->size; }

uint64_t kv_text_src_text_bytes(const struct kv_text_src *s) { return s->text_pos; }

int kv_text_src_sha256(struct kv_text_src *s, char hex[65]) {
    if (!s->done) return KV_EINVAL;
    uint8_t d[SHA256_DIGEST_SIZE];
    sha256_digest(&s->sha, sizeof d, d);
    for (int i = 0; i < SHA256_DIGEST_SIZE; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
    return KV_OK;
}

int kv_text_read(const char *path, char **out, size_t *len, struct kv_err *err) {
    struct kv_text_src *s;
    int rc = kv_text_src_open(path, &s, err);
    if (rc) return rc;
    size_t cap = s->gz ? 4 * (size_t)s->size + 4096 : (size_t)s->size + 1, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (buf && cap - n < 65536 && !s->done) {
            char *nb = cap > SIZE_MAX / 2 ? NULL : realloc(buf, cap * 2);
            if (!nb) free(buf);
            buf = nb;
            cap *= 2;
        }
        if (!buf) {
            kv_text_src_close(s);
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
        }
        size_t got;
        if ((rc = kv_text_src_read(s, buf + n, cap - n - 1, &got, err))) break;
        n += got;
        if (got == 0 && s->done) break;
    }
    kv_text_src_close(s);
    if (rc) {
        free(buf);
        return rc;
    }
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
