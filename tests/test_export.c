/* Dense export (kv_lr_export_dense), round trips. Real and hand-written
 * models in every source format get the hand-built factors of
 * export_fixture.h, are exported and reloaded: the K/V weights must equal
 * up·down computed with naive float64 loops (within the stored dtype's
 * rounding), every other weight and every byte outside the overwritten
 * tensors must equal the source, and file names and sizes must match.
 * GPT-2 directories (Conv1D c_attn holding q, k and v) get fused_query and
 * prerope_latent keys: only the K/V columns of c_attn may change, and the
 * F32 export's ordinary forward pass must give the compressed model's
 * latent-cache logits, also with centred factors (each mean exported into
 * the K/V bias). The refusals and `kvcal export` are
 * test_export_refusals.c's. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export.h"
#include "export_fixture.h"
#include "lrmodel.h"
#include "model.h"
#include "safetensors.h"
#include "testutil.h"

/* ---------------------------------------------------------------- round trips */

/* Every byte of dst equals src except inside the named tensors of table
 * (K/V tensors of compressed sides); the sizes are equal. */
static void check_bytes(const char *src, const char *dst, const struct kv_tensor *tab, int64_t n,
                        const struct kv_model *m, const struct kv_lowrank *lr) {
    size_t ns, nd;
    char *a = kvt_read_file(src, &ns), *b = kvt_read_file(dst, &nd);
    cr_assert(a && b);
    cr_assert_eq(ns, nd, "%s has %zu bytes, source %s has %zu", dst, nd, src, ns);
    /* allowed ranges: tensors named as a compressed side's K/V in any format */
    char *allow = calloc(ns ? ns : 1, 1);
    for (int64_t i = 0; i < n; i++) {
        const char *nm = tab[i].name;
        long long l = -1;
        char what[32] = "";
        if (sscanf(nm, "model.layers.%lld.self_attn.%31s", &l, what) == 2 ||
            sscanf(nm, "blk.%lld.attn_%31s", &l, what) == 2 ||
            sscanf(nm, "layers.%lld.%31s", &l, what) == 2) {
            enum kv_wkind k = KV_W_COUNT;
            if (!strcmp(what, "k_proj.weight") || !strcmp(what, "k.weight") || !strcmp(what, "wk"))
                k = KV_W_K;
            if (!strcmp(what, "v_proj.weight") || !strcmp(what, "v.weight") || !strcmp(what, "wv"))
                k = KV_W_V;
            if (!strcmp(what, "k_proj.bias") || !strcmp(what, "k.bias")) k = KV_W_BK;
            if (!strcmp(what, "v_proj.bias") || !strcmp(what, "v.bias")) k = KV_W_BV;
            if (k != KV_W_COUNT && l < m->cfg.n_layers && side(lr, l, k)->mode != KV_LR_FULL)
                memset(allow + tab[i].offset, 1, tab[i].nbytes);
        }
        /* gpt2's c_attn [d, qd + 2 kd] (bias [qd + 2 kd]): only the K or V
         * columns of a compressed side */
        if (sscanf(nm, "transformer.h.%lld.attn.c_attn.%31s", &l, what) == 2 ||
            sscanf(nm, "h.%lld.attn.c_attn.%31s", &l, what) == 2) {
            const struct kv_config *c = &m->cfg;
            int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
            int64_t out = qd + 2 * kd, in = strcmp(what, "bias") ? c->dim : 1;
            size_t es = kv_dtype_size(tab[i].dtype);
            for (int s = 0; s < 2; s++) {
                if (l >= c->n_layers || side(lr, l, s ? KV_W_V : KV_W_K)->mode == KV_LR_FULL)
                    continue;
                for (int64_t r = 0; r < in; r++)
                    memset(allow + tab[i].offset + (size_t)(r * out + qd + s * kd) * es, 1,
                           (size_t)kd * es);
            }
        }
    }
    for (size_t i = 0; i < ns; i++)
        cr_assert(a[i] == b[i] || allow[i],
                  "%s: byte %zu differs from the source outside the K/V tensors", dst, i);
    free(allow);
    free(a);
    free(b);
}

