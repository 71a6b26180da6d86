/* Calibration statistics against a naive float64 oracle written here: our own
 * forward hooks copy the fp32 activations and plain triple loops sum XᵀX, Σx,
 * QᵀQ per query head and KᵀK per KV head (no BLAS, nothing shared with
 * calib/accum.c). Then the properties collect promises: shards and inputs
 * merge by addition, a resumed checkpoint finishes byte-identical to an
 * uninterrupted run, a seeded draw is reproducible, and a non-finite
 * activation is KV_ENUMERIC naming the layer.
 *
 * The real-model tests use stories260K (.bin with tok512.bin) and
 * TinyStories val1k.txt from the shared data and skip without them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvstats.h"
#include "model.h"
#include "naive_llama.h"
#include "testutil.h"

#define MODEL_REL "models/stories260K/stories260K.bin"
#define TOK_REL "models/stories260K/tok512.bin"
#define VAL_REL "text/tinystories/val1k.txt"

/* Sums equal up to summation order: far tighter than any fp32 effect. */
#define STATS_RTOL 1e-12

/* ---------------------------------------------------------------- helpers */

static const char *fmt_err(const struct kv_err *e) {
    static __thread char buf[2600];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

/* Copy of a shared path (kvt_shared's buffer is reused); skips when absent. */
static char *shared_copy(const char *rel) {
    KVT_NEED_SHARED(p, rel);
    char *s = strdup(p);
    cr_assert(s);
    return s;
}

/* One thread: Criterion runs two tests at once on two cores, and spinning
 * OpenMP teams of two in each would oversubscribe them many times over. */
static struct kv_model *open_stories(void) {
    kv_set_threads(1);
    char *mp = shared_copy(MODEL_REL), *tp = shared_copy(TOK_REL);
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(mp, tp, &m, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert(kv_model_tokenizer(m));
    free(mp), free(tp);
    return m;
}

/* The synthetic model: GQA with Q/K/V biases, tied head. */
static struct kv_config synth_cfg(enum kv_rope_layout layout) { return tiny_cfg(layout, 1, 1); }

static struct kv_stats *stats_for(const struct kv_model *m) {
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_init(kv_model_config(m), &s, &err), KV_OK, "%s", fmt_err(&err));
    return s;
}

static struct kv_stats *open_stats(const char *path) {
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &s, &err), KV_OK, "%s", fmt_err(&err));
    return s;
}

static struct kv_calib *calib_open(const char *const *paths, int64_t n, const struct kv_model *m,
                                   const struct kv_calib_opts *o) {
    struct kv_calib *c = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_calib_open(paths, n, kv_model_tokenizer(m), o, &c, &err), KV_OK, "%s",
                 fmt_err(&err));
    return c;
}

/* A fresh collect of paths with options o into out_path (may be NULL); the
 * sums are returned when keep is non-NULL. */
static void collect(const struct kv_model *m, const char *const *paths, int64_t n,
                    const struct kv_calib_opts *o, const char *out_path, struct kv_stats **keep) {
    struct kv_calib *c = calib_open(paths, n, m, o);
    struct kv_stats *s = stats_for(m);
    struct kv_collect_opts co = {0};
    co.out_path = out_path;
    co.data = o;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_collect_run(m, c, s, &co, &err), KV_OK, "%s", fmt_err(&err));
    kv_calib_free(c);
    if (keep)
        *keep = s;
    else
        kv_stats_free(s);
}

static struct kv_calib_opts calib_opts(int64_t seq_len, int64_t samples, int sequential,
                                       uint64_t seed, int64_t shard_index, int64_t shard_count) {
    struct kv_calib_opts o = {seq_len, samples, sequential, seed, shard_index, shard_count};
    return o;
}

static char *read_all(const char *path, size_t *len) {
    char *b = kvt_read_file(path, len);
    cr_assert(b, "cannot read '%s'", path);
    return b;
}

