/* Hugging Face tokenizer.json (internal).
 *
 * Read: a "BPE" model with a vocab and rank-ordered merges (each "a b" or
 * ["a", "b"]), byte fallback pieces "<0xXX>", added tokens, and
 * SentencePiece-style spaces given either as the normalizer Sequence
 * [Prepend("▁"), Replace(" ", "▁")] or as a Metaspace pre-tokenizer; with
 * neither, spaces are ordinary characters. Byte-level (GPT-2 style),
 * WordPiece and Unigram tokenizers are KV_EUNSUPPORTED.
 *
 *     {"model": {"type": "BPE", "vocab": {"<piece>": id, ...},
 *                "merges": [...], "unk_token": ?, "byte_fallback": ?},
 *      "added_tokens": [{"id": N, "content": "...", "special": ?}, ...],
 *      "normalizer": ?, "pre_tokenizer": ?, "post_processor": ?}
 *
 * Every id from 0 to the largest one must have exactly one piece (the vocab's
 * and an added token's may agree). Past the JSON syntax (json.h), errors
 * carry no offset: jansson does not record where values start. */
#ifndef KV_TOKJSON_H
#define KV_TOKJSON_H

#include <stdint.h>

#include "kvformats.h"

struct kv_tokenizer;

/* Load tokenizer.json at path as a KV_TOK_RANK tokenizer. BOS/EOS come from
 * the TemplateProcessing post-processor or, failing that, from special added
 * tokens named like "<s>"/"</s>". On success release with kv_tok_free. */
int kv_hf_load_tokenizer(const char *path, struct kv_tokenizer **out, struct kv_err *err);

/* As kv_hf_load_tokenizer, with a checkpoint's own ids (config.json's
 * bos_token_id / eos_token_id): bos or eos >= 0 replaces the file's, -1 keeps
 * it; one outside the tokenizer's pieces is KV_EFORMAT. */
int kv_hf_load_tokenizer_ids(const char *path, int32_t bos, int32_t eos,
                             struct kv_tokenizer **out, struct kv_err *err);

#endif
