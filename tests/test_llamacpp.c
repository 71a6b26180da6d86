/* llama.cpp as an independent reference for the GGUF writer
 * (formats/ggufmodelw.c), for kvcal's forward pass and for its block codecs.
 * Models are written with kv_gguf_write_model, and llama.cpp's per-position
 * log-probabilities over the whole vocabulary (tests/llamacpp/logprobs.mjs:
 * its prebuilt CPU library through the npm package node-llama-cpp, F32 KV
 * cache) are compared with kvcal's own (kv_fwd_run, then the log-softmax of
 * tests/llamacpp/kvcal_logprobs.c, in process):
 *
 *   - random-weight Llama, Qwen2, Qwen3, Mistral and GPT-NeoX models at
 *     real head and GQA shapes (head_dim 64 and 128, GQA 4:1, 2:1 and
 *     Qwen2.5's 7:1, GPT-NeoX's partial rope and parallel residual,
 *     llama3, linear and yarn rope scaling, biases, tied and untied heads;
 *     Qwen2 and Qwen3 written as themselves with rotate-half q/k rows,
 *     Qwen3 with its per-head q/k norms at gains away from 1 and heads
 *     wider than dim as Qwen3-0.6B has them, Mistral as "llama"),
 *     128 ids from BOS, F32, Q8_0 and Q4_K matrices: the largest |Δ log p|
 *     must stay within the case's tolerance;
 *   - the real models at hand (data/kjv-llama, data/kjv-bpe-llama and,
 *     from ../shared, stories260K as GGUF and as llama2.c + tok512.bin,
 *     tinystories-656K) on an English text they tokenize: |Δ log p| within
 *     2e-3, and their vocabularies: llama.cpp decodes the ids to kvcal's
 *     text and encodes the text to the ids kvcal's reader of the written
 *     file gives (to the model's own ids where the vocabulary is written
 *     exactly);
 *   - a random Llama rewritten as DeepSeek-V2 multi-head latent attention
 *     (kv_mla_convert, kv_gguf_write_mla) and run by llama.cpp's deepseek2
 *     graph against kvcal's run of the model itself: with one KV head and
 *     the latent at full rank the rewrite is exact (2e-3); with two, it is
 *     exact at position 0 (which attends only to itself) and the cost of
 *     scoring the key energy outside the shared rope key without its
 *     rotation is logged; in every case, at full rank or not, llama.cpp
 *     computes what a float64 oracle of the MLA form computes
 *     (tests/naive_mla.h), to 2e-3; kjv-llama, stories260K,
 *     tinystories-656K and a Mistral exported at half the bytes: llama.cpp
 *     against kvcal's own MLA forward (kv_fwd_set_mla), to 2e-3; and the KV
 *     cache llama.cpp reports for kjv-llama and its export at 0.25 of the
 *     bytes is kvcal's count.
 *
 * For a block type the model's matrices are replaced by
 * kv_ggml_dequant(kv_ggml_quant(w)) after writing, so kvcal runs the very
 * weights its bytes encode, and llama.cpp decodes those bytes with its own
 * code: agreement checks kvcal's Q8_0 and Q4_K block layouts against
 * ggml's. llama.cpp also rounds the activations of every product with a
 * block-typed weight to 8 bits (Q8_0 blocks for Q8_0, Q8_K for Q4_K), which
 * kvcal does not, so these cases get a looser |Δ log p| tolerance and a
 * second test: llama.cpp's distributions must be at least twice as close
 * (mean KL) to kvcal's run of the decoded weights as to its run of the
 * weights before quantisation. tests/llamacpp/README.md has the
 * measurements.
 *
 * Needs node on PATH and deps/node/node_modules/node-llama-cpp (see
 * tests/llamacpp/README.md); skips, saying which is missing, without them.
 * Runs from the repository root, as make test does. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ggmlquant.h"
#include "gguf.h"
#include "ggufmodel.h"
#include "ggufmodelw.h"
#include "kvcalib.h"
#include "kvstats.h"
#include "model.h"
#include "naive_gemma2.h"
#include "naive_mla.h"
#include "naive_neox.h"
#include "testutil.h"
#include "xorshift64.h"

#define LOGPROBS_MJS "tests/llamacpp/logprobs.mjs"
#define NODE_PKG "deps/node/node_modules/node-llama-cpp/package.json"

/* Skip unless node and node-llama-cpp are there. */
static void need_llamacpp(void) {
    if (system("command -v node >/dev/null 2>&1") != 0)
        cr_skip_test("node is not on PATH; the llama.cpp comparison needs it; skipping");
    if (access(NODE_PKG, R_OK) != 0)
        cr_skip_test("'%s' is absent (npm install --prefix deps/node node-llama-cpp "
                     "@node-llama-cpp/linux-x64, tests/llamacpp/README.md); skipping",
                     NODE_PKG);
    if (access(LOGPROBS_MJS, R_OK) != 0)
        cr_skip_test("'%s' is absent (run from the repository root); skipping", LOGPROBS_MJS);
}

/* Random weights are N(0, 0.02): scale q and k so attention is not uniform,
 * and the head so the next-token distributions are peaked (logits of
 * standard deviation about 1.3 to 1.9). Sharper attention than this makes
 * the model chaotic: llama.cpp's rounding of activations (block types)
 * then flips which position a head attends to. */
static void shape_weights(struct kv_model *m) {
    const struct kv_config *c = kv_model_config(m);
    int64_t s[2];
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int k = KV_W_Q; k <= KV_W_K; k++) {
            float *w = kv_model_weight_mut(m, k, l);
            kv_model_expected_shape(c, k, s);
            for (int64_t i = 0; i < s[0] * s[1]; i++) w[i] *= 2;
        }
    float *head = kv_model_weight_mut(m, c->tied_embeddings ? KV_W_TOK_EMB : KV_W_LM_HEAD, 0);
    for (int64_t i = 0; i < c->vocab_size * c->dim; i++) head[i] *= 4;
}

/* Qwen3's per-head q/k RMSNorm gains, away from 1 and uneven along the head
 * and across layers (a norm dropped or misplaced changes the model): q
 * 0.8 to 1.6, k 1.2 to 2.0, so the normalised scores have a standard
 * deviation of about 1 to 3. Nothing for architectures without them. */
static void shape_norms(struct kv_model *m) {
    const struct kv_config *c = kv_model_config(m);
    if (kv_wkind_use(c, KV_W_QNORM) == KV_WUSE_NONE) return;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int k = KV_W_QNORM; k <= KV_W_KNORM; k++) {
            float *w = kv_model_weight_mut(m, k, l);
            cr_assert_not_null(w);
            for (int64_t i = 0; i < c->head_dim; i++)
                w[i] = (k == KV_W_QNORM ? 0.8f : 1.2f) + 0.1f * (float)((i * 5 + 3 * l + k) % 9);
        }
}

/* Every 2-D weight of m through type t and back, in place. */
static void round_matrices(struct kv_model *m, uint32_t t) {
    const struct kv_config *c = kv_model_config(m);
    int64_t s[2];
    for (int k = 0; k < KV_W_COUNT; k++)
        for (int64_t l = 0; l < (k < KV_W_FIRST_LAYER ? 1 : c->n_layers); l++) {
            float *w = kv_model_weight_mut(m, k, l);
            if (!w || kv_wkind_use(c, k) == KV_WUSE_NONE) continue;
            if (kv_model_expected_shape(c, k, s) != 2) continue;
            int64_t n = s[0] * s[1];
            void *q = malloc((size_t)(n / kv_ggml_block_elems(t) * kv_ggml_block_bytes(t)));
            cr_assert_eq(kv_ggml_quant(t, w, q, n), KV_OK);
            cr_assert_eq(kv_ggml_dequant(t, q, w, n), KV_OK);
            free(q);
        }
}

