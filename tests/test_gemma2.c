/* Gemma 2: the forward pass against the float64 oracle of
 * tests/naive_gemma2.h (GeGLU, post-norms, (1 + w) gains, the scaled
 * embedding, query_pre_attn_scalar, both soft-caps, a window on even
 * layers), Gemma2Config and its refusals, and the HF and GGUF round trips
 * (GGUF stores the gains with the 1 added). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf_patch.h"
#include "ggufmodelw.h"
#include "hfdir.h"
#include "kvformats.h"
#include "model.h"
#include "naive_gemma2.h"
#include "testutil.h"

/* Sharp attention, gains away from 1 and uneven, so every piece shows. */
static struct kv_model *random_gemma2(struct kv_config c, uint64_t seed) {
    struct kv_model *m;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_init_random(&c, seed, &m, &err), KV_OK, "%s", err.msg);
    for (int64_t l = 0; l < c.n_layers; l++) {
        for (int k = KV_W_Q; k <= KV_W_K; k++) {
            float *w = kv_model_weight_mut(m, (enum kv_wkind)k, l);
            int64_t rows = k == KV_W_Q ? c.n_heads : c.n_kv_heads;
            for (int64_t i = 0; i < rows * c.head_dim * c.dim; i++) w[i] *= 25;
        }
        const enum kv_wkind norms[] = {KV_W_ATTN_NORM, KV_W_FFN_NORM, KV_W_POST_ATTN_NORM,
                                       KV_W_POST_FFN_NORM};
        for (int k = 0; k < 4; k++) {
            float *w = kv_model_weight_mut(m, norms[k], l);
            for (int64_t i = 0; i < c.dim; i++)
                w[i] = 0.3f * (float)((i * 7 + k * 3 + l) % 9) / 9.0f - c.norm_offset + 0.8f;
        }
    }
    float *emb = kv_model_weight_mut(m, KV_W_TOK_EMB, 0);
    for (int64_t i = 0; i < c.vocab_size * c.dim; i++) emb[i] *= 10;
    return m;
}

#define ORACLE_TOL 1e-5
#define N_TOK 40

static void tokens(int32_t *tok, int64_t V) {
    for (int i = 0; i < N_TOK; i++) tok[i] = (i * 31 + 7) % (int32_t)V;
}

static double against_oracle(struct kv_config c, const char *what) {
    struct kv_model *m = random_gemma2(c, 13);
    int64_t n = N_TOK, V = c.vocab_size;
    int32_t tok[N_TOK];
    tokens(tok, V);
    float *got = kvt_logits(m, tok, n);
    double *ref = naive_gemma2_forward(m, tok, n);
    double spread = kvt_assert_close_oracle(got, ref, n * V, ORACLE_TOL, ORACLE_TOL, what);
    free(got), free(ref);
    kv_model_close(m);
    return spread;
}

Test(gemma2, forward_matches_the_float64_oracle) {
    struct kv_config c = tiny_gemma2_cfg();
    against_oracle(c, "gemma2, Gemma 2's soft-caps 50 and 30");
    c.attn_softcap = 2.0f, c.final_softcap = 3.0f; /* caps that bite */
    against_oracle(c, "gemma2, soft-caps 2 and 3");
    c.norm_offset = 0; /* GGUF's gains */
    against_oracle(c, "gemma2, gains stored whole");
    c.sliding_window = 0, c.window_period = 0, c.attn_scale = 0;
    against_oracle(c, "gemma2, no window, 1/sqrt(d_h)");
}

/* The oracle test can fail: each feature, switched in the model alone,
 * moves the logits well past its tolerance. */
Test(gemma2, each_feature_changes_the_logits) {
    struct kv_config c = tiny_gemma2_cfg();
    c.attn_softcap = 2.0f, c.final_softcap = 3.0f;
    struct kv_model *m = random_gemma2(c, 13);
    int64_t n = N_TOK, V = c.vocab_size;
    int32_t tok[N_TOK];
    tokens(tok, V);
    float *base = kvt_logits(m, tok, n);
    double spread = 0;
    for (int64_t i = 0; i < n * V; i++) spread = fmax(spread, fabs(base[i]));
    struct kv_config *mc = (struct kv_config *)&m->cfg;
    struct kv_config keep = *mc;
    const char *names[] = {"attention soft-cap", "final soft-cap", "attention scale",
                           "norm offset", "window"};
    for (int k = 0; k < 5; k++) {
        if (k == 0) mc->attn_softcap = 0;
        if (k == 1) mc->final_softcap = 0;
        if (k == 2) mc->attn_scale = 0;
        if (k == 3) mc->norm_offset = 0;
        if (k == 4) mc->sliding_window = 0, mc->window_period = 0;
        float *other = kvt_logits(m, tok, n);
        double worst = 0;
        for (int64_t i = 0; i < n * V; i++) worst = fmax(worst, fabs(other[i] - base[i]));
        cr_assert(worst > 3 * ORACLE_TOL * spread,
                  "%s changes the logits by only %g, under 3x the oracle test's tolerance %g",
                  names[k], worst, ORACLE_TOL * spread);
        *mc = keep;
        free(other);
    }
    free(base);
    kv_model_close(m);
}

