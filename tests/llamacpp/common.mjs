// Shared helpers of the llama.cpp reference harness (logprobs.mjs, bench.mjs).
//
// node-llama-cpp is looked up first in deps/node (where `npm install --prefix
// deps/node ...` puts it, relative to this repository), then as a bare
// package name, so a global or NODE_PATH install also works.
import fs from "node:fs";
import { fileURLToPath } from "node:url";

export class UsageError extends Error {}

// Print one lowercase line on stderr and exit 1.
export function die(msg) {
    let line = String(msg).split("\n").find((l) => l.trim() !== "") ?? "failed";
    line = line.trim();
    // "Invalid GGUF magic" -> "invalid GGUF magic"; "ENOENT", "N_TOKENS" stay
    if (/^[A-Z][a-z]/.test(line)) line = line.charAt(0).toLowerCase() + line.slice(1);
    process.stderr.write(line + "\n");
    process.exit(1);
}

export async function loadNodeLlamaCpp() {
    const local = new URL("../../deps/node/node_modules/node-llama-cpp/dist/index.js", import.meta.url);
    try {
        if (fs.existsSync(fileURLToPath(local))) return await import(local.href);
        return await import("node-llama-cpp");
    } catch (e) {
        throw new Error("cannot load node-llama-cpp (npm install --prefix deps/node --no-audit --no-fund " +
            "--omit=optional node-llama-cpp @node-llama-cpp/linux-x64): " + e.message);
    }
}

// Version of the installed node-llama-cpp package.
export async function moduleVersion(mod) {
    try {
        return await mod.getModuleVersion();
    } catch {
        return null;
    }
}

// Parse "--threads N" style options; positional arguments are returned in order.
export function parseArgs(argv, spec) {
    const pos = [];
    const opt = {};
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        if (a.startsWith("--")) {
            const eq = a.indexOf("=");
            const name = eq >= 0 ? a.slice(2, eq) : a.slice(2);
            if (!(name in spec)) throw new UsageError(`unknown option --${name}`);
            if (spec[name] === "flag") {
                if (eq >= 0) throw new UsageError(`option --${name} takes no value`);
                opt[name] = true;
                continue;
            }
            let v = eq >= 0 ? a.slice(eq + 1) : argv[++i];
            if (v === undefined) throw new UsageError(`option --${name} needs a value`);
            if (spec[name] === "int") {
                if (!/^[0-9]+$/.test(v) || Number(v) < 1) throw new UsageError(`--${name}: not a positive integer: ${v}`);
                v = Number(v);
            }
            opt[name] = v;
        } else pos.push(a);
    }
    return { pos, opt };
}

// getLlama on the CPU with the prebuilt binaries only (no build, no download).
// llama.cpp's log lines are kept in `logs` (printed on stderr with verbose).
// logs collects llama.cpp's messages from info level up (debug with
// verbose, which also copies them to stderr), so a caller can read what
// llama.cpp reports, such as its KV cache size (kvCacheSize).
export async function cpuLlama(mod, { threads, verbose }) {
    const logs = [];
    const llama = await mod.getLlama({
        gpu: false,
        build: "never",
        skipDownload: true,
        progressLogs: false,
        maxThreads: threads ?? 0,
        logLevel: verbose ? mod.LlamaLogLevel.debug : mod.LlamaLogLevel.info,
        logger: (level, message) => {
            logs.push(`[${level}] ${message}`);
            if (verbose) process.stderr.write(`[llama.cpp ${level}] ${message}\n`);
        },
    });
    return { llama, logs };
}

export function llamaCppBuild(mod, llama, pkgVersion) {
    const rel = llama.llamaCppRelease ?? {};
    return {
        node_llama_cpp: pkgVersion,
        llama_cpp_repo: rel.repo ?? null,
        llama_cpp_release: rel.release ?? null,
        build_type: llama.buildType,
        gpu: llama.gpu,
    };
}

// The KV cache llama.cpp reports when it creates a context ("llama_kv_cache:
// size = 2.00 MiB (4096 cells, ...)"), as {mib, cells}, or null.
export function kvCacheSize(logs) {
    for (const line of logs) {
        const m = /llama_kv_cache: size =\s+([0-9.]+) MiB \(\s*(\d+) cells/.exec(line);
        if (m) return { mib: Number(m[1]), cells: Number(m[2]) };
    }
    return null;
}
