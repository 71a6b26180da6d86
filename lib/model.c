#include "model.h"
#include "arch.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "ggmlquant.h"
#include "limits.h"
#include "tokenizer.h"

static const struct {
    const char *name;
    size_t size;
} dtype_info[KV_DTYPE_COUNT] = {
    [KV_DTYPE_F32] = {"F32", 4}, [KV_DTYPE_F16] = {"F16", 2},   [KV_DTYPE_BF16] = {"BF16", 2},
    [KV_DTYPE_F64] = {"F64", 8}, [KV_DTYPE_I8] = {"I8", 1},     [KV_DTYPE_I16] = {"I16", 2},
    [KV_DTYPE_I32] = {"I32", 4}, [KV_DTYPE_I64] = {"I64", 8},   [KV_DTYPE_U8] = {"U8", 1},
    [KV_DTYPE_BOOL] = {"BOOL", 1},
};

const char *kv_dtype_name(enum kv_dtype t) {
    return (unsigned)t < KV_DTYPE_COUNT ? dtype_info[t].name : "?";
}
size_t kv_dtype_size(enum kv_dtype t) {
    return (unsigned)t < KV_DTYPE_COUNT ? dtype_info[t].size : 0;
}

int64_t kv_tensor_numel(const struct kv_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static const char *const wkind_names[KV_W_COUNT] = {
    [KV_W_TOK_EMB] = "token embedding", [KV_W_OUT_NORM] = "output norm",
    [KV_W_LM_HEAD] = "output head",     [KV_W_ATTN_NORM] = "attention norm",
    [KV_W_Q] = "q projection",          [KV_W_K] = "k projection",
    [KV_W_V] = "v projection",          [KV_W_O] = "output projection",
    [KV_W_BQ] = "q bias",               [KV_W_BK] = "k bias",
    [KV_W_BV] = "v bias",               [KV_W_FFN_NORM] = "ffn norm",
    [KV_W_GATE] = "ffn gate",           [KV_W_DOWN] = "ffn down",
    [KV_W_UP] = "ffn up",               [KV_W_POS_EMB] = "position embedding",
    [KV_W_OUT_NORM_B] = "output norm bias", [KV_W_ATTN_NORM_B] = "attention norm bias",
    [KV_W_BO] = "output projection bias",   [KV_W_FFN_NORM_B] = "ffn norm bias",
    [KV_W_BUP] = "ffn up bias",             [KV_W_BDOWN] = "ffn down bias",
    [KV_W_QNORM] = "q norm",                [KV_W_KNORM] = "k norm",
    [KV_W_POST_ATTN_NORM] = "post-attention norm", [KV_W_POST_FFN_NORM] = "post-ffn norm",
};

int kv_wkind_use(const struct kv_config *c, enum kv_wkind k) {
    const struct kv_arch_desc *a = kv_arch_desc(c->arch);
    switch (k) {
    case KV_W_LM_HEAD: return c->tied_embeddings ? KV_WUSE_NONE : KV_WUSE_REQUIRED;
    case KV_W_BQ:
    case KV_W_BK:
    case KV_W_BV: return a->qkv_bias;
    case KV_W_GATE: return a->gelu_mlp ? KV_WUSE_NONE : KV_WUSE_REQUIRED;
    case KV_W_POS_EMB: return a->rope ? KV_WUSE_NONE : KV_WUSE_REQUIRED;
    case KV_W_OUT_NORM_B:
    case KV_W_ATTN_NORM_B:
    case KV_W_FFN_NORM_B: return a->layernorm ? KV_WUSE_REQUIRED : KV_WUSE_NONE;
    case KV_W_BO:
    case KV_W_BUP:
    case KV_W_BDOWN: return a->block_biases ? KV_WUSE_REQUIRED : KV_WUSE_NONE;
    case KV_W_QNORM:
    case KV_W_KNORM: return a->qk_norm ? KV_WUSE_REQUIRED : KV_WUSE_NONE;
    case KV_W_POST_ATTN_NORM:
    case KV_W_POST_FFN_NORM: return a->post_norms ? KV_WUSE_REQUIRED : KV_WUSE_NONE;
    case KV_W_COUNT: return KV_WUSE_NONE;
    default: return KV_WUSE_REQUIRED;
    }
}

int kv_wkind_is_stream_norm(enum kv_wkind k) {
    return k == KV_W_OUT_NORM || k == KV_W_ATTN_NORM || k == KV_W_FFN_NORM ||
           k == KV_W_POST_ATTN_NORM || k == KV_W_POST_FFN_NORM;
}

const char *kv_wkind_name(enum kv_wkind kind) {
    return (unsigned)kind < KV_W_COUNT ? wkind_names[kind] : "?";
}

const char *kv_format_name(enum kv_format f) {
    switch (f) {
    case KV_FORMAT_HF: return "hf-safetensors";
    case KV_FORMAT_GGUF: return "gguf";
    case KV_FORMAT_LLAMA2C: return "llama2c";
    case KV_FORMAT_SYNTHETIC: return "synthetic";
    }
    return "?";
}

int kv_model_expected_shape(const struct kv_config *c, enum kv_wkind kind, int64_t s[2]) {
    int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    switch (kind) {
    case KV_W_TOK_EMB:
    case KV_W_LM_HEAD: s[0] = c->vocab_size; s[1] = c->dim; return 2;
    case KV_W_OUT_NORM:
    case KV_W_ATTN_NORM:
    case KV_W_FFN_NORM:
    case KV_W_POST_ATTN_NORM:
    case KV_W_POST_FFN_NORM: s[0] = c->dim; return 1;
    case KV_W_Q: s[0] = qd; s[1] = c->dim; return 2;
    case KV_W_K:
    case KV_W_V: s[0] = kd; s[1] = c->dim; return 2;
    case KV_W_O: s[0] = c->dim; s[1] = qd; return 2;
    case KV_W_BQ: s[0] = qd; return 1;
    case KV_W_BK:
    case KV_W_BV: s[0] = kd; return 1;
    case KV_W_GATE:
    case KV_W_UP: s[0] = c->hidden_dim; s[1] = c->dim; return 2;
    case KV_W_DOWN: s[0] = c->dim; s[1] = c->hidden_dim; return 2;
    case KV_W_POS_EMB: s[0] = c->max_seq_len; s[1] = c->dim; return 2;
    case KV_W_OUT_NORM_B:
    case KV_W_ATTN_NORM_B:
    case KV_W_BO:
    case KV_W_FFN_NORM_B:
    case KV_W_BDOWN: s[0] = c->dim; return 1;
    case KV_W_BUP: s[0] = c->hidden_dim; return 1;
    case KV_W_QNORM:
    case KV_W_KNORM: s[0] = c->head_dim; return 1;
    case KV_W_COUNT: break;
    }
    KV_ASSERT(0);
    return 0;
}

static int check_cfg(const struct kv_config *c, const char *path, struct kv_err *err) {
    struct {
        const char *name;
        int64_t v, max;
    } dims[] = {
        {"dim", c->dim, KV_MAX_DIM},          {"hidden_dim", c->hidden_dim, KV_MAX_DIM},
        {"n_layers", c->n_layers, KV_MAX_LAYERS}, {"n_heads", c->n_heads, KV_MAX_DIM},
        {"n_kv_heads", c->n_kv_heads, KV_MAX_DIM}, {"head_dim", c->head_dim, KV_MAX_DIM},
        {"vocab_size", c->vocab_size, KV_MAX_VOCAB},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v <= 0 || dims[i].v > dims[i].max)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "%s is %lld, expected 1..%lld", dims[i].name, (long long)dims[i].v,
                           (long long)dims[i].max);
    if (c->n_heads % c->n_kv_heads)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "n_heads %lld is not a multiple of n_kv_heads %lld",
                       (long long)c->n_heads, (long long)c->n_kv_heads);
    if (!strcmp(kv_arch_name(c->arch), "?"))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "architecture %d is unknown", (int)c->arch);
    const struct kv_arch_desc *a = kv_arch_desc(c->arch);
    if (c->arch != KV_ARCH_GPTNEOX && (c->rope_dim || c->parallel_residual || c->gelu_erf))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s has no partial rope, parallel residual or erf gelu", a->name);
    if (c->arch != KV_ARCH_GEMMA2 &&
        (c->attn_scale || c->attn_softcap || c->final_softcap || c->norm_offset))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s has no attention scale, soft-capping or norm offset", a->name);
    if (!(c->attn_scale >= 0 && isfinite(c->attn_scale)) ||
        !(c->attn_softcap >= 0 && isfinite(c->attn_softcap)) ||
        !(c->final_softcap >= 0 && isfinite(c->final_softcap)) ||
        (c->norm_offset != 0 && c->norm_offset != 1))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "attention scale %g, soft-caps %g and %g must be finite and not negative, "
                       "norm offset %g 0 or 1",
                       (double)c->attn_scale, (double)c->attn_softcap, (double)c->final_softcap,
                       (double)c->norm_offset);
    if (c->rope_dim < 0 || c->rope_dim > c->head_dim || c->rope_dim % 2)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rope dimensions %lld must be even and within 0..head_dim (%lld)",
                       (long long)c->rope_dim, (long long)c->head_dim);
    if (a->rope && kv_rope_dim(c) > 2 * KV_MAX_ROPE_FACTORS)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "head_dim %lld exceeds %d, the most kvcal rotates", (long long)c->head_dim,
                       2 * KV_MAX_ROPE_FACTORS);
    if (a->rope && c->head_dim % 2)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "head_dim %lld is odd, rope needs pairs",
                       (long long)c->head_dim);
    if (a->mha && c->n_kv_heads != c->n_heads)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s has %lld kv heads for %lld heads, expected them equal", a->name,
                       (long long)c->n_kv_heads, (long long)c->n_heads);
    if (!a->rope && (c->max_seq_len <= 0 || c->max_seq_len > KV_MAX_CTX))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "%s n_positions %lld is outside 1..%d", a->name, (long long)c->max_seq_len,
                       KV_MAX_CTX);
    if (c->n_heads * c->head_dim > KV_MAX_DIM)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "n_heads*head_dim exceeds %d",
                       KV_MAX_DIM);
    if (!(c->norm_eps > 0) || !isfinite(c->norm_eps))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "norm epsilon %g must be positive",
                       (double)c->norm_eps);
    if (a->rope && (!(c->rope_theta > 0) || !isfinite(c->rope_theta)))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "rope theta %g must be positive",
                       (double)c->rope_theta);
    if (c->sliding_window < 0 || c->sliding_window > KV_MAX_CTX || c->window_from < 0 ||
        (c->sliding_window > 0 && c->window_period < 1))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "sliding window %lld (from layer %d, every %d) is out of range",
                       (long long)c->sliding_window, c->window_from, c->window_period);
    if (a->rope) return kv_rope_check(c, path, err);
    if (c->rope_scaling.type != KV_ROPE_SCALING_NONE)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s has no rope to scale", a->name);
    return KV_OK;
}

