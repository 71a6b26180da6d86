/* safetensors writer (suite stw): everything it writes is read back with the
 * safetensors parser and compared byte for byte. The f32 to f16/bf16
 * encoders are test_f16.c's. */
#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model.h"
#include "safetensors.h"
#include "err.h"
#include "stwrite.h"
#include "mapfile.h"
#include "testutil.h"
#include "xorshift64.h"

static const char *fmt_err(const struct kv_err *e) {
    static char buf[2048];
    kv_err_format(e, buf, sizeof buf, 0);
    return buf;
}

static uint64_t rd64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static int exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static char *tmp_of(const char *path) {
    size_t n = strlen(path) + 5;
    char *t = malloc(n);
    snprintf(t, n, "%s.tmp", path);
    return t;
}

static struct kv_stw *new_writer(void) {
    struct kv_stw *w = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stw_init(&w, &err), KV_OK);
    cr_assert_not_null(w);
    return w;
}

static void expect_err(int rc, const struct kv_err *err, int code, const char *needle) {
    cr_assert_eq(rc, code, "rc %d (%s), expected %d: %s", rc, kv_status_name(rc), code,
                 fmt_err(err));
    cr_assert_eq(err->code, code);
    cr_assert(strstr(err->msg, needle), "message '%s' lacks '%s'", err->msg, needle);
}

static void fill_random(void *p, size_t n, uint64_t seed) {
    uint8_t *b = p;
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(rng_next(&s) >> 56);
}

/* ------------------------------------------------------------ round trip */

struct tspec {
    const char *name;
    enum kv_dtype dtype;
    int ndim;
    int64_t shape[4];
};

/* Two or more of each dtype asked for, odd byte sizes (so later tensors sit
 * at unaligned offsets), a scalar, zero-element tensors back to back, a 4-d
 * one, and one (2 MiB) larger than the writer's staging buffer. */
static const struct tspec specs[] = {
    {"model.layers.0.k.f32", KV_DTYPE_F32, 2, {3, 5}},
    {"odd.f16", KV_DTYPE_F16, 1, {7}},
    {"w.bf16", KV_DTYPE_BF16, 3, {2, 3, 3}},
    {"cov.f64", KV_DTYPE_F64, 2, {4, 4}},
    {"ids.i64", KV_DTYPE_I64, 1, {5}},
    {"scalar.f32", KV_DTYPE_F32, 0, {0}},
    {"empty.f16", KV_DTYPE_F16, 2, {0, 3}},
    {"empty.i64", KV_DTYPE_I64, 1, {0}},
    {"four.f16", KV_DTYPE_F16, 4, {2, 1, 3, 2}},
    {"b.bf16", KV_DTYPE_BF16, 1, {9}},
    {"b.f64", KV_DTYPE_F64, 3, {1, 2, 3}},
    {"b.i64", KV_DTYPE_I64, 2, {2, 2}},
    {"big.f32", KV_DTYPE_F32, 2, {512, 1024}},
    {"tail.f16", KV_DTYPE_F16, 1, {1}},
};
#define N_SPECS (int)(sizeof specs / sizeof specs[0])

static uint64_t spec_bytes(const struct tspec *s) {
    uint64_t n = kv_dtype_size(s->dtype);
    for (int d = 0; d < s->ndim; d++) n *= (uint64_t)s->shape[d];
    return n;
}

static const char *const meta[][2] = {
    {"format", "pt"},
    {"kvcal.rank", "16"},
    {"note", "caf\xc3\xa9 \"quoted\" \\ \xe2\x9c\x93\nnew line"},
    {"empty", ""},
};
#define N_META (int)(sizeof meta / sizeof meta[0])

