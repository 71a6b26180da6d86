/* Tokenizer against a naive quadratic reference encoder (llama2.c style:
 * rescan every adjacent pair each round) on seeded random vocabularies and
 * text, in score and rank mode, and random megabytes round-tripping. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvformats.h"
#include "testutil.h"
#include "tok_fixture.h"
#include "tokenizer.h"

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
            cr_assert_eq(kv_tok_encode(t, text, len, bos | KV_TOK_PARSE_SPECIAL, &ids, &n, &err),
                         KV_OK, "%s", err.msg);
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
                cr_assert_eq(kv_tok_encode(t, text, len, 1 | KV_TOK_PARSE_SPECIAL, &with, &nw, &err),
                             KV_OK);
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

/* ---------------------------------------------------------------- streams */

/* text through a kv_tok_stream of the given chunk, fed in pieces of 1 to
 * max_feed bytes: the concatenated tokens (malloc'd) in *n, and in *parts
 * how many calls returned tokens. */
static int32_t *stream_encode(const struct kv_tokenizer *t, const char *text, size_t len, int bos,
                              size_t chunk, size_t max_feed, uint64_t *rng, int64_t *n,
                              int64_t *parts) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_tok_stream *s;
    cr_assert_eq(kv_tok_stream_new(t, bos, chunk, &s, &err), KV_OK, "%s", err.msg);
    size_t cap = len + 16, pos = 0;
    int32_t *all = malloc(cap * sizeof *all);
    cr_assert(all);
    *n = 0, *parts = 0;
    for (int eof = 0; !eof;) {
        size_t k = 1 + (size_t)(rng_next(rng) % max_feed);
        if (k > len - pos) k = len - pos;
        eof = pos + k == len;
        const int32_t *ids;
        int64_t m;
        cr_assert_eq(kv_tok_stream_feed(s, text + pos, k, eof, &ids, &m, &err), KV_OK, "%s",
                     err.msg);
        pos += k;
        cr_assert((size_t)(*n + m) <= cap);
        if (m) memcpy(all + *n, ids, (size_t)m * sizeof *ids), (*parts)++;
        *n += m;
    }
    kv_tok_stream_free(s);
    return all;
}

static void expect_same_tokens(const struct kv_tokenizer *t, const char *text, size_t len,
                               int bos, size_t chunk, size_t max_feed, uint64_t *rng,
                               const char *what, int64_t *parts) {
    struct kv_err err;
    kv_err_clear(&err);
    int32_t *want = NULL;
    int64_t n_want = 0, n = 0;
    cr_assert_eq(kv_tok_encode(t, text, len, bos, &want, &n_want, &err), KV_OK, "%s", err.msg);
    int32_t *got = stream_encode(t, text, len, bos, chunk, max_feed, rng, &n, parts);
    int64_t i = 0;
    while (i < n && i < n_want && got[i] == want[i]) i++;
    cr_assert(i == n && n == n_want,
              "%s, chunk %zu: the stream's %lld tokens differ from the whole text's %lld at "
              "token %lld (got %d, want %d)",
              what, chunk, (long long)n, (long long)n_want, (long long)i, i < n ? got[i] : -1,
              i < n_want ? want[i] : -1);
    free(got), free(want);
}

/* Random vocabularies (some with pieces that hold a space after another
 * character, which forbid every cut; literals with spaces inside) and
 * random texts: the stream's tokens are the whole text's, whatever the
 * chunk and the feed sizes. */
Test(tok_stream, random_vocabularies_match_whole_text_encoding) {
    uint64_t rng = 7;
    int64_t cut = 0, uncut = 0;
    for (int v = 0; v < 80; v++) {
        struct tb b;
        random_vocab(&b, &rng, (enum kv_tok_mode)(v % 2), v % 4 < 2);
        struct kv_tokenizer *t = tb_build(&b);
        for (int s = 0; s < 20; s++) {
            char text[4096];
            size_t len = 0;
            while (len < sizeof text - 256) len += random_text(&b, &rng, text + len, 256);
            int64_t parts;
            char what[64];
            snprintf(what, sizeof what, "vocab %d text %d", v, s);
            expect_same_tokens(t, text, len, rng_below(&rng, 2), 1 + (size_t)rng_below(&rng, 64),
                               1 + (size_t)rng_below(&rng, 300), &rng, what, &parts);
            if (parts > 2) cut++;
            else uncut++;
        }
        kv_tok_free(t);
        tb_free(&b);
    }
    cr_assert(cut > 1000, "%lld texts cut, %lld not", (long long)cut, (long long)uncut);
}

