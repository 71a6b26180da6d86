/* The llama mapping of a GGUF container: its tokenizers (SentencePiece and
 * byte-level BPE), its hyper-parameters and tensor names, and the model
 * loader. Keys and names are listed in ggufmodel.h. */
#include "ggufmodel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "err.h"
#include "ggmlquant.h"
#include "limits.h"
#include "model.h"
#include "pretok.h"
#include "tokenizer.h"

/* ------------------------------------------------------------ tokenizer */

#define SPACE_PIECE "\xe2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK */

/* Optional special id: default when absent, -1 for the "none" value. */
static int special_id(const struct kv_gguf_file *f, const char *key, int32_t dflt,
                      uint64_t n_vocab, int32_t *out, struct kv_err *err) {
    const struct kv_gguf_kv *kv = kv_gguf_find(f, key);
    if (!kv) {
        *out = dflt >= 0 && (uint64_t)dflt < n_vocab ? dflt : -1;
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

/* Optional bool: dflt when absent. */
static int opt_bool(const struct kv_gguf_file *f, const char *key, int dflt, int *out,
                    struct kv_err *err) {
    *out = dflt;
    return kv_gguf_find(f, key) ? kv_gguf_get_bool(f, key, out, err) : KV_OK;
}

/* Where string element s of an array starts in the file: its u64 length. */
static uint64_t str_off(const struct kv_gguf_file *f, struct kv_gguf_str s) {
    return (uint64_t)((const uint8_t *)s.p - f->buf) - 8;
}

/* What both vocabulary models share: the pieces, their optional scores and
 * types, the special ids and whether texts get BOS and EOS. */
struct gguf_vocab {
    struct kv_gguf_str *pieces;
    uint64_t n;
    float *scores;  /* NULL when absent */
    int32_t *types; /* NULL when absent */
    int32_t bos, eos, unk;
    int add_bos, add_eos;
};

static void vocab_free(struct gguf_vocab *v) {
    free(v->pieces);
    free(v->scores);
    free(v->types);
}

/* Read the keys of the vocabulary; want_scores reads tokenizer.ggml.scores.
 * dflt holds the default special ids and policy. */
static int read_vocab(const struct kv_gguf_file *f, int want_scores, const struct gguf_vocab *dflt,
                      struct gguf_vocab *v, struct kv_err *err) {
    memset(v, 0, sizeof *v);
    int rc = kv_gguf_get_arr_str(f, "tokenizer.ggml.tokens", &v->pieces, &v->n, err);
    if (rc) return rc;
    uint64_t n = v->n;
    if (n < 1 || n > KV_MAX_VOCAB)
        return kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, "tokenizer.ggml.tokens")->val_off,
                       "key 'tokenizer.ggml.tokens' has %llu entries, expected 1..%d",
                       (unsigned long long)n, KV_MAX_VOCAB);
    for (uint64_t i = 0; i < n; i++)
        if (v->pieces[i].len > KV_MAX_PIECE)
            return kv_fail(err, KV_EFORMAT, f->path, str_off(f, v->pieces[i]),
                           "token %llu of 'tokenizer.ggml.tokens' is %llu bytes, limit %d",
                           (unsigned long long)i, (unsigned long long)v->pieces[i].len,
                           KV_MAX_PIECE);
    const char *opt[2] = {"tokenizer.ggml.scores", "tokenizer.ggml.token_type"};
    for (int k = !want_scores; k < 2; k++) {
        const struct kv_gguf_kv *kv = kv_gguf_find(f, opt[k]);
        if (!kv) continue;
        uint64_t cnt = 0;
        rc = k ? kv_gguf_get_arr_i32(f, opt[k], &v->types, &cnt, err)
               : kv_gguf_get_arr_f32(f, opt[k], &v->scores, &cnt, err);
        if (rc) return rc;
        if (cnt != n)
            return kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                           "key '%s' has %llu entries but 'tokenizer.ggml.tokens' has %llu", opt[k],
                           (unsigned long long)cnt, (unsigned long long)n);
    }
    if ((rc = special_id(f, "tokenizer.ggml.bos_token_id", dflt->bos, n, &v->bos, err)) ||
        (rc = special_id(f, "tokenizer.ggml.eos_token_id", dflt->eos, n, &v->eos, err)) ||
        (rc = special_id(f, "tokenizer.ggml.unknown_token_id", dflt->unk, n, &v->unk, err)) ||
        (rc = opt_bool(f, "tokenizer.ggml.add_bos_token", dflt->add_bos, &v->add_bos, err)) ||
        (rc = opt_bool(f, "tokenizer.ggml.add_eos_token", dflt->add_eos, &v->add_eos, err)))
        return rc;
    return KV_OK;
}

/* "llama": SentencePiece pieces merged by score. */
static int build_llama(const struct kv_gguf_file *f, struct kv_tokenizer **out,
                       struct kv_err *err) {
    static const struct gguf_vocab dflt = {.bos = 1, .eos = 2, .unk = 0, .add_bos = 1};
    struct gguf_vocab v;
    struct kv_tokenizer *tok = NULL;
    int rc = read_vocab(f, 1, &dflt, &v, err);
    if (rc) goto done;
    int add_prefix = 1;
    if ((rc = opt_bool(f, "tokenizer.ggml.add_space_prefix", 1, &add_prefix, err))) goto done;

    if ((rc = kv_tok_init(KV_TOK_SCORE, (int32_t)v.n, &tok, err))) goto done;
    for (uint64_t i = 0; i < v.n; i++) {
        float sc = v.scores ? v.scores[i] : 0.0f;
        if (!isfinite(sc)) {
            rc = kv_fail(err, KV_EFORMAT, f->path,
                         kv_gguf_elem_off(kv_gguf_find(f, "tokenizer.ggml.scores"), i),
                         "score of token %llu is %g, expected a finite number",
                         (unsigned long long)i, (double)sc);
            goto done;
        }
        int ty = v.types ? v.types[i] : KV_TOKT_NORMAL;
        rc = kv_tok_set_piece(tok, (int32_t)i, v.pieces[i].p, (size_t)v.pieces[i].len, sc, ty, err);
        if (rc) goto done;
    }
    kv_tok_set_special(tok, v.bos, v.eos, v.unk);
    kv_tok_set_policy(tok, v.add_bos, v.add_eos);
    if ((rc = kv_tok_set_normalizer(tok, SPACE_PIECE, add_prefix, err))) goto done;
    if ((rc = kv_tok_finish(tok, f->path, err))) goto done;
    *out = tok;
    tok = NULL;
done:
    kv_tok_free(tok);
    vocab_free(&v);
    return rc;
}

