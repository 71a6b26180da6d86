/* Tokenizer: hand-built vocabularies with ids derived by hand, and a naive
 * quadratic reference encoder (llama2.c style: rescan every adjacent pair each
 * round) compared with kv_tok_encode on seeded random vocabularies and text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tokenizer.h"

#define NELEM(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))
#define SP "\xe2\x96\x81" /* U+2581, the SentencePiece space */

/* ---------------------------------------------------------------- vocab spec */

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

static char *memdup(const char *s, size_t n) {
    char *d = malloc(n + 1);
    cr_assert(d);
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* Ids 0, 1, 2 are <unk>, <s>, </s>. */
static void tb_init(struct tb *b, enum kv_tok_mode mode, const char *space, int dummy) {
    memset(b, 0, sizeof *b);
    b->mode = mode;
    b->space = space;
    b->dummy = dummy;
    b->bos = 1;
    b->eos = 2;
    b->unk = 0;
}

static int32_t tb_addn(struct tb *b, const char *s, size_t n, float score, int type) {
    cr_assert(b->n < TB_MAX_PIECES);
    b->s[b->n] = memdup(s, n);
    b->len[b->n] = n;
    b->score[b->n] = score;
    b->type[b->n] = type;
    return b->n++;
}

static int32_t tb_add(struct tb *b, const char *s, float score, int type) {
    return tb_addn(b, s, strlen(s), score, type);
}

static void tb_specials(struct tb *b) {
    tb_add(b, "<unk>", 0, KV_TOKT_UNKNOWN);
    tb_add(b, "<s>", 0, KV_TOKT_CONTROL);
    tb_add(b, "</s>", 0, KV_TOKT_CONTROL);
}

/* Appends <0x00>..<0xFF>; returns the id of <0x00>. */
static int32_t tb_bytes(struct tb *b) {
    int32_t first = b->n;
    for (int i = 0; i < 256; i++) {
        char p[8];
        snprintf(p, sizeof p, "<0x%02X>", i);
        tb_add(b, p, 0, KV_TOKT_BYTE);
    }
    return first;
}

static void tb_mergen(struct tb *b, const char *a, size_t alen, const char *c, size_t clen,
                      int32_t rank) {
    cr_assert(b->nm < TB_MAX_MERGES);
    b->ma[b->nm] = memdup(a, alen);
    b->malen[b->nm] = alen;
    b->mb[b->nm] = memdup(c, clen);
    b->mblen[b->nm] = clen;
    b->mrank[b->nm] = rank;
    b->nm++;
}

static void tb_merge(struct tb *b, const char *a, const char *c, int32_t rank) {
    tb_mergen(b, a, strlen(a), c, strlen(c), rank);
}

static void tb_free(struct tb *b) {
    for (int i = 0; i < b->n; i++) free(b->s[i]);
    for (int i = 0; i < b->nm; i++) {
        free(b->ma[i]);
        free(b->mb[i]);
    }
}

static struct kv_tokenizer *tb_build(const struct tb *b) {
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

/* ---------------------------------------------------------------- helpers */

static void fmt_ids(char *buf, size_t cap, const int32_t *ids, int64_t n) {
    size_t o = 0;
    buf[0] = 0;
    for (int64_t i = 0; i < n && o + 16 < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%d", i ? " " : "", (int)ids[i]);
}

static void expect_ids(const struct kv_tokenizer *t, const char *text, size_t len, int bos,
                       const int32_t *want, int64_t n_want) {
    struct kv_err err;
    kv_err_clear(&err);
    int32_t *ids = NULL;
    int64_t n = -1;
    cr_assert_eq(kv_tok_encode(t, text, len, bos, &ids, &n, &err), KV_OK, "%s", err.msg);
    char g[512], w[512];
    fmt_ids(g, sizeof g, ids, n);
    fmt_ids(w, sizeof w, want, n_want);
    cr_assert(n == n_want && memcmp(ids, want, (size_t)n * sizeof *ids) == 0,
              "encode '%.*s': got [%s], want [%s]", (int)len, text, g, w);
    free(ids);
}

#define EXPECT_IDS(tok, text, bos, ...)                                                    \
    do {                                                                                   \
        const int32_t want_[] = {__VA_ARGS__};                                             \
        expect_ids((tok), (text), sizeof(text) - 1, (bos), want_, NELEM(want_));           \
    } while (0)

/* Concatenated decode of ids[0..n), each with its predecessor as prev. */
static char *decode_all(const struct kv_tokenizer *t, const int32_t *ids, int64_t n,
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

static size_t decode1(const struct kv_tokenizer *t, int32_t prev, int32_t id, char *out,
                      size_t cap) {
    size_t n = kv_tok_decode(t, prev, id, out, cap);
    if (n < cap) out[n] = 0;
    return n;
}

/* ---------------------------------------------------------------- score mode */

Test(tok_encode, score_mode_merges_highest_score_first) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    int32_t a = tb_add(&b, "a", 0, 1), bb = tb_add(&b, "b", 0, 1), c = tb_add(&b, "c", 0, 1);
    tb_add(&b, "ab", -2, 1);
    int32_t bc = tb_add(&b, "bc", -1, 1);
    (void)bb;
    struct kv_tokenizer *t = tb_build(&b);
    /* ab (-2) loses to bc (-1) although it is further left; "abc" is absent */
    EXPECT_IDS(t, "abc", 0, a, bc);
    EXPECT_IDS(t, "cabc", 0, c, a, bc);
    kv_tok_free(t);
    tb_free(&b);
}

Test(tok_encode, score_mode_chains_merges) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    tb_add(&b, "a", 0, 1);
    tb_add(&b, "b", 0, 1);
    tb_add(&b, "c", 0, 1);
    tb_add(&b, "ab", -2, 1);
    tb_add(&b, "bc", -1, 1);
    int32_t abc = tb_add(&b, "abc", -3, 1);
    struct kv_tokenizer *t = tb_build(&b);
    EXPECT_IDS(t, "abc", 0, abc); /* bc first, then a+bc */
    kv_tok_free(t);
    tb_free(&b);
}

Test(tok_encode, score_mode_ties_go_leftmost) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    int32_t a = tb_add(&b, "a", 0, 1), aa = tb_add(&b, "aa", -1, 1);
    int32_t x = tb_add(&b, "x", 0, 1), y = tb_add(&b, "y", 0, 1), z = tb_add(&b, "z", 0, 1);
    int32_t xy = tb_add(&b, "xy", -4, 1), yz = tb_add(&b, "yz", -4, 1);
    int32_t p = tb_add(&b, "p", 0, 1), q = tb_add(&b, "q", 0, 1), r = tb_add(&b, "r", 0, 1);
    int32_t pq = tb_add(&b, "pq", -0.0f, 1), qr = tb_add(&b, "qr", 0.0f, 1);
    struct kv_tokenizer *t = tb_build(&b);
    EXPECT_IDS(t, "aaa", 0, aa, a);         /* rightmost-first would give a, aa */
    EXPECT_IDS(t, "aaaaa", 0, aa, aa, a);
    EXPECT_IDS(t, "xyz", 0, xy, z);         /* equal scores on different pairs */
    EXPECT_IDS(t, "zxyz", 0, z, xy, z);
    EXPECT_IDS(t, "pqr", 0, pq, r);         /* -0.0 and +0.0 are equal scores */
    (void)x, (void)y, (void)yz, (void)p, (void)q, (void)qr;
    kv_tok_free(t);
    tb_free(&b);
}

Test(tok_encode, duplicate_pieces_resolve_to_lowest_id) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    int32_t a = tb_add(&b, "a", 0, 1);
    tb_add(&b, "b", 0, 1);
    int32_t c = tb_add(&b, "c", 0, 1), d = tb_add(&b, "d", 0, 1);
    int32_t ab = tb_add(&b, "ab", -10, 1);
    tb_add(&b, "ab", 0, 1);                  /* higher id and score: never used */
    tb_add(&b, "cd", 0, KV_TOKT_CONTROL);    /* lowest "cd" is control: no merge */
    tb_add(&b, "cd", 0, 1);
    tb_add(&b, "a", 5, 1);
    struct kv_tokenizer *t = tb_build(&b);
    EXPECT_IDS(t, "ab", 0, ab);
    EXPECT_IDS(t, "cd", 0, c, d);
    EXPECT_IDS(t, "a", 0, a);
    kv_tok_free(t);
    tb_free(&b);
}

