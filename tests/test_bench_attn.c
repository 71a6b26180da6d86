/* Synthetic shapes (kernels/synth.c) and `kvcal bench-attn`.
 *
 * synth: the presets' documented shapes; kvrt_synth_lowrank's ranks (the
 *   uniform round(keep·d_h), and postrope ranks that differ per head with
 *   the mean kept, recomputed here), its factor shapes and value scale; the
 *   latent-cache forward pass accepts every mode it makes and gives finite
 *   logits; its refusals; and a manifest written by kv_lr_dir_write, read
 *   back alone and given random factors, runs in the forward pass and in
 *   the runtime's twin.
 * bench_cli: the command on the twin in text and JSON (configurations,
 *   KV bytes per token recomputed from the shapes, positive times, GB/s
 *   and speedup recomputed from the row), on a written manifest (a
 *   quantized one timed with its codes, --kv-bits replacing its width),
 *   --kv-bits on the synthetic latents, its exact usage errors, and
 *   --device cuda on a machine without a GPU. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt.h"
#include "lrmodel.h"
#include "model.h"
#include "testutil.h"

static const char *fmt_err(const struct kv_err *e) {
    static char buf[2200];
    kv_err_format(e, buf, sizeof buf, 1);
    return buf;
}

/* llama, GQA: dim 64, 2 layers, 6 query heads, 3 kv heads of 32 (an odd
 * number of kv heads: the postrope mean must still be kept). */
static struct kv_config llama_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_LLAMA;
    c.dim = 64, c.hidden_dim = 48, c.n_layers = 2, c.n_heads = 6, c.n_kv_heads = 3;
    c.head_dim = 32, c.vocab_size = 16, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF, c.bos_id = c.eos_id = -1;
    return c;
}

/* gpt2: dim 48, 2 layers, 4 heads of 16, biases. */
static struct kv_config gpt2_cfg(void) {
    struct kv_config c = {0};
    c.arch = KV_ARCH_GPT2;
    c.dim = 48, c.hidden_dim = 40, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 4;
    c.head_dim = 16, c.vocab_size = 16, c.max_seq_len = 64, c.norm_eps = 1e-5f;
    c.rope_layout = KV_ROPE_HALF, c.has_qkv_bias = 1, c.bos_id = c.eos_id = -1;
    return c;
}

static struct kv_model *model_of(struct kv_config c) {
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_init_random(&c, 3, &m, &err), KV_OK, "%s", fmt_err(&err));
    return m;
}

static struct kv_lowrank *lowrank(const struct kv_model *m, enum kv_lr_mode k, enum kv_lr_mode v,
                                  double keep) {
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_lowrank(m, k, v, keep, 11, &lr, &err), KV_OK, "%s", fmt_err(&err));
    return lr;
}

/* The latent-cache forward pass accepts lr on m, and 6 tokens give finite logits. */
static void assert_runs(const struct kv_model *m, const struct kv_lowrank *lr, const char *what) {
    const struct kv_config *c = kv_model_config(m);
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, 8, &f, &err), KV_OK, "%s: %s", what, fmt_err(&err));
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_OK, "%s: %s", what, fmt_err(&err));
    int32_t toks[6] = {1, 5, 2, 7, 0, 3};
    float *logits = malloc(6 * (size_t)c->vocab_size * sizeof *logits);
    cr_assert_eq(kv_fwd_run(f, toks, 6, 0, logits, &err), KV_OK, "%s: %s", what, fmt_err(&err));
    for (int64_t i = 0; i < 6 * c->vocab_size; i++)
        cr_assert(isfinite(logits[i]), "%s: logit %lld is %g", what, (long long)i,
                  (double)logits[i]);
    free(logits);
    kv_fwd_free(f);
}

/* Σ over query heads of the rank of the unit of their kv head. */
static int64_t cols_of(const struct kv_lr_side *s, int64_t h, int64_t g) {
    int64_t cols = 0;
    for (int64_t i = 0; i < h; i++)
        for (int64_t u = 0; u < s->n_units; u++)
            if (i / (h / g) >= s->units[u].head0 &&
                i / (h / g) < s->units[u].head0 + s->units[u].n_heads)
                cols += s->units[u].rank;
    return cols;
}

/* ------------------------------------------------------------ presets */

