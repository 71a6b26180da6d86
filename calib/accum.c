/* Streaming float64 accumulation of calibration statistics, and merging.
 *
 * Each window runs through the reference forward pass with hooks. A hook
 * copies the window's fp32 activations to float64 and adds their Gram
 * matrix to the running sum with one dsyrk (upper triangle, beta = 1):
 *   x [n, d]        -> xtx += xᵀx, xsum += Σ rows
 *   q [n, h*d_h]    -> q_cov[i] += q_iᵀ q_i  (column block i, lda h*d_h)
 *   k [n, g*d_h]    -> k_cov[j] += k_jᵀ k_j
 * With Fisher sums, one training pass (kv_grad_run) per window over inputs
 * ids[0..n) and targets ids[1..n], n = seq_len - 1, then per layer:
 *   ∂L/∂W_k [g*d_h, d]  -> fisher_k[r] += Σ_j (∂L/∂W_k[r, j])²
 *   ∂L/∂k [n, g*d_h]    -> grad_k_cov[j] += G_jᵀ G_j  (dsyrk as above)
 * and the same for V. Each window's row sums are formed whole and then
 * added, so a resumed run adds in the same order as an uninterrupted one.
 * Only upper triangles are updated, and s->upper says so: the writer
 * mirrors them as it writes, and kv_accum_sync fills the lower halves in
 * memory, which never feed back into a sum. Left unwritten, the lower
 * halves of the calloc'd sums are never made resident: about 44% of an
 * xtx at d = 4096. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backward.h"
#include "err.h"
#include "kvcalib.h"
#include "kvstats.h"
#include "model.h"

struct kv_accum {
    const struct kv_model *m;
    struct kv_stats *s;
    int64_t seq_len;
    struct kv_fwd *f;
    double *buf;        /* [rows, max(d, h*d_h)] float64 copy of an activation's rows */
    int64_t rows;       /* rows widened at a time: the window, or ACC_BYTES' worth */
    double *colsum;     /* [max(d, g*d_h)] one window's column or row sums */
    struct kv_grad *g;  /* the training pass, with Fisher sums only */
    double loss;        /* its last window's mean loss */
    const char *bad_what; /* set when a hook found a non-finite activation */
    int64_t bad_layer, bad_row;
};

/* The float64 copy takes at most this many bytes: a window's rows are then
 * widened and summed a block at a time (one block, as before, for every
 * model whose window fits). */
#define ACC_BYTES ((int64_t)16 << 20)

/* dst[n, cols] = (double)src, or the first non-finite row (else -1). */
static int64_t widen(double *dst, const float *src, int64_t n, int64_t cols) {
    int64_t bad = INT64_MAX;
#pragma omp parallel for if (n * cols > 65536) schedule(static) reduction(min : bad)
    for (int64_t i = 0; i < n; i++) {
        int ok = 1;
        for (int64_t j = 0; j < cols; j++) {
            float v = src[i * cols + j];
            ok &= isfinite(v) != 0;
            dst[i * cols + j] = (double)v;
        }
        if (!ok && i < bad) bad = i;
    }
    return bad == INT64_MAX ? -1 : bad;
}

/* Σ over the heads' column blocks: cov[i] += Bᵢᵀ Bᵢ for B [n, nh*dh]. */
static void head_grams(double *cov, const double *b, int64_t n, int64_t nh, int64_t dh) {
    for (int64_t i = 0; i < nh; i++)
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)dh, (int)n, 1.0, b + i * dh,
                    (int)(nh * dh), 1.0, cov + i * dh * dh, (int)dh);
}

static int on_attn_in(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0) {
    struct kv_accum *a = ctx;
    struct kv_stats_layer *L = &a->s->layers[layer];
    int64_t d = a->s->info.dim;
    /* window column sums first, then one add: the same order on resume */
    double *cs = a->colsum;
    memset(cs, 0, (size_t)d * sizeof *cs);
    for (int64_t r0 = 0; r0 < n; r0 += a->rows) {
        int64_t nr = n - r0 < a->rows ? n - r0 : a->rows;
        int64_t bad = widen(a->buf, x + r0 * d, nr, d);
        if (bad >= 0) {
            a->bad_what = "attention input", a->bad_layer = layer, a->bad_row = pos0 + r0 + bad;
            return KV_ENUMERIC;
        }
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)d, (int)nr, 1.0, a->buf, (int)d,
                    1.0, L->xtx, (int)d);
        for (int64_t i = 0; i < nr; i++)
            for (int64_t j = 0; j < d; j++) cs[j] += a->buf[i * d + j];
    }
    for (int64_t j = 0; j < d; j++) L->xsum[j] += cs[j];
    return KV_OK;
}

