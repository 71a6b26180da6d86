#include "hfdir.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "err.h"
#include "json.h"
#include "limits.h"
#include "mapfile.h"
#include "ropejson.h"
#include "model.h"
#include "safetensors.h"
#include "tokenizer.h"
#include "tokjson.h"

/* ================================================================ config */

/* bos_token_id / eos_token_id: an id, a list of ids (the first is used), or
 * null. *out is left alone when absent. */

/* A config number the model keeps as a float: one beyond the float range
 * is refused as written, not passed on as inf. */
static int as_float(double v, const char *key, const char *path, float *out, struct kv_err *err) {
    if (fabs(v) > FLT_MAX) {
        char num[32];
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "key '%s' is %s, beyond the range of a float", key,
                       kv_num_str(num, sizeof num, v));
    }
    *out = (float)v;
    return KV_OK;
}

static int get_token_id(const json_t *root, const char *key, const char *path, int32_t *out,
                        struct kv_err *err) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return KV_OK;
    if (json_is_array(v) && json_array_size(v) > 0) v = json_array_get(v, 0);
    if (!json_is_integer(v) || json_integer_value(v) < 0 ||
        json_integer_value(v) >= KV_MAX_VOCAB) {
        char found[64];
        kv_json_repr(json_object_get(root, key), found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key '%s' must be a token id in 0..%d, found %s", key, KV_MAX_VOCAB - 1,
                       found);
    }
    *out = (int32_t)json_integer_value(v);
    return KV_OK;
}

/* 1 when the string array "architectures" lists name. */
static int lists_architecture(const json_t *root, const char *name) {
    size_t i;
    json_t *a;
    json_array_foreach(json_object_get(root, "architectures"), i, a)
        if (json_is_string(a) && strcmp(json_string_value(a), name) == 0) return 1;
    return 0;
}

/* GPT2Config: its keys, and its defaults where real checkpoints omit them. */
static int parse_gpt2_config(const json_t *root, const char *path, struct kv_config *cfg,
                             struct kv_err *err) {
    cfg->arch = KV_ARCH_GPT2;
    const char *act = "gelu_new";
    int rc = kv_json_get_str(root, "activation_function", path, 0, &act, err);
    if (rc) return rc;
    if (strcmp(act, "gelu_new") != 0 && strcmp(act, "gelu_pytorch_tanh") != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "activation_function '%.64s' is not supported, expected 'gelu_new' or "
                       "'gelu_pytorch_tanh'",
                       act);
    int scale = 1, by_layer = 0;
    if ((rc = kv_json_get_bool(root, "scale_attn_weights", path, 0, &scale, err)) ||
        (rc = kv_json_get_bool(root, "scale_attn_by_inverse_layer_idx", path, 0, &by_layer, err)))
        return rc;
    if (!scale)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "scale_attn_weights false is not supported");
    if (by_layer)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "scale_attn_by_inverse_layer_idx true is not supported");
    int64_t dim = 0, layers = 0, heads = 0, vocab = 0, ctx = 0, inner = 0;
    if ((rc = kv_json_get_int(root, "n_embd", path, 1, KV_MAX_DIM, 1, &dim, err)) ||
        (rc = kv_json_get_int(root, "n_layer", path, 1, KV_MAX_LAYERS, 1, &layers, err)) ||
        (rc = kv_json_get_int(root, "n_head", path, 1, KV_MAX_DIM, 1, &heads, err)) ||
        (rc = kv_json_get_int(root, "vocab_size", path, 1, KV_MAX_VOCAB, 1, &vocab, err)) ||
        (rc = kv_json_get_int(root, "n_inner", path, 1, KV_MAX_DIM, 0, &inner, err)) ||
        (rc = kv_json_get_int(root, "n_positions", path, 1, INT32_MAX, 0, &ctx, err)))
        return rc;
    if (!ctx && (rc = kv_json_get_int(root, "n_ctx", path, 1, INT32_MAX, 0, &ctx, err))) return rc;
    if (!ctx) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "missing key 'n_positions'");
    if (dim % heads)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "n_embd %lld is not a multiple of n_head %lld", (long long)dim,
                       (long long)heads);
    double eps = 1e-5;
    int tied = 1;
    if ((rc = kv_json_get_num(root, "layer_norm_epsilon", path, 1, 0, &eps, err)) ||
        (rc = as_float(eps, "layer_norm_epsilon", path, &cfg->norm_eps, err)) ||
        (rc = kv_json_get_bool(root, "tie_word_embeddings", path, 0, &tied, err)) ||
        (rc = get_token_id(root, "bos_token_id", path, &cfg->bos_id, err)) ||
        (rc = get_token_id(root, "eos_token_id", path, &cfg->eos_id, err)))
        return rc;
    cfg->dim = dim;
    cfg->hidden_dim = inner ? inner : 4 * dim;
    cfg->n_layers = layers;
    cfg->n_heads = cfg->n_kv_heads = heads;
    cfg->head_dim = dim / heads;
    cfg->vocab_size = vocab;
    cfg->max_seq_len = ctx;
    cfg->tied_embeddings = tied;
    cfg->has_qkv_bias = 1;
    return KV_OK;
}

