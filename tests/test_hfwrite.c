/* HF directory writer: the byte-level tokenizer.json against the identity
 * byte <-> id map it stands for, and write -> kv_model_open -> logits round
 * trips of both architectures against the model that was written. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hfwrite.h"
#include "model.h"
#include "naive_gpt2.h"
#include "naive_llama.h"
#include "testutil.h"


/* ---------------------------------------------------------------- byte tokenizer */

static struct kv_tokenizer *byte_tokenizer(char **dir_out) {
    char *dir = kvt_temp_dir(), *path = kvt_path(dir, "tokenizer.json");
    struct kv_err e;
    cr_assert_eq(kv_hf_write_byte_tokenizer(path, &e), KV_OK, "%s", e.msg);
    struct kv_tokenizer *tok;
    cr_assert_eq(kv_tok_open(path, &tok, &e), KV_OK, "%s", e.msg);
    free(path);
    *dir_out = dir;
    return tok;
}

Test(hf_write, byte_tokenizer_maps_every_byte_to_its_id_and_back) {
    char *dir;
    struct kv_tokenizer *tok = byte_tokenizer(&dir);
    cr_assert_eq(kv_tok_n_vocab(tok), 258);
    cr_assert_eq(kv_tok_bos(tok), 256);
    cr_assert_eq(kv_tok_eos(tok), 257);
    /* every byte value (NUL, newlines, invalid UTF-8 included), then UTF-8 text */
    const char utf8[] = "h\xc3\xa9llo w\xc3\xb6rld \xe2\x9c\x93\n\n\tline <s and /s> \xf0\x9f\x98\x80";
    size_t len = 256 + sizeof utf8 - 1;
    char *text = malloc(len);
    for (int b = 0; b < 256; b++) text[b] = (char)(255 - b);
    memcpy(text + 256, utf8, sizeof utf8 - 1);
    int32_t *ids;
    int64_t n;
    struct kv_err e;
    cr_assert_eq(kv_tok_encode(tok, text, len, 1, &ids, &n, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(n, (int64_t)len + 1, "%lld ids for %zu bytes", (long long)n, len);
    cr_assert_eq(ids[0], 256, "bos first");
    for (size_t i = 0; i < len; i++)
        cr_assert_eq(ids[i + 1], (uint8_t)text[i], "byte %zu (0x%02x) became id %d", i,
                     (uint8_t)text[i], ids[i + 1]);
    char *back = malloc(len + 16);
    size_t o = 0;
    for (int64_t i = 1; i < n; i++) o += kv_tok_decode(tok, ids[i - 1], ids[i], back + o, len + 16 - o);
    cr_assert_eq(o, len);
    cr_assert(memcmp(back, text, len) == 0, "decode(encode(x)) differs from x");
    free(back), free(ids), free(text);
    kv_tok_free(tok);
    kvt_rm_dir(dir);
}

Test(hf_write, byte_tokenizer_special_tokens_match_as_literals) {
    char *dir;
    struct kv_tokenizer *tok = byte_tokenizer(&dir);
    int32_t *ids;
    int64_t n;
    struct kv_err e;
    cr_assert_eq(kv_tok_encode(tok, "a</s>", 5, KV_TOK_PARSE_SPECIAL, &ids, &n, &e), KV_OK, "%s",
                 e.msg);
    cr_assert_eq(n, 2);
    cr_assert_eq(ids[0], 'a');
    cr_assert_eq(ids[1], 257);
    free(ids);
    /* by default the string is text: its bytes */
    cr_assert_eq(kv_tok_encode(tok, "a</s>", 5, 0, &ids, &n, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(n, 5);
    cr_assert_eq(ids[1], '<');
    free(ids);
    kv_tok_free(tok);
    kvt_rm_dir(dir);
}

/* ---------------------------------------------------------------- model round trips */

static float *logits_of(const struct kv_model *m, int64_t n) {
    int64_t V = kv_model_config(m)->vocab_size;
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 29 + 3) % V);
    struct kv_fwd *f;
    struct kv_err e;
    cr_assert_eq(kv_fwd_init(m, n, &f, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &e), KV_OK, "%s", e.msg);
    float *out = malloc((size_t)(n * V) * sizeof *out);
    memcpy(out, kv_fwd_logits(f), (size_t)(n * V) * sizeof *out);
    kv_fwd_free(f);
    free(tok);
    return out;
}

static struct kv_model *write_and_open(const struct kv_model *m, enum kv_dtype dtype,
                                       const char *tokenizer, char **dir_out) {
    char *dir = kvt_temp_dir(), *sub = kvt_path(dir, "model"); /* created by the writer */
    struct kv_err e;
    cr_assert_eq(kv_hf_write(m, sub, dtype, tokenizer, &e), KV_OK, "%s", e.msg);
    struct kv_model *back;
    char msg[2200];
    int rc = kv_model_open(sub, NULL, &back, &e);
    kv_err_format(&e, msg, sizeof msg, 0);
    cr_assert_eq(rc, KV_OK, "%s", msg);
    free(dir);
    *dir_out = sub;
    return back;
}

static void expect_same_config(const struct kv_config *a, const struct kv_config *b) {
    cr_assert_eq(b->arch, a->arch);
    cr_assert_eq(b->dim, a->dim);
    cr_assert_eq(b->hidden_dim, a->hidden_dim);
    cr_assert_eq(b->n_layers, a->n_layers);
    cr_assert_eq(b->n_heads, a->n_heads);
    cr_assert_eq(b->n_kv_heads, a->n_kv_heads);
    cr_assert_eq(b->head_dim, a->head_dim);
    cr_assert_eq(b->vocab_size, a->vocab_size);
    cr_assert_eq(b->max_seq_len, a->max_seq_len);
    cr_assert(b->norm_eps == a->norm_eps, "norm eps %g, wrote %g", (double)b->norm_eps,
              (double)a->norm_eps);
    if (a->arch == KV_ARCH_LLAMA) {
        cr_assert(b->rope_theta == a->rope_theta);
        cr_assert_eq(b->rope_layout, KV_ROPE_HALF);
    }
    cr_assert_eq(b->tied_embeddings, a->tied_embeddings);
    cr_assert_eq(b->has_qkv_bias, a->has_qkv_bias);
    cr_assert_eq(b->bos_id, a->bos_id);
    cr_assert_eq(b->eos_id, a->eos_id);
}

/* Round every weight of m (allocated by kvcal) through dtype, in place. */
static void round_weights(struct kv_model *m, enum kv_dtype dtype) {
    const struct kv_config *c = kv_model_config(m);
    int64_t s[2];
    for (int k = 0; k < KV_W_COUNT; k++)
        for (int64_t l = 0; l < (k < KV_W_FIRST_LAYER ? 1 : c->n_layers); l++) {
            float *w = kv_model_weight_mut(m, k, l);
            if (!w || (k == KV_W_LM_HEAD && c->tied_embeddings)) continue;
            int nd = kv_model_expected_shape(c, k, s);
            int64_t n = nd == 2 ? s[0] * s[1] : s[0];
            uint16_t h;
            for (int64_t i = 0; i < n; i++) {
                kv_convert_from_f32(dtype, &w[i], &h, 1);
                kv_convert_to_f32(dtype, &h, &w[i], 1);
            }
        }
}

/* Write m in F32 and F16, read both back: F32 gives the same logits (bit
 * for bit when exact), F16 the logits of m with its weights rounded to f16
 * and, loosely, m's own. */
static void round_trip(struct kv_model *m, int exact) {
    const struct kv_config *c = kv_model_config(m);
    int64_t n = 24, nv = n * c->vocab_size;
    float *ref = logits_of(m, n);
    char *dir;
    struct kv_model *back = write_and_open(m, KV_DTYPE_F32, NULL, &dir);
    expect_same_config(c, kv_model_config(back));
    float *got = logits_of(back, n);
    if (exact)
        cr_assert(memcmp(got, ref, (size_t)nv * sizeof *got) == 0, "f32 round trip changed logits");
    else
        kvt_assert_close_f32(got, ref, nv, 1e-6, 1e-5, "f32 round trip logits");
    free(got);
    kv_model_close(back);
    kvt_rm_dir(dir);

    back = write_and_open(m, KV_DTYPE_F16, NULL, &dir);
    got = logits_of(back, n);
    kvt_assert_close_f32(got, ref, nv, 1e-3, 1e-2, "f16 round trip against the f32 model");
    round_weights(m, KV_DTYPE_F16);
    float *ref16 = logits_of(m, n);
    kvt_assert_close_f32(got, ref16, nv, 1e-6, 1e-5, "f16 round trip against the rounded model");
    free(got), free(ref16), free(ref);
    kv_model_close(back);
    kvt_rm_dir(dir);
}

static struct kv_model *random_model(struct kv_config c, uint64_t seed) {
    struct kv_model *m;
    struct kv_err e;
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &e), KV_OK, "%s", e.msg);
    sharpen(m);
    return m;
}

