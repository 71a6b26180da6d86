/* tokenizer.json: Hugging Face's tokenizers file as a kvcal tokenizer. What
 * is read and what is refused is described in tokjson.h. */
#include "tokjson.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "json.h"
#include "limits.h"
#include "tokenizer.h"

struct tok_piece {
    const char *s; /* points into the JSON document */
    size_t len;
    int type;
    int set;
};

static int is_byte_piece(const char *s, size_t len) {
    static const char hex[] = "0123456789ABCDEF";
    return len == 6 && memcmp(s, "<0x", 3) == 0 && strchr(hex, s[3]) && strchr(hex, s[4]) &&
           s[5] == '>';
}

/* Id of piece s in the vocab or the added tokens, or -1. */
static int32_t piece_id(const json_t *vocab, const json_t *added, const char *s) {
    json_t *v = json_object_get(vocab, s);
    if (json_is_integer(v)) return (int32_t)json_integer_value(v);
    size_t i;
    json_t *a;
    json_array_foreach(added, i, a) {
        json_t *c = json_object_get(a, "content");
        if (json_is_string(c) && strcmp(json_string_value(c), s) == 0) {
            json_t *id = json_object_get(a, "id");
            if (json_is_integer(id)) return (int32_t)json_integer_value(id);
        }
    }
    return -1;
}

/* How the text's spaces become pieces: space_piece replaces ' ', dummy says
 * whether one is prepended. NULL space_piece: no rule seen (yet). */
struct tok_spaces {
    const char *space_piece;
    int dummy;
};

static int parse_normalizer(const json_t *n, const char *path, struct tok_spaces *sp,
                            struct kv_err *err) {
    if (!n || json_is_null(n)) return KV_OK;
    const char *type = json_string_value(json_object_get(n, "type"));
    if (!type) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "normalizer has no string 'type'");
    const json_t *list = n;
    size_t count = 1;
    if (strcmp(type, "Sequence") == 0) {
        list = json_object_get(n, "normalizers");
        if (!json_is_array(list))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "normalizer Sequence has no 'normalizers' array");
        count = json_array_size(list);
    }
    const char *prepend = NULL, *replace = NULL;
    for (size_t i = 0; i < count; i++) {
        const json_t *e = list == n ? n : json_array_get(list, i);
        const char *et = json_string_value(json_object_get(e, "type"));
        if (!et)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "normalizer has no string 'type'");
        if (strcmp(et, "Prepend") == 0) {
            prepend = json_string_value(json_object_get(e, "prepend"));
            if (!prepend || !*prepend)
                return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                               "normalizer Prepend has no non-empty string 'prepend'");
        } else if (strcmp(et, "Replace") == 0) {
            const json_t *pat = json_object_get(e, "pattern");
            const char *from = json_string_value(json_object_get(pat, "String"));
            const char *to = json_string_value(json_object_get(e, "content"));
            if (!from || !to || !*to)
                return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                               "normalizer Replace is supported only with a string pattern and "
                               "non-empty content");
            if (strcmp(from, " ") != 0)
                return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                               "normalizer Replace of '%.32s' is not supported, expected ' '",
                               from);
            replace = to;
        } else {
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "normalizer '%.64s' is not supported", et);
        }
    }
    if (!replace) {
        if (prepend)
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "normalizer Prepend without Replace(' ') is not supported");
        return KV_OK; /* an empty Sequence */
    }
    if (prepend && strcmp(prepend, replace) != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "normalizer prepends '%.32s' but replaces spaces with '%.32s'", prepend,
                       replace);
    sp->space_piece = replace;
    sp->dummy = prepend != NULL;
    return KV_OK;
}

