/* kv_accum against the naive float64 oracle of accum_fixture.h, on synthetic
 * models (GQA, Q/K/V biases, both rope layouts) without the dataset code: the
 * sums, the Fisher sums against independent gradients, and a non-finite
 * activation as KV_ENUMERIC naming the layer and position. collect's
 * properties (merging, checkpoints, seeded draws) are test_collectrun.c's.
 *
 * The stories260K test uses the shared data and skips without it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accum_fixture.h"
#include "kvstats.h"
#include "model.h"
#include "naive_llama.h"
#include "testutil.h"

/* ---------------------------------------------------------------- helpers */

/* The synthetic model: GQA with Q/K/V biases, tied head. */
static struct kv_config synth_cfg(enum kv_rope_layout layout) { return tiny_cfg(layout, 1, 1); }

/* ---------------------------------------------------------------- accumulation */

/* kv_accum on a synthetic model with q/k/v biases and GQA, without the
 * dataset code: random windows, then the oracle. */
static void check_synthetic(enum kv_rope_layout layout) {
    struct kv_config cfg = synth_cfg(layout);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 11, &m, &err), KV_OK, "%s", fmt_err(&err));
    const int64_t seq_len = 40, n_win = 6;
    int32_t *ids = malloc((size_t)(seq_len * n_win) * sizeof *ids);
    uint64_t x = 0x9e3779b97f4a7c15ull + (uint64_t)layout;
    for (int64_t i = 0; i < seq_len * n_win; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((x >> 33) % (uint64_t)cfg.vocab_size);
    }
    struct kv_stats *s = stats_for(m);
    struct kv_accum *a;
    cr_assert_eq(kv_accum_init(m, s, seq_len, &a, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t w = 0; w < n_win; w++)
        cr_assert_eq(kv_accum_window(a, ids + w * seq_len, &err), KV_OK, "%s", fmt_err(&err));
    kv_accum_sync(a);
    kv_accum_free(a);

    struct kv_stats *ref = stats_for(m);
    naive_run(m, ref, ids, n_win, seq_len);
    assert_stats_close(s, ref, STATS_RTOL,
                       layout == KV_ROPE_HALF ? "synthetic rotate-half" : "synthetic interleaved");
    assert_symmetric(s);
    kv_stats_free(ref), kv_stats_free(s);
    free(ids);
    kv_model_close(m);
}

Test(accum, equals_naive_sums_bias_gqa_interleaved_rope) { check_synthetic(KV_ROPE_INTERLEAVED); }

/* 64 query heads of 32 make rows of 2048 floats, so the float64 copy (at
 * most 16 MiB) takes 1024 rows at a time: a window of 1100 is summed in two
 * blocks. */
Test(accum, equals_naive_sums_over_blocks_of_rows, .timeout = 120) {
    struct kv_config cfg = tiny_cfg(KV_ROPE_HALF, 1, 0);
    cfg.dim = 32, cfg.n_heads = 64, cfg.n_kv_heads = 8, cfg.head_dim = 32, cfg.n_layers = 1;
    cfg.max_seq_len = 1100;
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 12, &m, &err), KV_OK, "%s", fmt_err(&err));
    const int64_t seq_len = 1100;
    int32_t *ids = malloc((size_t)seq_len * sizeof *ids);
    for (int64_t i = 0; i < seq_len; i++) ids[i] = (int32_t)((i * 31 + 7) % cfg.vocab_size);
    struct kv_stats *s = stats_for(m);
    struct kv_accum *a;
    cr_assert_eq(kv_accum_init(m, s, seq_len, &a, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_accum_window(a, ids, &err), KV_OK, "%s", fmt_err(&err));
    kv_accum_sync(a);
    kv_accum_free(a);
    struct kv_stats *ref = stats_for(m);
    naive_run(m, ref, ids, 1, seq_len);
    assert_stats_close(s, ref, STATS_RTOL, "1100 rows in blocks of 1024");
    assert_symmetric(s);
    kv_stats_free(ref), kv_stats_free(s);
    free(ids);
    kv_model_close(m);
}
Test(accum, equals_naive_sums_bias_gqa_rotate_half_rope) { check_synthetic(KV_ROPE_HALF); }

