/* The fast attention kernels of the CUDA backend (included by
 * kvrt_cuda.cu, which holds the generic kernel they fall back to): decode
 * attention that streams the cache at the memory roofline, for fp16 caches
 * and for low-bit latents (kvrt_plan.h).
 *
 * Both kernels run the same tasks as the generic one (KV head j, sequence
 * chunk c, longest first: kvrt_task) and write the same partials (max,
 * sum, accumulator per query head), merged by combine_kernel. A task's
 * chunk streams through shared memory in tiles, NSTAGE deep: cp.async
 * copies keep two tiles in flight while the block computes on a third,
 * without holding registers. Inside a task the block is cut into groups of
 * consecutive threads (a power of two, enough that 8 elements a thread
 * cover a slice); each group takes its own positions of the tile, and
 * every thread keeps its 8 elements of the queries and of the value
 * accumulators in registers. Each value group keeps its own online
 * softmax; at the end the groups are merged in shared memory (the same
 * merge as combine_kernel's). Low-bit codes are read as exact floats
 * without conversion instructions (codef), and their (scale, zero) pairs
 * are applied once per position, not per element (dec8).
 *
 * mattn_kernel<NQ, KB, VB> (at the end of this file): keys scored as
 * stored (full, fused_query, postrope_rotation) on tensor cores, where its
 * widths apply; dattn_kernel otherwise.
 *
 * dattn_kernel<GRP, QB>: keys scored as stored (full, fused_query,
 * postrope_rotation), GRP query heads per KV head: keys and values each
 * with their own group width, so that a head with narrow keys and wide
 * values (or the reverse) keeps its threads busy (see the kernel).
 *
 * pattn_kernel<KSTEPS, NTW, GRP>: prerope_latent keys. The block rebuilds
 * the keys of 64 positions at a time on tensor cores, K = Z upᵀ with
 * mma.sync m16n8k16 (fp16 inputs, fp32 accumulation): Z is the latent
 * tile converted in shared memory (fp16 as cached, or the integer codes of
 * a low-bit cache, exact in fp16), up is held in registers as two fp16
 * parts (hi = fp16(up), lo = fp16(up - hi), two products each) so the
 * rebuilt keys carry up to about 2^-22 of its value, not fp16's 2^-11. For
 * codes, k = scale (codes upᵀ) + zero (Σ_k up). RoPE is applied to the
 * accumulator fragments in registers, with cos and sin at base + r from
 * the table's rows base and r (angle addition, about one ulp from the
 * table's own value), and the score of each position is summed from the
 * fragments, the four lanes of a quad and the four warps. Warp w owns
 * NTW of the d_h / 8 column tiles of 8, chosen so that both members of
 * every RoPE pair are in the same thread: tiles w·NTW .. for interleaved
 * pairs (2i, 2i+1), and tiles w·NTW/2 .. plus the same + d_h/16 for pairs
 * (i, i + d_h/2). The values go through the groups as in dattn_kernel. */

/* One side of the cache as the fast kernels read it: fp16 elements (bits
 * 16; ld and columns in elements) or codes (columns in bytes, unit-major
 * with szp rows per unit: kvrt_code_at, and the (scale, zero) pairs in sz:
 * kvrt_pair_at). */
struct dside {
    const void *c;
    const uint32_t *sz;
    int64_t ld, szp;
    int bits;
};

/* Code e (0..7) of a raw group of B-bit codes as an exact float, without
 * a conversion instruction: the code's bits under the exponent of 2^23,
 * less 2^23. */
template <int B>
static __device__ __forceinline__ float codef(uint4 r, int e) {
    unsigned u;
    if (B == 8)
        u = __byte_perm(e < 4 ? r.x : r.y, 0x4Bu, 0x4550u | (unsigned)(e & 3)); /* bytes: code, 0, 0, 0x4B */
    else
        u = ((r.x >> (e * B)) & ((1u << B) - 1u)) | 0x4B000000u; /* 8 codes of B <= 4 bits fit r.x */
    return __uint_as_float(u) - 8388608.0f;
}

/* The 8 elements of a raw group as floats: fp16 unpacked (B 16), or the
 * codes themselves; a code c reads back as c·scale + zero (kvrt_plan.h),
 * which the callers apply once per position instead of per element:
 * q·k = scale (q·c) + zero Σq, and Σ p v = Σ (p scale) c + Σ p zero. */
template <int B>
static __device__ __forceinline__ void dec8(uint4 r, float *o) {
    if constexpr (B == 16) {
        const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(h[i]);
            o[2 * i] = f.x, o[2 * i + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++) o[e] = codef<B>(r, e);
    }
}
/* dec8 for a width the block knows only at run time. */
static __device__ __forceinline__ void dec8r(int bits, uint4 r, float *o) {
    switch (bits) {
    case 8: dec8<8>(r, o); break;
    case 4: dec8<4>(r, o); break;
    case 3: dec8<3>(r, o); break;
    case 2: dec8<2>(r, o); break;
    default: dec8<16>(r, o); break;
    }
}
/* The pair (scale, zero) of a quantized row. */
static __device__ __forceinline__ float2 pair_of(uint32_t z) {
    return make_float2(__half2float(__ushort_as_half((unsigned short)(z & 0xffffu))),
                       __half2float(__ushort_as_half((unsigned short)(z >> 16))));
}

/* ---------------------------------------------------------------- staging */

/* Asynchronous copies from global to shared memory (cp.async, sm_80 and
 * later): the rows of the next tiles are in flight while the block
 * computes on the current one, without holding registers. */
static __device__ __forceinline__ void cp_async(void *s, const void *g, int bytes) {
#ifdef KVRT_EMULATE
    memcpy(s, g, (size_t)bytes);
#else
    unsigned sa = (unsigned)__cvta_generic_to_shared(s);
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g));
    else if (bytes == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(sa), "l"(g));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sa), "l"(g));
