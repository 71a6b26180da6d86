/* A model and its vocabulary read from a GGUF container (internal). The
 * container itself (layout, parsing, getters) is gguf.h; this module says
 * what a file of each architecture kvcal reads means (llama, qwen2, qwen3,
 * phi3, gptneox, gemma2: lib/arch.c's rows with a GGUF name). The keys
 * below are llama's, under the architecture's prefix for the others; what
 * the others add (phi3's longrope factor tensors and window, gptneox's
 * rope.dimension_count, use_parallel_residual and layer_norm_epsilon,
 * gemma2's soft-caps, window and gains stored with their 1) is
 * docs/formats.md's GGUF section.
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
 *   tokenizer.ggml.model                string, "llama" or "gpt2"
 *   tokenizer.ggml.tokens               array of string, the pieces
 *   tokenizer.ggml.token_type ?         array of int32, one per piece (enum
 *                                       kv_tok_type; default all normal)
 *   tokenizer.ggml.{bos,eos,unknown}_token_id ?  (llama: defaults 1, 2, 0;
 *                                       gpt2: none; 0xffffffff for none)
 *   tokenizer.ggml.add_bos_token ?      bool (llama: default true; gpt2: see
 *                                       tokenizer.ggml.pre)
 *   tokenizer.ggml.add_eos_token ?      bool (default false)
 *
 * "llama" (SentencePiece, merged by score) also reads:
 *
 *   tokenizer.ggml.scores ?             array of float32, one per piece
 *   tokenizer.ggml.add_space_prefix ?   bool (default true)
 *
 * "gpt2" (byte-level BPE, merged by rank; pieces in GPT-2's byte-to-unicode
 * form, where ' ' is U+0120: "\u0120the" for " the") also reads:
 *
 *   tokenizer.ggml.merges               array of string "a b" (mapped form),
 *                                       in rank order
 *   tokenizer.ggml.pre ?                string, the pre-tokenizer (default
 *                                       "default"): llama.cpp's name for a
 *                                       list of split regexes (default, gpt-2,
 *                                       llama-bpe, qwen2, falcon, starcoder,
 *                                       deepseek-llm, deepseek-coder, ... and
 *                                       aliases; see ggufmodel.c). An unknown
 *                                       name is KV_EUNSUPPORTED. The Llama 3
 *                                       names (llama-bpe, llama3, llama-v3)
 *                                       default add_bos_token to true and
 *                                       let a word that is a piece be that
 *                                       piece, as llama.cpp does; the others
 *                                       default it to false.
 *
 * Control pieces (type 3) of a gpt2 vocabulary match in text only with
 * KV_TOK_PARSE_SPECIAL; user-defined ones (type 4) always. Both are stored
 * as text, not in the mapped form.
 *
 * Tensor names (F32, F16, BF16 or a block type kvcal decodes; rope is
 * interleaved for llama, rotate-half for the others; per architecture in
 * lib/arch.c's .gguf tables):
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

/* The attention scale llama.cpp's gemma2 takes, having no key for it:
 * 1/sqrt(dim / heads) for Gemma 2 27B (46 layers), 1/sqrt(head_dim)
 * otherwise. */
float kv_gguf_gemma2_attn_scale(const struct kv_config *c);

/* Load a GGUF file of an architecture above as a model. The
 * model keeps the mapping alive and owns the tokenizer built from the
 * metadata when tokenizer.ggml.model is "llama" (else it has none; a "gpt2"
 * vocabulary is read by kv_gguf_load_tokenizer, kv_tok_open). */
int kv_gguf_load(const char *path, struct kv_model **out, struct kv_err *err);

/* Build the tokenizer described by a parsed file's metadata: the "llama"
 * (SentencePiece) and "gpt2" (byte-level BPE) models; others are
 * KV_EUNSUPPORTED. */
int kv_gguf_build_tokenizer(const struct kv_gguf_file *f, struct kv_tokenizer **out,
                            struct kv_err *err);
/* Open path and build its tokenizer; the mapping is released before return. */
int kv_gguf_load_tokenizer(const char *path, struct kv_tokenizer **out, struct kv_err *err);

#endif