/* ---------------------------------------------------------------- rank mode */

static void rank_vs_score_vocab(struct tb *b, enum kv_tok_mode mode) {
    tb_init(b, mode, " ", 0);
    tb_specials(b);
    tb_add(b, "a", 0, 1);
    tb_add(b, "b", 0, 1);
    tb_add(b, "c", 0, 1);
    tb_add(b, "ab", 0, 1);  /* best by score */
    tb_add(b, "bc", -5, 1); /* best by rank */
    if (mode == KV_TOK_RANK) {
        tb_merge(b, "b", "c", 0);
        tb_merge(b, "a", "b", 1);
    }
}

Test(tok_encode, rank_mode_follows_merge_order_not_scores) {
    struct tb b;
    rank_vs_score_vocab(&b, KV_TOK_RANK);
    struct kv_tokenizer *t = tb_build(&b);
    /* ids: a 3, b 4, c 5, ab 6, bc 7 */
    EXPECT_IDS(t, "abc", 0, 3, 7);
    EXPECT_IDS(t, "abab", 0, 6, 6);
    kv_tok_free(t);
    tb_free(&b);

    rank_vs_score_vocab(&b, KV_TOK_SCORE);
    t = tb_build(&b);
    EXPECT_IDS(t, "abc", 0, 6, 5); /* score order picks ab */
    kv_tok_free(t);
    tb_free(&b);
}

Test(tok_encode, rank_mode_ties_go_leftmost_and_duplicates_keep_lowest_rank) {
    struct tb b;
    tb_init(&b, KV_TOK_RANK, " ", 0);
    tb_specials(&b);
    int32_t a = tb_add(&b, "a", 0, 1), aa = tb_add(&b, "aa", 0, 1);
    tb_add(&b, "x", 0, 1);
    tb_add(&b, "y", 0, 1);
    tb_add(&b, "z", 0, 1);
    int32_t xy = tb_add(&b, "xy", 0, 1), yz = tb_add(&b, "yz", 0, 1);
    int32_t x = 5, z = 7;
    tb_merge(&b, "a", "a", 0);
    tb_merge(&b, "x", "y", 9);
    tb_merge(&b, "y", "z", 9); /* same rank as x+y: leftmost wins */
    tb_merge(&b, "y", "z", 3); /* listed again with a lower rank: now first */
    struct kv_tokenizer *t = tb_build(&b);
    EXPECT_IDS(t, "aaa", 0, aa, a);
    EXPECT_IDS(t, "xyz", 0, x, yz);
    (void)xy, (void)z;
    kv_tok_free(t);
    tb_free(&b);
}

