/* config.json parsing (formats/hfdir.c, formats/ropejson.c): the real
 * configs of tests/configs, both layouts of transformers (4.x top-level
 * rope_theta/rope_scaling, 5.x rope_parameters), every rope scaling, and
 * the refusals that keep a key spelled another way from being ignored. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hfdir.h"
#include "model.h"
#include "testutil.h"

static struct kv_config read_ok(const char *path) {
    struct kv_config c;
    struct kv_err err;
    int rc = kv_hf_read_config(path, &c, &err);
    cr_assert_eq(rc, KV_OK, "%s: %s", path, err.msg);
    return c;
}

/* A llama config with extra keys spliced in (text after "vocab_size": 32). */
static char *llama_with(const char *dir, const char *extra) {
    char text[8192];
    snprintf(text, sizeof text,
             "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 96,"
             " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
             " \"max_position_embeddings\": 131072, \"vocab_size\": 32%s%s}",
             extra[0] ? ", " : "", extra);
    return kvt_write_text(dir, "config.json", text);
}

static void read_fails(const char *dir, const char *extra, int code, const char *want) {
    char *p = llama_with(dir, extra);
    struct kv_config c;
    struct kv_err err;
    cr_assert_eq(kv_hf_read_config(p, &c, &err), code, "accepted %s", extra);
    cr_assert_str_eq(err.msg, want, "for %s: got \"%s\"", extra, err.msg);
    free(p);
}

static struct kv_config read_with(const char *dir, const char *extra) {
    char *p = llama_with(dir, extra);
    struct kv_config c = read_ok(p);
    free(p);
    return c;
}

Test(hf_config, smollm2_reads_the_same_in_both_layouts) {
    struct kv_config a = read_ok("tests/configs/SmolLM2-135M-transformers4.json");
    struct kv_config b = read_ok("tests/configs/SmolLM2-135M-transformers5.json");
    cr_assert_float_eq(a.rope_theta, 100000.0f, 0);
    cr_assert_float_eq(b.rope_theta, 100000.0f, 0, "the 5.x layout's rope_parameters.rope_theta "
                                                   "was not read (found %g)", (double)b.rope_theta);
    cr_assert_eq(b.rope_scaling.type, KV_ROPE_SCALING_NONE);
    cr_assert_eq(memcmp(&a, &b, sizeof a), 0, "the two layouts gave different configs");
    cr_assert_eq(a.head_dim, 64);
    cr_assert_eq(a.n_kv_heads, 3);
}

Test(hf_config, llama_3_configs_carry_their_llama3_scaling) {
    struct {
        const char *file;
        double factor;
        int64_t dim, head_dim;
        int tied;
    } rows[] = {{"tests/configs/Llama-3.2-1B.json", 32, 2048, 64, 1},
                {"tests/configs/Llama-3.1-8B.json", 8, 4096, 128, 0}};
    for (size_t i = 0; i < 2; i++) {
        struct kv_config c = read_ok(rows[i].file);
        const struct kv_rope_scaling_cfg *s = &c.rope_scaling;
        cr_assert_eq(s->type, KV_ROPE_SCALING_LLAMA3, "%s", rows[i].file);
        cr_assert_eq(s->factor, rows[i].factor);
        cr_assert_eq(s->low_freq_factor, 1.0);
        cr_assert_eq(s->high_freq_factor, 4.0);
        cr_assert_eq(s->original_ctx, 8192);
        cr_assert_float_eq(c.rope_theta, 500000.0f, 0);
        cr_assert_eq(c.dim, rows[i].dim);
        cr_assert_eq(c.head_dim, rows[i].head_dim);
        cr_assert_eq(c.n_kv_heads, 8);
        cr_assert_eq(c.tied_embeddings, rows[i].tied);
        cr_assert_eq(c.max_seq_len, 131072);
        struct kv_err err;
        cr_assert_eq(kv_rope_check(&c, rows[i].file, &err), KV_OK, "%s", err.msg);
    }
}

