/* ggml block codecs (suite ggmlquant; formats/ggmlquant.c).
 *
 * The decoders are checked bit for bit against a naive decoder written here
 * from the spec, on random blocks. It shares nothing with the library: the
 * element order comes from a table of bit positions built by walking the
 * loop nests of ggml's reference dequantize_row_* (ggml-quants.c), the fields
 * are read by a generic little-endian bit reader, the f16 scales by ldexp,
 * and the formula is evaluated in double and rounded once to f32 (which is
 * the correctly rounded f32 of the formula, as ggml's own arithmetic is).
 * The encoders are checked by their round trip: every element within the
 * half step its decoded block's scales give, the RMS error under a ceiling
 * per type, and requantising a decoded block gives the same bytes where the
 * encoder guarantees it. Then the edge cases. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggmlquant.h"
#include "gguf.h"
#include "testutil.h"
#include <criterion/parameterized.h>
#include "xorshift64.h"

enum {
    GT_F32 = 0,
    GT_F16 = 1,
    GT_Q4_0 = 2,
    GT_Q4_1 = 3,
    GT_Q5_0 = 6,
    GT_Q5_1 = 7,
    GT_Q8_0 = 8,
    GT_Q2_K = 10,
    GT_Q3_K = 11,
    GT_Q4_K = 12,
    GT_Q5_K = 13,
    GT_Q6_K = 14,
    GT_BF16 = 30,
};

/* ------------------------------------------------------------ the spec */

/* Sizes from ggml-common.h's static_asserts; f16 fields at these byte
 * offsets; rms_max, rms_out: ceilings on the round trip's RMS relative error
 * (about 1.25 times what the encoder measured when written) for the plain
 * data sets and for the one with outliers, whose blocks get coarse steps. */
struct spec {
    uint32_t t;
    const char *name;
    int elems, bytes;
    int nf16, f16_off[2];
    double rms_max, rms_out;
};

static const struct spec specs[] = {
    {GT_F32, "F32", 1, 4, 0, {0, 0}, 0, 0},
    {GT_F16, "F16", 1, 2, 1, {0, 0}, 2.8e-4, 2.6e-4},
    {GT_BF16, "BF16", 1, 2, 0, {0, 0}, 2.2e-3, 2.6e-3},
    {GT_Q4_0, "Q4_0", 32, 18, 1, {0, 0}, 0.11, 0.13},
    {GT_Q4_1, "Q4_1", 32, 20, 2, {0, 2}, 0.10, 0.14},
    {GT_Q5_0, "Q5_0", 32, 22, 1, {0, 0}, 0.054, 0.095},
    {GT_Q5_1, "Q5_1", 32, 24, 2, {0, 2}, 0.048, 0.072},
    {GT_Q8_0, "Q8_0", 32, 34, 1, {0, 0}, 0.0068, 0.015},
    {GT_Q2_K, "Q2_K", 256, 84, 2, {80, 82}, 0.45, 0.41},
    {GT_Q3_K, "Q3_K", 256, 110, 1, {108, 0}, 0.26, 0.135},
    {GT_Q4_K, "Q4_K", 256, 144, 2, {0, 2}, 0.10, 0.14},
    {GT_Q5_K, "Q5_K", 256, 176, 2, {0, 2}, 0.05, 0.074},
    {GT_Q6_K, "Q6_K", 256, 210, 1, {208, 0}, 0.025, 0.043},
};
#define N_SPECS ((int)(sizeof specs / sizeof specs[0]))

/* Bit i of a block is bit i%8 of byte i/8; n bits from bit off, LSB first. */
static unsigned bits(const uint8_t *b, int off, int n) {
    unsigned v = 0;
    for (int i = 0; i < n; i++) v |= (unsigned)((b[(off + i) / 8] >> ((off + i) % 8)) & 1) << i;
    return v;
}
static int sbits(const uint8_t *b, int off, int n) {
    unsigned v = bits(b, off, n);
    return v >= 1u << (n - 1) ? (int)v - (1 << n) : (int)v;
}