/* kv_model_streaming's mode, and the f32 size from which mode 0 streams */
static int stream_mode;
#define KV_STREAM_BYTES (2.0 * 1024 * 1024 * 1024)

void kv_model_streaming(int mode) { stream_mode = mode; }
int kv_model_is_streamed(const struct kv_model *m) { return m->streamed; }

int kv_model_create(const struct kv_config *cfg, enum kv_format fmt, const char *path,
                    struct kv_model **out, struct kv_err *err) {
    int rc = check_cfg(cfg, path, err);
    if (rc) return rc;
    struct kv_model *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    m->cfg = *cfg;
    m->format = fmt;
    double bytes = 0;
    for (int k = 0; k < KV_W_COUNT; k++) bytes += 4.0 * kv_model_random_elems(cfg, (enum kv_wkind)k);
    m->streamed = stream_mode > 0 || (stream_mode == 0 && bytes > KV_STREAM_BYTES);
    m->lslot.layer = -1;
    if (m->streamed) {
        pthread_mutex_t *mx = malloc(sizeof *mx);
        if (!mx || pthread_mutex_init(mx, NULL)) {
            free(mx);
            free(m);
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        }
        m->lock = mx;
    }
    m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m->layers) {
        free(m);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    *out = m;
    return KV_OK;
}

