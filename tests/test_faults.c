/* The fault-injection table: each writing command (collect, merge,
 * decompose, export, train), over an earlier good output where the command
 * replaces one, meets
 *   - SIGKILL just before or just after each fsync and each rename it makes;
 *   - a disk that fills at its 1st, 2nd, 3rd, 4th, 6th, ... write;
 *   - file-size limits (ulimit -f) below the largest file it writes;
 *   - a read-only output directory;
 *   - a second writer of the same output at the same time
 * (kills, the full disk and the read-only directory by tests/fault/
 * faultinject.c, preloaded). After a kill the output is the earlier one or
 * the new one, whole, never a mix or a part. A full disk, a size limit or a
 * read-only directory is reported in one line, exit 1, with the earlier
 * output untouched and nothing left beside it. Of two writers each finishes
 * or refuses in one line, and the output is one of theirs, whole. After
 * every row a rerun succeeds and gives the new output. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#define FAULT_LIB "build/tests/libfault.so"

static const char *kvcal_bin(void) {
    const char *bin = getenv("KVCAL_BIN");
    return bin && *bin ? bin : "build/kvcal";
}

/* kvcal ARGS (with KVCAL_FAULT=fault unless NULL): its exit status; its
 * stderr in *err unless err is NULL. */
static int run_err(const char *args, const char *fault, char **err) {
    char cmd[16384], errpath[64] = "/dev/null";
    if (err) snprintf(errpath, sizeof errpath, "/tmp/kvcal-faults-err-%ld", (long)getpid());
    if (fault)
        snprintf(cmd, sizeof cmd, "KVCAL_FAULT='%s' LD_PRELOAD=%s %s %s >/dev/null 2>%s </dev/null",
                 fault, FAULT_LIB, kvcal_bin(), args, errpath);
    else
        snprintf(cmd, sizeof cmd, "%s %s >/dev/null 2>%s </dev/null", kvcal_bin(), args, errpath);
    int st = system(cmd);
    cr_assert(st != -1, "%s", cmd);
    if (err) {
        *err = kvt_read_file(errpath, NULL);
        cr_assert_not_null(*err);
        unlink(errpath);
    }
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return WEXITSTATUS(st);
}

static int run(const char *args, const char *fault) { return run_err(args, fault, NULL); }

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The names in dir (dot files too when hidden), sorted, strdup'd into
 * names (at most cap): their count. */
static int sorted_names(const char *dir, char **names, int cap, int hidden) {
    DIR *d = opendir(dir);
    cr_assert(d, "%s", dir);
    int k = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && (hidden || e->d_name[0] != '.') &&
            k < cap)
            names[k++] = strdup(e->d_name);
    closedir(d);
    qsort(names, (size_t)k, sizeof *names, cmp_str);
    return k;
}

/* sha256 of a file's bytes, or of a directory's sorted names and files'
 * bytes; "absent" when path does not exist. */
static void digest(const char *path, char out[65]) {
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(out, 65, "absent");
        return;
    }
    size_t cap = 1 << 20, n = 0;
    char *all = malloc(cap);
    cr_assert(all);
    char *names[64];
    int k = 0;
    if (S_ISDIR(st.st_mode))
        k = sorted_names(path, names, 64, 0);
    else
        names[k++] = NULL;
    for (int i = 0; i < k; i++) {
        char *p = names[i] ? kvt_path(path, names[i]) : strdup(path);
        size_t len;
        char *b = kvt_read_file(p, &len);
        cr_assert(b, "%s", p);
        size_t need = n + len + (names[i] ? strlen(names[i]) : 0) + 2;
        if (need > cap) all = realloc(all, cap = need * 2);
        if (names[i]) n += (size_t)sprintf(all + n, "%s", names[i]) + 1;
        memcpy(all + n, b, len);
        n += len;
        free(b), free(p), free(names[i]);
    }
    kv_sha256_hex(all, n, out);
    free(all);
}

struct fault_case {
    const char *name;
    const char *old_args; /* makes the earlier output; NULL: there is none */
    const char *new_args; /* the run that is killed */
    const char *out;      /* its output, relative to the case's directory */
    int needs;            /* what it reads besides t.txt: NEED_* */
};

/* One case in a prepared directory: the commands, the output's path and
 * the digests of the earlier and the new output. */
struct setup {
    const struct fault_case *c;
    char oldv[8192], newv[8192], out[4096], old_d[65], new_d[65];
};

