/* The manifest kvcal.json of compressed-model directories
 * (formats/kvmanifest.c), with the fixtures of lrfixture.h.
 *
 * kvmanifest_write: the manifest of a hand-made kv_lowrank with every mode
 *   (llama with and without qkv biases, quantized; gpt2 with fused_query
 *   keys): fields, order, names, byte counts and predicted errors
 *   recomputed here.
 * kvmanifest_open: a corruption table over a valid llama or gpt2 directory,
 *   every row an error of the manifest alone: kv_lr_dir_open names the
 *   file, the key and the offset when known, kv_lr_manifest_read agrees,
 *   and kv_lr_manifest_parse on the file's bytes says exactly the same.
 * kvmanifest_parse: the parser on bytes: a valid manifest, truncations,
 *   bytes that are not JSON or not an object, NUL bytes, the size limit. */
#include <sys/mman.h>

#include "lrfixture.h"

#include <criterion/parameterized.h>

/* ------------------------------------------------------------ write */

static void assert_keys(const json_t *o, const char *const *keys, size_t n, const char *what) {
    size_t i = 0;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)o, k, v) {
        cr_assert(i < n, "%s: unexpected key '%s'", what, k);
        cr_assert_str_eq(k, keys[i], "%s: key %zu", what, i);
        i++;
    }
    cr_assert_eq(i, n, "%s: %zu keys, want %zu", what, i, n);
}


/* KV bytes/token recomputed from the description of kv_lr_bytes. */
static int64_t unit_bytes(int64_t rank, int bits) {
    return bits >= 16 ? 2 * rank : (rank * bits + 7) / 8 + 2 + 2;
}