/* ---------------------------------------------------------------- fallback */

Test(tok_encode, byte_fallback_for_missing_characters) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    int32_t b0 = tb_bytes(&b); /* <0x00> is id 3 */
    int32_t a = tb_add(&b, "a", 0, 1), bb = tb_add(&b, "b", 0, 1), x = tb_add(&b, "x", 0, 1);
    tb_add(&b, "x\xe2", 10, 1); /* would match the span x + first byte of '€' */
    tb_add(&b, "\xe2\x82", 10, 1);
    struct kv_tokenizer *t = tb_build(&b);
    cr_assert_eq(b0, 3);
    /* '€' = E2 82 AC is not a piece: three byte tokens that never merge */
    EXPECT_IDS(t, "x\xe2\x82\xac" "b", 0, x, 3 + 0xe2, 3 + 0x82, 3 + 0xac, bb);
    EXPECT_IDS(t, "azb", 0, a, 3 + 'z', bb);
    EXPECT_IDS(t, "a\xff\x80", 0, a, 3 + 0xff, 3 + 0x80); /* malformed bytes */
    /* truncated sequence: the lead byte is malformed on its own */
    EXPECT_IDS(t, "\xe2\x82" "a", 0, 3 + 0xe2, 3 + 0x82, a);
    /* a NUL byte inside the text */
    const char nul[] = {'a', 0, 'b'};
    const int32_t want[] = {a, 3, bb};
    expect_ids(t, nul, 3, 0, want, 3);
    kv_tok_free(t);
    tb_free(&b);
}

Test(tok_encode, unknown_id_without_byte_tokens) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    int32_t a = tb_add(&b, "a", 0, 1), bb = tb_add(&b, "b", 0, 1), ab = tb_add(&b, "ab", 0, 1);
    struct kv_tokenizer *t = tb_build(&b);
    /* one unknown per byte of a character with no piece, never merged */
    EXPECT_IDS(t, "a\xe2\x82\xac\xe2\x82\xac" "b\xff" "ab", 0, a, 0, 0, 0, 0, 0, 0, bb, 0, ab);
    kv_tok_free(t);

    b.unk = -1;
    t = tb_build(&b);
    struct kv_err err;
    kv_err_clear(&err);
    int32_t *ids = NULL;
    int64_t n = 0;
    cr_assert_eq(kv_tok_encode(t, "a\xe2\x82\xac", 4, 0, &ids, &n, &err), KV_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "unknown") != NULL, "%s", err.msg);
    cr_assert_null(ids);
    kv_tok_free(t);
    tb_free(&b);
}

/* ---------------------------------------------------------------- normalise */

Test(tok_encode, dummy_prefix_and_space_piece) {
    for (int sp = 0; sp < 2; sp++) {
        const char *space = sp ? SP : " ";
        char piece[16];
        for (int dummy = 0; dummy < 2; dummy++) {
            struct tb b;
            tb_init(&b, KV_TOK_SCORE, space, dummy);
            tb_specials(&b);
            int32_t s = tb_add(&b, space, 0, 1);
            int32_t a = tb_add(&b, "a", 0, 1);
            tb_add(&b, "b", 0, 1);
            snprintf(piece, sizeof piece, "%sa", space);
            int32_t sa = tb_add(&b, piece, -1, 1);
            snprintf(piece, sizeof piece, "%sb", space);
            int32_t sb = tb_add(&b, piece, -2, 1);
            struct kv_tokenizer *t = tb_build(&b);
            if (dummy) {
                EXPECT_IDS(t, "a b", 0, sa, sb);
                EXPECT_IDS(t, " a", 0, s, sa);
                EXPECT_IDS(t, "a b", 1, 1, sa, sb);
            } else {
                EXPECT_IDS(t, "a b", 0, a, sb);
                EXPECT_IDS(t, " a", 0, sa);
                EXPECT_IDS(t, "a  ", 1, 1, a, s, s);
            }
            kv_tok_free(t);
            tb_free(&b);
        }
    }
}

Test(tok_encode, empty_text) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, SP, 1);
    tb_specials(&b);
    tb_add(&b, SP, 0, 1);
    struct kv_tokenizer *t = tb_build(&b);
    struct kv_err err;
    kv_err_clear(&err);
    int32_t *ids = NULL;
    int64_t n = -1;
    cr_assert_eq(kv_tok_encode(t, NULL, 0, 0, &ids, &n, &err), KV_OK);
    cr_assert_eq(n, 0);
    free(ids);
    EXPECT_IDS(t, "", 1, 1); /* no dummy prefix for empty text */
    kv_tok_free(t);
    tb_free(&b);
}

/* ---------------------------------------------------------------- literals */

