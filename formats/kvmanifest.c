/* The manifest kvcal.json: schema in kvmanifest.h. */
#include "kvmanifest.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "err.h"
#include "json.h"
#include "limits.h"
#include "lrlayout.h"
#include "lrmodel.h"
#include "mapfile.h"
#include "model.h"
#include "ropejson.h"

#define MANIFEST_FORMAT "kvcal.manifest"
#define MANIFEST_VERSION 1
#define WEIGHT_LAYOUT "linear [out, in]" /* every matrix of the weights file */

/* dropped/energy, 0 when there is no energy. */
static double rel_error(double dropped, double energy) {
    return energy > 0 ? dropped / energy : 0.0;
}

/* The words the manifest's model object uses for what an architecture's
 * forward pass does besides attention. */
struct arch_words {
    const char *norm, *activation, *mlp, *positions, *qk_norm, *residual;
};

/* activation: "gelu" is x Φ(x) (erf), "gelu_new" its tanh approximation;
 * residual: "parallel" adds attention and MLP of the same normed input
 * (x + attn(norm1 x) + mlp(norm2 x)), "sequential" the MLP of x + attn */
static struct arch_words arch_words(const struct kv_config *c) {
    const struct kv_arch_desc *d = kv_arch_desc(c->arch);
    struct arch_words w = {d->layernorm ? "layernorm" : "rmsnorm",
                           d->geglu ? "gelu_new" : !d->gelu_mlp ? "silu" : c->gelu_erf ? "gelu" : "gelu_new",
                           d->gelu_mlp ? "plain" : "gated",
                           d->rope ? "rope" : "learned",
                           d->qk_norm ? "rmsnorm_per_head_before_rope" : "none",
                           c->parallel_residual ? "parallel" : "sequential"};
    return w;
}

/* Layer l's query and output projections as an engine applies them: the
 * fused query when its keys are fused_query, the plain q_proj otherwise (and
 * the bias that goes with it, when the model has q biases); o_proj (fused
 * or not, one name) and its bias where the architecture has one. */
struct attn_names {
    char q[KV_LRL_NAME_CAP], qb[KV_LRL_NAME_CAP], o[KV_LRL_NAME_CAP], ob[KV_LRL_NAME_CAP];
    int has_qb, has_ob;
};

static void attn_names(struct attn_names *a, const struct kv_config *c,
                       const struct kv_lowrank *lr, int64_t l) {
    int fused = lr->layers[l].k.mode == KV_LR_FUSED_QUERY;
    kv_lrl_attn_name(a->q, c->arch, l, 'q', fused ? "_fused.weight" : "_proj.weight");
    kv_lrl_attn_name(a->qb, c->arch, l, 'q', fused ? "_fused.bias" : "_proj.bias");
    kv_lrl_attn_name(a->o, c->arch, l, 'o', "_proj.weight");
    kv_lrl_attn_name(a->ob, c->arch, l, 'o', "_proj.bias");
    a->has_qb = c->has_qkv_bias;
    a->has_ob = kv_arch_desc(c->arch)->block_biases;
}

/* ================================================================ write */

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

