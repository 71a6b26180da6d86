/* kvcal collect / merge / inspect STATS through the binary: kill -9 and
 * --resume give a bitwise-identical file, and the exact messages users see
 * for mistakes and for damaged statistics files. */
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvstats.h"
#include "testutil.h"

extern char **environ;

#define MODEL "models/stories260K/stories260K.bin"
#define TOK "models/stories260K/tok512.bin"
#define TEXT "text/tinystories/val1k.txt"

static void expect_cli(const char *args, int code, const char *want_err) {
    char *out, *err;
    int rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, code, "kvcal %s: exit %d, want %d; stderr:\n%s", args, rc, code, err);
    if (want_err) cr_assert_str_eq(err, want_err, "kvcal %s", args);
    free(out), free(err);
}

/* "-m MODEL --tokenizer TOK -t TEXT" with shared paths, or skip. */
static void base_args(char *buf, size_t cap) {
    KVT_NEED_SHARED(m, MODEL);
    char mp[1024];
    snprintf(mp, sizeof mp, "%s", m);
    KVT_NEED_SHARED(t, TOK);
    char tp[1024];
    snprintf(tp, sizeof tp, "%s", t);
    KVT_NEED_SHARED(x, TEXT);
    snprintf(buf, cap, "collect -m %s --tokenizer %s -t %s --threads 2 -q", mp, tp, x);
}

static int same_file(const char *a, const char *b) {
    size_t la, lb;
    char *x = kvt_read_file(a, &la), *y = kvt_read_file(b, &lb);
    cr_assert(x && y, "cannot read %s or %s", a, b);
    int same = la == lb && memcmp(x, y, la) == 0;
    free(x), free(y);
    return same;
}

Test(collect_cli, kill_9_after_a_checkpoint_then_resume_is_bitwise_identical, .timeout = 240) {
    KVT_SKIP_SANITIZED("over its time limit at the sanitizers' speed");
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *ref = kvt_path(dir, "ref.kvstats"), *ck = kvt_path(dir, "ck.kvstats");
    const char *plan = "--samples 600 --seed 5 --checkpoint-every 40";
    char args[8192];
    snprintf(args, sizeof args, "%s %s -o %s", base, plan, ref);
    expect_cli(args, 0, "");

    /* the same run in the background, killed once its first checkpoint lands */
    const char *bin = getenv("KVCAL_BIN");
    if (!bin || !*bin) bin = "build/kvcal";
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "exec %s %s %s -o %s >/dev/null 2>&1", bin, base, plan, ck);
    char *argv[] = {"sh", "-c", cmd, NULL};
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, "/bin/sh", NULL, NULL, argv, environ), 0);
    struct stat st;
    int waited = 0;
    while (stat(ck, &st) != 0 && waited < 60000) {
        usleep(2000);
        waited += 2;
    }
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
              "the run finished before it could be killed; make it longer");
    struct kv_stats *s;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(ck, &s, &err), KV_OK, "checkpoint unreadable: %s", err.msg);
    cr_assert(s->info.next_window > 0 && s->info.next_window < s->info.plan_windows,
              "expected a checkpoint, got %lld of %lld windows", (long long)s->info.next_window,
              (long long)s->info.plan_windows);
    cr_assert_eq(s->info.next_window % 40, 0);
    kv_stats_free(s);
    cr_assert_not(same_file(ref, ck));

    snprintf(args, sizeof args, "%s %s --resume -o %s", base, plan, ck);
    expect_cli(args, 0, "");
    cr_assert(same_file(ref, ck), "resumed file differs from the uninterrupted run");
    unlink(ref), unlink(ck), rmdir(dir);
    free(ref), free(ck), free(dir);
}

Test(collect_cli, resume_with_other_options_is_refused) {
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "s.kvstats");
    char args[8192], want[4096];
    snprintf(args, sizeof args, "%s --samples 8 --seed 1 -o %s", base, out);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "%s --samples 8 --seed 2 --resume -o %s", base, out);
    snprintf(want, sizeof want,
             "kvcal: %s: checkpoint does not match this run: --seed is 1 there and 2 here; rerun "
             "with the same options, or drop --resume to start over\n", out);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "%s --samples 8 --seed 1 --seq-len 128 --resume -o %s", base, out);
    snprintf(want, sizeof want,
             "kvcal: %s: checkpoint does not match this run: --seq-len is 256 there and 128 "
             "here; rerun with the same options, or drop --resume to start over\n", out);
    expect_cli(args, 1, want);
    unlink(out), rmdir(dir);
    free(out), free(dir);
}