/* The pre-tokenizers of "gpt2" vocabularies: llama.cpp's regex lists for
 * each tokenizer.ggml.pre value (the regex_exprs of llm_tokenizer_bpe in
 * llama.cpp's src/llama-vocab.cpp, and which names share a list from its
 * tokenizer_pre table in the same file), as PCRE2 patterns. Each regex of
 * a list splits every piece the previous one left (the matches and the
 * gaps between them kept), in order. */

/* GPT-2's regex without its final "|\s+": a whitespace that ends up in no
 * match is a gap, kept as a piece all the same. */
#define RX_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define RX_PUNCT "[\\p{P}\\$\\+<=>\\^~\\|`]+"
/* The Llama 3 tokenizer.json regex with its "(?i:'s|'t|...)" spelled out
 * case by case, as llama.cpp writes it. */
#define RX_CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#define RX_LLAMA3                                                                                \
    RX_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
                    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RX_QWEN2                                                                                 \
    RX_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"      \
                    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* CJK ideographs, U+0800..U+4E00 and Hangul, as DeepSeek writes them. */
#define RX_CJK "[\\x{4e00}-\\x{9fa5}\\x{0800}-\\x{4e00}\\x{ac00}-\\x{d7ff}]+"

static const char *const rx_default[] = {RX_PUNCT, RX_GPT2, "\\p{N}+", "[0-9][0-9][0-9]", NULL};
static const char *const rx_gpt2[] = {RX_GPT2, NULL};
static const char *const rx_llama3[] = {RX_LLAMA3, NULL};
static const char *const rx_qwen2[] = {RX_QWEN2, NULL};
static const char *const rx_falcon[] = {RX_PUNCT, RX_GPT2, "[0-9][0-9][0-9]", NULL};
static const char *const rx_starcoder[] = {"\\p{N}", RX_GPT2, NULL};
static const char *const rx_deepseek_coder[] = {"[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RX_CJK,
                                                "\\p{N}", NULL};
static const char *const rx_deepseek_llm[] = {
    "[\\r\\n]",
    /* cased letters, listed range by range */
    "\\s?[A-Za-z\\x{b5}\\x{c0}-\\x{d6}\\x{d8}-\\x{f6}\\x{f8}-\\x{1ba}\\x{1bc}-\\x{1bf}"
    "\\x{1c4}-\\x{293}\\x{295}-\\x{2af}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37b}-\\x{37d}"
    "\\x{37f}\\x{386}\\x{388}-\\x{38a}\\x{38c}\\x{38e}-\\x{3a1}\\x{3a3}-\\x{3f5}"
    "\\x{3f7}-\\x{481}\\x{48a}-\\x{52f}\\x{531}-\\x{556}\\x{10a0}-\\x{10c5}\\x{13a0}-\\x{13f5}"
    "\\x{13f8}-\\x{13fd}\\x{1c90}-\\x{1cba}\\x{1cbd}-\\x{1cbf}\\x{1d00}-\\x{1d2b}"
    "\\x{1d6b}-\\x{1d77}\\x{1d79}-\\x{1d9a}\\x{1e00}-\\x{1f15}\\x{1f18}-\\x{1f1d}"
    "\\x{1f20}-\\x{1f45}\\x{1f48}-\\x{1f4d}\\x{1f50}-\\x{1f57}\\x{1f59}\\x{1f5b}\\x{1f5d}"
    "\\x{1f5f}-\\x{1f7d}\\x{1f80}-\\x{1fb4}\\x{1fb6}-\\x{1fbc}\\x{1fbe}\\x{1fc2}-\\x{1fc4}"
    "\\x{1fc6}-\\x{1fcc}\\x{1fd0}-\\x{1fd3}\\x{1fd6}-\\x{1fdb}\\x{1fe0}-\\x{1fec}"
    "\\x{1ff2}-\\x{1ff4}\\x{1ff6}-\\x{1ffc}\\x{2102}\\x{2107}\\x{210a}-\\x{2113}\\x{2115}"
    "\\x{2119}-\\x{211d}\\x{2124}\\x{2126}\\x{2128}\\x{212a}-\\x{212d}\\x{212f}-\\x{2134}"
    "\\x{2139}\\x{213c}-\\x{213f}\\x{2145}-\\x{2149}\\x{214e}\\x{2183}\\x{2184}"
    "\\x{2c00}-\\x{2c7b}\\x{2c7e}-\\x{2ce4}\\x{2ceb}-\\x{2cee}\\x{2cf2}\\x{2cf3}"
    "\\x{a640}-\\x{a66d}\\x{a680}-\\x{a69b}\\x{a722}-\\x{a76f}\\x{a771}-\\x{a787}"
    "\\x{a78b}-\\x{a78e}\\x{ab70}-\\x{abbf}\\x{fb00}-\\x{fb06}\\x{fb13}-\\x{fb17}"
    "\\x{ff21}-\\x{ff3a}\\x{ff41}-\\x{ff5a}\\x{10400}-\\x{1044f}\\x{104b0}-\\x{104d3}"
    "\\x{104d8}-\\x{104fb}\\x{10c80}-\\x{10cb2}\\x{10cc0}-\\x{10cf2}\\x{118a0}-\\x{118df}"
    "\\x{1e900}-\\x{1e943}]+",
    /* ASCII and full-width punctuation, quotation marks, CJK punctuation */
    "\\s?[!-/:-~\\x{ff01}-\\x{ff0f}\\x{ff1a}-\\x{ff5e}\\x{2018}-\\x{201f}\\x{3000}-\\x{3002}]+",
    "\\s+$",
    RX_CJK,
    "\\p{N}+",
    NULL,
};

