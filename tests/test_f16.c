/* f32 to f16/bf16 encoders and back (suite f16; lib/model.c): checked
 * against the format definitions, value by value, and against a
 * nearest-even reference. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "testutil.h"
#include "xorshift64.h"

/* ------------------------------------------------------------ f16 / bf16 */

/* IEEE binary16 and bfloat16 fields: sign, biased exponent, mantissa. */
static uint16_t H(int sign, int exp, int man) {
    return (uint16_t)(sign << 15 | exp << 10 | man);
}
static uint16_t B(int sign, int exp, int man) {
    return (uint16_t)(sign << 15 | exp << 7 | man);
}

static int f16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }
static int bf16_is_nan(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f); }

Test(f16, every_half_round_trips_through_f32) {
    int nans = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = kv_f16_to_f32(h);
        uint16_t back = kv_f32_to_f16(f);
        if (f16_is_nan(h)) {
            nans++;
            cr_assert(isnan(f));
            cr_assert(f16_is_nan(back), "NaN 0x%04x came back as 0x%04x", h, back);
            cr_assert_eq(back & 0x8000, h & 0x8000, "NaN 0x%04x lost its sign", h);
        } else {
            cr_assert_eq(back, h, "0x%04x (%.9g) came back as 0x%04x", h, (double)f, back);
        }
    }
    cr_assert_eq(nans, 2 * 1023);
}

Test(f16, every_bfloat16_round_trips_through_f32) {
    int nans = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = kv_bf16_to_f32(h);
        uint16_t back = kv_f32_to_bf16(f);
        if (bf16_is_nan(h)) {
            nans++;
            cr_assert(isnan(f));
            cr_assert(bf16_is_nan(back), "NaN 0x%04x came back as 0x%04x", h, back);
            cr_assert_eq(back & 0x8000, h & 0x8000, "NaN 0x%04x lost its sign", h);
        } else {
            cr_assert_eq(back, h, "0x%04x (%.9g) came back as 0x%04x", h, (double)f, back);
        }
    }
    cr_assert_eq(nans, 2 * 127);
}

static float f32_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

Test(f16, nan_inputs_stay_nan) {
    /* payload only in the low 13 bits, which f16 drops; or in the low 16,
     * which bf16 drops */
    const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu,
                             0x7f801000u};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        float x = f32_bits(nans[i]);
        uint16_t h = kv_f32_to_f16(x), b = kv_f32_to_bf16(x);
        cr_assert(f16_is_nan(h), "f16 of NaN 0x%08x is 0x%04x", nans[i], h);
        cr_assert(bf16_is_nan(b), "bf16 of NaN 0x%08x is 0x%04x", nans[i], b);
        cr_assert_eq(h >> 15, nans[i] >> 31);
        cr_assert_eq(b >> 15, nans[i] >> 31);
    }
}

struct hcase {
    float x;
    uint16_t want;
    const char *why;
};

/* f16 has 10 mantissa bits: in [2^e, 2^(e+1)) the spacing is 2^(e-10), and
 * subnormals are multiples of 2^-24 below 2^-14. Each input below is built
 * from that definition; the expected pattern is spelled as its fields. */
