/* Normalizers and pre-tokenizers of Hugging Face tokenizer.json files, and
 * GPT-2's byte-to-unicode map (internal).
 *
 * A pipeline holds, in file order, the normalizers (NFC, NFD, NFKC, NFKD,
 * Lowercase, Prepend, Replace, Strip) and the pre-tokenizer stages (Split
 * by a regex or a string with a behaviour and invert, ByteLevel, Metaspace;
 * Whitespace, WhitespaceSplit, Digits and Punctuation are Splits with a
 * fixed regex). Regexes run in PCRE2 with UTF, UCP and invalid-UTF
 * matching (an invalid byte matches nothing, so it lands in the gaps
 * between matches), JIT-compiled when the JIT is there, with match and
 * depth limits. Unicode normalization and lower-casing are utf8proc's;
 * bytes that are not UTF-8 pass through every normalizer unchanged.
 *
 * The semantics follow the Rust tokenizers crate:
 *   - normalizers run on each stretch of text between added tokens; Prepend
 *     and Strip's left side apply only where the stretch starts, Strip's
 *     right side where it ends (KV_PT_START, KV_PT_END);
 *   - a Split finds every match left to right (after an empty match it moves
 *     one character on), flips match and gap with invert, then folds:
 *     Removed keeps the gaps; Isolated keeps all; MergedWithPrevious adds a
 *     match to the piece before it; MergedWithNext to the piece after it;
 *     Contiguous joins neighbours of the same kind. Empty pieces are dropped;
 *   - ByteLevel prepends ' ' to each piece that does not start with one
 *     (add_prefix_space) and then splits it with GPT-2's regex (use_regex).
 *     The vocabulary itself is stored as raw bytes (kv_bytelevel_unmap), so
 *     the byte mapping is not applied to text;
 *   - Metaspace replaces ' ' with the replacement, prepends it to a piece
 *     that does not start with it (always; first: only the piece that starts
 *     the input, KV_PT_INPUT) and splits before each replacement (split).
 */
#ifndef KV_PRETOK_H
#define KV_PRETOK_H

#include <stddef.h>
#include <stdint.h>

#include "kvcal_core.h"

struct kv_pretok;

enum kv_pt_norm { KV_PT_NFC, KV_PT_NFD, KV_PT_NFKC, KV_PT_NFKD, KV_PT_LOWERCASE };
enum kv_pt_behavior {
    KV_PT_REMOVED,
    KV_PT_ISOLATED,
    KV_PT_MERGED_PREV,
    KV_PT_MERGED_NEXT,
    KV_PT_CONTIGUOUS,
};
enum kv_pt_scheme { KV_PT_ALWAYS, KV_PT_FIRST, KV_PT_NEVER };

/* Where a stretch of text sits: KV_PT_START it starts a stretch between
 * added tokens, KV_PT_END it ends one, KV_PT_INPUT it starts the input. */
enum { KV_PT_START = 1, KV_PT_END = 2, KV_PT_INPUT = 4 };

int kv_pretok_new(struct kv_pretok **out, struct kv_err *err);
void kv_pretok_free(struct kv_pretok *p);

/* Normalizers, applied in the order added. */
int kv_pretok_norm_unicode(struct kv_pretok *p, enum kv_pt_norm form, struct kv_err *err);
int kv_pretok_norm_prepend(struct kv_pretok *p, const char *s, size_t n, struct kv_err *err);
/* pattern is a PCRE2 regex when regex, else a literal string. */
int kv_pretok_norm_replace(struct kv_pretok *p, const char *pattern, size_t plen, int regex,
                           const char *content, size_t clen, struct kv_err *err);
int kv_pretok_norm_strip(struct kv_pretok *p, int left, int right, struct kv_err *err);

/* Pre-tokenizer stages, applied in the order added. */
int kv_pretok_split(struct kv_pretok *p, const char *pattern, size_t plen, int regex,
                    enum kv_pt_behavior behavior, int invert, struct kv_err *err);
int kv_pretok_bytelevel(struct kv_pretok *p, int add_prefix_space, int use_regex,
                        struct kv_err *err);
int kv_pretok_metaspace(struct kv_pretok *p, const char *replacement, size_t n,
                        enum kv_pt_scheme scheme, int split, struct kv_err *err);

int kv_pretok_has_normalizers(const struct kv_pretok *p);
int kv_pretok_has_stages(const struct kv_pretok *p);
/* The fixed regexes kvcal writes for the named pre-tokenizers. */
extern const char kv_pt_gpt2_regex[];

/* A growable byte buffer cut into pieces: piece i is
 * buf[i ? ends[i-1] : 0, ends[i]). */
struct kv_pt_buf {
    char *buf;
    size_t len, cap;
    size_t *ends;
    size_t n, cap_n;
};
void kv_pt_buf_free(struct kv_pt_buf *b);

/* Normalize text[0, len) into out->buf (out->len set, pieces cleared). */
int kv_pretok_normalize(const struct kv_pretok *p, const char *text, size_t len, unsigned where,
                        struct kv_pt_buf *out, struct kv_err *err);
/* Pre-tokenize text[0, len) (normalized) into out's pieces. */
int kv_pretok_pieces(const struct kv_pretok *p, const char *text, size_t len, unsigned where,
                     struct kv_pt_buf *out, struct kv_err *err);

/* GPT-2's byte-to-unicode map, inverted: the vocabulary piece s[0, n) as
 * raw bytes in out (at most n bytes). A character outside the map is kept
 * as its own UTF-8 bytes; *mapped says whether every character was in it. */
size_t kv_bytelevel_unmap(const char *s, size_t n, char *out, int *mapped);
/* The other way: raw bytes s[0, n) as GPT-2's mapped characters in out (at
 * most 2n bytes); returns the length. */
size_t kv_bytelevel_map(const char *s, size_t n, char *out);

#endif