Test(tok_encode, literals_split_text_and_match_longest) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, SP, 1);
    tb_specials(&b);
    tb_add(&b, SP, 0, 1);                        /* 3 */
    tb_add(&b, "h", 0, 1);                       /* 4 */
    int32_t i = tb_add(&b, "i", 0, 1);           /* 5 */
    int32_t sh = tb_add(&b, SP "h", -1, 1);      /* 6 */
    int32_t hi = tb_add(&b, "hi", -2, 1);        /* 7 */
    int32_t shi = tb_add(&b, SP "hi", -3, 1);    /* 8 */
    int32_t x = tb_add(&b, "<|x|>", 0, KV_TOKT_CONTROL);
    int32_t xl = tb_add(&b, "<|x|>!", 0, KV_TOKT_CONTROL);
    b.lit[b.nl++] = x;
    b.lit[b.nl++] = xl;
    b.lit[b.nl++] = 1; /* <s> */
    struct kv_tokenizer *t = tb_build(&b);
    /* the prefix goes only on a segment that starts the text */
    EXPECT_IDS(t, "hi<|x|> hi", 0, shi, x, shi);
    EXPECT_IDS(t, "<|x|>hi", 0, x, hi);
    EXPECT_IDS(t, "<|x|>!hi", 0, xl, hi);
    EXPECT_IDS(t, "h<|x|>i", 0, sh, x, i);
    EXPECT_IDS(t, "<s><|x|>", 1, 1, 1, x);
    EXPECT_IDS(t, "<|x|", 0, 3, 0, 0, 0, 0); /* incomplete: text, and unknown chars */
    kv_tok_free(t);
    tb_free(&b);
}

/* ---------------------------------------------------------------- decode */

Test(tok_decode, pieces_bytes_and_specials) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, SP, 1);
    tb_specials(&b);
    tb_bytes(&b);
    int32_t sab = tb_add(&b, SP "a" SP "b", 0, 1);
    int32_t ctl = tb_add(&b, "<ctl>", 0, KV_TOKT_CONTROL);
    int32_t user = tb_add(&b, SP "u", 0, KV_TOKT_USER);
    b.lit[b.nl++] = user;
    struct kv_tokenizer *t = tb_build(&b);
    char out[64];
    cr_assert_eq(decode1(t, -1, sab, out, sizeof out), 4);
    cr_assert_str_eq(out, " a b");
    cr_assert_eq(decode1(t, 1, sab, out, sizeof out), 3); /* after BOS */
    cr_assert_str_eq(out, "a b");
    cr_assert_eq(decode1(t, 1, user, out, sizeof out), 2); /* literals keep it */
    cr_assert_str_eq(out, " u");
    cr_assert_eq(decode1(t, -1, 3 + 0x0a, out, sizeof out), 1);
    cr_assert_eq(out[0], '\n');
    cr_assert_eq(decode1(t, 1, 3 + ' ', out, sizeof out), 1); /* bytes are never stripped */
    cr_assert_eq(out[0], ' ');
    cr_assert_eq(decode1(t, -1, 3 + 0xff, out, sizeof out), 1);
    cr_assert_eq((unsigned char)out[0], 0xff);
    cr_assert_eq(decode1(t, -1, ctl, out, sizeof out), 0);
    cr_assert_eq(decode1(t, -1, 1, out, sizeof out), 0);
    cr_assert_eq(decode1(t, -1, 0, out, sizeof out), 5);
    cr_assert_str_eq(out, "<unk>");
    cr_assert_eq(kv_tok_decode(t, -1, -5, out, sizeof out), 0);
    cr_assert_eq(kv_tok_decode(t, -1, b.n, out, sizeof out), 0);
    /* truncation: returns the full length, writes only cap bytes */
    memset(out, 'z', sizeof out);
    cr_assert_eq(kv_tok_decode(t, -1, sab, out, 2), 4);
    cr_assert(out[0] == ' ' && out[1] == 'a' && out[2] == 'z');
    kv_tok_free(t);
    tb_free(&b);
}

Test(tok_decode, no_strip_without_dummy_prefix_and_llama2c_spaces) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    int32_t sa = tb_add(&b, " a", 0, 1);
    int32_t hex = tb_add(&b, "<0x41>", 0, 1); /* spelled as a byte: decodes as one */
    struct kv_tokenizer *t = tb_build(&b);
    char out[16];
    cr_assert_eq(decode1(t, 1, sa, out, sizeof out), 2);
    cr_assert_str_eq(out, " a");
    cr_assert_eq(decode1(t, -1, hex, out, sizeof out), 1);
    cr_assert_eq(out[0], 'A');
    kv_tok_free(t);
    tb_free(&b);
}

/* ---------------------------------------------------------------- builder */

Test(tok_build, finish_names_a_missing_id) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_tokenizer *t = NULL;
    cr_assert_eq(kv_tok_init(KV_TOK_SCORE, 4, &t, &err), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 0, "a", 1, 0, 1, &err), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 1, "b", 1, 0, 1, &err), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 3, "c", 1, 0, 1, &err), KV_OK);
    cr_assert_eq(kv_tok_finish(t, "tok.bin", &err), KV_EFORMAT);
    cr_assert_str_eq(err.path, "tok.bin");
    cr_assert(strstr(err.msg, "token id 2 ") != NULL, "%s", err.msg);
    kv_tok_free(t);
}