Test(synth, presets_have_the_documented_shapes, .timeout = 60) {
    static const struct {
        const char *name;
        enum kv_arch arch;
        int64_t d, h, g, dh;
        double theta;
    } want[] = {
        {"llama7b", KV_ARCH_LLAMA, 4096, 32, 32, 128, 1e4},
        {"llama3-8b", KV_ARCH_LLAMA, 4096, 32, 8, 128, 5e5},
        {"gpt2-xl", KV_ARCH_GPT2, 1600, 25, 25, 64, 0},
    };
    const char *const *names = kvrt_synth_presets();
    for (size_t i = 0; i < 3; i++) cr_assert_str_eq(names[i], want[i].name);
    cr_assert_null(names[3]);
    for (size_t i = 0; i < 3; i++) {
        struct kv_model *m = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        int64_t layers =
            want[i].arch == KV_ARCH_GPT2 ? 2 : 1; /* 4096-wide layers are slow to fill */
        cr_assert_eq(kvrt_synth_model(want[i].name, layers, &m, &err), KV_OK, "%s", fmt_err(&err));
        const struct kv_config *c = kv_model_config(m);
        cr_assert_eq(c->arch, want[i].arch, "%s", want[i].name);
        cr_assert_eq(c->dim, want[i].d, "%s", want[i].name);
        cr_assert_eq(c->n_heads, want[i].h, "%s", want[i].name);
        cr_assert_eq(c->n_kv_heads, want[i].g, "%s", want[i].name);
        cr_assert_eq(c->head_dim, want[i].dh, "%s", want[i].name);
        cr_assert_eq(c->n_layers, layers, "%s", want[i].name);
        cr_assert_eq(c->vocab_size, 8, "%s", want[i].name);
        cr_assert_eq(c->has_qkv_bias, want[i].arch == KV_ARCH_GPT2, "%s", want[i].name);
        if (want[i].arch == KV_ARCH_LLAMA) {
            cr_assert_eq((double)c->rope_theta, want[i].theta, "%s", want[i].name);
            cr_assert_eq(c->rope_layout, KV_ROPE_HALF, "%s", want[i].name);
        } else {
            cr_assert_not_null(kv_model_weight(m, KV_W_BQ, 1), "%s", want[i].name);
        }
        kv_model_close(m);
    }
}

Test(synth, unknown_preset_and_layer_count_are_refused) {
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_model("llama9", 1, &m, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg,
                     "preset 'llama9' is unknown, expected one of llama7b, llama3-8b, gpt2-xl");
    cr_assert_eq(kvrt_synth_model("gpt2-xl", 0, &m, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "preset 'gpt2-xl' with 0 layers, expected 1..1024");
    cr_assert_null(m);
}

/* ------------------------------------------------------------ lowrank */

/* Every unit one kv head; ranks in 1..d_h; factor pointers as the mode needs. */
static void assert_side(const struct kv_lr_side *s, enum kv_lr_mode mode, int64_t g, int64_t dh) {
    cr_assert_eq(s->mode, mode);
    if (mode == KV_LR_FULL) {
        cr_assert_eq(s->n_units, 0);
        return;
    }
    cr_assert_eq(s->n_units, g);
    for (int64_t u = 0; u < g; u++) {
        const struct kv_lr_unit *x = &s->units[u];
        cr_assert_eq(x->head0, u);
        cr_assert_eq(x->n_heads, 1);
        cr_assert(x->rank >= 1 && x->rank <= dh, "rank %lld", (long long)x->rank);
        cr_assert_null(x->down_bias);
        if (mode == KV_LR_POSTROPE_ROTATION) {
            cr_assert(x->rot && !x->down && !x->up);
        } else {
            cr_assert(x->down && x->up && !x->rot);
        }
    }
}

Test(synth, uniform_ranks_are_keep_times_head_dim) {
    struct kv_model *m = model_of(llama_cfg());
    const double keeps[] = {0.3, 0.5, 1.0, 0.001};
    for (size_t i = 0; i < sizeof keeps / sizeof keeps[0]; i++) {
        struct kv_lowrank *lr = lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FUSED_OUTPUT, keeps[i]);
        int64_t want = (int64_t)floor(keeps[i] * 32 + 0.5);
        if (want < 1) want = 1;
        cr_assert_str_eq(lr->info.method, "synthetic");
        cr_assert_eq(lr->info.n_layers, 2);
        cr_assert_eq(lr->info.dim, 64);
        cr_assert_eq(lr->info.n_heads, 6);
        cr_assert_eq(lr->info.n_kv_heads, 3);
        cr_assert_eq(lr->info.head_dim, 32);
        cr_assert_eq(lr->info.kv_bits, 16);
        cr_assert_eq(lr->info.hadamard, 0);
        for (int64_t l = 0; l < 2; l++) {
            const struct kv_lr_layer *y = &lr->layers[l];
            assert_side(&y->k, KV_LR_PREROPE_LATENT, 3, 32);
            assert_side(&y->v, KV_LR_FUSED_OUTPUT, 3, 32);
            for (int64_t u = 0; u < 3; u++) {
                cr_assert_eq(y->k.units[u].rank, want, "keep %g", keeps[i]);
                cr_assert_eq(y->v.units[u].rank, want, "keep %g", keeps[i]);
            }
            cr_assert_eq(y->o_cols, 6 * want);
            cr_assert_not_null(y->o_fused);
            cr_assert(!y->q_fused && !y->q_fused_bias && y->q_cols == 0);
        }
        assert_runs(m, lr, "prerope_latent + fused_output");
        kv_lr_free(lr);
    }
    kv_model_close(m);
}

