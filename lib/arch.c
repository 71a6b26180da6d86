/* The architecture table (arch.h). */
#include "arch.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "err.h"

#define ONE(k) {k}, 1
#define COUNT(a) ((int64_t)(sizeof a / sizeof a[0]))

/* ---------------------------------------------------------------- llama */

static const struct kv_arch_tensor llama_hf_globals[] = {
    {"model.embed_tokens.weight", ONE(KV_W_TOK_EMB), 0, 0},
    {"model.norm.weight", ONE(KV_W_OUT_NORM), 0, 0},
    {"lm_head.weight", ONE(KV_W_LM_HEAD), 0, 0},
};

static const struct kv_arch_tensor llama_hf_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"self_attn.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {"self_attn.k_proj.weight", ONE(KV_W_K), 0, 0},
    {"self_attn.v_proj.weight", ONE(KV_W_V), 0, 0},
    {"self_attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"self_attn.q_proj.bias", ONE(KV_W_BQ), 0, 0},
    {"self_attn.k_proj.bias", ONE(KV_W_BK), 0, 0},
    {"self_attn.v_proj.bias", ONE(KV_W_BV), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"mlp.gate_proj.weight", ONE(KV_W_GATE), 0, 0},
    {"mlp.up_proj.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.down_proj.weight", ONE(KV_W_DOWN), 0, 0},
};

static const struct kv_arch_tensor llama_gguf_globals[] = {
    {"token_embd.weight", ONE(KV_W_TOK_EMB), 0, 0},
    {"output_norm.weight", ONE(KV_W_OUT_NORM), 0, 0},
    {"output.weight", ONE(KV_W_LM_HEAD), 0, 0},
};

static const struct kv_arch_tensor llama_gguf_layer[] = {
    {"attn_norm.weight", ONE(KV_W_ATTN_NORM), 0, 0}, {"attn_q.weight", ONE(KV_W_Q), 0, 0},
    {"attn_k.weight", ONE(KV_W_K), 0, 0},            {"attn_v.weight", ONE(KV_W_V), 0, 0},
    {"attn_output.weight", ONE(KV_W_O), 0, 0},       {"attn_q.bias", ONE(KV_W_BQ), 0, 0},
    {"attn_k.bias", ONE(KV_W_BK), 0, 0},             {"attn_v.bias", ONE(KV_W_BV), 0, 0},
    {"ffn_norm.weight", ONE(KV_W_FFN_NORM), 0, 0},   {"ffn_gate.weight", ONE(KV_W_GATE), 0, 0},
    {"ffn_down.weight", ONE(KV_W_DOWN), 0, 0},       {"ffn_up.weight", ONE(KV_W_UP), 0, 0},
};

static const struct kv_arch_tensor llama_lr_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"self_attn.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {"self_attn.q_proj.bias", ONE(KV_W_BQ), 0, 0},
    {NULL, ONE(KV_W_K), 0, 0},
    {"self_attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"mlp.gate_proj.weight", ONE(KV_W_GATE), 0, 0},
    {"mlp.up_proj.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.down_proj.weight", ONE(KV_W_DOWN), 0, 0},
};

/* biases HF Llama can carry but kvcal's forward pass has no place for */
static const char *const llama_hf_refused[] = {
    "self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
};

/* ---------------------------------------------------------------- qwen3 */

static const struct kv_arch_tensor qwen3_hf_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"self_attn.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {"self_attn.k_proj.weight", ONE(KV_W_K), 0, 0},
    {"self_attn.v_proj.weight", ONE(KV_W_V), 0, 0},
    {"self_attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"self_attn.q_proj.bias", ONE(KV_W_BQ), 0, 0},
    {"self_attn.k_proj.bias", ONE(KV_W_BK), 0, 0},
    {"self_attn.v_proj.bias", ONE(KV_W_BV), 0, 0},
    {"self_attn.q_norm.weight", ONE(KV_W_QNORM), 0, 0},
    {"self_attn.k_norm.weight", ONE(KV_W_KNORM), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"mlp.gate_proj.weight", ONE(KV_W_GATE), 0, 0},
    {"mlp.up_proj.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.down_proj.weight", ONE(KV_W_DOWN), 0, 0},
};

