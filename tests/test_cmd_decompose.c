/* CLI tests of decompose, verify --compressed and export --dense: the
 * latent-cache perplexity equals the dense export's, and every bad option or
 * mismatch is one exact line with the right exit code. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define M260 "models/stories260K/stories260K.bin"
#define TOK260 "models/stories260K/tok512.bin"
#define M656 "models/tinystories-656K"
#define TEXT "text/tinystories/val1k.txt"

static char dir_[1024];
static const char *workdir(void) {
    if (!dir_[0]) {
        char *d = kvt_temp_dir();
        snprintf(dir_, sizeof dir_, "%s", d);
        free(d);
    }
    return dir_;
}

static void run_ok(const char *args, char **out) {
    char *o, *e;
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d; stderr:\n%s", args, rc, e);
    free(e);
    if (out) *out = o;
    else free(o);
}

static void expect_cli(const char *args, int code, const char *want_err) {
    char *o, *e;
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, code, "kvcal %s: exit %d, want %d; stderr:\n%s", args, rc, code, e);
    cr_assert_str_eq(e, want_err, "kvcal %s", args);
    free(o), free(e);
}

static double json_num(const char *text, const char *key) {
    json_error_t je;
    json_t *o = json_loads(text, 0, &je);
    cr_assert(o, "not JSON (%s): %s", je.text, text);
    json_t *v = json_object_get(o, key);
    cr_assert(v && json_is_number(v), "no number '%s' in %s", key, text);
    double x = json_number_value(v);
    json_decref(o);
    return x;
}

/* "-m MODEL [--tokenizer TOK]" for the 260K or the 656K model, or skip. */
static void model_args(int big, char *buf, size_t cap) {
    if (big) {
        KVT_NEED_SHARED(m, M656);
        snprintf(buf, cap, "-m '%s'", m);
    } else {
        KVT_NEED_SHARED(m, M260);
        char mp[1024];
        snprintf(mp, sizeof mp, "%s", m);
        KVT_NEED_SHARED(t, TOK260);
        snprintf(buf, cap, "-m '%s' --tokenizer '%s'", mp, t);
    }
}

/* Statistics of the first 24 windows of 128 tokens, once per model. */
static const char *stats_for(int big) {
    static char path[2][1200];
    if (path[big][0]) return path[big];
    char ma[2400], args[4096];
    model_args(big, ma, sizeof ma);
    KVT_NEED_SHARED(t, TEXT);
    snprintf(path[big], sizeof path[big], "%s/s%d.kvstats", workdir(), big);
    snprintf(args, sizeof args,
             "collect %s -t '%s' --seq-len 128 --samples 24 --sequential --threads 2 -q -o '%s'", ma,
             t, path[big]);
    run_ok(args, NULL);
    return path[big];
}

static double verify_ppl(const char *model_part, const char *extra, double *base) {
    char args[4096], *out;
    KVT_NEED_SHARED(t, TEXT);
    snprintf(args, sizeof args, "verify %s --text '%s' --seq-len 128 --max-windows 12 --threads 2 --json %s",
             model_part, t, extra);
    run_ok(args, &out);
    double p = json_num(out, "ppl");
    if (base) *base = json_num(out, "base_ppl");
    free(out);
    return p;
}

/* Latent-cache verify and verify of the dense export agree to fp32
 * rounding (acceptance: 1e-4 relative PPL). */
static void latent_equals_dense(int big, const char *method, const char *dense_name) {
    char ma[2400], args[8192], dir[1200], dense[1200], part[4096];
    model_args(big, ma, sizeof ma);
    const char *st = stats_for(big);
    snprintf(dir, sizeof dir, "%s/%s-%d", workdir(), method, big);
    snprintf(dense, sizeof dense, "%s/%s", workdir(), dense_name);
    snprintf(args, sizeof args, "decompose %s -s '%s' --method %s --ratio 0.5 -o '%s' -q --threads 2",
             ma, st, method, dir);
    run_ok(args, NULL);
    double base;
    snprintf(part, sizeof part, "%s --compressed '%s'", ma, dir);
    double latent = verify_ppl(part, "", &base);
    snprintf(args, sizeof args, "export --dense '%s' %s -o '%s'", dir, ma, dense);
    run_ok(args, NULL);
    if (big) snprintf(part, sizeof part, "-m '%s'", dense);
    else {
        KVT_NEED_SHARED(t, TOK260);
        snprintf(part, sizeof part, "-m '%s' --tokenizer '%s'", dense, t);
    }
    double dense_ppl = verify_ppl(part, "", NULL);
    cr_log_info("%s %s: base %.6f latent %.6f dense %.6f", big ? "656K" : "260K", method, base,
                latent, dense_ppl);
    cr_assert(fabs(latent - dense_ppl) <= 1e-4 * dense_ppl, "latent ppl %.8f vs dense %.8f", latent,
              dense_ppl);
    cr_assert(latent > base * (1 + 1e-4), "a half-size cache should cost something: %.6f vs %.6f",
              latent, base);
}

