/* A random-weight model at Llama-3.1-8B's exact shape, for timing kvcal on
 * a streamed model (tests/bench/bench_8b.sh drives it; docs/bench-8b.md).
 *
 *   bench_8b_model OUT_DIR [--layers N] [--seed S] [--shard-mb MB]
 *       writes an HF directory: config.json (tests/configs/Llama-3.1-8B.json
 *       with num_hidden_layers = N, default 32), BF16 safetensors shards of
 *       at most MB (default 4000) MB each with model.safetensors.index.json,
 *       and a byte-level tokenizer.json (one byte is one token; BOS 128000
 *       and EOS 128001 as config.json has them).
 *       Weights are N(0, 0.02)-ish (an Irwin-Hall sum of four uniforms from
 *       a counter-based generator, so a tensor's bytes do not depend on the
 *       thread count), norms 1. One shard's data is in memory at a time.
 *   bench_8b_model --sgemm [--layers N] [--tokens M]
 *       times cblas_sgemm X[M, in] · W[out, in]ᵀ at the forward's shapes
 *       (M = 2048 tokens by default) and prints GFLOP/s per shape, the
 *       forward's FLOPs per token and the sgemm-bound tokens/s of N layers.
 *
 * With no arguments it prints this usage and exits 0, so `make bench`,
 * which runs every build/bench binary bare, passes over it at once. */
#include <cblas.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "err.h"
#include "kvformats.h"
#include "mapfile.h"
#include "model.h"
#include "stwrite.h"

/* Llama-3.1-8B (tests/configs/Llama-3.1-8B.json) */
#define D_MODEL 4096
#define N_LAYERS 32
#define N_HEADS 32
#define N_KV_HEADS 8
#define HEAD_DIM 128
#define D_FFN 14336
#define VOCAB 128256
#define INIT_STD 0.02

static const char CONFIG_FMT[] =
    "{\n"
    "  \"architectures\": [\n"
    "    \"LlamaForCausalLM\"\n"
    "  ],\n"
    "  \"attention_bias\": false,\n"
    "  \"attention_dropout\": 0.0,\n"
    "  \"bos_token_id\": 128000,\n"
    "  \"eos_token_id\": 128001,\n"
    "  \"hidden_act\": \"silu\",\n"
    "  \"hidden_size\": 4096,\n"
    "  \"initializer_range\": 0.02,\n"
    "  \"intermediate_size\": 14336,\n"
    "  \"max_position_embeddings\": 131072,\n"
    "  \"mlp_bias\": false,\n"
    "  \"model_type\": \"llama\",\n"
    "  \"num_attention_heads\": 32,\n"
    "  \"num_hidden_layers\": %d,\n"
    "  \"num_key_value_heads\": 8,\n"
    "  \"pretraining_tp\": 1,\n"
    "  \"rms_norm_eps\": 1e-05,\n"
    "  \"rope_scaling\": {\n"
    "    \"factor\": 8.0,\n"
    "    \"low_freq_factor\": 1.0,\n"
    "    \"high_freq_factor\": 4.0,\n"
    "    \"original_max_position_embeddings\": 8192,\n"
    "    \"rope_type\": \"llama3\"\n"
    "  },\n"
    "  \"rope_theta\": 500000.0,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"torch_dtype\": \"bfloat16\",\n"
    "  \"transformers_version\": \"4.43.0.dev0\",\n"
    "  \"use_cache\": true,\n"
    "  \"vocab_size\": 128256\n"
    "}\n";

