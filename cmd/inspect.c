/* kvcal inspect: what a model file or directory holds. */
#include <jansson.h>
#include <stdlib.h>

#include "cli.h"
#include "commands.h"

static void shape_str(const struct kv_tensor *t, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

int cmd_inspect(int argc, char **argv) {
    const char *tokenizer = NULL;
    int json = 0;
    const struct cli_opt opts[] = {
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE", "tokenizer to load alongside the model"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON object on stdout"},
    };
    const struct cli_cmd cmd = {
        "inspect", "PATH [--json]",
        "Print the config, tokenizer and tensor table of a model: an HF Llama directory, a\n"
        "GGUF file or a llama2.c .bin. Loading runs every check the other commands run, so\n"
        "a file that inspects cleanly will load.",
        "examples:\n"
        "  kvcal inspect stories260K.gguf\n"
        "  kvcal inspect tinystories-656K --json\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 1};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (n_pos != 1) return cli_usage_error(&cmd, "missing PATH");
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
