/* kvcal train: a small model from scratch (the maintainers' fixture maker). */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "commands.h"

static volatile sig_atomic_t interrupted;
static void on_signal(int sig) {
    (void)sig;
    interrupted = 1;
}

struct train_ui {
    int quiet, every;
    double unigram;
};

static int on_step(void *ctx, const struct kv_train_log *l) {
    const struct train_ui *u = ctx;
    int show = !u->quiet && (l->step == 1 || l->step % u->every == 0 || l->step == l->steps ||
                             !isnan(l->eval_loss));
    if (show) {
        fprintf(stderr, "step %6lld/%lld  loss %.4f  lr %.2e  |g| %.3f  %.0f tok/s", (long long)l->step,
                (long long)l->steps, l->loss, l->lr, l->grad_norm,
                (double)l->run_tokens / (l->seconds > 0 ? l->seconds : 1));
        if (!isnan(l->eval_loss))
            fprintf(stderr, "  eval %.4f (ppl %.3f)", l->eval_loss, exp(l->eval_loss));
        fprintf(stderr, "\n");
    }
    return interrupted;
}

int cmd_train(int argc, char **argv) {
    const char *text = NULL, *eval = NULL, *tok = NULL, *out = NULL, *ckpt = NULL;
    const char *arch = "llama", *dtype = "f16";
    int64_t dim = 256, layers = 4, heads = 4, kv_heads = -1, hidden = -1, ctx = 256, threads = 0;
    int64_t log_every = 10;
    int resume = 0, quiet = 0;
    struct kv_train_opts o;
    memset(&o, 0, sizeof o);
    kv_train_defaults(&o);
    int64_t seed = (int64_t)o.seed;
    const struct cli_opt opts[] = {
        {"text", 0, OPT_STR, &text, "FILE", "training text (.txt or .gz)"},
        {"eval", 0, OPT_STR, &eval, "FILE", "held-out text, scored every --eval-every steps"},
        {"output", 'o', OPT_STR, &out, "DIR", "HF directory to write at the end"},
        {"tokenizer", 0, OPT_STR, &tok, "FILE",
         "HF tokenizer.json (default: kvcal's byte-level one,\nwritten into DIR)"},
        {"arch", 0, OPT_STR, &arch, "NAME", "llama (RMSNorm, RoPE, GQA, SwiGLU) or gpt2\n(default llama)"},
        {"dim", 0, OPT_INT, &dim, "N", "model width d (default 256)"},
        {"layers", 0, OPT_INT, &layers, "N", "layers (default 4)"},
        {"heads", 0, OPT_INT, &heads, "N", "query heads; head_dim = dim/heads (default 4)"},
        {"kv-heads", 0, OPT_INT, &kv_heads, "N", "KV heads (llama; default heads/2, gpt2 = heads)"},
        {"hidden", 0, OPT_INT, &hidden, "N",
         "FFN width (default: llama 8d/3 rounded up to 64, gpt2 4d)"},
        {"ctx", 0, OPT_INT, &ctx, "N", "context the model is made for (gpt2's positions;\ndefault 256)"},
        {"seq-len", 0, OPT_INT, &o.seq_len, "N", "tokens per training window (default 256)"},
        {"batch", 0, OPT_INT, &o.batch, "N", "windows per step (default 16)"},
        {"steps", 0, OPT_INT, &o.steps, "N", "optimizer steps (default 2000)"},
        {"warmup", 0, OPT_INT, &o.warmup, "N", "linear warmup steps (default 100)"},
        {"lr", 0, OPT_DOUBLE, &o.lr, "X", "peak learning rate (default 2e-3)"},
        {"min-lr", 0, OPT_DOUBLE, &o.min_lr, "X", "final learning rate of the cosine (default 2e-4)"},
        {"weight-decay", 0, OPT_DOUBLE, &o.weight_decay, "X", "AdamW decay of 2-D weights (default 0.1)"},
        {"clip", 0, OPT_DOUBLE, &o.grad_clip, "X", "gradient-norm clip, 0 = none (default 1)"},
        {"seed", 0, OPT_INT, &seed, "N", "initialisation and window stream (default 1)"},
        {"eval-every", 0, OPT_INT, &o.eval_every, "N", "steps between held-out evaluations (default 100)"},
        {"eval-windows", 0, OPT_INT, &o.eval_windows, "N", "held-out windows per evaluation (default 32)"},
        {"checkpoint", 0, OPT_STR, &ckpt, "FILE", "checkpoint file (default DIR.ckpt)"},
        {"checkpoint-every", 0, OPT_INT, &o.ckpt_every, "N", "steps between checkpoints (default 100)"},
        {"resume", 0, OPT_FLAG, &resume, NULL, "continue from the checkpoint (bit-identical)"},
        {"dtype", 0, OPT_STR, &dtype, "T", "weights written: f16, bf16 or f32 (default f16)"},
        {"threads", 't', OPT_INT, &threads, "N", "threads (default: all cores)"},
        {"log-every", 0, OPT_INT, &log_every, "N", "steps between log lines (default 10)"},
        {"quiet", 'q', OPT_FLAG, &quiet, NULL, "no log lines"},
    };
    const struct cli_cmd cmd = {
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
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, NULL, &n_pos);
    if (rc >= 0) return rc;
    if (!text) return cli_usage_error(&cmd, "missing --text");
    if (!out) return cli_usage_error(&cmd, "missing --output");
    struct kv_config *c = &o.cfg;
    if (!strcmp(arch, "llama")) {
        c->arch = KV_ARCH_LLAMA;
    } else if (!strcmp(arch, "gpt2")) {
        c->arch = KV_ARCH_GPT2;
    } else {
        return cli_usage_error(&cmd, "unknown --arch '%s' (llama or gpt2)", arch);
    }
    if (dim <= 0 || layers <= 0 || heads <= 0 || dim % heads)
        return cli_usage_error(&cmd, "--dim %lld is not a positive multiple of --heads %lld",
                               (long long)dim, (long long)heads);
    if (kv_heads < 0) kv_heads = c->arch == KV_ARCH_GPT2 ? heads : (heads > 1 ? heads / 2 : 1);
    if (kv_heads <= 0 || heads % kv_heads)
        return cli_usage_error(&cmd, "--heads %lld is not a multiple of --kv-heads %lld",
                               (long long)heads, (long long)kv_heads);
    if (c->arch == KV_ARCH_GPT2 && kv_heads != heads)
        return cli_usage_error(&cmd, "gpt2 has one KV head per head (--kv-heads %lld, --heads %lld)",
                               (long long)kv_heads, (long long)heads);
    if (hidden < 0) hidden = c->arch == KV_ARCH_GPT2 ? 4 * dim : (8 * dim / 3 + 63) / 64 * 64;
    c->dim = dim, c->n_layers = layers, c->n_heads = heads, c->n_kv_heads = kv_heads;
    c->head_dim = dim / heads, c->hidden_dim = hidden, c->max_seq_len = ctx;
    c->norm_eps = 1e-5f, c->rope_theta = 10000.0f, c->rope_layout = KV_ROPE_HALF;
    c->tied_embeddings = c->arch == KV_ARCH_GPT2;
    if (!strcmp(dtype, "f16"))
        o.out_dtype = KV_DTYPE_F16;
    else if (!strcmp(dtype, "bf16"))
        o.out_dtype = KV_DTYPE_BF16;
    else if (!strcmp(dtype, "f32"))
        o.out_dtype = KV_DTYPE_F32;
    else
        return cli_usage_error(&cmd, "unknown --dtype '%s' (f16, bf16 or f32)", dtype);
    if (o.seq_len < 2 || o.batch < 1 || o.steps < 1 || o.warmup < 0 || log_every < 1)
        return cli_usage_error(&cmd, "--seq-len must be at least 2, --batch, --steps and "
                                     "--log-every at least 1, --warmup at least 0");
    if (!(o.lr > 0) || !(o.min_lr >= 0) || !(o.weight_decay >= 0) || !(o.grad_clip >= 0))
        return cli_usage_error(&cmd, "--lr must be positive; --min-lr, --weight-decay and --clip "
                                     "at least 0");
    if (seed < 0) return cli_usage_error(&cmd, "--seed must be at least 0");
    o.seed = (uint64_t)seed;
    char ckbuf[4096];
    if (!ckpt) {
        snprintf(ckbuf, sizeof ckbuf, "%s.ckpt", out);
        ckpt = ckbuf;
    }
    struct stat st;
    if (resume && stat(ckpt, &st) != 0) {
        fprintf(stderr, "kvcal: %s: no checkpoint to resume from\n", ckpt);
        return EXIT_ERR;
    }
    kv_set_threads((int)threads);
    o.train_path = text, o.eval_path = eval, o.tokenizer_path = tok, o.out_dir = out;
    o.ckpt_path = ckpt, o.resume = resume;
    struct train_ui ui = {quiet, (int)log_every, 0};
    o.log = on_step, o.log_ctx = &ui;
    if (!quiet)
        fprintf(stderr, "training %s d=%lld L=%lld h=%lld g=%lld hidden=%lld: %lld steps of %lld x %lld tokens%s\n",
                arch, (long long)dim, (long long)layers, (long long)heads, (long long)kv_heads,
                (long long)hidden, (long long)o.steps, (long long)o.batch, (long long)o.seq_len,
                resume ? " (resuming)" : "");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    struct kv_err err;
    kv_err_clear(&err);
    double t0 = kv_now();
    rc = kv_train(&o, &err);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    if (rc) {
        cli_report(&err);
        if (interrupted) {
            fprintf(stderr, "kvcal: checkpoint in %s; continue with --resume\n", ckpt);
            return 128 + SIGINT;
        }
        return EXIT_ERR;
    }
    double secs = kv_now() - t0;
    if (o.run_tokens < o.tokens_seen)
        printf("trained   %lld tokens, %lld of them in this run (%.0f s, %.0f tok/s), peak RSS %.0f MiB\n",
               (long long)o.tokens_seen, (long long)o.run_tokens, secs,
               secs > 0 ? (double)o.run_tokens / secs : 0.0, cli_peak_rss_mib());
    else
        printf("trained   %lld tokens in %.0f s (%.0f tok/s), peak RSS %.0f MiB\n",
               (long long)o.tokens_seen, secs, secs > 0 ? (double)o.tokens_seen / secs : 0.0,
               cli_peak_rss_mib());
    if (eval)
        printf("held-out  loss %.4f (ppl %.3f) against a unigram model's %.4f (ppl %.3f)\n",
               o.final_eval_loss, exp(o.final_eval_loss), o.unigram_eval_loss,
               exp(o.unigram_eval_loss));
    printf("wrote     %s (config.json, model.safetensors, tokenizer.json, train_log.tsv)\n", out);
    return EXIT_OK;
}
