/* The runtime's plan (internal to kernels/): everything a backend needs to
 * run one layer's decode step, built once by kvrt.c from a model and its
 * compressed attention, and read alike by the CPU twin (twin.c) and the
 * CUDA kernels (kvrt_cuda.cu). Plain C, no pointers into the model.
 *
 * One decode step of layer l at position pos (T = pos + 1 keys):
 *
 * 1. proj [rows] = wcat xn        one GEMV; wcat [rows, d] row-major stacks
 *                                 the query part (qrows), the key part
 *                                 (krows) and the value part (vrows)
 * 2. prep, per KV head j          adds bcat, RoPE, rotations; writes the
 *                                 query vector qv [qw_total] and the
 *                                 position's cache rows kc[pos], vc[pos]
 * 3. attention, per task (j, c)   the grp query heads of KV head j over the
 *                                 keys of sequence chunk c, in tiles of
 *                                 KVRT_TILE positions, online softmax;
 *                                 partial (m, l, acc[vw]) per head and chunk
 * 4. combine, per query head i    merges the chunks into att[ooff .. +vw]
 * 5. y [d] = wo att               one GEMV; wo [d, o_total] row-major
 *
 * Tables per KV head j (hk[j * KVRT_HK_N + field]):
 *   KCOL   first column of j's key source in a key cache row
 *   KSRC   width of that source (d_h, or the unit's rank for latents)
 *   KW     width of the vectors scored (d_h for full and prerope keys,
 *          the rank for fused_query and postrope_rotation)
 *   UPOFF  prerope: offset in up of j's [d_h, r] block (row e, column k at
 *          up[UPOFF + e * r + k]); else 0
 *   ROTOFF postrope: offset in rot of j's [r, d_h] matrix; else 0
 *   VCOL, VW  the same for values (full: j*d_h, d_h; fused_output: the
 *          unit's latent columns)
 *   KOWN, VOWN  1 when head j writes its unit's latent columns (the unit's
 *          first head; every head for full and postrope keys)
 *   KU, VU the index of head j's unit on a quantized side (which run of
 *          (scale, zero) pairs is its: kvrt_pair_at); else 0
 *   KPROJ, VPROJ  the first element of head j's latent (its unit's) in the
 *          latent rows of proj's key and value parts: KCOL / VCOL on an
 *          unquantized side, where those are element columns
 * lp->order lists the KV heads by descending KSRC + VW (the cache elements
 * one position costs them), ties by index.
 * Per query head i (hq[i * 2 + 0 / 1]): QOFF, the start of its query in qv
 * (i*d_h, or the running sum of KW for latent queries), and OOFF, the start
 * of its output in att (i*d_h, or the running sum of VW).
 * The query part of proj: qv's layout (fused_query) or h*d_h rows of W_q.
 * The key part: W_k (full, postrope) or the units' down rows at KCOL. The
 * value part: W_v (full) or the units' down rows at KPROJ / VPROJ (KCOL /
 * VCOL on an unquantized side; on a quantized side (below) KCOL / VCOL are
 * byte offsets into the code row, and the units' rows in proj are in unit
 * order at the sum of the ranks before them). */
#ifndef KVRT_PLAN_H
#define KVRT_PLAN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVRT_TILE 32   /* positions per tile of the attention loop */
#define KVRT_CHUNK_MIN 64
#define KVRT_CHUNK_MAX 1024
#define KVRT_NT 128    /* threads per block of the CUDA attention kernel */
/* Tasks a step aims at per multiprocessor: several blocks resident on
 * each, a few waves of them, so that loads stay in flight everywhere. */
#define KVRT_TASKS_PER_SM 8

enum { KVRT_HK_KCOL = 0, KVRT_HK_KSRC, KVRT_HK_KW, KVRT_HK_UPOFF, KVRT_HK_ROTOFF, KVRT_HK_VCOL,
       KVRT_HK_VW, KVRT_HK_KOWN, KVRT_HK_VOWN, KVRT_HK_KU, KVRT_HK_VU,
       KVRT_HK_KPROJ, KVRT_HK_VPROJ, KVRT_HK_N };