/* Single-file source (GGUF or llama2.c): export to dir/out.EXT, reload,
 * check. */
static void roundtrip_file(const char *src, const char *ext, const int *k_mode, unsigned v_full) {
    struct kv_model *m = open_ok(src);
    struct kv_lowrank *lr = make_lr(m, k_mode, v_full, 0, 7);
    kv_model_fingerprint(m, lr->info.model_fingerprint, NULL);
    char *dir = kvt_temp_dir();
    char name[32];
    snprintf(name, sizeof name, "out%s", ext);
    char *out = kvt_path(dir, name);
    export_ok(m, src, lr, out);
    cr_assert_eq(n_entries(dir), 1, "only the output file is left in its folder");
    struct kv_model *m2 = open_ok(out);
    cr_assert_eq(kv_model_format(m2), kv_model_format(m));
    int products = check_weights(m, m2, lr);
    cr_assert_gt(products, 0);
    check_bytes(src, out, m2->tensors, m2->n_tensors, m, lr);
    kv_model_close(m2);
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(out);
    free(dir);
}

/* Logits of tokens 0..n-1 (malloc'd), through lr's latent cache when lr is
 * non-NULL. */
static float *logits_of(const struct kv_model *m, const struct kv_lowrank *lr, int64_t n) {
    int64_t V = kv_model_config(m)->vocab_size;
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 7 + 3) % V);
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", err.msg);
    if (lr) cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_OK, "%s", err.msg);
    float *out = malloc((size_t)(n * V) * sizeof *out);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, out, &err), KV_OK, "%s", err.msg);
    kv_fwd_free(f);
    free(tok);
    return out;
}

/* Directory source: export to a fresh dir/out, check the file list, every
 * file's bytes and the reloaded weights; with same_logits, the exported
 * model's ordinary forward pass must also give the compressed model's
 * logits (for an F32 source, where the dense weights are not rounded). */
static void roundtrip_dir(const char *src, const int *k_mode, unsigned v_full, int k_bias,
                          int same_logits) {
    struct kv_model *m = open_ok(src);
    struct kv_lowrank *lr = make_lr(m, k_mode, v_full, k_bias, 11);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out");
    export_ok(m, src, lr, out);
    cr_assert_eq(n_entries(dir), 1, "only the output directory is left in its folder");
    struct kv_model *m2 = open_ok(out);
    cr_assert_eq(kv_model_format(m2), KV_FORMAT_HF);
    int products = check_weights(m, m2, lr);
    cr_assert_gt(products, 0);
    if (same_logits) {
        int64_t n = 12, nv = n * kv_model_config(m)->vocab_size;
        float *comp = logits_of(m, lr, n), *dense = logits_of(m2, NULL, n);
        float *base = logits_of(m, NULL, n);
        kvt_assert_close_f32(dense, comp, nv, 1e-5, 1e-4, "dense export vs compressed logits");
        double diff = 0;
        for (int64_t i = 0; i < nv; i++) diff = fmax(diff, fabs((double)base[i] - comp[i]));
        cr_assert_gt(diff, 1e-3, "the factors left the logits unchanged (max diff %g)", diff);
        free(comp), free(dense), free(base);
    }

    DIR *d = opendir(src);
    cr_assert(d);
    int regular = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *sp = kvt_path(src, e->d_name), *op = kvt_path(out, e->d_name);
        struct stat st, so;
        cr_assert_eq(stat(sp, &st), 0);
        if (!S_ISREG(st.st_mode)) {
            cr_assert_neq(stat(op, &so), 0, "%s is not a regular file but was copied", sp);
        } else {
            regular++;
            size_t len = strlen(e->d_name);
            struct kv_st_file *stf = NULL;
            struct kv_err err;
            if (len > 12 && !strcmp(e->d_name + len - 12, ".safetensors"))
                cr_assert_eq(kv_st_open(op, &stf, &err), KV_OK, "%s: %s", op, err.msg);
            check_bytes(sp, op, stf ? stf->tensors : NULL, stf ? stf->n_tensors : 0, m, lr);
            kv_st_close(stf);
        }
        free(sp);
        free(op);
    }
    closedir(d);
    cr_assert_eq(n_entries(out), regular, "the export holds exactly the source's regular files");
    kv_model_close(m2);
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(out);
    free(dir);
}

