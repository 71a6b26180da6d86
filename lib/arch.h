/* Architectures as data (internal).
 *
 * One row per architecture says everything the layers above need to know
 * about it: the forward and backward passes read the norm, the positions
 * and the MLP; the model checks which weights it has; the loaders and
 * writers (formats/) read the tensor names of each format; decomposition
 * and the runtime read whether keys are rotary. Adding a model family
 * means adding a row here, its names, and only what is truly new (a config
 * parser, a new kind of layer), not a branch in every file.
 *
 * Weights are the per-model enum kv_wkind of model.h. */
#ifndef KV_ARCH_H
#define KV_ARCH_H

#include "kvcal_core.h"
#include "model.h"

/* One stored tensor of a format: its name (a per-layer name follows the
 * format's layer prefix and the layer number: "model.layers.3." + name)
 * and the weights it holds, stacked along its rows (GPT-2's c_attn holds
 * q, k and v). conv: stored transposed, [in, out] (HF GPT-2's Conv1D). */
struct kv_arch_tensor {
    const char *name;
    enum kv_wkind kinds[3];
    int n_kinds;
    int conv;
    /* the stacked kinds interleaved per head, rows [h][n_kinds][d_h] (HF
     * GPT-NeoX's query_key_value: q, k, v of head 0, then of head 1, ...);
     * 0: each kind's rows whole, one after the other */
    int heads;
};

/* One format's names for an architecture. */
struct kv_arch_names {
    const char *layer_prefix;          /* "model.layers.", "blk." */
    /* a prefix stored names may come without ("transformer." for HF GPT-2,
     * whose checkpoints exist both ways); NULL when none */
    const char *optional_prefix;
    const struct kv_arch_tensor *globals;
    int64_t n_globals;
    const struct kv_arch_tensor *layer;
    int64_t n_layer;                   /* 0: kvcal has no mapping for this format */
};

struct kv_arch_desc {
    enum kv_arch id;
    const char *name;       /* "llama", "gpt2": kv_arch_name, manifests, messages */
    int layernorm;          /* LayerNorm with bias (mean removed) instead of RMSNorm */
    int rope;               /* rotary q/k; otherwise learned positions added to the embedding */
    int gelu_mlp;           /* up(+bias) -> GELU(tanh) -> down(+bias) instead of SwiGLU */
    int qk_norm;            /* per-head RMSNorm of q and k (weights [d_h]) before RoPE */
    int geglu;              /* gated MLP with GELU(tanh) in place of SiLU (Gemma) */
    int post_norms;         /* RMSNorm of attention's and the MLP's outputs before each
                               residual add (Gemma 2) */
    int embed_scale;        /* the embedding row times sqrt(d) (Gemma) */
    int qkv_bias;           /* KV_WUSE_OPTIONAL or KV_WUSE_REQUIRED (model.h) */
    int block_biases;       /* output projection, MLP and norm biases, all required */
    int mha;                /* as many KV heads as query heads */
    int tied_default;       /* a fresh model of the family (kvcal train) ties its head */
    const char *hf_class;   /* config.json "architectures" entry kvcal writes */
    const char *gguf_arch;  /* GGUF general.architecture (and its keys' prefix), or NULL */
    int gguf_rope_half;     /* llama.cpp rotates this architecture's GGUF heads as pairs
                               (i, i + d_h/2) ("neox"), with weights stored as in HF;
                               else as pairs (2i, 2i+1) of permuted weights (llama) */
    const char *hf_attn;    /* HF module path of the attention block in a layer
                               ("self_attn.", "attn."): compressed tensors are named
                               after it */
    /* HF per-layer tensors some checkpoints carry that kvcal's forward pass
     * has no place for: a checkpoint holding one is refused by name */
    const char *const *hf_refused;
    int64_t n_hf_refused;
    struct kv_arch_names hf, gguf;
    /* The weights file of a compressed model directory (formats/lrweights.c):
     * hf's globals, then per layer these, in this order, one weight each in
     * [out, in] (nothing stacked or transposed) after hf.layer_prefix; the
     * entry of kind KV_W_K with a NULL name stands for the K and V sides,
     * named after hf_attn. */
    const struct kv_arch_tensor *lr_layer;
    int64_t n_lr_layer;
};

/* The rows of each kind entry e stacks (rows[k]), their total and the
 * columns they share (1 for vectors) in config c; returns the number of
 * dimensions (1 or 2). */
int kv_arch_entry_shape(const struct kv_config *c, const struct kv_arch_tensor *e, int64_t rows[3],
                        int64_t *total, int64_t *cols);

/* The row of architecture a (KV_ASSERT on an unknown one). */
const struct kv_arch_desc *kv_arch_desc(enum kv_arch a);
/* 1 when a names a row of the table (for loops over every architecture). */
int kv_arch_valid(int a);
/* The GGUF general.architecture names kvcal reads, for messages:
 * "'llama' or 'qwen2'". */
const char *kv_arch_gguf_list(void);
/* The row named name ("llama"), or NULL. */
const struct kv_arch_desc *kv_arch_by_name(const char *name);

/* Every architecture's name, for messages that say what was expected:
 * "'llama' or 'gpt2'" (quoted) or "llama or gpt2". */
const char *kv_arch_list(int quoted);

/* name without names' optional prefix ("transformer.h.0.ln_1.weight" ->
 * "h.0.ln_1.weight"), or NULL when names has none or name lacks it. */
const char *kv_arch_unprefixed(const struct kv_arch_names *names, const char *name);

/* The entry of names holding weight kind (global or per layer), or NULL;
 * *part receives its index among the entry's stacked kinds. */
const struct kv_arch_tensor *kv_arch_find(const struct kv_arch_names *names, enum kv_wkind kind,
                                          int *part);

#endif
