/* A model as a GGUF file llama.cpp loads: layout and choices in
 * ggufmodelw.h.
 *
 * formats/ggufw.c writes GGUF for the statistics file, but it has no float32
 * scalars, no float32 or int32 arrays and no block-quantised tensors, all of
 * which llama.cpp insists on (it checks the stored type of every key it
 * reads), and it wants every tensor in memory. So this file serialises
 * itself: the metadata into one buffer, the tensors streamed row by row
 * from the model's f32 weights (permuted and encoded on the way) through
 * kv_write_atomic, which gives the same temp + fsync + rename as ggufw. */
#include "ggufmodelw.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arch.h"
#include "err.h"
#include "ggmlquant.h"
#include "ggufmodel.h"
#include "gguf.h"
#include "limits.h"
#include "mapfile.h"
#include "model.h"
#include "pretok.h"
#include "tokenizer.h"

#define GW_ALIGN 32u
#define GW_VERSION 3u
#define GW_STAGE (1u << 20) /* output staging buffer */
#define COUNT(a) ((int)(sizeof a / sizeof a[0]))

/* GGUF metadata value types (gguf.h numbers them as stored). */
enum { T_U32 = 4, T_I32 = 5, T_F32 = 6, T_BOOL = 7, T_STR = 8, T_ARR = 9 };

/* ================================================================ architectures */

/* Hyper-parameters a key can hold. */
enum hp {
    HP_CTX,       /* u32 max_seq_len */
    HP_DIM,       /* u32 dim */
    HP_LAYERS,    /* u32 n_layers */
    HP_FF,        /* u32 hidden_dim */
    HP_HEADS,     /* u32 n_heads */
    HP_KV_HEADS,  /* u32 n_kv_heads */
    HP_HEAD_DIM,  /* u32 head_dim */
    HP_ROPE_BASE, /* f32 rope_theta */
    HP_NORM_EPS,  /* f32 norm_eps */
    HP_VOCAB,     /* u32 vocab_size */
    HP_ROPE_DIM,  /* u32 kv_rope_dim (partial rope) */
};

/* One "<arch>.<suffix>" key; odd_head_dim: written only when head_dim is
 * not dim / n_heads (llama.cpp's default). */
struct hp_key {
    const char *suffix;
    enum hp what;
    int odd_head_dim;
};

static const struct hp_key llama_keys[] = {
    {"context_length", HP_CTX, 0},
    {"embedding_length", HP_DIM, 0},
    {"block_count", HP_LAYERS, 0},
    {"feed_forward_length", HP_FF, 0},
    {"attention.head_count", HP_HEADS, 0},
    {"attention.head_count_kv", HP_KV_HEADS, 0},
    {"attention.key_length", HP_HEAD_DIM, 1},
    {"attention.value_length", HP_HEAD_DIM, 1},
    {"rope.dimension_count", HP_HEAD_DIM, 0},
    {"rope.freq_base", HP_ROPE_BASE, 0},
    {"attention.layer_norm_rms_epsilon", HP_NORM_EPS, 0},
    {"vocab_size", HP_VOCAB, 0},
};

/* gptneox: LayerNorm's epsilon, the rotated dimensions of a partial rope
 * (use_parallel_residual is written apart, a bool) */
static const struct hp_key neox_keys[] = {
    {"context_length", HP_CTX, 0},
    {"embedding_length", HP_DIM, 0},
    {"block_count", HP_LAYERS, 0},
    {"feed_forward_length", HP_FF, 0},
    {"attention.head_count", HP_HEADS, 0},
    {"rope.dimension_count", HP_ROPE_DIM, 0},
    {"rope.freq_base", HP_ROPE_BASE, 0},
    {"attention.layer_norm_epsilon", HP_NORM_EPS, 0},
    {"vocab_size", HP_VOCAB, 0},
};

/* phi3: GQA keys, the rotated dimensions (its longrope keys, factor
 * tensors and window are written apart) */
static const struct hp_key phi3_keys[] = {
    {"context_length", HP_CTX, 0},
    {"embedding_length", HP_DIM, 0},
    {"block_count", HP_LAYERS, 0},
    {"feed_forward_length", HP_FF, 0},
    {"attention.head_count", HP_HEADS, 0},
    {"attention.head_count_kv", HP_KV_HEADS, 0},
    {"rope.dimension_count", HP_ROPE_DIM, 0},
    {"rope.freq_base", HP_ROPE_BASE, 0},
    {"attention.layer_norm_rms_epsilon", HP_NORM_EPS, 0},
    {"vocab_size", HP_VOCAB, 0},
};

/* gemma2: heads sized by key_length (Gemma 2 2B: 8 · 256 on 2304); its
 * window and soft-caps are written apart */
static const struct hp_key gemma2_keys[] = {
    {"context_length", HP_CTX, 0},
    {"embedding_length", HP_DIM, 0},
    {"block_count", HP_LAYERS, 0},
    {"feed_forward_length", HP_FF, 0},
    {"attention.head_count", HP_HEADS, 0},
    {"attention.head_count_kv", HP_KV_HEADS, 0},
    {"attention.key_length", HP_HEAD_DIM, 0},
    {"attention.value_length", HP_HEAD_DIM, 0},
    {"rope.freq_base", HP_ROPE_BASE, 0},
    {"attention.layer_norm_rms_epsilon", HP_NORM_EPS, 0},
    {"vocab_size", HP_VOCAB, 0},
};

/* How one kvcal architecture is written for llama.cpp: the GGUF
 * architecture (general.architecture and the key prefix), the RoPE pairing
 * llama.cpp's graph uses on stored q/k rows (llama: NORM, pairs (2i,
 * 2i+1); qwen2, qwen3, phi3, gptneox, gemma2: NEOX, pairs (i, i + d/2)),
 * whether it reads rope_freqs.weight, whether its graph sizes q and the
 * output projection as [dim, dim] (square_attn: n_heads * head_dim must be
 * dim), and its keys. Tensor names come from lib/arch.c's .gguf table of the same
 * kvcal architecture. */
struct gguf_arch {
    enum kv_arch arch;
    const char *name;
    enum kv_rope_layout rope_layout;
    int rope_freqs;
    int square_attn;
    const struct hp_key *keys;
    int n_keys;
};

/* Mistral is written as "llama", as convert_hf_to_gguf.py does: the same
 * graph, and its sliding window has no key (refused below). qwen2 stores
 * q/k rows as HF does (rotate-half) and reads neither rope_freqs.weight nor
 * key_length / value_length. qwen3 is qwen2's NEOX graph with the per-head
 * q/k norms, optional biases and heads sized by key_length, so n_heads *
 * head_dim may differ from dim (Qwen3-0.6B: 16 * 128 against 1024). */
static const struct gguf_arch gguf_archs[] = {
    {KV_ARCH_LLAMA, "llama", KV_ROPE_INTERLEAVED, 1, 0, llama_keys, COUNT(llama_keys)},
    {KV_ARCH_MISTRAL, "llama", KV_ROPE_INTERLEAVED, 1, 0, llama_keys, COUNT(llama_keys)},
    {KV_ARCH_QWEN2, "qwen2", KV_ROPE_HALF, 0, 1, llama_keys, COUNT(llama_keys)},
    {KV_ARCH_QWEN3, "qwen3", KV_ROPE_HALF, 0, 0, llama_keys, COUNT(llama_keys)},
    {KV_ARCH_GPTNEOX, "gptneox", KV_ROPE_HALF, 0, 1, neox_keys, COUNT(neox_keys)},
    {KV_ARCH_PHI3, "phi3", KV_ROPE_HALF, 0, 1, phi3_keys, COUNT(phi3_keys)},
    {KV_ARCH_GEMMA2, "gemma2", KV_ROPE_HALF, 0, 0, gemma2_keys, COUNT(gemma2_keys)},
};

