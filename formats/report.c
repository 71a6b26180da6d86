/* `kvcal report`: the report's data, its page and its figures (layout in
 * report.h). Everything is rendered into a growable buffer with fixed
 * number formats; kv_report_write puts each file in place atomically. */
#include "report.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "json.h"
#include "lrmodel.h"
#include "mapfile.h"
#include "model.h"

const char *const kv_report_figure_names[KV_REPORT_N_FIGURES] = {"spectra", "energy", "ranks",
                                                                 "bytes", "error", "quality"};

/* ---------------------------------------------------------------- buffer */

struct rb {
    char *p;
    size_t n, cap;
    int oom;
};

static void rb_grow(struct rb *b, size_t need) {
    if (b->oom || b->n + need + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + need + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = 1;
        return;
    }
    b->p = p, b->cap = cap;
}

static void rb_put(struct rb *b, const char *s, size_t len) {
    rb_grow(b, len);
    if (b->oom) return;
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = 0;
}

static void rb_printf(struct rb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rb_printf(struct rb *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = 1;
        return;
    }
    rb_grow(b, (size_t)n);
    if (b->oom) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)n;
}

/* s as XML text or attribute value: valid UTF-8 (kv_utf8_repair), & < > "
 * escaped, control characters other than tab and newline dropped. */
static void rb_esc(struct rb *b, const char *s) {
    char *r = kv_utf8_repair(s ? s : "");
    if (!r) {
        b->oom = 1;
        return;
    }
    for (const char *c = r; *c; c++) {
        unsigned char u = (unsigned char)*c;
        if (u == '&') rb_put(b, "&amp;", 5);
        else if (u == '<') rb_put(b, "&lt;", 4);
        else if (u == '>') rb_put(b, "&gt;", 4);
        else if (u == '"') rb_put(b, "&quot;", 6);
        else if ((u < 0x20 && u != '\t' && u != '\n') || u == 0x7f) continue;
        else rb_put(b, c, 1);
    }
    free(r);
}