enum { KVRT_HQ_QOFF = 0, KVRT_HQ_OOFF, KVRT_HQ_N };

struct kvrt_lplan {
    int kmode, vmode;               /* enum kv_lr_mode */
    int64_t qrows, krows, vrows;    /* rows of wcat per part; rows = their sum */
    int64_t kld, vld;               /* cache row widths (floats or halves; bytes on a quantized side) */
    int kbits, vbits;               /* 16: the side caches f32/f16 (kvrt_plan.f16); 8, 4, 3, 2: codes */
    int64_t kunits, vunits;         /* units of a quantized side, each with a (scale, zero) per row */
    int64_t kbytes, vbytes;         /* logical cache bytes per position of each side */
    int64_t qw_total, o_total;      /* lengths of qv and att */
    int64_t kw_max, ksrc_max, vw_max;
    float *wcat, *bcat;             /* [rows, d], [rows] (zeros where no bias) */
    float *up;                      /* prerope factors (NULL otherwise) */
    int64_t up_len;
    float *rot;                     /* postrope rotations (NULL otherwise) */
    int64_t rot_len;
    float *wo;                      /* [d, o_total] */
    int32_t *hk;                    /* [g][KVRT_HK_N] */
    int32_t *hq;                    /* [h][KVRT_HQ_N] */
    int32_t *order;                 /* [g] KV heads, costliest first */
};

struct kvrt_plan {
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim, grp;
    int64_t max_ctx;
    int rope, rope_half;            /* rotary keys; pairs (i, i+d_h/2) instead of (2i, 2i+1) */
    float *rope_cos, *rope_sin;     /* [max_ctx][d_h/2] when rope */
    float scale;                    /* 1/sqrt(d_h) */
    int f16;                        /* caches hold fp16 */
    int sm_count;                   /* what the chunking aims at */
    int64_t max_chunks;             /* chunks per head any step may use */
    struct kvrt_lplan *layers;
};

#ifdef __CUDACC__
#define KVRT_HD __host__ __device__
#else
#define KVRT_HD
#endif

/* Low-bit latent caches (kv_bits 8, 4, 3 or 2; lr->info.kv_bits applies to
 * every latent side, never to a full one). Each unit's latent row z [r] is
 * quantized per position as lib/forward.c does it (the reference):
 *   lo, hi = min, max of z; zero = f16(lo); scale = f16((hi - zero) / qmax)
 *   with qmax = 2^bits - 1; code_i = clamp(rint((z_i - zero) / scale), 0,
 *   qmax) (0 when scale is 0); read back as code_i * scale + zero, the
 *   product rounded before the sum (no fused multiply-add).
 * A quantized side holds, per unit, the codes of each row as a
 * little-endian bit string (code i at bits [i*bits, (i+1)*bits) of the
 * row's bytes, ceil(r*bits/8) of them), unit-major: unit u's rows 0 ..
 * max_ctx-1 are contiguous, upitch = ceil(r*bits/8) rounded up to
 * KVRT_QALIGN bytes apart (kvrt_unit_pitch), from byte KCOL·max_ctx (VCOL
 * for values), KCOL being the sum of the units before it of upitch; so a
 * head's stream of consecutive rows reads whole sectors, however few bytes
 * a row of it has. kld / vld: the sum over units, rounded up to 16 bytes
 * (max_ctx·kld bytes hold the side). A second array holds per unit and row
 * the pair (scale, zero) as two fp16 numbers (scale in the low half of a
 * 32-bit word), unit-major too: the pairs of one unit (KU / VU) for rows 0
 * .. max_ctx-1 are contiguous (kvrt_pair_at). A group of 8 codes starting
 * at a multiple of 8 occupies exactly `bits` bytes at byte 8k*bits/8 =
 * k*bits of the unit. */
