/* kvcal decompose: low-rank K/V factors under a budget, written as a
 * compressed model directory with its manifest. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

static void side_ranks(const struct kv_lowrank *lr, int64_t l, int which, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    if (kv_lr_mode_of(lr, l, which) == KV_LR_FULL) {
        snprintf(buf, cap, "full");
        return;
    }
    for (int64_t u = 0; u < kv_lr_n_units(lr, l, which) && n + 16 < cap; u++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", u ? "," : "",
                              (long long)kv_lr_unit_info(lr, l, which, u).rank);
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

int cmd_decompose(int argc, char **argv) {
    const char *model = NULL, *tokenizer = NULL, *stats = NULL, *out = NULL;
    const char *method_s = "palu", *alloc_s = NULL, *text = NULL;
    int64_t seq_len = 256, calib_windows = 8;
    double eps = 0, ratio = 0, d_min = 0, d_max = 0, cond_skip = 0, budget = 0;
    int64_t group = 1, mult = 1, min_rank = 1, kv_bits = 16, threads = 0;
    int hadamard = 0, json = 0, quiet = 0;
    const struct cli_opt opts[] = {
        {"model", 'm', OPT_STR, &model, "PATH", "model: HF directory, .gguf or llama2.c .bin"},
        {"tokenizer", 0, OPT_STR, &tokenizer, "FILE",
         "the model's tokenizer when it has none inside (copied into the output)"},
        {"stats", 's', OPT_STR, &stats, "FILE",
         "statistics from 'kvcal collect' (needed by every method except svd and lorc)"},
        {"output", 'o', OPT_STR, &out, "DIR", "output directory (created; an earlier output is replaced)"},
        {"method", 0, OPT_STR, &method_s, "M", "svd, palu (default), eigen, lorc, fdc or zack"},
        {"alloc", 0, OPT_STR, &alloc_s, "A",
         "rank allocation: eps, uniform, fisher, progressive, removal,\n"
         "layer-budget or global (default: the method's own; see below)"},
        {"eps", 0, OPT_DOUBLE, &eps, "E", "keep the fraction E in (0, 1] of each unit's energy"},
        {"ratio", 0, OPT_DOUBLE, &ratio, "R", "keep the fraction R in (0, 1] of the KV bytes per token"},
        {"group-size", 0, OPT_INT, &group, "S",
         "KV heads per unit for svd, palu and fdc values: 1 = per head (M-LRD, default),\n"
         "all = joint (J-LRD), between = groups (G-LRD)"},
        {"rank-multiple", 0, OPT_INT, &mult, "N", "round every rank up to a multiple of N (default 1)"},
        {"min-rank", 0, OPT_INT, &min_rank, "N", "smallest rank of a unit (default 1)"},
        {"d-min", 0, OPT_DOUBLE, &d_min, "F", "lorc: smallest layer rank as a fraction (eq. 13)"},
        {"d-max", 0, OPT_DOUBLE, &d_max, "F", "lorc: largest layer rank as a fraction (default 1)"},
        {"cond-skip", 0, OPT_DOUBLE, &cond_skip, "X",
         "lorc: leave layers whose log10 cumulative condition number exceeds X uncompressed"},
        {"error-budget", 0, OPT_DOUBLE, &budget, "E",
         "layer-budget: largest normalised layer output error ‖y'−y‖/‖y‖ per layer"},
        {"text", 't', OPT_STR, &text, "FILE",
         "layer-budget: calibration text whose windows measure the layer outputs"},
        {"seq-len", 0, OPT_INT, &seq_len, "N", "layer-budget: window length (default 256)"},
        {"windows", 0, OPT_INT, &calib_windows, "W", "layer-budget: windows measured (default 8)"},
        {"kv-bits", 0, OPT_INT, &kv_bits, "B",
         "latent storage for the byte budget: 16 (fp16, default), 8, 4, 3 or 2 (per-token\n"
         "asymmetric integers with an fp16 scale and zero point per unit)"},
        {"hadamard", 0, OPT_FLAG, &hadamard, NULL,
         "fuse a Walsh-Hadamard rotation into the factors (spreads latent outliers before\n"
         "quantization; exact in float)"},
        {"threads", 0, OPT_INT, &threads, "N", "threads for BLAS and OpenMP (default: all cores)"},
        {"json", 0, OPT_FLAG, &json, NULL, "print one JSON object on stdout"},
        {"quiet", 'q', OPT_FLAG, &quiet, NULL, "no progress on stderr"},
    };
    const struct cli_cmd cmd = {
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
        "  eps          per unit, the smallest rank keeping E of the energy [eigen]\n"
        "  uniform      the same fraction of every unit [svd, palu]\n"
        "  fisher       ranks in proportion to each unit's Fisher information, Σ (∂L/∂W)²\n"
        "               over its rows of W_k or W_v (needs 'kvcal collect --fisher' stats)\n"
        "  progressive  LoRC eqs. 12-13, --d-min/--d-max, --cond-skip [lorc]\n"
        "  removal      one singular-value removal rate for all units [fdc, zack]\n"
        "  layer-budget Eigen Attention §4.4: per layer, eps drops by 0.02 while the layer's\n"
        "               measured output error stays under --error-budget (needs --text)\n"
        "  global       greedy: drop the direction with the least relative error per byte\n"
        "               (each unit's error weighted by its Fisher information when the stats\n"
        "               have it)\n"
        "With --ratio the allocation's parameter is searched for the smallest cache of at\n"
        "least R of the base KV bytes per token (global stops at the first at or below R);\n"
        "the achieved ratio is printed and recorded, with a warning when the allocation\n"
        "cannot get that small. --eps 1 (or\n"
        "--ratio 1) keeps every rank: the compressed model then equals the base.\n"
        "\nthe predicted error of a unit is the calibration energy its dropped directions\n"
        "carry, Σ‖y − y'‖² over the calibration tokens, relative to Σ‖y‖².\n"
        "\nexamples:\n"
        "  kvcal decompose -m tinystories-656K -s 656K.kvstats --eps 0.9 -o out-656K\n"
        "  kvcal decompose -m stories260K.bin --tokenizer tok512.bin -s 260K.kvstats \\\n"
        "      --method palu --group-size 2 --ratio 0.5 -o out-260K\n"
        "  kvcal decompose -m stories260K.bin --method lorc --ratio 0.5 -o out-lorc\n",
        opts, (int)(sizeof opts / sizeof opts[0]), 0};
    const char *pos[1];
    int n_pos;
    int rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!model) return cli_usage_error(&cmd, "missing --model");
    if (!out) return cli_usage_error(&cmd, "missing --output");
    int method = kv_method_parse(method_s);
    if (method < 0)
        return cli_usage_error(&cmd, "unknown --method '%s' (svd, palu, eigen, lorc, fdc, zack)", method_s);
    int alloc = KV_ALLOC_DEFAULT;
    if (alloc_s && (alloc = kv_alloc_parse(alloc_s)) < 0)
        return cli_usage_error(&cmd, "unknown --alloc '%s' (eps, uniform, fisher, progressive, "
                                     "removal, global)", alloc_s);
    if (alloc == KV_ALLOC_FISHER && !stats)
        return cli_usage_error(&cmd, "--alloc fisher needs --stats from 'kvcal collect --fisher'");
    if (alloc == KV_ALLOC_LAYER_BUDGET && !text)
        return cli_usage_error(&cmd, "--alloc layer-budget needs --text (calibration windows)");
    if (budget < 0) return cli_usage_error(&cmd, "--error-budget must be positive");
    if (budget > 0 && alloc != KV_ALLOC_LAYER_BUDGET)
        return cli_usage_error(&cmd, "--error-budget applies to --alloc layer-budget");
    if (seq_len < 2 || calib_windows < 1)
        return cli_usage_error(&cmd, "--seq-len must be at least 2 and --windows at least 1");
    if (eps && ratio) return cli_usage_error(&cmd, "give --eps or --ratio, not both");
    if (eps && !(eps > 0 && eps <= 1)) return cli_usage_error(&cmd, "--eps %g is outside (0, 1]", eps);
    if (ratio && !(ratio > 0 && ratio <= 1))
        return cli_usage_error(&cmd, "--ratio %g is outside (0, 1]", ratio);
    if (!eps && !ratio && !(alloc == KV_ALLOC_PROGRESSIVE && d_min > 0) &&
        !(alloc == KV_ALLOC_LAYER_BUDGET && budget > 0) &&
        !(alloc == KV_ALLOC_DEFAULT && method == KV_METHOD_LORC && d_min > 0))
        return cli_usage_error(&cmd, "give --eps E or --ratio R");
    if (eps && alloc != KV_ALLOC_DEFAULT && alloc != KV_ALLOC_EPS && alloc != KV_ALLOC_GLOBAL)
        return cli_usage_error(&cmd, "--eps applies to --alloc eps or global; --alloc %s takes --ratio",
                               alloc_s);
    if (!ratio && (alloc == KV_ALLOC_UNIFORM || alloc == KV_ALLOC_FISHER || alloc == KV_ALLOC_REMOVAL))
        return cli_usage_error(&cmd, "--alloc %s needs --ratio R", alloc_s);
    int progressive = alloc == KV_ALLOC_PROGRESSIVE || (alloc == KV_ALLOC_DEFAULT && method == KV_METHOD_LORC && !eps);
    if ((cond_skip || d_min || d_max) && !progressive)
        return cli_usage_error(&cmd, "--d-min, --d-max and --cond-skip apply to --alloc progressive");
    if (budget > 0 && ratio) return cli_usage_error(&cmd, "give --error-budget or --ratio, not both");
    if (group < 1) return cli_usage_error(&cmd, "--group-size must be at least 1");
    if (mult < 1 || mult > 1 << 20)
        return cli_usage_error(&cmd, "--rank-multiple must be in 1..%d", 1 << 20);
    if (min_rank < 1) return cli_usage_error(&cmd, "--min-rank must be at least 1");
    if (kv_bits != 16 && kv_bits != 8 && kv_bits != 4 && kv_bits != 3 && kv_bits != 2)
        return cli_usage_error(&cmd, "--kv-bits %lld is not one of 16, 8, 4, 3, 2", (long long)kv_bits);
    if (d_min < 0 || d_min > 1 || d_max < 0 || d_max > 1 || (d_max > 0 && d_min > d_max))
        return cli_usage_error(&cmd, "--d-min and --d-max are fractions with d-min <= d-max <= 1");
    if (threads < 0) return cli_usage_error(&cmd, "--threads must be positive");
    kv_set_threads((int)threads);
    struct kv_err err;
    kv_err_clear(&err);
    if (kv_lr_dir_check(out, "--output", &err)) return cli_report(&err);

    struct kv_model *m;
    if ((rc = cli_load_model(model, tokenizer, &m))) return rc;
    const struct kv_config *c = kv_model_config(m);
    struct kv_stats *s = NULL;
    if (stats) {
        if (kv_stats_open(stats, &s, &err) || !kv_stats_matches_model(s, m, stats, &err)) {
            kv_stats_free(s);
            kv_model_close(m);
            return cli_report(&err);
        }
    } else if (method != KV_METHOD_SVD && method != KV_METHOD_LORC) {
        kv_model_close(m);
        return cli_usage_error(&cmd, "--method %s needs --stats (run 'kvcal collect' first)", method_s);
    }
    if (group > c->n_kv_heads || c->n_kv_heads % group) {
        int64_t g = c->n_kv_heads;
        kv_stats_free(s);
        kv_model_close(m);
        return cli_usage_error(&cmd, "--group-size %lld does not divide the model's %lld kv heads",
                               (long long)group, (long long)g);
    }
    if (alloc == KV_ALLOC_FISHER && !kv_stats_info(s).has_fisher) {
        fprintf(stderr, "kvcal: %s: has no fisher statistics (blk.N.fisher.k/v), which --alloc fisher needs\n",
                stats);
        kv_stats_free(s);
        kv_model_close(m);
        return EXIT_ERR;
    }

    int32_t *ids = NULL;
    int64_t n_ids = 0;
    size_t n_bytes = 0;
    if (alloc == KV_ALLOC_LAYER_BUDGET) {
        if ((rc = cli_load_tokens(m, text, NULL, &ids, &n_ids, &n_bytes))) {
            kv_stats_free(s);
            kv_model_close(m);
            return rc;
        }
        if (n_ids / seq_len < calib_windows) calib_windows = n_ids / seq_len;
        if (calib_windows < 1) {
            fprintf(stderr, "kvcal: %s: %lld tokens, fewer than one window of %lld\n", text,
                    (long long)n_ids, (long long)seq_len);
            free(ids), kv_stats_free(s), kv_model_close(m);
            return EXIT_ERR;
        }
    }
    struct kv_decompose_opts o = {0};
    o.calib_tokens = ids, o.calib_windows = calib_windows, o.seq_len = seq_len;
    o.method = method, o.alloc = alloc, o.eps = eps, o.ratio = ratio, o.group_size = group;
    o.rank_multiple = mult, o.min_rank = min_rank, o.d_min = d_min, o.d_max = d_max;
    o.cond_skip = cond_skip, o.error_budget = budget, o.kv_bits = (int)kv_bits, o.hadamard = hadamard;
    struct cli_progress prog;
    cli_progress_start(&prog, "layers", quiet || json);
    o.progress = cli_progress_cb, o.progress_ctx = &prog;
    struct kv_lowrank *lr = NULL;
    rc = kv_decompose(m, s, &o, &lr, &err);
    cli_progress_end(&prog);
    free(ids);
    if (rc) {
        if (!err.path[0] && stats && rc == KV_ENUMERIC) snprintf(err.path, sizeof err.path, "%s", stats);
        kv_stats_free(s);
        kv_model_close(m);
        return cli_report(&err);
    }
    int64_t base = kv_lr_base_bytes(c), comp = kv_lr_bytes(lr, (int)kv_bits);
    if (hadamard) {
        int64_t plain = 0;
        for (int64_t l = 0; l < kv_lr_info(lr).n_layers; l++)
            for (int k = 0; k < 2; k++)
                for (int64_t u = 0; u < kv_lr_n_units(lr, l, k); u++) {
                    int64_t r = kv_lr_unit_info(lr, l, k, u).rank;
                    plain += r > 1 && (r & 1);
                }
        if (plain)
            fprintf(stderr, "kvcal: warning: --hadamard leaves %lld units of odd rank unrotated (a "
                            "block is the largest power of two dividing the rank); add "
                            "--rank-multiple 8\n", (long long)plain);
    }
    int reached = !(ratio > 0 && o.least_bytes > o.target_bytes && comp > o.target_bytes);
    if (!reached)
        fprintf(stderr,
                "kvcal: warning: --alloc %s cannot reach --ratio %g for this model: its smallest "
                "cache keeps %.4f%s; wrote that\n",
                kv_alloc_name(o.alloc), ratio, (double)comp / (double)base,
                o.alloc == KV_ALLOC_PROGRESSIVE ? " (eq. 13 keeps the most sensitive layer at "
                                                  "--d-max: lower it to go further)"
                                                : "");
    double ke = 0, kd = 0, ve = 0, vd = 0;
    int64_t n_layers = kv_lr_info(lr).n_layers;
    for (int64_t l = 0; l < n_layers; l++) {
        kv_lr_side_error(lr, l, 0, &ke, &kd);
        kv_lr_side_error(lr, l, 1, &ve, &vd);
    }

    /* the manifest's options and stats records */
    json_t *jo = json_pack("{s:s, s:s, s:o, s:o, s:I, s:I, s:I, s:i, s:b, s:o}", "method", method_s,
                           "alloc", kv_alloc_name(o.alloc), "eps", eps > 0 ? json_real(eps) : json_null(),
                           "ratio", ratio > 0 ? json_real(ratio) : json_null(), "group_size",
                           (json_int_t)group, "rank_multiple", (json_int_t)mult, "min_rank",
                           (json_int_t)min_rank, "kv_bits", (int)kv_bits, "hadamard", hadamard,
                           "searched_parameter", cli_json_real(o.param));
    if (method == KV_METHOD_LORC) {
        json_object_set_new(jo, "d_min", json_real(o.alloc == KV_ALLOC_PROGRESSIVE && ratio > 0 ? o.param * (d_max > 0 ? d_max : 1.0) : d_min));
        json_object_set_new(jo, "d_max", json_real(d_max > 0 ? d_max : 1.0));
        json_object_set_new(jo, "cond_skip", cond_skip > 0 ? json_real(cond_skip) : json_null());
    }
    json_t *js = json_null();
    struct kv_stats_info si = s ? kv_stats_info(s) : (struct kv_stats_info){0};
    if (s)
        js = json_pack("{s:o, s:s, s:I, s:I, s:I, s:b}", "path", cli_json_text(stats),
                       "model_fingerprint", si.fingerprint, "tokens", (json_int_t)si.tokens,
                       "windows", (json_int_t)si.windows, "seq_len", (json_int_t)si.seq_len,
                       "fisher", si.has_fisher);
    char *opts_txt = json_dumps(jo, JSON_COMPACT), *stats_txt = json_dumps(js, JSON_COMPACT | JSON_ENCODE_ANY);
    struct kv_lr_dir_info info = {model, tokenizer, opts_txt, stats_txt};
    double tw = kv_now();
    rc = kv_lr_dir_write(m, lr, &info, out, &err);
    tw = kv_now() - tw;
    free(opts_txt), free(stats_txt);
    if (rc) {
        json_decref(jo), json_decref(js);
        kv_lr_free(lr), kv_stats_free(s), kv_model_close(m);
        return cli_report(&err);
    }

    if (json) {
        json_t *layers = json_array();
        for (int64_t l = 0; l < n_layers; l++) {
            json_t *side[2];
            for (int k = 0; k < 2; k++) {
                json_t *ranks = json_array();
                for (int64_t u = 0; u < kv_lr_n_units(lr, l, k); u++)
                    json_array_append_new(ranks, json_integer(kv_lr_unit_info(lr, l, k, u).rank));
                side[k] = json_pack("{s:s, s:o, s:o, s:I}", "mode",
                                    kv_lr_mode_name(kv_lr_mode_of(lr, l, k)), "ranks", ranks,
                                    "predicted_error",
                                    cli_json_real(kv_lr_side_error(lr, l, k, NULL, NULL)), "bytes",
                                    (json_int_t)kv_lr_side_bytes(lr, l, k, (int)kv_bits));
            }
            json_array_append_new(layers, json_pack("{s:I, s:o, s:o}", "layer", (json_int_t)l, "k",
                                                    side[0], "v", side[1]));
        }
        json_t *o2 = json_pack(
            "{s:o, s:o, s:s, s:s, s:o, s:{s:I, s:I, s:o, s:o, s:o}, s:{s:o, s:o}, s:o, s:o, s:o, s:o}",
            "model", cli_json_text(model), "output", cli_json_text(out), "method", method_s, "alloc",
            kv_alloc_name(o.alloc), "options", jo, "kv_bytes_per_token", "base", (json_int_t)base,
            "compressed", (json_int_t)comp, "ratio", cli_json_real((double)comp / (double)base),
            "target", ratio > 0 ? json_real(ratio) : json_null(), "target_reached", json_boolean(reached), "predicted_error", "k",
            cli_json_real(ke > 0 ? kd / ke : 0), "v", cli_json_real(ve > 0 ? vd / ve : 0), "layers",
            layers, "seconds", cli_json_real(o.seconds), "lapack_seconds",
            cli_json_real(o.lapack_seconds), "write_seconds", cli_json_real(tw));
        json_decref(js);
        rc = cli_print_json(o2, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    } else {
        json_decref(jo), json_decref(js);
        char desc[512];
        cli_describe_config(c, desc, sizeof desc);
        printf("model     %s\n          %s\n", model, desc);
        if (s)
            printf("stats     %s: %lld tokens in %lld windows of %lld%s\n", stats,
                   (long long)si.tokens, (long long)si.windows, (long long)si.seq_len,
                   si.has_fisher ? ", with fisher statistics" : "");
        printf("method    %s, alloc %s", method_s, kv_alloc_name(o.alloc));
        if (eps > 0) printf(", eps %g", eps);
        if (ratio > 0) printf(", ratio %g (searched parameter %.4f)", ratio, o.param);
        printf(", group %lld, rank multiple %lld, min rank %lld, %s%s\n", (long long)group,
               (long long)mult, (long long)min_rank, kv_bits == 16 ? "fp16 latents" : "quantized latents",
               hadamard ? ", hadamard" : "");
        printf("\nlayer  k mode  k ranks          k err    v mode  v ranks          v err    bytes/token\n");
        for (int64_t l = 0; l < n_layers; l++) {
            char kr[128], vr[128];
            side_ranks(lr, l, 0, kr, sizeof kr);
            side_ranks(lr, l, 1, vr, sizeof vr);
            int64_t lb = kv_lr_side_bytes(lr, l, 0, (int)kv_bits) +
                         kv_lr_side_bytes(lr, l, 1, (int)kv_bits);
            printf("%5lld  %-6s  %-15s %6.2f%%   %-6s  %-15s %6.2f%%   %lld / %lld\n", (long long)l,
                   mode_short(kv_lr_mode_of(lr, l, 0)), kr,
                   100 * kv_lr_side_error(lr, l, 0, NULL, NULL), mode_short(kv_lr_mode_of(lr, l, 1)),
                   vr, 100 * kv_lr_side_error(lr, l, 1, NULL, NULL), (long long)lb,
                   (long long)(2 * c->n_kv_heads * c->head_dim * 2));
        }
        printf("\npredicted calibration error: k %.3f%%, v %.3f%% of the output energy\n",
               100 * (ke > 0 ? kd / ke : 0), 100 * (ve > 0 ? vd / ve : 0));
        printf("kv cache  %lld bytes/token compressed vs %lld base: %.4f kept", (long long)comp,
               (long long)base, (double)comp / (double)base);
        if (ratio > 0) printf(" (target %.4f%s)", ratio, reached ? "" : ", not reachable");
        printf("\ntime      %.3f s (eigendecompositions %.3f s), write %.3f s\n", o.seconds,
               o.lapack_seconds, tw);
        printf("wrote     %s\n", out);
    }
    kv_lr_free(lr);
    kv_stats_free(s);
    kv_model_close(m);
    return rc;
}
