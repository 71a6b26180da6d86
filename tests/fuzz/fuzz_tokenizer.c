/* Tokenizer files: llama2.c tokenizer.bin bytes, and tokenizer.json through
 * the HF loader; each successful load encodes and decodes a short text. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"
#include "kvcal.h"
#include "llama2c.h"

static void exercise(struct kv_tokenizer *t) {
    static const char text[] = "The cat sat.\n<s> \xff\xe4\xb8\xad";
    int32_t *ids;
    int64_t n;
    struct kv_err err;
    for (int flags = 0; flags < 4; flags++) /* with and without BOS and special tokens */
        if (kv_tok_encode(t, text, sizeof text - 1, flags, &ids, &n, &err) == KV_OK) {
            char out[64];
            for (int64_t i = 1; i < n; i++) kv_tok_decode(t, ids[i - 1], ids[i], out, sizeof out);
            free(ids);
        }
    kv_tok_free(t);
}

KV_FUZZ_TARGET(tokenizer) {
    struct kv_tokenizer *t;
    struct kv_err err;
    if (size && data[0] == '{') { /* JSON: go through the file loader */
        const char *p = kv_fuzz_scratch(data, size, ".json");
        if (p && kv_tok_open(p, &t, &err) == KV_OK) exercise(t);
        if (p) unlink(p);
        return;
    }
    if (kv_l2c_parse_tokenizer(data, size, "fuzz.bin", -1, &t, &err) == KV_OK) exercise(t);
}
