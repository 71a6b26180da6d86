/* Normalizers and pre-tokenizers of tokenizer.json files (see pretok.h).
 *
 * Regexes are PCRE2 with UTF, UCP and MATCH_INVALID_UTF (a string pattern
 * is compiled with PCRE2_LITERAL instead of UCP). Every match runs under
 * a match limit and a depth limit, so a pattern that backtracks
 * catastrophically fails with an error instead of running for hours; a JIT
 * stack of up to 8 MiB is made per call. Unicode normalization is
 * utf8proc_map on each maximal run of valid UTF-8; the bytes between runs
 * are copied. Lowercase maps each code point with utf8proc_tolower, plus the
 * two context rules the Rust and JavaScript libraries apply: U+0130 becomes
 * "i" + U+0307, and a capital sigma that ends a word (a letter before it,
 * none after it) becomes the final sigma U+03C2. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "pretok.h"

#include <pcre2.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "err.h"

const char kv_pt_gpt2_regex[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* Limits on one regex search: enough for any real pre-tokenizer on a 64 KiB
 * chunk, far below what a catastrophic pattern needs. */
#define PT_MATCH_LIMIT 10000000u
#define PT_DEPTH_LIMIT 100000u
#define PT_JIT_STACK (8u << 20)

enum pt_kind {
    PT_N_UNICODE,
    PT_N_PREPEND,
    PT_N_REPLACE,
    PT_N_STRIP,
    PT_S_SPLIT,
    PT_S_BYTELEVEL,
    PT_S_METASPACE,
};

struct pt_op {
    enum pt_kind kind;
    int form;      /* PT_N_UNICODE: enum kv_pt_norm; PT_S_METASPACE: scheme */
    int a, b;      /* strip left/right; split behavior/invert; bytelevel prefix/regex;
                      metaspace split */
    char *s, *t;   /* prepend / replacement string, replace pattern (literal) and content */
    size_t sn, tn;
    pcre2_code *re;
};

struct kv_pretok {
    struct pt_op *ops;
    size_t n, cap;
    int n_norm, n_stage;
    pcre2_code *gpt2; /* shared by ByteLevel stages with use_regex */
};

/* ---------------------------------------------------------------- buffers */

void kv_pt_buf_free(struct kv_pt_buf *b) {
    if (!b) return;
    free(b->buf);
    free(b->ends);
    memset(b, 0, sizeof *b);
}

static int buf_reserve(struct kv_pt_buf *b, size_t more) {
    if (b->cap - b->len >= more) return KV_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < more) {
        if (cap > SIZE_MAX / 4) return KV_ENOMEM;
        cap *= 2;
    }
    char *p = realloc(b->buf, cap);
    if (!p) return KV_ENOMEM;
    b->buf = p;
    b->cap = cap;
    return KV_OK;
}

static int buf_put(struct kv_pt_buf *b, const void *s, size_t n) {
    if (!n) return KV_OK;
    if (buf_reserve(b, n)) return KV_ENOMEM;
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    return KV_OK;
}

/* End the current piece at b->len (an empty piece is dropped). */
static int buf_cut(struct kv_pt_buf *b) {
    size_t start = b->n ? b->ends[b->n - 1] : 0;
    if (b->len == start) return KV_OK;
    if (b->n == b->cap_n) {
        size_t cap = b->cap_n ? 2 * b->cap_n : 64;
        size_t *e = realloc(b->ends, cap * sizeof *e);
        if (!e) return KV_ENOMEM;
        b->ends = e;
        b->cap_n = cap;
    }
    b->ends[b->n++] = b->len;
    return KV_OK;
}

static void buf_clear(struct kv_pt_buf *b) {
    b->len = 0;
    b->n = 0;
}

static int oom(struct kv_err *err) {
    return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory pre-tokenizing text");
}

/* ---------------------------------------------------------------- building */

int kv_pretok_new(struct kv_pretok **out, struct kv_err *err) {
    *out = calloc(1, sizeof **out);
    return *out ? KV_OK : oom(err);
}

void kv_pretok_free(struct kv_pretok *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n; i++) {
        free(p->ops[i].s);
        free(p->ops[i].t);
        pcre2_code_free(p->ops[i].re);
    }
    pcre2_code_free(p->gpt2);
    free(p->ops);
    free(p);
}

