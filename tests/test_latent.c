/* The latent-cache forward pass (lib/forward.c's kv_fwd_set_lowrank,
 * kv_ppl_compare) on factors from kv_decompose:
 *
 *   latent_forward      the latent cache equals the plain forward of a dense
 *                       model whose K/V weights are up·down, and a naive
 *                       float64 forward of it (post-RoPE rotations: scores
 *                       q rotᵀ rot kᵀ); quantized latents degrade gracefully. */
#include "decompose_fixtures.h"

/* ================================================================ latent forward */

/* A model with the same random weights as random_model(layout, bias, seed)
 * whose K and V projections are replaced, for every latent side of lr, by
 * W = up·down and b = up·down_bias (float64 products rounded once). */
static struct kv_model *dense_copy(enum kv_rope_layout layout, int bias, uint64_t seed,
                                   const struct kv_lowrank *lr) {
    struct kv_model *m2 = random_model(layout, bias, seed);
    const struct kv_config *c = kv_model_config(m2);
    int64_t d = c->dim, dh = c->head_dim;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int side = 0; side < 2; side++) {
            const struct kv_lr_side *sd = side_of(lr, l, side);
            if (sd->mode != KV_LR_PREROPE_LATENT && sd->mode != KV_LR_FUSED_OUTPUT) continue;
            /* init_random weights are owned heap blocks */
            float *W = (float *)m2->layers[l].w[side ? KV_W_V : KV_W_K];
            float *B = (float *)m2->layers[l].w[side ? KV_W_BV : KV_W_BK];
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *un = &sd->units[u];
                int64_t mm = un->n_heads * dh, r = un->rank, row0 = un->head0 * dh;
                cr_assert_eq(B != NULL, un->down_bias != NULL, "layer %lld: bias and down_bias",
                             (long long)l);
                for (int64_t a = 0; a < mm; a++) {
                    for (int64_t j = 0; j < d; j++) {
                        double p = 0;
                        for (int64_t k = 0; k < r; k++)
                            p += (double)un->up[a * r + k] * un->down[k * d + j];
                        W[(row0 + a) * d + j] = (float)p;
                    }
                    if (B) {
                        double p = 0;
                        for (int64_t k = 0; k < r; k++) p += (double)un->up[a * r + k] * un->down_bias[k];
                        B[row0 + a] = (float)p;
                    }
                }
            }
        }
    return m2;
}

