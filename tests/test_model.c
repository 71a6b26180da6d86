/* Model core: config checks, weight binding, dtype conversion. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "testutil.h"

static struct kv_config cfg(void) {
    struct kv_config c = {0};
    c.dim = 8, c.hidden_dim = 12, c.n_layers = 1, c.n_heads = 2, c.n_kv_heads = 1;
    c.head_dim = 4, c.vocab_size = 10, c.norm_eps = 1e-5f, c.rope_theta = 10000.0f;
    c.tied_embeddings = 1, c.bos_id = 1, c.eos_id = 2;
    return c;
}

/* Independent f16 decode: sign * 2^(e-15) * (1 + m/1024), subnormals 2^-14 * m/1024. */
static double f16_ref(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0) v = ldexp(m / 1024.0, -14);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexp(1.0 + m / 1024.0, e - 15);
    return s ? -v : v;
}

Test(model, f16_conversion_matches_definition_for_every_value) {
    for (uint32_t h = 0; h < 65536; h++) {
        double ref = f16_ref((uint16_t)h);
        float got = kv_f16_to_f32((uint16_t)h);
        if (isnan(ref)) cr_assert(isnan(got), "0x%04x should be nan", h);
        else cr_assert_eq((double)got, ref, "0x%04x: got %.9g want %.9g", h, (double)got, ref);
    }
}

Test(model, bf16_conversion_is_the_high_half_of_f32) {
    float vals[] = {1.0f, -2.5f, 3.140625f, 1e-38f, 65504.0f};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        uint32_t bits;
        memcpy(&bits, &vals[i], 4);
        float got = kv_bf16_to_f32((uint16_t)(bits >> 16));
        uint32_t want_bits = bits & 0xffff0000u;
        float want;
        memcpy(&want, &want_bits, 4);
        cr_assert_eq(got, want);
    }
}

/* The array conversion (split over threads above 2^18 elements, in chunks
 * of 2^16) gives every element's bits as the definitions above do: every
 * 16-bit pattern, repeated past several chunks and a ragged tail, for F16
 * and BF16, at sizes below and above the split and unaligned in the file. */
Test(model, array_conversion_matches_the_elementwise_definition) {
    const int64_t sizes[] = {1, 65535, (1 << 18) - 1, (1 << 18) + 65536 * 3 + 17};
    for (int t = 0; t < 2; t++) {
        enum kv_dtype dt = t ? KV_DTYPE_BF16 : KV_DTYPE_F16;
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            int64_t n = sizes[si];
            uint8_t *raw = malloc((size_t)n * 2 + 1);
            float *out = malloc((size_t)n * sizeof *out);
            cr_assert(raw && out);
            uint8_t *p = raw + 1; /* odd address, as a tensor in a file may be */
            for (int64_t i = 0; i < n; i++) {
                uint16_t h = (uint16_t)(i * 40503u + 7);
                p[2 * i] = (uint8_t)h, p[2 * i + 1] = (uint8_t)(h >> 8);
            }
            kv_convert_to_f32(dt, p, out, n);
            for (int64_t i = 0; i < n; i++) {
                uint16_t h = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
                float want = t ? kv_bf16_to_f32(h) : kv_f16_to_f32(h);
                cr_assert(memcmp(&out[i], &want, 4) == 0, "%s n %lld element %lld (0x%04x): %g, want %g",
                          kv_dtype_name(dt), (long long)n, (long long)i, h, (double)out[i], (double)want);
            }
            free(raw), free(out);
        }
    }
}