/* A tokenizer.ggml.pre value. ignore_merges: a word that is a piece is that
 * piece; add_bos: the default of tokenizer.ggml.add_bos_token. llama.cpp
 * sets both for its Llama 3 pre-tokenizer, whose files often lack the key;
 * every other gpt2 vocabulary gets no BOS unless the file says so. */
struct gguf_pre {
    const char *name;
    const char *const *regex;
    int ignore_merges, add_bos;
};

static const struct gguf_pre gguf_pres[] = {
    {"default", rx_default, 0, 0},
    {"gpt-2", rx_gpt2, 0, 0},
    {"phi-2", rx_gpt2, 0, 0},
    {"gpt-neox", rx_gpt2, 0, 0},
    {"mpt", rx_gpt2, 0, 0},
    {"olmo", rx_gpt2, 0, 0},
    {"llama-bpe", rx_llama3, 1, 1},
    {"llama3", rx_llama3, 1, 1},
    {"llama-v3", rx_llama3, 1, 1},
    {"smaug-bpe", rx_llama3, 0, 0},
    {"dbrx", rx_llama3, 0, 0},
    {"qwen2", rx_qwen2, 0, 0},
    {"stablelm2", rx_qwen2, 0, 0},
    {"falcon", rx_falcon, 0, 0},
    {"starcoder", rx_starcoder, 0, 0},
    {"refact", rx_starcoder, 0, 0},
    {"smollm", rx_starcoder, 0, 0},
    {"command-r", rx_starcoder, 0, 0},
    {"deepseek-llm", rx_deepseek_llm, 0, 0},
    {"deepseek-coder", rx_deepseek_coder, 0, 0},
};

/* The entry of tokenizer.ggml.pre ("default" when absent). */
static int find_pre(const struct kv_gguf_file *f, const struct gguf_pre **out,
                    struct kv_err *err) {
    const char *key = "tokenizer.ggml.pre";
    struct kv_gguf_str name = {"default", 7};
    if (kv_gguf_find(f, key)) {
        int rc = kv_gguf_get_str(f, key, &name, err);
        if (rc) return rc;
    }
    size_t n_pres = sizeof gguf_pres / sizeof gguf_pres[0];
    for (size_t i = 0; i < n_pres; i++)
        if (kv_gguf_str_eq(name, gguf_pres[i].name)) {
            *out = &gguf_pres[i];
            return KV_OK;
        }
    char known[512], nb[128];
    size_t o = 0;
    for (size_t i = 0; i < n_pres && o < sizeof known; i++)
        o += (size_t)snprintf(known + o, sizeof known - o, "%s%s", i ? ", " : "",
                              gguf_pres[i].name);
    return kv_fail(err, KV_EUNSUPPORTED, f->path, kv_gguf_find(f, key)->val_off,
                   "key '%s' is '%s', which kvcal does not know; known: %s", key,
                   kv_gguf_excerpt(name.p, name.len, nb, sizeof nb), known);
}

/* Add merge i of the file ("a b", both pieces in GPT-2's mapped form). */
static int add_gpt2_merge(const struct kv_gguf_file *f, struct kv_tokenizer *tok,
                          struct kv_gguf_str m, uint64_t i, struct kv_err *err) {
    const char *key = "tokenizer.ggml.merges";
    const char *sp = memchr(m.p, ' ', (size_t)m.len);
    size_t alen = sp ? (size_t)(sp - m.p) : 0, blen = sp ? (size_t)m.len - alen - 1 : 0;
    char eb[128];
    if (!sp || !alen || !blen || memchr(sp + 1, ' ', blen))
        return kv_fail(err, KV_EFORMAT, f->path, str_off(f, m),
                       "entry %llu of key '%s' is '%s', expected two pieces joined by one space",
                       (unsigned long long)i, key, kv_gguf_excerpt(m.p, m.len, eb, sizeof eb));
    const char *a = m.p, *b = sp + 1;
    char ua[KV_MAX_PIECE], ub[KV_MAX_PIECE];
    int mapped;
    if (alen <= KV_MAX_PIECE && blen <= KV_MAX_PIECE) {
        alen = kv_bytelevel_unmap(a, alen, ua, &mapped);
        blen = kv_bytelevel_unmap(b, blen, ub, &mapped);
        a = ua;
        b = ub;
    }
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kv_tok_add_merge(tok, a, alen, b, blen, (int32_t)i, f->path, &e);
    if (rc == KV_OK) return KV_OK;
    if (rc != KV_EFORMAT) {
        if (err) *err = e;
        return rc;
    }
    /* "merge rank R 'a' + 'b': what is missing": keep what is missing (the
     * quotes escape every "'", so the first "': " ends the pair) */
    const char *why = strstr(e.msg, "': ");
    why = why ? why + 3 : e.msg;
    return kv_fail(err, KV_EFORMAT, f->path, str_off(f, m), "entry %llu of key '%s', '%s': %s",
                   (unsigned long long)i, key, kv_gguf_excerpt(m.p, m.len, eb, sizeof eb), why);
}

