/* HF directory loader and tokenizer.json: the real TinyStories-656K
 * checkpoint, tiny random Llama and GPT-2 checkpoints written here in
 * F32/F16/BF16 (single file and sharded), and the refusals, pinned to their
 * exact messages. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hfdir.h"
#include "model.h"
#include "safetensors.h"
#include "stwrite.h"
#include "testutil.h"
#include "tokenizer.h"
#include "tokjson.h"

#define SP "\xe2\x96\x81" /* U+2581, SentencePiece's space */

/* ---------------------------------------------------------------- files */

static void write_text(const char *dir, const char *name, const char *text) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
}


static void err_line(const struct kv_err *e, char *buf, size_t cap) { kv_err_format(e, buf, cap, 0); }

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

static const float *bound(const struct kv_model *m, enum kv_wkind k, int64_t layer) {
    switch (k) {
    case KV_W_TOK_EMB: return m->tok_emb;
    case KV_W_LM_HEAD: return m->lm_head;
    case KV_W_OUT_NORM: return m->out_norm;
    default: return m->layers[layer].w[k];
    }
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

static struct kv_model *load_ok(const char *dir) {
    struct kv_model *m = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    char msg[2200];
    int rc = kv_hf_load(dir, &m, &e);
    err_line(&e, msg, sizeof msg);
    cr_assert_eq(rc, KV_OK, "kv_hf_load: %s", msg);
    return m;
}

/* Load dir expecting failure with code and exactly "<dir>/<tail>". */
static void load_fails(const char *dir, int code, const char *tail) {
    struct kv_model *m = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kv_hf_load(dir, &m, &e);
    char msg[2200], want[2200];
    err_line(&e, msg, sizeof msg);
    snprintf(want, sizeof want, "%s/%s", dir, tail);
    cr_assert_eq(rc, code, "status %s, expected %s: %s", kv_status_name(rc), kv_status_name(code),
                 msg);
    cr_assert_null(m);
    cr_assert_str_eq(msg, want);
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

Test(hf_load, refuses_rope_scaling) {
    char *dir = kvt_temp_dir();
    write_text(dir, "config.json",
               "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24,"
               " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 32,"
               " \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}}");
    load_fails(dir, KV_EUNSUPPORTED, "config.json: rope_scaling type 'linear' is not supported");
    write_text(dir, "config.json",
               "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24,"
               " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 32,"
               " \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}}");
    load_fails(dir, KV_EUNSUPPORTED, "config.json: rope_scaling type 'llama3' is not supported");
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
    write_text(dir, "config.json", "{\"model_type\": \"mistral\"}");
    load_fails(dir, KV_EUNSUPPORTED, "config.json: model_type 'mistral' is not supported, expected 'llama' or 'gpt2'");
    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_act\": \"gelu\"}");
    load_fails(dir, KV_EUNSUPPORTED, "config.json: hidden_act 'gelu' is not supported, expected 'silu'");
    write_text(dir, "config.json", "{\"model_type\": \"llama\", \"hidden_size\": 16}");
    load_fails(dir, KV_EFORMAT, "config.json: missing key 'intermediate_size'");
    kvt_rm_dir(dir);
}

/* ---------------------------------------------------------------- gpt2 */

/* d 8, 2 heads of 4, n_inner 12, 2 layers, vocab 11, 10 positions. Tensors
 * are written as HF stores them (Conv1D [in, out]); the loaded weights are
 * checked against transposes taken here. */
#define G_DIM 8
#define G_INNER 12
#define G_LAYERS 2
#define G_VOCAB 11
#define G_POS 10

struct g_tensor {
    char name[96];
    int nd;
    int64_t shape[2];
    float *v;
};

struct g_model {
    struct g_tensor t[40];
    int n;
};

static void g_add(struct g_model *g, const char *prefix, const char *name, int64_t a, int64_t b,
                  uint32_t *seed) {
    struct g_tensor *t = &g->t[g->n++];
    snprintf(t->name, sizeof t->name, "%s%s", prefix, name);
    t->nd = b ? 2 : 1;
    t->shape[0] = a, t->shape[1] = b;
    int64_t n = b ? a * b : a;
    t->v = malloc((size_t)n * sizeof *t->v);
    for (int64_t i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        t->v[i] = (float)((int)((*seed >> 16) % 255) - 127) / 128.0f; /* exact in f16/bf16 */
    }
}

/* The stored tensors of a tiny GPT-2, names prefixed with prefix; buffers
 * adds the attention mask buffers HF once saved, head an lm_head.weight. */
static void g_build(struct g_model *g, const char *prefix, int buffers, int head) {
    memset(g, 0, sizeof *g);
    uint32_t seed = 777;
    char name[96];
    g_add(g, prefix, "wte.weight", G_VOCAB, G_DIM, &seed);
    g_add(g, prefix, "wpe.weight", G_POS, G_DIM, &seed);
    for (int l = 0; l < G_LAYERS; l++) {
        static const struct {
            const char *suffix;
            int64_t a, b;
        } per[] = {
            {"ln_1.weight", G_DIM, 0},         {"ln_1.bias", G_DIM, 0},
            {"attn.c_attn.weight", G_DIM, 3 * G_DIM}, {"attn.c_attn.bias", 3 * G_DIM, 0},
            {"attn.c_proj.weight", G_DIM, G_DIM}, {"attn.c_proj.bias", G_DIM, 0},
            {"ln_2.weight", G_DIM, 0},         {"ln_2.bias", G_DIM, 0},
            {"mlp.c_fc.weight", G_DIM, G_INNER}, {"mlp.c_fc.bias", G_INNER, 0},
            {"mlp.c_proj.weight", G_INNER, G_DIM}, {"mlp.c_proj.bias", G_DIM, 0},
        };
        for (size_t i = 0; i < sizeof per / sizeof per[0]; i++) {
            snprintf(name, sizeof name, "h.%d.%s", l, per[i].suffix);
            g_add(g, prefix, name, per[i].a, per[i].b, &seed);
        }
        if (buffers) {
            snprintf(name, sizeof name, "h.%d.attn.bias", l);
            g_add(g, prefix, name, G_POS, G_POS, &seed);
            snprintf(name, sizeof name, "h.%d.attn.masked_bias", l);
            g_add(g, prefix, name, 1, 0, &seed);
        }
    }
    g_add(g, prefix, "ln_f.weight", G_DIM, 0, &seed);
    g_add(g, prefix, "ln_f.bias", G_DIM, 0, &seed);
    if (head) g_add(g, "", "lm_head.weight", G_VOCAB, G_DIM, &seed);
}

static void g_free(struct g_model *g) {
    for (int i = 0; i < g->n; i++) free(g->t[i].v);
}

static struct g_tensor *g_find(struct g_model *g, const char *suffix) {
    for (int i = 0; i < g->n; i++) {
        size_t n = strlen(g->t[i].name), k = strlen(suffix);
        if (n >= k && strcmp(g->t[i].name + n - k, suffix) == 0 &&
            (n == k || g->t[i].name[n - k - 1] == '.'))
            return &g->t[i];
    }
    return NULL;
}

static const char g_config[] =
    "{\"architectures\": [\"GPT2LMHeadModel\"], \"model_type\": \"gpt2\", \"n_embd\": 8,"
    " \"n_layer\": 2, \"n_head\": 2, \"n_positions\": 10, \"n_inner\": 12, \"vocab_size\": 11,"
    " \"layer_norm_epsilon\": 1e-05, \"activation_function\": \"gelu_new\","
    " \"bos_token_id\": 10, \"eos_token_id\": 10}";

/* dir with config text and the model as dtype, leaving out tensor omit. */
static char *g_dir(const struct g_model *g, const char *config, enum kv_dtype dtype,
                   const char *omit) {
    char *dir = kvt_temp_dir();
    write_text(dir, "config.json", config);
    struct kv_stw *w;
    struct kv_err e;
    cr_assert_eq(kv_stw_init(&w, &e), KV_OK);
    for (int i = 0; i < g->n; i++) {
        if (omit && strcmp(g->t[i].name, omit) == 0) continue;
        cr_assert_eq(kv_stw_add_f32(w, g->t[i].name, dtype, g->t[i].nd, g->t[i].shape, g->t[i].v, &e),
                     KV_OK, "%s", e.msg);
    }
    char *path = kvt_path(dir, "model.safetensors");
    cr_assert_eq(kv_stw_write(w, path, &e), KV_OK, "%s", e.msg);
    free(path);
    kv_stw_free(w);
    return dir;
}

/* got [rows, cols] equals rows r0.. of stored [cols, all]ᵀ (conv) or of
 * stored [all, cols] (plain); cols 1 for vectors. */
static void expect_piece(const float *got, const struct g_tensor *st, int conv, int64_t r0,
                         int64_t rows, const char *what) {
    cr_assert_not_null(got, "%s is not bound", what);
    int64_t cols = st->nd == 2 ? (conv ? st->shape[0] : st->shape[1]) : 1;
    int64_t all = conv ? st->shape[1] : st->shape[0];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float want = conv ? st->v[c * all + r0 + r] : st->v[(r0 + r) * cols + c];
            cr_assert(got[r * cols + c] == want, "%s[%lld, %lld] = %g, expected %g (from '%s')",
                      what, (long long)r, (long long)c, (double)got[r * cols + c], (double)want,
                      st->name);
        }
}

