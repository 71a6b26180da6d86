/* kvcal train-tokenizer: a byte-level BPE vocabulary learned from text.
 *
 * The text is pre-tokenized as GPT-2 does (or by a given regex, then byte
 * level) and the distinct words are counted. Every word starts as its bytes
 * (ids 0..255); each round counts the adjacent pairs over the distinct words,
 * weighted by their counts, and merges the most frequent pair (ties: the
 * smaller first id, then the smaller second id) everywhere, until the
 * vocabulary holds vocab_size - 2 pieces or no pair occurs twice. A merge
 * whose bytes are already a piece reuses that id (the merge is still
 * listed). Two special tokens end the vocabulary: <|begin_of_text|> (BOS)
 * and <|end_of_text|> (EOS). The result is written as an HF tokenizer.json
 * (kv_hf_write_bpe_tokenizer) that kvcal and the tokenizers library read
 * with the same ids. Each round costs O(symbols of the distinct words). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "err.h"
#include "kvcalib.h"
#include "pretok.h"

struct word {
    int32_t *sym;
    int32_t n;
    int64_t count;
};

struct bpe {
    struct word *w;
    size_t n_w, cap_w;
    size_t *slot; /* word hash: index + 1, 0 empty */
    size_t slot_mask;
    char **piece;
    size_t *plen;
    int32_t n_piece;
    int32_t *merges;
    int32_t n_merges;
};