Test(hf_config, rope_parameters_equal_rope_scaling) {
    char *dir = kvt_temp_dir();
    struct {
        const char *v4, *v5;
    } rows[] = {
        {"\"rope_theta\": 500000.0, \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, "
         "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}",
         "\"rope_parameters\": {\"rope_theta\": 500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0, "
         "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}"},
        {"\"rope_theta\": 1000000, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, "
         "\"original_max_position_embeddings\": 32768}",
         "\"rope_parameters\": {\"rope_theta\": 1000000, \"rope_type\": \"yarn\", \"factor\": 4.0, "
         "\"original_max_position_embeddings\": 32768}"},
        {"\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}",
         "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2}"},
        {"\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2}",
         "\"rope_parameters\": {\"rope_type\": \"dynamic\", \"factor\": 2}"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_config a = read_with(dir, rows[i].v4), b = read_with(dir, rows[i].v5);
        cr_assert_neq(a.rope_scaling.type, KV_ROPE_SCALING_NONE, "row %zu", i);
        cr_assert_eq(memcmp(&a, &b, sizeof a), 0, "row %zu: the layouts differ", i);
        /* both at once, agreeing, is accepted too */
        char both[2048];
        snprintf(both, sizeof both, "%s, %s", rows[i].v4, rows[i].v5);
        struct kv_config c = read_with(dir, both);
        cr_assert_eq(memcmp(&a, &c, sizeof a), 0, "row %zu: both layouts at once", i);
    }
    /* yarn's attention factor: 0.1 ln 4 + 1; dynamic's context: max_position_embeddings */
    struct kv_config y = read_with(dir, rows[1].v4), d = read_with(dir, rows[3].v4);
    cr_assert_float_eq(y.rope_scaling.attention_factor, 0.1 * log(4.0) + 1, 1e-15);
    cr_assert_eq(d.rope_scaling.original_ctx, 131072);
    kvt_rm_dir(dir);
}

Test(hf_config, yarn_mscale_and_defaults) {
    char *dir = kvt_temp_dir();
    /* DeepSeek-style mscale / mscale_all_dim */
    struct kv_config c = read_with(dir, "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 40, "
                                        "\"original_max_position_embeddings\": 4096, "
                                        "\"mscale\": 0.707, \"mscale_all_dim\": 0.707, "
                                        "\"beta_fast\": 16}");
    cr_assert_float_eq(c.rope_scaling.attention_factor, 1.0, 1e-15);
    cr_assert_eq(c.rope_scaling.beta_fast, 16);
    cr_assert_eq(c.rope_scaling.beta_slow, 1);
    cr_assert_eq(c.rope_scaling.original_ctx, 4096);
    struct kv_config d = read_with(dir, "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 40, "
                                        "\"mscale\": 1, \"mscale_all_dim\": 0.5}");
    double want = (0.1 * log(40.0) + 1) / (0.05 * log(40.0) + 1);
    cr_assert_float_eq(d.rope_scaling.attention_factor, want, 1e-15);
    cr_assert_eq(d.rope_scaling.original_ctx, 131072, "without one, the original context is "
                                                      "max_position_embeddings");
    cr_assert_eq(d.rope_scaling.truncate, 1);
    kvt_rm_dir(dir);
}

Test(hf_config, phi3_longrope_with_a_top_level_original_context) {
    char *dir = kvt_temp_dir();
    char extra[4096], sf[1024] = "", lf[1024] = "";
    for (int i = 0; i < 8; i++) {
        char b[32];
        snprintf(b, sizeof b, "%s%.2f", i ? ", " : "", 1.0 + 0.1 * i);
        strcat(sf, b);
        snprintf(b, sizeof b, "%s%.2f", i ? ", " : "", 2.0 + i);
        strcat(lf, b);
    }
    snprintf(extra, sizeof extra,
             "\"original_max_position_embeddings\": 4096, \"rope_scaling\": {\"type\": \"su\", "
             "\"short_factor\": [%s], \"long_factor\": [%s]}",
             sf, lf);
    struct kv_config c = read_with(dir, extra);
    const struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    cr_assert_eq(s->type, KV_ROPE_SCALING_LONGROPE);
    cr_assert_eq(s->original_ctx, 4096);
    cr_assert_eq(s->factor, 32.0, "factor %g, expected 131072 / 4096", s->factor);
    /* a factor given is used as given */
    char *with = strstr(extra, "\"type\": \"su\"");
    const char *ins = "\"factor\": 16.0, ";
    memmove(with + strlen(ins), with, strlen(with) + 1);
    memcpy(with, ins, strlen(ins));
    cr_assert_eq(read_with(dir, extra).rope_scaling.factor, 16.0, "%s", extra);
    cr_assert_eq(s->n_factors, 8);
    cr_assert_float_eq(s->short_factor[3], 1.3f, 0);
    cr_assert_float_eq(s->long_factor[7], 9.0f, 0);
    struct kv_err err;
    cr_assert_eq(kv_rope_check(&c, "c", &err), KV_OK, "%s", err.msg);
    kvt_rm_dir(dir);
}

Test(hf_config, refuses_what_it_would_otherwise_get_wrong) {
    char *dir = kvt_temp_dir();
    read_fails(dir, "\"rope_theta\": 10000, \"rope_parameters\": {\"rope_theta\": 100000}", KV_EFORMAT,
               "rope_theta 10000 and rope_parameters.rope_theta 100000 disagree");
    read_fails(dir,
               "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}, "
               "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 4}",
               KV_EFORMAT, "rope_scaling ('linear') and rope_parameters ('linear') disagree");
    read_fails(dir,
               "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}, "
               "\"rope_parameters\": {\"rope_type\": \"default\"}",
               KV_EFORMAT, "rope_scaling ('linear') and rope_parameters ('default') disagree");
    read_fails(dir, "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2, \"low_freq_factor\": 1}",
               KV_EUNSUPPORTED,
               "rope_scaling: key 'low_freq_factor' of rope type 'linear' is not supported");
    read_fails(dir, "\"rope_parameters\": {\"rope_type\": \"default\", \"partial_rotary_factor\": 0.5}",
               KV_EUNSUPPORTED,
               "rope_parameters.partial_rotary_factor 0.5 is not supported for model_type 'llama': "
               "kvcal turns whole heads there (of these families only gpt_neox turns part of each)");
    read_fails(dir, "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8}", KV_EFORMAT,
               "rope_scaling: missing key 'low_freq_factor'");
    read_fails(dir,
               "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
               "\"high_freq_factor\": 4}",
               KV_EFORMAT, "rope_scaling: rope type 'llama3' needs original_max_position_embeddings");
    read_fails(dir, "\"rope_scaling\": {\"factor\": 8}", KV_EFORMAT, "rope_scaling: missing key 'type'");
    read_fails(dir, "\"rope_scaling\": {\"type\": \"freqs\", \"short_factor\": [1]}", KV_EUNSUPPORTED,
               "rope_scaling: rope type 'freqs' is not supported, expected default, linear, "
               "dynamic, llama3, yarn or longrope");
    read_fails(dir, "\"rope_scaling\": {\"type\": \"linear\", \"factor\": -2}", KV_EFORMAT,
               "rope_scaling: key 'factor' must be a positive number, found -2");
    read_fails(dir,
               "\"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1, 2], "
               "\"long_factor\": [1]}",
               KV_EFORMAT, "rope_scaling: rope long_factor has 1 entries and short_factor 2");
    read_fails(dir, "\"rope_parameters\": [1]", KV_EFORMAT,
               "key 'rope_parameters' must be an object or null, found [1]");
    kvt_rm_dir(dir);
}

/* The real configs of tests/configs load as their family, and a random
 * model of their attention and FFN shapes (one or two layers, a vocabulary
 * cut to 2048 to bound memory) runs a forward pass with finite logits; the
 * smaller ones also against the float64 oracle. */
struct real_cfg {
    const char *file;
    enum kv_arch arch;
    int64_t dim, hidden, heads, kv_heads, head_dim, window;
    float theta;
    int oracle;
};

#include "naive_gemma2.h"
#include "naive_llama.h"
#include "naive_neox.h"

/* A model of cfg whose weights are uniform in ±0.04 (norms 1) from a fast
 * generator: kv_model_init_random's normals take seconds at 8B shapes. */
static struct kv_model *fast_random_model(const struct kv_config *c) {
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_create(c, KV_FORMAT_SYNTHETIC, "random", &m, &err), KV_OK, "%s", err.msg);
    uint64_t st = 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < KV_W_COUNT; k++) {
        int use = kv_wkind_use(c, (enum kv_wkind)k);
        if (use == KV_WUSE_NONE || (use == KV_WUSE_OPTIONAL && !c->has_qkv_bias)) continue;
        int64_t nl = k < KV_W_FIRST_LAYER ? 1 : c->n_layers;
        for (int64_t l = 0; l < nl; l++) {
            struct kv_tensor t = {0};
            t.dtype = KV_DTYPE_F32;
            t.ndim = kv_model_expected_shape(c, (enum kv_wkind)k, t.shape);
            int64_t n = t.shape[0] * (t.ndim == 2 ? t.shape[1] : 1);
            float *w = malloc((size_t)n * sizeof *w);
            cr_assert_not_null(w);
            int is_norm = t.ndim == 1 && (k == KV_W_ATTN_NORM || k == KV_W_FFN_NORM || k == KV_W_OUT_NORM ||
                                          k == KV_W_QNORM || k == KV_W_KNORM || k == KV_W_POST_ATTN_NORM ||
                                          k == KV_W_POST_FFN_NORM);
            for (int64_t i = 0; i < n; i++) {
                st ^= st << 13, st ^= st >> 7, st ^= st << 17;
                double u = (double)(st >> 11) / 9007199254740992.0;
                w[i] = (float)(is_norm ? 0.5 + u : u * 0.08 - 0.04);
            }
            t.data = w;
            t.nbytes = (uint64_t)n * 4;
            snprintf(t.name, sizeof t.name, "%s.%lld", kv_wkind_name((enum kv_wkind)k), (long long)l);
            cr_assert_eq(kv_model_on_close(m, free, w, &err), KV_OK);
            cr_assert_eq(kv_model_bind(m, (enum kv_wkind)k, l, &t, "random", &err), KV_OK, "%s", err.msg);
        }
    }
    cr_assert_eq(kv_model_finish(m, "random", &err), KV_OK, "%s", err.msg);
    return m;
}