static void assert_same_bytes(const char *a, const char *b) {
    size_t na, nb;
    char *x = read_all(a, &na), *y = read_all(b, &nb);
    cr_assert_eq(na, nb, "'%s' has %zu bytes, '%s' has %zu", a, na, b, nb);
    size_t i = 0;
    while (i < na && x[i] == y[i]) i++;
    cr_assert_eq(i, na, "'%s' and '%s' first differ at byte %zu of %zu", a, b, i, na);
    free(x), free(y);
}

/* ---------------------------------------------------------------- the oracle */

/* Our own hooks keep the fp32 activations of every layer of one window. */
struct naive {
    int64_t L, d, qd, kd, max_n;
    int64_t n;                 /* rows of the last window */
    float *x, *q, *k;          /* [L][max_n, d], [L][max_n, h*d_h], [L][max_n, g*d_h] */
    int64_t calls_in, calls_qk;
};

static int naive_attn_in(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0) {
    struct naive *nv = ctx;
    cr_assert(layer >= 0 && layer < nv->L && n <= nv->max_n && pos0 == 0);
    memcpy(nv->x + layer * nv->max_n * nv->d, x, (size_t)(n * nv->d) * sizeof *x);
    nv->n = n;
    nv->calls_in++;
    return 0;
}

static int naive_qk(void *ctx, int64_t layer, const float *q, const float *k, int64_t n,
                    int64_t pos0) {
    struct naive *nv = ctx;
    cr_assert(layer >= 0 && layer < nv->L && n == nv->n && pos0 == 0);
    memcpy(nv->q + layer * nv->max_n * nv->qd, q, (size_t)(n * nv->qd) * sizeof *q);
    memcpy(nv->k + layer * nv->max_n * nv->kd, k, (size_t)(n * nv->kd) * sizeof *k);
    nv->calls_qk++;
    return 0;
}

/* cov[i] += Σ_t b[t, i*dh + a] b[t, i*dh + c] for each of nh heads of b [n, nh*dh]. */
static void naive_head_grams(double *cov, const float *b, int64_t n, int64_t nh, int64_t dh) {
    for (int64_t i = 0; i < nh; i++)
        for (int64_t a = 0; a < dh; a++)
            for (int64_t c = 0; c < dh; c++) {
                double s = 0;
                for (int64_t t = 0; t < n; t++)
                    s += (double)b[t * nh * dh + i * dh + a] * (double)b[t * nh * dh + i * dh + c];
                cov[(i * dh + a) * dh + c] += s;
            }
}

/* Add the captured window to ref, every element of both triangles. */
static void naive_add(const struct naive *nv, struct kv_stats *ref) {
    int64_t d = nv->d, n = nv->n, h = ref->n_heads, g = ref->n_kv_heads, dh = ref->head_dim;
    for (int64_t l = 0; l < nv->L; l++) {
        const float *x = nv->x + l * nv->max_n * d;
        struct kv_stats_layer *R = &ref->layers[l];
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < d; j++) {
                double s = 0;
                for (int64_t t = 0; t < n; t++) s += (double)x[t * d + i] * (double)x[t * d + j];
                R->xtx[i * d + j] += s;
            }
        for (int64_t j = 0; j < d; j++) {
            double s = 0;
            for (int64_t t = 0; t < n; t++) s += (double)x[t * d + j];
            R->xsum[j] += s;
        }
        naive_head_grams(R->q_cov, nv->q + l * nv->max_n * nv->qd, n, h, dh);
        naive_head_grams(R->k_cov, nv->k + l * nv->max_n * nv->kd, n, g, dh);
    }
}

/* Run n_windows windows of seq_len tokens (ids, consecutive) through a full
 * forward pass with our hooks and sum them into ref. */