static int grow(void **arr, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return 0;
    int64_t nc = *cap ? *cap * 2 : 16;
    while (nc < need) nc *= 2;
    void *p = realloc(*arr, (size_t)nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

int kv_model_on_close(struct kv_model *m, void (*fn)(void *), void *ctx, struct kv_err *err) {
    if (grow((void **)&m->cleanups, &m->cap_cleanups, m->n_cleanups + 1, sizeof *m->cleanups))
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    m->cleanups[m->n_cleanups++] = (struct kv_cleanup){fn, ctx};
    return KV_OK;
}

int kv_model_add_tensors(struct kv_model *m, const struct kv_tensor *t, int64_t n,
                         struct kv_err *err) {
    if (grow((void **)&m->tensors, &m->cap_tensors, m->n_tensors + n, sizeof *m->tensors))
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    if (n > 0) memcpy(m->tensors + m->n_tensors, t, (size_t)n * sizeof *t); /* t may be NULL for none */
    m->n_tensors += n;
    return KV_OK;
}

static float *own_floats(struct kv_model *m, int64_t n) {
    if (grow((void **)&m->owned, &m->cap_owned, m->n_owned + 1, sizeof *m->owned)) return NULL;
    float *p = malloc((size_t)n * sizeof *p);
    if (p) m->owned[m->n_owned++] = p;
    return p;
}

/* The f16 value of h with no branch on its class (a loop of it converts
 * 218 M elements in 0.14 s on 2 cores, against 0.22 s for a decode that
 * branches on subnormals, infinities and NaNs). The exponent and mantissa
 * bits, moved up 13 places, read as an f32 of exponent e - 127 for the
 * f16's e - 15, and multiplying by 2^112 rebiases it exactly; an f16
 * subnormal (e = 0) reads as an f32 subnormal and comes out as the normal
 * number it is. Infinities and NaNs (e = 31) take the f32's all-ones
 * exponent and keep their payload. */
static inline float f16_value(uint16_t h) {
    uint32_t em = h & 0x7fffu, b = em << 13;
    float f;
    memcpy(&f, &b, 4);
    f *= 0x1p112f;
    memcpy(&b, &f, 4);
    b = em >= 0x7c00u ? 0x7f800000u | (em & 0x3ffu) << 13 : b;
    b |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &b, 4);
    return f;
}

float kv_f16_to_f32(uint16_t h) { return f16_value(h); }

float kv_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* one thread's share of kv_convert_to_f32; the host is little-endian (the
 * F32 case copies bytes), so a 16-bit element is read with memcpy. At -O2
 * neither loop is vectorised; on 2 cores BF16 still moves 27 to 31 GB/s of
 * reads and writes, F16 a third of that. */