static void run_real(const struct real_cfg *r) {
    struct kv_config c = read_ok(r->file);
    cr_assert_eq(c.arch, r->arch, "%s: arch %s", r->file, kv_arch_name(c.arch));
    cr_assert_eq(c.dim, r->dim, "%s", r->file);
    cr_assert_eq(c.hidden_dim, r->hidden, "%s", r->file);
    cr_assert_eq(c.n_heads, r->heads, "%s", r->file);
    cr_assert_eq(c.n_kv_heads, r->kv_heads, "%s", r->file);
    cr_assert_eq(c.head_dim, r->head_dim, "%s", r->file);
    cr_assert_eq(c.sliding_window, r->window, "%s: window %lld", r->file, (long long)c.sliding_window);
    cr_assert_float_eq(c.rope_theta, r->theta, 0, "%s: theta %g", r->file, (double)c.rope_theta);
    c.n_layers = r->oracle ? 2 : 1;
    c.vocab_size = 2048;
    c.bos_id = c.eos_id = -1;
    struct kv_model *m = fast_random_model(&c);
    struct kv_err err;
    int64_t n = 12;
    int32_t tok[12];
    for (int i = 0; i < n; i++) tok[i] = (i * 131 + 7) % 2048;
    struct kv_fwd *f;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s: %s", r->file, err.msg);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s: %s", r->file, err.msg);
    const float *lg = kv_fwd_logits(f);
    for (int64_t i = 0; i < n * 2048; i++) cr_assert(isfinite(lg[i]), "%s: logit %lld", r->file, (long long)i);
    if (r->oracle) {
        double *ref = c.arch == KV_ARCH_GPTNEOX ? naive_neox_forward(m, tok, n)
                      : c.arch == KV_ARCH_GEMMA2  ? naive_gemma2_forward(m, tok, n)
                                                  : naive_forward(m, tok, n);
        /* float32 sums of d or hidden products: an error relative to the
         * largest logit, as the family suites bound it */
        kvt_assert_close_oracle(lg, ref, n * 2048, 1e-5, 1e-4, r->file);
        free(ref);
    }
    kv_fwd_free(f);
    kv_model_close(m);
}

