/* kvcal calibration (calib/): the public API of the calibration layer.
 *
 * Calibration text as token windows, streaming float64 statistics
 * (collect, merge, resume), the covariances and spectra derived from them,
 * decomposition into low-rank K/V factors under a budget, and the trainer
 * of the fixture models. Depends on kvcal_core.h and kvformats.h.
 */
#ifndef KVCAL_CALIB_H
#define KVCAL_CALIB_H

#include "kvcal_core.h"
#include "kvformats.h"

#ifdef __cplusplus
extern "C" {
#endif

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
    int due;               /* a step a log shows: the first and the last, every
                              log_every-th, and each one evaluated */
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
    int64_t log_every;              /* steps between the log lines kv_train_log.due marks */
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

/* The options of a training run as a caller names them in messages: a
 * check given names (indexed by this enum) words each message as the
 * caller's own, with its option names ("--dim 250 is not a positive
 * multiple of --heads 4" for kvcal train); NULL names use the library's. */
enum kv_train_opt {
    KV_TRAIN_OPT_ARCH,
    KV_TRAIN_OPT_DIM,
    KV_TRAIN_OPT_HEADS,
    KV_TRAIN_OPT_KV_HEADS,
    KV_TRAIN_OPT_SEQ_LEN,
    KV_TRAIN_OPT_BATCH,
    KV_TRAIN_OPT_STEPS,
    KV_TRAIN_OPT_LOG_EVERY,
    KV_TRAIN_OPT_WARMUP,
    KV_TRAIN_OPT_LR,
    KV_TRAIN_OPT_MIN_LR,
    KV_TRAIN_OPT_WEIGHT_DECAY,
    KV_TRAIN_OPT_CLIP,
    KV_TRAIN_OPT_COUNT
};

/* The architecture of a fresh model (*cfg, for kv_train_opts.cfg; the
 * vocabulary comes from the tokenizer): arch "llama" (RMSNorm, RoPE
 * rotate-half theta 1e4, GQA, SwiGLU) or "gpt2" (learned positions, one KV
 * head per head, tied embeddings), width dim, n_layers, n_heads of
 * dim/n_heads; n_kv_heads < 0 takes the default (llama n_heads/2, at least
 * 1; gpt2 n_heads), hidden < 0 too (llama 8d/3 rounded up to 64, gpt2 4d);
 * ctx is the context it is made for (gpt2's positions). KV_EINVAL for an
 * unknown arch, dim not a positive multiple of n_heads (or n_layers < 1),
 * n_heads not a multiple of n_kv_heads, or gpt2 with fewer KV heads. */
int kv_train_config(const char *arch, int64_t dim, int64_t n_layers, int64_t n_heads,
                    int64_t n_kv_heads, int64_t hidden, int64_t ctx, struct kv_config *cfg,
                    const char *const *names, struct kv_err *err);
/* Before any work, the options of o a caller sets: seq_len at least 2,
 * batch, steps and log_every at least 1, warmup at least 0; lr positive,
 * min_lr, weight_decay and grad_clip at least 0. KV_EINVAL names each group
 * (NULL names: "training options are out of range", as kv_train says for
 * these and the rest of its options). */
int kv_train_check(const struct kv_train_opts *o, const char *const *names, struct kv_err *err);
/* Before any work: KV_OK unless o->resume and there is no checkpoint at
 * o->ckpt_path to resume from (KV_EIO naming it). */
int kv_train_check_resume(const struct kv_train_opts *o, struct kv_err *err);

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
    int parse_special;    /* special-token strings in the text become control ids */
};

struct kv_calib_input {
    char *path;           /* as given */
    char sha256[65];      /* of the file bytes as stored (compressed if .gz) */
    uint64_t bytes;       /* file size */
    int64_t tokens;       /* tokens with BOS */
    int64_t windows;      /* tokens / seq_len */
    int64_t planned;      /* windows of this input in the plan */
    int64_t specials;     /* special-token strings encoded as text (scan) */
};

struct kv_calib; /* inputs, the window plan, and the tokens of one input */

