/* GPT-NeoX (Pythia): the forward pass against the float64 oracle of
 * tests/naive_neox.h (partial rope, parallel or sequential residual, erf or
 * tanh GELU), config.json in both layouts and its refusals, and the HF
 * (query_key_value interleaved per head) and GGUF (attn_qkv stacked) round
 * trips, which must give back the same weights and the same logits. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ggufmodelw.h"
#include "gguf_patch.h"
#include "hfdir.h"
#include "kvformats.h"
#include "model.h"
#include "naive_neox.h"
#include "testutil.h"

static struct kv_model *random_neox(struct kv_config c, uint64_t seed) {
    struct kv_model *m;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &err), KV_OK, "%s", err.msg);
    /* scores sharp enough that rope and masking errors show in the logits,
     * and MLP inputs wide enough that erf and tanh GELU differ */
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int k = KV_W_Q; k <= KV_W_K; k++) {
            float *w = kv_model_weight_mut(m, (enum kv_wkind)k, l);
            for (int64_t i = 0; i < c.n_heads * c.head_dim * c.dim; i++) w[i] *= 20;
        }
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int k = 0; k < 2; k++) {
            float *w = kv_model_weight_mut(m, k ? KV_W_DOWN : KV_W_UP, l);
            for (int64_t i = 0; i < c.hidden_dim * c.dim; i++) w[i] *= k ? 200 : 16;
        }
    return m;
}

/* float32 against float64: 4.5e-7 of the largest logit at worst, measured;
 * the tanh GELU in place of erf's moves them by 2.6e-4 of it */
#define ORACLE_TOL 1e-5

static void against_oracle(struct kv_config c, const char *what) {
    struct kv_model *m = random_neox(c, 11);
    int64_t n = 40, V = c.vocab_size;
    int32_t tok[40];
    for (int i = 0; i < n; i++) tok[i] = (i * 31 + 7) % (int32_t)V;
    float *got = kvt_logits(m, tok, n);
    double *ref = naive_neox_forward(m, tok, n);
    kvt_assert_close_oracle(got, ref, n * V, ORACLE_TOL, ORACLE_TOL, what);
    free(got), free(ref);
    kv_model_close(m);
}

Test(neox, forward_matches_the_float64_oracle) {
    struct kv_config c = tiny_neox_cfg();
    against_oracle(c, "gpt_neox parallel, rope 4 of 16, erf gelu");
    c.parallel_residual = 0, c.gelu_erf = 0, c.rope_dim = 8;
    against_oracle(c, "gpt_neox sequential, rope 8 of 16, tanh gelu");
    c.rope_dim = 0; /* whole heads */
    against_oracle(c, "gpt_neox sequential, whole-head rope");
    c = tiny_neox_cfg();
    c.rope_scaling.type = KV_ROPE_SCALING_LINEAR, c.rope_scaling.factor = 4;
    against_oracle(c, "gpt_neox with linear rope scaling");
}

/* The oracle test can fail: each feature, switched in the model alone,
 * moves the logits well past its tolerance. */
Test(neox, each_feature_changes_the_logits) {
    struct kv_config c = tiny_neox_cfg();
    struct kv_model *m = random_neox(c, 11);
    int64_t n = 40, V = c.vocab_size;
    int32_t tok[40];
    for (int i = 0; i < n; i++) tok[i] = (i * 31 + 7) % (int32_t)V;
    float *base = kvt_logits(m, tok, n);
    double spread = 0;
    for (int64_t i = 0; i < n * V; i++) spread = fmax(spread, fabs(base[i]));
    struct kv_config *mc = (struct kv_config *)&m->cfg;
    int *flags[] = {&mc->parallel_residual, &mc->gelu_erf};
    const char *names[] = {"parallel residual", "erf gelu", "partial rope"};
    for (int k = 0; k < 3; k++) {
        if (k < 2) *flags[k] = !*flags[k];
        else mc->rope_dim = 8;
        float *other = kvt_logits(m, tok, n);
        double worst = 0;
        for (int64_t i = 0; i < n * V; i++) worst = fmax(worst, fabs(other[i] - base[i]));
        cr_assert(worst > 3 * ORACLE_TOL * spread,
                  "%s changes the logits by only %g, under 3x the oracle test's tolerance %g",
                  names[k], worst, ORACLE_TOL * spread);
        if (k < 2) *flags[k] = !*flags[k];
        else mc->rope_dim = 4;
        free(other);
    }
    free(base);
    kv_model_close(m);
}

