/* kvcal public API.
 *
 * This is the one header another program needs to use kvcal's loaders,
 * tokenizers and reference forward pass. Every fallible function returns an
 * int status (KV_OK == 0) and fills a caller-owned struct kv_err; nothing in
 * the library prints or exits. Handles are opaque; free functions accept NULL.
 */
#ifndef KVCAL_H
#define KVCAL_H

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

/* Record an error; returns code so callers can `return kv_fail(...)`. */
int kv_fail_at(struct kv_err *err, int code, const char *path, uint64_t off,
               const char *src_file, int src_line, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
#define kv_fail(err, code, path, off, ...)                                     \
    kv_fail_at((err), (code), (path), (off), __FILE__, __LINE__, __VA_ARGS__)

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
};

/* Number of elements (product of shape). */
int64_t kv_tensor_numel(const struct kv_tensor *t);

/* ---------------------------------------------------------------- models */

enum kv_arch {
    KV_ARCH_LLAMA = 0, /* RMSNorm, RoPE, GQA, SwiGLU */
    KV_ARCH_GPT2 = 1,  /* LayerNorm, learned positions, MHA, GELU(tanh), biases */
};
const char *kv_arch_name(enum kv_arch a); /* "llama", "gpt2" */

/* How RoPE pairs dimensions within a head of size d_h. */
enum kv_rope_layout {
    KV_ROPE_INTERLEAVED = 0, /* pairs (2i, 2i+1): llama2.c, GGUF */
    KV_ROPE_HALF = 1,        /* pairs (i, i + d_h/2): HF rotate_half */
};

enum kv_format { KV_FORMAT_HF = 0, KV_FORMAT_GGUF, KV_FORMAT_LLAMA2C, KV_FORMAT_SYNTHETIC };

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
    int tied_embeddings;  /* output head shares the embedding matrix */
    int has_qkv_bias;
    int32_t bos_id, eos_id; /* -1 if unknown */
};

struct kv_model;      /* weights, tensor table, tokenizer; opaque */
struct kv_tokenizer;  /* opaque */

/* Open a model from an HF directory, a GGUF file or a llama2.c .bin file
 * (detected from the path). tokenizer_path, if non-NULL, overrides the model's
 * own tokenizer: a llama2.c tokenizer.bin, an HF tokenizer.json or a GGUF file.
 * On success *out owns every mapping it needs; release with kv_model_free. */
int kv_model_open(const char *path, const char *tokenizer_path, struct kv_model **out,
                  struct kv_err *err);

/* A model with random N(0, 0.02) weights (norms 1), for tests and benchmarks.
 * cfg->vocab_size etc. must be set; rope layout and ids are taken as given. */
int kv_model_init_random(const struct kv_config *cfg, uint64_t seed, struct kv_model **out,
                         struct kv_err *err);

void kv_model_free(struct kv_model *m);

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

/* Load a tokenizer on its own: llama2.c tokenizer.bin, HF tokenizer.json, or
 * the vocabulary of a GGUF file (detected from contents/extension). */
int kv_tokenizer_open(const char *path, struct kv_tokenizer **out, struct kv_err *err);
void kv_tok_free(struct kv_tokenizer *tok);

int32_t kv_tok_n_vocab(const struct kv_tokenizer *tok);
int32_t kv_tok_bos(const struct kv_tokenizer *tok);
int32_t kv_tok_eos(const struct kv_tokenizer *tok);

/* Encode len bytes of UTF-8 text. *ids is malloc'd (caller frees), *n_ids set.
 * add_bos prepends the BOS id. Cost O(n log n) in the text length. */
int kv_tok_encode(const struct kv_tokenizer *tok, const char *text, size_t len, int add_bos,
                  int32_t **ids, int64_t *n_ids, struct kv_err *err);

/* Bytes of token id as text, given the previous token (SentencePiece strips
 * the dummy-prefix space after BOS). Byte tokens decode to their byte.
 * Writes at most cap bytes (no NUL) and returns the full length. */
size_t kv_tok_decode(const struct kv_tokenizer *tok, int32_t prev, int32_t id, char *out,
                     size_t cap);

/* ---------------------------------------------------------------- text */

/* Read a whole .txt or .gz file (gzip detected by magic) into a malloc'd,
 * NUL-terminated buffer. */
int kv_text_read(const char *path, char **out, size_t *len, struct kv_err *err);

