#!/usr/bin/env bash
# make results: the README results table. Every method and rank allocation at
# 0.75, 0.5 and 0.375 of the base KV bytes, on stories260K and
# tinystories-656K, calibrated on the first 500 TinyStories validation stories
# and evaluated on the last 500 (and, for 656K, on WikiText-2); then a
# quantization block (palu at 0.5 on 656K, 16..2-bit latents, with and without
# the Hadamard rotation).
#
# Run from the repository root after `make`. Environment:
#   KVCAL_SHARED   test data (default ../shared)
#   KVCAL_BIN      the kvcal binary (default build/kvcal)
#   MAX_WINDOWS    evaluate the first W windows of 256 tokens of each text
#                  (default 128; 0 = every window)
#   THREADS        --threads of every kvcal run (default 1: these models are
#                  too small for threads to pay, and on a shared machine
#                  waiting threads make decompose times noise)
#   ONLY           run only the rows of this --alloc (e.g. ONLY=fisher)
#   JSON_TOOL      jq, python or awk (default: jq if installed, else python3,
#                  else awk on the pretty-printed output)
# Writes the markdown table to stdout, progress to stderr, one JSON line per
# row (the raw decompose and verify objects) to build/results/*.jsonl, and
# `kvcal report` of those lines (with tinystories-656K's spectra) beside
# them: build/results/report.html and its figures build/results/report-*.svg.
set -euo pipefail
export LC_ALL=C

S=${KVCAL_SHARED:-../shared}
BIN=${KVCAL_BIN:-build/kvcal}
MAX_WINDOWS=${MAX_WINDOWS:-128}
THREADS=${THREADS:-1}
OUT=build/results
RATIOS="0.75 0.5 0.375"
T0=$(date +%s)

for f in "$BIN" "$S/text/tinystories/val1k.txt" "$S/text/wikitext-2-raw/wiki.test.raw" \
    "$S/models/stories260K/stories260K.bin" "$S/models/stories260K/tok512.bin" \
    "$S/models/tinystories-656K/model.safetensors"; do
    [[ -e $f ]] || { echo "results: '$f' does not exist (run make; set KVCAL_SHARED)" >&2; exit 1; }
done

# ---------------------------------------------------------------- JSON fields

if [[ -n ${JSON_TOOL:-} ]]; then :
elif command -v jq >/dev/null 2>&1; then JSON_TOOL=jq
elif command -v python3 >/dev/null 2>&1; then JSON_TOOL=python
else JSON_TOOL="awk"
fi

# jget FILE a.b.c: the scalar at that path of a JSON object, or nothing.
jget() {
    case $JSON_TOOL in
    jq) jq -r ".$2 // empty" "$1" ;;
    python)
        python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
for k in sys.argv[2].split("."):
    d = d.get(k) if isinstance(d, dict) else None
print("" if d is None else d)' "$1" "$2" ;;
    awk)
        # kvcal prints one key per line, nested objects and arrays indented
        awk -v want="$2" '
        {
            line = $0
            sub(/^[ \t]+/, "", line)
            if (line ~ /^[]}]/) { depth--; next }
            key = ""; val = line
            if (match(line, /^"[^"]*": */)) {
                key = substr(line, 2, RLENGTH - 1)
                sub(/": *$/, "", key)
                val = substr(line, RLENGTH + 1)
            }
            if (val ~ /^[[{]$/) { stack[++depth] = key; next }
            p = ""
            for (i = 1; i <= depth; i++)
                if (stack[i] != "") p = p (p == "" ? "" : ".") stack[i]
            p = p (p == "" ? "" : ".") key
            if (p == want) {
                sub(/,$/, "", val)
                if (val ~ /^"/) { sub(/^"/, "", val); sub(/"$/, "", val) }
                if (val != "null") print val
                exit
            }
        }' "$1" ;;
    *)
        echo "results: JSON_TOOL '$JSON_TOOL' is not jq, python or awk" >&2
        exit 2
        ;;
    esac
}

# One line of JSON from kvcal's pretty-printed output (strings hold no newlines).
oneline() { sed 's/^ *//' "$1" | tr -d '\n'; }
jstr() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr -d '\n')"; }