/* IEEE binary16 and bfloat16 by their definitions. */
static double naive_f16(unsigned h) {
    int e = (h >> 10) & 31;
    unsigned m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return h >> 15 ? -v : v;
}
static double naive_bf16(unsigned h) {
    int e = (h >> 7) & 255;
    unsigned m = h & 127;
    double v = e == 0 ? ldexp(m, -133) : e == 255 ? (m ? NAN : INFINITY) : ldexp(128 + m, e - 134);
    return h >> 15 ? -v : v;
}
/* the f16 at byte offset off */
static double f16at(const uint8_t *b, int off) { return naive_f16(bits(b, 8 * off, 16)); }

/* Where each element's code lives: bit offsets of its low bits (nlo wide)
 * and high bits (nhi wide, 0 when none), and its sub-block. */
struct pos {
    int lo[256], hi[256], sub[256];
    int nlo, nhi;
};

/* Legacy blocks: y[j] from the low nibble of qs[j], y[j+16] from its high
 * nibble; the fifth bit of y[j] is qh bit j (xh_0) and of y[j+16] bit j+16
 * (xh_1 = (qh >> (j+12)) & 0x10). qh0 < 0: none. */
static void pos_legacy(struct pos *p, int qs0, int qh0) {
    p->nlo = 4;
    p->nhi = qh0 >= 0;
    for (int j = 0; j < 16; j++) {
        p->lo[j] = 8 * (qs0 + j);
        p->lo[j + 16] = 8 * (qs0 + j) + 4;
        p->hi[j] = 8 * qh0 + j;
        p->hi[j + 16] = 8 * qh0 + j + 16;
        p->sub[j] = p->sub[j + 16] = 0;
    }
}

static void pos_q8_0(struct pos *p) {
    p->nlo = 8;
    p->nhi = 0;
    for (int j = 0; j < 32; j++) {
        p->lo[j] = 8 * (2 + j);
        p->sub[j] = 0;
    }
}

/* Q2_K/Q3_K: for each half n (q = qs + 32n), for j in 0..3 (shift 2j, hmask
 * bit m): 16 elements from q[l] then 16 from q[l+16], a scale each; m moves
 * on after every j, across both halves. */
static void pos_k23(struct pos *p, int qs0, int with_hmask) {
    int y = 0, is = 0, m = 0;
    p->nlo = 2;
    p->nhi = with_hmask;
    for (int n = 0; n < 2; n++) {
        const int q = qs0 + 32 * n;
        for (int j = 0; j < 4; j++, m++)
            for (int half = 0; half < 2; half++, is++)
                for (int l = 0; l < 16; l++, y++) {
                    p->lo[y] = 8 * (q + 16 * half + l) + 2 * j;
                    p->hi[y] = 8 * (16 * half + l) + m;
                    p->sub[y] = is;
                }
    }
}

/* Q4_K/Q5_K: for each 64-chunk j (q = qs + 32j): 32 low nibbles of q[l]
 * (scale 2j, qh bit u1 = 2j), then 32 high nibbles (scale 2j+1, qh bit 2j+1). */
static void pos_k45(struct pos *p, int qs0, int qh0) {
    int y = 0;
    p->nlo = 4;
    p->nhi = qh0 >= 0;
    for (int j = 0; j < 4; j++)
        for (int nib = 0; nib < 2; nib++)
            for (int l = 0; l < 32; l++, y++) {
                p->lo[y] = 8 * (qs0 + 32 * j + l) + 4 * nib;
                p->hi[y] = 8 * qh0 + 8 * l + 2 * j + nib;
                p->sub[y] = 2 * j + nib;
            }
}

