/* The fault-injection table: each writing command (collect, merge,
 * decompose, export, train) killed with SIGKILL just before or just after
 * each fsync and each rename it makes (tests/fault/faultinject.c, preloaded),
 * over an earlier good output where the command replaces one. After every
 * kill the output is the earlier one or the new one, whole, never a mix or a
 * part; and a rerun succeeds and gives the new one. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#define FAULT_LIB "build/tests/libfault.so"

/* kvcal ARGS (with KVCAL_FAULT=fault unless NULL): its exit status. */
static int run(const char *args, const char *fault) {
    const char *bin = getenv("KVCAL_BIN");
    if (!bin || !*bin) bin = "build/kvcal";
    char cmd[16384];
    if (fault)
        snprintf(cmd, sizeof cmd, "KVCAL_FAULT=%s LD_PRELOAD=%s %s %s >/dev/null 2>&1 </dev/null",
                 fault, FAULT_LIB, bin, args);
    else
        snprintf(cmd, sizeof cmd, "%s %s >/dev/null 2>&1 </dev/null", bin, args);
    int st = system(cmd);
    cr_assert(st != -1, "%s", cmd);
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return WEXITSTATUS(st);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
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
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        cr_assert(d);
        struct dirent *e;
        while ((e = readdir(d)))
            if (e->d_name[0] != '.' && k < 64) names[k++] = strdup(e->d_name);
        closedir(d);
        qsort(names, (size_t)k, sizeof *names, cmp_str);
    } else {
        names[k++] = NULL;
    }
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
};

/* Kill points of one case, until a run with the fault armed finishes (its
 * fault point lies past the command's last call): the first three of each
 * step, then 4, 6, 9, 13, ... (a command makes one fsync per file, and
 * decompose writes a dozen). */
static int run_case(const char *dir, const struct fault_case *c) {
    char oldv[8192] = "", newv[8192], out[4096], old_d[65], new_d[65], got[65], rm[8192];
    snprintf(out, sizeof out, "%s/%s", dir, c->out);
    if (c->old_args) snprintf(oldv, sizeof oldv, c->old_args, dir, dir, dir, dir);
    snprintf(newv, sizeof newv, c->new_args, dir, dir, dir, dir);
    snprintf(rm, sizeof rm, "rm -rf '%s'", out);
    /* the new output, then the earlier one back in place */
    cr_assert_eq(system(rm), 0);
    cr_assert_eq(run(newv, NULL), 0, "%s: kvcal %s", c->name, newv);
    digest(out, new_d);
    if (c->old_args) {
        cr_assert_eq(run(oldv, NULL), 0, "%s: kvcal %s", c->name, oldv);
    } else {
        cr_assert_eq(system(rm), 0);
    }
    digest(out, old_d);
    cr_assert(strcmp(old_d, new_d), "%s: the earlier and the new output are the same", c->name);
    int kills = 0;
    const char *ops[] = {"fsync", "rename", "rename+"};
    for (int o = 0; o < 3; o++)
        for (int n = 1;; n += n < 3 ? 1 : n / 2) {
            char fault[32];
            snprintf(fault, sizeof fault, "%s:%d", ops[o], n);
            int rc = run(newv, fault);
            digest(out, got);
            cr_assert(!strcmp(got, old_d) || !strcmp(got, new_d),
                      "%s killed at %s (exit %d): %s is neither the earlier output nor the new "
                      "one", c->name, fault, rc, out);
            if (rc == 0) {
                cr_assert_str_eq(got, new_d, "%s: a run that finished left no new output", c->name);
            } else {
                cr_assert_eq(rc, 137, "%s at %s: exit %d", c->name, fault, rc);
                kills++;
                /* a rerun succeeds, whatever the kill left behind (a command
                 * that never replaces an output refuses a finished one) */
                if (c->old_args || strcmp(got, new_d)) {
                    cr_assert_eq(run(newv, NULL), 0, "%s: rerun after a kill at %s failed",
                                 c->name, fault);
                    digest(out, got);
                    cr_assert_str_eq(got, new_d, "%s: the rerun after %s gave another output",
                                     c->name, fault);
                }
            }
            /* the earlier output back for the next kill point */
            if (c->old_args)
                cr_assert_eq(run(oldv, NULL), 0, "%s: kvcal %s", c->name, oldv);
            else
                cr_assert_eq(system(rm), 0);
            if (rc == 0) break;
        }
    return kills;
}

/* The inputs every case reads, in a fresh directory. */
static char *prepare(void) {
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
    const char *prep[] = {
        "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 -q -o %s/base.kvstats",
        "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 --shard 0/2 -q -o %s/s0.kvstats",
        "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 --shard 1/2 -q -o %s/s1.kvstats",
        "decompose -m data/kjv-llama -s %s/base.kvstats --method svd --ratio 0.5 -q -o %s/c",
    };
    for (size_t i = 0; i < sizeof prep / sizeof prep[0]; i++) {
        snprintf(args, sizeof args, prep[i], dir, dir);
        cr_assert_eq(run(args, NULL), 0, "kvcal %s", args);
    }
    return dir;
}

static void fault_table_row(const struct fault_case *c) {
    KVT_SKIP_SANITIZED("the fault injector cannot be preloaded ahead of the sanitizer runtime");
    cr_assert_eq(access(FAULT_LIB, R_OK), 0, "%s is missing (make test builds it)", FAULT_LIB);
    char *dir = prepare();
    int kills = run_case(dir, c);
    cr_assert(kills >= 2, "%s: only %d kill points", c->name, kills);
    cr_log_info("%s: %d kill points, each left the earlier or the new output", c->name, kills);
    kvt_rm_dir(dir);
}

Test(faults, collect, .timeout = 300) {
    const struct fault_case c = {
        "collect", "collect -m data/kjv-llama -t %s/t.txt --seq-len 32 -q -o %s/x.kvstats",
        "collect -m data/kjv-llama -t %s/t.txt --seq-len 64 -q -o %s/x.kvstats", "x.kvstats"};
    fault_table_row(&c);
}

Test(faults, merge, .timeout = 300) {
    const struct fault_case c = {"merge", "merge %s/s0.kvstats -o %s/m.kvstats",
                                 "merge %s/s0.kvstats %s/s1.kvstats -o %s/m.kvstats", "m.kvstats"};
    fault_table_row(&c);
}

Test(faults, decompose, .timeout = 300) {
    const struct fault_case c = {
        "decompose",
        "decompose -m data/kjv-llama -s %s/base.kvstats --method svd --ratio 0.5 -q -o %s/d",
        "decompose -m data/kjv-llama -s %s/base.kvstats --method svd --ratio 0.25 -q -o %s/d",
        "d"};
    fault_table_row(&c);
}

Test(faults, export, .timeout = 300) {
    const struct fault_case c = {"export", NULL,
                                 "export --dense %s/c --model data/kjv-llama -o %s/e", "e"};
    fault_table_row(&c);
}

Test(faults, train, .timeout = 300) {
    const struct fault_case c = {
        "train",
        "train --text %s/t.txt -o %s/tr --dim 32 --layers 1 --heads 2 --steps 1 --seq-len 16 "
        "--batch 2 -q",
        "train --text %s/t.txt -o %s/tr --dim 32 --layers 1 --heads 2 --steps 2 --seq-len 16 "
        "--batch 2 -q",
        "tr"};
    fault_table_row(&c);
}