# fmt PRINTF-FORMAT VALUE: the number formatted, or a dash when absent.
# shellcheck disable=SC2059  # the format is the argument
fmt() { if [[ -z $2 || $2 == null ]]; then printf -- '-'; else printf -- "$1" "$2"; fi; }

# ---------------------------------------------------------------- data

mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl "$OUT"/*.md
CAL=$OUT/cal.txt
EVAL=$OUT/eval.txt
# a story is its lines up to and including its `<|endoftext|>` line
awk -v cal="$CAL" -v ev="$EVAL" '
    { print > (n < 500 ? cal : ev) }
    /^<\|endoftext\|>$/ { n++ }
    END { if (n != 1000) { print "results: expected 1000 stories, found " n > "/dev/stderr"; exit 1 } }
' "$S/text/tinystories/val1k.txt"
ncal=$(grep -c '^<|endoftext|>$' "$CAL")
neval=$(grep -c '^<|endoftext|>$' "$EVAL")
[[ $ncal == 500 && $neval == 500 ]] || { echo "results: split gave $ncal + $neval stories" >&2; exit 1; }
WIKI=$S/text/wikitext-2-raw/wiki.test.raw

M260=(--model "$S/models/stories260K/stories260K.bin" --tokenizer "$S/models/stories260K/tok512.bin")
M656=(--model "$S/models/tinystories-656K")

VERIFY_WINDOWS=()
if [[ $MAX_WINDOWS != 0 ]]; then VERIFY_WINDOWS=(--max-windows "$MAX_WINDOWS"); fi

# Rows: method, allocation, extra decompose options, label.
ROWS=(
    "svd|uniform||svd"
    "svd|global||svd"
    "palu|uniform|--group-size 1|palu (per head)"
    "palu|uniform|--group-size 4|palu (J-LRD, group 4)"
    "palu|fisher|--group-size 1|palu (per head)"
    "palu|global||palu"
    "eigen|eps||eigen"
    "eigen|layer-budget|-t $CAL|eigen"
    "eigen|global||eigen"
    "lorc|progressive||lorc"
    "fdc|removal||fdc"
    "fdc|global||fdc"
    "zack|removal||zack"
    "zack|global||zack"
)

# Markdown rows accumulate per block in $OUT/<block>.md; base PPL in $OUT/<block>.base.
DIR=$OUT/dir
ERR=$OUT/stderr.txt
DJ=$OUT/decompose.json
VJ=$OUT/verify.json

# decompose NAME MODEL-ARGS... -- DECOMPOSE-ARGS...: 0 with $DJ, or 1 with the
# refusal in $ERR.
decompose() {
    if "$BIN" decompose "$@" -o "$DIR" --threads "$THREADS" --json -q >"$DJ" 2>"$ERR"; then
        return 0
    fi
    return 1
}

# evaluate BLOCK MODEL-LABEL TEXT-LABEL TEXT METHOD ALLOC TARGET ROWJSON MODEL-ARGS... [-- VERIFY-ARGS...]
evaluate() {
    local block=$1 mlabel=$2 tlabel=$3 text=$4 method=$5 alloc=$6 target=$7 rowjson=$8
    shift 8
    local margs=() vargs=()
    while (($#)) && [[ $1 != -- ]]; do margs+=("$1"); shift; done
    if (($#)); then shift; vargs=("$@"); fi
    if ! "$BIN" verify "${margs[@]}" --compressed "$DIR" --text "$text" "${VERIFY_WINDOWS[@]}" \
        "${vargs[@]}" --threads "$THREADS" --json -q >"$VJ" 2>"$ERR"; then
        echo "results: verify failed for $mlabel $method $alloc $target: $(cat "$ERR")" >&2
        exit 1
    fi
    local base ppl dppl kl kept secs
    base=$(jget "$VJ" base_ppl)
    ppl=$(jget "$VJ" ppl)
    dppl=$(jget "$VJ" delta_ppl)
    kl=$(jget "$VJ" kl)
    kept=$(jget "$VJ" kv_bytes_per_token.ratio)
    secs=$(jget "$DJ" seconds)
    [[ -e $OUT/$block.base ]] || printf '%s\n' "$base" >"$OUT/$block.base"
    # the achieved cache of a float-16 row is above the target only when the
    # allocation cannot reach it (quantized rows are below by design)
    local mark=""
    if [[ -n $kept ]] && awk -v k="$kept" -v t="$target" 'BEGIN { exit !(k > t + 0.001) }'; then
        mark=" †"
    fi
    printf '| %s | %s | %s | %s | %s | %s%s | %s | %s | %s | %s |\n' "$mlabel" "$tlabel" "$method" \
        "$alloc" "$target" "$(fmt %.4f "$kept")" "$mark" "$(fmt %.3f "$ppl")" "$(fmt %+.3f "$dppl")" \
        "$(fmt %.4f "$kl")" "$(fmt %.3f "$secs")" >>"$OUT/$block.md"
    printf '{%s,"text":%s,"decompose":%s,"verify":%s}\n' "$rowjson" "$(jstr "$tlabel")" \
        "$(oneline "$DJ")" "$(oneline "$VJ")" >>"$OUT/$block.jsonl"
}

# refused BLOCK MODEL-LABEL TEXT-LABEL METHOD ALLOC TARGET ROWJSON: a row that
# shows decompose's refusal instead of numbers.
refused() {
    local msg
    msg=$(tr '\n' ' ' <"$ERR" | sed 's/ *$//; s/|/\\|/g')
    printf '| %s | %s | %s | %s | %s | refused: %s | | | | |\n' "$2" "$3" "$4" "$5" "$6" "$msg" \
        >>"$OUT/$1.md"
    printf '{%s,"text":%s,"error":%s}\n' "$7" "$(jstr "$3")" "$(jstr "$(cat "$ERR")")" \
        >>"$OUT/$1.jsonl"
}

# run_model TAG LABEL BLOCK:TEXT-LABEL:TEXT... -- MODEL-ARGS...
run_model() {
    local tag=$1 mlabel=$2
    shift 2
    local evals=()
    while [[ $1 != -- ]]; do evals+=("$1"); shift; done
    shift
    local margs=("$@")
    local stats=$OUT/$tag.kvstats
    echo "results: $mlabel: collect on $CAL" >&2
    "$BIN" collect "${margs[@]}" -t "$CAL" --fisher -o "$stats" --threads "$THREADS" -q >&2
    local row method alloc extra label r e
    for row in "${ROWS[@]}"; do
        IFS='|' read -r method alloc extra label <<<"$row"
        # ONLY=ALLOC limits the run to one allocation's rows
        [[ -z ${ONLY:-} || $alloc == "$ONLY" ]] || continue
        for r in $RATIOS; do
            echo "results: $mlabel: $label --alloc $alloc --ratio $r" >&2
            local rowjson
            rowjson=$(printf '"model":%s,"method":%s,"alloc":%s,"options":%s,"target":%s' \
                "$(jstr "$mlabel")" "$(jstr "$method")" "$(jstr "$alloc")" "$(jstr "$extra")" "$r")
            # shellcheck disable=SC2086  # extra holds whole options
            if decompose "${margs[@]}" -s "$stats" --method "$method" --alloc "$alloc" \
                --ratio "$r" $extra; then
                for e in "${evals[@]}"; do
                    IFS=':' read -r block tlabel text <<<"$e"
                    evaluate "$block" "$mlabel" "$tlabel" "$text" "$label" "$alloc" "$r" \
                        "$rowjson" "${margs[@]}"
                done
            else
                for e in "${evals[@]}"; do
                    IFS=':' read -r block tlabel text <<<"$e"
                    refused "$block" "$mlabel" "$tlabel" "$label" "$alloc" "$r" "$rowjson"
                done
            fi
        done
    done
}

run_model 260K stories260K "260K-tinystories:TinyStories:$EVAL" -- "${M260[@]}"
run_model 656K tinystories-656K "656K-tinystories:TinyStories:$EVAL" \
    "656K-wikitext2:WikiText-2:$WIKI" -- "${M656[@]}"

# quantized latents: palu per head at 0.5, rank multiple 8 in both variants
[[ -n ${ONLY:-} ]] || echo "results: tinystories-656K: quantization" >&2
for had in 0 1; do
    [[ -z ${ONLY:-} ]] || break
    hargs=(--rank-multiple 8)
    label="palu"
    if ((had)); then hargs+=(--hadamard); label="palu + hadamard"; fi
    decompose "${M656[@]}" -s "$OUT/656K.kvstats" --method palu --alloc uniform --ratio 0.5 \
        "${hargs[@]}" || { echo "results: $(cat "$ERR")" >&2; exit 1; }
    for bits in 16 8 4 3 2; do
        echo "results: tinystories-656K: $label, $bits-bit latents" >&2
        rowjson=$(printf '"model":"tinystories-656K","method":"palu","alloc":"uniform","options":%s,"target":0.5,"kv_bits":%s,"hadamard":%s' \
            "$(jstr "${hargs[*]}")" "$bits" "$( ((had)) && echo true || echo false)")
        evaluate 656K-quant tinystories-656K TinyStories "$EVAL" "$label, $bits-bit" uniform 0.5 \
            "$rowjson" "${M656[@]}" -- --kv-bits "$bits"
    done
done

# ---------------------------------------------------------------- markdown

T1=$(date +%s)
if [[ $MAX_WINDOWS == 0 ]]; then
    evaltxt="every window of 256 tokens of each evaluation text"
else
    evaltxt="the first $MAX_WINDOWS windows of 256 tokens of each evaluation text (\`verify --max-windows $MAX_WINDOWS\`)"
fi
echo "## Results"
echo
echo "Calibration: the first 500 stories of TinyStories val1k (\`kvcal collect\`, seq-len 256)."
echo "Evaluation: the last 500 stories, and WikiText-2 test for tinystories-656K (calibrated on the"
echo "same TinyStories statistics); $evaltxt."
echo "Target and achieved KV kept are fractions of the base fp16 KV bytes per token; ΔPPL and KL"
echo "(nats per token) are against the uncompressed model on the same windows; decompose s is"
echo "\`kvcal decompose\`'s time (\`--threads $THREADS\`). † marks a cache above its target:"
echo "decompose returned the smallest cache its allocation reaches. On WikiText-2 the TinyStories"
echo "model is far out of domain (see its base PPL), so a compressed model can score a lower PPL"
echo "than the base there; KL is the measure that compares."
header() {
    echo
    echo "| model | eval text | method | alloc | target | achieved KV kept | PPL | ΔPPL | KL | decompose s |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
}
for block in 260K-tinystories:stories260K:TinyStories 656K-tinystories:tinystories-656K:TinyStories \
    656K-wikitext2:tinystories-656K:WikiText-2; do
    IFS=':' read -r b mlabel tlabel <<<"$block"
    echo
    echo "### $mlabel on $tlabel"
    echo
    echo "base PPL $(fmt %.3f "$(cat "$OUT/$b.base")")"
    header
    cat "$OUT/$b.md"
done
echo
echo "### tinystories-656K on TinyStories: quantized latents"
echo
echo "palu per head at 0.5, \`--rank-multiple 8\` in both variants (\`--hadamard\` fuses a"
echo "Walsh-Hadamard rotation into the factors at decompose time), evaluated with \`verify --kv-bits\`."
echo "Achieved KV kept counts the integer codes plus the fp16 scale and zero point per unit and token."
echo
echo "base PPL $(fmt %.3f "$(cat "$OUT/656K-quant.base")")"
header
cat "$OUT/656K-quant.md"
REPORT_ARGS=()
for f in "$OUT"/*.jsonl; do REPORT_ARGS+=(--results "$f"); done
"$BIN" report "${M656[@]}" -s "$OUT/656K.kvstats" "${REPORT_ARGS[@]}" --title "make results" \
    --threads "$THREADS" -o "$OUT/report.html" -q
echo
echo "wall time: $((T1 - T0)) s; raw JSON lines in $OUT/*.jsonl, their figures in $OUT/report.html"
rm -rf "$DIR" "$DJ" "$VJ" "$ERR" "$OUT"/*.md "$OUT"/*.base
