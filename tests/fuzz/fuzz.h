/* Fuzz targets call kvcal's byte parsers. Each target defines
 * kv_fuzz_<name>(data, size); built with -DKV_LIBFUZZER it also becomes the
 * libFuzzer entry point (`make fuzz FUZZ=<name>`), and tests/test_fuzz.c
 * replays every committed corpus file through it in `make test`. A target
 * must never crash, leak or print, whatever the bytes. */
#ifndef KV_FUZZ_H
#define KV_FUZZ_H

#include <stddef.h>
#include <stdint.h>

#ifdef KV_LIBFUZZER
#define KV_FUZZ_ENTRY(name)                                                                \
    int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {                               \
        kv_fuzz_##name(d, n);                                                              \
        return 0;                                                                          \
    }
#else
#define KV_FUZZ_ENTRY(name)
#endif

#define KV_FUZZ_TARGET(name)                                                               \
    void kv_fuzz_##name(const uint8_t *data, size_t size);                                 \
    KV_FUZZ_ENTRY(name)                                                                    \
    void kv_fuzz_##name(const uint8_t *data, size_t size)

/* Write bytes to a per-process scratch file with the given suffix (the
 * loaders detect formats from names); returns its path (static buffer). */
const char *kv_fuzz_scratch(const uint8_t *data, size_t size, const char *suffix);

#endif
