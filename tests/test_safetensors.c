/* safetensors parser: a valid file built in memory, then one corruption per
 * validation rule, each pinned to its status code, offset and message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "err.h"
#include "model.h"
#include "safetensors.h"
#include "testutil.h"

#include <criterion/parameterized.h>

/* Headers are padded with spaces to HDR_LEN (the format allows it), so every
 * data offset below is fixed: the data section starts at D0. */
#define HDR_LEN 512
#define D0 (8 + HDR_LEN)
#define DATA_LEN 40
#define FILE_LEN (D0 + DATA_LEN)

/* a: F32 [2, 3] = 1..6; b: F16 [4] = 1, -2, 0.5, 65504; c: I8 [2, 4] = -4..3 */
#define ENT_A "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}"
#define ENT_B "\"b\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[24,32]}"
#define ENT_C "\"c\":{\"dtype\":\"I8\",\"shape\":[2,4],\"data_offsets\":[32,40]}"
#define META "\"__metadata__\":{\"format\":\"pt\",\"alias\":\"a\"}"
#define VALID "{" META "," ENT_A "," ENT_B "," ENT_C "}"

#define X10 "xxxxxxxxxx"
#define X100 X10 X10 X10 X10 X10 X10 X10 X10 X10 X10
#define LONG_NAME X100 X100 X100 /* 300 bytes */

static void fill_data(uint8_t *d) {
    for (int i = 0; i < 6; i++) {
        float f = (float)(i + 1);
        memcpy(d + 4 * i, &f, 4);
    }
    static const uint16_t h[4] = {0x3c00, 0xc000, 0x3800, 0x7bff};
    for (int i = 0; i < 4; i++) {
        d[24 + 2 * i] = (uint8_t)(h[i] & 0xff);
        d[24 + 2 * i + 1] = (uint8_t)(h[i] >> 8);
    }
    for (int i = 0; i < 8; i++) d[32 + i] = (uint8_t)(int8_t)(i - 4);
}

/* File image: header text padded to HDR_LEN, DATA_LEN + data_delta data
 * bytes; hlen overrides the length field when non-zero; total (when
 * non-zero) cuts the image to that many bytes. */
static uint8_t *build(const char *header, int64_t data_delta, uint64_t hlen, uint64_t total,
                      uint64_t *len) {
    size_t hl = strlen(header);
    cr_assert(hl <= HDR_LEN, "test header of %zu bytes does not fit", hl);
    uint64_t n = (uint64_t)((int64_t)FILE_LEN + data_delta);
    uint8_t *b = calloc(1, n > FILE_LEN ? n : FILE_LEN);
    uint64_t h = hlen ? hlen : HDR_LEN;
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(h >> (8 * i));
    memset(b + 8, ' ', HDR_LEN);
    memcpy(b + 8, header, hl);
    fill_data(b + D0);
    *len = total ? total : n;
    return b;
}

static void fmt_err(const struct kv_err *e, char *buf, size_t cap) { kv_err_format(e, buf, cap, 0); }

