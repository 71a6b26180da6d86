/* Calibration inputs: .txt, .gz, .jsonl and .jsonl.gz read alike; sha256
 * against the sha256sum command; the window plan (every window, sequential,
 * seeded draw, shards); windows against kv_tok_encode on each file as the
 * oracle; and the errors. The tokenizer is stories260K's tok512.bin. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "dataset.h"
#include "kvcalib.h"
#include "testutil.h"

#define TOK_REL "models/stories260K/tok512.bin"

/* ---------------------------------------------------------------- helpers */

static const char *fmt_err(const struct kv_err *e) {
    static __thread char buf[2600];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

static struct kv_tokenizer *load_tok(void) {
    KVT_NEED_SHARED(path, TOK_REL);
    struct kv_tokenizer *tok;
    struct kv_err err;
    int rc = kv_tok_open(path, &tok, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_tok_bos(tok), 1);
    return tok;
}

/* Seeded story-like text of n words, with sentences and paragraphs. */
static char *gen_text(uint64_t seed, int n_words) {
    static const char *words[] = {
        "once", "upon", "a", "time", "there", "was", "little", "girl", "named", "lily",
        "she", "loved", "to", "play", "outside", "in", "the", "park", "one", "day",
        "saw", "big", "red", "ball", "and", "wanted", "with", "it", "but", "too",
        "high", "her", "mom", "said", "happy", "dog", "ran", "fast", "tree", "sun",
    };
    size_t cap = (size_t)n_words * 12 + 16, n = 0;
    char *s = malloc(cap);
    cr_assert(s);
    uint64_t x = seed * 2654435761u + 12345;
    int cap_next = 1, space = 0;
    for (int i = 0; i < n_words; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const char *w = words[(x >> 33) % (sizeof words / sizeof words[0])];
        if (space) s[n++] = ' ';
        size_t k = strlen(w);
        memcpy(s + n, w, k);
        if (cap_next) s[n] = (char)(s[n] - 'a' + 'A');
        n += k;
        cap_next = 0;
        space = 1;
        unsigned r = (unsigned)(x >> 20) % 16;
        if (r == 0) {
            s[n++] = '.';
            cap_next = 1;
        } else if (r == 1) {
            s[n++] = ',';
        } else if (r == 2 && i + 1 < n_words) {
            memcpy(s + n, ".\n\n", 3);
            n += 3;
            cap_next = 1;
            space = 0;
        }
    }
    s[n] = 0;
    return s;
}

static char *write_text(const char *text, const char *suffix) {
    return kvt_write_temp(text, strlen(text), suffix);
}

static char *write_gz(const void *data, size_t len, const char *suffix) {
    char *path = kvt_write_temp("", 0, suffix);
    gzFile f = gzopen(path, "wb");
    cr_assert(f, "gzopen %s", path);
    cr_assert_eq(gzwrite(f, data, (unsigned)len), (int)len);
    cr_assert_eq(gzclose(f), Z_OK);
    return path;
}

/* One {"text": doc} line per document, with another member, blank lines
 * between and a CRLF ending on the second line. */
static char *make_jsonl(char *const *docs, int n) {
    size_t cap = 64, len = 0;
    char *s = malloc(cap);
    cr_assert(s);
    s[0] = 0;
    for (int i = 0; i < n; i++) {
        json_t *o = json_pack("{s:i, s:s}", "id", i, "text", docs[i]);
        cr_assert(o);
        char *line = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        const char *end = i == 1 ? "\r\n\n  \n" : "\n";
        size_t need = len + strlen(line) + strlen(end) + 1;
        if (need > cap) s = realloc(s, cap = need * 2);
        len += (size_t)sprintf(s + len, "%s%s", line, end);
        free(line);
    }
    return s;
}

static int64_t encode(const struct kv_tokenizer *tok, const char *text, int32_t **ids) {
    int64_t n;
    struct kv_err err;
    int rc = kv_tok_encode(tok, text, strlen(text), 1, ids, &n, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    return n;
}

static struct kv_calib_opts opts_of(int64_t seq_len) {
    struct kv_calib_opts o = {0};
    o.seq_len = seq_len;
    o.shard_count = 1;
    return o;
}

static struct kv_calib *open_ok(const char *const *paths, int64_t n,
                                const struct kv_tokenizer *tok, const struct kv_calib_opts *o) {
    struct kv_calib *c = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_calib_open(paths, n, tok, o, &c, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    cr_assert(c);
    return c;
}

static int open_fails(const char *const *paths, int64_t n, const struct kv_tokenizer *tok,
                      const struct kv_calib_opts *o, struct kv_err *err) {
    struct kv_calib *c = NULL;
    kv_err_clear(err);
    int rc = kv_calib_open(paths, n, tok, o, &c, err);
    cr_assert_neq(rc, KV_OK, "kv_calib_open succeeded where it should fail");
    cr_assert_null(c);
    cr_assert_eq(err->code, rc);
    return rc;
}

/* Global index (over all inputs' windows) of plan entry i. */
static int64_t global_of(struct kv_calib *c, int64_t i) {
    const int32_t *ids;
    int64_t in, w;
    struct kv_err err;
    int rc = kv_calib_window(c, i, &ids, &in, &w, &err);
    cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
    int64_t g = w;
    for (int64_t k = 0; k < in; k++) g += kv_calib_input(c, k)->windows;
    return g;
}

static int64_t *plan_globals(struct kv_calib *c) {
    int64_t n = kv_calib_n_windows(c);
    int64_t *g = malloc((size_t)(n ? n : 1) * sizeof *g);
    cr_assert(g);
    for (int64_t i = 0; i < n; i++) g[i] = global_of(c, i);
    return g;
}

static void sha256sum(const char *path, char hex[65]) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "sha256sum '%s'", path);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen sha256sum");
    char line[2048] = {0};
    cr_assert(fgets(line, sizeof line, p), "sha256sum printed nothing");
    cr_assert_eq(pclose(p), 0, "sha256sum failed on %s", path);
    cr_assert(strlen(line) > 64 && line[64] == ' ', "unexpected sha256sum output '%s'", line);
    memcpy(hex, line, 64);
    hex[64] = 0;
}

/* Two inputs whose token counts are not multiples of 64. */
struct two {
    struct kv_tokenizer *tok;
    char *text[2];
    char *path[2];
    int32_t *ids[2];
    int64_t n[2];
};

static void two_init(struct two *t) {
    t->tok = load_tok();
    static const int words[2] = {1500, 900};
    for (int k = 0; k < 2; k++) {
        t->text[k] = gen_text((uint64_t)k + 7, words[k]);
        t->path[k] = write_text(t->text[k], ".txt");
        t->n[k] = encode(t->tok, t->text[k], &t->ids[k]);
        cr_assert(t->n[k] > 5 * 64, "input %d has only %lld tokens", k, (long long)t->n[k]);
    }
    cr_assert(t->n[0] % 64 && t->n[1] % 64, "pick texts with a remainder");
}

static void two_free(struct two *t) {
    for (int k = 0; k < 2; k++) {
        unlink(t->path[k]);
        free(t->path[k]);
        free(t->text[k]);
        free(t->ids[k]);
    }
    kv_tok_free(t->tok);
}

/* ---------------------------------------------------------------- reading */

Test(dataset, txt_gz_jsonl_and_jsonl_gz_give_the_same_tokens) {
    struct kv_tokenizer *tok = load_tok();
    char *docs[3] = {gen_text(1, 300), gen_text(2, 5), gen_text(3, 400)};
    /* escapes survive the JSON round trip */
    char *d1 = malloc(strlen(docs[1]) + 64);
    sprintf(d1, "%s \"quoted\" back\\slash caf\xc3\xa9\ttab\nline", docs[1]);
    free(docs[1]);
    docs[1] = d1;

    size_t tl = strlen(docs[0]) + strlen(docs[1]) + strlen(docs[2]) + 5;
    char *txt = malloc(tl);
    snprintf(txt, tl, "%s\n\n%s\n\n%s", docs[0], docs[1], docs[2]);
    char *jsonl = make_jsonl(docs, 3);

    char *paths[4] = {
        write_text(txt, ".txt"),
        write_gz(txt, strlen(txt), ".gz"),
        write_text(jsonl, ".jsonl"),
        write_gz(jsonl, strlen(jsonl), ".jsonl.gz"),
    };
    for (int k = 0; k < 4; k++) {
        char *got;
        size_t len;
        struct kv_err err;
        int rc = kv_calib_read_text(paths[k], &got, &len, &err);
        cr_assert_eq(rc, KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(len, strlen(txt), "%s: %zu bytes, expected %zu", paths[k], len,
                     strlen(txt));
        cr_assert(memcmp(got, txt, len) == 0, "%s: text differs", paths[k]);
        cr_assert_eq(got[len], 0);
        free(got);
    }

    int32_t *ref;
    int64_t n_ref = encode(tok, txt, &ref);
    struct kv_calib_opts o = opts_of(16);
    struct kv_calib *c = open_ok((const char *const *)paths, 4, tok, &o);
    cr_assert_eq(kv_calib_n_inputs(c), 4);
    cr_assert_eq(kv_calib_n_windows(c), 4 * (n_ref / 16));
    for (int64_t i = 0; i < kv_calib_n_windows(c); i++) {
        const int32_t *ids;
        int64_t in, w;
        struct kv_err err;
        cr_assert_eq(kv_calib_window(c, i, &ids, &in, &w, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(in, i / (n_ref / 16));
        cr_assert_eq(w, i % (n_ref / 16));
        cr_assert(memcmp(ids, ref + w * 16, 16 * sizeof *ids) == 0,
                  "input %lld window %lld differs from the .txt tokens", (long long)in,
                  (long long)w);
    }
    for (int k = 0; k < 4; k++) {
        const struct kv_calib_input *in = kv_calib_input(c, k);
        cr_assert_str_eq(in->path, paths[k]);
        cr_assert_eq(in->tokens, n_ref, "%s: %lld tokens, expected %lld", paths[k],
                     (long long)in->tokens, (long long)n_ref);
        cr_assert_eq(in->windows, n_ref / 16);
        cr_assert_eq(in->planned, n_ref / 16);
    }
    cr_assert_null(kv_calib_input(c, 4));
    cr_assert_null(kv_calib_input(c, -1));
    kv_calib_free(c);
    free(ref);
    for (int k = 0; k < 4; k++) {
        unlink(paths[k]);
        free(paths[k]);
    }
    for (int k = 0; k < 3; k++) free(docs[k]);
    free(txt);
    free(jsonl);
    kv_tok_free(tok);
}

Test(dataset, jsonl_skips_blank_lines_and_a_byte_order_mark) {
    const char *src = "\xef\xbb\xbf{\"text\": \"a\"}\n\n \t\r\n{\"text\": \"\", \"x\": [1]}\n"
                      "{\"text\": \"b\\u0000c\"}";
    char *p = write_text(src, ".jsonl");
    char *got;
    size_t len;
    struct kv_err err;
    cr_assert_eq(kv_calib_read_text(p, &got, &len, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(len, 8);
    cr_assert(memcmp(got, "a\n\n\n\nb\0c", 8) == 0);
    free(got);
    unlink(p);
    free(p);

    /* an empty .jsonl is empty text */
    p = write_text("", ".jsonl");
    cr_assert_eq(kv_calib_read_text(p, &got, &len, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(len, 0);
    cr_assert_eq(got[0], 0);
    free(got);
    unlink(p);
    free(p);

    /* only the name makes a file JSON lines */
    p = write_text("{\"text\": \"a\"}\n", ".txt");
    cr_assert_eq(kv_calib_read_text(p, &got, &len, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_str_eq(got, "{\"text\": \"a\"}\n");
    free(got);
    unlink(p);
    free(p);
}

/* ---------------------------------------------------------------- hashing */

Test(dataset, sha256_and_size_match_sha256sum_of_the_stored_bytes) {
    struct kv_tokenizer *tok = load_tok();
    char *text = gen_text(11, 2000);
    char *paths[3] = {write_text(text, ".txt"), write_gz(text, strlen(text), ".gz"),
                      write_text("", ".txt")};
    struct kv_calib_opts o = opts_of(32);
    struct kv_calib *c = open_ok((const char *const *)paths, 3, tok, &o);
    for (int k = 0; k < 3; k++) {
        const struct kv_calib_input *in = kv_calib_input(c, k);
        char want[65];
        sha256sum(paths[k], want);
        cr_assert_str_eq(in->sha256, want, "%s", paths[k]);
        struct stat st;
        cr_assert_eq(stat(paths[k], &st), 0);
        cr_assert_eq(in->bytes, (uint64_t)st.st_size);
    }
    /* the .gz is hashed as stored, not decompressed */
    cr_assert_str_neq(kv_calib_input(c, 0)->sha256, kv_calib_input(c, 1)->sha256);
    cr_assert_str_eq(kv_calib_input(c, 2)->sha256,
                     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    cr_assert_eq(kv_calib_input(c, 2)->windows, 0);
    cr_assert_eq(kv_calib_input(c, 2)->planned, 0);
    kv_calib_free(c);
    for (int k = 0; k < 3; k++) {
        unlink(paths[k]);
        free(paths[k]);
    }
    free(text);
    kv_tok_free(tok);
}

/* ---------------------------------------------------------------- plan */

Test(dataset, without_samples_every_window_in_order) {
    struct two t;
    two_init(&t);
    struct kv_calib_opts o = opts_of(64);
    struct kv_calib *c = open_ok((const char *const *)t.path, 2, t.tok, &o);
    int64_t w0 = t.n[0] / 64, w1 = t.n[1] / 64;
    cr_assert_eq(kv_calib_n_windows(c), w0 + w1);
    for (int k = 0; k < 2; k++) {
        const struct kv_calib_input *in = kv_calib_input(c, k);
        cr_assert_eq(in->tokens, t.n[k]);
        cr_assert_eq(in->windows, t.n[k] / 64);
        cr_assert_eq(in->planned, in->windows);
    }
    int64_t *g = plan_globals(c);
    for (int64_t i = 0; i < w0 + w1; i++) cr_assert_eq(g[i], i);
    free(g);
    kv_calib_free(c);
    two_free(&t);
}

Test(dataset, sequential_takes_the_first_samples_windows) {
    struct two t;
    two_init(&t);
    int64_t w0 = t.n[0] / 64;
    struct kv_calib_opts o = opts_of(64);
    o.samples = w0 + 2; /* crosses into the second input */
    o.sequential = 1;
    o.seed = 99;        /* ignored */
    struct kv_calib *c = open_ok((const char *const *)t.path, 2, t.tok, &o);
    cr_assert_eq(kv_calib_n_windows(c), w0 + 2);
    int64_t *g = plan_globals(c);
    for (int64_t i = 0; i < w0 + 2; i++) cr_assert_eq(g[i], i);
    cr_assert_eq(kv_calib_input(c, 0)->planned, w0);
    cr_assert_eq(kv_calib_input(c, 1)->planned, 2);
    free(g);
    kv_calib_free(c);
    two_free(&t);
}

Test(dataset, random_draw_is_seeded_sorted_distinct_and_in_range) {
    struct two t;
    two_init(&t);
    int64_t total = t.n[0] / 64 + t.n[1] / 64;
    struct kv_calib_opts o = opts_of(64);
    o.samples = 7;
    o.seed = 1234;
    struct kv_calib *a = open_ok((const char *const *)t.path, 2, t.tok, &o);
    struct kv_calib *b = open_ok((const char *const *)t.path, 2, t.tok, &o);
    o.seed = 1235;
    struct kv_calib *d = open_ok((const char *const *)t.path, 2, t.tok, &o);
    cr_assert_eq(kv_calib_n_windows(a), 7);
    cr_assert_eq(kv_calib_n_windows(b), 7);
    cr_assert_eq(kv_calib_n_windows(d), 7);
    int64_t *ga = plan_globals(a), *gb = plan_globals(b), *gd = plan_globals(d);
    cr_assert(memcmp(ga, gb, 7 * sizeof *ga) == 0, "same seed, different plans");
    cr_assert(memcmp(ga, gd, 7 * sizeof *ga) != 0, "seeds 1234 and 1235 drew the same plan");
    for (int which = 0; which < 2; which++) {
        const int64_t *g = which ? gd : ga;
        struct kv_calib *c = which ? d : a;
        for (int64_t i = 0; i < 7; i++) {
            cr_assert(g[i] >= 0 && g[i] < total, "window %lld outside 0..%lld",
                      (long long)g[i], (long long)total - 1);
            if (i) cr_assert(g[i - 1] < g[i], "plan not strictly ascending at %lld", (long long)i);
        }
        cr_assert_eq(kv_calib_input(c, 0)->planned + kv_calib_input(c, 1)->planned, 7);
    }
    /* a draw of every window is every window */
    o.samples = total;
    struct kv_calib *e = open_ok((const char *const *)t.path, 2, t.tok, &o);
    int64_t *ge = plan_globals(e);
    for (int64_t i = 0; i < total; i++) cr_assert_eq(ge[i], i);
    free(ga);
    free(gb);
    free(gd);
    free(ge);
    kv_calib_free(a);
    kv_calib_free(b);
    kv_calib_free(d);
    kv_calib_free(e);
    two_free(&t);
}

Test(dataset, shards_partition_the_plan) {
    struct two t;
    two_init(&t);
    struct kv_calib_opts o = opts_of(64);
    o.samples = 9;
    o.seed = 42;
    struct kv_calib *all = open_ok((const char *const *)t.path, 2, t.tok, &o);
    int64_t *g = plan_globals(all);
    for (int64_t count = 2; count <= 3; count++) {
        int64_t seen = 0;
        for (int64_t idx = 0; idx < count; idx++) {
            struct kv_calib_opts os = o;
            os.shard_index = idx;
            os.shard_count = count;
            struct kv_calib *s = open_ok((const char *const *)t.path, 2, t.tok, &os);
            int64_t n = kv_calib_n_windows(s);
            cr_assert_eq(n, (9 - idx + count - 1) / count);
            int64_t *gs = plan_globals(s);
            for (int64_t i = 0; i < n; i++)
                cr_assert_eq(gs[i], g[idx + i * count], "shard %lld/%lld entry %lld",
                             (long long)idx, (long long)count, (long long)i);
            cr_assert_eq(kv_calib_input(s, 0)->planned + kv_calib_input(s, 1)->planned, n);
            seen += n;
            free(gs);
            kv_calib_free(s);
        }
        cr_assert_eq(seen, 9);
    }
    free(g);
    kv_calib_free(all);
    two_free(&t);
}

/* ---------------------------------------------------------------- windows */

Test(dataset, windows_are_slices_of_their_own_input) {
    struct two t;
    two_init(&t);
    struct kv_calib_opts o = opts_of(64);
    struct kv_calib *c = open_ok((const char *const *)t.path, 2, t.tok, &o);
    int64_t firsts = 0;
    for (int64_t i = 0; i < kv_calib_n_windows(c); i++) {
        const int32_t *ids;
        int64_t in, w;
        struct kv_err err;
        cr_assert_eq(kv_calib_window(c, i, &ids, &in, &w, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert(in == 0 || in == 1);
        cr_assert((w + 1) * 64 <= t.n[in]);
        cr_assert(memcmp(ids, t.ids[in] + w * 64, 64 * sizeof *ids) == 0,
                  "input %lld window %lld differs from kv_tok_encode of that file",
                  (long long)in, (long long)w);
        if (w == 0) {
            cr_assert_eq(ids[0], kv_tok_bos(t.tok), "input %lld starts with %d, not bos",
                         (long long)in, ids[0]);
            firsts++;
        } else {
            cr_assert_neq(ids[0], kv_tok_bos(t.tok));
        }
    }
    cr_assert_eq(firsts, 2);
    /* NULL input and window pointers are allowed */
    const int32_t *ids;
    struct kv_err err;
    cr_assert_eq(kv_calib_window(c, 0, &ids, NULL, NULL, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert(memcmp(ids, t.ids[0], 64 * sizeof *ids) == 0);
    kv_calib_free(c);
    two_free(&t);
}

Test(dataset, alternating_inputs_retokenizes_to_the_same_tokens) {
    struct two t;
    two_init(&t);
    struct kv_calib_opts o = opts_of(64);
    struct kv_calib *c = open_ok((const char *const *)t.path, 2, t.tok, &o);
    int64_t n = kv_calib_n_windows(c), w0 = t.n[0] / 64;
    /* first, last, first+1, last-1, ... switches input on every call */
    for (int64_t r = 0; r < 4; r++) {
        int64_t picks[2] = {r, n - 1 - r};
        for (int p = 0; p < 2; p++) {
            const int32_t *ids;
            int64_t in, w;
            struct kv_err err;
            cr_assert_eq(kv_calib_window(c, picks[p], &ids, &in, &w, &err), KV_OK, "%s",
                         fmt_err(&err));
            cr_assert_eq(in, picks[p] < w0 ? 0 : 1);
            cr_assert(memcmp(ids, t.ids[in] + w * 64, 64 * sizeof *ids) == 0,
                      "round %lld: input %lld window %lld differs", (long long)r, (long long)in,
                      (long long)w);
        }
    }
    kv_calib_free(c);
    two_free(&t);
}

Test(dataset, an_input_changed_after_the_scan_is_refused) {
    struct two t;
    two_init(&t);
    struct kv_calib_opts o = opts_of(64);
    struct kv_calib *c = open_ok((const char *const *)t.path, 2, t.tok, &o);
    /* the last input stays loaded, so input 0 is read again */
    char *more = gen_text(77, 1600);
    FILE *f = fopen(t.path[0], "wb");
    cr_assert(f);
    fputs(more, f);
    fclose(f);
    const int32_t *ids;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_calib_window(c, 0, &ids, NULL, NULL, &err);
    cr_assert_eq(rc, KV_EFORMAT);
    cr_assert_str_eq(err.path, t.path[0]);
    cr_assert(strncmp(err.msg, "changed since it was scanned", 28) == 0, "%s", err.msg);
    free(more);
    kv_calib_free(c);
    two_free(&t);
}

/* ---------------------------------------------------------------- errors */

Test(dataset, a_missing_file_is_an_io_error_naming_it) {
    struct kv_tokenizer *tok = load_tok();
    char *dir = kvt_temp_dir();
    char *missing = kvt_path(dir, "nope.txt");
    char *good = write_text("Once upon a time.", ".txt");
    const char *paths[2] = {good, missing};
    struct kv_calib_opts o = opts_of(2);
    struct kv_err err;
    cr_assert_eq(open_fails(paths, 2, tok, &o, &err), KV_EIO);
    cr_assert_str_eq(err.path, missing);
    cr_assert_eq(err.off, KV_NO_OFFSET);
    cr_assert_str_eq(err.msg, "cannot open: no such file or directory");
    unlink(good);
    rmdir(dir);
    free(good);
    free(missing);
    free(dir);
    kv_tok_free(tok);
}

struct bad_line {
    const char *text;  /* file contents */
    const char *msg;   /* expected message (prefix when prefix is set) */
    int prefix;
    uint64_t off;
};

static void check_bad_jsonl(const struct bad_line *b, const char *suffix) {
    char *p = strstr(suffix, ".gz") ? write_gz(b->text, strlen(b->text), suffix)
                                    : write_text(b->text, suffix);
    char *got = NULL;
    size_t len;
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_calib_read_text(p, &got, &len, &err);
    cr_assert_eq(rc, KV_EFORMAT, "%s: code %d for %s", suffix, rc, b->text);
    cr_assert_null(got);
    cr_assert_str_eq(err.path, p);
    cr_assert_eq(err.off, b->off, "%s: offset %llu, expected %llu (%s)", suffix,
                 (unsigned long long)err.off, (unsigned long long)b->off, err.msg);
    if (b->prefix)
        cr_assert(strncmp(err.msg, b->msg, strlen(b->msg)) == 0, "%s: message '%s'", suffix,
                  err.msg);
    else
        cr_assert_str_eq(err.msg, b->msg);
    unlink(p);
    free(p);
}

Test(dataset, bad_json_lines_name_the_line_and_its_offset) {
    static const struct bad_line rows[] = {
        {"{\"text\": \"a\"}\n\n{\"text\": \"b\"\n", "line 3: invalid json: ", 1, 15},
        {"{\"text\": \"a\"}\n{\"text\": \"b\"} x\n", "line 2: invalid json: ", 1, 14},
        {"{\"text\": \"a\", \"text\": \"b\"}\n", "line 1: invalid json: duplicate object key",
         1, 0},
        {"{\"text\": \"a\"}\n{\"txt\": \"b\"}\n",
         "line 2: expected a json object with a string \"text\", found no \"text\"", 0, 14},
        {"{\"text\": \"a\"}\r\n[\"b\"]\n",
         "line 2: expected a json object with a string \"text\", found an array", 0, 15},
        {"\"just a string\"\n",
         "line 1: expected a json object with a string \"text\", found a string", 0, 0},
        {"\n\n{\"text\": 5}",
         "line 3: expected a json object with a string \"text\", found \"text\" as an integer", 0,
         2},
        {"{\"text\": null}\n",
         "line 1: expected a json object with a string \"text\", found \"text\" as a null", 0, 0},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        check_bad_jsonl(&rows[i], ".jsonl");
        check_bad_jsonl(&rows[i], ".jsonl.gz"); /* offsets in the decompressed text */
    }
}

Test(dataset, a_bad_json_line_fails_the_open) {
    struct kv_tokenizer *tok = load_tok();
    char *p = write_text("{\"text\": \"a\"}\n{\"text\": \"b\"\n", ".jsonl");
    const char *paths[1] = {p};
    struct kv_calib_opts o = opts_of(2);
    struct kv_err err;
    cr_assert_eq(open_fails(paths, 1, tok, &o, &err), KV_EFORMAT);
    cr_assert_str_eq(err.path, p);
    cr_assert_eq(err.off, 14);
    cr_assert(strncmp(err.msg, "line 2: invalid json: ", 22) == 0, "%s", err.msg);
    unlink(p);
    free(p);
    kv_tok_free(tok);
}

Test(dataset, more_samples_than_windows_is_refused) {
    struct two t;
    two_init(&t);
    int64_t total = t.n[0] / 64 + t.n[1] / 64;
    for (int seq = 0; seq < 2; seq++) {
        struct kv_calib_opts o = opts_of(64);
        o.samples = total + 1;
        o.sequential = seq;
        struct kv_err err;
        cr_assert_eq(open_fails((const char *const *)t.path, 2, t.tok, &o, &err), KV_EINVAL);
        char want[256];
        snprintf(want, sizeof want,
                 "inputs hold %lld windows of 64 tokens, fewer than the %lld samples asked for",
                 (long long)total, (long long)total + 1);
        cr_assert_str_eq(err.msg, want);
    }
    two_free(&t);
}

Test(dataset, no_windows_at_all_is_refused) {
    struct kv_tokenizer *tok = load_tok();
    char *a = write_text("Once upon a time.", ".txt");
    char *b = write_text("Lily saw a dog.", ".txt");
    int32_t *ids;
    int64_t na = encode(tok, "Once upon a time.", &ids);
    free(ids);
    int64_t nb = encode(tok, "Lily saw a dog.", &ids);
    free(ids);
    cr_assert(na + nb < 256);
    struct kv_calib_opts o = opts_of(256);
    struct kv_err err;
    const char *one[1] = {a};
    cr_assert_eq(open_fails(one, 1, tok, &o, &err), KV_EINVAL);
    char want[256];
    snprintf(want, sizeof want,
             "no windows: the input holds %lld tokens, fewer than one window of 256",
             (long long)na);
    cr_assert_str_eq(err.msg, want);
    cr_assert_str_eq(err.path, a);

    /* the sum would fill a window, but windows never span inputs */
    int64_t longer = na > nb ? na : nb;
    cr_assert(na + nb > longer + 1);
    o.seq_len = longer + 1;
    const char *both[2] = {a, b};
    cr_assert_eq(open_fails(both, 2, tok, &o, &err), KV_EINVAL);
    snprintf(want, sizeof want,
             "no windows: each of the 2 inputs holds fewer than one window of %lld tokens "
             "(%lld tokens in all)",
             (long long)(longer + 1), (long long)(na + nb));
    cr_assert_str_eq(err.msg, want);

    /* one short input among others contributes no windows */
    o.seq_len = nb;
    struct kv_calib *c = open_ok(both, 2, tok, &o);
    cr_assert_eq(kv_calib_input(c, 0)->windows, na / nb);
    cr_assert_eq(kv_calib_input(c, 1)->windows, 1);
    kv_calib_free(c);
    unlink(a);
    unlink(b);
    free(a);
    free(b);
    kv_tok_free(tok);
}

Test(dataset, bad_options_are_refused) {
    struct kv_tokenizer *tok = load_tok();
    char *text = gen_text(5, 300);
    char *p = write_text(text, ".txt");
    const char *paths[1] = {p};
    struct {
        int64_t seq_len, samples, shard_index, shard_count;
        int64_t n_paths;
        const char *msg;
    } rows[] = {
        {1, 0, 0, 1, 1, "sequence length must be at least 2, found 1"},
        {64, -1, 0, 1, 1, "samples must be 0 (every window) or positive, found -1"},
        {64, 0, 0, 0, 1, "shard count must be at least 1, found 0"},
        {64, 0, 2, 2, 1, "shard index 2 is outside 0..1 for 2 shards"},
        {64, 0, -1, 2, 1, "shard index -1 is outside 0..1 for 2 shards"},
        {64, 0, 0, 1, 0, "no calibration inputs given"},
        {16, 1, 1, 2, 1, "shard 1 of 2 holds no windows: the plan holds 1"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_calib_opts o = opts_of(rows[i].seq_len);
        o.samples = rows[i].samples;
        o.shard_index = rows[i].shard_index;
        o.shard_count = rows[i].shard_count;
        struct kv_err err;
        cr_assert_eq(open_fails(paths, rows[i].n_paths, tok, &o, &err), KV_EINVAL, "row %zu",
                     i);
        cr_assert_str_eq(err.msg, rows[i].msg);
    }
    unlink(p);
    free(p);
    free(text);
    kv_tok_free(tok);
}

/* The same rules in a caller's words: kvcal collect names its flags. */
Test(dataset, checks_word_messages_with_the_callers_names) {
    static const char *const flags[KV_CALIB_OPT_COUNT] = {
        [KV_CALIB_OPT_SEQ_LEN] = "--seq-len", [KV_CALIB_OPT_SAMPLES] = "--samples",
        [KV_CALIB_OPT_SHARD] = "--shard"};
    struct {
        int64_t seq_len, samples, shard_index, shard_count;
        const char *msg;
    } rows[] = {
        {1, 0, 0, 1, "--seq-len must be at least 2, got 1"},
        {64, -1, 0, 1, "--samples must be 0 (every window) or more, got -1"},
        {64, 0, 2, 2, "--shard needs I/N with 0 <= I < N, got '2/2'"},
        {64, 0, 0, 0, "--shard needs I/N with 0 <= I < N, got '0/0'"},
        {64, 0, -1, 3, "--shard needs I/N with 0 <= I < N, got '-1/3'"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_calib_opts o = opts_of(rows[i].seq_len);
        o.samples = rows[i].samples;
        o.shard_index = rows[i].shard_index;
        o.shard_count = rows[i].shard_count;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_calib_check(&o, flags, &err), KV_EINVAL, "row %zu", i);
        cr_assert_str_eq(err.msg, rows[i].msg);
        cr_assert_eq(kv_calib_check(&o, NULL, &err), KV_EINVAL, "row %zu", i);
    }
    struct kv_calib_opts ok = opts_of(2);
    ok.shard_index = 1, ok.shard_count = 2;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_calib_check(&ok, flags, &err), KV_OK);
    cr_assert(kv_calib_shard_valid(0, 1) && kv_calib_shard_valid(3, 4));
    cr_assert(!kv_calib_shard_valid(4, 4) && !kv_calib_shard_valid(-1, 4) && !kv_calib_shard_valid(0, 0));
}

/* ---------------------------------------------------------------- streaming */

static long peak_rss_kib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* The finding of an adversarial run: tokenizing held ~55 bytes per byte
 * of text (10 MB of text took 585 MB). An input now streams: 8 MB of text,
 * plain and as .jsonl.gz documents, are counted with the peak RSS rising
 * by less than 48 MB (encoding it whole takes ~230 MB more), and windows
 * fetched at growing, skipping offsets equal the whole text's tokens. */
Test(dataset, inputs_stream_in_bounded_memory_with_the_whole_texts_tokens, .timeout = 300) {
    KVT_SKIP_SANITIZED("the shadow memory and quarantine inflate the peak rss");
    struct kv_tokenizer *tok = load_tok();
    enum { N_DOCS = 64 };
    char *docs[N_DOCS];
    size_t tl = 0;
    for (int i = 0; i < N_DOCS; i++) tl += strlen(docs[i] = gen_text(100 + (uint64_t)i, 26000)) + 2;
    char *txt = malloc(tl + 1), *jsonl = make_jsonl(docs, N_DOCS);
    size_t n = 0;
    for (int i = 0; i < N_DOCS; i++)
        n += (size_t)sprintf(txt + n, "%s%s", i ? "\n\n" : "", docs[i]), free(docs[i]);
    cr_assert(n > (size_t)7 << 20, "%zu bytes of text", n);
    char *paths[2] = {write_text(txt, ".txt"), write_gz(jsonl, strlen(jsonl), ".jsonl.gz")};
    size_t text_len[2] = {n, strlen(jsonl)}; /* decompressed, before JSON parsing */
    free(jsonl);
    int64_t counted[2];
    long before = peak_rss_kib();
    for (int k = 0; k < 2; k++) {
        struct kv_text_tokens *t;
        struct kv_err err;
        uint64_t fb, tb;
        char sha[65];
        cr_assert_eq(kv_text_tokens_open(paths[k], tok, 1, &t, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(kv_text_tokens_finish(t, &counted[k], sha, &fb, &tb, &err), KV_OK, "%s",
                     fmt_err(&err));
        cr_assert_eq(tb, text_len[k], "%s: %llu bytes of text, expected %zu", paths[k],
                     (unsigned long long)tb, text_len[k]);
        struct stat st;
        cr_assert_eq(stat(paths[k], &st), 0);
        cr_assert_eq(fb, (uint64_t)st.st_size);
        kv_text_tokens_close(t);
    }
    long rise = peak_rss_kib() - before;
    cr_assert(rise < 48 * 1024, "counting 2 x %zu bytes raised the peak rss by %ld KiB", n, rise);

    int32_t *ref;
    int64_t n_ref = encode(tok, txt, &ref);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(counted[k], n_ref, "%s: %lld tokens, the whole text has %lld", paths[k],
                     (long long)counted[k], (long long)n_ref);
        struct kv_text_tokens *t;
        struct kv_err err;
        cr_assert_eq(kv_text_tokens_open(paths[k], tok, 1, &t, &err), KV_OK, "%s", fmt_err(&err));
        uint64_t x = 77;
        int64_t checked = 0;
        for (int64_t a = 0; a < n_ref;) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            int64_t len = 1 + (int64_t)((x >> 33) % 5000);
            const int32_t *ids;
            int64_t got;
            cr_assert_eq(kv_text_tokens_get(t, a, len, &ids, &got, &err), KV_OK, "%s",
                         fmt_err(&err));
            int64_t want = n_ref - a < len ? n_ref - a : len;
            cr_assert_eq(got, want, "%s at %lld: %lld tokens, want %lld", paths[k], (long long)a,
                         (long long)got, (long long)want);
            for (int64_t i = 0; i < got; i++)
                cr_assert_eq(ids[i], ref[a + i], "%s: token %lld is %d, the whole text's %d",
                             paths[k], (long long)(a + i), ids[i], ref[a + i]);
            checked += got;
            a += (int64_t)((x >> 40) % 3 == 0 ? len / 2 + 1 : len + (int64_t)((x >> 20) % 20000));
        }
        cr_assert(checked > n_ref / 20, "%lld tokens checked", (long long)checked);
        kv_text_tokens_close(t);
    }
    free(ref);
    for (int k = 0; k < 2; k++) unlink(paths[k]), free(paths[k]);
    free(txt);
    kv_tok_free(tok);
}
