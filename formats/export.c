/* Dense export: the source model copied byte for byte with its K/V
 * projections replaced by up·down. Layout and rules in export.h. */
#include "export.h"

#include <cblas.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arch.h"
#include "err.h"
#include "ggmlquant.h"
#include "gguf.h"
#include "hfdir.h"
#include "json.h"
#include "limits.h"
#include "lrmodel.h"
#include "mapfile.h"
#include "model.h"
#include "safetensors.h"

#define EXPORT_CHUNK ((size_t)4 << 20) /* copy buffer */

/* One K/V weight (or bias) to overwrite inside a stored tensor. */
struct target {
    int64_t layer;
    enum kv_wkind kind; /* KV_W_K, KV_W_V, KV_W_BK or KV_W_BV */
    int file;           /* index into struct job's files */
    char name[KV_MAX_NAME_LEN + 1];
    enum kv_dtype dtype;
    uint32_t block_type;  /* a block-quantized GGUF tensor (dtype KV_DTYPE_COUNT), else 0 */
    uint64_t off, nbytes; /* the whole stored tensor */
    int64_t stored_n;     /* its elements */
    int64_t rows, cols;   /* the weight: [g*d_h, d], or [g*d_h] with cols 1 for a bias */
    /* element (o, i) of the weight is stored element base + o*os + i*is:
     * the whole tensor [out, in] for llama, columns of gpt2's c_attn */
    int64_t base, os, is;
    /* interleaved per head (HF gpt_neox's query_key_value): row o is stored
     * row (o / hdh) * hstride + hoff + o % hdh; hdh 0 otherwise */
    int64_t hdh, hstride, hoff;
};

struct job {
    const struct kv_model *m;
    const struct kv_lowrank *lr;
    char **files;    /* source paths; for a directory every regular file */
    char **names;    /* base names (directory source only) */
    int n_files;
    struct target *t;
    int64_t n_t;
};

static const char *side_name(enum kv_wkind k) { return k == KV_W_K || k == KV_W_BK ? "k" : "v"; }

static const struct kv_lr_side *side_of(const struct kv_lowrank *lr, int64_t l, enum kv_wkind k) {
    return k == KV_W_K || k == KV_W_BK ? &lr->layers[l].k : &lr->layers[l].v;
}

static enum kv_wkind bias_kind(enum kv_wkind w) { return w == KV_W_K ? KV_W_BK : KV_W_BV; }

/* ================================================================ checks */

/* lr against m's shapes, and every side against the modes and head
 * partition kv_lowrank promises. */
static int check_lowrank(const struct kv_model *m, const struct kv_lowrank *lr,
                         struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    if (!kv_shapes_match(c, lr->info.n_layers, lr->info.dim, lr->info.n_heads, lr->info.n_kv_heads, lr->info.head_dim,
                         "factors", NULL, err))
        return KV_EINVAL;
    KV_ASSERT(lr->layers);
    const int64_t g = c->n_kv_heads;
    char *seen = malloc((size_t)g);
    if (!seen) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int rc = KV_OK;
    for (int64_t l = 0; l < c->n_layers && !rc; l++)
        for (int which = 0; which < 2 && !rc; which++) {
            enum kv_wkind wk = which ? KV_W_V : KV_W_K;
            const struct kv_lr_side *s = side_of(lr, l, wk);
            const char *sn = side_name(wk);
            if (s->mode == KV_LR_FULL) continue;
            if (s->mode == KV_LR_POSTROPE_ROTATION) {
                /* without rope the rotation could fold into the weight, but
                 * the export writes only the up·down modes */
                rc = kv_arch_has_rope(c->arch)
                         ? kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                                   "layer %lld %s: mode 'postrope_rotation' cannot be exported "
                                   "dense: its projection acts after rope, which no %s weight "
                                   "expresses",
                                   (long long)l, sn, which ? "v_proj" : "k_proj")
                         : kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                                   "layer %lld %s: mode 'postrope_rotation' (a rotation of the "
                                   "projected keys, from --method zack or fdc) is not exported "
                                   "dense: export writes prerope_latent and fused_query keys",
                                   (long long)l, sn);
                break;
            }
            if (s->mode != KV_LR_PREROPE_LATENT && s->mode != KV_LR_FUSED_QUERY &&
                s->mode != KV_LR_FUSED_OUTPUT) {
                rc = kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                             "layer %lld %s: unknown mode %d", (long long)l, sn, (int)s->mode);
                break;
            }
            if (s->n_units < 1 || s->n_units > g || !s->units) {
                rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                             "layer %lld %s: mode '%s' has %lld units, expected 1..%lld",
                             (long long)l, sn, kv_lr_mode_name(s->mode), (long long)s->n_units,
                             (long long)g);
                break;
            }
            int has_bias = kv_model_has(m, bias_kind(wk), l);
            memset(seen, 0, (size_t)g);
            for (int64_t u = 0; u < s->n_units && !rc; u++) {
                const struct kv_lr_unit *x = &s->units[u];
                if (x->n_heads < 1 || x->head0 < 0 || x->head0 > g - x->n_heads)
                    rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                 "layer %lld %s unit %lld: heads %lld..%lld are outside the "
                                 "model's kv heads 0..%lld",
                                 (long long)l, sn, (long long)u, (long long)x->head0,
                                 (long long)(x->head0 + x->n_heads - 1), (long long)(g - 1));
                else if (x->rank < 1 || x->rank > KV_MAX_DIM)
                    rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                 "layer %lld %s unit %lld: rank %lld, expected 1..%d", (long long)l,
                                 sn, (long long)u, (long long)x->rank, KV_MAX_DIM);
                else if (!x->down || !x->up)
                    rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                 "layer %lld %s unit %lld: mode '%s' needs both down and up "
                                 "factors",
                                 (long long)l, sn, (long long)u, kv_lr_mode_name(s->mode));
                else if (x->up_bias && !has_bias)
                    rc = kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                                 "layer %lld %s unit %lld: the factors are centred (a mean in "
                                 "up_bias) but the model has no %s bias tensor to hold the mean",
                                 (long long)l, sn, (long long)u, sn);
                else if (x->down_bias && !has_bias)
                    rc = kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                                 "layer %lld %s unit %lld: the factors carry a down bias but the "
                                 "model has no %s bias tensor to hold up·down_bias",
                                 (long long)l, sn, (long long)u, sn);
                for (int64_t h = x->head0; !rc && h < x->head0 + x->n_heads; h++) {
                    if (seen[h])
                        rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                     "layer %lld %s: kv head %lld is in two units", (long long)l,
                                     sn, (long long)h);
                    seen[h] = 1;
                }
            }
            for (int64_t h = 0; h < g && !rc; h++)
                if (!seen[h])
                    rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                                 "layer %lld %s: kv head %lld is in no unit", (long long)l, sn,
                                 (long long)h);
        }
    free(seen);
    return rc;
}

