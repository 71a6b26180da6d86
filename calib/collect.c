/* kvcal collect: plan -> windows -> accumulated sums -> checkpoints/output,
 * and the checks and setup a collect run makes before any of that. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "kvcalib.h"
#include "kvstats.h"

static const char *sampling_of(const struct kv_calib_opts *o) {
    return o->samples > 0 && !o->sequential ? "random" : "sequential";
}

/* Fill a fresh s with the run's identity and plan. */
static int start_fresh(struct kv_stats *s, const char *fp, struct kv_calib *c,
                       const struct kv_calib_opts *o, struct kv_err *err) {
    snprintf(s->info.fingerprint, sizeof s->info.fingerprint, "%s", fp);
    s->info.seq_len = o->seq_len;
    snprintf(s->info.sampling, sizeof s->info.sampling, "%s", sampling_of(o));
    s->info.seed = o->samples > 0 && !o->sequential ? o->seed : 0;
    s->info.samples = o->samples;
    s->info.shard_index = o->shard_index;
    s->info.shard_count = o->shard_count;
    s->info.plan_windows = kv_calib_n_windows(c);
    s->info.next_window = 0;
    kv_calib_tokenization(c, s->info.tokenization, sizeof s->info.tokenization);
    for (int64_t i = 0; i < kv_calib_n_inputs(c); i++) {
        const struct kv_calib_input *in = kv_calib_input(c, i);
        int rc = kv_stats_add_input(s, in->path, in->sha256, in->bytes, in->tokens, 0, err);
        if (rc) return rc;
    }
    return KV_OK;
}

#define DIFFER(what, fmt, a, b)                                                               \
    kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,                                               \
            "checkpoint does not match this run: " what " is " fmt " there and " fmt          \
            " here; rerun with the same options, or drop --resume to start over",             \
            a, b)

/* A resumed s must describe exactly the run c and o would make. */
static int check_resume(const struct kv_stats *s, const char *fp, struct kv_calib *c,
                        const struct kv_calib_opts *o, int fisher, const char *path,
                        struct kv_err *err) {
    if (strcmp(s->info.fingerprint, fp))
        return DIFFER("the model fingerprint", "%.12s", s->info.fingerprint, fp);
    if (s->info.seq_len != o->seq_len)
        return DIFFER("--seq-len", "%lld", (long long)s->info.seq_len, (long long)o->seq_len);
    if (strcmp(s->info.sampling, sampling_of(o)))
        return DIFFER("the sampling", "%s", s->info.sampling, sampling_of(o));
    char tz[sizeof s->info.tokenization];
    kv_calib_tokenization(c, tz, sizeof tz);
    if (s->info.tokenization[0] && strcmp(s->info.tokenization, tz))
        return DIFFER("the tokenization", "'%s'", s->info.tokenization, tz);
    if (s->info.samples != o->samples)
        return DIFFER("--samples", "%lld", (long long)s->info.samples, (long long)o->samples);
    if (!strcmp(s->info.sampling, "random") && s->info.seed != o->seed)
        return DIFFER("--seed", "%llu", (unsigned long long)s->info.seed, (unsigned long long)o->seed);
    if (s->info.shard_index != o->shard_index || s->info.shard_count != o->shard_count)
        return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                       "checkpoint does not match this run: --shard is %lld/%lld there and "
                       "%lld/%lld here", (long long)s->info.shard_index, (long long)s->info.shard_count,
                       (long long)o->shard_index, (long long)o->shard_count);
    if (s->info.n_inputs != kv_calib_n_inputs(c))
        return DIFFER("the number of --text inputs", "%lld", (long long)s->info.n_inputs,
                      (long long)kv_calib_n_inputs(c));
    for (int64_t i = 0; i < s->info.n_inputs; i++) {
        const struct kv_calib_input *in = kv_calib_input(c, i);
        if (s->inputs[i].tokens != in->tokens)
            return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                           "checkpoint does not match this run: input %lld ('%s') has %lld tokens "
                           "here and %lld there; was another tokenizer used?", (long long)i + 1,
                           in->path, (long long)in->tokens, (long long)s->inputs[i].tokens);
        if (strcmp(s->inputs[i].sha256, in->sha256) || s->inputs[i].bytes != in->bytes)
            return kv_fail(err, KV_EINVAL, path, KV_NO_OFFSET,
                           "checkpoint does not match this run: input %lld ('%s') has sha256 "
                           "%.12s, the checkpoint recorded %.12s for '%s'", (long long)i + 1,
                           in->path, in->sha256, s->inputs[i].sha256, s->inputs[i].path);
    }
    if (s->info.plan_windows != kv_calib_n_windows(c))
        return DIFFER("the planned window count", "%lld", (long long)s->info.plan_windows,
                      (long long)kv_calib_n_windows(c));
    if (s->info.has_fisher != (fisher != 0))
        return DIFFER("--fisher", "%s", s->info.has_fisher ? "on" : "off", fisher ? "on" : "off");
    return KV_OK;
}