static void expect_gpt2(const struct kv_model *m, struct g_model *g) {
    const struct kv_config *c = kv_model_config(m);
    cr_assert_eq(c->arch, KV_ARCH_GPT2);
    cr_assert_eq(c->dim, G_DIM);
    cr_assert_eq(c->hidden_dim, G_INNER);
    cr_assert_eq(c->n_layers, G_LAYERS);
    cr_assert_eq(c->n_heads, 2);
    cr_assert_eq(c->n_kv_heads, 2);
    cr_assert_eq(c->head_dim, 4);
    cr_assert_eq(c->vocab_size, G_VOCAB);
    cr_assert_eq(c->max_seq_len, G_POS);
    cr_assert_eq(c->tied_embeddings, 1);
    cr_assert_eq(c->has_qkv_bias, 1);
    cr_assert_float_eq(c->norm_eps, 1e-5f, 0);
    cr_assert_eq(m->lm_head, m->tok_emb);
    expect_piece(kv_model_weight(m, KV_W_TOK_EMB, 0), g_find(g, "wte.weight"), 0, 0, G_VOCAB, "wte");
    expect_piece(kv_model_weight(m, KV_W_POS_EMB, 0), g_find(g, "wpe.weight"), 0, 0, G_POS, "wpe");
    expect_piece(kv_model_weight(m, KV_W_OUT_NORM, 0), g_find(g, "ln_f.weight"), 0, 0, G_DIM, "ln_f");
    expect_piece(kv_model_weight(m, KV_W_OUT_NORM_B, 0), g_find(g, "ln_f.bias"), 0, 0, G_DIM, "ln_f.b");
    static const struct {
        const char *suffix;
        enum kv_wkind kind;
        int conv;
        int64_t r0, rows;
    } map[] = {
        {"ln_1.weight", KV_W_ATTN_NORM, 0, 0, G_DIM},
        {"ln_1.bias", KV_W_ATTN_NORM_B, 0, 0, G_DIM},
        {"attn.c_attn.weight", KV_W_Q, 1, 0, G_DIM},
        {"attn.c_attn.weight", KV_W_K, 1, G_DIM, G_DIM},
        {"attn.c_attn.weight", KV_W_V, 1, 2 * G_DIM, G_DIM},
        {"attn.c_attn.bias", KV_W_BQ, 0, 0, G_DIM},
        {"attn.c_attn.bias", KV_W_BK, 0, G_DIM, G_DIM},
        {"attn.c_attn.bias", KV_W_BV, 0, 2 * G_DIM, G_DIM},
        {"attn.c_proj.weight", KV_W_O, 1, 0, G_DIM},
        {"attn.c_proj.bias", KV_W_BO, 0, 0, G_DIM},
        {"ln_2.weight", KV_W_FFN_NORM, 0, 0, G_DIM},
        {"ln_2.bias", KV_W_FFN_NORM_B, 0, 0, G_DIM},
        {"mlp.c_fc.weight", KV_W_UP, 1, 0, G_INNER},
        {"mlp.c_fc.bias", KV_W_BUP, 0, 0, G_INNER},
        {"mlp.c_proj.weight", KV_W_DOWN, 1, 0, G_DIM},
        {"mlp.c_proj.bias", KV_W_BDOWN, 0, 0, G_DIM},
    };
    char suffix[96];
    for (int l = 0; l < G_LAYERS; l++)
        for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
            snprintf(suffix, sizeof suffix, "h.%d.%s", l, map[i].suffix);
            expect_piece(kv_model_weight(m, map[i].kind, l), g_find(g, suffix), map[i].conv,
                         map[i].r0, map[i].rows, suffix);
        }
    cr_assert_null(kv_model_weight(m, KV_W_GATE, 0));
}

