/* kvcal formats (formats/): the public API of the file layer.
 *
 * Models and tokenizers from files, text and token files, the statistics
 * file, the compressed model directory and its manifest, the dense export
 * and the HF writer. docs/formats.md describes every format; each
 * formats/<name>.h holds its layout. Depends on kvcal_core.h only.
 */
#ifndef KVCAL_FORMATS_H
#define KVCAL_FORMATS_H

#include "kvcal_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- models */

/* Open a model from an HF directory, a GGUF file or a llama2.c .bin file
 * (detected from the path). tokenizer_path, if non-NULL, overrides the model's
 * own tokenizer: a llama2.c tokenizer.bin, an HF tokenizer.json or a GGUF file.
 * On success *out owns every mapping it needs; release with kv_model_close. */
int kv_model_open(const char *path, const char *tokenizer_path, struct kv_model **out,
                  struct kv_err *err);

/* Load a tokenizer on its own: llama2.c tokenizer.bin, HF tokenizer.json, or
 * the vocabulary of a GGUF file (detected from contents/extension). */
int kv_tok_open(const char *path, struct kv_tokenizer **out, struct kv_err *err);

/* ---------------------------------------------------------------- text */

/* Read a whole .txt or .gz file (gzip detected by magic) into a malloc'd,
 * NUL-terminated buffer. */
int kv_text_read(const char *path, char **out, size_t *len, struct kv_err *err);

/* The same text read in order, in pieces, in memory of one piece: open,
 * then read up to cap bytes at a time (*n 0 at the end). The file's raw
 * bytes (compressed, for gzip) are hashed as they are read: once read to
 * the end, kv_text_src_sha256 gives their sha256 (KV_EINVAL before). */
struct kv_text_src;
int kv_text_src_open(const char *path, struct kv_text_src **out, struct kv_err *err);
int kv_text_src_read(struct kv_text_src *s, char *buf, size_t cap, size_t *n, struct kv_err *err);
uint64_t kv_text_src_file_bytes(const struct kv_text_src *s);
uint64_t kv_text_src_text_bytes(const struct kv_text_src *s);
int kv_text_src_sha256(struct kv_text_src *s, char hex[65]);
void kv_text_src_close(struct kv_text_src *s);

/* A copy of s that a JSON file can hold: each byte that starts no valid
 * UTF-8 character (as jansson judges it) becomes U+FFFD, the rest is kept.
 * For paths and names that are bytes, not text. malloc'd; NULL without
 * memory. */
char *kv_utf8_repair(const char *s);

/* Read little-endian uint32 token ids (a --tokens file). */
int kv_tokens_read(const char *path, int32_t **ids, int64_t *n, int32_t n_vocab,
                   struct kv_err *err);

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

/* Write m with its attention replaced by mla as an HF directory of
 * transformers' DeepseekV2ForCausalLM (docs/formats.md, "MLA as an HF
 * directory"): config.json, model.safetensors (the attention in F32; the
 * model's other weights F32, or their stored F16 or BF16 when m is
 * streamed from its file, read a piece at a time so memory does not grow
 * with the model) and the files files[0 .. n_files) copied in under their
 * own names (tokenizer files). dir must be new or empty. Atomic per file,
 * config.json last. Errors: KV_EINVAL (dir not empty), KV_EIO naming the
 * file, KV_ENOMEM. */
struct kv_mla;
int kv_hf_write_mla(const struct kv_model *m, const struct kv_mla *mla, const char *dir,
                    const char *const *files, int n_files, struct kv_err *err);

/* Write (atomically) an HF tokenizer.json of a byte-level vocabulary: a BPE
 * model with byte_fallback whose ids 0..255 are the pieces "<0x00>".."<0xFF>"
 * and no merges, plus the special tokens "<s>" = 256 (bos) and "</s>" = 257
 * (eos): 258 ids, every byte string encodes. Errors: KV_EIO naming path. */
int kv_hf_write_byte_tokenizer(const char *path, struct kv_err *err);

