/* GGUF parser, getters, llama loader and vocabulary. The corruption table
 * mutates a small valid GGUF that this file writes itself. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "ggufmodel.h"
#include "llama2c.h"
#include "model.h"
#include "testutil.h"

#include <criterion/parameterized.h>
#include "tokenizer.h"

/* ------------------------------------------------------------ writer */

#define MAXKV 16
#define MAXT 16
#define T_F32 0u
#define T_F16 1u
#define T_Q4_0 2u
#define T_BF16 30u

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

static void put(struct fx *f, const void *b, size_t n) {
    if (f->len + n > f->cap) {
        f->cap = (f->len + n) * 2 + 256;
        f->p = realloc(f->p, f->cap);
        cr_assert(f->p);
    }
    memcpy(f->p + f->len, b, n);
    f->len += n;
}
static void put_u32(struct fx *f, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put(f, b, 4);
}
static void put_u64(struct fx *f, uint64_t v) {
    put_u32(f, (uint32_t)v);
    put_u32(f, (uint32_t)(v >> 32));
}
static void put_f32(struct fx *f, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    put_u32(f, u);
}
static void put_str(struct fx *f, const char *s) {
    put_u64(f, strlen(s));
    put(f, s, strlen(s));
}
static void set_u32(struct fx *f, size_t off, uint32_t v) {
    for (int i = 0; i < 4; i++) f->p[off + i] = (uint8_t)(v >> (8 * i));
}
static void set_u64(struct fx *f, size_t off, uint64_t v) {
    for (int i = 0; i < 8; i++) f->p[off + i] = (uint8_t)(v >> (8 * i));
}

static int kv_begin(struct fx *f, const char *key, uint32_t type) {
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
static float tval(int t, uint64_t i) { return (float)((int)((i + 7 * (uint64_t)t) % 61) - 30) / 32.0f; }

static uint16_t f32_to_f16_exact(float x) { /* only for values of tval (k/32, |k| <= 30) */
    if (x == 0) return 0;
    uint16_t sign = x < 0 ? 0x8000 : 0;
    float a = fabsf(x);
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int exp = e - 1 + 15;
    uint16_t man = (uint16_t)lrintf((m * 2 - 1) * 1024);
    return (uint16_t)(sign | exp << 10 | man);
}
static uint16_t f32_to_bf16_exact(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(u >> 16);
}

/* Tensor byte size for the types the writer knows. */
static uint64_t tbytes(const struct tspec *s, uint32_t type) {
    uint64_t n = 1;
    for (int d = 0; d < s->nd; d++) n *= s->ne[d];
    switch (type) {
    case T_F32: return n * 4;
    case T_F16:
    case T_BF16: return n * 2;
    case T_Q4_0: return n / 32 * 18;
    }
    cr_assert_fail("writer does not know type %u", type);
    return 0;
}

/* Build the tiny model; types[i] overrides tensor i's type when non-NULL.
 * with_tokenizer adds a 16-piece "llama" vocabulary. */
static void build(struct fx *f, const uint32_t *types, int with_tokenizer) {
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
        else
            for (uint64_t i = 0; i < n; i++) put(f, &(uint8_t){(uint8_t)(i * 7)}, 1);
        while (f->len % 32) put(f, "", 1);
    }
}

static int kv_index(const struct fx *f, const char *key) {
    for (int i = 0; i < f->nkv; i++)
        if (!strcmp(f->key[i], key)) return i;
    cr_assert_fail("fixture has no key %s", key);
    return -1;
}

static const char *fmt_err(const struct kv_err *e) {
    static char buf[2048];
    kv_err_format(e, buf, sizeof buf, 0);
    return buf;
}

/* ------------------------------------------------------------ valid file */

