/* Calibration inputs: reading, hashing, tokenizing, and the window plan. */
#include "dataset.h"
#include "kvcalib.h"

#include <ctype.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "json.h"
#include "mapfile.h"

/* One planned window: the input it lies in and its index there. */
struct plan_entry {
    int64_t input, window;
};

struct kv_calib {
    const struct kv_tokenizer *tok; /* borrowed; outlives the kv_calib */
    int64_t seq_len;
    int64_t n_inputs;
    struct kv_calib_input *inputs;  /* [n_inputs] */
    int64_t n_plan;
    struct plan_entry *plan;        /* [n_plan], (input, window) ascending */
    int64_t loaded;                 /* input whose tokens are in ids, or -1 */
    int32_t *ids;                   /* [n_ids] tokens of input `loaded` */
    int64_t n_ids;
};

/* ---------------------------------------------------------------- reading */

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

static int is_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r') return 0;
    return 1;
}

/* Append n bytes to a growing buffer that always keeps room for a NUL. */
static int append(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
    if (n > SIZE_MAX - 1 - *len) return 0;
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 4096;
        while (c < *len + n + 1) c = c > SIZE_MAX / 2 ? *len + n + 1 : c * 2;
        char *nb = realloc(*buf, c);
        if (!nb) return 0;
        *buf = nb;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    return 1;
}

/* The "text" members of one JSON object per line, joined with "\n\n". Offsets
 * in errors are of the line start in raw (the decompressed text for .gz). */
static int jsonl_join(const char *raw, size_t n, const char *path, char **out, size_t *out_len,
                      struct kv_err *err) {
    char *buf = NULL;
    size_t len = 0, cap = 0, pos = 0;
    int64_t line = 0, docs = 0;
    if (n >= 3 && memcmp(raw, "\xef\xbb\xbf", 3) == 0) pos = 3; /* UTF-8 byte order mark */
    while (pos < n) {
        line++;
        size_t start = pos;
        const char *s = raw + pos;
        const char *nl = memchr(s, '\n', n - pos);
        size_t ll = nl ? (size_t)(nl - s) : n - pos;
        pos += ll + (nl ? 1 : 0);
        if (is_blank(s, ll)) continue;

        json_error_t je;
        memset(&je, 0, sizeof je);
        json_t *j = json_loadb(s, ll, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL,
                               &je);
        if (!j) {
            char text[sizeof je.text];
            kv_json_error_text(&je, text, sizeof text);
            free(buf);
            return kv_fail(err, KV_EFORMAT, path, start, "line %lld: invalid json: %s",
                           (long long)line, text);
        }
        json_t *t = json_is_object(j) ? json_object_get(j, "text") : NULL;
        if (!json_is_string(t)) {
            char found[96];
            if (!json_is_object(j))
                snprintf(found, sizeof found, "found %s %s",
                         json_is_array(j) || json_is_integer(j) ? "an" : "a",
                         kv_json_type_name(j));
            else if (!t)
                snprintf(found, sizeof found, "found no \"text\"");
            else
                snprintf(found, sizeof found, "found \"text\" as %s %s",
                         json_is_array(t) || json_is_object(t) || json_is_integer(t) ? "an" : "a",
                         kv_json_type_name(t));
            json_decref(j);
            free(buf);
            return kv_fail(err, KV_EFORMAT, path, start,
                           "line %lld: expected a json object with a string \"text\", %s",
                           (long long)line, found);
        }
        int ok = (docs == 0 || append(&buf, &len, &cap, "\n\n", 2)) &&
                 append(&buf, &len, &cap, json_string_value(t), json_string_length(t));
        json_decref(j);
        if (!ok) {
            free(buf);
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
        }
        docs++;
    }
    if (!buf && !(buf = malloc(1)))
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
    buf[len] = 0;
    *out = buf;
    *out_len = len;
    return KV_OK;
}

int kv_calib_read_text(const char *path, char **out, size_t *len, struct kv_err *err) {
    char *raw;
    size_t n;
    int rc = kv_text_read(path, &raw, &n, err);
    if (rc) return rc;
    if (!ends_with(path, ".jsonl") && !ends_with(path, ".jsonl.gz")) {
        *out = raw;
        *len = n;
        return KV_OK;
    }
    rc = jsonl_join(raw, n, path, out, len, err);
    free(raw);
    return rc;
}

/* ---------------------------------------------------------------- inputs */

static void drop_tokens(struct kv_calib *c) {
    free(c->ids);
    c->ids = NULL;
    c->n_ids = 0;
    c->loaded = -1;
}

/* Hash, read and tokenize input k into the cache. The first time (scan) its
 * record is filled; later the file must still match that record. */