static void check_manifest(struct kv_config cfg, int bits) {
    struct kv_model *m = model_of(cfg, 3);
    const struct kv_config *c = kv_model_config(m);
    int bias = c->has_qkv_bias, gpt2 = c->arch == KV_ARCH_GPT2;
    struct kv_lowrank *lr = make_lr(m, bits, bits < 16, 21);
    char *parent, *dir = out_dir(&parent);
    write_dir(m, lr, dir);
    json_t *root = load_manifest(dir);

    static const char *const top[] = {
        "format", "version", "kvcal_version", "method", "alloc", "options", "model", "stats",
        "rope", "latent", "weights", "weight_layout", "kv_bytes_per_token", "predicted_error",
        "layers"};
    assert_keys(root, top, sizeof top / sizeof top[0], "manifest");
    cr_assert_str_eq(jstr(root, "format"), "kvcal.manifest");
    cr_assert_eq(jint(root, "version"), 1);
    cr_assert_str_eq(jstr(root, "method"), "palu");
    cr_assert_str_eq(jstr(root, "alloc"), "uniform");
    cr_assert_str_eq(jstr(root, "weights"), "model.safetensors");
    cr_assert_str_eq(jstr(root, "weight_layout"), "linear [out, in]");
    json_t *opt = json_loads(OPTIONS, 0, NULL), *st = json_loads(STATS, 0, NULL);
    cr_assert(json_equal(json_object_get(root, "options"), opt), "options not copied verbatim");
    cr_assert(json_equal(json_object_get(root, "stats"), st), "stats not copied verbatim");
    json_decref(opt), json_decref(st);

    json_t *mo = json_object_get(root, "model");
    static const char *const mkeys[] = {"fingerprint", "source", "format", "arch", "dim",
                                        "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                        "head_dim", "vocab_size", "norm_eps", "tied_embeddings",
                                        "qkv_bias"};
    size_t i = 0;
    const char *k;
    json_t *v;
    json_object_foreach(mo, k, v) {
        if (i < sizeof mkeys / sizeof mkeys[0]) cr_assert_str_eq(k, mkeys[i], "model key %zu", i);
        i++;
    }
    cr_assert_str_eq(jstr(mo, "fingerprint"), lr->info.model_fingerprint);
    cr_assert_str_eq(jstr(mo, "source"), "models/base");
    cr_assert_str_eq(jstr(mo, "format"), "synthetic");
    cr_assert_str_eq(jstr(mo, "arch"), gpt2 ? "gpt2" : "llama");
    cr_assert_eq(jint(mo, "dim"), c->dim);
    cr_assert_eq(jint(mo, "n_kv_heads"), c->n_kv_heads);
    cr_assert_eq(jint(mo, "head_dim"), c->head_dim);
    cr_assert_eq((float)jnum(mo, "norm_eps"), c->norm_eps);
    cr_assert_eq(json_is_true(json_object_get(mo, "qkv_bias")), bias);
    cr_assert_eq(json_is_true(json_object_get(mo, "tied_embeddings")), c->tied_embeddings);
    /* what an engine needs besides attention, and which KV head each query
     * head reads (h / g consecutive query heads per KV head) */
    cr_assert_str_eq(jstr(mo, "norm"), gpt2 ? "layernorm" : "rmsnorm");
    cr_assert_str_eq(jstr(mo, "activation"), gpt2 ? "gelu_new" : "silu");
    cr_assert_str_eq(jstr(mo, "mlp"), gpt2 ? "plain" : "gated");
    cr_assert_str_eq(jstr(mo, "positions"), gpt2 ? "learned" : "rope");
    json_t *map = json_object_get(mo, "kv_head_of_query");
    cr_assert_eq((int64_t)json_array_size(map), c->n_heads);
    for (int64_t h = 0; h < c->n_heads; h++)
        cr_assert_eq(json_integer_value(json_array_get(map, (size_t)h)),
                     h * c->n_kv_heads / c->n_heads, "kv_head_of_query[%lld]", (long long)h);

    json_t *ro = json_object_get(root, "rope");
    if (gpt2) {
        cr_assert(json_is_null(ro), "gpt2 has no rope: 'rope' must be null");
    } else {
        cr_assert_str_eq(jstr(ro, "layout"), "half");
        cr_assert_str_eq(jstr(ro, "pairs"), "(i, i + d_h/2)");
        cr_assert_eq(jnum(ro, "theta"), 10000.0);
        cr_assert(json_is_null(json_object_get(ro, "scaling")));
    }

    json_t *lo = json_object_get(root, "latent");
    cr_assert_eq(jint(lo, "bits"), bits);
    cr_assert_str_eq(jstr(lo, "dtype"), bits == 16 ? "f16" : "int");
    json_t *q = json_object_get(lo, "quantization");
    if (bits == 16) {
        cr_assert(json_is_null(q));
    } else {
        cr_assert_str_eq(jstr(q, "scheme"), "per-token asymmetric");
        cr_assert_str_eq(jstr(q, "group"), "unit");
        cr_assert_str_eq(jstr(q, "dequant"), "z = q * scale + zero");
    }
    cr_assert_eq(json_is_true(json_object_get(lo, "hadamard")), bits < 16);

    /* bytes and errors, recomputed */
    int64_t base = c->n_layers * 2 * c->n_kv_heads * c->head_dim * 2, comp = 0;
    double en[2] = {0, 0}, dr[2] = {0, 0};
    json_t *layers = json_object_get(root, "layers");
    cr_assert_eq((int64_t)json_array_size(layers), c->n_layers);
    for (int64_t l = 0; l < c->n_layers; l++) {
        json_t *yo = json_array_get(layers, (size_t)l);
        cr_assert_eq(jint(yo, "index"), l);
        {
            /* the query and output projections as applied, in every mode */
            char a[96], nm[160];
            snprintf(a, sizeof a,
                     gpt2 ? "transformer.h.%lld.attn." : "model.layers.%lld.self_attn.",
                     (long long)l);
            int fq = lr->layers[l].k.mode == KV_LR_FUSED_QUERY;
            snprintf(nm, sizeof nm, "%sq_%s.weight", a, fq ? "fused" : "proj");
            cr_assert_str_eq(jstr(yo, "q_proj"), nm);
            snprintf(nm, sizeof nm, "%sq_%s.bias", a, fq ? "fused" : "proj");
            if (bias)
                cr_assert_str_eq(jstr(yo, "q_proj_bias"), nm);
            else
                cr_assert(json_is_null(json_object_get(yo, "q_proj_bias")));
            snprintf(nm, sizeof nm, "%so_proj.weight", a);
            cr_assert_str_eq(jstr(yo, "o_proj"), nm);
            snprintf(nm, sizeof nm, "%so_proj.bias", a);
            if (gpt2)
                cr_assert_str_eq(jstr(yo, "o_proj_bias"), nm);
            else
                cr_assert(json_is_null(json_object_get(yo, "o_proj_bias")));
        }
        for (int s = 0; s < 2; s++) {
            const struct kv_lr_side *sd = s ? &lr->layers[l].v : &lr->layers[l].k;
            json_t *so = json_object_get(yo, s ? "v" : "k");
            char attn[96], pre[100];
            snprintf(attn, sizeof attn, gpt2 ? "transformer.h.%lld.attn." : "model.layers.%lld.self_attn.",
                     (long long)l);
            snprintf(pre, sizeof pre, "%s%c", attn, "kv"[s]);
            char nm[160];
            cr_assert_str_eq(jstr(so, "mode"), kv_lr_mode_name(sd->mode));
            cr_assert_eq(jint(so, "rank"), side_rank(sd));
            int latent = sd->mode == KV_LR_PREROPE_LATENT || sd->mode == KV_LR_FUSED_QUERY ||
                         sd->mode == KV_LR_FUSED_OUTPUT;
            snprintf(nm, sizeof nm, "%s_down.weight", pre);
            if (latent)
                cr_assert_str_eq(jstr(so, "down"), nm);
            else
                cr_assert(json_is_null(json_object_get(so, "down")));
            snprintf(nm, sizeof nm, "%s_down.bias", pre);
            if (latent && sd->units[0].down_bias)
                cr_assert_str_eq(jstr(so, "down_bias"), nm);
            else
                cr_assert(json_is_null(json_object_get(so, "down_bias")));
            snprintf(nm, sizeof nm, "%s_proj.weight", pre);
            if (!latent)
                cr_assert_str_eq(jstr(so, "proj"), nm);
            else
                cr_assert(json_is_null(json_object_get(so, "proj")));
            if (s) {
                snprintf(nm, sizeof nm, "%so_proj.weight", attn);
                cr_assert_str_eq(jstr(so, "o_proj"), nm);
                cr_assert(json_is_null(json_object_get(so, "o_proj_bias")), "o_proj_bias");
                if (sd->mode == KV_LR_FUSED_OUTPUT)
                    cr_assert_eq(jint(so, "o_cols"), o_cols_of(sd, c));
                else
                    cr_assert_null(json_object_get(so, "o_cols"));
            } else if (sd->mode == KV_LR_FUSED_QUERY) {
                /* the query heads' unit ranks, as for o_cols */
                cr_assert_eq(jint(so, "q_cols"), o_cols_of(sd, c));
                snprintf(nm, sizeof nm, "%sq_fused.weight", attn);
                cr_assert_str_eq(jstr(so, "q_proj"), nm);
                snprintf(nm, sizeof nm, "%sq_fused.bias", attn);
                cr_assert_str_eq(jstr(so, "q_proj_bias"), nm);
            } else {
                cr_assert(!json_object_get(so, "q_proj") && !json_object_get(so, "q_proj_bias") &&
                          !json_object_get(so, "q_cols"));
            }
            json_t *units = json_object_get(so, "units");
            cr_assert_eq((int64_t)json_array_size(units), sd->n_units);
            double se = 0, sdr = 0;
            int64_t off = 0;
            if (sd->mode == KV_LR_FULL) comp += c->n_kv_heads * c->head_dim * 2;
            for (int64_t u = 0; u < sd->n_units; u++) {
                const struct kv_lr_unit *x = &sd->units[u];
                json_t *uo = json_array_get(units, (size_t)u), *hs = json_object_get(uo, "heads");
                cr_assert_eq((int64_t)json_array_size(hs), x->n_heads);
                for (int64_t j = 0; j < x->n_heads; j++)
                    cr_assert_eq(json_integer_value(json_array_get(hs, (size_t)j)), x->head0 + j);
                cr_assert_eq(jint(uo, "rank"), x->rank);
                cr_assert_eq(jint(uo, "latent_offset"), off);
                snprintf(nm, sizeof nm, "%s_up.%lld.weight", pre, (long long)u);
                if (latent) cr_assert_str_eq(jstr(uo, "up"), nm);
                /* factors that are not centred: no mean, but the key */
                cr_assert(json_is_null(json_object_get(uo, "up_bias")), "up_bias");
                snprintf(nm, sizeof nm, "%s_rot.%lld.weight", pre, (long long)u);
                if (sd->mode == KV_LR_POSTROPE_ROTATION)
                    cr_assert_str_eq(jstr(uo, "rot"), nm);
                else
                    cr_assert(json_is_null(json_object_get(uo, "rot")));
                cr_assert_eq(jnum(uo, "energy"), x->energy);
                cr_assert_eq(jnum(uo, "dropped"), x->dropped);
                kvt_assert_close_f64((double[]){jnum(uo, "predicted_error")},
                                     (double[]){x->dropped / x->energy}, 1, 0, 1e-15,
                                     "unit predicted_error");
                off += x->rank;
                se += x->energy, sdr += x->dropped;
                comp += unit_bytes(x->rank, bits);
            }
            kvt_assert_close_f64((double[]){jnum(so, "predicted_error")},
                                 (double[]){se > 0 ? sdr / se : 0}, 1, 0, 1e-15,
                                 "side predicted_error");
            en[s] += se, dr[s] += sdr;
        }
    }
    json_t *bo = json_object_get(root, "kv_bytes_per_token");
    cr_assert_eq(jint(bo, "base"), base);
    cr_assert_eq(jint(bo, "compressed"), comp);
    cr_assert(comp < base, "the example compresses");
    kvt_assert_close_f64((double[]){jnum(bo, "ratio")}, (double[]){(double)comp / (double)base},
                         1, 0, 1e-15, "ratio");
    json_t *po = json_object_get(root, "predicted_error");
    kvt_assert_close_f64((double[]){jnum(po, "k"), jnum(po, "v")},
                         (double[]){dr[0] / en[0], dr[1] / en[1]}, 2, 0, 1e-15,
                         "predicted_error");
    json_decref(root);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvmanifest_write, manifest_fields_f16) { check_manifest(small_cfg(0), 16); }
