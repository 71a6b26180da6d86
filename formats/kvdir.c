/* The compressed-model output directory: layout in kvdir.h. */
#include "kvdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "hfdir.h"
#include "json.h"
#include "limits.h"
#include "lrmodel.h"
#include "mapfile.h"
#include "model.h"
#include "safetensors.h"
#include "stwrite.h"

#define MANIFEST_NAME "kvcal.json"
#define WEIGHTS_NAME "model.safetensors"
#define MANIFEST_FORMAT "kvcal.manifest"
#define MANIFEST_VERSION 1
#define WEIGHT_LAYOUT "linear [out, in]" /* every matrix of the weights file */
#define TNAME_CAP (KV_MAX_NAME_LEN + 1)

/* Files of an HF source directory that the output keeps, untouched. */
static const char *const hf_copied[] = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json",
};

static const char side_char[2] = {'k', 'v'};

static struct kv_lr_side *side_of(const struct kv_lowrank *lr, int64_t l, int which) {
    return which ? &lr->layers[l].v : &lr->layers[l].k;
}

/* The attention module's name inside a layer. */
static const char *attn_module(enum kv_arch arch) {
    return arch == KV_ARCH_GPT2 ? "attn." : "self_attn.";
}

/* "<layer prefix>L.<rest>": model.layers.L. (llama), transformer.h.L. (gpt2) */
static void layer_name(char *buf, enum kv_arch arch, int64_t l, const char *rest) {
    snprintf(buf, TNAME_CAP, "%s%lld.%s", kv_hf_layer_prefix(arch), (long long)l, rest);
}

/* "<layer prefix>L.<attn module><c><rest>", c one of q, k, v, o */
static void attn_name(char *buf, enum kv_arch arch, int64_t l, char c, const char *rest) {
    snprintf(buf, TNAME_CAP, "%s%lld.%s%c%s", kv_hf_layer_prefix(arch), (long long)l,
             attn_module(arch), c, rest);
}

static void unit_name(char *buf, enum kv_arch arch, int64_t l, int which, const char *kind,
                      int64_t u) {
    snprintf(buf, TNAME_CAP, "%s%lld.%s%c_%s.%lld.weight", kv_hf_layer_prefix(arch),
             (long long)l, attn_module(arch), side_char[which], kind, (long long)u);
}

/* Whether a layer's keys pass through RoPE between projection and score. */
static int has_rope(enum kv_arch arch) { return arch != KV_ARCH_GPT2; }

/* dropped/energy, 0 when there is no energy. */
static double rel_error(double dropped, double energy) {
    return energy > 0 ? dropped / energy : 0.0;
}

/* Prefix err's message with ctx ("layer 3 k unit 1"); returns rc. */
static int in_ctx(int rc, struct kv_err *err, const char *ctx) {
    size_t a = ctx ? strlen(ctx) : 0, cap = sizeof err->msg;
    if (rc && a && a + 3 < cap) {
        size_t n = strlen(err->msg);
        if (a + 2 + n >= cap) n = cap - 1 - a - 2;
        memmove(err->msg + a + 2, err->msg, n);
        memcpy(err->msg, ctx, a);
        err->msg[a] = ':', err->msg[a + 1] = ' ', err->msg[a + 2 + n] = 0;
    }
    return rc;
}

/* ================================================================ checks */

static int mode_allowed(enum kv_lr_mode mode, int which) {
    if (which == 0)
        return mode == KV_LR_FULL || mode == KV_LR_PREROPE_LATENT || mode == KV_LR_FUSED_QUERY ||
               mode == KV_LR_POSTROPE_ROTATION;
    return mode == KV_LR_FULL || mode == KV_LR_FUSED_OUTPUT;
}

/* Modes that cache z = x downᵀ + down_bias and carry up. */
static int has_down(enum kv_lr_mode mode) {
    return mode == KV_LR_PREROPE_LATENT || mode == KV_LR_FUSED_QUERY ||
           mode == KV_LR_FUSED_OUTPUT;
}

/* Σ rank over the units of a side. */
static int64_t side_rank(const struct kv_lr_side *s) {
    int64_t r = 0;
    for (int64_t u = 0; u < s->n_units; u++) r += s->units[u].rank;
    return r;
}

/* Columns of the fused output projection (rows of the fused query one): Σ
 * over query heads i of the rank of the unit holding i's KV head. The side
 * must have passed check_side. */
static int64_t fused_cols(const struct kv_lowrank *lr, const struct kv_lr_side *s) {
    int64_t per = lr->n_heads / lr->n_kv_heads, cols = 0;
    for (int64_t u = 0; u < s->n_units; u++) cols += s->units[u].rank * s->units[u].n_heads * per;
    return cols;
}

/* One layer side against lr's shapes: a mode this side can hold, units that
 * cover the KV heads in order with each exactly once, ranks in 1..s*d_h,
 * finite non-negative energies, and with factors set, the factor pointers
 * the mode needs (down_bias on all units or none). code is the status of a
 * violation (KV_EINVAL for a caller's struct, KV_EFORMAT for a file). */
static int check_side(const struct kv_lowrank *lr, int64_t l, int which, int factors, int code,
                      const char *path, struct kv_err *err) {
    const struct kv_lr_side *s = side_of(lr, l, which);
    int64_t g = lr->n_kv_heads, dh = lr->head_dim;
    char ctx[64];
    snprintf(ctx, sizeof ctx, "layer %lld %c", (long long)l, side_char[which]);
    if (!mode_allowed(s->mode, which))
        return kv_fail(err, code, path, KV_NO_OFFSET, "%s: mode '%s' is not one for %s", ctx,
                       kv_lr_mode_name(s->mode), which ? "values" : "keys");
    if (s->mode == KV_LR_FULL) {
        if (s->n_units != 0)
            return kv_fail(err, code, path, KV_NO_OFFSET,
                           "%s: mode 'full' has %lld units, expected none", ctx,
                           (long long)s->n_units);
        return KV_OK;
    }
    if (s->n_units < 1 || !s->units)
        return kv_fail(err, code, path, KV_NO_OFFSET, "%s: mode '%s' has no units", ctx,
                       kv_lr_mode_name(s->mode));
    int64_t next = 0;
    int biased = s->units[0].down_bias != NULL;
    for (int64_t u = 0; u < s->n_units; u++) {
        const struct kv_lr_unit *x = &s->units[u];
        long long a = (long long)x->head0, b = (long long)(x->head0 + x->n_heads - 1);
        if (x->n_heads < 1 || x->head0 < 0 || x->head0 + x->n_heads > g)
            return kv_fail(err, code, path, KV_NO_OFFSET,
                           "%s unit %lld: kv heads %lld..%lld are not within 0..%lld", ctx,
                           (long long)u, a, b, (long long)(g - 1));
        if (x->head0 < next)
            return kv_fail(err, code, path, KV_NO_OFFSET,
                           "%s unit %lld: kv heads %lld..%lld overlap the previous unit's, "
                           "expected the next unit to start at kv head %lld",
                           ctx, (long long)u, a, b, (long long)next);
        if (x->head0 > next)
            return kv_fail(err, code, path, KV_NO_OFFSET,
                           "%s unit %lld: starts at kv head %lld, so kv head %lld is in no unit",
                           ctx, (long long)u, a, (long long)next);
        if (s->mode == KV_LR_POSTROPE_ROTATION && x->n_heads != 1)
            return kv_fail(err, code, path, KV_NO_OFFSET,
                           "%s unit %lld: a postrope_rotation unit holds one kv head, found %lld",
                           ctx, (long long)u, (long long)x->n_heads);
        if (x->rank < 1 || x->rank > x->n_heads * dh)
            return kv_fail(err, code, path, KV_NO_OFFSET,
                           "%s unit %lld: rank %lld is not within 1..%lld", ctx, (long long)u,
                           (long long)x->rank, (long long)(x->n_heads * dh));
        if (!isfinite(x->energy) || !isfinite(x->dropped) || x->energy < 0 || x->dropped < 0)
            return kv_fail(err, code, path, KV_NO_OFFSET,
                           "%s unit %lld: energy %g and dropped %g must be finite and "
                           "non-negative",
                           ctx, (long long)u, x->energy, x->dropped);
        if (factors) {
            int ok = s->mode == KV_LR_POSTROPE_ROTATION ? x->rot != NULL
                                                         : x->down != NULL && x->up != NULL;
            if (!ok)
                return kv_fail(err, code, path, KV_NO_OFFSET,
                               "%s unit %lld: mode '%s' needs %s, found NULL", ctx, (long long)u,
                               kv_lr_mode_name(s->mode),
                               s->mode == KV_LR_POSTROPE_ROTATION ? "rot" : "down and up");
            if (has_down(s->mode) && (x->down_bias != NULL) != biased)
                return kv_fail(err, code, path, KV_NO_OFFSET,
                               "%s unit %lld: down_bias is %s but unit 0's is %s, expected all "
                               "units or none to have one",
                               ctx, (long long)u, x->down_bias ? "set" : "NULL",
                               biased ? "set" : "NULL");
        }
        next = x->head0 + x->n_heads;
    }
    if (next != g)
        return kv_fail(err, code, path, KV_NO_OFFSET, "%s: kv heads %lld..%lld are in no unit",
                       ctx, (long long)next, (long long)(g - 1));
    return KV_OK;
}

