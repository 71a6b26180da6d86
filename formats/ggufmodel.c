/* The llama mapping of a GGUF container: its SentencePiece tokenizer, its
 * hyper-parameters and tensor names, and the model loader. Keys and names are
 * listed in ggufmodel.h. */
#include "ggufmodel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "err.h"
#include "limits.h"
#include "model.h"
#include "tokenizer.h"

/* ------------------------------------------------------------ tokenizer */

#define SPACE_PIECE "\xe2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK */

/* Optional special id: default when absent, -1 for the "none" value. */
static int special_id(const struct kv_gguf_file *f, const char *key, int32_t dflt,
                      uint64_t n_vocab, int32_t *out, struct kv_err *err) {
    const struct kv_gguf_kv *kv = kv_gguf_find(f, key);
    if (!kv) {
        *out = (uint64_t)dflt < n_vocab ? dflt : -1;
        return KV_OK;
    }
    uint32_t v;
    int rc = kv_gguf_get_u32(f, key, &v, err);
    if (rc) return rc;
    if (v == UINT32_MAX) {
        *out = -1;
        return KV_OK;
    }
    if (v >= n_vocab)
        return kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                       "key '%s' is %u, outside the vocabulary of %llu tokens", key, v,
                       (unsigned long long)n_vocab);
    *out = (int32_t)v;
    return KV_OK;
}

int kv_gguf_build_tokenizer(const struct kv_gguf_file *f, struct kv_tokenizer **out,
                            struct kv_err *err) {
    struct kv_gguf_str model;
    int rc = kv_gguf_get_str(f, "tokenizer.ggml.model", &model, err);
    if (rc) return rc;
    if (!kv_gguf_str_eq(model, "llama")) {
        char mb[128];
        return kv_fail(err, KV_EUNSUPPORTED, f->path, kv_gguf_find(f, "tokenizer.ggml.model")->val_off,
                       "tokenizer model '%s' is not supported; kvcal reads only 'llama' "
                       "(sentencepiece) vocabularies",
                       kv_gguf_excerpt(model.p, model.len, mb, sizeof mb));
    }
    struct kv_gguf_str *pieces = NULL;
    float *scores = NULL;
    int32_t *types = NULL;
    struct kv_tokenizer *tok = NULL;
    uint64_t n = 0, ns = 0, nt = 0;
    rc = kv_gguf_get_arr_str(f, "tokenizer.ggml.tokens", &pieces, &n, err);
    if (rc) goto done;
    const struct kv_gguf_kv *tkv = kv_gguf_find(f, "tokenizer.ggml.tokens");
    if (n < 1 || n > KV_MAX_VOCAB) {
        rc = kv_fail(err, KV_EFORMAT, f->path, tkv->val_off,
                     "key 'tokenizer.ggml.tokens' has %llu entries, expected 1..%d",
                     (unsigned long long)n, KV_MAX_VOCAB);
        goto done;
    }
    const char *opt[2] = {"tokenizer.ggml.scores", "tokenizer.ggml.token_type"};
    for (int k = 0; k < 2; k++) {
        const struct kv_gguf_kv *kv = kv_gguf_find(f, opt[k]);
        if (!kv) continue;
        uint64_t *cnt = k ? &nt : &ns;
        rc = k ? kv_gguf_get_arr_i32(f, opt[k], &types, cnt, err)
               : kv_gguf_get_arr_f32(f, opt[k], &scores, cnt, err);
        if (rc) goto done;
        if (*cnt != n) {
            rc = kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                         "key '%s' has %llu entries but 'tokenizer.ggml.tokens' has %llu", opt[k],
                         (unsigned long long)*cnt, (unsigned long long)n);
            goto done;
        }
    }
    int32_t bos, eos, unk;
    if ((rc = special_id(f, "tokenizer.ggml.bos_token_id", 1, n, &bos, err))) goto done;
    if ((rc = special_id(f, "tokenizer.ggml.eos_token_id", 2, n, &eos, err))) goto done;
    if ((rc = special_id(f, "tokenizer.ggml.unknown_token_id", 0, n, &unk, err))) goto done;
    int add_prefix = 1;
    if (kv_gguf_find(f, "tokenizer.ggml.add_space_prefix") &&
        (rc = kv_gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", &add_prefix, err)))
        goto done;

    if ((rc = kv_tok_init(KV_TOK_SCORE, (int32_t)n, &tok, err))) goto done;
    for (uint64_t i = 0; i < n; i++) {
        if (pieces[i].len > KV_MAX_PIECE) {
            rc = kv_fail(err, KV_EFORMAT, f->path, (uint64_t)((const uint8_t *)pieces[i].p - f->buf) - 8,
                         "token %llu of 'tokenizer.ggml.tokens' is %llu bytes, limit %d",
                         (unsigned long long)i, (unsigned long long)pieces[i].len, KV_MAX_PIECE);
            goto done;
        }
        float sc = scores ? scores[i] : 0.0f;
        if (!isfinite(sc)) {
            rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_elem_off(kv_gguf_find(f, opt[0]), i),
                         "score of token %llu is %g, expected a finite number",
                         (unsigned long long)i, (double)sc);
            goto done;
        }
        int ty = types ? types[i] : KV_TOKT_NORMAL;
        rc = kv_tok_set_piece(tok, (int32_t)i, pieces[i].p, (size_t)pieces[i].len, sc, ty, err);
        if (rc) goto done;
    }
    kv_tok_set_special(tok, bos, eos, unk);
    if ((rc = kv_tok_set_normalizer(tok, SPACE_PIECE, add_prefix, err))) goto done;
    if ((rc = kv_tok_finish(tok, f->path, err))) goto done;
    *out = tok;
    tok = NULL;
done:
    kv_tok_free(tok);
    free(pieces);
    free(scores);
    free(types);
    return rc;
}

