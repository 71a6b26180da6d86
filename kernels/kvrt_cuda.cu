/* The CUDA backend of the runtime: the five stages of kvrt_plan.h as one
 * cuBLAS GEMV, three kernels (prep, attention, combine) and one more GEMV
 * per decode step, on one stream. The attention stage runs, per layer, one
 * of the fast kernels of attn_fast.cuh where the layer's shapes fit them
 * (choose_kernel), else the generic attn_kernel below. twin.c is the
 * generic kernel's algorithm in plain C, loop for loop: every dot product,
 * reconstruction and accumulation of attn_kernel runs in the twin's order,
 * so the two agree to fp32 rounding (the exceptions: the per-tile softmax
 * sum, a warp reduction here, and fused multiply-adds); the fast kernels
 * sum in their own order. Low-bit latent sides (kvrt_plan.h) are written
 * as codes by prep (quantize_put, the reference's arithmetic) and read
 * back by every attention kernel.
 *
 * attn_kernel<CT, PRE>: one block per task (KV head j, sequence chunk c),
 * launched longest first (kvrt_task). The block keeps the queries of j's
 * query heads in shared memory and walks its chunk in tiles of KVRT_TILE
 * (= 32, one warp lane per position): it stages the tile's keys and values
 * in shared memory, their loads in flight together, 16 bytes each where the
 * layout allows (stage2; values in place when they do not fit; prerope
 * latents: stages z, rebuilds k = z upᵀ with up held in shared memory when
 * it fits, applies RoPE there), scores them against every query head
 * (kvrt_score_parts threads per dot product when the tile has few query
 * heads), updates a running max and sum per head (online softmax), and
 * accumulates P·V (values or value latents) per head. CT is the cache
 * element type (float or __half). */
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvrt.h"
#include "kvrt_plan.h"

#define NT KVRT_NT /* threads per block */

/* ---------------------------------------------------------------- errors */

static int cuda_fail(struct kv_err *err, cudaError_t e, const char *what) {
    cudaGetLastError(); /* a later launch check must not report this error again */
    return kv_fail(err, KV_EDEVICE, NULL, KV_NO_OFFSET, "cuda: %s: %s", what, cudaGetErrorString(e));
}
#define CK(call, what)                                                                     \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) return cuda_fail(err, e_, what);                            \
    } while (0)
#define CB(call, what)                                                                     \
    do {                                                                                   \
        cublasStatus_t s_ = (call);                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                   \
            return kv_fail(err, KV_EDEVICE, NULL, KV_NO_OFFSET, "cublas: %s: status %d", what, \
                           (int)s_);                                                       \
    } while (0)

/* ---------------------------------------------------------------- devices */

static int cu_device_count(int *count, struct kv_err *err) {
    *count = 0;
    cudaError_t e = cudaGetDeviceCount(count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
        cudaGetLastError(); /* reset the last-error state for later calls */
        *count = 0;
        return KV_OK;
    }
    if (e != cudaSuccess) return cuda_fail(err, e, "counting devices");
    return KV_OK;
}

static int cu_device_query(int dev, struct kvrt_device *out, struct kv_err *err) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || dev < 0 || dev >= n) {
        cudaGetLastError();
        return kv_fail(err, KV_EDEVICE, NULL, KV_NO_OFFSET, "cuda: no device %d (%d found%s%s)", dev,
                       e == cudaSuccess ? n : 0, e == cudaSuccess ? "" : ": ",
                       e == cudaSuccess ? "" : cudaGetErrorString(e));
    }
    cudaDeviceProp pr;
    CK(cudaGetDeviceProperties(&pr, dev), "reading device properties");
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", pr.name);
    out->cc_major = pr.major, out->cc_minor = pr.minor;
    out->mem_bytes = (int64_t)pr.totalGlobalMem;
    int sm = 0, clk = 0, bus = 0, optin = 0;
    CK(cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, dev), "reading device attributes");
    CK(cudaDeviceGetAttribute(&clk, cudaDevAttrMemoryClockRate, dev), "reading device attributes");
    CK(cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, dev), "reading device attributes");
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
       "reading device attributes");
    out->sm_count = sm;
    out->smem_optin = optin;
    out->peak_gbs = 2.0 * (double)clk * 1e3 * (double)bus / 8.0 / 1e9; /* DDR: two transfers a clock */
    return KV_OK;
}

/* ---------------------------------------------------------------- device state */

/* What the kernels read of one layer (device pointers and scalars). */
struct dlayer {
    int kmode, vmode;
    int64_t qrows, krows, kld, vld;
    const float *bcat, *up, *rot;
    const int32_t *hk, *hq, *order;
    void *kc, *vc;
    float *qv;
    int kbits, vbits;        /* 16, or the codes' width on a quantized side */
    uint32_t *ksz, *vsz;     /* (scale, zero) fp16 pairs of a quantized side */
    int64_t szp;             /* pairs per unit (max_ctx: kvrt_pair_at) */
};
/* What every layer shares. */
struct dglob {
    int64_t dh, grp, g, max_chunks, vw_stride;
    int rope, rope_half;
    const float *cos_t, *sin_t;
    float scale;
};

/* Which attention kernel a layer runs (attn_fast.cuh; generic otherwise). */
enum { KERN_GENERIC = 0, KERN_DIRECT, KERN_PREROPE, KERN_MMA };

struct lstate {
    float *wcat, *bcat, *up, *rot, *wo, *qv;
    int32_t *hk, *hq, *order;
    void *kc, *vc;
    uint32_t *ksz, *vsz;
    size_t smem;   /* attention kernel's dynamic shared memory */
    int v_smem;    /* value tiles staged in shared memory */
    int up_smem;   /* prerope up factors staged in shared memory */
    int kern;      /* KERN_* */
    int gs;        /* threads per position of the prerope kernel (dattn_kernel sets its own per head) */
    int qb;        /* dattn_kernel's code width: a quantized side's bits, else 16 */
    int nq;        /* mattn_kernel's n-tiles of query heads (up to 4 each) */
    int cap;       /* dattn_kernel's stage bytes (dattn_tile) */
    size_t fsmem;  /* a fast kernel's dynamic shared memory */
};

struct kvrt_cuda {
    const struct kvrt_plan *p;
    int dev;
    cudaStream_t st;
    cublasHandle_t cb;
    cudaEvent_t ev[4];
    struct lstate *ls;
    float *cos_t, *sin_t, *xn, *proj, *att, *y, *pm, *pl, *pacc;
    int64_t vw_stride;
};

/* A quantized side as the generic kernel reads it (bits 16: not quantized). */
struct qsrc {
    int bits;
    const uint32_t *sz;
    int64_t szp, unit, up; /* rows per unit (kvrt_pair_at, kvrt_code_at), the unit, its row pitch */
};

/* Element e at row `row` of the unit at byte column col of a quantized
 * side, read back as code·scale + zero (product rounded first). */
static inline __device__ float ldq(const void *c, int64_t col, const qsrc &q, int64_t row, int64_t e) {
    unsigned v = kvrt_code_get((const uint8_t *)c + kvrt_code_at(q.szp, col, q.up, row), q.bits, e);
    uint32_t p = q.sz[kvrt_pair_at(q.szp, q.unit, row)];
    float sc = __half2float(__ushort_as_half((unsigned short)(p & 0xffffu)));
    float ze = __half2float(__ushort_as_half((unsigned short)(p >> 16)));
    return __fadd_rn(__fmul_rn((float)v, sc), ze);
}

static inline __device__ float ldc(const float *c, int64_t i) { return c[i]; }
static inline __device__ float ldc(const __half *c, int64_t i) { return __half2float(c[i]); }
static inline __device__ void stc(float *c, int64_t i, float v) { c[i] = v; }
static inline __device__ void stc(__half *c, int64_t i, float v) { c[i] = __float2half_rn(v); }

/* RoPE of tmp [d_h] in shared memory at position pos (pairs split over the
 * block; the caller synchronizes). */
