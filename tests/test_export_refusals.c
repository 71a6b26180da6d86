/* Dense export (kv_lr_export_dense), refusals: postrope_rotation keys, OUT
 * naming the source, a non-empty directory, mismatched factors or model,
 * centred factors for a model without K/V biases, with nothing written.
 * Then `kvcal export` on directories written by kv_lr_dir_write: usage
 * errors, a success, and the exact refusal lines (with the hint for centred
 * factors). */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export.h"
#include "export_fixture.h"
#include "kvdir.h"
#include "lrmodel.h"
#include "model.h"
#include "testutil.h"

/* ---------------------------------------------------------------- helpers */

static void copy_file(const char *src, const char *dst) {
    size_t n;
    char *b = kvt_read_file(src, &n);
    cr_assert_not_null(b, "cannot read %s", src);
    write_bytes(dst, b, n);
    free(b);
}

/* Expects a refusal with code and a message containing each of the (up to
 * three) fragments. */
static void export_fails(const struct kv_model *m, const char *path, const struct kv_lowrank *lr,
                         const char *out, int code, const char *f1, const char *f2,
                         const char *f3) {
    struct kv_err err;
    kv_err_clear(&err);
    int rc = kv_lr_export_dense(m, path, lr, out, NULL, &err);
    char line[2200];
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, code, "expected %s, got %s: %s", kv_status_name(code), kv_status_name(rc), line);
    const char *frag[3] = {f1, f2, f3};
    for (int i = 0; i < 3; i++)
        if (frag[i]) cr_assert(strstr(line, frag[i]), "message '%s' lacks '%s'", line, frag[i]);
    cr_assert(!(err.msg[0] >= 'A' && err.msg[0] <= 'Z'), "message '%s' starts uppercase", err.msg);
}

/* ---------------------------------------------------------------- refusals */

Test(export_dense, postrope_rotation_is_refused_before_writing) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_LATENT, K_POSTROPE, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 3);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out.bin");
    export_fails(m, s, lr, out, KV_EUNSUPPORTED, "layer 2 k", "'postrope_rotation'", "rope");
    cr_assert_eq(n_entries(dir), 0, "nothing may be written");
    kv_model_close(m);
    kv_lr_free(lr);

    /* the same for a directory export */
    KVT_NEED_SHARED(hf, "models/tinystories-656K");
    char *h = strdup(hf);
    m = open_ok(h);
    int k2[2] = {K_LATENT, K_POSTROPE};
    lr = make_lr(m, k2, 0, 0, 3);
    export_fails(m, h, lr, out, KV_EUNSUPPORTED, "layer 1 k", "'postrope_rotation'", NULL);
    cr_assert_eq(n_entries(dir), 0, "nothing may be written");
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(out);
    free(dir);
    free(h);
    free(s);
}

Test(export_dense, output_that_is_the_source_is_refused) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *dir = kvt_temp_dir();
    char *copy = kvt_path(dir, "model.bin");
    copy_file(src, copy);
    size_t n0;
    char *before = kvt_read_file(copy, &n0);
    struct kv_model *m = open_ok(copy);
    int k_mode[5] = {K_LATENT, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 5);
    export_fails(m, copy, lr, copy, KV_EINVAL, "is the source model", NULL, NULL);
    /* a hard link is the same file */
    char *link_path = kvt_path(dir, "alias.bin");
    cr_assert_eq(link(copy, link_path), 0);
    export_fails(m, copy, lr, link_path, KV_EINVAL, "is the source model", NULL, NULL);
    /* a source named like an old-style temporary of OUT (OUT.tmp) is no
     * clash: the export writes through a new name of its own */
    char *tmp_src = kvt_path(dir, "x.bin.tmp");
    cr_assert_eq(rename(link_path, tmp_src), 0);
    char *x = kvt_path(dir, "x.bin");
    struct kv_err xe;
    kv_err_clear(&xe);
    cr_assert_eq(kv_lr_export_dense(m, copy, lr, x, NULL, &xe), KV_OK, "%s", xe.msg);
    cr_assert_eq(kvt_tmp_left(x), 0);
    unlink(x);
    size_t n1;
    char *after = kvt_read_file(copy, &n1);
    cr_assert(n0 == n1 && !memcmp(before, after, n0), "the source changed");
    cr_assert_eq(n_entries(dir), 2);
    kv_model_close(m);

    /* a directory source named as its own output */
    KVT_NEED_SHARED(hf, "models/tinystories-656K");
    char *h = strdup(hf);
    m = open_ok(h);
    kv_lr_free(lr);
    int k2[2] = {K_LATENT, K_LATENT};
    lr = make_lr(m, k2, 0, 0, 5);
    export_fails(m, h, lr, h, KV_EINVAL, "is the source model", NULL, NULL);
    kv_model_close(m);
    kv_lr_free(lr);
    free(before), free(after), free(copy), free(link_path), free(tmp_src), free(x), free(h);
    rm_tree(dir);
    free(dir);
}