/* Q6_K: for each half n (ql += 64, qh += 32, sc += 8) and l < 32:
 * y[l] = ql[l] low | qh[l] bits 0-1 (sc[l/16]), y[l+32] = ql[l+32] low |
 * bits 2-3 (sc[l/16+2]), y[l+64] = ql[l] high | bits 4-5 (+4),
 * y[l+96] = ql[l+32] high | bits 6-7 (+6). */
static void pos_k6(struct pos *p) {
    p->nlo = 4;
    p->nhi = 2;
    for (int n = 0; n < 2; n++)
        for (int l = 0; l < 32; l++)
            for (int r = 0; r < 4; r++) {
                const int y = 128 * n + 32 * r + l;
                p->lo[y] = 8 * (64 * n + 32 * (r & 1) + l) + 4 * (r >> 1);
                p->hi[y] = 8 * (128 + 32 * n + l) + 2 * r;
                p->sub[y] = 8 * n + l / 16 + 2 * r;
            }
}

static void pos_of(uint32_t t, struct pos *p) {
    memset(p, 0, sizeof *p);
    switch (t) {
    case GT_Q4_0: pos_legacy(p, 2, -1); break;
    case GT_Q4_1: pos_legacy(p, 4, -1); break;
    case GT_Q5_0: pos_legacy(p, 6, 2); break;
    case GT_Q5_1: pos_legacy(p, 8, 4); break;
    case GT_Q8_0: pos_q8_0(p); break;
    case GT_Q2_K: pos_k23(p, 16, 0); break;
    case GT_Q3_K: pos_k23(p, 32, 1); break;
    case GT_Q4_K: pos_k45(p, 16, -1); break;
    case GT_Q5_K: pos_k45(p, 48, 16); break;
    case GT_Q6_K: pos_k6(p); break;
    default: break;
    }
}

/* Q3_K's 6-bit scale s, read word-wise: the twelve bytes as three u32; the
 * low nibble of s is nibble s/8 of byte s%8 (words 0 and 1), the top two
 * bits are bits 2*(s/4) of byte 8 + s%4 (word 2). */
static int naive_q3_scale(const uint8_t *sc12, int s) {
    uint32_t w[3];
    for (int i = 0; i < 3; i++) w[i] = bits(sc12, 32 * i, 32);
    unsigned lo = (w[(s % 8) / 4] >> (8 * (s % 4) + 4 * (s / 8))) & 15;
    unsigned hi = (w[2] >> (8 * (s % 4) + 2 * (s / 4))) & 3;
    return (int)(lo | hi << 4) - 32;
}

/* Q4_K/Q5_K's scale and min of sub-block s (the 12 bytes start at bit 32). */
static void naive_k4(const uint8_t *b, int s, int *sc, int *mn) {
    const int S = 32;
    if (s < 4) {
        *sc = (int)bits(b, S + 8 * s, 6);
        *mn = (int)bits(b, S + 8 * (s + 4), 6);
    } else {
        *sc = (int)(bits(b, S + 8 * (s + 4), 4) | bits(b, S + 8 * (s - 4) + 6, 2) << 4);
        *mn = (int)(bits(b, S + 8 * (s + 4) + 4, 4) | bits(b, S + 8 * s + 6, 2) << 4);
    }
}

/* The code of element e: its low and high bits joined (unsigned). */
static int code(const struct pos *p, const uint8_t *b, int e) {
    int q = (int)bits(b, p->lo[e], p->nlo);
    if (p->nhi) q |= (int)bits(b, p->hi[e], p->nhi) << p->nlo;
    return q;
}

