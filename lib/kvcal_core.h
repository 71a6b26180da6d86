/* kvcal core (lib/): the public API of the lowest layer.
 *
 * Errors, tensors, models in memory, tokenizers, the reference forward and
 * backward passes, perplexity, fingerprints, and the compressed-attention
 * description (struct kv_lowrank) with the latent-cache forward pass that
 * runs it. Loading from files is formats/ (kvformats.h); calibration and
 * decomposition are calib/ (kvcalib.h); programs include kvcal.h, which
 * gathers every layer's header.
 *
 * Every fallible function returns an int status (KV_OK == 0) and fills a
 * caller-owned struct kv_err; nothing in the library prints or exits.
 * Handles are opaque; their _free/_close functions accept NULL. A handle
 * that holds file mappings is released with _close (kv_model_close), a
 * heap object with _free.
 */
#ifndef KVCAL_CORE_H
#define KVCAL_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVCAL_VERSION "0.1.0"

/* ---------------------------------------------------------------- errors */

enum kv_status {
    KV_OK = 0,
    KV_EIO,          /* open/read/write/mmap failed */
    KV_EFORMAT,      /* file contents are malformed or inconsistent */
    KV_EINVAL,       /* bad argument or impossible option */
    KV_ENOMEM,       /* allocation failed */
    KV_ENUMERIC,     /* NaN/Inf or a numerical routine failed */
    KV_EDEVICE,      /* GPU runtime failure */
    KV_EUNSUPPORTED, /* well-formed input kvcal does not handle */
};

#define KV_NO_OFFSET UINT64_MAX

/* The one error channel. Caller-owned; the library fills it on failure. */
struct kv_err {
    int code;              /* enum kv_status */
    char path[1024];       /* file the problem is in, or "" */
    uint64_t off;          /* byte offset in that file, or KV_NO_OFFSET */
    const char *src_file;  /* detection site (for -v) */
    int src_line;
    char msg[1024];        /* lowercase, no final full stop */
};

/* Reset to "no error" (code KV_OK, off KV_NO_OFFSET). */
void kv_err_clear(struct kv_err *err);

/* Render "path: offset N: message" (parts omitted when absent) into buf.
 * verbose appends " [file.c:line]". Returns the length written. */
size_t kv_err_format(const struct kv_err *err, char *buf, size_t cap, int verbose);

/* Short name of a status code. */
const char *kv_status_name(int code);

/* ---------------------------------------------------------------- tensors */

enum kv_dtype {
    KV_DTYPE_F32 = 0,
    KV_DTYPE_F16,
    KV_DTYPE_BF16,
    KV_DTYPE_F64,
    KV_DTYPE_I8,
    KV_DTYPE_I16,
    KV_DTYPE_I32,
    KV_DTYPE_I64,
    KV_DTYPE_U8,
    KV_DTYPE_BOOL,
    KV_DTYPE_COUNT
};

/* Name as used by safetensors ("F32", "BF16", ...). */
const char *kv_dtype_name(enum kv_dtype t);
/* Bytes per element. */
size_t kv_dtype_size(enum kv_dtype t);

/* A view of one tensor stored in a file. It owns no bytes: data points into a
 * read-only mapping that lives as long as the model (or parser result) that
 * produced it. shape is row-major: shape[ndim-1] is the contiguous axis, so an
 * HF/GGUF linear weight is [out, in]. */
struct kv_tensor {
    char name[256];
    enum kv_dtype dtype;
    int ndim;
    int64_t shape[4];
    uint64_t offset;   /* absolute byte offset of the data in its file */
    uint64_t nbytes;
    const void *data;
    int file;          /* index of the file (shard) it lives in */
    /* a block-quantized GGUF tensor (dtype KV_DTYPE_COUNT): its ggml type
     * number (Q8_0 = 8, Q4_K = 12, ...); 0 otherwise */
    uint32_t block_type;
};

/* Number of elements (product of shape). */
int64_t kv_tensor_numel(const struct kv_tensor *t);

/* ---------------------------------------------------------------- models */

enum kv_arch {
    KV_ARCH_LLAMA = 0,   /* RMSNorm, RoPE, GQA, SwiGLU */
    KV_ARCH_GPT2 = 1,    /* LayerNorm, learned positions, MHA, GELU(tanh), biases */
    KV_ARCH_MISTRAL = 2, /* llama with an optional sliding window */
    KV_ARCH_QWEN2 = 3,   /* llama with q/k/v biases always, optional sliding window */
    KV_ARCH_PHI3 = 4,    /* llama with fused qkv and gate_up projections */
    KV_ARCH_QWEN3 = 5,   /* qwen2 with per-head RMSNorm of q and k, optional biases */
    KV_ARCH_GPTNEOX = 6, /* LayerNorm, partial RoPE, MHA, GELU, biases, parallel residual */
    KV_ARCH_GEMMA2 = 7,  /* llama with GeGLU, post-norms, scaled embedding, soft-capping */
};
const char *kv_arch_name(enum kv_arch a); /* "llama", "gpt2" */
/* 1 when the architecture rotates queries and keys (RoPE), 0 when it adds
 * learned positions to the embedding instead. */
int kv_arch_has_rope(enum kv_arch a);

/* How RoPE pairs dimensions within a head of size d_h. */
enum kv_rope_layout {
    KV_ROPE_INTERLEAVED = 0, /* pairs (2i, 2i+1): llama2.c, GGUF */
    KV_ROPE_HALF = 1,        /* pairs (i, i + d_h/2): HF rotate_half */
};