/* The earlier output in place again (or none, for a command without one). */
static void restore(const struct setup *u) {
    if (u->c->old_args) {
        cr_assert_eq(run(u->oldv, NULL), 0, "%s: kvcal %s", u->c->name, u->oldv);
    } else {
        char rm[8192];
        snprintf(rm, sizeof rm, "rm -rf '%s'", u->out);
        cr_assert_eq(system(rm), 0);
    }
}

/* Make the new output, note its digest, then put the earlier one in place. */
static void setup_case(const char *dir, const struct fault_case *c, struct setup *u) {
    u->c = c;
    snprintf(u->out, sizeof u->out, "%s/%s", dir, c->out);
    u->oldv[0] = 0;
    if (c->old_args) snprintf(u->oldv, sizeof u->oldv, c->old_args, dir, dir, dir, dir);
    snprintf(u->newv, sizeof u->newv, c->new_args, dir, dir, dir, dir);
    char rm[8192];
    snprintf(rm, sizeof rm, "rm -rf '%s'", u->out);
    cr_assert_eq(system(rm), 0);
    cr_assert_eq(run(u->newv, NULL), 0, "%s: kvcal %s", c->name, u->newv);
    digest(u->out, u->new_d);
    restore(u);
    digest(u->out, u->old_d);
    cr_assert(strcmp(u->old_d, u->new_d), "%s: the earlier and the new output are the same",
              c->name);
}

/* The next kill or fault point after n: the first three, then 4, 6, 9,
 * 13, ... (a command makes one fsync per file, and decompose writes a
 * dozen). */
static int next_point(int n) { return n + (n < 3 ? 1 : n / 2); }

/* Kill points of one case, until a run with the fault armed finishes (its
 * fault point lies past the command's last call). */
static int run_case(const char *dir, const struct fault_case *c) {
    struct setup u;
    setup_case(dir, c, &u);
    char got[65];
    int kills = 0;
    const char *ops[] = {"fsync", "rename", "rename+"};
    for (int o = 0; o < 3; o++)
        for (int n = 1;; n = next_point(n)) {
            char fault[32];
            snprintf(fault, sizeof fault, "%s:%d", ops[o], n);
            int rc = run(u.newv, fault);
            digest(u.out, got);
            cr_assert(!strcmp(got, u.old_d) || !strcmp(got, u.new_d),
                      "%s killed at %s (exit %d): %s is neither the earlier output nor the new "
                      "one", c->name, fault, rc, u.out);
            if (rc == 0) {
                cr_assert_str_eq(got, u.new_d, "%s: a run that finished left no new output",
                                 c->name);
            } else {
                cr_assert_eq(rc, 137, "%s at %s: exit %d", c->name, fault, rc);
                kills++;
                /* a rerun succeeds, whatever the kill left behind (a command
                 * that never replaces an output refuses a finished one) */
                if (c->old_args || strcmp(got, u.new_d)) {
                    cr_assert_eq(run(u.newv, NULL), 0, "%s: rerun after a kill at %s failed",
                                 c->name, fault);
                    digest(u.out, got);
                    cr_assert_str_eq(got, u.new_d, "%s: the rerun after %s gave another output",
                                     c->name, fault);
                }
            }
            restore(&u);
            if (rc == 0) break;
        }
    return kills;
}

/* The names in dir, sorted, one per line. */
static char *listing(const char *dir) {
    char *names[256];
    int k = sorted_names(dir, names, 256, 1);
    size_t cap = 1, n = 0;
    for (int i = 0; i < k; i++) cap += strlen(names[i]) + 1;
    char *all = malloc(cap);
    cr_assert(all);
    all[0] = 0;
    for (int i = 0; i < k; i++) {
        n += (size_t)sprintf(all + n, "%s\n", names[i]);
        free(names[i]);
    }
    return all;
}

/* A run that met a fault it must report (a full disk, a file-size limit, a
 * read-only directory): exit 1 with one line naming the cause, the earlier
 * output untouched, nothing of its own left beside it; then a rerun without
 * the fault gives the new output. */