static void usage(FILE *f) {
    fprintf(f,
            "usage: bench_8b_model OUT_DIR [--layers N] [--seed S] [--shard-mb MB]\n"
            "       bench_8b_model --sgemm [--layers N] [--tokens M]\n"
            "\n"
            "Write a random-weight HF model with Llama-3.1-8B's config (N layers, default 32;\n"
            "BF16 shards of at most MB megabytes, default 4000; a byte-level tokenizer.json,\n"
            "one byte one token), or time OpenBLAS sgemm at the forward's shapes (M tokens,\n"
            "default 2048).\n"
            "Run by tests/bench/bench_8b.sh; with no arguments this prints usage and exits 0.\n");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* ------------------------------------------------------------ the tensors */

struct tdesc {
    char name[64];
    int ndim;
    int64_t shape[2];
    int ones; /* a norm: every weight 1 */
    int shard;
};

static int64_t t_elems(const struct tdesc *t) {
    return t->ndim == 1 ? t->shape[0] : t->shape[0] * t->shape[1];
}

/* HF's tensors of an n-layer Llama-3.1-8B, in the order they are written. */
static struct tdesc *plan_tensors(int64_t n_layers, int64_t *n_out) {
    int64_t n = 3 + 9 * n_layers, k = 0;
    struct tdesc *t = calloc((size_t)n, sizeof *t);
    if (!t) return NULL;
#define T2(nm, r, c) (snprintf(t[k].name, sizeof t[k].name, "%s", nm), t[k].ndim = 2, t[k].shape[0] = (r), t[k].shape[1] = (c), k++)
#define T1(nm, r) (snprintf(t[k].name, sizeof t[k].name, "%s", nm), t[k].ndim = 1, t[k].shape[0] = (r), t[k].ones = 1, k++)
    T2("model.embed_tokens.weight", VOCAB, D_MODEL);
    for (int64_t l = 0; l < n_layers; l++) {
        static const struct {
            const char *suffix;
            int64_t r, c;
        } lw[] = {{"input_layernorm.weight", D_MODEL, 0},
                  {"self_attn.q_proj.weight", N_HEADS * HEAD_DIM, D_MODEL},
                  {"self_attn.k_proj.weight", N_KV_HEADS * HEAD_DIM, D_MODEL},
                  {"self_attn.v_proj.weight", N_KV_HEADS * HEAD_DIM, D_MODEL},
                  {"self_attn.o_proj.weight", D_MODEL, N_HEADS * HEAD_DIM},
                  {"post_attention_layernorm.weight", D_MODEL, 0},
                  {"mlp.gate_proj.weight", D_FFN, D_MODEL},
                  {"mlp.up_proj.weight", D_FFN, D_MODEL},
                  {"mlp.down_proj.weight", D_MODEL, D_FFN}};
        for (size_t i = 0; i < sizeof lw / sizeof lw[0]; i++) {
            char nm[64];
            snprintf(nm, sizeof nm, "model.layers.%lld.%s", (long long)l, lw[i].suffix);
            if (lw[i].c) T2(nm, lw[i].r, lw[i].c);
            else T1(nm, lw[i].r);
        }
    }
    T1("model.norm.weight", D_MODEL);
    T2("lm_head.weight", VOCAB, D_MODEL);
#undef T1
#undef T2
    KV_ASSERT(k == n);
    *n_out = n;
    return t;
}

/* splitmix64 of a counter: any element's value from (seed, tensor, index). */
static inline uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n BF16 values of tensor ti into out: ones, or N(0, INIT_STD)-ish as the
 * sum of four 16-bit uniforms (mean 2, variance 1/3) centred and scaled. */
static void fill_tensor(uint16_t *out, int64_t n, int ones, uint64_t seed, int64_t ti) {
    if (ones) {
        uint16_t one = kv_f32_to_bf16(1.0f);
        for (int64_t i = 0; i < n; i++) out[i] = one;
        return;
    }
    uint64_t base = mix64(seed ^ mix64((uint64_t)ti + 1));
    const float scale = (float)(INIT_STD * sqrt(3.0)) / 65536.0f;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = mix64(base + (uint64_t)i);
        int32_t s = (int32_t)(r & 0xffff) + (int32_t)((r >> 16) & 0xffff) +
                    (int32_t)((r >> 32) & 0xffff) + (int32_t)(r >> 48) - 2 * 65535;
        out[i] = kv_f32_to_bf16((float)s * scale);
    }
}

struct text_out {
    const char *text;
};

static int fill_text(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    const struct text_out *o = ctx;
    size_t len = strlen(o->text), done = 0;
    while (done < len) {
        ssize_t w = write(fd, o->text + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                           strerror(errno));
        done += (size_t)w;
    }
    return KV_OK;
}

static int write_text(const char *dir, const char *name, const char *text, struct kv_err *err) {
    char *path = kv_path_join(dir, name);
    if (!path) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    struct text_out o = {text};
    int rc = kv_write_atomic(path, fill_text, &o, err);
    free(path);
    return rc;
}

/* tokenizer.json: byte-level BPE with Llama 3's special ids. Ids 0..255 are
 * the bytes and no merges are given, so one byte of text is one token; ids
 * 256..127999 are distinct 2- and 3-byte pieces that are never produced,
 * there only so "<|begin_of_text|>" is 128000 and "<|end_of_text|>" 128001
 * as config.json says (kv_hf_write_byte_tokenizer's 258 ids put BOS at 256,
 * which kvcal refuses beside config.json's bos_token_id 128000). */
