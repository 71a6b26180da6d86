/* GGUF "gpt2" (byte-level BPE) vocabularies: small ones written here with
 * the GGUF writer and worked by hand (merges, pre-tokenizers, special
 * tokens, the BOS/EOS policy and every refusal), and the GPT-2 and Llama 3
 * tokenizer.json files of deps/tokenizers rewritten as GGUF vocabularies,
 * which must give the same ids as the files themselves on whole corpora. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "ggufmodel.h"
#include "ggufw.h"
#include "kvformats.h"
#include "testutil.h"
#include "tokenizer.h"

static const char *fmt_err(const struct kv_err *e) {
    static char buf[2048];
    kv_err_format(e, buf, sizeof buf, 0);
    return buf;
}

/* ------------------------------------------------------------ the small vocabulary */

/* Pieces in GPT-2's mapped form: U+0120 (C4 A0) is ' ', U+010A (C4 8A) is
 * '\n', U+00C3 and U+00A9 are the bytes C3 and A9 (so "\xc3\x83\xc2\xa9"
 * is "é"). */
enum {
    T_BOS, T_EOS, T_A, T_B, T_C, T_SP, T_H, T_I, T_AB, T_ABC, T_SPA, T_HI, T_SPHI, T_BANG,
    T_NL, T_APOS, T_S, T_APOS_S, T_LT, T_GT, T_SLASH, T_USER, T_C3, T_A9, T_EACUTE, T_UNUSED,
    T_BANG_A, T_CA, N_TOK
};
static const char *const tokens[N_TOK] = {
    [T_BOS] = "<s>", [T_EOS] = "</s>", [T_A] = "a", [T_B] = "b", [T_C] = "c",
    [T_SP] = "\xc4\xa0", [T_H] = "h", [T_I] = "i", [T_AB] = "ab", [T_ABC] = "abc",
    [T_SPA] = "\xc4\xa0" "a", [T_HI] = "hi", [T_SPHI] = "\xc4\xa0" "hi", [T_BANG] = "!",
    [T_NL] = "\xc4\x8a", [T_APOS] = "'", [T_S] = "s", [T_APOS_S] = "'s", [T_LT] = "<",
    [T_GT] = ">", [T_SLASH] = "/", [T_USER] = "<u>", [T_C3] = "\xc3\x83", [T_A9] = "\xc2\xa9",
    [T_EACUTE] = "\xc3\x83\xc2\xa9", [T_UNUSED] = "zz", [T_BANG_A] = "!a", [T_CA] = "ca",
};
/* Rank order. "c a" is missing on purpose: "ca" is reached only as a whole
 * word (ignore_merges). "Ġ a" ranks below "a b", so " ab" is " " + "ab". */
static const char *const merges[] = {
    "a b", "h i", "\xc4\xa0 a", "ab c", "\xc4\xa0 hi", "' s", "\xc3\x83 \xc2\xa9", "! a",
};
#define N_MERGES ((int)(sizeof merges / sizeof merges[0]))

static uint32_t types[N_TOK];

static void fill_types(void) {
    for (int i = 0; i < N_TOK; i++) types[i] = KV_TOKT_NORMAL;
    types[T_BOS] = types[T_EOS] = KV_TOKT_CONTROL;
    types[T_USER] = KV_TOKT_USER;
    types[T_UNUSED] = KV_TOKT_UNUSED;
}

/* What to write; NULL / -1 / 0 counts leave a key out. */
struct vspec {
    const char *model;
    const char *pre;
    const char *const *tokens;
    int n_tokens;
    const uint32_t *types;
    int n_types;
    const char *const *merges;
    int n_merges; /* -1: no key */
    int bos, eos;
    int add_bos, add_eos; /* -1: no key */
    int add_bos_u32;      /* write add_bos_token as a uint32 instead */
};