Test(f16, rounds_to_nearest_with_ties_to_even) {
    const struct hcase c[] = {
        {1.0f + ldexpf(1, -11), H(0, 15, 0), "1 + 2^-11: tie between 1 (man 0) and 1 + 2^-10 (man 1)"},
        {1.0f + 3 * ldexpf(1, -11), H(0, 15, 2),
         "1 + 3*2^-11: tie between 1 + 2^-10 (man 1) and 1 + 2^-9 (man 2)"},
        {1.0f + 5 * ldexpf(1, -11), H(0, 15, 2), "1 + 5*2^-11: tie between man 2 and man 3"},
        {1.0f + ldexpf(1, -11) + ldexpf(1, -23), H(0, 15, 1), "one f32 ulp above the first tie"},
        {1.0f + 3 * ldexpf(1, -11) - ldexpf(1, -23), H(0, 15, 1), "one f32 ulp below the second tie"},
        {-(2.0f + ldexpf(1, -10)), H(1, 16, 0), "-(2 + 2^-10): spacing 2^-9, tie, to man 0"},
        {2049.0f, H(0, 26, 0), "2049: spacing 2 in [2048, 4096), tie between 2048 and 2050"},
        {2051.0f, H(0, 26, 2), "2051: tie between 2050 (man 1) and 2052 (man 2)"},
        {2.0f - ldexpf(1, -11), H(0, 16, 0),
         "2 - 2^-11: tie between 2 - 2^-10 (man 1023) and 2, carrying into the exponent"},
        {ldexpf(1, -14) - ldexpf(1, -25), H(0, 1, 0),
         "2^-14 - 2^-25: tie between the largest subnormal (man 1023) and the smallest normal"},
        {ldexpf(1, -24), H(0, 0, 1), "2^-24: the smallest subnormal"},
        {ldexpf(1, -25), H(0, 0, 0), "2^-25: tie between 0 and 2^-24, to 0"},
        {nextafterf(ldexpf(1, -25), 1), H(0, 0, 1), "just above 2^-25"},
        {3 * ldexpf(1, -25), H(0, 0, 2), "1.5 * 2^-24: tie between 1 and 2 units, to 2"},
        {5 * ldexpf(1, -25), H(0, 0, 2), "2.5 * 2^-24: tie between 2 and 3 units, to 2"},
        {-ldexpf(1, -26), H(1, 0, 0), "-2^-26: to -0"},
        {FLT_MIN, H(0, 0, 0), "FLT_MIN"},
        {f32_bits(1), H(0, 0, 0), "the smallest f32 subnormal"},
        {-0.0f, H(1, 0, 0), "-0"},
        {65504.0f, H(0, 30, 1023), "65504: the largest half"},
        {nextafterf(65520.0f, 0), H(0, 30, 1023), "just below 65520"},
        {65520.0f, H(0, 31, 0), "65520: tie between 65504 (man 1023) and 2^16, which is inf"},
        {-65520.0f, H(1, 31, 0), "-65520"},
        {70000.0f, H(0, 31, 0), "70000"},
        {FLT_MAX, H(0, 31, 0), "FLT_MAX"},
        {INFINITY, H(0, 31, 0), "inf"},
        {-INFINITY, H(1, 31, 0), "-inf"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        uint16_t got = kv_f32_to_f16(c[i].x);
        cr_assert_eq(got, c[i].want, "%s: %.10g gave 0x%04x, expected 0x%04x", c[i].why,
                     (double)c[i].x, got, c[i].want);
    }
}

/* bf16 has 7 mantissa bits and f32's exponent range. */
Test(f16, bfloat16_rounds_to_nearest_with_ties_to_even) {
    const struct hcase c[] = {
        {1.0f + ldexpf(1, -8), B(0, 127, 0), "1 + 2^-8: tie between man 0 and man 1"},
        {1.0f + 3 * ldexpf(1, -8), B(0, 127, 2), "1 + 3*2^-8: tie between man 1 and man 2"},
        {1.0f + ldexpf(1, -8) + ldexpf(1, -23), B(0, 127, 1), "one f32 ulp above the tie"},
        {-(1.0f + 3 * ldexpf(1, -8) - ldexpf(1, -23)), B(1, 127, 1), "one f32 ulp below a tie"},
        {2.0f - ldexpf(1, -8), B(0, 128, 0),
         "2 - 2^-8: tie between 2 - 2^-7 (man 127) and 2, carrying into the exponent"},
        {f32_bits(0x00008000u), B(0, 0, 0), "subnormal tie between 0 and the smallest bf16"},
        {f32_bits(0x00018000u), B(0, 0, 2), "subnormal tie between man 1 and man 2"},
        {ldexpf(1.0f - ldexpf(1, -9), 128), B(0, 255, 0),
         "(2 - 2^-8) * 2^127: tie between the largest bf16 (2 - 2^-7) * 2^127 (man 127) and "
         "2^128, which is inf"},
        {nextafterf(ldexpf(1.0f - ldexpf(1, -9), 128), 0), B(0, 254, 127), "just below it"},
        {-FLT_MAX, B(1, 255, 0), "-FLT_MAX"},
        {INFINITY, B(0, 255, 0), "inf"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        uint16_t got = kv_f32_to_bf16(c[i].x);
        cr_assert_eq(got, c[i].want, "%s: %.10g gave 0x%04x, expected 0x%04x", c[i].why,
                     (double)c[i].x, got, c[i].want);
    }
}

/* Reference rounding: the positive patterns 0..top in order have increasing
 * values v[] (computed from the fields in double), with v[top] the first
 * value past the largest finite one (2^16 or 2^128, encoded as inf, as IEEE
 * rounds overflow). The answer is the nearest v[k], ties to the even k. */
struct refcode {
    double *v;
    uint32_t top;
};

static struct refcode ref_f16(void) {
    struct refcode r = {malloc(0x7c01 * sizeof(double)), 0x7c00};
    for (uint32_t k = 0; k <= r.top; k++) {
        uint32_t e = k >> 10, m = k & 0x3ff;
        r.v[k] = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, (int)e - 25);
    }
    return r;
}

static struct refcode ref_bf16(void) {
    struct refcode r = {malloc(0x7f81 * sizeof(double)), 0x7f80};
    for (uint32_t k = 0; k <= r.top; k++) {
        uint32_t e = k >> 7, m = k & 0x7f;
        r.v[k] = e == 0 ? ldexp(m, -133) : ldexp(128 + m, (int)e - 134);
    }
    return r;
}

static uint16_t ref_round(const struct refcode *r, float x) {
    double a = fabs((double)x);
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (a >= r->v[r->top]) return (uint16_t)(sign | r->top);
    uint32_t lo = 0, hi = r->top; /* v[lo] <= a < v[hi] */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (r->v[mid] <= a) lo = mid;
        else hi = mid;
    }
    double d0 = a - r->v[lo], d1 = r->v[hi] - a;
    uint32_t k = d0 < d1 ? lo : d1 < d0 ? hi : (lo & 1) ? hi : lo;
    return (uint16_t)(sign | k);
}

