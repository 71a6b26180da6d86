/* The GGUF model writer (formats/ggufmodelw.c): random Llama, Mistral,
 * Qwen2 and Qwen3 models written and read back by kvcal's own loader give
 * the same logits (Qwen3's per-head q/k norms with gains away from 1); matrices in F16/BF16 and block types are stored as exactly the
 * bytes kv_ggml_quant gives (read back through kv_ggml_dequant); the keys
 * llama.cpp reads are there with the types it insists on (yarn's
 * included); the vocabularies (synthetic, SentencePiece, byte-level BPE)
 * read back; and what cannot be written (sliding windows, rope scalings
 * llama.cpp cannot express) is refused with exact messages, leaving no
 * file. llama.cpp itself reads these files in test_llamacpp.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ggmlquant.h"
#include "gguf.h"
#include "ggufmodel.h"
#include "gguf_patch.h"
#include "ggufmodelw.h"
#include "model.h"
#include "naive_llama.h"
#include "testutil.h"
#include "tokenizer.h"

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14, T_BF16 = 30 };

/* ---------------------------------------------------------------- helpers */

static struct kv_model *random_model(struct kv_config c, uint64_t seed) {
    struct kv_model *m;
    struct kv_err e;
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &e), KV_OK, "%s", e.msg);
    sharpen(m);
    return m;
}

static float *logits_of(const struct kv_model *m, int64_t n) {
    int64_t V = kv_model_config(m)->vocab_size;
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 29 + 3) % V);
    struct kv_fwd *f;
    struct kv_err e;
    cr_assert_eq(kv_fwd_init(m, n, &f, &e), KV_OK, "%s", e.msg);
    float *out = malloc((size_t)(n * V) * sizeof *out);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, out, &e), KV_OK, "%s", e.msg);
    kv_fwd_free(f);
    free(tok);
    return out;
}

/* Write m to a fresh temporary directory as m.gguf; returns the path. */
static char *write_gguf(const struct kv_model *m, uint32_t type, char **dir_out) {
    char *dir = kvt_temp_dir(), *path = kvt_path(dir, "m.gguf");
    struct kv_gguf_write_opts o = {.matrix_type = type};
    struct kv_err e;
    char msg[2200];
    int rc = kv_gguf_write_model(m, path, &o, &e);
    kv_err_format(&e, msg, sizeof msg, 0);
    cr_assert_eq(rc, KV_OK, "%s", msg);
    *dir_out = dir;
    return path;
}

static struct kv_model *open_model(const char *path) {
    struct kv_model *m;
    struct kv_err e;
    char msg[2200];
    int rc = kv_model_open(path, NULL, &m, &e);
    kv_err_format(&e, msg, sizeof msg, 0);
    cr_assert_eq(rc, KV_OK, "%s", msg);
    return m;
}

static void remove_file(char *path, char *dir) {
    unlink(path);
    free(path);
    kvt_rm_dir(dir);
}

/* Write m in F32, read it back: the same model in the GGUF architecture's
 * layout (llama and mistral as "llama", interleaved; qwen2 and qwen3 as
 * themselves, rotate-half), with the same logits. */
static struct kv_model *round_trip(struct kv_model *m) {
    const struct kv_config *a = kv_model_config(m);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    struct kv_model *back = open_model(path);
    const struct kv_config *b = kv_model_config(back);
    cr_assert_eq(b->arch, a->arch == KV_ARCH_MISTRAL ? KV_ARCH_LLAMA : a->arch);
    cr_assert_eq(b->dim, a->dim);
    cr_assert_eq(b->hidden_dim, a->hidden_dim);
    cr_assert_eq(b->n_layers, a->n_layers);
    cr_assert_eq(b->n_heads, a->n_heads);
    cr_assert_eq(b->n_kv_heads, a->n_kv_heads);
    cr_assert_eq(b->head_dim, a->head_dim);
    cr_assert_eq(b->vocab_size, a->vocab_size);
    cr_assert_eq(b->max_seq_len, a->max_seq_len);
    cr_assert(b->norm_eps == a->norm_eps && b->rope_theta == a->rope_theta);
    int half = a->arch == KV_ARCH_QWEN2 || a->arch == KV_ARCH_QWEN3;
    cr_assert_eq(b->rope_layout, half ? KV_ROPE_HALF : KV_ROPE_INTERLEAVED,
                 "rope layout %d read back", (int)b->rope_layout);
    cr_assert_eq(b->tied_embeddings, a->tied_embeddings);
    cr_assert_eq(b->has_qkv_bias, a->has_qkv_bias);
    cr_assert_eq(b->bos_id, a->bos_id);
    cr_assert_eq(b->eos_id, a->eos_id);
    int64_t n = 24;
    float *ref = logits_of(m, n), *got = logits_of(back, n);
    kvt_assert_close_f32(got, ref, n * a->vocab_size, 1e-5, 0, "logits after the round trip");
    free(ref), free(got);
    remove_file(path, dir);
    return back;
}

/* ---------------------------------------------------------------- round trips */

Test(ggufmodelw, half_layout_tied_round_trip) {
    /* HF's rotate-half q/k rows become GGUF's interleaved ones */
    struct kv_model *m = random_model(tiny_cfg(KV_ROPE_HALF, 0, 1), 21);
    kv_model_close(round_trip(m));
    kv_model_close(m);
}

Test(ggufmodelw, interleaved_untied_bias_round_trip) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 1, 0);
    c.norm_eps = 1e-6f, c.rope_theta = 500000.0f;
    struct kv_model *m = random_model(c, 22);
    kv_model_close(round_trip(m));
    kv_model_close(m);
}

Test(ggufmodelw, half_layout_bias_round_trip) {
    /* the q and k biases are permuted with their rows */
    struct kv_model *m = random_model(tiny_cfg(KV_ROPE_HALF, 1, 0), 23);
    kv_model_close(round_trip(m));
    kv_model_close(m);
}

Test(ggufmodelw, head_dim_other_than_dim_over_heads_round_trip) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 1, 1);
    c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16; /* 4 * 16 != 48 */
    struct kv_model *m = random_model(c, 24);
    kv_model_close(round_trip(m));
    /* ... and the key and value lengths are written only then */
    char *dir, *path = write_gguf(m, T_F32, &dir);
    struct kv_gguf_file *f;
    struct kv_err e;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    uint32_t v;
    cr_assert_eq(kv_gguf_get_u32(f, "llama.attention.key_length", &v, &e), KV_OK);
    cr_assert_eq(v, 16);
    cr_assert_eq(kv_gguf_get_u32(f, "llama.attention.value_length", &v, &e), KV_OK);
    cr_assert_eq(v, 16);
    kv_gguf_close(f);
    remove_file(path, dir);
    kv_model_close(m);
    m = random_model(tiny_cfg(KV_ROPE_HALF, 0, 1), 25);
    path = write_gguf(m, T_F32, &dir);
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    cr_assert_null(kv_gguf_find(f, "llama.attention.key_length"));
    cr_assert_null(kv_gguf_find(f, "llama.attention.value_length"));
    kv_gguf_close(f);
    remove_file(path, dir);
    kv_model_close(m);
}

static struct kv_config llama3_cfg(void) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c.head_dim = 16, c.n_heads = 3, c.n_kv_heads = 1;
    c.rope_theta = 500000.0f;
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    /* a short original context: some pairs kept, some divided, some in between */
    s->type = KV_ROPE_SCALING_LLAMA3, s->factor = 8, s->low_freq_factor = 1;
    s->high_freq_factor = 4, s->original_ctx = 64;
    return c;
}