Test(hf_config, real_configs_load_and_run, .timeout = 120) {
    const struct real_cfg rows[] = {
        {"tests/configs/SmolLM2-135M-transformers5.json", KV_ARCH_LLAMA, 576, 1536, 9, 3, 64, 0, 100000.0f, 1},
        {"tests/configs/Llama-3.2-1B.json", KV_ARCH_LLAMA, 2048, 8192, 32, 8, 64, 0, 500000.0f, 0},
        {"tests/configs/Llama-3.1-8B.json", KV_ARCH_LLAMA, 4096, 14336, 32, 8, 128, 0, 500000.0f, 0},
        {"tests/configs/Qwen2.5-0.5B.json", KV_ARCH_QWEN2, 896, 4864, 14, 2, 64, 0, 1000000.0f, 1},
        {"tests/configs/Qwen2.5-7B.json", KV_ARCH_QWEN2, 3584, 18944, 28, 4, 128, 0, 1000000.0f, 0},
        {"tests/configs/Mistral-7B-Instruct-v0.3.json", KV_ARCH_MISTRAL, 4096, 14336, 32, 8, 128, 0,
         1000000.0f, 0},
        {"tests/configs/Phi-3-mini-4k-instruct.json", KV_ARCH_PHI3, 3072, 8192, 32, 32, 96, 2047,
         10000.0f, 0},
        {"tests/configs/Qwen3-0.6B.json", KV_ARCH_QWEN3, 1024, 3072, 16, 8, 128, 0, 1000000.0f, 1},
        {"tests/configs/Qwen3-8B.json", KV_ARCH_QWEN3, 4096, 12288, 32, 8, 128, 0, 1000000.0f, 0},
        {"tests/configs/Qwen3-8B-resaved-transformers-4.57.1.json", KV_ARCH_QWEN3, 4096, 12288, 32, 8,
         128, 0, 1000000.0f, 0},
        {"tests/configs/Phi-3-mini-128k-instruct.json", KV_ARCH_PHI3, 3072, 8192, 32, 32, 96,
         262144, 10000.0f, 0},
        {"tests/configs/pythia-160m.json", KV_ARCH_GPTNEOX, 768, 3072, 12, 12, 64, 0, 10000.0f, 1},
        {"tests/configs/gemma-2-2b.json", KV_ARCH_GEMMA2, 2304, 9216, 8, 4, 256, 4096, 10000.0f, 1},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) run_real(&rows[i]);
}

