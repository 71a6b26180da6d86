/* ggml block quantisation codecs. The block layouts are described in
 * ggmlquant.h; each type has one block decoder and one block encoder, and a
 * table maps ggml type numbers to them. */
#include "ggmlquant.h"

#include <math.h>
#include <string.h>

#include "model.h"

/* ggml type numbers (formats/gguf.c's table). */
enum {
    T_F32 = 0,
    T_F16 = 1,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q8_0 = 8,
    T_Q2_K = 10,
    T_Q3_K = 11,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
    T_BF16 = 30,
};

#define QK 32   /* legacy block */
#define QKK 256 /* K-quant super-block */
#define F16_MAX_BITS 0x7bffu /* 65504 */

/* ------------------------------------------------------------ scalar helpers */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xff);
    p[1] = (uint8_t)(v >> 8);
}
static void wr32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static float h2f(const uint8_t *p) { return kv_f16_to_f32(rd16(p)); }

/* Nearest f16 to x, saturating at ±65504 instead of overflowing to inf. */
static uint16_t f16_near(float x) {
    uint16_t h = kv_f32_to_f16(x);
    if ((h & 0x7fffu) > F16_MAX_BITS) h = (uint16_t)((h & 0x8000u) | F16_MAX_BITS);
    return h;
}

/* Smallest f16 >= x for x >= 0 (65504 at most). */
static uint16_t f16_up(float x) {
    if (!(x > 0)) return 0;
    uint16_t h = f16_near(x);
    if (kv_f16_to_f32(h) < x && h < F16_MAX_BITS) h++;
    return h;
}

/* Largest f16 <= x (-65504 at least). */
static uint16_t f16_down(float x) {
    uint16_t h = f16_near(x);
    if (kv_f16_to_f32(h) <= x) return h;
    if (h == 0x8000u || h == 0) return 0x8001u; /* below zero: -2^-24 */
    if (h & 0x8000u) return (uint16_t)(h < (0x8000u | F16_MAX_BITS) ? h + 1 : h);
    return (uint16_t)(h - 1);
}

/* v rounded to nearest (ties to even) and clamped to [lo, hi]. */
static int qnear(float v, int lo, int hi) {
    if (!(v > (float)lo)) return lo;
    if (v > (float)hi) return hi;
    int q = (int)lrintf(v);
    return q < lo ? lo : q > hi ? hi : q;
}

/* smallest integer >= v, clamped to [0, hi] */
static int qceil(float v, int hi) {
    if (!(v > 0)) return 0;
    if (v >= (float)hi) return hi;
    return (int)ceilf(v);
}

/* ---------------------------------------------------------- legacy decoders */

/* Q4_0: f16 d, qs[16]; x = (q - 8) * d */
static void dq_q4_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
    }
}

/* Q4_1: f16 d, f16 m, qs[16]; x = q * d + m */
static void dq_q4_1(const uint8_t *b, float *y) {
    const float d = h2f(b), m = h2f(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)(qs[j] & 15) * d + m;
        y[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
    }
}

/* The 5-bit code of elements j and j+16 from a nibble byte and qh. */
static int q5_lo(uint8_t q, uint32_t qh, int j) {
    return (q & 15) | (int)((qh >> j) & 1) << 4;
}
static int q5_hi(uint8_t q, uint32_t qh, int j) {
    return (q >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
}

/* Q5_0: f16 d, u32 qh, qs[16]; x = (q - 16) * d */
static void dq_q5_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    const uint32_t qh = rd32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)(q5_lo(qs[j], qh, j) - 16) * d;
        y[j + QK / 2] = (float)(q5_hi(qs[j], qh, j) - 16) * d;
    }
}

/* Q5_1: f16 d, f16 m, u32 qh, qs[16]; x = q * d + m */
static void dq_q5_1(const uint8_t *b, float *y) {
    const float d = h2f(b), m = h2f(b + 2);
    const uint32_t qh = rd32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)q5_lo(qs[j], qh, j) * d + m;
        y[j + QK / 2] = (float)q5_hi(qs[j], qh, j) * d + m;
    }
}