static struct vspec small_spec(void) {
    fill_types();
    return (struct vspec){.model = "gpt2", .pre = "gpt-2", .tokens = tokens, .n_tokens = N_TOK,
                          .types = types, .n_types = N_TOK, .merges = merges,
                          .n_merges = N_MERGES, .bos = T_BOS, .eos = T_EOS, .add_bos = -1,
                          .add_eos = -1};
}

static void ok(int rc, const struct kv_err *err) { cr_assert_eq(rc, KV_OK, "%s", fmt_err(err)); }

/* Write a vocabulary-only GGUF into dir; returns its malloc'd path. */
static char *write_vocab(const char *dir, const char *name, const struct vspec *s) {
    struct kv_ggufw *w;
    struct kv_err err;
    kv_err_clear(&err);
    ok(kv_ggufw_init(&w, &err), &err);
    ok(kv_ggufw_add_str(w, "general.architecture", "llama", &err), &err);
    ok(kv_ggufw_add_str(w, "tokenizer.ggml.model", s->model, &err), &err);
    if (s->pre) ok(kv_ggufw_add_str(w, "tokenizer.ggml.pre", s->pre, &err), &err);
    ok(kv_ggufw_add_arr_str(w, "tokenizer.ggml.tokens", s->tokens, (uint64_t)s->n_tokens, &err),
       &err);
    if (s->n_types)
        ok(kv_ggufw_add_arr_u32(w, "tokenizer.ggml.token_type", s->types, (uint64_t)s->n_types,
                                &err),
           &err);
    if (s->n_merges >= 0)
        ok(kv_ggufw_add_arr_str(w, "tokenizer.ggml.merges", s->merges, (uint64_t)s->n_merges,
                                &err),
           &err);
    if (s->bos >= 0)
        ok(kv_ggufw_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)s->bos, &err), &err);
    if (s->eos >= 0)
        ok(kv_ggufw_add_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)s->eos, &err), &err);
    if (s->add_bos_u32)
        ok(kv_ggufw_add_u32(w, "tokenizer.ggml.add_bos_token", 1, &err), &err);
    else if (s->add_bos >= 0)
        ok(kv_ggufw_add_bool(w, "tokenizer.ggml.add_bos_token", s->add_bos, &err), &err);
    if (s->add_eos >= 0)
        ok(kv_ggufw_add_bool(w, "tokenizer.ggml.add_eos_token", s->add_eos, &err), &err);
    char *path = kvt_path(dir, name);
    ok(kv_ggufw_write(w, path, &err), &err);
    kv_ggufw_free(w);
    return path;
}

static struct kv_tokenizer *open_spec(const struct vspec *s) {
    char *dir = kvt_temp_dir();
    char *path = write_vocab(dir, "vocab.gguf", s);
    struct kv_tokenizer *t = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    ok(kv_tok_open(path, &t, &err), &err);
    free(path);
    kvt_rm_dir(dir);
    return t;
}

/* Encode text and compare with the n ids of want. */
static void expect_ids(const struct kv_tokenizer *t, const char *text, int flags,
                       const int32_t *want, int64_t n) {
    int32_t *ids = NULL;
    int64_t got = 0;
    struct kv_err err;
    kv_err_clear(&err);
    ok(kv_tok_encode(t, text, strlen(text), flags, &ids, &got, &err), &err);
    char gs[256] = "", ws[256] = "";
    for (int64_t i = 0, o = 0; i < got && o < 240; i++)
        o += snprintf(gs + o, sizeof gs - (size_t)o, " %d", ids[i]);
    for (int64_t i = 0, o = 0; i < n && o < 240; i++)
        o += snprintf(ws + o, sizeof ws - (size_t)o, " %d", want[i]);
    cr_assert(got == n && !memcmp(ids, want, (size_t)n * sizeof *ids),
              "'%s' (flags %d): got%s, want%s", text, flags, gs, ws);
    free(ids);
}
#define EXPECT(t, text, flags, ...)                                                            \
    do {                                                                                        \
        const int32_t want_[] = {__VA_ARGS__};                                                  \
        expect_ids(t, text, flags, want_, (int64_t)(sizeof want_ / sizeof want_[0]));           \
    } while (0)

