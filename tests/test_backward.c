/* Backward pass: every gradient against central finite differences of an
 * independent float64 forward (tests/naive_llama.h, tests/naive_gpt2.h), and
 * the training forward's loss against the inference forward's. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backward.h"
#include "model.h"
#include "naive_gpt2.h"
#include "naive_llama.h"
#include "naive_gemma2.h"
#include "naive_neox.h"
#include "testutil.h"

/* Mean next-token NLL of tok[0..n] under the float64 oracle. */
static double oracle_loss(const struct kv_model *m, const int32_t *tok, int64_t n) {
    double *lg = m->cfg.arch == KV_ARCH_GPT2      ? naive_gpt2_forward(m, tok, n)
                 : m->cfg.arch == KV_ARCH_GPTNEOX ? naive_neox_forward(m, tok, n)
                 : m->cfg.arch == KV_ARCH_GEMMA2  ? naive_gemma2_forward(m, tok, n)
                                                  : naive_forward(m, tok, n);
    int64_t V = m->cfg.vocab_size;
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        double mx = lg[i * V];
        for (int64_t j = 1; j < V; j++) mx = lg[i * V + j] > mx ? lg[i * V + j] : mx;
        double z = 0;
        for (int64_t j = 0; j < V; j++) z += exp(lg[i * V + j] - mx);
        s += log(z) + mx - lg[i * V + tok[i + 1]];
    }
    free(lg);
    return s / (double)n;
}

static uint64_t rng = 0x1234;
static double urand(void) { /* xorshift64*, uniform in [-1, 1) */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (double)((rng * 0x2545f4914f6cdd1dull) >> 11) * 0x1.0p-52 - 1.0;
}

/* Larger weights than N(0, 0.02) so every nonlinearity is exercised: norm
 * gains 1 ± 0.5, everything else uniform with the given spread. */
static void spread_weights(struct kv_model *m, double spread) {
    const struct kv_config *c = &m->cfg;
    for (int k = 0; k < KV_W_COUNT; k++) {
        int64_t nl = k < KV_W_FIRST_LAYER ? 1 : c->n_layers, s[2];
        int nd = kv_model_expected_shape(c, k, s);
        int64_t cnt = nd == 2 ? s[0] * s[1] : s[0];
        for (int64_t l = 0; l < nl; l++) {
            if (k == KV_W_LM_HEAD && c->tied_embeddings) continue;
            float *w = kv_model_weight_mut(m, k, l);
            if (!w) continue;
            int gain = kv_wkind_is_stream_norm(k) || k == KV_W_QNORM || k == KV_W_KNORM;
            for (int64_t i = 0; i < cnt; i++)
                w[i] = gain ? (float)(1.0 + 0.5 * urand()) : (float)(spread * urand());
        }
    }
}

/* Every element of every tensor against central differences of the oracle:
 * |g − fd| <= 1e-3 · max |fd| + 1e-3 |fd| + 1e-7 per element, worst printed
 * (the 1e-7 floor is fp32 roundoff of a gradient that is exactly zero). */
static void check_gradients(struct kv_model *m, int64_t n) {
    int32_t tok[64];
    for (int64_t i = 0; i <= n; i++) tok[i] = (int32_t)((urand() + 1.0) * 0.5 * (double)m->cfg.vocab_size) % (int32_t)m->cfg.vocab_size;
    struct kv_grad *g;
    struct kv_err err = {0};
    cr_assert_eq(kv_grad_init(m, n, &g, &err), KV_OK, "%s", err.msg);
    double loss;
    cr_assert_eq(kv_grad_run(g, tok, n, &loss, &err), KV_OK, "%s", err.msg);
    double ref = oracle_loss(m, tok, n);
    cr_assert(fabs(loss - ref) <= 1e-5 * fabs(ref), "loss %.9g, oracle %.9g", loss, ref);
    for (int64_t t = 0; t < kv_grad_n_tensors(g); t++) {
        int64_t cnt;
        const float *w0, *gr;
        const char *name = kv_grad_tensor(g, t, &cnt, &w0, &gr);
        float *w = (float *)w0;
        double *fd = malloc((size_t)cnt * sizeof *fd), fmax = 0;
        for (int64_t i = 0; i < cnt; i++) {
            float keep = w[i];
            float hi = keep + 1e-3f, lo = keep - 1e-3f;
            w[i] = hi;
            double lp = oracle_loss(m, tok, n);
            w[i] = lo;
            double lm = oracle_loss(m, tok, n);
            w[i] = keep;
            fd[i] = (lp - lm) / ((double)hi - (double)lo);
            fmax = fabs(fd[i]) > fmax ? fabs(fd[i]) : fmax;
        }
        int64_t worst = 0;
        double wex = -1;
        for (int64_t i = 0; i < cnt; i++) {
            double tol = 1e-3 * fmax + 1e-3 * fabs(fd[i]) + 1e-7, ex = fabs(gr[i] - fd[i]) - tol;
            if (ex > wex || i == 0) wex = ex, worst = i;
        }
        /* gpt2's key bias adds q·b_k to every score of a row: softmax
         * cancels it, so its true gradient is zero */
        int zero_ok = m->cfg.arch == KV_ARCH_GPT2 && strstr(name, "k bias");
        cr_assert(fmax > 0 || zero_ok, "%s: finite differences are all zero", name);
        cr_assert(wex <= 0,
                  "%s (%s): element %lld gradient %.9g, finite difference %.9g (max |fd| %.3g)",
                  name, kv_arch_name(m->cfg.arch), (long long)worst, (double)gr[worst], fd[worst], fmax);
        free(fd);
    }
    kv_grad_free(g);
}