#define GEMMA2_2B_SHAPE                                                                        \
    "\"architectures\": [\"Gemma2ForCausalLM\"], \"model_type\": \"gemma2\", "                  \
    "\"hidden_size\": 2304, \"intermediate_size\": 9216, \"num_hidden_layers\": 26, "          \
    "\"num_attention_heads\": 8, \"num_key_value_heads\": 4, \"head_dim\": 256, "              \
    "\"vocab_size\": 256000, \"max_position_embeddings\": 8192, \"rms_norm_eps\": 1e-06, "     \
    "\"rope_theta\": 10000.0, \"query_pre_attn_scalar\": 256, \"sliding_window\": 4096"

/* Gemma 2 2B's shape in Gemma2Config's keys (not a copy of its config.json:
 * none was found to copy) */
Test(gemma2, config_keys_and_defaults) {
    char *dir = kvt_temp_dir();
    char *p = kvt_write_text(dir, "config.json", "{" GEMMA2_2B_SHAPE ", \"hidden_activation\": \"gelu_pytorch_tanh\", "
                                "\"attn_logit_softcapping\": 50.0, \"final_logit_softcapping\": 30.0}");
    struct kv_config c;
    struct kv_err err = {0};
    cr_assert_eq(kv_hf_read_config(p, &c, &err), KV_OK, "%s", err.msg);
    cr_assert(c.arch == KV_ARCH_GEMMA2 && c.head_dim == 256 && c.n_kv_heads == 4);
    cr_assert(c.attn_scale == 0.0625f && c.attn_softcap == 50.0f && c.final_softcap == 30.0f);
    cr_assert(c.sliding_window == 4096 && c.window_from == 0 && c.window_period == 2);
    cr_assert(c.norm_offset == 1.0f && c.tied_embeddings && c.norm_eps == 1e-6f);
    free(p);
    /* null soft-caps: none */
    p = kvt_write_text(dir, "config.json", "{" GEMMA2_2B_SHAPE ", \"attn_logit_softcapping\": null, "
                          "\"final_logit_softcapping\": null}");
    cr_assert_eq(kv_hf_read_config(p, &c, &err), KV_OK, "%s", err.msg);
    cr_assert(c.attn_softcap == 0 && c.final_softcap == 0);
    free(p);
    struct {
        const char *extra, *msg;
    } bad[] = {
        {"\"hidden_activation\": \"gelu\"", "hidden_activation 'gelu' is not supported"},
        {"\"attention_bias\": true", "attention_bias true is not supported"},
        {"\"layer_types\": [\"full_attention\"]", "key 'layer_types' must be a list of 26 strings"},
        {"\"attn_logit_softcapping\": -1", "attn_logit_softcapping"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[2048];
        snprintf(text, sizeof text, "{" GEMMA2_2B_SHAPE ", %s}", bad[i].extra);
        p = kvt_write_text(dir, "config.json", text);
        cr_assert_neq(kv_hf_read_config(p, &c, &err), KV_OK, "case %zu loaded", i);
        cr_assert(strstr(err.msg, bad[i].msg), "case %zu: '%s' lacks '%s'", i, err.msg, bad[i].msg);
        free(p);
    }
    /* a layer_types list with the windows on the odd layers, which kvcal's
     * gemma2 cannot run: refused at the first layer it differs in */
    char text[4096] = "{" GEMMA2_2B_SHAPE ", \"layer_types\": [";
    for (int l = 0; l < 26; l++)
        strcat(text, l % 2 ? "\"sliding_attention\", " : "\"full_attention\", ");
    strcpy(text + strlen(text) - 2, "]}");
    p = kvt_write_text(dir, "config.json", text);
    cr_assert_eq(kv_hf_read_config(p, &c, &err), KV_EUNSUPPORTED, "%s", text);
    cr_assert_str_eq(err.msg, "layer_types says layer 0 is full_attention; kvcal's gemma2 windows "
                              "every even layer");
    free(p);
    /* the list transformers writes, windows on the even layers, loads */
    strcpy(text, "{" GEMMA2_2B_SHAPE ", \"layer_types\": [");
    for (int l = 0; l < 26; l++)
        strcat(text, l % 2 ? "\"full_attention\", " : "\"sliding_attention\", ");
    strcpy(text + strlen(text) - 2, "]}");
    p = kvt_write_text(dir, "config.json", text);
    cr_assert_eq(kv_hf_read_config(p, &c, &err), KV_OK, "%s", err.msg);
    cr_assert(c.sliding_window > 0 && c.window_from == 0 && c.window_period == 2);
    free(p);
    kvt_rm_dir(dir);
}

Test(gemma2, hf_round_trip) {
    struct kv_config c = tiny_gemma2_cfg();
    struct kv_model *m = random_gemma2(c, 5), *r;
    char *dir = kvt_temp_dir();
    struct kv_err err = {0};
    cr_assert_eq(kv_hf_write(m, dir, KV_DTYPE_F32, NULL, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(dir, NULL, &r, &err), KV_OK, "%s", err.msg);
    const struct kv_config *rc = &r->cfg;
    cr_assert(rc->arch == KV_ARCH_GEMMA2 && rc->attn_scale == c.attn_scale &&
              rc->attn_softcap == c.attn_softcap && rc->final_softcap == c.final_softcap &&
              rc->norm_offset == 1.0f && rc->sliding_window == 6 && rc->window_period == 2,
              "scale %g caps %g %g offset %g window %lld/%d", (double)rc->attn_scale,
              (double)rc->attn_softcap, (double)rc->final_softcap, (double)rc->norm_offset,
              (long long)rc->sliding_window, rc->window_period);
    int32_t tok[N_TOK];
    tokens(tok, c.vocab_size);
    float *a = kvt_logits(m, tok, N_TOK), *b = kvt_logits(r, tok, N_TOK);
    cr_assert(!memcmp(a, b, (size_t)(N_TOK * c.vocab_size) * sizeof *a), "logits differ after the round trip");
    free(a), free(b);
    kv_model_close(r);
    kv_model_close(m);
    kvt_rm_dir(dir);
}

/* GGUF holds the gains with the 1 added, and llama.cpp's scale 1/sqrt(d_h):
 * the file reads back with norm_offset 0 and the same logits; a scale
 * llama.cpp would not compute is refused. */
Test(gemma2, gguf_round_trip_and_refusals) {
    struct kv_config c = tiny_gemma2_cfg();
    c.attn_scale = (float)(1.0 / sqrt((double)c.head_dim));
    struct kv_model *m = random_gemma2(c, 5), *r;
    char *dir = kvt_temp_dir(), *path = kvt_path(dir, "m.gguf"), *hf = kvt_path(dir, "hf");
    struct kv_err err = {0};
    cr_assert_eq(kv_gguf_write_model(m, path, NULL, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(path, NULL, &r, &err), KV_OK, "%s", err.msg);
    cr_assert(r->cfg.norm_offset == 0 && r->cfg.attn_scale == c.attn_scale &&
              r->cfg.attn_softcap == 50.0f && r->cfg.final_softcap == 30.0f &&
              r->cfg.sliding_window == 6 && r->cfg.window_period == 2);
    const float *g0 = kv_model_weight(m, KV_W_POST_FFN_NORM, 1), *g1 = kv_model_weight(r, KV_W_POST_FFN_NORM, 1);
    for (int64_t i = 0; i < c.dim; i++)
        cr_assert(g1[i] == 1.0f + g0[i], "gain %lld: %g read back as %g", (long long)i, (double)g0[i], (double)g1[i]);
    int32_t tok[N_TOK];
    tokens(tok, c.vocab_size);
    float *a = kvt_logits(m, tok, N_TOK), *b = kvt_logits(r, tok, N_TOK);
    cr_assert(!memcmp(a, b, (size_t)(N_TOK * c.vocab_size) * sizeof *a), "logits differ after the round trip");
    /* and to HF again: the gains lose their 1 */
    cr_assert_eq(kv_hf_write(r, hf, KV_DTYPE_F32, NULL, &err), KV_OK, "%s", err.msg);
    struct kv_model *h;
    cr_assert_eq(kv_model_open(hf, NULL, &h, &err), KV_OK, "%s", err.msg);
    float *hl = kvt_logits(h, tok, N_TOK);
    kvt_assert_close_f32(hl, a, N_TOK * c.vocab_size, 1e-5, 1e-5, "gguf read back, written as HF");
    free(a), free(b), free(hl);
    kv_model_close(h);
    kv_model_close(r);
    kv_model_close(m);
    c.attn_scale = (float)(1.0 / sqrt(24.0));
    m = random_gemma2(c, 5);
    cr_assert_neq(kv_gguf_write_model(m, path, NULL, &err), KV_OK);
    cr_assert(strstr(err.msg, "cannot be written to gguf 'gemma2': llama.cpp takes 1/sqrt(head_dim)"),
              "%s", err.msg);
    kv_model_close(m);
    free(path), free(hf);
    kvt_rm_dir(dir);
}

/* gemma2's own keys corrupted in place: named with their offset. */
Test(gemma2, corrupt_gguf_keys_are_refused_at_their_offset) {
    struct kv_config c = tiny_gemma2_cfg();
    c.attn_scale = (float)(1.0 / sqrt((double)c.head_dim));
    struct kv_model *m = random_gemma2(c, 5);
    uint64_t off;
    float bad[2] = {NAN, -1.0f};
    const char *keys[2] = {"gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping"};
    const char *msgs[2] = {"gemma2.attn_logit_softcapping is nan, expected a finite cap",
                           "gemma2.final_logit_softcapping is -1, expected a finite cap"};
    for (int i = 0; i < 2; i++) {
        char *p = patched_gguf(m, keys[i], &bad[i], 4, &off);
        refused_at(p, off, msgs[i]);
        unlink(p), free(p);
    }
    kv_model_close(m);
}
