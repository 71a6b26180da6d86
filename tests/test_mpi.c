/* `mpirun -n N kvcal collect` (the MPI build, build/mpi/kvcal): the file
 * equals, byte for byte, collect --shard I/N of every I then merge, for
 * N = 2 and 3; a rank that fails says so in one line naming its rank and
 * no output is left; a killed rank is named once, and --resume finishes
 * the job; --shard is refused under mpirun. `mpirun kvcal verify` gives
 * the numbers of one process to the last bit; --device is refused. Runs mpirun
 * --oversubscribe on this machine (--allow-run-as-root for CI); skips
 * without mpirun or the MPI build. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#define MODEL "data/kjv-llama"
#define TEXT "data/kjv/gospels.txt"
#define ARGS "-m " MODEL " -t " TEXT " --seq-len 64 --samples 12 --seed 3 --threads 1 -q"

static const char *mpi_bin(void) {
    const char *b = getenv("KVCAL_MPI_BIN");
    return b && *b ? b : "build/mpi/kvcal";
}

static void need_mpi(void) {
    if (system("command -v mpirun >/dev/null 2>&1") != 0)
        cr_skip_test("mpirun is not installed (make deps installs openmpi-bin)");
    if (access(mpi_bin(), X_OK) != 0)
        cr_skip_test("%s is not built (make builds it where mpicc is found)", mpi_bin());
}

/* mpirun -n n of the MPI build with args; its exit status, stdout and
 * stderr (caller frees). A time limit keeps a hung job from hanging the
 * suite. */
static int run_mpi(int n, const char *args, char **out, char **err) {
    char *dir = kvt_temp_dir(), cmd[8192];
    snprintf(cmd, sizeof cmd,
             "timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none -n %d %s %s "
             ">%s/out 2>%s/err </dev/null",
             n, mpi_bin(), args, dir, dir);
    int st = system(cmd);
    char p[1024];
    snprintf(p, sizeof p, "%s/out", dir);
    *out = kvt_read_file(p, NULL);
    unlink(p);
    snprintf(p, sizeof p, "%s/err", dir);
    *err = kvt_read_file(p, NULL);
    unlink(p);
    rmdir(dir);
    free(dir);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* Files want (named wname) and got (gname) hold the same bytes; their length. */
static size_t same_bytes(const char *want, const char *got, const char *wname, const char *gname) {
    size_t la = 0, lb = 0;
    char *a = kvt_read_file(want, &la), *b = kvt_read_file(got, &lb);
    cr_assert(a && b && la == lb, "sizes: %s %zu, %s %zu", wname, la, gname, lb);
    size_t at = 0;
    while (at < la && a[at] == b[at]) at++;
    cr_assert_eq(at, la, "%s differs from %s at byte %zu of %zu", gname, wname, at, la);
    free(a), free(b);
    return la;
}

static void same_as_shards_then_merge(int n) {
    need_mpi();
    char *dir = kvt_temp_dir(), args[8192], shards[4096] = "", *o, *e;
    for (int i = 0; i < n; i++) {
        char *p = kvt_path(dir, "s.kvstats"), part[1100];
        snprintf(part, sizeof part, "%s.%d", p, i);
        snprintf(args, sizeof args, "collect " ARGS " --shard %d/%d -o '%s'", i, n, part);
        int rc = kvt_run_cli(args, NULL, &e);
        cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, e);
        free(e);
        snprintf(shards + strlen(shards), sizeof shards - strlen(shards), " '%s'", part);
        free(p);
    }
    char *merged = kvt_path(dir, "merged.kvstats"), *viampi = kvt_path(dir, "mpi.kvstats");
    snprintf(args, sizeof args, "merge%s -o '%s'", shards, merged);
    int rc = kvt_run_cli(args, NULL, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, e);
    free(e);
    snprintf(args, sizeof args, "collect " ARGS " -o '%s'", viampi);
    rc = run_mpi(n, args, &o, &e);
    cr_assert_eq(rc, 0, "mpirun -n %d kvcal %s: exit %d\n%s", n, args, rc, e);
    char want[64];
    snprintf(want, sizeof want, "merged    %d ranks", n);
    cr_assert(o && strstr(o, want), "stdout: %s", o);
    free(o), free(e);
    size_t len = same_bytes(merged, viampi, "shards then merge", "mpirun");
    cr_log_info("mpirun -n %d: %zu bytes, equal to --shard I/%d then merge", n, len, n);
    /* nothing of the ranks' own is left beside the output */
    for (int r = 0; r < n; r++) {
        char p[1200];
        snprintf(p, sizeof p, "%s.rank%dof%d", viampi, r, n);
        cr_assert(access(p, F_OK) != 0, "%s was left behind", p);
        snprintf(p, sizeof p, "%s.rank%dof%d.recv", viampi, r, n);
        cr_assert(access(p, F_OK) != 0, "%s was left behind", p);
    }
    free(merged), free(viampi);
    kvt_rm_dir(dir);
}

