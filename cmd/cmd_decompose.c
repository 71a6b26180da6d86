/* kvcal decompose: low-rank K/V factors under a budget, written as a
 * compressed model directory with its manifest. The rules on the options,
 * the decomposition and the manifest's records are the library's
 * (kv_decompose_check, kv_decompose_check_model, kv_decompose,
 * kv_decompose_write): this file parses, loads, calls and prints. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

/* The command line as parsed: the options table writes here. */
/* How kvcal decompose names each option in the library's messages. */
static const char *const flag_names[KV_DECOMPOSE_OPT_COUNT] = {
    [KV_DECOMPOSE_OPT_METHOD] = "--method",
    [KV_DECOMPOSE_OPT_ALLOC] = "--alloc",
    [KV_DECOMPOSE_OPT_EPS] = "--eps",
    [KV_DECOMPOSE_OPT_RATIO] = "--ratio",
    [KV_DECOMPOSE_OPT_GROUP_SIZE] = "--group-size",
    [KV_DECOMPOSE_OPT_RANK_MULTIPLE] = "--rank-multiple",
    [KV_DECOMPOSE_OPT_MIN_RANK] = "--min-rank",
    [KV_DECOMPOSE_OPT_D_MIN] = "--d-min",
    [KV_DECOMPOSE_OPT_D_MAX] = "--d-max",
    [KV_DECOMPOSE_OPT_COND_SKIP] = "--cond-skip",
    [KV_DECOMPOSE_OPT_ERROR_BUDGET] = "--error-budget",
    [KV_DECOMPOSE_OPT_STATS] = "--stats",
    [KV_DECOMPOSE_OPT_TEXT] = "--text",
    [KV_DECOMPOSE_OPT_SEQ_LEN] = "--seq-len",
    [KV_DECOMPOSE_OPT_WINDOWS] = "--windows",
    [KV_DECOMPOSE_OPT_KV_BITS] = "--kv-bits",
    [KV_DECOMPOSE_OPT_CENTER] = "--center",
    [KV_DECOMPOSE_OPT_BASIS] = "--basis",
};

static struct {
    const char *model, *tokenizer, *stats, *out, *method, *alloc, *basis, *text, *kv_bits;
    int64_t threads;
    int json, quiet;
    struct kv_decompose_opts o;
} A;