Test(latent_forward, prerope_latent_and_fused_output_equal_the_dense_model, .timeout = 120) {
    struct {
        enum kv_rope_layout layout;
        int bias;
    } models[] = {{KV_ROPE_INTERLEAVED, 0}, {KV_ROPE_HALF, 1}};
    struct {
        enum kv_method method;
        int64_t group;
        int with_stats;
    } cases[] = {{KV_METHOD_PALU, 1, 1}, {KV_METHOD_PALU, 2, 1}, {KV_METHOD_EIGEN, 1, 1},
                 {KV_METHOD_SVD, 1, 0}, {KV_METHOD_LORC, 1, 0}};
    int64_t n = 48, V = 97;
    for (size_t mi = 0; mi < 2; mi++) {
        uint64_t seed = 31 + mi;
        struct kv_model *m = random_model(models[mi].layout, models[mi].bias, seed);
        int32_t *cal = random_tokens(3 * 64, V, 100 + mi), *tok = random_tokens(n, V, 200 + mi);
        struct kv_stats *s = collect(m, cal, 64, 3);
        float *plain = run_logits(m, NULL, 16, tok, n);
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            char what[128];
            snprintf(what, sizeof what, "%s group %lld, %s rope%s", kv_method_name(cases[ci].method),
                     (long long)cases[ci].group, models[mi].layout ? "half" : "interleaved",
                     models[mi].bias ? " + bias" : "");
            struct kv_lowrank *lr =
                decompose_ok(m, cases[ci].with_stats ? s : NULL,
                             opts_of(cases[ci].method, KV_ALLOC_DEFAULT, 0, 0.5, cases[ci].group), what);
            cr_assert_eq(lr->layers[0].k.mode, KV_LR_PREROPE_LATENT);
            cr_assert_eq(lr->layers[0].v.mode, KV_LR_FUSED_OUTPUT);
            float *lat = run_logits(m, lr, 16, tok, n);
            struct kv_model *m2 = dense_copy(models[mi].layout, models[mi].bias, seed, lr);
            float *dense = run_logits(m2, NULL, 16, tok, n);
            double scale = max_abs_f32(dense, n * V);
            /* the compression is visible in the logits, so the comparison bites */
            cr_assert_gt(max_abs_diff_f32(plain, dense, n * V), 1e-3 * scale, "%s: no effect", what);
            char w2[192];
            snprintf(w2, sizeof w2, "%s: latent cache vs dense model", what);
            kvt_assert_close_f32(lat, dense, n * V, 1e-4 * scale, 0, w2);
            double *nv = naive_forward(m2, tok, n);
            double *latd = malloc((size_t)(n * V) * sizeof *latd);
            for (int64_t i = 0; i < n * V; i++) latd[i] = lat[i];
            snprintf(w2, sizeof w2, "%s: latent cache vs naive float64 dense model", what);
            kvt_assert_close_f64(latd, nv, n * V, 1e-4 * scale, 0, w2);
            free(nv), free(latd), free(lat), free(dense);
            kv_model_close(m2);
            kv_lr_free(lr);
        }
        free(plain), free(cal), free(tok);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

/* Naive float64 forward from the Llama definition where the post-RoPE key of
 * KV head j in layer l is replaced by k P (P = kproj[l] + j·d_h², row-major,
 * or kproj[l] NULL to leave the layer's keys alone). */
static double *naive_forward_kproj(const struct kv_model *m, const int32_t *tok, int64_t n,
                                   double *const *kproj) {
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, h = c->n_heads, g = c->n_kv_heads, dh = c->head_dim, hid = c->hidden_dim;
    int64_t V = c->vocab_size, qd = h * dh, kd = g * dh;
    double *x = calloc((size_t)(n * d), sizeof *x), *xn = calloc((size_t)(n * d), sizeof *xn);
    double *q = calloc((size_t)(n * qd), sizeof *q), *k = calloc((size_t)(n * kd), sizeof *k);
    double *v = calloc((size_t)(n * kd), sizeof *v), *o = calloc((size_t)(n * qd), sizeof *o);
    double *p = calloc((size_t)n, sizeof *p), *tmp = calloc((size_t)dh, sizeof *tmp);
    double *a = calloc((size_t)hid, sizeof *a), *out = calloc((size_t)(n * V), sizeof *out);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++) x[t * d + j] = m->tok_emb[(int64_t)tok[t] * d + j];
    for (int64_t l = 0; l <= c->n_layers; l++) {
        const float *const *w = l < c->n_layers ? m->layers[l].w : NULL;
        const float *nw = w ? w[KV_W_ATTN_NORM] : m->out_norm;
        for (int64_t t = 0; t < n; t++) {
            double ss = 0;
            for (int64_t j = 0; j < d; j++) ss += x[t * d + j] * x[t * d + j];
            double rs = 1.0 / sqrt(ss / (double)d + (double)c->norm_eps);
            for (int64_t j = 0; j < d; j++) xn[t * d + j] = x[t * d + j] * rs * nw[j];
        }
        if (!w) break;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t r = 0; r < qd; r++) {
                double acc = w[KV_W_BQ] ? w[KV_W_BQ][r] : 0;
                for (int64_t j = 0; j < d; j++) acc += (double)w[KV_W_Q][r * d + j] * xn[t * d + j];
                q[t * qd + r] = acc;
            }
            for (int64_t r = 0; r < kd; r++) {
                double ak = w[KV_W_BK] ? w[KV_W_BK][r] : 0, av = w[KV_W_BV] ? w[KV_W_BV][r] : 0;
                for (int64_t j = 0; j < d; j++) {
                    ak += (double)w[KV_W_K][r * d + j] * xn[t * d + j];
                    av += (double)w[KV_W_V][r * d + j] * xn[t * d + j];
                }
                k[t * kd + r] = ak, v[t * kd + r] = av;
            }
            /* RoPE on every head of q and k at position t */
            for (int which = 0; which < 2; which++) {
                double *base = which ? k + t * kd : q + t * qd;
                for (int64_t hh = 0; hh < (which ? g : h); hh++)
                    for (int64_t i = 0; i < dh / 2; i++) {
                        int64_t ia = c->rope_layout == KV_ROPE_HALF ? i : 2 * i;
                        int64_t ib = c->rope_layout == KV_ROPE_HALF ? i + dh / 2 : 2 * i + 1;
                        double ang = (double)t * pow((double)c->rope_theta, -2.0 * (double)i / (double)dh);
                        double *e = base + hh * dh, re = e[ia], im = e[ib];
                        e[ia] = re * cos(ang) - im * sin(ang);
                        e[ib] = re * sin(ang) + im * cos(ang);
                    }
            }
            if (kproj[l])
                for (int64_t j = 0; j < g; j++) {
                    const double *P = kproj[l] + j * dh * dh;
                    double *kj = k + t * kd + j * dh;
                    for (int64_t b = 0; b < dh; b++) {
                        tmp[b] = 0;
                        for (int64_t e = 0; e < dh; e++) tmp[b] += kj[e] * P[e * dh + b];
                    }
                    memcpy(kj, tmp, (size_t)dh * sizeof *tmp);
                }
        }
        for (int64_t hh = 0; hh < h; hh++) {
            int64_t j = hh / (h / g);
            for (int64_t t = 0; t < n; t++) {
                double mx = -INFINITY, zs = 0;
                for (int64_t s2 = 0; s2 <= t; s2++) {
                    double dot = 0;
                    for (int64_t i = 0; i < dh; i++) dot += q[t * qd + hh * dh + i] * k[s2 * kd + j * dh + i];
                    p[s2] = dot / sqrt((double)dh);
                    mx = fmax(mx, p[s2]);
                }
                for (int64_t s2 = 0; s2 <= t; s2++) zs += p[s2] = exp(p[s2] - mx);
                for (int64_t i = 0; i < dh; i++) {
                    double acc = 0;
                    for (int64_t s2 = 0; s2 <= t; s2++) acc += p[s2] / zs * v[s2 * kd + j * dh + i];
                    o[t * qd + hh * dh + i] = acc;
                }
            }
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < d; r++) {
                double acc = 0;
                for (int64_t j = 0; j < qd; j++) acc += (double)w[KV_W_O][r * qd + j] * o[t * qd + j];
                x[t * d + r] += acc;
            }
        for (int64_t t = 0; t < n; t++) {
            double ss = 0;
            for (int64_t j = 0; j < d; j++) ss += x[t * d + j] * x[t * d + j];
            double rs = 1.0 / sqrt(ss / (double)d + (double)c->norm_eps);
            for (int64_t j = 0; j < d; j++) xn[t * d + j] = x[t * d + j] * rs * w[KV_W_FFN_NORM][j];
            for (int64_t r = 0; r < hid; r++) {
                double gt = 0, up = 0;
                for (int64_t j = 0; j < d; j++) {
                    gt += (double)w[KV_W_GATE][r * d + j] * xn[t * d + j];
                    up += (double)w[KV_W_UP][r * d + j] * xn[t * d + j];
                }
                a[r] = gt / (1.0 + exp(-gt)) * up;
            }
            for (int64_t r = 0; r < d; r++) {
                double acc = 0;
                for (int64_t j = 0; j < hid; j++) acc += (double)w[KV_W_DOWN][r * hid + j] * a[j];
                x[t * d + r] += acc;
            }
        }
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < V; r++) {
            double acc = 0;
            for (int64_t j = 0; j < d; j++) acc += (double)m->lm_head[r * d + j] * xn[t * d + j];
            out[t * V + r] = acc;
        }
    free(x), free(xn), free(q), free(k), free(v), free(o), free(p), free(tmp), free(a);
    return out;
}