/* kvcal's log p(v | ids[0..i]) for i < P, [P][V], as kvcal_logprobs.c: one
 * run from position 0 (with mla's attention when not NULL), log-softmax of
 * the float32 logits in double. */
static double *kvcal_logprobs_mla(const struct kv_model *m, const struct kv_mla *mla,
                                  const int32_t *ids, int64_t P) {
    int64_t V = kv_model_config(m)->vocab_size;
    struct kv_fwd *f;
    struct kv_err e;
    cr_assert_eq(kv_fwd_init(m, P, &f, &e), KV_OK, "%s", e.msg);
    if (mla) cr_assert_eq(kv_fwd_set_mla(f, mla, &e), KV_OK, "%s", e.msg);
    float *lg = malloc((size_t)(P * V) * sizeof *lg);
    cr_assert_eq(kv_fwd_run(f, ids, P, 0, lg, &e), KV_OK, "%s", e.msg);
    kv_fwd_free(f);
    double *lp = malloc((size_t)(P * V) * sizeof *lp);
    for (int64_t i = 0; i < P * V; i++) lp[i] = lg[i];
    free(lg);
    kvt_log_softmax_rows(lp, P, V);
    return lp;
}

static double *kvcal_logprobs(const struct kv_model *m, const int32_t *ids, int64_t P) {
    return kvcal_logprobs_mla(m, NULL, ids, P);
}

/* The float64 oracle's log p for a GELU family (tests/naive_neox.h,
 * tests/naive_gemma2.h), with its GELU exact or evaluated as llama.cpp's CPU
 * backend does (fp16 in and out, tests/naive_gelu.h). */
static double *oracle_logprobs(const struct kv_model *m, const int32_t *ids, int64_t P, int fp16) {
    const struct kv_config *c = kv_model_config(m);
    int64_t V = c->vocab_size;
    *naive_gelu_fp16() = fp16;
    double *lg = c->arch == KV_ARCH_GPTNEOX ? naive_neox_forward(m, ids, P) : naive_gemma2_forward(m, ids, P);
    *naive_gelu_fp16() = 0;
    kvt_log_softmax_rows(lg, P, V);
    return lg;
}

/* Read an OUT.bin of logprobs.mjs: [P][V] float32 after the header. */
static double *read_logprobs(const char *path, int64_t P, int64_t V) {
    size_t len;
    char *b = kvt_read_file(path, &len);
    cr_assert_not_null(b, "cannot read %s", path);
    uint32_t hdr[2];
    memcpy(hdr, b, 8);
    cr_assert(hdr[0] == P && hdr[1] == V, "%s: %u x %u, expected %lld x %lld", path, hdr[0],
              hdr[1], (long long)P, (long long)V);
    cr_assert_eq(len, 8 + (size_t)(P * V) * 4);
    double *lp = malloc((size_t)(P * V) * sizeof *lp);
    for (int64_t i = 0; i < P * V; i++) {
        float x;
        memcpy(&x, b + 8 + 4 * i, 4);
        lp[i] = x;
    }
    free(b);
    return lp;
}

/* How llama.cpp's log-probabilities lc differ from kvcal's kv. */
struct diff {
    double max;           /* max |Δ log p| over positions and vocabulary */
    int64_t pos, tok;     /* where */
    double at_kv, at_lc;  /* the two values there */
    double kl;            /* mean over positions of KL(lc || kv) */
    double ppl_kv, ppl_lc;
};

static struct diff compare(const double *lc, const double *kv, const int32_t *ids, int64_t P,
                           int64_t V) {
    struct diff d = {0};
    double nll_kv = 0, nll_lc = 0;
    for (int64_t i = 0; i < P; i++) {
        for (int64_t v = 0; v < V; v++) {
            double a = kv[i * V + v], b = lc[i * V + v], x = fabs(a - b);
            if (!(x <= d.max)) d.max = isnan(x) ? INFINITY : x, d.pos = i, d.tok = v, d.at_kv = a, d.at_lc = b;
            d.kl += exp(b) * (b - a);
        }
        nll_kv -= kv[i * V + ids[i + 1]];
        nll_lc -= lc[i * V + ids[i + 1]];
    }
    d.kl /= (double)P;
    d.ppl_kv = exp(nll_kv / (double)P), d.ppl_lc = exp(nll_lc / (double)P);
    return d;
}

/* Run "node SCRIPT A B C OPTS" from the repository root; assert it exits 0,
 * quoting what it printed otherwise. */
static void run_node(const char *what, const char *script, const char *a, const char *b,
                     const char *c, const char *opts) {
    char cmd[4096], out[8192];
    snprintf(cmd, sizeof cmd, "node '%s' '%s' '%s' '%s' %s 2>&1", script, a, b, c, opts);
    FILE *pp = popen(cmd, "r");
    cr_assert_not_null(pp);
    size_t got = fread(out, 1, sizeof out - 1, pp);
    out[got] = 0;
    cr_assert_eq(pclose(pp), 0, "%s: node %s failed: %s", what, script, out);
}

/* Write n ids as text. */
static void write_ids(const char *path, const int32_t *ids, int64_t n) {
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    for (int64_t i = 0; i < n; i++) fprintf(f, "%d ", ids[i]);
    cr_assert_eq(fclose(f), 0);
}

struct lc_case {
    const char *name;
    enum kv_arch arch; /* llama, mistral (written as "llama"), qwen2 or qwen3 */
    int64_t dim, hidden, layers, heads, kv_heads, head_dim, vocab;
    enum kv_rope_layout layout;
    /* NONE, LINEAR (factor 4), LLAMA3 (Llama 3.2's) or YARN (Qwen2.5's
     * long-context setting: factor 4, original context 32768, beta_fast 32,
     * beta_slow 1, truncated) */
    enum kv_rope_scaling scaling;
    float theta;     /* rope theta; 0: 10000 (500000 with llama3) */
    double attn;     /* yarn: attention_factor, 0 for transformers' default */
    int tied, bias;
    uint32_t mtype;
    double tol; /* max |Δ log p| allowed */
    int64_t rope_dim; /* gptneox: the dimensions of each head rope turns */
    int parallel;     /* gptneox: parallel residual */
    int64_t window;   /* phi3: a sliding window in every layer, 0 for none */
};

#define N_IDS 128

