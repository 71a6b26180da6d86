/* What the statistics-file suites share (test_kvstats.c,
 * test_kvstats_parse.c, test_merge.c): a small config, statistics filled with
 * distinct deterministic values, written and compared bit for bit. */
#ifndef KV_KVSTATS_FIXTURE_H
#define KV_KVSTATS_FIXTURE_H

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvstats.h"
#include "testutil.h"

/* Fingerprints, dataset hashes and the window length make_stats uses. */
#define FP_A "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
#define FP_B "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
#define SHA_1 "1111111111111111111111111111111111111111111111111111111111111111"
#define SHA_2 "2222222222222222222222222222222222222222222222222222222222222222"
#define SHA_3 "33333333333333333333333333333333333333333333333333333333333333cc"
#define SHA_4 "44444444444444444444444444444444444444444444444444444444444444dd"
#define SEQ_LEN 32

/* dim 16, 2 layers, 4 heads of 4, 2 kv heads: tensors of 2048, 128, 512 and
 * 256 bytes per layer, every one a multiple of the 32-byte alignment. */
static inline struct kv_config small_cfg(void) {
    struct kv_config c = {0};
    c.dim = 16, c.hidden_dim = 24, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 4, c.vocab_size = 32, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.tied_embeddings = 1, c.bos_id = 1, c.eos_id = 2;
    return c;
}

/* An error as one line, with the detection site. */
static inline const char *fmt_err(const struct kv_err *e) {
    static char buf[2200];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

/* Elements of a tensor of nd dimensions. */
static inline int64_t numel(const int64_t *shape, int nd) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    return n;
}

/* Element (a, b) of matrix m of tensor id: symmetric in (a, b), distinct for
 * every unordered pair, matrix and tensor, and not a short binary fraction. */
static inline double sym_val(int64_t id, int64_t m, int64_t a, int64_t b, double scale) {
    int64_t lo = a < b ? a : b, hi = a < b ? b : a;
    return scale * (double)(((id * 64 + m) * 64 + lo) * 64 + hi + 1) / 3.0;
}

/* Every tensor of s gets distinct deterministic values (matrices symmetric;
 * Fisher sums positive, and so the gradient covariances' diagonals). */
static inline void fill(struct kv_stats *s, double scale) {
    int64_t d = s->info.dim, hd = s->info.head_dim, kd = s->info.n_kv_heads * hd;
    for (int64_t l = 0; l < s->info.n_layers; l++) {
        struct kv_stats_layer *y = &s->layers[l];
        int64_t id = l * (KV_STATS_PER_LAYER + KV_STATS_FISHER_PER_LAYER);
        if (s->info.has_fisher) {
            for (int64_t r = 0; r < kd; r++) {
                y->fisher_k[r] = fabs(scale) * (double)((id + 4) * 4096 + r + 1) / 11.0;
                y->fisher_v[r] = fabs(scale) * (double)((id + 5) * 4096 + r + 1) / 13.0;
            }
            for (int64_t m = 0; m < s->info.n_kv_heads; m++)
                for (int64_t i = 0; i < hd; i++)
                    for (int64_t j = 0; j < hd; j++) {
                        double sg = i == j ? fabs(scale) : -scale; /* negative off-diagonals */
                        y->grad_k_cov[(m * hd + i) * hd + j] = sg * sym_val(id + 6, m, i, j, 1.0);
                        y->grad_v_cov[(m * hd + i) * hd + j] = sg * sym_val(id + 7, m, i, j, 1.0);
                    }
        }
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < d; j++) y->xtx[i * d + j] = sym_val(id, 0, i, j, scale);
        for (int64_t i = 0; i < d; i++) y->xsum[i] = -scale * (double)((id + 1) * 4096 + i) / 7.0;
        for (int64_t m = 0; m < s->info.n_heads; m++)
            for (int64_t i = 0; i < hd; i++)
                for (int64_t j = 0; j < hd; j++)
                    y->q_cov[(m * hd + i) * hd + j] = sym_val(id + 2, m, i, j, scale);
        for (int64_t m = 0; m < s->info.n_kv_heads; m++)
            for (int64_t i = 0; i < hd; i++)
                for (int64_t j = 0; j < hd; j++)
                    y->k_cov[(m * hd + i) * hd + j] = sym_val(id + 3, m, i, j, scale);
    }
}

