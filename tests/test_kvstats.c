/* Statistics files (.kvstats, formats/kvstats.c), writing: a round trip of
 * every field and tensor bit for bit, the probe, the writer's refusals
 * (non-finite sums, unwritable paths), and the independent writer of
 * kvstats_handwrite.h, which must reproduce kv_stats_write byte for byte.
 * Parsing is test_kvstats_parse.c's, kv_stats_merge test_merge.c's. */
#include <dirent.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvstats.h"
#include "kvstats_fixture.h"
#include "kvstats_handwrite.h"
#include "testutil.h"

static int dir_entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert(d, "cannot open %s", dir);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* ------------------------------------------------------------ write */

Test(kvstats_write, round_trips_every_field_and_tensor_bit_for_bit) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    /* a checkpoint, and values at the edges of float64 */
    s->info.plan_windows = 10;
    s->info.next_window = 7;
    double *sum = s->layers[1].xsum;
    sum[0] = -0.0, sum[1] = DBL_TRUE_MIN, sum[2] = DBL_MAX, sum[3] = -DBL_MIN, sum[4] = -DBL_MAX;
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "rt.kvstats");
    cr_assert_eq(dir_entries(dir), 1, "only the file, no .tmp left over");

    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(s, r);
    cr_assert_str_eq(r->info.version, KVCAL_VERSION);
    cr_assert_eq(r->info.n_inputs, 2);
    cr_assert(signbit(r->layers[1].xsum[0]), "-0.0 keeps its sign");

    /* the byte parser agrees with open */
    size_t len;
    char *bytes = kvt_read_file(path, &len);
    struct kv_stats *q = NULL;
    cr_assert_eq(kv_stats_parse(bytes, len, path, &q, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(s, q);
    kv_stats_free(q);
    free(bytes);
    kv_stats_free(r);
    kv_stats_free(s);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, layout_matches_an_independent_writer_byte_for_byte) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *a = write_stats(s, dir, "lib.kvstats");
    struct hspec h = hspec_default();
    char *b = hand_write(s, &h, dir, "hand.kvstats");
    size_t la, lb;
    char *pa = kvt_read_file(a, &la), *pb = kvt_read_file(b, &lb);
    cr_assert_eq(la, lb, "sizes %zu and %zu", la, lb);
    size_t i = 0;
    while (i < la && pa[i] == pb[i]) i++;
    cr_assert_eq(i, la, "first difference at byte %zu", i);
    free(pa), free(pb), free(a), free(b);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, round_trips_fisher_statistics_and_matches_an_independent_writer) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_fisher_stats(&c, 1.0);
    /* an empty sum of squares is 0, and off-diagonals of a Gram may be negative */
    s->layers[1].fisher_v[0] = 0.0;
    cr_assert_lt(s->layers[0].grad_k_cov[1], 0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "f.kvstats");
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(r->info.has_fisher, 1);
    assert_stats_eq(s, r);
    kv_stats_free(r);

    struct hspec h = hspec_default();
    char *b = hand_write(s, &h, dir, "hand.kvstats");
    size_t la, lb;
    char *pa = kvt_read_file(path, &la), *pb = kvt_read_file(b, &lb);
    cr_assert_eq(la, lb, "sizes %zu and %zu", la, lb);
    size_t i = 0;
    while (i < la && pa[i] == pb[i]) i++;
    cr_assert_eq(i, la, "first difference at byte %zu", i);
    free(pa), free(pb), free(b), free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, a_file_without_fisher_reads_as_none) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    cr_assert_eq(s->info.has_fisher, 0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "old.kvstats");
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(r->info.has_fisher, 0);
    cr_assert_eq(kv_stats_layer_tensors(r), 4);
    for (int64_t l = 0; l < r->info.n_layers; l++)
        cr_assert(!r->layers[l].fisher_k && !r->layers[l].fisher_v && !r->layers[l].grad_k_cov &&
                  !r->layers[l].grad_v_cov, "layer %lld has fisher pointers", (long long)l);
    /* its 7 windows have no fisher sums, and none can be added after them */
    cr_assert_eq(kv_stats_add_fisher(r, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "statistics of 7 windows have no fisher sums to extend; fisher sums "
                              "start with the first window");
    cr_assert_eq(r->info.has_fisher, 0);
    cr_assert_null(r->layers[0].fisher_k);
    kv_stats_free(r), kv_stats_free(s);

    /* fresh statistics take zeroed sums, once */
    cr_assert_eq(kv_stats_init(&c, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_stats_add_fisher(r, &err), KV_OK, "%s", fmt_err(&err));
    double *fk = r->layers[0].fisher_k;
    cr_assert_eq(kv_stats_add_fisher(r, &err), KV_OK, "a second call is a no-op");
    cr_assert_eq(r->layers[0].fisher_k, fk);
    cr_assert_eq(kv_stats_layer_tensors(r), 8);
    for (int64_t k = 0; k < c.n_kv_heads * c.head_dim; k++)
        cr_assert(r->layers[1].fisher_v[k] == 0 && r->layers[0].grad_v_cov[k] == 0);
    kv_stats_free(r);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, probe_recognises_only_stats_files) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "p.kvstats");
    cr_assert_eq(kv_stats_probe(path), 1);
    char *txt = kvt_path(dir, "notes.txt");
    put_file(txt, "Once upon a time\n", 17);
    cr_assert_eq(kv_stats_probe(txt), 0);
    char *magic = kvt_path(dir, "magic.gguf");
    put_file(magic, "GGUF", 4);
    cr_assert_eq(kv_stats_probe(magic), 0);
    char *none = kvt_path(dir, "absent.kvstats");
    cr_assert_eq(kv_stats_probe(none), 0);
    cr_assert_eq(kv_stats_probe(dir), 0);
    free(txt), free(magic), free(none), free(path);
    kv_stats_free(s);
    rm_tree(dir);
    KVT_NEED_SHARED(model, "models/stories260K/stories260K.gguf");
    cr_assert_eq(kv_stats_probe(model), 0);
}

