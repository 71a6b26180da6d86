/* The weights file of a compressed model directory: lrweights.h. */
#include "lrweights.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "err.h"
#include "hfwrite.h"
#include "lrlayout.h"
#include "lrmodel.h"
#include "safetensors.h"
#include "stwrite.h"

/* ================================================================ write */

/* Buffers the writer borrows until it has written. */
struct owned {
    float **p;
    int64_t n, cap;
};

static float *own(struct owned *o, int64_t n) {
    if (o->n == o->cap) {
        int64_t cap = o->cap ? o->cap * 2 : 16;
        float **q = realloc(o->p, (size_t)cap * sizeof *q);
        if (!q) return NULL;
        o->p = q;
        o->cap = cap;
    }
    float *f = malloc((size_t)(n > 0 ? n : 1) * sizeof *f);
    if (f) o->p[o->n++] = f;
    return f;
}

static void owned_free(struct owned *o) {
    for (int64_t i = 0; i < o->n; i++) free(o->p[i]);
    free(o->p);
}

static int add_f32(struct kv_stw *w, const char *name, const float *data, int64_t rows,
                   int64_t cols, struct kv_err *err) {
    int64_t shape[2] = {rows, cols};
    int nd = cols ? 2 : 1;
    uint64_t n = (uint64_t)rows * (uint64_t)(cols ? cols : 1);
    return kv_stw_add(w, name, KV_DTYPE_F32, nd, shape, data, n * 4, err);
}

static int add_side(struct kv_stw *w, struct owned *own_bufs, const struct kv_model *m,
                    const struct kv_lowrank *lr, int64_t l, int which, const char *path,
                    struct kv_err *err) {
    const struct kv_lr_side *s = kv_lr_side(lr, l, which);
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, dh = c->head_dim;
    char sc = kv_lrl_side_char(which), name[KV_LRL_NAME_CAP];
    int rc = KV_OK;
    if (!kv_lrl_has_down(s->mode)) {
        kv_lrl_attn_name(name, c->arch, l, sc, "_proj.weight");
        if ((rc = kv_hf_add_model_weight(w, m, which ? KV_W_V : KV_W_K, l, name, err))) return rc;
        kv_lrl_attn_name(name, c->arch, l, sc, "_proj.bias");
        if (kv_model_has(m, which ? KV_W_BV : KV_W_BK, l) &&
            (rc = kv_hf_add_model_weight(w, m, which ? KV_W_BV : KV_W_BK, l, name, err)))
            return rc;
        for (int64_t u = 0; u < s->n_units && !rc; u++) {
            kv_lrl_unit_name(name, c->arch, l, which, "rot", u);
            rc = add_f32(w, name, s->units[u].rot, s->units[u].rank, dh, err);
        }
        return rc;
    }
    int64_t r = kv_lrl_side_rank(s);
    float *down = own(own_bufs, r * d);
    float *bias = s->units[0].down_bias ? own(own_bufs, r) : NULL;
    if (!down || (s->units[0].down_bias && !bias))
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int64_t off = 0;
    for (int64_t u = 0; u < s->n_units; u++) {
        const struct kv_lr_unit *x = &s->units[u];
        memcpy(down + off * d, x->down, (size_t)(x->rank * d) * sizeof *down);
        if (bias) memcpy(bias + off, x->down_bias, (size_t)x->rank * sizeof *bias);
        off += x->rank;
    }
    kv_lrl_attn_name(name, c->arch, l, sc, "_down.weight");
    if ((rc = add_f32(w, name, down, r, d, err))) return rc;
    kv_lrl_attn_name(name, c->arch, l, sc, "_down.bias");
    if (bias && (rc = add_f32(w, name, bias, r, 0, err))) return rc;
    for (int64_t u = 0; u < s->n_units && !rc; u++) {
        kv_lrl_unit_name(name, c->arch, l, which, "up", u);
        rc = add_f32(w, name, s->units[u].up, s->units[u].n_heads * dh, s->units[u].rank, err);
    }
    for (int64_t u = 0; u < s->n_units && !rc; u++) {
        if (!s->units[u].up_bias) continue;
        kv_lrl_unit_bias_name(name, c->arch, l, which, u);
        rc = add_f32(w, name, s->units[u].up_bias, s->units[u].n_heads * dh, 0, err);
    }
    return rc;
}