static json_t *side_json(struct jb *b, const struct kv_model *m, const struct kv_lowrank *lr,
                         int64_t l, int which) {
    const struct kv_lr_side *s = kv_lr_side(lr, l, which);
    const struct kv_lr_layer *y = &lr->layers[l];
    enum kv_arch arch = m->cfg.arch;
    char c = kv_lrl_side_char(which), name[KV_LRL_NAME_CAP];
    json_t *o = json_object();
    jset(b, o, "mode", json_string(kv_lr_mode_name(s->mode)));
    jset(b, o, "rank", json_integer(kv_lrl_side_rank(s)));
    jset(b, o, "predicted_error", json_real(kv_lr_side_error(lr, l, which, NULL, NULL)));
    int down = kv_lrl_has_down(s->mode), proj = !down;
    kv_lrl_attn_name(name, arch, l, c, "_down.weight");
    jset(b, o, "down", name_or_null(down ? name : NULL));
    kv_lrl_attn_name(name, arch, l, c, "_down.bias");
    jset(b, o, "down_bias", name_or_null(down && s->units[0].down_bias ? name : NULL));
    kv_lrl_attn_name(name, arch, l, c, "_proj.weight");
    jset(b, o, "proj", name_or_null(proj ? name : NULL));
    kv_lrl_attn_name(name, arch, l, c, "_proj.bias");
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
        kv_lrl_unit_name(name, arch, l, which, "up", u);
        jset(b, uo, "up", name_or_null(down ? name : NULL));
        kv_lrl_unit_bias_name(name, arch, l, which, u);
        jset(b, uo, "up_bias", name_or_null(down && x->up_bias ? name : NULL));
        kv_lrl_unit_name(name, arch, l, which, "rot", u);
        jset(b, uo, "rot", name_or_null(s->mode == KV_LR_POSTROPE_ROTATION ? name : NULL));
        jset(b, uo, "energy", json_real(x->energy));
        jset(b, uo, "dropped", json_real(x->dropped));
        jset(b, uo, "predicted_error", json_real(rel_error(x->dropped, x->energy)));
        if (lr->info.kv_bits == KV_LR_BITS_MIXED) { /* the unit's own latent bands */
            json_t *bands = jset(b, uo, "bands", json_array());
            for (int i = 0; i < x->n_bands; i++) {
                json_t *bo = json_object();
                jset(b, bo, "n", json_integer(x->bands[i].n));
                jset(b, bo, "bits", json_integer(x->bands[i].bits));
                jappend(b, bands, bo);
            }
        }
        jappend(b, units, uo);
        off += x->rank;
    }
    if (which) {
        kv_lrl_attn_name(name, arch, l, 'o', "_proj.weight");
        jset(b, o, "o_proj", json_string(name));
        /* centred values: the fused output's mean term, added on top of the
         * layer's o_proj_bias (the model's) */
        kv_lrl_attn_name(name, arch, l, 'o', "_fused.bias");
        jset(b, o, "o_proj_bias", name_or_null(y->o_fused_bias ? name : NULL));
        if (s->mode == KV_LR_FUSED_OUTPUT) jset(b, o, "o_cols", json_integer(y->o_cols));
    } else if (s->mode == KV_LR_FUSED_QUERY) {
        kv_lrl_attn_name(name, arch, l, 'q', "_fused.weight");
        jset(b, o, "q_proj", json_string(name));
        kv_lrl_attn_name(name, arch, l, 'q', "_fused.bias");
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

int kv_mf_extra_parse(const struct kv_lr_dir_info *info, const char *dir, struct kv_mf_extra *x,
                      struct kv_err *err) {
    x->options = x->stats = NULL;
    int rc = parse_arg_json(info->options_json, "options", 0, dir, &x->options, err);
    if (!rc) rc = parse_arg_json(info->stats_json, "stats", 1, dir, &x->stats, err);
    if (rc) kv_mf_extra_clear(x);
    return rc;
}

void kv_mf_extra_clear(struct kv_mf_extra *x) {
    json_decref(x->options);
    json_decref(x->stats);
    x->options = x->stats = NULL;
}

static json_t *quant_json(struct jb *b, int bits) {
    if (bits >= 16) return json_null();
    json_t *q = json_object();
    jset(b, q, "scheme", json_string("per-token asymmetric"));
    /* mixed: each unit's bands below 16 bits, each on its own */
    jset(b, q, "group", json_string(bits == KV_LR_BITS_MIXED ? "band" : "unit"));
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
    jset(&b, root, "method", json_text(lr->info.method));
    jset(&b, root, "alloc", json_text(lr->info.alloc));
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
    if (c->sliding_window > 0) { /* the layers whose queries see only the last size keys */
        json_t *sw = jset(&b, mo, "sliding_window", json_object());
        jset(&b, sw, "size", json_integer(c->sliding_window));
        /* every period-th layer from the first listed (one listed layer cannot say) */
        jset(&b, sw, "period", json_integer(c->window_period));
        json_t *ls = jset(&b, sw, "layers", json_array());
        for (int64_t l = 0; l < c->n_layers; l++)
            if (kv_layer_window(c, l)) jappend(&b, ls, json_integer(l));
    } else {
        jset(&b, mo, "sliding_window", json_null());
    }
    /* what the forward pass does around attention, as words an engine can
     * switch on (the reader checks them against arch) */
    struct arch_words aw = arch_words(c);
    jset(&b, mo, "norm", json_string(aw.norm));
    jset(&b, mo, "activation", json_string(aw.activation));
    jset(&b, mo, "mlp", json_string(aw.mlp));
    jset(&b, mo, "positions", json_string(aw.positions));
    jset(&b, mo, "qk_norm", json_string(aw.qk_norm));
    jset(&b, mo, "residual", json_string(aw.residual));
    if (kv_arch_desc(c->arch)->post_norms) {
        /* Gemma 2: what its forward pass adds (formats.md) */
        jset(&b, mo, "post_norms", json_string("attention_and_mlp"));
        jset(&b, mo, "embedding_scale", json_real((double)(float)sqrt((double)c->dim)));
        jset(&b, mo, "norm_offset", json_float(c->norm_offset));
        jset(&b, mo, "attn_scale", json_float(kv_attn_scale(c)));
        jset(&b, mo, "attn_softcap", c->attn_softcap > 0 ? json_float(c->attn_softcap) : json_null());
        jset(&b, mo, "final_softcap", c->final_softcap > 0 ? json_float(c->final_softcap) : json_null());
    }
    json_t *map = jset(&b, mo, "kv_head_of_query", json_array());
    for (int64_t i = 0; i < c->n_heads; i++)
        jappend(&b, map, json_integer(i / (c->n_heads / c->n_kv_heads)));

    jset(&b, root, "stats", stats);
    if (kv_lrl_has_rope(c->arch)) {
        json_t *ro = jset(&b, root, "rope", json_object());
        int half = c->rope_layout == KV_ROPE_HALF;
        jset(&b, ro, "layout", json_string(half ? "half" : "interleaved"));
        int64_t rd = kv_rope_dim(c);
        if (rd == c->head_dim)
            jset(&b, ro, "pairs", json_string(half ? "(i, i + d_h/2)" : "(2i, 2i+1)"));
        else /* partial rope: the pairs within the first rotary_dim dimensions */
            jset(&b, ro, "pairs", json_string(half ? "(i, i + rotary_dim/2), i < rotary_dim/2"
                                                   : "(2i, 2i+1), i < rotary_dim/2"));
        jset(&b, ro, "rotary_dim", json_integer(rd));
        jset(&b, ro, "theta", json_float(c->rope_theta));
        jset(&b, ro, "scaling", kv_rope_json_write(&c->rope_scaling));
        /* the frequencies every scaling comes to, for engines: pair i turns
         * by position·inv_freq[i], and cos and sin are multiplied by
         * attention_factor (sequences up to the original context when the
         * scaling depends on the length) */
        if (c->rope_scaling.type != KV_ROPE_SCALING_NONE) {
        double inv[KV_MAX_ROPE_FACTORS];
        int64_t seq = kv_rope_depends_on_length(c) ? c->rope_scaling.original_ctx : 1;
        double af = kv_rope_freqs(c, seq, inv);
        json_t *fr = jset(&b, ro, "inv_freq", json_array());
        for (int64_t i = 0; i < kv_rope_dim(c) / 2; i++) jappend(&b, fr, json_real(inv[i]));
        jset(&b, ro, "attention_factor", json_real(af));
        }
    } else {
        jset(&b, root, "rope", json_null());
    }

    json_t *lo = jset(&b, root, "latent", json_object());
    jset(&b, lo, "dtype", json_string(lr->info.kv_bits == KV_LR_BITS_MIXED ? "mixed"
                                      : lr->info.kv_bits >= 16                ? "f16"
                                                                              : "int"));
    jset(&b, lo, "bits", json_integer(lr->info.kv_bits));
    jset(&b, lo, "quantization", quant_json(&b, lr->info.kv_bits));
    jset(&b, lo, "hadamard", json_boolean(lr->info.hadamard));
    jset(&b, root, "weights", json_string(KV_LRL_WEIGHTS_NAME));
    jset(&b, root, "weight_layout", json_string(WEIGHT_LAYOUT));

    int64_t base = kv_lr_base_bytes(c), comp = kv_lr_bytes(lr, lr->info.kv_bits);
    json_t *bo = jset(&b, root, "kv_bytes_per_token", json_object());
    jset(&b, bo, "base", json_integer(base));
    jset(&b, bo, "compressed", json_integer(comp));
    jset(&b, bo, "ratio", json_real((double)comp / (double)base));

    /* summed unit by unit over all layers (not side by side), as version 1
     * manifests have always recorded it */
    double en[2] = {0, 0}, dr[2] = {0, 0};
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int w = 0; w < 2; w++) {
            const struct kv_lr_side *s = kv_lr_side(lr, l, w);
            for (int64_t u = 0; u < s->n_units; u++)
                en[w] += s->units[u].energy, dr[w] += s->units[u].dropped;
        }
    json_t *po = jset(&b, root, "predicted_error", json_object());
    jset(&b, po, "k", json_real(rel_error(dr[0], en[0])));
    jset(&b, po, "v", json_real(rel_error(dr[1], en[1])));

    json_t *layers = jset(&b, root, "layers", json_array());
    for (int64_t l = 0; l < lr->info.n_layers && !b.bad; l++) {
        json_t *yo = json_object();
        jset(&b, yo, "index", json_integer(l));
        struct attn_names an;
        attn_names(&an, c, lr, l);
        jset(&b, yo, "q_proj", json_string(an.q));
        jset(&b, yo, "q_proj_bias", name_or_null(an.has_qb ? an.qb : NULL));
        jset(&b, yo, "o_proj", json_string(an.o));
        jset(&b, yo, "o_proj_bias", name_or_null(an.has_ob ? an.ob : NULL));
        if (kv_arch_desc(c->arch)->qk_norm) { /* applied to q and to the rebuilt key */
            char qn[KV_LRL_NAME_CAP], kn[KV_LRL_NAME_CAP];
            kv_lrl_attn_name(qn, c->arch, l, 'q', "_norm.weight");
            kv_lrl_attn_name(kn, c->arch, l, 'k', "_norm.weight");
            jset(&b, yo, "q_norm", json_string(qn));
            jset(&b, yo, "k_norm", json_string(kn));
        }
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

int kv_mf_format(const struct kv_model *m, const struct kv_lowrank *lr, const char *fp,
                 const struct kv_lr_dir_info *info, const char *tok_name, struct kv_mf_extra *x,
                 const char *path, char **out, struct kv_err *err) {
    json_t *root = build_manifest(m, lr, fp, info, x->options, x->stats, tok_name);
    x->options = x->stats = NULL;
    if (!root) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
    json_decref(root);
    if (!text) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    size_t n = strlen(text);
    char *t2 = realloc(text, n + 2);
    if (!t2) {
        free(text);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    memcpy(t2 + n, "\n", 2);
    *out = t2;
    return KV_OK;
}

/* ================================================================ read */

/* Prefix err's message with ctx ("layer 3 k unit 1"); returns rc. */
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
    if (!kv_lrl_has_rope(c->arch)) {
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
        return kv_err_in(rc, err, "rope");
    if (!strcmp(layout, "half"))
        c->rope_layout = KV_ROPE_HALF;
    else if (!strcmp(layout, "interleaved"))
        c->rope_layout = KV_ROPE_INTERLEAVED;
    else
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope: layout '%.64s' is not 'half' or 'interleaved'", layout);
    /* optional (manifests before partial rope turned whole heads) */
    int64_t rd = c->head_dim;
    if ((rc = kv_json_get_int(ro, "rotary_dim", path, 2, c->head_dim, 0, &rd, err)))
        return kv_err_in(rc, err, "rope");
    if (rd % 2 || (rd != c->head_dim && c->arch != KV_ARCH_GPTNEOX))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope: rotary_dim %lld must be even%s", (long long)rd,
                       c->arch != KV_ARCH_GPTNEOX ? " and head_dim for this arch" : "");
    c->rope_dim = rd == c->head_dim ? 0 : rd;
    json_t *sc = json_object_get(ro, "scaling");
    c->rope_theta = (float)theta;
    if (sc && !json_is_null(sc)) {
        if (!json_is_object(sc)) {
            char found[64];
            kv_json_repr(sc, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "rope: key 'scaling' must be an object or null, found %s", found);
        }
        rc = kv_rope_json_scaling(sc, path, c->max_seq_len, 0, 2, &c->rope_scaling, err);
        if (!rc) rc = kv_rope_check(c, path, err);
        if (rc) return kv_err_in(rc, err, "rope: scaling");
    }
    return KV_OK;
}

/* "sliding_window": absent or null (manifests before windows), or {size,
 * period, layers} with the layers every period-th from the first. */
static int parse_window(const json_t *mo, const char *path, struct kv_config *c,
                        struct kv_err *err) {
    json_t *sw = json_object_get(mo, "sliding_window");
    if (!sw || json_is_null(sw)) return KV_OK;
    int64_t size = 0;
    json_t *ls = json_object_get(sw, "layers");
    int rc = json_is_object(sw) ? kv_json_get_int(sw, "size", path, 1, KV_MAX_CTX, 1, &size, err)
                                : kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                                          "key 'sliding_window' must be an object or null");
    if (rc) return kv_err_in(rc, err, "model");
    size_t n = json_array_size(ls);
    int64_t first = n ? json_integer_value(json_array_get(ls, 0)) : -1;
    int64_t period = n > 1 ? json_integer_value(json_array_get(ls, 1)) - first : 1;
    /* optional (manifests before Gemma 2's two-layer models inferred it) */
    if (json_object_get(sw, "period") &&
        (rc = kv_json_get_int(sw, "period", path, 1, KV_MAX_LAYERS, 0, &period, err)))
        return kv_err_in(rc, err, "model: sliding_window");
    int ok = json_is_array(ls) && n > 0 && first >= 0 && period >= 1;
    c->sliding_window = size, c->window_from = (int32_t)first, c->window_period = (int32_t)period;
    for (int64_t l = 0, i = 0; ok && l < c->n_layers; l++)
        if (kv_layer_window(c, l)) {
            json_t *v = json_array_get(ls, (size_t)i++);
            ok = json_is_integer(v) && json_integer_value(v) == l;
        }
    if (!ok || (size_t)(first + (int64_t)(n - 1) * period) >= (size_t)c->n_layers)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: sliding_window layers must be every k-th layer from a first one, "
                       "within the %lld layers",
                       (long long)c->n_layers);
    return KV_OK;
}

