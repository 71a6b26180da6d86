/* The compressed-attention description (struct kv_lowrank): lifetime and
 * KV byte accounting. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "linalg.h"
#include "lrmodel.h"
#include "model.h"

const char *kv_lr_mode_name(enum kv_lr_mode m) {
    switch (m) {
    case KV_LR_FULL: return "full";
    case KV_LR_PREROPE_LATENT: return "prerope_latent";
    case KV_LR_FUSED_QUERY: return "fused_query";
    case KV_LR_FUSED_OUTPUT: return "fused_output";
    case KV_LR_POSTROPE_ROTATION: return "postrope_rotation";
    }
    return "?";
}

static void side_free(struct kv_lr_side *s) {
    for (int64_t u = 0; u < s->n_units; u++) {
        struct kv_lr_unit *x = &s->units[u];
        free(x->down), free(x->down_bias), free(x->up), free(x->up_bias), free(x->rot);
    }
    free(s->units);
}

static void layer_free(struct kv_lr_layer *L) {
    side_free(&L->k);
    side_free(&L->v);
    free(L->o_fused);
    free(L->o_fused_bias);
    free(L->q_fused), free(L->q_fused_bias);
    memset(L, 0, sizeof *L);
}

void kv_lr_free(struct kv_lowrank *lr) {
    if (!lr) return;
    for (int64_t l = 0; lr->layers && l < lr->info.n_layers; l++) layer_free(&lr->layers[l]);
    free(lr->layers);
    free(lr);
}

int64_t kv_lr_base_bytes(const struct kv_config *cfg) {
    return cfg->n_layers * 2 * cfg->n_kv_heads * cfg->head_dim * 2;
}

int64_t kv_lr_unit_bytes(int64_t rank, int kv_bits) {
    if (kv_bits >= 16) return 2 * rank;
    return (rank * kv_bits + 7) / 8 + 4; /* packed codes + fp16 scale + fp16 zero */
}

void kv_lr_qparams(const float *z, int64_t r, int bits, float *scale, float *zero) {
    float lo = z[0], hi = z[0];
    for (int64_t j = 1; j < r; j++) lo = z[j] < lo ? z[j] : lo, hi = z[j] > hi ? z[j] : hi;
    *zero = kv_f16_to_f32(kv_f32_to_f16(lo));
    *scale = kv_f16_to_f32(kv_f32_to_f16((hi - *zero) / kv_lr_qmax(bits)));
}

int kv_lr_bits_valid(int64_t kv_bits) {
    return kv_bits == 16 || kv_bits == 8 || kv_bits == 4 || kv_bits == 3 || kv_bits == 2;
}

int kv_lr_unit_bands(const struct kv_lr_unit *un, int kv_bits, struct kv_lr_band out[KV_LR_MAX_BANDS]) {
    if (kv_bits == KV_LR_BITS_MIXED) {
        KV_ASSERT(un->n_bands >= 1 && un->n_bands <= KV_LR_MAX_BANDS);
        for (int i = 0; i < un->n_bands; i++) out[i] = un->bands[i];
        return un->n_bands;
    }
    out[0] = (struct kv_lr_band){un->rank, kv_bits};
    return 1;
}

int64_t kv_lr_bands_bytes(const struct kv_lr_band *b, int n) {
    int64_t bytes = 0;
    for (int i = 0; i < n; i++) bytes += kv_lr_unit_bytes(b[i].n, b[i].bits);
    return bytes;
}

int64_t kv_lr_unit_bytes_at(const struct kv_lr_unit *un, int kv_bits) {
    struct kv_lr_band b[KV_LR_MAX_BANDS];
    return kv_lr_bands_bytes(b, kv_lr_unit_bands(un, kv_bits, b));
}

int kv_lr_bands_check(const struct kv_lr_band *b, int n, int64_t r, char *why, size_t why_len) {
    if (n < 1 || n > KV_LR_MAX_BANDS) {
        snprintf(why, why_len, "%d bands, expected 1 .. %d", n, KV_LR_MAX_BANDS);
        return KV_EINVAL;
    }
    int64_t sum = 0;
    for (int i = 0; i < n; i++) {
        if (!kv_lr_bits_valid(b[i].bits)) {
            snprintf(why, why_len, "band %d: bits %d is not one of " KV_LR_BITS_LIST, i, b[i].bits);
            return KV_EINVAL;
        }
        if (i > 0 && b[i].bits >= b[i - 1].bits) {
            snprintf(why, why_len, "band %d: bits %d after %d, expected strictly falling bits", i,
                     b[i].bits, b[i - 1].bits);
            return KV_EINVAL;
        }
        if (b[i].n < 1 || b[i].n > r) {
            snprintf(why, why_len, "band %d: n %lld is not within 1..%lld", i, (long long)b[i].n,
                     (long long)r);
            return KV_EINVAL;
        }
        sum += b[i].n;
    }
    if (sum != r) {
        snprintf(why, why_len, "bands hold %lld coordinates but the rank is %lld", (long long)sum,
                 (long long)r);
        return KV_EINVAL;
    }
    return KV_OK;
}