static __device__ void rope_shared(const struct dglob &G, float *v, int64_t pos) {
    int64_t half = G.dh / 2;
    const float *cs = G.cos_t + pos * half, *sn = G.sin_t + pos * half;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
        int64_t a = G.rope_half ? i : 2 * i, b = G.rope_half ? i + half : 2 * i + 1;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * cs[i] - x1 * sn[i];
        v[b] = x0 * sn[i] + x1 * cs[i];
    }
}

/* ---------------------------------------------------------------- stage 2: prep */

/* Quantizes the latent z [r] (shared memory) into a quantized side's row:
 * the codes from byte `at` of the code row, the (scale, zero) pair at pz
 * (kvrt_plan.h: the reference's arithmetic, lib/forward.c). Shared red
 * [2 · warps]. Every thread of the block calls it. */
static __device__ void quantize_put(const float *z, int64_t r, int bits, uint8_t *at, uint32_t *pz,
                                    float *red) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t e = threadIdx.x; e < r; e += blockDim.x) lo = fminf(lo, z[e]), hi = fmaxf(hi, z[e]);
    for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    int nw = (int)(blockDim.x >> 5), w = (int)(threadIdx.x >> 5);
    if ((threadIdx.x & 31) == 0) red[w] = lo, red[nw + w] = hi;
    __syncthreads();
    lo = red[0], hi = red[nw];
    for (int i = 1; i < nw; i++) lo = fminf(lo, red[i]), hi = fmaxf(hi, red[nw + i]);
    const float qmax = (float)((1 << bits) - 1);
    const __half zh = __float2half_rn(lo);
    const float zero = __half2float(zh);
    const __half sh = __float2half_rn((hi - zero) / qmax);
    const float scale = __half2float(sh);
    int64_t nb = kvrt_code_bytes(r, bits);
    for (int64_t k = threadIdx.x; k * 8 < r; k += blockDim.x) { /* 8 codes = `bits` bytes */
        uint64_t w64 = 0;
        for (int e = 0; e < 8 && k * 8 + e < r; e++) {
            float q = scale > 0.0f ? rintf((z[k * 8 + e] - zero) / scale) : 0.0f;
            q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
            w64 |= (uint64_t)(unsigned)q << (e * bits);
        }
        for (int b = 0; b < bits && k * bits + b < nb; b++) at[k * bits + b] = (uint8_t)(w64 >> (8 * b));
    }
    if (threadIdx.x == 0) *pz = (uint32_t)__half_as_ushort(sh) | (uint32_t)__half_as_ushort(zh) << 16;
    __syncthreads(); /* z and red may be reused */
}

/* Block j: biases, RoPE and rotations of KV head j's query heads, key and
 * value at position pos (twin.c prep). Shared: tmp [max(2 d_h, widest
 * latent)], then red [2 · warps]. */
template <typename CT>
__global__ void prep_kernel(struct dlayer L, struct dglob G, const float *proj, int64_t pos, int64_t tmp_len) {
    extern __shared__ float tmp[];
    float *red = tmp + tmp_len;
    int64_t j = blockIdx.x, dh = G.dh;
    const int32_t *hk = L.hk + j * KVRT_HK_N;
    const float *b = L.bcat;
    int fq = L.kmode == KV_LR_FUSED_QUERY, rot = L.kmode == KV_LR_POSTROPE_ROTATION;
    int64_t kw = hk[KVRT_HK_KW];
    const float *R = rot ? L.rot + hk[KVRT_HK_ROTOFF] : NULL;
    CT *kc = (CT *)L.kc, *vc = (CT *)L.vc;
    for (int64_t gi = 0; gi < G.grp; gi++) {
        int64_t i = j * G.grp + gi, qo = L.hq[i * KVRT_HQ_N + KVRT_HQ_QOFF];
        if (fq) {
            for (int64_t e = threadIdx.x; e < kw; e += blockDim.x) L.qv[qo + e] = proj[qo + e] + b[qo + e];
            continue;
        }
        for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) tmp[e] = proj[i * dh + e] + b[i * dh + e];
        __syncthreads();
        if (G.rope) rope_shared(G, tmp, pos);
        __syncthreads();
        if (rot) {
            for (int64_t a = threadIdx.x; a < kw; a += blockDim.x) {
                float s = 0.0f;
                for (int64_t e = 0; e < dh; e++) s += R[a * dh + e] * tmp[e];
                L.qv[qo + a] = s;
            }
        } else {
            for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) L.qv[qo + e] = tmp[e];
        }
        __syncthreads();
    }
    int64_t kb = L.qrows, vb = L.qrows + L.krows;
    int64_t krow = pos * L.kld, vrow = pos * L.vld, kcol = hk[KVRT_HK_KCOL];
    if (L.kmode == KV_LR_FULL || rot) {
        for (int64_t e = threadIdx.x; e < dh; e += blockDim.x)
            tmp[e] = proj[kb + j * dh + e] + b[kb + j * dh + e];
        __syncthreads();
        if (G.rope) rope_shared(G, tmp, pos);
        __syncthreads();
        if (rot && L.kbits < 16) {
            for (int64_t a = threadIdx.x; a < kw; a += blockDim.x) {
                float s = 0.0f;
                for (int64_t e = 0; e < dh; e++) s += R[a * dh + e] * tmp[e];
                tmp[dh + a] = s;
            }
            __syncthreads();
            quantize_put(tmp + dh, kw, L.kbits, (uint8_t *)L.kc + kvrt_code_at(L.szp, kcol, kvrt_unit_pitch(kw, L.kbits), pos),
                         L.ksz + kvrt_pair_at(L.szp, hk[KVRT_HK_KU], pos), red);
        } else if (rot) {
            for (int64_t a = threadIdx.x; a < kw; a += blockDim.x) {
                float s = 0.0f;
                for (int64_t e = 0; e < dh; e++) s += R[a * dh + e] * tmp[e];
                stc(kc, krow + kcol + a, s);
            }
        } else {
            for (int64_t e = threadIdx.x; e < dh; e += blockDim.x) stc(kc, krow + kcol + e, tmp[e]);
        }
    } else if (hk[KVRT_HK_KOWN]) {
        int64_t kp = hk[KVRT_HK_KPROJ], r = hk[KVRT_HK_KSRC];
        if (L.kbits < 16) {
            for (int64_t e = threadIdx.x; e < r; e += blockDim.x) tmp[e] = proj[kb + kp + e] + b[kb + kp + e];
            __syncthreads();
            quantize_put(tmp, r, L.kbits, (uint8_t *)L.kc + kvrt_code_at(L.szp, kcol, kvrt_unit_pitch(r, L.kbits), pos),
                         L.ksz + kvrt_pair_at(L.szp, hk[KVRT_HK_KU], pos), red);
        } else {
            for (int64_t e = threadIdx.x; e < r; e += blockDim.x)
                stc(kc, krow + kcol + e, proj[kb + kp + e] + b[kb + kp + e]);
        }
    }
    if (hk[KVRT_HK_VOWN]) {
        int64_t vcol = hk[KVRT_HK_VCOL], vp = hk[KVRT_HK_VPROJ], r = hk[KVRT_HK_VW];
        if (L.vbits < 16) {
            __syncthreads(); /* tmp may still be read above */
            for (int64_t e = threadIdx.x; e < r; e += blockDim.x) tmp[e] = proj[vb + vp + e] + b[vb + vp + e];
            __syncthreads();
            quantize_put(tmp, r, L.vbits, (uint8_t *)L.vc + kvrt_code_at(L.szp, vcol, kvrt_unit_pitch(r, L.vbits), pos),
                         L.vsz + kvrt_pair_at(L.szp, hk[KVRT_HK_VU], pos), red);
        } else {
            for (int64_t e = threadIdx.x; e < r; e += blockDim.x)
                stc(vc, vrow + vcol + e, proj[vb + vp + e] + b[vb + vp + e]);
        }
    }
}

/* ---------------------------------------------------------------- stage 3: attention */