Test(gguf_vocab, merges_apply_by_rank_on_raw_bytes) {
    struct vspec s = small_spec();
    struct kv_tokenizer *t = open_spec(&s);
    cr_assert_eq(kv_tok_n_vocab(t), N_TOK);
    cr_assert_eq(kv_tok_mode(t), KV_TOK_RANK);
    size_t len;
    const char *p = kv_tok_piece(t, T_SPHI, &len);
    cr_assert(len == 3 && !memcmp(p, " hi", 3), "pieces are stored as raw bytes");
    p = kv_tok_piece(t, T_EACUTE, &len);
    cr_assert(len == 2 && !memcmp(p, "\xc3\xa9", 2));
    p = kv_tok_piece(t, T_USER, &len);
    cr_assert(len == 3 && !memcmp(p, "<u>", 3), "user-defined pieces are text as they are");
    cr_assert_eq(kv_tok_type(t, T_UNUSED), KV_TOKT_UNUSED);
    cr_assert_eq(kv_tok_type(t, T_BOS), KV_TOKT_CONTROL);
    cr_assert_eq(kv_tok_type(t, T_USER), KV_TOKT_USER);
    /* "abc": a+b (rank 0), ab+c (3); " hi": h+i (1), " "+hi (4); " ab":
     * a+b (0) comes before " "+a (2), which then no longer applies */
    EXPECT(t, "abc hi ab!", 0, T_ABC, T_SPHI, T_SP, T_AB, T_BANG);
    EXPECT(t, " a", 0, T_SPA);
    EXPECT(t, "a's", 0, T_A, T_APOS_S);
    EXPECT(t, "\xc3\xa9", 0, T_EACUTE);
    /* gpt-2 splits "!" from "a", so the merge "! a" never meets them */
    EXPECT(t, "!a", 0, T_BANG, T_A);
    /* no "c a" merge: a word that is a piece is still its characters */
    EXPECT(t, "ca", 0, T_C, T_A);
    EXPECT(t, "hi\n\na", 0, T_HI, T_NL, T_NL, T_A);
    kv_tok_free(t);
}

Test(gguf_vocab, control_tokens_parse_only_with_parse_special) {
    struct vspec s = small_spec();
    struct kv_tokenizer *t = open_spec(&s);
    cr_assert_eq(kv_tok_bos(t), T_BOS);
    cr_assert_eq(kv_tok_eos(t), T_EOS);
    /* as text: "<", "s", ">" ("<" and ">" are separate pieces of the regex) */
    EXPECT(t, "hi<s>ab", 0, T_HI, T_LT, T_S, T_GT, T_AB);
    EXPECT(t, "hi</s>", 0, T_HI, T_LT, T_SLASH, T_S, T_GT);
    EXPECT(t, "hi<s>ab", KV_TOK_PARSE_SPECIAL, T_HI, T_BOS, T_AB);
    EXPECT(t, "hi</s>", KV_TOK_PARSE_SPECIAL, T_HI, T_EOS);
    /* a user-defined token matches either way */
    EXPECT(t, "a<u>b", 0, T_A, T_USER, T_B);
    EXPECT(t, "a<u>b", KV_TOK_PARSE_SPECIAL, T_A, T_USER, T_B);
    kv_tok_free(t);
}