Test(ggufmodelw, llama3_rope_scaling_becomes_rope_freqs) {
    struct kv_config c = llama3_cfg();
    struct kv_model *m = random_model(c, 26);
    struct kv_model *back = round_trip(m);
    const struct kv_config *b = kv_model_config(back);
    cr_assert_eq(b->rope_scaling.type, KV_ROPE_SCALING_FREQS);
    cr_assert_eq(b->rope_scaling.n_factors, 8);
    double fa[KV_MAX_ROPE_FACTORS], fb[KV_MAX_ROPE_FACTORS];
    kv_rope_freqs(&c, 32, fa);
    kv_rope_freqs(b, 32, fb);
    int kept = 0, divided = 0;
    for (int i = 0; i < 8; i++) {
        cr_assert(fabs(fa[i] - fb[i]) <= 1e-7 * fa[i], "pair %d: %.17g, wrote %.17g", i, fb[i], fa[i]);
        kept += b->rope_scaling.short_factor[i] == 1.0f;
        divided += b->rope_scaling.short_factor[i] == 8.0f;
    }
    cr_assert(kept > 0 && divided > 0 && kept + divided < 8, "kept %d divided %d", kept, divided);
    /* a model with rope_freqs written again keeps its divisors exactly */
    char *dir, *path = write_gguf(back, T_F32, &dir);
    struct kv_model *again = open_model(path);
    cr_assert(memcmp(kv_model_config(again)->rope_scaling.short_factor, b->rope_scaling.short_factor,
                     8 * sizeof(float)) == 0);
    kv_model_close(again);
    remove_file(path, dir);
    kv_model_close(back);
    kv_model_close(m);
}

Test(ggufmodelw, linear_rope_scaling_round_trip) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 0);
    c.rope_scaling.type = KV_ROPE_SCALING_LINEAR, c.rope_scaling.factor = 4;
    struct kv_model *m = random_model(c, 27);
    struct kv_model *back = round_trip(m);
    cr_assert_eq(kv_model_config(back)->rope_scaling.type, KV_ROPE_SCALING_LINEAR);
    cr_assert(kv_model_config(back)->rope_scaling.factor == 4);
    kv_model_close(back);
    kv_model_close(m);
}

static void check_stored(const struct kv_model *m, const char *path, uint32_t t);

/* A small Qwen2: q/k/v biases, theta 1e6, tied head, GQA 3:1, n_heads *
 * head_dim = dim as llama.cpp's qwen2 needs. */
static struct kv_config qwen2_cfg(enum kv_rope_layout layout) {
    struct kv_config c = tiny_cfg(layout, 1, 1);
    c.arch = KV_ARCH_QWEN2;
    c.rope_theta = 1000000.0f, c.norm_eps = 1e-6f;
    return c;
}

Test(ggufmodelw, qwen2_round_trip_keeps_rotate_half_rows) {
    /* HF's rotate-half rows are what llama.cpp's qwen2 rotates: stored as
     * they are, read back as rotate-half */
    struct kv_model *m = random_model(qwen2_cfg(KV_ROPE_HALF), 61);
    kv_model_close(round_trip(m));
    kv_model_close(m);
}

Test(ggufmodelw, qwen2_round_trip_from_interleaved_rows) {
    /* an interleaved model's rows are permuted to rotate-half */
    struct kv_config c = qwen2_cfg(KV_ROPE_INTERLEAVED);
    c.tied_embeddings = 0;
    struct kv_model *m = random_model(c, 62);
    kv_model_close(round_trip(m));
    kv_model_close(m);
}

Test(ggufmodelw, mistral_round_trip_is_written_as_llama) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 0);
    c.arch = KV_ARCH_MISTRAL, c.rope_theta = 1000000.0f;
    struct kv_model *m = random_model(c, 63);
    kv_model_close(round_trip(m));
    kv_model_close(m);
}

Test(ggufmodelw, qwen2_file_has_its_keys_and_hf_rows) {
    struct kv_model *m = random_model(qwen2_cfg(KV_ROPE_HALF), 64);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    check_stored(m, path, T_F32);
    struct kv_gguf_file *f;
    struct kv_err e;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_str(f, "general.architecture", &s, &e), KV_OK);
    cr_assert(kv_gguf_str_eq(s, "qwen2"));
    const char *keys[] = {"qwen2.context_length", "qwen2.embedding_length", "qwen2.block_count",
                          "qwen2.feed_forward_length", "qwen2.attention.head_count",
                          "qwen2.attention.head_count_kv", "qwen2.rope.dimension_count",
                          "qwen2.rope.freq_base", "qwen2.attention.layer_norm_rms_epsilon"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        cr_assert_not_null(kv_gguf_find(f, keys[i]), "no key '%s'", keys[i]);
    float theta;
    cr_assert_eq(kv_gguf_get_f32(f, "qwen2.rope.freq_base", &theta, &e), KV_OK);
    cr_assert(theta == 1000000.0f);
    cr_assert_null(kv_gguf_find(f, "llama.embedding_length"));
    cr_assert_not_null(kv_gguf_find_tensor(f, "blk.1.attn_k.bias"));
    kv_gguf_close(f);
    remove_file(path, dir);
    kv_model_close(m);
}

/* A small Qwen3 as Qwen3-0.6B has it, scaled down: heads wider than dim
 * (4 * 16 = 64 against 48), GQA 2:1, theta 1e6, tied head; q/k/v biases
 * as asked (Qwen3 has none, kvcal allows them). */
static struct kv_config qwen3_cfg(enum kv_rope_layout layout, int bias, int tied) {
    struct kv_config c = tiny_cfg(layout, bias, tied);
    c.arch = KV_ARCH_QWEN3;
    c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16;
    c.rope_theta = 1000000.0f, c.norm_eps = 1e-6f;
    return c;
}

/* A random Qwen3 whose q and k norm gains differ from 1, from each other,
 * from layer to layer and along the head (so a norm dropped, swapped or
 * left unpermuted shows in the logits). */
static struct kv_model *qwen3_model(struct kv_config c, uint64_t seed) {
    struct kv_model *m = random_model(c, seed);
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int k = KV_W_QNORM; k <= KV_W_KNORM; k++) {
            float *w = kv_model_weight_mut(m, k, l);
            cr_assert_not_null(w);
            for (int64_t i = 0; i < c.head_dim; i++)
                w[i] = (k == KV_W_QNORM ? 0.6f : 1.3f) + 0.1f * (float)((i * 7 + 3 * l) % 9);
        }
    return m;
}

Test(ggufmodelw, qwen3_round_trip_keeps_rotate_half_rows_and_norms) {
    struct kv_model *m = qwen3_model(qwen3_cfg(KV_ROPE_HALF, 0, 1), 71);
    struct kv_model *back = round_trip(m);
    for (int64_t l = 0; l < 2; l++)
        for (int k = KV_W_QNORM; k <= KV_W_KNORM; k++)
            cr_assert(memcmp(kv_model_weight(back, k, l), kv_model_weight(m, k, l), 16 * 4) == 0,
                      "%s of layer %lld read back differs", kv_wkind_name(k), (long long)l);
    kv_model_close(back);
    kv_model_close(m);
}

Test(ggufmodelw, qwen3_round_trip_from_interleaved_rows_permutes_the_norms) {
    /* the q/k rows go to rotate-half, and the norm gains with them */
    struct kv_model *m = qwen3_model(qwen3_cfg(KV_ROPE_INTERLEAVED, 1, 0), 72);
    kv_model_close(round_trip(m));
    kv_model_close(m);
}

