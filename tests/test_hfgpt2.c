/* HF directory loader, GPT-2: tiny checkpoints written here (Conv1D weights,
 * c_attn holding q, k and v; with and without the "transformer." prefix;
 * tied and untied heads), and the refusals, pinned to their exact messages. */
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