Test(gguf_vocab, pre_tokenizer_names_pick_their_regexes) {
    struct vspec s = small_spec();
    /* llama-bpe: "[^\r\n\p{L}\p{N}]?\p{L}+" keeps "!a" together, and a word
     * that is a piece is that piece (ignore_merges) */
    s.pre = "llama-bpe";
    struct kv_tokenizer *t = open_spec(&s);
    EXPECT(t, "!a", 0, T_BANG_A);
    EXPECT(t, "ca", 0, T_CA);
    EXPECT(t, "abc hi ab!", 0, T_ABC, T_SPHI, T_SP, T_AB, T_BANG);
    EXPECT(t, "hi\n\na", 0, T_HI, T_NL, T_NL, T_A);
    kv_tok_free(t);
    /* smaug-bpe: the same regex, merges as usual */
    s.pre = "smaug-bpe";
    t = open_spec(&s);
    EXPECT(t, "!a", 0, T_BANG_A);
    EXPECT(t, "ca", 0, T_C, T_A);
    kv_tok_free(t);
    /* absent: "default", whose first regex isolates punctuation */
    s.pre = NULL;
    t = open_spec(&s);
    EXPECT(t, "!a", 0, T_BANG, T_A);
    EXPECT(t, "abc hi ab!", 0, T_ABC, T_SPHI, T_SP, T_AB, T_BANG);
    kv_tok_free(t);
}

Test(gguf_vocab, every_known_pre_tokenizer_builds) {
    static const char *const names[] = {
        "default", "gpt-2", "phi-2", "gpt-neox", "mpt", "olmo", "llama-bpe", "llama3",
        "llama-v3", "smaug-bpe", "dbrx", "qwen2", "stablelm2", "falcon", "starcoder", "refact",
        "smollm", "command-r", "deepseek-llm", "deepseek-coder",
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        struct vspec s = small_spec();
        s.pre = names[i];
        struct kv_tokenizer *t = open_spec(&s);
        /* every list splits these the same way */
        EXPECT(t, "abc", 0, T_ABC);
        EXPECT(t, "\xc3\xa9", 0, T_EACUTE);
        kv_tok_free(t);
    }
}

Test(gguf_vocab, bos_and_eos_policy) {
    struct vspec s = small_spec();
    struct kv_tokenizer *t = open_spec(&s);
    cr_assert_eq(kv_tok_policy(t), 0, "gpt2 default: neither");
    kv_tok_free(t);

    s.add_bos = 1;
    s.add_eos = 1;
    t = open_spec(&s);
    cr_assert_eq(kv_tok_policy(t), KV_TOK_ADD_BOS | KV_TOK_ADD_EOS);
    EXPECT(t, "ab", kv_tok_policy(t), T_BOS, T_AB, T_EOS);
    kv_tok_free(t);

    s.add_bos = -1;
    s.add_eos = -1;
    s.pre = "llama-bpe"; /* llama.cpp's Llama 3 default: BOS */
    t = open_spec(&s);
    cr_assert_eq(kv_tok_policy(t), KV_TOK_ADD_BOS);
    kv_tok_free(t);

    s.add_bos = 0;
    t = open_spec(&s);
    cr_assert_eq(kv_tok_policy(t), 0);
    kv_tok_free(t);

    s.add_bos = 1; /* without a BOS id there is nothing to add */
    s.bos = -1;
    t = open_spec(&s);
    cr_assert_eq(kv_tok_bos(t), -1);
    cr_assert_eq(kv_tok_policy(t), 0);
    kv_tok_free(t);
}

Test(gguf_vocab, llama_vocabularies_read_the_policy_keys) {
    static const char *const sp[] = {"<unk>", "<s>", "</s>", "\xe2\x96\x81", "a",
                                     "\xe2\x96\x81" "a"};
    static const uint32_t ty[] = {2, 3, 3, 1, 1, 1};
    struct vspec s = {.model = "llama", .tokens = sp, .n_tokens = 6, .types = ty, .n_types = 6,
                      .n_merges = -1, .bos = -1, .eos = -1, .add_bos = -1, .add_eos = -1};
    struct kv_tokenizer *t = open_spec(&s);
    cr_assert_eq(kv_tok_mode(t), KV_TOK_SCORE);
    cr_assert_eq(kv_tok_bos(t), 1);
    cr_assert_eq(kv_tok_eos(t), 2);
    cr_assert_eq(kv_tok_policy(t), KV_TOK_ADD_BOS, "llama default: BOS");
    kv_tok_free(t);
    s.add_bos = 0;
    s.add_eos = 1;
    t = open_spec(&s);
    cr_assert_eq(kv_tok_policy(t), KV_TOK_ADD_EOS);
    kv_tok_free(t);
}