Test(latent_forward, postrope_rotation_scores_are_q_rot_rot_k, .timeout = 120) {
    struct {
        enum kv_rope_layout layout;
        int bias;
    } models[] = {{KV_ROPE_INTERLEAVED, 0}, {KV_ROPE_HALF, 1}};
    enum kv_method methods[] = {KV_METHOD_FDC, KV_METHOD_ZACK};
    int64_t n = 48, V = 97;
    for (size_t mi = 0; mi < 2; mi++) {
        uint64_t seed = 41 + mi;
        struct kv_model *m = random_model(models[mi].layout, models[mi].bias, seed);
        const struct kv_config *c = kv_model_config(m);
        int64_t L = c->n_layers, g = c->n_kv_heads, dh = c->head_dim;
        int32_t *cal = random_tokens(3 * 64, V, 300 + mi), *tok = random_tokens(n, V, 400 + mi);
        struct kv_stats *s = collect(m, cal, 64, 3);
        /* the oracle itself: no projection is the plain naive forward */
        double *none[4] = {NULL, NULL, NULL, NULL};
        double *o1 = naive_forward_kproj(m, tok, n, none), *o2 = naive_forward(m, tok, n);
        kvt_assert_close_f64(o1, o2, n * V, 1e-9, 1e-9, "naive oracle without projection");
        free(o1), free(o2);
        for (size_t ci = 0; ci < 2; ci++) {
            char what[96];
            snprintf(what, sizeof what, "%s, %s rope%s", kv_method_name(methods[ci]),
                     models[mi].layout ? "half" : "interleaved", models[mi].bias ? " + bias" : "");
            struct kv_lowrank *lr =
                decompose_ok(m, s, opts_of(methods[ci], KV_ALLOC_DEFAULT, 0, 0.5, 1), what);
            double *P[4] = {NULL, NULL, NULL, NULL};
            int64_t reduced = 0;
            cr_assert(L <= 4);
            for (int64_t l = 0; l < L; l++) {
                const struct kv_lr_side *sd = &lr->layers[l].k;
                cr_assert_eq(sd->mode, KV_LR_POSTROPE_ROTATION, "%s", what);
                cr_assert_eq(lr->layers[l].v.mode, KV_LR_FUSED_OUTPUT, "%s", what);
                cr_assert_eq(sd->n_units, g);
                P[l] = calloc((size_t)(g * dh * dh), sizeof(double));
                for (int64_t u = 0; u < g; u++) {
                    const struct kv_lr_unit *un = &sd->units[u];
                    cr_assert_eq(un->n_heads, 1);
                    reduced += un->rank < dh;
                    double *Pj = P[l] + un->head0 * dh * dh; /* rotᵀ rot */
                    for (int64_t a = 0; a < dh; a++)
                        for (int64_t b = 0; b < dh; b++)
                            for (int64_t i = 0; i < un->rank; i++)
                                Pj[a * dh + b] += (double)un->rot[i * dh + a] * un->rot[i * dh + b];
                }
            }
            cr_assert_gt(reduced, 0, "%s: no key rotation drops a direction", what);
            /* values are latent: the oracle runs the dense model for them */
            struct kv_model *m2 = dense_copy(models[mi].layout, models[mi].bias, seed, lr);
            double *ref = naive_forward_kproj(m2, tok, n, P);
            float *lat = run_logits(m, lr, 16, tok, n);
            double scale = 0;
            for (int64_t i = 0; i < n * V; i++) scale = fmax(scale, fabs(ref[i]));
            double *latd = malloc((size_t)(n * V) * sizeof *latd);
            for (int64_t i = 0; i < n * V; i++) latd[i] = lat[i];
            char w2[160];
            snprintf(w2, sizeof w2, "%s: latent cache vs naive q rotᵀ rot kᵀ", what);
            kvt_assert_close_f64(latd, ref, n * V, 1e-4 * scale, 0, w2);
            /* and the rotation matters: the plain dense model differs */
            double *plain = naive_forward(m2, tok, n), diff = 0;
            for (int64_t i = 0; i < n * V; i++) diff = fmax(diff, fabs(plain[i] - ref[i]));
            cr_assert_gt(diff, 1e-3 * scale, "%s: the key rotation has no effect", what);
            free(plain), free(latd), free(lat), free(ref);
            for (int64_t l = 0; l < L; l++) free(P[l]);
            kv_model_close(m2);
            kv_lr_free(lr);
        }
        free(cal), free(tok);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

Test(latent_forward, incremental_latent_cache_equals_whole_window) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 51);
    int64_t n = 40, V = 97;
    int32_t *cal = random_tokens(3 * 64, V, 500), *tok = random_tokens(n, V, 501);
    struct kv_stats *s = collect(m, cal, 64, 3);
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC};
    int bits[] = {16, 8};
    struct kv_err err;
    kv_err_clear(&err);
    for (int mi = 0; mi < 2; mi++)
        for (int bi = 0; bi < 2; bi++) {
            struct kv_lowrank *lr =
                decompose_ok(m, s, opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1), "incremental");
            float *whole = run_logits(m, lr, bits[bi], tok, n);
            struct kv_fwd *f;
            cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
            cr_assert_eq(kv_fwd_set_lowrank(f, lr, bits[bi], &err), KV_OK, "%s", fmt_err(&err));
            float *step = malloc((size_t)(n * V) * sizeof *step);
            /* prefill 25, then 10, then one token at a time */
            cr_assert_eq(kv_fwd_run(f, tok, 25, 0, step, &err), KV_OK, "%s", fmt_err(&err));
            cr_assert_eq(kv_fwd_run(f, tok + 25, 10, 25, step + 25 * V, &err), KV_OK);
            for (int64_t p = 35; p < n; p++)
                cr_assert_eq(kv_fwd_run(f, tok + p, 1, p, step + p * V, &err), KV_OK);
            char what[96];
            snprintf(what, sizeof what, "%s kv_bits %d: incremental latent logits",
                     kv_method_name(methods[mi]), bits[bi]);
            kvt_assert_close_f32(step, whole, n * V, 1e-5 * max_abs_f32(whole, n * V), 1e-4, what);
            /* NULL restores the full path exactly */
            cr_assert_eq(kv_fwd_set_lowrank(f, NULL, 16, &err), KV_OK);
            cr_assert_eq(kv_fwd_run(f, tok, n, 0, step, &err), KV_OK);
            float *plain = run_logits(m, NULL, 16, tok, n);
            cr_assert(!memcmp(step, plain, (size_t)(n * V) * sizeof *step),
                      "set_lowrank(NULL) does not restore the plain forward");
            free(plain), free(step), free(whole);
            kv_fwd_free(f);
            kv_lr_free(lr);
        }
    free(cal), free(tok);
    kv_stats_free(s);
    kv_model_close(m);
}