/* ---------------------------------------------------------------- an HF model with biases */

/* d 32, 8 heads of 4, 4 KV heads, FFN 48, 3 layers, vocab 64, q/k/v biases. */
#define H_DIM 32
#define H_FFN 48
#define H_LAYERS 3
#define H_KVD 16
#define H_VOCAB 64

struct st_entry {
    char name[96];
    int64_t shape[2];
    int nd;
    enum kv_dtype dtype;
};

/* Write a safetensors file of the given entries with random values,
 * converted to each entry's dtype. */
static void write_st(const char *path, const struct st_entry *t, int n, struct rng *g) {
    size_t hcap = 1 << 16, hl = 0, dcap = 1 << 20, dl = 0;
    char *hdr = malloc(hcap);
    uint8_t *data = malloc(dcap);
    hl += (size_t)snprintf(hdr, hcap, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        int64_t cnt = t[i].nd == 2 ? t[i].shape[0] * t[i].shape[1] : t[i].shape[0];
        float *v = randn_f(g, cnt, 0.1);
        size_t begin = dl, nb = (size_t)cnt * kv_dtype_size(t[i].dtype);
        cr_assert(dl + nb <= dcap);
        kv_convert_from_f32(t[i].dtype, v, data + dl, cnt);
        dl += nb;
        free(v);
        char shape[64];
        if (t[i].nd == 2)
            snprintf(shape, sizeof shape, "[%lld,%lld]", (long long)t[i].shape[0],
                     (long long)t[i].shape[1]);
        else
            snprintf(shape, sizeof shape, "[%lld]", (long long)t[i].shape[0]);
        hl += (size_t)snprintf(hdr + hl, hcap - hl,
                               ",\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                               t[i].name, kv_dtype_name(t[i].dtype), shape, begin, dl);
        cr_assert(hl < hcap);
    }
    hl += (size_t)snprintf(hdr + hl, hcap - hl, "}");
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    fwrite(len8, 1, 8, f);
    fwrite(hdr, 1, hl, f);
    fwrite(data, 1, dl, f);
    fclose(f);
    free(hdr);
    free(data);
}

/* A sharded checkpoint: tensors alternate between an F16 and a BF16 shard
 * (so K and V weights and biases land in both dtypes), plus an index, a
 * README and a subdirectory that the export must leave out. */
static char *make_hf_bias_dir(void) {
    char *dir = kvt_temp_dir();
    char text[2048];
    snprintf(text, sizeof text,
             "{\"model_type\": \"llama\", \"hidden_size\": %d, \"intermediate_size\": %d, "
             "\"num_hidden_layers\": %d, \"num_attention_heads\": 8, \"num_key_value_heads\": 4, "
             "\"vocab_size\": %d, \"rms_norm_eps\": 1e-05, \"max_position_embeddings\": 64, "
             "\"tie_word_embeddings\": false, \"attention_bias\": true, \"hidden_act\": "
             "\"silu\"}\n",
             H_DIM, H_FFN, H_LAYERS, H_VOCAB);
    char *p = kvt_path(dir, "config.json");
    write_bytes(p, text, strlen(text));
    free(p);
    p = kvt_path(dir, "README.md");
    write_bytes(p, "# test\n", 7);
    free(p);
    p = kvt_path(dir, "original");
    cr_assert_eq(mkdir(p, 0755), 0);
    char *q = kvt_path(p, "consolidated.bin");
    write_bytes(q, "x", 1);
    free(q);
    free(p);

    struct st_entry all[64];
    int n = 0;
    const struct {
        const char *suffix;
        int64_t a, b;
    } per_layer[] = {
        {"input_layernorm.weight", H_DIM, 0},       {"self_attn.q_proj.weight", H_DIM, H_DIM},
        {"self_attn.k_proj.weight", H_KVD, H_DIM},  {"self_attn.v_proj.weight", H_KVD, H_DIM},
        {"self_attn.o_proj.weight", H_DIM, H_DIM},  {"self_attn.q_proj.bias", H_DIM, 0},
        {"self_attn.k_proj.bias", H_KVD, 0},        {"self_attn.v_proj.bias", H_KVD, 0},
        {"post_attention_layernorm.weight", H_DIM, 0}, {"mlp.gate_proj.weight", H_FFN, H_DIM},
        {"mlp.up_proj.weight", H_FFN, H_DIM},       {"mlp.down_proj.weight", H_DIM, H_FFN},
    };
    struct st_entry glob[3] = {{"model.embed_tokens.weight", {H_VOCAB, H_DIM}, 2, 0},
                               {"lm_head.weight", {H_VOCAB, H_DIM}, 2, 0},
                               {"model.norm.weight", {H_DIM, 0}, 1, 0}};
    for (int i = 0; i < 3; i++) all[n++] = glob[i];
    for (int l = 0; l < H_LAYERS; l++)
        for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++) {
            struct st_entry *e = &all[n++];
            snprintf(e->name, sizeof e->name, "model.layers.%d.%s", l, per_layer[i].suffix);
            e->shape[0] = per_layer[i].a;
            e->shape[1] = per_layer[i].b;
            e->nd = per_layer[i].b ? 2 : 1;
        }
    struct st_entry sh[2][64];
    int ns[2] = {0, 0};
    static const char *const shard[2] = {"model-00001-of-00002.safetensors",
                                         "model-00002-of-00002.safetensors"};
    char *idx = malloc(16384);
    size_t il = (size_t)snprintf(idx, 16384, "{\"metadata\": {}, \"weight_map\": {");
    for (int i = 0; i < n; i++) {
        int s = i % 2;
        all[i].dtype = s ? KV_DTYPE_BF16 : KV_DTYPE_F16;
        sh[s][ns[s]++] = all[i];
        il += (size_t)snprintf(idx + il, 16384 - il, "%s\"%s\": \"%s\"", i ? ", " : "",
                               all[i].name, shard[s]);
    }
    snprintf(idx + il, 16384 - il, "}}\n");
    p = kvt_path(dir, "model.safetensors.index.json");
    write_bytes(p, idx, strlen(idx));
    free(p);
    free(idx);
    struct rng g = {42};
    for (int s = 0; s < 2; s++) {
        p = kvt_path(dir, shard[s]);
        write_st(p, sh[s], ns[s], &g);
        free(p);
    }
    return dir;
}