Test(export_dense, existing_outputs) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 9);
    char *dir = kvt_temp_dir();
    /* an existing file is replaced */
    char *out = kvt_path(dir, "out.bin");
    write_bytes(out, "old", 3);
    export_ok(m, s, lr, out);
    struct stat st, ss;
    cr_assert_eq(stat(out, &st), 0);
    cr_assert_eq(stat(s, &ss), 0);
    cr_assert_eq(st.st_size, ss.st_size);
    /* a directory where the file is due */
    char *sub = kvt_path(dir, "sub");
    cr_assert_eq(mkdir(sub, 0755), 0);
    export_fails(m, s, lr, sub, KV_EINVAL, "is a directory", NULL, NULL);
    kv_model_close(m);
    kv_lr_free(lr);

    KVT_NEED_SHARED(hf, "models/tinystories-656K");
    char *h = strdup(hf);
    m = open_ok(h);
    int k2[2] = {K_LATENT, K_FULL};
    lr = make_lr(m, k2, 0, 0, 9);
    /* an empty directory is replaced; "OUT/" names OUT */
    char *with_slash = malloc(strlen(sub) + 2);
    sprintf(with_slash, "%s/", sub);
    export_ok(m, h, lr, with_slash);
    cr_assert_eq(n_entries(sub), n_entries(h));
    /* now it is not empty */
    export_fails(m, h, lr, sub, KV_EINVAL, "not empty", NULL, NULL);
    /* a file where the directory is due */
    export_fails(m, h, lr, out, KV_EINVAL, "not a directory", NULL, NULL);
    cr_assert_eq(n_entries(dir), 2, "no temporaries left behind");
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(dir), free(out), free(sub), free(with_slash), free(h), free(s);
}

Test(export_dense, mismatched_factors_or_model_are_refused) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 13);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out.bin");

    lr->info.head_dim++;
    export_fails(m, s, lr, out, KV_EINVAL, "factors are for 5 layers, dim 64, 8 heads (4 kv) of 9, but the model has", NULL, NULL);
    lr->info.head_dim--;

    memset(lr->info.model_fingerprint, 'a', 64);
    export_fails(m, s, lr, out, KV_EINVAL, "fingerprint", NULL, NULL);
    lr->info.model_fingerprint[0] = 0;

    /* a head in two units, a head in none */
    struct kv_lr_unit *u0 = &lr->layers[1].k.units[0];
    u0->head0 = 1;
    export_fails(m, s, lr, out, KV_EINVAL, "layer 1 k", "kv head 2 is in two units", NULL);
    u0->head0 = 0;
    lr->layers[1].k.n_units = 1;
    export_fails(m, s, lr, out, KV_EINVAL, "layer 1 k", "kv head 2 is in no unit", NULL);
    lr->layers[1].k.n_units = 2;

    /* a down bias where the model has no bias tensor */
    struct rng g = {1};
    lr->layers[3].v.units[1].down_bias = randn_f(&g, lr->layers[3].v.units[1].rank, 1);
    export_fails(m, s, lr, out, KV_EUNSUPPORTED, "layer 3 v unit 1", "no v bias tensor", NULL);
    free(lr->layers[3].v.units[1].down_bias);
    lr->layers[3].v.units[1].down_bias = NULL;

    /* the file named is not the one the model was loaded from */
    char *other = kvt_path(dir, "other.bin");
    size_t n;
    char *bytes = kvt_read_file(s, &n);
    const struct kv_tensor *wv = NULL;
    for (int64_t i = 0; i < m->n_tensors; i++)
        if (!strcmp(m->tensors[i].name, "layers.4.wv")) wv = &m->tensors[i];
    cr_assert(wv);
    bytes[wv->offset + 5] ^= 0x40;
    write_bytes(other, bytes, n);
    free(bytes);
    export_fails(m, other, lr, out, KV_EINVAL, "layers.4.wv", "differs from the", NULL);

    /* a synthetic model has no files */
    struct kv_model *syn;
    struct kv_err err;
    cr_assert_eq(kv_model_init_random(kv_model_config(m), 1, &syn, &err), KV_OK);
    export_fails(syn, s, lr, out, KV_EINVAL, "synthetic", NULL, NULL);
    kv_model_close(syn);

    cr_assert_eq(n_entries(dir), 1, "only other.bin: nothing written");
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(dir), free(out), free(other), free(s);
}