#endif
}
static __device__ __forceinline__ void cp_commit() {
#ifndef KVRT_EMULATE
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
static __device__ __forceinline__ void cp_wait() {
#ifndef KVRT_EMULATE
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

#define NSTAGE 3 /* tiles in shared memory: one computed on, two in flight */

/* A head's slice of one side as staged: per position `chunks` copies of
 * cb bytes (16 for fp16; 8 for codes, a row's codes rounded up to 8
 * bytes, which is its pitch in the unit) into a stage row of `pitch`
 * bytes, and the (scale, zero) pair of a quantized side (sz non-NULL). */
struct sslice {
    const uint8_t *g;
    int64_t ld;
    const uint32_t *sz; /* the unit's pair of row 0 (rows contiguous) */
    int cb, chunks, pitch;
};
static __host__ __device__ __forceinline__ int slice_pitch(int64_t w, int bits) {
    int64_t b = bits == 16 ? 2 * w : (kvrt_code_bytes(w, bits) + 7) / 8 * 8;
    return (int)((b + 15) / 16 * 16);
}
static __device__ __forceinline__ sslice slice_of(const dside &S, int64_t col, int64_t w, int64_t unit) {
    sslice x;
    if (S.bits == 16) {
        x.g = (const uint8_t *)S.c + col * 2, x.ld = S.ld * 2, x.cb = 16, x.chunks = (int)(w / 8), x.sz = NULL;
    } else {
        x.g = (const uint8_t *)S.c + kvrt_code_at(S.szp, col, 0, 0), x.ld = kvrt_unit_pitch(w, S.bits), x.cb = 8;
        x.chunks = (int)((kvrt_code_bytes(w, S.bits) + 7) / 8), x.sz = S.sz + kvrt_pair_at(S.szp, unit, 0);
    }
    x.pitch = slice_pitch(w, S.bits);
    return x;
}
/* Bytes of one stage of tp positions: A's rows, B's rows, their pairs. */
static __host__ __device__ __forceinline__ size_t stage_bytes(int tp, int pa, int pb) {
    return (size_t)tp * (size_t)(pa + pb + 8);
}
/* The copies of rows p0 .. p0+np-1 of one slice into s: copy x = row ·
 * chunks + k goes to thread x mod NT, each thread stepping its (row, k)
 * without a division per copy. */
static __device__ __forceinline__ void issue_side(uint8_t *s, const sslice &A, int64_t p0, int np) {
    const int total = np * A.chunks, dr = NT / A.chunks, dk = NT - dr * A.chunks;
    int r = (int)threadIdx.x / A.chunks, k = (int)threadIdx.x - r * A.chunks;
    const uint8_t *g = A.g + p0 * A.ld;
    for (int x = threadIdx.x; x < total; x += NT) {
        cp_async(s + r * A.pitch + k * A.cb, g + r * A.ld + k * A.cb, A.cb);
        r += dr, k += dk;
        if (k >= A.chunks) k -= A.chunks, r++;
    }
}
/* Issues the copies of rows p0 .. p0+np-1 of slices A and B into stage st
 * (tp rows per slice); the caller commits. */
static __device__ __forceinline__ void stage_issue(uint8_t *st, int tp, const sslice &A, const sslice &B,
                                                   int64_t p0, int np) {
    uint8_t *sa = st, *sb = sa + (size_t)tp * A.pitch, *za = sb + (size_t)tp * B.pitch, *zb = za + 4 * tp;
    issue_side(sa, A, p0, np);
    issue_side(sb, B, p0, np);
    if (A.sz)
        for (int r = threadIdx.x; r < np; r += NT) cp_async(za + 4 * r, A.sz + p0 + r, 4);
    if (B.sz)
        for (int r = threadIdx.x; r < np; r += NT) cp_async(zb + 4 * r, B.sz + p0 + r, 4);
}
/* Tile n (positions t0 + n·tp .., up to t1) into its stage of the ring,
 * when there is one, and the commit of its group either way (the waits
 * count groups, so every thread commits one per tile slot). */
static __device__ __forceinline__ void issue_tile(uint8_t *stages, size_t sbytes, int tp, const sslice &A,
                                                  const sslice &B, int64_t t0, int64_t t1, int n, int ntile) {
    if (n < ntile) {
        const int64_t p = t0 + (int64_t)n * tp;
        stage_issue(stages + (n % NSTAGE) * sbytes, tp, A, B, p, t1 - p < tp ? (int)(t1 - p) : tp);
    }
    cp_commit();
}
/* The raw bytes of group i (elements 8i .. 8i+7) of a staged row: 16
 * bytes of fp16, or `bits` bytes of codes. */
static __device__ __forceinline__ uint4 raw8s(const uint8_t *row, int bits, int i) {
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    if (bits == 16) return *reinterpret_cast<const uint4 *>(row + 16 * i);
    const uint8_t *p = row + i * bits;
    if (bits == 8) {
        uint2 v = *reinterpret_cast<const uint2 *>(p);
        r.x = v.x, r.y = v.y;
    } else if (bits == 4) {
        r.x = *reinterpret_cast<const unsigned int *>(p);
    } else if (bits == 2) {
        r.x = *reinterpret_cast<const unsigned short *>(p);
    } else {
        r.x = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16;
    }
    return r;
}

/* A task's end: ng states per query head in shared
 * memory (gm [ng][grp], gl [ng][grp], gacc [ng][grp][vw], from the start),
 * merged into the task's partial (the same merge as combine_kernel's). */
static __device__ void merge_partials(const struct dglob &G, int64_t j, int64_t c, int64_t vw, int ng, int64_t grp,
                                      float *pm, float *pl, float *pacc) {
    extern __shared__ float sm[];
    const float *gm = sm, *gl = gm + ng * grp, *gacc = gl + ng * grp;
    for (int64_t x = threadIdx.x; x < grp * vw; x += blockDim.x) {
        int64_t gi = x / vw, col = x - gi * vw;
        float M = -INFINITY;
        for (int g = 0; g < ng; g++) M = fmaxf(M, gm[g * grp + gi]);
        float Ls = 0.0f, A = 0.0f;
        for (int g = 0; g < ng; g++) {
            float w = expf(gm[g * grp + gi] - M); /* 0 for a group that saw no position */
            Ls += w * gl[g * grp + gi];
            A += w * gacc[((int64_t)g * grp + gi) * vw + col];
        }
        int64_t at = (j * grp + gi) * G.max_chunks + c;
        pacc[at * G.vw_stride + col] = A;
        if (col == 0) pm[at] = M, pl[at] = Ls;
    }
}

/* The end of a fast task: once the copies are done, each group's (m, l,
 * acc) goes to shared memory (gm [ng][GRP], gl [ng][GRP], gacc [ng][GRP][vw],
 * over the stages), and they are merged per query head into the task's
 * partial. Group gid's lane li holds acc's columns 8li .. 8li+7 (von). */
template <int GRP>
static __device__ void merge_groups(const struct dglob &G, int64_t j, int64_t c, int64_t vw, int ng,
                                    int gid, int li, bool von, const float (&m)[GRP], const float (&l)[GRP],
                                    const float (&acc)[GRP][8], float *pm, float *pl, float *pacc) {
    extern __shared__ float sm[];
    const int64_t grp = GRP;
    cp_wait<0>();
    __syncthreads(); /* the stages and the rest are free */
    float *gm = sm, *gl = gm + ng * GRP, *gacc = gl + ng * GRP;
    if (li == 0)
        for (int gi = 0; gi < GRP; gi++) gm[gid * GRP + gi] = m[gi], gl[gid * GRP + gi] = l[gi];
    if (von)
        for (int gi = 0; gi < GRP; gi++)
            for (int e = 0; e < 8; e++) gacc[((int64_t)gid * GRP + gi) * vw + 8 * li + e] = acc[gi][e];
    __syncthreads();
    merge_partials(G, j, c, vw, ng, grp, pm, pl, pacc);
}


/* Folds nu scored positions s[u][gi] (-inf where absent) and their values
 * into a group's softmax state; every lane of the group holds the same
 * scores and its own 8 value columns vf[u] (with Q, codes, whose pairs
 * vz[u] go to the zero sum z: acc + z is the accumulator). */
template <int GMAX, int UMAX, bool Q>
static __device__ __forceinline__ void fold(int grp, int nu, float (&s)[UMAX][GMAX], float (&m)[GMAX],
                                            float (&l)[GMAX], float (&acc)[GMAX][8], float (&z)[GMAX],
                                            const float (&vf)[UMAX][8], const float2 (&vz)[UMAX]) {
#pragma unroll
    for (int gi = 0; gi < GMAX; gi++) {
        if (gi < grp) {
            float mt = -INFINITY;
#pragma unroll
            for (int u = 0; u < UMAX; u++) mt = fmaxf(mt, u < nu ? s[u][gi] : -INFINITY);
            const float mn = fmaxf(m[gi], mt), al = expf(m[gi] - mn);
            float sum = 0.0f, p[UMAX];
#pragma unroll
            for (int u = 0; u < UMAX; u++) {
                p[u] = u < nu ? expf(s[u][gi] - mn) : 0.0f;
                sum += p[u];
            }
            l[gi] = l[gi] * al + sum;
            m[gi] = mn;
            if (Q) {
                float zs = z[gi] * al;
#pragma unroll
                for (int u = 0; u < UMAX; u++) zs += p[u] * vz[u].y, p[u] *= vz[u].x;
                z[gi] = zs;
            }
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float a = acc[gi][e] * al;
#pragma unroll
                for (int u = 0; u < UMAX; u++) a += p[u] * vf[u][e];
                acc[gi][e] = a;
            }
        }
    }
}

/* ---------------------------------------------------------------- keys as stored */

/* Lanes a position of a slice w wide takes: 8 elements a lane, a power of
 * two (at most 32 for w <= 256). */
static __host__ __device__ __forceinline__ int fast_lanes(int64_t w) {
    int g = 1;
    while (8 * g < w) g *= 2;
    return g;
}

/* Positions per tile of dattn_kernel for a head whose keys take gk lanes
 * a position and its values gv, staged rows of pa + pb bytes: 4 positions
 * a group on the narrower side, halved while a stage exceeds cap bytes,
 * down to 4 positions a group on the wider side and at least one on the
 * narrower. Every warp scores and folds the same tp/4 positions. */
static __host__ __device__ __forceinline__ int dattn_tile(int gk, int gv, int pa, int pb, int cap) {
    const int gmin = gk < gv ? gk : gv, gmax = gk < gv ? gv : gk;
    const int lo = NT * 4 / gmax > NT / gmin ? NT * 4 / gmax : NT / gmin;
    int tp = NT * 4 / gmin;
    while (tp > lo && stage_bytes(tp, pa, pb) > (size_t)cap) tp /= 2;
    return tp;
}

/* The sums over a group's n lanes (a power of two; lane li) of the four
 * partial scores a[u] of positions r0 + u, each scaled by mul, stored to
 * out[r0 + u] for u < lim: with n >= 4 each lane ends with one whole sum
 * after log2(n) + 1 exchanges (not 4 log2(n)): the two halves of the group
 * swap two of the four, the quarters one of the two, then a butterfly. */
static __device__ __forceinline__ void sum_store4(const float (&a)[4], int n, int li, float *out, int r0, int lim,
                                                  float mul) {
    if (n >= 4) {
        const int o1 = n >> 1, o2 = n >> 2;
        const bool h1 = li & o1, h2 = li & o2;
        float k0 = h1 ? a[2] : a[0], k1 = h1 ? a[3] : a[1];
        k0 += __shfl_xor_sync(0xffffffffu, h1 ? a[0] : a[2], o1);
        k1 += __shfl_xor_sync(0xffffffffu, h1 ? a[1] : a[3], o1);
        float t = (h2 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, h2 ? k0 : k1, o2);
        for (int o = o2 >> 1; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        const int u = (h1 ? 2 : 0) + (h2 ? 1 : 0);
        if ((li & (o2 - 1)) == 0 && u < lim) out[r0 + u] = t * mul;
    } else if (n == 2) {
        const bool h1 = li & 1;
        const float k0 = (h1 ? a[2] : a[0]) + __shfl_xor_sync(0xffffffffu, h1 ? a[0] : a[2], 1);
        const float k1 = (h1 ? a[3] : a[1]) + __shfl_xor_sync(0xffffffffu, h1 ? a[1] : a[3], 1);
        const int u = h1 ? 2 : 0;
        if (u < lim) out[r0 + u] = k0 * mul;
        if (u + 1 < lim) out[r0 + u + 1] = k1 * mul;
    } else {
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (u < lim) out[r0 + u] = a[u] * mul;
    }
}

/* positions a value group folds at once (fewer with more query heads,
 * whose accumulators take the registers) */
#define DVB (GRP >= 4 ? 2 : 4)

/* dattn_kernel<GRP, QB>: keys scored as stored, GRP query heads per KV
 * head, QB the width of a quantized side's codes (16: none quantized).
 * Each tile goes through two phases, each with its own lanes per position,
 * so that a head whose key and value slices differ in width keeps its
 * lanes busy in both: keys, gk = fast_lanes(kw) lanes a position, 4
 * positions at a time, the scores summed by sum_store4 into shared memory;
 * then values, gv lanes a position, each group with its own softmax. A
 * warp's two phases cover the same positions (dattn_tile), so a warp
 * barrier separates them. */
template <int GRP, int QB>
__global__ void __launch_bounds__(NT, GRP >= 2 ? 3 : 4) dattn_kernel(struct dlayer L, struct dglob G, dside KS, dside VS,
                                                   int64_t T, int64_t len, int64_t n_full, int64_t rem, int cap,
                                                   float *pm, float *pl, float *pacc) {
    extern __shared__ float sm[];
    int64_t j, c;
    kvrt_task(L.order, L.hk, G.g, n_full, len, rem, blockIdx.x, &j, &c);
    const int32_t *hk = L.hk + j * KVRT_HK_N;
    const int64_t kw = hk[KVRT_HK_KW], vw = hk[KVRT_HK_VW];
    const bool kq = QB != 16 && KS.bits != 16, vq = QB != 16 && VS.bits != 16;
    const sslice A = slice_of(KS, hk[KVRT_HK_KCOL], kw, hk[KVRT_HK_KU]);
    const sslice B = slice_of(VS, hk[KVRT_HK_VCOL], vw, hk[KVRT_HK_VU]);
    const int gk = fast_lanes(kw), gv = fast_lanes(vw), tp = dattn_tile(gk, gv, A.pitch, B.pitch, cap);
    const int tid = threadIdx.x, kg = tid / gk, kl = tid - kg * gk, dk = tp * gk / NT;
    const int vg = tid / gv, vl = tid - vg * gv, dv = tp * gv / NT;
    const bool kon = 8 * kl < kw, von = 8 * vl < vw;
    const size_t sbytes = stage_bytes(tp, A.pitch, B.pitch);
    uint8_t *stages = reinterpret_cast<uint8_t *>(sm);
    float *ssc = reinterpret_cast<float *>(stages + NSTAGE * sbytes); /* scores [GRP][tp] */
    float q[GRP][8], qs[GRP], acc[GRP][8], z[GRP], m[GRP], l[GRP];
#pragma unroll
    for (int gi = 0; gi < GRP; gi++) {
        const float *qi = L.qv + L.hq[(j * GRP + gi) * KVRT_HQ_N + KVRT_HQ_QOFF];
        qs[gi] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) q[gi][e] = kon ? qi[8 * kl + e] : 0.0f, qs[gi] += q[gi][e], acc[gi][e] = 0.0f;
        m[gi] = -INFINITY, l[gi] = 0.0f, z[gi] = 0.0f;
    }
    const int64_t t0 = c * len, t1 = t0 + len < T ? t0 + len : T;
    const int ntile = (int)((t1 - t0 + tp - 1) / tp);
    for (int st = 0; st < NSTAGE - 1; st++) issue_tile(stages, sbytes, tp, A, B, t0, t1, st, ntile); /* in flight */
    for (int it = 0; it < ntile; it++) {
        cp_wait<NSTAGE - 2>(); /* tile it has landed (this thread's copies) */
        __syncthreads();       /* everyone's copies; everyone is done with tile it-1 */
        issue_tile(stages, sbytes, tp, A, B, t0, t1, it + NSTAGE - 1, ntile);
        const uint8_t *st = stages + (it % NSTAGE) * sbytes;
        const uint8_t *ra = st, *rb = st + (size_t)tp * A.pitch;
        const uint32_t *za = reinterpret_cast<const uint32_t *>(rb + (size_t)tp * B.pitch), *zb = za + tp;
        const int64_t pt = t0 + (int64_t)it * tp;
        const int npt = t1 - pt < tp ? (int)(t1 - pt) : tp;
        /* keys: group kg scores positions kg·dk .. kg·dk + dk - 1 */
        for (int u0 = 0; u0 < dk; u0 += 4) {
            const int r0 = kg * dk + u0;
            int lim = dk - u0 < 4 ? dk - u0 : 4;
            lim = npt - r0 < lim ? npt - r0 : lim;
            float a[GRP][4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                float kf[8];
                uint4 kr = make_uint4(0u, 0u, 0u, 0u);
                const bool in = u < lim && kon;
                float2 kz = make_float2(1.0f, 0.0f);
                if (kq) {
                    if (in) kr = raw8s(ra + (size_t)(r0 + u) * A.pitch, QB, kl), kz = pair_of(za[r0 + u]);
                    dec8<QB>(kr, kf);
                } else {
                    if (in) kr = raw8s(ra + (size_t)(r0 + u) * A.pitch, 16, kl);
                    dec8<16>(kr, kf);
                }
#pragma unroll
                for (int gi = 0; gi < GRP; gi++) {
                    float d = 0.0f;
#pragma unroll
                    for (int e = 0; e < 8; e++) d += q[gi][e] * kf[e];
                    a[gi][u] = kq ? kz.x * d + kz.y * qs[gi] : d;
                }
            }
#pragma unroll
            for (int gi = 0; gi < GRP; gi++) sum_store4(a[gi], gk, kl, ssc + gi * tp, r0, lim, G.scale);
        }
        __syncwarp(); /* this warp's scores (its positions in both phases) */
        /* values: group vg folds positions vg·dv .. vg·dv + dv - 1 */
        for (int u0 = 0; u0 < dv; u0 += DVB) {
            const int r0 = vg * dv + u0;
            int nu = dv - u0 < DVB ? dv - u0 : DVB;
            nu = npt - r0 < nu ? npt - r0 : nu;
            if (nu <= 0) break;
            float s[DVB][GRP], vf[DVB][8];
            float2 vz[DVB];
#pragma unroll
            for (int u = 0; u < DVB; u++) {
                uint4 vr = make_uint4(0u, 0u, 0u, 0u);
                const bool in = u < nu;
                vz[u] = make_float2(1.0f, 0.0f);
                if (vq) {
                    if (in && von) vr = raw8s(rb + (size_t)(r0 + u) * B.pitch, QB, vl);
                    if (in) vz[u] = pair_of(zb[r0 + u]);
                    dec8<QB>(vr, vf[u]);
                } else {
                    if (in && von) vr = raw8s(rb + (size_t)(r0 + u) * B.pitch, 16, vl);
                    dec8<16>(vr, vf[u]);
                }
#pragma unroll
                for (int gi = 0; gi < GRP; gi++) s[u][gi] = in ? ssc[gi * tp + r0 + u] : -INFINITY;
            }
            if (vq)
                fold<GRP, DVB, true>(GRP, nu, s, m, l, acc, z, vf, vz);
            else
                fold<GRP, DVB, false>(GRP, nu, s, m, l, acc, z, vf, vz);
        }
    }
#pragma unroll
    for (int gi = 0; gi < GRP; gi++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[gi][e] += z[gi];
    merge_groups<GRP>(G, j, c, vw, NT / gv, vg, vl, von, m, l, acc, pm, pl, pacc);
}

/* Shared memory of dattn_kernel for one head: its stages and scores, or the
 * merge area, whichever is larger. */
static size_t dattn_smem(int grp, int64_t kw, int kbits, int64_t vw, int vbits, int cap) {
    const int gk = fast_lanes(kw), gv = fast_lanes(vw), pa = slice_pitch(kw, kbits), pb = slice_pitch(vw, vbits);
    const int tp = dattn_tile(gk, gv, pa, pb, cap);
    size_t st = NSTAGE * stage_bytes(tp, pa, pb) + (size_t)grp * (size_t)tp * sizeof(float);
    size_t merge = (size_t)(NT / gv) * (size_t)grp * (size_t)(2 + vw) * sizeof(float);
    return st > merge ? st : merge;
}

/* ---------------------------------------------------------------- prerope keys on tensor cores */

#define PI 64   /* positions per round of the prerope kernel (4 m-tiles of 16) */
#define PUMAX 8 /* positions a group takes per round: PI / (NT / gs), gs 2 .. 16 */

static __device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1) {
#ifdef KVRT_EMULATE /* a host emulation of the warp's matrix product */
    kvrt_emulate_mma(d, a0, a1, a2, a3, b0, b1);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

static __device__ __forceinline__ uint32_t pack2(__half lo, __half hi) {
    return (uint32_t)__half_as_ushort(lo) | (uint32_t)__half_as_ushort(hi) << 16;
}

/* Column tile a (0 .. NTW-1) of warp w (the header's ownership). */
template <int NTW>
static __device__ __forceinline__ int ptile(int w, int a, int rope_half, int dh) {
    if (!rope_half) return w * NTW + a;
    return a < NTW / 2 ? w * (NTW / 2) + a : w * (NTW / 2) + (a - NTW / 2) + dh / 16;
}

template <int KSTEPS, int NTW, int GRP>
__global__ void __launch_bounds__(NT, 2) pattn_kernel(struct dlayer L, struct dglob G, dside KS, dside VS,
                                                   int gs, int64_t T, int64_t len, int64_t n_full,
                                                   int64_t rem, float *pm, float *pl, float *pacc) {
    constexpr int KSZ = KSTEPS * 16, ZP = KSZ + 8; /* latent width; staged row pitch in halves */
    extern __shared__ float sm[];
    int64_t j, c;
    kvrt_task(L.order, L.hk, G.g, n_full, len, rem, blockIdx.x, &j, &c);
    const int32_t *hk = L.hk + j * KVRT_HK_N;
    const int64_t vw = hk[KVRT_HK_VW];
    const int grp = GRP, dh = (int)G.dh, half = dh / 2;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, qg = lane >> 2, qt = lane & 3;
    const int ng = NT / gs, gid = tid / gs, li = tid - gid * gs, nu_max = PI / ng;
    const bool von = 8 * li < vw, quant = KS.bits != 16, vq = VS.bits != 16;
    /* shared: q [grp][dh] | zsc, zze [PI] | spart [4][grp][PI] | zt [PI][ZP] halves | NSTAGE stages */
    float *qs = sm, *zsc = qs + grp * dh, *zze = zsc + PI, *spart = zze + PI;
    __half *zt = reinterpret_cast<__half *>(spart + 4 * grp * PI);
    uint8_t *stages = reinterpret_cast<uint8_t *>(zt + PI * ZP);
    const sslice A = slice_of(KS, hk[KVRT_HK_KCOL], KSZ, hk[KVRT_HK_KU]);
    const sslice B = slice_of(VS, hk[KVRT_HK_VCOL], vw, hk[KVRT_HK_VU]);
    const size_t sbytes = stage_bytes(PI, A.pitch, B.pitch);
    for (int x = tid; x < grp * dh; x += NT)
        qs[x] = L.qv[L.hq[(j * grp + x / dh) * KVRT_HQ_N + KVRT_HQ_QOFF] + x % dh];
    /* up in registers: B fragments (k = 16 kk + 2 qt (+1, +8, +9), n = 8 tile + qg), hi and lo */
    const float *up = L.up + hk[KVRT_HK_UPOFF];
    uint32_t bh[NTW][KSTEPS][2], bl[NTW][KSTEPS][2];
    float usum[NTW][2];
#pragma unroll
    for (int a = 0; a < NTW; a++) {
        const int n = ptile<NTW>(warp, a, G.rope_half, dh) * 8 + qg;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int k = kk * 16 + 2 * qt + 8 * r;
                float u0 = up[n * KSZ + k], u1 = up[n * KSZ + k + 1];
                __half h0 = __float2half_rn(u0), h1 = __float2half_rn(u1);
                bh[a][kk][r] = pack2(h0, h1);
                bl[a][kk][r] = pack2(__float2half_rn(u0 - __half2float(h0)), __float2half_rn(u1 - __half2float(h1)));
            }
        /* Σ_k up over the two columns this thread's accumulators hold */
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = ptile<NTW>(warp, a, G.rope_half, dh) * 8 + 2 * qt + e;
            float s = 0.0f;
            if (quant)
                for (int k = 0; k < KSZ; k++) s += up[col * KSZ + k];
            usum[a][e] = s;
        }
    }
    float acc[GRP][8], z[GRP], m[GRP], l[GRP];
#pragma unroll
    for (int gi = 0; gi < GRP; gi++) {
        m[gi] = -INFINITY, l[gi] = 0.0f, z[gi] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[gi][e] = 0.0f;
    }
    const int64_t t0 = c * len, t1 = t0 + len < T ? t0 + len : T;
    const int ntile = (int)((t1 - t0 + PI - 1) / PI);
    for (int st = 0; st < NSTAGE - 1; st++) issue_tile(stages, sbytes, PI, A, B, t0, t1, st, ntile); /* in flight */
    for (int it = 0; it < ntile; it++) {
        const int64_t base = t0 + (int64_t)it * PI;
        const int np = t1 - base < PI ? (int)(t1 - base) : PI;
        cp_wait<NSTAGE - 2>(); /* round it has landed (this thread's copies) */
        __syncthreads();       /* everyone's copies; everyone is done with round it-1 */
        issue_tile(stages, sbytes, PI, A, B, t0, t1, it + NSTAGE - 1, ntile);
        const uint8_t *ra = stages + (it % NSTAGE) * sbytes, *rb = ra + (size_t)PI * A.pitch;
        const uint32_t *za = reinterpret_cast<const uint32_t *>(rb + (size_t)PI * B.pitch), *zb = za + PI;
        const int r0g = gid * nu_max;
        const int nu = np - r0g <= 0 ? 0 : (np - r0g < nu_max ? np - r0g : nu_max);
        /* 1. the latents as fp16 (codes as their integer values) with a
         * padded pitch for the fragments' loads, zeros past np */
        for (int x = tid; x < PI * (KSZ / 8); x += NT) {
            const int row = x / (KSZ / 8), part = x - row * (KSZ / 8);
            uint4 h = make_uint4(0u, 0u, 0u, 0u);
            if (row < np) {
                const uint4 r = raw8s(ra + (size_t)row * A.pitch, KS.bits, part);
                h = r;
                if (quant) { /* codes up to 255: exact in fp16 */
                    float v[8];
                    dec8r(KS.bits, r, v);
                    h.x = pack2(__float2half_rn(v[0]), __float2half_rn(v[1]));
                    h.y = pack2(__float2half_rn(v[2]), __float2half_rn(v[3]));
                    h.z = pack2(__float2half_rn(v[4]), __float2half_rn(v[5]));
                    h.w = pack2(__float2half_rn(v[6]), __float2half_rn(v[7]));
                }
            }
            *reinterpret_cast<uint4 *>(zt + row * ZP + part * 8) = h;
        }
        if (quant)
            for (int row = tid; row < PI; row += NT) {
                const uint32_t z = row < np ? za[row] : 0u;
                zsc[row] = __half2float(__ushort_as_half((unsigned short)(z & 0xffffu)));
                zze[row] = __half2float(__ushort_as_half((unsigned short)(z >> 16)));
            }
        __syncthreads();
        /* 3. keys on tensor cores, RoPE, partial scores of this warp's columns.
         * Pair p (0 .. NTW-1) of this thread in a row: interleaved, the
         * slots C[p][0..1] (pair index 4·tile + qt); halves, the slots
         * C[p/2][p%2] and C[p/2 + NTW/2][p%2] (pair index its column). */
        float cb[NTW], sb[NTW]; /* cos and sin of each pair at the round's first position */
        int pidx[NTW];
#pragma unroll
        for (int p = 0; p < NTW; p++) {
            pidx[p] = G.rope_half ? ptile<NTW>(warp, p >> 1, 1, dh) * 8 + 2 * qt + (p & 1)
                                  : ptile<NTW>(warp, p, 0, dh) * 4 + qt;
            cb[p] = G.rope ? __ldg(G.cos_t + base * half + pidx[p]) : 1.0f;
            sb[p] = G.rope ? __ldg(G.sin_t + base * half + pidx[p]) : 0.0f;
        }
#pragma unroll 1
        for (int mt = 0; mt < PI / 16; mt++) {
            float C[NTW][4];
#pragma unroll
            for (int a = 0; a < NTW; a++) C[a][0] = C[a][1] = C[a][2] = C[a][3] = 0.0f;
            const int r0 = mt * 16 + qg;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk++) {
                const int c0 = kk * 16 + 2 * qt;
                uint32_t a0 = *reinterpret_cast<const uint32_t *>(zt + r0 * ZP + c0);
                uint32_t a1 = *reinterpret_cast<const uint32_t *>(zt + (r0 + 8) * ZP + c0);
                uint32_t a2 = *reinterpret_cast<const uint32_t *>(zt + r0 * ZP + c0 + 8);
                uint32_t a3 = *reinterpret_cast<const uint32_t *>(zt + (r0 + 8) * ZP + c0 + 8);
#pragma unroll
                for (int a = 0; a < NTW; a++) {
                    mma16816(C[a], a0, a1, a2, a3, bh[a][kk][0], bh[a][kk][1]);
                    mma16816(C[a], a0, a1, a2, a3, bl[a][kk][0], bl[a][kk][1]);
                }
            }
            /* rows r0 (C[a][0..1]) and r0 + 8 (C[a][2..3]) */
#pragma unroll
            for (int h2 = 0; h2 < 2; h2++) {
                const int r = r0 + 8 * h2;
                if (quant) {
                    const float sc = zsc[r], ze = zze[r];
#pragma unroll
                    for (int a = 0; a < NTW; a++)
#pragma unroll
                        for (int e = 0; e < 2; e++) C[a][2 * h2 + e] = C[a][2 * h2 + e] * sc + ze * usum[a][e];
                }
                if (G.rope && r < np) {
#pragma unroll
                    for (int p = 0; p < NTW; p++) { /* cos, sin at base + r by angle addition */
                        const float cd = __ldg(G.cos_t + r * half + pidx[p]), sd = __ldg(G.sin_t + r * half + pidx[p]);
                        const float cs = cb[p] * cd - sb[p] * sd, sn = sb[p] * cd + cb[p] * sd;
                        if (G.rope_half) {
                            const int a = p >> 1, e = p & 1;
                            const float v0 = C[a][2 * h2 + e], v1 = C[a + NTW / 2][2 * h2 + e];
                            C[a][2 * h2 + e] = v0 * cs - v1 * sn;
                            C[a + NTW / 2][2 * h2 + e] = v0 * sn + v1 * cs;
                        } else {
                            const float v0 = C[p][2 * h2], v1 = C[p][2 * h2 + 1];
                            C[p][2 * h2] = v0 * cs - v1 * sn;
                            C[p][2 * h2 + 1] = v0 * sn + v1 * cs;
                        }
                    }
                }
                for (int gi = 0; gi < grp; gi++) {
                    const float *qh = qs + gi * dh;
                    float s = 0.0f;
#pragma unroll
                    for (int a = 0; a < NTW; a++) {
                        const int col = ptile<NTW>(warp, a, G.rope_half, dh) * 8 + 2 * qt;
                        s += qh[col] * C[a][2 * h2] + qh[col + 1] * C[a][2 * h2 + 1];
                    }
                    s += __shfl_xor_sync(0xffffffffu, s, 1);
                    s += __shfl_xor_sync(0xffffffffu, s, 2);
                    if (qt == 0) spart[(warp * grp + gi) * PI + r] = s;
                }
            }
        }
        __syncthreads();
        /* 4. each group: its positions' scores, softmax, values */
        float s[PUMAX][GRP], vf[PUMAX][8];
        float2 vz[PUMAX];
#pragma unroll
        for (int u = 0; u < PUMAX; u++) {
            const int r = r0g + u;
            uint4 vr = make_uint4(0u, 0u, 0u, 0u);
            if (u < nu && von) vr = raw8s(rb + (size_t)r * B.pitch, VS.bits, li);
            vz[u] = vq && u < nu ? pair_of(zb[r]) : make_float2(1.0f, 0.0f);
            dec8r(VS.bits, vr, vf[u]);
#pragma unroll
            for (int gi = 0; gi < GRP; gi++) {
                float a = -INFINITY;
                if (u < nu && gi < grp)
                    a = (((spart[(0 * grp + gi) * PI + r] + spart[(1 * grp + gi) * PI + r]) +
                          spart[(2 * grp + gi) * PI + r]) + spart[(3 * grp + gi) * PI + r]) * G.scale;
                s[u][gi] = a;
            }
        }
        if (nu > 0 && vq)
            fold<GRP, PUMAX, true>(grp, nu, s, m, l, acc, z, vf, vz);
        else if (nu > 0)
            fold<GRP, PUMAX, false>(grp, nu, s, m, l, acc, z, vf, vz);
    }