/* Check a parsed file holds specs[] with data[] and meta[], in order. */
static void check_parsed(const struct kv_st_file *f, uint8_t *const *data, uint64_t file_len) {
    cr_assert_eq(f->n_tensors, N_SPECS);
    cr_assert_eq(f->header_len % 8, 0, "header length %llu", (unsigned long long)f->header_len);
    cr_assert_eq(f->data_start % 8, 0);
    uint64_t at = f->data_start;
    for (int i = 0; i < N_SPECS; i++) {
        const struct tspec *s = &specs[i];
        /* sorted by offset == insertion order, contiguous */
        const struct kv_tensor *t = &f->tensors[i];
        cr_assert_str_eq(t->name, s->name, "tensor %d", i);
        cr_assert_eq(kv_st_find(f, s->name), t);
        cr_assert_eq(t->dtype, s->dtype, "%s dtype", s->name);
        cr_assert_eq(t->ndim, s->ndim, "%s ndim", s->name);
        for (int d = 0; d < s->ndim; d++) cr_assert_eq(t->shape[d], s->shape[d], "%s dim %d", s->name, d);
        cr_assert_eq(t->nbytes, spec_bytes(s), "%s nbytes", s->name);
        cr_assert_eq(t->offset, at, "%s at %llu, expected %llu", s->name,
                     (unsigned long long)t->offset, (unsigned long long)at);
        if (t->nbytes) cr_assert(!memcmp(t->data, data[i], t->nbytes), "%s data differs", s->name);
        at += t->nbytes;
    }
    cr_assert_eq(at, file_len);
    cr_assert_eq(f->n_meta, N_META);
    for (int i = 0; i < N_META; i++) {
        cr_assert_str_eq(f->meta_keys[i], meta[i][0], "metadata %d", i);
        cr_assert_str_eq(f->meta_vals[i], meta[i][1], "metadata '%s'", meta[i][0]);
    }
}

Test(stw, round_trips_every_dtype_shape_and_metadata) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = new_writer();
    uint8_t *data[N_SPECS];
    for (int i = 0; i < N_SPECS; i++) {
        uint64_t n = spec_bytes(&specs[i]);
        data[i] = n ? malloc(n) : NULL;
        if (n) fill_random(data[i], n, (uint64_t)i + 1);
        cr_assert_eq(kv_stw_add(w, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape,
                                data[i], n, &err),
                     KV_OK, "%s: %s", specs[i].name, fmt_err(&err));
        /* metadata interleaved with tensors still comes out first, in order */
        if (i < N_META)
            cr_assert_eq(kv_stw_add_meta(w, meta[i][0], meta[i][1], &err), KV_OK, "%s",
                         fmt_err(&err));
    }
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "out.safetensors");
    cr_assert_eq(kv_stw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);

    size_t len = 0;
    uint8_t *bytes = (uint8_t *)kvt_read_file(path, &len);
    cr_assert_not_null(bytes);
    uint64_t hlen = rd64(bytes);
    cr_assert_eq(hlen % 8, 0);
    const char *hdr = (const char *)bytes + 8;
    cr_assert(!strncmp(hdr, "{\"__metadata__\":{\"format\":\"pt\"", 30), "header starts '%.40s'",
              hdr);

    struct kv_st_file pf;
    cr_assert_eq(kv_st_parse(bytes, len, path, &pf, &err), KV_OK, "%s", fmt_err(&err));
    check_parsed(&pf, data, len);
    kv_st_clear(&pf);

    struct kv_st_file *f = NULL;
    cr_assert_eq(kv_st_open(path, &f, &err), KV_OK, "%s", fmt_err(&err));
    check_parsed(f, data, len);
    kv_st_close(f);

    /* the writer is unchanged by writing: a second file is identical */
    char *path2 = kvt_path(dir, "again.safetensors");
    cr_assert_eq(kv_stw_write(w, path2, &err), KV_OK, "%s", fmt_err(&err));
    size_t len2 = 0;
    char *bytes2 = kvt_read_file(path2, &len2);
    cr_assert(len2 == len && !memcmp(bytes, bytes2, len), "second write differs");

    kv_stw_free(w);
    for (int i = 0; i < N_SPECS; i++) free(data[i]);
    free(bytes);
    free(bytes2);
    unlink(path);
    unlink(path2);
    rmdir(dir);
    free(path);
    free(path2);
    free(tmp);
    free(dir);
}

