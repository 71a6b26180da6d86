/* The runtime's door to its CUDA backend: the backend is a shared object
 * (libkvrt_cuda.so, kvrt_cuda.cu) loaded with dlopen on the first call
 * that needs it, so kvcal starts, and runs on the CPU, without mapping the
 * CUDA libraries, and runs on machines that do not have them.
 *
 * Where it looks, first hit wins:
 *   1. $KVRT_CUDA_LIB, the object's path, when set (nothing else is tried);
 *   2. beside the running program, one directory up (build/tests/ finds
 *      build/), and in ../lib (an installed bin/kvcal finds lib/);
 *   3. the dynamic linker's own search (LD_LIBRARY_PATH, ld.so.cache).
 * A build without nvcc (KVRT_WITH_CUDA 0) never looks and every call says
 * so. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "kvrt.h"
#include "kvrt_plan.h"

#ifndef KVRT_WITH_CUDA
#define KVRT_WITH_CUDA 0
#endif

int kvrt_cuda_built(void) { return KVRT_WITH_CUDA; }

static pthread_once_t once = PTHREAD_ONCE_INIT;
static const struct kvrt_cuda_api *api;
static int load_code;        /* the failure, when api is NULL */
static char load_msg[1024];

/* Try one candidate; 0 when it is not there (keep looking), 1 when it was
 * found (api set, or load_msg says why it cannot be used). */
static int try_load(const char *path, int must) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        /* found but unloadable (a CUDA library missing, a wrong
         * architecture) is an answer; not found is not, unless must */
        if (!must && access(path, F_OK) != 0) return 0;
        snprintf(load_msg, sizeof load_msg, "cuda: cannot load the cuda backend: %s",
                 e ? e : path);
        load_code = KV_EDEVICE;
        return 1;
    }
    kvrt_cuda_entry_fn entry;
    *(void **)&entry = dlsym(h, KVRT_CUDA_ENTRY);
    const struct kvrt_cuda_api *a = entry ? entry() : NULL;
    if (!a || a->abi != KVRT_CUDA_ABI || a->plan_size != sizeof(struct kvrt_plan) ||
        a->lplan_size != sizeof(struct kvrt_lplan) || a->device_size != sizeof(struct kvrt_device) ||
        a->err_size != sizeof(struct kv_err)) {
        snprintf(load_msg, sizeof load_msg,
                 "cuda: %s is not this build's cuda backend (a different version of kvcal); "
                 "rebuild, or point KVRT_CUDA_LIB at the right one", path);
        load_code = KV_EDEVICE;
        dlclose(h);
        return 1;
    }
    api = a; /* the handle stays open for the life of the process */
    return 1;
}

static void load(void) {
    if (!KVRT_WITH_CUDA) {
        load_code = KV_EUNSUPPORTED;
        snprintf(load_msg, sizeof load_msg,
                 "this kvcal was built without cuda (nvcc was not found at build time; "
                 "rebuild with make CUDA=1)");
        return;
    }
    const char *env = getenv("KVRT_CUDA_LIB");
    if (env && *env) {
        try_load(env, 1);
        return;
    }
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) *slash = 0;
        const char *rel[] = {"", "/..", "/../lib"};
        for (int i = 0; i < 3; i++) {
            char path[4096 + 64];
            snprintf(path, sizeof path, "%s%s/" KVRT_CUDA_SO, exe, rel[i]);
            if (try_load(path, 0)) return;
        }
    }
    try_load(KVRT_CUDA_SO, 1);
    if (!api && strstr(load_msg, KVRT_CUDA_SO ": cannot open shared object file"))
        snprintf(load_msg, sizeof load_msg,
                 "cuda: cannot find the cuda backend " KVRT_CUDA_SO " beside the program, in "
                 "../lib or on the library path (set KVRT_CUDA_LIB to its path)");
}

/* The backend, or NULL with err filled. */
static const struct kvrt_cuda_api *backend(struct kv_err *err) {
    pthread_once(&once, load);
    if (!api) kv_fail(err, load_code, NULL, KV_NO_OFFSET, "%s", load_msg);
    return api;
}

int kvrt_cuda_device_count(int *count, struct kv_err *err) {
    *count = 0;
    const struct kvrt_cuda_api *a = backend(err);
    return a ? a->device_count(count, err) : load_code;
}

int kvrt_cuda_device_query(int dev, struct kvrt_device *out, struct kv_err *err) {
    const struct kvrt_cuda_api *a = backend(err);
    return a ? a->device_query(dev, out, err) : load_code;
}

int kvrt_cuda_open(const struct kvrt_plan *p, int dev, struct kvrt_cuda **out, struct kv_err *err) {
    const struct kvrt_cuda_api *a = backend(err);
    return a ? a->open(p, dev, out, err) : load_code;
}

/* Only an opened context reaches here, so the backend is loaded. */
void kvrt_cuda_close(struct kvrt_cuda *c) {
    if (c && api) api->close(c);
}

int kvrt_cuda_append(struct kvrt_cuda *c, int64_t layer, int64_t pos, const float *xn,
                     struct kv_err *err) {
    return api->append(c, layer, pos, xn, err);
}

int kvrt_cuda_attend(struct kvrt_cuda *c, int64_t layer, int64_t T, float *y, struct kv_err *err) {
    return api->attend(c, layer, T, y, err);
}

int kvrt_cuda_fill(struct kvrt_cuda *c, int64_t layer, int64_t len, uint64_t seed,
                   struct kv_err *err) {
    return api->fill(c, layer, len, seed, err);
}

int kvrt_cuda_time(struct kvrt_cuda *c, int64_t layer, int64_t pos, int64_t iters, double *us_step,
                   double *us_attn, struct kv_err *err) {
    return api->time(c, layer, pos, iters, us_step, us_attn, err);
}
