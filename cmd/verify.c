/* kvcal verify: perplexity under the windows protocol. */
#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

/* Base against compressed: both models on the same windows. */
static int verify_compressed(const char *model, const char *src, const char *text,
                             const char *dir, struct kv_model *m, const int32_t *ids, int64_t n,
                             size_t n_bytes, int64_t seq_len, int64_t max_windows, int64_t kv_bits,
                             int hadamard, int json, int quiet) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_lowrank *lr;
    if (kv_lr_dir_open(dir, m, &lr, &err)) return cli_report(&err);
    if (hadamard && !lr->hadamard && kv_lowrank_hadamard(lr, &err)) {
        kv_lowrank_free(lr);
        return cli_report(&err);
    }
    int bits = kv_bits ? (int)kv_bits : lr->kv_bits;
    struct cli_progress prog;
    cli_progress_start(&prog, "windows", quiet || json);
    struct kv_compare_result r;
    int rc = kv_ppl_compare(m, lr, bits, ids, n, seq_len, max_windows, cli_progress_cb, &prog, &r, &err);
    cli_progress_end(&prog);
    if (rc) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", src);
        kv_lowrank_free(lr);
        return cli_report(&err);
    }
    const struct kv_config *c = kv_model_config(m);
    int64_t base = kv_lowrank_base_bytes(c), comp = kv_lowrank_bytes(lr, bits);
    double ratio = (double)comp / (double)base;
    double tb = r.base.seconds > 0 ? (double)(r.base.windows * seq_len) / r.base.seconds : 0;
    double tc = r.comp.seconds > 0 ? (double)(r.comp.windows * seq_len) / r.comp.seconds : 0;
    if (json) {
        json_t *o = json_pack(
            "{s:s, s:o, s:o, s:o, s:s, s:s, s:i, s:b, s:I, s:I, s:I, s:I, s:o, s:o, s:o, s:o, s:o, "
            "s:o, s:o, s:{s:I, s:I, s:o}, s:o, s:o, s:o}",
            "protocol", "windows", "model", cli_json_text(model), "compressed", cli_json_text(dir),
            "text", cli_json_text(src), "method", lr->method, "alloc", lr->alloc, "kv_bits", bits,
            "hadamard", lr->hadamard, "seq_len", (json_int_t)seq_len, "tokens",
            (json_int_t)r.comp.tokens, "windows", (json_int_t)r.comp.windows, "scored",
            (json_int_t)r.comp.scored, "nll", cli_json_real(r.comp.nll), "ppl",
            cli_json_real(r.comp.ppl), "base_nll", cli_json_real(r.base.nll), "base_ppl",
            cli_json_real(r.base.ppl), "delta_ppl", cli_json_real(r.comp.ppl - r.base.ppl), "kl",
            cli_json_real(r.kl), "top1", cli_json_real(r.top1), "kv_bytes_per_token", "base",
            (json_int_t)base, "compressed", (json_int_t)comp, "ratio", cli_json_real(ratio),
            "tokens_per_s", cli_json_real(tc), "base_tokens_per_s", cli_json_real(tb),
            "peak_rss_mib", cli_json_real(cli_peak_rss_mib()));
        rc = cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    } else {
        char desc[512];
        cli_describe_config(c, desc, sizeof desc);
        printf("model       %s\n            %s\n", model, desc);
        printf("compressed  %s: %s, alloc %s, %s latents%s\n", dir, lr->method, lr->alloc,
               bits == 16 ? "fp16" : (bits == 8 ? "int8" : bits == 4 ? "int4" : bits == 3 ? "int3" : "int2"),
               lr->hadamard ? ", hadamard" : "");
        if (text)
            printf("text        %s: %zu bytes, %lld tokens with BOS\n", text, n_bytes, (long long)r.comp.tokens);
        else
            printf("tokens      %s: %lld tokens\n", src, (long long)r.comp.tokens);
        printf("protocol    windows: seq-len %lld, non-overlapping, remainder dropped, positions "
               "1..%lld scored\n", (long long)seq_len, (long long)(seq_len - 1));
        printf("windows     %lld, %lld scored tokens\n", (long long)r.comp.windows, (long long)r.comp.scored);
        printf("\n            base        compressed\n");
        printf("ppl         %-11.4f %.4f   (delta %+.4f, %+.2f%%)\n", r.base.ppl, r.comp.ppl,
               r.comp.ppl - r.base.ppl, 100 * (r.comp.ppl / r.base.ppl - 1));
        printf("nll         %-11.6f %.6f\n", r.base.nll, r.comp.nll);
        printf("kv bytes    %-11lld %lld per token   (%.4f of base)\n", (long long)base, (long long)comp, ratio);
        printf("kl          %.6f nats per token, KL(base || compressed)\n", r.kl);
        printf("top-1       %.4f of positions agree\n", r.top1);
        printf("speed       %.0f tokens/s base, %.0f compressed, peak rss %.1f MiB\n", tb, tc,
               cli_peak_rss_mib());
    }
    kv_lowrank_free(lr);
    return rc;
}

