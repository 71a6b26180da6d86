/* Compressed-model directories and their weights (formats/kvdir.c,
 * formats/lrweights.c, formats/lrlayout.c), with the fixtures of
 * lrfixture.h; the manifest's own suites are test_kvmanifest.c.
 *
 * kvdir_write: a hand-made kv_lowrank with every mode (prerope_latent K in
 *   units of 2 heads with a latent bias, postrope_rotation K, fused_output V
 *   with o_fused, full) on a random GQA model, with and without qkv biases,
 *   and fused_query K with q_fused (+ fused_output V) on a random gpt2
 *   model, written and read back factor for factor; the safetensors holds exactly
 *   the tensors the layout names, each equal to the model's or the factors'
 *   bytes (checked against a list built here); the tokenizer copied; what
 *   the output path may already hold; and the writer's refusals.
 * kvdir_open: a corruption table over a valid llama or gpt2 directory whose
 *   rows break the weights or the model (each row a clean error naming the
 *   file, the tensor, the offset when known), models that are not the one
 *   the directory was made from, and F16/BF16 factors.
 * kvdir_hf: an all-full directory from the shared HF model is itself a
 *   loadable HF checkpoint with the same fingerprint.
 * kvdir_inspect: `kvcal inspect DIR` in text and JSON.
 * kvdir_centred: centred factors (each unit's up_bias, the fused_output
 *   layers' o_fused_bias) written and read back bit for bit under their
 *   names, a corruption table of their manifest keys and tensors, and the
 *   writer's refusals. */
#include "lrfixture.h"

#include <criterion/parameterized.h>

/* ------------------------------------------------------------ round trip */

static void round_trip(struct kv_config cfg, int kv_bits, int hadamard) {
    struct kv_model *m = model_of(cfg, 7);
    struct kv_lowrank *lr = make_lr(m, kv_bits, hadamard, 99);
    char *parent, *dir = out_dir(&parent);
    write_dir(m, lr, dir);

    struct kv_lowrank *back = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(dir, m, &back, &err), KV_OK, "%s", fmt_err(&err));
    assert_lr_eq(lr, back, 1);
    cr_assert_eq(kv_lr_bytes(back, back->info.kv_bits), kv_lr_bytes(lr, lr->info.kv_bits));

    /* the manifest alone: same shapes, no factors */
    struct kv_lowrank *mf = NULL;
    char *mpath = kvt_path(dir, "kvcal.json");
    cr_assert_eq(kv_lr_manifest_read(mpath, &mf, &err), KV_OK, "%s", fmt_err(&err));
    assert_lr_eq(lr, mf, 0);

    /* nothing else is left beside the output */
    DIR *d = opendir(parent);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    cr_assert_eq(n, 1, "the temporary directory was left behind");

    kv_lr_free(mf);
    kv_lr_free(back);
    kv_lr_free(lr);
    kv_model_close(m);
    free(mpath);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvdir_write, round_trip_every_mode_without_bias) { round_trip(small_cfg(0), 16, 0); }
Test(kvdir_write, round_trip_every_mode_with_qkv_bias_quantized) {
    round_trip(small_cfg(1), 4, 1);
}
Test(kvdir_write, round_trip_gpt2_fused_query_and_fused_output) { round_trip(gpt2_cfg(), 16, 0); }
Test(kvdir_write, round_trip_gpt2_quantized) { round_trip(gpt2_cfg(), 3, 1); }

/* ------------------------------------------------------------ safetensors */

struct want_t {
    char name[128];
    int64_t rows, cols; /* cols 0: a vector */
    const float *data;
};

struct wants {
    struct want_t t[256];
    int n;
    float *bufs[64];
    int nb;
};

