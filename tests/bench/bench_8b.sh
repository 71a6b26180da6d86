#!/usr/bin/env bash
# kvcal at Llama-3.1-8B's shape (docs/bench-8b.md):
#
#   bash tests/bench/bench_8b.sh [LAYERS]      (default 32)
#
# Writes a random-weight BF16 model with Llama-3.1-8B's config and LAYERS
# layers (build/bench/bench_8b_model) into a temporary directory under
# ${TMPDIR:-/tmp}, then runs and times
#
#   kvcal collect   2 windows of 2048 tokens
#   kvcal decompose --ratio 0.5 (palu) from those statistics
#   kvcal verify    --compressed, 1 window of 2048 tokens
#   kvcal verify    the base model, 1 window of 2048 tokens
#
# recording each one's wall time, peak RssAnon and RssFile (polled from
# /proc/PID/status every 0.2 s), the tokens/s and BLAS kernels it reports
# (--json), and its forward rate against OpenBLAS sgemm at the forward's
# shapes (bench_8b_model --sgemm, same threads). The text is the King James
# text of data/kjv (make data), else README.md repeated; the model's
# tokenizer gives one token per byte. The model directory is removed at the
# end, whatever happens. Environment: KVCAL_BIN (default build/kvcal),
# BENCH_8B_MODEL (default build/bench/bench_8b_model), BENCH_8B_SGEMM=0 to
# skip the sgemm timing, KVCAL_THREADS to pass --threads. Exit status: 0
# when every step ran, 1 when one failed (the table says which).
set -u

LAYERS=${1:-32}
case $LAYERS in '' | *[!0-9]* | 0) echo "usage: bash tests/bench/bench_8b.sh [LAYERS]" >&2; exit 2 ;; esac
# paths given relative to the caller's directory; the rest from the repository root
KVCAL=${KVCAL_BIN:-} GEN=${BENCH_8B_MODEL:-}
[ -n "$KVCAL" ] && [ "${KVCAL#/}" = "$KVCAL" ] && KVCAL=$PWD/$KVCAL
[ -n "$GEN" ] && [ "${GEN#/}" = "$GEN" ] && GEN=$PWD/$GEN
cd "$(dirname "$0")/../.." || exit 1
KVCAL=${KVCAL:-$PWD/build/kvcal} GEN=${GEN:-$PWD/build/bench/bench_8b_model}
SEQ=2048
for b in "$KVCAL" "$GEN"; do
    if [ ! -x "$b" ]; then
        echo "bench_8b: '$b' not found: build it first (make CUDA=0 build/kvcal build/bench/bench_8b_model)" >&2
        exit 1
    fi
done
THREADS=()
[ -n "${KVCAL_THREADS:-}" ] && THREADS=(--threads "$KVCAL_THREADS")

# Sizes: BF16 parameters (embedding and head 128256 x 4096 each, 218.1M a
# layer); decompose writes the streamed model's uncompressed weights again,
# in their stored BF16, beside the factors: about the model's size again.
read -r MODEL_GB DEC_GB < <(awk -v l="$LAYERS" 'BEGIN {
    p = 2 * 128256 * 4096 + 4096 + l * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096)
    printf "%.2f %.2f\n", 2 * p / 1e9, 2 * p / 1e9 }')
ROOT=${TMPDIR:-/tmp}
FREE_GB=$(df -Pk "$ROOT" | awk 'NR == 2 { printf "%.2f", $4 * 1024 / 1e9 }')
MEM_GB=$(awk '/^MemAvailable:/ { printf "%.2f", $2 * 1024 / 1e9 }' /proc/meminfo)
echo "bench_8b: $LAYERS layers: the model takes $MODEL_GB GB on disk, decompose's output about $DEC_GB GB more;"
echo "bench_8b: $ROOT has $FREE_GB GB free, $MEM_GB GB of memory available"
if awk -v f="$FREE_GB" -v m="$MODEL_GB" 'BEGIN { exit !(f < m * 1.02 + 0.5) }'; then
    echo "bench_8b: not enough free space in $ROOT for the model ($MODEL_GB GB): set TMPDIR or pass fewer layers" >&2
    exit 1
