/* Normalizers and pre-tokenizers (lib/pretok.c) against hand-worked
 * results: each split behaviour on the same matches, the Unicode forms on
 * textbook examples, the context rules of lower-casing, Metaspace's
 * schemes, GPT-2's byte map rebuilt here from its definition, and a
 * backtracking regex stopped by the match limit. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pretok.h"
#include "testutil.h"

/* The pieces of b as "a|b|c". */
static void join_pieces(const struct kv_pt_buf *b, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < b->n; i++) {
        size_t a = i ? b->ends[i - 1] : 0;
        o += (size_t)snprintf(out + o, cap - o, "%s%.*s", i ? "|" : "", (int)(b->ends[i] - a),
                              b->buf + a);
    }
    out[o < cap ? o : cap - 1] = 0;
}

static void expect_pieces(const struct kv_pretok *p, const char *text, unsigned where,
                          const char *want) {
    struct kv_pt_buf out = {0};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_pretok_pieces(p, text, strlen(text), where, &out, &err), KV_OK, "%s", err.msg);
    char got[1024];
    join_pieces(&out, got, sizeof got);
    cr_assert_str_eq(got, want, "pieces of '%s': got '%s', want '%s'", text, got, want);
    kv_pt_buf_free(&out);
}

static void expect_norm(const struct kv_pretok *p, const char *text, unsigned where,
                        const char *want) {
    struct kv_pt_buf out = {0};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_pretok_normalize(p, text, strlen(text), where, &out, &err), KV_OK, "%s",
                 err.msg);
    cr_assert(out.len == strlen(want) && (!out.len || memcmp(out.buf, want, out.len) == 0),
              "normalized '%s': got '%.*s', want '%s'", text, (int)out.len, out.buf, want);
    kv_pt_buf_free(&out);
}

static struct kv_pretok *split_of(const char *re, int regex, enum kv_pt_behavior b, int invert) {
    struct kv_pretok *p;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_pretok_new(&p, &err), KV_OK);
    cr_assert_eq(kv_pretok_split(p, re, strlen(re), regex, b, invert, &err), KV_OK, "%s", err.msg);
    return p;
}

Test(pretok, split_behaviours_fold_matches_as_the_tokenizers_crate) {
    /* "-" in "the-final--countdown": matches at 3, 9, 10. */
    static const struct {
        enum kv_pt_behavior b;
        int invert;
        const char *want;
    } rows[] = {
        {KV_PT_REMOVED, 0, "the|final|countdown"},
        {KV_PT_ISOLATED, 0, "the|-|final|-|-|countdown"},
        {KV_PT_MERGED_PREV, 0, "the-|final-|-|countdown"},
        {KV_PT_MERGED_NEXT, 0, "the|-final|-|-countdown"},
        {KV_PT_CONTIGUOUS, 0, "the|-|final|--|countdown"},
        /* inverted: the words are the matches, each "-" a gap of its own */
        {KV_PT_REMOVED, 1, "-|-|-"},
        {KV_PT_MERGED_PREV, 1, "the|-final|-|-countdown"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_pretok *p = split_of("-", 0, rows[i].b, rows[i].invert);
        expect_pieces(p, "the-final--countdown", 0, rows[i].want);
        kv_pretok_free(p);
    }
    struct kv_pretok *p = split_of("\\s+", 1, KV_PT_ISOLATED, 0);
    expect_pieces(p, " a  b ", 0, " |a|  |b| ");
    kv_pretok_free(p);
    /* the Whitespace pre-tokenizer's form (tokenizer.json): \w+|[^\w\s]+
     * kept, the rest removed */
    p = split_of("\\w+|[^\\w\\s]+", 1, KV_PT_REMOVED, 1);
    expect_pieces(p, "Hello,  world!!", 0, "Hello|,|world|!!");
    kv_pretok_free(p);
    /* an empty match splits the text where it is found */
    p = split_of("\\b", 1, KV_PT_ISOLATED, 0);
    expect_pieces(p, "ab cd", 0, "ab| |cd");
    kv_pretok_free(p);
}

Test(pretok, gpt2_and_llama3_regexes_split_as_published) {
    struct kv_pretok *p;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_pretok_new(&p, &err), KV_OK);
    cr_assert_eq(kv_pretok_bytelevel(p, 0, 1, &err), KV_OK, "%s", err.msg);
    /* GPT-2: contractions, a space joins the next word, the last space of a
     * run joins the word after it, a run at the end stays whole */
    expect_pieces(p, "I'm 12 dogs!!  ok  ", 0, "I|'m| 12| dogs|!!| | ok|  ");
    expect_pieces(p, "\n\nHi", 0, "\n|\n|Hi");
    kv_pretok_free(p);
    /* Llama 3: digits in threes, case-insensitive contractions, a newline run
     * with the spaces before it */
    const char *re = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    p = split_of(re, 1, KV_PT_ISOLATED, 0);
    expect_pieces(p, "IT'S 1234567 (x)  \n\nend", 0, "IT|'S| |123|456|7| (|x|)|  \n\n|end");
    kv_pretok_free(p);
    /* with add_prefix_space, every piece gets a leading space */
    cr_assert_eq(kv_pretok_new(&p, &err), KV_OK);
    cr_assert_eq(kv_pretok_split(p, ",", 1, 0, KV_PT_ISOLATED, 0, &err), KV_OK);
    cr_assert_eq(kv_pretok_bytelevel(p, 1, 0, &err), KV_OK);
    expect_pieces(p, "a,b", 0, " a| ,| b");
    kv_pretok_free(p);
}

