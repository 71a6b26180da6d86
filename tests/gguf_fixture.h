/* A small valid GGUF written byte by byte, shared by the container suite
 * (test_gguf.c) and the llama-mapping suite (test_ggufmodel.c): the tiny llama
 * (dim 32, 1 layer, 4 heads, 2 kv heads, vocab 16) with F32, F16, BF16 or
 * Q4_0 tensors and, optionally, a 16-piece "llama" vocabulary. */
#ifndef KV_GGUF_FIXTURE_H
#define KV_GGUF_FIXTURE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggmlquant.h"
#include "testutil.h"

/* Capacity of the fixture, and the ggml types its writer knows. */
#define MAXKV 16
#define MAXT 16
#define T_F32 0u
#define T_F16 1u
#define T_Q4_0 2u
#define T_Q8_0 8u
#define T_Q8_1 9u
#define T_BF16 30u

/* The bytes written so far and where each field of each pair and tensor info
 * starts (absolute offsets), so tests patch and look up by field. */
struct fx {
    uint8_t *p;
    size_t len, cap;
    int nkv, nt;
    size_t key_off[MAXKV], type_off[MAXKV], val_off[MAXKV];
    const char *key[MAXKV];
    size_t t_info[MAXT], t_nd[MAXT], t_dims[MAXT], t_type[MAXT], t_off[MAXT];
    uint64_t t_rel[MAXT], t_bytes[MAXT], t_ne[MAXT][4];
    uint32_t t_gtype[MAXT];
    int t_ndim[MAXT];
    const char *t_name[MAXT];
    size_t header_end, data_off;
};

/* Append bytes, little-endian integers, a float32 or a length-prefixed string;
 * set_* overwrite in place. */
static inline void put(struct fx *f, const void *b, size_t n) {
    if (f->len + n > f->cap) {
        f->cap = (f->len + n) * 2 + 256;
        f->p = realloc(f->p, f->cap);
        cr_assert(f->p);
    }
    memcpy(f->p + f->len, b, n);
    f->len += n;
}
static inline void put_u32(struct fx *f, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put(f, b, 4);
}
static inline void put_u64(struct fx *f, uint64_t v) {
    put_u32(f, (uint32_t)v);
    put_u32(f, (uint32_t)(v >> 32));
}
static inline void put_f32(struct fx *f, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    put_u32(f, u);
}
static inline void put_str(struct fx *f, const char *s) {
    put_u64(f, strlen(s));
    put(f, s, strlen(s));
}
static inline void set_u32(struct fx *f, size_t off, uint32_t v) {
    for (int i = 0; i < 4; i++) f->p[off + i] = (uint8_t)(v >> (8 * i));
}
static inline void set_u64(struct fx *f, size_t off, uint64_t v) {
    for (int i = 0; i < 8; i++) f->p[off + i] = (uint8_t)(v >> (8 * i));
}

/* Start pair i: key and value type; the caller appends the value. */
static inline int kv_begin(struct fx *f, const char *key, uint32_t type) {
    int i = f->nkv++;
    cr_assert(i < MAXKV);
    f->key[i] = key;
    f->key_off[i] = f->len;
    put_str(f, key);
    f->type_off[i] = f->len;
    put_u32(f, type);
    f->val_off[i] = f->len;
    return i;
}

/* A tensor of the tiny llama: name and ne (innermost first). */
struct tspec {
    const char *name;
    int nd;
    uint64_t ne[4];
};