/* Element e of block b of type t, by the spec, in double. */
static double naive_elem(uint32_t t, const struct pos *p, const uint8_t *b, int e) {
    const int s = p->sub[e];
    int sc, mn;
    switch (t) {
    case GT_F32: {
        float f;
        memcpy(&f, b, 4);
        return f;
    }
    case GT_F16: return naive_f16(bits(b, 0, 16));
    case GT_BF16: return naive_bf16(bits(b, 0, 16));
    case GT_Q4_0: return (code(p, b, e) - 8) * f16at(b, 0);
    case GT_Q4_1: return code(p, b, e) * f16at(b, 0) + f16at(b, 2);
    case GT_Q5_0: return (code(p, b, e) - 16) * f16at(b, 0);
    case GT_Q5_1: return code(p, b, e) * f16at(b, 0) + f16at(b, 2);
    case GT_Q8_0: return sbits(b, p->lo[e], 8) * f16at(b, 0);
    case GT_Q2_K:
        sc = (int)bits(b, 8 * s, 4);
        mn = (int)bits(b, 8 * s + 4, 4);
        return f16at(b, 80) * sc * code(p, b, e) - f16at(b, 82) * mn;
    case GT_Q3_K: /* the third bit set means no -4 */
        return f16at(b, 108) * naive_q3_scale(b + 96, s) * (code(p, b, e) - 4);
    case GT_Q4_K:
    case GT_Q5_K:
        naive_k4(b, s, &sc, &mn);
        return f16at(b, 0) * sc * code(p, b, e) - f16at(b, 2) * mn;
    case GT_Q6_K: return f16at(b, 208) * sbits(b, 8 * (192 + s), 8) * (code(p, b, e) - 32);
    }
    return NAN;
}

/* The step of element e's grid (|scale| of its sub-block). */
static double naive_step(uint32_t t, const struct pos *p, const uint8_t *b, int e) {
    const int s = p->sub[e];
    int sc, mn;
    switch (t) {
    case GT_Q2_K: return fabs(f16at(b, 80) * (int)bits(b, 8 * s, 4));
    case GT_Q3_K: return fabs(f16at(b, 108) * naive_q3_scale(b + 96, s));
    case GT_Q4_K:
    case GT_Q5_K: naive_k4(b, s, &sc, &mn); return fabs(f16at(b, 0) * sc);
    case GT_Q6_K: return fabs(f16at(b, 208) * sbits(b, 8 * (192 + s), 8));
    default: return fabs(f16at(b, 0));
    }
}

static const struct spec *spec_of(uint32_t t) {
    for (int i = 0; i < N_SPECS; i++)
        if (specs[i].t == t) return &specs[i];
    return NULL;
}

/* ------------------------------------------------------------ data */

