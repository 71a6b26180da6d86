#include "hfwrite.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arch.h"
#include "err.h"
#include "hfdir.h"
#include "mapfile.h"
#include "mlamodel.h"
#include "model.h"
#include "pretok.h"
#include "ropejson.h"
#include "stwrite.h"

/* ================================================================ config.json */

/* The shortest decimal that reads back as f, as a double (so config.json
 * says 1e-05, not 9.9999997473787516e-06). */
static double short_float(float f) {
    char buf[32];
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, (double)f);
        if (strtof(buf, NULL) == f) break;
    }
    return strtod(buf, NULL);
}

static int jset(json_t *o, const char *key, json_t *v) { return json_object_set_new(o, key, v); }

/* o as config.json text (indented, ending in a newline) into *out, o
 * released; bad: a member could not be set (out of memory). */
static int config_dump(json_t *o, int bad, char **out, struct kv_err *err) {
    char *text = bad ? NULL : json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(9));
    json_decref(o);
    char *t2 = text ? realloc(text, strlen(text) + 2) : NULL;
    if (!t2) {
        free(text);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    strcat(t2, "\n");
    *out = t2;
    return KV_OK;
}

int kv_hf_config_text(const struct kv_config *c, char **out, struct kv_err *err) {
    int gpt2 = c->arch == KV_ARCH_GPT2;
    if (gpt2 && c->head_dim * c->n_heads != c->dim)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "gpt2 with %lld heads of %lld for dim %lld has no HF config (n_embd / "
                       "n_head is the head size)",
                       (long long)c->n_heads, (long long)c->head_dim, (long long)c->dim);
    const struct kv_arch_desc *a = kv_arch_desc(c->arch);
    json_t *o = json_object(), *arch = json_array();
    int bad = !o || !arch || json_array_append_new(arch, json_string(a->hf_class));
    bad |= jset(o, "architectures", arch);
    bad |= jset(o, "model_type", json_string(a->name));
    if (gpt2) {
        bad |= jset(o, "n_embd", json_integer(c->dim));
        bad |= jset(o, "n_layer", json_integer(c->n_layers));
        bad |= jset(o, "n_head", json_integer(c->n_heads));
        bad |= jset(o, "n_inner", json_integer(c->hidden_dim));
        bad |= jset(o, "n_positions", json_integer(c->max_seq_len));
        bad |= jset(o, "n_ctx", json_integer(c->max_seq_len));
        bad |= jset(o, "vocab_size", json_integer(c->vocab_size));
        bad |= jset(o, "layer_norm_epsilon", json_real(short_float(c->norm_eps)));
        bad |= jset(o, "activation_function", json_string("gelu_new"));
    } else if (c->arch == KV_ARCH_GEMMA2) { /* Gemma2Config */
        if (c->rope_scaling.type != KV_ROPE_SCALING_NONE || c->rope_dim ||
            (c->sliding_window && (c->window_from || c->window_period != 2))) {
            json_decref(o);
            return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                           "a gemma2 model with rope scaling, or windows other than every even "
                           "layer, has no config.json form");
        }
        bad |= jset(o, "hidden_size", json_integer(c->dim));
        bad |= jset(o, "intermediate_size", json_integer(c->hidden_dim));
        bad |= jset(o, "num_hidden_layers", json_integer(c->n_layers));
        bad |= jset(o, "num_attention_heads", json_integer(c->n_heads));
        bad |= jset(o, "num_key_value_heads", json_integer(c->n_kv_heads));
        bad |= jset(o, "head_dim", json_integer(c->head_dim));
        bad |= jset(o, "vocab_size", json_integer(c->vocab_size));
        bad |= jset(o, "max_position_embeddings", json_integer(c->max_seq_len));
        bad |= jset(o, "rms_norm_eps", json_real(short_float(c->norm_eps)));
        bad |= jset(o, "rope_theta", json_real(short_float(c->rope_theta)));
        bad |= jset(o, "hidden_activation", json_string("gelu_pytorch_tanh"));
        /* scale = qpas^-1/2: qpas = 1 / scale², the shortest decimal that reads back */
        double sc = kv_attn_scale(c);
        bad |= jset(o, "query_pre_attn_scalar", json_real(short_float((float)(1.0 / (sc * sc)))));
        bad |= jset(o, "attn_logit_softcapping",
                    c->attn_softcap > 0 ? json_real(short_float(c->attn_softcap)) : json_null());
        bad |= jset(o, "final_logit_softcapping",
                    c->final_softcap > 0 ? json_real(short_float(c->final_softcap)) : json_null());
        bad |= jset(o, "sliding_window",
                    c->sliding_window ? json_integer(c->sliding_window) : json_null());
        bad |= jset(o, "attention_bias", json_false());
    } else if (c->arch == KV_ARCH_GPTNEOX) { /* GPTNeoXConfig, in transformers 4.x's keys */
        if (c->rope_scaling.type == KV_ROPE_SCALING_FREQS) {
            json_decref(o);
            return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                           "rope scaling by per-pair divisors (a GGUF rope_freqs tensor) has no "
                           "config.json form");
        }
        bad |= jset(o, "hidden_size", json_integer(c->dim));
        bad |= jset(o, "intermediate_size", json_integer(c->hidden_dim));
        bad |= jset(o, "num_hidden_layers", json_integer(c->n_layers));
        bad |= jset(o, "num_attention_heads", json_integer(c->n_heads));
        bad |= jset(o, "vocab_size", json_integer(c->vocab_size));
        bad |= jset(o, "max_position_embeddings", json_integer(c->max_seq_len));
        bad |= jset(o, "layer_norm_eps", json_real(short_float(c->norm_eps)));
        bad |= jset(o, "rotary_emb_base", json_real(short_float(c->rope_theta)));
        /* exact: int(d_h * pct) is rope_dim for pct = rope_dim / d_h */
        bad |= jset(o, "rotary_pct", json_real((double)kv_rope_dim(c) / (double)c->head_dim));
        bad |= jset(o, "rope_scaling", kv_rope_json_write(&c->rope_scaling));
        bad |= jset(o, "use_parallel_residual", json_boolean(c->parallel_residual));
        bad |= jset(o, "hidden_act", json_string(c->gelu_erf ? "gelu" : "gelu_new"));
        bad |= jset(o, "attention_bias", json_true());
    } else {
        bad |= jset(o, "hidden_size", json_integer(c->dim));
        bad |= jset(o, "intermediate_size", json_integer(c->hidden_dim));
        bad |= jset(o, "num_hidden_layers", json_integer(c->n_layers));
        bad |= jset(o, "num_attention_heads", json_integer(c->n_heads));
        bad |= jset(o, "num_key_value_heads", json_integer(c->n_kv_heads));
        bad |= jset(o, "head_dim", json_integer(c->head_dim));
        bad |= jset(o, "vocab_size", json_integer(c->vocab_size));
        if (c->max_seq_len > 0)
            bad |= jset(o, "max_position_embeddings", json_integer(c->max_seq_len));
        bad |= jset(o, "rms_norm_eps", json_real(short_float(c->norm_eps)));
        bad |= jset(o, "rope_theta", json_real(short_float(c->rope_theta)));
        if (c->rope_scaling.type == KV_ROPE_SCALING_FREQS) {
            json_decref(o);
            return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                           "rope scaling by per-pair divisors (a GGUF rope_freqs tensor) has no "
                           "config.json form");
        }
        bad |= jset(o, "rope_scaling", kv_rope_json_write(&c->rope_scaling));
        bad |= jset(o, "hidden_act", json_string("silu"));
        /* the window keys each config class reads (absent, MistralConfig
         * would default to a window of 4096) */
        if (c->arch == KV_ARCH_MISTRAL || c->arch == KV_ARCH_PHI3)
            bad |= jset(o, "sliding_window",
                        c->sliding_window ? json_integer(c->sliding_window) : json_null());
        if (c->arch == KV_ARCH_QWEN2 || c->arch == KV_ARCH_QWEN3) {
            bad |= jset(o, "use_sliding_window", json_boolean(c->sliding_window > 0));
            bad |= jset(o, "sliding_window",
                        c->sliding_window ? json_integer(c->sliding_window) : json_null());
            bad |= jset(o, "max_window_layers", json_integer(c->window_from));
        }
        if (c->sliding_window && (c->window_period > 1 || (c->arch != KV_ARCH_QWEN2 && c->arch != KV_ARCH_QWEN3 && c->window_from))) {
            json_decref(o);
            return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                           "a %s model windowed every %d layers from layer %d has no config.json "
                           "form",
                           kv_arch_name(c->arch), c->window_period, c->window_from);
        }
        bad |= jset(o, "attention_bias", json_boolean(c->has_qkv_bias));
        bad |= jset(o, "mlp_bias", json_false());
    }
    bad |= jset(o, "tie_word_embeddings", json_boolean(c->tied_embeddings));
    bad |= jset(o, "bos_token_id", c->bos_id >= 0 ? json_integer(c->bos_id) : json_null());
    bad |= jset(o, "eos_token_id", c->eos_id >= 0 ? json_integer(c->eos_id) : json_null());
    return config_dump(o, bad, out, err);
}