int kv_lr_check_all_bands(const struct kv_lowrank *lr, const char *path, struct kv_err *err) {
    for (int64_t l = 0; lr->info.kv_bits == KV_LR_BITS_MIXED && l < lr->info.n_layers; l++)
        for (int w = 0; w < 2; w++) {
            const struct kv_lr_side *sd = kv_lr_side(lr, l, w);
            for (int64_t u = 0; sd->mode != KV_LR_FULL && u < sd->n_units; u++) {
                char why[160];
                const struct kv_lr_unit *un = &sd->units[u];
                if (kv_lr_bands_check(un->bands, un->n_bands, un->rank, why, sizeof why))
                    return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET, "layer %lld %c unit %lld: %s",
                                   (long long)l, w ? 'v' : 'k', (long long)u, why);
            }
        }
    return KV_OK;
}

int64_t kv_lr_side_bytes(const struct kv_lowrank *lr, int64_t l, int which, int kv_bits) {
    const struct kv_lr_side *s = kv_lr_side(lr, l, which);
    if (s->mode == KV_LR_FULL) return lr->info.n_kv_heads * lr->info.head_dim * 2;
    int64_t b = 0;
    for (int64_t u = 0; u < s->n_units; u++) b += kv_lr_unit_bytes_at(&s->units[u], kv_bits);
    return b;
}

int64_t kv_lr_bytes(const struct kv_lowrank *lr, int kv_bits) {
    int64_t b = 0;
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        b += kv_lr_side_bytes(lr, l, 0, kv_bits) + kv_lr_side_bytes(lr, l, 1, kv_bits);
    return b;
}

struct kv_lr_info kv_lr_info(const struct kv_lowrank *lr) { return lr->info; }

enum kv_lr_mode kv_lr_mode_of(const struct kv_lowrank *lr, int64_t l, int which) {
    KV_ASSERT(l >= 0 && l < lr->info.n_layers);
    return kv_lr_side(lr, l, which)->mode;
}

int64_t kv_lr_n_units(const struct kv_lowrank *lr, int64_t l, int which) {
    KV_ASSERT(l >= 0 && l < lr->info.n_layers);
    return kv_lr_side(lr, l, which)->n_units;
}

struct kv_lr_unit_info kv_lr_unit_info(const struct kv_lowrank *lr, int64_t l, int which,
                                       int64_t u) {
    KV_ASSERT(l >= 0 && l < lr->info.n_layers);
    const struct kv_lr_side *s = kv_lr_side(lr, l, which);
    KV_ASSERT(u >= 0 && u < s->n_units);
    const struct kv_lr_unit *x = &s->units[u];
    struct kv_lr_unit_info ui = {x->head0, x->n_heads, x->rank, x->energy, x->dropped, x->n_bands, {{0, 0}}};
    for (int i = 0; i < x->n_bands && i < KV_LR_MAX_BANDS; i++) ui.bands[i] = x->bands[i];
    return ui;
}

double kv_lr_side_error(const struct kv_lowrank *lr, int64_t l, int which, double *energy,
                        double *dropped) {
    const struct kv_lr_side *s = kv_lr_side(lr, l, which);
    double e = 0, d = 0;
    for (int64_t u = 0; u < s->n_units; u++) e += s->units[u].energy, d += s->units[u].dropped;
    if (energy) *energy += e;
    if (dropped) *dropped += d;
    return e > 0 ? d / e : 0;
}

int kv_lr_set_kv_bits(struct kv_lowrank *lr, int kv_bits, struct kv_err *err) {
    if (!kv_lr_bits_valid(kv_bits))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "latent bits %d is not one of %s",
                       kv_bits, KV_LR_BITS_LIST);
    lr->info.kv_bits = kv_bits;
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int w = 0; w < 2; w++) {
            struct kv_lr_side *s = kv_lr_side(lr, l, w);
            for (int64_t u = 0; u < s->n_units; u++) s->units[u].n_bands = 0;
        }
    return KV_OK;
}

int kv_lr_truncate(struct kv_lowrank *lr, int64_t n_layers, struct kv_err *err) {
    if (n_layers < 1 || n_layers > lr->info.n_layers)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "%lld layers is outside 1..%lld, the compressed model's layers",
                       (long long)n_layers, (long long)lr->info.n_layers);
    for (int64_t l = n_layers; lr->layers && l < lr->info.n_layers; l++) layer_free(&lr->layers[l]);
    lr->info.n_layers = n_layers;
    return KV_OK;
}