Test(synth, postrope_ranks_differ_with_the_mean_kept) {
    struct kv_model *m = model_of(llama_cfg());
    struct kv_lowrank *lr = lowrank(m, KV_LR_POSTROPE_ROTATION, KV_LR_FUSED_OUTPUT, 0.5);
    for (int64_t l = 0; l < 2; l++) {
        const struct kv_lr_layer *y = &lr->layers[l];
        assert_side(&y->k, KV_LR_POSTROPE_ROTATION, 3, 32);
        int64_t sum = 0, lo = 99, hi = 0;
        for (int64_t u = 0; u < 3; u++) {
            int64_t r = y->k.units[u].rank;
            sum += r, lo = r < lo ? r : lo, hi = r > hi ? r : hi;
            cr_assert_eq(y->v.units[u].rank, 16);
        }
        cr_assert_eq(sum, 3 * 16, "the mean rank is %g, want 16", sum / 3.0);
        cr_assert(lo < hi, "every head has rank %lld", (long long)lo);
        cr_assert_eq(lo % 8, 0);
        cr_assert_eq(y->o_cols, 6 * 16);
    }
    assert_runs(m, lr, "postrope_rotation + fused_output");
    kv_lr_free(lr);
    kv_model_close(m);

    /* a preset: 8 kv heads of 128, mean 64 */
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_model("llama3-8b", 1, &m, &err), KV_OK, "%s", fmt_err(&err));
    lr = lowrank(m, KV_LR_POSTROPE_ROTATION, KV_LR_FULL, 0.5);
    const struct kv_lr_side *k = &lr->layers[0].k;
    int64_t sum = 0;
    for (int64_t u = 0; u < 8; u++) {
        sum += k->units[u].rank;
        cr_assert_eq(k->units[u].rank % 8, 0);
    }
    cr_assert_eq(sum, 8 * 64);
    cr_assert_neq(k->units[0].rank, k->units[1].rank);
    kv_lr_free(lr);
    kv_model_close(m);
}

/* Uniform values with variance 1/fan_in: down [r, d] has 1/d. */
Test(synth, factor_values_have_variance_one_over_fan_in) {
    struct kv_model *m = model_of(llama_cfg());
    struct kv_lowrank *lr = lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FUSED_OUTPUT, 1.0);
    const struct kv_lr_layer *y = &lr->layers[0];
    double s2 = 0, amax = 0;
    int64_t n = 0;
    for (int64_t u = 0; u < 3; u++)
        for (int64_t i = 0; i < 32 * 64; i++, n++) {
            double v = y->k.units[u].down[i];
            s2 += v * v, amax = fabs(v) > amax ? fabs(v) : amax;
        }
    double var = s2 / (double)n;
    cr_assert(fabs(var - 1.0 / 64) <= 0.05 / 64, "down variance %g, want %g", var, 1.0 / 64);
    cr_assert(amax <= sqrt(3.0 / 64), "down max %g beyond the uniform bound %g", amax,
              sqrt(3.0 / 64));
    s2 = 0;
    for (int64_t i = 0; i < 64 * y->o_cols; i++) s2 += (double)y->o_fused[i] * y->o_fused[i];
    var = s2 / (double)(64 * y->o_cols);
    cr_assert(fabs(var - 1.0 / (double)y->o_cols) <= 0.05 / (double)y->o_cols,
              "o_fused variance %g, want %g", var, 1.0 / (double)y->o_cols);
    kv_lr_free(lr);
    kv_model_close(m);
}

Test(synth, every_mode_runs_in_the_forward_pass) {
    struct kv_model *m = model_of(llama_cfg());
    const enum kv_lr_mode lk[] = {KV_LR_PREROPE_LATENT, KV_LR_POSTROPE_ROTATION, KV_LR_FULL,
                                  KV_LR_PREROPE_LATENT};
    const enum kv_lr_mode lv[] = {KV_LR_FULL, KV_LR_FULL, KV_LR_FUSED_OUTPUT, KV_LR_FUSED_OUTPUT};
    for (int i = 0; i < 4; i++) {
        struct kv_lowrank *lr = lowrank(m, lk[i], lv[i], 0.25);
        char what[96];
        snprintf(what, sizeof what, "llama %s + %s", kv_lr_mode_name(lk[i]),
                 kv_lr_mode_name(lv[i]));
        assert_runs(m, lr, what);
        kv_lr_free(lr);
    }
    kv_model_close(m);

    m = model_of(gpt2_cfg());
    const enum kv_lr_mode gk[] = {KV_LR_FUSED_QUERY, KV_LR_POSTROPE_ROTATION, KV_LR_PREROPE_LATENT};
    for (int i = 0; i < 3; i++) {
        struct kv_lowrank *lr = lowrank(m, gk[i], KV_LR_FUSED_OUTPUT, 0.5);
        const struct kv_lr_layer *y = &lr->layers[1];
        if (gk[i] == KV_LR_FUSED_QUERY) {
            assert_side(&y->k, KV_LR_FUSED_QUERY, 4, 16);
            cr_assert_eq(y->q_cols, cols_of(&y->k, 4, 4));
            cr_assert(y->q_fused && y->q_fused_bias, "gpt2 has q biases: q_fused needs one");
        }
        char what[96];
        snprintf(what, sizeof what, "gpt2 %s + fused_output", kv_lr_mode_name(gk[i]));
        assert_runs(m, lr, what);
        kv_lr_free(lr);
    }
    kv_model_close(m);
}