static int same_inode(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* 1 if directory path has an entry other than . and .. (0 if it cannot be read). */
static int dir_has_entries(const char *path) {
    DIR *d = opendir(path);
    if (!d) return 0;
    struct dirent *e;
    int any = 0;
    while (!any && (e = readdir(d))) any = strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return any;
}

int kv_output_check(const char *model_path, const char *out, int is_dir, struct kv_err *err) {
    char eb[128];
    struct stat sm, so;
    if (stat(model_path, &sm) != 0)
        return kv_fail(err, KV_EIO, model_path, KV_NO_OFFSET, "cannot stat: %s",
                       kv_errtext(errno, eb, sizeof eb));
    if (!*out) return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "empty output path");
    if (stat(out, &so) == 0) {
        if (same_inode(&sm, &so))
            return kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET,
                           "is the source model itself; refusing to overwrite it");
        if (is_dir && !S_ISDIR(so.st_mode))
            return kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET,
                           "exists and is not a directory; the export of an hf directory is a "
                           "directory");
        if (is_dir && dir_has_entries(out))
            return kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET,
                           "directory exists and is not empty; refusing to replace it");
        if (!is_dir && S_ISDIR(so.st_mode))
            return kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET,
                           "is a directory; the export of a model file is one file");
    }
    return KV_OK;
}

/* ================================================================ targets */

/* Add the target for weight `kind` of `layer`, stored in tensor t (of
 * files[file]), checking t's dtype and shape. Where the architecture table
 * stacks it with other weights (gpt2's c_attn: q, k and v along the output
 * axis, weight [d, qd + 2 kd] as a Conv1D stores it, [in, out], and bias
 * [qd + 2 kd]), it is rows r0.. of that tensor; any other source stores
 * each as its own [kd, d] / [kd] tensor. */