/* "gpt2": byte-level BPE, pieces in GPT-2's byte-to-unicode form merged by
 * rank, text split by the named pre-tokenizer's regexes. */
static int build_gpt2(const struct kv_gguf_file *f, struct kv_tokenizer **out,
                      struct kv_err *err) {
    const struct gguf_pre *pre = NULL;
    int rc = find_pre(f, &pre, err);
    if (rc) return rc;
    const struct gguf_vocab dflt = {.bos = -1, .eos = -1, .unk = -1, .add_bos = pre->add_bos};
    struct gguf_vocab v;
    struct kv_gguf_str *merges = NULL;
    uint64_t n_merges = 0;
    struct kv_tokenizer *tok = NULL;
    struct kv_pretok *pt = NULL;
    if ((rc = read_vocab(f, 0, &dflt, &v, err))) goto done;
    if ((rc = kv_gguf_get_arr_str(f, "tokenizer.ggml.merges", &merges, &n_merges, err))) goto done;
    if (n_merges > KV_MAX_VOCAB) {
        rc = kv_fail(err, KV_EFORMAT, f->path, kv_gguf_find(f, "tokenizer.ggml.merges")->val_off,
                     "key 'tokenizer.ggml.merges' has %llu entries, above the limit %d",
                     (unsigned long long)n_merges, KV_MAX_VOCAB);
        goto done;
    }

    if ((rc = kv_tok_init(KV_TOK_RANK, (int32_t)v.n, &tok, err))) goto done;
    for (uint64_t i = 0; i < v.n; i++) {
        int ty = v.types ? v.types[i] : KV_TOKT_NORMAL;
        const char *p = v.pieces[i].p;
        size_t len = (size_t)v.pieces[i].len;
        char raw[KV_MAX_PIECE];
        if (ty != KV_TOKT_CONTROL && ty != KV_TOKT_USER) { /* those are text as it is */
            int mapped;
            len = kv_bytelevel_unmap(p, len, raw, &mapped);
            p = raw;
        }
        if ((rc = kv_tok_set_piece(tok, (int32_t)i, p, len, 0.0f, ty, err))) goto done;
    }
    for (uint64_t i = 0; i < n_merges; i++)
        if ((rc = add_gpt2_merge(f, tok, merges[i], i, err))) goto done;
    kv_tok_set_special(tok, v.bos, v.eos, v.unk);
    kv_tok_set_policy(tok, v.add_bos, v.add_eos);
    kv_tok_set_model_options(tok, pre->ignore_merges, 0);
    if ((rc = kv_pretok_new(&pt, err))) goto done;
    for (const char *const *rx = pre->regex; *rx; rx++)
        if ((rc = kv_pretok_split(pt, *rx, strlen(*rx), 1, KV_PT_ISOLATED, 0, err))) goto done;
    if ((rc = kv_pretok_bytelevel(pt, 0, 0, err))) goto done;
    if ((rc = kv_tok_set_pretok(tok, pt, 1, err))) goto done;
    pt = NULL;
    /* control tokens match in text only when parsing special tokens;
     * user-defined ones always (as llama.cpp does) */
    for (uint64_t i = 0; v.types && i < v.n; i++) {
        if (v.types[i] != KV_TOKT_CONTROL && v.types[i] != KV_TOKT_USER) continue;
        unsigned fl = v.types[i] == KV_TOKT_CONTROL ? KV_LIT_SPECIAL : 0;
        if ((rc = kv_tok_add_literal_flags(tok, (int32_t)i, fl, err))) goto done;
    }
    if ((rc = kv_tok_finish(tok, f->path, err))) goto done;
    *out = tok;
    tok = NULL;
done:
    kv_pretok_free(pt);
    kv_tok_free(tok);
    free(merges);
    vocab_free(&v);
    return rc;
}

int kv_gguf_build_tokenizer(const struct kv_gguf_file *f, struct kv_tokenizer **out,
                            struct kv_err *err) {
    struct kv_gguf_str model;
    int rc = kv_gguf_get_str(f, "tokenizer.ggml.model", &model, err);
    if (rc) return rc;
    if (kv_gguf_str_eq(model, "llama")) return build_llama(f, out, err);
    if (kv_gguf_str_eq(model, "gpt2")) return build_gpt2(f, out, err);
    char mb[128];
    return kv_fail(err, KV_EUNSUPPORTED, f->path, kv_gguf_find(f, "tokenizer.ggml.model")->val_off,
                   "tokenizer model '%s' is not supported; kvcal reads 'llama' (sentencepiece) "
                   "and 'gpt2' (byte-level bpe) vocabularies",
                   kv_gguf_excerpt(model.p, model.len, mb, sizeof mb));
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

/* "<arch>.<suffix>": the key of a hyper-parameter of the file's
 * architecture (a ring of buffers, so a message can name two). */
static const char *akey(const char *arch, const char *suffix) {
    static _Thread_local char ring[8][128];
    static _Thread_local unsigned next;
    char *b = ring[next++ % 8];
    snprintf(b, sizeof ring[0], "%s.%s", arch, suffix);
    return b;
}

/* Required or optional "<arch>.<suffix>" u32 hyper-parameter, as int64 in
 * 1..max. */
static int arch_dim(const struct kv_gguf_file *f, const char *arch, const char *suffix, int64_t max,
                    int64_t dflt, int64_t *out, struct kv_err *err) {
    const char *key = akey(arch, suffix);
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
 * "blk.N.attn_q.weight", ...) to its table entry and layer (-1 for a global);
 * NULL if unknown. */
static const struct kv_arch_tensor *name_entry(const struct kv_arch_names *nm, const char *name,
                                               int64_t *layer) {
    *layer = -1;
    for (int64_t i = 0; i < nm->n_globals; i++)
        if (!strcmp(name, nm->globals[i].name)) return &nm->globals[i];
    size_t np = strlen(nm->layer_prefix);
    if (strncmp(name, nm->layer_prefix, np) != 0) return 0;
    const char *p = name + np;
    int64_t l = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 9) {
        l = l * 10 + (*p++ - '0');
        digits++;
    }
    if (!digits || *p != '.' || (digits > 1 && name[np] == '0')) return NULL;
    p++;
    for (int64_t i = 0; i < nm->n_layer; i++)
        if (!strcmp(p, nm->layer[i].name)) {
            *layer = l;
            return &nm->layer[i];
        }
    return NULL;
}