/* An optional string key that, when present, must be want (what arch
 * does): keys added to version 1 after its first manifests. */
static int check_word(const json_t *o, const char *key, const char *want, const char *arch,
                      const char *path, struct kv_err *err) {
    const char *v = NULL;
    int rc = kv_json_get_str(o, key, path, 0, &v, err);
    if (rc) return kv_err_in(rc, err, "model");
    if (v && strcmp(v, want) != 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: %s '%.64s' does not match arch '%s', which has '%s'", key, v, arch,
                       want);
    return KV_OK;
}

/* norm, activation, mlp and positions agree with the arch, and
 * kv_head_of_query is the map kvcal's attention uses: query head i reads KV
 * head i / (n_heads / n_kv_heads). Each may be absent (earlier manifests). */
static int check_arch_words(const json_t *mo, const struct kv_config *c, const char *path,
                            struct kv_err *err) {
    struct arch_words w = arch_words(c);
    const char *an = kv_arch_name(c->arch);
    int rc;
    if ((rc = check_word(mo, "norm", w.norm, an, path, err)) ||
        (rc = check_word(mo, "activation", w.activation, an, path, err)) ||
        (rc = check_word(mo, "mlp", w.mlp, an, path, err)) ||
        (rc = check_word(mo, "positions", w.positions, an, path, err)) ||
        (rc = check_word(mo, "qk_norm", w.qk_norm, an, path, err)) ||
        (rc = check_word(mo, "residual", w.residual, an, path, err)))
        return rc;
    json_t *map = json_object_get(mo, "kv_head_of_query");
    if (!map) return KV_OK;
    if (!json_is_array(map) || json_array_size(map) != (size_t)c->n_heads) {
        char found[64];
        kv_json_repr(map, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: key 'kv_head_of_query' must be an array of n_heads %lld kv head "
                       "indices, found %s",
                       (long long)c->n_heads, found);
    }
    int64_t group = c->n_heads / c->n_kv_heads;
    for (int64_t i = 0; i < c->n_heads; i++) {
        json_t *h = json_array_get(map, (size_t)i);
        if (json_is_integer(h) && json_integer_value(h) == i / group) continue;
        char found[64];
        kv_json_repr(h, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: kv_head_of_query[%lld] is %s, expected %lld (query head i reads kv "
                       "head i / (n_heads / n_kv_heads))",
                       (long long)i, found, (long long)(i / group));
    }
    return KV_OK;
}

/* One of a layer's projection names: want (NULL: must be null). */
static int check_layer_name(const json_t *yo, const char *key, const char *want,
                            const char *path, const char *ctx, struct kv_err *err) {
    const char *v;
    int rc = get_name(yo, key, path, 0, &v, err);
    if (rc) return kv_err_in(rc, err, ctx);
    if (!v == !want && (!v || !strcmp(v, want))) return KV_OK;
    return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: %s is %s%.200s%s, expected %s%s%s",
                   ctx, key, v ? "'" : "", v ? v : "null", v ? "'" : "", want ? "'" : "",
                   want ? want : "null", want ? "'" : "");
}