static void run_case(const struct lc_case *k) {
    need_llamacpp();
    struct kv_config c = {0};
    c.arch = k->arch;
    c.dim = k->dim, c.hidden_dim = k->hidden, c.n_layers = k->layers;
    c.n_heads = k->heads, c.n_kv_heads = k->kv_heads, c.head_dim = k->head_dim;
    c.vocab_size = k->vocab, c.max_seq_len = 2048;
    c.norm_eps = k->arch == KV_ARCH_QWEN2 || k->arch == KV_ARCH_QWEN3 ? 1e-6f : 1e-5f;
    if (k->arch == KV_ARCH_GPTNEOX) /* llama.cpp runs gptneox with the tanh GELU */
        c.rope_dim = k->rope_dim, c.parallel_residual = k->parallel, c.gelu_erf = 0;
    c.rope_theta = k->theta > 0 ? k->theta : 10000.0f;
    c.rope_layout = k->layout;
    c.tied_embeddings = k->tied, c.has_qkv_bias = k->bias;
    c.bos_id = 1, c.eos_id = 2;
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = k->scaling;
    if (k->scaling == KV_ROPE_SCALING_LINEAR) s->factor = 4;
    if (k->scaling == KV_ROPE_SCALING_LLAMA3) {
        s->factor = 32, s->low_freq_factor = 1, s->high_freq_factor = 4, s->original_ctx = 8192;
        if (!(k->theta > 0)) c.rope_theta = 500000.0f;
    }
    if (k->scaling == KV_ROPE_SCALING_LONGROPE) { /* Phi-3-mini-128k's shape of factors */
        s->factor = 32, s->original_ctx = 4096, s->attention_factor = k->attn;
        s->n_factors = c.head_dim / 2;
        for (int64_t i = 0; i < s->n_factors; i++)
            s->short_factor[i] = 1.0f + 0.05f * (float)i, s->long_factor[i] = 1.0f + 1.5f * (float)i;
    }
    c.sliding_window = k->window, c.window_period = k->window ? 1 : 0;
    if (k->arch == KV_ARCH_GEMMA2) { /* Gemma 2's soft-caps, (1 + w) gains, even-layer windows */
        c.window_period = k->window ? 2 : 0, c.norm_eps = 1e-6f;
        c.attn_softcap = 50.0f, c.final_softcap = 30.0f, c.norm_offset = 1.0f;
        c.attn_scale = (float)(1.0 / sqrt((double)k->head_dim));
    }
    if (k->scaling == KV_ROPE_SCALING_YARN) {
        s->factor = 4, s->original_ctx = 32768, s->beta_fast = 32, s->beta_slow = 1;
        s->truncate = 1, s->attention_factor = k->attn;
    }
    struct kv_model *m;
    struct kv_err e;
    cr_assert_eq(kv_model_init_random(&c, 1000 + (uint64_t)k->dim + (uint64_t)k->head_dim, &m, &e),
                 KV_OK, "%s", e.msg);
    shape_weights(m);
    shape_norms(m);

    /* BOS, then random ids */
    const int64_t n = N_IDS, P = n - 1, V = c.vocab_size;
    int32_t ids[N_IDS];
    uint64_t st = 0x9e3779b97f4a7c15ull ^ (uint64_t)V;
    for (int64_t i = 0; i < n; i++) ids[i] = i == 0 ? 1 : (int32_t)(rng_next(&st) % (uint64_t)V);

    char *dir = kvt_temp_dir(), *gguf = kvt_path(dir, "m.gguf"), *ids_path = kvt_path(dir, "ids.txt");
    char *lc_path = kvt_path(dir, "lc.bin");
    struct kv_gguf_write_opts o = {.matrix_type = k->mtype};
    cr_assert_eq(kv_gguf_write_model(m, gguf, &o, &e), KV_OK, "%s", e.msg);
    write_ids(ids_path, ids, n);

    run_node(k->name, LOGPROBS_MJS, gguf, ids_path, lc_path, "--threads 1 --logits-only");
    double *lc = read_logprobs(lc_path, P, V);

    /* the weights before and after their round trip through the block type */
    double *kv_f32 = NULL;
    if (k->mtype != KV_GGML_F32) {
        kv_f32 = kvcal_logprobs(m, ids, P);
        round_matrices(m, k->mtype);
    }
    double *kv = kvcal_logprobs(m, ids, P);
    struct diff d = compare(lc, kv, ids, P, V);
    cr_log_info("%s: max |dlogp| %.2e at position %lld token %lld (kvcal %.6f, llama.cpp %.6f); "
                "mean KL %.2e; ppl kvcal %.6f llama.cpp %.6f",
                k->name, d.max, (long long)d.pos, (long long)d.tok, d.at_kv, d.at_lc, d.kl,
                d.ppl_kv, d.ppl_lc);
    cr_expect(d.max <= k->tol,
              "%s: max |dlogp| %.3g at position %lld token %lld (kvcal %.6f, llama.cpp %.6f), "
              "tolerance %.3g; ppl kvcal %.6f llama.cpp %.6f",
              k->name, d.max, (long long)d.pos, (long long)d.tok, d.at_kv, d.at_lc, k->tol,
              d.ppl_kv, d.ppl_lc);
    if (k->tol > 2e-3 && k->mtype == KV_GGML_F32) {
        /* a GELU family, whose looser bound is llama.cpp's fp16 GELU: the
         * float64 oracle with that GELU must agree with llama.cpp to 2e-3,
         * and with the exact GELU, with kvcal to float32 rounding */
        double *o16 = oracle_logprobs(m, ids, P, 1), *o64 = oracle_logprobs(m, ids, P, 0);
        struct diff dl = compare(lc, o16, ids, P, V), dk = compare(o64, kv, ids, P, V);
        cr_log_info("%s: llama.cpp against the oracle with its fp16 GELU: max |dlogp| %.2e at "
                    "position %lld token %lld, mean KL %.2e; kvcal against the exact oracle: "
                    "max %.2e",
                    k->name, dl.max, (long long)dl.pos, (long long)dl.tok, dl.kl, dk.max);
        cr_expect(dl.max <= 2e-3,
                  "%s: llama.cpp against the float64 oracle with llama.cpp's fp16 GELU: max "
                  "|dlogp| %.3g at position %lld token %lld, tolerance 2e-3",
                  k->name, dl.max, (long long)dl.pos, (long long)dl.tok);
        cr_expect(dk.max <= 1e-4,
                  "%s: kvcal against the exact float64 oracle: max |dlogp| %.3g at position "
                  "%lld token %lld, tolerance 1e-4",
                  k->name, dk.max, (long long)dk.pos, (long long)dk.tok);
        free(o16), free(o64);
    }
    if (kv_f32) {
        /* llama.cpp decodes the bytes to kvcal's decoded weights, not to
         * something else near the originals: its distributions are much
         * closer to kvcal's run of the decoded weights than to its run of
         * the weights before quantisation */
        struct diff d0 = compare(lc, kv_f32, ids, P, V);
        cr_log_info("%s: before quantisation: max |dlogp| %.2e, mean KL %.2e, ppl %.6f", k->name,
                    d0.max, d0.kl, d0.ppl_kv);
        cr_expect(d.kl <= 0.5 * d0.kl,
                  "%s: mean KL(llama.cpp || kvcal) %.3g with kvcal's decoded weights, %.3g with "
                  "the weights before quantisation: expected at most half",
                  k->name, d.kl, d0.kl);
        free(kv_f32);
    }
    free(kv), free(lc);
    unlink(gguf), unlink(ids_path), unlink(lc_path);
    free(gguf), free(ids_path), free(lc_path);
    kvt_rm_dir(dir);
    kv_model_close(m);
}

#define HALF KV_ROPE_HALF
#define INTL KV_ROPE_INTERLEAVED
#define NONE KV_ROPE_SCALING_NONE
#define LIN KV_ROPE_SCALING_LINEAR
#define L3 KV_ROPE_SCALING_LLAMA3
#define YARN KV_ROPE_SCALING_YARN
#define LLAMA KV_ARCH_LLAMA
#define MISTRAL KV_ARCH_MISTRAL
#define QWEN2 KV_ARCH_QWEN2
#define QWEN3 KV_ARCH_QWEN3
#define NEOX KV_ARCH_GPTNEOX
#define PHI3 KV_ARCH_PHI3
#define LONG KV_ROPE_SCALING_LONGROPE
#define GEMMA2 KV_ARCH_GEMMA2

