/* kvcal export --dense: a compressed model back as an ordinary model in the
 * source's own format, with K/V weights W' = up·down; --mla: a Llama-family
 * model rewritten as DeepSeek-V2 multi-head latent attention (GGUF
 * deepseek2, whose latent cache llama.cpp runs, or an HF
 * DeepseekV2ForCausalLM directory). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "commands.h"

/* Layers whose side is compressed (replaced by a product). */
static int64_t n_compressed(const struct kv_lowrank *lr, int v) {
    int64_t n = 0;
    for (int64_t l = 0; l < kv_lr_info(lr).n_layers; l++) n += kv_lr_mode_of(lr, l, v) != KV_LR_FULL;
    return n;
}

/* The MLA options of the command line. */
struct mla_args {
    const char *stats, *text;
    int64_t rank, rope_dim, rope_step, windows, seq_len;
    double ratio, latent_eps;
    int no_balance;
};

/* The tokenizer files an HF MLA directory gets: those of an HF model
 * directory, else a --tokenizer that is a tokenizer.json. */
static const char *const TOK_FILES[] = {"tokenizer.json", "tokenizer_config.json",
                                        "special_tokens_map.json", "tokenizer.model",
                                        "generation_config.json"};
#define N_TOK_FILES ((int)(sizeof TOK_FILES / sizeof TOK_FILES[0]))

static int tokenizer_files(const char *model, const char *tokenizer, char **files) {
    int n = 0;
    struct stat st;
    if (stat(model, &st) == 0 && S_ISDIR(st.st_mode)) {
        for (int i = 0; i < N_TOK_FILES; i++) {
            size_t len = strlen(model) + strlen(TOK_FILES[i]) + 2;
            char *p = malloc(len);
            if (p) snprintf(p, len, "%s/%s", model, TOK_FILES[i]);
            if (p && stat(p, &st) == 0 && S_ISREG(st.st_mode)) files[n++] = p;
            else free(p);
        }
    } else if (tokenizer) {
        const char *base = strrchr(tokenizer, '/');
        if (!strcmp(base ? base + 1 : tokenizer, "tokenizer.json") && (files[n] = strdup(tokenizer))) n++;
    }
    return n;
}

/* 1 when OUT names a GGUF file (it ends in .gguf), else an HF directory. */
static int gguf_output(const char *out) {
    size_t n = strlen(out);
    return n >= 5 && !strcmp(out + n - 5, ".gguf");
}