Test(mpi, collect_of_two_ranks_is_shards_then_merge, .timeout = 600) { same_as_shards_then_merge(2); }
Test(mpi, collect_of_three_ranks_is_shards_then_merge, .timeout = 600) { same_as_shards_then_merge(3); }

/* Rank 1 cannot write its shard (a directory has its name): one line from
 * rank 1, exit 1, and no output file. */
Test(mpi, a_failing_rank_names_itself_and_leaves_no_output, .timeout = 600) {
    need_mpi();
    char *dir = kvt_temp_dir(), *out = kvt_path(dir, "x.kvstats"), blocker[1200], args[4096], *o, *e;
    snprintf(blocker, sizeof blocker, "%s.rank1of2", out);
    cr_assert_eq(mkdir(blocker, 0755), 0);
    snprintf(args, sizeof args, "collect " ARGS " -o '%s'", out);
    int rc = run_mpi(2, args, &o, &e);
    cr_assert_eq(rc, 1, "exit %d\n%s", rc, e);
    char want[1400];
    snprintf(want, sizeof want, "kvcal: rank 1 of 2: %s: ", blocker);
    cr_assert(e && strstr(e, want), "stderr lacks '%s':\n%s", want, e);
    int lines = 0;
    for (const char *p = e; (p = strstr(p, "kvcal: ")); p++) lines++;
    cr_assert_eq(lines, 1, "one message, not %d:\n%s", lines, e);
    cr_assert(access(out, F_OK) != 0, "%s was written", out);
    free(o), free(e), free(out);
    kvt_rm_dir(dir);
}

/* OUT itself is checked before any rank starts. */
Test(mpi, a_bad_output_is_refused_before_the_work, .timeout = 600) {
    need_mpi();
    char *dir = kvt_temp_dir(), *out = kvt_path(dir, "d.kvstats"), args[4096], *o, *e;
    cr_assert_eq(mkdir(out, 0755), 0);
    snprintf(args, sizeof args, "collect " ARGS " -o '%s'", out);
    int rc = run_mpi(2, args, &o, &e);
    cr_assert_eq(rc, 1, "exit %d\n%s", rc, e);
    char want[1400];
    snprintf(want, sizeof want, "kvcal: rank 0 of 2: %s: is a directory; --output names the statistics file\n",
             out);
    cr_assert(e && strstr(e, want), "stderr lacks '%s':\n%s", want, e);
    char p[1200];
    snprintf(p, sizeof p, "%s.rank1of2", out);
    cr_assert(access(p, F_OK) != 0, "rank 1 started: %s exists", p);
    free(o), free(e), free(out);
    kvt_rm_dir(dir);
}

Test(mpi, shard_is_refused_under_mpirun, .timeout = 600) {
    need_mpi();
    char *dir = kvt_temp_dir(), *out = kvt_path(dir, "x.kvstats"), args[4096], *o, *e;
    snprintf(args, sizeof args, "collect " ARGS " --shard 0/2 -o '%s'", out);
    int rc = run_mpi(2, args, &o, &e);
    cr_assert_eq(rc, 2, "exit %d\n%s", rc, e);
    cr_assert(e && strstr(e, "--shard splits the plan by hand; under mpirun each rank takes its own "
                             "share already"),
              "%s", e);
    cr_assert(access(out, F_OK) != 0);
    free(o), free(e), free(out);
    kvt_rm_dir(dir);
}

/* ---------------------------------------------------------------- verify */

#define VERIFY_ARGS "-m " MODEL " -t " TEXT " --seq-len 64 --max-windows 23 --json"

/* The verify JSON of text o without what depends on the run, not the
 * numbers: timing, memory, threads and the ranks, sorted and printed with
 * every digit. */
static char *numbers_of(const char *o) {
    json_error_t je;
    json_t *j = json_loads(o ? o : "", 0, &je);
    cr_assert(j, "not JSON (%s): %s", je.text, o);
    static const char *const runtime[] = {"tokens_per_s", "base_tokens_per_s", "seconds",
                                          "peak_rss_mib", "threads", "ranks"};
    for (size_t i = 0; i < sizeof runtime / sizeof runtime[0]; i++) json_object_del(j, runtime[i]);
    char *s = json_dumps(j, JSON_SORT_KEYS | JSON_INDENT(1) | JSON_REAL_PRECISION(17));
    json_decref(j);
    return s;
}

