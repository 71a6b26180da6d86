/* tokenizer.json: Hugging Face's tokenizers file as a kvcal tokenizer. What
 * is read and what is refused is described in tokjson.h. */
#include "tokjson.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "json.h"
#include "limits.h"
#include "pretok.h"
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

/* The SentencePiece forms kvcal reads with its own space rule (no
 * pre-tokenizer): normalizer [Prepend(r)], Replace(' ', r) or a Metaspace
 * pre-tokenizer that does not split. Anything else goes through a pipeline.
 * Returns 1 when the file is of that form (sp filled), 0 when not. */
static int legacy_spaces(const json_t *n, const json_t *pre, struct tok_spaces *sp) {
    sp->space_piece = NULL;
    sp->dummy = 0;
    if (n && !json_is_null(n)) {
        const char *type = json_string_value(json_object_get(n, "type"));
        if (!type) return 0;
        const json_t *list = n;
        size_t count = 1;
        if (strcmp(type, "Sequence") == 0) {
            list = json_object_get(n, "normalizers");
            if (!json_is_array(list)) return 0;
            count = json_array_size(list);
        }
        const char *prepend = NULL, *replace = NULL;
        for (size_t i = 0; i < count; i++) {
            const json_t *e = list == n ? n : json_array_get(list, i);
            const char *et = json_string_value(json_object_get(e, "type"));
            if (!et) return 0;
            if (strcmp(et, "Prepend") == 0 && !replace) {
                prepend = json_string_value(json_object_get(e, "prepend"));
                if (!prepend || !*prepend) return 0;
            } else if (strcmp(et, "Replace") == 0) {
                const char *from = json_string_value(json_object_get(json_object_get(e, "pattern"), "String"));
                const char *to = json_string_value(json_object_get(e, "content"));
                if (!from || !to || !*to || strcmp(from, " ") != 0 || replace) return 0;
                replace = to;
            } else {
                return 0;
            }
        }
        if (!replace) return count == 0 && (!pre || json_is_null(pre));
        if (prepend && strcmp(prepend, replace) != 0) return 0;
        sp->space_piece = replace;
        sp->dummy = prepend != NULL;
    }
    if (!pre || json_is_null(pre)) return 1;
    const char *type = json_string_value(json_object_get(pre, "type"));
    if (!type || strcmp(type, "Metaspace") != 0 || sp->space_piece) return 0;
    const json_t *split = json_object_get(pre, "split");
    if (!json_is_false(split)) return 0; /* split defaults to true */
    const char *rep = json_string_value(json_object_get(pre, "replacement"));
    if (!rep || !*rep) return 0;
    int dummy = 1;
    const char *sc = json_string_value(json_object_get(pre, "prepend_scheme"));
    const json_t *aps = json_object_get(pre, "add_prefix_space");
    if (sc) {
        if (strcmp(sc, "never") == 0) dummy = 0;
        else if (strcmp(sc, "always") != 0 && strcmp(sc, "first") != 0) return 0;
    } else if (json_is_boolean(aps)) {
        dummy = json_is_true(aps);
    }
    sp->space_piece = rep;
    sp->dummy = dummy;
    return 1;
}

/* A string field that must be there. */
static const char *need_str(const json_t *o, const char *key, const char *what, const char *path,
                            size_t *len, struct kv_err *err) {
    const json_t *v = json_object_get(o, key);
    if (!json_is_string(v)) {
        kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s has no string '%s'", what, key);
        return NULL;
    }
    if (len) *len = json_string_length(v);
    return json_string_value(v);
}

/* A Split-like pattern: {"String": s} or {"Regex": r}. */
static const char *pattern_of(const json_t *o, const char *what, const char *path, int *regex,
                              size_t *len, struct kv_err *err) {
    const json_t *pat = json_object_get(o, "pattern");
    const json_t *v = json_object_get(pat, "Regex");
    *regex = v != NULL;
    if (!v) v = json_object_get(pat, "String");
    if (!json_is_string(v)) {
        kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                "%s has no 'pattern' {\"String\": ...} or {\"Regex\": ...}", what);
        return NULL;
    }
    *len = json_string_length(v);
    return json_string_value(v);
}

