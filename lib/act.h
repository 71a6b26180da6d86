/* The MLP activations and their derivatives, shared by the inference
 * forward (forward.c) and the training forward and backward (backward.c)
 * so both compute the same function (internal, header-only). */
#ifndef KV_ACT_H
#define KV_ACT_H

#include <math.h>

#define KV_GELU_C 0.7978845608028654f /* sqrt(2/pi) */

/* GELU, tanh approximation (GPT-2's "gelu_new", Gemma's "gelu_pytorch_tanh"). */
static inline float kv_gelu_tanh(float a) {
    return 0.5f * a * (1.0f + tanhf(KV_GELU_C * (a + 0.044715f * a * a * a)));
}

static inline float kv_gelu_tanh_grad(float a) {
    float t = tanhf(KV_GELU_C * (a + 0.044715f * a * a * a));
    return 0.5f * (1.0f + t) + 0.5f * a * (1.0f - t * t) * KV_GELU_C * (1.0f + 3.0f * 0.044715f * a * a);
}

/* GELU as defined, x Φ(x) (GPT-NeoX's "gelu"), and Φ(x) + x φ(x). */
static inline float kv_gelu_erf(float a) { return 0.5f * a * (1.0f + erff(a * 0.70710678118654752f)); }

static inline float kv_gelu_erf_grad(float a) {
    return 0.5f * (1.0f + erff(a * 0.70710678118654752f)) +
           a * expf(-0.5f * a * a) * 0.39894228040143268f;
}

/* SiLU, x σ(x) (Llama's gate). */
static inline float kv_silu(float a) { return a / (1.0f + expf(-a)); }

#endif