static void rb_escf(struct rb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rb_escf(struct rb *b, const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    rb_esc(b, buf);
}

static int rb_done(struct rb *b, char **out, size_t *len, struct kv_err *err) {
    if (b->oom || !b->p) {
        free(b->p);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    *out = b->p;
    if (len) *len = b->n;
    return KV_OK;
}

/* ---------------------------------------------------------------- the data */

int kv_report_init(struct kv_report **out, struct kv_err *err) {
    struct kv_report *r = calloc(1, sizeof *r);
    if (!r || !(r->title = strdup("kvcal report"))) {
        free(r);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    r->eps = NAN;
    *out = r;
    return KV_OK;
}

void kv_report_free(struct kv_report *r) {
    if (!r) return;
    free(r->title), free(r->model_path), free(r->comp_path), free(r->options_json);
    free(r->source), free(r->layer_bytes), free(r->eval_path);
    for (int64_t i = 0; i < r->n_stats; i++) {
        struct kv_report_stats *s = &r->stats[i];
        for (int64_t k = 0; s->inputs && k < s->info.n_inputs; k++) free(s->inputs[k]);
        free(s->inputs), free(s->role), free(s->path);
    }
    free(r->stats);
    for (int64_t i = 0; i < r->n_units; i++) free(r->units[i].eig);
    free(r->units);
    for (int64_t i = 0; i < r->n_points; i++) {
        struct kv_report_point *p = &r->points[i];
        free(p->group), free(p->series), free(p->label), free(p->source);
    }
    free(r->points);
    for (int64_t i = 0; i < r->n_results; i++) free(r->results_paths[i]);
    free(r->results_paths), free(r->results_rows), free(r->results_refused);
    for (int64_t i = 0; i < r->n_verify; i++) free(r->verify_paths[i]);
    free(r->verify_paths);
    free(r);
}

static int nomem(struct kv_err *err) {
    return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
}

int kv_report_set_title(struct kv_report *r, const char *title, struct kv_err *err) {
    char *t = strdup(title ? title : "kvcal report");
    if (!t) return nomem(err);
    free(r->title);
    r->title = t;
    return KV_OK;
}

int kv_report_set_model(struct kv_report *r, const char *path, const struct kv_model *m,
                        struct kv_err *err) {
    const struct kv_config *c = kv_model_config(m);
    free(r->model_path);
    if (!(r->model_path = strdup(path))) return nomem(err);
    r->n_layers = c->n_layers, r->n_kv_heads = c->n_kv_heads, r->head_dim = c->head_dim;
    snprintf(r->model_desc, sizeof r->model_desc,
             "%s (%s), dim %lld, %lld layers, %lld heads (%lld KV heads), head dim %lld, "
             "ffn %lld, vocab %lld",
             kv_arch_name(c->arch), kv_format_name(kv_model_format(m)), (long long)c->dim,
             (long long)c->n_layers, (long long)c->n_heads, (long long)c->n_kv_heads,
             (long long)c->head_dim, (long long)c->hidden_dim, (long long)c->vocab_size);
    return kv_model_fingerprint(m, r->fingerprint, err);
}

/* Whether what (statistics, a compressed model) at path has r's layers,
 * KV heads and head size; else KV_EINVAL in err saying both. */
static int same_shape(const struct kv_report *r, int64_t n_layers, int64_t n_kv_heads,
                      int64_t head_dim, const char *what, const char *path, struct kv_err *err) {
    if (n_layers == r->n_layers && n_kv_heads == r->n_kv_heads && head_dim == r->head_dim) return 1;
    kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
            "%s of %lld layers, %lld KV heads of %lld, but the model has %lld layers, %lld KV "
            "heads of %lld",
            what, (long long)n_layers, (long long)n_kv_heads, (long long)head_dim,
            (long long)r->n_layers, (long long)r->n_kv_heads, (long long)r->head_dim);
    return 0;
}

int kv_report_add_stats(struct kv_report *r, const char *role, const char *path,
                        const struct kv_stats *s, struct kv_err *err) {
    struct kv_stats_info si = kv_stats_info(s);
    if (r->n_layers && !same_shape(r, si.n_layers, si.n_kv_heads, si.head_dim, "statistics", path, err))
        return err->code;
    struct kv_report_stats *ns = realloc(r->stats, (size_t)(r->n_stats + 1) * sizeof *ns);
    if (!ns) return nomem(err);
    r->stats = ns;
    struct kv_report_stats *x = &ns[r->n_stats];
    memset(x, 0, sizeof *x);
    x->info = si;
    x->role = strdup(role), x->path = strdup(path);
    x->inputs = calloc((size_t)(si.n_inputs ? si.n_inputs : 1), sizeof *x->inputs);
    r->n_stats++; /* freed as a whole from here on */
    if (!x->role || !x->path || !x->inputs) return nomem(err);
    for (int64_t i = 0; i < si.n_inputs; i++) {
        const struct kv_stats_input *in = kv_stats_input(s, i);
        char line[1400];
        snprintf(line, sizeof line, "%s: %llu bytes, sha256 %.16s…, %lld tokens, %lld windows",
                 in->path, (unsigned long long)in->bytes, in->sha256, (long long)in->tokens,
                 (long long)in->windows);
        if (!(x->inputs[i] = strdup(line))) return nomem(err);
    }
    return KV_OK;
}

static struct kv_report_unit *add_unit(struct kv_report *r, int64_t *cap) {
    if (r->n_units == *cap) {
        int64_t nc = *cap ? 2 * *cap : 64;
        struct kv_report_unit *u = realloc(r->units, (size_t)nc * sizeof *u);
        if (!u) return NULL;
        r->units = u, *cap = nc;
    }
    struct kv_report_unit *u = &r->units[r->n_units++];
    memset(u, 0, sizeof *u);
    u->unit = -1, u->mode = -1, u->rank = -1, u->bytes = -1;
    u->predicted = u->measured = u->resid = u->total = u->var = NAN;
    return u;
}

/* Head blocks of one side of layer l (mode as given). */
static int head_blocks(struct kv_report *r, int64_t *cap, int64_t l, int which, int mode) {
    for (int64_t h = 0; h < r->n_kv_heads; h++) {
        struct kv_report_unit *u = add_unit(r, cap);
        if (!u) return 0;
        u->layer = l, u->which = which, u->head0 = h, u->n_heads = 1, u->width = r->head_dim;
        u->mode = mode;
        snprintf(u->why, sizeof u->why, "%s", mode < 0 ? "no compressed model" : "not compressed");
    }
    return 1;
}

int kv_report_head_units(struct kv_report *r, struct kv_err *err) {
    KV_ASSERT(r->n_units == 0 && r->n_layers > 0);
    int64_t cap = 0;
    for (int64_t l = 0; l < r->n_layers; l++)
        for (int w = 0; w < 2; w++)
            if (!head_blocks(r, &cap, l, w, -1)) return nomem(err);
    return KV_OK;
}

int kv_report_set_compressed(struct kv_report *r, const char *dir, const struct kv_lowrank *lr,
                             struct kv_err *err) {
    struct kv_lr_info li = kv_lr_info(lr);
    if (r->model_path &&
        !same_shape(r, li.n_layers, li.n_kv_heads, li.head_dim, "a compressed model", dir, err))
        return err->code;
    KV_ASSERT(r->n_units == 0 && !r->comp_path);
    r->n_layers = li.n_layers, r->n_kv_heads = li.n_kv_heads, r->head_dim = li.head_dim;
    if (!(r->comp_path = strdup(dir))) return nomem(err);
    snprintf(r->method, sizeof r->method, "%s", li.method);
    snprintf(r->alloc, sizeof r->alloc, "%s", li.alloc);
    r->kv_bits = li.kv_bits, r->hadamard = li.hadamard;
    struct kv_config cfg = {.n_layers = li.n_layers, .n_kv_heads = li.n_kv_heads,
                            .head_dim = li.head_dim};
    r->base_bytes = kv_lr_base_bytes(&cfg);
    r->comp_bytes = kv_lr_bytes(lr, li.kv_bits);
    cfg.n_layers = 1;
    r->layer_bytes = malloc((size_t)(3 * li.n_layers) * sizeof *r->layer_bytes);
    if (!r->layer_bytes) return nomem(err);
    int64_t cap = 0;
    for (int64_t l = 0; l < li.n_layers; l++) {
        r->layer_bytes[3 * l] = kv_lr_base_bytes(&cfg);
        for (int w = 0; w < 2; w++) {
            r->layer_bytes[3 * l + 1 + w] = kv_lr_side_bytes(lr, l, w, li.kv_bits);
            const struct kv_lr_side *sd = kv_lr_side(lr, l, w);
            if (sd->mode == KV_LR_FULL) {
                if (!head_blocks(r, &cap, l, w, KV_LR_FULL)) return nomem(err);
                continue;
            }
            for (int64_t k = 0; k < sd->n_units; k++) {
                const struct kv_lr_unit *un = &sd->units[k];
                struct kv_report_unit *u = add_unit(r, &cap);
                if (!u) return nomem(err);
                u->layer = l, u->which = w, u->unit = k, u->head0 = un->head0;
                u->n_heads = un->n_heads;
                u->width = sd->mode == KV_LR_POSTROPE_ROTATION ? li.head_dim : un->n_heads * li.head_dim;
                u->mode = (int)sd->mode, u->rank = un->rank;
                u->bytes = kv_lr_unit_bytes_at(un, li.kv_bits);
                u->predicted = un->energy > 0 ? un->dropped / un->energy : NAN;
                u->why[0] = 0;
            }
        }
    }
    /* the manifest's own records, for the provenance */
    size_t n = strlen(dir) + sizeof "/kvcal.json";
    char *mp = malloc(n);
    if (!mp) return nomem(err);
    snprintf(mp, n, "%s/kvcal.json", dir);
    json_t *doc = NULL;
    int rc = kv_json_load(mp, &doc, err);
    free(mp);
    if (rc) return rc;
    json_t *opts = json_object_get(doc, "options"), *mo = json_object_get(doc, "model");
    if (json_is_object(opts)) {
        r->options_json = json_dumps(opts, JSON_COMPACT | JSON_REAL_PRECISION(10));
        json_t *e = json_object_get(opts, "eps");
        if (json_is_number(e)) r->eps = json_number_value(e);
    }
    const char *src = json_string_value(json_object_get(mo, "source"));
    if (src && !(r->source = strdup(src))) rc = nomem(err);
    json_decref(doc);
    return rc;
}

/* ---------------------------------------------------------------- results and verify */

static int add_point(struct kv_report *r, struct kv_report_point *p, struct kv_err *err) {
    if (!p->group || !p->series || !p->label || !p->source) {
        free(p->group), free(p->series), free(p->label), free(p->source);
        return nomem(err);
    }
    if (r->n_points == r->cap_points) {
        int64_t nc = r->cap_points ? 2 * r->cap_points : 32;
        struct kv_report_point *np = realloc(r->points, (size_t)nc * sizeof *np);
        if (!np) {
            free(p->group), free(p->series), free(p->label), free(p->source);
            return nomem(err);
        }
        r->points = np, r->cap_points = nc;
    }
    r->points[r->n_points++] = *p;
    return KV_OK;
}

static const char *base_name(const char *p) {
    if (!p) return "?";
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') n--; /* "dir/" names dir */
    const char *s = p + n;
    while (s > p && s[-1] != '/') s--;
    return s;
}

static char *fmt_dup(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *fmt_dup(const char *fmt, ...) {
    char buf[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return strdup(buf);
}

/* The panel a verify object belongs to: model and text (last path
 * components) and the window count. */
static char *group_of(const json_t *v) {
    const char *model = json_string_value(json_object_get(v, "model"));
    const char *text = json_string_value(json_object_get(v, "text"));
    json_t *w = json_object_get(v, "windows");
    char mb[256], tb[256];
    size_t ml = strcspn(base_name(model), "/"), tl = strcspn(base_name(text), "/");
    snprintf(mb, sizeof mb, "%.*s", (int)ml, base_name(model));
    snprintf(tb, sizeof tb, "%.*s", (int)tl, base_name(text));
    return fmt_dup("%s on %s, %lld windows", mb, tb,
                   json_is_integer(w) ? (long long)json_integer_value(w) : -1LL);
}

static double num_or_nan(const json_t *v) { return json_is_number(v) ? json_number_value(v) : NAN; }

/* A verify object's number key, required (KV_EFORMAT naming what). */
static int need_num(const json_t *v, const char *key, const char *path, const char *where,
                    double *out, struct kv_err *err) {
    json_t *x = json_object_get(v, key);
    if (!json_is_number(x))
        return kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%s'verify' has no number '%s'", where,
                       key);
    *out = json_number_value(x);
    return KV_OK;
}

/* The series of a verify object: its method, with the latent width when
 * the latents are quantized. */
static char *series_of(const json_t *row, const json_t *v) {
    const char *m = json_string_value(json_object_get(v, "method"));
    if (!m) m = json_string_value(json_object_get(json_object_get(row, "decompose"), "method"));
    if (!m) m = "?";
    json_t *b = json_object_get(v, "kv_bits");
    if (json_is_integer(b) && json_integer_value(b) == 0) return fmt_dup("%s, mixed bits", m);
    if (json_is_integer(b) && json_integer_value(b) != 16)
        return fmt_dup("%s, %lld-bit", m, (long long)json_integer_value(b));
    return strdup(m);
}

/* A row's words: its label (results-kjv) or method and allocation
 * (results), and its target. */
static char *label_of(const json_t *row, const json_t *v) {
    const char *lab = json_string_value(json_object_get(row, "label"));
    const char *m = json_string_value(json_object_get(row, "method"));
    const char *al = json_string_value(json_object_get(row, "alloc"));
    const char *op = json_string_value(json_object_get(row, "options"));
    if (!m) m = json_string_value(json_object_get(v, "method"));
    if (!al) al = json_string_value(json_object_get(v, "alloc"));
    json_t *t = json_object_get(row, "target");
    char tg[64] = "";
    if (json_is_string(t)) snprintf(tg, sizeof tg, ", target %s", json_string_value(t));
    else if (json_is_number(t)) snprintf(tg, sizeof tg, ", target %.6g", json_number_value(t));
    if (lab) return fmt_dup("%s%s", lab, tg);
    return fmt_dup("%s, alloc %s%s%s%s", m ? m : "?", al ? al : "?", op && *op ? ", " : "",
                   op && *op ? op : "", tg);
}

static int strlist_add(char ***list, int64_t n, const char *s) {
    char **nl = realloc(*list, (size_t)(n + 1) * sizeof *nl);
    if (!nl) return 0;
    *list = nl;
    return (nl[n] = strdup(s)) != NULL;
}

int kv_report_add_results(struct kv_report *r, const char *path, struct kv_err *err) {
    char *text = NULL;
    size_t len = 0;
    int rc = kv_text_read(path, &text, &len, err);
    if (rc) return rc;
    int64_t rows = 0, refused = 0, ln = 0;
    for (size_t at = 0; at < len && !rc;) {
        size_t e = at;
        while (e < len && text[e] != '\n') e++;
        ln++;
        const char *line = text + at;
        size_t n = e - at;
        at = e + 1;
        size_t k = 0;
        while (k < n && (line[k] == ' ' || line[k] == '\t' || line[k] == '\r')) k++;
        if (k == n) continue;
        char where[48];
        snprintf(where, sizeof where, "line %lld: ", (long long)ln);
        json_error_t je;
        json_t *row = json_loadb(line, n, JSON_REJECT_DUPLICATES, &je);
        if (!row) {
            char msg[256];
            kv_json_error_text(&je, msg, sizeof msg);
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET, "%sinvalid json: %s", where, msg);
            break;
        }
        json_t *v = json_object_get(row, "verify");
        if (!json_is_object(row)) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "%sexpected a JSON object (a row of make results), found %s %s", where,
                         json_is_array(row) || json_is_integer(row) ? "an" : "a",
                         kv_json_type_name(row));
        } else if (json_object_get(row, "error")) {
            refused++;
        } else if (!json_is_object(v)) {
            rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                         "%sno 'verify' object (not a row of make results)", where);
        } else {
            struct kv_report_point p = {0};
            json_t *kb = json_object_get(v, "kv_bytes_per_token");
            if (!(rc = need_num(v, "ppl", path, where, &p.ppl, err)) &&
                !(rc = need_num(v, "base_ppl", path, where, &p.base_ppl, err))) {
                if (!json_is_object(kb))
                    rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                                 "%s'verify' has no object 'kv_bytes_per_token'", where);
                else if (!json_is_number(json_object_get(kb, "ratio")))
                    rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                                 "%s'verify' has no number 'kv_bytes_per_token.ratio'", where);
            }
            if (!rc) {
                p.ratio = json_number_value(json_object_get(kb, "ratio"));
                p.kl = num_or_nan(json_object_get(v, "kl"));
                p.group = group_of(v), p.series = series_of(row, v), p.label = label_of(row, v);
                p.source = fmt_dup("%s:%lld", path, (long long)ln);
                rc = add_point(r, &p, err);
                rows++;
            }
        }
        json_decref(row);
    }
    free(text);
    if (rc) return rc;
    int64_t i = r->n_results;
    int64_t *nr = realloc(r->results_rows, (size_t)(i + 1) * sizeof *nr);
    if (nr) r->results_rows = nr;
    int64_t *nf = realloc(r->results_refused, (size_t)(i + 1) * sizeof *nf);
    if (nf) r->results_refused = nf;
    if (!nr || !nf || !strlist_add(&r->results_paths, i, path)) return nomem(err);
    r->results_rows[i] = rows, r->results_refused[i] = refused;
    r->n_results++;
    return KV_OK;
}

