/* The model families end to end through the command line: a random model
 * of each family's features (Llama with llama3 RoPE scaling, Mistral with a
 * sliding window shorter than the windows, Qwen2 with q/k/v biases, yarn
 * scaling and a window in its upper layer, Phi-3, Qwen3, GPT-NeoX with a
 * partial rope and a parallel residual, Gemma 2) written as an HF directory, then
 * collect (with --fisher), decompose by every method at --eps 1 (the base
 * model again: 1e-4 relative PPL), and at --ratio 0.5 the latent cache
 * against the dense export (the same computation: 1e-4). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvformats.h"
#include "model.h"
#include "naive_llama.h"
#include "testutil.h"

#define TOKJSON "data/kjv-bpe-llama/tokenizer.json" /* 4,096 byte-level BPE ids */

static void run_ok(const char *args, char **out) {
    char *o, *e;
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d; stderr:\n%s", args, rc, e);
    free(e);
    if (out) *out = o;
    else free(o);
}

static double json_num(const char *text, const char *key) {
    json_t *o = json_loads(text, 0, NULL);
    cr_assert(o, "not JSON: %s", text);
    json_t *v = json_object_get(o, key);
    cr_assert(v && json_is_number(v), "no number '%s' in %s", key, text);
    double x = json_number_value(v);
    json_decref(o);
    return x;
}

/* Words drawn from a small list by a fixed generator: text the byte-level
 * vocabulary cuts into many ids. */
static char *write_text(const char *dir) {
    static const char *words[] = {"the",  "light", "and",   "shall", "unto",  "them", "which",
                                  "said", "came",  "upon",  "earth", "water", "for",  "were"};
    char *p = kvt_path(dir, "text.txt");
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f);
    uint64_t s = 88172645463325252ull;
    for (int i = 0; i < 6000; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        fprintf(f, "%s%s", words[s % 14], i % 17 == 16 ? ".\n" : " ");
    }
    fclose(f);
    return p;
}

static struct kv_config family_cfg(enum kv_arch arch) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, arch == KV_ARCH_QWEN2, 0);
    if (arch == KV_ARCH_QWEN3) c.window_period = 0; /* plain rope, no window: the norms alone */
    c.arch = arch;
    c.dim = 256, c.hidden_dim = 512, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 64, c.vocab_size = 4096, c.max_seq_len = 2048, c.rope_theta = 10000.0f;
    c.bos_id = c.eos_id = -1;
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    if (arch == KV_ARCH_LLAMA) {
        s->type = KV_ROPE_SCALING_LLAMA3, s->factor = 8, s->low_freq_factor = 1;
        s->high_freq_factor = 4, s->original_ctx = 256;
    } else if (arch == KV_ARCH_MISTRAL) {
        c.sliding_window = 24, c.window_period = 1;
        s->type = KV_ROPE_SCALING_LINEAR, s->factor = 2;
    } else if (arch == KV_ARCH_PHI3) { /* Phi-3-mini-128k's scaling, a window in every layer */
        c.sliding_window = 30, c.window_period = 1;
        s->type = KV_ROPE_SCALING_LONGROPE, s->factor = 32, s->original_ctx = 256;
        s->n_factors = c.head_dim / 2;
        for (int64_t i = 0; i < s->n_factors; i++)
            s->short_factor[i] = 1.0f + 0.05f * (float)i, s->long_factor[i] = 1.0f + 1.5f * (float)i;
    } else if (arch == KV_ARCH_QWEN3) {
        s->type = KV_ROPE_SCALING_NONE;
    } else if (arch == KV_ARCH_GEMMA2) { /* Gemma 2's caps and scale; a window on even layers */
        c.sliding_window = 24, c.window_from = 0, c.window_period = 2;
        c.attn_scale = (float)(1.0 / sqrt(48.0)), c.attn_softcap = 50.0f, c.final_softcap = 30.0f;
        c.norm_offset = 1.0f, c.tied_embeddings = 1, c.n_kv_heads = 2;
        s->type = KV_ROPE_SCALING_NONE;
    } else if (arch == KV_ARCH_GPTNEOX) { /* Pythia's: a quarter of each head turned */
        c.n_kv_heads = c.n_heads, c.rope_dim = 16, c.parallel_residual = 1, c.gelu_erf = 1;
        c.has_qkv_bias = 1, c.tied_embeddings = 0, c.window_period = 0;
        s->type = KV_ROPE_SCALING_NONE;
    } else {
        c.sliding_window = 40, c.window_from = 1, c.window_period = 1;
        s->type = KV_ROPE_SCALING_YARN, s->factor = 4, s->original_ctx = 512;
        s->beta_fast = 32, s->beta_slow = 1, s->truncate = 1, s->attention_factor = 1 + 0.1 * log(4.0);
    }
    return c;
}

static double verify_ppl(const char *model, const char *text, const char *extra, double *base) {
    char args[4096], *out;
    snprintf(args, sizeof args, "verify -m '%s' --text '%s' --seq-len 64 --max-windows 4 --threads 2 --json %s",
             model, text, extra);
    run_ok(args, &out);
    double p = json_num(out, "ppl");
    if (base) *base = json_num(out, "base_ppl");
    free(out);
    return p;
}