/* The options of the calibration data as a caller names them in messages.
 * A check given names (indexed by this enum) words each message as the
 * caller's own, with its option names ("--seq-len must be at least 2, got
 * 1" for kvcal collect); NULL names keep the library's wording ("sequence
 * length must be at least 2, found 1"). */
enum kv_calib_opt {
    KV_CALIB_OPT_SEQ_LEN,
    KV_CALIB_OPT_SAMPLES,
    KV_CALIB_OPT_SHARD, /* shard_index and shard_count, written I/N */
    KV_CALIB_OPT_COUNT
};

/* KV_OK when o describes a plan kv_calib_open can draw: seq_len at least
 * 2, samples 0 (every window) or more, and a shard (kv_calib_shard_valid);
 * else KV_EINVAL naming the first option that is not. kv_calib_open makes
 * the same check (with NULL names) before it reads anything. */
int kv_calib_check(const struct kv_calib_opts *o, const char *const *names, struct kv_err *err);
/* 1 when shard I/N = index/count names one: 0 <= index < count. */
int kv_calib_shard_valid(int64_t index, int64_t count);

/* The tokens of one input (.txt, .gz, .jsonl, .jsonl.gz, read as above),
 * tokenized as the text streams (kv_tok_stream): memory is of the order of
 * a megabyte of text, its tokens and the longest JSON line, not of the
 * file. get sets *ids to tokens [a, a+len) (*got of them, fewer only at
 * the end), valid until the next call; a never goes below an earlier
 * call's. finish reads to the end: the count of all tokens, the sha256 and
 * size of the file, and its bytes decompressed (the JSON itself for JSON
 * lines); any may be NULL. */
struct kv_text_tokens;
/* flags: KV_TOK_* for the stream (kv_tok_policy plus KV_TOK_PARSE_SPECIAL);
 * kv_text_tokens_specials: special-token strings read so far that were
 * encoded as text. */
int64_t kv_text_tokens_specials(const struct kv_text_tokens *t);
int kv_text_tokens_open(const char *path, const struct kv_tokenizer *tok, int flags,
                        struct kv_text_tokens **out, struct kv_err *err);
int kv_text_tokens_get(struct kv_text_tokens *t, int64_t a, int64_t len, const int32_t **ids,
                       int64_t *got, struct kv_err *err);
int kv_text_tokens_finish(struct kv_text_tokens *t, int64_t *n_tokens, char sha256[65],
                          uint64_t *file_bytes, uint64_t *text_bytes, struct kv_err *err);
void kv_text_tokens_close(struct kv_text_tokens *t);
/* The window function of a kv_token_src (kvcal_core.h) whose ctx is a
 * kv_text_tokens: tokens [w*seq_len, (w+1)*seq_len), an error naming the
 * file when the text ends before them (it changed since it was counted). */
int kv_text_tokens_window(void *t, int64_t w, int64_t seq_len, const int32_t **ids,
                          struct kv_err *err);

/* Read, hash and tokenize every input, then draw the window plan: the chosen
 * windows in (input, window) order. Errors name the file (and the line and
 * byte offset for JSON lines). Inputs stream: memory is that of
 * kv_text_tokens, not of the text. */
int kv_calib_open(const char *const *paths, int64_t n_paths, const struct kv_tokenizer *tok,
                  const struct kv_calib_opts *opts, struct kv_calib **out, struct kv_err *err);
void kv_calib_free(struct kv_calib *c);
/* How its texts become tokens: "bos=B eos=E special=text|parsed". */
void kv_calib_tokenization(const struct kv_calib *c, char *buf, size_t cap);
int64_t kv_calib_n_inputs(const struct kv_calib *c);
const struct kv_calib_input *kv_calib_input(const struct kv_calib *c, int64_t i);
/* Windows in the plan. */
int64_t kv_calib_n_windows(const struct kv_calib *c);
/* Tokens of plan entry i (seq_len ids), valid until the next call; reads
 * its input on from the last window asked for, or from the start (after
 * checking the file's sha256 against the scan) for another input or an
 * earlier window. *input and *window
 * (may be NULL) receive the input index and the window index within it. */