Test(hf_write, llama_round_trip) {
    struct kv_model *m = random_model(tiny_cfg(KV_ROPE_HALF, 0, 1), 11);
    round_trip(m, 1);
    kv_model_close(m);
}

Test(hf_write, llama_interleaved_untied_with_bias_round_trip) {
    /* rope pairs (2i, 2i+1) become HF's rotate-half rows; biases and head kept */
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 1, 0);
    c.norm_eps = 1e-6f;
    c.rope_theta = 500000.0f;
    struct kv_model *m = random_model(c, 12);
    round_trip(m, 0);
    kv_model_close(m);
}

Test(hf_write, gpt2_round_trip) {
    struct kv_model *m = random_model(tiny_gpt2_cfg(), 13);
    round_trip(m, 1);
    kv_model_close(m);
}

Test(hf_write, gpt2_untied_round_trip) {
    struct kv_config c = tiny_gpt2_cfg();
    c.tied_embeddings = 0;
    struct kv_model *m = random_model(c, 14);
    round_trip(m, 1);
    kv_model_close(m);
}

Test(hf_write, gpt2_logits_match_the_naive_forward_after_the_round_trip) {
    /* the written Conv1D layout read back by the loader is the model */
    struct kv_model *m = random_model(tiny_gpt2_cfg(), 15);
    char *dir;
    struct kv_model *back = write_and_open(m, KV_DTYPE_F32, NULL, &dir);
    int64_t n = 20, V = kv_model_config(m)->vocab_size;
    int32_t tok[20];
    for (int i = 0; i < n; i++) tok[i] = (int32_t)((i * 29 + 3) % V);
    double *ref = naive_gpt2_forward(m, tok, n);
    float *reff = malloc((size_t)(n * V) * sizeof *reff), *got = logits_of(back, n);
    for (int64_t i = 0; i < n * V; i++) reff[i] = (float)ref[i];
    kvt_assert_close_f32(got, reff, n * V, 2e-5, 1e-4, "loaded gpt2 against naive");
    free(ref), free(reff), free(got);
    kv_model_close(back), kv_model_close(m);
    kvt_rm_dir(dir);
}

