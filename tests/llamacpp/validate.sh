#!/bin/sh
# The measurements of tests/llamacpp/README.md: llama.cpp's log-probabilities
# (logprobs.mjs) against kvcal's (kvcal_logprobs: its float32 forward and the
# naive float64 one) and `kvcal verify`'s perplexity, on the same token ids.
#
#   sh tests/llamacpp/validate.sh [THREADS]      (from the repository root)
#
# Needs build/kvcal and build/libkvcal.a (make), node-llama-cpp in deps/node
# (README.md), the shared models and text in ../shared (or KVCAL_SHARED) and
# data/kjv/gospels.txt (make data). Works in a temporary directory; prints
# one JSON line per comparison and a summary table. About a minute on 2 cores.
set -eu
T=${1:-2}
S=${KVCAL_SHARED:-../shared}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
K=build/kvcal
D=tests/llamacpp

sh $D/build.sh "$W/kvcal_logprobs"

# ids MODEL TEXT N OUT: the first N ids kvcal gives TEXT (BOS first), as text
# and as the little-endian uint32 file `kvcal verify --tokens` reads
ids() {
    $K tokenize -m "$1" --text "$2" --ids 2>/dev/null | tr ' ' '\n' | head -n "$3" | tr '\n' ' ' >"$4.txt"
    node -e 'const fs=require("fs");const a=fs.readFileSync(process.argv[1],"utf8").trim().split(/\s+/).map(Number);
             const b=Buffer.alloc(4*a.length);a.forEach((v,i)=>b.writeUInt32LE(v,4*i));fs.writeFileSync(process.argv[2],b)' \
        "$4.txt" "$4.u32"
}

# case NAME GGUF KVCAL_MODEL IDS [verify options]: run everything on one model
case_() {
    name=$1 gguf=$2 kmodel=$3 idf=$4
    shift 4
    n=$(wc -w <"$idf.txt")
    node $D/logprobs.mjs "$gguf" "$idf.txt" "$W/$name.lc.bin" --threads "$T" >"$W/$name.lc.json"
    node $D/logprobs.mjs "$gguf" "$idf.txt" "$W/$name.lc16.bin" --threads "$T" --kv-cache f16 >"$W/$name.lc16.json"
    "$W/kvcal_logprobs" --naive "$kmodel" "$idf.txt" "$W/$name.nv.bin" >"$W/$name.nv.json"
    "$W/kvcal_logprobs" --threads "$T" "$kmodel" "$idf.txt" "$W/$name.kv.bin" >"$W/$name.kv.json"
    $K verify -m "$kmodel" --tokens "$idf.u32" --seq-len "$n" --threads "$T" --json -q "$@" >"$W/$name.verify.json"
    node $D/compare.mjs "$W/$name.lc.bin" "$W/$name.nv.bin" "$idf.txt" >"$W/$name.lc-nv.json"
    node $D/compare.mjs "$W/$name.lc.bin" "$W/$name.kv.bin" "$idf.txt" >"$W/$name.lc-kv.json"
    node $D/compare.mjs "$W/$name.lc16.bin" "$W/$name.nv.bin" "$idf.txt" >"$W/$name.lc16-nv.json"
    node $D/compare.mjs "$W/$name.kv.bin" "$W/$name.nv.bin" "$idf.txt" >"$W/$name.kv-nv.json"
    for f in lc lc16 nv kv verify lc-nv lc-kv lc16-nv kv-nv; do
        printf '%s %s ' "$name" "$f"
        cat "$W/$name.$f.json" | tr -d '\n '
        echo
    done
    echo "$name" >>"$W/cases"
}

M260=$S/models/stories260K/stories260K.gguf
M656=$S/models/tinystories-656K
VAL=$S/text/tinystories/val1k.txt

# 1. stories260K.gguf as it is (llama2.c export, F32, head_dim 8)
ids "$M260" "$VAL" 1024 "$W/ids260"
case_ stories260K "$M260" "$M260" "$W/ids260"