Test(accum, refuses_stats_shaped_for_another_model) {
    struct kv_config cfg = synth_cfg(KV_ROPE_HALF), other = cfg;
    other.n_kv_heads = 4;
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 1, &m, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_stats *s;
    cr_assert_eq(kv_stats_init(&other, &s, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_accum *a = NULL;
    cr_assert_eq(kv_accum_init(m, s, 16, &a, &err), KV_EINVAL);
    cr_assert_eq(err.code, KV_EINVAL);
    cr_assert(strstr(err.msg, "another model"), "message: %s", err.msg);
    kv_stats_free(s);
    kv_model_close(m);
}

/* ---------------------------------------------------------------- non-finite */

/* Poison one weight of layer `layer` and expect KV_ENUMERIC naming it. */
static void check_nan_weight(int64_t layer, enum kv_wkind kind, const char *want) {
    struct kv_config cfg = synth_cfg(KV_ROPE_HALF);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 5, &m, &err), KV_OK, "%s", fmt_err(&err));
    /* the random model owns its weights */
    ((float *)m->layers[layer].w[kind])[3] = NAN;
    struct kv_stats *s = stats_for(m);
    struct kv_accum *a;
    cr_assert_eq(kv_accum_init(m, s, 16, &a, &err), KV_OK, "%s", fmt_err(&err));
    int32_t ids[16];
    for (int i = 0; i < 16; i++) ids[i] = (i * 7 + 3) % 97;
    kv_err_clear(&err);
    int rc = kv_accum_window(a, ids, &err);
    cr_assert_eq(rc, KV_ENUMERIC, "returned %d (%s)", rc, fmt_err(&err));
    cr_assert_eq(err.code, KV_ENUMERIC);
    cr_assert_str_eq(err.msg, want);
    kv_accum_free(a);
    kv_stats_free(s);
    kv_model_close(m);
}

Test(accum, nan_key_weight_in_layer_0_is_numeric_error) {
    check_nan_weight(0, KV_W_K, "non-finite post-rope key in layer 0 at window position 0");
}

Test(accum, nan_key_weight_in_layer_1_is_numeric_error) {
    check_nan_weight(1, KV_W_K, "non-finite post-rope key in layer 1 at window position 0");
}

Test(accum, nan_query_weight_is_numeric_error) {
    check_nan_weight(1, KV_W_Q, "non-finite post-rope query in layer 1 at window position 0");
}

/* The position named is the first bad one, also when the check runs on
 * several threads (an activation of more than 65536 values). */
Test(accum, nan_names_first_bad_position_on_threads) {
    struct kv_config cfg = synth_cfg(KV_ROPE_HALF);
    cfg.dim = 512;
    cfg.n_layers = 1;
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 9, &m, &err), KV_OK, "%s", fmt_err(&err));
    kv_set_threads(2);
    ((float *)m->tok_emb)[3 * cfg.dim + 17] = NAN; /* token 3's embedding */
    enum { N = 256 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = 4 + i % 90;
    ids[5] = ids[200] = 3;
    struct kv_stats *s = stats_for(m);
    struct kv_accum *a;
    cr_assert_eq(kv_accum_init(m, s, N, &a, &err), KV_OK, "%s", fmt_err(&err));
    kv_err_clear(&err);
    cr_assert_eq(kv_accum_window(a, ids, &err), KV_ENUMERIC, "%s", fmt_err(&err));
    cr_assert_str_eq(err.msg, "non-finite attention input in layer 0 at window position 5");
    kv_accum_free(a);
    kv_stats_free(s);
    kv_model_close(m);
}

/* ---------------------------------------------------------------- fisher */

/* Relative agreement of Fisher sums: only the summation order differs. */
#define FISHER_RTOL 1e-9

/* The oracle: per window its own kv_grad_run, the W_k/W_v gradients found by
 * name in kv_grad_tensor's table, squares summed in double, and plain triple
 * loops over kv_grad_k/v for the covariances (both triangles). */
