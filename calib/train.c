/* `kvcal train`: a small model trained from scratch with kvcal's own
 * backward pass (lib/backward.c), to make fixture models.
 *
 * One step draws `batch` random windows of seq_len+1 tokens from the
 * training stream (a fraction bos_fraction of them start with BOS, the rest
 * are plain crops), sums their gradients, averages, clips the global norm,
 * and applies AdamW:
 *     m = b1 m + (1-b1) g,  v = b2 v + (1-b2) g²,
 *     w -= lr (m̂ / (√v̂ + eps) + wd w)   (wd on 2-D weights only),
 * with lr warming up linearly over `warmup` steps and then following a
 * cosine from lr to min_lr at the last step.
 *
 * The checkpoint is a safetensors file: for each parameter tensor
 * "w.NAME", "m.NAME" and "v.NAME" (F32), the loss log "log" (F64 [steps, 6]:
 * step, tokens, loss, lr, grad norm, eval loss or NaN), and __metadata__
 * with the step, the random stream state and every option that must match
 * on resume. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arch.h"
#include "backward.h"
#include "err.h"
#include "kvcalib.h"
#include "mapfile.h"
#include "model.h"
#include "safetensors.h"
#include "stwrite.h"

#define LOG_COLS 6

void kv_train_defaults(struct kv_train_opts *o) {
    o->seq_len = 256;
    o->batch = 16;
    o->steps = 2000;
    o->warmup = 100;
    o->lr = 2e-3;
    o->min_lr = 2e-4;
    o->weight_decay = 0.1;
    o->beta1 = 0.9;
    o->beta2 = 0.95;
    o->adam_eps = 1e-8;
    o->grad_clip = 1.0;
    o->bos_fraction = 0.125;
    o->seed = 1;
    o->eval_every = 100;
    o->eval_windows = 32;
    o->ckpt_every = 100;
    o->log_every = 10;
    o->out_dtype = KV_DTYPE_F16;
}

/* ---------------------------------------------------------------- checks */

/* The library's own names of the options, for messages without the caller's. */
static const char *const own_names[KV_TRAIN_OPT_COUNT] = {
    [KV_TRAIN_OPT_ARCH] = "architecture",
    [KV_TRAIN_OPT_DIM] = "dim",
    [KV_TRAIN_OPT_HEADS] = "heads",
    [KV_TRAIN_OPT_KV_HEADS] = "kv heads",
    [KV_TRAIN_OPT_SEQ_LEN] = "seq len",
    [KV_TRAIN_OPT_BATCH] = "batch",
    [KV_TRAIN_OPT_STEPS] = "steps",
    [KV_TRAIN_OPT_LOG_EVERY] = "log every",
    [KV_TRAIN_OPT_WARMUP] = "warmup",
    [KV_TRAIN_OPT_LR] = "lr",
    [KV_TRAIN_OPT_MIN_LR] = "min lr",
    [KV_TRAIN_OPT_WEIGHT_DECAY] = "weight decay",
    [KV_TRAIN_OPT_CLIP] = "clip",
};

int kv_train_config(const char *arch, int64_t dim, int64_t n_layers, int64_t n_heads,
                    int64_t n_kv_heads, int64_t hidden, int64_t ctx, struct kv_config *cfg,
                    const char *const *names, struct kv_err *err) {
    const char *const *n = names ? names : own_names;
    struct kv_config c = {0};
    const struct kv_arch_desc *a = kv_arch_by_name(arch);
    if (!a)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "unknown %s '%s' (%s)",
                       n[KV_TRAIN_OPT_ARCH], arch, kv_arch_list(0));
    c.arch = a->id;
    if (dim <= 0 || n_layers <= 0 || n_heads <= 0 || dim % n_heads)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %lld is not a positive multiple of %s %lld",
                       n[KV_TRAIN_OPT_DIM], (long long)dim, n[KV_TRAIN_OPT_HEADS], (long long)n_heads);
    if (n_kv_heads < 0) n_kv_heads = a->mha ? n_heads : (n_heads > 1 ? n_heads / 2 : 1);
    if (n_kv_heads <= 0 || n_heads % n_kv_heads)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s %lld is not a multiple of %s %lld",
                       n[KV_TRAIN_OPT_HEADS], (long long)n_heads, n[KV_TRAIN_OPT_KV_HEADS],
                       (long long)n_kv_heads);
    if (a->mha && n_kv_heads != n_heads)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s has one KV head per head (%s %lld, %s %lld)",
                       a->name, n[KV_TRAIN_OPT_KV_HEADS], (long long)n_kv_heads,
                       n[KV_TRAIN_OPT_HEADS], (long long)n_heads);
    if (hidden < 0) hidden = a->gelu_mlp ? 4 * dim : (8 * dim / 3 + 63) / 64 * 64;
    c.dim = dim, c.n_layers = n_layers, c.n_heads = n_heads, c.n_kv_heads = n_kv_heads;
    c.head_dim = dim / n_heads, c.hidden_dim = hidden, c.max_seq_len = ctx;
    c.norm_eps = 1e-5f, c.rope_theta = 10000.0f, c.rope_layout = KV_ROPE_HALF;
    c.tied_embeddings = a->tied_default;
    *cfg = c;
    return KV_OK;
}

