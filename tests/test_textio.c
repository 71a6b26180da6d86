/* Text (.txt/.gz) and token-file readers. */
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "testutil.h"

static char *gzip_bytes(const char *s, size_t len, size_t *out_len) {
    z_stream zs = {0};
    deflateInit2(&zs, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
    size_t cap = deflateBound(&zs, len) + 64;
    char *out = malloc(cap);
    zs.next_in = (Bytef *)s;
    zs.avail_in = (uInt)len;
    zs.next_out = (Bytef *)out;
    zs.avail_out = (uInt)cap;
    cr_assert_eq(deflate(&zs, Z_FINISH), Z_STREAM_END);
    *out_len = zs.total_out;
    deflateEnd(&zs);
    return out;
}

Test(textio, reads_plain_and_gzip_identically) {
    const char *s = "Once upon a time\nthere was a tree.\n";
    char *p = kvt_write_temp(s, strlen(s), ".txt");
    size_t gl;
    char *gz = gzip_bytes(s, strlen(s), &gl);
    char *pg = kvt_write_temp(gz, gl, ".gz");
    char *a, *b;
    size_t la, lb;
    struct kv_err err;
    cr_assert_eq(kv_text_read(p, &a, &la, &err), KV_OK);
    cr_assert_eq(kv_text_read(pg, &b, &lb, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(la, strlen(s));
    cr_assert_eq(lb, la);
    cr_assert_str_eq(a, s);
    cr_assert_str_eq(b, s);
    free(a), free(b), free(gz), unlink(p), unlink(pg), free(p), free(pg);
}

Test(textio, large_gzip_grows_its_buffer) {
    size_t n = 3 << 20;
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++) s[i] = 'a'; /* compresses ~1000x: exceeds the first guess */
    s[n] = 0;
    size_t gl;
    char *gz = gzip_bytes(s, n, &gl);
    char *pg = kvt_write_temp(gz, gl, ".gz");
    char *b;
    size_t lb;
    struct kv_err err;
    cr_assert_eq(kv_text_read(pg, &b, &lb, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(lb, n);
    cr_assert_eq(memcmp(b, s, n), 0);
    free(b), free(s), free(gz), unlink(pg), free(pg);
}

Test(textio, truncated_gzip_is_an_error) {
    const char *s = "The quick brown fox jumps over the lazy dog, again and again and again.";
    size_t gl;
    char *gz = gzip_bytes(s, strlen(s), &gl);
    char *pg = kvt_write_temp(gz, gl / 2, ".gz");
    char *b;
    size_t lb;
    struct kv_err err;
    cr_assert_eq(kv_text_read(pg, &b, &lb, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "gzip: truncated stream");
    cr_assert_eq(err.off, gl / 2);
    free(gz), unlink(pg), free(pg);
}

Test(textio, missing_file_names_the_path) {
    char *b;
    size_t lb;
    struct kv_err err;
    cr_assert_eq(kv_text_read("/nonexistent/x.txt", &b, &lb, &err), KV_EIO);
    char buf[512];
    kv_err_format(&err, buf, sizeof buf, 0);
    cr_assert_str_eq(buf, "/nonexistent/x.txt: cannot open: no such file or directory");
}

Test(textio, token_files_are_little_endian_u32_and_checked) {
    uint8_t raw[12] = {1, 0, 0, 0, 0x2c, 0x01, 0, 0, 7, 0, 0, 0};
    char *p = kvt_write_temp(raw, sizeof raw, ".bin");
    int32_t *ids;
    int64_t n;
    struct kv_err err;
    cr_assert_eq(kv_tokens_read(p, &ids, &n, 512, &err), KV_OK);
    cr_assert_eq(n, 3);
    cr_assert_eq(ids[0], 1);
    cr_assert_eq(ids[1], 300);
    cr_assert_eq(ids[2], 7);
    free(ids);
    cr_assert_eq(kv_tokens_read(p, &ids, &n, 256, &err), KV_EFORMAT);
    cr_assert_eq(err.off, 4);
    cr_assert_str_eq(err.msg, "token id 300 is outside the vocabulary of 256");
    unlink(p), free(p);
    p = kvt_write_temp(raw, 7, ".bin");
    cr_assert_eq(kv_tokens_read(p, &ids, &n, 512, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "token file is 7 bytes, not a multiple of 4 (little-endian uint32 ids)");
    unlink(p), free(p);
}
