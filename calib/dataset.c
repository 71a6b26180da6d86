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
    int tok_flags;                  /* KV_TOK_* of every input's stream */
    int64_t seq_len;
    int64_t n_inputs;
    struct kv_calib_input *inputs;  /* [n_inputs] */
    int64_t n_plan;
    struct plan_entry *plan;        /* [n_plan], (input, window) ascending */
    int64_t loaded;                 /* input being read by rd, or -1 */
    struct kv_text_tokens *rd;      /* its tokens, read in order */
    int64_t rd_from;                /* the first token rd was last asked for */
};

/* ---------------------------------------------------------------- reading */

/* Bytes of text read (and, for JSON lines, parsed) at a time. */
#define PIECE ((size_t)1 << 20)

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

static int is_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r') return 0;
    return 1;
}

/* Room for n more bytes (and a NUL) in a growing buffer. */
static int reserve(char **buf, size_t len, size_t *cap, size_t n) {
    if (n > SIZE_MAX - 1 - len) return 0;
    if (len + n + 1 <= *cap) return 1;
    size_t c = *cap ? *cap : 4096;
    while (c < len + n + 1) c = c > SIZE_MAX / 2 ? len + n + 1 : c * 2;
    char *nb = realloc(*buf, c);
    if (!nb) return 0;
    *buf = nb;
    *cap = c;
    return 1;
}

/* One input's text, in order and in pieces: plain and gzip text as read;
 * JSON lines as the "text" members of one object per line joined with
 * "\n\n" (a line is held whole, so memory is that of the longest line).
 * Offsets in errors are of the line start in the text (the decompressed
 * text for .gz). */
struct in_text {
    struct kv_text_src *src;
    const char *path;
    int jsonl, src_done;
    char *raw;          /* JSON lines: text read but not yet parsed */
    size_t n_raw, cap_raw;
    uint64_t raw_off;   /* offset of raw[0] in the text */
    int64_t line, docs;
};

static void in_close(struct in_text *t) {
    kv_text_src_close(t->src);
    free(t->raw);
    memset(t, 0, sizeof *t);
}

static int in_open(const char *path, struct in_text *t, struct kv_err *err) {
    memset(t, 0, sizeof *t);
    t->path = path;
    t->jsonl = ends_with(path, ".jsonl") || ends_with(path, ".jsonl.gz");
    return kv_text_src_open(path, &t->src, err);
}

/* The document of one JSON line, appended to *out (after "\n\n" unless it
 * is the first); blank lines give nothing. */
static int jsonl_line(struct in_text *t, const char *s, size_t ll, uint64_t start, char **out,
                      size_t *n, size_t *cap, struct kv_err *err) {
    t->line++;
    if (start == 0 && ll >= 3 && memcmp(s, "\xef\xbb\xbf", 3) == 0) /* UTF-8 byte order mark */
        s += 3, ll -= 3, start += 3;
    if (is_blank(s, ll)) return KV_OK;
    json_error_t je;
    memset(&je, 0, sizeof je);
    json_t *j = json_loadb(s, ll, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!j) {
        char text[sizeof je.text];
        kv_json_error_text(&je, text, sizeof text);
        return kv_fail(err, KV_EFORMAT, t->path, start, "line %lld: invalid json: %s",
                       (long long)t->line, text);
    }
    json_t *v = json_is_object(j) ? json_object_get(j, "text") : NULL;
    if (!json_is_string(v)) {
        char found[96];
        if (!json_is_object(j))
            snprintf(found, sizeof found, "found %s %s",
                     json_is_array(j) || json_is_integer(j) ? "an" : "a", kv_json_type_name(j));
        else if (!v)
            snprintf(found, sizeof found, "found no \"text\"");
        else
            snprintf(found, sizeof found, "found \"text\" as %s %s",
                     json_is_array(v) || json_is_object(v) || json_is_integer(v) ? "an" : "a",
                     kv_json_type_name(v));
        json_decref(j);
        return kv_fail(err, KV_EFORMAT, t->path, start,
                       "line %lld: expected a json object with a string \"text\", %s",
                       (long long)t->line, found);
    }
    size_t vl = json_string_length(v), sep = t->docs ? 2 : 0;
    int ok = reserve(out, *n, cap, sep + vl);
    if (ok) {
        memcpy(*out + *n, "\n\n", sep);
        memcpy(*out + *n + sep, json_string_value(v), vl);
        *n += sep + vl;
        t->docs++;
    }
    json_decref(j);
    return ok ? KV_OK
              : kv_fail(err, KV_ENOMEM, t->path, KV_NO_OFFSET, "out of memory reading text");
}