/* a [rows, r] (leading dim ld) = a H, in float64, rounded once. */
static void right_mul(float *a, int64_t rows, int64_t ld, int64_t r, const double *H, double *tmp) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < r; j++) tmp[i * r + j] = (double)a[i * ld + j];
    double *out = tmp + rows * r;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)r, (int)r, 1.0, tmp,
                (int)r, H, (int)r, 0.0, out, (int)r);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < r; j++) a[i * ld + j] = (float)out[i * r + j];
}

/* b [r, cols] = Hᵀ b, in float64, rounded once. */
static void left_mul_t(float *b, int64_t r, int64_t cols, const double *H, double *tmp) {
    for (int64_t i = 0; i < r * cols; i++) tmp[i] = (double)b[i];
    double *out = tmp + r * cols;
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)r, (int)cols, (int)r, 1.0, H, (int)r,
                tmp, (int)cols, 0.0, out, (int)cols);
    for (int64_t i = 0; i < r * cols; i++) b[i] = (float)out[i];
}

/* The unit of side s holding KV head j, or NULL. */
static const struct kv_lr_unit *unit_of_head(const struct kv_lr_side *s, int64_t j) {
    for (int64_t u = 0; u < s->n_units; u++)
        if (j >= s->units[u].head0 && j < s->units[u].head0 + s->units[u].n_heads)
            return &s->units[u];
    return NULL;
}

void kv_lr_unit_hadamard(const struct kv_lr_unit *un, double *h) {
    int64_t r = un->rank;
    if (un->n_bands < 1) {
        kv_la_hadamard(r, h);
        return;
    }
    memset(h, 0, (size_t)(r * r) * sizeof *h);
    int64_t at = 0;
    for (int i = 0; i < un->n_bands; i++) {
        int64_t n = un->bands[i].n;
        double *blk = h + at * r + at; /* the band's n×n block, filled in place below */
        kv_la_hadamard(n, blk);        /* row-major n×n at blk, spread to stride r next */
        for (int64_t a = n - 1; a >= 0; a--)
            for (int64_t b = n - 1; b >= 0; b--) {
                double v = blk[a * n + b];
                blk[a * n + b] = 0;
                blk[a * r + b] = v;
            }
        at += n;
    }
}

int kv_lr_fuse_hadamard(struct kv_lowrank *lr, struct kv_err *err) {
    if (lr->info.hadamard)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "a hadamard rotation is already fused in");
    int64_t rmax = 1, d = lr->info.dim, dh = lr->info.head_dim;
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int s = 0; s < 2; s++) {
            const struct kv_lr_side *sd = s ? &lr->layers[l].v : &lr->layers[l].k;
            for (int64_t u = 0; u < sd->n_units; u++) rmax = sd->units[u].rank > rmax ? sd->units[u].rank : rmax;
        }
    double *H = malloc((size_t)(rmax * rmax) * sizeof *H);
    int64_t rows = d > lr->info.n_kv_heads * dh ? d : lr->info.n_kv_heads * dh; /* longest factor side */
    double *tmp = malloc((size_t)(2 * rows * rmax) * sizeof *tmp);
    if (!H || !tmp) {
        free(H), free(tmp);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    int64_t grp = lr->info.n_heads / lr->info.n_kv_heads;
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        struct kv_lr_layer *L = &lr->layers[l];
        for (int s = 0; s < 2; s++) {
            struct kv_lr_side *sd = s ? &L->v : &L->k;
            if (sd->mode == KV_LR_FULL) continue;
            for (int64_t u = 0; u < sd->n_units; u++) {
                struct kv_lr_unit *un = &sd->units[u];
                int64_t r = un->rank;
                kv_lr_unit_hadamard(un, H);
                /* z' = z H: down' = Hᵀ down, c' = Hᵀ c, rot' = Hᵀ rot; up' = up H */
                if (un->down) left_mul_t(un->down, r, d, H, tmp);
                if (un->down_bias) left_mul_t(un->down_bias, r, 1, H, tmp);
                if (un->rot) left_mul_t(un->rot, r, dh, H, tmp);
                if (un->up) right_mul(un->up, un->n_heads * dh, r, r, H, tmp);
            }
            float *fused = s ? L->o_fused : L->q_fused;
            int64_t off = 0;
            for (int64_t i = 0; fused && i < lr->info.n_heads; i++) {
                const struct kv_lr_unit *un = unit_of_head(sd, i / grp);
                if (!un) break;
                kv_lr_unit_hadamard(un, H);
                if (s) { /* each query head's block of the fused output reads z: O' = O H */
                    right_mul(L->o_fused + off, d, L->o_cols, un->rank, H, tmp);
                } else { /* q'·z = (q' H)·(z H): block' [r, d] = Hᵀ block, bias' = Hᵀ bias */
                    left_mul_t(L->q_fused + off * d, un->rank, d, H, tmp);
                    if (L->q_fused_bias) left_mul_t(L->q_fused_bias + off, un->rank, 1, H, tmp);
                }
                off += un->rank;
            }
        }
    }
    free(H), free(tmp);
    lr->info.hadamard = 1;
    return KV_OK;
}
