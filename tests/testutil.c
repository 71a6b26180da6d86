#include "testutil.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvcal_core.h"

const char *kvt_shared(const char *rel) {
    static __thread char buf[4096];
    const char *root = getenv("KVCAL_SHARED");
    if (!root || !*root) root = "../shared";
    snprintf(buf, sizeof buf, "%s/%s", root, rel);
    struct stat st;
    if (stat(buf, &st) != 0) return NULL;
    return buf;
}

static const char *tmp_root(void) {
    const char *t = getenv("TMPDIR");
    return t && *t ? t : "/tmp";
}

/* Remove path and, if it is a directory (not followed through a link),
 * everything under it. */
static void rm_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (!S_ISDIR(st.st_mode)) {
        unlink(path);
        return;
    }
    DIR *d = opendir(path);
    if (d) {
        struct dirent *e;
        char sub[4096];
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
                snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
                rm_tree(sub);
            }
        closedir(d);
    }
    rmdir(path);
}

/* Every temporary file and directory this process made, removed when it
 * exits (each test runs in its own process), so a test that leaves its
 * own behind, or fails half-way, leaves nothing in the temporary
 * directory. */
static char **made;
static int n_made, cap_made;

static void remove_made(void) {
    for (int i = 0; i < n_made; i++) {
        rm_tree(made[i]);
        free(made[i]);
    }
    free(made);
    made = NULL, n_made = cap_made = 0;
}

static void remember(const char *path) {
    if (n_made == cap_made) {
        int cap = cap_made ? 2 * cap_made : 16;
        char **m = realloc(made, (size_t)cap * sizeof *m);
        if (!m) return;
        if (!made) atexit(remove_made);
        made = m, cap_made = cap;
    }
    if ((made[n_made] = strdup(path))) n_made++;
}

char *kvt_write_temp(const void *buf, size_t len, const char *suffix) {
    char tmpl[1024];
    snprintf(tmpl, sizeof tmpl, "%s/kvcal-test-XXXXXX%s", tmp_root(), suffix ? suffix : "");
    int fd = mkstemps(tmpl, suffix ? (int)strlen(suffix) : 0);
    cr_assert(fd >= 0, "mkstemps failed");
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(fd, (const char *)buf + off, len - off);
        cr_assert(w > 0, "write failed");
        off += (size_t)w;
    }
    close(fd);
    remember(tmpl);
    return strdup(tmpl);
}

char *kvt_temp_dir(void) {
    char tmpl[1024];
    snprintf(tmpl, sizeof tmpl, "%s/kvcal-test-dir-XXXXXX", tmp_root());
    cr_assert(mkdtemp(tmpl) != NULL, "mkdtemp failed");
    remember(tmpl);
    return strdup(tmpl);
}

char *kvt_path(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

char *kvt_write_text(const char *dir, const char *name, const char *text) {
    char *p = kvt_path(dir, name);
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f, "cannot write %s", p);
    fputs(text, f);
    cr_assert_eq(fclose(f), 0, "cannot write %s", p);
    return p;
}

float *kvt_logits(struct kv_model *m, const int32_t *tok, int64_t n) {
    struct kv_fwd *f;
    struct kv_err err = {0};
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", err.msg);
    int64_t V = kv_model_config(m)->vocab_size;
    float *out = malloc((size_t)(n * V) * sizeof *out);
    memcpy(out, kv_fwd_logits(f), (size_t)(n * V) * sizeof *out);
    kv_fwd_free(f);
    return out;
}

void kvt_log_softmax_rows(double *lg, int64_t n, int64_t V) {
    for (int64_t i = 0; i < n; i++) {
        double *row = lg + i * V, mx = -INFINITY, z = 0;
        for (int64_t v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
        for (int64_t v = 0; v < V; v++) z += exp(row[v] - mx);
        double lse = mx + log(z);
        for (int64_t v = 0; v < V; v++) row[v] -= lse;
    }
}

int kvt_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

char *kvt_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *s = malloc(cap);
    for (;;) {
        if (n + 4096 + 1 > cap) s = realloc(s, cap *= 2);
        size_t r = fread(s + n, 1, 4096, f);
        n += r;
        if (r == 0) break;
    }
    fclose(f);
    s[n] = 0;
    if (len) *len = n;
    return s;
}

int kvt_run_cli(const char *args, char **out, char **err) {
    const char *bin = getenv("KVCAL_BIN");
    if (!bin || !*bin) bin = "build/kvcal";
    char *dir = kvt_temp_dir();
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s >%s/out 2>%s/err </dev/null", bin, args, dir, dir);
    int st = system(cmd);
    char p[512];
    snprintf(p, sizeof p, "%s/out", dir);
    char *o = kvt_read_file(p, NULL);
    unlink(p);
    snprintf(p, sizeof p, "%s/err", dir);
    char *e = kvt_read_file(p, NULL);
    unlink(p);
    rmdir(dir);
    free(dir);
    if (out) *out = o; else free(o);
    if (err) *err = e; else free(e);
    if (st == -1) return -1;
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return -1;
}

#define CLOSE_BODY(T)                                                                      \
    int64_t worst = -1;                                                                    \
    double worst_excess = 0;                                                               \
    for (int64_t i = 0; i < n; i++) {                                                      \
        double a = got[i], r = ref[i];                                                     \
        double tol = atol + rtol * fabs(r);                                                \
        double diff = fabs(a - r);                                                         \
        if (!(diff <= tol)) {                                                              \
            double excess = isnan(diff) ? INFINITY : diff - tol;                           \
            if (worst < 0 || excess > worst_excess) {                                      \
                worst = i;                                                                 \
                worst_excess = excess;                                                     \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    if (worst >= 0)                                                                        \
        cr_assert_fail("%s: worst element %lld: got %.9g ref %.9g |diff| %.3g > tol %.3g "  \
                       "(atol %.3g rtol %.3g)",                                            \
                       what, (long long)worst, (double)got[worst], (double)ref[worst],     \
                       fabs((double)got[worst] - (double)ref[worst]),                      \
                       atol + rtol * fabs((double)ref[worst]), atol, rtol);

void kvt_assert_close_f32(const float *got, const float *ref, int64_t n, double atol,
                          double rtol, const char *what) {
    CLOSE_BODY(float)
}
void kvt_assert_close_f64(const double *got, const double *ref, int64_t n, double atol,
                          double rtol, const char *what) {
    CLOSE_BODY(double)
}

double kvt_assert_close_oracle(const float *got, const double *ref, int64_t n, double atol_rel,
                               double rtol, const char *what) {
    float *reff = malloc((size_t)n * sizeof *reff);
    cr_assert_not_null(reff);
    double spread = 0;
    for (int64_t i = 0; i < n; i++) reff[i] = (float)ref[i], spread = fmax(spread, fabs(ref[i]));
    cr_assert(spread > 0.5, "%s: too flat to test (max |ref| %g)", what, spread);
    kvt_assert_close_f32(got, reff, n, atol_rel * spread, rtol, what);
    free(reff);
    return spread;
}

void kvt_rm_dir(char *dir) {
    rm_tree(dir); /* whole: tests write directories (HF, compressed) inside theirs */
    free(dir);
}

int kvt_tmp_left(const char *path) {
    const char *slash = strrchr(path, '/');
    char dir[4096], prefix[1024];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    snprintf(prefix, sizeof prefix, "%s.tmp-", slash ? slash + 1 : path);
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
    closedir(d);
    return n;
}
