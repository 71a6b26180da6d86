/* An HF config.json through kvcal's reader (kv_hf_read_config): any bytes
 * give a config or a refusal, never a crash. */
#include <unistd.h>

#include "fuzz.h"
#include "hfdir.h"

KV_FUZZ_TARGET(config) {
    const char *p = kv_fuzz_scratch(data, size, "-config.json");
    if (!p) return;
    struct kv_config cfg;
    struct kv_err err;
    kv_hf_read_config(p, &cfg, &err);
    unlink(p);
}