/* The next piece of text into *buf (grown as needed): *n bytes, 0 at the
 * end. */
static int in_next(struct in_text *t, char **buf, size_t *cap, size_t *n, struct kv_err *err) {
    *n = 0;
    if (!t->jsonl) {
        if (!reserve(buf, 0, cap, PIECE))
            return kv_fail(err, KV_ENOMEM, t->path, KV_NO_OFFSET, "out of memory reading text");
        return kv_text_src_read(t->src, *buf, PIECE, n, err);
    }
    while (*n == 0 && !(t->src_done && t->n_raw == 0)) {
        if (!t->src_done) {
            size_t got;
            if (!reserve(&t->raw, t->n_raw, &t->cap_raw, PIECE))
                return kv_fail(err, KV_ENOMEM, t->path, KV_NO_OFFSET, "out of memory reading text");
            int rc = kv_text_src_read(t->src, t->raw + t->n_raw, PIECE, &got, err);
            if (rc) return rc;
            t->n_raw += got;
            t->src_done = got == 0;
        }
        /* every complete line, and at the end the last one */
        size_t pos = 0;
        for (;;) {
            const char *nl = memchr(t->raw + pos, '\n', t->n_raw - pos);
            if (!nl && !(t->src_done && pos < t->n_raw)) break;
            size_t ll = nl ? (size_t)(nl - (t->raw + pos)) : t->n_raw - pos;
            int rc = jsonl_line(t, t->raw + pos, ll, t->raw_off + pos, buf, n, cap, err);
            if (rc) return rc;
            pos += ll + (nl ? 1 : 0);
        }
        memmove(t->raw, t->raw + pos, t->n_raw - pos);
        t->n_raw -= pos;
        t->raw_off += pos;
    }
    return KV_OK;
}

int kv_calib_read_text(const char *path, char **out, size_t *len, struct kv_err *err) {
    struct in_text t;
    int rc = in_open(path, &t, err);
    char *all = NULL, *piece = NULL;
    size_t n_all = 0, cap_all = 0, cap_piece = 0, n;
    while (!rc && !(rc = in_next(&t, &piece, &cap_piece, &n, err)) && n) {
        if (!reserve(&all, n_all, &cap_all, n))
            rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
        else
            memcpy(all + n_all, piece, n), n_all += n;
    }
    in_close(&t);
    free(piece);
    if (!rc && !all && !(all = malloc(1)))
        rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory reading text");
    if (rc) {
        free(all);
        return rc;
    }
    all[n_all] = 0;
    *out = all;
    *len = n_all;
    return KV_OK;
}

/* ---------------------------------------------------------------- tokens */

struct kv_text_tokens {
    struct in_text in;
    struct kv_tok_stream *ts;
    char *piece;
    size_t cap_piece;
    int done;            /* the text and its tokens are all out */
    int64_t total;       /* tokens produced so far */
    int64_t keep_from;   /* tokens before this one are dropped */
    int32_t *ids;        /* tokens [base, base + n) */
    int64_t base, n, cap;
};

int64_t kv_text_tokens_specials(const struct kv_text_tokens *t) {
    return kv_tok_stream_specials(t->ts);
}

