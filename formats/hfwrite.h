/* Hugging Face model directory writer (internal; the API is kv_hf_write and
 * kv_hf_write_byte_tokenizer in kvcal.h).
 *
 * Writes what formats/hfdir.h reads, with the tensor names of its tables
 * (the architecture table, lib/arch.h):
 *
 *     config.json        llama: LlamaForCausalLM keys (hidden_size,
 *                          intermediate_size, num_hidden_layers,
 *                          num_attention_heads, num_key_value_heads, head_dim,
 *                          vocab_size, max_position_embeddings, rms_norm_eps,
 *                          rope_theta, hidden_act "silu", attention_bias,
 *                          tie_word_embeddings, bos/eos_token_id)
 *                        gpt2: GPT2LMHeadModel keys (n_embd, n_layer, n_head,
 *                          n_positions, n_ctx, n_inner, vocab_size,
 *                          layer_norm_epsilon, activation_function "gelu_new",
 *                          tie_word_embeddings, bos/eos_token_id)
 *     model.safetensors  every weight in the chosen dtype, __metadata__
 *                        {"format": "pt"}; llama q/k rows in HF's
 *                        rotate-half order (a model whose rope pairs are
 *                        interleaved has each head's rows permuted: HF row
 *                        j < d_h/2 is row 2j, row d_h/2 + j is row 2j + 1);
 *                        gpt2 Conv1D weights stored [in, out], c_attn as q, k
 *                        and v stacked; lm_head.weight only when untied
 *     tokenizer.json     a copy of the given file, when one is given
 *
 * Numbers in config.json are the shortest decimals that read back as the
 * same f32. */
#ifndef KV_HFWRITE_H
#define KV_HFWRITE_H

#include "kvformats.h"
#include "model.h"

/* config.json text of cfg (indented JSON ending in a newline), malloc'd;
 * KV_EINVAL when HF cannot describe cfg (gpt2 with head_dim * n_heads !=
 * dim), KV_ENOMEM. */
int kv_hf_config_text(const struct kv_config *cfg, char **out, struct kv_err *err);

struct kv_stw;

/* Weight kind of layer l (0 for a global) of m under name: a resident
 * model's f32 array borrowed (m must outlive the write), a streamed model's
 * rows converted while the file is written, in their stored F16 or BF16
 * (exact) else F32, so memory stays one piece whatever the model's size.
 * Errors: those of kv_stw_add. */
int kv_hf_add_model_weight(struct kv_stw *w, const struct kv_model *m, enum kv_wkind kind,
                           int64_t l, const char *name, struct kv_err *err);

#endif