/* ---------------------------------------------------------------- the command */

/* Write lr for the model at model_path as a compressed-model directory. */
static char *write_lr_dir(const struct kv_model *m, const char *model_path,
                          const struct kv_lowrank *lr, const char *parent, const char *name) {
    char *dir = kvt_path(parent, name);
    struct kv_lr_dir_info info = {model_path, NULL, NULL, NULL};
    struct kv_err err;
    kv_err_clear(&err);
    char line[2200];
    int rc = kv_lr_dir_write(m, lr, &info, dir, &err);
    kv_err_format(&err, line, sizeof line, 1);
    cr_assert_eq(rc, KV_OK, "writing %s: %s", dir, line);
    return dir;
}

Test(export_cli, usage_errors_exit_2) {
    char *out, *errs;
    int rc = kvt_run_cli("export --model m.bin -o x.bin", &out, &errs);
    cr_assert_eq(rc, 2, "exit %d, stderr: %s", rc, errs);
    cr_assert_str_eq(errs, "kvcal export: missing --dense DIR\n"
                           "usage: kvcal export --dense DIR --model PATH -o OUT [options] | --mla --model PATH --stats FILE -o OUT[.gguf] "
                           "(see 'kvcal export --help')\n");
    cr_assert_str_eq(out, "");
    free(out), free(errs);
    rc = kvt_run_cli("export --dense d --model m.bin", &out, &errs);
    cr_assert_eq(rc, 2);
    cr_assert(!strncmp(errs, "kvcal export: missing --output\n", 31), "stderr: %s", errs);
    free(out), free(errs);
    rc = kvt_run_cli("export --help", &out, &errs);
    cr_assert_eq(rc, 0);
    cr_assert(strstr(out, "quality proxy") && strstr(out, "fdc and zack") && strstr(out, "examples:"),
              "help: %s", out);
    free(out), free(errs);
}

Test(export_cli, exports_a_decomposed_directory_and_refuses_postrope) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_FULL, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 1u << 3, 0, 17);
    kv_model_fingerprint(m, lr->info.model_fingerprint, NULL);
    char *dir = kvt_temp_dir();
    char *lrdir = write_lr_dir(m, s, lr, dir, "lr");
    char *out = kvt_path(dir, "dense.bin");
    char args[4096], *o, *e;
    snprintf(args, sizeof args, "export --dense %s --model %s -o %s", lrdir, s, out);
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 0, "exit %d, stderr: %s", rc, e);
    cr_assert(strstr(o, "replaced  k in 4 of 5 layers, v in 4 of 5"), "stdout: %s", o);
    free(o), free(e);
    struct kv_model *m2 = open_ok(out);
    cr_assert_gt(check_weights(m, m2, lr), 0);
    kv_model_close(m2);
    kv_lr_free(lr);

    int k2[5] = {K_LATENT, K_LATENT, K_POSTROPE, K_LATENT, K_LATENT};
    lr = make_lr(m, k2, 0, 0, 19);
    kv_model_fingerprint(m, lr->info.model_fingerprint, NULL);
    char *rotdir = write_lr_dir(m, s, lr, dir, "rot");
    char *out2 = kvt_path(dir, "rot.bin");
    snprintf(args, sizeof args, "export --dense %s --model %s -o %s", rotdir, s, out2);
    rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 1, "exit %d, stderr: %s", rc, e);
    char want[1200];
    snprintf(want, sizeof want,
             "kvcal: %s: layer 2 k: mode 'postrope_rotation' cannot be exported dense: its "
             "projection acts after rope, which no k_proj weight expresses\n",
             rotdir);
    cr_assert_str_eq(e, want);
    cr_assert_str_eq(o, "");
    struct stat st;
    cr_assert_neq(stat(out2, &st), 0, "nothing may be written");
    free(o), free(e);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(dir);
    free(dir), free(lrdir), free(rotdir), free(out), free(out2), free(s);
}