Test(hf_load, gpt2_conv1d_weights_are_transposed_and_c_attn_split) {
    static const enum kv_dtype dtypes[] = {KV_DTYPE_F32, KV_DTYPE_F16, KV_DTYPE_BF16};
    for (int i = 0; i < 3; i++) {
        struct g_model g;
        g_build(&g, "transformer.", 0, 0);
        char *dir = g_dir(&g, g_config, dtypes[i], NULL);
        struct kv_model *m = load_ok(dir);
        expect_gpt2(m, &g);
        cr_assert_eq(kv_model_config(m)->bos_id, 10);
        cr_assert_eq(kv_model_config(m)->eos_id, 10);
        kv_model_close(m);
        kvt_rm_dir(dir);
        g_free(&g);
    }
}

/* Offset of tensor name in dir/model.safetensors. */
static unsigned long long st_offset(const char *dir, const char *name) {
    struct kv_st_file *st;
    struct kv_err e;
    char *p = kvt_path(dir, "model.safetensors");
    cr_assert_eq(kv_st_open(p, &st, &e), KV_OK, "%s", e.msg);
    const struct kv_tensor *t = kv_st_find(st, name);
    cr_assert_not_null(t, "no tensor '%s'", name);
    unsigned long long off = t->offset;
    kv_st_close(st);
    free(p);
    return off;
}

