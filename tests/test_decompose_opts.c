/* The options of a decomposition:
 *
 *   decompose_opts      impossible options are KV_EINVAL naming the option
 *                       (through kv_decompose);
 *   decompose_check     every rule of kv_decompose_check and
 *                       kv_decompose_check_model: its exact message with the
 *                       quantity names and with kvcal decompose's flags. */
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

/* ================================================================ kv_decompose_check */

/* kvcal decompose's defaults with the statistics given, then "key=value"
 * settings (stats=0 drops the statistics path, text=1 gives a text path,
 * fisher=1 gives scores). */
static struct kv_decompose_opts check_opts(const char *settings) {
    static const double scores[1] = {1};
    struct kv_decompose_opts o;
    kv_decompose_defaults(&o);
    o.stats_path = "s.kvstats";
    char buf[256];
    snprintf(buf, sizeof buf, "%s", settings);
    for (char *kv = strtok(buf, " "); kv; kv = strtok(NULL, " ")) {
        char *v = strchr(kv, '=');
        cr_assert(v, "setting '%s' has no value", kv);
        *v++ = 0;
        double x = strtod(v, NULL);
        if (!strcmp(kv, "method")) o.method = kv_method_parse(v) >= 0 ? kv_method_parse(v) : atoi(v);
        else if (!strcmp(kv, "alloc")) o.alloc = kv_alloc_parse(v);
        else if (!strcmp(kv, "eps")) o.eps = x;
        else if (!strcmp(kv, "ratio")) o.ratio = x;
        else if (!strcmp(kv, "group")) o.group_size = (int64_t)x;
        else if (!strcmp(kv, "mult")) o.rank_multiple = (int64_t)x;
        else if (!strcmp(kv, "min_rank")) o.min_rank = (int64_t)x;
        else if (!strcmp(kv, "kv_bits")) o.kv_bits = strtoll(v, NULL, 10);
        else if (!strcmp(kv, "d_min")) o.d_min = x;
        else if (!strcmp(kv, "d_max")) o.d_max = x;
        else if (!strcmp(kv, "cond_skip")) o.cond_skip = x;
        else if (!strcmp(kv, "budget")) o.error_budget = x;
        else if (!strcmp(kv, "seq_len")) o.seq_len = (int64_t)x;
        else if (!strcmp(kv, "windows")) o.calib_windows = (int64_t)x;
        else if (!strcmp(kv, "stats")) o.stats_path = x ? "s.kvstats" : NULL;
        else if (!strcmp(kv, "text")) o.text_path = x ? "t.txt" : NULL;
        else if (!strcmp(kv, "fisher")) o.fisher = x ? scores : NULL;
        else cr_assert_fail("unknown setting '%s'", kv);
    }
    return o;
}

/* Every rule once, in the order they are checked: the message with the
 * quantity names (names NULL) and with the CLI's flags, which
 * tests/test_cmd_decompose.c pins as kvcal decompose's usage errors. */