static int parse_pre_tokenizer(const json_t *p, const char *path, struct tok_spaces *sp,
                               struct kv_err *err) {
    if (!p || json_is_null(p)) return KV_OK;
    const char *type = json_string_value(json_object_get(p, "type"));
    if (!type)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "pre_tokenizer has no string 'type'");
    if (strcmp(type, "Metaspace") != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "pre_tokenizer '%.64s' is not supported", type);
    if (sp->space_piece)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "a metaspace pre_tokenizer after a space-replacing normalizer is not "
                       "supported");
    const char *rep = json_string_value(json_object_get(p, "replacement"));
    if (!rep || !*rep)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "pre_tokenizer Metaspace has no non-empty string 'replacement'");
    int dummy = 1;
    const json_t *scheme = json_object_get(p, "prepend_scheme");
    const json_t *aps = json_object_get(p, "add_prefix_space");
    if (json_is_string(scheme)) {
        const char *sc = json_string_value(scheme);
        if (strcmp(sc, "never") == 0)
            dummy = 0;
        else if (strcmp(sc, "always") != 0 && strcmp(sc, "first") != 0)
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "pre_tokenizer Metaspace prepend_scheme '%.32s' is not supported", sc);
    } else if (json_is_boolean(aps)) {
        dummy = json_is_true(aps);
    }
    sp->space_piece = rep;
    sp->dummy = dummy;
    return KV_OK;
}

/* "<s>", "<|begin_of_text|>", "<|start_story|>" ... as BOS; "</s>", "<eos>",
 * "<|endoftext|>", "<|end_story|>" ... as EOS. */
static int special_role(const char *content) {
    char name[64];
    size_t n = 0;
    for (const char *c = content; *c && n + 1 < sizeof name; c++)
        if (*c != '<' && *c != '>' && *c != '|') name[n++] = (char)(*c >= 'A' && *c <= 'Z' ? *c + 32 : *c);
    name[n] = 0;
    if (!strcmp(name, "s") || !strcmp(name, "bos") || !strncmp(name, "begin", 5) ||
        !strncmp(name, "start", 5))
        return 1;
    if (!strcmp(name, "/s") || !strcmp(name, "eos") || !strncmp(name, "end", 3))
        return 2;
    return 0;
}

/* BOS (before the sequence) and EOS (after it) of a TemplateProcessing
 * post-processor's "single" template; anything unexpected is ignored. */
static void template_specials(const json_t *root, const json_t *vocab, const json_t *added,
                              int32_t n_vocab, int32_t *bos, int32_t *eos) {
    const json_t *pp = json_object_get(root, "post_processor");
    const char *type = json_string_value(json_object_get(pp, "type"));
    if (!type || strcmp(type, "TemplateProcessing") != 0) return;
    const json_t *single = json_object_get(pp, "single");
    const json_t *specials = json_object_get(pp, "special_tokens");
    int seen_seq = 0;
    size_t i;
    json_t *item;
    json_array_foreach(single, i, item) {
        if (json_object_get(item, "Sequence")) {
            seen_seq = 1;
            continue;
        }
        const char *name = json_string_value(json_object_get(json_object_get(item, "SpecialToken"), "id"));
        if (!name) continue;
        int32_t id = -1;
        json_t *ids = json_object_get(json_object_get(specials, name), "ids");
        if (json_is_integer(json_array_get(ids, 0)))
            id = (int32_t)json_integer_value(json_array_get(ids, 0));
        else
            id = piece_id(vocab, added, name);
        if (id < 0 || id >= n_vocab) continue;
        if (!seen_seq && *bos < 0) *bos = id;
        if (seen_seq && *eos < 0) *eos = id;
    }
}

static int add_merges(struct kv_tokenizer *tok, const json_t *merges, const char *path,
                      struct kv_err *err) {
    size_t i;
    json_t *m;
    json_array_foreach(merges, i, m) {
        const char *a = NULL, *b = NULL;
        size_t alen = 0, blen = 0;
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            const char *sp = strchr(s, ' ');
            if (sp && sp != s && sp[1] && !strchr(sp + 1, ' ')) {
                a = s;
                alen = (size_t)(sp - s);
                b = sp + 1;
                blen = strlen(b);
            }
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            alen = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            blen = json_string_length(json_array_get(m, 1));
        }
        if (!a || !alen || !blen) {
            char found[64];
            kv_json_repr(m, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "merges[%zu] must be \"a b\" or [\"a\", \"b\"], found %s", i, found);
        }
        int rc = kv_tok_add_merge(tok, a, alen, b, blen, (int32_t)i, path, err);
        if (rc) return rc;
    }
    return KV_OK;
}