/* ------------------------------------------------------------ refusals */

/* Where in the file the u64 length of the string s starts (its first
 * occurrence at or after from). */
static uint64_t str_at(const char *file, size_t from, const char *s) {
    size_t len;
    char *buf = kvt_read_file(file, &len);
    cr_assert_not_null(buf);
    size_t n = strlen(s);
    uint8_t pat[256];
    cr_assert(n + 8 <= sizeof pat);
    for (int i = 0; i < 8; i++) pat[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(pat + 8, s, n);
    const char *hit = memmem(buf + from, len - from, pat, n + 8);
    cr_assert_not_null(hit, "'%s' is not in %s", s, file);
    uint64_t off = (uint64_t)(hit - buf);
    free(buf);
    return off;
}
/* Offset of the key's value type and of its value. */
static uint64_t key_type_at(const char *file, const char *key) {
    return str_at(file, 0, key) + 8 + strlen(key);
}
static uint64_t key_val_at(const char *file, const char *key) { return key_type_at(file, key) + 4; }

enum { AT_NONE, AT_TYPE, AT_VAL, AT_MERGE };
struct refusal {
    const char *what;
    struct vspec spec;
    int code;
    int at;          /* where err.off must point */
    const char *key; /* AT_TYPE, AT_VAL: the key; AT_MERGE: the merge string */
    const char *msg;
};

static const char *const bad_piece[] = {"a b", "h i", "a q"};
static const char *const bad_result[] = {"a b", "b c"};
static const char *const no_space[] = {"a b", "hi"};
static const char *const two_spaces[] = {"a  b"};
static const char *const lead_space[] = {" ab"};
static const uint32_t short_types[] = {1, 1, 1};

Test(gguf_vocab, corrupt_vocabularies_are_refused_with_key_and_offset) {
    fill_types();
    const struct vspec base = small_spec();
    struct refusal cases[] = {
        {"merge piece not in the vocabulary", base, KV_EFORMAT, AT_MERGE, "a q",
         "entry 2 of key 'tokenizer.ggml.merges', 'a q': piece 'q' is not in the vocabulary"},
        {"merge result not in the vocabulary", base, KV_EFORMAT, AT_MERGE, "b c",
         "entry 1 of key 'tokenizer.ggml.merges', 'b c': merged piece 'bc' is not in the "
         "vocabulary"},
        {"merge without a space", base, KV_EFORMAT, AT_MERGE, "hi",
         "entry 1 of key 'tokenizer.ggml.merges' is 'hi', expected two pieces joined by one "
         "space"},
        {"merge with two spaces", base, KV_EFORMAT, AT_MERGE, "a  b",
         "entry 0 of key 'tokenizer.ggml.merges' is 'a  b', expected two pieces joined by one "
         "space"},
        {"merge starting with a space", base, KV_EFORMAT, AT_MERGE, " ab",
         "entry 0 of key 'tokenizer.ggml.merges' is ' ab', expected two pieces joined by one "
         "space"},
        {"token_type of the wrong length", base, KV_EFORMAT, AT_VAL, "tokenizer.ggml.token_type",
         "key 'tokenizer.ggml.token_type' has 3 entries but 'tokenizer.ggml.tokens' has 28"},
        {"add_bos_token not a bool", base, KV_EFORMAT, AT_TYPE, "tokenizer.ggml.add_bos_token",
         "key 'tokenizer.ggml.add_bos_token' has type uint32, expected bool"},
        {"unknown pre-tokenizer", base, KV_EUNSUPPORTED, AT_VAL, "tokenizer.ggml.pre",
         "key 'tokenizer.ggml.pre' is 'xyz', which kvcal does not know; known: default, gpt-2, "
         "phi-2, gpt-neox, mpt, olmo, llama-bpe, llama3, llama-v3, smaug-bpe, dbrx, qwen2, "
         "stablelm2, falcon, starcoder, refact, smollm, command-r, deepseek-llm, deepseek-coder"},
        {"unknown model", base, KV_EUNSUPPORTED, AT_VAL, "tokenizer.ggml.model",
         "tokenizer model 'bert' is not supported; kvcal reads 'llama' (sentencepiece) and "
         "'gpt2' (byte-level bpe) vocabularies"},
        {"no merges", base, KV_EFORMAT, AT_NONE, NULL, "missing key 'tokenizer.ggml.merges'"},
        {"eos id outside the vocabulary", base, KV_EFORMAT, AT_VAL, "tokenizer.ggml.eos_token_id",
         "key 'tokenizer.ggml.eos_token_id' is 28, outside the vocabulary of 28 tokens"},
    };
    cases[0].spec.merges = bad_piece;
    cases[0].spec.n_merges = 3;
    cases[1].spec.merges = bad_result;
    cases[1].spec.n_merges = 2;
    cases[2].spec.merges = no_space;
    cases[2].spec.n_merges = 2;
    cases[3].spec.merges = two_spaces;
    cases[3].spec.n_merges = 1;
    cases[4].spec.merges = lead_space;
    cases[4].spec.n_merges = 1;
    cases[5].spec.types = short_types;
    cases[5].spec.n_types = 3;
    cases[6].spec.add_bos_u32 = 1;
    cases[7].spec.pre = "xyz";
    cases[8].spec.model = "bert";
    cases[9].spec.n_merges = -1;
    cases[10].spec.eos = N_TOK;
    char *dir = kvt_temp_dir();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct refusal *c = &cases[i];
        char *path = write_vocab(dir, "bad.gguf", &c->spec);
        struct kv_tokenizer *t = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        int rc = kv_gguf_load_tokenizer(path, &t, &err);
        cr_assert_eq(rc, c->code, "%s: rc %d (%s)", c->what, rc, fmt_err(&err));
        cr_assert_null(t);
        cr_assert_str_eq(err.msg, c->msg, "%s", c->what);
        cr_assert_str_eq(err.path, path, "%s", c->what);
        cr_assert_null(strchr(err.msg, '\n'), "%s: one line", c->what);
        uint64_t want = KV_NO_OFFSET;
        if (c->at == AT_TYPE) want = key_type_at(path, c->key);
        if (c->at == AT_VAL) want = key_val_at(path, c->key);
        if (c->at == AT_MERGE)
            want = str_at(path, (size_t)key_val_at(path, "tokenizer.ggml.merges"), c->key);
        cr_assert_eq(err.off, want, "%s: offset %llu, want %llu", c->what,
                     (unsigned long long)err.off, (unsigned long long)want);
        /* the same through kv_tok_open */
        kv_err_clear(&err);
        cr_assert_eq(kv_tok_open(path, &t, &err), c->code, "%s", c->what);
        cr_assert_str_eq(err.msg, c->msg, "%s", c->what);
        free(path);
    }
    kvt_rm_dir(dir);
}