static void naive_run(const struct kv_model *m, struct kv_stats *ref, const int32_t *ids,
                      int64_t n_windows, int64_t seq_len) {
    const struct kv_config *c = kv_model_config(m);
    struct naive nv = {0};
    nv.L = c->n_layers;
    nv.d = c->dim;
    nv.qd = c->n_heads * c->head_dim;
    nv.kd = c->n_kv_heads * c->head_dim;
    nv.max_n = seq_len;
    nv.x = malloc((size_t)(nv.L * seq_len * nv.d) * sizeof *nv.x);
    nv.q = malloc((size_t)(nv.L * seq_len * nv.qd) * sizeof *nv.q);
    nv.k = malloc((size_t)(nv.L * seq_len * nv.kd) * sizeof *nv.k);
    cr_assert(nv.x && nv.q && nv.k);
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, seq_len, &f, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_fwd_hooks hk = {0};
    hk.ctx = &nv;
    hk.attn_in = naive_attn_in;
    hk.qk_rope = naive_qk;
    /* a full pass, not hooks_only: the library's shortcut must not matter */
    kv_fwd_set_hooks(f, &hk);
    for (int64_t w = 0; w < n_windows; w++) {
        nv.calls_in = nv.calls_qk = 0;
        cr_assert_eq(kv_fwd_run(f, ids + w * seq_len, seq_len, 0, NULL, &err), KV_OK, "%s",
                     fmt_err(&err));
        cr_assert_eq(nv.calls_in, nv.L, "attn_in hook ran %lld times for %lld layers",
                     (long long)nv.calls_in, (long long)nv.L);
        cr_assert_eq(nv.calls_qk, nv.L);
        naive_add(&nv, ref);
    }
    kv_fwd_free(f);
    free(nv.x), free(nv.q), free(nv.k);
}

/* ---------------------------------------------------------------- comparisons */

struct tensor_view {
    const char *name;
    double *p;
    int64_t n;
};

static int layer_tensors(const struct kv_stats *s, int64_t l, struct tensor_view t[4]) {
    int64_t d = s->dim, dh = s->head_dim;
    const struct kv_stats_layer *L = &s->layers[l];
    t[0] = (struct tensor_view){"xtx", L->xtx, d * d};
    t[1] = (struct tensor_view){"xsum", L->xsum, d};
    t[2] = (struct tensor_view){"q_cov", L->q_cov, s->n_heads * dh * dh};
    t[3] = (struct tensor_view){"k_cov", L->k_cov, s->n_kv_heads * dh * dh};
    return 4;
}

/* ||a - b||_F / ||b||_F (b must not be all zero). */
static double rel_frob(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = a[i] - b[i];
        num += e * e;
        den += b[i] * b[i];
    }
    return sqrt(num / den);
}

/* Every tensor of got within tol of ref in relative Frobenius norm; the
 * worst layer/tensor is logged and named on failure. Returns the worst. */
static double assert_stats_close(const struct kv_stats *got, const struct kv_stats *ref,
                                 double tol, const char *what) {
    cr_assert(got->n_layers == ref->n_layers && got->dim == ref->dim &&
                  got->n_heads == ref->n_heads && got->n_kv_heads == ref->n_kv_heads &&
                  got->head_dim == ref->head_dim,
              "%s: shapes differ", what);
    double worst = -1;
    int64_t wl = -1;
    const char *wt = "";
    for (int64_t l = 0; l < ref->n_layers; l++) {
        struct tensor_view a[4], b[4];
        int nt = layer_tensors(got, l, a);
        layer_tensors(ref, l, b);
        for (int t = 0; t < nt; t++) {
            double norm = 0;
            for (int64_t i = 0; i < b[t].n; i++) norm += b[t].p[i] * b[t].p[i];
            cr_assert_gt(norm, 0, "%s: reference layer %lld %s is all zero", what, (long long)l,
                         b[t].name);
            double e = rel_frob(a[t].p, b[t].p, b[t].n);
            if (isnan(e)) e = INFINITY;
            if (e > worst) worst = e, wl = l, wt = b[t].name;
        }
    }
    cr_log_info("%s: worst relative Frobenius error %.3g (layer %lld %s)", what, worst,
                (long long)wl, wt);
    cr_assert(worst <= tol, "%s: layer %lld %s: relative Frobenius error %.3g > %.0e", what,
              (long long)wl, wt, worst, tol);
    return worst;
}