static int bool_opt(const json_t *o, const char *key, int dflt) {
    const json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

/* Name the path in an error a pretok builder made without one. */
static int at_path(int rc, const char *path, struct kv_err *err) {
    if (rc && err && !err->path[0]) snprintf(err->path, sizeof err->path, "%s", path);
    return rc;
}

#define MAX_DEPTH 16

static int add_normalizer(struct kv_pretok *pt, const json_t *n, const char *path, int depth,
                          struct kv_err *err) {
    if (!n || json_is_null(n)) return KV_OK;
    const char *type = need_str(n, "type", "a normalizer", path, NULL, err);
    if (!type) return KV_EFORMAT;
    if (depth > MAX_DEPTH)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "normalizer Sequences nest deeper than %d", MAX_DEPTH);
    static const struct {
        const char *name;
        enum kv_pt_norm form;
    } uni[] = {{"NFC", KV_PT_NFC}, {"NFD", KV_PT_NFD}, {"NFKC", KV_PT_NFKC},
               {"NFKD", KV_PT_NFKD}, {"Lowercase", KV_PT_LOWERCASE}};
    for (size_t i = 0; i < sizeof uni / sizeof uni[0]; i++)
        if (strcmp(type, uni[i].name) == 0) return at_path(kv_pretok_norm_unicode(pt, uni[i].form, err), path, err);
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "normalizer Sequence has no 'normalizers' array");
        size_t i;
        json_t *e;
        json_array_foreach(list, i, e) {
            int rc = add_normalizer(pt, e, path, depth + 1, err);
            if (rc) return rc;
        }
        return KV_OK;
    }
    if (strcmp(type, "Prepend") == 0) {
        size_t len;
        const char *s = need_str(n, "prepend", "normalizer Prepend", path, &len, err);
        if (s && len > KV_MAX_PIECE)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "normalizer Prepend's text is over %d bytes", KV_MAX_PIECE);
        return s ? at_path(kv_pretok_norm_prepend(pt, s, len, err), path, err) : KV_EFORMAT;
    }
    if (strcmp(type, "Replace") == 0) {
        int regex;
        size_t plen, clen;
        const char *pat = pattern_of(n, "normalizer Replace", path, &regex, &plen, err);
        if (!pat) return KV_EFORMAT;
        const char *content = need_str(n, "content", "normalizer Replace", path, &clen, err);
        if (!content) return KV_EFORMAT;
        if (plen == 0)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "normalizer Replace has an empty pattern");
        if (clen > KV_MAX_PIECE || plen > KV_MAX_PIECE)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "normalizer Replace's pattern or content is over %d bytes",
                           KV_MAX_PIECE);
        return at_path(kv_pretok_norm_replace(pt, pat, plen, regex, content, clen, err), path, err);
    }
    if (strcmp(type, "Strip") == 0)
        return at_path(kv_pretok_norm_strip(pt, bool_opt(n, "strip_left", 1),
                                             bool_opt(n, "strip_right", 1), err), path, err);
    return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                   "normalizer '%.64s' is not supported", type);
}

static int behavior_of(const json_t *o, const char *what, const char *path, enum kv_pt_behavior dflt,
                       enum kv_pt_behavior *out, struct kv_err *err) {
    static const struct {
        const char *name;
        enum kv_pt_behavior b;
    } names[] = {{"Removed", KV_PT_REMOVED},
                 {"Isolated", KV_PT_ISOLATED},
                 {"MergedWithPrevious", KV_PT_MERGED_PREV},
                 {"MergedWithNext", KV_PT_MERGED_NEXT},
                 {"Contiguous", KV_PT_CONTIGUOUS}};
    const json_t *v = json_object_get(o, "behavior");
    *out = dflt;
    if (!v) return KV_OK;
    for (size_t i = 0; json_is_string(v) && i < sizeof names / sizeof names[0]; i++)
        if (strcmp(json_string_value(v), names[i].name) == 0) {
            *out = names[i].b;
            return KV_OK;
        }
    char found[64];
    kv_json_repr(v, found, sizeof found);
    return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                   "%s behavior %s is not one of Removed, Isolated, MergedWithPrevious, "
                   "MergedWithNext, Contiguous",
                   what, found);
}

/* Add the pre-tokenizer's stages; *byte_level is set by a ByteLevel, which
 * must come last. */