Test(hf_write, copies_the_tokenizer_and_writes_hf_names) {
    struct kv_config c = tiny_gpt2_cfg();
    c.vocab_size = 258;
    c.bos_id = 256, c.eos_id = 257;
    struct kv_model *m = random_model(c, 16);
    char *tdir = kvt_temp_dir(), *tpath = kvt_path(tdir, "bytes.json");
    struct kv_err e;
    cr_assert_eq(kv_hf_write_byte_tokenizer(tpath, &e), KV_OK, "%s", e.msg);
    char *dir;
    struct kv_model *back = write_and_open(m, KV_DTYPE_BF16, tpath, &dir);
    const struct kv_tokenizer *tok = kv_model_tokenizer(back);
    cr_assert_not_null(tok);
    cr_assert_eq(kv_tok_n_vocab(tok), 258);
    cr_assert_eq(kv_model_config(back)->bos_id, 256);
    /* HF's own names and layouts */
    int found = 0;
    for (int64_t i = 0; i < kv_model_n_tensors(back); i++) {
        const struct kv_tensor *t = kv_model_tensor(back, i);
        cr_assert_eq(t->dtype, KV_DTYPE_BF16);
        if (!strcmp(t->name, "transformer.h.1.attn.c_attn.weight")) {
            cr_assert_eq(t->shape[0], 48);
            cr_assert_eq(t->shape[1], 144);
            found++;
        }
        if (!strcmp(t->name, "transformer.h.0.mlp.c_proj.weight")) {
            cr_assert_eq(t->shape[0], 192);
            cr_assert_eq(t->shape[1], 48);
            found++;
        }
        cr_assert(strcmp(t->name, "lm_head.weight") != 0, "a tied head is not written");
    }
    cr_assert_eq(found, 2);
    char *cfg_path = kvt_path(dir, "config.json");
    char *cfg = kvt_read_file(cfg_path, NULL);
    cr_assert(strstr(cfg, "\"layer_norm_epsilon\": 1e-5"), "%s", cfg);
    cr_assert(strstr(cfg, "\"activation_function\": \"gelu_new\""), "%s", cfg);
    free(cfg), free(cfg_path);
    kv_model_close(back), kv_model_close(m);
    kvt_rm_dir(dir);
    unlink(tpath);
    free(tpath);
    rmdir(tdir);
    free(tdir);
}

Test(hf_write, refuses_other_dtypes_and_undescribable_models) {
    struct kv_model *m = random_model(tiny_gpt2_cfg(), 17);
    char *dir = kvt_temp_dir();
    struct kv_err e;
    cr_assert_eq(kv_hf_write(m, dir, KV_DTYPE_I32, NULL, &e), KV_EINVAL);
    cr_assert_str_eq(e.msg, "cannot write weights as I32, expected F32, F16 or BF16");
    kv_model_close(m);
    struct kv_config c = tiny_gpt2_cfg();
    c.head_dim = 8; /* 4 heads of 8 for dim 48 */
    m = random_model(c, 17);
    cr_assert_eq(kv_hf_write(m, dir, KV_DTYPE_F32, NULL, &e), KV_EINVAL);
    cr_assert_str_eq(e.msg, "gpt2 with 4 heads of 8 for dim 48 has no HF config (n_embd / n_head "
                            "is the head size)");
    kv_model_close(m);
    kvt_rm_dir(dir);
}
