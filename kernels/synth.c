/* Synthetic shapes for timing the runtime (kvrt.h, "synthetic shapes"):
 * random models of real attention shapes and random compressed attention
 * of every mode, built only from lib/.
 *
 * Factor values are uniform with variance 1/fan_in (the input width of the
 * product they enter), so that latents, rebuilt keys, scores and outputs
 * stay of order one, as in a trained model; biases are small (0.02). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "err.h"
#include "kvrt.h"
#include "lrmodel.h"
#include "model.h"

/* Positions of the learned position table of gpt2 models made here:
 * GPT-2 XL's own 1024. Only the attention of these models is timed and
 * the runtime never reads the table (learned positions are added before
 * the first layer), so longer contexts are timed all the same; a table for
 * 64K positions would cost 420 MB at d 1600. The forward pass
 * (kv_fwd_init) does hold a gpt2 model to its positions. */
#define SYNTH_GPT2_POSITIONS 1024

static const struct synth_preset {
    const char *name;
    enum kv_arch arch;
    int64_t dim, n_heads, n_kv_heads, head_dim, max_seq_len;
    float rope_theta;
} presets[] = {
    {"llama7b", KV_ARCH_LLAMA, 4096, 32, 32, 128, 4096, 1e4f},
    {"llama3-8b", KV_ARCH_LLAMA, 4096, 32, 8, 128, 8192, 5e5f},
    {"gpt2-xl", KV_ARCH_GPT2, 1600, 25, 25, 64, SYNTH_GPT2_POSITIONS, 0.0f},
};
#define N_PRESETS (sizeof presets / sizeof presets[0])

const char *const *kvrt_synth_presets(void) {
    static const char *names[N_PRESETS + 1];
    for (size_t i = 0; i < N_PRESETS; i++) names[i] = presets[i].name;
    names[N_PRESETS] = NULL;
    return names;
}

/* A small vocabulary and FFN: only the attention of these models is timed. */
static struct kv_config synth_config(enum kv_arch arch, int64_t n_layers, int64_t dim,
                                     int64_t n_heads, int64_t n_kv_heads, int64_t head_dim) {
    struct kv_config c = {0};
    c.arch = arch;
    c.dim = dim, c.hidden_dim = 64, c.n_layers = n_layers;
    c.n_heads = n_heads, c.n_kv_heads = n_kv_heads, c.head_dim = head_dim;
    c.vocab_size = 8, c.norm_eps = 1e-5f;
    c.rope_layout = KV_ROPE_HALF, c.rope_theta = 1e4f;
    const struct kv_arch_desc *a = kv_arch_desc(arch);
    c.has_qkv_bias = a->qkv_bias == KV_WUSE_REQUIRED;
    c.max_seq_len = a->rope ? 4096 : SYNTH_GPT2_POSITIONS;
    c.bos_id = c.eos_id = -1;
    return c;
}

int kvrt_synth_preset_valid(const char *name) {
    for (size_t i = 0; i < N_PRESETS; i++)
        if (name && !strcmp(name, presets[i].name)) return 1;
    return 0;
}

int kvrt_synth_model(const char *preset, int64_t n_layers, struct kv_model **out,
                     struct kv_err *err) {
    const struct synth_preset *p = NULL;
    for (size_t i = 0; i < N_PRESETS; i++)
        if (preset && !strcmp(preset, presets[i].name)) p = &presets[i];
    if (!p)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "preset '%.64s' is unknown, expected one of llama7b, llama3-8b, gpt2-xl",
                       preset ? preset : "");
    if (n_layers < 1 || n_layers > 1024)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "preset '%s' with %lld layers, expected 1..1024", p->name,
                       (long long)n_layers);
    struct kv_config c =
        synth_config(p->arch, n_layers, p->dim, p->n_heads, p->n_kv_heads, p->head_dim);
    c.max_seq_len = p->max_seq_len;
    if (kv_arch_has_rope(p->arch)) c.rope_theta = p->rope_theta;
    return kv_model_init_random(&c, 1, out, err);
}

/* ---------------------------------------------------------------- random factors */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n floats uniform in [-a, a] with a = sqrt(3 / fan_in) (variance 1/fan_in),
 * or with standard deviation 0.02 when fan_in is 0 (biases); NULL when out
 * of memory. */
static float *rand_floats(int64_t n, int64_t fan_in, uint64_t *s) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    if (!p) return NULL;
    double a = fan_in > 0 ? sqrt(3.0 / (double)fan_in) : 0.02 * sqrt(3.0);
    for (int64_t i = 0; i < n; i++) {
        double u = (double)(splitmix(s) >> 11) * 0x1.0p-53; /* [0, 1) */
        p[i] = (float)(a * (2 * u - 1));
    }
    return p;
}

/* Σ over query heads of the rank of the unit holding their KV head: the
 * columns of o_fused and the rows of q_fused. */
static int64_t fused_cols(const struct kv_lowrank *lr, const struct kv_lr_side *s) {
    int64_t grp = lr->info.n_heads / lr->info.n_kv_heads, cols = 0;
    for (int64_t u = 0; u < s->n_units; u++) cols += s->units[u].rank * s->units[u].n_heads * grp;
    return cols;
}