static const struct cli_opt opts[] = {
    CLI_OPT_MODEL(&A.model),
    {"tokenizer", 0, OPT_STR, &A.tokenizer, "FILE",
     "the model's tokenizer when it has none inside (copied into the output)"},
    {"stats", 's', OPT_STR, &A.stats, "FILE",
     "statistics from 'kvcal collect' (needed by every method except svd and lorc)"},
    {"output", 'o', OPT_STR, &A.out, "DIR", "output directory (created; an earlier output is replaced)"},
    {"method", 0, OPT_STR, &A.method, "M", "svd, palu (default), eigen, lorc, fdc or zack"},
    {"alloc", 0, OPT_STR, &A.alloc, "A",
     "rank allocation: eps, uniform, fisher, progressive, removal,\n"
     "layer-budget or global (default: the method's own; see below)"},
    {"eps", 0, OPT_DOUBLE, &A.o.eps, "E",
     "keep ranks that explain the fraction E in (0, 1] of each unit's calibration\n"
     "variance: error Σ‖y - ŷ‖² <= (1 - E) Σ‖y - μ‖² (see below)"},
    {"ratio", 0, OPT_DOUBLE, &A.o.ratio, "R", "keep the fraction R in (0, 1] of the KV bytes per token"},
    {"group-size", 0, OPT_INT, &A.o.group_size, "S",
     "KV heads per unit for svd, palu and fdc values: 1 = per head (M-LRD, default),\n"
     "the model's KV head count = joint (J-LRD), between = groups (G-LRD)"},
    {"rank-multiple", 0, OPT_INT, &A.o.rank_multiple, "N", "round every rank up to a multiple of N (default 1)"},
    {"min-rank", 0, OPT_INT, &A.o.min_rank, "N", "smallest rank of a unit (default 1)"},
    {"d-min", 0, OPT_DOUBLE, &A.o.d_min, "F", "lorc: smallest layer rank as a fraction (eq. 13)"},
    {"d-max", 0, OPT_DOUBLE, &A.o.d_max, "F", "lorc: largest layer rank as a fraction (default 1)"},
    {"cond-skip", 0, OPT_DOUBLE, &A.o.cond_skip, "X",
     "lorc: leave layers whose log10 cumulative condition number exceeds X uncompressed"},
    {"error-budget", 0, OPT_DOUBLE, &A.o.error_budget, "E",
     "layer-budget: largest normalised layer output error ‖y'−y‖/‖y‖ per layer"},
    {"text", 't', OPT_STR, &A.text, "FILE",
     "calibration text: layer-budget measures the layer outputs on its windows;\n"
     "global with --ratio measures its ranks and uniform's (KL against the base)\n"
     "on them and keeps the better; --kv-bits auto its mix and each single width's"},
    CLI_OPT_PARSE_SPECIAL,
    {"seq-len", 0, OPT_INT, &A.o.seq_len, "N", "--text: window length (default 256)"},
    {"windows", 0, OPT_INT, &A.o.calib_windows, "W", "--text: windows measured (default 8)"},
    {"kv-bits", 0, OPT_STR, &A.kv_bits, "B",
     "latent storage for the byte budget: 16 (fp16, default), 8, 4, 3 or 2 (per-token\n"
     "asymmetric integers with an fp16 scale and zero point per unit), or auto:\n"
     "ranks and bits chosen together under --ratio's bytes, each unit's latents in\n"
     "bands of falling bits (needs --stats; implies --alloc global and --hadamard;\n"
     "see below)"},
    {"hadamard", 0, OPT_FLAG, &A.o.hadamard, NULL,
     "fuse a Walsh-Hadamard rotation into the factors (spreads latent outliers before\n"
     "quantization; exact in float)"},
    {"basis", 0, OPT_STR, &A.basis, "B",
     "what palu's units and fdc's values minimise: energy (default; the output's\n"
     "own energy, as the papers), output (keys: the score error E[(q·Δk)²] averaged\n"
     "over RoPE's turns; values: the error after the output projection) or loss (the\n"
     "gradient-weighted error; needs 'kvcal collect --fisher' stats)"},
    {"center", 0, OPT_FLAG, &A.o.center, NULL,
     "centred factors: fit the latents to y - μ, μ the calibration mean (needs\n"
     "--stats), and add μ back exactly as biases (DESIGN \"Centred latents\"); the\n"
     "GPU runtime refuses centred keys with RoPE and centred values, and a dense\n"
     "export needs k/v bias tensors to hold μ"},
    CLI_OPT_THREADS(&A.threads),
    CLI_OPT_JSON(&A.json),
    CLI_OPT_QUIET(&A.quiet),
};
static const struct cli_cmd cmd = {
    "decompose", "--model PATH [--stats FILE] -o DIR (--eps E | --ratio R) [options]",
    "Build low-rank K/V factors and write a model that caches latents.",
    "methods (DESIGN.md §3; every one emits down/up factors per unit):\n"
    "  svd    plain SVD of W_k, W_v (no calibration), uniform ranks: the baseline\n"
    "  palu   whitened SVD: eigenvectors of the output covariance W C_x Wᵀ, units of\n"
    "         --group-size heads; keys rebuilt before RoPE, values fused into W_o\n"
    "  eigen  Eigen Attention: one key basis per layer from C_q + C_k shared by all\n"
    "         heads (query stays full), a value basis per head, one rank per layer\n"
    "  lorc   LoRC: joint plain SVD per layer, ranks from cumulative condition numbers\n"
    "  fdc    post-RoPE key rotation from q_rope/k_rope statistics (scores on rotated\n"
    "         q·k, no key reconstruction); values as palu\n"
    "  zack   keys as fdc; values rotated with the V–W_O pair, fused into W_v and W_o\n"
    "\nallocations (default in brackets):\n"
    "  eps          per unit, the smallest rank explaining E of the variance [eigen]\n"
    "  uniform      the same fraction of every unit [svd, palu]\n"
    "  fisher       ranks in proportion to each unit's Fisher information, Σ (∂L/∂W)²\n"
    "               over its rows of W_k or W_v (needs 'kvcal collect --fisher' stats)\n"
    "  progressive  LoRC eqs. 12-13, --d-min/--d-max, --cond-skip [lorc]\n"
    "  removal      one singular-value removal rate for all units [fdc, zack]\n"
    "  layer-budget Eigen Attention §4.4: per layer, eps drops by 0.02 while the layer's\n"
    "               measured output error stays under --error-budget (needs --text)\n"
    "  global       greedy: drop the direction that costs least per byte: its predicted\n"
    "               loss with 'collect --fisher' stats (var · dᵀ E[ggᵀ] d), else its\n"
    "               relative error; with --ratio, uniform's ranks are kept instead when\n"
    "               their cost is lower, or with --text their measured KL on its windows\n"
    "With --ratio the allocation's parameter is searched for the smallest cache of at\n"
    "least R of the base KV bytes per token (global stops at the first at or below R);\n"
    "the achieved ratio is printed and recorded, with a warning when the allocation\n"
    "cannot get that small. --eps 1 (or\n"
    "--ratio 1) keeps every rank: the compressed model then equals the base.\n"
    "\nthe predicted error of a unit is the calibration energy its dropped directions\n"
    "carry, Σ‖y − y'‖² over the calibration tokens (weighted by the basis's metric),\n"
    "relative to Σ‖y‖² (Σ‖y − μ‖² with --center).\n"
    "\n--eps E is the same quantity for every method and basis: each unit keeps the fewest\n"
    "latents whose error Σ‖y − y'‖² is at most (1 − E) of its variance Σ‖y − μ‖²\n"
    "(R² >= E). Where the knee lies depends on the model; measured (palu, KV bytes\n"
    "kept and PPL on held-out text; docs/design.md, \"What eps means\"):\n"
    "  data/kjv-llama  E 0.8: 0.14, +10.8%; 0.9: 0.21, +1.8%; 0.95: 0.28, +0.57%\n"
    "  data/kjv-gpt2   E 0.9: 0.17, +22.9%; 0.95: 0.24, +4.3%; 0.98: 0.36, +0.51%\n"
    "so check a model's curve (verify) before trusting one E, or budget bytes with\n"
    "--ratio. --basis output or loss buys more quality per byte than the default\n"
    "(docs/results.md).\n"
    "\n--kv-bits auto spends --ratio's bytes on ranks and bits together: each unit\n"
    "keeps its first latents in up to five bands of falling bits (16, 8, 4, 3, 2),\n"
    "each rotated and quantized per token on its own. A model of the quantization\n"
    "noise from the statistics prices every band, a dynamic program per unit and one\n"
    "price per byte find the cheapest mix, and the same search at each single width\n"
    "is compared; the lowest is kept (by measured KL on --text's windows when given).\n"
    "On kjv-llama at 0.125 of the bytes (--group-size 2 --basis loss): +0.09% PPL,\n"
    "where the best single width, 8 bits, gives +0.15% and fp16 +4.4%\n"
    "(docs/design.md, \"Rank and bits together\"). The GPU runtime does not run\n"
    "bands yet; verify runs them on the CPU.\n"
    "\nexamples:\n"
    "  kvcal decompose -m tinystories-656K -s 656K.kvstats --eps 0.9 -o out-656K\n"
    "  kvcal decompose -m stories260K.bin --tokenizer tok512.bin -s 260K.kvstats \\\n"
    "      --method palu --group-size 2 --ratio 0.5 -o out-260K\n"
    "  kvcal decompose -m stories260K.bin --method lorc --ratio 0.5 -o out-lorc\n"
    "  kvcal collect -m data/kjv-llama -t data/kjv/train.txt --samples 2000 --fisher -o kjv.kvstats\n"
    "  kvcal decompose -m data/kjv-llama -s kjv.kvstats --group-size 2 --basis loss \\\n"
    "      --alloc global --ratio 0.125 -t data/kjv/train.txt -o out-kjv\n"
    "  kvcal decompose -m data/kjv-llama -s kjv.kvstats --group-size 2 --basis loss \\\n"
    "      --kv-bits auto --ratio 0.125 -t data/kjv/train.txt -o out-kjv-auto\n",
    opts, (int)(sizeof opts / sizeof opts[0]), 0};

