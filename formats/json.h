/* JSON files through jansson, with kvcal's error discipline (internal).
 *
 * Every JSON file kvcal reads (config.json, tokenizer.json, the safetensors
 * header, model.safetensors.index.json) goes through kv_json_parse, which
 * rejects duplicate object keys and turns jansson's diagnostics into one
 * KV_EFORMAT line with an absolute byte offset:
 *
 *     config.json: offset 17: invalid json: duplicate object key near '"a"'
 *
 * The typed getters read one member of an object and report a wrong type or
 * range as "key 'hidden_size' must be a positive integer, found "abc"" with
 * no offset (jansson does not record where values start). */
#ifndef KV_JSON_H
#define KV_JSON_H

#include <jansson.h>

#include "kvformats.h"

/* Read and parse the JSON file at path (at most KV_MAX_JSON_BYTES). On
 * success *out is a new reference the caller releases with json_decref.
 * Errors: KV_EIO (cannot read), KV_EFORMAT (too large, syntax, duplicate
 * keys; the offset is where jansson stopped). */
int kv_json_load(const char *path, json_t **out, struct kv_err *err);
/* As kv_json_load, with every number read as a real: for files that hold
 * integers past 64 bits (tokenizer_config.json's model_max_length of 1e30)
 * where kvcal reads no number. */
int kv_json_load_reals(const char *path, json_t **out, struct kv_err *err);

/* Parse len bytes of buf (no NUL needed). path names the file in messages
 * and base_off is the offset of buf[0] in that file, so errors carry absolute
 * offsets. The top level must be an object or an array. */
int kv_json_parse(const char *buf, size_t len, const char *path, uint64_t base_off,
                  json_t **out, struct kv_err *err);

/* jansson's message in lowercase (it capitalises some words), for one-line
 * errors of JSON parsed outside kv_json_parse (JSON lines). */
void kv_json_error_text(const json_error_t *je, char *out, size_t cap);

/* "object", "array", "string", "integer", "real", "boolean" or "null". */
const char *kv_json_type_name(const json_t *v);

/* Compact JSON text of v for "found ..." messages, cut to fit cap (which
 * must be at least 8) with a trailing "...". */
void kv_json_repr(const json_t *v, char *buf, size_t cap);

/* Typed members of obj. When key is absent or null and required is 0, they
 * return KV_OK and leave *out untouched, so callers store the default first.
 * Otherwise a missing key ("missing key 'k'") or a wrong type or range is
 * KV_EFORMAT naming path (no offset). */

/* An integer in lo..hi (a JSON integer; 128.0 is refused). */
int kv_json_get_int(const json_t *obj, const char *key, const char *path, int64_t lo,
                    int64_t hi, int required, int64_t *out, struct kv_err *err);
/* A finite number (integer or real); positive additionally requires > 0. */
int kv_json_get_num(const json_t *obj, const char *key, const char *path, int positive,
                    int required, double *out, struct kv_err *err);
/* A string; *out points into obj and lives as long as it does. */
int kv_json_get_str(const json_t *obj, const char *key, const char *path, int required,
                    const char **out, struct kv_err *err);
/* true or false, stored as 1 or 0. */
int kv_json_get_bool(const json_t *obj, const char *key, const char *path, int required,
                     int *out, struct kv_err *err);

#endif