/* Collect the pieces of vocab and added_tokens into pieces[0..n_vocab). */
static int collect_pieces(const json_t *vocab, const json_t *added, int byte_fallback,
                          const char *path, struct tok_piece **out, int32_t *n_out,
                          struct kv_err *err) {
    int64_t max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) >= KV_MAX_VOCAB) {
            char found[64];
            kv_json_repr(v, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "vocab piece '%.64s' has id %s, expected 0..%d", key, found,
                           KV_MAX_VOCAB - 1);
        }
        if (json_integer_value(v) > max_id) max_id = json_integer_value(v);
    }
    size_t i;
    json_t *a;
    json_array_foreach(added, i, a) {
        json_t *id = json_object_get(a, "id");
        json_t *content = json_object_get(a, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) >= KV_MAX_VOCAB || !json_is_string(content) ||
            json_string_length(content) == 0) {
            char found[64];
            kv_json_repr(a, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "added_tokens[%zu] must have an id in 0..%d and a non-empty content, "
                           "found %s",
                           i, KV_MAX_VOCAB - 1, found);
        }
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    if (max_id < 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "vocab is empty");
    int32_t n = (int32_t)(max_id + 1);
    struct tok_piece *p = calloc((size_t)n, sizeof *p);
    if (!p) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory for %d pieces", n);
    int rc = KV_OK;
    json_object_foreach((json_t *)vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        size_t len = strlen(key);
        if (len == 0 || len > KV_MAX_PIECE) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "vocab piece for id %d is %zu bytes, expected 1..%d", id, len,
                         KV_MAX_PIECE);
            goto fail;
        }
        if (p[id].set) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "vocab pieces '%.64s' and '%.64s' both have id %d", p[id].s, key, id);
            goto fail;
        }
        p[id] = (struct tok_piece){key, len, KV_TOKT_NORMAL, 1};
        if (byte_fallback && is_byte_piece(key, len)) p[id].type = KV_TOKT_BYTE;
    }
    json_array_foreach(added, i, a) {
        int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
        json_t *c = json_object_get(a, "content");
        const char *s = json_string_value(c);
        size_t len = json_string_length(c);
        if (len > KV_MAX_PIECE) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "added token %d is %zu bytes, above the limit %d", id, len, KV_MAX_PIECE);
            goto fail;
        }
        if (p[id].set && (p[id].len != len || memcmp(p[id].s, s, len) != 0)) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "added token '%.64s' has id %d, which the vocab gives to '%.64s'", s, id,
                         p[id].s);
            goto fail;
        }
        p[id] = (struct tok_piece){s, len, json_is_true(json_object_get(a, "special"))
                                               ? KV_TOKT_CONTROL
                                               : KV_TOKT_USER,
                                   1};
    }
    for (int32_t id = 0; id < n; id++)
        if (!p[id].set) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "vocab has no piece for id %d (ids go up to %d)", id, n - 1);
            goto fail;
        }
    *out = p;
    *n_out = n;
    return KV_OK;
fail:
    free(p);
    return rc;
}

/* Build a tokenizer from a parsed tokenizer.json. bos/eos >= 0 override the
 * file's own. */
