/* Tokenizer: hand-built vocabularies with ids derived by hand, in score and
 * rank mode: merges, byte fallback, the space piece, literals, decoding and
 * the builder's refusals. The naive reference encoder and the seeded random
 * vocabularies are test_tokref.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tok_fixture.h"
#include "tokenizer.h"

#define NELEM(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))

/* ---------------------------------------------------------------- helpers */

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
    const int PS = KV_TOK_PARSE_SPECIAL;
    EXPECT_IDS(t, "hi<|x|> hi", PS, shi, x, shi);
    EXPECT_IDS(t, "<|x|>hi", PS, x, hi);
    EXPECT_IDS(t, "<|x|>!hi", PS, xl, hi);
    EXPECT_IDS(t, "h<|x|>i", PS, sh, x, i);
    EXPECT_IDS(t, "<s><|x|>", 1 | PS, 1, 1, x);
    EXPECT_IDS(t, "<|x|", PS, 3, 0, 0, 0, 0); /* incomplete: text, and unknown chars */
    /* without parsing, special literals are text (unknown characters here) */
    EXPECT_IDS(t, "<|x|>hi", 0, 3, 0, 0, 0, 0, 0, hi);
    EXPECT_IDS(t, "<s>", 1, 1, 3, 0, 0, 0);
    /* a stream counts the special strings it read as text */
    const char *two = "<s>hi<|x|>!";
    for (int parse = 0; parse < 2; parse++) {
        struct kv_tok_stream *s;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_tok_stream_new(t, parse ? PS : 0, 0, &s, &err), KV_OK);
        const int32_t *ids;
        int64_t n;
        cr_assert_eq(kv_tok_stream_feed(s, two, strlen(two), 1, &ids, &n, &err), KV_OK);
        cr_assert_eq(kv_tok_stream_specials(s), parse ? 0 : 2);
        kv_tok_stream_free(s);
    }
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
