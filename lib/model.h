/* In-memory model description shared by every loader (internal).
 *
 * Loaders (formats/) parse a config into struct kv_config, call
 * kv_model_create, append their tensor table with kv_model_add_tensors, bind
 * each weight with kv_model_bind (which checks its shape against the config
 * and converts it to f32, as a view when the stored bytes already are aligned
 * little-endian f32), and finish with kv_model_finish.
 *
 * Every linear weight is [out, in] row-major (HF layout), so y = x Wᵀ.
 *
 * Architectures share one forward pass and one weight table:
 *   llama: RMSNorm, RoPE, GQA, SwiGLU (gate, up, down), optional q/k/v biases;
 *   gpt2:  LayerNorm with bias (norm + norm_b), learned positions (pos_emb),
 *          MHA with q/k/v/o biases, MLP up (c_fc) + GELU(tanh) + down
 *          (c_proj) with biases, no gate. */
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include "kvcal_core.h"

enum kv_wkind {
    KV_W_TOK_EMB = 0, /* [vocab, d] */
    KV_W_OUT_NORM,    /* [d] */
    KV_W_LM_HEAD,     /* [vocab, d]; absent when tied */
    KV_W_POS_EMB,     /* [max_seq_len, d] learned positions (GPT-2) */
    KV_W_OUT_NORM_B,  /* [d] final LayerNorm bias (GPT-2) */
    /* per layer: */
    KV_W_ATTN_NORM,   /* [d] */
    KV_W_Q,           /* [h*d_h, d] */
    KV_W_K,           /* [g*d_h, d] */
    KV_W_V,           /* [g*d_h, d] */
    KV_W_O,           /* [d, h*d_h] */
    KV_W_BQ,          /* [h*d_h] optional */
    KV_W_BK,          /* [g*d_h] optional */
    KV_W_BV,          /* [g*d_h] optional */
    KV_W_FFN_NORM,    /* [d] */
    KV_W_GATE,        /* w1: [hidden, d] */
    KV_W_DOWN,        /* w2: [d, hidden] */
    KV_W_UP,          /* w3: [hidden, d]; GPT-2's c_fc */
    KV_W_ATTN_NORM_B, /* [d] LayerNorm biases, output projection bias and MLP */
    KV_W_BO,          /* [d]      biases: GPT-2 only */
    KV_W_FFN_NORM_B,  /* [d] */
    KV_W_BUP,         /* [hidden] c_fc bias */
    KV_W_BDOWN,       /* [d]      c_proj bias */
    KV_W_QNORM,       /* [d_h] per-head RMSNorm of q before RoPE (Qwen3) */
    KV_W_KNORM,       /* [d_h] per-head RMSNorm of k before RoPE (Qwen3) */
    KV_W_POST_ATTN_NORM, /* [d] RMSNorm of attention's output before the residual (Gemma 2) */
    KV_W_POST_FFN_NORM,  /* [d] RMSNorm of the MLP's output before the residual (Gemma 2) */
    KV_W_COUNT
};
#define KV_W_FIRST_LAYER KV_W_ATTN_NORM

/* A weight as its file stores it (F16, BF16, unaligned F32 or a GGUF
 * block type), kept mapped and converted when used: a streamed model's
 * weights (kv_model_streaming). */
struct kv_wsrc {
    const void *data; /* NULL: the weight is an f32 pointer (or absent) */
    enum kv_dtype dtype; /* KV_DTYPE_COUNT with block_type for a block type */
    uint32_t block_type;
    int64_t n, cols;  /* elements, and the row length */
};

struct kv_layer {
    /* indexed by per-layer enum kv_wkind: f32 views or converted blocks of a
     * resident model; NULL where a streamed model keeps src (use
     * kv_model_layer / kv_model_weight, which convert) */
    const float *w[KV_W_COUNT];
    struct kv_wsrc src[KV_W_COUNT];
};

/* One converted layer of a streamed model. */
struct kv_lslot {
    int64_t layer; /* -1: empty */
    const float *w[KV_W_COUNT];
    float *buf;
    int64_t cap;
};

struct kv_cleanup {
    void (*fn)(void *);
    void *ctx;
};

