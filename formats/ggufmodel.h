/* A llama model and its SentencePiece vocabulary read from a GGUF container
 * (internal). The container itself (layout, parsing, getters) is gguf.h; this
 * module says what a llama file means.
 *
 * Metadata keys (u32 unless noted; "?" optional):
 *
 *   general.architecture                string, "llama"
 *   llama.embedding_length              d
 *   llama.feed_forward_length           hidden size of the MLP
 *   llama.block_count                   layers
 *   llama.attention.head_count          query heads
 *   llama.attention.head_count_kv ?     key/value heads (default: head_count)
 *   llama.attention.key_length ?        head size (default: d / head_count)
 *   llama.attention.value_length ?      must equal the head size
 *   llama.context_length                longest sequence
 *   llama.attention.layer_norm_rms_epsilon   float32
 *   llama.rope.freq_base ?              float32 (default 10000)
 *   llama.rope.dimension_count ?        must equal the head size
 *   llama.rope.scaling.type ?           string, only "none"
 *   llama.rope.scale_linear ?           float32, only 1
 *   llama.vocab_size ?                  (default: token_embd's row count)
 *
 *   tokenizer.ggml.model                string; only "llama" builds a tokenizer
 *   tokenizer.ggml.tokens               array of string, the pieces
 *   tokenizer.ggml.scores ?             array of float32, one per piece
 *   tokenizer.ggml.token_type ?         array of int32, one per piece
 *   tokenizer.ggml.{bos,eos,unknown}_token_id ?  (defaults 1, 2, 0;
 *                                       0xffffffff for none)
 *   tokenizer.ggml.add_space_prefix ?   bool (default true)
 *
 * Tensor names (F32, F16 or BF16; rope is interleaved):
 *
 *   token_embd.weight, output_norm.weight, output.weight (absent when tied),
 *   blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,
 *          ffn_down,ffn_up}.weight, blk.N.attn_{q,k,v}.bias (optional)
 *
 * Any other tensor, a type other than F32, F16 and BF16, or a layer past
 * block_count is refused before anything is allocated. */
#ifndef KV_GGUFMODEL_H
#define KV_GGUFMODEL_H

#include "gguf.h"

struct kv_tokenizer;
struct kv_model;

/* Load a llama-architecture GGUF file (F32/F16/BF16 weights) as a model. The
 * model keeps the mapping alive and owns the tokenizer built from the
 * metadata when tokenizer.ggml.model is "llama" (else it has none). */
int kv_gguf_load(const char *path, struct kv_model **out, struct kv_err *err);

/* Build the tokenizer described by a parsed file's metadata. Only the "llama"
 * (SentencePiece) model is supported; others are KV_EUNSUPPORTED. */
int kv_gguf_build_tokenizer(const struct kv_gguf_file *f, struct kv_tokenizer **out,
                            struct kv_err *err);
/* Open path and build its tokenizer; the mapping is released before return. */
int kv_gguf_load_tokenizer(const char *path, struct kv_tokenizer **out, struct kv_err *err);

#endif
