/* llama2.c checkpoint and tokenizer.bin readers. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llama2c.h"
#include "model.h"
#include "testutil.h"
#include "tokenizer.h"

static const char *fmt_err(const struct kv_err *e) {
    static char buf[2048];
    kv_err_format(e, buf, sizeof buf, 0);
    return buf;
}

/* ------------------------------------------------------------ checkpoint */

struct ckpt {
    int32_t h[7]; /* dim, hidden, layers, heads, kv heads, vocab, seq */
    uint8_t *p;
    size_t len;
    int64_t n_floats;
};

/* Floats of the body implied by a header (the layout of llama2c.h). */
static int64_t body_floats(const int32_t *h) {
    int64_t d = h[0], hid = h[1], L = h[2], hd = h[0] / h[3], kvd = h[4] * hd;
    int64_t V = h[5] < 0 ? -h[5] : h[5], S = h[6];
    int64_t n = V * d + L * d + L * d * d + 2 * L * kvd * d + L * d * d + L * d + 3 * L * hid * d +
                d + S * hd;
    if (h[5] < 0) n += V * d;
    return n;
}

/* Header then float(i) for body element i, so every value names its place. */
static void make_ckpt(struct ckpt *c, const int32_t h[7]) {
    memcpy(c->h, h, sizeof c->h);
    c->n_floats = body_floats(h);
    c->len = 28 + (size_t)c->n_floats * 4;
    c->p = malloc(c->len);
    for (int i = 0; i < 7; i++) {
        uint32_t u = (uint32_t)h[i];
        for (int b = 0; b < 4; b++) c->p[4 * i + b] = (uint8_t)(u >> (8 * b));
    }
    for (int64_t i = 0; i < c->n_floats; i++) {
        float x = (float)i;
        uint32_t u;
        memcpy(&u, &x, 4);
        for (int b = 0; b < 4; b++) c->p[28 + 4 * i + b] = (uint8_t)(u >> (8 * b));
    }
}

/* dim 16, hidden 24, 2 layers, 4 heads (head_dim 4), 2 kv heads, vocab 10, seq 6 */
static const int32_t tiny_h[7] = {16, 24, 2, 4, 2, 10, 6};

static int load_bytes(const void *buf, size_t len, struct kv_model **m, struct kv_err *err,
                      char **pathp) {
    char *path = kvt_write_temp(buf, len, ".bin");
    int rc = kv_l2c_load(path, m, err);
    unlink(path);
    *pathp = path;
    return rc;
}

