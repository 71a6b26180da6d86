/* A model written as a GGUF file that llama.cpp loads (internal).
 *
 * The file is GGUF v3 in the layout of gguf.h (alignment 32, metadata in the
 * order below, then the tensor infos, then the data), written atomically
 * (kv_write_atomic: PATH.tmp-*, fsync, rename, fsync of the directory).
 *
 * Architectures (kvcal's -> GGUF general.architecture A):
 *
 *   llama   -> "llama"  q/k rows in interleaved pairs; rope_freqs.weight
 *   mistral -> "llama"  as convert_hf_to_gguf.py writes Mistral
 *   qwen2   -> "qwen2"  q/k rows in rotate-half pairs (llama.cpp's qwen2
 *                       graph is NEOX), q/k/v biases; no rope_freqs.weight;
 *                       n_heads * head_dim must equal dim (llama.cpp sizes
 *                       attn_q and attn_output [dim, dim])
 *   qwen3   -> "qwen3"  as qwen2 (rotate-half rows, no rope_freqs.weight),
 *                       plus the per-head q/k norms attn_q_norm.weight and
 *                       attn_k_norm.weight [head_dim]; q/k/v biases
 *                       optional; n_heads * head_dim may differ from dim
 *                       (llama.cpp sizes attn_q [dim, n_heads * key_length],
 *                       attn_output [n_heads * key_length, dim])
 *
 * A model with a sliding window (sliding_window > 0) is refused: neither
 * kvcal's reader nor llama.cpp's llama, qwen2 and qwen3 read a window key,
 * so the file would be a different model that attends to every earlier
 * position.
 *
 * Metadata:
 *
 *   general.architecture        string A
 *   general.name                string "kvcal"
 *   A.context_length            u32 max_seq_len
 *   A.embedding_length          u32 dim
 *   A.block_count               u32 n_layers
 *   A.feed_forward_length       u32 hidden_dim
 *   A.attention.head_count      u32 n_heads
 *   A.attention.head_count_kv   u32 n_kv_heads
 *   A.attention.key_length      u32 head_dim   } only when head_dim differs
 *   A.attention.value_length    u32 head_dim   } from dim / n_heads
 *   A.rope.dimension_count      u32 head_dim
 *   A.rope.freq_base            f32 rope_theta
 *   A.attention.layer_norm_rms_epsilon  f32 norm_eps
 *   A.vocab_size                u32 vocab_size
 *   A.rope.scaling.type         string "linear" or "yarn"  } linear and
 *   A.rope.scaling.factor       f32 factor                 } yarn only
 *   A.rope.scaling.original_context_length  u32 original_ctx      } yarn
 *   A.rope.scaling.attn_factor  f32 attention_factor / m   } yarn with an
 *                               explicit attention_factor; m = 1 + 0.1 ln
 *                               factor (1 for factor <= 1)
 *   tokenizer.ggml.*            (below)
 *
 * Rope scaling: none; linear (the two keys above); yarn as transformers
 * computes it with beta_fast 32, beta_slow 1 and truncate true (llama.cpp's
 * llama, qwen2 and qwen3 read no yarn_beta_* key and always round the
 * correction range to whole dimensions; it multiplies cos and sin by
 * attn_factor times m, kvcal by attention_factor, or m when that is 0);
 * other yarn parameters are refused. For "llama" also llama3, and the per-pair
 * divisors of a GGUF-loaded model (KV_ROPE_SCALING_FREQS), as the F32
 * tensor rope_freqs.weight [head_dim/2] holding, for pair i,
 * theta^(-2i/d) / inv_freq_i (kv_rope_freqs), as llama.cpp's converter
 * writes Llama 3's. Dynamic and longrope are refused (KV_EUNSUPPORTED).
 *
 * Tensors: the names of the architecture table (lib/arch.c, .gguf), stored
 * with ne[0] the input axis (a [out, in] weight has ne = {in, out}):
 * rope_freqs.weight (when written), then the table's globals (output.weight
 * only when the head is not tied), then each layer's in table order
 * (q/k/v biases when the model has them). 1-D tensors (norms, biases) are
 * F32; 2-D ones (the embedding, the head and every projection) are of
 * o->matrix_type, encoded row by row with kv_ggml_quant (lib/ggmlquant.h),
 * so a quantised row must be a whole number of blocks. The query and key
 * rows (and their biases) are permuted within each head from the model's
 * RoPE layout to the architecture's: llama.cpp rotates pairs (2i, 2i+1) for
 * "llama", so a model loaded from HF (pairs (i, i + d_h/2)) has row
 * s*d_h/2 + i of each head written as row 2i + s, as convert_hf_to_gguf.py
 * does; an interleaved model (GGUF, llama2.c) is written as it is. For
 * "qwen2" and "qwen3" (pairs (i, i + d_h/2), as HF) it is the other way
 * round: an HF model is written as it is, an interleaved one has row 2i + s
 * written as row s*d_h/2 + i. qwen3's q/k norm weights scale q and k element
 * by element before RoPE, so they are permuted with the rows they scale.
 *
 * Tokenizer (tokenizer.ggml.*). llama.cpp requires unique pieces and one
 * piece per embedding row, so a tokenizer with fewer pieces than
 * vocab_size is padded with "[PAD<id>]" pieces of type unused, one with
 * more (or with two equal pieces) is refused (KV_EINVAL).
 *
 *   - No tokenizer (random weights, llama2.c without tokenizer.bin): a
 *     synthetic vocabulary of vocab_size pieces that loads and decodes:
 *     "<s>" (control) at the config's bos_id and "</s>" (control) at its
 *     eos_id (1 and 2 when the config has none or they lie outside the
 *     vocabulary), "<unk>" (unknown) at 0 unless bos or eos is 0; then, on
 *     the remaining ids in order, the 256 bytes while they last and
 *     "t<id>" (normal, score -id) after them. When the remaining ids hold
 *     all 256 bytes it is a SentencePiece ("llama") vocabulary whose bytes
 *     are "<0x00>".."<0xFF>" (type byte; scores 0 but for the "t<id>");
 *     below that (vocab_size under 259 with the three specials) it is a
 *     "gpt2" one of bytes 0, 1, ... in GPT-2's byte-to-unicode form (type
 *     normal, no merges, pre "default"), because llama.cpp's
 *     SentencePiece tokenizer aborts the process on a byte it has no piece
 *     for while its BPE one skips it. add_bos_token true (when there is a
 *     bos), add_eos_token false.
 *   - A score-merged (SentencePiece) tokenizer, kv_tok_mode KV_TOK_SCORE
 *     (GGUF "llama", llama2.c tokenizer.bin): "llama" with every piece (a
 *     ' ' in a piece, llama2.c's spelling of the space, written as U+2581),
 *     its score and type, exactly what kvcal and llama.cpp merge by.
 *   - A rank-merged tokenizer (HF tokenizer.json, GGUF "gpt2"): kvcal keeps
 *     its merge list private, so the merges cannot be written. When every
 *     one of the 256 single bytes is a piece and no piece is of type byte
 *     (byte-level BPE: GPT-2, Llama 3, Qwen): "gpt2" with the pieces in
 *     GPT-2's byte-to-unicode form (control and user pieces as text), their
 *     types, tokenizer.ggml.pre "default" and an empty
 *     tokenizer.ggml.merges: it loads and decodes every id to its bytes, but
 *     encodes text one byte per token. Otherwise (SentencePiece-style BPE
 *     with "<0xXX>" byte fallback: Llama 2, TinyLlama, kvcal's byte
 *     tokenizer): "llama" with the pieces and types as they are and score
 *     -id for normal and user pieces (SentencePiece orders its pieces by
 *     score, so this approximates the merge order; text is tokenized as
 *     by a SentencePiece model with those scores, not by the merge list).
 *
 *   Both "llama" cases also write tokenizer.ggml.add_space_prefix, found by
 *   encoding "a" (true when the first token starts with ' ', U+2581 or is
 *   the byte 0x20 or 0xE2). Every case writes tokenizer.ggml.model,
 *   .tokens, .token_type (int32), .scores (f32, "llama" only),
 *   .bos_token_id / .eos_token_id (the tokenizer's, else the config's;
 *   omitted when neither has one), .unknown_token_id (the first piece of
 *   type unknown, when there is one), .add_bos_token and .add_eos_token
 *   (kv_tok_adds_bos / kv_tok_adds_eos; the synthetic vocabulary: true and
 *   false). */