int kv_report_add_verify(struct kv_report *r, const char *path, struct kv_err *err) {
    json_t *v = NULL;
    int rc = kv_json_load(path, &v, err);
    if (rc) return rc;
    struct kv_report_point p = {.verify = 1};
    if (!json_is_object(v)) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "expected the JSON object of kvcal verify --json, found %s %s",
                     json_is_array(v) ? "an" : "a", kv_json_type_name(v));
    } else if (!json_is_number(json_object_get(v, "ppl"))) {
        rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                     "no number 'ppl' (not the output of kvcal verify --json)");
    } else {
        p.ppl = json_number_value(json_object_get(v, "ppl"));
        const char *comp = json_string_value(json_object_get(v, "compressed"));
        if (comp) {
            json_t *kb = json_object_get(v, "kv_bytes_per_token");
            p.base_ppl = num_or_nan(json_object_get(v, "base_ppl"));
            p.ratio = num_or_nan(json_object_get(kb, "ratio"));
            if (isnan(p.base_ppl) || isnan(p.ratio))
                rc = kv_fail(err, KV_EFORMAT, path, KV_NO_OFFSET,
                             "a compressed run without numbers 'base_ppl' and "
                             "'kv_bytes_per_token.ratio'");
            p.kl = num_or_nan(json_object_get(v, "kl"));
        } else {
            p.base_ppl = p.ppl, p.ratio = 1.0, p.kl = 0;
        }
        if (!rc) {
            p.group = group_of(v), p.series = strdup("--verify");
            p.label = comp ? fmt_dup("verify %s", comp) : strdup("verify: the base model");
            p.source = strdup(path);
            rc = add_point(r, &p, err);
        }
    }
    json_decref(v);
    if (!rc && !strlist_add(&r->verify_paths, r->n_verify, path)) rc = nomem(err);
    if (!rc) r->n_verify++;
    return rc;
}

/* ---------------------------------------------------------------- figures: helpers */

static const char *const palette[10] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                        "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#7f7f7f"};
#define K_COLOUR "#4e79a7"
#define V_COLOUR "#f28e2b"
#define FONT "DejaVu Sans, Arial, Helvetica, sans-serif"

struct axis {
    double lo, hi;
    int log;
    int no_ticks; /* categories: the caller labels them */
    double a, b;  /* pixels of lo and hi */
};

static double ax_map(const struct axis *x, double v) {
    double t = x->log ? (log10(v) - log10(x->lo)) / (log10(x->hi) - log10(x->lo))
                      : (v - x->lo) / (x->hi - x->lo);
    return x->a + t * (x->b - x->a);
}

/* Tick values of an axis (at most cap). */
static int ax_ticks(const struct axis *x, double *t, int cap) {
    int n = 0;
    if (x->no_ticks) return 0;
    if (x->log) {
        int k0 = (int)floor(log10(x->lo) + 1e-9), k1 = (int)ceil(log10(x->hi) - 1e-9);
        int decades = k1 - k0;
        static const double m125[] = {1, 2, 5}, m1_9[] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
        const double *ms = decades >= 2 ? m125 : m1_9;
        int nm = decades >= 2 ? 1 : 9;
        if (decades >= 2 && decades <= 2) nm = 3;
        int step = decades > 8 ? (decades + 7) / 8 : 1;
        for (int k = k0; k <= k1 && n < cap; k += (nm == 1 ? step : 1))
            for (int i = 0; i < nm && n < cap; i++) {
                double v = ms[i] * pow(10, k);
                if (v >= x->lo * (1 - 1e-9) && v <= x->hi * (1 + 1e-9)) t[n++] = v;
            }
        if (n >= 2) return n;
        n = 0; /* less than a decade between two of 1..9 x 10^k: linear ticks */
    }
    double raw = (x->hi - x->lo) / (x->log ? 3 : 5), mag = pow(10, floor(log10(raw))), f = raw / mag;
    double step = (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
    for (double v = ceil(x->lo / step - 1e-9) * step; v <= x->hi + step * 1e-9 && n < cap; v += step)
        t[n++] = fabs(v) < step * 1e-9 ? 0 : v;
    return n;
}

static void tick_label(const struct axis *x, double v, char *buf, size_t cap) {
    if (x->log) {
        double k = log10(v);
        if (fabs(k - floor(k + 0.5)) < 1e-9 && (k > 3.5 || k < -2.5))
            snprintf(buf, cap, "1e%d", (int)floor(k + 0.5));
        else
            snprintf(buf, cap, "%.4g", v);
    } else {
        snprintf(buf, cap, "%.4g", v);
    }
}

static void svg_text(struct rb *b, double x, double y, const char *anchor, double size,
                     const char *extra, const char *text) {
    rb_printf(b, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"%.1f\" text-anchor=\"%s\"%s%s>", x, y,
              size, anchor, extra ? " " : "", extra ? extra : "");
    rb_esc(b, text);
    rb_printf(b, "</text>\n");
}

/* A plot area [x0, x0+w] x [y0, y0+h] with its frame, grid, ticks and labels. */
static void panel(struct rb *b, double x0, double y0, double w, double h, struct axis *ax,
                  struct axis *ay, const char *title, const char *xlabel, const char *ylabel) {
    ax->a = x0, ax->b = x0 + w, ay->a = y0 + h, ay->b = y0;
    rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#ffffff\" "
                 "stroke=\"#333333\" stroke-width=\"1\"/>\n", x0, y0, w, h);
    double t[64];
    char lab[32];
    int n = ax_ticks(ax, t, 64);
    for (int i = 0; i < n; i++) {
        double px = ax_map(ax, t[i]);
        rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n",
                  px, y0, px, y0 + h);
        tick_label(ax, t[i], lab, sizeof lab);
        svg_text(b, px, y0 + h + 13, "middle", 10, NULL, lab);
    }
    n = ax_ticks(ay, t, 64);
    for (int i = 0; i < n; i++) {
        double py = ax_map(ay, t[i]);
        rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n",
                  x0, py, x0 + w, py);
        tick_label(ay, t[i], lab, sizeof lab);
        svg_text(b, x0 - 4, py + 3.5, "end", 10, NULL, lab);
    }
    rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                 "stroke=\"#333333\" stroke-width=\"1\"/>\n", x0, y0, w, h);
    if (title) svg_text(b, x0 + w / 2, y0 - 6, "middle", 12, "font-weight=\"bold\"", title);
    if (xlabel) svg_text(b, x0 + w / 2, y0 + h + 28, "middle", 11, NULL, xlabel);
    if (ylabel) {
        char tr[96];
        snprintf(tr, sizeof tr, "transform=\"rotate(-90 %.1f %.1f)\"", x0 - 40, y0 + h / 2);
        svg_text(b, x0 - 40, y0 + h / 2, "middle", 11, tr, ylabel);
    }
}

static void svg_open(struct rb *b, int standalone, const char *name, double w, double h,
                     const char *desc) {
    if (standalone) rb_printf(b, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    rb_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%.0f\" "
                 "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" font-family=\"%s\" class=\"kvr-%s\">\n",
              w, h, w, h, FONT, name);
    rb_printf(b, "<title>");
    rb_esc(b, desc);
    rb_printf(b, "</title>\n<rect width=\"100%%\" height=\"100%%\" fill=\"#ffffff\"/>\n");
}

static const char *side_name(int which) { return which ? "V" : "K"; }

static const char *unit_colour(const struct kv_report_unit *u) {
    return palette[(u->unit >= 0 ? u->unit : u->head0) % 10];
}