static void want(struct wants *w, const char *name, int64_t rows, int64_t cols, const float *data) {
    cr_assert(w->n < 256);
    cr_assert_not_null(data, "%s: no data", name);
    struct want_t *t = &w->t[w->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows, t->cols = cols, t->data = data;
}

/* The layout of kvdir.h, spelt out independently of the writer. */
static void expected_tensors(const struct kv_model *m, const struct kv_lowrank *lr,
                             struct wants *w) {
    const struct kv_config *c = kv_model_config(m);
    int64_t d = c->dim, dh = c->head_dim, qd = c->n_heads * dh, kvd = c->n_kv_heads * dh;
    int64_t ff = c->hidden_dim;
    int gpt2 = c->arch == KV_ARCH_GPT2;
    const char *P = gpt2 ? "transformer.h" : "model.layers", *A = gpt2 ? "attn" : "self_attn";
    char nm[128];
    if (gpt2) {
        want(w, "transformer.wte.weight", c->vocab_size, d, m->tok_emb);
        want(w, "transformer.wpe.weight", c->max_seq_len, d, m->pos_emb);
        want(w, "transformer.ln_f.weight", d, 0, m->out_norm);
        want(w, "transformer.ln_f.bias", d, 0, m->out_norm_b);
    } else {
        want(w, "model.embed_tokens.weight", c->vocab_size, d, m->tok_emb);
        want(w, "model.norm.weight", d, 0, m->out_norm);
    }
    if (!c->tied_embeddings) want(w, "lm_head.weight", c->vocab_size, d, m->lm_head);
    /* per-layer tensors that are neither attention projections nor K/V */
    static const struct {
        const char *name;
        enum kv_wkind kind;
        int gpt2;
    } plain[] = {
        {"input_layernorm.weight", KV_W_ATTN_NORM, 0},
        {"post_attention_layernorm.weight", KV_W_FFN_NORM, 0},
        {"mlp.gate_proj.weight", KV_W_GATE, 0},
        {"mlp.up_proj.weight", KV_W_UP, 0},
        {"mlp.down_proj.weight", KV_W_DOWN, 0},
        {"ln_1.weight", KV_W_ATTN_NORM, 1},
        {"ln_1.bias", KV_W_ATTN_NORM_B, 1},
        {"attn.o_proj.bias", KV_W_BO, 1},
        {"ln_2.weight", KV_W_FFN_NORM, 1},
        {"ln_2.bias", KV_W_FFN_NORM_B, 1},
        {"mlp.c_fc.weight", KV_W_UP, 1},
        {"mlp.c_fc.bias", KV_W_BUP, 1},
        {"mlp.c_proj.weight", KV_W_DOWN, 1},
        {"mlp.c_proj.bias", KV_W_BDOWN, 1},
    };
    for (int64_t l = 0; l < c->n_layers; l++) {
        const float *const *W = m->layers[l].w;
        const struct kv_lr_layer *y = &lr->layers[l];
#define N(fmt, ...) (snprintf(nm, sizeof nm, "%s.%lld." fmt, P, (long long)l, __VA_ARGS__), nm)
        for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
            if (plain[i].gpt2 != gpt2) continue;
            enum kv_wkind k = plain[i].kind;
            int64_t rows = k == KV_W_GATE || k == KV_W_UP || k == KV_W_BUP ? ff : d;
            int64_t cols = k == KV_W_GATE || k == KV_W_UP ? d : k == KV_W_DOWN ? ff : 0;
            want(w, N("%s", plain[i].name), rows, cols, W[k]);
        }
        if (y->k.mode == KV_LR_FUSED_QUERY) {
            want(w, N("%s.q_fused.weight", A), y->q_cols, d, y->q_fused);
            if (c->has_qkv_bias) want(w, N("%s.q_fused.bias", A), y->q_cols, 0, y->q_fused_bias);
        } else {
            want(w, N("%s.q_proj.weight", A), qd, d, W[KV_W_Q]);
            if (c->has_qkv_bias) want(w, N("%s.q_proj.bias", A), qd, 0, W[KV_W_BQ]);
        }
        if (y->v.mode == KV_LR_FUSED_OUTPUT)
            want(w, N("%s.o_proj.weight", A), d, y->o_cols, y->o_fused);
        else
            want(w, N("%s.o_proj.weight", A), d, qd, W[KV_W_O]);
        for (int s = 0; s < 2; s++) {
            const struct kv_lr_side *sd = s ? &y->v : &y->k;
            char p = "kv"[s];
            if (sd->mode == KV_LR_FULL || sd->mode == KV_LR_POSTROPE_ROTATION) {
                want(w, N("%s.%c_proj.weight", A, p), kvd, d, W[s ? KV_W_V : KV_W_K]);
                if (c->has_qkv_bias)
                    want(w, N("%s.%c_proj.bias", A, p), kvd, 0, W[s ? KV_W_BV : KV_W_BK]);
                for (int64_t u = 0; u < sd->n_units; u++)
                    want(w, N("%s.%c_rot.%lld.weight", A, p, (long long)u), sd->units[u].rank, dh,
                         sd->units[u].rot);
                continue;
            }
            /* stacked down (and bias) in unit order */
            int64_t r = side_rank(sd), off = 0;
            float *down = malloc((size_t)(r * d) * sizeof *down);
            float *bias = sd->units[0].down_bias ? malloc((size_t)r * sizeof *bias) : NULL;
            for (int64_t u = 0; u < sd->n_units; u++) {
                for (int64_t i = 0; i < sd->units[u].rank * d; i++)
                    down[off * d + i] = sd->units[u].down[i];
                for (int64_t i = 0; bias && i < sd->units[u].rank; i++)
                    bias[off + i] = sd->units[u].down_bias[i];
                off += sd->units[u].rank;
                want(w, N("%s.%c_up.%lld.weight", A, p, (long long)u), sd->units[u].n_heads * dh,
                     sd->units[u].rank, sd->units[u].up);
            }
            w->bufs[w->nb++] = down;
            want(w, N("%s.%c_down.weight", A, p), r, d, down);
            if (bias) {
                w->bufs[w->nb++] = bias;
                want(w, N("%s.%c_down.bias", A, p), r, 0, bias);
            }
        }
#undef N
    }
}

static void check_safetensors(struct kv_config cfg) {
    struct kv_model *m = model_of(cfg, 11);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 5);
    char *parent, *dir = out_dir(&parent);
    write_dir(m, lr, dir);
    char *wpath = kvt_path(dir, "model.safetensors");
    struct kv_st_file *f = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_st_open(wpath, &f, &err), KV_OK, "%s", fmt_err(&err));
    struct wants *w = calloc(1, sizeof *w);
    expected_tensors(m, lr, w);
    cr_assert_eq(f->n_tensors, w->n, "the file holds %lld tensors, the layout names %d",
                 (long long)f->n_tensors, w->n);
    for (int i = 0; i < w->n; i++) {
        const struct want_t *x = &w->t[i];
        const struct kv_tensor *t = kv_st_find(f, x->name);
        cr_assert_not_null(t, "missing tensor '%s'", x->name);
        cr_assert_eq(t->dtype, KV_DTYPE_F32, "%s", x->name);
        int nd = x->cols ? 2 : 1;
        cr_assert_eq(t->ndim, nd, "%s", x->name);
        cr_assert_eq(t->shape[0], x->rows, "%s", x->name);
        if (nd == 2) cr_assert_eq(t->shape[1], x->cols, "%s", x->name);
        int64_t n = x->rows * (x->cols ? x->cols : 1);
        cr_assert_eq(t->nbytes, (uint64_t)n * 4, "%s", x->name);
        cr_assert(memcmp(t->data, x->data, (size_t)n * 4) == 0, "%s: bytes differ", x->name);
    }
    cr_assert_str_eq(kv_st_meta(f, "format"), "pt");
    for (int i = 0; i < w->nb; i++) free(w->bufs[i]);
    free(w);
    kv_st_close(f);
    kv_lr_free(lr);
    kv_model_close(m);
    free(wpath);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvdir_write, safetensors_holds_exactly_the_layout_without_bias) {
    check_safetensors(small_cfg(0));
}
Test(kvdir_write, safetensors_holds_exactly_the_layout_with_bias) {
    check_safetensors(small_cfg(1));
}
Test(kvdir_write, safetensors_holds_exactly_the_gpt2_layout) { check_safetensors(gpt2_cfg()); }
Test(kvdir_write, safetensors_holds_exactly_the_untied_gpt2_layout) {
    struct kv_config c = gpt2_cfg();
    c.tied_embeddings = 0;
    check_safetensors(c);
}