static const struct gguf_arch *find_arch(enum kv_arch a) {
    for (int i = 0; i < COUNT(gguf_archs); i++)
        if (gguf_archs[i].arch == a) return &gguf_archs[i];
    return NULL;
}

/* ================================================================ metadata buffer */

struct buf {
    uint8_t *p;
    size_t len, cap;
    int oom;
};

static void b_put(struct buf *b, const void *p, size_t n) {
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q, b->cap = cap;
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

static void b_u32(struct buf *b, uint32_t v) {
    uint8_t x[4];
    for (int i = 0; i < 4; i++) x[i] = (uint8_t)(v >> (8 * i));
    b_put(b, x, 4);
}

static void b_u64(struct buf *b, uint64_t v) {
    uint8_t x[8];
    for (int i = 0; i < 8; i++) x[i] = (uint8_t)(v >> (8 * i));
    b_put(b, x, 8);
}

static void b_f32(struct buf *b, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    b_u32(b, u);
}

static void b_str(struct buf *b, const char *s, size_t n) {
    b_u64(b, n);
    b_put(b, s, n);
}

/* The metadata section: key/value pairs appended in order. */
struct meta {
    struct buf b;
    uint64_t n;
};

static void m_key(struct meta *m, const char *key, uint32_t type) {
    b_str(&m->b, key, strlen(key));
    b_u32(&m->b, type);
    m->n++;
}

static void m_u32(struct meta *m, const char *key, uint32_t v) {
    m_key(m, key, T_U32);
    b_u32(&m->b, v);
}

static void m_f32(struct meta *m, const char *key, float v) {
    m_key(m, key, T_F32);
    b_f32(&m->b, v);
}

static void m_bool(struct meta *m, const char *key, int v) {
    m_key(m, key, T_BOOL);
    uint8_t x = v != 0;
    b_put(&m->b, &x, 1);
}

static void m_str(struct meta *m, const char *key, const char *s) {
    m_key(m, key, T_STR);
    b_str(&m->b, s, strlen(s));
}

static void m_arr_head(struct meta *m, const char *key, uint32_t et, uint64_t n) {
    m_key(m, key, T_ARR);
    b_u32(&m->b, et);
    b_u64(&m->b, n);
}

/* ================================================================ tokenizer */

/* The vocabulary to write: n pieces (bytes owned), their scores and types. */
struct vocab {
    const char *model; /* "llama" or "gpt2" */
    int32_t n;
    char **piece;
    size_t *len;
    float *score;
    int32_t *type;
    int32_t bos, eos, unk; /* -1: key omitted */
    int add_bos, add_eos;
    int space_prefix; /* -1: key omitted */
};

static void vocab_free(struct vocab *v) {
    if (v->piece)
        for (int32_t i = 0; i < v->n; i++) free(v->piece[i]);
    free(v->piece);
    free(v->len);
    free(v->score);
    free(v->type);
    memset(v, 0, sizeof *v);
}

static int vocab_alloc(struct vocab *v, int32_t n, const char *path, struct kv_err *err) {
    v->n = n;
    v->piece = calloc((size_t)n, sizeof *v->piece);
    v->len = calloc((size_t)n, sizeof *v->len);
    v->score = calloc((size_t)n, sizeof *v->score);
    v->type = calloc((size_t)n, sizeof *v->type);
    if (!v->piece || !v->len || !v->score || !v->type)
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory for %d pieces", (int)n);
    return KV_OK;
}

/* Piece i := the n bytes at p (copied). */
static int vocab_set(struct vocab *v, int32_t i, const char *p, size_t n, float score, int type,
                     const char *path, struct kv_err *err) {
    char *c = malloc(n ? n : 1);
    if (!c) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    if (n) memcpy(c, p, n);
    free(v->piece[i]);
    v->piece[i] = c, v->len[i] = n, v->score[i] = score, v->type[i] = type;
    return KV_OK;
}

/* llama.cpp maps pieces to ids one to one (an assertion, not an error):
 * refuse two equal pieces. Empty pieces it renames itself. */
static int vocab_check_unique(const struct vocab *v, const char *path, struct kv_err *err) {
    size_t cap = 16;
    while (cap < (size_t)v->n * 2) cap *= 2;
    int32_t *slot = malloc(cap * sizeof *slot);
    if (!slot) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    for (size_t i = 0; i < cap; i++) slot[i] = -1;
    int rc = KV_OK;
    for (int32_t i = 0; i < v->n && !rc; i++) {
        if (!v->len[i]) continue;
        size_t s = (size_t)kv_gguf_hash(v->piece[i], v->len[i]) & (cap - 1);
        for (; slot[s] >= 0; s = (s + 1) & (cap - 1)) {
            int32_t j = slot[s];
            if (v->len[j] == v->len[i] && !memcmp(v->piece[j], v->piece[i], v->len[i])) {
                char eb[96];
                rc = kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                             "tokenizer pieces %d and %d are both '%s'; llama.cpp needs every "
                             "piece to be distinct",
                             (int)j, (int)i, kv_gguf_excerpt(v->piece[i], v->len[i], eb, sizeof eb));
                break;
            }
        }
        slot[s] = i;
    }
    free(slot);
    return rc;
}

/* The byte a piece starts with, reading a byte piece "<0xXX>" as its byte;
 * -1 for an empty piece. */
static int first_byte(const struct kv_tokenizer *tok, int32_t id) {
    size_t n;
    const char *p = kv_tok_piece(tok, id, &n);
    if (!p || !n) return -1;
    unsigned b;
    char s[8];
    if (kv_tok_type(tok, id) == KV_TOKT_BYTE && n == 6) {
        memcpy(s, p, 6), s[6] = 0;
        if (sscanf(s, "<0x%2X>", &b) == 1) return (int)b;
    }
    return (uint8_t)p[0];
}

/* Whether the tokenizer puts a space before a text (SentencePiece's dummy
 * prefix): the first token of "a" starts with ' ', with U+2581 (0xE2 ...),
 * or is one of those bytes. -1 when encoding fails. */
static int probe_space_prefix(const struct kv_tokenizer *tok) {
    int32_t *ids = NULL;
    int64_t n = 0;
    struct kv_err e;
    kv_err_clear(&e);
    if (kv_tok_encode(tok, "a", 1, 0, &ids, &n, &e) != KV_OK) return -1;
    int b = n > 0 ? first_byte(tok, ids[0]) : -1;
    free(ids);
    return b == ' ' || b == 0xE2;
}

/* The ids of bos and eos: the tokenizer's, else the config's, when inside
 * the vocabulary; -1 otherwise. */
static int32_t valid_id(int32_t a, int32_t b, int64_t n) {
    if (a >= 0 && a < n) return a;
    if (b >= 0 && b < n) return b;
    return -1;
}