/* The factors side s's mode needs, for every unit (its pointers NULL before). */
static int fill_side(const struct kv_lowrank *lr, struct kv_lr_side *s, uint64_t *seed) {
    int64_t d = lr->info.dim, dh = lr->info.head_dim;
    for (int64_t u = 0; u < s->n_units; u++) {
        struct kv_lr_unit *x = &s->units[u];
        if (s->mode == KV_LR_POSTROPE_ROTATION) {
            if (!(x->rot = rand_floats(x->rank * dh, dh, seed))) return KV_ENOMEM;
        } else if (s->mode != KV_LR_FULL) {
            x->down = rand_floats(x->rank * d, d, seed);
            x->up = rand_floats(x->n_heads * dh * x->rank, x->rank, seed);
            if (!x->down || !x->up) return KV_ENOMEM;
        }
    }
    return KV_OK;
}

/* Every factor of layer l (pointers all NULL before), o_cols and q_cols
 * as the units give them; q_bias: fused_query gets a query bias. */
static int fill_layer(const struct kv_lowrank *lr, int64_t l, int q_bias, uint64_t *seed) {
    struct kv_lr_layer *y = &lr->layers[l];
    int64_t d = lr->info.dim;
    if (fill_side(lr, &y->k, seed) || fill_side(lr, &y->v, seed)) return KV_ENOMEM;
    if (y->v.mode == KV_LR_FUSED_OUTPUT) {
        y->o_cols = fused_cols(lr, &y->v);
        if (!(y->o_fused = rand_floats(d * y->o_cols, y->o_cols, seed))) return KV_ENOMEM;
    }
    if (y->k.mode == KV_LR_FUSED_QUERY) {
        y->q_cols = fused_cols(lr, &y->k);
        if (!(y->q_fused = rand_floats(y->q_cols * d, d, seed))) return KV_ENOMEM;
        if (q_bias && !(y->q_fused_bias = rand_floats(y->q_cols, 0, seed))) return KV_ENOMEM;
    }
    return KV_OK;
}

/* Postrope ranks around the mean r: alternately lo (0.5 r rounded to a
 * multiple of 8 when d_h is one) and hi = 2r - lo, at most d_h; with an odd
 * number of KV heads the last one keeps r, so the mean is exactly r. */
static void postrope_ranks(int64_t g, int64_t dh, int64_t r, int64_t *ranks) {
    int64_t step = dh % 8 == 0 && r >= 8 ? 8 : 1;
    int64_t lo = (int64_t)llround(0.5 * (double)r / (double)step) * step;
    if (lo < 1) lo = 1;
    int64_t hi = 2 * r - lo;
    if (hi > dh) hi = dh, lo = 2 * r - dh;
    if (lo >= r) lo = hi = r;
    for (int64_t j = 0; j < g; j++) ranks[j] = j == g - 1 && g % 2 ? r : (j % 2 ? hi : lo);
}

/* One unit per KV head with the given ranks (energy 1, dropped the
 * fraction of the head's width the rank leaves out). */
static int make_units(struct kv_lr_side *s, enum kv_lr_mode mode, int64_t g, int64_t dh,
                      const int64_t *ranks) {
    s->mode = mode;
    if (mode == KV_LR_FULL) return KV_OK;
    if (!(s->units = calloc((size_t)g, sizeof *s->units))) return KV_ENOMEM;
    s->n_units = g;
    for (int64_t j = 0; j < g; j++) {
        struct kv_lr_unit *x = &s->units[j];
        x->head0 = j, x->n_heads = 1, x->rank = ranks[j];
        x->energy = 1.0, x->dropped = 1.0 - (double)ranks[j] / (double)dh;
    }
    return KV_OK;
}