enum kv_format { KV_FORMAT_HF = 0, KV_FORMAT_GGUF, KV_FORMAT_LLAMA2C, KV_FORMAT_SYNTHETIC };

/* How RoPE's frequencies are scaled for a context longer than the one the
 * model was trained with (config.json rope_scaling or rope_parameters, GGUF
 * rope.scaling.* and rope_freqs.weight). kv_rope_freqs (model.h) computes
 * them as the reference implementations do; docs/design.md has the
 * formulas. */
enum kv_rope_scaling {
    KV_ROPE_SCALING_NONE = 0, /* theta^(-2i/d) */
    KV_ROPE_SCALING_LINEAR,   /* every frequency / factor */
    KV_ROPE_SCALING_DYNAMIC,  /* NTK: theta raised once a sequence passes original_ctx */
    KV_ROPE_SCALING_LLAMA3,   /* low frequencies / factor, high kept, a smooth band between */
    KV_ROPE_SCALING_YARN,     /* NTK-by-parts ramp between interpolation and extrapolation,
                                 cos and sin scaled by attention_factor */
    KV_ROPE_SCALING_LONGROPE, /* per-frequency divisors short_factor, or long_factor for a
                                 sequence past original_ctx; attention_factor (Phi-3) */
    KV_ROPE_SCALING_FREQS,    /* per-frequency divisors given as data (short_factor):
                                 GGUF's rope_freqs.weight */
};
#define KV_MAX_ROPE_FACTORS 512

/* "linear", "llama3", ...; "default" for none (config.json's rope_type). */
const char *kv_rope_scaling_name(enum kv_rope_scaling t);

struct kv_rope_scaling_cfg {
    enum kv_rope_scaling type;
    double factor;            /* linear, dynamic, llama3, yarn, longrope */
    int64_t original_ctx;     /* the trained context the scaling extends */
    double low_freq_factor, high_freq_factor; /* llama3 */
    double beta_fast, beta_slow;              /* yarn */
    double attention_factor;  /* yarn, longrope: cos and sin are multiplied by it */
    int truncate;             /* yarn: the correction range rounded to whole dimensions */
    int64_t n_factors;        /* longrope, freqs: one per rotated pair */
    float short_factor[KV_MAX_ROPE_FACTORS], long_factor[KV_MAX_ROPE_FACTORS];
};

/* Plain model hyper-parameters (public, copyable). */
struct kv_config {
    enum kv_arch arch;
    int64_t dim;          /* d */
    int64_t hidden_dim;   /* FFN inner size */
    int64_t n_layers;     /* L */
    int64_t n_heads;      /* h */
    int64_t n_kv_heads;   /* g */
    int64_t head_dim;     /* d_h */
    int64_t vocab_size;
    int64_t max_seq_len;  /* trained context (informational for llama; gpt2's
                             learned positions: the forward's context limit) */
    float norm_eps;       /* RMSNorm (llama) or LayerNorm (gpt2) epsilon */
    float rope_theta;     /* llama only */
    enum kv_rope_layout rope_layout;
    struct kv_rope_scaling_cfg rope_scaling; /* type NONE: plain RoPE */
    /* sliding-window attention: a query at position p sees the keys at
     * p - sliding_window + 1 .. p, in the layers l >= window_from with
     * (l - window_from) % window_period == 0; 0: every layer sees every
     * earlier key (kv_layer_window) */
    int64_t sliding_window;
    int32_t window_from, window_period;
    int tied_embeddings;  /* output head shares the embedding matrix */
    int has_qkv_bias;
    int32_t bos_id, eos_id; /* -1 if unknown */
    /* GPT-NeoX (gpt_neox; 0 elsewhere): RoPE turns only the first rope_dim
     * dimensions of each head (0: all d_h; kv_rope_dim), the layer adds
     * attention and MLP of the same input (x + attn(norm1 x) + mlp(norm2 x))
     * when parallel_residual, and the MLP's GELU is erf's, not tanh's, when
     * gelu_erf */
    int64_t rope_dim;
    int parallel_residual;
    int gelu_erf;
    /* Gemma 2 (0 elsewhere): scores are q·k times attn_scale (its
     * query_pre_attn_scalar^-1/2; 0: 1/sqrt(d_h)), then capped as
     * cap·tanh(s/cap) when attn_softcap > 0; the logits likewise by
     * final_softcap; each RMSNorm multiplies by norm_offset + w (HF's Gemma
     * files store w and add 1: norm_offset 1; GGUF's store 1 + w: 0) */
    float attn_scale, attn_softcap, final_softcap, norm_offset;
};

/* The factor of the scores q·k: c->attn_scale, or 1/sqrt(d_h) when 0. */
float kv_attn_scale(const struct kv_config *c);

/* The dimensions of each head that RoPE turns: c->rope_dim, or d_h when 0. */
int64_t kv_rope_dim(const struct kv_config *c);

/* The sliding window of layer l of c, or 0 when it attends to every
 * earlier position. */
int64_t kv_layer_window(const struct kv_config *c, int64_t l);

struct kv_model;      /* weights, tensor table, tokenizer; opaque (kv_model_open in
                         kvformats.h loads one from files) */
struct kv_tokenizer;  /* opaque (kv_tok_open in kvformats.h) */

/* A model with random N(0, 0.02) weights (norms 1), for tests and benchmarks.
 * cfg->vocab_size etc. must be set; rope layout and ids are taken as given. */
int kv_model_init_random(const struct kv_config *cfg, uint64_t seed, struct kv_model **out,
                         struct kv_err *err);