/* No tokenizer: the synthetic vocabulary of ggufmodelw.h. */
static int vocab_synthetic(const struct kv_config *c, struct vocab *v, const char *path,
                           struct kv_err *err) {
    int32_t n = (int32_t)c->vocab_size;
    int rc = vocab_alloc(v, n, path, err);
    if (rc) return rc;
    v->bos = valid_id(c->bos_id, n > 1 ? 1 : -1, n);
    v->eos = valid_id(c->eos_id, n > 2 ? 2 : -1, n);
    v->unk = v->bos != 0 && v->eos != 0 ? 0 : -1;
    v->add_bos = v->bos >= 0, v->add_eos = 0, v->space_prefix = -1;
    int32_t n_special = (v->bos >= 0) + (v->eos >= 0 && v->eos != v->bos) + (v->unk >= 0);
    /* llama.cpp's SentencePiece tokenizer throws (and aborts the process)
     * on a byte it has no piece for: without room for all 256, the bytes
     * are byte-level BPE pieces, which it skips when absent */
    int spm = n - n_special >= 256;
    v->model = spm ? "llama" : "gpt2";
    char pb[32];
    int next_byte = 0;
    for (int32_t i = 0; i < n && !rc; i++) {
        if (i == v->bos) {
            rc = vocab_set(v, i, "<s>", 3, 0, KV_TOKT_CONTROL, path, err);
        } else if (i == v->eos) {
            rc = vocab_set(v, i, "</s>", 4, 0, KV_TOKT_CONTROL, path, err);
        } else if (i == v->unk) {
            rc = vocab_set(v, i, "<unk>", 5, 0, KV_TOKT_UNKNOWN, path, err);
        } else if (next_byte < 256 && spm) {
            int k = snprintf(pb, sizeof pb, "<0x%02X>", next_byte++);
            rc = vocab_set(v, i, pb, (size_t)k, 0, KV_TOKT_BYTE, path, err);
        } else if (next_byte < 256) {
            char b = (char)next_byte++;
            size_t k = kv_bytelevel_map(&b, 1, pb);
            rc = vocab_set(v, i, pb, k, 0, KV_TOKT_NORMAL, path, err);
        } else {
            int k = snprintf(pb, sizeof pb, "t%d", (int)i);
            rc = vocab_set(v, i, pb, (size_t)k, -(float)i, KV_TOKT_NORMAL, path, err);
        }
    }
    return rc;
}

/* 1 when tok is byte-level BPE: every single byte is a piece and no piece is
 * a "<0xXX>" byte token. */
static int is_byte_level(const struct kv_tokenizer *tok) {
    int32_t n = kv_tok_n_vocab(tok);
    unsigned char seen[256] = {0};
    int n_seen = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t len;
        const char *p = kv_tok_piece(tok, i, &len);
        int ty = kv_tok_type(tok, i);
        if (ty == KV_TOKT_BYTE) return 0;
        if (p && len == 1 && ty != KV_TOKT_CONTROL && ty != KV_TOKT_USER && !seen[(uint8_t)p[0]])
            seen[(uint8_t)p[0]] = 1, n_seen++;
    }
    return n_seen == 256;
}

/* The model's tokenizer as ggufmodelw.h says. */
static int vocab_from_tokenizer(const struct kv_tokenizer *tok, const struct kv_config *c,
                                struct vocab *v, const char *path, struct kv_err *err) {
    int32_t nt = kv_tok_n_vocab(tok), n = (int32_t)c->vocab_size;
    if (nt > n)
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "tokenizer has %d pieces but the model's vocabulary has %d rows; llama.cpp "
                       "needs one piece per row",
                       (int)nt, (int)n);
    int rc = vocab_alloc(v, n, path, err);
    if (rc) return rc;
    int score_mode = kv_tok_mode(tok) == KV_TOK_SCORE;
    int gpt2 = !score_mode && is_byte_level(tok);
    v->model = gpt2 ? "gpt2" : "llama";
    v->bos = valid_id(kv_tok_bos(tok), c->bos_id, n);
    v->eos = valid_id(kv_tok_eos(tok), c->eos_id, n);
    v->unk = -1;
    v->add_bos = kv_tok_adds_bos(tok), v->add_eos = kv_tok_adds_eos(tok);
    v->space_prefix = gpt2 ? -1 : probe_space_prefix(tok);
    char *tmp = malloc(2 * KV_MAX_PIECE * 3 + 16);
    if (!tmp) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    for (int32_t i = 0; i < n && !rc; i++) {
        if (i >= nt) {
            int k = snprintf(tmp, 64, "[PAD%d]", (int)i);
            rc = vocab_set(v, i, tmp, (size_t)k, 0, KV_TOKT_UNUSED, path, err);
            continue;
        }
        size_t len;
        const char *p = kv_tok_piece(tok, i, &len);
        int ty = kv_tok_type(tok, i);
        if (ty < KV_TOKT_NORMAL || ty > KV_TOKT_BYTE) ty = KV_TOKT_NORMAL;
        if (ty == KV_TOKT_UNKNOWN && v->unk < 0) v->unk = i;
        if (!p) p = "", len = 0;
        if (len > KV_MAX_PIECE) len = KV_MAX_PIECE; /* kvcal's own limit: never longer */
        float score = 0;
        if (score_mode) {
            /* llama2.c stores SentencePiece's U+2581 as ' ' */
            size_t o = 0;
            for (size_t k = 0; k < len; k++) {
                if (p[k] == ' ') {
                    memcpy(tmp + o, "\xe2\x96\x81", 3);
                    o += 3;
                } else {
                    tmp[o++] = p[k];
                }
            }
            p = tmp, len = o;
            score = kv_tok_score(tok, i);
        } else if (gpt2) {
            if (ty != KV_TOKT_CONTROL && ty != KV_TOKT_USER) {
                len = kv_bytelevel_map(p, len, tmp);
                p = tmp;
            }
        } else if (ty == KV_TOKT_NORMAL || ty == KV_TOKT_USER) {
            score = -(float)i;
        }
        rc = vocab_set(v, i, p, len, score, ty, path, err);
    }
    free(tmp);
    return rc;
}

static void meta_vocab(struct meta *m, const struct vocab *v) {
    m_str(m, "tokenizer.ggml.model", v->model);
    if (!strcmp(v->model, "gpt2")) m_str(m, "tokenizer.ggml.pre", "default");
    m_arr_head(m, "tokenizer.ggml.tokens", T_STR, (uint64_t)v->n);
    for (int32_t i = 0; i < v->n; i++) b_str(&m->b, v->piece[i], v->len[i]);
    if (!strcmp(v->model, "llama")) {
        m_arr_head(m, "tokenizer.ggml.scores", T_F32, (uint64_t)v->n);
        for (int32_t i = 0; i < v->n; i++) b_f32(&m->b, v->score[i]);
    }
    m_arr_head(m, "tokenizer.ggml.token_type", T_I32, (uint64_t)v->n);
    for (int32_t i = 0; i < v->n; i++) b_u32(&m->b, (uint32_t)v->type[i]);
    if (!strcmp(v->model, "gpt2")) m_arr_head(m, "tokenizer.ggml.merges", T_STR, 0);
    if (v->bos >= 0) m_u32(m, "tokenizer.ggml.bos_token_id", (uint32_t)v->bos);
    if (v->eos >= 0) m_u32(m, "tokenizer.ggml.eos_token_id", (uint32_t)v->eos);
    if (v->unk >= 0) m_u32(m, "tokenizer.ggml.unknown_token_id", (uint32_t)v->unk);
    m_bool(m, "tokenizer.ggml.add_bos_token", v->add_bos);
    m_bool(m, "tokenizer.ggml.add_eos_token", v->add_eos);
    if (v->space_prefix >= 0) m_bool(m, "tokenizer.ggml.add_space_prefix", v->space_prefix);
}

