/* The compressed-model output directory: layout in kvdir.h. */
#include "kvdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "kvmanifest.h"
#include "lrlayout.h"
#include "lrmodel.h"
#include "lrweights.h"
#include "mapfile.h"
#include "model.h"
#include "stwrite.h"

/* Files of an HF source directory that the output keeps, untouched. */
static const char *const hf_copied[] = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json",
};

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* ================================================================ files */

static int write_all_fd(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t r = write(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int fill_text(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    char eb[128];
    const char *s = ctx;
    int e = write_all_fd(fd, s, strlen(s));
    if (e)
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                       kv_errtext(e, eb, sizeof eb));
    return KV_OK;
}

/* dir without trailing slashes (malloc'd). */
static char *trim_dir(const char *dir) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    char *s = malloc(n + 1);
    if (!s) return NULL;
    memcpy(s, dir, n);
    s[n] = 0;
    return s;
}

/* What is at an output path. */
enum target { T_ABSENT, T_EMPTY, T_EARLIER };

/* Classify dir: absent, an empty directory, or an earlier output (a
 * directory holding kvcal.json and no subdirectory); anything else is
 * KV_EINVAL. */
static int classify_target(const char *dir, const char *name, enum target *out,
                           struct kv_err *err) {
    char eb[128];
    struct stat st;
    if (lstat(dir, &st) != 0) {
        if (errno == ENOENT) {
            *out = T_ABSENT;
            return KV_OK;
        }
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot stat: %s",
                       kv_errtext(errno, eb, sizeof eb));
    }
    if (!S_ISDIR(st.st_mode))
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "exists and is not a directory; %s names a directory",
                       name ? name : "the output");
    DIR *d = opendir(dir);
    if (!d)
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot open directory: %s",
                       kv_errtext(errno, eb, sizeof eb));
    int n = 0, manifest = 0, rc = KV_OK;
    char subdir[256] = "";
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        n++;
        if (!strcmp(e->d_name, KV_LRL_MANIFEST_NAME)) manifest = 1;
        char *p = kv_path_join(dir, e->d_name);
        if (!p) {
            rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
            break;
        }
        struct stat es;
        if (lstat(p, &es) == 0 && S_ISDIR(es.st_mode) && !subdir[0])
            snprintf(subdir, sizeof subdir, "%s", e->d_name);
        free(p);
    }
    closedir(d);
    if (rc) return rc;
    if (n == 0) {
        *out = T_EMPTY;
        return KV_OK;
    }
    if (!manifest)
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "directory is not empty and holds no " KV_LRL_MANIFEST_NAME
                       "; refusing to replace it");
    if (subdir[0])
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "earlier output holds a subdirectory '%s'; refusing to replace it",
                       subdir);
    *out = T_EARLIER;
    return KV_OK;
}

int kv_lr_dir_check(const char *dir, const char *name, struct kv_err *err) {
    char eb[128];
    if (!dir[0]) return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET, "empty output directory name");
    char *out = trim_dir(dir), *parent = out ? kv_path_dir(out) : NULL;
    enum target t;
    int rc = out && parent ? classify_target(out, name, &t, err)
                           : kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    /* the parent must take the temporary directory now, not after the work */
    if (!rc && access(parent, W_OK | X_OK) != 0)
        rc = kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot create the output directory in '%s': %s",
                     parent, kv_errtext(errno, eb, sizeof eb));
    free(out);
    free(parent);
    return rc;
}

/* ================================================================ write */