static int load_input(struct kv_calib *c, int64_t k, int scan, struct kv_err *err) {
    struct kv_calib_input *in = &c->inputs[k];
    drop_tokens(c);

    struct kv_map mp;
    int rc = kv_map_open(in->path, &mp, err);
    if (rc) return rc;
    char sha[65];
    kv_sha256_hex(mp.data ? (const void *)mp.data : "", (size_t)mp.len, sha);
    uint64_t bytes = mp.len;
    kv_map_close(&mp);
    if (scan) {
        memcpy(in->sha256, sha, sizeof sha);
        in->bytes = bytes;
    } else if (bytes != in->bytes || strcmp(sha, in->sha256) != 0) {
        return kv_fail(err, KV_EFORMAT, in->path, KV_NO_OFFSET,
                       "changed since it was scanned: %llu bytes with sha256 %s, expected "
                       "%llu bytes with sha256 %s",
                       (unsigned long long)bytes, sha, (unsigned long long)in->bytes,
                       in->sha256);
    }

    char *text;
    size_t len;
    rc = kv_calib_read_text(in->path, &text, &len, err);
    if (rc) return rc;
    int32_t *ids;
    int64_t n;
    rc = kv_tok_encode(c->tok, text, len, 1, &ids, &n, err);
    free(text);
    if (rc) {
        if (err && !err->path[0]) snprintf(err->path, sizeof err->path, "%s", in->path);
        return rc;
    }
    if (scan) {
        in->tokens = n;
        in->windows = n / c->seq_len;
    } else if (n != in->tokens) {
        free(ids);
        return kv_fail(err, KV_EFORMAT, in->path, KV_NO_OFFSET,
                       "changed since it was scanned: %lld tokens, expected %lld",
                       (long long)n, (long long)in->tokens);
    }
    c->ids = ids;
    c->n_ids = n;
    c->loaded = k;
    return KV_OK;
}

/* ---------------------------------------------------------------- plan */

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, n), n > 0: values below 2^64 mod n are rejected so that the
 * accepted range is a whole number of copies of [0, n). */
static uint64_t rand_below(uint64_t *state, uint64_t n) {
    uint64_t reject = -n % n;
    for (;;) {
        uint64_t r = splitmix64(state);
        if (r >= reject) return r % n;
    }
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The global window indices of the plan before sharding, ascending. */
static int draw(const struct kv_calib_opts *o, int64_t total, int64_t **out, int64_t *n_out,
                struct kv_err *err) {
    int64_t take = o->samples ? o->samples : total;
    size_t len = (size_t)(o->samples && !o->sequential ? total : take);
    if ((uint64_t)len > SIZE_MAX / sizeof(int64_t))
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory drawing %lld windows", (long long)take);
    int64_t *g = malloc(len * sizeof *g);
    if (!g)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                       "out of memory drawing %lld windows", (long long)take);
    for (size_t i = 0; i < len; i++) g[i] = (int64_t)i;
    if (o->samples && !o->sequential) {
        /* Partial Fisher-Yates: g[0..take) becomes a uniform draw without
         * replacement. The sequence is fixed by the seed, so a resume or
         * another shard draws the same plan. */
        uint64_t state = o->seed;
        for (int64_t i = 0; i < take; i++) {
            int64_t j = i + (int64_t)rand_below(&state, (uint64_t)(total - i));
            int64_t t = g[i];
            g[i] = g[j];
            g[j] = t;
        }
        qsort(g, (size_t)take, sizeof *g, cmp_i64);
    }
    *out = g;
    *n_out = take;
    return KV_OK;
}

int kv_calib_shard_valid(int64_t index, int64_t count) {
    return count >= 1 && index >= 0 && index < count;
}

/* Given names, a message is the caller's ("--seq-len must be at least 2,
 * got 1"); without, the library's own wording, as its callers know it. */
int kv_calib_check(const struct kv_calib_opts *o, const char *const *names, struct kv_err *err) {
    if (o->seq_len < 2)
        return names ? kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be at least 2, got %lld",
                               names[KV_CALIB_OPT_SEQ_LEN], (long long)o->seq_len)
                     : kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "sequence length must be at least 2, found %lld",
                               (long long)o->seq_len);
    if (o->samples < 0)
        return names ? kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "%s must be 0 (every window) or more, got %lld",
                               names[KV_CALIB_OPT_SAMPLES], (long long)o->samples)
                     : kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "samples must be 0 (every window) or positive, found %lld",
                               (long long)o->samples);
    if (kv_calib_shard_valid(o->shard_index, o->shard_count)) return KV_OK;
    if (names)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%s needs I/N with 0 <= I < N, got '%lld/%lld'", names[KV_CALIB_OPT_SHARD],
                       (long long)o->shard_index, (long long)o->shard_count);
    if (o->shard_count < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "shard count must be at least 1, found %lld", (long long)o->shard_count);
    return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                   "shard index %lld is outside 0..%lld for %lld shards",
                   (long long)o->shard_index, (long long)(o->shard_count - 1),
                   (long long)o->shard_count);
}