int kv_text_tokens_open(const char *path, const struct kv_tokenizer *tok, int flags,
                        struct kv_text_tokens **out, struct kv_err *err) {
    *out = NULL;
    struct kv_text_tokens *t = calloc(1, sizeof *t);
    if (!t) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int rc = in_open(path, &t->in, err);
    if (!rc) rc = kv_tok_stream_new(tok, flags, 0, &t->ts, err);
    if (rc) {
        if (err && !err->path[0]) snprintf(err->path, sizeof err->path, "%s", path);
        kv_text_tokens_close(t);
        return rc;
    }
    *out = t;
    return KV_OK;
}

void kv_text_tokens_close(struct kv_text_tokens *t) {
    if (!t) return;
    in_close(&t->in);
    kv_tok_stream_free(t->ts);
    free(t->piece);
    free(t->ids);
    free(t);
}

/* Tokenize the next piece of text, keeping the tokens from keep_from on. */
static int pull(struct kv_text_tokens *t, struct kv_err *err) {
    size_t len;
    int rc = in_next(&t->in, &t->piece, &t->cap_piece, &len, err);
    const int32_t *ids = NULL;
    int64_t m = 0;
    if (!rc) rc = kv_tok_stream_feed(t->ts, t->piece, len, len == 0, &ids, &m, err);
    if (rc) {
        if (err && !err->path[0]) snprintf(err->path, sizeof err->path, "%s", t->in.path);
        return rc;
    }
    t->done = len == 0;
    int64_t skip = t->keep_from > t->total ? t->keep_from - t->total : 0;
    if (skip > m) skip = m;
    if (m > skip) {
        if (t->n == 0) t->base = t->total + skip;
        if (t->n + (m - skip) > t->cap) {
            int64_t c = t->cap ? t->cap : 4096;
            while (c < t->n + (m - skip)) c *= 2;
            int32_t *p = realloc(t->ids, (size_t)c * sizeof *p);
            if (!p) return kv_fail(err, KV_ENOMEM, t->in.path, KV_NO_OFFSET, "out of memory");
            t->ids = p;
            t->cap = c;
        }
        memcpy(t->ids + t->n, ids + skip, (size_t)(m - skip) * sizeof *ids);
        t->n += m - skip;
    }
    t->total += m;
    return KV_OK;
}

int kv_text_tokens_get(struct kv_text_tokens *t, int64_t a, int64_t len, const int32_t **ids,
                       int64_t *got, struct kv_err *err) {
    KV_ASSERT(t && a >= t->keep_from && len >= 0 && ids && got);
    t->keep_from = a;
    if (t->n && t->base < a) {
        int64_t drop = a - t->base < t->n ? a - t->base : t->n;
        memmove(t->ids, t->ids + drop, (size_t)(t->n - drop) * sizeof *t->ids);
        t->n -= drop;
        t->base += drop;
    }
    while (!t->done && !(t->n && t->base + t->n >= a + len)) {
        int rc = pull(t, err);
        if (rc) return rc;
    }
    *ids = t->ids;
    *got = t->n && t->base == a ? (t->n < len ? t->n : len) : 0;
    return KV_OK;
}

int kv_text_tokens_finish(struct kv_text_tokens *t, int64_t *n_tokens, char sha256[65],
                          uint64_t *file_bytes, uint64_t *text_bytes, struct kv_err *err) {
    t->keep_from = INT64_MAX;
    t->n = 0;
    while (!t->done) {
        int rc = pull(t, err);
        if (rc) return rc;
    }
    if (n_tokens) *n_tokens = t->total;
    if (sha256) kv_text_src_sha256(t->in.src, sha256);
    if (file_bytes) *file_bytes = kv_text_src_file_bytes(t->in.src);
    if (text_bytes) *text_bytes = kv_text_src_text_bytes(t->in.src);
    return KV_OK;
}

int kv_text_tokens_window(void *ctx, int64_t w, int64_t seq_len, const int32_t **ids,
                          struct kv_err *err) {
    struct kv_text_tokens *t = ctx;
    int64_t got;
    int rc = kv_text_tokens_get(t, w * seq_len, seq_len, ids, &got, err);
    if (!rc && got < seq_len)
        rc = kv_fail(err, KV_EFORMAT, t->in.path, KV_NO_OFFSET,
                     "changed while it was read: window %lld has %lld of %lld tokens",
                     (long long)w, (long long)got, (long long)seq_len);
    return rc;
}