#ifndef KV_GGUFMODELW_H
#define KV_GGUFMODELW_H

#include <stdint.h>

#include "kvformats.h"
#include "mlamodel.h"

struct kv_model;

struct kv_gguf_write_opts {
    /* ggml type of the 2-D weight matrices: F32 (0, the default), F16 (1),
     * BF16 (30), or a block type kv_ggml_can_quant encodes (Q4_0 2, Q4_1 3,
     * Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14).
     * 1-D tensors (norms, biases, rope_freqs) are always F32. */
    uint32_t matrix_type;
    /* 1: a matrix whose rows hold no whole number of a K-quant's 256-element
     * super-blocks is written in the type llama.cpp's quantiser falls back
     * to (Q2_K, Q3_K -> Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0)
     * instead of refused; n_fallback receives how many were. */
    int fallback;
    int64_t n_fallback;
};

/* Write m (a llama, mistral, qwen2 or qwen3 model: kvcal's other
 * architectures have no GGUF row yet) to path as described above; o may be
 * NULL for the defaults. Nothing is written unless the whole model can be:
 * the type, the architecture, the sliding window, the head shape, the rope
 * scaling, every quantised row length and the tokenizer are checked first.
 * Errors: KV_EINVAL (a matrix type kvcal cannot encode: "matrix type ..."; a
 * row that is not a whole number of blocks, naming the tensor; a tokenizer
 * llama.cpp would refuse), KV_EUNSUPPORTED (the architecture, a sliding
 * window, qwen2 heads that do not add up to dim, the rope scaling),
 * KV_ENUMERIC (a non-finite weight for a block type, naming the tensor),
 * KV_EIO naming path, KV_ENOMEM. */
int kv_gguf_write_model(const struct kv_model *m, const char *path,
                        struct kv_gguf_write_opts *o, struct kv_err *err);

/* Model m with its attention replaced by mla, as GGUF "deepseek2" (every
 * block dense: leading_dense_block_count = layers, no experts, no q-LoRA),
 * the matrices in o->matrix_type except attn_kv_a_mqa, always F32 (its
 * latent rows are scaled far below float16's range). Atomic as
 * kv_gguf_write_model. */
int kv_gguf_write_mla(const struct kv_model *m, const struct kv_mla *mla, const char *path,
                      struct kv_gguf_write_opts *o, struct kv_err *err);

#endif