static inline __device__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
static inline __device__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Shared floats one block of the attention kernel needs (its layout below). */
static size_t attn_smem_floats(int64_t grp, int64_t kw, int64_t ks, int64_t vw, int64_t dh, int pre,
                               int v_smem, int up_smem) {
    int P = kvrt_score_parts(grp);
    size_t f = (size_t)(grp * kw + 3 * grp + grp * vw + KVRT_TILE * (kw | 1) + grp * KVRT_TILE);
    if (P > 1) f += (size_t)(P * grp * KVRT_TILE); /* score parts */
    if (v_smem) f += (size_t)(KVRT_TILE * vw);
    if (pre) f += (size_t)(KVRT_TILE * ks) + (up_smem ? (size_t)(dh * ks) : 0);
    return f;
}

/* Units (16-byte vectors, or single elements) a thread loads before it
 * stores any of them, per source. */
#define SB 4

/* 16-byte loads of a cache slice when its rows, its first column and its
 * width are all multiples of 16 bytes (the full caches and most latent
 * layouts); single elements otherwise. Block-uniform. */
template <typename CT>
static __device__ __forceinline__ int vec_ok(const CT *s, int64_t ld, int64_t c, int w) {
    const int ve = 16 / (int)sizeof(CT);
    return w % ve == 0 && ld % ve == 0 && c % ve == 0 && ((size_t)s & 15) == 0;
}
static __device__ __forceinline__ void unpack(uint4 r, float *o, const __half *) {
    const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __half22float2(h[i]);
        o[2 * i] = f.x, o[2 * i + 1] = f.y;
    }
}
static __device__ __forceinline__ void unpack(uint4 r, float *o, const float *) {
    o[0] = __uint_as_float(r.x), o[1] = __uint_as_float(r.y);
    o[2] = __uint_as_float(r.z), o[3] = __uint_as_float(r.w);
}

/* One source of stage2: columns c .. c+w-1 of rows s0 .. s0+ts-1 of cache
 * s (row pitch ld) into d (pitch p), in units of e elements, u per row. */

template <typename CT>
struct src {
    float *d;
    int64_t p;
    const CT *s;
    int64_t ld, c;
    int e, u, n; /* elements per unit, units per row, units in the tile */
    qsrc q;
};
template <typename CT>
static __device__ __forceinline__ src<CT> src_of(float *d, int64_t p, const CT *s, int64_t ld,
                                                 int64_t c, int w, int ts, const qsrc &q) {
    src<CT> r;
    r.d = d, r.p = p, r.s = s, r.ld = ld, r.c = c, r.q = q;
    r.e = w > 0 && q.bits == 16 && vec_ok(s, ld, c, w) ? 16 / (int)sizeof(CT) : 1;
    r.u = w / r.e, r.n = ts * r.u;
    return r;
}
template <typename CT>
static __device__ __forceinline__ uint4 src_load(const src<CT> &S, int64_t s0, int x) {
    int t = x / S.u, k = (x - t * S.u) * S.e;
    uint4 r;
    if (S.q.bits != 16) {
        r.x = __float_as_uint(ldq(S.s, S.c, S.q, s0 + t, k));
        r.y = r.z = r.w = 0u;
        return r;
    }
    const CT *at = S.s + (s0 + t) * S.ld + S.c + k;
    if (S.e > 1)
        r = *reinterpret_cast<const uint4 *>(at);
    else
        r.x = __float_as_uint(ldc(at, 0)), r.y = r.z = r.w = 0u;
    return r;
}
template <typename CT>
static __device__ __forceinline__ void src_store(const src<CT> &S, int x, uint4 r) {
    int t = x / S.u, k = (x - t * S.u) * S.e;
    float *o = S.d + t * S.p + k;
    if (S.e > 1) {
        float f[16 / sizeof(CT)];
        unpack(r, f, (const CT *)0);
#pragma unroll
        for (int i = 0; i < (int)(16 / sizeof(CT)); i++) o[i] = f[i];
    } else {
        o[0] = __uint_as_float(r.x);
    }
}

/* Stages rows s0 .. s0+ts-1 of two caches into shared memory as floats:
 * columns c1 .. c1+w1-1 of s1 (row pitch ld1) into d1 (pitch p1), and
 * likewise s2 into d2 (w2 = 0: none). Each thread issues up to SB loads of
 * each source, 16 bytes each where the layout allows, before it stores
 * them, so that a block keeps up to 2·SB·blockDim loads in flight and the
 * two caches' loads overlap: a tile's loads are the memory traffic the step
 * is bound by. An f16 tile of 32 full keys and values of 128 is one round
 * (4 + 4 loads per thread). */
template <typename CT>
static __device__ void stage2(float *d1, int64_t p1, const CT *s1, int64_t ld1, int64_t c1, int w1,
                              const qsrc &q1, float *d2, int64_t p2, const CT *s2, int64_t ld2,
                              int64_t c2, int w2, const qsrc &q2, int64_t s0, int ts) {
    const src<CT> A = src_of(d1, p1, s1, ld1, c1, w1, ts, q1), B = src_of(d2, p2, s2, ld2, c2, w2, ts, q2);
    const int n = A.n > B.n ? A.n : B.n, nt = blockDim.x;
    for (int x0 = threadIdx.x; x0 < n; x0 += SB * nt) {
        uint4 r1[SB], r2[SB];
#pragma unroll
        for (int u = 0; u < SB; u++) {
            int x = x0 + u * nt;
            if (x < A.n) r1[u] = src_load(A, s0, x);
            if (x < B.n) r2[u] = src_load(B, s0, x);
        }
#pragma unroll
        for (int u = 0; u < SB; u++) {
            int x = x0 + u * nt;
            if (x < A.n) src_store(A, x, r1[u]);
            if (x < B.n) src_store(B, x, r2[u]);
        }
    }
}