Test(ggufmodelw, qwen3_file_has_its_keys_norms_and_head_size) {
    struct kv_model *m = qwen3_model(qwen3_cfg(KV_ROPE_INTERLEAVED, 0, 1), 73);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    check_stored(m, path, T_F32);
    struct kv_gguf_file *f;
    struct kv_err e;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_str(f, "general.architecture", &s, &e), KV_OK);
    cr_assert(kv_gguf_str_eq(s, "qwen3"));
    /* heads of 16 where dim / n_heads is 12: llama.cpp needs the lengths */
    const struct {
        const char *key;
        uint32_t v;
    } want[] = {{"qwen3.embedding_length", 48}, {"qwen3.attention.head_count", 4},
                {"qwen3.attention.head_count_kv", 2}, {"qwen3.attention.key_length", 16},
                {"qwen3.attention.value_length", 16}, {"qwen3.rope.dimension_count", 16}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        uint32_t v;
        cr_assert_eq(kv_gguf_get_u32(f, want[i].key, &v, &e), KV_OK, "%s", e.msg);
        cr_assert_eq(v, want[i].v, "key '%s' is %u, expected %u", want[i].key, v, want[i].v);
    }
    float theta;
    cr_assert_eq(kv_gguf_get_f32(f, "qwen3.rope.freq_base", &theta, &e), KV_OK);
    cr_assert(theta == 1000000.0f);
    cr_assert_null(kv_gguf_find(f, "qwen2.embedding_length"));
    const struct kv_gguf_tensor *t = kv_gguf_find_tensor(f, "blk.1.attn_k_norm.weight");
    cr_assert(t && t->n_dims == 1 && t->ne[0] == 16 && t->ggml_type == T_F32);
    t = kv_gguf_find_tensor(f, "blk.0.attn_q.weight");
    cr_assert(t && t->ne[0] == 48 && t->ne[1] == 64);
    t = kv_gguf_find_tensor(f, "blk.0.attn_output.weight");
    cr_assert(t && t->ne[0] == 64 && t->ne[1] == 48);
    cr_assert_null(kv_gguf_find_tensor(f, "blk.0.attn_q.bias"));
    cr_assert_null(kv_gguf_find_tensor(f, "rope_freqs.weight"));
    kv_gguf_close(f);
    remove_file(path, dir);
    kv_model_close(m);
}

static struct kv_config yarn_cfg(enum kv_arch arch, double attention_factor) {
    struct kv_config c = arch == KV_ARCH_QWEN2   ? qwen2_cfg(KV_ROPE_HALF)
                         : arch == KV_ARCH_QWEN3 ? qwen3_cfg(KV_ROPE_HALF, 0, 1)
                                                 : tiny_cfg(KV_ROPE_HALF, 0, 1);
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = KV_ROPE_SCALING_YARN, s->factor = 4, s->original_ctx = 32;
    s->beta_fast = 32, s->beta_slow = 1, s->truncate = 1, s->attention_factor = attention_factor;
    return c;
}

/* The yarn keys of path under prefix ar; *attn: the attn_factor key's
 * value, or -1 when absent. */
static void yarn_keys(const char *path, const char *ar, float *factor, uint32_t *orig, float *attn) {
    struct kv_gguf_file *f;
    struct kv_err e;
    char key[128];
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    struct kv_gguf_str s;
    snprintf(key, sizeof key, "%s.rope.scaling.type", ar);
    cr_assert_eq(kv_gguf_get_str(f, key, &s, &e), KV_OK, "%s", e.msg);
    cr_assert(kv_gguf_str_eq(s, "yarn"));
    snprintf(key, sizeof key, "%s.rope.scaling.factor", ar);
    cr_assert_eq(kv_gguf_get_f32(f, key, factor, &e), KV_OK, "%s", e.msg);
    snprintf(key, sizeof key, "%s.rope.scaling.original_context_length", ar);
    cr_assert_eq(kv_gguf_get_u32(f, key, orig, &e), KV_OK, "%s", e.msg);
    snprintf(key, sizeof key, "%s.rope.scaling.attn_factor", ar);
    *attn = -1;
    if (kv_gguf_find(f, key)) cr_assert_eq(kv_gguf_get_f32(f, key, attn, &e), KV_OK, "%s", e.msg);
    /* llama.cpp's llama and qwen2 read no yarn_beta_* key: none is written */
    snprintf(key, sizeof key, "%s.rope.scaling.yarn_beta_fast", ar);
    cr_assert_null(kv_gguf_find(f, key));
    kv_gguf_close(f);
}

Test(ggufmodelw, yarn_rope_scaling_writes_llama_cpp_keys) {
    /* default attention factor: no attn_factor key (llama.cpp's own
     * 1 + 0.1 ln factor is transformers' default) */
    struct kv_model *m = random_model(yarn_cfg(KV_ARCH_QWEN2, 0), 65);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    float factor, attn;
    uint32_t orig;
    yarn_keys(path, "qwen2", &factor, &orig, &attn);
    cr_assert(factor == 4 && orig == 32 && attn == -1, "factor %g orig %u attn %g", factor, orig, attn);
    remove_file(path, dir);
    kv_model_close(m);
    /* an explicit one is divided by what llama.cpp multiplies in itself */
    m = random_model(yarn_cfg(KV_ARCH_LLAMA, 1.5), 66);
    path = write_gguf(m, T_F32, &dir);
    yarn_keys(path, "llama", &factor, &orig, &attn);
    cr_assert(factor == 4 && orig == 32, "factor %g orig %u", factor, orig);
    cr_assert(attn == (float)(1.5 / (1 + 0.1 * log(4.0))), "attn_factor %.9g", attn);
    remove_file(path, dir);
    kv_model_close(m);
}

/* and kvcal reads them back to the same model */
Test(ggufmodelw, yarn_round_trip) {
    const struct {
        enum kv_arch arch;
        double af;
    } rows[] = {{KV_ARCH_QWEN2, 0}, {KV_ARCH_LLAMA, 1.5}, {KV_ARCH_QWEN3, 0}};
    for (int i = 0; i < 3; i++) {
        struct kv_model *m = random_model(yarn_cfg(rows[i].arch, rows[i].af), 67 + (uint64_t)i);
        struct kv_model *back = round_trip(m);
        const struct kv_rope_scaling_cfg *s = &kv_model_config(back)->rope_scaling;
        cr_assert_eq(s->type, KV_ROPE_SCALING_YARN);
        cr_assert_eq(s->original_ctx, 32);
        double want = rows[i].af ? rows[i].af : 1 + 0.1 * log(4.0);
        cr_assert_float_eq(s->attention_factor, want, 1e-6, "attention factor %.9g", s->attention_factor);
        kv_model_close(back);
        kv_model_close(m);
    }
}

/* ---------------------------------------------------------------- the file itself */

