/* kvcal verify: perplexity under the windows protocol (kv_ppl_run, or
 * kv_ppl_compare* against a compressed model or a device). This file reads
 * the command line, opens the runtime for --device and prints. */
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "kvrt.h"

/* --device twin|cuda: a third run with the attention on the runtime. */
struct device {
    int on;
    struct kvrt_opts o;
    double tol;        /* --device-tol */
    char desc[512];    /* "twin (cpu), f32 cache" or "cuda: NAME (sm_90, 132 SMs), f16 cache" */
};

/* Open the runtime for m's attention (lr's with --compressed) and describe
 * it. Prints errors. */
static int device_open(struct device *dv, const struct kv_model *m, const struct kv_lowrank *lr,
                       int64_t seq_len, struct kvrt **rt) {
    struct kv_err err;
    kv_err_clear(&err);
    dv->o.max_ctx = seq_len;
    if (kvrt_open(m, lr, &dv->o, rt, &err)) return cli_report(&err);
    const char *cache = kvrt_dtype_name(dv->o.cache);
    if (dv->o.backend == KVRT_BACKEND_TWIN) {
        snprintf(dv->desc, sizeof dv->desc, "twin (cpu), %s cache", cache);
        return EXIT_OK;
    }
    struct kvrt_device d;
    if (kvrt_device_query(dv->o.device, &d, &err)) {
        kvrt_close(*rt);
        *rt = NULL;
        return cli_report(&err);
    }
    snprintf(dv->desc, sizeof dv->desc, "cuda: %s (sm_%d%d, %d SMs), %s cache", d.name, d.cc_major,
             d.cc_minor, d.sm_count, cache);
    return EXIT_OK;
}

/* The windows of base and, with lr, compressed on the cpu, plus the device
 * run with dv->on. Prints errors, naming src for those of the run itself. */
static int run_windows(const struct kv_model *m, const struct kv_lowrank *lr, int bits,
                       struct device *dv, const struct kv_token_src *ts, int64_t seq_len,
                       int64_t max_windows, int quiet, const char *src,
                       struct kv_compare_result *r) {
    struct kvrt *rt = NULL;
    int rc = dv->on ? device_open(dv, m, lr, seq_len, &rt) : EXIT_OK;
    if (rc) return rc;
    struct kv_err err;
    kv_err_clear(&err);
    struct cli_progress prog;
    cli_progress_start(&prog, "windows", quiet);
    if (rt) {
        const struct kv_fwd_hooks hk = {.ctx = rt, .attn = kvrt_fwd_attn};
        rc = kv_ppl_compare_src(m, lr, bits, &hk, ts, seq_len, max_windows, cli_progress_cb,
                                &prog, r, &err);
    } else {
        rc = kv_ppl_compare_src(m, lr, bits, NULL, ts, seq_len, max_windows, cli_progress_cb,
                                &prog, r, &err);
    }
    cli_progress_end(&prog);
    if (rc && rt && kvrt_error(rt)->code != KV_OK) {
        rc = cli_report(kvrt_error(rt)); /* the runtime knows what failed */
    } else if (rc) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", src);
        rc = cli_report(&err);
    }
    kvrt_close(rt);
    return rc;
}

/* Under mpirun: this rank's share of the windows (w ≡ rank mod ranks),
 * every window's sums added over the ranks (each window's row comes from
 * one rank, the others' are zero, so the sum is that row exactly) and the
 * totals taken in window order: what one process gives, bit for bit. The
 * forward-pass seconds are the slowest rank's. Prints errors, naming src
 * and the rank; every rank returns the same status. */
static double V_peak_rss = -1; /* the largest rank's peak rss, under mpirun */

static int run_parts(const struct kv_model *m, const struct kv_lowrank *lr, int bits,
                     const struct kv_token_src *ts, int64_t seq_len, int64_t max_windows,
                     int quiet, const char *src, struct kv_compare_result *r) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t windows = 0;
    double *sums = NULL, sec[2] = {0, 0};
    int rc = kv_ppl_windows(ts->n_tokens, seq_len, max_windows, &windows, &err);
    int oom = !rc && !(sums = calloc((size_t)windows * KV_PPL_SUMS, sizeof *sums));
    if (oom) {
        fprintf(stderr, "kvcal: out of memory for %lld windows' sums\n", (long long)windows);
        rc = EXIT_ERR;
    } else if (!rc) {
        struct cli_progress prog;
        cli_progress_start(&prog, "windows of this rank", quiet || cli_mpi_rank() > 0);
        rc = kv_ppl_compare_part(m, lr, bits, ts, seq_len, max_windows, cli_mpi_rank(),
                                 cli_mpi_size(), cli_progress_cb, &prog, sums, sec, &err);
        cli_progress_end(&prog);
    }
    if (rc && !oom) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", src);
        rc = cli_report(&err);
    }
    if (cli_mpi_any_failed(rc)) {
        free(sums);
        return rc ? rc : EXIT_ERR;
    }
    cli_mpi_sum(sums, windows * KV_PPL_SUMS);
    cli_mpi_max(sec, 2);
    V_peak_rss = cli_peak_rss_mib();
    cli_mpi_max(&V_peak_rss, 1);
    rc = kv_ppl_compare_finish(sums, windows, ts->n_tokens, seq_len, lr != NULL, sec, r, &err);
    free(sums);
    return rc ? cli_report(&err) : EXIT_OK;
}

