// llama.cpp's next-token log-probabilities for a GGUF model and a token
// sequence, through node-llama-cpp's prebuilt CPU library (see README.md).
//
//   node tests/llamacpp/logprobs.mjs MODEL.gguf IDS.txt OUT.bin [--threads N]
//        [--batch N] [--kv-cache f32|f16] [--logits-only] [--verbose]
//
// IDS.txt: whitespace-separated token ids, fed exactly as given (nothing is
// added: put BOS first yourself if the model expects it). The whole sequence
// runs in one context, one sequence, on the CPU, flash attention off, KV cache
// F32 (default; --kv-cache f16 is llama.cpp's default).
//
// OUT.bin, little-endian: u32 n_positions (= number of ids - 1), u32 n_vocab,
// then for each position i = 0..n_positions-1, n_vocab float32:
// log p(v | ids[0..i]) for v = 0..n_vocab-1, the log-softmax (in float64,
// stored as float32) of the raw float32 logits llama.cpp computed there.
//
// stdout: one JSON line; errors: one lowercase line on stderr, exit 1.
import fs from "node:fs";
import path from "node:path";

import { UsageError, cpuLlama, die, kvCacheSize, llamaCppBuild, loadNodeLlamaCpp, moduleVersion, parseArgs } from "./common.mjs";

const USAGE = "usage: logprobs.mjs MODEL.gguf IDS.txt OUT.bin [--threads N] [--batch N] " +
    "[--kv-cache f32|f16] [--logits-only] [--verbose]";

function readIds(file) {
    let text;
    try {
        text = fs.readFileSync(file, "utf8");
    } catch (e) {
        throw new Error(`${file}: cannot read: ${e.code ?? e.message}`);
    }
    const words = text.split(/\s+/).filter((w) => w !== "");
    const ids = new Array(words.length);
    for (let i = 0; i < words.length; i++) {
        if (!/^[0-9]+$/.test(words[i]) || Number(words[i]) > 0x7fffffff)
            throw new Error(`${file}: word ${i + 1}: not a token id: ${words[i].slice(0, 40)}`);
        ids[i] = Number(words[i]);
    }
    if (ids.length < 2) throw new Error(`${file}: need at least 2 token ids, have ${ids.length}`);
    return ids;
}

let cleanup = null; // removes a partly written OUT.bin.tmp-PID on error