/* Weight kind of m (layer l) as a tensor [rows, cols] (cols 0: a vector);
 * absent optional weights are skipped. */
static int add_weight(struct kv_stw *w, struct owned *bufs, const struct kv_model *m,
                      enum kv_wkind kind, int64_t l, const char *name, struct kv_err *err) {
    if (!kv_model_has(m, kind, l)) return KV_OK;
    return kv_hf_add_model_weight(w, m, kind, l, name, err);
}

/* Every tensor of the file (data borrowed from m, lr and bufs): the globals
 * under their HF names, then each layer's. */
static int add_weights(struct kv_stw *w, struct owned *bufs, const struct kv_model *m,
                       const struct kv_lowrank *lr, const char *path, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim;
    char name[KV_LRL_NAME_CAP];
    int rc = kv_stw_add_meta(w, "format", "pt", err);
    const struct kv_arch_desc *a = kv_arch_desc(c->arch);
    for (int64_t i = 0; i < a->hf.n_globals && !rc; i++) {
        const struct kv_arch_tensor *e = &a->hf.globals[i];
        enum kv_wkind k = e->kinds[0];
        KV_ASSERT(e->n_kinds == 1 && !e->conv);
        if (k == KV_W_LM_HEAD && c->tied_embeddings) continue;
        rc = add_weight(w, bufs, m, k, 0, e->name, err);
    }
    for (int64_t l = 0; l < c->n_layers && !rc; l++) {
        const struct kv_lr_layer *z = &lr->layers[l];
        int fq = z->k.mode == KV_LR_FUSED_QUERY, fo = z->v.mode == KV_LR_FUSED_OUTPUT;
        for (int64_t i = 0; i < a->n_lr_layer && !rc; i++) {
            enum kv_wkind k = a->lr_layer[i].kinds[0];
            const char *rest = a->lr_layer[i].name;
            if (k == KV_W_K) {
                if (!(rc = add_side(w, bufs, m, lr, l, 0, path, err)))
                    rc = add_side(w, bufs, m, lr, l, 1, path, err);
            } else if (k == KV_W_Q && fq) {
                kv_lrl_attn_name(name, c->arch, l, 'q', "_fused.weight");
                rc = add_f32(w, name, z->q_fused, z->q_cols, d, err);
            } else if (k == KV_W_BQ && fq) {
                kv_lrl_attn_name(name, c->arch, l, 'q', "_fused.bias");
                if (z->q_fused_bias) rc = add_f32(w, name, z->q_fused_bias, z->q_cols, 0, err);
            } else if (k == KV_W_O && fo) {
                kv_lrl_layer_name(name, c->arch, l, rest);
                rc = add_f32(w, name, z->o_fused, d, z->o_cols, err);
                kv_lrl_attn_name(name, c->arch, l, 'o', "_fused.bias");
                if (!rc && z->o_fused_bias) rc = add_f32(w, name, z->o_fused_bias, d, 0, err);
            } else {
                kv_lrl_layer_name(name, c->arch, l, rest);
                rc = add_weight(w, bufs, m, k, l, name, err);
            }
        }
    }
    return rc;
}

int kv_lrw_write(const struct kv_model *m, const struct kv_lowrank *lr, const char *path,
                 struct kv_err *err) {
    struct kv_stw *w = NULL;
    struct owned bufs = {0};
    int rc = kv_stw_init(&w, err);
    if (!rc) rc = add_weights(w, &bufs, m, lr, path, err);
    if (!rc) rc = kv_stw_write(w, path, err);
    kv_stw_free(w);
    owned_free(&bufs);
    return rc;
}

/* ================================================================ read */

/* Find name in f, check it has the shape [rows, cols] (cols 0: [rows]) and
 * a float dtype, and, if out, convert it into a new f32 buffer. what says
 * which manifest entry named it. */