Test(kvdir_write, copies_the_tokenizer_of_a_non_hf_source) {
    struct kv_model *m = make_model(0, 1);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    char *parent, *dir = out_dir(&parent);
    char *tok = kvt_path(parent, "tok512.bin");
    static const char bytes[] = "not really a tokenizer \x01\x02";
    FILE *f = fopen(tok, "wb");
    cr_assert_not_null(f);
    fwrite(bytes, 1, sizeof bytes, f);
    fclose(f);
    struct kv_lr_dir_info info = {"model.bin", tok, NULL, NULL};
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_OK, "%s", fmt_err(&err));
    char *copy = kvt_path(dir, "tok512.bin");
    size_t n = 0;
    char *got = kvt_read_file(copy, &n);
    cr_assert_not_null(got);
    cr_assert_eq(n, sizeof bytes);
    cr_assert(memcmp(got, bytes, n) == 0);
    char *cfg = kvt_path(dir, "config.json");
    cr_assert_neq(access(cfg, F_OK), 0, "no config.json is invented");
    json_t *root = load_manifest(dir);
    json_t *empty = json_object();
    cr_assert(json_equal(json_object_get(root, "options"), empty));
    json_decref(empty);
    cr_assert(json_is_null(json_object_get(root, "stats")));
    cr_assert_str_eq(jstr(json_object_get(root, "model"), "tokenizer"), "tok512.bin");
    json_decref(root);
    free(got), free(copy), free(cfg), free(tok);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ output path */

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

Test(kvdir_write, refuses_a_non_empty_directory_without_manifest) {
    struct kv_model *m = make_model(0, 1);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    char *parent, *dir = out_dir(&parent);
    cr_assert_eq(mkdir(dir, 0755), 0);
    char *keep = kvt_path(dir, "keep.txt");
    FILE *f = fopen(keep, "w");
    fputs("mine", f);
    fclose(f);
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, NULL, dir, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, dir);
    cr_assert(strstr(err.msg, "not empty"), "%s", err.msg);
    cr_assert_eq(access(keep, F_OK), 0, "the user's file was removed");
    cr_assert_eq(count_entries(dir), 1);
    cr_assert_eq(count_entries(parent), 1, "a temporary was left behind");

    /* a plain file at the path */
    char *file = kvt_path(parent, "file");
    f = fopen(file, "w");
    fclose(f);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, NULL, file, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert(strstr(err.msg, "not a directory"), "%s", err.msg);
    free(file), free(keep);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