/* NaN into the strict lower triangles of every symmetric matrix of s */
static void poison_lower(struct kv_stats *s) {
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int t = 0; t < kv_stats_layer_tensors(s); t++) {
            if (t == 1 || t == 4 || t == 5) continue; /* the vectors */
            int64_t shape[3];
            char name[64];
            int nd = kv_stats_tensor_desc(s, l, t, name, sizeof name, shape);
            int64_t mats = nd == 3 ? shape[0] : 1, n = shape[nd - 1];
            double *p = kv_stats_tensor_data(s, l, t);
            for (int64_t m = 0; m < mats; m++)
                for (int64_t i = 0; i < n; i++)
                    for (int64_t j = 0; j < i; j++) p[m * n * n + i * n + j] = NAN;
        }
}

Test(kvstats_write, upper_triangles_alone_write_the_same_bytes_and_mirror_back) {
    struct kv_config c = small_cfg();
    struct kv_stats *whole = make_fisher_stats(&c, 1.0), *up = make_fisher_stats(&c, 1.0);
    poison_lower(up);
    up->upper = 1;
    char *dir = kvt_temp_dir();
    char *pa = write_stats(whole, dir, "whole.kvstats"), *pb = write_stats(up, dir, "upper.kvstats");
    size_t la, lb;
    char *a = kvt_read_file(pa, &la), *b = kvt_read_file(pb, &lb);
    cr_assert_eq(la, lb, "sizes %zu and %zu", la, lb);
    size_t i = 0;
    while (i < la && a[i] == b[i]) i++;
    cr_assert_eq(i, la, "first difference at byte %zu of %zu", i, la);
    kv_stats_mirror(up);
    cr_assert_eq(up->upper, 0);
    assert_stats_eq(whole, up);
    free(a), free(b), free(pa), free(pb);
    kv_stats_free(whole), kv_stats_free(up);
    rm_tree(dir);
}

/* Each layer's xtx starts on a 4 KiB page, so a row of 512k doubles is k
 * whole pages and upper-triangle sums leave the pages below untouched. */
Test(kvstats_write, every_xtx_starts_on_a_page) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    for (int64_t l = 0; l < s->info.n_layers; l++)
        cr_assert_eq((uintptr_t)s->layers[l].xtx % 4096, 0, "layer %lld's xtx at %p",
                     (long long)l, (void *)s->layers[l].xtx);
    kv_stats_free(s);
}

Test(kvstats_write, upper_triangles_alone_refuse_a_non_finite_sum_at_both_its_elements) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    poison_lower(s);
    s->upper = 1;
    int64_t d = s->info.dim;
    s->layers[0].xtx[2 * d + 5] = INFINITY; /* row 2, column 5: the file's (5, 2) too */
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "inf.kvstats");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_ENUMERIC, "%s", fmt_err(&err));
    char want[128];
    snprintf(want, sizeof want, "tensor 'blk.0.attn_in.xtx': non-finite value inf at element %lld;",
             (long long)(2 * d + 5));
    cr_assert(strstr(err.msg, want), "message '%s' lacks '%s'", err.msg, want);
    cr_assert_eq(dir_entries(dir), 0, "neither the file nor a .tmp may exist");
    free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