Test(stw, header_is_json_padded_with_spaces_to_a_multiple_of_8) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "pad.safetensors");
    /* names of 1..16 bytes move the JSON length through every residue mod 8 */
    int residues = 0;
    for (int nlen = 1; nlen <= 16; nlen++) {
        char name[17];
        memset(name, 'a' + nlen, (size_t)nlen);
        name[nlen] = 0;
        int16_t v[3] = {1, -2, 3};
        int64_t shape[1] = {3};
        struct kv_stw *w = new_writer();
        cr_assert_eq(kv_stw_add(w, name, KV_DTYPE_I16, 1, shape, v, sizeof v, &err), KV_OK);
        cr_assert_eq(kv_stw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
        kv_stw_free(w);

        size_t len = 0;
        uint8_t *b = (uint8_t *)kvt_read_file(path, &len);
        uint64_t n = rd64(b);
        cr_assert_eq(n % 8, 0, "header length %llu for a %d-byte name", (unsigned long long)n,
                     nlen);
        cr_assert_eq(len, 8 + n + sizeof v);
        cr_assert(!memcmp(b + 8 + n, v, sizeof v));
        /* JSON up to its closing brace, then fewer than 8 spaces */
        const char *h = (const char *)b + 8;
        size_t end = (size_t)n;
        while (end && h[end - 1] == ' ') end--;
        cr_assert(end && h[end - 1] == '}', "header does not end in '}' before the padding");
        cr_assert_lt(n - end, 8);
        residues |= 1 << (end % 8);
        json_error_t je;
        json_t *root = json_loadb(h, end, 0, &je);
        cr_assert_not_null(root, "header is not json: %s", je.text);
        json_t *e = json_object_get(root, name);
        cr_assert(json_is_object(e));
        cr_assert_str_eq(json_string_value(json_object_get(e, "dtype")), "I16");
        json_t *o = json_object_get(e, "data_offsets");
        cr_assert_eq(json_integer_value(json_array_get(o, 0)), 0);
        cr_assert_eq(json_integer_value(json_array_get(o, 1)), (json_int_t)sizeof v);
        json_decref(root);
        free(b);
    }
    cr_assert_eq(residues, 0xff, "JSON lengths covered residues 0x%x only", residues);
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

Test(stw, writes_an_empty_file_that_parses) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "empty.safetensors");
    struct kv_stw *w = new_writer();
    cr_assert_eq(kv_stw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_stw_free(w);
    size_t len = 0;
    char *b = kvt_read_file(path, &len);
    cr_assert_eq(len, 16);
    cr_assert_eq(rd64((uint8_t *)b), 8);
    cr_assert(!memcmp(b + 8, "{}      ", 8));
    struct kv_st_file *f = NULL;
    cr_assert_eq(kv_st_open(path, &f, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(f->n_tensors, 0);
    cr_assert_eq(f->n_meta, 0);
    kv_st_close(f);
    free(b);
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

Test(stw, free_null_is_a_no_op) {
    kv_stw_free(NULL);
}

/* ------------------------------------------------------------ add_f32 */

Test(stw, add_f32_converts_into_its_own_buffer) {
    struct kv_err err;
    kv_err_clear(&err);
    enum { N = 37 };
    float src[N];
    uint64_t s = 7;
    for (int i = 0; i < N; i++)
        src[i] = (float)((double)(int64_t)(rng_next(&s) >> 11) / 9007199254740992.0 * 200.0 - 100.0);
    src[0] = 1.0f + ldexpf(1.0f, -11); /* a tie for f16 */
    src[1] = 1.0f + ldexpf(1.0f, -8);  /* a tie for bf16 */
    int64_t shape[2] = {1, N};
    struct kv_stw *w = new_writer();
    const enum kv_dtype dts[3] = {KV_DTYPE_F32, KV_DTYPE_F16, KV_DTYPE_BF16};
    const char *names[3] = {"as.f32", "as.f16", "as.bf16"};
    for (int k = 0; k < 3; k++)
        cr_assert_eq(kv_stw_add_f32(w, names[k], dts[k], 2, shape, src, &err), KV_OK, "%s",
                     fmt_err(&err));
    int64_t eshape[1] = {0};
    cr_assert_eq(kv_stw_add_f32(w, "none.f16", KV_DTYPE_F16, 1, eshape, NULL, &err), KV_OK);
    float keep[N];
    memcpy(keep, src, sizeof src);
    memset(src, 0xff, sizeof src); /* the writer must not read src again */

    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "conv.safetensors");
    cr_assert_eq(kv_stw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_stw_free(w);
    struct kv_st_file *f = NULL;
    cr_assert_eq(kv_st_open(path, &f, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(f->n_tensors, 4);
    for (int k = 0; k < 3; k++) {
        const struct kv_tensor *t = kv_st_find(f, names[k]);
        cr_assert(t && t->dtype == dts[k] && t->ndim == 2 && t->shape[1] == N);
        const uint8_t *b = t->data;
        for (int i = 0; i < N; i++) {
            if (dts[k] == KV_DTYPE_F32) {
                cr_assert(!memcmp(b + 4 * i, &keep[i], 4), "f32 element %d", i);
                continue;
            }
            uint16_t got = (uint16_t)(b[2 * i] | b[2 * i + 1] << 8);
            uint16_t want = dts[k] == KV_DTYPE_F16 ? kv_f32_to_f16(keep[i]) : kv_f32_to_bf16(keep[i]);
            cr_assert_eq(got, want, "%s element %d: 0x%04x, expected 0x%04x", names[k], i, got,
                         want);
        }
    }
    /* the two ties went to the even neighbour, 1.0 */
    const uint8_t *h = kv_st_find(f, "as.f16")->data, *bf = kv_st_find(f, "as.bf16")->data;
    cr_assert_eq(h[0] | h[1] << 8, 0x3c00);
    cr_assert_eq(bf[2] | bf[3] << 8, 0x3f80);
    cr_assert_eq(kv_st_find(f, "none.f16")->nbytes, 0);
    kv_st_close(f);
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

/* ------------------------------------------------------------ rejections */

Test(stw, rejects_duplicate_tensor_names_naming_the_tensor) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = new_writer();
    float x[2] = {1, 2};
    int64_t shape[1] = {2};
    cr_assert_eq(kv_stw_add(w, "layer.0.k", KV_DTYPE_F32, 1, shape, x, sizeof x, &err), KV_OK);
    expect_err(kv_stw_add(w, "layer.0.k", KV_DTYPE_F32, 1, shape, x, sizeof x, &err), &err,
               KV_EINVAL, "duplicate tensor name 'layer.0.k'");
    expect_err(kv_stw_add_f32(w, "layer.0.k", KV_DTYPE_F16, 1, shape, x, &err), &err, KV_EINVAL,
               "duplicate tensor name 'layer.0.k'");
    /* the writer still works and holds the tensor once */
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "dup.safetensors");
    cr_assert_eq(kv_stw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_st_file *f = NULL;
    cr_assert_eq(kv_st_open(path, &f, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(f->n_tensors, 1);
    kv_st_close(f);
    kv_stw_free(w);
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

Test(stw, rejects_duplicate_metadata_keys_naming_the_key) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = new_writer();
    cr_assert_eq(kv_stw_add_meta(w, "format", "pt", &err), KV_OK);
    expect_err(kv_stw_add_meta(w, "format", "np", &err), &err, KV_EINVAL,
               "duplicate metadata key 'format'");
    expect_err(kv_stw_add_meta(w, "bad\xc3", "x", &err), &err, KV_EINVAL, "not valid utf-8");
    expect_err(kv_stw_add_meta(w, "k", "\xed\xa0\x80", &err), &err, KV_EINVAL,
               "value of metadata key 'k' is not valid utf-8");
    kv_stw_free(w);
}

Test(stw, rejects_what_the_reader_would_refuse) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = new_writer();
    float x[6] = {0};
    int64_t s1[1] = {6}, s5[5] = {1, 1, 1, 1, 6}, sneg[2] = {-1, 3};
    char long_name[300];
    memset(long_name, 'x', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = 0;
    expect_err(kv_stw_add(w, "", KV_DTYPE_F32, 1, s1, x, sizeof x, &err), &err, KV_EINVAL,
               "empty tensor name");
    expect_err(kv_stw_add(w, long_name, KV_DTYPE_F32, 1, s1, x, sizeof x, &err), &err, KV_EINVAL,
               "limit 255");
    expect_err(kv_stw_add(w, "__metadata__", KV_DTYPE_F32, 1, s1, x, sizeof x, &err), &err,
               KV_EINVAL, "'__metadata__' is reserved");
    expect_err(kv_stw_add(w, "bad\xff", KV_DTYPE_F32, 1, s1, x, sizeof x, &err), &err, KV_EINVAL,
               "not valid utf-8");
    expect_err(kv_stw_add(w, "five", KV_DTYPE_F32, 5, s5, x, sizeof x, &err), &err, KV_EINVAL,
               "tensor 'five' has 5 dimensions, expected 0 to 4");
    expect_err(kv_stw_add(w, "minus", KV_DTYPE_F32, -1, s1, x, sizeof x, &err), &err, KV_EINVAL,
               "tensor 'minus' has -1 dimensions");
    expect_err(kv_stw_add(w, "neg", KV_DTYPE_F32, 2, sneg, x, 0, &err), &err, KV_EINVAL,
               "tensor 'neg' has shape [-1, 3], expected non-negative dimensions");
    expect_err(kv_stw_add(w, "short", KV_DTYPE_F32, 1, s1, x, sizeof x - 4, &err), &err,
               KV_EINVAL, "tensor 'short': data is 20 bytes but shape [6] F32 needs 24");
    expect_err(kv_stw_add(w, "what", KV_DTYPE_COUNT, 1, s1, x, sizeof x, &err), &err, KV_EINVAL,
               "tensor 'what' has unknown dtype");
    expect_err(kv_stw_add_f32(w, "ints", KV_DTYPE_I64, 1, s1, x, &err), &err, KV_EINVAL,
               "tensor 'ints': cannot convert f32 to I64, expected F32, F16 or BF16");
    int64_t huge[2] = {INT64_MAX, 4};
    expect_err(kv_stw_add(w, "huge", KV_DTYPE_F32, 2, huge, x, 0, &err), &err, KV_EINVAL,
               "tensor 'huge' byte size overflows");
    kv_stw_free(w);
}

/* ------------------------------------------------------------ file errors */

static struct kv_stw *one_tensor_writer(void) {
    static const float x[3] = {1.0f, 2.0f, 3.0f};
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = new_writer();
    int64_t shape[1] = {3};
    cr_assert_eq(kv_stw_add(w, "x", KV_DTYPE_F32, 1, shape, x, sizeof x, &err), KV_OK);
    return w;
}

static void expect_eio_naming(int rc, const struct kv_err *err, const char *path,
                              const char *needle) {
    expect_err(rc, err, KV_EIO, needle);
    cr_assert_str_eq(err->path, path);
    cr_assert(strstr(fmt_err(err), path), "'%s' does not name %s", fmt_err(err), path);
}

Test(stw, write_into_a_missing_directory_is_eio_naming_the_path) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = one_tensor_writer();
    char *dir = kvt_temp_dir();
    char *sub = kvt_path(dir, "missing");
    char *path = kvt_path(sub, "x.safetensors");
    expect_eio_naming(kv_stw_write(w, path, &err), &err, path, "no such file or directory");
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    cr_assert(!exists(path));
    kv_stw_free(w);
    rmdir(dir);
    free(tmp);
    free(path);
    free(sub);
    free(dir);
}

Test(stw, write_under_a_regular_file_is_eio_naming_the_path) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = one_tensor_writer();
    char *file = kvt_write_temp("x", 1, NULL);
    char *path = kvt_path(file, "x.safetensors");
    expect_eio_naming(kv_stw_write(w, path, &err), &err, path, "not a directory");
    kv_stw_free(w);
    unlink(file);
    free(path);
    free(file);
}

Test(stw, write_into_a_read_only_directory_is_eio_and_leaves_nothing) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    cr_assert_eq(chmod(dir, 0555), 0);
    if (access(dir, W_OK) == 0) { /* root writes anyway */
        rmdir(dir);
        free(dir);
        cr_skip_test("a read-only directory is still writable for this user; skipping");
    }
    struct kv_stw *w = one_tensor_writer();
    char *path = kvt_path(dir, "x.safetensors");
    expect_eio_naming(kv_stw_write(w, path, &err), &err, path, "permission denied");
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    cr_assert(!exists(path));
    kv_stw_free(w);
    chmod(dir, 0755);
    rmdir(dir);
    free(tmp);
    free(path);
    free(dir);
}

Test(stw, failed_rename_removes_the_temporary_file) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stw *w = one_tensor_writer();
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "is-a-dir");
    cr_assert_eq(mkdir(path, 0755), 0);
    char *inside = kvt_path(path, "keep");
    FILE *f = fopen(inside, "w");
    cr_assert(f);
    fclose(f);
    expect_eio_naming(kv_stw_write(w, path, &err), &err, path, "cannot rename");
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    cr_assert(exists(inside), "the directory was touched");
    kv_stw_free(w);
    unlink(inside);
    rmdir(path);
    rmdir(dir);
    free(tmp);
    free(inside);
    free(path);
    free(dir);
}

Test(stw, replaces_an_existing_file_and_leaves_a_stale_temporary_alone) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "model.safetensors");
    char *tmp = tmp_of(path);
    size_t old_len = 100000;
    uint8_t *old = malloc(old_len);
    memset(old, 0xab, old_len);
    for (int k = 0; k < 2; k++) {
        FILE *f = fopen(k ? tmp : path, "wb");
        cr_assert(f);
        cr_assert_eq(fwrite(old, 1, old_len, f), old_len);
        fclose(f);
    }
    struct stat before;
    cr_assert_eq(stat(path, &before), 0);

    struct kv_stw *w = one_tensor_writer();
    cr_assert_eq(kv_stw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_stw_free(w);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    /* another writer's (or an older version's) temporary is not ours to touch */
    size_t tl = 0;
    char *tb = kvt_read_file(tmp, &tl);
    cr_assert(tb && tl == old_len && !memcmp(tb, old, old_len), "%s was touched", tmp);
    free(tb);
    unlink(tmp);
    struct stat after;
    cr_assert_eq(stat(path, &after), 0);
    /* a new inode renamed into place, not the old file rewritten */
    cr_assert_neq(after.st_ino, before.st_ino);
    size_t len = 0;
    char *bytes = kvt_read_file(path, &len);
    cr_assert_lt(len, old_len);
    for (size_t i = 0; i < len; i++) cr_assert_neq((uint8_t)bytes[i], 0xab, "old byte at %zu", i);
    struct kv_st_file *f = NULL;
    cr_assert_eq(kv_st_open(path, &f, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(f->n_tensors, 1);
    static const float want[3] = {1.0f, 2.0f, 3.0f};
    cr_assert(!memcmp(kv_st_find(f, "x")->data, want, sizeof want));
    kv_st_close(f);
    free(bytes);
    free(old);
    unlink(path);
    rmdir(dir);
    free(tmp);
    free(path);
    free(dir);
}

/* ------------------------------------------------------------ file copy */

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert(f, "cannot create %s", path);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    fclose(f);
}

static void expect_content(const char *path, const void *p, size_t n) {
    size_t len = 0;
    char *b = kvt_read_file(path, &len);
    cr_assert_not_null(b, "cannot read %s", path);
    cr_assert_eq(len, n, "%s is %zu bytes, expected %zu", path, len, n);
    size_t i = 0;
    while (i < n && (uint8_t)b[i] == ((const uint8_t *)p)[i]) i++;
    cr_assert_eq(i, n, "%s differs at byte %zu", path, i);
    free(b);
}

Test(stw, file_copy_copies_exactly) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    char *src = kvt_path(dir, "src.bin");
    char *dst = kvt_path(dir, "dst.bin");
    char *tmp = tmp_of(dst);
    /* sizes around the 1 MiB copy buffer, and empty */
    const size_t sizes[] = {0, 1, 4097, (1u << 20) - 1, 1u << 20, 3 * (1u << 20) + 17};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        uint8_t *b = malloc(n ? n : 1);
        fill_random(b, n, 100 + k);
        write_file(src, b, n);
        cr_assert_eq(kv_file_copy(src, dst, &err), KV_OK, "%s", fmt_err(&err));
        expect_content(dst, b, n);
        expect_content(src, b, n);
        cr_assert_eq(kvt_tmp_left(dst), 0, "a temporary of %s left behind", dst);
        free(b);
    }
    /* onto itself: the content survives */
    static const char text[] = "same file";
    write_file(src, text, sizeof text);
    cr_assert_eq(kv_file_copy(src, src, &err), KV_OK, "%s", fmt_err(&err));
    expect_content(src, text, sizeof text);
    unlink(src);
    unlink(dst);
    rmdir(dir);
    free(tmp);
    free(src);
    free(dst);
    free(dir);
}

