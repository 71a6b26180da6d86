#!/usr/bin/env bash
# make results-kjv: the methods on the fixtures with a realistic head size
# (data/kjv-llama, data/kjv-gpt2, data/kjv-bpe-llama: head_dim 64). Statistics with Fisher sums
# from 2000 random windows of data/kjv/train.txt; every paper's method at its
# own allocation and kvcal's options (global, which measures its ranks and
# uniform's on the first 8 windows of the training text, --center, --basis
# output and loss, J-LRD units) at 0.5, 0.25 and 0.125 of the base KV bytes,
# and every method at --eps 0.9; each evaluated on the first 100 windows of
# data/kjv/gospels.txt with 95% bootstrap intervals over those windows for
# ΔPPL and KL (verify --json's delta_ppl_rel_ci95, kl_ci95).
#
# Run from the repository root after `make`. Environment:
#   KVCAL_BIN     the kvcal binary (default build/kvcal)
#   OUT           where statistics and JSON go (default build/results-kjv;
#                 statistics already there are reused)
#   MAX_WINDOWS   evaluation windows of 256 tokens (default 100)
#   SAMPLES       calibration windows (default 2000)
#   MODELS        default "kjv-llama kjv-gpt2 kjv-bpe-llama"
#   RATIOS        default "0.5 0.25 0.125"
# Writes markdown tables to stdout, progress to stderr, each row's
# decompose and verify JSON to $OUT/<model>.jsonl, and `kvcal report` of
# those lines beside them: $OUT/report.html and its figures $OUT/report-*.svg.
set -euo pipefail
export LC_ALL=C

BIN=${KVCAL_BIN:-build/kvcal}
OUT=${OUT:-build/results-kjv}
MAX_WINDOWS=${MAX_WINDOWS:-100}
SAMPLES=${SAMPLES:-2000}
MODELS=${MODELS:-"kjv-llama kjv-gpt2 kjv-bpe-llama"}
RATIOS=${RATIOS:-"0.5 0.25 0.125"}
TRAIN=data/kjv/train.txt EVAL=data/kjv/gospels.txt

for f in "$BIN" "$TRAIN" "$EVAL"; do
    [[ -e $f ]] || { echo "results-kjv: '$f' does not exist (run make; make data writes data/kjv)" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "results-kjv: needs python3 to read kvcal's JSON" >&2; exit 1; }
mkdir -p "$OUT"
T0=$(date +%s)

# configurations: label | decompose options (G: the model's KV head count)
SEEDS=(
    "svd (baseline)|--method svd"
    "palu per head|--method palu"
    "palu J-LRD|--method palu --group-size G"
    "palu fisher|--method palu --alloc fisher"
    "eigen layer-budget|--method eigen --alloc layer-budget -t $TRAIN"
    "lorc progressive|--method lorc"
    "fdc removal|--method fdc"
    "zack removal|--method zack"
)
NEW=(
    "palu global|--method palu --alloc global -t $TRAIN"
    "palu --center|--method palu --center"
    "palu --basis output|--method palu --basis output"
    "palu --basis loss|--method palu --basis loss"
    "palu --basis output, global|--method palu --basis output --alloc global -t $TRAIN"
    "palu --basis loss, global|--method palu --basis loss --alloc global -t $TRAIN"
    "palu J-LRD global|--method palu --group-size G --alloc global -t $TRAIN"
    "palu J-LRD --basis output|--method palu --group-size G --basis output"
    "palu J-LRD --basis loss|--method palu --group-size G --basis loss"
    "palu J-LRD --basis output, global|--method palu --group-size G --basis output --alloc global -t $TRAIN"
    "palu J-LRD --basis loss, global|--method palu --group-size G --basis loss --alloc global -t $TRAIN"
)
EPS_ROWS=(
    "svd|--method svd" "palu|--method palu" "eigen|--method eigen" "lorc|--method lorc"
    "fdc|--method fdc" "zack|--method zack" "palu --basis output|--method palu --basis output"
)