/* Peak resident memory: this process's, or under mpirun the largest rank's. */
static double peak_rss(void) { return V_peak_rss >= 0 ? V_peak_rss : cli_peak_rss_mib(); }

/* The ranks that ran the windows, in the JSON under mpirun. */
static void json_ranks(json_t *o) {
    if (o && cli_mpi_size() > 1) json_object_set_new(o, "ranks", json_integer(cli_mpi_size()));
}

static double tokens_per_s(const struct kv_ppl_result *r, int64_t seq_len) {
    return r->seconds > 0 ? (double)(r->windows * seq_len) / r->seconds : 0;
}

/* The device run against cpu (the compressed run, or the base): text lines
 * after a blank one, or fields of the JSON object o. */
static void device_print(const struct device *dv, const struct kv_compare_result *r,
                         const struct kv_ppl_result *cpu, int64_t seq_len, json_t *o) {
    double rel = kv_compare_dev_rel(r), tps = tokens_per_s(&r->dev, seq_len);
    if (o) {
        json_t *f = json_pack(
            "{s:s, s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:I, s:I, s:o, s:o, s:o, s:o}", "device",
            kvrt_backend_name(dv->o.backend), "device_desc", dv->desc, "cache",
            kvrt_dtype_name(dv->o.cache), "device_ppl", cli_json_real(r->dev.ppl), "device_nll",
            cli_json_real(r->dev.nll), "device_rel_ppl", cli_json_real(rel), "device_tol",
            cli_json_real(dv->tol), "max_rel_logit", cli_json_real(r->max_rel_logit),
            "max_rel_logit_window", (json_int_t)r->max_rel_window, "max_rel_logit_position",
            (json_int_t)r->max_rel_pos, "device_kl", cli_json_real(r->dev_kl), "device_top1",
            cli_json_real(r->dev_top1), "device_tokens_per_s", cli_json_real(tps),
            "device_seconds", cli_json_real(r->dev.seconds));
        if (f) json_object_update(o, f);
        json_decref(f);
        return;
    }
    printf("\ndevice      %s, %.0f tokens/s\n", dv->desc, tps);
    printf("device ppl  %-11.4f (cpu %.4f, rel diff %+.2e, tolerance %g)\n", r->dev.ppl, cpu->ppl,
           rel, dv->tol);
    printf("logits      max rel diff %.2e at window %lld position %lld; kl %.2e nats per token, "
           "KL(cpu || device); top-1 %.4f\n",
           r->max_rel_logit, (long long)r->max_rel_window, (long long)r->max_rel_pos, r->dev_kl,
           r->dev_top1);
}

/* The options as the library's messages name them. */
static const char *const ppl_names[KV_PPL_OPT_COUNT] = {
    [KV_PPL_OPT_SEQ_LEN] = "--seq-len",
    [KV_PPL_OPT_MAX_WINDOWS] = "--max-windows",
    [KV_PPL_OPT_DEVICE_TOL] = "--device-tol",
};

/* Exit 3 with a line on stderr when a device run's ppl is off by more than
 * --device-tol (kv_ppl_device_verdict); rc otherwise. */
static int device_verdict(const struct device *dv, const struct kv_compare_result *r, int rc) {
    struct kv_err err;
    kv_err_clear(&err);
    if (rc || !dv->on || !kv_ppl_device_verdict(r, dv->tol, ppl_names, &err)) return rc;
    fprintf(stderr, "kvcal: %s\n", err.msg);
    return EXIT_TOLERANCE;
}

/* What the command line gives (file scope: the option table points into it). */
static struct verify_args {
    const char *model, *tokenizer, *text, *tokens, *comp, *device, *cache, *mla;
    int64_t seq_len, max_windows, threads, kv_bits;
    int json, quiet, hadamard;
    double device_tol; /* NaN: not given */
} A = {.seq_len = 256, .device = "cpu", .device_tol = NAN};