/* llama.cpp rounds the activations of each product with a Q8_0 or Q4_K
 * weight to 8 bits: measured 0.13 and 0.16 at most (tests/llamacpp/README.md),
 * against 0.23 and 2.4 between llama.cpp and kvcal's run of the weights
 * before quantisation; a block layout kvcal got wrong gives garbage.
 *
 * The qwen2 rows are Qwen2.5 scaled down: GQA 7:1 (0.5B has 14:2, 7B
 * 28:4), heads of 64 and 128, n_heads * head_dim = dim (llama.cpp's qwen2
 * needs it), FFN 5.4 times dim, q/k/v biases, theta 1e6, tied head.
 * Mistral 7B scaled down: GQA 4:1, heads of 128, theta 1e6, untied.
 * The qwen3 rows are Qwen3-0.6B scaled down: heads of 128, GQA 2:1 (0.6B
 * has 16:8), n_heads * head_dim twice dim (16 * 128 against 1024, which
 * llama.cpp's qwen3 sizes by key_length), FFN 3 times dim, theta 1e6, tied
 * head, no biases, q/k norms away from 1 (shape_norms); one from
 * interleaved rows with biases and an untied head (the norms are permuted
 * with the rows), one with Qwen3's yarn (factor 4, original context
 * 32768).
 * The gptneox rows are Pythia scaled down: MHA, a quarter of each head
 * turned (rotary_pct 0.25; one with half of heads of 128), parallel and
 * sequential residuals, biases everywhere, untied head, tanh GELU (what
 * llama.cpp's gptneox graph computes). llama.cpp's CPU GELU looks its
 * result up in a table of every fp16 input, rounded to fp16: measured max
 * |Δ log p| 3.2e-3 and 3.6e-3 against kvcal's float32 GELU, and 1.15e-3 and
 * 1.17e-3 (mean KL 2e-7 -> 4e-9) when kvcal's GELU was made to round the
 * same way for the measurement; hence their 5e-3. run_case checks that
 * reason on each F32 gptneox and gemma2 case: the float64 oracle with
 * llama.cpp's fp16 GELU (tests/naive_gelu.h) agrees with llama.cpp to
 * 2e-3, and the exact oracle with kvcal to 1e-4. */
static const struct lc_case cases[] = {
    /* name                   arch  dim  hid  L  h  g  d_h vocab layout scaling theta attn tied bias type  tol */
    {"hd64-gqa4-llama3-f32", LLAMA, 512, 1024, 2, 8, 2, 64, 1024, HALF, L3, 0, 0, 1, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"hd128-gqa2-bias-f32", LLAMA, 512, 768, 3, 4, 2, 128, 2048, INTL, NONE, 0, 0, 0, 1, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"hd64-heads-wider-f32", LLAMA, 256, 512, 2, 8, 4, 64, 512, HALF, NONE, 0, 0, 0, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"hd64-gqa2-linear-f32", LLAMA, 384, 768, 2, 6, 3, 64, 768, HALF, LIN, 0, 0, 1, 1, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"hd64-vocab200-f32", LLAMA, 256, 512, 1, 4, 2, 64, 200, HALF, NONE, 0, 0, 1, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"hd64-gqa4-llama3-q8_0", LLAMA, 512, 1024, 2, 8, 2, 64, 1024, HALF, L3, 0, 0, 1, 0, 8, 0.5, 0, 0, 0},
    {"hd128-gqa2-bias-q4_k", LLAMA, 512, 768, 3, 4, 2, 128, 2048, INTL, NONE, 0, 0, 0, 1, 12, 0.5, 0, 0, 0},
    {"hd64-gqa2-yarn-attn-f32", LLAMA, 384, 768, 2, 6, 3, 64, 768, HALF, YARN, 0, 1.2, 1, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"qwen2-hd64-gqa7-f32", QWEN2, 448, 2432, 2, 7, 1, 64, 1024, HALF, NONE, 1e6f, 0, 1, 1, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"qwen2-hd128-gqa7-f32", QWEN2, 896, 4864, 2, 7, 1, 128, 2048, INTL, NONE, 1e6f, 0, 1, 1, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"qwen2-hd64-gqa7-yarn-f32", QWEN2, 448, 2432, 2, 7, 1, 64, 1024, HALF, YARN, 1e6f, 0, 0, 1, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"mistral-hd128-gqa4-f32", MISTRAL, 512, 1792, 2, 4, 1, 128, 1024, HALF, NONE, 1e6f, 0, 0, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"qwen3-hd128-gqa2-f32", QWEN3, 256, 768, 2, 4, 2, 128, 1024, HALF, NONE, 1e6f, 0, 1, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"qwen3-hd128-gqa2-intl-bias-f32", QWEN3, 256, 768, 2, 4, 2, 128, 1024, INTL, NONE, 1e6f, 0, 0, 1, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"qwen3-hd128-gqa2-yarn-f32", QWEN3, 256, 768, 2, 4, 2, 128, 1024, HALF, YARN, 1e6f, 0, 1, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"neox-hd64-rot16-parallel-f32", NEOX, 512, 2048, 2, 8, 8, 64, 1024, HALF, NONE, 0, 0, 0, 1, KV_GGML_F32, 5e-3, 16, 1, 0},
    {"neox-hd128-rot32-sequential-f32", NEOX, 512, 2048, 2, 4, 4, 128, 1024, HALF, NONE, 0, 0, 0, 1, KV_GGML_F32, 5e-3, 32, 0, 0},
    {"neox-hd64-rot16-parallel-q4_k", NEOX, 512, 2048, 2, 8, 8, 64, 1024, HALF, NONE, 0, 0, 0, 1, 12, 0.5, 16, 1, 0},
    {"phi3-hd96-f32", PHI3, 384, 1024, 2, 4, 4, 96, 1024, HALF, NONE, 0, 0, 0, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"phi3-hd96-longrope-f32", PHI3, 384, 1024, 2, 4, 4, 96, 1024, HALF, LONG, 0, 0, 0, 0, KV_GGML_F32, 2e-3, 0, 0, 0},
    {"phi3-hd96-q8_0", PHI3, 384, 1024, 2, 4, 4, 96, 1024, HALF, NONE, 0, 0, 0, 0, 8, 0.5, 0, 0, 0},
    {"gemma2-hd256-gqa2-f32", GEMMA2, 512, 1024, 2, 4, 2, 256, 1024, HALF, NONE, 0, 0, 1, 0, KV_GGML_F32, 5e-3, 0, 0, 0},
    {"gemma2-hd256-gqa2-window-f32", GEMMA2, 512, 1024, 2, 4, 2, 256, 1024, HALF, NONE, 0, 0, 1, 0, KV_GGML_F32, 5e-3, 0, 0, 24},
};