static int valid_bits(int64_t bits) {
    return bits == 16 || bits == 8 || bits == 4 || bits == 3 || bits == 2;
}

/* A fused_query key side needs a model without rope (up folds into the
 * query only when nothing acts between projection and score). */
static int check_fused_query_arch(enum kv_arch arch, int64_t l, int code, const char *path,
                                  struct kv_err *err) {
    if (!has_rope(arch)) return KV_OK;
    return kv_fail(err, code, path, KV_NO_OFFSET,
                   "layer %lld k: mode 'fused_query' needs a model without rope, found arch '%s'",
                   (long long)l, kv_arch_name(arch));
}

/* The whole of lr against model m, as kv_lr_dir_write needs it. */
static int check_lowrank(const struct kv_lowrank *lr, const struct kv_model *m, const char *dir,
                         struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    if (!kv_shapes_match(c, lr->n_layers, lr->dim, lr->n_heads, lr->n_kv_heads, lr->head_dim,
                         "factors", dir, err))
        return KV_EINVAL;
    if (!valid_bits(lr->kv_bits))
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "latent bits %d is not one of 16, 8, 4, 3, 2", lr->kv_bits);
    if (!lr->layers) return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET, "factors have no layers");
    for (int64_t l = 0; l < lr->n_layers; l++) {
        int rc;
        if ((rc = check_side(lr, l, 0, 1, KV_EINVAL, dir, err)) ||
            (rc = check_side(lr, l, 1, 1, KV_EINVAL, dir, err)))
            return rc;
        const struct kv_lr_layer *y = &lr->layers[l];
        if (y->v.mode == KV_LR_FUSED_OUTPUT) {
            int64_t want = fused_cols(lr, &y->v);
            if (!y->o_fused || y->o_cols != want)
                return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                               "layer %lld v: fused output projection is %s with %lld columns, "
                               "expected %lld",
                               (long long)l, y->o_fused ? "set" : "NULL", (long long)y->o_cols,
                               (long long)want);
        } else if (y->o_fused) {
            return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                           "layer %lld v: a fused output projection is set but the mode is '%s'",
                           (long long)l, kv_lr_mode_name(y->v.mode));
        }
        if (y->k.mode == KV_LR_FUSED_QUERY) {
            if ((rc = check_fused_query_arch(c->arch, l, KV_EINVAL, dir, err))) return rc;
            int64_t want = fused_cols(lr, &y->k);
            if (!y->q_fused || y->q_cols != want)
                return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                               "layer %lld k: fused query projection is %s with %lld rows, "
                               "expected %lld",
                               (long long)l, y->q_fused ? "set" : "NULL", (long long)y->q_cols,
                               (long long)want);
            int qb = kv_model_weight(m, KV_W_BQ, l) != NULL;
            if ((y->q_fused_bias != NULL) != qb)
                return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                               "layer %lld k: fused query bias is %s but the model has %s",
                               (long long)l, y->q_fused_bias ? "set" : "NULL",
                               qb ? "a q bias" : "no q bias");
        } else if (y->q_fused || y->q_fused_bias) {
            return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                           "layer %lld k: a fused query projection is set but the mode is '%s'",
                           (long long)l, kv_lr_mode_name(y->k.mode));
        }
    }
    return KV_OK;
}

/* ================================================================ manifest: write */

/* json_t builders that remember the first allocation failure. */
struct jb {
    int bad;
};

static json_t *jset(struct jb *b, json_t *o, const char *key, json_t *v) {
    if (!o || !v || json_object_set_new(o, key, v) != 0) b->bad = 1;
    return v;
}

static void jappend(struct jb *b, json_t *a, json_t *v) {
    if (!a || !v || json_array_append_new(a, v) != 0) b->bad = 1;
}

/* A JSON number holding the shortest decimal that reads back as f, so
 * 1e-05f is written as 1e-05 rather than as the double nearest the float. */
static json_t *json_float(float f) {
    char buf[32];
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, (double)f);
        if (strtof(buf, NULL) == f) break;
    }
    return json_real(strtod(buf, NULL));
}

/* A JSON string of s; bytes of a path that are not UTF-8 become '?'. */
static json_t *json_text(const char *s) {
    if (!s) return json_null();
    json_t *v = json_string(s);
    if (v) return v;
    char *c = strdup(s);
    if (!c) return NULL;
    for (char *p = c; *p; p++)
        if ((unsigned char)*p >= 0x80) *p = '?';
    v = json_string(c);
    free(c);
    return v;
}

static json_t *name_or_null(const char *name) {
    return name ? json_string(name) : json_null();
}

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static json_t *side_json(struct jb *b, const struct kv_model *m, const struct kv_lowrank *lr,
                         int64_t l, int which) {
    const struct kv_lr_side *s = side_of(lr, l, which);
    const struct kv_lr_layer *y = &lr->layers[l];
    enum kv_arch arch = m->cfg.arch;
    char c = side_char[which], name[TNAME_CAP];
    json_t *o = json_object();
    double en = 0, dr = 0;
    for (int64_t u = 0; u < s->n_units; u++) en += s->units[u].energy, dr += s->units[u].dropped;
    jset(b, o, "mode", json_string(kv_lr_mode_name(s->mode)));
    jset(b, o, "rank", json_integer(side_rank(s)));
    jset(b, o, "predicted_error", json_real(rel_error(dr, en)));
    int down = has_down(s->mode), proj = !down;
    attn_name(name, arch, l, c, "_down.weight");
    jset(b, o, "down", name_or_null(down ? name : NULL));
    attn_name(name, arch, l, c, "_down.bias");
    jset(b, o, "down_bias", name_or_null(down && s->units[0].down_bias ? name : NULL));
    attn_name(name, arch, l, c, "_proj.weight");
    jset(b, o, "proj", name_or_null(proj ? name : NULL));
    attn_name(name, arch, l, c, "_proj.bias");
    const float *bias = kv_model_weight(m, which ? KV_W_BV : KV_W_BK, l);
    jset(b, o, "proj_bias", name_or_null(proj && bias ? name : NULL));
    json_t *units = jset(b, o, "units", json_array());
    int64_t off = 0;
    for (int64_t u = 0; u < s->n_units; u++) {
        const struct kv_lr_unit *x = &s->units[u];
        json_t *uo = json_object(), *heads = json_array();
        for (int64_t j = 0; j < x->n_heads; j++) jappend(b, heads, json_integer(x->head0 + j));
        jset(b, uo, "heads", heads);
        jset(b, uo, "rank", json_integer(x->rank));
        jset(b, uo, "latent_offset", json_integer(off));
        unit_name(name, arch, l, which, "up", u);
        jset(b, uo, "up", name_or_null(down ? name : NULL));
        unit_name(name, arch, l, which, "rot", u);
        jset(b, uo, "rot", name_or_null(s->mode == KV_LR_POSTROPE_ROTATION ? name : NULL));
        jset(b, uo, "energy", json_real(x->energy));
        jset(b, uo, "dropped", json_real(x->dropped));
        jset(b, uo, "predicted_error", json_real(rel_error(x->dropped, x->energy)));
        jappend(b, units, uo);
        off += x->rank;
    }
    if (which) {
        attn_name(name, arch, l, 'o', "_proj.weight");
        jset(b, o, "o_proj", json_string(name));
        if (s->mode == KV_LR_FUSED_OUTPUT) jset(b, o, "o_cols", json_integer(y->o_cols));
    } else if (s->mode == KV_LR_FUSED_QUERY) {
        attn_name(name, arch, l, 'q', "_fused.weight");
        jset(b, o, "q_proj", json_string(name));
        attn_name(name, arch, l, 'q', "_fused.bias");
        jset(b, o, "q_proj_bias", name_or_null(y->q_fused_bias ? name : NULL));
        jset(b, o, "q_cols", json_integer(y->q_cols));
    }
    return o;
}

