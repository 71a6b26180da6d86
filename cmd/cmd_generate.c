/* kvcal generate: greedy decoding with the reference forward pass. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

int cmd_generate(int argc, char **argv) {
    const char *model = NULL, *tokenizer = NULL, *prompt = "";
    int64_t steps = 200, threads = 0;
    int show_ids = 0;
    const struct cli_opt opts[] = {
        {"model", 'm', OPT_STR, &model, "PATH", "model: HF directory, .gguf or llama2.c .bin"},
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE", "override the model's tokenizer"},
        {"prompt", 'p', OPT_STR, &prompt, "TEXT", "text to continue (default: start from BOS)"},
        {"steps", 'n', OPT_INT, &steps, "N", "number of tokens to generate (default 200)"},
        {"threads", 0, OPT_INT, &threads, "N", "threads for BLAS and OpenMP"},
        {"ids", 0, OPT_FLAG, &show_ids, NULL, "print token ids instead of text"},
    };
    const struct cli_cmd cmd = {
        "generate", "--model PATH [--prompt TEXT] [-n N]",
        "Greedy decoding (temperature 0) from BOS plus an optional prompt. The text goes to\n"
        "stdout; the speed goes to stderr. Decoding stops early at BOS or EOS.",
        "example:\n"
        "  kvcal generate --model stories260K.gguf -n 200\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!model) return cli_usage_error(&cmd, "missing --model");
    if (steps < 1) return cli_usage_error(&cmd, "-n must be at least 1");
    kv_set_threads((int)threads);
    struct kv_model *m;
    if ((rc = cli_load_model(model, tokenizer, &m))) return rc;
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    if (!tok) {
        kv_model_close(m);
        fprintf(stderr, "kvcal: the model has no tokenizer: pass --tokenizer FILE\n");
        return EXIT_ERR;
    }
    struct kv_err err;
    kv_err_clear(&err);
    int32_t *ids = NULL;
    int64_t n_prompt = 0;
    struct kv_fwd *f = NULL;
    if ((rc = kv_tok_encode(tok, prompt, strlen(prompt), 1, &ids, &n_prompt, &err))) goto fail;
    int64_t ctx = n_prompt + steps;
    int32_t *seq = realloc(ids, (size_t)ctx * sizeof *seq);
    if (!seq) {
        err = (struct kv_err){.code = KV_ENOMEM, .off = KV_NO_OFFSET, .msg = "out of memory"};
        rc = KV_ENOMEM;
        goto fail;
    }
    ids = seq;
    if ((rc = kv_fwd_init(m, ctx, &f, &err))) goto fail;
    int64_t vocab = kv_model_config(m)->vocab_size, len = n_prompt;
    for (int64_t i = 0; i < n_prompt; i++) {
        char piece[256];
        size_t pl = kv_tok_decode(tok, i ? ids[i - 1] : -1, ids[i], piece, sizeof piece);
        if (!show_ids) fwrite(piece, 1, pl < sizeof piece ? pl : sizeof piece, stdout);
    }
    double t0 = kv_now();
    int64_t produced = 0, run_from = 0;
    while (produced < steps) {
        if ((rc = kv_fwd_run(f, ids + run_from, len - run_from, run_from, NULL, &err))) goto fail;
        const float *lg = kv_fwd_logits(f) + (len - run_from - 1) * vocab;
        int32_t best = 0;
        for (int64_t j = 1; j < vocab; j++)
            if (lg[j] > lg[best]) best = (int32_t)j;
        if (best == kv_tok_bos(tok) || best == kv_tok_eos(tok)) break;
        ids[len] = best;
        if (show_ids) {
            printf("%s%d", produced ? " " : "", best);
        } else {
            char piece[256];
            size_t pl = kv_tok_decode(tok, ids[len - 1], best, piece, sizeof piece);
            fwrite(piece, 1, pl < sizeof piece ? pl : sizeof piece, stdout);
        }
        fflush(stdout);
        run_from = len;
        len++;
        produced++;
    }
    printf("\n");
    fflush(stdout); /* keep the text ahead of the summary when both streams are merged */
    double dt = kv_now() - t0;
    fprintf(stderr, "generated %lld tokens in %.2f s (%.1f tokens/s)\n", (long long)produced, dt,
            dt > 0 ? (double)produced / dt : 0.0);
    kv_fwd_free(f);
    free(ids);
    kv_model_close(m);
    return EXIT_OK;
fail:
    kv_fwd_free(f);
    free(ids);
    kv_model_close(m);
    return cli_report(&err);
}
