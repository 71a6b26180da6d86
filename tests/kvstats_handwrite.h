/* An independent writer of statistics files (test_kvstats.c and
 * test_kvstats_parse.c): a stats-like GGUF built from the layout documented in
 * kvstats.h with the raw GGUF writer, nothing shared with formats/kvstats.c,
 * and each piece overridable to make a corrupt file. */
#ifndef KV_KVSTATS_HANDWRITE_H
#define KV_KVSTATS_HANDWRITE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "ggufw.h"
#include "kvstats.h"
#include "kvstats_fixture.h"
#include "testutil.h"

/* ggml types of the tensors it writes. */
#define GGML_F32 0u
#define GGML_F64 28u

/* The crc32 kvcal.crc32 holds for n bytes at p. */
static inline uint32_t crc_of(const void *p, uint64_t n) {
    return (uint32_t)crc32(crc32(0L, Z_NULL, 0), p, (uInt)n);
}

/* kvcal.meta_crc32 as kvstats.h defines it: the crc32 of one text of the
 * other keys' values (decimal numbers, the strings as they are). */
static inline uint32_t hmeta_crc(const struct kv_stats *s) {
    const struct kv_stats_info *i = &s->info;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert(f);
    fprintf(f, "%s\n%s\n", i->version, i->fingerprint);
    fprintf(f, "%lld %lld %lld %lld %lld\n", (long long)i->n_layers, (long long)i->dim,
            (long long)i->n_heads, (long long)i->n_kv_heads, (long long)i->head_dim);
    fprintf(f, "%lld %lld %lld\n", (long long)i->seq_len, (long long)i->tokens,
            (long long)i->windows);
    fprintf(f, "%s %llu %lld %lld %lld %lld %lld\n", i->sampling, (unsigned long long)i->seed,
            (long long)i->samples, (long long)i->shard_index, (long long)i->shard_count,
            (long long)i->plan_windows, (long long)i->next_window);
    for (int64_t k = 0; k < i->n_inputs; k++)
        fprintf(f, "%s\n%s %llu %lld %lld\n", s->inputs[k].path, s->inputs[k].sha256,
                (unsigned long long)s->inputs[k].bytes, (long long)s->inputs[k].tokens,
                (long long)s->inputs[k].windows);
    fclose(f);
    uint32_t c = crc_of(text, len);
    free(text);
    return c;
}

/* A stats-like GGUF written from the documented layout (kvstats.h) with the
 * raw GGUF writer; each field overrides one piece. */
struct hspec {
    const char *drop_key;     /* metadata key left out */
    uint32_t format_version;  /* kvcal.format_version */
    const char *drop_tensor;  /* tensor left out (and out of kvcal.crc32) */
    const char *f32_tensor;   /* tensor stored as F32 */
    int64_t xtx_cols;         /* columns of blk.0.attn_in.xtx; 0 = d */
    int swap_first;           /* the first two tensors swapped */
    int extra_tensor;         /* a layer-n_layers attn_in.xtx at the end */
    int crc_extra;            /* extra 0 entries at the end of kvcal.crc32 */
    int crc_wide;             /* kvcal.crc32 as uint64 with 2^32 added to entry 0 */
    int short_sha;            /* kvcal.datasets.sha256 one entry short */
    int64_t drop_fisher_of;   /* layer N-1's four Fisher tensors left out; 0 = none */
};

/* No override: the file kv_stats_write writes. */
static inline struct hspec hspec_default(void) { return (struct hspec){.format_version = 2}; }

/* A tensor as the independent writer stores it. */
struct htensor {
    char name[64];
    uint32_t type;
    int nd;
    int64_t shape[3];
    void *data; /* malloc'd copy */
    uint64_t nbytes;
};

/* Tensor names after "blk.N.", in file order: four, then four with Fisher sums. */
static const char *const suffix[8] = {"attn_in.xtx", "attn_in.sum", "q_rope.cov", "k_rope.cov",
                                      "fisher.k",    "fisher.v",    "grad_k.cov", "grad_v.cov"};

/* Tensors per layer per kvstats.h: four, and four more with Fisher sums. */
static inline int hper(const struct kv_stats *s) { return s->info.has_fisher ? 8 : 4; }

