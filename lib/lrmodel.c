/* The compressed-attention description (struct kv_lowrank): lifetime and
 * KV byte accounting. */
#include <stdlib.h>

#include "err.h"
#include "model.h"

const char *kv_lr_mode_name(enum kv_lr_mode m) {
    switch (m) {
    case KV_LR_FULL: return "full";
    case KV_LR_PREROPE_LATENT: return "prerope_latent";
    case KV_LR_FUSED_QUERY: return "fused_query";
    case KV_LR_FUSED_OUTPUT: return "fused_output";
    case KV_LR_POSTROPE_ROTATION: return "postrope_rotation";
    }
    return "?";
}

static void side_free(struct kv_lr_side *s) {
    for (int64_t u = 0; u < s->n_units; u++) {
        struct kv_lr_unit *x = &s->units[u];
        free(x->down), free(x->down_bias), free(x->up), free(x->rot);
    }
    free(s->units);
}

void kv_lowrank_free(struct kv_lowrank *lr) {
    if (!lr) return;
    if (lr->layers)
        for (int64_t l = 0; l < lr->n_layers; l++) {
            side_free(&lr->layers[l].k);
            side_free(&lr->layers[l].v);
            free(lr->layers[l].o_fused);
        }
    free(lr->layers);
    free(lr);
}

int64_t kv_lowrank_base_bytes(const struct kv_config *cfg) {
    return cfg->n_layers * 2 * cfg->n_kv_heads * cfg->head_dim * 2;
}

int64_t kv_lr_unit_bytes(int64_t rank, int kv_bits) {
    if (kv_bits >= 16) return 2 * rank;
    return (rank * kv_bits + 7) / 8 + 4; /* packed codes + fp16 scale + fp16 zero */
}

static int64_t side_bytes(const struct kv_lowrank *lr, const struct kv_lr_side *s, int kv_bits) {
    if (s->mode == KV_LR_FULL) return lr->n_kv_heads * lr->head_dim * 2;
    int64_t b = 0;
    for (int64_t u = 0; u < s->n_units; u++) b += kv_lr_unit_bytes(s->units[u].rank, kv_bits);
    return b;
}

int64_t kv_lowrank_bytes(const struct kv_lowrank *lr, int kv_bits) {
    int64_t b = 0;
    for (int64_t l = 0; l < lr->n_layers; l++)
        b += side_bytes(lr, &lr->layers[l].k, kv_bits) + side_bytes(lr, &lr->layers[l].v, kv_bits);
    return b;
}