static const struct kv_arch_tensor qwen3_gguf_layer[] = {
    {"attn_norm.weight", ONE(KV_W_ATTN_NORM), 0, 0}, {"attn_q.weight", ONE(KV_W_Q), 0, 0},
    {"attn_k.weight", ONE(KV_W_K), 0, 0},            {"attn_v.weight", ONE(KV_W_V), 0, 0},
    {"attn_output.weight", ONE(KV_W_O), 0, 0},       {"attn_q.bias", ONE(KV_W_BQ), 0, 0},
    {"attn_k.bias", ONE(KV_W_BK), 0, 0},             {"attn_v.bias", ONE(KV_W_BV), 0, 0},
    {"attn_q_norm.weight", ONE(KV_W_QNORM), 0, 0},   {"attn_k_norm.weight", ONE(KV_W_KNORM), 0, 0},
    {"ffn_norm.weight", ONE(KV_W_FFN_NORM), 0, 0},   {"ffn_gate.weight", ONE(KV_W_GATE), 0, 0},
    {"ffn_down.weight", ONE(KV_W_DOWN), 0, 0},       {"ffn_up.weight", ONE(KV_W_UP), 0, 0},
};

/* the compressed directory keeps the norms, which act on the rebuilt key */
static const struct kv_arch_tensor qwen3_lr_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"self_attn.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {"self_attn.q_proj.bias", ONE(KV_W_BQ), 0, 0},
    {"self_attn.q_norm.weight", ONE(KV_W_QNORM), 0, 0},
    {"self_attn.k_norm.weight", ONE(KV_W_KNORM), 0, 0},
    {NULL, ONE(KV_W_K), 0, 0},
    {"self_attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"mlp.gate_proj.weight", ONE(KV_W_GATE), 0, 0},
    {"mlp.up_proj.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.down_proj.weight", ONE(KV_W_DOWN), 0, 0},
};

/* ---------------------------------------------------------------- phi3 */

/* Phi-3 stores q, k, v stacked in one projection and gate, up in another */
static const struct kv_arch_tensor phi3_hf_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"self_attn.qkv_proj.weight", {KV_W_Q, KV_W_K, KV_W_V}, 3, 0, 0},
    {"self_attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"mlp.gate_up_proj.weight", {KV_W_GATE, KV_W_UP}, 2, 0, 0},
    {"mlp.down_proj.weight", ONE(KV_W_DOWN), 0, 0},
};

