/* kvcal's tokenizers against reference ids nobody here computed: the golden
 * files tests/tokgold/NAME.ids.gz hold the ids @huggingface/tokenizers gave
 * whole corpora (tests/tokgold/golden.js made them; `make
 * golden-tokenizers` remakes them). Each file's header names its
 * tokenizer, corpus, mode and the corpus's sha256. The tokenizer.json
 * files are built by `make deps` into deps/tokenizers (from the npm
 * packages' real vocabularies); without them, or without ../shared, the
 * tests skip and say why.
 *
 * Every corpus is encoded twice: whole, and through a stream with 4 KiB
 * slices fed in random pieces; both must equal the reference id for id.
 * For byte-level tokenizers decode(encode(text)) must give the text back
 * (Qwen 2's: the text in NFC, its normalizer's form). */
#include <dirent.h>
#include <nettle/sha2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>
#include <zlib.h>

#include "kvformats.h"
#include "testutil.h"
#include "xorshift64.h"

#define GOLD_DIR "tests/tokgold"

struct gold {
    char tok[64], corpus[32], mode[16], sha[65];
    int64_t n;
    int32_t *ids;
};

/* Read a golden file: "# tok corpus mode n sha256" then one id per line. */
static void gold_read(const char *path, struct gold *g) {
    gzFile f = gzopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    char line[512];
    cr_assert_not_null(gzgets(f, line, sizeof line), "%s: empty", path);
    long long n;
    cr_assert_eq(sscanf(line, "# %63s %31s %15s %lld %64s", g->tok, g->corpus, g->mode, &n, g->sha),
                 5, "%s: bad header '%s'", path, line);
    g->n = n;
    g->ids = malloc((size_t)(n ? n : 1) * sizeof *g->ids);
    cr_assert_not_null(g->ids);
    for (int64_t i = 0; i < n; i++) {
        cr_assert_not_null(gzgets(f, line, sizeof line), "%s: %lld ids, header says %lld", path,
                           (long long)i, n);
        g->ids[i] = (int32_t)strtol(line, NULL, 10);
    }
    gzclose(f);
}

static const char *corpus_path(const char *name) {
    if (!strcmp(name, "hard")) return GOLD_DIR "/hard.txt";
    if (!strcmp(name, "wiki")) return kvt_shared("text/wikitext-2-raw/wiki.test.raw");
    if (!strcmp(name, "tiny")) return kvt_shared("text/tinystories/val1k.txt");
    if (!strcmp(name, "gospels")) return "data/kjv/gospels.txt"; /* make data */
    return NULL;
}

