/* GGUF writer: everything it writes is read back with the GGUF parser. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ggufw.h"
#include "gguf.h"
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

static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
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

static int64_t file_size(const char *path) {
    struct stat st;
    cr_assert_eq(stat(path, &st), 0, "stat %s", path);
    return (int64_t)st.st_size;
}

static struct kv_ggufw *new_writer(void) {
    struct kv_ggufw *w = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_ggufw_init(&w, &err), KV_OK);
    cr_assert_not_null(w);
    return w;
}

/* ------------------------------------------------------------ round trip */

struct tspec {
    const char *name;
    uint32_t type;
    int ndim;
    int64_t shape[4];
    uint64_t esize;
    enum kv_dtype dtype;
};

/* The F16 tensor is 6 bytes, so the next one starts after 26 bytes of
 * padding; the big F32 one (2 MiB) goes around the staging buffer. */
static const struct tspec specs[] = {
    {"blk.0.cov", 28, 3, {2, 3, 5}, 8, KV_DTYPE_F64},
    {"w.f32", 0, 2, {4, 7}, 4, KV_DTYPE_F32},
    {"odd.f16", 1, 1, {3}, 2, KV_DTYPE_F16},
    {"after.odd.bf16", 30, 2, {5, 3}, 2, KV_DTYPE_BF16},
    {"ids.i32", 26, 4, {1, 2, 1, 3}, 4, KV_DTYPE_I32},
    {"big.f32", 0, 2, {512, 1024}, 4, KV_DTYPE_F32},
};
#define N_SPECS (int)(sizeof specs / sizeof specs[0])

static uint64_t spec_bytes(const struct tspec *s) {
    uint64_t n = s->esize;
    for (int d = 0; d < s->ndim; d++) n *= (uint64_t)s->shape[d];
    return n;
}

