/* kvcal runtime (libkvrt): decode attention over a latent KV cache.
 *
 * A runtime holds one model's attention (every layer's projections, the
 * factors a compressed model's manifest names, and a KV cache per layer) on
 * a backend, and runs decode steps: append one token's keys/values (or their
 * latents) at a position, then attend from that token's query over every
 * cached position. It runs every mode kvcal decompose writes (kvcal_core.h,
 * enum kv_lr_mode) and the plain full-KV path:
 *
 *   keys   full               cache RoPE(x W_kᵀ + b_k), score q·k
 *          prerope_latent     cache z = x downᵀ + c; per tile of positions
 *                             rebuild k = z upᵀ, RoPE it, score q·k
 *          fused_query        cache z; score q'·z with q' = x q_fusedᵀ + b
 *          postrope_rotation  cache z_j = RoPE(k_j) rot_jᵀ; score (q_i rot_jᵀ)·z_j
 *   values full               cache v; out = (P v) W_oᵀ
 *          fused_output       cache z; out = (P z) o_fusedᵀ
 *
 * Two backends share one plan and one algorithm (kernels/README.md): the
 * CUDA kernels and their CPU twin, plain C with the same tiling, chunking
 * and order of operations, which is the reference the GPU is tested against.
 * Cached entries are stored as fp32 or fp16 (rounded to nearest even as they
 * enter the cache); a compressed model whose kv_bits is below 16 stores
 * every latent as 8-, 4-, 3- or 2-bit codes with an fp16 scale and zero per
 * unit and position (quantized as the forward pass quantizes them, full keys
 * and values staying fp32/fp16); all arithmetic is fp32.
 *
 * Errors follow kvcal_core.h: an int status and a caller-owned struct kv_err.
 * KV_EDEVICE for CUDA failures, KV_EUNSUPPORTED for a build without CUDA or
 * a manifest the runtime does not run. */
#ifndef KVRT_H
#define KVRT_H

#include "kvcal_core.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kvrt_backend {
    KVRT_BACKEND_TWIN = 0, /* the CPU twin (always built) */
    KVRT_BACKEND_CUDA = 1, /* the CUDA kernels (built when nvcc is found) */
};
enum kvrt_dtype {
    KVRT_DTYPE_F32 = 0,
    KVRT_DTYPE_F16 = 1,
};
const char *kvrt_backend_name(enum kvrt_backend b); /* "twin", "cuda" */
const char *kvrt_dtype_name(enum kvrt_dtype t);     /* "f32", "f16" */
/* Parse a name; -1 when unknown. */
int kvrt_backend_parse(const char *s);
int kvrt_dtype_parse(const char *s);

struct kvrt_opts {
    enum kvrt_backend backend;
    enum kvrt_dtype cache;  /* storage of cached keys, values and latents */
    int64_t max_ctx;        /* positions per layer */
    int device;             /* CUDA device ordinal */
    int sm_count;           /* parallel width the sequence chunking aims at (blocks of
                               work = about 2 × this); 0: the device's multiprocessor
                               count (cuda) or 132 (twin). Give the twin a GPU's
                               count to reproduce that GPU's chunking exactly. */
};
/* backend twin, cache f32, max_ctx 2048, device 0, sm_count 0. */
void kvrt_opts_default(struct kvrt_opts *o);

/* ---------------------------------------------------------------- devices */

/* 1 when this build has the CUDA backend. */
int kvrt_cuda_built(void);

struct kvrt_device {
    char name[256];
    int cc_major, cc_minor;  /* compute capability */
    int sm_count;
    int64_t mem_bytes;       /* global memory */
    int64_t smem_optin;      /* shared memory one block may opt in to */
    double peak_gbs;         /* memory clock × bus width × 2 (DDR), GB/s (1e9) */
};
/* Number of CUDA devices (0 when the driver sees none). KV_EUNSUPPORTED in
 * a build without CUDA. */
int kvrt_device_count(int *count, struct kv_err *err);
/* Properties of device ordinal dev. KV_EDEVICE when it does not exist. */
int kvrt_device_query(int dev, struct kvrt_device *out, struct kv_err *err);

/* ---------------------------------------------------------------- runtime */

struct kvrt;

/* Upload model m's attention for a decode runtime: the base model's full
 * K/V path when lr is NULL, else lr's compressed attention (lr as from
 * kv_lr_dir_open; its shapes must match m). lr's kv_bits (kv_lr_info) says
 * how latents are cached: 16 as opts.cache says, 8, 4, 3 or 2 as codes
 * (kernels/README.md, "Low-bit latents"). Only the attention weights are
 * copied; m and lr may be freed afterwards. */
