/* What the tokenizer suites share (test_tokenizer.c, test_tokref.c): a
 * vocabulary kept as plain arrays, which the tests build kvcal tokenizers
 * from and the reference encoder reads directly, and a concatenated decode. */
#ifndef KV_TOK_FIXTURE_H
#define KV_TOK_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tokenizer.h"

#define SP "\xe2\x96\x81" /* U+2581, the SentencePiece space */

/* Capacities of a struct tb. */
enum { TB_MAX_PIECES = 1024, TB_MAX_MERGES = 1024, TB_MAX_LITS = 8 };

/* A vocabulary as plain arrays: the tests build kvcal tokenizers from it and
 * the reference encoder reads it directly. */
struct tb {
    enum kv_tok_mode mode;
    int n;
    char *s[TB_MAX_PIECES];
    size_t len[TB_MAX_PIECES];
    float score[TB_MAX_PIECES];
    int type[TB_MAX_PIECES];
    int nm;
    char *ma[TB_MAX_MERGES], *mb[TB_MAX_MERGES];
    size_t malen[TB_MAX_MERGES], mblen[TB_MAX_MERGES];
    int32_t mrank[TB_MAX_MERGES];
    int nl;
    int32_t lit[TB_MAX_LITS];
    const char *space;
    int dummy;
    int32_t bos, eos, unk;
};

/* A NUL-terminated copy of n bytes. */
static inline char *memdup(const char *s, size_t n) {
    char *d = malloc(n + 1);
    cr_assert(d);
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* Ids 0, 1, 2 are <unk>, <s>, </s>. */
static inline void tb_init(struct tb *b, enum kv_tok_mode mode, const char *space, int dummy) {
    memset(b, 0, sizeof *b);
    b->mode = mode;
    b->space = space;
    b->dummy = dummy;
    b->bos = 1;
    b->eos = 2;
    b->unk = 0;
}

/* Append a piece; returns its id. tb_add takes a C string. */
static inline int32_t tb_addn(struct tb *b, const char *s, size_t n, float score, int type) {
    cr_assert(b->n < TB_MAX_PIECES);
    b->s[b->n] = memdup(s, n);
    b->len[b->n] = n;
    b->score[b->n] = score;
    b->type[b->n] = type;
    return b->n++;
}

static inline int32_t tb_add(struct tb *b, const char *s, float score, int type) {
    return tb_addn(b, s, strlen(s), score, type);
}

/* Append <unk>, <s> and </s> (ids 0, 1, 2 after tb_init). */
static inline void tb_specials(struct tb *b) {
    tb_add(b, "<unk>", 0, KV_TOKT_UNKNOWN);
    tb_add(b, "<s>", 0, KV_TOKT_CONTROL);
    tb_add(b, "</s>", 0, KV_TOKT_CONTROL);
}

/* Appends <0x00>..<0xFF>; returns the id of <0x00>. */
static inline int32_t tb_bytes(struct tb *b) {
    int32_t first = b->n;
    for (int i = 0; i < 256; i++) {
        char p[8];
        snprintf(p, sizeof p, "<0x%02X>", i);
        tb_add(b, p, 0, KV_TOKT_BYTE);
    }
    return first;
}

/* Append the merge a + c of rank rank; tb_merge takes C strings. */
static inline void tb_mergen(struct tb *b, const char *a, size_t alen, const char *c, size_t clen,
                             int32_t rank) {
    cr_assert(b->nm < TB_MAX_MERGES);
    b->ma[b->nm] = memdup(a, alen);
    b->malen[b->nm] = alen;
    b->mb[b->nm] = memdup(c, clen);
    b->mblen[b->nm] = clen;
    b->mrank[b->nm] = rank;
    b->nm++;
}

static inline void tb_merge(struct tb *b, const char *a, const char *c, int32_t rank) {
    tb_mergen(b, a, strlen(a), c, strlen(c), rank);
}

/* Free what the tb_add and tb_merge calls copied. */
static inline void tb_free(struct tb *b) {
    for (int i = 0; i < b->n; i++) free(b->s[i]);
    for (int i = 0; i < b->nm; i++) {
        free(b->ma[i]);
        free(b->mb[i]);
    }
}

/* The kvcal tokenizer of b; fails the test on any error. */
static inline struct kv_tokenizer *tb_build(const struct tb *b) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_tokenizer *t = NULL;
    cr_assert_eq(kv_tok_init(b->mode, b->n, &t, &err), KV_OK, "%s", err.msg);
    for (int i = 0; i < b->n; i++)
        cr_assert_eq(kv_tok_set_piece(t, i, b->s[i], b->len[i], b->score[i], b->type[i], &err),
                     KV_OK, "%s", err.msg);
    for (int i = 0; i < b->nm; i++)
        cr_assert_eq(kv_tok_add_merge(t, b->ma[i], b->malen[i], b->mb[i], b->mblen[i],
                                      b->mrank[i], "merges.txt", &err),
                     KV_OK, "%s", err.msg);
    kv_tok_set_special(t, b->bos, b->eos, b->unk);
    cr_assert_eq(kv_tok_set_normalizer(t, b->space, b->dummy, &err), KV_OK, "%s", err.msg);
    for (int i = 0; i < b->nl; i++)
        cr_assert_eq(kv_tok_add_literal(t, b->lit[i], &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_tok_finish(t, "vocab", &err), KV_OK, "%s", err.msg);
    return t;
}

/* The ids as "1 2 3", cut to fit cap. */
static inline void fmt_ids(char *buf, size_t cap, const int32_t *ids, int64_t n) {
    size_t o = 0;
    buf[0] = 0;
    for (int64_t i = 0; i < n && o + 16 < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%d", i ? " " : "", (int)ids[i]);
}

/* Concatenated decode of ids[0..n), each with its predecessor as prev. */
static inline char *decode_all(const struct kv_tokenizer *t, const int32_t *ids, int64_t n,
                               size_t *out_len) {
    size_t cap = 64, len = 0;
    char *s = malloc(cap);
    cr_assert(s);
    for (int64_t i = 0; i < n; i++) {
        int32_t prev = i ? ids[i - 1] : -1;
        size_t k = kv_tok_decode(t, prev, ids[i], NULL, 0);
        while (len + k > cap) s = realloc(s, cap *= 2);
        cr_assert(s);
        cr_assert_eq(kv_tok_decode(t, prev, ids[i], s + len, k), k);
        len += k;
    }
    *out_len = len;
    return s;
}

#endif
