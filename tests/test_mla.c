/* The MLA export (calib/mla.c, kvcal export --mla): which models and
 * options convert, with their messages; the rewrite exact where DESIGN says
 * (a float64 oracle of the MLA form against one of the model); the GGUF
 * deepseek2 file kvcal
 * writes for data/kjv-llama, its keys and tensor shapes as llama.cpp reads
 * them (llama.cpp itself runs the rewrite in tests/test_llamacpp.c). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "ggufmodelw.h"
#include "kvcalib.h"
#include "kvstats.h"
#include "model.h"
#include "naive_llama.h"
#include "naive_mla.h"
#include "safetensors.h"
#include "testutil.h"
#include "xorshift64.h"

static struct kv_config llama_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_LLAMA;
    c.dim = 256, c.hidden_dim = 512, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 64, c.vocab_size = 300, c.max_seq_len = 256, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF;
    return c;
}

Test(mla, models_and_options_that_do_not_convert_say_why) {
    struct kv_mla_opts ok = {64, 64, 1, 1, 0, NULL, 0, 0};
    struct kv_err e;
    struct kv_config c = llama_cfg();
    cr_assert_eq(kv_mla_check(&c, &ok, &e), KV_OK, "%s", e.msg);
    enum { GPT2, BIAS, WINDOW, SCALING, ODD_ROPE, WIDE_ROPE, STEP, RANK0, RANK };
    static const struct {
        int what;
        int code;
        const char *msg;
    } rows[] = {
        {GPT2, KV_EUNSUPPORTED,
         "architecture 'gpt2' has no deepseek2 form: only llama and mistral layers (RMSNorm, "
         "RoPE, SwiGLU, no attention biases) convert"},
        {BIAS, KV_EUNSUPPORTED, "q/k/v biases have no place in llama.cpp's deepseek2"},
        {WINDOW, KV_EUNSUPPORTED, "a sliding window of 64 positions has no deepseek2 key"},
        {SCALING, KV_EUNSUPPORTED,
         "rope scaling 'linear' has no deepseek2 form (its frequencies must be theta^(-2i/R))"},
        {ODD_ROPE, KV_EINVAL, "rope dims 33 must be even, from 2 to the head size 64"},
        {WIDE_ROPE, KV_EINVAL, "rope dims 66 must be even, from 2 to the head size 64"},
        {STEP, KV_EINVAL, "rope step 3 over 16 pairs passes the head's 32 pairs"},
        {RANK0, KV_EINVAL, "kv lora rank 0 must be from 1 to 256 (keys and values of every KV head)"},
        {RANK, KV_EINVAL, "kv lora rank 257 must be from 1 to 256 (keys and values of every KV head)"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_config ci = llama_cfg();
        struct kv_mla_opts oi = ok;
        switch (rows[i].what) {
        case GPT2: ci.arch = KV_ARCH_GPT2; break;
        case BIAS: ci.has_qkv_bias = 1; break;
        case WINDOW: ci.sliding_window = 64; break;
        case SCALING: ci.rope_scaling.type = KV_ROPE_SCALING_LINEAR; break;
        case ODD_ROPE: oi.rope_dim = 33; break;
        case WIDE_ROPE: oi.rope_dim = 66; break;
        case STEP: oi.rope_dim = 32, oi.rope_step = 3; break;
        case RANK0: oi.kv_lora_rank = 0; break;
        case RANK: oi.kv_lora_rank = 257; break;
        }
        kv_err_clear(&e);
        cr_assert_eq(kv_mla_check(&ci, &oi, &e), rows[i].code, "row %zu: %s", i, e.msg);
        cr_assert_str_eq(e.msg, rows[i].msg, "row %zu", i);
    }
    /* the largest step that fits: pairs 0, 2, ..., 30 of 32 */
    struct kv_mla_opts edge = {64, 32, 2, 1, 0, NULL, 0, 0};
    cr_assert_eq(kv_mla_check(&c, &edge, &e), KV_OK, "%s", e.msg);
}