/* cov[i] += Bᵢᵀ Bᵢ per head of src [n, nh*dh] widened a block of rows at a
 * time, or the first non-finite row (else -1). */
static int64_t add_head_grams(struct kv_accum *a, double *cov, const float *src, int64_t n,
                              int64_t nh, int64_t dh) {
    for (int64_t r0 = 0; r0 < n; r0 += a->rows) {
        int64_t nr = n - r0 < a->rows ? n - r0 : a->rows;
        int64_t bad = widen(a->buf, src + r0 * nh * dh, nr, nh * dh);
        if (bad >= 0) return r0 + bad;
        head_grams(cov, a->buf, nr, nh, dh);
    }
    return -1;
}

static int on_qk(void *ctx, int64_t layer, const float *q, const float *k, int64_t n,
                 int64_t pos0) {
    struct kv_accum *a = ctx;
    struct kv_stats_layer *L = &a->s->layers[layer];
    int64_t h = a->s->info.n_heads, g = a->s->info.n_kv_heads, dh = a->s->info.head_dim;
    int64_t bad = add_head_grams(a, L->q_cov, q, n, h, dh);
    if (bad >= 0) {
        a->bad_what = "post-rope query", a->bad_layer = layer, a->bad_row = pos0 + bad;
        return KV_ENUMERIC;
    }
    bad = add_head_grams(a, L->k_cov, k, n, g, dh);
    if (bad >= 0) {
        a->bad_what = "post-rope key", a->bad_layer = layer, a->bad_row = pos0 + bad;
        return KV_ENUMERIC;
    }
    return KV_OK;
}

/* One window's Fisher sums (see the top of the file). */
static int add_fisher(struct kv_accum *a, const int32_t *ids, struct kv_err *err) {
    struct kv_stats *s = a->s;
    int64_t n = a->seq_len - 1, d = s->info.dim, g = s->info.n_kv_heads, dh = s->info.head_dim, kd = g * dh;
    int rc = kv_grad_run(a->g, ids, n, &a->loss, err);
    if (rc) return rc;
    if (!isfinite(a->loss))
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET, "non-finite loss %g", a->loss);
    double *rs = a->colsum;
    for (int64_t l = 0; l < s->info.n_layers; l++)
        for (int side = 0; side < 2; side++) {
            struct kv_stats_layer *L = &s->layers[l];
            const float *gw = kv_grad_of(a->g, side ? KV_W_V : KV_W_K, l); /* [kd, d] */
            KV_ASSERT(gw);
            int64_t bad = INT64_MAX;
#pragma omp parallel for if (kd * d > 65536) schedule(static) reduction(min : bad)
            for (int64_t r = 0; r < kd; r++) {
                double t = 0;
                for (int64_t j = 0; j < d; j++) t += (double)gw[r * d + j] * (double)gw[r * d + j];
                rs[r] = t;
                if (!isfinite(t) && r < bad) bad = r;
            }
            if (bad != INT64_MAX)
                return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                               "non-finite gradient of the %s projection in layer %lld (row %lld)",
                               side ? "v" : "k", (long long)l, (long long)bad);
            double *fs = side ? L->fisher_v : L->fisher_k;
            for (int64_t r = 0; r < kd; r++) fs[r] += rs[r];
            const float *gy = side ? kv_grad_v(a->g, l) : kv_grad_k(a->g, l); /* [n, kd] */
            int64_t row = add_head_grams(a, side ? L->grad_v_cov : L->grad_k_cov, gy, n, g, dh);
            if (row >= 0)
                return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                               "non-finite %s gradient in layer %lld at window position %lld",
                               side ? "value" : "key", (long long)l, (long long)row);
        }
    return KV_OK;
}

void kv_accum_free(struct kv_accum *a) {
    if (!a) return;
    kv_grad_free(a->g);
    kv_fwd_free(a->f);
    free(a->buf);
    free(a->colsum);
    free(a);
}

