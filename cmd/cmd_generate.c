/* kvcal generate: greedy decoding with the reference forward pass
 * (kv_generate_greedy); this file prints its tokens. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

/* The options as the library's messages name them. */
static const char *const gen_names[KV_GENERATE_OPT_COUNT] = {[KV_GENERATE_OPT_STEPS] = "-n"};

struct gen_print {
    int ids;          /* --ids: generated token ids instead of text */
    int64_t produced; /* generated tokens printed so far */
};

/* The prompt's text as it is, then each generated token as it comes. */
static int print_token(void *ctx, int32_t id, const char *piece, size_t len, int prompt) {
    struct gen_print *p = ctx;
    if (prompt) {
        if (!p->ids) fwrite(piece, 1, len, stdout);
        return 0;
    }
    if (p->ids)
        printf("%s%d", p->produced ? " " : "", id);
    else
        fwrite(piece, 1, len, stdout);
    fflush(stdout);
    p->produced++;
    return 0;
}

int cmd_generate(int argc, char **argv) {
    const char *model = NULL, *tokenizer = NULL, *prompt = "";
    int64_t steps = 200, threads = 0;
    int show_ids = 0;
    const struct cli_opt opts[] = {
        CLI_OPT_MODEL(&model),
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
    struct kv_err err;
    kv_err_clear(&err);
    if (kv_generate_check(steps, gen_names, &err)) return cli_usage_error(&cmd, "%s", err.msg);
    kv_set_threads((int)threads);
    struct kv_model *m;
    if ((rc = cli_load_model(model, tokenizer, &m))) return rc;
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    if (!tok) {
        kv_model_close(m);
        fprintf(stderr, "kvcal: the model has no tokenizer: pass --tokenizer FILE\n");
        return EXIT_ERR;
    }
    struct gen_print p = {.ids = show_ids};
    struct kv_generate_result r;
    rc = kv_generate_greedy(m, tok, prompt, steps, print_token, &p, &r, &err);
    kv_model_close(m);
    if (rc) return cli_report(&err);
    printf("\n");
    fflush(stdout); /* keep the text ahead of the summary when both streams are merged */
    fprintf(stderr, "generated %lld tokens in %.2f s (%.1f tokens/s)\n", (long long)r.generated,
            r.seconds, r.seconds > 0 ? (double)r.generated / r.seconds : 0.0);
    return EXIT_OK;
}