/* Q8_0: f16 d, int8 qs[32]; x = q * d */
static void dq_q8_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    for (int j = 0; j < QK; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

/* ------------------------------------------------------------- K decoders */

/* Q2_K/Q3_K/Q6_K pack 2-bit fields of element e = 128h + 32k + l into byte
 * 32h + l at bits 2k: the byte index for e (k returned through *k). */
static int k_byte(int e, int *k) {
    *k = (e % 128) / 32;
    return 32 * (e / 128) + e % 32;
}

/* 6-bit scale and min of sub-block s of Q4_K/Q5_K ("get_scale_min_k4"). */
static void k4_scale_min(const uint8_t *sc, int s, int *scale, int *min) {
    if (s < 4) {
        *scale = sc[s] & 63;
        *min = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 15) | (sc[s - 4] >> 6) << 4;
        *min = (sc[s + 4] >> 4) | (sc[s] >> 6) << 4;
    }
}

/* Q2_K: scales[16], qs[64], f16 d, f16 dmin; x = d*sc*q - dmin*mn */
static void dq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    for (int s = 0; s < 16; s++) {
        const float dl = d * (float)(sc[s] & 15), ml = dmin * (float)(sc[s] >> 4);
        for (int e = 16 * s; e < 16 * s + 16; e++) {
            int k, i = k_byte(e, &k);
            y[e] = dl * (float)((qs[i] >> (2 * k)) & 3) - ml;
        }
    }
}

/* Signed 6-bit scale s of Q3_K (-32..31). */
static int k3_scale(const uint8_t *sc, int s) {
    int lo = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
    int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* Q3_K: hmask[32], qs[64], scales[12], f16 d; x = d * sc * q, q in -4..3 */
static void dq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = h2f(b + 108);
    for (int s = 0; s < 16; s++) {
        const float dl = d * (float)k3_scale(sc, s);
        for (int e = 16 * s; e < 16 * s + 16; e++) {
            int k, i = k_byte(e, &k);
            int q = ((qs[i] >> (2 * k)) & 3) - (((hm[e % 32] >> (e / 32)) & 1) ? 0 : 4);
            y[e] = dl * (float)q;
        }
    }
}

/* Q4_K and Q5_K share the scales and the nibble order; qh is NULL for Q4_K. */
static void dq_k45(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *y) {
    const float d = h2f(b), dmin = h2f(b + 2);
    for (int s = 0; s < 8; s++) {
        int scale, min;
        k4_scale_min(b + 4, s, &scale, &min);
        const float d1 = d * (float)scale, m1 = dmin * (float)min;
        const uint8_t *q = qs + 32 * (s / 2);
        const int shift = 4 * (s % 2);
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 15;
            if (qh) v |= ((qh[l] >> s) & 1) << 4;
            y[32 * s + l] = d1 * (float)v - m1;
        }
    }
}

/* Q4_K: f16 d, f16 dmin, scales[12], qs[128] */
static void dq_q4_k(const uint8_t *b, float *y) { dq_k45(b, NULL, b + 16, y); }
/* Q5_K: f16 d, f16 dmin, scales[12], qh[32], qs[128] */
static void dq_q5_k(const uint8_t *b, float *y) { dq_k45(b, b + 16, b + 48, y); }

/* The 4-bit low part of Q6_K element e: its ql byte and nibble shift. */
static int k6_low(int e, int *shift) {
    const int k = (e % 128) / 32;
    *shift = k >= 2 ? 4 : 0;
    return 64 * (e / 128) + 32 * (k & 1) + e % 32;
}