/* kv_write_atomic's fill: a NUL-terminated text. */
static int fill_text(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    const char *s = ctx;
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            char eb[128];
            return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                           kv_errtext(w < 0 ? errno : EIO, eb, sizeof eb));
        }
        s += w, n -= (size_t)w;
    }
    return KV_OK;
}

/* ================================================================ weights */

/* HF row of kvcal's q/k row r: rotate-half order within each head of d_h
 * for a model with interleaved rope pairs, else r itself. */
static int64_t hf_row(const struct kv_config *c, enum kv_wkind k, int64_t r) {
    int qk = k == KV_W_Q || k == KV_W_K || k == KV_W_BQ || k == KV_W_BK;
    if (!kv_arch_desc(c->arch)->rope || c->rope_layout != KV_ROPE_INTERLEAVED || !qk) return r;
    int64_t dh = c->head_dim, j = r % dh, half = kv_rope_dim(c) / 2;
    if (j >= 2 * half) return r; /* partial rope: the unturned dimensions stay */
    return r - j + (j % 2 ? half + j / 2 : j / 2);
}

/* A streamed model's weight, produced while the file is written: its rows
 * converted from the model file, in its stored F16 or BF16 (exact), else
 * F32. */
struct wfill {
    const struct kv_model *m;
    enum kv_wkind kind;
    int64_t layer, cols;
    enum kv_dtype dtype;
};