/* The sizes Llama-style configs (llama, mistral, qwen, phi3, gpt_neox,
 * gemma2) spell alike; *ctx keeps its default when max_position_embeddings
 * is absent. */
static int read_dims(const json_t *root, const char *path, int64_t *dim, int64_t *hidden,
                     int64_t *layers, int64_t *heads, int64_t *vocab, int64_t *ctx,
                     struct kv_err *err) {
    int rc;
    if ((rc = kv_json_get_int(root, "hidden_size", path, 1, KV_MAX_DIM, 1, dim, err)) ||
        (rc = kv_json_get_int(root, "intermediate_size", path, 1, KV_MAX_DIM, 1, hidden, err)) ||
        (rc = kv_json_get_int(root, "num_hidden_layers", path, 1, KV_MAX_LAYERS, 1, layers, err)) ||
        (rc = kv_json_get_int(root, "num_attention_heads", path, 1, KV_MAX_DIM, 1, heads, err)) ||
        (rc = kv_json_get_int(root, "vocab_size", path, 1, KV_MAX_VOCAB, 1, vocab, err)))
        return rc;
    return kv_json_get_int(root, "max_position_embeddings", path, 1, INT32_MAX, 0, ctx, err);
}

/* The fraction of each head RoPE turns, from whichever keys the config
 * spells it with (transformers 4.x's partial_rotary_factor or GPT-NeoX's
 * rotary_pct, 5.x's rope_parameters.partial_rotary_factor): they must
 * agree; 1 when none is given. */
static int read_partial_rotary(const json_t *root, const char *path, double *out,
                               const char **key_out, struct kv_err *err) {
    static const char *const keys[] = {"partial_rotary_factor", "rotary_pct", NULL};
    const json_t *objs[] = {root, root, json_object_get(root, "rope_parameters")};
    const char *names[] = {"partial_rotary_factor", "rotary_pct",
                           "rope_parameters.partial_rotary_factor"};
    double v = 0;
    int have = -1;
    for (int i = 0; i < 3; i++) {
        const char *key = keys[i] ? keys[i] : "partial_rotary_factor";
        if (!json_is_object(objs[i])) continue;
        double x = 0;
        int rc = kv_json_get_num(objs[i], key, path, 1, 0, &x, err);
        if (rc) return rc;
        if (x == 0) continue;
        if (x > 1)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "%s %g is above 1 (the fraction of each head RoPE turns)", names[i], x);
        if (have >= 0 && x != v)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s %g and %s %g disagree",
                           names[have], v, names[i], x);
        v = x, have = i;
    }
    *out = have >= 0 ? v : 1.0;
    if (key_out) *key_out = have >= 0 ? names[have] : "partial_rotary_factor";
    return KV_OK;
}

/* GPTNeoXConfig (Pythia): its keys in either layout (rotary_emb_base or
 * rope_theta, rotary_pct or partial_rotary_factor), and its defaults where
 * checkpoints omit them (parallel residual, untied head, biases). */
static int parse_neox_config(const json_t *root, const char *path, struct kv_config *cfg,
                             struct kv_err *err) {
    cfg->arch = KV_ARCH_GPTNEOX;
    const char *act = "gelu";
    int rc = kv_json_get_str(root, "hidden_act", path, 0, &act, err);
    if (rc) return rc;
    int erf = !strcmp(act, "gelu");
    if (!erf && strcmp(act, "gelu_new") && strcmp(act, "gelu_fast") &&
        strcmp(act, "gelu_pytorch_tanh"))
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "hidden_act '%.64s' is not supported, expected 'gelu', 'gelu_new', "
                       "'gelu_fast' or 'gelu_pytorch_tanh'",
                       act);
    int64_t dim = 0, hidden = 0, layers = 0, heads = 0, vocab = 0, ctx = 2048;
    if ((rc = read_dims(root, path, &dim, &hidden, &layers, &heads, &vocab, &ctx, err)))
        return rc;
    if (dim % heads)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "hidden_size %lld is not a multiple of num_attention_heads %lld",
                       (long long)dim, (long long)heads);
    double eps = 1e-5, partial = 1, base = 0;
    int tied = 0, parallel = 1, bias = 1;
    if ((rc = kv_json_get_num(root, "layer_norm_eps", path, 1, 0, &eps, err)) ||
        (rc = as_float(eps, "layer_norm_eps", path, &cfg->norm_eps, err)) ||
        (rc = kv_json_get_bool(root, "tie_word_embeddings", path, 0, &tied, err)) ||
        (rc = kv_json_get_bool(root, "use_parallel_residual", path, 0, &parallel, err)) ||
        (rc = kv_json_get_bool(root, "attention_bias", path, 0, &bias, err)) ||
        (rc = kv_json_get_num(root, "rotary_emb_base", path, 1, 0, &base, err)) ||
        (rc = read_partial_rotary(root, path, &partial, NULL, err)) ||
        (rc = kv_rope_json_read(root, path, ctx, cfg, err)) ||
        (rc = get_token_id(root, "bos_token_id", path, &cfg->bos_id, err)) ||
        (rc = get_token_id(root, "eos_token_id", path, &cfg->eos_id, err)))
        return rc;
    if (!bias)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "attention_bias false is not supported: gpt_neox's projections have biases");
    const json_t *rp = json_object_get(root, "rope_parameters");
    int theta_given = (json_object_get(root, "rope_theta") &&
                       !json_is_null(json_object_get(root, "rope_theta"))) ||
                      (json_is_object(rp) && json_object_get(rp, "rope_theta"));
    if (base && theta_given && (float)base != cfg->rope_theta)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rotary_emb_base %.15g and rope_theta %.15g disagree", base,
                       (double)cfg->rope_theta);
    if (base && !theta_given) {
        if (base > FLT_MAX)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "key 'rotary_emb_base' is beyond the range of a float");
        cfg->rope_theta = (float)base;
    }
    int64_t hd = dim / heads, rd = (int64_t)((double)hd * partial); /* HF: int(head_size * pct) */
    if (rd < 2 || rd % 2)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "rotary_pct %g of head_dim %lld gives %lld rotated dimensions, expected an "
                       "even number of at least 2",
                       partial, (long long)hd, (long long)rd);
    cfg->dim = dim;
    cfg->hidden_dim = hidden;
    cfg->n_layers = layers;
    cfg->n_heads = cfg->n_kv_heads = heads;
    cfg->head_dim = hd;
    cfg->vocab_size = vocab;
    cfg->max_seq_len = ctx;
    cfg->tied_embeddings = tied;
    cfg->has_qkv_bias = 1;
    cfg->rope_dim = rd == hd ? 0 : rd;
    cfg->parallel_residual = parallel;
    cfg->gelu_erf = erf;
    return KV_OK;
}