fi
if awk -v f="$FREE_GB" -v m="$MODEL_GB" -v d="$DEC_GB" 'BEGIN { exit !(f < m + d + 0.5) }'; then
    echo "bench_8b: warning: $FREE_GB GB free is less than the model plus decompose's output: decompose may run out of space"
fi

WORK=$(mktemp -d "$ROOT/kvcal-bench8b.XXXXXX") || exit 1
CHILD=""
cleanup() {
    # a step still running (the script was interrupted) goes first
    [ -n "$CHILD" ] && kill "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
echo "bench_8b: working in $WORK (removed at the end)"

# CPU seconds: busy time of the whole machine (/proc/stat), and the user +
# system time of this shell's reaped children (bash's times builtin)
HZ=$(getconf CLK_TCK)
machine_cpu() {
    local _c u n s i w q sq st _r
    read -r _c u n s i w q sq st _r </proc/stat
    awk -v j=$((u + n + s + q + sq + st)) -v hz="$HZ" 'BEGIN { printf "%.2f", j / hz }'
}
# (times must run in this shell, not in a command substitution's subshell)
times_cpu() {
    awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] } printf "%.2f", t }' "$1"
}

# run_step NAME CMD...: run CMD with stdout to $WORK/NAME.out and stderr to
# $WORK/NAME.err, polling its memory; sets S_RC, S_WALL, S_ANON, S_FILE
# (peak kB), S_LAST (the last sample, "anon file" kB), S_OTHER (the share
# of the machine other processes used meanwhile, "N%").
run_step() {
    local name=$1 k v _ a f t0 t1 m0 m1 c0 c1
    shift
    times >"$WORK/.times"
    m0=$(machine_cpu) c0=$(times_cpu "$WORK/.times")
    t0=$(date +%s.%N)
    "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    local pid=$!
    CHILD=$pid
    S_ANON=0 S_FILE=0 S_LAST="0 0"
    while kill -0 "$pid" 2>/dev/null; do
        a=0 f=0
        while read -r k v _; do
            case $k in RssAnon:) a=$v ;; RssFile:) f=$v ;; esac
        done 2>/dev/null <"/proc/$pid/status"
        if [ "$a" -gt 0 ] || [ "$f" -gt 0 ]; then
            S_LAST="$a $f"
            [ "$a" -gt "$S_ANON" ] && S_ANON=$a
            [ "$f" -gt "$S_FILE" ] && S_FILE=$f
        fi
        sleep 0.2
    done
    wait "$pid"
    S_RC=$?
    CHILD=""
    t1=$(date +%s.%N)
    times >"$WORK/.times"
    m1=$(machine_cpu) c1=$(times_cpu "$WORK/.times")
    S_WALL=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    S_OTHER=$(awk -v w="$S_WALL" -v m="$m1" -v mm="$m0" -v c="$c1" -v cc="$c0" -v n="$(nproc)" \
        'BEGIN { o = (m - mm) - (c - cc); if (o < 0) o = 0; printf "%.0f%%", (w > 0 ? 100 * o / (w * n) : 0) }')
    if [ "$S_RC" -ne 0 ]; then
        echo "bench_8b: $name failed with exit status $S_RC; last RSS sample: anon $(kb_mib ${S_LAST% *}) MiB, file $(kb_mib ${S_LAST#* }) MiB" >&2
        echo "bench_8b: $name's stderr ends:" >&2
        tail -n 5 "$WORK/$name.err" | sed 's/^/    /' >&2
    fi
}
kb_mib() { awk -v k="$1" 'BEGIN { printf "%.0f", k / 1024 }'; }
# jget FILE KEY: the first "KEY": value of kvcal's indented --json output
jget() { sed -n "s/^ *\"$2\": *\"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}\$/\1/p" "$1" | head -n 1; }