/* Layer l's q_proj, q_proj_bias, o_proj and o_proj_bias (all four, or none
 * in earlier manifests): the tensors kvcal applies, the fused ones under the
 * names its sides give. */
static int check_layer_names(const json_t *yo, int64_t l, const struct kv_config *c,
                             const struct kv_lowrank *lr, const struct kv_mf_names *nm,
                             const char *path, struct kv_err *err) {
    static const char *const keys[] = {"q_proj", "q_proj_bias", "o_proj", "o_proj_bias"};
    int present = 0;
    for (int i = 0; i < 4; i++) present += json_object_get(yo, keys[i]) != NULL;
    if (!present) return KV_OK;
    char ctx[48];
    snprintf(ctx, sizeof ctx, "layer %lld", (long long)l);
    struct attn_names a;
    attn_names(&a, c, lr, l);
    int fused = lr->layers[l].k.mode == KV_LR_FUSED_QUERY;
    const char *want[4] = {fused ? nm[0].q_proj : a.q,
                           fused ? nm[0].q_proj_bias : a.has_qb ? a.qb : NULL, nm[1].o_proj,
                           a.has_ob ? a.ob : NULL};
    for (int i = 0; i < 4; i++) {
        int rc = check_layer_name(yo, keys[i], want[i], path, ctx, err);
        if (rc) return rc;
    }
    return KV_OK;
}