static int add_target(struct job *j, int64_t layer, enum kv_wkind kind, int file,
                      const struct kv_tensor *t, const char *path, struct kv_err *err) {
    const struct kv_config *c = &j->m->cfg;
    const int64_t kd = c->n_kv_heads * c->head_dim, d = c->dim;
    const int is_bias = kind == KV_W_BK || kind == KV_W_BV;
    int part = 0;
    const struct kv_arch_desc *ad = kv_arch_desc(c->arch);
    const struct kv_arch_tensor *e =
        j->m->format == KV_FORMAT_HF     ? kv_arch_find(&ad->hf, kind, &part)
        : j->m->format == KV_FORMAT_GGUF ? kv_arch_find(&ad->gguf, kind, &part)
                                         : NULL;
    int64_t out = kd, r0 = 0; /* the tensor's output rows, and this weight's first */
    if (e && e->n_kinds > 1) {
        out = 0;
        for (int k = 0; k < e->n_kinds; k++) {
            int64_t s[2];
            kv_model_expected_shape(c, e->kinds[k], s);
            if (k < part) r0 += s[0];
            out += s[0];
        }
    }
    const int conv = e && e->conv;
    /* a quantized GGUF tensor is rewritten as F16 (fill_gguf_retyped) */
    const int blocks = t->dtype == KV_DTYPE_COUNT && t->block_type &&
                       kv_ggml_can_dequant(t->block_type) && j->m->format == KV_FORMAT_GGUF;
    if (t->dtype != KV_DTYPE_F32 && t->dtype != KV_DTYPE_F16 && t->dtype != KV_DTYPE_BF16 && !blocks)
        return kv_fail(err, KV_EUNSUPPORTED, path, t->offset,
                       "tensor '%s' has dtype %s; dense export writes only F32, F16 and BF16",
                       t->name, kv_dtype_name(t->dtype));
    if (blocks && e && e->n_kinds > 1)
        return kv_fail(err, KV_EUNSUPPORTED, path, t->offset,
                       "tensor '%s' stacks q, k and v in quantized type %s; dense export "
                       "rewrites only whole quantized K or V tensors (as F16)",
                       t->name, kv_ggml_type_name(t->block_type));
    int64_t want[2] = {out, 0};
    int nd = is_bias ? 1 : 2;
    if (!is_bias) want[0] = conv ? d : out, want[1] = conv ? out : d;
    int ok = t->ndim == nd;
    for (int i = 0; i < nd && ok; i++) ok = t->shape[i] == want[i];
    int64_t stored_n = want[0] * (is_bias ? 1 : want[1]);
    uint64_t want_bytes = blocks ? (uint64_t)(stored_n / kv_ggml_block_elems(t->block_type)) *
                                       (uint64_t)kv_ggml_block_bytes(t->block_type)
                                 : (uint64_t)stored_n * kv_dtype_size(t->dtype);
    if (!ok || t->nbytes != want_bytes) {
        char a[96], b[96];
        kv_shape_str(a, sizeof a, t->shape, t->ndim);
        kv_shape_str(b, sizeof b, want, nd);
        return kv_fail(err, KV_EFORMAT, path, t->offset,
                       "tensor '%s' has shape %s, expected %s: it is not the %s of layer %lld "
                       "the model was loaded with",
                       t->name, a, b, kv_wkind_name(kind), (long long)layer);
    }
    struct target *x = &j->t[j->n_t++];
    x->layer = layer;
    x->kind = kind;
    x->file = file;
    snprintf(x->name, sizeof x->name, "%s", t->name);
    x->dtype = t->dtype;
    x->block_type = blocks ? t->block_type : 0;
    x->off = t->offset;
    x->nbytes = t->nbytes;
    x->stored_n = stored_n;
    x->rows = kd;
    x->cols = is_bias ? 1 : d;
    x->base = conv ? r0 : r0 * x->cols;
    x->os = conv ? 1 : x->cols;
    x->is = conv ? out : 1;
    if (e && e->heads) { /* rows [h][n_kinds][d_h]: this kind's rows of head i at i*stride + off */
        x->hdh = c->head_dim, x->hstride = e->n_kinds * c->head_dim, x->hoff = part * c->head_dim;
        x->base = 0;
    }
    return KV_OK;
}

/* Stored element index of element e (row-major in [rows, cols]) of t. */
static int64_t stored_at(const struct target *t, int64_t e) {
    int64_t o = e / t->cols, i = e % t->cols;
    if (t->hdh) return ((o / t->hdh) * t->hstride + t->hoff + o % t->hdh) * t->cols + i;
    return t->base + o * t->os + i * t->is;
}

/* Stored name of a K/V weight in the source's format, from the
 * architecture table (gpt2: the c_attn holding it, under its full name; the
 * loader also takes it without the "transformer." prefix). */
static void stored_name(enum kv_format f, enum kv_arch arch, int64_t l, enum kv_wkind k,
                        char *buf, size_t cap) {
    const struct kv_arch_desc *a = kv_arch_desc(arch);
    const struct kv_arch_names *nm = f == KV_FORMAT_HF ? &a->hf : &a->gguf;
    const struct kv_arch_tensor *e = f == KV_FORMAT_LLAMA2C ? NULL : kv_arch_find(nm, k, NULL);
    if (e)
        snprintf(buf, cap, "%s%lld.%s", nm->layer_prefix, (long long)l, e->name);
    else /* llama2.c stores the weights by position; its names are kvcal's own */
        snprintf(buf, cap, "layers.%lld.w%s", (long long)l, side_name(k));
}

/* Number of tensors to overwrite: the weight of each compressed side, and
 * its bias when the model has one. */
static int64_t count_targets(const struct job *j) {
    int64_t n = 0;
    for (int64_t l = 0; l < j->m->cfg.n_layers; l++)
        for (int which = 0; which < 2; which++) {
            enum kv_wkind wk = which ? KV_W_V : KV_W_K;
            if (side_of(j->lr, l, wk)->mode == KV_LR_FULL) continue;
            n += 1 + kv_model_has(j->m, bias_kind(wk), l);
        }
    return n;
}

/* Single-file sources: the tensors come from the model's own table. */
static int targets_from_table(struct job *j, const char *path, struct kv_err *err) {
    const struct kv_model *m = j->m;
    char name[KV_MAX_NAME_LEN + 64];
    for (int64_t l = 0; l < m->cfg.n_layers; l++)
        for (int which = 0; which < 2; which++) {
            enum kv_wkind wk = which ? KV_W_V : KV_W_K;
            if (side_of(j->lr, l, wk)->mode == KV_LR_FULL) continue;
            enum kv_wkind kinds[2] = {wk, bias_kind(wk)};
            for (int b = 0; b < 2; b++) {
                if (b && !kv_model_has(m, kinds[1], l)) continue;
                stored_name(m->format, m->cfg.arch, l, kinds[b], name, sizeof name);
                const struct kv_tensor *t = NULL;
                for (int64_t i = 0; i < m->n_tensors && !t; i++)
                    if (!strcmp(m->tensors[i].name, name)) t = &m->tensors[i];
                if (!t)
                    return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                                   "missing tensor '%s' in the loaded model's table", name);
                int rc = add_target(j, l, kinds[b], 0, t, path, err);
                if (rc) return rc;
            }
        }
    return KV_OK;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every regular file of dir (symbolic links followed), sorted by name. The
 * order matters for the copy: file X is written through X.tmp, and X.tmp
 * sorts after X, so no temporary ever replaces a file already copied. */