Test(latent_forward, rejects_another_models_factors_and_bad_bits) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 0, 52);
    struct kv_config c2 = tiny_cfg(KV_ROPE_HALF, 0, 1);
    c2.dim = 64;
    struct kv_model *m2 = random_model_cfg(c2, 53);
    struct kv_lowrank *lr =
        decompose_ok(m2, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1), "svd");
    struct kv_lowrank *lr1 =
        decompose_ok(m, NULL, opts_of(KV_METHOD_SVD, KV_ALLOC_DEFAULT, 0, 0.5, 1), "svd");
    struct kv_fwd *f;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_fwd_init(m, 8, &f, &err), KV_OK);
    cr_assert_eq(kv_fwd_set_lowrank(f, lr, 16, &err), KV_EINVAL);
    cr_assert(strstr(err.msg, "compressed attention factors are for 2 layers, dim 64") && strstr(err.msg, "but the model has 2 layers, dim 48"), "%s", err.msg);
    for (int bits = 0; bits <= 17; bits++) {
        int ok = bits == 16 || bits == 8 || bits == 4 || bits == 3 || bits == 2;
        kv_err_clear(&err);
        cr_assert_eq(kv_fwd_set_lowrank(f, lr1, bits, &err), ok ? KV_OK : KV_EINVAL, "bits %d", bits);
        if (!ok) cr_assert(strstr(err.msg, "bits"), "%s", err.msg);
    }
    kv_fwd_free(f);
    kv_lr_free(lr), kv_lr_free(lr1);
    kv_model_close(m), kv_model_close(m2);
}

