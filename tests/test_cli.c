/* The kvcal binary: exit codes and the exact messages users see.
 * Corrupt fixtures are built here from the shared models (mutated copies)
 * or from scratch. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvrt.h"
#include "testutil.h"

/* Run kvcal; assert exit code and exact stderr. */
static void expect_cli(const char *args, int code, const char *want_err) {
    char *out, *err;
    int rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, code, "kvcal %s: exit %d, want %d; stderr:\n%s", args, rc, code, err);
    if (want_err) cr_assert_str_eq(err, want_err, "kvcal %s", args);
    free(out), free(err);
}

static char *read_shared(const char *rel, size_t *len) {
    const char *p = kvt_shared(rel);
    if (!p) cr_skip_test("shared file '%s' is absent; skipping", rel);
    char *b = kvt_read_file(p, len);
    cr_assert_not_null(b);
    return b;
}

static void put_le64(char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (char)(v >> (8 * i));
}

/* Position just after the tensor-info name `name` in a GGUF buffer. */
static size_t after_name(const char *buf, size_t len, const char *name) {
    const char *hit = memmem(buf, len, name, strlen(name));
    cr_assert_not_null(hit, "'%s' not found", name);
    return (size_t)(hit - buf) + strlen(name);
}

/* Fixture path with a stable name so messages can be pinned. */
static char *fixture(const char *dir, const char *name, const void *data, size_t len) {
    char *p = kvt_path(dir, name);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(data, 1, len, f), len);
    fclose(f);
    return p;
}

static void expect_load_error(const char *path, const char *msg) {
    char args[4096], want[8192];
    snprintf(args, sizeof args, "inspect '%s'", path);
    snprintf(want, sizeof want, "kvcal: %s\n", msg);
    expect_cli(args, 1, want);
}

/* ------------------------------------------------------------- usage */

Test(cli, no_arguments_lists_commands_and_succeeds) {
    char *out;
    cr_assert_eq(kvt_run_cli("", &out, NULL), 0);
    cr_assert(strstr(out, "usage: kvcal <command>") && strstr(out, "verify") &&
              strstr(out, "generate") && strstr(out, "inspect"), "%s", out);
    free(out);
    cr_assert_eq(kvt_run_cli("help", &out, NULL), 0);
    free(out);
}

Test(cli, unknown_command_names_the_nearest) {
    expect_cli("verfy", 2, "kvcal: unknown command 'verfy'; did you mean 'verify'?\n");
    expect_cli("frobnicate", 2, "kvcal: unknown command 'frobnicate'; run 'kvcal help' for the list\n");
}

Test(cli, help_goes_to_stdout_with_exit_0) {
    char *out, *err;
    cr_assert_eq(kvt_run_cli("verify --help", &out, &err), 0);
    cr_assert(strncmp(out, "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options]\n", 74) == 0, "%s", out);
    cr_assert(strstr(out, "--seq-len N") && strstr(out, "protocol (windows)"), "%s", out);
    cr_assert_str_eq(err, "");
    free(out), free(err);
    cr_assert_eq(kvt_run_cli("help generate", &out, NULL), 0);
    cr_assert(strstr(out, "usage: kvcal generate"), "%s", out);
    free(out);
}

Test(cli, usage_errors_exit_2_with_one_message_and_the_usage) {
    expect_cli("verify --text x.txt", 2,
               "kvcal verify: missing --model\n"
               "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options] (see 'kvcal verify --help')\n");
    expect_cli("verify --model m --text t --seq-len abc", 2,
               "kvcal verify: option '--seq-len' needs an integer, got 'abc'\n"
               "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options] (see 'kvcal verify --help')\n");
    expect_cli("verify --model m --text t --seq-len 1", 2,
               "kvcal verify: --seq-len must be at least 2, got 1\n"
               "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options] (see 'kvcal verify --help')\n");
    expect_cli("verify --model m --text t --tokens u", 2,
               "kvcal verify: give exactly one of --text or --tokens\n"
               "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options] (see 'kvcal verify --help')\n");
    expect_cli("inspect --bogus", 2,
               "kvcal inspect: unknown option '--bogus'\n"
               "usage: kvcal inspect PATH [--json]  |  STATS.kvstats [--model PATH] [--json] "
               "(see 'kvcal inspect --help')\n");
    expect_cli("generate --model", 2,
               "kvcal generate: option '--model' needs a value\n"
               "usage: kvcal generate --model PATH [--prompt TEXT] [-n N] (see 'kvcal generate --help')\n");
}

/* Numbers that are not finite, a value option given twice, and the
 * bounds of --threads, --max-windows, --eps and --ratio: each a usage error
 * naming what was given (before, nan and inf were taken, so --device-tol
 * nan never failed and train --lr inf ran to a nan loss; a repeated -m kept
 * the last; --eps 0 asked for --eps; --eps 1.0000001 printed as 1). */
Test(cli, option_values_are_checked_as_given) {
    const char *vu = "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options] (see 'kvcal verify --help')\n";
    const char *du = "usage: kvcal decompose --model PATH [--stats FILE] -o DIR (--eps E | --ratio R) [options] "
                     "(see 'kvcal decompose --help')\n";
    const char *tu = "usage: kvcal train --text FILE -o DIR [options] (see 'kvcal train --help')\n";
    char want[1024];
    const struct {
        const char *args, *msg, *usage;
    } rows[] = {
        {"verify -m m -t t --device twin --device-tol nan", "kvcal verify: option '--device-tol' needs a finite number, got 'nan'\n", vu},
        {"verify -m m -t t --device-tol -inf", "kvcal verify: option '--device-tol' needs a finite number, got '-inf'\n", vu},
        {"verify -m a -m b -t t", "kvcal verify: option '--model' given twice\n", vu},
        {"verify -m a -t t --text u", "kvcal verify: option '--text' given twice\n", vu},
        {"verify -m m -t t --threads -1", "kvcal verify: --threads must be 0 (all cores) or more\n", vu},
        {"verify -m m -t t --max-windows -1", "kvcal verify: --max-windows must be 0 (every window) or more\n", vu},
        {"bench-attn --synthetic llama7b --keep nan", "kvcal bench-attn: option '--keep' needs a finite number, got 'nan'\n",
         "usage: kvcal bench-attn (--synthetic PRESET | --manifest DIR) [options] (see 'kvcal bench-attn --help')\n"},
        {"decompose -m m -o o --d-min inf --eps 0.9", "kvcal decompose: option '--d-min' needs a finite number, got 'inf'\n", du},
        {"decompose -m m -o o --eps 0", "kvcal decompose: --eps 0 is outside (0, 1]\n", du},
        {"decompose -m m -o o --ratio -0.5", "kvcal decompose: --ratio -0.5 is outside (0, 1]\n", du},
        {"decompose -m m -o o --eps 1.0000001", "kvcal decompose: --eps 1.0000001 is outside (0, 1]\n", du},
        {"decompose -m m -o o --eps 0.9 --threads -2", "kvcal decompose: --threads must be 0 (all cores) or more\n", du},
        {"train --text t -o o --lr inf", "kvcal train: option '--lr' needs a finite number, got 'inf'\n", tu},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        snprintf(want, sizeof want, "%s%s", rows[i].msg, rows[i].usage);
        expect_cli(rows[i].args, 2, want);
    }
}

/* A llama2.c tokenizer.bin cut at a record boundary reads as truncated
 * when it is paired with a model (its vocabulary is the count), instead of
 * a smaller tokenizer whose perplexity is nonsense. */
Test(cli, truncated_tokenizer_bin_is_refused) {
    size_t len;
    char *b = read_shared("models/stories260K/tok512.bin", &len);
    const char *m = kvt_shared("models/stories260K/stories260K.bin");
    char *dir = kvt_temp_dir(), *t = fixture(dir, "t.bin", b, 1220), *txt = fixture(dir, "x.txt", "Once upon a time.", 17);
    char args[4096], want[4096];
    snprintf(args, sizeof args, "verify -m '%s' --tokenizer '%s' -t '%s' -q", m, t, txt);
    snprintf(want, sizeof want, "kvcal: %s: offset 1220: truncated: need 4 bytes for the score of token 87, have 0\n", t);
    expect_cli(args, 1, want);
    free(b), free(t), free(txt);
    kvt_rm_dir(dir);
}