/* Write (atomically) an HF tokenizer.json of a byte-level BPE vocabulary as
 * GPT-2 and Llama 3 have them: pieces[i] (raw bytes, plen[i] long) is id i
 * for i < n (written in GPT-2's mapped form), merges[2k], merges[2k+1] the
 * ids merged at rank k (as ["a", "b"] pairs), then the special tokens
 * "<|begin_of_text|>" = n (BOS, added by the post-processor's template) and
 * "<|end_of_text|>" = n + 1 (EOS); pre-tokenizer ByteLevel with
 * GPT-2's regex, or with regex given, Split(regex) then ByteLevel. */
int kv_hf_write_bpe_tokenizer(const char *path, const char *const *pieces, const size_t *plen,
                              int32_t n, const int32_t *merges, int32_t n_merges,
                              const char *regex, struct kv_err *err);

/* ---------------------------------------------------------------- statistics */

/* Calibration statistics (opaque): per-layer float64 sums over tokens of
 * the attention input's XᵀX and Σx, the post-RoPE QᵀQ and KᵀK per head and,
 * from `collect --fisher`, Fisher sums (docs/formats.md has the file). */
struct kv_stats;

/* One input the sums came from. */
struct kv_stats_input {
    char *path;
    char sha256[65];
    uint64_t bytes;
    int64_t tokens;   /* tokens of the input (with BOS) */
    int64_t windows;  /* windows of it accumulated */
};

/* What a statistics file holds, apart from the sums (a copy; kv_stats_info). */
struct kv_stats_info {
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim;
    char fingerprint[65];  /* kv_model_fingerprint of the model */
    char version[32];      /* kvcal version that wrote the file */
    int64_t seq_len;
    int64_t tokens;        /* tokens accumulated */
    int64_t windows;       /* windows accumulated */
    int has_fisher;        /* Fisher sums too (collect --fisher) */
    char sampling[16];     /* the plan: "sequential", "random" or "merged" */
    uint64_t seed;
    int64_t samples;       /* windows asked for (0 = all) */
    int64_t shard_index, shard_count;
    int64_t plan_windows;  /* windows in the plan */
    int64_t next_window;   /* plan entries done; < plan_windows in a checkpoint */
    int64_t n_inputs;
    char tokenization[48]; /* how text became tokens: "bos=1 eos=0 special=text"
                              (special=parsed with --parse-special); "" in files
                              written before kvcal recorded it */
};
struct kv_stats_info kv_stats_info(const struct kv_stats *s);
/* Input i (0 .. n_inputs-1), valid while s lives. */
const struct kv_stats_input *kv_stats_input(const struct kv_stats *s, int64_t i);
/* Σ over the rows of layer l's W_k (which 0) or W_v (which 1) of the Fisher
 * sums; NaN when s has none. */
double kv_stats_fisher_total(const struct kv_stats *s, int64_t l, int which);

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

/* The attention of what kvcal export --mla wrote from model m (a GGUF
 * deepseek2 file, or an HF DeepseekV2ForCausalLM directory when path is a
 * directory; its kvcal.mla.base_fingerprint must be m's), as a struct
 * kv_mla (kv_mla_free) to run with m's other weights (kv_fwd_set_mla).
 * Errors name the file and, where there is one, the byte offset. */
int kv_mla_open(const char *path, const struct kv_model *m, struct kv_mla **out,
                struct kv_err *err);

/* 1 when s was made by this model (same fingerprint and shapes), else 0 with
 * the difference in err (KV_EINVAL, naming path). */
int kv_stats_matches_model(const struct kv_stats *s, const struct kv_model *m, const char *path,
                           struct kv_err *err);
/* ---------------------------------------------------------------- output directory */

/* The compressed model directory of `kvcal decompose`: kvcal.json (the
 * manifest, docs/formats.md) and model.safetensors. */
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

