// A minimal HF Llama safetensors directory -> GGUF converter, so llama.cpp
// can run the committed HF fixtures (data/kjv-llama) that kvcal cannot write
// as GGUF itself (`kvcal export` of an HF model writes an HF directory).
//
//   node tests/llamacpp/hf2gguf.mjs HF_DIR OUT.gguf [--dtype f32|f16]
//
// What it writes, as llama.cpp's convert_hf_to_gguf.py does for
// LlamaForCausalLM: general.architecture "llama" with the llama.* hparams from
// config.json; tensors renamed to token_embd / blk.N.attn_{norm,q,k,v,output}
// / blk.N.ffn_{norm,gate,up,down} / output_norm / output (output left out when
// the embeddings are tied); the rows of q_proj and k_proj permuted from HF's
// rotate-half RoPE layout to GGUF's interleaved one (per head, row
// s*hd/2 + j -> 2j + s). Norm weights are always F32; the matrices are F32
// by default (an exact upcast of F16/BF16 safetensors, so llama.cpp
// multiplies in float32), F16 with --dtype f16 (llama.cpp's CPU backend then
// rounds the activations to F16 before each product). Only model.safetensors
// (one file) is read.
//
// Tokenizer (tokenizer.json): written as a "llama" (SentencePiece) vocabulary
// with the ids of tokenizer.json: "<0xXX>" pieces as byte tokens, added special
// tokens as control tokens, scores from the BPE merge order. It is there so
// the file loads and the ids mean the same tokens; it does not tokenize text as
// tokenizer.json does (a SentencePiece vocabulary escapes spaces as "▁", which
// a byte-only vocabulary such as data/kjv-llama's spells as 3 byte tokens).
// Tokenize with the HF directory (kvcal tokenize -m HF_DIR --ids): logprobs.mjs
// feeds token ids, never text.
import fs from "node:fs";
import path from "node:path";

import { UsageError, die, parseArgs } from "./common.mjs";

const GGUF_TYPE = { U8: 0, I8: 1, U16: 2, I16: 3, U32: 4, I32: 5, F32: 6, BOOL: 7, STR: 8, ARR: 9, U64: 10 };
const GGML = { F32: 0, F16: 1 };
const ALIGN = 32;

function readSafetensors(file) {
    const buf = fs.readFileSync(file);
    const hlen = Number(buf.readBigUInt64LE(0));
    const header = JSON.parse(buf.subarray(8, 8 + hlen).toString("utf8"));
    const base = 8 + hlen;
    const tensors = new Map();
    for (const [name, t] of Object.entries(header)) {
        if (name === "__metadata__") continue;
        const [b, e] = t.data_offsets;
        tensors.set(name, { dtype: t.dtype, shape: t.shape, bytes: buf.subarray(base + b, base + e) });
    }
    return tensors;
}

function f16ToF32(h) {
    const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e === 0) return s * m * 2 ** -24;
    if (e === 31) return m ? NaN : s * Infinity;
    return s * (1 + m / 1024) * 2 ** (e - 15);
}

// Float32Array of a tensor's values (F32, F16, BF16).
function toF32(t) {
    const n = t.shape.reduce((a, b) => a * b, 1);
    const out = new Float32Array(n);
    const b = t.bytes;
    if (t.dtype === "F32") {
        for (let i = 0; i < n; i++) out[i] = b.readFloatLE(4 * i);
    } else if (t.dtype === "F16") {
        for (let i = 0; i < n; i++) out[i] = f16ToF32(b.readUInt16LE(2 * i));
    } else if (t.dtype === "BF16") {
        const tmp = Buffer.alloc(4);
        for (let i = 0; i < n; i++) {
            tmp.writeUInt32LE(b.readUInt16LE(2 * i) << 16 >>> 0, 0);
            out[i] = tmp.readFloatLE(0);
        }
    } else throw new Error(`tensor dtype ${t.dtype} is not supported (F32, F16, BF16)`);
    return out;
}

// float32 -> IEEE half, round to nearest even.
function f32ToF16(x) {
    const f = new Float32Array([x]), u = new Uint32Array(f.buffer)[0];
    const sign = (u >>> 16) & 0x8000;
    let e = (u >>> 23) & 0xff, m = u & 0x7fffff;
    if (e === 0xff) return sign | 0x7c00 | (m ? 0x200 : 0);
    e = e - 127 + 15;
    if (e >= 0x1f) return sign | 0x7c00;
    if (e <= 0) {
        if (e < -10) return sign;
        m |= 0x800000;
        const shift = 14 - e;
        let r = m >>> shift;
        const rem = m & ((1 << shift) - 1), half = 1 << (shift - 1);
        if (rem > half || (rem === half && (r & 1))) r++;
        return sign | r;
    }
    let r = (e << 10) | (m >>> 13);
    const rem = m & 0x1fff;
    if (rem > 0x1000 || (rem === 0x1000 && (r & 1))) r++;
    return sign | r;
}