/* Whether models opened from now on keep their weights in the file's dtype,
 * converting one layer at a time into float32 as it is used (streamed), or
 * convert them all at load: 0 (the default) streams a model whose float32
 * weights would pass 2 GiB, 1 streams every model, -1 none. Aligned F32
 * weights are always used in place. Process-wide; set it before opening. */
void kv_model_streaming(int mode);

/* Release a model: its weights, tokenizer and the file mappings they view. */
void kv_model_close(struct kv_model *m);

const struct kv_config *kv_model_config(const struct kv_model *m);
enum kv_format kv_model_format(const struct kv_model *m);
const char *kv_format_name(enum kv_format f);
/* The model's tokenizer, or NULL when it has none (llama2.c without --tokenizer). */
const struct kv_tokenizer *kv_model_tokenizer(const struct kv_model *m);
/* Tensor table of the source files, in file order. */
int64_t kv_model_n_tensors(const struct kv_model *m);
const struct kv_tensor *kv_model_tensor(const struct kv_model *m, int64_t i);
/* Number of parameters the forward pass uses. */
int64_t kv_model_n_params(const struct kv_model *m);

/* ---------------------------------------------------------------- tokenizer */

/* Release a tokenizer (not one a model owns: kv_model_close frees that). */
void kv_tok_free(struct kv_tokenizer *tok);

int32_t kv_tok_n_vocab(const struct kv_tokenizer *tok);
int32_t kv_tok_bos(const struct kv_tokenizer *tok);
int32_t kv_tok_eos(const struct kv_tokenizer *tok);
/* The bytes of piece id (not NUL-terminated; raw bytes for byte-level
 * vocabularies), or NULL for an id outside the vocabulary. */
const char *kv_tok_piece(const struct kv_tokenizer *tok, int32_t id, size_t *len);

/* Encoding flags. KV_TOK_ADD_BOS prepends the BOS id, KV_TOK_ADD_EOS
 * appends EOS; KV_TOK_PARSE_SPECIAL turns special-token strings in the text
 * ("<s>", "<|endoftext|>") into their control ids. Without it they are
 * encoded as the text they are (counted: kv_tok_stream_specials), so a
 * document that holds "</s>" cannot end a sequence early. */
#define KV_TOK_ADD_BOS 1
#define KV_TOK_PARSE_SPECIAL 2
#define KV_TOK_ADD_EOS 4

/* The tokenizer's own policy (tokenizer_config.json's add_bos_token, the
 * post-processor's template, GGUF's add_bos_token; llama2.c: BOS) as
 * KV_TOK_ADD_BOS | KV_TOK_ADD_EOS flags, only those whose id exists. */
int kv_tok_policy(const struct kv_tokenizer *tok);
int kv_tok_adds_bos(const struct kv_tokenizer *tok);
int kv_tok_adds_eos(const struct kv_tokenizer *tok);

/* Encode len bytes of UTF-8 text with KV_TOK_* flags. *ids is malloc'd
 * (caller frees), *n_ids set. Cost O(n log n) in the text length. */
int kv_tok_encode(const struct kv_tokenizer *tok, const char *text, size_t len, int flags,
                  int32_t **ids, int64_t *n_ids, struct kv_err *err);

/* Streaming encoder: the text fed in pieces gives, concatenated over the
 * calls, exactly kv_tok_encode's tokens of the whole text, encoded in
 * slices of about `chunk` bytes (0: 64 KiB), in memory of that order
 * rather than of the text. It cuts where no merge can span and no
 * literal token starts, ends or lies: for a pre-tokenizing (Hugging Face
 * pipeline) tokenizer, before a ' ' between an ASCII letter or digit and an
 * ASCII letter, where its pre-tokenizer was found to split when it was
 * built; else before a ' ' that follows another character (unless a
 * vocabulary piece holds a space after another character), or before an
 * ASCII character without a piece of its own (a byte-fallback '\n' in most
 * SentencePiece vocabularies). Text without such a place is gathered whole
 * (up to eof). feed appends len
 * bytes (eof: the text ends with them) and sets *ids, *n_ids to the tokens
 * now settled, owned by the stream until its next call. */
struct kv_tok_stream;
int kv_tok_stream_new(const struct kv_tokenizer *tok, int flags, size_t chunk,
                      struct kv_tok_stream **out, struct kv_err *err);
/* Special-token strings the text held so far that were encoded as text
 * (without KV_TOK_PARSE_SPECIAL). */
int64_t kv_tok_stream_specials(const struct kv_tok_stream *s);
int kv_tok_stream_feed(struct kv_tok_stream *s, const char *text, size_t len, int eof,
                       const int32_t **ids, int64_t *n_ids, struct kv_err *err);
void kv_tok_stream_free(struct kv_tok_stream *s);

/* Bytes of token id as text, given the previous token (SentencePiece strips
 * the dummy-prefix space after BOS). Byte tokens decode to their byte.
 * Writes at most cap bytes (no NUL) and returns the full length. */
size_t kv_tok_decode(const struct kv_tokenizer *tok, int32_t prev, int32_t id, char *out,
                     size_t cap);
/* ---------------------------------------------------------------- forward */

/* Hook points for statistics and compressed K/V paths. Any may be NULL. A
 * non-zero return aborts the forward pass with that status. Shapes:
 *   x:  [n, d]            attention input after the norm
 *   q:  [n, h*d_h]        post-RoPE queries, head i in columns i*d_h..
 *   k:  [n, g*d_h]        post-RoPE keys
 *   v:  [n, g*d_h]        values
 * pos0 is the absolute position of row 0. */
