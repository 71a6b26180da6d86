/* SentencePiece-style BPE tokenizer with byte fallback (internal builder API).
 *
 * Two merge modes share one engine (a priority queue over adjacent pairs):
 *   KV_TOK_SCORE: merge the adjacent pair whose concatenation is a vocabulary
 *                 piece with the highest score (llama2.c tokenizer.bin, GGUF
 *                 "llama" vocab). Ties go to the leftmost pair.
 *   KV_TOK_RANK:  merge the adjacent pair with the lowest rank in an explicit
 *                 merge list (HF tokenizer.json "BPE"). Ties go leftmost.
 *
 * Normalisation: optionally prepend a dummy prefix, and replace every ' ' in
 * the input with space_piece (" " for llama2.c files whose pieces store
 * spaces, "\xe2\x96\x81" (U+2581) for GGUF / HF files). Decoding maps
 * space_piece back to ' '.
 *
 * Initial symbols are UTF-8 characters. A character that is not a NORMAL or
 * USER piece becomes its byte tokens "<0xXX>" when the vocabulary has them
 * (byte fallback), else the unknown id. Byte, control, unknown and unused
 * pieces are never produced by merging. Literal tokens (HF added tokens) are
 * matched verbatim in the raw text before normalisation and split it.
 *
 * Loaders build one with kv_tok_init, kv_tok_set_piece for every id,
 * kv_tok_add_merge (rank mode), kv_tok_set_special, kv_tok_set_normalizer,
 * kv_tok_add_literal, then kv_tok_finish. */
#ifndef KV_TOKENIZER_H
#define KV_TOKENIZER_H

#include "kvcal_core.h"

enum kv_tok_mode { KV_TOK_SCORE = 0, KV_TOK_RANK = 1 };

/* Same numbering as GGUF tokenizer.ggml.token_type. */
enum kv_tok_type {
    KV_TOKT_NORMAL = 1,
    KV_TOKT_UNKNOWN = 2,
    KV_TOKT_CONTROL = 3,
    KV_TOKT_USER = 4,
    KV_TOKT_UNUSED = 5,
    KV_TOKT_BYTE = 6,
};

int kv_tok_init(enum kv_tok_mode mode, int32_t n_vocab, struct kv_tokenizer **out,
                struct kv_err *err);

/* Set piece `id` (bytes copied). Types outside 1..6 are treated as NORMAL. */
int kv_tok_set_piece(struct kv_tokenizer *tok, int32_t id, const char *piece, size_t len,
                     float score, int type, struct kv_err *err);

/* Rank mode: merging pieces a and b (both must exist, as must a+b) has this
 * rank; lower merges first. path names the source file in messages. */
int kv_tok_add_merge(struct kv_tokenizer *tok, const char *a, size_t alen, const char *b,
                     size_t blen, int32_t rank, const char *path, struct kv_err *err);

/* Ids may be -1 when absent. unk defaults to 0. */
void kv_tok_set_special(struct kv_tokenizer *tok, int32_t bos, int32_t eos, int32_t unk);

/* space_piece: bytes substituted for ' ' (copied); add_dummy_prefix: prepend
 * one space_piece to non-empty text. Defaults: " ", 1. */
int kv_tok_set_normalizer(struct kv_tokenizer *tok, const char *space_piece,
                          int add_dummy_prefix, struct kv_err *err);

/* Token id is matched verbatim in raw text (HF added/special tokens).
 * kv_tok_add_literal adds a special one. KV_LIT_SPECIAL: matched only when
 * encoding with KV_TOK_PARSE_SPECIAL (else counted and encoded as text);
 * LSTRIP / RSTRIP: the match takes the whitespace before / after it;
 * SINGLE_WORD: matched only with no word character on either side;
 * NORMALIZED: matched in the normalized text (pipelines only). */
enum {
    KV_LIT_SPECIAL = 1,
    KV_LIT_LSTRIP = 2,
    KV_LIT_RSTRIP = 4,
    KV_LIT_SINGLE_WORD = 8,
    KV_LIT_NORMALIZED = 16,
};
int kv_tok_add_literal(struct kv_tokenizer *tok, int32_t id, struct kv_err *err);
int kv_tok_add_literal_flags(struct kv_tokenizer *tok, int32_t id, unsigned flags,
                             struct kv_err *err);

/* A Hugging Face pipeline (pretok.h), owned by the tokenizer from now on:
 * text is normalized and pre-tokenized per stretch between literals and
 * each piece merged on its own; the space normalizer is off. byte_level:
 * the pieces are raw bytes (kv_bytelevel_unmap) and a word's initial
 * symbols are its bytes. */
struct kv_pretok;
int kv_tok_set_pretok(struct kv_tokenizer *tok, struct kv_pretok *pt, int byte_level,
                      struct kv_err *err);
/* BPE model options of tokenizer.json, as the tokenizers crate runs them:
 * ignore_merges (a word that is a piece is that piece) and fuse_unk (a run
 * of unknown characters is one unknown token). Calling it also switches
 * byte fallback to the crate's rule: a character without a piece becomes
 * its byte tokens when all of them exist, else one unknown token (not one
 * per byte, llama.cpp's rule for the score mode). */
void kv_tok_set_model_options(struct kv_tokenizer *tok, int ignore_merges, int fuse_unk);
/* continuing_subword_prefix and end_of_word_suffix (NULL: none); set them
 * before the merges. */
int kv_tok_set_affixes(struct kv_tokenizer *tok, const char *prefix, const char *suffix,
                       struct kv_err *err);
/* Pipeline decoding: replace `from` by `to` in each piece (in the order
 * added, at most 4), then drop up to n leading spaces from the first token
 * of a text (after BOS or with no previous token). */
int kv_tok_add_decoder_replace(struct kv_tokenizer *tok, const char *from, size_t nf,
                               const char *to, size_t nt, struct kv_err *err);
void kv_tok_set_decoder_strip(struct kv_tokenizer *tok, int n);
/* Whether texts get BOS / EOS (kv_tok_policy); default BOS yes, EOS no. */
void kv_tok_set_policy(struct kv_tokenizer *tok, int add_bos, int add_eos);

/* Build lookup tables; every id must have been set. Errors name path. */
int kv_tok_finish(struct kv_tokenizer *tok, const char *path, struct kv_err *err);

/* The slice of text a stream encodes at a time (kv_tok_stream_new with
 * chunk 0): small enough for the merge heap and the symbols to stay in
 * cache. 'kvcal verify --max-windows 5' of stories260K on 20 MB of
 * TinyStories, almost all of it the pass that counts the tokens, took
 * 5.6 s with 64 KiB, 5.9 s with 16 KiB, 6.1 s with 256 KiB, and 9.3 s
 * when the text was encoded whole. */
#define KV_TOK_STREAM_CHUNK ((size_t)64 << 10)

float kv_tok_score(const struct kv_tokenizer *tok, int32_t id);
int kv_tok_type(const struct kv_tokenizer *tok, int32_t id);
enum kv_tok_mode kv_tok_mode(const struct kv_tokenizer *tok);

#endif