int kv_collect_run(const struct kv_model *m, struct kv_calib *c, struct kv_stats *s,
                   struct kv_collect_opts *opts, struct kv_err *err) {
    const struct kv_calib_opts *o = opts->data;
    const char *out = opts->out_path;
    char fp[65];
    int rc = kv_model_fingerprint(m, fp, err);
    if (rc) return rc;
    int fresh = !opts->resume;
    if (fresh && (s->info.windows || s->info.n_inputs))
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                       "a fresh run needs empty statistics from kv_stats_init");
    if (fresh && !(rc = start_fresh(s, fp, c, o, err)) && opts->fisher)
        rc = kv_stats_add_fisher(s, err);
    else if (!fresh)
        rc = check_resume(s, fp, c, o, opts->fisher, out, err);
    if (rc) return rc;
    struct kv_accum *a;
    if ((rc = kv_accum_init(m, s, o->seq_len, &a, err))) return rc;
    double t0 = kv_now();
    int64_t n = s->info.plan_windows, start = s->info.next_window, since_write = 0;
    int stop = 0;
    double loss_sum = 0;
    opts->checkpoints_written = 0;
    for (int64_t i = start; i < n && !rc && !stop; i++) {
        const int32_t *ids;
        int64_t input, win;
        if ((rc = kv_calib_window(c, i, &ids, &input, &win, err))) break;
        if ((rc = kv_accum_window(a, ids, err))) {
            if (!err->path[0]) snprintf(err->path, sizeof err->path, "%s", kv_calib_input(c, input)->path);
            size_t l = strlen(err->msg);
            snprintf(err->msg + l, sizeof err->msg - l, " (window %lld of this input)", (long long)win);
            break;
        }
        loss_sum += kv_accum_loss(a);
        s->info.tokens += o->seq_len;
        s->info.windows++;
        s->inputs[input].windows++;
        s->info.next_window = i + 1;
        since_write++;
        if (opts->progress)
            stop = opts->progress(opts->progress_ctx, i + 1 - start, n - start,
                                  (i + 1 - start) * o->seq_len);
        int ckpt = opts->checkpoint_every > 0 && (i + 1) % opts->checkpoint_every == 0;
        if (out && (ckpt || stop) && i + 1 < n) {
            if ((rc = kv_stats_write(s, out, err))) break;
            opts->checkpoints_written++;
            since_write = 0;
        }
    }
    if (!rc) {
        if (stop && s->info.next_window < n)
            rc = out ? kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET,
                               "interrupted after %lld of %lld windows; the checkpoint is saved, "
                               "continue with --resume", (long long)s->info.next_window, (long long)n)
                     : kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET,
                               "interrupted after %lld of %lld windows",
                               (long long)s->info.next_window, (long long)n);
        else if (out && (since_write || fresh))
            rc = kv_stats_write(s, out, err);
    }
    if (!opts->upper_only) kv_accum_sync(a);
    opts->seconds = kv_now() - t0;
    opts->loss = s->info.next_window > start ? loss_sum / (double)(s->info.next_window - start) : 0;
    opts->run_windows = s->info.next_window - start;
    opts->tokens_per_s =
        opts->seconds > 0 ? (double)(opts->run_windows * o->seq_len) / opts->seconds : 0;
    kv_accum_free(a);
    return rc;
}

/* ---------------------------------------------------------------- before the run */

/* The library's own names of the options, for messages without the caller's. */
static const char *const own_names[KV_COLLECT_OPT_COUNT] = {
    [KV_COLLECT_OPT_SEQ_LEN] = "sequence length",
    [KV_COLLECT_OPT_SAMPLES] = "samples",
    [KV_COLLECT_OPT_SHARD] = "shard",
    [KV_COLLECT_OPT_CHECKPOINT_EVERY] = "checkpoint every",
    [KV_COLLECT_OPT_TEXT] = "calibration",
    [KV_COLLECT_OPT_OUTPUT] = "the output path",
    [KV_COLLECT_OPT_RESUME] = "resume",
};