static void assert_square_symmetric(const double *a, int64_t n, const char *what, int64_t l,
                                    int64_t head) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = i + 1; j < n; j++)
            cr_assert(a[i * n + j] == a[j * n + i],
                      "layer %lld %s head %lld: [%lld,%lld] = %.17g but [%lld,%lld] = %.17g",
                      (long long)l, what, (long long)head, (long long)i, (long long)j,
                      a[i * n + j], (long long)j, (long long)i, a[j * n + i]);
}

/* Both triangles stored and exactly equal. */
static void assert_symmetric(const struct kv_stats *s) {
    int64_t dh = s->head_dim;
    for (int64_t l = 0; l < s->n_layers; l++) {
        assert_square_symmetric(s->layers[l].xtx, s->dim, "xtx", l, 0);
        for (int64_t i = 0; i < s->n_heads; i++)
            assert_square_symmetric(s->layers[l].q_cov + i * dh * dh, dh, "q_cov", l, i);
        for (int64_t i = 0; i < s->n_kv_heads; i++)
            assert_square_symmetric(s->layers[l].k_cov + i * dh * dh, dh, "k_cov", l, i);
    }
}

/* ---------------------------------------------------------------- accumulation */

/* ACCEPTANCE: collect of the first 64 windows of val1k equals the oracle. */
Test(collect, first_64_windows_equal_independent_naive_sums, .timeout = 300) {
    struct kv_model *m = open_stories();
    char *text = shared_copy(VAL_REL);
    const char *paths[1] = {text};
    struct kv_calib_opts o = calib_opts(256, 64, 1, 0, 0, 1);
    struct kv_stats *s;
    collect(m, paths, 1, &o, NULL, &s);

    cr_assert_eq(s->tokens, 64 * 256);
    cr_assert_eq(s->windows, 64);
    cr_assert_eq(s->plan_windows, 64);
    cr_assert_eq(s->next_window, 64);
    cr_assert_str_eq(s->sampling, "sequential");
    cr_assert_eq(s->n_inputs, 1);
    cr_assert_eq(s->inputs[0].windows, 64);
    cr_assert_str_eq(s->inputs[0].path, text);

    /* the oracle tokenizes the file itself */
    struct kv_err err;
    kv_err_clear(&err);
    char *buf;
    size_t len;
    cr_assert_eq(kv_text_read(text, &buf, &len, &err), KV_OK, "%s", fmt_err(&err));
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(kv_model_tokenizer(m), buf, len, 1, &ids, &n, &err), KV_OK, "%s",
                 fmt_err(&err));
    cr_assert_geq(n, 64 * 256);
    cr_assert_eq(s->inputs[0].tokens, n);
    cr_assert_eq(s->inputs[0].bytes, (uint64_t)len);

    struct kv_stats *ref = stats_for(m);
    naive_run(m, ref, ids, 64, 256);
    assert_stats_close(s, ref, STATS_RTOL, "stories260K val1k 64x256");
    assert_symmetric(s);

    kv_stats_free(ref), kv_stats_free(s);
    free(ids), free(buf), free(text);
    kv_model_close(m);
}

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

/* ---------------------------------------------------------------- merging */

/* Writes a.txt and b.txt in dir: the first ~96 KB of val1k.txt cut in two
 * near its middle, both ends at a newline (some 90 windows of 256 each). */
static void write_halves(const char *dir, char **pa, char **pb) {
    char *text = shared_copy(VAL_REL);
    size_t len;
    char *all = read_all(text, &len);
    size_t cut = len < 96 * 1024 ? len : 96 * 1024;
    while (cut < len && all[cut - 1] != '\n') cut++;
    size_t mid = cut / 2;
    while (mid < cut && all[mid - 1] != '\n') mid++;
    cr_assert(mid > 0 && mid < cut, "no newline to split val1k.txt at");
    *pa = kvt_path(dir, "a.txt");
    *pb = kvt_path(dir, "b.txt");
    FILE *f = fopen(*pa, "wb");
    cr_assert(f && fwrite(all, 1, mid, f) == mid && fclose(f) == 0);
    f = fopen(*pb, "wb");
    cr_assert(f && fwrite(all + mid, 1, cut - mid, f) == cut - mid && fclose(f) == 0);
    free(all), free(text);
}