/* Parse caller-supplied JSON text for "options" / "stats". */
static int parse_arg_json(const char *text, const char *what, int allow_null, const char *dir,
                          json_t **out, struct kv_err *err) {
    if (!text) {
        *out = allow_null ? json_null() : json_object();
        if (!*out) return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
        return KV_OK;
    }
    json_error_t je;
    json_t *v = json_loads(text, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!v) {
        char t[sizeof je.text];
        kv_json_error_text(&je, t, sizeof t);
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET, "%s text is not valid json: %s", what,
                       t);
    }
    if (!json_is_object(v) && !(allow_null && json_is_null(v))) {
        json_decref(v);
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET, "%s must be a json object%s", what,
                       allow_null ? " or null" : "");
    }
    *out = v;
    return KV_OK;
}

static json_t *quant_json(struct jb *b, int bits) {
    if (bits >= 16) return json_null();
    json_t *q = json_object();
    jset(b, q, "scheme", json_string("per-token asymmetric"));
    jset(b, q, "group", json_string("unit"));
    jset(b, q, "scale_dtype", json_string("f16"));
    jset(b, q, "zero_dtype", json_string("f16"));
    jset(b, q, "dequant", json_string("z = q * scale + zero"));
    return q;
}

/* The manifest; options and stats are stolen. tok_name is the copied
 * tokenizer's file name or NULL. */