static const struct cli_opt verify_opts[] = {
    CLI_OPT_MODEL(&A.model),
    {"tokenizer", 0, OPT_STR, &A.tokenizer, "FILE",
     "override the model's tokenizer (tokenizer.bin, tokenizer.json or .gguf)"},
    {"text", 't', OPT_STR, &A.text, "FILE",
     "evaluation text, .txt or .gz (one document; .jsonl as collect reads it)"},
    CLI_OPT_PARSE_SPECIAL,
    {"tokens", 0, OPT_STR, &A.tokens, "FILE",
     "pre-tokenized ids (little-endian uint32) instead of --text; include BOS yourself"},
    {"compressed", 0, OPT_STR, &A.comp, "DIR",
     "also run the compressed model in DIR (from 'kvcal decompose') with a cache that\n"
     "stores latents, and compare it with the base: ppl, kl, top-1, kv bytes"},
    {"mla", 0, OPT_STR, &A.mla, "PATH",
     "also run the model's attention as PATH from 'kvcal export --mla' (a GGUF\n"
     "deepseek2 file or an HF DeepseekV2ForCausalLM directory: multi-head latent\n"
     "attention, caching its latent and rope key) and compare"},
    {"kv-bits", 0, OPT_INT, &A.kv_bits, "B",
     "with --compressed: latent storage 16, 8, 4, 3 or 2 bits (default: the manifest's);\n"
     "below 16, per-token asymmetric quantization with fp16 scale and zero point"},
    {"hadamard", 0, OPT_FLAG, &A.hadamard, NULL,
     "with --compressed: fuse a Walsh-Hadamard rotation into the factors before running\n"
     "(as decompose --hadamard; no-op when the directory already has one)"},
    {"device", 0, OPT_STR, &A.device, "D",
     "cpu (default), twin or cuda: also run every window with the attention on the\n"
     "runtime (twin: its cpu twin of the gpu kernels; cuda: the gpu) and compare"},
    {"cache", 0, OPT_STR, &A.cache, "T",
     "with --device twin or cuda: the runtime's cache storage, f16 (default) or f32"},
    {"device-tol", 0, OPT_DOUBLE, &A.device_tol, "X",
     "with --device twin or cuda: largest |device ppl / cpu ppl - 1| accepted (default\n"
     "1e-3); beyond it verify exits 3"},
    {"seq-len", 0, OPT_INT, &A.seq_len, "N", "window length in tokens (default 256)"},
    {"max-windows", 0, OPT_INT, &A.max_windows, "W", "evaluate only the first W windows"},
    CLI_OPT_THREADS(&A.threads),
    CLI_OPT_JSON(&A.json),
    CLI_OPT_QUIET(&A.quiet),
};

static const struct cli_cmd verify_cmd = {
    "verify", "--model PATH --text FILE [--compressed DIR] [options]",
    "Report the perplexity of a model on held-out text.",
    "protocol (windows): the text is one document with BOS once at its start; its tokens\n"
    "are cut into non-overlapping windows of --seq-len (the remainder is dropped); each\n"
    "window runs on its own from position 0, and positions 1..seq-len-1 are scored (the\n"
    "nll of the token at t given the tokens before it); ppl = exp(mean nll).\n"
    "\nwith --compressed the base model and the compressed one run the same windows; the\n"
    "compressed cache stores only latents: keys rebuilt from them before RoPE (palu,\n"
    "eigen, svd, lorc), or scored as rotated post-RoPE q·k (fdc, zack); values stay\n"
    "latent and go through the fused output projection. KV bytes per token count fp16\n"
    "for the base and, for latents, their codes plus scale and zero point. --json adds\n"
    "95% intervals of ppl/base_ppl - 1 and of kl (delta_ppl_rel_ci95, kl_ci95): the\n"
    "percentiles of 2000 resamples of the windows, drawn with replacement.\n"
    "\nwith --device twin or cuda a further run of the same windows puts every layer's\n"
    "attention on the runtime (kvrt: decode steps, one token at a time, over its own KV\n"
    "cache; with --compressed the compressed model's latent cache, else the base's full\n"
    "one) while the rest of the model stays on the cpu. It is compared with the cpu run\n"
    "of the same model: device ppl and its relative difference, the largest relative\n"
    "logit difference (max over the vocabulary of |device - cpu| over the largest |cpu|\n"
    "logit, maximum over scored positions) and where it is, KL(cpu || device) and top-1\n"
    "agreement. An f16 cache (the default) rounds what it stores, as a deployment would;\n"
    "f32 reproduces the cpu path to rounding. When |device ppl / cpu ppl - 1| exceeds\n"
    "--device-tol verify prints the numbers, says so on stderr and exits 3.\n"
    "\nunder mpirun (the MPI build, build/mpi/kvcal) rank I of N runs windows I, I+N, ...\n"
    "with --threads threads; the windows' sums are added over the ranks and the totals\n"
    "taken in window order, so every number equals one process's to the last bit (the\n"
    "JSON adds \"ranks\"; its seconds are the slowest rank's, peak_rss_mib the largest).\n"
    "Rank 0 prints. --device runs in one process only.\n"
    "\nexamples:\n"
    "  kvcal verify --model stories260K.bin --tokenizer tok512.bin --text val1k.txt\n"
    "  kvcal verify --model tinystories-656K --compressed out-656K --text wiki.test.raw\n"
    "  kvcal verify --model tinystories-656K --text wiki.test.raw --seq-len 256 --json\n"
    "  kvcal verify --model tinystories-656K --compressed out-656K --text wiki.test.raw \\\n"
    "      --device cuda --max-windows 50\n",
    verify_opts, (int)(sizeof verify_opts / sizeof verify_opts[0]), 0};