Test(stw, file_copy_from_a_missing_source_fails_cleanly) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    char *src = kvt_path(dir, "nope.bin");
    char *dst = kvt_path(dir, "dst.bin");
    char *tmp = tmp_of(dst);
    expect_eio_naming(kv_file_copy(src, dst, &err), &err, src, "no such file or directory");
    cr_assert(!exists(dst));
    cr_assert_eq(kvt_tmp_left(dst), 0, "a temporary of %s left behind", dst);
    /* an existing destination is left alone */
    static const char keep[] = "keep me";
    write_file(dst, keep, sizeof keep);
    expect_eio_naming(kv_file_copy(src, dst, &err), &err, src, "cannot open");
    expect_content(dst, keep, sizeof keep);
    cr_assert_eq(kvt_tmp_left(dst), 0, "a temporary of %s left behind", dst);
    /* a directory is not a file to copy */
    expect_eio_naming(kv_file_copy(dir, dst, &err), &err, dir, "is a directory");
    expect_content(dst, keep, sizeof keep);
    /* a file named like an old-style temporary of dst is just a source:
     * the copy's own temporary has a name of its own */
    static const char other[] = "other bytes";
    write_file(tmp, other, sizeof other);
    cr_assert_eq(kv_file_copy(tmp, dst, &err), KV_OK, "%s", fmt_err(&err));
    expect_content(tmp, other, sizeof other);
    expect_content(dst, other, sizeof other);
    cr_assert_eq(kvt_tmp_left(dst), 0);
    unlink(tmp);
    unlink(dst);
    rmdir(dir);
    free(tmp);
    free(src);
    free(dst);
    free(dir);
}

