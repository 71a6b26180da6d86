/* `mpirun -n N kvcal collect` (the MPI build, build/mpi/kvcal): the file
 * equals, byte for byte, collect --shard I/N of every I then merge, for
 * N = 2 and 3; a rank that fails says so in one line naming its rank and
 * no output is left; --shard is refused under mpirun. Runs mpirun
 * --oversubscribe on this machine (--allow-run-as-root for CI); skips
 * without mpirun or the MPI build. */
#include <criterion/criterion.h>
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
    size_t la = 0, lb = 0;
    char *a = kvt_read_file(merged, &la), *b = kvt_read_file(viampi, &lb);
    cr_assert(a && b && la == lb, "sizes: merge %zu, mpirun %zu", la, lb);
    size_t at = 0;
    while (at < la && a[at] == b[at]) at++;
    cr_assert_eq(at, la, "mpirun -n %d differs from shards then merge at byte %zu of %zu", n, at, la);
    cr_log_info("mpirun -n %d: %zu bytes, equal to --shard I/%d then merge", n, la, n);
    /* nothing of the ranks' own is left beside the output */
    for (int r = 0; r < n; r++) {
        char p[1200];
        snprintf(p, sizeof p, "%s.rank%dof%d", viampi, r, n);
        cr_assert(access(p, F_OK) != 0, "%s was left behind", p);
        snprintf(p, sizeof p, "%s.rank%dof%d.recv", viampi, r, n);
        cr_assert(access(p, F_OK) != 0, "%s was left behind", p);
    }
    free(a), free(b), free(merged), free(viampi);
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