static int fill_weight(void *ctx, uint64_t off, uint64_t n, void *out, struct kv_err *err) {
    const struct wfill *f = ctx;
    size_t es = kv_dtype_size(f->dtype);
    int64_t e0 = (int64_t)(off / es), ne = (int64_t)(n / es);
    int64_t r0 = e0 / f->cols, r1 = (e0 + ne + f->cols - 1) / f->cols;
    float *tmp = malloc((size_t)((r1 - r0) * f->cols) * sizeof *tmp);
    if (!tmp) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    kv_model_rows(f->m, f->kind, f->layer, r0, r1 - r0, tmp);
    kv_convert_from_f32(f->dtype, tmp + (e0 - r0 * f->cols), out, ne);
    free(tmp);
    return KV_OK;
}

int kv_hf_add_model_weight(struct kv_stw *w, const struct kv_model *m, enum kv_wkind kind,
                           int64_t l, const char *name, struct kv_err *err) {
    int64_t shape[2];
    int nd = kv_model_expected_shape(&m->cfg, kind, shape);
    if (!kv_model_is_streamed(m)) {
        const float *data = kv_model_weight(m, kind, l);
        uint64_t n = (uint64_t)shape[0] * (uint64_t)(nd == 2 ? shape[1] : 1);
        return kv_stw_add(w, name, KV_DTYPE_F32, nd, shape, data, n * 4, err);
    }
    const struct kv_wsrc *src = kind < KV_W_FIRST_LAYER ? &m->gsrc[kind] : &m->layers[l].src[kind];
    enum kv_dtype dt = src->data && !src->block_type &&
                               (src->dtype == KV_DTYPE_F16 || src->dtype == KV_DTYPE_BF16)
                           ? src->dtype
                           : KV_DTYPE_F32;
    struct wfill f = {m, kind, l, nd == 2 ? shape[1] : shape[0], dt};
    return kv_stw_add_fn_copy(w, name, dt, nd, shape, fill_weight, &f, sizeof f, err);
}