Test(ggufmodelw, writes_the_keys_llama_cpp_reads_with_their_types) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 0);
    c.norm_eps = 1e-6f, c.vocab_size = 300;
    struct kv_model *m = random_model(c, 28);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    struct kv_gguf_file *f;
    struct kv_err e;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(f->version, 3);
    cr_assert_eq(f->alignment, 32);
    struct {
        const char *key;
        enum kv_gguf_type type;
        double v;
    } want[] = {
        {"llama.context_length", KV_GGUF_U32, 64},
        {"llama.embedding_length", KV_GGUF_U32, 48},
        {"llama.block_count", KV_GGUF_U32, 2},
        {"llama.feed_forward_length", KV_GGUF_U32, 80},
        {"llama.attention.head_count", KV_GGUF_U32, 6},
        {"llama.attention.head_count_kv", KV_GGUF_U32, 2},
        {"llama.rope.dimension_count", KV_GGUF_U32, 8},
        {"llama.rope.freq_base", KV_GGUF_F32, 10000},
        {"llama.attention.layer_norm_rms_epsilon", KV_GGUF_F32, (double)1e-6f},
        {"llama.vocab_size", KV_GGUF_U32, 300},
        {"tokenizer.ggml.bos_token_id", KV_GGUF_U32, 1},
        {"tokenizer.ggml.eos_token_id", KV_GGUF_U32, 2},
        {"tokenizer.ggml.unknown_token_id", KV_GGUF_U32, 0},
        {"tokenizer.ggml.add_bos_token", KV_GGUF_BOOL, 1},
        {"tokenizer.ggml.add_eos_token", KV_GGUF_BOOL, 0},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const struct kv_gguf_kv *kv = kv_gguf_find(f, want[i].key);
        cr_assert_not_null(kv, "no key '%s'", want[i].key);
        cr_assert_eq(kv->type, want[i].type, "key '%s' has type %s", want[i].key,
                     kv_gguf_type_name(kv->type));
        double got = kv->type == KV_GGUF_F32 ? kv->v.f : (double)kv->v.u;
        cr_assert(got == want[i].v, "key '%s' is %g, expected %g", want[i].key, got, want[i].v);
    }
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_str(f, "general.architecture", &s, &e), KV_OK);
    cr_assert(kv_gguf_str_eq(s, "llama"));
    cr_assert_eq(kv_gguf_get_str(f, "tokenizer.ggml.model", &s, &e), KV_OK);
    cr_assert(kv_gguf_str_eq(s, "llama"));
    const char *arrs[3] = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"};
    enum kv_gguf_type at[3] = {KV_GGUF_STRING, KV_GGUF_F32, KV_GGUF_I32};
    for (int i = 0; i < 3; i++) {
        const struct kv_gguf_kv *kv = kv_gguf_find(f, arrs[i]);
        cr_assert(kv && kv->type == KV_GGUF_ARRAY && kv->arr_type == at[i] && kv->arr_n == 300,
                  "key '%s'", arrs[i]);
    }
    /* names and shapes: ne[0] the input axis; output.weight as it is untied */
    cr_assert_eq(f->n_tensors, 3 + 2 * 9);
    const struct kv_gguf_tensor *t = kv_gguf_find_tensor(f, "blk.1.ffn_down.weight");
    cr_assert(t && t->n_dims == 2 && t->ne[0] == 80 && t->ne[1] == 48 && t->ggml_type == T_F32);
    t = kv_gguf_find_tensor(f, "output.weight");
    cr_assert(t && t->ne[0] == 48 && t->ne[1] == 300);
    cr_assert_not_null(kv_gguf_find_tensor(f, "blk.0.attn_norm.weight"));
    cr_assert_null(kv_gguf_find_tensor(f, "rope_freqs.weight"));
    cr_assert_null(kv_gguf_find_tensor(f, "blk.0.attn_q.bias"));
    kv_gguf_close(f);
    cr_assert_eq(kvt_tmp_left(path), 0);
    remove_file(path, dir);
    kv_model_close(m);
}

/* GGUF row r of a q/k weight of a rotate-half model: row h*hd + 2i + s
 * holds the model's row h*hd + s*hd/2 + i. */
static int64_t hf_row(int64_t r, int64_t hd) {
    int64_t j = r % hd;
    return r - j + (j % 2) * (hd / 2) + j / 2;
}

/* qwen2 row r of a q/k weight of an interleaved model: row h*hd + s*hd/2 + i
 * holds the model's row h*hd + 2i + s. */
static int64_t il_row(int64_t r, int64_t hd) {
    int64_t j = r % hd, half = hd / 2;
    return r - j + 2 * (j % half) + j / half;
}

/* The rows of w ([rows, cols]) as stored: permuted for the q/k kinds (and
 * qwen3's q/k norms) of a model whose layout is not the architecture's
 * (llama: interleaved, qwen2 and qwen3: rotate-half), then through type t
 * and back. */
static float *expected(const struct kv_config *c, enum kv_wkind k, const float *w, int64_t rows,
                       int64_t cols, uint32_t t) {
    int qk = k == KV_W_Q || k == KV_W_K || k == KV_W_BQ || k == KV_W_BK || k == KV_W_QNORM ||
             k == KV_W_KNORM;
    /* llama.cpp's qwen2 and qwen3 rotate (i, i + hd/2) */
    int half = c->arch == KV_ARCH_QWEN2 || c->arch == KV_ARCH_QWEN3;
    int perm = qk && (c->rope_layout == KV_ROPE_HALF) != half;
    float *x = malloc((size_t)(rows * cols) * sizeof *x);
    if (cols == 1 || rows == 1) { /* a 1-D tensor: f32, elements permuted */
        int64_t n = rows * cols;
        for (int64_t i = 0; i < n; i++)
            x[i] = w[!perm ? i : half ? il_row(i, c->head_dim) : hf_row(i, c->head_dim)];
        return x;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t from = !perm ? r : half ? il_row(r, c->head_dim) : hf_row(r, c->head_dim);
        memcpy(x + r * cols, w + from * cols, (size_t)cols * 4);
    }
    void *q = malloc((size_t)(rows * cols / kv_ggml_block_elems(t) * kv_ggml_block_bytes(t)));
    cr_assert_eq(kv_ggml_quant(t, x, q, rows * cols), KV_OK);
    cr_assert_eq(kv_ggml_dequant(t, q, x, rows * cols), KV_OK);
    free(q);
    return x;
}

/* Every tensor of the file decodes to expected(): bit for bit. */
static void check_stored(const struct kv_model *m, const char *path, uint32_t t) {
    const struct kv_config *c = kv_model_config(m);
    struct kv_gguf_file *f;
    struct kv_err e;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    static const struct {
        const char *name;
        enum kv_wkind kind;
    } names[] = {
        {"token_embd.weight", KV_W_TOK_EMB}, {"output_norm.weight", KV_W_OUT_NORM},
        {"output.weight", KV_W_LM_HEAD},     {"attn_norm.weight", KV_W_ATTN_NORM},
        {"attn_q.weight", KV_W_Q},           {"attn_k.weight", KV_W_K},
        {"attn_v.weight", KV_W_V},           {"attn_output.weight", KV_W_O},
        {"attn_q.bias", KV_W_BQ},            {"attn_k.bias", KV_W_BK},
        {"attn_v.bias", KV_W_BV},            {"ffn_norm.weight", KV_W_FFN_NORM},
        {"ffn_gate.weight", KV_W_GATE},      {"ffn_down.weight", KV_W_DOWN},
        {"ffn_up.weight", KV_W_UP},          {"attn_q_norm.weight", KV_W_QNORM},
        {"attn_k_norm.weight", KV_W_KNORM},
    };
    int64_t checked = 0;
    for (int64_t l = -1; l < c->n_layers; l++)
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
            enum kv_wkind k = names[i].kind;
            if ((l < 0) != (k < KV_W_FIRST_LAYER)) continue;
            if (k == KV_W_LM_HEAD && c->tied_embeddings) continue;
            if ((k == KV_W_BQ || k == KV_W_BK || k == KV_W_BV) && !c->has_qkv_bias) continue;
            if (kv_wkind_use(c, k) == KV_WUSE_NONE) continue;
            char name[128];
            if (l < 0)
                snprintf(name, sizeof name, "%s", names[i].name);
            else
                snprintf(name, sizeof name, "blk.%lld.%s", (long long)l, names[i].name);
            const struct kv_gguf_tensor *ti = kv_gguf_find_tensor(f, name);
            cr_assert_not_null(ti, "no tensor '%s'", name);
            int64_t s[2];
            int nd = kv_model_expected_shape(c, k, s);
            int64_t rows = nd == 2 ? s[0] : 1, cols = nd == 2 ? s[1] : s[0];
            cr_assert_eq(ti->n_dims, nd, "%s", name);
            cr_assert_eq(ti->ggml_type, nd == 2 ? t : T_F32, "'%s' has type %s", name,
                         kv_ggml_type_name(ti->ggml_type));
            cr_assert(ti->ne[0] == cols && (nd == 1 || ti->ne[1] == rows), "%s", name);
            float *got = malloc((size_t)(rows * cols) * sizeof *got);
            cr_assert_eq(kv_ggml_dequant(ti->ggml_type, ti->t.data, got, rows * cols), KV_OK);
            float *want = expected(c, k, kv_model_weight(m, k, l < 0 ? 0 : l), rows, cols, t);
            for (int64_t j = 0; j < rows * cols; j++)
                cr_assert(memcmp(&got[j], &want[j], 4) == 0,
                          "'%s' element %lld (row %lld): stored %.9g, expected %.9g", name,
                          (long long)j, (long long)(j / cols), got[j], want[j]);
            free(got), free(want);
            checked++;
        }
    cr_assert_eq(checked, f->n_tensors, "%lld of %lld tensors checked", (long long)checked,
                 (long long)f->n_tensors);
    kv_gguf_close(f);
}