static const char *latent_name(int bits) {
    return bits == KV_LR_BITS_MIXED ? "mixed-bit"
           : bits == 16             ? "fp16"
                        : (bits == 8 ? "int8" : bits == 4 ? "int4" : bits == 3 ? "int3" : "int2");
}

/* A compressed model's run against its base, as one JSON object or text. */
/* Special-token strings the --text held that were read as text. */
static int64_t V_specials;

/* How the text became tokens, for the text report. */
static const char *describe_tokens(const struct kv_model *m, char *buf, size_t cap) {
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    int n = snprintf(buf, cap, "%s", kv_tok_adds_bos(tok) ? "with BOS" : "without BOS");
    if (kv_tok_adds_eos(tok)) n += snprintf(buf + n, cap - (size_t)n, " and EOS");
    if (cli_parse_special)
        snprintf(buf + n, cap - (size_t)n, ", special-token strings parsed");
    else if (V_specials)
        snprintf(buf + n, cap - (size_t)n, ", %lld special-token string%s read as text",
                 (long long)V_specials, V_specials == 1 ? "" : "s");
    return buf;
}

/* The same as JSON: {"bos", "eos", "special_tokens", "special_strings"}. */
static void json_tokenization(json_t *o, const struct verify_args *a, const struct kv_model *m) {
    if (!o || !a->text) return;
    const struct kv_tokenizer *tok = kv_model_tokenizer(m);
    json_object_set_new(o, "tokenization",
                        json_pack("{s:b, s:b, s:s, s:I}", "bos", kv_tok_adds_bos(tok), "eos",
                                  kv_tok_adds_eos(tok), "special_tokens", cli_special_mode(),
                                  "special_strings", (json_int_t)V_specials));
}

/* A run compared with the base (--compressed or --mla), as both print it. */
struct vs_run {
    const char *name;       /* "compressed" or "mla": the column, and the JSON key of path */
    const char *path;
    char desc[512];         /* what it is, after "name  path: " */
    int64_t bytes;          /* its KV bytes per token */
    const char *bytes_note; /* after the fraction of base in the kv bytes line, or "" */
    char extra[200];        /* a line after kv bytes, or "" */
};