Test(collect_cli, usage_errors_exit_2) {
    expect_cli("collect -m x.bin -o o.kvstats", 2,
               "kvcal collect: missing --text\nusage: kvcal collect --model PATH --text FILE "
               "[--text FILE ...] -o OUT.kvstats [options] (see 'kvcal collect --help')\n");
    expect_cli("collect -m x.bin -t a.txt -o o.kvstats --shard 2/2", 2,
               "kvcal collect: --shard needs I/N with 0 <= I < N, got '2/2'\nusage: kvcal collect "
               "--model PATH --text FILE [--text FILE ...] -o OUT.kvstats [options] (see 'kvcal "
               "collect --help')\n");
    expect_cli("collect -m x.bin -t a.txt -o o.kvstats --sequential", 2,
               "kvcal collect: --sequential needs --samples N (without it every window is used, "
               "in order)\nusage: kvcal collect --model PATH --text FILE [--text FILE ...] -o "
               "OUT.kvstats [options] (see 'kvcal collect --help')\n");
    expect_cli("merge a.kvstats", 2,
               "kvcal merge: missing --output\nusage: kvcal merge SHARD.kvstats SHARD.kvstats ... "
               "-o OUT.kvstats (see 'kvcal merge --help')\n");
}

Test(collect_cli, too_many_samples_names_the_counts) {
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "s.kvstats");
    char args[8192];
    snprintf(args, sizeof args, "%s --samples 5000 -o %s", base, out);
    char *o, *e;
    cr_assert_eq(kvt_run_cli(args, &o, &e), 1);
    cr_assert(strstr(e, "1578 windows") && strstr(e, "5000"), "stderr: %s", e);
    struct stat st;
    cr_assert_neq(stat(out, &st), 0, "nothing may be written on error");
    free(o), free(e), free(out), rmdir(dir), free(dir);
}

/* Two shards of one plan, merged, equal the unsharded run; mismatched shards
 * are refused with one line naming the file. */
Test(collect_cli, merge_shards_and_refuse_mismatches) {
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *a = kvt_path(dir, "a.kvstats"), *b = kvt_path(dir, "b.kvstats");
    char *all = kvt_path(dir, "all.kvstats"), *ab = kvt_path(dir, "ab.kvstats");
    char *c = kvt_path(dir, "c.kvstats");
    char args[8192], want[4096];
    const char *plan = "--samples 24 --sequential";
    snprintf(args, sizeof args, "%s %s --shard 0/2 -o %s", base, plan, a);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "%s %s --shard 1/2 -o %s", base, plan, b);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "%s %s -o %s", base, plan, all);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "merge %s %s -o %s", a, b, ab);
    expect_cli(args, 0, "");
    struct kv_stats *x, *y;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(ab, &x, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_stats_open(all, &y, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(x->info.tokens, y->info.tokens);
    cr_assert_eq(x->info.windows, 24);
    int64_t d = x->info.dim;
    for (int64_t l = 0; l < x->info.n_layers; l++)
        kvt_assert_close_f64(x->layers[l].xtx, y->layers[l].xtx, d * d, 0, 1e-12, "merged xtx");
    kv_stats_free(x), kv_stats_free(y);

    snprintf(args, sizeof args, "%s %s --seq-len 128 -o %s", base, plan, c);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "merge %s %s -o %s", a, c, ab);
    snprintf(want, sizeof want,
             "kvcal: %s: seq-len 128 differs from the first shard's 256; statistics of different "
             "window lengths do not add up\n", c);
    expect_cli(args, 1, want);
    unlink(a), unlink(b), unlink(all), unlink(ab), unlink(c), rmdir(dir);
    free(a), free(b), free(all), free(ab), free(c), free(dir);
}