Test(pretok, metaspace_schemes_and_split) {
    static const struct {
        enum kv_pt_scheme scheme;
        int split;
        unsigned where;
        const char *text, *want;
    } rows[] = {
        {KV_PT_ALWAYS, 1, 0, "hi there", "▁hi|▁there"},
        {KV_PT_ALWAYS, 0, 0, "hi there", "▁hi▁there"},
        {KV_PT_NEVER, 1, 0, "hi there", "hi|▁there"},
        {KV_PT_FIRST, 1, KV_PT_INPUT, "hi", "▁hi"},
        {KV_PT_FIRST, 1, 0, "hi", "hi"},
        {KV_PT_ALWAYS, 1, 0, " hi", "▁hi"},
        {KV_PT_ALWAYS, 1, 0, "a  b", "▁a|▁|▁b"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_pretok *p;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_pretok_new(&p, &err), KV_OK);
        cr_assert_eq(kv_pretok_metaspace(p, "▁", strlen("▁"), rows[i].scheme, rows[i].split, &err),
                     KV_OK);
        expect_pieces(p, rows[i].text, rows[i].where, rows[i].want);
        kv_pretok_free(p);
    }
}

Test(pretok, unicode_forms_on_textbook_examples) {
    static const struct {
        enum kv_pt_norm form;
        const char *in, *want;
    } rows[] = {
        {KV_PT_NFC, "e\xcc\x81", "\xc3\xa9"},               /* e + acute -> é */
        {KV_PT_NFD, "\xc3\xa9", "e\xcc\x81"},
        {KV_PT_NFKC, "\xef\xac\x81", "fi"},                 /* ﬁ ligature */
        {KV_PT_NFKC, "\xe2\x91\xa0", "1"},                  /* ① */
        {KV_PT_NFKD, "\xe1\xba\x9b\xcc\xa3", "s\xcc\xa3\xcc\x87"}, /* UAX #15's ẛ̣ */
        {KV_PT_NFC, "\xe1\x84\x80\xe1\x85\xa1", "\xea\xb0\x80"},   /* jamo -> 가 */
        {KV_PT_LOWERCASE, "HeLLo \xc3\x89", "hello \xc3\xa9"},
        {KV_PT_LOWERCASE, "\xc4\xb0", "i\xcc\x87"},          /* İ -> i + dot above */
        /* ΟΔΟΣ: the last sigma ends a word, so it is final */
        {KV_PT_LOWERCASE, "\xce\x9f\xce\x94\xce\x9f\xce\xa3 \xce\xa3",
         "\xce\xbf\xce\xb4\xce\xbf\xcf\x82 \xcf\x83"},
        /* bytes that are not UTF-8 pass every form unchanged */
        {KV_PT_NFKC, "a\xff" "e\xcc\x81\xc3", "a\xff\xc3\xa9\xc3"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_pretok *p;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_pretok_new(&p, &err), KV_OK);
        cr_assert_eq(kv_pretok_norm_unicode(p, rows[i].form, &err), KV_OK);
        expect_norm(p, rows[i].in, 0, rows[i].want);
        kv_pretok_free(p);
    }
}

