/* kvcal tokenize: the ids and pieces kvcal gives a string or a file, to
 * compare with another tokenizer. Files stream through kv_tok_stream, the
 * path collect and verify take. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

struct tok_args {
    const char *model, *tokenizer, *text;
    int json, ids_only, no_bos, eos;
};

/* A piece as printable UTF-8 in buf (4n + 1 bytes): valid characters as
 * they are, control bytes and bytes that are not UTF-8 (a byte-level piece
 * may hold part of a character) as the text "\xHH", '\' doubled. */
static size_t piece_text(const char *p, size_t n, char *buf) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)p[i];
        size_t k = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3
                 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        int ok = k > 0 && i + k <= n && c >= 0x20 && c != 0x7f && c != '\\';
        for (size_t j = 1; ok && j < k; j++) ok = ((unsigned char)p[i + j] & 0xc0) == 0x80;
        if (ok && k >= 3) {
            unsigned c1 = (unsigned char)p[i + 1];
            ok = !(c == 0xe0 && c1 < 0xa0) && !(c == 0xed && c1 > 0x9f) &&
                 !(c == 0xf0 && c1 < 0x90) && !(c == 0xf4 && c1 > 0x8f);
        }
        if (ok) {
            memcpy(buf + o, p + i, k);
            o += k;
            i += k;
        } else if (c == '\\') {
            memcpy(buf + o, "\\\\", 2);
            o += 2;
            i++;
        } else {
            o += (size_t)snprintf(buf + o, 5, "\\x%02x", c);
            i++;
        }
    }
    buf[o] = 0;
    return o;
}

static int read_all(const char *path, char **text, size_t *len) {
    struct kv_err err;
    kv_err_clear(&err);
    if (kv_text_read(path, text, len, &err)) return cli_report(&err);
    return 0;
}