async function main() {
    const t0 = performance.now();
    const { pos, opt } = parseArgs(process.argv.slice(2), {
        threads: "int", batch: "int", "kv-cache": "str", "logits-only": "flag", verbose: "flag", help: "flag",
    });
    if (opt.help) {
        process.stdout.write(USAGE + "\n");
        return;
    }
    if (pos.length !== 3) throw new UsageError(USAGE);
    const [modelPath, idsPath, outPath] = pos;
    const kvCache = (opt["kv-cache"] ?? "f32").toLowerCase();
    if (kvCache !== "f32" && kvCache !== "f16") throw new UsageError(`--kv-cache: f32 or f16, not ${kvCache}`);
    const wantProbs = !opt["logits-only"];

    const ids = readIds(idsPath);
    const n = ids.length;
    if (!fs.existsSync(modelPath)) throw new Error(`${modelPath}: no such file`);

    const mod = await loadNodeLlamaCpp();
    const pkgVersion = await moduleVersion(mod);
    const { llama, logs } = await cpuLlama(mod, { threads: opt.threads, verbose: opt.verbose });
    const model = await llama.loadModel({ modelPath, gpuLayers: 0 });

    const vocabTokens = model.fileInfo?.metadata?.tokenizer?.ggml?.tokens;
    const metaVocab = Array.isArray(vocabTokens) ? vocabTokens.length : null;
    if (metaVocab != null) {
        const bad = ids.findIndex((t) => t >= metaVocab);
        if (bad >= 0) throw new Error(`${idsPath}: id ${ids[bad]} at position ${bad} is outside the vocabulary (${metaVocab})`);
    }

    // One context holding the n ids (node-llama-cpp pads the size up to a
    // multiple of 256); one ubatch of up to --batch tokens (default 512).
    const kvType = kvCache === "f32" ? "F32" : "F16";
    const context = await model.createContext({
        contextSize: n,
        batchSize: Math.min(opt.batch ?? 512, Math.max(n, 2)),
        threads: opt.threads ?? 0,
        flashAttention: false,
        sequences: 1,
        experimentalKvCacheKeyType: kvType,
        experimentalKvCacheValueType: kvType,
        failedCreationRemedy: false,
    });
    const kType = mod.GgmlType[context.kvCacheKeyType] ?? String(context.kvCacheKeyType);
    const vType = mod.GgmlType[context.kvCacheValueType] ?? String(context.kvCacheValueType);
    if (kType !== kvType || vType !== kvType)
        throw new Error(`asked for a ${kvType} kv cache, got k ${kType} v ${vType}`);
    if (context.flashAttention !== false) throw new Error(`flash attention is ${context.flashAttention}, wanted off`);
    const sequence = context.getSequence();

    // Positions 0..n-2 predict ids[1..n-1]; the last id needs no evaluation.
    const nPos = n - 1;
    let nVocab = null;
    let nllLogits = 0, nllProbs = 0, maxDiff = 0, zeroProbs = 0, done = 0;
    const tmpPath = `${outPath}.tmp-${process.pid}`;
    let fd;
    try {
        fd = fs.openSync(tmpPath, "w");
    } catch (e) {
        throw new Error(`${outPath}: cannot write: ${e.code ?? e.message}`);
    }
    cleanup = () => {
        try {
            fs.closeSync(fd);
        } catch { /* already closed */ }
        fs.rmSync(tmpPath, { force: true });
    };
    let rowF64 = null, rowF32 = null;
    const onRow = (i, out) => {
        const logits = out?.next?.logits;
        if (!(logits instanceof Map)) throw new Error(`position ${i}: no logits returned`);
        if (nVocab == null) {
            nVocab = logits.size;
            rowF64 = new Float64Array(nVocab);
            rowF32 = new Float32Array(nVocab);
            const hdr = Buffer.alloc(8);
            hdr.writeUInt32LE(nPos, 0);
            hdr.writeUInt32LE(nVocab, 4);
            fs.writeSync(fd, hdr, 0, 8, 0);
        }
        if (logits.size !== nVocab) throw new Error(`position ${i}: ${logits.size} logits, expected ${nVocab}`);
        rowF64.fill(NaN);
        let mx = -Infinity;
        for (const [tok, l] of logits) {
            if (tok < 0 || tok >= nVocab) throw new Error(`position ${i}: logit for token ${tok} outside 0..${nVocab - 1}`);
            rowF64[tok] = l;
            if (l > mx) mx = l;
        }
        let s = 0;
        for (let v = 0; v < nVocab; v++) {
            if (Number.isNaN(rowF64[v])) throw new Error(`position ${i}: token ${v} has no logit`);
            s += Math.exp(rowF64[v] - mx);
        }
        const lse = mx + Math.log(s);
        for (let v = 0; v < nVocab; v++) rowF32[v] = rowF64[v] - lse;
        const target = ids[i + 1];
        if (target >= nVocab) throw new Error(`id ${target} at position ${i + 1} is outside the vocabulary (${nVocab})`);
        nllLogits -= rowF64[target] - lse;
        if (wantProbs) {
            const probs = out.next.probabilities;
            if (!(probs instanceof Map) || probs.size !== nVocab)
                throw new Error(`position ${i}: ${probs?.size ?? 0} probabilities, expected ${nVocab}`);
            for (const [tok, p] of probs) {
                if (p > 1e-30) {
                    const d = Math.abs(Math.log(p) - (rowF64[tok] - lse));
                    if (d > maxDiff) maxDiff = d;
                } else zeroProbs++;
            }
            const pt = probs.get(target);
            nllProbs -= Math.log(pt);
            out.next.probabilities = undefined;
        }
        out.next.logits = undefined;
        fs.writeSync(fd, new Uint8Array(rowF32.buffer), 0, nVocab * 4, 8 + i * nVocab * 4);
        done++;
    };

    const tEval = performance.now();
    const gen = { logits: true, ...(wantProbs ? { probabilities: true } : {}) };
    const input = ids.slice(0, nPos).map((t) => [t, { generateNext: gen }]);
    let rowError = null;
    await sequence.controlledEvaluate(input, {
        onTokenResult: (i, out) => {
            if (rowError) return;
            try {
                onRow(i, out);
            } catch (e) {
                rowError = e;
            }
        },
    });
    const evalSeconds = (performance.now() - tEval) / 1000;
    if (rowError) throw rowError;
    if (done !== nPos) throw new Error(`got ${done} of ${nPos} positions`);
    fs.fsyncSync(fd);
    fs.closeSync(fd);
    fs.renameSync(tmpPath, outPath);
    cleanup = null;

    const result = {
        n,
        n_positions: nPos,
        n_vocab: nVocab,
        nll_sum: nllLogits,
        ppl: Math.exp(nllLogits / nPos),
        ...(wantProbs ? {
            nll_sum_probs: nllProbs,
            max_abs_dlogp_probs_vs_logits: maxDiff,
            probs_tiny: zeroProbs, // probabilities <= 1e-30, left out of the comparison
        } : {}),
        first_id: ids[0],
        model_bos: model.tokens.bos,
        kv_cache_type: { k: kType, v: vType },
        kv_cache_reported: kvCacheSize(logs),
        flash_attention: context.flashAttention,
        context_size: context.contextSize,
        batch_size: context.batchSize,
        threads: context.idealThreads,
        llama_cpp_build: { ...llamaCppBuild(mod, llama, pkgVersion), model: path.basename(modelPath) },
        eval_seconds: evalSeconds,
        seconds: (performance.now() - t0) / 1000,
    };
    await context.dispose();
    await model.dispose();
    await llama.dispose();
    process.stdout.write(JSON.stringify(result) + "\n");
}

main().catch((e) => {
    cleanup?.();
    if (e instanceof UsageError) die(e.message);
    die(e?.message ?? String(e));
});