static double uniform01(uint64_t *s) {
    return ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(uint64_t *s) {
    return sqrt(-2 * log(uniform01(s))) * cos(6.283185307179586 * uniform01(s));
}

/* A random finite f16 (any sign, subnormals and zeros included). */
static uint16_t rand_f16(uint64_t *s) {
    uint16_t h = (uint16_t)(rng_next(s) >> 48);
    if ((h & 0x7c00) == 0x7c00) h &= 0xbfff;
    return h;
}

/* Random bytes for nblk blocks of sp, the f16 fields random finite halves
 * (F32/BF16: every element finite). */
static void random_blocks(const struct spec *sp, uint8_t *buf, int64_t nblk, uint64_t *s) {
    for (int64_t i = 0; i < nblk * sp->bytes; i++) buf[i] = (uint8_t)(rng_next(s) >> 56);
    for (int64_t i = 0; i < nblk; i++) {
        uint8_t *b = buf + i * sp->bytes;
        for (int k = 0; k < sp->nf16; k++) {
            uint16_t h = rand_f16(s);
            b[sp->f16_off[k]] = (uint8_t)h;
            b[sp->f16_off[k] + 1] = (uint8_t)(h >> 8);
        }
        if (sp->t == GT_BF16 && (b[1] & 0x7f) == 0x7f && (b[0] & 0x80)) b[1] &= 0xbf;
        if (sp->t == GT_F32 && (b[3] & 0x7f) == 0x7f && (b[2] & 0x80)) b[3] &= 0xbf;
    }
}

enum { DATA_GAUSS, DATA_OUTLIERS, DATA_TINY, DATA_SHIFTED, N_DATA };
static const char *const data_names[N_DATA] = {"gaussian", "outliers", "tiny", "shifted"};

/* n values of data set k. */
static void make_data(int k, float *x, int64_t n) {
    uint64_t s = 0x9e3779b97f4a7c15ull + (uint64_t)k;
    for (int64_t i = 0; i < n; i++) {
        double g = gauss(&s);
        switch (k) {
        case DATA_OUTLIERS: x[i] = (float)(rng_next(&s) % 64 == 0 ? 40 * g : g); break;
        case DATA_TINY: x[i] = (float)(1e-3 * g); break;
        case DATA_SHIFTED: x[i] = (float)(2 + 0.1 * g); break;
        default: x[i] = (float)g;
        }
    }
}

static int64_t n_for(const struct spec *sp) { return sp->elems == 1 ? 4096 : 32 * 256; }

/* ------------------------------------------------------------ decoding */

ParameterizedTestParameters(ggmlquant, dequant_matches_naive_decoder) {
    static int idx[N_SPECS];
    for (int i = 0; i < N_SPECS; i++) idx[i] = i;
    return cr_make_param_array(int, idx, N_SPECS);
}

ParameterizedTest(int *ip, ggmlquant, dequant_matches_naive_decoder) {
    const struct spec *sp = &specs[*ip];
    const int64_t nblk = sp->elems == 1 ? 65536 : sp->elems == 32 ? 8192 : 2048;
    const int64_t n = nblk * sp->elems;
    uint8_t *buf = malloc((size_t)(nblk * sp->bytes));
    float *got = malloc((size_t)n * sizeof *got), *want = malloc((size_t)n * sizeof *want);
    cr_assert(buf && got && want);
    uint64_t s = 0x243f6a8885a308d3ull ^ sp->t;
    random_blocks(sp, buf, nblk, &s);
    struct pos p;
    pos_of(sp->t, &p);
    for (int64_t i = 0; i < nblk; i++)
        for (int e = 0; e < sp->elems; e++)
            want[i * sp->elems + e] = (float)naive_elem(sp->t, &p, buf + i * sp->bytes, e);
    cr_assert_eq(kv_ggml_dequant(sp->t, buf, got, n), KV_OK, "%s", sp->name);
    if (memcmp(got, want, (size_t)n * sizeof *got)) {
        int64_t worst = -1, first = -1, bad = 0;
        double wd = -1;
        for (int64_t i = 0; i < n; i++) {
            if (!memcmp(&got[i], &want[i], sizeof *got)) continue;
            bad++;
            if (first < 0) first = i;
            double d = fabs((double)got[i] - (double)want[i]);
            if (!(d <= wd)) wd = d, worst = i;
        }
        cr_assert_fail("%s: %lld of %lld elements differ; first: block %lld element %lld got %a "
                       "want %a; worst: block %lld element %lld got %.9g want %.9g",
                       sp->name, (long long)bad, (long long)n, (long long)(first / sp->elems),
                       (long long)(first % sp->elems), (double)got[first], (double)want[first],
                       (long long)(worst / sp->elems), (long long)(worst % sp->elems),
                       (double)got[worst], (double)want[worst]);
    }
    free(buf);
    free(got);
    free(want);
}

/* ------------------------------------------------------------ encoding */

/* The bound on |decoded - x| for element e of block b (decoded from x):
 * half a step; for Q4_0/Q5_0, whose top code is one short of the extreme,
 * a whole step above the last code. slop covers f32 rounding. */
static double elem_bound(const struct spec *sp, const struct pos *p, const uint8_t *b, int e,
                         float x, double slop) {
    switch (sp->t) {
    case GT_F32: return 0;
    case GT_F16: return fmax(fabs(x) * 0x1p-11, 0x1p-25);
    case GT_BF16: return fabs(x) * 0x1p-8;
    default: break;
    }
    const double step = naive_step(sp->t, p, b, e);
    if (sp->t == GT_Q4_0 || sp->t == GT_Q5_0) {
        const double d = f16at(b, 0), top = sp->t == GT_Q4_0 ? 7 : 15;
        if (d != 0 && x / d > top + 0.5) return step * (1 + 0x1p-7) + slop;
    }
    return step / 2 * (1 + 0x1p-12) + slop;
}

struct rt_stats {
    double err2, x2, worst_ratio;
};

/* Check every element of the round trip of x (n values) against its bound;
 * returns the statistics, failing on the first element out of bound. */
static struct rt_stats check_round_trip(const struct spec *sp, const float *x, const uint8_t *q,
                                        const float *y, int64_t n, const char *data) {
    struct pos p;
    pos_of(sp->t, &p);
    struct rt_stats st = {0, 0, 0};
    for (int64_t i = 0; i < n / sp->elems; i++) {
        const float *xb = x + i * sp->elems;
        const uint8_t *b = q + i * sp->bytes;
        double amax = 0;
        for (int e = 0; e < sp->elems; e++) amax = fmax(amax, fabs(xb[e]));
        const double slop = amax * 0x1p-20;
        for (int e = 0; e < sp->elems; e++) {
            const int64_t k = i * sp->elems + e;
            const double err = fabs((double)y[k] - (double)x[k]);
            const double bound = elem_bound(sp, &p, b, e, x[k], slop);
            cr_assert(err <= bound,
                      "%s %s: block %lld element %d: x %.9g decoded %.9g, error %.3g over the "
                      "bound %.3g (step %.3g)",
                      sp->name, data, (long long)i, e, (double)x[k], (double)y[k], err, bound,
                      sp->elems > 1 ? naive_step(sp->t, &p, b, e) : 0.0);
            st.err2 += err * err;
            st.x2 += (double)x[k] * x[k];
            if (bound > 0 && err / bound > st.worst_ratio) st.worst_ratio = err / bound;
        }
    }
    return st;
}

/* Q8_0: d is max|x|/127 to f16 precision and some code reaches ±127. */
static void check_q8_0_scale(const float *x, const uint8_t *q, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        double amax = 0;
        int qmax = 0;
        for (int e = 0; e < 32; e++) amax = fmax(amax, fabs(x[32 * i + e]));
        for (int e = 0; e < 32; e++) {
            const int c = abs(sbits(q + 34 * i, 8 * (2 + e), 8));
            qmax = c > qmax ? c : qmax;
        }
        const double d = f16at(q + 34 * i, 0); /* nearest f16, subnormal for tiny data */
        cr_assert(fabs(d - amax / 127) <= amax / 127 * 0x1p-11 + 0x1p-25,
                  "Q8_0 block %lld: d %.9g for max %.9g", (long long)i, d, amax);
        cr_assert(amax == 0 || qmax == 127, "Q8_0 block %lld: largest code %d", (long long)i, qmax);
    }
}

