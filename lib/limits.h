/* Named limits for everything read from untrusted files.
 * Parsers compare against these before allocating or looping. */
#ifndef KV_LIMITS_H
#define KV_LIMITS_H

#define KV_MAX_DIMS 4                       /* tensor rank (GGUF allows 4) */
#define KV_MAX_NAME_LEN 255                 /* tensor name bytes */
#define KV_MAX_ST_HEADER (100u * 1000u * 1000u) /* safetensors JSON header */
#define KV_MAX_JSON_BYTES (256u << 20)      /* config.json, tokenizer.json, index */
#define KV_MAX_TENSORS (1 << 20)            /* tensors in one file */
#define KV_MAX_KV_PAIRS (1 << 20)           /* GGUF metadata pairs */
#define KV_MAX_STRING (16u << 20)           /* one GGUF string */
#define KV_MAX_ARRAY (1u << 28)             /* elements in one GGUF array */
#define KV_MAX_SHARDS 4096                  /* safetensors shards */
#define KV_MAX_LAYERS 1024
#define KV_MAX_VOCAB (1 << 22)
#define KV_MAX_PIECE 4096                   /* bytes in one vocabulary piece */
#define KV_MAX_DIM (1 << 20)                /* any model dimension */
#define KV_MAX_CTX (1 << 20)                /* sequence length */

#endif
