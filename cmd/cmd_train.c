/* kvcal train: a small model from scratch (the maintainers' fixture maker).
 * The architecture, its defaults and the option rules are the library's
 * (kv_train_config, kv_train_check); this file reads the command line,
 * handles Ctrl-C and prints the log. */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

static volatile sig_atomic_t interrupted;
static void on_signal(int sig) {
    (void)sig;
    interrupted = 1;
}

/* What the command line gives (file scope: the option table points into
 * it); the run's own options go straight into o. */
static struct train_args {
    const char *text, *eval, *tok, *out, *ckpt, *arch, *dtype;
    int64_t dim, layers, heads, kv_heads, hidden, ctx, threads, seed;
    int resume, quiet;
    struct kv_train_opts o;
} A = {.arch = "llama", .dtype = "f16", .dim = 256, .layers = 4, .heads = 4, .kv_heads = -1,
       .hidden = -1, .ctx = 256};

static const struct cli_opt train_opts[] = {
    {"text", 0, OPT_STR, &A.text, "FILE", "training text (.txt or .gz)"},
    {"eval", 0, OPT_STR, &A.eval, "FILE", "held-out text, scored every --eval-every steps"},
    {"output", 'o', OPT_STR, &A.out, "DIR",
     "HF directory to write at the end (an earlier model there is replaced whole; "
     "a directory with other files is refused)"},
    {"tokenizer", 0, OPT_STR, &A.tok, "FILE",
     "HF tokenizer.json (default: kvcal's byte-level one,\nwritten into DIR)"},
    {"arch", 0, OPT_STR, &A.arch, "NAME", "llama (RMSNorm, RoPE, GQA, SwiGLU) or gpt2\n(default llama)"},
    {"dim", 0, OPT_INT, &A.dim, "N", "model width d (default 256)"},
    {"layers", 0, OPT_INT, &A.layers, "N", "layers (default 4)"},
    {"heads", 0, OPT_INT, &A.heads, "N", "query heads; head_dim = dim/heads (default 4)"},
    {"kv-heads", 0, OPT_INT, &A.kv_heads, "N", "KV heads (llama; default heads/2, gpt2 = heads)"},
    {"hidden", 0, OPT_INT, &A.hidden, "N",
     "FFN width (default: llama 8d/3 rounded up to 64, gpt2 4d)"},
    {"ctx", 0, OPT_INT, &A.ctx, "N", "context the model is made for (gpt2's positions;\ndefault 256)"},
    {"seq-len", 0, OPT_INT, &A.o.seq_len, "N", "tokens per training window (default 256)"},
    {"batch", 0, OPT_INT, &A.o.batch, "N", "windows per step (default 16)"},
    {"steps", 0, OPT_INT, &A.o.steps, "N", "optimizer steps (default 2000)"},
    {"warmup", 0, OPT_INT, &A.o.warmup, "N", "linear warmup steps (default 100)"},
    {"lr", 0, OPT_DOUBLE, &A.o.lr, "X", "peak learning rate (default 2e-3)"},
    {"min-lr", 0, OPT_DOUBLE, &A.o.min_lr, "X", "final learning rate of the cosine (default 2e-4)"},
    {"weight-decay", 0, OPT_DOUBLE, &A.o.weight_decay, "X", "AdamW decay of 2-D weights (default 0.1)"},
    {"clip", 0, OPT_DOUBLE, &A.o.grad_clip, "X", "gradient-norm clip, 0 = none (default 1)"},
    {"seed", 0, OPT_INT, &A.seed, "N", "initialisation and window stream (default 1)"},
    {"eval-every", 0, OPT_INT, &A.o.eval_every, "N", "steps between held-out evaluations (default 100)"},
    {"eval-windows", 0, OPT_INT, &A.o.eval_windows, "N", "held-out windows per evaluation (default 32)"},
    {"checkpoint", 0, OPT_STR, &A.ckpt, "FILE", "checkpoint file (default DIR.ckpt)"},
    {"checkpoint-every", 0, OPT_INT, &A.o.ckpt_every, "N", "steps between checkpoints (default 100)"},
    {"resume", 0, OPT_FLAG, &A.resume, NULL, "continue from the checkpoint (bit-identical)"},
    {"dtype", 0, OPT_STR, &A.dtype, "T", "weights written: f16, bf16 or f32 (default f16)"},
    {"threads", 't', OPT_INT, &A.threads, "N", "threads (default: all cores)"},
    {"log-every", 0, OPT_INT, &A.o.log_every, "N", "steps between log lines (default 10)"},
    {"quiet", 'q', OPT_FLAG, &A.quiet, NULL, "no log lines"},
};

