/* The manifest's records of a decomposition ("options" and "stats" in
 * kvcal.json), built from the options as run, and the write of the
 * compressed model directory with them. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decompose_ctx.h"
#include "err.h"

/* A JSON string that never fails on a path (kv_utf8_repair). */
static json_t *json_text(const char *s) {
    char *r = kv_utf8_repair(s);
    json_t *j = r ? json_string(r) : NULL;
    free(r);
    return j;
}

/* A real, or null when it is not finite (JSON has no NaN). */
static json_t *json_real_or_null(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* {"16": v[0], "8": v[1], ...} over KV_DECOMPOSE_WIDTHS. */
static json_t *per_width(const double *v) {
    json_t *o = json_object();
    for (int w = 0; o && w < KV_DECOMPOSE_N_WIDTHS; w++) {
        char k[8];
        snprintf(k, sizeof k, "%d", KV_DECOMPOSE_WIDTHS[w]);
        json_object_set_new(o, k, json_real_or_null(v[w]));
    }
    return o;
}

static json_t *options_record(const struct kv_decompose_opts *o) {
    json_t *jo = json_pack("{s:s, s:s, s:o, s:o, s:I, s:I, s:I, s:i, s:b, s:o}", "method",
                           kv_method_name(o->method), "alloc", kv_alloc_name(o->alloc), "eps",
                           o->eps > 0 ? json_real(o->eps) : json_null(), "ratio",
                           o->ratio > 0 ? json_real(o->ratio) : json_null(), "group_size",
                           (json_int_t)o->group_size, "rank_multiple", (json_int_t)o->rank_multiple,
                           "min_rank", (json_int_t)o->min_rank, "kv_bits", (int)o->kv_bits,
                           "hadamard", o->hadamard, "searched_parameter", json_real_or_null(o->param));
    /* written only when on (kvcal before them never centred, and its
     * basis was the energy's): an absent key reads as that default */
    if (jo && o->center) json_object_set_new(jo, "center", json_true());
    int auto_bits = o->kv_bits == KV_DECOMPOSE_BITS_AUTO;
    if (jo && auto_bits) { /* "auto", the modelled costs of the mix and of each one width */
        json_object_set_new(jo, "kv_bits", json_string("auto"));
        json_object_set_new(jo, "objective", json_real_or_null(o->objective));
        json_object_set_new(jo, "objective_mix", json_real_or_null(o->objective_mix));
        json_object_set_new(jo, "objective_fixed", per_width(o->objective_fixed));
        if (o->probed) { /* measured on the calibration windows: what chose */
            json_object_set_new(jo, "probe_kl", json_real_or_null(o->probe_kl));
            json_object_set_new(jo, "probe_kl_fixed", per_width(o->probe_kl_fixed));
        }
        json_object_set_new(jo, "fixed_kept", o->fixed_kept ? json_integer(o->fixed_kept) : json_null());
    }
    if (jo && o->alloc == KV_ALLOC_GLOBAL && o->ratio > 0 && !auto_bits) {
        json_object_set_new(jo, "objective", json_real_or_null(o->objective));
        json_object_set_new(jo, "objective_uniform", json_real_or_null(o->objective_uniform));
        json_object_set_new(jo, "kept_uniform", json_boolean(o->kept_uniform));
        if (o->probed) {
            json_object_set_new(jo, "probe_kl", json_real_or_null(o->probe_kl));
            json_object_set_new(jo, "probe_kl_uniform", json_real_or_null(o->probe_kl_uniform));
        }
    }
    if (jo && o->basis != KV_BASIS_ENERGY)
        json_object_set_new(jo, "basis", json_string(kv_basis_name(o->basis)));
    if (jo && o->method == KV_METHOD_LORC) {
        double dmax = o->d_max > 0 ? o->d_max : 1.0;
        /* with a ratio, progressive searched d_min / d_max: record the d_min it ran */
        double dmin = o->alloc == KV_ALLOC_PROGRESSIVE && o->ratio > 0 ? o->param * dmax : o->d_min;
        json_object_set_new(jo, "d_min", json_real(dmin));
        json_object_set_new(jo, "d_max", json_real(dmax));
        json_object_set_new(jo, "cond_skip", o->cond_skip > 0 ? json_real(o->cond_skip) : json_null());
    }
    return jo;
}

static json_t *stats_record(const struct kv_decompose_opts *o, const struct kv_stats *s) {
    if (!s) return json_null();
    struct kv_stats_info si = kv_stats_info(s);
    return json_pack("{s:o, s:s, s:I, s:I, s:I, s:b}", "path",
                     o->stats_path ? json_text(o->stats_path) : json_null(), "model_fingerprint",
                     si.fingerprint, "tokens", (json_int_t)si.tokens, "windows",
                     (json_int_t)si.windows, "seq_len", (json_int_t)si.seq_len, "fisher",
                     si.has_fisher);
}

int kv_decompose_records(const struct kv_decompose_opts *o, const struct kv_stats *s,
                         char **options_json, char **stats_json, struct kv_err *err) {
    json_t *jo = options_record(o), *js = stats_json ? stats_record(o, s) : NULL;
    char *ot = jo ? json_dumps(jo, JSON_COMPACT) : NULL;
    char *st = js ? json_dumps(js, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    json_decref(jo), json_decref(js);
    if (!ot || (stats_json && !st)) {
        free(ot), free(st);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for the manifest's records");
    }
    *options_json = ot;
    if (stats_json) *stats_json = st;
    return KV_OK;
}

int kv_decompose_write(const struct kv_model *m, const struct kv_lowrank *lr,
                       const struct kv_decompose_opts *o, const struct kv_stats *s,
                       const char *model_path, const char *tokenizer_path, const char *dir,
                       struct kv_err *err) {
    char *ot, *st;
    int rc = kv_decompose_records(o, s, &ot, &st, err);
    if (rc) return rc;
    struct kv_lr_dir_info info = {model_path, tokenizer_path, ot, st};
    rc = kv_lr_dir_write(m, lr, &info, dir, err);
    free(ot), free(st);
    return rc;
}