/* The legend of the units' colours, from layer 0's K side. */
static double unit_legend(struct rb *b, const struct kv_report *r, double x, double y, double wmax) {
    double cx = x;
    for (int64_t i = 0; i < r->n_units; i++) {
        const struct kv_report_unit *u = &r->units[i];
        if (u->layer != 0 || u->which != 0) continue;
        char lab[96];
        if (u->n_heads == 1)
            snprintf(lab, sizeof lab, "%s KV head %lld", u->unit >= 0 ? "unit of" : "block of",
                     (long long)u->head0);
        else
            snprintf(lab, sizeof lab, "unit of KV heads %lld-%lld", (long long)u->head0,
                     (long long)(u->head0 + u->n_heads - 1));
        double tw = 12 + 6.2 * (double)strlen(lab) + 18;
        if (cx + tw > x + wmax && cx > x) cx = x, y += 16;
        rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                     "stroke-width=\"2.5\"/>\n", cx, y - 4, cx + 14, y - 4, unit_colour(u));
        svg_text(b, cx + 18, y, "start", 11, NULL, lab);
        cx += tw;
    }
    return y;
}

/* The panel grid of the spectra and energy figures. */
struct grid {
    int64_t lpr;     /* layers per row */
    double pw, ph;   /* plot size */
    double cw, chh;  /* cell size */
    double left, top;
};

static struct grid grid_of(const struct kv_report *r) {
    struct grid g;
    g.lpr = r->n_layers >= 12 ? 4 : r->n_layers >= 2 ? 2 : 1;
    g.pw = g.lpr == 4 ? 150 : 200, g.ph = g.lpr == 4 ? 120 : 150;
    g.cw = g.pw + 70, g.chh = g.ph + 62;
    g.left = 58, g.top = 40;
    return g;
}

/* ---------------------------------------------------------------- figure: spectra, energy */

static double clamp01(double v) { return v < 0 ? 0 : v > 1 ? 1 : v; }

static void fig_spectra(struct rb *b, const struct kv_report *r, int standalone, int energy) {
    struct grid g = grid_of(r);
    int64_t rows = (r->n_layers + g.lpr - 1) / g.lpr;
    double W = g.left + (double)(2 * g.lpr) * g.cw, H = g.top + (double)rows * g.chh + 50;
    svg_open(b, standalone, energy ? "energy" : "spectra", W, H,
             energy ? "Cumulative energy of each unit's K and V output covariance, ranks marked"
                    : "Normalised eigen-spectra of each unit's K and V output covariance");
    /* a common y range: the smallest positive normalised eigenvalue */
    double lo = 1;
    for (int64_t i = 0; i < r->n_units; i++) {
        const struct kv_report_unit *u = &r->units[i];
        if (!u->eig || !(u->eig[0] > 0)) continue;
        for (int64_t k = 0; k < u->width; k++)
            if (u->eig[k] > 0 && u->eig[k] / u->eig[0] < lo) lo = u->eig[k] / u->eig[0];
    }
    if (lo < 1e-12) lo = 1e-12;
    lo = pow(10, floor(log10(lo)));
    if (lo >= 1) lo = 0.1;
    for (int64_t l = 0; l < r->n_layers; l++)
        for (int w = 0; w < 2; w++) {
            int64_t col = (l % g.lpr) * 2 + w, row = l / g.lpr;
            double x0 = g.left + (double)col * g.cw, y0 = g.top + (double)row * g.chh;
            struct axis ax = {.lo = energy ? 0 : 1, .hi = (double)r->head_dim}, ay;
            for (int64_t i = 0; i < r->n_units; i++)
                if (r->units[i].layer == l && r->units[i].which == w && r->units[i].width > ax.hi)
                    ax.hi = (double)r->units[i].width;
            if (ax.hi <= ax.lo) ax.hi = ax.lo + 1;
            if (energy) ay = (struct axis){.lo = 0, .hi = 1};
            else ay = (struct axis){.lo = lo, .hi = 1, .log = 1};
            char title[64];
            snprintf(title, sizeof title, "layer %lld %s", (long long)l, side_name(w));
            panel(b, x0, y0, g.pw, g.ph, &ax, &ay, title, energy ? "rank" : "eigenvalue index",
                  col == 0 ? (energy ? "variance explained" : "λ / λ₁") : NULL);
            if (energy && !isnan(r->eps))
                rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                             "stroke=\"#555555\" stroke-dasharray=\"4 3\"/>\n",
                          ax.a, ax_map(&ay, r->eps), ax.b, ax_map(&ay, r->eps));
            for (int64_t i = 0; i < r->n_units; i++) {
                const struct kv_report_unit *u = &r->units[i];
                if (u->layer != l || u->which != w || !u->eig) continue;
                double sum = 0;
                for (int64_t k = 0; k < u->width; k++) sum += u->eig[k] > 0 ? u->eig[k] : 0;
                if (!(u->eig[0] > 0) || !(sum > 0)) continue;
                rb_printf(b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"",
                          unit_colour(u));
                double cum = 0, at_rank = NAN, var = u->var > 0 ? u->var : sum;
                if (energy) /* variance explained: 1 − the tail over the variance */
                    rb_printf(b, "%.1f,%.1f ", ax_map(&ax, 0), ax_map(&ay, clamp01(1 - sum / var)));
                for (int64_t k = 0; k < u->width; k++) {
                    double e = u->eig[k] > 0 ? u->eig[k] : 0, y;
                    cum += e;
                    if (energy) {
                        y = clamp01(1 - (sum - cum) / var);
                        if (k + 1 == u->rank) at_rank = y;
                    } else {
                        y = e / u->eig[0];
                        if (y < lo) y = lo;
                        if (y > 1) y = 1;
                    }
                    rb_printf(b, "%.1f,%.1f ", ax_map(&ax, (double)(k + 1)), ax_map(&ay, y));
                }
                rb_printf(b, "\"/>\n");
                if (energy && u->rank > 0 && !isnan(at_rank)) {
                    double px = ax_map(&ax, (double)u->rank), py = ax_map(&ay, at_rank);
                    rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                                 "stroke=\"%s\" stroke-dasharray=\"2 2\"/>\n",
                              px, ay.a, px, py, unit_colour(u));
                    rb_printf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\" "
                                 "stroke=\"#000000\" stroke-width=\"0.6\"><title>",
                              px, py, unit_colour(u));
                    rb_escf(b, "layer %lld %s unit %lld (KV heads %lld-%lld): rank %lld of %lld "
                               "explains %.4f of the variance",
                            (long long)l, side_name(w), (long long)u->unit, (long long)u->head0,
                            (long long)(u->head0 + u->n_heads - 1), (long long)u->rank,
                            (long long)u->width, at_rank);
                    rb_printf(b, "</title></circle>\n");
                }
            }
        }
    double ly = g.top + (double)rows * g.chh + 14;
    ly = unit_legend(b, r, g.left, ly, W - g.left - 10);
    if (energy && !isnan(r->eps)) {
        char lab[64];
        snprintf(lab, sizeof lab, "dashed: eps %.4g", r->eps);
        svg_text(b, g.left, ly + 16, "start", 11, NULL, lab);
    }
    rb_printf(b, "</svg>\n");
}

/* ---------------------------------------------------------------- figure: ranks */

/* Viridis-like sequential colour of t in [0, 1]. */
static void seq_colour(double t, char *buf, size_t cap) {
    static const int stops[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98},
                                    {253, 231, 37}};
    if (!(t >= 0)) t = 0;
    if (t > 1) t = 1;
    double s = t * 4;
    int i = (int)s;
    if (i > 3) i = 3;
    double f = s - i;
    int c[3];
    for (int k = 0; k < 3; k++)
        c[k] = (int)lround(stops[i][k] + f * (stops[i + 1][k] - stops[i][k]));
    snprintf(buf, cap, "#%02x%02x%02x", c[0], c[1], c[2]);
}