static json_t *build_manifest(const struct kv_model *m, const struct kv_lowrank *lr,
                              const char *fp, const struct kv_lr_dir_info *info, json_t *options,
                              json_t *stats, const char *tok_name) {
    struct jb b = {0};
    const struct kv_config *c = &m->cfg;
    json_t *root = json_object();
    jset(&b, root, "format", json_string(MANIFEST_FORMAT));
    jset(&b, root, "version", json_integer(MANIFEST_VERSION));
    jset(&b, root, "kvcal_version", json_string(KVCAL_VERSION));
    jset(&b, root, "method", json_text(lr->method));
    jset(&b, root, "alloc", json_text(lr->alloc));
    jset(&b, root, "options", options);

    json_t *mo = jset(&b, root, "model", json_object());
    jset(&b, mo, "fingerprint", json_string(fp));
    jset(&b, mo, "source", json_text(info->model_path));
    jset(&b, mo, "format",
         json_string(m->format == KV_FORMAT_HF ? "hf" : kv_format_name(m->format)));
    jset(&b, mo, "arch", json_string(kv_arch_name(c->arch)));
    jset(&b, mo, "dim", json_integer(c->dim));
    jset(&b, mo, "hidden_dim", json_integer(c->hidden_dim));
    jset(&b, mo, "n_layers", json_integer(c->n_layers));
    jset(&b, mo, "n_heads", json_integer(c->n_heads));
    jset(&b, mo, "n_kv_heads", json_integer(c->n_kv_heads));
    jset(&b, mo, "head_dim", json_integer(c->head_dim));
    jset(&b, mo, "vocab_size", json_integer(c->vocab_size));
    jset(&b, mo, "norm_eps", json_float(c->norm_eps));
    jset(&b, mo, "tied_embeddings", json_boolean(c->tied_embeddings));
    jset(&b, mo, "qkv_bias", json_boolean(c->has_qkv_bias));
    jset(&b, mo, "max_seq_len", json_integer(c->max_seq_len));
    jset(&b, mo, "bos_id", json_integer(c->bos_id));
    jset(&b, mo, "eos_id", json_integer(c->eos_id));
    jset(&b, mo, "tokenizer", json_text(tok_name));

    jset(&b, root, "stats", stats);
    if (has_rope(c->arch)) {
        json_t *ro = jset(&b, root, "rope", json_object());
        int half = c->rope_layout == KV_ROPE_HALF;
        jset(&b, ro, "layout", json_string(half ? "half" : "interleaved"));
        jset(&b, ro, "pairs", json_string(half ? "(i, i + d_h/2)" : "(2i, 2i+1)"));
        jset(&b, ro, "theta", json_float(c->rope_theta));
        jset(&b, ro, "scaling", json_null());
    } else {
        jset(&b, root, "rope", json_null());
    }

    json_t *lo = jset(&b, root, "latent", json_object());
    jset(&b, lo, "dtype", json_string(lr->kv_bits >= 16 ? "f16" : "int"));
    jset(&b, lo, "bits", json_integer(lr->kv_bits));
    jset(&b, lo, "quantization", quant_json(&b, lr->kv_bits));
    jset(&b, lo, "hadamard", json_boolean(lr->hadamard));
    jset(&b, root, "weights", json_string(WEIGHTS_NAME));
    jset(&b, root, "weight_layout", json_string(WEIGHT_LAYOUT));

    int64_t base = kv_lr_base_bytes(c), comp = kv_lr_bytes(lr, lr->kv_bits);
    json_t *bo = jset(&b, root, "kv_bytes_per_token", json_object());
    jset(&b, bo, "base", json_integer(base));
    jset(&b, bo, "compressed", json_integer(comp));
    jset(&b, bo, "ratio", json_real((double)comp / (double)base));

    double en[2] = {0, 0}, dr[2] = {0, 0};
    for (int64_t l = 0; l < lr->n_layers; l++)
        for (int w = 0; w < 2; w++) {
            const struct kv_lr_side *s = side_of(lr, l, w);
            for (int64_t u = 0; u < s->n_units; u++)
                en[w] += s->units[u].energy, dr[w] += s->units[u].dropped;
        }
    json_t *po = jset(&b, root, "predicted_error", json_object());
    jset(&b, po, "k", json_real(rel_error(dr[0], en[0])));
    jset(&b, po, "v", json_real(rel_error(dr[1], en[1])));

    json_t *layers = jset(&b, root, "layers", json_array());
    for (int64_t l = 0; l < lr->n_layers && !b.bad; l++) {
        json_t *yo = json_object();
        jset(&b, yo, "index", json_integer(l));
        jset(&b, yo, "k", side_json(&b, m, lr, l, 0));
        jset(&b, yo, "v", side_json(&b, m, lr, l, 1));
        jappend(&b, layers, yo);
    }
    if (b.bad) {
        json_decref(root);
        return NULL;
    }
    return root;
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
        if (!strcmp(e->d_name, MANIFEST_NAME)) manifest = 1;
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
                       "directory is not empty and holds no " MANIFEST_NAME
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

/* Unlink every entry of dir (no subdirectories) and, if rmdir_too, dir. */
static int remove_files(const char *dir, int rmdir_too, struct kv_err *err) {
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

/* ================================================================ weights: write */

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
                    const struct kv_lowrank *lr, int64_t l, int which, const char *dir,
                    struct kv_err *err) {
    const struct kv_lr_side *s = side_of(lr, l, which);
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, dh = c->head_dim, kvd = c->n_kv_heads * dh;
    char sc = side_char[which], name[TNAME_CAP];
    int rc = KV_OK;
    if (!has_down(s->mode)) {
        const float *wt = kv_model_weight(m, which ? KV_W_V : KV_W_K, l);
        const float *bias = kv_model_weight(m, which ? KV_W_BV : KV_W_BK, l);
        attn_name(name, c->arch, l, sc, "_proj.weight");
        if ((rc = add_f32(w, name, wt, kvd, d, err))) return rc;
        attn_name(name, c->arch, l, sc, "_proj.bias");
        if (bias && (rc = add_f32(w, name, bias, kvd, 0, err))) return rc;
        for (int64_t u = 0; u < s->n_units && !rc; u++) {
            unit_name(name, c->arch, l, which, "rot", u);
            rc = add_f32(w, name, s->units[u].rot, s->units[u].rank, dh, err);
        }
        return rc;
    }
    int64_t r = side_rank(s);
    float *down = own(own_bufs, r * d);
    float *bias = s->units[0].down_bias ? own(own_bufs, r) : NULL;
    if (!down || (s->units[0].down_bias && !bias))
        return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    int64_t off = 0;
    for (int64_t u = 0; u < s->n_units; u++) {
        const struct kv_lr_unit *x = &s->units[u];
        memcpy(down + off * d, x->down, (size_t)(x->rank * d) * sizeof *down);
        if (bias) memcpy(bias + off, x->down_bias, (size_t)x->rank * sizeof *bias);
        off += x->rank;
    }
    attn_name(name, c->arch, l, sc, "_down.weight");
    if ((rc = add_f32(w, name, down, r, d, err))) return rc;
    attn_name(name, c->arch, l, sc, "_down.bias");
    if (bias && (rc = add_f32(w, name, bias, r, 0, err))) return rc;
    for (int64_t u = 0; u < s->n_units && !rc; u++) {
        unit_name(name, c->arch, l, which, "up", u);
        rc = add_f32(w, name, s->units[u].up, s->units[u].n_heads * dh, s->units[u].rank, err);
    }
    return rc;
}

/* The per-layer tensors besides K and V, in file order: kvcal's kind and
 * its name after the layer prefix for llama and for gpt2 (NULL where the
 * architecture has no such tensor). KV_W_K stands for both K/V sides. */
static const struct {
    enum kv_wkind kind;
    const char *llama, *gpt2;
} layer_tensors[] = {
    {KV_W_ATTN_NORM, "input_layernorm.weight", "ln_1.weight"},
    {KV_W_ATTN_NORM_B, NULL, "ln_1.bias"},
    {KV_W_Q, "self_attn.q_proj.weight", "attn.q_proj.weight"},
    {KV_W_BQ, "self_attn.q_proj.bias", "attn.q_proj.bias"},
    {KV_W_K, NULL, NULL},
    {KV_W_O, "self_attn.o_proj.weight", "attn.o_proj.weight"},
    {KV_W_BO, NULL, "attn.o_proj.bias"},
    {KV_W_FFN_NORM, "post_attention_layernorm.weight", "ln_2.weight"},
    {KV_W_FFN_NORM_B, NULL, "ln_2.bias"},
    {KV_W_GATE, "mlp.gate_proj.weight", NULL},
    {KV_W_UP, "mlp.up_proj.weight", "mlp.c_fc.weight"},
    {KV_W_BUP, NULL, "mlp.c_fc.bias"},
    {KV_W_DOWN, "mlp.down_proj.weight", "mlp.c_proj.weight"},
    {KV_W_BDOWN, NULL, "mlp.c_proj.bias"},
};

/* Weight kind of m (layer l) as a tensor [rows, cols] (cols 0: a vector);
 * absent optional weights are skipped. */
static int add_weight(struct kv_stw *w, const struct kv_model *m, enum kv_wkind kind, int64_t l,
                      const char *name, struct kv_err *err) {
    const float *data = kv_model_weight(m, kind, l);
    if (!data) return KV_OK;
    int64_t shape[2];
    int nd = kv_model_expected_shape(&m->cfg, kind, shape);
    return add_f32(w, name, data, shape[0], nd == 2 ? shape[1] : 0, err);
}

/* Every tensor of model.safetensors (data borrowed from m, lr and bufs):
 * the globals under their HF names, then each layer's. */
static int add_weights(struct kv_stw *w, struct owned *bufs, const struct kv_model *m,
                       const struct kv_lowrank *lr, const char *dir, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    int64_t d = c->dim, n_glob = 0;
    char name[TNAME_CAP];
    int rc = kv_stw_add_meta(w, "format", "pt", err);
    const struct kv_hf_name *glob = kv_hf_names(c->arch, 0, &n_glob);
    for (int64_t i = 0; i < n_glob && !rc; i++) {
        enum kv_wkind k = glob[i].kinds[0];
        KV_ASSERT(glob[i].n_kinds == 1 && !glob[i].conv);
        if (k == KV_W_LM_HEAD && c->tied_embeddings) continue;
        rc = add_weight(w, m, k, 0, glob[i].name, err);
    }
    for (int64_t l = 0; l < c->n_layers && !rc; l++) {
        const struct kv_lr_layer *z = &lr->layers[l];
        int fq = z->k.mode == KV_LR_FUSED_QUERY, fo = z->v.mode == KV_LR_FUSED_OUTPUT;
        for (size_t i = 0; i < sizeof layer_tensors / sizeof layer_tensors[0] && !rc; i++) {
            enum kv_wkind k = layer_tensors[i].kind;
            const char *rest = c->arch == KV_ARCH_GPT2 ? layer_tensors[i].gpt2
                                                       : layer_tensors[i].llama;
            if (k == KV_W_K) {
                if (!(rc = add_side(w, bufs, m, lr, l, 0, dir, err)))
                    rc = add_side(w, bufs, m, lr, l, 1, dir, err);
            } else if (!rest) {
                continue;
            } else if (k == KV_W_Q && fq) {
                attn_name(name, c->arch, l, 'q', "_fused.weight");
                rc = add_f32(w, name, z->q_fused, z->q_cols, d, err);
            } else if (k == KV_W_BQ && fq) {
                attn_name(name, c->arch, l, 'q', "_fused.bias");
                if (z->q_fused_bias) rc = add_f32(w, name, z->q_fused_bias, z->q_cols, 0, err);
            } else if (k == KV_W_O && fo) {
                layer_name(name, c->arch, l, rest);
                rc = add_f32(w, name, z->o_fused, d, z->o_cols, err);
            } else {
                layer_name(name, c->arch, l, rest);
                rc = add_weight(w, m, k, l, name, err);
            }
        }
    }
    return rc;
}

/* ================================================================ write */

/* Fill the temporary directory tmp. */
static int write_contents(const struct kv_model *m, const struct kv_lowrank *lr,
                          const struct kv_lr_dir_info *info, const char *fp, const char *tmp,
                          struct kv_err *err) {
    json_t *options = NULL, *stats = NULL;
    int rc = parse_arg_json(info->options_json, "options", 0, tmp, &options, err);
    if (!rc) rc = parse_arg_json(info->stats_json, "stats", 1, tmp, &stats, err);
    if (rc) {
        json_decref(options);
        return rc;
    }

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
        if (!bn[0] || !strcmp(bn, ".") || !strcmp(bn, "..") || !strcmp(bn, MANIFEST_NAME) ||
            !strcmp(bn, WEIGHTS_NAME)) {
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
        json_decref(options);
        json_decref(stats);
        return rc;
    }

    /* weights */
    char *wpath = kv_path_join(tmp, WEIGHTS_NAME), *mpath = kv_path_join(tmp, MANIFEST_NAME);
    struct kv_stw *w = NULL;
    struct owned bufs = {0};
    if (!wpath || !mpath) rc = kv_fail(err, KV_ENOMEM, tmp, KV_NO_OFFSET, "out of memory");
    if (!rc) rc = kv_stw_init(&w, err);
    if (!rc) rc = add_weights(w, &bufs, m, lr, wpath, err);
    if (!rc) rc = kv_stw_write(w, wpath, err);
    kv_stw_free(w);
    owned_free(&bufs);

    /* manifest (takes options and stats) */
    json_t *root = NULL;
    if (!rc) {
        root = build_manifest(m, lr, fp, info, options, stats, tok_name);
        options = stats = NULL;
        if (!root) rc = kv_fail(err, KV_ENOMEM, mpath, KV_NO_OFFSET, "out of memory");
    }
    char *text = NULL;
    if (!rc && !(text = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(17))))
        rc = kv_fail(err, KV_ENOMEM, mpath, KV_NO_OFFSET, "out of memory");
    if (!rc) {
        size_t n = strlen(text);
        char *t2 = realloc(text, n + 2);
        if (!t2) {
            rc = kv_fail(err, KV_ENOMEM, mpath, KV_NO_OFFSET, "out of memory");
        } else {
            text = t2;
            memcpy(text + n, "\n", 2);
            rc = kv_write_atomic(mpath, fill_text, text, err);
        }
    }
    free(text);
    json_decref(root);
    json_decref(options);
    json_decref(stats);
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
    int rc = check_lowrank(lr, m, dir, err);
    if (rc) return rc;
    char fp[65];
    if ((rc = kv_model_fingerprint(m, fp, err))) return rc;
    if (lr->model_fingerprint[0] && strcmp(lr->model_fingerprint, fp) != 0)
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "factors were made from model %.12s but this model is %.12s",
                       lr->model_fingerprint, fp);

    char *out = trim_dir(dir), *parent = out ? kv_path_dir(out) : NULL;
    size_t n = out ? strlen(out) + 32 : 0;
    char *tmp = out ? malloc(n) : NULL;
    if (!out || !parent || !tmp) {
        free(out), free(parent), free(tmp);
        return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    }
    snprintf(tmp, n, "%s.tmp-%ld", out, (long)getpid());

    /* refuse early, before writing anything */
    enum target t;
    if ((rc = classify_target(out, NULL, &t, err))) goto done;
    if (mkdir(tmp, 0755) != 0) {
        rc = kv_fail(err, KV_EIO, tmp, KV_NO_OFFSET, "cannot create directory: %s",
                     kv_errtext(errno, eb, sizeof eb));
        goto done;
    }
    rc = write_contents(m, lr, info, fp, tmp, err);
    if (!rc) rc = kv_fsync_dir(tmp, tmp, err);
    /* look again: the directory may have changed while the weights were written */
    if (!rc) rc = classify_target(out, NULL, &t, err);
    if (!rc && t == T_EARLIER) rc = remove_files(out, 0, err);
    if (!rc && rename(tmp, out) != 0)
        rc = kv_fail(err, KV_EIO, out, KV_NO_OFFSET, "cannot rename '%s' to it: %s", tmp,
                     kv_errtext(errno, eb, sizeof eb));
    if (rc) {
        struct kv_err ignored;
        kv_err_clear(&ignored);
        remove_files(tmp, 1, &ignored);
        goto done;
    }
    rc = kv_fsync_dir(parent, parent, err);
