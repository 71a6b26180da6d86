/* Helpers shared by the Criterion suites. */
#ifndef KV_TESTUTIL_H
#define KV_TESTUTIL_H

#include <criterion/criterion.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvcal.h"

/* Path under the shared test-data folder ($KVCAL_SHARED, default ../shared),
 * or NULL when it does not exist. Returned string is static per call site
 * use: copy it if you need two at once. */
const char *kvt_shared(const char *rel);

/* Skip the current test with a message when a shared file is missing. */
#define KVT_NEED_SHARED(var, rel)                                                          \
    const char *var = kvt_shared(rel);                                                     \
    do {                                                                                   \
        if (!var) cr_skip_test("shared test data '%s' is absent; skipping", rel);           \
    } while (0)

/* Skip the current test under the sanitizers (make check-san sets
 * KVCAL_SANITIZED): for tests that measure memory or limit the address
 * space, which AddressSanitizer's shadow memory and quarantine defeat. */
#define KVT_SKIP_SANITIZED(why)                                                            \
    do {                                                                                   \
        if (getenv("KVCAL_SANITIZED"))                                                     \
            cr_skip_test("under the sanitizers: %s; skipping", why);                       \
    } while (0)

/* Write bytes to a fresh temporary file; returns its malloc'd path. */
char *kvt_write_temp(const void *buf, size_t len, const char *suffix);
/* Make a fresh temporary directory; returns its malloc'd path. */
char *kvt_temp_dir(void);
/* Remove dir and everything under it (symbolic links removed, not
 * followed), and free the malloc'd path. */
void kvt_rm_dir(char *dir);
/* dir + "/" + name, malloc'd. */
char *kvt_path(const char *dir, const char *name);
/* How many temporaries of path (PATH.tmp-*, kv_tmp_create's names) its
 * directory holds. */
int kvt_tmp_left(const char *path);
/* Write text to dir/name (asserting it worked); returns the malloc'd path. */
char *kvt_write_text(const char *dir, const char *name, const char *text);
/* The logits [n, vocab] of one forward run of m over tok from position 0
 * (asserting it worked), malloc'd. */
struct kv_model;
float *kvt_logits(struct kv_model *m, const int32_t *tok, int64_t n);

/* Read a whole file (malloc'd, NUL-terminated); NULL on failure. */
char *kvt_read_file(const char *path, size_t *len);

/* Each of n rows of V logits replaced by its log-softmax, in float64. */
void kvt_log_softmax_rows(double *lg, int64_t n, int64_t V);

/* Whether path exists (stat succeeds). */
int kvt_exists(const char *path);
/* Skips the test, saying why, when the King James text of make data is absent. */
#define KVT_NEED_KJV()                                                                        \
    do {                                                                                      \
        if (!kvt_exists("data/kjv/train.txt") || !kvt_exists("data/kjv/gospels.txt"))         \
            cr_skip_test("data/kjv is absent (make data, which needs Debian's bible-kjv); "   \
                         "skipping");                                                         \
    } while (0)

/* Run the kvcal binary ($KVCAL_BIN, default build/kvcal) with a shell-quoted
 * argument string; captures stdout and stderr (malloc'd) and returns the exit
 * code (or 128+signal). */
int kvt_run_cli(const char *args, char **out, char **err);

/* Compare arrays with |a-b| <= atol + rtol*|ref|; on failure reports the worst
 * element (index, values, tolerance) through cr_assert. */
void kvt_assert_close_f32(const float *got, const float *ref, int64_t n, double atol,
                          double rtol, const char *what);
void kvt_assert_close_f64(const double *got, const double *ref, int64_t n, double atol,
                          double rtol, const char *what);

/* float32 values got [n] (logits) against a float64 oracle's ref [n]: fails
 * when max |ref| is 0.5 or less (too flat to test), else compares as above
 * with atol = atol_rel · max |ref|, float32 sums erring in proportion to the
 * largest value. Returns max |ref|. */
double kvt_assert_close_oracle(const float *got, const double *ref, int64_t n, double atol_rel,
                               double rtol, const char *what);

#endif