static void fig_ranks(struct rb *b, const struct kv_report *r, int standalone) {
    double cw = r->n_kv_heads > 0 ? 480.0 / (double)r->n_kv_heads : 40;
    if (cw > 64) cw = 64;
    if (cw < 12) cw = 12;
    double chh = r->n_layers > 0 ? 640.0 / (double)r->n_layers : 30;
    if (chh > 32) chh = 32;
    if (chh < 10) chh = 10;
    double gw = cw * (double)r->n_kv_heads, gh = chh * (double)r->n_layers;
    double left = 70, top = 44, gap = 60;
    double W = left + 2 * gw + gap + 120, H = top + gh + 60;
    svg_open(b, standalone, "ranks", W, H, "Rank of each unit over its width, per layer and KV head");
    for (int w = 0; w < 2; w++) {
        double x0 = left + (double)w * (gw + gap);
        char title[64];
        snprintf(title, sizeof title, "%s ranks", side_name(w));
        svg_text(b, x0 + gw / 2, top - 22, "middle", 12, "font-weight=\"bold\"", title);
        for (int64_t h = 0; h < r->n_kv_heads; h++)
            if (cw >= 16 || h % 4 == 0) {
                char lab[24];
                snprintf(lab, sizeof lab, "%lld", (long long)h);
                svg_text(b, x0 + ((double)h + 0.5) * cw, top - 6, "middle", 10, NULL, lab);
            }
        svg_text(b, x0 + gw / 2, top + gh + 18, "middle", 11, NULL, "KV head");
        for (int64_t l = 0; l < r->n_layers; l++) {
            if (w == 0 && (chh >= 12 || l % 4 == 0)) {
                char lab[32];
                snprintf(lab, sizeof lab, "layer %lld", (long long)l);
                svg_text(b, x0 - 6, top + ((double)l + 0.5) * chh + 3.5, "end", 10, NULL, lab);
            }
        }
        for (int64_t i = 0; i < r->n_units; i++) {
            const struct kv_report_unit *u = &r->units[i];
            if (u->which != w) continue;
            double x = x0 + (double)u->head0 * cw, y = top + (double)u->layer * chh;
            double ww = (double)u->n_heads * cw;
            char fill[16] = "#d9d9d9", txt[32] = "full", tip[200];
            double t = 0;
            if (u->rank > 0) {
                t = (double)u->rank / (double)u->width;
                seq_colour(t, fill, sizeof fill);
                snprintf(txt, sizeof txt, "%lld", (long long)u->rank);
                snprintf(tip, sizeof tip, "layer %lld %s unit %lld (KV heads %lld-%lld, %s): rank "
                         "%lld of %lld, %lld bytes per token",
                         (long long)u->layer, side_name(w), (long long)u->unit, (long long)u->head0,
                         (long long)(u->head0 + u->n_heads - 1),
                         kv_lr_mode_name((enum kv_lr_mode)u->mode), (long long)u->rank,
                         (long long)u->width, (long long)u->bytes);
            } else {
                snprintf(tip, sizeof tip, "layer %lld %s KV head %lld: not compressed",
                         (long long)u->layer, side_name(w), (long long)u->head0);
            }
            rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\" "
                         "stroke=\"#ffffff\" stroke-width=\"1\"><title>",
                      x, y, ww, chh, fill);
            rb_esc(b, tip);
            rb_printf(b, "</title></rect>\n");
            if (ww >= 16 && chh >= 12)
                svg_text(b, x + ww / 2, y + chh / 2 + 3.5, "middle", chh >= 16 ? 10 : 8,
                         t > 0.6 || u->rank <= 0 ? "fill=\"#000000\"" : "fill=\"#ffffff\"", txt);
        }
    }
    /* the colour bar */
    double bx = left + 2 * gw + gap + 20, by = top, bh = gh < 120 ? 120 : gh;
    if (by + bh > H - 30) bh = H - 30 - by;
    for (int i = 0; i < 50; i++) {
        char fill[16];
        seq_colour((49.5 - i) / 49.0, fill, sizeof fill);
        rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"16\" height=\"%.2f\" fill=\"%s\"/>\n", bx,
                  by + i * bh / 50, bh / 50 + 0.3, fill);
    }
    rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"16\" height=\"%.1f\" fill=\"none\" "
                 "stroke=\"#333333\"/>\n", bx, by, bh);
    for (int i = 0; i <= 4; i++) {
        char lab[16];
        snprintf(lab, sizeof lab, "%.2f", 1 - i / 4.0);
        svg_text(b, bx + 20, by + i * bh / 4 + 3.5, "start", 10, NULL, lab);
    }
    svg_text(b, bx - 4, by + bh + 16, "start", 10, NULL, "rank / width");
    svg_text(b, bx - 4, by + bh + 30, "start", 10, NULL, "grey: full");
    rb_printf(b, "</svg>\n");
}

/* ---------------------------------------------------------------- figure: bytes */

static void fig_bytes(struct rb *b, const struct kv_report *r, int standalone) {
    double bw = r->n_layers > 0 ? 560.0 / (double)r->n_layers : 40;
    if (bw > 70) bw = 70;
    if (bw < 8) bw = 8;
    double pw = bw * (double)r->n_layers, ph = 240, left = 70, top = 30;
    double W = left + pw + 170, H = top + ph + 60;
    svg_open(b, standalone, "bytes", W, H, "KV cache bytes per token per layer");
    int64_t top_bytes = 1;
    for (int64_t l = 0; l < r->n_layers; l++) {
        int64_t c = r->layer_bytes[3 * l + 1] + r->layer_bytes[3 * l + 2];
        if (r->layer_bytes[3 * l] > top_bytes) top_bytes = r->layer_bytes[3 * l];
        if (c > top_bytes) top_bytes = c;
    }
    struct axis ax = {.lo = 0, .hi = (double)r->n_layers}, ay = {.lo = 0, .hi = 1.08 * (double)top_bytes};
    char title[160];
    snprintf(title, sizeof title, "KV bytes per token: %lld base, %lld compressed (%.4f)",
             (long long)r->base_bytes, (long long)r->comp_bytes,
             r->base_bytes ? (double)r->comp_bytes / (double)r->base_bytes : 0.0);
    ax.no_ticks = 1; /* layers are categories, labelled below each bar */
    panel(b, left, top, pw, ph, &ax, &ay, title, NULL, "bytes per token");
    for (int64_t l = 0; l < r->n_layers; l++) {
        double x = left + (double)l * bw, y0 = ax_map(&ay, 0);
        const int64_t *lb = &r->layer_bytes[3 * l];
        rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#d9d9d9\">"
                     "<title>layer %lld: base %lld bytes per token</title></rect>\n",
                  x + bw * 0.08, ax_map(&ay, (double)lb[0]), bw * 0.84, y0 - ax_map(&ay, (double)lb[0]),
                  (long long)l, (long long)lb[0]);
        double yk = ax_map(&ay, (double)lb[1]), yv = ax_map(&ay, (double)(lb[1] + lb[2]));
        rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">"
                     "<title>layer %lld K: %lld bytes per token</title></rect>\n",
                  x + bw * 0.25, yk, bw * 0.5, y0 - yk, K_COLOUR, (long long)l, (long long)lb[1]);
        rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">"
                     "<title>layer %lld V: %lld bytes per token</title></rect>\n",
                  x + bw * 0.25, yv, bw * 0.5, yk - yv, V_COLOUR, (long long)l, (long long)lb[2]);
        char lab[32];
        if (bw >= 24 || l % 4 == 0) {
            snprintf(lab, sizeof lab, "%lld", (long long)l);
            svg_text(b, x + bw / 2, top + ph + 13, "middle", 10, NULL, lab);
        }
        if (bw >= 30) {
            snprintf(lab, sizeof lab, "%lld", (long long)(lb[1] + lb[2]));
            svg_text(b, x + bw / 2, yv - 3, "middle", 9, NULL, lab);
        }
    }
    svg_text(b, left + pw / 2, top + ph + 28, "middle", 11, NULL, "layer");
    double lx = left + pw + 16, ly = top + 12;
    const char *fills[3] = {"#d9d9d9", K_COLOUR, V_COLOUR};
    const char *names[3] = {"base (fp16 K and V)", "compressed K", "compressed V"};
    for (int i = 0; i < 3; i++) {
        rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"%s\"/>\n", lx,
                  ly + i * 18 - 10, fills[i]);
        svg_text(b, lx + 16, ly + i * 18, "start", 11, NULL, names[i]);
    }
    rb_printf(b, "</svg>\n");
}

/* ---------------------------------------------------------------- figure: error */

static int measured_point(const struct kv_report_unit *u) {
    return !isnan(u->measured) && u->measured > 0 && u->predicted > 0;
}

static void fig_error(struct rb *b, const struct kv_report *r, int standalone) {
    double left = 80, top = 36, pw = 400, ph = 400, W = left + pw + 170, H = top + ph + 56;
    svg_open(b, standalone, "error", W, H, "Predicted against measured relative output error per unit");
    double lo = INFINITY, hi = 0;
    int64_t shown = 0, left_out = 0;
    for (int64_t i = 0; i < r->n_units; i++) {
        const struct kv_report_unit *u = &r->units[i];
        if (u->rank <= 0) continue;
        if (!measured_point(u)) {
            left_out++;
            continue;
        }
        shown++;
        double a = u->predicted < u->measured ? u->predicted : u->measured;
        double c = u->predicted > u->measured ? u->predicted : u->measured;
        if (a < lo) lo = a;
        if (c > hi) hi = c;
    }
    if (!shown) lo = 1e-3, hi = 1;
    lo = pow(10, floor(log10(lo) - 1e-9));
    hi = pow(10, ceil(log10(hi) + 1e-9));
    if (hi / lo < 100) hi = lo * 100;
    struct axis ax = {.lo = lo, .hi = hi, .log = 1}, ay = ax;
    panel(b, left, top, pw, ph, &ax, &ay, "measured against predicted error",
          "predicted: dropped / energy (manifest)", "measured on --eval-stats");
    rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#555555\" "
                 "stroke-dasharray=\"5 4\"/>\n",
              ax_map(&ax, lo), ax_map(&ay, lo), ax_map(&ax, hi), ax_map(&ay, hi));
    for (int64_t i = 0; i < r->n_units; i++) {
        const struct kv_report_unit *u = &r->units[i];
        if (u->rank <= 0 || !measured_point(u)) continue;
        double px = ax_map(&ax, u->predicted), py = ax_map(&ay, u->measured);
        if (u->which == 0)
            rb_printf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\" fill-opacity=\"0.8\" "
                         "stroke=\"#000000\" stroke-width=\"0.5\"><title>", px, py, K_COLOUR);
        else
            rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"7\" height=\"7\" fill=\"%s\" "
                         "fill-opacity=\"0.8\" stroke=\"#000000\" stroke-width=\"0.5\"><title>",
                      px - 3.5, py - 3.5, V_COLOUR);
        rb_escf(b, "layer %lld %s unit %lld (KV heads %lld-%lld), rank %lld of %lld: predicted "
                   "%.6g, measured %.6g",
                (long long)u->layer, side_name(u->which), (long long)u->unit, (long long)u->head0,
                (long long)(u->head0 + u->n_heads - 1), (long long)u->rank, (long long)u->width,
                u->predicted, u->measured);
        rb_printf(b, "</title>%s\n", u->which == 0 ? "</circle>" : "</rect>");
    }
    double lx = left + pw + 16, ly = top + 12;
    rb_printf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\" stroke=\"#000000\" "
                 "stroke-width=\"0.5\"/>\n", lx + 5, ly - 4, K_COLOUR);
    svg_text(b, lx + 16, ly, "start", 11, NULL, "K unit");
    rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"7\" height=\"7\" fill=\"%s\" stroke=\"#000000\" "
                 "stroke-width=\"0.5\"/>\n", lx + 1.5, ly + 18 - 7.5, V_COLOUR);
    svg_text(b, lx + 16, ly + 18, "start", 11, NULL, "V unit");
    rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#555555\" "
                 "stroke-dasharray=\"5 4\"/>\n", lx, ly + 32, lx + 12, ly + 32);
    svg_text(b, lx + 16, ly + 36, "start", 11, NULL, "y = x");
    char note[96];
    snprintf(note, sizeof note, "%lld units plotted", (long long)shown);
    svg_text(b, lx, ly + 60, "start", 11, NULL, note);
    if (left_out) {
        snprintf(note, sizeof note, "%lld not measured or zero", (long long)left_out);
        svg_text(b, lx, ly + 76, "start", 11, NULL, note);
    }
    rb_printf(b, "</svg>\n");
}

