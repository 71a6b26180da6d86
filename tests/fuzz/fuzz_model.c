/* Whole-model loading from one file: GGUF (by magic) or llama2.c, including
 * the embedded GGUF tokenizer, then one short encode. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"
#include "kvcal.h"

KV_FUZZ_TARGET(model) {
    const char *p = kv_fuzz_scratch(data, size, ".model");
    if (!p) return;
    struct kv_model *m;
    struct kv_err err;
    if (kv_model_open(p, NULL, &m, &err) == KV_OK) {
        const struct kv_tokenizer *tok = kv_model_tokenizer(m);
        if (tok) {
            int32_t *ids;
            int64_t n;
            if (kv_tok_encode(tok, "Once upon a time \xe2\x82\xac", 19, 1, &ids, &n, &err) == KV_OK)
                free(ids);
        }
        kv_model_close(m);
    }
    unlink(p);
}
