/* Streamed weights (kv_model_streaming): a model whose weights stay in the
 * file's dtype (F16 safetensors, block-quantized GGUF) and are converted one
 * layer at a time computes bit for bit what the model converted at load
 * does (forward logits, the training loss and its gradients, the
 * fingerprint, verify's perplexity), and keeps less anonymous memory. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backward.h"
#include "ggufmodelw.h"
#include "kvformats.h"
#include "model.h"
#include "testutil.h"

#define BPE "data/kjv-bpe-llama" /* F16 safetensors, 4,096-id BPE */

static void need(const char *path) {
    if (access(path, R_OK)) cr_skip("%s is missing: run the tests from the repository root", path);
}

static struct kv_model *open_as(const char *path, int streamed) {
    kv_model_streaming(streamed ? 1 : -1);
    struct kv_model *m;
    struct kv_err err;
    cr_assert_eq(kv_model_open(path, NULL, &m, &err), KV_OK, "%s", err.msg);
    kv_model_streaming(0);
    cr_assert_eq(kv_model_is_streamed(m), streamed);
    return m;
}

static float *logits(const struct kv_model *m, int64_t n) {
    const struct kv_config *c = kv_model_config(m);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)((i * 131 + 17) % c->vocab_size);
    struct kv_fwd *f;
    struct kv_err err;
    cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", err.msg);
    float *out = malloc((size_t)(n * c->vocab_size) * sizeof *out);
    memcpy(out, kv_fwd_logits(f), (size_t)(n * c->vocab_size) * sizeof *out);
    kv_fwd_free(f);
    free(tok);
    return out;
}