# The texts: collect reads 2 windows of SEQ tokens, verify 1; one byte is
# one token after BOS.
CTEXT=$WORK/calib.txt VTEXT=$WORK/heldout.txt
if [ -s data/kjv/train.txt ] && [ -s data/kjv/gospels.txt ]; then
    head -c $((4 * SEQ)) data/kjv/train.txt >"$CTEXT"
    head -c $((2 * SEQ)) data/kjv/gospels.txt >"$VTEXT"
    TEXTS="data/kjv/train.txt (first $((4 * SEQ)) bytes) and data/kjv/gospels.txt (first $((2 * SEQ)) bytes)"
else
    while [ "$(wc -c <"$CTEXT" 2>/dev/null || echo 0)" -lt $((6 * SEQ)) ]; do cat README.md >>"$CTEXT"; done
    tail -c $((2 * SEQ)) "$CTEXT" >"$VTEXT"
    head -c $((4 * SEQ)) "$CTEXT" >"$CTEXT.tmp" && mv "$CTEXT.tmp" "$CTEXT"
    TEXTS="README.md repeated (no data/kjv: make data)"
fi

FAILED=0
ROWS=()
# row NAME TOKS_PER_S FLOPS_PER_TOKEN BLAS NOTE [SGEMM_GFLOPS]: a table row of
# the last step; its GFLOP/s against SGEMM_GFLOPS (default $MIX)
row() {
    local pct="-" gf="-" mix=${6:-${MIX:-}}
    if [ -n "$2" ] && [ "$2" != "-" ] && [ -n "$3" ] && [ -n "$mix" ]; then
        gf=$(awk -v t="$2" -v f="$3" 'BEGIN { printf "%.1f", t * f / 1e9 }')
        pct=$(awk -v g="$gf" -v m="$mix" 'BEGIN { printf "%.0f%%", 100 * g / m }')
    fi
    local st=ok
    [ "$S_RC" -ne 0 ] && st="exit $S_RC" && FAILED=1
    local tps=${2:--} note=${4:--}
    [ "$tps" != - ] && tps=$(awk -v t="$tps" 'BEGIN { printf "%.1f", t }')
    [ -n "${5:-}" ] && note="$note ${5}"
    local ra rf
    ra=$(kb_mib "$S_ANON") rf=$(kb_mib "$S_FILE")
    local oth=${S_OTHER:--}
    [ "$S_WALL" = same ] && ra=same rf=same oth=same
    [ "$S_RC" -ne 0 ] && [ "$S_WALL" = same ] && S_WALL=- ra=- rf=- oth=-
    ROWS+=("$(printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |' "$1" "$st" "$S_WALL" \
        "$ra" "$rf" "$tps" "$gf" "$pct" "$oth" "$note")")
}

# 0. sgemm at the forward's shapes, with the threads kvcal uses
MIX="" LMIX="" FPT_V="" FPT_C=""
if [ "${BENCH_8B_SGEMM:-1}" != 0 ]; then
    echo "bench_8b: timing sgemm at the forward's shapes"
    run_step sgemm env ${KVCAL_THREADS:+OMP_NUM_THREADS=$KVCAL_THREADS} "$GEN" --sgemm --layers "$LAYERS" --tokens $SEQ
    sed -n '/^OpenBLAS/,/^sgemm-bound/p' "$WORK/sgemm.out" | grep -v '^sgemm_gflops'
    MIX=$(sed -n 's/^sgemm_mix_gflops //p' "$WORK/sgemm.out")
    LMIX=$(sed -n 's/^sgemm_layer_gflops //p' "$WORK/sgemm.out")
    FPT_V=$(sed -n 's/^flops_per_token_verify //p' "$WORK/sgemm.out")
    FPT_C=$(sed -n 's/^flops_per_token_collect //p' "$WORK/sgemm.out")
    SG_BLAS=$(sed -n 's/^blas_kernels //p' "$WORK/sgemm.out")
    NOTE=""
    [ -n "$MIX" ] && NOTE="$(awk -v m="$MIX" 'BEGIN { printf "%.1f", m }') GFLOP/s at the forward's mix"
    row "sgemm at the forward's shapes" "-" "" "$SG_BLAS" "$NOTE"
fi