static int load_tensor(const struct kv_st_file *f, const char *wpath, const char *name,
                       const char *what, int64_t rows, int64_t cols, float **out,
                       struct kv_err *err) {
    const struct kv_tensor *t = kv_st_find(f, name);
    if (!t)
        return kv_fail(err, KV_EFORMAT, wpath, KV_NO_OFFSET,
                       "missing tensor '%s' (named by " KV_LRL_MANIFEST_NAME " %s)", name, what);
    int64_t want[2] = {rows, cols};
    int nd = cols ? 2 : 1;
    int same = t->ndim == nd;
    for (int i = 0; i < nd && same; i++) same = t->shape[i] == want[i];
    if (!same) {
        char a[96], b[96];
        kv_shape_str(a, sizeof a, t->shape, t->ndim);
        kv_shape_str(b, sizeof b, want, nd);
        return kv_fail(err, KV_EFORMAT, wpath, t->offset,
                       "tensor '%s' has shape %s but " KV_LRL_MANIFEST_NAME " (%s) implies %s",
                       name, a, what, b);
    }
    if (t->dtype != KV_DTYPE_F32 && t->dtype != KV_DTYPE_F16 && t->dtype != KV_DTYPE_BF16)
        return kv_fail(err, KV_EFORMAT, wpath, t->offset,
                       "tensor '%s' has dtype %s, expected F32, F16 or BF16", name,
                       kv_dtype_name(t->dtype));
    if (!out) return KV_OK;
    int64_t n = rows * (cols ? cols : 1);
    float *p = malloc((size_t)n * sizeof *p);
    if (!p) return kv_fail(err, KV_ENOMEM, wpath, KV_NO_OFFSET, "out of memory");
    kv_convert_to_f32(t->dtype, t->data, p, n);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(p[i])) {
            free(p);
            return kv_fail(err, KV_EFORMAT, wpath,
                           t->offset + (uint64_t)i * kv_dtype_size(t->dtype),
                           "tensor '%s' holds a non-finite value at element %lld", name,
                           (long long)i);
        }
    *out = p;
    return KV_OK;
}

/* Slice rows [r0, r0+n) of the [*, cols] matrix src into a new buffer. */
static float *rows_copy(const float *src, int64_t r0, int64_t n, int64_t cols) {
    float *p = malloc((size_t)(n * cols) * sizeof *p);
    if (p) memcpy(p, src + r0 * cols, (size_t)(n * cols) * sizeof *p);
    return p;
}

