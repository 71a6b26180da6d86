/* Block-quantized GGUF end to end: data/kjv-llama (head_dim 64, the fixture
 * with realistic heads) written by kvcal's quantiser as Q8_0, Q6_K, Q4_K and
 * Q4_0 GGUFs, loaded back (decoded at load) and scored by `kvcal verify`
 * on the same Gospel windows as the F32 model. The perplexity moves by
 * what the format's step allows: well under 1% at 8 bits, a few percent
 * at 4, and in order of the formats' precision. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ggmlquant.h"
#include "gguf.h"
#include "ggufmodelw.h"
#include "kvformats.h"
#include "testutil.h"

#define MODEL "data/kjv-llama"
#define TOKJSON "data/kjv-llama/tokenizer.json"
#define GOSPELS "data/kjv/gospels.txt"

static void run_ok(const char *args, char **out) {
    char *o, *e;
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, e);
    free(e);
    if (out) *out = o;
    else free(o);
}

static double ppl_of(const char *args_fmt, const char *a, const char *b) {
    char args[4096], *out;
    snprintf(args, sizeof args, args_fmt, a, b);
    run_ok(args, &out);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert(o, "not JSON: %s", out);
    double p = json_number_value(json_object_get(o, "ppl"));
    json_decref(o);
    free(out);
    return p;
}

/* verify's perplexity of model on the first 24 Gospel windows of 256 */
static double verify_ppl(const char *model) {
    return ppl_of("verify -m '%s' --tokenizer " TOKJSON " --text " GOSPELS
                  " --seq-len 256 --max-windows 24 --threads 2 --json %s",
                  model, "");
}

Test(quantppl, kjv_llama_quantized_by_kvcal, .timeout = 300) {
    if (access(MODEL "/model.safetensors", R_OK) || access(GOSPELS, R_OK))
        cr_skip("%s or %s is missing (make data writes the Gospels; run from the repository root)",
                MODEL, GOSPELS);
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_open(MODEL, NULL, &m, &err), KV_OK, "%s", err.msg);
    char *dir = kvt_temp_dir();
    double base = verify_ppl(MODEL);
    const struct {
        uint32_t type;
        double max_rel; /* the PPL change the format's step allows */
    } rows[] = {{0, 1e-5}, {8, 0.002}, {14, 0.003}, {12, 0.015}, {2, 0.03}};
    double rel[5];
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        char path[1200];
        snprintf(path, sizeof path, "%s/m-%s.gguf", dir, kv_ggml_type_name(rows[i].type));
        /* the FFN's 704 columns hold no whole K-quant super-block: those
         * matrices take llama.cpp's fallback type */
        struct kv_gguf_write_opts o = {.matrix_type = rows[i].type, .fallback = 1};
        cr_assert_eq(kv_gguf_write_model(m, path, &o, &err), KV_OK, "%s: %s", path, err.msg);
        cr_assert_eq(o.n_fallback, rows[i].type >= 10 ? 4 : 0, "%lld fallbacks",
                     (long long)o.n_fallback);
        double p = verify_ppl(path);
        rel[i] = fabs(p - base) / base;
        cr_log_info("%-5s ppl %.6f (F32 HF %.6f): %+.4f%%", kv_ggml_type_name(rows[i].type), p, base,
                    100 * (p - base) / base);
        cr_assert_leq(rel[i], rows[i].max_rel, "%s: ppl %.6f vs %.6f (%.3g relative, allowed %.3g)",
                      kv_ggml_type_name(rows[i].type), p, base, rel[i], rows[i].max_rel);
    }
    /* more bits, closer: Q8_0 < Q4_K and Q6_K < Q4_0 */
    cr_assert_lt(rel[1], rel[3], "Q8_0 (%.3g) is not closer than Q4_K (%.3g)", rel[1], rel[3]);
    cr_assert_lt(rel[2], rel[4], "Q6_K (%.3g) is not closer than Q4_0 (%.3g)", rel[2], rel[4]);
    kv_model_close(m);
    kvt_rm_dir(dir);
}

/* A Q4_K model compressed and exported dense: the patched K/V tensors are
 * written as F16 (said so), the other tensors keep their blocks, and the
 * dense file scores what the latent cache does, to F16 rounding. */