/* Whether kv_lr_dir_write may write dir, checked before any work: dir is
 * absent, an empty directory or an earlier output (a directory holding
 * kvcal.json and no subdirectory), and its parent takes a new directory.
 * KV_EINVAL or KV_EIO naming dir otherwise; name is how messages call the
 * output ("--output"; NULL: "the output"). */
int kv_lr_dir_check(const char *dir, const char *name, struct kv_err *err);

/* Read dir/kvcal.json and the weights file it names, for base model m: the
 * format and version, the architecture and every dimension against m's
 * config, m's fingerprint against the recorded one (KV_EINVAL), every unit's
 * heads (contiguous, in range, each KV head exactly once), ranks (1..s*d_h),
 * each named tensor's presence and exact shape (F32, or F16/BF16 converted),
 * o_cols and q_cols (fused_query keys only on a model without rope), and
 * that kv_bytes_per_token is what the ranks give. On success *out owns copies of
 * every factor; release with kv_lr_free. Errors name the file and the
 * key or tensor (with its byte offset when known): KV_EIO, KV_EFORMAT,
 * KV_EINVAL (another model), KV_EUNSUPPORTED (a newer version, a mode kvcal
 * does not run), KV_ENOMEM. */
int kv_lr_dir_open(const char *dir, const struct kv_model *m, struct kv_lowrank **out,
                   struct kv_err *err);

/* Parse and validate a manifest from len bytes of buf (any bytes, no NUL
 * needed; at most 256 MiB), alone (no weights, no model); path only names
 * the file in messages. This is the whole of reading a manifest:
 * kv_lr_manifest_read and kv_lr_dir_open parse through it. On success *out
 * gets the shapes, modes, units, ranks, energies, o_cols, q_cols and latent
 * format, with every factor pointer NULL; release with kv_lr_free. Errors
 * name path: KV_EFORMAT (invalid JSON with the byte offset where it
 * stopped, a missing key, a wrong type or range, a rule of the layout
 * broken, with no offset), KV_EUNSUPPORTED (a newer version, another arch,
 * rope scaling or weight layout), KV_ENOMEM. */
int kv_lr_manifest_parse(const void *buf, size_t len, const char *path, struct kv_lowrank **out,
                         struct kv_err *err);

/* Read the manifest file at path and kv_lr_manifest_parse its bytes.
 * Errors as kv_lr_manifest_parse, and KV_EIO when path cannot be read. */
int kv_lr_manifest_read(const char *path, struct kv_lowrank **out, struct kv_err *err);

/* ---------------------------------------------------------------- dense export */

/* Write the source model at model_path (from which m was loaded) again in its
 * own format, with every compressed K/V weight replaced by up·down: an
 * ordinary model that any engine loads, as a quality proxy (same numbers, no
 * memory saving). HF directories become a directory, GGUF and llama2.c a
 * file; only the K/V tensors' bytes change (for gpt2 the K and V columns of
 * each Conv1D c_attn and its bias). postrope_rotation keys have no
 * dense form: KV_EUNSUPPORTED naming the layer, before anything is written.
 * A GGUF whose compressed K/V tensors are block-quantized is rewritten with
 * those tensors as F16 (rep->retyped of them, rep->from naming the type they
 * had); rep may be NULL. Atomic; see formats/export.h for every
 * rule. */
struct kv_export_report {
    int64_t retyped;    /* quantized K/V tensors written as F16 */
    char from[16];      /* the type they had ("Q4_K"; the first one's) */
};
int kv_lr_export_dense(const struct kv_model *m, const char *model_path,
                       const struct kv_lowrank *lr, const char *out,
                       struct kv_export_report *rep, struct kv_err *err);
/* The rules every export's output obeys, checked before anything is
 * written: out is not the model at model_path itself (same inode), and,
 * when it exists, is an empty directory for a directory output (is_dir)
 * or not a directory for a file. KV_EINVAL naming out, KV_EIO naming
 * model_path (cannot stat it). */
int kv_output_check(const char *model_path, const char *out, int is_dir, struct kv_err *err);



