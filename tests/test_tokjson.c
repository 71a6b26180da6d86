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

/* ---------------------------------------------------------------- pipelines */

/* A byte-level vocabulary of 256 byte pieces (GPT-2's mapped characters)
 * plus the given merged pieces and merges, around the given pipeline. */
static char *bytelevel_json(const char *pre, const char *norm, const char *extra_vocab,
                            const char *merges, const char *added, const char *model_opts) {
    size_t cap = 64 << 10;
    char *s = malloc(cap);
    cr_assert_not_null(s);
    size_t o = (size_t)snprintf(s, cap, "{\"added_tokens\": [%s], \"normalizer\": %s, "
                                        "\"pre_tokenizer\": %s, \"decoder\": {\"type\": \"ByteLevel\"},"
                                        " \"model\": {\"type\": \"BPE\"%s, \"vocab\": {",
                                added, norm, pre, model_opts);
    int k = 0;
    for (int b = 0; b < 256; b++) {
        int self = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        int c = self ? b : 256 + k++;
        char u[4];
        if (c < 0x80) u[0] = (char)c, u[1] = 0;
        else u[0] = (char)(0xc0 | (c >> 6)), u[1] = (char)(0x80 | (c & 0x3f)), u[2] = 0;
        o += (size_t)snprintf(s + o, cap - o, "%s\"%s%s\": %d", b ? ", " : "",
                              c == '"' || c == '\\' ? "\\" : "", u, b);
    }
    o += (size_t)snprintf(s + o, cap - o, "%s%s}, \"merges\": [%s]}}", *extra_vocab ? ", " : "",
                          extra_vocab, merges);
    return s;
}

static const char BL_PRE[] =
    "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}";

Test(hf_tokenizer, bytelevel_bpe_by_hand) {
    /* "Ġ" is ' ' (U+0120); merges: "h i" -> "hi" (256), "Ġ hi" -> "Ġhi" (257) */
    char *j = bytelevel_json(BL_PRE, "null", "\"hi\": 256, \"\xc4\xa0hi\": 257",
                             "\"h i\", \"\xc4\xa0 hi\"",
                             "{\"id\": 258, \"content\": \"<|e|>\", \"special\": true}", "");
    struct kv_tokenizer *tok = tok_load_text(j);
    /* "hi hi!" -> "hi", " hi", "!": the regex keeps the space with the word */
    expect_ids(tok, "hi hi!", 0, (const int32_t[]){256, 257, '!'}, 3);
    /* the merge never spans two pre-tokens: "h" + "i" across "h|!i" */
    expect_ids(tok, "h!i", 0, (const int32_t[]){'h', '!', 'i'}, 3);
    /* a special string is text unless parsed */
    expect_ids(tok, "<|e|>", 0, (const int32_t[]){'<', '|', 'e', '|', '>'}, 5);
    expect_ids(tok, "hi<|e|>", KV_TOK_PARSE_SPECIAL, (const int32_t[]){256, 258}, 2);
    /* any bytes at all, decoded back exactly */
    expect_ids(tok, "\xff\xfe", 0, (const int32_t[]){0xff, 0xfe}, 2);
    cr_assert_eq(kv_tok_policy(tok), 0, "no template, no config: no BOS");
    kv_tok_free(tok);
    free(j);
}

Test(hf_tokenizer, added_token_flags) {
    const char *added =
        "{\"id\": 256, \"content\": \"<L>\", \"special\": false, \"lstrip\": true, \"normalized\": false},"
        "{\"id\": 257, \"content\": \"<r>\", \"special\": false, \"rstrip\": true},"
        "{\"id\": 258, \"content\": \"ab\", \"special\": false, \"single_word\": true},"
        "{\"id\": 259, \"content\": \"kv\", \"special\": false, \"normalized\": true},"
        "{\"id\": 260, \"content\": \"\xc4\xb0x\", \"special\": false}";
    const char *norm = "{\"type\": \"Lowercase\"}";
    const char *pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", "
                      "\"pattern\": {\"String\": \" \"}, \"behavior\": \"Isolated\"}, {\"type\": "
                      "\"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]}";
    char *j = bytelevel_json(pre, norm, "", "", added, "");
    struct kv_tokenizer *tok = tok_load_text(j);
    expect_ids(tok, "x  <L>", 0, (const int32_t[]){'x', 256}, 2);
    expect_ids(tok, "<R>  x", 0, (const int32_t[]){257, 'x'}, 2); /* matched as "<r>" */
    expect_ids(tok, "ab xab", 0, (const int32_t[]){258, ' ', 'x', 'a', 'b'}, 5);
    expect_ids(tok, "KV", 0, (const int32_t[]){259}, 1); /* matched after Lowercase */
    /* "İx" lower-cases to "i" U+0307 "x", a byte longer: the match is as
     * long as the normalized content */
    expect_ids(tok, "a\xc4\xb0xb", 0, (const int32_t[]){'a', 260, 'b'}, 3);
    kv_tok_free(tok);
    free(j);
}