/* Read little-endian uint32 token ids (a --tokens file). */
int kv_tokens_read(const char *path, int32_t **ids, int64_t *n, int32_t n_vocab,
                   struct kv_err *err);

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

/* Run n tokens at positions pos0..pos0+n-1, attending to the cache [0, pos0)
 * plus themselves (causal). Positions >= pos0 in the cache are overwritten.
 * If logits is non-NULL it receives [n, vocab] logits (row i predicts the
 * token after position pos0+i). */
int kv_fwd_run(struct kv_fwd *f, const int32_t *tokens, int64_t n, int64_t pos0, float *logits,
               struct kv_err *err);

/* Pointer to the logits of the last run ([n, vocab]), valid until the next run. */
const float *kv_fwd_logits(const struct kv_fwd *f);

/* Floating point operations of one kv_fwd_run of n tokens starting at pos0
 * (2 per multiply-add, projections + attention + head). */
double kv_fwd_flops(const struct kv_model *m, int64_t n, int64_t pos0);

/* Monotonic wall clock in seconds. */
double kv_now(void);

/* Set the thread count for BLAS and OpenMP (<= 0 leaves the default). */
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

/* ---------------------------------------------------------------- training */

/* `kvcal train` (calib/train.c): a fresh model of cfg trained from scratch
 * on a text file with AdamW (decoupled weight decay on matrices only), a
 * linear warmup and a cosine decay to min_lr, gradient-norm clipping, and
 * batches of random windows drawn from a seeded stream. Checkpoints
 * (weights, Adam moments, step, the random stream and the loss log) go to
 * ckpt_path atomically; a resumed run continues bit-identically. At the end
 * the model is written as an HF directory (out_dir) in out_dtype. */
struct kv_train_log {
    int64_t step, steps;
    int64_t tokens;        /* training tokens seen */
    int64_t run_tokens;    /* of them, seen by this run (not before a resume) */
    double loss;           /* mean training loss of this step's batch */
    double lr;
    double grad_norm;      /* before clipping */
    double eval_loss;      /* mean held-out loss, NaN when not evaluated at this step */
    double seconds;        /* wall time of this run's steps so far */
};

struct kv_train_opts {
    struct kv_config cfg;           /* architecture; vocab comes from the tokenizer */
    const char *train_path;         /* training text (.txt or .gz) */
    const char *eval_path;          /* held-out text, NULL for none */
    const char *tokenizer_path;     /* HF tokenizer.json; NULL: kvcal's byte-level one */
    const char *out_dir;            /* HF directory written at the end */
    const char *ckpt_path;          /* checkpoint file */
    int resume;                     /* continue from ckpt_path */
    int64_t seq_len;                /* tokens per window (inputs) */
    int64_t batch;                  /* windows per step */
    int64_t steps, warmup;
    double lr, min_lr, weight_decay, beta1, beta2, adam_eps, grad_clip;
    double bos_fraction;            /* fraction of windows that start with BOS */
    uint64_t seed;
    int64_t eval_every, eval_windows, ckpt_every;
    enum kv_dtype out_dtype;        /* F16, BF16 or F32 */
    /* Called after each step; non-zero stops the run after a checkpoint
     * (KV_EINVAL "interrupted"). */
    int (*log)(void *ctx, const struct kv_train_log *l);
    void *log_ctx;
    /* out */
    double unigram_eval_loss;       /* held-out loss of the training text's unigram model */
    double final_eval_loss;
    int64_t tokens_seen;            /* training tokens of all steps */
    int64_t run_tokens;             /* of them, trained by this call (not before a resume) */
};

/* Defaults for every field but cfg and the paths. */
void kv_train_defaults(struct kv_train_opts *o);
int kv_train(struct kv_train_opts *o, struct kv_err *err);

/* ---------------------------------------------------------------- hf writer */

/* Write m as an HF model directory that kv_model_open reads back:
 * config.json (LlamaForCausalLM or GPT2LMHeadModel fields), model.safetensors
 * with HF tensor names in dtype (KV_DTYPE_F32, F16 or BF16; GPT-2's Conv1D
 * weights stored [in, out] with c_attn concatenated, as HF does) and, when
 * tokenizer_json_path is non-NULL, that file copied as tokenizer.json. dir
 * is created when absent (its parent must exist); each file is written
 * atomically (kv_write_atomic) and other files in dir are left alone.
 * Errors: KV_EINVAL (dtype, a model HF cannot describe), KV_EIO naming the
 * file, KV_ENOMEM. */