/* ------------------------------------------------------------ tokenizer.json as GGUF */

struct json_vocab {
    char **tokens; /* [n], mapped form, owned */
    uint32_t *types;
    int32_t n;
    char **merges; /* "a b", owned */
    size_t n_merges;
};

static void json_vocab_free(struct json_vocab *v) {
    for (int32_t i = 0; i < v->n; i++) free(v->tokens[i]);
    for (size_t i = 0; i < v->n_merges; i++) free(v->merges[i]);
    free(v->tokens);
    free(v->types);
    free(v->merges);
}

/* The pieces, types and merges of a tokenizer.json, as llama.cpp's
 * converter writes them: vocab pieces normal, added tokens at their ids
 * (control when special, else user-defined). */
static void json_vocab_read(const char *path, struct json_vocab *v) {
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    cr_assert_not_null(root, "%s: %s", path, je.text);
    json_t *model = json_object_get(root, "model");
    json_t *vocab = json_object_get(model, "vocab");
    json_t *added = json_object_get(root, "added_tokens");
    json_t *jm = json_object_get(model, "merges");
    cr_assert(json_is_object(vocab) && json_is_array(jm), "%s: no BPE vocab and merges", path);
    int64_t max = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (json_integer_value(val) > max) max = json_integer_value(val);
    }
    size_t i;
    json_t *a;
    json_array_foreach(added, i, a) {
        int64_t id = json_integer_value(json_object_get(a, "id"));
        if (id > max) max = id;
    }
    v->n = (int32_t)(max + 1);
    v->tokens = calloc((size_t)v->n, sizeof *v->tokens);
    v->types = calloc((size_t)v->n, sizeof *v->types);
    cr_assert(v->tokens && v->types);
    json_object_foreach(vocab, key, val) {
        int64_t id = json_integer_value(val);
        v->tokens[id] = strdup(key);
        v->types[id] = KV_TOKT_NORMAL;
    }
    json_array_foreach(added, i, a) {
        int64_t id = json_integer_value(json_object_get(a, "id"));
        free(v->tokens[id]);
        v->tokens[id] = strdup(json_string_value(json_object_get(a, "content")));
        v->types[id] = json_is_true(json_object_get(a, "special")) ? KV_TOKT_CONTROL : KV_TOKT_USER;
    }
    for (int32_t id = 0; id < v->n; id++)
        cr_assert_not_null(v->tokens[id], "%s: no id %d", path, id);
    v->n_merges = json_array_size(jm);
    v->merges = calloc(v->n_merges ? v->n_merges : 1, sizeof *v->merges);
    cr_assert_not_null(v->merges);
    json_array_foreach(jm, i, a) {
        if (json_is_string(a)) {
            v->merges[i] = strdup(json_string_value(a));
        } else {
            const char *l = json_string_value(json_array_get(a, 0));
            const char *r = json_string_value(json_array_get(a, 1));
            cr_assert(l && r, "%s: merges[%zu] is not a pair of strings", path, i);
            cr_assert(asprintf(&v->merges[i], "%s %s", l, r) > 0);
        }
    }
    json_decref(root);
}