/* What one run loads. */
struct inputs {
    struct kv_model *m;
    struct kv_stats *s;
    int32_t *ids; /* layer-budget's calibration tokens */
};

static void inputs_free(struct inputs *in) {
    free(in->ids);
    kv_stats_free(in->s);
    kv_model_close(in->m);
}

static void side_ranks(const struct kv_lowrank *lr, int64_t l, int which, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    if (kv_lr_mode_of(lr, l, which) == KV_LR_FULL) {
        snprintf(buf, cap, "full");
        return;
    }
    for (int64_t u = 0; u < kv_lr_n_units(lr, l, which) && n + 16 < cap; u++) {
        struct kv_lr_unit_info ui = kv_lr_unit_info(lr, l, which, u);
        cli_unit_rank(&ui, u == 0, buf, cap, &n);
    }
}

static const char *mode_short(enum kv_lr_mode m) {
    switch (m) {
    case KV_LR_FULL: return "full";
    case KV_LR_PREROPE_LATENT: return "latent";
    case KV_LR_FUSED_OUTPUT: return "fused";
    case KV_LR_FUSED_QUERY: return "query";
    case KV_LR_POSTROPE_ROTATION: return "rotate";
    default: return kv_lr_mode_name(m);
    }
}

/* The options as the library takes them, checked: -1 to go on, else the
 * exit code (a usage error). */
