// Compare two log-probability files in the layout of logprobs.mjs (for
// example llama.cpp's against kvcal_logprobs'):
//
//   node tests/llamacpp/compare.mjs A.bin B.bin [IDS.txt]
//
// Prints one JSON line: max |log p_A - log p_B| over every position and the
// whole vocabulary (and where), the same restricted to entries with
// log p_A >= -20, the mean KL(A || B) per position, top-1 agreement, and
// with IDS.txt the perplexities of both on the ids (position i scores
// ids[i+1]) and the max |Δ log p| at those targets.
import fs from "node:fs";

import { UsageError, die } from "./common.mjs";

function readBin(file) {
    let buf;
    try {
        buf = fs.readFileSync(file);
    } catch (e) {
        throw new Error(`${file}: cannot read: ${e.code ?? e.message}`);
    }
    if (buf.length < 8) throw new Error(`${file}: too short for the header`);
    const nPos = buf.readUInt32LE(0), nVocab = buf.readUInt32LE(4);
    if (buf.length !== 8 + nPos * nVocab * 4)
        throw new Error(`${file}: ${buf.length} bytes, header says ${nPos} x ${nVocab} float32 (${8 + nPos * nVocab * 4})`);
    const data = new Float32Array(buf.buffer.slice(buf.byteOffset + 8, buf.byteOffset + buf.length));
    return { nPos, nVocab, data };
}

function main() {
    const args = process.argv.slice(2);
    if (args.length < 2 || args.length > 3) throw new UsageError("usage: compare.mjs A.bin B.bin [IDS.txt]");
    const a = readBin(args[0]), b = readBin(args[1]);
    if (a.nPos !== b.nPos || a.nVocab !== b.nVocab)
        throw new Error(`shapes differ: ${a.nPos} x ${a.nVocab} against ${b.nPos} x ${b.nVocab}`);
    let ids = null;
    if (args[2]) {
        ids = fs.readFileSync(args[2], "utf8").split(/\s+/).filter((w) => w !== "").map(Number);
        if (ids.length !== a.nPos + 1) throw new Error(`${args[2]}: ${ids.length} ids, expected ${a.nPos + 1}`);
    }
    const V = a.nVocab;
    let maxAll = 0, where = null, maxLikely = 0, maxTarget = 0, kl = 0, agree = 0, nllA = 0, nllB = 0;
    for (let i = 0; i < a.nPos; i++) {
        let argA = 0, argB = 0;
        // KL on rows renormalized in float64 (the stored float32 log p sum
        // to 1 only to rounding, which would show as KL noise of ~1e-9).
        let sa = 0, sb = 0;
        for (let v = 0; v < V; v++) sa += Math.exp(a.data[i * V + v]), sb += Math.exp(b.data[i * V + v]);
        const za = Math.log(sa), zb = Math.log(sb);
        for (let v = 0; v < V; v++) {
            const la = a.data[i * V + v], lb = b.data[i * V + v];
            const d = Math.abs(la - lb);
            if (!(d <= maxAll)) {
                maxAll = d;
                where = { position: i, token: v, a: la, b: lb };
            }
            if (la >= -20 && d > maxLikely) maxLikely = d;
            kl += Math.exp(la - za) * (la - za - (lb - zb));
            if (la > a.data[i * V + argA]) argA = v;
            if (lb > b.data[i * V + argB]) argB = v;
        }
        if (argA === argB) agree++;
        if (ids) {
            const t = ids[i + 1];
            const la = a.data[i * V + t], lb = b.data[i * V + t];
            nllA -= la, nllB -= lb;
            maxTarget = Math.max(maxTarget, Math.abs(la - lb));
        }
    }
    const out = {
        n_positions: a.nPos,
        n_vocab: V,
        max_abs_dlogp: maxAll,
        max_at: where,
        max_abs_dlogp_where_logp_a_ge_minus20: maxLikely,
        mean_kl_a_b: kl / a.nPos,
        top1_agreement: agree / a.nPos,
        ...(ids ? {
            ppl_a: Math.exp(nllA / a.nPos),
            ppl_b: Math.exp(nllB / a.nPos),
            max_abs_dlogp_target: maxTarget,
        } : {}),
    };
    process.stdout.write(JSON.stringify(out) + "\n");
}

try {
    main();
} catch (e) {
    die(e?.message ?? String(e));
}
