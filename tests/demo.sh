#!/usr/bin/env bash
# make demo: kvcal's main job on the embedded model data/kjv-llama (or
# DEMO_MODEL, say data/kjv-bpe-llama: make demo DEMO_MODEL=...), with the
# King James text from 'make data': calibration statistics from 64 random
# windows of the training books, low-rank K/V factors keeping 90% of each
# unit's calibration energy, and perplexity on the held-out Gospels, base
# against a cache that stores only the latents; then statistics of the
# held-out text too, and `kvcal report` of it all into build/demo/report.html
# (and its figures, build/demo/report-*.svg; DEMO_REPORT_DIR moves them),
# with the run's files in build/demo/run.
set -euo pipefail
KVCAL=${1:-build/kvcal}
MODEL=${DEMO_MODEL:-data/kjv-llama}
TRAIN=data/kjv/train.txt
HELDOUT=data/kjv/gospels.txt
WINDOWS=${DEMO_WINDOWS:-400}
REPORT_DIR=${DEMO_REPORT_DIR:-build/demo}
for f in "$MODEL/model.safetensors" "$TRAIN" "$HELDOUT"; do
    [ -e "$f" ] || { echo "make demo: $f is missing (make data makes the text; the model is committed)" >&2; exit 1; }
done
# the demo's files, kept beside its report (fixed paths: the report names
# them, so a second run writes the same bytes)
out=$REPORT_DIR/run
rm -rf "$out"
mkdir -p "$out"
start=$(date +%s)
set -x
"$KVCAL" collect --model "$MODEL" --text "$TRAIN" --samples 64 --seq-len 256 -o "$out/kjv.kvstats" -q
"$KVCAL" decompose --model "$MODEL" --stats "$out/kjv.kvstats" --eps 0.9 -o "$out/compressed-eps0.9" -q
"$KVCAL" verify --model "$MODEL" --compressed "$out/compressed-eps0.9" --text "$HELDOUT" \
    --seq-len 256 --max-windows "$WINDOWS" -q
"$KVCAL" verify --model "$MODEL" --compressed "$out/compressed-eps0.9" --text "$HELDOUT" \
    --seq-len 256 --max-windows 50 --json -q > "$out/verify.json"
"$KVCAL" collect --model "$MODEL" --text "$HELDOUT" --samples 64 --seq-len 256 -o "$out/heldout.kvstats" -q
"$KVCAL" report --model "$MODEL" --stats "$out/kjv.kvstats" --compressed "$out/compressed-eps0.9" \
    --eval-stats "$out/heldout.kvstats" --verify "$out/verify.json" -o "$REPORT_DIR/report.html"
{ set +x; } 2>/dev/null
echo "demo took $(( $(date +%s) - start )) s"