static int add_pre_tokenizer(struct kv_pretok *pt, const json_t *p, const char *path, int depth,
                             int *byte_level, struct kv_err *err) {
    if (!p || json_is_null(p)) return KV_OK;
    const char *type = need_str(p, "type", "a pre_tokenizer", path, NULL, err);
    if (!type) return KV_EFORMAT;
    if (depth > MAX_DEPTH)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "pre_tokenizer Sequences nest deeper than %d", MAX_DEPTH);
    if (*byte_level)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "pre_tokenizer '%.64s' after ByteLevel is not supported (ByteLevel must "
                       "come last)",
                       type);
    int rc;
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "pre_tokenizer Sequence has no 'pretokenizers' array");
        size_t i;
        json_t *e;
        json_array_foreach(list, i, e) {
            if ((rc = add_pre_tokenizer(pt, e, path, depth + 1, byte_level, err))) return rc;
        }
        return KV_OK;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        *byte_level = 1;
        return at_path(kv_pretok_bytelevel(pt, bool_opt(p, "add_prefix_space", 1),
                                           bool_opt(p, "use_regex", 1), err), path, err);
    }
    if (strcmp(type, "Split") == 0) {
        int regex;
        size_t plen;
        const char *pat = pattern_of(p, "pre_tokenizer Split", path, &regex, &plen, err);
        if (!pat) return KV_EFORMAT;
        enum kv_pt_behavior b;
        if ((rc = behavior_of(p, "pre_tokenizer Split", path, KV_PT_ISOLATED, &b, err))) return rc;
        if (plen == 0)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "pre_tokenizer Split has an empty pattern");
        return at_path(kv_pretok_split(pt, pat, plen, regex, b, bool_opt(p, "invert", 0), err), path, err);
    }
    if (strcmp(type, "Whitespace") == 0)
        return at_path(kv_pretok_split(pt, "\\w+|[^\\w\\s]+", 13, 1, KV_PT_REMOVED, 1, err), path, err);
    if (strcmp(type, "WhitespaceSplit") == 0)
        return at_path(kv_pretok_split(pt, "\\s+", 3, 1, KV_PT_REMOVED, 0, err), path, err);
    if (strcmp(type, "Digits") == 0)
        return at_path(kv_pretok_split(pt, "\\p{N}", 5, 1,
                                       bool_opt(p, "individual_digits", 0) ? KV_PT_ISOLATED
                                                                           : KV_PT_CONTIGUOUS,
                                       0, err), path, err);
    if (strcmp(type, "Punctuation") == 0) {
        enum kv_pt_behavior b;
        if ((rc = behavior_of(p, "pre_tokenizer Punctuation", path, KV_PT_ISOLATED, &b, err))) return rc;
        static const char punct[] = "[\\p{P}\\x{21}-\\x{2f}\\x{3a}-\\x{40}\\x{5b}-\\x{60}\\x{7b}-\\x{7e}]";
        return at_path(kv_pretok_split(pt, punct, sizeof punct - 1, 1, b, 0, err), path, err);
    }
    if (strcmp(type, "Metaspace") == 0) {
        size_t n;
        const char *rep = need_str(p, "replacement", "pre_tokenizer Metaspace", path, &n, err);
        if (!rep) return KV_EFORMAT;
        if (n == 0)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "pre_tokenizer Metaspace has an empty 'replacement'");
        if (n > KV_MAX_PIECE)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "the replacement for ' ' (pre_tokenizer Metaspace or normalizer "
                           "Replace) is %zu bytes, more than a piece may hold (%d)",
                           n, KV_MAX_PIECE);
        enum kv_pt_scheme scheme = bool_opt(p, "add_prefix_space", 1) ? KV_PT_ALWAYS : KV_PT_NEVER;
        const char *sc = json_string_value(json_object_get(p, "prepend_scheme"));
        if (sc) {
            if (strcmp(sc, "always") == 0) scheme = KV_PT_ALWAYS;
            else if (strcmp(sc, "first") == 0) scheme = KV_PT_FIRST;
            else if (strcmp(sc, "never") == 0) scheme = KV_PT_NEVER;
            else
                return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                               "pre_tokenizer Metaspace prepend_scheme '%.32s' is not one of "
                               "always, first, never", sc);
        }
        return at_path(kv_pretok_metaspace(pt, rep, n, scheme, bool_opt(p, "split", 1), err), path, err);
    }
    return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                   "pre_tokenizer '%.64s' is not supported", type);
}