/* Bind GGUF tensor t as entry e's weights of layer: one kind as it is, or
 * the kinds stacked along its rows (gptneox's attn_qkv) as slices of whole
 * rows (a quantized row holds whole blocks, so each slice does too). */
static int bind_entry(struct kv_model *m, const struct kv_arch_tensor *e, int64_t layer,
                      const struct kv_tensor *t, const char *path, struct kv_err *err) {
    if (e->n_kinds == 1) return kv_model_bind(m, e->kinds[0], layer, t, path, err);
    int64_t rows[3], total, cols;
    int nd = kv_arch_entry_shape(&m->cfg, e, rows, &total, &cols);
    if (t->ndim != nd || t->shape[0] != total || (nd == 2 && t->shape[1] != cols)) {
        char got[96], exp[64];
        int64_t want[2] = {total, cols};
        kv_shape_str(got, sizeof got, t->shape, t->ndim);
        kv_shape_str(exp, sizeof exp, want, nd);
        return kv_fail(err, KV_EFORMAT, path, t->offset,
                       "tensor '%s' has shape %s but the config implies %s", t->name, got, exp);
    }
    uint64_t row_bytes = t->nbytes / (uint64_t)total;
    struct kv_tensor piece = *t;
    int64_t r0 = 0;
    for (int k = 0; k < e->n_kinds; r0 += rows[k], k++) {
        piece.shape[0] = rows[k];
        piece.data = (const uint8_t *)t->data + (uint64_t)r0 * row_bytes;
        piece.offset = t->offset + (uint64_t)r0 * row_bytes;
        piece.nbytes = (uint64_t)rows[k] * row_bytes;
        int rc = kv_model_bind(m, e->kinds[k], layer, &piece, path, err);
        if (rc) return rc;
    }
    return KV_OK;
}

/* Yarn as llama.cpp computes it for these architectures: rope.scaling.factor,
 * rope.scaling.original_context_length (else context_length), beta_fast 32
 * and beta_slow 1 with the correction range rounded to whole dimensions,
 * and cos, sin multiplied by rope.scaling.attn_factor (default 1) times
 * 1 + 0.1 ln factor. */
static int read_yarn(const struct kv_gguf_file *f, const char *ar, struct kv_config *cfg,
                     struct kv_err *err) {
    struct kv_rope_scaling_cfg *sc = &cfg->rope_scaling;
    float factor = 0, af = 1;
    uint32_t orig = 0;
    int rc;
    if ((rc = kv_gguf_get_f32(f, akey(ar, "rope.scaling.factor"), &factor, err))) return rc;
    if (kv_gguf_find(f, akey(ar, "rope.scaling.original_context_length")) &&
        (rc = kv_gguf_get_u32(f, akey(ar, "rope.scaling.original_context_length"), &orig, err)))
        return rc;
    if (kv_gguf_find(f, akey(ar, "rope.scaling.attn_factor")) &&
        (rc = kv_gguf_get_f32(f, akey(ar, "rope.scaling.attn_factor"), &af, err)))
        return rc;
    sc->type = KV_ROPE_SCALING_YARN, sc->factor = factor;
    sc->original_ctx = orig ? (int64_t)orig : cfg->max_seq_len;
    sc->beta_fast = 32, sc->beta_slow = 1, sc->truncate = 1;
    sc->attention_factor = (double)af * (factor > 1 ? 1 + 0.1 * log((double)factor) : 1.0);
    return KV_OK;
}

/* GGUF's rope scaling: rope.scaling.type none or linear with
 * rope.scaling.factor (or the older rope.scale_linear), and the per-pair
 * frequency divisors of a rope_freqs.weight tensor (Llama 3's scaling, as
 * llama.cpp's converter writes it). */
