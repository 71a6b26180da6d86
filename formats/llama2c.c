/* llama2.c checkpoint and tokenizer.bin readers. Layouts are in llama2c.h. */
#include "llama2c.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cursor.h"
#include "err.h"
#include "limits.h"
#include "mapfile.h"
#include "model.h"
#include "tokenizer.h"

#define L2C_HEADER_BYTES 28u
/* First int32 of the newer llama2.c export formats ("ak42" little-endian). */
#define L2C_EXPORT_MAGIC 0x616b3432u

/* ------------------------------------------------------------ checkpoint */

struct l2c_header {
    int32_t dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len;
};

static int check_header(const struct l2c_header *h, const char *path, struct kv_err *err) {
    if ((uint32_t)h->dim == L2C_EXPORT_MAGIC) {
        uint32_t version = (uint32_t)h->hidden;
        return kv_fail(err, KV_EUNSUPPORTED, path, 0,
                       "llama2.c export version %u file (magic 'ak42'); kvcal reads only the "
                       "legacy version 0 layout",
                       version);
    }
    const struct {
        const char *name;
        int64_t v, max;
        uint64_t off;
    } f[] = {
        {"dim", h->dim, KV_MAX_DIM, 0},
        {"hidden_dim", h->hidden, KV_MAX_DIM, 4},
        {"n_layers", h->n_layers, KV_MAX_LAYERS, 8},
        {"n_heads", h->n_heads, KV_MAX_DIM, 12},
        {"n_kv_heads", h->n_kv_heads, KV_MAX_DIM, 16},
        {"vocab_size", h->vocab < 0 ? -(int64_t)h->vocab : h->vocab, KV_MAX_VOCAB, 20},
        {"seq_len", h->seq_len, KV_MAX_CTX, 24},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < 1 || f[i].v > f[i].max)
            return kv_fail(err, KV_EFORMAT, path, f[i].off, "header %s is %lld, expected 1..%lld",
                           f[i].name, (long long)(i == 5 ? h->vocab : f[i].v),
                           (long long)f[i].max);
    if (h->dim % h->n_heads)
        return kv_fail(err, KV_EFORMAT, path, 0, "header dim %d is not divisible by n_heads %d",
                       h->dim, h->n_heads);
    if (h->n_heads % h->n_kv_heads)
        return kv_fail(err, KV_EFORMAT, path, 16,
                       "header n_heads %d is not a multiple of n_kv_heads %d", h->n_heads,
                       h->n_kv_heads);
    if ((h->dim / h->n_heads) % 2)
        return kv_fail(err, KV_EFORMAT, path, 0,
                       "head size %d (dim %d / n_heads %d) is odd; rope needs pairs",
                       h->dim / h->n_heads, h->dim, h->n_heads);
    return KV_OK;
}

/* One array of the file: rows of `count` views of shape (ndim, s0, s1). */
struct l2c_array {
    const char *name; /* per-layer arrays are "layers.%lld.<name>" */
    int per_layer;
    int ndim;
    int64_t s0, s1;
    int kind; /* enum kv_wkind, or -1 (not bound) */
};

static int64_t arr_numel(const struct l2c_array *a) { return a->ndim == 2 ? a->s0 * a->s1 : a->s0; }