/* A model whose every row is a whole number of K-quant super-blocks. */
static struct kv_config block_cfg(enum kv_rope_layout layout, int bias, int tied) {
    struct kv_config c = tiny_cfg(layout, bias, tied);
    c.dim = 256, c.hidden_dim = 512, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 64;
    c.vocab_size = 300;
    return c;
}

static void stored_as(struct kv_config c, uint32_t t, uint64_t seed) {
    struct kv_model *m = random_model(c, seed);
    char *dir, *path = write_gguf(m, t, &dir);
    check_stored(m, path, t);
    remove_file(path, dir);
    kv_model_close(m);
}

Test(ggufmodelw, f16_and_bf16_matrices_are_the_rounded_weights) {
    stored_as(tiny_cfg(KV_ROPE_HALF, 1, 0), T_F16, 31);
    stored_as(tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1), T_BF16, 32);
}

Test(ggufmodelw, f16_read_back_by_the_loader_is_the_rounded_model) {
    /* kvcal loads F16 itself: its weights are the f16 roundings, permuted */
    struct kv_model *m = random_model(tiny_cfg(KV_ROPE_HALF, 1, 0), 33);
    char *dir, *path = write_gguf(m, T_F16, &dir);
    struct kv_model *back = open_model(path);
    const struct kv_config *c = kv_model_config(m);
    int64_t s[2];
    for (int k = KV_W_Q; k <= KV_W_BK; k++) {
        if (k == KV_W_V || k == KV_W_O) continue;
        int nd = kv_model_expected_shape(c, k, s);
        int64_t rows = nd == 2 ? s[0] : 1, cols = nd == 2 ? s[1] : s[0];
        float *want = expected(c, k, kv_model_weight(m, k, 1), rows, cols, T_F16);
        if (nd == 1) /* biases stay f32 */
            cr_assert(memcmp(kv_model_weight(back, k, 1), want, (size_t)cols * 4) == 0, "%s",
                      kv_wkind_name(k));
        else
            cr_assert(memcmp(kv_model_weight(back, k, 1), want, (size_t)(rows * cols) * 4) == 0,
                      "%s", kv_wkind_name(k));
        free(want);
    }
    kv_model_close(back);
    remove_file(path, dir);
    kv_model_close(m);
}

Test(ggufmodelw, q8_0_matrices_are_the_encoded_weights) {
    stored_as(block_cfg(KV_ROPE_HALF, 1, 0), T_Q8_0, 34);
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1); /* rows of 64 and 96: two and three blocks */
    c.dim = 64, c.hidden_dim = 96, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16;
    stored_as(c, T_Q8_0, 35);
}

Test(ggufmodelw, q4_k_matrices_are_the_encoded_weights) {
    stored_as(block_cfg(KV_ROPE_HALF, 1, 1), T_Q4_K, 36);
}

Test(ggufmodelw, other_block_types_are_the_encoded_weights) {
    stored_as(block_cfg(KV_ROPE_INTERLEAVED, 0, 0), T_Q6_K, 37);
    stored_as(block_cfg(KV_ROPE_HALF, 0, 1), T_Q4_0, 38);
}

/* ---------------------------------------------------------------- vocabularies */

/* The tokenizer kvcal reads from path's vocabulary. */
static struct kv_tokenizer *read_tok(const char *path) {
    struct kv_tokenizer *t;
    struct kv_err e;
    cr_assert_eq(kv_gguf_load_tokenizer(path, &t, &e), KV_OK, "%s", e.msg);
    return t;
}

static void expect_piece(const struct kv_tokenizer *t, int32_t id, const char *s, int type) {
    size_t n;
    const char *p = kv_tok_piece(t, id, &n);
    cr_assert(p && n == strlen(s) && !memcmp(p, s, n), "piece %d is '%.*s', expected '%s'", id,
              (int)n, p ? p : "", s);
    cr_assert_eq(kv_tok_type(t, id), type, "piece %d has type %d", id, kv_tok_type(t, id));
}

Test(ggufmodelw, synthetic_vocabulary_without_a_tokenizer) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    c.vocab_size = 300;
    struct kv_model *m = random_model(c, 41);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    struct kv_tokenizer *t = read_tok(path);
    cr_assert_eq(kv_tok_n_vocab(t), 300);
    cr_assert_eq(kv_tok_bos(t), 1);
    cr_assert_eq(kv_tok_eos(t), 2);
    expect_piece(t, 0, "<unk>", KV_TOKT_UNKNOWN);
    expect_piece(t, 1, "<s>", KV_TOKT_CONTROL);
    expect_piece(t, 2, "</s>", KV_TOKT_CONTROL);
    expect_piece(t, 3, "<0x00>", KV_TOKT_BYTE);
    expect_piece(t, 3 + 0x0A, "<0x0A>", KV_TOKT_BYTE);
    expect_piece(t, 258, "<0xFF>", KV_TOKT_BYTE);
    expect_piece(t, 259, "t259", KV_TOKT_NORMAL);
    expect_piece(t, 299, "t299", KV_TOKT_NORMAL);
    cr_assert(kv_tok_score(t, 299) == -299.0f);
    /* every byte decodes to itself */
    for (int b = 0; b < 256; b++) {
        char out[4];
        cr_assert_eq(kv_tok_decode(t, 5, 3 + b, out, sizeof out), 1);
        cr_assert_eq((uint8_t)out[0], b);
    }
    kv_tok_free(t);
    remove_file(path, dir);
    kv_model_close(m);
}

Test(ggufmodelw, synthetic_small_vocabulary_is_byte_level_and_follows_the_config_ids) {
    /* 97 ids leave no room for 256 byte pieces: llama.cpp's SentencePiece
     * tokenizer would abort on the bytes it lacks, its BPE one skips them */
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    c.bos_id = 5, c.eos_id = 0;
    struct kv_model *m = random_model(c, 42);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    struct kv_gguf_file *f;
    struct kv_err e;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_str(f, "tokenizer.ggml.model", &s, &e), KV_OK);
    cr_assert(kv_gguf_str_eq(s, "gpt2"));
    cr_assert_null(kv_gguf_find(f, "tokenizer.ggml.unknown_token_id")); /* 0 is taken */
    struct kv_gguf_str *toks;
    uint64_t nt;
    cr_assert_eq(kv_gguf_get_arr_str(f, "tokenizer.ggml.tokens", &toks, &nt, &e), KV_OK);
    cr_assert_eq(nt, 97);
    cr_assert(kv_gguf_str_eq(toks[1], "\xc4\x80")); /* byte 0 is U+0100 */
    cr_assert(kv_gguf_str_eq(toks[6], "\xc4\x84")); /* byte 4 */
    cr_assert(kv_gguf_str_eq(toks[67], "A"));        /* byte 0x41 */
    free(toks);
    kv_gguf_close(f);
    struct kv_tokenizer *t = read_tok(path);
    cr_assert_eq(kv_tok_n_vocab(t), 97);
    cr_assert_eq(kv_tok_bos(t), 5);
    cr_assert_eq(kv_tok_eos(t), 0);
    expect_piece(t, 0, "</s>", KV_TOKT_CONTROL);
    expect_piece(t, 5, "<s>", KV_TOKT_CONTROL);
    for (int32_t id = 1; id < 97; id++) {
        if (id == 5) continue;
        int b = id < 5 ? id - 1 : id - 2;
        size_t n;
        const char *p = kv_tok_piece(t, id, &n);
        cr_assert(n == 1 && (uint8_t)p[0] == b, "piece %d is not the byte %d", id, b);
    }
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(t, "A0\n", 3, 0, &ids, &n, &e), KV_OK, "%s", e.msg);
    cr_assert(n == 3 && ids[0] == 67 && ids[1] == 50 && ids[2] == 12);
    free(ids);
    kv_tok_free(t);
    remove_file(path, dir);
    kv_model_close(m);
}