/* ---------------------------------------------------------------- figure: quality */

/* The distinct values of points' group (which 0) or series (1), in order
 * of first appearance: their indices into r->points, n returned. */
static int64_t distinct(const struct kv_report *r, int which, int64_t *first) {
    int64_t n = 0;
    for (int64_t i = 0; i < r->n_points; i++) {
        const char *s = which ? r->points[i].series : r->points[i].group;
        int64_t k = 0;
        while (k < n && strcmp(which ? r->points[first[k]].series : r->points[first[k]].group, s)) k++;
        if (k == n) first[n++] = i;
    }
    return n;
}

static void marker(struct rb *b, int64_t series, int verify, double x, double y) {
    if (verify) {
        rb_printf(b, "<path d=\"M%.1f %.1fl2.4 4.9 5.4 0.8-3.9 3.8 0.9 5.4-4.8-2.5-4.8 2.5 "
                     "0.9-5.4-3.9-3.8 5.4-0.8z\" fill=\"#000000\" stroke=\"#ffffff\" "
                     "stroke-width=\"0.6\"><title>", x, y - 7.5);
        return;
    }
    const char *c = palette[series % 10];
    switch ((series / 10) % 3) {
    case 0:
        rb_printf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4.2\" fill=\"%s\" stroke=\"#000000\" "
                     "stroke-width=\"0.5\"><title>", x, y, c);
        break;
    case 1:
        rb_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"8\" height=\"8\" fill=\"%s\" "
                     "stroke=\"#000000\" stroke-width=\"0.5\"><title>", x - 4, y - 4, c);
        break;
    default:
        rb_printf(b, "<path d=\"M%.1f %.1fl5 8.5h-10z\" fill=\"%s\" stroke=\"#000000\" "
                     "stroke-width=\"0.5\"><title>", x, y - 5.5, c);
    }
}

static const char *marker_end(int64_t series, int verify) {
    if (verify) return "</title></path>";
    switch ((series / 10) % 3) {
    case 0: return "</title></circle>";
    case 1: return "</title></rect>";
    default: return "</title></path>";
    }
}

static int cmp_pt(const void *a, const void *b, void *ctx) {
    const struct kv_report_point *p = ctx;
    const struct kv_report_point *x = &p[*(const int64_t *)a], *y = &p[*(const int64_t *)b];
    if (x->ratio != y->ratio) return x->ratio < y->ratio ? -1 : 1;
    if (x->ppl != y->ppl) return x->ppl < y->ppl ? -1 : 1;
    int64_t d = *(const int64_t *)a - *(const int64_t *)b;
    return d < 0 ? -1 : d > 0;
}

static int fig_quality(struct rb *b, const struct kv_report *r, int standalone) {
    int64_t *gf = malloc((size_t)(r->n_points + 1) * sizeof *gf);
    int64_t *sf = malloc((size_t)(r->n_points + 1) * sizeof *sf);
    int64_t *idx = malloc((size_t)(r->n_points + 1) * sizeof *idx);
    if (!gf || !sf || !idx) {
        free(gf), free(sf), free(idx);
        return 0;
    }
    int64_t ng = distinct(r, 0, gf), ns = distinct(r, 1, sf);
    int64_t per_row = ng > 1 ? 2 : 1, rows = (ng + per_row - 1) / per_row;
    double pw = 420, ph = 280, cw = pw + 100, chh = ph + 80, left = 80, top = 40;
    double W = left + (double)per_row * cw + 10;
    int64_t legend_rows = (ns + 2) / 3 + 1;
    double H = top + (double)rows * chh + 20 + 18 * (double)legend_rows;
    svg_open(b, standalone, "quality", W, H, "Perplexity against KV cache bytes kept");
    for (int64_t g = 0; g < ng; g++) {
        const char *gname = r->points[gf[g]].group;
        double x0 = left + (double)(g % per_row) * cw, y0 = top + (double)(g / per_row) * chh;
        double plo = INFINITY, phi = 0, xhi = 1, base = NAN;
        int64_t n = 0;
        for (int64_t i = 0; i < r->n_points; i++) {
            const struct kv_report_point *p = &r->points[i];
            if (strcmp(p->group, gname) || !(p->ppl > 0)) continue;
            if (p->ppl < plo) plo = p->ppl;
            if (p->ppl > phi) phi = p->ppl;
            if (p->base_ppl > 0) {
                if (isnan(base)) base = p->base_ppl;
                if (p->base_ppl < plo) plo = p->base_ppl;
                if (p->base_ppl > phi) phi = p->base_ppl;
            }
            if (p->ratio > xhi) xhi = p->ratio;
            idx[n++] = i;
        }
        if (!n) plo = 1, phi = 10;
        struct axis ax = {.lo = 0, .hi = xhi * 1.04}, ay = {.lo = plo / 1.06, .hi = phi * 1.06, .log = 1};
        panel(b, x0, y0, pw, ph, &ax, &ay, gname, "KV bytes per token kept (fraction of base)",
              g % per_row == 0 ? "perplexity" : NULL);
        if (!isnan(base)) {
            rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888888\" "
                         "stroke-dasharray=\"6 4\"/>\n",
                      ax.a, ax_map(&ay, base), ax.b, ax_map(&ay, base));
            char lab[64];
            snprintf(lab, sizeof lab, "base PPL %.4g", base);
            svg_text(b, ax.a + 4, ax_map(&ay, base) - 4, "start", 10, "fill=\"#555555\"", lab);
        }
        /* the Pareto front of the results rows: least PPL for its bytes */
        int64_t m = 0;
        for (int64_t k = 0; k < n; k++)
            if (!r->points[idx[k]].verify) idx[m++] = idx[k];
        qsort_r(idx, (size_t)m, sizeof *idx, cmp_pt, r->points);
        double best = INFINITY;
        int started = 0;
        for (int64_t k = 0; k < m; k++) {
            const struct kv_report_point *p = &r->points[idx[k]];
            if (!(p->ppl < best)) continue;
            best = p->ppl;
            rb_printf(b, "%s%.1f,%.1f", started ? " " : "<polyline fill=\"none\" stroke=\"#000000\" "
                                                       "stroke-width=\"1.6\" stroke-opacity=\"0.75\" points=\"",
                      ax_map(&ax, p->ratio), ax_map(&ay, p->ppl));
            started = 1;
        }
        if (started) rb_printf(b, "\"/>\n");
        for (int64_t i = 0; i < r->n_points; i++) {
            const struct kv_report_point *p = &r->points[i];
            if (strcmp(p->group, gname) || !(p->ppl > 0)) continue;
            int64_t s = 0;
            while (s < ns && strcmp(r->points[sf[s]].series, p->series)) s++;
            marker(b, s, p->verify, ax_map(&ax, p->ratio), ax_map(&ay, p->ppl));
            rb_escf(b, "%s (%s): %.4f of base bytes, PPL %.5g (%+.3f%%), KL %.5g [%s]", p->label,
                    p->series, p->ratio, p->ppl,
                    p->base_ppl > 0 ? 100 * (p->ppl / p->base_ppl - 1) : 0.0, p->kl, p->source);
            rb_printf(b, "%s\n", marker_end(s, p->verify));
        }
    }
    double ly = top + (double)rows * chh + 10, lx = left;
    for (int64_t s = 0; s < ns; s++) {
        const char *name = r->points[sf[s]].series;
        int v = !strcmp(name, "--verify") && r->points[sf[s]].verify;
        double x = lx + (double)(s % 3) * 230, y = ly + (double)(s / 3) * 18;
        marker(b, s, v, x + 5, y - 4);
        rb_esc(b, name);
        rb_printf(b, "%s\n", marker_end(s, v));
        svg_text(b, x + 16, y, "start", 11, NULL, name);
    }
    double y = ly + (double)((ns + 2) / 3) * 18;
    rb_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#000000\" "
                 "stroke-width=\"1.6\"/>\n", lx, y - 4, lx + 12, y - 4);
    svg_text(b, lx + 16, y, "start", 11, NULL, "Pareto front (least PPL for the bytes)");
    rb_printf(b, "</svg>\n");
    free(gf), free(sf), free(idx);
    return 1;
}