int kv_l2c_parse(const uint8_t *buf, uint64_t len, const char *path, struct kv_model **out,
                 struct kv_err *err) {
    struct kv_cursor c;
    kv_cur_init(&c, buf, len, path, err);
    struct l2c_header h;
    int32_t *fields[7] = {&h.dim, &h.hidden, &h.n_layers, &h.n_heads, &h.n_kv_heads, &h.vocab,
                          &h.seq_len};
    static const char *const what[7] = {"header dim",     "header hidden_dim", "header n_layers",
                                        "header n_heads", "header n_kv_heads", "header vocab_size",
                                        "header seq_len"};
    for (int i = 0; i < 7; i++) {
        int rc = kv_cur_i32(&c, fields[i], what[i]);
        if (rc) return rc;
    }
    int rc = check_header(&h, path, err);
    if (rc) return rc;

    /* All values are bounded by the limits (<= 2^22), so products of two fit
     * easily; sums and the final size use checked math anyway. */
    int64_t d = h.dim, hid = h.hidden, L = h.n_layers, hd = h.dim / h.n_heads;
    int64_t qd = h.n_heads * hd, kvd = h.n_kv_heads * hd, V = h.vocab < 0 ? -(int64_t)h.vocab : h.vocab;
    int64_t S = h.seq_len;
    const struct l2c_array arrays[] = {
        {"token_embedding", 0, 2, V, d, KV_W_TOK_EMB},
        {"rms_att", 1, 1, d, 0, KV_W_ATTN_NORM},
        {"wq", 1, 2, qd, d, KV_W_Q},
        {"wk", 1, 2, kvd, d, KV_W_K},
        {"wv", 1, 2, kvd, d, KV_W_V},
        {"wo", 1, 2, d, qd, KV_W_O},
        {"rms_ffn", 1, 1, d, 0, KV_W_FFN_NORM},
        {"w1", 1, 2, hid, d, KV_W_GATE},
        {"w2", 1, 2, d, hid, KV_W_DOWN},
        {"w3", 1, 2, hid, d, KV_W_UP},
        {"rms_final", 0, 1, d, 0, KV_W_OUT_NORM},
        {"freq_cis_real", 0, 2, S, hd / 2, -1},
        {"freq_cis_imag", 0, 2, S, hd / 2, -1},
        {"wcls", 0, 2, V, d, KV_W_LM_HEAD},
    };
    const size_t n_arrays = sizeof arrays / sizeof arrays[0] - (h.vocab > 0 ? 1 : 0);
    uint64_t expect = L2C_HEADER_BYTES;
    int64_t n_views = 0;
    int ok = 1;
    for (size_t i = 0; i < n_arrays; i++) {
        uint64_t bytes;
        ok = ok && kv_mul_u64((uint64_t)arr_numel(&arrays[i]), 4u * (arrays[i].per_layer ? (uint64_t)L : 1u), &bytes) &&
             kv_add_u64(expect, bytes, &expect);
        n_views += arrays[i].per_layer ? L : 1;
    }
    if (!ok || expect != len) {
        char implied[32];
        if (ok)
            snprintf(implied, sizeof implied, "%llu", (unsigned long long)expect);
        else
            snprintf(implied, sizeof implied, "more than 2^64 bytes");
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "file is %llu bytes but header (dim %d, hidden %d, layers %d, heads %d, kv "
                       "heads %d, vocab %d, seq %d) implies %s",
                       (unsigned long long)len, h.dim, h.hidden, h.n_layers, h.n_heads,
                       h.n_kv_heads, h.vocab, h.seq_len, implied);
    }

    struct kv_config cfg = {
        .arch = KV_ARCH_LLAMA,
        .dim = d,
        .hidden_dim = hid,
        .n_layers = L,
        .n_heads = h.n_heads,
        .n_kv_heads = h.n_kv_heads,
        .head_dim = hd,
        .vocab_size = V,
        .max_seq_len = S,
        .norm_eps = 1e-5f,
        .rope_theta = 10000.0f,
        .rope_layout = KV_ROPE_INTERLEAVED,
        .tied_embeddings = h.vocab > 0,
        .has_qkv_bias = 0,
        .bos_id = 1,
        .eos_id = 2,
    };
    struct kv_model *m;
    if ((rc = kv_model_create(&cfg, KV_FORMAT_LLAMA2C, path, &m, err))) return rc;
    struct kv_tensor *table = calloc((size_t)n_views, sizeof *table);
    if (!table) {
        kv_model_close(m);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    uint64_t off = L2C_HEADER_BYTES;
    int64_t k = 0;
    for (size_t i = 0; i < n_arrays; i++) {
        const struct l2c_array *a = &arrays[i];
        int64_t reps = a->per_layer ? L : 1;
        uint64_t bytes = (uint64_t)arr_numel(a) * 4u;
        for (int64_t l = 0; l < reps; l++, k++) {
            struct kv_tensor *t = &table[k];
            if (a->per_layer)
                snprintf(t->name, sizeof t->name, "layers.%lld.%s", (long long)l, a->name);
            else
                snprintf(t->name, sizeof t->name, "%s", a->name);
            t->dtype = KV_DTYPE_F32;
            t->ndim = a->ndim;
            t->shape[0] = a->s0;
            t->shape[1] = a->ndim == 2 ? a->s1 : 0;
            t->offset = off;
            t->nbytes = bytes;
            t->data = buf + off;
            t->file = 0;
            off += bytes;
            if (a->kind >= 0 &&
                (rc = kv_model_bind(m, (enum kv_wkind)a->kind, l, t, path, err))) {
                free(table);
                kv_model_close(m);
                return rc;
            }
        }
    }
    KV_ASSERT(off == len && k == n_views);
    rc = kv_model_add_tensors(m, table, n_views, err);
    free(table);
    if (!rc) rc = kv_model_finish(m, path, err);
    if (rc) {
        kv_model_close(m);
        return rc;
    }
    *out = m;
    return KV_OK;
}

int kv_l2c_load(const char *path, struct kv_model **out, struct kv_err *err) {
    struct kv_map *map;
    int rc = kv_map_open_heap(path, &map, err);
    if (rc) return rc;
    struct kv_model *m;
    if ((rc = kv_l2c_parse(map->data, map->len, path, &m, err))) {
        kv_map_free_cb(map);
        return rc;
    }
    if ((rc = kv_model_on_close(m, kv_map_free_cb, map, err))) {
        kv_map_free_cb(map);
        kv_model_close(m);
        return rc;
    }
    *out = m;
    return KV_OK;
}

