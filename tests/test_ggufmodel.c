/* GGUF llama mapping: the loader and the vocabulary, on the small GGUF of
 * gguf_fixture.h and on stories260K from the shared data. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ggmlquant.h"
#include "gguf.h"
#include "gguf_fixture.h"
#include "ggufmodel.h"
#include "llama2c.h"
#include "model.h"
#include "testutil.h"
#include "tokenizer.h"

/* ------------------------------------------------------------ loading */

static char *write_fx(const struct fx *f) { return kvt_write_temp(f->p, f->len, ".gguf"); }

Test(gguf_load, loads_the_tiny_model) {
    struct fx f;
    build(&f, NULL, 1);
    char *path = write_fx(&f);
    struct kv_model *m;
    struct kv_err err;
    int rc = kv_gguf_load(path, &m, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    const struct kv_config *c = kv_model_config(m);
    cr_assert_eq(c->dim, 32);
    cr_assert_eq(c->hidden_dim, 64);
    cr_assert_eq(c->n_layers, 1);
    cr_assert_eq(c->n_heads, 4);
    cr_assert_eq(c->n_kv_heads, 2);
    cr_assert_eq(c->head_dim, 8);
    cr_assert_eq(c->vocab_size, 16);
    cr_assert_eq(c->max_seq_len, 128);
    cr_assert_eq(c->norm_eps, 1e-6f);
    cr_assert_eq(c->rope_theta, 10000.0f);
    cr_assert_eq(c->rope_layout, KV_ROPE_INTERLEAVED);
    cr_assert_eq(c->tied_embeddings, 1);
    cr_assert_eq(c->bos_id, 1);
    cr_assert_eq(c->eos_id, 2);
    cr_assert_eq(kv_model_format(m), KV_FORMAT_GGUF);
    cr_assert_eq(kv_model_n_tensors(m), N_TINY);
    cr_assert_str_eq(kv_model_tensor(m, 3)->name, "blk.0.attn_q.weight");
    cr_assert_eq(m->lm_head, m->tok_emb);
    cr_assert_eq(m->layers[0].w[KV_W_DOWN][5], tval(T_DOWN, 5));
    cr_assert_eq(m->layers[0].w[KV_W_DOWN][64 * 31 + 63], tval(T_DOWN, 64 * 31 + 63));
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    cr_assert_not_null(tok);
    cr_assert_eq(kv_tok_n_vocab(tok), 16);
    cr_assert_eq(kv_tok_type(tok, 3), KV_TOKT_NORMAL); /* no token_type array */
    cr_assert_eq(kv_tok_score(tok, 9), -9.0f);
    kv_model_close(m);
    unlink(path);
    free(path);
    free(f.p);
}

Test(gguf_load, converts_f16_and_bf16_weights) {
    uint32_t types[N_TINY] = {0};
    types[T_K] = T_F16;
    types[T_V] = T_BF16;
    struct fx f;
    build(&f, types, 0);
    char *path = write_fx(&f);
    struct kv_model *m;
    struct kv_err err;
    int rc = kv_gguf_load(path, &m, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    cr_assert_null(kv_model_tokenizer(m));
    for (int i = 0; i < 16 * 32; i++) {
        cr_assert_eq(m->layers[0].w[KV_W_K][i], tval(T_K, (uint64_t)i), "k[%d]", i);
        cr_assert_eq(m->layers[0].w[KV_W_V][i], tval(T_V, (uint64_t)i), "v[%d]", i);
    }
    kv_model_close(m);
    unlink(path);
    free(path);
    free(f.p);
}

Test(gguf_load, dequantises_block_types) {
    uint32_t types[N_TINY] = {0};
    types[T_Q] = T_Q4_0;
    types[T_DOWN] = T_Q8_0;
    struct fx f;
    build(&f, types, 0);
    char *path = write_fx(&f);
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_gguf_load(path, &m, &err), KV_OK, "%s", fmt_err(&err));
    const struct {
        int t;
        enum kv_wkind kind;
        int64_t n;
    } rows[] = {{T_Q, KV_W_Q, 32 * 32}, {T_DOWN, KV_W_DOWN, 64 * 32}};
    for (int r = 0; r < 2; r++) {
        float *want = malloc((size_t)rows[r].n * sizeof *want);
        cr_assert_eq(kv_ggml_dequant(f.t_gtype[rows[r].t], f.p + f.data_off + f.t_rel[rows[r].t], want,
                                     rows[r].n),
                     KV_OK);
        cr_assert_eq(memcmp(m->layers[0].w[rows[r].kind], want, (size_t)rows[r].n * sizeof *want), 0,
                     "%s differs from its blocks decoded", f.t_name[rows[r].t]);
        /* and it is the f32 values, to the type's step */
        double worst = 0;
        for (int64_t i = 0; i < rows[r].n; i++)
            worst = fmax(worst, fabs(want[i] - tval(rows[r].t, (uint64_t)i)));
        cr_assert_leq(worst, r ? 0.008 : 0.13, "%s off by %g", f.t_name[rows[r].t], worst);
        free(want);
    }
    kv_model_close(m);
    unlink(path);
    free(path);
    free(f.p);
}

Test(gguf_load, refuses_undecodable_quantized_tensors_with_the_exact_message) {
    uint32_t types[N_TINY] = {0};
    types[T_Q] = T_Q8_1;
    struct fx f;
    build(&f, types, 0);
    char *path = write_fx(&f);
    struct kv_model *m = NULL;
    struct kv_err err;
    int rc = kv_gguf_load(path, &m, &err);
    cr_assert_eq(rc, KV_EUNSUPPORTED, "%s", fmt_err(&err));
    char want[512];
    snprintf(want, sizeof want,
             "%s: offset %zu: tensor 'blk.0.attn_q.weight' has quantized type Q8_1; kvcal loads "
             "F32, F16, BF16 and Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K",
             path, f.t_type[T_Q]);
    cr_assert_str_eq(fmt_err(&err), want);
    unlink(path);
    free(path);
    free(f.p);
}

/* Rewrite the u32 value of a key (same width) and load. */
static int load_patched(const char *key, uint32_t type, uint32_t value, struct kv_err *err,
                        char **pathp, size_t *offp) {
    struct fx f;
    build(&f, NULL, 0);
    int k = kv_index(&f, key);
    set_u32(&f, f.type_off[k], type);
    set_u32(&f, f.val_off[k], value);
    *offp = f.val_off[k];
    char *path = write_fx(&f);
    struct kv_model *m = NULL;
    int rc = kv_gguf_load(path, &m, err);
    kv_model_close(m);
    unlink(path);
    *pathp = path;
    free(f.p);
    return rc;
}

Test(gguf_load, refuses_other_architectures_and_bad_hyperparameters) {
    /* "llama" -> "gpt2\0"-length change is awkward; patch the string bytes. */
    struct fx f;
    build(&f, NULL, 0);
    int k = kv_index(&f, "general.architecture");
    memcpy(f.p + f.val_off[k] + 8, "bert1", 5);
    char *path = write_fx(&f);
    struct kv_model *m = NULL;
    struct kv_err err;
    cr_assert_eq(kv_gguf_load(path, &m, &err), KV_EUNSUPPORTED);
    cr_assert_str_eq(err.msg, "architecture 'bert1' is not supported, expected 'llama', 'qwen2', 'phi3', 'qwen3', 'gptneox' or 'gemma2'");
    cr_assert_eq(err.off, f.val_off[k]);
    unlink(path);
    free(path);
    free(f.p);

    char *p2;
    size_t off;
    cr_assert_eq(load_patched("llama.attention.head_count", 4, 5, &err, &p2, &off), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "llama.embedding_length 32 is not divisible by "
                              "llama.attention.head_count 5");
    free(p2);
    cr_assert_eq(load_patched("llama.block_count", 4, 0, &err, &p2, &off), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "key 'llama.block_count' is 0, expected 1..1024");
    cr_assert_eq(err.off, off);
    free(p2);
    /* a string where a u32 belongs: type 8 with a u64 length that is the old
     * value plus the next key's bytes would misparse, so use type float32 */
    cr_assert_eq(load_patched("llama.block_count", 6, 0, &err, &p2, &off), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "key 'llama.block_count' has type float32, expected uint32");
    free(p2);
}

/* ------------------------------------------------------------ stories260K */

#define GGUF_REL "models/stories260K/stories260K.gguf"
#define BIN_REL "models/stories260K/stories260K.bin"
#define TOK_REL "models/stories260K/tok512.bin"

Test(gguf_load, stories260k_has_the_readme_config) {
    KVT_NEED_SHARED(path, GGUF_REL);
    struct kv_model *m;
    struct kv_err err;
    int rc = kv_gguf_load(path, &m, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    const struct kv_config *c = kv_model_config(m);
    cr_assert_eq(c->dim, 64);
    cr_assert_eq(c->hidden_dim, 172);
    cr_assert_eq(c->n_layers, 5);
    cr_assert_eq(c->n_heads, 8);
    cr_assert_eq(c->n_kv_heads, 4);
    cr_assert_eq(c->head_dim, 8);
    cr_assert_eq(c->vocab_size, 512);
    cr_assert_eq(c->norm_eps, 1e-5f);
    cr_assert_eq(c->rope_theta, 10000.0f);
    cr_assert_eq(c->rope_layout, KV_ROPE_INTERLEAVED);
    cr_assert_eq(c->max_seq_len, 2048); /* the converter's default, per the README */
    /* The file stores output.weight (a copy of the embedding), so the loader
     * binds it as an untied head; the weights test checks it equals the
     * embedding. */
    cr_assert_eq(c->tied_embeddings, 0);
    cr_assert_eq(c->has_qkv_bias, 0);
    cr_assert_eq(c->bos_id, 1);
    cr_assert_eq(c->eos_id, 2);
    cr_assert_eq(kv_model_format(m), KV_FORMAT_GGUF);
    cr_assert_eq(kv_model_n_tensors(m), 48);
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    cr_assert_not_null(tok);
    cr_assert_eq(kv_tok_n_vocab(tok), 512);
    cr_assert_eq(kv_tok_bos(tok), 1);
    cr_assert_eq(kv_tok_eos(tok), 2);
    kv_model_close(m);
}

Test(gguf_load, stories260k_getter_names_file_key_and_types) {
    KVT_NEED_SHARED(path, GGUF_REL);
    struct kv_gguf_file *g;
    struct kv_err err;
    cr_assert_eq(kv_gguf_open(path, &g, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_str(g, "llama.block_count", &s, &err), KV_EFORMAT);
    const struct kv_gguf_kv *kv = kv_gguf_find(g, "llama.block_count");
    char want[1200];
    snprintf(want, sizeof want, "%s: offset %llu: key 'llama.block_count' has type uint32, expected string",
             path, (unsigned long long)kv->type_off);
    cr_assert_str_eq(fmt_err(&err), want);
    uint32_t u;
    cr_assert_eq(kv_gguf_get_u32(g, "tokenizer.ggml.model", &u, &err), KV_EFORMAT);
    cr_assert(strstr(err.msg, "key 'tokenizer.ggml.model' has type string, expected uint32"));
    cr_assert_eq(g->data_off, 14176);
    kv_gguf_close(g);
}

Test(gguf_load, stories260k_weights_equal_the_llama2c_checkpoint) {
    KVT_NEED_SHARED(gp, GGUF_REL);
    char gpath[4096];
    snprintf(gpath, sizeof gpath, "%s", gp);
    KVT_NEED_SHARED(bpath, BIN_REL);
    struct kv_model *g, *b;
    struct kv_err err;
    cr_assert_eq(kv_gguf_load(gpath, &g, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_l2c_load(bpath, &b, &err), KV_OK, "%s", fmt_err(&err));
    const struct kv_config *c = kv_model_config(g);
    int64_t s[2];
    int nd = kv_model_expected_shape(c, KV_W_TOK_EMB, s);
    size_t emb = (size_t)(s[0] * s[1]) * 4;
    cr_assert_eq(nd, 2);
    cr_assert(!memcmp(g->tok_emb, b->tok_emb, emb), "token embedding differs");
    cr_assert(!memcmp(g->lm_head, b->lm_head, emb), "output head differs");
    cr_assert(!memcmp(g->out_norm, b->out_norm, (size_t)c->dim * 4), "output norm differs");
    int compared = 3;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int k = KV_W_FIRST_LAYER; k < KV_W_COUNT; k++) {
            if (kv_wkind_use(c, k) != KV_WUSE_REQUIRED) {
                cr_assert_null(g->layers[l].w[k]);
                continue;
            }
            nd = kv_model_expected_shape(c, k, s);
            size_t n = (size_t)(nd == 2 ? s[0] * s[1] : s[0]) * 4;
            cr_assert(!memcmp(g->layers[l].w[k], b->layers[l].w[k], n), "layer %lld %s differs",
                      (long long)l, kv_wkind_name(k));
            compared++;
        }
    cr_assert_eq(compared, 3 + 5 * 9);
    kv_model_close(g);
    kv_model_close(b);
}

Test(gguf_load, stories260k_vocabulary_equals_tok512) {
    KVT_NEED_SHARED(gp, GGUF_REL);
    char gpath[4096];
    snprintf(gpath, sizeof gpath, "%s", gp);
    KVT_NEED_SHARED(tpath, TOK_REL);
    struct kv_tokenizer *g, *t;
    struct kv_err err;
    cr_assert_eq(kv_gguf_load_tokenizer(gpath, &g, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_l2c_load_tokenizer(tpath, 512, &t, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_tok_n_vocab(g), 512);
    cr_assert_eq(kv_tok_n_vocab(t), 512);
    cr_assert_eq(kv_tok_type(g, 0), KV_TOKT_UNKNOWN);
    cr_assert_eq(kv_tok_type(g, 1), KV_TOKT_CONTROL);
    cr_assert_eq(kv_tok_type(g, 2), KV_TOKT_CONTROL);
    int n_space = 0;
    for (int32_t id = 0; id < 512; id++) {
        cr_assert_eq(kv_tok_score(g, id), kv_tok_score(t, id), "score of %d", id);
        if (id < 3) continue;
        size_t gl, tl;
        const char *gp2 = kv_tok_piece(g, id, &gl);
        const char *tp = kv_tok_piece(t, id, &tl);
        char conv[64];
        size_t n = 0;
        for (size_t i = 0; i < gl; i++) {
            cr_assert(n < sizeof conv - 1);
            if (i + 2 < gl && !memcmp(gp2 + i, "\xe2\x96\x81", 3)) {
                conv[n++] = ' ';
                i += 2;
                n_space++;
            } else {
                conv[n++] = gp2[i];
            }
        }
        cr_assert(n == tl && !memcmp(conv, tp, tl), "piece %d: '%.*s' vs '%.*s'", id, (int)n,
                  conv, (int)tl, tp);
        cr_assert_eq(kv_tok_type(g, id), kv_tok_type(t, id), "type of %d", id);
    }
    cr_assert_gt(n_space, 50);
    kv_tok_free(g);
    kv_tok_free(t);
}

Test(gguf_load, other_tokenizer_models_are_unsupported) {
    struct fx f;
    build(&f, NULL, 1);
    int k = kv_index(&f, "tokenizer.ggml.model");
    memcpy(f.p + f.val_off[k] + 8, "gpt2x", 5);
    char *path = write_fx(&f);
    struct kv_tokenizer *tok;
    struct kv_err err;
    cr_assert_eq(kv_gguf_load_tokenizer(path, &tok, &err), KV_EUNSUPPORTED);
    cr_assert_str_eq(err.msg, "tokenizer model 'gpt2x' is not supported; kvcal reads 'llama' "
                              "(sentencepiece) and 'gpt2' (byte-level bpe) vocabularies");
    /* the model itself still loads, without a tokenizer */
    struct kv_model *m;
    cr_assert_eq(kv_gguf_load(path, &m, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_null(kv_model_tokenizer(m));
    kv_model_close(m);
    unlink(path);
    free(path);
    free(f.p);
}

Test(gguf_load, non_finite_score_names_the_token_and_its_byte) {
    struct fx f;
    build(&f, NULL, 1);
    int k = kv_index(&f, "tokenizer.ggml.scores");
    size_t at = f.val_off[k] + 12 + 4 * 5; /* element type, count, then token 5 */
    set_u32(&f, at, 0x7fc00000u);            /* NaN */
    char *path = write_fx(&f);
    struct kv_tokenizer *tok;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_gguf_load_tokenizer(path, &tok, &err), KV_EFORMAT);
    cr_assert_eq(err.off, at, "offset %llu, want %zu", (unsigned long long)err.off, at);
    cr_assert_str_eq(err.msg, "score of token 5 is nan, expected a finite number");
    unlink(path);
    free(path);
    free(f.p);
}