int kv_hf_write(const struct kv_model *m, const char *dir, enum kv_dtype dtype,
                const char *tokenizer_json_path, struct kv_err *err);

/* Write (atomically) an HF tokenizer.json of a byte-level vocabulary: a BPE
 * model with byte_fallback whose ids 0..255 are the pieces "<0x00>".."<0xFF>"
 * and no merges, plus the special tokens "<s>" = 256 (bos) and "</s>" = 257
 * (eos): 258 ids, every byte string encodes. Errors: KV_EIO naming path. */
int kv_hf_write_byte_tokenizer(const char *path, struct kv_err *err);

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

/* ---------------------------------------------------------------- calibration data */

/* Calibration inputs: .txt, .gz, .jsonl or .jsonl.gz (one {"text": ...}
 * object per line; the documents are joined with a blank line). Each file is
 * one token stream with BOS at its start, cut into windows of seq_len tokens
 * (remainder dropped); windows never span two files. */
struct kv_calib_opts {
    int64_t seq_len;
    int64_t samples;      /* windows to take; 0 = every window */
    int sequential;       /* take the first `samples` windows instead of a random draw */
    uint64_t seed;        /* random draw */
    int64_t shard_index;  /* keep planned windows i with i % shard_count == shard_index */
    int64_t shard_count;  /* 1 = no sharding */
};

struct kv_calib_input {
    char *path;           /* as given */
    char sha256[65];      /* of the file bytes as stored (compressed if .gz) */
    uint64_t bytes;       /* file size */
    int64_t tokens;       /* tokens with BOS */
    int64_t windows;      /* tokens / seq_len */
    int64_t planned;      /* windows of this input in the plan */
};

struct kv_calib; /* inputs, the window plan, and the tokens of one input */

/* Read, hash and tokenize every input, then draw the window plan: the chosen
 * windows in (input, window) order. Errors name the file (and the line and
 * byte offset for JSON lines). Only the tokens of one input stay in memory. */
int kv_calib_open(const char *const *paths, int64_t n_paths, const struct kv_tokenizer *tok,
                  const struct kv_calib_opts *opts, struct kv_calib **out, struct kv_err *err);
void kv_calib_free(struct kv_calib *c);
int64_t kv_calib_n_inputs(const struct kv_calib *c);
const struct kv_calib_input *kv_calib_input(const struct kv_calib *c, int64_t i);
/* Windows in the plan. */
int64_t kv_calib_n_windows(const struct kv_calib *c);
/* Tokens of plan entry i (seq_len ids), valid until the next call; re-reads
 * and re-tokenizes its input when another input is loaded. *input and *window
 * (may be NULL) receive the input index and the window index within it. */
int kv_calib_window(struct kv_calib *c, int64_t i, const int32_t **ids, int64_t *input,
                    int64_t *window, struct kv_err *err);

/* ---------------------------------------------------------------- statistics */

/* Per-layer float64 sums over calibration tokens (DESIGN §6). Matrices are
 * row-major and symmetric (both triangles stored). */
struct kv_stats_layer {
    double *xtx;    /* [d, d]        Σ xᵀx, x = attention input after the norm */
    double *xsum;   /* [d]           Σ x */
    double *q_cov;  /* [h, d_h, d_h] Σ qᵀq per query head, post-RoPE */
    double *k_cov;  /* [g, d_h, d_h] Σ kᵀk per KV head, post-RoPE */
    /* Fisher statistics (collect --fisher), NULL when absent. Sums over
     * windows of the squared gradient of that window's mean loss:
     * fisher_k[r] = Σ_w Σ_j (∂L_w/∂W_k[r, j])² for output row r (Palu §3.3
     * scores any group of heads by summing its rows); the same for W_v. */
    double *fisher_k;  /* [g*d_h] */
    double *fisher_v;  /* [g*d_h] */
    /* Σ gᵀg over tokens per KV head of g = ∂L_w/∂k (pre-RoPE key output,
     * kv_grad_k) and ∂L_w/∂v. */
    double *grad_k_cov; /* [g, d_h, d_h] */
    double *grad_v_cov; /* [g, d_h, d_h] */
};

struct kv_stats_input {
    char *path;
    char sha256[65];
    uint64_t bytes;
    int64_t tokens;   /* tokens of the input (with BOS) */
    int64_t windows;  /* windows of it accumulated */
};