/* ------------------------------------------------------------ tokenizer */

static int is_byte_piece(const uint8_t *p, int32_t n) {
    if (n != 6 || memcmp(p, "<0x", 3) != 0 || p[5] != '>') return 0;
    for (int i = 3; i < 5; i++)
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'A' && p[i] <= 'F'))) return 0;
    return 1;
}

/* Read one token record at the cursor, validating it. */
static int read_token(struct kv_cursor *c, int64_t id, uint32_t max_len, float *score,
                      const uint8_t **piece, int32_t *len) {
    char what[64];
    uint64_t tok_off = c->pos;
    snprintf(what, sizeof what, "the score of token %lld", (long long)id);
    int rc = kv_cur_f32(c, score, what);
    if (rc) return rc;
    uint64_t len_off = c->pos;
    snprintf(what, sizeof what, "the length of token %lld", (long long)id);
    if ((rc = kv_cur_i32(c, len, what))) return rc;
    if (*len < 0 || *len > KV_MAX_PIECE)
        return kv_fail(c->err, KV_EFORMAT, c->path, len_off,
                       "token %lld has length %d, expected 0..%d", (long long)id, *len,
                       KV_MAX_PIECE);
    if ((uint32_t)*len > max_len)
        return kv_fail(c->err, KV_EFORMAT, c->path, len_off,
                       "token %lld has length %d, more than max_token_length %u", (long long)id,
                       *len, max_len);
    snprintf(what, sizeof what, "the bytes of token %lld", (long long)id);
    if ((rc = kv_cur_bytes(c, (uint64_t)*len, piece, what))) return rc;
    if (!isfinite(*score))
        return kv_fail(c->err, KV_EFORMAT, c->path, tok_off,
                       "token %lld has score %g, expected a finite number", (long long)id,
                       (double)*score);
    return KV_OK;
}

int kv_l2c_parse_tokenizer(const uint8_t *buf, uint64_t len, const char *path, int32_t n_vocab,
                           struct kv_tokenizer **out, struct kv_err *err) {
    if (n_vocab > KV_MAX_VOCAB)
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET, "vocabulary size %d exceeds the limit %d",
                       n_vocab, KV_MAX_VOCAB);
    struct kv_cursor c;
    kv_cur_init(&c, buf, len, path, err);
    uint32_t max_len;
    int rc = kv_cur_u32(&c, &max_len, "max_token_length");
    if (rc) return rc;
    /* Pass 1: validate every record and count them. */
    uint64_t first = c.pos;
    int64_t count = 0;
    while (n_vocab > 0 ? count < n_vocab : kv_cur_left(&c) > 0) {
        if (count >= KV_MAX_VOCAB)
            return kv_fail(err, KV_EFORMAT, path, c.pos, "more than %d tokens", KV_MAX_VOCAB);
        float score;
        const uint8_t *p;
        int32_t n;
        if ((rc = read_token(&c, count, max_len, &score, &p, &n))) return rc;
        count++;
    }
    if (kv_cur_left(&c) > 0)
        return kv_fail(err, KV_EFORMAT, path, c.pos, "%llu bytes follow the last of %d tokens",
                       (unsigned long long)kv_cur_left(&c), n_vocab);
    if (count < 3)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "tokenizer has %lld tokens, expected at least 3 (unk, bos, eos)",
                       (long long)count);
    /* Pass 2: build. */
    struct kv_tokenizer *tok;
    if ((rc = kv_tok_init(KV_TOK_SCORE, (int32_t)count, &tok, err))) return rc;
    c.pos = first;
    for (int64_t id = 0; id < count; id++) {
        float score;
        const uint8_t *p;
        int32_t n;
        rc = read_token(&c, id, max_len, &score, &p, &n);
        if (rc) break;
        int type = id == 0                ? KV_TOKT_UNKNOWN
                   : id <= 2              ? KV_TOKT_CONTROL
                   : is_byte_piece(p, n) ? KV_TOKT_BYTE
                                          : KV_TOKT_NORMAL;
        if ((rc = kv_tok_set_piece(tok, (int32_t)id, (const char *)p, (size_t)n, score, type, err)))
            break;
    }
    if (!rc) {
        kv_tok_set_special(tok, 1, 2, 0);
        rc = kv_tok_set_normalizer(tok, " ", 1, err);
    }
    if (!rc) rc = kv_tok_finish(tok, path, err);
    if (rc) {
        kv_tok_free(tok);
        return rc;
    }
    *out = tok;
    return KV_OK;
}

int kv_l2c_load_tokenizer(const char *path, int32_t n_vocab, struct kv_tokenizer **out,
                          struct kv_err *err) {
    struct kv_map map;
    int rc = kv_map_open(path, &map, err);
    if (rc) return rc;
    rc = kv_l2c_parse_tokenizer(map.data, map.len, path, n_vocab, out, err);
    kv_map_close(&map);
    return rc;
}
