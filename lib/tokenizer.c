/* SentencePiece-style BPE tokenizer: builder, encoder and decoder.
 *
 * Encoding one segment of text (the bytes between literal tokens):
 *   1. Normalise it into a scratch buffer (dummy prefix, ' ' -> space_piece).
 *   2. Split it into UTF-8 characters. Each character becomes one symbol (its
 *      piece), or frozen symbols that never merge: one per byte, each the
 *      byte's <0xXX> token or, where the vocabulary lacks it, the unknown id.
 *   3. Symbols form a doubly linked list indexed by their byte offset in the
 *      normalised buffer, so a symbol's bytes are buf[i, i+len) and the
 *      concatenation of two neighbours is one contiguous span.
 *   4. A binary heap holds candidate merges keyed (priority, left offset), so
 *      the smallest key is the best pair and ties go leftmost. Entries go
 *      stale when either side changes. On pop, an entry is live iff its left
 *      symbol is alive and left+right still spans the recorded length: both
 *      sides only ever grow, so a changed pair never spans the same length
 *      twice.
 * Each merge pushes at most two entries, so n symbols cost O(n log n).
 *
 * Choices beyond the header:
 *   - Duplicate pieces: lookups by bytes return the lowest id, whatever its
 *     type; a character or merge result counts only if that id is NORMAL or
 *     USER.
 *   - Rank mode: a pair listed twice keeps its lowest rank. A merge whose
 *     result is not NORMAL/USER is never applied.
 *   - Scores: any score merges (no llama2.c -1e10 floor); NaN ranks below
 *     every number.
 *   - Byte tokens: a piece spelled "<0xHH>" (either hex case), or a BYTE piece
 *     of one byte, stands for that byte; the lowest such id per byte is used
 *     for fallback. A character without a piece falls back byte by byte; a
 *     byte without a token is the unknown id (so a 3-byte character in a
 *     vocabulary with no byte tokens gives three unknowns; HF's fuse_unk would
 *     give one). With neither, encoding fails (KV_EUNSUPPORTED) rather than
 *     dropping text.
 *   - Literals: matched in the raw text, longest first (lowest id among equal
 *     pieces). The dummy prefix goes only on a text segment that starts the
 *     input: "<s>hi" gets no prefix, "hi<s> yo" gives "▁hi", <s>, "▁yo".
 *   - Decode: byte tokens give their byte; CONTROL gives ""; UNKNOWN gives
 *     its raw piece; every other type gives its piece with space_piece turned
 *     into ' '. After prev == bos, one leading ' ' is dropped when the dummy
 *     prefix is on and the token is not a literal (literals never carry it).
 *     Decoding is per token, so a space_piece that fell back to byte tokens
 *     decodes to its bytes, not ' ' (SentencePiece vocabularies always hold
 *     the space piece).
 *   - Encoding with add_bos when there is no bos id fails with KV_EINVAL.
 *   - Merges resolve pieces to ids when added, so loaders set every piece
 *     before the first kv_tok_add_merge.
 */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "limits.h"
#include "pretok.h"

enum { TOKF_SET = 1, TOKF_LITERAL = 2 };

struct tok_slot {
    uint32_t tag; /* high hash bits, to skip most byte compares */
    int32_t id;   /* -1: empty */
};

struct tok_merge {
    int32_t a, b; /* a == -1: empty */
    int32_t rank, res;
};

struct tok_lit {
    int32_t id;
    uint32_t len;
    unsigned char first;
};

struct kv_tokenizer {
    enum kv_tok_mode mode;
    int32_t n_vocab;
    int32_t bos, eos, unk;
    int finished;

    /* Piece id i is arena[off[i], off[i]+len[i]). */
    char *arena;
    size_t arena_len, arena_cap;
    size_t *off;
    uint32_t *len;
    float *score;
    uint8_t *type;
    uint8_t *flags;   /* TOKF_* */
    int16_t *byteval; /* byte a token stands for, or -1 (built by finish) */

    /* Bytes -> lowest id; rebuilt lazily when pieces change. */
    struct tok_slot *slots;
    size_t slot_mask;
    int lookup_dirty;

    /* Rank mode: (a, b) -> (rank, result). */
    struct tok_merge *merges;
    size_t merge_mask, n_merges;

    int32_t byte_id[256];
    size_t max_piece; /* longest NORMAL/USER piece: longer spans never match */

    char *space;
    size_t space_len;
    int dummy;
    /* Where a stream may cut the text (built by finish): before a ' ' that
     * follows another character when cut_space (no mergeable piece holds
     * space_piece after a byte that does not end one), and before an ASCII
     * byte b with cut_byte[b] (its character has no mergeable piece, so its
     * symbol never merges). max_lit: the longest literal in bytes. */
    int cut_space;
    unsigned char cut_byte[128];
    size_t max_lit;

    /* Before finish: ids in call order. After: sorted by (first byte, length
     * descending, id), deduplicated, with [lit_begin[c], lit_begin[c+1])
     * the literals starting with byte c. */
    int32_t *lits;
    size_t n_lits, cap_lits;
    size_t lit_begin[257];
    uint8_t *litf; /* KV_LIT_* of each id added as a literal */
    /* Pipelines: the literals matched after normalization, by their content
     * normalized as a text of its own (as the tokenizers crate does), sorted
     * by (first byte, length descending, id); [nl_begin[c], nl_begin[c+1])
     * start with byte c. */
    struct tok_nlit {
        int32_t id;
        uint32_t len;
        char *s;
    } *nl;
    size_t n_nl, nl_begin[257];

    /* Hugging Face pipelines (kv_tok_set_pretok): normalizers and
     * pre-tokenizers run on each stretch between literals, and each piece is
     * merged on its own. byte_level: initial symbols are bytes (the pieces
     * are stored as raw bytes); else UTF-8 characters. */
    struct kv_pretok *pt;
    int byte_level, ignore_merges, fuse_unk, hf_unk;
    char *cprefix, *eow; /* continuing_subword_prefix, end_of_word_suffix */
    size_t cprefix_len, eow_len;
    int pipe_cut; /* a stream may cut before ' ' between two ASCII letters */
    size_t look;  /* bytes a cut decision reads past the cut */
    /* Decoding of pipeline tokenizers: replacements in order, then up to
     * dec_strip leading ' ' removed from the first token of a text. */
    struct {
        char *from, *to;
        size_t nf, nt;
    } dec[4];
    int n_dec, dec_strip;
    int add_bos, add_eos; /* the tokenizer's own policy */
};

/* ---------------------------------------------------------------- hashing */

static uint64_t mix64(uint64_t x) {
    x ^= x >> 31;
    x *= 0x7fb5d329728ea185ull;
    x ^= x >> 27;
    x *= 0x81dadef4bc2dd44dull;
    x ^= x >> 33;
    return x;
}

/* Word-at-a-time multiply/shift hash; only needs to agree with itself. */
static uint64_t hash_bytes(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t h = 0x243f6a8885a308d3ull ^ ((uint64_t)n * 0x13198a2e03707345ull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x9fb21c651e98df25ull;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    if (n) memcpy(&w, p, n);
    return mix64(h ^ w);
}

static int mergeable_type(int type) { return type == KV_TOKT_NORMAL || type == KV_TOKT_USER; }

static const char *piece_bytes(const struct kv_tokenizer *t, int32_t id) {
    return t->arena ? t->arena + t->off[id] : ""; /* no arena while every piece is empty */
}

static int32_t piece_find(const struct kv_tokenizer *t, const void *p, size_t n) {
    uint64_t h = hash_bytes(p, n);
    uint32_t tag = (uint32_t)(h >> 32);
    for (size_t i = (size_t)h & t->slot_mask;; i = (i + 1) & t->slot_mask) {
        const struct tok_slot *s = &t->slots[i];
        if (s->id < 0) return -1;
        if (s->tag == tag && t->len[s->id] == n && memcmp(piece_bytes(t, s->id), p, n) == 0)
            return s->id;
    }
}

/* Map every set piece to its lowest id (load factor <= 1/2). */
static int build_lookup(struct kv_tokenizer *t) {
    size_t cap = 16;
    while (cap < 2 * (size_t)t->n_vocab) cap <<= 1;
    struct tok_slot *slots = malloc(cap * sizeof *slots);
    if (!slots) return KV_ENOMEM;
    for (size_t i = 0; i < cap; i++) slots[i].id = -1;
    free(t->slots);
    t->slots = slots;
    t->slot_mask = cap - 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!(t->flags[id] & TOKF_SET) || t->len[id] == 0) continue;
        const char *p = piece_bytes(t, id);
        uint64_t h = hash_bytes(p, t->len[id]);
        uint32_t tag = (uint32_t)(h >> 32);
        for (size_t i = (size_t)h & t->slot_mask;; i = (i + 1) & t->slot_mask) {
            struct tok_slot *s = &slots[i];
            if (s->id < 0) {
                s->id = id;
                s->tag = tag;
                break;
            }
            if (s->tag == tag && t->len[s->id] == t->len[id] &&
                memcmp(piece_bytes(t, s->id), p, t->len[id]) == 0)
                break; /* a lower id already owns these bytes */
        }
    }
    t->lookup_dirty = 0;
    return KV_OK;
}

