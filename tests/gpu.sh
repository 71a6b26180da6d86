#!/bin/bash
# The attention runtime's GPU checks in one run, for a machine with a CUDA
# device and a built tree (`make`): the GPU test suites (GPU against the
# CPU twin, verify --device cuda against the CPU path, bench-attn on cuda),
# make bench's attention targets, the bench-attn tables (fast kernels and
# the generic one, KVRT_CUDA_KERNEL=generic, and keys as stored on one of
# their two kernels, KVRT_CUDA_KERNEL=direct or mma, in the same run), Nsight
# Compute's DRAM throughput of the attention kernels at 64K, and
# compute-sanitizer's four tools over every kernel.
#
#   bash tests/gpu.sh [OUTDIR]     (default build/gpu)
#
# Logs go to OUTDIR (tests.log, bench.log, ncu.log, sanitize.log); a
# summary goes to stdout. Exit 1 if a test, a target or a sanitizer fails.
# ONLY=tests,bench,ncu,sanitize (any of them) runs those parts. The shared
# test data is found as the tests find it ($KVCAL_SHARED, default
# ../shared); JOBS (default 8) tests run side by side.
set -u
out=${1:-build/gpu}
mkdir -p "$out"
bin=${KVCAL_BIN:-build/kvcal}
only=${ONLY:-all}
status=0
say() { printf '%s\n' "$*"; }
part() { [ "$only" = all ] || [[ ",$only," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,clocks.max.sm,driver_version --format=csv,noheader 2>&1 | sed 's/^/device: /'

if part tests; then
    : >"$out/tests.log"
    # the last: the GPU suite again with keys as stored on dattn_kernel only
    for t in "test_kvrt --filter kvrt_gpu/*" "test_cli --filter cli/verify_device*" "test_bench_attn" \
             "test_kvrt --filter kvrt_gpu/* direct"; do
        set -- $t
        start=$(date +%s)
        k=; [ "${@: -1}" = direct ] && { k=direct; set -- "${@:1:$#-1}"; }
        KVRT_CUDA_KERNEL=$k timeout 200 "build/tests/$1" "${@:2}" -j${JOBS:-8} --verbose >>"$out/tests.log" 2>&1
        rc=$?
        line=$(grep -a "Synthesis" "$out/tests.log" | tail -1)
        say "tests: $t: exit $rc, $(( $(date +%s) - start )) s: ${line#*Synthesis: }"
        [ $rc -eq 0 ] || status=1
    done
fi

if part bench; then
    : >"$out/bench.log"
    for p in llama7b llama3-8b gpt2-xl; do
        "$bin" bench-attn --synthetic $p --ctx 4K,64K --cache f16 -q >>"$out/bench.log" 2>&1 || status=1
    done
    KVRT_CUDA_KERNEL=generic "$bin" bench-attn --synthetic llama7b --ctx 4K,64K --cache f16 -q \
        >>"$out/bench.log" 2>&1 || status=1
    for k in direct mma; do # keys as stored on one kernel only (dattn_kernel, mattn_kernel), to compare
        for p in "llama7b --kv-bits 16" "llama7b --kv-bits 4" "llama3-8b"; do
            KVRT_CUDA_KERNEL=$k "$bin" bench-attn --synthetic $p --ctx 64K --cache f16 -q \
                >>"$out/bench.log" 2>&1 || status=1
        done
    done
    for b in 8 4 2; do
        "$bin" bench-attn --synthetic llama7b --ctx 4K,64K --cache f16 --kv-bits $b -q >>"$out/bench.log" 2>&1 || status=1
    done
    "$bin" bench-attn --synthetic llama7b --ctx 64K --cache f16 --keep 1 --kv-bits 4 -q >>"$out/bench.log" 2>&1 || status=1
    say "bench: 64K f16 rows (µs/step, µs attn, GB/s, % peak, speedup):"
    grep -a "^| *65536 " "$out/bench.log" | awk -F'|' '{printf "  %-32s %-6s %8s %8s %8s %6s %7s\n", $3, $4, $6, $7, $8, $9, $10}'
    KVCAL_BIN=$bin build/bench/bench_attn >>"$out/bench.log" 2>&1
    rc=$?
    say "make bench attention targets: exit $rc"
    grep -a "^64K" "$out/bench.log" | sed 's/^/  /'
    [ $rc -eq 0 ] || status=1
fi

if part ncu && command -v ncu >/dev/null; then
    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \
        -k regex:attn_kernel --launch-count 15 \
        "$bin" bench-attn --synthetic llama7b --ctx 64K --cache f16 --iters 1 -q >"$out/ncu.log" 2>&1
    for b in ${NCU_BITS-4}; do
        ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \
            -k regex:attn_kernel --launch-count 15 \
            "$bin" bench-attn --synthetic llama7b --ctx 64K --cache f16 --iters 1 --kv-bits $b -q >>"$out/ncu.log" 2>&1
    done
    say "ncu (64K, f16; per attention kernel launch):"
    awk '/attn_kernel</ {k=$2} /dram__throughput/ {d=$NF} /gpu__time_duration/ {t=$NF} /dram__bytes_read/ {b=$NF} /hmma/ {h=$NF} /sm__throughput/ {print "  " k, "time", t, "us, read", b, "GB, dram", d, "%, sm", $NF, "%, tensor", h "%"; h=""}' "$out/ncu.log" | sort | uniq -c | head -20
fi

if part sanitize && command -v compute-sanitizer >/dev/null; then
    : >"$out/sanitize.log"
    # each run: every configuration of the preset (full, prerope or
    # fused_query, postrope), 700 positions (a partial last chunk); the
    # fast kernels where they apply, the generic one on quantized caches
    # (KVRT_CUDA_KERNEL=generic), and each keys-as-stored kernel forced
    # where the default picks the other (KVRT_CUDA_KERNEL=direct, mma)
    runs=("fast --synthetic llama7b --cache f16" "fast --synthetic llama7b --cache f32"
          "fast --synthetic llama7b --cache f16 --kv-bits 4" "fast --synthetic llama7b --cache f16 --kv-bits 3"
          "fast --synthetic llama3-8b --cache f16 --kv-bits 2" "fast --synthetic llama3-8b --cache f16"
          "fast --synthetic gpt2-xl --cache f16 --kv-bits 8" "fast --synthetic gpt2-xl --cache f32"
          "generic --synthetic llama7b --cache f16 --kv-bits 4" "generic --synthetic llama3-8b --cache f16 --kv-bits 3"
          "direct --synthetic llama7b --cache f16 --kv-bits 4" "mma --synthetic llama7b --cache f16")
    pids=()
    i=0
    for tool in memcheck racecheck synccheck initcheck; do
        for r in "${runs[@]}"; do
            i=$((i + 1))
            set -- $r
            # each run's output joins sanitize.log when it ends (one at a
            # time), so a run cut short still leaves the finished ones there
            ( KVRT_CUDA_KERNEL=$1 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 \
                  "$bin" bench-attn "${@:2}" --ctx 700 --iters 1 -q >"$out/san.$i" 2>&1
              echo "exit $? $tool $r" >>"$out/san.$i"
              flock "$out/sanitize.log" sh -c 'cat "$0" >>"$1" && rm -f "$0"' "$out/san.$i" "$out/sanitize.log" ) &
            pids+=($!)
            if [ ${#pids[@]} -ge 8 ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
        done
    done
    wait
    bad=$(grep -ac "^exit [^0]" "$out/sanitize.log")
    say "sanitizers: $i runs, $bad failed; error summaries:"
    grep -a "ERROR SUMMARY\|RACECHECK SUMMARY" "$out/sanitize.log" | sort | uniq -c | sed 's/^/  /'
    grep -a "^exit [^0]" "$out/sanitize.log" | sed 's/^/  /' | head -20
    [ "$bad" -eq 0 ] || status=1
fi
exit $status