Test(synth, refusals_name_the_problem) {
    struct kv_model *m = model_of(llama_cfg());
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_lowrank(m, KV_LR_FUSED_QUERY, KV_LR_FULL, 0.5, 1, &lr, &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.msg,
                     "key mode 'fused_query' needs a model without rope, found arch 'llama'");
    cr_assert_eq(kvrt_synth_lowrank(m, KV_LR_FUSED_OUTPUT, KV_LR_FULL, 0.5, 1, &lr, &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.msg, "key mode 'fused_output' is not one of full, prerope_latent, "
                              "fused_query, postrope_rotation");
    cr_assert_eq(kvrt_synth_lowrank(m, KV_LR_FULL, KV_LR_PREROPE_LATENT, 0.5, 1, &lr, &err),
                 KV_EINVAL);
    cr_assert_str_eq(err.msg, "value mode 'prerope_latent' is not one of full, fused_output");
    cr_assert_eq(kvrt_synth_lowrank(m, KV_LR_FULL, KV_LR_FULL, 0, 1, &lr, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "keep 0 is not within (0, 1]");
    cr_assert_eq(kvrt_synth_lowrank(m, KV_LR_FULL, KV_LR_FULL, 1.5, 1, &lr, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "keep 1.5 is not within (0, 1]");
    cr_assert_null(lr);
    kv_model_close(m);
}

/* ------------------------------------------------------------ manifests */

/* A manifest of m written by kv_lr_dir_write: layer 0 of lr_a, layer 1 of
 * lr_b (mixed modes). Returns the directory; *parent to clean up. */
static char *write_manifest(const struct kv_model *m, struct kv_lowrank *a, struct kv_lowrank *b,
                            int kv_bits, char **parent) {
    struct kv_lr_layer t = a->layers[1];
    a->layers[1] = b->layers[1], b->layers[1] = t;
    a->info.kv_bits = kv_bits;
    *parent = kvt_temp_dir();
    char *dir = kvt_path(*parent, "lr");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, a, NULL, dir, &err), KV_OK, "%s", fmt_err(&err));
    return dir;
}

static void rm_manifest(char *dir, char *parent) {
    kvt_rm_dir(dir);
    kvt_rm_dir(parent);
}

static struct kv_lowrank *read_manifest(const char *dir) {
    char *p = kvt_path(dir, "kvcal.json");
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_manifest_read(p, &lr, &err), KV_OK, "%s", fmt_err(&err));
    free(p);
    return lr;
}

/* Factors of a manifest read alone: every pointer its modes need, the
 * model of its shapes, and both the forward pass and the twin run them. */