static void after_refusal(const char *dir, const struct setup *u, const char *what, int rc,
                          const char *err, const char *cause, const char *before) {
    const char *name = u->c->name;
    cr_assert_eq(rc, 1, "%s with %s: exit %d, want 1; stderr:\n%s", name, what, rc, err);
    size_t n = strlen(err);
    cr_assert(!strncmp(err, "kvcal: ", 7) && n && err[n - 1] == '\n' && !strchr(err, '\n')[1],
              "%s with %s: stderr is not one kvcal: line:\n%s", name, what, err);
    cr_assert(strstr(err, cause), "%s with %s: stderr does not say '%s':\n%s", name, what, cause,
              err);
    char got[65];
    digest(u->out, got);
    cr_assert_str_eq(got, u->old_d, "%s with %s: the earlier output changed", name, what);
    char *after = listing(dir);
    cr_assert_str_eq(after, before, "%s with %s: the run left files beside its output", name,
                     what);
    free(after);
    cr_assert_eq(run(u->newv, NULL), 0, "%s: rerun after %s failed", name, what);
    digest(u->out, got);
    cr_assert_str_eq(got, u->new_d, "%s: the rerun after %s gave another output", name, what);
    restore(u);
}

/* The disk fills at write n = 1, 2, 3, 4, 6, 9, ... of the run, until the
 * run needs fewer writes: every run that met it said so and changed
 * nothing. The number of points met. */
static int full_disk(const char *dir, const struct setup *u) {
    char *before = listing(dir), *err, got[65];
    int points = 0;
    for (int n = 1;; n = next_point(n)) {
        char fault[32], what[64];
        snprintf(fault, sizeof fault, "full:%d", n);
        snprintf(what, sizeof what, "the disk full at write %d", n);
        int rc = run_err(u->newv, fault, &err);
        if (rc == 0) {
            digest(u->out, got);
            cr_assert_str_eq(got, u->new_d, "%s: a run that finished left no new output",
                             u->c->name);
            free(err);
            restore(u);
            break;
        }
        after_refusal(dir, u, what, rc, err, ": no space left on device", before);
        free(err);
        points++;
    }
    free(before);
    return points;
}

/* Each file-size limit (ulimit -f) below the largest file the run writes,
 * from 512 bytes up to one byte short of it. The number of limits met. */
static int file_size_limit(const char *dir, const struct setup *u) {
    /* the largest file of the new output: the output itself, or the largest
     * file of the output directory */
    char *before = listing(dir), *err;
    restore(u);
    cr_assert_eq(run(u->newv, NULL), 0);
    off_t largest = 0;
    struct stat st;
    cr_assert_eq(stat(u->out, &st), 0);
    if (S_ISDIR(st.st_mode)) {
        char *names[64];
        int k = sorted_names(u->out, names, 64, 1);
        for (int i = 0; i < k; i++) {
            char *p = kvt_path(u->out, names[i]);
            struct stat fs;
            if (stat(p, &fs) == 0 && S_ISREG(fs.st_mode) && fs.st_size > largest)
                largest = fs.st_size;
            free(p), free(names[i]);
        }
    } else {
        largest = st.st_size;
    }
    restore(u);
    const off_t limits[] = {512, 65536, largest / 2, largest - 1};
    int met = 0;
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        if (limits[i] <= 0 || limits[i] >= largest) continue;
        struct rlimit old, rl;
        cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
        rl.rlim_cur = (rlim_t)limits[i], rl.rlim_max = old.rlim_max;
        cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
        int rc = run_err(u->newv, NULL, &err);
        setrlimit(RLIMIT_FSIZE, &old);
        char what[64];
        snprintf(what, sizeof what, "a file-size limit of %lld bytes", (long long)limits[i]);
        after_refusal(dir, u, what, rc, err, ": file too large", before);
        free(err);
        met++;
    }
    free(before);
    return met;
}

/* The directory of the output read-only: the run says so and changes
 * nothing. */
static void read_only_dir(const char *dir, const struct setup *u) {
    char *before = listing(dir), *err, fault[4200];
    snprintf(fault, sizeof fault, "rofs:%s/", dir);
    int rc = run_err(u->newv, fault, &err);
    after_refusal(dir, u, "a read-only directory", rc, err, ": read-only file system", before);
    free(err), free(before);
}

/* Two writers of one output at once (the earlier and the new run, or the
 * new run twice), three times: each finishes or refuses with one line, the
 * output is one of theirs whole, nothing is left beside it, and a rerun
 * gives the new output. */