static void convert_part(enum kv_dtype src, const uint8_t *restrict p, float *restrict out,
                         int64_t n) {
    switch (src) {
    case KV_DTYPE_F32: memcpy(out, p, (size_t)n * 4); break;
    case KV_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = f16_value(h);
        }
        break;
    case KV_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            uint32_t bits = (uint32_t)h << 16;
            memcpy(out + i, &bits, 4);
        }
        break;
    default: KV_ASSERT(0 && "unsupported conversion");
    }
}

void kv_convert_to_f32(enum kv_dtype src, const void *in, float *out, int64_t n) {
    const uint8_t *p = in;
    size_t es = kv_dtype_size(src);
    /* a layer's weights (10^8 elements) are converted before each layer's
     * products: split them over the threads, in chunks of 64 Ki elements */
    const int64_t chunk = 1 << 16;
    if (n < 4 * chunk) {
        convert_part(src, p, out, n);
        return;
    }
    int64_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t e0 = c * chunk, m = n - e0 < chunk ? n - e0 : chunk;
        convert_part(src, p + (size_t)e0 * es, out + e0, m);
    }
}

const char *kv_shape_str(char *buf, size_t cap, const int64_t *s, int nd) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < nd && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
    return buf;
}

static const float **slot(struct kv_model *m, enum kv_wkind kind, int64_t layer) {
    switch (kind) {
    case KV_W_TOK_EMB: return &m->tok_emb;
    case KV_W_OUT_NORM: return &m->out_norm;
    case KV_W_LM_HEAD: return &m->lm_head;
    case KV_W_POS_EMB: return &m->pos_emb;
    case KV_W_OUT_NORM_B: return &m->out_norm_b;
    default: return &m->layers[layer].w[kind];
    }
}

static struct kv_wsrc *src_of(struct kv_model *m, enum kv_wkind kind, int64_t layer) {
    return kind < KV_W_FIRST_LAYER ? &m->gsrc[kind] : &m->layers[layer].src[kind];
}

/* n elements of s starting at element e0 (a whole number of blocks for a
 * block type) as f32 */
static void convert_src(const struct kv_wsrc *s, int64_t e0, int64_t n, float *out) {
    if (s->block_type) {
        int64_t be = kv_ggml_block_elems(s->block_type), bb = kv_ggml_block_bytes(s->block_type);
        const uint8_t *p = (const uint8_t *)s->data + (size_t)(e0 / be * bb);
        KV_ASSERT(e0 % be == 0 && kv_ggml_dequant(s->block_type, p, out, n) == KV_OK);
    } else {
        kv_convert_to_f32(s->dtype, (const uint8_t *)s->data + (size_t)e0 * kv_dtype_size(s->dtype),
                          out, n);
    }
}

/* f32 elements of layer l's streamed weights */
static int64_t layer_src_elems(const struct kv_model *m, int64_t l) {
    int64_t need = 0;
    for (int k = 0; k < KV_W_COUNT; k++) need += m->layers[l].src[k].data ? m->layers[l].src[k].n : 0;
    return need;
}

