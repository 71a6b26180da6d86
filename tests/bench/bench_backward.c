/* make bench: the backward pass against the inference forward on the
 * fixture models' shape (d 256, 4 layers, head_dim 64, byte vocabulary,
 * windows of 256), for both architectures. A training step (forward with
 * saved activations + backward over every weight) does about three times the
 * forward's multiply-adds, so the target is a window in at most 4.5x the time
 * of the forward alone. Also prints tokens/s and peak RSS. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>

#include "bench_util.h"

static double peak_rss_mib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0;
}

static int run(enum kv_arch arch, int *ok) {
    struct kv_config c = {0};
    c.arch = arch, c.dim = 256, c.n_layers = 4, c.n_heads = 4;
    c.n_kv_heads = arch == KV_ARCH_GPT2 ? 4 : 2, c.head_dim = 64;
    c.hidden_dim = arch == KV_ARCH_GPT2 ? 1024 : 704, c.vocab_size = 258, c.max_seq_len = 256;
    c.norm_eps = 1e-5f, c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF;
    c.tied_embeddings = arch == KV_ARCH_GPT2, c.has_qkv_bias = arch == KV_ARCH_GPT2;
    c.bos_id = 256, c.eos_id = 257;
    struct kv_err err = {0};
    struct kv_model *m;
    if (kv_model_init_random(&c, 7, &m, &err)) return die(&err);
    int64_t n = 255, reps = 12;
    int32_t tok[256];
    for (int i = 0; i < 256; i++) tok[i] = (i * 37 + 11) % 256;
    struct kv_fwd *f;
    struct kv_grad *g;
    if (kv_fwd_init(m, n, &f, &err) || kv_grad_init(m, n, &g, &err)) return die(&err);
    double loss, best_f = 1e30, best_b = 1e30;
    for (int64_t r = 0; r < reps; r++) { /* best of reps, alternating */
        double t0 = kv_now();
        if (kv_fwd_run(f, tok, n, 0, NULL, &err)) return die(&err);
        double t1 = kv_now();
        if (kv_grad_run(g, tok, n, &loss, &err)) return die(&err);
        double t2 = kv_now();
        best_f = t1 - t0 < best_f ? t1 - t0 : best_f;
        best_b = t2 - t1 < best_b ? t2 - t1 : best_b;
    }
    double ratio = best_b / best_f;
    int pass = ratio <= 4.5;
    *ok &= pass;
    printf("  %s d=256 L=4: forward %.0f tokens/s, forward+backward %.0f tokens/s = %.2fx the "
           "forward's time (target <= 4.5x) %s; peak RSS %.1f MiB\n",
           kv_arch_name(arch), (double)n / best_f, (double)n / best_b, ratio,
           pass ? "ok" : "SLOW", peak_rss_mib());
    kv_grad_free(g);
    kv_fwd_free(f);
    kv_model_close(m);
    return 0;
}

int main(void) {
    int ok = 1;
    printf("backward pass, one window of 255 tokens, best of 12\n");
    if (run(KV_ARCH_LLAMA, &ok) || run(KV_ARCH_GPT2, &ok)) return 1;
    return ok ? 0 : 1;
}