static uint64_t fnv(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* The bytes of word k, rebuilt from its symbols (the table keys). */
static int word_eq(const struct bpe *b, const struct word *w, const char *s, size_t n) {
    size_t o = 0;
    for (int32_t i = 0; i < w->n; i++) {
        size_t l = b->plen[w->sym[i]];
        if (o + l > n || memcmp(b->piece[w->sym[i]], s + o, l)) return 0;
        o += l;
    }
    return o == n;
}

static int grow_words(struct bpe *b) {
    size_t cap = b->slot ? 2 * (b->slot_mask + 1) : 1 << 16;
    size_t *slot = calloc(cap, sizeof *slot);
    if (!slot) return KV_ENOMEM;
    for (size_t k = 0; k < b->n_w; k++) {
        const struct word *w = &b->w[k];
        uint64_t h = 1469598103934665603ull;
        for (int32_t i = 0; i < w->n; i++) h = (h ^ (unsigned char)w->sym[i]) * 1099511628211ull;
        size_t i = (size_t)h & (cap - 1);
        while (slot[i]) i = (i + 1) & (cap - 1);
        slot[i] = k + 1;
    }
    free(b->slot);
    b->slot = slot;
    b->slot_mask = cap - 1;
    return KV_OK;
}

/* Count one occurrence of the word s[0, n) (symbols are still bytes). */
static int add_word(struct bpe *b, const char *s, size_t n) {
    if (!n) return KV_OK;
    if (!b->slot || 2 * (b->n_w + 1) > b->slot_mask + 1)
        if (grow_words(b)) return KV_ENOMEM;
    size_t i = (size_t)fnv(s, n) & b->slot_mask;
    for (; b->slot[i]; i = (i + 1) & b->slot_mask) {
        struct word *w = &b->w[b->slot[i] - 1];
        if (word_eq(b, w, s, n)) {
            w->count++;
            return KV_OK;
        }
    }
    if (b->n_w == b->cap_w) {
        size_t cap = b->cap_w ? 2 * b->cap_w : 4096;
        struct word *w = realloc(b->w, cap * sizeof *w);
        if (!w) return KV_ENOMEM;
        b->w = w;
        b->cap_w = cap;
    }
    struct word *w = &b->w[b->n_w];
    if (!(w->sym = malloc(n * sizeof *w->sym))) return KV_ENOMEM;
    for (size_t k = 0; k < n; k++) w->sym[k] = (unsigned char)s[k];
    w->n = (int32_t)n;
    w->count = 1;
    b->slot[i] = ++b->n_w;
    return KV_OK;
}

struct pair_slot {
    uint64_t key; /* (a << 32 | b) + 1; 0 empty */
    int64_t count;
};

/* One round: the most frequent pair into *pa, *pb (count in *best). */
static int best_pair(const struct bpe *b, struct pair_slot *tab, size_t mask, size_t *used,
                     int32_t *pa, int32_t *pb, int64_t *best) {
    size_t n_used = 0;
    *best = 0;
    for (size_t k = 0; k < b->n_w; k++) {
        const struct word *w = &b->w[k];
        for (int32_t i = 0; i + 1 < w->n; i++) {
            uint64_t key = ((uint64_t)(uint32_t)w->sym[i] << 32 | (uint32_t)w->sym[i + 1]) + 1;
            size_t s = (size_t)((key * 0x9e3779b97f4a7c15ull) >> 20) & mask;
            while (tab[s].key && tab[s].key != key) s = (s + 1) & mask;
            if (!tab[s].key) {
                tab[s].key = key;
                tab[s].count = 0;
                used[n_used++] = s;
            }
            tab[s].count += w->count;
        }
    }
    for (size_t u = 0; u < n_used; u++) {
        const struct pair_slot *p = &tab[used[u]];
        int32_t a = (int32_t)((p->key - 1) >> 32), c = (int32_t)(uint32_t)(p->key - 1);
        if (p->count > *best || (p->count == *best && (a < *pa || (a == *pa && c < *pb)))) {
            *best = p->count;
            *pa = a;
            *pb = c;
        }
    }
    for (size_t u = 0; u < n_used; u++) tab[used[u]].key = 0;
    return KV_OK;
}

static void bpe_free(struct bpe *b) {
    for (size_t k = 0; k < b->n_w; k++) free(b->w[k].sym);
    free(b->w);
    free(b->slot);
    for (int32_t i = 0; b->piece && i < b->n_piece; i++) free(b->piece[i]);
    free(b->piece);
    free(b->plen);
    free(b->merges);
}

int kv_bpe_train(const char *const *paths, int n_paths, const struct kv_bpe_opts *o,
                 const char *out_path, kv_bpe_progress_fn progress, void *ctx,
                 struct kv_bpe_result *r, struct kv_err *err) {
    KV_ASSERT(paths && o && out_path && r);
    memset(r, 0, sizeof *r);
    if (o->vocab_size < 258 || o->vocab_size > 1 << 20)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "vocabulary size %d is outside 258..%d (256 bytes and 2 special tokens "
                       "at least)", (int)o->vocab_size, 1 << 20);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct bpe b = {0};
    struct kv_pretok *pt = NULL;
    struct kv_pt_buf pieces = {0};
    int32_t cap_piece = o->vocab_size;
    int rc = kv_pretok_new(&pt, err);
    if (!rc && o->regex)
        rc = kv_pretok_split(pt, o->regex, strlen(o->regex), 1, KV_PT_ISOLATED, 0, err);
    if (!rc) rc = kv_pretok_bytelevel(pt, 0, o->regex == NULL, err);
    if (rc) goto done;
    b.piece = calloc((size_t)cap_piece, sizeof *b.piece);
    b.plen = calloc((size_t)cap_piece, sizeof *b.plen);
    b.merges = malloc(2 * (size_t)cap_piece * sizeof *b.merges);
    if (!b.piece || !b.plen || !b.merges) goto oom;
    for (int c = 0; c < 256; c++) {
        if (!(b.piece[c] = malloc(1))) goto oom;
        b.piece[c][0] = (char)c;
        b.plen[c] = 1;
    }
    b.n_piece = 256;

    for (int p = 0; p < n_paths; p++) {
        char *text;
        size_t len;
        if ((rc = kv_text_read(paths[p], &text, &len, err))) goto done;
        rc = kv_pretok_pieces(pt, text, len, KV_PT_START | KV_PT_END | KV_PT_INPUT, &pieces, err);
        for (size_t i = 0; !rc && i < pieces.n; i++) {
            size_t a = i ? pieces.ends[i - 1] : 0;
            if (add_word(&b, pieces.buf + a, pieces.ends[i] - a)) rc = KV_ENOMEM;
        }
        r->bytes += (int64_t)len;
        r->words += (int64_t)pieces.n;
        free(text);
        if (rc == KV_ENOMEM) goto oom;
        if (rc) {
            if (err && !err->path[0]) snprintf(err->path, sizeof err->path, "%s", paths[p]);
            goto done;
        }
    }
    r->distinct_words = (int64_t)b.n_w;

    size_t total = 0;
    for (size_t k = 0; k < b.n_w; k++) total += (size_t)b.w[k].n;
    size_t cap = 1024;
    while (cap < 2 * total + 2) cap <<= 1;
    struct pair_slot *tab = calloc(cap, sizeof *tab);
    size_t *used = malloc((total + 1) * sizeof *used);
    if (!tab || !used) {
        free(tab);
        free(used);
        goto oom;
    }
    int32_t target = o->vocab_size - 2;
    while (b.n_piece < target) {
        int32_t a = INT32_MAX, c = INT32_MAX;
        int64_t best;
        best_pair(&b, tab, cap - 1, used, &a, &c, &best);
        if (best < 2) break;
        size_t la = b.plen[a], lc = b.plen[c];
        char *s = malloc(la + lc);
        if (!s) break;
        memcpy(s, b.piece[a], la);
        memcpy(s + la, b.piece[c], lc);
        int32_t id = -1;
        for (int32_t i = 256; i < b.n_piece && id < 0; i++)
            if (b.plen[i] == la + lc && !memcmp(b.piece[i], s, la + lc)) id = i;
        if (id < 0) {
            id = b.n_piece++;
            b.piece[id] = s;
            b.plen[id] = la + lc;
        } else {
            free(s);
        }
        b.merges[2 * b.n_merges] = a;
        b.merges[2 * b.n_merges + 1] = c;
        b.n_merges++;
        for (size_t k = 0; k < b.n_w; k++) {
            struct word *w = &b.w[k];
            int32_t m = 0;
            for (int32_t i = 0; i < w->n; i++) {
                if (i + 1 < w->n && w->sym[i] == a && w->sym[i + 1] == c) {
                    w->sym[m++] = id;
                    i++;
                } else {
                    w->sym[m++] = w->sym[i];
                }
            }
            w->n = m;
        }
        if (progress) progress(ctx, b.n_piece, target);
    }
    free(tab);
    free(used);
    r->merges = b.n_merges;
    r->vocab = b.n_piece + 2;
    rc = kv_hf_write_bpe_tokenizer(out_path, (const char *const *)b.piece, b.plen, b.n_piece,
                                   b.merges, b.n_merges, o->regex, err);
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    r->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    goto done;
oom:
    rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory learning a vocabulary");
done:
    kv_pt_buf_free(&pieces);
    kv_pretok_free(pt);
    bpe_free(&b);
    return rc;
}
