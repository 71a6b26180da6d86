/* Format detection and the published reference outputs of the shared models. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static const char *REFERENCE_STORY =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.";

static char *path_copy(const char *rel) {
    const char *p = kvt_shared(rel);
    return p ? strdup(p) : NULL;
}

/* Greedy decoding of n tokens from BOS; returns the decoded text. */
static char *greedy(const struct kv_model *m, int n) {
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    cr_assert_not_null(tok);
    int64_t vocab = kv_model_config(m)->vocab_size;
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, n + 1, &f, &err), KV_OK);
    int32_t *ids = malloc((size_t)(n + 1) * sizeof *ids);
    ids[0] = kv_tok_bos(tok);
    char *out = calloc(1, 65536);
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(kv_fwd_run(f, ids + i, 1, i, NULL, &err), KV_OK, "%s", err.msg);
        const float *lg = kv_fwd_logits(f);
        int32_t best = 0;
        for (int64_t j = 1; j < vocab; j++)
            if (lg[j] > lg[best]) best = (int32_t)j;
        ids[i + 1] = best;
        len += kv_tok_decode(tok, ids[i], best, out + len, 65535 - len);
    }
    free(ids);
    kv_fwd_free(f);
    return out;
}

Test(loader, stories260K_greedy_matches_the_published_text_from_bin_and_gguf) {
    char *bin = path_copy("models/stories260K/stories260K.bin");
    char *tok = path_copy("models/stories260K/tok512.bin");
    char *gguf = path_copy("models/stories260K/stories260K.gguf");
    if (!bin || !tok || !gguf) cr_skip_test("shared models are absent; skipping");
    kv_set_threads(1);
    struct kv_model *a, *b;
    struct kv_err err;
    cr_assert_eq(kv_model_open(bin, tok, &a, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(gguf, NULL, &b, &err), KV_OK, "%s", err.msg);
    char *ta = greedy(a, 200), *tb = greedy(b, 200);
    cr_assert(strncmp(ta, REFERENCE_STORY, strlen(REFERENCE_STORY)) == 0,
              "llama2.c output differs from the reference:\n%s", ta);
    cr_assert_str_eq(ta, tb, "bin and gguf outputs differ");
    free(ta), free(tb), free(bin), free(tok), free(gguf);
    kv_model_close(a), kv_model_close(b);
}

static void expect_ids(const struct kv_tokenizer *t, const char *text, const int32_t *want,
                       int64_t n_want) {
    int32_t *ids;
    int64_t n;
    struct kv_err err;
    cr_assert_eq(kv_tok_encode(t, text, strlen(text), 1, &ids, &n, &err), KV_OK);
    cr_assert_eq(n, n_want, "'%s': %lld ids, want %lld", text, (long long)n, (long long)n_want);
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(ids[i], want[i], "'%s': id %lld is %d, want %d", text, (long long)i, ids[i],
                     want[i]);
    free(ids);
}

Test(loader, llama2_32k_tokenizer_reproduces_published_ids) {
    char *p = path_copy("models/llama2-tokenizer/tokenizer.bin");
    if (!p) cr_skip_test("shared llama2 tokenizer is absent; skipping");
    struct kv_tokenizer *t;
    struct kv_err err;
    cr_assert_eq(kv_tok_open(p, &t, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_tok_n_vocab(t), 32000);
    const int32_t a[] = {1, 306, 4658, 278, 6593, 310, 2834, 338};
    expect_ids(t, "I believe the meaning of life is", a, 8);
    const int32_t b[] = {1, 3439, 17632, 1925, 29892, 278, 6368, 310, 14215, 537, 5922, 393, 29871};
    expect_ids(t, "Simply put, the theory of relativity states that ", b, 13);
    kv_tok_free(t);
    free(p);
}

Test(loader, tok512_and_gguf_vocabulary_agree_on_val1k) {
    char *tok = path_copy("models/stories260K/tok512.bin");
    char *gguf = path_copy("models/stories260K/stories260K.gguf");
    char *text = path_copy("text/tinystories/val1k.txt");
    if (!tok || !gguf || !text) cr_skip_test("shared files are absent; skipping");
    struct kv_tokenizer *a, *b;
    struct kv_err err;
    cr_assert_eq(kv_tok_open(tok, &a, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_tok_open(gguf, &b, &err), KV_OK, "%s", err.msg);
    char *s;
    size_t len;
    cr_assert_eq(kv_text_read(text, &s, &len, &err), KV_OK);
    int32_t *ia, *ib;
    int64_t na, nb;
    cr_assert_eq(kv_tok_encode(a, s, len, 1, &ia, &na, &err), KV_OK);
    cr_assert_eq(kv_tok_encode(b, s, len, 1, &ib, &nb, &err), KV_OK);
    cr_assert_eq(na, 404019, "tok512 gave %lld tokens", (long long)na);
    cr_assert_eq(na, nb);
    for (int64_t i = 0; i < na; i++)
        cr_assert_eq(ia[i], ib[i], "position %lld: tok512 %d, gguf %d", (long long)i, ia[i], ib[i]);
    /* decoding the ids gives back the text (tok512 has byte fallback) */
    char *dec = malloc(len + 64);
    size_t dl = 0;
    for (int64_t i = 1; i < na; i++) dl += kv_tok_decode(a, ia[i - 1], ia[i], dec + dl, len + 64 - dl);
    cr_assert_eq(dl, len);
    cr_assert(memcmp(dec, s, len) == 0);
    free(dec), free(ia), free(ib), free(s), free(tok), free(gguf), free(text);
    kv_tok_free(a), kv_tok_free(b);
}

Test(loader, tokenizer_override_must_fit_the_vocabulary) {
    char *bin = path_copy("models/stories260K/stories260K.bin");
    char *big = path_copy("models/llama2-tokenizer/tokenizer.bin");
    if (!bin || !big) cr_skip_test("shared files are absent; skipping");
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_open(bin, big, &m, &err), KV_EINVAL);
    char want[8192];
    snprintf(want, sizeof want,
             "tokenizer has 32000 pieces but the model '%s' has a vocabulary of 512", bin);
    cr_assert_str_eq(err.msg, want);
    free(bin), free(big);
}

Test(loader, missing_path_and_model_file_inside_a_directory) {
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_open("/nonexistent/model", NULL, &m, &err), KV_EIO);
    cr_assert_str_eq(err.msg, "no such file or directory");
    char *st = path_copy("models/tinystories-656K/model.safetensors");
    if (!st) cr_skip_test("shared files are absent; skipping");
    cr_assert_eq(kv_model_open(st, NULL, &m, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "pass the model directory (with config.json), not one of its files");
    free(st);
}
