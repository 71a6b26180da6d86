/* kvcal decompose: units, spectra, rank allocation and factors (DESIGN §3–§5).
 *
 * kv_decompose checks the options (decompose_check.c), builds every layer's
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

static const char *const basis_names[KV_BASIS_COUNT] = {"energy", "output", "loss"};

/* The index of s in names[first .. n-1], or -1. */
static int name_index(const char *const *names, int first, int n, const char *s) {
    for (int i = first; i < n; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

const char *kv_basis_name(enum kv_basis b) {
    return (unsigned)b < KV_BASIS_COUNT ? basis_names[b] : "?";
}
const char *kv_method_name(enum kv_method m) {
    return (unsigned)m < KV_METHOD_COUNT ? method_names[m] : "?";
}
const char *kv_alloc_name(enum kv_alloc a) {
    return (unsigned)a < KV_ALLOC_COUNT ? alloc_names[a] : "?";
}
int kv_basis_parse(const char *s) { return name_index(basis_names, 0, KV_BASIS_COUNT, s); }
int kv_method_parse(const char *s) { return name_index(method_names, 0, KV_METHOD_COUNT, s); }
/* "default" is not a name a user gives */
int kv_alloc_parse(const char *s) { return name_index(alloc_names, 1, KV_ALLOC_COUNT, s); }

void kv_decompose_defaults(struct kv_decompose_opts *o) {
    memset(o, 0, sizeof *o);
    o->method = KV_METHOD_PALU;
    o->group_size = o->rank_multiple = o->min_rank = 1;
    o->kv_bits = 16;
    o->seq_len = 256;
    o->calib_windows = 8;
}

/* Zeros to their defaults, then every rule. seq_len and calib_windows
 * describe calib_tokens, so their zeros are read as the defaults for the
 * check only: layer-budget still refuses windows it was not given. */
static int check_all(const struct kv_model *m, const struct kv_stats *s,
                     struct kv_decompose_opts *o, struct kv_err *err) {
    if (!o->kv_bits) o->kv_bits = 16;
    if (!o->group_size) o->group_size = 1;
    if (!o->rank_multiple) o->rank_multiple = 1;
    if (!o->min_rank) o->min_rank = 1;
    struct kv_decompose_opts d, chk = *o;
    kv_decompose_defaults(&d);
    if (!chk.seq_len) chk.seq_len = d.seq_len;
    if (!chk.calib_windows) chk.calib_windows = d.calib_windows;
    const char *const *names = kv_dec_names(o->names);
    int rc = kv_dec_check_opts(&chk, s || o->stats_path, o->calib_tokens || o->text_path, names, err);
    if (rc) return rc;
    if (o->kv_bits == KV_DECOMPOSE_BITS_AUTO) /* its own search; its model assumes the rotation */
        o->alloc = KV_ALLOC_GLOBAL, o->hadamard = 1;
    if (o->alloc == KV_ALLOC_DEFAULT) {
        static const enum kv_alloc def[KV_METHOD_COUNT] = {
            KV_ALLOC_UNIFORM, KV_ALLOC_UNIFORM, KV_ALLOC_EPS,
            KV_ALLOC_PROGRESSIVE, KV_ALLOC_REMOVAL, KV_ALLOC_REMOVAL};
        o->alloc = o->eps > 0 && o->ratio <= 0 ? KV_ALLOC_EPS : def[o->method];
    }
    return kv_decompose_check_model(o, m, s, names, err);
}

/* The smallest cache the options allow, every slot at its smallest rank,
 * against the byte target. */
static int check_floor(struct kv_dec_ctx *x, int64_t target, int64_t base) {
    const struct kv_decompose_opts *o = x->o;
    const char *const *n = x->names;
    for (int64_t i = 0; i < x->n_slots; i++) {
        struct kv_dec_slot *sl = &x->slots[i];
        sl->rank = kv_dec_round_rank(o, 0, sl->m);
        if (o->kv_bits == KV_DECOMPOSE_BITS_AUTO) { /* the floor rank at its cheapest width */
            int64_t least = INT64_MAX;
            for (int w = 0; w < KV_DECOMPOSE_N_WIDTHS; w++) {
                int64_t b = kv_lr_unit_bytes(sl->rank, KV_DECOMPOSE_WIDTHS[w]);
                if (b < least) least = b, sl->bands[0] = (struct kv_lr_band){sl->rank, KV_DECOMPOSE_WIDTHS[w]};
            }
            sl->n_bands = 1;
        }
    }
    int64_t floor = kv_dec_total_bytes(x), skipped = 0;
    for (int64_t i = 0; i < x->n_slots; i++) skipped += x->slots[i].skip;
    if (floor > target && skipped)
        return kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s %g is below %.4f, the smallest cache with the %lld units that "
                       "%s %g leaves uncompressed",
                       n[KV_DECOMPOSE_OPT_RATIO], o->ratio, (double)floor / (double)base,
                       (long long)skipped, n[KV_DECOMPOSE_OPT_COND_SKIP], o->cond_skip);
    if (floor > target)
        return kv_fail(x->err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s %g is below %.4f, the smallest cache that %s %lld and %s %lld allow",
                       n[KV_DECOMPOSE_OPT_RATIO], o->ratio, (double)floor / (double)base,
                       n[KV_DECOMPOSE_OPT_MIN_RANK], (long long)o->min_rank,
                       n[KV_DECOMPOSE_OPT_RANK_MULTIPLE], (long long)o->rank_multiple);
    return KV_OK;
}

int kv_dec_probe_kl(struct kv_dec_ctx *x, double *kl) {
    const struct kv_decompose_opts *o = x->o;
    struct kv_lowrank *lr = NULL;
    int rc = kv_dec_build_lowrank(x, &lr);
    struct kv_compare_result r;
    if (!rc)
        rc = kv_ppl_compare(x->m, lr, kv_lr_info(lr).kv_bits, o->calib_tokens, o->calib_windows * o->seq_len,
                            o->seq_len, o->calib_windows, NULL, NULL, &r, x->err);
    kv_lr_free(lr);
    if (!rc) *kl = r.kl;
    return rc;
}

/* global's ranks; with a byte target also uniform's, and the better kept
 * (kept_uniform): the one of lower measured KL on the calibration windows
 * when there are some (probed), else of lower objective; uniform's cache
 * only where it is no larger than the target or global's own. */
static int global_or_uniform(struct kv_dec_ctx *x, int64_t target) {
    struct kv_decompose_opts *o = x->o;
    kv_dec_global_ranks(x, target, o->eps);
    o->param = 0;
    o->objective = kv_dec_objective(x);
    if (target <= 0) return KV_OK;
    int64_t *save = malloc((size_t)(x->n_slots > 0 ? x->n_slots : 1) * sizeof *save);
    if (!save) return kv_fail(x->err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < x->n_slots; i++) save[i] = x->slots[i].rank;
    int64_t global_bytes = kv_dec_total_bytes(x);
    int rc = KV_OK, probe = o->calib_tokens && o->calib_windows > 0 && o->seq_len >= 2;
    if (probe) rc = kv_dec_probe_kl(x, &o->probe_kl);
    double t = kv_dec_search_param(x, KV_ALLOC_UNIFORM, target);
    o->objective_uniform = kv_dec_objective(x);
    if (!rc && probe) rc = kv_dec_probe_kl(x, &o->probe_kl_uniform);
    o->probed = probe && !rc;
    /* uniform's cache may only win where it is no larger than the target
     * or global's own (its search stops at the first at or above) */
    int64_t ub = kv_dec_total_bytes(x);
    int better = probe ? o->probe_kl_uniform < o->probe_kl : o->objective_uniform < o->objective;
    if (!rc && better && (ub <= target || ub <= global_bytes)) {
        o->kept_uniform = 1, o->param = t;
    } else {
        for (int64_t i = 0; i < x->n_slots; i++) x->slots[i].rank = save[i];
    }
    free(save);
    return rc;
}

/* Every slot's rank by the allocation, and o->param, achieved_bytes and
 * least_bytes. */
static int allocate(struct kv_dec_ctx *x, int64_t target) {
    struct kv_decompose_opts *o = x->o;
    enum kv_alloc a = o->alloc;
    int rc = KV_OK;
    switch (a) {
    case KV_ALLOC_GLOBAL:
        rc = o->kv_bits == KV_DECOMPOSE_BITS_AUTO ? kv_dec_auto_bits(x, target)
                                                  : global_or_uniform(x, target);
        break;
    case KV_ALLOC_LAYER_BUDGET: rc = kv_dec_layer_budget(x, target); break;
    case KV_ALLOC_PROGRESSIVE:
        if (target > 0) o->param = kv_dec_search_param(x, a, target);
        else kv_dec_param_ranks(x, a, o->param = o->d_min / (o->d_max > 0 ? o->d_max : 1.0));
        break;
    case KV_ALLOC_EPS:
        if (target > 0) o->param = kv_dec_search_param(x, a, target);
        else kv_dec_param_ranks(x, a, o->param = o->eps);
        break;
    case KV_ALLOC_REMOVAL: o->param = 1.0 - kv_dec_search_param(x, a, target); break;
    default: o->param = kv_dec_search_param(x, a, target); break;
    }
    o->achieved_bytes = rc ? 0 : kv_dec_total_bytes(x);
    if (!rc && target > 0 && a != KV_ALLOC_GLOBAL && a != KV_ALLOC_UNIFORM) {
        /* the allocation's own parameter at its most aggressive end still
         * keeps more than the target (e.g. progressive with d_max = 1 keeps
         * the most sensitive layer whole): say so instead of pretending */
        int64_t *save = malloc((size_t)(x->n_slots > 0 ? x->n_slots : 1) * sizeof *save);
        if (save) {
            for (int64_t i = 0; i < x->n_slots; i++) save[i] = x->slots[i].rank;
            if (a != KV_ALLOC_LAYER_BUDGET) {
                kv_dec_param_ranks(x, a, 0.0);
                o->least_bytes = kv_dec_total_bytes(x);
            }
            for (int64_t i = 0; i < x->n_slots; i++) x->slots[i].rank = save[i];
            free(save);
        }
    }
    return rc;
}

/* What the result says beyond its factors: the predicted errors, whether the
 * target was reached, and the units a Hadamard rotation leaves out. */
static void summarize(const struct kv_lowrank *lr, struct kv_decompose_opts *o) {
    double ke = 0, kd = 0, ve = 0, vd = 0;
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        kv_lr_side_error(lr, l, 0, &ke, &kd);
        kv_lr_side_error(lr, l, 1, &ve, &vd);
    }
    o->error_k = ke > 0 ? kd / ke : 0;
    o->error_v = ve > 0 ? vd / ve : 0;
    int64_t comp = kv_lr_bytes(lr, lr->info.kv_bits);
    o->target_reached = !(o->ratio > 0 && o->least_bytes > o->target_bytes && comp > o->target_bytes);
    o->odd_rank_units = 0;
    if (o->hadamard && o->kv_bits != KV_DECOMPOSE_BITS_AUTO) /* auto's model counts the blocks */
        for (int64_t l = 0; l < lr->info.n_layers; l++)
            for (int k = 0; k < 2; k++) {
                const struct kv_lr_side *sd = k ? &lr->layers[l].v : &lr->layers[l].k;
                for (int64_t u = 0; u < sd->n_units; u++) {
                    int64_t r = sd->units[u].rank;
                    o->odd_rank_units += r > 1 && (r & 1);
                }
            }
}