Test(st_parse, round_trip_reads_values_back) {
    uint64_t len;
    uint8_t *buf = build(VALID, 0, 0, 0, &len);
    struct kv_st_file f;
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kv_st_parse(buf, len, "model.safetensors", &f, &e);
    char msg[1200];
    fmt_err(&e, msg, sizeof msg);
    cr_assert_eq(rc, KV_OK, "%s", msg);
    cr_assert_eq(f.n_tensors, 3);
    cr_assert_eq(f.header_len, HDR_LEN);
    cr_assert_eq(f.data_start, D0);

    const struct kv_tensor *a = &f.tensors[0], *b = &f.tensors[1], *c = &f.tensors[2];
    cr_assert_str_eq(a->name, "a");
    cr_assert_str_eq(b->name, "b");
    cr_assert_str_eq(c->name, "c");
    cr_assert_eq(a->dtype, KV_DTYPE_F32);
    cr_assert_eq(b->dtype, KV_DTYPE_F16);
    cr_assert_eq(c->dtype, KV_DTYPE_I8);
    cr_assert(a->ndim == 2 && a->shape[0] == 2 && a->shape[1] == 3);
    cr_assert(b->ndim == 1 && b->shape[0] == 4);
    cr_assert(c->ndim == 2 && c->shape[0] == 2 && c->shape[1] == 4);
    cr_assert_eq(a->offset, D0);
    cr_assert_eq(b->offset, D0 + 24);
    cr_assert_eq(c->offset, D0 + 32);
    cr_assert_eq(a->nbytes, 24);
    cr_assert_eq(b->nbytes, 8);
    cr_assert_eq(c->nbytes, 8);
    cr_assert_eq(a->data, buf + D0);

    for (int i = 0; i < 6; i++) {
        float v;
        memcpy(&v, (const uint8_t *)a->data + 4 * i, 4);
        cr_assert_float_eq(v, (float)(i + 1), 0, "a[%d] = %g", i, (double)v);
    }
    float hb[4];
    kv_convert_to_f32(KV_DTYPE_F16, b->data, hb, 4);
    const float want_b[4] = {1.0f, -2.0f, 0.5f, 65504.0f};
    for (int i = 0; i < 4; i++) cr_assert_float_eq(hb[i], want_b[i], 0, "b[%d] = %g", i, (double)hb[i]);
    for (int i = 0; i < 8; i++) cr_assert_eq(((const int8_t *)c->data)[i], i - 4);

    cr_assert_str_eq(kv_st_meta(&f, "format"), "pt");
    cr_assert_str_eq(kv_st_meta(&f, "alias"), "a");
    cr_assert_null(kv_st_meta(&f, "missing"));
    cr_assert_eq(kv_st_find(&f, "b"), b);
    cr_assert_null(kv_st_find(&f, "d"));
    kv_st_clear(&f);
    free(buf);
}

Test(st_parse, sorts_tensors_by_offset_and_accepts_empty_ones) {
    /* Listed out of order; z is a zero-size tensor sharing c's begin. */
    uint64_t len;
    uint8_t *buf = build("{" ENT_C ",\"z\":{\"dtype\":\"BF16\",\"shape\":[0,7],\"data_offsets\":[32,32]},"
                         ENT_B "," ENT_A "}",
                         0, 0, 0, &len);
    struct kv_st_file f;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_st_parse(buf, len, "m.safetensors", &f, &e), KV_OK, "%s", e.msg);
    cr_assert_eq(f.n_tensors, 4);
    const char *order[] = {"a", "b", "z", "c"};
    for (int i = 0; i < 4; i++) cr_assert_str_eq(f.tensors[i].name, order[i]);
    cr_assert_eq(f.tensors[2].nbytes, 0);
    cr_assert_eq(f.n_meta, 0);
    kv_st_clear(&f);
    free(buf);
}

Test(st_open, maps_a_file_and_finds_tensors) {
    uint64_t len;
    uint8_t *buf = build(VALID, 0, 0, 0, &len);
    char *path = kvt_write_temp(buf, len, ".safetensors");
    struct kv_st_file *f = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_st_open(path, &f, &e), KV_OK, "%s", e.msg);
    const struct kv_tensor *c = kv_st_find(f, "c");
    cr_assert_not_null(c);
    cr_assert_eq(memcmp(c->data, buf + D0 + 32, 8), 0);
    kv_st_close(f);
    kv_st_close(NULL);
    unlink(path);

    cr_assert_eq(kv_st_open(path, &f, &e), KV_EIO);
    cr_assert_str_eq(e.path, path);
    free(path);
    free(buf);
}

/* Strings are held by value: Criterion runs each parameter in a fresh
 * process where pointers into this one's static data are meaningless. */
struct st_case {
    char name[64];
    char header[HDR_LEN + 1]; /* "": the valid header */
    int64_t data_delta;   /* bytes added to (removed from) the data section */
    uint64_t hlen;        /* length field; 0: HDR_LEN */
    uint64_t total;       /* cut the image to this size; 0: keep */
    int code;
    uint64_t off;
    char msg[256];        /* the whole kv_err_format line */
};

#define P "model.safetensors: "