Test(mla, kjv_llama_exports_a_deepseek2_gguf, .timeout = 300) {
    KVT_NEED_KJV();
    char *dir = kvt_temp_dir(), *st = kvt_path(dir, "s.kvstats"), *out = kvt_path(dir, "m.gguf");
    char args[4096], *o, *e;
    snprintf(args, sizeof args, "collect -m data/kjv-llama -t data/kjv/train.txt --samples 8 "
                                "--seq-len 64 --threads 1 -q -o '%s'", st);
    cr_assert_eq(kvt_run_cli(args, NULL, &e), 0, "%s", e);
    free(e);
    /* usage */
    struct {
        const char *args;
        const char *err;
    } bad[] = {
        {"export --mla --dense x -m data/kjv-llama -o y", "kvcal export: give one of --dense DIR or --mla\n"},
        {"export --dense x -m data/kjv-llama --ratio 0.5 -o y",
         "kvcal export: --stats, --kv-lora-rank, --ratio, --rope-dim, --rope-step, --no-balance, --text, "
         "--parse-special and --latent-norm-eps go with --mla\n"},
        {"export --mla -m data/kjv-llama -o y", "kvcal export: --mla needs --stats FILE (kvcal collect of the model)\n"},
        {"export --mla -m data/kjv-llama -s S -o y",
         "kvcal export: --mla needs exactly one of --kv-lora-rank N or --ratio X\n"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = kvt_run_cli(bad[i].args, &o, &e);
        cr_assert_eq(rc, 2, "%s: exit %d\n%s", bad[i].args, rc, e);
        cr_assert(!strncmp(e, bad[i].err, strlen(bad[i].err)), "%s:\n%s", bad[i].args, e);
        free(o), free(e);
    }
    /* 0.25 of the bytes with the whole head's rope key leaves no latent */
    snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.25 -o '%s'", st, out);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 1, "%s", e);
    cr_assert_str_eq(e, "kvcal: --ratio 0.25 keeps 64 values a token and layer, and the rope key "
                        "alone takes 64: lower --rope-dim\n");
    free(o), free(e);
    /* the turn fitted on calibration text: said, and closer to the model
     * than the residual scored as it is (KL on 4 windows of the Gospels) */
    char *turned = kvt_path(dir, "turned.gguf"), *plain = kvt_path(dir, "plain.gguf");
    snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 --windows 2 -o '%s'", st, out);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 2, "%s", e);
    cr_assert_str_eq(e, "kvcal export: --windows and --seq-len go with --text\n"
                        "usage: kvcal export --dense DIR --model PATH -o OUT [options] | --mla --model "
                        "PATH --stats FILE -o OUT[.gguf] (see 'kvcal export --help')\n");
    free(o), free(e);
    snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 -t data/kjv/train.txt "
                                "--windows 2 -o '%s'", st, turned);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "\nturn      fitted on data/kjv/train.txt: 2 windows of 256 from its start\n") &&
              strstr(o, "latent keeps (k+v energy)  mean attention distance\n"), "%s", o);
    free(o), free(e);
    snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 -o '%s'", st, plain);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "--text FILE fits a turn for it on calibration text"), "%s", o);
    free(o), free(e);
    double kl[2];
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' "
                                    "--max-windows 4 --json -q", i ? turned : plain);
        cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
        json_t *j = json_loads(o, 0, NULL);
        cr_assert(j, "%s", o);
        kl[i] = json_number_value(json_object_get(j, "kl"));
        json_decref(j);
        free(o), free(e);
    }
    cr_log_info("kjv-llama at 0.5, 4 windows: KL %.4f as it is, %.4f turned", kl[0], kl[1]);
    cr_assert_lt(kl[1], 0.8 * kl[0], "KL %.4f turned against %.4f as it is", kl[1], kl[0]);
    free(turned), free(plain);
    /* 0.25 as rope 16 (pairs 0, 2, ..., 14) and a latent of 48 */
    snprintf(args, sizeof args,
             "export --mla -m data/kjv-llama -s '%s' --ratio 0.25 --rope-dim 16 --rope-step 2 -o '%s'", st, out);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "kv_lora_rank 48, rope dims 16, pairs 0..14 step 2, freq_base 10"), "%s", o);
    cr_assert(strstr(o, "cache     64 values a token and layer against 256: 0.2500 of the base"), "%s", o);
    free(o), free(e);
    struct kv_gguf_file *g;
    struct kv_err err;
    cr_assert_eq(kv_gguf_open(out, &g, &err), KV_OK, "%s", err.msg);
    struct kv_gguf_str arch;
    cr_assert_eq(kv_gguf_get_str(g, "general.architecture", &arch, &err), KV_OK);
    cr_assert(arch.len == 9 && !memcmp(arch.p, "deepseek2", 9));
    static const struct {
        const char *key;
        uint32_t want;
    } keys[] = {{"deepseek2.attention.kv_lora_rank", 48}, {"deepseek2.rope.dimension_count", 16},
                {"deepseek2.attention.key_length", 64},   {"deepseek2.attention.value_length", 48},
                {"deepseek2.attention.key_length_mla", 80}, {"deepseek2.attention.value_length_mla", 64},
                {"deepseek2.attention.head_count_kv", 1}, {"deepseek2.leading_dense_block_count", 4},
                {"deepseek2.attention.q_lora_rank", 0},   {"deepseek2.expert_count", 0}};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        uint32_t v = 0;
        cr_assert_eq(kv_gguf_get_u32(g, keys[i].key, &v, &err), KV_OK, "%s: %s", keys[i].key, err.msg);
        cr_assert_eq(v, keys[i].want, "%s: %u, want %u", keys[i].key, v, keys[i].want);
    }
    float base;
    cr_assert_eq(kv_gguf_get_f32(g, "deepseek2.rope.freq_base", &base, &err), KV_OK);
    /* pairs 0, 2, ...: θ' = θ^(2·16/64) = 10000^0.5 */
    cr_assert_float_eq(base, 100.0f, 1e-3f, "freq_base %g", (double)base);
    static const struct {
        const char *name;
        int64_t ne[3];
        uint32_t type;
    } ts[] = {{"blk.0.attn_q.weight", {256, 4 * 80, 1}, 0},
              {"blk.0.attn_kv_a_mqa.weight", {256, 64, 1}, 0},
              {"blk.0.attn_kv_a_norm.weight", {48, 1, 1}, 0},
              {"blk.0.attn_k_b.weight", {64, 48, 4}, 0},
              {"blk.0.attn_v_b.weight", {48, 64, 4}, 0},
              {"blk.3.ffn_down.weight", {704, 256, 1}, 0}};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
        const struct kv_gguf_tensor *t = kv_gguf_find_tensor(g, ts[i].name);
        cr_assert(t, "%s is missing", ts[i].name);
        cr_assert_eq(t->n_dims, ts[i].ne[2] > 1 ? 3 : ts[i].ne[1] > 1 ? 2 : 1, "%s: %d dims", ts[i].name, t->n_dims);
        for (int d = 0; d < t->n_dims; d++)
            cr_assert_eq(t->ne[d], ts[i].ne[d], "%s ne[%d] %lld, want %lld", ts[i].name, d,
                         (long long)t->ne[d], (long long)ts[i].ne[d]);
        cr_assert_eq(t->ggml_type, ts[i].type, "%s type %u", ts[i].name, t->ggml_type);
    }
    kv_gguf_close(g);
    free(st), free(out);
    kvt_rm_dir(dir);
}

/* A random Llama of 2 layers, dim 128, 4 heads of 64 over G KV heads, its
 * queries and keys scaled up for sharper attention than N(0, 0.02) gives,
 * and statistics of 4 random windows of 48 (the last in ids). */
static struct kv_model *random_case_layout(int64_t G, enum kv_rope_layout layout, uint64_t seed,
                                          struct kv_stats **s, int32_t ids[48]) {
    struct kv_config c = llama_cfg();
    c.rope_layout = layout;
    c.n_kv_heads = G, c.n_layers = 2, c.dim = 128, c.hidden_dim = 256, c.bos_id = 1;
    struct kv_model *m;
    struct kv_err e;
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &e), KV_OK, "%s", e.msg);
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int k = KV_W_Q; k <= KV_W_K; k++) {
            float *w = (float *)kv_model_weight(m, (enum kv_wkind)k, l);
            for (int64_t i = 0; i < (k == KV_W_Q ? 4 : G) * 64 * c.dim; i++) w[i] *= 6;
        }
    struct kv_accum *a;
    cr_assert_eq(kv_stats_init(kv_model_config(m), s, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_accum_init(m, *s, 48, &a, &e), KV_OK, "%s", e.msg);
    uint64_t st = seed * 7 + 1;
    for (int w = 0; w < 4; w++) {
        for (int i = 0; i < 48; i++) ids[i] = i == 0 ? 1 : (int32_t)(rng_next(&st) % 300);
        cr_assert_eq(kv_accum_window(a, ids, &e), KV_OK, "%s", e.msg);
    }
    kv_accum_sync(a);
    kv_accum_free(a);
    return m;
}

static struct kv_model *random_case(int64_t G, uint64_t seed, struct kv_stats **s, int32_t ids[48]) {
    return random_case_layout(G, KV_ROPE_HALF, seed, s, ids);
}

/* With one KV head and the latent at full rank, the MLA form computes the
 * model: the float64 oracle of each (tests/naive_mla.h, naive_llama.h) on
 * 48 positions, to the float32 rounding of the rewritten weights. With two
 * heads it does not (the rotation lost), by far more. */