/* ---------------------------------------------------------------- centred factors */

Test(export_dense, centred_factors_without_kv_biases_are_refused) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_FULL, K_LATENT, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 0, 0, 29);
    fx_centre(m, lr, 3);
    char *dir = kvt_temp_dir();
    char *out = kvt_path(dir, "out.bin");
    struct kv_err err;
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_export_dense(m, s, lr, out, NULL, &err), KV_EUNSUPPORTED, "%s", err.msg);
    cr_assert_str_eq(err.msg, "layer 0 v unit 0: the factors are centred (a mean in up_bias) but "
                              "the model has no v bias tensor to hold the mean");
    /* keys alike, and the message names no option of the command line */
    for (int64_t u = 0; u < lr->layers[0].v.n_units; u++) {
        free(lr->layers[0].v.units[u].up_bias);
        lr->layers[0].v.units[u].up_bias = NULL;
    }
    kv_err_clear(&err);
    cr_assert_eq(kv_lr_export_dense(m, s, lr, out, NULL, &err), KV_EUNSUPPORTED, "%s", err.msg);
    cr_assert_str_eq(err.msg, "layer 1 k unit 0: the factors are centred (a mean in up_bias) but "
                              "the model has no k bias tensor to hold the mean");
    cr_assert_null(strstr(err.msg, "--"), "%s", err.msg);
    cr_assert_eq(n_entries(dir), 0, "nothing may be written");
    kv_model_close(m);
    kv_lr_free(lr);
    rm_tree(dir);
    free(out), free(dir), free(s);
}

Test(export_cli, refuses_centred_factors_without_kv_biases_with_a_hint) {
    KVT_NEED_SHARED(src, "models/stories260K/stories260K.bin");
    char *s = strdup(src);
    struct kv_model *m = open_ok(s);
    int k_mode[5] = {K_LATENT, K_FULL, K_LATENT, K_LATENT, K_LATENT};
    struct kv_lowrank *lr = make_lr(m, k_mode, 1u << 3, 0, 31);
    fx_centre(m, lr, 5);
    kv_model_fingerprint(m, lr->info.model_fingerprint, NULL);
    char *dir = kvt_temp_dir();
    char *lrdir = write_lr_dir(m, s, lr, dir, "centred");
    char *out = kvt_path(dir, "dense.bin");
    char args[4096], *o, *e;
    snprintf(args, sizeof args, "export --dense %s --model %s -o %s", lrdir, s, out);
    int rc = kvt_run_cli(args, &o, &e);
    cr_assert_eq(rc, 1, "exit %d, stderr: %s", rc, e);
    char want[1400];
    snprintf(want, sizeof want,
             "kvcal: %s: layer 0 k unit 0: the factors are centred (a mean in up_bias) but the "
             "model has no k bias tensor to hold the mean\n"
             "kvcal: hint: decompose without --center to export a model that has no k/v biases\n",
             lrdir);
    cr_assert_str_eq(e, want);
    cr_assert_str_eq(o, "");
    struct stat st;
    cr_assert_neq(stat(out, &st), 0, "nothing may be written");
    free(o), free(e);
    kv_lr_free(lr);
    kv_model_close(m);
    rm_tree(dir);
    free(dir), free(lrdir), free(out), free(s);
}