/* Statistics of two inputs (3 + 4 windows of SEQ_LEN), plan finished. */
static inline struct kv_stats *make_stats(const struct kv_config *c, double scale) {
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(c, &s, &err), KV_OK, "%s", fmt_err(&err));
    fill(s, scale);
    snprintf(s->info.fingerprint, sizeof s->info.fingerprint, "%s", FP_A);
    s->info.seq_len = SEQ_LEN;
    cr_assert_eq(kv_stats_add_input(s, "data/a.txt", SHA_1, 1234, 600, 3, &err), KV_OK);
    cr_assert_eq(kv_stats_add_input(s, "data/b.txt", SHA_2, 99999, 5000, 4, &err), KV_OK);
    s->info.windows = 7;
    s->info.tokens = s->info.windows * SEQ_LEN;
    snprintf(s->info.sampling, sizeof s->info.sampling, "random");
    s->info.seed = 0xfedcba9876543210ull;
    s->info.samples = 7;
    s->info.shard_index = 1;
    s->info.shard_count = 3;
    s->info.plan_windows = 7;
    s->info.next_window = 7;
    return s;
}

/* make_stats with Fisher statistics. */
static inline struct kv_stats *make_fisher_stats(const struct kv_config *c, double scale) {
    struct kv_stats *s = make_stats(c, scale);
    struct kv_err err;
    kv_err_clear(&err);
    int64_t windows = s->info.windows;
    s->info.windows = 0; /* fisher sums start with the first window */
    cr_assert_eq(kv_stats_add_fisher(s, &err), KV_OK, "%s", fmt_err(&err));
    s->info.windows = windows;
    cr_assert_eq(s->info.has_fisher, 1);
    fill(s, scale);
    return s;
}

/* Every field and every tensor of a and b agree bit for bit. */
static inline void assert_stats_eq(const struct kv_stats *a, const struct kv_stats *b) {
    cr_assert_eq(a->info.n_layers, b->info.n_layers);
    cr_assert_eq(a->info.dim, b->info.dim);
    cr_assert_eq(a->info.n_heads, b->info.n_heads);
    cr_assert_eq(a->info.n_kv_heads, b->info.n_kv_heads);
    cr_assert_eq(a->info.head_dim, b->info.head_dim);
    cr_assert_str_eq(a->info.fingerprint, b->info.fingerprint);
    cr_assert_str_eq(a->info.version, b->info.version);
    cr_assert_eq(a->info.seq_len, b->info.seq_len);
    cr_assert_eq(a->info.tokens, b->info.tokens);
    cr_assert_eq(a->info.windows, b->info.windows);
    cr_assert_str_eq(a->info.sampling, b->info.sampling);
    cr_assert_eq(a->info.seed, b->info.seed);
    cr_assert_eq(a->info.samples, b->info.samples);
    cr_assert_eq(a->info.shard_index, b->info.shard_index);
    cr_assert_eq(a->info.shard_count, b->info.shard_count);
    cr_assert_eq(a->info.plan_windows, b->info.plan_windows);
    cr_assert_eq(a->info.next_window, b->info.next_window);
    cr_assert_eq(a->info.has_fisher, b->info.has_fisher);
    cr_assert_eq(a->info.n_inputs, b->info.n_inputs);
    for (int64_t i = 0; i < a->info.n_inputs; i++) {
        cr_assert_str_eq(a->inputs[i].path, b->inputs[i].path, "input %lld", (long long)i);
        cr_assert_str_eq(a->inputs[i].sha256, b->inputs[i].sha256, "input %lld", (long long)i);
        cr_assert_eq(a->inputs[i].bytes, b->inputs[i].bytes, "input %lld", (long long)i);
        cr_assert_eq(a->inputs[i].tokens, b->inputs[i].tokens, "input %lld", (long long)i);
        cr_assert_eq(a->inputs[i].windows, b->inputs[i].windows, "input %lld", (long long)i);
    }
    for (int64_t l = 0; l < a->info.n_layers; l++)
        for (int t = 0; t < kv_stats_layer_tensors(a); t++) {
            char name[64];
            int64_t shape[3];
            int nd = kv_stats_tensor_desc(a, l, t, name, sizeof name, shape);
            cr_assert(!memcmp(kv_stats_tensor_data(a, l, t), kv_stats_tensor_data(b, l, t),
                              (size_t)numel(shape, nd) * 8),
                      "tensor '%s' differs", name);
        }
}

/* Write n bytes at p as the file path. */
static inline void put_file(const char *path, const void *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    cr_assert(fp, "cannot create %s", path);
    cr_assert_eq(fwrite(p, 1, n, fp), n);
    cr_assert_eq(fclose(fp), 0);
}

/* Remove a temporary directory this test made (flat) and free its path. */
static inline void rm_tree(char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        for (struct dirent *e; (e = readdir(d));) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char *p = kvt_path(dir, e->d_name);
            unlink(p);
            free(p);
        }
        closedir(d);
    }
    rmdir(dir);
    free(dir);
}

/* kv_stats_write s as dir/name; returns the malloc'd path. */
static inline char *write_stats(const struct kv_stats *s, const char *dir, const char *name) {
    char *path = kvt_path(dir, name);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_write(s, path, &err), KV_OK, "%s", fmt_err(&err));
    return path;
}

#endif