#define KVRT_QALIGN 8
static inline KVRT_HD unsigned kvrt_code_get(const uint8_t *u, int bits, int64_t i) {
    int64_t bit = i * bits;
    unsigned w = u[bit >> 3];
    if ((bit & 7) + bits > 8) w |= (unsigned)u[(bit >> 3) + 1] << 8;
    return (w >> (bit & 7)) & ((1u << bits) - 1u);
}
/* Sets code i (the caller cleared the unit's bytes first). */
static inline KVRT_HD void kvrt_code_put(uint8_t *u, int bits, int64_t i, unsigned q) {
    int64_t bit = i * bits;
    unsigned w = q << (bit & 7);
    u[bit >> 3] |= (uint8_t)(w & 0xffu);
    if ((bit & 7) + bits > 8) u[(bit >> 3) + 1] |= (uint8_t)(w >> 8);
}
static inline KVRT_HD int64_t kvrt_code_bytes(int64_t rank, int bits) {
    return (rank * bits + 7) / 8;
}
/* Bytes between two rows of a quantized unit of rank r, and the byte
 * where row `row` of the unit at column col (KCOL / VCOL) starts. */
static inline KVRT_HD int64_t kvrt_unit_pitch(int64_t rank, int bits) {
    return (kvrt_code_bytes(rank, bits) + KVRT_QALIGN - 1) / KVRT_QALIGN * KVRT_QALIGN;
}
static inline KVRT_HD int64_t kvrt_code_at(int64_t max_ctx, int64_t col, int64_t upitch, int64_t row) {
    return col * max_ctx + row * upitch;
}
/* Index of the (scale, zero) pair of unit `unit` at row `row`. */
static inline KVRT_HD int64_t kvrt_pair_at(int64_t max_ctx, int64_t unit, int64_t row) {
    return unit * max_ctx + row;
}

/* Parts each query-key dot product of a tile is split into: with fewer
 * than KVRT_NT (query head, position) pairs in a tile, the kernel gives
 * each pair KVRT_NT / pairs threads, thread r summing elements
 * [r·ceil(kw/P), (r+1)·ceil(kw/P)) in order; the parts are then added in
 * order, r = 0 first. The twin sums in the same order. */
static inline KVRT_HD int kvrt_score_parts(int64_t grp) {
    int64_t pairs = grp * KVRT_TILE;
    return pairs >= KVRT_NT ? 1 : (int)(KVRT_NT / pairs);
}

/* Sequence chunking for T positions: chunks of *len positions (a multiple
 * of KVRT_TILE in [KVRT_CHUNK_MIN, KVRT_CHUNK_MAX], about
 * KVRT_TASKS_PER_SM·sm_count tasks when T allows); returns the number of
 * chunks, of which *n_full have the full length (all but a shorter last).
 * Inline: the CUDA backend, a shared object of its own, chunks with the
 * same code. */
static inline int64_t kvrt_plan_chunks(const struct kvrt_plan *p, int64_t T, int64_t *len,
                                       int64_t *n_full) {
    int64_t target = KVRT_TASKS_PER_SM * (int64_t)p->sm_count;
    int64_t want = (T * p->n_kv_heads + target - 1) / target;
    int64_t l = (want + KVRT_TILE - 1) / KVRT_TILE * KVRT_TILE;
    l = l < KVRT_CHUNK_MIN ? KVRT_CHUNK_MIN : (l > KVRT_CHUNK_MAX ? KVRT_CHUNK_MAX : l);
    int64_t n = (T + l - 1) / l;
    *len = l;
    *n_full = T % l == 0 ? n : n - 1;
    return n;
}