/* The quantize-dequantize of one latent row as the header describes it:
 * per token and unit, asymmetric codes 0 .. 2^bits − 1 with an fp16 zero
 * point (the row minimum) and an fp16 scale, z = q·scale + zero. */
static void fake_quant(float *z, int64_t r, int bits) {
    if (bits >= 16) return;
    float lo = z[0], hi = z[0], qmax = (float)((1 << bits) - 1);
    for (int64_t j = 1; j < r; j++) lo = fminf(lo, z[j]), hi = fmaxf(hi, z[j]);
    float zero = kv_f16_to_f32(kv_f32_to_f16(lo));
    float scale = kv_f16_to_f32(kv_f32_to_f16((hi - zero) / qmax));
    for (int64_t j = 0; j < r; j++) {
        float code = scale > 0 ? nearbyintf((z[j] - zero) / scale) : 0.0f;
        code = code < 0 ? 0 : (code > qmax ? qmax : code);
        z[j] = code * scale + zero;
    }
}

/* The plain forward with K and V replaced by their (quantized) latent
 * reconstructions: prerope k = RoPE(Q(x downᵀ + c) upᵀ), rotation
 * k = Q(k rotᵀ) rot, values v = Q(x downᵀ + c) upᵀ. */
struct qctx {
    const struct kv_model *m;
    const struct kv_lowrank *lr;
    int bits;
};