/* A FIFO (or pipe, or device) in place of an input file is refused at
 * once, naming it: before, one without a writer blocked forever and one
 * with a writer read as empty. The timeout is the test of "at once". */
Test(cli, fifos_are_not_read, .timeout = 30) {
    const char *p = kvt_shared("models/stories260K/stories260K.bin");
    if (!p) cr_skip_test("shared models are absent; skipping");
    char *m = strdup(p), *t = strdup(kvt_shared("models/stories260K/tok512.bin"));
    char *dir = kvt_temp_dir(), *f = kvt_path(dir, "fifo"), *txt = fixture(dir, "x.txt", "Once upon a time.", 17);
    cr_assert_eq(mkfifo(f, 0600), 0);
    char args[5][4096], want[4096];
    snprintf(args[0], sizeof args[0], "verify -m '%s' --tokenizer '%s' -t '%s' -q", m, t, f);
    snprintf(args[1], sizeof args[1], "verify -m '%s' -t '%s' -q", f, txt);
    snprintf(args[2], sizeof args[2], "verify -m '%s' --tokenizer '%s' -t '%s' -q", m, f, txt);
    snprintf(args[3], sizeof args[3], "verify -m '%s' --tokens '%s' -q", m, f);
    snprintf(args[4], sizeof args[4], "inspect '%s'", f);
    snprintf(want, sizeof want, "kvcal: %s: not a regular file (a pipe, FIFO or device is not read; give a file)\n", f);
    for (int i = 0; i < 5; i++) expect_cli(args[i], 1, want);
    unlink(f);
    free(f), free(txt), free(m), free(t);
    kvt_rm_dir(dir);
}

static char *device_text(const char *dir);
static double json_get(json_t *o, const char *key, const char *out);

/* The finding of an adversarial run: with a symlink planted at the old
 * fixed temporary name, collect overwrote its target. Now the temporary
 * has a name of its own, created exclusively. */
Test(cli, a_planted_temporary_is_not_followed, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *st = kvt_path(dir, "x.kvstats");
    char *victim = kvt_path(dir, "victim.txt"), *link_path = kvt_path(dir, "x.kvstats.tmp");
    free(fixture(dir, "victim.txt", "precious", 8));
    cr_assert_eq(symlink(victim, link_path), 0);
    char args[8192];
    snprintf(args, sizeof args, "collect -m data/kjv-llama -t '%s' --seq-len 128 -q -o '%s'", t, st);
    expect_cli(args, 0, "");
    size_t n;
    char *v = kvt_read_file(victim, &n);
    cr_assert(v && n == 8 && !memcmp(v, "precious", 8), "the symlink's target was written");
    struct stat sb;
    cr_assert_eq(lstat(st, &sb), 0);
    cr_assert(S_ISREG(sb.st_mode), "%s is not a regular file", st);
    cr_assert_eq(kvt_tmp_left(st), 0);
    free(v), free(victim), free(link_path), free(st), free(t);
    kvt_rm_dir(dir);
}

/* Past a file-size limit (ulimit -f) a run says so and exits 1, leaving no
 * temporary and no output, instead of dying of SIGXFSZ. */
Test(cli, a_file_size_limit_is_reported, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *st = kvt_path(dir, "x.kvstats");
    char args[8192], *out, *err;
    snprintf(args, sizeof args, "collect -m data/kjv-llama -t '%s' --seq-len 128 -q -o '%s'", t, st);
    struct rlimit rl = {.rlim_cur = 64 * 1024, .rlim_max = RLIM_INFINITY};
    struct rlimit old;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    rl.rlim_max = old.rlim_max;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    int rc = kvt_run_cli(args, &out, &err);
    setrlimit(RLIMIT_FSIZE, &old);
    cr_assert_eq(rc, 1, "exit %d, want 1; stderr:\n%s", rc, err);
    char want[8192];
    snprintf(want, sizeof want, "kvcal: %s: cannot write '%s.tmp-", st, st);
    cr_assert(!strncmp(err, want, strlen(want)), "stderr '%s' does not start '%s'", err, want);
    cr_assert(strstr(err, "': file too large\n"), "stderr '%s'", err);
    cr_assert_eq(kvt_tmp_left(st), 0);
    cr_assert_eq(access(st, F_OK), -1, "%s exists", st);
    free(out), free(err), free(st), free(t);
    kvt_rm_dir(dir);
}

/* kvcal ARGS under an address-space limit of kb KiB (ulimit -v), killed
 * after 10 s: the exit status (137 when it was killed), stderr in *err. */
static int run_limited(long kb, const char *args, char **err) {
    const char *bin = getenv("KVCAL_BIN");
    if (!bin || !*bin) bin = "build/kvcal";
    char *dir = kvt_temp_dir(), *ep = kvt_path(dir, "err"), cmd[16384];
    snprintf(cmd, sizeof cmd,
             "timeout -s KILL 10 sh -c 'ulimit -v %ld && exec \"$0\" \"$@\"' %s %s "
             ">/dev/null 2>'%s' </dev/null",
             kb, bin, args, ep);
    int st = system(cmd);
    *err = kvt_read_file(ep, NULL);
    cr_assert_not_null(*err);
    unlink(ep), free(ep), rmdir(dir), free(dir);
    cr_assert(st != -1 && WIFEXITED(st), "%s: status %d", cmd, st);
    return WEXITSTATUS(st);
}

/* The finding of an adversarial run: under ulimit -v OpenBLAS retried a
 * failed work-buffer mapping forever, in its constructor (before main) or
 * inside a matrix product, so even 'kvcal inspect' hung. Now every command,
 * under 50, 100, 200 and 400 MiB, ends within 10 s with a result or a
 * message; one thread's run fits in 400 MiB. */
Test(cli, no_command_hangs_under_an_address_space_limit, .timeout = 600) {
    KVT_SKIP_SANITIZED("the shadow memory needs more address space than any of these limits");
    char *dir = kvt_temp_dir(), *t = device_text(dir), *st = kvt_path(dir, "s.kvstats"),
         *c = kvt_path(dir, "c"), args[8192];
    snprintf(args, sizeof args, "collect -m data/kjv-llama -t '%s' --seq-len 128 -q -o '%s'", t, st);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "decompose -m data/kjv-llama -s '%s' --method svd --ratio 0.5 -q -o '%s'", st, c);
    expect_cli(args, 0, "");
    const char *fmt[] = {
        "inspect data/kjv-llama",
        "verify -m data/kjv-llama -t '%1$s/verses.txt' --threads 1",
        "verify -m data/kjv-llama -t '%1$s/verses.txt'",
        "generate -m data/kjv-llama -p In -n 4 --threads 1",
        "collect -m data/kjv-llama -t '%1$s/verses.txt' --seq-len 128 -q -o '%1$s/x.kvstats'",
        "merge '%1$s/s.kvstats' -o '%1$s/m.kvstats'",
        "decompose -m data/kjv-llama -s '%1$s/s.kvstats' --ratio 0.5 -q -o '%1$s/d'",
        "export --dense '%1$s/c' --model data/kjv-llama -o '%1$s/e'",
        "train --text '%1$s/verses.txt' -o '%1$s/tr' --dim 32 --layers 1 --heads 2 --steps 2 "
        "--seq-len 16 --batch 2 --threads 1",
        "bench-attn --synthetic gpt2-xl --device twin --ctx 1K -q",
    };
    const long mib[] = {50, 100, 200, 400};
    for (size_t i = 0; i < sizeof mib / sizeof mib[0]; i++)
        for (size_t j = 0; j < sizeof fmt / sizeof fmt[0]; j++) {
            char *err;
            snprintf(args, sizeof args, fmt[j], dir);
            int rc = run_limited(mib[i] * 1024, args, &err);
            cr_assert(rc != 137, "ulimit -v %ld MiB: kvcal %s ran past 10 s; stderr:\n%s", mib[i], args, err);
            /* 127: the loader could not even map the C library */
            cr_assert(rc == 0 || ((rc == 1 || rc == 127) && *err), "ulimit -v %ld MiB: kvcal %s: exit %d; stderr:\n%s",
                      mib[i], args, rc, err);
            if (mib[i] == 400 && j == 1) cr_assert_eq(rc, 0, "kvcal %s: exit %d; stderr:\n%s", args, rc, err);
            if (mib[i] == 200 && j == 0)
                cr_assert(strstr(err, "kvcal: out of memory: the BLAS library could not map a ") == err &&
                              strstr(err, "(address-space limit, ulimit -v: 200 MiB); raise the limit"),
                          "stderr:\n%s", err);
            free(err);
        }
    free(st), free(c), free(t);
    kvt_rm_dir(dir);
}

