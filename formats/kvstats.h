/* Statistics file (.kvstats), format version 2, and the statistics in
 * memory (internal; the API is in kvformats.h).
 *
 * A GGUF v3 file (formats/gguf.h) with these metadata keys:
 *
 *   general.type              string  "kvcal.stats"
 *   kvcal.format_version      uint32  2 (1: written before meta_crc32;
 *                                     still read)
 *   kvcal.version             string  kvcal version that wrote it
 *   kvcal.model.fingerprint   string  64 hex digits (kv_model_fingerprint)
 *   kvcal.model.n_layers, .dim, .n_heads, .n_kv_heads, .head_dim   uint64
 *   kvcal.seq_len             uint64  window length
 *   kvcal.tokens              uint64  tokens accumulated (= sequences * seq_len)
 *   kvcal.sequences           uint64  windows accumulated
 *   kvcal.sampling            string  "sequential", "random" or "merged"
 *   kvcal.seed, kvcal.samples uint64  the draw (samples 0 = every window)
 *   kvcal.shard.index, kvcal.shard.count   uint64
 *   kvcal.plan.windows        uint64  windows in the run's plan
 *   kvcal.plan.next_window    uint64  plan entries done; less than
 *                                     plan.windows in a checkpoint
 *   kvcal.datasets            [string] input paths as given
 *   kvcal.datasets.sha256     [string] sha256 of each input's bytes
 *   kvcal.datasets.bytes      [uint64] file sizes
 *   kvcal.datasets.tokens     [uint64] tokens of each input (with BOS)
 *   kvcal.datasets.windows    [uint64] windows of each input accumulated
 *   kvcal.crc32               [uint32] zlib crc32 of each tensor's data, in
 *                                      tensor order
 *   kvcal.meta_crc32          uint32  (version 2) zlib crc32 of this text,
 *                                     numbers in decimal, strings as stored:
 *       "<version>\n<fingerprint>\n<n_layers> <dim> <n_heads> <n_kv_heads>
 *        <head_dim>\n<seq_len> <tokens> <sequences>\n<sampling> <seed>
 *        <samples> <shard.index> <shard.count> <plan.windows>
 *        <plan.next_window>\n" and for each dataset "<path>\n<sha256>
 *        <bytes> <tokens> <windows>\n" (one space between fields, no
 *        line breaks but the \n shown)
 *
 * and, per layer N, four float64 tensors (sums over tokens, never means;
 * shapes row-major as kvcal prints them, GGUF stores ne[] reversed):
 *
 *   blk.N.attn_in.xtx   [d, d]
 *   blk.N.attn_in.sum   [d]
 *   blk.N.q_rope.cov    [h, d_h, d_h]
 *   blk.N.k_rope.cov    [g, d_h, d_h]
 *
 * followed, in a file with Fisher statistics (collect --fisher), by four
 * more per layer, sums over windows of one backward pass each (the window's
 * mean loss over its seq_len - 1 next-token targets):
 *
 *   blk.N.fisher.k      [g*d_h]        Σ_j (∂L/∂W_k[r, j])² per output row r
 *   blk.N.fisher.v      [g*d_h]        the same for W_v
 *   blk.N.grad_k.cov    [g, d_h, d_h]  Σ gᵀg per KV head, g = ∂L/∂k (pre-RoPE)
 *   blk.N.grad_v.cov    [g, d_h, d_h]  Σ gᵀg per KV head, g = ∂L/∂v
 *
 * in that order, layer after layer (blk.0's eight, then blk.1's). Either
 * every layer has all four or none does. Fisher sums and the covariances'
 * diagonals are sums of squares, so never negative. Matrices are stored in
 * full (both triangles). A file without the Fisher tensors has the same
 * layout as one from before they existed. */
#ifndef KV_KVSTATS_H
#define KV_KVSTATS_H

#include "kvformats.h"

/* Per-layer float64 sums over calibration tokens (docs/design.md). Matrices are
 * row-major and symmetric: both triangles stored, or only the upper one while
 * kv_stats.upper is set. */
struct kv_stats_layer {
    double *xtx;    /* [d, d]        Σ xᵀx, x = attention input after the norm */
    double *xsum;   /* [d]           Σ x */
    double *q_cov;  /* [h, d_h, d_h] Σ qᵀq per query head, post-RoPE */
    double *k_cov;  /* [g, d_h, d_h] Σ kᵀk per KV head, post-RoPE */
    /* Fisher statistics (collect --fisher), NULL when absent. Sums over
     * windows of the squared gradient of that window's mean loss:
     * fisher_k[r] = Σ_w Σ_j (∂L_w/∂W_k[r, j])² for output row r (Palu §3.3
     * scores any group of heads by summing its rows); the same for W_v. */
    double *fisher_k;  /* [g*d_h] */
    double *fisher_v;  /* [g*d_h] */
    /* Σ gᵀg over tokens per KV head of g = ∂L_w/∂k (pre-RoPE key output,
     * kv_grad_k) and ∂L_w/∂v. */
    double *grad_k_cov; /* [g, d_h, d_h] */
    double *grad_v_cov; /* [g, d_h, d_h] */
    void *block;        /* the allocation xtx, xsum, q_cov and k_cov live in */
};

/* The sums and their records (the accessors of kvformats.h read these). */
struct kv_stats {
    struct kv_stats_info info;     /* shapes, counts, the plan (kvformats.h) */
    struct kv_stats_input *inputs; /* [info.n_inputs] */
    struct kv_stats_layer *layers; /* [info.n_layers] */
    /* 1: the symmetric matrices (xtx and the per-head covariances) hold
     * only their upper triangles, as collect accumulates them, and the
     * lower ones were never written (so never made resident). kv_stats_write
     * writes them whole, mirrored as it goes; kv_stats_mirror fills them. */
    int upper;
};


/* Fill the lower triangles of s's symmetric matrices from the upper ones
 * and clear s->upper (nothing to do when it is clear). */
void kv_stats_mirror(struct kv_stats *s);

#define KV_STATS_TYPE "kvcal.stats"
#define KV_STATS_FORMAT_VERSION 2
#define KV_STATS_PER_LAYER 4        /* tensors per layer without Fisher statistics */
#define KV_STATS_FISHER_PER_LAYER 4 /* added per layer with them */

/* Tensors per layer of s: KV_STATS_PER_LAYER, plus KV_STATS_FISHER_PER_LAYER
 * when s->has_fisher. */
int kv_stats_layer_tensors(const struct kv_stats *s);
/* Name and row-major shape of tensor t (0 .. kv_stats_layer_tensors - 1) of a
 * layer, in file order; returns ndim. */
int kv_stats_tensor_desc(const struct kv_stats *s, int64_t layer, int t, char *name, size_t cap,
                         int64_t shape[3]);
/* Data pointer of tensor t of a layer. */
double *kv_stats_tensor_data(const struct kv_stats *s, int64_t layer, int t);

#endif