static int resolve_options(void) {
    if (!A.model) return cli_usage_error(&cmd, "missing --model");
    if (!A.out) return cli_usage_error(&cmd, "missing --output");
    if (A.method) {
        int method = kv_method_parse(A.method);
        if (method < 0)
            return cli_usage_error(&cmd, "unknown --method '%s' (svd, palu, eigen, lorc, fdc, zack)",
                                   A.method);
        A.o.method = (enum kv_method)method;
    }
    if (A.alloc) {
        int alloc = kv_alloc_parse(A.alloc);
        if (alloc < 0)
            return cli_usage_error(&cmd, "unknown --alloc '%s' (eps, uniform, fisher, progressive, "
                                         "removal, global)", A.alloc);
        A.o.alloc = (enum kv_alloc)alloc;
    }
    if (A.kv_bits) {
        char *end;
        long long v = strtoll(A.kv_bits, &end, 10);
        if (!strcmp(A.kv_bits, "auto")) A.o.kv_bits = KV_DECOMPOSE_BITS_AUTO;
        else if (end != A.kv_bits && !*end && v >= 0) A.o.kv_bits = v; /* the library checks it */
        else return cli_usage_error(&cmd, "--kv-bits '%s' is not one of " KV_LR_BITS_LIST " or auto", A.kv_bits);
    }
    if (A.basis) {
        int b = kv_basis_parse(A.basis);
        if (b < 0) return cli_usage_error(&cmd, "unknown --basis '%s' (energy, output, loss)", A.basis);
        A.o.basis = (enum kv_basis)b;
    }
    if (!isnan(A.o.eps) && !(A.o.eps > 0))
        return cli_usage_error(&cmd, "--eps %g is outside (0, 1]", A.o.eps);
    if (!isnan(A.o.ratio) && !(A.o.ratio > 0))
        return cli_usage_error(&cmd, "--ratio %g is outside (0, 1]", A.o.ratio);
    A.o.eps = isnan(A.o.eps) ? 0 : A.o.eps, A.o.ratio = isnan(A.o.ratio) ? 0 : A.o.ratio;
    A.o.stats_path = A.stats, A.o.text_path = A.text, A.o.names = flag_names;
    struct kv_err err;
    kv_err_clear(&err);
    if (kv_decompose_check(&A.o, flag_names, &err)) return cli_usage_error(&cmd, "%s", err.msg);
    if (A.threads < 0) return cli_usage_error(&cmd, "--threads must be 0 (all cores) or more");
    return -1;
}

/* The output checked, then the model, the statistics and the rules on both,
 * and layer-budget's tokens: -1 to go on, else the exit code. */