Test(stw, file_copy_into_a_missing_directory_is_eio_naming_the_destination) {
    struct kv_err err;
    kv_err_clear(&err);
    char *src = kvt_write_temp("abc", 3, NULL);
    char *dir = kvt_temp_dir();
    char *sub = kvt_path(dir, "missing");
    char *dst = kvt_path(sub, "dst.bin");
    expect_eio_naming(kv_file_copy(src, dst, &err), &err, dst, "no such file or directory");
    unlink(src);
    rmdir(dir);
    free(src);
    free(dst);
    free(sub);
    free(dir);
}

/* A symlink planted where the writer's temporary goes (the old fixed name,
 * and the next names kv_tmp_create would try) is neither followed nor
 * truncated: the victim keeps its bytes, the output is a regular file. */
Test(stw, write_never_follows_a_planted_temporary) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "x.safetensors");
    char *victim = kvt_path(dir, "victim.txt");
    static const char keep[] = "precious";
    write_file(victim, keep, sizeof keep);
    char *old = tmp_of(path);
    cr_assert_eq(symlink(victim, old), 0);
    /* learn the name the next call starts from, then plant symlinks there */
    int fd;
    char *probe;
    cr_assert_eq(kv_tmp_create(path, &fd, &probe, &err), KV_OK, "%s", fmt_err(&err));
    close(fd);
    unlink(probe);
    long pid;
    unsigned seq;
    cr_assert_eq(sscanf(probe + strlen(path), ".tmp-%ld-%u", &pid, &seq), 2, "name '%s'", probe);
    cr_assert_eq(pid, (long)getpid());
    char planted[8][4200];
    for (int k = 0; k < 8; k++) {
        snprintf(planted[k], sizeof planted[k], "%s.tmp-%ld-%u", path, pid, seq + 1 + (unsigned)k);
        cr_assert_eq(symlink(victim, planted[k]), 0);
    }
    struct kv_stw *w = one_tensor_writer();
    cr_assert_eq(kv_stw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_stw_free(w);
    expect_content(victim, keep, sizeof keep);
    struct stat st;
    cr_assert_eq(lstat(path, &st), 0);
    cr_assert(S_ISREG(st.st_mode), "%s is not a regular file", path);
    struct kv_st_file *f = NULL;
    cr_assert_eq(kv_st_open(path, &f, &err), KV_OK, "%s", fmt_err(&err));
    kv_st_close(f);
    /* the planted links are still there (not ours), nothing else is */
    cr_assert_eq(kvt_tmp_left(path), 8);
    for (int k = 0; k < 8; k++) unlink(planted[k]);
    unlink(old);
    unlink(path);
    unlink(victim);
    rmdir(dir);
    free(probe);
    free(old);
    free(path);
    free(victim);
    free(dir);
}

