// llama.cpp prompt-processing (prefill) throughput through node-llama-cpp's
// prebuilt CPU library, for comparison with kvcal's own numbers.
//
//   node tests/llamacpp/bench.mjs MODEL.gguf N_TOKENS [--threads N] [--batch 512]
//        [--kv-cache f16|f32] [--flash-attention] [--repeat R] [--seed S] [--verbose]
//
// N_TOKENS pseudo-random token ids (a fixed seed; any id of the vocabulary)
// are evaluated into one fresh context of N_TOKENS positions in batches of
// --batch (default 512) tokens, asking for no logits (as llama-bench's pp
// test: only the last token's logits are computed). A 16-token warm-up runs
// first; the best of --repeat (default 3) timed runs is reported, each on a
// cleared sequence. Defaults are llama.cpp's: F16 KV cache; flash attention
// off unless --flash-attention.
//
// stdout: one JSON line {"tokens_per_s", "threads", "n", ...}; errors: one
// lowercase line on stderr, exit 1.
import fs from "node:fs";
import path from "node:path";

import { UsageError, cpuLlama, die, llamaCppBuild, loadNodeLlamaCpp, moduleVersion, parseArgs } from "./common.mjs";

const USAGE = "usage: bench.mjs MODEL.gguf N_TOKENS [--threads N] [--batch N] [--kv-cache f16|f32] " +
    "[--flash-attention] [--repeat R] [--seed S] [--verbose]";

// xorshift32: the same ids on every run for a given seed
function randomIds(n, vocab, seed) {
    let s = (seed >>> 0) || 0x9e3779b9;
    const ids = new Array(n);
    for (let i = 0; i < n; i++) {
        s ^= s << 13; s >>>= 0;
        s ^= s >>> 17;
        s ^= s << 5; s >>>= 0;
        ids[i] = s % vocab;
    }
    return ids;
}

async function main() {
    const { pos, opt } = parseArgs(process.argv.slice(2), {
        threads: "int", batch: "int", "kv-cache": "str", "flash-attention": "flag", repeat: "int", seed: "int",
        verbose: "flag", help: "flag",
    });
    if (opt.help) {
        process.stdout.write(USAGE + "\n");
        return;
    }
    if (pos.length !== 2) throw new UsageError(USAGE);
    const [modelPath, nArg] = pos;
    if (!/^[0-9]+$/.test(nArg) || Number(nArg) < 2) throw new UsageError(`N_TOKENS: not an integer >= 2: ${nArg}`);
    const n = Number(nArg);
    const kvCache = (opt["kv-cache"] ?? "f16").toLowerCase();
    if (kvCache !== "f32" && kvCache !== "f16") throw new UsageError(`--kv-cache: f32 or f16, not ${kvCache}`);
    const batch = opt.batch ?? 512, repeat = opt.repeat ?? 3;
    if (!fs.existsSync(modelPath)) throw new Error(`${modelPath}: no such file`);

    const mod = await loadNodeLlamaCpp();
    const pkgVersion = await moduleVersion(mod);
    const { llama } = await cpuLlama(mod, { threads: opt.threads, verbose: opt.verbose });
    const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
    const vocab = model.fileInfo?.metadata?.tokenizer?.ggml?.tokens?.length;
    if (!vocab) throw new Error(`${modelPath}: no tokenizer.ggml.tokens to draw ids from`);

    const kvType = kvCache === "f32" ? "F32" : "F16";
    const context = await model.createContext({
        contextSize: n + 16,
        batchSize: Math.min(batch, n),
        threads: opt.threads ?? 0,
        flashAttention: !!opt["flash-attention"],
        sequences: 1,
        experimentalKvCacheKeyType: kvType,
        experimentalKvCacheValueType: kvType,
        failedCreationRemedy: false,
    });
    const sequence = context.getSequence();
    const ids = randomIds(n, vocab, opt.seed ?? 1);

    await sequence.evaluateWithoutGeneratingNewTokens(ids.slice(0, 16));
    const runs = [];
    for (let r = 0; r < repeat; r++) {
        await sequence.clearHistory();
        const t = performance.now();
        await sequence.evaluateWithoutGeneratingNewTokens(ids);
        runs.push((performance.now() - t) / 1000);
        if (sequence.nextTokenIndex !== n) throw new Error(`evaluated ${sequence.nextTokenIndex} of ${n} tokens`);
    }
    const best = Math.min(...runs);
    const result = {
        tokens_per_s: n / best,
        threads: context.idealThreads,
        n,
        batch_size: context.batchSize,
        seconds_best: best,
        seconds_runs: runs,
        kv_cache_type: { k: mod.GgmlType[context.kvCacheKeyType], v: mod.GgmlType[context.kvCacheValueType] },
        flash_attention: context.flashAttention,
        context_size: context.contextSize,
        llama_cpp_build: { ...llamaCppBuild(mod, llama, pkgVersion), model: path.basename(modelPath) },
    };
    await context.dispose();
    await model.dispose();
    await llama.dispose();
    process.stdout.write(JSON.stringify(result) + "\n");
}

main().catch((e) => {
    if (e instanceof UsageError) die(e.message);
    die(e?.message ?? String(e));
});
