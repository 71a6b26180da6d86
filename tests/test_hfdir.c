/* HF directory loader, Llama: the real TinyStories-656K checkpoint, tiny
 * random checkpoints written here in F32/F16/BF16 (single file and sharded),
 * config.json's ids over the tokenizer's, and the refusals, pinned to their
 * exact messages. GPT-2 is test_hfgpt2.c's, tokenizer.json test_tokjson.c's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hf_fixture.h"
#include "hfdir.h"
#include "model.h"
#include "safetensors.h"
#include "stwrite.h"
#include "testutil.h"
#include "tokenizer.h"

/* ---------------------------------------------------------------- a tiny model */

/* d 16, FFN 24, 2 layers, 4 heads of 4, 2 KV heads, vocab 32. */
#define T_DIM 16
#define T_FFN 24
#define T_LAYERS 2
#define T_KVD 8
#define T_VOCAB 32

struct ref_tensor {
    char name[96];
    int nd;
    int64_t shape[2];
    int64_t n;
    float *v;
    enum kv_wkind kind;
    int64_t layer;
};

struct ref_model {
    struct ref_tensor t[64];
    int n;
};

/* Values k/128 with |k| <= 127: exact in F32, F16 and BF16, so every dtype
 * must load bit-identical floats. */
static void ref_add(struct ref_model *r, const char *name, int64_t a, int64_t b, enum kv_wkind kind,
                    int64_t layer, uint32_t *seed) {
    struct ref_tensor *t = &r->t[r->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->nd = b ? 2 : 1;
    t->shape[0] = a;
    t->shape[1] = b;
    t->n = b ? a * b : a;
    t->v = malloc((size_t)t->n * sizeof *t->v);
    for (int64_t i = 0; i < t->n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        int k = (int)((*seed >> 16) % 255) - 127;
        t->v[i] = (float)k / 128.0f;
    }
    t->kind = kind;
    t->layer = layer;
}

static void ref_build(struct ref_model *r, int tied, int bias) {
    memset(r, 0, sizeof *r);
    uint32_t seed = 12345;
    char name[96];
    ref_add(r, "model.embed_tokens.weight", T_VOCAB, T_DIM, KV_W_TOK_EMB, 0, &seed);
    if (!tied) ref_add(r, "lm_head.weight", T_VOCAB, T_DIM, KV_W_LM_HEAD, 0, &seed);
    ref_add(r, "model.norm.weight", T_DIM, 0, KV_W_OUT_NORM, 0, &seed);
    static const struct {
        const char *suffix;
        enum kv_wkind kind;
        int64_t a, b;
        int is_bias;
    } per_layer[] = {
        {"input_layernorm.weight", KV_W_ATTN_NORM, T_DIM, 0, 0},
        {"self_attn.q_proj.weight", KV_W_Q, T_DIM, T_DIM, 0},
        {"self_attn.k_proj.weight", KV_W_K, T_KVD, T_DIM, 0},
        {"self_attn.v_proj.weight", KV_W_V, T_KVD, T_DIM, 0},
        {"self_attn.o_proj.weight", KV_W_O, T_DIM, T_DIM, 0},
        {"self_attn.q_proj.bias", KV_W_BQ, T_DIM, 0, 1},
        {"self_attn.k_proj.bias", KV_W_BK, T_KVD, 0, 1},
        {"self_attn.v_proj.bias", KV_W_BV, T_KVD, 0, 1},
        {"post_attention_layernorm.weight", KV_W_FFN_NORM, T_DIM, 0, 0},
        {"mlp.gate_proj.weight", KV_W_GATE, T_FFN, T_DIM, 0},
        {"mlp.up_proj.weight", KV_W_UP, T_FFN, T_DIM, 0},
        {"mlp.down_proj.weight", KV_W_DOWN, T_DIM, T_FFN, 0},
    };
    for (int64_t l = 0; l < T_LAYERS; l++)
        for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++) {
            if (per_layer[i].is_bias && !bias) continue;
            snprintf(name, sizeof name, "model.layers.%lld.%s", (long long)l, per_layer[i].suffix);
            ref_add(r, name, per_layer[i].a, per_layer[i].b, per_layer[i].kind, l, &seed);
        }
}

static void ref_free(struct ref_model *r) {
    for (int i = 0; i < r->n; i++) free(r->t[i].v);
}