static size_t merge_slot(const struct tok_merge *tab, size_t mask, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = (size_t)mix64(key) & mask;
    while (tab[i].a >= 0 && !(tab[i].a == a && tab[i].b == b)) i = (i + 1) & mask;
    return i;
}

static const struct tok_merge *merge_find(const struct kv_tokenizer *t, int32_t a, int32_t b) {
    if (!t->merges) return NULL;
    const struct tok_merge *m = &t->merges[merge_slot(t->merges, t->merge_mask, a, b)];
    return m->a >= 0 ? m : NULL;
}

static int merge_grow(struct kv_tokenizer *t) {
    size_t cap = t->merges ? 2 * (t->merge_mask + 1) : 1024;
    struct tok_merge *tab = malloc(cap * sizeof *tab);
    if (!tab) return KV_ENOMEM;
    for (size_t i = 0; i < cap; i++) tab[i].a = -1;
    if (t->merges) {
        for (size_t i = 0; i <= t->merge_mask; i++) {
            if (t->merges[i].a < 0) continue;
            tab[merge_slot(tab, cap - 1, t->merges[i].a, t->merges[i].b)] = t->merges[i];
        }
    }
    free(t->merges);
    t->merges = tab;
    t->merge_mask = cap - 1;
    return KV_OK;
}

/* "<0xHH>" -> HH, else -1. */
static int parse_byte_piece(const char *p, size_t n) {
    if (n != 6 || p[0] != '<' || p[1] != '0' || p[2] != 'x' || p[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        int c = (unsigned char)p[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Quote a piece for a message: printable bytes and UTF-8 as-is, the rest as
 * \xHH, truncated to fit. */
static const char *quote_piece(char *buf, size_t cap, const char *p, size_t n) {
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    for (size_t i = 0; i < n && o + 8 < cap; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c < 0x20 || c == 0x7f || c == '\\' || c == '\'') {
            buf[o++] = '\\';
            buf[o++] = 'x';
            buf[o++] = hex[c >> 4];
            buf[o++] = hex[c & 15];
        } else {
            buf[o++] = (char)c;
        }
        if (i + 1 < n && o + 8 >= cap) {
            memcpy(buf + o, "...", 3);
            o += 3;
        }
    }
    buf[o] = 0;
    return buf;
}

/* ---------------------------------------------------------------- builder */

void kv_tok_free(struct kv_tokenizer *tok) {
    if (!tok) return;
    free(tok->arena);
    free(tok->off);
    free(tok->len);
    free(tok->score);
    free(tok->type);
    free(tok->flags);
    free(tok->byteval);
    free(tok->slots);
    free(tok->merges);
    free(tok->space);
    free(tok->lits);
    free(tok->litf);
    for (size_t i = 0; i < tok->n_nl; i++) free(tok->nl[i].s);
    free(tok->nl);
    kv_pretok_free(tok->pt);
    free(tok->cprefix);
    free(tok->eow);
    for (int i = 0; i < tok->n_dec; i++) {
        free(tok->dec[i].from);
        free(tok->dec[i].to);
    }
    free(tok);
}

int kv_tok_init(enum kv_tok_mode mode, int32_t n_vocab, struct kv_tokenizer **out,
                struct kv_err *err) {
    KV_ASSERT(out);
    KV_ASSERT(mode == KV_TOK_SCORE || mode == KV_TOK_RANK);
    *out = NULL;
    if (n_vocab <= 0 || n_vocab > KV_MAX_VOCAB)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "vocabulary size %d is outside 1..%d", (int)n_vocab, KV_MAX_VOCAB);
    struct kv_tokenizer *t = calloc(1, sizeof *t);
    if (!t) goto oom;
    *t = (struct kv_tokenizer){.mode = mode, .n_vocab = n_vocab, .bos = -1, .eos = -1,
                               .unk = 0, .dummy = 1, .lookup_dirty = 1, .add_bos = 1};
    size_t n = (size_t)n_vocab;
    t->off = calloc(n, sizeof *t->off);
    t->len = calloc(n, sizeof *t->len);
    t->score = calloc(n, sizeof *t->score);
    t->type = calloc(n, sizeof *t->type);
    t->flags = calloc(n, sizeof *t->flags);
    t->litf = calloc(n, sizeof *t->litf);
    t->space = malloc(1);
    if (!t->off || !t->len || !t->score || !t->type || !t->flags || !t->litf || !t->space)
        goto oom;
    t->space[0] = ' ';
    t->space_len = 1;
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    *out = t;
    return KV_OK;
oom:
    kv_tok_free(t);
    return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                   "out of memory allocating a tokenizer of %d pieces", (int)n_vocab);
}

int kv_tok_set_piece(struct kv_tokenizer *tok, int32_t id, const char *piece, size_t len,
                     float score, int type, struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished);
    KV_ASSERT(piece || len == 0);
    if (id < 0 || id >= tok->n_vocab)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "token id %d is outside the vocabulary of %d", (int)id,
                       (int)tok->n_vocab);
    if (len > KV_MAX_PIECE)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "token %d: piece is %zu bytes but the limit is %d", (int)id, len,
                       KV_MAX_PIECE);
    if (tok->arena_cap - tok->arena_len < len) {
        size_t cap = tok->arena_cap ? tok->arena_cap : 4096;
        while (cap - tok->arena_len < len) cap *= 2;
        char *a = realloc(tok->arena, cap);
        if (!a)
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                           "out of memory storing %zu bytes of vocabulary pieces", cap);
        tok->arena = a;
        tok->arena_cap = cap;
    }
    if (len) memcpy(tok->arena + tok->arena_len, piece, len);
    tok->off[id] = tok->arena_len;
    tok->len[id] = (uint32_t)len;
    tok->arena_len += len;
    tok->score[id] = score;
    tok->type[id] = (uint8_t)(type >= KV_TOKT_NORMAL && type <= KV_TOKT_BYTE ? type
                                                                             : KV_TOKT_NORMAL);
    tok->flags[id] |= TOKF_SET;
    tok->lookup_dirty = 1;
    return KV_OK;
}

int kv_tok_add_merge(struct kv_tokenizer *tok, const char *a, size_t alen, const char *b,
                     size_t blen, int32_t rank, const char *path, struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished && tok->mode == KV_TOK_RANK);
    KV_ASSERT((a || alen == 0) && (b || blen == 0));
    if (tok->lookup_dirty && build_lookup(tok) != KV_OK)
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET,
                       "out of memory indexing %d vocabulary pieces", (int)tok->n_vocab);
    char qa[128], qb[128], qab[256];
    int32_t ia = piece_find(tok, a, alen), ib = piece_find(tok, b, blen);
    if (ia < 0 || ib < 0) {
        const char *miss = ia < 0 ? a : b;
        size_t mlen = ia < 0 ? alen : blen;
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "merge rank %d '%s' + '%s': piece '%s' is not in the vocabulary",
                       (int)rank, quote_piece(qa, sizeof qa, a, alen),
                       quote_piece(qb, sizeof qb, b, blen),
                       quote_piece(qab, sizeof qab, miss, mlen));
    }
    int32_t res = -1;
    if (tok->cprefix_len && blen >= tok->cprefix_len &&
        memcmp(b, tok->cprefix, tok->cprefix_len) == 0) {
        b += tok->cprefix_len; /* a + b without b's prefix, as the merge's result */
        blen -= tok->cprefix_len;
    }
    if (alen + blen <= KV_MAX_PIECE) {
        char cat[2 * KV_MAX_PIECE];
        memcpy(cat, a, alen);
        memcpy(cat + alen, b, blen);
        res = piece_find(tok, cat, alen + blen);
    }
    if (res < 0) {
        char cat[256];
        size_t n = 0;
        for (size_t i = 0; i < alen && n < sizeof cat; i++) cat[n++] = a[i];
        for (size_t i = 0; i < blen && n < sizeof cat; i++) cat[n++] = b[i];
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "merge rank %d '%s' + '%s': merged piece '%s' is not in the vocabulary",
                       (int)rank, quote_piece(qa, sizeof qa, a, alen),
                       quote_piece(qb, sizeof qb, b, blen), quote_piece(qab, sizeof qab, cat, n));
    }
    if (!tok->merges || 2 * (tok->n_merges + 1) > tok->merge_mask + 1) {
        if (merge_grow(tok) != KV_OK)
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET,
                           "out of memory storing %zu merges", tok->n_merges + 1);
    }
    struct tok_merge *m = &tok->merges[merge_slot(tok->merges, tok->merge_mask, ia, ib)];
    if (m->a < 0) {
        *m = (struct tok_merge){.a = ia, .b = ib, .rank = rank, .res = res};
        tok->n_merges++;
    } else if (rank < m->rank) {
        m->rank = rank;
        m->res = res;
    }
    return KV_OK;
}