/* ================================================================ tensors */

enum perm { PERM_NONE = 0, PERM_TO_INTERLEAVED, PERM_TO_HALF };

/* One tensor, streamed as rows x cols f32 source elements encoded to type
 * (a 1-D tensor that is permuted is n rows of 1, else 1 row of n). */
struct wtensor {
    char name[KV_MAX_NAME_LEN + 1];
    uint32_t type;
    int ndim;
    int64_t shape[3]; /* row-major, as stored */
    int64_t rows, cols;
    const float *src; /* NULL for a streamed model's weight: fetched as written */
    /* kinds stored stacked along the rows (gptneox's and phi3's attn_qkv,
     * phi3's ffn_up): each row read from its kind's weight as written, so
     * nothing is gathered; NULL otherwise */
    const struct kv_arch_tensor *stack;
    int kind;
    int64_t layer;
    enum perm perm;
    int64_t head_dim;
    uint64_t row_bytes, nbytes, rel;
};

/* Source row of stored row r: within each head of hd rows, the model's
 * pairing rearranged into the architecture's. */
static int64_t src_row(const struct wtensor *t, int64_t r) {
    if (t->perm == PERM_NONE) return r;
    int64_t hd = t->head_dim, half = hd / 2, j = r % hd, base = r - j;
    if (t->perm == PERM_TO_INTERLEAVED) return base + (j % 2) * half + j / 2; /* 2i+s <- s*half+i */
    return base + 2 * (j % half) + j / half;                                 /* s*half+i <- 2i+s */
}

struct plan {
    const struct kv_model *m;
    int fallback;          /* opts.fallback */
    int64_t n_fallback;    /* matrices written in the fallback type */
    const struct gguf_arch *ga;
    struct meta meta;
    struct wtensor *t;
    int64_t n_t, cap_t;
    float rope_div[KV_MAX_ROPE_FACTORS];
    uint64_t data_end;
    float **owned;         /* Gemma 2's norm gains with their 1 added, written from here */
    int64_t n_owned;
};

/* A block of n floats p owns (freed with the plan), or NULL when out of memory. */
static float *plan_own(struct plan *p, int64_t n) {
    float **ow = realloc(p->owned, (size_t)(p->n_owned + 1) * sizeof *ow);
    if (!ow) return NULL;
    p->owned = ow;
    float *buf = malloc((size_t)(n > 0 ? n : 1) * sizeof *buf);
    if (buf) p->owned[p->n_owned++] = buf;
    return buf;
}


static int plan_add(struct plan *p, const char *name, uint32_t type, int ndim, const int64_t *shape,
                    const float *src, enum perm perm, const char *path, struct kv_err *err) {
    if (p->n_t == p->cap_t) {
        int64_t cap = p->cap_t ? p->cap_t * 2 : 64;
        struct wtensor *q = realloc(p->t, (size_t)cap * sizeof *q);
        if (!q) return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
        p->t = q, p->cap_t = cap;
    }
    struct wtensor *t = &p->t[p->n_t];
    memset(t, 0, sizeof *t);
    KV_ASSERT(strlen(name) <= KV_MAX_NAME_LEN);
    strcpy(t->name, name);
    t->type = type, t->ndim = ndim, t->src = src, t->perm = perm;
    t->head_dim = p->m->cfg.head_dim;
    t->shape[0] = shape[0], t->shape[1] = ndim >= 2 ? shape[1] : 1, t->shape[2] = ndim == 3 ? shape[2] : 1;
    if (ndim == 3) /* [a, b, c] row-major: a*b rows of c */
        t->rows = shape[0] * shape[1], t->cols = shape[2];
    else if (ndim == 2)
        t->rows = shape[0], t->cols = shape[1];
    else if (perm != PERM_NONE)
        t->rows = shape[0], t->cols = 1;
    else
        t->rows = 1, t->cols = shape[0];
    int64_t be = kv_ggml_block_elems(type), bb = kv_ggml_block_bytes(type);
    KV_ASSERT(be > 0 && bb > 0);
    if (t->cols % be && p->fallback && kv_ggml_k_fallback(type) != type) {
        /* llama.cpp's quantiser does the same for rows that hold no whole
         * super-block */
        t->type = type = kv_ggml_k_fallback(type);
        be = kv_ggml_block_elems(type), bb = kv_ggml_block_bytes(type);
        p->n_fallback++;
    }
    if (t->cols % be) {
        char sb[64];
        kv_shape_str(sb, sizeof sb, shape, ndim);
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "tensor '%s' of shape %s has rows of %lld elements, not a whole number of "
                       "%s blocks of %lld",
                       name, sb, (long long)t->cols, kv_ggml_type_name(type), (long long)be);
    }
    t->row_bytes = (uint64_t)(t->cols / be * bb);
    t->nbytes = t->row_bytes * (uint64_t)t->rows;
    t->rel = (p->data_end + GW_ALIGN - 1) / GW_ALIGN * GW_ALIGN;
    p->data_end = t->rel + t->nbytes;
    p->n_t++;
    return KV_OK;
}

/* Block types need finite input (kv_ggml_quant). */
/* Rows r0.. of t, n of them, in src (stacked kinds: one kind's rows). */
static int check_rows(const struct wtensor *t, const float *src, int64_t r0, int64_t n,
                      const char *path, struct kv_err *err) {
    if (kv_ggml_block_elems(t->type) == 1) return KV_OK;
    for (int64_t i = 0; i < n * t->cols; i++)
        if (!isfinite(src[i]))
            return kv_fail(err, KV_ENUMERIC, path, KV_NO_OFFSET,
                           "tensor '%s' holds %g at row %lld, column %lld; %s needs finite weights",
                           t->name, (double)src[i], (long long)(r0 + i / t->cols),
                           (long long)(i % t->cols), kv_ggml_type_name(t->type));
    return KV_OK;
}

static int check_finite(const struct wtensor *t, const char *path, struct kv_err *err) {
    return check_rows(t, t->src, 0, t->rows, path, err);
}

/* The weights of t's stacked kinds (a streamed model's layer converted),
 * their row counts; returns how many kinds. */
static int stack_parts(const struct plan *p, const struct wtensor *t, const float **parts,
                       int64_t *rows) {
    int64_t total, cols;
    kv_arch_entry_shape(&p->m->cfg, t->stack, rows, &total, &cols);
    for (int k = 0; k < t->stack->n_kinds; k++)
        parts[k] = kv_model_weight(p->m, t->stack->kinds[k], t->layer);
    return t->stack->n_kinds;
}

/* Which weights of the arch's .gguf table the model stores, under which
 * names and types. */