static void check_filled(struct kv_lowrank *lr, enum kv_arch arch) {
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kvrt_synth_fill_factors(lr, 5, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        const struct kv_lr_layer *y = &lr->layers[l];
        assert_side(&y->k, y->k.mode, lr->info.n_kv_heads, lr->info.head_dim);
        assert_side(&y->v, y->v.mode, lr->info.n_kv_heads, lr->info.head_dim);
        cr_assert_eq(y->o_fused != NULL, y->v.mode == KV_LR_FUSED_OUTPUT);
        cr_assert_eq(y->q_fused != NULL, y->k.mode == KV_LR_FUSED_QUERY);
        cr_assert_eq(y->q_fused_bias != NULL, y->k.mode == KV_LR_FUSED_QUERY);
    }
    struct kv_model *m = NULL;
    cr_assert_eq(kvrt_synth_model_for(lr, &m, &err), KV_OK, "%s", fmt_err(&err));
    const struct kv_config *c = kv_model_config(m);
    cr_assert_eq(c->arch, arch);
    cr_assert(c->n_layers == lr->info.n_layers && c->dim == lr->info.dim && c->n_heads == lr->info.n_heads &&
              c->n_kv_heads == lr->info.n_kv_heads && c->head_dim == lr->info.head_dim);
    assert_runs(m, lr, "manifest with random factors");

    struct kvrt_opts o;
    kvrt_opts_default(&o);
    o.max_ctx = 40;
    struct kvrt *rt;
    cr_assert_eq(kvrt_open(m, lr, &o, &rt, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        double us, ua;
        cr_assert_eq(kvrt_fill(rt, l, 39, 1, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert_eq(kvrt_time_step(rt, l, 39, 1, &us, &ua, &err), KV_OK, "%s", fmt_err(&err));
        cr_assert(us > 0 && ua > 0, "step %g us, attention %g us", us, ua);
    }
    kvrt_close(rt);
    kv_model_close(m);

    cr_assert_eq(kvrt_synth_fill_factors(lr, 5, &err), KV_EINVAL);
    cr_assert_str_eq(err.msg, "layer 0 already has factors, expected a manifest read alone");
}

Test(synth, a_written_manifest_gets_factors_the_forward_accepts) {
    struct kv_model *m = model_of(llama_cfg());
    struct kv_lowrank *a = lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FUSED_OUTPUT, 0.5);
    struct kv_lowrank *b = lowrank(m, KV_LR_POSTROPE_ROTATION, KV_LR_FULL, 0.25);
    char *parent, *dir = write_manifest(m, a, b, 16, &parent);
    struct kv_lowrank *lr = read_manifest(dir);
    cr_assert_eq(lr->layers[1].k.mode, KV_LR_POSTROPE_ROTATION);
    check_filled(lr, KV_ARCH_LLAMA);
    kv_lr_free(lr), kv_lr_free(a), kv_lr_free(b);
    rm_manifest(dir, parent);
    kv_model_close(m);

    m = model_of(gpt2_cfg());
    a = lowrank(m, KV_LR_FUSED_QUERY, KV_LR_FUSED_OUTPUT, 0.5);
    b = lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FULL, 0.75);
    dir = write_manifest(m, a, b, 16, &parent);
    lr = read_manifest(dir);
    check_filled(lr, KV_ARCH_GPT2);
    kv_lr_free(lr), kv_lr_free(a), kv_lr_free(b);
    rm_manifest(dir, parent);
    kv_model_close(m);
}

/* ------------------------------------------------------------ CLI */

static void expect_usage(const char *args, const char *msg) {
    char *out, *err, want[1024];
    int rc = kvt_run_cli(args, &out, &err);
    snprintf(want, sizeof want,
             "kvcal bench-attn: %s\nusage: kvcal bench-attn (--synthetic PRESET | --manifest DIR) "
             "[options] (see 'kvcal bench-attn --help')\n",
             msg);
    cr_assert_eq(rc, 2, "kvcal %s: exit %d, want 2; stderr:\n%s", args, rc, err);
    cr_assert_str_eq(err, want, "kvcal %s", args);
    cr_assert_str_eq(out, "");
    free(out), free(err);
}

/* The table rows of text output: fields split at '|'. */
struct row {
    long long ctx;
    char config[64], cache[8], peak[16];
    double kv, us, ua, gbs, speedup;
};

static int parse_rows(const char *out, struct row *rows, int cap) {
    int n = 0;
    for (const char *p = out; (p = strstr(p, "\n| ")); p++) {
        struct row r;
        if (sscanf(p, "\n| %lld | %63s | %7s | %lf | %lf | %lf | %lf | %15s | %lfx |", &r.ctx,
                   r.config, r.cache, &r.kv, &r.us, &r.ua, &r.gbs, r.peak, &r.speedup) != 9)
            continue;
        cr_assert_lt(n, cap);
        rows[n++] = r;
    }
    return n;
}

Test(bench_cli, synthetic_preset_on_the_twin, .timeout = 60) {
    char *out, *err;
    int rc = kvt_run_cli(
        "bench-attn --synthetic llama3-8b --device twin --ctx 256 --iters 1 --cache f16", &out,
        &err);
    cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
    cr_assert(strstr(out, "device     cpu twin, ") &&
                  strstr(out, "d 4096, 32 heads, 8 kv heads, head_dim 128, "
                              "1 layer timed, rope theta 500000"),
              "%s", out);
    cr_assert(strstr(out, "| ctx |") || strstr(out, "|     ctx | config"), "%s", out);
    struct row r[8];
    int n = parse_rows(out, r, 8);
    cr_assert_eq(n, 3, "%d rows in\n%s", n, out);
    static const char *names[] = {"full", "prerope_latent+fused_output",
                                  "postrope_rotation+fused_output"};
    /* fp16 bytes per token and layer: K and V of 8 kv heads of 128, or of rank 64 on average */
    const double kv[] = {2 * 8 * 128 * 2, 2 * 8 * 64 * 2, 2 * 8 * 64 * 2};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(r[i].ctx, 256);
        cr_assert_str_eq(r[i].config, names[i]);
        cr_assert_str_eq(r[i].cache, "f16");
        cr_assert_eq(r[i].kv, kv[i], "%s: %g bytes per token", names[i], r[i].kv);
        cr_assert(r[i].us > 0 && r[i].ua > 0 && r[i].gbs > 0 && r[i].speedup > 0, "%s", out);
        cr_assert_str_eq(r[i].peak, "-");
        /* speedup = full's step / this row's, to the printed digits */
        double want = r[0].us / r[i].us;
        cr_assert(fabs(r[i].speedup - want) <= 0.006 + 1e-3 * want, "%s: speedup %g, want %g",
                  names[i], r[i].speedup, want);
    }
    cr_assert_eq(r[0].speedup, 1.0);
    free(out), free(err);
}