done:
    free(out);
    free(parent);
    free(tmp);
    return rc;
}

/* ================================================================ manifest: read */

/* What the manifest says about the model, beyond lr's shapes. */
struct mf_model {
    struct kv_config cfg;
    char fingerprint[65];
    const char *weights; /* points into the JSON document */
};

static int get_obj(const json_t *o, const char *key, const char *path, json_t **out,
                   struct kv_err *err) {
    json_t *v = json_object_get(o, key);
    if (!v) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "missing key '%s'", key);
    if (!json_is_object(v)) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key '%s' must be an object, found %s",
                       key, found);
    }
    *out = v;
    return KV_OK;
}

static int get_arr(const json_t *o, const char *key, const char *path, json_t **out,
                   struct kv_err *err) {
    json_t *v = json_object_get(o, key);
    if (!v) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "missing key '%s'", key);
    if (!json_is_array(v)) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key '%s' must be an array, found %s",
                       key, found);
    }
    *out = v;
    return KV_OK;
}

/* A tensor name or null: *out is NULL for null. required refuses null. */
static int get_name(const json_t *o, const char *key, const char *path, int required,
                    const char **out, struct kv_err *err) {
    json_t *v = json_object_get(o, key);
    *out = NULL;
    if (!v) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "missing key '%s'", key);
    if (json_is_null(v) && !required) return KV_OK;
    if (!json_is_string(v) || json_string_length(v) == 0 ||
        json_string_length(v) > KV_MAX_NAME_LEN) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key '%s' must be a tensor name%s, found %s", key,
                       required ? "" : " or null", found);
    }
    *out = json_string_value(v);
    return KV_OK;
}

/* A name that must be null for this mode. */
static int want_null(const json_t *o, const char *key, const char *mode, const char *path,
                     struct kv_err *err) {
    json_t *v = json_object_get(o, key);
    if (v && !json_is_null(v)) {
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key '%s' must be null for mode '%s', found %s", key, mode, found);
    }
    return KV_OK;
}

static int copy_label(const json_t *root, const char *key, const char *path, char *dst,
                      size_t cap, struct kv_err *err) {
    const char *s;
    int rc = kv_json_get_str(root, key, path, 1, &s, err);
    if (rc) return rc;
    if (strlen(s) >= cap)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key '%s' is '%.32s', longer than %zu bytes", key, s, cap - 1);
    memcpy(dst, s, strlen(s) + 1);
    return KV_OK;
}

/* "rope": an object for an architecture with rope, null for gpt2. */
static int parse_rope(const json_t *root, const char *path, struct kv_config *c,
                      struct kv_err *err) {
    if (!has_rope(c->arch)) {
        json_t *v = json_object_get(root, "rope");
        if (!v) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "missing key 'rope'");
        if (json_is_null(v)) return KV_OK;
        char found[64];
        kv_json_repr(v, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key 'rope' must be null for arch '%s' (no rope), found %s",
                       kv_arch_name(c->arch), found);
    }
    json_t *ro;
    int rc = get_obj(root, "rope", path, &ro, err);
    if (rc) return rc;
    const char *layout;
    double theta = 0;
    if ((rc = kv_json_get_str(ro, "layout", path, 1, &layout, err)) ||
        (rc = kv_json_get_num(ro, "theta", path, 1, 1, &theta, err)))
        return in_ctx(rc, err, "rope");
    if (!strcmp(layout, "half"))
        c->rope_layout = KV_ROPE_HALF;
    else if (!strcmp(layout, "interleaved"))
        c->rope_layout = KV_ROPE_INTERLEAVED;
    else
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope: layout '%.64s' is not 'half' or 'interleaved'", layout);
    json_t *sc = json_object_get(ro, "scaling");
    if (sc && !json_is_null(sc))
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "rope: scaling is not supported, expected null");
    c->rope_theta = (float)theta;
    return KV_OK;
}