/* The tiny llama: dim 32, hidden 64, 1 layer, 4 heads, 2 kv heads, vocab 16. */
static const struct tspec tiny[] = {
    {"token_embd.weight", 2, {32, 16}},
    {"output_norm.weight", 1, {32}},
    {"blk.0.attn_norm.weight", 1, {32}},
    {"blk.0.attn_q.weight", 2, {32, 32}},
    {"blk.0.attn_k.weight", 2, {32, 16}},
    {"blk.0.attn_v.weight", 2, {32, 16}},
    {"blk.0.attn_output.weight", 2, {32, 32}},
    {"blk.0.ffn_norm.weight", 1, {32}},
    {"blk.0.ffn_gate.weight", 2, {32, 64}},
    {"blk.0.ffn_down.weight", 2, {64, 32}},
    {"blk.0.ffn_up.weight", 2, {32, 64}},
};
#define N_TINY ((int)(sizeof tiny / sizeof tiny[0]))
enum { T_EMB = 0, T_ONORM, T_ANORM, T_Q, T_K, T_V, T_O, T_FNORM, T_GATE, T_DOWN, T_UP };

/* Value of element i of tensor t: exactly representable in f16 and bf16. */
static inline float tval(int t, uint64_t i) {
    return (float)((int)((i + 7 * (uint64_t)t) % 61) - 30) / 32.0f;
}

/* f16 and bf16 bits of a value of tval. */
static inline uint16_t f32_to_f16_exact(float x) { /* only for values of tval (k/32, |k| <= 30) */
    if (x == 0) return 0;
    uint16_t sign = x < 0 ? 0x8000 : 0;
    float a = fabsf(x);
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int exp = e - 1 + 15;
    uint16_t man = (uint16_t)lrintf((m * 2 - 1) * 1024);
    return (uint16_t)(sign | exp << 10 | man);
}
static inline uint16_t f32_to_bf16_exact(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(u >> 16);
}

/* Tensor byte size for the types the writer knows. */
static inline uint64_t tbytes(const struct tspec *s, uint32_t type) {
    uint64_t n = 1;
    for (int d = 0; d < s->nd; d++) n *= s->ne[d];
    switch (type) {
    case T_F32: return n * 4;
    case T_F16:
    case T_BF16: return n * 2;
    case T_Q4_0: return n / 32 * 18;
    case T_Q8_0: return n / 32 * 34;
    case T_Q8_1: return n / 32 * 36;
    }
    cr_assert_fail("writer does not know type %u", type);
    return 0;
}

/* Build the tiny model; types[i] overrides tensor i's type when non-NULL.
 * with_tokenizer adds a 16-piece "llama" vocabulary. */