static int write_tokenizer(const char *dir, struct kv_err *err) {
    enum { N = 128000 };
    char *bytes = malloc((size_t)N * 3);
    const char **pieces = malloc(N * sizeof *pieces);
    size_t *plen = malloc(N * sizeof *plen);
    char *path = kv_path_join(dir, "tokenizer.json");
    int rc;
    if (!bytes || !pieces || !plen || !path) {
        rc = kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    } else {
        for (int32_t i = 0; i < N; i++) {
            char *p = bytes + 3 * (size_t)i;
            pieces[i] = p;
            if (i < 256) {
                p[0] = (char)i, plen[i] = 1;
            } else if (i < 256 + 65536) {
                int32_t j = i - 256;
                p[0] = (char)(j >> 8), p[1] = (char)(j & 255), plen[i] = 2;
            } else {
                int32_t j = i - 256 - 65536;
                p[0] = (char)(j >> 16), p[1] = (char)((j >> 8) & 255), p[2] = (char)(j & 255);
                plen[i] = 3;
            }
        }
        rc = kv_hf_write_bpe_tokenizer(path, pieces, plen, N, NULL, 0, NULL, err);
    }
    free(bytes), free(pieces), free(plen), free(path);
    return rc;
}

static int write_model(const char *dir, int64_t n_layers, uint64_t seed, int64_t shard_mb) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t nt;
    struct tdesc *t = plan_tensors(n_layers, &nt);
    if (!t) return fprintf(stderr, "bench_8b_model: out of memory\n"), 1;

    /* shards: tensors in order, a new shard when the next would pass the cap */
    uint64_t cap = (uint64_t)shard_mb * 1000000ull, total = 0, cur = 0, biggest = 0;
    int n_shards = 1;
    double params = 0;
    for (int64_t i = 0; i < nt; i++) {
        uint64_t b = (uint64_t)t_elems(&t[i]) * 2;
        if (cur > 0 && cur + b > cap) {
            if (cur > biggest) biggest = cur;
            n_shards++, cur = 0;
        }
        t[i].shard = n_shards - 1;
        cur += b, total += b, params += (double)t_elems(&t[i]);
    }
    if (cur > biggest) biggest = cur;
    printf("model: Llama-3.1-8B shape, %lld layers, %.3f B parameters, %.2f GB BF16 in %d shard%s "
           "(largest %.2f GB in memory at a time), seed %llu\n",
           (long long)n_layers, params / 1e9, (double)total / 1e9, n_shards,
           n_shards == 1 ? "" : "s", (double)biggest / 1e9, (unsigned long long)seed);

    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench_8b_model: cannot create '%s': %s\n", dir, strerror(errno));
        free(t);
        return 1;
    }
    struct statvfs vfs;
    if (statvfs(dir, &vfs) == 0) {
        double avail = (double)vfs.f_bavail * (double)vfs.f_frsize;
        if (avail < (double)total * 1.01 + 1e8) {
            fprintf(stderr, "bench_8b_model: '%s' has %.2f GB free, the model needs %.2f GB\n",
                    dir, avail / 1e9, (double)total / 1e9);
            free(t);
            return 1;
        }
    }

    char cfg[sizeof CONFIG_FMT + 16];
    snprintf(cfg, sizeof cfg, CONFIG_FMT, (int)n_layers);
    int rc = write_text(dir, "config.json", cfg, &err);
    if (!rc) rc = write_tokenizer(dir, &err);
    if (rc) {
        free(t);
        return die(&err);
    }

    json_t *map = json_object();
    double t0 = now_s();
    uint64_t written = 0;
    int64_t i0 = 0;
    for (int s = 0; s < n_shards && !rc; s++) {
        int64_t i1 = i0;
        uint64_t sb = 0;
        while (i1 < nt && t[i1].shard == s) sb += (uint64_t)t_elems(&t[i1++]) * 2;
        char fname[64];
        snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        uint16_t *buf = malloc(sb);
        struct kv_stw *w = NULL;
        if (!buf) rc = kv_fail(&err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for %llu bytes",
                               (unsigned long long)sb);
        if (!rc) rc = kv_stw_init(&w, &err);
        if (!rc) rc = kv_stw_add_meta(w, "format", "pt", &err);
        double ts = now_s();
        uint16_t *p = buf;
        for (int64_t i = i0; i < i1 && !rc; i++) {
            int64_t n = t_elems(&t[i]);
            fill_tensor(p, n, t[i].ones, seed, i);
            rc = kv_stw_add(w, t[i].name, KV_DTYPE_BF16, t[i].ndim, t[i].shape, p,
                            (uint64_t)n * 2, &err);
            json_object_set_new(map, t[i].name, json_string(fname));
            p += n;
        }
        double tg = now_s() - ts;
        char *path = rc ? NULL : kv_path_join(dir, fname);
        if (!rc && !path) rc = kv_fail(&err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        if (!rc) rc = kv_stw_write(w, path, &err);
        struct stat st;
        if (!rc && stat(path, &st) == 0) written += (uint64_t)st.st_size;
        if (!rc)
            printf("shard %d/%d %s: %lld tensors, %.2f GB (generated in %.1f s, written in %.1f s), "
                   "%.2f GB so far, %.0f s\n",
                   s + 1, n_shards, fname, (long long)(i1 - i0), (double)sb / 1e9, tg,
                   now_s() - ts - tg, (double)written / 1e9, now_s() - t0);
        fflush(stdout);
        free(path);
        kv_stw_free(w);
        free(buf);
        i0 = i1;
    }
    if (!rc) {
        json_t *idx = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)total,
                                "weight_map", map);
        map = NULL;
        char *text = idx ? json_dumps(idx, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
        json_decref(idx);
        rc = text ? write_text(dir, "model.safetensors.index.json", text, &err)
                  : kv_fail(&err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
        free(text);
    }
    json_decref(map);
    free(t);
    if (rc) return die(&err);
    printf("wrote %s: %d shard%s, %llu bytes of safetensors (%.2f GB) in %.1f s\n", dir, n_shards,
           n_shards == 1 ? "" : "s", (unsigned long long)written, (double)written / 1e9,
           now_s() - t0);
    return 0;
}