Test(kvdir_write, replaces_an_empty_directory_and_an_earlier_output) {
    struct kv_model *m = make_model(0, 1);
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    char *parent, *dir = out_dir(&parent);
    cr_assert_eq(mkdir(dir, 0755), 0);
    write_dir(m, lr, dir);
    char *stale = kvt_path(dir, "stale.bin");
    FILE *f = fopen(stale, "w");
    fclose(f);
    snprintf(lr->info.method, sizeof lr->info.method, "eigen");
    char *slash = malloc(strlen(dir) + 2);
    sprintf(slash, "%s/", dir); /* a trailing slash names the same directory */
    write_dir(m, lr, slash);
    cr_assert_neq(access(stale, F_OK), 0, "the earlier output's file survived");
    json_t *root = load_manifest(dir);
    cr_assert_str_eq(jstr(root, "method"), "eigen");
    json_decref(root);
    cr_assert_eq(count_entries(parent), 1);
    free(slash), free(stale);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ writer refusals */

Test(kvdir_write, refuses_factors_that_do_not_describe_the_model) {
    struct kv_model *m = make_model(0, 1);
    char *parent, *dir = out_dir(&parent);
    struct kv_err err;
    static const struct {
        const char *what, *needle;
    } rows[] = {
        {"overlap", "overlap"},
        {"gap", "in no unit"},
        {"rank", "rank 0 is not within"},
        {"fingerprint", "made from model"},
        {"o_cols", "fused output projection"},
        {"bias", "down_bias"},
        {"bits", "latent bits"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
        struct kv_lr_side *k0 = &lr->layers[0].k;
        switch (i) {
        case 0: k0->units[1].head0 = 1; break;
        case 1: k0->units[1].head0 = 3, k0->units[1].n_heads = 1; break;
        case 2: lr->layers[1].k.units[2].rank = 0; break;
        case 3: lr->info.model_fingerprint[0] = lr->info.model_fingerprint[0] == '0' ? '1' : '0'; break;
        case 4: lr->layers[0].o_cols--; break;
        case 5: free(k0->units[1].down_bias), k0->units[1].down_bias = NULL; break;
        case 6: lr->info.kv_bits = 5; break;
        }
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_dir_write(m, lr, NULL, dir, &err), KV_EINVAL, "%s: %s", rows[i].what,
                     fmt_err(&err));
        cr_assert(strstr(err.msg, rows[i].needle), "%s: '%s' lacks '%s'", rows[i].what, err.msg,
                  rows[i].needle);
        cr_assert_neq(access(dir, F_OK), 0, "%s: the directory was created", rows[i].what);
        kv_lr_free(lr);
    }
    /* fused query keys: on gpt2 only, with q_fused of the units' rows and a
     * bias exactly when the model has a q bias */
    struct kv_model *g2 = model_of(gpt2_cfg(), 1);
    static const struct {
        const char *what, *needle;
    } qrows[] = {
        {"q_cols", "layer 0 k: fused query projection is set with 39 rows, expected 40"},
        {"q_fused", "layer 2 k: fused query projection is NULL"},
        {"q bias", "layer 0 k: fused query bias is NULL but the model has a q bias"},
        {"stray q_fused", "layer 1 k: a fused query projection is set but the mode is "
                          "'prerope_latent'"},
        {"llama", "layer 0 k: mode 'fused_query' needs a model without rope"},
    };
    for (size_t i = 0; i < sizeof qrows / sizeof qrows[0]; i++) {
        struct kv_lowrank *lr = make_lr(g2, 16, 0, 2);
        struct kv_lr_layer *y = lr->layers;
        struct kv_model *llama = NULL;
        const struct kv_model *target = g2;
        switch (i) {
        case 0: y[0].q_cols--; break;
        case 1: free(y[2].q_fused), y[2].q_fused = NULL; break;
        case 2: free(y[0].q_fused_bias), y[0].q_fused_bias = NULL; break;
        case 3: y[1].q_fused = malloc(sizeof(float)); break;
        case 4: { /* the same factors for a llama model of gpt2's shapes */
            struct kv_config lc = gpt2_cfg();
            lc.arch = KV_ARCH_LLAMA, lc.rope_theta = 10000.0f;
            target = llama = model_of(lc, 1);
            cr_assert_eq(kv_model_fingerprint(llama, lr->info.model_fingerprint, &err), KV_OK);
            break;
        }
        }
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_dir_write(target, lr, NULL, dir, &err), KV_EINVAL, "%s: %s",
                     qrows[i].what, fmt_err(&err));
        cr_assert(strstr(err.msg, qrows[i].needle), "%s: '%s' lacks '%s'", qrows[i].what,
                  err.msg, qrows[i].needle);
        cr_assert_neq(access(dir, F_OK), 0, "%s: the directory was created", qrows[i].what);
        kv_lr_free(lr);
        kv_model_close(llama);
    }
    kv_model_close(g2);
    /* options that are not an object */
    struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
    struct kv_lr_dir_info info = {NULL, NULL, "[1, 2]", NULL};
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert(strstr(err.msg, "options"), "%s", err.msg);
    cr_assert_eq(count_entries(parent), 0, "a temporary was left behind");
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ corruption */

static void j_missing_name(json_t *r) {
    set(unit_json(r, 0, "k", 1), "up", json_string("model.layers.0.self_attn.k_up.7.weight"));
}
static void j_dim(json_t *r) { set(json_object_get(r, "model"), "hidden_dim", json_integer(41)); }
/* layer 1 k unit 3: rank 1 -> 2 with the side rank, bytes and ratio to match,
 * so only the tensor's shape disagrees */
static void j_rank_consistent(json_t *r) {
    bump(unit_json(r, 1, "k", 3), "rank", 1);
    bump(side_json(r, 1, "k"), "rank", 1);
    json_t *b = json_object_get(r, "kv_bytes_per_token");
    bump(b, "compressed", 2);
    set(b, "ratio", json_real((double)json_integer_value(json_object_get(b, "compressed")) /
                              (double)json_integer_value(json_object_get(b, "base"))));
}

static const struct row rows[] = {
    {"q_fused dropped", NULL, 3, "transformer.h.2.attn.q_fused.weight",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'transformer.h.2.attn.q_fused.weight' "
                                      "(named by kvcal.json layer 2 k 'q_proj', q_cols)"}, 1},
    {"q_fused bias dropped", NULL, 3, "transformer.h.0.attn.q_fused.bias",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'transformer.h.0.attn.q_fused.bias'"}, 1},
    {"q_fused shape", NULL, 4, "transformer.h.0.attn.q_fused.weight",
     {KV_EFORMAT, 1, 0, 0, "has shape [40, 31] but kvcal.json (layer 0 k 'q_proj', q_cols) "
                           "implies [40, 32]"}, 1},
    {"q_fused bias shape", NULL, 4, "transformer.h.2.attn.q_fused.bias",
     {KV_EFORMAT, 1, 0, 0, "has shape [71] but kvcal.json (layer 2 k 'q_proj_bias', q_cols) "
                           "implies [72]"}, 1},
    {"gpt2 factor dropped", NULL, 3, "transformer.h.1.attn.k_up.1.weight",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'transformer.h.1.attn.k_up.1.weight'"}, 1},
    {"named tensor absent", j_missing_name, 0, NULL,
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'model.layers.0.self_attn.k_up.7.weight'"}, 0},
    {"model dims", j_dim, 0, NULL,
     {KV_EINVAL, 0, KV_NO_OFFSET, 0, "hidden_dim 41"}, 0},
    {"tensor dropped", NULL, 3, "model.layers.1.self_attn.k_rot.2.weight",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'model.layers.1.self_attn.k_rot.2.weight'"}, 0},
    {"bias dropped", NULL, 3, "model.layers.0.self_attn.k_down.bias",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0, "missing tensor 'model.layers.0.self_attn.k_down.bias'"}, 0},
    {"rank vs shape", NULL, 4, "model.layers.0.self_attn.k_up.1.weight",
     {KV_EFORMAT, 1, 0, 0,
      "has shape [8, 2] but kvcal.json (layer 0 k unit 1 'up', rank 3) implies [8, 3]"}, 0},
    {"rank vs shape in the manifest", j_rank_consistent, 5,
     "model.layers.1.self_attn.k_rot.3.weight",
     {KV_EFORMAT, 1, 0, 0, "has shape [1, 4] but kvcal.json (layer 1 k unit 3 'rot', rank 2) "
                           "implies [2, 4]"}, 0},
    {"fused o_proj shape", NULL, 4, "model.layers.0.self_attn.o_proj.weight",
     {KV_EFORMAT, 1, 0, 0, "o_proj"}, 0},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

ParameterizedTestParameters(kvdir_open, rejects_corruption) {
    static int idx[N_ROWS];
    for (size_t i = 0; i < N_ROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_ROWS);
}

ParameterizedTest(int *ip, kvdir_open, rejects_corruption) { check_corruption(&rows[*ip], NULL); }

Test(kvdir_open, refuses_another_model) {
    struct fx f;
    fx_init(&f);
    struct kv_model *other = make_model(0, 18); /* same shapes, other weights */
    struct kv_lowrank *lr = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.path, f.mpath);
    char want[128];
    snprintf(want, sizeof want, "made from model %.12s, but the given model is ",
             f.lr->info.model_fingerprint);
    cr_assert(strstr(err.msg, want), "'%s' lacks '%s'", err.msg, want);
    kv_model_close(other);

    /* what an engine reads from the manifest must be the model's (before:
     * a manifest with another theta, norm epsilon or context was taken) */
    struct kv_config tc = small_cfg(0);
    tc.rope_theta = 500000.0f;
    other = model_of(tc, 18);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.msg, "made from a model with rope theta 10000, but the given model has 500000");
    kv_model_close(other);
    tc = small_cfg(0), tc.norm_eps = 1e-6f;
    other = model_of(tc, 18);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.msg, "made from a model with norm_eps 1e-05, but the given model has 1e-06");
    kv_model_close(other);
    tc = small_cfg(0), tc.max_seq_len = 128;
    other = model_of(tc, 18);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.msg, "made from a model with max_seq_len 64, but the given model has 128");
    kv_model_close(other);

    /* the other rope pairs, in words (before: "rope layout (1 = half) 0") */
    struct kv_config ic = small_cfg(0);
    ic.rope_layout = KV_ROPE_INTERLEAVED;
    other = model_of(ic, 18);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.msg, "made from a model whose rope pairs are half (i, i + d_h/2), but the given "
                              "model's are interleaved (2i, 2i+1)");
    kv_model_close(other);

    /* other shapes: named before any fingerprint is computed */
    other = make_model(1, 17);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert(strstr(err.msg, "tied_embeddings") || strstr(err.msg, "qkv_bias"), "%s", err.msg);
    kv_model_close(other);
    fx_free(&f);

    /* a gpt2 directory and a llama model of the same shapes */
    fx_init_arch(&f, 1);
    struct kv_config lc = gpt2_cfg();
    lc.arch = KV_ARCH_LLAMA, lc.rope_theta = 10000.0f;
    other = model_of(lc, 17);
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, other, &lr, &err), KV_EINVAL, "%s", fmt_err(&err));
    cr_assert_str_eq(err.msg, "made from a gpt2 model, but the given model is llama");
    kv_model_close(other);
    fx_free(&f);
}

