/* RoPE parameters in JSON (ropejson.h). */
#include "ropejson.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "err.h"
#include "json.h"
#include "model.h"


/* The keys a rope scaling type reads besides its type (and, in
 * rope_parameters, rope_theta); any other key is refused, since it would
 * change the frequencies in a way kvcal does not compute. */
struct scaling_kind {
    const char *name;
    enum kv_rope_scaling type;
    const char *keys[9];
};

static const struct scaling_kind scaling_kinds[] = {
    {"default", KV_ROPE_SCALING_NONE, {NULL}},
    {"linear", KV_ROPE_SCALING_LINEAR, {"factor", NULL}},
    {"dynamic", KV_ROPE_SCALING_DYNAMIC, {"factor", "original_max_position_embeddings", NULL}},
    {"llama3", KV_ROPE_SCALING_LLAMA3,
     {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", NULL}},
    {"yarn", KV_ROPE_SCALING_YARN,
     {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
      "mscale", "mscale_all_dim", "truncate", NULL}},
    {"longrope", KV_ROPE_SCALING_LONGROPE,
     {"factor", "short_factor", "long_factor", "attention_factor",
      "original_max_position_embeddings", NULL}},
    {"su", KV_ROPE_SCALING_LONGROPE, /* longrope's first name (Phi-3) */
     {"factor", "short_factor", "long_factor", "attention_factor",
      "original_max_position_embeddings", NULL}},
    /* kvcal's manifests only: GGUF's rope_freqs.weight divisors */
    {"freqs", KV_ROPE_SCALING_FREQS, {"short_factor", NULL}},
};

static int list_of_factors(const json_t *o, const char *key, const char *path, int64_t *n,
                           float *out, struct kv_err *err) {
    json_t *a = json_object_get(o, key);
    size_t i;
    json_t *v;
    if (!json_is_array(a) || json_array_size(a) > KV_MAX_ROPE_FACTORS) {
        char found[64];
        kv_json_repr(a, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key '%s' must be a list of at most %d numbers, found %s", key,
                       KV_MAX_ROPE_FACTORS, a ? found : "nothing");
    }
    json_array_foreach(a, i, v) {
        if (!json_is_number(v) || !(json_number_value(v) > 0) || !isfinite(json_number_value(v))) {
            char found[64];
            kv_json_repr(v, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "key '%s' entry %zu must be a positive number, found %s", key, i, found);
        }
        out[i] = (float)json_number_value(v);
    }
    *n = (int64_t)json_array_size(a);
    return KV_OK;
}

/* yarn's default attention factor: 0.1 ln(factor) m + 1 (1 when factor <= 1) */
static double yarn_mscale(double factor, double m) { return factor <= 1 ? 1 : 0.1 * m * log(factor) + 1; }

/* One rope scaling object (4.x rope_scaling or 5.x rope_parameters): its
 * type from "rope_type" (or the older "type"), then that type's keys.
 * max_pos is max_position_embeddings, orig_top a top-level
 * original_max_position_embeddings (Phi-3) or 0. */
int kv_rope_json_scaling(const json_t *o, const char *path, int64_t max_pos, int64_t orig_top,
                         int in_params, struct kv_rope_scaling_cfg *s, struct kv_err *err) {
    memset(s, 0, sizeof *s);
    const char *ty = NULL;
    int rc = kv_json_get_str(o, "rope_type", path, 0, &ty, err);
    if (!rc && !ty) rc = kv_json_get_str(o, "type", path, !in_params, &ty, err);
    if (rc) return rc;
    if (!ty) ty = "default";
    const struct scaling_kind *k = NULL;
    for (size_t i = 0; i < sizeof scaling_kinds / sizeof scaling_kinds[0]; i++)
        if (!strcmp(scaling_kinds[i].name, ty)) k = &scaling_kinds[i];
    if (!k || (k->type == KV_ROPE_SCALING_FREQS && in_params != 2))
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "rope type '%.64s' is not supported, expected default, linear, dynamic, "
                       "llama3, yarn or longrope",
                       ty);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)o, key, v) {
        int known = !strcmp(key, "rope_type") || !strcmp(key, "type") ||
                    (in_params == 1 && (!strcmp(key, "rope_theta") ||
                                        !strcmp(key, "partial_rotary_factor")));
        for (int j = 0; k->keys[j] && !known; j++) known = !strcmp(key, k->keys[j]);
        if (!known && !json_is_null(v))
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "key '%.64s' of rope type '%s' is not supported", key, k->name);
    }
    s->type = k->type;
    if (s->type == KV_ROPE_SCALING_NONE) return KV_OK;
    double m = 0, m_all = 0;
    int64_t orig = 0;
    s->beta_fast = 32, s->beta_slow = 1, s->truncate = 1;
    if ((rc = kv_json_get_num(o, "factor", path, 1, s->type != KV_ROPE_SCALING_LONGROPE, &s->factor,
                              err)) ||
        (rc = kv_json_get_int(o, "original_max_position_embeddings", path, 1, INT32_MAX, 0, &orig,
                              err)) ||
        (rc = kv_json_get_num(o, "attention_factor", path, 1, 0, &s->attention_factor, err)) ||
        (rc = kv_json_get_num(o, "low_freq_factor", path, 1, s->type == KV_ROPE_SCALING_LLAMA3,
                              &s->low_freq_factor, err)) ||
        (rc = kv_json_get_num(o, "high_freq_factor", path, 1, s->type == KV_ROPE_SCALING_LLAMA3,
                              &s->high_freq_factor, err)) ||
        (rc = kv_json_get_num(o, "beta_fast", path, 1, 0, &s->beta_fast, err)) ||
        (rc = kv_json_get_num(o, "beta_slow", path, 1, 0, &s->beta_slow, err)) ||
        (rc = kv_json_get_num(o, "mscale", path, 0, 0, &m, err)) ||
        (rc = kv_json_get_num(o, "mscale_all_dim", path, 0, 0, &m_all, err)) ||
        (rc = kv_json_get_bool(o, "truncate", path, 0, &s->truncate, err)))
        return rc;
    switch (s->type) {
    case KV_ROPE_SCALING_LLAMA3:
        if (!orig)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "rope type 'llama3' needs original_max_position_embeddings");
        s->original_ctx = orig;
        break;
    case KV_ROPE_SCALING_DYNAMIC:
        /* transformers scales from max_position_embeddings and reads no
         * other context for this type */
        s->original_ctx = max_pos;
        break;
    case KV_ROPE_SCALING_YARN:
        s->original_ctx = orig ? orig : max_pos;
        if (!s->attention_factor)
            s->attention_factor = m && m_all ? yarn_mscale(s->factor, m) / yarn_mscale(s->factor, m_all)
                                             : yarn_mscale(s->factor, 1);
        break;
    case KV_ROPE_SCALING_FREQS:
        return list_of_factors(o, "short_factor", path, &s->n_factors, s->short_factor, err);
    case KV_ROPE_SCALING_LONGROPE: {
        int64_t n_long = 0;
        if ((rc = list_of_factors(o, "short_factor", path, &s->n_factors, s->short_factor, err)) ||
            (rc = list_of_factors(o, "long_factor", path, &n_long, s->long_factor, err)))
            return rc;
        if (n_long != s->n_factors)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "rope long_factor has %lld entries and short_factor %lld",
                           (long long)n_long, (long long)s->n_factors);
        /* Phi-3 keeps the original context at the top level; without a
         * factor the scale is the ratio of the two contexts */
        s->original_ctx = orig ? orig : orig_top ? orig_top : max_pos;
        if (!s->factor) s->factor = (double)max_pos / (double)s->original_ctx;
        break;
    }
    default: break;
    }
    return KV_OK;
}

