/* The options of a decomposition:
 *
 *   decompose_opts      impossible options are KV_EINVAL naming the option
 *                       (through kv_decompose). */
#include "decompose_fixtures.h"

/* ================================================================ options */

/* GQA 8/4 so that a group size can fail to divide g. */
static struct kv_config opts_cfg(void) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    c.n_heads = 8, c.n_kv_heads = 4;
    return c;
}

struct opts_env {
    struct kv_model *m;
    struct kv_stats *s;
};

static struct opts_env opts_env(void) {
    struct opts_env e;
    e.m = random_model_cfg(opts_cfg(), 71);
    int32_t *tok = random_tokens(2 * 64, 97, 72);
    e.s = collect(e.m, tok, 64, 2);
    free(tok);
    return e;
}

static void opts_env_free(struct opts_env *e) {
    kv_stats_free(e->s);
    kv_model_close(e->m);
}

/* kv_decompose must fail with code, a message containing each of the
 * NULL-terminated needles, and no result. */
static void expect_refusal(const struct kv_model *m, const struct kv_stats *s,
                           struct kv_decompose_opts o, int code, const char *what, ...) {
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_decompose(m, s, &o, &lr, &err);
    cr_assert_eq(rc, code, "%s: status %s (%s), expected %s", what, kv_status_name(rc), err.msg,
                 kv_status_name(code));
    cr_assert_eq(err.code, code, "%s: err.code", what);
    cr_assert_null(lr, "%s: a result came back with the error", what);
    va_list ap;
    va_start(ap, what);
    for (const char *needle; (needle = va_arg(ap, const char *));)
        cr_assert(strstr(err.msg, needle), "%s: message '%s' does not contain '%s'", what, err.msg,
                  needle);
    va_end(ap);
}

Test(decompose_opts, rejects_eps_outside_the_unit_interval) {
    struct opts_env e = opts_env();
    double bad[] = {-0.1, -1, 1.0000001, 1.5, 7};
    for (int i = 0; i < 5; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, bad[i], 0, 1), KV_EINVAL, "eps",
                       "--eps", "(0, 1]", NULL);
    /* the edges of the interval are accepted */
    kv_lr_free(decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, 1.0, 0, 1), "eps 1"));
    kv_lr_free(decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, 1e-9, 0, 1), "eps tiny"));
    opts_env_free(&e);
}

Test(decompose_opts, rejects_ratio_outside_the_unit_interval) {
    struct opts_env e = opts_env();
    double bad[] = {-0.2, -1, 1.01, 2};
    for (int i = 0; i < 4; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, bad[i], 1), KV_EINVAL,
                       "ratio", "--ratio", "(0, 1]", NULL);
    kv_lr_free(decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 1.0, 1), "ratio 1"));
    opts_env_free(&e);
}

/* NaN is outside (0, 1] too; the library must not take it for "not given". */
Test(decompose_opts, rejects_nan_eps_and_ratio) {
    struct opts_env e = opts_env();
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_DEFAULT, NAN, 0.5, 1), KV_EINVAL,
                   "nan eps with a ratio", "--eps", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_EPS, 0.9, NAN, 1), KV_EINVAL,
                   "nan ratio with an eps", "--ratio", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, NAN, 1), KV_EINVAL,
                   "nan ratio", "--ratio", "outside", NULL);
    opts_env_free(&e);
}

Test(decompose_opts, rejects_eps_together_with_ratio) {
    struct opts_env e = opts_env();
    enum kv_alloc allocs[] = {KV_ALLOC_DEFAULT, KV_ALLOC_EPS, KV_ALLOC_GLOBAL};
    for (int i = 0; i < 3; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, allocs[i], 0.9, 0.5, 1), KV_EINVAL,
                       "eps and ratio", "--eps", "--ratio", NULL);
    opts_env_free(&e);
}

/* The smallest cache: every unit at max(min_rank, 1) rounded up to the rank
 * multiple, fp16. A ratio below it is refused naming it; the floor itself is
 * accepted. */