/* ---------------------------------------------------------------- sgemm */

/* Best GFLOP/s of Y[m, n] = X[m, k] · W[n, k]ᵀ with Y's rows ldy apart
 * (ldy >= n: a slice of a wider output, as the streamed head writes its
 * 4096-row chunks into the logits). Calls until 1.5 s and 2 calls have run,
 * or one call past 5 s (Y is touched first, and the library is warm from
 * the shape before); the best call is counted. */
static double sgemm_gflops(int64_t m, int64_t n, int64_t k, int64_t ldy, int *calls) {
    float *a = malloc((size_t)(m * k) * sizeof *a), *b = malloc((size_t)(n * k) * sizeof *b);
    float *c = malloc((size_t)(m * ldy) * sizeof *c);
    if (!a || !b || !c) {
        free(a), free(b), free(c);
        return -1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m * k; i++) a[i] = (float)((i * 7) % 13) * 0.01f;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n * k; i++) b[i] = (float)((i * 5) % 11) * 0.01f;
    memset(c, 0, (size_t)(m * ldy) * sizeof *c);
    double best = 1e30, spent = 0;
    int it = 0;
    while (!((it >= 2 && spent >= 1.5) || (it >= 1 && spent >= 5.0))) {
        double t0 = now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)k, 1.0f, a,
                    (int)k, b, (int)k, 0.0f, c, (int)ldy);
        double dt = now_s() - t0;
        spent += dt, it++;
        if (dt < best) best = dt;
    }
    free(a), free(b), free(c);
    *calls = it;
    return 2.0 * (double)m * (double)n * (double)k / best / 1e9;
}

char *openblas_get_corename(void);
int openblas_get_num_threads(void);