struct kv_fwd_hooks {
    void *ctx;
    int (*attn_in)(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0);
    int (*qk_rope)(void *ctx, int64_t layer, const float *q, const float *k, int64_t n,
                   int64_t pos0);
    /* Replace the K/V path: called with x and the freshly computed post-RoPE k
     * and v; it may overwrite k and v (e.g. with a low-rank reconstruction)
     * before they enter the cache. */
    int (*kv_replace)(void *ctx, int64_t layer, const float *x, float *k, float *v, int64_t n,
                      int64_t pos0);
    /* The residual stream after layer `layer` (attention and FFN added),
     * x [n, d]. */
    int (*layer_out)(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0);
    /* Replace the attention block (an external runtime, kernels/kvrt.h):
     * called with the attention input x [n, d] at positions pos0.., it must
     * add the block's output (output projection applied, without its bias)
     * to the residual res [n, d]. The forward's own attention, its cache and
     * the qk_rope/kv_replace hooks are skipped for every layer. */
    int (*attn)(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0, float *res);
    /* The attention block's output y [n, d] (output projection applied,
     * without its bias) just before it is added to the residual, on the
     * full and latent paths alike. */
    int (*attn_out)(void *ctx, int64_t layer, const float *y, int64_t n, int64_t pos0);
    /* Non-zero when only the hooks need the pass (statistics): it stops
     * after the last layer's hooks, with no attention or FFN in that layer
     * and no logits (kv_fwd_logits is then NULL). */
    int hooks_only;
};

struct kv_fwd; /* activations + KV cache for up to max_ctx positions */

/* Allocate a forward state for sequences of at most max_ctx positions. */
int kv_fwd_init(const struct kv_model *m, int64_t max_ctx, struct kv_fwd **out,
                struct kv_err *err);
void kv_fwd_free(struct kv_fwd *f);
void kv_fwd_set_hooks(struct kv_fwd *f, const struct kv_fwd_hooks *hooks);
/* Every run of f will be one whole window from position 0, keeping nothing
 * between runs: all layers then share one layer's cache (keys and values,
 * or latents) instead of each holding its own, so the caches take one
 * layer's memory, not n_layers'. kv_fwd_run then refuses pos0 > 0. */
void kv_fwd_one_window(struct kv_fwd *f);

/* Run n tokens at positions pos0..pos0+n-1, attending to the cache [0, pos0)
 * plus themselves (causal). Positions >= pos0 in the cache are overwritten.
 * If logits is non-NULL it receives [n, vocab] logits (row i predicts the
 * token after position pos0+i). */
int kv_fwd_run(struct kv_fwd *f, const int32_t *tokens, int64_t n, int64_t pos0, float *logits,
               struct kv_err *err);

/* Runs of f stop after the final norm and compute no logits (kv_fwd_logits
 * is NULL after one); kv_fwd_head then computes any rows of them, so a
 * caller can score a long window with a large vocabulary a slice of
 * positions at a time. */
void kv_fwd_defer_head(struct kv_fwd *f);
/* The logits [n, vocab] of positions i0..i0+n-1 of the last run (deferred
 * head only) into logits, or into f's own buffer when NULL (kv_fwd_logits
 * then points there). KV_EINVAL for rows outside the last run. */
int kv_fwd_head(struct kv_fwd *f, int64_t i0, int64_t n, float *logits, struct kv_err *err);

/* Pointer to the logits of the last run ([n, vocab]), valid until the next run. */
const float *kv_fwd_logits(const struct kv_fwd *f);

/* Floating point operations of one kv_fwd_run of n tokens starting at pos0
 * (2 per multiply-add, projections + attention + head). */
double kv_fwd_flops(const struct kv_model *m, int64_t n, int64_t pos0);

/* Monotonic wall clock in seconds: the clock of every `seconds` the
 * library reports, so a caller timing around a call agrees with it. */
double kv_now(void);

/* Set the process-wide thread count of BLAS and OpenMP, which every
 * parallel loop of the library uses (<= 0 leaves the default: all cores). */
void kv_set_threads(int n);

/* ---------------------------------------------------------------- gradients */

/* Training forward and backward pass (lib/backward.c), both architectures.
 * One run takes a window of n+1 tokens: inputs tokens[0..n) at positions
 * 0..n-1, targets tokens[1..n]. The loss is the mean next-token
 * cross-entropy over the n targets (float64). Activations are fp32 and the
 * whole window is kept, so memory is O(L·n·(d + hidden) + h·n²). */
struct kv_grad;
int kv_grad_init(const struct kv_model *m, int64_t max_n, struct kv_grad **out,
                 struct kv_err *err);
void kv_grad_free(struct kv_grad *g);
/* Forward + backward of one window; overwrites every gradient buffer. */
int kv_grad_run(struct kv_grad *g, const int32_t *tokens, int64_t n, double *loss,
                struct kv_err *err);
/* Forward only (the same code path as kv_grad_run): mean loss of the window. */
int kv_grad_loss(struct kv_grad *g, const int32_t *tokens, int64_t n, double *loss,
                 struct kv_err *err);
/* Parameter tensors of the model, in a fixed order (globals, then per layer):
 * kvcal's name ("blk.2.k projection"), element count, the weight and its
 * gradient from the last run. A tied head has no entry of its own (its
 * gradient is added into the embedding's). i in 0 .. kv_grad_n_tensors-1. */