/* verify under mpirun -n n equals one process with 2 threads, every
 * number to the last bit; extra are verify's further arguments. */
static void verify_same(int n, const char *extra) {
    char args[8192], *o1, *e1, *on, *en;
    snprintf(args, sizeof args, "verify " VERIFY_ARGS " --threads 2 %s", extra);
    int rc = kvt_run_cli(args, &o1, &e1);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, e1);
    snprintf(args, sizeof args, "verify " VERIFY_ARGS " --threads 1 %s", extra);
    rc = run_mpi(n, args, &on, &en);
    cr_assert_eq(rc, 0, "mpirun -n %d kvcal %s: exit %d\n%s", n, args, rc, en);
    char *a = numbers_of(o1), *b = numbers_of(on);
    size_t at = 0;
    while (a[at] && a[at] == b[at]) at++;
    cr_assert(!a[at] && !b[at], "mpirun -n %d differs from one process at byte %zu:\n%s\n---\n%s", n,
              at, a, b);
    json_t *j = json_loads(on, 0, NULL);
    cr_assert_eq(json_integer_value(json_object_get(j, "ranks")), n, "%s", on);
    json_decref(j);
    cr_log_info("mpirun -n %d verify %s: the same %zu bytes of numbers as one process", n, extra, strlen(a));
    free(a), free(b), free(o1), free(e1), free(on), free(en);
}

Test(mpi, verify_of_two_ranks_is_one_process, .timeout = 600) {
    need_mpi();
    verify_same(2, "");
}

Test(mpi, compressed_verify_of_three_ranks_is_one_process, .timeout = 600) {
    need_mpi();
    char *dir = kvt_temp_dir(), *st = kvt_path(dir, "s.kvstats"), *comp = kvt_path(dir, "c"), args[8192], *e;
    snprintf(args, sizeof args, "collect " ARGS " -o '%s'", st);
    int rc = kvt_run_cli(args, NULL, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, e);
    free(e);
    snprintf(args, sizeof args, "decompose -m " MODEL " -s '%s' --eps 0.9 -o '%s' -q", st, comp);
    rc = kvt_run_cli(args, NULL, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, e);
    free(e);
    snprintf(args, sizeof args, "--compressed '%s'", comp);
    verify_same(3, args);
    snprintf(args, sizeof args, "--compressed '%s' --kv-bits 4", comp);
    verify_same(2, args);
    free(st), free(comp);
    kvt_rm_dir(dir);
}

/* mpirun -n 2 of args exits 2 with want on stderr, said once (by rank 0). */
static void refused_once(const char *args, const char *want) {
    char *o, *e;
    int rc = run_mpi(2, args, &o, &e);
    cr_assert_eq(rc, 2, "exit %d\n%s", rc, e);
    cr_assert(e && strstr(e, want), "stderr lacks '%s':\n%s", want, e);
    cr_assert(!strstr(strstr(e, want) + 1, want), "said twice:\n%s", e);
    free(o), free(e);
}

Test(mpi, device_is_refused_under_mpirun, .timeout = 600) {
    need_mpi();
    refused_once("verify " VERIFY_ARGS " --device twin",
                 "kvcal verify: --device runs in one process; under mpirun verify spreads the "
                 "cpu's windows over the ranks (run --device without mpirun)\n");
}

/* A model that is not there: said once (rank 0 opens the inputs first). */
Test(mpi, a_bad_input_is_said_once, .timeout = 600) {
    need_mpi();
    char *o, *e;
    int rc = run_mpi(3, "verify -m no/such/model -t " TEXT " --json", &o, &e);
    cr_assert_eq(rc, 1, "exit %d\n%s", rc, e);
    int lines = 0;
    for (const char *p = e; (p = strstr(p, "kvcal: ")); p++) lines++;
    cr_assert_eq(lines, 1, "one message, not %d:\n%s", lines, e);
    cr_assert(strstr(e, "kvcal: rank 0 of 3: no/such/model"), "%s", e);
    free(o), free(e);
}

/* ---------------------------------------------------------------- a killed rank */

/* The process id of rank `rank` of a running mpirun job of the MPI build
 * (found by its environment), or -1. */