static void naive_fisher(const struct kv_model *m, struct kv_stats *ref, const int32_t *ids,
                         int64_t n_windows, int64_t seq_len) {
    const struct kv_config *c = kv_model_config(m);
    int64_t n = seq_len - 1, d = c->dim, g = c->n_kv_heads, dh = c->head_dim, kd = g * dh;
    struct kv_grad *gr;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_grad_init(m, n, &gr, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t w = 0; w < n_windows; w++) {
        double loss;
        cr_assert_eq(kv_grad_run(gr, ids + w * seq_len, n, &loss, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert(isfinite(loss) && loss > 0, "window %lld: loss %g", (long long)w, loss);
        for (int64_t l = 0; l < c->n_layers; l++)
            for (int side = 0; side < 2; side++) {
                char want[64];
                snprintf(want, sizeof want, "blk.%lld.%s projection", (long long)l, side ? "v" : "k");
                const float *grad = NULL;
                int64_t count = 0;
                for (int64_t i = 0; i < kv_grad_n_tensors(gr) && !grad; i++) {
                    const char *name = kv_grad_tensor(gr, i, &count, NULL, NULL);
                    if (!strcmp(name, want)) kv_grad_tensor(gr, i, &count, NULL, &grad);
                }
                cr_assert(grad, "no gradient tensor '%s'", want);
                cr_assert_eq(count, kd * d, "'%s' has %lld elements", want, (long long)count);
                struct kv_stats_layer *R = &ref->layers[l];
                double *fs = side ? R->fisher_v : R->fisher_k;
                for (int64_t r = 0; r < kd; r++) {
                    double t = 0;
                    for (int64_t j = 0; j < d; j++) t += (double)grad[r * d + j] * (double)grad[r * d + j];
                    fs[r] += t;
                }
                const float *gy = side ? kv_grad_v(gr, l) : kv_grad_k(gr, l);
                naive_head_grams(side ? R->grad_v_cov : R->grad_k_cov, gy, n, g, dh);
            }
    }
    kv_grad_free(gr);
}

/* The Fisher tensors of got against ref, elementwise; the worst is named. */
static void assert_fisher_close(const struct kv_stats *got, const struct kv_stats *ref,
                                const char *what) {
    cr_assert(got->info.has_fisher && ref->info.has_fisher, "%s: no fisher sums", what);
    int64_t kd = ref->info.n_kv_heads * ref->info.head_dim, n2 = kd * ref->info.head_dim;
    for (int64_t l = 0; l < ref->info.n_layers; l++) {
        const struct kv_stats_layer *A = &got->layers[l], *B = &ref->layers[l];
        const double *a[4] = {A->fisher_k, A->fisher_v, A->grad_k_cov, A->grad_v_cov};
        const double *b[4] = {B->fisher_k, B->fisher_v, B->grad_k_cov, B->grad_v_cov};
        static const char *const names[4] = {"fisher.k", "fisher.v", "grad_k.cov", "grad_v.cov"};
        for (int t = 0; t < 4; t++) {
            int64_t n = t < 2 ? kd : n2;
            double big = 0;
            for (int64_t i = 0; i < n; i++) big = fmax(big, fabs(b[t][i]));
            cr_assert_gt(big, 0, "%s: reference layer %lld %s is all zero", what, (long long)l,
                         names[t]);
            char label[160];
            snprintf(label, sizeof label, "%s: layer %lld %s", what, (long long)l, names[t]);
            /* off-diagonal covariances may cancel: an absolute floor at the tensor's scale */
            kvt_assert_close_f64(a[t], b[t], n, 1e-13 * big, FISHER_RTOL, label);
        }
    }
}

static void check_fisher(struct kv_model *m, const int32_t *ids, int64_t n_win, int64_t seq_len,
                         const char *what) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stats *s = stats_for(m), *plain = stats_for(m);
    cr_assert_eq(kv_stats_add_fisher(s, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_accum *a, *b;
    cr_assert_eq(kv_accum_init(m, s, seq_len, &a, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_accum_init(m, plain, seq_len, &b, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t w = 0; w < n_win; w++) {
        cr_assert_eq(kv_accum_window(a, ids + w * seq_len, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_gt(kv_accum_loss(a), 0, "window %lld: no loss", (long long)w);
        cr_assert_eq(kv_accum_window(b, ids + w * seq_len, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(kv_accum_loss(b), 0);
    }
    kv_accum_sync(a), kv_accum_sync(b);
    kv_accum_free(a), kv_accum_free(b);

    struct kv_stats *ref = stats_for(m);
    cr_assert_eq(kv_stats_add_fisher(ref, &err), KV_OK, "%s", fmt_err(&err));
    naive_fisher(m, ref, ids, n_win, seq_len);
    assert_fisher_close(s, ref, what);
    /* the gradient covariances are stored in full, symmetric */
    int64_t dh = s->info.head_dim;
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int64_t j = 0; j < s->info.n_kv_heads; j++) {
            assert_square_symmetric(s->layers[l].grad_k_cov + j * dh * dh, dh, "grad_k_cov", l, j);
            assert_square_symmetric(s->layers[l].grad_v_cov + j * dh * dh, dh, "grad_v_cov", l, j);
        }
    /* the forward sums are those of a run without fisher, bit for bit */
    for (int64_t l = 0; l < s->info.n_layers; l++) {
        struct tensor_view x[4], y[4];
        layer_tensors(s, l, x);
        layer_tensors(plain, l, y);
        for (int t = 0; t < 4; t++)
            cr_assert(!memcmp(x[t].p, y[t].p, (size_t)x[t].n * 8),
                      "%s: layer %lld %s changed with fisher", what, (long long)l, x[t].name);
    }
    kv_stats_free(ref), kv_stats_free(s), kv_stats_free(plain);
}

static int32_t *random_ids(int64_t n, int64_t vocab, uint64_t x) {
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    cr_assert(ids);
    for (int64_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((x >> 33) % (uint64_t)vocab);
    }
    return ids;
}

static void check_fisher_synthetic(enum kv_rope_layout layout, int bias) {
    struct kv_config cfg = tiny_cfg(layout, bias, !bias);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 21, &m, &err), KV_OK, "%s", fmt_err(&err));
    sharpen(m);
    const int64_t seq_len = 33, n_win = 4;
    int32_t *ids = random_ids(seq_len * n_win, cfg.vocab_size, 77 + (uint64_t)layout);
    check_fisher(m, ids, n_win, seq_len,
                 layout == KV_ROPE_HALF ? "synthetic rotate-half" : "synthetic interleaved");
    free(ids);
    kv_model_close(m);
}

Test(accum, fisher_sums_equal_independent_gradients_interleaved_bias) {
    check_fisher_synthetic(KV_ROPE_INTERLEAVED, 1);
}
Test(accum, fisher_sums_equal_independent_gradients_rotate_half_untied) {
    check_fisher_synthetic(KV_ROPE_HALF, 0);
}

/* The first 4 windows of val1k on stories260K (tied head, no biases). */
Test(accum, fisher_sums_equal_independent_gradients_stories260K, .timeout = 120) {
    struct kv_model *m = open_stories();
    char *text = shared_copy(VAL_REL);
    struct kv_err err;
    kv_err_clear(&err);
    char *buf;
    size_t len;
    cr_assert_eq(kv_text_read(text, &buf, &len, &err), KV_OK, "%s", fmt_err(&err));
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(kv_model_tokenizer(m), buf, len, 1, &ids, &n, &err), KV_OK, "%s",
                 fmt_err(&err));
    cr_assert_geq(n, 4 * 256);
    check_fisher(m, ids, 4, 256, "stories260K val1k 4x256");
    free(ids), free(buf), free(text);
    kv_model_close(m);
}

Test(accum, fisher_needs_windows_of_two_tokens) {
    struct kv_config cfg = synth_cfg(KV_ROPE_HALF);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&cfg, 1, &m, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_stats *s = stats_for(m);
    cr_assert_eq(kv_stats_add_fisher(s, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_accum *a = NULL;
    cr_assert_eq(kv_accum_init(m, s, 1, &a, &err), KV_EINVAL);
    cr_assert_null(a);
    cr_assert_str_eq(err.msg, "fisher statistics need windows of at least 2 tokens, got 1");
    kv_stats_free(s);
    kv_model_close(m);
}