/* The numbers of r against the base, as JSON (the caller adds its own keys). */
static json_t *vs_json(const struct verify_args *a, const char *src, const struct kv_model *m,
                       const struct kv_compare_result *r, const struct vs_run *v) {
    int64_t base = kv_lr_base_bytes(kv_model_config(m)), seq_len = a->seq_len;
    json_t *o = json_pack(
        "{s:s, s:o, s:o, s:o, s:I, s:I, s:I, s:I, s:o, s:o, s:o, s:o, s:o, s:o, s:o, "
        "s:{s:I, s:I, s:o}, s:o, s:o, s:o}",
        "protocol", "windows", "model", cli_json_text(a->model), v->name, cli_json_text(v->path),
        "text", cli_json_text(src), "seq_len", (json_int_t)seq_len, "tokens",
        (json_int_t)r->comp.tokens, "windows", (json_int_t)r->comp.windows, "scored",
        (json_int_t)r->comp.scored, "nll", cli_json_real(r->comp.nll), "ppl", cli_json_real(r->comp.ppl),
        "base_nll", cli_json_real(r->base.nll), "base_ppl", cli_json_real(r->base.ppl), "delta_ppl",
        cli_json_real(r->comp.ppl - r->base.ppl), "kl", cli_json_real(r->kl), "top1",
        cli_json_real(r->top1), "kv_bytes_per_token", "base", (json_int_t)base, "compressed",
        (json_int_t)v->bytes, "ratio", cli_json_real((double)v->bytes / (double)base),
        "tokens_per_s", cli_json_real(tokens_per_s(&r->comp, seq_len)), "base_tokens_per_s",
        cli_json_real(tokens_per_s(&r->base, seq_len)), "peak_rss_mib", cli_json_real(peak_rss()));
    json_ranks(o);
    if (o) { /* 95% bootstrap over windows: ppl / base_ppl - 1, and kl */
        json_object_set_new(o, "delta_ppl_rel_ci95", json_pack("[o, o]", cli_json_real(r->dppl_ci[0]),
                                                               cli_json_real(r->dppl_ci[1])));
        json_object_set_new(o, "kl_ci95", json_pack("[o, o]", cli_json_real(r->kl_ci[0]),
                                                    cli_json_real(r->kl_ci[1])));
    }
    json_tokenization(o, a, m);
    cli_json_blas(o);
    return o;
}

/* The same as text. */
static void vs_text(const struct verify_args *a, const char *src, size_t n_bytes,
                    const struct kv_model *m, const struct kv_compare_result *r, const struct vs_run *v) {
    int64_t base = kv_lr_base_bytes(kv_model_config(m)), seq_len = a->seq_len;
    char desc[512], tdesc[160], bn[160];
    cli_describe_config(kv_model_config(m), desc, sizeof desc);
    printf("model       %s\n            %s\n", a->model, desc);
    printf("%-11s %s: %s\n", v->name, v->path, v->desc);
    if (a->text)
        printf("text        %s: %zu bytes, %lld tokens %s\n", a->text, n_bytes,
               (long long)r->comp.tokens, describe_tokens(m, tdesc, sizeof tdesc));
    else
        printf("tokens      %s: %lld tokens\n", src, (long long)r->comp.tokens);
    printf("protocol    windows: seq-len %lld, non-overlapping, remainder dropped, positions "
           "1..%lld scored\n", (long long)seq_len, (long long)(seq_len - 1));
    printf("windows     %lld, %lld scored tokens\n", (long long)r->comp.windows, (long long)r->comp.scored);
    printf("\n            base        %s\n", v->name);
    printf("ppl         %-11.4f %.4f   (delta %+.4f, %+.2f%%)\n", r->base.ppl, r->comp.ppl,
           r->comp.ppl - r->base.ppl, 100 * (r->comp.ppl / r->base.ppl - 1));
    printf("nll         %-11.6f %.6f\n", r->base.nll, r->comp.nll);
    printf("kv bytes    %-11lld %lld per token   (%.4f of base%s)\n", (long long)base,
           (long long)v->bytes, (double)v->bytes / (double)base, v->bytes_note);
    if (v->extra[0]) printf("%s\n", v->extra);
    printf("kl          %.6f nats per token, KL(base || %s)\n", r->kl, v->name);
    printf("top-1       %.4f of positions agree\n", r->top1);
    printf("speed       %.0f tokens/s base, %.0f %s, peak rss %.1f MiB\n"
           "blas        %s\n",
           tokens_per_s(&r->base, seq_len), tokens_per_s(&r->comp, seq_len), v->name, peak_rss(),
           cli_blas_note(bn, sizeof bn));
}

static int print_compressed(const struct verify_args *a, const char *src, size_t n_bytes,
                            const struct kv_model *m, const struct kv_lowrank *lr, int bits,
                            const struct device *dv, const struct kv_compare_result *r) {
    struct kv_lr_info li = kv_lr_info(lr);
    struct vs_run v = {"compressed", a->comp, "", kv_lr_bytes(lr, bits), "", ""};
    snprintf(v.desc, sizeof v.desc, "%s, alloc %s, %s latents%s", li.method, li.alloc,
             latent_name(bits), li.hadamard ? ", hadamard" : "");
    if (bits == KV_LR_BITS_MIXED) {
        char mix[160];
        snprintf(v.extra, sizeof v.extra, "latents     %s", cli_bits_mix(lr, mix, sizeof mix));
    }
    if (a->json) {
        json_t *o = vs_json(a, src, m, r, &v);
        if (o) {
            json_object_set_new(o, "method", json_string(li.method));
            json_object_set_new(o, "alloc", json_string(li.alloc));
            json_object_set_new(o, "kv_bits", json_integer(bits));
            json_object_set_new(o, "hadamard", json_boolean(li.hadamard));
        }
        if (o && bits == KV_LR_BITS_MIXED) json_object_set_new(o, "latent_bits", cli_bits_mix_json(lr));
        if (o && dv->on) device_print(dv, r, &r->comp, a->seq_len, o);
        return cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    }
    vs_text(a, src, n_bytes, m, r, &v);
    if (dv->on) device_print(dv, r, &r->comp, a->seq_len, NULL);
    return EXIT_OK;
}

