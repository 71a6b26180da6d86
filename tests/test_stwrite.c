/* safetensors writer (suite stw): everything it writes is read back with the
 * safetensors parser and compared byte for byte. f32 to f16/bf16 encoders
 * (suite f16): checked against the format definitions, value by value. */
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
#include "stwrite.h"
#include "testutil.h"

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

/* Deterministic bytes (xorshift64). */
static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
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
    cr_assert(!exists(tmp), "%s left behind", tmp);

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
    cr_assert(!exists(tmp));
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
    cr_assert(!exists(tmp));
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
    cr_assert(!exists(tmp), "%s left behind", tmp);
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

Test(stw, replaces_an_existing_file_and_a_stale_temporary) {
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
    cr_assert(!exists(tmp), "%s left behind", tmp);
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
        cr_assert(!exists(tmp), "%s left behind", tmp);
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
    cr_assert(!exists(tmp));
    /* an existing destination is left alone */
    static const char keep[] = "keep me";
    write_file(dst, keep, sizeof keep);
    expect_eio_naming(kv_file_copy(src, dst, &err), &err, src, "cannot open");
    expect_content(dst, keep, sizeof keep);
    cr_assert(!exists(tmp));
    /* a directory is not a file to copy */
    expect_eio_naming(kv_file_copy(dir, dst, &err), &err, dir, "is a directory");
    expect_content(dst, keep, sizeof keep);
    /* the destination's own temporary is refused before it is truncated */
    write_file(tmp, keep, sizeof keep);
    expect_err(kv_file_copy(tmp, dst, &err), &err, KV_EINVAL, "temporary");
    expect_content(tmp, keep, sizeof keep);
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

/* ------------------------------------------------------------ f16 / bf16 */

/* IEEE binary16 and bfloat16 fields: sign, biased exponent, mantissa. */
static uint16_t H(int sign, int exp, int man) {
    return (uint16_t)(sign << 15 | exp << 10 | man);
}
static uint16_t B(int sign, int exp, int man) {
    return (uint16_t)(sign << 15 | exp << 7 | man);
}

static int f16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }
static int bf16_is_nan(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f); }

Test(f16, every_half_round_trips_through_f32) {
    int nans = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = kv_f16_to_f32(h);
        uint16_t back = kv_f32_to_f16(f);
        if (f16_is_nan(h)) {
            nans++;
            cr_assert(isnan(f));
            cr_assert(f16_is_nan(back), "NaN 0x%04x came back as 0x%04x", h, back);
            cr_assert_eq(back & 0x8000, h & 0x8000, "NaN 0x%04x lost its sign", h);
        } else {
            cr_assert_eq(back, h, "0x%04x (%.9g) came back as 0x%04x", h, (double)f, back);
        }
    }
    cr_assert_eq(nans, 2 * 1023);
}

Test(f16, every_bfloat16_round_trips_through_f32) {
    int nans = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = kv_bf16_to_f32(h);
        uint16_t back = kv_f32_to_bf16(f);
        if (bf16_is_nan(h)) {
            nans++;
            cr_assert(isnan(f));
            cr_assert(bf16_is_nan(back), "NaN 0x%04x came back as 0x%04x", h, back);
            cr_assert_eq(back & 0x8000, h & 0x8000, "NaN 0x%04x lost its sign", h);
        } else {
            cr_assert_eq(back, h, "0x%04x (%.9g) came back as 0x%04x", h, (double)f, back);
        }
    }
    cr_assert_eq(nans, 2 * 127);
}

static float f32_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

Test(f16, nan_inputs_stay_nan) {
    /* payload only in the low 13 bits, which f16 drops; or in the low 16,
     * which bf16 drops */
    const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu,
                             0x7f801000u};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        float x = f32_bits(nans[i]);
        uint16_t h = kv_f32_to_f16(x), b = kv_f32_to_bf16(x);
        cr_assert(f16_is_nan(h), "f16 of NaN 0x%08x is 0x%04x", nans[i], h);
        cr_assert(bf16_is_nan(b), "bf16 of NaN 0x%08x is 0x%04x", nans[i], b);
        cr_assert_eq(h >> 15, nans[i] >> 31);
        cr_assert_eq(b >> 15, nans[i] >> 31);
    }
}