/* Add table entry e of layer (global entries: layer 0) under name: its
 * kinds stacked along the output axis (interleaved per head when e->heads),
 * then transposed for a Conv1D. An
 * absent optional weight (a Llama bias some layer lacks) is written as
 * zeros. */
static int add_entry(struct kv_stw *w, const struct kv_model *m, const struct kv_arch_tensor *e,
                     int64_t layer, const char *name, enum kv_dtype dtype, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    int64_t rows[3], total, cols;
    int nd = kv_arch_entry_shape(c, e, rows, &total, &cols);
    float *buf = malloc((size_t)(total * cols) * sizeof *buf);
    if (!buf) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for '%s'", name);
    int64_t r0 = 0;
    for (int k = 0; k < e->n_kinds; k++) {
        const float *src = kv_model_weight(m, e->kinds[k], layer);
        /* HF's Gemma stores each RMSNorm gain minus 1 (a model read from
         * GGUF holds the gains themselves: norm_offset 0) */
        float shift = kv_arch_desc(c->arch)->post_norms && c->norm_offset == 0 &&
                              kv_wkind_is_stream_norm(e->kinds[k])
                          ? -1.0f
                          : 0.0f;
        for (int64_t r = 0; r < rows[k]; r++) {
            int64_t hr = hf_row(c, e->kinds[k], r), dh = c->head_dim;
            int64_t at = e->heads ? ((hr / dh) * e->n_kinds + k) * dh + hr % dh : r0 + hr;
            float *dst = e->conv ? buf + r0 + r : buf + at * cols;
            int64_t step = e->conv ? total : 1; /* Conv1D: element (r, i) at [i, r0 + r] */
            for (int64_t i = 0; i < cols; i++) dst[i * step] = src ? src[r * cols + i] + shift : 0.0f;
        }
        r0 += rows[k];
    }
    int64_t shape[2] = {e->conv ? cols : total, e->conv ? total : cols};
    int rc = kv_stw_add_f32(w, name, dtype, nd, shape, buf, err);
    free(buf);
    return rc;
}

/* Every weight the model's forward pass uses, under its HF name. */
static int add_weights(struct kv_stw *w, const struct kv_model *m, enum kv_dtype dtype,
                       struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    const struct kv_arch_names *nm = &kv_arch_desc(c->arch)->hf;
    int rc = KV_OK;
    for (int64_t i = 0; !rc && i < nm->n_globals; i++)
        if (kv_wkind_use(c, nm->globals[i].kinds[0]) != KV_WUSE_NONE)
            rc = add_entry(w, m, &nm->globals[i], 0, nm->globals[i].name, dtype, err);
    char name[512];
    for (int64_t l = 0; !rc && l < c->n_layers; l++)
        for (int64_t i = 0; !rc && i < nm->n_layer; i++) {
            int use = kv_wkind_use(c, nm->layer[i].kinds[0]);
            if (use == KV_WUSE_NONE || (use == KV_WUSE_OPTIONAL && !c->has_qkv_bias)) continue;
            snprintf(name, sizeof name, "%s%lld.%s", nm->layer_prefix, (long long)l,
                     nm->layer[i].name);
            rc = add_entry(w, m, &nm->layer[i], l, name, dtype, err);
        }
    return rc;
}

/* ================================================================ directory */

/* dir created when absent (its parent must exist), or already a directory. */
static int make_dir(const char *dir, struct kv_err *err) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        char eb[128];
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot create the directory: %s",
                       kv_errtext(errno, eb, sizeof eb));
    }
    if (kv_path_kind(dir) != 1) return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "not a directory");
    return KV_OK;
}

