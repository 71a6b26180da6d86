/* The committed fixture models data/kjv-llama and data/kjv-gpt2: they load
 * through the ordinary HF loader, beat a unigram model of the training text
 * by a wide margin on the held-out Gospels, and the GPT-2 one compresses
 * exactly at full rank through the fused-query and fused-output paths. The
 * KJV text comes from 'make data' (make test runs it when the bible command
 * exists); tests that need it skip without it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "testutil.h"

static void check_config(const char *dir, enum kv_arch arch, int64_t kv_heads) {
    struct kv_model *m;
    struct kv_err err = {0};
    cr_assert_eq(kv_model_open(dir, NULL, &m, &err), KV_OK, "%s", err.msg);
    const struct kv_config *c = kv_model_config(m);
    cr_assert_eq(c->arch, arch, "%s", dir);
    cr_assert(c->dim == 256 && c->n_layers == 4 && c->n_heads == 4 && c->head_dim == 64, "%s", dir);
    cr_assert_eq(c->n_kv_heads, kv_heads, "%s", dir);
    cr_assert_eq(c->vocab_size, 258);
    cr_assert_eq(kv_model_format(m), KV_FORMAT_HF);
    cr_assert_eq(kv_model_tensor(m, 0)->dtype, KV_DTYPE_F16, "weights are committed as F16");
    kv_model_close(m);
}

Test(fixtures, load_as_hf_models) {
    check_config("data/kjv-llama", KV_ARCH_LLAMA, 2);
    check_config("data/kjv-gpt2", KV_ARCH_GPT2, 4);
}

/* Held-out Gospel loss per byte against an add-one unigram model of the
 * training books, over the same scored positions. */
static void beats_unigram(const char *dir) {
    struct kv_err err = {0};
    struct kv_model *m;
    cr_assert_eq(kv_model_open(dir, NULL, &m, &err), KV_OK, "%s", err.msg);
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    char *train, *held;
    size_t tl, hl;
    cr_assert_eq(kv_text_read("data/kjv/train.txt", &train, &tl, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_text_read("data/kjv/gospels.txt", &held, &hl, &err), KV_OK, "%s", err.msg);
    int32_t *ti, *hi;
    int64_t tn, hn;
    cr_assert_eq(kv_tok_encode(tok, train, tl, 0, &ti, &tn, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_tok_encode(tok, held, hl, 1, &hi, &hn, &err), KV_OK, "%s", err.msg);
    int64_t V = kv_model_config(m)->vocab_size, seq = 256, wins = 24;
    double *cnt = calloc((size_t)V, sizeof *cnt), uni = 0;
    for (int64_t i = 0; i < tn; i++) cnt[ti[i]] += 1;
    for (int64_t w = 0; w < wins; w++)
        for (int64_t i = 1; i < seq; i++) uni -= log((cnt[hi[w * seq + i]] + 1) / (double)(tn + V));
    uni /= (double)(wins * (seq - 1));
    struct kv_ppl_result r;
    cr_assert_eq(kv_ppl_run(m, hi, hn, seq, wins, NULL, NULL, &r, &err), KV_OK, "%s", err.msg);
    cr_log_info("%s: held-out %.3f nats per byte, unigram %.3f", dir, r.nll, uni);
    cr_assert(r.nll < 0.6 * uni, "%s: held-out nll %.4f is not well below the unigram's %.4f", dir,
              r.nll, uni);
    free(cnt), free(ti), free(hi), free(train), free(held);
    kv_model_close(m);
}

Test(fixtures, llama_beats_unigram) {
    KVT_NEED_KJV();
    beats_unigram("data/kjv-llama");
}
Test(fixtures, gpt2_beats_unigram) {
    KVT_NEED_KJV();
    beats_unigram("data/kjv-gpt2");
}

static double json_num(const char *s, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(s, pat);
    cr_assert_not_null(p, "no %s in %s", key, s);
    return strtod(p + strlen(pat), NULL);
}

/* Full rank: every unit keeps all of its directions, so the latent cache
 * (keys folded into the query, values into the output projection) computes
 * what the base does up to fp32 rounding. */
Test(fixtures, gpt2_full_rank_is_exact) {
    KVT_NEED_KJV();
    char *dir = kvt_temp_dir(), args[2048], *out = NULL, *err = NULL;
    snprintf(args, sizeof args,
             "collect -m data/kjv-gpt2 -t data/kjv/train.txt -n 8 -o %s/s.kvstats -q", dir);
    cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
    free(out), free(err);
    static const char *const methods[] = {"palu", "svd", "eigen", "lorc", "fdc", "zack"};
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        snprintf(args, sizeof args, "decompose -m data/kjv-gpt2 -s %s/s.kvstats --method %s --eps 1 -o %s/%s -q",
                 dir, methods[i], dir, methods[i]);
        cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
        free(out), free(err);
        char name[64];
        snprintf(name, sizeof name, "%s/kvcal.json", methods[i]);
        char *man = kvt_path(dir, name);
        char *mj = kvt_read_file(man, NULL);
        int rot = !strcmp(methods[i], "fdc") || !strcmp(methods[i], "zack");
        cr_assert(mj && strstr(mj, rot ? "\"postrope_rotation\"" : "\"fused_query\"") &&
                      strstr(mj, "\"fused_output\""),
                  "%s: the manifest lacks the expected key and value modes", methods[i]);
        snprintf(args, sizeof args,
                 "verify -m data/kjv-gpt2 --compressed %s/%s -t data/kjv/gospels.txt --max-windows 4 --json -q",
                 dir, methods[i]);
        cr_assert_eq(kvt_run_cli(args, &out, &err), 0, "%s", err);
        double ppl = json_num(out, "ppl"), base = json_num(out, "base_ppl");
        cr_assert(fabs(ppl - base) <= 1e-4 * base, "%s: full-rank ppl %.8f vs base %.8f", methods[i],
                  ppl, base);
        free(out), free(err), free(man), free(mj);
    }
    free(dir);
}