struct kv_stats {
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim;
    char fingerprint[65];  /* kv_model_fingerprint of the model */
    char version[32];      /* kvcal version that wrote the file */
    int64_t seq_len;
    int64_t tokens;        /* tokens accumulated */
    int64_t windows;       /* windows accumulated */
    int has_fisher;        /* every layer has fisher_k/v and grad_k/v_cov */
    /* the plan that produced the sums ("sequential", "random" or "merged") */
    char sampling[16];
    uint64_t seed;
    int64_t samples;       /* --samples (0 = all) */
    int64_t shard_index, shard_count;
    int64_t plan_windows;  /* windows in the plan */
    int64_t next_window;   /* plan entries done; < plan_windows in a checkpoint */
    int64_t n_inputs;
    struct kv_stats_input *inputs;
    struct kv_stats_layer *layers; /* [n_layers] */
};

/* Zeroed sums shaped for cfg (no inputs, empty plan). */
int kv_stats_init(const struct kv_config *cfg, struct kv_stats **out, struct kv_err *err);
/* Add zeroed Fisher sums (fisher_k/v, grad_k/v_cov) to every layer and set
 * has_fisher, before any window is summed (KV_EINVAL once s has windows);
 * nothing changes when s has them already. */
int kv_stats_add_fisher(struct kv_stats *s, struct kv_err *err);
void kv_stats_free(struct kv_stats *s);
/* Append an input record (path copied). */
int kv_stats_add_input(struct kv_stats *s, const char *path, const char sha256[65],
                       uint64_t bytes, int64_t tokens, int64_t windows, struct kv_err *err);

/* 1 when path looks like a stats file (GGUF magic and the "kvcal.stats"
 * type string in its header), else 0. Cheap; kv_stats_open validates. */
int kv_stats_probe(const char *path);

/* Write s as a GGUF v3 stats file: path.tmp, fsync, rename. */
int kv_stats_write(const struct kv_stats *s, const char *path, struct kv_err *err);
/* Read and fully validate a stats file: type, format version, every key,
 * tensor names, shapes, dtype F64, crc32 per tensor and finiteness. Errors
 * name the path, the tensor or key, and the byte offset. */
int kv_stats_parse(const void *buf, uint64_t len, const char *path, struct kv_stats **out,
                   struct kv_err *err);
int kv_stats_open(const char *path, struct kv_stats **out, struct kv_err *err);

/* 1 when s was made by this model (same fingerprint and shapes), else 0 with
 * the difference in err (KV_EINVAL, naming path). */
int kv_stats_matches_model(const struct kv_stats *s, const struct kv_model *m, const char *path,
                           struct kv_err *err);
/* acc += b, exactly as sums. Refuses a different fingerprint, shape or
 * seq_len, Fisher statistics in one but not the other, and an unfinished
 * checkpoint, naming b_path. acc's plan becomes
 * "merged"; inputs are appended (windows added when the same sha256 and
 * path appear in both). */
int kv_stats_merge(struct kv_stats *acc, const struct kv_stats *b, const char *b_path,
                   struct kv_err *err);

/* Streaming accumulation: one forward pass per window with hooks that add
 * each window's float64 contribution (dsyrk on a float64 copy of its
 * activations) to s. Memory is O(L·d²) plus one window's activations.
 * When s has Fisher sums (kv_stats_add_fisher), each window also runs
 * kv_grad_run on inputs ids[0..seq_len-1) with targets ids[1..seq_len) and
 * adds the squared W_k/W_v gradients and the ∂L/∂k, ∂L/∂v Grams; that
 * keeps the whole window's training activations (see kv_grad). */
struct kv_accum;
int kv_accum_init(const struct kv_model *m, struct kv_stats *s, int64_t seq_len,
                  struct kv_accum **out, struct kv_err *err);
void kv_accum_free(struct kv_accum *a);
/* Run seq_len tokens (one window, positions 0..) and add their statistics. */
int kv_accum_window(struct kv_accum *a, const int32_t *ids, struct kv_err *err);
/* Mean loss of the last window's backward pass (with Fisher sums), else 0. */
double kv_accum_loss(const struct kv_accum *a);
/* Copy each upper triangle to its lower half (before s is written or read). */
void kv_accum_sync(struct kv_accum *a);

/* The whole collect run: plan entries s->next_window .. end of c, with a
 * stats file written to out_path every checkpoint_every windows (0 = never),
 * when progress asks to stop (a checkpoint, then KV_EINVAL "interrupted"),
 * and at the end. s is either fresh from kv_stats_init (its plan and inputs
 * are filled here from c and data) or a checkpoint read back for a resume:
 * then the model fingerprint, seq_len, plan options, fisher and every
 * input's sha256 must match, else KV_EINVAL names the first difference. */