static inline void build(struct fx *f, const uint32_t *types, int with_tokenizer) {
    memset(f, 0, sizeof *f);
    put(f, "GGUF", 4);
    put_u32(f, 3);
    put_u64(f, N_TINY);
    put_u64(f, 0); /* patched below */
    kv_begin(f, "general.architecture", 8);
    put_str(f, "llama");
    kv_begin(f, "general.alignment", 4);
    put_u32(f, 32);
    kv_begin(f, "llama.embedding_length", 4);
    put_u32(f, 32);
    kv_begin(f, "llama.feed_forward_length", 4);
    put_u32(f, 64);
    kv_begin(f, "llama.block_count", 4);
    put_u32(f, 1);
    kv_begin(f, "llama.attention.head_count", 4);
    put_u32(f, 4);
    kv_begin(f, "llama.attention.head_count_kv", 4);
    put_u32(f, 2);
    kv_begin(f, "llama.context_length", 4);
    put_u32(f, 128);
    kv_begin(f, "llama.attention.layer_norm_rms_epsilon", 6);
    put_f32(f, 1e-6f);
    kv_begin(f, "test.a", 5);
    put_u32(f, (uint32_t)-7);
    kv_begin(f, "test.b", 5);
    put_u32(f, 7);
    kv_begin(f, "general.tags", 9);
    put_u32(f, 8);
    put_u64(f, 2);
    put_str(f, "a");
    put_str(f, "bc");
    kv_begin(f, "test.floats", 9);
    put_u32(f, 6);
    put_u64(f, 3);
    put_f32(f, 1.5f);
    put_f32(f, -2.0f);
    put_f32(f, 3.25f);
    if (with_tokenizer) {
        kv_begin(f, "tokenizer.ggml.model", 8);
        put_str(f, "llama");
        kv_begin(f, "tokenizer.ggml.tokens", 9);
        put_u32(f, 8);
        put_u64(f, 16);
        const char *pieces[16] = {"<unk>", "<s>", "</s>", "<0x41>", "\xe2\x96\x81", "a", "b",
                                  "\xe2\x96\x81" "a", "ab", "ba", "c", "d", "e", "f", "g", "h"};
        for (int i = 0; i < 16; i++) put_str(f, pieces[i]);
        kv_begin(f, "tokenizer.ggml.scores", 9);
        put_u32(f, 6);
        put_u64(f, 16);
        for (int i = 0; i < 16; i++) put_f32(f, -(float)i);
    }
    set_u64(f, 16, (uint64_t)f->nkv);
    uint64_t rel = 0;
    for (int t = 0; t < N_TINY; t++) {
        uint32_t ty = types ? types[t] : T_F32;
        f->t_name[t] = tiny[t].name;
        f->t_info[t] = f->len;
        put_str(f, tiny[t].name);
        f->t_nd[t] = f->len;
        put_u32(f, (uint32_t)tiny[t].nd);
        f->t_dims[t] = f->len;
        f->t_ndim[t] = tiny[t].nd;
        for (int d = 0; d < tiny[t].nd; d++) {
            put_u64(f, tiny[t].ne[d]);
            f->t_ne[t][d] = tiny[t].ne[d];
        }
        f->t_type[t] = f->len;
        f->t_gtype[t] = ty;
        put_u32(f, ty);
        f->t_off[t] = f->len;
        put_u64(f, rel);
        f->t_rel[t] = rel;
        f->t_bytes[t] = tbytes(&tiny[t], ty);
        rel = (rel + f->t_bytes[t] + 31) / 32 * 32;
    }
    f->nt = N_TINY;
    f->header_end = f->len;
    f->data_off = (f->len + 31) / 32 * 32;
    while (f->len < f->data_off) put(f, "", 1);
    for (int t = 0; t < N_TINY; t++) {
        cr_assert_eq(f->len, f->data_off + f->t_rel[t]);
        uint64_t n = f->t_bytes[t];
        uint32_t ty = f->t_gtype[t];
        if (ty == T_F32)
            for (uint64_t i = 0; i < n / 4; i++) put_f32(f, tval(t, i));
        else if (ty == T_F16 || ty == T_BF16)
            for (uint64_t i = 0; i < n / 2; i++) {
                uint16_t h = ty == T_F16 ? f32_to_f16_exact(tval(t, i)) : f32_to_bf16_exact(tval(t, i));
                uint8_t b[2] = {(uint8_t)h, (uint8_t)(h >> 8)};
                put(f, b, 2);
            }
        else if (ty == T_Q4_0 || ty == T_Q8_0) { /* tval quantised by kvcal's encoder */
            uint64_t ne = n / (uint64_t)kv_ggml_block_bytes(ty) * (uint64_t)kv_ggml_block_elems(ty);
            float *x = malloc(ne * sizeof *x);
            uint8_t *q = malloc(n);
            for (uint64_t i = 0; i < ne; i++) x[i] = tval(t, i);
            cr_assert_eq(kv_ggml_quant(ty, x, q, (int64_t)ne), KV_OK);
            put(f, q, n);
            free(x), free(q);
        } else
            for (uint64_t i = 0; i < n; i++) put(f, &(uint8_t){(uint8_t)(i * 7)}, 1);
        while (f->len % 32) put(f, "", 1);
    }
}

/* Index of the fixture's pair named key (fails the test when absent). */
static inline int kv_index(const struct fx *f, const char *key) {
    for (int i = 0; i < f->nkv; i++)
        if (!strcmp(f->key[i], key)) return i;
    cr_assert_fail("fixture has no key %s", key);
    return -1;
}

/* An error as one line, without the detection site. */
static inline const char *fmt_err(const struct kv_err *e) {
    static char buf[2048];
    kv_err_format(e, buf, sizeof buf, 0);
    return buf;
}

#endif