template <typename CT, bool PRE>
__global__ void __launch_bounds__(NT, 4) attn_kernel(struct dlayer L, struct dglob G, int64_t T,
                                                  int64_t len, int64_t n_full, int64_t rem,
                                                  int v_smem, int up_smem, float *pm, float *pl,
                                                  float *pacc) {
    extern __shared__ float sm[];
    int64_t j, c;
    kvrt_task(L.order, L.hk, G.g, n_full, len, rem, blockIdx.x, &j, &c);
    const int32_t *hk = L.hk + j * KVRT_HK_N;
    int64_t grp = G.grp, dh = G.dh;
    int64_t kw = hk[KVRT_HK_KW], ks = hk[KVRT_HK_KSRC], vw = hk[KVRT_HK_VW];
    /* an odd row pitch keeps the score loop's column reads (a lane per
     * position) free of shared-memory bank conflicts */
    int64_t kcol = hk[KVRT_HK_KCOL], vcol = hk[KVRT_HK_VCOL], kpad = kw | 1;
    const CT *kc = (const CT *)L.kc, *vc = (const CT *)L.vc;
    const qsrc kq = {L.kbits, L.ksz, L.szp, hk[KVRT_HK_KU], kvrt_unit_pitch(ks, L.kbits)};
    const qsrc vq = {L.vbits, L.vsz, L.szp, hk[KVRT_HK_VU], kvrt_unit_pitch(vw, L.vbits)};
    float *q = sm, *m = q + grp * kw, *l = m + grp, *alpha = l + grp, *acc = alpha + grp;
    float *K = acc + grp * vw, *s = K + KVRT_TILE * kpad, *V = s + grp * KVRT_TILE;
    float *Z = V + (v_smem ? KVRT_TILE * vw : 0), *ups = Z + KVRT_TILE * ks;
    const int P = kvrt_score_parts(grp); /* threads per dot product of the scores */
    /* score parts [P][grp][KVRT_TILE] when P > 1, after the prerope regions */
    float *sp = Z + (PRE ? KVRT_TILE * ks + (up_smem ? dh * ks : 0) : 0);
    int vs = v_smem ? (int)vw : 0; /* value columns staged per tile (0: read in place) */
    const float *up = NULL;
    int64_t up_e = ks, up_k = 1; /* element (e, k) of up is up[e up_e + k up_k] */
    int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    for (int64_t x = tid; x < grp * kw; x += nt) {
        int64_t gi = x / kw, e = x % kw;
        q[x] = L.qv[L.hq[(j * grp + gi) * KVRT_HQ_N + KVRT_HQ_QOFF] + e];
    }
    for (int64_t x = tid; x < grp; x += nt) m[x] = -INFINITY, l[x] = 0.0f;
    for (int64_t x = tid; x < grp * vw; x += nt) acc[x] = 0.0f;
    if (PRE) {
        up = L.up + hk[KVRT_HK_UPOFF];
        if (up_smem) { /* staged transposed: lanes of a warp read consecutive e */
            for (int64_t x = tid; x < dh * ks; x += nt) ups[(x % ks) * dh + x / ks] = up[x];
            up = ups, up_e = 1, up_k = dh;
        }
    }
    __syncthreads();
    int64_t t0 = c * len, t1 = t0 + len < T ? t0 + len : T;
    for (int64_t s0 = t0; s0 < t1; s0 += KVRT_TILE) {
        int64_t ts = t1 - s0 < KVRT_TILE ? t1 - s0 : KVRT_TILE;
        if (PRE) { /* stage z and the values, rebuild k = z upᵀ, RoPE */
            stage2(Z, ks, kc, L.kld, kcol, (int)ks, kq, V, vw, vc, L.vld, vcol, vs, vq, s0, (int)ts);
            __syncthreads();
            for (int x = tid; x < (int)(ts * dh); x += nt) {
                int t = x / (int)dh, e = x % (int)dh;
                float a = 0.0f;
                for (int64_t k = 0; k < ks; k++) a += Z[t * ks + k] * up[e * up_e + k * up_k];
                K[t * kpad + e] = a;
            }
            __syncthreads();
            if (G.rope) {
                int half = (int)dh / 2;
                for (int x = tid; x < (int)ts * half; x += nt) {
                    int t = x / half, i = x - t * half;
                    int64_t a = G.rope_half ? i : 2 * i, b = G.rope_half ? i + half : 2 * i + 1;
                    const float cs = G.cos_t[(s0 + t) * half + i], sn = G.sin_t[(s0 + t) * half + i];
                    float x0 = K[t * kpad + a], x1 = K[t * kpad + b];
                    K[t * kpad + a] = x0 * cs - x1 * sn;
                    K[t * kpad + b] = x0 * sn + x1 * cs;
                }
                __syncthreads();
            }
        } else { /* stage the keys (or key latents) and the values */
            stage2(K, kpad, kc, L.kld, kcol, (int)kw, kq, V, vw, vc, L.vld, vcol, vs, vq, s0, (int)ts);
            __syncthreads();
        }
        if (P == 1) {
            for (int x = tid; x < (int)(grp * ts); x += nt) {
                int gi = x / (int)ts, t = x - gi * (int)ts;
                float a = 0.0f;
                for (int64_t e = 0; e < kw; e++) a += q[gi * kw + e] * K[t * kpad + e];
                s[gi * KVRT_TILE + t] = a * G.scale;
            }
        } else { /* P threads per (head, position): parts of kw, then their sum */
            const int pairs = (int)grp * KVRT_TILE, cw = ((int)kw + P - 1) / P;
            for (int x = tid; x < P * pairs; x += nt) {
                int r = x / pairs, pr = x - r * pairs, gi = pr / KVRT_TILE, t = pr - gi * KVRT_TILE;
                if (t >= ts) continue;
                int e0 = r * cw, e1 = e0 + cw < (int)kw ? e0 + cw : (int)kw;
                float a = 0.0f;
                for (int e = e0; e < e1; e++) a += q[gi * kw + e] * K[t * kpad + e];
                sp[x] = a;
            }
            __syncthreads();
            for (int x = tid; x < pairs; x += nt) {
                int gi = x / KVRT_TILE, t = x - gi * KVRT_TILE;
                if (t >= ts) continue;
                float a = sp[x];
                for (int r = 1; r < P; r++) a += sp[r * pairs + x];
                s[x] = a * G.scale;
            }
        }
        __syncthreads();
        for (int64_t gi = warp; gi < grp; gi += nw) { /* online softmax, a lane per position */
            float v = lane < ts ? s[gi * KVRT_TILE + lane] : -INFINITY;
            float mt = warp_max(v), mold = m[gi];
            float mn = fmaxf(mold, mt);
            float pr = lane < ts ? expf(v - mn) : 0.0f;
            float sum = warp_sum(pr);
            if (lane < ts) s[gi * KVRT_TILE + lane] = pr;
            __syncwarp(); /* every lane has read m[gi] before lane 0 replaces it */
            if (lane == 0) {
                float al = expf(mold - mn);
                alpha[gi] = al;
                l[gi] = l[gi] * al + sum;
                m[gi] = mn;
            }
        }
        __syncthreads();
        for (int x = tid; x < (int)(grp * vw); x += nt) {
            int gi = x / (int)vw, col = x - gi * (int)vw;
            float a = acc[x] * alpha[gi];
            if (vs)
                for (int64_t t = 0; t < ts; t++) a += s[gi * KVRT_TILE + t] * V[t * vw + col];
            else if (vq.bits != 16)
                for (int64_t t = 0; t < ts; t++)
                    a += s[gi * KVRT_TILE + t] * ldq(vc, vcol, vq, s0 + t, col);
            else
                for (int64_t t = 0; t < ts; t++) a += s[gi * KVRT_TILE + t] * ldc(vc, (s0 + t) * L.vld + vcol + col);
            acc[x] = a;
        }
        __syncthreads();
    }
    for (int64_t x = tid; x < grp * vw; x += nt) {
        int64_t gi = x / vw, col = x % vw;
        pacc[((j * grp + gi) * G.max_chunks + c) * G.vw_stride + col] = acc[x];
    }
    for (int64_t gi = tid; gi < grp; gi += nt) {
        int64_t at = (j * grp + gi) * G.max_chunks + c;
        pm[at] = m[gi], pl[at] = l[gi];
    }
}

/* ---------------------------------------------------------------- stage 4: combine */

__global__ void combine_kernel(struct dlayer L, struct dglob G, int64_t n, const float *pm,
                               const float *pl, const float *pacc, float *att) {
    int64_t i = blockIdx.x;
    int64_t vw = L.hk[(i / G.grp) * KVRT_HK_N + KVRT_HK_VW];
    const float *m = pm + i * G.max_chunks, *l = pl + i * G.max_chunks;
    float M = m[0];
    for (int64_t c = 1; c < n; c++) M = m[c] > M ? m[c] : M;
    float Ls = 0.0f;
    for (int64_t c = 0; c < n; c++) Ls += expf(m[c] - M) * l[c];
    float *o = att + L.hq[i * KVRT_HQ_N + KVRT_HQ_OOFF];
    for (int64_t col = threadIdx.x; col < vw; col += blockDim.x) {
        float a = 0.0f;
        for (int64_t c = 0; c < n; c++) a += expf(m[c] - M) * pacc[(i * G.max_chunks + c) * G.vw_stride + col];
        o[col] = a / Ls;
    }
}

/* ---------------------------------------------------------------- fill */

template <typename CT>
__global__ void fill_kernel(CT *c, int64_t n, uint64_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        stc(c, i, kvrt_fill_value(seed, (uint64_t)i));
}

/* A quantized side: its n code bytes and nz (scale, zero) pairs. */
__global__ void fill_codes_kernel(uint8_t *c, int64_t n, uint32_t *sz, int64_t nz, uint64_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        c[i] = kvrt_fill_byte(seed, (uint64_t)i);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nz; i += (int64_t)gridDim.x * blockDim.x) {
        uint16_t a, b;
        kvrt_fill_sz(seed, (uint64_t)i, &a, &b);
        sz[i] = (uint32_t)a | (uint32_t)b << 16;
    }
}