static int64_t compare_on(const struct kv_tokenizer *g, const struct kv_tokenizer *j,
                          const char *name, const char *corpus, const char *text, size_t len) {
    int64_t total = 0;
    for (int k = 0; k < 2; k++) {
        int flags = k ? KV_TOK_PARSE_SPECIAL : 0;
        int32_t *gi = NULL, *ji = NULL;
        int64_t gn = 0, jn = 0;
        struct kv_err err;
        kv_err_clear(&err);
        ok(kv_tok_encode(g, text, len, flags, &gi, &gn, &err), &err);
        ok(kv_tok_encode(j, text, len, flags, &ji, &jn, &err), &err);
        int64_t i = 0;
        while (i < gn && i < jn && gi[i] == ji[i]) i++;
        if (i < gn || i < jn) {
            size_t gl = 0, jl = 0;
            const char *gp = i < gn ? kv_tok_piece(g, gi[i], &gl) : "";
            const char *jp = i < jn ? kv_tok_piece(j, ji[i], &jl) : "";
            cr_assert_fail("%s %s (flags %d): the GGUF gives %lld tokens, tokenizer.json %lld; "
                           "first difference at token %lld: GGUF %d '%.*s', tokenizer.json %d "
                           "'%.*s'",
                           name, corpus, flags, (long long)gn, (long long)jn, (long long)i,
                           i < gn ? gi[i] : -1, (int)gl, gp, i < jn ? ji[i] : -1, (int)jl, jp);
        }
        fprintf(stderr, "gguf_vocab: %s %s (flags %d): %lld tokens identical\n", name, corpus,
                flags, (long long)gn);
        total += gn;
        free(gi);
        free(ji);
    }
    return total;
}

