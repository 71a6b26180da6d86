/* Shared CLI plumbing: option tables, messages, progress, resources.
 * Only cmd/ prints or exits. */
#ifndef KV_CLI_H
#define KV_CLI_H

#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "kvcal.h"

enum { EXIT_OK = 0, EXIT_ERR = 1, EXIT_USAGE = 2, EXIT_TOLERANCE = 3 };

enum cli_opt_type { OPT_FLAG, OPT_STR, OPT_INT, OPT_DOUBLE, OPT_LIST };

/* Options a command may have (cli_parse tracks which were given). */
#define CLI_MAX_OPTS 128

/* Destination of an OPT_LIST option: every occurrence is appended. */
#define CLI_MAX_LIST 1024
struct cli_list {
    const char *v[CLI_MAX_LIST];
    int n;
};

/* One option, declared once: drives both parsing and --help. */
struct cli_opt {
    const char *name;  /* long name without "--" */
    char short_name;   /* 0 if none */
    enum cli_opt_type type;
    void *dst;         /* int* (flag), const char** (str), int64_t* (int), double*,
                          struct cli_list* (list) */
    const char *metavar;
    const char *help;
};

/* The options most commands share, each worded once. */
#define CLI_OPT_MODEL(dst) {"model", 'm', OPT_STR, (dst), "PATH", "model: HF directory, .gguf or llama2.c .bin"}
#define CLI_OPT_THREADS(dst) \
    {"threads", 0, OPT_INT, (dst), "N", "threads for BLAS and OpenMP (default: all cores)"}
#define CLI_OPT_JSON(dst) {"json", 0, OPT_FLAG, (dst), NULL, "print one JSON object on stdout"}
#define CLI_OPT_QUIET(dst) {"quiet", 'q', OPT_FLAG, (dst), NULL, "no progress on stderr"}
#define CLI_OPT_PARSE_SPECIAL                                                                   \
    {"parse-special", 0, OPT_FLAG, &cli_parse_special, NULL,                                  \
     "read special-token strings in the text (\"<s>\", \"<|endoftext|>\") as their\n"          \
     "control tokens; by default they are ordinary text and only counted"}

struct cli_cmd {
    const char *name;
    const char *usage;    /* "--model M --text T [options]" */
    const char *summary;  /* one line */
    const char *details;  /* paragraphs after the options, with examples */
    const struct cli_opt *opts;
    int n_opts;
    int max_positional;   /* positional arguments accepted */
};

/* Parse argv (argv[0] is the subcommand name). Positional arguments are
 * stored in pos[0..*n_pos). Returns -1 to continue, or an exit code (0 after
 * --help, EXIT_USAGE after a usage error already printed). */
int cli_parse(const struct cli_cmd *cmd, int argc, char **argv, const char **pos, int *n_pos);