Test(tok_build, rejects_bad_arguments) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_tokenizer *t = NULL;
    cr_assert_eq(kv_tok_init(KV_TOK_SCORE, 0, &t, &err), KV_EINVAL);
    cr_assert_null(t);
    cr_assert_eq(kv_tok_init(KV_TOK_SCORE, 3, &t, &err), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 3, "a", 1, 0, 1, &err), KV_EINVAL);
    cr_assert(strstr(err.msg, "token id 3") != NULL, "%s", err.msg);
    cr_assert_eq(kv_tok_set_piece(t, -1, "a", 1, 0, 1, &err), KV_EINVAL);
    cr_assert_eq(kv_tok_add_literal(t, 7, &err), KV_EINVAL);
    cr_assert_eq(kv_tok_set_normalizer(t, "", 1, &err), KV_EINVAL);
    for (int i = 0; i < 3; i++) cr_assert_eq(kv_tok_set_piece(t, i, "a", 1, 0, 99, &err), KV_OK);
    cr_assert_eq(kv_tok_type(t, 0), KV_TOKT_NORMAL); /* out-of-range type */
    kv_tok_set_special(t, 3, -1, 0);
    cr_assert_eq(kv_tok_finish(t, "v.gguf", &err), KV_EFORMAT);
    cr_assert(strstr(err.msg, "bos token id 3") != NULL, "%s", err.msg);
    kv_tok_free(t);
    kv_tok_free(NULL);
}

Test(tok_build, merge_errors_name_pieces_and_rank) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_tokenizer *t = NULL;
    cr_assert_eq(kv_tok_init(KV_TOK_RANK, 3, &t, &err), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 0, "a", 1, 0, 1, &err), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 1, "b", 1, 0, 1, &err), KV_OK);
    cr_assert_eq(kv_tok_set_piece(t, 2, "ab", 2, 0, 1, &err), KV_OK);
    cr_assert_eq(kv_tok_add_merge(t, "a", 1, "b", 1, 0, "tokenizer.json", &err), KV_OK);
    cr_assert_eq(kv_tok_add_merge(t, "a", 1, "q", 1, 7, "tokenizer.json", &err), KV_EFORMAT);
    cr_assert_str_eq(err.path, "tokenizer.json");
    cr_assert_str_eq(err.msg, "merge rank 7 'a' + 'q': piece 'q' is not in the vocabulary");
    cr_assert_eq(kv_tok_add_merge(t, "b", 1, "a", 1, 8, "tokenizer.json", &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg,
                     "merge rank 8 'b' + 'a': merged piece 'ba' is not in the vocabulary");
    cr_assert_eq(kv_tok_finish(t, "tokenizer.json", &err), KV_OK);
    size_t n = 0;
    const char *p = kv_tok_piece(t, 2, &n);
    cr_assert(n == 2 && memcmp(p, "ab", 2) == 0);
    cr_assert_eq(kv_tok_mode(t), KV_TOK_RANK);
    cr_assert_eq(kv_tok_n_vocab(t), 3);
    cr_assert_eq(kv_tok_bos(t), -1);
    cr_assert_eq(kv_tok_eos(t), -1);
    int32_t *ids = NULL;
    int64_t n_ids = 0;
    cr_assert_eq(kv_tok_encode(t, "ab", 2, 1, &ids, &n_ids, &err), KV_EINVAL); /* no bos */
    cr_assert_eq(kv_tok_encode(t, "ab", 2, 0, &ids, &n_ids, &err), KV_OK);
    /* defaults: dummy prefix " " (no piece here, so unknown id 0), then ab */
    cr_assert(n_ids == 2 && ids[0] == 0 && ids[1] == 2);
    free(ids);
    kv_tok_free(t);
}

/* ---------------------------------------------------------------- reference */

/* Independent naive encoder over a struct tb. */

static int32_t ref_find(const struct tb *b, const char *s, size_t n) {
    for (int i = 0; i < b->n; i++)
        if (b->len[i] == n && memcmp(b->s[i], s, n) == 0) return i;
    return -1;
}

static int ref_mergeable(const struct tb *b, int32_t id) {
    return id >= 0 && (b->type[id] == KV_TOKT_NORMAL || b->type[id] == KV_TOKT_USER);
}

static int32_t ref_byte(const struct tb *b, unsigned char c) {
    char p[8];
    snprintf(p, sizeof p, "<0x%02X>", c);
    return ref_find(b, p, 6);
}

/* Well-formed UTF-8 per Unicode table 3-7: (lead range, second range, length). */
static size_t ref_utf8(const unsigned char *s, size_t n) {
    static const struct {
        unsigned char lo, hi, s_lo, s_hi, len;
    } rows[] = {
        {0xc2, 0xdf, 0x80, 0xbf, 2}, {0xe0, 0xe0, 0xa0, 0xbf, 3}, {0xe1, 0xec, 0x80, 0xbf, 3},
        {0xed, 0xed, 0x80, 0x9f, 3}, {0xee, 0xef, 0x80, 0xbf, 3}, {0xf0, 0xf0, 0x90, 0xbf, 4},
        {0xf1, 0xf3, 0x80, 0xbf, 4}, {0xf4, 0xf4, 0x80, 0x8f, 4},
    };
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        if (s[0] < rows[r].lo || s[0] > rows[r].hi) continue;
        if (n < rows[r].len || s[1] < rows[r].s_lo || s[1] > rows[r].s_hi) return 1;
        for (size_t k = 2; k < rows[r].len; k++)
            if ((s[k] & 0xc0) != 0x80) return 1;
        return rows[r].len;
    }
    return 1;
}