#include "attn_fast.cuh"


/* ---------------------------------------------------------------- host side */

static struct dlayer dlayer_of(const struct kvrt_cuda *c, int64_t l) {
    const struct kvrt_lplan *lp = &c->p->layers[l];
    const struct lstate *s = &c->ls[l];
    struct dlayer L;
    L.kmode = lp->kmode, L.vmode = lp->vmode;
    L.qrows = lp->qrows, L.krows = lp->krows, L.kld = lp->kld, L.vld = lp->vld;
    L.bcat = s->bcat, L.up = s->up, L.rot = s->rot;
    L.hk = s->hk, L.hq = s->hq, L.order = s->order;
    L.kc = s->kc, L.vc = s->vc, L.qv = s->qv;
    L.kbits = lp->kbits, L.vbits = lp->vbits, L.ksz = s->ksz, L.vsz = s->vsz;
    L.szp = c->p->max_ctx;
    return L;
}

static struct dglob dglob_of(const struct kvrt_cuda *c) {
    const struct kvrt_plan *p = c->p;
    struct dglob G;
    G.dh = p->head_dim, G.grp = p->grp, G.g = p->n_kv_heads, G.max_chunks = p->max_chunks;
    G.vw_stride = c->vw_stride;
    G.rope = p->rope, G.rope_half = p->rope_half;
    G.cos_t = c->cos_t, G.sin_t = c->sin_t;
    G.scale = p->scale;
    return G;
}

template <typename T>
static int upload(T **dst, const T *src, int64_t n, struct kv_err *err, const char *what) {
    *dst = NULL;
    if (n <= 0 || !src) return KV_OK;
    cudaError_t e = cudaMalloc((void **)dst, (size_t)n * sizeof(T));
    if (e != cudaSuccess) {
        *dst = NULL;
        return cuda_fail(err, e, what);
    }
    /* on a failed copy *dst stays set, and kvrt_cuda_close frees it */
    CK(cudaMemcpy(*dst, src, (size_t)n * sizeof(T), cudaMemcpyHostToDevice), what);
    return KV_OK;
}

static int dalloc(void **dst, size_t bytes, struct kv_err *err, const char *what) {
    cudaError_t e = cudaMalloc(dst, bytes ? bytes : 4);
    if (e != cudaSuccess) {
        *dst = NULL;
        return kv_fail(err, KV_EDEVICE, NULL, KV_NO_OFFSET, "cuda: %s (%.1f MiB): %s", what,
                       (double)bytes / 1048576.0, cudaGetErrorString(e));
    }
    return KV_OK;
}

static void cu_close(struct kvrt_cuda *c) {
    if (!c) return;
    cudaSetDevice(c->dev);
    if (c->st) cudaStreamSynchronize(c->st); /* nothing in flight reads what is freed */
    if (c->ls)
        for (int64_t l = 0; l < c->p->n_layers; l++) {
            struct lstate *s = &c->ls[l];
            cudaFree(s->wcat), cudaFree(s->bcat), cudaFree(s->up), cudaFree(s->rot), cudaFree(s->wo);
            cudaFree(s->qv), cudaFree(s->hk), cudaFree(s->hq), cudaFree(s->order);
            cudaFree(s->kc), cudaFree(s->vc), cudaFree(s->ksz), cudaFree(s->vsz);
        }
    free(c->ls);
    cudaFree(c->cos_t), cudaFree(c->sin_t), cudaFree(c->xn), cudaFree(c->proj), cudaFree(c->att);
    cudaFree(c->y), cudaFree(c->pm), cudaFree(c->pl), cudaFree(c->pacc);
    for (int i = 0; i < 4; i++)
        if (c->ev[i]) cudaEventDestroy(c->ev[i]);
    if (c->cb) cublasDestroy(c->cb);
    if (c->st) cudaStreamDestroy(c->st);
    free(c);
}

/* The prerope kernel's instantiations: KSTEPS 1..4 (ranks 16..64) by NTW
 * 2 or 4 (d_h 64 or 128) by query heads per KV head 1, 2 or 4. */
#define PATTN_CASES_G(X, g) X(1, 2, g) X(2, 2, g) X(3, 2, g) X(4, 2, g) X(1, 4, g) X(2, 4, g) X(3, 4, g) X(4, 4, g)
#define PATTN_CASES(X) PATTN_CASES_G(X, 1) PATTN_CASES_G(X, 2) PATTN_CASES_G(X, 4)
/* dattn_kernel<GRP, QB> */
#define DATTN_CASES_G(X, g) X(g, 16) X(g, 8) X(g, 4) X(g, 3) X(g, 2)
#define DATTN_CASES(X) DATTN_CASES_G(X, 1) DATTN_CASES_G(X, 2) DATTN_CASES_G(X, 4)
/* mattn_kernel<NQ, KB, VB>: key and value widths 16 (fp16), 8 or 4, both
 * quantized only at the same width */
#define MATTN_CASES_N(X, n) X(n, 16, 16) X(n, 8, 8) X(n, 4, 4) X(n, 8, 16) X(n, 16, 8) X(n, 4, 16) X(n, 16, 4)
#define MATTN_CASES(X) MATTN_CASES_N(X, 1) MATTN_CASES_N(X, 2)
/* The stage bytes dattn_kernel aims at (dattn_tile). On an H100, 64K
 * positions of llama7b's postrope_rotation at half the bytes (heads of 32
 * and 96 key columns): 238 µs at 8 or 16 KB, 250 at 24, 254 at 32 or 48;
 * full KV the same at every cap. */
#define DATTN_STAGE_CAP 16384

/* Whether mattn_kernel takes a keys-as-stored layer: up to 8 query heads
 * per KV head, every head's key width a multiple of 16 and its value width
 * of 32, both at most 128, each side fp16 or codes of 8 or 4 bits (the
 * same if both are codes); and the shared memory it needs (0 if not). */
static size_t mattn_fits(const struct kvrt_plan *p, const struct kvrt_lplan *lp, int cap, int64_t optin) {
    int kq = lp->kbits < 16, vq = lp->vbits < 16;
    if (p->grp > 8 || (kq && lp->kbits != 8 && lp->kbits != 4) || (vq && lp->vbits != 8 && lp->vbits != 4) ||
        (kq && vq && lp->kbits != lp->vbits))
        return 0;
    size_t sm = 0;
    for (int64_t j = 0; j < p->n_kv_heads; j++) {
        const int32_t *hk = lp->hk + j * KVRT_HK_N;
        int64_t kw = hk[KVRT_HK_KW], vw = hk[KVRT_HK_VW];
        if (kw % 16 || kw > 16 * MKS || vw % 32 || vw > 16 * MVT) return 0;
        size_t need = mattn_smem((int)p->grp, kw, lp->kbits, vw, lp->vbits, cap);
        sm = need > sm ? need : sm;
    }
    return (int64_t)sm <= optin ? sm : 0;
}

/* Picks a layer's attention kernel: a fast one (attn_fast.cuh) when every
 * head's slices fit its layout, the generic one otherwise or when the
 * environment sets KVRT_CUDA_KERNEL=generic (to compare them). Keys as
 * stored go to mattn_kernel with several query heads per KV head or 4-bit
 * codes, and to dattn_kernel otherwise, as measured on an H100 at 64K
 * (docs/performance.md): GQA full KV 163.3 against 208.1 µs, 4-bit
 * postrope 188.2 against 213.8, but MHA fp16 full KV 415.9 against 396.6
 * and 8-bit postrope 222.4 against 215.2. KVRT_CUDA_KERNEL=mma or direct
 * sends every such layer that fits to one of the two. */