static int read_rope_scaling(const struct kv_gguf_file *f, const char *ar, struct kv_config *cfg,
                             struct kv_err *err) {
    struct kv_rope_scaling_cfg *sc = &cfg->rope_scaling;
    struct kv_gguf_str s;
    char sb[128];
    int rc;
    const struct kv_gguf_kv *rs = kv_gguf_find(f, akey(ar, "rope.scaling.type"));
    if (rs) {
        if ((rc = kv_gguf_get_str(f, akey(ar, "rope.scaling.type"), &s, err))) return rc;
        if (kv_gguf_str_eq(s, "linear")) {
            float v = 1;
            if ((rc = kv_gguf_get_f32(f, akey(ar, "rope.scaling.factor"), &v, err))) return rc;
            sc->type = KV_ROPE_SCALING_LINEAR, sc->factor = v;
        } else if (kv_gguf_str_eq(s, "yarn")) {
            if ((rc = read_yarn(f, ar, cfg, err))) return rc;
        } else if (!kv_gguf_str_eq(s, "none")) {
            return kv_fail(err, KV_EUNSUPPORTED, f->path, rs->val_off,
                           "rope scaling '%s' is not supported, expected none, linear or yarn",
                           kv_gguf_excerpt(s.p, s.len, sb, sizeof sb));
        }
    }
    const struct kv_gguf_kv *sl = kv_gguf_find(f, akey(ar, "rope.scale_linear"));
    if (sl) {
        float v;
        if ((rc = kv_gguf_get_f32(f, akey(ar, "rope.scale_linear"), &v, err))) return rc;
        if (v != 1.0f) {
            if (sc->type == KV_ROPE_SCALING_LINEAR && sc->factor != v)
                return kv_fail(err, KV_EFORMAT, f->path, sl->val_off,
                               "%s %g disagrees with %s %g", akey(ar, "rope.scale_linear"),
                               (double)v, akey(ar, "rope.scaling.factor"), sc->factor);
            sc->type = KV_ROPE_SCALING_LINEAR, sc->factor = v;
        }
    }
    const struct kv_gguf_tensor *rf = kv_gguf_find_tensor(f, "rope_freqs.weight");
    if (!rf) return KV_OK;
    int64_t half = cfg->head_dim / 2;
    if (sc->type != KV_ROPE_SCALING_NONE)
        return kv_fail(err, KV_EUNSUPPORTED, f->path, rf->info_off,
                       "tensor 'rope_freqs.weight' together with rope scaling '%s' is not supported",
                       kv_rope_scaling_name(sc->type));
    if ((rf->ggml_type != KV_GGML_F32 && rf->ggml_type != KV_GGML_F16) ||
        kv_tensor_numel(&rf->t) != half || half > KV_MAX_ROPE_FACTORS)
        return kv_fail(err, KV_EFORMAT, f->path, rf->info_off,
                       "tensor 'rope_freqs.weight' must hold %lld F32 or F16 values, one per "
                       "rotated pair, found %lld of type %s",
                       (long long)half, (long long)kv_tensor_numel(&rf->t),
                       kv_ggml_type_name(rf->ggml_type));
    kv_convert_to_f32(rf->t.dtype, rf->t.data, sc->short_factor, half);
    sc->type = KV_ROPE_SCALING_FREQS, sc->n_factors = half;
    return KV_OK; /* values checked by kv_model_create */
}

/* One of phi3's longrope factor tensors into out: n F32 or F16 values. */
static int read_factors(const struct kv_gguf_file *f, const char *name, int64_t n, float *out,
                        struct kv_err *err) {
    const struct kv_gguf_tensor *t = kv_gguf_find_tensor(f, name);
    if (!t)
        return kv_fail(err, KV_EFORMAT, f->path, KV_NO_OFFSET,
                       "missing tensor '%s' (phi3's longrope needs both factor tensors)", name);
    if ((t->ggml_type != KV_GGML_F32 && t->ggml_type != KV_GGML_F16) ||
        kv_tensor_numel(&t->t) != n || n > KV_MAX_ROPE_FACTORS)
        return kv_fail(err, KV_EFORMAT, f->path, t->info_off,
                       "tensor '%s' must hold %lld F32 or F16 values, one per rotated pair, "
                       "found %lld of type %s",
                       name, (long long)n, (long long)kv_tensor_numel(&t->t),
                       kv_ggml_type_name(t->ggml_type));
    kv_convert_to_f32(t->t.dtype, t->t.data, out, n);
    return KV_OK;
}

/* Phi-3's longrope as llama.cpp's converter stores it: the factor tensors
 * rope_factors_short.weight and rope_factors_long.weight, the trained
 * context phi3.rope.scaling.original_context_length, and cos and sin
 * multiplied by phi3.rope.scaling.attn_factor (else transformers' default
 * from factor = context_length / original). And its sliding window,
 * phi3.attention.sliding_window, in every layer. */
static int read_phi3(const struct kv_gguf_file *f, const char *ar, struct kv_config *cfg,
                     struct kv_err *err) {
    int rc;
    if (kv_gguf_find(f, akey(ar, "attention.sliding_window"))) {
        uint32_t w;
        if ((rc = kv_gguf_get_u32(f, akey(ar, "attention.sliding_window"), &w, err))) return rc;
        cfg->sliding_window = w, cfg->window_from = 0, cfg->window_period = w ? 1 : 0;
    }
    int has_s = kv_gguf_find_tensor(f, "rope_factors_short.weight") != NULL;
    int has_l = kv_gguf_find_tensor(f, "rope_factors_long.weight") != NULL;
    if (!has_s && !has_l) return KV_OK;
    struct kv_rope_scaling_cfg *sc = &cfg->rope_scaling;
    if (sc->type != KV_ROPE_SCALING_NONE)
        return kv_fail(err, KV_EUNSUPPORTED, f->path, KV_NO_OFFSET,
                       "phi3 longrope factor tensors together with rope scaling '%s' are not "
                       "supported",
                       kv_rope_scaling_name(sc->type));
    int64_t half = kv_rope_dim(cfg) / 2;
    uint32_t orig = 0;
    float af = 0;
    if ((rc = read_factors(f, "rope_factors_short.weight", half, sc->short_factor, err)) ||
        (rc = read_factors(f, "rope_factors_long.weight", half, sc->long_factor, err)) ||
        (rc = kv_gguf_get_u32(f, akey(ar, "rope.scaling.original_context_length"), &orig, err)))
        return rc;
    const struct kv_gguf_kv *ak = kv_gguf_find(f, akey(ar, "rope.scaling.attn_factor"));
    if (ak && (rc = kv_gguf_get_f32(f, akey(ar, "rope.scaling.attn_factor"), &af, err))) return rc;
    if (ak && !(af > 0 && isfinite(af)))
        return kv_fail(err, KV_EFORMAT, f->path, ak->val_off,
                       "%s is %g, expected a positive factor", akey(ar, "rope.scaling.attn_factor"),
                       (double)af);
    sc->type = KV_ROPE_SCALING_LONGROPE, sc->n_factors = half;
    sc->original_ctx = orig;
    sc->factor = orig ? (double)cfg->max_seq_len / (double)orig : 1.0;
    sc->attention_factor = af;
    return KV_OK; /* values checked by kv_model_create */
}