/* Fill the temporary directory tmp. */
static int write_contents(const struct kv_model *m, const struct kv_lowrank *lr,
                          const struct kv_lr_dir_info *info, const char *fp, const char *tmp,
                          struct kv_err *err) {
    struct kv_mf_extra extra;
    int rc = kv_mf_extra_parse(info, tmp, &extra, err);
    if (rc) return rc;

    /* extra files first: the manifest names the tokenizer it copied */
    const char *tok_name = NULL;
    char *src = NULL, *dst = NULL;
    if (m->format == KV_FORMAT_HF && info->model_path && kv_path_kind(info->model_path) == 1) {
        for (size_t i = 0; i < sizeof hf_copied / sizeof hf_copied[0] && !rc; i++) {
            src = kv_path_join(info->model_path, hf_copied[i]);
            dst = kv_path_join(tmp, hf_copied[i]);
            if (!src || !dst)
                rc = kv_fail(err, KV_ENOMEM, tmp, KV_NO_OFFSET, "out of memory");
            else if (kv_path_kind(src) == 0 && !(rc = kv_file_copy(src, dst, err)) &&
                     !strcmp(hf_copied[i], "tokenizer.json"))
                tok_name = "tokenizer.json";
            free(src), free(dst);
            src = dst = NULL;
        }
    } else if (m->format != KV_FORMAT_HF && info->tokenizer_path) {
        const char *bn = base_name(info->tokenizer_path);
        if (!bn[0] || !strcmp(bn, ".") || !strcmp(bn, "..") || !strcmp(bn, KV_LRL_MANIFEST_NAME) ||
            !strcmp(bn, KV_LRL_WEIGHTS_NAME)) {
            rc = kv_fail(err, KV_EINVAL, info->tokenizer_path, KV_NO_OFFSET,
                         "cannot copy the tokenizer as '%s' into the output directory", bn);
        } else if (!(dst = kv_path_join(tmp, bn))) {
            rc = kv_fail(err, KV_ENOMEM, tmp, KV_NO_OFFSET, "out of memory");
        } else if (!(rc = kv_file_copy(info->tokenizer_path, dst, err))) {
            tok_name = bn;
        }
        free(dst);
    }
    if (rc) {
        kv_mf_extra_clear(&extra);
        return rc;
    }

    /* weights, then the manifest (which takes extra) */
    char *wpath = kv_path_join(tmp, KV_LRL_WEIGHTS_NAME);
    char *mpath = kv_path_join(tmp, KV_LRL_MANIFEST_NAME);
    if (!wpath || !mpath) rc = kv_fail(err, KV_ENOMEM, tmp, KV_NO_OFFSET, "out of memory");
    if (!rc) rc = kv_lrw_write(m, lr, wpath, err);
    char *text = NULL;
    if (!rc) rc = kv_mf_format(m, lr, fp, info, tok_name, &extra, mpath, &text, err);
    if (!rc) rc = kv_write_atomic(mpath, fill_text, text, err);
    free(text);
    kv_mf_extra_clear(&extra);
    free(wpath);
    free(mpath);
    return rc;
}

int kv_lr_dir_write(const struct kv_model *m, const struct kv_lowrank *lr,
                    const struct kv_lr_dir_info *info, const char *dir, struct kv_err *err) {
    KV_ASSERT(m && lr && dir);
    const struct kv_lr_dir_info none = {0};
    if (!info) info = &none;
    char eb[128];
    if (!dir[0]) return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET, "empty output directory name");
    int rc = kv_lrl_check(lr, m, dir, err);
    if (rc) return rc;
    char fp[65];
    if ((rc = kv_model_fingerprint(m, fp, err))) return rc;
    if (lr->info.model_fingerprint[0] && strcmp(lr->info.model_fingerprint, fp) != 0)
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "factors were made from model %.12s but this model is %.12s",
                       lr->info.model_fingerprint, fp);

    char *out = trim_dir(dir);
    size_t n = out ? strlen(out) + 32 : 0;
    char *tmp = out ? malloc(n) : NULL;
    if (!out || !tmp) {
        free(out), free(tmp);
        return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    }
    snprintf(tmp, n, "%s.tmp-%ld", out, (long)getpid());

    /* refuse early, before writing anything */
    enum target t;
    if ((rc = classify_target(out, NULL, &t, err))) goto done;
    if (mkdir(tmp, 0755) != 0) {
        rc = kv_fail(err, KV_EIO, out, KV_NO_OFFSET, "cannot create directory '%s': %s", tmp,
                     kv_errtext(errno, eb, sizeof eb));
        goto done;
    }
    rc = write_contents(m, lr, info, fp, tmp, err);
    if (!rc) rc = kv_fsync_dir(tmp, tmp, err);
    /* look again: the directory may have changed while the weights were written */
    if (!rc) rc = classify_target(out, NULL, &t, err);
    /* An earlier output is swapped with the new one in one step
     * (kv_dir_install): out holds the old output or the new one, whole, at
     * every moment. */
    if (!rc) rc = kv_dir_install(tmp, out, err);
    if (rc && kv_path_kind(tmp) == 1) {
        struct kv_err ignored;
        kv_err_clear(&ignored);
        kv_remove_dir_files(tmp, 1, &ignored);
    }
done:
    free(out);
    free(tmp);
    return rc;
}

/* ================================================================ open */

