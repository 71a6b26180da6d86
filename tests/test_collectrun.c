/* kv_collect_run against the naive float64 oracle of accum_fixture.h, and the
 * properties collect promises: shards and inputs merge by addition, a
 * resumed checkpoint (with and without Fisher sums) finishes byte-identical
 * to an uninterrupted run, and a seeded draw is reproducible.
 *
 * The tests use stories260K (.bin with tok512.bin) and TinyStories val1k.txt
 * from the shared data and skip without them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accum_fixture.h"
#include "kvstats.h"
#include "model.h"
#include "testutil.h"

/* ---------------------------------------------------------------- helpers */

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
    struct kv_calib_opts o = {seq_len, samples, sequential, seed, shard_index, shard_count, 0};
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

/* ---------------------------------------------------------------- accumulation */

/* ACCEPTANCE: collect of the first 64 windows of val1k equals the oracle. */
Test(collect, first_64_windows_equal_independent_naive_sums, .timeout = 300) {
    struct kv_model *m = open_stories();
    char *text = shared_copy(VAL_REL);
    const char *paths[1] = {text};
    struct kv_calib_opts o = calib_opts(256, 64, 1, 0, 0, 1);
    struct kv_stats *s;
    collect(m, paths, 1, &o, NULL, &s);

    cr_assert_eq(s->info.tokens, 64 * 256);
    cr_assert_eq(s->info.windows, 64);
    cr_assert_eq(s->info.plan_windows, 64);
    cr_assert_eq(s->info.next_window, 64);
    cr_assert_str_eq(s->info.sampling, "sequential");
    cr_assert_eq(s->info.n_inputs, 1);
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

/* upper_only: the same file, and the lower triangles never written */
Test(collect, upper_only_writes_the_same_file_and_never_touches_the_lower_triangles,
     .timeout = 300) {
    struct kv_model *m = open_stories();
    char *text = shared_copy(VAL_REL), *dir = kvt_temp_dir();
    const char *paths[1] = {text};
    struct kv_calib_opts o = calib_opts(128, 8, 1, 0, 0, 1);
    char *pa = kvt_path(dir, "whole.kvstats"), *pb = kvt_path(dir, "upper.kvstats");
    struct kv_stats *sa, *sb;
    collect(m, paths, 1, &o, pa, &sa);
    struct kv_calib *c = calib_open(paths, 1, m, &o);
    sb = stats_for(m);
    struct kv_collect_opts co = {.out_path = pb, .data = &o, .upper_only = 1};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_collect_run(m, c, sb, &co, &err), KV_OK, "%s", fmt_err(&err));
    kv_calib_free(c);
    assert_same_bytes(pa, pb);
    cr_assert_eq(sa->upper, 0);
    cr_assert_eq(sb->upper, 1);
    int64_t d = sb->info.dim, lower_nonzero = 0, upper_zero = 0;
    for (int64_t l = 0; l < sb->info.n_layers; l++)
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < d; j++) {
                double x = sb->layers[l].xtx[i * d + j];
                if (j < i) lower_nonzero += x != 0;
                else upper_zero += x == 0;
            }
    cr_assert_eq(lower_nonzero, 0, "the lower triangles were written");
    cr_assert_eq(upper_zero, 0, "an upper element is still 0");
    kv_stats_mirror(sb);
    assert_stats_close(sb, sa, 0, "upper_only mirrored against a whole run");
    kv_stats_free(sa), kv_stats_free(sb);
    free(pa), free(pb), free(text);
    kvt_rm_dir(dir);
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
    int64_t wa = acc->info.windows;
    cr_assert_eq(kv_stats_merge(acc, b, b_path, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(acc->info.windows, wa + b->info.windows);
    cr_assert_eq(acc->info.tokens, whole->info.tokens, "%s: %lld tokens merged, %lld in one run", what,
                 (long long)acc->info.tokens, (long long)whole->info.tokens);
    cr_assert_eq(acc->info.windows, whole->info.windows, "%s: %lld windows merged, %lld in one run", what,
                 (long long)acc->info.windows, (long long)whole->info.windows);
    cr_assert_str_eq(acc->info.sampling, "merged");
    cr_assert_eq(acc->info.next_window, acc->info.plan_windows);
    cr_assert_eq(acc->info.n_inputs, whole->info.n_inputs);
    for (int64_t i = 0; i < whole->info.n_inputs; i++) {
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
    cr_assert_gt(sa->info.windows, 8);
    cr_assert_gt(sb->info.windows, 8);
    cr_assert_eq(sab->info.n_inputs, 2);
    cr_assert_eq(sab->inputs[0].windows, sa->info.windows);
    cr_assert_eq(sab->inputs[1].windows, sb->info.windows);
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
    cr_assert_eq(x0->info.shard_index, 0);
    cr_assert_eq(x1->info.shard_index, 1);
    cr_assert_eq(x1->info.shard_count, 2);
    cr_assert_eq(x0->info.windows, (xall->info.windows + 1) / 2);
    cr_assert_eq(x1->info.windows, xall->info.windows / 2);
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
    cr_assert_eq(ck->info.next_window, 12);
    cr_assert_eq(ck->info.plan_windows, 32);
    cr_assert_eq(ck->info.windows, 12);
    cr_assert_eq(ck->info.tokens, 12 * 256);
    cr_assert_eq(ck->info.n_inputs, 1);
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
    cr_assert_eq(ck->info.next_window, 32);
    cr_assert_eq(ck->info.windows, 32);
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
    cr_assert_str_eq(a->info.sampling, "random");
    cr_assert_eq(a->info.seed, 7);
    cr_assert_eq(a->info.samples, 16);
    cr_assert_eq(a->info.windows, 16);
    cr_assert_eq(b->info.seed, 8);
    cr_assert_eq(b->info.windows, 16);
    double e = rel_frob(b->layers[0].xtx, a->layers[0].xtx, a->info.dim * a->info.dim);
    cr_assert_gt(e, 1e-6, "seeds 7 and 8 gave the same layer 0 xtx (relative difference %.3g)", e);
    kv_stats_free(a), kv_stats_free(b);

    unlink(r1), unlink(r2), unlink(r3), rmdir(dir);
    free(r1), free(r2), free(r3), free(dir), free(text);
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
        cr_assert_eq(s->info.has_fisher, 1);
        if (run != 1) cr_assert(co.loss > 0 && isfinite(co.loss), "run %d: mean loss %g", run, co.loss);
        kv_stats_free(s);
        kv_calib_free(c);
        if (run == 1) {
            /* the checkpoint refuses a resume without --fisher, and a fisher-less one with it */
            c = calib_open(paths, 1, m, &o);
            s = open_stats(f2);
            cr_assert_eq(s->info.has_fisher, 1);
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
    cr_assert_eq(s->info.windows, 10);
    kv_stats_free(s);
    unlink(f1), unlink(f2), rmdir(dir);
    free(f1), free(f2), free(dir), free(text);
    kv_model_close(m);
}
