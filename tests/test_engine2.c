/* A second engine against kvcal: tests/engine2/engine.js runs base and
 * compressed models from docs/formats.md alone (written from the docs, not
 * from kvcal's source; node, no packages). On the same tokens its mean NLL
 * must match `kvcal verify --json` for the base model and for compressed
 * directories of every key mode (prerope_latent, fused_query,
 * postrope_rotation; values fused_output), single-head and two-head units,
 * at 16 bits, at 4 bits with a Hadamard rotation and in mixed-bit bands
 * (--kv-bits auto). Skips without node. */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define ENGINE "tests/engine2/engine.js"
#define SEQ 128
#define WINDOWS 4

static int have_node(void) { return system("command -v node >/dev/null 2>&1") == 0; }

/* The mean NLL in a JSON object's key (kvcal's "nll" or "base_nll", the
 * engine's "nll"). */
static double nll_of(const char *text, const char *key, const char *what) {
    json_error_t je;
    json_t *o = json_loads(text, 0, &je);
    cr_assert_not_null(o, "%s: not json (%s):\n%s", what, je.text, text);
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "%s: no number '%s' in:\n%s", what, key, text);
    double x = json_number_value(v);
    json_decref(o);
    return x;
}

/* node ENGINE kind dir tokens: the engine's mean NLL. */
static double engine_nll(const char *kind, const char *dir, const char *tok) {
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "node " ENGINE " %s '%s' '%s' --seq-len %d --max-windows %d --json",
             kind, dir, tok, SEQ, WINDOWS);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "%s", cmd);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, p);
    buf[n] = 0;
    int st = pclose(p);
    cr_assert_eq(st, 0, "%s: status %d, output:\n%s", cmd, st, buf);
    return nll_of(buf, "nll", cmd);
}

/* The tokens: BOS then the bytes of a text (both fixtures' tokenizers are
 * byte-level, 256 = bos), WINDOWS windows of SEQ. */
static char *write_tokens(const char *dir) {
    size_t len = 0;
    char *text = kvt_read_file("data/kjv/gospels.txt", &len);
    cr_assert(text && len >= (size_t)(SEQ * WINDOWS));
    char *path = kvt_path(dir, "tok.bin");
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    for (int i = 0; i < SEQ * WINDOWS + 1; i++) {
        uint32_t id = i ? (unsigned char)text[i - 1] : 256u;
        unsigned char le[4] = {(unsigned char)id, (unsigned char)(id >> 8),
                               (unsigned char)(id >> 16), (unsigned char)(id >> 24)};
        cr_assert_eq(fwrite(le, 1, 4, f), 4u);
    }
    cr_assert_eq(fclose(f), 0);
    free(text);
    return path;
}

static void check_model(const char *model) {
    if (!have_node())
        cr_skip_test("node is not installed; the second engine (" ENGINE ") needs it");
    char *dir = kvt_temp_dir(), *tok = write_tokens(dir);
    /* Calibration on the fixtures' training text, scored on the held-out
     * Gospels: fixed inputs, so a doc edit cannot move a 4-bit code across a
     * rounding boundary and the result is the same on every checkout. */
    const char *cal = "data/kjv/train.txt";
    char *st = kvt_path(dir, "s.kvstats"), args[16384], *out, *err;
    snprintf(args, sizeof args,
             "collect -m %s -t '%s' --seq-len %d --samples 48 --threads 1 -q -o '%s'", model, cal,
             SEQ, st);
    int rc = kvt_run_cli(args, &out, &err);
    cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, err);
    free(out), free(err);

    const struct {
        const char *name, *opts;
        /* 16 bits: fp32 rounding alone (seen: 4e-8); 4 bits: a latent near a
         * rounding boundary takes the neighbouring code when the two engines'
         * fp32 sums differ in their last bit, one quantization step, which
         * moves the NLL of 508 tokens by up to about 4e-5 here (the scale
         * taken from the unrounded min, as the README once had it, moves
         * GPT-2's by 6e-4) */
        double rtol;
    } dirs[] = {
        {"palu", "--method palu --ratio 0.5", 1e-7},
        {"palu-c", "--method palu --ratio 0.5 --center", 1e-7}, /* the mean as up/o biases */
        {"palu-g2", "--method palu --group-size 2 --ratio 0.5", 1e-7},
        {"zack", "--method zack --ratio 0.5", 1e-7},
        {"palu4h", "--method palu --ratio 0.2 --kv-bits 4 --hadamard", 2e-4},
        /* bands of mixed bits, each quantized on its own */
        {"palu-auto", "--method palu --group-size 2 --kv-bits auto --ratio 0.15", 2e-4},
    };
    double base_engine = engine_nll("base", model, tok);
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        char *d = kvt_path(dir, dirs[i].name);
        snprintf(args, sizeof args, "decompose -m %s -s '%s' %s -q -o '%s'", model, st,
                 dirs[i].opts, d);
        rc = kvt_run_cli(args, &out, &err);
        cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, err);
        free(out), free(err);
        snprintf(args, sizeof args,
                 "verify -m %s --tokens '%s' --compressed '%s' --seq-len %d --max-windows %d "
                 "--threads 1 --json -q",
                 model, tok, d, SEQ, WINDOWS);
        rc = kvt_run_cli(args, &out, &err);
        cr_assert_eq(rc, 0, "kvcal %s: exit %d\n%s", args, rc, err);
        double kv_base = nll_of(out, "base_nll", args), kv = nll_of(out, "nll", args);
        double eng = engine_nll("comp", d, tok);
        char what[256];
        snprintf(what, sizeof what, "%s %s: mean nll, second engine against kvcal verify", model,
                 dirs[i].name);
        kvt_assert_close_f64(&eng, &kv, 1, 0, dirs[i].rtol, what);
        snprintf(what, sizeof what, "%s: base mean nll, second engine against kvcal verify",
                 model);
        kvt_assert_close_f64(&base_engine, &kv_base, 1, 0, 1e-7, what);
        cr_log_info("%s %s: nll kvcal %.9f, engine %.9f (rel %.1e); base %.9f, %.9f", model,
                    dirs[i].name, kv, eng, fabs(eng - kv) / kv, kv_base, base_engine);
        free(out), free(err), free(d);
    }
    free(st), free(tok);
    kvt_rm_dir(dir);
}

Test(engine2, gpt2_from_the_docs_matches_verify, .timeout = 300) {
    check_model("data/kjv-gpt2");
}

Test(engine2, llama_from_the_docs_matches_verify, .timeout = 300) {
    check_model("data/kjv-llama");
}