static const struct cli_cmd train_cmd = {
    "train", "--text FILE -o DIR [options]",
    "Train a small model from scratch with kvcal's own backward pass. This is a\n"
    "maintainer command: it makes the fixture models in data/ (make fixtures).\n"
    "AdamW with decoupled weight decay on 2-D weights, linear warmup then a cosine\n"
    "to --min-lr, global gradient-norm clipping, and batches of random windows from\n"
    "a seeded stream (one in eight starts with BOS). A checkpoint is written every\n"
    "--checkpoint-every steps and on Ctrl-C; --resume continues bit-identically.\n"
    "At the end DIR holds an HF model (config.json, model.safetensors,\n"
    "tokenizer.json) and train_log.tsv, the loss curve.",
    "examples:\n"
    "  kvcal train --text data/kjv/train.txt --eval data/kjv/gospels.txt -o data/kjv-llama\n"
    "  kvcal train --arch gpt2 --heads 4 --text data/kjv/train.txt -o data/kjv-gpt2 --steps 1500\n"
    "  kvcal train --text t.txt -o m --resume      # after an interruption\n",
    train_opts, (int)(sizeof train_opts / sizeof train_opts[0]), 0};

/* The options as the library's messages name them. */
static const char *const train_names[KV_TRAIN_OPT_COUNT] = {
    [KV_TRAIN_OPT_ARCH] = "--arch",
    [KV_TRAIN_OPT_DIM] = "--dim",
    [KV_TRAIN_OPT_HEADS] = "--heads",
    [KV_TRAIN_OPT_KV_HEADS] = "--kv-heads",
    [KV_TRAIN_OPT_SEQ_LEN] = "--seq-len",
    [KV_TRAIN_OPT_BATCH] = "--batch",
    [KV_TRAIN_OPT_STEPS] = "--steps",
    [KV_TRAIN_OPT_LOG_EVERY] = "--log-every",
    [KV_TRAIN_OPT_WARMUP] = "--warmup",
    [KV_TRAIN_OPT_LR] = "--lr",
    [KV_TRAIN_OPT_MIN_LR] = "--min-lr",
    [KV_TRAIN_OPT_WEIGHT_DECAY] = "--weight-decay",
    [KV_TRAIN_OPT_CLIP] = "--clip",
};

/* The steps the library marks due, on stderr; Ctrl-C stops the run. */
static int on_step(void *ctx, const struct kv_train_log *l) {
    int quiet = *(const int *)ctx;
    if (!quiet && l->due) {
        fprintf(stderr, "step %6lld/%lld  loss %.4f  lr %.2e  |g| %.3f  %.0f tok/s", (long long)l->step,
                (long long)l->steps, l->loss, l->lr, l->grad_norm,
                (double)l->run_tokens / (l->seconds > 0 ? l->seconds : 1));
        if (!isnan(l->eval_loss))
            fprintf(stderr, "  eval %.4f (ppl %.3f)", l->eval_loss, exp(l->eval_loss));
        fprintf(stderr, "\n");
    }
    return interrupted;
}

/* --dtype: the weights written. */
static int parse_dtype(const char *s, enum kv_dtype *out) {
    if (!strcmp(s, "f16"))
        *out = KV_DTYPE_F16;
    else if (!strcmp(s, "bf16"))
        *out = KV_DTYPE_BF16;
    else if (!strcmp(s, "f32"))
        *out = KV_DTYPE_F32;
    else
        return -1;
    return 0;
}

/* The checks, in the order the command has always made them: the
 * library's rules with its names, and the command line's own. Fills a->o.
 * Returns -1 to go on, or an exit code after the message. */
