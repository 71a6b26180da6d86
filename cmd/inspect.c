/* kvcal inspect: what a model file or directory holds. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

static void shape_str(const struct kv_tensor *t, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static void rank_text(int64_t a, int64_t b, char *buf, size_t cap) {
    if (a < 0)
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%lld/%lld", (long long)a, (long long)b);
}

static int inspect_stats(const char *path, const char *model, const char *tokenizer, int json) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_stats *s;
    if (kv_stats_open(path, &s, &err)) return cli_report(&err);
    struct kv_model *m = NULL;
    int rc;
    if (model) {
        if ((rc = cli_load_model(model, tokenizer, &m))) {
            kv_stats_free(s);
            return rc;
        }
        if (!kv_stats_matches_model(s, m, path, &err)) {
            kv_stats_free(s);
            kv_model_free(m);
            return cli_report(&err);
        }
    }
    int64_t g = s->n_kv_heads;
    struct kv_head_spectrum *heads = calloc((size_t)g, sizeof *heads);
    json_t *layers = json ? json_array() : NULL;
    if (!json) {
        printf("stats      %s (kvcal.stats, written by kvcal %s)\n", path, s->version);
        printf("model      fingerprint %s\n           dim %lld, %lld layers, %lld heads (%lld kv), "
               "head_dim %lld\n", s->fingerprint, (long long)s->dim, (long long)s->n_layers,
               (long long)s->n_heads, (long long)s->n_kv_heads, (long long)s->head_dim);
        printf("tokens     %lld in %lld windows of %lld (%s", (long long)s->tokens,
               (long long)s->windows, (long long)s->seq_len, s->sampling);
        if (!strcmp(s->sampling, "random")) printf(", seed %llu", (unsigned long long)s->seed);
        if (s->shard_count > 1) printf(", shard %lld/%lld", (long long)s->shard_index, (long long)s->shard_count);
        printf(")\n");
        if (s->next_window < s->plan_windows)
            printf("checkpoint %lld of %lld planned windows done; finish with 'kvcal collect --resume'\n",
                   (long long)s->next_window, (long long)s->plan_windows);
        for (int64_t i = 0; i < s->n_inputs; i++)
            printf("input      %s: %llu bytes, sha256 %.16s…, %lld tokens, %lld windows\n",
                   s->inputs[i].path, (unsigned long long)s->inputs[i].bytes, s->inputs[i].sha256,
                   (long long)s->inputs[i].tokens, (long long)s->inputs[i].windows);
        printf("\neffective rank = fewest eigen-directions keeping 90%%/99%% of the energy\n");
        printf("%-6s %12s %12s %14s   per kv head 0..%lld: K|V|K post-rope, of %lld\n", "layer",
               "trace(XtX)", "cond(XtX)", "XtX rank", (long long)(g - 1), (long long)s->head_dim);
    }
    rc = EXIT_OK;
    for (int64_t l = 0; l < s->n_layers && heads; l++) {
        struct kv_layer_spectrum sp = {.heads = heads};
        if (kv_stats_layer_spectrum(s, m, l, &sp, &err)) {
            snprintf(err.path, sizeof err.path, "%s", path);
            rc = cli_report(&err);
            break;
        }
        if (json) {
            json_t *hs = json_array();
            for (int64_t j = 0; j < g; j++) {
                json_t *h = json_pack("{s:I, s:[I,I]}", "kv_head", (json_int_t)j,
                                      "k_rope_rank", (json_int_t)heads[j].krope90,
                                      (json_int_t)heads[j].krope99);
                if (h && m) {
                    json_object_set_new(h, "k_rank", json_pack("[I,I]", (json_int_t)heads[j].k90, (json_int_t)heads[j].k99));
                    json_object_set_new(h, "v_rank", json_pack("[I,I]", (json_int_t)heads[j].v90, (json_int_t)heads[j].v99));
                }
                json_array_append_new(hs, h);
            }
            json_array_append_new(layers, json_pack("{s:I, s:o, s:o, s:o, s:o, s:[I,I], s:o}",
                                                    "layer", (json_int_t)l, "trace",
                                                    cli_json_real(sp.trace), "lambda_max",
                                                    cli_json_real(sp.lambda_max), "lambda_min",
                                                    cli_json_real(sp.lambda_min), "cond",
                                                    cli_json_real(sp.cond), "xtx_rank",
                                                    (json_int_t)sp.x90, (json_int_t)sp.x99,
                                                    "heads", hs));
        } else {
            char xr[32], cond[32];
            snprintf(xr, sizeof xr, "%lld/%lld of %lld", (long long)sp.x90, (long long)sp.x99,
                     (long long)s->dim);
            if (isfinite(sp.cond))
                snprintf(cond, sizeof cond, "%.3e", sp.cond);
            else
                snprintf(cond, sizeof cond, "inf");
            printf("%-6lld %12.4e %12s %14s  ", (long long)l, sp.trace, cond, xr);
            for (int64_t j = 0; j < g; j++) {
                char a[24], b[24], c[24];
                rank_text(heads[j].k90, heads[j].k99, a, sizeof a);
                rank_text(heads[j].v90, heads[j].v99, b, sizeof b);
                rank_text(heads[j].krope90, heads[j].krope99, c, sizeof c);
                printf(" %s|%s|%s", a, b, c);
            }
            printf("\n");
        }
    }
    if (!heads) rc = cli_report(&(struct kv_err){.code = KV_ENOMEM, .off = KV_NO_OFFSET, .msg = "out of memory"});
    if (json && rc == EXIT_OK) {
        json_t *ins = cli_json_stats_inputs(s);
        json_t *o = json_pack("{s:o, s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:s, s:I, s:I, s:o, s:o}",
                              "path", cli_json_text(path), "type", "kvcal.stats", "version", s->version,
                              "fingerprint", s->fingerprint, "n_layers", (json_int_t)s->n_layers,
                              "dim", (json_int_t)s->dim, "n_heads", (json_int_t)s->n_heads,
                              "n_kv_heads", (json_int_t)s->n_kv_heads, "head_dim",
                              (json_int_t)s->head_dim, "seq_len", (json_int_t)s->seq_len, "tokens",
                              (json_int_t)s->tokens, "windows", (json_int_t)s->windows, "sampling",
                              s->sampling, "plan_windows", (json_int_t)s->plan_windows,
                              "next_window", (json_int_t)s->next_window, "inputs", ins, "layers", layers);
        layers = NULL;
        rc = cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    } else if (!json && rc == EXIT_OK && !m) {
        printf("\n(K and V output ranks need the model: add --model PATH)\n");
    }
    json_decref(layers);
    free(heads);
    kv_stats_free(s);
    kv_model_free(m);
    return rc;
}

int cmd_inspect(int argc, char **argv) {
    const char *tokenizer = NULL, *model = NULL;
    int json = 0;
    const struct cli_opt opts[] = {
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE", "tokenizer to load alongside the model"},
        {"model", 'm', OPT_STR, &model, "PATH",
         "for a .kvstats file: the model it was collected on, to show K/V output spectra"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON object on stdout"},
    };
    const struct cli_cmd cmd = {
        "inspect", "PATH [--json]  |  STATS.kvstats [--model PATH] [--json]",
        "Print the config, tokenizer and tensor table of a model: an HF Llama directory, a\n"
        "GGUF file or a llama2.c .bin. Loading runs every check the other commands run, so\n"
        "a file that inspects cleanly will load.\n"
        "\n"
        "Given a statistics file from 'kvcal collect', print its tokens, windows and inputs\n"
        "and, per layer, the trace and condition number of XᵀX and the effective rank (the\n"
        "fewest eigen-directions keeping 90% / 99% of the energy) of each KV head's\n"
        "post-RoPE key covariance and, with --model, of its K and V output covariances\n"
        "W C_x Wᵀ. Low ranks mean a head compresses well; look here before choosing --eps.",
        "examples:\n"
        "  kvcal inspect stories260K.gguf\n"
        "  kvcal inspect tinystories-656K --json\n"
        "  kvcal inspect 656K.kvstats --model tinystories-656K\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 1};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (n_pos != 1) return cli_usage_error(&cmd, "missing PATH");
    if (kv_stats_probe(pos[0])) return inspect_stats(pos[0], model, tokenizer, json);
    if (model) return cli_usage_error(&cmd, "--model applies to a .kvstats file, and '%s' is not one", pos[0]);
    struct kv_model *m;
    if ((rc = cli_load_model(pos[0], tokenizer, &m))) return rc;
    const struct kv_config *c = kv_model_config(m);
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    int64_t nt = kv_model_n_tensors(m);
    if (json) {
        json_t *ts = json_array();
        for (int64_t i = 0; i < nt; i++) {
            const struct kv_tensor *t = kv_model_tensor(m, i);
            json_t *sh = json_array();
            for (int k = 0; k < t->ndim; k++) json_array_append_new(sh, json_integer(t->shape[k]));
            json_array_append_new(ts, json_pack("{s:o, s:s, s:o, s:I, s:I, s:i}", "name", cli_json_text(t->name),
                                                "dtype", kv_dtype_name(t->dtype), "shape", sh,
                                                "offset", (json_int_t)t->offset, "bytes",
                                                (json_int_t)t->nbytes, "file", t->file));
        }
        json_t *cfg = json_pack(
            "{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o, s:o, s:s, s:b, s:b, s:i, s:i}",
            "arch", "llama", "dim", (json_int_t)c->dim, "hidden_dim", (json_int_t)c->hidden_dim,
            "n_layers", (json_int_t)c->n_layers, "n_heads", (json_int_t)c->n_heads, "n_kv_heads",
            (json_int_t)c->n_kv_heads, "head_dim", (json_int_t)c->head_dim, "vocab_size",
            (json_int_t)c->vocab_size, "max_seq_len", (json_int_t)c->max_seq_len, "norm_eps",
            cli_json_real(c->norm_eps), "rope_theta", cli_json_real(c->rope_theta), "rope_layout",
            c->rope_layout == KV_ROPE_INTERLEAVED ? "interleaved" : "rotate-half",
            "tied_embeddings", c->tied_embeddings, "qkv_bias", c->has_qkv_bias, "bos_id",
            c->bos_id, "eos_id", c->eos_id);
        json_t *o = json_pack("{s:o, s:s, s:o, s:I, s:o}", "path", cli_json_text(pos[0]), "format",
                              kv_format_name(kv_model_format(m)), "config", cfg, "params",
                              (json_int_t)kv_model_n_params(m), "tensors", ts);
        if (o)
            json_object_set_new(o, "tokenizer_vocab",
                                tok ? json_integer(kv_tok_n_vocab(tok)) : json_null());
        rc = cli_print_json(o, JSON_INDENT(2));
    } else {
        char desc[512], np[32];
        cli_describe_config(c, desc, sizeof desc);
        cli_human_count((double)kv_model_n_params(m), np, sizeof np);
        printf("model      %s\nformat     %s\nconfig     %s\n", pos[0],
               kv_format_name(kv_model_format(m)), desc);
        printf("           norm eps %g, trained context %lld, bos %d, eos %d, qkv bias %s\n",
               (double)c->norm_eps, (long long)c->max_seq_len, c->bos_id, c->eos_id,
               c->has_qkv_bias ? "yes" : "no");
        printf("params     %s\n", np);
        printf("kv cache   %lld bytes/token at f16 (%lld layers x 2 x %lld kv heads x %lld)\n",
               (long long)(c->n_layers * 2 * c->n_kv_heads * c->head_dim * 2),
               (long long)c->n_layers, (long long)c->n_kv_heads, (long long)c->head_dim);
        if (tok)
            printf("tokenizer  %d pieces, bos %d, eos %d\n", kv_tok_n_vocab(tok), kv_tok_bos(tok),
                   kv_tok_eos(tok));
        else
            printf("tokenizer  none (pass --tokenizer FILE)\n");
        printf("\n%-52s %-5s %-16s %12s %12s\n", "tensor", "dtype", "shape", "offset", "bytes");
        for (int64_t i = 0; i < nt; i++) {
            const struct kv_tensor *t = kv_model_tensor(m, i);
            char sh[64];
            shape_str(t, sh, sizeof sh);
            printf("%-52s %-5s %-16s %12llu %12llu\n", t->name, kv_dtype_name(t->dtype), sh,
                   (unsigned long long)t->offset, (unsigned long long)t->nbytes);
        }
    }
    kv_model_free(m);
    return rc; /* 0 unless the JSON could not be encoded */
}