static int load_side(const struct kv_st_file *f, const char *wpath, const struct kv_mf_names *nm,
                     int64_t l, int which, struct kv_lowrank *lr, struct kv_err *err) {
    struct kv_lr_side *s = kv_lr_side(lr, l, which);
    int64_t d = lr->info.dim, dh = lr->info.head_dim, kvd = lr->info.n_kv_heads * dh;
    char sc = kv_lrl_side_char(which), what[160];
    int rc = KV_OK;
    if (!kv_lrl_has_down(s->mode)) {
        snprintf(what, sizeof what, "layer %lld %c 'proj'", (long long)l, sc);
        if ((rc = load_tensor(f, wpath, nm->proj, what, kvd, d, NULL, err))) return rc;
        for (int64_t u = 0; u < s->n_units && !rc; u++) {
            struct kv_lr_unit *x = &s->units[u];
            snprintf(what, sizeof what, "layer %lld %c unit %lld 'rot', rank %lld", (long long)l,
                     sc, (long long)u, (long long)x->rank);
            rc = load_tensor(f, wpath, nm->unit[u], what, x->rank, dh, &x->rot, err);
        }
        return rc;
    }
    int64_t r = kv_lrl_side_rank(s);
    float *down = NULL, *bias = NULL;
    snprintf(what, sizeof what, "layer %lld %c 'down', rank %lld", (long long)l, sc,
             (long long)r);
    if ((rc = load_tensor(f, wpath, nm->down, what, r, d, &down, err))) return rc;
    snprintf(what, sizeof what, "layer %lld %c 'down_bias', rank %lld", (long long)l, sc,
             (long long)r);
    if (nm->down_bias && (rc = load_tensor(f, wpath, nm->down_bias, what, r, 0, &bias, err))) {
        free(down);
        return rc;
    }
    int64_t off = 0;
    for (int64_t u = 0; u < s->n_units && !rc; u++) {
        struct kv_lr_unit *x = &s->units[u];
        x->down = rows_copy(down, off, x->rank, d);
        if (bias) x->down_bias = rows_copy(bias, off, x->rank, 1);
        if (!x->down || (bias && !x->down_bias)) {
            rc = kv_fail(err, KV_ENOMEM, wpath, KV_NO_OFFSET, "out of memory");
            break;
        }
        off += x->rank;
        snprintf(what, sizeof what, "layer %lld %c unit %lld 'up', rank %lld", (long long)l, sc,
                 (long long)u, (long long)x->rank);
        rc = load_tensor(f, wpath, nm->unit[u], what, x->n_heads * dh, x->rank, &x->up, err);
        snprintf(what, sizeof what, "layer %lld %c unit %lld 'up_bias', heads %lld", (long long)l,
                 sc, (long long)u, (long long)x->n_heads);
        if (!rc && nm->unit_bias && nm->unit_bias[u])
            rc = load_tensor(f, wpath, nm->unit_bias[u], what, x->n_heads * dh, 0, &x->up_bias,
                             err);
    }
    free(down);
    free(bias);
    return rc;
}

static int load_weights(const struct kv_st_file *f, const char *wpath, const struct kv_mf *mf,
                        struct kv_lowrank *lr, struct kv_err *err) {
    int64_t d = lr->info.dim, qd = lr->info.n_heads * lr->info.head_dim;
    int rc = KV_OK;
    for (int64_t l = 0; l < lr->info.n_layers && !rc; l++) {
        const struct kv_mf_names *kn = &mf->names[l][0], *vn = &mf->names[l][1];
        if ((rc = load_side(f, wpath, kn, l, 0, lr, err)) ||
            (rc = load_side(f, wpath, vn, l, 1, lr, err)))
            break;
        struct kv_lr_layer *y = &lr->layers[l];
        char what[96];
        snprintf(what, sizeof what, "layer %lld v 'o_proj'%s", (long long)l,
                 y->v.mode == KV_LR_FUSED_OUTPUT ? ", o_cols" : "");
        if (y->v.mode == KV_LR_FUSED_OUTPUT)
            rc = load_tensor(f, wpath, vn->o_proj, what, d, y->o_cols, &y->o_fused, err);
        else
            rc = load_tensor(f, wpath, vn->o_proj, what, d, qd, NULL, err);
        snprintf(what, sizeof what, "layer %lld v 'o_proj_bias', dim", (long long)l);
        if (!rc && vn->o_proj_bias)
            rc = load_tensor(f, wpath, vn->o_proj_bias, what, d, 0, &y->o_fused_bias, err);
        if (rc || y->k.mode != KV_LR_FUSED_QUERY) continue;
        snprintf(what, sizeof what, "layer %lld k 'q_proj', q_cols", (long long)l);
        rc = load_tensor(f, wpath, kn->q_proj, what, y->q_cols, d, &y->q_fused, err);
        snprintf(what, sizeof what, "layer %lld k 'q_proj_bias', q_cols", (long long)l);
        if (!rc && kn->q_proj_bias)
            rc = load_tensor(f, wpath, kn->q_proj_bias, what, y->q_cols, 0, &y->q_fused_bias,
                             err);
    }
    return rc;
}

int kv_lrw_read(const char *path, const struct kv_mf *mf, struct kv_lowrank *lr,
                struct kv_err *err) {
    struct kv_st_file *f = NULL;
    int rc = kv_st_open(path, &f, err);
    if (!rc) rc = load_weights(f, path, mf, lr, err);
    kv_st_close(f);
    return rc;
}