Test(kvdir_open, reads_f16_and_bf16_factors) {
    struct fx f;
    fx_init(&f);
    /* store k_up.0 of layer 0 as BF16 and o_proj of layer 2 as F16 */
    const char *bf = "model.layers.0.self_attn.k_up.0.weight";
    const char *hf = "model.layers.2.self_attn.o_proj.weight";
    struct kv_st_file *st = NULL;
    struct kv_stw *w = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_st_open(f.wpath, &st, &err), KV_OK);
    cr_assert_eq(kv_stw_init(&w, &err), KV_OK);
    for (int64_t i = 0; i < st->n_tensors; i++) {
        const struct kv_tensor *t = &st->tensors[i];
        enum kv_dtype dt = !strcmp(t->name, bf)   ? KV_DTYPE_BF16
                           : !strcmp(t->name, hf) ? KV_DTYPE_F16
                                                  : KV_DTYPE_F32;
        if (dt == KV_DTYPE_F32)
            cr_assert_eq(kv_stw_add(w, t->name, dt, t->ndim, t->shape, t->data, t->nbytes, &err),
                         KV_OK);
        else
            cr_assert_eq(kv_stw_add_f32(w, t->name, dt, t->ndim, t->shape, t->data, &err), KV_OK);
    }
    cr_assert_eq(kv_stw_write(w, f.wpath, &err), KV_OK, "%s", fmt_err(&err));
    kv_stw_free(w);
    kv_st_close(st);
    struct kv_lowrank *lr = NULL;
    cr_assert_eq(kv_lr_dir_open(f.dir, f.m, &lr, &err), KV_OK, "%s", fmt_err(&err));
    /* rounding to 8 (bf16) and 11 (f16) significant bits; values are in [-1, 1) */
    const struct kv_lr_unit *a = &lr->layers[0].k.units[0], *b = &f.lr->layers[0].k.units[0];
    int64_t n = a->n_heads * f.lr->info.head_dim * a->rank;
    kvt_assert_close_f32(a->up, b->up, n, 0, 0x1.0p-8, "bf16 up");
    n = f.lr->info.dim * lr->layers[2].o_cols;
    kvt_assert_close_f32(lr->layers[2].o_fused, f.lr->layers[2].o_fused, n, 0x1.0p-25, 0x1.0p-11,
                         "f16 o_fused");
    kv_lr_free(lr);
    fx_free(&f);
}

/* ------------------------------------------------------------ HF source */

Test(kvdir_hf, all_full_output_is_the_same_hf_checkpoint) {
    KVT_NEED_SHARED(src, "models/tinystories-656K");
    struct kv_model *m = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_model_open(src, NULL, &m, &err), KV_OK, "%s", fmt_err(&err));
    const struct kv_config *c = kv_model_config(m);
    struct kv_lowrank *lr = calloc(1, sizeof *lr);
    snprintf(lr->info.method, sizeof lr->info.method, "none");
    snprintf(lr->info.alloc, sizeof lr->info.alloc, "none");
    lr->info.n_layers = c->n_layers, lr->info.dim = c->dim, lr->info.n_heads = c->n_heads;
    lr->info.n_kv_heads = c->n_kv_heads, lr->info.head_dim = c->head_dim, lr->info.kv_bits = 16;
    lr->layers = calloc((size_t)c->n_layers, sizeof *lr->layers);
    char *parent, *dir = out_dir(&parent);
    struct kv_lr_dir_info info = {src, NULL, NULL, NULL};
    cr_assert_eq(kv_lr_dir_write(m, lr, &info, dir, &err), KV_OK, "%s", fmt_err(&err));
    static const char *const copied[] = {"config.json", "generation_config.json", "tokenizer.json",
                                         "tokenizer_config.json", "special_tokens_map.json"};
    for (size_t i = 0; i < sizeof copied / sizeof copied[0]; i++) {
        char *a = kvt_path(src, copied[i]), *b = kvt_path(dir, copied[i]);
        size_t na = 0, nb = 0;
        char *x = kvt_read_file(a, &na), *y = kvt_read_file(b, &nb);
        cr_assert_not_null(y, "%s was not copied", copied[i]);
        cr_assert(na == nb && memcmp(x, y, na) == 0, "%s differs", copied[i]);
        free(a), free(b), free(x), free(y);
    }
    json_t *root = load_manifest(dir);
    json_t *mo = json_object_get(root, "model");
    cr_assert_str_eq(jstr(mo, "format"), "hf");
    cr_assert_str_eq(jstr(mo, "tokenizer"), "tokenizer.json");
    cr_assert_eq(jint(json_object_get(root, "kv_bytes_per_token"), "compressed"),
                 jint(json_object_get(root, "kv_bytes_per_token"), "base"));
    json_decref(root);

    /* the directory loads as an HF checkpoint with the same weights */
    struct kv_model *again = NULL;
    cr_assert_eq(kv_model_open(dir, NULL, &again, &err), KV_OK, "%s", fmt_err(&err));
    char fa[65], fb[65];
    cr_assert_eq(kv_model_fingerprint(m, fa, &err), KV_OK);
    cr_assert_eq(kv_model_fingerprint(again, fb, &err), KV_OK);
    cr_assert_str_eq(fa, fb);
    struct kv_lowrank *back = NULL;
    cr_assert_eq(kv_lr_dir_open(dir, again, &back, &err), KV_OK, "%s", fmt_err(&err));
    cr_assert_eq(kv_lr_bytes(back, 16), kv_lr_base_bytes(c));
    kv_lr_free(back);
    kv_model_close(again);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}

