/* Format detection: one entry point from a path to a struct kv_model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "ggufmodel.h"
#include "hfdir.h"
#include "limits.h"
#include "llama2c.h"
#include "mapfile.h"
#include "model.h"
#include "tokenizer.h"
#include "tokjson.h"

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* 1 if the file is named .gguf or starts with the GGUF magic (a .gguf with a
 * bad magic must reach the GGUF parser to be told so). */
static int is_gguf(const char *path) {
    if (ends_with(path, ".gguf")) return 1;
    char mg[4] = {0};
    return kv_read_head(path, mg, 4) == 4 && memcmp(mg, "GGUF", 4) == 0;
}

/* kv_tok_open, a llama2.c tokenizer.bin of fewer than n_vocab records (n_vocab
 * > 0, a model's vocabulary) refused as truncated: a file cut at a record
 * boundary is not a smaller tokenizer. */
static int tok_open_n(const char *path, int32_t n_vocab, struct kv_tokenizer **out, struct kv_err *err) {
    int kind = kv_path_kind(path);
    if (kind < 0) return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "no such file");
    if (kind == 1) {
        char *p = kv_path_join(path, "tokenizer.json");
        if (!p) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        int rc = kv_hf_load_tokenizer(p, out, err);
        free(p);
        return rc;
    }
    if (ends_with(path, ".json")) return kv_hf_load_tokenizer(path, out, err);
    if (is_gguf(path)) return kv_gguf_load_tokenizer(path, out, err);
    int rc = kv_l2c_load_tokenizer(path, -1, out, err);
    if (rc || n_vocab <= 0 || kv_tok_n_vocab(*out) >= n_vocab) return rc; /* more: kv_model_open says so */
    kv_tok_free(*out); /* fewer records than the vocabulary: read again to name where the file ends */
    *out = NULL;
    return kv_l2c_load_tokenizer(path, n_vocab, out, err);
}

int kv_tok_open(const char *path, struct kv_tokenizer **out, struct kv_err *err) {
    return tok_open_n(path, -1, out, err);
}

int kv_model_open(const char *path, const char *tokenizer_path, struct kv_model **out,
                  struct kv_err *err) {
    int kind = kv_path_kind(path);
    if (kind < 0) return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "no such file or directory");
    struct kv_model *m = NULL;
    int rc;
    if (kind == 1)
        rc = kv_hf_load(path, &m, err);
    else if (is_gguf(path) && kv_stats_probe(path))
        rc = kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                     "a kvcal statistics file, not a model (see 'kvcal inspect' for its contents)");
    else if (is_gguf(path))
        rc = kv_gguf_load(path, &m, err);
    else if (ends_with(path, ".safetensors") || ends_with(path, "config.json"))
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "pass the model directory (with config.json), not one of its files");
    else
        rc = kv_l2c_load(path, &m, err);
    if (rc) return rc;
    if (tokenizer_path) {
        struct kv_tokenizer *tok;
        int32_t want = m->cfg.vocab_size <= KV_MAX_VOCAB ? (int32_t)m->cfg.vocab_size : -1;
        rc = tok_open_n(tokenizer_path, want, &tok, err);
        if (rc) {
            kv_model_close(m);
            return rc;
        }
        if (kv_tok_n_vocab(tok) > m->cfg.vocab_size) {
            int nv = kv_tok_n_vocab(tok);
            long long mv = (long long)m->cfg.vocab_size;
            kv_tok_free(tok);
            kv_model_close(m);
            return kv_fail(err, KV_EINVAL, tokenizer_path, KV_NO_OFFSET,
                           "tokenizer has %d pieces but the model '%s' has a vocabulary of %lld",
                           nv, path, mv);
        }
        kv_tok_free(m->tok);
        m->tok = tok;
    }
    *out = m;
    return KV_OK;
}