static void same_model(const char *path) {
    struct kv_model *a = open_as(path, 0), *b = open_as(path, 1);
    int64_t n = 48, V = kv_model_config(a)->vocab_size;
    float *la = logits(a, n), *lb = logits(b, n);
    cr_assert_eq(memcmp(la, lb, (size_t)(n * V) * sizeof *la), 0, "%s: streamed logits differ", path);
    free(la), free(lb);
    char fa[65], fb[65];
    struct kv_err err;
    cr_assert_eq(kv_model_fingerprint(a, fa, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_fingerprint(b, fb, &err), KV_OK, "%s", err.msg);
    cr_assert_str_eq(fa, fb, "%s: fingerprints differ", path);
    /* the training pass: loss and every gradient */
    int32_t tok[33];
    for (int i = 0; i < 33; i++) tok[i] = (int32_t)((i * 37 + 5) % V);
    struct kv_grad *ga, *gb;
    cr_assert_eq(kv_grad_init(a, 32, &ga, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_grad_init(b, 32, &gb, &err), KV_OK, "%s", err.msg);
    double lossa, lossb;
    cr_assert_eq(kv_grad_run(ga, tok, 32, &lossa, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_grad_run(gb, tok, 32, &lossb, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(lossa, lossb, "%s: loss %.17g vs %.17g", path, lossa, lossb);
    for (int64_t i = 0; i < kv_grad_n_tensors(ga); i++) {
        int64_t ca, cb;
        const float *gra, *grb;
        const char *name = kv_grad_tensor(ga, i, &ca, NULL, &gra);
        kv_grad_tensor(gb, i, &cb, NULL, &grb);
        cr_assert(ca == cb && !memcmp(gra, grb, (size_t)ca * sizeof *gra), "%s: gradient %s differs",
                  path, name);
    }
    kv_grad_free(ga), kv_grad_free(gb);
    kv_model_close(a), kv_model_close(b);
}

Test(stream, f16_safetensors_compute_the_same) {
    need(BPE "/model.safetensors");
    same_model(BPE);
}

Test(stream, block_quantized_gguf_computes_the_same) {
    need(BPE "/model.safetensors");
    struct kv_model *m = open_as(BPE, 0);
    char *dir = kvt_temp_dir(), path[1200];
    snprintf(path, sizeof path, "%s/q.gguf", dir);
    struct kv_gguf_write_opts o = {.matrix_type = 12 /* Q4_K */, .fallback = 1};
    struct kv_err err;
    cr_assert_eq(kv_gguf_write_model(m, path, &o, &err), KV_OK, "%s", err.msg);
    kv_model_close(m);
    same_model(path);
    kvt_rm_dir(dir);
}

/* RssAnon of this process in KiB (anonymous pages, without the mapped file). */
static long rss_anon_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "RssAnon:", 8)) v = strtol(line + 8, NULL, 10);
    if (f) fclose(f);
    return v;
}

Test(stream, keeps_less_anonymous_memory) {
    need(BPE "/model.safetensors");
    long r0 = rss_anon_kib();
    if (r0 < 0) cr_skip("no RssAnon in /proc/self/status");
    struct kv_model *a = open_as(BPE, 0);
    long r1 = rss_anon_kib();
    kv_model_close(a);
    long r2 = rss_anon_kib();
    struct kv_model *b = open_as(BPE, 1);
    const float *const *w = kv_model_layer(b, 0); /* one layer converted */
    cr_assert_not_null(w[KV_W_Q]);
    long r3 = rss_anon_kib();
    kv_model_close(b);
    /* 5.05M parameters: about 19.7 MiB of float32 at load; streamed, one of
     * four layers (about 1 MiB) */
    cr_log_info("RssAnon growth: converted at load %ld KiB, streamed %ld KiB", r1 - r0, r3 - r2);
    cr_assert_gt(r1 - r0, 15000, "converting at load grew only %ld KiB", r1 - r0);
    cr_assert_lt(r3 - r2, (r1 - r0) / 4, "streamed grew %ld KiB against %ld", r3 - r2, r1 - r0);
}

/* The command line: KVCAL_STREAM_WEIGHTS=1 gives verify's numbers exactly. */
Test(stream, verify_reads_the_same_with_the_variable) {
    need(BPE "/model.safetensors");
    need("data/kjv/gospels.txt");
    double ppl[2];
    for (int s = 0; s < 2; s++) {
        char args[2048], *out, *e;
        snprintf(args, sizeof args,
                 "verify -m " BPE " --text data/kjv/gospels.txt --seq-len 128 --max-windows 6 --threads 2 --json -q");
        setenv("KVCAL_STREAM_WEIGHTS", s ? "1" : "0", 1);
        int rc = kvt_run_cli(args, &out, &e);
        unsetenv("KVCAL_STREAM_WEIGHTS");
        cr_assert_eq(rc, 0, "%s", e);
        json_t *o = json_loads(out, 0, NULL);
        cr_assert(o, "%s", out);
        ppl[s] = json_number_value(json_object_get(o, "ppl"));
        json_decref(o);
        free(out), free(e);
    }
    cr_assert_eq(ppl[0], ppl[1], "ppl %.10f converted at load, %.10f streamed", ppl[0], ppl[1]);
}

/* collect, decompose and verify --compressed, streamed or not: the same
 * perplexities and the same predicted errors. */
Test(stream, collect_decompose_verify_read_the_same, .timeout = 300) {
    need(BPE "/model.safetensors");
    need("data/kjv/gospels.txt");
    char *dir = kvt_temp_dir();
    double ppl[2], base[2];
    for (int s = 0; s < 2; s++) {
        char args[4096], st[1200], lr[1200], *out, *e;
        snprintf(st, sizeof st, "%s/s%d.kvstats", dir, s);
        snprintf(lr, sizeof lr, "%s/lr%d", dir, s);
        setenv("KVCAL_STREAM_WEIGHTS", s ? "1" : "0", 1);
        const char *cmds[2] = {"collect -m " BPE " -t data/kjv/gospels.txt --seq-len 128 --samples 6 "
                               "--sequential --fisher -q --threads 2 -o '%s'",
                               "decompose -m " BPE " -s '%s' --method palu --alloc fisher --ratio 0.5 -q -o '%s'"};
        snprintf(args, sizeof args, cmds[0], st);
        int rc = kvt_run_cli(args, &out, &e);
        cr_assert_eq(rc, 0, "%s", e);
        free(out), free(e);
        snprintf(args, sizeof args, cmds[1], st, lr);
        rc = kvt_run_cli(args, &out, &e);
        cr_assert_eq(rc, 0, "%s", e);
        free(out), free(e);
        snprintf(args, sizeof args,
                 "verify -m " BPE " --compressed '%s' --text data/kjv/gospels.txt --seq-len 128 "
                 "--max-windows 4 --threads 2 --json -q",
                 lr);
        rc = kvt_run_cli(args, &out, &e);
        unsetenv("KVCAL_STREAM_WEIGHTS");
        cr_assert_eq(rc, 0, "%s", e);
        json_t *o = json_loads(out, 0, NULL);
        cr_assert(o, "%s", out);
        ppl[s] = json_number_value(json_object_get(o, "ppl"));
        base[s] = json_number_value(json_object_get(o, "base_ppl"));
        json_decref(o);
        free(out), free(e);
    }
    cr_assert_eq(base[0], base[1], "base ppl %.10f vs %.10f", base[0], base[1]);
    cr_assert_eq(ppl[0], ppl[1], "compressed ppl %.10f converted at load, %.10f streamed", ppl[0], ppl[1]);
    kvt_rm_dir(dir);
}
