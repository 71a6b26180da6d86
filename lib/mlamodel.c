/* The MLA form of a model's attention (mlamodel.h). */
#include <stdlib.h>

#include "mlamodel.h"

void kv_mla_free(struct kv_mla *mla) {
    if (!mla) return;
    for (int64_t l = 0; mla->layers && l < mla->n_layers; l++) {
        struct kv_mla_layer *y = &mla->layers[l];
        free(y->wq), free(y->wkv_a), free(y->kv_norm), free(y->wk_b), free(y->wv_b);
    }
    free(mla->layers);
    free(mla);
}

struct kv_mla_info kv_mla_info(const struct kv_mla *mla) {
    return (struct kv_mla_info){mla->kv_lora_rank, mla->rope_dim, mla->nope_dim,
                                mla->v_dim,        mla->rope_base, mla->latent_eps};
}
