#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz.h"

const char *kv_fuzz_scratch(const uint8_t *data, size_t size, const char *suffix) {
    static char path[1024];
    const char *t = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/kvcal-fuzz-%ld%s", t && *t ? t : "/tmp", (long)getpid(), suffix);
    FILE *f = fopen(path, "wb");
    if (!f) return NULL;
    if (size) fwrite(data, 1, size, f);
    fclose(f);
    return path;
}