/* Tensor k of layer l per kvstats.h: name, row-major shape, a copy of the data. */
static inline void htensor_make(const struct kv_stats *s, int64_t l, int k, struct htensor *t) {
    int64_t d = s->info.dim, h = s->info.n_heads, g = s->info.n_kv_heads, dh = s->info.head_dim;
    const struct kv_stats_layer *y = &s->layers[l];
    const double *src[8] = {y->xtx,      y->xsum,     y->q_cov,      y->k_cov,
                            y->fisher_k, y->fisher_v, y->grad_k_cov, y->grad_v_cov};
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "blk.%lld.%s", (long long)l, suffix[k]);
    t->type = GGML_F64;
    switch (k) {
    case 0: t->nd = 2, t->shape[0] = d, t->shape[1] = d; break;
    case 1: t->nd = 1, t->shape[0] = d; break;
    case 2: t->nd = 3, t->shape[0] = h, t->shape[1] = dh, t->shape[2] = dh; break;
    case 4:
    case 5: t->nd = 1, t->shape[0] = g * dh; break;
    default: t->nd = 3, t->shape[0] = g, t->shape[1] = dh, t->shape[2] = dh; break;
    }
    t->nbytes = (uint64_t)numel(t->shape, t->nd) * 8;
    t->data = malloc(t->nbytes);
    cr_assert(t->data);
    memcpy(t->data, src[k], t->nbytes);
}

/* Write s as dir/name from the documented layout, with h's overrides;
 * returns the malloc'd path. */
static inline char *hand_write(const struct kv_stats *s, const struct hspec *h, const char *dir,
                               const char *name) {
    struct kv_err err;
    kv_err_clear(&err);
    int64_t cap = s->info.n_layers * hper(s) + 1, nt = 0;
    struct htensor *t = calloc((size_t)cap, sizeof *t);
    cr_assert(t);
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int k = 0; k < hper(s); k++) {
            struct htensor *x = &t[nt];
            htensor_make(s, l, k, x);
            if ((h->drop_tensor && !strcmp(x->name, h->drop_tensor)) ||
                (k >= 4 && l == h->drop_fisher_of - 1)) {
                free(x->data);
                continue;
            }
            if (l == 0 && k == 0 && h->xtx_cols) {
                x->shape[1] = h->xtx_cols; /* the first d*cols values */
                x->nbytes = (uint64_t)(x->shape[0] * x->shape[1]) * 8;
            }
            if (h->f32_tensor && !strcmp(x->name, h->f32_tensor)) {
                uint64_t n = x->nbytes / 8;
                float *f = malloc(n * sizeof *f);
                cr_assert(f);
                for (uint64_t i = 0; i < n; i++) f[i] = (float)((double *)x->data)[i];
                free(x->data);
                x->data = f;
                x->nbytes = n * 4;
                x->type = GGML_F32;
            }
            nt++;
        }
    if (h->swap_first) {
        struct htensor tmp = t[0];
        t[0] = t[1];
        t[1] = tmp;
    }
    if (h->extra_tensor) {
        htensor_make(s, 0, 0, &t[nt]);
        snprintf(t[nt].name, sizeof t[nt].name, "blk.%lld.%s", (long long)s->info.n_layers, suffix[0]);
        nt++;
    }
    int64_t ncrc = nt + h->crc_extra;
    uint32_t *crc = calloc((size_t)ncrc, sizeof *crc);
    uint64_t *crc64 = calloc((size_t)ncrc, sizeof *crc64);
    cr_assert(crc && crc64);
    for (int64_t i = 0; i < nt; i++) crc64[i] = crc[i] = crc_of(t[i].data, t[i].nbytes);
    if (h->crc_wide) crc64[0] += 1ull << 32;

    int64_t ni = s->info.n_inputs;
    const char **paths = calloc((size_t)ni + 1, sizeof *paths);
    const char **shas = calloc((size_t)ni + 1, sizeof *shas);
    uint64_t *bytes = calloc((size_t)ni + 1, 8), *toks = calloc((size_t)ni + 1, 8);
    uint64_t *wins = calloc((size_t)ni + 1, 8);
    cr_assert(paths && shas && bytes && toks && wins);
    for (int64_t i = 0; i < ni; i++) {
        paths[i] = s->inputs[i].path;
        shas[i] = s->inputs[i].sha256;
        bytes[i] = s->inputs[i].bytes;
        toks[i] = (uint64_t)s->inputs[i].tokens;
        wins[i] = (uint64_t)s->inputs[i].windows;
    }

    struct kv_ggufw *w;
    cr_assert_eq(kv_ggufw_init(&w, &err), KV_OK);