static void sha256_hex(const char *buf, size_t len, char out[65]) {
    struct sha256_ctx c;
    uint8_t d[SHA256_DIGEST_SIZE];
    sha256_init(&c);
    sha256_update(&c, len, (const uint8_t *)buf);
    sha256_digest(&c, sizeof d, d);
    for (int i = 0; i < SHA256_DIGEST_SIZE; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

static void expect_same(const struct gold *g, const int32_t *ids, int64_t n, const char *how) {
    int64_t i = 0;
    while (i < n && i < g->n && ids[i] == g->ids[i]) i++;
    cr_assert(i == n && n == g->n,
              "%s %s %s (%s): %lld tokens, the reference %lld; first difference at token %lld: "
              "kvcal %d, reference %d",
              g->tok, g->corpus, g->mode, how, (long long)n, (long long)g->n, (long long)i,
              i < n ? ids[i] : -1, i < g->n ? g->ids[i] : -1);
}

/* The stream's ids: 4 KiB slices, fed in random pieces of up to 64 KiB. */
static int32_t *stream_ids(const struct kv_tokenizer *t, const char *text, size_t len, int flags,
                           int64_t *n) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_tok_stream *s;
    cr_assert_eq(kv_tok_stream_new(t, flags, 4096, &s, &err), KV_OK, "%s", err.msg);
    int64_t cap = 1024;
    int32_t *all = malloc((size_t)cap * sizeof *all);
    cr_assert_not_null(all);
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    *n = 0;
    for (size_t pos = 0, eof = 0; !eof;) {
        size_t k = 1 + (size_t)(rng_next(&rng) % 65536);
        if (k > len - pos) k = len - pos;
        eof = pos + k == len;
        const int32_t *ids;
        int64_t m;
        cr_assert_eq(kv_tok_stream_feed(s, text + pos, k, (int)eof, &ids, &m, &err), KV_OK, "%s",
                     err.msg);
        pos += k;
        while (*n + m > cap) {
            cap *= 2;
            all = realloc(all, (size_t)cap * sizeof *all);
            cr_assert_not_null(all);
        }
        if (m) memcpy(all + *n, ids, (size_t)m * sizeof *ids);
        *n += m;
    }
    kv_tok_stream_free(s);
    return all;
}

static int check_file(const char *name) {
    char path[512], tpath[512];
    snprintf(path, sizeof path, GOLD_DIR "/%s", name);
    struct gold g;
    gold_read(path, &g);
    /* kvcal's own fixture tokenizer is committed with its model */
    if (!strcmp(g.tok, "kjvbpe"))
        snprintf(tpath, sizeof tpath, "data/kjv-bpe-llama/tokenizer.json");
    else
        snprintf(tpath, sizeof tpath, "deps/tokenizers/%s/tokenizer.json", g.tok);
    const char *cpath = corpus_path(g.corpus);
    if (access(tpath, R_OK) != 0 || !cpath) {
        fprintf(stderr, "tokgold: %s skipped: %s is missing (make deps builds it)\n", name,
                access(tpath, R_OK) != 0 ? tpath : g.corpus);
        free(g.ids);
        return 0;
    }
    size_t len;
    char *text = kvt_read_file(cpath, &len);
    cr_assert_not_null(text, "cannot read %s", cpath);
    char sha[65];
    sha256_hex(text, len, sha);
    cr_assert_str_eq(sha, g.sha, "%s: %s has sha256 %s but the golden file was made from %s; "
                     "remake it with make golden-tokenizers", name, cpath, sha, g.sha);
    struct kv_tokenizer *t = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_tok_open(tpath, &t, &err), KV_OK, "%s", err.msg);
    int flags = !strcmp(g.mode, "special") ? KV_TOK_PARSE_SPECIAL : 0;
    int32_t *ids = NULL;
    int64_t n = 0;
    cr_assert_eq(kv_tok_encode(t, text, len, flags, &ids, &n, &err), KV_OK, "%s", err.msg);
    expect_same(&g, ids, n, "whole text");
    int64_t ns;
    int32_t *sids = stream_ids(t, text, len, flags, &ns);
    expect_same(&g, sids, ns, "stream of 4 KiB slices");
    if (!flags) {
        /* decoding gives the text back, where the vocabulary can spell it */
        size_t cap = len + 1024, o = 0;
        char *back = malloc(cap);
        cr_assert_not_null(back);
        for (int64_t i = 0; i < n && o <= len; i++) {
            size_t k = kv_tok_decode(t, i ? ids[i - 1] : -1, ids[i], back + o, cap - o);
            o += k;
        }
        /* Qwen 2 normalizes to NFC first, so it gives back the NFC text */
        char *want = text;
        size_t wlen = len;
        if (!strcmp(g.tok, "qwen2")) {
            utf8proc_uint8_t *nfc = NULL;
            utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)text, (utf8proc_ssize_t)len,
                                              &nfc, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
            cr_assert(r >= 0, "%s is not UTF-8", cpath);
            want = (char *)nfc;
            wlen = (size_t)r;
        }
        int exact = o == wlen && memcmp(back, want, wlen) == 0;
        if (!strcmp(g.tok, "gpt2") || !strcmp(g.tok, "llama3") || !strcmp(g.tok, "qwen2") ||
            !strcmp(g.tok, "kjvbpe"))
            cr_assert(exact, "%s %s: decode(encode(text)) is not the text (%zu bytes back of %zu)",
                      g.tok, g.corpus, o, wlen);
        if (want != text) free(want);
        free(back);
    }
    fprintf(stderr, "tokgold: %s %s %s: %lld tokens identical to the reference\n", g.tok, g.corpus,
            g.mode, (long long)n);
    free(sids);
    free(ids);
    kv_tok_free(t);
    free(text);
    free(g.ids);
    return 1;
}

static int run_matching(const char *prefix) {
    DIR *d = opendir(GOLD_DIR);
    cr_assert_not_null(d);
    struct dirent *e;
    int checked = 0, seen = 0;
    while ((e = readdir(d))) {
        size_t nl = strlen(e->d_name);
        if (nl < 7 || strcmp(e->d_name + nl - 7, ".ids.gz") || strncmp(e->d_name, prefix, strlen(prefix)))
            continue;
        seen++;
        checked += check_file(e->d_name);
    }
    closedir(d);
    cr_assert(seen > 0, "no golden files for '%s' in " GOLD_DIR, prefix);
    return checked;
}

#define GOLD_TEST(tok)                                                                          \
    Test(tokgold, tok, .timeout = 300) {                                                        \
        if (!run_matching(#tok "-")) cr_skip("no %s tokenizer.json or corpus: make deps builds " \
                                             "deps/tokenizers, ../shared holds the corpora", #tok); \
    }

GOLD_TEST(gpt2)
GOLD_TEST(llama3)
GOLD_TEST(qwen2)
GOLD_TEST(gpt2mix)
GOLD_TEST(tinystories)
GOLD_TEST(metaspace)
GOLD_TEST(kjvbpe)