static int list_dir(struct job *j, const char *dir, struct kv_err *err) {
    char eb[128];
    DIR *d = opendir(dir);
    if (!d)
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot open directory: %s",
                       kv_errtext(errno, eb, sizeof eb));
    int cap = 0, rc = KV_OK;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *p = kv_path_join(dir, e->d_name);
        if (!p) {
            rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
            break;
        }
        struct stat st;
        if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(p);
            continue;
        }
        free(p);
        if (j->n_files == cap) {
            int nc = cap ? 2 * cap : 16;
            char **nn = realloc(j->names, (size_t)nc * sizeof *nn);
            if (!nn) {
                rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
                break;
            }
            j->names = nn;
            cap = nc;
        }
        if (!(j->names[j->n_files] = strdup(e->d_name))) {
            rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
            break;
        }
        j->n_files++;
    }
    closedir(d);
    if (rc) return rc;
    if (j->n_files) qsort(j->names, (size_t)j->n_files, sizeof *j->names, name_cmp);
    j->files = calloc(j->n_files ? (size_t)j->n_files : 1, sizeof *j->files);
    if (!j->files) return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    for (int i = 0; i < j->n_files; i++)
        if (!(j->files[i] = kv_path_join(dir, j->names[i])))
            return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    return KV_OK;
}

static int file_index(const struct job *j, const char *name) {
    for (int i = 0; i < j->n_files; i++)
        if (!strcmp(j->names[i], name)) return i;
    return -1;
}

/* HF directory: the shards the loader reads (model.safetensors if present,
 * else the files model.safetensors.index.json maps to), each parsed again
 * for its offsets. */