void kv_tok_set_special(struct kv_tokenizer *tok, int32_t bos, int32_t eos, int32_t unk) {
    KV_ASSERT(tok && !tok->finished);
    tok->bos = bos < 0 ? -1 : bos;
    tok->eos = eos < 0 ? -1 : eos;
    tok->unk = unk < 0 ? -1 : unk;
}

int kv_tok_set_normalizer(struct kv_tokenizer *tok, const char *space_piece,
                          int add_dummy_prefix, struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished && space_piece);
    size_t n = strlen(space_piece);
    if (n == 0 || n > KV_MAX_PIECE)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "space piece is %zu bytes but must be 1..%d", n, KV_MAX_PIECE);
    char *s = malloc(n);
    if (!s) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    memcpy(s, space_piece, n);
    free(tok->space);
    tok->space = s;
    tok->space_len = n;
    tok->dummy = add_dummy_prefix != 0;
    return KV_OK;
}

int kv_tok_add_literal(struct kv_tokenizer *tok, int32_t id, struct kv_err *err) {
    return kv_tok_add_literal_flags(tok, id, KV_LIT_SPECIAL, err);
}

int kv_tok_add_literal_flags(struct kv_tokenizer *tok, int32_t id, unsigned flags,
                             struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished);
    if (id < 0 || id >= tok->n_vocab)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "literal token id %d is outside the vocabulary of %d", (int)id,
                       (int)tok->n_vocab);
    if (tok->n_lits == tok->cap_lits) {
        size_t cap = tok->cap_lits ? 2 * tok->cap_lits : 16;
        int32_t *l = realloc(tok->lits, cap * sizeof *l);
        if (!l)
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                           "out of memory storing %zu literal tokens", cap);
        tok->lits = l;
        tok->cap_lits = cap;
    }
    tok->lits[tok->n_lits++] = id;
    tok->litf[id] = (uint8_t)flags;
    return KV_OK;
}

int kv_tok_set_pretok(struct kv_tokenizer *tok, struct kv_pretok *pt, int byte_level,
                      struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished && pt);
    kv_pretok_free(tok->pt);
    tok->pt = pt;
    tok->byte_level = byte_level != 0;
    tok->dummy = 0;
    return KV_OK;
}

void kv_tok_set_model_options(struct kv_tokenizer *tok, int ignore_merges, int fuse_unk) {
    KV_ASSERT(tok && !tok->finished);
    tok->ignore_merges = ignore_merges != 0;
    tok->fuse_unk = fuse_unk != 0;
    tok->hf_unk = 1;
}

static int set_bytes(char **dst, size_t *dlen, const char *s, size_t n) {
    free(*dst);
    *dst = NULL;
    *dlen = 0;
    if (!n) return KV_OK;
    if (!(*dst = malloc(n))) return KV_ENOMEM;
    memcpy(*dst, s, n);
    *dlen = n;
    return KV_OK;
}

int kv_tok_set_affixes(struct kv_tokenizer *tok, const char *prefix, const char *suffix,
                       struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished);
    size_t pn = prefix ? strlen(prefix) : 0, sn = suffix ? strlen(suffix) : 0;
    if (pn > 64 || sn > 64)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "a subword prefix or word suffix is limited to 64 bytes");
    if (set_bytes(&tok->cprefix, &tok->cprefix_len, prefix, pn) ||
        set_bytes(&tok->eow, &tok->eow_len, suffix, sn))
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    return KV_OK;
}

int kv_tok_add_decoder_replace(struct kv_tokenizer *tok, const char *from, size_t nf,
                               const char *to, size_t nt, struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished);
    if (tok->n_dec == (int)(sizeof tok->dec / sizeof tok->dec[0]))
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "more than %d replacing decoders", tok->n_dec);
    if (nf == 0 || nf > 64 || nt > 64)
        return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                       "a replacing decoder's pattern must be 1..64 bytes and its content at "
                       "most 64");
    int i = tok->n_dec;
    tok->dec[i].from = tok->dec[i].to = NULL;
    if (set_bytes(&tok->dec[i].from, &tok->dec[i].nf, from, nf) ||
        set_bytes(&tok->dec[i].to, &tok->dec[i].nt, to, nt)) {
        free(tok->dec[i].from);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    tok->n_dec++;
    return KV_OK;
}

void kv_tok_set_decoder_strip(struct kv_tokenizer *tok, int n) {
    KV_ASSERT(tok && !tok->finished);
    tok->dec_strip = n < 0 ? 0 : n;
}

void kv_tok_set_policy(struct kv_tokenizer *tok, int add_bos, int add_eos) {
    KV_ASSERT(tok && !tok->finished);
    tok->add_bos = add_bos != 0;
    tok->add_eos = add_eos != 0;
}