Test(l2c, round_trips_a_tiny_checkpoint) {
    struct ckpt c;
    make_ckpt(&c, tiny_h);
    struct kv_model *m;
    struct kv_err err;
    char *path;
    int rc = load_bytes(c.p, c.len, &m, &err, &path);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    const struct kv_config *cf = kv_model_config(m);
    cr_assert_eq(cf->dim, 16);
    cr_assert_eq(cf->hidden_dim, 24);
    cr_assert_eq(cf->n_layers, 2);
    cr_assert_eq(cf->n_heads, 4);
    cr_assert_eq(cf->n_kv_heads, 2);
    cr_assert_eq(cf->head_dim, 4);
    cr_assert_eq(cf->vocab_size, 10);
    cr_assert_eq(cf->max_seq_len, 6);
    cr_assert_eq(cf->norm_eps, 1e-5f);
    cr_assert_eq(cf->rope_theta, 10000.0f);
    cr_assert_eq(cf->rope_layout, KV_ROPE_INTERLEAVED);
    cr_assert_eq(cf->tied_embeddings, 1);
    cr_assert_eq(cf->bos_id, 1);
    cr_assert_eq(cf->eos_id, 2);
    cr_assert_eq(kv_model_format(m), KV_FORMAT_LLAMA2C);
    cr_assert_null(kv_model_tokenizer(m));

    /* Expected start (in floats) of each region, from the documented order. */
    int64_t d = 16, hid = 24, L = 2, kvd = 8, V = 10;
    int64_t emb = 0, rms_att = emb + V * d, wq = rms_att + L * d, wk = wq + L * d * d,
            wv = wk + L * kvd * d, wo = wv + L * kvd * d, rms_ffn = wo + L * d * d,
            w1 = rms_ffn + L * d, w2 = w1 + L * hid * d, w3 = w2 + L * d * hid,
            rms_final = w3 + L * hid * d, fr = rms_final + d, fi = fr + 6 * 2,
            end = fi + 6 * 2;
    cr_assert_eq(end, c.n_floats);
    cr_assert_eq(m->tok_emb[0], (float)emb);
    cr_assert_eq(m->tok_emb[V * d - 1], (float)(V * d - 1));
    cr_assert_eq(m->lm_head, m->tok_emb);
    cr_assert_eq(m->out_norm[3], (float)(rms_final + 3));
    struct {
        enum kv_wkind k;
        int64_t base, per_layer;
    } chk[] = {
        {KV_W_ATTN_NORM, rms_att, d}, {KV_W_Q, wq, d * d},        {KV_W_K, wk, kvd * d},
        {KV_W_V, wv, kvd * d},        {KV_W_O, wo, d * d},        {KV_W_FFN_NORM, rms_ffn, d},
        {KV_W_GATE, w1, hid * d},     {KV_W_DOWN, w2, d * hid},   {KV_W_UP, w3, hid * d},
    };
    for (size_t i = 0; i < sizeof chk / sizeof chk[0]; i++)
        for (int64_t l = 0; l < L; l++) {
            const float *w = m->layers[l].w[chk[i].k];
            int64_t first = chk[i].base + l * chk[i].per_layer;
            cr_assert_eq(w[0], (float)first, "%s layer %lld", kv_wkind_name(chk[i].k), (long long)l);
            cr_assert_eq(w[chk[i].per_layer - 1], (float)(first + chk[i].per_layer - 1));
        }

    /* Tensor table: file order, readable names, absolute offsets. */
    cr_assert_eq(kv_model_n_tensors(m), 1 + 9 * 2 + 1 + 2);
    const char *names[] = {"token_embedding", "layers.0.rms_att", "layers.1.rms_att",
                           "layers.0.wq",     "layers.1.wq",      "layers.0.wk"};
    for (int i = 0; i < 6; i++) cr_assert_str_eq(kv_model_tensor(m, i)->name, names[i]);
    const struct kv_tensor *t = kv_model_tensor(m, 4);
    cr_assert_eq(t->offset, 28 + (uint64_t)(wq + d * d) * 4);
    cr_assert_eq(t->nbytes, (uint64_t)(d * d) * 4);
    cr_assert(t->ndim == 2 && t->shape[0] == 16 && t->shape[1] == 16);
    const struct kv_tensor *last = kv_model_tensor(m, kv_model_n_tensors(m) - 1);
    cr_assert_str_eq(last->name, "freq_cis_imag");
    cr_assert(last->shape[0] == 6 && last->shape[1] == 2);
    cr_assert_eq(last->offset + last->nbytes, c.len);
    kv_model_close(m);
    free(path);
    free(c.p);
}

Test(l2c, negative_vocab_means_an_untied_classifier) {
    int32_t h[7];
    memcpy(h, tiny_h, sizeof h);
    h[5] = -10;
    struct ckpt c;
    make_ckpt(&c, h);
    struct kv_model *m;
    struct kv_err err;
    char *path;
    cr_assert_eq(load_bytes(c.p, c.len, &m, &err, &path), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_model_config(m)->tied_embeddings, 0);
    cr_assert_eq(kv_model_config(m)->vocab_size, 10);
    cr_assert_neq(m->lm_head, m->tok_emb);
    cr_assert_eq(m->lm_head[0], (float)(c.n_floats - 160));
    cr_assert_str_eq(kv_model_tensor(m, kv_model_n_tensors(m) - 1)->name, "wcls");
    kv_model_close(m);
    free(path);
    free(c.p);
}

Test(l2c, rejects_size_mismatch_with_the_exact_message) {
    struct ckpt c;
    make_ckpt(&c, tiny_h);
    size_t want_len = c.len;
    struct kv_model *m = NULL;
    struct kv_err err;
    char *path, want[1200];
    cr_assert_eq(load_bytes(c.p, c.len - 4, &m, &err, &path), KV_EFORMAT);
    snprintf(want, sizeof want,
             "%s: file is %zu bytes but header (dim 16, hidden 24, layers 2, heads 4, kv heads 2, "
             "vocab 10, seq 6) implies %zu",
             path, want_len - 4, want_len);
    cr_assert_str_eq(fmt_err(&err), want);
    free(path);
    uint8_t *big = calloc(1, c.len + 3);
    memcpy(big, c.p, c.len);
    cr_assert_eq(load_bytes(big, c.len + 3, &m, &err, &path), KV_EFORMAT);
    cr_assert(strstr(err.msg, "implies"), "%s", err.msg);
    char num[64];
    snprintf(num, sizeof num, "file is %zu bytes", want_len + 3);
    cr_assert(strstr(err.msg, num), "%s", err.msg);
    free(path);
    free(big);
    free(c.p);
}

