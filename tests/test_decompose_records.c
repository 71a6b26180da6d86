/* The manifest's records of a decomposition (calib/decompose_records.c):
 *
 *   decompose_records   kv_decompose_records and the kvcal.json that
 *                       kv_decompose_write writes carry the "options" and
 *                       "stats" objects kvcal decompose wrote before they
 *                       moved into the library: the expected objects are the
 *                       ones the earlier binary wrote, on tinystories-656K,
 *                       for option sets whose records do not depend on the
 *                       calibration sample (statistics from kv_accum here). */
#include <jansson.h>

#include "decompose_fixtures.h"

/* JSON text in one canonical form (compact, members in their order, reals
 * with 17 digits as kvcal.json has them), malloc'd. */
static char *canonical(const char *text, const char *what) {
    json_error_t je;
    json_t *v = json_loads(text, JSON_DECODE_ANY, &je);
    cr_assert(v, "%s: not JSON (%s): %s", what, je.text, text);
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(17));
    json_decref(v);
    cr_assert(s);
    return s;
}

static void assert_same_json(const char *got, const char *want, const char *what) {
    char *g = canonical(got, what), *w = canonical(want, what);
    cr_assert_str_eq(g, w, "%s:\n got  %s\n want %s", what, g, w);
    free(g), free(w);
}

/* The member `key` of dir/kvcal.json as compact text, malloc'd. */
static char *manifest_member(const char *dir, const char *key) {
    char *path = kvt_path(dir, "kvcal.json");
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    cr_assert(root, "%s: %s", path, je.text);
    json_t *v = json_object_get(root, key);
    cr_assert(v, "%s has no '%s'", path, key);
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(17));
    json_decref(root);
    free(path);
    return s;
}

/* "options" of the earlier kvcal decompose on tinystories-656K (its
 * kvcal.json), and the command line that wrote it. */
static const struct {
    const char *args;
    enum kv_method method;
    enum kv_alloc alloc;
    double eps, ratio, d_min, d_max, cond_skip, budget;
    int64_t mult, min_rank, kv_bits;
    int hadamard, stats;
    const char *options;
} option_rows[] = {
    {"-s S --eps 0.9", KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0.9, 0, 0, 0, 0, 0, 1, 1, 16, 0, 1,
     "{\"method\": \"palu\", \"alloc\": \"eps\", \"eps\": 0.90000000000000002, \"ratio\": null, "
     "\"group_size\": 1, \"rank_multiple\": 1, \"min_rank\": 1, \"kv_bits\": 16, \"hadamard\": false, "
     "\"searched_parameter\": 0.90000000000000002}"},
    {"--method svd --ratio 0.5", KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 0, 0, 0, 0, 1, 1, 16, 0, 0,
     "{\"method\": \"svd\", \"alloc\": \"uniform\", \"eps\": null, \"ratio\": 0.5, \"group_size\": 1, "
     "\"rank_multiple\": 1, \"min_rank\": 1, \"kv_bits\": 16, \"hadamard\": false, "
     "\"searched_parameter\": 0.46875}"},
    {"--method lorc --ratio 0.5 --d-max 0.9", KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0.5, 0, 0.9, 0, 0, 1,
     1, 16, 0, 0,
     "{\"method\": \"lorc\", \"alloc\": \"progressive\", \"eps\": null, \"ratio\": 0.5, "
     "\"group_size\": 1, \"rank_multiple\": 1, \"min_rank\": 1, \"kv_bits\": 16, \"hadamard\": false, "
     "\"searched_parameter\": 0.095486111111111105, \"d_min\": 0.0859375, \"d_max\": "
     "0.90000000000000002, \"cond_skip\": null}"},
    {"-s S --method lorc --d-min 0.3 --cond-skip 1", KV_METHOD_LORC, KV_ALLOC_DEFAULT, 0, 0, 0.3, 0, 1,
     0, 1, 1, 16, 0, 1,
     "{\"method\": \"lorc\", \"alloc\": \"progressive\", \"eps\": null, \"ratio\": null, "
     "\"group_size\": 1, \"rank_multiple\": 1, \"min_rank\": 1, \"kv_bits\": 16, \"hadamard\": false, "
     "\"searched_parameter\": 0.29999999999999999, \"d_min\": 0.29999999999999999, \"d_max\": 1.0, "
     "\"cond_skip\": 1.0}"},
    {"-s S --alloc global --eps 0.95 --min-rank 2", KV_METHOD_PALU, KV_ALLOC_GLOBAL, 0.95, 0, 0, 0, 0, 0,
     1, 2, 16, 0, 1,
     "{\"method\": \"palu\", \"alloc\": \"global\", \"eps\": 0.94999999999999996, \"ratio\": null, "
     "\"group_size\": 1, \"rank_multiple\": 1, \"min_rank\": 2, \"kv_bits\": 16, \"hadamard\": false, "
     "\"searched_parameter\": 0.0}"},
    {"-s S --ratio 0.5 --hadamard --rank-multiple 8 --kv-bits 4", KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0,
     0.5, 0, 0, 0, 0, 8, 1, 4, 1, 1,
     "{\"method\": \"palu\", \"alloc\": \"uniform\", \"eps\": null, \"ratio\": 0.5, \"group_size\": 1, "
     "\"rank_multiple\": 8, \"min_rank\": 1, \"kv_bits\": 4, \"hadamard\": true, "
     "\"searched_parameter\": 1.0}"},
    {"-s S --ratio 0.6 --min-rank 3 --rank-multiple 2", KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0, 0.6, 0, 0,
     0, 0, 2, 3, 16, 0, 1,
     "{\"method\": \"palu\", \"alloc\": \"uniform\", \"eps\": null, \"ratio\": 0.59999999999999998, "
     "\"group_size\": 1, \"rank_multiple\": 2, \"min_rank\": 3, \"kv_bits\": 16, \"hadamard\": false, "
     "\"searched_parameter\": 0.53125}"},
    {"-s S --alloc layer-budget --error-budget 0.2 -t T --seq-len 64 --windows 2", KV_METHOD_PALU,
     KV_ALLOC_LAYER_BUDGET, 0, 0, 0, 0, 0, 0.2, 1, 1, 16, 0, 1,
     "{\"method\": \"palu\", \"alloc\": \"layer-budget\", \"eps\": null, \"ratio\": null, "
     "\"group_size\": 1, \"rank_multiple\": 1, \"min_rank\": 1, \"kv_bits\": 16, \"hadamard\": false, "
     "\"searched_parameter\": 0.20000000000000001}"},
};