int kv_lr_dir_open(const char *dir, const struct kv_model *m, struct kv_lowrank **out,
                   struct kv_err *err) {
    KV_ASSERT(dir && m && out);
    char *mpath = kv_path_join(dir, KV_LRL_MANIFEST_NAME);
    if (!mpath) return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    if (kv_path_kind(dir) != 1) {
        int rc = kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "not a directory");
        free(mpath);
        return rc;
    }
    struct kv_lowrank *lr = NULL;
    char *wpath = NULL;
    struct kv_mf mf = {0};
    int rc = kv_mf_read(mpath, &lr, &mf, err);
    if (rc) goto done;

    const struct kv_config *c = &m->cfg, *r = &mf.cfg;
    if (r->arch != c->arch) {
        rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET,
                     "made from a %s model, but the given model is %s", kv_arch_name(r->arch),
                     kv_arch_name(c->arch));
        goto done;
    }
    const struct {
        const char *key;
        int64_t file, model;
    } dims[] = {
        {"dim", r->dim, c->dim},
        {"hidden_dim", r->hidden_dim, c->hidden_dim},
        {"n_layers", r->n_layers, c->n_layers},
        {"n_heads", r->n_heads, c->n_heads},
        {"n_kv_heads", r->n_kv_heads, c->n_kv_heads},
        {"head_dim", r->head_dim, c->head_dim},
        {"vocab_size", r->vocab_size, c->vocab_size},
        {"tied_embeddings", r->tied_embeddings, c->tied_embeddings},
        {"qkv_bias", r->has_qkv_bias, c->has_qkv_bias},
        /* what an engine following the manifest computes with: as the model's
         * (a manifest without max_seq_len, from before it was read, agrees) */
        {"max_seq_len", r->max_seq_len ? r->max_seq_len : c->max_seq_len, c->max_seq_len},
        {"sliding_window", r->sliding_window, c->sliding_window},
        {"first windowed layer", r->sliding_window ? r->window_from : 0, c->sliding_window ? c->window_from : 0},
        {"windowed layer period", r->sliding_window ? r->window_period : 0, c->sliding_window ? c->window_period : 0},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].file != dims[i].model) {
            rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET,
                         "made from a model with %s %lld, but the given model has %lld",
                         dims[i].key, (long long)dims[i].file, (long long)dims[i].model);
            goto done;
        }
    const struct {
        const char *key;
        float file, model;
    } reals[] = {
        {"norm_eps", r->norm_eps, c->norm_eps},
        {"rope theta", kv_lrl_has_rope(c->arch) ? r->rope_theta : 0, kv_lrl_has_rope(c->arch) ? c->rope_theta : 0},
    };
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++)
        if (reals[i].file != reals[i].model) {
            char a[32], b[32];
            rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET, "made from a model with %s %s, but the given model has %s",
                         reals[i].key, kv_float_str(a, sizeof a, reals[i].file), kv_float_str(b, sizeof b, reals[i].model));
            goto done;
        }
    int rope_model = kv_lrl_has_rope(c->arch) ? (int)c->rope_layout : KV_ROPE_INTERLEAVED;
    if ((int)r->rope_layout != rope_model) {
        static const char *const pairs[] = {"interleaved (2i, 2i+1)", "half (i, i + d_h/2)"};
        rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET,
                     "made from a model whose rope pairs are %s, but the given model's are %s",
                     pairs[r->rope_layout == KV_ROPE_HALF], pairs[rope_model == KV_ROPE_HALF]);
        goto done;
    }
    if (kv_lrl_has_rope(c->arch) && !kv_rope_same(r, c)) {
        rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET,
                     "made from a model with rope scaling '%s', but the given model's rope scaling "
                     "('%s') gives other frequencies",
                     kv_rope_scaling_name(r->rope_scaling.type),
                     kv_rope_scaling_name(c->rope_scaling.type));
        goto done;
    }
    char fp[65];
    if ((rc = kv_model_fingerprint(m, fp, err))) goto done;
    if (strcmp(fp, mf.fingerprint) != 0) {
        rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET,
                     "made from model %.12s, but the given model is %.12s (fingerprints differ)",
                     mf.fingerprint, fp);
        goto done;
    }
    if (!(wpath = kv_path_join(dir, mf.weights))) {
        rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    if ((rc = kv_lrw_read(wpath, &mf, lr, err))) goto done;
    /* what the reader built is what a writer accepts */
    KV_ASSERT(kv_lrl_check(lr, m, mpath, err) == KV_OK);
    *out = lr;
    lr = NULL;
done:
    kv_lr_free(lr);
    kv_mf_clear(&mf);
    free(wpath);
    free(mpath);
    return rc;
}