/* The finding of an adversarial run: tokenizing held ~55 bytes per byte
 * of text (a 10 MB text needed 585 MB). Now verify and collect stream
 * their text: on 8 MB the peak RSS stays under 96 MiB (before, verify
 * peaked at 264 MiB). */
Test(cli, verify_and_collect_stream_a_large_text, .timeout = 300) {
    KVT_SKIP_SANITIZED("the shadow memory and quarantine inflate the peak rss");
    char *dir = kvt_temp_dir(), *big = kvt_path(dir, "big.txt"), *st = kvt_path(dir, "s.kvstats");
    const char *verse = "And God said, Let there be light: and there was light. And God saw the "
                        "light, that it was good: and God divided the light from the darkness.\n";
    FILE *f = fopen(big, "wb");
    cr_assert_not_null(f);
    size_t n = 0;
    while (n < (size_t)8 << 20) n += fwrite(verse, 1, strlen(verse), f);
    cr_assert_eq(fclose(f), 0);
    char args[8192], *out, *err;
    snprintf(args, sizeof args, "verify -m data/kjv-llama -t '%s' --max-windows 2 --json -q", big);
    int rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "%s", je.text);
    double rss = json_get(o, "peak_rss_mib", out), tokens = json_get(o, "tokens", out);
    cr_assert(rss < 96, "verify of %zu bytes peaked at %.1f MiB", n, rss);
    cr_assert(tokens > (double)n / 4, "%.0f tokens in %zu bytes", tokens, n);
    json_decref(o), free(out), free(err);
    snprintf(args, sizeof args,
             "collect -m data/kjv-llama -t '%s' --seq-len 128 --samples 2 -o '%s'", big, st);
    rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
    const char *p = strstr(out, "peak rss ");
    cr_assert(p, "no peak rss in:\n%s", out);
    rss = strtod(p + strlen("peak rss "), NULL);
    cr_assert(rss < 96, "collect of %zu bytes peaked at %.1f MiB", n, rss);
    free(out), free(err), free(big), free(st);
    kvt_rm_dir(dir);
}

/* A tokenizer that adds no BOS (no template, no config saying so) reads
 * texts without one, as Qwen and GPT-2 style models do: verify and collect
 * run and say so, and generate needs a prompt to start from. */
Test(cli, a_tokenizer_without_bos_reads_text_without_it, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *m = kvt_path(dir, "nobos"), args[8192];
    cr_assert_eq(mkdir(m, 0755), 0);
    size_t len;
    char *cfg = kvt_read_file("data/kjv-llama/config.json", &len);
    cr_assert_not_null(cfg);
    char *bos = strstr(cfg, "\"bos_token_id\": 256,");
    cr_assert_not_null(bos);
    memmove(bos, bos + strlen("\"bos_token_id\": 256,"), strlen(bos + strlen("\"bos_token_id\": 256,")) + 1);
    free(fixture(m, "config.json", cfg, strlen(cfg)));
    json_error_t je;
    json_t *tj = json_load_file("data/kjv-llama/tokenizer.json", 0, &je);
    cr_assert_not_null(tj, "%s", je.text);
    json_object_del(tj, "post_processor");
    char *tp = kvt_path(m, "tokenizer.json");
    cr_assert_eq(json_dump_file(tj, tp, 0), 0);
    json_decref(tj);
    char cp[4096];
    snprintf(cp, sizeof cp, "cp data/kjv-llama/model.safetensors '%s/'", m);
    cr_assert_eq(system(cp), 0);
    char *out, *err;
    long long with = 0, without = 0;
    snprintf(args, sizeof args, "verify -m data/kjv-llama -t '%s' --seq-len 64 -q", t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    char *p = strstr(out, "bytes, ");
    cr_assert(p && sscanf(p, "bytes, %lld tokens with BOS", &with) == 1, "%s", out);
    free(out), free(err);
    snprintf(args, sizeof args, "verify -m '%s' -t '%s' --seq-len 64 -q", m, t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    p = strstr(out, "bytes, ");
    cr_assert(p && sscanf(p, "bytes, %lld tokens without BOS", &without) == 1, "%s", out);
    cr_assert_eq(without, with - 1, "the same tokens less BOS");
    free(out), free(err);
    snprintf(args, sizeof args, "collect -m '%s' -t '%s' --seq-len 64 -q -o '%s/s.kvstats'", m, t,
             dir);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    cr_assert(strstr(out, "tokens    bos=0 eos=0 special=text\n"), "%s", out);
    free(out), free(err);
    snprintf(args, sizeof args, "generate -m '%s' -n 2", m);
    expect_cli(args, 1,
               "kvcal: the prompt is empty and the tokenizer adds no bos token: give a prompt\n");
    snprintf(args, sizeof args, "generate -m '%s' -n 2 -p 'In the'", m);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    free(out), free(err);
    free(cfg), free(tp), free(m), free(t);
    kvt_rm_dir(dir);
}

/* The finding of an adversarial run: a Metaspace replacement of 5000
 * bytes gave "space piece is 5000 bytes but must be 1..4096", naming no
 * file (later the file, but not the field). Now both are named. */
Test(cli, an_overlong_space_replacement_names_the_tokenizer) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *tp = kvt_path(dir, "tokenizer.json");
    json_error_t je;
    json_t *tj = json_load_file("data/kjv-llama/tokenizer.json", 0, &je);
    cr_assert_not_null(tj, "%s", je.text);
    char *rep = malloc(5001);
    memset(rep, 'x', 5000), rep[5000] = 0;
    json_object_set_new(tj, "pre_tokenizer", json_pack("{s:s, s:s}", "type", "Metaspace", "replacement", rep));
    cr_assert_eq(json_dump_file(tj, tp, 0), 0);
    json_decref(tj);
    char args[8192], want[8192];
    snprintf(args, sizeof args, "verify -m data/kjv-llama --tokenizer '%s' -t '%s' -q", tp, t);
    snprintf(want, sizeof want,
             "kvcal: %s: the replacement for ' ' (pre_tokenizer Metaspace or normalizer Replace) "
             "is 5000 bytes, more than a piece may hold (4096)\n", tp);
    expect_cli(args, 1, want);
    free(rep), free(tp), free(t);
    kvt_rm_dir(dir);
}

/* The finding of an adversarial run: bytes that are not UTF-8 (here in a
 * path and in an option's value) were echoed raw to the terminal. Now
 * each such byte shows as U+FFFD. */
Test(cli, bytes_that_are_not_utf8_are_not_echoed_raw) {
    const char *runs[][2] = {
        {"inspect '/nonexistent/\xff\xfe.bin'", "kvcal: /nonexistent/\xef\xbf\xbd\xef\xbf\xbd.bin: "},
        {"verify -m data/kjv-llama -t x --seq-len '\xff'",
         "kvcal verify: option '--seq-len' needs an integer, got '\xef\xbf\xbd'\n"},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char *out, *err;
        int rc = kvt_run_cli(runs[i][0], &out, &err);
        cr_assert(rc == 1 || rc == 2, "kvcal %s: exit %d", runs[i][0], rc);
        cr_assert(!strchr(err, '\xff') && !strchr(err, '\xfe'), "raw bytes in: %s", err);
        cr_assert(!strncmp(err, runs[i][1], strlen(runs[i][1])), "stderr '%s' does not start '%s'",
                  err, runs[i][1]);
        free(out), free(err);
    }
}

/* The finding of an adversarial run: zack keys of GPT-2 were refused for
 * export because they "act after rope", which GPT-2 does not have. Now the
 * refusal says what the mode is and what export writes. */
Test(cli, export_of_gpt2_rotated_keys_is_refused_without_rope, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *st = kvt_path(dir, "s.kvstats"),
         *c = kvt_path(dir, "c"), *e = kvt_path(dir, "e"), args[8192], want[8192];
    snprintf(args, sizeof args, "collect -m data/kjv-gpt2 -t '%s' --seq-len 64 -q -o '%s'", t, st);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "decompose -m data/kjv-gpt2 -s '%s' --method zack --ratio 0.5 -q -o '%s'", st, c);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "export --dense '%s' --model data/kjv-gpt2 -o '%s'", c, e);
    snprintf(want, sizeof want,
             "kvcal: %s: layer 0 k: mode 'postrope_rotation' (a rotation of the projected keys, "
             "from --method zack or fdc) is not exported dense: export writes prerope_latent and "
             "fused_query keys\n", c);
    expect_cli(args, 1, want);
    cr_assert_eq(access(e, F_OK), -1, "%s was written", e);
    free(st), free(c), free(e), free(t);
    kvt_rm_dir(dir);
}