struct hcase {
    float x;
    uint16_t want;
    const char *why;
};

/* f16 has 10 mantissa bits: in [2^e, 2^(e+1)) the spacing is 2^(e-10), and
 * subnormals are multiples of 2^-24 below 2^-14. Each input below is built
 * from that definition; the expected pattern is spelled as its fields. */
Test(f16, rounds_to_nearest_with_ties_to_even) {
    const struct hcase c[] = {
        {1.0f + ldexpf(1, -11), H(0, 15, 0), "1 + 2^-11: tie between 1 (man 0) and 1 + 2^-10 (man 1)"},
        {1.0f + 3 * ldexpf(1, -11), H(0, 15, 2),
         "1 + 3*2^-11: tie between 1 + 2^-10 (man 1) and 1 + 2^-9 (man 2)"},
        {1.0f + 5 * ldexpf(1, -11), H(0, 15, 2), "1 + 5*2^-11: tie between man 2 and man 3"},
        {1.0f + ldexpf(1, -11) + ldexpf(1, -23), H(0, 15, 1), "one f32 ulp above the first tie"},
        {1.0f + 3 * ldexpf(1, -11) - ldexpf(1, -23), H(0, 15, 1), "one f32 ulp below the second tie"},
        {-(2.0f + ldexpf(1, -10)), H(1, 16, 0), "-(2 + 2^-10): spacing 2^-9, tie, to man 0"},
        {2049.0f, H(0, 26, 0), "2049: spacing 2 in [2048, 4096), tie between 2048 and 2050"},
        {2051.0f, H(0, 26, 2), "2051: tie between 2050 (man 1) and 2052 (man 2)"},
        {2.0f - ldexpf(1, -11), H(0, 16, 0),
         "2 - 2^-11: tie between 2 - 2^-10 (man 1023) and 2, carrying into the exponent"},
        {ldexpf(1, -14) - ldexpf(1, -25), H(0, 1, 0),
         "2^-14 - 2^-25: tie between the largest subnormal (man 1023) and the smallest normal"},
        {ldexpf(1, -24), H(0, 0, 1), "2^-24: the smallest subnormal"},
        {ldexpf(1, -25), H(0, 0, 0), "2^-25: tie between 0 and 2^-24, to 0"},
        {nextafterf(ldexpf(1, -25), 1), H(0, 0, 1), "just above 2^-25"},
        {3 * ldexpf(1, -25), H(0, 0, 2), "1.5 * 2^-24: tie between 1 and 2 units, to 2"},
        {5 * ldexpf(1, -25), H(0, 0, 2), "2.5 * 2^-24: tie between 2 and 3 units, to 2"},
        {-ldexpf(1, -26), H(1, 0, 0), "-2^-26: to -0"},
        {FLT_MIN, H(0, 0, 0), "FLT_MIN"},
        {f32_bits(1), H(0, 0, 0), "the smallest f32 subnormal"},
        {-0.0f, H(1, 0, 0), "-0"},
        {65504.0f, H(0, 30, 1023), "65504: the largest half"},
        {nextafterf(65520.0f, 0), H(0, 30, 1023), "just below 65520"},
        {65520.0f, H(0, 31, 0), "65520: tie between 65504 (man 1023) and 2^16, which is inf"},
        {-65520.0f, H(1, 31, 0), "-65520"},
        {70000.0f, H(0, 31, 0), "70000"},
        {FLT_MAX, H(0, 31, 0), "FLT_MAX"},
        {INFINITY, H(0, 31, 0), "inf"},
        {-INFINITY, H(1, 31, 0), "-inf"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        uint16_t got = kv_f32_to_f16(c[i].x);
        cr_assert_eq(got, c[i].want, "%s: %.10g gave 0x%04x, expected 0x%04x", c[i].why,
                     (double)c[i].x, got, c[i].want);
    }
}

/* bf16 has 7 mantissa bits and f32's exponent range. */
Test(f16, bfloat16_rounds_to_nearest_with_ties_to_even) {
    const struct hcase c[] = {
        {1.0f + ldexpf(1, -8), B(0, 127, 0), "1 + 2^-8: tie between man 0 and man 1"},
        {1.0f + 3 * ldexpf(1, -8), B(0, 127, 2), "1 + 3*2^-8: tie between man 1 and man 2"},
        {1.0f + ldexpf(1, -8) + ldexpf(1, -23), B(0, 127, 1), "one f32 ulp above the tie"},
        {-(1.0f + 3 * ldexpf(1, -8) - ldexpf(1, -23)), B(1, 127, 1), "one f32 ulp below a tie"},
        {2.0f - ldexpf(1, -8), B(0, 128, 0),
         "2 - 2^-8: tie between 2 - 2^-7 (man 127) and 2, carrying into the exponent"},
        {f32_bits(0x00008000u), B(0, 0, 0), "subnormal tie between 0 and the smallest bf16"},
        {f32_bits(0x00018000u), B(0, 0, 2), "subnormal tie between man 1 and man 2"},
        {ldexpf(1.0f - ldexpf(1, -9), 128), B(0, 255, 0),
         "(2 - 2^-8) * 2^127: tie between the largest bf16 (2 - 2^-7) * 2^127 (man 127) and "
         "2^128, which is inf"},
        {nextafterf(ldexpf(1.0f - ldexpf(1, -9), 128), 0), B(0, 254, 127), "just below it"},
        {-FLT_MAX, B(1, 255, 0), "-FLT_MAX"},
        {INFINITY, B(0, 255, 0), "inf"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        uint16_t got = kv_f32_to_bf16(c[i].x);
        cr_assert_eq(got, c[i].want, "%s: %.10g gave 0x%04x, expected 0x%04x", c[i].why,
                     (double)c[i].x, got, c[i].want);
    }
}

/* Reference rounding: the positive patterns 0..top in order have increasing
 * values v[] (computed from the fields in double), with v[top] the first
 * value past the largest finite one (2^16 or 2^128, encoded as inf, as IEEE
 * rounds overflow). The answer is the nearest v[k], ties to the even k. */
struct refcode {
    double *v;
    uint32_t top;
};

static struct refcode ref_f16(void) {
    struct refcode r = {malloc(0x7c01 * sizeof(double)), 0x7c00};
    for (uint32_t k = 0; k <= r.top; k++) {
        uint32_t e = k >> 10, m = k & 0x3ff;
        r.v[k] = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, (int)e - 25);
    }
    return r;
}

static struct refcode ref_bf16(void) {
    struct refcode r = {malloc(0x7f81 * sizeof(double)), 0x7f80};
    for (uint32_t k = 0; k <= r.top; k++) {
        uint32_t e = k >> 7, m = k & 0x7f;
        r.v[k] = e == 0 ? ldexp(m, -133) : ldexp(128 + m, (int)e - 134);
    }
    return r;
}

static uint16_t ref_round(const struct refcode *r, float x) {
    double a = fabs((double)x);
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (a >= r->v[r->top]) return (uint16_t)(sign | r->top);
    uint32_t lo = 0, hi = r->top; /* v[lo] <= a < v[hi] */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (r->v[mid] <= a) lo = mid;
        else hi = mid;
    }
    double d0 = a - r->v[lo], d1 = r->v[hi] - a;
    uint32_t k = d0 < d1 ? lo : d1 < d0 ? hi : (lo & 1) ? hi : lo;
    return (uint16_t)(sign | k);
}