Test(quantppl, dense_export_of_a_quantized_model, .timeout = 300) {
    if (access(MODEL "/model.safetensors", R_OK) || access(GOSPELS, R_OK))
        cr_skip("%s or %s is missing (make data writes the Gospels; run from the repository root)",
                MODEL, GOSPELS);
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_open(MODEL, NULL, &m, &err), KV_OK, "%s", err.msg);
    char *dir = kvt_temp_dir(), q[1200], st[1200], lr[1200], full[1200], dense[1200], args[8192];
    snprintf(q, sizeof q, "%s/q4k.gguf", dir);
    snprintf(st, sizeof st, "%s/s.kvstats", dir);
    snprintf(lr, sizeof lr, "%s/half", dir);
    snprintf(full, sizeof full, "%s/full", dir);
    snprintf(dense, sizeof dense, "%s/dense.gguf", dir);
    struct kv_gguf_write_opts o = {.matrix_type = 12, .fallback = 1};
    cr_assert_eq(kv_gguf_write_model(m, q, &o, &err), KV_OK, "%s", err.msg);
    kv_model_close(m);
    snprintf(args, sizeof args,
             "collect -m '%s' --tokenizer '%s' -t '%s' --seq-len 128 --samples 8 --sequential -q --threads 2 -o '%s'",
             q, TOKJSON, GOSPELS, st);
    run_ok(args, NULL);
    const char *vfmt = "verify -m '%s' --tokenizer " TOKJSON " --text " GOSPELS
                       " --seq-len 128 --max-windows 8 --threads 2 --json %s";
    /* full rank over quantized weights: the base model again */
    snprintf(args, sizeof args, "decompose -m '%s' --tokenizer '%s' -s '%s' --method palu --eps 1 -o '%s' -q",
             q, TOKJSON, st, full);
    run_ok(args, NULL);
    char extra[1400];
    snprintf(extra, sizeof extra, "--compressed '%s'", full);
    double base = ppl_of(vfmt, q, ""), at1 = ppl_of(vfmt, q, extra);
    cr_assert(fabs(at1 - base) <= 1e-4 * base, "--eps 1 over Q4_K: %.8f vs %.8f", at1, base);
    /* half the cache, exported dense */
    snprintf(args, sizeof args, "decompose -m '%s' --tokenizer '%s' -s '%s' --method palu --ratio 0.5 -o '%s' -q",
             q, TOKJSON, st, lr);
    run_ok(args, NULL);
    snprintf(extra, sizeof extra, "--compressed '%s'", lr);
    double latent = ppl_of(vfmt, q, extra);
    char *out;
    snprintf(args, sizeof args, "export --dense '%s' -m '%s' --tokenizer '%s' -o '%s'", lr, q, TOKJSON, dense);
    run_ok(args, &out);
    cr_assert(strstr(out, "replaced Q4_K K/V tensors written as F16"), "export did not say so:\n%s", out);
    free(out);
    double dp = ppl_of(vfmt, dense, "");
    cr_log_info("Q4_K: base %.6f, half-cache latent %.6f, dense export (K/V F16) %.6f", base, latent, dp);
    cr_assert(fabs(latent - dp) <= 2e-3 * dp, "latent %.8f vs dense %.8f", latent, dp);
    /* the file: K/V as F16, every other matrix as it was */
    struct kv_gguf_file *f, *g;
    cr_assert_eq(kv_gguf_open(dense, &f, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_gguf_open(q, &g, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(f->n_tensors, g->n_tensors);
    int64_t f16 = 0;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        const struct kv_gguf_tensor *a = &f->tensors[i], *b = &g->tensors[i];
        cr_assert_str_eq(a->t.name, b->t.name);
        int kv = strstr(a->t.name, "attn_k.weight") || strstr(a->t.name, "attn_v.weight");
        if (kv && a->ggml_type == 1) f16++;
        else {
            cr_assert_eq(a->ggml_type, b->ggml_type, "%s changed type", a->t.name);
            cr_assert_eq(memcmp(a->t.data, b->t.data, a->t.nbytes), 0, "%s changed bytes", a->t.name);
        }
    }
    cr_assert_gt(f16, 0, "no K/V tensor was written as F16");
    kv_gguf_close(f), kv_gguf_close(g);
    kvt_rm_dir(dir);
}