static void choose_kernel(const struct kvrt_plan *p, const struct kvrt_lplan *lp, struct lstate *s,
                          int64_t optin) {
    s->kern = KERN_GENERIC, s->gs = 0, s->fsmem = 0;
    const char *force = getenv("KVRT_CUDA_KERNEL");
    if (force && !strcmp(force, "generic")) return;
    int kq = lp->kbits < 16, vq = lp->vbits < 16;
    if ((!kq && !p->f16) || (!vq && !p->f16)) return;
    int pre = lp->kmode == KV_LR_PREROPE_LATENT;
    int64_t grp = p->grp, dh = p->head_dim;
    int ok = (kq || lp->kld % 8 == 0) && (vq || lp->vld % 8 == 0);
    int64_t ks_first = lp->hk[KVRT_HK_KSRC];
    for (int64_t j = 0; ok && j < p->n_kv_heads; j++) {
        const int32_t *hk = lp->hk + j * KVRT_HK_N;
        ok = hk[KVRT_HK_VW] % 8 == 0 && hk[KVRT_HK_VCOL] % 8 == 0 && hk[KVRT_HK_KCOL] % 8 == 0;
        if (pre)
            ok = ok && hk[KVRT_HK_KSRC] == ks_first && hk[KVRT_HK_VW] <= 128;
        else
            ok = ok && hk[KVRT_HK_KW] % 8 == 0 && hk[KVRT_HK_KW] <= 256 && hk[KVRT_HK_VW] <= 256;
    }
    if (!ok) return;
    if (pre) {
        if (!((grp == 1 || grp == 2 || grp == 4) && (dh == 64 || dh == 128) && ks_first % 16 == 0 && ks_first >= 16 && ks_first <= 64))
            return;
        int gs = fast_lanes(lp->vw_max) > 2 ? fast_lanes(lp->vw_max) : 2;
        size_t sm = pattn_smem((int)grp, (int)dh, (int)ks_first, lp->kbits, gs, lp->vw_max, lp->vbits);
        if ((int64_t)sm > optin) return;
        s->kern = KERN_PREROPE, s->gs = gs, s->fsmem = sm;
    } else {
        const char *cap = getenv("KVRT_CUDA_STAGE_BYTES"); /* for tuning: the stage caps */
        s->cap = cap && atoi(cap) >= 1024 ? atoi(cap) : DATTN_STAGE_CAP;
        int mma = force && !strcmp(force, "mma") ? 1 : force && !strcmp(force, "direct") ? 0
                  : grp > 1 || lp->kbits == 4 || lp->vbits == 4;
        size_t msm = mma ? mattn_fits(p, lp, s->cap, optin) : 0;
        if (msm) {
            s->kern = KERN_MMA, s->nq = grp > 4 ? 2 : 1, s->fsmem = msm;
            return;
        }
        if (!(grp == 1 || grp == 2 || grp == 4) || (kq && vq && lp->kbits != lp->vbits)) return;
        s->qb = kq ? lp->kbits : vq ? lp->vbits : 16;
        size_t sm = 0; /* each head its own lanes and tile (attn_fast.cuh): the largest need */
        for (int64_t j = 0; j < p->n_kv_heads; j++) {
            const int32_t *hk = lp->hk + j * KVRT_HK_N;
            size_t need = dattn_smem((int)grp, hk[KVRT_HK_KW], lp->kbits, hk[KVRT_HK_VW], lp->vbits, s->cap);
            sm = need > sm ? need : sm;
        }
        if ((int64_t)sm > optin) return;
        s->kern = KERN_DIRECT, s->gs = 0, s->fsmem = sm;
    }
}

static int open_layers(struct kvrt_cuda *c, int64_t optin, struct kv_err *err) {
    const struct kvrt_plan *p = c->p;
    size_t es = p->f16 ? 2 : 4;
    int rc;
    for (int64_t l = 0; l < p->n_layers; l++) {
        const struct kvrt_lplan *lp = &p->layers[l];
        struct lstate *s = &c->ls[l];
        int64_t rows = lp->qrows + lp->krows + lp->vrows;
        if ((rc = upload(&s->wcat, lp->wcat, rows * p->dim, err, "uploading projections")) ||
            (rc = upload(&s->bcat, lp->bcat, rows, err, "uploading biases")) ||
            (rc = upload(&s->up, lp->up, lp->up_len, err, "uploading up factors")) ||
            (rc = upload(&s->rot, lp->rot, lp->rot_len, err, "uploading rotations")) ||
            (rc = upload(&s->wo, lp->wo, p->dim * lp->o_total, err, "uploading output projections")) ||
            (rc = upload(&s->hk, lp->hk, p->n_kv_heads * KVRT_HK_N, err, "uploading tables")) ||
            (rc = upload(&s->hq, lp->hq, p->n_heads * KVRT_HQ_N, err, "uploading tables")) ||
            (rc = upload(&s->order, lp->order, p->n_kv_heads, err, "uploading tables")))
            return rc;
        size_t kes = lp->kbits < 16 ? 1 : es, ves = lp->vbits < 16 ? 1 : es; /* codes: ld in bytes */
        if ((rc = dalloc((void **)&s->qv, (size_t)lp->qw_total * 4, err, "allocating queries")) ||
            (rc = dalloc(&s->kc, (size_t)(p->max_ctx * lp->kld) * kes, err, "allocating the key cache")) ||
            (rc = dalloc(&s->vc, (size_t)(p->max_ctx * lp->vld) * ves, err, "allocating the value cache")))
            return rc;
        if (lp->kbits < 16 &&
            (rc = dalloc((void **)&s->ksz, (size_t)(p->max_ctx * lp->kunits) * 4, err, "allocating the key scales")))
            return rc;
        if (lp->vbits < 16 &&
            (rc = dalloc((void **)&s->vsz, (size_t)(p->max_ctx * lp->vunits) * 4, err, "allocating the value scales")))
            return rc;
        /* cleared once: a row's padding bytes, which the fast kernels' copies
         * cover but no append writes, are then defined */
        CK(cudaMemset(s->kc, 0, (size_t)(p->max_ctx * lp->kld) * kes), "clearing the key cache");
        CK(cudaMemset(s->vc, 0, (size_t)(p->max_ctx * lp->vld) * ves), "clearing the value cache");
        if (s->ksz) CK(cudaMemset(s->ksz, 0, (size_t)(p->max_ctx * lp->kunits) * 4), "clearing the key scales");
        if (s->vsz) CK(cudaMemset(s->vsz, 0, (size_t)(p->max_ctx * lp->vunits) * 4), "clearing the value scales");
        choose_kernel(p, lp, s, optin);
        /* value tiles in shared memory when they fit, then the up factors */
        int pre = lp->kmode == KV_LR_PREROPE_LATENT;
#define SMEM(v, u) (attn_smem_floats(p->grp, lp->kw_max, lp->ksrc_max, lp->vw_max, p->head_dim, pre, v, u) * 4)
        s->v_smem = (int64_t)SMEM(1, 0) <= optin;
        s->up_smem = pre && (int64_t)SMEM(s->v_smem, 1) <= optin;
        s->smem = SMEM(s->v_smem, s->up_smem);
#undef SMEM
        if ((int64_t)s->smem > optin)
            return kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,
                           "layer %lld: the attention kernel needs %zu bytes of shared memory per block, "
                           "the device allows %lld", (long long)l, s->smem, (long long)optin);
    }
    /* Opt in to the device's maximum rather than this plan's need: the
     * attribute belongs to the kernel, not to this context, so a smaller
     * value would break another open context that needs more. */
    int o = (int)optin;
#define DSET(g, b)                                                                                   \
    CK(cudaFuncSetAttribute(dattn_kernel<g, b>, cudaFuncAttributeMaxDynamicSharedMemorySize, o),     \
       "setting shared memory");
    DATTN_CASES(DSET)
#undef DSET
#define MSET(n, kb, vb)                                                                              \
    CK(cudaFuncSetAttribute(mattn_kernel<n, kb, vb>, cudaFuncAttributeMaxDynamicSharedMemorySize, o), \
       "setting shared memory");
    MATTN_CASES(MSET)
#undef MSET
#define PSET(k, n, g)                                                                                 \
    CK(cudaFuncSetAttribute(pattn_kernel<k, n, g>, cudaFuncAttributeMaxDynamicSharedMemorySize, o),   \
       "setting shared memory");
    PATTN_CASES(PSET)
