/* kvcal train: the optimizer step against an independent AdamW step, loss
 * going down, the written model loading back with the same loss, a resumed
 * run bit-identical to an uninterrupted one, and resume refusals. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backward.h"
#include "model.h"
#include "testutil.h"

static char *write_text(size_t len) {
    char *s = malloc(len);
    const char *verse = "In the beginning God created the heaven and the earth. ";
    for (size_t i = 0; i < len; i++) s[i] = verse[i % strlen(verse)];
    char *p = kvt_write_temp(s, len, ".txt");
    free(s);
    return p;
}

static void tiny_opts(struct kv_train_opts *o, enum kv_arch arch) {
    memset(o, 0, sizeof *o);
    kv_train_defaults(o);
    struct kv_config *c = &o->cfg;
    c->arch = arch;
    c->dim = 16, c->hidden_dim = 32, c->n_layers = 2, c->n_heads = 4;
    c->n_kv_heads = arch == KV_ARCH_GPT2 ? 4 : 2, c->head_dim = 4, c->max_seq_len = 32;
    c->norm_eps = 1e-5f, c->rope_theta = 10000.0f, c->rope_layout = KV_ROPE_HALF;
    c->tied_embeddings = arch == KV_ARCH_GPT2;
    o->seq_len = 16, o->batch = 4, o->steps = 60, o->warmup = 3, o->lr = 1e-2, o->min_lr = 1e-3;
    o->eval_every = 10, o->eval_windows = 4, o->ckpt_every = 0, o->out_dtype = KV_DTYPE_F32;
}

struct seen {
    double first, last;
    int64_t stop_at;
};

static int record(void *ctx, const struct kv_train_log *l) {
    struct seen *s = ctx;
    if (l->step == 1) s->first = l->loss;
    s->last = l->loss;
    return s->stop_at && l->step == s->stop_at;
}

static char *slurp(const char *dir, const char *name, size_t *len) {
    char *p = kvt_path(dir, name);
    char *b = kvt_read_file(p, len);
    free(p);
    return b;
}

static void learns_and_loads(enum kv_arch arch) {
    char *text = write_text(4000), *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "model"), *ck = kvt_path(dir, "model.ckpt");
    struct kv_train_opts o;
    tiny_opts(&o, arch);
    struct seen s = {0};
    o.train_path = text, o.eval_path = text, o.out_dir = out, o.ckpt_path = ck;
    o.log = record, o.log_ctx = &s;
    struct kv_err err = {0};
    cr_assert_eq(kv_train(&o, &err), KV_OK, "%s", err.msg);
    cr_assert(s.last < 0.5 * s.first, "%s: loss %.4f -> %.4f did not halve", kv_arch_name(arch),
              s.first, s.last);
    cr_assert(o.final_eval_loss < o.unigram_eval_loss, "eval %.4f vs unigram %.4f",
              o.final_eval_loss, o.unigram_eval_loss);
    /* the written HF directory loads through the ordinary loader and scores
     * the first eval window as the trainer did */
    struct kv_model *m;
    cr_assert_eq(kv_model_open(out, NULL, &m, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_config(m)->arch, arch);
    cr_assert_eq(kv_model_config(m)->vocab_size, 258);
    int32_t *ids;
    int64_t n;
    char *t = kvt_read_file(text, NULL);
    cr_assert_eq(kv_tok_encode(kv_model_tokenizer(m), t, strlen(t), 1, &ids, &n, &err), KV_OK, "%s", err.msg);
    struct kv_ppl_result r;
    cr_assert_eq(kv_ppl_run(m, ids, 17 * 4, 17, 4, NULL, NULL, &r, &err), KV_OK, "%s", err.msg);
    cr_assert(r.ppl < exp(o.unigram_eval_loss), "loaded model ppl %.3f vs unigram %.3f", r.ppl,
              exp(o.unigram_eval_loss));
    size_t ll;
    char *log = slurp(out, "train_log.tsv", &ll);
    cr_assert_not_null(log);
    const char *head = "step\ttokens\tloss\tlr\tgrad_norm\teval_loss\n";
    cr_assert(strncmp(log, head, strlen(head)) == 0, "%s", log);
    int lines = 0;
    for (size_t i = 0; i < ll; i++) lines += log[i] == '\n';
    cr_assert_eq(lines, o.steps + 1);
    free(log), free(ids), free(t);
    kv_model_close(m);
    free(text), free(dir), free(out), free(ck);
}

Test(train, llama_learns_and_loads) { learns_and_loads(KV_ARCH_LLAMA); }
Test(train, gpt2_learns_and_loads) { learns_and_loads(KV_ARCH_GPT2); }