float kv_gguf_gemma2_attn_scale(const struct kv_config *c) {
    return (float)(1.0 / sqrt((double)(c->n_layers == 46 ? c->dim / c->n_heads : c->head_dim)));
}

/* Gemma 2 as llama.cpp's converter stores it: RMSNorm gains with the 1
 * already added (norm_offset 0), attention.sliding_window on every even
 * layer, the two soft-caps, and no key for the attention scale, which
 * llama.cpp derives: 1/sqrt(dim / heads) for the 27B model (46 layers),
 * 1/sqrt(key_length) otherwise. */
static int read_gemma2(const struct kv_gguf_file *f, const char *ar, struct kv_config *cfg,
                       struct kv_err *err) {
    int rc;
    cfg->norm_offset = 0;
    cfg->attn_scale = kv_gguf_gemma2_attn_scale(cfg);
    if (kv_gguf_find(f, akey(ar, "attention.sliding_window"))) {
        uint32_t w;
        if ((rc = kv_gguf_get_u32(f, akey(ar, "attention.sliding_window"), &w, err))) return rc;
        cfg->sliding_window = w, cfg->window_from = 0, cfg->window_period = w ? 2 : 0;
    }
    const char *caps[2] = {"attn_logit_softcapping", "final_logit_softcapping"};
    float *outs[2] = {&cfg->attn_softcap, &cfg->final_softcap};
    for (int i = 0; i < 2; i++) {
        const struct kv_gguf_kv *kv = kv_gguf_find(f, akey(ar, caps[i]));
        if (!kv) continue;
        if ((rc = kv_gguf_get_f32(f, akey(ar, caps[i]), outs[i], err))) return rc;
        if (!(*outs[i] >= 0 && isfinite(*outs[i])))
            return kv_fail(err, KV_EFORMAT, f->path, kv->val_off,
                           "%s is %g, expected a finite cap (0 for none)", akey(ar, caps[i]),
                           (double)*outs[i]);
    }
    return KV_OK;
}

