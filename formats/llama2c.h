/* llama2.c legacy checkpoint (.bin, "version 0") and tokenizer.bin readers
 * (internal).
 *
 * Checkpoint layout, all little-endian:
 *
 *   7 x i32 header: dim, hidden_dim, n_layers, n_heads, n_kv_heads,
 *                   vocab_size (negative: an untied classifier follows),
 *                   seq_len
 *   f32 weights, in llama2.c memory_map_weights order, each row-major:
 *     token_embedding [vocab, dim]
 *     rms_att         [L, dim]
 *     wq              [L, n_heads*head_dim, dim]
 *     wk              [L, kv_dim, dim]
 *     wv              [L, kv_dim, dim]
 *     wo              [L, dim, n_heads*head_dim]
 *     rms_ffn         [L, dim]
 *     w1              [L, hidden, dim]
 *     w2              [L, dim, hidden]
 *     w3              [L, hidden, dim]
 *     rms_final       [dim]
 *     freq_cis_real   [seq_len, head_dim/2]   (unused: kvcal computes RoPE)
 *     freq_cis_imag   [seq_len, head_dim/2]   (unused)
 *     wcls            [vocab, dim]            (only when vocab_size < 0)
 *   with head_dim = dim / n_heads and kv_dim = n_kv_heads * head_dim. The file
 *   must end exactly after the last weight.
 *
 * The format carries no hyper-parameters beyond the header: kvcal uses RMSNorm
 * epsilon 1e-5, RoPE theta 10000 on interleaved pairs, BOS 1 and EOS 2, as
 * llama2.c does.
 *
 * tokenizer.bin layout:
 *
 *   u32 max_token_length
 *   per token: f32 score, i32 length, length bytes (no terminator)
 *
 * Pieces store spaces as ' '. Ids 0, 1, 2 are <unk>, BOS and EOS; pieces
 * spelled exactly "<0xXX>" (upper-case hex) are byte-fallback tokens. */
#ifndef KV_LLAMA2C_H
#define KV_LLAMA2C_H

#include <stdint.h>

#include "kvformats.h"

struct kv_model;
struct kv_tokenizer;

/* Load a llama2.c checkpoint. The model keeps the file mapped; its weights
 * are views into the mapping. The tensor table lists every array of the file
 * (per-layer views named "layers.N.wq" etc). The model has no tokenizer. */
int kv_l2c_load(const char *path, struct kv_model **out, struct kv_err *err);

/* Build a model whose weights are views into len bytes of a checkpoint (path
 * for messages only). buf must outlive the model. */
int kv_l2c_parse(const uint8_t *buf, uint64_t len, const char *path, struct kv_model **out,
                 struct kv_err *err);

/* Load a llama2.c tokenizer.bin with n_vocab tokens; n_vocab <= 0 reads
 * tokens until the end of the file, which must fall on a token boundary.
 * With n_vocab > 0 the file must also end after exactly n_vocab tokens.
 * Builds a score-mode tokenizer with space piece " " and a dummy prefix. */
int kv_l2c_load_tokenizer(const char *path, int32_t n_vocab, struct kv_tokenizer **out,
                          struct kv_err *err);

/* Parser behind kv_l2c_load_tokenizer, on bytes (path for messages only). */
int kv_l2c_parse_tokenizer(const uint8_t *buf, uint64_t len, const char *path, int32_t n_vocab,
                           struct kv_tokenizer **out, struct kv_err *err);

#endif