/* lr's latent bits as run: --kv-bits, else the manifest's. */
static int run_bits(const struct verify_args *a, const struct kv_lowrank *lr) {
    return a->kv_bits ? (int)a->kv_bits : kv_lr_info(lr).kv_bits;
}

/* The compressed model of --compressed, ready to run (--hadamard fused,
 * the bits set); prints errors. */
static int open_compressed(const struct verify_args *a, struct kv_model *m, const struct device *dv,
                           struct kv_lowrank **out) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_lowrank *lr;
    if (kv_lr_dir_open(a->comp, m, &lr, &err)) return cli_report(&err);
    struct kv_lr_info li = kv_lr_info(lr);
    if (a->hadamard && !li.hadamard && kv_lr_fuse_hadamard(lr, &err)) {
        kv_lr_free(lr);
        return cli_report(&err);
    }
    int bits = run_bits(a, lr);
    if (dv->on && bits == KV_LR_BITS_MIXED) {
        kv_lr_free(lr);
        fprintf(stderr,
                "kvcal: %s: mixed latent bits (each unit's own bands, decompose --kv-bits auto) "
                "are not supported by the runtime; verify them without --device, or at one width "
                "with --kv-bits B\n",
                a->comp);
        return EXIT_ERR;
    }
    if (bits != KV_LR_BITS_MIXED) /* what the runtime is asked to cache; checked above */
        kv_lr_set_kv_bits(lr, bits, &err);
    *out = lr;
    return EXIT_OK;
}

/* Base against compressed: both models on the same windows. */
static int verify_compressed(const struct verify_args *a, const char *src, struct kv_model *m,
                             const struct kv_lowrank *lr, const struct kv_token_src *ts,
                             size_t n_bytes, struct device *dv) {
    int bits = run_bits(a, lr), quiet = a->quiet || a->json;
    struct kv_compare_result r;
    int rc = cli_mpi_size() > 1
                 ? run_parts(m, lr, bits, ts, a->seq_len, a->max_windows, quiet, src, &r)
                 : run_windows(m, lr, bits, dv, ts, a->seq_len, a->max_windows, quiet, src, &r);
    if (!rc && cli_mpi_rank() == 0)
        rc = device_verdict(dv, &r, print_compressed(a, src, n_bytes, m, lr, bits, dv, &r));
    return rc;
}

/* Base against the MLA form of PATH (a GGUF file or an HF directory) on the
 * same windows. */
static int verify_mla(const struct verify_args *a, const char *src, struct kv_model *m,
                      const struct kv_token_src *ts, size_t n_bytes) {
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_mla *mla;
    if (kv_mla_open(a->mla, m, &mla, &err)) return cli_report(&err);
    struct kv_compare_result r;
    struct cli_progress prog;
    cli_progress_start(&prog, "windows", a->quiet || a->json);
    int rc = kv_ppl_compare_mla_src(m, mla, ts, a->seq_len, a->max_windows, cli_progress_cb, &prog, &r, &err);
    cli_progress_end(&prog);
    if (rc) {
        if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", src);
        kv_mla_free(mla);
        return cli_report(&err);
    }
    const struct kv_mla_info mi = kv_mla_info(mla);
    struct vs_run v = {"mla", a->mla, "", kv_mla_bytes(mla), "; the latent and the rope key at f16", ""};
    snprintf(v.desc, sizeof v.desc,
             "deepseek2, kv_lora_rank %lld, rope key %lld (base %.6g), nope %lld, latent norm "
             "epsilon %g", (long long)mi.kv_lora_rank, (long long)mi.rope_dim,
             (double)mi.rope_base, (long long)mi.nope_dim, (double)mi.latent_eps);
    if (a->json) {
        json_t *o = vs_json(a, src, m, &r, &v);
        if (o) json_object_set_new(o, "method", json_string("mla"));
        rc = cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    } else {
        vs_text(a, src, n_bytes, m, &r, &v);
        rc = EXIT_OK;
    }
    kv_mla_free(mla);
    return rc;
}