struct kv_collect_opts {
    const char *out_path;
    const struct kv_calib_opts *data; /* the options c was opened with */
    int resume;                       /* s is a checkpoint read back (else fresh) */
    int fisher;                       /* Fisher statistics too: a backward pass per window */
    int64_t checkpoint_every;
    kv_progress_fn progress;  /* done/total count this run's windows */
    void *progress_ctx;
    int64_t checkpoints_written; /* out: checkpoint files written */
    double seconds;              /* out: wall time of the windows and writes */
    double loss;                 /* out: mean window loss of this run (fisher), else 0 */
};
int kv_collect_run(const struct kv_model *m, struct kv_calib *c, struct kv_stats *s,
                   struct kv_collect_opts *opts, struct kv_err *err);

/* Output covariance Σ yᵀy of KV heads head0 .. head0+nh-1 of the layer's K
 * (which = 0) or V (which = 1) projection, or of query heads (which = 2,
 * pre-RoPE), derived from the input sums:
 * y = x Wᵀ + b gives W C_x Wᵀ + W Σx bᵀ + b Σxᵀ Wᵀ + N b bᵀ. out is
 * [nh*d_h, nh*d_h] row-major. Pre-RoPE for K. s must match m's shapes. */
int kv_stats_out_cov(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                     int which, int64_t head0, int64_t nh, double *out, struct kv_err *err);
/* The same for every head of `which` at once, as the diagonal blocks of
 * `block` consecutive heads (block divides the head count): out is
 * [heads/block][block*d_h][block*d_h]. */
int kv_stats_out_cov_blocks(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                            int which, int64_t block, double *out, struct kv_err *err);

/* The spectrum view of one layer (`kvcal inspect STATS`). Energy ranks are
 * the smallest r keeping 90% / 99% of the eigenvalue sum. */
struct kv_head_spectrum {
    int64_t k90, k99;        /* K output covariance (pre-RoPE, from C_x); -1 without a model */
    int64_t v90, v99;        /* V output covariance; -1 without a model */
    int64_t krope90, krope99; /* post-RoPE K covariance (k_rope.cov) */
};
struct kv_layer_spectrum {
    double trace;            /* trace of XᵀX (a sum over tokens) */
    double lambda_max, lambda_min; /* extreme eigenvalues of XᵀX */
    double cond;             /* lambda_max / lambda_min; +inf when lambda_min <= 0 */
    int64_t x90, x99;        /* energy ranks of XᵀX, out of d */
    struct kv_head_spectrum *heads; /* [n_kv_heads], caller-allocated */
};
/* m may be NULL (then the K/V ranks are -1). */
int kv_stats_layer_spectrum(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                            struct kv_layer_spectrum *out, struct kv_err *err);

/* Sorted eigenvalues (descending) of a symmetric n×n float64 matrix, by
 * LAPACKE dsyevd on a copy. NaN/Inf input is KV_ENUMERIC naming `what`. */
int kv_sym_eigvals(const double *a, int64_t n, double *w, const char *what, struct kv_err *err);
/* Smallest r with λ_1 + .. + λ_r >= energy · Σλ (λ descending, negatives
 * counted as 0); 0 when Σλ is 0. */
int64_t kv_energy_rank(const double *lambda, int64_t n, double energy);


/* ---------------------------------------------------------------- low-rank numerics */

/* Full symmetric eigendecomposition of the n×n float64 matrix a (row-major,
 * both triangles; only the upper one is read), by LAPACKE dsyevd on a copy.
 * w[n] receives the eigenvalues in descending order and vec[n*n] (row-major)
 * the matching orthonormal eigenvectors as columns: column j of vec belongs
 * to w[j]. Each column's sign is fixed so that its largest-magnitude entry
 * is positive (deterministic output). NaN/Inf input and non-convergence are
 * KV_ENUMERIC naming `what` (e.g. "layer 3 k unit 1"). */
int kv_lr_eigh(const double *a, int64_t n, double *w, double *vec, const char *what,
               struct kv_err *err);

/* Thin SVD of the m×n float64 matrix a (row-major) by LAPACKE dgesdd on a
 * copy: a = U diag(s) Vᵀ with k = min(m, n); u is [m, k], s [k] descending,
 * vt [k, n], all row-major. Errors as kv_lr_eigh. */