#define PYTHIA_KEYS                                                                          \
    "\"architectures\": [\"GPTNeoXForCausalLM\"], \"model_type\": \"gpt_neox\", "            \
    "\"hidden_size\": 768, \"intermediate_size\": 3072, \"num_hidden_layers\": 12, "         \
    "\"num_attention_heads\": 12, \"vocab_size\": 50304, \"max_position_embeddings\": 2048, " \
    "\"layer_norm_eps\": 1e-05, \"tie_word_embeddings\": false, "   \
    "\"bos_token_id\": 0, \"eos_token_id\": 0"

/* Pythia-160m's shape in transformers 4.x's keys (rotary_pct,
 * rotary_emb_base, use_parallel_residual) and in 5.x's rope_parameters. */
Test(neox, config_in_both_layouts) {
    char *dir = kvt_temp_dir();
    const char *texts[] = {
        "{" PYTHIA_KEYS ", \"rotary_pct\": 0.25, \"rotary_emb_base\": 10000, "
        "\"use_parallel_residual\": true, \"hidden_act\": \"gelu\"}",
        "{" PYTHIA_KEYS ", \"hidden_act\": \"gelu\", \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": "
        "10000.0, \"partial_rotary_factor\": 0.25}}",
    };
    for (int i = 0; i < 2; i++) {
        char *p = kvt_write_text(dir, "config.json", texts[i]);
        struct kv_config c;
        struct kv_err err = {0};
        cr_assert_eq(kv_hf_read_config(p, &c, &err), KV_OK, "layout %d: %s", i, err.msg);
        cr_assert_eq(c.arch, KV_ARCH_GPTNEOX);
        cr_assert(c.head_dim == 64 && kv_rope_dim(&c) == 16, "head %lld, rope %lld",
                  (long long)c.head_dim, (long long)kv_rope_dim(&c));
        cr_assert(c.parallel_residual && c.gelu_erf && !c.tied_embeddings && c.n_kv_heads == 12);
        cr_assert(c.rope_theta == 10000.0f && c.norm_eps == 1e-5f);
        free(p);
    }
    kvt_rm_dir(dir);
}