/* What each family's real config sets beyond the shapes: Phi-3-mini-128k's
 * "su" scaling (the April 2024 file) with 48 factor pairs for d_h 96 from a
 * 4096 context, Pythia's quarter rotary with the parallel residual and erf
 * GELU, Gemma 2's scale, soft-caps, (1 + w) norms and every second layer
 * windowed. */
Test(hf_config, real_family_keys) {
    struct kv_config p = read_ok("tests/configs/Phi-3-mini-128k-instruct.json");
    const struct kv_rope_scaling_cfg *s = &p.rope_scaling;
    cr_assert_eq(s->type, KV_ROPE_SCALING_LONGROPE);
    cr_assert_eq(s->n_factors, 48);
    cr_assert_eq(s->original_ctx, 4096);
    cr_assert_eq(s->factor, 32.0, "factor %g, expected 131072 / 4096", s->factor);
    cr_assert_float_eq(s->long_factor[0], 1.0299999713897705f, 0);
    cr_assert_float_eq(s->short_factor[0], 1.05f, 0);
    struct kv_err err;
    cr_assert_eq(kv_rope_check(&p, "phi3", &err), KV_OK, "%s", err.msg);

    struct kv_config n = read_ok("tests/configs/pythia-160m.json");
    cr_assert_eq(kv_rope_dim(&n), 16, "rope dims %lld", (long long)kv_rope_dim(&n));
    cr_assert_eq(n.parallel_residual, 1);
    cr_assert_eq(n.gelu_erf, 1);
    cr_assert_eq(n.tied_embeddings, 0);
    cr_assert_eq(n.vocab_size, 50304);

    struct kv_config g = read_ok("tests/configs/gemma-2-2b.json");
    cr_assert_float_eq(g.attn_scale, 1.0f / 16.0f, 0, "attn_scale %g", (double)g.attn_scale);
    cr_assert_float_eq(g.attn_softcap, 50.0f, 0);
    cr_assert_float_eq(g.final_softcap, 30.0f, 0);
    cr_assert_float_eq(g.norm_offset, 1.0f, 0);
    cr_assert_eq(g.window_from, 0);
    cr_assert_eq(g.window_period, 2);
    cr_assert_eq(g.tied_embeddings, 1);
}

