/* kvcal export --dense: a compressed model back as an ordinary model in the
 * source's own format, with K/V weights W' = up·down. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

/* Layers whose side is compressed (replaced by a product). */
static int64_t n_compressed(const struct kv_lowrank *lr, int v) {
    int64_t n = 0;
    for (int64_t l = 0; l < kv_lr_info(lr).n_layers; l++) n += kv_lr_mode_of(lr, l, v) != KV_LR_FULL;
    return n;
}

int cmd_export(int argc, char **argv) {
    const char *dense = NULL, *model = NULL, *tokenizer = NULL, *out = NULL;
    int json = 0;
    const struct cli_opt opts[] = {
        {"dense", 0, OPT_STR, &dense, "DIR", "the compressed model: an output of 'kvcal decompose'"},
        {"model", 'm', OPT_STR, &model, "PATH",
         "the base model DIR was made from: HF directory, .gguf or llama2.c .bin"},
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE",
         "override the base model's tokenizer (only for loading; nothing is copied)"},
        {"output", 'o', OPT_STR, &out, "OUT",
         "where to write: a directory for an HF source, else one file"},
        CLI_OPT_JSON(&json),
    };
    const struct cli_cmd cmd = {
        "export", "--dense DIR --model PATH -o OUT [options]",
        "Write a compressed model as an ordinary dense model in the base model's format.",
        "what it is for: a quality proxy. Each compressed layer's K and V projections become\n"
        "the products W' = up·down of its factors (biases up·down_bias), so any engine\n"
        "(transformers, llama.cpp, vLLM, llama2.c) loads OUT and computes the keys and\n"
        "values the compressed model caches, to measure its quality with the usual tools.\n"
        "It saves no memory: the KV cache and the weights keep their original sizes.\n"
        "\nthe output is the base model copied byte for byte, only the K/V tensors (and\n"
        "their biases) overwritten in place in their stored dtype (F32, F16 or BF16):\n"
        "an HF directory gives a directory with a copy of each of its files, a .gguf or\n"
        "a .bin gives one file of the same size. Values fused into o_proj are exported\n"
        "with the original o_proj and W_v' = up·down, which computes the same output.\n"
        "Latent quantization (--kv-bits below 16) is not reproduced.\n"
        "\nkeys of the fdc and zack methods (mode postrope_rotation) cannot be exported:\n"
        "their projection acts after RoPE, which no k_proj weight can express. Such a\n"
        "model is refused before anything is written. Centred factors (decompose\n"
        "--center) export their mean into the K/V biases: a base model without k/v\n"
        "bias tensors is refused likewise.\n"
        "\nOUT is written atomically (through OUT.tmp-<pid>-<n>, or OUT.tmp-<pid>/ for a\n"
        "directory). An existing file or empty directory is replaced; the base model\n"
        "itself and a non-empty directory are refused.\n"
        "\nexamples:\n"
        "  kvcal export --dense out-656K --model tinystories-656K -o 656K-dense\n"
        "  kvcal export --dense out-260K --model stories260K.bin -o 260K-dense.bin\n"
        "  kvcal verify --model 260K-dense.bin --tokenizer tok512.bin --text val1k.txt\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!dense) return cli_usage_error(&cmd, "missing --dense DIR");
    if (!model) return cli_usage_error(&cmd, "missing --model");
    if (!out) return cli_usage_error(&cmd, "missing --output");

    struct kv_model *m;
    if ((rc = cli_load_model(model, tokenizer, &m))) return rc;
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_lowrank *lr = NULL;
    if (kv_lr_dir_open(dense, m, &lr, &err)) {
        kv_model_close(m);
        return cli_report(&err);
    }
    double t0 = kv_now();
    struct kv_export_report rep;
    rc = kv_lr_export_dense(m, model, lr, out, &rep, &err);
    double secs = kv_now() - t0;
    if (rc) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", dense);
        kv_lr_free(lr);
        kv_model_close(m);
        rc = cli_report(&err);
        /* the library's refusal of centred factors (formats/export.c) */
        if (err.code == KV_EUNSUPPORTED && strstr(err.msg, "the factors are centred"))
            fprintf(stderr, "kvcal: hint: decompose without --center to export a model that has "
                            "no k/v biases\n");
        return rc;
    }
    int64_t nk = n_compressed(lr, 0), nv = n_compressed(lr, 1), L = kv_lr_info(lr).n_layers;
    const char *fmt = kv_format_name(kv_model_format(m));
    if (json) {
        json_t *o = json_pack("{s:o, s:o, s:o, s:s, s:I, s:I, s:I, s:o}", "output",
                              cli_json_text(out), "dense", cli_json_text(dense), "model",
                              cli_json_text(model), "format", fmt, "n_layers", (json_int_t)L,
                              "k_layers_replaced", (json_int_t)nk, "v_layers_replaced",
                              (json_int_t)nv, "seconds", cli_json_real(secs));
        if (o) {
            json_object_set_new(o, "retyped_f16", json_integer(rep.retyped));
            json_object_set_new(o, "retyped_from", rep.retyped ? json_string(rep.from) : json_null());
        }
        rc = cli_print_json(o, JSON_INDENT(2));
    } else {
        if (rep.retyped)
            printf("wrote     %s (%s; %s with its %lld replaced %s K/V tensors written as F16)\n", out,
                   fmt, model, (long long)rep.retyped, rep.from);
        else
            printf("wrote     %s (%s, the layout and size of %s)\n", out, fmt, model);
        printf("replaced  k in %lld of %lld layers, v in %lld of %lld, by up·down of %s\n",
               (long long)nk, (long long)L, (long long)nv, (long long)L, dense);
        printf("note      a quality proxy: the compressed model's keys and values, no memory "
               "saving\n");
        rc = EXIT_OK;
    }
    kv_lr_free(lr);
    kv_model_close(m);
    return rc;
}
