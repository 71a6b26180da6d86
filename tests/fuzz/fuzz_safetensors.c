/* safetensors header and layout validation on arbitrary bytes. */
#include "fuzz.h"
#include "safetensors.h"

KV_FUZZ_TARGET(safetensors) {
    struct kv_st_file f;
    struct kv_err err;
    if (kv_st_parse(data, size, "fuzz.safetensors", &f, &err) == KV_OK) {
        for (int64_t i = 0; i < f.n_tensors; i++) (void)kv_st_find(&f, f.tensors[i].name);
        kv_st_clear(&f);
    }
}