int kv_train_check(const struct kv_train_opts *o, const char *const *names, struct kv_err *err) {
    if (o->seq_len < 2 || o->batch < 1 || o->steps < 1 || o->warmup < 0 || o->log_every < 1)
        return names ? kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "%s must be at least 2, %s, %s and %s at least 1, %s at least 0",
                               names[KV_TRAIN_OPT_SEQ_LEN], names[KV_TRAIN_OPT_BATCH],
                               names[KV_TRAIN_OPT_STEPS], names[KV_TRAIN_OPT_LOG_EVERY],
                               names[KV_TRAIN_OPT_WARMUP])
                     : kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "training options are out of range");
    if (!(o->lr > 0) || !(o->min_lr >= 0) || !(o->weight_decay >= 0) || !(o->grad_clip >= 0))
        return names ? kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "%s must be positive; %s, %s and %s at least 0",
                               names[KV_TRAIN_OPT_LR], names[KV_TRAIN_OPT_MIN_LR],
                               names[KV_TRAIN_OPT_WEIGHT_DECAY], names[KV_TRAIN_OPT_CLIP])
                     : kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "training options are out of range");
    return KV_OK;
}

int kv_train_check_resume(const struct kv_train_opts *o, struct kv_err *err) {
    struct stat st;
    if (o->resume && stat(o->ckpt_path, &st) != 0)
        return kv_fail(err, KV_EIO, o->ckpt_path, KV_NO_OFFSET, "no checkpoint to resume from");
    return KV_OK;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double unif(uint64_t *s) { return ((double)(splitmix(s) >> 11) + 0.5) * 0x1.0p-53; }

static double normal(uint64_t *s) {
    return sqrt(-2.0 * log(unif(s))) * cos(2.0 * M_PI * unif(s));
}

struct trainer {
    struct kv_train_opts *o;
    char stage[2048];   /* out_dir.tmp-PID: the output until it is whole, or "" */
    struct kv_model *m;
    struct kv_tokenizer *tok;
    struct kv_grad *g;
    int32_t *train, *eval;
    int64_t n_train, n_eval;
    int64_t n_t;             /* parameter tensors */
    float **w, **gr;         /* [n_t] */
    int64_t *cnt;
    int *decay;
    float *acc, *am, *av;    /* gradient sum and Adam moments, concatenated */
    int64_t total;
    int32_t *win;            /* one window, seq_len+1 */
    double *log;             /* [steps][LOG_COLS] */
    int64_t step;            /* steps done */
    uint64_t rng;
    int64_t tokens;
};

static void trainer_free(struct trainer *t) {
    kv_grad_free(t->g);
    kv_model_close(t->m);
    kv_tok_free(t->tok);
    free(t->train), free(t->eval), free(t->w), free(t->gr), free(t->cnt), free(t->decay);
    free(t->acc), free(t->am), free(t->av), free(t->win), free(t->log);
}

/* GPT-2 style initialisation: N(0, 0.02) matrices, residual outputs (W_o,
 * W_down) scaled by 1/√(2L), N(0, 0.01) positions, unit gains, zero biases. */
static void init_weights(struct trainer *t) {
    const struct kv_config *c = &t->m->cfg;
    uint64_t s = t->o->seed ^ 0x6b76636174726169ull;
    for (int k = 0; k < KV_W_COUNT; k++) {
        int64_t nl = k < KV_W_FIRST_LAYER ? 1 : c->n_layers, sh[2];
        int nd = kv_model_expected_shape(c, k, sh);
        int64_t n = nd == 2 ? sh[0] * sh[1] : sh[0];
        for (int64_t l = 0; l < nl; l++) {
            if (k == KV_W_LM_HEAD && c->tied_embeddings) continue;
            float *w = kv_model_weight_mut(t->m, k, l);
            if (!w) continue;
            int gain = k == KV_W_ATTN_NORM || k == KV_W_FFN_NORM || k == KV_W_OUT_NORM;
            double sd = k == KV_W_POS_EMB ? 0.01
                        : (k == KV_W_O || k == KV_W_DOWN) ? 0.02 / sqrt(2.0 * (double)c->n_layers)
                                                           : 0.02;
            for (int64_t i = 0; i < n; i++)
                w[i] = nd == 2 ? (float)(sd * normal(&s)) : (gain ? 1.0f : 0.0f);
        }
    }
}

static int read_tokens(const char *path, const struct kv_tokenizer *tok, int bos, int32_t **ids,
                       int64_t *n, struct kv_err *err) {
    char *text;
    size_t len;
    int rc = kv_text_read(path, &text, &len, err);
    if (rc) return rc;
    rc = kv_tok_encode(tok, text, len, bos, ids, n, err);
    free(text);
    return rc;
}

/* The eval windows: non-overlapping seq_len+1 spans of the eval stream. */
static int64_t eval_count(const struct trainer *t) {
    int64_t n = t->n_eval > 0 ? (t->n_eval - 1) / t->o->seq_len : 0;
    return n < t->o->eval_windows ? n : t->o->eval_windows;
}

static int eval_loss(struct trainer *t, double *out, struct kv_err *err) {
    int64_t nw = eval_count(t), L = t->o->seq_len;
    double s = 0;
    for (int64_t i = 0; i < nw; i++) {
        double l;
        int rc = kv_grad_loss(t->g, t->eval + i * L, L, &l, err);
        if (rc) return rc;
        s += l;
    }
    *out = nw ? s / (double)nw : NAN;
    return KV_OK;
}

/* Held-out loss of an add-one unigram model of the training stream, on the
 * targets eval_loss scores. */
static double unigram_loss(const struct trainer *t) {
    int64_t V = t->m->cfg.vocab_size, nw = eval_count(t), L = t->o->seq_len;
    double *cnt = calloc((size_t)V, sizeof *cnt);
    if (!cnt || !nw) {
        free(cnt);
        return NAN;
    }
    for (int64_t i = 0; i < t->n_train; i++) cnt[t->train[i]] += 1;
    double tot = (double)t->n_train + (double)V, s = 0;
    for (int64_t w = 0; w < nw; w++)
        for (int64_t i = 1; i <= L; i++) s -= log((cnt[t->eval[w * L + i]] + 1.0) / tot);
    free(cnt);
    return s / (double)(nw * L);
}

static void draw_window(struct trainer *t) {
    int64_t L = t->o->seq_len;
    int bos = t->m->cfg.bos_id >= 0 && unif(&t->rng) < t->o->bos_fraction;
    int64_t need = L + 1 - bos;
    int64_t off = (int64_t)(unif(&t->rng) * (double)(t->n_train - need + 1));
    if (off > t->n_train - need) off = t->n_train - need;
    if (bos) t->win[0] = t->m->cfg.bos_id;
    memcpy(t->win + bos, t->train + off, (size_t)need * sizeof(int32_t));
}

static double lr_at(const struct kv_train_opts *o, int64_t step) {
    if (step < o->warmup) return o->lr * (double)(step + 1) / (double)o->warmup;
    double p = o->steps > o->warmup ? (double)(step - o->warmup) / (double)(o->steps - o->warmup) : 1.0;
    return o->min_lr + 0.5 * (o->lr - o->min_lr) * (1.0 + cos(M_PI * (p > 1 ? 1 : p)));
}

static int train_step(struct trainer *t, struct kv_train_log *lg, struct kv_err *err) {
    const struct kv_train_opts *o = t->o;
    memset(t->acc, 0, (size_t)t->total * sizeof(float));
    double loss = 0;
    for (int64_t b = 0; b < o->batch; b++) {
        draw_window(t);
        double l;
        int rc = kv_grad_run(t->g, t->win, o->seq_len, &l, err);
        if (rc) return rc;
        loss += l;
        float *a = t->acc;
        for (int64_t i = 0; i < t->n_t; i++) {
            const float *gi = t->gr[i];
            for (int64_t j = 0; j < t->cnt[i]; j++) a[j] += gi[j];
            a += t->cnt[i];
        }
    }
    double inv = 1.0 / (double)o->batch, nrm = 0;
    for (int64_t j = 0; j < t->total; j++) {
        t->acc[j] = (float)(t->acc[j] * inv);
        nrm += (double)t->acc[j] * t->acc[j];
    }
    nrm = sqrt(nrm);
    if (!isfinite(nrm))
        return kv_fail(err, KV_ENUMERIC, NULL, KV_NO_OFFSET, "step %lld: gradient norm is %s",
                       (long long)t->step + 1, isnan(nrm) ? "nan" : "inf");
    double clip = o->grad_clip > 0 && nrm > o->grad_clip ? o->grad_clip / nrm : 1.0;
    double lr = lr_at(o, t->step);
    int64_t s1 = t->step + 1;
    double bc1 = 1.0 - pow(o->beta1, (double)s1), bc2 = 1.0 - pow(o->beta2, (double)s1);
    int64_t off = 0;
    for (int64_t i = 0; i < t->n_t; i++) {
        float *w = t->w[i];
        double wd = t->decay[i] ? o->weight_decay : 0.0;
        for (int64_t j = 0; j < t->cnt[i]; j++) {
            double gj = t->acc[off + j] * clip;
            double m = o->beta1 * t->am[off + j] + (1 - o->beta1) * gj;
            double v = o->beta2 * t->av[off + j] + (1 - o->beta2) * gj * gj;
            t->am[off + j] = (float)m, t->av[off + j] = (float)v;
            w[j] = (float)(w[j] - lr * ((m / bc1) / (sqrt(v / bc2) + o->adam_eps) + wd * w[j]));
        }
        off += t->cnt[i];
    }
    t->tokens += o->batch * o->seq_len;
    t->step++;
    lg->step = t->step, lg->steps = o->steps, lg->tokens = t->tokens;
    lg->loss = loss * inv, lg->lr = lr, lg->grad_norm = nrm, lg->eval_loss = NAN;
    return KV_OK;
}

/* ---------------------------------------------------------------- checkpoints */

/* The options a resume must share with the checkpoint, as metadata. */
static int ckpt_fingerprint(const struct trainer *t, char *buf, size_t cap) {
    const struct kv_train_opts *o = t->o;
    const struct kv_config *c = &t->m->cfg;
    char n[8][32];
    return snprintf(buf, cap,
                    "arch=%s dim=%lld hidden=%lld layers=%lld heads=%lld kv=%lld head_dim=%lld "
                    "vocab=%lld ctx=%lld seq_len=%lld batch=%lld steps=%lld warmup=%lld lr=%s "
                    "min_lr=%s wd=%s b1=%s b2=%s eps=%s clip=%s bos=%s seed=%" PRIu64,
                    kv_arch_name(c->arch), (long long)c->dim, (long long)c->hidden_dim,
                    (long long)c->n_layers, (long long)c->n_heads, (long long)c->n_kv_heads,
                    (long long)c->head_dim, (long long)c->vocab_size, (long long)c->max_seq_len,
                    (long long)o->seq_len, (long long)o->batch, (long long)o->steps,
                    (long long)o->warmup, kv_num_str(n[0], 32, o->lr), kv_num_str(n[1], 32, o->min_lr),
                    kv_num_str(n[2], 32, o->weight_decay), kv_num_str(n[3], 32, o->beta1), kv_num_str(n[4], 32, o->beta2),
                    kv_num_str(n[5], 32, o->adam_eps), kv_num_str(n[6], 32, o->grad_clip),
                    kv_num_str(n[7], 32, o->bos_fraction), o->seed);
}

static int ckpt_write(const struct trainer *t, struct kv_err *err) {
    struct kv_stw *w;
    int rc = kv_stw_init(&w, err);
    if (rc) return rc;
    char fp[1024], num[32], name[96];
    ckpt_fingerprint(t, fp, sizeof fp);
    rc = kv_stw_add_meta(w, "format", "kvcal.train.checkpoint", err);
    if (!rc) rc = kv_stw_add_meta(w, "version", "1", err);
    if (!rc) rc = kv_stw_add_meta(w, "options", fp, err);
    snprintf(num, sizeof num, "%lld", (long long)t->step);
    if (!rc) rc = kv_stw_add_meta(w, "step", num, err);
    snprintf(num, sizeof num, "%" PRIu64, t->rng);
    if (!rc) rc = kv_stw_add_meta(w, "rng", num, err);
    snprintf(num, sizeof num, "%lld", (long long)t->tokens);
    if (!rc) rc = kv_stw_add_meta(w, "tokens", num, err);
    int64_t off = 0;
    for (int64_t i = 0; !rc && i < t->n_t; i++) {
        const char *tn = kv_grad_tensor(t->g, i, NULL, NULL, NULL);
        int64_t sh[1] = {t->cnt[i]};
        uint64_t nb = (uint64_t)t->cnt[i] * 4;
        snprintf(name, sizeof name, "w.%s", tn);
        rc = kv_stw_add(w, name, KV_DTYPE_F32, 1, sh, t->w[i], nb, err);
        snprintf(name, sizeof name, "m.%s", tn);
        if (!rc) rc = kv_stw_add(w, name, KV_DTYPE_F32, 1, sh, t->am + off, nb, err);
        snprintf(name, sizeof name, "v.%s", tn);
        if (!rc) rc = kv_stw_add(w, name, KV_DTYPE_F32, 1, sh, t->av + off, nb, err);
        off += t->cnt[i];
    }
    int64_t lsh[2] = {t->step, LOG_COLS};
    if (!rc)
        rc = kv_stw_add(w, "log", KV_DTYPE_F64, 2, lsh, t->log,
                        (uint64_t)(t->step * LOG_COLS) * sizeof(double), err);
    if (!rc) rc = kv_stw_write(w, t->o->ckpt_path, err);
    kv_stw_free(w);
    return rc;
}

/* Compare two "key=value ..." option lists item by item, values that both
 * parse as numbers by value (so 0.002 and 0.0020000000000000000 agree). On
 * the first difference copy both items into wa and wb and return 1. */
static int options_differ(const char *a, const char *b, char *wa, char *wb, size_t cap) {
    while (*a || *b) {
        size_t la = strcspn(a, " "), lb = strcspn(b, " ");
        const char *ea = memchr(a, '=', la), *eb = memchr(b, '=', lb);
        int same = ea && eb && ea - a == eb - b && memcmp(a, b, (size_t)(ea - a)) == 0;
        if (same && (la != lb || memcmp(a, b, la) != 0)) {
            char va[64], vb[64], *xa, *xb;
            snprintf(va, sizeof va, "%.*s", (int)(la - (size_t)(ea - a) - 1), ea + 1);
            snprintf(vb, sizeof vb, "%.*s", (int)(lb - (size_t)(eb - b) - 1), eb + 1);
            double da = strtod(va, &xa), db = strtod(vb, &xb);
            same = *va && *vb && !*xa && !*xb && da == db;
        }
        if (!same) {
            snprintf(wa, cap, "%.*s", (int)la, a);
            snprintf(wb, cap, "%.*s", (int)lb, b);
            return 1;
        }
        a += la + (a[la] == ' '), b += lb + (b[lb] == ' ');
    }
    return 0;
}

static int ckpt_tensor(const struct kv_st_file *f, const char *path, const char *name,
                       enum kv_dtype dt, int64_t count, const struct kv_tensor **out,
                       struct kv_err *err) {
    const struct kv_tensor *x = kv_st_find(f, name);
    if (!x) return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "checkpoint has no tensor '%s'", name);
    if (x->dtype != dt || kv_tensor_numel(x) != count)
        return kv_fail(err, KV_EFORMAT, path, x->offset,
                       "checkpoint tensor '%s' has %lld %s elements, expected %lld %s", name,
                       (long long)kv_tensor_numel(x), kv_dtype_name(x->dtype), (long long)count,
                       kv_dtype_name(dt));
    *out = x;
    return KV_OK;
}