int kv_gguf_load_tokenizer(const char *path, struct kv_tokenizer **out, struct kv_err *err) {
    struct kv_gguf_file *f;
    int rc = kv_gguf_open(path, &f, err);
    if (rc) return rc;
    rc = kv_gguf_build_tokenizer(f, out, err);
    kv_gguf_close(f);
    return rc;
}

/* ------------------------------------------------------------ model */

static void close_cb(void *p) { kv_gguf_close(p); }

/* Required or optional "llama.<suffix>" u32 hyper-parameter, as int64 in
 * 1..max. */
static int arch_dim(const struct kv_gguf_file *f, const char *suffix, int64_t max,
                    int64_t dflt, int64_t *out, struct kv_err *err) {
    char key[128];
    snprintf(key, sizeof key, "llama.%s", suffix);
    const struct kv_gguf_kv *kv = kv_gguf_find(f, key);
    if (!kv && dflt > 0) {
        *out = dflt;
        return KV_OK;
    }
    uint32_t v;
    int rc = kv_gguf_get_u32(f, key, &v, err);
    if (rc) return rc;
    if (v < 1 || v > max)
        return kv_fail(err, KV_EFORMAT, f->path, kv->val_off, "key '%s' is %u, expected 1..%lld",
                       key, v, (long long)max);
    *out = v;
    return KV_OK;
}

/* Map a GGUF tensor name of the names table nm (lib/arch.h: "token_embd.weight",
 * "blk.N.attn_q.weight", ...) to a weight kind and layer (-1 for a global);
 * 0 if unknown. */
static int name_kind(const struct kv_arch_names *nm, const char *name, enum kv_wkind *kind,
                     int64_t *layer) {
    *layer = -1;
    for (int64_t i = 0; i < nm->n_globals; i++)
        if (!strcmp(name, nm->globals[i].name)) return *kind = nm->globals[i].kinds[0], 1;
    size_t np = strlen(nm->layer_prefix);
    if (strncmp(name, nm->layer_prefix, np) != 0) return 0;
    const char *p = name + np;
    int64_t l = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 9) {
        l = l * 10 + (*p++ - '0');
        digits++;
    }
    if (!digits || *p != '.' || (digits > 1 && name[np] == '0')) return 0;
    p++;
    for (int64_t i = 0; i < nm->n_layer; i++)
        if (!strcmp(p, nm->layer[i].name)) {
            *kind = nm->layer[i].kinds[0];
            *layer = l;
            return 1;
        }
    return 0;
}