Test(l2c, rejects_bad_header_values) {
    struct {
        int field;
        int32_t value;
        int code;
        const char *msg;
        uint64_t off;
    } rows[] = {
        {3, 0, KV_EFORMAT, "header n_heads is 0, expected 1..1048576", 12},
        {0, 30, KV_EFORMAT, "header dim 30 is not divisible by n_heads 4", 0},
        {4, 3, KV_EFORMAT, "header n_heads 4 is not a multiple of n_kv_heads 3", 16},
        {0, -16, KV_EFORMAT, "header dim is -16, expected 1..1048576", 0},
        {2, 5000, KV_EFORMAT, "header n_layers is 5000, expected 1..1024", 8},
        {5, INT32_MIN, KV_EFORMAT, "header vocab_size is -2147483648, expected 1..4194304", 20},
        {6, 0, KV_EFORMAT, "header seq_len is 0, expected 1..1048576", 24},
        {0, 12, KV_EFORMAT, "head size 3 (dim 12 / n_heads 4) is odd; rope needs pairs", 0},
        {0, 0x616b3432, KV_EUNSUPPORTED,
         "llama2.c export version 24 file (magic 'ak42'); kvcal reads only the legacy version 0 "
         "layout",
         0},
    };
    struct ckpt c;
    make_ckpt(&c, tiny_h);
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        uint8_t *b = malloc(c.len);
        memcpy(b, c.p, c.len);
        uint32_t u = (uint32_t)rows[r].value;
        for (int k = 0; k < 4; k++) b[4 * rows[r].field + k] = (uint8_t)(u >> (8 * k));
        struct kv_model *m = NULL;
        struct kv_err err;
        int rc = kv_l2c_parse(b, c.len, "h.bin", &m, &err);
        cr_assert_eq(rc, rows[r].code, "row %zu: %s", r, fmt_err(&err));
        cr_assert_str_eq(err.msg, rows[r].msg, "row %zu", r);
        cr_assert_eq(err.off, rows[r].off, "row %zu", r);
        free(b);
    }
    free(c.p);
}

Test(l2c, rejects_a_truncated_header) {
    struct ckpt c;
    make_ckpt(&c, tiny_h);
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_l2c_parse(c.p, 10, "short.bin", &m, &err), KV_EFORMAT);
    cr_assert_str_eq(fmt_err(&err),
                     "short.bin: offset 8: truncated: need 4 bytes for header n_layers, have 2");
    cr_assert_eq(kv_l2c_parse(NULL, 0, "empty.bin", &m, &err), KV_EFORMAT);
    cr_assert_str_eq(fmt_err(&err),
                     "empty.bin: offset 0: truncated: need 4 bytes for header dim, have 0");
    free(c.p);
}

Test(l2c, stories260k_loads_and_a_cut_copy_is_refused) {
    KVT_NEED_SHARED(path, "models/stories260K/stories260K.bin");
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_l2c_load(path, &m, &err), KV_OK, "%s", fmt_err(&err));
    const struct kv_config *cf = kv_model_config(m);
    cr_assert(cf->dim == 64 && cf->hidden_dim == 172 && cf->n_layers == 5 && cf->n_heads == 8 &&
              cf->n_kv_heads == 4 && cf->head_dim == 8 && cf->vocab_size == 512 &&
              cf->max_seq_len == 512 && cf->tied_embeddings == 1);
    cr_assert_eq(kv_model_n_tensors(m), 1 + 9 * 5 + 1 + 2);
    kv_model_close(m);

    size_t len;
    char *bytes = kvt_read_file(path, &len);
    cr_assert_eq(len, 1056540);
    char *cut;
    cr_assert_eq(load_bytes(bytes, len - 4, &m, &err, &cut), KV_EFORMAT);
    char want[1200];
    snprintf(want, sizeof want,
             "%s: file is 1056536 bytes but header (dim 64, hidden 172, layers 5, heads 8, kv "
             "heads 4, vocab 512, seq 512) implies 1056540",
             cut);
    cr_assert_str_eq(fmt_err(&err), want);
    free(cut);
    free(bytes);
}