Test(kvmanifest_write, manifest_fields_quantized) { check_manifest(small_cfg(1), 3); }
Test(kvmanifest_write, manifest_fields_gpt2) { check_manifest(gpt2_cfg(), 16); }

/* Mixed bits (--kv-bits auto): each unit's bands written in order, the
 * latent block says so, the bytes are the bands', and they read back. */
Test(kvmanifest_write, mixed_bands_round_trip) {
    struct kv_model *m = model_of(small_cfg(1), 3);
    struct kv_lowrank *lr = make_lr(m, 16, 1, 21);
    static const int widths[] = {16, 8, 4, 3, 2};
    int64_t comp = 0, k = 0;
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int w = 0; w < 2; w++) {
            struct kv_lr_side *sd = kv_lr_side(lr, l, w);
            if (sd->mode == KV_LR_FULL) {
                comp += lr->info.n_kv_heads * lr->info.head_dim * 2;
                continue;
            }
            for (int64_t u = 0; u < sd->n_units; u++, k++) {
                struct kv_lr_unit *un = &sd->units[u];
                /* rank r as up to three bands of falling widths, varied per unit */
                int64_t left = un->rank;
                int nb = 0, wi = (int)(k % 3);
                while (left > 0 && nb < 3) {
                    int64_t n = nb == 2 || left == 1 ? left : 1 + (left - 1) / 2;
                    un->bands[nb++] = (struct kv_lr_band){n, widths[wi]};
                    comp += unit_bytes(n, widths[wi]);
                    left -= n, wi++;
                }
                un->n_bands = nb;
            }
        }
    lr->info.kv_bits = KV_LR_BITS_MIXED;
    cr_assert_eq(kv_lr_bytes(lr, KV_LR_BITS_MIXED), comp, "kv_lr_bytes %lld, by hand %lld",
                 (long long)kv_lr_bytes(lr, KV_LR_BITS_MIXED), (long long)comp);
    char *parent, *dir = out_dir(&parent);
    write_dir(m, lr, dir);
    json_t *root = load_manifest(dir), *lo = json_object_get(root, "latent");
    cr_assert_eq(jint(lo, "bits"), 0);
    cr_assert_str_eq(jstr(lo, "dtype"), "mixed");
    cr_assert_str_eq(jstr(json_object_get(lo, "quantization"), "group"), "band");
    cr_assert_eq(jint(json_object_get(root, "kv_bytes_per_token"), "compressed"), comp);
    struct kv_lowrank *back = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(dir, m, &back, &err), KV_OK, "%s", err.msg);
    cr_assert_eq(kv_lr_info(back).kv_bits, KV_LR_BITS_MIXED);
    for (int64_t l = 0; l < lr->info.n_layers; l++)
        for (int w = 0; w < 2; w++)
            for (int64_t u = 0; u < kv_lr_n_units(lr, l, w); u++) {
                struct kv_lr_unit_info a = kv_lr_unit_info(lr, l, w, u), b = kv_lr_unit_info(back, l, w, u);
                json_t *jb = json_object_get(unit_json(root, l, w ? "v" : "k", u), "bands");
                cr_assert_eq(a.n_bands, b.n_bands);
                cr_assert_eq((int)json_array_size(jb), a.n_bands);
                for (int i = 0; i < a.n_bands; i++) {
                    cr_assert(a.bands[i].n == b.bands[i].n && a.bands[i].bits == b.bands[i].bits,
                              "layer %lld side %d unit %lld band %d", (long long)l, w, (long long)u, i);
                    cr_assert_eq(jint(json_array_get(jb, (size_t)i), "n"), a.bands[i].n);
                    cr_assert_eq(jint(json_array_get(jb, (size_t)i), "bits"), a.bands[i].bits);
                }
            }
    json_decref(root);
    kv_lr_free(back);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ corruption */