Test(mla, one_kv_head_at_full_rank_is_the_model) {
    for (int G = 1; G <= 2; G++) {
        struct kv_err e;
        struct kv_stats *s;
        int32_t ids[48];
        struct kv_model *m = random_case(G, 5, &s, ids);
        struct kv_mla_opts o = {2 * G * 64, 64, 1, 1, 0, NULL, 0, 0};
        struct kv_mla *mla;
        cr_assert_eq(kv_mla_convert(m, s, &o, &mla, NULL, &e), KV_OK, "%s", e.msg);
        double *base = naive_forward(m, ids, 48), *mf = naive_mla_forward(m, mla, ids, 48);
        kvt_log_softmax_rows(base, 48, 300), kvt_log_softmax_rows(mf, 48, 300);
        double worst = 0;
        int64_t at = 0;
        for (int64_t i = 0; i < 48 * 300; i++)
            if (fabs(base[i] - mf[i]) > worst) worst = fabs(base[i] - mf[i]), at = i;
        cr_log_info("%d kv heads: max |dlogp| %.2e at position %lld", G, worst, (long long)(at / 300));
        if (G == 1)
            cr_assert_leq(worst, 1e-4, "one kv head: max |dlogp| %.3g at position %lld", worst,
                          (long long)(at / 300));
        else
            cr_assert_gt(worst, 1e-2, "two kv heads lose rotation, yet max |dlogp| is %.3g", worst);
        free(base), free(mf);
        kv_mla_free(mla);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

/* The HF directory, taken through the mapping llama.cpp's converter
 * (convert_hf_to_gguf.py, DeepseekV2Model, in the llama.cpp release
 * node-llama-cpp ships) applies to DeepseekV2ForCausalLM, is the GGUF
 * export, which llama.cpp runs (llamacpp/mla_*): config.json to the
 * deepseek2 keys, each tensor to its GGUF name (gguf-py's tensor map), and
 * kv_b_proj viewed as [heads, qk_nope + v, kv_lora_rank], split into k_b
 * (transposed) and v_b. Every float equal, every GGUF tensor accounted for.
 * Reading both back (kv_mla_open) gives the same struct. */
Test(mla, hf_directory_is_the_gguf_through_llamacpps_converter) {
    struct kv_err e;
    struct kv_stats *s;
    int32_t ids[48];
    struct kv_model *m = random_case(2, 11, &s, ids);
    struct kv_mla_opts o = {48, 16, 2, 1, 0, NULL, 0, 0};
    char *dir = kvt_temp_dir(), *gpath = kvt_path(dir, "m.gguf"), *hdir = kvt_path(dir, "hf");
    cr_assert_eq(kv_mla_export_gguf(m, s, &o, gpath, NULL, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_mla_export_hf(m, s, &o, hdir, NULL, 0, NULL, &e), KV_OK, "%s", e.msg);
    char *cpath = kvt_path(hdir, "config.json"), *wpath = kvt_path(hdir, "model.safetensors");
    json_error_t je;
    json_t *cfg = json_load_file(cpath, 0, &je);
    cr_assert(cfg, "%s", je.text);
    struct kv_gguf_file *g;
    struct kv_st_file *st;
    cr_assert_eq(kv_gguf_open(gpath, &g, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_st_open(wpath, &st, &e), KV_OK, "%s", e.msg);
#define CI(k) ((int64_t)json_integer_value(json_object_get(cfg, k)))
    cr_assert_str_eq(json_string_value(json_object_get(cfg, "model_type")), "deepseek_v2");
    int64_t L = CI("num_hidden_layers"), H = CI("num_attention_heads"), dc = CI("kv_lora_rank");
    int64_t R = CI("qk_rope_head_dim"), n = CI("qk_nope_head_dim"), v = CI("v_head_dim");
    /* set_gguf_parameters: the keys each config member becomes */
    const struct {
        const char *key;
        int64_t want;
    } keys[] = {
        {"deepseek2.block_count", L},
        {"deepseek2.embedding_length", CI("hidden_size")},
        {"deepseek2.feed_forward_length", CI("intermediate_size")},
        {"deepseek2.expert_feed_forward_length", CI("moe_intermediate_size")},
        {"deepseek2.attention.head_count", H},
        {"deepseek2.attention.head_count_kv", 1}, /* the converter sets num_key_value_heads 1 */
        {"deepseek2.leading_dense_block_count", CI("first_k_dense_replace")},
        {"deepseek2.attention.kv_lora_rank", dc},
        {"deepseek2.attention.key_length", dc + R},
        {"deepseek2.attention.value_length", dc},
        {"deepseek2.attention.key_length_mla", n + R},
        {"deepseek2.attention.value_length_mla", v},
        {"deepseek2.rope.dimension_count", R},
        {"deepseek2.context_length", CI("max_position_embeddings")},
        {"deepseek2.vocab_size", CI("vocab_size")},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        uint32_t got = 0;
        cr_assert_eq(kv_gguf_get_u32(g, keys[i].key, &got, &e), KV_OK, "%s: %s", keys[i].key, e.msg);
        cr_assert_eq((int64_t)got, keys[i].want, "%s: gguf %u, config.json gives %lld", keys[i].key,
                     got, (long long)keys[i].want);
    }
    cr_assert(json_is_null(json_object_get(cfg, "q_lora_rank")) &&
              json_is_null(json_object_get(cfg, "n_routed_experts")) && CI("first_k_dense_replace") == L &&
              CI("num_key_value_heads") == H, "every layer dense, no q-LoRA, a kv head per head");
    const struct {
        const char *key, *member;
    } reals[] = {{"deepseek2.attention.layer_norm_rms_epsilon", "rms_norm_eps"},
                 {"deepseek2.rope.freq_base", "rope_theta"}};
    for (size_t i = 0; i < 2; i++) {
        float got = 0;
        cr_assert_eq(kv_gguf_get_f32(g, reals[i].key, &got, &e), KV_OK, "%s", e.msg);
        double want = json_number_value(json_object_get(cfg, reals[i].member));
        cr_assert_eq(got, (float)want, "%s: gguf %.9g, config.json %.9g", reals[i].key, (double)got, want);
    }
    /* the tensors: HF name -> GGUF name, equal float for float */
    int64_t mapped = 0;
    char gn[160];
    for (int64_t i = 0; i < st->n_tensors; i++) {
        const struct kv_tensor *t = &st->tensors[i];
        cr_assert_eq(t->dtype, KV_DTYPE_F32, "%s", t->name);
        int64_t l;
        char rest[128];
        static const char *const glob[][2] = {{"model.embed_tokens.weight", "token_embd.weight"},
                                              {"model.norm.weight", "output_norm.weight"},
                                              {"lm_head.weight", "output.weight"}};
        static const char *const lay[][2] = {{"input_layernorm.weight", "attn_norm.weight"},
                                             {"post_attention_layernorm.weight", "ffn_norm.weight"},
                                             {"mlp.gate_proj.weight", "ffn_gate.weight"},
                                             {"mlp.up_proj.weight", "ffn_up.weight"},
                                             {"mlp.down_proj.weight", "ffn_down.weight"},
                                             {"self_attn.q_proj.weight", "attn_q.weight"},
                                             {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
                                             {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
                                             {"self_attn.o_proj.weight", "attn_output.weight"}};
        gn[0] = 0;
        for (size_t k = 0; k < 3; k++)
            if (!strcmp(t->name, glob[k][0])) snprintf(gn, sizeof gn, "%s", glob[k][1]);
        if (!gn[0]) {
            cr_assert_eq(sscanf(t->name, "model.layers.%lld.%127s", (long long *)&l, rest), 2, "%s", t->name);
            if (!strcmp(rest, "self_attn.kv_b_proj.weight")) {
                /* kv_b.view(H, n + v, dc); k_b = [:, :n, :].transpose(1, 2); v_b = [:, n:, :] */
                const float *kvb = t->data;
                cr_assert(t->ndim == 2 && t->shape[0] == H * (n + v) && t->shape[1] == dc);
                snprintf(gn, sizeof gn, "blk.%lld.attn_k_b.weight", (long long)l);
                const struct kv_gguf_tensor *kb = kv_gguf_find_tensor(g, gn);
                snprintf(gn, sizeof gn, "blk.%lld.attn_v_b.weight", (long long)l);
                const struct kv_gguf_tensor *vb = kv_gguf_find_tensor(g, gn);
                cr_assert(kb && vb && kb->t.dtype == KV_DTYPE_F32 && vb->t.dtype == KV_DTYPE_F32);
                cr_assert(kb->ne[0] == n && kb->ne[1] == dc && kb->ne[2] == H, "k_b [H, dc, n]");
                cr_assert(vb->ne[0] == dc && vb->ne[1] == v && vb->ne[2] == H, "v_b [H, v, dc]");
                const float *K = kb->t.data, *V = vb->t.data;
                for (int64_t h = 0; h < H; h++)
                    for (int64_t r = 0; r < dc; r++) {
                        for (int64_t j = 0; j < n; j++)
                            cr_assert_eq(K[(h * dc + r) * n + j], kvb[(h * (n + v) + j) * dc + r],
                                         "layer %lld k_b[%lld][%lld][%lld]", (long long)l, (long long)h,
                                         (long long)r, (long long)j);
                        for (int64_t j = 0; j < v; j++)
                            cr_assert_eq(V[(h * v + j) * dc + r], kvb[(h * (n + v) + n + j) * dc + r],
                                         "layer %lld v_b[%lld][%lld][%lld]", (long long)l, (long long)h,
                                         (long long)j, (long long)r);
                    }
                mapped += 2;
                continue;
            }
            for (size_t k = 0; k < sizeof lay / sizeof lay[0]; k++)
                if (!strcmp(rest, lay[k][0])) snprintf(gn, sizeof gn, "blk.%lld.%s", (long long)l, lay[k][1]);
        }
        cr_assert(gn[0], "%s has no place in the converter's map", t->name);
        const struct kv_gguf_tensor *gt = kv_gguf_find_tensor(g, gn);
        cr_assert(gt, "%s: gguf has no %s", t->name, gn);
        cr_assert(gt->t.dtype == KV_DTYPE_F32 && gt->t.nbytes == t->nbytes, "%s: %llu bytes, gguf %llu",
                  t->name, (unsigned long long)t->nbytes, (unsigned long long)gt->t.nbytes);
        /* safetensors [out, in] is GGUF ne {in, out}: the same row-major bytes */
        cr_assert(gt->ne[0] == t->shape[t->ndim - 1], "%s: ne[0] %lld", t->name, (long long)gt->ne[0]);
        cr_assert(!memcmp(gt->t.data, t->data, t->nbytes), "%s differs from gguf %s", t->name, gn);
        mapped++;
    }
    cr_assert_eq(mapped, g->n_tensors, "%lld tensors mapped, the gguf holds %lld",
                 (long long)mapped, (long long)g->n_tensors);
#undef CI
    /* read back, both are one model */
    struct kv_mla *a, *b;
    cr_assert_eq(kv_mla_open(gpath, m, &a, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_mla_open(hdir, m, &b, &e), KV_OK, "%s", e.msg);
    cr_assert(a->n_layers == b->n_layers && a->n_heads == b->n_heads && a->kv_lora_rank == b->kv_lora_rank &&
              a->rope_dim == b->rope_dim && a->nope_dim == b->nope_dim && a->v_dim == b->v_dim &&
              a->rope_base == b->rope_base && a->latent_eps == b->latent_eps &&
              !strcmp(a->base_fingerprint, b->base_fingerprint));
    for (int64_t l = 0; l < L; l++) {
        const struct kv_mla_layer *x = &a->layers[l], *y = &b->layers[l];
        cr_assert(!memcmp(x->wq, y->wq, (size_t)(H * (n + R) * 128) * 4) &&
                  !memcmp(x->wkv_a, y->wkv_a, (size_t)((dc + R) * 128) * 4) &&
                  !memcmp(x->kv_norm, y->kv_norm, (size_t)dc * 4) &&
                  !memcmp(x->wk_b, y->wk_b, (size_t)(H * dc * n) * 4) &&
                  !memcmp(x->wv_b, y->wv_b, (size_t)(H * v * dc) * 4), "layer %lld", (long long)l);
    }
    kv_mla_free(a), kv_mla_free(b);
    /* for transformers (its kv_a_layernorm's epsilon is 1e-6): the same
     * gain, the latent's input scaled by sqrt(1e-6 / 1e-5), the epsilon in
     * the metadata; GGUF has no place for it */
    struct kv_mla_opts o6 = o;
    o6.latent_eps = 1e-6;
    char *h6 = kvt_path(dir, "hf6");
    cr_assert_eq(kv_mla_export_gguf(m, s, &o6, gpath, NULL, &e), KV_EINVAL);
    cr_assert(strstr(e.msg, "a latent norm epsilon of 1e-06 is for an HF directory"), "%s", e.msg);
    cr_assert_eq(kv_mla_export_hf(m, s, &o6, h6, NULL, 0, NULL, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_mla_open(h6, m, &b, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_mla_open(hdir, m, &a, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(b->latent_eps, 1e-6f);
    double worst = 0;
    for (int64_t i = 0; i < dc * 128; i++) {
        double want = a->layers[0].wkv_a[i] * sqrt(0.1), got = b->layers[0].wkv_a[i];
        double rel = fabs(got - want) / (fabs(want) + 1e-30);
        worst = rel > worst ? rel : worst;
    }
    cr_assert_leq(worst, 1e-6, "latent rows scaled by sqrt(0.1): worst relative %.3g", worst);
    cr_assert(!memcmp(a->layers[0].kv_norm, b->layers[0].kv_norm, (size_t)dc * 4), "the same gain");
    kv_mla_free(a), kv_mla_free(b);
    json_decref(cfg);
    kv_st_close(st);
    kv_gguf_close(g);
    kv_stats_free(s);
    kv_model_close(m);
    free(gpath), free(hdir), free(cpath), free(wpath), free(h6);
    kvt_rm_dir(dir);
}

/* The turn (kv_mla_fit_turn) against a float64 oracle written from its
 * definition (docs/design.md, step 3'), with a rope key of 16 of 64: pairs
 * 8..31 lose RoPE whole (the residual is the key itself), and for each
 * the least squares of q·R(−ωΔ)k ≈ c q·k + s (q_a k_b − q_b k_a), weighed
 * by the attention weights and centred per query, over two windows of 48,
 * solved here in closed form from the oracle's own queries, keys and
 * softmax. One KV head with rotate-half pairs, where pairs 0..7 keep RoPE
 * whole (nothing to turn: the identity), and two KV heads (each query
 * head against its own) with interleaved pairs. */
static double *oracle_q[2], *oracle_k[2];
static int64_t oracle_G;
static void keep_qk(int64_t l, const double *q, const double *k, int64_t n) {
    free(oracle_q[l]), free(oracle_k[l]);
    oracle_q[l] = malloc((size_t)(n * 4 * 64) * sizeof(double));
    oracle_k[l] = malloc((size_t)(n * oracle_G * 64) * sizeof(double));
    memcpy(oracle_q[l], q, (size_t)(n * 4 * 64) * sizeof(double));
    memcpy(oracle_k[l], k, (size_t)(n * oracle_G * 64) * sizeof(double));
}

Test(mla, the_turn_is_the_oracles_least_squares) {
    for (int64_t G = 1; G <= 2; G++) {
        enum kv_rope_layout lay = G == 1 ? KV_ROPE_HALF : KV_ROPE_INTERLEAVED;
        struct kv_err e;
        struct kv_stats *s;
        int32_t ids[48], two[96];
        struct kv_model *m = random_case_layout(G, lay, 3, &s, ids);
        uint64_t st = 99;
        for (int i = 0; i < 96; i++) two[i] = i % 48 == 0 ? 1 : (int32_t)(rng_next(&st) % 300);
        struct kv_mla_opts o = {64, 16, 1, 1, 0, two, 2, 48};
        double turn[2 * 2 * 32 * 2], want[2 * 2 * 32 * 5] = {0};
        cr_assert_eq(kv_mla_fit_turn(m, s, &o, turn, NULL, &e), KV_OK, "%s", e.msg);
        oracle_G = G;
        naive_qk_pre = keep_qk;
        for (int w = 0; w < 2; w++) {
            free(naive_forward(m, two + 48 * w, 48));
            for (int64_t l = 0; l < 2; l++)
                for (int64_t h = 0; h < 4; h++)
                    for (int64_t t = 0; t < 48; t++) {
                        int64_t g = h / (4 / G);
                        const double *q = oracle_q[l] + (t * 4 + h) * 64;
                        /* the softmax of the roped scores, from scratch */
                        double sc[48], mx = -INFINITY, z = 0;
                        for (int64_t u = 0; u <= t; u++) {
                            const double *k = oracle_k[l] + (u * G + g) * 64;
                            double dot = 0;
                            for (int64_t f = 0; f < 32; f++) {
                                int64_t a = lay == KV_ROPE_HALF ? f : 2 * f, b = lay == KV_ROPE_HALF ? f + 32 : 2 * f + 1;
                                double ang = pow(10000.0, -2.0 * (double)f / 64.0) * (double)(t - u);
                                dot += cos(ang) * (q[a] * k[a] + q[b] * k[b]) + sin(ang) * (q[a] * k[b] - q[b] * k[a]);
                            }
                            sc[u] = dot / 8.0;
                            mx = sc[u] > mx ? sc[u] : mx;
                        }
                        for (int64_t u = 0; u <= t; u++) z += sc[u] = exp(sc[u] - mx);
                        for (int64_t f = 8; f < 32; f++) { /* the pairs that lose RoPE */
                            int64_t a = lay == KV_ROPE_HALF ? f : 2 * f, b = lay == KV_ROPE_HALF ? f + 32 : 2 * f + 1;
                            double om = pow(10000.0, -2.0 * (double)f / 64.0), m1[3] = {0}, m2[5] = {0};
                            for (int64_t u = 0; u <= t; u++) {
                                const double *k = oracle_k[l] + (u * G + g) * 64;
                                double p = sc[u] / z, A = q[a] * k[a] + q[b] * k[b], B = q[a] * k[b] - q[b] * k[a];
                                double y = cos(om * (double)(t - u)) * A + sin(om * (double)(t - u)) * B;
                                m1[0] += p * A, m1[1] += p * B, m1[2] += p * y;
                                m2[0] += p * A * A, m2[1] += p * A * B, m2[2] += p * B * B;
                                m2[3] += p * y * A, m2[4] += p * y * B;
                            }
                            double *wv = want + ((l * G + g) * 32 + f) * 5;
                            wv[0] += m2[0] - m1[0] * m1[0], wv[1] += m2[1] - m1[0] * m1[1];
                            wv[2] += m2[2] - m1[1] * m1[1], wv[3] += m2[3] - m1[2] * m1[0];
                            wv[4] += m2[4] - m1[2] * m1[1];
                        }
                    }
        }
        naive_qk_pre = NULL;
        double worst = 0;
        int64_t at = 0;
        for (int64_t i = 0; i < 2 * G * 32; i++) {
            if (i % 32 < 8) continue; /* kept pairs: below */
            const double *S = want + i * 5;
            double det = S[0] * S[2] - S[1] * S[1];
            double wc = (S[3] * S[2] - S[4] * S[1]) / det, ws = (S[4] * S[0] - S[3] * S[1]) / det;
            const double *gt = turn + i * 2;
            double err = fmax(fabs(gt[0] - wc), fabs(gt[1] - ws)) / (1e-4 + 1e-4 * fmax(fabs(wc), fabs(ws)));
            if (err > worst) worst = err, at = i;
        }
        cr_log_info("%lld kv heads: worst |turn - oracle| / (1e-4 + 1e-4 |oracle|) %.3g at layer %lld "
                    "head %lld pair %lld", (long long)G, worst, (long long)(at / (32 * G)),
                    (long long)(at / 32 % G), (long long)(at % 32));
        cr_assert_leq(worst, 1.0, "%lld kv heads, layer %lld head %lld pair %lld: (%.9g, %.9g)",
                      (long long)G, (long long)(at / (32 * G)), (long long)(at / 32 % G),
                      (long long)(at % 32), turn[at * 2], turn[at * 2 + 1]);
        for (int64_t l = 0; G == 1 && l < 2; l++) /* one kv head keeps pairs 0..7 whole */
            for (int64_t f = 0; f < 8; f++)
                cr_assert(turn[(l * 32 + f) * 2] == 1 && turn[(l * 32 + f) * 2 + 1] == 0,
                          "layer %lld pair %lld: (%g, %g)", (long long)l, (long long)f,
                          turn[(l * 32 + f) * 2], turn[(l * 32 + f) * 2 + 1]);
        for (int l = 0; l < 2; l++) free(oracle_q[l]), free(oracle_k[l]), oracle_q[l] = oracle_k[l] = NULL;
        kv_stats_free(s);
        kv_model_close(m);
    }
}

/* The fitted turn: nothing to turn with one KV head at full rank (the file
 * is the same bit for bit); with two it brings the MLA form closer to the
 * model, on the calibration window and on another (KL of the float64
 * oracles, base against MLA). */
Test(mla, the_turn_brings_the_model_closer) {
    for (int G = 1; G <= 2; G++) {
        struct kv_err e;
        struct kv_stats *s;
        int32_t ids[48], other[48];
        struct kv_model *m = random_case(G, 7, &s, ids);
        uint64_t st = 1234;
        for (int i = 0; i < 48; i++) other[i] = i == 0 ? 1 : (int32_t)(rng_next(&st) % 300);
        struct kv_mla_opts plain = {2 * G * 64, 64, 1, 1, 0, NULL, 0, 0}, fold = plain;
        fold.calib_tokens = ids, fold.calib_windows = 1, fold.seq_len = 48;
        struct kv_mla *a, *b;
        cr_assert_eq(kv_mla_convert(m, s, &plain, &a, NULL, &e), KV_OK, "%s", e.msg);
        cr_assert_eq(kv_mla_convert(m, s, &fold, &b, NULL, &e), KV_OK, "%s", e.msg);
        if (G == 1) {
            for (int64_t l = 0; l < 2; l++)
                cr_assert(!memcmp(a->layers[l].wk_b, b->layers[l].wk_b, (size_t)(4 * 128 * 64) * 4) &&
                              !memcmp(a->layers[l].wkv_a, b->layers[l].wkv_a, (size_t)((128 + 64) * 128) * 4),
                          "one kv head: nothing loses RoPE, yet layer %lld changed", (long long)l);
        } else {
            const int32_t *wins[2] = {ids, other};
            for (int k = 0; k < 2; k++) {
                double *base = naive_forward(m, wins[k], 48), *pa = naive_mla_forward(m, a, wins[k], 48),
                       *pb = naive_mla_forward(m, b, wins[k], 48);
                kvt_log_softmax_rows(base, 48, 300), kvt_log_softmax_rows(pa, 48, 300);
                kvt_log_softmax_rows(pb, 48, 300);
                double kla = 0, klb = 0;
                for (int64_t i = 0; i < 48 * 300; i++) {
                    kla += exp(base[i]) * (base[i] - pa[i]);
                    klb += exp(base[i]) * (base[i] - pb[i]);
                }
                cr_log_info("window %d: KL %.5f unrotated, %.5f turned", k, kla / 48, klb / 48);
                cr_assert_lt(klb, 0.9 * kla, "window %d: KL %.5f turned against %.5f unrotated", k,
                             klb / 48, kla / 48);
                free(base), free(pa), free(pb);
            }
        }
        kv_mla_free(a), kv_mla_free(b);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

/* kvcal's own MLA forward (kv_fwd_set_mla: the absorbed query, a cache of
 * the normed latent and the roped key) against the float64 oracle of the
 * MLA form, two KV heads, d_c 48, R 16 over pairs 0, 2, ..., 14: float32
 * rounding. */
Test(mla, kvcals_mla_forward_is_the_oracle) {
    struct kv_err e;
    struct kv_stats *s;
    int32_t ids[48];
    struct kv_model *m = random_case(2, 8, &s, ids);
    struct kv_mla_opts o = {48, 16, 2, 1, 0, NULL, 0, 0};
    struct kv_mla *mla;
    cr_assert_eq(kv_mla_convert(m, s, &o, &mla, NULL, &e), KV_OK, "%s", e.msg);
    double *want = naive_mla_forward(m, mla, ids, 48);
    kvt_log_softmax_rows(want, 48, 300);
    /* whole window, then the same positions a few at a time from the cache */
    for (int split = 0; split < 2; split++) {
        struct kv_fwd *f;
        cr_assert_eq(kv_fwd_init(m, 48, &f, &e), KV_OK, "%s", e.msg);
        cr_assert_eq(kv_fwd_set_mla(f, mla, &e), KV_OK, "%s", e.msg);
        float *lg = malloc(48 * 300 * sizeof *lg);
        for (int64_t p0 = 0; p0 < 48; p0 += split ? 7 : 48) {
            int64_t nn = split ? (48 - p0 < 7 ? 48 - p0 : 7) : 48;
            cr_assert_eq(kv_fwd_run(f, ids + p0, nn, p0, lg + p0 * 300, &e), KV_OK, "%s", e.msg);
        }
        double *got = malloc(48 * 300 * sizeof *got), worst = 0;
        for (int64_t i = 0; i < 48 * 300; i++) got[i] = lg[i];
        kvt_log_softmax_rows(got, 48, 300);
        int64_t at = 0;
        for (int64_t i = 0; i < 48 * 300; i++)
            if (fabs(got[i] - want[i]) > worst) worst = fabs(got[i] - want[i]), at = i;
        cr_log_info("kvcal's MLA forward (%s): max |dlogp| %.2e against the oracle at position %lld",
                    split ? "7 positions a run" : "one run", worst, (long long)(at / 300));
        cr_assert_leq(worst, 1e-4, "max |dlogp| %.3g at position %lld", worst, (long long)(at / 300));
        free(lg), free(got);
        kv_fwd_free(f);
    }
    free(want);
    kv_mla_free(mla);
    kv_stats_free(s);
    kv_model_close(m);
}

/* kvcal verify --mla: base against the MLA form read back from the file,
 * with its cache bytes; the files it refuses (another architecture,
 * another model, cut short, a key that disagrees with the tensors, a NaN),
 * each in one line naming the file, and the options. */
Test(mla, verify_runs_the_export_and_refuses_other_files, .timeout = 300) {
    KVT_NEED_KJV();
    char *dir = kvt_temp_dir(), *st = kvt_path(dir, "s.kvstats"), *g = kvt_path(dir, "m.gguf");
    char *plain = kvt_path(dir, "plain.gguf"), *other = kvt_path(dir, "other.gguf"), args[4096], *o, *e;
    snprintf(args, sizeof args, "collect -m data/kjv-llama -t data/kjv/train.txt --samples 8 "
                                "--seq-len 64 --threads 1 -q -o '%s'", st);
    cr_assert_eq(kvt_run_cli(args, NULL, &e), 0, "%s", e);
    free(e);
    snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 -o '%s'", st, g);
    cr_assert_eq(kvt_run_cli(args, NULL, &e), 0, "%s", e);
    free(e);
    snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' "
                                "--max-windows 3 --json -q", g);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "\"method\": \"mla\"") && strstr(o, "\"compressed\": 1024") &&
              strstr(o, "\"base\": 2048") && strstr(o, "\"windows\": 3"), "%s", o);
    json_t *jg = json_loads(o, 0, NULL);
    free(o), free(e);
    /* the same export as an HF directory runs to the same numbers */
    char *hf = kvt_path(dir, "hf");
    snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 -o '%s'", st, hf);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "(hf DeepseekV2ForCausalLM: kv_lora_rank 64, rope dims 64,") &&
              strstr(o, "\ntokenizer tokenizer.json copied\n") &&
              strstr(o, "note      the latent norm is made for epsilon 1e-05 (config.json's "
                        "rms_norm_eps: vLLM, SGLang, llama.cpp's converter)"), "%s", o);
    free(o), free(e);
    snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' "
                                "--max-windows 3 --json -q", hf);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    json_t *jh = json_loads(o, 0, NULL);
    cr_assert(jg && jh, "%s", o);
    static const char *const same[] = {"nll", "base_nll", "kl", "top1", "scored"};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
        cr_assert(json_equal(json_object_get(jg, same[i]), json_object_get(jh, same[i])),
                  "%s: gguf %g, hf directory %g", same[i], json_number_value(json_object_get(jg, same[i])),
                  json_number_value(json_object_get(jh, same[i])));
    json_decref(jg), json_decref(jh);
    free(o), free(e);
    /* nothing is overwritten: not the model itself, not a directory in use */
    static const struct {
        const char *out, *err;
    } over[] = {
        {"data/kjv-llama", "kvcal: data/kjv-llama: is the source model itself; refusing to overwrite it\n"},
        {NULL, "directory exists and is not empty; refusing to replace it\n"},
    };
    for (size_t i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 -o '%s'", st,
                 over[i].out ? over[i].out : hf);
        int rc = kvt_run_cli(args, &o, &e);
        cr_assert_eq(rc, 1, "%s: exit %d\n%s", args, rc, e);
        cr_assert(strstr(e, over[i].err) && !strchr(e, '\n')[1], "%s:\n%s", args, e);
        free(o), free(e);
    }
    /* made for transformers' epsilon: the engines that read the config are told off */
    char *hf6 = kvt_path(dir, "hf6");
    snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 --latent-norm-eps 1e-6 "
                                "-o '%s'", st, hf6);
    cr_assert_eq(kvt_run_cli(args, &o, &e), 0, "%s", e);
    cr_assert(strstr(o, "note      the latent norm is made for epsilon 1e-06 (transformers' "
                        "kv_a_layernorm); vLLM, SGLang and llama.cpp's converter normalize it with "
                        "config.json's rms_norm_eps 1e-05 and will not compute this model\n"), "%s", o);
    free(o), free(e), free(hf6);
    /* a GGUF has one epsilon; an impossible one is a usage error */
    static const struct {
        const char *extra, *err;
    } eps_bad[] = {
        {"--latent-norm-eps 1e-6 -o x.gguf",
         "kvcal export: --latent-norm-eps is for an HF directory: llama.cpp's deepseek2 normalizes "
         "the latent with the model's rms_norm_eps\n"},
        {"--latent-norm-eps 2 -o xdir", "kvcal export: --latent-norm-eps must be in (0, 1), got 2\n"},
        {"--latent-norm-eps 0 -o xdir", "kvcal export: --latent-norm-eps must be in (0, 1), got 0\n"},
    };
    for (size_t i = 0; i < sizeof eps_bad / sizeof eps_bad[0]; i++) {
        snprintf(args, sizeof args, "export --mla -m data/kjv-llama -s '%s' --ratio 0.5 %s", st,
                 eps_bad[i].extra);
        int rc = kvt_run_cli(args, &o, &e);
        cr_assert_eq(rc, 2, "%s: exit %d\n%s", eps_bad[i].extra, rc, e);
        cr_assert(!strncmp(e, eps_bad[i].err, strlen(eps_bad[i].err)), "got:\n%s", e);
        free(o), free(e);
    }
    /* damaged directories: another model_type, no latent epsilon, a kv_b_proj of another shape */
    char *cfg_path = kvt_path(hf, "config.json"), *w_path = kvt_path(hf, "model.safetensors");
    size_t clen = 0, wlen = 0;
    char *cfg_text = kvt_read_file(cfg_path, &clen), *w_bytes = kvt_read_file(w_path, &wlen);
    cr_assert(cfg_text && w_bytes);
    static const struct {
        const char *file, *from, *to, *err;
    } hbad[] = {
        {"config.json", "\"deepseek_v2\"", "\"deepseek_v3\"",
         "config.json: model_type is 'deepseek_v3', not 'deepseek_v2' (kvcal export --mla writes it)\n"},
        {"config.json", "\"v_head_dim\": 64", "\"v_head_dim\": 32",
         "config.json: 4 layers (4 dense), 4 heads (4 kv), values of 32, rope dims 64, epsilon 1e-05 "
         "do not fit the model (4 layers, 4 heads of 64, epsilon 1e-05)\n"},
        {"model.safetensors", "kvcal.mla.latent_norm_eps", "kvcal.mla.latent_norm_xxx",
         "model.safetensors: metadata kvcal.mla.latent_norm_eps is missing, expected a number in (0, 1)\n"},
        {"model.safetensors", "\"model.layers.2.self_attn.kv_b_proj.weight\"",
         "\"model.layers.2.self_attn.kv_b_proj.weighT\"",
         "model.safetensors: tensor 'model.layers.2.self_attn.kv_b_proj.weight' is missing\n"},
    };
    for (size_t i = 0; i < sizeof hbad / sizeof hbad[0]; i++) {
        int is_cfg = !strcmp(hbad[i].file, "config.json");
        char *copy = malloc(is_cfg ? clen : wlen), *path = is_cfg ? cfg_path : w_path;
        memcpy(copy, is_cfg ? cfg_text : w_bytes, is_cfg ? clen : wlen);
        char *at = memmem(copy, is_cfg ? clen : wlen, hbad[i].from, strlen(hbad[i].from));
        cr_assert(at && strlen(hbad[i].from) == strlen(hbad[i].to), "%s", hbad[i].from);
        memcpy(at, hbad[i].to, strlen(hbad[i].to));
        FILE *fp = fopen(path, "wb");
        cr_assert(fp && fwrite(copy, 1, is_cfg ? clen : wlen, fp) == (is_cfg ? clen : wlen) && fclose(fp) == 0);
        snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' -q", hf);
        int rc = kvt_run_cli(args, &o, &e);
        char want[1200];
        snprintf(want, sizeof want, "kvcal: %s/%s", hf, hbad[i].err);
        cr_assert_eq(rc, 1, "%s: exit %d\n%s", hbad[i].to, rc, e);
        cr_assert_str_eq(e, want, "%s", hbad[i].to);
        free(o), free(e);
        /* put the file back */
        fp = fopen(path, "wb");
        cr_assert(fp && fwrite(is_cfg ? cfg_text : w_bytes, 1, is_cfg ? clen : wlen, fp) == (is_cfg ? clen : wlen) &&
                  fclose(fp) == 0);
        free(copy);
    }
    /* weights cut short, and a NaN in the latent norm's gain: the file and
     * the offset named */
    struct kv_st_file *stf;
    struct kv_err serr;
    cr_assert_eq(kv_st_open(w_path, &stf, &serr), KV_OK, "%s", serr.msg);
    const struct kv_tensor *gain = kv_st_find(stf, "model.layers.0.self_attn.kv_a_layernorm.weight");
    cr_assert(gain);
    uint64_t nan_off = gain->offset;
    kv_st_close(stf);
    for (int i = 0; i < 2; i++) {
        char *copy = malloc(wlen);
        memcpy(copy, w_bytes, wlen);
        float nanv = NAN;
        size_t n = i == 0 ? wlen / 2 : wlen;
        if (i == 1) memcpy(copy + nan_off, &nanv, 4);
        FILE *fp = fopen(w_path, "wb");
        cr_assert(fp && fwrite(copy, 1, n, fp) == n && fclose(fp) == 0);
        snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' -q", hf);
        int rc = kvt_run_cli(args, &o, &e);
        char want[1200];
        snprintf(want, sizeof want, "kvcal: %s: offset ", w_path);
        cr_assert_eq(rc, 1, "case %d: exit %d\n%s", i, rc, e);
        cr_assert(!strncmp(e, want, strlen(want)) && !strchr(e, '\n')[1], "case %d:\n%s", i, e);
        if (i == 1)
            cr_assert(strstr(e, "tensor 'model.layers.0.self_attn.kv_a_layernorm.weight' holds nan at "
                                "element 0\n"), "%s", e);
        free(o), free(e), free(copy);
    }
    free(cfg_text), free(w_bytes), free(cfg_path), free(w_path), free(hf);
    /* a plain llama file, and an export of another model (same shapes) */
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_open("data/kjv-llama", NULL, &m, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_gguf_write_model(m, plain, NULL, &err), KV_OK, "%s", err.msg);
    struct kv_config c = *kv_model_config(m);
    kv_model_close(m);
    cr_assert_eq(kv_model_init_random(&c, 1, &m, &err), KV_OK, "%s", err.msg);
    struct kv_stats *s;
    cr_assert_eq(kv_stats_open(st, &s, &err), KV_OK, "%s", err.msg);
    struct kv_mla_opts mo = {128 - 64, 64, 1, 1, 0, NULL, 0, 0};
    cr_assert_eq(kv_mla_export_gguf(m, s, &mo, other, NULL, &err), KV_OK, "%s", err.msg);
    kv_stats_free(s);
    kv_model_close(m);
    struct {
        const char *file;
        int code;
        const char *err;
    } bad[] = {
        {plain, 1, "kvcal: %s: general.architecture is 'llama', not 'deepseek2' (kvcal export --mla writes it)\n"},
        {other, 1, "kvcal: %s: made from another model (fingerprint "},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' -q",
                 bad[i].file);
        int rc = kvt_run_cli(args, &o, &e);
        cr_assert_eq(rc, bad[i].code, "%s: exit %d\n%s", bad[i].file, rc, e);
        char want[2048];
        snprintf(want, sizeof want, bad[i].err, bad[i].file);
        cr_assert(!strncmp(e, want, strlen(want)), "got:\n%swant:\n%s", e, want);
        free(o), free(e);
    }
    /* damaged copies of the export: cut in half, kv_lora_rank changed, a
     * NaN in the latent's norm gain */
    size_t len = 0;
    char *bytes = kvt_read_file(g, &len);
    cr_assert(bytes);
    struct kv_gguf_file *gf;
    cr_assert_eq(kv_gguf_open(g, &gf, &err), KV_OK, "%s", err.msg);
    const struct kv_gguf_tensor *nt = kv_gguf_find_tensor(gf, "blk.0.attn_kv_a_norm.weight");
    cr_assert(nt);
    uint64_t nan_at = nt->t.offset;
    kv_gguf_close(gf);
    const char *key = "deepseek2.attention.kv_lora_rank";
    char *kat = memmem(bytes, len, key, strlen(key));
    cr_assert(kat);
    size_t rank_at = (size_t)(kat - bytes) + strlen(key) + 4; /* after the u32 type */
    static const struct {
        const char *name, *err;
    } dmg[] = {
        {"cut.gguf", "but the data section holds"},
        {"rank.gguf", "tensor 'blk.0.attn_kv_a_mqa.weight' has 32768 elements in 2 dims, expected "
                      "[1, 129, 256] for this model\n"},
        {"nan.gguf", "tensor 'blk.0.attn_kv_a_norm.weight' holds nan at element 0\n"},
    };
    for (size_t i = 0; i < sizeof dmg / sizeof dmg[0]; i++) {
        char *copy = malloc(len), *path = kvt_path(dir, dmg[i].name);
        memcpy(copy, bytes, len);
        size_t n = len;
        uint32_t rank = 65;
        float nanv = NAN;
        if (i == 0) n = len / 2;
        if (i == 1) memcpy(copy + rank_at, &rank, 4);
        if (i == 2) memcpy(copy + nan_at, &nanv, 4);
        FILE *fp = fopen(path, "wb");
        cr_assert(fp && fwrite(copy, 1, n, fp) == n && fclose(fp) == 0);
        snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' -q", path);
        int rc = kvt_run_cli(args, &o, &e);
        char want[1200];
        snprintf(want, sizeof want, "kvcal: %s: offset ", path);
        cr_assert_eq(rc, 1, "%s: exit %d\n%s", dmg[i].name, rc, e);
        cr_assert(!strncmp(e, want, strlen(want)) && strstr(e, dmg[i].err) && !strchr(e, '\n')[1],
                  "%s: one line naming the file and offset and '%s', got:\n%s", dmg[i].name,
                  dmg[i].err, e);
        free(o), free(e), free(copy), free(path);
    }
    free(bytes);
    static const struct {
        const char *extra, *err;
    } usage[] = {
        {"--compressed x", "kvcal verify: give one of --compressed DIR or --mla PATH\n"},
        {"--device twin", "kvcal verify: --mla runs on the cpu; the runtime has no latent attention of this form\n"},
    };
    for (size_t i = 0; i < sizeof usage / sizeof usage[0]; i++) {
        snprintf(args, sizeof args, "verify -m data/kjv-llama -t data/kjv/gospels.txt --mla '%s' %s",
                 g, usage[i].extra);
        int rc = kvt_run_cli(args, &o, &e);
        cr_assert_eq(rc, 2, "%s: exit %d\n%s", usage[i].extra, rc, e);
        cr_assert(!strncmp(e, usage[i].err, strlen(usage[i].err)), "got:\n%s", e);
        free(o), free(e);
    }
    free(st), free(g), free(plain), free(other);
    kvt_rm_dir(dir);
}
