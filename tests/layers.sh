#!/usr/bin/env bash
# The layering of the tree, checked (make test runs this through
# tests/test_layers.c):
#
#   lib/      <- formats/, kernels/ <- calib/ <- cmd/
#
# 1. includes: every header of every folder is included, as a file of each
#    folder would include it, with that folder's include paths from the
#    Makefile (INC_<folder>); it must compile exactly when the folder may
#    use it. lib/kvcal.h gathers every layer, so only cmd/ (through the
#    installed headers) may include it.
# 2. symbols: no object of a folder references a symbol that only a folder
#    it may not use defines (objects from `make`, in build/obj).
# 3. no quoted include climbs out of its folder ("../x.h") or is absolute.
#
# Prints one line per violation and exits 1, else one summary line.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
CC=${CC:-cc}
build=${BUILD:-build}

# the folders each folder may use, besides itself (the Makefile's INC_*)
declare -A uses=([lib]="" [formats]="lib" [kernels]="lib" [calib]="lib formats"
                 [cmd]="lib formats kernels calib")
layers="lib formats kernels calib cmd"
flags=$(make -s --no-print-directory layer-flags) || { echo "layers: make layer-flags failed"; exit 1; }
declare -A inc
while IFS='=' read -r k v; do inc[$k]=$v; done <<<"$flags"
installed=" $(make -s --no-print-directory installed-headers) "

bad=0
fail() { echo "layers: $*"; bad=$((bad + 1)); }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvcal-layers.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# ---------------------------------------------------------------- 1. includes
probes=0
for from in $layers; do
    for h in lib/*.h formats/*.h kernels/*.h calib/*.h cmd/*.h; do
        dir=${h%%/*} name=${h##*/}
        # may `from` include h?
        if [[ $from == cmd ]]; then
            want=no
            [[ $dir == cmd || $installed == *" $name "* ]] && want=yes
        elif [[ $name == kvcal.h ]]; then
            want=no
        elif [[ $dir == "$from" || " ${uses[$from]} " == *" $dir "* ]]; then
            want=yes
        else
            want=no
        fi
        # a file of folder `from` searches its own folder first (-iquote)
        printf '#include "%s"\n' "$name" >"$tmp/probe.c"
        # it compiles and the header found is ours (not a system header of
        # the same name, such as <err.h> or <limits.h>)
        got=no
        if $CC -std=c11 -D_GNU_SOURCE -M -iquote "$from" ${inc[$from]} "$tmp/probe.c" \
            >"$tmp/out" 2>&1 && tr ' \\' '\n\n' <"$tmp/out" | grep -qxE "$h|$build/include/$name"; then
            got=yes
        fi
        probes=$((probes + 1))
        if [[ $got != "$want" ]]; then
            if [[ $want == yes ]]; then
                fail "$from/ may include $h, but it does not compile there: $(grep -m1 error "$tmp/out")"
            else
                fail "$from/ must not include $h, but it compiles there"
            fi
        fi
    done
done

# ---------------------------------------------------------------- 2. symbols
# the objects of the sources there are now (not stale ones of renamed
# files), brought up to date first
objs=()
for l in $layers; do
    for c in "$l"/*.c; do objs+=("$build/obj/${c%.c}.o"); done
done
built=1
if ! make -s --no-print-directory "${objs[@]}" >"$tmp/make" 2>&1; then
    fail "the objects do not build: $(grep -m1 -E 'error|Error' "$tmp/make")"
    built=0
fi
declare -A defined_in
libc_interposed=(mmap)
for l in $layers; do
    ((built)) || break
    for c in "$l"/*.c; do
        o=$build/obj/${c%.c}.o
        while read -r sym; do defined_in[$sym]+=" $l"; done < <(nm -g --defined-only "$o" | awk '{print $3}')
    done
done
syms=0
for l in $layers; do
    ((built)) || break
    allowed=" $l ${uses[$l]} "
    for c in "$l"/*.c; do
        o=$build/obj/${c%.c}.o
        while read -r sym; do
            owners=${defined_in[$sym]:-}
            [[ -z $owners ]] && continue # a system library's
            # the C library's own functions that cmd/ interposes (blasguard.c)
            [[ " ${libc_interposed[*]} " == *" $sym "* ]] && continue
            syms=$((syms + 1))
            ok=0
            for w in $owners; do [[ $allowed == *" $w "* ]] && ok=1; done
            ((ok)) || fail "${o#"$build"/obj/} uses '$sym', which only${owners} defines"
        done < <(nm -u "$o" | awk '{print $2}')
    done
done

# ---------------------------------------------------------------- 3. paths
while IFS= read -r line; do
    fail "an include outside its folder: $line"
done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"(\.\.|/)' lib/* formats/* calib/* kernels/* cmd/* 2>/dev/null)

if ((bad)); then
    echo "layers: $bad violation(s)"
    exit 1
fi
echo "layers: $probes include probes and $syms cross-object symbol references follow lib <- formats, kernels <- calib <- cmd"
