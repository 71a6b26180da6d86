#!/usr/bin/env bash
# Checked examples in the documentation.
#
#   tests/docs.sh check FILE...    run every console block of each FILE and
#                                  compare what kvcal prints with the block
#   tests/docs.sh update FILE...   write what kvcal prints into the blocks
#                                  (make docs)
#
# A console block is a fenced code block whose info string is `console`,
# with its fence in column 0. In it, a line starting with "$ " is a shell
# command (a trailing "\" continues it onto the next line); the lines after a
# command, up to the next "$ " line or the end of the block, are its expected
# output: stdout and stderr together, as 2>&1 gives them. Trailing blank lines
# are ignored. The exit status is not compared.
#
# Where the commands run: each FILE gets a fresh scratch directory, and every
# command of the file runs there with bash -c, block after block in file
# order, so a later block can use what an earlier one wrote. `kvcal` is the
# built binary ($KVCAL_BIN, default build/kvcal). The directory holds links to
# the shared models and texts ($KVCAL_SHARED, default ../shared):
# tinystories-656K, stories260K.bin, stories260K.gguf, tok512.bin, val1k.txt
# and wiki.test.raw; `data`, a link to the repository's data/ folder; and
# cal.txt and eval.txt, the first and the last 500 stories of val1k.txt.
# Commands run with LC_ALL=C, one thread (OMP_NUM_THREADS=1,
# OPENBLAS_NUM_THREADS=1), OpenBLAS's Haswell kernels (OPENBLAS_CORETYPE=
# Haswell, or $DOCS_OPENBLAS_CORETYPE: AVX2 and FMA, which Intel and AMD
# machines alike run, so the last digits of a perplexity or a checksum of
# float sums do not change with the CPU the checks run on), stdin from
# /dev/null and at most 300 s each.
#
# Masks. Before comparing, these are replaced by '#' in the expected and the
# actual text alike, because they vary from run to run and machine to machine;
# everything else must match exactly:
#   durations   a number followed by " s", " ms", " us" or " µs"
#   rates       a number followed by " tokens/s", " tok/s", " GB/s" or
#               " GFLOP/s", and the compressed rate in verify's
#               "N tokens/s base, N compressed"
#   memory      a number followed by " MiB" (peak RSS)
#   JSON        the values of "seconds", "tokens_per_s" and "peak_rss_mib"
#   blas        the OpenBLAS kernel set and its hint on a "blas" line, and
#               the values of "blas_kernels" and "blas_faster"
#   temp names  ".tmp-<digits>", and the 6-character suffix of a mktemp name
#               (tmp.XXXXXX, kvcal-NAME.XXXXXX)
#   bench-attn  its timing table's µs/step, µs attn, GB/s, % peak and speedup
#               cells (a table row whose last cell is "<number>x")
#
# Lint: every fence opening a code block needs an info string (console for
# checked examples, sh for commands to type, and so on), a console block must
# start with a command, and a block that is not console must not hold "$ "
# lines (a transcript that nothing checks).
#
# DOCS_VERBOSE=1 prints each command's time.
#
# Exit status: 0 when every FILE matches (or was updated), 1 on a mismatch or
# a lint error, 2 on a usage error, 77 when $KVCAL_SHARED does not exist and a
# FILE has console blocks (the message says so; tests/test_docs.c skips).
set -uo pipefail
export LC_ALL=C