const float *const *kv_model_layer(const struct kv_model *cm, int64_t l) {
    KV_ASSERT(l >= 0 && l < cm->cfg.n_layers);
    if (!cm->streamed) return cm->layers[l].w;
    struct kv_model *m = (struct kv_model *)cm;
    pthread_mutex_lock(m->lock);
    struct kv_lslot *sl = &m->lslot;
    if (sl->layer != l) { /* one slot: a forward or backward pass visits each layer in turn */
        const struct kv_layer *y = &m->layers[l];
        int64_t need = layer_src_elems(m, l);
        /* kv_model_finish sized the slot for the largest layer */
        KV_ASSERT(need <= sl->cap);
        int64_t off = 0;
        for (int k = 0; k < KV_W_COUNT; k++) {
            if (!y->src[k].data) {
                sl->w[k] = y->w[k];
                continue;
            }
            convert_src(&y->src[k], 0, y->src[k].n, sl->buf + off);
            sl->w[k] = sl->buf + off;
            off += y->src[k].n;
        }
        sl->layer = l;
    }
    pthread_mutex_unlock(m->lock);
    return sl->w;
}

const float *kv_model_weight(const struct kv_model *cm, enum kv_wkind kind, int64_t layer) {
    if ((unsigned)kind >= KV_W_COUNT) return NULL;
    struct kv_model *m = (struct kv_model *)cm;
    if (kind < KV_W_FIRST_LAYER) {
        const float **p = slot(m, kind, 0);
        if (!*p && m->gsrc[kind].data) { /* a streamed global, converted once */
            float *f = own_floats(m, m->gsrc[kind].n);
            KV_ASSERT(f);
            convert_src(&m->gsrc[kind], 0, m->gsrc[kind].n, f);
            *p = f;
            if (m->cfg.tied_embeddings && (kind == KV_W_TOK_EMB || kind == KV_W_LM_HEAD))
                m->tok_emb = m->lm_head = f;
        }
        return *p;
    }
    if (layer < 0 || layer >= m->cfg.n_layers) return NULL;
    return kv_model_layer(m, layer)[kind];
}

int kv_model_has(const struct kv_model *m, enum kv_wkind kind, int64_t layer) {
    if ((unsigned)kind >= KV_W_COUNT) return 0;
    if (kind >= KV_W_FIRST_LAYER && (layer < 0 || layer >= m->cfg.n_layers)) return 0;
    struct kv_model *mm = (struct kv_model *)m;
    return *slot(mm, kind, kind < KV_W_FIRST_LAYER ? 0 : layer) != NULL ||
           src_of(mm, kind, layer)->data != NULL;
}

void kv_model_rows(const struct kv_model *cm, enum kv_wkind kind, int64_t layer, int64_t r0,
                   int64_t n, float *out) {
    struct kv_model *m = (struct kv_model *)cm;
    const float *w = *slot(m, kind, kind < KV_W_FIRST_LAYER ? 0 : layer);
    const struct kv_wsrc *s = src_of(m, kind, layer);
    int64_t shp[2];
    int nd = kv_model_expected_shape(&m->cfg, kind, shp);
    int64_t cols = nd == 2 ? shp[1] : shp[0];
    if (w)
        memcpy(out, w + r0 * cols, (size_t)(n * cols) * sizeof *out);
    else if (s->data)
        convert_src(s, r0 * cols, n * cols, out);
    else
        KV_ASSERT(0 && "rows of an absent weight");
}

float *kv_model_weight_mut(struct kv_model *m, enum kv_wkind kind, int64_t layer) {
    return (float *)kv_model_weight(m, kind, layer);
}