Test(cmd_decompose, latent_cache_equals_dense_export_260K) { latent_equals_dense(0, "palu", "d260.bin"); }
Test(cmd_decompose, latent_cache_equals_dense_export_656K) { latent_equals_dense(1, "svd", "d656"); }
Test(cmd_decompose, latent_cache_equals_dense_export_eigen) { latent_equals_dense(1, "eigen", "d656e"); }

Test(cmd_decompose, full_rank_is_the_base_model) {
    char ma[2400], args[8192], dir[1200], part[4096];
    model_args(1, ma, sizeof ma);
    const char *st = stats_for(1);
    const char *methods[] = {"svd", "palu", "eigen", "lorc", "fdc", "zack"};
    for (int i = 0; i < 6; i++) {
        snprintf(dir, sizeof dir, "%s/full-%s", workdir(), methods[i]);
        snprintf(args, sizeof args, "decompose %s -s '%s' --method %s --eps 1 -o '%s' -q", ma, st,
                 methods[i], dir);
        run_ok(args, NULL);
        double base;
        snprintf(part, sizeof part, "%s --compressed '%s'", ma, dir);
        double p = verify_ppl(part, "", &base);
        cr_assert(fabs(p - base) <= 1e-4 * base, "%s at --eps 1: ppl %.8f vs base %.8f", methods[i], p, base);
    }
}

Test(cmd_decompose, ratio_is_achieved_and_reported) {
    char ma[2400], args[8192], *out;
    model_args(1, ma, sizeof ma);
    const char *st = stats_for(1);
    const double targets[] = {0.75, 0.5, 0.375};
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "decompose %s -s '%s' --alloc global --ratio %g -o '%s/g' -q --json",
                 ma, st, targets[i], workdir());
        run_ok(args, &out);
        json_t *o = json_loads(out, 0, NULL);
        cr_assert(o);
        json_t *kb = json_object_get(o, "kv_bytes_per_token");
        double base = json_number_value(json_object_get(kb, "base"));
        double comp = json_number_value(json_object_get(kb, "compressed"));
        /* one rank step of one unit is 2 bytes (fp16, rank multiple 1) */
        cr_assert(comp <= targets[i] * base && comp > targets[i] * base - 2.0 - 1e-9,
                  "ratio %g: %g of %g bytes", targets[i], comp, base);
        json_decref(o);
        free(out);
        /* the manifest agrees with the command's own report */
        snprintf(args, sizeof args, "inspect '%s/g' --json", workdir());
        run_ok(args, &out);
        cr_assert(strstr(out, "kv_bytes_per_token"), "%s", out);
        free(out);
    }
}