/* export --mla: the conversion, the file and a table of what each layer kept. */
static int export_mla(const struct cli_cmd *cmd, const char *model, const char *tokenizer,
                      const char *out, const struct mla_args *x, int json) {
    if (!x->stats) return cli_usage_error(cmd, "--mla needs --stats FILE (kvcal collect of the model)");
    if (!x->rank == !(x->ratio > 0))
        return cli_usage_error(cmd, "--mla needs exactly one of --kv-lora-rank N or --ratio X");
    if (x->ratio > 1) return cli_usage_error(cmd, "--ratio must be in (0, 1], got %g", x->ratio);
    int gguf = gguf_output(out), eps_given = !isnan(x->latent_eps);
    if (gguf && eps_given)
        return cli_usage_error(cmd, "--latent-norm-eps is for an HF directory: llama.cpp's deepseek2 "
                                    "normalizes the latent with the model's rms_norm_eps");
    if ((x->windows || x->seq_len) && !x->text)
        return cli_usage_error(cmd, "--windows and --seq-len go with --text");
    if (x->windows < 0 || (x->seq_len && x->seq_len < 2))
        return cli_usage_error(cmd, "--windows must be positive and --seq-len at least 2");
    if (eps_given && !(x->latent_eps > 0 && x->latent_eps < 1))
        return cli_usage_error(cmd, "--latent-norm-eps must be in (0, 1), got %g", x->latent_eps);
    struct kv_err oerr;
    kv_err_clear(&oerr);
    if (kv_output_check(model, out, !gguf, &oerr)) return cli_report(&oerr);
    struct kv_model *m;
    int rc = cli_load_model(model, tokenizer, &m);
    if (rc) return rc;
    const struct kv_config *c = kv_model_config(m);
    int64_t G = c->n_kv_heads, dh = c->head_dim, L = c->n_layers, base = 2 * G * dh;
    struct kv_mla_opts o = {x->rank, x->rope_dim ? x->rope_dim : dh, x->rope_step ? x->rope_step : 1,
                            !x->no_balance, eps_given ? x->latent_eps : 0, NULL, 0, 0};
    if (x->ratio > 0) { /* values a token and layer, as llama.cpp caches them: d_c + R */
        o.kv_lora_rank = (int64_t)floor(x->ratio * (double)base + 1e-9) - o.rope_dim;
        if (o.kv_lora_rank < 1) {
            kv_model_close(m);
            fprintf(stderr,
                    "kvcal: --ratio %g keeps %lld values a token and layer, and the rope key "
                    "alone takes %lld: lower --rope-dim\n",
                    x->ratio, (long long)floor(x->ratio * (double)base + 1e-9), (long long)o.rope_dim);
            return EXIT_ERR;
        }
    }
    int32_t *ids = NULL;
    if (x->text) { /* windows of the text from its start, as decompose --text takes them */
        int64_t n_ids = 0, T = x->seq_len ? x->seq_len : 256, W = x->windows ? x->windows : 8;
        size_t n_bytes = 0;
        if (c->max_seq_len > 0 && T > c->max_seq_len) T = c->max_seq_len;
        if ((rc = cli_load_tokens(m, x->text, NULL, &ids, &n_ids, &n_bytes))) {
            kv_model_close(m);
            return rc;
        }
        o.seq_len = T, o.calib_windows = n_ids / T < W ? n_ids / T : W, o.calib_tokens = ids;
        if (o.calib_windows < 1) {
            fprintf(stderr, "kvcal: %s: %lld tokens, fewer than one window of %lld\n", x->text,
                    (long long)n_ids, (long long)T);
            free(ids);
            kv_model_close(m);
            return EXIT_ERR;
        }
    }
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stats *s = NULL;
    struct kv_mla_layer_info *info = calloc((size_t)L, sizeof *info);
    if (!info) {
        free(ids);
        kv_model_close(m);
        fprintf(stderr, "kvcal: out of memory\n");
        return EXIT_ERR;
    }
    rc = kv_stats_open(x->stats, &s, &err) || kv_stats_check_complete(s, x->stats, &err) ||
                 !kv_stats_matches_model(s, m, x->stats, &err)
             ? cli_report(&err)
             : EXIT_OK;
    if (!rc && kv_mla_check(c, &o, &err)) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", model);
        rc = cli_report(&err);
    }
    char *files[N_TOK_FILES];
    int n_files = gguf ? 0 : tokenizer_files(model, tokenizer, files);
    double t0 = kv_now();
    if (!rc && gguf && kv_mla_export_gguf(m, s, &o, out, info, &err)) rc = cli_report(&err);
    if (!rc && !gguf &&
        kv_mla_export_hf(m, s, &o, out, (const char *const *)files, n_files, info, &err))
        rc = cli_report(&err);
    double secs = kv_now() - t0;
    /* the epsilon made for, as the shortest decimal of its float ("1e-05") */
    float leps_f = eps_given ? (float)x->latent_eps : c->norm_eps;
    char eb[32];
    for (int p = 1; p <= 9; p++) {
        snprintf(eb, sizeof eb, "%.*g", p, (double)leps_f);
        if (strtof(eb, NULL) == leps_f) break;
    }
    double leps = strtod(eb, NULL);
    json_t *copied = json_array();
    for (int i = 0; i < n_files; i++) {
        const char *b = strrchr(files[i], '/');
        json_array_append_new(copied, json_string(b ? b + 1 : files[i]));
        free(files[i]);
    }
    int64_t per = o.kv_lora_rank + o.rope_dim; /* values a token and layer */
    double theta = pow((double)c->rope_theta, (double)(o.rope_step * o.rope_dim) / (double)dh);
    if (!rc && json) {
        json_t *layers = json_array();
        for (int64_t l = 0; l < L; l++)
            json_array_append_new(layers, json_pack("{s:I, s:o, s:o, s:o, s:o}", "layer", (json_int_t)l,
                                                    "rope_share", cli_json_real(info[l].rope_share),
                                                    "latent_share", cli_json_real(info[l].latent_share),
                                                    "alpha", cli_json_real(info[l].alpha),
                                                    "mean_distance",
                                                    ids ? cli_json_real(info[l].mean_distance) : json_null()));
        rc = cli_print_json(
            json_pack("{s:o, s:o, s:o, s:o, s:I, s:I, s:s, s:s, s:o, s:o, s:I, s:I, s:I, s:o, s:b, s:I, s:I, s:o, s:o, s:o}",
                      "output", cli_json_text(out), "model", cli_json_text(model), "stats",
                      cli_json_text(x->stats), "text", ids ? cli_json_text(x->text) : json_null(),
                      "windows", (json_int_t)o.calib_windows, "seq_len", (json_int_t)o.seq_len,
                      "architecture", "deepseek2", "format",
                      gguf ? "gguf" : "hf", "latent_norm_eps", cli_json_real(leps), "copied",
                      copied, "kv_lora_rank",
                      (json_int_t)o.kv_lora_rank, "rope_dim", (json_int_t)o.rope_dim, "rope_step",
                      (json_int_t)o.rope_step, "rope_freq_base", cli_json_real(theta), "balance",
                      o.balance, "cache_values_per_token_layer", (json_int_t)per,
                      "base_values_per_token_layer", (json_int_t)base, "ratio",
                      cli_json_real((double)per / (double)base), "layers", layers, "seconds",
                      cli_json_real(secs)),
            JSON_INDENT(2));
    } else if (!rc) {
        printf("wrote     %s (%s: kv_lora_rank %lld, rope dims %lld, pairs 0..%lld "
               "step %lld, freq_base %.6g)\n",
               out, gguf ? "gguf deepseek2" : "hf DeepseekV2ForCausalLM", (long long)o.kv_lora_rank,
               (long long)o.rope_dim, (long long)((o.rope_dim / 2 - 1) * o.rope_step),
               (long long)o.rope_step, theta);
        if (!gguf) {
            printf("tokenizer ");
            for (size_t i = 0; i < json_array_size(copied); i++)
                printf("%s%s", i ? ", " : "", json_string_value(json_array_get(copied, i)));
            printf("%s\n", json_array_size(copied) ? " copied"
                                                   : "none copied (the model has no HF tokenizer "
                                                     "files; give --tokenizer tokenizer.json)");
        }
        printf("cache     %lld values a token and layer against %lld: %.4f of the base\n",
               (long long)per, (long long)base, (double)per / (double)base);
        if (ids)
            printf("turn      fitted on %s: %lld windows of %lld from its start\n", x->text,
                   (long long)o.calib_windows, (long long)o.seq_len);
        printf("\nlayer  rope keeps (key energy)  latent keeps (k+v energy)%s\n",
               ids ? "  mean attention distance" : "");
        for (int64_t l = 0; l < L; l++) {
            printf("%5lld  %22.4f  %25.6f", (long long)l, info[l].rope_share, info[l].latent_share);
            if (ids) printf("  %23.2f", info[l].mean_distance);
            printf("\n");
        }
        if (ids)
            printf("\nnote      the key energy outside the rope key is turned by a map fitted to the "
                   "scores on the calibration windows (docs/design.md)\n");
        else
            printf("\nnote      the key energy outside the rope key is scored without its rotation; "
                   "--text FILE fits a turn for it on calibration text, which costs less "
                   "(docs/design.md)\n");
        /* which engines normalize the latent with the epsilon it was made for */
        int for_config = leps_f == c->norm_eps, for_tf = leps_f == 1e-6f;
        if (!gguf && for_config && !for_tf)
            printf("note      the latent norm is made for epsilon %g (config.json's rms_norm_eps: "
                   "vLLM, SGLang, llama.cpp's converter); transformers normalizes kv_a_layernorm "
                   "with 1e-06 whatever the config says: export with --latent-norm-eps 1e-6 for it\n",
                   leps);
        else if (!gguf && for_tf && !for_config)
            printf("note      the latent norm is made for epsilon 1e-06 (transformers' "
                   "kv_a_layernorm); vLLM, SGLang and llama.cpp's converter normalize it with "
                   "config.json's rms_norm_eps %g and will not compute this model\n",
                   (double)c->norm_eps);
        else if (!gguf && !for_tf && !for_config)
            printf("note      the latent norm is made for epsilon %g, which no engine known here "
                   "uses (transformers 1e-06, vLLM and SGLang config.json's rms_norm_eps %g)\n",
                   leps, (double)c->norm_eps);
        if (!gguf)
            printf("note      run it in float32 or bfloat16: the latent's input is scaled below "
                   "float16's range\n");
    }
    if (rc || !json) json_decref(copied);
    free(info), free(ids);
    kv_stats_free(s);
    kv_model_close(m);
    return rc;
}