static int parse_model(const json_t *root, const char *path, struct mf_model *mm,
                       struct kv_err *err) {
    json_t *mo;
    int rc = get_obj(root, "model", path, &mo, err);
    if (rc) return rc;
    struct kv_config *c = &mm->cfg;
    memset(c, 0, sizeof *c);
    c->arch = KV_ARCH_LLAMA;
    const char *fp, *arch;
    if ((rc = kv_json_get_str(mo, "fingerprint", path, 1, &fp, err)))
        return in_ctx(rc, err, "model");
    size_t n = strlen(fp);
    if (n != 64 || strspn(fp, "0123456789abcdef") != 64)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: key 'fingerprint' must be 64 lowercase hex digits, found '%.80s'",
                       fp);
    memcpy(mm->fingerprint, fp, 65);
    if ((rc = kv_json_get_str(mo, "arch", path, 1, &arch, err))) return in_ctx(rc, err, "model");
    if (!strcmp(arch, kv_arch_name(KV_ARCH_GPT2)))
        c->arch = KV_ARCH_GPT2;
    else if (strcmp(arch, kv_arch_name(KV_ARCH_LLAMA)) != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "model: arch '%.64s' is not supported, expected 'llama' or 'gpt2'", arch);
    double eps = 0;
    if ((rc = kv_json_get_int(mo, "dim", path, 1, KV_MAX_DIM, 1, &c->dim, err)) ||
        (rc = kv_json_get_int(mo, "hidden_dim", path, 1, KV_MAX_DIM, 1, &c->hidden_dim, err)) ||
        (rc = kv_json_get_int(mo, "n_layers", path, 1, KV_MAX_LAYERS, 1, &c->n_layers, err)) ||
        (rc = kv_json_get_int(mo, "n_heads", path, 1, KV_MAX_DIM, 1, &c->n_heads, err)) ||
        (rc = kv_json_get_int(mo, "n_kv_heads", path, 1, KV_MAX_DIM, 1, &c->n_kv_heads, err)) ||
        (rc = kv_json_get_int(mo, "head_dim", path, 1, KV_MAX_DIM, 1, &c->head_dim, err)) ||
        (rc = kv_json_get_int(mo, "vocab_size", path, 1, KV_MAX_VOCAB, 1, &c->vocab_size, err)) ||
        (rc = kv_json_get_num(mo, "norm_eps", path, 1, 1, &eps, err)) ||
        (rc = kv_json_get_bool(mo, "tied_embeddings", path, 1, &c->tied_embeddings, err)) ||
        (rc = kv_json_get_bool(mo, "qkv_bias", path, 1, &c->has_qkv_bias, err)))
        return in_ctx(rc, err, "model");
    c->norm_eps = (float)eps;
    if (c->n_heads % c->n_kv_heads)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: n_heads %lld is not a multiple of n_kv_heads %lld",
                       (long long)c->n_heads, (long long)c->n_kv_heads);

    if ((rc = parse_rope(root, path, c, err))) return rc;

    const char *w, *layout = NULL;
    if ((rc = kv_json_get_str(root, "weights", path, 1, &w, err))) return rc;
    if (!w[0] || strchr(w, '/') || !strcmp(w, ".") || !strcmp(w, ".."))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key 'weights' must be a file name in the directory, found '%.128s'", w);
    mm->weights = w;
    /* optional: the first version-1 manifests had no other layout and no key */
    if ((rc = kv_json_get_str(root, "weight_layout", path, 0, &layout, err))) return rc;
    if (layout && strcmp(layout, WEIGHT_LAYOUT) != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "weight_layout '%.64s' is not supported, expected '" WEIGHT_LAYOUT "'",
                       layout);
    return KV_OK;
}

static int parse_latent(const json_t *root, const char *path, struct kv_lowrank *lr,
                        struct kv_err *err) {
    json_t *lo;
    int rc = get_obj(root, "latent", path, &lo, err);
    if (rc) return rc;
    int64_t bits = 0;
    const char *dtype;
    if ((rc = kv_json_get_int(lo, "bits", path, 1, 16, 1, &bits, err)) ||
        (rc = kv_json_get_str(lo, "dtype", path, 1, &dtype, err)) ||
        (rc = kv_json_get_bool(lo, "hadamard", path, 1, &lr->hadamard, err)))
        return in_ctx(rc, err, "latent");
    if (!valid_bits(bits))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "latent: bits %lld is not one of 16, 8, 4, 3, 2", (long long)bits);
    const char *want = bits == 16 ? "f16" : "int";
    if (strcmp(dtype, want) != 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "latent: dtype '%.32s' does not match %lld bits, expected '%s'", dtype,
                       (long long)bits, want);
    lr->kv_bits = (int)bits;
    return KV_OK;
}

static int parse_mode(const char *s, int which, const char *path, const char *ctx,
                      enum kv_lr_mode *out, struct kv_err *err) {
    static const enum kv_lr_mode modes[] = {KV_LR_FULL, KV_LR_PREROPE_LATENT, KV_LR_FUSED_QUERY,
                                            KV_LR_FUSED_OUTPUT, KV_LR_POSTROPE_ROTATION};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        if (strcmp(s, kv_lr_mode_name(modes[i])) != 0) continue;
        if (!mode_allowed(modes[i], which)) break;
        *out = modes[i];
        return KV_OK;
    }
    return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: mode '%.64s' is not one of %s", ctx,
                   s,
                   which ? "full, fused_output"
                         : "full, prerope_latent, fused_query, postrope_rotation");
}

/* One unit: heads, rank, latent offset, the names its mode needs, energies. */
static int parse_unit(const json_t *uo, const struct kv_lowrank *lr, enum kv_lr_mode mode,
                      int64_t offset, const char *path, const char *ctx, struct kv_lr_unit *x,
                      struct kv_err *err) {
    if (!json_is_object(uo))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: unit must be an object, found a %s", ctx, kv_json_type_name(uo));
    json_t *heads;
    int rc = get_arr(uo, "heads", path, &heads, err);
    if (rc) return in_ctx(rc, err, ctx);
    size_t nh = json_array_size(heads);
    int64_t g = lr->n_kv_heads;
    for (size_t j = 0; j < nh; j++) {
        json_t *h = json_array_get(heads, j);
        json_int_t first = json_integer_value(json_array_get(heads, 0));
        if (!json_is_integer(h) || json_integer_value(h) < 0 || json_integer_value(h) >= g ||
            json_integer_value(h) != first + (json_int_t)j) {
            char found[64];
            kv_json_repr(heads, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "%s: key 'heads' must list consecutive kv heads in 0..%lld, found %s",
                           ctx, (long long)(g - 1), found);
        }
    }
    if (nh == 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: key 'heads' is empty", ctx);
    x->head0 = (int64_t)json_integer_value(json_array_get(heads, 0));
    x->n_heads = (int64_t)nh;
    int64_t lat = 0;
    if ((rc = kv_json_get_int(uo, "rank", path, 1, KV_MAX_DIM, 1, &x->rank, err)) ||
        (rc = kv_json_get_int(uo, "latent_offset", path, 0, INT64_MAX, 1, &lat, err)) ||
        (rc = kv_json_get_num(uo, "energy", path, 0, 1, &x->energy, err)) ||
        (rc = kv_json_get_num(uo, "dropped", path, 0, 1, &x->dropped, err)))
        return in_ctx(rc, err, ctx);
    if (x->rank > x->n_heads * lr->head_dim)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: rank %lld is not within 1..%lld",
                       ctx, (long long)x->rank, (long long)(x->n_heads * lr->head_dim));
    if (lat != offset)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: latent_offset is %lld, expected %lld (the ranks of the units before)",
                       ctx, (long long)lat, (long long)offset);
    const char *name;
    const char *mn = kv_lr_mode_name(mode);
    if (mode == KV_LR_POSTROPE_ROTATION) {
        if ((rc = get_name(uo, "rot", path, 1, &name, err)) ||
            (rc = want_null(uo, "up", mn, path, err)))
            return in_ctx(rc, err, ctx);
    } else {
        if ((rc = get_name(uo, "up", path, 1, &name, err)) ||
            (rc = want_null(uo, "rot", mn, path, err)))
            return in_ctx(rc, err, ctx);
    }
    return KV_OK;
}

/* The fused query keys of a key side: q_proj, q_proj_bias (present exactly
 * when the model has q biases) and q_cols, or all three null for another
 * mode. */
static int parse_fused_query(const json_t *so, int64_t l, const struct kv_config *c,
                             struct kv_lowrank *lr, const char *path, const char *ctx,
                             struct kv_err *err) {
    struct kv_lr_layer *y = &lr->layers[l];
    const char *mn = kv_lr_mode_name(y->k.mode), *name, *bias;
    int rc;
    if (y->k.mode != KV_LR_FUSED_QUERY) {
        if ((rc = want_null(so, "q_proj", mn, path, err)) ||
            (rc = want_null(so, "q_proj_bias", mn, path, err)) ||
            (rc = want_null(so, "q_cols", mn, path, err)))
            return in_ctx(rc, err, ctx);
        return KV_OK;
    }
    if ((rc = check_fused_query_arch(c->arch, l, KV_EFORMAT, path, err))) return rc;
    if ((rc = get_name(so, "q_proj", path, 1, &name, err)) ||
        (rc = get_name(so, "q_proj_bias", path, 0, &bias, err)))
        return in_ctx(rc, err, ctx);
    if (!bias != !c->has_qkv_bias)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: key 'q_proj_bias' is %s, but the model has %s", ctx,
                       bias ? "a tensor name" : "null", c->has_qkv_bias ? "q biases" : "none");
    int64_t cols = 0, want = fused_cols(lr, &y->k);
    if ((rc = kv_json_get_int(so, "q_cols", path, 1, INT64_MAX, 1, &cols, err)))
        return in_ctx(rc, err, ctx);
    if (cols != want)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: q_cols is %lld, expected %lld (each query head's unit rank)", ctx,
                       (long long)cols, (long long)want);
    y->q_cols = cols;
    return KV_OK;
}

