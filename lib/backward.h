/* Internal access to the gradients of lib/backward.c (the trainer and the
 * Fisher accumulator address tensors by kind). */
#ifndef KV_BACKWARD_H
#define KV_BACKWARD_H

#include "kvcal_core.h"
#include "model.h"

/* Gradient buffer of weight kind of layer (global kinds ignore layer; a tied
 * head maps to the embedding), or NULL when the model has no such weight. */
float *kv_grad_of(const struct kv_grad *g, enum kv_wkind kind, int64_t layer);
/* Weight kind and layer (-1 for globals) of parameter tensor i. */
enum kv_wkind kv_grad_tensor_kind(const struct kv_grad *g, int64_t i, int64_t *layer);

#endif