static int ckpt_read(struct trainer *t, struct kv_err *err) {
    const char *path = t->o->ckpt_path;
    struct kv_st_file *f;
    int rc = kv_st_open(path, &f, err);
    if (rc) return rc;
    char fp[1024];
    ckpt_fingerprint(t, fp, sizeof fp);
    const char *fmt = kv_st_meta(f, "format"), *ver = kv_st_meta(f, "version");
    const char *opt = kv_st_meta(f, "options"), *st = kv_st_meta(f, "step");
    const char *rg = kv_st_meta(f, "rng"), *tk = kv_st_meta(f, "tokens");
    if (!fmt || strcmp(fmt, "kvcal.train.checkpoint") != 0 || !ver || strcmp(ver, "1") != 0 ||
        !opt || !st || !rg || !tk) {
        kv_st_close(f);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                       "not a kvcal training checkpoint (version 1)");
    }
    char wa[96], wb[96];
    if (options_differ(opt, fp, wa, wb, sizeof wa)) {
        kv_st_close(f);
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "checkpoint was made with %s, this run has %s", wa, wb);
    }
    char *end;
    errno = 0;
    long long step = strtoll(st, &end, 10);
    int bad = errno || *end || step < 0 || step > t->o->steps;
    t->rng = strtoull(rg, &end, 10);
    bad |= *end != 0;
    t->tokens = strtoll(tk, &end, 10);
    bad |= *end != 0;
    if (bad) {
        kv_st_close(f);
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "checkpoint step '%.32s' is invalid", st);
    }
    t->step = step;
    char name[96];
    int64_t off = 0;
    for (int64_t i = 0; !rc && i < t->n_t; i++) {
        const char *tn = kv_grad_tensor(t->g, i, NULL, NULL, NULL);
        const char *pre[3] = {"w", "m", "v"};
        float *dst[3] = {t->w[i], t->am + off, t->av + off};
        for (int p = 0; !rc && p < 3; p++) {
            const struct kv_tensor *x;
            snprintf(name, sizeof name, "%s.%s", pre[p], tn);
            rc = ckpt_tensor(f, path, name, KV_DTYPE_F32, t->cnt[i], &x, err);
            if (!rc) memcpy(dst[p], x->data, (size_t)t->cnt[i] * 4);
            for (int64_t j = 0; !rc && j < t->cnt[i]; j++)
                if (!isfinite(dst[p][j]))
                    rc = kv_fail(err, KV_ENUMERIC, path, x->offset + (uint64_t)j * 4,
                                 "checkpoint tensor '%s' element %lld is not finite", name, (long long)j);
        }
        off += t->cnt[i];
    }
    const struct kv_tensor *lx;
    if (!rc) rc = ckpt_tensor(f, path, "log", KV_DTYPE_F64, step * LOG_COLS, &lx, err);
    if (!rc && step) memcpy(t->log, lx->data, (size_t)(step * LOG_COLS) * sizeof(double));
    kv_st_close(f);
    return rc;
}

