/* The weights file model.safetensors of a compressed model directory
 * (internal): every weight the forward pass uses, F32, in the layout
 * formats/kvdir.h describes, with the tensor names of formats/lrlayout.h.
 * The writer takes the base model's weights and lr's factors; the reader
 * takes the names a parsed manifest (formats/kvmanifest.h) gives and
 * checks each tensor's presence, shape and dtype against the ranks. */
#ifndef KV_LRWEIGHTS_H
#define KV_LRWEIGHTS_H

#include "kvformats.h"
#include "kvmanifest.h"

/* Write the weights file of lr, compressed from base model m, to path
 * (atomically, kv_stw_write): m's weights other than K, V and, where fused,
 * Q and O, then per layer lr's factors or the original projections. lr must
 * have passed kv_lrl_check against m. Errors: KV_EIO naming path,
 * KV_ENOMEM. */
int kv_lrw_write(const struct kv_model *m, const struct kv_lowrank *lr, const char *path,
                 struct kv_err *err);

/* Read from the weights file at path every factor of lr, as parsed from a
 * manifest (factor pointers NULL) with its tensor names mf: each named
 * tensor must exist with exactly the shape the ranks imply and dtype F32,
 * F16 or BF16 (converted to f32), holding finite values; the projections a
 * mode keeps are checked but not loaded. Errors name path, the tensor and
 * the manifest entry that named it, with the tensor's offset when known:
 * KV_EIO, KV_EFORMAT, KV_ENOMEM. On failure lr may hold some factors;
 * kv_lr_free releases them. */
int kv_lrw_read(const char *path, const struct kv_mf *mf, struct kv_lowrank *lr,
                struct kv_err *err);

#endif