static int read_config(const struct kv_gguf_file *f, struct kv_config *cfg, struct kv_err *err) {
    struct kv_gguf_str s;
    char sb[128];
    int rc = kv_gguf_get_str(f, "general.architecture", &s, err);
    if (rc) return rc;
    const struct kv_arch_desc *ad = NULL;
    for (int a = 0; !ad && kv_arch_valid(a); a++)
        if (kv_arch_desc(a)->gguf_arch && kv_gguf_str_eq(s, kv_arch_desc(a)->gguf_arch))
            ad = kv_arch_desc(a);
    if (!ad)
        return kv_fail(err, KV_EUNSUPPORTED, f->path, kv_gguf_find(f, "general.architecture")->val_off,
                       "architecture '%s' is not supported, expected %s",
                       kv_gguf_excerpt(s.p, s.len, sb, sizeof sb), kv_arch_gguf_list());
    const char *ar = ad->gguf_arch;
    memset(cfg, 0, sizeof *cfg);
    cfg->arch = ad->id;
    cfg->rope_layout = ad->gguf_rope_half ? KV_ROPE_HALF : KV_ROPE_INTERLEAVED;
    if ((rc = arch_dim(f, ar, "embedding_length", KV_MAX_DIM, 0, &cfg->dim, err)) ||
        (rc = arch_dim(f, ar, "feed_forward_length", KV_MAX_DIM, 0, &cfg->hidden_dim, err)) ||
        (rc = arch_dim(f, ar, "block_count", KV_MAX_LAYERS, 0, &cfg->n_layers, err)) ||
        (rc = arch_dim(f, ar, "attention.head_count", KV_MAX_DIM, 0, &cfg->n_heads, err)) ||
        (rc = arch_dim(f, ar, "attention.head_count_kv", KV_MAX_DIM, cfg->n_heads, &cfg->n_kv_heads,
                       err)) ||
        (rc = arch_dim(f, ar, "context_length", KV_MAX_CTX, 0, &cfg->max_seq_len, err)))
        return rc;
    const struct kv_gguf_kv *kl = kv_gguf_find(f, akey(ar, "attention.key_length"));
    if (kl) {
        if ((rc = arch_dim(f, ar, "attention.key_length", KV_MAX_DIM, 0, &cfg->head_dim, err)))
            return rc;
    } else {
        if (cfg->dim % cfg->n_heads)
            return kv_fail(err, KV_EFORMAT, f->path,
                           kv_gguf_find(f, akey(ar, "attention.head_count"))->val_off,
                           "%s %lld is not divisible by %s %lld", akey(ar, "embedding_length"),
                           (long long)cfg->dim, akey(ar, "attention.head_count"), (long long)cfg->n_heads);
        cfg->head_dim = cfg->dim / cfg->n_heads;
    }
    const struct kv_gguf_kv *vl = kv_gguf_find(f, akey(ar, "attention.value_length"));
    if (vl) {
        int64_t v;
        if ((rc = arch_dim(f, ar, "attention.value_length", KV_MAX_DIM, 0, &v, err))) return rc;
        if (v != cfg->head_dim)
            return kv_fail(err, KV_EUNSUPPORTED, f->path, vl->val_off,
                           "%s %lld differs from the key head size %lld",
                           akey(ar, "attention.value_length"), (long long)v, (long long)cfg->head_dim);
    }
    /* LayerNorm architectures (gptneox) say layer_norm_epsilon */
    if ((rc = kv_gguf_get_f32(f, akey(ar, ad->layernorm ? "attention.layer_norm_epsilon"
                                                         : "attention.layer_norm_rms_epsilon"),
                              &cfg->norm_eps, err)))
        return rc;
    if (ad->id == KV_ARCH_GPTNEOX) {
        /* llama.cpp runs gptneox with the tanh GELU (ggml_gelu), whatever the
         * HF model it came from used; parallel unless the file says not */
        cfg->parallel_residual = 1;
        if (kv_gguf_find(f, akey(ar, "use_parallel_residual")) &&
            (rc = kv_gguf_get_bool(f, akey(ar, "use_parallel_residual"), &cfg->parallel_residual,
                                   err)))
            return rc;
    }
    cfg->rope_theta = 10000.0f;
    if (kv_gguf_find(f, akey(ar, "rope.freq_base")) &&
        (rc = kv_gguf_get_f32(f, akey(ar, "rope.freq_base"), &cfg->rope_theta, err)))
        return rc;
    const struct kv_gguf_kv *rd = kv_gguf_find(f, akey(ar, "rope.dimension_count"));
    if (rd) {
        uint32_t v;
        if ((rc = kv_gguf_get_u32(f, akey(ar, "rope.dimension_count"), &v, err))) return rc;
        int partial = ad->id == KV_ARCH_GPTNEOX; /* the first v dimensions of each head */
        if (partial && (v < 2 || v % 2 || (int64_t)v > cfg->head_dim))
            return kv_fail(err, KV_EFORMAT, f->path, rd->val_off,
                           "%s %u must be even and within 2..%lld (the head size)",
                           akey(ar, "rope.dimension_count"), v, (long long)cfg->head_dim);
        if (partial)
            cfg->rope_dim = (int64_t)v < cfg->head_dim ? v : 0;
        else if ((int64_t)v != cfg->head_dim)
            return kv_fail(err, KV_EUNSUPPORTED, f->path, rd->val_off,
                           "%s %u differs from the head size %lld: "
                           "partial rotary embeddings are not supported",
                           akey(ar, "rope.dimension_count"), v, (long long)cfg->head_dim);
    }
    if ((rc = read_rope_scaling(f, ar, cfg, err))) return rc;
    if (ad->id == KV_ARCH_PHI3 && (rc = read_phi3(f, ar, cfg, err))) return rc;
    if (ad->id == KV_ARCH_GEMMA2 && (rc = read_gemma2(f, ar, cfg, err))) return rc;

    const struct kv_gguf_tensor *emb = kv_gguf_find_tensor(f, "token_embd.weight");
    if (!emb)
        return kv_fail(err, KV_EFORMAT, f->path, KV_NO_OFFSET, "missing tensor 'token_embd.weight'");
    if (kv_gguf_find(f, akey(ar, "vocab_size"))) {
        if ((rc = arch_dim(f, ar, "vocab_size", KV_MAX_VOCAB, 0, &cfg->vocab_size, err))) return rc;
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
        if (gt != KV_GGML_F32 && gt != KV_GGML_F16 && gt != KV_GGML_BF16 && !kv_ggml_can_dequant(gt))
            return kv_fail(err, KV_EUNSUPPORTED, f->path, ti->type_off,
                           "tensor '%s' has %stype %s; kvcal loads F32, F16, BF16 and "
                           KV_GGML_LOADABLE,
                           ti->t.name, kv_ggml_is_quantized(gt) ? "quantized " : "",
                           kv_ggml_type_name(gt));
        int64_t layer;
        if (!name_entry(&kv_arch_desc(cfg->arch)->gguf, ti->t.name, &layer)) {
            if (!strcmp(ti->t.name, "rope_freqs.weight")) continue; /* read_rope_scaling */
            if (cfg->arch == KV_ARCH_PHI3 && (!strcmp(ti->t.name, "rope_factors_short.weight") ||
                                              !strcmp(ti->t.name, "rope_factors_long.weight")))
                continue; /* read_phi3 */
            return kv_fail(err, KV_EUNSUPPORTED, f->path, ti->info_off,
                           "tensor '%s' is not part of the %s architecture kvcal implements",
                           ti->t.name, kv_arch_desc(cfg->arch)->gguf_arch);
        }
        if (layer >= cfg->n_layers)
            return kv_fail(err, KV_EFORMAT, f->path, ti->info_off,
                           "tensor '%s' names layer %lld but %s.block_count is %lld",
                           ti->t.name, (long long)layer, kv_arch_desc(cfg->arch)->gguf_arch,
                           (long long)cfg->n_layers);
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
        int64_t layer;
        const struct kv_arch_tensor *e = name_entry(nm, f->tensors[i].t.name, &layer);
        if (!e) continue; /* rope_freqs, rope_factors_* */
        if ((rc = bind_entry(m, e, layer < 0 ? 0 : layer, &f->tensors[i].t, path, err))) goto fail;
    }
    const struct kv_gguf_kv *tm = kv_gguf_find(f, "tokenizer.ggml.model");
    if (tm && tm->type == KV_GGUF_STRING &&
        (kv_gguf_str_eq(tm->str, "llama") || kv_gguf_str_eq(tm->str, "gpt2")) &&
        (rc = kv_gguf_build_tokenizer(f, &m->tok, err)))
        goto fail;
    if ((rc = kv_model_finish(m, path, err))) goto fail;
    *out = m;
    return KV_OK;
fail:
    kv_model_close(m);
    return rc;
}