int64_t kv_grad_n_tensors(const struct kv_grad *g);
const char *kv_grad_tensor(const struct kv_grad *g, int64_t i, int64_t *count,
                           const float **weight, const float **grad);
/* ∂loss/∂(key projection output) [n, g*d_h] of layer l from the last run:
 * the gradient with respect to k = x W_kᵀ + b_k before RoPE (equal to the
 * post-projection output for gpt2); the same for values. */
const float *kv_grad_k(const struct kv_grad *g, int64_t layer);
const float *kv_grad_v(const struct kv_grad *g, int64_t layer);

/* ---------------------------------------------------------------- perplexity */

/* Windows protocol (DESIGN §8): tokens are one document with BOS at its
 * start; cut into non-overlapping windows of seq_len, drop the remainder, run
 * each window on its own and score positions 1..seq_len-1. */
struct kv_ppl_result {
    int64_t tokens;    /* document tokens including BOS */
    int64_t windows;   /* windows evaluated */
    int64_t scored;    /* predictions scored */
    double nll_sum;    /* sum of -log p, float64 */
    double nll;        /* nll_sum / scored */
    double ppl;        /* exp(nll) */
    double seconds;    /* wall time of the forward passes */
};

/* Called after each window; return non-zero to stop early (status KV_EINVAL). */
typedef int (*kv_progress_fn)(void *ctx, int64_t done, int64_t total, int64_t tokens_done);

int kv_ppl_run(const struct kv_model *m, const int32_t *tokens, int64_t n_tokens,
               int64_t seq_len, int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
               struct kv_ppl_result *out, struct kv_err *err);

/* Numerically stable -log softmax(logits)[target] in float64. */
double kv_nll_row(const float *logits, int64_t vocab, int32_t target);


/* ---------------------------------------------------------------- hashing */

/* Lowercase hex SHA-256 of len bytes (65 bytes with the NUL). */
void kv_sha256_hex(const void *data, size_t len, char hex[65]);

/* Model fingerprint (hex SHA-256) over the config and, for every weight the
 * forward pass uses, kvcal's name for it ("blk.3.k projection"), its shape
 * and its f32 data. It does not depend on the container, so the same weights
 * in GGUF and in safetensors share a fingerprint. One parallel pass over the
 * weights, on the first call only (the model remembers it); fails only for
 * lack of memory. */
int kv_model_fingerprint(const struct kv_model *m, char hex[65], struct kv_err *err);
/* ---------------------------------------------------------------- low-rank K/V */

/* How one layer's keys or values are cached (DESIGN §4, manifest "mode"). */
enum kv_lr_mode {
    KV_LR_FULL = 0,          /* not compressed: the original projection */
    KV_LR_PREROPE_LATENT,    /* z = x downᵀ + c; k = RoPE(z upᵀ) per head */
    KV_LR_FUSED_QUERY,       /* non-RoPE keys: z = x downᵀ + c; q' = x q_fusedᵀ + q_fused_bias;
                                score q'·z (up folded into the query, gpt2) */
    KV_LR_FUSED_OUTPUT,      /* values: z = x downᵀ + c; out = (P z) o_fusedᵀ */
    KV_LR_POSTROPE_ROTATION, /* z = RoPE(x W_kᵀ + b) rotᵀ per KV head; q' = q rotᵀ */
};
const char *kv_lr_mode_name(enum kv_lr_mode m);

/* A compressed model's attention (opaque): what kvcal decompose builds,
 * what the output directory stores (kv_lr_dir_open, kvformats.h) and what
 * the latent-cache forward pass runs. Per layer, keys (which = 0) and
 * values (which = 1) each have a mode and units: unit u covers KV heads
 * head0 .. head0+n_heads-1 with one rank. */
struct kv_lowrank;

/* The compressed model as a whole (a copy; kv_lr_info). */
struct kv_lr_info {
    char method[16];             /* "palu", "eigen", ... */
    char alloc[16];              /* "uniform", "eps", ... */
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim;
    char model_fingerprint[65];  /* of the base model */
    int kv_bits;                 /* latent storage: 16 (fp16) or 8/4/3/2 (quantized), or
                                    KV_LR_BITS_MIXED: each unit's own bands */
    int hadamard;                /* a Walsh-Hadamard matrix is fused into the factors
                                    (with bands: one per band) */
};
/* Mixed latent storage (decompose --kv-bits auto): each compressed unit's
 * latent coordinates, in basis order, fall into up to KV_LR_MAX_BANDS
 * bands of strictly falling bits (16, 8, 4, 3, 2); a quantized band is
 * quantized per token on its own (its own scale and zero point). */
#define KV_LR_BITS_MIXED 0
#define KV_LR_MAX_BANDS 5
struct kv_lr_band {
    int64_t n; /* latent coordinates, >= 1 */
    int bits;  /* 16 (fp16), 8, 4, 3 or 2 */
};
/* One unit (a copy; kv_lr_unit_info). energy and dropped are calibration
 * sums (Σ over tokens of squared norms in the unit's metric); dropped/energy
 * is the predicted relative error. */
struct kv_lr_unit_info {
    int64_t head0, n_heads;
    int64_t rank;
    double energy, dropped;
    int n_bands; /* 0 unless the model's kv_bits is KV_LR_BITS_MIXED */
    struct kv_lr_band bands[KV_LR_MAX_BANDS];
};

void kv_lr_free(struct kv_lowrank *lr);
struct kv_lr_info kv_lr_info(const struct kv_lowrank *lr);
/* Layer l's keys (which 0) or values (which 1): their mode, their units
 * (0 for KV_LR_FULL) and unit u of them. l, which and u must be in range. */