static struct kv_config small_llama(int bias, int tied, enum kv_rope_layout lay) {
    struct kv_config c = tiny_cfg(lay, bias, tied);
    c.dim = 16, c.hidden_dim = 24, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 4;
    c.vocab_size = 19;
    return c;
}

static struct kv_config small_gpt2(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPT2;
    c.dim = 16, c.hidden_dim = 32, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 4;
    c.head_dim = 4, c.vocab_size = 19, c.max_seq_len = 12, c.norm_eps = 1e-5f;
    c.tied_embeddings = 1, c.has_qkv_bias = 1, c.bos_id = c.eos_id = -1;
    return c;
}

static void run_case(struct kv_config c, double spread, int64_t n) {
    struct kv_model *m;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_init_random(&c, 7, &m, &err), KV_OK, "%s", err.msg);
    spread_weights(m, spread);
    check_gradients(m, n);
    kv_model_close(m);
}

Test(backward, llama_half_rope_bias_untied) { run_case(small_llama(1, 0, KV_ROPE_HALF), 0.4, 7); }
Test(backward, llama_interleaved_tied) { run_case(small_llama(0, 1, KV_ROPE_INTERLEAVED), 0.4, 7); }
Test(backward, gpt2) { run_case(small_gpt2(), 0.4, 9); }
/* a window of 3 in the second layer, and llama3-scaled rope */
static struct kv_config windowed_llama(void) {
    struct kv_config c = small_llama(1, 0, KV_ROPE_HALF);
    c.sliding_window = 3, c.window_from = 1, c.window_period = 1;
    struct kv_rope_scaling_cfg *s = &c.rope_scaling;
    s->type = KV_ROPE_SCALING_LLAMA3, s->factor = 4, s->low_freq_factor = 0.5;
    s->high_freq_factor = 4, s->original_ctx = 16;
    return c;
}
Test(backward, llama_sliding_window_and_scaled_rope) { run_case(windowed_llama(), 0.4, 7); }
static struct kv_config qwen3_like(void) {
    struct kv_config c = small_llama(1, 0, KV_ROPE_HALF);
    c.arch = KV_ARCH_QWEN3;
    return c;
}
Test(backward, qwen3_per_head_qk_norms) { run_case(qwen3_like(), 0.4, 7); }
/* partial rope (4 of 8 dimensions), parallel residual, erf GELU; and the
 * sequential, tanh variant */
static struct kv_config small_neox(int parallel, int erf_gelu) {
    struct kv_config c = tiny_neox_cfg();
    c.dim = 16, c.hidden_dim = 32, c.n_heads = c.n_kv_heads = 2, c.head_dim = 8, c.rope_dim = 4;
    c.vocab_size = 19, c.parallel_residual = parallel, c.gelu_erf = erf_gelu;
    return c;
}
Test(backward, gpt_neox_parallel_partial_rope_erf_gelu) { run_case(small_neox(1, 1), 0.4, 7); }
Test(backward, gpt_neox_sequential_tanh_gelu) { run_case(small_neox(0, 0), 0.4, 7); }
/* GeGLU, post-norms, (1 + w) gains, the scaled embedding, a scale apart
 * from 1/sqrt(d_h), soft-caps small enough to bend, a window of 3 on even
 * layers */