Test(decompose_records, options_are_what_kvcal_decompose_wrote, .timeout = 120) {
    struct shared sh = open_shared(1);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, CAL_WINDOWS);
    for (size_t i = 0; i < sizeof option_rows / sizeof option_rows[0]; i++) {
        const char *what = option_rows[i].args;
        struct kv_decompose_opts o;
        kv_decompose_defaults(&o);
        o.method = option_rows[i].method, o.alloc = option_rows[i].alloc;
        o.eps = option_rows[i].eps, o.ratio = option_rows[i].ratio;
        o.d_min = option_rows[i].d_min, o.d_max = option_rows[i].d_max;
        o.cond_skip = option_rows[i].cond_skip, o.error_budget = option_rows[i].budget;
        o.rank_multiple = option_rows[i].mult, o.min_rank = option_rows[i].min_rank;
        o.kv_bits = option_rows[i].kv_bits, o.hadamard = option_rows[i].hadamard;
        if (o.alloc == KV_ALLOC_LAYER_BUDGET) {
            o.calib_tokens = sh.tok, o.seq_len = 64, o.calib_windows = 2;
            o.text_path = "val1k.txt";
        }
        const struct kv_stats *st = option_rows[i].stats ? s : NULL;
        if (st) o.stats_path = "656K.kvstats";
        struct kv_lowrank *lr = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_decompose(sh.m, st, &o, &lr, &err), KV_OK, "%s: %s", what, fmt_err(&err));
        char *opts_txt = NULL, *stats_txt = NULL;
        cr_assert_eq(kv_decompose_records(&o, st, &opts_txt, &stats_txt, &err), KV_OK, "%s: %s", what,
                     fmt_err(&err));
        assert_same_json(opts_txt, option_rows[i].options, what);
        if (!st) cr_assert_str_eq(stats_txt, "null", "%s", what);
        /* and the manifest written with them */
        char *dir = kvt_temp_dir();
        cr_assert_eq(kv_decompose_write(sh.m, lr, &o, st, kvt_shared(M656_REL), NULL, dir, &err), KV_OK,
                     "%s: %s", what, fmt_err(&err));
        char *written = manifest_member(dir, "options");
        assert_same_json(written, option_rows[i].options, what);
        free(written);
        kvt_rm_dir(dir);
        free(opts_txt), free(stats_txt);
        kv_lr_free(lr);
    }
    kv_stats_free(s);
    shared_free(&sh);
}