int cmd_tokenize(int argc, char **argv) {
    static struct tok_args A;
    struct tok_args *a = &A;
    const struct cli_opt opts[] = {
        {"model", 'm', OPT_STR, &A.model, "PATH", "model whose tokenizer to use"},
        {"tokenizer", 0, OPT_STR, &A.tokenizer, "FILE",
         "tokenizer file alone (tokenizer.json, tokenizer.bin or .gguf); with --model,\n"
         "it overrides the model's"},
        {"text", 't', OPT_STR, &A.text, "FILE", "tokenize a file (.txt, .gz, .jsonl) instead of TEXT"},
        CLI_OPT_PARSE_SPECIAL,
        {"no-bos", 0, OPT_FLAG, &A.no_bos, NULL, "leave out BOS even where the tokenizer adds it"},
        {"ids", 0, OPT_FLAG, &A.ids_only, NULL, "print only the ids, one line, space-separated"},
        {"json", 0, OPT_FLAG, &A.json, NULL,
         "print {\"ids\", \"pieces\", \"tokens\", \"bos\", \"eos\", \"special_strings\",\n"
         "\"roundtrip\"} on stdout"},
    };
    const struct cli_cmd cmd = {
        "tokenize", "(--tokenizer FILE | --model PATH) (TEXT | --text FILE) [options]",
        "The token ids kvcal gives a text, with each id's piece, so they can be compared\n"
        "with another tokenizer. BOS and EOS follow the tokenizer's own policy (the text\n"
        "report says which); special-token strings in the text are ordinary text unless\n"
        "--parse-special. The text is encoded in the streamed chunks collect and verify\n"
        "use (a file is read as they read it). The summary line says whether decoding\n"
        "the ids gives the text back. Pieces print as UTF-8, other bytes as \\xHH.",
        "examples:\n"
        "  kvcal tokenize --tokenizer tokenizer.json \"Hello world\"\n"
        "  kvcal tokenize -m data/kjv-llama --text data/kjv/gospels.txt --ids > ids.txt\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 1};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!a->model && !a->tokenizer) return cli_usage_error(&cmd, "give --tokenizer FILE or --model PATH");
    if (!a->text && n_pos == 0) return cli_usage_error(&cmd, "give TEXT or --text FILE");
    if (a->text && n_pos) return cli_usage_error(&cmd, "give TEXT or --text FILE, not both");
    if (a->json && a->ids_only) return cli_usage_error(&cmd, "--json and --ids exclude each other");

    struct kv_err err;
    kv_err_clear(&err);
    struct kv_model *m = NULL;
    struct kv_tokenizer *own = NULL;
    const struct kv_tokenizer *tok;
    if (a->model) {
        if ((rc = cli_load_model(a->model, a->tokenizer, &m))) return rc;
        tok = kv_model_tokenizer(m);
        if (!tok) {
            kv_model_close(m);
            fprintf(stderr, "kvcal: the model has no tokenizer: pass --tokenizer FILE\n");
            return EXIT_ERR;
        }
    } else {
        if (kv_tok_open(a->tokenizer, &own, &err)) return cli_report(&err);
        tok = own;
    }
    int flags = cli_tok_flags(tok);
    if (a->no_bos) flags &= ~KV_TOK_ADD_BOS;

    char *text = NULL;
    size_t len = 0;
    if (a->text) {
        if ((rc = read_all(a->text, &text, &len))) goto out;
    } else {
        len = strlen(pos[0]);
        text = malloc(len + 1);
        if (!text) {
            fprintf(stderr, "kvcal: out of memory\n");
            rc = EXIT_ERR;
            goto out;
        }
        memcpy(text, pos[0], len + 1);
    }
    struct kv_tok_stream *ts = NULL;
    const int32_t *part;
    int64_t n_part = 0, n = 0;
    int32_t *ids = NULL;
    if (!kv_tok_stream_new(tok, flags, 0, &ts, &err) &&
        !kv_tok_stream_feed(ts, text, len, 1, &part, &n_part, &err) &&
        (ids = malloc((size_t)(n_part ? n_part : 1) * sizeof *ids))) {
        if (n_part) memcpy(ids, part, (size_t)n_part * sizeof *ids);
        n = n_part;
    }
    int64_t specials = ts ? kv_tok_stream_specials(ts) : 0;
    kv_tok_stream_free(ts);
    if (err.code) {
        if (!err.path[0] && a->text) snprintf(err.path, sizeof err.path, "%s", a->text);
        rc = cli_report(&err);
        goto done;
    }
    if (!ids) {
        fprintf(stderr, "kvcal: out of memory\n");
        rc = EXIT_ERR;
        goto done;
    }

    /* Decode back; the text's own bytes are the reference. */
    size_t dcap = len + 64, dn = 0;
    char *dec = malloc(dcap);
    int round = dec != NULL;
    for (int64_t i = 0; round && i < n; i++) {
        size_t k = kv_tok_decode(tok, i ? ids[i - 1] : -1, ids[i], NULL, 0);
        if (dn + k > dcap) {
            round = 0;
            break;
        }
        kv_tok_decode(tok, i ? ids[i - 1] : -1, ids[i], dec + dn, k);
        dn += k;
    }
    round = round && dn == len && memcmp(dec, text, len) == 0;
    free(dec);

    if (a->json) {
        json_t *o = json_object(), *ji = json_array(), *jp = json_array();
        for (int64_t i = 0; o && ji && jp && i < n; i++) {
            size_t pl;
            const char *p = kv_tok_piece(tok, ids[i], &pl);
            json_array_append_new(ji, json_integer(ids[i]));
            char *buf = malloc(4 * pl + 1);
            json_array_append_new(jp, buf ? json_stringn(buf, piece_text(p ? p : "", p ? pl : 0, buf))
                                          : NULL);
            free(buf);
        }
        if (o) {
            json_object_set_new(o, "tokens", json_integer(n));
            json_object_set_new(o, "bos", json_boolean(flags & KV_TOK_ADD_BOS));
            json_object_set_new(o, "eos", json_boolean(flags & KV_TOK_ADD_EOS));
            json_object_set_new(o, "special_tokens", json_string(cli_special_mode()));
            json_object_set_new(o, "special_strings", json_integer(specials));
            json_object_set_new(o, "roundtrip", json_boolean(round));
            json_object_set_new(o, "ids", ji);
            json_object_set_new(o, "pieces", jp);
        }
        rc = cli_print_json(o, JSON_INDENT(1));
    } else if (a->ids_only) {
        for (int64_t i = 0; i < n; i++) printf("%s%d", i ? " " : "", ids[i]);
        printf("\n");
        rc = EXIT_OK;
    } else {
        for (int64_t i = 0; i < n; i++) {
            size_t pl;
            const char *p = kv_tok_piece(tok, ids[i], &pl);
            char *buf = malloc(4 * pl + 1);
            if (buf) piece_text(p ? p : "", p ? pl : 0, buf);
            printf("%8d  %s\n", ids[i], buf ? buf : "?");
            free(buf);
        }
        printf("%lld tokens from %zu bytes (%s%s), special-token strings %s", (long long)n, len,
               flags & KV_TOK_ADD_BOS ? "with BOS" : "without BOS",
               flags & KV_TOK_ADD_EOS ? " and EOS" : "",
               cli_parse_special ? "parsed" : "read as text");
        if (!cli_parse_special && specials) printf(" (%lld)", (long long)specials);
        printf("; decoding %s the text\n", round ? "gives back" : "does not give back");
        rc = EXIT_OK;
    }
done:
    free(ids);
out:
    free(text);
    kv_tok_free(own);
    kv_model_close(m);
    return rc;
}