/* ---------------------------------------------------------------- report */

/* `kvcal report` (formats/report.h has the page's layout): one
 * self-contained HTML page (inline SVG, no script, nothing fetched) of what
 * a calibration and a compression did, and each figure as its own SVG
 * file. A report gathers its inputs through the calls below and calib/'s
 * kv_report_spectra and kv_report_measure (kvcalib.h); each section
 * appears only when its inputs were given. The same inputs give the same
 * bytes: no time, no pointer, fixed number formats, input order. */
struct kv_report;
int kv_report_init(struct kv_report **out, struct kv_err *err);
void kv_report_free(struct kv_report *r);
/* The page's heading (copied; the default is "kvcal report"). */
int kv_report_set_title(struct kv_report *r, const char *title, struct kv_err *err);
/* The base model m as given (path), for the provenance and the shapes.
 * Before kv_report_set_compressed. */
int kv_report_set_model(struct kv_report *r, const char *path, const struct kv_model *m,
                        struct kv_err *err);
/* A statistics file s read from path, shown in the provenance under role
 * ("calibration", "evaluation"). KV_EINVAL naming path when its shapes are
 * not the model's (set first). */
int kv_report_add_stats(struct kv_report *r, const char *role, const char *path,
                        const struct kv_stats *s, struct kv_err *err);
/* The compressed model lr (kv_lr_dir_open, or kv_lr_manifest_read without
 * a model: no factors needed) read from directory dir: its units, ranks,
 * predicted errors and bytes per token (the library's own count), and its
 * manifest's options (dir/kvcal.json). KV_EINVAL naming dir when its
 * shapes are not the model's. Before kv_report_spectra. */
int kv_report_set_compressed(struct kv_report *r, const char *dir, const struct kv_lowrank *lr,
                             struct kv_err *err);
/* The JSON lines of `make results` or `make results-kjv` (one object per
 * line holding the row's "verify" object, and "decompose"; rows with
 * "error", a refused decompose, are counted and left out; blank lines are
 * skipped). KV_EIO when path cannot be read, KV_EFORMAT naming path and
 * "line N" for a line that is not such an object. */
int kv_report_add_results(struct kv_report *r, const char *path, struct kv_err *err);
/* The JSON object of `kvcal verify --json` (with --compressed or of the
 * base alone). Errors as kv_json_load, KV_EFORMAT for missing fields. */
int kv_report_add_verify(struct kv_report *r, const char *path, struct kv_err *err);
/* The figures the report's data draws, in page order: up to cap names
 * (static strings) into names; returns how many there are. */
int kv_report_figures(const struct kv_report *r, const char **names, int cap);
/* The page (*out malloc'd, *len bytes, NUL-terminated). svg_stem names the
 * figure files in the captions (only its last path component is shown). */
int kv_report_html(const struct kv_report *r, const char *svg_stem, char **out, size_t *len,
                   struct kv_err *err);
/* One figure as a standalone SVG document (with the XML declaration).
 * KV_EINVAL when the report does not draw it. */
int kv_report_svg(const struct kv_report *r, const char *figure, char **out, size_t *len,
                  struct kv_err *err);
/* The file of a figure beside html_path: STEM-figure.svg, STEM being
 * html_path less a final ".html" (malloc'd; NULL without memory). */
char *kv_report_svg_path(const char *html_path, const char *figure);
/* Before any work: html_path must not be a directory (KV_EINVAL naming it),
 * nor any of the figure files, and its folder must exist (KV_EIO). */
int kv_report_check_output(const char *html_path, struct kv_err *err);
/* Write the page to html_path and every figure beside it
 * (kv_report_svg_path), each atomically (temporary, fsync, rename);
 * *n_svg (may be NULL) receives the figure count. Errors name the file. */
int kv_report_write(const struct kv_report *r, const char *html_path, int *n_svg,
                    struct kv_err *err);

#ifdef __cplusplus
}
#endif
#endif