/* ------------------------------------------------------------ inspect */

Test(kvdir_inspect, prints_ranks_bytes_and_json) {
    struct fx f;
    fx_init(&f);
    char args[4200];
    char *out = NULL, *errs = NULL;
    snprintf(args, sizeof args, "inspect '%s' --json", f.dir);
    int rc = kvt_run_cli(args, &out, &errs);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, errs);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "%s: %s", je.text, out);
    cr_assert_str_eq(jstr(o, "type"), "kvcal.manifest");
    cr_assert_str_eq(jstr(o, "method"), "palu");
    json_t *layers = json_object_get(o, "layers");
    cr_assert_eq(json_array_size(layers), 3);
    int64_t total = 0;
    for (int64_t l = 0; l < 3; l++) {
        json_t *yo = json_array_get(layers, (size_t)l);
        int64_t lb = 0;
        for (int s = 0; s < 2; s++) {
            const struct kv_lr_side *sd = s ? &f.lr->layers[l].v : &f.lr->layers[l].k;
            json_t *so = json_object_get(yo, s ? "v" : "k");
            cr_assert_str_eq(jstr(so, "mode"), kv_lr_mode_name(sd->mode));
            json_t *ranks = json_object_get(so, "ranks");
            cr_assert_eq((int64_t)json_array_size(ranks), sd->n_units);
            for (int64_t u = 0; u < sd->n_units; u++)
                cr_assert_eq(json_integer_value(json_array_get(ranks, (size_t)u)),
                             sd->units[u].rank);
            lb += sd->mode == KV_LR_FULL ? 4 * 4 * 2 : 2 * side_rank(sd);
        }
        cr_assert_eq(jint(json_object_get(yo, "kv_bytes_per_token"), "compressed"), lb);
        cr_assert_eq(jint(json_object_get(yo, "kv_bytes_per_token"), "base"), 2 * 4 * 4 * 2);
        total += lb;
    }
    cr_assert_eq(jint(json_object_get(o, "kv_bytes_per_token"), "compressed"), total);
    json_decref(o);
    free(out), free(errs);

    snprintf(args, sizeof args, "inspect '%s'", f.dir);
    rc = kvt_run_cli(args, &out, &errs);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, errs);
    cr_assert(strstr(out, "palu"), "%s", out);
    cr_assert(strstr(out, "prerope_latent") && strstr(out, "5,3"), "%s", out);
    cr_assert(strstr(out, "2,3,4,1"), "%s", out);
    free(out), free(errs);

    /* a broken manifest is an error naming it */
    edit_json(&f, j_version);
    rc = kvt_run_cli(args, &out, &errs);
    cr_assert_eq(rc, 1, "exit %d", rc);
    cr_assert(strstr(errs, "kvcal.json") && strstr(errs, "version 2"), "%s", errs);
    free(out), free(errs);
    fx_free(&f);
}
/* ------------------------------------------------------------ centred factors */

/* Centred factors on lr (make_lr's, for model c): an up_bias [s_u·d_h] on
 * every unit of every side with an up factor, and o_fused_bias [d] on each
 * fused_output layer. Random values: the format stores them, whatever they
 * mean. */
static void centre(struct kv_lowrank *lr, const struct kv_config *c, uint64_t seed) {
    uint64_t s = seed;
    for (int64_t l = 0; l < lr->info.n_layers; l++) {
        for (int w = 0; w < 2; w++) {
            struct kv_lr_side *sd = kv_lr_side(lr, l, w);
            for (int64_t u = 0; u < sd->n_units; u++)
                if (sd->units[u].up)
                    sd->units[u].up_bias = rand_floats(sd->units[u].n_heads * c->head_dim, &s);
        }
        if (lr->layers[l].v.mode == KV_LR_FUSED_OUTPUT)
            lr->layers[l].o_fused_bias = rand_floats(c->dim, &s);
    }
}

/* A valid directory of centred factors (llama: make_lr's with centre). */
static void fx_init_centred(struct fx *f, int gpt2) {
    f->m = gpt2 ? model_of(gpt2_cfg(), 17) : make_model(0, 17);
    f->lr = make_lr(f->m, 16, 0, 23);
    centre(f->lr, kv_model_config(f->m), 29);
    f->dir = out_dir(&f->parent);
    write_dir(f->m, f->lr, f->dir);
    f->mpath = kvt_path(f->dir, "kvcal.json");
    f->wpath = kvt_path(f->dir, "model.safetensors");
}

/* The centred tensors of a and b agree bit for bit (NULL where NULL). */
static void assert_centred_eq(const struct kv_lowrank *a, const struct kv_lowrank *b) {
    for (int64_t l = 0; l < a->info.n_layers; l++) {
        for (int w = 0; w < 2; w++) {
            const struct kv_lr_side *s = kv_lr_side(a, l, w), *t = kv_lr_side(b, l, w);
            for (int64_t u = 0; u < s->n_units; u++) {
                char what[64];
                snprintf(what, sizeof what, "layer %lld %c unit %lld up_bias", (long long)l,
                         "kv"[w], (long long)u);
                assert_floats_eq(s->units[u].up_bias, t->units[u].up_bias,
                                 s->units[u].n_heads * a->info.head_dim, what);
            }
        }
        char what[64];
        snprintf(what, sizeof what, "layer %lld o_fused_bias", (long long)l);
        assert_floats_eq(a->layers[l].o_fused_bias, b->layers[l].o_fused_bias, a->info.dim, what);
    }
}

/* Centred factors of every mode with an up factor (llama: prerope_latent K,
 * fused_output V; gpt2: fused_query K too) are written under the names
 * lrlayout.h gives and read back bit for bit; postrope_rotation units and
 * full sides name none. */