static void assert_merged_equals(struct kv_stats *acc, const struct kv_stats *b,
                                 const char *b_path, const struct kv_stats *whole,
                                 const char *what) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t wa = acc->windows;
    cr_assert_eq(kv_stats_merge(acc, b, b_path, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(acc->windows, wa + b->windows);
    cr_assert_eq(acc->tokens, whole->tokens, "%s: %lld tokens merged, %lld in one run", what,
                 (long long)acc->tokens, (long long)whole->tokens);
    cr_assert_eq(acc->windows, whole->windows, "%s: %lld windows merged, %lld in one run", what,
                 (long long)acc->windows, (long long)whole->windows);
    cr_assert_str_eq(acc->sampling, "merged");
    cr_assert_eq(acc->next_window, acc->plan_windows);
    cr_assert_eq(acc->n_inputs, whole->n_inputs);
    for (int64_t i = 0; i < whole->n_inputs; i++) {
        cr_assert_str_eq(acc->inputs[i].path, whole->inputs[i].path);
        cr_assert_str_eq(acc->inputs[i].sha256, whole->inputs[i].sha256);
        cr_assert_eq(acc->inputs[i].tokens, whole->inputs[i].tokens);
        cr_assert_eq(acc->inputs[i].windows, whole->inputs[i].windows,
                     "%s: input %lld: %lld windows merged, %lld in one run", what, (long long)i,
                     (long long)acc->inputs[i].windows, (long long)whole->inputs[i].windows);
    }
    assert_stats_close(acc, whole, STATS_RTOL, what);
    assert_symmetric(acc);
}

/* ACCEPTANCE: collect(A) + collect(B) == collect(A, B). */
Test(collect, merge_of_two_inputs_equals_one_run_over_both, .timeout = 300) {
    struct kv_model *m = open_stories();
    char *dir = kvt_temp_dir(), *a, *b;
    write_halves(dir, &a, &b);
    char *oa = kvt_path(dir, "a.kvstats"), *ob = kvt_path(dir, "b.kvstats");
    char *oab = kvt_path(dir, "ab.kvstats");
    struct kv_calib_opts o = calib_opts(256, 0, 0, 0, 0, 1);
    const char *pa[1] = {a}, *pb[1] = {b}, *pab[2] = {a, b};
    collect(m, pa, 1, &o, oa, NULL);
    collect(m, pb, 1, &o, ob, NULL);
    collect(m, pab, 2, &o, oab, NULL);

    struct kv_stats *sa = open_stats(oa), *sb = open_stats(ob), *sab = open_stats(oab);
    cr_assert_gt(sa->windows, 8);
    cr_assert_gt(sb->windows, 8);
    cr_assert_eq(sab->n_inputs, 2);
    cr_assert_eq(sab->inputs[0].windows, sa->windows);
    cr_assert_eq(sab->inputs[1].windows, sb->windows);
    assert_merged_equals(sa, sb, ob, sab, "merge(a, b) vs collect(a, b)");

    kv_stats_free(sa), kv_stats_free(sb), kv_stats_free(sab);
    const char *files[] = {a, b, oa, ob, oab};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) unlink(files[i]);
    rmdir(dir);
    free(a), free(b), free(oa), free(ob), free(oab), free(dir);
    kv_model_close(m);
}

