/* Calibration inputs and the window plan (internal; the API is in kvcal.h).
 *
 * Reading: .gz is detected by its magic bytes; a name ending in .jsonl or
 * .jsonl.gz holds one JSON object per line with a string member "text"
 * (blank lines are skipped, other members ignored); the documents are joined
 * with "\n\n" into one stream. Everything else is plain UTF-8 text.
 *
 * Plan: global window index runs over the inputs in order. Without samples
 * every window is taken; with --sequential the first `samples`; otherwise
 * `samples` windows drawn without replacement by a seeded partial
 * Fisher-Yates shuffle (splitmix64), then sorted. Sharding keeps the plan
 * entries i with i % shard_count == shard_index. */
#ifndef KV_DATASET_H
#define KV_DATASET_H

#include "kvcalib.h"

/* Read one input as text (jsonl joined as above). *out is malloc'd and
 * NUL-terminated. */
int kv_calib_read_text(const char *path, char **out, size_t *len, struct kv_err *err);

#endif