int kv_model_bind(struct kv_model *m, enum kv_wkind kind, int64_t layer,
                  const struct kv_tensor *t, const char *path, struct kv_err *err) {
    KV_ASSERT((unsigned)kind < KV_W_COUNT);
    KV_ASSERT(kind < KV_W_FIRST_LAYER || (layer >= 0 && layer < m->cfg.n_layers));
    int blocks = t->dtype == KV_DTYPE_COUNT && t->block_type && kv_ggml_can_dequant(t->block_type);
    if (t->dtype != KV_DTYPE_F32 && t->dtype != KV_DTYPE_F16 && t->dtype != KV_DTYPE_BF16 && !blocks)
        return kv_fail(err, KV_EUNSUPPORTED, path, t->offset,
                       "tensor '%s' has dtype %s; kvcal loads only F32, F16, BF16 and the "
                       "quantized types " KV_GGML_LOADABLE,
                       t->name, t->dtype == KV_DTYPE_COUNT ? "quantized" : kv_dtype_name(t->dtype));
    int64_t want[2];
    int nd = kv_model_expected_shape(&m->cfg, kind, want);
    int ok = t->ndim == nd;
    for (int i = 0; ok && i < nd; i++) ok = t->shape[i] == want[i];
    if (!ok) {
        char got[96], exp[64];
        kv_shape_str(got, sizeof got, t->shape, t->ndim);
        kv_shape_str(exp, sizeof exp, want, nd);
        return kv_fail(err, KV_EFORMAT, path, t->offset,
                       "tensor '%s' has shape %s but the config implies %s for the %s", t->name,
                       got, exp, kv_wkind_name(kind));
    }
    int64_t n = kv_tensor_numel(t);
    const float *w;
    int view = t->dtype == KV_DTYPE_F32 && ((uintptr_t)t->data % _Alignof(float)) == 0;
    if (!view && m->streamed) { /* kept as stored, checked for finite values a chunk at a time */
        struct kv_wsrc s = {t->data, t->dtype, blocks ? t->block_type : 0, n, nd == 2 ? want[1] : want[0]};
        int64_t chunk = 1 << 16, be = blocks ? kv_ggml_block_elems(t->block_type) : 1;
        chunk = (chunk + be - 1) / be * be;
        float *tmp = malloc((size_t)chunk * sizeof *tmp);
        if (!tmp) return kv_fail(err, KV_ENOMEM, path, t->offset, "out of memory checking '%s'", t->name);
        for (int64_t e0 = 0; e0 < n; e0 += chunk) {
            int64_t c = n - e0 < chunk ? n - e0 : chunk;
            convert_src(&s, e0, c, tmp);
            for (int64_t i = 0; i < c; i++)
                if (!isfinite(tmp[i])) {
                    int64_t e = e0 + i;
                    uint64_t off = blocks ? (uint64_t)(e / be) * (uint64_t)kv_ggml_block_bytes(t->block_type)
                                          : (uint64_t)e * kv_dtype_size(t->dtype);
                    const char *what = isnan(tmp[i]) ? "nan" : "inf";
                    free(tmp);
                    return kv_fail(err, KV_ENUMERIC, path, t->offset + off,
                                   "tensor '%s' element %lld is %s", t->name, (long long)e, what);
                }
        }
        free(tmp);
        *src_of(m, kind, layer) = s;
        *slot(m, kind, layer) = NULL;
        return KV_OK;
    }
    if (view) {
        w = t->data; /* view into the mapping */
    } else {
        float *p = own_floats(m, n);
        if (!p) return kv_fail(err, KV_ENOMEM, path, t->offset, "out of memory converting '%s'", t->name);
        if (blocks)
            KV_ASSERT(kv_ggml_dequant(t->block_type, t->data, p, n) == KV_OK); /* sized by the parser */
        else
            kv_convert_to_f32(t->dtype, t->data, p, n);
        w = p;
    }
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(w[i])) {
            /* a quantized element's offset is its block's */
            uint64_t off = blocks ? (uint64_t)(i / kv_ggml_block_elems(t->block_type)) *
                                        (uint64_t)kv_ggml_block_bytes(t->block_type)
                                  : (uint64_t)i * kv_dtype_size(t->dtype);
            return kv_fail(err, KV_ENUMERIC, path, t->offset + off,
                           "tensor '%s' element %lld is %s", t->name, (long long)i,
                           isnan(w[i]) ? "nan" : "inf");
        }
    *slot(m, kind, layer) = w;
    return KV_OK;
}

int kv_model_finish(struct kv_model *m, const char *path, struct kv_err *err) {
    if (m->cfg.tied_embeddings && !kv_model_has(m, KV_W_LM_HEAD, 0))
        m->lm_head = m->tok_emb, m->gsrc[KV_W_LM_HEAD] = m->gsrc[KV_W_TOK_EMB];
    if (!kv_model_has(m, KV_W_TOK_EMB, 0) && kv_model_has(m, KV_W_LM_HEAD, 0) && m->cfg.tied_embeddings)
        m->tok_emb = m->lm_head, m->gsrc[KV_W_TOK_EMB] = m->gsrc[KV_W_LM_HEAD];
    for (int k = 0; k < KV_W_FIRST_LAYER; k++)
        if (kv_wkind_use(&m->cfg, k) == KV_WUSE_REQUIRED && !kv_model_has(m, k, 0))
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "missing tensor for the %s",
                           kv_wkind_name(k));
    for (int64_t l = 0; l < m->cfg.n_layers; l++)
        for (int k = KV_W_FIRST_LAYER; k < KV_W_COUNT; k++) {
            if (kv_wkind_use(&m->cfg, k) == KV_WUSE_REQUIRED && !kv_model_has(m, k, l))
                return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                               "missing tensor for the %s of layer %lld", kv_wkind_name(k),
                               (long long)l);
        }
    int any_bias = 0;
    for (int64_t l = 0; l < m->cfg.n_layers; l++)
        any_bias |= kv_model_has(m, KV_W_BQ, l) || kv_model_has(m, KV_W_BK, l) ||
                    kv_model_has(m, KV_W_BV, l);
    m->cfg.has_qkv_bias = any_bias;
    if (m->streamed) { /* the one layer slot, allocated now so a pass cannot fail halfway */
        int64_t need = 0;
        for (int64_t l = 0; l < m->cfg.n_layers; l++) {
            int64_t e = layer_src_elems(m, l);
            if (e > need) need = e;
        }
        float *b = need > m->lslot.cap ? realloc(m->lslot.buf, (size_t)need * sizeof *b) : m->lslot.buf;
        if (need > m->lslot.cap && !b)
            return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET,
                           "out of memory for one layer's weights as f32 (%.1f MiB)",
                           (double)need * 4.0 / 1048576.0);
        if (need > m->lslot.cap) m->lslot.buf = b, m->lslot.cap = need, m->lslot.layer = -1;
    }
    if (m->tok && kv_tok_n_vocab(m->tok) > m->cfg.vocab_size)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "tokenizer has %d pieces but the model's vocabulary is %lld",
                       kv_tok_n_vocab(m->tok), (long long)m->cfg.vocab_size);
    return KV_OK;
}