int kv_calib_window(struct kv_calib *c, int64_t i, const int32_t **ids, int64_t *input,
                    int64_t *window, struct kv_err *err);

/* ---------------------------------------------------------------- statistics */

/* acc += b, exactly as sums. Refuses a different fingerprint, shape or
 * seq_len, Fisher statistics in one but not the other, and an unfinished
 * checkpoint, naming b_path. acc's plan becomes
 * "merged"; inputs are appended (windows added when the same sha256 and
 * path appear in both). */
int kv_stats_merge(struct kv_stats *acc, const struct kv_stats *b, const char *b_path,
                   struct kv_err *err);

/* KV_OK when s is a finished run, else KV_EINVAL naming path: "an
 * unfinished checkpoint (N of M windows)", which only `collect --resume`
 * may continue. */
int kv_stats_check_complete(const struct kv_stats *s, const char *path, struct kv_err *err);

/* `kvcal merge`: open every file of paths[0..n) (n >= 1), check each is
 * complete, add them (kv_stats_merge) and write the sum to out_path; *out
 * receives the merged statistics (kv_stats_free). Errors name the file. */
int kv_stats_merge_files(const char *const *paths, int64_t n, const char *out_path,
                         struct kv_stats **out, struct kv_err *err);

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
/* Copy each upper triangle to its lower half, so s's matrices are whole in
 * memory (kv_stats_mirror). kv_stats_write needs no sync: it mirrors as it
 * writes. */
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
    /* 1: leave s's symmetric sums as upper triangles at the end (s->upper),
     * so their lower halves are never resident (the files are whole either
     * way); 0: mirror them, so s is whole in memory */
    int upper_only;
    kv_progress_fn progress;  /* done/total count this run's windows */
    void *progress_ctx;
    int64_t resumed_from;        /* out of kv_collect_start: the checkpoint's next window,
                                    -1 for fresh statistics */
    int64_t checkpoints_written; /* out: checkpoint files written */
    double seconds;              /* out: wall time of the windows and writes */
    double loss;                 /* out: mean window loss of this run (fisher), else 0 */
    int64_t run_windows;         /* out: windows this run summed (none before a resume) */
    double tokens_per_s;         /* out: run_windows x seq_len / seconds (0 without time) */
};
int kv_collect_run(const struct kv_model *m, struct kv_calib *c, struct kv_stats *s,
                   struct kv_collect_opts *opts, struct kv_err *err);

/* The options of a collect run as a caller names them in messages (see
 * enum kv_calib_opt, whose names it starts with: a collect names array
 * serves kv_calib_check as it is). */
enum kv_collect_opt {
    KV_COLLECT_OPT_SEQ_LEN = KV_CALIB_OPT_SEQ_LEN,
    KV_COLLECT_OPT_SAMPLES = KV_CALIB_OPT_SAMPLES,
    KV_COLLECT_OPT_SHARD = KV_CALIB_OPT_SHARD,
    KV_COLLECT_OPT_CHECKPOINT_EVERY = KV_CALIB_OPT_COUNT,
    KV_COLLECT_OPT_TEXT,   /* the calibration inputs */
    KV_COLLECT_OPT_OUTPUT, /* out_path */
    KV_COLLECT_OPT_RESUME, /* continuing a checkpoint (kv_collect_start's resume) */
    KV_COLLECT_OPT_COUNT
};

/* Before any work, the options of a collect run: kv_calib_check of
 * o->data, and checkpoint_every 0 (never) or more (kv_collect_run reads a
 * negative one as never; a caller's option is refused). KV_EINVAL names
 * the first option that is wrong. */
int kv_collect_check_options(const struct kv_collect_opts *o, const char *const *names,
                             struct kv_err *err);
/* Before any work, where a collect run will write: o->out_path must not be
 * a directory, nor the model (model_path) or one of the inputs
 * (inputs[0..n_inputs)), nor, without resume, hold an unfinished
 * checkpoint; and its folder must take a new file now (a probe file is
 * created and removed), not after hours of windows. KV_EINVAL (KV_EIO for
 * the folder) naming out_path otherwise. */