/* A soft-cap of Gemma2Config: its default when absent, none when null. */
static int get_softcap(const json_t *root, const char *key, double dflt, const char *path,
                       float *out, struct kv_err *err) {
    const json_t *v = json_object_get(root, key);
    double x = dflt;
    if (v && json_is_null(v)) x = 0;
    else if (v) {
        int rc = kv_json_get_num(root, key, path, 1, 1, &x, err);
        if (rc) return rc;
    }
    return as_float(x, key, path, out, err);
}

/* An explicit layer_types list (transformers 4.5x and 5.x write one) against
 * the windows the other keys give: a window of win in the layers l >= from
 * with (l - from) % period == 0. *bad is the first layer the list says
 * otherwise of (its entry in *said), or -1; a list of another length or an
 * entry other than full_attention / sliding_attention is an error. */
static int layer_types_differ(const json_t *root, const char *path, int64_t layers, int64_t win,
                              int64_t from, int64_t period, int64_t *bad, const char **said,
                              struct kv_err *err) {
    *bad = -1, *said = NULL;
    json_t *lt = json_object_get(root, "layer_types");
    if (!lt || json_is_null(lt)) return KV_OK;
    if (!json_is_array(lt) || (int64_t)json_array_size(lt) != layers)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "key 'layer_types' must be a list of %lld strings", (long long)layers);
    for (int64_t l = 0; l < layers; l++) {
        const char *t = json_string_value(json_array_get(lt, (size_t)l));
        int sliding = t && !strcmp(t, "sliding_attention");
        if (!t || (!sliding && strcmp(t, "full_attention")))
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "layer_types entry %lld is not 'full_attention' or 'sliding_attention'",
                           (long long)l);
        int want = win > 0 && l >= from && (l - from) % period == 0;
        if (sliding != want) {
            *bad = l, *said = t;
            return KV_OK;
        }
    }
    return KV_OK;
}

/* Gemma2Config: GeGLU with the tanh GELU, query_pre_attn_scalar, the two
 * soft-caps, a window on every even layer, (1 + w) norms, tied head. */