int kvrt_open(const struct kv_model *m, const struct kv_lowrank *lr,
              const struct kvrt_opts *o, struct kvrt **out, struct kv_err *err);
void kvrt_close(struct kvrt *rt);

/* Append the token at position pos of layer `layer`: xn [d] is its attention
 * input (after the norm). Computes its query (kept for kvrt_attend) and its
 * cache entries, which go to row pos; the layer's cache then holds positions
 * 0..pos (later rows are forgotten). pos must be at most the layer's current
 * length and below max_ctx. */
int kvrt_append(struct kvrt *rt, int64_t layer, int64_t pos, const float *xn,
                struct kv_err *err);
/* Attend from the query of the last append to this layer over positions
 * 0..pos: y [d] = the attention block's output (output projection applied,
 * its bias not added). */
int kvrt_attend(struct kvrt *rt, int64_t layer, float *y, struct kv_err *err);
/* kvrt_append then kvrt_attend. */
int kvrt_step(struct kvrt *rt, int64_t layer, int64_t pos, const float *xn, float *y,
              struct kv_err *err);

/* kv_fwd_hooks.attn for a struct kvrt *ctx: decode rows x [n, d] one at a
 * time at positions pos0.. and add each y to res [n, d]. On failure it
 * returns the status; kvrt_error tells what happened. */
int kvrt_fwd_attn(void *ctx, int64_t layer, const float *x, int64_t n, int64_t pos0,
                  float *res);
const struct kv_err *kvrt_error(const struct kvrt *rt);

/* ---------------------------------------------------------------- introspection */

struct kvrt_layer_info {
    enum kv_lr_mode kmode, vmode;
    int64_t cache_bytes_per_token; /* K + V entries of one position, as stored (quantized
                                      latents: codes plus fp16 scale and zero per unit,
                                      kv_lr_unit_bytes, without the row padding) */
    int64_t weight_bytes;          /* fp32 weights one decode step reads */
    int64_t up_bytes;              /* of which prerope reconstruction factors */
};
int kvrt_layer_info(const struct kvrt *rt, int64_t layer, struct kvrt_layer_info *out);

/* KV_OK when the caches of every layer filled to max_ctx positions fit: on
 * the twin, whose caches live in host memory that is only touched when
 * filled, at most 90% of the memory available now (MemAvailable, else the
 * physical memory); KV_ENOMEM naming both sizes otherwise, rather than be
 * killed for it. A CUDA runtime allocated its caches at kvrt_open. */
int kvrt_cache_fits(const struct kvrt *rt, int64_t max_ctx, struct kv_err *err);
/* Bytes of memory available to a new allocation: MemAvailable of
 * /proc/meminfo, else the physical memory; 0 when unknown. */
double kvrt_mem_available(void);
enum kvrt_backend kvrt_backend_of(const struct kvrt *rt);
/* The sequence chunk length and the number of (KV head, chunk) tasks one
 * attention step over T positions uses. */
int64_t kvrt_chunk_len(const struct kvrt *rt, int64_t T, int64_t *n_tasks);

/* The most cached positions a runtime holds (kvrt_opts.max_ctx), so the
 * longest context a decode step attends over is one less. */
int64_t kvrt_max_ctx(void);

/* ---------------------------------------------------------------- benchmarks */

/* Fill layer `layer`'s cache rows 0..len-1 with pseudo-random entries from
 * seed (uniform in [-1, 1]; quantized latents: random codes, scales in
 * [2^-4, 2^-3) and zeros in (-2, -1]), as if len tokens had been appended;
 * the same bytes on every backend (kvrt_plan.h). */
int kvrt_fill(struct kvrt *rt, int64_t layer, int64_t len, uint64_t seed, struct kv_err *err);
/* Time iters decode steps of layer `layer` at position pos (each appends a
 * fixed pseudo-random input at pos, over a cache filled to pos, and
 * attends), after 3 untimed ones. *us_step gets the mean wall time of a whole
 * step in microseconds, *us_attn the part spent in the attention kernels
 * (scores, softmax, P·V and the chunk combine; without the projections). On
 * CUDA both are measured with events on the device's stream. */
int kvrt_time_step(struct kvrt *rt, int64_t layer, int64_t pos, int64_t iters, double *us_step,
                   double *us_attn, struct kv_err *err);