static void centred_round_trip(int gpt2) {
    struct fx f;
    fx_init_centred(&f, gpt2);
    const struct kv_config *c = kv_model_config(f.m);
    struct kv_lowrank *back = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_dir_open(f.dir, f.m, &back, &err), KV_OK, "%s", fmt_err(&err));
    assert_lr_eq(f.lr, back, 1);
    assert_centred_eq(f.lr, back);
    int64_t n_bias = 0, n_obias = 0;
    for (int64_t l = 0; l < c->n_layers; l++) {
        for (int w = 0; w < 2; w++)
            for (int64_t u = 0; u < kv_lr_side(back, l, w)->n_units; u++)
                n_bias += kv_lr_side(back, l, w)->units[u].up_bias != NULL;
        n_obias += back->layers[l].o_fused_bias != NULL;
    }
    cr_assert_eq(n_bias, gpt2 ? 3 + 8 + 2 + 1 + 4 : 2 + 4 + 1, "units read with an up_bias");
    cr_assert_eq(n_obias, 2, "layers read with an o_fused_bias");

    /* the manifest's names, the weights file's tensors */
    json_t *root = load_manifest(f.dir);
    struct kv_st_file *st = NULL;
    cr_assert_eq(kv_st_open(f.wpath, &st, &err), KV_OK, "%s", fmt_err(&err));
    for (int64_t l = 0; l < c->n_layers; l++) {
        char attn[64], nm[160];
        snprintf(attn, sizeof attn, gpt2 ? "transformer.h.%lld.attn." : "model.layers.%lld.self_attn.",
                 (long long)l);
        for (int w = 0; w < 2; w++) {
            const struct kv_lr_side *sd = kv_lr_side(f.lr, l, w);
            for (int64_t u = 0; u < sd->n_units; u++) {
                json_t *v = json_object_get(unit_json(root, l, w ? "v" : "k", u), "up_bias");
                cr_assert_not_null(v, "layer %lld %c unit %lld has no key 'up_bias'", (long long)l,
                                   "kv"[w], (long long)u);
                if (sd->mode == KV_LR_POSTROPE_ROTATION) {
                    cr_assert(json_is_null(v));
                    continue;
                }
                snprintf(nm, sizeof nm, "%s%c_up.%lld.bias", attn, "kv"[w], (long long)u);
                cr_assert_str_eq(json_string_value(v), nm);
                const struct kv_tensor *t = kv_st_find(st, nm);
                cr_assert_not_null(t, "%s", nm);
                cr_assert(t->dtype == KV_DTYPE_F32 && t->ndim == 1 &&
                              t->shape[0] == sd->units[u].n_heads * c->head_dim,
                          "%s", nm);
            }
        }
        json_t *ob = json_object_get(side_json(root, l, "v"), "o_proj_bias");
        cr_assert_not_null(ob, "layer %lld v has no key 'o_proj_bias'", (long long)l);
        snprintf(nm, sizeof nm, "%so_fused.bias", attn);
        if (f.lr->layers[l].v.mode != KV_LR_FUSED_OUTPUT) {
            cr_assert(json_is_null(ob));
            cr_assert_null(kv_st_find(st, nm), "%s", nm);
            continue;
        }
        cr_assert_str_eq(json_string_value(ob), nm);
        const struct kv_tensor *t = kv_st_find(st, nm);
        cr_assert_not_null(t, "%s", nm);
        cr_assert(t->dtype == KV_DTYPE_F32 && t->ndim == 1 && t->shape[0] == c->dim, "%s", nm);
        /* the model's own o bias (gpt2) is still named by the layer, apart */
        snprintf(nm, sizeof nm, "%so_proj.bias", attn);
        if (gpt2) cr_assert_str_eq(jstr(json_array_get(json_object_get(root, "layers"), (size_t)l),
                                        "o_proj_bias"), nm);
    }
    kv_st_close(st);
    json_decref(root);

    /* the manifest alone: no factors */
    struct kv_lowrank *mf = NULL;
    cr_assert_eq(kv_lr_manifest_read(f.mpath, &mf, &err), KV_OK, "%s", fmt_err(&err));
    assert_lr_eq(f.lr, mf, 0);
    for (int64_t l = 0; l < c->n_layers; l++) cr_assert_null(mf->layers[l].o_fused_bias);
    kv_lr_free(mf);
    kv_lr_free(back);
    fx_free(&f);
}

Test(kvdir_centred, round_trip_llama) { centred_round_trip(0); }
Test(kvdir_centred, round_trip_gpt2_fused_query) { centred_round_trip(1); }

/* NaN at element i of tensor name, in place; returns the element's offset. */
static uint64_t poison(const char *wpath, const char *name, int64_t i) {
    struct kv_st_file *st = NULL;
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_st_open(wpath, &st, &err), KV_OK, "%s", fmt_err(&err));
    const struct kv_tensor *t = kv_st_find(st, name);
    cr_assert_not_null(t, "%s", name);
    cr_assert_eq(t->dtype, KV_DTYPE_F32);
    uint64_t off = t->offset + (uint64_t)i * 4;
    kv_st_close(st);
    float nan = NAN;
    FILE *fp = fopen(wpath, "r+b");
    cr_assert_not_null(fp);
    cr_assert_eq(fseek(fp, (long)off, SEEK_SET), 0);
    cr_assert_eq(fwrite(&nan, sizeof nan, 1, fp), 1);
    fclose(fp);
    return off;
}

static void jc_up_bias_on_rot(json_t *r) {
    set(unit_json(r, 1, "k", 0), "up_bias", json_string("model.layers.1.self_attn.k_up.0.bias"));
}
static void jc_up_bias_in_part(json_t *r) { set(unit_json(r, 0, "k", 1), "up_bias", json_null()); }
static void jc_values_not_centred(json_t *r) {
    for (int64_t u = 0; u < 4; u++) set(unit_json(r, 0, "v", u), "up_bias", json_null());
}
static void jc_o_bias_null(json_t *r) { set(side_json(r, 2, "v"), "o_proj_bias", json_null()); }
static void jc_o_bias_on_full(json_t *r) {
    set(side_json(r, 1, "v"), "o_proj_bias", json_string("model.layers.1.self_attn.o_fused.bias"));
}
static void jc_up_bias_type(json_t *r) { set(unit_json(r, 2, "v", 0), "up_bias", json_integer(3)); }

/* Rows over a centred llama directory: kind 0 edits the manifest, 3 drops
 * the tensor, 4 narrows it by one column, 6 puts a NaN at its element 3. */