static int read_config(const struct kv_gguf_file *f, struct kv_config *cfg, struct kv_err *err) {
    struct kv_gguf_str s;
    char sb[128];
    int rc = kv_gguf_get_str(f, "general.architecture", &s, err);
    if (rc) return rc;
    if (!kv_gguf_str_eq(s, "llama"))
        return kv_fail(err, KV_EUNSUPPORTED, f->path, kv_gguf_find(f, "general.architecture")->val_off,
                       "architecture '%s' is not supported",
                       kv_gguf_excerpt(s.p, s.len, sb, sizeof sb));
    memset(cfg, 0, sizeof *cfg);
    cfg->arch = KV_ARCH_LLAMA;
    cfg->rope_layout = KV_ROPE_INTERLEAVED;
    if ((rc = arch_dim(f, "embedding_length", KV_MAX_DIM, 0, &cfg->dim, err)) ||
        (rc = arch_dim(f, "feed_forward_length", KV_MAX_DIM, 0, &cfg->hidden_dim, err)) ||
        (rc = arch_dim(f, "block_count", KV_MAX_LAYERS, 0, &cfg->n_layers, err)) ||
        (rc = arch_dim(f, "attention.head_count", KV_MAX_DIM, 0, &cfg->n_heads, err)) ||
        (rc = arch_dim(f, "attention.head_count_kv", KV_MAX_DIM, cfg->n_heads, &cfg->n_kv_heads,
                       err)) ||
        (rc = arch_dim(f, "context_length", KV_MAX_CTX, 0, &cfg->max_seq_len, err)))
        return rc;
    const struct kv_gguf_kv *kl = kv_gguf_find(f, "llama.attention.key_length");
    if (kl) {
        if ((rc = arch_dim(f, "attention.key_length", KV_MAX_DIM, 0, &cfg->head_dim, err)))
            return rc;
    } else {
        if (cfg->dim % cfg->n_heads)
            return kv_fail(err, KV_EFORMAT, f->path,
                           kv_gguf_find(f, "llama.attention.head_count")->val_off,
                           "llama.embedding_length %lld is not divisible by "
                           "llama.attention.head_count %lld",
                           (long long)cfg->dim, (long long)cfg->n_heads);
        cfg->head_dim = cfg->dim / cfg->n_heads;
    }
    const struct kv_gguf_kv *vl = kv_gguf_find(f, "llama.attention.value_length");
    if (vl) {
        int64_t v;
        if ((rc = arch_dim(f, "attention.value_length", KV_MAX_DIM, 0, &v, err))) return rc;
        if (v != cfg->head_dim)
            return kv_fail(err, KV_EUNSUPPORTED, f->path, vl->val_off,
                           "llama.attention.value_length %lld differs from the key head size "
                           "%lld",
                           (long long)v, (long long)cfg->head_dim);
    }
    if ((rc = kv_gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &cfg->norm_eps, err)))
        return rc;
    cfg->rope_theta = 10000.0f;
    if (kv_gguf_find(f, "llama.rope.freq_base") &&
        (rc = kv_gguf_get_f32(f, "llama.rope.freq_base", &cfg->rope_theta, err)))
        return rc;
    const struct kv_gguf_kv *rd = kv_gguf_find(f, "llama.rope.dimension_count");
    if (rd) {
        uint32_t v;
        if ((rc = kv_gguf_get_u32(f, "llama.rope.dimension_count", &v, err))) return rc;
        if ((int64_t)v != cfg->head_dim)
            return kv_fail(err, KV_EUNSUPPORTED, f->path, rd->val_off,
                           "llama.rope.dimension_count %u differs from the head size %lld: "
                           "partial rotary embeddings are not supported",
                           v, (long long)cfg->head_dim);
    }
    const struct kv_gguf_kv *rs = kv_gguf_find(f, "llama.rope.scaling.type");
    if (rs) {
        if ((rc = kv_gguf_get_str(f, "llama.rope.scaling.type", &s, err))) return rc;
        if (!kv_gguf_str_eq(s, "none"))
            return kv_fail(err, KV_EUNSUPPORTED, f->path, rs->val_off,
                           "rope scaling '%s' is not supported",
                           kv_gguf_excerpt(s.p, s.len, sb, sizeof sb));
    }
    const struct kv_gguf_kv *sl = kv_gguf_find(f, "llama.rope.scale_linear");
    if (sl) {
        float v;
        if ((rc = kv_gguf_get_f32(f, "llama.rope.scale_linear", &v, err))) return rc;
        if (v != 1.0f)
            return kv_fail(err, KV_EUNSUPPORTED, f->path, sl->val_off,
                           "linear rope scaling %g is not supported", (double)v);
    }

    const struct kv_gguf_tensor *emb = kv_gguf_find_tensor(f, "token_embd.weight");
    if (!emb)
        return kv_fail(err, KV_EFORMAT, f->path, KV_NO_OFFSET, "missing tensor 'token_embd.weight'");
    if (kv_gguf_find(f, "llama.vocab_size")) {
        if ((rc = arch_dim(f, "vocab_size", KV_MAX_VOCAB, 0, &cfg->vocab_size, err))) return rc;
    } else {
        cfg->vocab_size = emb->t.ndim == 2 ? emb->t.shape[0] : emb->ne[emb->n_dims - 1];
    }
    cfg->tied_embeddings = kv_gguf_find_tensor(f, "output.weight") == NULL;

    /* Special ids for the config; the tokenizer validates them again. */
    int is_llama_vocab = 0;
    const struct kv_gguf_kv *tm = kv_gguf_find(f, "tokenizer.ggml.model");
    if (tm && tm->type == KV_GGUF_STRING) is_llama_vocab = kv_gguf_str_eq(tm->str, "llama");
    const char *idkeys[2] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"};
    int32_t *ids[2] = {&cfg->bos_id, &cfg->eos_id};
    for (int k = 0; k < 2; k++) {
        *ids[k] = is_llama_vocab ? k + 1 : -1;
        if (!kv_gguf_find(f, idkeys[k])) continue;
        uint32_t v;
        if ((rc = kv_gguf_get_u32(f, idkeys[k], &v, err))) return rc;
        *ids[k] = v < (uint64_t)cfg->vocab_size ? (int32_t)v : -1;
    }
    return KV_OK;
}