Test(ggufw, round_trips_every_metadata_type_and_tensor) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();

    size_t big_len = (3u << 20) / 2; /* larger than the staging buffer */
    char *big = malloc(big_len + 1);
    for (size_t i = 0; i < big_len; i++) big[i] = (char)('a' + i % 26);
    big[big_len] = 0;
    const char *strs[] = {"alpha", "", "\xe2\x96\x81unicode"};
    const uint32_t u32s[] = {0, 1, 0xffffffffu, 12345};
    const uint64_t u64s[] = {0xfedcba9876543210ull, 42};
    const double f64v = -1.25e-300;

    cr_assert_eq(kv_ggufw_add_str(w, "general.name", "tiny model", &err), KV_OK, "%s",
                 fmt_err(&err));
    cr_assert_eq(kv_ggufw_add_u32(w, "test.u32", 0xdeadbeefu, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_u64(w, "test.u64", 0x0123456789abcdefull, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_i64(w, "test.i64", -9000000000000ll, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_f64(w, "test.f64", f64v, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_bool(w, "test.true", 7, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_bool(w, "test.false", 0, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_str(w, "test.empty", "", &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_str(w, "test.big", big, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_arr_str(w, "test.strs", strs, 3, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_arr_u32(w, "test.u32s", u32s, 4, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_arr_u64(w, "test.u64s", u64s, 2, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_arr_u32(w, "test.none", NULL, 0, &err), KV_OK);
    cr_assert_eq(kv_ggufw_add_u32(w, "general.alignment", 32, &err), KV_OK, "%s", fmt_err(&err));
    const char *order[] = {"general.name", "test.u32",  "test.u64",  "test.i64",
                           "test.f64",     "test.true", "test.false", "test.empty",
                           "test.big",     "test.strs", "test.u32s", "test.u64s",
                           "test.none",    "general.alignment"};
    int n_order = (int)(sizeof order / sizeof order[0]);

    uint8_t *data[N_SPECS];
    for (int t = 0; t < N_SPECS; t++) {
        uint64_t n = spec_bytes(&specs[t]);
        data[t] = malloc(n);
        for (uint64_t i = 0; i < n; i++) data[t][i] = (uint8_t)(i * 31 + (uint64_t)t * 7 + 1);
        cr_assert_eq(kv_ggufw_add_tensor(w, specs[t].name, specs[t].type, specs[t].ndim,
                                         specs[t].shape, data[t], n, &err),
                     KV_OK, "%s: %s", specs[t].name, fmt_err(&err));
    }

    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "out.gguf");
    cr_assert_eq(kv_ggufw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_ggufw_free(w);
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);

    struct kv_gguf_file *g = NULL;
    cr_assert_eq(kv_gguf_open(path, &g, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(g->version, 3);
    cr_assert_eq(g->alignment, 32);
    cr_assert(g->buf[0] == 'G' && g->buf[1] == 'G' && g->buf[2] == 'U' && g->buf[3] == 'F');
    cr_assert_eq(rd32(g->buf + 4), 3);
    cr_assert_eq(rd64(g->buf + 8), (uint64_t)N_SPECS);
    cr_assert_eq(rd64(g->buf + 16), (uint64_t)n_order);

    /* metadata, in insertion order */
    cr_assert_eq(g->n_kv, n_order);
    for (int i = 0; i < n_order; i++) {
        cr_assert_eq(g->kv[i].key.len, strlen(order[i]));
        cr_assert(!memcmp(g->kv[i].key.p, order[i], strlen(order[i])), "key %d", i);
    }
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_str(g, "general.name", &s, &err), KV_OK);
    cr_assert(s.len == 10 && !memcmp(s.p, "tiny model", 10));
    uint32_t u32;
    cr_assert_eq(kv_gguf_get_u32(g, "test.u32", &u32, &err), KV_OK);
    cr_assert_eq(u32, 0xdeadbeefu);
    cr_assert_eq(kv_gguf_find(g, "test.u32")->type, KV_GGUF_U32);
    uint64_t u64;
    cr_assert_eq(kv_gguf_get_u64(g, "test.u64", &u64, &err), KV_OK);
    cr_assert_eq(u64, 0x0123456789abcdefull);
    cr_assert_eq(kv_gguf_find(g, "test.u64")->type, KV_GGUF_U64);
    const struct kv_gguf_kv *kv = kv_gguf_find(g, "test.i64");
    cr_assert(kv && kv->type == KV_GGUF_I64);
    cr_assert_eq(kv->v.i, -9000000000000ll);
    kv = kv_gguf_find(g, "test.f64");
    cr_assert(kv && kv->type == KV_GGUF_F64);
    cr_assert(!memcmp(&kv->v.f, &f64v, sizeof f64v), "f64 bits differ: %g", kv->v.f);
    int b = -1;
    cr_assert_eq(kv_gguf_get_bool(g, "test.true", &b, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(b, 1);
    cr_assert_eq(kv_gguf_get_bool(g, "test.false", &b, &err), KV_OK);
    cr_assert_eq(b, 0);
    cr_assert_eq(kv_gguf_get_str(g, "test.empty", &s, &err), KV_OK);
    cr_assert_eq(s.len, 0);
    cr_assert_eq(kv_gguf_get_str(g, "test.big", &s, &err), KV_OK);
    cr_assert(s.len == big_len && !memcmp(s.p, big, big_len));

    struct kv_gguf_str *arr = NULL;
    uint64_t n = 0;
    cr_assert_eq(kv_gguf_get_arr_str(g, "test.strs", &arr, &n, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(n, 3);
    for (int i = 0; i < 3; i++)
        cr_assert(arr[i].len == strlen(strs[i]) && !memcmp(arr[i].p, strs[i], arr[i].len),
                  "element %d", i);
    free(arr);
    kv = kv_gguf_find(g, "test.u32s");
    cr_assert(kv && kv->type == KV_GGUF_ARRAY && kv->arr_type == KV_GGUF_U32 && kv->arr_n == 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(rd32(g->buf + kv->arr_off + 4 * (uint64_t)i), u32s[i]);
    kv = kv_gguf_find(g, "test.u64s");
    cr_assert(kv && kv->type == KV_GGUF_ARRAY && kv->arr_type == KV_GGUF_U64 && kv->arr_n == 2);
    for (int i = 0; i < 2; i++) cr_assert_eq(rd64(g->buf + kv->arr_off + 8 * (uint64_t)i), u64s[i]);
    kv = kv_gguf_find(g, "test.none");
    cr_assert(kv && kv->type == KV_GGUF_ARRAY && kv->arr_type == KV_GGUF_U32 && kv->arr_n == 0);

    /* tensors, in insertion order, contiguous and aligned */
    cr_assert_eq(g->n_tensors, N_SPECS);
    cr_assert_eq(g->data_off % 32, 0);
    uint64_t expect = 0;
    for (int t = 0; t < N_SPECS; t++) {
        const struct tspec *sp = &specs[t];
        const struct kv_gguf_tensor *ti = kv_gguf_find_tensor(g, sp->name);
        cr_assert(ti, "tensor %s", sp->name);
        cr_assert_eq(ti, &g->tensors[t]);
        cr_assert_eq(ti->ggml_type, sp->type);
        cr_assert(ti->has_dtype);
        cr_assert_eq(ti->t.dtype, sp->dtype);
        cr_assert_eq(ti->t.ndim, sp->ndim);
        cr_assert_eq(ti->n_dims, sp->ndim);
        for (int d = 0; d < sp->ndim; d++) {
            cr_assert_eq(ti->t.shape[d], sp->shape[d], "%s dim %d", sp->name, d);
            cr_assert_eq(ti->ne[d], sp->shape[sp->ndim - 1 - d]);
        }
        cr_assert_eq(ti->rel_offset, expect, "%s", sp->name);
        cr_assert_eq(ti->rel_offset % 32, 0);
        cr_assert_eq(ti->t.offset % 32, 0);
        cr_assert_eq(ti->t.offset, g->data_off + ti->rel_offset);
        cr_assert_eq(ti->t.nbytes, spec_bytes(sp));
        cr_assert(!memcmp(ti->t.data, data[t], spec_bytes(sp)), "%s data differs", sp->name);
        expect = (ti->rel_offset + ti->t.nbytes + 31) / 32 * 32;
    }
    /* the odd tensor forced padding, zero-filled */
    const struct kv_gguf_tensor *odd = kv_gguf_find_tensor(g, "odd.f16");
    cr_assert_eq(kv_gguf_find_tensor(g, "after.odd.bf16")->rel_offset, odd->rel_offset + 32);
    for (uint64_t i = odd->t.offset + 6; i < odd->t.offset + 32; i++)
        cr_assert_eq(g->buf[i], 0, "padding byte %llu", (unsigned long long)i);
    /* the file ends at the aligned end of the last tensor */
    cr_assert_eq(g->len, g->data_off + expect);
    cr_assert_eq((int64_t)g->len, file_size(path));

    kv_gguf_close(g);
    for (int t = 0; t < N_SPECS; t++) free(data[t]);
    free(big);
    unlink(path);
    rmdir(dir);
    free(tmp);
    free(path);
    free(dir);
}

Test(ggufw, round_trips_an_empty_file) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "empty.gguf");
    cr_assert_eq(kv_ggufw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_ggufw_free(w);
    cr_assert_eq(file_size(path), 32, "24-byte header padded to the alignment");
    struct kv_gguf_file *g = NULL;
    cr_assert_eq(kv_gguf_open(path, &g, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(g->version, 3);
    cr_assert_eq(g->n_kv, 0);
    cr_assert_eq(g->n_tensors, 0);
    cr_assert_eq(g->data_off, 32);
    cr_assert_null(kv_gguf_find(g, "general.name"));
    kv_gguf_close(g);
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    unlink(path);
    rmdir(dir);
    free(tmp);
    free(path);
    free(dir);
}

Test(ggufw, free_null_is_a_no_op) {
    kv_ggufw_free(NULL);
}

/* ------------------------------------------------------------ argument errors */

static void expect_err(int rc, const struct kv_err *err, int code, const char *substr) {
    cr_assert_eq(rc, code, "rc %d, expected %d (%s)", rc, code, fmt_err(err));
    cr_assert_eq(err->code, code);
    cr_assert(strstr(err->msg, substr), "message '%s' lacks '%s'", err->msg, substr);
    cr_assert(err->msg[0] < 'A' || err->msg[0] > 'Z', "message '%s' starts uppercase", err->msg);
    size_t n = strlen(err->msg);
    cr_assert(n && err->msg[n - 1] != '.', "message '%s' ends with a full stop", err->msg);
}

Test(ggufw, rejects_duplicate_keys_naming_the_key) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();
    cr_assert_eq(kv_ggufw_add_u32(w, "llama.block_count", 2, &err), KV_OK);
    expect_err(kv_ggufw_add_u32(w, "llama.block_count", 3, &err), &err, KV_EINVAL,
               "duplicate key 'llama.block_count'");
    expect_err(kv_ggufw_add_str(w, "llama.block_count", "x", &err), &err, KV_EINVAL,
               "duplicate key 'llama.block_count'");
    const char *v[] = {"a"};
    expect_err(kv_ggufw_add_arr_str(w, "llama.block_count", v, 1, &err), &err, KV_EINVAL,
               "duplicate key 'llama.block_count'");
    expect_err(kv_ggufw_add_u32(w, "", 1, &err), &err, KV_EINVAL, "empty metadata key");
    kv_ggufw_free(w);
}

Test(ggufw, rejects_an_alignment_key_other_than_uint32_32) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();
    expect_err(kv_ggufw_add_u32(w, "general.alignment", 64, &err), &err, KV_EINVAL,
               "key 'general.alignment' is 64, expected 32");
    expect_err(kv_ggufw_add_u64(w, "general.alignment", 32, &err), &err, KV_EINVAL,
               "key 'general.alignment' has type uint64, expected uint32 32");
    kv_ggufw_free(w);
}

Test(ggufw, rejects_duplicate_tensor_names) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();
    float x[4] = {0};
    int64_t shape[1] = {4};
    cr_assert_eq(kv_ggufw_add_tensor(w, "t", 0, 1, shape, x, sizeof x, &err), KV_OK);
    expect_err(kv_ggufw_add_tensor(w, "t", 0, 1, shape, x, sizeof x, &err), &err, KV_EINVAL,
               "duplicate tensor name 't'");
    kv_ggufw_free(w);
}

Test(ggufw, rejects_bad_nbytes_ndim_dims_and_types) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();
    double x[24] = {0};
    int64_t s23[2] = {2, 3}, s5[5] = {1, 1, 1, 1, 1}, s20[2] = {2, 0}, sneg[1] = {-4};
    expect_err(kv_ggufw_add_tensor(w, "a", 0, 2, s23, x, 10, &err), &err, KV_EINVAL,
               "tensor 'a': data is 10 bytes but shape [2, 3] F32 needs 24");
    expect_err(kv_ggufw_add_tensor(w, "a", 28, 2, s23, x, 24, &err), &err, KV_EINVAL,
               "shape [2, 3] F64 needs 48");
    expect_err(kv_ggufw_add_tensor(w, "a", 0, 0, s23, x, 4, &err), &err, KV_EINVAL,
               "tensor 'a' has 0 dimensions, expected 1 to 4");
    expect_err(kv_ggufw_add_tensor(w, "a", 0, 5, s5, x, 4, &err), &err, KV_EINVAL,
               "tensor 'a' has 5 dimensions, expected 1 to 4");
    expect_err(kv_ggufw_add_tensor(w, "a", 0, 2, s20, x, 0, &err), &err, KV_EINVAL,
               "tensor 'a' has shape [2, 0], expected positive dimensions");
    expect_err(kv_ggufw_add_tensor(w, "a", 0, 1, sneg, x, 16, &err), &err, KV_EINVAL,
               "expected positive dimensions");
    int64_t huge[2] = {INT64_MAX, 4};
    expect_err(kv_ggufw_add_tensor(w, "a", 0, 2, huge, x, 16, &err), &err, KV_EINVAL,
               "element count overflows");
    int64_t wide[1] = {INT64_MAX / 2};
    expect_err(kv_ggufw_add_tensor(w, "a", 28, 1, wide, x, 16, &err), &err, KV_EINVAL,
               "byte size overflows");
    expect_err(kv_ggufw_add_tensor(w, "a", 2, 1, s23, x, 18, &err), &err, KV_EINVAL,
               "unsupported ggml type 2");
    expect_err(kv_ggufw_add_tensor(w, "", 0, 1, s23, x, 8, &err), &err, KV_EINVAL,
               "empty tensor name");
    char longname[300];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    expect_err(kv_ggufw_add_tensor(w, longname, 0, 1, s23, x, 8, &err), &err, KV_EINVAL,
               "is 299 bytes, limit 255");

    /* failed adds leave nothing behind: the writer still writes a valid file */
    cr_assert_eq(kv_ggufw_add_tensor(w, "a", 28, 2, s23, x, 48, &err), KV_OK, "%s",
                 fmt_err(&err));
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "after-errors.gguf");
    cr_assert_eq(kv_ggufw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_gguf_file *g = NULL;
    cr_assert_eq(kv_gguf_open(path, &g, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(g->n_tensors, 1);
    cr_assert_eq(g->n_kv, 0);
    kv_gguf_close(g);
    kv_ggufw_free(w);
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

/* ------------------------------------------------------------ file errors */

Test(ggufw, write_into_a_missing_directory_is_eio_naming_the_path) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();
    cr_assert_eq(kv_ggufw_add_u32(w, "a", 1, &err), KV_OK);
    char *dir = kvt_temp_dir();
    char *sub = kvt_path(dir, "missing");
    char *path = kvt_path(sub, "x.gguf");
    int rc = kv_ggufw_write(w, path, &err);
    expect_err(rc, &err, KV_EIO, "no such file or directory");
    cr_assert_str_eq(err.path, path);
    cr_assert(strstr(fmt_err(&err), path), "'%s' does not name %s", fmt_err(&err), path);
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    cr_assert(!exists(path));
    kv_ggufw_free(w);
    rmdir(dir);
    free(tmp);
    free(path);
    free(sub);
    free(dir);
}

Test(ggufw, failed_rename_removes_the_temporary_file) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_ggufw *w = new_writer();
    cr_assert_eq(kv_ggufw_add_u32(w, "a", 1, &err), KV_OK);
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "is-a-dir");
    cr_assert_eq(mkdir(path, 0755), 0);
    char *inside = kvt_path(path, "keep");
    FILE *f = fopen(inside, "w");
    cr_assert(f);
    fclose(f);
    expect_err(kv_ggufw_write(w, path, &err), &err, KV_EIO, "cannot rename");
    cr_assert_str_eq(err.path, path);
    char *tmp = tmp_of(path);
    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    cr_assert(exists(inside), "the directory was touched");
    kv_ggufw_free(w);
    unlink(inside);
    rmdir(path);
    rmdir(dir);
    free(tmp);
    free(inside);
    free(path);
    free(dir);
}

Test(ggufw, overwrite_replaces_the_old_file_entirely) {
    struct kv_err err;
    kv_err_clear(&err);
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "model.gguf");
    char *tmp = tmp_of(path);
    /* an old, longer file, and a stale temporary from an interrupted run */
    size_t old_len = 100000;
    uint8_t *old = malloc(old_len);
    memset(old, 0xab, old_len);
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    cr_assert_eq(fwrite(old, 1, old_len, f), old_len);
    fclose(f);
    f = fopen(tmp, "wb");
    cr_assert(f);
    cr_assert_eq(fwrite(old, 1, old_len, f), old_len);
    fclose(f);

    struct kv_ggufw *w = new_writer();
    cr_assert_eq(kv_ggufw_add_str(w, "general.name", "new", &err), KV_OK);
    float x[3] = {1.0f, 2.0f, 3.0f};
    int64_t shape[1] = {3};
    cr_assert_eq(kv_ggufw_add_tensor(w, "x", 0, 1, shape, x, sizeof x, &err), KV_OK);
    cr_assert_eq(kv_ggufw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_ggufw_free(w);

    cr_assert_eq(kvt_tmp_left(path), 0, "a temporary of %s left behind", path);
    /* another writer's (or an older version's) temporary is not ours to touch */
    cr_assert_eq(file_size(tmp), (int64_t)old_len, "%s was touched", tmp);
    unlink(tmp);
    int64_t sz = file_size(path);
    cr_assert_lt(sz, (int64_t)old_len);
    size_t len = 0;
    char *bytes = kvt_read_file(path, &len);
    cr_assert_eq((int64_t)len, sz);
    for (size_t i = 0; i < len; i++) cr_assert_neq((uint8_t)bytes[i], 0xab, "old byte at %zu", i);
    free(bytes);
    struct kv_gguf_file *g = NULL;
    cr_assert_eq(kv_gguf_open(path, &g, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(g->n_kv, 1);
    cr_assert_eq(g->n_tensors, 1);
    const struct kv_gguf_tensor *ti = kv_gguf_find_tensor(g, "x");
    cr_assert(ti && !memcmp(ti->t.data, x, sizeof x));
    cr_assert_eq(g->len, g->data_off + 32);
    kv_gguf_close(g);

    free(old);
    unlink(path);
    rmdir(dir);
    free(tmp);
    free(path);
    free(dir);
}