#define KEY(key, call)                                                                         \
    do {                                                                                       \
        if (!h->drop_key || strcmp(h->drop_key, key))                                          \
            cr_assert_eq((call), KV_OK, "%s: %s", key, fmt_err(&err));                         \
    } while (0)
#define STR(key, v) KEY(key, kv_ggufw_add_str(w, key, v, &err))
#define U64(key, v) KEY(key, kv_ggufw_add_u64(w, key, (uint64_t)(v), &err))
    STR("general.type", "kvcal.stats");
    KEY("kvcal.format_version", kv_ggufw_add_u32(w, "kvcal.format_version", h->format_version, &err));
    STR("kvcal.version", s->info.version);
    STR("kvcal.model.fingerprint", s->info.fingerprint);
    U64("kvcal.model.n_layers", s->info.n_layers);
    U64("kvcal.model.dim", s->info.dim);
    U64("kvcal.model.n_heads", s->info.n_heads);
    U64("kvcal.model.n_kv_heads", s->info.n_kv_heads);
    U64("kvcal.model.head_dim", s->info.head_dim);
    U64("kvcal.seq_len", s->info.seq_len);
    U64("kvcal.tokens", s->info.tokens);
    U64("kvcal.sequences", s->info.windows);
    STR("kvcal.sampling", s->info.sampling);
    U64("kvcal.seed", s->info.seed);
    U64("kvcal.samples", s->info.samples);
    U64("kvcal.shard.index", s->info.shard_index);
    U64("kvcal.shard.count", s->info.shard_count);
    U64("kvcal.plan.windows", s->info.plan_windows);
    U64("kvcal.plan.next_window", s->info.next_window);
    uint64_t n = (uint64_t)ni;
    KEY("kvcal.datasets", kv_ggufw_add_arr_str(w, "kvcal.datasets", paths, n, &err));
    KEY("kvcal.datasets.sha256",
        kv_ggufw_add_arr_str(w, "kvcal.datasets.sha256", shas, n - (h->short_sha ? 1 : 0), &err));
    KEY("kvcal.datasets.bytes", kv_ggufw_add_arr_u64(w, "kvcal.datasets.bytes", bytes, n, &err));
    KEY("kvcal.datasets.tokens", kv_ggufw_add_arr_u64(w, "kvcal.datasets.tokens", toks, n, &err));
    KEY("kvcal.datasets.windows", kv_ggufw_add_arr_u64(w, "kvcal.datasets.windows", wins, n, &err));
    if (h->crc_wide)
        KEY("kvcal.crc32", kv_ggufw_add_arr_u64(w, "kvcal.crc32", crc64, (uint64_t)ncrc, &err));
    else
        KEY("kvcal.crc32", kv_ggufw_add_arr_u32(w, "kvcal.crc32", crc, (uint64_t)ncrc, &err));
    if (h->format_version >= 2)
        KEY("kvcal.meta_crc32", kv_ggufw_add_u32(w, "kvcal.meta_crc32", hmeta_crc(s), &err));
#undef U64
#undef STR
#undef KEY
    for (int64_t i = 0; i < nt; i++)
        cr_assert_eq(kv_ggufw_add_tensor(w, t[i].name, t[i].type, t[i].nd, t[i].shape, t[i].data,
                                         t[i].nbytes, &err),
                     KV_OK, "%s", fmt_err(&err));
    char *path = kvt_path(dir, name);
    cr_assert_eq(kv_ggufw_write(w, path, &err), KV_OK, "%s", fmt_err(&err));
    kv_ggufw_free(w);
    for (int64_t i = 0; i < nt; i++) free(t[i].data);
    free(t), free(crc), free(crc64), free(paths), free(shas), free(bytes), free(toks), free(wins);
    return path;
}

#endif