struct kv_model {
    struct kv_config cfg;
    enum kv_format format;
    /* streamed: weights not stored as aligned f32 stay in the file's dtype
     * (src) and are converted per layer into one slot as used */
    int streamed;
    struct kv_wsrc gsrc[KV_W_FIRST_LAYER];
    struct kv_lslot lslot;
    void *lock;                                /* pthread_mutex_t, streamed only */
    const float *tok_emb, *out_norm, *lm_head; /* lm_head == tok_emb when tied */
    const float *pos_emb, *out_norm_b;         /* GPT-2 only, else NULL */
    struct kv_layer *layers;                   /* [n_layers] */
    struct kv_tokenizer *tok;                  /* owned, may be NULL */
    struct kv_tensor *tensors;                 /* source tensor table */
    int64_t n_tensors, cap_tensors;
    void **owned;                              /* malloc'd blocks (converted weights) */
    int64_t n_owned, cap_owned;
    struct kv_cleanup *cleanups;               /* e.g. munmap of source files */
    char fingerprint[65];                      /* kv_model_fingerprint, once computed
                                                  ("" before); weights never change */
    int64_t n_cleanups, cap_cleanups;
};

/* Validate cfg (positive dims, h % g == 0, even head_dim, limits) and
 * allocate an empty model. path names the source in messages. */
int kv_model_create(const struct kv_config *cfg, enum kv_format fmt, const char *path,
                    struct kv_model **out, struct kv_err *err);

/* Register fn(ctx) to run at kv_model_close (in reverse order). */
int kv_model_on_close(struct kv_model *m, void (*fn)(void *), void *ctx, struct kv_err *err);

/* Append tensors to the table shown by `kvcal inspect` (copied). */
int kv_model_add_tensors(struct kv_model *m, const struct kv_tensor *t, int64_t n,
                         struct kv_err *err);

/* Bind tensor t as weight `kind` of `layer` (ignored for global kinds).
 * Checks dtype (F32/F16/BF16) and shape against the config; on mismatch the
 * message names path, the tensor and found vs expected shape. */
int kv_model_bind(struct kv_model *m, enum kv_wkind kind, int64_t layer,
                  const struct kv_tensor *t, const char *path, struct kv_err *err);

/* Check every required weight is bound (naming the first missing one), tie
 * the head to the embedding when cfg.tied_embeddings, and take ownership of
 * tok (may be NULL). */
int kv_model_finish(struct kv_model *m, const char *path, struct kv_err *err);

/* 1 when the five attention shapes (layers, dim, heads, kv heads, head
 * dim) equal cfg's; else 0 and KV_EINVAL in err: "<what> are for L layers,
 * dim d, h heads (g kv) of d_h, but the model has ...", naming path. */
int kv_shapes_match(const struct kv_config *cfg, int64_t n_layers, int64_t dim, int64_t n_heads,
                    int64_t n_kv_heads, int64_t head_dim, const char *what, const char *path,
                    struct kv_err *err);

/* RoPE (lib/rope.c). The inverse frequencies of c's head_dim/2 rotated
 * pairs for a sequence of seq_len positions, after c's rope_scaling, into
 * inv_freq; returns the factor cos and sin are multiplied by (yarn,
 * longrope; else 1). */
double kv_rope_freqs(const struct kv_config *c, int64_t seq_len, double *inv_freq);
/* cos/sin [n_pos][head_dim/2] of pos·inv_freq times that factor, computed
 * in double and rounded once to float (the table every rotary path uses). */
void kv_rope_table(const struct kv_config *c, int64_t seq_len, int64_t n_pos, float *cos_out,
                   float *sin_out);
/* 1 when a and b rotate alike: the same frequencies and factor for every
 * length up to either's original context and past it. */
int kv_rope_same(const struct kv_config *a, const struct kv_config *b);
/* 1 when c's frequencies change with the sequence length (dynamic, longrope). */
int kv_rope_depends_on_length(const struct kv_config *c);
/* Check c's rope_scaling parameters (factor, original context, per-pair
 * factors) naming path; KV_EFORMAT. */
int kv_rope_check(const struct kv_config *c, const char *path, struct kv_err *err);
/* KV_EUNSUPPORTED when c's frequencies depend on the length and seq_len
 * passes the original context (kvcal builds one table per run). */