static int check_args(const struct cli_cmd *cmd, struct train_args *a, char *ckbuf, size_t cap) {
    struct kv_train_opts *o = &a->o;
    struct kv_err err;
    kv_err_clear(&err);
    if (!a->text) return cli_usage_error(cmd, "missing --text");
    if (!a->out) return cli_usage_error(cmd, "missing --output");
    if (kv_train_config(a->arch, a->dim, a->layers, a->heads, a->kv_heads, a->hidden, a->ctx,
                        &o->cfg, train_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    if (parse_dtype(a->dtype, &o->out_dtype))
        return cli_usage_error(cmd, "unknown --dtype '%s' (f16, bf16 or f32)", a->dtype);
    if (kv_train_check(o, train_names, &err)) return cli_usage_error(cmd, "%s", err.msg);
    /* the command line's own: the seed is read signed */
    if (a->seed < 0) return cli_usage_error(cmd, "--seed must be at least 0");
    o->seed = (uint64_t)a->seed;
    if (!a->ckpt) {
        snprintf(ckbuf, cap, "%s.ckpt", a->out);
        a->ckpt = ckbuf;
    }
    o->train_path = a->text, o->eval_path = a->eval, o->tokenizer_path = a->tok;
    o->out_dir = a->out, o->ckpt_path = a->ckpt, o->resume = a->resume;
    if (kv_train_check_resume(o, &err)) return cli_report_refusal(&err);
    return -1;
}

/* kv_train, stopped by Ctrl-C or SIGTERM after a checkpoint. */
static int run(struct kv_train_opts *o, struct kv_err *err) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int rc = kv_train(o, err);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    return rc;
}

int cmd_train(int argc, char **argv) {
    struct train_args *a = &A;
    struct kv_train_opts *o = &a->o;
    kv_train_defaults(o);
    a->seed = (int64_t)o->seed;
    int n_pos;
    int rc = cli_parse(&train_cmd, argc, argv, NULL, &n_pos);
    if (rc >= 0) return rc;
    char ckbuf[4096];
    if ((rc = check_args(&train_cmd, a, ckbuf, sizeof ckbuf)) >= 0) return rc;
    kv_set_threads((int)a->threads);
    o->log = on_step, o->log_ctx = &a->quiet;
    const struct kv_config *c = &o->cfg;
    if (!a->quiet)
        fprintf(stderr, "training %s d=%lld L=%lld h=%lld g=%lld hidden=%lld: %lld steps of %lld x %lld tokens%s\n",
                a->arch, (long long)c->dim, (long long)c->n_layers, (long long)c->n_heads,
                (long long)c->n_kv_heads, (long long)c->hidden_dim, (long long)o->steps,
                (long long)o->batch, (long long)o->seq_len, a->resume ? " (resuming)" : "");
    struct kv_err err;
    kv_err_clear(&err);
    double t0 = kv_now();
    if ((rc = run(o, &err))) {
        cli_report(&err);
        if (interrupted) {
            fprintf(stderr, "kvcal: checkpoint in %s; continue with --resume\n", a->ckpt);
            return 128 + SIGINT;
        }
        return EXIT_ERR;
    }
    double secs = kv_now() - t0;
    if (o->run_tokens < o->tokens_seen)
        printf("trained   %lld tokens, %lld of them in this run (%.0f s, %.0f tok/s), peak RSS %.0f MiB\n",
               (long long)o->tokens_seen, (long long)o->run_tokens, secs,
               secs > 0 ? (double)o->run_tokens / secs : 0.0, cli_peak_rss_mib());
    else
        printf("trained   %lld tokens in %.0f s (%.0f tok/s), peak RSS %.0f MiB\n",
               (long long)o->tokens_seen, secs, secs > 0 ? (double)o->tokens_seen / secs : 0.0,
               cli_peak_rss_mib());
    if (a->eval)
        printf("held-out  loss %.4f (ppl %.3f) against a unigram model's %.4f (ppl %.3f)\n",
               o->final_eval_loss, exp(o->final_eval_loss), o->unigram_eval_loss,
               exp(o->unigram_eval_loss));
    printf("wrote     %s (config.json, model.safetensors, tokenizer.json, train_log.tsv)\n", a->out);
    return EXIT_OK;
}
