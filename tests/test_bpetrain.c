/* kvcal train-tokenizer (kv_bpe_train): merges worked by hand on a small
 * text, the ids of the written tokenizer.json read back, and its refusals. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvcalib.h"
#include "testutil.h"

static struct kv_tokenizer *train(const char *text, int32_t vocab, char **dir_out) {
    char *dir = kvt_temp_dir(), *in = kvt_path(dir, "t.txt"), *out = kvt_path(dir, "tok.json");
    FILE *f = fopen(in, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    struct kv_bpe_opts o = {vocab, NULL};
    struct kv_bpe_result r;
    struct kv_err err;
    kv_err_clear(&err);
    const char *paths[] = {in};
    cr_assert_eq(kv_bpe_train(paths, 1, &o, out, NULL, NULL, &r, &err), KV_OK, "%s", err.msg);
    struct kv_tokenizer *t = NULL;
    cr_assert_eq(kv_tok_open(out, &t, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_tok_n_vocab(t), r.vocab);
    unlink(in), unlink(out);
    free(in), free(out);
    *dir_out = dir;
    return t;
}

static void expect_pieces(const struct kv_tokenizer *t, const char *text, const char *want) {
    int32_t *ids;
    int64_t n;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_tok_encode(t, text, strlen(text), 0, &ids, &n, &err), KV_OK, "%s", err.msg);
    char got[512] = "";
    for (int64_t i = 0; i < n; i++) {
        size_t l;
        const char *p = kv_tok_piece(t, ids[i], &l);
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%.*s", i ? "|" : "", (int)l, p);
    }
    cr_assert_str_eq(got, want, "'%s': got '%s', want '%s'", text, got, want);
    free(ids);
}

Test(bpe_train, merges_the_most_frequent_pair_first) {
    /* GPT-2's regex keeps the space with the word: "low" x1, " low" x4,
     * " lower" x2, " newest" x6, " widest" x3. Pair counts: "es" 9, "st" 9,
     * "we" 8, "lo" 7, "ow" 7, " n" 6 ... The most frequent goes first; of
     * "es" and "st" the smaller ids: 'e' (101) 's' (115) before 's' 't'. */
    const char *text = "low low low low low lower lower newest newest newest newest newest "
                       "newest widest widest widest";
    char *dir;
    struct kv_tokenizer *t = train(text, 256 + 2 + 1, &dir);
    expect_pieces(t, " newest", " |n|e|w|es|t");
    kv_tok_free(t);
    rmdir(dir), free(dir);
    t = train(text, 256 + 2 + 2, &dir);
    expect_pieces(t, " newest", " |n|e|w|est"); /* then es + t (9) */
    kv_tok_free(t);
    rmdir(dir), free(dir);
    /* enough room: every word becomes one piece, then no pair occurs twice */
    t = train(text, 1000, &dir);
    expect_pieces(t, "low lower newest widest", "low| lower| newest| widest");
    cr_assert_lt(kv_tok_n_vocab(t), 1000, "stops when no pair occurs twice");
    cr_assert_eq(kv_tok_policy(t), KV_TOK_ADD_BOS, "BOS from the template");
    size_t l;
    const char *p = kv_tok_piece(t, kv_tok_bos(t), &l);
    cr_assert(l == 17 && !memcmp(p, "<|begin_of_text|>", 17));
    kv_tok_free(t);
    rmdir(dir), free(dir);
}

Test(bpe_train, refuses_a_vocabulary_below_the_bytes) {
    struct kv_bpe_opts o = {257, NULL};
    struct kv_bpe_result r;
    struct kv_err err;
    kv_err_clear(&err);
    const char *paths[] = {"/nonexistent"};
    cr_assert_eq(kv_bpe_train(paths, 1, &o, "/tmp/x.json", NULL, NULL, &r, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "vocabulary size 257 is outside 258..1048576 (256 bytes and 2 "
                              "special tokens at least)");
    o.vocab_size = 300;
    kv_err_clear(&err);
    cr_assert_eq(kv_bpe_train(paths, 1, &o, "/tmp/x.json", NULL, NULL, &r, &err), KV_EIO);
}