Test(hf_load, gpt2_n_inner_null_shapes_the_mlp_as_four_times_n_embd) {
    /* config by architectures alone, n_ctx for n_positions, unprefixed
     * names; n_inner null means 4 * n_embd = 32, which the stored c_fc
     * (n_inner 12) contradicts */
    struct g_model g;
    g_build(&g, "", 0, 0);
    char *dir = g_dir(&g,
                      "{\"architectures\": [\"GPT2LMHeadModel\"], \"n_embd\": 8, \"n_layer\": 2,"
                      " \"n_head\": 2, \"n_ctx\": 10, \"n_inner\": null, \"vocab_size\": 11}",
                      KV_DTYPE_F32, NULL);
    char want[256];
    snprintf(want, sizeof want,
             "model.safetensors: offset %llu: tensor 'h.0.mlp.c_fc.weight' has shape [8, 12] but "
             "the config implies [8, 32] (Conv1D, stored [in, out])",
             st_offset(dir, "h.0.mlp.c_fc.weight"));
    load_fails(dir, KV_EFORMAT, want);
    kvt_rm_dir(dir);
    g_free(&g);
}

Test(hf_load, gpt2_n_inner_null_is_four_times_n_embd) {
    struct kv_config c;
    struct kv_err e;
    char *dir = kvt_temp_dir();
    write_text(dir, "config.json",
               "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2,"
               " \"n_ctx\": 10, \"n_inner\": null, \"vocab_size\": 11}");
    char *p = kvt_path(dir, "config.json");
    cr_assert_eq(kv_hf_read_config(p, &c, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(c.hidden_dim, 32);
    cr_assert_eq(c.max_seq_len, 10);
    cr_assert_eq(c.tied_embeddings, 1);
    cr_assert_eq(c.bos_id, -1);
    cr_assert_float_eq(c.norm_eps, 1e-5f, 0);
    free(p);
    kvt_rm_dir(dir);
}

Test(hf_load, gpt2_loads_unprefixed_names_and_ignores_buffers) {
    struct g_model g;
    g_build(&g, "", 1, 1);
    char *dir = g_dir(&g,
                      "{\"architectures\": [\"GPT2LMHeadModel\"], \"n_embd\": 8, \"n_layer\": 2,"
                      " \"n_head\": 2, \"n_ctx\": 10, \"n_inner\": 12, \"vocab_size\": 11}",
                      KV_DTYPE_F16, NULL);
    struct kv_model *m = load_ok(dir);
    expect_gpt2(m, &g);
    cr_assert_eq(kv_model_n_tensors(m), g.n, "the buffers stay in the tensor table");
    kv_model_close(m);
    kvt_rm_dir(dir);
    g_free(&g);
}

Test(hf_load, gpt2_untied_head_and_a_head_standing_in_for_wte) {
    struct g_model g;
    g_build(&g, "transformer.", 0, 1);
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%.*s, \"tie_word_embeddings\": false}", (int)strlen(g_config) - 1,
             g_config);
    char *dir = g_dir(&g, cfg, KV_DTYPE_F32, NULL);
    struct kv_model *m = load_ok(dir);
    cr_assert_eq(kv_model_config(m)->tied_embeddings, 0);
    expect_piece(kv_model_weight(m, KV_W_LM_HEAD, 0), g_find(&g, "lm_head.weight"), 0, 0, G_VOCAB,
                 "lm_head");
    cr_assert_neq(m->lm_head, m->tok_emb);
    kv_model_close(m);
    kvt_rm_dir(dir);
    dir = g_dir(&g, cfg, KV_DTYPE_F32, "lm_head.weight");
    load_fails(dir, KV_EFORMAT,
               "model.safetensors: missing tensor 'lm_head.weight' (tie_word_embeddings is false)");
    kvt_rm_dir(dir);
    /* tied, wte absent: the stored head is the embedding */
    dir = g_dir(&g, g_config, KV_DTYPE_F32, "transformer.wte.weight");
    m = load_ok(dir);
    expect_piece(kv_model_weight(m, KV_W_TOK_EMB, 0), g_find(&g, "lm_head.weight"), 0, 0, G_VOCAB,
                 "wte from lm_head");
    kv_model_close(m);
    kvt_rm_dir(dir);
    g_free(&g);
}

Test(hf_load, gpt2_names_a_missing_or_ill_shaped_tensor) {
    struct g_model g;
    g_build(&g, "transformer.", 0, 0);
    char *dir = g_dir(&g, g_config, KV_DTYPE_F32, "transformer.h.1.attn.c_proj.bias");
    load_fails(dir, KV_EFORMAT, "model.safetensors: missing tensor 'transformer.h.1.attn.c_proj.bias'");
    kvt_rm_dir(dir);
    dir = g_dir(&g, g_config, KV_DTYPE_F32, "transformer.wpe.weight");
    load_fails(dir, KV_EFORMAT, "model.safetensors: missing tensor 'transformer.wpe.weight'");
    kvt_rm_dir(dir);
    /* c_attn stored [3d, d] (the Linear layout) instead of Conv1D's [d, 3d] */
    struct g_tensor *ca = g_find(&g, "h.1.attn.c_attn.weight");
    ca->shape[0] = 3 * G_DIM, ca->shape[1] = G_DIM;
    dir = g_dir(&g, g_config, KV_DTYPE_F32, NULL);
    char want[256];
    snprintf(want, sizeof want,
             "model.safetensors: offset %llu: tensor 'transformer.h.1.attn.c_attn.weight' has shape "
             "[24, 8] but the config implies [8, 24] (Conv1D, stored [in, out])",
             st_offset(dir, "transformer.h.1.attn.c_attn.weight"));
    load_fails(dir, KV_EFORMAT, want);
    kvt_rm_dir(dir);
    ca->shape[0] = G_DIM, ca->shape[1] = 3 * G_DIM;
    /* a bias of the wrong length */
    struct g_tensor *cb = g_find(&g, "h.0.attn.c_attn.bias");
    cb->shape[0] = 3 * G_DIM - 1;
    dir = g_dir(&g, g_config, KV_DTYPE_F32, NULL);
    snprintf(want, sizeof want,
             "model.safetensors: offset %llu: tensor 'transformer.h.0.attn.c_attn.bias' has shape "
             "[23] but the config implies [24]",
             st_offset(dir, "transformer.h.0.attn.c_attn.bias"));
    load_fails(dir, KV_EFORMAT, want);
    kvt_rm_dir(dir);
    cb->shape[0] = 3 * G_DIM;
    /* a NaN inside a Conv1D weight: its element index and offset as stored
     * (F16: 2 bytes an element) */
    struct g_tensor *fc = g_find(&g, "h.1.mlp.c_fc.weight");
    fc->v[13] = NAN;
    dir = g_dir(&g, g_config, KV_DTYPE_F16, NULL);
    snprintf(want, sizeof want,
             "model.safetensors: offset %llu: tensor 'transformer.h.1.mlp.c_fc.weight' element 13 "
             "is nan",
             st_offset(dir, "transformer.h.1.mlp.c_fc.weight") + 26);
    load_fails(dir, KV_ENUMERIC, want);
    kvt_rm_dir(dir);
    g_free(&g);
}

Test(hf_load, gpt2_refuses_unsupported_config) {
    char *dir = kvt_temp_dir();
    write_text(dir, "config.json", "{\"model_type\": \"gpt2\", \"activation_function\": \"relu\"}");
    load_fails(dir, KV_EUNSUPPORTED,
               "config.json: activation_function 'relu' is not supported, expected 'gelu_new' or "
               "'gelu_pytorch_tanh'");
    write_text(dir, "config.json", "{\"model_type\": \"gpt2\", \"activation_function\": \"gelu\"}");
    load_fails(dir, KV_EUNSUPPORTED,
               "config.json: activation_function 'gelu' is not supported, expected 'gelu_new' or "
               "'gelu_pytorch_tanh'");
    write_text(dir, "config.json", "{\"model_type\": \"gpt2\", \"scale_attn_weights\": false}");
    load_fails(dir, KV_EUNSUPPORTED, "config.json: scale_attn_weights false is not supported");
    write_text(dir, "config.json",
               "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_layer\": 2, \"n_head\": 3,"
               " \"n_positions\": 10, \"vocab_size\": 11}");
    load_fails(dir, KV_EFORMAT, "config.json: n_embd 8 is not a multiple of n_head 3");
    write_text(dir, "config.json",
               "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2,"
               " \"vocab_size\": 11}");
    load_fails(dir, KV_EFORMAT, "config.json: missing key 'n_positions'");
    write_text(dir, "config.json", "{\"model_type\": \"gpt2\", \"n_embd\": 8}");
    load_fails(dir, KV_EFORMAT, "config.json: missing key 'n_layer'");
    kvt_rm_dir(dir);
}

/* ---------------------------------------------------------------- tokenizer.json */

/* Hand-worked vocabulary. Merge ranks: 0 "a b", 1 "▁ a", 2 "▁ ab", 3 "b c",
 * 4 "c a". Pieces: <unk> 0, <s> 1, </s> 2, ▁ 3, a 4, b 5, c 6, ▁a 7, ab 8,
 * ▁ab 9, bc 10, <0x21> 11, ca 12. */
#define HAND_HEAD                                                                          \
    "{\"version\": \"1.0\",\n"                                                               \
    " \"added_tokens\": [{\"id\": 0, \"content\": \"<unk>\", \"special\": true},\n"           \
    "                  {\"id\": 1, \"content\": \"<s>\", \"special\": true},\n"               \
    "                  {\"id\": 2, \"content\": \"</s>\", \"special\": true}],\n"             \
    " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [\n"                          \
    "    {\"type\": \"Prepend\", \"prepend\": \"" SP "\"},\n"                                   \
    "    {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"" SP "\"}]},\n" \
    " \"pre_tokenizer\": null,\n"                                                            \
    " \"post_processor\": {\"type\": \"TemplateProcessing\",\n"                              \
    "    \"single\": [{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}},\n"                \
    "               {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}],\n"                       \
    "    \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1], \"tokens\": [\"<s>\"]}}},\n" \
    " \"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"byte_fallback\": true,\n"       \
    "   \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"" SP "\": 3, \"a\": 4, \"b\": 5,"   \
    " \"c\": 6, \"" SP "a\": 7, \"ab\": 8, \"" SP "ab\": 9, \"bc\": 10, \"<0x21>\": 11, \"ca\": 12},\n"

static const char hand_string_merges[] =
    HAND_HEAD "   \"merges\": [\"a b\", \"" SP " a\", \"" SP " ab\", \"b c\", \"c a\"]}}\n";
static const char hand_array_merges[] =
    HAND_HEAD "   \"merges\": [[\"a\", \"b\"], [\"" SP "\", \"a\"], [\"" SP "\", \"ab\"], [\"b\", \"c\"],"
              " [\"c\", \"a\"]]}}\n";

static struct kv_tokenizer *tok_load_text(const char *text) {
    char *path = kvt_write_temp(text, strlen(text), ".json");
    struct kv_tokenizer *tok = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    char msg[2200];
    int rc = kv_hf_load_tokenizer(path, &tok, &e);
    err_line(&e, msg, sizeof msg);
    cr_assert_eq(rc, KV_OK, "%s", msg);
    unlink(path);
    free(path);
    return tok;
}

static void expect_ids(const struct kv_tokenizer *tok, const char *text, int add_bos,
                       const int32_t *want, int64_t n_want) {
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_tok_encode(tok, text, strlen(text), add_bos, &ids, &n, &e), KV_OK, "%s", e.msg);
    char got[256] = "", exp[256] = "";
    for (int64_t i = 0; i < n; i++)
        snprintf(got + strlen(got), sizeof got - strlen(got), " %d", ids[i]);
    for (int64_t i = 0; i < n_want; i++)
        snprintf(exp + strlen(exp), sizeof exp - strlen(exp), " %d", want[i]);
    cr_assert_str_eq(got, exp, "encode(\"%s\")", text);
    free(ids);
}