/* ---------------------------------------------------------------- figures: dispatch */

static int has_figure(const struct kv_report *r, int f) {
    switch (f) {
    case 0:
    case 1: return r->has_spectra;
    case 2:
    case 3: return r->comp_path != NULL;
    case 4: return r->comp_path && r->has_measured;
    default: return r->n_points > 0;
    }
}

int kv_report_figures(const struct kv_report *r, const char **names, int cap) {
    int n = 0;
    for (int f = 0; f < KV_REPORT_N_FIGURES; f++)
        if (has_figure(r, f)) {
            if (n < cap) names[n] = kv_report_figure_names[f];
            n++;
        }
    return n;
}

static int render_figure(struct rb *b, const struct kv_report *r, int f, int standalone) {
    switch (f) {
    case 0: fig_spectra(b, r, standalone, 0); break;
    case 1: fig_spectra(b, r, standalone, 1); break;
    case 2: fig_ranks(b, r, standalone); break;
    case 3: fig_bytes(b, r, standalone); break;
    case 4: fig_error(b, r, standalone); break;
    default:
        if (!fig_quality(b, r, standalone)) b->oom = 1;
    }
    return !b->oom;
}

static int figure_index(const char *name) {
    for (int f = 0; f < KV_REPORT_N_FIGURES; f++)
        if (!strcmp(name, kv_report_figure_names[f])) return f;
    return -1;
}

int kv_report_svg(const struct kv_report *r, const char *figure, char **out, size_t *len,
                  struct kv_err *err) {
    int f = figure_index(figure);
    if (f < 0 || !has_figure(r, f))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "the report draws no figure '%s'", figure);
    struct rb b = {0};
    render_figure(&b, r, f, 1);
    return rb_done(&b, out, len, err);
}

/* ---------------------------------------------------------------- the page */

static const char *const css =
    "body{font-family:" FONT ";max-width:1180px;margin:24px auto;padding:0 16px;color:#222;"
    "background:#fff;line-height:1.45}\n"
    "h1{font-size:1.6em;margin-bottom:0.2em}h2{font-size:1.25em;border-bottom:1px solid #ccc;"
    "padding-bottom:0.2em;margin-top:1.8em}\n"
    "figure{margin:1em 0;overflow-x:auto}figcaption{font-size:0.85em;color:#555}\n"
    "table{border-collapse:collapse;font-size:0.85em}td,th{border:1px solid #ccc;padding:2px 6px;"
    "text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}\n"
    "dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px}dt{font-weight:bold}"
    "dd{margin:0;overflow-wrap:anywhere}\ncode,pre{font-family:DejaVu Sans Mono,monospace;font-size:0.9em}"
    "pre{white-space:pre-wrap;background:#f7f7f7;padding:6px}\n.na{color:#888}\n";

static void figure_block(struct rb *b, const struct kv_report *r, int f, const char *stem) {
    rb_printf(b, "<figure id=\"fig-%s\">\n", kv_report_figure_names[f]);
    render_figure(b, r, f, 0);
    rb_printf(b, "<figcaption>figure file: <code>");
    rb_escf(b, "%s-%s.svg", base_name(stem), kv_report_figure_names[f]);
    rb_printf(b, "</code></figcaption>\n</figure>\n");
}

static void num_cell(struct rb *b, double v, const char *fmt) {
    if (isnan(v))
        rb_printf(b, "<td class=\"na\">-</td>");
    else {
        rb_printf(b, "<td>");
        rb_printf(b, fmt, v);
        rb_printf(b, "</td>");
    }
}

static void error_table(struct rb *b, const struct kv_report *r) {
    double sr[2] = {0, 0}, st[2] = {0, 0}, pd[2] = {0, 0}, pe[2] = {0, 0};
    int64_t nm[2] = {0, 0}, nn[2] = {0, 0};
    for (int64_t i = 0; i < r->n_units; i++) {
        const struct kv_report_unit *u = &r->units[i];
        if (u->rank <= 0) continue;
        if (isnan(u->measured)) {
            nn[u->which]++;
            continue;
        }
        nm[u->which]++;
        sr[u->which] += u->resid, st[u->which] += u->total;
        if (!isnan(u->predicted)) pd[u->which] += u->predicted * u->total, pe[u->which] += u->total;
    }
    rb_printf(b, "<table>\n<tr><th class=\"l\">side</th><th>units measured</th><th>not measured</th>"
                 "<th>measured Σ‖y−ŷ‖² / Σ‖y‖²</th></tr>\n");
    for (int w = 0; w < 2; w++) {
        rb_printf(b, "<tr><td class=\"l\">%s</td><td>%lld</td><td>%lld</td>", side_name(w),
                  (long long)nm[w], (long long)nn[w]);
        num_cell(b, st[w] > 0 ? sr[w] / st[w] : NAN, "%.6g");
        rb_printf(b, "</tr>\n");
    }
    rb_printf(b, "</table>\n<details><summary>every unit</summary>\n<table>\n"
                 "<tr><th>layer</th><th class=\"l\">side</th><th>unit</th><th class=\"l\">KV heads</th>"
                 "<th class=\"l\">mode</th><th>rank / width</th><th>bytes/token</th>"
                 "<th>predicted</th><th>measured</th><th>measured / predicted</th></tr>\n");
    for (int64_t i = 0; i < r->n_units; i++) {
        const struct kv_report_unit *u = &r->units[i];
        if (u->rank <= 0) continue;
        rb_printf(b, "<tr><td>%lld</td><td class=\"l\">%s</td><td>%lld</td><td class=\"l\">%lld-%lld"
                     "</td><td class=\"l\">%s</td><td>%lld / %lld</td><td>%lld</td>",
                  (long long)u->layer, side_name(u->which), (long long)u->unit, (long long)u->head0,
                  (long long)(u->head0 + u->n_heads - 1), kv_lr_mode_name((enum kv_lr_mode)u->mode),
                  (long long)u->rank, (long long)u->width, (long long)u->bytes);
        num_cell(b, u->predicted, "%.6g");
        if (isnan(u->measured)) {
            rb_printf(b, "<td class=\"na l\" colspan=\"2\">not measured: ");
            rb_esc(b, u->why);
            rb_printf(b, "</td>");
        } else {
            num_cell(b, u->measured, "%.6g");
            num_cell(b, u->predicted > 0 ? u->measured / u->predicted : NAN, "%.6f");
        }
        rb_printf(b, "</tr>\n");
    }
    rb_printf(b, "</table>\n</details>\n");
}

static void dl_item(struct rb *b, const char *k, const char *v) {
    rb_printf(b, "<dt>");
    rb_esc(b, k);
    rb_printf(b, "</dt><dd>");
    rb_esc(b, v);
    rb_printf(b, "</dd>\n");
}

static void provenance(struct rb *b, const struct kv_report *r) {
    char buf[1600];
    rb_printf(b, "<section id=\"provenance\">\n<h2>How this was made</h2>\n<dl>\n");
    if (r->model_path) {
        dl_item(b, "model", r->model_path);
        dl_item(b, "config", r->model_desc);
        dl_item(b, "fingerprint", r->fingerprint);
    }
    for (int64_t i = 0; i < r->n_stats; i++) {
        const struct kv_report_stats *s = &r->stats[i];
        snprintf(buf, sizeof buf, "%s statistics", s->role);
        dl_item(b, buf, s->path);
        int n = snprintf(buf, sizeof buf, "%lld tokens in %lld windows of %lld, %s", (long long)s->info.tokens,
                         (long long)s->info.windows, (long long)s->info.seq_len, s->info.sampling);
        if (!strcmp(s->info.sampling, "random"))
            n += snprintf(buf + n, sizeof buf - (size_t)n, " (seed %llu)", (unsigned long long)s->info.seed);
        if (s->info.tokenization[0])
            snprintf(buf + n, sizeof buf - (size_t)n, ", %s", s->info.tokenization);
        dl_item(b, "", buf);
        for (int64_t k = 0; k < s->info.n_inputs; k++) dl_item(b, "", s->inputs[k]);
    }
    if (r->comp_path) {
        dl_item(b, "compressed", r->comp_path);
        snprintf(buf, sizeof buf, "method %s, alloc %s, %s latents%s", r->method, r->alloc,
                 r->kv_bits == KV_LR_BITS_MIXED ? "mixed-bit" : r->kv_bits >= 16 ? "fp16" : "integer",
                 r->hadamard ? ", hadamard" : "");
        if (r->kv_bits > 0 && r->kv_bits < 16)
            snprintf(buf, sizeof buf, "method %s, alloc %s, %d-bit latents%s", r->method, r->alloc,
                     r->kv_bits, r->hadamard ? ", hadamard" : "");
        dl_item(b, "", buf);
        if (r->options_json) dl_item(b, "options", r->options_json);
        if (r->source) dl_item(b, "made from", r->source);
        snprintf(buf, sizeof buf, "%lld bytes per token compressed, %lld base (%.4f kept)",
                 (long long)r->comp_bytes, (long long)r->base_bytes,
                 r->base_bytes ? (double)r->comp_bytes / (double)r->base_bytes : 0.0);
        dl_item(b, "KV cache", buf);
    }
    for (int64_t i = 0; i < r->n_results; i++) {
        dl_item(b, "results", r->results_paths[i]);
        snprintf(buf, sizeof buf, "%lld rows plotted, %lld refused by decompose (left out)",
                 (long long)r->results_rows[i], (long long)r->results_refused[i]);
        dl_item(b, "", buf);
    }
    if (r->n_results)
        dl_item(b, "protocol",
                "each row: kvcal decompose, then kvcal verify on held-out text (windows of "
                "seq-len tokens, non-overlapping, every position after the first scored, base "
                "and compressed on the same windows); PPL and KL from verify, bytes per token "
                "kept from the compressed model");
    for (int64_t i = 0; i < r->n_verify; i++) dl_item(b, "verify", r->verify_paths[i]);
    rb_printf(b, "</dl>\n</section>\n");
}

