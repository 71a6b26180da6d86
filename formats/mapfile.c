#include "mapfile.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"

const char *kv_errtext(int e, char *buf, size_t cap) {
    snprintf(buf, cap, "%s", strerror(e));
    if (buf[0] >= 'A' && buf[0] <= 'Z') buf[0] = (char)(buf[0] - 'A' + 'a');
    return buf;
}

int kv_open_regular(const char *path, uint64_t *size, struct kv_err *err) {
    char eb[128];
    /* O_NONBLOCK: opening a FIFO that has no writer must not wait for one */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot open: %s", kv_errtext(errno, eb, sizeof eb));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot stat: %s", kv_errtext(e, eb, sizeof eb));
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        if (S_ISDIR(st.st_mode))
            kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "is a directory, expected a file");
        else
            kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "not a regular file (a pipe, FIFO or device is not read; give a file)");
        return -1;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    if (size) *size = (uint64_t)st.st_size;
    return fd;
}

ssize_t kv_read_head(const char *path, void *buf, size_t cap) {
    int fd = kv_open_regular(path, NULL, NULL);
    if (fd < 0) return -1;
    ssize_t n;
    do n = read(fd, buf, cap);
    while (n < 0 && errno == EINTR);
    close(fd);
    return n;
}

int kv_map_open(const char *path, struct kv_map *m, struct kv_err *err) {
    m->data = NULL;
    m->len = 0;
    char eb[128];
    uint64_t size = 0;
    int fd = kv_open_regular(path, &size, err);
    if (fd < 0) return KV_EIO; /* every failure of kv_open_regular is */
    if (size > 0) {
        void *p = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot map: %s", kv_errtext(e, eb, sizeof eb));
        }
        m->data = p;
        m->len = size;
    }
    close(fd);
    return KV_OK;
}

void kv_map_close(struct kv_map *m) {
    if (!m) return;
    if (m->data) munmap((void *)m->data, (size_t)m->len);
    m->data = NULL;
    m->len = 0;
}

int kv_map_open_heap(const char *path, struct kv_map **out, struct kv_err *err) {
    struct kv_map *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int rc = kv_map_open(path, m, err);
    if (rc) {
        free(m);
        return rc;
    }
    *out = m;
    return KV_OK;
}

void kv_map_free_cb(void *map) {
    kv_map_close(map);
    free(map);
}

int kv_path_kind(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) return -1;
    return S_ISDIR(st.st_mode) ? 1 : 0;
}

char *kv_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *s = malloc(a + b + 2);
    if (!s) return NULL;
    memcpy(s, dir, a);
    size_t n = a;
    if (n && s[n - 1] != '/') s[n++] = '/';
    memcpy(s + n, name, b + 1);
    return s;
}

char *kv_path_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    if (!slash) return strdup(".");
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, path, n);
    d[n] = 0;
    return d;
}

int kv_fsync_dir(const char *dir, const char *path, struct kv_err *err) {
    char eb[128];
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot open directory '%s': %s", dir,
                       kv_errtext(errno, eb, sizeof eb));
    int r, rc = KV_OK;
    while ((r = fsync(fd)) != 0 && errno == EINTR) {}
    /* file systems that cannot sync a directory say EINVAL: nothing to do */
    if (r != 0 && errno != EINVAL && errno != ENOTSUP)
        rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot sync directory '%s': %s", dir,
                     kv_errtext(errno, eb, sizeof eb));
    close(fd);
    return rc;
}

int kv_fsync_parent(const char *path, struct kv_err *err) {
    char *dir = kv_path_dir(path);
    if (!dir) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int rc = kv_fsync_dir(dir, path, err);
    free(dir);
    return rc;
}