static void concurrent(const char *dir, const struct setup *u) {
    char got[65];
    /* what the directory holds after a writer finished */
    if (!u->c->old_args) cr_assert_eq(run(u->newv, NULL), 0);
    char *before = listing(dir);
    const char *first = u->c->old_args ? u->oldv : u->newv;
    for (int round = 0; round < 3; round++) {
        if (!u->c->old_args) {
            char rm[8192];
            snprintf(rm, sizeof rm, "rm -rf '%s'", u->out);
            cr_assert_eq(system(rm), 0);
        }
        char cmd[40000], e1[4200], e2[4200], r1[4200], r2[4200];
        snprintf(e1, sizeof e1, "%s/err1", dir), snprintf(e2, sizeof e2, "%s/err2", dir);
        snprintf(r1, sizeof r1, "%s/rc1", dir), snprintf(r2, sizeof r2, "%s/rc2", dir);
        snprintf(cmd, sizeof cmd,
                 "(%s %s >/dev/null 2>'%s' </dev/null; echo $? >'%s') & "
                 "(%s %s >/dev/null 2>'%s' </dev/null; echo $? >'%s') & wait",
                 kvcal_bin(), first, e1, r1, kvcal_bin(), u->newv, e2, r2);
        cr_assert_eq(system(cmd), 0);
        int ok = 0;
        const char *rcs[] = {r1, r2}, *errs[] = {e1, e2};
        for (int w = 0; w < 2; w++) {
            char *rt = kvt_read_file(rcs[w], NULL), *et = kvt_read_file(errs[w], NULL);
            cr_assert(rt && et);
            int rc = atoi(rt);
            size_t n = strlen(et);
            cr_assert(rc == 0 || (rc == 1 && !strncmp(et, "kvcal: ", 7) && et[n - 1] == '\n' &&
                                  !strchr(et, '\n')[1]),
                      "%s, two writers, round %d: writer %d exit %d, stderr:\n%s", u->c->name,
                      round, w + 1, rc, et);
            if (rc == 1) cr_log_info("%s, two writers: one refused: %s", u->c->name, et);
            ok += rc == 0;
            unlink(rcs[w]), unlink(errs[w]);
            free(rt), free(et);
        }
        cr_assert(ok >= 1, "%s, two writers, round %d: neither finished", u->c->name, round);
        digest(u->out, got);
        cr_assert(!strcmp(got, u->old_d) || !strcmp(got, u->new_d),
                  "%s, two writers, round %d: the output is neither writer's", u->c->name, round);
        char *after = listing(dir);
        cr_assert_str_eq(after, before, "%s, two writers: files were left beside the output",
                         u->c->name);
        free(after);
    }
    if (!u->c->old_args) restore(u); /* export never replaces an output */
    cr_assert_eq(run(u->newv, NULL), 0, "%s: rerun after two writers failed", u->c->name);
    digest(u->out, got);
    cr_assert_str_eq(got, u->new_d, "%s: the rerun after two writers gave another output",
                     u->c->name);
    restore(u);
    free(before);
}

/* What a case reads besides t.txt. */
enum { NEED_STATS = 1, NEED_SHARDS = 2, NEED_COMPRESSED = 4 };

/* The inputs a case reads (needs: NEED_*), in a fresh directory. */
static char *prepare(int needs) {
    char *dir = kvt_temp_dir();
    char *t = kvt_path(dir, "t.txt");
    FILE *f = fopen(t, "w");
    cr_assert(f);
    for (int i = 0; i < 12; i++)
        fputs("In the beginning God created the heaven and the earth. And the earth was without "
              "form, and void; and darkness was upon the face of the deep.\n", f);
    fclose(f);
    free(t);
    char args[8192];
    const struct {
        int need;
        const char *args;
    } prep[] = {
        {NEED_STATS | NEED_COMPRESSED, "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 "
                                       "--samples 8 --threads 1 -q -o %s/base.kvstats"},
        {NEED_SHARDS, "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 --samples 8 "
                      "--shard 0/2 --threads 1 -q -o %s/s0.kvstats"},
        {NEED_SHARDS, "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 --samples 8 "
                      "--shard 1/2 --threads 1 -q -o %s/s1.kvstats"},
        {NEED_COMPRESSED, "decompose -m data/kjv-llama -s %s/base.kvstats --method svd "
                          "--ratio 0.5 --threads 1 -q -o %s/c"},
    };
    for (size_t i = 0; i < sizeof prep / sizeof prep[0]; i++) {
        if (!(needs & prep[i].need)) continue;
        snprintf(args, sizeof args, prep[i].args, dir, dir);
        cr_assert_eq(run(args, NULL), 0, "kvcal %s", args);
    }
    return dir;
}