int kv_hf_write(const struct kv_model *m, const char *dir, enum kv_dtype dtype,
                const char *tokenizer_json_path, struct kv_err *err) {
    if (dtype != KV_DTYPE_F32 && dtype != KV_DTYPE_F16 && dtype != KV_DTYPE_BF16)
        return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                       "cannot write weights as %s, expected F32, F16 or BF16", kv_dtype_name(dtype));
    char *config = NULL;
    int rc = kv_hf_config_text(&m->cfg, &config, err);
    if (rc) return rc;
    rc = make_dir(dir, err);
    char *wpath = kv_path_join(dir, "model.safetensors");
    char *tpath = kv_path_join(dir, "tokenizer.json");
    char *cpath = kv_path_join(dir, "config.json");
    if (!rc && (!wpath || !tpath || !cpath))
        rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    struct kv_stw *w = NULL;
    if (!rc) rc = kv_stw_init(&w, err);
    if (!rc) rc = kv_stw_add_meta(w, "format", "pt", err);
    if (!rc) rc = add_weights(w, m, dtype, err);
    if (!rc) rc = kv_stw_write(w, wpath, err);
    kv_stw_free(w);
    if (!rc && tokenizer_json_path) rc = kv_file_copy(tokenizer_json_path, tpath, err);
    if (!rc) rc = kv_write_atomic(cpath, fill_text, config, err); /* last: the directory is whole */
    free(config), free(wpath), free(tpath), free(cpath);
    return rc;
}

/* ================================================================ MLA directory */

/* config.json of m's model rewritten as mla, in transformers'
 * DeepseekV2Config keys: every layer dense (first_k_dense_replace = layers,
 * no routed experts), no q-LoRA, one key-value head per query head (the
 * keys come from kv_b_proj per head; llama.cpp's converter asserts it). */
static int mla_config_text(const struct kv_config *c, const struct kv_mla *mla, char **out,
                           struct kv_err *err) {
    json_t *o = json_object();
    int bad = !o;
    bad |= jset(o, "architectures", json_pack("[s]", "DeepseekV2ForCausalLM"));
    bad |= jset(o, "model_type", json_string("deepseek_v2"));
    bad |= jset(o, "hidden_size", json_integer(c->dim));
    bad |= jset(o, "intermediate_size", json_integer(c->hidden_dim));
    bad |= jset(o, "moe_intermediate_size", json_integer(c->hidden_dim));
    bad |= jset(o, "num_hidden_layers", json_integer(c->n_layers));
    bad |= jset(o, "first_k_dense_replace", json_integer(c->n_layers));
    bad |= jset(o, "n_routed_experts", json_null());
    bad |= jset(o, "moe_layer_freq", json_integer(1));
    bad |= jset(o, "num_attention_heads", json_integer(mla->n_heads));
    bad |= jset(o, "num_key_value_heads", json_integer(mla->n_heads));
    bad |= jset(o, "q_lora_rank", json_null());
    bad |= jset(o, "kv_lora_rank", json_integer(mla->kv_lora_rank));
    bad |= jset(o, "qk_nope_head_dim", json_integer(mla->nope_dim));
    bad |= jset(o, "qk_rope_head_dim", json_integer(mla->rope_dim));
    bad |= jset(o, "v_head_dim", json_integer(mla->v_dim));
    bad |= jset(o, "vocab_size", json_integer(c->vocab_size));
    if (c->max_seq_len > 0)
        bad |= jset(o, "max_position_embeddings", json_integer(c->max_seq_len));
    bad |= jset(o, "rms_norm_eps", json_real(short_float(c->norm_eps)));
    bad |= jset(o, "rope_theta", json_real(short_float(mla->rope_base)));
    bad |= jset(o, "rope_scaling", json_null());
    bad |= jset(o, "hidden_act", json_string("silu"));
    bad |= jset(o, "attention_bias", json_false());
    bad |= jset(o, "attention_dropout", json_real(0.0));
    bad |= jset(o, "tie_word_embeddings", json_boolean(c->tied_embeddings));
    bad |= jset(o, "bos_token_id", c->bos_id >= 0 ? json_integer(c->bos_id) : json_null());
    bad |= jset(o, "eos_token_id", c->eos_id >= 0 ? json_integer(c->eos_id) : json_null());
    bad |= jset(o, "torch_dtype", json_string("float32"));
    return config_dump(o, bad, out, err);
}