static int parse_gemma2_config(const json_t *root, const char *path, struct kv_config *cfg,
                               struct kv_err *err) {
    cfg->arch = KV_ARCH_GEMMA2;
    const char *act = NULL, *act2 = NULL;
    int rc;
    if ((rc = kv_json_get_str(root, "hidden_activation", path, 0, &act, err)) ||
        (rc = kv_json_get_str(root, "hidden_act", path, 0, &act2, err)))
        return rc;
    if (!act) act = act2 ? act2 : "gelu_pytorch_tanh";
    if (strcmp(act, "gelu_pytorch_tanh") && strcmp(act, "gelu_new") && strcmp(act, "gelu_fast"))
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "hidden_activation '%.64s' is not supported, expected 'gelu_pytorch_tanh'",
                       act);
    int64_t dim = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 256, vocab = 0;
    int64_t ctx = 8192, win = 4096;
    if ((rc = read_dims(root, path, &dim, &hidden, &layers, &heads, &vocab, &ctx, err)) ||
        (rc = kv_json_get_int(root, "head_dim", path, 1, KV_MAX_DIM, 0, &head_dim, err)))
        return rc;
    kv_heads = heads;
    if ((rc = kv_json_get_int(root, "num_key_value_heads", path, 1, KV_MAX_DIM, 0, &kv_heads, err)))
        return rc;
    const json_t *sw = json_object_get(root, "sliding_window");
    if (sw && json_is_null(sw)) win = 0;
    else if ((rc = kv_json_get_int(root, "sliding_window", path, 1, KV_MAX_CTX, 0, &win, err)))
        return rc;
    double eps = 1e-6, qpas = 256, partial = 1;
    const char *pkey;
    int tied = 1, bias = 0;
    if ((rc = kv_json_get_num(root, "rms_norm_eps", path, 1, 0, &eps, err)) ||
        (rc = as_float(eps, "rms_norm_eps", path, &cfg->norm_eps, err)) ||
        (rc = kv_json_get_num(root, "query_pre_attn_scalar", path, 1, 0, &qpas, err)) ||
        (rc = get_softcap(root, "attn_logit_softcapping", 50.0, path, &cfg->attn_softcap, err)) ||
        (rc = get_softcap(root, "final_logit_softcapping", 30.0, path, &cfg->final_softcap, err)) ||
        (rc = kv_json_get_bool(root, "tie_word_embeddings", path, 0, &tied, err)) ||
        (rc = kv_json_get_bool(root, "attention_bias", path, 0, &bias, err)) ||
        (rc = read_partial_rotary(root, path, &partial, &pkey, err)) ||
        (rc = kv_rope_json_read(root, path, ctx, cfg, err)) ||
        (rc = get_token_id(root, "bos_token_id", path, &cfg->bos_id, err)) ||
        (rc = get_token_id(root, "eos_token_id", path, &cfg->eos_id, err)))
        return rc;
    if (bias)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET, "attention_bias true is not supported");
    if (partial != 1)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "%s %g is not supported for model_type 'gemma2'", pkey, partial);
    /* transformers' Gemma 2: layer i slides when i is even; a layer_types
     * list must say the same */
    int64_t bad;
    const char *said;
    if ((rc = layer_types_differ(root, path, layers, win, 0, 2, &bad, &said, err))) return rc;
    if (bad >= 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "layer_types says layer %lld is %s; kvcal's gemma2 windows every even layer",
                       (long long)bad, said);
    cfg->dim = dim, cfg->hidden_dim = hidden, cfg->n_layers = layers;
    cfg->n_heads = heads, cfg->n_kv_heads = kv_heads, cfg->head_dim = head_dim;
    cfg->vocab_size = vocab, cfg->max_seq_len = ctx, cfg->tied_embeddings = tied;
    cfg->sliding_window = win, cfg->window_from = 0, cfg->window_period = win ? 2 : 0;
    cfg->attn_scale = (float)(1.0 / sqrt(qpas));
    cfg->norm_offset = 1.0f;
    return KV_OK;
}

/* The sliding windows of the llama family as each config class defines
 * them: Mistral's sliding_window (MistralConfig's default 4096 when absent,
 * none when null) in every layer; Qwen2's only with use_sliding_window, from
 * layer max_window_layers on; and an explicit layer_types list (transformers
 * 4.5x and 5.x write one), which must agree with what the keys give. */
static int parse_windows(const json_t *root, const char *path, int64_t layers,
                         struct kv_config *cfg, struct kv_err *err) {
    int64_t win = 0, from = 0;
    int rc, use = 1;
    json_t *sw = json_object_get(root, "sliding_window");
    if (cfg->arch == KV_ARCH_MISTRAL) {
        win = sw ? 0 : 4096;
    } else if (cfg->arch == KV_ARCH_QWEN2 || cfg->arch == KV_ARCH_QWEN3) {
        use = 0;
        from = 28; /* Qwen2Config's max_window_layers */
        if ((rc = kv_json_get_bool(root, "use_sliding_window", path, 0, &use, err)) ||
            (rc = kv_json_get_int(root, "max_window_layers", path, 0, KV_MAX_LAYERS, 0, &from, err)))
            return rc;
    } else if (cfg->arch == KV_ARCH_PHI3) {
        win = 0; /* Phi3Config: none unless given, then in every layer */
    } else {
        use = 0; /* LlamaConfig has no window (transformers ignores the key) */
    }
    if (use && (rc = kv_json_get_int(root, "sliding_window", path, 1, KV_MAX_CTX, 0, &win, err)))
        return rc;
    if (!use) win = 0;
    int64_t bad;
    const char *said;
    if ((rc = layer_types_differ(root, path, layers, win, from, 1, &bad, &said, err))) return rc;
    if (bad >= 0)
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "layer_types says layer %lld is %s, but the window keys make it %s",
                       (long long)bad, said,
                       strcmp(said, "sliding_attention") ? "sliding_attention" : "full_attention");
    cfg->sliding_window = win;
    cfg->window_from = win ? (int32_t)from : 0, cfg->window_period = win ? 1 : 0;
    return KV_OK;
}

