/* kvcal decompose: units, spectra, rank allocation and factors (DESIGN §3–§5).
 *
 * kv_decompose checks the options, builds every layer's
 * slots and their spectra (decompose_slots.c), allocates ranks
 * (decompose_alloc.c, decompose_budget.c) and emits the factors
 * (decompose_factors.c); decompose_ctx.h describes the objects they share. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decompose_ctx.h"
#include "err.h"
#include "kvstats.h"
#include "lrmodel.h"
#include "model.h"

static const char *const method_names[KV_METHOD_COUNT] = {"svd", "palu", "eigen",
                                                           "lorc", "fdc", "zack"};
static const char *const alloc_names[KV_ALLOC_COUNT] = {
    "default", "eps", "uniform", "fisher", "progressive", "removal", "layer-budget", "global"};

const char *kv_method_name(enum kv_method m) {
    return (unsigned)m < KV_METHOD_COUNT ? method_names[m] : "?";
}
const char *kv_alloc_name(enum kv_alloc a) {
    return (unsigned)a < KV_ALLOC_COUNT ? alloc_names[a] : "?";
}
int kv_method_parse(const char *s) {
    for (int i = 0; i < KV_METHOD_COUNT; i++)
        if (!strcmp(s, method_names[i])) return i;
    return -1;
}
int kv_alloc_parse(const char *s) {
    for (int i = 1; i < KV_ALLOC_COUNT; i++)
        if (!strcmp(s, alloc_names[i])) return i;
    return -1;
}

int kv_decompose(const struct kv_model *m, const struct kv_stats *s,
                 struct kv_decompose_opts *o, struct kv_lowrank **out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    double t0 = kv_now();
    if ((unsigned)o->method >= KV_METHOD_COUNT || (unsigned)o->alloc >= KV_ALLOC_COUNT)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "unknown method or allocation");
    if (o->alloc == KV_ALLOC_DEFAULT) {
        static const enum kv_alloc def[KV_METHOD_COUNT] = {
            KV_ALLOC_UNIFORM, KV_ALLOC_UNIFORM, KV_ALLOC_EPS,
            KV_ALLOC_PROGRESSIVE, KV_ALLOC_REMOVAL, KV_ALLOC_REMOVAL};
        o->alloc = o->eps > 0 && o->ratio <= 0 ? KV_ALLOC_EPS : def[o->method];
    }
    if (!o->kv_bits) o->kv_bits = 16;
    o->least_bytes = o->achieved_bytes = o->target_bytes = 0;
    if (!s && o->method != KV_METHOD_SVD && o->method != KV_METHOD_LORC)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--method %s needs calibration statistics (--stats)", kv_method_name(o->method));
    if (o->eps != 0 && !(o->eps > 0 && o->eps <= 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--eps %g is outside (0, 1]", o->eps);
    if (o->ratio != 0 && !(o->ratio > 0 && o->ratio <= 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--ratio %g is outside (0, 1]", o->ratio);
    if (o->eps > 0 && o->ratio > 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "give --eps or --ratio, not both");
    enum kv_alloc a = o->alloc;
    int needs_ratio = a == KV_ALLOC_UNIFORM || a == KV_ALLOC_FISHER || a == KV_ALLOC_REMOVAL;
    if (needs_ratio && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--alloc %s needs --ratio", kv_alloc_name(a));
    if (a == KV_ALLOC_EPS && o->eps <= 0 && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--alloc eps needs --eps or --ratio");
    if (a == KV_ALLOC_GLOBAL && o->eps <= 0 && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--alloc global needs --ratio or --eps");
    if (a == KV_ALLOC_PROGRESSIVE && o->ratio <= 0 && o->d_min <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--alloc progressive needs --ratio or --d-min");
    if (a == KV_ALLOC_LAYER_BUDGET && o->error_budget <= 0 && o->ratio <= 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--alloc layer-budget needs --error-budget or --ratio");
    if (o->eps > 0 && a != KV_ALLOC_EPS && a != KV_ALLOC_GLOBAL)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--eps applies to --alloc eps or global, not %s", kv_alloc_name(a));
    if (o->group_size < 0 || o->group_size > c->n_kv_heads || (o->group_size && c->n_kv_heads % o->group_size))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "--group-size %lld does not divide the %lld kv heads", (long long)o->group_size,
                       (long long)c->n_kv_heads);
    if (o->kv_bits != 16 && o->kv_bits != 8 && o->kv_bits != 4 && o->kv_bits != 3 && o->kv_bits != 2)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "--kv-bits %d is not one of 16, 8, 4, 3, 2",
                       o->kv_bits);
    if (s && !kv_shapes_match(c, s->n_layers, s->dim, s->n_heads, s->n_kv_heads, s->head_dim,
                              "statistics", NULL, err))
        return KV_EINVAL;

    struct kv_dec_ctx x = {m, s, o, NULL, 0, 0, err};
    int rc = kv_dec_build_slots(&x);
    if (!rc && a == KV_ALLOC_PROGRESSIVE) rc = kv_dec_lorc_conditions(&x);
    if (!rc && (a == KV_ALLOC_FISHER || (a == KV_ALLOC_GLOBAL && (o->fisher || (s && s->has_fisher)))))
        rc = kv_dec_fisher_scores(&x);
    int64_t base = kv_lr_base_bytes(c);
    int64_t target = o->ratio > 0 ? (int64_t)llround(o->ratio * (double)base) : 0;
    if (!rc && target > 0) {
        /* the floor: every slot at its smallest rank */
        for (int64_t i = 0; i < x.n_slots; i++) x.slots[i].rank = kv_dec_round_rank(o, 0, x.slots[i].m);
        int64_t floor = kv_dec_total_bytes(&x), skipped = 0;
        for (int64_t i = 0; i < x.n_slots; i++) skipped += x.slots[i].skip;
        if (floor > target && skipped)
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                         "--ratio %g is below %.4f, the smallest cache with the %lld units that "
                         "--cond-skip %g leaves uncompressed",
                         o->ratio, (double)floor / (double)base, (long long)skipped, o->cond_skip);
        else if (floor > target)
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                         "--ratio %g is below %.4f, the smallest cache that --min-rank %lld and "
                         "--rank-multiple %lld allow",
                         o->ratio, (double)floor / (double)base, (long long)(o->min_rank > 0 ? o->min_rank : 1),
                         (long long)(o->rank_multiple > 0 ? o->rank_multiple : 1));
    }
    if (!rc) {
        switch (a) {
        case KV_ALLOC_GLOBAL: kv_dec_global_ranks(&x, target, o->eps); o->param = 0; break;
        case KV_ALLOC_LAYER_BUDGET: rc = kv_dec_layer_budget(&x, target); break;
        case KV_ALLOC_PROGRESSIVE:
            if (target > 0) o->param = kv_dec_search_param(&x, a, target);
            else kv_dec_param_ranks(&x, a, o->param = o->d_min / (o->d_max > 0 ? o->d_max : 1.0));
            break;
        case KV_ALLOC_EPS:
            if (target > 0) o->param = kv_dec_search_param(&x, a, target);
            else kv_dec_param_ranks(&x, a, o->param = o->eps);
            break;
        case KV_ALLOC_REMOVAL: o->param = 1.0 - kv_dec_search_param(&x, a, target); break;
        default: o->param = kv_dec_search_param(&x, a, target); break;
        }
    }
    o->target_bytes = target;
    o->achieved_bytes = rc ? 0 : kv_dec_total_bytes(&x);
    if (!rc && target > 0 && a != KV_ALLOC_GLOBAL && a != KV_ALLOC_UNIFORM) {
        /* the allocation's own parameter at its most aggressive end still
         * keeps more than the target (e.g. progressive with d_max = 1 keeps
         * the most sensitive layer whole): say so instead of pretending */
        int64_t *save = malloc((size_t)(x.n_slots > 0 ? x.n_slots : 1) * sizeof *save);
        if (save) {
            for (int64_t i = 0; i < x.n_slots; i++) save[i] = x.slots[i].rank;
            if (a != KV_ALLOC_LAYER_BUDGET) {
                kv_dec_param_ranks(&x, a, 0.0);
                o->least_bytes = kv_dec_total_bytes(&x);
            }
            for (int64_t i = 0; i < x.n_slots; i++) x.slots[i].rank = save[i];
            free(save);
        }
    }
    if (!rc) rc = kv_dec_build_lowrank(&x, out);
    kv_dec_slots_free(x.slots, x.n_slots);
    o->lapack_seconds = x.lapack_s;
    o->seconds = kv_now() - t0;
    return rc;
}