Test(cmd_decompose, bad_options_are_usage_errors) {
    char ma[2400], args[8192], want[4096];
    model_args(0, ma, sizeof ma);
    const char *st = stats_for(0);
    const char *usage = "usage: kvcal decompose --model PATH [--stats FILE] -o DIR (--eps E | --ratio R) "
                        "[options] (see 'kvcal decompose --help')\n";
    struct {
        const char *opts, *msg;
    } rows[] = {
        {"--eps 1.5", "--eps 1.5 is outside (0, 1]"},
        {"--eps -0.1", "--eps -0.1 is outside (0, 1]"},
        {"--ratio 2", "--ratio 2 is outside (0, 1]"},
        {"", "give --eps E or --ratio R"},
        {"--eps 0.9 --ratio 0.5", "give --eps or --ratio, not both"},
        {"--method qr --ratio 0.5", "unknown --method 'qr' (svd, palu, eigen, lorc, fdc, zack)"},
        {"--alloc uniform --eps 0.9", "--eps applies to --alloc eps or global; --alloc uniform takes --ratio"},
        {"--group-size 3 --ratio 0.5", "--group-size 3 does not divide the model's 4 kv heads"},
        {"--kv-bits 5 --ratio 0.5", "--kv-bits 5 is not one of 16, 8, 4, 3, 2 or auto"},
        {"--kv-bits four --ratio 0.5", "--kv-bits 'four' is not one of 16, 8, 4, 3, 2 or auto"},
        {"--kv-bits -1 --ratio 0.5", "--kv-bits '-1' is not one of 16, 8, 4, 3, 2 or auto"},
        {"--kv-bits auto --eps 0.9", "--kv-bits auto needs --ratio R: it shares that many bytes between ranks and bits"},
        {"--kv-bits auto --alloc uniform --ratio 0.5",
         "--kv-bits auto chooses the ranks itself: leave --alloc out or give global"},
        {"--alloc layer-budget --error-budget 0.1", "--alloc layer-budget needs --text (calibration windows)"},
        {"--ratio 0.5 --cond-skip 3", "--d-min, --d-max and --cond-skip apply to --alloc progressive"},
        {"--rank-multiple 0 --ratio 0.5", "--rank-multiple must be in 1..1048576"},
        {"--basis sideways --ratio 0.5", "unknown --basis 'sideways' (energy, output, loss)"},
        {"--method eigen --basis output --ratio 0.5",
         "--basis output applies to --method palu (keys and values) and fdc (values)"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        snprintf(args, sizeof args, "decompose %s -s '%s' %s -o '%s/x'", ma, st, rows[i].opts, workdir());
        snprintf(want, sizeof want, "kvcal decompose: %s\n%s", rows[i].msg, usage);
        expect_cli(args, 2, want);
    }
    snprintf(args, sizeof args, "decompose %s --method palu --ratio 0.5 -o '%s/x'", ma, workdir());
    snprintf(want, sizeof want, "kvcal decompose: --method palu needs --stats (run 'kvcal collect' first)\n%s", usage);
    expect_cli(args, 2, want);
    snprintf(args, sizeof args, "decompose %s --method svd --alloc fisher --ratio 0.5 -o '%s/x'", ma,
             workdir());
    snprintf(want, sizeof want,
             "kvcal decompose: --alloc fisher needs --stats from 'kvcal collect --fisher'\n%s", usage);
    expect_cli(args, 2, want);
    snprintf(args, sizeof args, "decompose %s --method svd --center --ratio 0.5 -o '%s/x'", ma, workdir());
    snprintf(want, sizeof want,
             "kvcal decompose: --center needs --stats: the mean it subtracts is a calibration mean\n%s", usage);
    expect_cli(args, 2, want);
}

/* Every unit's rank from decompose --json, in layer, K, V order. */
static int64_t json_ranks(const char *text, int64_t *out, int64_t cap) {
    json_t *o = json_loads(text, 0, NULL);
    cr_assert(o, "not JSON: %s", text);
    json_t *layers = json_object_get(o, "layers"), *ly;
    size_t i;
    int64_t n = 0;
    json_array_foreach(layers, i, ly) {
        for (int side = 0; side < 2; side++) {
            json_t *rs = json_object_get(json_object_get(ly, side ? "v" : "k"), "ranks"), *r;
            size_t j;
            json_array_foreach(rs, j, r) {
                cr_assert(n < cap);
                out[n++] = json_integer_value(r);
            }
        }
    }
    json_decref(o);
    return n;
}

/* collect --fisher, then --alloc fisher: other ranks than uniform at the
 * same ratio, a cache at the target, and a model verify runs. */
Test(cmd_decompose, fisher_allocation_differs_from_uniform_260K, .timeout = 120) {
    char ma[2400], args[8192], st[1200], *out;
    model_args(0, ma, sizeof ma);
    KVT_NEED_SHARED(t, TEXT);
    snprintf(st, sizeof st, "%s/fisher260.kvstats", workdir());
    snprintf(args, sizeof args,
             "collect %s -t '%s' --seq-len 128 --samples 24 --sequential --fisher --threads 2 -q "
             "-o '%s'", ma, t, st);
    run_ok(args, NULL);
    int64_t rf[64], ru[64], nf, nu;
    double comp[2], base = 0;
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof args, "decompose %s -s '%s' --alloc %s --ratio 0.5 -o '%s/%s' -q --json",
                 ma, st, k ? "uniform" : "fisher", workdir(), k ? "uni260" : "fisher260");
        run_ok(args, &out);
        if (k) nu = json_ranks(out, ru, 64);
        else nf = json_ranks(out, rf, 64);
        json_t *o = json_loads(out, 0, NULL);
        json_t *kb = json_object_get(o, "kv_bytes_per_token");
        base = json_number_value(json_object_get(kb, "base"));
        comp[k] = json_number_value(json_object_get(kb, "compressed"));
        cr_assert(json_is_true(json_object_get(json_object_get(o, "options"), "hadamard")) == 0);
        json_decref(o);
        free(out);
    }
    cr_assert_eq(nf, nu);
    int64_t differ = 0;
    for (int64_t i = 0; i < nf; i++) differ += rf[i] != ru[i];
    cr_assert_gt(differ, 0, "--alloc fisher gave the uniform ranks");
    /* the smallest cache of at least the target: within one rank step (2 bytes) of each unit */
    cr_assert(comp[0] >= 0.5 * base && comp[0] <= 0.5 * base + 2.0 * (double)nf,
              "fisher: %g of %g bytes", comp[0], base);
    char part[4096];
    snprintf(part, sizeof part, "%s --compressed '%s/fisher260'", ma, workdir());
    double b, p = verify_ppl(part, "", &b);
    cr_assert(isfinite(p) && p > b, "fisher at 0.5: ppl %g, base %g", p, b);
}