/* Refuse tensors kvcal cannot use before allocating anything. */
static int check_tensors(const struct kv_gguf_file *f, const struct kv_config *cfg,
                         struct kv_err *err) {
    for (int64_t i = 0; i < f->n_tensors; i++) {
        const struct kv_gguf_tensor *ti = &f->tensors[i];
        uint32_t gt = ti->ggml_type;
        if (gt != KV_GGML_F32 && gt != KV_GGML_F16 && gt != KV_GGML_BF16)
            return kv_fail(err, KV_EUNSUPPORTED, f->path, ti->type_off,
                           "tensor '%s' has %stype %s; kvcal loads only F32, F16 and BF16",
                           ti->t.name, kv_ggml_is_quantized(gt) ? "quantized " : "",
                           kv_ggml_type_name(gt));
        enum kv_wkind kind;
        int64_t layer;
        if (!name_kind(&kv_arch_desc(cfg->arch)->gguf, ti->t.name, &kind, &layer)) {
            if (!strcmp(ti->t.name, "rope_freqs.weight"))
                return kv_fail(err, KV_EUNSUPPORTED, f->path, ti->info_off,
                               "tensor 'rope_freqs.weight' (rope frequency scaling) is not "
                               "supported");
            return kv_fail(err, KV_EUNSUPPORTED, f->path, ti->info_off,
                           "tensor '%s' is not part of the llama architecture kvcal implements",
                           ti->t.name);
        }
        if (layer >= cfg->n_layers)
            return kv_fail(err, KV_EFORMAT, f->path, ti->info_off,
                           "tensor '%s' names layer %lld but llama.block_count is %lld",
                           ti->t.name, (long long)layer, (long long)cfg->n_layers);
    }
    return KV_OK;
}

int kv_gguf_load(const char *path, struct kv_model **out, struct kv_err *err) {
    struct kv_gguf_file *f;
    int rc = kv_gguf_open(path, &f, err);
    if (rc) return rc;
    struct kv_config cfg;
    struct kv_model *m = NULL;
    if ((rc = read_config(f, &cfg, err)) || (rc = check_tensors(f, &cfg, err)) ||
        (rc = kv_model_create(&cfg, KV_FORMAT_GGUF, path, &m, err))) {
        kv_gguf_close(f);
        return rc;
    }
    if ((rc = kv_model_on_close(m, close_cb, f, err))) {
        kv_gguf_close(f);
        kv_model_close(m);
        return rc;
    }
    struct kv_tensor *table = malloc((size_t)(f->n_tensors ? f->n_tensors : 1) * sizeof *table);
    if (!table) {
        rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < f->n_tensors; i++) table[i] = f->tensors[i].t;
    rc = kv_model_add_tensors(m, table, f->n_tensors, err);
    free(table);
    if (rc) goto fail;
    const struct kv_arch_names *nm = &kv_arch_desc(m->cfg.arch)->gguf;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        enum kv_wkind kind;
        int64_t layer;
        KV_ASSERT(name_kind(nm, f->tensors[i].t.name, &kind, &layer)); /* by check_tensors */
        if ((rc = kv_model_bind(m, kind, layer, &f->tensors[i].t, path, err))) goto fail;
    }
    const struct kv_gguf_kv *tm = kv_gguf_find(f, "tokenizer.ggml.model");
    if (tm && tm->type == KV_GGUF_STRING && kv_gguf_str_eq(tm->str, "llama") &&
        (rc = kv_gguf_build_tokenizer(f, &m->tok, err)))
        goto fail;
    if ((rc = kv_model_finish(m, path, err))) goto fail;
    *out = m;
    return KV_OK;
fail:
    kv_model_close(m);
    return rc;
}