int kv_accum_init(const struct kv_model *m, struct kv_stats *s, int64_t seq_len,
                  struct kv_accum **out, struct kv_err *err) {
    const struct kv_config *c = &m->cfg;
    if (s->info.n_layers != c->n_layers || s->info.dim != c->dim || s->info.n_heads != c->n_heads ||
        s->info.n_kv_heads != c->n_kv_heads || s->info.head_dim != c->head_dim)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "statistics shaped for another model (dim %lld, %lld layers)",
                       (long long)s->info.dim, (long long)s->info.n_layers);
    struct kv_accum *a = calloc(1, sizeof *a);
    if (!a) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    a->m = m;
    a->s = s;
    a->seq_len = seq_len;
    int rc = kv_fwd_init(m, seq_len, &a->f, err);
    if (rc) {
        kv_accum_free(a);
        return rc;
    }
    kv_fwd_one_window(a->f); /* windows from position 0: one layer's cache serves all */
    if (s->info.has_fisher && seq_len < 2) {
        kv_accum_free(a);
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "fisher statistics need windows of at least 2 tokens, got %lld",
                       (long long)seq_len);
    }
    if (s->info.has_fisher && (rc = kv_grad_init(m, seq_len - 1, &a->g, err))) {
        kv_accum_free(a);
        return rc;
    }
    int64_t w = c->dim, kd = c->n_kv_heads * c->head_dim;
    if (c->n_heads * c->head_dim > w) w = c->n_heads * c->head_dim;
    a->rows = ACC_BYTES / (w * (int64_t)sizeof(double));
    if (a->rows < 1) a->rows = 1;
    if (a->rows > seq_len) a->rows = seq_len;
    a->buf = malloc((size_t)(a->rows * w) * sizeof *a->buf);
    a->colsum = malloc((size_t)(c->dim > kd ? c->dim : kd) * sizeof *a->colsum);
    if (!a->buf || !a->colsum) {
        kv_accum_free(a);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    struct kv_fwd_hooks hk = {0};
    hk.ctx = a;
    hk.attn_in = on_attn_in;
    hk.qk_rope = on_qk;
    hk.hooks_only = 1;
    kv_fwd_set_hooks(a->f, &hk);
    *out = a;
    return KV_OK;
}

int kv_accum_window(struct kv_accum *a, const int32_t *ids, struct kv_err *err) {
    a->bad_what = NULL;
    a->s->upper = 1; /* the lower triangles are stale from here on */
    int rc = kv_fwd_run(a->f, ids, a->seq_len, 0, NULL, err);
    if (rc && a->bad_what)
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET,
                       "non-finite %s in layer %lld at window position %lld", a->bad_what,
                       (long long)a->bad_layer, (long long)a->bad_row);
    if (!rc && a->g) rc = add_fisher(a, ids, err);
    return rc;
}

double kv_accum_loss(const struct kv_accum *a) { return a->g ? a->loss : 0; }

void kv_accum_sync(struct kv_accum *a) { kv_stats_mirror(a->s); }

/* ------------------------------------------------------------------ merge */

int kv_stats_check_complete(const struct kv_stats *s, const char *path, struct kv_err *err) {
    if (s->info.next_window < s->info.plan_windows)
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "an unfinished checkpoint (%lld of %lld windows); finish it with "
                       "'kvcal collect --resume' first", (long long)s->info.next_window,
                       (long long)s->info.plan_windows);
    return KV_OK;
}

int kv_stats_merge_files(const char *const *paths, int64_t n, const char *out_path,
                         struct kv_stats **out, struct kv_err *err) {
    KV_ASSERT(n >= 1);
    struct kv_stats *acc = NULL, *b = NULL;
    /* a lone shard still gets the checks a merge makes */
    int rc = kv_stats_open(paths[0], &acc, err);
    if (!rc) rc = kv_stats_check_complete(acc, paths[0], err);
    for (int64_t i = 1; !rc && i < n; i++) {
        rc = kv_stats_open(paths[i], &b, err);
        if (!rc) rc = kv_stats_merge(acc, b, paths[i], err);
        kv_stats_free(b);
        b = NULL;
    }
    if (!rc) rc = kv_stats_write(acc, out_path, err);
    if (rc) {
        kv_stats_free(acc);
        return rc;
    }
    *out = acc;
    return KV_OK;
}

