#!/usr/bin/env bash
# kvcal's forward against llama.cpp's prompt processing, on the same GGUF
# files and the same machine, in one run (docs/bench-8b.md):
#   - Llama-3.2-1B's shape (d = 2048, 16 layers, vocab 128256), whole;
#   - Llama-3.1-8B's shape (d = 4096, vocab 128256), 4 of its 32 layers
#     (the per-layer work is the 8B's; the head is a larger share).
# Random weights, F16 matrices (both engines read the same bytes), 2048
# tokens in one window, the head on the last position only (llama.cpp's
# prompt processing asks for no other logits), 2 threads each, best of 3.
# Needs node and deps/node's node-llama-cpp (make deps); about 8 GB of disk
# in a temporary directory, removed at the end.
#
#   tests/bench/llamacpp_vs.sh [N_TOKENS]
set -euo pipefail
N=${1:-2048}
BIN=build/bench/bench_llamacpp
[[ -x $BIN ]] || { echo "llamacpp_vs: $BIN is missing (make bench)" >&2; exit 1; }
command -v node >/dev/null || { echo "llamacpp_vs: node is not on PATH" >&2; exit 1; }
[[ -r deps/node/node_modules/node-llama-cpp/package.json ]] ||
    { echo "llamacpp_vs: deps/node/node_modules/node-llama-cpp is missing (make deps)" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2
for row in "Llama-3.2-1B 0" "Llama-3.1-8B 4"; do
    set -- $row
    name=$1 layers=$2
    gguf=$TMP/$name.gguf
    if ((layers > 0)); then $BIN write "$gguf" "tests/configs/$name.json" --layers "$layers"
    else $BIN write "$gguf" "tests/configs/$name.json"; fi
    kv=$($BIN time "$gguf" "$N")
    lc=$(node tests/llamacpp/bench.mjs "$gguf" "$N" --threads 2)
    kvt=$(sed -n 's/.*"tokens_per_s": *\([0-9.]*\).*/\1/p' <<<"$kv")
    lct=$(sed -n 's/.*"tokens_per_s": *\([0-9.]*\).*/\1/p' <<<"$lc")
    echo "$name ($([[ $layers -gt 0 ]] && echo "$layers layers" || echo "all layers")), $N tokens:"
    echo "  kvcal      $kv"
    echo "  llama.cpp  $lc"
    echo "  ratio      $(awk -v a="$kvt" -v b="$lct" 'BEGIN { printf "%.2f", a / b }')x (kvcal / llama.cpp)"
    rm -f "$gguf"
done