static int lit_cmp(const void *pa, const void *pb) {
    const struct tok_lit *a = pa, *b = pb;
    if (a->first != b->first) return a->first < b->first ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

static int build_literals(struct kv_tokenizer *t) {
    struct tok_lit *v = malloc((t->n_lits ? t->n_lits : 1) * sizeof *v);
    if (!v) return KV_ENOMEM;
    size_t n = 0;
    for (size_t i = 0; i < t->n_lits; i++) {
        int32_t id = t->lits[i];
        t->flags[id] |= TOKF_LITERAL;
        if (t->len[id] == 0) continue; /* the empty piece can never match */
        v[n++] = (struct tok_lit){id, t->len[id], (unsigned char)piece_bytes(t, id)[0]};
    }
    qsort(v, n, sizeof *v, lit_cmp);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (k == 0 || v[i].id != t->lits[k - 1]) t->lits[k++] = v[i].id;
    t->n_lits = k;
    size_t j = 0;
    for (int c = 0; c < 256; c++) {
        t->lit_begin[c] = j;
        while (j < k && (unsigned char)piece_bytes(t, t->lits[j])[0] == c) j++;
    }
    t->lit_begin[256] = k;
    free(v);
    return KV_OK;
}

static int nlit_cmp(const void *pa, const void *pb) {
    const struct tok_nlit *a = pa, *b = pb;
    unsigned char ca = (unsigned char)a->s[0], cb = (unsigned char)b->s[0];
    if (ca != cb) return ca < cb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

/* The normalized contents of a pipeline's normalized literals. */
static int build_nlits(struct kv_tokenizer *t) {
    size_t n = 0;
    for (size_t i = 0; i < t->n_lits; i++) n += (t->litf[t->lits[i]] & KV_LIT_NORMALIZED) != 0;
    t->nl = calloc(n ? n : 1, sizeof *t->nl);
    if (!t->nl) return KV_ENOMEM;
    struct kv_pt_buf b = {0};
    for (size_t i = 0; i < t->n_lits; i++) {
        int32_t id = t->lits[i];
        if (!(t->litf[id] & KV_LIT_NORMALIZED)) continue;
        if (kv_pretok_normalize(t->pt, piece_bytes(t, id), t->len[id],
                                KV_PT_START | KV_PT_END | KV_PT_INPUT, &b, NULL)) {
            kv_pt_buf_free(&b);
            return KV_ENOMEM;
        }
        if (!b.len) continue; /* normalized away: it can never match */
        struct tok_nlit *e = &t->nl[t->n_nl];
        if (!(e->s = malloc(b.len))) {
            kv_pt_buf_free(&b);
            return KV_ENOMEM;
        }
        memcpy(e->s, b.buf, b.len);
        e->len = (uint32_t)b.len;
        e->id = id;
        t->n_nl++;
        if (b.len > t->max_lit) t->max_lit = b.len;
    }
    kv_pt_buf_free(&b);
    qsort(t->nl, t->n_nl, sizeof *t->nl, nlit_cmp);
    size_t j = 0;
    for (int c = 0; c < 256; c++) {
        t->nl_begin[c] = j;
        while (j < t->n_nl && (unsigned char)t->nl[j].s[0] == c) j++;
    }
    t->nl_begin[256] = t->n_nl;
    return KV_OK;
}

/* Normalize and pre-tokenize s[0, n) (no literals) into out. */
static int probe_pieces(const struct kv_tokenizer *t, const char *s, size_t n, unsigned where,
                        struct kv_pt_buf *out) {
    struct kv_pt_buf norm = {0};
    int rc = kv_pretok_normalize(t->pt, s, n, where, &norm, NULL);
    if (!rc) rc = kv_pretok_pieces(t->pt, norm.buf, norm.len, where, out, NULL);
    kv_pt_buf_free(&norm);
    return rc;
}

/* Whether a pipeline splits where a stream would cut (before a ' ' between
 * ASCII letters or digits): on sample phrases, the pieces of the whole
 * equal the pieces of the two sides, each side taken as a stream's slice. */
static int probe_cut(const struct kv_tokenizer *t) {
    static const char *const probes[] = {"ab cd",     "Hello world", "x y",     "it's me",
                                         "a1 b",      "A B C",       "END Tail", "to be or"};
    struct kv_pt_buf whole = {0}, l = {0}, r = {0};
    int ok = 1;
    for (size_t i = 0; ok && i < sizeof probes / sizeof probes[0]; i++) {
        const char *s = probes[i];
        size_t n = strlen(s);
        for (size_t c = 1; ok && c + 1 < n; c++) {
            if (s[c] != ' ') continue;
            ok = !probe_pieces(t, s, n, KV_PT_START | KV_PT_END | KV_PT_INPUT, &whole) &&
                 !probe_pieces(t, s, c, KV_PT_START | KV_PT_INPUT, &l) &&
                 !probe_pieces(t, s + c, n - c, KV_PT_END, &r) && whole.n == l.n + r.n &&
                 whole.len == l.len + r.len && memcmp(whole.buf, l.buf, l.len) == 0 &&
                 memcmp(whole.buf + l.len, r.buf, r.len) == 0;
            for (size_t k = 0; ok && k < whole.n; k++)
                ok = whole.ends[k] == (k < l.n ? l.ends[k] : l.len + r.ends[k - l.n]);
        }
    }
    kv_pt_buf_free(&whole);
    kv_pt_buf_free(&l);
    kv_pt_buf_free(&r);
    return ok;
}

int kv_tok_finish(struct kv_tokenizer *tok, const char *path, struct kv_err *err) {
    KV_ASSERT(tok && !tok->finished);
    for (int32_t id = 0; id < tok->n_vocab; id++)
        if (!(tok->flags[id] & TOKF_SET))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "token id %d has no piece (vocabulary has %d ids)", (int)id,
                           (int)tok->n_vocab);
    const struct {
        const char *name;
        int32_t id;
    } special[] = {{"bos", tok->bos}, {"eos", tok->eos}, {"unknown", tok->unk}};
    for (int i = 0; i < 3; i++)
        if (special[i].id >= tok->n_vocab)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "%s token id %d is outside the vocabulary of %d", special[i].name,
                           (int)special[i].id, (int)tok->n_vocab);
    if (tok->lookup_dirty && build_lookup(tok) != KV_OK) goto oom;
    tok->byteval = malloc((size_t)tok->n_vocab * sizeof *tok->byteval);
    if (!tok->byteval) goto oom;
    if (build_literals(tok) != KV_OK) goto oom;
    tok->max_piece = 0;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        const char *p = piece_bytes(tok, id);
        int b = parse_byte_piece(p, tok->len[id]);
        if (b < 0 && tok->type[id] == KV_TOKT_BYTE && tok->len[id] == 1) b = (unsigned char)p[0];
        tok->byteval[id] = (int16_t)b;
        if (b >= 0 && tok->byte_id[b] < 0) tok->byte_id[b] = id;
        if (mergeable_type(tok->type[id]) && tok->len[id] > tok->max_piece)
            tok->max_piece = tok->len[id];
    }
    tok->cut_space = 1;
    for (int32_t id = 0; id < tok->n_vocab && tok->cut_space; id++) {
        const char *p = piece_bytes(tok, id);
        size_t n = tok->len[id], sl = tok->space_len;
        if (!mergeable_type(tok->type[id])) continue;
        for (size_t k = 1; k + sl <= n && tok->cut_space; k++)
            if (memcmp(p + k, tok->space, sl) == 0 &&
                !(k >= sl && memcmp(p + k - sl, tok->space, sl) == 0))
                tok->cut_space = 0;
    }
    for (int b = 0; b < 128; b++) {
        char c = (char)b;
        int32_t id = piece_find(tok, &c, 1);
        tok->cut_byte[b] = b != ' ' && (id < 0 || !mergeable_type(tok->type[id]));
        /* with fuse_unk an unknown character joins the unknown before it */
        if (tok->hf_unk && tok->fuse_unk && tok->byte_id[b] < 0) tok->cut_byte[b] = 0;
    }
    tok->max_lit = 0;
    for (size_t i = 0; i < tok->n_lits; i++)
        if (tok->len[tok->lits[i]] > tok->max_lit) tok->max_lit = tok->len[tok->lits[i]];
    if (tok->pt && build_nlits(tok) != KV_OK) goto oom;
    tok->look = tok->max_lit > 2 ? tok->max_lit : 2;
    tok->pipe_cut = tok->pt && probe_cut(tok);
    tok->finished = 1;
    return KV_OK;
oom:
    return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET,
                   "out of memory building lookup tables for %d pieces", (int)tok->n_vocab);
}

const char *kv_tok_piece(const struct kv_tokenizer *tok, int32_t id, size_t *len) {
    KV_ASSERT(tok);
    if (id < 0 || id >= tok->n_vocab || !(tok->flags[id] & TOKF_SET)) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = tok->len[id];
    return piece_bytes(tok, id);
}

float kv_tok_score(const struct kv_tokenizer *tok, int32_t id) {
    KV_ASSERT(tok);
    return id >= 0 && id < tok->n_vocab ? tok->score[id] : 0.0f;
}

int kv_tok_type(const struct kv_tokenizer *tok, int32_t id) {
    KV_ASSERT(tok);
    return id >= 0 && id < tok->n_vocab ? tok->type[id] : 0;
}

enum kv_tok_mode kv_tok_mode(const struct kv_tokenizer *tok) {
    KV_ASSERT(tok);
    return tok->mode;
}

int32_t kv_tok_n_vocab(const struct kv_tokenizer *tok) {
    KV_ASSERT(tok);
    return tok->n_vocab;
}

int32_t kv_tok_bos(const struct kv_tokenizer *tok) {
    KV_ASSERT(tok);
    return tok->bos;
}

int32_t kv_tok_eos(const struct kv_tokenizer *tok) {
    KV_ASSERT(tok);
    return tok->eos;
}

/* ---------------------------------------------------------------- encode */

/* Symbol at byte offset i of the normalised segment; len == 0 for offsets
 * that start no symbol (inside one, or absorbed by a merge). */
struct tok_sym {
    int64_t prev, next; /* -1 at the ends */
    int32_t id;
    unsigned len : 31;
    unsigned frozen : 1; /* byte fallback or unknown: never merges */
};

struct tok_cand {
    uint32_t key; /* smaller merges first */
    int32_t id;   /* token the merge produces */
    uint32_t len; /* bytes of left+right when pushed */
    int64_t left;
};

struct tok_work {
    unsigned char *buf;
    struct tok_sym *sym;
    struct tok_cand *heap;
    size_t n_heap, cap_heap;
};

/* Higher score -> smaller key, in float order; -0 == +0, NaN last. */
static uint32_t score_key(float s) {
    if (s != s) return UINT32_MAX;
    if (s == 0) s = 0;
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}

static uint32_t rank_key(int32_t rank) { return (uint32_t)rank ^ 0x80000000u; }

