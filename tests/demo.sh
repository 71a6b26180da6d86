#!/usr/bin/env bash
# make demo: kvcal's main job on the embedded model data/kjv-llama (or
# DEMO_MODEL, say data/kjv-bpe-llama: make demo DEMO_MODEL=...), with the
# King James text from 'make data': calibration statistics from 64 random
# windows of the training books, low-rank K/V factors keeping 90% of each
# unit's calibration energy, and perplexity on the held-out Gospels, base
# against a cache that stores only the latents.
set -euo pipefail
KVCAL=${1:-build/kvcal}
MODEL=${DEMO_MODEL:-data/kjv-llama}
TRAIN=data/kjv/train.txt
HELDOUT=data/kjv/gospels.txt
WINDOWS=${DEMO_WINDOWS:-400}
for f in "$MODEL/model.safetensors" "$TRAIN" "$HELDOUT"; do
    [ -e "$f" ] || { echo "make demo: $f is missing (make data makes the text; the model is committed)" >&2; exit 1; }
done
out=$(mktemp -d "${TMPDIR:-/tmp}/kvcal-demo.XXXXXX")
trap 'rm -rf "$out"' EXIT
start=$(date +%s)
set -x
"$KVCAL" collect --model "$MODEL" --text "$TRAIN" --samples 64 --seq-len 256 -o "$out/kjv.kvstats" -q
"$KVCAL" decompose --model "$MODEL" --stats "$out/kjv.kvstats" --eps 0.9 -o "$out/compressed-eps0.9" -q
"$KVCAL" verify --model "$MODEL" --compressed "$out/compressed-eps0.9" --text "$HELDOUT" \
    --seq-len 256 --max-windows "$WINDOWS" -q
{ set +x; } 2>/dev/null
echo "demo took $(( $(date +%s) - start )) s"