struct ref_sym {
    int32_t id;
    size_t start, len;
    int frozen;
};

static void ref_segment(const struct tb *b, const char *src, size_t n, int prefix,
                        int32_t *out, int64_t *n_out) {
    size_t sl = strlen(b->space);
    char *buf = malloc(n * sl + sl + 1);
    struct ref_sym *sy = malloc((n * sl + sl + 1) * sizeof *sy);
    cr_assert(buf && sy);
    size_t m = 0;
    if (prefix) {
        memcpy(buf, b->space, sl);
        m = sl;
    }
    for (size_t i = 0; i < n; i++) {
        if (src[i] == ' ') {
            memcpy(buf + m, b->space, sl);
            m += sl;
        } else {
            buf[m++] = src[i];
        }
    }
    size_t ns = 0;
    for (size_t i = 0; i < m;) {
        size_t cl = ref_utf8((const unsigned char *)buf + i, m - i);
        int32_t id = ref_find(b, buf + i, cl);
        if (ref_mergeable(b, id)) {
            sy[ns++] = (struct ref_sym){id, i, cl, 0};
        } else {
            /* byte fallback; a byte with no token is the unknown id */
            for (size_t k = 0; k < cl; k++) {
                int32_t bid = ref_byte(b, (unsigned char)buf[i + k]);
                if (bid < 0) {
                    cr_assert(b->unk >= 0);
                    bid = b->unk;
                }
                sy[ns++] = (struct ref_sym){bid, i + k, 1, 1};
            }
        }
        i += cl;
    }
    for (;;) {
        int64_t best = -1;
        int32_t best_id = -1;
        float best_score = 0;
        int32_t best_rank = 0;
        for (size_t i = 0; i + 1 < ns; i++) {
            if (sy[i].frozen || sy[i + 1].frozen) continue;
            if (b->mode == KV_TOK_SCORE) {
                int32_t id = ref_find(b, buf + sy[i].start, sy[i].len + sy[i + 1].len);
                if (!ref_mergeable(b, id)) continue;
                if (best < 0 || b->score[id] > best_score) {
                    best = (int64_t)i;
                    best_id = id;
                    best_score = b->score[id];
                }
            } else {
                for (int k = 0; k < b->nm; k++) {
                    if (ref_find(b, b->ma[k], b->malen[k]) != sy[i].id ||
                        ref_find(b, b->mb[k], b->mblen[k]) != sy[i + 1].id)
                        continue;
                    char cat[64];
                    cr_assert(b->malen[k] + b->mblen[k] <= sizeof cat);
                    memcpy(cat, b->ma[k], b->malen[k]);
                    memcpy(cat + b->malen[k], b->mb[k], b->mblen[k]);
                    int32_t res = ref_find(b, cat, b->malen[k] + b->mblen[k]);
                    if (!ref_mergeable(b, res)) continue;
                    if (best < 0 || b->mrank[k] < best_rank) {
                        best = (int64_t)i;
                        best_id = res;
                        best_rank = b->mrank[k];
                    }
                }
            }
        }
        if (best < 0) break;
        sy[best].id = best_id;
        sy[best].len += sy[best + 1].len;
        memmove(sy + best + 1, sy + best + 2, (ns - (size_t)best - 2) * sizeof *sy);
        ns--;
    }
    for (size_t i = 0; i < ns; i++) out[(*n_out)++] = sy[i].id;
    free(buf);
    free(sy);
}

/* out needs room for len * strlen(space) + strlen(space) + 1 ids. */
static int64_t ref_encode(const struct tb *b, const char *text, size_t len, int bos,
                          int32_t *out) {
    int64_t n = 0;
    if (bos) out[n++] = b->bos;
    size_t seg = 0, pos = 0;
    while (pos < len) {
        int32_t lit = -1;
        for (int k = 0; k < b->nl; k++) {
            int32_t id = b->lit[k];
            if (b->len[id] == 0 || b->len[id] > len - pos ||
                memcmp(b->s[id], text + pos, b->len[id]) != 0)
                continue;
            if (lit < 0 || b->len[id] > b->len[lit] || (b->len[id] == b->len[lit] && id < lit))
                lit = id;
        }
        if (lit < 0) {
            pos++;
            continue;
        }
        ref_segment(b, text + seg, pos - seg, b->dummy && seg == 0 && pos > 0, out, &n);
        out[n++] = lit;
        pos += b->len[lit];
        seg = pos;
    }
    ref_segment(b, text + seg, len - seg, b->dummy && seg == 0 && len > 0, out, &n);
    return n;
}

/* ---------------------------------------------------------------- random */

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int rng_below(uint64_t *s, int n) { return (int)(rng_next(s) % (uint64_t)n); }

/* Text units: valid characters (some left out of the vocabulary), malformed
 * bytes, a truncated sequence and its tail, an overlong form, a surrogate. */