void kv_model_close(struct kv_model *m) {
    if (!m) return;
    kv_tok_free(m->tok);
    for (int64_t i = m->n_cleanups - 1; i >= 0; i--) m->cleanups[i].fn(m->cleanups[i].ctx);
    for (int64_t i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->lslot.buf);
    if (m->lock) {
        pthread_mutex_destroy(m->lock);
        free(m->lock);
    }
    free(m->cleanups);
    free(m->tensors);
    free(m->layers);
    free(m);
}

const struct kv_config *kv_model_config(const struct kv_model *m) { return &m->cfg; }
enum kv_format kv_model_format(const struct kv_model *m) { return m->format; }
const struct kv_tokenizer *kv_model_tokenizer(const struct kv_model *m) { return m->tok; }
int64_t kv_model_n_tensors(const struct kv_model *m) { return m->n_tensors; }
const struct kv_tensor *kv_model_tensor(const struct kv_model *m, int64_t i) {
    return i >= 0 && i < m->n_tensors ? &m->tensors[i] : NULL;
}

int64_t kv_model_n_params(const struct kv_model *m) {
    const struct kv_config *c = &m->cfg;
    int64_t s[2], n = 0;
    for (int k = 0; k < KV_W_COUNT; k++) {
        if (kv_wkind_use(c, k) == KV_WUSE_NONE) continue;
        if (kv_wkind_use(c, k) == KV_WUSE_OPTIONAL && !kv_model_has(m, k, 0)) continue;
        int nd = kv_model_expected_shape(c, k, s);
        n += (nd == 2 ? s[0] * s[1] : s[0]) * (k < KV_W_FIRST_LAYER ? 1 : c->n_layers);
    }
    return n;
}

/* splitmix64: a seeded, platform-independent stream for synthetic weights. */
static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill_normal(float *p, int64_t n, float stdev, uint64_t *s) {
    for (int64_t i = 0; i < n; i += 2) { /* Box-Muller */
        double u1 = ((splitmix(s) >> 11) + 1.0) * 0x1.0p-53, u2 = (splitmix(s) >> 11) * 0x1.0p-53;
        double r = sqrt(-2.0 * log(u1));
        p[i] = (float)(stdev * r * cos(2 * M_PI * u2));
        if (i + 1 < n) p[i + 1] = (float)(stdev * r * sin(2 * M_PI * u2));
    }
}

double kv_model_random_elems(const struct kv_config *cfg, enum kv_wkind kind) {
    int use = kv_wkind_use(cfg, kind);
    if (use == KV_WUSE_NONE || (use == KV_WUSE_OPTIONAL && !cfg->has_qkv_bias)) return 0;
    int64_t shp[2];
    int nd = kv_model_expected_shape(cfg, kind, shp);
    return (nd == 2 ? (double)shp[0] * (double)shp[1] : (double)shp[0]) *
           (double)(kind < KV_W_FIRST_LAYER ? 1 : cfg->n_layers);
}