#pragma unroll
    for (int gi = 0; gi < GRP; gi++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[gi][e] += z[gi];
    merge_groups<GRP>(G, j, c, vw, ng, gid, li, von, m, l, acc, pm, pl, pacc); /* over q and the stages too */
}

static size_t pattn_smem(int grp, int dh, int ksz, int kbits, int gs, int64_t vw_max, int vbits) {
    size_t main = (size_t)(grp * dh + 2 * PI + 4 * grp * PI) * sizeof(float) + (size_t)PI * (size_t)(ksz + 8) * 2 +
                  NSTAGE * stage_bytes(PI, slice_pitch(ksz, kbits), slice_pitch(vw_max, vbits));
    size_t merge = (size_t)(NT / gs) * (size_t)grp * (size_t)(2 + vw_max) * sizeof(float);
    return main > merge ? main : merge;
}

/* ---------------------------------------------------------------- keys as stored, on tensor cores */

/* mattn_kernel<NQ, KB, VB>: the keys-as-stored modes (full, fused_query,
 * postrope_rotation) with both products on tensor cores, mma.sync
 * m16n8k16, fp16 inputs and fp32 accumulation, for up to 4·NQ query heads
 * per KV head, keys and values each fp16 (16) or codes of 8 or 4 bits.
 * Each warp takes 16 positions of the tile at a time:
 *  - scores: A = the 16 key rows (fp16 as cached, or the integer codes,
 *    exact in fp16), B = the queries, column 2h query head h's hi part and
 *    2h + 1 its lo part (q·2^e = hi + lo, e per head so that the largest
 *    element is below 2^14, which keeps both parts normal): the sum of the
 *    two columns carries about 2^-22 of q, not fp16's 2^-11. The lane
 *    (g, t) of a quad ends with the scores of positions g and g + 8 for
 *    query head t (4·n + t in n-tile n); a code's (scale, zero) applies
 *    to the score as scale (q·c) + zero Σq.
 *  - softmax: each lane its head's online state; the maximum over the
 *    warp's 16 positions takes three exchanges.
 *  - values: A = the value rows transposed (rows value columns, k the 16
 *    positions), B = the probabilities split as hi + lo the same way
 *    (times the value code's scale; its zero goes to a running sum), moved
 *    from the score layout to B's by four exchanges.
 * A lane's k slots are a permutation of the key columns chosen so that
 * its loads are whole and its codes decode with a mask (mslot_col); the
 * query fragments follow the same permutation, so the dot product is
 * unchanged. The value columns a lane accumulates are likewise its own
 * contiguous slice (mval_col). At the end the warps' states merge as in
 * the other kernels. Rows past the chunk's end are cleared in their
 * stage, so that a zero probability never meets a stale NaN. */