/* Damaged statistics: one lowercase line naming the file, tensor and offset. */
Test(collect_cli, damaged_stats_name_file_tensor_and_offset) {
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *good = kvt_path(dir, "good.kvstats");
    char args[8192], want[4096];
    snprintf(args, sizeof args, "%s --samples 4 --sequential -o %s", base, good);
    expect_cli(args, 0, "");
    size_t len;
    char *buf = kvt_read_file(good, &len);
    cr_assert_not_null(buf);

    /* flip one byte in the data of blk.2.k_rope.cov: the crc32 names it */
    struct kv_stats *s;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_parse(buf, len, good, &s, &err), KV_OK, "%s", err.msg);
    kv_stats_free(s);
    /* the tensors are at the end in file order: k_rope.cov of the last layer
     * is the final [4, 8, 8] f64 block; blk.2's is 3 layers of tensors
     * earlier. Find it by value instead: the parser's own offsets. */
    char *bad = kvt_path(dir, "bad.kvstats");
    {
        FILE *f = fopen(bad, "wb");
        cr_assert_not_null(f);
        fwrite(buf, 1, len, f);
        fclose(f);
    }
    struct kv_stats *ref;
    kv_stats_open(good, &ref, &err);
    /* last tensor (blk.4.k_rope.cov) ends at the last 8-byte double before padding */
    int64_t per_layer = 8 * (ref->info.dim * ref->info.dim + ref->info.dim +
                             (ref->info.n_heads + ref->info.n_kv_heads) * ref->info.head_dim * ref->info.head_dim);
    int64_t krope = 8 * ref->info.n_kv_heads * ref->info.head_dim * ref->info.head_dim;
    kv_stats_free(ref);
    /* data ends at len (the writer pads to 32; every size here is a multiple of 32) */
    uint64_t last_start = len - (uint64_t)krope;
    uint64_t target = last_start - 2 * (uint64_t)per_layer + 16;
    buf[target] ^= 0x40;
    {
        FILE *f = fopen(bad, "wb");
        fwrite(buf, 1, len, f);
        fclose(f);
    }
    char *o, *e;
    snprintf(args, sizeof args, "inspect %s", bad);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 1);
    snprintf(want, sizeof want, "kvcal: %s: offset %llu: tensor 'blk.2.k_rope.cov': crc32 mismatch",
             bad, (unsigned long long)(last_start - 2 * (uint64_t)per_layer));
    cr_assert(strncmp(e, want, strlen(want)) == 0, "stderr: %swant prefix: %s", e, want);
    cr_assert_eq(strchr(e, '\n') - e + 1, (long)strlen(e), "one line: %s", e);
    free(o), free(e);
    buf[target] ^= 0x40;

    /* truncated in the middle of the data */
    {
        FILE *f = fopen(bad, "wb");
        fwrite(buf, 1, len - 100, f);
        fclose(f);
    }
    cr_assert_eq(kvt_run_cli(args, &o, &e), 1);
    cr_assert(strstr(e, bad) && strstr(e, "blk.4.k_rope.cov"), "stderr: %s", e);
    free(o), free(e);

    /* a model is not a stats file, and a stats file is not a model */
    snprintf(args, sizeof args, "verify -m %s --text x.txt", good);
    snprintf(want, sizeof want,
             "kvcal: %s: a kvcal statistics file, not a model (see 'kvcal inspect' for its "
             "contents)\n", good);
    expect_cli(args, 1, want);
    unlink(good), unlink(bad), rmdir(dir);
    free(good), free(bad), free(dir), free(buf);
}

Test(collect_cli, inspect_stats_prints_ranks_and_json) {
    char base[4096];
    base_args(base, sizeof base);
    const char *model = kvt_shared(MODEL);
    char mp[1024];
    snprintf(mp, sizeof mp, "%s", model);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "s.kvstats");
    char args[8192];
    snprintf(args, sizeof args, "%s --samples 16 --sequential -o %s", base, out);
    expect_cli(args, 0, "");
    char *o, *e;
    snprintf(args, sizeof args, "inspect %s -m %s", out, mp);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "4096 in 16 windows of 256 (sequential)"), "%s", o);
    cr_assert(strstr(o, "per kv head 0..3"), "%s", o);
    free(o), free(e);
    snprintf(args, sizeof args, "inspect %s --json", out);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "\"type\": \"kvcal.stats\"") && strstr(o, "\"k_rope_rank\""), "%s", o);
    free(o), free(e);
    unlink(out), rmdir(dir);
    free(out), free(dir);
}

