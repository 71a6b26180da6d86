/* kvcal train-tokenizer: learn a byte-level BPE vocabulary from text
 * (kv_bpe_train) and write it as an HF tokenizer.json. */
#include <stdio.h>
#include <stdlib.h>

#include "cli.h"
#include "commands.h"

static void on_merge(void *ctx, int32_t pieces, int32_t target) {
    cli_progress_cb(ctx, pieces, target, 0);
}

int cmd_train_tokenizer(int argc, char **argv) {
    static struct cli_list texts;
    static const char *output, *regex;
    static int64_t vocab = 4096;
    static int quiet;
    const struct cli_opt opts[] = {
        {"text", 't', OPT_LIST, &texts, "FILE", "training text (.txt, .gz, .jsonl); repeat for more"},
        {"output", 'o', OPT_STR, &output, "FILE", "tokenizer.json to write"},
        {"vocab-size", 0, OPT_INT, &vocab, "N",
         "ids in all: 256 bytes, the merges, and 2 special tokens (default 4096)"},
        {"regex", 0, OPT_STR, &regex, "RE",
         "pre-tokenizer regex (PCRE2), written as a Split before ByteLevel\n"
         "(default: GPT-2's, inside ByteLevel)"},
        CLI_OPT_QUIET(&quiet),
    };
    const struct cli_cmd cmd = {
        "train-tokenizer", "--text FILE -o tokenizer.json [--vocab-size N]",
        "Learn a byte-level BPE vocabulary, as GPT-2's and Llama 3's are: the text is\n"
        "split by the pre-tokenizer regex, each word starts as its bytes, and the most\n"
        "frequent adjacent pair (counted over the distinct words) is merged, round after\n"
        "round, until the vocabulary is full or no pair occurs twice. The last two ids are\n"
        "<|begin_of_text|> (BOS, added to every text) and <|end_of_text|> (EOS). The\n"
        "tokenizer.json is read by kvcal and by Hugging Face's tokenizers alike.",
        "example:\n"
        "  kvcal train-tokenizer -t data/kjv/train.txt --vocab-size 4096 -o kjv-bpe.json\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (texts.n == 0) return cli_usage_error(&cmd, "missing --text");
    if (!output) return cli_usage_error(&cmd, "missing --output");
    if (vocab < 258 || vocab > (1 << 20))
        return cli_usage_error(&cmd, "--vocab-size must be 258..%d, got %lld", 1 << 20,
                               (long long)vocab);
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_bpe_opts o = {(int32_t)vocab, regex};
    struct kv_bpe_result r;
    struct cli_progress prog;
    cli_progress_start(&prog, "pieces", quiet);
    rc = kv_bpe_train((const char *const *)texts.v, texts.n, &o, output, on_merge, &prog, &r, &err);
    cli_progress_end(&prog);
    if (rc) return cli_report(&err);
    printf("text      %lld bytes, %lld words, %lld distinct\n", (long long)r.bytes,
           (long long)r.words, (long long)r.distinct_words);
    printf("learned   %d merges: %d ids (256 bytes, %d merged pieces, 2 special)\n", r.merges,
           r.vocab, r.vocab - 258);
    printf("time      %.2f s\n", r.seconds);
    printf("wrote     %s\n", output);
    return EXIT_OK;
}