static void check_against_ref(const struct refcode *r, uint16_t (*enc)(float), const char *what) {
    /* every exact value, every midpoint between neighbours, and one f32 ulp
     * either side of it, both signs */
    for (uint32_t k = 0; k < r->top; k++) {
        double mid = (r->v[k] + r->v[k + 1]) / 2;
        float fm = (float)mid;
        cr_assert_eq((double)fm, mid, "%s midpoint %u is not an f32", what, k);
        float xs[4] = {(float)r->v[k], fm, nextafterf(fm, 0), nextafterf(fm, INFINITY)};
        for (int j = 0; j < 8; j++) {
            float x = j < 4 ? xs[j] : -xs[j - 4];
            uint16_t got = enc(x), want = ref_round(r, x);
            cr_assert_eq(got, want, "%s(%a) = 0x%04x, reference 0x%04x", what, (double)x, got,
                         want);
        }
    }
    /* random finite f32 bit patterns, and random values within range */
    uint64_t s = 12345;
    for (int i = 0; i < 1000000; i++) {
        uint32_t b = (uint32_t)(rng_next(&s) >> 32);
        if ((b & 0x7f800000u) == 0x7f800000u) continue;
        float x = f32_bits(b);
        uint16_t got = enc(x), want = ref_round(r, x);
        cr_assert_eq(got, want, "%s(%a) = 0x%04x, reference 0x%04x", what, (double)x, got, want);
        double lo = r->v[1], hi = r->v[r->top];
        x = (float)(exp(log(lo) + (log(hi) - log(lo)) * (double)(rng_next(&s) >> 11) / 9007199254740992.0));
        got = enc(x);
        want = ref_round(r, x);
        cr_assert_eq(got, want, "%s(%a) = 0x%04x, reference 0x%04x", what, (double)x, got, want);
    }
}

Test(f16, matches_a_nearest_even_reference) {
    struct refcode r = ref_f16();
    check_against_ref(&r, kv_f32_to_f16, "f16");
    free(r.v);
    r = ref_bf16();
    check_against_ref(&r, kv_f32_to_bf16, "bf16");
    free(r.v);
}

Test(f16, convert_from_f32_writes_little_endian) {
    const float in[4] = {1.0f, -2.0f, 0.5f, 65504.0f};
    uint8_t h[8], b[8], f[16];
    kv_convert_from_f32(KV_DTYPE_F16, in, h, 4);
    kv_convert_from_f32(KV_DTYPE_BF16, in, b, 4);
    kv_convert_from_f32(KV_DTYPE_F32, in, f, 4);
    /* 1 = H(0,15,0) = 0x3c00, -2 = 0xc000, 0.5 = 0x3800, 65504 = 0x7bff */
    const uint8_t want_h[8] = {0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38, 0xff, 0x7b};
    cr_assert(!memcmp(h, want_h, 8));
    /* 1 = B(0,127,0) = 0x3f80, -2 = 0xc000, 0.5 = 0x3f00; 65504 is f32 0x477fe000, whose
     * dropped half 0xe000 is above the midpoint: up to 0x4780 = 2^16 */
    const uint8_t want_b[8] = {0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f, 0x80, 0x47};
    cr_assert(!memcmp(b, want_b, 8));
    for (int i = 0; i < 4; i++) {
        uint32_t bits;
        memcpy(&bits, &in[i], 4);
        for (int j = 0; j < 4; j++) cr_assert_eq(f[4 * i + j], (uint8_t)(bits >> (8 * j)));
    }
    float back[4];
    kv_convert_to_f32(KV_DTYPE_F16, h, back, 4);
    cr_assert(!memcmp(back, in, sizeof in));
    kv_convert_to_f32(KV_DTYPE_BF16, b, back, 4);
    cr_assert(back[0] == 1.0f && back[1] == -2.0f && back[2] == 0.5f && back[3] == 65536.0f);
}
