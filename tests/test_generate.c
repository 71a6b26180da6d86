/* Greedy decoding (lib/generate.c): the published stories260K story, and
 * every generated token against the argmax of a naive float64 forward pass
 * over the whole sequence so far (no cache, no code shared with
 * lib/forward.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "naive_llama.h"
#include "testutil.h"

/* What the callback saw. */
struct seen {
    int32_t ids[512];
    int prompt[512];
    int64_t n;
    char text[8192];
    size_t len;
    int64_t stop_after; /* generated tokens after which to stop (0: never) */
    int64_t generated;
};

static int collect(void *ctx, int32_t id, const char *piece, size_t len, int prompt) {
    struct seen *s = ctx;
    cr_assert_lt(s->n, 512);
    s->ids[s->n] = id, s->prompt[s->n] = prompt, s->n++;
    cr_assert_lt(s->len + len, sizeof s->text);
    memcpy(s->text + s->len, piece, len);
    s->len += len;
    s->text[s->len] = 0;
    s->generated += !prompt;
    return s->stop_after && s->generated == s->stop_after;
}

static struct kv_model *open_model(const char *path, const char *tok) {
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(path, tok, &m, &err), KV_OK, "%s", err.msg);
    return m;
}

Test(generate, reproduces_the_published_stories260K_story) {
    KVT_NEED_SHARED(p, "models/stories260K/stories260K.gguf");
    struct kv_model *m = open_model(p, NULL);
    kv_set_threads(1);
    struct seen s = {0};
    struct kv_generate_result r;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_generate_greedy(m, kv_model_tokenizer(m), "", 200, collect, &s, &r, &err),
                 KV_OK, "%s", err.msg);
    const char *want = "Once upon a time, there was a little girl named Lily. She loved to play "
                       "outside in the park. One day, she saw a big, red ball. She wanted to play "
                       "with it, but it was too high.";
    cr_assert(strncmp(s.text, want, strlen(want)) == 0, "got:\n%s", s.text);
    cr_assert_eq(r.prompt_tokens, 1);
    cr_assert_eq(r.generated, 200);
    cr_assert_eq(s.n, 201);
    cr_assert(s.prompt[0] && s.ids[0] == kv_tok_bos(kv_model_tokenizer(m)));
    for (int64_t i = 1; i < s.n; i++) cr_assert_eq(s.prompt[i], 0, "token %lld", (long long)i);
    cr_assert(r.seconds > 0);
    kv_model_close(m);
}

/* Index of the largest value; *gap gets its lead over the runner-up. */
static int64_t argmax_gap(const double *row, int64_t n, double *gap) {
    int64_t b = 0;
    for (int64_t j = 1; j < n; j++)
        if (row[j] > row[b]) b = j;
    double second = -INFINITY;
    for (int64_t j = 0; j < n; j++)
        if (j != b && row[j] > second) second = row[j];
    *gap = row[b] - second;
    return b;
}

Test(generate, every_token_is_the_argmax_of_a_naive_forward_of_the_sequence) {
    KVT_NEED_SHARED(tp, "models/stories260K/tok512.bin");
    struct kv_tokenizer *tok;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_tok_open(tp, &tok, &err), KV_OK, "%s", err.msg);
    struct kv_config c = tiny_cfg(KV_ROPE_INTERLEAVED, 0, 1);
    c.vocab_size = kv_tok_n_vocab(tok);
    struct kv_model *m;
    cr_assert_eq(kv_model_init_random(&c, 7, &m, &err), KV_OK, "%s", err.msg);
    sharpen(m);
    /* a larger head spreads the logits, so the naive and fp32 maxima agree */
    float *head = (float *)m->tok_emb;
    for (int64_t i = 0; i < c.vocab_size * c.dim; i++) head[i] *= 50;
    const char *prompt = "Once upon a time";
    int32_t *pids;
    int64_t np;
    cr_assert_eq(kv_tok_encode(tok, prompt, strlen(prompt), 1, &pids, &np, &err), KV_OK);
    struct seen s = {0};
    struct kv_generate_result r;
    const int64_t steps = 24;
    cr_assert_eq(kv_generate_greedy(m, tok, prompt, steps, collect, &s, &r, &err), KV_OK, "%s",
                 err.msg);
    cr_assert_eq(r.prompt_tokens, np);
    for (int64_t i = 0; i < np; i++) cr_assert(s.ids[i] == pids[i] && s.prompt[i]);
    cr_assert_eq(s.n, np + r.generated);
    int64_t checked = 0;
    for (int64_t k = 0; k <= r.generated && np + k < c.max_seq_len; k++) {
        int64_t n = np + k;
        double *lg = naive_forward(m, s.ids, n), gap;
        const double *last = lg + (n - 1) * c.vocab_size;
        int64_t b = argmax_gap(last, c.vocab_size, &gap);
        int stopped = k == r.generated;
        if (stopped && r.generated < steps) {
            /* decoding stopped here: the argmax is BOS or EOS */
            cr_assert(b == kv_tok_bos(tok) || b == kv_tok_eos(tok), "stopped at %lld", (long long)k);
        } else if (!stopped) {
            /* fp32 against float64: a near-tie may go either way */
            double tol = 1e-4 * (fabs(last[b]) + 1);
            if (gap > tol)
                cr_assert_eq(s.ids[n], b, "step %lld: %d, naive argmax %lld (lead %g)",
                             (long long)k, s.ids[n], (long long)b, gap);
            else
                cr_assert(last[s.ids[n]] >= last[b] - tol, "step %lld", (long long)k);
            checked += gap > tol;
        }
        free(lg);
    }
    cr_assert_geq(checked, r.generated - 2, "only %lld of %lld steps had a clear maximum",
                  (long long)checked, (long long)r.generated);
    cr_assert_geq(r.generated, 8, "decoding stopped after %lld tokens", (long long)r.generated);
    free(pids);
    kv_model_close(m);
    kv_tok_free(tok);
}

Test(generate, a_callback_stops_the_decoding) {
    KVT_NEED_SHARED(p, "models/stories260K/stories260K.gguf");
    struct kv_model *m = open_model(p, NULL);
    struct seen s = {.stop_after = 3};
    struct kv_generate_result r;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_generate_greedy(m, kv_model_tokenizer(m), "Lily", 50, collect, &s, &r, &err),
                 KV_OK, "%s", err.msg);
    cr_assert_eq(r.generated, 3);
    cr_assert_eq(s.n, r.prompt_tokens + 3);
    kv_model_close(m);
}

Test(generate, steps_below_one_are_refused_in_the_callers_words) {
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_generate_check(1, NULL, &err), KV_OK);
    cr_assert_eq(kv_generate_check(0, NULL, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "steps must be at least 1");
    const char *const names[KV_GENERATE_OPT_COUNT] = {[KV_GENERATE_OPT_STEPS] = "-n"};
    cr_assert_eq(kv_generate_check(-5, names, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "-n must be at least 1");
    KVT_NEED_SHARED(p, "models/stories260K/stories260K.gguf");
    struct kv_model *m = open_model(p, NULL);
    struct seen s = {0};
    struct kv_generate_result r;
    cr_assert_eq(kv_generate_greedy(m, kv_model_tokenizer(m), "", 0, collect, &s, &r, &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.msg, "steps must be at least 1");
    cr_assert_eq(s.n, 0);
    kv_model_close(m);
}