/* ---------------------------------------------------------------- inputs */

static void drop_tokens(struct kv_calib *c) {
    kv_text_tokens_close(c->rd);
    c->rd = NULL;
    c->loaded = -1;
}

/* The sha256 and size of a file, read to its end in pieces. */
static int file_sha256(const char *path, char sha[65], uint64_t *bytes, struct kv_err *err) {
    struct kv_text_src *s;
    int rc = kv_text_src_open(path, &s, err);
    char *buf = rc ? NULL : malloc(PIECE);
    if (!rc && !buf) rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    size_t n = 1;
    /* the raw bytes are what is hashed: gzip is still decoded, to end the
     * stream where the reader does */
    while (!rc && n) rc = kv_text_src_read(s, buf, PIECE, &n, err);
    if (!rc) {
        kv_text_src_sha256(s, sha);
        *bytes = kv_text_src_file_bytes(s);
    }
    free(buf);
    kv_text_src_close(s);
    return rc;
}

/* Scan input k (scan: hash it and count its tokens into its record) or
 * open it for its windows, after checking it still matches that record. */
static int load_input(struct kv_calib *c, int64_t k, int scan, struct kv_err *err) {
    struct kv_calib_input *in = &c->inputs[k];
    drop_tokens(c);
    c->rd_from = 0;
    int rc;
    if (!scan) {
        char sha[65];
        uint64_t bytes;
        if ((rc = file_sha256(in->path, sha, &bytes, err))) return rc;
        if (bytes != in->bytes || strcmp(sha, in->sha256) != 0)
            return kv_fail(err, KV_EFORMAT, in->path, KV_NO_OFFSET,
                           "changed since it was scanned: %llu bytes with sha256 %s, expected "
                           "%llu bytes with sha256 %s",
                           (unsigned long long)bytes, sha, (unsigned long long)in->bytes,
                           in->sha256);
    }
    struct kv_text_tokens *t;
    if ((rc = kv_text_tokens_open(in->path, c->tok, c->tok_flags, &t, err))) return rc;
    if (scan) {
        int64_t n;
        rc = kv_text_tokens_finish(t, &n, in->sha256, &in->bytes, NULL, err);
        in->specials = kv_text_tokens_specials(t);
        kv_text_tokens_close(t);
        if (rc) return rc;
        in->tokens = n;
        in->windows = n / c->seq_len;
        return KV_OK;
    }
    c->rd = t;
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

void kv_calib_tokenization(const struct kv_calib *c, char *buf, size_t cap) {
    snprintf(buf, cap, "bos=%d eos=%d special=%s", (c->tok_flags & KV_TOK_ADD_BOS) != 0,
             (c->tok_flags & KV_TOK_ADD_EOS) != 0,
             (c->tok_flags & KV_TOK_PARSE_SPECIAL) ? "parsed" : "text");
}

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
    c->tok_flags = kv_tok_policy(tok) | (opts->parse_special ? KV_TOK_PARSE_SPECIAL : 0);
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
    kv_text_tokens_close(c->rd);
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
    int64_t a = e->window * c->seq_len, got;
    int rc;
    /* the reader only goes forward: an earlier window starts it again */
    if (c->loaded != e->input || a < c->rd_from) {
        if ((rc = load_input(c, e->input, 0, err))) return rc;
    }
    c->rd_from = a;
    if ((rc = kv_text_tokens_get(c->rd, a, c->seq_len, ids, &got, err))) return rc;
    if (got < c->seq_len)
        return kv_fail(err, KV_EFORMAT, c->inputs[e->input].path, KV_NO_OFFSET,
                       "changed since it was scanned: %lld tokens, fewer than window %lld needs",
                       (long long)(a + got), (long long)e->window);
    if (input) *input = e->input;
    if (window) *window = e->window;
    return KV_OK;
}