static int load_inputs(struct inputs *in) {
    struct kv_err err;
    kv_err_clear(&err);
    kv_set_threads((int)A.threads);
    if (kv_lr_dir_check(A.out, "--output", &err)) return cli_report(&err);
    int rc = cli_load_model(A.model, A.tokenizer, &in->m);
    if (rc) return rc;
    if (A.stats && (kv_stats_open(A.stats, &in->s, &err) || !kv_stats_matches_model(in->s, in->m, A.stats, &err)))
        return cli_report(&err);
    if (kv_decompose_check_model(&A.o, in->m, in->s, flag_names, &err)) {
        if (!err.path[0]) return cli_usage_error(&cmd, "%s", err.msg);
        /* about the statistics file: an error, printed as it always was
         * (without the detection site under -v) */
        char buf[2400];
        kv_err_format(&err, buf, sizeof buf, 0);
        fprintf(stderr, "kvcal: %s\n", buf);
        return EXIT_ERR;
    }
    int global = A.o.alloc == KV_ALLOC_GLOBAL || A.o.kv_bits == KV_DECOMPOSE_BITS_AUTO;
    if (A.o.alloc == KV_ALLOC_LAYER_BUDGET || (A.text && global && A.o.ratio > 0)) {
        int64_t n_ids = 0, seq = A.o.seq_len;
        size_t n_bytes = 0;
        if ((rc = cli_load_tokens(in->m, A.text, NULL, &in->ids, &n_ids, &n_bytes)))
            return rc;
        if (n_ids / seq < A.o.calib_windows) A.o.calib_windows = n_ids / seq;
        if (A.o.calib_windows < 1) {
            fprintf(stderr, "kvcal: %s: %lld tokens, fewer than one window of %lld\n", A.text,
                    (long long)n_ids, (long long)seq);
            return EXIT_ERR;
        }
        A.o.calib_tokens = in->ids;
    }
    return -1;
}

static void print_warnings(const struct kv_model *m, const struct kv_lowrank *lr) {
    if (A.o.odd_rank_units)
        fprintf(stderr, "kvcal: warning: --hadamard leaves one latent coordinate unrotated in "
                        "each of %lld units of odd rank (its blocks are the powers of two "
                        "that sum to the rank); add "
                        "--rank-multiple 8\n", (long long)A.o.odd_rank_units);
    int64_t base = kv_lr_base_bytes(kv_model_config(m)), comp = kv_lr_bytes(lr, kv_lr_info(lr).kv_bits);
    if (!A.o.target_reached)
        fprintf(stderr,
                "kvcal: warning: --alloc %s cannot reach --ratio %g for this model: its smallest "
                "cache keeps %.4f%s; wrote that\n",
                kv_alloc_name(A.o.alloc), A.o.ratio, (double)comp / (double)base,
                A.o.alloc == KV_ALLOC_PROGRESSIVE ? " (eq. 13 keeps the most sensitive layer at "
                                                    "--d-max: lower it to go further)"
                                                  : "");
}

static json_t *json_layers(const struct kv_lowrank *lr) {
    json_t *layers = json_array();
    int bits = kv_lr_info(lr).kv_bits;
    for (int64_t l = 0; l < kv_lr_info(lr).n_layers; l++) {
        json_t *side[2];
        for (int k = 0; k < 2; k++) {
            json_t *ranks = json_array(), *bands = cli_side_bands_json(lr, l, k);
            for (int64_t u = 0; u < kv_lr_n_units(lr, l, k); u++)
                json_array_append_new(ranks, json_integer(kv_lr_unit_info(lr, l, k, u).rank));
            side[k] = json_pack("{s:s, s:o, s:o, s:I}", "mode", kv_lr_mode_name(kv_lr_mode_of(lr, l, k)),
                                "ranks", ranks, "predicted_error",
                                cli_json_real(kv_lr_side_error(lr, l, k, NULL, NULL)), "bytes",
                                (json_int_t)kv_lr_side_bytes(lr, l, k, bits));
            if (side[k] && bands) json_object_set_new(side[k], "bands", bands);
        }
        json_array_append_new(layers, json_pack("{s:I, s:o, s:o}", "layer", (json_int_t)l, "k",
                                                side[0], "v", side[1]));
    }
    return layers;
}