static uint16_t to_f16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) == 0) return (uint16_t)(b >> 16);
    cr_assert_eq(b & 0x1fffu, 0, "%g is not exact in f16", (double)f);
    uint32_t exp = ((b >> 23) & 0xff) - 127 + 15;
    cr_assert(exp > 0 && exp < 31);
    return (uint16_t)((b >> 31) << 15 | exp << 10 | (b & 0x7fffffu) >> 13);
}

static uint16_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    cr_assert_eq(b & 0xffffu, 0, "%g is not exact in bf16", (double)f);
    return (uint16_t)(b >> 16);
}

/* Write the tensors whose index i has pick[i] into dir/file as dtype. meta
 * is the __metadata__ object text or NULL. */
static void write_st(const char *dir, const char *file, const struct ref_model *r, const int *pick,
                     const char *dtype, const char *meta) {
    size_t es = strcmp(dtype, "F32") == 0 ? 4 : 2;
    size_t hcap = 16384, hl = 0, dl = 0;
    char *hdr = malloc(hcap);
    uint8_t *data = malloc(1 << 20);
    hl += (size_t)snprintf(hdr + hl, hcap - hl, "{");
    if (meta) hl += (size_t)snprintf(hdr + hl, hcap - hl, "\"__metadata__\":%s", meta);
    int first = !meta;
    for (int i = 0; i < r->n; i++) {
        if (pick && !pick[i]) continue;
        const struct ref_tensor *t = &r->t[i];
        size_t begin = dl;
        for (int64_t j = 0; j < t->n; j++) {
            if (es == 4) {
                memcpy(data + dl, &t->v[j], 4);
            } else {
                uint16_t h = strcmp(dtype, "F16") == 0 ? to_f16(t->v[j]) : to_bf16(t->v[j]);
                data[dl] = (uint8_t)(h & 0xff);
                data[dl + 1] = (uint8_t)(h >> 8);
            }
            dl += es;
        }
        char shape[64];
        if (t->nd == 2)
            snprintf(shape, sizeof shape, "[%lld, %lld]", (long long)t->shape[0], (long long)t->shape[1]);
        else
            snprintf(shape, sizeof shape, "[%lld]", (long long)t->shape[0]);
        hl += (size_t)snprintf(hdr + hl, hcap - hl,
                               "%s\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                               first ? "" : ",", t->name, dtype, shape, begin, dl);
        first = 0;
        cr_assert(hl < hcap);
    }
    hl += (size_t)snprintf(hdr + hl, hcap - hl, "}");
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    fwrite(len8, 1, 8, f);
    fwrite(hdr, 1, hl, f);
    fwrite(data, 1, dl, f);
    fclose(f);
    free(hdr);
    free(data);
}

static void write_config(const char *dir, int tied, int bias, const char *extra) {
    char text[4096];
    snprintf(text, sizeof text,
             "{\n"
             "  \"architectures\": [\"LlamaForCausalLM\"],\n"
             "  \"model_type\": \"llama\",\n"
             "  \"hidden_size\": %d,\n"
             "  \"intermediate_size\": %d,\n"
             "  \"num_hidden_layers\": %d,\n"
             "  \"num_attention_heads\": 4,\n"
             "  \"num_key_value_heads\": 2,\n"
             "  \"vocab_size\": %d,\n"
             "  \"rms_norm_eps\": 1e-05,\n"
             "  \"rope_theta\": 500000.0,\n"
             "  \"max_position_embeddings\": 64,\n"
             "  \"tie_word_embeddings\": %s,\n"
             "  \"attention_bias\": %s,\n"
             "  \"rope_scaling\": null,\n"
             "  \"hidden_act\": \"silu\"%s%s\n"
             "}\n",
             T_DIM, T_FFN, T_LAYERS, T_VOCAB, tied ? "true" : "false", bias ? "true" : "false",
             extra ? ",\n  " : "", extra ? extra : "");
    write_text(dir, "config.json", text);
}

/* A directory holding the reference model as dtype; omit names one tensor
 * to leave out. */
static char *make_dir(const struct ref_model *r, const char *dtype, int tied, int bias,
                      const char *omit, const char *config_extra) {
    char *dir = kvt_temp_dir();
    write_config(dir, tied, bias, config_extra);
    int pick[64];
    for (int i = 0; i < r->n; i++) pick[i] = !omit || strcmp(r->t[i].name, omit) != 0;
    write_st(dir, "model.safetensors", r, pick, dtype, "{\"format\":\"pt\"}");
    return dir;
}

static void expect_weights(const struct kv_model *m, const struct ref_model *r, const char *what) {
    for (int i = 0; i < r->n; i++) {
        const struct ref_tensor *t = &r->t[i];
        const float *got = bound(m, t->kind, t->layer);
        cr_assert_not_null(got, "%s: %s is not bound", what, t->name);
        for (int64_t j = 0; j < t->n; j++)
            cr_assert(got[j] == t->v[j], "%s: %s[%lld] = %.9g, expected %.9g", what, t->name,
                      (long long)j, (double)got[j], (double)t->v[j]);
    }
}

/* ---------------------------------------------------------------- real checkpoint */

Test(hf_load, tinystories_656k_config_and_tied_head) {
    KVT_NEED_SHARED(dir_s, "models/tinystories-656K");
    char *dir = strdup(dir_s);
    struct kv_model *m = load_ok(dir);
    const struct kv_config *c = kv_model_config(m);
    cr_assert_eq(c->dim, 128);
    cr_assert_eq(c->hidden_dim, 384);
    cr_assert_eq(c->n_layers, 2);
    cr_assert_eq(c->n_heads, 8);
    cr_assert_eq(c->n_kv_heads, 4);
    cr_assert_eq(c->head_dim, 16);
    cr_assert_eq(c->vocab_size, 2048);
    cr_assert_eq(c->max_seq_len, 512);
    cr_assert_eq(c->tied_embeddings, 1);
    cr_assert_eq(c->has_qkv_bias, 0);
    cr_assert_float_eq(c->rope_theta, 10000.0f, 0);
    cr_assert_float_eq(c->norm_eps, 1e-6f, 0);
    cr_assert_eq(c->rope_layout, KV_ROPE_HALF);
    cr_assert_eq(c->bos_id, 1);
    cr_assert_eq(c->eos_id, 2);
    cr_assert_eq(kv_model_format(m), KV_FORMAT_HF);

    /* Only lm_head.weight is stored; __metadata__ aliases the embedding to it. */
    cr_assert_eq(kv_model_n_tensors(m), 20);
    const struct kv_tensor *head = NULL, *norm = NULL;
    for (int64_t i = 0; i < kv_model_n_tensors(m); i++) {
        const struct kv_tensor *t = kv_model_tensor(m, i);
        if (!strcmp(t->name, "lm_head.weight")) head = t;
        if (!strcmp(t->name, "model.norm.weight")) norm = t;
    }
    cr_assert_not_null(head);
    cr_assert_not_null(norm);
    cr_assert_eq(head->offset, 8 + 2160);
    cr_assert_eq(m->tok_emb, m->lm_head);
    cr_assert_eq((const void *)m->tok_emb, head->data, "F32 weights are views into the mapping");

    /* The final norm's bytes, read straight from the file at 8 + 2160 + 2623488. */
    size_t flen;
    char *path = kv_path_join(dir, "model.safetensors");
    char *bytes = kvt_read_file(path, &flen);
    cr_assert_eq(flen, 2626168);
    cr_assert_eq(norm->offset, 8 + 2160 + 2623488);
    cr_assert_eq(memcmp(m->out_norm, bytes + 8 + 2160 + 2623488, 128 * 4), 0);
    free(bytes);
    free(path);

    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    cr_assert_not_null(tok);
    cr_assert_eq(kv_tok_n_vocab(tok), 2048);
    cr_assert_eq(kv_tok_bos(tok), 1);
    cr_assert_eq(kv_tok_eos(tok), 2);
    kv_model_close(m);
    free(dir);
}

/* ---------------------------------------------------------------- tiny checkpoints */

Test(hf_load, f16_and_bf16_load_equal_to_f32) {
    struct ref_model r;
    ref_build(&r, 0, 1);
    static const char *const dtypes[] = {"F32", "F16", "BF16"};
    for (int i = 0; i < 3; i++) {
        char *dir = make_dir(&r, dtypes[i], 0, 1, NULL, NULL);
        struct kv_model *m = load_ok(dir);
        const struct kv_config *c = kv_model_config(m);
        cr_assert_eq(c->dim, T_DIM);
        cr_assert_eq(c->head_dim, 4);
        cr_assert_eq(c->has_qkv_bias, 1);
        cr_assert_eq(c->tied_embeddings, 0);
        cr_assert_float_eq(c->rope_theta, 500000.0f, 0);
        cr_assert_float_eq(c->norm_eps, 1e-5f, 0);
        cr_assert_null(kv_model_tokenizer(m));
        cr_assert_eq(kv_model_n_tensors(m), r.n);
        cr_assert_eq(kv_model_tensor(m, 0)->dtype,
                     i == 0 ? KV_DTYPE_F32 : i == 1 ? KV_DTYPE_F16 : KV_DTYPE_BF16);
        expect_weights(m, &r, dtypes[i]);
        kv_model_close(m);
        kvt_rm_dir(dir);
    }
    ref_free(&r);
}

Test(hf_load, tied_checkpoint_without_lm_head_shares_the_embedding) {
    struct ref_model r;
    ref_build(&r, 1, 0);
    char *dir = make_dir(&r, "BF16", 1, 0, NULL, NULL);
    struct kv_model *m = load_ok(dir);
    cr_assert_eq(kv_model_config(m)->tied_embeddings, 1);
    cr_assert_eq(m->lm_head, m->tok_emb);
    expect_weights(m, &r, "tied");
    kv_model_close(m);
    kvt_rm_dir(dir);
    ref_free(&r);
}

Test(hf_load, metadata_alias_resolves_a_missing_tensor) {
    /* Untied config, but only the embedding is stored and __metadata__ says
     * lm_head.weight is the same tensor. */
    struct ref_model r;
    ref_build(&r, 1, 0);
    char *dir = kvt_temp_dir();
    write_config(dir, 0, 0, NULL);
    write_st(dir, "model.safetensors", &r, NULL, "F16",
             "{\"format\":\"pt\",\"lm_head.weight\":\"model.embed_tokens.weight\"}");
    struct kv_model *m = load_ok(dir);
    cr_assert_eq(kv_model_config(m)->tied_embeddings, 0);
    expect_weights(m, &r, "alias");
    cr_assert_not_null(m->lm_head);
    cr_assert_eq(memcmp(m->lm_head, m->tok_emb, T_VOCAB * T_DIM * sizeof(float)), 0);
    kv_model_close(m);

    write_st(dir, "model.safetensors", &r, NULL, "F16", "{\"format\":\"pt\"}");
    load_fails(dir, KV_EFORMAT,
               "model.safetensors: missing tensor 'lm_head.weight' (tie_word_embeddings is false)");
    kvt_rm_dir(dir);
    ref_free(&r);
}

static const char *shard_of(int i) {
    return i % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
}

/* Shards alternate tensor by tensor; index_override, if set, replaces the
 * index text. */
static char *make_sharded(const struct ref_model *r, const char *index_override) {
    char *dir = kvt_temp_dir();
    write_config(dir, 0, 1, NULL);
    int pick0[64], pick1[64];
    for (int i = 0; i < r->n; i++) {
        pick0[i] = i % 2 == 0;
        pick1[i] = i % 2 == 1;
    }
    write_st(dir, shard_of(0), r, pick0, "F16", NULL);
    write_st(dir, shard_of(1), r, pick1, "F32", NULL);
    if (index_override) {
        write_text(dir, "model.safetensors.index.json", index_override);
        return dir;
    }
    char *idx = malloc(16384);
    size_t n = (size_t)snprintf(idx, 16384, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
    for (int i = 0; i < r->n; i++)
        n += (size_t)snprintf(idx + n, 16384 - n, "%s\"%s\": \"%s\"", i ? ", " : "", r->t[i].name,
                              shard_of(i));
    snprintf(idx + n, 16384 - n, "}}");
    write_text(dir, "model.safetensors.index.json", idx);
    free(idx);
    return dir;
}

Test(hf_load, sharded_index_maps_each_shard_once) {
    struct ref_model r;
    ref_build(&r, 0, 1);
    char *dir = make_sharded(&r, NULL);
    struct kv_model *m = load_ok(dir);
    expect_weights(m, &r, "sharded");
    cr_assert_eq(kv_model_n_tensors(m), r.n);
    /* Table is shard 0's tensors then shard 1's, each in file order. */
    int64_t n0 = (r.n + 1) / 2;
    for (int64_t i = 0; i < kv_model_n_tensors(m); i++)
        cr_assert_eq(kv_model_tensor(m, i)->file, i < n0 ? 0 : 1, "tensor %lld", (long long)i);
    cr_assert_eq(m->n_cleanups, 2, "one mapping per shard");
    kv_model_close(m);
    kvt_rm_dir(dir);
    ref_free(&r);
}

Test(hf_load, sharded_index_names_a_tensor_its_shard_lacks) {
    struct ref_model r;
    ref_build(&r, 0, 1);
    char *dir = make_sharded(&r, NULL);
    /* model.norm.weight is index 2, stored in shard 1 (0-based 0); claim shard 2. */
    char *idx = malloc(16384);
    size_t n = (size_t)snprintf(idx, 16384, "{\"weight_map\": {");
    for (int i = 0; i < r.n; i++)
        n += (size_t)snprintf(idx + n, 16384 - n, "%s\"%s\": \"%s\"", i ? ", " : "", r.t[i].name,
                              strcmp(r.t[i].name, "model.norm.weight") ? shard_of(i) : shard_of(1));
    snprintf(idx + n, 16384 - n, "}}");
    write_text(dir, "model.safetensors.index.json", idx);
    free(idx);
    load_fails(dir, KV_EFORMAT,
               "model.safetensors.index.json: tensor 'model.norm.weight' is mapped to "
               "'model-00002-of-00002.safetensors' but that file does not contain it");
    kvt_rm_dir(dir);
    ref_free(&r);
}

Test(hf_load, sharded_index_refuses_paths_outside_the_directory) {
    struct ref_model r;
    ref_build(&r, 0, 1);
    char *dir = make_sharded(&r, "{\"weight_map\": {\"model.norm.weight\": \"../x.safetensors\"}}");
    load_fails(dir, KV_EFORMAT,
               "model.safetensors.index.json: weight_map names file '../x.safetensors', "
               "expected a plain file name");
    kvt_rm_dir(dir);
    ref_free(&r);
}

Test(hf_load, names_the_missing_tensor) {
    struct ref_model r;
    ref_build(&r, 0, 0);
    char *dir = make_dir(&r, "F32", 0, 0, "model.layers.1.mlp.up_proj.weight", NULL);
    load_fails(dir, KV_EFORMAT,
               "model.safetensors: missing tensor 'model.layers.1.mlp.up_proj.weight'");
    kvt_rm_dir(dir);
    ref_free(&r);
}

/* A safetensors file whose header is `{}` (no tensors at all) names the
 * first missing tensor; adding its zero tensors to the model must not pass
 * memcpy a null pointer (UBSan flagged it). */
Test(hf_load, empty_safetensors_header_names_the_missing_tensor) {
    struct ref_model r;
    ref_build(&r, 0, 0);
    char *dir = make_dir(&r, "F32", 0, 0, NULL, NULL);
    char *p = kvt_path(dir, "model.safetensors");
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f);
    const unsigned char hdr[10] = {2, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    cr_assert_eq(fwrite(hdr, 1, sizeof hdr, f), sizeof hdr);
    fclose(f);
    free(p);
    load_fails(dir, KV_EFORMAT, "model.safetensors: missing tensor 'model.embed_tokens.weight'");
    kvt_rm_dir(dir);
    ref_free(&r);
}

Test(hf_load, refuses_an_unknown_rope_scaling) {
    char *dir = kvt_temp_dir();
    write_text(dir, "config.json",
               "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24,"
               " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 32,"
               " \"rope_scaling\": {\"type\": \"ntk-by-parts\", \"factor\": 2.0}}");
    load_fails(dir, KV_EUNSUPPORTED,
               "config.json: rope_scaling: rope type 'ntk-by-parts' is not supported, expected "
               "default, linear, dynamic, llama3, yarn or longrope");
    kvt_rm_dir(dir);
}

/* What LlamaConfig itself accepts: rope_scaling of type "default" is plain
 * RoPE, and hidden_act may be left out (silu). */
Test(hf_load, accepts_default_rope_scaling_and_missing_hidden_act) {
    struct ref_model r;
    ref_build(&r, 1, 0);
    char *dir = make_dir(&r, "F32", 1, 0, NULL, NULL);
    const char *variants[] = {"{\"type\": \"default\"}", "{\"rope_type\": \"default\"}"};
    for (int v = 0; v < 2; v++) {
        char *p = kvt_path(dir, "config.json");
        char *cfg = kvt_read_file(p, NULL);
        cr_assert_not_null(cfg);
        char *a = strstr(cfg, "\"rope_scaling\": null,\n  \"hidden_act\": \"silu\"");
        cr_assert_not_null(a);
        char text[4096];
        snprintf(text, sizeof text, "%.*s\"rope_scaling\": %s%s", (int)(a - cfg), cfg, variants[v],
                 a + strlen("\"rope_scaling\": null,\n  \"hidden_act\": \"silu\""));
        write_text(dir, "config.json", text);
        struct kv_model *m = load_ok(dir);
        cr_assert_float_eq(kv_model_config(m)->rope_theta, 500000.0, 1e-3);
        expect_weights(m, &r, variants[v]);
        kv_model_close(m);
        write_config(dir, 1, 0, NULL);
        free(cfg), free(p);
    }
    kvt_rm_dir(dir);
    ref_free(&r);
}

Test(hf_load, refuses_duplicate_config_keys) {
    char *dir = kvt_temp_dir();
    /* {"model_type": "llama", = 24 bytes; "hidden_size": 16, = 19 more; the
     * second "hidden_size" key (13 bytes) ends at byte 56. */
    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_size\": 16, \"hidden_size\": 16}");
    load_fails(dir, KV_EFORMAT,
               "config.json: offset 56: invalid json: duplicate object key near '\"hidden_size\"'");
    kvt_rm_dir(dir);
}

Test(hf_load, reports_bad_config_values) {
    char *dir = kvt_temp_dir();
    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_size\": \"abc\"}");
    load_fails(dir, KV_EFORMAT,
               "config.json: key 'hidden_size' must be a positive integer, found \"abc\"");
    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_size\": 0}");
    load_fails(dir, KV_EFORMAT, "config.json: key 'hidden_size' must be a positive integer, found 0");
    write_text(dir, "config.json", "{\"model_type\": \"mamba\"}");
    load_fails(dir, KV_EUNSUPPORTED,
               "config.json: model_type 'mamba' is not supported, expected 'llama', 'gpt2', "
               "'mistral', 'qwen2', 'phi3', 'qwen3', 'gpt_neox' or 'gemma2'");
    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_act\": \"gelu\"}");
    load_fails(dir, KV_EUNSUPPORTED, "config.json: hidden_act 'gelu' is not supported, expected 'silu'");
    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_size\": 16}");
    load_fails(dir, KV_EFORMAT, "config.json: missing key 'intermediate_size'");
    /* beyond a float: named as written (before: "norm epsilon inf must be positive") */
    write_text(dir, "config.json",
               "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 32, "
               "\"num_attention_heads\": 2, \"num_hidden_layers\": 1, \"vocab_size\": 8, \"rms_norm_eps\": 1e308}");
    load_fails(dir, KV_EFORMAT, "config.json: key 'rms_norm_eps' is 1e+308, beyond the range of a float");
    write_text(dir, "config.json",
               "{\"model_type\": \"gpt2\", \"n_embd\": 16, \"n_head\": 2, \"n_layer\": 1, \"vocab_size\": 8, "
               "\"n_positions\": 8, \"layer_norm_epsilon\": 1e39}");
    load_fails(dir, KV_EFORMAT, "config.json: key 'layer_norm_epsilon' is 1e+39, beyond the range of a float");
    kvt_rm_dir(dir);
}

Test(hf_load, config_ids_override_the_tokenizer) {
    struct ref_model r;
    ref_build(&r, 0, 0);
    char *dir = make_dir(&r, "F32", 0, 0, NULL, NULL);
    write_text(dir, "tokenizer.json", hand_string_merges);
    struct kv_model *m = load_ok(dir);
    cr_assert_eq(kv_tok_bos(kv_model_tokenizer(m)), 1);
    cr_assert_eq(kv_model_config(m)->bos_id, 1, "config without ids takes the tokenizer's");
    cr_assert_eq(kv_model_config(m)->eos_id, 2);
    kv_model_close(m);
    write_config(dir, 0, 0, "\"bos_token_id\": 2, \"eos_token_id\": [1, 7]");
    m = load_ok(dir);
    cr_assert_eq(kv_tok_bos(kv_model_tokenizer(m)), 2);
    cr_assert_eq(kv_tok_eos(kv_model_tokenizer(m)), 1);
    cr_assert_eq(kv_model_config(m)->bos_id, 2);
    kv_model_close(m);
    kvt_rm_dir(dir);
    ref_free(&r);
}