int cmd_export(int argc, char **argv) {
    const char *dense = NULL, *model = NULL, *tokenizer = NULL, *out = NULL;
    int json = 0, mla = 0;
    struct mla_args x = {0};
    x.latent_eps = NAN; /* not given */
    const struct cli_opt opts[] = {
        {"dense", 0, OPT_STR, &dense, "DIR", "the compressed model: an output of 'kvcal decompose'"},
        {"mla", 0, OPT_FLAG, &mla, NULL,
         "instead: the model as DeepSeek-V2 multi-head latent attention (llama and\n"
         "mistral models), from --stats and --kv-lora-rank or --ratio: GGUF deepseek2\n"
         "when OUT ends in .gguf, else an HF DeepseekV2ForCausalLM directory"},
        {"stats", 's', OPT_STR, &x.stats, "FILE", "with --mla: calibration statistics of the model"},
        {"kv-lora-rank", 0, OPT_INT, &x.rank, "N",
         "with --mla: latent values per token and layer (up to 2 * kv heads * head_dim)"},
        {"ratio", 0, OPT_DOUBLE, &x.ratio, "X",
         "with --mla: the cache llama.cpp keeps (latent + rope key) as a fraction of the\n"
         "base's keys and values; sets --kv-lora-rank"},
        {"rope-dim", 0, OPT_INT, &x.rope_dim, "R",
         "with --mla: dimensions of the shared rope key (even; default head_dim)"},
        {"rope-step", 0, OPT_INT, &x.rope_step, "S",
         "with --mla: keep the model's rope pairs 0, S, 2S, ... (default 1: the fastest)"},
        {"no-balance", 0, OPT_FLAG, &x.no_balance, NULL,
         "with --mla: do not weigh keys and values to equal energy in the latent"},
        {"text", 't', OPT_STR, &x.text, "FILE",
         "with --mla: calibration text; the key parts that lose RoPE are turned by a\n"
         "map fitted to the model's scores on its windows (recommended: costs less)"},
        CLI_OPT_PARSE_SPECIAL,
        {"windows", 0, OPT_INT, &x.windows, "W", "--text: windows measured, from its start (default 8)"},
        {"seq-len", 0, OPT_INT, &x.seq_len, "N", "--text: window length (default 256)"},
        {"latent-norm-eps", 0, OPT_DOUBLE, &x.latent_eps, "E",
         "with --mla to an HF directory: the epsilon the engine normalizes the latent\n"
         "with (default the model's rms_norm_eps: vLLM, SGLang; 1e-6 for transformers)"},
        {"model", 'm', OPT_STR, &model, "PATH",
         "the base model DIR was made from (with --mla: the model to rewrite): HF\n"
         "directory, .gguf or llama2.c .bin"},
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE",
         "override the base model's tokenizer (for loading; with --mla to an HF\n"
         "directory from a model file, a tokenizer.json given here is copied there)"},
        {"output", 'o', OPT_STR, &out, "OUT",
         "where to write: a directory for an HF source, else one file (--mla: a\n"
         ".gguf file, or any other name for an HF directory)"},
        CLI_OPT_JSON(&json),
    };
    const struct cli_cmd cmd = {
        "export", "--dense DIR --model PATH -o OUT [options] | --mla --model PATH --stats FILE -o OUT[.gguf]",
        "Write a compressed model as an ordinary dense model in the base model's format, or\n"
        "(--mla) a model as DeepSeek-V2 latent attention that llama.cpp, transformers and\n"
        "vLLM run.",
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
        "\n--mla instead rewrites a llama or mistral model (no attention biases, no rope\n"
        "scaling, no window) as DeepSeek-V2 multi-head latent attention in one GGUF file of\n"
        "architecture deepseek2, which llama.cpp runs with a cache of kv_lora_rank latent\n"
        "values plus one shared rope key of --rope-dim values per token and layer. For each\n"
        "rope pair the KV heads are mixed so that one component keeps its rotation in the\n"
        "shared key; the rest of the keys and all values go through the latent (the top\n"
        "directions of their calibration covariance, keys and values weighed to equal\n"
        "energy), scored without rotation. Exact with one KV head and a full-rank latent;\n"
        "with more, the rotation lost costs quality (docs/design.md, \"Export as Multi-head\n"
        "Latent Attention\", measures it); with --text, each pair's residual key is first\n"
        "turned by a 2x2 map fitted to the model's attention scores on the text's first\n"
        "--windows windows, which takes back much of that (kjv-llama at full size: +32.9%\n"
        "perplexity without, +11.6% with). The table printed says, per layer, the share of\n"
        "key energy that keeps its rotation and of key and value energy the latent keeps.\n"
        "kvcal verify --mla OUT.gguf runs it back against the model (its cache, PPL, KL).\n"
        "\nan OUT that does not end in .gguf is written as an HF directory of\n"
        "transformers' DeepseekV2ForCausalLM (config.json, model.safetensors, and the\n"
        "model's tokenizer files copied): the same weights, kv_b_proj holding each head's\n"
        "key rows then value rows, every layer dense. Engines disagree on one number:\n"
        "transformers normalizes the latent (kv_a_layernorm) with epsilon 1e-6 whatever\n"
        "config.json says, vLLM and SGLang with rms_norm_eps. The latent norm is made\n"
        "for one of them: the model's rms_norm_eps by default, --latent-norm-eps 1e-6\n"
        "for transformers (the same when the model's epsilon is 1e-6). Run it in float32\n"
        "or bfloat16. kvcal verify --mla DIR runs the directory back.\n"
        "\nexamples:\n"
        "  kvcal export --dense out-656K --model tinystories-656K -o 656K-dense\n"
        "  kvcal export --dense out-260K --model stories260K.bin -o 260K-dense.bin\n"
        "  kvcal verify --model 260K-dense.bin --tokenizer tok512.bin --text val1k.txt\n"
        "  kvcal export --mla -m data/kjv-llama -s kjv.kvstats --ratio 0.5 -t data/kjv/train.txt \\\n"
        "      -o kjv-mla.gguf\n"
        "  kvcal verify -m data/kjv-llama -t data/kjv/gospels.txt --mla kjv-mla.gguf\n"
        "  kvcal export --mla -m data/kjv-llama -s kjv.kvstats --ratio 0.5 --latent-norm-eps 1e-6 -o kjv-mla-hf\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (mla && dense) return cli_usage_error(&cmd, "give one of --dense DIR or --mla");
    if (!mla && (x.stats || x.rank || x.ratio > 0 || x.rope_dim || x.rope_step || x.no_balance ||
                 !isnan(x.latent_eps) || x.text || x.windows || x.seq_len || cli_parse_special))
        return cli_usage_error(&cmd, "--stats, --kv-lora-rank, --ratio, --rope-dim, --rope-step, "
                                     "--no-balance, --text, --parse-special and --latent-norm-eps go "
                                     "with --mla");
    if (mla && !model) return cli_usage_error(&cmd, "missing --model");
    if (mla && !out) return cli_usage_error(&cmd, "missing --output");
    if (mla) return export_mla(&cmd, model, tokenizer, out, &x, json);
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