/* The finding of an adversarial run: the .kvstats crc32s covered the
 * tensors, not the metadata, so a changed seed or dataset size went
 * unnoticed. Now kvcal.meta_crc32 covers it: one changed value is
 * refused with the key and its offset. */
Test(cli, a_changed_kvstats_metadata_value_is_detected, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *st = kvt_path(dir, "s.kvstats"), args[8192];
    snprintf(args, sizeof args, "collect -m data/kjv-llama -t '%s' --seq-len 128 -q -o '%s'", t, st);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "inspect '%s'", st);
    expect_cli(args, 0, NULL);
    size_t len;
    unsigned char *b = (unsigned char *)kvt_read_file(st, &len);
    cr_assert_not_null(b);
    /* GGUF: the key, a u32 type, then the u64 value */
    const char key[] = "kvcal.seed";
    unsigned char *k = memmem(b, len, key, sizeof key - 1);
    cr_assert_not_null(k);
    size_t val = (size_t)(k - b) + sizeof key - 1 + 4;
    b[val] ^= 1;
    free(fixture(dir, "s.kvstats", b, len));
    int rc;
    char *out, *err;
    rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, 1, "exit %d; stderr:\n%s", rc, err);
    char want[8192];
    snprintf(want, sizeof want, "kvcal: %s: offset ", st);
    cr_assert(!strncmp(err, want, strlen(want)) &&
                  strstr(err, ": key 'kvcal.meta_crc32': metadata crc32 mismatch (stored "),
              "stderr: %s", err);
    free(out), free(err), free(b), free(st), free(t);
    kvt_rm_dir(dir);
}

/* train writes its model beside the output and puts it in place whole
 * (the fault table kills it at every step); so it replaces only a
 * directory that holds nothing but an earlier model's files. */
Test(cli, train_refuses_to_replace_a_directory_with_other_files, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *o = kvt_path(dir, "o"), args[8192], want[8192];
    snprintf(args, sizeof args,
             "train --text '%s' -o '%s' --dim 32 --layers 1 --heads 2 --steps 1 --seq-len 16 "
             "--batch 2 -q", t, o);
    expect_cli(args, 0, "");
    expect_cli(args, 0, ""); /* an earlier model is replaced */
    free(fixture(o, "notes.txt", "mine", 4));
    snprintf(want, sizeof want,
             "kvcal: %s: holds 'notes.txt', not a file of a trained model (config.json, "
             "model.safetensors, tokenizer.json, train_log.tsv); refusing to replace it\n", o);
    expect_cli(args, 1, want);
    char *notes = kvt_path(o, "notes.txt");
    cr_assert_eq(access(notes, F_OK), 0, "notes.txt was removed");
    free(notes), free(o), free(t);
    kvt_rm_dir(dir);
}

/* A manifest whose shapes no machine holds (the adversarial run's dim
 * 2^20 took 9.4 GB and a minute) is refused before anything is allocated,
 * with the shapes and both sizes. */
Test(cli, bench_attn_refuses_a_manifest_too_large_to_time, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *st = kvt_path(dir, "s.kvstats"), *c = kvt_path(dir, "c");
    char args[8192];
    snprintf(args, sizeof args, "collect -m data/kjv-llama -t '%s' --seq-len 128 -q -o '%s'", t, st);
    expect_cli(args, 0, "");
    snprintf(args, sizeof args, "decompose -m data/kjv-llama -s '%s' --method svd --ratio 0.5 -q -o '%s'", st, c);
    expect_cli(args, 0, "");
    char *mp = kvt_path(c, "kvcal.json");
    json_error_t je;
    json_t *root = json_load_file(mp, 0, &je);
    cr_assert_not_null(root, "%s", je.text);
    json_t *model = json_object_get(root, "model"), *kb = json_object_get(root, "kv_bytes_per_token");
    json_object_set_new(model, "dim", json_integer(1 << 20));
    json_object_set_new(model, "head_dim", json_integer(1 << 14));
    json_object_set_new(json_object_get(root, "rope"), "rotary_dim", json_integer(1 << 14));
    /* the base bytes follow the shapes: 4 layers, 2 KV heads, k and v, f16 */
    json_int_t base = 4 * 2 * 2 * (1 << 14) * 2;
    json_object_set_new(kb, "base", json_integer(base));
    json_object_set_new(kb, "ratio", json_real((double)json_integer_value(json_object_get(kb, "compressed")) / (double)base));
    cr_assert_eq(json_dump_file(root, mp, JSON_INDENT(1)), 0);
    json_decref(root);
    snprintf(args, sizeof args, "bench-attn --manifest '%s' --device twin --ctx 1K -q", c);
    char *out, *err;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = kvt_run_cli(args, &out, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    cr_assert_eq(rc, 1, "exit %d; stderr:\n%s", rc, err);
    const char *want = "kvcal: timing the manifest's shapes (dim 1048576, 4 layers, 4 heads of 16384) needs at least "
                       "6147.1 GiB for its synthetic weights, but ";
    cr_assert(!strncmp(err, want, strlen(want)), "stderr '%s'", err);
    cr_assert(strstr(err, " GiB of memory is available\n"), "stderr '%s'", err);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    cr_assert_lt(s, 10.0, "took %.1f s", s);
    free(out), free(err), free(mp), free(st), free(t);
    kvt_rm_dir(c);
    kvt_rm_dir(dir);
}

/* A tokenizer.json with more pieces than config.json's vocab_size is
 * blamed on the tokenizer, not on model.safetensors. */
Test(cli, a_tokenizer_larger_than_the_vocabulary_is_named) {
    char *dir = kvt_temp_dir(), *hf = kvt_path(dir, "hf");
    cr_assert_eq(mkdir(hf, 0755), 0);
    const char *names[] = {"config.json", "model.safetensors", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        char src[256];
        snprintf(src, sizeof src, "data/kjv-llama/%s", names[i]);
        size_t n;
        char *b = kvt_read_file(src, &n);
        cr_assert_not_null(b, "%s", src);
        free(fixture(hf, names[i], b, n));
        free(b);
    }
    char *tp = kvt_path(hf, "tokenizer.json");
    json_error_t je;
    json_t *root = json_load_file(tp, 0, &je), *added = json_object_get(root, "added_tokens");
    cr_assert(json_is_array(added), "%s", je.text);
    for (int id = 258; id < 260; id++)
        json_array_append_new(added, json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content",
                                               id == 258 ? "<x1>" : "<x2>", "single_word", 0, "lstrip", 0,
                                               "rstrip", 0, "normalized", 0, "special", 1));
    cr_assert_eq(json_dump_file(root, tp, 0), 0);
    json_decref(root);
    char args[4096], want[4096];
    snprintf(args, sizeof args, "inspect '%s'", hf);
    snprintf(want, sizeof want, "kvcal: %s: tokenizer has 260 pieces but config.json's vocab_size is 258\n", tp);
    expect_cli(args, 1, want);
    free(tp), free(hf);
    kvt_rm_dir(dir);
}