int kv_lr_svd(const double *a, int64_t m, int64_t n, double *u, double *s, double *vt,
              const char *what, struct kv_err *err);

/* The Cholesky-whitened truncation-aware SVD of SVD-LLM / Palu appendix K,
 * kept as an independent cross-check of the eigen route (DESIGN §3.1).
 * W is d×m (math layout, row-major), cx the d×d input second moment XᵀX,
 * lambda a ridge added to its diagonal. With S = chol(cx + lambda I) lower
 * triangular, Sᵀ W = U Σ Vᵀ, it returns W' = S⁻ᵀ U_r Σ_r V_rᵀ (d×m, row-major)
 * by a triangular solve (no inverse is formed). A non-positive-definite cx
 * is KV_ENUMERIC naming `what`. */
int kv_lr_whitened_chol(const double *w, int64_t d, int64_t m, const double *cx, double lambda,
                        int64_t r, double *w_out, const char *what, struct kv_err *err);

/* Orthonormal n×n Walsh-Hadamard-type matrix (row-major): block diagonal
 * with Sylvester blocks of size b, the largest power of two dividing n (b
 * may be 1, then it is the identity), each scaled by 1/√b. Returns b. */
int64_t kv_lr_hadamard(int64_t n, double *h);

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

/* One unit: KV heads head0 .. head0+n_heads-1 of one layer's K or V, with
 * one rank. Weight-layout factors ([out, in], as HF stores a linear):
 *   down [rank, d], down_bias [rank] or NULL:  z = x downᵀ + down_bias
 *   up   [n_heads*d_h, rank]:                  y = z upᵀ
 *   rot  [rank, d_h] (postrope_rotation only): z_j = k_j rotᵀ for the one
 *        KV head j of the unit, and q'_i = q_i rotᵀ for its query heads.
 * energy and dropped are calibration sums (Σ over tokens of squared norms in
 * the unit's metric); dropped/energy is the predicted relative error. */
struct kv_lr_unit {
    int64_t head0, n_heads;
    int64_t rank;
    double energy, dropped;
    float *down, *down_bias, *up, *rot;
};

struct kv_lr_side {
    enum kv_lr_mode mode;
    int64_t n_units;         /* 0 for KV_LR_FULL */
    struct kv_lr_unit *units;
};

struct kv_lr_layer {
    struct kv_lr_side k, v;
    /* fused_output values: the output projection with each query head's
     * d_h input columns replaced by its unit's latent columns, [d, o_cols]
     * weight layout with o_cols = Σ over query heads i of rank(unit of i),
     * query heads in order. NULL otherwise. */
    float *o_fused;
    int64_t o_cols;
    /* fused_query keys: the query projection folded with each query head's
     * unit up-block, q'_i = q_i up_i = x (up_iᵀ W_q,i)ᵀ + up_iᵀ b_q,i, stored
     * [q_cols, d] weight layout (+ bias [q_cols], NULL when the model has no
     * q bias) with q_cols = Σ over query heads i of rank(unit of i), query
     * heads in order. NULL otherwise. */
    float *q_fused, *q_fused_bias;
    int64_t q_cols;
};

/* A compressed model's attention: what kvcal decompose builds, what the
 * output directory stores and what the latent-cache forward pass runs. */
struct kv_lowrank {
    char method[16];             /* "palu", "eigen", ... */
    char alloc[16];              /* "uniform", "eps", ... */
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim;
    char model_fingerprint[65];  /* of the base model */
    int kv_bits;                 /* latent storage: 16 (fp16) or 8/4/3/2 (quantized) */
    int hadamard;                /* a Walsh-Hadamard matrix is fused into the factors */
    struct kv_lr_layer *layers;  /* [n_layers] */
};

void kv_lowrank_free(struct kv_lowrank *lr);

/* KV cache bytes per token (all layers, K and V). The base stores fp16 K and
 * V; a compressed unit stores rank fp16 numbers, or at kv_bits < 16
 * ceil(rank*kv_bits/8) bytes plus an fp16 scale and an fp16 zero point per
 * unit and token; a full unit stores n_heads*d_h fp16 numbers. */
int64_t kv_lowrank_base_bytes(const struct kv_config *cfg);
int64_t kv_lowrank_bytes(const struct kv_lowrank *lr, int kv_bits);
int64_t kv_lr_unit_bytes(int64_t rank, int kv_bits);

