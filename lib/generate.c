/* Greedy decoding (temperature 0) with the reference forward pass: the
 * loop behind `kvcal generate`, kept in the library so that its tokens can
 * be tested without the program. */
#include <stdlib.h>
#include <string.h>

#include "err.h"

/* Bytes of one token's text handed to the callback: longer pieces are cut. */
#define PIECE_CAP 256

int kv_generate_check(int64_t steps, const char *const *names, struct kv_err *err) {
    if (steps < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 1",
                       names ? names[KV_GENERATE_OPT_STEPS] : "steps");
    return KV_OK;
}

/* Hand token i of seq (its text after token i-1; -1 before BOS) to the caller. */
static int emit(const struct kv_tokenizer *tok, const int32_t *seq, int64_t i, int prompt,
                kv_generate_fn on_token, void *ctx) {
    char piece[PIECE_CAP];
    size_t pl = kv_tok_decode(tok, i ? seq[i - 1] : -1, seq[i], piece, sizeof piece);
    return on_token(ctx, seq[i], piece, pl < sizeof piece ? pl : sizeof piece, prompt);
}

int kv_generate_greedy(const struct kv_model *m, const struct kv_tokenizer *tok,
                       const char *prompt, int64_t steps, kv_generate_fn on_token, void *ctx,
                       struct kv_generate_result *out, struct kv_err *err) {
    KV_ASSERT(m && tok && prompt && on_token && out);
    memset(out, 0, sizeof *out);
    int rc = kv_generate_check(steps, NULL, err);
    if (rc) return rc;
    int32_t *ids = NULL;
    int64_t n_prompt = 0;
    if ((rc = kv_tok_encode(tok, prompt, strlen(prompt), kv_tok_adds_bos(tok) ? KV_TOK_ADD_BOS : 0,
                            &ids, &n_prompt, err)))
        return rc;
    if (n_prompt == 0) {
        free(ids);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "the prompt is empty and the tokenizer adds no bos token: give a prompt");
    }
    /* the whole sequence fits one buffer and one cache from the start */
    int64_t ctx_len = n_prompt + steps;
    int32_t *seq = realloc(ids, (size_t)ctx_len * sizeof *seq);
    if (!seq) {
        free(ids);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    struct kv_fwd *f = NULL;
    if ((rc = kv_fwd_init(m, ctx_len, &f, err))) {
        free(seq);
        return rc;
    }
    out->prompt_tokens = n_prompt;
    int stop = 0;
    for (int64_t i = 0; i < n_prompt && !stop; i++) stop = emit(tok, seq, i, 1, on_token, ctx);
    int64_t vocab = kv_model_config(m)->vocab_size, len = n_prompt, run_from = 0;
    double t0 = kv_now();
    while (!stop && out->generated < steps) {
        /* the prompt in one run, then one position per step over the cache */
        if ((rc = kv_fwd_run(f, seq + run_from, len - run_from, run_from, NULL, err))) break;
        const float *lg = kv_fwd_logits(f) + (len - run_from - 1) * vocab;
        int32_t best = 0;
        for (int64_t j = 1; j < vocab; j++)
            if (lg[j] > lg[best]) best = (int32_t)j;
        if (best == kv_tok_bos(tok) || best == kv_tok_eos(tok)) break;
        seq[len] = best;
        stop = emit(tok, seq, len, 0, on_token, ctx);
        run_from = len;
        len++;
        out->generated++;
    }
    out->seconds = kv_now() - t0;
    kv_fwd_free(f);
    free(seq);
    return rc;
}
