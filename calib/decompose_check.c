/* The rules of kvcal decompose's options, in one place: the ones on the
 * options alone (kv_decompose_check, before any model loads) and the ones
 * that need the model and its statistics (kv_decompose_check_model). The
 * CLI and kv_decompose both run them, so a rule and its message are written
 * once; the caller says how the message names each option. */
#include "decompose_ctx.h"
#include "err.h"
#include "kvstats.h"
#include "model.h"

/* The library's own words for the options, for callers with no flags. */
static const char *const quantity_names[KV_DECOMPOSE_OPT_COUNT] = {
    [KV_DECOMPOSE_OPT_METHOD] = "method",
    [KV_DECOMPOSE_OPT_ALLOC] = "allocation",
    [KV_DECOMPOSE_OPT_EPS] = "eps",
    [KV_DECOMPOSE_OPT_RATIO] = "ratio",
    [KV_DECOMPOSE_OPT_GROUP_SIZE] = "group size",
    [KV_DECOMPOSE_OPT_RANK_MULTIPLE] = "rank multiple",
    [KV_DECOMPOSE_OPT_MIN_RANK] = "min rank",
    [KV_DECOMPOSE_OPT_D_MIN] = "d min",
    [KV_DECOMPOSE_OPT_D_MAX] = "d max",
    [KV_DECOMPOSE_OPT_COND_SKIP] = "cond skip",
    [KV_DECOMPOSE_OPT_ERROR_BUDGET] = "error budget",
    [KV_DECOMPOSE_OPT_STATS] = "statistics",
    [KV_DECOMPOSE_OPT_TEXT] = "text",
    [KV_DECOMPOSE_OPT_SEQ_LEN] = "seq len",
    [KV_DECOMPOSE_OPT_WINDOWS] = "windows",
    [KV_DECOMPOSE_OPT_KV_BITS] = "kv bits",
    [KV_DECOMPOSE_OPT_CENTER] = "centring",
    [KV_DECOMPOSE_OPT_BASIS] = "basis",
};

const char *const *kv_dec_names(const char *const *names) {
    return names ? names : quantity_names;
}

/* The largest rank multiple: a rank is at most a unit's width, far below. */
#define MAX_RANK_MULTIPLE (1 << 20)

/* The order is the CLI's: with several options wrong, the first broken rule
 * is the one reported. A zero eps or ratio is "not given"; NaN is given and
 * outside every interval. */
int kv_dec_check_opts(const struct kv_decompose_opts *o, int have_stats, int have_text,
                      const char *const *names, struct kv_err *err) {
    const char *const *n = kv_dec_names(names);
    const char *alloc = n[KV_DECOMPOSE_OPT_ALLOC], *ratio = n[KV_DECOMPOSE_OPT_RATIO];
    const char *eps_n = n[KV_DECOMPOSE_OPT_EPS], *budget_n = n[KV_DECOMPOSE_OPT_ERROR_BUDGET];
    if ((unsigned)o->method >= KV_METHOD_COUNT || (unsigned)o->alloc >= KV_ALLOC_COUNT)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "unknown method or allocation");
    enum kv_alloc a = o->alloc;
    double eps = o->eps, r = o->ratio, budget = o->error_budget;
    if (a == KV_ALLOC_FISHER && !have_stats && !o->fisher)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s fisher needs %s from 'kvcal collect --fisher'", alloc,
                       n[KV_DECOMPOSE_OPT_STATS]);
    if (a == KV_ALLOC_LAYER_BUDGET && !have_text)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s layer-budget needs %s (calibration windows)",
                       alloc, n[KV_DECOMPOSE_OPT_TEXT]);
    if ((unsigned)o->basis >= KV_BASIS_COUNT)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "unknown basis");
    if (o->basis != KV_BASIS_ENERGY && o->method != KV_METHOD_PALU && o->method != KV_METHOD_FDC)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s %s applies to %s palu (keys and values) and fdc (values)",
                       n[KV_DECOMPOSE_OPT_BASIS], kv_basis_name(o->basis), n[KV_DECOMPOSE_OPT_METHOD]);
    if (o->center && !have_stats)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s needs %s: the mean it subtracts is a calibration mean",
                       n[KV_DECOMPOSE_OPT_CENTER], n[KV_DECOMPOSE_OPT_STATS]);
    if (budget < 0) return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be positive", budget_n);
    if (budget > 0 && a != KV_ALLOC_LAYER_BUDGET)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s applies to %s layer-budget", budget_n,
                       alloc);
    if (o->seq_len < 2 || o->calib_windows < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 2 and %s at least 1",
                       n[KV_DECOMPOSE_OPT_SEQ_LEN], n[KV_DECOMPOSE_OPT_WINDOWS]);
    if (eps && r) return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "give %s or %s, not both", eps_n, ratio);
    char num[32];
    if (eps && !(eps > 0 && eps <= 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %s is outside (0, 1]", eps_n,
                       kv_num_str(num, sizeof num, eps));
    if (r && !(r > 0 && r <= 1))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %s is outside (0, 1]", ratio,
                       kv_num_str(num, sizeof num, r));
    /* lorc's own allocation (progressive) takes d_min alone, layer-budget e_b */
    int lorc_default = a == KV_ALLOC_DEFAULT && o->method == KV_METHOD_LORC;
    if (!eps && !r && !(a == KV_ALLOC_PROGRESSIVE && o->d_min > 0) &&
        !(a == KV_ALLOC_LAYER_BUDGET && budget > 0) && !(lorc_default && o->d_min > 0))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "give %s E or %s R", eps_n, ratio);
    if (eps && a != KV_ALLOC_DEFAULT && a != KV_ALLOC_EPS && a != KV_ALLOC_GLOBAL)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s applies to %s eps or global; %s %s takes %s",
                       eps_n, alloc, alloc, kv_alloc_name(a), ratio);
    if (!r && (a == KV_ALLOC_UNIFORM || a == KV_ALLOC_FISHER || a == KV_ALLOC_REMOVAL))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %s needs %s R", alloc, kv_alloc_name(a), ratio);
    int progressive = a == KV_ALLOC_PROGRESSIVE || (lorc_default && !eps);
    if ((o->cond_skip || o->d_min || o->d_max) && !progressive)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s, %s and %s apply to %s progressive",
                       n[KV_DECOMPOSE_OPT_D_MIN], n[KV_DECOMPOSE_OPT_D_MAX],
                       n[KV_DECOMPOSE_OPT_COND_SKIP], alloc);
    if (budget > 0 && r)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "give %s or %s, not both", budget_n, ratio);
    if (o->group_size < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 1",
                       n[KV_DECOMPOSE_OPT_GROUP_SIZE]);
    if (o->rank_multiple < 1 || o->rank_multiple > MAX_RANK_MULTIPLE)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be in 1..%d",
                       n[KV_DECOMPOSE_OPT_RANK_MULTIPLE], MAX_RANK_MULTIPLE);
    if (o->min_rank < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 1",
                       n[KV_DECOMPOSE_OPT_MIN_RANK]);
    const char *bits_n = n[KV_DECOMPOSE_OPT_KV_BITS];
    if (o->kv_bits == KV_DECOMPOSE_BITS_AUTO) {
        if (!r)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "%s auto needs %s R: it shares that many bytes between ranks and bits",
                           bits_n, ratio);
        if (a != KV_ALLOC_DEFAULT && a != KV_ALLOC_GLOBAL)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "%s auto chooses the ranks itself: leave %s out or give global", bits_n,
                           alloc);
        if (!have_stats)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "%s auto needs %s: the latent ranges it models come from them", bits_n,
                           n[KV_DECOMPOSE_OPT_STATS]);
    } else if (!kv_lr_bits_valid(o->kv_bits)) {
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s %lld is not one of " KV_LR_BITS_LIST " or auto", bits_n,
                       (long long)o->kv_bits);
    }
    double dmin = o->d_min, dmax = o->d_max;
    if (dmin < 0 || dmin > 1 || dmax < 0 || dmax > 1 || (dmax > 0 && dmin > dmax))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s and %s are fractions with d-min <= d-max <= 1", n[KV_DECOMPOSE_OPT_D_MIN],
                       n[KV_DECOMPOSE_OPT_D_MAX]);
    return KV_OK;
}

