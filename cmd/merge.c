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
    struct kv_stats *acc = NULL, *b = NULL;
    if (kv_stats_open(pos[0], &acc, &err)) return cli_report(&err);
    /* a lone shard still gets the checks a merge makes */
    if (acc->next_window < acc->plan_windows) {
        fprintf(stderr, "kvcal: %s: an unfinished checkpoint (%lld of %lld windows); finish it "
                        "with 'kvcal collect --resume' first\n", pos[0],
                (long long)acc->next_window, (long long)acc->plan_windows);
        kv_stats_free(acc);
        return EXIT_ERR;
    }
    for (int i = 1; i < n_pos; i++) {
        if (kv_stats_open(pos[i], &b, &err) || kv_stats_merge(acc, b, pos[i], &err)) {
            kv_stats_free(b);
            kv_stats_free(acc);
            return cli_report(&err);
        }
        kv_stats_free(b);
        b = NULL;
    }
    rc = EXIT_OK;
    if (kv_stats_write(acc, output, &err)) {
        kv_stats_free(acc);
        return cli_report(&err);
    }
    if (json) {
        json_t *ins = cli_json_stats_inputs(acc);
        rc = cli_print_json(json_pack("{s:o, s:i, s:s, s:I, s:I, s:I, s:b, s:o}", "output",
                                      cli_json_text(output), "shards", n_pos, "fingerprint",
                                      acc->fingerprint, "seq_len", (json_int_t)acc->seq_len,
                                      "tokens", (json_int_t)acc->tokens, "windows",
                                      (json_int_t)acc->windows, "fisher", acc->has_fisher,
                                      "inputs", ins),
                            JSON_INDENT(2));
    } else {
        printf("merged    %d shard%s: %lld tokens in %lld windows of %lld%s\n", n_pos,
               n_pos > 1 ? "s" : "", (long long)acc->tokens, (long long)acc->windows,
               (long long)acc->seq_len, acc->has_fisher ? ", with fisher statistics" : "");
        for (int64_t i = 0; i < acc->n_inputs; i++)
            printf("input     %s: sha256 %.16s…, %lld windows\n", acc->inputs[i].path,
                   acc->inputs[i].sha256, (long long)acc->inputs[i].windows);
        printf("wrote     %s\n", output);
    }
    kv_stats_free(acc);
    return rc;
}