#define MW (NT / 32) /* warps */
/* Tiles in shared memory: one computed on, one in flight. On an H100 at
 * 64K positions two stages beat three (full KV 415.9 against 433.7 µs,
 * GQA 163.3 against 174.0, 4-bit postrope 188.2 against 188.9): a task's
 * stages take less shared memory, so more blocks share a multiprocessor. */
#ifndef MSTAGE
#define MSTAGE 2
#endif
#define MKS 8        /* k-steps of 16 key columns at most: kw <= 128 */
#define MVT 8        /* m-tiles of 16 value columns at most: vw <= 128 */

/* The key column of slot s (0 .. 15) of k-step kk: a lane t holds slots
 * 2t, 2t+1 (its first register) and 2t+8, 2t+9 (its second), columns
 * 4t .. 4t+3 of the step: in order for fp16 (one 8-byte load), as
 * (4t, 4t+2), (4t+1, 4t+3) for codes (one mask each). */
template <int B>
static __host__ __device__ __forceinline__ int mslot_col(int kk, int s) {
    const int t = (s & 7) >> 1, e = s & 1, hi = s >> 3;
    return 16 * kk + 4 * t + (B == 16 ? 2 * hi + e : hi + 2 * e);
}
/* The value column of row slot r (0 .. 15) of m-tile mt for lane group g
 * (r = g or g + 8) in a head of nvt m-tiles: lane group g owns columns
 * 2·nvt·g .. 2·nvt·(g+1) - 1, two per m-tile. */
