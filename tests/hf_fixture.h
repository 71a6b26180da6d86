/* What the HF suites share (test_hfdir.c, test_hfgpt2.c, test_tokjson.c):
 * files written into a checkpoint directory, the loader called expecting
 * success or an exact message, and a hand-worked tokenizer.json. */
#ifndef KV_HF_FIXTURE_H
#define KV_HF_FIXTURE_H

#include <stdio.h>
#include <string.h>

#include "hfdir.h"
#include "model.h"
#include "testutil.h"

#define SP "\xe2\x96\x81" /* U+2581, SentencePiece's space */

/* Write text as dir/name. */
static inline void write_text(const char *dir, const char *name, const char *text) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
}

/* An error as one line, without the detection site. */
static inline void err_line(const struct kv_err *e, char *buf, size_t cap) {
    kv_err_format(e, buf, cap, 0);
}

/* The weight of kind k (of layer, for per-layer kinds) bound in m, or NULL. */
static inline const float *bound(const struct kv_model *m, enum kv_wkind k, int64_t layer) {
    switch (k) {
    case KV_W_TOK_EMB: return m->tok_emb;
    case KV_W_LM_HEAD: return m->lm_head;
    case KV_W_OUT_NORM: return m->out_norm;
    default: return m->layers[layer].w[k];
    }
}

/* Load the HF directory dir; fails the test on an error. */
static inline struct kv_model *load_ok(const char *dir) {
    struct kv_model *m = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    char msg[2200];
    int rc = kv_hf_load(dir, &m, &e);
    err_line(&e, msg, sizeof msg);
    cr_assert_eq(rc, KV_OK, "kv_hf_load: %s", msg);
    return m;
}

/* Load dir expecting failure with code and exactly "<dir>/<tail>". */
static inline void load_fails(const char *dir, int code, const char *tail) {
    struct kv_model *m = NULL;
    struct kv_err e;
    kv_err_clear(&e);
    int rc = kv_hf_load(dir, &m, &e);
    char msg[2200], want[2200];
    err_line(&e, msg, sizeof msg);
    snprintf(want, sizeof want, "%s/%s", dir, tail);
    cr_assert_eq(rc, code, "status %s, expected %s: %s", kv_status_name(rc), kv_status_name(code),
                 msg);
    cr_assert_null(m);
    cr_assert_str_eq(msg, want);
}

/* Hand-worked vocabulary. Merge ranks: 0 "a b", 1 "▁ a", 2 "▁ ab", 3 "b c",
 * 4 "c a". Pieces: <unk> 0, <s> 1, </s> 2, ▁ 3, a 4, b 5, c 6, ▁a 7, ab 8,
 * ▁ab 9, bc 10, <0x21> 11, ca 12. */
#define HAND_HEAD                                                                          \
    "{\"version\": \"1.0\",\n"                                                               \
    " \"added_tokens\": [{\"id\": 0, \"content\": \"<unk>\", \"special\": true},\n"           \
    "                  {\"id\": 1, \"content\": \"<s>\", \"special\": true},\n"               \
    "                  {\"id\": 2, \"content\": \"</s>\", \"special\": true}],\n"             \
    " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [\n"                          \
    "    {\"type\": \"Prepend\", \"prepend\": \"" SP "\"},\n"                                   \
    "    {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"" SP "\"}]},\n" \
    " \"pre_tokenizer\": null,\n"                                                            \
    " \"post_processor\": {\"type\": \"TemplateProcessing\",\n"                              \
    "    \"single\": [{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}},\n"                \
    "               {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}],\n"                       \
    "    \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1], \"tokens\": [\"<s>\"]}}},\n" \
    " \"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"byte_fallback\": true,\n"       \
    "   \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"" SP "\": 3, \"a\": 4, \"b\": 5,"   \
    " \"c\": 6, \"" SP "a\": 7, \"ab\": 8, \"" SP "ab\": 9, \"bc\": 10, \"<0x21>\": 11, \"ca\": 12},\n"

static const char hand_string_merges[] =
    HAND_HEAD "   \"merges\": [\"a b\", \"" SP " a\", \"" SP " ab\", \"b c\", \"c a\"]}}\n";

#endif