Test(llamacpp, hd64_gqa4_llama3_f32) { run_case(&cases[0]); }
Test(llamacpp, hd128_gqa2_bias_f32) { run_case(&cases[1]); }
Test(llamacpp, hd64_heads_wider_than_dim_f32) { run_case(&cases[2]); }
Test(llamacpp, hd64_gqa2_linear_scaling_f32) { run_case(&cases[3]); }
Test(llamacpp, hd64_small_byte_level_vocabulary_f32) { run_case(&cases[4]); }
Test(llamacpp, hd64_gqa4_llama3_q8_0) { run_case(&cases[5]); }
Test(llamacpp, hd128_gqa2_bias_q4_k) { run_case(&cases[6]); }
Test(llamacpp, hd64_gqa2_yarn_attention_factor_f32) { run_case(&cases[7]); }
Test(llamacpp, qwen2_hd64_gqa7_rotate_half_f32) { run_case(&cases[8]); }
Test(llamacpp, qwen2_hd128_gqa7_from_interleaved_f32) { run_case(&cases[9]); }
Test(llamacpp, qwen2_hd64_gqa7_yarn_f32) { run_case(&cases[10]); }
Test(llamacpp, mistral_hd128_gqa4_as_llama_f32) { run_case(&cases[11]); }
Test(llamacpp, qwen3_hd128_gqa2_heads_wider_than_dim_qk_norms_f32) { run_case(&cases[12]); }
Test(llamacpp, qwen3_hd128_gqa2_from_interleaved_bias_f32) { run_case(&cases[13]); }
Test(llamacpp, qwen3_hd128_gqa2_yarn_f32) { run_case(&cases[14]); }
Test(llamacpp, gptneox_hd64_rope16_parallel_f32) { run_case(&cases[15]); }
Test(llamacpp, gptneox_hd128_rope32_sequential_f32) { run_case(&cases[16]); }
Test(llamacpp, gptneox_hd64_rope16_parallel_q4_k) { run_case(&cases[17]); }
Test(llamacpp, phi3_hd96_f32) { run_case(&cases[18]); }
Test(llamacpp, phi3_hd96_longrope_f32) { run_case(&cases[19]); }
Test(llamacpp, phi3_hd96_q8_0) { run_case(&cases[20]); }
Test(llamacpp, gemma2_hd256_gqa2_f32) { run_case(&cases[21]); }
Test(llamacpp, gemma2_hd256_gqa2_even_layer_window_f32) { run_case(&cases[22]); }

/* ---------------------------------------------------------------- real models */

/* llama.cpp's view of a vocabulary: OUT.detok, the text of the ids of IDS
 * (detokenize, special tokens not rendered), and OUT.tok, the ids of the
 * text of TEXT (tokenize, no BOS, special tokens as text). */
static const char TOKENIZER_MJS[] =
    "import fs from 'node:fs';\n"
    "const common = await import(new URL('tests/llamacpp/common.mjs', 'file://' + process.cwd() + '/').href);\n"
    "const [model, idsFile, textFile, out] = process.argv.slice(2);\n"
    "const mod = await common.loadNodeLlamaCpp();\n"
    "const { llama } = await common.cpuLlama(mod, { threads: 1 });\n"
    "const m = await llama.loadModel({ modelPath: model, gpuLayers: 0 });\n"
    "const ids = fs.readFileSync(idsFile, 'utf8').trim().split(/\\s+/).map(Number);\n"
    "fs.writeFileSync(out + '.detok', m.detokenize(ids, false));\n"
    "const text = fs.readFileSync(textFile, 'utf8');\n"
    "fs.writeFileSync(out + '.tok', Array.from(m.tokenize(text, false)).join(' '));\n"
    "await m.dispose();\n"
    "await llama.dispose();\n";

static int32_t *read_id_list(const char *path, int64_t *n) {
    size_t len;
    char *s = kvt_read_file(path, &len);
    cr_assert_not_null(s, "cannot read %s", path);
    int32_t *ids = malloc((len / 2 + 1) * sizeof *ids);
    int64_t k = 0;
    for (char *p = s, *end; *p; p = end) {
        long v = strtol(p, &end, 10);
        if (end == p) break;
        ids[k++] = (int32_t)v;
    }
    free(s);
    *n = k;
    return ids;
}

struct real_case {
    const char *name;
    const char *model;     /* under the repository, or under ../shared when shared */
    const char *tokenizer; /* likewise; NULL: the model's own */
    int shared;
    int same_text_ids;     /* llama.cpp encodes text as the model's own tokenizer does */
};

static const char REAL_TEXT[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park.\nOne day, she saw a big, red ball. \"Can I play?\" she asked her mom.\n";

/* The paths of model and tokenizer (NULL: none) under ../shared when
 * shared, else as given; skips the test when a shared one is absent. */
static void real_paths(const char *model, const char *tokenizer, int shared, char mpath[1024],
                       char tpath[1024]) {
    const char *p = shared ? kvt_shared(model) : model;
    if (!p) cr_skip_test("shared model '%s' is absent; skipping", model);
    snprintf(mpath, 1024, "%s", p);
    tpath[0] = 0;
    if (!tokenizer) return;
    p = shared ? kvt_shared(tokenizer) : tokenizer;
    if (!p) cr_skip_test("shared tokenizer '%s' is absent; skipping", tokenizer);
    snprintf(tpath, 1024, "%s", p);
}

static void run_real(const struct real_case *k) {
    need_llamacpp();
    char mpath[1024], tpath[1024];
    real_paths(k->model, k->tokenizer, k->shared, mpath, tpath);
    struct kv_model *m;
    struct kv_err e;
    char msg[2200];
    int rc = kv_model_open(mpath, k->tokenizer ? tpath : NULL, &m, &e);
    kv_err_format(&e, msg, sizeof msg, 0);
    cr_assert_eq(rc, KV_OK, "%s", msg);
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    cr_assert_not_null(tok);
    int32_t *ids;
    int64_t n;
    cr_assert_eq(kv_tok_encode(tok, REAL_TEXT, strlen(REAL_TEXT), kv_tok_policy(tok), &ids, &n, &e),
                 KV_OK, "%s", e.msg);
    int64_t P = n - 1, V = kv_model_config(m)->vocab_size;

    char *dir = kvt_temp_dir(), *gguf = kvt_path(dir, "m.gguf"), *ids_path = kvt_path(dir, "ids.txt");
    char *lc_path = kvt_path(dir, "lc.bin"), *text_path = kvt_path(dir, "text.txt");
    char *mjs = kvt_path(dir, "tok.mjs"), *out = kvt_path(dir, "lc");
    cr_assert_eq(kv_gguf_write_model(m, gguf, NULL, &e), KV_OK, "%s", e.msg);
    write_ids(ids_path, ids, n);

    /* the forward passes, on the text the model was trained for */
    run_node(k->name, LOGPROBS_MJS, gguf, ids_path, lc_path, "--threads 1 --logits-only");
    double *lc = read_logprobs(lc_path, P, V), *kv = kvcal_logprobs(m, ids, P);
    struct diff d = compare(lc, kv, ids, P, V);
    cr_log_info("%s: %lld ids: max |dlogp| %.2e at position %lld token %lld (kvcal %.6f, "
                "llama.cpp %.6f); mean KL %.2e; ppl kvcal %.6f llama.cpp %.6f",
                k->name, (long long)n, d.max, (long long)d.pos, (long long)d.tok, d.at_kv, d.at_lc,
                d.kl, d.ppl_kv, d.ppl_lc);
    cr_expect(d.max <= 2e-3, "%s: max |dlogp| %.3g at position %lld token %lld (kvcal %.6f, "
              "llama.cpp %.6f); ppl kvcal %.6f llama.cpp %.6f",
              k->name, d.max, (long long)d.pos, (long long)d.tok, d.at_kv, d.at_lc, d.ppl_kv,
              d.ppl_lc);

    /* the vocabulary: llama.cpp decodes the ids to kvcal's text, and
     * encodes text as kvcal's reader of the written file does */
    FILE *f = fopen(mjs, "w");
    cr_assert_not_null(f);
    fputs(TOKENIZER_MJS, f);
    fclose(f);
    f = fopen(text_path, "w");
    cr_assert_not_null(f);
    fputs(REAL_TEXT, f);
    fclose(f);
    run_node(k->name, mjs, gguf, ids_path, text_path, out);
    char *detok_path = kvt_path(dir, "lc.detok"), *tok_path = kvt_path(dir, "lc.tok");
    size_t dlen;
    char *detok = kvt_read_file(detok_path, &dlen);
    cr_assert_not_null(detok);
    char dec[4096];
    size_t o = 0;
    for (int64_t i = 0; i < n; i++)
        o += kv_tok_decode(tok, i ? ids[i - 1] : -1, ids[i], dec + o, sizeof dec - o);
    cr_assert_lt(o, sizeof dec);
    /* llama.cpp keeps the dummy-prefix space after BOS that kvcal's
     * decoder (like SentencePiece's) drops */
    const char *lt = detok;
    if (dlen == o + 1 && detok[0] == ' ' && (o == 0 || dec[0] != ' ')) lt++, dlen--;
    cr_expect(dlen == o && !memcmp(lt, dec, o),
              "%s: llama.cpp decodes the ids to\n%.*s\nkvcal to\n%.*s", k->name, (int)dlen, lt,
              (int)o, dec);
    struct kv_tokenizer *back;
    cr_assert_eq(kv_gguf_load_tokenizer(gguf, &back, &e), KV_OK, "%s", e.msg);
    int32_t *kids, *lids;
    int64_t kn, ln;
    cr_assert_eq(kv_tok_encode(back, REAL_TEXT, strlen(REAL_TEXT), 0, &kids, &kn, &e), KV_OK, "%s",
                 e.msg);
    lids = read_id_list(tok_path, &ln);
    int64_t first = 0;
    while (first < kn && first < ln && kids[first] == lids[first]) first++;
    cr_expect(kn == ln && first == kn,
              "%s: llama.cpp encodes the text to %lld ids, kvcal's reader of the file to %lld; "
              "first difference at %lld (%d, %d)",
              k->name, (long long)ln, (long long)kn, (long long)first,
              first < ln ? lids[first] : -1, first < kn ? kids[first] : -1);
    int64_t skip = n > 0 && ids[0] == kv_tok_bos(tok); /* ids has BOS, kids none */
    int same = kn == n - skip && !memcmp(kids, ids + skip, (size_t)kn * sizeof *kids);
    if (k->same_text_ids)
        cr_expect(same, "%s: the written vocabulary encodes the text differently from the model's "
                  "own", k->name);
    cr_log_info("%s: text of %zu bytes: %lld ids from the model's tokenizer, %lld from the "
                "written vocabulary (%s; llama.cpp and kvcal's reader agree: %s)",
                k->name, strlen(REAL_TEXT), (long long)(n - skip), (long long)ln,
                same ? "the same ids" : "other ids", kn == ln && first == kn ? "yes" : "no");
    free(kids), free(lids), free(detok);
    kv_tok_free(back);
    free(kv), free(lc), free(ids);
    char *files[] = {gguf, ids_path, lc_path, text_path, mjs, detok_path, tok_path};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) unlink(files[i]), free(files[i]);
    free(out);
    kvt_rm_dir(dir);
    kv_model_close(m);
}

