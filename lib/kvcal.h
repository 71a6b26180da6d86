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

#ifdef __cplusplus
}
#endif
#endif