int kv_report_html(const struct kv_report *r, const char *svg_stem, char **out, size_t *len,
                   struct kv_err *err) {
    struct rb b = {0};
    rb_printf(&b, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>");
    rb_esc(&b, r->title);
    rb_printf(&b, "</title>\n<style>\n%s</style>\n</head>\n<body>\n<h1>", css);
    rb_esc(&b, r->title);
    rb_printf(&b, "</h1>\n<p>");
    if (r->model_path) rb_escf(&b, "Model %s: %s. ", r->model_path, r->model_desc);
    if (r->comp_path)
        rb_escf(&b, "Compressed with %s (alloc %s) to %lld of %lld KV bytes per token (%.4f). ",
                r->method, r->alloc, (long long)r->comp_bytes, (long long)r->base_bytes,
                r->base_bytes ? (double)r->comp_bytes / (double)r->base_bytes : 0.0);
    if (r->n_points) rb_escf(&b, "%lld quality points. ", (long long)r->n_points);
    rb_printf(&b, "Written by kvcal report: no script, nothing fetched; each figure is also a "
                  "separate SVG file.</p>\n");
    static const char *const heads[KV_REPORT_N_FIGURES] = {
        "Eigen-spectra of the K and V output covariances",
        "Variance explained and the chosen ranks",
        "Ranks per layer and KV head",
        "KV cache bytes per token per layer",
        "Predicted against measured error",
        "Quality against KV cache size"};
    static const char *const texts[KV_REPORT_N_FIGURES] = {
        "For each layer, the eigenvalues of each unit's output covariance Σ yᵀy (y = x Wᵀ + b "
        "over the calibration tokens; keys before RoPE), divided by the largest, on a log "
        "axis. A curve that falls fast means a few directions hold the unit's output: it "
        "compresses well. A flat curve needs a high rank.",
        "The same eigenvalues as the fraction of the unit's calibration variance that the "
        "first r directions explain, 1 − Σ_{i>r} λ_i / (Σ λ_i − N‖μ‖²) with μ the output's "
        "mean: what the eps rule of kvcal decompose thresholds (the plain cumulative energy "
        "Σ_{i≤r} λ_i / Σ λ_i when the mean is zero). A dot marks the rank each unit of the "
        "compressed model has, and the dashed line the eps it was asked to keep, when given: "
        "the smallest rank at or above the line. Where the basis is not "
        "the plain energy one (--basis output or loss, --center, post-RoPE rotations, svd "
        "without statistics) the rank was chosen in another metric and need not sit on the "
        "curve at eps.",
        "Each cell is one unit of the compressed model: its rank, coloured by rank over the "
        "unit's width (n_heads × head_dim). A unit of several KV heads spans their columns; "
        "grey cells are sides kept full.",
        "The KV cache bytes per token each layer stores, base (fp16 K and V) against the "
        "compressed keys and values, counted by the library as kvcal verify and inspect do "
        "(latent bits, scales and zero points included).",
        "Each unit's predicted relative error (dropped / energy, from the manifest: the "
        "calibration energy its rank leaves out) against its error measured exactly on the "
        "held-out statistics: Σ‖y − ŷ‖² / Σ‖y‖² over their tokens, with ŷ = up (down x + "
        "down_bias) + up_bias, computed from the statistics' XᵀX, Σx and token count. On the "
        "dashed line y = x the calibration predicted the held-out error; points above it "
        "lose more on new text. Quantization noise of the latents is not included. Units "
        "without down/up factors (post-RoPE rotations) are not measured.",
        "Perplexity (log axis) against the KV cache bytes per token kept, a fraction of the "
        "base, for each results row (one colour and marker per method) and each --verify run "
        "(black stars). One panel per model, evaluation text and window count. The black line "
        "joins the Pareto front: the rows no other row beats on both bytes and perplexity. "
        "The dashed line is the base model's perplexity. Hovering a marker shows its row."};
    for (int f = 0; f < KV_REPORT_N_FIGURES; f++) {
        if (!has_figure(r, f)) continue;
        rb_printf(&b, "<section id=\"%s\">\n<h2>", kv_report_figure_names[f]);
        rb_esc(&b, heads[f]);
        rb_printf(&b, "</h2>\n<p>");
        rb_esc(&b, texts[f]);
        rb_printf(&b, "</p>\n");
        figure_block(&b, r, f, svg_stem);
        if (f == 4) {
            rb_printf(&b, "<p>Measured on ");
            rb_esc(&b, r->eval_path ? r->eval_path : "?");
            rb_printf(&b, ".</p>\n");
            error_table(&b, r);
        }
        rb_printf(&b, "</section>\n");
    }
    provenance(&b, r);
    rb_printf(&b, "</body>\n</html>\n");
    return rb_done(&b, out, len, err);
}

/* ---------------------------------------------------------------- files */

char *kv_report_svg_path(const char *html_path, const char *figure) {
    size_t n = strlen(html_path);
    if (n > 5 && !strcmp(html_path + n - 5, ".html")) n -= 5;
    size_t cap = n + strlen(figure) + 6;
    char *p = malloc(cap);
    if (p) snprintf(p, cap, "%.*s-%s.svg", (int)n, html_path, figure);
    return p;
}

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

int kv_report_check_output(const char *html_path, struct kv_err *err) {
    if (!*html_path || is_dir(html_path) || html_path[strlen(html_path) - 1] == '/')
        return kv_fail(err, KV_EINVAL, html_path, KV_NO_OFFSET,
                       "is a directory; --output names the report's HTML file");
    /* the folder it goes in, now rather than after the work */
    const char *slash = strrchr(html_path, '/');
    if (slash) {
        char *dir = strndup(html_path, slash == html_path ? 1 : (size_t)(slash - html_path));
        if (!dir) return nomem(err);
        int ok = is_dir(dir);
        if (!ok) kv_fail(err, KV_EIO, html_path, KV_NO_OFFSET, "its folder '%s' does not exist", dir);
        free(dir);
        if (!ok) return KV_EIO;
    }
    for (int f = 0; f < KV_REPORT_N_FIGURES; f++) {
        char *p = kv_report_svg_path(html_path, kv_report_figure_names[f]);
        if (!p) return nomem(err);
        int d = is_dir(p);
        if (d) kv_fail(err, KV_EINVAL, p, KV_NO_OFFSET, "is a directory, where the report's figure goes");
        free(p);
        if (d) return KV_EINVAL;
    }
    return KV_OK;
}

struct fill_ctx {
    const char *data;
    size_t len;
};

static int fill_bytes(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    const struct fill_ctx *c = ctx;
    size_t at = 0;
    while (at < c->len) {
        ssize_t w = write(fd, c->data + at, c->len - at);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                           strerror(w < 0 ? errno : EIO));
        at += (size_t)w;
    }
    return KV_OK;
}

static int write_file(const char *path, const char *data, size_t len, struct kv_err *err) {
    struct fill_ctx c = {data, len};
    return kv_write_atomic(path, fill_bytes, &c, err);
}

int kv_report_write(const struct kv_report *r, const char *html_path, int *n_svg,
                    struct kv_err *err) {
    int rc = kv_report_check_output(html_path, err), n = 0;
    if (rc) return rc;
    size_t sl = strlen(html_path);
    char *stem = strdup(html_path);
    if (!stem) return nomem(err);
    if (sl > 5 && !strcmp(stem + sl - 5, ".html")) stem[sl - 5] = 0;
    char *page = NULL;
    size_t len = 0;
    for (int f = 0; f < KV_REPORT_N_FIGURES && !rc; f++) {
        if (!has_figure(r, f)) continue;
        char *svg = NULL, *p = kv_report_svg_path(html_path, kv_report_figure_names[f]);
        if (!p) rc = nomem(err);
        if (!rc) rc = kv_report_svg(r, kv_report_figure_names[f], &svg, &len, err);
        if (!rc) rc = write_file(p, svg, len, err);
        if (!rc) n++;
        free(svg), free(p);
    }
    if (!rc) rc = kv_report_html(r, stem, &page, &len, err);
    if (!rc) rc = write_file(html_path, page, len, err);
    free(page), free(stem);
    if (n_svg) *n_svg = n;
    return rc;
}