ParameterizedTestParameters(ggmlquant, quant_round_trip_within_bound) {
    static int idx[N_SPECS];
    for (int i = 0; i < N_SPECS; i++) idx[i] = i;
    return cr_make_param_array(int, idx, N_SPECS);
}

ParameterizedTest(int *ip, ggmlquant, quant_round_trip_within_bound) {
    const struct spec *sp = &specs[*ip];
    cr_assert(kv_ggml_can_quant(sp->t), "%s", sp->name);
    const int64_t n = n_for(sp), nb = n / sp->elems * sp->bytes;
    float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
    uint8_t *q = malloc((size_t)nb);
    cr_assert(x && y && q);
    for (int k = 0; k < N_DATA; k++) {
        make_data(k, x, n);
        memset(q, 0xa5, (size_t)nb);
        cr_assert_eq(kv_ggml_quant(sp->t, x, q, n), KV_OK);
        cr_assert_eq(kv_ggml_dequant(sp->t, q, y, n), KV_OK);
        struct rt_stats st = check_round_trip(sp, x, q, y, n, data_names[k]);
        const double rms = sqrt(st.err2 / st.x2);
        const double ceiling = k == DATA_OUTLIERS ? sp->rms_out : sp->rms_max;
        cr_log_info("%s %s: rms relative error %.3e (ceiling %.3g), worst error/bound %.3f",
                    sp->name, data_names[k], rms, ceiling, st.worst_ratio);
        cr_assert(rms <= ceiling, "%s %s: rms relative error %.4g over %.4g", sp->name,
                  data_names[k], rms, ceiling);
        if (sp->t == GT_Q8_0) check_q8_0_scale(x, q, n);
    }
    free(x);
    free(y);
    free(q);
}