static int parse_config(const json_t *root, const char *path, struct kv_config *cfg,
                        struct kv_err *err) {
    if (!json_is_object(root))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "config is a json %s, expected an object",
                       kv_json_type_name(root));
    memset(cfg, 0, sizeof *cfg);
    cfg->arch = KV_ARCH_LLAMA;
    cfg->rope_layout = KV_ROPE_HALF;
    cfg->bos_id = cfg->eos_id = -1;

    const char *s = NULL;
    int rc = kv_json_get_str(root, "model_type", path, 0, &s, err);
    if (rc) return rc;
    if (s ? strcmp(s, "gpt2") == 0 : lists_architecture(root, "GPT2LMHeadModel"))
        return parse_gpt2_config(root, path, cfg, err);
    if (s && !strcmp(s, "gpt_neox")) return parse_neox_config(root, path, cfg, err);
    if (s && !strcmp(s, "gemma2")) return parse_gemma2_config(root, path, cfg, err);
    if ((rc = kv_json_get_str(root, "model_type", path, 1, &s, err))) return rc;
    const struct kv_arch_desc *ad = kv_arch_by_name(s);
    if (!ad || ad->id == KV_ARCH_GPT2)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "model_type '%.64s' is not supported, expected %s", s, kv_arch_list(1));
    cfg->arch = ad->id;
    s = "silu";
    if ((rc = kv_json_get_str(root, "hidden_act", path, 0, &s, err))) return rc;
    if (strcmp(s, "silu") != 0)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "hidden_act '%.64s' is not supported, expected 'silu'", s);

    int64_t dim = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
    int64_t ctx = 2048; /* LlamaConfig's default */
    if ((rc = read_dims(root, path, &dim, &hidden, &layers, &heads, &vocab, &ctx, err)))
        return rc;
    kv_heads = heads;
    if ((rc = kv_json_get_int(root, "num_key_value_heads", path, 1, KV_MAX_DIM, 0, &kv_heads, err)))
        return rc;
    if ((rc = kv_json_get_int(root, "head_dim", path, 1, KV_MAX_DIM, 0, &head_dim, err))) return rc;
    if (!head_dim) {
        if (dim % heads)
            return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                           "hidden_size %lld is not a multiple of num_attention_heads %lld and "
                           "head_dim is not given",
                           (long long)dim, (long long)heads);
        head_dim = dim / heads;
    }
    double eps = 1e-6;
    if ((rc = kv_json_get_num(root, "rms_norm_eps", path, 1, 0, &eps, err)) ||
        (rc = as_float(eps, "rms_norm_eps", path, &cfg->norm_eps, err)) ||
        (rc = kv_rope_json_read(root, path, ctx, cfg, err)))
        return rc;
    int tied = 0, attn_bias = 0, mlp_bias = 0;
    if ((rc = kv_json_get_bool(root, "tie_word_embeddings", path, 0, &tied, err)) ||
        (rc = kv_json_get_bool(root, "attention_bias", path, 0, &attn_bias, err)) ||
        (rc = kv_json_get_bool(root, "mlp_bias", path, 0, &mlp_bias, err)))
        return rc;
    if (mlp_bias)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET, "mlp_bias true is not supported");
    double partial = 1;
    const char *pkey;
    if ((rc = read_partial_rotary(root, path, &partial, &pkey, err))) return rc;
    if (partial != 1)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "%s %g is not supported for model_type '%s': kvcal turns whole heads "
                       "there (of these families only gpt_neox turns part of each)",
                       pkey, partial, ad->name);

    if ((rc = get_token_id(root, "bos_token_id", path, &cfg->bos_id, err)) ||
        (rc = get_token_id(root, "eos_token_id", path, &cfg->eos_id, err)) ||
        (rc = parse_windows(root, path, layers, cfg, err)))
        return rc;

    cfg->dim = dim;
    cfg->hidden_dim = hidden;
    cfg->n_layers = layers;
    cfg->n_heads = heads;
    cfg->n_kv_heads = kv_heads;
    cfg->head_dim = head_dim;
    cfg->vocab_size = vocab;
    cfg->max_seq_len = ctx;
    cfg->tied_embeddings = tied;
    cfg->has_qkv_bias = attn_bias;
    return KV_OK;
}

int kv_hf_read_config(const char *path, struct kv_config *cfg, struct kv_err *err) {
    json_t *root;
    int rc = kv_json_load(path, &root, err);
    if (rc) return rc;
    rc = parse_config(root, path, cfg, err);
    json_decref(root);
    return rc;
}

/* ================================================================ weights */

struct hf_shard {
    char *name; /* file name inside dir (owned) */
    char *path; /* dir/name (owned) */
    struct kv_st_file *st; /* owned by the model once registered */
};

struct hf_ref {
    const char *name;
    const struct kv_tensor *t;
};

struct hf_weights {
    const char *list_path; /* model.safetensors or the index, for messages */
    struct hf_shard *shards;
    int n_shards;
    struct hf_ref *refs; /* every tensor of every shard, sorted by name */
    int64_t n_refs;
};

static void st_close_cb(void *p) { kv_st_close(p); }

static int ref_cmp(const void *pa, const void *pb) {
    return strcmp(((const struct hf_ref *)pa)->name, ((const struct hf_ref *)pb)->name);
}

static const struct kv_tensor *lookup(const struct hf_weights *w, const char *name) {
    struct hf_ref key = {name, NULL};
    const struct hf_ref *r = bsearch(&key, w->refs, (size_t)w->n_refs, sizeof key, ref_cmp);
    return r ? r->t : NULL;
}

/* Tensor name, following __metadata__ aliases ("model.embed_tokens.weight":
 * "lm_head.weight") a few hops. */
static const struct kv_tensor *find(const struct hf_weights *w, const char *name) {
    for (int hop = 0; hop < 4 && name; hop++) {
        const struct kv_tensor *t = lookup(w, name);
        if (t) return t;
        const char *next = NULL;
        for (int s = 0; s < w->n_shards && !next; s++) next = kv_st_meta(w->shards[s].st, name);
        name = next;
    }
    return NULL;
}

