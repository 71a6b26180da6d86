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

enum kv_arch { KV_ARCH_LLAMA = 0 };

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
    int64_t max_seq_len;  /* trained context (informational) */
    float norm_eps;
    float rope_theta;
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
 * weights; fails only for lack of memory. */
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
 * seq_len, and an unfinished checkpoint, naming b_path. acc's plan becomes
 * "merged"; inputs are appended (windows added when the same sha256 and
 * path appear in both). */
int kv_stats_merge(struct kv_stats *acc, const struct kv_stats *b, const char *b_path,
                   struct kv_err *err);

/* Streaming accumulation: one forward pass per window with hooks that add
 * each window's float64 contribution (dsyrk on a float64 copy of its
 * activations) to s. Memory is O(L·d²) plus one window's activations. */
struct kv_accum;
int kv_accum_init(const struct kv_model *m, struct kv_stats *s, int64_t seq_len,
                  struct kv_accum **out, struct kv_err *err);
void kv_accum_free(struct kv_accum *a);
/* Run seq_len tokens (one window, positions 0..) and add their statistics. */
int kv_accum_window(struct kv_accum *a, const int32_t *ids, struct kv_err *err);
/* Copy each upper triangle to its lower half (before s is written or read). */
void kv_accum_sync(struct kv_accum *a);

/* The whole collect run: plan entries s->next_window .. end of c, with a
 * stats file written to out_path every checkpoint_every windows (0 = never),
 * when progress asks to stop (a checkpoint, then KV_EINVAL "interrupted"),
 * and at the end. s is either fresh from kv_stats_init (its plan and inputs
 * are filled here from c and data) or a checkpoint read back for a resume:
 * then the model fingerprint, seq_len, plan options and every input's sha256
 * must match, else KV_EINVAL names the first difference. */
struct kv_collect_opts {
    const char *out_path;
    const struct kv_calib_opts *data; /* the options c was opened with */
    int resume;                       /* s is a checkpoint read back (else fresh) */
    int64_t checkpoint_every;
    kv_progress_fn progress;  /* done/total count this run's windows */
    void *progress_ctx;
    int64_t checkpoints_written; /* out: checkpoint files written */
    double seconds;              /* out: wall time of the windows and writes */
};
int kv_collect_run(const struct kv_model *m, struct kv_calib *c, struct kv_stats *s,
                   struct kv_collect_opts *opts, struct kv_err *err);

/* Output covariance Σ yᵀy of KV heads head0 .. head0+nh-1 of the layer's K
 * (which = 0) or V (which = 1) projection, derived from the input sums:
 * y = x Wᵀ + b gives W C_x Wᵀ + W Σx bᵀ + b Σxᵀ Wᵀ + N b bᵀ. out is
 * [nh*d_h, nh*d_h] row-major. Pre-RoPE for K. s must match m's shapes. */
int kv_stats_out_cov(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                     int which, int64_t head0, int64_t nh, double *out, struct kv_err *err);

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

#ifdef __cplusplus
}
#endif
#endif