/* The weights: the model's own under their HF names (streamed), its q/k/v
 * replaced by the latent attention's four tensors. */
static int add_mla_weights(struct kv_stw *w, const struct kv_model *m, const struct kv_mla *mla,
                           struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    const struct kv_arch_names *nm = &kv_arch_desc(c->arch)->hf;
    int64_t d = c->dim, H = mla->n_heads, dc = mla->kv_lora_rank, R = mla->rope_dim;
    int64_t n = mla->nope_dim, v = mla->v_dim;
    int rc = KV_OK;
    for (int64_t i = 0; !rc && i < nm->n_globals; i++)
        if (kv_wkind_use(c, nm->globals[i].kinds[0]) != KV_WUSE_NONE)
            rc = kv_hf_add_model_weight(w, m, nm->globals[i].kinds[0], 0, nm->globals[i].name, err);
    float *kvb = malloc((size_t)(H * (n + v) * dc) * sizeof *kvb);
    if (!rc && !kvb) rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    char name[512];
    for (int64_t l = 0; !rc && l < c->n_layers; l++) {
        const struct kv_mla_layer *y = &mla->layers[l];
        for (int64_t i = 0; !rc && i < nm->n_layer; i++) {
            enum kv_wkind k = nm->layer[i].kinds[0];
            if (kv_wkind_use(c, k) == KV_WUSE_NONE || k == KV_W_K || k == KV_W_V || k == KV_W_BQ ||
                k == KV_W_BK || k == KV_W_BV)
                continue;
            snprintf(name, sizeof name, "%s%lld.", nm->layer_prefix, (long long)l);
            size_t at = strlen(name);
            if (k != KV_W_Q) {
                snprintf(name + at, sizeof name - at, "%s", nm->layer[i].name);
                rc = kv_hf_add_model_weight(w, m, k, l, name, err);
                continue;
            }
            /* in q_proj's place: transformers' DeepseekV2Attention's four */
            int64_t sq[2] = {H * (n + R), d}, sa[2] = {dc + R, d}, sn[1] = {dc}, sb[2] = {H * (n + v), dc};
            snprintf(name + at, sizeof name - at, "self_attn.q_proj.weight");
            rc = kv_stw_add(w, name, KV_DTYPE_F32, 2, sq, y->wq, (uint64_t)(sq[0] * d) * 4, err);
            snprintf(name + at, sizeof name - at, "self_attn.kv_a_proj_with_mqa.weight");
            if (!rc) rc = kv_stw_add(w, name, KV_DTYPE_F32, 2, sa, y->wkv_a, (uint64_t)(sa[0] * d) * 4, err);
            snprintf(name + at, sizeof name - at, "self_attn.kv_a_layernorm.weight");
            if (!rc) rc = kv_stw_add(w, name, KV_DTYPE_F32, 1, sn, y->kv_norm, (uint64_t)dc * 4, err);
            /* kv_b_proj: head h's n key rows (W_UK,h = wk_b[h]ᵀ), then its v value rows */
            for (int64_t h = 0; h < H; h++) {
                float *rows = kvb + h * (n + v) * dc;
                for (int64_t j = 0; j < n; j++)
                    for (int64_t r = 0; r < dc; r++) rows[j * dc + r] = y->wk_b[(h * dc + r) * n + j];
                memcpy(rows + n * dc, y->wv_b + h * v * dc, (size_t)(v * dc) * sizeof *rows);
            }
            snprintf(name + at, sizeof name - at, "self_attn.kv_b_proj.weight");
            if (!rc) rc = kv_stw_add_f32(w, name, KV_DTYPE_F32, 2, sb, kvb, err);
        }
    }
    free(kvb);
    return rc;
}