static __host__ __device__ __forceinline__ int mval_col(int nvt, int mt, int r) {
    return 2 * (nvt * (r & 7) + mt) + (r >> 3);
}

/* fp16 pairs (1024 + c) less 1024: the codes as exact fp16 numbers. */
static __device__ __forceinline__ uint32_t hless1024(uint32_t x) {
#ifdef KVRT_EMULATE
    return pack2(__float2half_rn(__half2float(__ushort_as_half((unsigned short)(x & 0xffffu))) - 1024.0f),
                 __float2half_rn(__half2float(__ushort_as_half((unsigned short)(x >> 16))) - 1024.0f));
#else
    __half2 h = *reinterpret_cast<__half2 *>(&x);
    h = __hsub2(h, __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400)));
    return *reinterpret_cast<uint32_t *>(&h);
#endif
}

/* The two A registers of a staged key row for k-step kk, lane t of its
 * quad: slots (2t, 2t+1) and (2t+8, 2t+9), columns mslot_col<B>. */
template <int B>
static __device__ __forceinline__ void mkey(const uint8_t *row, int kk, int t, uint32_t &r0, uint32_t &r1) {
    if constexpr (B == 16) {
        const uint2 v = *reinterpret_cast<const uint2 *>(row + 32 * kk + 8 * t);
        r0 = v.x, r1 = v.y;
    } else if constexpr (B == 8) {
        const uint32_t w = *reinterpret_cast<const uint32_t *>(row + 16 * kk + 4 * t);
        r0 = hless1024(__byte_perm(w, 0x64646464u, 0x4240u));
        r1 = hless1024(__byte_perm(w, 0x64646464u, 0x4341u));
    } else {
        const uint32_t u = *reinterpret_cast<const unsigned short *>(row + 8 * kk + 2 * t);
        const uint32_t y = u | u << 8;
        r0 = hless1024((y & 0x000F000Fu) | 0x64006400u);
        r1 = hless1024(((y >> 4) & 0x000F000Fu) | 0x64006400u);
    }
}