/* Task t (0 .. g·n_chunks-1) of a step in launch order, longest first (FDC
 * §5.3 decode). A task is (KV head j, chunk c) and costs the positions of
 * its chunk (len for the n_full full chunks, rem for a shorter last one)
 * times KSRC + VW of head j (the cache elements one position costs it).
 * The order is by descending cost, ties in lp->order (which is by
 * descending KSRC + VW) and then by chunk: the merge of the full tasks
 * (head order[a / n_full], chunk a % n_full) and the partial ones (head
 * order[b], chunk n_full), found per task by a merge-path binary search
 * so that every block computes its own task. Blocks launched in this order
 * are dispatched by the GPU to whichever multiprocessor frees first: the
 * greedy longest-first assignment of the paper. */
static inline KVRT_HD int64_t kvrt_task_cost(const int32_t *hk, int64_t j, int64_t pos) {
    return pos * (int64_t)(hk[j * KVRT_HK_N + KVRT_HK_KSRC] + hk[j * KVRT_HK_N + KVRT_HK_VW]);
}
static inline KVRT_HD void kvrt_task(const int32_t *order, const int32_t *hk, int64_t g,
                                     int64_t n_full, int64_t len, int64_t rem, int64_t t,
                                     int64_t *j, int64_t *c) {
    int64_t nf = n_full * g, np = rem > 0 ? g : 0;
    int64_t lo = t - np > 0 ? t - np : 0, hi = t < nf ? t : nf;
    while (lo < hi) { /* full tasks among the first t: the first a with A[a] < B[t-a-1] */
        int64_t mid = (lo + hi) / 2, bi = t - mid - 1; /* in 0 .. np-1 by the bounds */
        if (bi < 0 || kvrt_task_cost(hk, order[mid / n_full], len) >= kvrt_task_cost(hk, order[bi], rem))
            lo = mid + 1;
        else
            hi = mid;
    }
    int64_t a = lo, b = t - lo;
    if (a < nf && (b >= np || kvrt_task_cost(hk, order[a / n_full], len) >=
                                  kvrt_task_cost(hk, order[b], rem))) {
        *j = order[a / n_full];
        *c = a % n_full;
    } else {
        *j = order[b];
        *c = n_full;
    }
}

/* Pseudo-random cache entry idx of a kvrt_fill (uniform in [-1, 1)), the
 * same on every backend: splitmix64 of seed + idx·golden, top 24 bits. */