Test(decompose_opts, rejects_a_ratio_below_the_floor_naming_the_floor) {
    struct opts_env e = opts_env();
    const struct kv_config *c = kv_model_config(e.m);
    int64_t base = kv_lr_base_bytes(c), dh = c->head_dim;
    struct {
        int64_t group, min_rank, mult;
    } cases[] = {{1, 1, 1}, {1, 3, 1}, {1, 1, 4}, {2, 3, 2}, {4, 5, 1}};
    for (int i = 0; i < 5; i++) {
        int64_t units = c->n_layers * 2 * (c->n_kv_heads / cases[i].group);
        int64_t r = admissible(cases[i].min_rank, cases[i].min_rank, cases[i].mult, cases[i].group * dh);
        double floor = (double)(units * 2 * r) / (double)base;
        char fl[32], what[64];
        snprintf(fl, sizeof fl, "%.4f", floor);
        snprintf(what, sizeof what, "floor %s", fl);
        struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, floor * 0.9, cases[i].group);
        o.min_rank = cases[i].min_rank, o.rank_multiple = cases[i].mult;
        expect_refusal(e.m, e.s, o, KV_EINVAL, what, "--ratio", fl, NULL);
        o.ratio = floor;
        struct kv_lowrank *lr = decompose_ok(e.m, e.s, o, what);
        cr_assert_eq(kv_lr_bytes(lr, 16), units * 2 * r, "%s: the floor itself", what);
        kv_lr_free(lr);
    }
    opts_env_free(&e);
}

Test(decompose_opts, rejects_a_group_size_that_does_not_divide_the_kv_heads) {
    struct opts_env e = opts_env(); /* g = 4 */
    int64_t bad[] = {3, 5, 8, -1};
    for (int i = 0; i < 4; i++)
        expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, bad[i]), KV_EINVAL,
                       "group size", "--group-size", NULL);
    int64_t good[] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        struct kv_lowrank *lr =
            decompose_ok(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, good[i]), "group");
        cr_assert_eq(lr->layers[0].k.n_units, 4 / good[i]);
        cr_assert_eq(lr->layers[0].k.units[0].n_heads, good[i]);
        kv_lr_free(lr);
    }
    opts_env_free(&e);
}

Test(decompose_opts, rejects_fisher_without_scores) {
    struct opts_env e = opts_env();
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0.5, 1), KV_EINVAL, "fisher",
                   "fisher", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_PALU, KV_ALLOC_FISHER, 0, 0, 1), KV_EINVAL,
                   "fisher without a ratio", "--ratio", NULL);
    opts_env_free(&e);
}

Test(decompose_opts, rejects_data_methods_without_statistics) {
    struct opts_env e = opts_env();
    enum kv_method need[] = {KV_METHOD_PALU, KV_METHOD_EIGEN, KV_METHOD_FDC, KV_METHOD_ZACK};
    for (int i = 0; i < 4; i++)
        expect_refusal(e.m, NULL, opts_of(need[i], KV_ALLOC_DEFAULT, 0, 0.5, 1), KV_EINVAL,
                       kv_method_name(need[i]), kv_method_name(need[i]), "--stats", NULL);
    /* svd and lorc work from the weights alone */
    kv_lr_free(decompose_ok(e.m, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1), "svd"));
    kv_lr_free(decompose_ok(e.m, NULL, opts_of(KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0.5, 1), "lorc"));
    opts_env_free(&e);
}

Test(decompose_opts, rejects_statistics_of_another_model) {
    struct opts_env e = opts_env();
    struct kv_config shapes[3];
    for (int i = 0; i < 3; i++) shapes[i] = opts_cfg();
    shapes[0].dim = 64;
    shapes[1].n_layers = 3;
    shapes[2].n_heads = 4, shapes[2].n_kv_heads = 2, shapes[2].head_dim = 12;
    for (int i = 0; i < 3; i++) {
        struct kv_model *other = random_model_cfg(shapes[i], 73 + i);
        int32_t *tok = random_tokens(64, 97, 80 + i);
        struct kv_stats *s2 = collect(other, tok, 64, 1);
        enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_SVD};
        for (int mi = 0; mi < 2; mi++)
            expect_refusal(e.m, s2, opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1), KV_EINVAL,
                           "stats of another shape", "statistics", NULL);
        kv_stats_free(s2);
        free(tok);
        kv_model_close(other);
    }
    opts_env_free(&e);
}

Test(decompose_opts, rejects_bad_kv_bits_and_allocation_mismatches) {
    struct opts_env e = opts_env();
    struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.5, 1);
    o.kv_bits = 5;
    expect_refusal(e.m, e.s, o, KV_EINVAL, "kv bits", "--kv-bits", NULL);
    o = opts_of(KV_METHOD_LORC, KV_ALLOC_PROGRESSIVE, 0.9, 0, 1);
    o.d_min = 0.3;
    expect_refusal(e.m, e.s, o, KV_EINVAL, "eps with progressive", "--eps", "progressive", NULL);
    expect_refusal(e.m, e.s, opts_of(KV_METHOD_FDC, KV_ALLOC_REMOVAL, 0, 0, 1), KV_EINVAL,
                   "removal without ratio", "--ratio", NULL);
    opts_env_free(&e);
}