static void check_hand_tokenizer(const struct kv_tokenizer *tok) {
    cr_assert_eq(kv_tok_n_vocab(tok), 13);
    cr_assert_eq(kv_tok_bos(tok), 1, "BOS from the TemplateProcessing post-processor");
    cr_assert_eq(kv_tok_eos(tok), 2, "EOS from the special added token </s>");
    cr_assert_eq(kv_tok_type(tok, 0), KV_TOKT_UNKNOWN);
    cr_assert_eq(kv_tok_type(tok, 1), KV_TOKT_CONTROL);
    cr_assert_eq(kv_tok_type(tok, 4), KV_TOKT_NORMAL);
    cr_assert_eq(kv_tok_type(tok, 11), KV_TOKT_BYTE);
    /* "abc" -> ▁ a b c; lowest rank first: a+b (0) -> ▁ ab c; ▁+ab (2) -> ▁ab c. */
    expect_ids(tok, "abc", 1, (const int32_t[]){1, 9, 6}, 3);
    /* "bca" -> ▁ b c a; b+c (3) beats c+a (4) -> ▁ bc a. */
    expect_ids(tok, "bca", 0, (const int32_t[]){3, 10, 4}, 3);
    /* "c ab!" -> ▁ c ▁ a b !; a+b (0) then ▁+ab (2); '!' is byte piece <0x21>. */
    expect_ids(tok, "c ab!", 0, (const int32_t[]){3, 6, 9, 11}, 4);
    /* 'z' has neither a piece nor a byte piece: unknown. */
    expect_ids(tok, "z", 0, (const int32_t[]){3, 0}, 2);
    /* "</s>" is an added token matched verbatim; "a" alone is ▁+a (1). */
    expect_ids(tok, "a</s>", 0, (const int32_t[]){7, 2}, 2);
}