/* ---------------------------------------------------------------- synthetic shapes */

/* Presets of real attention shapes with random weights, for timing:
 *   "llama7b"    d 4096, 32 heads, MHA (32 KV heads), head_dim 128, RoPE θ 1e4
 *   "llama3-8b"  d 4096, 32 heads, 8 KV heads, head_dim 128, RoPE θ 5e5
 *   "gpt2-xl"    d 1600, 25 heads, MHA, head_dim 64, learned positions (no RoPE)
 * NULL-terminated list of the names. */
const char *const *kvrt_synth_presets(void);
/* 1 when name is one of kvrt_synth_presets(). */
int kvrt_synth_preset_valid(const char *name);
/* A model of the preset with n_layers layers (an 8-entry vocabulary and a
 * small FFN; only its attention is meant to run). KV_EINVAL naming the
 * preset when it is unknown. */
int kvrt_synth_model(const char *preset, int64_t n_layers, struct kv_model **out,
                     struct kv_err *err);
/* Random compressed attention for m: every layer's keys in kmode (full,
 * prerope_latent, fused_query (models without RoPE only) or
 * postrope_rotation) and values in vmode (full or fused_output), one unit
 * per KV head with rank round(keep·d_h) (at least 1); postrope_rotation ranks
 * differ per head (alternately 0.5× and 1.5× the mean, rounded to multiples
 * of 8 where d_h allows, mean kept), the case FDC's scheduling balances. */
int kvrt_synth_lowrank(const struct kv_model *m, enum kv_lr_mode kmode, enum kv_lr_mode vmode,
                       double keep, uint64_t seed, struct kv_lowrank **out, struct kv_err *err);
/* Random factors of the shapes a manifest-only lr describes (from
 * kv_lr_manifest_read, every factor pointer NULL), and a random model of its
 * shapes (gpt2 when any layer has fused_query keys, else llama), so that a
 * manifest's ranks can be timed without its weights. */
int kvrt_synth_fill_factors(struct kv_lowrank *lr, uint64_t seed, struct kv_err *err);
int kvrt_synth_model_for(const struct kv_lowrank *lr, struct kv_model **out, struct kv_err *err);
/* KV_OK when the synthetic model kvrt_synth_model_for would build for lr,
 * and the runtime's copy of its attention projections, fit in 90% of the
 * memory available now (kvrt_mem_available; the factors come on top);
 * KV_ENOMEM naming the shapes and both sizes otherwise, before anything
 * is allocated. */
int kvrt_synth_fits(const struct kv_lowrank *lr, struct kv_err *err);

/* ---------------------------------------------------------------- benchmark tables */

/* The options of a benchmark as a caller names them in messages: a check
 * given names (indexed by this enum) words its message with them ("--ctx
 * length 0 is outside 1..1048575" for kvcal bench-attn); NULL names use
 * the library's ("context length 0 ..."). */
enum kvrt_bench_opt {
    KVRT_BENCH_OPT_CTX,    /* the context lengths timed */
    KVRT_BENCH_OPT_KEEP,   /* synthetic latents' mean rank / head_dim */
    KVRT_BENCH_OPT_ITERS,  /* timed steps per layer and context */
    KVRT_BENCH_OPT_LAYERS, /* layers timed */
    KVRT_BENCH_OPT_KV_BITS, /* latent storage bits */
    KVRT_BENCH_OPT_COUNT
};

/* KV_OK when a decode step at context ctx (ctx cached positions and one
 * appended) fits a runtime: 1 <= ctx <= kvrt_max_ctx() - 1. */
int kvrt_bench_check_ctx(int64_t ctx, const char *const *names, struct kv_err *err);
/* KV_OK when keep is within (0, 1]: the mean latent rank per KV head of
 * synthetic compressed attention as a fraction of head_dim
 * (kvrt_synth_lowrank makes the same check). */
int kvrt_bench_check_keep(double keep, const char *const *names, struct kv_err *err);
/* KV_OK when bits is a latent storage kvcal runs: 16, 8, 4, 3 or 2
 * (kv_lr_bits_valid). */
int kvrt_bench_check_bits(int64_t bits, const char *const *names, struct kv_err *err);
/* KV_OK when iters and layers are at least 1. */
int kvrt_bench_check(int64_t iters, int64_t layers, const char *const *names,
                     struct kv_err *err);