static void check_against_ref(const struct refcode *r, uint16_t (*enc)(float), const char *what) {
    /* every exact value, every midpoint between neighbours, and one f32 ulp
     * either side of it, both signs */
    for (uint32_t k = 0; k < r->top; k++) {
        double mid = (r->v[k] + r->v[k + 1]) / 2;
        float fm = (float)mid;
        cr_assert_eq((double)fm, mid, "%s midpoint %u is not an f32", what, k);
        float xs[4] = {(float)r->v[k], fm, nextafterf(fm, 0), nextafterf(fm, INFINITY)};
        for (int j = 0; j < 8; j++) {
            float x = j < 4 ? xs[j] : -xs[j - 4];
            uint16_t got = enc(x), want = ref_round(r, x);
            cr_assert_eq(got, want, "%s(%a) = 0x%04x, reference 0x%04x", what, (double)x, got,
                         want);
        }
    }
    /* random finite f32 bit patterns, and random values within range */
    uint64_t s = 12345;
    for (int i = 0; i < 1000000; i++) {
        uint32_t b = (uint32_t)(rng_next(&s) >> 32);
        if ((b & 0x7f800000u) == 0x7f800000u) continue;
        float x = f32_bits(b);
        uint16_t got = enc(x), want = ref_round(r, x);
        cr_assert_eq(got, want, "%s(%a) = 0x%04x, reference 0x%04x", what, (double)x, got, want);
        double lo = r->v[1], hi = r->v[r->top];
        x = (float)(exp(log(lo) + (log(hi) - log(lo)) * (double)(rng_next(&s) >> 11) / 9007199254740992.0));
        got = enc(x);
        want = ref_round(r, x);
        cr_assert_eq(got, want, "%s(%a) = 0x%04x, reference 0x%04x", what, (double)x, got, want);
    }
}