/* "stats" of the earlier kvcal decompose: the statistics' path as given
 * (bytes that are not UTF-8 replaced by U+FFFD), fingerprint and counts;
 * null without statistics. */
Test(decompose_records, stats_are_what_kvcal_decompose_wrote, .timeout = 120) {
    struct shared sh = open_shared(1);
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, CAL_WINDOWS);
    cr_assert_str_eq(s->info.fingerprint, "49a6d8998ba1bff65c7df92b43d0d56ae417162bd7ad7760f95c3b6b32108087");
    static const struct {
        const char *path;
        int64_t tokens, windows, seq_len;
        int fisher;
        const char *stats;
    } rows[] = {
        {"calib/c-656K.kvstats", 4096, 16, 256, 0,
         "{\"path\": \"calib/c-656K.kvstats\", \"model_fingerprint\": "
         "\"49a6d8998ba1bff65c7df92b43d0d56ae417162bd7ad7760f95c3b6b32108087\", \"tokens\": 4096, "
         "\"windows\": 16, \"seq_len\": 256, \"fisher\": false}"},
        {"calib/c-656K-fisher.kvstats", 1024, 8, 128, 1,
         "{\"path\": \"calib/c-656K-fisher.kvstats\", \"model_fingerprint\": "
         "\"49a6d8998ba1bff65c7df92b43d0d56ae417162bd7ad7760f95c3b6b32108087\", \"tokens\": 1024, "
         "\"windows\": 8, \"seq_len\": 128, \"fisher\": true}"},
        {"calib/c-656K-\xff\xfex.kvstats", 4096, 16, 256, 0,
         "{\"path\": \"calib/c-656K-\xef\xbf\xbd\xef\xbf\xbdx.kvstats\", "
         "\"model_fingerprint\": \"49a6d8998ba1bff65c7df92b43d0d56ae417162bd7ad7760f95c3b6b32108087\", "
         "\"tokens\": 4096, \"windows\": 16, \"seq_len\": 256, \"fisher\": false}"},
    };
    struct kv_decompose_opts o;
    kv_decompose_defaults(&o);
    o.method = KV_METHOD_SVD, o.ratio = 0.5;
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_decompose(sh.m, s, &o, &lr, &err), KV_OK, "%s", fmt_err(&err));
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        /* the record reads only these fields of the statistics */
        s->info.tokens = rows[i].tokens, s->info.windows = rows[i].windows, s->info.seq_len = rows[i].seq_len;
        s->info.has_fisher = rows[i].fisher;
        o.stats_path = rows[i].path;
        char *opts_txt = NULL, *stats_txt = NULL;
        cr_assert_eq(kv_decompose_records(&o, s, &opts_txt, &stats_txt, &err), KV_OK, "%s", fmt_err(&err));
        assert_same_json(stats_txt, rows[i].stats, rows[i].path);
        char *dir = kvt_temp_dir();
        cr_assert_eq(kv_decompose_write(sh.m, lr, &o, s, kvt_shared(M656_REL), NULL, dir, &err), KV_OK,
                     "%s", fmt_err(&err));
        char *written = manifest_member(dir, "stats");
        assert_same_json(written, rows[i].stats, rows[i].path);
        free(written);
        kvt_rm_dir(dir);
        free(opts_txt), free(stats_txt);
    }
    char *opts_txt = NULL, *stats_txt = NULL;
    cr_assert_eq(kv_decompose_records(&o, NULL, &opts_txt, &stats_txt, &err), KV_OK);
    cr_assert_str_eq(stats_txt, "null");
    free(opts_txt), free(stats_txt);
    /* the options alone when the stats are not wanted */
    cr_assert_eq(kv_decompose_records(&o, s, &opts_txt, NULL, &err), KV_OK);
    cr_assert(strstr(opts_txt, "\"method\":\"svd\""), "%s", opts_txt);
    free(opts_txt);
    s->info.has_fisher = 0;
    kv_lr_free(lr);
    kv_stats_free(s);
    shared_free(&sh);
}