#undef PSET
    if (p->f16) {
        CK(cudaFuncSetAttribute(attn_kernel<__half, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, o),
           "setting shared memory");
        CK(cudaFuncSetAttribute(attn_kernel<__half, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, o),
           "setting shared memory");
    } else {
        CK(cudaFuncSetAttribute(attn_kernel<float, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, o),
           "setting shared memory");
        CK(cudaFuncSetAttribute(attn_kernel<float, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, o),
           "setting shared memory");
    }
    return KV_OK;
}

static int cu_open(const struct kvrt_plan *p, int dev, struct kvrt_cuda **out,
                   struct kv_err *err) {
    struct kvrt_device dv;
    int rc = cu_device_query(dev, &dv, err);
    if (rc) return rc;
    CK(cudaSetDevice(dev), "selecting the device");
    struct kvrt_cuda *c = (struct kvrt_cuda *)calloc(1, sizeof *c);
    if (!c) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    c->p = p, c->dev = dev;
    c->ls = (struct lstate *)calloc((size_t)p->n_layers, sizeof *c->ls);
    if (!c->ls) {
        free(c);
        return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    }
    int64_t rows = 1, ot = 1, vw = 1;
    for (int64_t l = 0; l < p->n_layers; l++) {
        const struct kvrt_lplan *lp = &p->layers[l];
        int64_t r = lp->qrows + lp->krows + lp->vrows;
        rows = r > rows ? r : rows, ot = lp->o_total > ot ? lp->o_total : ot;
        vw = lp->vw_max > vw ? lp->vw_max : vw;
    }
    c->vw_stride = vw;
    int64_t hc = p->n_heads * p->max_chunks, half = p->head_dim / 2;
    cudaError_t e = cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking);
    if (e != cudaSuccess) rc = cuda_fail(err, e, "creating a stream");
    for (int i = 0; !rc && i < 4; i++)
        if ((e = cudaEventCreate(&c->ev[i])) != cudaSuccess) rc = cuda_fail(err, e, "creating events");
    if (!rc && cublasCreate(&c->cb) != CUBLAS_STATUS_SUCCESS) {
        c->cb = NULL;
        rc = kv_fail(err, KV_EDEVICE, NULL, KV_NO_OFFSET, "cublas: cannot create a handle");
    }
    if (!rc && cublasSetStream(c->cb, c->st) != CUBLAS_STATUS_SUCCESS)
        rc = kv_fail(err, KV_EDEVICE, NULL, KV_NO_OFFSET, "cublas: cannot set the stream");
    if (!rc && p->rope) rc = upload(&c->cos_t, p->rope_cos, p->max_ctx * half, err, "uploading the rope table");
    if (!rc && p->rope) rc = upload(&c->sin_t, p->rope_sin, p->max_ctx * half, err, "uploading the rope table");
    if (!rc) rc = dalloc((void **)&c->xn, (size_t)p->dim * 4, err, "allocating scratch");
    if (!rc) rc = dalloc((void **)&c->proj, (size_t)rows * 4, err, "allocating scratch");
    if (!rc) rc = dalloc((void **)&c->att, (size_t)ot * 4, err, "allocating scratch");
    if (!rc) rc = dalloc((void **)&c->y, (size_t)p->dim * 4, err, "allocating scratch");
    if (!rc) rc = dalloc((void **)&c->pm, (size_t)hc * 4, err, "allocating partials");
    if (!rc) rc = dalloc((void **)&c->pl, (size_t)hc * 4, err, "allocating partials");
    if (!rc) rc = dalloc((void **)&c->pacc, (size_t)(hc * vw) * 4, err, "allocating partials");
    if (!rc) rc = open_layers(c, dv.smem_optin, err);
    /* the uploads ran on the legacy default stream, which c->st (non-blocking)
     * is not ordered after: finish them before any kernel on c->st reads them */
    if (!rc) {
        cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) rc = cuda_fail(err, e, "finishing the uploads");
    }
    if (rc) {
        cu_close(c);
        cudaGetLastError(); /* a failed allocation must not show up in a later call */
        return rc;
    }
    *out = c;
    return KV_OK;
}

/* Stages 1 and 2 from the input already in c->xn. */
static int append_dev(struct kvrt_cuda *c, int64_t l, int64_t pos, struct kv_err *err) {
    const struct kvrt_plan *p = c->p;
    const struct kvrt_lplan *lp = &p->layers[l];
    const struct lstate *s = &c->ls[l];
    int rows = (int)(lp->qrows + lp->krows + lp->vrows), d = (int)p->dim;
    const float one = 1.0f, zero = 0.0f;
    /* proj [rows] = wcat [rows, d] xn: column-major wcat is [d, rows], so op T */
    CB(cublasSgemv(c->cb, CUBLAS_OP_T, d, rows, &one, s->wcat, d, c->xn, 1, &zero, c->proj, 1),
       "projection gemv");
    struct dlayer L = dlayer_of(c, l);
    struct dglob G = dglob_of(c);
    int64_t tl = 2 * p->head_dim;
    tl = lp->ksrc_max > tl ? lp->ksrc_max : tl;
    tl = lp->vw_max > tl ? lp->vw_max : tl;
    size_t sh = (size_t)(tl + 2 * (NT / 32)) * sizeof(float);
    if (p->f16)
        prep_kernel<__half><<<(unsigned)p->n_kv_heads, NT, sh, c->st>>>(L, G, c->proj, pos, tl);
    else
        prep_kernel<float><<<(unsigned)p->n_kv_heads, NT, sh, c->st>>>(L, G, c->proj, pos, tl);
    CK(cudaGetLastError(), "launching the prep kernel");
    return KV_OK;
}

/* Stages 3 and 4 over T positions into c->att. */
static int attn_dev(struct kvrt_cuda *c, int64_t l, int64_t T, struct kv_err *err) {
    const struct kvrt_plan *p = c->p;
    const struct lstate *s = &c->ls[l];
    int64_t len, n_full, n = kvrt_plan_chunks(p, T, &len, &n_full);
    int64_t rem = T - n_full * len;
    struct dlayer L = dlayer_of(c, l);
    struct dglob G = dglob_of(c);
    unsigned tasks = (unsigned)(n * p->n_kv_heads);
    int pre = L.kmode == KV_LR_PREROPE_LATENT;
    const struct kvrt_lplan *lp = &p->layers[l];
    const dside KS = {L.kc, L.ksz, L.kld, L.szp, L.kbits}, VS = {L.vc, L.vsz, L.vld, L.szp, L.vbits};
    if (s->kern == KERN_DIRECT) {
#define DLAUNCH(g, b)                                                                                      \
        if (p->grp == g && s->qb == b)                                                                   \
            dattn_kernel<g, b><<<tasks, NT, s->fsmem, c->st>>>(L, G, KS, VS, T, len, n_full, rem, s->cap, c->pm, \
                                                              c->pl, c->pacc);
        DATTN_CASES(DLAUNCH)
#undef DLAUNCH
    } else if (s->kern == KERN_MMA) {
#define MLAUNCH(qn, kb, vb)                                                                              \
        if (s->nq == qn && lp->kbits == kb && lp->vbits == vb)                                          \
            mattn_kernel<qn, kb, vb><<<tasks, NT, s->fsmem, c->st>>>(L, G, KS, VS, T, len, n_full, rem, s->cap, \
                                                                    c->pm, c->pl, c->pacc);
        MATTN_CASES(MLAUNCH)
#undef MLAUNCH
    } else if (s->kern == KERN_PREROPE) {
        int ksteps = (int)(lp->ksrc_max / 16), ntw = (int)(p->head_dim / 32);
#define PLAUNCH(k, nw, g)                                                                                   \
        if (ksteps == k && ntw == nw && p->grp == g)                                                      \
            pattn_kernel<k, nw, g><<<tasks, NT, s->fsmem, c->st>>>(L, G, KS, VS, s->gs, T, len, n_full, rem, \
                                                                   c->pm, c->pl, c->pacc);
        PATTN_CASES(PLAUNCH)
#undef PLAUNCH
    } else if (p->f16) {
        if (pre)
            attn_kernel<__half, true><<<tasks, NT, s->smem, c->st>>>(L, G, T, len, n_full, rem, s->v_smem, s->up_smem, c->pm, c->pl, c->pacc);
        else
            attn_kernel<__half, false><<<tasks, NT, s->smem, c->st>>>(L, G, T, len, n_full, rem, s->v_smem, 0, c->pm, c->pl, c->pacc);
    } else {
        if (pre)
            attn_kernel<float, true><<<tasks, NT, s->smem, c->st>>>(L, G, T, len, n_full, rem, s->v_smem, s->up_smem, c->pm, c->pl, c->pacc);
        else
            attn_kernel<float, false><<<tasks, NT, s->smem, c->st>>>(L, G, T, len, n_full, rem, s->v_smem, 0, c->pm, c->pl, c->pacc);
    }
    CK(cudaGetLastError(), "launching the attention kernel");
    combine_kernel<<<(unsigned)p->n_heads, NT, 0, c->st>>>(L, G, n, c->pm, c->pl, c->pacc, c->att);
    CK(cudaGetLastError(), "launching the combine kernel");
    return KV_OK;
}