Test(bench_cli, json_rows, .timeout = 60) {
    char *out, *err;
    int rc = kvt_run_cli(
        "bench-attn --synthetic gpt2-xl --device twin --ctx 128,64 --iters 1 --json", &out, &err);
    cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
    cr_assert_str_eq(err, "", "--json prints no progress");
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "%s: %s", je.text, out);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(o, "device"), "backend")),
                     "twin");
    cr_assert_str_eq(json_string_value(json_object_get(o, "synthetic")), "gpt2-xl");
    json_t *sh = json_object_get(o, "shapes");
    cr_assert_eq(json_integer_value(json_object_get(sh, "dim")), 1600);
    cr_assert(json_is_false(json_object_get(sh, "rope")));
    json_t *rows = json_object_get(o, "rows");
    cr_assert_eq(json_array_size(rows), 2 * 3 * 2, "%s", out);
    static const char *names[] = {"full", "fused_query+fused_output",
                                  "postrope_rotation+fused_output"};
    static const char *caches[] = {"f16", "f32"};
    size_t i = 0;
    for (int c = 0; c < 2; c++)
        for (int g = 0; g < 3; g++)
            for (int t = 0; t < 2; t++, i++) {
                json_t *r = json_array_get(rows, i);
                int64_t ctx = c ? 128 : 64;
                cr_assert_eq(json_integer_value(json_object_get(r, "ctx")), ctx);
                cr_assert_str_eq(json_string_value(json_object_get(r, "config")), names[g]);
                cr_assert_str_eq(json_string_value(json_object_get(r, "cache")), caches[t]);
                double kv = json_real_value(json_object_get(r, "kv_bytes_per_token_layer"));
                double full = 2.0 * 25 * 64 * (t ? 4 : 2);
                cr_assert_eq(kv, g ? full / 2 : full, "row %zu: %g bytes per token", i, kv);
                double us = json_real_value(json_object_get(r, "us_step"));
                double bytes = json_real_value(json_object_get(r, "bytes"));
                double gbs = json_real_value(json_object_get(r, "gbs"));
                cr_assert(us > 0 && bytes > (double)(ctx + 1) * kv, "row %zu", i);
                cr_assert(fabs(gbs - bytes / us / 1e3) <= 1e-9 * gbs, "row %zu: gbs %g", i, gbs);
                cr_assert(json_is_null(json_object_get(r, "pct_peak")));
                json_t *f = json_array_get(rows, i - (size_t)(g * 2));
                double want = json_real_value(json_object_get(f, "us_step")) / us;
                double sp = json_real_value(json_object_get(r, "speedup"));
                cr_assert(fabs(sp - want) <= 1e-9 * want, "row %zu: speedup %g, want %g", i, sp,
                          want);
            }
    json_t *cfgs = json_object_get(o, "configs");
    cr_assert_eq(json_array_size(cfgs), 3);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(cfgs, 1), "kmode")),
                     "fused_query");
    json_decref(o);
    free(out), free(err);
}

Test(bench_cli, a_written_manifest, .timeout = 60) {
    struct kv_model *m = model_of(llama_cfg());
    struct kv_lowrank *a = lowrank(m, KV_LR_POSTROPE_ROTATION, KV_LR_FUSED_OUTPUT, 0.5);
    struct kv_lowrank *b = lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FULL, 0.25);
    char *parent, *dir = write_manifest(m, a, b, 16, &parent);
    /* f32 bytes per token of each layer: K ranks 8+24+16 and V 3×16; then
     * K 3×8 and V full 3×32 */
    double want = ((48 + 48) + (24 + 96)) * 4 / 2.0;
    char args[2048], *out, *err;
    snprintf(args, sizeof args,
             "bench-attn --manifest '%s' --device twin --ctx 32,100 --cache f32 -q", dir);
    int rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
    cr_assert_str_eq(err, "");
    cr_assert(strstr(out, "2 layers timed, rope theta 10000") && strstr(out, "method synthetic"),
              "%s", out);
    cr_assert_null(strstr(out, "note"), "%s", out);
    struct row r[8];
    int n = parse_rows(out, r, 8);
    cr_assert_eq(n, 4, "%s", out);
    cr_assert(r[0].ctx == 32 && r[2].ctx == 100 && !strcmp(r[1].config, "manifest"), "%s", out);
    cr_assert_eq(r[1].kv, want, "manifest: %g bytes per token and layer, want %g", r[1].kv, want);
    cr_assert_eq(r[0].kv, 2 * 3 * 32 * 4);
    free(out), free(err);

    snprintf(args, sizeof args, "bench-attn --manifest '%s' --device twin --layers 3", dir);
    expect_usage(args, "--layers 3 exceeds the manifest's 2 layers");
    snprintf(args, sizeof args, "bench-attn --manifest '%s' --keep 0.5", dir);
    expect_usage(args, "--keep needs --synthetic (a manifest has its own ranks)");
    kv_lr_free(a), kv_lr_free(b);
    rm_manifest(dir, parent);

    /* quantized latents: timed as the manifest stores them, its codes plus
     * an fp16 scale and zero per unit; --kv-bits replaces its width; only
     * layer 0. 3 kv heads of rank 16 per side. */
    a = lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FUSED_OUTPUT, 0.5);
    b = lowrank(m, KV_LR_PREROPE_LATENT, KV_LR_FUSED_OUTPUT, 0.5);
    dir = write_manifest(m, a, b, 4, &parent);
    static const struct {
        const char *opt;
        double kv;
        const char *note;
    } q[] = {{"", 2 * 3 * (8 + 4), ", 4-bit codes with an fp16 scale and zero per unit\n"},
             {"--kv-bits 8", 2 * 3 * (16 + 4), ", 8-bit codes with an fp16 scale and zero per unit\n"},
             {"--kv-bits 16", 2 * 3 * 16 * 2, "alloc uniform\n"}};
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args,
                 "bench-attn --manifest '%s' --device twin --ctx 16 --cache f16 --layers 1 %s -q", dir,
                 q[i].opt);
        rc = kvt_run_cli(args, &out, &err);
        cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
        cr_assert(strstr(out, "\nmanifest   method synthetic, alloc uniform") && strstr(out, q[i].note),
                  "%s: %s", q[i].opt, out);
        cr_assert_null(strstr(out, "note"), "%s", out);
        cr_assert(strstr(out, "1 layer timed"), "%s", out);
        cr_assert_eq(!!strstr(out, "values fused_output, "), i < 2, "%s", out);
        n = parse_rows(out, r, 8);
        cr_assert_eq(n, 2, "%s", out);
        cr_assert_eq(r[1].kv, q[i].kv, "%s: %g bytes per token", q[i].opt, r[1].kv);
        cr_assert_eq(r[0].kv, 2 * 3 * 32 * 2);
        free(out), free(err);
    }
    kv_lr_free(a), kv_lr_free(b);
    rm_manifest(dir, parent);
    kv_model_close(m);
}

