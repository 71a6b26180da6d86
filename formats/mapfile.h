/* Read-only file mappings. Parsers take bytes; *_open functions map a file
 * and hand the bytes to the parser. */
#ifndef KV_MAPFILE_H
#define KV_MAPFILE_H

#include <sys/types.h>

#include "kvformats.h"

struct kv_map {
    const uint8_t *data; /* NULL for an empty file */
    uint64_t len;
};

/* Open path for reading if it is a regular file, without waiting on a
 * FIFO that has no writer: the descriptor, and the size in *size (if not
 * NULL); -1 with KV_EIO naming path ("not a regular file" for a pipe, FIFO
 * or device, which kvcal never reads: they would block or read as empty). */
int kv_open_regular(const char *path, uint64_t *size, struct kv_err *err);
/* Up to cap bytes from the start of the regular file path (a probe: -1 when
 * it is not one or cannot be read, never blocking on a FIFO). */
ssize_t kv_read_head(const char *path, void *buf, size_t cap);

/* Map path read-only (a regular file: kv_open_regular). Errors: KV_EIO
 * naming path and strerror. */
int kv_map_open(const char *path, struct kv_map *m, struct kv_err *err);
void kv_map_close(struct kv_map *m);
/* Heap copy of a kv_map suitable for kv_model_on_close(kv_map_free_cb, ...). */
int kv_map_open_heap(const char *path, struct kv_map **out, struct kv_err *err);
void kv_map_free_cb(void *map);

/* strerror(e) in kvcal's message style (lowercase first letter), in buf. */
const char *kv_errtext(int e, char *buf, size_t cap);

/* 1 if path is a directory, 0 if not, -1 if it does not exist. */
int kv_path_kind(const char *path);

/* The directory holding path, malloc'd ("." when path has no slash, "/"
 * for a file at the root); NULL when out of memory. */
char *kv_path_dir(const char *path);

/* Join dir and name into a malloc'd string. */
char *kv_path_join(const char *dir, const char *name);

/* fsync directory dir (a rename into it becomes durable); errors are KV_EIO
 * naming path. kv_fsync_parent syncs the directory holding path. */
int kv_fsync_dir(const char *dir, const char *path, struct kv_err *err);
int kv_fsync_parent(const char *path, struct kv_err *err);

/* Unlink every entry of dir (no subdirectories) and, if rmdir_too, dir. */
int kv_remove_dir_files(const char *dir, int rmdir_too, struct kv_err *err);

/* Put the complete directory tmp (files only) in place of out, on the same
 * file system: renamed there when out is absent, else exchanged with out
 * in one step (renameat2 RENAME_EXCHANGE), so out is the earlier directory
 * or the new one, whole, at every moment, and the earlier one, now at tmp,
 * is removed after. A file system without the exchange gets the old order:
 * out's files removed, then tmp renamed. The parent directory is synced.
 * The caller has checked that out may be replaced. */
int kv_dir_install(const char *tmp, const char *out, struct kv_err *err);

/* Create a new file beside path to write it through: "path.tmp-PID-N"
 * (mode 0644 less the umask), created exclusively, so an existing file or
 * a symlink planted under that name is neither followed nor truncated, and
 * concurrent writers get names of their own. On KV_OK *fd_out is open for
 * writing and *tmp_out holds the name (the caller frees it). Errors:
 * KV_EIO naming path, KV_ENOMEM. */
int kv_tmp_create(const char *path, int *fd_out, char **tmp_out, struct kv_err *err);

/* Write path atomically, so that it always holds either its old content or
 * all of the new: create a temporary beside it (kv_tmp_create), let fill
 * write the whole content to fd, fsync and close it, rename it over path,
 * then fsync the directory. fill gets path and the temporary's name for
 * its messages and returns KV_OK or a status with err filled (a failed write
 * is KV_EIO naming path: "cannot write 'TMP': ..."); it must not close fd.
 * On any failure the temporary is removed and path is left as it was.
 * Errors: KV_EIO naming path, KV_ENOMEM, and whatever fill returns. */
int kv_write_atomic(const char *path,
                    int (*fill)(int fd, const char *path, const char *tmp, void *ctx,
                                struct kv_err *err),
                    void *ctx, struct kv_err *err);

#endif