static const struct {
    const char *settings, *quantities, *flags;
} check_rows[] = {
    {"method=17 ratio=0.5", "unknown method or allocation", "unknown method or allocation"},
    {"alloc=fisher stats=0 ratio=0.5", "allocation fisher needs statistics from 'kvcal collect --fisher'",
     "--alloc fisher needs --stats from 'kvcal collect --fisher'"},
    {"alloc=layer-budget budget=0.1", "allocation layer-budget needs text (calibration windows)",
     "--alloc layer-budget needs --text (calibration windows)"},
    {"budget=-1 ratio=0.5", "error budget must be positive", "--error-budget must be positive"},
    {"budget=0.1 ratio=0.5", "error budget applies to allocation layer-budget",
     "--error-budget applies to --alloc layer-budget"},
    {"seq_len=1 ratio=0.5", "seq len must be at least 2 and windows at least 1",
     "--seq-len must be at least 2 and --windows at least 1"},
    {"windows=0 ratio=0.5", "seq len must be at least 2 and windows at least 1",
     "--seq-len must be at least 2 and --windows at least 1"},
    {"eps=0.9 ratio=0.5", "give eps or ratio, not both", "give --eps or --ratio, not both"},
    {"eps=1.5", "eps 1.5 is outside (0, 1]", "--eps 1.5 is outside (0, 1]"},
    {"eps=-0.1", "eps -0.1 is outside (0, 1]", "--eps -0.1 is outside (0, 1]"},
    {"eps=nan", "eps nan is outside (0, 1]", "--eps nan is outside (0, 1]"},
    {"ratio=2", "ratio 2 is outside (0, 1]", "--ratio 2 is outside (0, 1]"},
    {"ratio=nan", "ratio nan is outside (0, 1]", "--ratio nan is outside (0, 1]"},
    {"method=palu", "give eps E or ratio R", "give --eps E or --ratio R"},
    {"method=lorc", "give eps E or ratio R", "give --eps E or --ratio R"},
    {"alloc=progressive", "give eps E or ratio R", "give --eps E or --ratio R"},
    {"alloc=uniform eps=0.9", "eps applies to allocation eps or global; allocation uniform takes ratio",
     "--eps applies to --alloc eps or global; --alloc uniform takes --ratio"},
    {"alloc=layer-budget text=1 eps=0.9",
     "eps applies to allocation eps or global; allocation layer-budget takes ratio",
     "--eps applies to --alloc eps or global; --alloc layer-budget takes --ratio"},
    {"ratio=0.5 cond_skip=3", "d min, d max and cond skip apply to allocation progressive",
     "--d-min, --d-max and --cond-skip apply to --alloc progressive"},
    {"method=lorc eps=0.9 d_min=0.2", "d min, d max and cond skip apply to allocation progressive",
     "--d-min, --d-max and --cond-skip apply to --alloc progressive"},
    {"alloc=layer-budget text=1 budget=0.1 ratio=0.5", "give error budget or ratio, not both",
     "give --error-budget or --ratio, not both"},
    {"group=0 ratio=0.5", "group size must be at least 1", "--group-size must be at least 1"},
    {"group=-2 ratio=0.5", "group size must be at least 1", "--group-size must be at least 1"},
    {"mult=0 ratio=0.5", "rank multiple must be in 1..1048576", "--rank-multiple must be in 1..1048576"},
    {"mult=2000000 ratio=0.5", "rank multiple must be in 1..1048576",
     "--rank-multiple must be in 1..1048576"},
    {"min_rank=0 ratio=0.5", "min rank must be at least 1", "--min-rank must be at least 1"},
    {"kv_bits=5 ratio=0.5", "kv bits 5 is not one of 16, 8, 4, 3, 2 or auto",
     "--kv-bits 5 is not one of 16, 8, 4, 3, 2 or auto"},
    {"kv_bits=0 ratio=0.5", "kv bits 0 is not one of 16, 8, 4, 3, 2 or auto",
     "--kv-bits 0 is not one of 16, 8, 4, 3, 2 or auto"},
    {"kv_bits=4294967312 ratio=0.5", "kv bits 4294967312 is not one of 16, 8, 4, 3, 2 or auto",
     "--kv-bits 4294967312 is not one of 16, 8, 4, 3, 2 or auto"},
    /* kv_bits -1: auto */
    {"kv_bits=-1 eps=0.9", "kv bits auto needs ratio R: it shares that many bytes between ranks and bits",
     "--kv-bits auto needs --ratio R: it shares that many bytes between ranks and bits"},
    {"kv_bits=-1 alloc=uniform ratio=0.5",
     "kv bits auto chooses the ranks itself: leave allocation out or give global",
     "--kv-bits auto chooses the ranks itself: leave --alloc out or give global"},
    {"kv_bits=-1 stats=0 method=svd ratio=0.5",
     "kv bits auto needs statistics: the latent ranges it models come from them",
     "--kv-bits auto needs --stats: the latent ranges it models come from them"},
    {"alloc=progressive d_min=0.8 d_max=0.5", "d min and d max are fractions with d-min <= d-max <= 1",
     "--d-min and --d-max are fractions with d-min <= d-max <= 1"},
    {"method=lorc ratio=0.5 d_min=-0.1", "d min and d max are fractions with d-min <= d-max <= 1",
     "--d-min and --d-max are fractions with d-min <= d-max <= 1"},
    {"alloc=progressive d_min=0.1 d_max=2", "d min and d max are fractions with d-min <= d-max <= 1",
     "--d-min and --d-max are fractions with d-min <= d-max <= 1"},
    /* several broken: the first rule in the order wins */
    {"eps=2 ratio=3 group=0 kv_bits=7", "give eps or ratio, not both", "give --eps or --ratio, not both"},
    {"kv_bits=7 min_rank=0 ratio=0.5", "min rank must be at least 1", "--min-rank must be at least 1"},
    {"alloc=fisher seq_len=1 eps=3", "seq len must be at least 2 and windows at least 1",
     "--seq-len must be at least 2 and --windows at least 1"},
};