Test(cli, missing_files_exit_1) {
    expect_cli("inspect /nonexistent/model.gguf", 1,
               "kvcal: /nonexistent/model.gguf: no such file or directory\n");
}

/* ------------------------------------------------------------- corrupt GGUF */

Test(cli, corrupt_gguf_files_are_refused_with_file_and_offset) {
    size_t len;
    char *g = read_shared("models/stories260K/stories260K.gguf", &len);
    char *dir = kvt_temp_dir(), msg[4096];

    char *bad = malloc(len);
    memcpy(bad, g, len);
    memcpy(bad, "XGUF", 4);
    char *p = fixture(dir, "badmagic.gguf", bad, len);
    snprintf(msg, sizeof msg, "%s: offset 0: bad magic 'XGUF', expected 'GGUF'", p);
    expect_load_error(p, msg);
    free(p);

    memcpy(bad, g, len);
    bad[4] = 1;
    p = fixture(dir, "v1.gguf", bad, len);
    snprintf(msg, sizeof msg, "%s: offset 4: unsupported gguf version 1, expected 2 or 3", p);
    expect_load_error(p, msg);
    free(p);

    p = fixture(dir, "trunc.gguf", g, 5000);
    snprintf(msg, sizeof msg,
             "%s: offset 4996: truncated: need 8 bytes for element 370 of key "
             "'tokenizer.ggml.tokens', have 4", p);
    expect_load_error(p, msg);
    free(p);

    memcpy(bad, g, len);
    size_t at = after_name(g, len, "token_embd.weight") + 4 + 16 + 4; /* n_dims, ne[2], type */
    put_le64(bad + at, 4);
    p = fixture(dir, "misaligned.gguf", bad, len);
    snprintf(msg, sizeof msg,
             "%s: offset %zu: tensor 'token_embd.weight' offset 4 is not a multiple of the "
             "alignment 32", p, at);
    expect_load_error(p, msg);
    free(p);

    memcpy(bad, g, len);
    at = after_name(g, len, "blk.4.ffn_norm.weight") + 4 + 8 + 4; /* 1-d tensor */
    put_le64(bad + at, (uint64_t)1 << 30);
    p = fixture(dir, "range.gguf", bad, len);
    snprintf(msg, sizeof msg,
             "%s: offset %zu: tensor 'blk.4.ffn_norm.weight' at data offset 1073741824 needs 256 "
             "bytes but the data section holds 1171200", p, at);
    expect_load_error(p, msg);
    free(p);
    free(bad), free(g), free(dir);
}

/* ------------------------------------------------------------- llama2.c */

Test(cli, llama2c_file_whose_size_does_not_match_its_header) {
    size_t len;
    char *b = read_shared("models/stories260K/stories260K.bin", &len);
    char *dir = kvt_temp_dir(), msg[4096];
    char *p = fixture(dir, "short.bin", b, len - 4);
    snprintf(msg, sizeof msg,
             "%s: file is 1056536 bytes but header (dim 64, hidden 172, layers 5, heads 8, kv "
             "heads 4, vocab 512, seq 512) implies 1056540", p);
    expect_load_error(p, msg);
    free(p), free(b), free(dir);
}

/* ------------------------------------------------------------- safetensors */

/* An HF directory with the tinystories-656K config and the given
 * model.safetensors bytes (and optionally a replaced config). */
static char *hf_dir(const char *name, const void *st, size_t st_len, const char *cfg) {
    size_t cl;
    char *real_cfg = read_shared("models/tinystories-656K/config.json", &cl);
    char *root = kvt_temp_dir();
    char *dir = kvt_path(root, name);
    cr_assert_eq(mkdir(dir, 0755), 0);
    free(fixture(dir, "config.json", cfg ? cfg : real_cfg, cfg ? strlen(cfg) : cl));
    free(fixture(dir, "model.safetensors", st, st_len));
    free(real_cfg), free(root);
    return dir;
}

/* safetensors bytes: 8-byte header length, the JSON header, zeroed data. */
static char *st_bytes(const char *header, size_t data_len, size_t *len) {
    size_t hl = strlen(header);
    *len = 8 + hl + data_len;
    char *b = calloc(1, *len);
    put_le64(b, hl);
    memcpy(b + 8, header, hl);
    return b;
}

static char *replace(const char *s, const char *from, const char *to) {
    const char *hit = strstr(s, from);
    cr_assert_not_null(hit, "'%s' not in config", from);
    size_t a = (size_t)(hit - s), fl = strlen(from), tl = strlen(to), sl = strlen(s);
    char *r = malloc(sl - fl + tl + 1);
    memcpy(r, s, a);
    memcpy(r + a, to, tl);
    memcpy(r + a + tl, hit + fl, sl - a - fl + 1);
    return r;
}

static void expect_hf_error(const char *dir, const char *file, const char *rest) {
    char msg[4096];
    snprintf(msg, sizeof msg, "%s/%s: %s", dir, file, rest);
    expect_load_error(dir, msg);
}

Test(cli, corrupt_safetensors_are_refused_with_file_and_offset) {
    size_t len;
    char *st = read_shared("models/tinystories-656K/model.safetensors", &len);
    char *d = hf_dir("truncated", st, 100000, NULL);
    expect_hf_error(d, "model.safetensors",
                    "offset 2168: truncated: tensor 'lm_head.weight' data_offsets end 1048576 "
                    "exceeds the 97832 data bytes in the file");
    free(d);

    char *big = malloc(len);
    memcpy(big, st, len);
    put_le64(big, 10000000);
    d = hf_dir("hdrlen", big, len, NULL);
    expect_hf_error(d, "model.safetensors", "offset 0: header length 10000000 exceeds file size 2626168");
    free(d), free(big);

    size_t bl;
    char *b = st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 24, &bl);
    d = hf_dir("overlap", b, bl, NULL);
    expect_hf_error(d, "model.safetensors",
                    "offset 125: tensor 'b': data_offsets [8, 24] overlap tensor 'a', which ends at 16");
    free(d), free(b);

    b = st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[20,36]}}", 36, &bl);
    d = hf_dir("gap", b, bl, NULL);
    expect_hf_error(d, "model.safetensors",
                    "offset 138: tensor 'b': data_offsets begin 20 leaves a gap of 4 bytes after "
                    "tensor 'a', which ends at 16");
    free(d), free(b);

    b = st_bytes("{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4, &bl);
    d = hf_dir("dtype", b, bl, NULL);
    expect_hf_error(d, "model.safetensors",
                    "offset 8: tensor 'a': unknown dtype 'F8_E4M3', expected one of F64 F32 F16 "
                    "BF16 I64 I32 I16 I8 U8 BOOL");
    free(d), free(b);

    b = st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                 "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &bl);
    d = hf_dir("dupkey", b, bl, NULL);
    expect_hf_error(d, "model.safetensors", "offset 65: invalid json: duplicate object key near '\"a\"'");
    free(d), free(b), free(st);
}