Test(gguf_parse, accepts_the_valid_fixture_and_converts_shapes) {
    struct fx f;
    build(&f, NULL, 0);
    struct kv_gguf_file g;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_gguf_parse(f.p, f.len, "tiny.gguf", &g, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(g.version, 3);
    cr_assert_eq(g.alignment, 32);
    cr_assert_eq(g.n_kv, f.nkv);
    cr_assert_eq(g.n_tensors, N_TINY);
    cr_assert_eq(g.data_off, f.data_off);
    for (int t = 0; t < N_TINY; t++) {
        const struct kv_gguf_tensor *ti = kv_gguf_find_tensor(&g, tiny[t].name);
        cr_assert(ti, "tensor %s", tiny[t].name);
        cr_assert_eq(ti, &g.tensors[t]);
        cr_assert_eq(ti->t.ndim, tiny[t].nd);
        for (int d = 0; d < tiny[t].nd; d++)
            cr_assert_eq(ti->t.shape[d], (int64_t)tiny[t].ne[tiny[t].nd - 1 - d]);
        cr_assert_eq(ti->t.offset, f.data_off + f.t_rel[t]);
        cr_assert_eq(ti->t.nbytes, f.t_bytes[t]);
        cr_assert_eq(ti->t.dtype, KV_DTYPE_F32);
        cr_assert_eq((const uint8_t *)ti->t.data, f.p + ti->t.offset);
        cr_assert_eq(ti->type_off, f.t_type[t]);
        cr_assert_eq(ti->offset_off, f.t_off[t]);
    }
    cr_assert_null(kv_gguf_find_tensor(&g, "blk.0.attn_q"));
    cr_assert_null(kv_gguf_find(&g, "general"));
    kv_gguf_release(&g);
    free(f.p);
}

Test(gguf_parse, getters_return_values_and_name_type_mismatches) {
    struct fx f;
    build(&f, NULL, 0);
    struct kv_gguf_file g;
    struct kv_err err;
    cr_assert_eq(kv_gguf_parse(f.p, f.len, "tiny.gguf", &g, &err), KV_OK);
    uint32_t u;
    int32_t i;
    uint64_t u64;
    float x;
    struct kv_gguf_str s;
    cr_assert_eq(kv_gguf_get_u32(&g, "llama.block_count", &u, &err), KV_OK);
    cr_assert_eq(u, 1);
    cr_assert_eq(kv_gguf_get_u64(&g, "llama.feed_forward_length", &u64, &err), KV_OK);
    cr_assert_eq(u64, 64);
    cr_assert_eq(kv_gguf_get_i32(&g, "test.a", &i, &err), KV_OK);
    cr_assert_eq(i, -7);
    cr_assert_eq(kv_gguf_get_f32(&g, "llama.attention.layer_norm_rms_epsilon", &x, &err), KV_OK);
    cr_assert_eq(x, 1e-6f);
    cr_assert_eq(kv_gguf_get_str(&g, "general.architecture", &s, &err), KV_OK);
    cr_assert(s.len == 5 && !memcmp(s.p, "llama", 5));

    struct kv_gguf_str *tags;
    uint64_t n;
    cr_assert_eq(kv_gguf_get_arr_str(&g, "general.tags", &tags, &n, &err), KV_OK);
    cr_assert_eq(n, 2);
    cr_assert(tags[0].len == 1 && tags[0].p[0] == 'a');
    cr_assert(tags[1].len == 2 && !memcmp(tags[1].p, "bc", 2));
    free(tags);
    float *fl;
    cr_assert_eq(kv_gguf_get_arr_f32(&g, "test.floats", &fl, &n, &err), KV_OK);
    cr_assert(n == 3 && fl[0] == 1.5f && fl[1] == -2.0f && fl[2] == 3.25f);
    free(fl);

    int ka = kv_index(&f, "general.architecture");
    cr_assert_eq(kv_gguf_get_u32(&g, "general.architecture", &u, &err), KV_EFORMAT);
    cr_assert_eq(err.off, f.type_off[ka]);
    char want[256];
    snprintf(want, sizeof want,
             "tiny.gguf: offset %zu: key 'general.architecture' has type string, expected uint32",
             f.type_off[ka]);
    cr_assert_str_eq(fmt_err(&err), want);
    cr_assert_eq(kv_gguf_get_u32(&g, "test.a", &u, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "key 'test.a' is -7, which does not fit in uint32");
    cr_assert_eq(kv_gguf_get_str(&g, "general.tags", &s, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "key 'general.tags' has type array of string, expected string");
    int32_t *ia;
    cr_assert_eq(kv_gguf_get_arr_i32(&g, "test.floats", &ia, &n, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "key 'test.floats' has type array of float32, expected array of int32");
    cr_assert_eq(kv_gguf_get_u32(&g, "llama.vocab_size", &u, &err), KV_EFORMAT);
    cr_assert_str_eq(fmt_err(&err), "tiny.gguf: missing key 'llama.vocab_size'");
    kv_gguf_release(&g);
    free(f.p);
}

/* ------------------------------------------------------------ corruption table */

struct mut_out {
    size_t off; /* expected error offset */
};
typedef void (*mutate_fn)(struct fx *f, struct mut_out *o);

static void m_magic(struct fx *f, struct mut_out *o) { f->p[0] = 'X'; o->off = 0; }
static void m_v1(struct fx *f, struct mut_out *o) { set_u32(f, 4, 1); o->off = 4; }
static void m_vswap(struct fx *f, struct mut_out *o) { set_u32(f, 4, 0x03000000u); o->off = 4; }
static void m_trunc_magic(struct fx *f, struct mut_out *o) { f->len = 2; o->off = 0; }
static void m_trunc_counts(struct fx *f, struct mut_out *o) { f->len = 20; o->off = 16; }
static void m_trunc_kv(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "test.floats");
    f->len = f->val_off[k] + 12 + 2; /* element type, count, then 2 of 12 bytes */
    cr_assert(f->len - 24 >= (size_t)N_TINY * 33, "cut too early for this row");
    o->off = f->val_off[k] + 12;
}
static void m_trunc_tinfo(struct fx *f, struct mut_out *o) {
    f->len = f->t_off[N_TINY - 1] + 7;
    o->off = f->t_off[N_TINY - 1];
}
static void m_trunc_data(struct fx *f, struct mut_out *o) {
    f->len -= 4;
    o->off = f->t_off[N_TINY - 1];
}
static void m_trunc_first_tensor(struct fx *f, struct mut_out *o) {
    f->len = f->data_off + 10;
    o->off = f->t_off[0];
}
static void m_misaligned(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_off[T_Q], f->t_rel[T_Q] + 4);
    o->off = f->t_off[T_Q];
}
static void m_out_of_range(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_off[T_K], (uint64_t)1 << 40);
    o->off = f->t_off[T_K];
}
static void m_offset_overflow(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_off[T_K], UINT64_MAX - 31);
    o->off = f->t_off[T_K];
}
static void m_overlap(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_off[T_ANORM], f->t_rel[T_ONORM]);
    o->off = f->t_off[T_ANORM];
}
static void m_first_not_zero(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_off[T_EMB], 32);
    o->off = f->t_off[T_EMB];
}
static void m_gap(struct fx *f, struct mut_out *o) {
    for (int i = 0; i < 32; i++) put(f, "", 1); /* room for the moved tensor */
    set_u64(f, f->t_off[T_UP], f->t_rel[T_UP] + 32);
    o->off = f->t_off[T_UP];
}
static void m_dup_key(struct fx *f, struct mut_out *o) {
    int b = kv_index(f, "test.b");
    f->p[f->key_off[b] + 8 + 5] = 'a'; /* "test.b" -> "test.a" */
    o->off = f->key_off[b];
}
static void m_dup_tensor(struct fx *f, struct mut_out *o) {
    f->p[f->t_info[T_K] + 8 + strlen("blk.0.attn_")] = 'v'; /* attn_k -> attn_v */
    o->off = f->t_info[T_V];
}
static void m_nested(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "general.tags");
    set_u32(f, f->val_off[k], 9);
    o->off = f->val_off[k];
}
static void m_align3(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "general.alignment");
    set_u32(f, f->val_off[k], 48);
    o->off = f->val_off[k];
}
static void m_align0(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "general.alignment");
    set_u32(f, f->val_off[k], 0);
    o->off = f->val_off[k];
}
static void m_align_type(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "general.alignment");
    set_u32(f, f->type_off[k], 5); /* int32 */
    o->off = f->type_off[k];
}
static void m_many_tensors(struct fx *f, struct mut_out *o) { set_u64(f, 8, 1u << 20); o->off = 8; }
static void m_too_many_tensors(struct fx *f, struct mut_out *o) {
    set_u64(f, 8, (1u << 20) + 1);
    o->off = 8;
}
static void m_many_kv(struct fx *f, struct mut_out *o) { set_u64(f, 16, 100000); o->off = 16; }
static void m_ndims5(struct fx *f, struct mut_out *o) {
    set_u32(f, f->t_nd[T_ONORM], 5);
    o->off = f->t_nd[T_ONORM];
}
static void m_ndims0(struct fx *f, struct mut_out *o) {
    set_u32(f, f->t_nd[T_ONORM], 0);
    o->off = f->t_nd[T_ONORM];
}
static void m_dim0(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_dims[T_Q] + 8, 0);
    o->off = f->t_dims[T_Q] + 8;
}
static void m_dim_overflow(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_dims[T_Q] + 8, (uint64_t)1 << 62);
    o->off = f->t_dims[T_Q] + 8;
}
static void m_type_removed(struct fx *f, struct mut_out *o) {
    set_u32(f, f->t_type[T_ONORM], 4);
    o->off = f->t_type[T_ONORM];
}
static void m_type_99(struct fx *f, struct mut_out *o) {
    set_u32(f, f->t_type[T_ONORM], 99);
    o->off = f->t_type[T_ONORM];
}
static void m_block(struct fx *f, struct mut_out *o) {
    set_u32(f, f->t_type[T_ONORM], 10); /* Q2_K: 256-element blocks, ne[0] is 32 */
    o->off = f->t_type[T_ONORM];
}
static void m_value_type(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "test.b");
    set_u32(f, f->type_off[k], 13);
    o->off = f->type_off[k];
}
static void m_long_key(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "test.b");
    set_u64(f, f->key_off[k], (16u << 20) + 1);
    o->off = f->key_off[k];
}
static void m_long_name(struct fx *f, struct mut_out *o) {
    set_u64(f, f->t_info[T_V], 256);
    o->off = f->t_info[T_V];
}
static void m_empty_key(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "test.b");
    set_u64(f, f->key_off[k], 0);
    o->off = f->key_off[k];
}
static void m_big_array(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "test.floats");
    set_u64(f, f->val_off[k] + 4, (1u << 28) + 1);
    o->off = f->val_off[k] + 4;
}
static void m_array_past_end(struct fx *f, struct mut_out *o) {
    int k = kv_index(f, "test.floats");
    set_u64(f, f->val_off[k] + 4, 1u << 28);
    o->off = f->val_off[k] + 12;
}