static pid_t find_rank(int rank) {
    char want[64], cmd[256];
    snprintf(want, sizeof want, "OMPI_COMM_WORLD_RANK=%d", rank);
    snprintf(cmd, sizeof cmd, "pgrep -f '%s collect'", mpi_bin());
    FILE *p = popen(cmd, "r");
    pid_t found = -1;
    long pid;
    while (p && found < 0 && fscanf(p, "%ld", &pid) == 1) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%ld/environ", pid);
        size_t len = 0;
        char *env = kvt_read_file(path, &len);
        for (size_t at = 0; env && at < len; at += strlen(env + at) + 1)
            if (!strcmp(env + at, want)) found = (pid_t)pid;
        free(env);
    }
    if (p) pclose(p);
    return found;
}

/* mpirun stops the job when rank 1 is killed: one line names rank 1, OUT
 * is not written, rank 0 keeps its checkpoint, and --resume then finishes
 * with the bytes of a run never stopped. */
Test(mpi, a_killed_rank_is_named_once_and_resume_finishes, .timeout = 600) {
    need_mpi();
    char *dir = kvt_temp_dir(), *out = kvt_path(dir, "k.kvstats"), *fresh = kvt_path(dir, "f.kvstats");
    char cmd[8192], args[4096], *o, *e;
#define LONG_ARGS "-m " MODEL " -t " TEXT " --seq-len 128 --samples 1200 --seed 5 --threads 1 -q"
    snprintf(cmd, sizeof cmd,
             "timeout 300 mpirun -q --allow-run-as-root --oversubscribe --bind-to none -n 2 %s collect "
             LONG_ARGS " --checkpoint-every 20 -o '%s' >%s/out 2>%s/err </dev/null; echo $? >%s/rc",
             mpi_bin(), out, dir, dir, dir);
    FILE *job = popen(cmd, "r"); /* runs it in the background */
    cr_assert(job);
    /* into the windows: rank 0's first checkpoint is there */
    char ck[1200];
    snprintf(ck, sizeof ck, "%s.rank0of2", out);
    for (int i = 0; i < 6000 && access(ck, F_OK) != 0; i++) usleep(10000);
    pid_t victim = find_rank(1);
    cr_assert(victim > 0, "rank 1 is not running");
    cr_assert_eq(kill(victim, SIGKILL), 0);
    pclose(job);
    char p[1200];
    snprintf(p, sizeof p, "%s/rc", dir);
    char *rc_text = kvt_read_file(p, NULL);
    snprintf(p, sizeof p, "%s/err", dir);
    e = kvt_read_file(p, NULL);
    cr_assert(rc_text && atoi(rc_text) != 0, "the job did not fail: %s\n%s", rc_text, e);
    char want[1400];
    snprintf(want, sizeof want,
             "kvcal: rank 1 of 2: ended before finishing (killed or crashed); %s was not written, "
             "and each other rank's checkpoint is kept for --resume\n", out);
    cr_assert(e && strstr(e, want), "stderr lacks '%s':\n%s", want, e);
    int lines = 0;
    for (const char *q = e; (q = strstr(q, "kvcal: ")); q++) lines++;
    cr_assert_eq(lines, 1, "one message, not %d:\n%s", lines, e);
    cr_assert(access(out, F_OK) != 0, "%s was written", out);
    free(rc_text), free(e);
    /* the same command with --resume: rank 0 from its checkpoint, rank 1 anew */
    snprintf(args, sizeof args, "collect " LONG_ARGS " --checkpoint-every 20 --resume -o '%s'", out);
    int rc = run_mpi(2, args, &o, &e);
    cr_assert_eq(rc, 0, "resume: exit %d\n%s", rc, e);
    free(o), free(e);
    snprintf(args, sizeof args, "collect " LONG_ARGS " --checkpoint-every 20 -o '%s'", fresh);
    rc = run_mpi(2, args, &o, &e);
    cr_assert_eq(rc, 0, "fresh: exit %d\n%s", rc, e);
    free(o), free(e);
    same_bytes(fresh, out, "a fresh run", "the resumed run");
    free(out), free(fresh);
    kvt_rm_dir(dir);
}

/* decompose (and every command but collect and verify) runs in one
 * process: under mpirun it is refused once, before any work. */
Test(mpi, other_commands_are_refused_under_mpirun, .timeout = 600) {
    need_mpi();
    refused_once("decompose -m " MODEL " -s none.kvstats --eps 0.9 -o none",
                 "kvcal: decompose runs in one process; under mpirun only collect and verify "
                 "spread their work (run 'kvcal decompose' without mpirun)\n");
    cr_assert(access("none", F_OK) != 0);
}