Test(decompose_check, each_rule_is_one_message_naming_quantities_or_flags) {
    for (size_t i = 0; i < sizeof check_rows / sizeof check_rows[0]; i++)
        for (int flags = 0; flags < 2; flags++) {
            struct kv_decompose_opts o = check_opts(check_rows[i].settings);
            struct kv_err err;
            kv_err_clear(&err);
            int rc = kv_decompose_check(&o, flags ? kv_decompose_flag_names : NULL, &err);
            const char *want = flags ? check_rows[i].flags : check_rows[i].quantities;
            cr_assert_eq(rc, KV_EINVAL, "'%s' (%s): status %s (%s)", check_rows[i].settings,
                         flags ? "flags" : "quantities", kv_status_name(rc), err.msg);
            cr_assert_eq(err.code, KV_EINVAL);
            cr_assert_str_eq(err.msg, want, "'%s' (%s)", check_rows[i].settings,
                             flags ? "flags" : "quantities");
            cr_assert_str_eq(err.path, "", "'%s': an option error names no file", check_rows[i].settings);
        }
}

Test(decompose_check, accepts_every_allocation_with_what_it_needs) {
    const char *good[] = {
        "ratio=0.5", "eps=0.9", "eps=1", "ratio=1", "method=svd stats=0 ratio=0.5",
        "method=lorc d_min=0.3", "method=lorc ratio=0.5 d_max=0.9 cond_skip=2",
        "alloc=progressive d_min=0.2 d_max=0.2", "alloc=layer-budget text=1 budget=0.1",
        "alloc=layer-budget text=1 ratio=0.5", "alloc=global eps=0.95 min_rank=2",
        "alloc=fisher stats=0 fisher=1 ratio=0.5", "alloc=eps ratio=0.5 mult=2",
        "kv_bits=2 ratio=0.5 mult=1048576 group=3", "seq_len=2 windows=1 ratio=0.5",
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        struct kv_decompose_opts o = check_opts(good[i]);
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose_check(&o, NULL, &err), KV_OK, "'%s': %s", good[i], err.msg);
    }
}

/* The rules on the model and the statistics: about the options (no path),
 * or about the statistics file, named when the options have its path. */
