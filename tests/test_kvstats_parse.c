/* Statistics files (.kvstats, formats/kvstats.c), parsing: a corruption
 * table over a valid file this test writes (byte mutations at offsets found
 * with kv_gguf_parse, never hard-coded) and over files from the independent
 * writer (kvstats_handwrite.h) with one piece overridden; every prefix and
 * every single-byte flip must fail cleanly. */
#include <dirent.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "kvstats.h"
#include "kvstats_fixture.h"
#include "kvstats_handwrite.h"
#include "testutil.h"

#include <criterion/parameterized.h>

static void set_le(uint8_t *p, uint64_t v, int nbytes) {
    for (int i = 0; i < nbytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ------------------------------------------------------------ the valid file */

/* A valid file's bytes (mutable) and kv_gguf_parse of them for offsets. */
struct fx {
    struct kv_stats *s;
    char *dir;
    uint8_t *p;
    size_t len;
    struct kv_gguf_file g;
};

static void fx_load(struct fx *f, const char *path) {
    kv_gguf_release(&f->g);
    free(f->p);
    f->p = (uint8_t *)kvt_read_file(path, &f->len);
    cr_assert(f->p, "cannot read %s", path);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_gguf_parse(f->p, f->len, path, &f->g, &err), KV_OK, "%s", fmt_err(&err));
}

static void fx_init(struct fx *f) {
    memset(f, 0, sizeof *f);
    struct kv_config c = small_cfg();
    f->s = make_stats(&c, 1.0);
    f->dir = kvt_temp_dir();
    char *path = write_stats(f->s, f->dir, "valid.kvstats");
    fx_load(f, path);
    free(path);
}

/* The valid file becomes one with Fisher statistics. */
static void fx_fisher(struct fx *f) {
    struct kv_config c = small_cfg();
    kv_stats_free(f->s);
    f->s = make_fisher_stats(&c, 1.0);
    char *path = write_stats(f->s, f->dir, "fisher.kvstats");
    fx_load(f, path);
    free(path);
}

/* Replace the bytes with a file from the independent writer. */
static void fx_hand(struct fx *f, const struct hspec *h) {
    char *path = hand_write(f->s, h, f->dir, "hand.kvstats");
    fx_load(f, path);
    free(path);
}

static void fx_free(struct fx *f) {
    kv_gguf_release(&f->g);
    free(f->p);
    kv_stats_free(f->s);
    rm_tree(f->dir);
}

static const struct kv_gguf_tensor *fx_tensor(const struct fx *f, const char *name) {
    const struct kv_gguf_tensor *t = kv_gguf_find_tensor(&f->g, name);
    cr_assert(t, "fixture has no tensor %s", name);
    return t;
}

static const struct kv_gguf_kv *fx_kv(const struct fx *f, const char *key) {
    const struct kv_gguf_kv *kv = kv_gguf_find(&f->g, key);
    cr_assert(kv, "fixture has no key %s", key);
    return kv;
}

static int64_t fx_tensor_index(const struct fx *f, const char *name) {
    return fx_tensor(f, name) - f->g.tensors;
}

/* Overwrite a scalar integer value in place (its stored width). */
static void fx_set_int(struct fx *f, const char *key, uint64_t v) {
    const struct kv_gguf_kv *kv = fx_kv(f, key);
    cr_assert(kv->type == KV_GGUF_U64 || kv->type == KV_GGUF_U32, "%s is not an integer", key);
    set_le(f->p + kv->val_off, v, kv->type == KV_GGUF_U64 ? 8 : 4);
}

/* Store x as element k of tensor name, with the tensor's crc32 fixed up. */
static uint64_t fx_poke_f64(struct fx *f, const char *name, int64_t k, double x) {
    const struct kv_gguf_tensor *t = fx_tensor(f, name);
    memcpy(f->p + t->t.offset + (uint64_t)k * 8, &x, 8);
    const struct kv_gguf_kv *kc = fx_kv(f, "kvcal.crc32");
    cr_assert_eq(kc->arr_type, KV_GGUF_U32);
    set_le(f->p + kc->arr_off + 4 * (uint64_t)fx_tensor_index(f, name),
           crc_of(f->p + t->t.offset, t->t.nbytes), 4);
    return t->t.offset + (uint64_t)k * 8;
}

/* ------------------------------------------------------------ parse: corruption table */

struct want {
    uint64_t off;  /* expected error offset, or KV_NO_OFFSET */
    char msg[512]; /* a further substring computed from the file, or "" */
};
typedef void (*mutate_fn)(struct fx *f, struct want *w);

/* truncations */
static void m_cut_header(struct fx *f, struct want *w) {
    f->len = 12; /* inside the u64 tensor count at 8 */
    w->off = 8;
}
static void m_cut_metadata(struct fx *f, struct want *w) {
    /* late enough that the bytes left could still hold the tensor infos */
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.datasets.sha256");
    f->len = kv->arr_off + 8 + 64 + 8 + 10; /* 10 digits of the second entry */
    w->off = kv->arr_off + 8 + 64 + 8;
}
static void m_cut_tensor_info(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.0.q_rope.cov");
    f->len = t->type_off + 2;
    w->off = t->type_off;
}
static void m_cut_tensor_data(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.1.q_rope.cov");
    f->len = t->t.offset + t->t.nbytes / 2;
    w->off = t->offset_off;
    snprintf(w->msg, sizeof w->msg,
             "tensor 'blk.1.q_rope.cov' at data offset %llu needs %llu bytes but the data "
             "section holds %llu",
             (unsigned long long)t->rel_offset, (unsigned long long)t->t.nbytes,
             (unsigned long long)(f->len - f->g.data_off));
}
static void m_cut_last_byte(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.1.k_rope.cov");
    cr_assert_eq(t->t.offset + t->t.nbytes, f->len, "the last tensor ends the file");
    f->len -= 1;
    w->off = t->offset_off;
    snprintf(w->msg, sizeof w->msg, "needs %llu bytes but the data section holds %llu",
             (unsigned long long)t->t.nbytes, (unsigned long long)(f->len - f->g.data_off));
}

/* tensor data */
static void m_crc(struct fx *f, struct want *w) {
    const struct kv_gguf_tensor *t = fx_tensor(f, "blk.1.q_rope.cov");
    f->p[t->t.offset + 13] ^= 0x01;
    w->off = t->t.offset;
}
static void m_nan(struct fx *f, struct want *w) {
    w->off = fx_poke_f64(f, "blk.1.attn_in.sum", 5, NAN);
}
static void m_inf(struct fx *f, struct want *w) {
    w->off = fx_poke_f64(f, "blk.0.q_rope.cov", 17, -INFINITY);
}

/* metadata */
static void m_type_statz(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "general.type");
    cr_assert_eq(kv->str.len, 11);
    f->p[kv->val_off + 8 + 10] = 'z';
    w->off = kv->val_off;
}
static void m_model_gguf(struct fx *f, struct want *w) {
    KVT_NEED_SHARED(model, "models/stories260K/stories260K.gguf");
    fx_load(f, model);
    cr_assert_null(kv_gguf_find(&f->g, "general.type"), "the shared model has no general.type");
    w->off = KV_NO_OFFSET;
}
static void m_no_type(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_key = "general.type";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_no_meta_crc(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_key = "kvcal.meta_crc32";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_meta_seed(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.seed", 12345);
    w->off = fx_kv(f, "kvcal.meta_crc32")->val_off;
}
static void m_version3(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.format_version", 3);
    w->off = fx_kv(f, "kvcal.format_version")->val_off;
}
static void m_tokens(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.tokens", 7 * SEQ_LEN + 1);
    w->off = fx_kv(f, "kvcal.tokens")->val_off;
}
static void m_sampling(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.sampling");
    cr_assert_eq(kv->str.len, 6);
    f->p[kv->val_off + 8 + 5] = 'X'; /* "random" -> "randoX" */
    w->off = kv->val_off;
}
static void m_fingerprint(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.model.fingerprint");
    f->p[kv->val_off + 8 + 10] = 'A'; /* uppercase hex */
    w->off = kv->val_off;
}
static void m_next_window(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.plan.next_window", 8);
    w->off = fx_kv(f, "kvcal.plan.next_window")->val_off;
}
static void m_shard_index(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.shard.index", 3);
    w->off = fx_kv(f, "kvcal.shard.index")->val_off;
}
static void m_no_layers(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.model.n_layers", 0);
    w->off = fx_kv(f, "kvcal.model.n_layers")->val_off;
}
static void m_huge_dim(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.model.dim", 1u << 20);
    w->off = KV_NO_OFFSET;
}
static void m_kv_heads(struct fx *f, struct want *w) {
    fx_set_int(f, "kvcal.model.n_kv_heads", 3);
    w->off = fx_kv(f, "kvcal.model.n_kv_heads")->val_off;
}
static void m_seq_len_type(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.seq_len");
    set_le(f->p + kv->type_off, KV_GGUF_F64, 4); /* same width as uint64 */
    w->off = kv->type_off;
}
static void m_dataset_windows(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.datasets.windows");
    cr_assert_eq(kv->arr_type, KV_GGUF_U64);
    set_le(f->p + kv->arr_off, 4, 8); /* 3 -> 4 */
    w->off = kv->val_off;
}
static void m_dataset_sha(struct fx *f, struct want *w) {
    const struct kv_gguf_kv *kv = fx_kv(f, "kvcal.datasets.sha256");
    f->p[kv->arr_off + 8 + 63] = 'g'; /* first element: u64 length, then the digits */
    w->off = kv->val_off;
}

/* files from the independent writer */
static void m_shape(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.xtx_cols = f->s->info.dim - 1;
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.0.attn_in.xtx")->info_off;
}
static void m_dtype(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.f32_tensor = "blk.1.attn_in.sum";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.1.attn_in.sum")->type_off;
}
static void m_missing_last(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.1.k_rope.cov";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_missing_middle(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.0.q_rope.cov";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.0.k_rope.cov")->info_off;
}
static void m_swapped(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.swap_first = 1;
    fx_hand(f, &h);
    w->off = f->g.tensors[0].info_off;
}
static void m_extra_tensor(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.extra_tensor = 1;
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.2.attn_in.xtx")->info_off;
}
static void m_crc_count(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.crc_extra = 1;
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.crc32")->val_off;
}
static void m_crc_wide(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.crc_wide = 1;
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.crc32")->val_off;
}
static void m_short_sha(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.short_sha = 1;
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.datasets.sha256")->val_off;
}
/* Forty inputs, each holding as many windows as its tokens allow: every
 * count is valid alone, and only their uint64 sum wraps. The reader must see
 * the overflow rather than compare a wrapped sum. */
static void m_windows_wrap(struct fx *f, struct want *w) {
    struct kv_err err;
    kv_err_clear(&err);
    for (int i = 0; i < 40; i++)
        cr_assert_eq(kv_stats_add_input(f->s, "data/big.txt", SHA_3, 1, INT64_MAX,
                                        INT64_MAX / SEQ_LEN, &err), KV_OK);
    struct hspec h = hspec_default();
    fx_hand(f, &h);
    w->off = fx_kv(f, "kvcal.datasets.windows")->val_off;
}
static void m_no_seq_len(struct fx *f, struct want *w) {
    struct hspec h = hspec_default();
    h.drop_key = "kvcal.seq_len";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}

/* Fisher statistics */
static void m_fisher_missing_last(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.1.grad_v.cov";
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_fisher_missing_first_layer(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.drop_tensor = "blk.0.grad_v.cov";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.1.attn_in.xtx")->info_off;
}
static void m_fisher_one_layer_only(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.drop_fisher_of = 2;
    fx_hand(f, &h);
    w->off = KV_NO_OFFSET;
}
static void m_fisher_nan(struct fx *f, struct want *w) {
    fx_fisher(f);
    w->off = fx_poke_f64(f, "blk.0.fisher.k", 3, NAN);
}
static void m_fisher_negative(struct fx *f, struct want *w) {
    fx_fisher(f);
    w->off = fx_poke_f64(f, "blk.1.fisher.v", 6, -1.5);
}
static void m_grad_cov_negative_diagonal(struct fx *f, struct want *w) {
    fx_fisher(f);
    /* head 1, diagonal element (2, 2) of a 4x4 */
    w->off = fx_poke_f64(f, "blk.1.grad_k.cov", 16 + 2 * 4 + 2, -2.0);
}
static void m_grad_cov_f32(struct fx *f, struct want *w) {
    fx_fisher(f);
    struct hspec h = hspec_default();
    h.f32_tensor = "blk.0.grad_v.cov";
    fx_hand(f, &h);
    w->off = fx_tensor(f, "blk.0.grad_v.cov")->type_off;
}

struct row {
    const char *name;
    mutate_fn fn;
    int code;
    const char *substr; /* names the tensor or key */
};

static const struct row rows[] = {
    {"cut inside the header", m_cut_header, KV_EFORMAT,
     "truncated: need 8 bytes for the tensor count, have 4"},
    {"cut inside the metadata", m_cut_metadata, KV_EFORMAT,
     "truncated: need 64 bytes for element 1 of key 'kvcal.datasets.sha256', have 10"},
    {"cut inside a tensor info", m_cut_tensor_info, KV_EFORMAT,
     "truncated: need 4 bytes for tensor 'blk.0.q_rope.cov', have 2"},
    {"cut inside a tensor's data", m_cut_tensor_data, KV_EFORMAT, "tensor 'blk.1.q_rope.cov'"},
    {"one byte short", m_cut_last_byte, KV_EFORMAT, "tensor 'blk.1.k_rope.cov'"},
    {"flipped data byte", m_crc, KV_EFORMAT, "tensor 'blk.1.q_rope.cov': crc32 mismatch"},
    {"nan with a matching crc", m_nan, KV_EFORMAT,
     "tensor 'blk.1.attn_in.sum': non-finite value at element 5"},
    {"-inf with a matching crc", m_inf, KV_EFORMAT,
     "tensor 'blk.0.q_rope.cov': non-finite value at element 17"},
    {"general.type kvcal.statz", m_type_statz, KV_EFORMAT,
     "not a kvcal stats file: general.type is 'kvcal.statz', expected 'kvcal.stats'"},
    {"a model gguf", m_model_gguf, KV_EFORMAT,
     "not a kvcal stats file: no 'general.type' key"},
    {"general.type missing", m_no_type, KV_EFORMAT,
     "not a kvcal stats file: no 'general.type' key"},
    {"version 2 without kvcal.meta_crc32", m_no_meta_crc, KV_EFORMAT,
     "no key 'kvcal.meta_crc32', which format version 2 files carry"},
    {"seed changed", m_meta_seed, KV_EFORMAT,
     "key 'kvcal.meta_crc32': metadata crc32 mismatch (stored "},
    {"format version 3", m_version3, KV_EUNSUPPORTED,
     "stats format version 3 is not supported (this kvcal reads versions up to 2)"},
    {"tokens not sequences * seq_len", m_tokens, KV_EFORMAT,
     "kvcal.tokens is 225 but 7 windows of 32 tokens make 224"},
    {"unknown sampling", m_sampling, KV_EFORMAT,
     "key 'kvcal.sampling' is 'randoX', expected sequential, random or merged"},
    {"uppercase fingerprint", m_fingerprint, KV_EFORMAT,
     "key 'kvcal.model.fingerprint' is not 64 lowercase hex digits"},
    {"next window past the plan", m_next_window, KV_EFORMAT,
     "key 'kvcal.plan.next_window' is 8, outside 0..7"},
    {"shard index = count", m_shard_index, KV_EFORMAT, "key 'kvcal.shard.index' is 3, outside 0..2"},
    {"zero layers", m_no_layers, KV_EFORMAT, "key 'kvcal.model.n_layers' is 0, outside 1..1024"},
    {"dim the file cannot hold", m_huge_dim, KV_EFORMAT,
     "truncated or inconsistent: 2 layers of dim 1048576 need more bytes"},
    {"heads not a multiple of kv heads", m_kv_heads, KV_EFORMAT,
     "4 heads are not a multiple of 3 kv heads"},
    {"seq_len of type float64", m_seq_len_type, KV_EFORMAT,
     "key 'kvcal.seq_len' has type float64, expected uint64"},
    {"dataset windows do not add up", m_dataset_windows, KV_EFORMAT,
     "the datasets' windows add up to 8 but kvcal.sequences is 7"},
    {"dataset sha256 not hex", m_dataset_sha, KV_EFORMAT, "dataset 0: sha256 is not 64 hex digits"},
    {"wrong shape", m_shape, KV_EFORMAT,
     "tensor 'blk.0.attn_in.xtx' has shape [16, 15], expected [16, 16]"},
    {"wrong dtype", m_dtype, KV_EFORMAT, "tensor 'blk.1.attn_in.sum' has type F32, expected F64"},
    {"missing last tensor", m_missing_last, KV_EFORMAT,
     "missing tensor 'blk.1.k_rope.cov': 2 layers need 8 tensors, the file has 7"},
    {"missing middle tensor", m_missing_middle, KV_EFORMAT,
     "missing tensor 'blk.0.q_rope.cov' (found 'blk.0.k_rope.cov' in its place)"},
    {"tensors out of order", m_swapped, KV_EFORMAT,
     "tensor 'blk.0.attn_in.sum' is at position 0, expected 'blk.0.attn_in.xtx' there"},
    {"an extra tensor", m_extra_tensor, KV_EFORMAT,
     "unexpected tensor 'blk.2.attn_in.xtx': 2 layers have 8 tensors"},
    {"crc32 with an extra entry", m_crc_count, KV_EFORMAT,
     "key 'kvcal.crc32' has 9 entries but the file has 8 tensors"},
    {"crc32 entry wider than 32 bits", m_crc_wide, KV_EFORMAT,
     "key 'kvcal.crc32': entry 0 is not a 32-bit value"},
    {"dataset arrays of different lengths", m_short_sha, KV_EFORMAT,
     "key 'kvcal.datasets.sha256' has 1 entries but 'kvcal.datasets' has 2"},
    {"dataset windows whose sum wraps", m_windows_wrap, KV_EFORMAT, "the datasets' windows"},
    {"seq_len missing", m_no_seq_len, KV_EFORMAT, "missing key 'kvcal.seq_len'"},
    {"fisher: last layer's grad_v.cov missing", m_fisher_missing_last, KV_EFORMAT,
     "missing tensor 'blk.1.grad_v.cov': 2 layers need 16 tensors, the file has 15; fisher "
     "statistics are fisher.k, fisher.v, grad_k.cov and grad_v.cov in every layer"},
    {"fisher: first layer's grad_v.cov missing", m_fisher_missing_first_layer, KV_EFORMAT,
     "missing tensor 'blk.0.grad_v.cov' (found 'blk.1.attn_in.xtx' in its place); fisher "
     "statistics are fisher.k, fisher.v, grad_k.cov and grad_v.cov in every layer"},
    {"fisher: in one layer only", m_fisher_one_layer_only, KV_EFORMAT,
     "missing tensor 'blk.1.fisher.k': 2 layers need 16 tensors, the file has 12"},
    {"fisher: nan with a matching crc", m_fisher_nan, KV_EFORMAT,
     "tensor 'blk.0.fisher.k': non-finite value at element 3"},
    {"fisher: negative sum of squares", m_fisher_negative, KV_EFORMAT,
     "tensor 'blk.1.fisher.v': negative value -1.5 at element 6, expected a sum of squares >= 0"},
    {"fisher: negative gradient covariance diagonal", m_grad_cov_negative_diagonal, KV_EFORMAT,
     "tensor 'blk.1.grad_k.cov': negative value -2 at element 26, expected a sum of squares >= 0"},
    {"fisher: gradient covariance as F32", m_grad_cov_f32, KV_EFORMAT,
     "tensor 'blk.0.grad_v.cov' has type F32, expected F64"},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

ParameterizedTestParameters(kvstats_parse, rejects_corruption) {
    static int idx[N_ROWS];
    for (size_t i = 0; i < N_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_ROWS);
}

ParameterizedTest(int *ip, kvstats_parse, rejects_corruption) {
    const struct row *r = &rows[*ip];
    struct fx f;
    fx_init(&f);
    struct want w = {.off = KV_NO_OFFSET};
    r->fn(&f, &w);
    char *path = kvt_path(f.dir, "bad.kvstats");
    put_file(path, f.p, f.len);

    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_stats_open(path, &s, &err);
    cr_assert_eq(rc, r->code, "%s: code %d (%s), expected %d", r->name, rc, fmt_err(&err),
                 r->code);
    cr_assert_null(s, "%s: *out set on failure", r->name);
    cr_assert_str_eq(err.path, path, "%s", r->name);
    cr_assert(strstr(err.msg, r->substr), "%s: message '%s' lacks '%s'", r->name, err.msg,
              r->substr);
    if (w.msg[0])
        cr_assert(strstr(err.msg, w.msg), "%s: message '%s' lacks '%s'", r->name, err.msg, w.msg);
    cr_assert_null(strchr(err.msg, '\n'), "%s: one line", r->name);
    cr_assert_eq(err.off, w.off, "%s: offset %llu, expected %llu (%s)", r->name,
                 (unsigned long long)err.off, (unsigned long long)w.off, fmt_err(&err));

    /* the byte parser reports the same error */
    struct kv_err e2;
    kv_err_clear(&e2);
    cr_assert_eq(kv_stats_parse(f.p, f.len, path, &s, &e2), r->code, "%s", r->name);
    cr_assert_null(s);
    cr_assert_eq(e2.off, err.off, "%s", r->name);
    cr_assert_str_eq(e2.msg, err.msg, "%s", r->name);
    cr_assert_str_eq(e2.path, path, "%s", r->name);
    free(path);
    fx_free(&f);
}

Test(kvstats_parse, names_a_file_it_cannot_open) {
    char *dir = kvt_temp_dir();
    char *path = kvt_path(dir, "absent.kvstats");
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &s, &err), KV_EIO);
    cr_assert_str_eq(err.path, path);
    cr_assert_null(s);
    char *empty = kvt_path(dir, "empty.kvstats");
    put_file(empty, "", 0);
    cr_assert_eq(kv_stats_open(empty, &s, &err), KV_EFORMAT, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, empty);
    free(path), free(empty);
    rm_tree(dir);
}

/* ------------------------------------------------------------ parse: garbage */

Test(kvstats_parse, every_prefix_fails_cleanly) {
    struct fx f;
    fx_init(&f);
    for (size_t n = 0; n < f.len; n++) {
        struct kv_stats *s = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        int rc = kv_stats_parse(f.p, n, "cut.kvstats", &s, &err);
        cr_assert_neq(rc, KV_OK, "prefix of %zu bytes accepted", n);
        cr_assert_null(s);
        cr_assert(err.msg[0], "prefix %zu: empty message", n);
        cr_assert_str_eq(err.path, "cut.kvstats", "prefix %zu", n);
        cr_assert(err.off == KV_NO_OFFSET || err.off <= n, "prefix %zu: offset %llu", n,
                  (unsigned long long)err.off);
    }
    struct kv_stats *s = NULL;
    struct kv_err err;
    cr_assert_eq(kv_stats_parse(f.p, f.len, "whole.kvstats", &s, &err), KV_OK, "%s",
                 fmt_err(&err));
    kv_stats_free(s);
    fx_free(&f);
}

Test(kvstats_parse, header_byte_flips_fail_cleanly) {
    struct fx f;
    fx_init(&f);
    uint8_t *copy = malloc(f.len);
    cr_assert(copy);
    int accepted = 0;
    for (uint64_t i = 0; i < f.g.data_off; i++) {
        memcpy(copy, f.p, f.len);
        copy[i] ^= 0xff;
        struct kv_stats *s = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        int rc = kv_stats_parse(copy, f.len, "flip.kvstats", &s, &err);
        if (rc == KV_OK) {
            cr_assert_not_null(s);
            kv_stats_free(s);
            accepted++;
            continue;
        }
        cr_assert(rc > KV_OK && rc <= KV_EUNSUPPORTED, "byte %llu: code %d",
                  (unsigned long long)i, rc);
        cr_assert_null(s);
        cr_assert(err.msg[0], "byte %llu: empty message", (unsigned long long)i);
        cr_assert_str_eq(err.path, "flip.kvstats", "byte %llu", (unsigned long long)i);
        cr_assert(err.off == KV_NO_OFFSET || err.off < f.len, "byte %llu: offset %llu",
                  (unsigned long long)i, (unsigned long long)err.off);
    }
    /* kvcal.meta_crc32 covers the seed, the counts and the dataset records
     * too: only flips in the alignment padding before the data pass */
    cr_assert(accepted < 32, "%d flips accepted", accepted);
    free(copy);
    fx_free(&f);
}

/* A version 1 file (from before kvcal.meta_crc32) is still read. */
Test(kvstats_parse, a_version_1_file_without_the_metadata_crc_is_read) {
    struct fx f;
    fx_init(&f);
    struct hspec h = hspec_default();
    h.format_version = 1;
    char *path = hand_write(f.s, &h, f.dir, "v1.kvstats");
    struct kv_stats *s = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_open(path, &s, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_stats_info(s).seed, f.s->info.seed);
    kv_stats_free(s);
    free(path);
    fx_free(&f);
}

Test(kvstats_parse, every_data_byte_flip_is_a_crc_mismatch) {
    struct fx f;
    fx_init(&f);
    cr_assert_eq(f.g.tensors[f.g.n_tensors - 1].t.offset + f.g.tensors[f.g.n_tensors - 1].t.nbytes,
                 f.len, "no padding after the data");
    for (int64_t k = 0; k < f.g.n_tensors; k++) {
        const struct kv_gguf_tensor *t = &f.g.tensors[k];
        char want[320];
        snprintf(want, sizeof want, "tensor '%s': crc32 mismatch", t->t.name);
        for (uint64_t i = t->t.offset; i < t->t.offset + t->t.nbytes; i++) {
            f.p[i] ^= 0xff;
            struct kv_stats *s = NULL;
            struct kv_err err;
            kv_err_clear(&err);
            int rc = kv_stats_parse(f.p, f.len, "flip.kvstats", &s, &err);
            f.p[i] ^= 0xff;
            cr_assert_eq(rc, KV_EFORMAT, "byte %llu: code %d", (unsigned long long)i, rc);
            cr_assert(strstr(err.msg, want), "byte %llu: '%s'", (unsigned long long)i, err.msg);
            cr_assert_eq(err.off, t->t.offset, "byte %llu", (unsigned long long)i);
        }
    }
    fx_free(&f);
}

Test(kvstats_parse, matches_model_checks_shape_and_fingerprint) {
    struct kv_config c = small_cfg();
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, 5, &m, &err), KV_OK, "%s", fmt_err(&err));
    char fp[65];
    cr_assert_eq(kv_model_fingerprint(m, fp, &err), KV_OK, "%s", fmt_err(&err));
    struct kv_stats *s = make_stats(&c, 1.0);
    snprintf(s->info.fingerprint, sizeof s->info.fingerprint, "%s", fp);
    cr_assert_eq(kv_stats_matches_model(s, m, "s.kvstats", &err), 1, "%s", fmt_err(&err));

    s->info.fingerprint[0] = s->info.fingerprint[0] == '0' ? '1' : '0';
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_matches_model(s, m, "s.kvstats", &err), 0);
    cr_assert_eq(err.code, KV_EINVAL);
    cr_assert_str_eq(err.path, "s.kvstats");
    cr_assert(strstr(err.msg, "collected on another model"), "%s", err.msg);
    kv_stats_free(s);

    struct kv_config c2 = c;
    c2.n_layers = 1;
    s = make_stats(&c2, 1.0);
    snprintf(s->info.fingerprint, sizeof s->info.fingerprint, "%s", fp);
    kv_err_clear(&err);
    cr_assert_eq(kv_stats_matches_model(s, m, "s.kvstats", &err), 0);
    cr_assert_eq(err.code, KV_EINVAL);
    cr_assert_str_eq(err.path, "s.kvstats");
    cr_assert(strstr(err.msg, "statistics are for 1 layers, dim 16"), "%s", err.msg);
    kv_stats_free(s);
    kv_model_close(m);
}
