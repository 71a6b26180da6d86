/* Hugging Face Llama and GPT-2 checkpoints (internal).
 *
 * Directory layout:
 *
 *     config.json                    hyper-parameters (model_type "llama" or
 *                                    "gpt2", or architectures ["GPT2LMHeadModel"])
 *     model.safetensors              the weights, or instead:
 *     model.safetensors.index.json   {"weight_map": {"<tensor>": "<shard file>"}}
 *       model-00001-of-0000N.safetensors ...
 *     tokenizer.json                 optional; loaded when present (tokjson.h)
 *
 * The tensor names are the architecture table's (lib/arch.h); for Llama
 * (every linear weight is [out, in] row-major):
 *
 *     model.embed_tokens.weight                      [vocab, d]
 *     model.layers.N.input_layernorm.weight          [d]
 *     model.layers.N.self_attn.{q,k,v,o}_proj.weight
 *     model.layers.N.self_attn.{q,k,v}_proj.bias     optional
 *     model.layers.N.post_attention_layernorm.weight [d]
 *     model.layers.N.mlp.{gate,up,down}_proj.weight
 *     model.norm.weight                              [d]
 *     lm_head.weight                                 [vocab, d]; absent when tied
 *
 * GPT-2 tensor names, with or without the "transformer." prefix. Conv1D
 * weights are stored [in, out] and transposed at load into owned f32
 * [out, in]; c_attn holds q, k and v stacked along its output axis:
 *
 *     transformer.wte.weight                 [vocab, d]
 *     transformer.wpe.weight                 [n_positions, d]
 *     transformer.h.N.ln_1.{weight,bias}     [d]
 *     transformer.h.N.attn.c_attn.weight     [d, 3d]   Conv1D
 *     transformer.h.N.attn.c_attn.bias       [3d]
 *     transformer.h.N.attn.c_proj.weight     [d, d]    Conv1D
 *     transformer.h.N.attn.c_proj.bias       [d]
 *     transformer.h.N.ln_2.{weight,bias}     [d]
 *     transformer.h.N.mlp.c_fc.weight        [d, n_inner]  Conv1D
 *     transformer.h.N.mlp.c_fc.bias          [n_inner]
 *     transformer.h.N.mlp.c_proj.weight      [n_inner, d]  Conv1D
 *     transformer.h.N.mlp.c_proj.bias        [d]
 *     transformer.ln_f.{weight,bias}         [d]
 *     lm_head.weight                         [vocab, d]; the head when
 *                                            tie_word_embeddings is false
 *                                            (else unused, or the embedding
 *                                            when wte is absent)
 *
 * The causal-mask buffers h.N.attn.bias / h.N.attn.masked_bias are ignored.
 *
 * A safetensors __metadata__ entry whose key is a missing tensor name and
 * whose value is a present one is an alias (tied checkpoints store only one
 * of model.embed_tokens.weight / lm_head.weight). Other tensors are listed in
 * the model's table but not used. */
#ifndef KV_HFDIR_H
#define KV_HFDIR_H

#include "kvformats.h"
#include "model.h"

/* Read config.json at path into *cfg (rope layout KV_ROPE_HALF; bos/eos -1
 * when absent; has_qkv_bias mirrors attention_bias for llama). For gpt2:
 * n_embd, n_layer, n_head, n_positions (else n_ctx), n_inner (absent or null:
 * 4 n_embd), layer_norm_epsilon, vocab_size, tie_word_embeddings (default
 * true). Errors: KV_EIO, KV_EFORMAT (missing key, wrong type, range),
 * KV_EUNSUPPORTED (model_type other than llama or gpt2, hidden_act other
 * than silu, rope_scaling, mlp_bias; activation_function other than gelu_new
 * or gelu_pytorch_tanh, scale_attn_weights false,
 * scale_attn_by_inverse_layer_idx true). */
int kv_hf_read_config(const char *path, struct kv_config *cfg, struct kv_err *err);

/* Load the HF checkpoint in directory dir. The weight files stay mapped for
 * the model's lifetime (F32 weights are views into them; F16/BF16 are
 * converted). config.json's bos/eos ids override the tokenizer's. On success
 * *out is released with kv_model_close. Errors name the file they concern. */
int kv_hf_load(const char *dir, struct kv_model **out, struct kv_err *err);

#endif