static int targets_from_shards(struct job *j, const char *dir, struct kv_err *err) {
    int rc = list_dir(j, dir, err);
    if (rc) return rc;
    int *shards = NULL, n_shards = 0;
    json_t *root = NULL;
    char *list_path = NULL;
    struct kv_st_file **st = NULL;
    int single = file_index(j, "model.safetensors");
    if (single >= 0) {
        if (!(shards = malloc(sizeof *shards)) ||
            !(list_path = kv_path_join(dir, "model.safetensors"))) {
            rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
            goto done;
        }
        shards[n_shards++] = single;
    } else {
        if (!(list_path = kv_path_join(dir, "model.safetensors.index.json"))) {
            rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
            goto done;
        }
        if ((rc = kv_json_load(list_path, &root, err))) goto done;
        const json_t *map = json_object_get(root, "weight_map");
        if (!json_is_object(map)) {
            rc = kv_fail(err, KV_EFORMAT, list_path, KV_NO_OFFSET,
                         "key 'weight_map' must be an object");
            goto done;
        }
        if (!(shards = malloc((size_t)(j->n_files ? j->n_files : 1) * sizeof *shards))) {
            rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
            goto done;
        }
        const char *key;
        json_t *v;
        json_object_foreach((json_t *)map, key, v) {
            const char *s = json_string_value(v);
            int f = s && !strchr(s, '/') ? file_index(j, s) : -1;
            if (f < 0) {
                rc = kv_fail(err, KV_EFORMAT, list_path, KV_NO_OFFSET,
                             "weight_map entry '%.128s' does not name a file of the directory",
                             key);
                goto done;
            }
            int dup = 0;
            for (int i = 0; i < n_shards && !dup; i++) dup = shards[i] == f;
            if (!dup) shards[n_shards++] = f;
        }
    }
    if (!(st = calloc((size_t)n_shards, sizeof *st))) {
        rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    for (int i = 0; i < n_shards; i++)
        if ((rc = kv_st_open(j->files[shards[i]], &st[i], err))) goto done;
    char name[KV_MAX_NAME_LEN + 64];
    for (int64_t l = 0; l < j->m->cfg.n_layers && !rc; l++)
        for (int which = 0; which < 2 && !rc; which++) {
            enum kv_wkind wk = which ? KV_W_V : KV_W_K;
            if (side_of(j->lr, l, wk)->mode == KV_LR_FULL) continue;
            enum kv_wkind kinds[2] = {wk, bias_kind(wk)};
            for (int b = 0; b < 2 && !rc; b++) {
                if (b && !kv_model_has(j->m, kinds[1], l)) continue;
                stored_name(KV_FORMAT_HF, j->m->cfg.arch, l, kinds[b], name, sizeof name);
                const struct kv_tensor *t = NULL;
                const char *alt = kv_arch_unprefixed(&kv_arch_desc(j->m->cfg.arch)->hf, name);
                int s = 0;
                for (; s < n_shards && !t; s++) {
                    t = kv_st_find(st[s], name);
                    if (!t && alt) t = kv_st_find(st[s], alt);
                }
                if (!t)
                    rc = kv_fail(err, KV_EFORMAT, list_path, KV_NO_OFFSET,
                                 "missing tensor '%s' (it must be stored under its own name "
                                 "to be overwritten)",
                                 name);
                else
                    rc = add_target(j, l, kinds[b], shards[s - 1], t, j->files[shards[s - 1]],
                                    err);
            }
        }
done:
    if (st)
        for (int i = 0; i < n_shards; i++) kv_st_close(st[i]);
    free(st);
    free(shards);
    free(list_path);
    if (root) json_decref(root);
    return rc;
}

/* ================================================================ i/o */

static int pread_all(int fd, void *buf, uint64_t n, uint64_t off) {
    uint8_t *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n > EXPORT_CHUNK ? EXPORT_CHUNK : (size_t)n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return -1; /* short file */
        p += r;
        n -= (uint64_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

static int pwrite_all(int fd, const void *buf, uint64_t n, uint64_t off) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t r = pwrite(fd, p, n > EXPORT_CHUNK ? EXPORT_CHUNK : (size_t)n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO;
        p += r;
        n -= (uint64_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

/* Read every target back from its source file: it must decode to exactly
 * the weight m holds, or m was not loaded from these files. */
static int verify_sources(const struct job *j, struct kv_err *err) {
    char eb[128];
    uint64_t maxb = 0;
    int64_t maxn = 1;
    for (int64_t i = 0; i < j->n_t; i++) {
        if (j->t[i].nbytes > maxb) maxb = j->t[i].nbytes;
        if (j->t[i].stored_n > maxn) maxn = j->t[i].stored_n;
    }
    uint8_t *raw = malloc(maxb ? (size_t)maxb : 1);
    float *f = malloc((size_t)maxn * sizeof *f);
    int rc = KV_OK;
    if (!raw || !f) rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    int fd = -1, fd_file = -1;
    for (int64_t i = 0; i < j->n_t && !rc; i++) {
        const struct target *t = &j->t[i];
        const char *path = j->files[t->file];
        if (fd_file != t->file) {
            if (fd >= 0) close(fd);
            fd_file = t->file;
            if ((fd = kv_open_regular(path, NULL, err)) < 0) {
                rc = KV_EIO;
                break;
            }
        }
        int e = pread_all(fd, raw, t->nbytes, t->off);
        if (e) {
            rc = e < 0 ? kv_fail(err, KV_EFORMAT, path, t->off,
                                 "tensor '%s' extends past the end of the file", t->name)
                       : kv_fail(err, KV_EIO, path, t->off, "cannot read tensor '%s': %s",
                                 t->name, kv_errtext(e, eb, sizeof eb));
            break;
        }
        if (t->block_type)
            KV_ASSERT(kv_ggml_dequant(t->block_type, raw, f, t->stored_n) == KV_OK);
        else
            kv_convert_to_f32(t->dtype, raw, f, t->stored_n);
        const float *w = kv_model_weight(j->m, t->kind, t->layer);
        KV_ASSERT(w);
        int same = 1;
        for (int64_t x = 0; x < t->rows * t->cols && same; x++)
            same = !memcmp(&f[stored_at(t, x)], &w[x], sizeof *f);
        if (!same)
            rc = kv_fail(err, KV_EINVAL, path, t->off,
                         "tensor '%s' differs from the %s of layer %lld of the loaded model; "
                         "pass the model the factors were loaded with",
                         t->name, kv_wkind_name(t->kind), (long long)t->layer);
    }
    if (fd >= 0) close(fd);
    free(raw);
    free(f);
    return rc;
}

/* ================================================================ numerics */

/* Dense rows of target t into out (f32, [g*d_h, d] for a weight, [g*d_h]
 * for a bias), unit by unit:
 *   W'[rows of u] = up_u · down_u      up_u [nh*d_h, r], down_u [r, d]
 *   b'[rows of u] = up_u · c_u + μ_u   c_u = down_bias_u, μ_u = up_bias_u,
 *                                      each 0 when NULL
 * in float64 (dgemm), rounded to f32 once. */
static int dense_rows(const struct job *j, const struct target *t, float *out,
                      struct kv_err *err) {
    const struct kv_config *c = &j->m->cfg;
    const struct kv_lr_side *s = side_of(j->lr, t->layer, t->kind);
    const int64_t d = c->dim, dh = c->head_dim;
    const int is_bias = t->kind == KV_W_BK || t->kind == KV_W_BV;
    const int64_t cols = is_bias ? 1 : d;
    for (int64_t u = 0; u < s->n_units; u++) {
        const struct kv_lr_unit *x = &s->units[u];
        const int64_t rows = x->n_heads * dh, r = x->rank;
        double *up = malloc((size_t)(rows * r) * sizeof *up);
        double *down = malloc((size_t)(r * cols) * sizeof *down);
        double *w = malloc((size_t)(rows * cols) * sizeof *w);
        if (!up || !down || !w) {
            free(up), free(down), free(w);
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        }
        for (int64_t i = 0; i < rows * r; i++) up[i] = x->up[i];
        if (!is_bias)
            for (int64_t i = 0; i < r * d; i++) down[i] = x->down[i];
        else
            for (int64_t i = 0; i < r; i++) down[i] = x->down_bias ? x->down_bias[i] : 0.0;
        /* w [rows, cols] = up [rows, r] · down [r, cols] (+ the mean of
         * centred factors, for the bias) */
        double beta = 0.0;
        if (is_bias && x->up_bias) {
            for (int64_t i = 0; i < rows; i++) w[i] = x->up_bias[i];
            beta = 1.0;
        }
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)cols, (int)r, 1.0,
                    up, (int)r, down, (int)cols, beta, w, (int)cols);
        float *dst = out + x->head0 * dh * cols;
        int rc = KV_OK;
        for (int64_t i = 0; i < rows * cols && !rc; i++) {
            dst[i] = (float)w[i];
            if (!isfinite(dst[i]))
                rc = kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                             "layer %lld %s unit %lld: dense %s element [%lld%s%lld] is %g%s",
                             (long long)t->layer, side_name(t->kind), (long long)u,
                             is_bias ? "bias" : "weight", (long long)(x->head0 * dh + i / cols),
                             is_bias ? "" : ", ", is_bias ? 0LL : (long long)(i % cols), w[i],
                             isfinite(w[i]) ? " (beyond the f32 range)" : "");
        }
        free(up), free(down), free(w);
        if (rc) return rc;
    }
    return KV_OK;
}

/* Stored tensor of target first into fd: its source bytes (read from in)
 * with every target inside it replaced by its dense product, each element
 * rounded to the stored dtype once. Several targets share a tensor when K
 * and V live in gpt2's c_attn. */
static int write_tensor(const struct job *j, int64_t first, int in, const char *src, int fd,
                        const char *path, const char *tmp, struct kv_err *err) {
    char eb[128];
    const struct target *t0 = &j->t[first];
    const size_t es = kv_dtype_size(t0->dtype);
    const int64_t n = t0->rows * t0->cols; /* the same for every target of a tensor */
    uint8_t *raw = malloc((size_t)t0->nbytes), *cvt = malloc((size_t)n * es);
    float *f = malloc((size_t)n * sizeof *f), *back = malloc((size_t)n * sizeof *back);
    int rc = KV_OK;
    if (!raw || !cvt || !f || !back)
        rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int e = rc ? 0 : pread_all(in, raw, t0->nbytes, t0->off);
    if (e)
        rc = e < 0 ? kv_fail(err, KV_EFORMAT, src, t0->off,
                             "tensor '%s' extends past the end of the file", t0->name)
                   : kv_fail(err, KV_EIO, src, t0->off, "cannot read tensor '%s': %s", t0->name,
                             kv_errtext(e, eb, sizeof eb));
    for (int64_t k = first; k < j->n_t && !rc; k++) {
        const struct target *t = &j->t[k];
        if (t->file != t0->file || t->off != t0->off) continue;
        KV_ASSERT(t->rows * t->cols == n && t->dtype == t0->dtype);
        if ((rc = dense_rows(j, t, f, err))) break;
        kv_convert_from_f32(t->dtype, f, cvt, n);
        kv_convert_to_f32(t->dtype, cvt, back, n);
        for (int64_t i = 0; i < n && !rc; i++)
            if (!isfinite(back[i]))
                rc = kv_fail(err, KV_ENUMERIC, path, t->off,
                             "tensor '%s': dense %s element %lld is %g, beyond the range of %s",
                             t->name, kv_wkind_name(t->kind), (long long)i, (double)f[i],
                             kv_dtype_name(t->dtype));
        for (int64_t i = 0; i < n && !rc; i++)
            memcpy(raw + (size_t)stored_at(t, i) * es, cvt + (size_t)i * es, es);
    }
    if (!rc && (e = pwrite_all(fd, raw, t0->nbytes, t0->off)))
        rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                     kv_errtext(e, eb, sizeof eb));
    free(raw), free(cvt), free(f), free(back);
    return rc;
}

struct fill_ctx {
    const struct job *j;
    int file;
};

/* kv_write_atomic's fill: the source file's bytes, then its patched tensors. */
static int fill_file(int fd, const char *path, const char *tmp, void *vctx, struct kv_err *err) {
    const struct fill_ctx *ctx = vctx;
    const struct job *j = ctx->j;
    const char *src = j->files[ctx->file];
    char eb[128];
    int in = kv_open_regular(src, NULL, err);
    if (in < 0) return KV_EIO;
    uint8_t *buf = malloc(EXPORT_CHUNK);
    int rc = buf ? KV_OK : kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    uint64_t off = 0;
    while (!rc) {
        ssize_t r = read(in, buf, EXPORT_CHUNK);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = kv_fail(err, KV_EIO, src, off, "cannot read: %s", kv_errtext(errno, eb, sizeof eb));
            break;
        }
        if (r == 0) break;
        int e = pwrite_all(fd, buf, (uint64_t)r, off);
        if (e)
            rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                         kv_errtext(e, eb, sizeof eb));
        off += (uint64_t)r;
    }
    free(buf);
    for (int64_t i = 0; i < j->n_t && !rc; i++) {
        const struct target *t = &j->t[i];
        if (t->file != ctx->file) continue;
        int done = 0; /* an earlier target of the same tensor wrote it */
        for (int64_t k = 0; k < i && !done; k++)
            done = j->t[k].file == t->file && j->t[k].off == t->off;
        if (done) continue;
        if (t->off + t->nbytes > off)
            rc = kv_fail(err, KV_EFORMAT, src, t->off,
                         "tensor '%s' extends past the end of the file", t->name);
        else
            rc = write_tensor(j, i, in, src, fd, path, tmp, err);
    }
    close(in);
    return rc;
}