/* A piece holding a space after another character ("a▁b") forbids cuts
 * at spaces: a stream that cut there would give a, ▁b instead of a▁b. */
Test(tok_stream, no_cut_at_a_space_a_piece_spans) {
    struct tb b;
    tb_init(&b, KV_TOK_SCORE, SP, 1);
    tb_specials(&b);
    tb_bytes(&b);
    tb_add(&b, SP, 0, KV_TOKT_NORMAL);
    tb_add(&b, "a", 0, KV_TOKT_NORMAL);
    tb_add(&b, "b", 0, KV_TOKT_NORMAL);
    tb_add(&b, SP "b", 1, KV_TOKT_NORMAL);
    int32_t ab = tb_add(&b, "a" SP "b", 2, KV_TOKT_NORMAL);
    struct kv_tokenizer *t = tb_build(&b);
    char text[600];
    size_t len = 0;
    while (len + 4 <= sizeof text) memcpy(text + len, "a ba", 4), len += 4;
    uint64_t rng = 5;
    int64_t parts, n;
    expect_same_tokens(t, text, len, 1, 1, 7, &rng, "a b", &parts);
    int32_t *ids = stream_encode(t, text, len, 1, 1, 7, &rng, &n, &parts);
    int64_t n_ab = 0;
    for (int64_t i = 0; i < n; i++) n_ab += ids[i] == ab;
    cr_assert_eq(n_ab, (int64_t)(len / 4), "%lld of %zu 'a b' pairs merged", (long long)n_ab,
                 len / 4);
    cr_assert_eq(parts, 1, "the stream cut %lld times", (long long)parts - 1);
    free(ids);
    kv_tok_free(t);
    tb_free(&b);
}

/* Every shared tokenizer on every shared text: identical tokens in slices
 * of 1 byte (a cut at every safe place; val1k only), 4 KiB and the default
 * 64 KiB. */
Test(tok_stream, shared_texts_match_whole_text_encoding, .timeout = 300) {
    const char *toks[] = {"models/llama2-tokenizer/tokenizer.bin", "models/stories260K/tok512.bin",
                          "models/stories260K/stories260K.gguf",
                          "models/tinystories-656K/tokenizer.json"};
    const char *texts[] = {"text/tinystories/val1k.txt", "text/wikitext-2-raw/wiki.test.raw"};
    if (!kvt_shared(texts[0])) cr_skip_test("shared texts are absent; skipping");
    uint64_t rng = 11;
    for (size_t i = 0; i < sizeof toks / sizeof toks[0] + 1; i++) {
        char tp[4096];
        const char *sp = i < sizeof toks / sizeof toks[0] ? kvt_shared(toks[i])
                                                          : "data/kjv-llama/tokenizer.json";
        cr_assert(sp, "shared tokenizer %s is absent", toks[i]);
        snprintf(tp, sizeof tp, "%s", sp);
        struct kv_err err;
        kv_err_clear(&err);
        struct kv_tokenizer *t;
        cr_assert_eq(kv_tok_open(tp, &t, &err), KV_OK, "%s: %s", tp, err.msg);
        for (size_t j = 0; j < sizeof texts / sizeof texts[0]; j++) {
            size_t len;
            char *text = kvt_read_file(kvt_shared(texts[j]), &len);
            cr_assert(text);
            const size_t chunks[] = {1, 4096, 0};
            /* a cut at every safe space on the smaller text only (time) */
            for (size_t c = j == 0 ? 0 : 1; c < 3; c++) {
                int64_t parts;
                expect_same_tokens(t, text, len, 1, chunks[c], 1 << 16, &rng, tp, &parts);
                /* every vocabulary but tinystories-656K's (which holds
                 * pieces like "e▁", and a piece for each ASCII character
                 * of these texts) allows cuts */
                if (chunks[c] && chunks[c] < len / 4 && i != 3)
                    cr_assert(parts > 4, "%s on %s, chunk %zu: only %lld parts", tp, texts[j],
                              chunks[c], (long long)parts);
            }
            free(text);
        }
        kv_tok_free(t);
    }
}