/* Each message names the key at fault. */
Test(neox, config_refusals) {
    char *dir = kvt_temp_dir();
    struct {
        const char *extra, *msg;
    } cases[] = {
        {"\"rotary_pct\": 0.25, \"rotary_emb_base\": 10000, \"rope_theta\": 500",
         "rotary_emb_base 10000 and rope_theta 500 disagree"},
        {"\"rotary_pct\": 0.25, \"partial_rotary_factor\": 0.5",
         "partial_rotary_factor 0.5 and rotary_pct 0.25 disagree"},
        {"\"rotary_pct\": 0.3", "rotary_pct 0.3 of head_dim 64 gives 19 rotated dimensions"},
        {"\"rotary_pct\": 1.5", "rotary_pct 1.5 is above 1"},
        {"\"rotary_pct\": 0.25, \"attention_bias\": false", "attention_bias false is not supported"},
        {"\"rotary_pct\": 0.25, \"hidden_act\": \"relu\"", "hidden_act 'relu' is not supported"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[1024];
        snprintf(text, sizeof text, "{" PYTHIA_KEYS ", %s}", cases[i].extra);
        char *p = kvt_write_text(dir, "config.json", text);
        struct kv_config c;
        struct kv_err err = {0};
        cr_assert_neq(kv_hf_read_config(p, &c, &err), KV_OK, "case %zu loaded", i);
        cr_assert(strstr(err.msg, cases[i].msg), "case %zu: '%s' lacks '%s'", i, err.msg,
                  cases[i].msg);
        free(p);
    }
    kvt_rm_dir(dir);
}

static void same_weights(const struct kv_model *a, const struct kv_model *b, const char *what) {
    const struct kv_config *c = &a->cfg;
    for (int k = 0; k < KV_W_COUNT; k++) {
        int64_t nl = k < KV_W_FIRST_LAYER ? 1 : c->n_layers, s[2];
        int nd = kv_model_expected_shape(c, (enum kv_wkind)k, s);
        for (int64_t l = 0; l < nl; l++) {
            const float *wa = kv_model_weight(a, (enum kv_wkind)k, l);
            const float *wb = kv_model_weight(b, (enum kv_wkind)k, l);
            cr_assert(!wa == !wb, "%s: %s of layer %lld bound in one model only", what,
                      kv_wkind_name((enum kv_wkind)k), (long long)l);
            if (!wa) continue;
            int64_t n = nd == 2 ? s[0] * s[1] : s[0];
            for (int64_t i = 0; i < n; i++)
                cr_assert(wa[i] == wb[i], "%s: %s of layer %lld element %lld: %g, read back %g",
                          what, kv_wkind_name((enum kv_wkind)k), (long long)l, (long long)i,
                          (double)wa[i], (double)wb[i]);
        }
    }
}

Test(neox, hf_round_trip_interleaves_query_key_value_per_head) {
    struct kv_config c = tiny_neox_cfg();
    struct kv_model *m = random_neox(c, 5), *r;
    char *dir = kvt_temp_dir();
    struct kv_err err = {0};
    cr_assert_eq(kv_hf_write(m, dir, KV_DTYPE_F32, NULL, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(dir, NULL, &r, &err), KV_OK, "%s", err.msg);
    cr_assert(r->cfg.arch == KV_ARCH_GPTNEOX && r->cfg.rope_dim == 4 && r->cfg.parallel_residual &&
              r->cfg.gelu_erf);
    same_weights(m, r, "hf");
    /* the stored layout is HF's: row (head 1, v, 0) of query_key_value is v's row d_h */
    char *st = kvt_path(dir, "model.safetensors");
    const struct kv_tensor *t = NULL;
    for (int64_t i = 0; i < r->n_tensors && !t; i++)
        if (!strcmp(r->tensors[i].name, "gpt_neox.layers.1.attention.query_key_value.weight"))
            t = &r->tensors[i];
    cr_assert_not_null(t, "no query_key_value tensor in %s", st);
    cr_assert(t->dtype == KV_DTYPE_F32 && t->shape[0] == 3 * c.dim && t->shape[1] == c.dim);
    const float *rows = t->data, *wv = kv_model_weight(m, KV_W_V, 1);
    int64_t dh = c.head_dim, d = c.dim;
    for (int64_t j = 0; j < d; j++)
        cr_assert(rows[(1 * 3 * dh + 2 * dh) * d + j] == wv[dh * d + j], "column %lld", (long long)j);
    int32_t tok[24];
    for (int i = 0; i < 24; i++) tok[i] = (i * 13 + 1) % (int32_t)c.vocab_size;
    float *a = kvt_logits(m, tok, 24), *b = kvt_logits(r, tok, 24);
    cr_assert(!memcmp(a, b, (size_t)(24 * c.vocab_size) * sizeof *a), "logits differ after the round trip");
    free(a), free(b), free(st);
    kv_model_close(r);
    kv_model_close(m);
    kvt_rm_dir(dir);
}

Test(neox, gguf_round_trip_and_the_erf_refusal) {
    struct kv_config c = tiny_neox_cfg();
    char *dir = kvt_temp_dir(), *path = kvt_path(dir, "m.gguf");
    struct kv_err err = {0};
    struct kv_model *m = random_neox(c, 5), *r;
    cr_assert_neq(kv_gguf_write_model(m, path, NULL, &err), KV_OK);
    cr_assert(strstr(err.msg, "this model's GELU is erf's, but llama.cpp runs gguf 'gptneox' "
                              "with the tanh approximation"),
              "%s", err.msg);
    kv_model_close(m);
    c.gelu_erf = 0;
    m = random_neox(c, 5);
    cr_assert_eq(kv_gguf_write_model(m, path, NULL, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(path, NULL, &r, &err), KV_OK, "%s", err.msg);
    cr_assert(r->cfg.arch == KV_ARCH_GPTNEOX && r->cfg.rope_dim == 4 && r->cfg.parallel_residual &&
              !r->cfg.gelu_erf && r->cfg.norm_eps == c.norm_eps);
    same_weights(m, r, "gguf");
    int32_t tok[24];
    for (int i = 0; i < 24; i++) tok[i] = (i * 13 + 1) % (int32_t)c.vocab_size;
    float *a = kvt_logits(m, tok, 24), *b = kvt_logits(r, tok, 24);
    cr_assert(!memcmp(a, b, (size_t)(24 * c.vocab_size) * sizeof *a), "logits differ after the round trip");
    free(a), free(b);
    kv_model_close(r);
    kv_model_close(m);
    /* quantized: attn_qkv rows sliced from Q8_0 blocks, within Q8_0's rounding */
    m = random_neox(c, 5);
    struct kv_gguf_write_opts o = {.matrix_type = 8};
    cr_assert_eq(kv_gguf_write_model(m, path, &o, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(path, NULL, &r, &err), KV_OK, "%s", err.msg);
    const float *wk = kv_model_weight(m, KV_W_K, 1), *rk = kv_model_weight(r, KV_W_K, 1);
    double worst = 0, big = 0;
    for (int64_t i = 0; i < c.dim * c.dim; i++)
        worst = fmax(worst, fabs(wk[i] - rk[i])), big = fmax(big, fabs(wk[i]));
    cr_assert(worst <= big / 127.0 && worst > 0, "Q8_0 k of layer 1: worst error %g, max |w| %g", worst, big);
    kv_model_close(r);
    kv_model_close(m);
    free(path);
    kvt_rm_dir(dir);
}

/* ---------------------------------------------------------------- GGUF end to end */

#define TOKJSON "data/kjv-bpe-llama/tokenizer.json" /* 4,096 byte-level BPE ids */

static char *cli_ok(const char *args) {
    char *o, *e;
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d; stderr:\n%s", args, rc, e);
    free(e);
    return o;
}

static double ppl_of(const char *json, const char *key) {
    json_t *o = json_loads(json, 0, NULL);
    cr_assert(o, "not JSON: %s", json);
    double x = json_number_value(json_object_get(o, key));
    json_decref(o);
    return x;
}

/* A GGUF gptneox (tanh GELU) with a byte-level vocabulary: collect,
 * decompose to half the cache, and the latent cache against the dense
 * export, whose attn_qkv gets new k and v rows between untouched q rows;
 * a Q8_0 file's stacked attn_qkv is refused by name. */
Test(neox, gguf_collect_decompose_and_dense_export, .timeout = 300) {
    if (access(TOKJSON, R_OK) != 0) cr_skip("%s is missing: run the tests from the repository root", TOKJSON);
    struct kv_config c = tiny_neox_cfg();
    c.dim = 256, c.hidden_dim = 512, c.n_heads = c.n_kv_heads = 4, c.head_dim = 64, c.rope_dim = 16;
    c.vocab_size = 4096, c.max_seq_len = 2048, c.gelu_erf = 0;
    struct kv_model *m, *hf;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_init_random(&c, 3, &m, &err), KV_OK, "%s", err.msg);
    for (int64_t l = 0; l < c.n_layers; l++) /* sharp attention, as in the family suite */
        for (int k = KV_W_Q; k <= KV_W_K; k++) {
            float *w = kv_model_weight_mut(m, (enum kv_wkind)k, l);
            for (int64_t i = 0; i < c.dim * c.dim; i++) w[i] *= 20;
        }
    char *dir = kvt_temp_dir(), *hfdir = kvt_path(dir, "hf"), *gguf = kvt_path(dir, "m.gguf");
    char *q8 = kvt_path(dir, "q8.gguf"), *text = kvt_path(dir, "text.txt");
    cr_assert_eq(kv_hf_write(m, hfdir, KV_DTYPE_F32, TOKJSON, &err), KV_OK, "%s", err.msg);
    kv_model_close(m);
    cr_assert_eq(kv_model_open(hfdir, NULL, &hf, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_gguf_write_model(hf, gguf, NULL, &err), KV_OK, "%s", err.msg);
    struct kv_gguf_write_opts o = {.matrix_type = 8};
    cr_assert_eq(kv_gguf_write_model(hf, q8, &o, &err), KV_OK, "%s", err.msg);
    kv_model_close(hf);
    FILE *f = fopen(text, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 400; i++) fprintf(f, "and the light shall come upon the earth %d. ", i % 37);
    fclose(f);
    char args[4096];
    snprintf(args, sizeof args,
             "collect -m '%s' -t '%s' --seq-len 64 --samples 8 --sequential --threads 2 -q -o '%s/s.kvstats'",
             gguf, text, dir);
    free(cli_ok(args));
    snprintf(args, sizeof args, "decompose -m '%s' -s '%s/s.kvstats' --method palu --ratio 0.5 -o '%s/c' -q",
             gguf, dir, dir);
    free(cli_ok(args));
    snprintf(args, sizeof args, "verify -m '%s' --text '%s' --seq-len 64 --max-windows 4 --threads 2 --json --compressed '%s/c'",
             gguf, text, dir);
    char *out = cli_ok(args);
    double latent = ppl_of(out, "ppl"), base = ppl_of(out, "base_ppl");
    free(out);
    snprintf(args, sizeof args, "export --dense '%s/c' -m '%s' -o '%s/dense.gguf'", dir, gguf, dir);
    free(cli_ok(args));
    snprintf(args, sizeof args, "verify -m '%s/dense.gguf' --text '%s' --seq-len 64 --max-windows 4 --threads 2 --json",
             dir, text);
    out = cli_ok(args);
    double dense = ppl_of(out, "ppl");
    free(out);
    cr_assert(fabs(latent - dense) <= 1e-4 * dense, "latent ppl %.8f vs dense export %.8f", latent, dense);
    cr_assert(fabs(latent - base) > 1e-5 * base, "half the cache changed nothing (%.8f)", latent);
    /* the dense file's q rows are the source's */
    struct kv_model *a, *b;
    snprintf(args, sizeof args, "%s/dense.gguf", dir);
    cr_assert_eq(kv_model_open(gguf, NULL, &a, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(args, NULL, &b, &err), KV_OK, "%s", err.msg);
    for (int64_t l = 0; l < c.n_layers; l++)
        cr_assert(!memcmp(kv_model_weight(a, KV_W_Q, l), kv_model_weight(b, KV_W_Q, l),
                          (size_t)(c.dim * c.dim) * sizeof(float)),
                  "q of layer %lld changed", (long long)l);
    kv_model_close(a), kv_model_close(b);
    char *o2, *e2;
    snprintf(args, sizeof args,
             "collect -m '%s' -t '%s' --seq-len 64 --samples 2 --sequential --threads 2 -q -o '%s/s8.kvstats'",
             q8, text, dir);
    free(cli_ok(args));
    snprintf(args, sizeof args, "decompose -m '%s' -s '%s/s8.kvstats' --method palu --ratio 0.5 -o '%s/c8' -q",
             q8, dir, dir);
    free(cli_ok(args));
    snprintf(args, sizeof args, "export --dense '%s/c8' -m '%s' -o '%s/dense8.gguf'", dir, q8, dir);
    int rc = kvt_run_cli(args, &o2, &e2);
    cr_assert_neq(rc, 0, "a Q8_0 attn_qkv was exported");
    cr_assert(strstr(e2, "tensor 'blk.0.attn_qkv.weight' stacks q, k and v in quantized type Q8_0"),
              "%s", e2);
    free(o2), free(e2);
    free(hfdir), free(gguf), free(q8), free(text);
    kvt_rm_dir(dir);
}

/* ---------------------------------------------------------------- corrupt GGUF */

/* gptneox's own keys, corrupted in place: each refusal names the key and
 * its offset. */
Test(neox, corrupt_gguf_keys_are_refused_at_their_offset) {
    struct kv_config c = tiny_neox_cfg();
    c.gelu_erf = 0;
    struct kv_model *m = random_neox(c, 5);
    uint64_t off;
    uint32_t five = 5, big = 17;
    uint8_t two = 2;
    char *p = patched_gguf(m, "gptneox.rope.dimension_count", &five, 4, &off);
    refused_at(p, off, "gptneox.rope.dimension_count 5 must be even and within 2..16 (the head size)");
    unlink(p), free(p);
    p = patched_gguf(m, "gptneox.rope.dimension_count", &big, 4, &off);
    refused_at(p, off, "gptneox.rope.dimension_count 17 must be even and within 2..16");
    unlink(p), free(p);
    p = patched_gguf(m, "gptneox.use_parallel_residual", &two, 1, &off);
    refused_at(p, off, "key 'gptneox.use_parallel_residual' is bool 2, expected 0 or 1");
    unlink(p), free(p);
    kv_model_close(m);
}