/* A GGUF source whose compressed K/V tensors are block-quantized: the file
 * rewritten with those tensors as F16 (their dense products rounded once),
 * the header's key-value section and every other tensor's bytes copied, the
 * tensor infos and offsets recomputed. */
static int put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
    return 4;
}
static int put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
    return 8;
}

/* The target rewriting GGUF tensor i of f, or NULL when it is copied. */
static const struct target *retyped(const struct job *j, const struct kv_gguf_file *f, int64_t i) {
    for (int64_t k = 0; k < j->n_t; k++)
        if (j->t[k].block_type && j->t[k].off == f->tensors[i].t.offset) return &j->t[k];
    return NULL;
}

static int fill_gguf_retyped(int fd, const char *path, const char *tmp, void *vctx,
                             struct kv_err *err) {
    const struct fill_ctx *ctx = vctx;
    const struct job *j = ctx->j;
    const char *src = j->files[ctx->file];
    struct kv_gguf_file *f;
    int rc = kv_gguf_open(src, &f, err);
    if (rc) return rc;
    char eb[128];
    const uint64_t al = f->alignment;
    /* sizes: the header (key-values kept, infos rewritten), then the data */
    uint64_t kv_end = f->n_tensors ? f->tensors[0].info_off : f->data_off;
    uint64_t hdr = kv_end, data = 0;
    uint64_t *rel = calloc((size_t)(f->n_tensors ? f->n_tensors : 1), sizeof *rel);
    if (!rel) rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < f->n_tensors && !rc; i++) {
        const struct kv_gguf_tensor *t = &f->tensors[i];
        hdr += (t->type_off - t->info_off) + 4 + 8; /* name and dims as stored, type, offset */
        data = (data + al - 1) / al * al;
        rel[i] = data;
        data += retyped(j, f, i) ? (uint64_t)kv_tensor_numel(&t->t) * 2 : t->t.nbytes;
    }
    uint64_t data_off = (hdr + al - 1) / al * al;
    uint8_t *h = rc ? NULL : calloc(1, (size_t)data_off);
    if (!rc && !h) rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    if (!rc) {
        memcpy(h, f->buf, (size_t)kv_end); /* magic, version, counts, key-values */
        uint64_t o = kv_end;
        for (int64_t i = 0; i < f->n_tensors; i++) {
            const struct kv_gguf_tensor *t = &f->tensors[i];
            memcpy(h + o, f->buf + t->info_off, (size_t)(t->type_off - t->info_off));
            o += t->type_off - t->info_off;
            o += (uint64_t)put_u32(h + o, retyped(j, f, i) ? KV_GGML_F16 : t->ggml_type);
            o += (uint64_t)put_u64(h + o, rel[i]);
        }
        int e = pwrite_all(fd, h, data_off, 0);
        if (e) rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp, kv_errtext(e, eb, sizeof eb));
    }
    for (int64_t i = 0; i < f->n_tensors && !rc; i++) {
        const struct kv_gguf_tensor *t = &f->tensors[i];
        const struct target *x = retyped(j, f, i);
        if (!x) {
            int e = pwrite_all(fd, t->t.data, t->t.nbytes, data_off + rel[i]);
            if (e) rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp, kv_errtext(e, eb, sizeof eb));
            continue;
        }
        int64_t n = x->rows * x->cols;
        float *w = malloc((size_t)n * sizeof *w);
        uint16_t *h16 = malloc((size_t)n * sizeof *h16);
        if (!w || !h16) rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        if (!rc) rc = dense_rows(j, x, w, err);
        for (int64_t k = 0; k < n && !rc; k++) {
            h16[k] = kv_f32_to_f16(w[k]);
            if (!isfinite(kv_f16_to_f32(h16[k])))
                rc = kv_fail(err, KV_ENUMERIC, path, x->off,
                             "tensor '%s': dense %s element %lld is %g, beyond the range of F16",
                             x->name, kv_wkind_name(x->kind), (long long)k, (double)w[k]);
        }
        if (!rc) {
            uint8_t *le = (uint8_t *)h16; /* little-endian bytes, as GGUF stores them */
            for (int64_t k = 0; k < n; k++) {
                uint16_t v = h16[k];
                le[2 * k] = (uint8_t)v, le[2 * k + 1] = (uint8_t)(v >> 8);
            }
            int e = pwrite_all(fd, le, (uint64_t)n * 2, data_off + rel[i]);
            if (e) rc = kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp, kv_errtext(e, eb, sizeof eb));
        }
        free(w), free(h16);
    }
    /* the last tensor's padding: the file ends where its data does */
    free(h), free(rel);
    kv_gguf_close(f);
    return rc;
}