static void rope_row(const struct kv_config *c, float *p, int64_t pos) {
    int64_t dh = c->head_dim, half = dh / 2;
    for (int64_t i = 0; i < half; i++) {
        double ang = (double)pos * pow((double)c->rope_theta, -2.0 * (double)i / (double)dh);
        float cs = (float)cos(ang), sn = (float)sin(ang);
        int64_t a = c->rope_layout == KV_ROPE_HALF ? i : 2 * i;
        int64_t b = c->rope_layout == KV_ROPE_HALF ? i + half : 2 * i + 1;
        float x0 = p[a], x1 = p[b];
        p[a] = x0 * cs - x1 * sn;
        p[b] = x0 * sn + x1 * cs;
    }
}

static int q_replace(void *ctx, int64_t l, const float *x, float *k, float *v, int64_t n,
                     int64_t pos0) {
    struct qctx *Q = ctx;
    const struct kv_config *c = kv_model_config(Q->m);
    int64_t d = c->dim, dh = c->head_dim, kd = c->n_kv_heads * dh;
    float z[256];
    for (int side = 0; side < 2; side++) {
        const struct kv_lr_side *sd = side_of(Q->lr, l, side);
        float *out = side ? v : k;
        for (int64_t u = 0; u < sd->n_units; u++) {
            const struct kv_lr_unit *un = &sd->units[u];
            int64_t r = un->rank, mm = un->n_heads * dh;
            for (int64_t t = 0; t < n; t++) {
                float *row = out + t * kd + un->head0 * dh;
                if (sd->mode == KV_LR_POSTROPE_ROTATION) {
                    for (int64_t i = 0; i < r; i++) {
                        double acc = 0;
                        for (int64_t a = 0; a < dh; a++) acc += (double)un->rot[i * dh + a] * row[a];
                        z[i] = (float)acc;
                    }
                    fake_quant(z, r, Q->bits);
                    for (int64_t a = 0; a < dh; a++) {
                        double acc = 0;
                        for (int64_t i = 0; i < r; i++) acc += (double)un->rot[i * dh + a] * z[i];
                        row[a] = (float)acc;
                    }
                    continue;
                }
                for (int64_t i = 0; i < r; i++) {
                    double acc = un->down_bias ? un->down_bias[i] : 0;
                    for (int64_t j = 0; j < d; j++) acc += (double)un->down[i * d + j] * x[t * d + j];
                    z[i] = (float)acc;
                }
                fake_quant(z, r, Q->bits);
                for (int64_t a = 0; a < mm; a++) {
                    double acc = 0;
                    for (int64_t i = 0; i < r; i++) acc += (double)un->up[a * r + i] * z[i];
                    row[a] = (float)acc;
                }
                if (!side)
                    for (int64_t hh = 0; hh < un->n_heads; hh++) rope_row(c, row + hh * dh, pos0 + t);
            }
        }
    }
    return 0;
}

/* Quantized logits against their oracle: a code that flips because fp32
 * rounding put a latent on a rounding edge moves a few logits by one
 * quantization step (one such flip is about 1% of the 8-bit effect here), so
 * the comparison is in RMS: the mismatch must be below frac of the change the
 * quantization itself makes (got against the fp16 latents); a side left
 * unquantized, or the wrong bit width, is a mismatch of the order of the
 * effect. The worst element is printed. */