static int print_json(const struct inputs *in, const struct kv_lowrank *lr, double write_s) {
    struct kv_err err;
    kv_err_clear(&err);
    char *opts_txt;
    if (kv_decompose_records(&A.o, in->s, &opts_txt, NULL, &err)) return cli_report(&err);
    json_t *jo = json_loads(opts_txt, 0, NULL); /* the manifest's "options", as written */
    free(opts_txt);
    int64_t base = kv_lr_base_bytes(kv_model_config(in->m)), comp = kv_lr_bytes(lr, kv_lr_info(lr).kv_bits);
    double ratio = A.o.ratio;
    json_t *o2 = json_pack(
        "{s:o, s:o, s:s, s:s, s:o, s:{s:I, s:I, s:o, s:o, s:o}, s:{s:o, s:o}, s:o, s:o, s:o, s:o}",
        "model", cli_json_text(A.model), "output", cli_json_text(A.out), "method",
        kv_method_name(A.o.method), "alloc", kv_alloc_name(A.o.alloc), "options", jo,
        "kv_bytes_per_token", "base", (json_int_t)base, "compressed", (json_int_t)comp, "ratio",
        cli_json_real((double)comp / (double)base), "target", ratio > 0 ? json_real(ratio) : json_null(),
        "target_reached", json_boolean(A.o.target_reached), "predicted_error", "k",
        cli_json_real(A.o.error_k), "v", cli_json_real(A.o.error_v), "layers", json_layers(lr),
        "seconds", cli_json_real(A.o.seconds), "lapack_seconds", cli_json_real(A.o.lapack_seconds),
        "write_seconds", cli_json_real(write_s));
    return cli_print_json(o2, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
}

static void print_text(const struct inputs *in, const struct kv_lowrank *lr, double write_s) {
    const struct kv_config *c = kv_model_config(in->m);
    const struct kv_decompose_opts *o = &A.o;
    int bits = kv_lr_info(lr).kv_bits;
    char desc[512];
    cli_describe_config(c, desc, sizeof desc);
    printf("model     %s\n          %s\n", A.model, desc);
    if (in->s) {
        struct kv_stats_info si = kv_stats_info(in->s);
        printf("stats     %s: %lld tokens in %lld windows of %lld%s\n", A.stats, (long long)si.tokens,
               (long long)si.windows, (long long)si.seq_len, si.has_fisher ? ", with fisher statistics" : "");
    }
    printf("method    %s, alloc %s", kv_method_name(o->method), kv_alloc_name(o->alloc));
    if (o->eps > 0) printf(", eps %g", o->eps);
    if (o->ratio > 0) printf(", ratio %g (searched parameter %.4f)", o->ratio, o->param);
    printf(", group %lld, rank multiple %lld, min rank %lld, %s%s\n", (long long)o->group_size,
           (long long)o->rank_multiple, (long long)o->min_rank,
           bits == KV_LR_BITS_MIXED ? "mixed-bit latents (--kv-bits auto)"
           : bits == 16             ? "fp16 latents"
                                    : "quantized latents",
           o->hadamard ? ", hadamard" : "");
    printf("\nlayer  k mode  k ranks          k err    v mode  v ranks          v err    bytes/token\n");
    for (int64_t l = 0; l < kv_lr_info(lr).n_layers; l++) {
        char kr[512], vr[512];
        side_ranks(lr, l, 0, kr, sizeof kr);
        side_ranks(lr, l, 1, vr, sizeof vr);
        int64_t lb = kv_lr_side_bytes(lr, l, 0, bits) + kv_lr_side_bytes(lr, l, 1, bits);
        printf("%5lld  %-6s  %-15s %6.2f%%   %-6s  %-15s %6.2f%%   %lld / %lld\n", (long long)l,
               mode_short(kv_lr_mode_of(lr, l, 0)), kr, 100 * kv_lr_side_error(lr, l, 0, NULL, NULL),
               mode_short(kv_lr_mode_of(lr, l, 1)), vr, 100 * kv_lr_side_error(lr, l, 1, NULL, NULL),
               (long long)lb, (long long)(2 * c->n_kv_heads * c->head_dim * 2));
    }
    int64_t base = kv_lr_base_bytes(c), comp = kv_lr_bytes(lr, bits);
    static const char *const metric[KV_BASIS_COUNT] = {"", ", weighted by the score and output error",
                                                       ", weighted by the loss gradient"};
    printf("\npredicted calibration error: k %.3f%%, v %.3f%% of the output %s%s\n", 100 * o->error_k,
           100 * o->error_v, o->center ? "variance" : "energy", metric[o->basis]);
    printf("kv cache  %lld bytes/token compressed vs %lld base: %.4f kept", (long long)comp,
           (long long)base, (double)comp / (double)base);
    if (o->ratio > 0) printf(" (target %.4f%s)", o->ratio, o->target_reached ? "" : ", not reachable");
    if (o->kv_bits == KV_DECOMPOSE_BITS_AUTO) {
        char mix[160];
        printf("\nbits      %s\n          modelled cost of the mix %.6g; one width at the same "
               "target:",
               kv_lr_info(lr).kv_bits == KV_LR_BITS_MIXED ? cli_bits_mix(lr, mix, sizeof mix)
                                                         : "one width for every unit",
               o->objective_mix);
        for (int w = 0; w < KV_DECOMPOSE_N_WIDTHS; w++)
            printf("%s %d-bit %.6g", w ? "," : "", KV_DECOMPOSE_WIDTHS[w], o->objective_fixed[w]);
        if (o->probed) {
            printf("\n          calibration KL (%lld windows of --text): mix %.6g;", (long long)o->calib_windows,
                   o->probe_kl);
            for (int w = 0; w < KV_DECOMPOSE_N_WIDTHS; w++)
                printf("%s %d-bit %.6g", w ? "," : "", KV_DECOMPOSE_WIDTHS[w], o->probe_kl_fixed[w]);
        }
        if (o->fixed_kept) printf("\n          kept %d-bit alone: it scored lower than the mix", o->fixed_kept);
    } else if (o->alloc == KV_ALLOC_GLOBAL && o->ratio > 0 && o->probed) {
        printf("\nglobal    calibration KL %.6g against uniform's %.6g at the same target (%lld "
               "windows of --text): kept %s's ranks", o->probe_kl, o->probe_kl_uniform,
               (long long)o->calib_windows, o->kept_uniform ? "uniform" : "global");
    } else if (o->alloc == KV_ALLOC_GLOBAL && o->ratio > 0) {
        printf("\nglobal    objective %.6g against uniform's %.6g at the same target: kept %s's ranks",
               o->objective, o->objective_uniform, o->kept_uniform ? "uniform" : "global");
    }
    printf("\ntime      %.3f s (eigendecompositions %.3f s), write %.3f s\n", o->seconds,
           o->lapack_seconds, write_s);
    printf("wrote     %s\n", A.out);
}

/* Decompose, warn, write the directory, print. */
static int run(struct inputs *in) {
    struct kv_err err;
    kv_err_clear(&err);
    struct cli_progress prog;
    cli_progress_start(&prog, "layers", A.quiet || A.json);
    A.o.progress = cli_progress_cb, A.o.progress_ctx = &prog;
    struct kv_lowrank *lr = NULL;
    int rc = kv_decompose(in->m, in->s, &A.o, &lr, &err);
    cli_progress_end(&prog);
    A.o.progress = NULL, A.o.progress_ctx = NULL;
    if (rc) return cli_report(&err);
    print_warnings(in->m, lr);
    double tw = kv_now();
    rc = kv_decompose_write(in->m, lr, &A.o, in->s, A.model, A.tokenizer, A.out, &err);
    tw = kv_now() - tw;
    if (rc) rc = cli_report(&err);
    else if (A.json) rc = print_json(in, lr, tw);
    else print_text(in, lr, tw);
    kv_lr_free(lr);
    return rc;
}

int cmd_decompose(int argc, char **argv) {
    memset(&A, 0, sizeof A);
    kv_decompose_defaults(&A.o);
    A.o.eps = A.o.ratio = NAN; /* not given (the library's 0), told apart from a given 0 */
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if ((rc = resolve_options()) >= 0) return rc;
    struct inputs in = {0};
    if ((rc = load_inputs(&in)) < 0) rc = run(&in);
    inputs_free(&in);
    return rc;
}