static int add_shard(struct hf_weights *w, const char *dir, const char *name, const char *list_path,
                     struct kv_err *err) {
    for (int i = 0; i < w->n_shards; i++)
        if (strcmp(w->shards[i].name, name) == 0) return KV_OK;
    if (w->n_shards >= KV_MAX_SHARDS)
        return kv_fail(err, KV_EFORMAT, list_path, KV_NO_OFFSET,
                       "weight_map names more than %d shard files", KV_MAX_SHARDS);
    if (!*name || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))
        return kv_fail(err, KV_EFORMAT, list_path, KV_NO_OFFSET,
                       "weight_map names file '%.128s', expected a plain file name", name);
    if (w->n_shards % 16 == 0) {
        struct hf_shard *ns = realloc(w->shards, (size_t)(w->n_shards + 16) * sizeof *ns);
        if (!ns) return kv_fail(err, KV_ENOMEM, list_path, KV_NO_OFFSET, "out of memory");
        w->shards = ns;
    }
    struct hf_shard *s = &w->shards[w->n_shards];
    s->name = strdup(name);
    s->path = kv_path_join(dir, name);
    s->st = NULL;
    w->n_shards++; /* counted now so the strings are freed on any failure */
    if (!s->name || !s->path)
        return kv_fail(err, KV_ENOMEM, list_path, KV_NO_OFFSET, "out of memory");
    return KV_OK;
}

/* Open every shard (registering its mapping with m), add all tensors to m's
 * table and build the sorted name index. */
static int open_shards(struct hf_weights *w, struct kv_model *m, struct kv_err *err) {
    int64_t total = 0;
    for (int i = 0; i < w->n_shards; i++) {
        struct hf_shard *s = &w->shards[i];
        int rc = kv_st_open(s->path, &s->st, err);
        if (rc) return rc;
        if ((rc = kv_model_on_close(m, st_close_cb, s->st, err))) {
            kv_st_close(s->st);
            s->st = NULL;
            return rc;
        }
        for (int64_t j = 0; j < s->st->n_tensors; j++) s->st->tensors[j].file = i;
        if ((rc = kv_model_add_tensors(m, s->st->tensors, s->st->n_tensors, err))) return rc;
        total += s->st->n_tensors;
    }
    w->refs = calloc(total ? (size_t)total : 1, sizeof *w->refs);
    if (!w->refs) return kv_fail(err, KV_ENOMEM, w->list_path, KV_NO_OFFSET, "out of memory");
    for (int i = 0; i < w->n_shards; i++)
        for (int64_t j = 0; j < w->shards[i].st->n_tensors; j++) {
            const struct kv_tensor *t = &w->shards[i].st->tensors[j];
            w->refs[w->n_refs++] = (struct hf_ref){t->name, t};
        }
    qsort(w->refs, (size_t)w->n_refs, sizeof *w->refs, ref_cmp);
    for (int64_t i = 1; i < w->n_refs; i++)
        if (strcmp(w->refs[i - 1].name, w->refs[i].name) == 0)
            return kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET,
                           "tensor '%s' is stored in both '%s' and '%s'", w->refs[i].name,
                           w->shards[w->refs[i - 1].t->file].name,
                           w->shards[w->refs[i].t->file].name);
    return KV_OK;
}

/* Shard list from model.safetensors.index.json; opened and cross-checked. */
static int open_index(struct hf_weights *w, const char *dir, struct kv_model *m,
                      struct kv_err *err) {
    json_t *root;
    int rc = kv_json_load(w->list_path, &root, err);
    if (rc) return rc;
    const json_t *map = json_object_get(root, "weight_map");
    const char *key;
    json_t *v;
    if (!json_is_object(map)) {
        rc = kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET,
                     "key 'weight_map' must be an object");
        goto done;
    }
    if (json_object_size(map) > KV_MAX_TENSORS) {
        rc = kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET,
                     "weight_map has %zu entries, above the limit %d", json_object_size(map),
                     KV_MAX_TENSORS);
        goto done;
    }
    json_object_foreach((json_t *)map, key, v) {
        if (!json_is_string(v)) {
            char found[64];
            kv_json_repr(v, found, sizeof found);
            rc = kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET,
                         "weight_map entry '%.128s' must name a file, found %s", key, found);
            goto done;
        }
        if ((rc = add_shard(w, dir, json_string_value(v), w->list_path, err))) goto done;
    }
    if (w->n_shards == 0) {
        rc = kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET, "weight_map is empty");
        goto done;
    }
    if ((rc = open_shards(w, m, err))) goto done;
    json_object_foreach((json_t *)map, key, v) {
        const struct kv_tensor *t = lookup(w, key);
        const char *want = json_string_value(v);
        if (!t || strcmp(w->shards[t->file].name, want) != 0) {
            rc = kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET,
                         "tensor '%.128s' is mapped to '%.128s' but that file does not contain it",
                         key, want);
            goto done;
        }
    }
done:
    json_decref(root);
    return rc;
}

static void weights_free(struct hf_weights *w) {
    for (int i = 0; i < w->n_shards; i++) {
        free(w->shards[i].name);
        free(w->shards[i].path);
    }
    free(w->shards);
    free(w->refs);
}

