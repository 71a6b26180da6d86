/* SHA-256 (nettle) and the model fingerprint. */
#include <nettle/sha2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "model.h"

static void hex_digest(struct sha256_ctx *ctx, char hex[65]) {
    uint8_t d[SHA256_DIGEST_SIZE];
    sha256_digest(ctx, sizeof d, d);
    for (int i = 0; i < SHA256_DIGEST_SIZE; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

/* nettle takes size_t lengths; feed in 1 GiB pieces anyway to bound each call. */
static void update(struct sha256_ctx *ctx, const void *data, size_t len) {
    const uint8_t *p = data;
    while (len) {
        size_t k = len < ((size_t)1 << 30) ? len : ((size_t)1 << 30);
        sha256_update(ctx, k, p);
        p += k;
        len -= k;
    }
}

void kv_sha256_hex(const void *data, size_t len, char hex[65]) {
    struct sha256_ctx ctx;
    sha256_init(&ctx);
    if (len) update(&ctx, data, len);
    hex_digest(&ctx, hex);
}

static void put_u64(struct sha256_ctx *ctx, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
    sha256_update(ctx, 8, b);
}

static void put_f32(struct sha256_ctx *ctx, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    put_u64(ctx, u);
}

static void put_str(struct sha256_ctx *ctx, const char *s) {
    put_u64(ctx, strlen(s));
    sha256_update(ctx, strlen(s), (const uint8_t *)s);
}

/* One weight: its canonical name, shape and the bytes of its f32 values in
 * little-endian order (the host order on every platform kvcal builds for). */
#define FP_SLICE (1 << 20) /* floats per thread converted at a time */

struct fp_item {
    char name[48];
    int64_t shape[2];
    int nd;
    int kind;
    int64_t layer;
    uint8_t digest[SHA256_DIGEST_SIZE];
};

int kv_model_fingerprint(const struct kv_model *m, char hex[65], struct kv_err *err) {
    if (m->fingerprint[0]) {
        memcpy(hex, m->fingerprint, 65);
        return KV_OK;
    }
    const struct kv_config *c = &m->cfg;
    int64_t cap = KV_W_FIRST_LAYER + c->n_layers * (KV_W_COUNT - KV_W_FIRST_LAYER), n = 0;
    struct fp_item *it = calloc((size_t)cap, sizeof *it);
    if (!it) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    struct sha256_ctx ctx;
    sha256_init(&ctx);
    put_str(&ctx, "kvcal.fingerprint.v1");
    /* the config fields that change what the weights compute */
    put_u64(&ctx, (uint64_t)c->arch);
    put_u64(&ctx, (uint64_t)c->dim);
    put_u64(&ctx, (uint64_t)c->hidden_dim);
    put_u64(&ctx, (uint64_t)c->n_layers);
    put_u64(&ctx, (uint64_t)c->n_heads);
    put_u64(&ctx, (uint64_t)c->n_kv_heads);
    put_u64(&ctx, (uint64_t)c->head_dim);
    put_u64(&ctx, (uint64_t)c->vocab_size);
    put_f32(&ctx, c->norm_eps);
    put_f32(&ctx, c->rope_theta);
    put_u64(&ctx, (uint64_t)c->rope_layout);
    put_u64(&ctx, (uint64_t)c->tied_embeddings);
    put_u64(&ctx, (uint64_t)c->has_qkv_bias);
    if (c->sliding_window > 0) { /* absent from fingerprints made before windows */
        put_str(&ctx, "sliding_window");
        put_u64(&ctx, (uint64_t)c->sliding_window);
        put_u64(&ctx, (uint64_t)c->window_from);
        put_u64(&ctx, (uint64_t)c->window_period);
    }
    if (c->rope_dim || c->parallel_residual || c->gelu_erf) { /* GPT-NeoX's (absent before it) */
        put_str(&ctx, "gpt_neox");
        put_u64(&ctx, (uint64_t)c->rope_dim);
        put_u64(&ctx, (uint64_t)c->parallel_residual);
        put_u64(&ctx, (uint64_t)c->gelu_erf);
    }
    if (c->attn_scale || c->attn_softcap || c->final_softcap || c->norm_offset) { /* Gemma 2's */
        put_str(&ctx, "gemma2");
        put_f32(&ctx, c->attn_scale);
        put_f32(&ctx, c->attn_softcap);
        put_f32(&ctx, c->final_softcap);
        put_f32(&ctx, c->norm_offset);
    }
    const struct kv_rope_scaling_cfg *rs = &c->rope_scaling;
    if (rs->type != KV_ROPE_SCALING_NONE) { /* absent from fingerprints made before scaling */
        put_str(&ctx, "rope_scaling");
        put_u64(&ctx, (uint64_t)rs->type);
        put_u64(&ctx, (uint64_t)rs->original_ctx);
        put_u64(&ctx, (uint64_t)rs->truncate);
        put_u64(&ctx, (uint64_t)rs->n_factors);
        const double p[] = {rs->factor,    rs->low_freq_factor, rs->high_freq_factor,
                            rs->beta_fast, rs->beta_slow,       rs->attention_factor};
        for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) put_f32(&ctx, (float)p[i]);
        for (int64_t i = 0; i < rs->n_factors; i++) {
            put_f32(&ctx, rs->short_factor[i]);
            put_f32(&ctx, rs->long_factor[i]);
        }
    }
    for (int k = 0; k < KV_W_COUNT; k++) {
        int64_t nl = k < KV_W_FIRST_LAYER ? 1 : c->n_layers;
        for (int64_t l = 0; l < nl; l++) {
            int has = !(k == KV_W_LM_HEAD && c->tied_embeddings) && kv_model_has(m, k, l);
            if (!has) continue; /* absent biases; a tied head is the embedding */
            struct fp_item *p = &it[n++];
            p->nd = kv_model_expected_shape(c, k, p->shape);
            if (p->nd == 1) p->shape[1] = 1;
            p->kind = k, p->layer = l;
            if (k < KV_W_FIRST_LAYER)
                snprintf(p->name, sizeof p->name, "%s", kv_wkind_name(k));
            else
                snprintf(p->name, sizeof p->name, "blk.%lld.%s", (long long)l, kv_wkind_name(k));
        }
    }
    /* each weight hashed on its own (in parallel), then the list in order:
     * its f32 values, read a slice of rows at a time (a streamed model
     * converts them from the file, so memory stays bounded) */
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float *buf = malloc((size_t)FP_SLICE * sizeof *buf);
        bad |= !buf;
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < n; i++) {
            if (!buf) continue;
            struct sha256_ctx t;
            sha256_init(&t);
            int64_t rows = it[i].shape[0], cols = it[i].shape[1];
            if (it[i].nd == 1) rows = 1, cols = it[i].shape[0];
            if (!kv_model_is_streamed(m)) { /* resident: hash the weight in place */
                update(&t, kv_model_weight(m, (enum kv_wkind)it[i].kind, it[i].layer),
                       (size_t)(rows * cols) * sizeof(float));
                sha256_digest(&t, SHA256_DIGEST_SIZE, it[i].digest);
                continue;
            }
            int64_t step = FP_SLICE / cols > 0 ? FP_SLICE / cols : 1;
            for (int64_t r0 = 0; r0 < rows; r0 += step) {
                int64_t nr = rows - r0 < step ? rows - r0 : step;
                kv_model_rows(m, (enum kv_wkind)it[i].kind, it[i].layer, r0, nr, buf);
                update(&t, buf, (size_t)(nr * cols) * sizeof(float));
            }
            sha256_digest(&t, SHA256_DIGEST_SIZE, it[i].digest);
        }
        free(buf);
    }
    if (bad) {
        free(it);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    for (int64_t i = 0; i < n; i++) {
        put_str(&ctx, it[i].name);
        put_u64(&ctx, (uint64_t)it[i].shape[0]);
        put_u64(&ctx, (uint64_t)it[i].shape[1]);
        sha256_update(&ctx, SHA256_DIGEST_SIZE, it[i].digest);
    }
    free(it);
    hex_digest(&ctx, hex);
    /* the weights are immutable once loaded: remember it for the next call */
    memcpy(((struct kv_model *)m)->fingerprint, hex, 65);
    return KV_OK;
}