int cmd_verify(int argc, char **argv) {
    const char *model = NULL, *tokenizer = NULL, *text = NULL, *tokens = NULL, *comp = NULL;
    int64_t seq_len = 256, max_windows = 0, threads = 0, kv_bits = 0;
    int json = 0, quiet = 0, hadamard = 0;
    const struct cli_opt opts[] = {
        {"model", 'm', OPT_STR, &model, "PATH", "model: HF directory, .gguf or llama2.c .bin"},
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE",
         "override the model's tokenizer (tokenizer.bin, tokenizer.json or .gguf)"},
        {"text", 't', OPT_STR, &text, "FILE", "evaluation text, .txt or .gz (one document)"},
        {"tokens", 0, OPT_STR, &tokens, "FILE",
         "pre-tokenized ids (little-endian uint32) instead of --text; include BOS yourself"},
        {"compressed", 0, OPT_STR, &comp, "DIR",
         "also run the compressed model in DIR (from 'kvcal decompose') with a cache that\n"
         "stores latents, and compare it with the base: ppl, kl, top-1, kv bytes"},
        {"kv-bits", 0, OPT_INT, &kv_bits, "B",
         "with --compressed: latent storage 16, 8, 4, 3 or 2 bits (default: the manifest's);\n"
         "below 16, per-token asymmetric quantization with fp16 scale and zero point"},
        {"hadamard", 0, OPT_FLAG, &hadamard, NULL,
         "with --compressed: fuse a Walsh-Hadamard rotation into the factors before running\n"
         "(as decompose --hadamard; no-op when the directory already has one)"},
        {"seq-len", 0, OPT_INT, &seq_len, "N", "window length in tokens (default 256)"},
        {"max-windows", 0, OPT_INT, &max_windows, "W", "evaluate only the first W windows"},
        {"threads", 0, OPT_INT, &threads, "N", "threads for BLAS and OpenMP (default: all cores)"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON object on stdout"},
        {"quiet", 'q', OPT_FLAG, &quiet, NULL, "no progress on stderr"},
    };
    const struct cli_cmd cmd = {
        "verify", "--model PATH --text FILE [--compressed DIR] [options]",
        "Report the perplexity of a model on held-out text.",
        "protocol (windows): the text is one document with BOS once at its start; its tokens\n"
        "are cut into non-overlapping windows of --seq-len (the remainder is dropped); each\n"
        "window runs on its own and positions 1..seq-len-1 are scored; ppl = exp(mean nll).\n"
        "\nwith --compressed the base model and the compressed one run the same windows; the\n"
        "compressed cache stores only latents: keys rebuilt from them before RoPE (palu,\n"
        "eigen, svd, lorc), or scored as rotated post-RoPE q·k (fdc, zack); values stay\n"
        "latent and go through the fused output projection. KV bytes per token count fp16\n"
        "for the base and, for latents, their codes plus scale and zero point.\n"
        "\nexamples:\n"
        "  kvcal verify --model stories260K.bin --tokenizer tok512.bin --text val1k.txt\n"
        "  kvcal verify --model tinystories-656K --compressed out-656K --text wiki.test.raw\n"
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
    if (kv_bits && !comp) return cli_usage_error(&cmd, "--kv-bits needs --compressed");
    if (hadamard && !comp) return cli_usage_error(&cmd, "--hadamard needs --compressed");
    if (kv_bits && kv_bits != 16 && kv_bits != 8 && kv_bits != 4 && kv_bits != 3 && kv_bits != 2)
        return cli_usage_error(&cmd, "--kv-bits %lld is not one of 16, 8, 4, 3, 2", (long long)kv_bits);
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
    if (comp) {
        rc = verify_compressed(model, src, text, comp, m, ids, n, n_bytes, seq_len, max_windows,
                               kv_bits, hadamard, json, quiet);
        free(ids);
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