static int parse_side(const json_t *yo, int64_t l, int which, const struct kv_config *c,
                      struct kv_lowrank *lr, const char *path, struct kv_err *err) {
    char ctx[96];
    snprintf(ctx, sizeof ctx, "layer %lld %c", (long long)l, side_char[which]);
    char key[2] = {side_char[which], 0};
    json_t *so;
    int rc = get_obj(yo, key, path, &so, err);
    if (rc) return in_ctx(rc, err, ctx);
    struct kv_lr_side *s = side_of(lr, l, which);
    const char *ms, *name;
    if ((rc = kv_json_get_str(so, "mode", path, 1, &ms, err))) return in_ctx(rc, err, ctx);
    if ((rc = parse_mode(ms, which, path, ctx, &s->mode, err))) return rc;
    const char *mn = kv_lr_mode_name(s->mode);
    if (has_down(s->mode)) {
        if ((rc = get_name(so, "down", path, 1, &name, err)) ||
            (rc = get_name(so, "down_bias", path, 0, &name, err)) ||
            (rc = want_null(so, "proj", mn, path, err)))
            return in_ctx(rc, err, ctx);
    } else {
        if ((rc = get_name(so, "proj", path, 1, &name, err)) ||
            (rc = want_null(so, "down", mn, path, err)) ||
            (rc = want_null(so, "down_bias", mn, path, err)))
            return in_ctx(rc, err, ctx);
    }
    if (which && (rc = get_name(so, "o_proj", path, 1, &name, err))) return in_ctx(rc, err, ctx);
    json_t *units;
    if ((rc = get_arr(so, "units", path, &units, err))) return in_ctx(rc, err, ctx);
    size_t nu = json_array_size(units);
    if (s->mode == KV_LR_FULL && nu)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: mode 'full' has %zu units, expected none", ctx, nu);
    if (s->mode != KV_LR_FULL && (nu == 0 || nu > (size_t)lr->n_kv_heads))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: mode '%s' has %zu units, expected 1..%lld", ctx, mn, nu,
                       (long long)lr->n_kv_heads);
    if (nu && !(s->units = calloc(nu, sizeof *s->units)))
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    s->n_units = (int64_t)nu;
    int64_t off = 0;
    for (size_t u = 0; u < nu; u++) {
        char uctx[128];
        snprintf(uctx, sizeof uctx, "%s unit %zu", ctx, u);
        if ((rc = parse_unit(json_array_get(units, u), lr, s->mode, off, path, uctx,
                             &s->units[u], err)))
            return rc;
        off += s->units[u].rank;
    }
    if ((rc = check_side(lr, l, which, 0, KV_EFORMAT, path, err))) return rc;
    int64_t rank = 0;
    if ((rc = kv_json_get_int(so, "rank", path, 0, INT64_MAX, 1, &rank, err)))
        return in_ctx(rc, err, ctx);
    if (rank != off)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: rank is %lld but its units' ranks add up to %lld", ctx,
                       (long long)rank, (long long)off);
    if (which && s->mode == KV_LR_FUSED_OUTPUT) {
        int64_t cols = 0, want = fused_cols(lr, s);
        if ((rc = kv_json_get_int(so, "o_cols", path, 1, INT64_MAX, 1, &cols, err)))
            return in_ctx(rc, err, ctx);
        if (cols != want)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "%s: o_cols is %lld, expected %lld (each query head's unit rank)", ctx,
                           (long long)cols, (long long)want);
        lr->layers[l].o_cols = cols;
    }
    if (!which) return parse_fused_query(so, l, c, lr, path, ctx, err);
    return KV_OK;
}

/* The whole manifest (no tensors): *out gets every shape with NULL factors. */
static int parse_manifest(const json_t *root, const char *path, struct kv_lowrank **out,
                          struct mf_model *mm, struct kv_err *err) {
    if (!json_is_object(root))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "manifest is a json %s, expected an object", kv_json_type_name(root));
    const char *fmt;
    int rc = kv_json_get_str(root, "format", path, 1, &fmt, err);
    if (rc) return rc;
    if (strcmp(fmt, MANIFEST_FORMAT) != 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "format '%.64s' is not '" MANIFEST_FORMAT "'", fmt);
    int64_t version = 0;
    if ((rc = kv_json_get_int(root, "version", path, 1, INT64_MAX, 1, &version, err))) return rc;
    if (version != MANIFEST_VERSION)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "manifest version %lld is not supported, expected %d", (long long)version,
                       MANIFEST_VERSION);
    if ((rc = parse_model(root, path, mm, err))) return rc;

    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    if (!lr) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    const struct kv_config *c = &mm->cfg;
    lr->n_layers = c->n_layers, lr->dim = c->dim, lr->n_heads = c->n_heads;
    lr->n_kv_heads = c->n_kv_heads, lr->head_dim = c->head_dim;
    memcpy(lr->model_fingerprint, mm->fingerprint, 65);
    json_t *layers = NULL;
    if ((rc = copy_label(root, "method", path, lr->method, sizeof lr->method, err)) ||
        (rc = copy_label(root, "alloc", path, lr->alloc, sizeof lr->alloc, err)) ||
        (rc = parse_latent(root, path, lr, err)) ||
        (rc = get_arr(root, "layers", path, &layers, err)))
        goto fail;
    if (json_array_size(layers) != (size_t)lr->n_layers) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "key 'layers' has %zu entries, expected n_layers %lld",
                     json_array_size(layers), (long long)lr->n_layers);
        goto fail;
    }
    if (!(lr->layers = calloc((size_t)lr->n_layers, sizeof *lr->layers))) {
        rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        goto fail;
    }
    for (int64_t l = 0; l < lr->n_layers; l++) {
        json_t *yo = json_array_get(layers, (size_t)l);
        char ctx[48];
        snprintf(ctx, sizeof ctx, "layer %lld", (long long)l);
        int64_t index = -1;
        if (!json_is_object(yo)) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: must be an object, found a %s",
                         ctx, kv_json_type_name(yo));
            goto fail;
        }
        if ((rc = in_ctx(kv_json_get_int(yo, "index", path, 0, KV_MAX_LAYERS, 1, &index, err),
                         err, ctx)))
            goto fail;
        if (index != l) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: index is %lld, expected %lld",
                         ctx, (long long)index, (long long)l);
            goto fail;
        }
        if ((rc = parse_side(yo, l, 0, c, lr, path, err)) ||
            (rc = parse_side(yo, l, 1, c, lr, path, err)))
            goto fail;
    }

    /* honest compression: the recorded bytes are the ones the ranks give */
    json_t *bo;
    int64_t base = 0, comp = 0;
    double ratio = 0;
    if ((rc = get_obj(root, "kv_bytes_per_token", path, &bo, err))) goto fail;
    if ((rc = kv_json_get_int(bo, "base", path, 1, INT64_MAX, 1, &base, err)) ||
        (rc = kv_json_get_int(bo, "compressed", path, 1, INT64_MAX, 1, &comp, err)) ||
        (rc = kv_json_get_num(bo, "ratio", path, 1, 1, &ratio, err))) {
        in_ctx(rc, err, "kv_bytes_per_token");
        goto fail;
    }
    int64_t want_base = kv_lr_base_bytes(c), want_comp = kv_lr_bytes(lr, lr->kv_bits);
    if (base != want_base || comp != want_comp) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "kv_bytes_per_token says base %lld, compressed %lld, but the shapes and "
                     "ranks give base %lld, compressed %lld",
                     (long long)base, (long long)comp, (long long)want_base,
                     (long long)want_comp);
        goto fail;
    }
    double want_ratio = (double)want_comp / (double)want_base;
    if (fabs(ratio - want_ratio) > 1e-9 * want_ratio) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "kv_bytes_per_token: ratio is %.10g, expected %lld/%lld = %.10g", ratio,
                     (long long)comp, (long long)base, want_ratio);
        goto fail;
    }
    *out = lr;
    return KV_OK;