static int run_sgemm(int64_t n_layers, int64_t m) {
    /* the forward's products per layer (out x in), and the head: a streamed
     * model's (every model past 2 GiB of float32 weights) in 4096-row chunks
     * into the logits, the chunk's rate standing for all 128256 rows; the
     * whole head in one product is timed for comparison, outside the mix */
    static const struct {
        const char *what;
        int64_t n, k, ldy;
        int per_layer; /* products of this shape per layer; 0: the head; -1: not in the mix */
    } sh[] = {{"q_proj, o_proj", N_HEADS * HEAD_DIM, D_MODEL, 0, 2},
              {"k_proj, v_proj", N_KV_HEADS * HEAD_DIM, D_MODEL, 0, 2},
              {"gate_proj, up_proj", D_FFN, D_MODEL, 0, 2},
              {"down_proj", D_MODEL, D_FFN, 0, 1},
              {"lm_head, 4096 rows", 4096, D_MODEL, VOCAB, 0},
              {"lm_head, whole", VOCAB, D_MODEL, 0, -1}};
    int ns = (int)(sizeof sh / sizeof sh[0]);
    printf("OpenBLAS %s kernels, %d threads, M = %lld tokens\n", openblas_get_corename(),
           openblas_get_num_threads(), (long long)m);
    printf("%-20s %-22s %6s %10s\n", "product", "M x N x K", "calls", "GFLOP/s");
    double lin_s = 0, lin_flops = 0, layer_s = 0, layer_flops = 0;
    for (int i = 0; i < ns; i++) {
        int calls = 0;
        int64_t ldy = sh[i].ldy ? sh[i].ldy : sh[i].n;
        double g = sgemm_gflops(m, sh[i].n, sh[i].k, ldy, &calls);
        if (g < 0) return fprintf(stderr, "bench_8b_model: out of memory\n"), 1;
        char dims[48];
        snprintf(dims, sizeof dims, "%lldx%lldx%lld%s", (long long)m, (long long)sh[i].n,
                 (long long)sh[i].k, ldy != sh[i].n ? " ldc" : "");
        printf("%-20s %-22s %6d %10.1f\n", sh[i].what, dims, calls, g);
        printf("sgemm_gflops %lld %lld %lld %.3f\n", (long long)sh[i].n, (long long)sh[i].k,
               (long long)ldy, g);
        fflush(stdout);
        if (sh[i].per_layer < 0) continue;
        /* FLOPs per token; the head's chunk stands for the whole vocabulary */
        double f = 2.0 * (double)(sh[i].per_layer ? sh[i].n : VOCAB) * (double)sh[i].k;
        double cnt = sh[i].per_layer ? (double)(sh[i].per_layer * n_layers) : 1.0;
        lin_flops += f * cnt, lin_s += f * cnt / (g * 1e9);
        if (sh[i].per_layer)
            layer_flops += f * sh[i].per_layer, layer_s += f * sh[i].per_layer / (g * 1e9);
    }
    /* causal attention: q·k and p·v over (T+1)/2 keys on average, per head
     * 2 * 2 * head_dim FLOPs per key */
    double attn = 4.0 * N_HEADS * HEAD_DIM * ((double)m + 1) / 2.0;
    double fwd = lin_flops + (double)n_layers * attn;
    /* collect stops at the last layer's post-RoPE keys: n-1 layers, the last
     * one's q, k, v, no head */
    double qkv = 2.0 * D_MODEL * (double)(N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM;
    double col = (layer_flops + attn) * (double)(n_layers - 1) + qkv;
    double mix = lin_flops / lin_s / 1e9, lmix = layer_flops / layer_s / 1e9;
    printf("\n%lld layers: forward %.4f GFLOP/token (linear %.4f, attention %.4f at %lld tokens)\n",
           (long long)n_layers, fwd / 1e9, lin_flops / 1e9, (double)n_layers * attn / 1e9,
           (long long)m);
    printf("sgemm rate at the forward's mix of products: %.1f GFLOP/s (layers alone %.1f)\n", mix,
           lmix);
    printf("sgemm-bound forward: %.1f tokens/s (linear products only)\n", 1e9 * mix / lin_flops);
    printf("flops_per_token_verify %.6e\n", fwd);
    printf("flops_per_token_collect %.6e\n", col);
    printf("sgemm_mix_gflops %.3f\n", mix);
    printf("sgemm_layer_gflops %.3f\n", lmix);
    printf("blas_kernels %s\n", openblas_get_corename());
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stdout);
        return 0;
    }
    const char *dir = NULL;
    int sgemm = 0;
    int64_t layers = N_LAYERS, seed = 0, shard_mb = 4000, tokens = 2048;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int64_t *dst = NULL, lo = 0, hi = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--sgemm")) {
            sgemm = 1;
            continue;
        } else if (!strcmp(a, "--layers")) {
            dst = &layers, lo = 1, hi = 1024;
        } else if (!strcmp(a, "--seed")) {
            dst = &seed, lo = 0, hi = INT64_MAX;
        } else if (!strcmp(a, "--shard-mb")) {
            dst = &shard_mb, lo = 1, hi = 1000000;
        } else if (!strcmp(a, "--tokens")) {
            dst = &tokens, lo = 1, hi = 65536;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "bench_8b_model: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (!dir) {
            dir = a;
            continue;
        } else {
            fprintf(stderr, "bench_8b_model: unexpected argument '%s'\n", a);
            return 2;
        }
        if (i + 1 >= argc || parse_i64(argv[i + 1], lo, hi, dst)) {
            fprintf(stderr, "bench_8b_model: option '%s' needs an integer in %lld..%lld\n", a,
                    (long long)lo, (long long)hi);
            return 2;
        }
        i++;
    }
    if (sgemm) return run_sgemm(layers, tokens);
    if (!dir) {
        usage(stderr);
        return 2;
    }
    return write_model(dir, layers, (uint64_t)seed, shard_mb);
}