/* A lane group's slice of a staged value row (2·nvt columns from column
 * 2·nvt·g, at p) as 32-bit words, in the widest loads its alignment
 * allows. */
template <int B>
static __device__ __forceinline__ void mvrow(const uint8_t *p, int nvt, uint32_t (&w)[MVT]) {
    const int bytes = nvt * B / 4;
#pragma unroll
    for (int i = 0; i < MVT; i++) w[i] = 0u;
    if (bytes % 8 == 0) {
#pragma unroll
        for (int i = 0; i < MVT; i += 2)
            if (4 * i < bytes) {
                const uint2 v = *reinterpret_cast<const uint2 *>(p + 4 * i);
                w[i] = v.x, w[i + 1] = v.y;
            }
    } else if (bytes % 4 == 0) {
#pragma unroll
        for (int i = 0; i < MVT; i++)
            if (4 * i < bytes) w[i] = *reinterpret_cast<const uint32_t *>(p + 4 * i);
    } else {
#pragma unroll
        for (int i = 0; i < 2 * MVT; i++)
            if (2 * i < bytes) w[i >> 1] |= (uint32_t)*reinterpret_cast<const unsigned short *>(p + 2 * i) << (16 * (i & 1));
    }
}
/* The two A registers of m-tile mt from two rows' slices (x, y: positions
 * k and k + 1): column mval_col(.., g) in r0, mval_col(.., g + 8) in r1,
 * each as (row x, row y). */