int kv_hf_write_mla(const struct kv_model *m, const struct kv_mla *mla, const char *dir,
                    const char *const *files, int n_files, struct kv_err *err) {
    KV_ASSERT(m && mla && dir && mla->n_layers == m->cfg.n_layers);
    DIR *d = opendir(dir); /* a new directory, or an empty one: nothing replaced */
    for (struct dirent *e; d && (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            closedir(d);
            return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                           "directory exists and is not empty; refusing to replace it");
        }
    if (d) closedir(d);
    char *config = NULL, eps[32];
    int rc = mla_config_text(&m->cfg, mla, &config, err);
    if (!rc) rc = make_dir(dir, err);
    char *wpath = kv_path_join(dir, "model.safetensors"), *cpath = kv_path_join(dir, "config.json");
    if (!rc && (!wpath || !cpath)) rc = kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    struct kv_stw *w = NULL;
    snprintf(eps, sizeof eps, "%.9g", short_float(mla->latent_eps)); /* "1e-05" */
    if (!rc) rc = kv_stw_init(&w, err);
    if (!rc) rc = kv_stw_add_meta(w, "format", "pt", err);
    if (!rc) rc = kv_stw_add_meta(w, "kvcal.mla.base_fingerprint", mla->base_fingerprint, err);
    if (!rc) rc = kv_stw_add_meta(w, "kvcal.mla.latent_norm_eps", eps, err);
    if (!rc) rc = add_mla_weights(w, m, mla, err);
    if (!rc) rc = kv_stw_write(w, wpath, err);
    kv_stw_free(w);
    for (int i = 0; !rc && i < n_files; i++) {
        const char *base = strrchr(files[i], '/');
        char *dst = kv_path_join(dir, base ? base + 1 : files[i]);
        rc = dst ? kv_file_copy(files[i], dst, err)
                 : kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
        free(dst);
    }
    if (!rc) rc = kv_write_atomic(cpath, fill_text, config, err); /* last: the directory is whole */
    free(config), free(wpath), free(cpath);
    return rc;
}

/* ================================================================ tokenizer.json */

/* Write the tokenizer.json both writers make: a BPE model of vocab and
 * merges, added tokens, a pre-tokenizer and decoder, and the template that
 * puts bos (id bos_id) before the text. Takes the references it is given
 * (any NULL: out of memory). */
static int write_tokenizer(const char *path, json_t *vocab, json_t *merges, int byte_fallback,
                           json_t *added, json_t *pre, json_t *dec, const char *bos, int bos_id,
                           struct kv_err *err) {
    json_t *root = json_object(), *model = json_object(), *pp = json_object();
    int bad = !root || !model || !pp || !vocab || !merges || !added || !dec;
    bad |= jset(pp, "type", json_string("TemplateProcessing"));
    bad |= jset(pp, "single", json_pack("[{s:{s:s, s:i}}, {s:{s:s, s:i}}]", "SpecialToken", "id",
                                        bos, "type_id", 0, "Sequence", "id", "A", "type_id", 0));
    bad |= jset(pp, "pair", json_pack("[{s:{s:s, s:i}}, {s:{s:s, s:i}}, {s:{s:s, s:i}}]",
                                      "SpecialToken", "id", bos, "type_id", 0, "Sequence", "id",
                                      "A", "type_id", 0, "Sequence", "id", "B", "type_id", 1));
    bad |= jset(pp, "special_tokens",
                json_pack("{s:{s:s, s:[i], s:[s]}}", bos, "id", bos, "ids", bos_id, "tokens", bos));
    bad |= jset(model, "type", json_string("BPE"));
    bad |= jset(model, "dropout", json_null());
    bad |= jset(model, "unk_token", json_null());
    bad |= jset(model, "continuing_subword_prefix", json_null());
    bad |= jset(model, "end_of_word_suffix", json_null());
    bad |= jset(model, "fuse_unk", json_false());
    bad |= jset(model, "byte_fallback", json_boolean(byte_fallback));
    bad |= jset(model, "ignore_merges", json_false());
    bad |= jset(model, "vocab", vocab);
    bad |= jset(model, "merges", merges);
    bad |= jset(root, "version", json_string("1.0"));
    bad |= jset(root, "truncation", json_null());
    bad |= jset(root, "padding", json_null());
    bad |= jset(root, "added_tokens", added);
    bad |= jset(root, "normalizer", json_null());
    bad |= jset(root, "pre_tokenizer", pre ? pre : json_null());
    bad |= jset(root, "post_processor", pp);
    bad |= jset(root, "decoder", dec);
    bad |= jset(root, "model", model);
    char *text = bad ? NULL : json_dumps(root, JSON_INDENT(2));
    json_decref(root);
    if (!text) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    int rc = kv_write_atomic(path, fill_text, text, err);
    free(text);
    return rc;
}