static int cand_before(const struct tok_cand *a, const struct tok_cand *b) {
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

static int heap_push(struct tok_work *w, struct tok_cand c) {
    if (w->n_heap == w->cap_heap) {
        size_t cap = w->cap_heap ? 2 * w->cap_heap : 256;
        struct tok_cand *h = realloc(w->heap, cap * sizeof *h);
        if (!h) return KV_ENOMEM;
        w->heap = h;
        w->cap_heap = cap;
    }
    struct tok_cand *h = w->heap;
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_before(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
    return KV_OK;
}

static struct tok_cand heap_pop(struct tok_work *w) {
    KV_ASSERT(w->n_heap > 0);
    struct tok_cand *h = w->heap;
    struct tok_cand top = h[0], last = h[--w->n_heap];
    size_t n = w->n_heap, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && cand_before(&h[c + 1], &h[c])) c++;
        if (!cand_before(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (n) h[i] = last;
    return top;
}

/* Push the pair (l, l.next) if it can merge. */
static int push_pair(const struct kv_tokenizer *t, struct tok_work *w, int64_t l) {
    const struct tok_sym *sym = w->sym;
    int64_t r = sym[l].next;
    if (r < 0 || sym[l].frozen || sym[r].frozen) return KV_OK;
    size_t n = (size_t)sym[l].len + sym[r].len;
    struct tok_cand c = {.len = (uint32_t)n, .left = l};
    if (t->mode == KV_TOK_SCORE) {
        if (n > t->max_piece) return KV_OK;
        int32_t id = piece_find(t, w->buf + l, n);
        if (id < 0 || !mergeable_type(t->type[id])) return KV_OK;
        c.id = id;
        c.key = score_key(t->score[id]);
    } else {
        const struct tok_merge *m = merge_find(t, sym[l].id, sym[r].id);
        if (!m || !mergeable_type(t->type[m->res])) return KV_OK;
        c.id = m->res;
        c.key = rank_key(m->rank);
    }
    return heap_push(w, c);
}

/* Length of the UTF-8 character at s (n bytes left); 1 for a malformed byte.
 * Overlong forms, surrogates and code points above U+10FFFF are malformed. */
static size_t utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0], lo = 0x80, hi = 0xbf;
    size_t need;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        need = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        need = 3;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 4;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
    } else {
        return 1;
    }
    if (n < need || s[1] < lo || s[1] > hi) return 1;
    for (size_t i = 2; i < need; i++)
        if (s[i] < 0x80 || s[i] > 0xbf) return 1;
    return need;
}

/* Merge the symbols linked from offset 0 until no pair merges. */
static int run_merges(const struct kv_tokenizer *t, struct tok_work *w) {
    struct tok_sym *sym = w->sym;
    w->n_heap = 0;
    for (int64_t l = 0; l >= 0; l = sym[l].next)
        if (push_pair(t, w, l) != KV_OK) return KV_ENOMEM;
    while (w->n_heap) {
        struct tok_cand c = heap_pop(w);
        int64_t l = c.left, r = sym[l].next;
        if (sym[l].len == 0 || r < 0 || (size_t)sym[l].len + sym[r].len != c.len) continue;
        sym[l].len = c.len;
        sym[l].id = c.id;
        sym[l].next = sym[r].next;
        if (sym[r].next >= 0) sym[sym[r].next].prev = l;
        sym[r].len = 0;
        if (sym[l].prev >= 0 && push_pair(t, w, sym[l].prev) != KV_OK) return KV_ENOMEM;
        if (push_pair(t, w, l) != KV_OK) return KV_ENOMEM;
    }
    return KV_OK;
}

/* Encode src[0, n) as one segment, appending ids to out[*n_out...]. */
static int encode_segment(const struct kv_tokenizer *t, struct tok_work *w, const char *src,
                          size_t n, int prefix, int32_t *out, int64_t *n_out,
                          struct kv_err *err) {
    unsigned char *buf = w->buf;
    size_t m = 0;
    if (prefix) {
        memcpy(buf, t->space, t->space_len);
        m = t->space_len;
    }
    for (size_t i = 0; i < n; i++) {
        if (src[i] == ' ') {
            memcpy(buf + m, t->space, t->space_len);
            m += t->space_len;
        } else {
            buf[m++] = (unsigned char)src[i];
        }
    }
    if (m == 0) return KV_OK;

    struct tok_sym *sym = w->sym;
    int64_t last = -1;
    int last_unk = 0;
    for (size_t i = 0; i < m;) {
        size_t cl = utf8_len(buf + i, m - i);
        int32_t id = piece_find(t, buf + i, cl);
        int frozen = id < 0 || !mergeable_type(t->type[id]);
        if (frozen && t->hf_unk) {
            /* the tokenizers crate: all byte tokens, else one unknown for
             * the character, fused with the one before under fuse_unk */
            int all = 1;
            for (size_t k = 0; k < cl; k++) all &= t->byte_id[buf[i + k]] >= 0;
            if (!all) {
                if (t->unk < 0) {
                    char q[64];
                    return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                                   "character '%s' has no piece, no byte token and there is no "
                                   "unknown token",
                                   quote_piece(q, sizeof q, (const char *)buf + i, cl));
                }
                if (last_unk && t->fuse_unk) {
                    sym[last].len += (unsigned)cl;
                } else {
                    int64_t at = (int64_t)i;
                    sym[at] = (struct tok_sym){.prev = last, .next = -1, .id = t->unk,
                                               .len = (unsigned)cl, .frozen = 1};
                    if (last >= 0) sym[last].next = at;
                    last = at;
                }
                last_unk = 1;
                i += cl;
                continue;
            }
        }
        last_unk = 0;
        /* A character without a mergeable piece falls back byte by byte: each
         * byte becomes its <0xXX> token, or the unknown id when the vocabulary
         * lacks that byte token (one unknown per byte, as the reference
         * perplexities of vocabularies without byte tokens assume). */
        size_t nsym = frozen ? cl : 1;
        for (size_t k = 0; k < nsym; k++) {
            int32_t sid = frozen ? t->byte_id[buf[i + k]] : id;
            if (frozen && sid < 0) sid = t->unk;
            if (sid < 0) {
                char q[64];
                return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                               "character '%s' has no piece, no byte token and there is no "
                               "unknown token",
                               quote_piece(q, sizeof q, (const char *)buf + i, cl));
            }
            int64_t at = (int64_t)(i + k);
            sym[at].prev = last;
            sym[at].next = -1;
            sym[at].frozen = (unsigned)frozen;
            sym[at].id = sid;
            sym[at].len = frozen ? 1u : (unsigned)cl;
            if (last >= 0) sym[last].next = at;
            last = at;
        }
        i += cl;
    }
    if (run_merges(t, w) != KV_OK)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory merging a text segment of %zu bytes", m);
    for (int64_t l = 0; l >= 0; l = sym[l].next) out[(*n_out)++] = sym[l].id;
    return KV_OK;
}

/* ---------------------------------------------------------------- literals */

/* A "word" character for single_word literals: an ASCII letter, digit or
 * '_', or any byte of a non-ASCII character. */
static int word_byte(unsigned char c) {
    return c >= 0x80 || c == '_' || (c >= '0' && c <= '9') || ((c | 32) >= 'a' && (c | 32) <= 'z');
}

