/* The compressed model's layout rules: lrlayout.h. */
#include "lrlayout.h"

#include <math.h>
#include <stdio.h>

#include "arch.h"
#include "err.h"

int kv_lrl_has_rope(enum kv_arch arch) { return kv_arch_desc(arch)->rope; }

void kv_lrl_layer_name(char *buf, enum kv_arch arch, int64_t l, const char *rest) {
    snprintf(buf, KV_LRL_NAME_CAP, "%s%lld.%s", kv_arch_desc(arch)->hf.layer_prefix,
             (long long)l, rest);
}

void kv_lrl_attn_name(char *buf, enum kv_arch arch, int64_t l, char c, const char *rest) {
    const struct kv_arch_desc *a = kv_arch_desc(arch);
    snprintf(buf, KV_LRL_NAME_CAP, "%s%lld.%s%c%s", a->hf.layer_prefix, (long long)l, a->hf_attn,
             c, rest);
}

/* P A {k,v}_<kind>.<u>.<leaf> */
static void unit_tensor_name(char *buf, enum kv_arch arch, int64_t l, int which, const char *kind,
                             int64_t u, const char *leaf) {
    const struct kv_arch_desc *a = kv_arch_desc(arch);
    snprintf(buf, KV_LRL_NAME_CAP, "%s%lld.%s%c_%s.%lld.%s", a->hf.layer_prefix, (long long)l,
             a->hf_attn, kv_lrl_side_char(which), kind, (long long)u, leaf);
}

void kv_lrl_unit_name(char *buf, enum kv_arch arch, int64_t l, int which, const char *kind,
                      int64_t u) {
    unit_tensor_name(buf, arch, l, which, kind, u, "weight");
}

void kv_lrl_unit_bias_name(char *buf, enum kv_arch arch, int64_t l, int which, int64_t u) {
    unit_tensor_name(buf, arch, l, which, "up", u, "bias");
}

int kv_lrl_mode_allowed(enum kv_lr_mode mode, int which) {
    if (which == 0)
        return mode == KV_LR_FULL || mode == KV_LR_PREROPE_LATENT || mode == KV_LR_FUSED_QUERY ||
               mode == KV_LR_POSTROPE_ROTATION;
    return mode == KV_LR_FULL || mode == KV_LR_FUSED_OUTPUT;
}

int kv_lrl_has_down(enum kv_lr_mode mode) {
    return mode == KV_LR_PREROPE_LATENT || mode == KV_LR_FUSED_QUERY ||
           mode == KV_LR_FUSED_OUTPUT;
}

int64_t kv_lrl_side_rank(const struct kv_lr_side *s) {
    int64_t r = 0;
    for (int64_t u = 0; u < s->n_units; u++) r += s->units[u].rank;
    return r;
}

int64_t kv_lrl_fused_cols(const struct kv_lowrank *lr, const struct kv_lr_side *s) {
    int64_t per = lr->info.n_heads / lr->info.n_kv_heads, cols = 0;
    for (int64_t u = 0; u < s->n_units; u++) cols += s->units[u].rank * s->units[u].n_heads * per;
    return cols;
}

int kv_lrl_check_side(const struct kv_lowrank *lr, int64_t l, int which, int factors, int code,
                      const char *path, struct kv_err *err) {
    const struct kv_lr_side *s = kv_lr_side(lr, l, which);
    int64_t g = lr->info.n_kv_heads, dh = lr->info.head_dim;
    char ctx[64];
    snprintf(ctx, sizeof ctx, "layer %lld %c", (long long)l, kv_lrl_side_char(which));
    if (!kv_lrl_mode_allowed(s->mode, which))
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
    int biased = s->units[0].down_bias != NULL, centred = s->units[0].up_bias != NULL;
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
            if (kv_lrl_has_down(s->mode) && (x->down_bias != NULL) != biased)
                return kv_fail(err, code, path, KV_NO_OFFSET,
                               "%s unit %lld: down_bias is %s but unit 0's is %s, expected all "
                               "units or none to have one",
                               ctx, (long long)u, x->down_bias ? "set" : "NULL",
                               biased ? "set" : "NULL");
            if (!kv_lrl_has_down(s->mode) && x->up_bias)
                return kv_fail(err, code, path, KV_NO_OFFSET,
                               "%s unit %lld: up_bias is set but mode '%s' has no up factor", ctx,
                               (long long)u, kv_lr_mode_name(s->mode));
            if ((x->up_bias != NULL) != centred)
                return kv_fail(err, code, path, KV_NO_OFFSET,
                               "%s unit %lld: up_bias is %s but unit 0's is %s, expected all "
                               "units or none to have one",
                               ctx, (long long)u, x->up_bias ? "set" : "NULL",
                               centred ? "set" : "NULL");
        }
        next = x->head0 + x->n_heads;
    }
    if (next != g)
        return kv_fail(err, code, path, KV_NO_OFFSET, "%s: kv heads %lld..%lld are in no unit",
                       ctx, (long long)next, (long long)(g - 1));
    return KV_OK;
}