/* ---------------------------------------------------------------- outputs */

static int log_fill(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    const struct trainer *t = ctx;
    FILE *fp = fdopen(dup(fd), "w");
    char eb[128];
    if (!fp) return kv_fail(err, KV_EIO, tmp, KV_NO_OFFSET, "cannot write: %s", kv_errtext(errno, eb, sizeof eb));
    fprintf(fp, "step\ttokens\tloss\tlr\tgrad_norm\teval_loss\n");
    for (int64_t i = 0; i < t->step; i++) {
        const double *r = t->log + i * LOG_COLS;
        fprintf(fp, "%lld\t%lld\t%.6f\t%.6g\t%.4f\t", (long long)r[0], (long long)r[1], r[2], r[3],
                r[4]);
        if (isnan(r[5]))
            fprintf(fp, "\n");
        else
            fprintf(fp, "%.6f\n", r[5]);
    }
    int bad = ferror(fp) | (fclose(fp) != 0);
    return bad ? kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write the training log") : KV_OK;
}

/* The files a trained model's directory holds: out_dir may be replaced
 * only when it holds nothing else. */
static const char *const out_files[] = {"config.json", "model.safetensors", "tokenizer.json",
                                        "train_log.tsv"};

static int check_out_dir(const char *dir, struct kv_err *err) {
    int kind = kv_path_kind(dir);
    if (kind < 0) return KV_OK;
    if (kind == 0) return kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET, "exists and is not a directory");
    char eb[128];
    DIR *d = opendir(dir);
    if (!d)
        return kv_fail(err, KV_EIO, dir, KV_NO_OFFSET, "cannot open directory: %s",
                       kv_errtext(errno, eb, sizeof eb));
    int rc = KV_OK;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        int known = 0;
        for (size_t i = 0; i < sizeof out_files / sizeof out_files[0]; i++)
            known |= !strcmp(e->d_name, out_files[i]);
        if (!known)
            rc = kv_fail(err, KV_EINVAL, dir, KV_NO_OFFSET,
                         "holds '%.200s', not a file of a trained model (config.json, "
                         "model.safetensors, tokenizer.json, train_log.tsv); refusing to "
                         "replace it",
                         e->d_name);
    }
    closedir(d);
    return rc;
}