/* "model", "rope", "weights" and "weight_layout" into mf. */
static int parse_model(const json_t *root, const char *path, struct kv_mf *mf,
                       struct kv_err *err) {
    json_t *mo;
    int rc = get_obj(root, "model", path, &mo, err);
    if (rc) return rc;
    struct kv_config *c = &mf->cfg;
    memset(c, 0, sizeof *c);
    const char *fp, *arch;
    if ((rc = kv_json_get_str(mo, "fingerprint", path, 1, &fp, err)))
        return kv_err_in(rc, err, "model");
    size_t n = strlen(fp);
    if (n != 64 || strspn(fp, "0123456789abcdef") != 64)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: key 'fingerprint' must be 64 lowercase hex digits, found '%.80s'",
                       fp);
    memcpy(mf->fingerprint, fp, 65);
    if ((rc = kv_json_get_str(mo, "arch", path, 1, &arch, err))) return kv_err_in(rc, err, "model");
    const struct kv_arch_desc *ad = kv_arch_by_name(arch);
    if (!ad)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "model: arch '%.64s' is not supported, expected %s", arch, kv_arch_list(1));
    c->arch = ad->id;
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
        return kv_err_in(rc, err, "model");
    c->norm_eps = (float)eps;
    /* checked for type and range (an engine reads them); the reader compares
     * max_seq_len with the base model, bos and eos are the tokenizer's */
    int64_t bos = -1, eos = -1;
    if ((rc = kv_json_get_int(mo, "max_seq_len", path, 1, KV_MAX_CTX, 0, &c->max_seq_len, err)) ||
        (rc = kv_json_get_int(mo, "bos_id", path, -1, KV_MAX_VOCAB, 0, &bos, err)) ||
        (rc = kv_json_get_int(mo, "eos_id", path, -1, KV_MAX_VOCAB, 0, &eos, err)))
        return kv_err_in(rc, err, "model");
    c->bos_id = (int32_t)bos, c->eos_id = (int32_t)eos;
    if (c->n_heads % c->n_kv_heads)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "model: n_heads %lld is not a multiple of n_kv_heads %lld",
                       (long long)c->n_heads, (long long)c->n_kv_heads);

    if (c->arch == KV_ARCH_GPTNEOX) { /* what the words say is the model's, not the arch's */
        const char *act, *res;
        if ((rc = kv_json_get_str(mo, "activation", path, 1, &act, err)) ||
            (rc = kv_json_get_str(mo, "residual", path, 1, &res, err)))
            return kv_err_in(rc, err, "model");
        if (strcmp(act, "gelu") && strcmp(act, "gelu_new"))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "model: activation '%.64s' is not 'gelu' or 'gelu_new'", act);
        if (strcmp(res, "parallel") && strcmp(res, "sequential"))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "model: residual '%.64s' is not 'parallel' or 'sequential'", res);
        c->gelu_erf = !strcmp(act, "gelu");
        c->parallel_residual = !strcmp(res, "parallel");
    }
    if (kv_arch_desc(c->arch)->post_norms) { /* Gemma 2's numbers, all required */
        double off = 0, sc = 0, caps[2] = {0, 0};
        const char *ck[2] = {"attn_softcap", "final_softcap"};
        if ((rc = kv_json_get_num(mo, "norm_offset", path, 0, 1, &off, err)) ||
            (rc = kv_json_get_num(mo, "attn_scale", path, 1, 1, &sc, err)))
            return kv_err_in(rc, err, "model");
        for (int i = 0; i < 2; i++) {
            const json_t *v = json_object_get(mo, ck[i]);
            if (!v)
                return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "model: missing key '%s'", ck[i]);
            if (!json_is_null(v) && (rc = kv_json_get_num(mo, ck[i], path, 1, 1, &caps[i], err)))
                return kv_err_in(rc, err, "model");
        }
        if (off != 0 && off != 1)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "model: norm_offset %g is not 0 or 1", off);
        c->norm_offset = (float)off, c->attn_scale = (float)sc;
        c->attn_softcap = (float)caps[0], c->final_softcap = (float)caps[1];
    }
    if ((rc = parse_rope(root, path, c, err))) return rc;
    if ((rc = parse_window(mo, path, c, err))) return rc;
    if ((rc = check_arch_words(mo, c, path, err))) return rc;

    const char *w, *layout = NULL;
    if ((rc = kv_json_get_str(root, "weights", path, 1, &w, err))) return rc;
    if (!w[0] || strchr(w, '/') || !strcmp(w, ".") || !strcmp(w, ".."))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key 'weights' must be a file name in the directory, found '%.128s'", w);
    mf->weights = w;
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
    if ((rc = kv_json_get_int(lo, "bits", path, 0, 16, 1, &bits, err)) ||
        (rc = kv_json_get_str(lo, "dtype", path, 1, &dtype, err)) ||
        (rc = kv_json_get_bool(lo, "hadamard", path, 1, &lr->info.hadamard, err)))
        return kv_err_in(rc, err, "latent");
    if (!kv_lr_bits_valid(bits) && bits != KV_LR_BITS_MIXED)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "latent: bits %lld is not one of " KV_LR_BITS_LIST
                       " or 0 (each unit's own bands)",
                       (long long)bits);
    const char *want = bits == KV_LR_BITS_MIXED ? "mixed" : bits == 16 ? "f16" : "int";
    if (strcmp(dtype, want) != 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "latent: dtype '%.32s' does not match %lld bits, expected '%s'", dtype,
                       (long long)bits, want);
    lr->info.kv_bits = (int)bits;
    return KV_OK;
}