static int make_plan(struct kv_calib *c, const struct kv_calib_opts *o, struct kv_err *err) {
    int64_t total = 0, tokens = 0;
    for (int64_t k = 0; k < c->n_inputs; k++) {
        total += c->inputs[k].windows;
        tokens += c->inputs[k].tokens;
    }
    if (total == 0) {
        if (c->n_inputs == 1)
            return kv_fail(err, KV_EINVAL, c->inputs[0].path, KV_NO_OFFSET,
                           "no windows: the input holds %lld tokens, fewer than one window "
                           "of %lld",
                           (long long)tokens, (long long)c->seq_len);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "no windows: each of the %lld inputs holds fewer than one window of "
                       "%lld tokens (%lld tokens in all)",
                       (long long)c->n_inputs, (long long)c->seq_len, (long long)tokens);
    }
    if (o->samples > total)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "inputs hold %lld windows of %lld tokens, fewer than the %lld samples "
                       "asked for",
                       (long long)total, (long long)c->seq_len, (long long)o->samples);

    int64_t *g = NULL, n = 0;
    int rc = draw(o, total, &g, &n, err);
    if (rc) return rc;
    int64_t kept = n > o->shard_index ? (n - o->shard_index - 1) / o->shard_count + 1 : 0;
    if (kept == 0) {
        free(g);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "shard %lld of %lld holds no windows: the plan holds %lld",
                       (long long)o->shard_index, (long long)o->shard_count, (long long)n);
    }
    c->plan = malloc((size_t)kept * sizeof *c->plan);
    if (!c->plan) {
        free(g);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for the plan");
    }
    int64_t k = 0, first = 0; /* input k holds global windows first .. first+windows-1 */
    for (int64_t j = 0; j < kept; j++) {
        int64_t i = o->shard_index + j * o->shard_count;
        while (g[i] >= first + c->inputs[k].windows) first += c->inputs[k++].windows;
        c->plan[c->n_plan++] = (struct plan_entry){k, g[i] - first};
        c->inputs[k].planned++;
    }
    KV_ASSERT(c->n_plan == kept);
    free(g);
    return KV_OK;
}

/* ---------------------------------------------------------------- API */

int kv_calib_open(const char *const *paths, int64_t n_paths, const struct kv_tokenizer *tok,
                  const struct kv_calib_opts *opts, struct kv_calib **out, struct kv_err *err) {
    KV_ASSERT(tok && opts && out && (paths || n_paths <= 0));
    *out = NULL;
    if (n_paths < 1)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "no calibration inputs given");
    int rc = kv_calib_check(opts, NULL, err);
    if (rc) return rc;

    struct kv_calib *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    c->tok = tok;
    c->seq_len = opts->seq_len;
    c->loaded = -1;
    c->inputs = calloc((size_t)n_paths, sizeof *c->inputs);
    if (!c->inputs) {
        free(c);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    for (int64_t k = 0; k < n_paths; k++) {
        KV_ASSERT(paths[k]);
        c->inputs[k].path = strdup(paths[k]);
        c->n_inputs++;
        if (!c->inputs[k].path) {
            rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
            goto fail;
        }
        /* Only counts are kept; the next load frees these tokens. */
        rc = load_input(c, k, 1, err);
        if (rc) goto fail;
    }
    rc = make_plan(c, opts, err);
    if (rc) goto fail;
    /* Keep the last input's tokens (the only input's, often) if the plan
     * needs them; otherwise free them now. */
    if (c->loaded >= 0 && c->inputs[c->loaded].planned == 0) drop_tokens(c);
    *out = c;
    return KV_OK;
fail:
    kv_calib_free(c);
    return rc;
}

void kv_calib_free(struct kv_calib *c) {
    if (!c) return;
    for (int64_t k = 0; k < c->n_inputs; k++) free(c->inputs[k].path);
    free(c->inputs);
    free(c->plan);
    free(c->ids);
    free(c);
}

int64_t kv_calib_n_inputs(const struct kv_calib *c) { return c->n_inputs; }

const struct kv_calib_input *kv_calib_input(const struct kv_calib *c, int64_t i) {
    return i >= 0 && i < c->n_inputs ? &c->inputs[i] : NULL;
}

int64_t kv_calib_n_windows(const struct kv_calib *c) { return c->n_plan; }

int kv_calib_window(struct kv_calib *c, int64_t i, const int32_t **ids, int64_t *input,
                    int64_t *window, struct kv_err *err) {
    KV_ASSERT(c && ids && i >= 0 && i < c->n_plan);
    const struct plan_entry *e = &c->plan[i];
    if (c->loaded != e->input) {
        int rc = load_input(c, e->input, 0, err);
        if (rc) return rc;
    }
    KV_ASSERT((e->window + 1) * c->seq_len <= c->n_ids);
    *ids = c->ids + e->window * c->seq_len;
    if (input) *input = e->input;
    if (window) *window = e->window;
    return KV_OK;
}