/* A llama2.c-style SentencePiece tokenizer (spaces stored as ' ', dummy
 * prefix), n_extra unused ids short of the model's vocabulary. */
static const char *const SP_PIECES[] = {" ", "a", "b", "c", "h", "i", " a", "ab", " ab", "hi", " hi", "abc"};
#define N_SP (3 + 256 + (int)(sizeof SP_PIECES / sizeof SP_PIECES[0]))

static struct kv_tokenizer *sp_tokenizer(const char *dup) {
    struct kv_tokenizer *t;
    struct kv_err e;
    cr_assert_eq(kv_tok_init(KV_TOK_SCORE, N_SP, &t, &e), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 0, "<unk>", 5, 0, KV_TOKT_UNKNOWN, &e), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 1, "<s>", 3, 0, KV_TOKT_CONTROL, &e), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 2, "</s>", 4, 0, KV_TOKT_CONTROL, &e), KV_OK);
    for (int b = 0; b < 256; b++) {
        char p[8];
        snprintf(p, sizeof p, "<0x%02X>", b);
        cr_assert_eq(kv_tok_set_piece(t, 3 + b, p, 6, 0, KV_TOKT_BYTE, &e), KV_OK);
    }
    for (int i = 0; i < N_SP - 259; i++) {
        const char *p = dup && i == N_SP - 260 ? dup : SP_PIECES[i];
        cr_assert_eq(kv_tok_set_piece(t, 259 + i, p, strlen(p), (float)(-i), KV_TOKT_NORMAL, &e),
                     KV_OK);
    }
    kv_tok_set_special(t, 1, 2, 0);
    cr_assert_eq(kv_tok_set_normalizer(t, " ", 1, &e), KV_OK);
    cr_assert_eq(kv_tok_finish(t, "test", &e), KV_OK, "%s", e.msg);
    return t;
}

static int32_t *encode(const struct kv_tokenizer *t, const char *s, int64_t *n) {
    int32_t *ids;
    struct kv_err e;
    cr_assert_eq(kv_tok_encode(t, s, strlen(s), KV_TOK_ADD_BOS, &ids, n, &e), KV_OK, "%s", e.msg);
    return ids;
}

Test(ggufmodelw, sentencepiece_tokenizer_is_written_with_u2581_spaces) {
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    c.vocab_size = N_SP + 3; /* three ids the tokenizer lacks */
    struct kv_model *m = random_model(c, 43);
    m->tok = sp_tokenizer(NULL);
    char *dir, *path = write_gguf(m, T_F32, &dir);
    struct kv_tokenizer *t = read_tok(path);
    cr_assert_eq(kv_tok_n_vocab(t), N_SP + 3);
    expect_piece(t, 259, "\xe2\x96\x81", KV_TOKT_NORMAL);
    expect_piece(t, 265, "\xe2\x96\x81" "a", KV_TOKT_NORMAL);
    expect_piece(t, 269, "\xe2\x96\x81" "hi", KV_TOKT_NORMAL);
    expect_piece(t, 100, "<0x61>", KV_TOKT_BYTE);
    expect_piece(t, N_SP, "[PAD271]", KV_TOKT_UNUSED);
    expect_piece(t, N_SP + 2, "[PAD273]", KV_TOKT_UNUSED);
    for (int32_t i = 0; i < N_SP; i++)
        cr_assert(kv_tok_score(t, i) == kv_tok_score(m->tok, i), "score of %d", i);
    /* the same ids and the same text back */
    const char *texts[] = {"hi abc ab a", " hi  hi\nxyz", "abcabc hi"};
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        int64_t na, nb;
        int32_t *a = encode(m->tok, texts[k], &na), *b = encode(t, texts[k], &nb);
        cr_assert(na == nb && !memcmp(a, b, (size_t)na * sizeof *a), "'%s' encodes differently",
                  texts[k]);
        char da[256], db[256];
        size_t oa = 0, ob = 0;
        for (int64_t i = 0; i < na; i++) {
            oa += kv_tok_decode(m->tok, i ? a[i - 1] : -1, a[i], da + oa, sizeof da - oa);
            ob += kv_tok_decode(t, i ? b[i - 1] : -1, b[i], db + ob, sizeof db - ob);
        }
        cr_assert(oa == ob && !memcmp(da, db, oa) && oa == strlen(texts[k]) &&
                      !memcmp(da, texts[k], oa),
                  "'%s' decodes to '%.*s' and '%.*s'", texts[k], (int)oa, da, (int)ob, db);
        free(a), free(b);
    }
    struct kv_gguf_file *f;
    struct kv_err e;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    int v;
    cr_assert_eq(kv_gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", &v, &e), KV_OK);
    cr_assert_eq(v, 1);
    kv_gguf_close(f);
    kv_tok_free(t);
    remove_file(path, dir);
    kv_model_close(m);
}

Test(ggufmodelw, byte_level_tokenizer_is_written_as_gpt2_without_merges) {
    /* raw pieces: the 256 bytes, then "ab", " a", "hello"; merges a+b, ' '+a */
    static const char *extra[] = {"ab", " a"};
    const char *pieces[258];
    size_t plen[258];
    char bytes[256];
    for (int b = 0; b < 256; b++) bytes[b] = (char)b, pieces[b] = &bytes[b], plen[b] = 1;
    pieces[256] = extra[0], plen[256] = 2;
    pieces[257] = extra[1], plen[257] = 2;
    int32_t merges[4] = {'a', 'b', ' ', 'a'};
    char *dir0 = kvt_temp_dir(), *tj = kvt_path(dir0, "tokenizer.json");
    struct kv_err e;
    cr_assert_eq(kv_hf_write_bpe_tokenizer(tj, pieces, plen, 258, merges, 2, NULL, &e), KV_OK,
                 "%s", e.msg);
    struct kv_tokenizer *orig;
    cr_assert_eq(kv_tok_open(tj, &orig, &e), KV_OK, "%s", e.msg);
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c.vocab_size = kv_tok_n_vocab(orig); /* 258 + 2 specials */
    c.bos_id = kv_tok_bos(orig), c.eos_id = kv_tok_eos(orig);
    struct kv_model *m = random_model(c, 44);
    m->tok = orig;
    char *dir, *path = write_gguf(m, T_F32, &dir);
    struct kv_gguf_file *f;
    cr_assert_eq(kv_gguf_open(path, &f, &e), KV_OK, "%s", e.msg);
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_str(f, "tokenizer.ggml.model", &s, &e), KV_OK);
    cr_assert(kv_gguf_str_eq(s, "gpt2"));
    const struct kv_gguf_kv *mk = kv_gguf_find(f, "tokenizer.ggml.merges");
    cr_assert(mk && mk->type == KV_GGUF_ARRAY && mk->arr_type == KV_GGUF_STRING && mk->arr_n == 0);
    struct kv_gguf_str *toks;
    uint64_t nt;
    cr_assert_eq(kv_gguf_get_arr_str(f, "tokenizer.ggml.tokens", &toks, &nt, &e), KV_OK);
    cr_assert(kv_gguf_str_eq(toks[' '], "\xc4\xa0"));   /* ' ' is U+0120 */
    cr_assert(kv_gguf_str_eq(toks['\n'], "\xc4\x8a"));  /* '\n' is U+010A */
    cr_assert(kv_gguf_str_eq(toks[257], "\xc4\xa0" "a"));
    cr_assert(kv_gguf_str_eq(toks[258], "<|begin_of_text|>")); /* control: text as it is */
    free(toks);
    kv_gguf_close(f);
    /* every id decodes to its bytes; text encodes one byte per token */
    struct kv_tokenizer *t = read_tok(path);
    for (int32_t i = 0; i < kv_tok_n_vocab(orig); i++) {
        char a[64], b[64];
        size_t na = kv_tok_decode(orig, 7, i, a, sizeof a), nb = kv_tok_decode(t, 7, i, b, sizeof b);
        cr_assert(na == nb && !memcmp(a, b, na), "id %d decodes to '%.*s', wrote '%.*s'", i,
                  (int)nb, b, (int)na, a);
    }
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(t, "ab a", 4, 0, &ids, &n, &e), KV_OK, "%s", e.msg);
    cr_assert(n == 4 && ids[0] == 'a' && ids[1] == 'b' && ids[2] == ' ' && ids[3] == 'a');
    free(ids);
    kv_tok_free(t);
    remove_file(path, dir);
    unlink(tj), free(tj), kvt_rm_dir(dir0);
    kv_model_close(m);
}