static int plan_tensors(struct plan *p, uint32_t mtype, const char *path, struct kv_err *err) {
    const struct kv_model *m = p->m;
    const struct kv_config *c = &m->cfg;
    const struct kv_arch_desc *ad = kv_arch_desc(c->arch);
    const struct kv_arch_names *nm = &ad->gguf;
    int rc;
    enum kv_rope_scaling rs = c->rope_scaling.type;
    if (ad->rope && (rs == KV_ROPE_SCALING_LLAMA3 || rs == KV_ROPE_SCALING_FREQS)) {
        /* divisors of theta^(-2i/d), as llama.cpp divides its frequencies */
        int64_t half = c->head_dim / 2;
        double inv[KV_MAX_ROPE_FACTORS];
        KV_ASSERT(half <= KV_MAX_ROPE_FACTORS);
        kv_rope_freqs(c, c->max_seq_len, inv);
        for (int64_t i = 0; i < half; i++)
            p->rope_div[i] = (float)(pow((double)c->rope_theta, -2.0 * (double)i / (double)c->head_dim) / inv[i]);
        int64_t shape[1] = {half};
        if ((rc = plan_add(p, "rope_freqs.weight", KV_GGML_F32, 1, shape, p->rope_div, PERM_NONE,
                           path, err)))
            return rc;
    }
    if (rs == KV_ROPE_SCALING_LONGROPE) { /* phi3's factors, one per rotated pair */
        int64_t shape[1] = {c->rope_scaling.n_factors};
        if ((rc = plan_add(p, "rope_factors_long.weight", KV_GGML_F32, 1, shape,
                           c->rope_scaling.long_factor, PERM_NONE, path, err)) ||
            (rc = plan_add(p, "rope_factors_short.weight", KV_GGML_F32, 1, shape,
                           c->rope_scaling.short_factor, PERM_NONE, path, err)))
            return rc;
    }
    enum perm perm = PERM_NONE;
    if (ad->rope && c->rope_layout != p->ga->rope_layout)
        perm = p->ga->rope_layout == KV_ROPE_INTERLEAVED ? PERM_TO_INTERLEAVED : PERM_TO_HALF;
    for (int64_t l = -1; l < c->n_layers; l++) {
        const struct kv_arch_tensor *tab = l < 0 ? nm->globals : nm->layer;
        int64_t n = l < 0 ? nm->n_globals : nm->n_layer;
        for (int64_t i = 0; i < n; i++) {
            const struct kv_arch_tensor *e = &tab[i];
            KV_ASSERT(!e->conv && !e->heads); /* llama.cpp stacks only whole kinds */
            enum kv_wkind k = e->kinds[0];
            if (e->n_kinds > 1) { /* attn_qkv, ffn_up: the kinds' rows one after the other */
                KV_ASSERT(perm == PERM_NONE && l >= 0);
                int64_t shape[2], rows[3];
                int nd = kv_arch_entry_shape(c, e, rows, &shape[0], &shape[1]);
                char name[KV_MAX_NAME_LEN + 1];
                snprintf(name, sizeof name, "%s%lld.%s", nm->layer_prefix, (long long)l, e->name);
                if ((rc = plan_add(p, name, nd == 2 ? mtype : KV_GGML_F32, nd, shape, NULL,
                                   PERM_NONE, path, err)))
                    return rc;
                struct wtensor *t = &p->t[p->n_t - 1];
                t->stack = e, t->layer = l;
                const float *parts[3];
                stack_parts(p, t, parts, rows);
                int64_t r0 = 0;
                for (int q = 0; q < e->n_kinds; r0 += rows[q], q++) {
                    if (!parts[q])
                        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                                       "the model has no %s weight in some layer",
                                       kv_wkind_name(e->kinds[q]));
                    /* a stacked vector (the biases) is one F32 row: nothing to check */
                    if (nd == 2 && (rc = check_rows(t, parts[q], r0, rows[q], path, err))) return rc;
                }
                continue;
            }
            if (kv_wkind_use(c, k) == KV_WUSE_NONE) continue;
            const float *w = kv_model_weight(m, k, l < 0 ? 0 : l);
            if (!w) {
                if (kv_wkind_use(c, k) == KV_WUSE_OPTIONAL) continue;
                return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET, "the model has no %s weight%s",
                               kv_wkind_name(k), l < 0 ? "" : " in some layer");
            }
            int64_t shape[2];
            int nd = kv_model_expected_shape(c, k, shape);
            float *shifted = NULL;
            if (ad->post_norms && kv_wkind_is_stream_norm(k) && c->norm_offset != 0) { /* llama.cpp: gains with the 1 added */
                if (!(shifted = plan_own(p, shape[0])))
                    return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
                for (int64_t j = 0; j < shape[0]; j++) shifted[j] = c->norm_offset + w[j];
                w = shifted;
            }
            char name[KV_MAX_NAME_LEN + 1];
            if (l < 0)
                snprintf(name, sizeof name, "%s", e->name);
            else
                snprintf(name, sizeof name, "%s%lld.%s", nm->layer_prefix, (long long)l, e->name);
            /* the per-head norms scale q and k element by element before
             * RoPE: their weights move with the rows they scale */
            int qk = k == KV_W_Q || k == KV_W_K || k == KV_W_BQ || k == KV_W_BK ||
                     k == KV_W_QNORM || k == KV_W_KNORM;
            if ((rc = plan_add(p, name, nd == 2 ? mtype : KV_GGML_F32, nd, shape, w,
                               qk ? perm : PERM_NONE, path, err)) ||
                (rc = check_finite(&p->t[p->n_t - 1], path, err)))
                return rc;
            /* a streamed model's layer slot is reused: fetch it again when writing */
            struct wtensor *t = &p->t[p->n_t - 1];
            t->kind = k, t->layer = l < 0 ? 0 : l;
            if (kv_model_is_streamed(m) && !shifted) t->src = NULL;
        }
    }
    return KV_OK;
}

