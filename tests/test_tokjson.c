/* tokenizer.json: hand-worked vocabularies (merges as strings and as pairs,
 * spaces by normalizer or by Metaspace pre-tokenizer), the refusals pinned to
 * their exact messages, and the TinyStories tokenizer round-tripping 20 KB of
 * stories. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hf_fixture.h"
#include "testutil.h"
#include "tokenizer.h"
#include "tokjson.h"

/* ---------------------------------------------------------------- tokenizer.json */

static const char hand_array_merges[] =
    HAND_HEAD "   \"merges\": [[\"a\", \"b\"], [\"" SP "\", \"a\"], [\"" SP "\", \"ab\"], [\"b\", \"c\"],"
              " [\"c\", \"a\"]]}}\n";

static struct kv_tokenizer *tok_load_text(const char *text) {
    char *path = kvt_write_temp(text, strlen(text), ".json");
    struct kv_tokenizer *tok = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    char msg[2200];
    int rc = kv_hf_load_tokenizer(path, &tok, &e);
    err_line(&e, msg, sizeof msg);
    cr_assert_eq(rc, KV_OK, "%s", msg);
    unlink(path);
    free(path);
    return tok;
}

static void expect_ids(const struct kv_tokenizer *tok, const char *text, int add_bos,
                       const int32_t *want, int64_t n_want) {
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_tok_encode(tok, text, strlen(text), add_bos, &ids, &n, &e), KV_OK, "%s", e.msg);
    char got[256] = "", exp[256] = "";
    for (int64_t i = 0; i < n; i++)
        snprintf(got + strlen(got), sizeof got - strlen(got), " %d", ids[i]);
    for (int64_t i = 0; i < n_want; i++)
        snprintf(exp + strlen(exp), sizeof exp - strlen(exp), " %d", want[i]);
    cr_assert_str_eq(got, exp, "encode(\"%s\")", text);
    free(ids);
}

static void check_hand_tokenizer(const struct kv_tokenizer *tok) {
    cr_assert_eq(kv_tok_n_vocab(tok), 13);
    cr_assert_eq(kv_tok_bos(tok), 1, "BOS from the TemplateProcessing post-processor");
    cr_assert_eq(kv_tok_eos(tok), 2, "EOS from the special added token </s>");
    cr_assert_eq(kv_tok_type(tok, 0), KV_TOKT_UNKNOWN);
    cr_assert_eq(kv_tok_type(tok, 1), KV_TOKT_CONTROL);
    cr_assert_eq(kv_tok_type(tok, 4), KV_TOKT_NORMAL);
    cr_assert_eq(kv_tok_type(tok, 11), KV_TOKT_BYTE);
    /* "abc" -> ▁ a b c; lowest rank first: a+b (0) -> ▁ ab c; ▁+ab (2) -> ▁ab c. */
    expect_ids(tok, "abc", 1, (const int32_t[]){1, 9, 6}, 3);
    /* "bca" -> ▁ b c a; b+c (3) beats c+a (4) -> ▁ bc a. */
    expect_ids(tok, "bca", 0, (const int32_t[]){3, 10, 4}, 3);
    /* "c ab!" -> ▁ c ▁ a b !; a+b (0) then ▁+ab (2); '!' is byte piece <0x21>. */
    expect_ids(tok, "c ab!", 0, (const int32_t[]){3, 6, 9, 11}, 4);
    /* 'z' has neither a piece nor a byte piece: unknown. */
    expect_ids(tok, "z", 0, (const int32_t[]){3, 0}, 2);
    /* "</s>" is an added token matched verbatim; "a" alone is ▁+a (1). */
    expect_ids(tok, "a</s>", KV_TOK_PARSE_SPECIAL, (const int32_t[]){7, 2}, 2);
    /* by default it is text: '<' and '/' are unknown, 's' has no piece */
    expect_ids(tok, "</s>", 0, (const int32_t[]){3, 0, 0, 0, 0}, 5);
}

Test(hf_tokenizer, hand_worked_merges_as_strings) {
    struct kv_tokenizer *tok = tok_load_text(hand_string_merges);
    check_hand_tokenizer(tok);
    kv_tok_free(tok);
}

Test(hf_tokenizer, hand_worked_merges_as_pairs) {
    struct kv_tokenizer *tok = tok_load_text(hand_array_merges);
    check_hand_tokenizer(tok);
    kv_tok_free(tok);
}