static const struct row crows[] = {
    {"up_bias on a postrope_rotation unit", jc_up_bias_on_rot, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 1 k unit 0: key 'up_bias' must be null for mode 'postrope_rotation', found "
      "\"model.layers.1.self_attn.k_up.0.bias\""}, 0},
    {"up_bias on some units", jc_up_bias_in_part, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 k unit 1: key 'up_bias' is null but unit 0's is a tensor name, expected all "
      "units or none to have one"}, 0},
    {"o_proj_bias without up_bias", jc_values_not_centred, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 0 v: key 'o_proj_bias' is a tensor name, but the units have no up_bias"}, 0},
    {"up_bias without o_proj_bias", jc_o_bias_null, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 2 v: key 'o_proj_bias' is null, but the units have an up_bias"}, 0},
    {"o_proj_bias on full values", jc_o_bias_on_full, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 1 v: key 'o_proj_bias' must be null for mode 'full', found "
      "\"model.layers.1.self_attn.o_fused.bias\""}, 0},
    {"up_bias of another type", jc_up_bias_type, 0, NULL,
     {KV_EFORMAT, 0, KV_NO_OFFSET, 0,
      "layer 2 v unit 0: key 'up_bias' must be a tensor name or null, found 3"}, 0},
    {"up_bias dropped", NULL, 3, "model.layers.0.self_attn.v_up.3.bias",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0,
      "missing tensor 'model.layers.0.self_attn.v_up.3.bias' (named by kvcal.json layer 0 v "
      "unit 3 'up_bias', heads 1)"}, 0},
    {"o_fused bias dropped", NULL, 3, "model.layers.2.self_attn.o_fused.bias",
     {KV_EFORMAT, 1, KV_NO_OFFSET, 0,
      "missing tensor 'model.layers.2.self_attn.o_fused.bias' (named by kvcal.json layer 2 v "
      "'o_proj_bias', dim)"}, 0},
    {"up_bias shape", NULL, 4, "model.layers.0.self_attn.k_up.1.bias",
     {KV_EFORMAT, 1, 0, 0,
      "tensor 'model.layers.0.self_attn.k_up.1.bias' has shape [7] but kvcal.json (layer 0 k "
      "unit 1 'up_bias', heads 2) implies [8]"}, 0},
    {"o_fused bias shape", NULL, 4, "model.layers.0.self_attn.o_fused.bias",
     {KV_EFORMAT, 1, 0, 0,
      "tensor 'model.layers.0.self_attn.o_fused.bias' has shape [31] but kvcal.json (layer 0 v "
      "'o_proj_bias', dim) implies [32]"}, 0},
    {"up_bias not finite", NULL, 6, "model.layers.0.self_attn.v_up.2.bias",
     {KV_EFORMAT, 1, 0, 0,
      "tensor 'model.layers.0.self_attn.v_up.2.bias' holds a non-finite value at element 3"}, 0},
    {"o_fused bias not finite", NULL, 6, "model.layers.2.self_attn.o_fused.bias",
     {KV_EFORMAT, 1, 0, 0,
      "tensor 'model.layers.2.self_attn.o_fused.bias' holds a non-finite value at element 3"},
     0},
};
#define N_CROWS (sizeof crows / sizeof crows[0])

ParameterizedTestParameters(kvdir_centred, rejects_corruption) {
    static int idx[N_CROWS];
    for (size_t i = 0; i < N_CROWS; i++) idx[i] = (int)i;
    return cr_make_param_array(int, idx, N_CROWS);
}

/* The exact message, file and offset of kv_lr_dir_open; where the manifest
 * alone is at fault, kv_lr_manifest_read says the same. */
ParameterizedTest(int *ip, kvdir_centred, rejects_corruption) {
    const struct row *r = &crows[*ip];
    struct fx f;
    fx_init_centred(&f, 0);
    struct want_err w = r->w;
    switch (r->kind) {
    case 0: edit_json(&f, r->json_fn); break;
    case 3: rewrite_weights(&f, r->tensor, NULL, NULL); break;
    case 4: rewrite_weights(&f, NULL, r->tensor, &w.off); break;
    case 6: w.off = poison(f.wpath, r->tensor, 3); break;
    }
    check_opened(&f, r, &w, 1);
    fx_free(&f);
}

/* What the writer refuses of centred factors (KV_EINVAL naming the
 * directory, nothing written): the lrlayout.h rules. */
Test(kvdir_centred, writer_refuses_factors_that_break_the_rules) {
    struct kv_model *m = make_model(0, 1);
    char *parent, *dir = out_dir(&parent);
    static const char *const msgs[] = {
        "layer 1 k unit 2: up_bias is set but mode 'postrope_rotation' has no up factor",
        "layer 0 k unit 1: up_bias is NULL but unit 0's is set, expected all units or none to "
        "have one",
        "layer 0 v: fused output bias is NULL but the value units have an up_bias",
        "layer 2 v: fused output bias is set but the value units have no up_bias",
        "layer 1 v: a fused output bias is set but the mode is 'full'",
    };
    for (size_t i = 0; i < sizeof msgs / sizeof msgs[0]; i++) {
        struct kv_lowrank *lr = make_lr(m, 16, 0, 2);
        centre(lr, kv_model_config(m), 3);
        struct kv_lr_layer *y = lr->layers;
        uint64_t s = 5;
        switch (i) {
        case 0: y[1].k.units[2].up_bias = rand_floats(4, &s); break;
        case 1: free(y[0].k.units[1].up_bias), y[0].k.units[1].up_bias = NULL; break;
        case 2: free(y[0].o_fused_bias), y[0].o_fused_bias = NULL; break;
        case 3: free(y[2].v.units[0].up_bias), y[2].v.units[0].up_bias = NULL; break;
        case 4: y[1].o_fused_bias = rand_floats(32, &s); break;
        }
        struct kv_err err;
        kv_err_clear(&err);
        cr_assert_eq(kv_lr_dir_write(m, lr, NULL, dir, &err), KV_EINVAL, "row %zu: %s", i,
                     fmt_err(&err));
        cr_assert_str_eq(err.path, dir, "row %zu", i);
        cr_assert_str_eq(err.msg, msgs[i], "row %zu", i);
        cr_assert_neq(access(dir, F_OK), 0, "row %zu: the directory was created", i);
        kv_lr_free(lr);
    }
    kv_model_close(m);
    rm_tree(parent);
    free(dir), free(parent);
}
