/* The manifest kvcal.json of a compressed model directory (internal): its
 * schema, built from a struct kv_lowrank and its base model, and parsed
 * from bytes back into one. The directory around it is formats/kvdir.h.
 *
 * Layout (DESIGN §7; manifest version 1): a JSON object (jansson, indent 2,
 * a final newline), fields in order:
 *
 *     format "kvcal.manifest", version 1, kvcal_version, method, alloc,
 *     options {..}, model {fingerprint, source, format, arch ("llama" or
 *     "gpt2"), dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim,
 *     vocab_size, norm_eps, tied_embeddings, qkv_bias, max_seq_len, bos_id,
 *     eos_id, tokenizer, norm, activation, mlp, positions,
 *     kv_head_of_query}, stats, rope {layout, pairs, theta, scaling} (null
 *     for gpt2: no rope), latent {dtype, bits, quantization, hadamard},
 *     weights, weight_layout "linear [out, in]", kv_bytes_per_token {base,
 *     compressed, ratio}, predicted_error {k, v}, layers [..]
 *
 * norm ("rmsnorm", "layernorm"), activation ("silu", "gelu_new"), mlp
 * ("gated", "plain") and positions ("rope", "learned") say in words what
 * arch does; kv_head_of_query[i] = i / (n_heads / n_kv_heads).
 *
 * Each layer {index, q_proj, q_proj_bias, o_proj, o_proj_bias, k, v}: the
 * four names are the query and output projections as an engine applies
 * them in every mode (the fused query for fused_query keys; biases null
 * where the model has none). Each side ("k", "v") holds mode, rank (Σ
 * rank_u), predicted_error, the tensor names down, down_bias, proj (and
 * proj_bias), for V o_proj, o_proj_bias (and o_cols when fused), for
 * fused_query K q_proj, q_proj_bias (null without q biases) and q_cols, and
 * units [{heads, rank, latent_offset, up, up_bias, rot, energy, dropped,
 * predicted_error}]. Units cover the layer's KV heads in order, each exactly
 * once; latent_offset is the unit's first row in down (its first column of
 * the cached latent). q_cols and o_cols are Σ over query heads of their
 * unit's rank, query heads in order. fused_query needs a model without rope
 * (gpt2). The tensor names are the weights file's (lrlayout.h); a reader
 * takes them from the manifest, trusting nothing.
 *
 * Centred factors: up_bias names a unit's mean (struct kv_lr_unit's
 * up_bias), on every unit of a side with down or on none, null on
 * postrope_rotation units; the V side's o_proj_bias names the layer's
 * o_fused_bias, a name exactly when the values are fused_output with
 * up_bias and null otherwise. It is added on top of the layer's own
 * o_proj_bias (the model's bias), not in its place.
 *
 * The parser checks everything the manifest alone can say: the format and
 * version, types and ranges of every key it reads, the architecture and
 * rope, the words and kv_head_of_query against the architecture, the latent
 * bits, every side (lrlayout.h's rules), the names each mode needs and the
 * nulls it forbids, o_cols and q_cols, each layer's projection names against
 * the names kvcal applies, and that kv_bytes_per_token is what the ranks
 * give. Errors are KV_EFORMAT naming
 * the file (KV_EUNSUPPORTED for a newer version, an unknown arch, rope
 * scaling or another weight layout), with no offset except where the JSON
 * itself is invalid (jansson's position). The first rule broken is the one
 * reported, in the order above. The words, kv_head_of_query, the layers'
 * projection names and the centred factors' up_bias and V o_proj_bias came
 * after the first version-1 manifests: a manifest without them is read as
 * before (absent up_bias and o_proj_bias read as null). */
#ifndef KV_KVMANIFEST_H
#define KV_KVMANIFEST_H

#include "kvformats.h"

struct json_t; /* jansson's, kept out of the callers */

/* The tensor names the manifest gives one layer side; NULL where its mode
 * has none. unit[u] is unit u's "up" (modes with down) or "rot"
 * (postrope_rotation) name and unit_bias[u] its "up_bias" name, NULL on
 * every unit of a side whose factors are not centred. o_proj_bias is the
 * values' "o_proj_bias", the fused output's mean term (centred
 * fused_output values only). The strings live in the parsed document. */
struct kv_mf_names {
    const char *down, *down_bias, *proj, *o_proj, *o_proj_bias, *q_proj, *q_proj_bias;
    const char **unit, **unit_bias;
};

/* What a manifest says beyond the struct kv_lowrank: the model it was made
 * from and where each factor is in the weights file. */
struct kv_mf {
    struct kv_config cfg;          /* arch, dim, hidden_dim, n_layers, n_heads,
                                      n_kv_heads, head_dim, vocab_size, norm_eps,
                                      tied_embeddings, has_qkv_bias, max_seq_len
                                      (0 when absent), bos_id and eos_id (-1 when
                                      absent), and the rope layout and theta
                                      (llama); the rest 0 */
    char fingerprint[65];          /* model.fingerprint */
    const char *weights;           /* the weights file's name, no slash */
    struct kv_mf_names (*names)[2]; /* [n_layers][keys, values] */
    struct json_t *doc;            /* owns the strings above */
};

/* Parse and validate the manifest in len bytes of buf (any bytes; no NUL
 * needed); path names the file in messages. On success *out gets the
 * shapes, modes, units, ranks, energies, o_cols, q_cols and latent format
 * with every factor pointer NULL (release with kv_lr_free) and, when mf is
 * not NULL, *mf the rest (release with kv_mf_clear). On failure nothing is
 * left to release. */
int kv_mf_parse(const void *buf, size_t len, const char *path, struct kv_lowrank **out,
                struct kv_mf *mf, struct kv_err *err);
/* kv_mf_parse on the bytes of the file at path (KV_EIO when it cannot be
 * read). */
int kv_mf_read(const char *path, struct kv_lowrank **out, struct kv_mf *mf, struct kv_err *err);
/* Release what kv_mf_parse put in mf and zero it; a zeroed mf is a no-op. */
void kv_mf_clear(struct kv_mf *mf);

/* The caller's JSON for the manifest's "options" and "stats"
 * (struct kv_lr_dir_info), parsed before any file is written. */
struct kv_mf_extra {
    struct json_t *options, *stats;
};
/* Parse info->options_json (an object; NULL: {}) and info->stats_json (an
 * object or null; NULL: null) into x. KV_EINVAL naming dir when either is
 * not valid JSON of its kind, KV_ENOMEM. */
int kv_mf_extra_parse(const struct kv_lr_dir_info *info, const char *dir, struct kv_mf_extra *x,
                      struct kv_err *err);
/* Release x's values and zero it. */
void kv_mf_extra_clear(struct kv_mf_extra *x);

/* The manifest of lr for base model m (fingerprint fp) as text in a new
 * malloc'd string *out: info->model_path is model.source, tok_name the
 * copied tokenizer's file name or NULL, x's values (taken over: x is
 * cleared, also on failure) are options and stats. lr must have passed
 * kv_lrl_check against m. KV_ENOMEM naming path. */
int kv_mf_format(const struct kv_model *m, const struct kv_lowrank *lr, const char *fp,
                 const struct kv_lr_dir_info *info, const char *tok_name, struct kv_mf_extra *x,
                 const char *path, char **out, struct kv_err *err);

#endif