/* rope_theta and the scaling of a config in either layout: transformers
 * 4.x's top-level rope_theta and rope_scaling, or 5.x's rope_parameters
 * {rope_theta, rope_type, ...}. A value given both ways must agree; theta
 * given neither way is LlamaConfig's 10,000. */
int kv_rope_json_read(const json_t *root, const char *path, int64_t max_pos,
                      struct kv_config *cfg, struct kv_err *err) {
    double theta = 10000.0, theta_p = 0;
    int64_t orig_top = 0;
    int rc;
    if ((rc = kv_json_get_num(root, "rope_theta", path, 1, 0, &theta, err)) ||
        (rc = kv_json_get_int(root, "original_max_position_embeddings", path, 1, INT32_MAX, 0,
                              &orig_top, err)))
        return rc;
    json_t *rs = json_object_get(root, "rope_scaling"), *rp = json_object_get(root, "rope_parameters");
    const char *keys[] = {"rope_scaling", "rope_parameters"};
    json_t *objs[] = {rs, rp};
    struct kv_rope_scaling_cfg sc[2];
    int have[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        if (!objs[i] || json_is_null(objs[i])) continue;
        if (!json_is_object(objs[i])) {
            char found[64];
            kv_json_repr(objs[i], found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "key '%s' must be an object or null, found %s", keys[i], found);
        }
        if ((rc = kv_err_in(kv_rope_json_scaling(objs[i], path, max_pos, orig_top, i == 1, &sc[i], err),
                            err, keys[i])))
            return rc;
        have[i] = 1;
    }
    if (have[1]) {
        if ((rc = kv_err_in(kv_json_get_num(rp, "rope_theta", path, 1, 0, &theta_p, err), err,
                            "rope_parameters")))
            return rc;
        if (theta_p && json_object_get(root, "rope_theta") &&
            !json_is_null(json_object_get(root, "rope_theta")) && theta_p != theta) {
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "rope_theta %.15g and rope_parameters.rope_theta %.15g disagree", theta,
                           theta_p);
        }
        if (theta_p) theta = theta_p;
    }
    if (have[0] && have[1] && memcmp(&sc[0], &sc[1], sizeof sc[0]) != 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope_scaling ('%s') and rope_parameters ('%s') disagree",
                       kv_rope_scaling_name(sc[0].type), kv_rope_scaling_name(sc[1].type));
    if (have[1] || have[0]) cfg->rope_scaling = sc[have[1] ? 1 : 0];
    if (fabs(theta) > FLT_MAX) {
        char num[32];
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key 'rope_theta' is %s, beyond the range of a float",
                       kv_num_str(num, sizeof num, theta));
    }
    cfg->rope_theta = (float)theta;
    return KV_OK;
}