static void equivalence(const char *name, const char *pre, int add_bos) {
    char jpath[256];
    snprintf(jpath, sizeof jpath, "deps/tokenizers/%s/tokenizer.json", name);
    if (access(jpath, R_OK) != 0)
        cr_skip_test("%s is missing; make deps builds it", jpath);
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_tokenizer *j = NULL, *g = NULL;
    ok(kv_tok_open(jpath, &j, &err), &err);
    struct json_vocab v;
    json_vocab_read(jpath, &v);
    struct vspec s = {.model = "gpt2", .pre = pre, .tokens = (const char *const *)v.tokens,
                      .n_tokens = v.n, .types = v.types, .n_types = v.n,
                      .merges = (const char *const *)v.merges, .n_merges = (int)v.n_merges,
                      .bos = kv_tok_bos(j), .eos = kv_tok_eos(j), .add_bos = add_bos,
                      .add_eos = 0};
    char *dir = kvt_temp_dir();
    char *gpath = write_vocab(dir, "vocab.gguf", &s);
    json_vocab_free(&v);
    ok(kv_tok_open(gpath, &g, &err), &err);
    free(gpath);
    kvt_rm_dir(dir);

    cr_assert_eq(kv_tok_n_vocab(g), kv_tok_n_vocab(j));
    cr_assert_eq(kv_tok_bos(g), kv_tok_bos(j));
    cr_assert_eq(kv_tok_eos(g), kv_tok_eos(j));
    cr_assert_eq(kv_tok_policy(g), kv_tok_policy(j), "policy %d, tokenizer.json's %d",
                 kv_tok_policy(g), kv_tok_policy(j));
    for (int32_t id = 0; id < kv_tok_n_vocab(j); id++) {
        size_t gl, jl;
        const char *gp = kv_tok_piece(g, id, &gl), *jp = kv_tok_piece(j, id, &jl);
        cr_assert(gl == jl && !memcmp(gp, jp, gl), "%s: piece %d differs", name, id);
        cr_assert_eq(kv_tok_type(g, id), kv_tok_type(j, id), "%s: type of %d", name, id);
    }

    int64_t total = 0;
    const char *hard = "tests/tokgold/hard.txt";
    size_t len;
    char *text;
    if (access(hard, R_OK) == 0) {
        text = kvt_read_file(hard, &len);
        cr_assert_not_null(text);
        total += compare_on(g, j, name, "hard.txt", text, len);
        free(text);
    }
    static const char *const corpora[] = {"text/wikitext-2-raw/wiki.test.raw",
                                          "text/tinystories/val1k.txt"};
    for (int c = 0; c < 2; c++) {
        const char *cp = kvt_shared(corpora[c]);
        if (!cp) {
            kv_tok_free(g);
            kv_tok_free(j);
            cr_skip_test("shared test data '%s' is absent (%lld tokens compared before); "
                         "skipping",
                         corpora[c], (long long)total);
        }
        text = kvt_read_file(cp, &len);
        cr_assert_not_null(text, "cannot read %s", cp);
        total += compare_on(g, j, name, corpora[c], text, len);
        free(text);
    }
    fprintf(stderr, "gguf_vocab: %s: %lld tokens compared, all identical\n", name,
            (long long)total);
    kv_tok_free(g);
    kv_tok_free(j);
}

Test(gguf_vocab, gpt2_tokenizer_json_as_gguf_gives_the_same_ids, .timeout = 300) {
    equivalence("gpt2", "gpt-2", 0);
}

Test(gguf_vocab, llama3_tokenizer_json_as_gguf_gives_the_same_ids, .timeout = 300) {
    equivalence("llama3", "llama-bpe", 1);
}