/* Requantising a decoded block gives its bytes back: Q8_0/Q4_0/Q5_0 put the
 * block's extreme on the extreme code, so the decoded block has the same d. */
ParameterizedTestParameters(ggmlquant, requant_is_idempotent) {
    static const uint32_t types[] = {GT_Q8_0, GT_Q4_0, GT_Q5_0, GT_F16, GT_BF16, GT_F32};
    return cr_make_param_array(uint32_t, types, sizeof types / sizeof types[0]);
}

ParameterizedTest(uint32_t *tp, ggmlquant, requant_is_idempotent) {
    const struct spec *sp = spec_of(*tp);
    const int64_t n = n_for(sp), nb = n / sp->elems * sp->bytes;
    float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
    uint8_t *q = malloc((size_t)nb), *q2 = malloc((size_t)nb);
    cr_assert(x && y && q && q2);
    for (int k = 0; k < N_DATA; k++) {
        make_data(k, x, n);
        cr_assert_eq(kv_ggml_quant(sp->t, x, q, n), KV_OK);
        cr_assert_eq(kv_ggml_dequant(sp->t, q, y, n), KV_OK);
        cr_assert_eq(kv_ggml_quant(sp->t, y, q2, n), KV_OK);
        for (int64_t i = 0; i < nb; i++)
            cr_assert_eq(q[i], q2[i],
                         "%s %s: byte %lld (block %lld) was 0x%02x, requantised 0x%02x", sp->name,
                         data_names[k], (long long)i, (long long)(i / sp->bytes), q[i], q2[i]);
    }
    free(x);
    free(y);
    free(q);
    free(q2);
}

/* ------------------------------------------------------------ edge cases */

Test(ggmlquant, block_sizes_match_ggml) {
    for (int i = 0; i < N_SPECS; i++) {
        const struct spec *sp = &specs[i];
        cr_assert_eq(kv_ggml_block_elems(sp->t), sp->elems, "%s", sp->name);
        cr_assert_eq(kv_ggml_block_bytes(sp->t), sp->bytes, "%s", sp->name);
        cr_assert(kv_ggml_can_dequant(sp->t) && kv_ggml_can_quant(sp->t), "%s", sp->name);
        cr_assert_str_eq(kv_ggml_type_name(sp->t), sp->name);
        cr_assert_eq(kv_ggml_is_quantized(sp->t), sp->elems > 1, "%s", sp->name);
    }
}

Test(ggmlquant, zero_blocks_decode_to_zero) {
    for (int i = 0; i < N_SPECS; i++) {
        const struct spec *sp = &specs[i];
        const int64_t n = 2 * sp->elems + (sp->elems == 1 ? 254 : 0);
        float x[512] = {0}, y[512];
        uint8_t q[1024];
        cr_assert_eq(kv_ggml_quant(sp->t, x, q, n), KV_OK, "%s", sp->name);
        cr_assert_eq(kv_ggml_dequant(sp->t, q, y, n), KV_OK, "%s", sp->name);
        for (int64_t e = 0; e < n; e++)
            cr_assert(y[e] == 0, "%s: zeros came back with element %lld = %g", sp->name,
                      (long long)e, (double)y[e]);
        memset(q, 0, sizeof q); /* all-zero bytes: zero scales */
        cr_assert_eq(kv_ggml_dequant(sp->t, q, y, n), KV_OK, "%s", sp->name);
        for (int64_t e = 0; e < n; e++)
            cr_assert(y[e] == 0, "%s: zero bytes decoded element %lld to %g", sp->name,
                      (long long)e, (double)y[e]);
    }
}