static void j_format(json_t *r) { set(r, "format", json_string("kvcal.other")); }
static void j_bytes(json_t *r) { bump(json_object_get(r, "kv_bytes_per_token"), "compressed", -2); }
static void j_overlap(json_t *r) {
    /* layer 0 k: units {0,1} and {2,3} become {0,1} and {1,2,3} */
    set(unit_json(r, 0, "k", 1), "heads", json_pack("[i,i,i]", 1, 2, 3));
}
static void j_gap(json_t *r) {
    set(unit_json(r, 0, "k", 1), "heads", json_pack("[i]", 3));
}
static void j_heads_order(json_t *r) {
    set(unit_json(r, 1, "k", 2), "heads", json_pack("[i,i]", 3, 2));
}
static void j_rank_range(json_t *r) {
    set(unit_json(r, 1, "k", 0), "rank", json_integer(5)); /* d_h is 4 */
}
static void j_side_rank(json_t *r) {
    set(side_json(r, 0, "k"), "rank", json_integer(9));
}
static void j_offset(json_t *r) {
    set(unit_json(r, 0, "v", 2), "latent_offset", json_integer(4));
}
static void j_o_cols(json_t *r) { bump(side_json(r, 2, "v"), "o_cols", 1); }
static void j_mode(json_t *r) { set(side_json(r, 1, "v"), "mode", json_string("prerope_latent")); }
static void j_fused_query(json_t *r) {
    set(side_json(r, 0, "k"), "mode", json_string("fused_query"));
}
static void j_arch(json_t *r) { set(json_object_get(r, "model"), "arch", json_string("mamba")); }
static void j_rope_null(json_t *r) { set(r, "rope", json_null()); }
static void j_rope_object(json_t *r) {
    set(r, "rope", json_pack("{s:s, s:f}", "layout", "half", "theta", 10000.0));
}
static void j_layout(json_t *r) { set(r, "weight_layout", json_string("linear [in, out]")); }
/* a partial rope on llama, which turns whole heads */
static void j_rotary_dim(json_t *r) {
    json_int_t hd = json_integer_value(json_object_get(json_object_get(r, "model"), "head_dim"));
    set(json_object_get(r, "rope"), "rotary_dim", json_integer(hd - 2));
}
static void j_residual(json_t *r) { set(json_object_get(r, "model"), "residual", json_string("parallel")); }
static void j_q_cols(json_t *r) { bump(side_json(r, 0, "k"), "q_cols", 1); }
static void j_q_cols_missing(json_t *r) {
    cr_assert_eq(json_object_del(side_json(r, 2, "k"), "q_cols"), 0);
}
static void j_q_proj_null(json_t *r) { set(side_json(r, 2, "k"), "q_proj", json_null()); }
static void j_q_bias_null(json_t *r) { set(side_json(r, 0, "k"), "q_proj_bias", json_null()); }
static void j_q_proj_stray(json_t *r) {
    set(side_json(r, 1, "k"), "q_proj", json_string("transformer.h.1.attn.q_proj.weight"));
}
static void j_weights_path(json_t *r) { set(r, "weights", json_string("../w.safetensors")); }
static void j_energy(json_t *r) { set(unit_json(r, 0, "k", 0), "energy", json_string("lots")); }
static void j_bos_type(json_t *r) { set(json_object_get(r, "model"), "bos_id", json_string("1")); }
static void j_ctx_zero(json_t *r) { set(json_object_get(r, "model"), "max_seq_len", json_integer(0)); }
static void j_norm(json_t *r) {
    set(json_object_get(r, "model"), "norm", json_string("layernorm"));
}
static void j_activation(json_t *r) {
    set(json_object_get(r, "model"), "activation", json_string("gelu"));
}
static void j_positions(json_t *r) {
    set(json_object_get(r, "model"), "positions", json_string("rope"));
}
static void j_kv_map(json_t *r) {
    json_t *map = json_object_get(json_object_get(r, "model"), "kv_head_of_query");
    cr_assert_eq(json_array_set_new(map, 3, json_integer(2)), 0);
}
static void j_kv_map_short(json_t *r) {
    json_t *map = json_object_get(json_object_get(r, "model"), "kv_head_of_query");
    cr_assert_eq(json_array_remove(map, 7), 0);
}
static void j_layer_q_proj(json_t *r) {
    set(json_array_get(json_object_get(r, "layers"), 1), "q_proj",
        json_string("model.layers.1.self_attn.k_proj.weight"));
}
static void j_layer_q_fused(json_t *r) {
    /* a fused query layer must name the fused projection its keys name */
    set(json_array_get(json_object_get(r, "layers"), 0), "q_proj",
        json_string("transformer.h.0.attn.q_proj.weight"));
}
static void j_layer_o_bias(json_t *r) {
    set(json_array_get(json_object_get(r, "layers"), 2), "o_proj_bias", json_null());
}
static void j_layer_q_bias(json_t *r) {
    set(json_array_get(json_object_get(r, "layers"), 0), "q_proj_bias",
        json_string("model.layers.0.self_attn.q_proj.bias"));
}
static void j_layer_partial(json_t *r) {
    cr_assert_eq(json_object_del(json_array_get(json_object_get(r, "layers"), 1), "o_proj"), 0);
}
static void j_layers(json_t *r) {
    cr_assert_eq(json_array_remove(json_object_get(r, "layers"), 2), 0);
}
/* mixed bits: latent bits 0 with every compressed unit one band at 8 */
static void to_mixed(json_t *r, int bands) {
    json_t *lo = json_object_get(r, "latent");
    set(lo, "bits", json_integer(0));
    set(lo, "dtype", json_string("mixed"));
    json_t *layers = json_object_get(r, "layers");
    for (size_t l = 0; bands && l < json_array_size(layers); l++)
        for (int k = 0; k < 2; k++) {
            json_t *units = json_object_get(side_json(r, (int64_t)l, k ? "v" : "k"), "units");
            for (size_t u = 0; u < json_array_size(units); u++) {
                json_t *uo = json_array_get(units, u);
                set(uo, "bands", json_pack("[{s:I, s:i}]", "n", json_integer_value(json_object_get(uo, "rank")), "bits", 8));
            }
        }
}
static void j_bands_at_16(json_t *r) {
    set(unit_json(r, 0, "k", 0), "bands", json_pack("[{s:i, s:i}]", "n", 5, "bits", 8));
}
static void j_mixed_no_bands(json_t *r) { to_mixed(r, 0); }
static void j_mixed_dtype(json_t *r) {
    to_mixed(r, 1);
    set(json_object_get(r, "latent"), "dtype", json_string("int"));
}
static void j_bands_rising(json_t *r) {
    to_mixed(r, 1);
    set(unit_json(r, 0, "k", 0), "bands", json_pack("[{s:i, s:i}, {s:i, s:i}]", "n", 1, "bits", 4, "n", 4, "bits", 8));
}
static void j_bands_sum(json_t *r) {
    to_mixed(r, 1);
    set(unit_json(r, 0, "v", 2), "bands", json_pack("[{s:i, s:i}, {s:i, s:i}]", "n", 1, "bits", 16, "n", 2, "bits", 3));
}
static void j_bands_bits(json_t *r) {
    to_mixed(r, 1);
    set(unit_json(r, 2, "v", 0), "bands", json_pack("[{s:i, s:i}]", "n", 6, "bits", 5));
}
static void j_bands_type(json_t *r) {
    to_mixed(r, 1);
    set(unit_json(r, 0, "k", 1), "bands", json_string("8"));
}