static int space_byte(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* The literal matched at text[pos, len): the longest one there, or -1.
 * kind: 0 any literal (the literal scan of streams), 1 those matched in raw
 * text, 3 the same where pos starts the input, 2 those matched after
 * normalization (pipelines only, by normalized content). Specials are
 * matched only with parse; one skipped that way has its length in
 * *skip_len, so the caller can count it and step over it. A match's length
 * is *match_len. */
/* Whether literal id, whose text matched text[pos, pos + n), counts there:
 * a single_word one needs no word character beside it; a special one
 * counts only with parse (else *skip_len takes the first such length). */
static int lit_takes(const struct kv_tokenizer *t, int32_t id, const char *text, size_t pos,
                     size_t n, size_t len, int parse, size_t *skip_len) {
    unsigned f = t->litf[id];
    if ((f & KV_LIT_SINGLE_WORD) &&
        ((pos > 0 && word_byte((unsigned char)text[pos - 1])) ||
         (pos + n < len && word_byte((unsigned char)text[pos + n]))))
        return 0;
    if ((f & KV_LIT_SPECIAL) && !parse) {
        if (!*skip_len) *skip_len = n;
        return 0;
    }
    return 1;
}

static int32_t lit_at(const struct kv_tokenizer *t, const char *text, size_t pos, size_t len,
                      int kind, int parse, size_t *skip_len, size_t *match_len) {
    unsigned char c = (unsigned char)text[pos];
    *skip_len = 0;
    if (kind == 2) {
        for (size_t k = t->nl_begin[c]; k < t->nl_begin[c + 1]; k++) {
            const struct tok_nlit *e = &t->nl[k];
            if (e->len > len - pos || memcmp(e->s, text + pos, e->len) != 0 ||
                !lit_takes(t, e->id, text, pos, e->len, len, parse, skip_len))
                continue;
            *match_len = e->len;
            return e->id;
        }
        return -1;
    }
    for (size_t k = t->lit_begin[c]; k < t->lit_begin[c + 1]; k++) {
        int32_t id = t->lits[k];
        size_t n = t->len[id];
        unsigned f = t->litf[id];
        if (kind && t->pt && (f & KV_LIT_NORMALIZED)) continue;
        if (n > len - pos || memcmp(piece_bytes(t, id), text + pos, n) != 0) continue;
        /* a SentencePiece form's normalized literal is "▁" + content: it
         * takes the ' ' before it, or the dummy prefix at the input's start
         * (kind 3) */
        if (kind && !t->pt && t->dummy && (f & KV_LIT_NORMALIZED) &&
            !(pos > 0 && text[pos - 1] == ' ') && !(pos == 0 && kind == 3))
            continue;
        if (kind && !lit_takes(t, id, text, pos, n, len, parse, skip_len)) continue;
        *match_len = n;
        return id;
    }
    return -1;
}

/* The span [*a, *b) literal lit takes when matched at s[pos, pos + mlen):
 * with lstrip the whitespace back to from, with rstrip the whitespace
 * after it. */
static void lit_span(const struct kv_tokenizer *t, int32_t lit, const char *s, size_t from,
                     size_t pos, size_t mlen, size_t len, size_t *a, size_t *b) {
    *a = pos;
    *b = pos + mlen;
    if (t->litf[lit] & KV_LIT_LSTRIP)
        while (*a > from && space_byte((unsigned char)s[*a - 1])) --*a;
    if (t->litf[lit] & KV_LIT_RSTRIP)
        while (*b < len && space_byte((unsigned char)s[*b])) ++*b;
}

/* ---------------------------------------------------------------- pipelines */

struct idvec {
    int32_t *v;
    int64_t n, cap;
};

static int idvec_push(struct idvec *v, int32_t id) {
    if (v->n == v->cap) {
        int64_t cap = v->cap ? 2 * v->cap : 1024;
        int32_t *p = realloc(v->v, (size_t)cap * sizeof *p);
        if (!p) return KV_ENOMEM;
        v->v = p;
        v->cap = cap;
    }
    v->v[v->n++] = id;
    return KV_OK;
}

struct pipe_work {
    struct tok_work w;
    size_t cap; /* bytes buf and sym hold */
    struct kv_pt_buf norm, pieces;
    int64_t specials;
};

static void pipe_work_free(struct pipe_work *pw) {
    free(pw->w.buf);
    free(pw->w.sym);
    free(pw->w.heap);
    kv_pt_buf_free(&pw->norm);
    kv_pt_buf_free(&pw->pieces);
}

/* The mergeable id of s[0, n) with the model's affixes, or -1. */
static int32_t char_id(const struct kv_tokenizer *t, const unsigned char *s, size_t n, int first,
                       int last) {
    if ((first || !t->cprefix_len) && (!last || !t->eow_len)) {
        int32_t id = piece_find(t, s, n);
        return id >= 0 && mergeable_type(t->type[id]) ? id : -1;
    }
    char tmp[64 + 4 + 64];
    size_t k = 0;
    if (!first && t->cprefix_len) {
        memcpy(tmp, t->cprefix, t->cprefix_len);
        k = t->cprefix_len;
    }
    memcpy(tmp + k, s, n);
    k += n;
    if (last && t->eow_len) {
        memcpy(tmp + k, t->eow, t->eow_len);
        k += t->eow_len;
    }
    int32_t id = piece_find(t, tmp, k);
    return id >= 0 && mergeable_type(t->type[id]) ? id : -1;
}

/* BPE of one pre-tokenized word, as the tokenizers crate's BPE model does:
 * ignore_merges takes a word that is a piece whole; a character without a
 * piece becomes its byte tokens when all exist, else the unknown id (runs
 * of them fused with fuse_unk). */
static int bpe_word(const struct kv_tokenizer *t, struct pipe_work *pw, const char *word,
                    size_t n, struct idvec *out, struct kv_err *err) {
    if (!n) return KV_OK;
    if (t->ignore_merges && n <= t->max_piece) {
        int32_t id = piece_find(t, word, n);
        if (id >= 0 && mergeable_type(t->type[id]))
            return idvec_push(out, id) ? kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory")
                                       : KV_OK;
    }
    if (n > pw->cap) {
        size_t cap = pw->cap ? pw->cap : 256;
        while (cap < n) cap *= 2;
        unsigned char *b = realloc(pw->w.buf, cap);
        if (b) pw->w.buf = b;
        struct tok_sym *y = b ? realloc(pw->w.sym, cap * sizeof *y) : NULL;
        if (!y) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory encoding a "
                                                                  "word of %zu bytes", n);
        pw->w.sym = y;
        pw->cap = cap;
    }
    memcpy(pw->w.buf, word, n);
    const unsigned char *buf = pw->w.buf;
    struct tok_sym *sym = pw->w.sym;
    int64_t last = -1;
    int last_unk = 0;
    for (size_t i = 0; i < n;) {
        size_t cl = t->byte_level ? 1 : utf8_len(buf + i, n - i);
        int32_t id = char_id(t, buf + i, cl, i == 0, i + cl == n);
        size_t nsym = 1;
        int frozen = 0, unk = 0;
        if (id < 0) {
            frozen = 1;
            int all = 1;
            for (size_t k = 0; k < cl; k++) all &= t->byte_id[buf[i + k]] >= 0;
            if (all) {
                nsym = cl;
            } else if (t->unk >= 0) {
                unk = 1;
                id = t->unk;
            } else {
                char q[64];
                return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                               "character '%s' has no piece, no byte token and there is no "
                               "unknown token",
                               quote_piece(q, sizeof q, (const char *)buf + i, cl));
            }
        }
        if (unk && last_unk && t->fuse_unk) {
            sym[last].len += (unsigned)cl;
            i += cl;
            continue;
        }
        for (size_t k = 0; k < nsym; k++) {
            int64_t at = (int64_t)(i + k);
            sym[at].prev = last;
            sym[at].next = -1;
            sym[at].frozen = (unsigned)frozen;
            sym[at].id = frozen && !unk ? t->byte_id[buf[i + k]] : id;
            sym[at].len = frozen && !unk ? 1u : (unsigned)cl;
            if (last >= 0) sym[last].next = at;
            last = at;
        }
        last_unk = unk;
        i += cl;
    }
    if (run_merges(t, &pw->w) != KV_OK)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory merging a word");
    for (int64_t l = 0; l >= 0; l = sym[l].next)
        if (idvec_push(out, sym[l].id))
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    return KV_OK;
}

/* Pre-tokenize and merge normalized text s[0, n). */
static int pipe_words(const struct kv_tokenizer *t, struct pipe_work *pw, const char *s,
                      size_t n, unsigned where, struct idvec *out, struct kv_err *err) {
    if (!n) return KV_OK;
    int rc = kv_pretok_pieces(t->pt, s, n, where, &pw->pieces, err);
    for (size_t i = 0; !rc && i < pw->pieces.n; i++) {
        size_t a = i ? pw->pieces.ends[i - 1] : 0;
        rc = bpe_word(t, pw, pw->pieces.buf + a, pw->pieces.ends[i] - a, out, err);
    }
    return rc;
}

/* One stretch of raw text between literals: normalize it, split it at the
 * literals matched after normalization, pre-tokenize and merge the rest. */