Test(hf_config, window_keys_of_mistral_and_qwen2) {
    char *dir = kvt_temp_dir();
    struct {
        const char *type, *extra;
        int64_t win, from;
    } rows[] = {
        {"mistral", "", 4096, 0},
        {"mistral", ", \"sliding_window\": null", 0, 0},
        {"mistral", ", \"sliding_window\": 512", 512, 0},
        {"qwen2", ", \"sliding_window\": 4096", 0, 0},
        {"qwen2", ", \"use_sliding_window\": true, \"sliding_window\": 4096, \"max_window_layers\": 1",
         4096, 1},
        {"qwen2",
         ", \"use_sliding_window\": true, \"sliding_window\": 64, \"max_window_layers\": 1, "
         "\"layer_types\": [\"full_attention\", \"sliding_attention\"]",
         64, 1},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        char text[2048];
        snprintf(text, sizeof text,
                 "{\"model_type\": \"%s\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 32%s}",
                 rows[i].type, rows[i].extra);
        char *p = kvt_path(dir, "config.json");
        FILE *f = fopen(p, "w");
        fputs(text, f);
        fclose(f);
        struct kv_config c = read_ok(p);
        cr_assert_eq(c.sliding_window, rows[i].win, "row %zu: window %lld", i, (long long)c.sliding_window);
        cr_assert_eq(c.window_from, rows[i].from, "row %zu", i);
        if (rows[i].win) cr_assert_eq(kv_layer_window(&c, 1), rows[i].win, "row %zu", i);
        free(p);
    }
    read_fails(dir, "\"layer_types\": [\"full_attention\", \"sliding_attention\"]", KV_EFORMAT,
               "layer_types says layer 1 is sliding_attention, but the window keys make it "
               "full_attention");
    read_fails(dir, "\"layer_types\": [\"full_attention\"]", KV_EFORMAT,
               "key 'layer_types' must be a list of 2 strings");
    read_fails(dir, "\"layer_types\": [\"full_attention\", \"chunked_attention\"]", KV_EUNSUPPORTED,
               "layer_types entry 1 is not 'full_attention' or 'sliding_attention'");
    kvt_rm_dir(dir);
}