Test(train, resume_is_bit_identical) {
    char *text = write_text(3000), *dir = kvt_temp_dir();
    char *a = kvt_path(dir, "a"), *b = kvt_path(dir, "b");
    char *cka = kvt_path(dir, "a.ckpt"), *ckb = kvt_path(dir, "b.ckpt");
    struct kv_err err = {0};
    struct kv_train_opts o;
    tiny_opts(&o, KV_ARCH_LLAMA);
    o.steps = 12, o.train_path = text, o.eval_path = text, o.out_dir = a, o.ckpt_path = cka;
    cr_assert_eq(kv_train(&o, &err), KV_OK, "%s", err.msg);
    struct seen s = {.stop_at = 5};
    tiny_opts(&o, KV_ARCH_LLAMA);
    o.steps = 12, o.train_path = text, o.eval_path = text, o.out_dir = b, o.ckpt_path = ckb;
    o.log = record, o.log_ctx = &s;
    cr_assert_eq(kv_train(&o, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "interrupted");
    s.stop_at = 0, o.resume = 1;
    cr_assert_eq(kv_train(&o, &err), KV_OK, "%s", err.msg);
    size_t la, lb;
    char *wa = slurp(a, "model.safetensors", &la), *wb = slurp(b, "model.safetensors", &lb);
    cr_assert(wa && wb && la == lb && memcmp(wa, wb, la) == 0,
              "resumed weights differ from the uninterrupted run's");
    char *ga = slurp(a, "train_log.tsv", &la), *gb = slurp(b, "train_log.tsv", &lb);
    cr_assert(ga && gb && la == lb && memcmp(ga, gb, la) == 0, "loss logs differ");
    /* a resume with another option names it */
    o.lr = 5e-3;
    cr_assert_eq(kv_train(&o, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "checkpoint was made with lr=0.01, this run has lr=0.005");
    free(wa), free(wb), free(ga), free(gb);
    free(text), free(dir), free(a), free(b), free(cka), free(ckb);
}

/* One step on a single fixed window against AdamW written out here: the
 * first step's bias-corrected moments are g and g², so the update is
 * lr · (ĝ / (|ĝ| + eps) + wd · w) with ĝ the clipped gradient. */
Test(train, first_step_is_adamw) {
    char *dir = kvt_temp_dir();
    char *text = write_text(17); /* exactly one window: inputs 16, targets 16 */
    char *out = kvt_path(dir, "m"), *ck = kvt_path(dir, "m.ckpt");
    struct kv_train_opts o;
    tiny_opts(&o, KV_ARCH_LLAMA);
    o.steps = 1, o.batch = 1, o.warmup = 0, o.bos_fraction = 0, o.grad_clip = 0.5;
    o.eval_path = NULL, o.train_path = text, o.out_dir = out, o.ckpt_path = ck;
    struct kv_err err = {0};
    cr_assert_eq(kv_train(&o, &err), KV_OK, "%s", err.msg);
    struct kv_model *after;
    cr_assert_eq(kv_model_open(out, NULL, &after, &err), KV_OK, "%s", err.msg);
    /* the initial weights: a zero-step run writes them */
    struct kv_model *before;
    char *out0 = kvt_path(dir, "m0");
    struct kv_train_opts z = o;
    z.steps = 1, z.lr = 1e-300, z.min_lr = 0, z.weight_decay = 0, z.out_dir = out0;
    char *ck0 = kvt_path(dir, "m0.ckpt");
    z.ckpt_path = ck0;
    cr_assert_eq(kv_train(&z, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_model_open(out0, NULL, &before, &err), KV_OK, "%s", err.msg);
    struct kv_grad *g;
    cr_assert_eq(kv_grad_init(before, 16, &g, &err), KV_OK, "%s", err.msg);
    int32_t *ids;
    int64_t n;
    char *t = kvt_read_file(text, NULL);
    cr_assert_eq(kv_tok_encode(kv_model_tokenizer(before), t, 17, 0, &ids, &n, &err), KV_OK, "%s", err.msg);
    double loss;
    cr_assert_eq(kv_grad_run(g, ids, 16, &loss, &err), KV_OK, "%s", err.msg);
    double nrm = 0;
    for (int64_t i = 0; i < kv_grad_n_tensors(g); i++) {
        int64_t cnt;
        const float *gr;
        kv_grad_tensor(g, i, &cnt, NULL, &gr);
        for (int64_t j = 0; j < cnt; j++) nrm += (double)gr[j] * gr[j];
    }
    nrm = sqrt(nrm);
    double clip = nrm > 0.5 ? 0.5 / nrm : 1.0;
    for (int64_t i = 0; i < kv_grad_n_tensors(g); i++) {
        int64_t cnt;
        const float *w0, *gr;
        const char *name = kv_grad_tensor(g, i, &cnt, &w0, &gr);
        const struct kv_config *c = kv_model_config(before);
        /* the same weight in `after`, and whether AdamW decays it (2-D) */
        int64_t layer, s2[2];
        enum kv_wkind kind = kv_grad_tensor_kind(g, i, &layer);
        const float *w1 = kv_model_weight(after, kind, layer);
        int decay = kv_model_expected_shape(c, kind, s2) == 2;
        cr_assert_not_null(w1, "%s", name);
        float *want = malloc((size_t)cnt * sizeof *want);
        for (int64_t j = 0; j < cnt; j++) {
            double gj = gr[j] * clip;
            want[j] = (float)(w0[j] - o.lr * (gj / (fabs(gj) + o.adam_eps) + (decay ? o.weight_decay : 0) * w0[j]));
        }
        kvt_assert_close_f32(w1, want, cnt, 1e-6, 1e-5, name);
        free(want);
    }
    kv_grad_free(g);
    kv_model_close(before), kv_model_close(after);
    free(ids), free(t), free(dir), free(text), free(out), free(ck), free(out0), free(ck0);
}

Test(train, refusals) {
    char *text = write_text(10), *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "m"), *ck = kvt_path(dir, "m.ckpt");
    struct kv_train_opts o;
    tiny_opts(&o, KV_ARCH_LLAMA);
    o.train_path = text, o.out_dir = out, o.ckpt_path = ck;
    struct kv_err err = {0};
    cr_assert_eq(kv_train(&o, &err), KV_EINVAL);
    cr_assert(strstr(err.msg, "training text has 10 tokens, fewer than one window of 17"), "%s", err.msg);
    o.resume = 1;
    free(text);
    text = write_text(400);
    o.train_path = text;
    cr_assert_neq(kv_train(&o, &err), KV_OK);
    cr_assert(strstr(err.msg, "cannot open"), "%s", err.msg);
    free(text), free(dir), free(out), free(ck);
}

static void cli_says(const char *args, int code, const char *want) {
    char *out = NULL, *err = NULL;
    int rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, code, "kvcal %s: exit %d, expected %d (%s)", args, rc, code, err);
    cr_assert(strstr(err, want), "kvcal %s: stderr '%s' lacks '%s'", args, err, want);
    free(out), free(err);
}

Test(train_cli, messages) {
    char *dir = kvt_temp_dir(), args[1024];
    cli_says("train", 2, "kvcal train: missing --text\n");
    cli_says("train --text t.txt", 2, "kvcal train: missing --output\n");
    cli_says("train --text t.txt -o m --arch foo", 2, "kvcal train: unknown --arch 'foo' (llama, gpt2, mistral, qwen2, phi3, qwen3, gpt_neox or gemma2)\n");
    cli_says("train --text t.txt -o m --arch gpt2 --kv-heads 2", 2,
             "kvcal train: gpt2 has one KV head per head (--kv-heads 2, --heads 4)\n");
    cli_says("train --text t.txt -o m --dim 250", 2,
             "kvcal train: --dim 250 is not a positive multiple of --heads 4\n");
    cli_says("train --text t.txt -o m --dtype f8", 2, "kvcal train: unknown --dtype 'f8' (f16, bf16 or f32)\n");
    snprintf(args, sizeof args, "train --text t.txt -o %s/m --resume", dir);
    char want[1100];
    snprintf(want, sizeof want, "kvcal: %s/m.ckpt: no checkpoint to resume from\n", dir);
    cli_says(args, 1, want);
    snprintf(args, sizeof args, "train --text %s/absent.txt -o %s/m -q", dir, dir);
    snprintf(want, sizeof want, "kvcal: %s/absent.txt: cannot open: no such file or directory\n", dir);
    cli_says(args, 1, want);
    char *m = kvt_path(dir, "m");
    struct stat st;
    cr_assert(stat(m, &st) != 0, "a failed run created %s", m);
    free(m), free(dir);
}

/* A damaged or foreign checkpoint is refused with its path, never resumed. */
Test(train, corrupt_checkpoints) {
    char *text = write_text(2000), *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "m"), *ck = kvt_path(dir, "m.ckpt");
    struct kv_err err = {0};
    struct kv_train_opts o;
    tiny_opts(&o, KV_ARCH_LLAMA);
    struct seen s = {.stop_at = 3};
    o.steps = 6, o.train_path = text, o.out_dir = out, o.ckpt_path = ck;
    o.log = record, o.log_ctx = &s;
    cr_assert_eq(kv_train(&o, &err), KV_EINVAL);
    size_t len;
    char *bytes = kvt_read_file(ck, &len);
    cr_assert_not_null(bytes);
    o.resume = 1, s.stop_at = 0;
    /* truncated: the safetensors reader names the file and the offset */
    FILE *f = fopen(ck, "wb");
    fwrite(bytes, 1, len / 2, f);
    fclose(f);
    cr_assert_eq(kv_train(&o, &err), KV_EFORMAT, "%s", err.msg);
    cr_assert_str_eq(err.path, ck);
    /* a model file is not a checkpoint */
    char *model = kvt_path(dir, "other");
    struct kv_train_opts z;
    tiny_opts(&z, KV_ARCH_LLAMA);
    z.steps = 1, z.train_path = text, z.out_dir = model, z.ckpt_path = ck;
    cr_assert_eq(kv_train(&z, &err), KV_OK, "%s", err.msg);
    char *st = kvt_path(model, "model.safetensors");
    o.ckpt_path = st;
    cr_assert_eq(kv_train(&o, &err), KV_EFORMAT);
    cr_assert_str_eq(err.msg, "not a kvcal training checkpoint (version 1)");
    cr_assert_str_eq(err.path, st);
    free(bytes), free(st), free(model), free(text), free(dir), free(out), free(ck);
}