struct row {
    const char *name;
    mutate_fn fn;
    int code;
    const char *substr;
};

static const struct row rows[] = {
    {"bad magic", m_magic, KV_EFORMAT, "bad magic 'XGUF', expected 'GGUF'"},
    {"version 1", m_v1, KV_EUNSUPPORTED, "unsupported gguf version 1, expected 2 or 3"},
    {"byte-swapped version", m_vswap, KV_EUNSUPPORTED,
     "gguf version field is 0x03000000, which is version 3 byte-swapped: the file is big-endian"},
    {"truncated in magic", m_trunc_magic, KV_EFORMAT, "truncated: need 4 bytes for the magic, have 2"},
    {"truncated in counts", m_trunc_counts, KV_EFORMAT,
     "truncated: need 8 bytes for the metadata count, have 4"},
    {"truncated in a value", m_trunc_kv, KV_EFORMAT,
     "truncated: need 12 bytes for the value of key 'test.floats', have 2"},
    {"truncated in tensor info", m_trunc_tinfo, KV_EFORMAT,
     "truncated: need 8 bytes for tensor 'blk.0.ffn_up.weight', have 7"},
    {"truncated in the first tensor", m_trunc_first_tensor, KV_EFORMAT,
     "tensor 'token_embd.weight' at data offset 0 needs 2048 bytes but the data section holds"},
    {"truncated in data", m_trunc_data, KV_EFORMAT,
     "tensor 'blk.0.ffn_up.weight' at data offset"},
    {"misaligned tensor offset", m_misaligned, KV_EFORMAT,
     "tensor 'blk.0.attn_q.weight' offset 2308 is not a multiple of the alignment 32"},
    {"tensor out of range", m_out_of_range, KV_EFORMAT,
     "tensor 'blk.0.attn_k.weight' at data offset 1099511627776 needs 2048 bytes but the data "
     "section holds"},
    {"tensor offset overflows", m_offset_overflow, KV_EFORMAT,
     "tensor 'blk.0.attn_k.weight' at data offset 18446744073709551584 needs 2048 bytes"},
    {"overlapping tensors", m_overlap, KV_EFORMAT,
     "tensor 'blk.0.attn_norm.weight' at data offset 2048 overlaps tensor 'output_norm.weight' "
     "(2048..2176)"},
    {"first tensor not at 0", m_first_not_zero, KV_EFORMAT,
     "tensor 'token_embd.weight' is first in the data section at offset 32, expected 0"},
    {"gap between tensors", m_gap, KV_EFORMAT,
     "tensor 'blk.0.ffn_up.weight' at data offset 31136 leaves a gap after tensor "
     "'blk.0.ffn_down.weight', expected offset 31104"},
    {"duplicate key", m_dup_key, KV_EFORMAT, "duplicate key 'test.a' (first at offset"},
    {"duplicate tensor name", m_dup_tensor, KV_EFORMAT,
     "duplicate tensor name 'blk.0.attn_v.weight' (first at offset"},
    {"nested array", m_nested, KV_EFORMAT,
     "key 'general.tags' is an array of arrays; gguf arrays do not nest"},
    {"alignment 48", m_align3, KV_EFORMAT, "key 'general.alignment' is 48, expected a power of two"},
    {"alignment 0", m_align0, KV_EFORMAT, "key 'general.alignment' is 0, expected a power of two"},
    {"alignment int32", m_align_type, KV_EFORMAT,
     "key 'general.alignment' has type int32, expected uint32"},
    {"too many tensors for the file", m_many_tensors, KV_EFORMAT,
     "tensor count 1048576 needs at least 34603008 bytes of tensor info"},
    {"tensor count over the limit", m_too_many_tensors, KV_EFORMAT,
     "tensor count 1048577 exceeds the limit 1048576"},
    {"too many pairs for the file", m_many_kv, KV_EFORMAT,
     "metadata count 100000 needs at least 1400000 bytes"},
    {"n_dims 5", m_ndims5, KV_EFORMAT,
     "tensor 'output_norm.weight' has 5 dimensions, expected 1 to 4"},
    {"n_dims 0", m_ndims0, KV_EFORMAT,
     "tensor 'output_norm.weight' has 0 dimensions, expected 1 to 4"},
    {"zero dimension", m_dim0, KV_EFORMAT, "tensor 'blk.0.attn_q.weight' has ne[1] = 0"},
    {"element count overflow", m_dim_overflow, KV_EFORMAT,
     "tensor 'blk.0.attn_q.weight' element count overflows"},
    {"removed ggml type", m_type_removed, KV_EFORMAT,
     "tensor 'output_norm.weight' has unknown ggml type 4"},
    {"unknown ggml type", m_type_99, KV_EFORMAT,
     "tensor 'output_norm.weight' has unknown ggml type 99"},
    {"partial quant block", m_block, KV_EFORMAT,
     "tensor 'output_norm.weight' has ne[0] = 32, not a multiple of the Q2_K block size 256"},
    {"unknown value type", m_value_type, KV_EFORMAT,
     "key 'test.b' has unknown value type 13, expected 0..12"},
    {"key too long", m_long_key, KV_EFORMAT,
     "the key of metadata pair 10 is 16777217 bytes, limit 16777216"},
    {"tensor name too long", m_long_name, KV_EFORMAT, "the name of tensor 5 is 256 bytes, limit 255"},
    {"empty key", m_empty_key, KV_EFORMAT, "metadata pair 10 has an empty key"},
    {"array over the limit", m_big_array, KV_EFORMAT,
     "key 'test.floats' has 268435457 array elements, limit 268435456"},
    {"array past the end", m_array_past_end, KV_EFORMAT,
     "truncated: need 1073741824 bytes for the value of key 'test.floats'"},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

ParameterizedTestParameters(gguf_parse, rejects_corruption) {
    static int idx[N_ROWS];
    for (size_t i = 0; i < N_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_ROWS);
}

ParameterizedTest(int *ip, gguf_parse, rejects_corruption) {
    const struct row *r = &rows[*ip];
    struct fx f;
    build(&f, NULL, 0);
    struct mut_out o = {0};
    r->fn(&f, &o);
    struct kv_gguf_file g;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_gguf_parse(f.p, f.len, "bad.gguf", &g, &err);
    cr_assert_eq(rc, r->code, "%s: code %d (%s), expected %d", r->name, rc, fmt_err(&err),
                 r->code);
    cr_assert_eq(err.off, (uint64_t)o.off, "%s: offset %llu, expected %zu (%s)", r->name,
                 (unsigned long long)err.off, o.off, fmt_err(&err));
    cr_assert(strstr(err.msg, r->substr), "%s: message '%s' lacks '%s'", r->name, err.msg,
              r->substr);
    cr_assert_str_eq(err.path, "bad.gguf");
    cr_assert_null(g.kv);
    cr_assert_null(g.tensors);
    free(f.p);
}

Test(gguf_parse, every_truncation_fails_cleanly) {
    struct fx f;
    build(&f, NULL, 1);
    struct kv_gguf_file g;
    struct kv_err err;
    for (size_t n = 0; n < f.len; n++) {
        int rc = kv_gguf_parse(f.p, n, "cut.gguf", &g, &err);
        cr_assert_eq(rc, KV_EFORMAT, "prefix %zu: rc %d", n, rc);
        cr_assert(err.off == KV_NO_OFFSET || err.off <= n, "prefix %zu: offset %llu", n,
                  (unsigned long long)err.off);
    }
    free(f.p);
}

Test(gguf_parse, single_byte_corruptions_never_crash) {
    struct fx f;
    build(&f, NULL, 1);
    uint8_t *copy = malloc(f.len);
    struct kv_gguf_file g;
    struct kv_err err;
    const uint8_t vals[] = {0x00, 0xff, 0x80, 0x09, 0x05};
    for (size_t i = 0; i < f.header_end; i++)
        for (size_t v = 0; v < sizeof vals; v++) {
            memcpy(copy, f.p, f.len);
            copy[i] = vals[v];
            if (kv_gguf_parse(copy, f.len, "flip.gguf", &g, &err) == KV_OK) kv_gguf_release(&g);
        }
    free(copy);
    free(f.p);
}

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

Test(gguf_load, refuses_quantized_tensors_with_the_exact_message) {
    uint32_t types[N_TINY] = {0};
    types[T_Q] = T_Q4_0;
    struct fx f;
    build(&f, types, 0);
    char *path = write_fx(&f);
    struct kv_model *m = NULL;
    struct kv_err err;
    int rc = kv_gguf_load(path, &m, &err);
    cr_assert_eq(rc, KV_EUNSUPPORTED, "%s", fmt_err(&err));
    char want[512];
    snprintf(want, sizeof want,
             "%s: offset %zu: tensor 'blk.0.attn_q.weight' has quantized type Q4_0; kvcal loads "
             "only F32, F16 and BF16",
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
    cr_assert_str_eq(err.msg, "architecture 'bert1' is not supported");
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
    cr_assert_str_eq(err.msg, "tokenizer model 'gpt2x' is not supported; kvcal reads only "
                              "'llama' (sentencepiece) vocabularies");
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