/* ACCEPTANCE: --shard 0/2 + --shard 1/2 == the unsharded run. */
Test(collect, merge_of_shards_equals_unsharded_run, .timeout = 300) {
    struct kv_model *m = open_stories();
    char *dir = kvt_temp_dir(), *a, *b;
    write_halves(dir, &a, &b);
    char *o0 = kvt_path(dir, "s0.kvstats"), *o1 = kvt_path(dir, "s1.kvstats");
    char *oall = kvt_path(dir, "all.kvstats");
    const char *pa[1] = {a};
    struct kv_calib_opts all = calib_opts(256, 0, 0, 0, 0, 1);
    struct kv_calib_opts s0 = calib_opts(256, 0, 0, 0, 0, 2);
    struct kv_calib_opts s1 = calib_opts(256, 0, 0, 0, 1, 2);
    collect(m, pa, 1, &all, oall, NULL);
    collect(m, pa, 1, &s0, o0, NULL);
    collect(m, pa, 1, &s1, o1, NULL);

    struct kv_stats *x0 = open_stats(o0), *x1 = open_stats(o1), *xall = open_stats(oall);
    cr_assert_eq(x0->shard_index, 0);
    cr_assert_eq(x1->shard_index, 1);
    cr_assert_eq(x1->shard_count, 2);
    cr_assert_eq(x0->windows, (xall->windows + 1) / 2);
    cr_assert_eq(x1->windows, xall->windows / 2);
    assert_merged_equals(x0, x1, o1, xall, "merge(shard 0/2, shard 1/2) vs unsharded");

    kv_stats_free(x0), kv_stats_free(x1), kv_stats_free(xall);
    const char *files[] = {a, b, o0, o1, oall};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) unlink(files[i]);
    rmdir(dir);
    free(a), free(b), free(o0), free(o1), free(oall), free(dir);
    kv_model_close(m);
}

/* ---------------------------------------------------------------- checkpoints */

struct progress_log {
    int64_t stop_at; /* windows of this run after which to ask to stop; 0 = never */
    int64_t last_done, last_total, last_tokens, calls;
};

static int on_progress(void *ctx, int64_t done, int64_t total, int64_t tokens_done) {
    struct progress_log *p = ctx;
    p->last_done = done, p->last_total = total, p->last_tokens = tokens_done;
    p->calls++;
    return p->stop_at > 0 && done >= p->stop_at;
}

/* A resume whose options differ from the checkpoint's is refused before it
 * touches the file. */
static void assert_resume_refused(const struct kv_model *m, const char *text, const char *ckpt,
                                  const struct kv_calib_opts *o, const char *what) {
    size_t n0;
    char *before = read_all(ckpt, &n0);
    const char *paths[1] = {text};
    struct kv_calib *c = calib_open(paths, 1, m, o);
    struct kv_stats *s = open_stats(ckpt);
    struct kv_collect_opts co = {0};
    co.out_path = ckpt;
    co.data = o;
    co.resume = 1;
    co.checkpoint_every = 8;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_collect_run(m, c, s, &co, &err);
    cr_assert_eq(rc, KV_EINVAL, "%s: resume returned %d (%s)", what, rc, fmt_err(&err));
    cr_assert_eq(err.code, KV_EINVAL);
    const char *want = "checkpoint does not match this run";
    cr_assert(strncmp(err.msg, want, strlen(want)) == 0, "%s: message: %s", what, err.msg);
    size_t n1;
    char *after = read_all(ckpt, &n1);
    cr_assert(n0 == n1 && memcmp(before, after, n0) == 0, "%s: the refused resume changed '%s'",
              what, ckpt);
    free(before), free(after);
    kv_stats_free(s);
    kv_calib_free(c);
}