Test(cli, invalid_config_json_is_refused) {
    size_t len, cl;
    char *st = read_shared("models/tinystories-656K/model.safetensors", &len);
    char *cfg = read_shared("models/tinystories-656K/config.json", &cl);
    char *c1 = replace(cfg, "\"hidden_size\": 128,", "\"hidden_size\": 128,,");
    char *d = hf_dir("badjson", st, len, c1);
    expect_hf_error(d, "config.json", "offset 194: invalid json: string or '}' expected near ','");
    free(d), free(c1);
    c1 = replace(cfg, "\"hidden_size\": 128,", "\"hidden_size\": 128, \"hidden_size\": 64,");
    d = hf_dir("dupcfg", st, len, c1);
    expect_hf_error(d, "config.json",
                    "offset 207: invalid json: duplicate object key near '\"hidden_size\"'");
    free(d), free(c1);
    c1 = replace(cfg, "\"rope_scaling\": null",
                 "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0, \"low_freq_factor\": 1}");
    d = hf_dir("ropescale", st, len, c1);
    expect_hf_error(d, "config.json",
                    "rope_scaling: key 'low_freq_factor' of rope type 'linear' is not supported");
    free(d), free(c1), free(cfg), free(st);
}

/* ------------------------------------------------------------- real runs */

Test(cli, generate_reproduces_the_published_story) {
    const char *p = kvt_shared("models/stories260K/stories260K.gguf");
    if (!p) cr_skip_test("shared models are absent; skipping");
    char args[4096], *out, *err;
    snprintf(args, sizeof args, "generate --model '%s' -n 200 --threads 1", p);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    const char *want = "Once upon a time, there was a little girl named Lily. She loved to play "
                       "outside in the park. One day, she saw a big, red ball. She wanted to play "
                       "with it, but it was too high.";
    cr_assert(strncmp(out, want, strlen(want)) == 0, "got:\n%s", out);
    cr_assert(strstr(err, "generated 200 tokens in "), "%s", err);
    free(out), free(err);
}