static int parse_mode(const char *s, int which, const char *path, const char *ctx,
                      enum kv_lr_mode *out, struct kv_err *err) {
    static const enum kv_lr_mode modes[] = {KV_LR_FULL, KV_LR_PREROPE_LATENT, KV_LR_FUSED_QUERY,
                                            KV_LR_FUSED_OUTPUT, KV_LR_POSTROPE_ROTATION};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        if (strcmp(s, kv_lr_mode_name(modes[i])) != 0) continue;
        if (!kv_lrl_mode_allowed(modes[i], which)) break;
        *out = modes[i];
        return KV_OK;
    }
    return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: mode '%.64s' is not one of %s", ctx,
                   s,
                   which ? "full, fused_output"
                         : "full, prerope_latent, fused_query, postrope_rotation");
}

/* An optional tensor name (absent in manifests before its key): *out is
 * NULL when absent or null. */
static int get_opt_name(const json_t *o, const char *key, const char *path, const char **out,
                        struct kv_err *err) {
    *out = NULL;
    if (!json_object_get(o, key)) return KV_OK;
    return get_name(o, key, path, 0, out, err);
}

/* A unit's "bands": a list of {n, bits} at latent bits 0 (mixed), absent
 * or null otherwise. */
static int parse_bands(const json_t *uo, int kv_bits, struct kv_lr_unit *x, const char *path,
                       const char *ctx, struct kv_err *err) {
    json_t *bands = json_object_get(uo, "bands");
    x->n_bands = 0;
    if (kv_bits != KV_LR_BITS_MIXED) {
        if (!bands || json_is_null(bands)) return KV_OK;
        char found[64];
        kv_json_repr(bands, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: key 'bands' must be null when latent bits is %d, found %s", ctx, kv_bits,
                       found);
    }
    if (!bands)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: missing key 'bands' (latent bits 0: each unit's own bands)", ctx);
    if (!json_is_array(bands)) {
        char found[64];
        kv_json_repr(bands, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: key 'bands' must be an array of {n, bits}, found %s", ctx, found);
    }
    size_t nb = json_array_size(bands);
    if (nb < 1 || nb > KV_LR_MAX_BANDS)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: key 'bands' has %zu entries, expected 1 .. %d", ctx, nb, KV_LR_MAX_BANDS);
    for (size_t i = 0; i < nb; i++) {
        json_t *bo = json_array_get(bands, i);
        char bctx[160];
        snprintf(bctx, sizeof bctx, "%s band %zu", ctx, i);
        if (!json_is_object(bo))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: must be an object, found a %s",
                           bctx, kv_json_type_name(bo));
        int64_t n = 0, bits = 0;
        int rc;
        if ((rc = kv_json_get_int(bo, "n", path, 1, KV_MAX_DIM, 1, &n, err)) ||
            (rc = kv_json_get_int(bo, "bits", path, 2, 16, 1, &bits, err)))
            return kv_err_in(rc, err, bctx);
        x->bands[i] = (struct kv_lr_band){n, (int)bits};
    }
    x->n_bands = (int)nb;
    char why[160];
    if (kv_lr_bands_check(x->bands, x->n_bands, x->rank, why, sizeof why))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: %s", ctx, why);
    return KV_OK;
}

/* One unit: heads, rank, latent offset, the name its mode needs (into
 * *name) and its up_bias name or NULL (into *bias_name), energies. */
static int parse_unit(const json_t *uo, const struct kv_lowrank *lr, enum kv_lr_mode mode,
                      int64_t offset, const char *path, const char *ctx, struct kv_lr_unit *x,
                      const char **name, const char **bias_name, struct kv_err *err) {
    if (!json_is_object(uo))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: unit must be an object, found a %s", ctx, kv_json_type_name(uo));
    json_t *heads;
    int rc = get_arr(uo, "heads", path, &heads, err);
    if (rc) return kv_err_in(rc, err, ctx);
    size_t nh = json_array_size(heads);
    int64_t g = lr->info.n_kv_heads;
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
        return kv_err_in(rc, err, ctx);
    if (x->rank > x->n_heads * lr->info.head_dim)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: rank %lld is not within 1..%lld",
                       ctx, (long long)x->rank, (long long)(x->n_heads * lr->info.head_dim));
    if (lat != offset)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: latent_offset is %lld, expected %lld (the ranks of the units before)",
                       ctx, (long long)lat, (long long)offset);
    if ((rc = parse_bands(uo, lr->info.kv_bits, x, path, ctx, err))) return rc;
    const char *mn = kv_lr_mode_name(mode);
    *bias_name = NULL;
    if (mode == KV_LR_POSTROPE_ROTATION) {
        if ((rc = get_name(uo, "rot", path, 1, name, err)) ||
            (rc = want_null(uo, "up", mn, path, err)) ||
            (rc = want_null(uo, "up_bias", mn, path, err)))
            return kv_err_in(rc, err, ctx);
    } else {
        /* up_bias: optional (manifests before centred factors) */
        if ((rc = get_name(uo, "up", path, 1, name, err)) ||
            (rc = get_opt_name(uo, "up_bias", path, bias_name, err)) ||
            (rc = want_null(uo, "rot", mn, path, err)))
            return kv_err_in(rc, err, ctx);
    }
    return KV_OK;
}

/* The fused query keys of a key side: q_proj, q_proj_bias (present exactly
 * when the model has q biases) and q_cols, or all three null for another
 * mode. */