/* ---------------------------------------------------------------- refusals */

/* Writing m with type t fails with code and exactly msg; no file, no temporary. */
static void refused(const struct kv_model *m, uint32_t t, int code, const char *msg) {
    char *dir = kvt_temp_dir(), *path = kvt_path(dir, "m.gguf");
    struct kv_gguf_write_opts o = {.matrix_type = t};
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_gguf_write_model(m, path, &o, &e), code, "code %s: %s",
                 kv_status_name(e.code), e.msg);
    cr_assert_str_eq(e.msg, msg);
    cr_assert_str_eq(e.path, path);
    cr_assert_neq(access(path, F_OK), 0, "a file was written");
    cr_assert_eq(kvt_tmp_left(path), 0);
    free(path);
    kvt_rm_dir(dir);
}

Test(ggufmodelw, refuses_matrix_types_it_cannot_encode) {
    struct kv_model *m = random_model(tiny_cfg(KV_ROPE_HALF, 0, 1), 51);
    refused(m, 99, KV_EINVAL,
            "matrix type 99 (unknown) is not one kvcal can write; expected F32, F16, BF16, Q4_0, "
            "Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K");
    refused(m, 28, KV_EINVAL,
            "matrix type 28 (F64) is not one kvcal can write; expected F32, F16, BF16, Q4_0, "
            "Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K");
    kv_model_close(m);
}

Test(ggufmodelw, refuses_rows_that_are_not_whole_blocks) {
    struct kv_model *m = random_model(tiny_cfg(KV_ROPE_HALF, 0, 1), 52);
    refused(m, T_Q4_K, KV_EINVAL,
            "tensor 'token_embd.weight' of shape [97, 48] has rows of 48 elements, not a whole "
            "number of Q4_K blocks of 256");
    kv_model_close(m);
    /* every row but ffn_down's (hidden 80) is 256 long */
    struct kv_config c = block_cfg(KV_ROPE_HALF, 0, 1);
    c.hidden_dim = 80;
    m = random_model(c, 53);
    refused(m, T_Q4_K, KV_EINVAL,
            "tensor 'blk.0.ffn_down.weight' of shape [256, 80] has rows of 80 elements, not a "
            "whole number of Q4_K blocks of 256");
    refused(m, T_Q8_0, KV_EINVAL,
            "tensor 'blk.0.ffn_down.weight' of shape [256, 80] has rows of 80 elements, not a "
            "whole number of Q8_0 blocks of 32");
    kv_model_close(m);
}

Test(ggufmodelw, refuses_non_finite_weights_for_block_types) {
    struct kv_model *m = random_model(block_cfg(KV_ROPE_HALF, 0, 1), 54);
    kv_model_weight_mut(m, KV_W_UP, 1)[3 * 256 + 7] = NAN;
    refused(m, T_Q8_0, KV_ENUMERIC,
            "tensor 'blk.1.ffn_up.weight' holds nan at row 3, column 7; Q8_0 needs finite weights");
    kv_model_close(m);
}

Test(ggufmodelw, refuses_rope_scalings_gguf_cannot_hold_yet) {
    /* llama.cpp's yarn: beta_fast 32, beta_slow 1, whole correction dims */
    struct kv_config c = yarn_cfg(KV_ARCH_LLAMA, 0);
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->beta_fast = 16;
    struct kv_model *m = random_model(c, 55);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "rope scaling 'yarn' with beta_fast 16 and beta_slow 1 cannot be written to gguf "
            "'llama'; llama.cpp uses 32 and 1 there");
    kv_model_close(m);
    s->beta_fast = 32, s->truncate = 0;
    m = random_model(c, 55);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "rope scaling 'yarn' with truncate false cannot be written to gguf 'llama'; "
            "llama.cpp rounds the correction range to whole dimensions");
    kv_model_close(m);
    memset(s, 0, sizeof *s);
    s->type = KV_ROPE_SCALING_DYNAMIC, s->factor = 2, s->original_ctx = 32;
    m = random_model(c, 56);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "rope scaling 'dynamic' cannot be written to gguf 'llama' yet; kvcal writes default, "
            "linear, yarn, llama3 and per-pair divisors (rope_freqs.weight)");
    kv_model_close(m);
    /* qwen2 has no rope_freqs.weight in llama.cpp */
    struct kv_config q = qwen2_cfg(KV_ROPE_HALF);
    q.head_dim = 16, q.n_heads = 3, q.n_kv_heads = 1;
    q.rope_theta = 500000.0f;
    s = &q.rope_scaling;
    s->type = KV_ROPE_SCALING_LLAMA3, s->factor = 8, s->low_freq_factor = 1;
    s->high_freq_factor = 4, s->original_ctx = 64;
    m = random_model(q, 57);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "rope scaling 'llama3' cannot be written to gguf 'qwen2' yet; kvcal writes default, "
            "linear and yarn (llama.cpp reads no rope_freqs.weight for it)");
    kv_model_close(m);
}

Test(ggufmodelw, refuses_sliding_windows) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 0);
    c.arch = KV_ARCH_MISTRAL, c.sliding_window = 4096, c.window_period = 1;
    struct kv_model *m = random_model(c, 67);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "sliding window of 4096 positions cannot be written to gguf 'llama': neither kvcal "
            "nor llama.cpp reads a window key there, so the file would attend to every earlier "
            "position");
    kv_model_close(m);
    /* Qwen2 windows only some layers, and only 32 positions here */
    c = qwen2_cfg(KV_ROPE_HALF);
    c.sliding_window = 32, c.window_from = 1, c.window_period = 1;
    m = random_model(c, 68);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "sliding window of 32 positions cannot be written to gguf 'qwen2': neither kvcal "
            "nor llama.cpp reads a window key there, so the file would attend to every earlier "
            "position");
    kv_model_close(m);
}

Test(ggufmodelw, refuses_qwen2_heads_that_do_not_add_up_to_dim) {
    struct kv_config c = qwen2_cfg(KV_ROPE_HALF);
    c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16; /* 64 != 48 */
    struct kv_model *m = random_model(c, 69);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "n_heads * head_dim is 4 * 16 = 64 but dim is 48; llama.cpp's 'qwen2' needs them "
            "equal");
    kv_model_close(m);
}

