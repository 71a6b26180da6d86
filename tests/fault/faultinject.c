/* A fault injector for tests/test_faults.c, preloaded into kvcal
 * (LD_PRELOAD). KVCAL_FAULT says which fault:
 *
 *   "OP:N"    kill the process with SIGKILL just before the Nth call of OP;
 *   "OP+:N"   just after it returns. OP is fsync or rename (rename and
 *             renameat2 counted together): the steps at which a writer's
 *             output becomes durable or visible.
 *   "full:N"  the disk fills at the Nth write to a regular file (write and
 *             pwrite counted together): that call writes half of its bytes
 *             (all of a single byte's call fails) and every later write and
 *             fsync fails with ENOSPC, as on a real full disk.
 *   "rofs:D"  every path that starts with D is on a read-only file system:
 *             opening it to create or write, mkdir, rename, unlink and rmdir
 *             fail with EROFS (reading works).
 *
 * Nothing else changes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { OP_FSYNC, OP_RENAME, OP_WRITE, N_OPS };
static long calls[N_OPS];
static int fault_op = -1, fault_after, disk_full_at_write, disk_full;
static long fault_n;
static const char *ro_prefix;

__attribute__((constructor)) static void fault_init(void) {
    const char *e = getenv("KVCAL_FAULT");
    if (!e) return;
    if (!strncmp(e, "rofs:", 5) && e[5]) {
        ro_prefix = e + 5;
        return;
    }
    char op[16];
    long n;
    if (sscanf(e, "%15[a-z+]:%ld", op, &n) != 2) return;
    if (!strcmp(op, "full")) {
        disk_full_at_write = 1, fault_n = n;
        return;
    }
    size_t k = strlen(op);
    fault_after = k && op[k - 1] == '+';
    if (fault_after) op[k - 1] = 0;
    fault_op = !strcmp(op, "fsync") ? OP_FSYNC : !strcmp(op, "rename") ? OP_RENAME : -1;
    fault_n = n;
}

static void at(int op, int after) {
    if (op == fault_op && calls[op] == fault_n && after == fault_after) kill(getpid(), SIGKILL);
}

static int read_only(const char *path) {
    return ro_prefix && path && !strncmp(path, ro_prefix, strlen(ro_prefix));
}

static int fail(int e) {
    errno = e;
    return -1;
}

/* real: the next definition of fn (libc's). */
#define REAL(fn)                  \
    static __typeof__(fn) *real;  \
    if (!real) real = (__typeof__(fn) *)dlsym(RTLD_NEXT, #fn)

int fsync(int fd) {
    REAL(fsync);
    calls[OP_FSYNC]++;
    at(OP_FSYNC, 0);
    if (disk_full) return fail(ENOSPC);
    int r = real(fd);
    at(OP_FSYNC, 1);
    return r;
}

int rename(const char *a, const char *b) {
    REAL(rename);
    calls[OP_RENAME]++;
    at(OP_RENAME, 0);
    if (read_only(a) || read_only(b)) return fail(EROFS);
    int r = real(a, b);
    at(OP_RENAME, 1);
    return r;
}

int renameat2(int da, const char *a, int db, const char *b, unsigned flags) {
    REAL(renameat2);
    calls[OP_RENAME]++;
    at(OP_RENAME, 0);
    if (read_only(a) || read_only(b)) return fail(EROFS);
    int r = real(da, a, db, b, flags);
    at(OP_RENAME, 1);
    return r;
}

/* How many of n bytes a write to fd may put on the disk: n, a part, or
 * -1 once it is full. */
static ssize_t room(int fd, size_t n) {
    if (!disk_full_at_write) return (ssize_t)n;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return (ssize_t)n;
    if (disk_full) return -1;
    if (++calls[OP_WRITE] < fault_n) return (ssize_t)n;
    disk_full = 1;
    return n > 1 ? (ssize_t)(n / 2) : -1;
}

ssize_t write(int fd, const void *p, size_t n) {
    REAL(write);
    ssize_t k = room(fd, n);
    if (k < 0) return fail(ENOSPC);
    return real(fd, p, (size_t)k);
}

ssize_t pwrite(int fd, const void *p, size_t n, off_t off) {
    REAL(pwrite);
    ssize_t k = room(fd, n);
    if (k < 0) return fail(ENOSPC);
    return real(fd, p, (size_t)k, off);
}

ssize_t pwrite64(int fd, const void *p, size_t n, off64_t off) {
    REAL(pwrite64);
    ssize_t k = room(fd, n);
    if (k < 0) return fail(ENOSPC);
    return real(fd, p, (size_t)k, off);
}

/* open and its kin: refused on a read-only path when they would create or
 * write. */
static int writes(int flags) {
    return (flags & O_CREAT) || (flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC);
}

/* mode: open's third argument, present when flags create a file. */
#define MODE_ARG(flags, mode)                                        \
    mode_t mode = 0;                                                 \
    if (((flags) & O_CREAT) || ((flags) & O_TMPFILE) == O_TMPFILE) { \
        va_list ap;                                                  \
        va_start(ap, flags);                                         \
        mode = (mode_t)va_arg(ap, int);                              \
        va_end(ap);                                                  \
    }

#define OPEN_LIKE(name)                                           \
    int name(const char *path, int flags, ...) {                  \
        REAL(name);                                               \
        MODE_ARG(flags, mode);                                    \
        if (read_only(path) && writes(flags)) return fail(EROFS); \
        return real(path, flags, mode);                           \
    }
OPEN_LIKE(open)
OPEN_LIKE(open64)

#define OPENAT_LIKE(name)                                         \
    int name(int dfd, const char *path, int flags, ...) {         \
        REAL(name);                                               \
        MODE_ARG(flags, mode);                                    \
        if (read_only(path) && writes(flags)) return fail(EROFS); \
        return real(dfd, path, flags, mode);                      \
    }
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)

int mkdir(const char *path, mode_t mode) {
    REAL(mkdir);
    if (read_only(path)) return fail(EROFS);
    return real(path, mode);
}

int unlink(const char *path) {
    REAL(unlink);
    if (read_only(path)) return fail(EROFS);
    return real(path);
}

int rmdir(const char *path) {
    REAL(rmdir);
    if (read_only(path)) return fail(EROFS);
    return real(path);
}