int kv_collect_check_output(const struct kv_collect_opts *o, int resume, const char *model_path,
                            const char *const *inputs, int64_t n_inputs,
                            const char *const *names, struct kv_err *err);
/* The statistics a collect run of m sums into (*out, kv_stats_free): with
 * resume and a file at o->out_path, the checkpoint read back from it (then
 * o->resume is set and o->resumed_from is its next window); else fresh
 * statistics for m (o->resume cleared, o->resumed_from -1). */
int kv_collect_start(const struct kv_model *m, int resume, struct kv_collect_opts *o,
                     struct kv_stats **out, struct kv_err *err);

/* Output covariance Σ yᵀy of KV heads head0 .. head0+nh-1 of the layer's K
 * (which = 0) or V (which = 1) projection, or of query heads (which = 2,
 * pre-RoPE), derived from the input sums:
 * y = x Wᵀ + b gives W C_x Wᵀ + W Σx bᵀ + b Σxᵀ Wᵀ + N b bᵀ. out is
 * [nh*d_h, nh*d_h] row-major. Pre-RoPE for K. s must match m's shapes. */
int kv_stats_out_cov(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
                     int which, int64_t head0, int64_t nh, double *out, struct kv_err *err);
/* Calibration mean of the same output, Σy / N = W Σx / N + b, for heads
 * head0 .. head0+nh-1: out [nh*d_h]. N is the statistics' token count (> 0). */
