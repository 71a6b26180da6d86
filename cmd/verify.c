/* kvcal verify: perplexity under the windows protocol. */
#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

int cmd_verify(int argc, char **argv) {
    const char *model = NULL, *tokenizer = NULL, *text = NULL, *tokens = NULL;
    int64_t seq_len = 256, max_windows = 0, threads = 0;
    int json = 0, quiet = 0;
    const struct cli_opt opts[] = {
        {"model", 'm', OPT_STR, &model, "PATH", "model: HF directory, .gguf or llama2.c .bin"},
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE",
         "override the model's tokenizer (tokenizer.bin, tokenizer.json or .gguf)"},
        {"text", 't', OPT_STR, &text, "FILE", "evaluation text, .txt or .gz (one document)"},
        {"tokens", 0, OPT_STR, &tokens, "FILE",
         "pre-tokenized ids (little-endian uint32) instead of --text; include BOS yourself"},
        {"seq-len", 0, OPT_INT, &seq_len, "N", "window length in tokens (default 256)"},
        {"max-windows", 0, OPT_INT, &max_windows, "W", "evaluate only the first W windows"},
        {"threads", 0, OPT_INT, &threads, "N", "threads for BLAS and OpenMP (default: all cores)"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON object on stdout"},
        {"quiet", 'q', OPT_FLAG, &quiet, NULL, "no progress on stderr"},
    };
    const struct cli_cmd cmd = {
        "verify", "--model PATH --text FILE [options]",
        "Report the perplexity of a model on held-out text.",
        "protocol (windows): the text is one document with BOS once at its start; its tokens\n"
        "are cut into non-overlapping windows of --seq-len (the remainder is dropped); each\n"
        "window runs on its own and positions 1..seq-len-1 are scored; ppl = exp(mean nll).\n"
        "\nexamples:\n"
        "  kvcal verify --model stories260K.bin --tokenizer tok512.bin --text val1k.txt\n"
        "  kvcal verify --model tinystories-656K --text wiki.test.raw --seq-len 256 --json\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!model) return cli_usage_error(&cmd, "missing --model");
    if (!text == !tokens) return cli_usage_error(&cmd, "give exactly one of --text or --tokens");
    if (seq_len < 2) return cli_usage_error(&cmd, "--seq-len must be at least 2, got %lld", (long long)seq_len);
    if (max_windows < 0) return cli_usage_error(&cmd, "--max-windows must be positive");
    if (threads < 0) return cli_usage_error(&cmd, "--threads must be positive");
    kv_set_threads((int)threads);

    const char *src = text ? text : tokens;
    struct kv_model *m;
    if ((rc = cli_load_model(model, tokenizer, &m))) return rc;
    const struct kv_config *c = kv_model_config(m);
    int32_t *ids;
    int64_t n;
    size_t n_bytes;
    if ((rc = cli_load_tokens(m, text, tokens, &ids, &n, &n_bytes))) {
        kv_model_free(m);
        return rc;
    }
    struct cli_progress prog;
    cli_progress_start(&prog, "windows", quiet || json);
    struct kv_ppl_result r;
    struct kv_err err;
    kv_err_clear(&err);
    rc = kv_ppl_run(m, ids, n, seq_len, max_windows, cli_progress_cb, &prog, &r, &err);
    cli_progress_end(&prog);
    free(ids);
    if (rc) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", src);
        kv_model_free(m);
        return cli_report(&err);
    }
    double tps = r.seconds > 0 ? (double)(r.windows * seq_len) / r.seconds : 0;
    int nthreads = omp_get_max_threads();
    if (json) {
        json_t *o = json_pack("{s:s, s:o, s:s, s:o, s:I, s:I, s:I, s:I, s:I, s:o, s:o, s:o, s:o, s:i, s:o}",
                              "protocol", "windows", "model", cli_json_text(model), "format",
                              kv_format_name(kv_model_format(m)), "text", cli_json_text(src),
                              "seq_len", (json_int_t)seq_len, "tokens", (json_int_t)r.tokens,
                              "windows", (json_int_t)r.windows, "scored", (json_int_t)r.scored,
                              "params", (json_int_t)kv_model_n_params(m), "nll",
                              cli_json_real(r.nll), "ppl", cli_json_real(r.ppl), "tokens_per_s",
                              cli_json_real(tps), "seconds", cli_json_real(r.seconds), "threads",
                              nthreads, "peak_rss_mib", cli_json_real(cli_peak_rss_mib()));
        rc = cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    } else {
        char desc[512], np[32];
        cli_describe_config(c, desc, sizeof desc);
        cli_human_count((double)kv_model_n_params(m), np, sizeof np);
        printf("model     %s (%s, %s params)\n          %s\n", model,
               kv_format_name(kv_model_format(m)), np, desc);
        if (text)
            printf("text      %s: %zu bytes, %lld tokens with BOS\n", text, n_bytes, (long long)r.tokens);
        else
            printf("tokens    %s: %lld tokens\n", tokens, (long long)r.tokens);
        printf("protocol  windows: seq-len %lld, non-overlapping, remainder dropped, "
               "positions 1..%lld scored\n", (long long)seq_len, (long long)(seq_len - 1));
        printf("windows   %lld, %lld scored tokens\n", (long long)r.windows, (long long)r.scored);
        printf("nll       %.6f\n", r.nll);
        printf("ppl       %.4f\n", r.ppl);
        printf("speed     %.0f tokens/s (%d threads, %.2f s), peak rss %.1f MiB\n", tps, nthreads,
               r.seconds, cli_peak_rss_mib());
    }
    kv_model_free(m);
    return rc;
}