/* The base model alone, as one JSON object or text. */
static int print_base(const struct verify_args *a, const char *src, size_t n_bytes,
                      const struct kv_model *m, const struct device *dv,
                      const struct kv_compare_result *cr, const struct kv_ppl_result *r) {
    double tps = tokens_per_s(r, a->seq_len);
    int nthreads = omp_get_max_threads();
    if (a->json) {
        json_t *o = json_pack("{s:s, s:o, s:s, s:o, s:I, s:I, s:I, s:I, s:I, s:o, s:o, s:o, s:o, s:i, s:o}",
                              "protocol", "windows", "model", cli_json_text(a->model), "format",
                              kv_format_name(kv_model_format(m)), "text", cli_json_text(src),
                              "seq_len", (json_int_t)a->seq_len, "tokens", (json_int_t)r->tokens,
                              "windows", (json_int_t)r->windows, "scored", (json_int_t)r->scored,
                              "params", (json_int_t)kv_model_n_params(m), "nll",
                              cli_json_real(r->nll), "ppl", cli_json_real(r->ppl), "tokens_per_s",
                              cli_json_real(tps), "seconds", cli_json_real(r->seconds), "threads",
                              nthreads, "peak_rss_mib", cli_json_real(peak_rss()));
        json_ranks(o);
        json_tokenization(o, a, m);
        cli_json_blas(o);
        if (o && dv->on) device_print(dv, cr, r, a->seq_len, o);
        return cli_print_json(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    }
    char desc[512], np[32], tdesc[160];
    cli_describe_config(kv_model_config(m), desc, sizeof desc);
    cli_human_count((double)kv_model_n_params(m), np, sizeof np);
    printf("model     %s (%s, %s params)\n          %s\n", a->model,
           kv_format_name(kv_model_format(m)), np, desc);
    if (a->text)
        printf("text      %s: %zu bytes, %lld tokens %s\n", a->text, n_bytes, (long long)r->tokens,
               describe_tokens(m, tdesc, sizeof tdesc));
    else
        printf("tokens    %s: %lld tokens\n", a->tokens, (long long)r->tokens);
    printf("protocol  windows: seq-len %lld, non-overlapping, remainder dropped, "
           "positions 1..%lld scored\n", (long long)a->seq_len, (long long)(a->seq_len - 1));
    printf("windows   %lld, %lld scored tokens\n", (long long)r->windows, (long long)r->scored);
    printf("nll       %.6f\n", r->nll);
    printf("ppl       %.4f\n", r->ppl);
    char bn[160];
    if (cli_mpi_size() > 1)
        printf("speed     %.0f tokens/s (%d ranks of %d threads, %.2f s), peak rss %.1f MiB a rank\n",
               tps, cli_mpi_size(), nthreads, r->seconds, peak_rss());
    else
        printf("speed     %.0f tokens/s (%d threads, %.2f s), peak rss %.1f MiB\n", tps, nthreads,
               r->seconds, peak_rss());
    printf("blas      %s\n", cli_blas_note(bn, sizeof bn));
    if (dv->on) device_print(dv, cr, r, a->seq_len, NULL);
    return EXIT_OK;
}

/* The base model's windows, with a device run against them with --device. */
static int verify_base(const struct verify_args *a, const char *src, struct kv_model *m,
                       const struct kv_token_src *ts, size_t n_bytes, struct device *dv) {
    struct kv_compare_result cr;
    struct kv_ppl_result r;
    int rc;
    if (cli_mpi_size() > 1) { /* the windows spread over the ranks */
        rc = run_parts(m, NULL, 16, ts, a->seq_len, a->max_windows, a->quiet || a->json, src, &cr);
        r = cr.base;
    } else if (dv->on) { /* the device against the base */
        rc = run_windows(m, NULL, 16, dv, ts, a->seq_len, a->max_windows, a->quiet || a->json,
                         src, &cr);
        r = cr.base;
    } else {
        struct cli_progress prog;
        cli_progress_start(&prog, "windows", a->quiet || a->json);
        struct kv_err err;
        kv_err_clear(&err);
        rc = kv_ppl_run_src(m, ts, a->seq_len, a->max_windows, cli_progress_cb, &prog, &r, &err);
        cli_progress_end(&prog);
        if (rc) {
            if (!err.path[0]) snprintf(err.path, sizeof err.path, "%s", src);
            rc = cli_report(&err);
        }
    }
    if (rc || cli_mpi_rank() > 0) return rc;
    return device_verdict(dv, &cr, print_base(a, src, n_bytes, m, dv, &cr, &r));
}

/* The checks of the options, in the order the command has always made
 * them: the command line's own, and the library's rules with its names.
 * Fills dv. Returns -1 to go on, or EXIT_USAGE after the message. */
static int check_args(const struct cli_cmd *cmd, const struct verify_args *a, struct device *dv) {
    struct kv_err err;
    kv_err_clear(&err);
    if (!a->model) return cli_usage_error(cmd, "missing --model");
    if (!a->text == !a->tokens)
        return cli_usage_error(cmd, "give exactly one of --text or --tokens");
    if (kv_ppl_check(a->seq_len, a->max_windows, ppl_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    if (a->threads < 0) return cli_usage_error(cmd, "--threads must be 0 (all cores) or more");
    if (a->mla && a->comp) return cli_usage_error(cmd, "give one of --compressed DIR or --mla PATH");
    if (a->mla && strcmp(a->device, "cpu"))
        return cli_usage_error(cmd, "--mla runs on the cpu; the runtime has no latent attention of this form");
    if (a->mla && cli_mpi_size() > 1) return cli_usage_error(cmd, "--mla runs in one process, not under mpirun");
    if (a->kv_bits && !a->comp) return cli_usage_error(cmd, "--kv-bits needs --compressed");
    if (a->hadamard && !a->comp) return cli_usage_error(cmd, "--hadamard needs --compressed");
    if (a->kv_bits && !kv_lr_bits_valid(a->kv_bits))
        return cli_usage_error(cmd, "--kv-bits %lld is not one of " KV_LR_BITS_LIST,
                               (long long)a->kv_bits);
    *dv = (struct device){.on = strcmp(a->device, "cpu") != 0};
    kvrt_opts_default(&dv->o);
    int be = kvrt_backend_parse(a->device);
    if (dv->on && be < 0)
        return cli_usage_error(cmd, "--device '%s' is not one of cpu, twin, cuda", a->device);
    if (a->cache && !dv->on) return cli_usage_error(cmd, "--cache needs --device twin or cuda");
    if (!isnan(a->device_tol) && !dv->on)
        return cli_usage_error(cmd, "--device-tol needs --device twin or cuda");
    int dt = kvrt_dtype_parse(a->cache ? a->cache : "f16");
    if (dt < 0) return cli_usage_error(cmd, "--cache '%s' is not one of f16, f32", a->cache);
    if (kv_ppl_check_tol(a->device_tol, ppl_names, &err))
        return cli_usage_error(cmd, "%s", err.msg);
    if (dv->on && cli_mpi_size() > 1)
        return cli_usage_error(cmd, "--device runs in one process; under mpirun verify spreads "
                                    "the cpu's windows over the ranks (run --device without mpirun)");
    dv->o.backend = (enum kvrt_backend)(dv->on ? be : KVRT_BACKEND_TWIN);
    dv->o.cache = (enum kvrt_dtype)dt;
    dv->tol = isnan(a->device_tol) ? 1e-3 : a->device_tol;
    return -1;
}

int cmd_verify(int argc, char **argv) {
    const struct verify_args *a = &A;
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&verify_cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    struct device dv;
    if ((rc = check_args(&verify_cmd, a, &dv)) >= 0) return rc;
    kv_set_threads((int)a->threads);

    const char *src = a->text ? a->text : a->tokens;
    /* under mpirun rank 0 opens the inputs first, the others after it
     * has: an input that is bad for all is reported once */
    int mpi = cli_mpi_size() > 1, root = cli_mpi_rank() == 0;
    if (mpi && !root && cli_mpi_any_failed(0)) return EXIT_ERR; /* rank 0 has said why */
    struct kv_model *m = NULL;
    struct kv_lowrank *lr = NULL;
    struct cli_tokens t;
    int have_t = 0;
    rc = cli_load_model(a->model, a->tokenizer, &m);
    if (!rc && !(rc = cli_open_tokens(m, a->text, a->tokens, &t))) have_t = 1;
    if (!rc && a->comp) rc = open_compressed(a, m, &dv, &lr);
    /* rank 0's status lets the others start; then whether every rank could */
    int stop = mpi && root && cli_mpi_any_failed(rc);
    if (!stop && mpi && cli_mpi_any_failed(rc) && !rc) rc = EXIT_ERR;
    if (!rc) {
        V_specials = t.specials;
        rc = a->comp  ? verify_compressed(a, src, m, lr, &t.src, t.n_bytes, &dv)
             : a->mla ? verify_mla(a, src, m, &t.src, t.n_bytes)
                      : verify_base(a, src, m, &t.src, t.n_bytes, &dv);
    }
    kv_lr_free(lr);
    if (have_t) cli_close_tokens(&t);
    if (m) kv_model_close(m);
    return rc;
}