int kv_decompose_check(const struct kv_decompose_opts *o, const char *const *names,
                       struct kv_err *err) {
    return kv_dec_check_opts(o, o->stats_path != NULL, o->text_path != NULL, names, err);
}

int kv_decompose_check_model(const struct kv_decompose_opts *o, const struct kv_model *m,
                             const struct kv_stats *s, const char *const *names,
                             struct kv_err *err) {
    const char *const *n = kv_dec_names(names);
    const struct kv_config *c = &m->cfg;
    if (!s && o->method != KV_METHOD_SVD && o->method != KV_METHOD_LORC)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %s needs %s (run 'kvcal collect' first)",
                       n[KV_DECOMPOSE_OPT_METHOD], kv_method_name(o->method), n[KV_DECOMPOSE_OPT_STATS]);
    int64_t g = c->n_kv_heads, group = o->group_size;
    if (group < 1 || group > g || g % group)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %lld does not divide the model's %lld kv heads",
                       n[KV_DECOMPOSE_OPT_GROUP_SIZE], (long long)group, (long long)g);
    if (s && !kv_shapes_match(c, s->info.n_layers, s->info.dim, s->info.n_heads, s->info.n_kv_heads, s->info.head_dim,
                              "statistics", o->stats_path, err))
        return KV_EINVAL;
    if (s && kv_stats_check_complete(s, o->stats_path, err)) return KV_EINVAL; /* as merge refuses it */
    if (o->basis == KV_BASIS_LOSS && !(s && s->info.has_fisher)) {
        if (o->stats_path)
            return kv_fail(err, KV_EINVAL, o->stats_path, KV_NO_OFFSET,
                           "has no gradient statistics (blk.N.grad_k/v.cov), which %s loss needs: "
                           "collect them with 'kvcal collect --fisher'",
                           n[KV_DECOMPOSE_OPT_BASIS]);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s loss needs gradient statistics from 'kvcal collect --fisher'",
                       n[KV_DECOMPOSE_OPT_BASIS]);
    }
    if (o->alloc == KV_ALLOC_FISHER && !o->fisher && !(s && s->info.has_fisher)) {
        /* the file is the subject when it has a name */
        if (o->stats_path)
            return kv_fail(err, KV_EINVAL, o->stats_path, KV_NO_OFFSET,
                           "has no fisher statistics (blk.N.fisher.k/v), which %s fisher needs",
                           n[KV_DECOMPOSE_OPT_ALLOC]);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s fisher needs fisher statistics (blk.N.fisher.k/v), which this stats file "
                       "does not have",
                       n[KV_DECOMPOSE_OPT_ALLOC]);
    }
    return KV_OK;
}