template <int B>
static __device__ __forceinline__ void mval(const uint32_t (&x)[MVT], const uint32_t (&y)[MVT], int mt,
                                            uint32_t &r0, uint32_t &r1) {
    if constexpr (B == 16) {
        r0 = __byte_perm(x[mt], y[mt], 0x5410u), r1 = __byte_perm(x[mt], y[mt], 0x7632u);
    } else if constexpr (B == 8) {
        const unsigned k = 2u * ((unsigned)mt & 1u), s = k | (k + 1u) << 4 | (k + 4u) << 8 | (k + 5u) << 12;
        const uint32_t v = __byte_perm(x[mt >> 1], y[mt >> 1], s); /* x's two codes, y's two codes */
        r0 = hless1024(__byte_perm(v, 0x64646464u, 0x4240u));
        r1 = hless1024(__byte_perm(v, 0x64646464u, 0x4341u));
    } else {
        const unsigned k = (unsigned)mt & 3u, s = k | k << 4 | (k + 4u) << 8 | (k + 4u) << 12;
        const uint32_t v = __byte_perm(x[mt >> 2], y[mt >> 2], s); /* x's byte in byte 0, y's in byte 2 */
        r0 = hless1024((v & 0x000F000Fu) | 0x64006400u);
        r1 = hless1024(((v >> 4) & 0x000F000Fu) | 0x64006400u);
    }
}

/* A staged row pitch for the fragments' loads: an odd number of 16-byte
 * units, so that the rows a warp reads at once fall in different banks. */
static __host__ __device__ __forceinline__ int mattn_pitch(int pitch) {
    return (pitch / 16) % 2 ? pitch : pitch + 16;
}
/* Positions per tile: 64 (16 a warp), doubled while a stage stays within
 * cap bytes, up to 256. */
static __host__ __device__ __forceinline__ int mattn_tile(int pa, int pb, int cap) {
    int tp = 16 * MW;
    while (tp < 256 && stage_bytes(2 * tp, pa, pb) <= (size_t)cap) tp *= 2;
    return tp;
}
/* Clears rows np .. tp-1 of a stage (both slices and their pairs). */
static __device__ __forceinline__ void stage_clear(uint8_t *st, int tp, int pa, int pb, int np) {
    uint8_t *sb = st + (size_t)tp * pa, *z = sb + (size_t)tp * pb;
    const int na = (tp - np) * pa / 16, nb = (tp - np) * pb / 16;
    for (int x = threadIdx.x; x < na; x += NT) reinterpret_cast<uint4 *>(st + (size_t)np * pa)[x] = make_uint4(0u, 0u, 0u, 0u);
    for (int x = threadIdx.x; x < nb; x += NT) reinterpret_cast<uint4 *>(sb + (size_t)np * pb)[x] = make_uint4(0u, 0u, 0u, 0u);
    for (int x = np + threadIdx.x; x < tp; x += NT) reinterpret_cast<uint32_t *>(z)[x] = 0u, reinterpret_cast<uint32_t *>(z)[tp + x] = 0u;
}

/* 2^e such that a query whose largest magnitude is mx has it in [2^13, 2^14). */
static __device__ __forceinline__ float mq_mul(float mx) {
    if (!(mx > 0.0f) || !(mx < INFINITY)) return 1.0f;
    int e;
    frexpf(mx, &e);
    return ldexpf(1.0f, 14 - e);
}

template <int NQ, int KB, int VB>
__global__ void __launch_bounds__(NT, NQ == 1 ? 4 : 2) mattn_kernel(struct dlayer L, struct dglob G, dside KS, dside VS,
                                                                  int64_t T, int64_t len, int64_t n_full, int64_t rem,
                                                                  int cap, float *pm, float *pl, float *pacc) {
    extern __shared__ float sm[];
    int64_t j, c;
    kvrt_task(L.order, L.hk, G.g, n_full, len, rem, blockIdx.x, &j, &c);
    const int32_t *hk = L.hk + j * KVRT_HK_N;
    const int kw = hk[KVRT_HK_KW], vw = hk[KVRT_HK_VW], grp = (int)G.grp, nks = kw / 16, nvt = vw / 16;
    sslice A = slice_of(KS, hk[KVRT_HK_KCOL], kw, hk[KVRT_HK_KU]);
    sslice B = slice_of(VS, hk[KVRT_HK_VCOL], vw, hk[KVRT_HK_VU]);
    A.pitch = mattn_pitch(A.pitch), B.pitch = mattn_pitch(B.pitch);
    const int tp = mattn_tile(A.pitch, B.pitch, cap);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const size_t sbytes = stage_bytes(tp, A.pitch, B.pitch);
    uint8_t *stages = reinterpret_cast<uint8_t *>(sm);
    /* the queries as B fragments (column g: head 4n + g/2, hi or lo part),
     * and for this lane's score head 4n + t the scale back and Σq */
    float hmul[4 * NQ], hsum[4 * NQ]; /* per query head 4n .. 4n+3: mq_mul and Σq, over the warp */
#pragma unroll
    for (int h = 0; h < 4 * NQ; h++) {
        float mx = 0.0f, sum = 0.0f;
        if (h < grp) {
            const float *qh = L.qv + L.hq[(j * grp + h) * KVRT_HQ_N + KVRT_HQ_QOFF];
            for (int i = lane; i < kw; i += 32) mx = fmaxf(mx, fabsf(qh[i])), sum += qh[i];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o)), sum += __shfl_xor_sync(0xffffffffu, sum, o);
        hmul[h] = mq_mul(mx), hsum[h] = sum;
    }
    uint32_t qb[NQ][MKS][2];
    float qinv[NQ], qsum[NQ], m[NQ], l[NQ], z[NQ], acc[MVT][NQ][4];
#pragma unroll
    for (int n = 0; n < NQ; n++) {
        const int hb = 4 * n + (g >> 1), hc = 4 * n + t;
        const float *qi = hb < grp ? L.qv + L.hq[(j * grp + hb) * KVRT_HQ_N + KVRT_HQ_QOFF] : NULL;
        float mul = 0.0f, cmul = 1.0f, csum = 0.0f; /* selected without indexing the arrays */
#pragma unroll
        for (int h = 0; h < 4 * NQ; h++) {
            if (h == hb) mul = hmul[h];
            if (h == hc) cmul = hmul[h], csum = hsum[h];
        }
#pragma unroll
        for (int kk = 0; kk < MKS; kk++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                uint32_t pk = 0u;
                if (qi && kk < nks)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float v = qi[mslot_col<KB>(kk, 2 * t + e + 8 * r)] * mul;
                        __half h = __float2half_rn(v);
                        if (g & 1) h = __float2half_rn(v - __half2float(h));
                        pk |= (uint32_t)__half_as_ushort(h) << (16 * e);
                    }
                qb[n][kk][r] = pk;
            }
        qinv[n] = hc < grp ? 1.0f / cmul : 0.0f, qsum[n] = hc < grp ? csum : 0.0f;
        m[n] = -INFINITY, l[n] = 0.0f, z[n] = 0.0f;