/* Stage 5: c->y = wo att. */
static int out_dev(struct kvrt_cuda *c, int64_t l, struct kv_err *err) {
    const struct kvrt_lplan *lp = &c->p->layers[l];
    const float one = 1.0f, zero = 0.0f;
    /* y [d] = wo [d, o_total] att: column-major wo is [o_total, d], so op T */
    CB(cublasSgemv(c->cb, CUBLAS_OP_T, (int)lp->o_total, (int)c->p->dim, &one, c->ls[l].wo,
                   (int)lp->o_total, c->att, 1, &zero, c->y, 1), "output gemv");
    return KV_OK;
}

static int cu_append(struct kvrt_cuda *c, int64_t layer, int64_t pos, const float *xn,
                     struct kv_err *err) {
    CK(cudaSetDevice(c->dev), "selecting the device");
    CK(cudaMemcpyAsync(c->xn, xn, (size_t)c->p->dim * sizeof(float), cudaMemcpyHostToDevice, c->st),
       "copying the input");
    return append_dev(c, layer, pos, err);
}

static int cu_attend(struct kvrt_cuda *c, int64_t layer, int64_t T, float *y,
                     struct kv_err *err) {
    CK(cudaSetDevice(c->dev), "selecting the device");
    int rc = attn_dev(c, layer, T, err);
    if (!rc) rc = out_dev(c, layer, err);
    if (rc) return rc;
    CK(cudaMemcpyAsync(y, c->y, (size_t)c->p->dim * sizeof(float), cudaMemcpyDeviceToHost, c->st),
       "copying the output");
    CK(cudaStreamSynchronize(c->st), "running the decode step");
    return KV_OK;
}

static int cu_fill(struct kvrt_cuda *c, int64_t layer, int64_t len, uint64_t seed,
                   struct kv_err *err) {
    CK(cudaSetDevice(c->dev), "selecting the device");
    const struct kvrt_lplan *lp = &c->p->layers[layer];
    const struct lstate *s = &c->ls[layer];
    int64_t nk = len * lp->kld, nv = len * lp->vld, mc = c->p->max_ctx; /* codes: whole arrays (kvrt_plan.h) */
    unsigned blocks = 1024;
    uint64_t vseed = seed ^ 0x5bd1e995ull;
    if (lp->kbits < 16)
        fill_codes_kernel<<<blocks, 256, 0, c->st>>>((uint8_t *)s->kc, mc * lp->kld, s->ksz, lp->kunits * mc, seed);
    else if (c->p->f16)
        fill_kernel<__half><<<blocks, 256, 0, c->st>>>((__half *)s->kc, nk, seed);
    else
        fill_kernel<float><<<blocks, 256, 0, c->st>>>((float *)s->kc, nk, seed);
    if (lp->vbits < 16)
        fill_codes_kernel<<<blocks, 256, 0, c->st>>>((uint8_t *)s->vc, mc * lp->vld, s->vsz, lp->vunits * mc, vseed);
    else if (c->p->f16)
        fill_kernel<__half><<<blocks, 256, 0, c->st>>>((__half *)s->vc, nv, vseed);
    else
        fill_kernel<float><<<blocks, 256, 0, c->st>>>((float *)s->vc, nv, vseed);
    CK(cudaGetLastError(), "launching the fill kernel");
    CK(cudaMemsetAsync(s->qv, 0, (size_t)lp->qw_total * sizeof(float), c->st), "clearing the query");
    CK(cudaStreamSynchronize(c->st), "filling the cache");
    return KV_OK;
}

static int cu_time(struct kvrt_cuda *c, int64_t layer, int64_t pos, int64_t iters,
                   double *us_step, double *us_attn, struct kv_err *err) {
    const struct kvrt_plan *p = c->p;
    CK(cudaSetDevice(c->dev), "selecting the device");
    float *x = (float *)malloc((size_t)p->dim * sizeof *x);
    if (!x) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    for (int64_t e = 0; e < p->dim; e++) x[e] = kvrt_fill_value(12345, (uint64_t)e);
    /* on the context's stream (non-blocking: the legacy stream would not
     * order against it), finished before x is freed */
    cudaError_t ce = cudaMemcpyAsync(c->xn, x, (size_t)p->dim * sizeof(float), cudaMemcpyHostToDevice, c->st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(c->st);
    free(x);
    if (ce != cudaSuccess) return cuda_fail(err, ce, "copying the input");
    int rc = KV_OK;
    for (int w = 0; w < 3 && !rc; w++) { /* warm-up */
        rc = append_dev(c, layer, pos, err);
        if (!rc) rc = attn_dev(c, layer, pos + 1, err);
        if (!rc) rc = out_dev(c, layer, err);
    }
    CK(cudaEventRecord(c->ev[0], c->st), "recording an event");
    for (int64_t it = 0; it < iters && !rc; it++) { /* whole steps */
        rc = append_dev(c, layer, pos, err);
        if (!rc) rc = attn_dev(c, layer, pos + 1, err);
        if (!rc) rc = out_dev(c, layer, err);
    }
    CK(cudaEventRecord(c->ev[1], c->st), "recording an event");
    CK(cudaEventRecord(c->ev[2], c->st), "recording an event");
    for (int64_t it = 0; it < iters && !rc; it++) rc = attn_dev(c, layer, pos + 1, err); /* attention alone */
    CK(cudaEventRecord(c->ev[3], c->st), "recording an event");
    if (rc) return rc;
    CK(cudaEventSynchronize(c->ev[3]), "running the timed steps");
    float ms_step = 0, ms_attn = 0;
    CK(cudaEventElapsedTime(&ms_step, c->ev[0], c->ev[1]), "reading the timer");
    CK(cudaEventElapsedTime(&ms_attn, c->ev[2], c->ev[3]), "reading the timer");
    *us_step = 1e3 * (double)ms_step / (double)iters;
    *us_attn = 1e3 * (double)ms_attn / (double)iters;
    return KV_OK;
}

/* ---------------------------------------------------------------- entry */

/* The one exported symbol (KVRT_CUDA_ENTRY): the loader, cuda_load.c,
 * checks abi and the sizes against its own build before using the table. */
extern "C" __attribute__((visibility("default"))) const struct kvrt_cuda_api *kvrt_cuda_backend(void) {
    static const struct kvrt_cuda_api a = {
        KVRT_CUDA_ABI,          sizeof(struct kvrt_plan), sizeof(struct kvrt_lplan),
        sizeof(struct kvrt_device), sizeof(struct kv_err), cu_device_count,
        cu_device_query,        cu_open,                  cu_close,
        cu_append,              cu_attend,                cu_fill,
        cu_time,
    };
    return &a;
}