/* The model, its tokenizer and the log into the staging directory, then
 * the staging directory in place of out_dir in one step (kv_dir_install):
 * out_dir is the earlier output or the new one, whole, at every moment. */
static int write_outputs(struct trainer *t, const char *tok_path, struct kv_err *err) {
    int rc = check_out_dir(t->o->out_dir, err); /* again: it may have changed meanwhile */
    if (!rc) rc = kv_hf_write(t->m, t->stage, t->o->out_dtype, tok_path, err);
    if (rc) return rc;
    char path[4096];
    snprintf(path, sizeof path, "%s/train_log.tsv", t->stage);
    if ((rc = kv_write_atomic(path, log_fill, t, err)) || (rc = kv_fsync_dir(t->stage, t->stage, err)) ||
        (rc = kv_dir_install(t->stage, t->o->out_dir, err)))
        return rc;
    t->stage[0] = 0;
    return KV_OK;
}

/* ---------------------------------------------------------------- the run */

static int setup(struct trainer *t, char *tok_path, size_t cap, struct kv_err *err) {
    struct kv_train_opts *o = t->o;
    int rc = kv_train_check(o, NULL, err);
    if (rc) return rc;
    if (!(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) ||
        !(o->adam_eps > 0) || !(o->bos_fraction >= 0 && o->bos_fraction <= 1) ||
        o->eval_every < 0 || o->eval_windows < 0 || o->ckpt_every < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "training options are out of range");
    /* nothing is created before the inputs are known to be readable */
    const char *ins[2] = {o->train_path, o->eval_path};
    for (int i = 0; i < 2; i++)
        if (ins[i] && access(ins[i], R_OK) != 0) {
            char eb[128];
            return kv_fail(err, KV_EIO, ins[i], KV_NO_OFFSET, "cannot open: %s",
                           kv_errtext(errno, eb, sizeof eb));
        }
    /* the output is made in out_dir.tmp-PID and put in place at the end */
    if ((rc = check_out_dir(o->out_dir, err))) return rc;
    size_t n = strlen(o->out_dir);
    while (n > 1 && o->out_dir[n - 1] == '/') n--;
    snprintf(t->stage, sizeof t->stage, "%.*s.tmp-%ld", (int)n, o->out_dir, (long)getpid());
    if (mkdir(t->stage, 0755) != 0) {
        char eb[128];
        int e = errno;
        rc = kv_fail(err, KV_EIO, o->out_dir, KV_NO_OFFSET, "cannot create directory '%s': %s",
                     t->stage, kv_errtext(e, eb, sizeof eb));
        t->stage[0] = 0;
        return rc;
    }
    if (o->tokenizer_path) {
        snprintf(tok_path, cap, "%s", o->tokenizer_path);
    } else {
        snprintf(tok_path, cap, "%s/tokenizer.json", t->stage);
        if ((rc = kv_hf_write_byte_tokenizer(tok_path, err))) return rc;
    }
    if ((rc = kv_tok_open(tok_path, &t->tok, err))) return rc;
    struct kv_config c = o->cfg;
    c.vocab_size = kv_tok_n_vocab(t->tok);
    c.bos_id = kv_tok_bos(t->tok), c.eos_id = kv_tok_eos(t->tok);
    const struct kv_arch_desc *a = kv_arch_desc(c.arch);
    if (a->qkv_bias == KV_WUSE_REQUIRED) c.has_qkv_bias = 1;
    if (!a->rope && o->seq_len > c.max_seq_len) /* learned positions end there */
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "window of %lld tokens exceeds the model's %lld positions",
                       (long long)o->seq_len, (long long)c.max_seq_len);
    if ((rc = read_tokens(o->train_path, t->tok, 0, &t->train, &t->n_train, err))) return rc;
    if (t->n_train < o->seq_len + 1)
        return kv_fail(err, KV_EINVAL, o->train_path, KV_NO_OFFSET,
                       "training text has %lld tokens, fewer than one window of %lld",
                       (long long)t->n_train, (long long)o->seq_len + 1);
    if (o->eval_path && (rc = read_tokens(o->eval_path, t->tok, c.bos_id >= 0, &t->eval, &t->n_eval, err)))
        return rc;
    if ((rc = kv_model_init_random(&c, o->seed, &t->m, err))) return rc;
    if ((rc = kv_grad_init(t->m, o->seq_len, &t->g, err))) return rc;
    init_weights(t);
    t->n_t = kv_grad_n_tensors(t->g);
    t->w = calloc((size_t)t->n_t, sizeof *t->w);
    t->gr = calloc((size_t)t->n_t, sizeof *t->gr);
    t->cnt = calloc((size_t)t->n_t, sizeof *t->cnt);
    t->decay = calloc((size_t)t->n_t, sizeof *t->decay);
    if (!t->w || !t->gr || !t->cnt || !t->decay)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t i = 0; i < t->n_t; i++) {
        const float *w, *g;
        kv_grad_tensor(t->g, i, &t->cnt[i], &w, &g);
        t->w[i] = (float *)w; /* kv_model_init_random owns them */
        t->gr[i] = (float *)g;
        t->total += t->cnt[i];
    }
    /* AdamW decays the 2-D weights (matrices and embeddings), not gains or biases */
    for (int64_t i = 0; i < t->n_t; i++) {
        int64_t sh[2];
        t->decay[i] = kv_model_expected_shape(&c, kv_grad_tensor_kind(t->g, i, NULL), sh) == 2;
    }
    t->acc = calloc((size_t)t->total, sizeof(float));
    t->am = calloc((size_t)t->total, sizeof(float));
    t->av = calloc((size_t)t->total, sizeof(float));
    t->win = calloc((size_t)o->seq_len + 1, sizeof(int32_t));
    t->log = calloc((size_t)(o->steps * LOG_COLS), sizeof(double));
    if (!t->acc || !t->am || !t->av || !t->win || !t->log)
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory for the optimizer state");
    t->rng = o->seed;
    if (o->resume) return ckpt_read(t, err);
    return KV_OK;
}