/* ------------------------------------------------------------ options */

Test(train, config_defaults_follow_the_architecture) {
    struct kv_config c;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_train_config("llama", 256, 4, 4, -1, -1, 512, &c, NULL, &err), KV_OK, "%s", err.msg);
    cr_assert(c.arch == KV_ARCH_LLAMA && c.dim == 256 && c.n_layers == 4 && c.n_heads == 4);
    cr_assert_eq(c.n_kv_heads, 2);
    cr_assert_eq(c.head_dim, 64);
    cr_assert_eq(c.hidden_dim, 704, "8d/3 rounded up to 64: %lld", (long long)c.hidden_dim);
    cr_assert(c.max_seq_len == 512 && c.rope_layout == KV_ROPE_HALF && !c.tied_embeddings);
    cr_assert(c.norm_eps == 1e-5f && c.rope_theta == 10000.0f);
    cr_assert_eq(kv_train_config("llama", 64, 1, 1, -1, 100, 16, &c, NULL, &err), KV_OK);
    cr_assert(c.n_kv_heads == 1 && c.hidden_dim == 100);
    cr_assert_eq(kv_train_config("gpt2", 96, 2, 6, -1, -1, 128, &c, NULL, &err), KV_OK, "%s", err.msg);
    cr_assert(c.arch == KV_ARCH_GPT2 && c.n_kv_heads == 6 && c.hidden_dim == 384 && c.tied_embeddings);
}

