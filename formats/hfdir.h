/* Hugging Face Llama checkpoints (internal).
 *
 * Directory layout:
 *
 *     config.json                    hyper-parameters (model_type "llama")
 *     model.safetensors              the weights, or instead:
 *     model.safetensors.index.json   {"weight_map": {"<tensor>": "<shard file>"}}
 *       model-00001-of-0000N.safetensors ...
 *     tokenizer.json                 optional; loaded when present
 *
 * Tensor names (every linear weight is [out, in] row-major):
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
 * A safetensors __metadata__ entry whose key is a missing tensor name and
 * whose value is a present one is an alias (tied checkpoints store only one
 * of model.embed_tokens.weight / lm_head.weight). Other tensors are listed in
 * the model's table but not used.
 *
 * tokenizer.json: a "BPE" model with a vocab and rank-ordered merges, byte
 * fallback pieces "<0xXX>", added tokens, and SentencePiece-style spaces
 * given either as the normalizer Sequence [Prepend("▁"), Replace(" ", "▁")]
 * or as a Metaspace pre-tokenizer. Byte-level (GPT-2 style), WordPiece and
 * Unigram tokenizers are KV_EUNSUPPORTED. */
#ifndef KV_HFDIR_H
#define KV_HFDIR_H

#include "kvcal.h"

/* Read config.json at path into *cfg (rope layout KV_ROPE_HALF; bos/eos -1
 * when absent; has_qkv_bias mirrors attention_bias). Errors: KV_EIO, KV_EFORMAT (missing key, wrong type, range),
 * KV_EUNSUPPORTED (model_type other than llama, hidden_act other than silu,
 * rope_scaling, mlp_bias). */
int kv_hf_read_config(const char *path, struct kv_config *cfg, struct kv_err *err);

/* Load the HF checkpoint in directory dir. The weight files stay mapped for
 * the model's lifetime (F32 weights are views into them; F16/BF16 are
 * converted). config.json's bos/eos ids override the tokenizer's. On success
 * *out is released with kv_model_free. Errors name the file they concern. */
int kv_hf_load(const char *dir, struct kv_model **out, struct kv_err *err);

/* Load tokenizer.json at path as a KV_TOK_RANK tokenizer. BOS/EOS come from
 * the TemplateProcessing post-processor or, failing that, from special added
 * tokens named like "<s>"/"</s>". On success release with kv_tok_free. */
int kv_hf_load_tokenizer(const char *path, struct kv_tokenizer **out, struct kv_err *err);

#endif