static int pipe_stretch(const struct kv_tokenizer *t, struct pipe_work *pw, const char *s,
                        size_t n, unsigned where, int parse, struct idvec *out,
                        struct kv_err *err) {
    int rc = kv_pretok_normalize(t->pt, s, n, where, &pw->norm, err);
    if (rc) return rc;
    /* pieces reuses its buffer, so the normalized text moves out first. */
    char *ns = pw->norm.buf;
    size_t nn = pw->norm.len;
    pw->norm = (struct kv_pt_buf){0};
    size_t seg = 0;
    for (size_t pos = 0; pos < nn && !rc;) {
        size_t skip = 0, mlen = 0, a, b;
        int32_t lit = t->n_nl ? lit_at(t, ns, pos, nn, 2, parse, &skip, &mlen) : -1;
        if (lit < 0) {
            if (skip) pw->specials++;
            pos += skip ? skip : 1;
            continue;
        }
        lit_span(t, lit, ns, seg, pos, mlen, nn, &a, &b);
        rc = pipe_words(t, pw, ns + seg, a - seg, seg == 0 ? where : 0, out, err);
        if (!rc && idvec_push(out, lit)) rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        pos = seg = b;
    }
    if (!rc) rc = pipe_words(t, pw, ns + seg, nn - seg, seg == 0 ? where : 0, out, err);
    free(ns);
    return rc;
}

/* Encode text[0, len) with a pipeline. first: it starts the input; last:
 * it ends it. Literals in raw text split it; lstrip and rstrip literals
 * take the whitespace beside them. */
static int pipe_encode(const struct kv_tokenizer *t, const char *text, size_t len, int parse,
                       int first, int last, struct idvec *out, int64_t *specials,
                       struct kv_err *err) {
    struct pipe_work pw = {0};
    int rc = KV_OK;
    size_t seg = 0;
    for (size_t pos = 0; pos < len && !rc;) {
        size_t skip = 0, mlen = 0, a, b;
        int32_t lit = t->n_lits ? lit_at(t, text, pos, len, 1, parse, &skip, &mlen) : -1;
        if (lit < 0) {
            if (skip) pw.specials++;
            pos += skip ? skip : 1;
            continue;
        }
        lit_span(t, lit, text, seg, pos, mlen, len, &a, &b);
        unsigned where = (seg > 0 || first ? KV_PT_START : 0) | KV_PT_END |
                         (seg == 0 && first ? KV_PT_INPUT : 0);
        if (a > seg) rc = pipe_stretch(t, &pw, text + seg, a - seg, where, parse, out, err);
        if (!rc && idvec_push(out, lit)) rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        pos = seg = b;
    }
    if (!rc && len > seg) {
        unsigned where = (seg > 0 || first ? KV_PT_START : 0) | (last ? KV_PT_END : 0) |
                         (seg == 0 && first ? KV_PT_INPUT : 0);
        rc = pipe_stretch(t, &pw, text + seg, len - seg, where, parse, out, err);
    }
    *specials += pw.specials;
    pipe_work_free(&pw);
    return rc;
}

/* ---------------------------------------------------------------- encode */

/* The tokens of text[0, len). first: the text starts the input (BOS and the
 * dummy prefix apply); last: it ends it; a piece of a stream starts and
 * ends at safe cuts. */
static int encode_text(const struct kv_tokenizer *tok, const char *text, size_t len, int flags,
                       int first, int last, int32_t **ids, int64_t *n_ids, int64_t *specials,
                       struct kv_err *err) {
    KV_ASSERT(tok && tok->finished && ids && n_ids);
    KV_ASSERT(text || len == 0);
    *ids = NULL;
    *n_ids = 0;
    int add_bos = (flags & KV_TOK_ADD_BOS) && first, parse = (flags & KV_TOK_PARSE_SPECIAL) != 0;
    int add_eos = (flags & KV_TOK_ADD_EOS) && last;
    if (add_bos && tok->bos < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "bos requested but the tokenizer has no bos token");
    if (add_eos && tok->eos < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "eos requested but the tokenizer has no eos token");
    if (tok->pt) {
        struct idvec v = {0};
        int rc = KV_OK;
        if (add_bos && idvec_push(&v, tok->bos)) rc = KV_ENOMEM;
        if (!rc) rc = pipe_encode(tok, text, len, parse, first, last, &v, specials, err);
        else rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        if (!rc && add_eos && idvec_push(&v, tok->eos))
            rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        if (rc) {
            free(v.v);
            return rc;
        }
        if (!v.v && !(v.v = malloc(sizeof *v.v)))
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        *ids = v.v;
        *n_ids = v.n;
        return KV_OK;
    }

    /* Upper bound on normalised bytes; every token covers at least one of
     * them (or one raw byte for a literal), plus BOS and EOS. */
    size_t n_sp = 0;
    for (size_t i = 0; i < len; i++) n_sp += text[i] == ' ';
    size_t norm, cap;
    if (__builtin_mul_overflow(n_sp, tok->space_len - 1, &norm) ||
        __builtin_add_overflow(norm, len, &norm) ||
        __builtin_add_overflow(norm, tok->space_len, &norm) ||
        __builtin_add_overflow(norm, 2, &cap) || cap > SIZE_MAX / sizeof(struct tok_sym))
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "text of %zu bytes is too long to encode", len);

    struct tok_work w = {0};
    int32_t *out = malloc(cap * sizeof *out);
    w.buf = malloc(norm);
    w.sym = malloc(norm * sizeof *w.sym);
    int rc;
    if (!out || !w.buf || !w.sym) {
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                     "out of memory encoding %zu bytes of text", len);
        goto done;
    }
    int64_t n_out = 0;
    if (add_bos) out[n_out++] = tok->bos;
    size_t seg = 0;
    for (size_t pos = 0; pos < len;) {
        size_t skip = 0, mlen = 0;
        int32_t lit = tok->n_lits ? lit_at(tok, text, pos, len, first && pos == 0 ? 3 : 1, parse,
                                           &skip, &mlen)
                                  : -1;
        if (lit < 0) {
            if (skip) ++*specials;
            pos += skip ? skip : 1;
            continue;
        }
        /* a normalized literal took the space before it */
        size_t end = pos - (pos > seg && tok->dummy && (tok->litf[lit] & KV_LIT_NORMALIZED));
        rc = encode_segment(tok, &w, text + seg, end - seg,
                            first && tok->dummy && seg == 0 && end > 0, out, &n_out, err);
        if (rc) goto done;
        out[n_out++] = lit;
        pos += mlen;
        seg = pos;
    }
    rc = encode_segment(tok, &w, text + seg, len - seg, first && tok->dummy && seg == 0 && len > 0,
                        out, &n_out, err);
    if (rc) goto done;
    if (add_eos) out[n_out++] = tok->eos;
    KV_ASSERT((size_t)n_out <= cap);
    int32_t *shrunk = realloc(out, (n_out ? (size_t)n_out : 1) * sizeof *out);
    if (shrunk) out = shrunk;
    *ids = out;
    *n_ids = n_out;
    out = NULL;
done:
    free(out);
    free(w.buf);
    free(w.sym);
    free(w.heap);
    return rc;
}

int kv_tok_encode(const struct kv_tokenizer *tok, const char *text, size_t len, int flags,
                  int32_t **ids, int64_t *n_ids, struct kv_err *err) {
    int64_t specials = 0;
    return encode_text(tok, text, len, flags, 1, 1, ids, n_ids, &specials, err);
}

int kv_tok_adds_bos(const struct kv_tokenizer *tok) {
    KV_ASSERT(tok);
    return tok->add_bos && tok->bos >= 0;
}

int kv_tok_adds_eos(const struct kv_tokenizer *tok) {
    KV_ASSERT(tok);
    return tok->add_eos && tok->eos >= 0;
}

int kv_tok_policy(const struct kv_tokenizer *tok) {
    return (kv_tok_adds_bos(tok) ? KV_TOK_ADD_BOS : 0) | (kv_tok_adds_eos(tok) ? KV_TOK_ADD_EOS : 0);
}

/* ---------------------------------------------------------------- streams */

struct kv_tok_stream {
    const struct kv_tokenizer *tok;
    int flags, started; /* started: BOS and the dummy prefix are out */
    size_t chunk;       /* text gathered before a cut is looked for */
    char *pend;         /* text not yet encoded */
    size_t n_pend, cap_pend, scanned;
    int32_t *ids;       /* the last call's tokens */
    int64_t specials;
};

int kv_tok_stream_new(const struct kv_tokenizer *tok, int flags, size_t chunk,
                      struct kv_tok_stream **out, struct kv_err *err) {
    KV_ASSERT(tok && tok->finished && out);
    *out = NULL;
    if ((flags & KV_TOK_ADD_BOS) && tok->bos < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "bos requested but the tokenizer has no bos token");
    if ((flags & KV_TOK_ADD_EOS) && tok->eos < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "eos requested but the tokenizer has no eos token");
    struct kv_tok_stream *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    s->tok = tok;
    s->flags = flags;
    s->chunk = chunk ? chunk : KV_TOK_STREAM_CHUNK;
    *out = s;
    return KV_OK;
}