/* The architecture's keys and the rope scaling keys. */
static void meta_hparams(struct plan *p) {
    const struct kv_config *c = &p->m->cfg;
    const struct gguf_arch *ga = p->ga;
    struct meta *m = &p->meta;
    char key[256];
    m_str(m, "general.architecture", ga->name);
    m_str(m, "general.name", "kvcal");
    for (int i = 0; i < ga->n_keys; i++) {
        const struct hp_key *k = &ga->keys[i];
        if (k->odd_head_dim && c->head_dim * c->n_heads == c->dim) continue;
        snprintf(key, sizeof key, "%s.%s", ga->name, k->suffix);
        switch (k->what) {
        case HP_CTX: m_u32(m, key, (uint32_t)c->max_seq_len); break;
        case HP_DIM: m_u32(m, key, (uint32_t)c->dim); break;
        case HP_LAYERS: m_u32(m, key, (uint32_t)c->n_layers); break;
        case HP_FF: m_u32(m, key, (uint32_t)c->hidden_dim); break;
        case HP_HEADS: m_u32(m, key, (uint32_t)c->n_heads); break;
        case HP_KV_HEADS: m_u32(m, key, (uint32_t)c->n_kv_heads); break;
        case HP_HEAD_DIM: m_u32(m, key, (uint32_t)c->head_dim); break;
        case HP_ROPE_BASE: m_f32(m, key, c->rope_theta); break;
        case HP_NORM_EPS: m_f32(m, key, c->norm_eps); break;
        case HP_VOCAB: m_u32(m, key, (uint32_t)c->vocab_size); break;
        case HP_ROPE_DIM: m_u32(m, key, (uint32_t)kv_rope_dim(c)); break;
        }
    }
    if (c->arch == KV_ARCH_GPTNEOX) {
        snprintf(key, sizeof key, "%s.use_parallel_residual", ga->name);
        m_bool(m, key, c->parallel_residual);
    }
    if (c->arch == KV_ARCH_GEMMA2) { /* every even layer's window; the soft-caps */
        if (c->sliding_window > 0) {
            snprintf(key, sizeof key, "%s.attention.sliding_window", ga->name);
            m_u32(m, key, (uint32_t)c->sliding_window);
        }
        if (c->attn_softcap > 0) {
            snprintf(key, sizeof key, "%s.attn_logit_softcapping", ga->name);
            m_f32(m, key, c->attn_softcap);
        }
        if (c->final_softcap > 0) {
            snprintf(key, sizeof key, "%s.final_logit_softcapping", ga->name);
            m_f32(m, key, c->final_softcap);
        }
    }
    const struct kv_rope_scaling_cfg *s = &c->rope_scaling;
    if (s->type == KV_ROPE_SCALING_LONGROPE) { /* phi3 (check_rope): factors are tensors */
        snprintf(key, sizeof key, "%s.rope.scaling.original_context_length", ga->name);
        m_u32(m, key, (uint32_t)s->original_ctx);
        double af = s->attention_factor > 0 ? s->attention_factor
                    : s->factor <= 1      ? 1.0
                                          : sqrt(1 + log(s->factor) / log((double)s->original_ctx));
        snprintf(key, sizeof key, "%s.rope.scaling.attn_factor", ga->name);
        m_f32(m, key, (float)af);
    }
    if (s->type == KV_ROPE_SCALING_LINEAR || s->type == KV_ROPE_SCALING_YARN) {
        snprintf(key, sizeof key, "%s.rope.scaling.type", ga->name);
        m_str(m, key, s->type == KV_ROPE_SCALING_LINEAR ? "linear" : "yarn");
        snprintf(key, sizeof key, "%s.rope.scaling.factor", ga->name);
        m_f32(m, key, (float)s->factor);
    }
    if (s->type == KV_ROPE_SCALING_YARN) {
        snprintf(key, sizeof key, "%s.rope.scaling.original_context_length", ga->name);
        m_u32(m, key, (uint32_t)s->original_ctx);
        if (s->attention_factor > 0) {
            /* llama.cpp multiplies cos and sin by attn_factor times its own
             * 1 + 0.1 ln(factor) (1 for factor <= 1), which is what kvcal
             * uses when attention_factor is 0 */
            double dflt = s->factor <= 1 ? 1.0 : 1.0 + 0.1 * log(s->factor);
            snprintf(key, sizeof key, "%s.rope.scaling.attn_factor", ga->name);
            m_f32(m, key, (float)(s->attention_factor / dflt));
        }
    }
}

/* The rope scaling of c, refused unless ga's keys express it exactly:
 * none, linear, yarn as llama.cpp computes it (beta_fast 32 and beta_slow 1,
 * the only values its llama, qwen2 and qwen3 graphs use: they read no
 * yarn_beta_* key; the correction range rounded to whole dimensions), and,
 * where ga reads rope_freqs.weight, llama3 and per-pair divisors. */
static int check_rope(const struct kv_config *c, const struct gguf_arch *ga, const char *path,
                      struct kv_err *err) {
    const struct kv_rope_scaling_cfg *s = &c->rope_scaling;
    enum kv_rope_scaling rs = s->type;
    if (!kv_arch_desc(c->arch)->rope || rs == KV_ROPE_SCALING_NONE || rs == KV_ROPE_SCALING_LINEAR)
        return KV_OK;
    if (ga->rope_freqs && (rs == KV_ROPE_SCALING_LLAMA3 || rs == KV_ROPE_SCALING_FREQS)) return KV_OK;
    if (c->arch == KV_ARCH_PHI3 && rs == KV_ROPE_SCALING_LONGROPE) return KV_OK;
    if (rs != KV_ROPE_SCALING_YARN)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "rope scaling '%s' cannot be written to gguf '%s' yet; kvcal writes %s",
                       kv_rope_scaling_name(rs), ga->name,
                       ga->rope_freqs ? "default, linear, yarn, llama3 and per-pair divisors "
                                        "(rope_freqs.weight)"
                                      : "default, linear and yarn (llama.cpp reads no "
                                        "rope_freqs.weight for it)");
    if (s->beta_fast != 32 || s->beta_slow != 1)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "rope scaling 'yarn' with beta_fast %g and beta_slow %g cannot be written "
                       "to gguf '%s'; llama.cpp uses 32 and 1 there",
                       s->beta_fast, s->beta_slow, ga->name);
    if (!s->truncate)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "rope scaling 'yarn' with truncate false cannot be written to gguf '%s'; "
                       "llama.cpp rounds the correction range to whole dimensions",
                       ga->name);
    if (s->original_ctx > (int64_t)UINT32_MAX)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "rope scaling 'yarn': original context %lld does not fit gguf's u32 "
                       "original_context_length",
                       (long long)s->original_ctx);
    return KV_OK;
}

/* ================================================================ output */

struct out {
    int fd;
    uint8_t *buf;
    size_t len, cap;
    uint64_t pos;
    int e;
};

static void o_flush(struct out *o) {
    const uint8_t *p = o->buf;
    size_t n = o->len;
    while (n && !o->e) {
        ssize_t r = write(o->fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            o->e = r < 0 ? errno : EIO;
            break;
        }
        p += r, n -= (size_t)r;
    }
    o->len = 0;
}

static void o_put(struct out *o, const void *p, size_t n) {
    const uint8_t *b = p;
    o->pos += n;
    while (n && !o->e) {
        size_t k = o->cap - o->len < n ? o->cap - o->len : n;
        memcpy(o->buf + o->len, b, k);
        o->len += k, b += k, n -= k;
        if (o->len == o->cap) o_flush(o);
    }
}

static void o_u32(struct out *o, uint32_t v) {
    uint8_t x[4];
    for (int i = 0; i < 4; i++) x[i] = (uint8_t)(v >> (8 * i));
    o_put(o, x, 4);
}

static void o_u64(struct out *o, uint64_t v) {
    uint8_t x[8];
    for (int i = 0; i < 8; i++) x[i] = (uint8_t)(v >> (8 * i));
    o_put(o, x, 8);
}

static void o_pad(struct out *o) {
    static const uint8_t zeros[GW_ALIGN];
    o_put(o, zeros, (GW_ALIGN - o->pos % GW_ALIGN) % GW_ALIGN);
}