Test(train, config_refusals_name_the_callers_options) {
    static const char *const flags[KV_TRAIN_OPT_COUNT] = {
        [KV_TRAIN_OPT_ARCH] = "--arch", [KV_TRAIN_OPT_DIM] = "--dim",
        [KV_TRAIN_OPT_HEADS] = "--heads", [KV_TRAIN_OPT_KV_HEADS] = "--kv-heads"};
    const struct {
        const char *arch;
        int64_t dim, layers, heads, kv;
        const char *own, *cli;
    } rows[] = {
        {"foo", 64, 1, 4, -1, "unknown architecture 'foo' (llama, gpt2, mistral, qwen2, phi3, qwen3, gpt_neox or gemma2)",
         "unknown --arch 'foo' (llama, gpt2, mistral, qwen2, phi3, qwen3, gpt_neox or gemma2)"},
        {"llama", 250, 1, 4, -1, "dim 250 is not a positive multiple of heads 4",
         "--dim 250 is not a positive multiple of --heads 4"},
        {"llama", 64, 0, 4, -1, "dim 64 is not a positive multiple of heads 4",
         "--dim 64 is not a positive multiple of --heads 4"},
        {"llama", 64, 1, 4, 3, "heads 4 is not a multiple of kv heads 3",
         "--heads 4 is not a multiple of --kv-heads 3"},
        {"llama", 64, 1, 4, 0, "heads 4 is not a multiple of kv heads 0",
         "--heads 4 is not a multiple of --kv-heads 0"},
        {"gpt2", 64, 1, 4, 2, "gpt2 has one KV head per head (kv heads 2, heads 4)",
         "gpt2 has one KV head per head (--kv-heads 2, --heads 4)"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_config c;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_train_config(rows[i].arch, rows[i].dim, rows[i].layers, rows[i].heads,
                                     rows[i].kv, -1, 64, &c, NULL, &err), KV_EINVAL, "row %zu", i);
        cr_assert_str_eq(err.msg, rows[i].own);
        cr_assert_eq(kv_train_config(rows[i].arch, rows[i].dim, rows[i].layers, rows[i].heads,
                                     rows[i].kv, -1, 64, &c, flags, &err), KV_EINVAL, "row %zu", i);
        cr_assert_str_eq(err.msg, rows[i].cli);
    }
}