Test(collect, resume_after_interrupt_is_byte_identical, .timeout = 300) {
    struct kv_model *m = open_stories();
    char *text = shared_copy(VAL_REL);
    const char *paths[1] = {text};
    char *dir = kvt_temp_dir();
    char *f1 = kvt_path(dir, "whole.kvstats"), *f2 = kvt_path(dir, "resumed.kvstats");
    struct kv_calib_opts o = calib_opts(256, 32, 1, 0, 0, 1);
    struct kv_err err;

    /* uninterrupted, checkpointing every 8 windows */
    struct kv_calib *c = calib_open(paths, 1, m, &o);
    struct kv_stats *s = stats_for(m);
    struct kv_collect_opts co = {0};
    co.out_path = f1;
    co.data = &o;
    co.checkpoint_every = 8;
    kv_err_clear(&err);
    cr_assert_eq(kv_collect_run(m, c, s, &co, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(co.checkpoints_written, 3, "checkpoints after 8, 16 and 24 of 32, found %lld",
                 (long long)co.checkpoints_written);
    kv_stats_free(s);
    kv_calib_free(c);

    /* interrupted by the progress callback after 12 windows */
    struct progress_log pl = {.stop_at = 12};
    c = calib_open(paths, 1, m, &o);
    s = stats_for(m);
    co = (struct kv_collect_opts){0};
    co.out_path = f2;
    co.data = &o;
    co.checkpoint_every = 8;
    co.progress = on_progress;
    co.progress_ctx = &pl;
    kv_err_clear(&err);
    int rc = kv_collect_run(m, c, s, &co, &err);
    cr_assert_eq(rc, KV_EINVAL, "interrupted run returned %d (%s)", rc, fmt_err(&err));
    cr_assert(strncmp(err.msg, "interrupted", 11) == 0, "message: %s", err.msg);
    cr_assert_eq(pl.last_done, 12);
    cr_assert_eq(pl.last_total, 32);
    cr_assert_eq(pl.last_tokens, 12 * 256);
    kv_stats_free(s);
    kv_calib_free(c);

    struct kv_stats *ck = open_stats(f2);
    cr_assert_eq(ck->next_window, 12);
    cr_assert_eq(ck->plan_windows, 32);
    cr_assert_eq(ck->windows, 12);
    cr_assert_eq(ck->tokens, 12 * 256);
    cr_assert_eq(ck->n_inputs, 1);
    cr_assert_eq(ck->inputs[0].windows, 12);
    kv_stats_free(ck);

    /* a resume with other options is refused and leaves the checkpoint alone */
    struct kv_calib_opts other_len = calib_opts(128, 32, 1, 0, 0, 1);
    struct kv_calib_opts other_n = calib_opts(256, 16, 1, 0, 0, 1);
    assert_resume_refused(m, text, f2, &other_len, "seq_len 128");
    assert_resume_refused(m, text, f2, &other_n, "samples 16");

    /* the resume, as from a new process: fresh calibration data */
    c = calib_open(paths, 1, m, &o);
    ck = open_stats(f2);
    pl = (struct progress_log){0};
    co = (struct kv_collect_opts){0};
    co.out_path = f2;
    co.data = &o;
    co.resume = 1;
    co.checkpoint_every = 8;
    co.progress = on_progress;
    co.progress_ctx = &pl;
    kv_err_clear(&err);
    cr_assert_eq(kv_collect_run(m, c, ck, &co, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(pl.calls, 20);
    cr_assert_eq(pl.last_done, 20);
    cr_assert_eq(pl.last_total, 20);
    cr_assert_eq(ck->next_window, 32);
    cr_assert_eq(ck->windows, 32);
    kv_stats_free(ck);
    kv_calib_free(c);

    assert_same_bytes(f1, f2);

    unlink(f1), unlink(f2), rmdir(dir);
    free(f1), free(f2), free(dir), free(text);
    kv_model_close(m);
}

Test(collect, seeded_random_draw_is_reproducible, .timeout = 300) {
    struct kv_model *m = open_stories();
    char *text = shared_copy(VAL_REL);
    const char *paths[1] = {text};
    char *dir = kvt_temp_dir();
    char *r1 = kvt_path(dir, "r1.kvstats"), *r2 = kvt_path(dir, "r2.kvstats");
    char *r3 = kvt_path(dir, "r3.kvstats");
    struct kv_calib_opts o7 = calib_opts(256, 16, 0, 7, 0, 1);
    struct kv_calib_opts o8 = calib_opts(256, 16, 0, 8, 0, 1);
    collect(m, paths, 1, &o7, r1, NULL);
    collect(m, paths, 1, &o7, r2, NULL);
    collect(m, paths, 1, &o8, r3, NULL);
    assert_same_bytes(r1, r2);

    struct kv_stats *a = open_stats(r1), *b = open_stats(r3);
    cr_assert_str_eq(a->sampling, "random");
    cr_assert_eq(a->seed, 7);
    cr_assert_eq(a->samples, 16);
    cr_assert_eq(a->windows, 16);
    cr_assert_eq(b->seed, 8);
    cr_assert_eq(b->windows, 16);
    double e = rel_frob(b->layers[0].xtx, a->layers[0].xtx, a->dim * a->dim);
    cr_assert_gt(e, 1e-6, "seeds 7 and 8 gave the same layer 0 xtx (relative difference %.3g)", e);
    kv_stats_free(a), kv_stats_free(b);

    unlink(r1), unlink(r2), unlink(r3), rmdir(dir);
    free(r1), free(r2), free(r3), free(dir), free(text);
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
    cr_assert(got->has_fisher && ref->has_fisher, "%s: no fisher sums", what);
    int64_t kd = ref->n_kv_heads * ref->head_dim, n2 = kd * ref->head_dim;
    for (int64_t l = 0; l < ref->n_layers; l++) {
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
    int64_t dh = s->head_dim;
    for (int64_t l = 0; l < s->n_layers; l++)
        for (int64_t j = 0; j < s->n_kv_heads; j++) {
            assert_square_symmetric(s->layers[l].grad_k_cov + j * dh * dh, dh, "grad_k_cov", l, j);
            assert_square_symmetric(s->layers[l].grad_v_cov + j * dh * dh, dh, "grad_v_cov", l, j);
        }
    /* the forward sums are those of a run without fisher, bit for bit */
    for (int64_t l = 0; l < s->n_layers; l++) {
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

/* Checkpoint, interrupt and resume with fisher: the same bytes as one run;
 * a resume that turns --fisher on or off is refused. */
Test(collect, fisher_resume_after_interrupt_is_byte_identical, .timeout = 300) {
    struct kv_model *m = open_stories();
    char *text = shared_copy(VAL_REL);
    const char *paths[1] = {text};
    char *dir = kvt_temp_dir();
    char *f1 = kvt_path(dir, "whole.kvstats"), *f2 = kvt_path(dir, "resumed.kvstats");
    struct kv_calib_opts o = calib_opts(64, 10, 0, 3, 0, 1);
    struct kv_err err;
    for (int run = 0; run < 3; run++) {
        /* 0: uninterrupted; 1: stopped after 3 windows; 2: its resume */
        struct kv_calib *c = calib_open(paths, 1, m, &o);
        struct kv_stats *s = run == 2 ? open_stats(f2) : stats_for(m);
        struct progress_log pl = {.stop_at = run == 1 ? 3 : 0};
        struct kv_collect_opts co = {0};
        co.out_path = run ? f2 : f1;
        co.data = &o;
        co.fisher = 1;
        co.resume = run == 2;
        co.checkpoint_every = 4;
        co.progress = on_progress;
        co.progress_ctx = &pl;
        kv_err_clear(&err);
        int rc = kv_collect_run(m, c, s, &co, &err);
        cr_assert_eq(rc, run == 1 ? KV_EINVAL : KV_OK, "run %d: %d (%s)", run, rc, fmt_err(&err));
        cr_assert_eq(s->has_fisher, 1);
        if (run != 1) cr_assert(co.loss > 0 && isfinite(co.loss), "run %d: mean loss %g", run, co.loss);
        kv_stats_free(s);
        kv_calib_free(c);
        if (run == 1) {
            /* the checkpoint refuses a resume without --fisher, and a fisher-less one with it */
            c = calib_open(paths, 1, m, &o);
            s = open_stats(f2);
            cr_assert_eq(s->has_fisher, 1);
            co = (struct kv_collect_opts){.out_path = f2, .data = &o, .resume = 1};
            kv_err_clear(&err);
            cr_assert_eq(kv_collect_run(m, c, s, &co, &err), KV_EINVAL);
            cr_assert_str_eq(err.msg, "checkpoint does not match this run: --fisher is on there "
                                      "and off here; rerun with the same options, or drop "
                                      "--resume to start over");
            kv_stats_free(s);
            kv_calib_free(c);
        }
    }
    assert_same_bytes(f1, f2);
    struct kv_stats *s = open_stats(f1);
    cr_assert_eq(s->windows, 10);
    kv_stats_free(s);
    unlink(f1), unlink(f2), rmdir(dir);
    free(f1), free(f2), free(dir), free(text);
    kv_model_close(m);
}
