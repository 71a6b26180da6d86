/* The CUDA backend of a build without nvcc: every entry point answers
 * KV_EUNSUPPORTED, so the twin and the rest of kvcal work unchanged. */
#include "err.h"
#include "kvrt.h"
#include "kvrt_plan.h"

#define NO_CUDA(err)                                                                       \
    kv_fail(err, KV_EUNSUPPORTED, NULL, KV_NO_OFFSET,                                      \
            "this kvcal was built without cuda (nvcc was not found at build time; "        \
            "rebuild with make CUDA=1)")

int kvrt_cuda_built(void) { return 0; }
int kvrt_cuda_device_count(int *count, struct kv_err *err) {
    *count = 0;
    return NO_CUDA(err);
}
int kvrt_cuda_device_query(int dev, struct kvrt_device *out, struct kv_err *err) { return NO_CUDA(err); }
int kvrt_cuda_open(const struct kvrt_plan *p, int dev, struct kvrt_cuda **out, struct kv_err *err) {
    return NO_CUDA(err);
}
void kvrt_cuda_close(struct kvrt_cuda *c) { (void)c; }
int kvrt_cuda_append(struct kvrt_cuda *c, int64_t layer, int64_t pos, const float *xn,
                     struct kv_err *err) {
    return NO_CUDA(err);
}
int kvrt_cuda_attend(struct kvrt_cuda *c, int64_t layer, int64_t T, float *y, struct kv_err *err) {
    return NO_CUDA(err);
}
int kvrt_cuda_fill(struct kvrt_cuda *c, int64_t layer, int64_t len, uint64_t seed,
                   struct kv_err *err) {
    return NO_CUDA(err);
}
int kvrt_cuda_time(struct kvrt_cuda *c, int64_t layer, int64_t pos, int64_t iters, double *us_step,
                   double *us_attn, struct kv_err *err) {
    return NO_CUDA(err);
}