static int fill(int fd, const char *path, const char *tmp, void *ctx, struct kv_err *err) {
    struct plan *p = ctx;
    struct out o = {.fd = fd, .cap = GW_STAGE};
    uint64_t max_row = 1;
    for (int64_t i = 0; i < p->n_t; i++)
        if (p->t[i].row_bytes > max_row) max_row = p->t[i].row_bytes;
    uint8_t *row = malloc((size_t)max_row);
    o.buf = malloc(o.cap);
    if (!row || !o.buf) {
        free(row), free(o.buf);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    o_put(&o, "GGUF", 4);
    o_u32(&o, GW_VERSION);
    o_u64(&o, (uint64_t)p->n_t);
    o_u64(&o, p->meta.n);
    o_put(&o, p->meta.b.p, p->meta.b.len);
    for (int64_t i = 0; i < p->n_t; i++) {
        const struct wtensor *t = &p->t[i];
        o_u64(&o, strlen(t->name));
        o_put(&o, t->name, strlen(t->name));
        o_u32(&o, (uint32_t)t->ndim);
        for (int d = t->ndim - 1; d >= 0; d--) o_u64(&o, (uint64_t)t->shape[d]); /* ne[0] innermost */
        o_u32(&o, t->type);
        o_u64(&o, t->rel);
    }
    o_pad(&o);
    uint64_t data_off = o.pos;
    for (int64_t i = 0; i < p->n_t && !o.e; i++) {
        const struct wtensor *t = &p->t[i];
        KV_ASSERT(o.pos == data_off + t->rel);
        const float *src = t->src || t->stack ? t->src : kv_model_weight(p->m, (enum kv_wkind)t->kind, t->layer);
        const float *parts[3];
        int64_t prows[3];
        if (t->stack) stack_parts(p, t, parts, prows);
        if (t->stack && t->ndim == 1) { /* stacked vectors (biases): one row, the parts in turn */
            for (int q = 0; q < t->stack->n_kinds; q++) {
                int qrc = kv_ggml_quant(t->type, parts[q], row, prows[q]);
                KV_ASSERT(qrc == KV_OK && t->type == KV_GGML_F32); /* row holds the whole vector */
                o_put(&o, row, (size_t)prows[q] * sizeof(float));
            }
            o_pad(&o);
            continue;
        }
        for (int64_t r = 0; r < t->rows && !o.e; r++) {
            const float *sr;
            if (t->stack) { /* row r of the kind it falls in */
                int q = 0;
                int64_t rr = r;
                while (rr >= prows[q]) rr -= prows[q++];
                sr = parts[q] + rr * t->cols;
            } else {
                sr = src + src_row(t, r) * t->cols;
            }
            int qrc = kv_ggml_quant(t->type, sr, row, t->cols);
            KV_ASSERT(qrc == KV_OK); /* type, row length and values checked by the plan */
            o_put(&o, row, (size_t)t->row_bytes);
        }
        o_pad(&o);
    }
    o_flush(&o);
    free(row), free(o.buf);
    if (o.e) {
        char eb[128];
        return kv_fail(err, KV_EIO, path, KV_NO_OFFSET, "cannot write '%s': %s", tmp,
                       kv_errtext(o.e, eb, sizeof eb));
    }
    return KV_OK;
}

/* ================================================================ entry point */

static const char *TYPES_WRITTEN =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K";

static int plan_mla_tensors(struct plan *p, const struct kv_mla *mla, uint32_t mtype,
                            const char *path, struct kv_err *err);
static void meta_mla(struct plan *p, const struct kv_mla *mla);

/* The vocabulary, the tensors and the metadata of p's model (its own
 * architecture's, or mla's deepseek2 when mla is not NULL), then the
 * file, atomically; p's buffers freed. */
static int write_planned(struct plan *p, const struct kv_mla *mla, uint32_t mtype, const char *path,
                         struct kv_gguf_write_opts *o, struct kv_err *err) {
    const struct kv_config *c = &p->m->cfg;
    struct vocab v = {0};
    const struct kv_tokenizer *tok = kv_model_tokenizer(p->m);
    int rc = tok ? vocab_from_tokenizer(tok, c, &v, path, err) : vocab_synthetic(c, &v, path, err);
    if (!rc) rc = vocab_check_unique(&v, path, err);
    if (!rc) rc = mla ? plan_mla_tensors(p, mla, mtype, path, err) : plan_tensors(p, mtype, path, err);
    if (!rc) {
        if (mla)
            meta_mla(p, mla);
        else
            meta_hparams(p);
        meta_vocab(&p->meta, &v);
        if (p->meta.b.oom) rc = kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    vocab_free(&v);
    if (!rc) rc = kv_write_atomic(path, fill, p, err);
    free(p->meta.b.p);
    free(p->t);
    for (int64_t i = 0; i < p->n_owned; i++) free(p->owned[i]);
    free(p->owned);
    if (!rc && o) o->n_fallback = p->n_fallback;
    return rc;
}

int kv_gguf_write_model(const struct kv_model *m, const char *path,
                        struct kv_gguf_write_opts *o, struct kv_err *err) {
    KV_ASSERT(m && path);
    const struct kv_config *c = &m->cfg;
    uint32_t mtype = o ? o->matrix_type : KV_GGML_F32;
    if (!kv_ggml_can_quant(mtype) || !kv_ggml_can_dequant(mtype)) {
        const char *tn = kv_ggml_type_name(mtype);
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "matrix type %u (%s) is not one kvcal can write; expected %s", mtype,
                       strcmp(tn, "?") ? tn : "unknown", TYPES_WRITTEN);
    }
    struct plan p = {.m = m, .ga = find_arch(c->arch), .fallback = o && o->fallback};
    if (!p.ga) {
        char names[256];
        size_t k = 0;
        for (int i = 0; i < COUNT(gguf_archs) && k < sizeof names; i++)
            k += (size_t)snprintf(names + k, sizeof names - k, "%s'%s'",
                                  i == 0 ? "" : i + 1 == COUNT(gguf_archs) ? " and " : ", ",
                                  kv_arch_name(gguf_archs[i].arch));
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "architecture '%s' cannot be written to gguf yet; kvcal writes %s",
                       kv_arch_name(c->arch), names);
    }
    if (c->arch == KV_ARCH_GEMMA2) {
        float want = kv_gguf_gemma2_attn_scale(c);
        if (kv_attn_scale(c) != want)
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "attention scale %g cannot be written to gguf 'gemma2': llama.cpp "
                           "takes 1/sqrt(%s) = %g, with no key to say otherwise",
                           (double)kv_attn_scale(c), c->n_layers == 46 ? "dim / heads" : "head_dim",
                           (double)want);
        if (c->sliding_window > 0 && (c->window_from || c->window_period != 2))
            return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                           "gguf 'gemma2' windows every even layer; this model's window is on "
                           "every %d from layer %d",
                           c->window_period, c->window_from);
    }
    if (c->sliding_window > 0 && c->arch == KV_ARCH_PHI3)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "sliding window of %lld positions cannot be written to gguf 'phi3': "
                       "llama.cpp reads phi3.attention.sliding_window but attends to every "
                       "earlier position (measured), so the file would be another model there",
                       (long long)c->sliding_window);
    if (c->sliding_window > 0 && c->arch != KV_ARCH_GEMMA2)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "sliding window of %lld positions cannot be written to gguf '%s': neither "
                       "kvcal nor llama.cpp reads a window key there, so the file would attend "
                       "to every earlier position",
                       (long long)c->sliding_window, p.ga->name);
    if (c->gelu_erf)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "this model's GELU is erf's, but llama.cpp runs gguf '%s' with the tanh "
                       "approximation, so the file would compute another model",
                       p.ga->name);
    if (p.ga->square_attn && c->n_heads * c->head_dim != c->dim)
        return kv_fail(err, KV_EUNSUPPORTED, path, KV_NO_OFFSET,
                       "n_heads * head_dim is %lld * %lld = %lld but dim is %lld; llama.cpp's "
                       "'%s' needs them equal",
                       (long long)c->n_heads, (long long)c->head_dim,
                       (long long)(c->n_heads * c->head_dim), (long long)c->dim, p.ga->name);
    int rc = check_rope(c, p.ga, path, err);
    if (rc) return rc;
    /* a row of gguf_archs needs a GGUF name for every weight its
     * architecture can hold, or plan_tensors would drop the weight */
    for (int k = 0; k < KV_W_COUNT; k++)
        KV_ASSERT(kv_wkind_use(c, (enum kv_wkind)k) == KV_WUSE_NONE ||
                  kv_arch_find(&kv_arch_desc(c->arch)->gguf, (enum kv_wkind)k, NULL));

    return write_planned(&p, NULL, mtype, path, o, err);
}

/* ================================================================ MLA (deepseek2) */

