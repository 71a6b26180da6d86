/* The BLAS work-buffer guard.
 *
 * OpenBLAS 0.3.21 (Debian 12) maps one work buffer per thread (128 MiB on
 * x86-64) with mmap, falls back to malloc, and when both fail retries them
 * forever: under an address-space limit (ulimit -v) kvcal would hang in
 * the library's constructor, before main, or later inside a matrix
 * product. So the kvcal executable defines mmap, which every library it
 * loads calls instead of the C library's: the call goes straight to the
 * kernel, and a mapping that fails for a caller inside the BLAS library
 * ends the run with a message naming the limit instead of returning
 * MAP_FAILED into that loop. Every other caller sees mmap unchanged.
 *
 * Writers are unaffected: an output is complete and renamed, or still a
 * temporary beside it, and the previous output is intact. */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The base address of the object holding the BLAS (found through a
 * symbol only OpenBLAS defines), or NULL with another BLAS. */
static void *blas_base(void) {
    void *sym = dlsym(RTLD_DEFAULT, "openblas_get_config");
    Dl_info di;
    if (!sym || !dladdr(sym, &di)) return NULL;
    return di.dli_fbase;
}

static void blas_out_of_memory(size_t len, int err) {
    struct rlimit rl;
    char limit[96];
    if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        snprintf(limit, sizeof limit, "address-space limit, ulimit -v: %.0f MiB",
                 (double)rl.rlim_cur / 1048576.0);
    else
        snprintf(limit, sizeof limit, "mmap: %s", strerror(err));
    fprintf(stderr,
            "kvcal: out of memory: the BLAS library could not map a %.0f MiB work buffer "
            "(%s); raise the limit, or lower --threads (each thread maps its own)\n",
            (double)len / 1048576.0, limit);
    fflush(stderr);
    _exit(1);
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    long r = syscall(SYS_mmap, addr, len, prot, flags, fd, off);
    if (r == -1) {
        int err = errno;
        Dl_info di;
        void *base = blas_base();
        if (base && dladdr(__builtin_return_address(0), &di) && di.dli_fbase == base)
            blas_out_of_memory(len, err);
        errno = err;
        return MAP_FAILED;
    }
    return (void *)r;
}