int kv_collect_check_options(const struct kv_collect_opts *o, const char *const *names,
                             struct kv_err *err) {
    int rc = kv_calib_check(o->data, names, err);
    if (rc) return rc;
    const char *const *n = names ? names : own_names;
    if (o->checkpoint_every < 0)
        return kv_fail(err, KV_EINVAL, NULL, KV_NO_OFFSET, "%s must be 0 (never) or more, got %lld",
                       n[KV_COLLECT_OPT_CHECKPOINT_EVERY], (long long)o->checkpoint_every);
    return KV_OK;
}

static int same_file(const struct stat *a, const char *path) {
    struct stat b;
    return stat(path, &b) == 0 && a->st_dev == b.st_dev && a->st_ino == b.st_ino;
}

/* What an existing out_path may not be: a directory, an input, or a
 * checkpoint that a run without resume would overwrite. */
static int check_existing(const char *out, const struct stat *st, int resume,
                          const char *model_path, const char *const *inputs, int64_t n_inputs,
                          const char *const *n, struct kv_err *err) {
    if (S_ISDIR(st->st_mode))
        return kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET, "is a directory; %s names the statistics file",
                       n[KV_COLLECT_OPT_OUTPUT]);
    int clash = same_file(st, model_path);
    for (int64_t i = 0; i < n_inputs && !clash; i++) clash = same_file(st, inputs[i]);
    if (clash)
        return kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET,
                       "is also the model or a %s input; refusing to overwrite it",
                       n[KV_COLLECT_OPT_TEXT]);
    if (resume || !kv_stats_probe(out)) return KV_OK;
    struct kv_stats *s;
    struct kv_err ignored;
    kv_err_clear(&ignored);
    /* a file that does not open is not a checkpoint to protect */
    if (kv_stats_open(out, &s, &ignored) != KV_OK) return KV_OK;
    int64_t done = s->info.next_window, plan = s->info.plan_windows;
    kv_stats_free(s);
    if (done < plan)
        return kv_fail(err, KV_EINVAL, out, KV_NO_OFFSET,
                       "holds an unfinished checkpoint (%lld of %lld windows); add %s to "
                       "continue it, or remove the file to start over",
                       (long long)done, (long long)plan, n[KV_COLLECT_OPT_RESUME]);
    return KV_OK;
}

int kv_collect_check_output(const struct kv_collect_opts *o, int resume, const char *model_path,
                            const char *const *inputs, int64_t n_inputs,
                            const char *const *names, struct kv_err *err) {
    const char *out = o->out_path, *const *n = names ? names : own_names;
    struct stat st;
    int rc;
    if (stat(out, &st) == 0 &&
        (rc = check_existing(out, &st, resume, model_path, inputs, n_inputs, n, err)))
        return rc;
    /* the folder must take OUT.tmp now, not after hours of windows */
    size_t len = strlen(out) + 16;
    char *probe = malloc(len);
    if (!probe) return kv_fail(err, KV_ENOMEM, NULL, KV_NO_OFFSET, "out of memory");
    snprintf(probe, len, "%s.probe", out);
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    int e = errno;
    if (fd >= 0) {
        close(fd);
        unlink(probe);
    }
    free(probe);
    if (fd >= 0 || e == EEXIST) return KV_OK;
    char eb[256];
    snprintf(eb, sizeof eb, "%s", strerror(e));
    for (char *p = eb; *p; p++) *p = (char)tolower((unsigned char)*p);
    return kv_fail(err, KV_EIO, out, KV_NO_OFFSET, "cannot write there: %s", eb);
}

int kv_collect_start(const struct kv_model *m, int resume, struct kv_collect_opts *o,
                     struct kv_stats **out, struct kv_err *err) {
    struct stat st;
    *out = NULL;
    o->resume = resume && stat(o->out_path, &st) == 0;
    o->resumed_from = -1;
    if (!o->resume) return kv_stats_init(kv_model_config(m), out, err);
    int rc = kv_stats_open(o->out_path, out, err);
    if (!rc) o->resumed_from = (*out)->info.next_window;
    return rc;
}