/* Q6_K: ql[128], qh[64], int8 scales[16], f16 d; x = d * sc * q, q in -32..31 */
static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const float d = h2f(b + 208);
    for (int s = 0; s < 16; s++) {
        const float ds = d * (float)(int8_t)b[192 + s];
        for (int e = 16 * s; e < 16 * s + 16; e++) {
            int shift, k;
            const int li = k6_low(e, &shift), hi_i = k_byte(e, &k);
            const int lo = (ql[li] >> shift) & 15, hi = (qh[hi_i] >> (2 * k)) & 3;
            y[e] = ds * (float)((lo | hi << 4) - 32);
        }
    }
}

/* ---------------------------------------------------------- legacy encoders */

/* Q8_0: d = max|x| / 127 (nearest f16), q = round(x / d) */
static void q_q8_0(const float *x, uint8_t *b) {
    float amax = 0;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const uint16_t dh = f16_near(amax / 127.0f);
    const float d = kv_f16_to_f32(dh);
    wr16(b, dh);
    for (int j = 0; j < QK; j++)
        b[2 + j] = (uint8_t)(int8_t)(d > 0 ? qnear(x[j] / d, -127, 127) : 0);
}

/* Q4_0/Q5_0 codes: the element of largest |x| maps to -half, d = x_max / -half
 * (nearest f16), q = round(x / d) + half clamped to [0, 2*half - 1]. Returns
 * the f16 d; codes go to L. */
static uint16_t sym_legacy(const float *x, int half, uint8_t *L) {
    float amax = 0, m = 0;
    for (int j = 0; j < QK; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            m = x[j];
        }
    const uint16_t dh = f16_near(m / (float)-half);
    const float d = kv_f16_to_f32(dh);
    for (int j = 0; j < QK; j++)
        L[j] = (uint8_t)(d != 0 ? qnear(x[j] / d, -half, half - 1) + half : half);
    return dh;
}

/* Q4_1/Q5_1 codes: m = min x rounded down to f16, d = (max x - m) / nmax
 * rounded up, q = round((x - m) / d). Writes d and m to b. */
static void affine_legacy(const float *x, int nmax, uint8_t *L, uint8_t *b) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < QK; j++) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    const uint16_t mh = f16_down(lo);
    const float m = kv_f16_to_f32(mh);
    const uint16_t dh = f16_up((hi - m) / (float)nmax);
    const float d = kv_f16_to_f32(dh);
    wr16(b, dh);
    wr16(b + 2, mh);
    for (int j = 0; j < QK; j++) L[j] = (uint8_t)(d > 0 ? qnear((x[j] - m) / d, 0, nmax) : 0);
}

static void pack_nibbles(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK / 2; j++) qs[j] = (uint8_t)((L[j] & 15) | (L[j + QK / 2] & 15) << 4);
}

/* fifth bits: bit e of qh is bit 4 of L[e] */
static uint32_t pack_qh(const uint8_t *L) {
    uint32_t qh = 0;
    for (int e = 0; e < QK; e++) qh |= (uint32_t)(L[e] >> 4 & 1) << e;
    return qh;
}

static void q_q4_0(const float *x, uint8_t *b) {
    uint8_t L[QK];
    wr16(b, sym_legacy(x, 8, L));
    pack_nibbles(L, b + 2);
}

static void q_q5_0(const float *x, uint8_t *b) {
    uint8_t L[QK];
    wr16(b, sym_legacy(x, 16, L));
    wr32(b + 2, pack_qh(L));
    pack_nibbles(L, b + 6);
}

static void q_q4_1(const float *x, uint8_t *b) {
    uint8_t L[QK];
    affine_legacy(x, 15, L, b);
    pack_nibbles(L, b + 4);
}

static void q_q5_1(const float *x, uint8_t *b) {
    uint8_t L[QK];
    affine_legacy(x, 31, L, b);
    wr32(b + 4, pack_qh(L));
    pack_nibbles(L, b + 8);
}

/* --------------------------------------------------------------- K encoders */