/* Mistakes that would lose data are refused before any window runs. */
Test(collect_cli, refuses_to_overwrite_inputs_checkpoints_or_merge_a_shard_twice) {
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *txt = kvt_path(dir, "in.txt"), *out = kvt_path(dir, "s.kvstats");
    char *twice = kvt_path(dir, "twice.kvstats");
    FILE *f = fopen(txt, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 400; i++) fputs("Once upon a time there was a cat. ", f);
    fclose(f);
    char args[8192], want[4096];
    snprintf(args, sizeof args, "%s -t %s -o %s", base, txt, txt);
    snprintf(want, sizeof want,
             "kvcal: %s: is also the model or a --text input; refusing to overwrite it\n", txt);
    expect_cli(args, 1, want);
    /* an unfinished checkpoint: collect 4 of 8 windows by stopping early is
     * awkward from the CLI, so mark a finished file unfinished through the API */
    snprintf(args, sizeof args, "%s --samples 8 --sequential -o %s", base, out);
    expect_cli(args, 0, "");
    struct kv_stats *s;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(out, &s, &err), KV_OK, "%s", err.msg);
    s->info.plan_windows = 16;
    cr_assert_eq(kv_stats_write(s, out, &err), KV_OK, "%s", err.msg);
    kv_stats_free(s);
    snprintf(want, sizeof want,
             "kvcal: %s: holds an unfinished checkpoint (8 of 16 windows); add --resume to "
             "continue it, or remove the file to start over\n", out);
    expect_cli(args, 1, want);
    unlink(out);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "merge %s %s -o %s", out, out, twice);
    snprintf(want, sizeof want,
             "kvcal: %s: the same windows as the first shard (same inputs, plan and shard 0/1); "
             "merging would count them twice\n", out);
    expect_cli(args, 1, want);
    unlink(txt), unlink(out), rmdir(dir);
    free(txt), free(out), free(twice), free(dir);
}

/* --fisher: two runs with the same seed and threads give the same bytes,
 * inspect shows the Fisher sums, and merge keeps them. */
Test(collect_cli, fisher_twice_is_bitwise_identical_and_inspect_shows_it, .timeout = 240) {
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *a = kvt_path(dir, "a.kvstats"), *b = kvt_path(dir, "b.kvstats");
    char *c = kvt_path(dir, "c.kvstats"), *ac = kvt_path(dir, "ac.kvstats");
    char args[8192];
    snprintf(args, sizeof args, "%s --samples 16 --seed 3 --fisher -o %s", base, a);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "%s --samples 16 --seed 3 --fisher -o %s", base, b);
    expect_cli(args, 0, "");
    cr_assert(same_file(a, b), "two --fisher runs with the same seed and threads differ");
    struct kv_stats *s;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(a, &s, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(s->info.has_fisher, 1);
    double fk = 0;
    for (int64_t r = 0; r < s->info.n_kv_heads * s->info.head_dim; r++) fk += s->layers[0].fisher_k[r];
    cr_assert_gt(fk, 0, "layer 0 fisher.k sums to %g", fk);
    kv_stats_free(s);

    char *o, *e;
    snprintf(args, sizeof args, "inspect %s", a);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "fisher     yes: squared W_k/W_v gradients and ∂L/∂k, ∂L/∂v Grams of 16 "
                        "windows"), "%s", o);
    cr_assert(strstr(o, "\nfisher information Σ (∂L/∂W)² of each layer's K and V projection"), "%s", o);
    free(o), free(e);
    snprintf(args, sizeof args, "inspect %s --json", a);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "\"fisher\": true") && strstr(o, "\"fisher\": {"), "%s", o);
    free(o), free(e);

    /* a plain run says it has none; merge keeps fisher with fisher */
    snprintf(args, sizeof args, "%s --samples 16 --seed 4 --fisher --json -o %s", base, c);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "\"fisher\": true") && strstr(o, "\"mean_loss\": "), "%s", o);
    free(o), free(e);
    snprintf(args, sizeof args, "merge %s %s -o %s", a, c, ac);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "merged    2 shards: 8192 tokens in 32 windows of 256, with fisher "
                        "statistics\n"), "%s", o);
    free(o), free(e);
    cr_assert_eq(kv_stats_open(ac, &s, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(s->info.has_fisher, 1);
    cr_assert_eq(s->info.windows, 32);
    kv_stats_free(s);
    unlink(a), unlink(b), unlink(c), unlink(ac), rmdir(dir);
    free(a), free(b), free(c), free(ac), free(dir);
}

/* The messages users see for mixing runs with and without --fisher. */
Test(collect_cli, fisher_misuse_messages) {
    char base[4096];
    base_args(base, sizeof base);
    char *dir = kvt_temp_dir();
    char *plain = kvt_path(dir, "plain.kvstats"), *fi = kvt_path(dir, "fisher.kvstats");
    char *out = kvt_path(dir, "m.kvstats");
    char args[8192], want[4096];
    snprintf(args, sizeof args, "%s --samples 4 --seed 1 -o %s", base, plain);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "%s --samples 4 --seed 2 --fisher -o %s", base, fi);
    expect_cli(args, 0, "");
    /* a resume must keep --fisher as it was */
    snprintf(args, sizeof args, "%s --samples 4 --seed 1 --fisher --resume -o %s", base, plain);
    snprintf(want, sizeof want,
             "kvcal: %s: checkpoint does not match this run: --fisher is off there and on here; "
             "rerun with the same options, or drop --resume to start over\n", plain);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "%s --samples 4 --seed 2 --resume -o %s", base, fi);
    snprintf(want, sizeof want,
             "kvcal: %s: checkpoint does not match this run: --fisher is on there and off here; "
             "rerun with the same options, or drop --resume to start over\n", fi);
    expect_cli(args, 1, want);
    /* shards are merged only with shards collected alike */
    snprintf(args, sizeof args, "merge %s %s -o %s", plain, fi, out);
    snprintf(want, sizeof want,
             "kvcal: %s: has fisher statistics and the first shard has none; collect every "
             "shard with --fisher, or none\n", fi);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "merge %s %s -o %s", fi, plain, out);
    snprintf(want, sizeof want,
             "kvcal: %s: has no fisher statistics and the first shard has them; collect every "
             "shard with --fisher, or none\n", plain);
    expect_cli(args, 1, want);
    struct stat st;
    cr_assert_neq(stat(out, &st), 0, "a refused merge wrote %s", out);
    /* inspect says which files have them */
    char *o, *e;
    snprintf(args, sizeof args, "inspect %s", plain);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "\nfisher     none ('kvcal collect --fisher' adds them; --alloc fisher "
                        "needs them)\n"), "%s", o);
    free(o), free(e);
    unlink(plain), unlink(fi), rmdir(dir);
    free(plain), free(fi), free(out), free(dir);
}

