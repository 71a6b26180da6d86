/* The manifest kvcal.json on arbitrary bytes: JSON, the schema and every
 * layout rule (kv_lr_manifest_parse); a manifest that parses is walked
 * through the accessors and byte counts a program would use next. */
#include "fuzz.h"
#include "kvcal.h"

KV_FUZZ_TARGET(manifest) {
    struct kv_lowrank *lr;
    struct kv_err err;
    if (kv_lr_manifest_parse(data, size, "fuzz.json", &lr, &err) != KV_OK) return;
    struct kv_lr_info in = kv_lr_info(lr);
    for (int64_t l = 0; l < in.n_layers; l++)
        for (int which = 0; which < 2; which++) {
            (void)kv_lr_mode_of(lr, l, which);
            (void)kv_lr_side_error(lr, l, which, NULL, NULL);
            (void)kv_lr_side_bytes(lr, l, which, in.kv_bits);
            for (int64_t u = 0; u < kv_lr_n_units(lr, l, which); u++)
                (void)kv_lr_unit_info(lr, l, which, u);
        }
    (void)kv_lr_bytes(lr, in.kv_bits);
    kv_lr_free(lr);
}
