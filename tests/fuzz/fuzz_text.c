/* Calibration and evaluation text: any bytes, as .txt, .gz or .jsonl (by
 * their first byte), read whole (kv_calib_read_text, kv_tok_encode) and as
 * a stream (kv_text_tokens, and kv_tok_stream fed in pieces); when the
 * whole read succeeds the streams must give the same tokens, or the target
 * aborts. The vocabulary is built here: byte fallback, a few merges, and
 * literals with spaces inside, which cuts must not split. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dataset.h"
#include "fuzz.h"
#include "kvcalib.h"
#include "tokenizer.h"

static struct kv_tokenizer *fuzz_vocab(void) {
    static const char *const pieces[] = {"\xe2\x96\x81", "a", "b", "t", "h", "e", "\xe2\x96\x81t",
                                         "he", "\xe2\x96\x81the", "\xe2\x96\x81" "a", "ab", "\n",
                                         "<s>", "</s>", "x y"};
    int32_t n = 256 + (int32_t)(sizeof pieces / sizeof pieces[0]);
    struct kv_tokenizer *t;
    struct kv_err err;
    if (kv_tok_init(KV_TOK_SCORE, n, &t, &err)) abort();
    for (int b = 0; b < 256; b++) {
        char p[8];
        snprintf(p, sizeof p, "<0x%02X>", b);
        if (kv_tok_set_piece(t, b, p, 6, 0, KV_TOKT_BYTE, &err)) abort();
    }
    for (int32_t i = 256; i < n; i++) {
        const char *p = pieces[i - 256];
        int type = i >= n - 3 ? KV_TOKT_CONTROL : KV_TOKT_NORMAL;
        if (kv_tok_set_piece(t, i, p, strlen(p), (float)(i % 5), type, &err)) abort();
    }
    kv_tok_set_special(t, n - 3, n - 2, -1);
    if (kv_tok_set_normalizer(t, "\xe2\x96\x81", 1, &err)) abort();
    for (int32_t i = n - 3; i < n; i++)
        if (kv_tok_add_literal(t, i, &err)) abort();
    if (kv_tok_finish(t, "fuzz", &err)) abort();
    return t;
}

KV_FUZZ_TARGET(text) {
    static struct kv_tokenizer *tok;
    if (!tok) tok = fuzz_vocab();
    const char *suffix = size && data[0] == '{' ? ".jsonl" : size && data[0] == 0x1f ? ".gz" : ".txt";
    const char *sp = kv_fuzz_scratch(data, size, suffix);
    if (!sp) return;
    char path[1024];
    snprintf(path, sizeof path, "%s", sp);
    struct kv_err err;
    char *text;
    size_t len;
    int32_t *ref = NULL;
    int64_t n_ref = 0;
    if (kv_calib_read_text(path, &text, &len, &err) == KV_OK) {
        if (kv_tok_encode(tok, text, len, 1, &ref, &n_ref, &err) != KV_OK) abort();
        /* the stream fed in pieces of 1..16 bytes, slices of 1..32 */
        struct kv_tok_stream *s;
        if (kv_tok_stream_new(tok, 1, 1 + (size ? data[size - 1] % 32 : 0), &s, &err)) abort();
        int64_t at = 0;
        for (size_t pos = 0, k; pos < len || !at; pos += k) {
            k = 1 + (pos * 7 + len) % 16;
            if (k > len - pos) k = len - pos;
            const int32_t *ids;
            int64_t m;
            if (kv_tok_stream_feed(s, text + pos, k, pos + k == len, &ids, &m, &err)) abort();
            if (at + m > n_ref || (m && memcmp(ids, ref + at, (size_t)m * sizeof *ids))) abort();
            at += m;
            if (pos + k == len) break;
        }
        if (at != n_ref) abort();
        kv_tok_stream_free(s);
        free(text);
    }
    /* the file's tokens through kv_text_tokens: counted, then in windows */
    struct kv_text_tokens *t;
    int64_t counted = -1;
    if (kv_text_tokens_open(path, tok, 1, &t, &err) == KV_OK) {
        if (kv_text_tokens_finish(t, &counted, NULL, NULL, NULL, &err) != KV_OK) counted = -1;
        kv_text_tokens_close(t);
    }
    if (ref && counted != n_ref) abort();
    if (ref && kv_text_tokens_open(path, tok, 1, &t, &err) == KV_OK) {
        for (int64_t a = 0; a < n_ref; a += 5) {
            const int32_t *ids;
            int64_t got;
            if (kv_text_tokens_get(t, a, 7, &ids, &got, &err)) abort();
            int64_t want = n_ref - a < 7 ? n_ref - a : 7;
            if (got != want || memcmp(ids, ref + a, (size_t)got * sizeof *ids)) abort();
        }
        kv_text_tokens_close(t);
    }
    free(ref);
    unlink(path);
}