/* ------------------------------------------------------------ tokenizer.bin */

struct tbuf {
    uint8_t p[4096];
    size_t len;
    size_t tok_off[16];
};
static void tb_u32(struct tbuf *t, uint32_t v) {
    for (int i = 0; i < 4; i++) t->p[t->len++] = (uint8_t)(v >> (8 * i));
}
static void tb_tok(struct tbuf *t, int id, float score, const char *s, int32_t len) {
    t->tok_off[id] = t->len;
    uint32_t u;
    memcpy(&u, &score, 4);
    tb_u32(t, u);
    tb_u32(t, (uint32_t)len);
    memcpy(t->p + t->len, s, (size_t)(len > 0 ? len : 0));
    t->len += (size_t)(len > 0 ? len : 0);
}
static void tiny_tok(struct tbuf *t) {
    t->len = 0;
    tb_u32(t, 6);
    tb_tok(t, 0, 0.0f, "<unk>", 5);
    tb_tok(t, 1, 0.0f, "\n<s>\n", 5);
    tb_tok(t, 2, 0.0f, "\n</s>\n", 6);
    tb_tok(t, 3, 0.0f, "<0x41>", 6);
    tb_tok(t, 4, -1.5f, " ab", 3);
    tb_tok(t, 5, -2.0f, "<0x4g>", 6);
}

Test(l2c_tok, reads_pieces_scores_and_types) {
    struct tbuf t;
    tiny_tok(&t);
    for (int pass = 0; pass < 2; pass++) {
        struct kv_tokenizer *tok;
        struct kv_err err;
        int rc = kv_l2c_parse_tokenizer(t.p, t.len, "tok.bin", pass ? 6 : -1, &tok, &err);
        cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(kv_tok_n_vocab(tok), 6);
        cr_assert_eq(kv_tok_bos(tok), 1);
        cr_assert_eq(kv_tok_eos(tok), 2);
        cr_assert_eq(kv_tok_mode(tok), KV_TOK_SCORE);
        const int types[6] = {KV_TOKT_UNKNOWN, KV_TOKT_CONTROL, KV_TOKT_CONTROL,
                              KV_TOKT_BYTE,    KV_TOKT_NORMAL,  KV_TOKT_NORMAL};
        for (int i = 0; i < 6; i++) cr_assert_eq(kv_tok_type(tok, i), types[i], "type of %d", i);
        size_t n;
        const char *p = kv_tok_piece(tok, 4, &n);
        cr_assert(n == 3 && !memcmp(p, " ab", 3));
        cr_assert_eq(kv_tok_score(tok, 4), -1.5f);
        kv_tok_free(tok);
    }
}