static struct kv_config small_gemma2(void) {
    struct kv_config c = tiny_gemma2_cfg();
    c.dim = 16, c.hidden_dim = 24, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 8;
    c.vocab_size = 19, c.sliding_window = 3, c.attn_softcap = 2.0f, c.final_softcap = 3.0f;
    c.attn_scale = (float)(1.0 / sqrt(10.0));
    return c;
}
Test(backward, gemma2_softcaps_post_norms_geglu) { run_case(small_gemma2(), 0.4, 7); }

/* The training forward scores a window like the inference forward. */
static void loss_matches_forward(struct kv_config c) {
    struct kv_model *m;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_init_random(&c, 3, &m, &err), KV_OK, "%s", err.msg);
    spread_weights(m, 0.2);
    int64_t n = 10;
    int32_t tok[11];
    for (int i = 0; i <= n; i++) tok[i] = (i * 7 + 3) % (int32_t)c.vocab_size;
    struct kv_fwd *f;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", err.msg);
    double ref = 0;
    for (int64_t i = 0; i < n; i++) ref += kv_nll_row(kv_fwd_logits(f) + i * c.vocab_size, c.vocab_size, tok[i + 1]);
    ref /= (double)n;
    struct kv_grad *g;
    cr_assert_eq(kv_grad_init(m, n, &g, &err), KV_OK, "%s", err.msg);
    double loss;
    cr_assert_eq(kv_grad_loss(g, tok, n, &loss, &err), KV_OK, "%s", err.msg);
    cr_assert(fabs(loss - ref) <= 1e-5 * fabs(ref), "%s: training loss %.9g, forward %.9g",
              kv_arch_name(c.arch), loss, ref);
    kv_grad_free(g);
    kv_fwd_free(f);
    kv_model_close(m);
}

Test(backward, loss_matches_inference_forward) {
    loss_matches_forward(small_llama(1, 0, KV_ROPE_HALF));
    loss_matches_forward(small_gpt2());
    loss_matches_forward(windowed_llama());
    loss_matches_forward(qwen3_like());
    loss_matches_forward(small_neox(1, 1));
    loss_matches_forward(small_gemma2());
}

/* ∂L/∂k and ∂L/∂v are the gradients the weight gradients came from:
 * dW_k = gkᵀ xn, checked through a bias-free model's dW_k = Σ_t gk_t ⊗ xn_t
 * is implied by the finite-difference test; here check gk against finite
 * differences of the k bias, whose gradient is Σ_t gk_t. */
Test(backward, key_value_output_gradients) {
    struct kv_config c = small_llama(1, 0, KV_ROPE_HALF);
    struct kv_model *m;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_init_random(&c, 5, &m, &err), KV_OK, "%s", err.msg);
    spread_weights(m, 0.4);
    int64_t n = 6, kd = c.n_kv_heads * c.head_dim;
    int32_t tok[7] = {1, 5, 9, 2, 11, 3, 17};
    struct kv_grad *g;
    cr_assert_eq(kv_grad_init(m, n, &g, &err), KV_OK, "%s", err.msg);
    double loss;
    cr_assert_eq(kv_grad_run(g, tok, n, &loss, &err), KV_OK, "%s", err.msg);
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const float *gk = side ? kv_grad_v(g, l) : kv_grad_k(g, l);
            const float *gb = kv_grad_of(g, side ? KV_W_BV : KV_W_BK, l);
            float *sum = calloc((size_t)kd, sizeof *sum);
            for (int64_t t = 0; t < n; t++)
                for (int64_t j = 0; j < kd; j++) sum[j] += gk[t * kd + j];
            kvt_assert_close_f32(sum, gb, kd, 1e-6, 1e-4, side ? "sum of dL/dv vs dL/db_v" : "sum of dL/dk vs dL/db_k");
            free(sum);
        }
    cr_assert_null(kv_grad_k(g, c.n_layers));
    kv_grad_free(g);
    kv_model_close(m);
}

Test(backward, refuses_bad_windows) {
    struct kv_config c = small_gpt2();
    struct kv_model *m;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_init_random(&c, 1, &m, &err), KV_OK, "%s", err.msg);
    struct kv_grad *g = NULL;
    cr_assert_eq(kv_grad_init(m, 13, &g, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "window of 13 tokens is outside 1..12");
    cr_assert_eq(kv_grad_init(m, 12, &g, &err), KV_OK, "%s", err.msg);
    int32_t tok[4] = {1, 2, 19, 3};
    double loss;
    cr_assert_eq(kv_grad_run(g, tok, 3, &loss, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "token id 19 at position 2 is outside the vocabulary of 19");
    cr_assert_eq(kv_grad_run(g, tok, 0, &loss, &err), KV_EINVAL);
    kv_grad_free(g);
    kv_model_close(m);
}