int kv_model_init_random(const struct kv_config *cfg, uint64_t seed, struct kv_model **out,
                         struct kv_err *err) {
    struct kv_model *m;
    int rc = kv_model_create(cfg, KV_FORMAT_SYNTHETIC, "synthetic", &m, err);
    if (rc) return rc;
    uint64_t s = seed;
    for (int k = 0; k < KV_W_COUNT; k++) {
        int64_t nl = k < KV_W_FIRST_LAYER ? 1 : cfg->n_layers;
        double total = kv_model_random_elems(cfg, k);
        if (total == 0) continue;
        int64_t n = (int64_t)(total / (double)nl);
        for (int64_t l = 0; l < nl; l++) {
            float *p = own_floats(m, n);
            if (!p) {
                kv_model_close(m);
                return kv_fail(err, KV_ENOMEM, "synthetic", KV_NO_OFFSET, "out of memory");
            }
            int is_norm = kv_wkind_is_stream_norm(k) || k == KV_W_QNORM || k == KV_W_KNORM;
            /* gains of 1: Gemma's stored w is the gain minus norm_offset (not the q/k norms') */
            float one = k == KV_W_QNORM || k == KV_W_KNORM ? 1.0f : 1.0f - cfg->norm_offset;
            /* GPT-2 keeps every weight random (biases included) so tests see them */
            if (is_norm)
                for (int64_t i = 0; i < n; i++) p[i] = one;
            else
                fill_normal(p, n, 0.02f, &s);
            *slot(m, k, l) = p;
        }
    }
    rc = kv_model_finish(m, "synthetic", err);
    if (rc) {
        kv_model_close(m);
        return rc;
    }
    *out = m;
    return KV_OK;
}

/* ---------------------------------------------------------------- f32 to f16 / bf16 */

uint16_t kv_f32_to_f16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint16_t sign = (uint16_t)(bits >> 16 & 0x8000);
    uint32_t a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) { /* NaN: keep the top payload bits, never all zero */
        uint16_t man = (uint16_t)(a >> 13 & 0x3ff);
        return (uint16_t)(sign | 0x7c00 | (man ? man : 0x200));
    }
    /* 65520 = 65504 + half an ulp; the tie goes to the even neighbour, 2^16 */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);
    if (a >= 0x38800000u) { /* normal: 2^-14 and up */
        uint32_t r = a - ((uint32_t)(127 - 15) << 23); /* rebias the exponent */
        /* round the 13 dropped bits to nearest even; a carry moves into the
         * exponent, which is the correctly rounded result */
        r += 0xfffu + (r >> 13 & 1);
        return (uint16_t)(sign | r >> 13);
    }
    /* subnormal or zero: the result counts units of 2^-24. |x| = m 2^(e-150)
     * with the implicit bit in m, so |x| / 2^-24 = m >> (126 - e). */
    uint32_t e = a >> 23;
    if (e < 102) return sign; /* below 2^-25 (e = 102 is [2^-25, 2^-24)) */
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t s = 126 - e;      /* 14..24 */
    uint32_t q = m >> s, rem = m & ((1u << s) - 1), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1))) q++; /* q may reach 0x400, the smallest normal */
    return (uint16_t)(sign | q);
}

uint16_t kv_f32_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN: truncate, keeping it a NaN */
        uint16_t h = (uint16_t)(bits >> 16);
        return (h & 0x7f) ? h : (uint16_t)(h | 0x40);
    }
    /* round the low 16 bits to nearest even; past the largest finite value
     * the carry reaches the all-ones exponent, which is inf */
    bits += 0x7fffu + (bits >> 16 & 1);
    return (uint16_t)(bits >> 16);
}

void kv_convert_from_f32(enum kv_dtype dst, const float *in, void *out, int64_t n) {
    uint8_t *p = out;
    switch (dst) {
    case KV_DTYPE_F32: memcpy(out, in, (size_t)n * 4); break; /* little-endian host */
    case KV_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = kv_f32_to_f16(in[i]);
            p[2 * i] = (uint8_t)(h & 0xff);
            p[2 * i + 1] = (uint8_t)(h >> 8);
        }
        break;
    case KV_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = kv_f32_to_bf16(in[i]);
            p[2 * i] = (uint8_t)(h & 0xff);
            p[2 * i + 1] = (uint8_t)(h >> 8);
        }
        break;
    default: KV_ASSERT(0 && "unsupported conversion");
    }
}

int kv_shapes_match(const struct kv_config *c, int64_t n_layers, int64_t dim, int64_t n_heads,
                    int64_t n_kv_heads, int64_t head_dim, const char *what, const char *path,
                    struct kv_err *err) {
    if (n_layers == c->n_layers && dim == c->dim && n_heads == c->n_heads &&
        n_kv_heads == c->n_kv_heads && head_dim == c->head_dim)
        return 1;
    kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
            "%s are for %lld layers, dim %lld, %lld heads (%lld kv) of %lld, but the model has "
            "%lld layers, dim %lld, %lld heads (%lld kv) of %lld",
            what, (long long)n_layers, (long long)dim, (long long)n_heads, (long long)n_kv_heads,
            (long long)head_dim, (long long)c->n_layers, (long long)c->dim, (long long)c->n_heads,
            (long long)c->n_kv_heads, (long long)c->head_dim);
    return 0;
}