int kv_tmp_create(const char *path, int *fd_out, char **tmp_out, struct kv_err *err) {
    static atomic_uint seq;
    char eb[128];
    size_t n = strlen(path) + 40;
    char *tmp = malloc(n);
    *fd_out = -1, *tmp_out = NULL;
    if (!tmp) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    for (int tries = 0; tries < 1000; tries++) {
        snprintf(tmp, n, "%s.tmp-%ld-%u", path, (long)getpid(), atomic_fetch_add(&seq, 1u));
        int fd = open(tmp, O_CREAT | O_EXCL | O_NOFOLLOW | O_WRONLY | O_CLOEXEC, 0644);
        if (fd >= 0) {
            *fd_out = fd, *tmp_out = tmp;
            return KV_OK;
        }
        if (errno != EEXIST) {
            int rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot create '%s': %s", tmp,
                             kv_errtext(errno, eb, sizeof eb));
            free(tmp);
            return rc;
        }
    }
    int rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET,
                     "cannot create a temporary file beside it: 1000 names taken, the last '%s'", tmp);
    free(tmp);
    return rc;
}

int kv_write_atomic(const char *path,
                    int (*fill)(int fd, const char *path, const char *tmp, void *ctx,
                                struct kv_err *err),
                    void *ctx, struct kv_err *err) {
    char eb[128];
    char *tmp;
    int fd, rc = kv_tmp_create(path, &fd, &tmp, err);
    if (rc != KV_OK) return rc;
    rc = fill(fd, path, tmp, ctx, err);
    int e = 0;
    const char *op = NULL;
    if (rc == KV_OK) {
        int r;
        while ((r = fsync(fd)) != 0 && errno == EINTR) {}
        if (r != 0) {
            e = errno;
            op = "cannot sync";
        }
    }
    /* close is not retried on EINTR: on Linux the descriptor is gone anyway */
    if (close(fd) != 0 && rc == KV_OK && !e) {
        e = errno;
        op = "cannot close";
    }
    if (rc == KV_OK && e)
        rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "%s '%s': %s", op, tmp,
                     kv_errtext(e, eb, sizeof eb));
    if (rc == KV_OK && rename(tmp, path) != 0)
        rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot rename '%s' over it: %s", tmp,
                     kv_errtext(errno, eb, sizeof eb));
    if (rc != KV_OK) {
        unlink(tmp);
        free(tmp);
        return rc;
    }
    free(tmp);
    return kv_fsync_parent(path, err);
}

/* Unlink every entry of dir (no subdirectories) and, if rmdir_too, dir. */
int kv_remove_dir_files(const char *dir, int rmdir_too, struct kv_err *err) {
    char eb[128];
    DIR *d = opendir(dir);
    if (!d)
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot open directory: %s",
                       kv_errtext(errno, eb, sizeof eb));
    int rc = KV_OK;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *p = kv_path_join(dir, e->d_name);
        if (!p)
            rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
        else if (unlink(p) != 0)
            rc = kv_fail(err, KV_EIO, p, KV_NO_OFFSET, "cannot remove: %s",
                         kv_errtext(errno, eb, sizeof eb));
        free(p);
    }
    closedir(d);
    if (!rc && rmdir_too && rmdir(dir) != 0)
        rc = kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot remove directory: %s",
                     kv_errtext(errno, eb, sizeof eb));
    return rc;
}

int kv_dir_install(const char *tmp, const char *out, struct kv_err *err) {
    char eb[128];
    int swapped = 0, rc = KV_OK;
    if (kv_path_kind(out) == 1) {
        if (renameat2(AT_FDCWD, tmp, AT_FDCWD, out, RENAME_EXCHANGE) == 0)
            swapped = 1;
        else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP)
            rc = kv_remove_dir_files(out, 0, err); /* the old order: empty it, then rename */
        else
            return kv_fail(err, KV_EIO, out, KV_NO_OFFSET, "cannot exchange '%s' with it: %s", tmp,
                           kv_errtext(errno, eb, sizeof eb));
    }
    if (!rc && !swapped && rename(tmp, out) != 0)
        rc = kv_fail(err, KV_EIO, out, KV_NO_OFFSET, "cannot rename '%s' to it: %s", tmp,
                     kv_errtext(errno, eb, sizeof eb));
    if (rc) return rc;
    char *parent = kv_path_dir(out);
    if (!parent) return kv_fail(err, KV_ENOMEM, out, KV_NO_OFFSET, "out of memory");
    rc = kv_fsync_dir(parent, parent, err);
    free(parent);
    if (!rc && swapped) rc = kv_remove_dir_files(tmp, 1, err); /* the earlier one, now at tmp */
    return rc;
}