enum kv_lr_mode kv_lr_mode_of(const struct kv_lowrank *lr, int64_t l, int which);
int64_t kv_lr_n_units(const struct kv_lowrank *lr, int64_t l, int which);
struct kv_lr_unit_info kv_lr_unit_info(const struct kv_lowrank *lr, int64_t l, int which,
                                       int64_t u);
/* The predicted relative error of layer l's keys or values: Σ dropped / Σ
 * energy over its units (0 without energy); adds the sums to *energy and
 * *dropped when they are not NULL. */
double kv_lr_side_error(const struct kv_lowrank *lr, int64_t l, int which, double *energy,
                        double *dropped);

/* The latent storage widths kvcal runs: 16 (fp16) and 8, 4, 3, 2 bits
 * (per-token asymmetric integers with an fp16 scale and zero point per
 * unit). 1 when kv_bits is one of them. */
int kv_lr_bits_valid(int64_t kv_bits);
#define KV_LR_BITS_LIST "16, 8, 4, 3, 2"

/* KV cache bytes per token (all layers, K and V). The base stores fp16 K and
 * V; a compressed unit stores rank fp16 numbers, or at kv_bits < 16
 * ceil(rank*kv_bits/8) bytes plus an fp16 scale and an fp16 zero point per
 * unit and token; a full unit stores n_heads*d_h fp16 numbers. At
 * kv_bits KV_LR_BITS_MIXED each unit is the sum of its bands, a band of n
 * coordinates at b bits taking kv_lr_unit_bytes(n, b). */
int64_t kv_lr_base_bytes(const struct kv_config *cfg);
/* kv_bits KV_LR_BITS_MIXED only for a model whose units have bands. */
int64_t kv_lr_bytes(const struct kv_lowrank *lr, int kv_bits);
/* kv_bits one of 16, 8, 4, 3, 2. */
int64_t kv_lr_unit_bytes(int64_t rank, int kv_bits);
/* The bytes per token of layer l's keys or values alone. */
int64_t kv_lr_side_bytes(const struct kv_lowrank *lr, int64_t l, int which, int kv_bits);

/* Fuse a Walsh-Hadamard rotation H (kv_la_hadamard of each unit's rank)
 * into the factors, in place: the cached latent becomes z H, which spreads
 * outliers before quantization (Palu §3.4), while every product the forward
 * pass forms is unchanged in exact arithmetic. KV_EINVAL when lr already has
 * one. */
int kv_lr_fuse_hadamard(struct kv_lowrank *lr, struct kv_err *err);
/* Record the latent storage a runtime caches (kv_lr_bits_valid, else
 * KV_EINVAL): every unit at kv_bits, its bands dropped. */
int kv_lr_set_kv_bits(struct kv_lowrank *lr, int kv_bits, struct kv_err *err);
/* Keep the first n_layers layers (1 .. kv_lr_info().n_layers, else
 * KV_EINVAL) and free the rest: a prefix of a model, as a benchmark times. */
int kv_lr_truncate(struct kv_lowrank *lr, int64_t n_layers, struct kv_err *err);

/* KV cache bytes per token (all layers, K and V). The base stores fp16 K and
 * V; a compressed unit stores rank fp16 numbers, or at kv_bits < 16
 * ceil(rank*kv_bits/8) bytes plus an fp16 scale and an fp16 zero point per
 * unit and token; a full unit stores n_heads*d_h fp16 numbers. */

/* Latent-cache forward: after this call every run of f computes attention
 * from cached latents as lr describes (NULL restores the full path). At
 * kv_bits < 16 each unit's latent row is quantized per token (asymmetric,
 * fp16 scale and zero point) as it enters the cache; at KV_LR_BITS_MIXED
 * (lr's own kv_bits must be mixed then) each band of a unit is, at its
 * bits. lr must match f's
 * model and outlive f. With a low-rank model set, only the attn_in and
 * layer_out hooks run; qk_rope, kv_replace and hooks_only apply to the full
 * path alone. */
int kv_fwd_set_lowrank(struct kv_fwd *f, const struct kv_lowrank *lr, int kv_bits,
                       struct kv_err *err);

/* Base against compressed on the windows protocol: both forward passes on
 * the same windows; KL(base‖compressed) in nats per scored token and top-1
 * agreement. */
struct kv_compare_result {
    struct kv_ppl_result base, comp;
    double kl;        /* mean KL(p_base ‖ p_comp) per scored token */
    double top1;      /* fraction of scored positions whose argmax agrees */
    /* 95% percentile-bootstrap intervals over windows (KV_BOOTSTRAP_DRAWS
     * resamples of the windows with replacement, a fixed seed): of
     * ppl_comp / ppl_base - 1 and of kl; the point itself with one window */
    double dppl_ci[2], kl_ci[2];
    /* The device run of kv_ppl_compare_attn (has_dev 0 and the rest zero
     * otherwise), compared with the CPU path: the compressed run, or the
     * base when there is none. */
    int has_dev;
    struct kv_ppl_result dev;
    double max_rel_logit;    /* max over scored positions of max_j |l_dev_j − l_cpu_j| /
                                max_j |l_cpu_j| (over the vocabulary) */
    int64_t max_rel_window;  /* the window (0-based) and position in it (row i */
    int64_t max_rel_pos;     /* predicts token i+1) where that maximum happened */
    double dev_kl;           /* mean KL(p_cpu ‖ p_dev) per scored token */
    double dev_top1;         /* fraction of scored positions whose argmax agrees with the CPU's */
};
#define KV_BOOTSTRAP_DRAWS 2000
/* The 95% percentile-bootstrap intervals of kv_compare_result from n
 * windows' sums: d[i] the compressed minus the base nll and k[i] the KL,
 * each over `scored` positions per window; draws resamples of the windows
 * with replacement from seed. ΔPPL of a resample is exp(Σ d / (n·scored))
 * - 1, its KL Σ k / (n·scored). KV_ENOMEM or KV_OK. */
