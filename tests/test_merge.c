/* kv_stats_merge (calib/accum.c) on statistics built here: exact sums,
 * counts and inputs, and the refusals. */
#include <dirent.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvstats.h"
#include "kvstats_fixture.h"
#include "testutil.h"

#include <criterion/parameterized.h>

/* ------------------------------------------------------------ merge */

Test(kvstats_merge, adds_sums_counts_and_inputs_exactly) {
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_stats(&c, 1.0), *a = make_stats(&c, 1.0);
    struct kv_stats *b = make_stats(&c, -0.7);
    struct kv_err err;
    kv_err_clear(&err);
    /* b: b.txt again (same path and sha: windows add), a new c.txt, and a.txt
     * with other contents (another sha: a new input) */
    for (int64_t i = 0; i < b->info.n_inputs; i++) free(b->inputs[i].path);
    b->info.n_inputs = 0;
    cr_assert_eq(kv_stats_add_input(b, "data/b.txt", SHA_2, 99999, 5000, 5, &err), KV_OK);
    cr_assert_eq(kv_stats_add_input(b, "data/c.txt", SHA_3, 10, 200, 2, &err), KV_OK);
    cr_assert_eq(kv_stats_add_input(b, "data/a.txt", SHA_4, 77, 88, 1, &err), KV_OK);
    b->info.windows = 8;
    b->info.tokens = 8 * SEQ_LEN;
    b->info.plan_windows = b->info.next_window = 8;
    b->info.shard_index = 2;

    cr_assert_eq(kv_stats_merge(acc, b, "b.kvstats", &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int t = 0; t < KV_STATS_PER_LAYER; t++) {
            char name[64];
            int64_t shape[3];
            int64_t n = numel(shape, kv_stats_tensor_desc(acc, l, t, name, sizeof name, shape));
            const double *x = kv_stats_tensor_data(a, l, t), *y = kv_stats_tensor_data(b, l, t);
            double *want = malloc((size_t)n * 8);
            for (int64_t i = 0; i < n; i++) want[i] = x[i] + y[i];
            cr_assert(!memcmp(kv_stats_tensor_data(acc, l, t), want, (size_t)n * 8),
                      "tensor '%s' is not the exact element-wise sum", name);
            free(want);
        }
    cr_assert_eq(acc->info.windows, 15);
    cr_assert_eq(acc->info.tokens, 15 * SEQ_LEN);
    cr_assert_str_eq(acc->info.sampling, "merged");
    cr_assert_eq(acc->info.plan_windows, 15);
    cr_assert_eq(acc->info.next_window, 15);
    cr_assert_eq(acc->info.seed, 0);
    cr_assert_eq(acc->info.samples, 0);
    cr_assert_eq(acc->info.shard_index, 0);
    cr_assert_eq(acc->info.shard_count, 1);
    cr_assert_str_eq(acc->info.fingerprint, FP_A);
    cr_assert_eq(acc->info.seq_len, SEQ_LEN);
    static const struct {
        const char *path, *sha;
        uint64_t bytes;
        int64_t tokens, windows;
    } in[] = {{"data/a.txt", SHA_1, 1234, 600, 3},
              {"data/b.txt", SHA_2, 99999, 5000, 9},
              {"data/c.txt", SHA_3, 10, 200, 2},
              {"data/a.txt", SHA_4, 77, 88, 1}};
    cr_assert_eq(acc->info.n_inputs, 4);
    for (int i = 0; i < 4; i++) {
        cr_assert_str_eq(acc->inputs[i].path, in[i].path, "input %d", i);
        cr_assert_str_eq(acc->inputs[i].sha256, in[i].sha, "input %d", i);
        cr_assert_eq(acc->inputs[i].bytes, in[i].bytes, "input %d", i);
        cr_assert_eq(acc->inputs[i].tokens, in[i].tokens, "input %d", i);
        cr_assert_eq(acc->inputs[i].windows, in[i].windows, "input %d", i);
    }

    /* the merged statistics are a valid file */
    char *dir = kvt_temp_dir();
    char *path = write_stats(acc, dir, "merged.kvstats");
    struct kv_stats *r = NULL;
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    assert_stats_eq(acc, r);
    kv_stats_free(r);
    free(path);
    rm_tree(dir);
    kv_stats_free(acc), kv_stats_free(a), kv_stats_free(b);
}

Test(kvstats_merge, adds_fisher_sums_exactly) {
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_fisher_stats(&c, 1.0), *a = make_fisher_stats(&c, 1.0);
    struct kv_stats *b = make_fisher_stats(&c, -0.7);
    b->info.shard_index = 2;
    struct kv_err err;
    kv_err_clear(&err);
    /* b's inputs are a's (same windows again), so make room for them */
    for (int64_t i = 0; i < b->info.n_inputs; i++) acc->inputs[i].tokens = b->inputs[i].tokens = 1 << 20;
    cr_assert_eq(kv_stats_merge(acc, b, "b.kvstats", &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(acc->info.has_fisher, 1);
    cr_assert_eq(kv_stats_layer_tensors(acc), 8);
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int t = 0; t < 8; t++) {
            char name[64];
            int64_t shape[3];
            int64_t n = numel(shape, kv_stats_tensor_desc(acc, l, t, name, sizeof name, shape));
            const double *x = kv_stats_tensor_data(a, l, t), *y = kv_stats_tensor_data(b, l, t);
            const double *got = kv_stats_tensor_data(acc, l, t);
            for (int64_t i = 0; i < n; i++)
                cr_assert(got[i] == x[i] + y[i], "tensor '%s' element %lld: %.17g, expected %.17g",
                          name, (long long)i, got[i], x[i] + y[i]);
        }
    kv_stats_free(acc), kv_stats_free(a), kv_stats_free(b);
}

Test(kvstats_merge, refuses_fisher_with_non_fisher_either_way) {
    struct kv_config c = small_cfg();
    for (int k = 0; k < 2; k++) {
        struct kv_stats *acc = k ? make_fisher_stats(&c, 1.0) : make_stats(&c, 1.0);
        struct kv_stats *b = k ? make_stats(&c, 2.0) : make_fisher_stats(&c, 2.0);
        b->info.shard_index = 2;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_stats_merge(acc, b, "shards/b.kvstats", &err), KV_EINVAL, "%s",
                     fmt_err(&err));
        cr_assert_str_eq(err.path, "shards/b.kvstats");
        cr_assert_str_eq(err.msg, k ? "has no fisher statistics and the first shard has them; "
                                      "collect every shard with --fisher, or none"
                                    : "has fisher statistics and the first shard has none; "
                                      "collect every shard with --fisher, or none");
        cr_assert_eq(acc->info.windows, 7, "a refusal changes nothing");
        cr_assert_eq(acc->info.has_fisher, k);
        kv_stats_free(acc), kv_stats_free(b);
    }
}

typedef struct kv_stats *(*make_b_fn)(void);

static struct kv_stats *b_other_model(void) {
    struct kv_config c = small_cfg();
    struct kv_stats *b = make_stats(&c, 2.0);
    snprintf(b->info.fingerprint, sizeof b->info.fingerprint, "%s", FP_B);
    return b;
}
static struct kv_stats *b_other_seq_len(void) {
    struct kv_config c = small_cfg();
    struct kv_stats *b = make_stats(&c, 2.0);
    b->info.seq_len = 2 * SEQ_LEN;
    b->info.tokens = b->info.windows * b->info.seq_len;
    return b;
}
static struct kv_stats *b_other_shape(void) {
    struct kv_config c = small_cfg();
    c.dim = 8, c.n_heads = 2, c.n_kv_heads = 1;
    return make_stats(&c, 2.0);
}
static struct kv_stats *b_checkpoint(void) {
    struct kv_config c = small_cfg();
    struct kv_stats *b = make_stats(&c, 2.0);
    b->info.plan_windows = 10;
    return b;
}

struct merge_row {
    const char *name;
    make_b_fn make;
    const char *substr;
};

static const struct merge_row merge_rows[] = {
    {"another fingerprint", b_other_model,
     "collected on another model (fingerprint fedcba987654, the first shard has 0123456789ab)"},
    {"another seq_len", b_other_seq_len, "seq-len 64 differs from the first shard's 32"},
    {"another shape", b_other_shape,
     "shaped for another model (dim 8, 2 layers; the first shard has dim 16, 2 layers)"},
    {"an unfinished checkpoint", b_checkpoint,
     "an unfinished checkpoint (7 of 10 windows); finish it with 'kvcal collect --resume' first"},
};
#define N_MERGE_ROWS (sizeof merge_rows / sizeof merge_rows[0])

ParameterizedTestParameters(kvstats_merge, refuses_shards_that_do_not_add_up) {
    static int idx[N_MERGE_ROWS];
    for (size_t i = 0; i < N_MERGE_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_MERGE_ROWS);
}

ParameterizedTest(int *ip, kvstats_merge, refuses_shards_that_do_not_add_up) {
    const struct merge_row *r = &merge_rows[*ip];
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_stats(&c, 1.0), *before = make_stats(&c, 1.0);
    struct kv_stats *b = r->make();
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_stats_merge(acc, b, "shards/b.kvstats", &err);
    cr_assert_eq(rc, KV_EINVAL, "%s: code %d (%s)", r->name, rc, fmt_err(&err));
    cr_assert_str_eq(err.path, "shards/b.kvstats", "%s", r->name);
    cr_assert_eq(err.off, KV_NO_OFFSET, "%s", r->name);
    cr_assert(strstr(err.msg, r->substr), "%s: message '%s' lacks '%s'", r->name, err.msg,
              r->substr);
    cr_assert_null(strchr(err.msg, '\n'), "%s: one line", r->name);
    assert_stats_eq(acc, before); /* a refusal changes nothing */
    kv_stats_free(acc), kv_stats_free(before), kv_stats_free(b);
}

/* Counts that fit a file each (tokens = windows * seq_len <= INT64_MAX) but
 * not their sum: the merge must refuse instead of wrapping into a negative
 * count that kv_stats_write stores as a huge uint64 the reader rejects. */
Test(kvstats_merge, refuses_counts_that_overflow) {
    struct kv_config c = small_cfg();
    struct kv_stats *acc = make_stats(&c, 1.0), *b = make_stats(&c, 1.0);
    for (int k = 0; k < 2; k++) {
        struct kv_stats *s = k ? b : acc;
        for (int64_t i = 0; i < s->info.n_inputs; i++) free(s->inputs[i].path);
        s->info.n_inputs = 0;
        s->info.seq_len = 1;
        s->info.windows = s->info.tokens = INT64_MAX / 4 * 3;
        s->info.plan_windows = s->info.next_window = s->info.windows;
    }
    /* each is a file kv_stats_open accepts */
    char *dir = kvt_temp_dir();
    char *path = write_stats(b, dir, "big.kvstats");
    struct kv_stats *r = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &r, &err), KV_OK, "%s", fmt_err(&err));
    kv_stats_free(r);

    kv_err_clear(&err);
    int rc = kv_stats_merge(acc, b, path, &err);
    cr_assert_neq(rc, KV_OK, "merge wrapped the token count to %lld", (long long)acc->info.tokens);
    cr_assert_str_eq(err.path, path);
    cr_assert_eq(acc->info.tokens, INT64_MAX / 4 * 3, "a refusal changes nothing");
    free(path);
    rm_tree(dir);
    kv_stats_free(acc), kv_stats_free(b);
}
