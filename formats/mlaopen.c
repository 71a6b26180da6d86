/* The attention of what kvcal export --mla wrote (a GGUF deepseek2 file
 * or an HF DeepseekV2ForCausalLM directory), read back as a struct kv_mla
 * for the model it was made from (kvcal verify --mla). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "gguf.h"
#include "json.h"
#include "kvformats.h"
#include "mapfile.h"
#include "mlamodel.h"
#include "model.h"
#include "safetensors.h"

/* Tensor t (called name) of n elements as float32, copied into *out; a
 * dtype other than F32, F16 or BF16, or a value that is not finite, is
 * refused naming the file and the element's offset. */
static int take_f32(const struct kv_tensor *t, const char *path, const char *name, uint64_t info_off,
                    int64_t n, float **out, struct kv_err *err) {
    if (t->block_type || (t->dtype != KV_DTYPE_F32 && t->dtype != KV_DTYPE_F16 && t->dtype != KV_DTYPE_BF16))
        return kv_fail(err, KV_EUNSUPPORTED, path, info_off,
                       "tensor '%s' is of type %s; kvcal reads F32, F16 or BF16 here", name,
                       t->block_type ? "block-quantized" : kv_dtype_name(t->dtype));
    float *f = malloc((size_t)n * sizeof *f);
    if (!f) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    kv_convert_to_f32(t->dtype, t->data, f, n);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(f[i])) {
            double bad = f[i];
            free(f);
            uint64_t at = t->offset + (uint64_t)i * (t->dtype == KV_DTYPE_F32 ? 4 : 2);
            return kv_fail(err, KV_ENUMERIC, path, at, "tensor '%s' holds %g at element %lld", name,
                           bad, (long long)i);
        }
    *out = f;
    return KV_OK;
}

/* The model's fingerprint against the one the export stored (stored, of
 * len bytes; NULL: absent). */
static int check_base(const char *path, const char *key, const char *stored, size_t len,
                      const struct kv_model *m, char fp[65], struct kv_err *err) {
    if (!stored)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "no %s: kvcal runs the deepseek2 files of its own export --mla, with the "
                       "weights of the model they were made from", key);
    int rc = kv_model_fingerprint(m, fp, err);
    if (rc) return rc;
    if (len != 64 || memcmp(stored, fp, 64))
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "made from another model (fingerprint %.12s..., the given model's %.12s...)",
                       len >= 12 ? stored : "?", fp);
    return KV_OK;
}

static int new_mla(int64_t L, const char *path, struct kv_mla **out, struct kv_err *err) {
    struct kv_mla *mla = calloc(1, sizeof *mla);
    if (!mla || !(mla->layers = calloc((size_t)L, sizeof *mla->layers))) {
        free(mla);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    mla->n_layers = L;
    *out = mla;
    return KV_OK;
}

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
    if (!t->has_dtype)
        return kv_fail(err, KV_EUNSUPPORTED, path, t->info_off,
                       "tensor '%s' is of ggml type %u; kvcal reads F32, F16 or BF16 here", name,
                       t->ggml_type);
    return take_f32(&t->t, path, name, t->info_off, a * b * c, out, err);
}

static int gguf_open(const char *path, const struct kv_model *m, struct kv_mla **out,
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
    s = (struct kv_gguf_str){0};
    if (kv_gguf_find(g, "kvcal.mla.base_fingerprint") &&
        (rc = kv_gguf_get_str(g, "kvcal.mla.base_fingerprint", &s, err)))
        goto done;
    if ((rc = check_base(path, "kvcal.mla.base_fingerprint", s.p, s.len, m, fp, err))) goto done;
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
    if ((rc = new_mla(L, path, &mla, err))) goto done;
    mla->latent_eps = eps, mla->n_heads = H, mla->kv_lora_rank = dc, mla->rope_dim = R;
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

/* Layer l's "model.layers.l.self_attn.<suffix>" of the HF directory's
 * weights st, of shape [rows, cols] (cols 0: a vector), as float32. */
static int hf_tensor(const struct kv_st_file *st, const char *path, int64_t l, const char *suffix,
                     int64_t rows, int64_t cols, float **out, struct kv_err *err) {
    char name[160];
    snprintf(name, sizeof name, "model.layers.%lld.self_attn.%s", (long long)l, suffix);
    const struct kv_tensor *t = kv_st_find(st, name);
    if (!t) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "tensor '%s' is missing", name);
    int nd = cols ? 2 : 1;
    if (t->ndim != nd || t->shape[0] != rows || (cols && t->shape[1] != cols)) {
        char got[128], want[128];
        int64_t w[2] = {rows, cols};
        return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s' has shape %s, expected %s for this model",
                       name, kv_shape_str(got, sizeof got, t->shape, t->ndim),
                       kv_shape_str(want, sizeof want, w, nd));
    }
    return take_f32(t, path, name, 8, rows * (cols ? cols : 1), out, err);
}