/* kv_stw_add_fn: bytes produced while writing, in 1 MiB pieces, equal to
 * the same bytes added whole; a fill error ends the write and leaves no
 * file. */
static int fill_pattern(void *ctx, uint64_t off, uint64_t n, void *out, struct kv_err *err) {
    const uint8_t *src = ctx;
    if (!src) return kv_fail(err, KV_EIO, NULL, KV_NO_OFFSET, "fill failed at %llu", (unsigned long long)off);
    memcpy(out, src + off, (size_t)n);
    return KV_OK;
}

Test(stw, fill_function_tensors_equal_added_ones) {
    int64_t shape[2] = {700, 1000}; /* 2.8 MB: three pieces */
    size_t nb = 700 * 1000 * 4;
    uint8_t *data = malloc(nb);
    fill_random(data, nb, 9);
    char *dir = kvt_temp_dir(), *a = kvt_path(dir, "a.safetensors"), *b = kvt_path(dir, "b.safetensors");
    struct kv_err err;
    struct kv_stw *w = new_writer();
    cr_assert_eq(kv_stw_add(w, "x", KV_DTYPE_F32, 2, shape, data, nb, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_stw_write(w, a, &err), KV_OK, "%s", err.msg);
    kv_stw_free(w);
    w = new_writer();
    cr_assert_eq(kv_stw_add_fn(w, "x", KV_DTYPE_F32, 2, shape, fill_pattern, data, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_stw_write(w, b, &err), KV_OK, "%s", err.msg);
    kv_stw_free(w);
    size_t la, lb;
    char *fa = kvt_read_file(a, &la), *fb = kvt_read_file(b, &lb);
    cr_assert(la == lb && !memcmp(fa, fb, la), "the files differ (%zu and %zu bytes)", la, lb);
    free(fa), free(fb);
    /* a failing fill */
    char *c = kvt_path(dir, "c.safetensors");
    w = new_writer();
    cr_assert_eq(kv_stw_add_fn(w, "x", KV_DTYPE_F32, 2, shape, fill_pattern, NULL, &err), KV_OK);
    cr_assert_eq(kv_stw_write(w, c, &err), KV_EIO);
    cr_assert_str_eq(err.msg, "fill failed at 0");
    cr_assert(!exists(c), "a failed write left %s", c);
    cr_assert(!kvt_tmp_left(c), "a failed write left its temporary");
    kv_stw_free(w);
    free(data), free(a), free(b), free(c);
    kvt_rm_dir(dir);
}
