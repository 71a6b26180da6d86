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

static double verify_ppl(const char *model) {
    char args[4096], *out, *e;
    snprintf(args, sizeof args,
             "verify -m '%s' --tokenizer '%s' --text '%s' --seq-len 256 --max-windows 24 --threads 2 --json",
             model, TOKJSON, GOSPELS);
    int rc = kvt_run_cli(args, &out, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, e);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert(o, "not JSON: %s", out);
    double p = json_number_value(json_object_get(o, "ppl"));
    json_decref(o);
    free(out), free(e);
    return p;
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