/* ---------------------------------------------------------------- a gpt2 model */

/* d 16, 4 heads of 4, n_inner 4d, 2 layers, vocab 24, 16 positions, tied:
 * Conv1D weights stored [in, out], c_attn holding q, k and v. Names with
 * the "transformer." prefix or without (as the hub's gpt2 has them); every
 * tensor F32, or alternately F16 and BF16. */
#define G_DIM 16
#define G_FFN 64
#define G_VOCAB 24
#define G_POS 16

static char *make_gpt2_dir(int prefixed, int half) {
    char *dir = kvt_temp_dir();
    char text[512];
    snprintf(text, sizeof text,
             "{\"model_type\": \"gpt2\", \"n_embd\": %d, \"n_layer\": 2, \"n_head\": 4, "
             "\"n_positions\": %d, \"vocab_size\": %d, \"layer_norm_epsilon\": 1e-05}\n",
             G_DIM, G_POS, G_VOCAB);
    char *p = kvt_path(dir, "config.json");
    write_bytes(p, text, strlen(text));
    free(p);
    const struct {
        const char *suffix;
        int64_t a, b;
    } glob[] = {{"wte.weight", G_VOCAB, G_DIM}, {"wpe.weight", G_POS, G_DIM},
                {"ln_f.weight", G_DIM, 0},      {"ln_f.bias", G_DIM, 0}},
      per_layer[] = {
          {"ln_1.weight", G_DIM, 0},          {"ln_1.bias", G_DIM, 0},
          {"attn.c_attn.weight", G_DIM, 3 * G_DIM}, {"attn.c_attn.bias", 3 * G_DIM, 0},
          {"attn.c_proj.weight", G_DIM, G_DIM}, {"attn.c_proj.bias", G_DIM, 0},
          {"ln_2.weight", G_DIM, 0},          {"ln_2.bias", G_DIM, 0},
          {"mlp.c_fc.weight", G_DIM, G_FFN},  {"mlp.c_fc.bias", G_FFN, 0},
          {"mlp.c_proj.weight", G_FFN, G_DIM}, {"mlp.c_proj.bias", G_DIM, 0},
      };
    const char *pre = prefixed ? "transformer." : "";
    struct st_entry all[40];
    int n = 0;
    for (size_t i = 0; i < sizeof glob / sizeof glob[0]; i++, n++) {
        snprintf(all[n].name, sizeof all[n].name, "%s%s", pre, glob[i].suffix);
        all[n].shape[0] = glob[i].a, all[n].shape[1] = glob[i].b, all[n].nd = glob[i].b ? 2 : 1;
    }
    for (int l = 0; l < 2; l++)
        for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++, n++) {
            snprintf(all[n].name, sizeof all[n].name, "%sh.%d.%s", pre, l, per_layer[i].suffix);
            all[n].shape[0] = per_layer[i].a, all[n].shape[1] = per_layer[i].b;
            all[n].nd = per_layer[i].b ? 2 : 1;
        }
    for (int i = 0; i < n; i++)
        all[i].dtype = !half ? KV_DTYPE_F32 : i % 2 ? KV_DTYPE_BF16 : KV_DTYPE_F16;
    struct rng g = {prefixed * 2 + half + 5};
    p = kvt_path(dir, "model.safetensors");
    write_st(p, all, n, &g);
    free(p);
    return dir;
}