/* Bind stored tensor t as the weights e->kinds of layer (see struct
 * kv_arch_tensor). A Conv1D weight is converted to f32 and transposed, and
 * one interleaved per head is converted and gathered, into a block the model
 * owns; the pieces of a stacked tensor are bound as slices. */
static int bind_entry(struct kv_model *m, const struct hf_weights *w, const struct kv_arch_tensor *e,
                      int64_t layer, const struct kv_tensor *t, struct kv_err *err) {
    const char *path = w->shards[t->file].path;
    if (e->n_kinds == 1 && !e->conv) return kv_model_bind(m, e->kinds[0], layer, t, path, err);
    int64_t rows[3], total, cols;
    int nd = kv_arch_entry_shape(&m->cfg, e, rows, &total, &cols);
    int64_t want[2] = {e->conv ? cols : total, e->conv ? total : cols};
    if (t->ndim != nd || t->shape[0] != want[0] || (nd == 2 && t->shape[1] != want[1])) {
        char got[96], exp[64];
        kv_shape_str(got, sizeof got, t->shape, t->ndim);
        kv_shape_str(exp, sizeof exp, want, nd);
        return kv_fail(err, KV_EFORMAT, path, t->offset,
                       "tensor '%s' has shape %s but the config implies %s%s", t->name, got, exp,
                       e->conv ? " (Conv1D, stored [in, out])" : "");
    }
    struct kv_tensor piece = *t;
    const uint8_t *base = t->data;
    if (e->conv || e->heads) {
        if (t->dtype != KV_DTYPE_F32 && t->dtype != KV_DTYPE_F16 && t->dtype != KV_DTYPE_BF16)
            return kv_model_bind(m, e->kinds[0], layer, t, path, err); /* refuses the dtype */
        int64_t n = total * cols;
        float *in = malloc((size_t)n * sizeof *in), *out = malloc((size_t)n * sizeof *out);
        if (!in || !out || kv_model_on_close(m, free, out, err)) {
            free(in), free(out);
            return kv_fail(err, KV_ENOMEM, path, t->offset, "out of memory transposing '%s'", t->name);
        }
        kv_convert_to_f32(t->dtype, t->data, in, n);
        for (int64_t i = 0; i < n; i++) /* here, where the element's offset is known */
            if (!isfinite(in[i])) {
                const char *what = isnan(in[i]) ? "nan" : "inf"; /* before in is freed */
                free(in);
                return kv_fail(err, KV_ENUMERIC, path,
                               t->offset + (uint64_t)i * kv_dtype_size(t->dtype),
                               "tensor '%s' element %lld is %s", t->name, (long long)i, what);
            }
        if (e->conv) {
            for (int64_t i = 0; i < cols; i++) /* in [cols, total] -> out [total, cols] */
                for (int64_t o = 0; o < total; o++) out[o * cols + i] = in[i * total + o];
        } else { /* rows [h][kinds][d_h] -> each kind's rows whole, one after the other */
            int64_t dh = m->cfg.head_dim, r0 = 0;
            for (int k = 0; k < e->n_kinds; r0 += rows[k], k++)
                for (int64_t r = 0; r < rows[k]; r++)
                    memcpy(out + (r0 + r) * cols,
                           in + ((r / dh) * e->n_kinds * dh + k * dh + r % dh) * cols,
                           (size_t)cols * sizeof *out);
        }
        free(in);
        piece.dtype = KV_DTYPE_F32;
        base = (const uint8_t *)out;
    }
    size_t es = kv_dtype_size(piece.dtype);
    int64_t r0 = 0;
    for (int k = 0; k < e->n_kinds; k++) {
        piece.ndim = nd;
        piece.shape[0] = rows[k];
        piece.shape[1] = cols;
        piece.data = base + (size_t)(r0 * cols) * es;
        piece.nbytes = (uint64_t)(rows[k] * cols) * es;
        /* a transposed or interleaved piece is scattered through the file: name its start */
        piece.offset = e->conv || e->heads ? t->offset : t->offset + (uint64_t)(r0 * cols) * es;
        int rc = kv_model_bind(m, e->kinds[k], layer, &piece, path, err);
        if (rc) return rc;
        r0 += rows[k];
    }
    return KV_OK;
}

/* The stored tensor of name, also found without the names' optional prefix
 * (GPT-2 checkpoints exist both ways). */
static const struct kv_tensor *find_named(const struct hf_weights *w,
                                          const struct kv_arch_names *nm, const char *name) {
    const struct kv_tensor *t = find(w, name);
    const char *alt = kv_arch_unprefixed(nm, name);
    if (!t && alt) t = find(w, alt);
    return t;
}

/* Bind every weight of the model's architecture from its HF names (arch.h):
 * the globals (the head only when untied; a tied checkpoint may store only
 * the head, which then serves as the embedding), then each layer's.
 * attn_bias: config.json's attention_bias, which makes an architecture's
 * optional q/k/v biases required. */