static const char *const units[] = {
    "a", "b", "c", "d", " ", " ", " ", "\n", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9d\x84\x9e",
    "\xff", "\x80", "\xe2\x82", "\xac", "\xc0\xaf", "\xed\xa0\x80", "a", "b",
};
static const char *const chars[] = {"a", "b", "c", "d", "\n", "\xc3\xa9", "\xe2\x82\xac",
                                    "\xf0\x9d\x84\x9e", "\xff"};

static int random_piece_id(const struct tb *b, uint64_t *rng, int first_text) {
    for (;;) {
        int id = first_text + rng_below(rng, b->n - first_text);
        if (ref_mergeable(b, id) && b->len[id] > 0) return id;
    }
}

/* A random vocabulary; with_bytes adds <0xHH> tokens (decode round-trips),
 * else unknown ids cover the bytes of missing characters. */
static void random_vocab(struct tb *b, uint64_t *rng, enum kv_tok_mode mode, int with_bytes) {
    tb_init(b, mode, rng_below(rng, 2) ? SP : " ", rng_below(rng, 4) != 0);
    tb_specials(b);
    if (with_bytes) tb_bytes(b);
    int first_text = b->n;
    tb_add(b, b->space, -(float)rng_below(rng, 4), KV_TOKT_NORMAL);
    for (size_t i = 0; i < sizeof chars / sizeof chars[0]; i++)
        if (i < 2 || rng_below(rng, 4) != 0)
            tb_add(b, chars[i], -(float)rng_below(rng, 4), KV_TOKT_NORMAL);
    int n_new = 10 + rng_below(rng, 50);
    for (int k = 0; k < n_new; k++) {
        int x = random_piece_id(b, rng, first_text), y = random_piece_id(b, rng, first_text);
        if (b->len[x] + b->len[y] > 14) continue;
        char cat[32];
        memcpy(cat, b->s[x], b->len[x]);
        memcpy(cat + b->len[x], b->s[y], b->len[y]);
        int r = rng_below(rng, 20);
        int type = r == 0 ? KV_TOKT_CONTROL : r == 1 ? KV_TOKT_USER : KV_TOKT_NORMAL;
        /* few distinct scores, so ties are common */
        float score = rng_below(rng, 3) ? -(float)rng_below(rng, 6)
                                        : -(float)rng_below(rng, 1000) / 7;
        if (ref_find(b, cat, b->len[x] + b->len[y]) < 0 || rng_below(rng, 4) == 0)
            tb_addn(b, cat, b->len[x] + b->len[y], score, type);
        if (mode == KV_TOK_RANK) {
            /* ranks repeat too: equal ranks on different pairs tie leftmost */
            char *sx = b->s[x], *sy = b->s[y];
            tb_mergen(b, sx, b->len[x], sy, b->len[y], rng_below(rng, 2 * n_new));
        }
    }
    if (mode == KV_TOK_RANK) {
        /* extra merges between pieces whose concatenation already exists */
        for (int k = 0; k < 40; k++) {
            int x = random_piece_id(b, rng, first_text), y = random_piece_id(b, rng, first_text);
            char cat[64];
            if (b->len[x] + b->len[y] > sizeof cat) continue;
            memcpy(cat, b->s[x], b->len[x]);
            memcpy(cat + b->len[x], b->s[y], b->len[y]);
            if (ref_find(b, cat, b->len[x] + b->len[y]) >= 0)
                tb_mergen(b, b->s[x], b->len[x], b->s[y], b->len[y], rng_below(rng, 2 * n_new));
        }
    }
    /* literals: never starting with a space (see the decode rule) */
    int n_lit = rng_below(rng, 3);
    for (int k = 0; k < n_lit; k++) {
        char lit[32];
        size_t n = 0;
        int parts = 1 + rng_below(rng, 3);
        for (int p = 0; p < parts; p++) {
            const char *u = units[rng_below(rng, (int)(sizeof units / sizeof units[0]))];
            if (n == 0 && u[0] == ' ') u = "d";
            memcpy(lit + n, u, strlen(u));
            n += strlen(u);
        }
        b->lit[b->nl++] = tb_addn(b, lit, n, 0, with_bytes ? KV_TOKT_USER : KV_TOKT_CONTROL);
    }
}

static size_t random_text(const struct tb *b, uint64_t *rng, char *buf, size_t cap) {
    int n_units = rng_below(rng, 40);
    size_t n = 0;
    for (int k = 0; k < n_units; k++) {
        const char *u;
        size_t ul;
        char raw[1];
        if (b->nl && rng_below(rng, 15) == 0) {
            int32_t id = b->lit[rng_below(rng, b->nl)];
            u = b->s[id];
            ul = b->len[id];
        } else if (rng_below(rng, 10) == 0) {
            /* any byte but 0x96, so no stray U+2581 can form */
            do raw[0] = (char)rng_below(rng, 256);
            while ((unsigned char)raw[0] == 0x96);
            u = raw;
            ul = 1;
        } else {
            u = units[rng_below(rng, (int)(sizeof units / sizeof units[0]))];
            ul = strlen(u);
        }
        if (n + ul > cap) break;
        memcpy(buf + n, u, ul);
        n += ul;
    }
    return n;
}

