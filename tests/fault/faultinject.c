/* A fault injector for tests/test_faults.c, preloaded into kvcal
 * (LD_PRELOAD): KVCAL_FAULT="OP:N" kills the process with SIGKILL just
 * before the Nth call of OP, "OP+:N" just after it returns. OP is fsync or
 * rename (rename and renameat2 counted together): the steps at which a
 * writer's output becomes durable or visible. Nothing else changes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { OP_FSYNC, OP_RENAME, N_OPS };
static long calls[N_OPS];
static int fault_op = -1, fault_after;
static long fault_n;

__attribute__((constructor)) static void fault_init(void) {
    const char *e = getenv("KVCAL_FAULT");
    if (!e) return;
    char op[16];
    long n;
    if (sscanf(e, "%15[a-z+]:%ld", op, &n) != 2) return;
    size_t k = strlen(op);
    fault_after = k && op[k - 1] == '+';
    if (fault_after) op[k - 1] = 0;
    fault_op = !strcmp(op, "fsync") ? OP_FSYNC : !strcmp(op, "rename") ? OP_RENAME : -1;
    fault_n = n;
}

static void at(int op, int after) {
    if (op == fault_op && calls[op] == fault_n && after == fault_after) kill(getpid(), SIGKILL);
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    calls[OP_FSYNC]++;
    at(OP_FSYNC, 0);
    int r = real(fd);
    at(OP_FSYNC, 1);
    return r;
}

int rename(const char *a, const char *b) {
    static int (*real)(const char *, const char *);
    if (!real) real = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    calls[OP_RENAME]++;
    at(OP_RENAME, 0);
    int r = real(a, b);
    at(OP_RENAME, 1);
    return r;
}

int renameat2(int da, const char *a, int db, const char *b, unsigned flags) {
    static int (*real)(int, const char *, int, const char *, unsigned);
    if (!real) real = (int (*)(int, const char *, int, const char *, unsigned))dlsym(RTLD_NEXT, "renameat2");
    calls[OP_RENAME]++;
    at(OP_RENAME, 0);
    int r = real(da, a, db, b, flags);
    at(OP_RENAME, 1);
    return r;
}