/* Decoders of a pipeline tokenizer: replacements and a leading-space strip. */
static int add_decoder(struct kv_tokenizer *tok, const json_t *d, const char *path, int depth,
                       int apply, struct kv_err *err) {
    if (!d || json_is_null(d)) return KV_OK;
    const char *type = need_str(d, "type", "a decoder", path, NULL, err);
    if (!type) return KV_EFORMAT;
    if (depth > MAX_DEPTH)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "decoder Sequences nest deeper than %d",
                       MAX_DEPTH);
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(d, "decoders");
        if (!json_is_array(list))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "decoder Sequence has no 'decoders' array");
        size_t i;
        json_t *e;
        json_array_foreach(list, i, e) {
            int rc = add_decoder(tok, e, path, depth + 1, apply, err);
            if (rc) return rc;
        }
        return KV_OK;
    }
    if (!strcmp(type, "ByteLevel") || !strcmp(type, "ByteFallback") || !strcmp(type, "Fuse"))
        return KV_OK; /* pieces are raw bytes, byte tokens decode to their byte, tokens join */
    if (strcmp(type, "Replace") == 0) {
        int regex;
        size_t plen, clen;
        const char *pat = pattern_of(d, "decoder Replace", path, &regex, &plen, err);
        if (!pat) return KV_EFORMAT;
        const char *content = need_str(d, "content", "decoder Replace", path, &clen, err);
        if (!content) return KV_EFORMAT;
        if (regex)
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "decoder Replace with a regex pattern is not supported");
        return apply ? at_path(kv_tok_add_decoder_replace(tok, pat, plen, content, clen, err), path, err)
                     : KV_OK;
    }
    if (strcmp(type, "Strip") == 0) {
        const char *content = json_string_value(json_object_get(d, "content"));
        const json_t *start = json_object_get(d, "start");
        if (!content || strcmp(content, " ") != 0 || !json_is_integer(start) ||
            json_integer_value(start) < 0 || json_integer_value(start) > 64)
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "decoder Strip is supported only for content ' ' and start 0..64");
        if (apply) kv_tok_set_decoder_strip(tok, (int)json_integer_value(start));
        return KV_OK;
    }
    if (strcmp(type, "Metaspace") == 0) {
        size_t n;
        const char *rep = need_str(d, "replacement", "decoder Metaspace", path, &n, err);
        if (!rep) return KV_EFORMAT;
        const char *sc = json_string_value(json_object_get(d, "prepend_scheme"));
        int strip = sc ? strcmp(sc, "never") != 0 : bool_opt(d, "add_prefix_space", 1);
        if (!apply) return KV_OK;
        if (n) {
            int rc = kv_tok_add_decoder_replace(tok, rep, n, " ", 1, err);
            if (rc) return at_path(rc, path, err);
        }
        kv_tok_set_decoder_strip(tok, strip);
        return KV_OK;
    }
    return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET, "decoder '%.64s' is not supported",
                   type);
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
 * post-processor's "single" template, also inside a Sequence of
 * post-processors. ByteLevel post-processors only move offsets. Others
 * (Roberta, Bert) add tokens kvcal does not model: refused. */
static int template_specials(const json_t *pp, const json_t *vocab, const json_t *added,
                             int32_t n_vocab, const char *path, int depth, int32_t *bos,
                             int32_t *eos, struct kv_err *err) {
    if (!pp || json_is_null(pp)) return KV_OK;
    const char *type = json_string_value(json_object_get(pp, "type"));
    if (!type) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "post_processor has no string 'type'");
    if (strcmp(type, "ByteLevel") == 0) return KV_OK;
    if (strcmp(type, "Sequence") == 0 && depth < MAX_DEPTH) {
        size_t i;
        json_t *e;
        json_array_foreach(json_object_get(pp, "processors"), i, e) {
            int rc = template_specials(e, vocab, added, n_vocab, path, depth + 1, bos, eos, err);
            if (rc) return rc;
        }
        return KV_OK;
    }
    if (strcmp(type, "TemplateProcessing") != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "post_processor '%.64s' is not supported (TemplateProcessing, ByteLevel "
                       "and Sequence are)", type);
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
        if (id < 0 || id >= n_vocab)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "post_processor template token '%.64s' is not in the vocab", name);
        if (!seen_seq && *bos < 0) *bos = id;
        if (seen_seq && *eos < 0) *eos = id;
    }
    return KV_OK;
}