static int parse_fused_query(const json_t *so, int64_t l, const struct kv_config *c,
                             struct kv_lowrank *lr, struct kv_mf_names *nm, const char *path,
                             const char *ctx, struct kv_err *err) {
    struct kv_lr_layer *y = &lr->layers[l];
    const char *mn = kv_lr_mode_name(y->k.mode);
    int rc;
    if (y->k.mode != KV_LR_FUSED_QUERY) {
        if ((rc = want_null(so, "q_proj", mn, path, err)) ||
            (rc = want_null(so, "q_proj_bias", mn, path, err)) ||
            (rc = want_null(so, "q_cols", mn, path, err)))
            return kv_err_in(rc, err, ctx);
        return KV_OK;
    }
    if ((rc = kv_lrl_check_fused_query_arch(c->arch, l, KV_EFORMAT, path, err))) return rc;
    if ((rc = get_name(so, "q_proj", path, 1, &nm->q_proj, err)) ||
        (rc = get_name(so, "q_proj_bias", path, 0, &nm->q_proj_bias, err)))
        return kv_err_in(rc, err, ctx);
    if (!nm->q_proj_bias != !c->has_qkv_bias)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: key 'q_proj_bias' is %s, but the model has %s", ctx,
                       nm->q_proj_bias ? "a tensor name" : "null",
                       c->has_qkv_bias ? "q biases" : "none");
    int64_t cols = 0, want = kv_lrl_fused_cols(lr, &y->k);
    if ((rc = kv_json_get_int(so, "q_cols", path, 1, INT64_MAX, 1, &cols, err)))
        return kv_err_in(rc, err, ctx);
    if (cols != want)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: q_cols is %lld, expected %lld (each query head's unit rank)", ctx,
                       (long long)cols, (long long)want);
    y->q_cols = cols;
    return KV_OK;
}

/* Layer l's side `which` into lr, its tensor names into nm. */
static int parse_side(const json_t *yo, int64_t l, int which, const struct kv_config *c,
                      struct kv_lowrank *lr, struct kv_mf_names *nm, const char *path,
                      struct kv_err *err) {
    char ctx[96];
    snprintf(ctx, sizeof ctx, "layer %lld %c", (long long)l, kv_lrl_side_char(which));
    char key[2] = {kv_lrl_side_char(which), 0};
    json_t *so;
    int rc = get_obj(yo, key, path, &so, err);
    if (rc) return kv_err_in(rc, err, ctx);
    struct kv_lr_side *s = kv_lr_side(lr, l, which);
    const char *ms;
    if ((rc = kv_json_get_str(so, "mode", path, 1, &ms, err))) return kv_err_in(rc, err, ctx);
    if ((rc = parse_mode(ms, which, path, ctx, &s->mode, err))) return rc;
    const char *mn = kv_lr_mode_name(s->mode);
    if (kv_lrl_has_down(s->mode)) {
        if ((rc = get_name(so, "down", path, 1, &nm->down, err)) ||
            (rc = get_name(so, "down_bias", path, 0, &nm->down_bias, err)) ||
            (rc = want_null(so, "proj", mn, path, err)))
            return kv_err_in(rc, err, ctx);
    } else {
        if ((rc = get_name(so, "proj", path, 1, &nm->proj, err)) ||
            (rc = want_null(so, "down", mn, path, err)) ||
            (rc = want_null(so, "down_bias", mn, path, err)))
            return kv_err_in(rc, err, ctx);
    }
    if (which && ((rc = get_name(so, "o_proj", path, 1, &nm->o_proj, err)) ||
                  (rc = get_opt_name(so, "o_proj_bias", path, &nm->o_proj_bias, err))))
        return kv_err_in(rc, err, ctx);
    json_t *units;
    if ((rc = get_arr(so, "units", path, &units, err))) return kv_err_in(rc, err, ctx);
    size_t nu = json_array_size(units);
    if (s->mode == KV_LR_FULL && nu)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: mode 'full' has %zu units, expected none", ctx, nu);
    if (s->mode != KV_LR_FULL && (nu == 0 || nu > (size_t)lr->info.n_kv_heads))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: mode '%s' has %zu units, expected 1..%lld", ctx, mn, nu,
                       (long long)lr->info.n_kv_heads);
    if (nu && (!(s->units = calloc(nu, sizeof *s->units)) ||
               !(nm->unit = calloc(nu, sizeof *nm->unit)) ||
               !(nm->unit_bias = calloc(nu, sizeof *nm->unit_bias))))
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    s->n_units = (int64_t)nu;
    int64_t off = 0;
    for (size_t u = 0; u < nu; u++) {
        char uctx[128];
        snprintf(uctx, sizeof uctx, "%s unit %zu", ctx, u);
        if ((rc = parse_unit(json_array_get(units, u), lr, s->mode, off, path, uctx,
                             &s->units[u], &nm->unit[u], &nm->unit_bias[u], err)))
            return rc;
        off += s->units[u].rank;
    }
    if ((rc = kv_lrl_check_side(lr, l, which, 0, KV_EFORMAT, path, err))) return rc;
    /* centred factors: an up_bias on every unit or on none */
    int centred = nu && nm->unit_bias[0];
    for (size_t u = 1; u < nu; u++)
        if (!nm->unit_bias[u] != !centred)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "%s unit %zu: key 'up_bias' is %s but unit 0's is %s, expected all "
                           "units or none to have one",
                           ctx, u, nm->unit_bias[u] ? "a tensor name" : "null",
                           centred ? "a tensor name" : "null");
    if (which && s->mode != KV_LR_FUSED_OUTPUT &&
        (rc = want_null(so, "o_proj_bias", mn, path, err)))
        return kv_err_in(rc, err, ctx);
    if (which && s->mode == KV_LR_FUSED_OUTPUT && !nm->o_proj_bias != !centred)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: key 'o_proj_bias' is %s, but the units have %s", ctx,
                       nm->o_proj_bias ? "a tensor name" : "null",
                       centred ? "an up_bias" : "no up_bias");
    int64_t rank = 0;
    if ((rc = kv_json_get_int(so, "rank", path, 0, INT64_MAX, 1, &rank, err)))
        return kv_err_in(rc, err, ctx);
    if (rank != off)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s: rank is %lld but its units' ranks add up to %lld", ctx,
                       (long long)rank, (long long)off);
    if (which && s->mode == KV_LR_FUSED_OUTPUT) {
        int64_t cols = 0, want = kv_lrl_fused_cols(lr, s);
        if ((rc = kv_json_get_int(so, "o_cols", path, 1, INT64_MAX, 1, &cols, err)))
            return kv_err_in(rc, err, ctx);
        if (cols != want)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "%s: o_cols is %lld, expected %lld (each query head's unit rank)", ctx,
                           (long long)cols, (long long)want);
        lr->layers[l].o_cols = cols;
    }
    if (!which) return parse_fused_query(so, l, c, lr, nm, path, ctx, err);
    return KV_OK;
}