static json_t *added_token(int id, const char *content) {
    return json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content", content,
                     "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special", 1);
}

int kv_hf_write_bpe_tokenizer(const char *path, const char *const *pieces, const size_t *plen,
                              int32_t n, const int32_t *merges, int32_t n_merges,
                              const char *regex, struct kv_err *err) {
    json_t *vocab = json_object(), *added = json_array(), *mj = json_array();
    int bad = !vocab || !added || !mj;
    char **mapped = calloc((size_t)n, sizeof *mapped);
    bad |= !mapped;
    for (int32_t i = 0; !bad && i < n; i++) {
        if (!(mapped[i] = malloc(2 * plen[i] + 1))) {
            bad = 1;
            break;
        }
        mapped[i][kv_bytelevel_map(pieces[i], plen[i], mapped[i])] = 0;
        bad |= jset(vocab, mapped[i], json_integer(i));
    }
    for (int32_t k = 0; !bad && k < n_merges; k++)
        bad |= json_array_append_new(mj, json_pack("[s, s]", mapped[merges[2 * k]],
                                                   mapped[merges[2 * k + 1]]));
    for (int32_t i = 0; mapped && i < n; i++) free(mapped[i]);
    free(mapped);
    bad |= json_array_append_new(added, added_token(n, "<|begin_of_text|>"));
    bad |= json_array_append_new(added, added_token(n + 1, "<|end_of_text|>"));
    json_t *bl = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0,
                           "trim_offsets", 1, "use_regex", regex == NULL);
    json_t *pre = regex ? json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, o]}", "type", "Sequence",
                                    "pretokenizers", "type", "Split", "pattern", "Regex", regex,
                                    "behavior", "Isolated", "invert", 0, bl)
                        : bl;
    json_t *dec = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1,
                            "trim_offsets", 1, "use_regex", 1);
    if (bad || !pre) {
        json_decref(vocab), json_decref(added), json_decref(mj), json_decref(pre), json_decref(dec);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    return write_tokenizer(path, vocab, mj, 0, added, pre, dec, "<|begin_of_text|>", n, err);
}

int kv_hf_write_byte_tokenizer(const char *path, struct kv_err *err) {
    json_t *vocab = json_object(), *added = json_array();
    int bad = !vocab || !added;
    char piece[8];
    for (int b = 0; !bad && b < 256; b++) {
        snprintf(piece, sizeof piece, "<0x%02X>", b);
        bad |= jset(vocab, piece, json_integer(b));
    }
    bad |= added && json_array_append_new(added, added_token(256, "<s>"));
    bad |= added && json_array_append_new(added, added_token(257, "</s>"));
    if (bad) {
        json_decref(vocab), json_decref(added);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    /* HF adds BOS on encode, as kvcal's windows expect */
    return write_tokenizer(path, vocab, json_array(), 1, added, NULL,
                           json_pack("{s:s, s:[{s:s}, {s:s}]}", "type", "Sequence", "decoders",
                                     "type", "ByteFallback", "type", "Fuse"),
                           "<s>", 256, err);
}