Test(f16, matches_a_nearest_even_reference) {
    struct refcode r = ref_f16();
    check_against_ref(&r, kv_f32_to_f16, "f16");
    free(r.v);
    r = ref_bf16();
    check_against_ref(&r, kv_f32_to_bf16, "bf16");
    free(r.v);
}

Test(f16, convert_from_f32_writes_little_endian) {
    const float in[4] = {1.0f, -2.0f, 0.5f, 65504.0f};
    uint8_t h[8], b[8], f[16];
    kv_convert_from_f32(KV_DTYPE_F16, in, h, 4);
    kv_convert_from_f32(KV_DTYPE_BF16, in, b, 4);
    kv_convert_from_f32(KV_DTYPE_F32, in, f, 4);
    /* 1 = H(0,15,0) = 0x3c00, -2 = 0xc000, 0.5 = 0x3800, 65504 = 0x7bff */
    const uint8_t want_h[8] = {0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38, 0xff, 0x7b};
    cr_assert(!memcmp(h, want_h, 8));
    /* 1 = B(0,127,0) = 0x3f80, -2 = 0xc000, 0.5 = 0x3f00; 65504 is f32 0x477fe000, whose
     * dropped half 0xe000 is above the midpoint: up to 0x4780 = 2^16 */
    const uint8_t want_b[8] = {0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f, 0x80, 0x47};
    cr_assert(!memcmp(b, want_b, 8));
    for (int i = 0; i < 4; i++) {
        uint32_t bits;
        memcpy(&bits, &in[i], 4);
        for (int j = 0; j < 4; j++) cr_assert_eq(f[4 * i + j], (uint8_t)(bits >> (8 * j)));
    }
    float back[4];
    kv_convert_to_f32(KV_DTYPE_F16, h, back, 4);
    cr_assert(!memcmp(back, in, sizeof in));
    kv_convert_to_f32(KV_DTYPE_BF16, b, back, 4);
    cr_assert(back[0] == 1.0f && back[1] == -2.0f && back[2] == 0.5f && back[3] == 65536.0f);
}
