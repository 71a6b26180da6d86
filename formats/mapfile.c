#include "mapfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

const char *kv_errtext(int e, char *buf, size_t cap) {
    snprintf(buf, cap, "%s", strerror(e));
    if (buf[0] >= 'A' && buf[0] <= 'Z') buf[0] = (char)(buf[0] - 'A' + 'a');
    return buf;
}

int kv_map_open(const char *path, struct kv_map *m, struct kv_err *err) {
    m->data = NULL;
    m->len = 0;
    char eb[128];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot open: %s", kv_errtext(errno, eb, sizeof eb));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot stat: %s", kv_errtext(e, eb, sizeof eb));
    }
    if (S_ISDIR(st.st_mode)) {
        close(fd);
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "is a directory, expected a file");
    }
    if (st.st_size > 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot map: %s", kv_errtext(e, eb, sizeof eb));
        }
        m->data = p;
        m->len = (uint64_t)st.st_size;
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