/* ---------------------------------------------------------------- tests */

Test(export_dense, hf_shared_model_roundtrips) {
    KVT_NEED_SHARED(src, "models/tinystories-656K");
    char *s = strdup(src);
    int k_mode[2] = {K_LATENT, K_LATENT};
    roundtrip_dir(s, k_mode, 0, 0, 0);
    free(s);
}

Test(export_dense, hf_sharded_f16_bf16_with_biases_roundtrips) {
    char *src = make_hf_bias_dir();
    /* layer 0: both compressed, K bias from a down bias on unit 0 and 0 on
     * unit 1, V bias 0 (no down bias); layer 1: K full; layer 2: V full */
    int k_mode[H_LAYERS] = {K_LATENT, K_FULL, K_LATENT};
    roundtrip_dir(src, k_mode, 1u << 2, 1, 0);
    rm_tree(src);
    free(src);
}

Test(export_dense, gpt2_c_attn_k_and_v_columns_roundtrip_with_the_compressed_logits) {
    /* layer 0: fused_query keys with a down bias, fused_output values;
     * layer 1: keys full, values fused_output */
    char *src = make_gpt2_dir(0, 0);
    int k_mode[2] = {K_FUSED_QUERY, K_FULL};
    roundtrip_dir(src, k_mode, 0, 1, 1);
    rm_tree(src);
    free(src);
}

Test(export_dense, gpt2_prefixed_f16_bf16_roundtrips) {
    /* layer 0: fused_query keys, values full; layer 1: prerope_latent keys
     * and fused_output values, in F16 and BF16 tensors */
    char *src = make_gpt2_dir(1, 1);
    int k_mode[2] = {K_FUSED_QUERY, K_LATENT};
    roundtrip_dir(src, k_mode, 1u << 0, 1, 0);
    rm_tree(src);
    free(src);
}

Test(export_dense, llama2c_roundtrips) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    int k_mode[5] = {K_LATENT, K_LATENT, K_FULL, K_LATENT, K_LATENT};
    roundtrip_file(s, ".bin", k_mode, 1u << 4);
    free(s);
}

Test(export_dense, gguf_roundtrips) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.gguf");
    char *s = strdup(src);
    int k_mode[5] = {K_FULL, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    roundtrip_file(s, ".gguf", k_mode, 1u << 1);
    free(s);
}

/* ---------------------------------------------------------------- centred factors */