enum fault_kind { KILLS, FULL_DISK, FILE_SIZE, READ_ONLY, TWO_WRITERS };

static void fault_table_row(const struct fault_case *c, enum fault_kind kind) {
    KVT_SKIP_SANITIZED("the fault injector cannot be preloaded ahead of the sanitizer runtime");
    cr_assert_eq(access(FAULT_LIB, R_OK), 0, "%s is missing (make test builds it)", FAULT_LIB);
    char *dir = prepare(c->needs);
    struct setup u;
    int n;
    switch (kind) {
    case KILLS:
        n = run_case(dir, c);
        cr_assert(n >= 2, "%s: only %d kill points", c->name, n);
        cr_log_info("%s: %d kill points, each left the earlier or the new output", c->name, n);
        break;
    case FULL_DISK:
        setup_case(dir, c, &u);
        n = full_disk(dir, &u);
        cr_assert(n >= 2, "%s: the disk filled at only %d points", c->name, n);
        cr_log_info("%s: the disk full at %d points, each reported", c->name, n);
        break;
    case FILE_SIZE:
        setup_case(dir, c, &u);
        n = file_size_limit(dir, &u);
        cr_assert(n >= 2, "%s: only %d file-size limits below its largest file", c->name, n);
        break;
    case READ_ONLY:
        setup_case(dir, c, &u);
        read_only_dir(dir, &u);
        break;
    case TWO_WRITERS:
        setup_case(dir, c, &u);
        concurrent(dir, &u);
        break;
    }
    kvt_rm_dir(dir);
}

static const struct fault_case collect_case = {
    "collect",
    "collect -m data/kjv-llama -t %s/t.txt --seq-len 32 --samples 8 --threads 1 -q -o %s/x.kvstats",
    "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 --samples 8 --threads 1 -q -o %s/x.kvstats",
    "x.kvstats", 0};
static const struct fault_case merge_case = {
    "merge", "merge %s/s0.kvstats -o %s/m.kvstats",
    "merge %s/s0.kvstats %s/s1.kvstats -o %s/m.kvstats", "m.kvstats", NEED_SHARDS};
static const struct fault_case decompose_case = {
    "decompose",
    "decompose -m data/kjv-llama -s %s/base.kvstats --method svd --ratio 0.5 --threads 1 -q "
    "-o %s/d",
    "decompose -m data/kjv-llama -s %s/base.kvstats --method svd --ratio 0.25 --threads 1 -q "
    "-o %s/d",
    "d",
    NEED_STATS};
static const struct fault_case export_case = {
    "export", NULL, "export --dense %s/c --model data/kjv-llama -o %s/e", "e", NEED_COMPRESSED};
static const struct fault_case train_case = {
    "train",
    "train --text %s/t.txt -o %s/tr --dim 32 --layers 1 --heads 2 --steps 1 --seq-len 16 "
    "--batch 2 --threads 1 -q",
    "train --text %s/t.txt -o %s/tr --dim 32 --layers 1 --heads 2 --steps 2 --seq-len 16 "
    "--batch 2 --threads 1 -q",
    "tr", 0};

/* One test per command and fault: kills (the name of the command alone),
 * a full disk, a file-size limit, a read-only directory, two writers. */
#define FAULT_ROWS(cmd)                                                                          \
    Test(faults, cmd, .timeout = 300) { fault_table_row(&cmd##_case, KILLS); }                   \
    Test(faults, cmd##_full_disk, .timeout = 300) { fault_table_row(&cmd##_case, FULL_DISK); }   \
    Test(faults, cmd##_file_size_limit, .timeout = 300) {                                        \
        fault_table_row(&cmd##_case, FILE_SIZE);                                                 \
    }                                                                                            \
    Test(faults, cmd##_read_only, .timeout = 300) { fault_table_row(&cmd##_case, READ_ONLY); }   \
    Test(faults, cmd##_two_writers, .timeout = 300) { fault_table_row(&cmd##_case, TWO_WRITERS); }

FAULT_ROWS(collect)
FAULT_ROWS(merge)
FAULT_ROWS(decompose)
FAULT_ROWS(export)
FAULT_ROWS(train)