static struct pt_op *push_op(struct kv_pretok *p, enum pt_kind kind) {
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 8;
        struct pt_op *o = realloc(p->ops, cap * sizeof *o);
        if (!o) return NULL;
        p->ops = o;
        p->cap = cap;
    }
    struct pt_op *o = &p->ops[p->n++];
    memset(o, 0, sizeof *o);
    o->kind = kind;
    if (kind <= PT_N_STRIP) p->n_norm++;
    else p->n_stage++;
    return o;
}

static char *dup_bytes(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        if (n) memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static int compile(const char *pat, size_t n, int regex, pcre2_code **re, struct kv_err *err) {
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (regex ? PCRE2_UCP : PCRE2_LITERAL);
    int ec;
    PCRE2_SIZE eo;
    *re = pcre2_compile((PCRE2_SPTR)pat, n, opts, &ec, &eo, NULL);
    if (!*re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return kv_fail(err, KV_EFORMAT, NULL, KV_NO_OFFSET,
                       "regex '%.80s' does not compile at offset %zu: %s", pat, (size_t)eo,
                       (const char *)msg);
    }
    (void)pcre2_jit_compile(*re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
    return KV_OK;
}

int kv_pretok_norm_unicode(struct kv_pretok *p, enum kv_pt_norm form, struct kv_err *err) {
    struct pt_op *o = push_op(p, PT_N_UNICODE);
    if (!o) return oom(err);
    o->form = form;
    return KV_OK;
}

int kv_pretok_norm_prepend(struct kv_pretok *p, const char *s, size_t n, struct kv_err *err) {
    struct pt_op *o = push_op(p, PT_N_PREPEND);
    if (!o || !(o->s = dup_bytes(s, n))) return oom(err);
    o->sn = n;
    return KV_OK;
}

int kv_pretok_norm_replace(struct kv_pretok *p, const char *pattern, size_t plen, int regex,
                           const char *content, size_t clen, struct kv_err *err) {
    struct pt_op *o = push_op(p, PT_N_REPLACE);
    if (!o || !(o->s = dup_bytes(pattern, plen)) || !(o->t = dup_bytes(content, clen)))
        return oom(err);
    o->sn = plen;
    o->tn = clen;
    o->a = regex;
    return compile(pattern, plen, regex, &o->re, err);
}

int kv_pretok_norm_strip(struct kv_pretok *p, int left, int right, struct kv_err *err) {
    struct pt_op *o = push_op(p, PT_N_STRIP);
    if (!o) return oom(err);
    o->a = left != 0;
    o->b = right != 0;
    return KV_OK;
}

int kv_pretok_split(struct kv_pretok *p, const char *pattern, size_t plen, int regex,
                    enum kv_pt_behavior behavior, int invert, struct kv_err *err) {
    struct pt_op *o = push_op(p, PT_S_SPLIT);
    if (!o || !(o->s = dup_bytes(pattern, plen))) return oom(err);
    o->sn = plen;
    o->a = (int)behavior;
    o->b = invert != 0;
    return compile(pattern, plen, regex, &o->re, err);
}

int kv_pretok_bytelevel(struct kv_pretok *p, int add_prefix_space, int use_regex,
                        struct kv_err *err) {
    struct pt_op *o = push_op(p, PT_S_BYTELEVEL);
    if (!o) return oom(err);
    o->a = add_prefix_space != 0;
    o->b = use_regex != 0;
    if (use_regex && !p->gpt2)
        return compile(kv_pt_gpt2_regex, sizeof kv_pt_gpt2_regex - 1, 1, &p->gpt2, err);
    return KV_OK;
}

int kv_pretok_metaspace(struct kv_pretok *p, const char *replacement, size_t n,
                        enum kv_pt_scheme scheme, int split, struct kv_err *err) {
    struct pt_op *o = push_op(p, PT_S_METASPACE);
    if (!o || !(o->s = dup_bytes(replacement, n))) return oom(err);
    o->sn = n;
    o->form = (int)scheme;
    o->a = split != 0;
    return KV_OK;
}

int kv_pretok_has_normalizers(const struct kv_pretok *p) { return p && p->n_norm > 0; }
int kv_pretok_has_stages(const struct kv_pretok *p) { return p && p->n_stage > 0; }

/* ---------------------------------------------------------------- matching */

struct pt_match {
    size_t start, end;
};

struct pt_matches {
    struct pt_match *v;
    size_t n, cap;
};

/* Length of the character at s (1 for a byte that starts no valid one). */
static size_t char_len(const unsigned char *s, size_t n) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate(s, (utf8proc_ssize_t)n, &cp);
    return k > 0 ? (size_t)k : 1;
}

/* Every match of re in s[0, n), left to right, as the Rust crate finds them:
 * after an empty match the search goes on one character later. */
static int find_all(const pcre2_code *re, const char *s, size_t n, struct pt_matches *m,
                    struct kv_err *err) {
    m->n = 0;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    pcre2_match_context *mc = pcre2_match_context_create(NULL);
    pcre2_jit_stack *js = pcre2_jit_stack_create(32u << 10, PT_JIT_STACK, NULL);
    int rc = KV_OK;
    if (!md || !mc || !js) {
        rc = oom(err);
        goto done;
    }
    pcre2_set_match_limit(mc, PT_MATCH_LIMIT);
    pcre2_set_depth_limit(mc, PT_DEPTH_LIMIT);
    pcre2_jit_stack_assign(mc, NULL, js);
    for (size_t pos = 0; pos <= n;) {
        int r = pcre2_match(re, (PCRE2_SPTR)s, n, pos, 0, md, mc);
        if (r == PCRE2_ERROR_NOMATCH) break;
        if (r < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(r, msg, sizeof msg);
            rc = kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                         "a pre-tokenizer regex failed %zu bytes into a piece of %zu: %s", pos,
                         n, (const char *)msg);
            goto done;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (m->n == m->cap) {
            size_t cap = m->cap ? 2 * m->cap : 256;
            struct pt_match *v = realloc(m->v, cap * sizeof *v);
            if (!v) {
                rc = oom(err);
                goto done;
            }
            m->v = v;
            m->cap = cap;
        }
        m->v[m->n++] = (struct pt_match){ov[0], ov[1]};
        if (ov[1] > ov[0]) {
            pos = ov[1];
        } else {
            if (ov[1] >= n) break;
            pos = ov[1] + char_len((const unsigned char *)s + ov[1], n - ov[1]);
        }
    }
done:
    pcre2_jit_stack_free(js);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
    return rc;
}

/* Split s[0, n) by the matches into out's pieces with the behaviour. */
static int split_piece(const char *s, size_t n, const struct pt_matches *m, int behavior,
                       int invert, struct kv_pt_buf *out) {
    /* The spans of text: gaps (kind 0) and matches (kind 1), in order. */
    struct span {
        size_t a, b;
        int match;
    };
    size_t cap = 2 * m->n + 1, k = 0, prev = 0;
    struct span *sp = malloc(cap * sizeof *sp);
    if (!sp) return KV_ENOMEM;
    for (size_t i = 0; i < m->n; i++) {
        if (m->v[i].start != prev) sp[k++] = (struct span){prev, m->v[i].start, 0};
        sp[k++] = (struct span){m->v[i].start, m->v[i].end, 1};
        prev = m->v[i].end;
    }
    if (prev != n || k == 0) sp[k++] = (struct span){prev, n, 0};
    if (invert)
        for (size_t i = 0; i < k; i++) sp[i].match = !sp[i].match;
    /* Fold into pieces (a, b), as the Rust crate's split does. */
    size_t np = 0;
    struct span *pc = malloc(cap * sizeof *pc);
    if (!pc) {
        free(sp);
        return KV_ENOMEM;
    }
    int prev_match = 0;
    switch (behavior) {
    case KV_PT_REMOVED:
        for (size_t i = 0; i < k; i++)
            if (!sp[i].match) pc[np++] = sp[i];
        break;
    case KV_PT_ISOLATED:
        for (size_t i = 0; i < k; i++) pc[np++] = sp[i];
        break;
    case KV_PT_MERGED_PREV:
        for (size_t i = 0; i < k; i++) {
            if (sp[i].match && !prev_match && np) pc[np - 1].b = sp[i].b;
            else pc[np++] = sp[i];
            prev_match = sp[i].match;
        }
        break;
    case KV_PT_MERGED_NEXT:
        /* Folded from the right, then read back in order. */
        for (size_t i = k; i-- > 0;) {
            if (sp[i].match && !prev_match && np) pc[np - 1].a = sp[i].a;
            else pc[np++] = sp[i];
            prev_match = sp[i].match;
        }
        for (size_t i = 0; i < np / 2; i++) {
            struct span t = pc[i];
            pc[i] = pc[np - 1 - i];
            pc[np - 1 - i] = t;
        }
        break;
    default: /* KV_PT_CONTIGUOUS */
        for (size_t i = 0; i < k; i++) {
            if (sp[i].match == prev_match && np) pc[np - 1].b = sp[i].b;
            else pc[np++] = sp[i];
            prev_match = sp[i].match;
        }
        break;
    }
    int rc = KV_OK;
    for (size_t i = 0; i < np && !rc; i++) {
        rc = buf_put(out, s + pc[i].a, pc[i].b - pc[i].a);
        if (!rc) rc = buf_cut(out);
    }
    free(sp);
    free(pc);
    return rc;
}

/* ---------------------------------------------------------------- normalizers */

static int is_space_cp(utf8proc_int32_t c) {
    if (c == 9 || c == 10 || c == 11 || c == 12 || c == 13 || c == 0x85) return 1;
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_ZS || k == UTF8PROC_CATEGORY_ZL || k == UTF8PROC_CATEGORY_ZP;
}

static int is_letter_cp(utf8proc_int32_t c) {
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

/* One Unicode normalization form or lower-casing of s[0, n) into out. */
static int norm_unicode(int form, const char *s, size_t n, struct kv_pt_buf *out) {
    static const utf8proc_option_t opt[] = {
        [KV_PT_NFC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE,
        [KV_PT_NFD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE,
        [KV_PT_NFKC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
        [KV_PT_NFKD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT,
    };
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        /* The next maximal run of valid UTF-8. */
        size_t j = i;
        utf8proc_int32_t cp;
        while (j < n) {
            utf8proc_ssize_t k = utf8proc_iterate(u + j, (utf8proc_ssize_t)(n - j), &cp);
            if (k <= 0) break;
            j += (size_t)k;
        }
        if (j > i) {
            if (form == KV_PT_LOWERCASE) {
                for (size_t q = i; q < j;) {
                    utf8proc_ssize_t k = utf8proc_iterate(u + q, (utf8proc_ssize_t)(j - q), &cp);
                    utf8proc_int32_t lc = utf8proc_tolower(cp);
                    unsigned char enc[8];
                    if (cp == 0x130) {
                        if (buf_put(out, "i\xcc\x87", 3)) return KV_ENOMEM;
                    } else {
                        if (cp == 0x3a3) {
                            /* Final sigma: a letter before, none after. */
                            int before = 0, after = 0;
                            if (q > i) {
                                size_t b = q - 1;
                                while (b > i && (u[b] & 0xc0) == 0x80) b--;
                                utf8proc_int32_t pc;
                                if (utf8proc_iterate(u + b, (utf8proc_ssize_t)(q - b), &pc) > 0)
                                    before = is_letter_cp(pc);
                            }
                            utf8proc_int32_t nc;
                            if (q + (size_t)k < j &&
                                utf8proc_iterate(u + q + k, (utf8proc_ssize_t)(j - q - (size_t)k),
                                                 &nc) > 0)
                                after = is_letter_cp(nc);
                            if (before && !after) lc = 0x3c2;
                        }
                        utf8proc_ssize_t e = utf8proc_encode_char(lc, enc);
                        if (buf_put(out, enc, (size_t)e)) return KV_ENOMEM;
                    }
                    q += (size_t)k;
                }
            } else {
                utf8proc_uint8_t *dst = NULL;
                utf8proc_ssize_t r =
                    utf8proc_map(u + i, (utf8proc_ssize_t)(j - i), &dst, opt[form]);
                if (r < 0) {
                    free(dst);
                    return r == UTF8PROC_ERROR_NOMEM ? KV_ENOMEM : KV_EFORMAT;
                }
                int rc = buf_put(out, dst, (size_t)r);
                free(dst);
                if (rc) return rc;
            }
        }
        if (j < n) {
            if (buf_put(out, u + j, 1)) return KV_ENOMEM; /* a byte that is not UTF-8 */
            j++;
        }
        i = j;
    }
    return KV_OK;
}

static int norm_replace(const struct pt_op *o, const char *s, size_t n, struct kv_pt_buf *out,
                        struct pt_matches *m, struct kv_err *err) {
    int rc = find_all(o->re, s, n, m, err);
    if (rc) return rc;
    size_t prev = 0;
    for (size_t i = 0; i < m->n; i++) {
        if (buf_put(out, s + prev, m->v[i].start - prev) || buf_put(out, o->t, o->tn))
            return oom(err);
        prev = m->v[i].end;
    }
    return buf_put(out, s + prev, n - prev) ? oom(err) : KV_OK;
}

static void strip_span(const char *s, size_t n, int left, int right, size_t *a, size_t *b) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, j = n;
    utf8proc_int32_t cp;
    while (left && i < n) {
        utf8proc_ssize_t k = utf8proc_iterate(u + i, (utf8proc_ssize_t)(n - i), &cp);
        if (k <= 0 || !is_space_cp(cp)) break;
        i += (size_t)k;
    }
    while (right && j > i) {
        size_t b0 = j - 1;
        while (b0 > i && (u[b0] & 0xc0) == 0x80) b0--;
        utf8proc_ssize_t k = utf8proc_iterate(u + b0, (utf8proc_ssize_t)(j - b0), &cp);
        if (k <= 0 || (size_t)k != j - b0 || !is_space_cp(cp)) break;
        j = b0;
    }
    *a = i;
    *b = j;
}

int kv_pretok_normalize(const struct kv_pretok *p, const char *text, size_t len, unsigned where,
                        struct kv_pt_buf *out, struct kv_err *err) {
    buf_clear(out);
    if (buf_put(out, text, len)) return oom(err);
    struct kv_pt_buf tmp = {0};
    struct pt_matches m = {0};
    int rc = KV_OK;
    for (size_t i = 0; i < p->n && !rc; i++) {
        const struct pt_op *o = &p->ops[i];
        if (o->kind > PT_N_STRIP) continue;
        buf_clear(&tmp);
        switch (o->kind) {
        case PT_N_UNICODE:
            rc = norm_unicode(o->form, out->buf, out->len, &tmp);
            if (rc == KV_ENOMEM) rc = oom(err);
            else if (rc) rc = kv_fail(err, KV_EFORMAT, NULL, KV_NO_OFFSET, "text does not normalize");
            break;
        case PT_N_PREPEND:
            if (out->len && (where & KV_PT_START) && buf_put(&tmp, o->s, o->sn)) rc = oom(err);
            if (!rc && buf_put(&tmp, out->buf, out->len)) rc = oom(err);
            break;
        case PT_N_REPLACE:
            rc = norm_replace(o, out->buf, out->len, &tmp, &m, err);
            break;
        default: { /* PT_N_STRIP */
            size_t a, b;
            strip_span(out->buf, out->len, o->a && (where & KV_PT_START),
                       o->b && (where & KV_PT_END), &a, &b);
            if (buf_put(&tmp, out->buf + a, b - a)) rc = oom(err);
            break;
        }
        }
        if (!rc) {
            struct kv_pt_buf t = *out;
            *out = tmp;
            tmp = t;
        }
    }
    kv_pt_buf_free(&tmp);
    free(m.v);
    out->n = 0;
    return rc;
}

/* ---------------------------------------------------------------- stages */

static int stage(const struct kv_pretok *p, const struct pt_op *o, const struct kv_pt_buf *in,
                 unsigned where, struct kv_pt_buf *out, struct pt_matches *m,
                 struct kv_err *err) {
    buf_clear(out);
    struct kv_pt_buf tmp = {0};
    int rc = KV_OK;
    for (size_t i = 0; i < in->n && !rc; i++) {
        size_t a = i ? in->ends[i - 1] : 0, b = in->ends[i];
        const char *s = in->buf + a;
        size_t n = b - a;
        switch (o->kind) {
        case PT_S_SPLIT:
            rc = find_all(o->re, s, n, m, err);
            if (!rc && split_piece(s, n, m, o->a, o->b, out)) rc = oom(err);
            break;
        case PT_S_BYTELEVEL:
            buf_clear(&tmp);
            if (o->a && s[0] != ' ' && buf_put(&tmp, " ", 1)) rc = oom(err);
            if (!rc && buf_put(&tmp, s, n)) rc = oom(err);
            if (rc) break;
            if (o->b) {
                rc = find_all(p->gpt2, tmp.buf, tmp.len, m, err);
                if (!rc && split_piece(tmp.buf, tmp.len, m, KV_PT_ISOLATED, 0, out)) rc = oom(err);
            } else if (buf_put(out, tmp.buf, tmp.len) || buf_cut(out)) {
                rc = oom(err);
            }
            break;
        default: { /* PT_S_METASPACE */
            buf_clear(&tmp);
            int first = i == 0 && (where & KV_PT_INPUT);
            int starts = n >= 1 && s[0] == ' ';
            if (!starts && (o->form == KV_PT_ALWAYS || (o->form == KV_PT_FIRST && first)) &&
                !(n >= o->sn && memcmp(s, o->s, o->sn) == 0))
                rc = buf_put(&tmp, o->s, o->sn);
            for (size_t k = 0; k < n && !rc; k++)
                rc = s[k] == ' ' ? buf_put(&tmp, o->s, o->sn) : buf_put(&tmp, s + k, 1);
            if (rc) {
                rc = oom(err);
                break;
            }
            if (!o->a) {
                if (buf_put(out, tmp.buf, tmp.len) || buf_cut(out)) rc = oom(err);
                break;
            }
            /* Split before each replacement (MergedWithNext). */
            size_t from = 0;
            for (size_t k = 1; k + o->sn <= tmp.len;) {
                const char *hit = memmem(tmp.buf + k, tmp.len - k, o->s, o->sn);
                if (!hit) break;
                k = (size_t)(hit - tmp.buf);
                if (buf_put(out, tmp.buf + from, k - from) || buf_cut(out)) {
                    rc = oom(err);
                    break;
                }
                from = k;
                k += o->sn;
            }
            if (!rc && (buf_put(out, tmp.buf + from, tmp.len - from) || buf_cut(out)))
                rc = oom(err);
            break;
        }
        }
    }
    kv_pt_buf_free(&tmp);
    return rc;
}

int kv_pretok_pieces(const struct kv_pretok *p, const char *text, size_t len, unsigned where,
                     struct kv_pt_buf *out, struct kv_err *err) {
    buf_clear(out);
    if (buf_put(out, text, len) || buf_cut(out)) return oom(err);
    struct kv_pt_buf tmp = {0};
    struct pt_matches m = {0};
    int rc = KV_OK;
    for (size_t i = 0; i < p->n && !rc; i++) {
        if (p->ops[i].kind < PT_S_SPLIT) continue;
        rc = stage(p, &p->ops[i], out, where, &tmp, &m, err);
        if (!rc) {
            struct kv_pt_buf t = *out;
            *out = tmp;
            tmp = t;
        }
    }
    kv_pt_buf_free(&tmp);
    free(m.v);
    return rc;
}

/* ---------------------------------------------------------------- byte level */

/* GPT-2's bytes_to_unicode: the printable bytes '!'..'~', U+00A1..U+00AC and
 * U+00AE..U+00FF stand for themselves; the other 68 bytes, in order, are
 * U+0100, U+0101, ... */
static int byte_of_cp(utf8proc_int32_t cp) {
    if ((cp >= 0x21 && cp <= 0x7e) || (cp >= 0xa1 && cp <= 0xac) || (cp >= 0xae && cp <= 0xff))
        return (int)cp;
    /* U+0100 + k: bytes 0x00..0x20 (k < 33), 0x7f..0xa0 (k < 67), 0xad. */
    int k = (int)cp - 0x100;
    if (k < 0 || k >= 68) return -1;
    return k < 33 ? k : k < 67 ? 0x7f + (k - 33) : 0xad;
}

size_t kv_bytelevel_map(const char *s, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int b = (unsigned char)s[i], c;
        if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae) c = b;
        else c = 0x100 + (b <= 0x20 ? b : b < 0xad ? 33 + (b - 0x7f) : 67);
        if (c < 0x80) {
            out[o++] = (char)c;
        } else {
            out[o++] = (char)(0xc0 | (c >> 6));
            out[o++] = (char)(0x80 | (c & 0x3f));
        }
    }
    return o;
}

size_t kv_bytelevel_unmap(const char *s, size_t n, char *out, int *mapped) {
    const unsigned char *u = (const unsigned char *)s;
    size_t o = 0;
    *mapped = 1;
    for (size_t i = 0; i < n;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate(u + i, (utf8proc_ssize_t)(n - i), &cp);
        int b = k > 0 ? byte_of_cp(cp) : -1;
        if (b >= 0) {
            out[o++] = (char)b;
            i += (size_t)k;
        } else {
            size_t c = k > 0 ? (size_t)k : 1;
            memcpy(out + o, s + i, c);
            o += c;
            i += c;
            *mapped = 0;
        }
    }
    return o;
}