/* ------------------------------------------------------------ the library's checks */

static const char *const collect_flags[KV_COLLECT_OPT_COUNT] = {
    [KV_COLLECT_OPT_SEQ_LEN] = "--seq-len", [KV_COLLECT_OPT_SAMPLES] = "--samples",
    [KV_COLLECT_OPT_SHARD] = "--shard", [KV_COLLECT_OPT_CHECKPOINT_EVERY] = "--checkpoint-every",
    [KV_COLLECT_OPT_TEXT] = "--text", [KV_COLLECT_OPT_OUTPUT] = "--output",
    [KV_COLLECT_OPT_RESUME] = "--resume"};

Test(collect_check, options_in_the_library_words_or_the_callers) {
    struct kv_calib_opts d = {256, 0, 0, 0, 0, 1, 0};
    struct kv_collect_opts o = {.data = &d, .checkpoint_every = 0};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_collect_check_options(&o, collect_flags, &err), KV_OK);
    o.checkpoint_every = -2;
    cr_assert_eq(kv_collect_check_options(&o, collect_flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--checkpoint-every must be 0 (never) or more, got -2");
    cr_assert_eq(kv_collect_check_options(&o, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "checkpoint every must be 0 (never) or more, got -2");
    d.seq_len = 1; /* the data's rules come first, from kv_calib_check */
    cr_assert_eq(kv_collect_check_options(&o, collect_flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "--seq-len must be at least 2, got 1");
}

Test(collect_check, where_a_run_may_write) {
    char *dir = kvt_temp_dir();
    char *in = kvt_path(dir, "in.txt"), *out = kvt_path(dir, "s.kvstats");
    FILE *f = fopen(in, "w");
    cr_assert_not_null(f);
    fputs("Once upon a time.\n", f);
    fclose(f);
    struct kv_calib_opts d = {16, 0, 0, 0, 0, 1, 0};
    struct kv_collect_opts o = {.out_path = out, .data = &d};
    const char *inputs[1] = {in};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_collect_check_output(&o, 0, "absent-model", inputs, 1, collect_flags, &err),
                 KV_OK, "%s", err.msg);
    struct stat st;
    cr_assert_neq(stat(out, &st), 0, "the check leaves nothing behind");
    char *probe = kvt_path(dir, "s.kvstats.probe");
    cr_assert_neq(stat(probe, &st), 0, "the probe is removed");
    free(probe);
    /* the output is the input */
    o.out_path = in;
    cr_assert_eq(kv_collect_check_output(&o, 0, "absent-model", inputs, 1, collect_flags, &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.path, in);
    cr_assert_str_eq(err.msg, "is also the model or a --text input; refusing to overwrite it");
    cr_assert_eq(kv_collect_check_output(&o, 0, in, NULL, 0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "is also the model or a calibration input; refusing to overwrite it");
    /* a directory */
    o.out_path = dir;
    cr_assert_eq(kv_collect_check_output(&o, 0, "m", inputs, 1, collect_flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "is a directory; --output names the statistics file");
    /* a folder that does not exist */
    char *nowhere = kvt_path(dir, "no/such/dir/s.kvstats");
    o.out_path = nowhere;
    cr_assert_eq(kv_collect_check_output(&o, 0, "m", inputs, 1, collect_flags, &err), KV_EIO);
    cr_assert_str_eq(err.msg, "cannot write there: no such file or directory");
    cr_assert_str_eq(err.path, nowhere);
    free(nowhere);
    unlink(in), rmdir(dir);
    free(in), free(out), free(dir);
}

static int stop_at_3(void *ctx, int64_t done, int64_t total, int64_t tokens) {
    (void)ctx, (void)total, (void)tokens;
    return done == 3;
}

/* A fresh start, a resume of a checkpoint, and an unfinished checkpoint
 * that only a resume may touch. */
Test(collect_check, start_fresh_or_from_the_checkpoint, .timeout = 120) {
    KVT_NEED_SHARED(mp, MODEL);
    char model[1024];
    snprintf(model, sizeof model, "%s", mp);
    KVT_NEED_SHARED(tp, TOK);
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(model, tp, &m, &err), KV_OK, "%s", err.msg);
    char *dir = kvt_temp_dir(), *out = kvt_path(dir, "s.kvstats"), *txt = kvt_path(dir, "in.txt");
    FILE *f = fopen(txt, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 100; i++) fputs("Once upon a time there was a cat. ", f);
    fclose(f);
    const char *inputs[1] = {txt};
    struct kv_calib_opts d = {16, 8, 1, 0, 0, 1, 0};
    struct kv_calib *c;
    cr_assert_eq(kv_calib_open(inputs, 1, kv_model_tokenizer(m), &d, &c, &err), KV_OK, "%s", err.msg);
    struct kv_collect_opts o = {.out_path = out, .data = &d, .progress = stop_at_3};
    struct kv_stats *s;
    /* --resume without a file starts fresh */
    cr_assert_eq(kv_collect_start(m, 1, &o, &s, &err), KV_OK, "%s", err.msg);
    cr_assert(!o.resume && o.resumed_from == -1 && s->info.windows == 0 && s->info.n_inputs == 0);
    /* stopped after 3 of 8 windows: a checkpoint */
    cr_assert_eq(kv_collect_run(m, c, s, &o, &err), KV_EINVAL);
    cr_assert_eq(o.run_windows, 3);
    cr_assert(o.tokens_per_s > 0 && o.seconds > 0);
    cr_assert_float_eq(o.tokens_per_s, 3 * 16 / o.seconds, 1e-9 * o.tokens_per_s);
    kv_stats_free(s);
    cr_assert_eq(kv_collect_check_output(&o, 0, model, inputs, 1, collect_flags, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "holds an unfinished checkpoint (3 of 8 windows); add --resume to "
                              "continue it, or remove the file to start over");
    cr_assert_eq(kv_collect_check_output(&o, 1, model, inputs, 1, collect_flags, &err), KV_OK,
                 "%s", err.msg);
    /* without resume a run would start over; with it, it continues at 3 */
    cr_assert_eq(kv_collect_start(m, 0, &o, &s, &err), KV_OK, "%s", err.msg);
    cr_assert(!o.resume && o.resumed_from == -1 && s->info.plan_windows == 0);
    kv_stats_free(s);
    cr_assert_eq(kv_collect_start(m, 1, &o, &s, &err), KV_OK, "%s", err.msg);
    cr_assert(o.resume && o.resumed_from == 3 && s->info.next_window == 3 && s->info.plan_windows == 8);
    o.progress = NULL;
    cr_assert_eq(kv_collect_run(m, c, s, &o, &err), KV_OK, "%s", err.msg);
    cr_assert(o.run_windows == 5 && s->info.windows == 8);
    kv_stats_free(s);
    kv_calib_free(c);
    unlink(out), unlink(txt), rmdir(dir);
    free(out), free(txt), free(dir);
    kv_model_close(m);
}