/* --kv-bits on synthetic latents: the header and each latent row name the
 * width, the bytes per token count codes plus scale and zero per unit (the
 * same for both caches), full stays f16/f32; JSON carries the bits. */
Test(bench_cli, kv_bits_quantizes_the_synthetic_latents, .timeout = 60) {
    char *out, *err;
    int rc = kvt_run_cli("bench-attn --synthetic gpt2-xl --device twin --ctx 64 --iters 1 --kv-bits 2 -q",
                         &out, &err);
    cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
    cr_assert(strstr(out, "\nlatents    rank round(0.5 x head_dim) on average per kv head, 2-bit codes "
                          "with an fp16 scale and zero per unit\n") &&
                  strstr(out, "keys fused_query, values fused_output, 2-bit latents\n") &&
                  strstr(out, "keys full, values full\n"),
              "%s", out);
    struct row r[8];
    int n = parse_rows(out, r, 8);
    cr_assert_eq(n, 6, "%s", out);
    /* 25 kv heads of rank 32 at 2 bits: 8 bytes of codes + 4 per unit and side */
    for (int i = 2; i < 6; i++) cr_assert_eq(r[i].kv, 2 * 25 * (8 + 4), "row %d: %g", i, r[i].kv);
    cr_assert(r[0].kv == 2 * 25 * 64 * 2 && r[1].kv == 2 * 25 * 64 * 4, "%s", out);
    free(out), free(err);
    rc = kvt_run_cli("bench-attn --synthetic gpt2-xl --device twin --ctx 64 --iters 1 --kv-bits 3 "
                     "--cache f32 --json", &out, &err);
    cr_assert_eq(rc, 0, "exit %d; stderr:\n%s", rc, err);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "%s: %s", je.text, out);
    cr_assert_eq(json_integer_value(json_object_get(o, "kv_bits")), 3);
    cr_assert_null(json_object_get(o, "note"));
    json_t *cfgs = json_object_get(o, "configs");
    for (int g = 0; g < 3; g++) {
        json_t *c = json_array_get(cfgs, (size_t)g);
        cr_assert_eq(json_integer_value(json_object_get(c, "kv_bits")), g ? 3 : 16, "%s", out);
        /* 3 bits x 32: 12 bytes of codes + 4 per unit and side, one layer */
        cr_assert_eq(json_integer_value(json_object_get(json_object_get(c, "kv_bytes_per_token"), "f32")),
                     g ? 2 * 25 * 16 : 2 * 25 * 64 * 4, "%s", out);
    }
    double kv = json_real_value(json_object_get(json_array_get(json_object_get(o, "rows"), 1),
                                                "kv_bytes_per_token_layer"));
    cr_assert_eq(kv, 2 * 25 * 16, "%s", out);
    json_decref(o);
    free(out), free(err);
}

Test(bench_cli, usage_errors) {
    expect_usage("bench-attn --device twin", "give exactly one of --synthetic or --manifest");
    expect_usage("bench-attn --synthetic llama7b --manifest x",
                 "give exactly one of --synthetic or --manifest");
    expect_usage("bench-attn --synthetic llama9",
                 "unknown preset 'llama9', expected one of llama7b, llama3-8b, gpt2-xl");
    expect_usage("bench-attn --synthetic llama7b --device gpu",
                 "--device 'gpu' is not one of cuda, twin");
    expect_usage("bench-attn --synthetic llama7b --ctx 1K,x",
                 "--ctx item 'x' is not a context length (an integer, K for 1024: 4096, 64K)");
    expect_usage("bench-attn --synthetic llama7b --ctx 2M",
                 "--ctx item '2M' is not a context length (an integer, K for 1024: 4096, 64K)");
    expect_usage("bench-attn --synthetic llama7b --ctx 1K,,2K",
                 "--ctx '1K,,2K' is not a list of context lengths (e.g. 1K,4096,64K)");
    expect_usage("bench-attn --synthetic llama7b --ctx 0", "--ctx length 0 is outside 1..1048575");
    expect_usage("bench-attn --synthetic llama7b --ctx 1024K",
                 "--ctx length 1048576 is outside 1..1048575");
    expect_usage("bench-attn --synthetic llama7b --keep 0", "--keep 0 is not within (0, 1]");
    expect_usage("bench-attn --synthetic llama7b --keep 1.5", "--keep 1.5 is not within (0, 1]");
    expect_usage("bench-attn --synthetic llama7b --cache f8",
                 "--cache 'f8' is not one of f16, f32, both");
    expect_usage("bench-attn --synthetic llama7b --iters 0", "--iters must be at least 1, got 0");
    expect_usage("bench-attn --synthetic llama7b --layers 0", "--layers must be at least 1, got 0");
    expect_usage("bench-attn --synthetic llama7b --kv-bits 5", "--kv-bits 5 is not one of 16, 8, 4, 3, 2");
    expect_usage("bench-attn --synthetic llama7b --kv-bits 0", "--kv-bits 0 is not one of 16, 8, 4, 3, 2");
    expect_usage("bench-attn --synthetic llama7b --kv-bits x", "option '--kv-bits' needs an integer, got 'x'");
    expect_usage("bench-attn --synthetic llama7b --bogus", "unknown option '--bogus'");
}