usage() { echo "usage: tests/docs.sh check|update FILE..." >&2; exit 2; }
(($# >= 2)) || usage
MODE=$1
shift
[[ $MODE == check || $MODE == update ]] || usage

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${KVCAL_SHARED:-../shared}
[[ $SHARED == /* ]] || SHARED=$ROOT/$SHARED
BIN=${KVCAL_BIN:-build/kvcal}
[[ $BIN == /* ]] || BIN=$ROOT/$BIN
[[ -x $BIN ]] || { echo "docs.sh: kvcal binary '$BIN' is missing (run make)" >&2; exit 1; }

mask() {
    sed -E \
        -e 's/[0-9]+(\.[0-9]+)? (s|ms|us|µs)\b/# \2/g' \
        -e 's#[0-9]+(\.[0-9]+)? (tokens/s|tok/s|GB/s|GFLOP/s)#\# \2#g' \
        -e 's#(tokens/s base, )[0-9]+ compressed#\1\# compressed#g' \
        -e 's/[0-9]+(\.[0-9]+)? MiB/# MiB/g' \
        -e 's/"(seconds|tokens_per_s|peak_rss_mib)": [-+0-9.eE]+/"\1": #/g' \
        -e 's/^(blas +)OpenBLAS .*/\1#/' \
        -e 's/"blas_(kernels|faster)": ("[^"]*"|null)/"blas_\1": #/g' \
        -e 's/\.tmp-[0-9]+/.tmp-#/g' \
        -e 's/\b(tmp|kvcal-[A-Za-z0-9_-]+)\.[A-Za-z0-9]{6}\b/\1.XXXXXX/g' \
        -e 's/^(\|([^|]*\|){4})([^|]*\|){4}[ 0-9.]+x \|$/\1 # | # | # | # | # |/'
}

SCRATCH=""
BINDIR=$(mktemp -d "${TMPDIR:-/tmp}/kvcal-docs-bin.XXXXXX")
ln -s "$BIN" "$BINDIR/kvcal"
cleanup() { rm -rf "$BINDIR" ${SCRATCH:+"$SCRATCH"}; }
trap cleanup EXIT

# A fresh scratch directory for one file, with the inputs described above.
make_scratch() {
    [[ -n $SCRATCH ]] && rm -rf "$SCRATCH"
    SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/kvcal-docs.XXXXXX")
    local m=$SHARED/models t=$SHARED/text
    local links=("$m/tinystories-656K" "$m/stories260K/stories260K.bin" "$m/stories260K/stories260K.gguf"
        "$m/stories260K/tok512.bin" "$t/tinystories/val1k.txt" "$t/wikitext-2-raw/wiki.test.raw")
    local f
    for f in "${links[@]}"; do
        [[ -e $f ]] && ln -s "$f" "$SCRATCH/$(basename "$f")"
    done
    ln -s "$ROOT/data" "$SCRATCH/data"
    if [[ -e $SCRATCH/val1k.txt ]]; then
        # a story is its lines up to and including its <|endoftext|> line
        awk -v cal="$SCRATCH/cal.txt" -v ev="$SCRATCH/eval.txt" \
            '{ print > (n < 500 ? cal : ev) } /^<\|endoftext\|>$/ { n++ }' "$SCRATCH/val1k.txt"
    fi
}

# run CMD: its output, stdout and stderr together, trailing newlines dropped.
run() {
    (cd "$SCRATCH" && PATH="$BINDIR:$PATH" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        OPENBLAS_CORETYPE="${DOCS_OPENBLAS_CORETYPE:-Haswell}" \
        timeout 300 bash -c "$1" </dev/null 2>&1)
}

# Strip trailing empty lines from the array named $1.
trim() {
    local -n a=$1
    while ((${#a[@]})) && [[ -z ${a[-1]} ]]; do unset 'a[-1]'; done
}

status=0

# process FILE: check or update its console blocks.
process() {
    local file=$1
    local -a lines out
    mapfile -t lines <"$file"
    local n=${#lines[@]} i=0 fails=0 blocks=0 line info

    # lint, and count the console blocks, before running anything
    local infence=0 kind="" start=0 first=0
    for ((i = 0; i < n; i++)); do
        line=${lines[i]}
        if ((!infence)) && [[ $line =~ ^\ *\`\`\`(.*)$ ]]; then
            info=${BASH_REMATCH[1]}
            infence=1 start=$((i + 1)) first=1 kind=${info%% *}
            if [[ -z $kind ]]; then
                echo "$file:$start: a code block without an info string (console, sh, ...)" >&2
                fails=$((fails + 1))
            elif [[ $kind == console ]]; then
                blocks=$((blocks + 1))
                if [[ $line != '```console' ]]; then
                    echo "$file:$start: a console block must start in column 0 as \`\`\`console" >&2
                    fails=$((fails + 1))
                fi
            fi
        elif ((infence)) && [[ $line =~ ^\ *\`\`\`\ *$ ]]; then
            infence=0
        elif ((infence)); then
            if [[ $kind == console ]] && ((first)) && [[ $line != '$ '* ]]; then
                echo "$file:$start: a console block must start with a '\$ ' command line" >&2
                fails=$((fails + 1))
            elif [[ -n $kind && $kind != console && $line =~ ^\ *\$\  ]]; then
                echo "$file:$((i + 1)): a '\$ ' line in a $kind block: make it a console block" >&2
                fails=$((fails + 1))
            fi
            first=0
        fi
    done
    if ((infence)); then
        echo "$file:$start: code block never closed" >&2
        fails=$((fails + 1))
    fi
    if ((fails)); then status=1; return; fi
    if ((blocks == 0)); then
        echo "docs: $file: no console blocks"
        return
    fi
    if [[ ! -d $SHARED ]]; then
        echo "shared test data '$SHARED' is absent; skipping the examples of $file"
        [[ $status == 0 ]] && status=77
        return
    fi

    make_scratch
    local t0=$SECONDS ncmd=0
    i=0
    while ((i < n)); do
        line=${lines[i]}
        out+=("$line")
        i=$((i + 1))
        [[ $line == '```console' ]] || continue
        local bstart=$i bfirst=""
        while ((i < n)) && [[ ! ${lines[i]} =~ ^\`\`\`\ *$ ]]; do
            # one command: its lines, then its expected output
            local -a cmdlines=("${lines[i]}") exp=() act=() em=() am=()
            local cmdline=$i cmd=${lines[i]#\$ }
            i=$((i + 1))
            while [[ ${cmdlines[-1]} == *\\ ]] && ((i < n)); do
                cmdlines+=("${lines[i]}")
                cmd+=$'\n'${lines[i]}
                i=$((i + 1))
            done
            while ((i < n)) && [[ ${lines[i]} != '$ '* && ! ${lines[i]} =~ ^\`\`\`\ *$ ]]; do
                exp+=("${lines[i]}")
                i=$((i + 1))
            done
            trim exp
            [[ -n $bfirst ]] || bfirst=${cmdlines[0]}
            ncmd=$((ncmd + 1))
            local c0=$SECONDS
            mapfile -t act < <(run "$cmd")
            [[ -z ${DOCS_VERBOSE:-} ]] || echo "docs: $file:$((cmdline + 1)): $((SECONDS - c0)) s: ${cmdlines[0]}"
            trim act
            mapfile -t em < <(((${#exp[@]})) && printf '%s\n' "${exp[@]}" | mask)
            mapfile -t am < <(((${#act[@]})) && printf '%s\n' "${act[@]}" | mask)
            local k same=1 len=$((${#em[@]} > ${#am[@]} ? ${#em[@]} : ${#am[@]}))
            for ((k = 0; k < len; k++)); do
                if [[ $k -ge ${#em[@]} || $k -ge ${#am[@]} || ${em[k]} != "${am[k]}" ]]; then
                    same=0
                    break
                fi
            done
            out+=("${cmdlines[@]}")
            if ((same)); then
                ((${#exp[@]})) && out+=("${exp[@]}")
            else
                ((${#act[@]})) && out+=("${act[@]}")
                if [[ $MODE == check ]]; then
                    fails=$((fails + 1))
                    echo "$file:$bstart: the console block starting '$bfirst' differs"
                    [[ ${cmdlines[0]} == "$bfirst" ]] || echo "  in the command on line $((cmdline + 1)): ${cmdlines[0]}"
                    echo "  first difference at output line $((k + 1)):"
                    echo "  expected: ${exp[k]-<end of output>}"
                    echo "  actual:   ${act[k]-<end of output>}"
                else
                    echo "docs: $file:$((cmdline + 1)): updated the output of ${cmdlines[0]}"
                fi
            fi
        done
    done
    local took=$((SECONDS - t0))
    if ((fails)); then
        echo "docs: $file: $fails of $ncmd commands differ ($took s); if the change is meant, run 'make docs' and review the diff"
        status=1
        return
    fi
    if [[ $MODE == update ]]; then
        local tmp
        tmp=$(mktemp "$file.XXXXXX")
        printf '%s\n' "${out[@]}" >"$tmp" && cat "$tmp" >"$file"
        rm -f "$tmp"
    fi
    echo "docs: $file: all $ncmd commands of its console blocks match ($took s)"
}

for f in "$@"; do
    [[ -f $f ]] || { echo "docs.sh: '$f' does not exist" >&2; status=1; continue; }
    process "$f"
done
exit "$status"
