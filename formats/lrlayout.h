/* The compressed model's layout rules (internal), shared by the manifest
 * (formats/kvmanifest.c), the weights file (formats/lrweights.c) and the
 * directory (formats/kvdir.c), so the writer and the reader hold one copy:
 *
 *   - the file names of the output directory;
 *   - the tensor names of the weights file (kvdir.h has the whole layout):
 *     a layer prefix P ("model.layers.N." for llama, "transformer.h.N." for
 *     gpt2), an attention module A ("self_attn." or "attn."), and under P A
 *     "<c>_proj.weight", "<c>_down.weight", "<c>_up.<u>.weight",
 *     "<c>_up.<u>.bias", "<c>_rot.<u>.weight", "q_fused.weight",
 *     "o_fused.bias", ... with c one of q, k, v, o;
 *   - which modes keys and values may hold, and what each mode stores;
 *   - the check of a struct kv_lowrank against its own shapes (units cover
 *     the KV heads in order, each exactly once, ranks in 1..s*d_h, finite
 *     energies, the factors the modes need) and against a model.
 *
 * Every check names its subject ("layer 3 k unit 1: ...") and fails with the
 * status the caller gives: KV_EINVAL for a caller's struct, KV_EFORMAT for a
 * file. */
#ifndef KV_LRLAYOUT_H
#define KV_LRLAYOUT_H

#include "kvformats.h"
#include "limits.h"
#include "lrmodel.h"
#include "model.h"

#define KV_LRL_MANIFEST_NAME "kvcal.json"
#define KV_LRL_WEIGHTS_NAME "model.safetensors"
/* Bytes of a tensor-name buffer: the longest name a safetensors file holds. */
#define KV_LRL_NAME_CAP (KV_MAX_NAME_LEN + 1)

/* 'k' for keys (which 0), 'v' for values (which 1): the manifest's side keys
 * and the side letter of tensor names and messages. */
static inline char kv_lrl_side_char(int which) { return which ? 'v' : 'k'; }

/* Whether an architecture's keys pass through RoPE between projection and
 * score (llama yes, gpt2 no). */
int kv_lrl_has_rope(enum kv_arch arch);

/* "P" + rest: layer l's tensor "<layer prefix>l.<rest>", in buf
 * (KV_LRL_NAME_CAP bytes). */
void kv_lrl_layer_name(char *buf, enum kv_arch arch, int64_t l, const char *rest);
/* "P A" + c + rest, c one of q, k, v, o: "model.layers.3.self_attn.k_down.weight". */
void kv_lrl_attn_name(char *buf, enum kv_arch arch, int64_t l, char c, const char *rest);
/* Unit u's factor of kind "up" or "rot": "P A <k|v>_<kind>.<u>.weight". */
void kv_lrl_unit_name(char *buf, enum kv_arch arch, int64_t l, int which, const char *kind,
                      int64_t u);
/* Unit u's up_bias (centred factors): "P A <k|v>_up.<u>.bias". */
void kv_lrl_unit_bias_name(char *buf, enum kv_arch arch, int64_t l, int which, int64_t u);

/* Whether a side (keys: which 0, values: 1) may hold mode: keys full,
 * prerope_latent, fused_query or postrope_rotation; values full or
 * fused_output. */
int kv_lrl_mode_allowed(enum kv_lr_mode mode, int which);
/* Whether mode caches z = x downᵀ + down_bias and carries up (prerope_latent,
 * fused_query, fused_output); the others keep the projection (proj). */
int kv_lrl_has_down(enum kv_lr_mode mode);
/* Σ rank over the units of a side. */
int64_t kv_lrl_side_rank(const struct kv_lr_side *s);
/* Columns of the fused output projection (rows of the fused query one): Σ
 * over query heads of the rank of the unit holding their KV head. The side
 * must have passed kv_lrl_check_side. */
int64_t kv_lrl_fused_cols(const struct kv_lowrank *lr, const struct kv_lr_side *s);

/* Layer l's keys (which 0) or values against lr's shapes: a mode the side
 * may hold, units covering the KV heads in order with each exactly once,
 * ranks in 1..n_heads*d_h, finite non-negative energy and dropped and, when
 * factors is 1, the factor pointers the mode needs (down_bias and up_bias
 * each on all units or none; no up_bias on postrope_rotation units, which
 * have no up factor). A violation is status code naming path, with no
 * offset. */
int kv_lrl_check_side(const struct kv_lowrank *lr, int64_t l, int which, int factors, int code,
                      const char *path, struct kv_err *err);
/* fused_query keys in layer l need a model without rope (up folds into the
 * query only when nothing acts between projection and score): code naming
 * path otherwise. */
int kv_lrl_check_fused_query_arch(enum kv_arch arch, int64_t l, int code, const char *path,
                                  struct kv_err *err);
/* The whole of lr, factors included, against model m, as kv_lr_dir_write
 * needs it (and as kv_lr_dir_open builds it): the shapes, the latent bits,
 * every side, the fused projections with their column counts and q bias,
 * and o_fused_bias set exactly when the values are fused_output with an
 * up_bias. KV_EINVAL naming dir otherwise. */
int kv_lrl_check(const struct kv_lowrank *lr, const struct kv_model *m, const char *dir,
                 struct kv_err *err);

#endif