static void run_family(enum kv_arch arch) {
    if (access(TOKJSON, R_OK) != 0) cr_skip("%s is missing: run the tests from the repository root", TOKJSON);
    struct kv_config c = family_cfg(arch);
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, 11, &m, &err), KV_OK, "%s", err.msg);
    sharpen(m);
    for (int64_t l = 0; l < c.n_layers; l++) /* Qwen3's norms away from 1 */
        for (int k = KV_W_QNORM; k <= KV_W_KNORM; k++) {
            float *nw = kv_model_weight_mut(m, (enum kv_wkind)k, l);
            for (int64_t i = 0; nw && i < c.head_dim; i++) nw[i] = 0.6f + 0.8f * (float)((i * 37 + l * 11 + k) % 17) / 17.0f;
        }
    char *dir = kvt_temp_dir(), *model = kvt_path(dir, "model"), *text = write_text(dir);
    cr_assert_eq(kv_hf_write(m, model, KV_DTYPE_F32, TOKJSON, &err), KV_OK, "%s", err.msg);
    kv_model_close(m);
    /* the written directory reads back as the family, scaling and window included */
    struct kv_model *back;
    cr_assert_eq(kv_model_open(model, NULL, &back, &err), KV_OK, "%s", err.msg);
    const struct kv_config *bc = kv_model_config(back);
    cr_assert_eq(bc->arch, arch);
    cr_assert_eq(bc->rope_scaling.type, c.rope_scaling.type, "%s: scaling", kv_arch_name(arch));
    cr_assert_eq(bc->sliding_window, c.sliding_window, "%s: window", kv_arch_name(arch));
    cr_assert_eq(bc->window_from, c.window_from, "%s: window start", kv_arch_name(arch));
    kv_model_close(back);

    char args[8192], stats[1200], out[1200];
    snprintf(stats, sizeof stats, "%s/s.kvstats", dir);
    snprintf(args, sizeof args,
             "collect -m '%s' -t '%s' --seq-len 64 --samples 8 --sequential --fisher --threads 2 -q -o '%s'",
             model, text, stats);
    run_ok(args, NULL);
    const char *methods[] = {"svd", "palu", "eigen", "lorc", "fdc", "zack"};
    for (int i = 0; i < 6; i++) {
        snprintf(out, sizeof out, "%s/full-%s", dir, methods[i]);
        snprintf(args, sizeof args, "decompose -m '%s' -s '%s' --method %s --eps 1 -o '%s' -q", model,
                 stats, methods[i], out);
        run_ok(args, NULL);
        char extra[1400];
        snprintf(extra, sizeof extra, "--compressed '%s'", out);
        double base, p = verify_ppl(model, text, extra, &base);
        cr_assert(fabs(p - base) <= 1e-4 * base, "%s %s at --eps 1: ppl %.8f vs base %.8f",
                  kv_arch_name(arch), methods[i], p, base);
    }
    /* half the cache: the latent cache computes what the dense export does */
    snprintf(out, sizeof out, "%s/half", dir);
    snprintf(args, sizeof args, "decompose -m '%s' -s '%s' --method palu --alloc fisher --ratio 0.5 -o '%s' -q",
             model, stats, out);
    run_ok(args, NULL);
    char extra[1400], dense[1200];
    snprintf(extra, sizeof extra, "--compressed '%s'", out);
    double base, latent = verify_ppl(model, text, extra, &base);
    snprintf(dense, sizeof dense, "%s/dense", dir);
    snprintf(args, sizeof args, "export --dense '%s' -m '%s' -o '%s'", out, model, dense);
    run_ok(args, NULL);
    double dp = verify_ppl(dense, text, "", NULL);
    cr_log_info("%s: base %.6f, half-cache latent %.6f, dense export %.6f", kv_arch_name(arch), base,
                latent, dp);
    cr_assert(fabs(latent - dp) <= 1e-4 * dp, "%s: latent ppl %.8f vs dense %.8f", kv_arch_name(arch),
              latent, dp);
    cr_assert(fabs(latent - base) > 1e-5 * base, "%s: half the cache changed nothing (%.8f)",
              kv_arch_name(arch), latent);
    free(model), free(text);
    kvt_rm_dir(dir);
}

Test(families, llama_with_llama3_scaling, .timeout = 300) { run_family(KV_ARCH_LLAMA); }
Test(families, mistral_with_a_sliding_window, .timeout = 300) { run_family(KV_ARCH_MISTRAL); }
Test(families, qwen2_with_biases_yarn_and_a_window, .timeout = 300) { run_family(KV_ARCH_QWEN2); }
Test(families, phi3_fused_with_longrope_and_a_window, .timeout = 300) { run_family(KV_ARCH_PHI3); }
Test(families, qwen3_with_per_head_qk_norms, .timeout = 300) { run_family(KV_ARCH_QWEN3); }
Test(families, gpt_neox_partial_rope_parallel_residual, .timeout = 300) { run_family(KV_ARCH_GPTNEOX); }
Test(families, gemma2_softcaps_post_norms_alternating_window, .timeout = 300) { run_family(KV_ARCH_GEMMA2); }
