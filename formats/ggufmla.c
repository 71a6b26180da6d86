/* The attention of a GGUF deepseek2 file written by kvcal export --mla,
 * read back as a struct kv_mla for the model it was made from (kvcal
 * verify --mla). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "gguf.h"
#include "kvformats.h"
#include "mlamodel.h"
#include "model.h"

/* Tensor suffix of layer l, of nd dims, as float32 rows [a][b][c] (ne =
 * {c, b, a}), copied into *out. */
static int read_tensor(const struct kv_gguf_file *g, const char *path, int64_t l, const char *suffix,
                       int nd, int64_t a, int64_t b, int64_t c, float **out, struct kv_err *err) {
    char name[128];
    snprintf(name, sizeof name, "blk.%lld.%s", (long long)l, suffix);
    const struct kv_gguf_tensor *t = kv_gguf_find_tensor(g, name);
    if (!t) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "tensor '%s' is missing", name);
    int64_t want[3] = {c, b, a}, got = 1;
    for (int d = 0; d < t->n_dims; d++) got *= t->ne[d];
    int same = t->n_dims == nd;
    for (int d = 0; same && d < nd; d++) same = t->ne[d] == want[d];
    if (!same)
        return kv_fail(err, KV_EFORMAT, path, t->info_off, "tensor '%s' has %lld elements in %d dims, "
                       "expected [%lld, %lld, %lld] for this model", name, (long long)got, t->n_dims,
                       (long long)a, (long long)b, (long long)c);
    if (!t->has_dtype || (t->t.dtype != KV_DTYPE_F32 && t->t.dtype != KV_DTYPE_F16 && t->t.dtype != KV_DTYPE_BF16))
        return kv_fail(err, KV_EUNSUPPORTED, path, t->info_off,
                       "tensor '%s' is of ggml type %u; kvcal reads F32, F16 or BF16 here", name,
                       t->ggml_type);
    int64_t n = a * b * c;
    float *f = malloc((size_t)n * sizeof *f);
    if (!f) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    kv_convert_to_f32(t->t.dtype, t->t.data, f, n);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(f[i])) {
            double bad = f[i];
            free(f);
            uint64_t at = t->t.offset + (uint64_t)i * (t->t.dtype == KV_DTYPE_F32 ? 4 : 2);
            return kv_fail(err, KV_ENUMERIC, path, at, "tensor '%s' holds %g at element %lld", name,
                           bad, (long long)i);
        }
    *out = f;
    return KV_OK;
}

int kv_mla_gguf_open(const char *path, const struct kv_model *m, struct kv_mla **out,
                     struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    struct kv_gguf_file *g;
    int rc = kv_gguf_open(path, &g, err);
    if (rc) return rc;
    struct kv_gguf_str s;
    struct kv_mla *mla = NULL;
    char fp[65];
    if ((rc = kv_gguf_get_str(g, "general.architecture", &s, err))) goto done;
    if (s.len != 9 || memcmp(s.p, "deepseek2", 9)) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "general.architecture is '%.*s', not 'deepseek2' (kvcal export --mla writes it)",
                     (int)(s.len < 64 ? s.len : 64), s.p);
        goto done;
    }
    if (!kv_gguf_find(g, "kvcal.mla.base_fingerprint")) {
        rc = kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                     "no kvcal.mla.base_fingerprint: kvcal runs the deepseek2 files of its own "
                     "export --mla, with the weights of the model they were made from");
        goto done;
    }
    if ((rc = kv_gguf_get_str(g, "kvcal.mla.base_fingerprint", &s, err)) ||
        (rc = kv_model_fingerprint(m, fp, err)))
        goto done;
    if (s.len != 64 || memcmp(s.p, fp, 64)) {
        rc = kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                     "made from another model (fingerprint %.12s..., the given model's %.12s...)",
                     s.len >= 12 ? s.p : "?", fp);
        goto done;
    }
    uint32_t L, H, dc, R, kmla, vmla, qlora;
    float base, eps;
    if ((rc = kv_gguf_get_u32(g, "deepseek2.block_count", &L, err)) ||
        (rc = kv_gguf_get_u32(g, "deepseek2.attention.head_count", &H, err)) ||
        (rc = kv_gguf_get_u32(g, "deepseek2.attention.kv_lora_rank", &dc, err)) ||
        (rc = kv_gguf_get_u32(g, "deepseek2.rope.dimension_count", &R, err)) ||
        (rc = kv_gguf_get_u32(g, "deepseek2.attention.key_length_mla", &kmla, err)) ||
        (rc = kv_gguf_get_u32(g, "deepseek2.attention.value_length_mla", &vmla, err)) ||
        (rc = kv_gguf_get_u32(g, "deepseek2.attention.q_lora_rank", &qlora, err)) ||
        (rc = kv_gguf_get_f32(g, "deepseek2.rope.freq_base", &base, err)) ||
        (rc = kv_gguf_get_f32(g, "deepseek2.attention.layer_norm_rms_epsilon", &eps, err)))
        goto done;
    if (L != c->n_layers || H != c->n_heads || vmla != c->head_dim || qlora != 0 || kmla <= R ||
        R < 2 || R % 2 || dc < 1 || eps != c->norm_eps) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "%u layers, %u heads, values of %u, q_lora_rank %u, epsilon %g do not fit the "
                     "model (%lld layers, %lld heads of %lld, epsilon %g)",
                     L, H, vmla, qlora, (double)eps, (long long)c->n_layers, (long long)c->n_heads,
                     (long long)c->head_dim, (double)c->norm_eps);
        goto done;
    }
    mla = calloc(1, sizeof *mla);
    if (!mla || !(mla->layers = calloc(L, sizeof *mla->layers))) {
        rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        goto done;
    }
    mla->n_layers = L, mla->n_heads = H, mla->kv_lora_rank = dc, mla->rope_dim = R;
    mla->nope_dim = kmla - R, mla->v_dim = vmla, mla->rope_base = base;
    memcpy(mla->base_fingerprint, fp, sizeof fp);
    int64_t d = c->dim, n = kmla - R;
    for (int64_t l = 0; l < L && !rc; l++) {
        struct kv_mla_layer *y = &mla->layers[l];
        if ((rc = read_tensor(g, path, l, "attn_q.weight", 2, 1, H * (n + R), d, &y->wq, err)) ||
            (rc = read_tensor(g, path, l, "attn_kv_a_mqa.weight", 2, 1, dc + R, d, &y->wkv_a, err)) ||
            (rc = read_tensor(g, path, l, "attn_kv_a_norm.weight", 1, 1, 1, dc, &y->kv_norm, err)) ||
            (rc = read_tensor(g, path, l, "attn_k_b.weight", 3, H, dc, n, &y->wk_b, err)) ||
            (rc = read_tensor(g, path, l, "attn_v_b.weight", 3, H, vmla, dc, &y->wv_b, err)))
            break;
    }
done:
    kv_gguf_close(g);
    if (rc) {
        kv_mla_free(mla);
        return rc;
    }
    *out = mla;
    return KV_OK;
}