ParameterizedTestParameters(st_parse, rejects_corruption) {
    static struct st_case cases[] = {
        {"file shorter than the length field", "", 0, 0, 4, KV_EFORMAT, 0,
         P "offset 0: file is 4 bytes, too short for the 8-byte header length"},
        {"truncated data", "", -4, 0, 0, KV_EFORMAT, D0 + 32,
         P "offset 552: truncated: tensor 'c' data_offsets end 40 exceeds the 36 data bytes in "
           "the file"},
        {"header length larger than the file", "", 0, 999999, 0, KV_EFORMAT, 0,
         P "offset 0: header length 999999 exceeds file size 560"},
        {"header length past the end", "", 0, 555, 0, KV_EFORMAT, 0,
         P "offset 0: header length 555 exceeds the 552 bytes after the length field"},
        {"overlapping offsets",
         "{" ENT_A ",\"b\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[20,28]},"
         "\"c\":{\"dtype\":\"I8\",\"shape\":[2,4],\"data_offsets\":[28,36]}}",
         0, 0, 0, KV_EFORMAT, D0 + 20,
         P "offset 540: tensor 'b': data_offsets [20, 28] overlap tensor 'a', which ends at 24"},
        {"gap between tensors",
         "{" ENT_A ",\"b\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[28,36]},"
         "\"c\":{\"dtype\":\"I8\",\"shape\":[2,4],\"data_offsets\":[36,44]}}",
         0, 0, 0, KV_EFORMAT, D0 + 28,
         P "offset 548: tensor 'b': data_offsets begin 28 leaves a gap of 4 bytes after tensor "
           "'a', which ends at 24"},
        {"gap at the start",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[8,32]},"
         "\"c\":{\"dtype\":\"I8\",\"shape\":[2,4],\"data_offsets\":[32,40]}}",
         0, 0, 0, KV_EFORMAT, D0 + 8,
         P "offset 528: tensor 'a': data_offsets begin 8 leaves a gap of 8 bytes at the start "
           "of the data"},
        {"last end short of the file size", "", 8, 0, 0, KV_EFORMAT, D0 + 40,
         P "offset 560: tensor 'c' ends the data at 40 but the file has 48 data bytes (8 "
           "trailing)"},
        {"no tensors but data", "{" META "}", 0, 0, 0, KV_EFORMAT, D0,
         P "offset 520: header lists no tensors but 40 data bytes follow it"},
        {"unsupported safetensors dtype",
         "{" ENT_A "," ENT_B ",\"c\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,4],\"data_offsets\":[32,40]}}",
         0, 0, 0, KV_EUNSUPPORTED, 8,
         P "offset 8: tensor 'c': unknown dtype 'F8_E4M3', expected one of F64 F32 F16 BF16 I64 "
           "I32 I16 I8 U8 BOOL"},
        {"unknown dtype",
         "{" ENT_A "," ENT_B ",\"c\":{\"dtype\":\"Q4_K\",\"shape\":[2,4],\"data_offsets\":[32,40]}}",
         0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: tensor 'c': unknown dtype 'Q4_K', expected one of F64 F32 F16 BF16 I64 I32 "
           "I16 I8 U8 BOOL"},
        /* jansson stops after reading the token '1' at header bytes 5..6 */
        {"invalid json", "{\"a\" 1}", 0, 0, 0, KV_EFORMAT, 8 + 6,
         P "offset 14: invalid json: ':' expected near '1'"},
        /* the second "a" key ends at header byte 10 */
        {"duplicate keys", "{\"a\":1,\"a\":2}", 0, 0, 0, KV_EFORMAT, 8 + 10,
         P "offset 18: invalid json: duplicate object key near '\"a\"'"},
        {"header is not an object", "[1, 2]", 0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: header is a json array, expected an object"},
        {"shape and size disagree",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,4],\"data_offsets\":[0,24]}," ENT_B "," ENT_C "}",
         0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: tensor 'a': data_offsets span 24 bytes but shape [2, 4] F32 needs 32"},
        {"too many dims",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,2,3],\"data_offsets\":[0,24]}," ENT_B "," ENT_C "}",
         0, 0, 0, KV_EFORMAT, 8, P "offset 8: tensor 'a': shape has 5 dims, above the limit 4"},
        {"negative dim",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2,3],\"data_offsets\":[0,24]}," ENT_B "," ENT_C "}",
         0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: tensor 'a': shape[0] is -2, expected a non-negative integer"},
        {"fractional dim",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0,3],\"data_offsets\":[0,24]}," ENT_B "," ENT_C "}",
         0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: tensor 'a': shape[0] is 2.0, expected a non-negative integer"},
        {"byte size overflows",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,24]}}",
         0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: tensor 'a': shape [4294967296, 4294967296] F32 needs more than 2^64 bytes"},
        {"end before begin",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[24,0]}}", 0, 0, 0,
         KV_EFORMAT, 8,
         P "offset 8: tensor 'a': data_offsets must be [begin, end] with 0 <= begin <= end, "
           "found [24,0]"},
        {"data_offsets of three",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24,40]}}", 0, 0, 0,
         KV_EFORMAT, 8,
         P "offset 8: tensor 'a': data_offsets must be [begin, end] with 0 <= begin <= end, "
           "found [0,24,40]"},
        {"missing dtype", "{\"a\":{\"shape\":[2,3],\"data_offsets\":[0,24]}}", 0, 0, 0,
         KV_EFORMAT, 8, P "offset 8: tensor 'a': missing 'dtype'"},
        {"entry not an object", "{\"a\":5}", 0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: tensor 'a': entry is a json integer, expected an object"},
        {"metadata value not a string", "{\"__metadata__\":{\"format\":1}," ENT_A "}", 0, 0, 0,
         KV_EFORMAT, 8, P "offset 8: __metadata__ key 'format' maps to 1, expected a string"},
        {"name too long", "{\"" LONG_NAME "\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}",
         0, 0, 0, KV_EFORMAT, 8,
         P "offset 8: tensor name '" X10 X10 X10 X10 "...' is 300 bytes, above the limit 255"},
    };
    return cr_make_param_array(struct st_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(struct st_case *c, st_parse, rejects_corruption) {
    uint64_t len;
    uint8_t *buf = build(c->header[0] ? c->header : VALID, c->data_delta, c->hlen, c->total, &len);
    struct kv_st_file f;
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kv_st_parse(buf, len, "model.safetensors", &f, &e);
    char msg[1200];
    fmt_err(&e, msg, sizeof msg);
    cr_assert_eq(rc, c->code, "%s: status %s, expected %s (%s)", c->name, kv_status_name(rc),
                 kv_status_name(c->code), msg);
    cr_assert_eq(e.code, c->code, "%s", c->name);
    cr_assert_eq(e.off, c->off, "%s: offset %llu, expected %llu", c->name,
                 (unsigned long long)e.off, (unsigned long long)c->off);
    cr_assert_str_eq(msg, c->msg, "%s", c->name);
    cr_assert_eq(f.n_tensors, 0, "%s: a failed parse leaves no table", c->name);
    cr_assert_null(f.tensors);
    free(buf);
}

Test(st_parse, rejects_header_length_above_the_limit) {
    /* A mapping larger than KV_MAX_ST_HEADER whose pages are never touched. */
    size_t n = (size_t)128 << 20;
    uint8_t *buf = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert(buf != MAP_FAILED);
    uint64_t h = 100000001;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(h >> (8 * i));
    struct kv_st_file f;
    struct kv_err e;
    kv_err_clear(&e);
    cr_assert_eq(kv_st_parse(buf, n, "big.safetensors", &f, &e), KV_EFORMAT);
    char msg[1200];
    fmt_err(&e, msg, sizeof msg);
    cr_assert_str_eq(msg, "big.safetensors: offset 0: header length 100000001 exceeds the limit "
                          "100000000");
    munmap(buf, n);
}

Test(st_parse, survives_every_truncation_and_byte_flip) {
    uint64_t len;
    uint8_t *buf = build(VALID, 0, 0, 0, &len);
    struct kv_st_file f;
    struct kv_err e;
    for (uint64_t cut = 0; cut < len; cut++) {
        uint8_t *copy = malloc(cut ? cut : 1); /* exact size, so ASan sees overreads */
        memcpy(copy, buf, cut);
        kv_err_clear(&e);
        int rc = kv_st_parse(copy, cut, "t", &f, &e);
        cr_assert_neq(rc, KV_OK, "a file cut to %llu bytes parsed", (unsigned long long)cut);
        cr_assert(e.off == KV_NO_OFFSET || e.off <= len, "offset %llu", (unsigned long long)e.off);
        free(copy);
    }
    size_t hl = strlen(VALID);
    for (size_t i = 0; i < 8 + hl; i++) {
        for (int bit = 0; bit < 8; bit++) {
            uint8_t *copy = malloc(len);
            memcpy(copy, buf, len);
            copy[i] ^= (uint8_t)(1u << bit);
            kv_err_clear(&e);
            if (kv_st_parse(copy, len, "t", &f, &e) == KV_OK) kv_st_clear(&f);
            free(copy);
        }
    }
    free(buf);
}