Test(pretok, prepend_replace_strip_apply_where_a_stretch_starts_and_ends) {
    struct kv_pretok *p;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_pretok_new(&p, &err), KV_OK);
    cr_assert_eq(kv_pretok_norm_strip(p, 1, 1, &err), KV_OK);
    cr_assert_eq(kv_pretok_norm_replace(p, "``", 2, 0, "\"", 1, &err), KV_OK);
    cr_assert_eq(kv_pretok_norm_replace(p, " {2,}", 5, 1, " ", 1, &err), KV_OK);
    cr_assert_eq(kv_pretok_norm_prepend(p, ">", 1, &err), KV_OK);
    unsigned both = KV_PT_START | KV_PT_END;
    expect_norm(p, "  ``a``   b \t", both, ">\"a\" b");
    expect_norm(p, "  ``a``   b \t", KV_PT_START, ">\"a\" b \t");
    expect_norm(p, "  x ", KV_PT_END, " x");
    expect_norm(p, "", both, ""); /* Prepend leaves an empty text empty */
    kv_pretok_free(p);
}

/* GPT-2's bytes_to_unicode, written out from its definition. */
static int gpt2_char_of(int b) {
    if ((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) return b;
    int n = 0;
    for (int k = 0; k < b; k++)
        if (!((k >= '!' && k <= '~') || (k >= 0xa1 && k <= 0xac) || (k >= 0xae && k <= 0xff))) n++;
    return 256 + n;
}

Test(pretok, bytelevel_unmap_inverts_gpt2s_byte_map) {
    for (int b = 0; b < 256; b++) {
        int c = gpt2_char_of(b);
        char enc[4], out[8];
        size_t n = c < 0x80 ? 1 : 2;
        if (n == 1) enc[0] = (char)c;
        else enc[0] = (char)(0xc0 | (c >> 6)), enc[1] = (char)(0x80 | (c & 0x3f));
        int mapped;
        size_t k = kv_bytelevel_unmap(enc, n, out, &mapped);
        cr_assert(k == 1 && (unsigned char)out[0] == b && mapped, "byte %d (U+%04X)", b, c);
    }
    char out[16];
    int mapped;
    /* "Ġthe" -> " the"; a character outside the map is kept and flagged */
    cr_assert_eq(kv_bytelevel_unmap("\xc4\xa0the", 5, out, &mapped), 4);
    cr_assert(memcmp(out, " the", 4) == 0 && mapped);
    cr_assert_eq(kv_bytelevel_unmap("\xe2\x96\x81", 3, out, &mapped), 3);
    cr_assert(!mapped);
}

Test(pretok, a_backtracking_regex_stops_at_the_match_limit) {
    struct kv_pretok *p = split_of("(a+)+$", 1, KV_PT_ISOLATED, 0);
    char text[64];
    memset(text, 'a', 40);
    text[40] = '!';
    struct kv_pt_buf out = {0};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_pretok_pieces(p, text, 41, 0, &out, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "a pre-tokenizer regex failed 0 bytes into a piece of 41: match "
                              "limit exceeded");
    kv_pt_buf_free(&out);
    kv_pretok_free(p);
    /* a pattern that does not compile names itself and the place */
    kv_err_clear(&err);
    cr_assert_eq(kv_pretok_new(&p, &err), KV_OK);
    cr_assert_eq(kv_pretok_split(p, "a(b", 3, 1, KV_PT_ISOLATED, 0, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "regex 'a(b' does not compile at offset 3: missing closing "
                              "parenthesis");
    kv_pretok_free(p);
}