static const struct real_case reals[] = {
    {"kjv-llama", "data/kjv-llama", NULL, 0, 0},
    {"kjv-bpe-llama", "data/kjv-bpe-llama", NULL, 0, 0},
    {"stories260K-gguf", "models/stories260K/stories260K.gguf", NULL, 1, 1},
    {"stories260K-llama2c", "models/stories260K/stories260K.bin", "models/stories260K/tok512.bin", 1, 1},
    {"tinystories-656K", "models/tinystories-656K", NULL, 1, 0},
};

Test(llamacpp, real_kjv_llama_byte_vocabulary) { run_real(&reals[0]); }
Test(llamacpp, real_kjv_bpe_llama_byte_level_vocabulary) { run_real(&reals[1]); }
Test(llamacpp, real_stories260k_gguf) { run_real(&reals[2]); }
Test(llamacpp, real_stories260k_llama2c_with_tokenizer) { run_real(&reals[3]); }
Test(llamacpp, real_tinystories_656k_hf) { run_real(&reals[4]); }

/* ---------------------------------------------------------------- MLA export */

/* Statistics of m over `windows` windows of 64 ids drawn below vocab from
 * *st (the first id 1 when bos). */
static struct kv_stats *random_stats(const struct kv_model *m, int windows, uint64_t vocab, int bos,
                                     uint64_t *st) {
    struct kv_stats *s;
    struct kv_accum *a;
    struct kv_err e;
    cr_assert_eq(kv_stats_init(kv_model_config(m), &s, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_accum_init(m, s, 64, &a, &e), KV_OK, "%s", e.msg);
    int32_t win[64];
    for (int w = 0; w < windows; w++) {
        for (int i = 0; i < 64; i++) win[i] = bos && i == 0 ? 1 : (int32_t)(rng_next(st) % vocab);
        cr_assert_eq(kv_accum_window(a, win, &e), KV_OK, "%s", e.msg);
    }
    kv_accum_sync(a);
    kv_accum_free(a);
    return s;
}

/* A random Llama as DeepSeek-V2 MLA (kv_mla_convert, kv_gguf_write_mla),
 * run by llama.cpp's deepseek2 graph, against kvcal's run of the model
 * itself. With one KV head the rewrite is exact at full latent rank
 * (docs/design.md, "Export as Multi-head Latent Attention"): every pair's
 * component 0 is the whole key. */
struct mla_case {
    const char *name;
    int64_t kv_heads;
    enum kv_rope_layout layout;
    int64_t rank, rope_dim, rope_step; /* rank 0: full */
    double tol;                        /* max |Δ log p| allowed; 0: only measured */
    int turned;                        /* what loses RoPE turned (kv_mla_fit_turn) */
};

static void run_mla(const struct mla_case *k) {
    need_llamacpp();
    struct kv_config c = {0};
    c.arch = KV_ARCH_LLAMA;
    c.dim = 256, c.hidden_dim = 512, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = k->kv_heads;
    c.head_dim = 64, c.vocab_size = 300, c.max_seq_len = 2048, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.rope_layout = k->layout, c.bos_id = 1, c.eos_id = 2;
    struct kv_model *m;
    struct kv_err e;
    cr_assert_eq(kv_model_init_random(&c, 77 + (uint64_t)k->kv_heads, &m, &e), KV_OK, "%s", e.msg);
    shape_weights(m);
    shape_norms(m);
    /* calibration statistics of 8 random windows of 64 */
    uint64_t st = 0x51ed270b27c6f4a3ull;
    struct kv_stats *s = random_stats(m, 8, 300, 1, &st);
    struct kv_mla_opts mo = {k->rank ? k->rank : 2 * k->kv_heads * 64, k->rope_dim, k->rope_step, 1, 0,
                             NULL, 0, 0};
    int32_t calib[2 * N_IDS];
    if (k->turned) { /* the turn fitted on two more random windows */
        for (int i = 0; i < 2 * N_IDS; i++) calib[i] = i % N_IDS == 0 ? 1 : (int32_t)(rng_next(&st) % 300);
        mo.calib_tokens = calib, mo.calib_windows = 2, mo.seq_len = N_IDS;
    }
    struct kv_mla *mla;
    struct kv_mla_layer_info info[2];
    cr_assert_eq(kv_mla_convert(m, s, &mo, &mla, info, &e), KV_OK, "%s", e.msg);
    for (int l = 0; l < 2; l++)
        cr_log_info("%s: layer %d: rope keeps %.4f of the key energy, the latent %.6f of the "
                    "joint; alpha %.3g (latent rms at most %.3g)",
                    k->name, l, info[l].rope_share, info[l].latent_share, info[l].alpha,
                    info[l].latent_rms_bound);
    const int64_t n = N_IDS, P = n - 1, V = c.vocab_size;
    int32_t ids[N_IDS];
    for (int64_t i = 0; i < n; i++) ids[i] = i == 0 ? 1 : (int32_t)(rng_next(&st) % (uint64_t)V);
    char *dir = kvt_temp_dir(), *gguf = kvt_path(dir, "mla.gguf"), *ids_path = kvt_path(dir, "ids.txt");
    char *lc_path = kvt_path(dir, "lc.bin");
    cr_assert_eq(kv_gguf_write_mla(m, mla, gguf, NULL, &e), KV_OK, "%s", e.msg);
    write_ids(ids_path, ids, n);
    run_node(k->name, LOGPROBS_MJS, gguf, ids_path, lc_path, "--threads 1 --logits-only");
    double *lc = read_logprobs(lc_path, P, V), *kv = kvcal_logprobs(m, ids, P);
    struct diff d = compare(lc, kv, ids, P, V);
    cr_log_info("%s: llama.cpp's deepseek2 against kvcal's model: max |dlogp| %.2e at position "
                "%lld token %lld (kvcal %.6f, llama.cpp %.6f); mean KL %.2e; ppl kvcal %.6f "
                "llama.cpp %.6f",
                k->name, d.max, (long long)d.pos, (long long)d.tok, d.at_kv, d.at_lc, d.kl,
                d.ppl_kv, d.ppl_lc);
    if (k->tol > 0)
        cr_expect(d.max <= k->tol, "%s: max |dlogp| %.3g at position %lld, tolerance %.3g", k->name,
                  d.max, (long long)d.pos, k->tol);
    /* llama.cpp against the float64 oracle of the MLA form itself: the
     * layout (the rope key, the absorbed k^nope, the values) read as
     * written, whatever the rewrite cost */
    double *om = naive_mla_forward(m, mla, ids, P);
    kvt_log_softmax_rows(om, P, V);
    struct diff dm = compare(lc, om, ids, P, V);
    cr_log_info("%s: llama.cpp against the float64 MLA oracle: max |dlogp| %.2e at position %lld "
                "token %lld, mean KL %.2e",
                k->name, dm.max, (long long)dm.pos, (long long)dm.tok, dm.kl);
    cr_expect(dm.max <= 2e-3, "%s: llama.cpp against the MLA oracle: max |dlogp| %.3g at position "
              "%lld token %lld, tolerance 2e-3", k->name, dm.max, (long long)dm.pos, (long long)dm.tok);
    free(om);
    /* and against kvcal's own MLA forward (kv_fwd_set_mla) */
    {
        double *km = kvcal_logprobs_mla(m, mla, ids, P);
        struct diff dk = compare(lc, km, ids, P, V);
        cr_log_info("%s: llama.cpp against kvcal's MLA forward: max |dlogp| %.2e at position %lld",
                    k->name, dk.max, (long long)dk.pos);
        cr_expect(dk.max <= 2e-3, "%s: llama.cpp against kvcal's MLA forward: max |dlogp| %.3g at "
                  "position %lld, tolerance 2e-3", k->name, dk.max, (long long)dk.pos);
        free(km);
    }
    /* position 0 attends only to itself, where no rotation is lost: the
     * values and the latent (exact at full rank) decide it alone */
    double d0 = 0;
    for (int64_t v = 0; v < V; v++) d0 = fmax(d0, fabs(lc[v] - kv[v]));
    cr_log_info("%s: position 0: max |dlogp| %.2e", k->name, d0);
    if (!k->rank) /* a full-rank latent */
        cr_expect(d0 <= 2e-3, "%s: position 0: max |dlogp| %.3g, tolerance 2e-3", k->name, d0);
    free(lc), free(kv);
    unlink(gguf), unlink(ids_path), unlink(lc_path);
    free(gguf), free(ids_path), free(lc_path);
    kvt_rm_dir(dir);
    kv_mla_free(mla);
    kv_stats_free(s);
    kv_model_close(m);
}

static const struct mla_case mla_cases[] = {
    {"mla_mqa_full_rank_half", 1, KV_ROPE_HALF, 0, 64, 1, 2e-3, 0},
    {"mla_mqa_full_rank_interleaved", 1, KV_ROPE_INTERLEAVED, 0, 64, 1, 2e-3, 0},
    {"mla_gqa2_full_rank", 2, KV_ROPE_HALF, 0, 64, 1, 0, 0}, /* the lost rotation: measured */
    {"mla_gqa2_rank48_rope16_step2", 2, KV_ROPE_INTERLEAVED, 48, 16, 2, 0, 0},
    {"mla_gqa2_rank48_rope16_step2_turned", 2, KV_ROPE_INTERLEAVED, 48, 16, 2, 0, 1},
};
Test(llamacpp, mla_mqa_full_rank_half_is_exact) { run_mla(&mla_cases[0]); }
Test(llamacpp, mla_mqa_full_rank_interleaved_is_exact) { run_mla(&mla_cases[1]); }
Test(llamacpp, mla_gqa2_full_rank_exact_at_position_0) { run_mla(&mla_cases[2]); }
Test(llamacpp, mla_gqa2_rank48_rope16_step2_as_the_oracle) { run_mla(&mla_cases[3]); }
Test(llamacpp, mla_gqa2_turned_as_the_oracle) { run_mla(&mla_cases[4]); }

/* "node SCRIPT A B C OPTS" from the repository root: its last stdout line
 * (the caller frees); asserts it exits 0. */
static char *node_last_line(const char *what, const char *script, const char *a, const char *b,
                            const char *c, const char *opts) {
    char cmd[4096], line[65536], *last = NULL;
    snprintf(cmd, sizeof cmd, "node '%s' '%s' '%s' '%s' %s 2>/dev/null", script, a, b, c, opts);
    FILE *pp = popen(cmd, "r");
    cr_assert_not_null(pp);
    while (fgets(line, sizeof line, pp)) {
        free(last);
        last = strdup(line);
    }
    cr_assert_eq(pclose(pp), 0, "%s: node %s failed", what, script);
    cr_assert_not_null(last, "%s: node %s printed nothing", what, script);
    return last;
}

/* llama.cpp's own KV cache (its log's "llama_kv_cache: size = ... MiB (N
 * cells"), for 4096 cells of f16 of kjv-llama and of its MLA export at 0.25
 * of the bytes (rope key 32, latent 32), against kvcal's count: (d_c + R)
 * values a token and layer for the export, 2 G d_h for the base. */
Test(llamacpp, mla_kv_cache_is_kvcals_count, .timeout = 300) {
    need_llamacpp();
    struct kv_model *m;
    struct kv_err e;
    cr_assert_eq(kv_model_open("data/kjv-llama", NULL, &m, &e), KV_OK, "%s", e.msg);
    const struct kv_config *c = kv_model_config(m);
    uint64_t st = 17;
    struct kv_stats *s = random_stats(m, 4, 256, 0, &st);
    int64_t G = c->n_kv_heads, dh = c->head_dim, L = c->n_layers, base = 2 * G * dh;
    struct kv_mla_opts o = {base / 4 - 32, 32, 1, 1, 0, NULL, 0, 0};
    char *dir = kvt_temp_dir(), *mla_path = kvt_path(dir, "mla.gguf"), *base_path = kvt_path(dir, "base.gguf");
    char *ids_path = kvt_path(dir, "ids.txt"), *out = kvt_path(dir, "lp.bin");
    cr_assert_eq(kv_mla_export_gguf(m, s, &o, mla_path, NULL, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(kv_gguf_write_model(m, base_path, NULL, &e), KV_OK, "%s", e.msg);
    const int64_t n = 4096;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    for (int64_t i = 0; i < n; i++) ids[i] = i == 0 ? c->bos_id : (int32_t)(rng_next(&st) % 256);
    write_ids(ids_path, ids, n);
    const char *paths[2] = {base_path, mla_path};
    int64_t values[2] = {base, o.kv_lora_rank + o.rope_dim};
    for (int k = 0; k < 2; k++) {
        char *js = node_last_line("kv cache", LOGPROBS_MJS, paths[k], ids_path, out,
                                  "--threads 2 --logits-only --kv-cache f16");
        const char *at = strstr(js, "\"kv_cache_reported\":{\"mib\":");
        cr_assert_not_null(at, "no kv_cache_reported in %s", js);
        double mib = 0;
        long cells = 0;
        cr_assert_eq(sscanf(at, "\"kv_cache_reported\":{\"mib\":%lf,\"cells\":%ld", &mib, &cells), 2, "%s", at);
        double want = (double)(values[k] * 2 * L * cells) / (1024.0 * 1024.0);
        cr_log_info("%s: llama.cpp's kv cache %.2f MiB for %ld cells, kvcal's count %.4f MiB (%lld "
                    "values a token and layer)",
                    k ? "mla export at 0.25" : "base", mib, cells, want, (long long)values[k]);
        cr_expect(fabs(mib - want) <= 0.05 * want, "%s: llama.cpp %.2f MiB, kvcal %.4f MiB",
                  k ? "mla" : "base", mib, want);
        free(js);
    }
    free(ids);
    kvt_rm_dir(dir);
    free(mla_path), free(base_path), free(ids_path), free(out);
    kv_stats_free(s);
    kv_model_close(m);
}

/* The real models at hand and a Mistral, exported as MLA at half the base's
 * values (the rope key of the whole head, the latent the rest), run by
 * llama.cpp against kvcal's own MLA forward on 128 random ids from BOS:
 * the same model in two engines, whatever the rewrite cost. */
struct mla_real {
    const char *name, *model, *tokenizer; /* model: under ../shared when shared, else the repo */
    int shared;
};

static void run_mla_real(const struct mla_real *k) {
    need_llamacpp();
    struct kv_model *m;
    struct kv_err e;
    if (k->model) {
        char mpath[1024], tpath[1024];
        real_paths(k->model, k->tokenizer, k->shared, mpath, tpath);
        cr_assert_eq(kv_model_open(mpath, k->tokenizer ? tpath : NULL, &m, &e), KV_OK, "%s", e.msg);
    } else { /* Mistral 7B's shape scaled down: GQA 4:1, heads of 128, theta 1e6 */
        struct kv_config c = {0};
        c.arch = KV_ARCH_MISTRAL, c.dim = 512, c.hidden_dim = 1024, c.n_layers = 2, c.n_heads = 8;
        c.n_kv_heads = 2, c.head_dim = 128, c.vocab_size = 320, c.max_seq_len = 2048;
        c.norm_eps = 1e-5f, c.rope_theta = 1e6f, c.rope_layout = KV_ROPE_HALF, c.bos_id = 1;
        cr_assert_eq(kv_model_init_random(&c, 41, &m, &e), KV_OK, "%s", e.msg);
        shape_weights(m);
        shape_norms(m);
    }
    const struct kv_config *c = kv_model_config(m);
    int64_t V = c->vocab_size, G = c->n_kv_heads, dh = c->head_dim;
    uint64_t st = 29;
    struct kv_stats *s = random_stats(m, 4, (uint64_t)V, 0, &st);
    struct kv_mla_opts o = {G * dh - dh, dh, 1, 1, 0, NULL, 0, 0}; /* d_c + R = half of 2 G d_h */
    if (o.kv_lora_rank < 1) o.kv_lora_rank = dh / 2, o.rope_dim = dh / 2;
    struct kv_mla *mla;
    cr_assert_eq(kv_mla_convert(m, s, &o, &mla, NULL, &e), KV_OK, "%s", e.msg);
    const int64_t n = N_IDS, P = n - 1;
    int32_t ids[N_IDS];
    for (int64_t i = 0; i < n; i++) ids[i] = i == 0 ? c->bos_id : (int32_t)(rng_next(&st) % (uint64_t)V);
    char *dir = kvt_temp_dir(), *gguf = kvt_path(dir, "mla.gguf"), *ids_path = kvt_path(dir, "ids.txt");
    char *lc_path = kvt_path(dir, "lc.bin");
    cr_assert_eq(kv_gguf_write_mla(m, mla, gguf, NULL, &e), KV_OK, "%s", e.msg);
    write_ids(ids_path, ids, n);
    run_node(k->name, LOGPROBS_MJS, gguf, ids_path, lc_path, "--threads 1 --logits-only");
    double *lc = read_logprobs(lc_path, P, V);
    double *km = kvcal_logprobs_mla(m, mla, ids, P);
    struct diff d = compare(lc, km, ids, P, V);
    cr_log_info("%s: MLA at d_c %lld, R %lld: llama.cpp against kvcal's MLA forward: max |dlogp| "
                "%.2e at position %lld; ppl kvcal %.6f llama.cpp %.6f",
                k->name, (long long)o.kv_lora_rank, (long long)o.rope_dim, d.max, (long long)d.pos,
                d.ppl_kv, d.ppl_lc);
    cr_expect(d.max <= 2e-3, "%s: max |dlogp| %.3g at position %lld, tolerance 2e-3", k->name, d.max,
              (long long)d.pos);
    free(km), free(lc);
    kvt_rm_dir(dir);
    free(gguf), free(ids_path), free(lc_path);
    kv_mla_free(mla);
    kv_stats_free(s);
    kv_model_close(m);
}

static const struct mla_real mla_reals[] = {
    {"mla_kjv_llama", "data/kjv-llama", NULL, 0},
    {"mla_stories260k", "models/stories260K/stories260K.bin", "models/stories260K/tok512.bin", 1},
    {"mla_tinystories_656k", "models/tinystories-656K", NULL, 1},
    {"mla_mistral_hd128_gqa4", NULL, NULL, 0},
};
Test(llamacpp, mla_kjv_llama_as_kvcal_runs_it) { run_mla_real(&mla_reals[0]); }
Test(llamacpp, mla_stories260k_as_kvcal_runs_it) { run_mla_real(&mla_reals[1]); }
Test(llamacpp, mla_tinystories_656k_as_kvcal_runs_it) { run_mla_real(&mla_reals[2]); }
Test(llamacpp, mla_mistral_hd128_gqa4_as_kvcal_runs_it) { run_mla_real(&mla_reals[3]); }