int kv_rope_check_length(const struct kv_config *c, int64_t seq_len, struct kv_err *err);

/* "[d0, d1, ...]" of a row-major shape of nd dims into buf; returns buf. */
const char *kv_shape_str(char *buf, size_t cap, const int64_t *shape, int nd);

/* Expected row-major shape of a weight kind; returns ndim. */
int kv_model_expected_shape(const struct kv_config *cfg, enum kv_wkind kind, int64_t shape[2]);
/* Whether cfg's architecture uses weight `kind`: KV_WUSE_NONE, KV_WUSE_REQUIRED
 * or KV_WUSE_OPTIONAL (Llama's q/k/v biases; the head when tied is NONE). */
enum { KV_WUSE_NONE = 0, KV_WUSE_REQUIRED = 1, KV_WUSE_OPTIONAL = 2 };
int kv_wkind_use(const struct kv_config *cfg, enum kv_wkind kind);
/* Elements of weight kind that kv_model_init_random allocates for cfg, over
 * every layer (0 when it allocates none): the count to check against
 * memory before building a model. */
double kv_model_random_elems(const struct kv_config *cfg, enum kv_wkind kind);
/* The bound weight of kind (layer ignored for global kinds), or NULL. For a
 * streamed model a layer's weight is converted with its whole layer into
 * one slot, valid until another layer is asked for; a global
 * one is converted once and kept (use kv_model_rows for the embedding and
 * the head of large models instead). One thread at a time per model. */
const float *kv_model_weight(const struct kv_model *m, enum kv_wkind kind, int64_t layer);
/* Layer l's weights as f32 [KV_W_COUNT] (NULL where absent), as above. */
const float *const *kv_model_layer(const struct kv_model *m, int64_t l);
/* 1 when the model holds weight kind (of layer), streamed or not. */
int kv_model_has(const struct kv_model *m, enum kv_wkind kind, int64_t layer);
/* Rows r0 .. r0+n-1 of weight kind (a matrix [rows, cols], or a vector as
 * one row) as f32 into out, converted from the file when streamed. */
void kv_model_rows(const struct kv_model *m, enum kv_wkind kind, int64_t layer, int64_t r0,
                   int64_t n, float *out);
/* 1 when m keeps its weights in their stored dtype (kv_model_streaming). */
int kv_model_is_streamed(const struct kv_model *m);
/* Mutable weight of a model whose weights kvcal allocated (kv_model_init_random,
 * the trainer); NULL when absent. Never use on a loaded (mapped) model. */
float *kv_model_weight_mut(struct kv_model *m, enum kv_wkind kind, int64_t layer);
const char *kv_wkind_name(enum kv_wkind kind);
/* 1 for the gain of a norm of the residual stream (attention's and the
 * MLP's input norms, Gemma 2's post-norms, the final norm): the weights a
 * config's norm_offset applies to; 0 otherwise (Qwen3's q/k norms too). */
int kv_wkind_is_stream_norm(enum kv_wkind kind);

/* Convert n elements of dtype src to f32 (little-endian source bytes). */
void kv_convert_to_f32(enum kv_dtype src, const void *in, float *out, int64_t n);
float kv_f16_to_f32(uint16_t h);
float kv_bf16_to_f32(uint16_t h);

/* f32 to IEEE binary16: round to nearest, ties to even; magnitudes from
 * 65520 up (and inf) become ±inf; results below 2^-14 are subnormal or ±0.
 * A NaN stays a NaN with the sign and the top 10 payload bits (set to the
 * quiet bit when they would all be zero). */
uint16_t kv_f32_to_f16(float x);
/* f32 to bfloat16 (the top half of an f32): round to nearest, ties to even,
 * overflowing to ±inf. A NaN stays a NaN as f16 above (7 payload bits). */
uint16_t kv_f32_to_bf16(float x);
/* Convert n f32 values to dtype dst (F32, F16 or BF16), little-endian bytes
 * in out (n * kv_dtype_size(dst) bytes). */
void kv_convert_from_f32(enum kv_dtype dst, const float *in, void *out, int64_t n);

#endif