/* A token given in tokenizer_config.json: a string or {"content": ...}. */
static const char *config_token(const json_t *cfg, const char *key) {
    const json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_string_value(v);
}

static int add_merges(struct kv_tokenizer *tok, const json_t *merges, int byte_level,
                      const char *path, struct kv_err *err) {
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
        char ua[KV_MAX_PIECE], ub[KV_MAX_PIECE];
        if (byte_level && alen <= KV_MAX_PIECE && blen <= KV_MAX_PIECE) {
            int mapped;
            alen = kv_bytelevel_unmap(a, alen, ua, &mapped);
            blen = kv_bytelevel_unmap(b, blen, ub, &mapped);
            a = ua;
            b = ub;
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
    const json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout))
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "tokenizer model option dropout must be null: kvcal tokenizes "
                       "deterministically");
    const char *affix[2];
    static const char *const affix_key[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const json_t *v = json_object_get(model, affix_key[i]);
        affix[i] = json_string_value(v);
        if (v && !json_is_null(v) && !affix[i])
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "tokenizer model option %s must be a string or null", affix_key[i]);
        if (affix[i] && !*affix[i]) affix[i] = NULL;
    }
    int ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    int byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    const json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_null(added) && !json_is_array(added))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key 'added_tokens' must be an array");
    if (json_array_size(added) > KV_MAX_VOCAB)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "too many added_tokens");

    /* The SentencePiece forms run on kvcal's own space rule; everything else
     * (byte-level BPE, regex splits, Unicode normalizers) on a pipeline. */
    const json_t *norm = json_object_get(root, "normalizer");
    const json_t *pre = json_object_get(root, "pre_tokenizer");
    struct tok_spaces sp = {NULL, 0};
    int legacy = legacy_spaces(norm, pre, &sp) && !ignore_merges && !affix[0] && !affix[1];
    struct kv_pretok *pt = NULL;
    int byte_level = 0, rc = KV_OK;
    if (!legacy) {
        rc = kv_pretok_new(&pt, err);
        if (!rc) rc = add_normalizer(pt, norm, path, 0, err);
        if (!rc) rc = add_pre_tokenizer(pt, pre, path, 0, &byte_level, err);
        if (rc) {
            kv_pretok_free(pt);
            return rc;
        }
    }
    if (!sp.space_piece) sp.space_piece = " "; /* plain BPE: spaces are ordinary characters */

    struct tok_piece *pieces = NULL;
    int32_t n = 0;
    if ((rc = collect_pieces(vocab, added, byte_fallback, path, &pieces, &n, err))) {
        kv_pretok_free(pt);
        return rc;
    }

    int32_t unk = -1, bos = -1, eos = -1;
    const char *unk_s = json_string_value(json_object_get(model, "unk_token"));
    if (unk_s) {
        unk = piece_id(vocab, added, unk_s);
        if (unk < 0) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "unk_token '%.64s' is not in the vocab",
                         unk_s);
            goto done;
        }
        pieces[unk].type = KV_TOKT_UNKNOWN;
    }
    /* BOS and EOS: the template's, else tokenizer_config.json's tokens, else
     * special tokens named like them. Whether texts get them: the config's
     * add_bos_token / add_eos_token, else whether the template adds them. */
    if ((rc = template_specials(json_object_get(root, "post_processor"), vocab, added, n, path, 0,
                                &bos, &eos, err)))
        goto done;
    int tmpl_bos = bos >= 0, tmpl_eos = eos >= 0;
    json_t *cfg = NULL;
    {
        const char *slash = strrchr(path, '/');
        char cpath[4096];
        snprintf(cpath, sizeof cpath, "%.*stokenizer_config.json",
                 slash ? (int)(slash - path + 1) : 0, path);
        if (access(cpath, F_OK) == 0 && (rc = kv_json_load_reals(cpath, &cfg, err))) goto done;
        if (cfg && !json_is_object(cfg)) {
            rc = kv_fail(err, KV_EFORMAT, cpath, KV_NO_OFFSET, "tokenizer config is a json %s, "
                         "expected an object", kv_json_type_name(cfg));
            json_decref(cfg);
            goto done;
        }
        const char *names[2] = {config_token(cfg, "bos_token"), config_token(cfg, "eos_token")};
        int32_t *ids[2] = {&bos, &eos};
        for (int k = 0; k < 2; k++) {
            if (!names[k]) continue;
            int32_t id = piece_id(vocab, added, names[k]);
            if (*ids[k] < 0) *ids[k] = id;
            if (id < 0) {
                rc = kv_fail(err, KV_EFORMAT, cpath, KV_NO_OFFSET,
                             "%s '%.64s' is not in the tokenizer's vocab",
                             k ? "eos_token" : "bos_token", names[k]);
                json_decref(cfg);
                goto done;
            }
        }
    }
    int add_bos = bool_opt(cfg, "add_bos_token", tmpl_bos);
    int add_eos = bool_opt(cfg, "add_eos_token", tmpl_eos);
    json_decref(cfg);
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
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "config.json's %s %d is outside the tokenizer's %d pieces",
                     bos_ovr >= n ? "bos_token_id" : "eos_token_id",
                     bos_ovr >= n ? bos_ovr : eos_ovr, n);
        goto done;
    }
    if (bos_ovr >= 0) bos = bos_ovr;
    if (eos_ovr >= 0) eos = eos_ovr;
    if (add_bos && bos < 0) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "add_bos_token is true but the tokenizer names no bos token");
        goto done;
    }

    struct kv_tokenizer *tok = NULL;
    rc = kv_tok_init(KV_TOK_RANK, n, &tok, err);
    for (int32_t id = 0; !rc && id < n; id++) {
        const char *ps = pieces[id].s;
        size_t plen = pieces[id].len;
        char raw[KV_MAX_PIECE];
        if (byte_level && (pieces[id].type == KV_TOKT_NORMAL || pieces[id].type == KV_TOKT_BYTE ||
                           pieces[id].type == KV_TOKT_UNKNOWN)) {
            int mapped;
            plen = kv_bytelevel_unmap(ps, plen, raw, &mapped);
            ps = raw;
        }
        rc = kv_tok_set_piece(tok, id, ps, plen, 0.0f, pieces[id].type, err);
    }
    if (!rc) rc = at_path(kv_tok_set_affixes(tok, affix[0], affix[1], err), path, err);
    if (!rc) rc = add_merges(tok, merges, byte_level, path, err);
    if (!rc && strlen(sp.space_piece) > KV_MAX_PIECE)
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "the replacement for ' ' (pre_tokenizer Metaspace or normalizer Replace) is "
                     "%zu bytes, more than a piece may hold (%d)",
                     strlen(sp.space_piece), KV_MAX_PIECE);
    if (!rc) {
        kv_tok_set_special(tok, bos, eos, unk);
        kv_tok_set_policy(tok, add_bos, add_eos);
        rc = kv_tok_set_normalizer(tok, sp.space_piece, sp.dummy, err);
    }
    if (!rc) kv_tok_set_model_options(tok, ignore_merges, bool_opt(model, "fuse_unk", 0));
    if (!rc && pt) {
        rc = add_decoder(tok, json_object_get(root, "decoder"), path, 0, 1, err);
        if (!rc) rc = kv_tok_set_pretok(tok, pt, byte_level, err);
        if (!rc) pt = NULL;
    } else if (!rc) {
        rc = add_decoder(tok, json_object_get(root, "decoder"), path, 0, 0, err);
    }
    json_array_foreach(added, i, a) {
        if (rc) break;
        int special = json_is_true(json_object_get(a, "special"));
        unsigned f = (special ? KV_LIT_SPECIAL : 0) |
                     (bool_opt(a, "lstrip", 0) ? KV_LIT_LSTRIP : 0) |
                     (bool_opt(a, "rstrip", 0) ? KV_LIT_RSTRIP : 0) |
                     (bool_opt(a, "single_word", 0) ? KV_LIT_SINGLE_WORD : 0) |
                     (bool_opt(a, "normalized", !special) ? KV_LIT_NORMALIZED : 0);
        rc = kv_tok_add_literal_flags(tok, (int32_t)json_integer_value(json_object_get(a, "id")), f,
                                      err);
    }
    if (!rc) rc = kv_tok_finish(tok, path, err);
    if (rc) {
        kv_tok_free(tok);
        goto done;
    }
    *out = tok;
done:
    free(pieces);
    kv_pretok_free(pt);
    return rc;
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