Test(model, rejects_inconsistent_config) {
    struct kv_config c = cfg();
    struct kv_model *m;
    struct kv_err err;
    c.n_kv_heads = 3;
    cr_assert_eq(kv_model_create(&c, KV_FORMAT_HF, "config.json", &m, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "n_heads 2 is not a multiple of n_kv_heads 3");
    c = cfg();
    c.head_dim = 3;
    cr_assert_eq(kv_model_create(&c, KV_FORMAT_HF, "config.json", &m, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "head_dim 3 is odd, rope needs pairs");
    c = cfg();
    c.dim = 0;
    cr_assert_eq(kv_model_create(&c, KV_FORMAT_HF, "config.json", &m, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "dim is 0, expected 1..1048576");
}

Test(model, bind_checks_shape_and_dtype_and_converts) {
    struct kv_config c = cfg();
    struct kv_model *m;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_create(&c, KV_FORMAT_HF, "m.safetensors", &m, &err), KV_OK);
    uint16_t half[8 * 8];
    for (int i = 0; i < 64; i++) half[i] = (uint16_t)(0x3c00 + i); /* 1.0 + i/1024 */
    struct kv_tensor t = {.dtype = KV_DTYPE_F16, .ndim = 2, .shape = {8, 8}, .offset = 100,
                          .nbytes = sizeof half, .data = half};
    strcpy(t.name, "wq");
    cr_assert_eq(kv_model_bind(m, KV_W_Q, 0, &t, "m.safetensors", &err), KV_OK);
    for (int i = 0; i < 64; i++) cr_assert_eq(m->layers[0].w[KV_W_Q][i], (float)f16_ref(half[i]));
    t.shape[0] = 4;
    cr_assert_eq(kv_model_bind(m, KV_W_Q, 0, &t, "m.safetensors", &err), KV_EFORMAT);
    char buf[512];
    kv_err_format(&err, buf, sizeof buf, 0);
    cr_assert_str_eq(buf, "m.safetensors: offset 100: tensor 'wq' has shape [4, 8] but the config "
                          "implies [8, 8] for the q projection");
    t.dtype = KV_DTYPE_I32;
    cr_assert_eq(kv_model_bind(m, KV_W_Q, 0, &t, "m.safetensors", &err), KV_EUNSUPPORTED);
    cr_assert_str_eq(err.msg, "tensor 'wq' has dtype I32; kvcal loads only F32, F16, BF16 and the "
                              "quantized types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, "
                              "Q5_K and Q6_K");
    /* aligned f32 is a view, not a copy */
    float f[8];
    struct kv_tensor n1 = {.dtype = KV_DTYPE_F32, .ndim = 1, .shape = {8}, .data = f};
    strcpy(n1.name, "norm");
    cr_assert_eq(kv_model_bind(m, KV_W_ATTN_NORM, 0, &n1, "m", &err), KV_OK);
    cr_assert_eq(m->layers[0].w[KV_W_ATTN_NORM], f);
    /* non-finite weights are refused with the element's byte offset */
    float bad[8] = {1, 1, 1, 1, 1, 0, 1, 1};
    bad[5] = INFINITY;
    struct kv_tensor n2 = {.dtype = KV_DTYPE_F32, .ndim = 1, .shape = {8}, .offset = 64, .data = bad};
    strcpy(n2.name, "ffn_norm");
    cr_assert_eq(kv_model_bind(m, KV_W_FFN_NORM, 0, &n2, "m.safetensors", &err), KV_ENUMERIC);
    kv_err_format(&err, buf, sizeof buf, 0);
    cr_assert_str_eq(buf, "m.safetensors: offset 84: tensor 'ffn_norm' element 5 is inf");
    uint16_t hnan[8] = {0x3c00, 0x7e00, 0, 0, 0, 0, 0, 0};
    struct kv_tensor n3 = {.dtype = KV_DTYPE_F16, .ndim = 1, .shape = {8}, .offset = 10, .data = hnan};
    strcpy(n3.name, "ffn_norm");
    cr_assert_eq(kv_model_bind(m, KV_W_FFN_NORM, 0, &n3, "m.safetensors", &err), KV_ENUMERIC);
    cr_assert_eq(err.off, 12);
    cr_assert_str_eq(err.msg, "tensor 'ffn_norm' element 1 is nan");
    cr_assert_eq(kv_model_finish(m, "m.safetensors", &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "missing tensor for the token embedding");
    kv_model_close(m);
}

Test(model, random_model_is_deterministic_and_counts_params) {
    struct kv_config c = cfg();
    struct kv_model *a, *b;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(&c, 9, &a, &err), KV_OK);
    cr_assert_eq(kv_model_init_random(&c, 9, &b, &err), KV_OK);
    cr_assert_eq(memcmp(a->layers[0].w[KV_W_K], b->layers[0].w[KV_W_K], 4 * 8 * sizeof(float)), 0);
    /* per layer: q 64 + k 32 + v 32 + o 64 + ffn 3*96 + norms 16; emb 80 + out norm 8 */
    cr_assert_eq(kv_model_n_params(a), 64 + 32 + 32 + 64 + 288 + 16 + 80 + 8);
    kv_model_close(a);
    kv_model_close(b);
    kv_model_close(NULL);
}