# 2. a GGUF written by kvcal: plain-SVD K/V at half the KV bytes, exported dense
$K decompose -m "$M260" --method svd --ratio 0.5 -o "$W/svd260" -q --threads "$T" >/dev/null
$K export --dense "$W/svd260" --model "$M260" -o "$W/svd260.gguf" >/dev/null
case_ stories260K-svd-export "$W/svd260.gguf" "$W/svd260.gguf" "$W/ids260"
$K verify -m "$M260" --compressed "$W/svd260" --tokens "$W/ids260.u32" --seq-len 1024 --threads "$T" --json -q \
    | tr -d '\n ' | sed 's/^/stories260K-svd-export verify-compressed /'
echo

# 3. data/kjv-llama (HF, F16, head_dim 64, GQA 4/2) through hf2gguf.mjs
ids data/kjv-llama data/kjv/gospels.txt 256 "$W/idskjv"
node $D/hf2gguf.mjs data/kjv-llama "$W/kjv.gguf" >/dev/null
case_ kjv-llama "$W/kjv.gguf" data/kjv-llama "$W/idskjv"
node $D/hf2gguf.mjs data/kjv-llama "$W/kjv-f16.gguf" --dtype f16 >/dev/null
node $D/logprobs.mjs "$W/kjv-f16.gguf" "$W/idskjv.txt" "$W/kjvf16.bin" --threads "$T" | tr -d '\n ' | sed 's/^/kjv-llama-f16-weights lc /'
echo
node $D/compare.mjs "$W/kjvf16.bin" "$W/kjv-llama.nv.bin" "$W/idskjv.txt" | sed 's/^/kjv-llama-f16-weights lc-nv /'

# 4. kvcal's export of kjv-llama (an HF directory) through hf2gguf.mjs
$K decompose -m data/kjv-llama --method svd --ratio 0.5 -o "$W/svdkjv" -q --threads "$T" >/dev/null
$K export --dense "$W/svdkjv" --model data/kjv-llama -o "$W/svdkjv-hf" >/dev/null
node $D/hf2gguf.mjs "$W/svdkjv-hf" "$W/svdkjv.gguf" >/dev/null
case_ kjv-llama-svd-export "$W/svdkjv.gguf" "$W/svdkjv-hf" "$W/idskjv"
$K verify -m data/kjv-llama --compressed "$W/svdkjv" --tokens "$W/idskjv.u32" --seq-len 256 --threads "$T" --json -q \
    | tr -d '\n ' | sed 's/^/kjv-llama-svd-export verify-compressed /'
echo

# 5. tinystories-656K (HF, F32, tied embeddings, head_dim 16) through hf2gguf.mjs
ids "$M656" "$VAL" 512 "$W/ids656"
node $D/hf2gguf.mjs "$M656" "$W/ts656.gguf" >/dev/null
case_ tinystories-656K "$W/ts656.gguf" "$M656" "$W/ids656"

# summary: ppl of llama.cpp (F32 / F16 KV), kvcal verify, naive float64;
# max |Δ log p| over all positions and the whole vocabulary
node -e '
const fs = require("fs"), W = process.argv[1];
const r = (c, f) => JSON.parse(fs.readFileSync(`${W}/${c}.${f}.json`, "utf8"));
const e = (x) => x.toExponential(1);
console.log("case                        n  ppl llama.cpp  (F16 KV)   ppl kvcal verify  ppl naive f64" +
    "  max|dlogp|: lc-naive  lc-kvcal  kvcal-naive  lcF16KV-naive");
for (const c of fs.readFileSync(`${W}/cases`, "utf8").trim().split("\n")) {
    const lc = r(c, "lc"), v = r(c, "verify"), nv = r(c, "nv");
    console.log(`${c.padEnd(24)} ${String(lc.n).padStart(5)}  ${lc.ppl.toFixed(6).padStart(13)}  ${r(c, "lc16").ppl.toFixed(6).padStart(9)}  ` +
        `${v.ppl.toFixed(6).padStart(16)}  ` +
        `${nv.ppl.toFixed(6).padStart(13)}  ${e(r(c, "lc-nv").max_abs_dlogp).padStart(20)}  ${e(r(c, "lc-kv").max_abs_dlogp).padStart(8)}  ` +
        `${e(r(c, "kv-nv").max_abs_dlogp).padStart(11)}  ${e(r(c, "lc16-nv").max_abs_dlogp).padStart(13)}`);
}' "$W"