/* GPT-2 (K and V biases in c_attn), F32: fused_query keys with a down bias
 * and fused_output values in layer 0, prerope_latent keys and fused_output
 * values in layer 1, every unit centred. The exported K/V weights are
 * up·down and the biases up·down_bias + up_bias, against naive float64 sums
 * (within one f32 rounding); every other weight is the source's; and the
 * export's ordinary forward gives the centred compressed model's logits. */
Test(export_dense, centred_factors_export_their_means_into_the_kv_biases) {
    char *src = make_gpt2_dir(0, 0);
    struct kv_model *m = open_ok(src);
    const struct kv_config *c = kv_model_config(m);
    int k_mode[2] = {K_FUSED_QUERY, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 1, 23);
    fx_centre(m, lr, 31);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out");
    export_ok(m, src, lr, out);
    struct kv_model *m2 = open_ok(out);
    const int64_t kd = c->n_kv_heads * c->head_dim, d = c->dim;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int w = 0; w < 2; w++) {
            enum kv_wkind wk = w ? KV_W_V : KV_W_K, bk = w ? KV_W_BV : KV_W_BK;
            const struct kv_lr_side *s = side(lr, l, wk);
            char what[96];
            /* the weight: up·down */
            double *ref = naive_dense(lr, l, wk);
            const float *b = kv_model_weight(m2, wk, l);
            double *got = malloc((size_t)(kd * d) * sizeof *got);
            for (int64_t i = 0; i < kd * d; i++) got[i] = b[i];
            snprintf(what, sizeof what, "layer %lld %s weight", (long long)l, w ? "v" : "k");
            kvt_assert_close_f64(got, ref, kd * d, 1e-40, 0x1p-24 * 1.0001, what);
            free(ref), free(got);
            /* the bias: up·down_bias + up_bias, naive */
            double *nb = malloc((size_t)kd * sizeof *nb), *gb = malloc((size_t)kd * sizeof *gb);
            for (int64_t u = 0; u < s->n_units; u++) {
                const struct kv_lr_unit *x = &s->units[u];
                cr_assert_not_null(x->up_bias);
                for (int64_t i = 0; i < x->n_heads * c->head_dim; i++) {
                    double acc = x->up_bias[i];
                    for (int64_t k = 0; x->down_bias && k < x->rank; k++)
                        acc += (double)x->up[i * x->rank + k] * x->down_bias[k];
                    nb[x->head0 * c->head_dim + i] = acc;
                }
            }
            const float *bb = kv_model_weight(m2, bk, l);
            for (int64_t i = 0; i < kd; i++) gb[i] = bb[i];
            snprintf(what, sizeof what, "layer %lld %s bias", (long long)l, w ? "v" : "k");
            kvt_assert_close_f64(gb, nb, kd, 1e-40, 0x1p-24 * 1.0001, what);
            free(nb), free(gb);
        }
    for (int k = 0; k < KV_W_COUNT; k++) {
        if (k == KV_W_K || k == KV_W_V || k == KV_W_BK || k == KV_W_BV) continue;
        int64_t reps = k < KV_W_FIRST_LAYER ? 1 : c->n_layers;
        for (int64_t l = 0; l < reps; l++) {
            const float *a = kv_model_weight(m, (enum kv_wkind)k, l);
            const float *b = kv_model_weight(m2, (enum kv_wkind)k, l);
            cr_assert_eq(!a, !b);
            if (!a) continue;
            int64_t sh[2];
            int nd = kv_model_expected_shape(c, (enum kv_wkind)k, sh);
            int64_t n = nd == 2 ? sh[0] * sh[1] : sh[0];
            cr_assert(!memcmp(a, b, (size_t)n * sizeof *a), "%s of layer %lld changed",
                      kv_wkind_name((enum kv_wkind)k), (long long)l);
        }
    }
    int64_t n = 12, nv = n * c->vocab_size;
    float *comp = logits_of(m, lr, n), *dense = logits_of(m2, NULL, n);
    kvt_assert_close_f32(dense, comp, nv, 1e-5, 1e-4, "dense export vs centred compressed logits");
    free(comp), free(dense);
    kv_model_close(m2);
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    rm_tree(src);
    free(out), free(dir), free(src);
}
