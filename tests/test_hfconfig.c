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
    char *p = kvt_path(dir, "config.json");
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    return p;
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
               "rope_parameters: key 'partial_rotary_factor' of rope type 'default' is not supported");
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