# 1. the model
echo "bench_8b: writing the model"
M=$WORK/model
run_step write "$GEN" "$M" --layers "$LAYERS"
cat "$WORK/write.out"
row "write model ($(sed -n 's/^wrote .*(\(.* GB\)).*/\1/p' "$WORK/write.out"))" "-" "" "-"
if [ "$S_RC" -ne 0 ]; then
    printf '%s\n' "${ROWS[@]}"
    exit 1
fi

# 2. collect
echo "bench_8b: kvcal collect"
run_step collect "$KVCAL" collect -m "$M" -t "$CTEXT" -o "$WORK/s.kvstats" --seq-len $SEQ \
    --samples 2 --sequential --json "${THREADS[@]}"
O=$WORK/collect.out
row "collect, 2 x $SEQ tokens" "$(jget "$O" tokens_per_s)" "$FPT_C" "$(jget "$O" blas_kernels)" \
    "$(f=$(jget "$O" blas_faster); [ -n "$f" ] && [ "$f" != null ] && echo "(faster: $f)")" "$LMIX"

# 3. decompose
echo "bench_8b: kvcal decompose --ratio 0.5"
run_step decompose "$KVCAL" decompose -m "$M" -s "$WORK/s.kvstats" --ratio 0.5 -o "$WORK/comp" \
    --json "${THREADS[@]}"
O=$WORK/decompose.out
DEC_DISK=$(du -sb "$WORK/comp" 2>/dev/null | awk '{ printf "%.2f GB", $1 / 1e9 }')
row "decompose --ratio 0.5" "-" "" "-" "${DEC_DISK:+output $DEC_DISK}"
DEC_OK=$S_RC
[ -d "$WORK/comp" ] && (cd "$WORK/comp" && ls -l | sed -n '2,$p' | awk '{ printf "    %-40s %14s bytes\n", $9, $5 }')

# 4. verify --compressed
echo "bench_8b: kvcal verify --compressed"
if [ "$DEC_OK" -eq 0 ]; then
    run_step verify_c "$KVCAL" verify -m "$M" --compressed "$WORK/comp" -t "$VTEXT" --seq-len $SEQ \
        --max-windows 1 --json "${THREADS[@]}"
    O=$WORK/verify_c.out
    row "verify --compressed, 1 x $SEQ: base run" "$(jget "$O" base_tokens_per_s)" "$FPT_V" \
        "$(jget "$O" blas_kernels)" "(ppl $(jget "$O" base_ppl))"
    S_WALL=same
    row "verify --compressed: compressed run (same process)" "$(jget "$O" tokens_per_s)" "" \
        "$(jget "$O" blas_kernels)" "(ppl $(jget "$O" ppl), KV ratio $(jget "$O" ratio))"
else
    S_RC=1 S_WALL=same
    row "verify --compressed: not run, decompose failed" "-" "" "-"
fi

# 5. verify, base
echo "bench_8b: kvcal verify"
run_step verify "$KVCAL" verify -m "$M" -t "$VTEXT" --seq-len $SEQ --max-windows 1 --json "${THREADS[@]}"
O=$WORK/verify.out
P=$(jget "$O" ppl)
row "verify base, 1 x $SEQ" "$(jget "$O" tokens_per_s)" "$FPT_V" "$(jget "$O" blas_kernels)" \
    "${P:+(ppl $P)}"

echo
echo "kvcal at Llama-3.1-8B's shape, $LAYERS layers (random BF16 weights, streamed), $(nproc) cores," \
    "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
echo "text: $TEXTS"
echo "others' CPU: the share of the machine's $(nproc) cores that other processes used during the step" \
    "(above a few %, the timings are slowed by them)"
[ -n "$FPT_V" ] && echo "forward FLOPs per token: verify $(awk -v f="$FPT_V" 'BEGIN { printf "%.3f", f / 1e9 }') G," \
    "collect $(awk -v f="$FPT_C" 'BEGIN { printf "%.3f", f / 1e9 }') G (matrix products and attention at $SEQ tokens;" \
    "collect measured against the sgemm rate of the layers alone, it runs no head;" \
    "collect's float64 sums not counted)"
echo
echo "| step | status | wall s | peak RssAnon MiB | peak RssFile MiB | tokens/s | GFLOP/s | of sgemm | others' CPU | blas |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
exit $FAILED
