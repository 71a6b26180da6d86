/* RoPE parameters in JSON (internal): config.json's two layouts, and the
 * scaling object of kvcal's manifests. */
#ifndef KV_ROPEJSON_H
#define KV_ROPEJSON_H

#include <jansson.h>

#include "kvcal_core.h"

/* rope_theta and the rope scaling of a config.json into cfg, in either
 * layout: transformers 4.x's top-level rope_theta and rope_scaling, or 5.x's
 * rope_parameters {rope_theta, rope_type, ...}. A value given both ways
 * must agree; a key a scaling type does not read is refused (it would
 * change the frequencies); theta given neither way is 10,000 (LlamaConfig's
 * default). max_pos is max_position_embeddings. Errors name path. */
int kv_rope_json_read(const json_t *root, const char *path, int64_t max_pos,
                      struct kv_config *cfg, struct kv_err *err);

/* One scaling object o into s: "rope_type" (or "type") and that type's
 * keys. max_pos: max_position_embeddings; orig_top: a top-level
 * original_max_position_embeddings (Phi-3) or 0; in_params: 0 for
 * rope_scaling, 1 for rope_parameters (may hold rope_theta), 2 for a kvcal
 * manifest (may also be type "freqs", GGUF's per-pair divisors). */
int kv_rope_json_scaling(const json_t *o, const char *path, int64_t max_pos, int64_t orig_top,
                         int in_params, struct kv_rope_scaling_cfg *s, struct kv_err *err);

/* s as an object kv_rope_json_scaling reads back to the same values (JSON
 * null for none); NULL when out of memory. A new reference. */
json_t *kv_rope_json_write(const struct kv_rope_scaling_cfg *s);

#endif