/* Fuse a Walsh-Hadamard rotation H (kv_lr_hadamard of each unit's rank)
 * into the factors, in place: the cached latent becomes z H, which spreads
 * outliers before quantization (Palu §3.4), while every product the forward
 * pass forms is unchanged in exact arithmetic. KV_EINVAL when lr already has
 * one. */
int kv_lowrank_hadamard(struct kv_lowrank *lr, struct kv_err *err);

/* ---------------------------------------------------------------- output directory */

/* The compressed model directory of `kvcal decompose`: kvcal.json (the
 * manifest, README "Compressed model directory") and model.safetensors. */
/* What kv_lr_dir_write records besides the model and its factors. */
struct kv_lr_dir_info {
    const char *model_path;     /* --model as given: the manifest's model.source (may be NULL);
                                   for an HF directory its config and tokenizer files are copied */
    const char *tokenizer_path; /* --tokenizer or NULL: copied for a non-HF source */
    const char *options_json;   /* JSON object text for "options" (NULL: {}) */
    const char *stats_json;     /* JSON object text for "stats" (NULL: null) */
};

/* Write the compressed model lr of base model m to directory dir. Every file
 * goes into dir.tmp-<pid>/ first (each fsynced); then, if dir exists, it must
 * be empty or hold a kvcal.json (an earlier output, whose files are removed
 * one by one first; a subdirectory is refused), else KV_EINVAL and nothing of
 * dir is touched; the temporary is renamed to dir and the parent directory
 * fsynced. lr must describe m (same shapes and fingerprint, units covering
 * every KV head once, the factors its modes need): KV_EINVAL otherwise.
 * Errors name the file: KV_EIO, KV_EINVAL, KV_ENOMEM. */
int kv_lr_dir_write(const struct kv_model *m, const struct kv_lowrank *lr,
                    const struct kv_lr_dir_info *info, const char *dir, struct kv_err *err);

/* Read dir/kvcal.json and the weights file it names, for base model m: the
 * format and version, the architecture and every dimension against m's
 * config, m's fingerprint against the recorded one (KV_EINVAL), every unit's
 * heads (contiguous, in range, each KV head exactly once), ranks (1..s*d_h),
 * each named tensor's presence and exact shape (F32, or F16/BF16 converted),
 * o_cols and q_cols (fused_query keys only on a model without rope), and
 * that kv_bytes_per_token is what the ranks give. On success *out owns copies of
 * every factor; release with kv_lowrank_free. Errors name the file and the
 * key or tensor (with its byte offset when known): KV_EIO, KV_EFORMAT,
 * KV_EINVAL (another model), KV_EUNSUPPORTED (a newer version, a mode kvcal
 * does not run), KV_ENOMEM. */
int kv_lr_dir_open(const char *dir, const struct kv_model *m, struct kv_lowrank **out,
                   struct kv_err *err);

/* Read and validate the manifest at path alone (no weights, no model): *out
 * gets the shapes, modes, units, ranks, energies, o_cols, q_cols and latent
 * format, with every factor pointer NULL. Errors as kv_lr_dir_open, naming path. */
int kv_lr_manifest_read(const char *path, struct kv_lowrank **out, struct kv_err *err);

/* ---------------------------------------------------------------- dense export */

/* Write the source model at model_path (from which m was loaded) again in its
 * own format, with every compressed K/V weight replaced by up·down: an
 * ordinary model that any engine loads, as a quality proxy (same numbers, no
 * memory saving). HF directories become a directory, GGUF and llama2.c a
 * file; only the K/V tensors' bytes change (for gpt2 the K and V columns of
 * each Conv1D c_attn and its bias). postrope_rotation keys have no
 * dense form: KV_EUNSUPPORTED naming the layer, before anything is written.
 * Atomic; see formats/export.h for every rule. */
int kv_lr_export_dense(const struct kv_model *m, const char *model_path,
                       const struct kv_lowrank *lr, const char *out, struct kv_err *err);

/* ---------------------------------------------------------------- decompose */