#pragma unroll
        for (int mt = 0; mt < MVT; mt++) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;
    }
    const int64_t t0 = c * len, t1 = t0 + len < T ? t0 + len : T;
    const int ntile = (int)((t1 - t0 + tp - 1) / tp);
    for (int n = 0; n < MSTAGE - 1 + ntile; n++) {
        const int it = n - (MSTAGE - 1); /* the tile computed on after issuing tile n */
        if (it >= 0) {
            cp_wait<MSTAGE - 2>(); /* tile it has landed (this thread's copies) */
            __syncthreads();       /* everyone's copies and clears; everyone is done with tile it-1 */
        }
        if (n < ntile) {
            const int64_t p = t0 + (int64_t)n * tp;
            const int np = t1 - p < tp ? (int)(t1 - p) : tp;
            uint8_t *st = stages + (n % MSTAGE) * sbytes;
            stage_issue(st, tp, A, B, p, np);
            if (np < tp) stage_clear(st, tp, A.pitch, B.pitch, np);
        }
        cp_commit();
        if (it < 0) continue;
        const uint8_t *ra = stages + (it % MSTAGE) * sbytes, *rb = ra + (size_t)tp * A.pitch;
        const uint32_t *za = reinterpret_cast<const uint32_t *>(rb + (size_t)tp * B.pitch), *zb = za + tp;
        const int64_t pt = t0 + (int64_t)it * tp;
        const int npt = t1 - pt < tp ? (int)(t1 - pt) : tp;
        for (int r0 = 16 * warp; r0 < npt; r0 += 16 * MW) {
            /* scores of rows r0 + g and r0 + g + 8 */
            float C[NQ][4];
#pragma unroll
            for (int n = 0; n < NQ; n++) C[n][0] = C[n][1] = C[n][2] = C[n][3] = 0.0f;
            const uint8_t *k0 = ra + (size_t)(r0 + g) * A.pitch, *k1 = k0 + 8 * (size_t)A.pitch;
#pragma unroll
            for (int kk = 0; kk < MKS; kk++)
                if (kk < nks) {
                    uint32_t a0, a1, a2, a3;
                    mkey<KB>(k0, kk, t, a0, a2);
                    mkey<KB>(k1, kk, t, a1, a3);
#pragma unroll
                    for (int n = 0; n < NQ; n++) mma16816(C[n], a0, a1, a2, a3, qb[n][kk][0], qb[n][kk][1]);
                }
            const bool in0 = r0 + g < npt, in1 = r0 + g + 8 < npt;
            float2 kz0 = make_float2(1.0f, 0.0f), kz1 = kz0, vz0 = kz0, vz1 = kz0;
            if (KB != 16) kz0 = pair_of(za[r0 + g]), kz1 = pair_of(za[r0 + g + 8]);
            if (VB != 16) vz0 = pair_of(zb[r0 + g]), vz1 = pair_of(zb[r0 + g + 8]);
            uint32_t bv[NQ][2];
            float al[NQ];
#pragma unroll
            for (int n = 0; n < NQ; n++) {
                float s0 = (C[n][0] + C[n][1]) * qinv[n], s1 = (C[n][2] + C[n][3]) * qinv[n];
                if (KB != 16) s0 = kz0.x * s0 + kz0.y * qsum[n], s1 = kz1.x * s1 + kz1.y * qsum[n];
                s0 = in0 ? s0 * G.scale : -INFINITY;
                s1 = in1 ? s1 * G.scale : -INFINITY;
                float mx = fmaxf(s0, s1);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float mn = fmaxf(m[n], mx);
                float a = 1.0f, p0 = 0.0f, p1 = 0.0f;
                if (mn != -INFINITY) a = expf(m[n] - mn), p0 = expf(s0 - mn), p1 = expf(s1 - mn);
                m[n] = mn, al[n] = a;
                l[n] = l[n] * a + (p0 + p1);
                if (VB != 16) z[n] = z[n] * a + (p0 * vz0.y + p1 * vz1.y), p0 *= vz0.x, p1 *= vz1.x;
                const __half h0 = __float2half_rn(p0), h1 = __float2half_rn(p1);
                const uint32_t H = pack2(h0, h1);
                const uint32_t Lo = pack2(__float2half_rn(p0 - __half2float(h0)), __float2half_rn(p1 - __half2float(h1)));
                /* B: column g (head 4n + g/2, hi or lo), k = positions 2t, 2t+1 | 2t+8, 2t+9:
                 * from the lanes holding rows 2t and 2t+1 for that head */
                const int sa = 8 * t + (g >> 1), sb = sa + 4;
                const uint32_t ah = __shfl_sync(0xffffffffu, H, sa), alo = __shfl_sync(0xffffffffu, Lo, sa);
                const uint32_t bh = __shfl_sync(0xffffffffu, H, sb), blo = __shfl_sync(0xffffffffu, Lo, sb);
                const uint32_t xa = (g & 1) ? alo : ah, xb = (g & 1) ? blo : bh;
                bv[n][0] = __byte_perm(xa, xb, 0x5410u), bv[n][1] = __byte_perm(xa, xb, 0x7632u);
            }
            bool re = false;
#pragma unroll
            for (int n = 0; n < NQ; n++) re = re || al[n] != 1.0f;
            if (__any_sync(0xffffffffu, re))
#pragma unroll
                for (int mt = 0; mt < MVT; mt++)
#pragma unroll
                    for (int n = 0; n < NQ; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++) acc[mt][n][e] *= al[n];
            /* values of rows r0 + 2t, +1, +8, +9 */
            uint32_t wa[MVT], wb[MVT], wc[MVT], wd[MVT];
            const uint8_t *v0 = rb + (size_t)(r0 + 2 * t) * B.pitch + (size_t)(g * nvt * VB / 4);
            mvrow<VB>(v0, nvt, wa);
            mvrow<VB>(v0 + B.pitch, nvt, wb);
            mvrow<VB>(v0 + 8 * (size_t)B.pitch, nvt, wc);
            mvrow<VB>(v0 + 9 * (size_t)B.pitch, nvt, wd);
#pragma unroll
            for (int mt = 0; mt < MVT; mt++)
                if (mt < nvt) {
                    uint32_t a0, a1, a2, a3;
                    mval<VB>(wa, wb, mt, a0, a1);
                    mval<VB>(wc, wd, mt, a2, a3);
#pragma unroll
                    for (int n = 0; n < NQ; n++) mma16816(acc[mt][n], a0, a1, a2, a3, bv[n][0], bv[n][1]);
                }
        }
    }
    /* each head's sums over its lanes; then the warps' states merge */
#pragma unroll
    for (int n = 0; n < NQ; n++)
#pragma unroll
        for (int o = 4; o < 32; o *= 2)
            l[n] += __shfl_xor_sync(0xffffffffu, l[n], o), z[n] += __shfl_xor_sync(0xffffffffu, z[n], o);
    cp_wait<0>();
    __syncthreads(); /* the stages are free */
    float *gm = sm, *gl = gm + MW * grp, *gacc = gl + MW * grp;
#pragma unroll
    for (int n = 0; n < NQ; n++) {
        const int hc = 4 * n + t;
        if (hc < grp) {
            if (g == 0) gm[warp * grp + hc] = m[n], gl[warp * grp + hc] = l[n];
            float *o = gacc + ((int64_t)warp * grp + hc) * vw;
#pragma unroll
            for (int mt = 0; mt < MVT; mt++)
                if (mt < nvt) {
                    o[mval_col(nvt, mt, g)] = acc[mt][n][0] + acc[mt][n][1] + z[n];
                    o[mval_col(nvt, mt, g + 8)] = acc[mt][n][2] + acc[mt][n][3] + z[n];
                }
        }
    }
    __syncthreads();
    merge_partials(G, j, c, vw, MW, grp, pm, pl, pacc);
}

/* Shared memory of mattn_kernel for one head: its stages, or the merge
 * area, whichever is larger. */
static size_t mattn_smem(int grp, int64_t kw, int kbits, int64_t vw, int vbits, int cap) {
    const int pa = mattn_pitch(slice_pitch(kw, kbits)), pb = mattn_pitch(slice_pitch(vw, vbits));
    size_t st = MSTAGE * stage_bytes(mattn_tile(pa, pb, cap), pa, pb);
    size_t merge = (size_t)MW * (size_t)grp * (size_t)(2 + vw) * sizeof(float);
    return st > merge ? st : merge;
}