Test(cmd_decompose, mismatches_are_errors_naming_the_file) {
    char ma[2400], args[8192], want[4096];
    model_args(0, ma, sizeof ma);
    const char *other = stats_for(1), *st = stats_for(0);
    snprintf(args, sizeof args, "decompose %s -s '%s' --ratio 0.5 -o '%s/x'", ma, other, workdir());
    snprintf(want, sizeof want,
             "kvcal: %s: statistics are for 2 layers, dim 128, 8 heads (4 kv) of 16, but the model "
             "has 5 layers, dim 64, 8 heads (4 kv) of 8\n", other);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "decompose %s -s '%s' --alloc fisher --ratio 0.5 -o '%s/x' -q", ma, st, workdir());
    snprintf(want, sizeof want,
             "kvcal: %s: has no fisher statistics (blk.N.fisher.k/v), which --alloc fisher needs\n", st);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "decompose %s -s '%s' --basis loss --ratio 0.5 -o '%s/x' -q", ma, st, workdir());
    snprintf(want, sizeof want,
             "kvcal: %s: has no gradient statistics (blk.N.grad_k/v.cov), which --basis loss needs: "
             "collect them with 'kvcal collect --fisher'\n", st);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "decompose %s -s '%s' --ratio 0.05 -o '%s/x' -q", ma, st, workdir());
    expect_cli(args, 1,
               "kvcal: --ratio 0.05 is below 0.1250, the smallest cache that --min-rank 1 and "
               "--rank-multiple 1 allow\n");
    /* the output directory is checked before any work */
    snprintf(args, sizeof args, "decompose %s -s '%s' --ratio 0.5 -o '%s' -q", ma, st, st);
    snprintf(want, sizeof want, "kvcal: %s: exists and is not a directory; --output names a directory\n", st);
    expect_cli(args, 1, want);
}

Test(cmd_decompose, verify_refuses_a_directory_of_another_model) {
    char ma[2400], mb[2400], args[8192], dir[1200], want[4096];
    model_args(1, mb, sizeof mb);
    model_args(0, ma, sizeof ma);
    const char *st = stats_for(1);
    snprintf(dir, sizeof dir, "%s/other", workdir());
    snprintf(args, sizeof args, "decompose %s -s '%s' --ratio 0.5 -o '%s' -q", mb, st, dir);
    run_ok(args, NULL);
    KVT_NEED_SHARED(t, TEXT);
    snprintf(args, sizeof args, "verify %s --compressed '%s' --text '%s'", ma, dir, t);
    snprintf(want, sizeof want, "kvcal: %s/kvcal.json: made from a model with dim 128, but the given model has 64\n", dir);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "verify %s --text '%s' --kv-bits 4", ma, t);
    expect_cli(args, 2,
               "kvcal verify: --kv-bits needs --compressed\n"
               "usage: kvcal verify --model PATH --text FILE [--compressed DIR] [options] (see 'kvcal verify --help')\n");
}

Test(cmd_decompose, quantized_latents_cost_more_at_fewer_bits) {
    char ma[2400], args[8192], dir[1200], part[4096];
    model_args(1, ma, sizeof ma);
    const char *st = stats_for(1);
    snprintf(dir, sizeof dir, "%s/q", workdir());
    snprintf(args, sizeof args, "decompose %s -s '%s' --ratio 0.5 --rank-multiple 8 --hadamard -o '%s' -q", ma, st, dir);
    run_ok(args, NULL);
    snprintf(part, sizeof part, "%s --compressed '%s'", ma, dir);
    double p16 = verify_ppl(part, "", NULL), p8 = verify_ppl(part, "--kv-bits 8", NULL);
    double p2 = verify_ppl(part, "--kv-bits 2", NULL);
    cr_log_info("656K palu 0.5 hadamard: 16 bits %.4f, 8 bits %.4f, 2 bits %.4f", p16, p8, p2);
    cr_assert(fabs(p8 - p16) < 0.02 * p16, "8-bit latents should be close: %.4f vs %.4f", p8, p16);
    cr_assert(p2 > p8, "2-bit latents should cost more than 8-bit: %.4f vs %.4f", p2, p8);
}

