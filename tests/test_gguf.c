/* GGUF container: parser and getters. The corruption table mutates the small
 * valid GGUF of gguf_fixture.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "gguf_fixture.h"
#include "testutil.h"

#include <criterion/parameterized.h>

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