static void assert_small_beside(const float *got, const float *ref, const float *unquant, int64_t n,
                                double frac, const char *what) {
    double mis = 0, eff = 0, worst = -1;
    int64_t wi = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = (double)got[i] - ref[i], q = (double)got[i] - unquant[i];
        mis += e * e, eff += q * q;
        if (fabs(e) > worst) worst = fabs(e), wi = i;
    }
    mis = sqrt(mis / (double)n), eff = sqrt(eff / (double)n);
    cr_assert(mis <= frac * eff,
              "%s: rms mismatch %.3g > %g of the quantization effect %.3g; worst element %lld: got "
              "%.9g ref %.9g", what, mis, frac, eff, (long long)wi, (double)got[wi], (double)ref[wi]);
}

Test(latent_forward, quantized_latents_equal_the_dequantized_reconstruction, .timeout = 120) {
    struct {
        enum kv_rope_layout layout;
        int bias;
    } models[] = {{KV_ROPE_INTERLEAVED, 0}, {KV_ROPE_HALF, 1}};
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC, KV_METHOD_EIGEN};
    int bits[] = {16, 8, 4, 2};
    int64_t n = 48, V = 97;
    struct kv_err err;
    kv_err_clear(&err);
    for (size_t mi = 0; mi < 2; mi++) {
        struct kv_model *m = random_model(models[mi].layout, models[mi].bias, 91 + mi);
        int32_t *cal = random_tokens(3 * 64, V, 600 + mi), *tok = random_tokens(n, V, 700 + mi);
        struct kv_stats *s = collect(m, cal, 64, 3);
        for (int ci = 0; ci < 3; ci++) {
            struct kv_lowrank *lr =
                decompose_ok(m, s, opts_of(methods[ci], KV_ALLOC_DEFAULT, 0, 0.6, 1), "quantized");
            float *l16 = NULL, *prev = NULL; /* bits[0] is 16 */
            for (int bi = 0; bi < 4; bi++) {
                float *lat = run_logits(m, lr, bits[bi], tok, n);
                struct qctx Q = {m, lr, bits[bi]};
                struct kv_fwd_hooks hk = {0};
                hk.ctx = &Q, hk.kv_replace = q_replace;
                struct kv_fwd *f;
                cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
                kv_fwd_set_hooks(f, &hk);
                cr_assert_eq(kv_fwd_run(f, tok, n, 0, NULL, &err), KV_OK, "%s", fmt_err(&err));
                char what[128];
                snprintf(what, sizeof what, "%s kv_bits %d, %s rope%s: latent cache vs dequantized "
                         "reconstruction", kv_method_name(methods[ci]), bits[bi],
                         models[mi].layout ? "half" : "interleaved", models[mi].bias ? " + bias" : "");
                if (bits[bi] == 16)
                    kvt_assert_close_f32(lat, kv_fwd_logits(f), n * V, 1e-4 * max_abs_f32(lat, n * V),
                                         0, what);
                else /* a code may flip where fp32 rounding meets a rounding edge */
                    assert_small_beside(lat, kv_fwd_logits(f), l16, n * V, 0.15, what);
                /* each bit width changes the logits */
                if (prev)
                    cr_assert_gt(max_abs_diff_f32(lat, prev, n * V), 1e-6 * max_abs_f32(lat, n * V),
                                 "%s: same logits as the wider latents", what);
                if (prev != l16) free(prev);
                if (bits[bi] == 16) l16 = lat;
                prev = lat;
                kv_fwd_free(f);
            }
            if (prev != l16) free(prev);
            free(l16);
            kv_lr_free(lr);
        }
        free(cal), free(tok);
        kv_stats_free(s);
        kv_model_close(m);
    }
}

/* Quantized latents: 8 bits barely move the logits, fewer bits move them
 * more (KL against the fp16-latent logits of the same factors). */