# row MODEL STATS G LABEL TARGET OPTS...: one decompose + verify, one table row
row() {
    local model=$1 stats=$2 g=$3 label=$4 target=$5; shift 5
    local dir; dir=$(mktemp -d "$OUT/run.XXXXXX")
    local opts=("${@//G/$g}")
    if ! "$BIN" decompose -m "data/$model" -s "$stats" "${opts[@]}" -o "$dir/c" -q --json > "$dir/d.json" 2> "$dir/d.err"; then
        echo "| $label | $target | - | $(head -c 120 "$dir/d.err" | tr '\n|' '  ') | | | |"
        rm -rf "$dir"
        return
    fi
    "$BIN" verify -m "data/$model" --compressed "$dir/c" --text "$EVAL" --max-windows "$MAX_WINDOWS" --json -q > "$dir/v.json"
    python3 - "$dir/d.json" "$dir/v.json" "$label" "$target" "$OUT/$model.jsonl" <<'PY'
import json, sys
d, v = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
label, target, jl = sys.argv[3], sys.argv[4], sys.argv[5]
with open(jl, "a") as f:
    f.write(json.dumps({"label": label, "target": target, "decompose": d, "verify": v}) + "\n")
o = d["options"]
alloc = d["alloc"] + (" (kept uniform)" if o.get("kept_uniform") else "")
dp, lo, hi = 100 * (v["ppl"] / v["base_ppl"] - 1), *(100 * x for x in v["delta_ppl_rel_ci95"])
kl, (kl0, kl1) = v["kl"], v["kl_ci95"]
print(f"| {label} | {alloc} | {target} | {v['kv_bytes_per_token']['ratio']:.4f} | {v['ppl']:.4f} | "
      f"{dp:+.3f}% [{lo:+.3f}, {hi:+.3f}] | {kl:.5f} [{kl0:.5f}, {kl1:.5f}] |")
PY
    rm -rf "$dir"
}

for model in $MODELS; do
    stats=$OUT/$model.kvstats
    if [[ ! -e $stats ]]; then
        echo "results-kjv: collect $model ($SAMPLES windows with Fisher sums)" >&2
        "$BIN" collect -m "data/$model" -t "$TRAIN" --samples "$SAMPLES" --seed 0 --fisher -o "$stats" -q >&2
    fi
    g=$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); print(c.get("num_key_value_heads", c.get("n_head", c.get("num_attention_heads"))))' "data/$model/config.json")
    : > "$OUT/$model.jsonl"
    base=$("$BIN" verify -m "data/$model" --text "$EVAL" --max-windows "$MAX_WINDOWS" --json -q | python3 -c 'import json, sys; print("%.6f" % json.load(sys.stdin)["ppl"])')
    echo
    echo "### $model (base PPL $base, $MAX_WINDOWS windows of $EVAL)"
    echo
    echo "| configuration | alloc | target | KV kept | PPL | ΔPPL [95% CI] | KL [95% CI] |"
    echo "|---|---|---|---|---|---|---|"
    for r in $RATIOS; do
        for e in "${SEEDS[@]}" "${NEW[@]}"; do
            echo "results-kjv: $model $r ${e%%|*} ($(( $(date +%s) - T0 )) s)" >&2
            # shellcheck disable=SC2086
            row "$model" "$stats" "$g" "${e%%|*}" "$r" ${e#*|} --ratio "$r"
        done
    done
    for e in "${EPS_ROWS[@]}"; do
        # shellcheck disable=SC2086
        row "$model" "$stats" "$g" "${e%%|*}" "eps 0.9" ${e#*|} --eps 0.9
    done
done
REPORT_ARGS=()
for model in $MODELS; do REPORT_ARGS+=(--results "$OUT/$model.jsonl"); done
"$BIN" report "${REPORT_ARGS[@]}" --title "make results-kjv" -o "$OUT/report.html" -q
echo "results-kjv: done in $(( $(date +%s) - T0 )) s; figures in $OUT/report.html" >&2