Test(bench_cli, help_and_command_list) {
    char *out, *err;
    cr_assert_eq(kvt_run_cli("bench-attn --help", &out, &err), 0);
    const char *usage = "usage: kvcal bench-attn (--synthetic PRESET | --manifest DIR) [options]\n";
    cr_assert(!strncmp(out, usage, strlen(usage)), "%s", out);
    cr_assert(strstr(out, "what is timed:") && strstr(out, "GB/s = bytes / µs/step / 1e3") &&
                  strstr(out, "speedup = µs/step of full") && strstr(out, "examples:") &&
                  strstr(out, "--ctx LIST") && strstr(out, "--kv-bits B") &&
                  strstr(out, "--synthetic llama3-8b --kv-bits 4"),
              "%s", out);
    cr_assert_str_eq(err, "");
    free(out), free(err);
    cr_assert_eq(kvt_run_cli("", &out, NULL), 0);
    cr_assert(strstr(out, "  bench-attn time one decode-attention step"), "%s", out);
    free(out);
}

/* Without a usable GPU the command fails with the runtime's own message. */
Test(bench_cli, cuda_without_a_gpu_is_an_error) {
    struct kv_err e;
    kv_err_clear(&e);
    int count = 0;
    int rc = kvrt_device_count(&count, &e);
    if (rc == KV_OK && count > 0)
        cr_skip_test("a cuda device is present; the no-gpu error is not reachable");
    char *out, *err, want[2400];
    int x = kvt_run_cli("bench-attn --synthetic gpt2-xl --ctx 64", &out, &err);
    cr_assert_eq(x, 1, "exit %d; stderr:\n%s", x, err);
    if (rc != KV_OK) {
        char buf[2200];
        kv_err_format(&e, buf, sizeof buf, 0);
        snprintf(want, sizeof want, "kvcal: %s\n", buf);
        if (!kvrt_cuda_built()) cr_assert(strstr(buf, "built without cuda"), "%s", buf);
    } else {
        snprintf(want, sizeof want,
                 "kvcal: no cuda device is visible (the driver reports none); "
                 "use --device twin for the cpu twin\n");
    }
    cr_assert_str_eq(err, want);
    cr_assert_str_eq(out, "");
    free(out), free(err);
}

/* Where kvcal looks for its cuda backend: a copy of the program in a
 * folder of its own (bin/kvcal) finds none and says where it looked; with
 * the backend put in ../lib (where make install puts it) it loads, and the
 * answer is the device's. */
Test(bench_cli, the_cuda_backend_is_found_in_lib_beside_bin) {
    if (!kvrt_cuda_built()) cr_skip_test("built without cuda; the loader never looks");
    const char *bin = getenv("KVCAL_BIN") && *getenv("KVCAL_BIN") ? getenv("KVCAL_BIN") : "build/kvcal";
    char *dir = kvt_temp_dir(), cmd[8192], so[4096], copy[4096];
    snprintf(so, sizeof so, "%s", bin);
    char *slash = strrchr(so, '/');
    snprintf(slash ? slash + 1 : so, sizeof so - (size_t)(slash ? slash + 1 - so : 0),
             "libkvrt_cuda.so");
    snprintf(copy, sizeof copy, "%s/bin/kvcal", dir);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/bin' '%s/lib' && cp '%s' '%s'", dir, dir, bin, copy);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    unsetenv("KVRT_CUDA_LIB");
    setenv("KVCAL_BIN", copy, 1);
    char *out, *err;
    int x = kvt_run_cli("bench-attn --synthetic gpt2-xl --ctx 64", &out, &err);
    cr_assert_eq(x, 1, "exit %d; stderr:\n%s", x, err);
    cr_assert_str_eq(err, "kvcal: cuda: cannot find the cuda backend libkvrt_cuda.so beside the "
                          "program, in ../lib or on the library path (set KVRT_CUDA_LIB to its "
                          "path)\n");
    free(out), free(err);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s/lib/'", so, dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    x = kvt_run_cli("bench-attn --synthetic gpt2-xl --ctx 64 --cache f32 --iters 1 --json", &out, &err);
    int count = 0;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kvrt_device_count(&count, &e), KV_OK, "%s", e.msg);
    if (count > 0) {
        cr_assert_eq(x, 0, "exit %d; stderr:\n%s", x, err);
    } else {
        cr_assert_eq(x, 1, "exit %d; stderr:\n%s", x, err);
        cr_assert_str_eq(err, "kvcal: no cuda device is visible (the driver reports none); "
                              "use --device twin for the cpu twin\n");
    }
    free(out), free(err);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    free(dir);
}