static inline KVRT_HD uint64_t kvrt_mix64(uint64_t z) { /* splitmix64's finalizer */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline KVRT_HD float kvrt_fill_value(uint64_t seed, uint64_t idx) {
    uint64_t z = kvrt_mix64(seed + (idx + 1) * 0x9E3779B97F4A7C15ull);
    return (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

/* A kvrt_fill of a quantized side: code byte idx of its whole array
 * (max_ctx·kld bytes), and the (scale, zero) pair at index idx (every
 * unit's max_ctx pairs) as fp16 bits (scale in [2^-4, 2^-3), zero in (-2,
 * -1]), the same on every backend. */
static inline KVRT_HD uint8_t kvrt_fill_byte(uint64_t seed, uint64_t idx) {
    return (uint8_t)(kvrt_mix64(seed + (idx + 1) * 0x9E3779B97F4A7C15ull) >> 56);
}
static inline KVRT_HD void kvrt_fill_sz(uint64_t seed, uint64_t idx, uint16_t *scale, uint16_t *zero) {
    uint64_t z = kvrt_mix64(seed + (idx + 1) * 0xD1B54A32D192ED03ull);
    *scale = (uint16_t)(0x2C00u | (unsigned)(z & 0x3ffu));
    *zero = (uint16_t)(0xBC00u | (unsigned)((z >> 10) & 0x3ffu));
}

struct kv_err;
struct kvrt_device;
struct kvrt;

/* The plan a runtime runs (kvrt.c), for tests that check its layout. */
const struct kvrt_plan *kvrt_plan_of(const struct kvrt *rt);

/* Backends. Positions: append writes cache row pos of `layer` from the
 * attention input xn [d] (host memory) and keeps the query; attend scores
 * that query over rows 0..T-1 and writes y [d] (host memory). */
struct kvrt_twin;
int kvrt_twin_open(const struct kvrt_plan *p, struct kvrt_twin **out, struct kv_err *err);
void kvrt_twin_close(struct kvrt_twin *t);
void kvrt_twin_append(struct kvrt_twin *t, int64_t layer, int64_t pos, const float *xn);
void kvrt_twin_attend(struct kvrt_twin *t, int64_t layer, int64_t T, float *y);
void kvrt_twin_fill(struct kvrt_twin *t, int64_t layer, int64_t len, uint64_t seed);
/* Attention part alone (tasks + combine) of the last append's query. */
void kvrt_twin_attn_only(struct kvrt_twin *t, int64_t layer, int64_t T);

/* The CUDA backend lives in a shared object of its own (libkvrt_cuda.so,
 * built from kvrt_cuda.cu), loaded on the first call that needs it
 * (cuda_load.c): a program that never asks for cuda does not map the CUDA
 * libraries (some 200 MiB of resident memory and 0.4 s at start-up). The
 * object exports one symbol, KVRT_CUDA_ENTRY, a function returning this
 * table; abi and the struct sizes must match the loader's. */
#define KVRT_CUDA_ABI 3
#define KVRT_CUDA_ENTRY "kvrt_cuda_backend"
#define KVRT_CUDA_SO "libkvrt_cuda.so"
struct kvrt_cuda;
struct kvrt_cuda_api {
    int abi;
    size_t plan_size, lplan_size, device_size, err_size;
    int (*device_count)(int *count, struct kv_err *err);
    int (*device_query)(int dev, struct kvrt_device *out, struct kv_err *err);
    int (*open)(const struct kvrt_plan *p, int dev, struct kvrt_cuda **out, struct kv_err *err);
    void (*close)(struct kvrt_cuda *c);
    int (*append)(struct kvrt_cuda *c, int64_t layer, int64_t pos, const float *xn, struct kv_err *err);
    int (*attend)(struct kvrt_cuda *c, int64_t layer, int64_t T, float *y, struct kv_err *err);
    int (*fill)(struct kvrt_cuda *c, int64_t layer, int64_t len, uint64_t seed, struct kv_err *err);
    int (*time)(struct kvrt_cuda *c, int64_t layer, int64_t pos, int64_t iters, double *us_step,
                double *us_attn, struct kv_err *err);
};
typedef const struct kvrt_cuda_api *(*kvrt_cuda_entry_fn)(void);

/* The loader's forwarders (cuda_load.c): each loads the backend on first
 * use and fails with KV_EUNSUPPORTED (built without cuda) or KV_EDEVICE
 * (the object or the CUDA libraries cannot be loaded) when it cannot. */
int kvrt_cuda_device_count(int *count, struct kv_err *err);
int kvrt_cuda_device_query(int dev, struct kvrt_device *out, struct kv_err *err);
int kvrt_cuda_open(const struct kvrt_plan *p, int dev, struct kvrt_cuda **out, struct kv_err *err);
void kvrt_cuda_close(struct kvrt_cuda *c);
int kvrt_cuda_append(struct kvrt_cuda *c, int64_t layer, int64_t pos, const float *xn,
                     struct kv_err *err);
int kvrt_cuda_attend(struct kvrt_cuda *c, int64_t layer, int64_t T, float *y, struct kv_err *err);
int kvrt_cuda_fill(struct kvrt_cuda *c, int64_t layer, int64_t len, uint64_t seed,
                   struct kv_err *err);
int kvrt_cuda_time(struct kvrt_cuda *c, int64_t layer, int64_t pos, int64_t iters, double *us_step,
                   double *us_attn, struct kv_err *err);

#ifdef __cplusplus
}
#endif
#endif