Test(latent_forward, quantized_latents_stay_close_and_fewer_bits_move_more, .timeout = 120) {
    struct shared sh = open_shared(0);
    int64_t V = kv_model_config(sh.m)->vocab_size;
    struct kv_stats *s = collect(sh.m, sh.tok, SEQ, CAL_WINDOWS);
    enum kv_method methods[] = {KV_METHOD_PALU, KV_METHOD_FDC};
    for (int mi = 0; mi < 2; mi++) {
        struct kv_lowrank *lr =
            decompose_ok(sh.m, s, opts_of(methods[mi], KV_ALLOC_DEFAULT, 0, 0.5, 1), "quantized");
        const int32_t *tok = sh.tok + EVAL_AT;
        float *l16 = run_logits(sh.m, lr, 16, tok, SEQ);
        float *l8 = run_logits(sh.m, lr, 8, tok, SEQ);
        float *l4 = run_logits(sh.m, lr, 4, tok, SEQ);
        float *l2 = run_logits(sh.m, lr, 2, tok, SEQ);
        double k8 = mean_kl(l16, l8, SEQ, V), k4 = mean_kl(l16, l4, SEQ, V);
        double k2 = mean_kl(l16, l2, SEQ, V);
        const char *nm = kv_method_name(methods[mi]);
        cr_assert_gt(k8, 0, "%s: 8-bit latents change nothing", nm);
        cr_assert_lt(k8, 2e-3, "%s: 8-bit latents move the logits by kl %g", nm, k8);
        cr_assert_lt(k8, k4, "%s: kl 8 bits %g, 4 bits %g", nm, k8, k4);
        cr_assert_lt(k4, k2, "%s: kl 4 bits %g, 2 bits %g", nm, k4, k2);
        /* the byte accounting: at rank 4, 8 bits cost as much as fp16 (the
         * codes plus an fp16 scale and zero point per unit and token) */
        cr_assert_leq(kv_lr_bytes(lr, 8), kv_lr_bytes(lr, 16));
        cr_assert_lt(kv_lr_bytes(lr, 2), kv_lr_bytes(lr, 8));
        cr_assert_eq(kv_lr_bytes(lr, 16), bytes_by_definition(lr, 16));
        cr_assert_eq(kv_lr_bytes(lr, 8), bytes_by_definition(lr, 8));
        cr_assert_eq(kv_lr_bytes(lr, 2), bytes_by_definition(lr, 2));
        free(l16), free(l8), free(l4), free(l2);
        kv_lr_free(lr);
    }
    kv_stats_free(s);
    shared_free(&sh);
}

/* kv_fwd_one_window: all layers share one cache slab, bit for bit the same
 * logits as per-layer caches (dense and latent), and a run past position 0
 * is refused. */
Test(latent_forward, one_window_shares_one_cache_bit_for_bit) {
    struct kv_model *m = random_model(KV_ROPE_HALF, 1, 53);
    int64_t n = 40, V = 97;
    int32_t *cal = random_tokens(3 * 64, V, 510), *tok = random_tokens(n, V, 511);
    struct kv_stats *s = collect(m, cal, 64, 3);
    struct kv_lowrank *lr =
        decompose_ok(m, s, opts_of(KV_METHOD_PALU, KV_ALLOC_DEFAULT, 0, 0.5, 1), "one window");
    struct kv_err err;
    kv_err_clear(&err);
    for (int latent = 0; latent < 2; latent++)
        for (int bits = 16; bits >= 4; bits -= 12) {
            float *ref = run_logits(m, latent ? lr : NULL, bits, tok, n);
            struct kv_fwd *f;
            cr_assert_eq(kv_fwd_init(m, n, &f, &err), KV_OK);
            cr_assert_eq(kv_fwd_set_lowrank(f, latent ? lr : NULL, bits, &err), KV_OK, "%s",
                         fmt_err(&err));
            kv_fwd_one_window(f);
            float *got = malloc((size_t)(n * V) * sizeof *got);
            for (int rep = 0; rep < 2; rep++) { /* a second window reuses the slab */
                cr_assert_eq(kv_fwd_run(f, tok, n, 0, got, &err), KV_OK, "%s", fmt_err(&err));
                cr_assert(!memcmp(got, ref, (size_t)(n * V) * sizeof *got),
                          "latent %d, %d bits, window %d: one_window logits differ", latent, bits,
                          rep);
            }
            cr_assert_eq(kv_fwd_run(f, tok, 1, 5, got, &err), KV_EINVAL);
            cr_assert_str_eq(err.msg, "this forward state keeps no cache between runs "
                                      "(kv_fwd_one_window); a run must start at position 0, not 5");
            kv_err_clear(&err);
            free(got), free(ref);
            kv_fwd_free(f);
        }
    kv_lr_free(lr);
    free(cal), free(tok);
    kv_stats_free(s);
    kv_model_close(m);
}