static int bind_weights(struct kv_model *m, const struct hf_weights *w, int attn_bias,
                        struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    const struct kv_arch_desc *a = kv_arch_desc(c->arch);
    const struct kv_arch_names *nm = &a->hf;
    const struct kv_arch_tensor *he = kv_arch_find(nm, KV_W_LM_HEAD, NULL);
    const struct kv_tensor *head = he ? find_named(w, nm, he->name) : NULL;
    for (int64_t i = 0; i < nm->n_globals; i++) {
        const struct kv_arch_tensor *e = &nm->globals[i];
        enum kv_wkind k = e->kinds[0];
        if (k == KV_W_LM_HEAD && c->tied_embeddings) continue;
        const struct kv_tensor *t = find_named(w, nm, e->name);
        if (!t && k == KV_W_TOK_EMB && c->tied_embeddings) t = head;
        if (!t)
            return kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET, "missing tensor '%s'%s",
                           e->name, k == KV_W_LM_HEAD ? " (tie_word_embeddings is false)" : "");
        int rc = bind_entry(m, w, e, 0, t, err);
        if (rc) return rc;
    }
    char name[KV_MAX_NAME_LEN + 64];
    for (int64_t l = 0; l < c->n_layers; l++) {
        for (int64_t i = 0; i < a->n_hf_refused; i++) {
            snprintf(name, sizeof name, "%s%lld.%s", nm->layer_prefix, (long long)l,
                     a->hf_refused[i]);
            const struct kv_tensor *t = find(w, name);
            if (t)
                return kv_fail(err, KV_EUNSUPPORTED, w->shards[t->file].path, t->offset,
                               "tensor '%s': this bias is not supported", name);
        }
        for (int64_t i = 0; i < nm->n_layer; i++) {
            const struct kv_arch_tensor *e = &nm->layer[i];
            snprintf(name, sizeof name, "%s%lld.%s", nm->layer_prefix, (long long)l, e->name);
            const struct kv_tensor *t = find_named(w, nm, name);
            int optional = kv_wkind_use(c, e->kinds[0]) == KV_WUSE_OPTIONAL;
            if (!t && optional && !attn_bias) continue;
            if (!t)
                return kv_fail(err, KV_EFORMAT, w->list_path, KV_NO_OFFSET,
                               "missing tensor '%s'%s", name,
                               optional ? " (attention_bias is true)" : "");
            int rc = bind_entry(m, w, e, l, t, err);
            if (rc) return rc;
        }
    }
    return KV_OK;
}

/* ================================================================ directory */

static int load_dir(const char *dir, struct kv_model **out, char **paths, struct kv_err *err) {
    /* paths: [0] config.json, [1] model.safetensors, [2] the index, [3] tokenizer.json */
    static const char *const names[] = {"config.json", "model.safetensors",
                                        "model.safetensors.index.json", "tokenizer.json"};
    for (int i = 0; i < 4; i++)
        if (!(paths[i] = kv_path_join(dir, names[i])))
            return kv_fail(err, KV_ENOMEM, dir, KV_NO_OFFSET, "out of memory");
    if (kv_path_kind(dir) != 1)
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "not a directory");

    struct kv_config cfg;
    int rc = kv_hf_read_config(paths[0], &cfg, err);
    if (rc) return rc;
    int attn_bias = cfg.has_qkv_bias;
    cfg.has_qkv_bias = 0; /* kv_model_finish sets it from the bound tensors */
    const char *single = paths[1], *index = paths[2];
    int sharded = kv_path_kind(single) != 0;
    if (sharded && kv_path_kind(index) != 0)
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET,
                       "no model.safetensors or model.safetensors.index.json");

    struct kv_model *m;
    if ((rc = kv_model_create(&cfg, KV_FORMAT_HF, paths[0], &m, err))) return rc;
    struct hf_weights w = {sharded ? index : single, NULL, 0, NULL, 0};
    if (sharded)
        rc = open_index(&w, dir, m, err);
    else if (!(rc = add_shard(&w, dir, "model.safetensors", single, err)))
        rc = open_shards(&w, m, err);
    if (!rc)
        rc = bind_weights(m, &w, attn_bias, err);
    weights_free(&w);

    if (!rc && kv_path_kind(paths[3]) == 0) {
        rc = kv_hf_load_tokenizer_ids(paths[3], cfg.bos_id, cfg.eos_id, &m->tok, err);
        /* the tokenizer's own file is the one at fault (kv_model_finish
         * would name the weights) */
        if (!rc && kv_tok_n_vocab(m->tok) > cfg.vocab_size)
            rc = kv_fail(err, KV_EFORMAT, paths[3], KV_NO_OFFSET,
                         "tokenizer has %d pieces but config.json's vocab_size is %lld",
                         kv_tok_n_vocab(m->tok), (long long)cfg.vocab_size);
        if (!rc) {
            if (m->cfg.bos_id < 0) m->cfg.bos_id = kv_tok_bos(m->tok);
            if (m->cfg.eos_id < 0) m->cfg.eos_id = kv_tok_eos(m->tok);
        }
    }
    if (!rc) rc = kv_model_finish(m, sharded ? index : single, err);
    if (rc) {
        kv_model_close(m);
        return rc;
    }
    *out = m;
    return KV_OK;
}

int kv_hf_load(const char *dir, struct kv_model **out, struct kv_err *err) {
    char *paths[4] = {NULL, NULL, NULL, NULL};
    int rc = load_dir(dir, out, paths, err);
    for (int i = 0; i < 4; i++) free(paths[i]);
    return rc;
}