int kv_lrl_check_fused_query_arch(enum kv_arch arch, int64_t l, int code, const char *path,
                                  struct kv_err *err) {
    if (!kv_lrl_has_rope(arch)) return KV_OK;
    return kv_fail(err, code, path, KV_NO_OFFSET,
                   "layer %lld k: mode 'fused_query' needs a model without rope, found arch '%s'",
                   (long long)l, kv_arch_name(arch));
}

int kv_lrl_check(const struct kv_lowrank *lr, const struct kv_model *m, const char *dir,
                 struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    if (!kv_shapes_match(c, lr->info.n_layers, lr->info.dim, lr->info.n_heads, lr->info.n_kv_heads, lr->info.head_dim,
                         "factors", dir, err))
        return KV_EINVAL;
    if (!kv_lr_bits_valid(lr->info.kv_bits) && lr->info.kv_bits != KV_LR_BITS_MIXED)
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "latent bits %d is not one of " KV_LR_BITS_LIST " or 0 (mixed)",
                       lr->info.kv_bits);
    if (!lr->layers) return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET, "factors have no layers");
    if (kv_lr_check_all_bands(lr, dir, err)) return KV_EINVAL;
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        int rc;
        if ((rc = kv_lrl_check_side(lr, l, 0, 1, KV_EINVAL, dir, err)) ||
            (rc = kv_lrl_check_side(lr, l, 1, 1, KV_EINVAL, dir, err)))
            return rc;
        const struct kv_lr_layer *y = &lr->layers[l];
        if (y->v.mode == KV_LR_FUSED_OUTPUT) {
            int64_t want = kv_lrl_fused_cols(lr, &y->v);
            if (!y->o_fused || y->o_cols != want)
                return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                               "layer %lld v: fused output projection is %s with %lld columns, "
                               "expected %lld",
                               (long long)l, y->o_fused ? "set" : "NULL", (long long)y->o_cols,
                               (long long)want);
            int centred = y->v.units[0].up_bias != NULL;
            if ((y->o_fused_bias != NULL) != centred)
                return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                               "layer %lld v: fused output bias is %s but the value units have "
                               "%s",
                               (long long)l, y->o_fused_bias ? "set" : "NULL",
                               centred ? "an up_bias" : "no up_bias");
        } else if (y->o_fused || y->o_fused_bias) {
            return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                           "layer %lld v: a fused output %s is set but the mode is '%s'",
                           (long long)l, y->o_fused ? "projection" : "bias",
                           kv_lr_mode_name(y->v.mode));
        }
        if (y->k.mode == KV_LR_FUSED_QUERY) {
            if ((rc = kv_lrl_check_fused_query_arch(c->arch, l, KV_EINVAL, dir, err))) return rc;
            int64_t want = kv_lrl_fused_cols(lr, &y->k);
            if (!y->q_fused || y->q_cols != want)
                return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                               "layer %lld k: fused query projection is %s with %lld rows, "
                               "expected %lld",
                               (long long)l, y->q_fused ? "set" : "NULL", (long long)y->q_cols,
                               (long long)want);
            int qb = kv_model_has(m, KV_W_BQ, l);
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