static void compare_with_reference(enum kv_tok_mode mode, int with_bytes, uint64_t seed) {
    uint64_t rng = seed;
    int64_t checked = 0;
    for (int v = 0; v < 40; v++) {
        struct tb b;
        random_vocab(&b, &rng, mode, with_bytes);
        struct kv_tokenizer *t = tb_build(&b);
        for (int s = 0; s < 100; s++) {
            char text[256];
            size_t len = random_text(&b, &rng, text, sizeof text);
            int bos = rng_below(&rng, 2);
            int32_t want[1024];
            int64_t n_want = ref_encode(&b, text, len, bos, want);
            struct kv_err err;
            kv_err_clear(&err);
            int32_t *ids = NULL;
            int64_t n = -1;
            cr_assert_eq(kv_tok_encode(t, text, len, bos, &ids, &n, &err), KV_OK, "%s", err.msg);
            if (n != n_want || memcmp(ids, want, (size_t)n * sizeof *ids) != 0) {
                char g[2048], w[2048];
                fmt_ids(g, sizeof g, ids, n);
                fmt_ids(w, sizeof w, want, n_want);
                cr_assert_fail("vocab %d text %d (%zu bytes, space '%s', dummy %d): got [%s], "
                               "reference [%s]",
                               v, s, len, b.space, b.dummy, g, w);
            }
            if (with_bytes) {
                /* decode(encode(s)) == s, with BOS so the dummy prefix goes */
                int32_t *with = NULL;
                int64_t nw = 0;
                cr_assert_eq(kv_tok_encode(t, text, len, 1, &with, &nw, &err), KV_OK);
                size_t dl = 0;
                char *d = decode_all(t, with, nw, &dl);
                cr_assert(dl == len && memcmp(d, text, len) == 0,
                          "vocab %d text %d: round trip gave '%.*s' for '%.*s'", v, s, (int)dl,
                          d, (int)len, text);
                free(d);
                free(with);
            }
            free(ids);
            checked++;
        }
        kv_tok_free(t);
        tb_free(&b);
    }
    cr_assert_eq(checked, 4000);
}

Test(tok_reference, score_mode_with_byte_fallback) { compare_with_reference(KV_TOK_SCORE, 1, 1); }
Test(tok_reference, score_mode_with_unknown) { compare_with_reference(KV_TOK_SCORE, 0, 2); }
Test(tok_reference, rank_mode_with_byte_fallback) { compare_with_reference(KV_TOK_RANK, 1, 3); }
Test(tok_reference, rank_mode_with_unknown) { compare_with_reference(KV_TOK_RANK, 0, 4); }

/* ---------------------------------------------------------------- large */

Test(tok_encode, one_megabyte_of_random_text_round_trips) {
    uint64_t rng = 99;
    for (int mode = 0; mode < 2; mode++) {
        struct tb b;
        random_vocab(&b, &rng, (enum kv_tok_mode)mode, 1);
        struct kv_tokenizer *t = tb_build(&b);
        size_t len = 1 << 20;
        char *text = malloc(len);
        cr_assert(text);
        for (size_t i = 0; i < len; i++) {
            const char *u = units[rng_below(&rng, (int)(sizeof units / sizeof units[0]))];
            text[i] = u[0]; /* single bytes: valid and malformed alike */
        }
        struct kv_err err;
        kv_err_clear(&err);
        int32_t *ids = NULL;
        int64_t n = 0;
        cr_assert_eq(kv_tok_encode(t, text, len, 1, &ids, &n, &err), KV_OK, "%s", err.msg);
        cr_assert(n > 1 && n <= (int64_t)len * 3 + 4);
        size_t dl = 0;
        char *d = decode_all(t, ids, n, &dl);
        cr_assert(dl == len && memcmp(d, text, len) == 0, "1 MB round trip differs");
        free(d);
        free(ids);
        free(text);
        kv_tok_free(t);
        tb_free(&b);
    }
}

Test(tok_encode, long_run_of_one_character) {
    /* a, aa, aaaa, ... : cascading merges over 1 MB */
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, " ", 0);
    tb_specials(&b);
    char p[65];
    memset(p, 'a', sizeof p);
    int32_t ids_by_len[7];
    for (int k = 0; k < 7; k++) ids_by_len[k] = tb_addn(&b, p, (size_t)1 << k, (float)k, 1);
    struct kv_tokenizer *t = tb_build(&b);
    size_t len = (1 << 20) + 3;
    char *text = malloc(len);
    cr_assert(text);
    memset(text, 'a', len);
    struct kv_err err;
    kv_err_clear(&err);
    int32_t *ids = NULL;
    int64_t n = 0;
    cr_assert_eq(kv_tok_encode(t, text, len, 0, &ids, &n, &err), KV_OK, "%s", err.msg);
    /* 2^20 / 64 pieces of 64, then "aaa" -> aa a */
    cr_assert_eq(n, (1 << 14) + 2);
    for (int64_t i = 0; i < (1 << 14); i++) cr_assert_eq(ids[i], ids_by_len[6]);
    cr_assert_eq(ids[1 << 14], ids_by_len[1]);
    cr_assert_eq(ids[(1 << 14) + 1], ids_by_len[0]);
    free(ids);
    free(text);
    kv_tok_free(t);
    tb_free(&b);
}