Test(decompose_check, model_rules_name_quantities_or_flags_and_the_file) {
    struct opts_env e = opts_env(); /* g = 4, statistics without fisher sums */
    static const struct {
        const char *settings;
        int with_stats;
        const char *path, *quantities, *flags;
    } rows[] = {
        {"method=palu stats=0 ratio=0.5", 0, "", "method palu needs statistics (run 'kvcal collect' first)",
         "--method palu needs --stats (run 'kvcal collect' first)"},
        {"method=zack stats=0 group=3 ratio=0.5", 0, "",
         "method zack needs statistics (run 'kvcal collect' first)",
         "--method zack needs --stats (run 'kvcal collect' first)"},
        {"group=3 ratio=0.5", 1, "", "group size 3 does not divide the model's 4 kv heads",
         "--group-size 3 does not divide the model's 4 kv heads"},
        {"method=svd stats=0 group=8 ratio=0.5", 0, "", "group size 8 does not divide the model's 4 kv heads",
         "--group-size 8 does not divide the model's 4 kv heads"},
        {"alloc=fisher ratio=0.5", 1, "s.kvstats",
         "has no fisher statistics (blk.N.fisher.k/v), which allocation fisher needs",
         "has no fisher statistics (blk.N.fisher.k/v), which --alloc fisher needs"},
        {"alloc=fisher stats=0 ratio=0.5", 1, "",
         "allocation fisher needs fisher statistics (blk.N.fisher.k/v), which this stats file does not have",
         "--alloc fisher needs fisher statistics (blk.N.fisher.k/v), which this stats file does not have"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        for (int flags = 0; flags < 2; flags++) {
            struct kv_decompose_opts o = check_opts(rows[i].settings);
            struct kv_err err;
            kv_err_clear(&err);
            int rc = kv_decompose_check_model(&o, e.m, rows[i].with_stats ? e.s : NULL,
                                              flags ? kv_decompose_flag_names : NULL, &err);
            cr_assert_eq(rc, KV_EINVAL, "'%s': status %s", rows[i].settings, kv_status_name(rc));
            cr_assert_str_eq(err.msg, flags ? rows[i].flags : rows[i].quantities, "'%s'", rows[i].settings);
            cr_assert_str_eq(err.path, rows[i].path, "'%s'", rows[i].settings);
        }
    const char *good[] = {"method=svd stats=0 ratio=0.5", "method=lorc stats=0 ratio=0.5",
                          "group=4 ratio=0.5", "group=2 ratio=0.5", "alloc=fisher fisher=1 ratio=0.5"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        struct kv_decompose_opts o = check_opts(good[i]);
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose_check_model(&o, e.m, o.stats_path ? e.s : NULL, NULL, &err), KV_OK,
                     "'%s': %s", good[i], err.msg);
    }
    opts_env_free(&e);
}

/* Statistics that are an unfinished checkpoint are refused, naming the
 * file, as merge refuses them (before, decompose used the windows summed
 * so far without a word). */
Test(decompose_check, refuses_an_unfinished_checkpoint) {
    struct opts_env e = opts_env();
    int64_t done = e.s->info.next_window;
    e.s->info.plan_windows = done + 3;
    struct kv_decompose_opts o = check_opts("ratio=0.5");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose_check_model(&o, e.m, e.s, kv_decompose_flag_names, &err), KV_EINVAL);
    char want[256];
    snprintf(want, sizeof want,
             "an unfinished checkpoint (%lld of %lld windows); finish it with 'kvcal collect --resume' first",
             (long long)done, (long long)done + 3);
    cr_assert_str_eq(err.msg, want);
    cr_assert_str_eq(err.path, "s.kvstats");
    e.s->info.plan_windows = done;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose_check_model(&o, e.m, e.s, kv_decompose_flag_names, &err), KV_OK, "%s", err.msg);
    opts_env_free(&e);
}

/* kv_decompose names the options as o->names says, also in the messages
 * only a run can give (the floor of the cache); NULL is the library's
 * quantity names. */
Test(decompose_check, kv_decompose_names_options_as_asked) {
    struct opts_env e = opts_env();
    const char *names[KV_DECOMPOSE_OPT_COUNT];
    for (int i = 0; i < KV_DECOMPOSE_OPT_COUNT; i++) names[i] = "?";
    names[KV_DECOMPOSE_OPT_RATIO] = "R", names[KV_DECOMPOSE_OPT_MIN_RANK] = "m";
    names[KV_DECOMPOSE_OPT_RANK_MULTIPLE] = "k", names[KV_DECOMPOSE_OPT_EPS] = "E";
    for (int given = 0; given < 2; given++) {
        struct kv_decompose_opts o = opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 0, 0.01, 1);
        o.names = given ? names : NULL;
        struct kv_lowrank *lr = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose(e.m, e.s, &o, &lr, &err), KV_EINVAL);
        cr_assert_null(lr);
        cr_assert_str_eq(err.msg, given ? "R 0.01 is below 0.1250, the smallest cache that m 1 and k 1 allow"
                                        : "ratio 0.01 is below 0.1250, the smallest cache that min rank 1 "
                                          "and rank multiple 1 allow");
        o = opts_of(KV_METHOD_PALU, KV_ALLOC_UNIFORM, 1.5, 0, 1);
        o.names = given ? names : NULL;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose(e.m, e.s, &o, &lr, &err), KV_EINVAL);
        cr_assert_str_eq(err.msg, given ? "E 1.5 is outside (0, 1]" : "eps 1.5 is outside (0, 1]");
    }
    opts_env_free(&e);
}