static const struct row rows[] = {
    {"missing manifest", NULL, 1, NULL,
     {KV_EIO, 0, KV_NO_OFFSET, 0, "cannot open"}, 0},
    {"bad json", NULL, 2, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 1, "invalid json"}, 0},
    {"wrong format", j_format, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "format 'kvcal.other'"}, 0},
    {"newer version", j_version, 0, NULL,
     {KV_EUNSUPPORTED, 0, KV_NO_OFFSET, 0, "version 2"}, 0},
    {"wrong kv bytes", j_bytes, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "kv_bytes_per_token"}, 0},
    {"heads overlap", j_overlap, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 0 k unit 1: kv heads 1..3 overlap"}, 0},
    {"heads gap", j_gap, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "kv head 2 is in no unit"}, 0},
    {"heads out of order", j_heads_order, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "consecutive kv heads"}, 0},
    {"rank above d_h", j_rank_range, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "rank 5 is not within 1..4"}, 0},
    {"side rank", j_side_rank, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "rank is 9 but its units"}, 0},
    {"latent offset", j_offset, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "latent_offset is 4, expected 5"}, 0},
    {"o_cols", j_o_cols, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "o_cols"}, 0},
    {"mode for values", j_mode, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "mode 'prerope_latent' is not one of"}, 0},
    {"fused_query on llama", j_fused_query, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k: mode 'fused_query' needs a model without rope, found arch 'llama'"}, 0},
    {"bos_id of another type", j_bos_type, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "model: key 'bos_id' must be"}, 0},
    {"max_seq_len 0", j_ctx_zero, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "model: key 'max_seq_len'"}, 0},
    {"unknown arch", j_arch, 0, NULL,
     {KV_EUNSUPPORTED, 0, KV_NO_OFFSET, 0,
      "model: arch 'mamba' is not supported, expected 'llama', 'gpt2', 'mistral', 'qwen2', 'phi3', 'qwen3', 'gpt_neox' or 'gemma2'"}, 0},
    {"llama rope null", j_rope_null, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "key 'rope' must be an object, found null"}, 0},
    {"partial rope on llama", j_rotary_dim, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "must be even and head_dim for this arch"}, 0},
    {"parallel residual on llama", j_residual, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "model: residual 'parallel' does not match arch 'llama', which has 'sequential'"}, 0},
    {"weight layout", j_layout, 0, NULL,
     {KV_EUNSUPPORTED, 0, KV_NO_OFFSET, 0,
      "weight_layout 'linear [in, out]' is not supported, expected 'linear [out, in]'"}, 0},
    {"gpt2 rope object", j_rope_object, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "key 'rope' must be null for arch 'gpt2' (no rope)"}, 1},
    {"q_cols", j_q_cols, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k: q_cols is 41, expected 40 (each query head's unit rank)"}, 1},
    {"q_cols missing", j_q_cols_missing, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 2 k: missing key 'q_cols'"}, 1},
    {"q_proj null", j_q_proj_null, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 2 k: key 'q_proj' must be a tensor name, found null"},
     1},
    {"q_proj_bias null", j_q_bias_null, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k: key 'q_proj_bias' is null, but the model has q biases"}, 1},
    {"q_proj on another mode", j_q_proj_stray, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 1 k: key 'q_proj' must be null for mode "
                                      "'prerope_latent'"}, 1},
    {"weights outside", j_weights_path, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "key 'weights'"}, 0},
    {"energy type", j_energy, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 0 k unit 0: key 'energy'"}, 0},
    {"norm against arch", j_norm, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "model: norm 'layernorm' does not match arch 'llama', which has 'rmsnorm'"}, 0},
    {"activation against arch", j_activation, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "model: activation 'gelu' does not match arch 'gpt2', which has 'gelu_new'"}, 1},
    {"positions against arch", j_positions, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "model: positions 'rope' does not match arch 'gpt2', which has 'learned'"}, 1},
    {"kv head of a query head", j_kv_map, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "model: kv_head_of_query[3] is 2, expected 1 (query head i reads kv head i / (n_heads / "
      "n_kv_heads))"}, 0},
    {"kv head map length", j_kv_map_short, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "model: key 'kv_head_of_query' must be an array of n_heads 8 kv head indices"}, 0},
    {"layer q_proj", j_layer_q_proj, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 1: q_proj is 'model.layers.1.self_attn.k_proj.weight', expected "
      "'model.layers.1.self_attn.q_proj.weight'"}, 0},
    {"layer q_proj of fused keys", j_layer_q_fused, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0: q_proj is 'transformer.h.0.attn.q_proj.weight', expected "
      "'transformer.h.0.attn.q_fused.weight'"}, 1},
    {"layer o_proj_bias of gpt2", j_layer_o_bias, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 2: o_proj_bias is null, expected 'transformer.h.2.attn.o_proj.bias'"}, 1},
    {"layer q_proj_bias without q biases", j_layer_q_bias, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0: q_proj_bias is 'model.layers.0.self_attn.q_proj.bias', expected null"}, 0},
    {"layer projections in part", j_layer_partial, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 1: missing key 'o_proj'"}, 0},
    {"layer count", j_layers, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "2 entries, expected n_layers 3"}, 0},
    {"bands at 16 bits", j_bands_at_16, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k unit 0: key 'bands' must be null when latent bits is 16, found [{\"n\":5,\"bits\":8}]"},
     0},
    {"mixed without bands", j_mixed_no_bands, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k unit 0: missing key 'bands' (latent bits 0: each unit's own bands)"}, 0},
    {"mixed bits with dtype int", j_mixed_dtype, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "latent: dtype 'int' does not match 0 bits, expected 'mixed'"}, 0},
    {"bands of rising bits", j_bands_rising, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k unit 0: band 1: bits 8 after 4, expected strictly falling bits"}, 0},
    {"bands short of the rank", j_bands_sum, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 v unit 2: bands hold 3 coordinates but the rank is 4"}, 0},
    {"band of 5 bits", j_bands_bits, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 2 v unit 0: band 0: bits 5 is not one of 16, 8, 4, 3, 2"}, 0},
    {"bands of another type", j_bands_type, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0, "layer 0 k unit 1: key 'bands' must be an array of {n, bits}, found \"8\""}, 0},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

/* The parser on the corrupted manifest's bytes says what the file reader
 * says: code, file, offset and message. */
static void parse_agrees(const struct fx *f, const struct row *r, const struct want_err *w) {
    if (r->kind == 1) return; /* no manifest */
    size_t n = 0;
    char *b = kvt_read_file(f->mpath, &n);
    cr_assert_not_null(b, "%s", r->name);
    struct kv_lowrank *lr = NULL;
    struct kv_err e1, e2;
    kv_err_clear(&e1);
    kv_err_clear(&e2);
    cr_assert_eq(kv_lr_manifest_read(f->mpath, &lr, &e1), w->code, "%s", r->name);
    cr_assert_eq(kv_lr_manifest_parse(b, n, f->mpath, &lr, &e2), w->code, "%s: %s", r->name,
                 fmt_err(&e2));
    cr_assert_null(lr, "%s", r->name);
    cr_assert_str_eq(e2.path, f->mpath, "%s", r->name);
    cr_assert_eq(e2.off, e1.off, "%s: offset %llu, the reader's %llu", r->name,
                 (unsigned long long)e2.off, (unsigned long long)e1.off);
    cr_assert_str_eq(e2.msg, e1.msg, "%s", r->name);
    cr_assert(strstr(e2.msg, w->needle), "%s: message '%s' lacks '%s'", r->name, e2.msg,
              w->needle);
    free(b);
}

ParameterizedTestParameters(kvmanifest_open, rejects_corruption) {
    static int idx[N_ROWS];
    for (size_t i = 0; i < N_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_ROWS);
}

ParameterizedTest(int *ip, kvmanifest_open, rejects_corruption) {
    check_corruption(&rows[*ip], parse_agrees);
}

/* ------------------------------------------------------------ parse */

/* What the parser's messages call the bytes: any name, no file behind it. */
#define MF_PATH "in-memory/kvcal.json"

/* kv_lr_manifest_parse on n bytes of buf; lr is set exactly on success. */
static int parse(const void *buf, size_t n, struct kv_err *err) {
    struct kv_lowrank *lr = NULL;
    kv_err_clear(err);
    int rc = kv_lr_manifest_parse(buf, n, MF_PATH, &lr, err);
    cr_assert_eq(rc == KV_OK, lr != NULL, "status %d with lr %p", rc, (void *)lr);
    kv_lr_free(lr);
    return rc;
}

/* rc and e are KV_EFORMAT naming MF_PATH at off with message msg. */
static void assert_refused(int rc, const struct kv_err *e, uint64_t off, const char *msg,
                           const char *what) {
    cr_assert_eq(rc, KV_EFORMAT, "%s: status %d (%s)", what, rc, fmt_err(e));
    cr_assert_str_eq(e->path, MF_PATH, "%s", what);
    cr_assert_eq(e->off, off, "%s: offset %llu, want %llu", what, (unsigned long long)e->off,
                 (unsigned long long)off);
    cr_assert_str_eq(e->msg, msg, "%s", what);
}

/* The bytes of the manifest of a fresh llama (or gpt2) directory. */
static char *manifest_bytes(struct fx *f, int gpt2, size_t *n) {
    fx_init_arch(f, gpt2);
    char *b = kvt_read_file(f->mpath, n);
    cr_assert_not_null(b);
    cr_assert_gt(*n, 2);
    cr_assert_eq(memcmp(b + *n - 2, "}\n", 2), 0, "a manifest ends with '}' and a newline");
    return b;
}

Test(kvmanifest_parse, reads_the_bytes_of_a_valid_manifest) {
    for (int gpt2 = 0; gpt2 < 2; gpt2++) {
        struct fx f;
        size_t n = 0;
        char *text = manifest_bytes(&f, gpt2, &n);
        /* exactly n bytes, with nothing after them: the parser needs no NUL */
        char *b = malloc(n);
        memcpy(b, text, n);
        struct kv_lowrank *lr = NULL, *from_file = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_manifest_parse(b, n, MF_PATH, &lr, &err), KV_OK, "%s", fmt_err(&err));
        assert_lr_eq(f.lr, lr, 0);
        cr_assert_eq(kv_lr_manifest_read(f.mpath, &from_file, &err), KV_OK, "%s",
                     fmt_err(&err));
        assert_lr_eq(from_file, lr, 0);
        kv_lr_free(lr);
        /* nor the final newline */
        lr = NULL;
        cr_assert_eq(kv_lr_manifest_parse(b, n - 1, MF_PATH, &lr, &err), KV_OK, "%s",
                     fmt_err(&err));
        assert_lr_eq(f.lr, lr, 0);
        kv_lr_free(lr);
        kv_lr_free(from_file);
        free(b), free(text);
        fx_free(&f);
    }
}

/* The keys added to version 1 after its first manifests (the model's norm,
 * activation, mlp, positions and kv_head_of_query, each layer's
 * projections): a manifest without them is still read, as the same model. */
static void j_earlier(json_t *r) {
    json_t *mo = json_object_get(r, "model");
    static const char *const mk[] = {"norm", "activation", "mlp", "positions",
                                     "kv_head_of_query"};
    for (size_t i = 0; i < sizeof mk / sizeof mk[0]; i++)
        cr_assert_eq(json_object_del(mo, mk[i]), 0, "%s", mk[i]);
    static const char *const lk[] = {"q_proj", "q_proj_bias", "o_proj", "o_proj_bias"};
    json_t *layers = json_object_get(r, "layers");
    for (size_t l = 0; l < json_array_size(layers); l++)
        for (size_t i = 0; i < sizeof lk / sizeof lk[0]; i++)
            cr_assert_eq(json_object_del(json_array_get(layers, l), lk[i]), 0, "%s", lk[i]);
}

Test(kvmanifest_open, reads_a_manifest_from_before_the_added_keys) {
    for (int gpt2 = 0; gpt2 < 2; gpt2++) {
        struct fx f;
        fx_init_arch(&f, gpt2);
        edit_json(&f, j_earlier);
        struct kv_lowrank *lr = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_dir_open(f.dir, f.m, &lr, &err), KV_OK, "%s", fmt_err(&err));
        assert_lr_eq(f.lr, lr, 1);
        kv_lr_free(lr);
        fx_free(&f);
    }
}

/* The keys of centred factors (each unit's up_bias, the values' o_proj_bias)
 * came after the first version-1 manifests too: without them a directory
 * is read as factors that are not centred. */
static void j_before_centred(json_t *r) {
    json_t *layers = json_object_get(r, "layers");
    for (size_t l = 0; l < json_array_size(layers); l++) {
        json_t *vo = json_object_get(json_array_get(layers, l), "v");
        cr_assert_eq(json_object_del(vo, "o_proj_bias"), 0, "layer %zu v o_proj_bias", l);
        for (int w = 0; w < 2; w++) {
            json_t *units = json_object_get(json_object_get(json_array_get(layers, l), w ? "v" : "k"),
                                            "units");
            for (size_t u = 0; u < json_array_size(units); u++)
                cr_assert_eq(json_object_del(json_array_get(units, u), "up_bias"), 0,
                             "layer %zu unit %zu up_bias", l, u);
        }
    }
}

Test(kvmanifest_open, reads_a_manifest_from_before_centred_factors) {
    for (int gpt2 = 0; gpt2 < 2; gpt2++) {
        struct fx f;
        fx_init_arch(&f, gpt2);
        edit_json(&f, j_before_centred);
        size_t n = 0;
        char *text = kvt_read_file(f.mpath, &n);
        cr_assert_null(strstr(text, "up_bias"), "the edit left an up_bias key");
        free(text);
        struct kv_lowrank *lr = NULL;
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_dir_open(f.dir, f.m, &lr, &err), KV_OK, "%s", fmt_err(&err));
        assert_lr_eq(f.lr, lr, 1);
        for (int64_t l = 0; l < lr->info.n_layers; l++) {
            cr_assert_null(lr->layers[l].o_fused_bias, "layer %lld", (long long)l);
            for (int w = 0; w < 2; w++)
                for (int64_t u = 0; u < kv_lr_side(lr, l, w)->n_units; u++)
                    cr_assert_null(kv_lr_side(lr, l, w)->units[u].up_bias,
                                   "layer %lld %c unit %lld", (long long)l, "kv"[w], (long long)u);
        }
        kv_lr_free(lr);
        fx_free(&f);
    }
}

Test(kvmanifest_parse, refuses_a_truncated_manifest) {
    struct fx f;
    size_t n = 0;
    char *b = manifest_bytes(&f, 0, &n);
    struct kv_err err;
    assert_refused(parse(b, 0, &err), &err, 0,
                   "invalid json: '[' or '{' expected near end of file", "empty");
    assert_refused(parse(b, 1, &err), &err, 1,
                   "invalid json: string or '}' expected near end of file", "'{' alone");
    assert_refused(parse(b, n - 2, &err), &err, n - 2,
                   "invalid json: '}' expected near end of file", "without the last '}'");
    /* every other length: invalid json where the bytes stop */
    for (size_t cut = 2; cut < n - 2; cut++) {
        int rc = parse(b, cut, &err);
        cr_assert_eq(rc, KV_EFORMAT, "cut at %zu: status %d (%s)", cut, rc, fmt_err(&err));
        cr_assert_str_eq(err.path, MF_PATH, "cut at %zu", cut);
        cr_assert_eq(err.off, cut, "cut at %zu: offset %llu", cut, (unsigned long long)err.off);
        cr_assert(!strncmp(err.msg, "invalid json: ", 14), "cut at %zu: %s", cut, err.msg);
    }
    free(b);
    fx_free(&f);
}

Test(kvmanifest_parse, refuses_bytes_that_are_not_a_json_object) {
    static const struct {
        const char *bytes;
        uint64_t off;
        const char *msg;
    } cases[] = {
        {"hello", 5, "invalid json: '[' or '{' expected near 'hello'"},
        {"42", 2, "invalid json: '[' or '{' expected near '42'"},
        {"\"kvcal.manifest\"", 16, "invalid json: '[' or '{' expected near '\"kvcal.manifest\"'"},
        {"{\"format\": \"kvcal.manifest\", \"version\": 1, \"format\": 2}", 51,
         "invalid json: duplicate object key near '\"format\"'"},
        {"[1, 2]", KV_NO_OFFSET, "manifest is a json array, expected an object"},
        {"{}", KV_NO_OFFSET, "missing key 'format'"},
        {"{\"format\": \"kvcal.manifest\", \"version\": 1}", KV_NO_OFFSET, "missing key 'model'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kv_err err;
        int rc = parse(cases[i].bytes, strlen(cases[i].bytes), &err);
        assert_refused(rc, &err, cases[i].off, cases[i].msg, cases[i].bytes);
    }
}

Test(kvmanifest_parse, refuses_a_nul_byte) {
    /* in a string, the offset is the NUL's; elsewhere jansson reads it as
     * the end of the input */
    static const char in_string[] = "{\"format\": \"kvcal.man\0ifest\", \"version\": 1}";
    static const char between[] = "{\"format\": \"kvcal.manifest\",\0 \"version\": 1}";
    static const char after[] = "{\"format\": \"kvcal.manifest\", \"version\": 1}\0";
    static const char escaped[] = "{\"format\": \"kvcal\\u0000manifest\"}";
    struct kv_err err;
    assert_refused(parse(in_string, sizeof in_string - 1, &err), &err, 21,
                   "invalid json: control character 0x0 near '\"kvcal.man'", "in a string");
    assert_refused(parse(between, sizeof between - 1, &err), &err, 29,
                   "invalid json: string or '}' expected near end of file", "between members");
    assert_refused(parse(after, sizeof after - 1, &err), &err, 43,
                   "invalid json: end of file expected near end of file", "after the object");
    assert_refused(parse(escaped, sizeof escaped - 1, &err), &err, 32,
                   "invalid json: \\u0000 is not allowed without json_allow_nul", "escaped");

    /* a NUL in a real manifest: in the method's string, and after it all */
    struct fx f;
    size_t n = 0;
    char *b = manifest_bytes(&f, 1, &n);
    char *p = strstr(b, "\"palu\"");
    cr_assert_not_null(p);
    p[3] = 0;
    assert_refused(parse(b, n, &err), &err, (uint64_t)(p - b) + 3, /* the NUL's offset */
                   "invalid json: control character 0x0 near '\"pa'", "in the method");
    p[3] = 'l';
    char *longer = malloc(n + 1);
    memcpy(longer, b, n);
    longer[n] = 0;
    assert_refused(parse(longer, n + 1, &err), &err, n + 1,
                   "invalid json: end of file expected near end of file", "after the manifest");
    free(longer), free(b);
    fx_free(&f);
}

Test(kvmanifest_parse, refuses_more_than_the_json_limit) {
    /* untouched anonymous pages: the size is refused before any byte is read */
    size_t n = (256u << 20) + 1;
    void *big = mmap(NULL, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(big, MAP_FAILED);
    struct kv_err err;
    assert_refused(parse(big, n, &err), &err, KV_NO_OFFSET,
                   "file is 268435457 bytes, above the json limit of 268435456", "too large");
    munmap(big, n);
}