Test(ggufmodelw, refuses_architectures_without_a_gguf_row) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPT2;
    c.dim = 32, c.hidden_dim = 128, c.n_layers = 1, c.n_heads = 4, c.n_kv_heads = 4;
    c.head_dim = 8, c.vocab_size = 50, c.max_seq_len = 16, c.norm_eps = 1e-5f;
    c.tied_embeddings = 1, c.has_qkv_bias = 1, c.bos_id = c.eos_id = -1;
    struct kv_model *m;
    struct kv_err e;
    cr_assert_eq(kv_model_init_random(&c, 57, &m, &e), KV_OK, "%s", e.msg);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "architecture 'gpt2' cannot be written to gguf yet; kvcal writes 'llama', "
            "'mistral', 'qwen2', 'qwen3', 'gpt_neox', 'phi3' and 'gemma2'");
    kv_model_close(m);
}

Test(ggufmodelw, refuses_tokenizers_llama_cpp_cannot_load) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c.vocab_size = N_SP;
    struct kv_model *m = random_model(c, 58);
    m->tok = sp_tokenizer(" hi"); /* the last piece repeats " hi" (id 269) */
    refused(m, T_F32, KV_EINVAL,
            "tokenizer pieces 269 and 270 are both '\\xe2\\x96\\x81hi'; llama.cpp needs every "
            "piece to be distinct");
    kv_model_close(m);
    c.vocab_size = N_SP - 1;
    m = random_model(c, 59);
    m->tok = sp_tokenizer(NULL);
    refused(m, T_F32, KV_EINVAL,
            "tokenizer has 271 pieces but the model's vocabulary has 270 rows; llama.cpp needs "
            "one piece per row");
    kv_model_close(m);
}

/* Phi-3 as llama.cpp's phi3 stores it: q, k, v stacked in attn_qkv, gate
 * and up in ffn_up, longrope as two factor tensors and its keys. Reading
 * the file back gives the same weights, the same scaling and the same
 * logits; a sliding window is refused (llama.cpp ignores its key). */
Test(ggufmodelw, phi3_round_trip_with_longrope) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 0);
    c.arch = KV_ARCH_PHI3, c.n_kv_heads = c.n_heads;
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = KV_ROPE_SCALING_LONGROPE, s->factor = 4, s->original_ctx = 64;
    s->n_factors = c.head_dim / 2;
    for (int64_t i = 0; i < s->n_factors; i++)
        s->short_factor[i] = 1.0f + 0.25f * (float)i, s->long_factor[i] = 2.0f + (float)i;
    c.max_seq_len = 256; /* factor 4 = 256 / 64, as the reader derives it */
    struct kv_model *m, *r;
    struct kv_err e = {0};
    cr_assert_eq(kv_model_init_random(&c, 91, &m, &e), KV_OK, "%s", e.msg);
    char *path = kvt_write_temp("", 0, ".gguf");
    cr_assert_eq(kv_gguf_write_model(m, path, NULL, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_gguf_load(path, &r, &e), KV_OK, "%s", e.msg);
    const struct kv_config *rc = kv_model_config(r);
    cr_assert(rc->arch == KV_ARCH_PHI3 && rc->rope_scaling.type == KV_ROPE_SCALING_LONGROPE &&
              rc->rope_scaling.original_ctx == 64 && rc->rope_scaling.factor == 4 &&
              rc->rope_scaling.n_factors == c.head_dim / 2);
    for (int64_t i = 0; i < s->n_factors; i++)
        cr_assert(rc->rope_scaling.short_factor[i] == s->short_factor[i] &&
                  rc->rope_scaling.long_factor[i] == s->long_factor[i], "factor %lld", (long long)i);
    for (int k = 0; k < KV_W_COUNT; k++)
        for (int64_t l = 0; l < (k < KV_W_FIRST_LAYER ? 1 : c.n_layers); l++) {
            const float *a = kv_model_weight(m, (enum kv_wkind)k, l), *b = kv_model_weight(r, (enum kv_wkind)k, l);
            cr_assert(!a == !b, "%s of layer %lld", kv_wkind_name((enum kv_wkind)k), (long long)l);
            int64_t sh[2];
            int nd = kv_model_expected_shape(&c, (enum kv_wkind)k, sh);
            if (a) cr_assert(!memcmp(a, b, (size_t)(nd == 2 ? sh[0] * sh[1] : sh[0]) * sizeof *a),
                             "%s of layer %lld differs", kv_wkind_name((enum kv_wkind)k), (long long)l);
        }
    /* the short factors and the attention factor (sqrt(1 + ln 4 / ln 64)), in both */
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (i * 7 + 3) % (int32_t)c.vocab_size;
    float *la = malloc(40 * (size_t)c.vocab_size * sizeof *la), *lb = malloc(40 * (size_t)c.vocab_size * sizeof *lb);
    struct kv_fwd *f;
    cr_assert_eq(kv_fwd_init(m, 40, &f, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_fwd_run(f, tok, 40, 0, la, &e), KV_OK, "%s", e.msg);
    kv_fwd_free(f);
    cr_assert_eq(kv_fwd_init(r, 40, &f, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_fwd_run(f, tok, 40, 0, lb, &e), KV_OK, "%s", e.msg);
    kv_fwd_free(f);
    /* the file holds the attention factor as f32, the source computes it in double */
    kvt_assert_close_f32(lb, la, 40 * c.vocab_size, 1e-5, 1e-5, "phi3 logits read back");
    free(la), free(lb);
    kv_model_close(r);
    kv_model_close(m);
    c.rope_scaling.type = KV_ROPE_SCALING_NONE, c.sliding_window = 8, c.window_period = 1;
    cr_assert_eq(kv_model_init_random(&c, 91, &m, &e), KV_OK, "%s", e.msg);
    refused(m, T_F32, KV_EUNSUPPORTED,
            "sliding window of 8 positions cannot be written to gguf 'phi3': llama.cpp reads "
            "phi3.attention.sliding_window but attends to every earlier position (measured), so "
            "the file would be another model there");
    kv_model_close(m);
    unlink(path);
    free(path);
}

/* phi3's longrope, corrupted: a factor tensor renamed away, and a
 * non-finite attention factor (named with its offset). */
Test(ggufmodelw, phi3_corrupt_longrope_is_refused) {
    struct kv_config c = tiny_cfg(KV_ROPE_HALF, 0, 0);
    c.arch = KV_ARCH_PHI3, c.n_kv_heads = c.n_heads, c.max_seq_len = 256;
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = KV_ROPE_SCALING_LONGROPE, s->factor = 4, s->original_ctx = 64;
    s->n_factors = c.head_dim / 2;
    for (int64_t i = 0; i < s->n_factors; i++) s->short_factor[i] = 1.0f, s->long_factor[i] = 2.0f;
    struct kv_model *m, *r;
    struct kv_err e = {0};
    cr_assert_eq(kv_model_init_random(&c, 91, &m, &e), KV_OK, "%s", e.msg);
    uint64_t off;
    float nan_f = NAN;
    char *p = patched_gguf(m, "phi3.rope.scaling.attn_factor", &nan_f, 4, &off);
    refused_at(p, off, "phi3.rope.scaling.attn_factor is nan, expected a positive factor");
    /* the same file with the long factors' tensor renamed */
    size_t len;
    char *b = kvt_read_file(p, &len);
    char *hit = memmem(b, len, "rope_factors_long.weight", 24);
    cr_assert_not_null(hit);
    hit[17] = 'G';
    char *q = kvt_write_temp(b, len, ".gguf");
    cr_assert_neq(kv_model_open(q, NULL, &r, &e), KV_OK);
    cr_assert(strstr(e.msg, "missing tensor 'rope_factors_long.weight' (phi3's longrope needs both "
                            "factor tensors)"),
              "%s", e.msg);
    unlink(p), unlink(q);
    free(p), free(q), free(b);
    kv_model_close(m);
}