/* One super-block's quantised parameters and codes. */
struct kq {
    uint16_t dh, dminh;   /* f16 super-scales */
    uint8_t sc[16];       /* sub-block scales (symmetric types: sc >= 0) */
    uint8_t mn[16];       /* sub-block mins (affine types) */
    int8_t L[QKK];        /* codes: 0..nmax (affine) or lo..hi (symmetric) */
};

/* Affine super-block (Q2_K, Q4_K, Q5_K): nsub sub-blocks of QKK/nsub with
 * x = d*sc*q - dmin*mn, q in 0..nmax, sc and mn in 0..smax. The offset
 * dmin*mn is the sub-block's min (capped at 0) rounded up to the dmin grid;
 * the scale is then the smallest that reaches the sub-block's max. */
static void kq_affine(const float *x, int nsub, int nmax, int smax, struct kq *o) {
    const int len = QKK / nsub;
    float lo[16], hi[16], need[16], dm[16], lomax = 0, needmax = 0;
    for (int s = 0; s < nsub; s++) {
        lo[s] = 0;
        hi[s] = x[s * len];
        for (int l = 0; l < len; l++) {
            lo[s] = fminf(lo[s], x[s * len + l]);
            hi[s] = fmaxf(hi[s], x[s * len + l]);
        }
        lomax = fmaxf(lomax, -lo[s]);
    }
    o->dminh = f16_up(lomax / (float)smax);
    const float dmin = kv_f16_to_f32(o->dminh);
    for (int s = 0; s < nsub; s++) {
        o->mn[s] = (uint8_t)(dmin > 0 ? qceil(-lo[s] / dmin, smax) : 0);
        dm[s] = dmin * (float)o->mn[s];
        need[s] = fmaxf(0, hi[s] + dm[s]);
        needmax = fmaxf(needmax, need[s]);
    }
    o->dh = f16_up(needmax / (float)(nmax * smax));
    const float d = kv_f16_to_f32(o->dh);
    for (int s = 0; s < nsub; s++) {
        o->sc[s] = (uint8_t)(d > 0 ? qceil(need[s] / ((float)nmax * d), smax) : 0);
        const float ds = d * (float)o->sc[s];
        for (int l = 0; l < len; l++) {
            const float v = x[s * len + l] + dm[s];
            o->L[s * len + l] = (int8_t)(ds > 0 ? qnear(v / ds, 0, nmax) : 0);
        }
    }
}

/* Symmetric super-block (Q3_K, Q6_K): 16 sub-blocks of 16 with
 * x = d * sc * q, q in qlo..qhi, sc in 0..smax: each sub-block's scale is
 * the smallest that reaches its max |x| with qhi. */
static void kq_sym(const float *x, int qlo, int qhi, int smax, struct kq *o) {
    float amax[16], top = 0;
    for (int s = 0; s < 16; s++) {
        amax[s] = 0;
        for (int l = 0; l < 16; l++) amax[s] = fmaxf(amax[s], fabsf(x[16 * s + l]));
        top = fmaxf(top, amax[s]);
    }
    o->dh = f16_up(top / (float)(qhi * smax));
    o->dminh = 0;
    const float d = kv_f16_to_f32(o->dh);
    for (int s = 0; s < 16; s++) {
        o->sc[s] = (uint8_t)(d > 0 ? qceil(amax[s] / ((float)qhi * d), smax) : 0);
        const float ds = d * (float)o->sc[s];
        for (int l = 0; l < 16; l++)
            o->L[16 * s + l] = (int8_t)(ds > 0 ? qnear(x[16 * s + l] / ds, qlo, qhi) : 0);
    }
}

/* 2-bit fields of element e into Q2_K/Q3_K's qs */
static void pack_k2(const int8_t *L, int bias, uint8_t *qs) {
    for (int e = 0; e < QKK; e++) {
        int k, i = k_byte(e, &k);
        qs[i] |= (uint8_t)(((L[e] + bias) & 3) << (2 * k));
    }
}