int kv_bootstrap_ci(const double *d, const double *k, int64_t n, int64_t scored, int64_t draws,
                    uint64_t seed, double dppl_ci[2], double kl_ci[2], struct kv_err *err);
/* The most bytes of logits a scoring run holds per forward pass (default,
 * and for bytes <= 0: 256 MiB). A window whose [seq_len, vocab] float
 * logits take more is scored a slice of positions at a time from a
 * deferred head (kv_fwd_defer_head): 1 GiB less per model for a window of
 * 2048 at a vocabulary of 128256. Process-wide; set before a run. */
void kv_ppl_slice_bytes(int64_t bytes);
int kv_ppl_compare(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                   const int32_t *tokens, int64_t n_tokens, int64_t seq_len,
                   int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
                   struct kv_compare_result *out, struct kv_err *err);
/* kv_ppl_compare plus a third forward pass per window whose attention runs
 * through dev (dev->attn must be set: an external runtime, kernels/kvrt.h,
 * runs every layer's attention while the rest of the model runs on the
 * CPU). With lr NULL there is no compressed CPU run (comp, kl and top1 stay
 * zero) and the device run is compared with the base. A non-zero return of
 * one of dev's hooks stops the run and is returned as is; err then holds a
 * generic message naming the window, the runtime has the details. */
int kv_ppl_compare_attn(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                        const struct kv_fwd_hooks *dev, const int32_t *tokens, int64_t n_tokens,
                        int64_t seq_len, int64_t max_windows, kv_progress_fn progress,
                        void *progress_ctx, struct kv_compare_result *out, struct kv_err *err);

/* The same three, over tokens read window by window rather than held in
 * one array (a text tokenized as it streams: kv_text_tokens in
 * kvcalib.h): window(ctx, w, seq_len, &ids, err) sets *ids to tokens
 * [w*seq_len, (w+1)*seq_len), valid until its next call; w only grows.
 * n_tokens is the whole sequence's count. kv_ppl_compare_src runs the
 * compressed model when lr is not NULL and the device when dev is not
 * NULL (at least one of them). */
struct kv_token_src {
    int (*window)(void *ctx, int64_t w, int64_t seq_len, const int32_t **ids,
                  struct kv_err *err);
    void *ctx;
    int64_t n_tokens;
};
int kv_ppl_run_src(const struct kv_model *m, const struct kv_token_src *src, int64_t seq_len,
                   int64_t max_windows, kv_progress_fn progress, void *progress_ctx,
                   struct kv_ppl_result *out, struct kv_err *err);
int kv_ppl_compare_src(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                       const struct kv_fwd_hooks *dev, const struct kv_token_src *src,
                       int64_t seq_len, int64_t max_windows, kv_progress_fn progress,
                       void *progress_ctx, struct kv_compare_result *out, struct kv_err *err);

/* The same comparison split across processes (mpirun kvcal verify): each
 * of part_count parts runs windows w ≡ part_index (mod part_count), then
 * kv_ppl_compare_finish of every window's sums gives what one process
 * gives, bit for bit. A window's sums are KV_PPL_SUMS doubles, each taken
 * position by position in order (independent of threads); the totals add
 * windows in order. Rows of other parts are left as they are, so parts
 * that start from zeroed arrays can be added element-wise (an all-reduce)
 * before the finish. */
enum {
    KV_PPL_BASE,      /* base nll */
    KV_PPL_COMP,      /* compressed nll */
    KV_PPL_KL,        /* KL(base ‖ compressed) */
    KV_PPL_AGREE,     /* positions whose argmax agrees */
    KV_PPL_DEV,       /* the device run's, in kv_ppl_compare_src only */
    KV_PPL_DEV_KL,
    KV_PPL_DEV_AGREE,
    KV_PPL_SUMS
};
/* The windows the protocol evaluates: n_tokens / seq_len, at most
 * max_windows when it is > 0; KV_EINVAL when not one fits. */
int kv_ppl_windows(int64_t n_tokens, int64_t seq_len, int64_t max_windows, int64_t *windows,
                   struct kv_err *err);
/* One part's windows: base and, when lr is not NULL, compressed, into the
 * rows of sums [windows][KV_PPL_SUMS]; seconds[0] and [1] the base's and
 * compressed's forward-pass time. progress counts this part's windows. */
int kv_ppl_compare_part(const struct kv_model *m, const struct kv_lowrank *lr, int kv_bits,
                        const struct kv_token_src *src, int64_t seq_len, int64_t max_windows,
                        int64_t part_index, int64_t part_count, kv_progress_fn progress,
                        void *progress_ctx, double *sums, double seconds[2], struct kv_err *err);
/* The result of every window's sums (out->comp, kl, top1 and the
 * intervals only when with_comp; no device fields); seconds as given. */
int kv_ppl_compare_finish(const double *sums, int64_t windows, int64_t n_tokens, int64_t seq_len,
                          int with_comp, const double seconds[2], struct kv_compare_result *out,
                          struct kv_err *err);

/* ---------------------------------------------------------------- MLA */