/* Timed steps per layer and context when a caller gives none: 50 on cuda,
 * 3 on the (slower) twin. */
int64_t kvrt_bench_default_iters(enum kvrt_backend backend);
/* KV_OK when a manifest's lr has at least `layers` layers to time. */
int kvrt_bench_check_manifest(const struct kv_lowrank *lr, int64_t layers,
                              const char *const *names, struct kv_err *err);
/* A manifest read alone (kv_lr_manifest_read) made ready to time: its
 * first `layers` layers (<= 0: all; kvrt_bench_check_manifest), random
 * factors (kvrt_synth_fill_factors) and a random model of its shapes in *m
 * (kv_model_close). Its latents are timed as it stores them (its kv_bits;
 * kv_lr_set_kv_bits changes that). */
int kvrt_bench_manifest(struct kv_lowrank *lr, int64_t layers, struct kv_model **m,
                        struct kv_err *err);

#define KVRT_BENCH_MAX_CTXS 64 /* context lengths one table holds */
#define KVRT_BENCH_MAX_CFGS 4

/* One row label of the table: a configuration timed at every context. */
struct kvrt_bench_cfg {
    const char *name;             /* "full", "manifest", "prerope_latent+fused_output", ... */
    enum kv_lr_mode kmode, vmode; /* the synthetic modes it is made with */
    int manifest;                 /* the manifest's own modes and ranks instead */
    /* as timed, per cache dtype (index enum kvrt_dtype): */
    int64_t kv_total[2];          /* KV bytes per token over the timed layers, as stored
                                     (kvrt_layer_info: quantized latents' codes, scale, zero) */
    enum kv_lr_mode lk, lv;       /* modes of layer 0 as the runtime runs them */
    int mixed;                    /* the layers differ in modes */
    int kv_bits;                  /* its latents' storage: 16 (as the cache dtype), 8, 4, 3, 2;
                                     16 for full */
};

/* One (configuration, cache dtype, context): means over the timed layers. */
struct kvrt_bench_cell {
    double us_step;  /* a whole decode step, microseconds (kvrt_time_step) */
    double us_attn;  /* of which the attention kernels */
    double bytes;    /* bytes the step moves: (ctx+1) x cached bytes per token + weights */
    double kv_layer; /* cached bytes per token and layer */
};

/* A decode-attention benchmark: what to time (set by the caller) and the
 * table (filled by kvrt_bench_run). */
struct kvrt_bench {
    enum kvrt_backend backend;
    int64_t ctx[KVRT_BENCH_MAX_CTXS]; /* ascending and distinct */
    int n_ctx;
    int caches[2], n_cache;           /* enum kvrt_dtype, in table order */
    int64_t iters;
    double keep;                      /* synthetic latents (kvrt_synth_lowrank) */
    int kv_bits;                      /* synthetic latents' storage: 16 (or 0), 8, 4, 3, 2;
                                         a manifest's is its own (lr's kv_bits) */
    const struct kv_model *m;         /* the model timed, every layer of it */
    struct kv_lowrank *lr;            /* a manifest's (kvrt_bench_manifest), or NULL */
    /* out */
    struct kvrt_bench_cfg cfgs[KVRT_BENCH_MAX_CFGS]; /* full first: speedups are against it */
    int n_cfg;
    struct kvrt_bench_cell *cells;    /* kvrt_bench_cell; kvrt_bench_release frees them */
};

/* Time every configuration (full and the manifest's with lr, else full and
 * two synthetic latent ones, fused_query keys for models without RoPE and
 * prerope_latent otherwise, and postrope_rotation), cache dtype, layer and
 * context: per layer one fill of the cache to the longest context, then
 * kvrt_time_step at each context from the longest down. progress (may be
 * NULL) counts (configuration, cache, layer, context) steps; non-zero stops
 * the run (KV_EINVAL). Runtime errors say which configuration, cache and
 * context length they came from. */
int kvrt_bench_run(struct kvrt_bench *b, kv_progress_fn progress, void *ctx,
                   struct kv_err *err);
/* The cell of configuration cfg (index into b->cfgs), cache dtype cache
 * (enum kvrt_dtype) and context b->ctx[ctx_i]. */
const struct kvrt_bench_cell *kvrt_bench_cell(const struct kvrt_bench *b, int cfg, int cache,
                                              int ctx_i);
/* Free the table (not m or lr, which stay the caller's). */
void kvrt_bench_release(struct kvrt_bench *b);

#ifdef __cplusplus
}
#endif
#endif