Test(ggmlquant, rejects_partial_blocks) {
    float x[600] = {0}, y[600];
    uint8_t q[600] = {0};
    for (int i = 0; i < N_SPECS; i++) {
        const struct spec *sp = &specs[i];
        const int64_t bad[] = {sp->elems + 1, sp->elems - 1, 2 * sp->elems - 3, -sp->elems, -1};
        for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
            if (bad[k] >= 0 && bad[k] % sp->elems == 0) continue; /* a valid n */
            cr_assert_eq(kv_ggml_dequant(sp->t, q, y, bad[k]), KV_EINVAL, "%s n=%lld", sp->name,
                         (long long)bad[k]);
            cr_assert_eq(kv_ggml_quant(sp->t, x, q, bad[k]), KV_EINVAL, "%s n=%lld", sp->name,
                         (long long)bad[k]);
        }
        cr_assert_eq(kv_ggml_dequant(sp->t, q, y, 0), KV_OK, "%s n=0", sp->name);
        cr_assert_eq(kv_ggml_quant(sp->t, x, q, 0), KV_OK, "%s n=0", sp->name);
    }
}

Test(ggmlquant, unknown_types_are_unsupported) {
    /* Q4_2/Q4_3 (removed), Q8_1, Q8_K, IQ2_XXS, IQ4_NL, I8, F64, TQ1_0, MXFP4, past the table */
    static const uint32_t types[] = {4, 5, 9, 15, 16, 20, 24, 28, 34, 39, 40, 1000, UINT32_MAX};
    float x[256] = {0}, y[256];
    uint8_t q[512] = {0};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const uint32_t t = types[i];
        cr_assert(!kv_ggml_can_dequant(t) && !kv_ggml_can_quant(t), "type %u", t);
        cr_assert_eq(kv_ggml_block_elems(t), 0, "type %u", t);
        cr_assert_eq(kv_ggml_block_bytes(t), 0, "type %u", t);
        cr_assert_eq(kv_ggml_dequant(t, q, y, 256), KV_EUNSUPPORTED, "type %u", t);
        cr_assert_eq(kv_ggml_quant(t, x, q, 256), KV_EUNSUPPORTED, "type %u", t);
        cr_assert_eq(kv_ggml_dequant(t, q, y, 7), KV_EUNSUPPORTED, "type %u, odd n", t);
    }
}

/* inf and NaN scales decode to whatever IEEE gives, without crashing; a Q8_0
 * block with d = NaN decodes to NaNs. */
Test(ggmlquant, nonfinite_scales_decode) {
    static const uint16_t bad[] = {0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x7bff};
    uint64_t s = 7;
    for (int i = 0; i < N_SPECS; i++) {
        const struct spec *sp = &specs[i];
        if (!sp->nf16) continue;
        uint8_t b[256];
        float y[256];
        for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++)
            for (int f = 0; f < sp->nf16; f++) {
                random_blocks(sp, b, 1, &s);
                b[sp->f16_off[f]] = (uint8_t)bad[k];
                b[sp->f16_off[f] + 1] = (uint8_t)(bad[k] >> 8);
                cr_assert_eq(kv_ggml_dequant(sp->t, b, y, sp->elems), KV_OK, "%s", sp->name);
                if (sp->t == GT_Q8_0 && (bad[k] & 0x7fff) > 0x7c00)
                    for (int e = 0; e < 32; e++)
                        cr_assert(isnan(y[e]), "Q8_0 NaN d, element %d", e);
            }
    }
}