/* llama.cpp's phi3: q, k, v stacked in attn_qkv, gate and up in ffn_up */
static const struct kv_arch_tensor phi3_gguf_layer[] = {
    {"attn_norm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"attn_qkv.weight", {KV_W_Q, KV_W_K, KV_W_V}, 3, 0, 0},
    {"attn_output.weight", ONE(KV_W_O), 0, 0},
    {"ffn_norm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"ffn_up.weight", {KV_W_GATE, KV_W_UP}, 2, 0, 0},
    {"ffn_down.weight", ONE(KV_W_DOWN), 0, 0},
};

static const char *const phi3_hf_refused[] = {
    "self_attn.qkv_proj.bias", "self_attn.o_proj.bias", "mlp.gate_up_proj.bias", "mlp.down_proj.bias",
};

/* ---------------------------------------------------------------- gemma2 */

/* HF's post_attention_layernorm is Gemma 2's norm of attention's output;
 * the MLP's input norm is pre_feedforward_layernorm */
static const struct kv_arch_tensor gemma2_hf_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"self_attn.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {"self_attn.k_proj.weight", ONE(KV_W_K), 0, 0},
    {"self_attn.v_proj.weight", ONE(KV_W_V), 0, 0},
    {"self_attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_POST_ATTN_NORM), 0, 0},
    {"pre_feedforward_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"post_feedforward_layernorm.weight", ONE(KV_W_POST_FFN_NORM), 0, 0},
    {"mlp.gate_proj.weight", ONE(KV_W_GATE), 0, 0},
    {"mlp.up_proj.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.down_proj.weight", ONE(KV_W_DOWN), 0, 0},
};

static const struct kv_arch_tensor gemma2_gguf_layer[] = {
    {"attn_norm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"attn_q.weight", ONE(KV_W_Q), 0, 0},
    {"attn_k.weight", ONE(KV_W_K), 0, 0},
    {"attn_v.weight", ONE(KV_W_V), 0, 0},
    {"attn_output.weight", ONE(KV_W_O), 0, 0},
    {"post_attention_norm.weight", ONE(KV_W_POST_ATTN_NORM), 0, 0},
    {"ffn_norm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"post_ffw_norm.weight", ONE(KV_W_POST_FFN_NORM), 0, 0},
    {"ffn_gate.weight", ONE(KV_W_GATE), 0, 0},
    {"ffn_up.weight", ONE(KV_W_UP), 0, 0},
    {"ffn_down.weight", ONE(KV_W_DOWN), 0, 0},
};

static const struct kv_arch_tensor gemma2_lr_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"self_attn.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {NULL, ONE(KV_W_K), 0, 0},
    {"self_attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_POST_ATTN_NORM), 0, 0},
    {"pre_feedforward_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"post_feedforward_layernorm.weight", ONE(KV_W_POST_FFN_NORM), 0, 0},
    {"mlp.gate_proj.weight", ONE(KV_W_GATE), 0, 0},
    {"mlp.up_proj.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.down_proj.weight", ONE(KV_W_DOWN), 0, 0},
};

static const char *const gemma2_hf_refused[] = {
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "self_attn.o_proj.bias", "mlp.gate_proj.bias",    "mlp.up_proj.bias",
    "mlp.down_proj.bias",
};

/* ---------------------------------------------------------------- gpt_neox */

#define NEOX_PREFIX "gpt_neox."

static const struct kv_arch_tensor neox_hf_globals[] = {
    {NEOX_PREFIX "embed_in.weight", ONE(KV_W_TOK_EMB), 0, 0},
    {NEOX_PREFIX "final_layer_norm.weight", ONE(KV_W_OUT_NORM), 0, 0},
    {NEOX_PREFIX "final_layer_norm.bias", ONE(KV_W_OUT_NORM_B), 0, 0},
    {"embed_out.weight", ONE(KV_W_LM_HEAD), 0, 0},
};

/* q, k and v in one projection, interleaved per head */
static const struct kv_arch_tensor neox_hf_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"input_layernorm.bias", ONE(KV_W_ATTN_NORM_B), 0, 0},
    {"attention.query_key_value.weight", {KV_W_Q, KV_W_K, KV_W_V}, 3, 0, 1},
    {"attention.query_key_value.bias", {KV_W_BQ, KV_W_BK, KV_W_BV}, 3, 0, 1},
    {"attention.dense.weight", ONE(KV_W_O), 0, 0},
    {"attention.dense.bias", ONE(KV_W_BO), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"post_attention_layernorm.bias", ONE(KV_W_FFN_NORM_B), 0, 0},
    {"mlp.dense_h_to_4h.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.dense_h_to_4h.bias", ONE(KV_W_BUP), 0, 0},
    {"mlp.dense_4h_to_h.weight", ONE(KV_W_DOWN), 0, 0},
    {"mlp.dense_4h_to_h.bias", ONE(KV_W_BDOWN), 0, 0},
};

static const struct kv_arch_tensor neox_gguf_globals[] = {
    {"token_embd.weight", ONE(KV_W_TOK_EMB), 0, 0},
    {"output_norm.weight", ONE(KV_W_OUT_NORM), 0, 0},
    {"output_norm.bias", ONE(KV_W_OUT_NORM_B), 0, 0},
    {"output.weight", ONE(KV_W_LM_HEAD), 0, 0},
};

/* llama.cpp's converter stores q, k, v one after the other (not per head) */
static const struct kv_arch_tensor neox_gguf_layer[] = {
    {"attn_norm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"attn_norm.bias", ONE(KV_W_ATTN_NORM_B), 0, 0},
    {"attn_qkv.weight", {KV_W_Q, KV_W_K, KV_W_V}, 3, 0, 0},
    {"attn_qkv.bias", {KV_W_BQ, KV_W_BK, KV_W_BV}, 3, 0, 0},
    {"attn_output.weight", ONE(KV_W_O), 0, 0},
    {"attn_output.bias", ONE(KV_W_BO), 0, 0},
    {"ffn_norm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"ffn_norm.bias", ONE(KV_W_FFN_NORM_B), 0, 0},
    {"ffn_up.weight", ONE(KV_W_UP), 0, 0},
    {"ffn_up.bias", ONE(KV_W_BUP), 0, 0},
    {"ffn_down.weight", ONE(KV_W_DOWN), 0, 0},
    {"ffn_down.bias", ONE(KV_W_BDOWN), 0, 0},
};

/* a compressed directory stores GPT-NeoX unfused, under its own layer names */
static const struct kv_arch_tensor neox_lr_layer[] = {
    {"input_layernorm.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"input_layernorm.bias", ONE(KV_W_ATTN_NORM_B), 0, 0},
    {"attention.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {"attention.q_proj.bias", ONE(KV_W_BQ), 0, 0},
    {NULL, ONE(KV_W_K), 0, 0},
    {"attention.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"attention.o_proj.bias", ONE(KV_W_BO), 0, 0},
    {"post_attention_layernorm.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"post_attention_layernorm.bias", ONE(KV_W_FFN_NORM_B), 0, 0},
    {"mlp.dense_h_to_4h.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.dense_h_to_4h.bias", ONE(KV_W_BUP), 0, 0},
    {"mlp.dense_4h_to_h.weight", ONE(KV_W_DOWN), 0, 0},
    {"mlp.dense_4h_to_h.bias", ONE(KV_W_BDOWN), 0, 0},
};

/* ---------------------------------------------------------------- gpt2 */

#define GPT2_PREFIX "transformer."

static const struct kv_arch_tensor gpt2_hf_globals[] = {
    {GPT2_PREFIX "wte.weight", ONE(KV_W_TOK_EMB), 0, 0},
    {GPT2_PREFIX "wpe.weight", ONE(KV_W_POS_EMB), 0, 0},
    {GPT2_PREFIX "ln_f.weight", ONE(KV_W_OUT_NORM), 0, 0},
    {GPT2_PREFIX "ln_f.bias", ONE(KV_W_OUT_NORM_B), 0, 0},
    {"lm_head.weight", ONE(KV_W_LM_HEAD), 0, 0},
};

static const struct kv_arch_tensor gpt2_hf_layer[] = {
    {"ln_1.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"ln_1.bias", ONE(KV_W_ATTN_NORM_B), 0, 0},
    {"attn.c_attn.weight", {KV_W_Q, KV_W_K, KV_W_V}, 3, 1, 0},
    {"attn.c_attn.bias", {KV_W_BQ, KV_W_BK, KV_W_BV}, 3, 0, 0},
    {"attn.c_proj.weight", ONE(KV_W_O), 1, 0},
    {"attn.c_proj.bias", ONE(KV_W_BO), 0, 0},
    {"ln_2.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"ln_2.bias", ONE(KV_W_FFN_NORM_B), 0, 0},
    {"mlp.c_fc.weight", ONE(KV_W_UP), 1, 0},
    {"mlp.c_fc.bias", ONE(KV_W_BUP), 0, 0},
    {"mlp.c_proj.weight", ONE(KV_W_DOWN), 1, 0},
    {"mlp.c_proj.bias", ONE(KV_W_BDOWN), 0, 0},
};

/* a compressed directory stores GPT-2 unfused and [out, in], under HF
 * Llama-like names inside GPT-2's layer */
static const struct kv_arch_tensor gpt2_lr_layer[] = {
    {"ln_1.weight", ONE(KV_W_ATTN_NORM), 0, 0},
    {"ln_1.bias", ONE(KV_W_ATTN_NORM_B), 0, 0},
    {"attn.q_proj.weight", ONE(KV_W_Q), 0, 0},
    {"attn.q_proj.bias", ONE(KV_W_BQ), 0, 0},
    {NULL, ONE(KV_W_K), 0, 0},
    {"attn.o_proj.weight", ONE(KV_W_O), 0, 0},
    {"attn.o_proj.bias", ONE(KV_W_BO), 0, 0},
    {"ln_2.weight", ONE(KV_W_FFN_NORM), 0, 0},
    {"ln_2.bias", ONE(KV_W_FFN_NORM_B), 0, 0},
    {"mlp.c_fc.weight", ONE(KV_W_UP), 0, 0},
    {"mlp.c_fc.bias", ONE(KV_W_BUP), 0, 0},
    {"mlp.c_proj.weight", ONE(KV_W_DOWN), 0, 0},
    {"mlp.c_proj.bias", ONE(KV_W_BDOWN), 0, 0},
};

/* ---------------------------------------------------------------- the table */

static const struct kv_arch_desc archs[] = {
    [KV_ARCH_LLAMA] =
        {
            .id = KV_ARCH_LLAMA,
            .name = "llama",
            .layernorm = 0,
            .rope = 1,
            .gelu_mlp = 0,
            .qkv_bias = KV_WUSE_OPTIONAL,
            .block_biases = 0,
            .mha = 0,
            .tied_default = 0,
            .hf_class = "LlamaForCausalLM",
            .gguf_arch = "llama",
            .hf_attn = "self_attn.",
            .hf_refused = llama_hf_refused,
            .n_hf_refused = COUNT(llama_hf_refused),
            .hf = {"model.layers.", NULL, llama_hf_globals, COUNT(llama_hf_globals),
                   llama_hf_layer, COUNT(llama_hf_layer)},
            .gguf = {"blk.", NULL, llama_gguf_globals, COUNT(llama_gguf_globals),
                     llama_gguf_layer, COUNT(llama_gguf_layer)},
            .lr_layer = llama_lr_layer,
            .n_lr_layer = COUNT(llama_lr_layer),
        },
    [KV_ARCH_MISTRAL] =
        {
            .id = KV_ARCH_MISTRAL,
            .name = "mistral",
            .rope = 1,
            .qkv_bias = KV_WUSE_OPTIONAL,
            .hf_class = "MistralForCausalLM",
            .gguf_arch = NULL, /* llama.cpp writes Mistral as "llama" */
            .hf_attn = "self_attn.",
            .hf_refused = llama_hf_refused,
            .n_hf_refused = COUNT(llama_hf_refused),
            .hf = {"model.layers.", NULL, llama_hf_globals, COUNT(llama_hf_globals),
                   llama_hf_layer, COUNT(llama_hf_layer)},
            .gguf = {"blk.", NULL, llama_gguf_globals, COUNT(llama_gguf_globals),
                     llama_gguf_layer, COUNT(llama_gguf_layer)},
            .lr_layer = llama_lr_layer,
            .n_lr_layer = COUNT(llama_lr_layer),
        },
    [KV_ARCH_QWEN2] =
        {
            .id = KV_ARCH_QWEN2,
            .name = "qwen2",
            .rope = 1,
            .qkv_bias = KV_WUSE_REQUIRED,
            .hf_class = "Qwen2ForCausalLM",
            .gguf_arch = "qwen2",
            .gguf_rope_half = 1,
            .hf_attn = "self_attn.",
            .hf_refused = llama_hf_refused,
            .n_hf_refused = COUNT(llama_hf_refused),
            .hf = {"model.layers.", NULL, llama_hf_globals, COUNT(llama_hf_globals),
                   llama_hf_layer, COUNT(llama_hf_layer)},
            .gguf = {"blk.", NULL, llama_gguf_globals, COUNT(llama_gguf_globals),
                     llama_gguf_layer, COUNT(llama_gguf_layer)},
            .lr_layer = llama_lr_layer,
            .n_lr_layer = COUNT(llama_lr_layer),
        },
    [KV_ARCH_PHI3] =
        {
            .id = KV_ARCH_PHI3,
            .name = "phi3",
            .rope = 1,
            .qkv_bias = KV_WUSE_NONE,
            .hf_class = "Phi3ForCausalLM",
            .gguf_arch = "phi3",
            .gguf_rope_half = 1,
            .hf_attn = "self_attn.",
            .hf_refused = phi3_hf_refused,
            .n_hf_refused = COUNT(phi3_hf_refused),
            .hf = {"model.layers.", NULL, llama_hf_globals, COUNT(llama_hf_globals),
                   phi3_hf_layer, COUNT(phi3_hf_layer)},
            .gguf = {"blk.", NULL, llama_gguf_globals, COUNT(llama_gguf_globals),
                     phi3_gguf_layer, COUNT(phi3_gguf_layer)},
            .lr_layer = llama_lr_layer,
            .n_lr_layer = COUNT(llama_lr_layer),
        },
    [KV_ARCH_QWEN3] =
        {
            .id = KV_ARCH_QWEN3,
            .name = "qwen3",
            .rope = 1,
            .qk_norm = 1,
            .qkv_bias = KV_WUSE_OPTIONAL,
            .hf_class = "Qwen3ForCausalLM",
            .gguf_arch = "qwen3",
            .gguf_rope_half = 1,
            .hf_attn = "self_attn.",
            .hf_refused = llama_hf_refused,
            .n_hf_refused = COUNT(llama_hf_refused),
            .hf = {"model.layers.", NULL, llama_hf_globals, COUNT(llama_hf_globals),
                   qwen3_hf_layer, COUNT(qwen3_hf_layer)},
            .gguf = {"blk.", NULL, llama_gguf_globals, COUNT(llama_gguf_globals),
                     qwen3_gguf_layer, COUNT(qwen3_gguf_layer)},
            .lr_layer = qwen3_lr_layer,
            .n_lr_layer = COUNT(qwen3_lr_layer),
        },
    [KV_ARCH_GPT2] =
        {
            .id = KV_ARCH_GPT2,
            .name = "gpt2",
            .layernorm = 1,
            .rope = 0,
            .gelu_mlp = 1,
            .qkv_bias = KV_WUSE_REQUIRED,
            .block_biases = 1,
            .mha = 1,
            .tied_default = 1,
            .hf_class = "GPT2LMHeadModel",
            .hf_attn = "attn.",
            .hf = {GPT2_PREFIX "h.", GPT2_PREFIX, gpt2_hf_globals, COUNT(gpt2_hf_globals),
                   gpt2_hf_layer, COUNT(gpt2_hf_layer)},
            .gguf = {"blk.", NULL, NULL, 0, NULL, 0},
            .lr_layer = gpt2_lr_layer,
            .n_lr_layer = COUNT(gpt2_lr_layer),
        },
    [KV_ARCH_GEMMA2] =
        {
            .id = KV_ARCH_GEMMA2,
            .name = "gemma2",
            .rope = 1,
            .geglu = 1,
            .post_norms = 1,
            .embed_scale = 1,
            .qkv_bias = KV_WUSE_NONE,
            .tied_default = 1,
            .hf_class = "Gemma2ForCausalLM",
            .gguf_arch = "gemma2",
            .gguf_rope_half = 1,
            .hf_attn = "self_attn.",
            .hf_refused = gemma2_hf_refused,
            .n_hf_refused = COUNT(gemma2_hf_refused),
            .hf = {"model.layers.", NULL, llama_hf_globals, COUNT(llama_hf_globals),
                   gemma2_hf_layer, COUNT(gemma2_hf_layer)},
            .gguf = {"blk.", NULL, llama_gguf_globals, COUNT(llama_gguf_globals),
                     gemma2_gguf_layer, COUNT(gemma2_gguf_layer)},
            .lr_layer = gemma2_lr_layer,
            .n_lr_layer = COUNT(gemma2_lr_layer),
        },
    [KV_ARCH_GPTNEOX] =
        {
            .id = KV_ARCH_GPTNEOX,
            .name = "gpt_neox",
            .layernorm = 1,
            .rope = 1,
            .gelu_mlp = 1,
            .qkv_bias = KV_WUSE_REQUIRED,
            .block_biases = 1,
            .mha = 1,
            .hf_class = "GPTNeoXForCausalLM",
            .gguf_arch = "gptneox",
            .gguf_rope_half = 1,
            .hf_attn = "attention.",
            .hf = {NEOX_PREFIX "layers.", NULL, neox_hf_globals, COUNT(neox_hf_globals),
                   neox_hf_layer, COUNT(neox_hf_layer)},
            .gguf = {"blk.", NULL, neox_gguf_globals, COUNT(neox_gguf_globals),
                     neox_gguf_layer, COUNT(neox_gguf_layer)},
            .lr_layer = neox_lr_layer,
            .n_lr_layer = COUNT(neox_lr_layer),
        },
};

const struct kv_arch_desc *kv_arch_desc(enum kv_arch a) {
    KV_ASSERT((unsigned)a < sizeof archs / sizeof archs[0] && archs[a].name);
    return &archs[a];
}

const struct kv_arch_desc *kv_arch_by_name(const char *name) {
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (archs[i].name && !strcmp(archs[i].name, name)) return &archs[i];
    return NULL;
}

const char *kv_arch_name(enum kv_arch a) {
    return (unsigned)a < sizeof archs / sizeof archs[0] && archs[a].name ? archs[a].name : "?";
}

const struct kv_arch_tensor *kv_arch_find(const struct kv_arch_names *names, enum kv_wkind kind,
                                          int *part) {
    int per_layer = kind >= KV_W_FIRST_LAYER;
    const struct kv_arch_tensor *t = per_layer ? names->layer : names->globals;
    int64_t n = per_layer ? names->n_layer : names->n_globals;
    for (int64_t i = 0; i < n; i++)
        for (int k = 0; k < t[i].n_kinds; k++)
            if (t[i].kinds[k] == kind) {
                if (part) *part = k;
                return &t[i];
            }
    return NULL;
}

const char *kv_arch_unprefixed(const struct kv_arch_names *names, const char *name) {
    const char *p = names->optional_prefix;
    size_t n = p ? strlen(p) : 0;
    return p && !strncmp(name, p, n) ? name + n : NULL;
}

/* "a, b or c" of the rows' names (gguf: their GGUF names, skipping rows
 * without one), each in quotes when quoted. */
static void name_list(char *list, size_t cap, int gguf, int quoted) {
    size_t n = 0, count = 0, total = 0;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        total += (gguf ? archs[i].gguf_arch : archs[i].name) != NULL;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++) {
        const char *nm = gguf ? archs[i].gguf_arch : archs[i].name;
        if (!nm) continue;
        const char *sep = count == 0 ? "" : count + 1 == total ? " or " : ", ";
        const char *q = quoted ? "'" : "";
        n += (size_t)snprintf(list + n, cap - n, "%s%s%s%s", sep, q, nm, q);
        count++;
    }
}

const char *kv_arch_list(int quoted) {
    static char lists[2][256];
    char *list = lists[quoted != 0];
    /* the table is constant, so every caller writes the same bytes */
    if (!list[0]) name_list(list, sizeof lists[0], 0, quoted);
    return list;
}

int kv_arch_has_rope(enum kv_arch a) { return kv_arch_desc(a)->rope; }

int64_t kv_rope_dim(const struct kv_config *c) { return c->rope_dim > 0 ? c->rope_dim : c->head_dim; }

int kv_arch_entry_shape(const struct kv_config *c, const struct kv_arch_tensor *e, int64_t rows[3],
                        int64_t *total, int64_t *cols) {
    int64_t s[2];
    int nd = 0;
    *total = 0, *cols = 1;
    for (int k = 0; k < e->n_kinds; k++) {
        nd = kv_model_expected_shape(c, e->kinds[k], s);
        rows[k] = s[0];
        *total += s[0];
        if (nd == 2) *cols = s[1];
    }
    return nd;
}

float kv_attn_scale(const struct kv_config *c) {
    return c->attn_scale > 0 ? c->attn_scale : (float)(1.0 / sqrt((double)c->head_dim));
}

int64_t kv_layer_window(const struct kv_config *c, int64_t l) {
    if (c->sliding_window <= 0 || l < c->window_from) return 0;
    int64_t p = c->window_period > 0 ? c->window_period : 1;
    return (l - c->window_from) % p == 0 ? c->sliding_window : 0;
}

int kv_arch_valid(int a) {
    return a >= 0 && (size_t)a < sizeof archs / sizeof archs[0] && archs[a].name != NULL;
}

const char *kv_arch_gguf_list(void) {
    static char list[256];
    if (!list[0]) name_list(list, sizeof list, 1, 1);
    return list;
}