Test(l2c_tok, rejects_truncation_and_bad_lengths) {
    struct tbuf t;
    tiny_tok(&t);
    struct kv_tokenizer *tok;
    struct kv_err err;
    char want[256];
    /* cut inside the bytes of the last token */
    cr_assert_eq(kv_l2c_parse_tokenizer(t.p, t.len - 2, "tok.bin", -1, &tok, &err), KV_EFORMAT);
    snprintf(want, sizeof want, "tok.bin: offset %zu: truncated: need 6 bytes for the bytes of token 5, have 4",
             t.tok_off[5] + 8);
    cr_assert_str_eq(fmt_err(&err), want);
    /* cut inside a length */
    cr_assert_eq(kv_l2c_parse_tokenizer(t.p, t.tok_off[3] + 6, "tok.bin", -1, &tok, &err),
                 KV_EFORMAT);
    snprintf(want, sizeof want,
             "tok.bin: offset %zu: truncated: need 4 bytes for the length of token 3, have 2",
             t.tok_off[3] + 4);
    cr_assert_str_eq(fmt_err(&err), want);
    /* more tokens asked for than present */
    cr_assert_eq(kv_l2c_parse_tokenizer(t.p, t.len, "tok.bin", 7, &tok, &err), KV_EFORMAT);
    snprintf(want, sizeof want,
             "tok.bin: offset %zu: truncated: need 4 bytes for the score of token 6, have 0", t.len);
    cr_assert_str_eq(fmt_err(&err), want);
    /* fewer */
    cr_assert_eq(kv_l2c_parse_tokenizer(t.p, t.len, "tok.bin", 5, &tok, &err), KV_EFORMAT);
    snprintf(want, sizeof want, "tok.bin: offset %zu: 14 bytes follow the last of 5 tokens",
             t.tok_off[5]);
    cr_assert_str_eq(fmt_err(&err), want);
    /* negative and oversized lengths */
    struct tbuf b = t;
    uint32_t neg = (uint32_t)-1;
    memcpy(b.p + t.tok_off[4] + 4, &neg, 4);
    cr_assert_eq(kv_l2c_parse_tokenizer(b.p, b.len, "tok.bin", -1, &tok, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "token 4 has length -1, expected 0..4096");
    cr_assert_eq(err.off, t.tok_off[4] + 4);
    b = t;
    b.p[t.tok_off[4] + 4] = 7; /* 7 > max_token_length 6 */
    cr_assert_eq(kv_l2c_parse_tokenizer(b.p, b.len, "tok.bin", -1, &tok, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "token 4 has length 7, more than max_token_length 6");
    /* a NaN score */
    b = t;
    uint32_t nan_bits = 0x7fc00000u;
    memcpy(b.p + t.tok_off[4], &nan_bits, 4);
    cr_assert_eq(kv_l2c_parse_tokenizer(b.p, b.len, "tok.bin", -1, &tok, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "token 4 has score nan, expected a finite number");
    /* too few tokens */
    cr_assert_eq(kv_l2c_parse_tokenizer(t.p, t.tok_off[2], "tok.bin", -1, &tok, &err), KV_EFORMAT);
    cr_assert_str_eq(fmt_err(&err), "tok.bin: tokenizer has 2 tokens, expected at least 3 (unk, bos, eos)");
    /* every prefix fails without crashing, except those ending on the
     * boundary after 3 or more tokens, which are valid shorter vocabularies */
    for (size_t n = 0; n < t.len; n++) {
        int boundary = n == t.tok_off[3] || n == t.tok_off[4] || n == t.tok_off[5];
        int rc = kv_l2c_parse_tokenizer(t.p, n, "tok.bin", -1, &tok, &err);
        cr_assert_eq(rc, boundary ? KV_OK : KV_EFORMAT, "prefix %zu", n);
        if (!rc) kv_tok_free(tok);
    }
}

Test(l2c_tok, llama2_tokenizer_has_32000_pieces) {
    KVT_NEED_SHARED(path, "models/llama2-tokenizer/tokenizer.bin");
    struct kv_tokenizer *tok;
    struct kv_err err;
    for (int pass = 0; pass < 2; pass++) {
        int rc = kv_l2c_load_tokenizer(path, pass ? 32000 : -1, &tok, &err);
        cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(kv_tok_n_vocab(tok), 32000);
        cr_assert_eq(kv_tok_type(tok, 3), KV_TOKT_BYTE);
        cr_assert_eq(kv_tok_type(tok, 258), KV_TOKT_BYTE);
        cr_assert_eq(kv_tok_type(tok, 259), KV_TOKT_NORMAL);
        size_t n;
        const char *p = kv_tok_piece(tok, 31999, &n);
        cr_assert(n > 0 && p);
        kv_tok_free(tok);
    }
    cr_assert_eq(kv_l2c_load_tokenizer(path, 32001, &tok, &err), KV_EFORMAT);
    cr_assert(strstr(err.msg, "truncated: need 4 bytes for the score of token 32000, have 0"),
              "%s", err.msg);
}

Test(l2c_tok, llama2_tokenizer_encodes_the_published_example) {
    KVT_NEED_SHARED(path, "models/llama2-tokenizer/tokenizer.bin");
    struct kv_tokenizer *tok;
    struct kv_err err;
    cr_assert_eq(kv_l2c_load_tokenizer(path, -1, &tok, &err), KV_OK, "%s", fmt_err(&err));
    const char *text = "I believe the meaning of life is";
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(tok, text, strlen(text), 1, &ids, &n, &err), KV_OK, "%s",
                 fmt_err(&err));
    const int32_t want[] = {1, 306, 4658, 278, 6593, 310, 2834, 338};
    cr_assert_eq(n, 8);
    for (int i = 0; i < 8; i++) cr_assert_eq(ids[i], want[i], "id %d", i);
    free(ids);
    kv_tok_free(tok);
}