// HF rotate-half rows -> GGUF interleaved rows, per head of hd rows.
function permuteRows(w, rows, cols, nHead) {
    const hd = rows / nHead, half = hd / 2;
    const out = new Float32Array(w.length);
    for (let h = 0; h < nHead; h++)
        for (let s = 0; s < 2; s++)
            for (let j = 0; j < half; j++) {
                const src = (h * hd + s * half + j) * cols, dst = (h * hd + 2 * j + s) * cols;
                out.set(w.subarray(src, src + cols), dst);
            }
    return out;
}

class Writer {
    constructor() {
        this.parts = [];
    }
    u32(v) { const b = Buffer.alloc(4); b.writeUInt32LE(v >>> 0); this.parts.push(b); }
    i32(v) { const b = Buffer.alloc(4); b.writeInt32LE(v); this.parts.push(b); }
    u64(v) { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); this.parts.push(b); }
    f32(v) { const b = Buffer.alloc(4); b.writeFloatLE(v); this.parts.push(b); }
    str(s) { const b = Buffer.from(s, "utf8"); this.u64(b.length); this.parts.push(b); }
    get length() { return this.parts.reduce((a, b) => a + b.length, 0); }
    buffer() { return Buffer.concat(this.parts); }
}

function main() {
    const { pos, opt } = parseArgs(process.argv.slice(2), { dtype: "str" });
    if (pos.length !== 2) throw new UsageError("usage: hf2gguf.mjs HF_DIR OUT.gguf [--dtype f32|f16]");
    const [dir, outPath] = pos;
    const dtype = (opt.dtype ?? "f32").toLowerCase();
    if (dtype !== "f32" && dtype !== "f16") throw new UsageError(`--dtype: f32 or f16, not ${dtype}`);

    const cfg = JSON.parse(fs.readFileSync(path.join(dir, "config.json"), "utf8"));
    if (cfg.model_type !== "llama") throw new Error(`${dir}: model_type ${cfg.model_type}, only llama is supported`);
    if (cfg.rope_scaling) throw new Error(`${dir}: rope_scaling is not supported`);
    if (cfg.attention_bias || cfg.mlp_bias) throw new Error(`${dir}: biases are not supported`);
    const d = cfg.hidden_size, nH = cfg.num_attention_heads, nKV = cfg.num_key_value_heads ?? nH;
    const hd = cfg.head_dim ?? d / nH, L = cfg.num_hidden_layers;
    const st = readSafetensors(path.join(dir, "model.safetensors"));
    const tok = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));

    // vocabulary by id
    const V = cfg.vocab_size;
    const pieces = new Array(V).fill(null), types = new Array(V).fill(1), scores = new Array(V).fill(0);
    for (const [p, id] of Object.entries(tok.model?.vocab ?? {})) if (id < V) pieces[id] = p;
    for (const a of tok.added_tokens ?? []) if (a.id < V) {
        pieces[a.id] = a.content;
        types[a.id] = a.special ? 3 : 4;
    }
    const merges = tok.model?.merges ?? [];
    const rank = new Map();
    merges.forEach((m, i) => rank.set(Array.isArray(m) ? m.join("") : m.replace(" ", ""), i));
    for (let i = 0; i < V; i++) {
        if (pieces[i] == null) {
            pieces[i] = `<unused${i}>`;
            types[i] = 5;
        } else if (/^<0x[0-9A-F]{2}>$/.test(pieces[i])) types[i] = 6;
        else if (pieces[i] === tok.model?.unk_token) types[i] = 2;
        if (rank.has(pieces[i])) scores[i] = -(rank.get(pieces[i]) + 1);
    }

    // tensors: [name, Float32Array, shape (row-major), keep f32]
    const get = (n) => {
        const t = st.get(n);
        if (!t) throw new Error(`${dir}: tensor ${n} missing`);
        return t;
    };
    const tensors = [];
    const add = (name, hfName, { norm = false, permuteHeads = 0 } = {}) => {
        const t = get(hfName);
        let w = toF32(t);
        if (permuteHeads) w = permuteRows(w, t.shape[0], t.shape[1], permuteHeads);
        tensors.push({ name, w, shape: t.shape, f32: norm || dtype === "f32" });
    };
    // tied embeddings may be stored once, as lm_head.weight (tinystories-656K)
    add("token_embd.weight", st.has("model.embed_tokens.weight") || !cfg.tie_word_embeddings
        ? "model.embed_tokens.weight" : "lm_head.weight");
    for (let l = 0; l < L; l++) {
        const p = `model.layers.${l}.`;
        add(`blk.${l}.attn_norm.weight`, p + "input_layernorm.weight", { norm: true });
        add(`blk.${l}.attn_q.weight`, p + "self_attn.q_proj.weight", { permuteHeads: nH });
        add(`blk.${l}.attn_k.weight`, p + "self_attn.k_proj.weight", { permuteHeads: nKV });
        add(`blk.${l}.attn_v.weight`, p + "self_attn.v_proj.weight");
        add(`blk.${l}.attn_output.weight`, p + "self_attn.o_proj.weight");
        add(`blk.${l}.ffn_norm.weight`, p + "post_attention_layernorm.weight", { norm: true });
        add(`blk.${l}.ffn_gate.weight`, p + "mlp.gate_proj.weight");
        add(`blk.${l}.ffn_up.weight`, p + "mlp.up_proj.weight");
        add(`blk.${l}.ffn_down.weight`, p + "mlp.down_proj.weight");
    }
    add("output_norm.weight", "model.norm.weight", { norm: true });
    if (!cfg.tie_word_embeddings && st.has("lm_head.weight")) add("output.weight", "lm_head.weight");

    // metadata
    const kv = [];
    const put = (key, type, val) => kv.push([key, type, val]);
    put("general.architecture", "STR", "llama");
    put("general.name", "STR", path.basename(path.resolve(dir)));
    put("general.file_type", "U32", dtype === "f32" ? 0 : 1);
    put("llama.context_length", "U32", cfg.max_position_embeddings ?? 2048);
    put("llama.embedding_length", "U32", d);
    put("llama.block_count", "U32", L);
    put("llama.feed_forward_length", "U32", cfg.intermediate_size);
    put("llama.attention.head_count", "U32", nH);
    put("llama.attention.head_count_kv", "U32", nKV);
    put("llama.attention.key_length", "U32", hd);
    put("llama.attention.value_length", "U32", hd);
    put("llama.rope.dimension_count", "U32", hd);
    put("llama.rope.freq_base", "F32", cfg.rope_theta ?? 10000);
    put("llama.attention.layer_norm_rms_epsilon", "F32", cfg.rms_norm_eps ?? 1e-6);
    put("llama.vocab_size", "U32", V);
    put("tokenizer.ggml.model", "STR", "llama");
    put("tokenizer.ggml.tokens", "ARR_STR", pieces);
    put("tokenizer.ggml.scores", "ARR_F32", scores);
    put("tokenizer.ggml.token_type", "ARR_I32", types);
    if (cfg.bos_token_id != null) put("tokenizer.ggml.bos_token_id", "U32", cfg.bos_token_id);
    if (cfg.eos_token_id != null) put("tokenizer.ggml.eos_token_id", "U32", cfg.eos_token_id);
    put("tokenizer.ggml.add_bos_token", "BOOL", true);
    put("tokenizer.ggml.add_eos_token", "BOOL", false);
    // no "▁" prefix when tokenizer.json has no normalizer (data/kjv-llama)
    put("tokenizer.ggml.add_space_prefix", "BOOL", tok.normalizer != null);

    const w = new Writer();
    w.parts.push(Buffer.from("GGUF"));
    w.u32(3);
    w.u64(tensors.length);
    w.u64(kv.length);
    for (const [key, type, val] of kv) {
        w.str(key);
        switch (type) {
        case "STR": w.u32(GGUF_TYPE.STR); w.str(val); break;
        case "U32": w.u32(GGUF_TYPE.U32); w.u32(val); break;
        case "F32": w.u32(GGUF_TYPE.F32); w.f32(val); break;
        case "BOOL": w.u32(GGUF_TYPE.BOOL); w.parts.push(Buffer.from([val ? 1 : 0])); break;
        case "ARR_STR": w.u32(GGUF_TYPE.ARR); w.u32(GGUF_TYPE.STR); w.u64(val.length); for (const s of val) w.str(s); break;
        case "ARR_F32": w.u32(GGUF_TYPE.ARR); w.u32(GGUF_TYPE.F32); w.u64(val.length); for (const x of val) w.f32(x); break;
        case "ARR_I32": w.u32(GGUF_TYPE.ARR); w.u32(GGUF_TYPE.I32); w.u64(val.length); for (const x of val) w.i32(x); break;
        default: throw new Error(`internal: metadata type ${type}`);
        }
    }
    const datas = [];
    let off = 0;
    for (const t of tensors) {
        const n = t.w.length;
        let bytes;
        if (t.f32) bytes = Buffer.from(t.w.buffer, t.w.byteOffset, n * 4);
        else {
            bytes = Buffer.alloc(n * 2);
            for (let i = 0; i < n; i++) bytes.writeUInt16LE(f32ToF16(t.w[i]), 2 * i);
        }
        w.str(t.name);
        w.u32(t.shape.length);
        for (let i = t.shape.length - 1; i >= 0; i--) w.u64(t.shape[i]); // ne[]: innermost first
        w.u32(t.f32 ? GGML.F32 : GGML.F16);
        off = Math.ceil(off / ALIGN) * ALIGN;
        w.u64(off);
        datas.push([off, bytes]);
        off += bytes.length;
    }
    const head = w.buffer();
    const dataStart = Math.ceil(head.length / ALIGN) * ALIGN;
    const file = Buffer.alloc(dataStart + off);
    head.copy(file, 0);
    for (const [o, b] of datas) b.copy(file, dataStart + o);
    const tmp = `${outPath}.tmp-${process.pid}`;
    fs.writeFileSync(tmp, file);
    fs.renameSync(tmp, outPath);
    process.stdout.write(JSON.stringify({ output: outPath, tensors: tensors.length, bytes: file.length, dtype,
        n_layers: L, n_heads: nH, n_kv_heads: nKV, head_dim: hd, vocab: V }) + "\n");
}

try {
    main();
} catch (e) {
    die(e?.message ?? String(e));
}