Test(hf_tokenizer, hand_worked_merges_as_strings) {
    struct kv_tokenizer *tok = tok_load_text(hand_string_merges);
    check_hand_tokenizer(tok);
    kv_tok_free(tok);
}

Test(hf_tokenizer, hand_worked_merges_as_pairs) {
    struct kv_tokenizer *tok = tok_load_text(hand_array_merges);
    check_hand_tokenizer(tok);
    kv_tok_free(tok);
}

Test(hf_tokenizer, metaspace_pre_tokenizer_matches_the_normalizer_form) {
    /* Same file with the space handling moved to a Metaspace pre-tokenizer. */
    char *text = strdup(hand_string_merges);
    const char *from = strstr(text, " \"normalizer\"");
    const char *to = strstr(text, " \"post_processor\"");
    char *out = malloc(strlen(text) + 256);
    size_t a = (size_t)(from - text);
    memcpy(out, text, a);
    a += (size_t)sprintf(out + a, " \"normalizer\": null,\n \"pre_tokenizer\": {\"type\": \"Metaspace\","
                                  " \"replacement\": \"" SP "\", \"prepend_scheme\": \"always\","
                                  " \"split\": false},\n");
    strcpy(out + a, to);
    struct kv_tokenizer *tok = tok_load_text(out);
    check_hand_tokenizer(tok);
    kv_tok_free(tok);
    free(out);
    free(text);
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

static void tok_fails(const char *text, int code, const char *tail) {
    char *path = kvt_write_temp(text, strlen(text), ".json");
    struct kv_tokenizer *tok = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kv_hf_load_tokenizer(path, &tok, &e);
    char msg[2200], want[2200];
    err_line(&e, msg, sizeof msg);
    snprintf(want, sizeof want, "%s: %s", path, tail);
    cr_assert_eq(rc, code, "status %s: %s", kv_status_name(rc), msg);
    cr_assert_null(tok);
    cr_assert_str_eq(msg, want);
    unlink(path);
    free(path);
}

Test(hf_tokenizer, refuses_other_tokenizer_kinds) {
    tok_fails("{\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false},"
              " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
              KV_EUNSUPPORTED, "pre_tokenizer 'ByteLevel' is not supported");
    tok_fails("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}", KV_EUNSUPPORTED,
              "tokenizer model type 'WordPiece' is not supported, expected 'BPE'");
    tok_fails("{\"normalizer\": {\"type\": \"NFKC\"},"
              " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
              KV_EUNSUPPORTED, "normalizer 'NFKC' is not supported");
    tok_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"c\": 2}, \"merges\": []}}",
              KV_EFORMAT, "vocab has no piece for id 1 (ids go up to 2)");
    tok_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b c\"]}}",
              KV_EFORMAT, "merges[0] must be \"a b\" or [\"a\", \"b\"], found \"a b c\"");
}

