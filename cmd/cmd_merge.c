/* kvcal merge: exact sum of .kvstats shards. */
#include <jansson.h>
#include <stdlib.h>

#include "cli.h"
#include "commands.h"

int cmd_merge(int argc, char **argv) {
    const char *output = NULL;
    int json = 0;
    const struct cli_opt opts[] = {
        {"output", 'o', OPT_STR, &output, "FILE", "merged statistics file to write"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON summary on stdout"},
    };
    const struct cli_cmd cmd = {
        "merge", "SHARD.kvstats SHARD.kvstats ... -o OUT.kvstats",
        "Add statistics shards into one file. Every tensor is a float64 sum, so merging\n"
        "is exact addition: the result equals one run over the union of the shards'\n"
        "windows up to float64 rounding. Shards must come from the same model (the\n"
        "fingerprint) and --seq-len, and be complete (no unfinished checkpoint); either\n"
        "every shard has Fisher statistics (collect --fisher) or none does.",
        "examples:\n"
        "  kvcal merge a.kvstats b.kvstats -o ab.kvstats\n"
        "  kvcal merge shard-*.kvstats -o all.kvstats --json\n",
        opts, (int)(sizeof opts / sizeof opts[0]), CLI_MAX_LIST};
    static const char *pos[CLI_MAX_LIST];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (n_pos < 1) return cli_usage_error(&cmd, "missing SHARD files");
    if (!output) return cli_usage_error(&cmd, "missing --output");
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stats *acc = NULL;
    if (kv_stats_merge_files(pos, n_pos, output, &acc, &err)) return cli_report(&err);
    struct kv_stats_info in = kv_stats_info(acc);
    rc = EXIT_OK;
    if (json) {
        json_t *ins = cli_json_stats_inputs(acc);
        rc = cli_print_json(json_pack("{s:o, s:i, s:s, s:I, s:I, s:I, s:b, s:o}", "output",
                                      cli_json_text(output), "shards", n_pos, "fingerprint",
                                      in.fingerprint, "seq_len", (json_int_t)in.seq_len,
                                      "tokens", (json_int_t)in.tokens, "windows",
                                      (json_int_t)in.windows, "fisher", in.has_fisher,
                                      "inputs", ins),
                            JSON_INDENT(2));
    } else {
        printf("merged    %d shard%s: %lld tokens in %lld windows of %lld%s\n", n_pos,
               n_pos > 1 ? "s" : "", (long long)in.tokens, (long long)in.windows,
               (long long)in.seq_len, in.has_fisher ? ", with fisher statistics" : "");
        for (int64_t i = 0; i < in.n_inputs; i++) {
            const struct kv_stats_input *x = kv_stats_input(acc, i);
            printf("input     %s: sha256 %.16s…, %lld windows\n", x->path, x->sha256,
                   (long long)x->windows);
        }
        printf("wrote     %s\n", output);
    }
    kv_stats_free(acc);
    return rc;
}