Test(hf_tokenizer, metaspace_pre_tokenizer_matches_the_normalizer_form) {
    /* Same file with the space handling moved to a Metaspace pre-tokenizer. */
    char *text = strdup(hand_string_merges);
    const char *from = strstr(text, " \"normalizer\"");
    const char *to = strstr(text, " \"post_processor\"");
    char *out = malloc(strlen(text) + 256);
    size_t a = (size_t)(from - text);
    memcpy(out, text, a);
    a += (size_t)sprintf(out + a, " \"normalizer\": null,\n \"pre_tokenizer\": {\"type\": \"Metaspace\","
                                  " \"replacement\": \"" SP "\", \"prepend_scheme\": \"always\","
                                  " \"split\": false},\n");
    strcpy(out + a, to);
    struct kv_tokenizer *tok = tok_load_text(out);
    check_hand_tokenizer(tok);
    kv_tok_free(tok);
    free(out);
    free(text);
}

static void tok_fails(const char *text, int code, const char *tail) {
    char *path = kvt_write_temp(text, strlen(text), ".json");
    struct kv_tokenizer *tok = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kv_hf_load_tokenizer(path, &tok, &e);
    char msg[2200], want[2200];
    err_line(&e, msg, sizeof msg);
    snprintf(want, sizeof want, "%s: %s", path, tail);
    cr_assert_eq(rc, code, "status %s: %s", kv_status_name(rc), msg);
    cr_assert_null(tok);
    cr_assert_str_eq(msg, want);
    unlink(path);
    free(path);
}

Test(hf_tokenizer, refuses_other_tokenizer_kinds) {
    tok_fails("{\"pre_tokenizer\": {\"type\": \"BertPreTokenizer\"},"
              " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
              KV_EUNSUPPORTED, "pre_tokenizer 'BertPreTokenizer' is not supported");
    tok_fails("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}", KV_EUNSUPPORTED,
              "tokenizer model type 'WordPiece' is not supported, expected 'BPE'");
    tok_fails("{\"normalizer\": {\"type\": \"BertNormalizer\"},"
              " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
              KV_EUNSUPPORTED, "normalizer 'BertNormalizer' is not supported");
    tok_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"c\": 2}, \"merges\": []}}",
              KV_EFORMAT, "vocab has no piece for id 1 (ids go up to 2)");
    tok_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b c\"]}}",
              KV_EFORMAT, "merges[0] must be \"a b\" or [\"a\", \"b\"], found \"a b c\"");
    /* a rule the tokenizer library checks names the file too (before: no file) */
    size_t n = 5000;
    char *big = malloc(n + 1), *text = malloc(n + 512);
    memset(big, 'x', n), big[n] = 0;
    snprintf(text, n + 512,
             "{\"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"%s\"},"
             " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}", big);
    tok_fails(text, KV_EFORMAT,
              "the replacement for ' ' (pre_tokenizer Metaspace or normalizer Replace) is 5000 "
              "bytes, more than a piece may hold (4096)");
    free(big), free(text);
}

Test(hf_tokenizer, tinystories_round_trip_on_20kb_of_stories) {
    KVT_NEED_SHARED(tok_path_s, "models/tinystories-656K/tokenizer.json");
    char *tok_path = strdup(tok_path_s);
    KVT_NEED_SHARED(text_path, "text/tinystories/val1k.txt");
    size_t len;
    char *text = kvt_read_file(text_path, &len);
    cr_assert_not_null(text);
    cr_assert(len > 20480);
    len = 20480;
    text[len] = 0;

    struct kv_tokenizer *tok = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_hf_load_tokenizer(tok_path, &tok, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_tok_n_vocab(tok), 2048);
    cr_assert_eq(kv_tok_bos(tok), 1);
    cr_assert_eq(kv_tok_eos(tok), 2);

    int32_t *ids = NULL;
    int64_t n = 0;
    cr_assert_eq(kv_tok_encode(tok, text, len, 1, &ids, &n, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(ids[0], 1);
    cr_assert(n > 1000 && n < (int64_t)len / 2, "%lld tokens for %zu bytes", (long long)n, len);
    char *back = malloc(len * 4 + 64);
    size_t o = 0;
    for (int64_t i = 1; i < n; i++) {
        cr_assert_neq(ids[i], 0, "token %lld is <unk>", (long long)i);
        o += kv_tok_decode(tok, ids[i - 1], ids[i], back + o, len * 4 - o);
    }
    back[o] = 0;
    cr_assert_eq(o, len, "decoded %zu bytes, expected %zu", o, len);
    cr_assert(memcmp(back, text, len) == 0, "decode(encode(x)) differs from x");
    free(back);
    free(ids);
    kv_tok_free(tok);
    free(text);
    free(tok_path);
}