static void expect_no_write_of_nonfinite(int64_t layer, int t, int64_t k, double x,
                                         const char *name) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    kv_stats_tensor_data(s, layer, t)[k] = x;
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "nan.kvstats");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_ENUMERIC, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, path);
    char want[128];
    snprintf(want, sizeof want, "tensor '%s': non-finite value", name);
    cr_assert(strstr(err.msg, want), "message '%s' lacks '%s'", err.msg, want);
    snprintf(want, sizeof want, "element %lld", (long long)k);
    cr_assert(strstr(err.msg, want), "message '%s' lacks '%s'", err.msg, want);
    cr_assert_eq(dir_entries(dir), 0, "neither the file nor a .tmp may exist");
    free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, refuses_non_finite_sums_and_writes_nothing) {
    expect_no_write_of_nonfinite(1, 2, 7, NAN, "blk.1.q_rope.cov");
    expect_no_write_of_nonfinite(0, 0, 16 * 3 + 5, INFINITY, "blk.0.attn_in.xtx");
    expect_no_write_of_nonfinite(1, 3, 31, -INFINITY, "blk.1.k_rope.cov");
}

/* A negative value where a sum of squares belongs: KV_ENUMERIC, nothing written. */
static void expect_no_write_of_negative(int64_t layer, int t, int64_t k, const char *name) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_fisher_stats(&c, 1.0);
    kv_stats_tensor_data(s, layer, t)[k] = -0.25;
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "neg.kvstats");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_ENUMERIC, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, path);
    char want[256];
    snprintf(want, sizeof want,
             "tensor '%s': negative value -0.25 at element %lld, where a sum of squares belongs; "
             "not written", name, (long long)k);
    cr_assert_str_eq(err.msg, want);
    cr_assert_eq(dir_entries(dir), 0, "neither the file nor a .tmp may exist");
    free(path);
    kv_stats_free(s);
    rm_tree(dir);
}

Test(kvstats_write, refuses_negative_sums_of_squares_and_writes_nothing) {
    expect_no_write_of_negative(0, 4, 5, "blk.0.fisher.k");
    expect_no_write_of_negative(1, 5, 0, "blk.1.fisher.v");
    expect_no_write_of_negative(1, 6, 4 * 4 * 1 + 3 * 5, "blk.1.grad_k.cov"); /* head 1 (3, 3) */
    expect_no_write_of_negative(0, 7, 0, "blk.0.grad_v.cov");
    expect_no_write_of_nonfinite(1, 3, 31, NAN, "blk.1.k_rope.cov");
}

Test(kvstats_write, refused_write_keeps_the_previous_file) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "keep.kvstats");
    s->layers[0].xsum[3] = NAN;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_ENUMERIC);
    struct kv_stats *r = NULL;
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(r->layers[0].xsum[3], -(double)(1 * 4096 + 3) / 7.0);
    cr_assert_eq(dir_entries(dir), 1);
    kv_stats_free(r);
    kv_stats_free(s);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, replaces_an_existing_file) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0), *t = make_stats(&c, -2.5);
    char *dir = kvt_temp_dir();
    char *path = write_stats(s, dir, "twice.kvstats");
    free(write_stats(t, dir, "twice.kvstats"));
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(t, r);
    cr_assert_eq(dir_entries(dir), 1);
    kv_stats_free(r), kv_stats_free(s), kv_stats_free(t);
    free(path);
    rm_tree(dir);
}

Test(kvstats_write, names_the_path_it_cannot_create) {
    struct kv_config c = small_cfg();
    struct kv_stats *s = make_stats(&c, 1.0);
    char *dir = kvt_temp_dir();
    char *sub = kvt_path(dir, "no-such-dir");
    char *path = kvt_path(sub, "out.kvstats");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_EIO, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, path);
    cr_assert_eq(err.off, KV_NO_OFFSET);
    cr_assert(strstr(err.msg, "cannot create"), "%s", err.msg);
    cr_assert(strstr(err.msg, "no such file or directory"), "%s", err.msg);
    cr_assert_eq(dir_entries(dir), 0);
    free(sub), free(path);
    kv_stats_free(s);
    rm_tree(dir);
}
