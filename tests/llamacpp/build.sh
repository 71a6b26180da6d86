#!/bin/sh
# Build tests/llamacpp/kvcal_logprobs.c against build/libkvcal.a (run `make`
# first), with the Makefile's flags and libraries. Run from the repository
# root: sh tests/llamacpp/build.sh [OUTPUT]   (default build/kvcal_logprobs)
set -eu
out=${1:-build/kvcal_logprobs}
[ -f build/libkvcal.a ] || { echo "build.sh: build/libkvcal.a missing: run make first" >&2; exit 1; }
multiarch=$(gcc -print-multiarch)
blas_inc=/usr/include/$multiarch/openblas-openmp
blas_lib=/usr/lib/$multiarch/openblas-openmp
exec ${CC:-cc} -std=c11 -O2 -g -Wall -Wextra -Wno-unused-parameter -D_GNU_SOURCE -fopenmp \
    -I"$blas_inc" -Ilib -Iformats -Ibuild/include -Itests \
    tests/llamacpp/kvcal_logprobs.c build/libkvcal.a -o "$out" \
    -L"$blas_lib" -Wl,-rpath,"$blas_lib" -lopenblas -llapacke -Wl,--no-as-needed -llapack -lblas \
    -Wl,--as-needed -ljansson -lpcre2-8 -lutf8proc -lnettle -lz -lm -fopenmp