Test(hf_tokenizer, tinystories_round_trip_on_20kb_of_stories) {
    KVT_NEED_SHARED(tok_path_s, "models/tinystories-656K/tokenizer.json");
    char *tok_path = strdup(tok_path_s);
    KVT_NEED_SHARED(text_path, "text/tinystories/val1k.txt");
    size_t len;
    char *text = kvt_read_file(text_path, &len);
    cr_assert_not_null(text);
    cr_assert(len > 20480);
    len = 20480;
    text[len] = 0;

    struct kv_tokenizer *tok = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_hf_load_tokenizer(tok_path, &tok, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_tok_n_vocab(tok), 2048);
    cr_assert_eq(kv_tok_bos(tok), 1);
    cr_assert_eq(kv_tok_eos(tok), 2);

    int32_t *ids = NULL;
    int64_t n = 0;
    cr_assert_eq(kv_tok_encode(tok, text, len, 1, &ids, &n, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(ids[0], 1);
    cr_assert(n > 1000 && n < (int64_t)len / 2, "%lld tokens for %zu bytes", (long long)n, len);
    char *back = malloc(len * 4 + 64);
    size_t o = 0;
    for (int64_t i = 1; i < n; i++) {
        cr_assert_neq(ids[i], 0, "token %lld is <unk>", (long long)i);
        o += kv_tok_decode(tok, ids[i - 1], ids[i], back + o, len * 4 - o);
    }
    back[o] = 0;
    cr_assert_eq(o, len, "decoded %zu bytes, expected %zu", o, len);
    cr_assert(memcmp(back, text, len) == 0, "decode(encode(x)) differs from x");
    free(back);
    free(ids);
    kv_tok_free(tok);
    free(text);
    free(tok_path);
}