Test(train, option_checks_name_each_group_or_say_out_of_range) {
    static const char *const flags[KV_TRAIN_OPT_COUNT] = {
        [KV_TRAIN_OPT_SEQ_LEN] = "--seq-len", [KV_TRAIN_OPT_BATCH] = "--batch",
        [KV_TRAIN_OPT_STEPS] = "--steps", [KV_TRAIN_OPT_LOG_EVERY] = "--log-every",
        [KV_TRAIN_OPT_WARMUP] = "--warmup", [KV_TRAIN_OPT_LR] = "--lr",
        [KV_TRAIN_OPT_MIN_LR] = "--min-lr", [KV_TRAIN_OPT_WEIGHT_DECAY] = "--weight-decay",
        [KV_TRAIN_OPT_CLIP] = "--clip"};
    const char *counts = "--seq-len must be at least 2, --batch, --steps and --log-every at "
                         "least 1, --warmup at least 0";
    const char *rates = "--lr must be positive; --min-lr, --weight-decay and --clip at least 0";
    struct kv_train_opts o;
    struct kv_err err;
    kv_err_clear(&err);
    tiny_opts(&o, KV_ARCH_LLAMA);
    cr_assert_eq(kv_train_check(&o, flags, &err), KV_OK, "%s", err.msg);
    for (int k = 0; k < 9; k++) {
        tiny_opts(&o, KV_ARCH_LLAMA);
        const char *want = k < 5 ? counts : rates;
        switch (k) {
        case 0: o.seq_len = 1; break;
        case 1: o.batch = 0; break;
        case 2: o.steps = 0; break;
        case 3: o.log_every = 0; break;
        case 4: o.warmup = -1; break;
        case 5: o.lr = 0; break;
        case 6: o.min_lr = -1; break;
        case 7: o.weight_decay = NAN; break;
        default: o.grad_clip = -0.5; break;
        }
        cr_assert_eq(kv_train_check(&o, flags, &err), KV_EINVAL, "case %d", k);
        cr_assert_str_eq(err.msg, want, "case %d", k);
        cr_assert_eq(kv_train_check(&o, NULL, &err), KV_EINVAL, "case %d", k);
        cr_assert_str_eq(err.msg, "training options are out of range", "case %d", k);
    }
    /* a resume needs its checkpoint */
    tiny_opts(&o, KV_ARCH_LLAMA);
    char *dir = kvt_temp_dir(), *ck = kvt_path(dir, "absent.ckpt");
    o.ckpt_path = ck;
    cr_assert_eq(kv_train_check_resume(&o, &err), KV_OK);
    o.resume = 1;
    cr_assert_eq(kv_train_check_resume(&o, &err), KV_EIO);
    cr_assert_str_eq(err.msg, "no checkpoint to resume from");
    cr_assert_str_eq(err.path, ck);
    free(ck);
    kvt_rm_dir(dir);
}

struct due_log {
    int64_t due[64];
    int64_t n;
};

static int record_due(void *ctx, const struct kv_train_log *l) {
    struct due_log *d = ctx;
    if (l->due && d->n < 64) d->due[d->n++] = l->step;
    return 0;
}

Test(train, log_lines_are_due_at_the_first_last_every_nth_and_evaluated_steps) {
    char *text = write_text(4000), *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "m"), *ck = kvt_path(dir, "m.ckpt");
    struct kv_train_opts o;
    tiny_opts(&o, KV_ARCH_LLAMA);
    struct due_log d = {0};
    o.steps = 8, o.log_every = 3, o.eval_every = 5, o.eval_windows = 1;
    o.train_path = text, o.eval_path = text, o.out_dir = out, o.ckpt_path = ck;
    o.log = record_due, o.log_ctx = &d;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_train(&o, &err), KV_OK, "%s", err.msg);
    const int64_t want[] = {1, 3, 5, 6, 8};
    cr_assert_eq(d.n, 5, "%lld steps due", (long long)d.n);
    for (int i = 0; i < 5; i++) cr_assert_eq(d.due[i], want[i], "due %d", i);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    free(text), free(dir), free(out), free(ck);
}