static int tok_from_json(const json_t *root, const char *path, int32_t bos_ovr, int32_t eos_ovr,
                         struct kv_tokenizer **out, struct kv_err *err) {
    if (!json_is_object(root))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "tokenizer is a json %s, expected an object", kv_json_type_name(root));
    const json_t *model = json_object_get(root, "model");
    if (!json_is_object(model))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key 'model' must be an object");
    const char *type = json_string_value(json_object_get(model, "type"));
    if (type && strcmp(type, "BPE") != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "tokenizer model type '%.64s' is not supported, expected 'BPE'", type);
    const json_t *vocab = json_object_get(model, "vocab");
    const json_t *merges = json_object_get(model, "merges");
    if (!type && !merges)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "tokenizer model has no type and no merges; only BPE is supported");
    if (!json_is_object(vocab))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key 'model.vocab' must be an object");
    if (!json_is_array(merges))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key 'model.merges' must be an array");
    if (json_object_size(vocab) > KV_MAX_VOCAB || json_array_size(merges) > KV_MAX_VOCAB)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "tokenizer has %zu pieces and %zu merges, above the limit %d",
                       json_object_size(vocab), json_array_size(merges), KV_MAX_VOCAB);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        const char *s = json_string_value(json_object_get(model, affixes[i]));
        if (s && *s)
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "tokenizer model option %s '%.32s' is not supported", affixes[i], s);
    }
    if (json_is_true(json_object_get(model, "ignore_merges")))
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "tokenizer model option ignore_merges true is not supported");
    int byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    const json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_null(added) && !json_is_array(added))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key 'added_tokens' must be an array");
    if (json_array_size(added) > KV_MAX_VOCAB)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "too many added_tokens");

    struct tok_spaces sp = {NULL, 0};
    int rc = parse_normalizer(json_object_get(root, "normalizer"), path, &sp, err);
    if (!rc) rc = parse_pre_tokenizer(json_object_get(root, "pre_tokenizer"), path, &sp, err);
    if (rc) return rc;
    if (!sp.space_piece) sp.space_piece = " "; /* plain BPE: spaces are ordinary characters */

    struct tok_piece *pieces = NULL;
    int32_t n = 0;
    if ((rc = collect_pieces(vocab, added, byte_fallback, path, &pieces, &n, err))) return rc;

    int32_t unk = -1, bos = -1, eos = -1;
    const char *unk_s = json_string_value(json_object_get(model, "unk_token"));
    if (unk_s) {
        unk = piece_id(vocab, added, unk_s);
        if (unk < 0) {
            free(pieces);
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "unk_token '%.64s' is not in the vocab", unk_s);
        }
        pieces[unk].type = KV_TOKT_UNKNOWN;
    }
    template_specials(root, vocab, added, n, &bos, &eos);
    size_t i;
    json_t *a;
    json_array_foreach(added, i, a) {
        if (!json_is_true(json_object_get(a, "special"))) continue;
        int role = special_role(json_string_value(json_object_get(a, "content")));
        int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
        if (role == 1 && bos < 0) bos = id;
        if (role == 2 && eos < 0) eos = id;
    }
    if (bos_ovr >= n || eos_ovr >= n) {
        free(pieces);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "config.json's %s %d is outside the tokenizer's %d pieces",
                       bos_ovr >= n ? "bos_token_id" : "eos_token_id",
                       bos_ovr >= n ? bos_ovr : eos_ovr, n);
    }
    if (bos_ovr >= 0) bos = bos_ovr;
    if (eos_ovr >= 0) eos = eos_ovr;

    struct kv_tokenizer *tok = NULL;
    rc = kv_tok_init(KV_TOK_RANK, n, &tok, err);
    for (int32_t id = 0; !rc && id < n; id++)
        rc = kv_tok_set_piece(tok, id, pieces[id].s, pieces[id].len, 0.0f, pieces[id].type, err);
    if (!rc) rc = add_merges(tok, merges, path, err);
    if (!rc && strlen(sp.space_piece) > KV_MAX_PIECE)
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "the replacement for ' ' (pre_tokenizer Metaspace or normalizer Replace) is "
                     "%zu bytes, more than a piece may hold (%d)",
                     strlen(sp.space_piece), KV_MAX_PIECE);
    if (!rc) {
        kv_tok_set_special(tok, bos, eos, unk);
        rc = kv_tok_set_normalizer(tok, sp.space_piece, sp.dummy, err);
    }
    json_array_foreach(added, i, a) {
        if (rc) break;
        rc = kv_tok_add_literal(tok, (int32_t)json_integer_value(json_object_get(a, "id")), err);
    }
    if (!rc) rc = kv_tok_finish(tok, path, err);
    free(pieces);
    if (rc) {
        kv_tok_free(tok);
        return rc;
    }
    *out = tok;
    return KV_OK;
}

int kv_hf_load_tokenizer_ids(const char *path, int32_t bos, int32_t eos,
                             struct kv_tokenizer **out, struct kv_err *err) {
    json_t *root;
    int rc = kv_json_load(path, &root, err);
    if (rc) return rc;
    rc = tok_from_json(root, path, bos, eos, out, err);
    json_decref(root);
    if (rc && err && !err->path[0]) snprintf(err->path, sizeof err->path, "%s", path); /* the tokenizer's own rules */
    return rc;
}

int kv_hf_load_tokenizer(const char *path, struct kv_tokenizer **out, struct kv_err *err) {
    return kv_hf_load_tokenizer_ids(path, -1, -1, out, err);
}