void kv_tok_stream_free(struct kv_tok_stream *s) {
    if (!s) return;
    free(s->pend);
    free(s->ids);
    free(s);
}

int64_t kv_tok_stream_specials(const struct kv_tok_stream *s) {
    KV_ASSERT(s);
    return s->specials;
}

static int ascii_letter(unsigned char c) { return (c | 32) >= 'a' && (c | 32) <= 'z'; }

/* Whether text may be cut at c (0 < c < n). No merge may span c: for a
 * pipeline, text[c] is a ' ' between an ASCII letter or digit and an ASCII
 * letter, where its pre-tokenizer splits (probed when it was built); else
 * text[c] is an ASCII character whose symbol never merges, or (cut_space) a
 * ' ' after a character that is neither ' ' nor ends in space_piece (an
 * ASCII byte always starts a character). And no literal may start at c,
 * end at it, or span it, so the whole text's literal scan also passes
 * through c and each stretch between literals keeps its ends. */
static int cut_at(const struct kv_tokenizer *t, const char *text, size_t n, size_t c) {
    unsigned char b = (unsigned char)text[c];
    if (b >= 128) return 0;
    if (t->pt) {
        unsigned char p = (unsigned char)text[c - 1];
        if (!t->pipe_cut || b != ' ' || c + 1 >= n || !ascii_letter((unsigned char)text[c + 1]) ||
            !(ascii_letter(p) || (p >= '0' && p <= '9')))
            return 0;
    } else if (b == ' ') {
        if (!t->cut_space || text[c - 1] == ' ') return 0;
        if (c >= t->space_len && memcmp(text + c - t->space_len, t->space, t->space_len) == 0)
            return 0;
    } else if (!t->cut_byte[b]) {
        return 0;
    }
    size_t q0 = t->max_lit && c >= t->max_lit ? c - t->max_lit : 0;
    for (size_t q = q0; t->n_lits && q <= c; q++) {
        size_t skip = 0, mlen = 0;
        int32_t lit = lit_at(t, text, q, n, 0, 1, &skip, &mlen);
        if (lit >= 0 && q + mlen >= c) return 0;
    }
    return 1;
}

int kv_tok_stream_feed(struct kv_tok_stream *s, const char *text, size_t len, int eof,
                       const int32_t **ids, int64_t *n_ids, struct kv_err *err) {
    KV_ASSERT(s && ids && n_ids && (text || len == 0));
    const struct kv_tokenizer *t = s->tok;
    *ids = NULL;
    *n_ids = 0;
    free(s->ids);
    s->ids = NULL;
    if (len > s->cap_pend - s->n_pend) {
        size_t cap = s->cap_pend ? s->cap_pend : 4096;
        while (cap - s->n_pend < len) {
            if (cap > SIZE_MAX / 2)
                return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "text too long to encode");
            cap *= 2;
        }
        char *p = realloc(s->pend, cap);
        if (!p) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory encoding text");
        s->pend = p;
        s->cap_pend = cap;
    }
    if (len) memcpy(s->pend + s->n_pend, text, len);
    s->n_pend += len;
    /* Encode slices of about `chunk` bytes, each ending at a cut: the last
     * cut at or before start + chunk, else the first after it. A cut
     * decision reads up to t->look bytes past the cut, so before eof cuts
     * stop that far from the end; text up to `scanned` holds no cut (a
     * verdict needs only that lookahead, so it stands across calls). */
    size_t look = t->look, start = 0;
    size_t limit = s->n_pend > look ? s->n_pend - look : 0;
    int64_t n_out = 0, cap_out = 0;
    int rc = KV_OK;
    for (;;) {
        size_t left = s->n_pend - start, cut = 0;
        if (!eof && left < s->chunk) break;
        if (eof && left <= s->chunk) {
            if (s->started && left == 0) break;
            cut = s->n_pend;
        } else {
            size_t lo = s->scanned > start ? s->scanned : start;
            size_t hi = start + s->chunk < limit ? start + s->chunk : limit;
            for (size_t c = hi; c > lo && !cut; c--)
                if (cut_at(t, s->pend, s->n_pend, c)) cut = c;
            for (size_t c = hi + 1; c <= limit && !cut; c++)
                if (cut_at(t, s->pend, s->n_pend, c)) cut = c;
            if (!cut && !eof) {
                s->scanned = limit;
                break;
            }
            if (!cut) cut = s->n_pend;
        }
        int32_t *part;
        int64_t n_part;
        rc = encode_text(t, s->pend ? s->pend + start : "", cut - start, s->flags, !s->started,
                         eof && cut == s->n_pend, &part, &n_part, &s->specials, err);
        if (rc) break;
        s->started = 1;
        start = cut;
        if (n_out + n_part > cap_out) {
            int64_t c = cap_out ? cap_out : 1024;
            while (c < n_out + n_part) c *= 2;
            int32_t *p = realloc(s->ids, (size_t)c * sizeof *p);
            if (!p) {
                free(part);
                rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory encoding text");
                break;
            }
            s->ids = p;
            cap_out = c;
        }
        if (n_part) memcpy(s->ids + n_out, part, (size_t)n_part * sizeof *part);
        n_out += n_part;
        free(part);
        if (start == s->n_pend) break;
    }
    if (rc) return rc;
    if (start) memmove(s->pend, s->pend + start, s->n_pend - start);
    s->n_pend -= start;
    s->scanned = s->scanned > start ? s->scanned - start : 0;
    *ids = s->ids;
    *n_ids = n_out;
    return KV_OK;
}

/* ---------------------------------------------------------------- decode */

/* A pipeline's token: its piece through the replacing decoders, less up to
 * dec_strip leading spaces at the start of a text. */
static size_t decode_pipe(const struct kv_tokenizer *t, int32_t prev, int32_t id, char *out,
                          size_t cap) {
    const char *p = piece_bytes(t, id);
    size_t n = t->len[id];
    char *cur = NULL;
    for (int d = 0; d < t->n_dec; d++) {
        size_t nf = t->dec[d].nf, nt = t->dec[d].nt, m = 0;
        char *nx = malloc(n / nf * (nt > nf ? nt : nf) + n + 1);
        if (!nx) break; /* decoding is best effort; the piece as it stands */
        for (size_t i = 0; i < n;) {
            if (n - i >= nf && memcmp(p + i, t->dec[d].from, nf) == 0) {
                memcpy(nx + m, t->dec[d].to, nt);
                m += nt;
                i += nf;
            } else {
                nx[m++] = p[i++];
            }
        }
        free(cur);
        cur = nx;
        p = cur;
        n = m;
    }
    size_t skip = 0;
    if ((prev < 0 || prev == t->bos) && !(t->flags[id] & TOKF_LITERAL))
        while (skip < n && (int)skip < t->dec_strip && p[skip] == ' ') skip++;
    size_t o = n - skip;
    if (cap && o) memcpy(out, p + skip, o < cap ? o : cap);
    free(cur);
    return o;
}

size_t kv_tok_decode(const struct kv_tokenizer *tok, int32_t prev, int32_t id, char *out,
                     size_t cap) {
    KV_ASSERT(tok && tok->finished);
    KV_ASSERT(out || cap == 0);
    if (id < 0 || id >= tok->n_vocab) return 0;
    if (tok->byteval[id] >= 0) {
        if (cap) out[0] = (char)tok->byteval[id];
        return 1;
    }
    int type = tok->type[id];
    if (type == KV_TOKT_CONTROL) return 0;
    const char *p = piece_bytes(tok, id);
    size_t n = tok->len[id], o = 0;
    if (type == KV_TOKT_UNKNOWN) {
        if (cap && n) memcpy(out, p, n < cap ? n : cap);
        return n;
    }
    if (tok->pt) return decode_pipe(tok, prev, id, out, cap);
    int strip = tok->dummy && prev >= 0 && prev == tok->bos && !(tok->flags[id] & TOKF_LITERAL);
    const char *sp = tok->space;
    size_t sl = tok->space_len;
    for (size_t i = 0; i < n;) {
        char c;
        if (n - i >= sl && memcmp(p + i, sp, sl) == 0) {
            c = ' ';
            i += sl;
        } else {
            c = p[i++];
        }
        if (strip) {
            strip = 0;
            if (c == ' ') continue;
        }
        if (o < cap) out[o] = c;
        o++;
    }
    return o;
}