/* Print "kvcal CMD: message" plus a hint to stderr; returns EXIT_USAGE. */
int cli_usage_error(const struct cli_cmd *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Print a library error ("kvcal: path: offset N: msg") and return EXIT_ERR. */
int cli_report(const struct kv_err *err);

/* Print a refusal that a library check made before any work (the user's
 * mistake, not the library's failure) as cli_report does, but never with
 * the detection site of -v. Returns EXIT_ERR. */
int cli_report_refusal(const struct kv_err *err);

/* Global -v: add detection sites to error messages. */
extern int cli_verbose;
/* --parse-special: special-token strings in text become control ids. */
extern int cli_parse_special;
/* KV_TOK_* flags texts are read with: the tokenizer's BOS/EOS policy and
 * --parse-special. */
int cli_tok_flags(const struct kv_tokenizer *tok);
/* "text" or "parsed": what special-token strings in text became. */
const char *cli_special_mode(void);

/* Progress on stderr: a redrawn bar on a TTY, otherwise a plain line at
 * each 10% step. quiet suppresses it. */
struct cli_progress {
    const char *what;  /* "windows" */
    double t0;
    int tty, quiet, last_decile;
};
void cli_progress_start(struct cli_progress *p, const char *what, int quiet);
/* Callback shape matching kv_progress_fn. */
int cli_progress_cb(void *ctx, int64_t done, int64_t total, int64_t tokens_done);
void cli_progress_end(struct cli_progress *p);

/* Peak resident set size of this process in MiB. */
double cli_peak_rss_mib(void);

/* The OpenBLAS kernel set this process runs ("Haswell", "SkylakeX", ...;
 * OPENBLAS_CORETYPE chooses it at start), and in *better the one to select
 * when the CPU offers AVX-512 that the running set does not use, else NULL. */
const char *cli_blas_kernels(const char **better);
/* " (OpenBLAS K kernels)" or " (OpenBLAS K kernels; OPENBLAS_CORETYPE=B is
 * faster here, docs/performance.md)" into buf, for the speed lines. */
const char *cli_blas_note(char *buf, size_t cap);
/* Add "blas_kernels" and "blas_faster" (the better set, or null) to o. */
void cli_json_blas(json_t *o);

/* A mixed-bit model's latent coordinates per token at each width, over
 * every band of every compressed unit: "16-bit 40, 8-bit 212, ..." (the
 * widths that hold any) into buf, and as {"16": n, "8": n, "4": n, "3": n,
 * "2": n}. */
const char *cli_bits_mix(const struct kv_lowrank *lr, char *buf, size_t cap);
/* A unit's rank as a side's rank list prints it, after a comma unless it
 * is the first: "12", or with bands "4@16+20@4" (n@bits). Appends at buf
 * + *at, cap in all; *at moves past what was written (snprintf's count). */
void cli_unit_rank(const struct kv_lr_unit_info *ui, int first, char *buf, size_t cap, size_t *at);
/* Layer l's keys or values' bands, one [[n, bits], ...] per unit, or NULL
 * when lr's bits are not mixed. */
json_t *cli_side_bands_json(const struct kv_lowrank *lr, int64_t l, int which);
json_t *cli_bits_mix_json(const struct kv_lowrank *lr);

/* MPI (cmd/mpi.c): in the MPI build (build/mpi/kvcal) a process started
 * by a launcher such as mpirun joins MPI_COMM_WORLD; otherwise, and in the
 * plain build, it is rank 0 of 1. Messages of cli_report and friends name
 * the rank when there are several. */
void cli_mpi_init(int *argc, char ***argv);
void cli_mpi_finalize(void);
int cli_mpi_rank(void);
int cli_mpi_size(void);
/* Whether any rank's failed is non-zero (every rank calls it). */
int cli_mpi_any_failed(int failed);
/* v[0..n) summed (cli_mpi_sum) or maximised (cli_mpi_max) element-wise
 * over the ranks, in place on every rank (every rank calls it). */
void cli_mpi_sum(double *v, int64_t n);
void cli_mpi_max(double *v, int64_t n);
/* After mpirun stopped the job (this rank got SIGTERM): the ranks on this
 * host whose process has ended, as "1, 3" in list, and their count; 0
 * when none is known (a peer on another host, or the user stopped the
 * job). *speak: whether no lower rank is still running, so that this rank
 * reports for the job and the message is said once. */
int cli_mpi_dead_ranks(char *list, size_t cap, int *speak);
/* Rank from's file src copied to dst on rank 0 (created, synced), by
 * messages: every rank calls it; 0, or 1 with the reason in msg on the
 * rank that failed (from's read, or rank 0's write). */
int cli_mpi_file_to_root(int from, const char *src, const char *dst, char *msg, size_t cap);

/* Load a model, honouring --tokenizer; prints errors. Returns 0 or EXIT_ERR. */
int cli_load_model(const char *path, const char *tok_path, struct kv_model **m);

/* Token ids for evaluation: from --tokens (raw ids) or --text (read .txt/.gz,
 * encode with BOS). *n_bytes receives the text size (0 for --tokens). */
int cli_load_tokens(const struct kv_model *m, const char *text_path, const char *tokens_path,
                    int32_t **ids, int64_t *n, size_t *n_bytes);

/* 0 when tok has a bos token (kvcal starts every text with one); else
 * prints an error naming the tokenizer's file (tok_path, or the model's
 * when the model holds it) and returns EXIT_ERR. */

/* The tokens verify scores, read window by window (t->src): --tokens in
 * memory (4 bytes a token), or --text tokenized as it streams, counted in
 * a first pass (memory of the order of a megabyte of text, whatever the
 * text's size). t->n_bytes: the text's bytes (0 for --tokens). Prints errors;
 * returns 0 or EXIT_ERR. */
struct cli_tokens {
    struct kv_token_src src;
    const char *path;
    int32_t *ids;               /* --tokens */
    struct kv_text_tokens *tt;  /* --text */
    size_t n_bytes;
    int64_t specials;           /* special-token strings read as text (--text) */
};
int cli_open_tokens(const struct kv_model *m, const char *text_path, const char *tokens_path,
                    struct cli_tokens *t);
void cli_close_tokens(struct cli_tokens *t);

/* "dim 64, 5 layers, 8 heads (4 kv), head_dim 8, ffn 172, vocab 512" */
void cli_describe_config(const struct kv_config *c, char *buf, size_t cap);

/* JSON values that never fail on user data: text that is not valid UTF-8
 * (a file name, a tensor name) keeps its valid characters and has each bad
 * byte replaced by U+FFFD; a non-finite real becomes null. */
json_t *cli_json_text(const char *s);
json_t *cli_json_real(double v);
/* The inputs of a stats file as a JSON array of {path, sha256, bytes,
 * tokens, windows}. */
json_t *cli_json_stats_inputs(const struct kv_stats *s);
/* Print o on stdout and release it. A NULL o (a pack that failed) is
 * reported on stderr instead. Returns EXIT_OK or EXIT_ERR. */
int cli_print_json(json_t *o, size_t flags);

/* Human count: 260.1K, 15.2M. */
void cli_human_count(double v, char *buf, size_t cap);

#endif