int kvrt_synth_lowrank(const struct kv_model *m, enum kv_lr_mode kmode, enum kv_lr_mode vmode,
                       double keep, uint64_t seed, struct kv_lowrank **out, struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    if (kmode != KV_LR_FULL && kmode != KV_LR_PREROPE_LATENT && kmode != KV_LR_FUSED_QUERY &&
        kmode != KV_LR_POSTROPE_ROTATION)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "key mode '%s' is not one of full, prerope_latent, fused_query, "
                       "postrope_rotation",
                       kv_lr_mode_name(kmode));
    if (vmode != KV_LR_FULL && vmode != KV_LR_FUSED_OUTPUT)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "value mode '%s' is not one of full, fused_output", kv_lr_mode_name(vmode));
    if (kmode == KV_LR_FUSED_QUERY && kv_arch_has_rope(c->arch))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "key mode 'fused_query' needs a model without rope, found arch '%s'",
                       kv_arch_name(c->arch));
    int rc = kvrt_bench_check_keep(keep, NULL, err);
    if (rc) return rc;
    int64_t L = c->n_layers, g = c->n_kv_heads, dh = c->head_dim;
    int64_t r = (int64_t)llround(keep * (double)dh);
    if (r < 1) r = 1;
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    int64_t *uni = malloc((size_t)g * sizeof *uni), *het = malloc((size_t)g * sizeof *het);
    if (!lr || !uni || !het) goto oom;
    snprintf(lr->info.method, sizeof lr->info.method, "synthetic");
    snprintf(lr->info.alloc, sizeof lr->info.alloc,
             kmode == KV_LR_POSTROPE_ROTATION ? "alternating" : "uniform");
    lr->info.n_layers = L, lr->info.dim = c->dim, lr->info.n_heads = c->n_heads;
    lr->info.n_kv_heads = g, lr->info.head_dim = dh;
    lr->info.kv_bits = 16, lr->info.hadamard = 0;
    for (int64_t j = 0; j < g; j++) uni[j] = r;
    postrope_ranks(g, dh, r, het);
    if (!(lr->layers = calloc((size_t)L, sizeof *lr->layers))) goto oom;
    uint64_t s = seed;
    for (int64_t l = 0; l < L; l++) {
        struct kv_lr_layer *y = &lr->layers[l];
        if (make_units(&y->k, kmode, g, dh, kmode == KV_LR_POSTROPE_ROTATION ? het : uni) ||
            make_units(&y->v, vmode, g, dh, uni) ||
            fill_layer(lr, l, kv_model_weight(m, KV_W_BQ, l) != NULL, &s))
            goto oom;
    }
    free(uni), free(het);
    *out = lr;
    return KV_OK;
oom:
    free(uni), free(het);
    kv_lr_free(lr);
    return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for synthetic factors");
}

/* The architecture a manifest's ranks are timed on: gpt2 when a layer has
 * fused_query keys (they need a model without rope), else llama. */
static int needs_gpt2(const struct kv_lowrank *lr) {
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        if (lr->layers[l].k.mode == KV_LR_FUSED_QUERY) return 1;
    return 0;
}

static int side_has_factors(const struct kv_lr_side *s) {
    for (int64_t u = 0; u < s->n_units; u++)
        if (s->units[u].down || s->units[u].down_bias || s->units[u].up || s->units[u].rot)
            return 1;
    return 0;
}

int kvrt_synth_fill_factors(struct kv_lowrank *lr, uint64_t seed, struct kv_err *err) {
    if (!lr->layers || lr->info.n_kv_heads < 1 || lr->info.n_heads % lr->info.n_kv_heads)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "compressed attention is not a manifest's: %s",
                       lr->layers ? "heads are not a multiple of kv heads" : "no layers");
    int gpt2 = needs_gpt2(lr);
    uint64_t s = seed;
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        struct kv_lr_layer *y = &lr->layers[l];
        if (side_has_factors(&y->k) || side_has_factors(&y->v) || y->o_fused || y->q_fused ||
            y->q_fused_bias)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "layer %lld already has factors, expected a manifest read alone",
                           (long long)l);
        int64_t o_cols = y->o_cols, q_cols = y->q_cols;
        if (fill_layer(lr, l, gpt2, &s))
            return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                           "out of memory for synthetic factors");
        if (y->v.mode == KV_LR_FUSED_OUTPUT && o_cols != y->o_cols)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "layer %lld: fused output has %lld columns, the units need %lld",
                           (long long)l, (long long)o_cols, (long long)y->o_cols);
        if (y->k.mode == KV_LR_FUSED_QUERY && q_cols != y->q_cols)
            return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                           "layer %lld: fused query has %lld rows, the units need %lld",
                           (long long)l, (long long)q_cols, (long long)y->q_cols);
    }
    return KV_OK;
}

/* The synthetic model timed for a manifest's shapes. */
static struct kv_config config_for(const struct kv_lowrank *lr) {
    return synth_config(needs_gpt2(lr) ? KV_ARCH_GPT2 : KV_ARCH_LLAMA, lr->info.n_layers, lr->info.dim,
                        lr->info.n_heads, lr->info.n_kv_heads, lr->info.head_dim);
}

int kvrt_synth_model_for(const struct kv_lowrank *lr, struct kv_model **out, struct kv_err *err) {
    struct kv_config c = config_for(lr);
    return kv_model_init_random(&c, 1, out, err);
}

int kvrt_synth_fits(const struct kv_lowrank *lr, struct kv_err *err) {
    struct kv_config c = config_for(lr);
    double need = 0, have = kvrt_mem_available();
    for (int k = 0; k < KV_W_COUNT; k++) {
        int attn = k == KV_W_Q || k == KV_W_K || k == KV_W_V || k == KV_W_O;
        /* fp32, the attention projections twice (the runtime's copy) */
        need += 4.0 * kv_model_random_elems(&c, k) * (attn ? 2 : 1);
    }
    if (have <= 0 || need <= 0.9 * have) return KV_OK;
    return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET,
                   "timing the manifest's shapes (dim %lld, %lld layers, %lld heads of %lld) needs "
                   "at least %.1f GiB for its synthetic weights, but %.1f GiB of memory is available",
                   (long long)c.dim, (long long)c.n_layers, (long long)c.n_heads, (long long)c.head_dim,
                   need / (1 << 30), have / (1 << 30));
}