int kv_stats_out_mean(const struct kv_stats *s, const struct kv_model *m, int64_t layer,
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
/* What a unit's basis minimises (palu units, fdc values; docs/design.md,
 * "Bases that see the output"). */
enum kv_basis {
    KV_BASIS_ENERGY = 0, /* E‖Δy‖²: the output covariance's eigenvectors (the papers') */
    KV_BASIS_OUTPUT,     /* keys E[(q·Δk)²] (query-aware, rope-averaged), values
                            E‖Δv O_iᵀ‖² (through the output projection) */
    KV_BASIS_LOSS,       /* E[(g·Δy)²], g = ∂L/∂y: needs collect --fisher statistics */
    KV_BASIS_COUNT
};
const char *kv_basis_name(enum kv_basis b);
int kv_basis_parse(const char *s);
const char *kv_method_name(enum kv_method m);
const char *kv_alloc_name(enum kv_alloc a);
/* Parse a name; returns -1 when unknown. */
int kv_method_parse(const char *s);
int kv_alloc_parse(const char *s);

/* The options of a decomposition as messages name them: a check takes
 * names[KV_DECOMPOSE_OPT_COUNT] indexed by this enum (a program passes its
 * flags, "--eps"), or NULL for the library's own quantity names ("eps",
 * "group size"). */
enum kv_decompose_opt {
    KV_DECOMPOSE_OPT_METHOD,
    KV_DECOMPOSE_OPT_ALLOC,
    KV_DECOMPOSE_OPT_EPS,
    KV_DECOMPOSE_OPT_RATIO,
    KV_DECOMPOSE_OPT_GROUP_SIZE,
    KV_DECOMPOSE_OPT_RANK_MULTIPLE,
    KV_DECOMPOSE_OPT_MIN_RANK,
    KV_DECOMPOSE_OPT_D_MIN,
    KV_DECOMPOSE_OPT_D_MAX,
    KV_DECOMPOSE_OPT_COND_SKIP,
    KV_DECOMPOSE_OPT_ERROR_BUDGET,
    KV_DECOMPOSE_OPT_STATS,
    KV_DECOMPOSE_OPT_TEXT,
    KV_DECOMPOSE_OPT_SEQ_LEN,
    KV_DECOMPOSE_OPT_WINDOWS,
    KV_DECOMPOSE_OPT_KV_BITS,
    KV_DECOMPOSE_OPT_CENTER,
    KV_DECOMPOSE_OPT_BASIS,
    KV_DECOMPOSE_OPT_COUNT
};

/* A zero field means its default where a default is listed; kv_decompose
 * resolves alloc KV_ALLOC_DEFAULT, kv_bits 0 and group_size, rank_multiple,
 * min_rank 0 in place (to the method's allocation, 16 and 1), so the struct
 * tells what ran. */
struct kv_decompose_opts {
    enum kv_method method;
    enum kv_alloc alloc;
    double eps;            /* (0, 1]; 0 = not given */
    double ratio;          /* (0, 1] fraction of base KV bytes kept; 0 = not given */
    int64_t group_size;    /* KV heads per unit for svd/palu/fdc values (default 1) */
    int64_t rank_multiple; /* ranks rounded up to a multiple, 1 .. 2^20 (default 1) */
    int64_t min_rank;      /* floor per unit (default 1) */
    double d_min, d_max;   /* lorc: rank fractions of eq. 13 (d_max default 1; d_min
                              searched for --ratio when 0) */
    double cond_skip;      /* lorc: keep layers whose log10 cumulative condition number
                              exceeds this (0 = never skip) */
    double error_budget;   /* layer-budget: e_b, normalised layer output error */
    const double *fisher;  /* per slot Fisher scores (tests; NULL = from the stats: Σ of
                              fisher_k/v over the rows of the slot's units, when they have it) */
    int64_t kv_bits;       /* latent storage bits: 16 (default), 8, 4, 3 or 2 (byte accounting),
                              or KV_DECOMPOSE_BITS_AUTO: ranks and bands of bits chosen
                              together under the ratio's bytes (docs/design.md, "Rank and
                              bits together"); needs a ratio and statistics, implies
                              hadamard and global */
    int hadamard;          /* fuse a Walsh-Hadamard matrix into the factors */
    enum kv_basis basis;   /* what palu units and fdc values minimise (default energy) */
    int center;            /* latent factors of y - μ, μ the calibration mean, added back
                              exactly (up_bias, o_fused_bias); the spectra and eps are then
                              of the variance. Needs statistics. Post-RoPE rotation keys
                              are never centred (their mean turns with the position). */
    /* layer-budget measures real layer outputs on these windows (tokens
     * [calib_windows][seq_len]; kv_decompose_defaults: windows of 256, 8) */
    const int32_t *calib_tokens;
    int64_t calib_windows, seq_len;
    /* The inputs as given, for the checks and the manifest (may be NULL):
     * the statistics file s was read from, and layer-budget's text. */
    const char *stats_path;
    const char *text_path;
    /* How messages name the options (enum kv_decompose_opt; a program
     * passes its flags); NULL: the library's quantity names. */
    const char *const *names;
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
    int target_reached;     /* 0 when a ratio was given, least_bytes is above the target
                               and so is the cache written; else 1 */
    double param;          /* the allocation's parameter as run: eps, width fraction
                              (uniform, fisher), removal rate, d_min/d_max
                              (progressive), e_b (layer-budget); 0 for global */
    /* global with a ratio: its objective (kv_dec_objective) and uniform's at
     * the same target; kept_uniform 1 when uniform's was lower and its ranks
     * were kept (so global is never worse than uniform on its objective) */
    double objective, objective_uniform;
    int kept_uniform;
    /* global with a ratio and calibration tokens: the choice is measured
     * instead, the mean KL(base ‖ compressed) of each on the calibration
     * windows (probed 1) */
    int probed;
    double probe_kl, probe_kl_uniform;
    /* --kv-bits auto: objective is the model's cost of the mix of bands
     * (truncation plus quantization noise, in global's units), or of the
     * width kept; objective_fixed[w] that of the same search held to one
     * width KV_DECOMPOSE_WIDTHS[w] (INFINITY where that width cannot reach
     * the target); fixed_kept the width whose one-width choice was kept
     * because it scored lower (0: the mix was kept) */
    double objective_fixed[5];
    double objective_mix; /* the mix's own modelled cost */
    int fixed_kept;
    /* with calibration tokens (--text) the six choices are measured
     * instead: probe_kl the mix's calibration KL, probe_kl_fixed[w] each
     * width's (INFINITY where it cannot reach the target), the lowest kept */
    double probe_kl_fixed[5];
    double error_k, error_v; /* predicted calibration error of all K (V) units:
                                Σ dropped / Σ energy (0 without energy) */
    int64_t odd_rank_units; /* with hadamard: units of odd rank > 1, in which the
                               rotation leaves one latent coordinate alone (its
                               last block, of size 1); 0 without */
};

/* kv_bits of --kv-bits auto, and the widths it chooses among. */
#define KV_DECOMPOSE_BITS_AUTO (-1)
#define KV_DECOMPOSE_N_WIDTHS 5
extern const int KV_DECOMPOSE_WIDTHS[KV_DECOMPOSE_N_WIDTHS]; /* 16, 8, 4, 3, 2 */

/* `kvcal decompose`'s defaults: everything zero but method palu,
 * group_size, rank_multiple and min_rank 1, kv_bits 16, and layer-budget
 * windows of seq_len 256, calib_windows 8. */
void kv_decompose_defaults(struct kv_decompose_opts *o);

/* The rules on the options alone, checkable before a model loads: eps and
 * ratio in (0, 1], not both, and the one each allocation needs; an
 * allocation's own options (d_min, d_max, cond_skip only with progressive,
 * error_budget only with layer-budget); group_size, rank_multiple, min_rank,
 * kv_bits (kv_lr_bits_valid), seq_len and calib_windows in range; fisher
 * needs stats_path (or o->fisher scores) and layer-budget text_path. names
 * (enum kv_decompose_opt) say how the message calls the options; NULL: the
 * quantity names ("eps 1.5 is outside (0, 1]"). KV_EINVAL with no path
 * naming the first rule broken, in a fixed order. */
int kv_decompose_check(const struct kv_decompose_opts *o, const char *const *names,
                       struct kv_err *err);

/* The rules that need the model m and the statistics s (NULL: none), after
 * kv_decompose_check: a method other than svd and lorc needs statistics,
 * group_size divides the model's KV heads, s has m's shapes and is complete
 * (not an unfinished checkpoint: kv_stats_check_complete), and fisher
 * allocation needs Fisher sums in s (or o->fisher). KV_EINVAL: about the
 * options (no path), or naming o->stats_path when it is about that file. */
int kv_decompose_check_model(const struct kv_decompose_opts *o, const struct kv_model *m,
                             const struct kv_stats *s, const char *const *names,
                             struct kv_err *err);

/* Build low-rank K/V factors for m from its statistics s (which may be NULL
 * for svd and lorc: then errors are measured in the weight metric). Checks
 * the options first (kv_decompose_check with seq_len and calib_windows 0
 * read as their defaults, then kv_decompose_check_model, naming the options
 * as o->names does), with calib_tokens standing for text_path and s for
 * stats_path. Only the shapes of s are checked here; kv_stats_matches_model
 * checks that s came from m. The result records per unit the calibration
 * energy and the dropped energy (the predicted ‖Y − Y'‖²_F). Errors:
 * KV_EINVAL for impossible options (naming the option), KV_ENUMERIC naming
 * the layer and unit (and o->stats_path as the path when given). */
int kv_decompose(const struct kv_model *m, const struct kv_stats *s,
                 struct kv_decompose_opts *o, struct kv_lowrank **out, struct kv_err *err);

/* The manifest's records of a run: *options_json, the compact JSON object of
 * the options as run (o after kv_decompose), and *stats_json (may be NULL
 * when not wanted), the statistics s read from o->stats_path, or null
 * without s. Both malloc'd; the caller frees them. */
int kv_decompose_records(const struct kv_decompose_opts *o, const struct kv_stats *s,
                         char **options_json, char **stats_json, struct kv_err *err);

/* Write lr, decomposed from m with o and s, as a compressed model directory
 * dir (kv_lr_dir_write) whose manifest carries kv_decompose_records.
 * model_path and tokenizer_path are as given (see struct kv_lr_dir_info). */
int kv_decompose_write(const struct kv_model *m, const struct kv_lowrank *lr,
                       const struct kv_decompose_opts *o, const struct kv_stats *s,
                       const char *model_path, const char *tokenizer_path, const char *dir,
                       struct kv_err *err);

/* ---------------------------------------------------------------- report */

/* The relative output error of unit u of layer `layer`'s keys (which 0)
 * or values (1) of lr, measured exactly on statistics s (any text's, from
 * `kvcal collect`; m's shapes): with y = W x + b the unit's rows of W_k or
 * W_v [n_heads*d_h, d] and their bias, and ŷ = up (down x + down_bias) +
 * up_bias, the residual is r = A x + c with A = W − up·down and c = b −
 * up·down_bias − up_bias, so over the tokens
 *   *resid = Σ‖r‖² = tr(A XᵀX Aᵀ) + 2 cᵀ A Σx + n ‖c‖²,
 *   *total = Σ‖y‖² = tr(W XᵀX Wᵀ) + 2 bᵀ W Σx + n ‖b‖²,
 * from s's XᵀX, Σx and token count n, in float64 (the float32 factors
 * widened). The error is *resid / *total; on the calibration statistics
 * of an energy-basis decomposition without centring it equals the
 * manifest's dropped / energy. KV_EUNSUPPORTED (the reason in err) for a
 * side kept full, a post-RoPE rotation unit (no down/up) or factors not
 * read; KV_ENUMERIC when a sum is not finite; KV_ENOMEM. */
int kv_lr_unit_error(const struct kv_stats *s, const struct kv_model *m,
                     const struct kv_lowrank *lr, int64_t layer, int which, int64_t u,
                     double *resid, double *total, struct kv_err *err);

/* The eigenvalues (descending, by kv_la_eigh's LAPACKE dsyevd) of each
 * unit's output covariance in r from the calibration statistics s of m
 * (kv_stats_out_cov; post-RoPE rotation units: the post-RoPE key
 * covariance their rank is of). The units are the compressed model's
 * (kv_report_set_compressed first) or, without one, one per KV head.
 * s must match m (kv_stats_matches_model). Errors: KV_ENUMERIC naming the
 * layer and heads, KV_ENOMEM. */
int kv_report_spectra(struct kv_report *r, const struct kv_stats *s, const struct kv_model *m,
                      struct kv_err *err);

/* Every compressed unit's measured error (kv_lr_unit_error) on the
 * held-out statistics s read from eval_path, into r (whose units are lr's:
 * kv_report_set_compressed first); a unit kv_lr_unit_error cannot measure
 * keeps its reason and is shown as not measured. Errors name eval_path. */
int kv_report_measure(struct kv_report *r, const char *eval_path, const struct kv_stats *s,
                      const struct kv_model *m, const struct kv_lowrank *lr, struct kv_err *err);

/* ---------------------------------------------------------------- MLA export */

/* The rewrite of a Llama-family model as DeepSeek-V2 multi-head latent
 * attention (docs/design.md, "Export as Multi-head Latent Attention"). */
struct kv_mla;
struct kv_mla_opts {
    int64_t kv_lora_rank; /* d_c: latent values per token (1 .. 2 G d_h) */
    int64_t rope_dim;     /* R: the shared RoPE key's dims (even, 2 .. d_h) */
    int64_t rope_step;    /* slot i holds the model's pair i*rope_step */
    int balance;          /* weigh keys and values to equal energy in the latent */
    double latent_eps;    /* the epsilon the engine normalizes the latent with;
                           * 0: the model's rms_norm_eps */
    /* calibration windows [calib_windows][seq_len] (NULL: none): the key
     * components that lose RoPE are then turned by the map fitted to the
     * model's scores on them (kv_mla_fit_turn, docs/design.md step 3'),
     * else scored as they are */
    const int32_t *calib_tokens;
    int64_t calib_windows, seq_len;
};
/* What each layer's rewrite keeps: the share of the pre-RoPE key energy
 * that keeps its rotation (component 0 of the kept pairs), the share of
 * the (balanced) joint key-value energy the latent keeps, the latent
 * scale alpha and the bound on the latent's RMS it was chosen from. */
struct kv_mla_layer_info {
    double rope_share, latent_share, alpha, latent_rms_bound;
    /* with calibration windows: the attention's mean distance in the
     * layer (positions), else 0 */
    double mean_distance;
};
/* KV_OK when c and o can be converted; else KV_EUNSUPPORTED (the model) or
 * KV_EINVAL (the options), the reason in err. */
int kv_mla_check(const struct kv_config *c, const struct kv_mla_opts *o, struct kv_err *err);
/* Step 3' (docs/design.md): for every layer, KV head g and RoPE pair f,
 * the map [[c, s], [−s, c]] that best stands, on o's calibration windows,
 * for the rotation R(−ωΔ) the residual key (what loses RoPE) would get:
 * least squares of each query's scores, centred and weighed by its
 * attention. turn [n_layers][n_kv_heads][head_dim/2][2] receives (c, s),
 * the identity where nothing loses RoPE; mean_distance [n_layers] (or
 * NULL) the attention's mean distance. KV_EINVAL without windows. */
int kv_mla_fit_turn(const struct kv_model *m, const struct kv_stats *s, const struct kv_mla_opts *o,
                    double *turn, double *mean_distance, struct kv_err *err);
/* m rewritten under o with the calibration statistics s (m's); info
 * [n_layers] or NULL. Free *out with kv_mla_free (kvcal_core.h). */
int kv_mla_convert(const struct kv_model *m, const struct kv_stats *s, const struct kv_mla_opts *o,
                   struct kv_mla **out, struct kv_mla_layer_info *info, struct kv_err *err);
/* kv_mla_convert, then the result written to path as GGUF "deepseek2"
 * (float32 matrices; kv_gguf_write_mla in formats/ggufmodelw.h). KV_EINVAL
 * when o->latent_eps is not the model's epsilon (llama.cpp has one). */
int kv_mla_export_gguf(const struct kv_model *m, const struct kv_stats *s,
                       const struct kv_mla_opts *o, const char *path,
                       struct kv_mla_layer_info *info, struct kv_err *err);
/* kv_mla_convert, then the result written to the directory dir as HF
 * transformers' DeepseekV2ForCausalLM (kv_hf_write_mla in kvformats.h),
 * with the files files[0 .. n_files) (tokenizer files) copied in. The
 * latent norm is made for o->latent_eps: the model's rms_norm_eps (0) for
 * vLLM, SGLang and llama.cpp's converter, 1e-6 for transformers. */
int kv_mla_export_hf(const struct kv_model *m, const struct kv_stats *s,
                     const struct kv_mla_opts *o, const char *dir, const char *const *files,
                     int n_files, struct kv_mla_layer_info *info, struct kv_err *err);

#ifdef __cplusplus
}
#endif
/* ---------------------------------------------------------------- train-tokenizer */

/* Learn a byte-level BPE vocabulary of vocab_size ids (256 bytes, merges,
 * then <|begin_of_text|> and <|end_of_text|>) from the texts, pre-tokenized
 * by GPT-2's regex (regex NULL) or by regex then byte level, and write it as
 * an HF tokenizer.json at out_path (atomically). Fewer ids when no pair
 * occurs twice. progress (may be NULL) is called after each merge. */
struct kv_bpe_opts {
    int32_t vocab_size;
    const char *regex;
};
struct kv_bpe_result {
    int64_t bytes, words, distinct_words;
    int32_t merges, vocab;
    double seconds;
};
typedef void (*kv_bpe_progress_fn)(void *ctx, int32_t pieces, int32_t target);
int kv_bpe_train(const char *const *paths, int n_paths, const struct kv_bpe_opts *o,
                 const char *out_path, kv_bpe_progress_fn progress, void *ctx,
                 struct kv_bpe_result *r, struct kv_err *err);

#endif