fail:
    kv_lr_free(lr);
    return rc;
}

int kv_lr_manifest_read(const char *path, struct kv_lowrank **out, struct kv_err *err) {
    KV_ASSERT(path && out);
    json_t *root;
    int rc = kv_json_load(path, &root, err);
    if (rc) return rc;
    struct mf_model mm;
    rc = parse_manifest(root, path, out, &mm, err);
    json_decref(root);
    return rc;
}

/* ================================================================ weights: read */

/* Tensor name of a side or unit key (validated by parse_manifest). */
static const char *jname(const json_t *o, const char *key) {
    return json_string_value(json_object_get(o, key));
}

/* Find name in f, check it has the shape [rows, cols] (cols 0: [rows]) and
 * a float dtype, and, if out, convert it into a new f32 buffer. what says
 * which manifest entry named it. */
static int load_tensor(const struct kv_st_file *f, const char *wpath, const char *name,
                       const char *what, int64_t rows, int64_t cols, float **out,
                       struct kv_err *err) {
    const struct kv_tensor *t = kv_st_find(f, name);
    if (!t)
        return kv_fail(err, KV_EFORMAT, wpath, KV_NO_OFFSET,
                       "missing tensor '%s' (named by " MANIFEST_NAME " %s)", name, what);
    int64_t want[2] = {rows, cols};
    int nd = cols ? 2 : 1;
    int same = t->ndim == nd;
    for (int i = 0; i < nd && same; i++) same = t->shape[i] == want[i];
    if (!same) {
        char a[96], b[96];
        kv_shape_str(a, sizeof a, t->shape, t->ndim);
        kv_shape_str(b, sizeof b, want, nd);
        return kv_fail(err, KV_EFORMAT, wpath, t->offset,
                       "tensor '%s' has shape %s but " MANIFEST_NAME " (%s) implies %s", name, a,
                       what, b);
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

static int load_side(const struct kv_st_file *f, const char *wpath, const json_t *yo, int64_t l,
                     int which, struct kv_lowrank *lr, struct kv_err *err) {
    char key[2] = {side_char[which], 0};
    const json_t *so = json_object_get(yo, key), *units = json_object_get(so, "units");
    struct kv_lr_side *s = side_of(lr, l, which);
    int64_t d = lr->dim, dh = lr->head_dim, kvd = lr->n_kv_heads * dh;
    char what[160];
    int rc = KV_OK;
    if (!has_down(s->mode)) {
        snprintf(what, sizeof what, "layer %lld %c 'proj'", (long long)l, side_char[which]);
        if ((rc = load_tensor(f, wpath, jname(so, "proj"), what, kvd, d, NULL, err))) return rc;
        for (int64_t u = 0; u < s->n_units && !rc; u++) {
            struct kv_lr_unit *x = &s->units[u];
            snprintf(what, sizeof what, "layer %lld %c unit %lld 'rot', rank %lld", (long long)l,
                     side_char[which], (long long)u, (long long)x->rank);
            rc = load_tensor(f, wpath, jname(json_array_get(units, (size_t)u), "rot"), what,
                             x->rank, dh, &x->rot, err);
        }
        return rc;
    }
    int64_t r = side_rank(s);
    float *down = NULL, *bias = NULL;
    const char *bias_name = jname(so, "down_bias");
    snprintf(what, sizeof what, "layer %lld %c 'down', rank %lld", (long long)l, side_char[which],
             (long long)r);
    if ((rc = load_tensor(f, wpath, jname(so, "down"), what, r, d, &down, err))) return rc;
    snprintf(what, sizeof what, "layer %lld %c 'down_bias', rank %lld", (long long)l,
             side_char[which], (long long)r);
    if (bias_name && (rc = load_tensor(f, wpath, bias_name, what, r, 0, &bias, err))) {
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
        snprintf(what, sizeof what, "layer %lld %c unit %lld 'up', rank %lld", (long long)l,
                 side_char[which], (long long)u, (long long)x->rank);
        rc = load_tensor(f, wpath, jname(json_array_get(units, (size_t)u), "up"), what,
                         x->n_heads * dh, x->rank, &x->up, err);
    }
    free(down);
    free(bias);
    return rc;
}

static int load_weights(const struct kv_st_file *f, const char *wpath, const json_t *root,
                        struct kv_lowrank *lr, struct kv_err *err) {
    const json_t *layers = json_object_get(root, "layers");
    int64_t d = lr->dim, qd = lr->n_heads * lr->head_dim;
    int rc = KV_OK;
    for (int64_t l = 0; l < lr->n_layers && !rc; l++) {
        const json_t *yo = json_array_get(layers, (size_t)l);
        if ((rc = load_side(f, wpath, yo, l, 0, lr, err)) ||
            (rc = load_side(f, wpath, yo, l, 1, lr, err)))
            break;
        struct kv_lr_layer *y = &lr->layers[l];
        const char *oname = jname(json_object_get(yo, "v"), "o_proj");
        char what[96];
        snprintf(what, sizeof what, "layer %lld v 'o_proj'%s", (long long)l,
                 y->v.mode == KV_LR_FUSED_OUTPUT ? ", o_cols" : "");
        if (y->v.mode == KV_LR_FUSED_OUTPUT)
            rc = load_tensor(f, wpath, oname, what, d, y->o_cols, &y->o_fused, err);
        else
            rc = load_tensor(f, wpath, oname, what, d, qd, NULL, err);
        if (rc || y->k.mode != KV_LR_FUSED_QUERY) continue;
        const json_t *ko = json_object_get(yo, "k");
        const char *bname = jname(ko, "q_proj_bias");
        snprintf(what, sizeof what, "layer %lld k 'q_proj', q_cols", (long long)l);
        rc = load_tensor(f, wpath, jname(ko, "q_proj"), what, y->q_cols, d, &y->q_fused, err);
        snprintf(what, sizeof what, "layer %lld k 'q_proj_bias', q_cols", (long long)l);
        if (!rc && bname)
            rc = load_tensor(f, wpath, bname, what, y->q_cols, 0, &y->q_fused_bias, err);
    }
    return rc;
}

int kv_lr_dir_open(const char *dir, const struct kv_model *m, struct kv_lowrank **out,
                   struct kv_err *err) {
    KV_ASSERT(dir && m && out);
    char *mpath = kv_path_join(dir, MANIFEST_NAME);
    if (!mpath) return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    if (kv_path_kind(dir) != 1) {
        int rc = kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "not a directory");
        free(mpath);
        return rc;
    }
    json_t *root = NULL;
    struct kv_lowrank *lr = NULL;
    struct kv_st_file *f = NULL;
    char *wpath = NULL;
    struct mf_model mm;
    int rc = kv_json_load(mpath, &root, err);
    if (!rc) rc = parse_manifest(root, mpath, &lr, &mm, err);
    if (rc) goto done;

    const struct kv_config *c = &m->cfg, *r = &mm.cfg;
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
        {"rope layout (1 = half)", r->rope_layout, has_rope(c->arch) ? c->rope_layout : 0},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].file != dims[i].model) {
            rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET,
                         "made from a model with %s %lld, but the given model has %lld",
                         dims[i].key, (long long)dims[i].file, (long long)dims[i].model);
            goto done;
        }
    char fp[65];
    if ((rc = kv_model_fingerprint(m, fp, err))) goto done;
    if (strcmp(fp, mm.fingerprint) != 0) {
        rc = kv_fail(err, KV_EINVAL, mpath, KV_NO_OFFSET,
                     "made from model %.12s, but the given model is %.12s (fingerprints differ)",
                     mm.fingerprint, fp);
        goto done;
    }
    if (!(wpath = kv_path_join(dir, mm.weights))) {
        rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    if ((rc = kv_st_open(wpath, &f, err))) goto done;
    if ((rc = load_weights(f, wpath, root, lr, err))) goto done;
    /* what the reader built is what a writer accepts */
    KV_ASSERT(check_lowrank(lr, m, mpath, err) == KV_OK);
    *out = lr;
    lr = NULL;
done:
    kv_st_close(f);
    kv_lr_free(lr);
    json_decref(root);
    free(wpath);
    free(mpath);
    return rc;
}
