/* .kvstats reading (GGUF container plus the stats schema) on arbitrary bytes. */
#include "fuzz.h"
#include "kvcal.h"

KV_FUZZ_TARGET(kvstats) {
    struct kv_stats *s;
    struct kv_err err;
    if (kv_stats_parse(data, size, "fuzz.kvstats", &s, &err) == KV_OK) kv_stats_free(s);
}