enum kv_method {
    KV_METHOD_SVD = 0, /* plain SVD of W (C_x = I), the baseline */
    KV_METHOD_PALU,    /* whitened (output-covariance) factors, units of --group-size KV heads */
    KV_METHOD_EIGEN,   /* Eigen Attention: shared pre-RoPE key basis from C_q + C_k, per-head V */
    KV_METHOD_LORC,    /* LoRC: joint plain SVD per layer, progressive ranks */
    KV_METHOD_FDC,     /* post-RoPE key rotation, values as palu */
    KV_METHOD_ZACK,    /* post-RoPE key rotation, V–W_O paired rotation */
    KV_METHOD_COUNT
};
enum kv_alloc {
    KV_ALLOC_DEFAULT = 0, /* the method's own: svd/palu uniform, eigen eps, lorc progressive,
                             fdc/zack removal */
    KV_ALLOC_EPS,         /* per unit, keep the fraction eps of the energy (Eigen eq. 5) */
    KV_ALLOC_UNIFORM,     /* the same fraction of every unit's width */
    KV_ALLOC_FISHER,      /* ranks proportional to Fisher information (Palu §3.3) */
    KV_ALLOC_PROGRESSIVE, /* LoRC eqs. 12–13 */
    KV_ALLOC_REMOVAL,     /* one singular-value removal rate (ZACK eq. 6 / FDC eq. 1) */
    KV_ALLOC_LAYER_BUDGET,/* Eigen §4.4: per-layer eps lowered by 0.02 under a measured error */
    KV_ALLOC_GLOBAL,      /* greedy: least relative error per byte saved (each slot's error
                             weighted by its Fisher score / the mean when there are scores) */
    KV_ALLOC_COUNT
};
const char *kv_method_name(enum kv_method m);
const char *kv_alloc_name(enum kv_alloc a);
/* Parse a name; returns -1 when unknown. */
int kv_method_parse(const char *s);
int kv_alloc_parse(const char *s);

/* alloc KV_ALLOC_DEFAULT and kv_bits 0 are resolved in place (to the
 * method's allocation and 16), so the struct tells what ran. */
struct kv_decompose_opts {
    enum kv_method method;
    enum kv_alloc alloc;
    double eps;            /* (0, 1]; 0 = not given */
    double ratio;          /* (0, 1] fraction of base KV bytes kept; 0 = not given */
    int64_t group_size;    /* KV heads per unit for svd/palu/fdc values (default 1) */
    int64_t rank_multiple; /* ranks rounded up to a multiple (default 1) */
    int64_t min_rank;      /* floor per unit (default 1) */
    double d_min, d_max;   /* lorc: rank fractions of eq. 13 (d_max default 1; d_min
                              searched for --ratio when 0) */
    double cond_skip;      /* lorc: keep layers whose log10 cumulative condition number
                              exceeds this (0 = never skip) */
    double error_budget;   /* layer-budget: e_b, normalised layer output error */
    const double *fisher;  /* per slot Fisher scores (tests; NULL = from the stats: Σ of
                              fisher_k/v over the rows of the slot's units, when they have it) */
    int kv_bits;           /* latent storage bits: 16, 8, 4, 3 or 2 (byte accounting) */
    int hadamard;          /* fuse a Walsh-Hadamard matrix into the factors */
    /* layer-budget measures real layer outputs on these windows */
    const int32_t *calib_tokens;
    int64_t calib_windows, seq_len;
    kv_progress_fn progress;
    void *progress_ctx;
    /* out */
    double seconds;        /* wall time */
    double lapack_seconds; /* of which eigendecompositions */
    int64_t target_bytes;   /* KV bytes per token --ratio asked for (0 without) */
    int64_t achieved_bytes; /* what the allocation gives */
    int64_t least_bytes;    /* the smallest cache the allocation reaches at all (its
                               parameter at the aggressive end; 0 when not computed):
                               above target_bytes, the target is out of its reach */
    double param;          /* the allocation's parameter as run: eps, width fraction
                              (uniform, fisher), removal rate, d_min/d_max
                              (progressive), e_b (layer-budget); 0 for global */
};

/* Build low-rank K/V factors for m from its statistics s (which may be NULL
 * for svd and lorc: then errors are measured in the weight metric). Only
 * the shapes of s are checked here; kv_stats_matches_model checks that s
 * came from m. The
 * result records per unit the calibration energy and the dropped energy
 * (the predicted ‖Y − Y'‖²_F). Errors: KV_EINVAL for impossible options
 * (naming the option), KV_ENUMERIC naming the layer and unit. */
int kv_decompose(const struct kv_model *m, const struct kv_stats *s,
                 struct kv_decompose_opts *o, struct kv_lowrank **out, struct kv_err *err);

/* Latent-cache forward: after this call every run of f computes attention
 * from cached latents as lr describes (NULL restores the full path). At
 * kv_bits < 16 each unit's latent row is quantized per token (asymmetric,
 * fp16 scale and zero point) as it enters the cache. lr must match f's
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

#ifdef __cplusplus
}
#endif
#endif