int kv_decompose(const struct kv_model *m, const struct kv_stats *s,
                 struct kv_decompose_opts *o, struct kv_lowrank **out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    double t0 = kv_now();
    o->least_bytes = o->achieved_bytes = o->target_bytes = 0;
    o->target_reached = 1, o->odd_rank_units = 0, o->error_k = o->error_v = 0;
    o->objective = o->objective_uniform = 0, o->kept_uniform = 0;
    o->probed = 0, o->probe_kl = o->probe_kl_uniform = 0, o->fixed_kept = 0, o->objective_mix = 0;
    for (int w = 0; w < KV_DECOMPOSE_N_WIDTHS; w++) o->objective_fixed[w] = o->probe_kl_fixed[w] = 0;
    int rc = check_all(m, s, o, err);
    if (rc) return rc;

    enum kv_alloc a = o->alloc;
    struct kv_dec_ctx x = {m, s, o, kv_dec_names(o->names), NULL, 0, 0, err, NULL};
    rc = kv_dec_build_slots(&x);
    if (!rc && a == KV_ALLOC_PROGRESSIVE) rc = kv_dec_lorc_conditions(&x);
    if (!rc && (a == KV_ALLOC_FISHER || (a == KV_ALLOC_GLOBAL && (o->fisher || (s && s->info.has_fisher)))))
        rc = kv_dec_fisher_scores(&x);
    int64_t base = kv_lr_base_bytes(c);
    /* a ratio asks for at least one byte (a tiny one is then below the floor) */
    int64_t target = o->ratio > 0 ? (int64_t)llround(o->ratio * (double)base) : 0;
    if (o->ratio > 0 && target < 1) target = 1;
    if (!rc && target > 0) rc = check_floor(&x, target, base);
    if (!rc) rc = allocate(&x, target);
    o->target_bytes = target;
    if (!rc) rc = kv_dec_build_lowrank(&x, out);
    if (!rc) summarize(*out, o);
    kv_dec_slots_free(x.slots, x.n_slots);
    free(x.turns);
    o->lapack_seconds = x.lapack_s;
    o->seconds = kv_now() - t0;
    /* a numerical failure is in the statistics' numbers: name the file */
    if (rc == KV_ENUMERIC && !err->path[0] && o->stats_path)
        snprintf(err->path, sizeof err->path, "%s", o->stats_path);
    return rc;
}