Test(hf_tokenizer, model_options_by_hand) {
    /* ignore_merges: a word that is a piece is taken whole even with no
     * merge path to it ("abc" has no merges) */
    char *j = bytelevel_json(BL_PRE, "null", "\"abc\": 256", "", "",
                             ", \"ignore_merges\": true");
    struct kv_tokenizer *tok = tok_load_text(j);
    expect_ids(tok, "abc abcd", 0, (const int32_t[]){256, ' ', 'a', 'b', 'c', 'd'}, 6);
    kv_tok_free(tok);
    free(j);
    /* continuing_subword_prefix "##": later characters are looked up as
     * "##x", and "a ##b" merges to "ab" */
    const char *v = "{\"model\": {\"type\": \"BPE\", \"continuing_subword_prefix\": \"##\", "
                    "\"unk_token\": \"?\", \"fuse_unk\": true, \"vocab\": {\"?\": 0, \"a\": 1, "
                    "\"##b\": 2, \"ab\": 3, \"##a\": 4}, \"merges\": [\"a ##b\"]}, "
                    "\"pre_tokenizer\": {\"type\": \"WhitespaceSplit\"}}";
    tok = tok_load_text(v);
    expect_ids(tok, "ab aa", 0, (const int32_t[]){3, 1, 4}, 3);
    /* fuse_unk: a run of unknown characters is one unknown token */
    expect_ids(tok, "xyz a", 0, (const int32_t[]){0, 1}, 2);
    kv_tok_free(tok);
    tok_fails("{\"model\": {\"type\": \"BPE\", \"dropout\": 0.1, \"vocab\": {\"a\": 0}, \"merges\": []}}",
              KV_EUNSUPPORTED,
              "tokenizer model option dropout must be null: kvcal tokenizes deterministically");
}

Test(hf_tokenizer, hostile_files_fail_cleanly_or_finish, .timeout = 60) {
    /* a regex that backtracks catastrophically: loading works, encoding
     * stops at PCRE2's match limit with an error */
    char *j = bytelevel_json("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(a+)+$\"}, "
                             "\"behavior\": \"Isolated\"}", "null", "", "", "", "");
    struct kv_tokenizer *tok = tok_load_text(j);
    char text[64];
    memset(text, 'a', 40);
    text[40] = '!';
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_tok_encode(tok, text, 41, 0, &ids, &n, &e), KV_EINVAL);
    cr_assert_str_eq(e.msg, "a pre-tokenizer regex failed 0 bytes into a piece of 41: match limit "
                            "exceeded");
    kv_tok_free(tok);
    free(j);
    tok_fails("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"a(b\"}},"
              " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
              KV_EFORMAT, "regex 'a(b' does not compile at offset 3: missing closing parenthesis");
    /* 100,000 nested arrays: jansson's depth limit, one line */
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 64);
    size_t o = (size_t)sprintf(deep, "{\"normalizer\": ");
    memset(deep + o, '[', depth), o += depth;
    memset(deep + o, ']', depth), o += depth;
    strcpy(deep + o, "}");
    char *path = kvt_write_temp(deep, strlen(deep), ".json");
    kv_err_clear(&e);
    cr_assert_eq(kv_hf_load_tokenizer(path, &tok, &e), KV_EFORMAT);
    cr_assert(strstr(e.msg, "invalid json: maximum parsing depth reached"), "%s", e.msg);
    unlink(path);
    free(path);
    free(deep);
    /* 10^6 merges (the one pair, listed again and again): loads in bounded
     * time and merges as listed once */
    size_t nm = 1000000, cap = nm * 8 + 4096;
    char *big = malloc(cap);
    o = (size_t)sprintf(big, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, "
                             "\"ab\": 2}, \"merges\": [");
    for (size_t i = 0; i < nm; i++) o += (size_t)sprintf(big + o, "%s\"a b\"", i ? "," : "");
    strcpy(big + o, "]}}");
    tok = tok_load_text(big);
    expect_ids(tok, "abab", 0, (const int32_t[]){2, 2}, 2);
    kv_tok_free(tok);
    free(big);
}

Test(hf_tokenizer, bos_policy_from_template_and_config) {
    char *dir = kvt_temp_dir(), *p = kvt_path(dir, "tokenizer.json");
    const char *tj = "{\"added_tokens\": [{\"id\": 2, \"content\": \"<s>\", \"special\": true}],"
                     " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
                     "[{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}}, {\"Sequence\": "
                     "{\"id\": \"A\", \"type_id\": 0}}], \"special_tokens\": {\"<s>\": {\"id\": "
                     "\"<s>\", \"ids\": [2]}}},"
                     " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}}";
    FILE *f = fopen(p, "w");
    fputs(tj, f);
    fclose(f);
    struct kv_tokenizer *tok = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_hf_load_tokenizer(p, &tok, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_tok_policy(tok), KV_TOK_ADD_BOS, "the template adds BOS");
    kv_tok_free(tok);
    /* tokenizer_config.json's add_bos_token false wins; add_eos_token adds EOS
     * (and a number past 64 bits, as in real files, does not stop the read) */
    char *c = kvt_path(dir, "tokenizer_config.json");
    f = fopen(c, "w");
    fputs("{\"add_bos_token\": false, \"add_eos_token\": true, \"eos_token\": {\"content\": \"b\"},"
          " \"model_max_length\": 1000000000000000019884624838656}", f);
    fclose(f);
    cr_assert_eq(kv_hf_load_tokenizer(p, &tok, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_tok_policy(tok), KV_TOK_ADD_EOS);
    cr_assert_eq(kv_tok_eos(tok), 1);
    expect_ids(tok, "a", kv_tok_policy(tok), (const int32_t[]){0, 1}, 2);
    kv_tok_free(tok);
    f = fopen(c, "w");
    fputs("{\"add_bos_token\": true, \"bos_token\": \"<x>\"}", f);
    fclose(f);
    cr_assert_eq(kv_hf_load_tokenizer(p, &tok, &e), KV_EFORMAT);
    cr_assert_str_eq(e.msg, "bos_token '<x>' is not in the tokenizer's vocab");
    unlink(c);
    unlink(p);
    free(c);
    free(p);
    rmdir(dir);
    free(dir);
}