/* ================================================================ output */

static void remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char *p = kv_path_join(dir, e->d_name);
            if (p) unlink(p);
            free(p);
        }
        closedir(d);
    }
    rmdir(dir);
}


static int write_dir(const struct job *j, const char *out, struct kv_err *err) {
    char eb[128];
    size_t n = strlen(out);
    while (n > 1 && out[n - 1] == '/') n--; /* "OUT/" names OUT */
    char *dst = strndup(out, n);
    char *tmp = malloc(n + 32);
    if (!dst || !tmp) {
        free(dst), free(tmp);
        return kv_fail(err, KV_ENOMEM, out, KV_NO_OFFSET, "out of memory");
    }
    snprintf(tmp, n + 32, "%s.tmp-%ld", dst, (long)getpid());
    if (mkdir(tmp, 0755) != 0) {
        int rc = kv_fail(err, KV_EIO, out, KV_NO_OFFSET, "cannot create directory '%s': %s", tmp,
                         kv_errtext(errno, eb, sizeof eb));
        free(dst), free(tmp);
        return rc;
    }
    int rc = KV_OK;
    for (int i = 0; i < j->n_files && !rc; i++) {
        char *p = kv_path_join(tmp, j->names[i]);
        if (!p) {
            rc = kv_fail(err, KV_ENOMEM, out, KV_NO_OFFSET, "out of memory");
            break;
        }
        struct fill_ctx ctx = {j, i};
        rc = kv_write_atomic(p, fill_file, &ctx, err); /* also syncs tmp */
        free(p);
    }
    if (!rc && rename(tmp, dst) != 0) {
        if (errno == ENOTEMPTY || errno == EEXIST)
            rc = kv_fail(err, KV_EIO, out, KV_NO_OFFSET,
                         "directory was filled while this run wrote '%s' (another run?); "
                         "refusing to replace it",
                         tmp);
        else
            rc = kv_fail(err, KV_EIO, out, KV_NO_OFFSET, "cannot rename '%s' to it: %s", tmp,
                         kv_errtext(errno, eb, sizeof eb));
    }
    if (rc)
        remove_tree(tmp);
    else
        rc = kv_fsync_parent(dst, err);
    free(dst), free(tmp);
    return rc;
}

