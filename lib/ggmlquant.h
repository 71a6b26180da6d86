/* ggml block quantisation codecs (internal): decode GGUF tensor data of the
 * float and legacy/K-quant ggml types to f32, and encode f32 into them.
 *
 * Layouts, written from ggml's block_* definitions (ggml-common.h) and its
 * reference dequantize_row_* formulas (ggml-quants.c). All multi-byte fields
 * are little-endian; "f16" is IEEE binary16. A tensor row is a run of blocks;
 * element e of a block is its e-th float in row order. q is the unsigned code
 * read from the bits, d/m/dmin the f16 fields decoded to f32.
 *
 * Legacy types, blocks of 32 (the nibble at byte j holds element j in its low
 * half and element j+16 in its high half):
 *   Q4_0 (18 B): f16 d | 16 B nibbles.                 x = (q - 8) * d
 *   Q4_1 (20 B): f16 d | f16 m | 16 B nibbles.         x = q * d + m
 *   Q5_0 (22 B): f16 d | u32 qh | 16 B nibbles.        x = (q - 16) * d
 *   Q5_1 (24 B): f16 d | f16 m | u32 qh | 16 B nibbles. x = q * d + m
 *     the fifth bit of element e is bit e of qh (so 0..15 for the low
 *     nibbles, 16..31 for the high ones).
 *   Q8_0 (34 B): f16 d | 32 int8 q.                    x = q * d
 *
 * K-quants, super-blocks of 256 elements cut into sub-blocks (16 or 32):
 *   Q2_K (84 B): scales[16] | qs[64] | f16 d | f16 dmin.
 *     sub-block s (16 elements, s = e/16) has scale sc = scales[s] & 15 and
 *     min mn = scales[s] >> 4; x = d*sc*q - dmin*mn, q 2 bits.
 *     The 256 elements are two halves of 128; in half h, element
 *     128h + 32k + l (k 0..3, l 0..31) is bits 2k..2k+1 of qs[32h + l].
 *   Q3_K (110 B): hmask[32] | qs[64] | scales[12] | f16 d.
 *     low 2 bits as Q2_K's qs; the third bit of element e is bit e/32 of
 *     hmask[e % 32], and q = low + 4*bit - 4 (so -4..3). Sixteen 6-bit
 *     scales (s = e/16): low 4 bits in scales[s] (s < 8, low nibble) or
 *     scales[s-8] (high nibble), high 2 bits at bits 2*(s/4) of
 *     scales[8 + s%4]; x = d * (sc - 32) * q.
 *   Q4_K (144 B): f16 d | f16 dmin | scales[12] | qs[128].
 *     four chunks of 64; in chunk c, element 64c + l (l < 32) is the low
 *     nibble and 64c + 32 + l the high nibble of qs[32c + l].
 *     Eight 6-bit scale/min pairs (s = e/32), "get_scale_min_k4": for s < 4
 *     sc = scales[s] & 63, mn = scales[s+4] & 63; for s >= 4
 *     sc = (scales[s+4] & 15) | (scales[s-4] >> 6) << 4,
 *     mn = (scales[s+4] >> 4) | (scales[s] >> 6) << 4.  x = d*sc*q - dmin*mn.
 *   Q5_K (176 B): f16 d | f16 dmin | scales[12] | qh[32] | qs[128].
 *     as Q4_K, plus a fifth bit (value 16) for element e: bit e/32 of
 *     qh[e % 32].
 *   Q6_K (210 B): ql[128] | qh[64] | int8 scales[16] | f16 d.
 *     two halves of 128; in half h, element 128h + 32k + l (k 0..3,
 *     l < 32): low 4 bits from ql[64h + 32*(k&1) + l] (low nibble for
 *     k < 2, high for k >= 2), high 2 bits at bits 2k..2k+1 of qh[32h + l];
 *     q = bits - 32 (-32..31), scale sc = scales[e/16] (signed);
 *     x = d * sc * q.
 *
 * F32, F16 and BF16 count as blocks of one element.
 *
 * Decoding follows ggml's reference arithmetic: every product of a scale and
 * a code is exact in f32, so the result is the correctly rounded f32 of the
 * formula and matches ggml's dequantize_row_* bit for bit.
 *
 * Encoding is a plain, deterministic quantiser (not ggml's error-minimising
 * search): Q8_0, Q4_0 and Q5_0 take d from the block's signed extreme (as
 * ggml's reference does, so requantising a decoded block gives the same
 * bytes); every other type takes its scales and mins from the min/max of each
 * (sub-)block, rounded up so that the grid covers the data: each element is
 * then within half a step of its decoded value. Codes are rounded to
 * nearest. */
#ifndef KV_GGMLQUANT_H
#define KV_GGMLQUANT_H

#include <stdint.h>

#include "kvcal_core.h"

/* The quantized types kv_ggml_dequant decodes, for messages. */
#define KV_GGML_LOADABLE "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K"

/* The legacy block type llama.cpp's quantiser writes instead of K-quant t
 * for rows without a whole 256-element super-block (Q2_K, Q3_K -> Q4_0;
 * Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0); t itself for other types. */
uint32_t kv_ggml_k_fallback(uint32_t t);

/* 1 when kv_ggml_dequant can decode ggml type t. */
int kv_ggml_can_dequant(uint32_t t);
/* Elements per block and bytes per block of t (1 and the element size for
 * F32/F16/BF16); 0 when unknown. */
int64_t kv_ggml_block_elems(uint32_t t);
int64_t kv_ggml_block_bytes(uint32_t t);
/* Decode n elements (n a multiple of the block size) of type t from in into
 * out (n / block * block_bytes bytes in, n floats out). Returns KV_OK, or
 * KV_EUNSUPPORTED for a type it cannot decode, KV_EINVAL for n negative or
 * not a multiple of the block. No error record: callers word the message.
 * Non-finite scales decode to whatever IEEE arithmetic gives. */
int kv_ggml_dequant(uint32_t t, const void *in, float *out, int64_t n);
/* 1 when kv_ggml_quant can encode t: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. */
int kv_ggml_can_quant(uint32_t t);
/* Encode n finite floats (n a multiple of the block) into t's blocks in out
 * (n / block * block_bytes bytes). Values beyond the f16 range of a type's
 * scales saturate. Returns KV_OK, KV_EUNSUPPORTED or KV_EINVAL (as above). */
int kv_ggml_quant(uint32_t t, const float *in, void *out, int64_t n);

#endif