Test(cli, verify_json_has_the_protocol_fields) {
    const char *p = kvt_shared("models/tinystories-656K");
    if (!p) cr_skip_test("shared models are absent; skipping");
    char model[4096];
    snprintf(model, sizeof model, "%s", p);
    const char *t = kvt_shared("text/tinystories/val1k.txt");
    char args[8192], *out, *err;
    snprintf(args, sizeof args,
             "verify --model '%s' --text '%s' --seq-len 128 --max-windows 8 --threads 1 --json",
             model, t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    const char *keys[] = {"\"ppl\"", "\"nll\"", "\"tokens\"", "\"windows\": 8", "\"scored\": 1016",
                          "\"tokens_per_s\"", "\"protocol\": \"windows\"", "\"seq_len\": 128"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        cr_assert(strstr(out, keys[i]), "missing %s in:\n%s", keys[i], out);
    cr_assert_str_eq(err, "", "json mode must keep stderr quiet: %s", err);
    free(out), free(err);
}

Test(cli, verify_text_requires_a_tokenizer_for_llama2c) {
    const char *p = kvt_shared("models/stories260K/stories260K.bin");
    if (!p) cr_skip_test("shared models are absent; skipping");
    char args[4096];
    snprintf(args, sizeof args, "verify --model '%s' --text /dev/null", p);
    expect_cli(args, 1,
               "kvcal: the model has no tokenizer: pass --tokenizer FILE (llama2.c tokenizer.bin, "
               "tokenizer.json or .gguf) or --tokens FILE\n");
}

/* A file name that is not valid UTF-8 must not break --json: each bad byte
 * becomes U+FFFD and the rest of the object is intact. */
Test(cli, json_output_survives_a_non_utf8_path) {
    size_t len;
    char *buf = read_shared("models/stories260K/stories260K.gguf", &len);
    const char *t = kvt_shared("text/tinystories/val1k.txt");
    if (!t) cr_skip_test("shared text is absent; skipping");
    char *dir = kvt_temp_dir();
    char *p = fixture(dir, "m\xff\xfe.gguf", buf, len);
    char args[8192], *out, *err;
    snprintf(args, sizeof args, "inspect '%s' --json", p);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    cr_assert(strstr(out, "/m\xef\xbf\xbd\xef\xbf\xbd.gguf\""), "%s", out);
    cr_assert(strstr(out, "\"name\": \"token_embd.weight\""), "%s", out);
    free(out), free(err);
    snprintf(args, sizeof args,
             "verify --model '%s' --text '%s' --seq-len 64 --max-windows 2 --threads 1 --json", p,
             t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    cr_assert(strstr(out, "/m\xef\xbf\xbd\xef\xbf\xbd.gguf\""), "%s", out);
    cr_assert(strstr(out, "\"windows\": 2"), "%s", out);
    free(out), free(err);
    unlink(p);
    rmdir(dir);
    free(p), free(dir), free(buf);
}

/* Errors from the perplexity run itself carry no file; verify names the text. */
Test(cli, verify_names_a_text_too_short_for_one_window) {
    const char *p = kvt_shared("models/stories260K/stories260K.gguf");
    if (!p) cr_skip_test("shared models are absent; skipping");
    char *dir = kvt_temp_dir();
    char *t = fixture(dir, "short.txt", "Once upon a time.", 17);
    char args[8192], want[8192];
    snprintf(args, sizeof args, "verify --model '%s' --text '%s'", p, t);
    snprintf(want, sizeof want, "kvcal: %s: text has 6 tokens, fewer than one window of 256\n", t);
    expect_cli(args, 1, want);
    unlink(t);
    rmdir(dir);
    free(t), free(dir);
}

/* ------------------------------------------------------------- verify --device */

/* The committed byte-level fixture models read any text: a few verses,
 * enough for three windows of 256 tokens. */
static char *device_text(const char *dir) {
    const char *verse = "In the beginning was the Word, and the Word was with God, and the Word "
                        "was God. The same was in the beginning with God. All things were made "
                        "by him; and without him was not any thing made that was made.\n";
    char buf[1024] = "";
    while (strlen(buf) + strlen(verse) < sizeof buf) strcat(buf, verse);
    return fixture(dir, "verses.txt", buf, strlen(buf));
}

static double json_get(json_t *o, const char *key, const char *out) {
    json_t *v = json_object_get(o, key);
    cr_assert(v && json_is_number(v), "no number '%s' in:\n%s", key, out);
    return json_number_value(v);
}

/* verify --json on args; the device ppl within ppl_rtol relative of the
 * cpu's (key cpu_key), the device and cache as named, and the device fields
 * present. An f32 cache reproduces the cpu path to rounding; an f16 cache
 * rounds every cached entry, so its logit, KL and top-1 bounds are looser
 * (the twin's f16 run on tinystories-656K: max rel logit 2.5e-3, KL 4e-7),
 * and so are quantized latents' (loose), whose codes the runtime's GEMV and
 * the cpu's GEMM may round to neighbouring values where a latent sits on a
 * rounding edge (a code flip: kjv-llama svd at 8, 4, 3 and 2 bits, the twin
 * with either cache: ppl within 1.9e-5, max rel logit 1.5e-2, KL 1.2e-5;
 * palu in pairs of heads at 4 bits on an H100: ppl 4.4e-5, max rel logit
 * 2.7e-2, KL 3.0e-6, top-1 1.0), so a flip's logit bound is 5e-2 while
 * its ppl, KL and top-1 bounds stay. */
static void check_device_json(const char *args, const char *cpu_key, const char *device,
                              const char *cache, double ppl_rtol, int loose) {
    int f16 = !strcmp(cache, "f16") || loose;
    char *out, *err;
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "kvcal %s:\n%s", args, err);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert(o, "not JSON (%s): %s", je.text, out);
    cr_assert_str_eq(json_string_value(json_object_get(o, "device")), device, "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(o, "cache")), cache, "%s", out);
    double dev = json_get(o, "device_ppl", out), cpu = json_get(o, cpu_key, out);
    kvt_assert_close_f64(&dev, &cpu, 1, 0, ppl_rtol, "device ppl against the cpu's");
    double rel = json_get(o, "device_rel_ppl", out), want = dev / cpu - 1;
    kvt_assert_close_f64(&rel, &want, 1, 1e-9, 1e-6, "device_rel_ppl (10 digits of ppl)");
    cr_assert_lt(json_get(o, "max_rel_logit", out), loose ? 5e-2 : f16 ? 2e-2 : 1e-4, "%s", out);
    cr_assert_lt(json_get(o, "device_kl", out), f16 ? 1e-4 : 1e-8, "%s", out);
    cr_assert_gt(json_get(o, "device_top1", out), 0.99, "%s", out);
    cr_assert_gt(json_get(o, "device_tokens_per_s", out), 0, "%s", out);
    json_get(o, "device_tol", out);
    json_get(o, "max_rel_logit_window", out);
    json_get(o, "max_rel_logit_position", out);
    cr_assert_str_eq(err, "", "json mode must keep stderr quiet: %s", err);
    json_decref(o);
    free(out), free(err);
}

/* The twin with an f32 cache reproduces the compressed cpu run (text lines
 * and JSON), and without --compressed the base. */
Test(cli, verify_device_twin_reproduces_the_cpu_path, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *c = kvt_path(dir, "c");
    char args[8192], *out, *err;
    snprintf(args, sizeof args, "decompose -m data/kjv-llama --method svd --ratio 0.5 -o '%s' -q",
             c);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    free(out), free(err);
    snprintf(args, sizeof args,
             "verify -m data/kjv-llama --compressed '%s' --text '%s' --device twin --cache f32 "
             "--max-windows 2 --threads 1 -q", c, t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    const char *lines[] = {"\nppl         ", "\n\ndevice      twin (cpu), f32 cache, ",
                           "\ndevice ppl  ", "\nlogits      max rel diff ", " at window ",
                           "KL(cpu || device); top-1 "};
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++)
        cr_assert(strstr(out, lines[i]), "missing '%s' in:\n%s", lines[i], out);
    free(out), free(err);
    snprintf(args, sizeof args,
             "verify -m data/kjv-llama --compressed '%s' --text '%s' --device twin --cache f32 "
             "--max-windows 2 --threads 1 --json", c, t);
    check_device_json(args, "ppl", "twin", "f32", 1e-5, 0);
    snprintf(args, sizeof args,
             "verify -m data/kjv-gpt2 --text '%s' --device twin --cache f32 --max-windows 2 "
             "--threads 1 --json", t);
    check_device_json(args, "ppl", "twin", "f32", 1e-5, 0);
    snprintf(args, sizeof args,
             "verify -m data/kjv-gpt2 --text '%s' --device twin --cache f32 --max-windows 2 "
             "--threads 1 -q", t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    cr_assert(strstr(out, "\nppl       ") &&
                  strstr(out, "\n\ndevice      twin (cpu), f32 cache, ") &&
                  strstr(out, "\ndevice ppl  "),
              "%s", out);
    free(out), free(err);
    kvt_rm_dir(c);
    kvt_rm_dir(dir);
    free(t);
}

/* On a GPU: verify --device cuda reproduces the cpu perplexity, within 1e-5
 * with an f32 cache and 1e-3 with f16, for prerope_latent (svd), grouped
 * prerope (palu --group-size 2) and postrope_rotation (fdc) keys of
 * kjv-llama, fused_query keys (palu) of kjv-gpt2, and both bases; and
 * quantized latents (4-bit postrope, 3-bit fused_query) within 1e-3. */
Test(cli, verify_device_cuda_reproduces_the_cpu_path, .timeout = 600) {
    int count = 0;
    struct kv_err e;
    kv_err_clear(&e);
    if (!kvrt_cuda_built()) cr_skip_test("built without cuda; skipping the gpu test");
    cr_assert_eq(kvrt_device_count(&count, &e), KV_OK, "%s", e.msg); /* see test_kvrt's need_gpu */
    if (count < 1) cr_skip_test("no cuda device (the driver reports none); skipping the gpu test");
    char *dir = kvt_temp_dir(), *t = device_text(dir);
    const char *runs[][2] = {{"kjv-llama", ""},
                             {"kjv-llama", "--method svd --ratio 0.5"},
                             {"kjv-llama", "--method palu --group-size 2 --ratio 0.5"},
                             {"kjv-llama", "--method fdc --ratio 0.5"},
                             {"kjv-gpt2", ""},
                             {"kjv-gpt2", "--method palu --ratio 0.5"},
                             {"kjv-llama", "--method fdc --ratio 0.5"},
                             {"kjv-gpt2", "--method palu --ratio 0.5"}};
    const int bits[] = {0, 0, 0, 0, 0, 0, 4, 3}; /* --kv-bits, 0: the manifest's (16) */
    char args[8192], *out, *err;
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char comp[4096] = "", name[16];
        snprintf(name, sizeof name, "c%zu", i);
        char *c = kvt_path(dir, name);
        if (runs[i][1][0]) {
            char *st = kvt_path(dir, "s.kvstats");
            snprintf(args, sizeof args, "collect -m data/%s -t '%s' --seq-len 128 -q -o '%s'",
                     runs[i][0], t, st);
            cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
            free(out), free(err);
            snprintf(args, sizeof args, "decompose -m data/%s -s '%s' %s -o '%s' -q", runs[i][0],
                     st, runs[i][1], c);
            cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
            free(out), free(err);
            unlink(st);
            free(st);
            snprintf(comp, sizeof comp, "--compressed '%s'", c);
        }
        for (int f16 = 0; f16 < 2; f16++) {
            char kb[32] = "";
            if (bits[i]) snprintf(kb, sizeof kb, " --kv-bits %d", bits[i]);
            snprintf(args, sizeof args,
                     "verify -m data/%s %s%s --text '%s' --device cuda --cache %s --max-windows 2 "
                     "--threads 1 --json",
                     runs[i][0], comp, kb, t, f16 ? "f16" : "f32");
            check_device_json(args, "ppl", "cuda", f16 ? "f16" : "f32", f16 || bits[i] ? 1e-3 : 1e-5,
                              bits[i] != 0);
        }
        if (runs[i][1][0]) kvt_rm_dir(c); /* frees c */
        else free(c);
    }
    kvt_rm_dir(dir);
    free(t);
}

/* On a GPU, every latent mode at every code width: verify --device cuda
 * --kv-bits B (B 8, 4, 3, 2; f16 cache) reproduces the cpu perplexity of
 * the same quantized latents within 1e-3, for one compression of each key
 * mode (model, decompose options): one test each, so that they run side by
 * side. */
static void device_every_width(const char *model, const char *method) {
    int count = 0;
    struct kv_err e;
    kv_err_clear(&e);
    if (!kvrt_cuda_built()) cr_skip_test("built without cuda; skipping the gpu test");
    cr_assert_eq(kvrt_device_count(&count, &e), KV_OK, "%s", e.msg);
    if (count < 1) cr_skip_test("no cuda device (the driver reports none); skipping the gpu test");
    char *dir = kvt_temp_dir(), *t = device_text(dir), *c = kvt_path(dir, "c"), *st = kvt_path(dir, "s.kvstats");
    char args[8192], *out, *err;
    snprintf(args, sizeof args, "collect -m data/%s -t '%s' --seq-len 128 -q -o '%s'", model, t, st);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    free(out), free(err);
    snprintf(args, sizeof args, "decompose -m data/%s -s '%s' %s -o '%s' -q", model, st, method, c);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    free(out), free(err);
    const int bits[] = {8, 4, 3, 2};
    for (size_t i = 0; i < sizeof bits / sizeof bits[0]; i++) {
        snprintf(args, sizeof args,
                 "verify -m data/%s --compressed '%s' --kv-bits %d --text '%s' --device cuda --cache f16 "
                 "--max-windows 2 --threads 1 --json",
                 model, c, bits[i], t);
        check_device_json(args, "ppl", "cuda", "f16", 1e-3, 1);
    }
    unlink(st);
    free(st);
    kvt_rm_dir(c); /* frees c */
    kvt_rm_dir(dir);
    free(t);
}
Test(cli, verify_device_cuda_every_width_prerope, .timeout = 300) {
    device_every_width("kjv-llama", "--method svd --ratio 0.5");
}
Test(cli, verify_device_cuda_every_width_grouped_prerope, .timeout = 300) {
    device_every_width("kjv-llama", "--method palu --group-size 2 --ratio 0.5");
}
Test(cli, verify_device_cuda_every_width_postrope, .timeout = 300) {
    device_every_width("kjv-llama", "--method fdc --ratio 0.5");
}
Test(cli, verify_device_cuda_every_width_fused_query, .timeout = 300) {
    device_every_width("kjv-gpt2", "--method palu --ratio 0.5");
}

/* A device ppl off by more than --device-tol is exit 3, numbers printed. */
Test(cli, verify_device_beyond_its_tolerance_exits_3, .timeout = 60) {
    char *dir = kvt_temp_dir(), *t = device_text(dir);
    char args[8192], *out, *err;
    snprintf(args, sizeof args,
             "verify -m data/kjv-llama --text '%s' --device twin --cache f16 --device-tol 0 "
             "--max-windows 2 --threads 1 -q", t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 3, "%s", err);
    cr_assert(strstr(out, "\ndevice ppl  "), "%s", out);
    cr_assert(strncmp(err, "kvcal: device ppl ", 18) == 0 &&
                  strstr(err, ", more than --device-tol 0\n"),
              "%s", err);
    free(out), free(err);
    kvt_rm_dir(dir);
    free(t);
}

Test(cli, verify_device_options_are_usage_errors) {
    const char *usage = "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options] "
                        "(see 'kvcal verify --help')\n";
    const struct {
        const char *args, *msg;
    } rows[] = {
        {"--device bogus", "--device 'bogus' is not one of cpu, twin, cuda"},
        {"--cache f16", "--cache needs --device twin or cuda"},
        {"--device cpu --cache f32", "--cache needs --device twin or cuda"},
        {"--device twin --cache f8", "--cache 'f8' is not one of f16, f32"},
        {"--device-tol 1e-2", "--device-tol needs --device twin or cuda"},
        {"--device twin --device-tol -1", "--device-tol must be at least 0, got -1"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        char args[512], want[1024];
        snprintf(args, sizeof args, "verify --model m --text t %s", rows[i].args);
        snprintf(want, sizeof want, "kvcal verify: %s\n%s", rows[i].msg, usage);
        expect_cli(args, 2, want);
    }
}

/* Quantized latents on the twin: verify --kv-bits 8, 4, 3 and 2 reproduces
 * the cpu's quantized run within check_device_json's bounds for them (both
 * caches: every side of svd's layers is latent, so the cache dtype plays no
 * part), and the text names the latents. */
Test(cli, verify_device_twin_runs_quantized_latents, .timeout = 120) {
    char *dir = kvt_temp_dir(), *t = device_text(dir), *c = kvt_path(dir, "c");
    char args[8192], *out, *err;
    snprintf(args, sizeof args, "decompose -m data/kjv-llama --method svd --ratio 0.5 -o '%s' -q",
             c);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    free(out), free(err);
    static const int bits[] = {8, 4, 3, 2};
    for (int i = 0; i < 4; i++)
        for (int f16 = 0; f16 < 2; f16++) {
            snprintf(args, sizeof args,
                     "verify -m data/kjv-llama --compressed '%s' --text '%s' --device twin --cache %s "
                     "--kv-bits %d --max-windows 2 --threads 1 --json",
                     c, t, f16 ? "f16" : "f32", bits[i]);
            check_device_json(args, "ppl", "twin", f16 ? "f16" : "f32", 1e-3, 1);
        }
    snprintf(args, sizeof args,
             "verify -m data/kjv-llama --compressed '%s' --text '%s' --device twin --kv-bits 4 "
             "--max-windows 1 --threads 1 -q",
             c, t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    cr_assert(strstr(out, ", int4 latents") && strstr(out, "\n\ndevice      twin (cpu), f16 cache, ") &&
                  strstr(out, "\ndevice ppl  "),
              "%s", out);
    cr_assert_str_eq(err, "");
    free(out), free(err);
    kvt_rm_dir(c);
    kvt_rm_dir(dir);
    free(t);
}

/* --device cuda where no GPU can run it: exit 1 with the runtime's error. */
Test(cli, verify_device_cuda_without_a_gpu_is_an_error, .timeout = 60) {
    int count = 0;
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kvrt_device_count(&count, &e);
    if (!rc && count > 0)
        cr_skip_test("a cuda device is present; the no-gpu error is not reachable");
    char *dir = kvt_temp_dir(), *t = device_text(dir);
    char args[8192], *out, *err;
    snprintf(args, sizeof args, "verify -m data/kjv-llama --text '%s' --device cuda -q", t);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 1, "%s", err);
    cr_assert(strncmp(err, "kvcal: ", 7) == 0 && strlen(err) > 8 && !strchr(err, '\n')[1], "%s",
              err);
    if (!kvrt_cuda_built()) {
        char want[2048];
        snprintf(want, sizeof want, "kvcal: %s\n", e.msg);
        cr_assert_str_eq(err, want);
    }
    cr_assert_str_eq(out, "");
    free(out), free(err);
    kvt_rm_dir(dir);
    free(t);
}

/* kvcal tokenize and train-tokenizer: their usage errors, word for word, and
 * tokenize's JSON on a fixture (ids a by-hand count can follow: the byte
 * tokenizer gives BOS then one id per byte). */
Test(cli, tokenize_and_train_tokenizer_usage_and_output) {
    const char *tu = "usage: kvcal tokenize (--tokenizer FILE | --model PATH) (TEXT | --text FILE) "
                     "[options] (see 'kvcal tokenize --help')\n";
    char want[1024];
    snprintf(want, sizeof want, "kvcal tokenize: give --tokenizer FILE or --model PATH\n%s", tu);
    expect_cli("tokenize hi", 2, want);
    snprintf(want, sizeof want, "kvcal tokenize: give TEXT or --text FILE\n%s", tu);
    expect_cli("tokenize -m data/kjv-llama", 2, want);
    snprintf(want, sizeof want, "kvcal tokenize: --json and --ids exclude each other\n%s", tu);
    expect_cli("tokenize -m data/kjv-llama --json --ids hi", 2, want);
    expect_cli("tokenize --tokenizer /nonexistent.json hi", 1,
               "kvcal: /nonexistent.json: no such file\n");
    expect_cli("train-tokenizer -t x.txt -o y.json --vocab-size 100", 2,
               "kvcal train-tokenizer: --vocab-size must be 258..1048576, got 100\n"
               "usage: kvcal train-tokenizer --text FILE -o tokenizer.json [--vocab-size N] "
               "(see 'kvcal train-tokenizer --help')\n");
    char *out, *err;
    cr_assert_eq(kvt_run_cli("tokenize -m data/kjv-llama --json 'a<s>'", &out, &err), 0, "%s", err);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "%s: %s", je.text, out);
    json_t *ids = json_object_get(o, "ids");
    cr_assert_eq(json_array_size(ids), 5, "%s", out);
    static const int want_ids[] = {256, 'a', '<', 's', '>'};
    for (int i = 0; i < 5; i++) cr_assert_eq(json_integer_value(json_array_get(ids, i)), want_ids[i]);
    cr_assert_eq(json_integer_value(json_object_get(o, "special_strings")), 1);
    cr_assert(json_is_true(json_object_get(o, "roundtrip")));
    cr_assert_str_eq(json_string_value(json_array_get(json_object_get(o, "pieces"), 1)), "<0x61>");
    json_decref(o);
    free(out), free(err);
}