/* ================================================================ entry */

static void job_free(struct job *j) {
    for (int i = 0; i < j->n_files; i++) {
        if (j->files) free(j->files[i]);
        if (j->names) free(j->names[i]);
    }
    free(j->files);
    free(j->names);
    free(j->t);
}

int kv_lr_export_dense(const struct kv_model *m, const char *model_path,
                       const struct kv_lowrank *lr, const char *out, struct kv_export_report *rep,
                       struct kv_err *err) {
    KV_ASSERT(m && model_path && lr && out);
    if (rep) memset(rep, 0, sizeof *rep);
    enum kv_format fmt = kv_model_format(m);
    if (fmt == KV_FORMAT_SYNTHETIC)
        return kv_fail(err, KV_EINVAL, model_path, KV_NO_OFFSET,
                       "a synthetic model has no source files to export");
    int rc = check_lowrank(m, lr, err);
    if (rc) return rc;
    int is_dir = kv_path_kind(model_path);
    if (is_dir < 0)
        return kv_fail(err, KV_EIO, model_path, KV_NO_OFFSET, "no such file or directory");
    if (is_dir != (fmt == KV_FORMAT_HF))
        return kv_fail(err, KV_EINVAL, model_path, KV_NO_OFFSET,
                       "is a %s but the model was loaded as %s", is_dir ? "directory" : "file",
                       kv_format_name(fmt));
    if ((rc = kv_output_check(model_path, out, is_dir, err))) return rc;
    if (lr->info.model_fingerprint[0]) {
        char fp[65];
        if ((rc = kv_model_fingerprint(m, fp, err))) return rc;
        if (strcmp(fp, lr->info.model_fingerprint) != 0)
            return kv_fail(err, KV_EINVAL, model_path, KV_NO_OFFSET,
                           "model fingerprint %.12s does not match the factors' %.12s",
                           fp, lr->info.model_fingerprint);
    }

    struct job j = {.m = m, .lr = lr};
    int64_t n_t = count_targets(&j);
    if (!(j.t = calloc(n_t ? (size_t)n_t : 1, sizeof *j.t)))
        return kv_fail(err, KV_ENOMEM, model_path, KV_NO_OFFSET, "out of memory");
    if (is_dir) {
        rc = targets_from_shards(&j, model_path, err);
    } else {
        j.files = calloc(1, sizeof *j.files);
        j.names = calloc(1, sizeof *j.names);
        if (!j.files || !j.names || !(j.files[0] = strdup(model_path)))
            rc = kv_fail(err, KV_ENOMEM, model_path, KV_NO_OFFSET, "out of memory");
        j.n_files = 1;
        if (!rc) rc = targets_from_table(&j, model_path, err);
    }
    if (!rc) KV_ASSERT(j.n_t == n_t);
    if (!rc) rc = verify_sources(&j, err);
    if (!rc) {
        if (is_dir) {
            rc = write_dir(&j, out, err);
        } else {
            struct fill_ctx ctx = {&j, 0};
            int64_t n_retyped = 0;
            for (int64_t i = 0; i < j.n_t; i++) n_retyped += j.t[i].block_type != 0;
            rc = kv_write_atomic(out, n_retyped ? fill_gguf_retyped : fill_file, &ctx, err);
            if (!rc && rep) {
                rep->retyped = n_retyped;
                for (int64_t i = 0; i < j.n_t && !rep->from[0]; i++)
                    if (j.t[i].block_type)
                        snprintf(rep->from, sizeof rep->from, "%s", kv_ggml_type_name(j.t[i].block_type));
            }
        }
    }
    job_free(&j);
    return rc;
}
