/* Replays the fuzz corpora (tests/fuzz/corpus/<target>/) through the fuzz
 * targets, plus a deterministic sweep of truncations and byte flips of each
 * file, so every input a fuzzer ever found stays a permanent test. Run under
 * `make fuzz` the same targets get coverage-guided inputs. */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#include "fuzz/fuzz_config.c"
#include "fuzz/fuzz_kvstats.c"
#include "fuzz/fuzz_manifest.c"
#include "fuzz/fuzz_model.c"
#include "fuzz/fuzz_safetensors.c"
#include "fuzz/fuzz_scratch.c"
#include "fuzz/fuzz_text.c"
#include "fuzz/fuzz_tokenizer.c"

typedef void (*target_fn)(const uint8_t *, size_t);

/* Every corpus file whole, every prefix at a stride, and single-byte flips
 * at a stride; returns the number of files replayed. */
static int replay(const char *name, target_fn fn) {
    char dir[512];
    snprintf(dir, sizeof dir, "tests/fuzz/corpus/%s", name);
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "corpus '%s' is missing (run make test from the repository root)", dir);
    int files = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char *p = kvt_path(dir, e->d_name);
        size_t len;
        uint8_t *buf = (uint8_t *)kvt_read_file(p, &len);
        cr_assert_not_null(buf, "%s", p);
        fn(buf, len);
        size_t stride = len / 64 + 1;
        for (size_t cut = 0; cut < len; cut += stride) fn(buf, cut);
        uint8_t *mut = malloc(len ? len : 1);
        for (size_t i = 0; i < len; i += stride) {
            memcpy(mut, buf, len);
            mut[i] ^= 0xff;
            fn(mut, len);
        }
        free(mut), free(buf), free(p);
        files++;
    }
    closedir(d);
    return files;
}

Test(fuzz_replay, safetensors_corpus_never_crashes) {
    cr_assert_gt(replay("safetensors", kv_fuzz_safetensors), 0);
}
Test(fuzz_replay, model_corpus_never_crashes) { cr_assert_gt(replay("model", kv_fuzz_model), 0); }
Test(fuzz_replay, tokenizer_corpus_never_crashes) {
    cr_assert_gt(replay("tokenizer", kv_fuzz_tokenizer), 0);
}
Test(fuzz_replay, kvstats_corpus_never_crashes) {
    cr_assert_gt(replay("kvstats", kv_fuzz_kvstats), 0);
}
Test(fuzz_replay, config_corpus_never_crashes) {
    cr_assert_gt(replay("config", kv_fuzz_config), 0);
}
Test(fuzz_replay, text_corpus_streams_as_it_reads_whole) {
    cr_assert_gt(replay("text", kv_fuzz_text), 0);
}
Test(fuzz_replay, manifest_corpus_never_crashes) {
    cr_assert_gt(replay("manifest", kv_fuzz_manifest), 0);
}