/* the keys of s for its type, in the form kv_rope_json_scaling reads */
json_t *kv_rope_json_write(const struct kv_rope_scaling_cfg *s) {
    if (s->type == KV_ROPE_SCALING_NONE) return json_null();
    json_t *o = json_object();
    if (!o) return NULL;
    int bad = json_object_set_new(o, "rope_type", json_string(kv_rope_scaling_name(s->type)));
    if (s->type != KV_ROPE_SCALING_FREQS) bad |= json_object_set_new(o, "factor", json_real(s->factor));
    switch (s->type) {
    case KV_ROPE_SCALING_LLAMA3:
        bad |= json_object_set_new(o, "low_freq_factor", json_real(s->low_freq_factor));
        bad |= json_object_set_new(o, "high_freq_factor", json_real(s->high_freq_factor));
        break;
    case KV_ROPE_SCALING_YARN:
        bad |= json_object_set_new(o, "beta_fast", json_real(s->beta_fast));
        bad |= json_object_set_new(o, "beta_slow", json_real(s->beta_slow));
        bad |= json_object_set_new(o, "truncate", json_boolean(s->truncate));
        bad |= json_object_set_new(o, "attention_factor", json_real(s->attention_factor));
        break;
    case KV_ROPE_SCALING_LONGROPE:
        if (s->attention_factor)
            bad |= json_object_set_new(o, "attention_factor", json_real(s->attention_factor));
        break;
    default: break;
    }
    if (s->type != KV_ROPE_SCALING_LINEAR && s->type != KV_ROPE_SCALING_FREQS)
        bad |= json_object_set_new(o, "original_max_position_embeddings",
                                   json_integer(s->original_ctx));
    if (s->type == KV_ROPE_SCALING_LONGROPE || s->type == KV_ROPE_SCALING_FREQS) {
        json_t *sf = json_array(), *lf = json_array();
        for (int64_t i = 0; i < s->n_factors; i++) {
            bad |= json_array_append_new(sf, json_real(s->short_factor[i]));
            bad |= json_array_append_new(lf, json_real(s->long_factor[i]));
        }
        bad |= json_object_set_new(o, "short_factor", sf);
        if (s->type == KV_ROPE_SCALING_LONGROPE)
            bad |= json_object_set_new(o, "long_factor", lf);
        else
            json_decref(lf);
    }
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
}