/* --kv-bits auto: the cache it writes is within the ratio, verify counts
 * its bands' bytes and runs them, the runtime refuses the bands by name,
 * and with --text the choice kept is the one of least measured KL. */
Test(cmd_decompose, kv_bits_auto_writes_bands_verify_runs, .timeout = 120) {
    char ma[2400], args[8192], dir[1200], part[4096], want[4096], *out;
    model_args(1, ma, sizeof ma);
    const char *st = stats_for(1);
    KVT_NEED_SHARED(t, TEXT);
    snprintf(dir, sizeof dir, "%s/auto", workdir());
    snprintf(args, sizeof args, "decompose %s -s '%s' --kv-bits auto --ratio 0.25 -o '%s' --json -q", ma,
             st, dir);
    run_ok(args, &out);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je), *opt = o ? json_object_get(o, "options") : NULL;
    cr_assert(opt, "not JSON with options (%s): %s", je.text, out);
    cr_assert_str_eq(json_string_value(json_object_get(opt, "kv_bits")), "auto");
    cr_assert(json_is_true(json_object_get(opt, "hadamard")));
    cr_assert(json_is_null(json_object_get(opt, "fixed_kept")), "the model keeps the mix here: %s", out);
    double ratio = json_number_value(json_object_get(json_object_get(o, "kv_bytes_per_token"), "ratio"));
    cr_assert(ratio <= 0.25 && ratio > 0.2, "ratio %g", ratio);
    json_t *bands = json_object_get(json_object_get(json_array_get(json_object_get(o, "layers"), 0), "k"), "bands");
    cr_assert(json_is_array(bands) && json_array_size(bands) > 0, "%s", out);
    json_decref(o);
    free(out);
    snprintf(part, sizeof part, "%s --compressed '%s'", ma, dir);
    snprintf(args, sizeof args, "verify %s --text '%s' --seq-len 128 --max-windows 2 --threads 2 --json", part, t);
    run_ok(args, &out);
    cr_assert(json_num(out, "kv_bits") == 0 && isfinite(json_num(out, "ppl")), "%s", out);
    cr_assert(strstr(out, "\"latent_bits\""), "%s", out);
    free(out);
    snprintf(args, sizeof args, "verify %s --text '%s' --device twin --max-windows 1", part, t);
    snprintf(want, sizeof want,
             "kvcal: %s: mixed latent bits (each unit's own bands, decompose --kv-bits auto) are not "
             "supported by the runtime; verify them without --device, or at one width with "
             "--kv-bits B\n",
             dir);
    expect_cli(args, 1, want);
    snprintf(args, sizeof args, "bench-attn --manifest '%s' --device twin --iters 1", dir);
    snprintf(want, sizeof want,
             "kvcal: %s: mixed latent bits (each unit's own bands, decompose --kv-bits auto) are not "
             "supported by the runtime; time the same factors at one width with --kv-bits B\n",
             dir);
    expect_cli(args, 1, want);

    /* measured: the least calibration KL of the mix and the five widths */
    snprintf(args, sizeof args,
             "decompose %s -s '%s' --kv-bits auto --ratio 0.25 -t '%s' --seq-len 64 --windows 2 "
             "-o '%s/auto-t' --json -q",
             ma, st, t, workdir());
    run_ok(args, &out);
    o = json_loads(out, 0, &je), opt = o ? json_object_get(o, "options") : NULL;
    cr_assert(opt, "not JSON with options (%s): %s", je.text, out);
    json_t *pk = json_object_get(opt, "probe_kl_fixed"), *kept = json_object_get(opt, "fixed_kept");
    cr_assert(json_is_object(pk) && json_is_number(json_object_get(opt, "probe_kl")), "%s", out);
    double least = json_number_value(json_object_get(opt, "probe_kl"));
    int want_kept = 0;
    static const char *const widths[] = {"16", "8", "4", "3", "2"};
    for (int w = 0; w < 5; w++) {
        json_t *v = json_object_get(pk, widths[w]);
        if (json_is_number(v) && json_number_value(v) < least)
            least = json_number_value(v), want_kept = atoi(widths[w]);
    }
    cr_assert_eq(json_is_null(kept) ? 0 : (int)json_integer_value(kept), want_kept, "%s", out);
    json_decref(o);
    free(out);
}