static void q_q2_k(const float *x, uint8_t *b) {
    struct kq o;
    kq_affine(x, 16, 3, 15, &o);
    memset(b, 0, 84);
    for (int s = 0; s < 16; s++) b[s] = (uint8_t)(o.sc[s] | o.mn[s] << 4);
    pack_k2(o.L, 0, b + 16);
    wr16(b + 80, o.dh);
    wr16(b + 82, o.dminh);
}

static void q_q3_k(const float *x, uint8_t *b) {
    struct kq o;
    kq_sym(x, -4, 3, 31, &o);
    memset(b, 0, 110);
    uint8_t *hm = b, *sc = b + 96;
    pack_k2(o.L, 4, b + 32);
    for (int e = 0; e < QKK; e++) hm[e % 32] |= (uint8_t)(((o.L[e] + 4) >> 2) << (e / 32));
    for (int s = 0; s < 16; s++) {
        const int v = o.sc[s] + 32;
        sc[s < 8 ? s : s - 8] |= (uint8_t)((v & 15) << (s < 8 ? 0 : 4));
        sc[8 + s % 4] |= (uint8_t)((v >> 4) << (2 * (s / 4)));
    }
    wr16(b + 108, o.dh);
}

/* Q4_K/Q5_K: d, dmin, 12 bytes of 6-bit scales/mins, then the codes' low
 * nibbles at qs and (Q5_K) their fifth bits at qh. */
static void pack_k45(const struct kq *o, uint8_t *b, uint8_t *qh, uint8_t *qs) {
    uint8_t *sc = b + 4;
    wr16(b, o->dh);
    wr16(b + 2, o->dminh);
    for (int s = 0; s < 8; s++) {
        if (s < 4) {
            sc[s] |= o->sc[s];
            sc[s + 4] |= o->mn[s];
        } else {
            sc[s + 4] = (uint8_t)((o->sc[s] & 15) | (o->mn[s] & 15) << 4);
            sc[s - 4] |= (uint8_t)((o->sc[s] >> 4) << 6);
            sc[s] |= (uint8_t)((o->mn[s] >> 4) << 6);
        }
        for (int l = 0; l < 32; l++) {
            const int v = o->L[32 * s + l];
            qs[32 * (s / 2) + l] |= (uint8_t)((v & 15) << (4 * (s % 2)));
            if (qh) qh[l] |= (uint8_t)((v >> 4 & 1) << s);
        }
    }
}

static void q_q4_k(const float *x, uint8_t *b) {
    struct kq o;
    kq_affine(x, 8, 15, 63, &o);
    memset(b, 0, 144);
    pack_k45(&o, b, NULL, b + 16);
}

static void q_q5_k(const float *x, uint8_t *b) {
    struct kq o;
    kq_affine(x, 8, 31, 63, &o);
    memset(b, 0, 176);
    pack_k45(&o, b, b + 16, b + 48);
}

static void q_q6_k(const float *x, uint8_t *b) {
    struct kq o;
    kq_sym(x, -32, 31, 127, &o);
    memset(b, 0, 210);
    uint8_t *ql = b, *qh = b + 128;
    for (int e = 0; e < QKK; e++) {
        const int u = o.L[e] + 32;
        int shift, k;
        const int li = k6_low(e, &shift), hi_i = k_byte(e, &k);
        ql[li] |= (uint8_t)((u & 15) << shift);
        qh[hi_i] |= (uint8_t)((u >> 4) << (2 * k));
    }
    for (int s = 0; s < 16; s++) b[192 + s] = o.sc[s]; /* 0..127: int8 as is */
    wr16(b + 208, o.dh);
}

/* ------------------------------------------------------------------- table */