/* The model's weight k of layer l (-1: a global) under name, in type. */
static int plan_weight(struct plan *p, const char *name, enum kv_wkind k, int64_t l, uint32_t type,
                       const char *path, struct kv_err *err) {
    const struct kv_config *c = &p->m->cfg;
    const float *w = kv_model_weight(p->m, k, l < 0 ? 0 : l);
    if (!w)
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET, "the model has no %s weight%s",
                       kv_wkind_name(k), l < 0 ? "" : " in some layer");
    int64_t shape[2];
    int nd = kv_model_expected_shape(c, k, shape);
    int rc = plan_add(p, name, nd == 2 ? type : KV_GGML_F32, nd, shape, w, PERM_NONE, path, err);
    if (!rc) rc = check_finite(&p->t[p->n_t - 1], path, err);
    if (rc) return rc;
    struct wtensor *t = &p->t[p->n_t - 1];
    t->kind = k, t->layer = l < 0 ? 0 : l;
    if (kv_model_is_streamed(p->m)) t->src = NULL; /* fetched again when written */
    return KV_OK;
}

/* One of mla's own tensors. */
static int plan_mla(struct plan *p, const char *name, int64_t l, uint32_t type, int nd,
                    const int64_t *shape, const float *src, const char *path, struct kv_err *err) {
    char full[KV_MAX_NAME_LEN + 1];
    snprintf(full, sizeof full, "blk.%lld.%s", (long long)l, name);
    int rc = plan_add(p, full, nd >= 2 ? type : KV_GGML_F32, nd, shape, src, PERM_NONE, path, err);
    return rc ? rc : check_finite(&p->t[p->n_t - 1], path, err);
}

static int plan_mla_tensors(struct plan *p, const struct kv_mla *mla, uint32_t mtype,
                            const char *path, struct kv_err *err) {
    const struct kv_config *c = &p->m->cfg;
    int64_t d = c->dim, H = mla->n_heads, dc = mla->kv_lora_rank, R = mla->rope_dim;
    int64_t n = mla->nope_dim, v = mla->v_dim;
    int rc;
    if ((rc = plan_weight(p, "token_embd.weight", KV_W_TOK_EMB, -1, mtype, path, err)) ||
        (rc = plan_weight(p, "output_norm.weight", KV_W_OUT_NORM, -1, mtype, path, err)))
        return rc;
    if (!c->tied_embeddings && (rc = plan_weight(p, "output.weight", KV_W_LM_HEAD, -1, mtype, path, err)))
        return rc;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const struct kv_mla_layer *y = &mla->layers[l];
        char name[KV_MAX_NAME_LEN + 1];
#define W(suffix, kind)                                                                          \
    do {                                                                                         \
        snprintf(name, sizeof name, "blk.%lld." suffix, (long long)l);                           \
        if ((rc = plan_weight(p, name, kind, l, mtype, path, err))) return rc;                   \
    } while (0)
        W("attn_norm.weight", KV_W_ATTN_NORM);
        int64_t sq[2] = {H * (n + R), d}, sa[2] = {dc + R, d}, sn[1] = {dc};
        int64_t sk[3] = {H, dc, n}, sv[3] = {H, v, dc};
        if ((rc = plan_mla(p, "attn_q.weight", l, mtype, 2, sq, y->wq, path, err)) ||
            (rc = plan_mla(p, "attn_kv_a_mqa.weight", l, KV_GGML_F32, 2, sa, y->wkv_a, path, err)) ||
            (rc = plan_mla(p, "attn_kv_a_norm.weight", l, KV_GGML_F32, 1, sn, y->kv_norm, path, err)) ||
            (rc = plan_mla(p, "attn_k_b.weight", l, mtype, 3, sk, y->wk_b, path, err)) ||
            (rc = plan_mla(p, "attn_v_b.weight", l, mtype, 3, sv, y->wv_b, path, err)))
            return rc;
        W("attn_output.weight", KV_W_O);
        W("ffn_norm.weight", KV_W_FFN_NORM);
        W("ffn_gate.weight", KV_W_GATE);
        W("ffn_down.weight", KV_W_DOWN);
        W("ffn_up.weight", KV_W_UP);
#undef W
    }
    return KV_OK;
}

static void meta_mla(struct plan *p, const struct kv_mla *mla) {
    const struct kv_config *c = &p->m->cfg;
    struct meta *m = &p->meta;
    m_str(m, "general.architecture", "deepseek2");
    m_str(m, "general.name", "kvcal");
    m_u32(m, "deepseek2.context_length", (uint32_t)c->max_seq_len);
    m_u32(m, "deepseek2.embedding_length", (uint32_t)c->dim);
    m_u32(m, "deepseek2.block_count", (uint32_t)c->n_layers);
    m_u32(m, "deepseek2.feed_forward_length", (uint32_t)c->hidden_dim);
    m_u32(m, "deepseek2.attention.head_count", (uint32_t)mla->n_heads);
    m_u32(m, "deepseek2.attention.head_count_kv", 1); /* the latent: one "head" */
    m_u32(m, "deepseek2.attention.key_length", (uint32_t)(mla->kv_lora_rank + mla->rope_dim));
    m_u32(m, "deepseek2.attention.value_length", (uint32_t)mla->kv_lora_rank);
    m_u32(m, "deepseek2.attention.key_length_mla", (uint32_t)(mla->nope_dim + mla->rope_dim));
    m_u32(m, "deepseek2.attention.value_length_mla", (uint32_t)mla->v_dim);
    m_u32(m, "deepseek2.rope.dimension_count", (uint32_t)mla->rope_dim);
    m_f32(m, "deepseek2.rope.freq_base", mla->rope_base);
    m_f32(m, "deepseek2.attention.layer_norm_rms_epsilon", c->norm_eps);
    m_u32(m, "deepseek2.leading_dense_block_count", (uint32_t)c->n_layers);
    m_u32(m, "deepseek2.attention.q_lora_rank", 0);
    m_u32(m, "deepseek2.attention.kv_lora_rank", (uint32_t)mla->kv_lora_rank);
    /* no experts; the FFN's width, as llama.cpp's converter writes for a dense model */
    m_u32(m, "deepseek2.expert_feed_forward_length", (uint32_t)c->hidden_dim);
    m_u32(m, "deepseek2.expert_count", 0);
    m_u32(m, "deepseek2.expert_used_count", 0);
    m_u32(m, "deepseek2.expert_shared_count", 0);
    m_u32(m, "deepseek2.vocab_size", (uint32_t)c->vocab_size);
    /* kvcal reads the attention back and runs it with the base's other weights */
    m_str(m, "kvcal.mla.base_fingerprint", mla->base_fingerprint);
}

int kv_gguf_write_mla(const struct kv_model *m, const struct kv_mla *mla, const char *path,
                      struct kv_gguf_write_opts *o, struct kv_err *err) {
    KV_ASSERT(m && mla && path);
    const struct kv_config *c = &m->cfg;
    uint32_t mtype = o ? o->matrix_type : KV_GGML_F32;
    if (!kv_ggml_can_quant(mtype) || !kv_ggml_can_dequant(mtype))
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "matrix type %u is not one kvcal can write; expected %s", mtype, TYPES_WRITTEN);
    KV_ASSERT(mla->n_layers == c->n_layers && mla->layers);
    struct plan p = {.m = m, .ga = find_arch(KV_ARCH_LLAMA), .fallback = o && o->fallback};
    return write_planned(&p, mla, mtype, path, o, err);
}