/* An HF DeepseekV2ForCausalLM directory of kvcal export --mla: config.json
 * and model.safetensors, read the way transformers' DeepseekV2Attention
 * reads them (kv_b_proj rows per head: qk_nope_head_dim of keys, then
 * v_head_dim of values). */
static int hf_open(const char *dir, const struct kv_model *m, struct kv_mla **out,
                   struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    char *cpath = kv_path_join(dir, "config.json"), *wpath = kv_path_join(dir, "model.safetensors");
    json_t *cfg = NULL;
    struct kv_st_file *st = NULL;
    struct kv_mla *mla = NULL;
    int rc = !cpath || !wpath ? kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory")
                              : kv_json_load(cpath, &cfg, err);
    const char *type = NULL;
    if (!rc) rc = kv_json_get_str(cfg, "model_type", cpath, 1, &type, err);
    if (!rc && strcmp(type, "deepseek_v2"))
        rc = kv_fail(err, KV_EFORMAT, cpath, KV_NO_OFFSET,
                     "model_type is '%.64s', not 'deepseek_v2' (kvcal export --mla writes it)", type);
    int64_t L = 0, H = 0, kvh = 0, dc = 0, R = 0, n = 0, v = 0, dense = 0;
    double eps = 0, theta = 0;
    if (!rc)
        (void)((rc = kv_json_get_int(cfg, "num_hidden_layers", cpath, 1, INT32_MAX, 1, &L, err)) ||
         (rc = kv_json_get_int(cfg, "num_attention_heads", cpath, 1, INT32_MAX, 1, &H, err)) ||
         (rc = kv_json_get_int(cfg, "num_key_value_heads", cpath, 1, INT32_MAX, 1, &kvh, err)) ||
         (rc = kv_json_get_int(cfg, "kv_lora_rank", cpath, 1, INT32_MAX, 1, &dc, err)) ||
         (rc = kv_json_get_int(cfg, "qk_rope_head_dim", cpath, 2, INT32_MAX, 1, &R, err)) ||
         (rc = kv_json_get_int(cfg, "qk_nope_head_dim", cpath, 1, INT32_MAX, 1, &n, err)) ||
         (rc = kv_json_get_int(cfg, "v_head_dim", cpath, 1, INT32_MAX, 1, &v, err)) ||
         (rc = kv_json_get_int(cfg, "first_k_dense_replace", cpath, 0, INT32_MAX, 1, &dense, err)) ||
         (rc = kv_json_get_num(cfg, "rms_norm_eps", cpath, 1, 1, &eps, err)) ||
         (rc = kv_json_get_num(cfg, "rope_theta", cpath, 1, 1, &theta, err)));
    if (!rc) {
        const json_t *ql = json_object_get(cfg, "q_lora_rank"), *rs = json_object_get(cfg, "rope_scaling");
        const json_t *ab = json_object_get(cfg, "attention_bias");
        if ((ql && !json_is_null(ql)) || (rs && !json_is_null(rs)) || (ab && !json_is_false(ab)))
            rc = kv_fail(err, KV_EFORMAT, cpath, KV_NO_OFFSET,
                         "q_lora_rank, rope_scaling or attention_bias is set: kvcal export --mla "
                         "writes none");
    }
    if (!rc && (L != c->n_layers || H != c->n_heads || kvh != H || v != c->head_dim || R % 2 ||
                dense < L || (float)eps != c->norm_eps))
        rc = kv_fail(err, KV_EFORMAT, cpath, KV_NO_OFFSET,
                     "%lld layers (%lld dense), %lld heads (%lld kv), values of %lld, rope dims %lld, "
                     "epsilon %g do not fit the model (%lld layers, %lld heads of %lld, epsilon %g)",
                     (long long)L, (long long)dense, (long long)H, (long long)kvh, (long long)v,
                     (long long)R, eps, (long long)c->n_layers, (long long)c->n_heads,
                     (long long)c->head_dim, (double)c->norm_eps);
    if (!rc) rc = kv_st_open(wpath, &st, err);
    char fp[65];
    const char *stored = st ? kv_st_meta(st, "kvcal.mla.base_fingerprint") : NULL;
    if (!rc) rc = check_base(wpath, "kvcal.mla.base_fingerprint", stored, stored ? strlen(stored) : 0, m, fp, err);
    const char *le = st ? kv_st_meta(st, "kvcal.mla.latent_norm_eps") : NULL;
    char *end = NULL;
    double latent_eps = le ? strtod(le, &end) : 0;
    if (!rc && (!le || *end || !(latent_eps > 0 && latent_eps < 1)))
        rc = kv_fail(err, KV_EFORMAT, wpath, KV_NO_OFFSET,
                     "metadata kvcal.mla.latent_norm_eps is %s%.32s%s, expected a number in (0, 1)",
                     le ? "'" : "", le ? le : "missing", le ? "'" : "");
    if (!rc) rc = new_mla(L, wpath, &mla, err);
    if (!rc) {
        mla->n_heads = H, mla->kv_lora_rank = dc, mla->rope_dim = R, mla->nope_dim = n;
        mla->v_dim = v, mla->rope_base = (float)theta, mla->latent_eps = (float)latent_eps;
        memcpy(mla->base_fingerprint, fp, sizeof fp);
    }
    int64_t d = c->dim;
    for (int64_t l = 0; l < L && !rc; l++) {
        struct kv_mla_layer *y = &mla->layers[l];
        float *kvb = NULL;
        if ((rc = hf_tensor(st, wpath, l, "q_proj.weight", H * (n + R), d, &y->wq, err)) ||
            (rc = hf_tensor(st, wpath, l, "kv_a_proj_with_mqa.weight", dc + R, d, &y->wkv_a, err)) ||
            (rc = hf_tensor(st, wpath, l, "kv_a_layernorm.weight", dc, 0, &y->kv_norm, err)) ||
            (rc = hf_tensor(st, wpath, l, "kv_b_proj.weight", H * (n + v), dc, &kvb, err)))
            break;
        y->wk_b = malloc((size_t)(H * dc * n) * sizeof *y->wk_b);
        y->wv_b = malloc((size_t)(H * v * dc) * sizeof *y->wv_b);
        if (!y->wk_b || !y->wv_b) {
            free(kvb);
            rc = kv_fail(err, KV_ENOMEM, wpath, KV_NO_OFFSET, "out of memory");
            break;
        }
        for (int64_t h = 0; h < H; h++) {
            const float *rows = kvb + h * (n + v) * dc; /* head h: n key rows, then v value rows */
            for (int64_t j = 0; j < n; j++)
                for (int64_t r = 0; r < dc; r++) y->wk_b[(h * dc + r) * n + j] = rows[j * dc + r];
            memcpy(y->wv_b + h * v * dc, rows + n * dc, (size_t)(v * dc) * sizeof *y->wv_b);
        }
        free(kvb);
    }
    json_decref(cfg);
    kv_st_close(st);
    free(cpath), free(wpath);
    if (rc) {
        kv_mla_free(mla);
        return rc;
    }
    *out = mla;
    return KV_OK;
}

int kv_mla_open(const char *path, const struct kv_model *m, struct kv_mla **out,
                struct kv_err *err) {
    return kv_path_kind(path) == 1 ? hf_open(path, m, out, err) : gguf_open(path, m, out, err);
}