/* The whole manifest (no tensors): *out gets every shape with NULL
 * factors, mf the rest (its names pointing into root). */
static int parse_manifest(const json_t *root, const char *path, struct kv_lowrank **out,
                          struct kv_mf *mf, struct kv_err *err) {
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
    if ((rc = parse_model(root, path, mf, err))) return rc;

    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    if (!lr) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    const struct kv_config *c = &mf->cfg;
    lr->info.n_layers = c->n_layers, lr->info.dim = c->dim, lr->info.n_heads = c->n_heads;
    lr->info.n_kv_heads = c->n_kv_heads, lr->info.head_dim = c->head_dim;
    memcpy(lr->info.model_fingerprint, mf->fingerprint, 65);
    json_t *layers = NULL;
    if ((rc = copy_label(root, "method", path, lr->info.method, sizeof lr->info.method, err)) ||
        (rc = copy_label(root, "alloc", path, lr->info.alloc, sizeof lr->info.alloc, err)) ||
        (rc = parse_latent(root, path, lr, err)) ||
        (rc = get_arr(root, "layers", path, &layers, err)))
        goto fail;
    if (json_array_size(layers) != (size_t)lr->info.n_layers) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "key 'layers' has %zu entries, expected n_layers %lld",
                     json_array_size(layers), (long long)lr->info.n_layers);
        goto fail;
    }
    if (!(lr->layers = calloc((size_t)lr->info.n_layers, sizeof *lr->layers)) ||
        !(mf->names = calloc((size_t)lr->info.n_layers, sizeof *mf->names))) {
        rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        goto fail;
    }
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        json_t *yo = json_array_get(layers, (size_t)l);
        char ctx[48];
        snprintf(ctx, sizeof ctx, "layer %lld", (long long)l);
        int64_t index = -1;
        if (!json_is_object(yo)) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: must be an object, found a %s",
                         ctx, kv_json_type_name(yo));
            goto fail;
        }
        if ((rc = kv_err_in(kv_json_get_int(yo, "index", path, 0, KV_MAX_LAYERS, 1, &index, err),
                         err, ctx)))
            goto fail;
        if (index != l) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s: index is %lld, expected %lld",
                         ctx, (long long)index, (long long)l);
            goto fail;
        }
        if ((rc = parse_side(yo, l, 0, c, lr, &mf->names[l][0], path, err)) ||
            (rc = parse_side(yo, l, 1, c, lr, &mf->names[l][1], path, err)) ||
            (rc = check_layer_names(yo, l, c, lr, mf->names[l], path, err)))
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
        kv_err_in(rc, err, "kv_bytes_per_token");
        goto fail;
    }
    int64_t want_base = kv_lr_base_bytes(c), want_comp = kv_lr_bytes(lr, lr->info.kv_bits);
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

void kv_mf_clear(struct kv_mf *mf) {
    for (int64_t l = 0; mf->names && l < mf->cfg.n_layers; l++)
        for (int w = 0; w < 2; w++) free(mf->names[l][w].unit), free(mf->names[l][w].unit_bias);
    free(mf->names);
    json_decref(mf->doc);
    memset(mf, 0, sizeof *mf);
}

int kv_mf_parse(const void *buf, size_t len, const char *path, struct kv_lowrank **out,
                struct kv_mf *mf, struct kv_err *err) {
    KV_ASSERT((buf || !len) && path && out);
    struct kv_mf own;
    if (!mf) mf = &own;
    memset(mf, 0, sizeof *mf);
    if (len > KV_MAX_JSON_BYTES)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "file is %llu bytes, above the json limit of %llu",
                       (unsigned long long)len, (unsigned long long)KV_MAX_JSON_BYTES);
    int rc = kv_json_parse(buf, len, path, 0, &mf->doc, err);
    if (!rc) rc = parse_manifest(mf->doc, path, out, mf, err);
    if (rc || mf == &own) kv_mf_clear(mf);
    return rc;
}

int kv_mf_read(const char *path, struct kv_lowrank **out, struct kv_mf *mf, struct kv_err *err) {
    KV_ASSERT(path && out);
    struct kv_map map;
    int rc = kv_map_open(path, &map, err);
    if (rc) return rc;
    rc = kv_mf_parse(map.data, (size_t)map.len, path, out, mf, err);
    kv_map_close(&map);
    return rc;
}

/* ================================================================ public */

int kv_lr_manifest_parse(const void *buf, size_t len, const char *path, struct kv_lowrank **out,
                         struct kv_err *err) {
    return kv_mf_parse(buf, len, path, out, NULL, err);
}

int kv_lr_manifest_read(const char *path, struct kv_lowrank **out, struct kv_err *err) {
    return kv_mf_read(path, out, NULL, err);
}