struct codec {
    uint32_t type;
    int elems, bytes;
    int dtype; /* enum kv_dtype for the float types, else -1 */
    void (*dq)(const uint8_t *b, float *y);
    void (*q)(const float *x, uint8_t *b);
};

static const struct codec codecs[] = {
    {T_F32, 1, 4, KV_DTYPE_F32, NULL, NULL},
    {T_F16, 1, 2, KV_DTYPE_F16, NULL, NULL},
    {T_BF16, 1, 2, KV_DTYPE_BF16, NULL, NULL},
    {T_Q4_0, QK, 18, -1, dq_q4_0, q_q4_0},
    {T_Q4_1, QK, 20, -1, dq_q4_1, q_q4_1},
    {T_Q5_0, QK, 22, -1, dq_q5_0, q_q5_0},
    {T_Q5_1, QK, 24, -1, dq_q5_1, q_q5_1},
    {T_Q8_0, QK, 34, -1, dq_q8_0, q_q8_0},
    {T_Q2_K, QKK, 84, -1, dq_q2_k, q_q2_k},
    {T_Q3_K, QKK, 110, -1, dq_q3_k, q_q3_k},
    {T_Q4_K, QKK, 144, -1, dq_q4_k, q_q4_k},
    {T_Q5_K, QKK, 176, -1, dq_q5_k, q_q5_k},
    {T_Q6_K, QKK, 210, -1, dq_q6_k, q_q6_k},
};

static const struct codec *codec_of(uint32_t t) {
    for (size_t i = 0; i < sizeof codecs / sizeof codecs[0]; i++)
        if (codecs[i].type == t) return &codecs[i];
    return NULL;
}

int kv_ggml_can_dequant(uint32_t t) { return codec_of(t) != NULL; }
int kv_ggml_can_quant(uint32_t t) { return codec_of(t) != NULL; }

int64_t kv_ggml_block_elems(uint32_t t) {
    const struct codec *c = codec_of(t);
    return c ? c->elems : 0;
}

int64_t kv_ggml_block_bytes(uint32_t t) {
    const struct codec *c = codec_of(t);
    return c ? c->bytes : 0;
}

/* KV_OK when t has a codec and n is a whole number of its blocks. */
static int check_args(const struct codec *c, int64_t n) {
    if (!c) return KV_EUNSUPPORTED;
    return n >= 0 && n % c->elems == 0 ? KV_OK : KV_EINVAL;
}

int kv_ggml_dequant(uint32_t t, const void *in, float *out, int64_t n) {
    const struct codec *c = codec_of(t);
    int rc = check_args(c, n);
    if (rc) return rc;
    if (c->dtype >= 0) {
        kv_convert_to_f32((enum kv_dtype)c->dtype, in, out, n);
        return KV_OK;
    }
    const uint8_t *b = in;
    for (int64_t i = 0; i < n / c->elems; i++) c->dq(b + i * c->bytes, out + i * c->elems);
    return KV_OK;
}

int kv_ggml_quant(uint32_t t, const float *in, void *out, int64_t n) {
    const struct codec *c = codec_of(t);
    int rc = check_args(c, n);
    if (rc) return rc;
    if (c->dtype >= 0) {
        kv_convert_from_f32((enum kv_dtype)c->dtype, in, out, n);
        return KV_OK;
    }
    uint8_t *b = out;
    for (int64_t i = 0; i < n / c->elems; i++) c->q(in + i * c->elems, b + i * c->bytes);
    return KV_OK;
}

uint32_t kv_ggml_k_fallback(uint32_t t) {
    switch (t) {
    case 10: /* Q2_K */
    case 11: return 2; /* Q3_K -> Q4_0 (llama.cpp picks IQ4_NL, which kvcal has not) */
    case 12: return 6;  /* Q4_K -> Q5_0 */
    case 13: return 7;  /* Q5_K -> Q5_1 */
    case 14: return 8;  /* Q6_K -> Q8_0 */
    default: return t;
    }
}