int kv_stats_merge(struct kv_stats *acc, const struct kv_stats *b, const char *b_path,
                   struct kv_err *err) {
    if (strcmp(acc->info.fingerprint, b->info.fingerprint))
        return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                       "collected on another model (fingerprint %.12s, the first shard has %.12s)",
                       b->info.fingerprint, acc->info.fingerprint);
    if (acc->info.n_layers != b->info.n_layers || acc->info.dim != b->info.dim || acc->info.n_heads != b->info.n_heads ||
        acc->info.n_kv_heads != b->info.n_kv_heads || acc->info.head_dim != b->info.head_dim)
        return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                       "shaped for another model (dim %lld, %lld layers; the first shard has dim "
                       "%lld, %lld layers)", (long long)b->info.dim, (long long)b->info.n_layers,
                       (long long)acc->info.dim, (long long)acc->info.n_layers);
    if (acc->info.has_fisher != b->info.has_fisher)
        return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                       "%s fisher statistics and the first shard %s; collect every shard with "
                       "--fisher, or none", b->info.has_fisher ? "has" : "has no",
                       acc->info.has_fisher ? "has them" : "has none");
    if (acc->info.seq_len != b->info.seq_len)
        return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                       "seq-len %lld differs from the first shard's %lld; statistics of different "
                       "window lengths do not add up", (long long)b->info.seq_len,
                       (long long)acc->info.seq_len);
    if (strcmp(acc->info.tokenization, b->info.tokenization))
        return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                       "tokenized as '%s' but the first shard as '%s'; collect every shard with "
                       "the same tokenizer and --parse-special choice",
                       b->info.tokenization[0] ? b->info.tokenization : "(not recorded)",
                       acc->info.tokenization[0] ? acc->info.tokenization : "(not recorded)");
    int rc = kv_stats_check_complete(b, b_path, err);
    if (rc) return rc;
    KV_ASSERT(!b->upper && "kv_stats_mirror the statistics to add first");
    if (acc->info.next_window < acc->info.plan_windows)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "the first shard is an unfinished checkpoint (%lld of %lld windows)",
                       (long long)acc->info.next_window, (long long)acc->info.plan_windows);
    /* the same shard twice (a plan is its sampling, seed, size, shard and inputs) */
    int same_plan = strcmp(acc->info.sampling, "merged") && !strcmp(acc->info.sampling, b->info.sampling) &&
                    acc->info.seed == b->info.seed && acc->info.samples == b->info.samples &&
                    acc->info.shard_index == b->info.shard_index && acc->info.shard_count == b->info.shard_count &&
                    acc->info.plan_windows == b->info.plan_windows && acc->info.n_inputs == b->info.n_inputs;
    for (int64_t i = 0; same_plan && i < acc->info.n_inputs; i++)
        same_plan = !strcmp(acc->inputs[i].sha256, b->inputs[i].sha256);
    if (same_plan)
        return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                       "the same windows as the first shard (same inputs, plan and shard "
                       "%lld/%lld); merging would count them twice",
                       (long long)b->info.shard_index, (long long)b->info.shard_count);
    int64_t tokens, windows;
    if (__builtin_add_overflow(acc->info.tokens, b->info.tokens, &tokens) ||
        __builtin_add_overflow(acc->info.windows, b->info.windows, &windows))
        return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                       "its %lld tokens overflow the merged count of %lld", (long long)b->info.tokens,
                       (long long)acc->info.tokens);
    /* check every input first, so a refusal leaves acc untouched */
    for (int pass = 0; pass < 2; pass++)
        for (int64_t i = 0; i < b->info.n_inputs; i++) {
            const struct kv_stats_input *in = &b->inputs[i];
            int64_t j = 0;
            for (; j < acc->info.n_inputs; j++)
                if (!strcmp(acc->inputs[j].sha256, in->sha256)) break;
            if (j == acc->info.n_inputs) {
                rc = pass ? kv_stats_add_input(acc, in->path, in->sha256, in->bytes,
                                                   in->tokens, in->windows, err)
                              : KV_OK;
                if (rc) return rc;
                continue;
            }
            /* the reader keeps each input's windows within tokens / seq_len,
             * so the sum cannot overflow */
            int64_t w = acc->inputs[j].windows + in->windows;
            if (acc->inputs[j].tokens != in->tokens)
                return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                               "input '%s' has %lld tokens here and %lld in the first shard; "
                               "were the shards tokenized differently?", in->path,
                               (long long)in->tokens, (long long)acc->inputs[j].tokens);
            if (w > in->tokens / acc->info.seq_len)
                return kv_fail(err, KV_EINVAL, b_path, KV_NO_OFFSET,
                               "merging would count %lld windows of input '%s', which holds only "
                               "%lld; is a shard given twice?", (long long)w, in->path,
                               (long long)(in->tokens / acc->info.seq_len));
            if (pass) acc->inputs[j].windows = w;
        }
    for (int64_t l = 0; l < acc->info.n_layers; l++)
        for (int t = 0; t < kv_stats_layer_tensors(acc); t++) {
            char name[64];
            int64_t shape[3];
            int nd = kv_stats_tensor_desc(acc, l, t, name, sizeof name, shape);
            int64_t n = shape[0] * (nd > 1 ? shape[1] : 1) * (nd > 2 ? shape[2] : 1);
            double *x = kv_stats_tensor_data(acc, l, t);
            const double *y = kv_stats_tensor_data(b, l, t);
            for (int64_t i = 0; i < n; i++) x[i] += y[i];
        }
    acc->info.tokens = tokens;
    acc->info.windows = windows;
    snprintf(acc->info.sampling, sizeof acc->info.sampling, "merged");
    acc->info.seed = 0;
    acc->info.samples = 0;
    acc->info.shard_index = 0;
    acc->info.shard_count = 1;
    acc->info.plan_windows = acc->info.windows;
    acc->info.next_window = acc->info.windows;
    return KV_OK;
}