int kv_train(struct kv_train_opts *o, struct kv_err *err) {
    struct trainer t = {0};
    t.o = o;
    char tok_path[4096];
    int rc = setup(&t, tok_path, sizeof tok_path, err);
    if (!rc) o->unigram_eval_loss = unigram_loss(&t);
    double t0 = kv_now();
    int64_t tok0 = t.tokens; /* a resumed run's rate counts its own tokens */
    while (!rc && t.step < o->steps) {
        struct kv_train_log lg;
        rc = train_step(&t, &lg, err);
        if (rc) break;
        int last = t.step == o->steps;
        if (o->eval_path && ((o->eval_every && t.step % o->eval_every == 0) || last))
            rc = eval_loss(&t, &lg.eval_loss, err);
        if (rc) break;
        double *r = t.log + (t.step - 1) * LOG_COLS;
        r[0] = (double)lg.step, r[1] = (double)lg.tokens, r[2] = lg.loss, r[3] = lg.lr;
        r[4] = lg.grad_norm, r[5] = lg.eval_loss;
        lg.seconds = kv_now() - t0;
        lg.run_tokens = t.tokens - tok0;
        lg.due = lg.step == 1 || lg.step % o->log_every == 0 || last || !isnan(lg.eval_loss);
        int stop = o->log && o->log(o->log_ctx, &lg);
        if (stop || last || (o->ckpt_every && t.step % o->ckpt_every == 0))
            rc = ckpt_write(&t, err);
        if (!rc && stop && !last) rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "interrupted");
    }
    if (!rc) {
        o->final_eval_loss = t.step ? t.log[(t.step - 1) * LOG_COLS + 5] : NAN;
        o->tokens_seen = t.tokens;
        o->run_tokens = t.tokens - tok0;
        rc = write_outputs(&t, tok_path, err);
    }
    if (t.stage[0]) { /* not put in place: nothing of it stays */
        struct kv_err ignored;
        kv_err_clear(&ignored);
        kv_remove_dir_files(t.stage, 1, &ignored);
    }
    trainer_free(&t);
    return rc;
}