/* A model's attention rewritten as DeepSeek-V2 multi-head latent attention
 * (kv_mla_convert in kvcalib.h builds one, kv_mla_open in kvformats.h
 * reads one back from the GGUF file or HF directory kvcal export --mla
 * writes); opaque. */
struct kv_mla;
void kv_mla_free(struct kv_mla *mla);
/* Run f's attention as mla's (made from f's model): queries absorbed, a
 * cache of the normed latent and the roped shared key per token and layer,
 * as llama.cpp's deepseek2 graph computes. KV_EINVAL when mla's shapes are
 * not f's model's; KV_ENOMEM. */
int kv_fwd_set_mla(struct kv_fwd *f, const struct kv_mla *mla, struct kv_err *err);
/* Base against mla on the same windows, as kv_ppl_compare_src: out->comp
 * is mla's run. */
int kv_ppl_compare_mla_src(const struct kv_model *m, const struct kv_mla *mla,
                           const struct kv_token_src *src, int64_t seq_len, int64_t max_windows,
                           kv_progress_fn progress, void *progress_ctx,
                           struct kv_compare_result *out, struct kv_err *err);
/* Bytes per token of mla's cache at f16: (kv_lora_rank + rope_dim) · 2 · layers. */
int64_t kv_mla_bytes(const struct kv_mla *mla);
struct kv_mla_info {
    int64_t kv_lora_rank, rope_dim, nope_dim, v_dim;
    float rope_base;
    float latent_eps; /* the epsilon of the latent's RMSNorm it was made for */
};
struct kv_mla_info kv_mla_info(const struct kv_mla *mla);

/* ---------------------------------------------------------------- greedy generation */

/* The options of a greedy decoding as a caller names them in messages: a
 * check given names (indexed by this enum) words its message with them, so
 * a program's message names its own flag ("-n"); NULL names use the
 * library's ("steps"). */
enum kv_generate_opt { KV_GENERATE_OPT_STEPS, KV_GENERATE_OPT_COUNT };

/* KV_OK when steps, the number of tokens to generate, is at least 1; else
 * KV_EINVAL "<steps> must be at least 1". */
int kv_generate_check(int64_t steps, const char *const *names, struct kv_err *err);

/* Called with each token of the sequence in order: the prompt's (BOS
 * first) with prompt 1, then each generated token with prompt 0. piece is
 * the token's text decoded after the token before it (kv_tok_decode; len
 * at most 256 bytes, not NUL-terminated), valid during the call. A
 * non-zero return stops the decoding (kv_generate_greedy then returns
 * KV_OK with the tokens so far). */
typedef int (*kv_generate_fn)(void *ctx, int32_t id, const char *piece, size_t len, int prompt);

struct kv_generate_result {
    int64_t prompt_tokens; /* BOS and the prompt's tokens */
    int64_t generated;     /* tokens generated: steps, or fewer when BOS or EOS came first */
    double seconds;        /* wall time of the decoding, after the prompt's callbacks */
};

/* Greedy decoding (temperature 0) with the reference forward pass: prompt
 * (UTF-8, may be "") is encoded with BOS by tok, runs in one forward pass,
 * then up to steps times the argmax of the last position's logits (the
 * first of equal ones) is appended and run as one position over the
 * cache. Decoding stops before a BOS or EOS token. tok must be non-NULL
 * (the model's own: kv_model_tokenizer). */
int kv_generate_greedy(const struct kv_model *m, const struct kv_tokenizer *tok,
                       const char *prompt, int64_t steps, kv_generate_fn on_token, void *ctx,
                       struct kv_generate_result *out, struct kv_err *err);

/* ---------------------------------------------------------------- perplexity: checks */

/* The options of a perplexity run as a caller names them in messages
 * (kv_ppl_check, kv_ppl_check_tol, kv_ppl_device_verdict): given names
 * (indexed by this enum) a message is worded as the caller's own, with its
 * option names ("--seq-len must be at least 2, got 1" for kvcal verify);
 * NULL names keep the library's wording. */
enum kv_ppl_opt {
    KV_PPL_OPT_SEQ_LEN,
    KV_PPL_OPT_MAX_WINDOWS,
    KV_PPL_OPT_DEVICE_TOL, /* the device run's tolerance */
    KV_PPL_OPT_COUNT
};

/* Before any work: KV_OK when seq_len is at least 2 (kv_ppl_run and the
 * comparisons refuse shorter windows the same way) and max_windows is 0
 * (every window) or more; else KV_EINVAL. The runs themselves read a
 * negative max_windows as every window; a caller's option is refused. */
int kv_ppl_check(int64_t seq_len, int64_t max_windows, const char *const *names,
                 struct kv_err *err);
/* KV_OK when tol, the largest |device ppl / cpu ppl - 1| a caller accepts
 * (kv_ppl_device_verdict), is at least 0 (or NaN: not given); else
 * KV_EINVAL. */
int kv_ppl_check_tol(double tol, const char *const *names, struct kv_err *err);
/* The device run's relative perplexity difference, dev.ppl / cpu ppl - 1,
 * where cpu is the compressed run when r has one, else the base. */
double kv_compare_dev_rel(const struct kv_compare_result *r);
/* KV_OK when r has no device run or |kv_compare_dev_rel(r)| <= tol; else
 * KV_ENUMERIC with both perplexities and the difference. */
int kv_ppl_device_verdict(const struct kv_compare_result *r, double tol, const char *const *names,
                          struct kv_err *err);

#ifdef __cplusplus
}
#endif
#endif
