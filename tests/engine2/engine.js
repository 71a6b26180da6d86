#!/usr/bin/env node
// Independent engine for kvcal compressed model directories (kvcal.json + model.safetensors)
// and for the base HF Llama / GPT-2 models, written from docs/formats.md only.
//
// usage:
//   node engine.js base HF_DIR TOKENS.bin [--seq-len 128] [--max-windows W] [--json]
//   node engine.js comp OUT_DIR TOKENS.bin [--seq-len 128] [--max-windows W] [--json]
//        [--f16-cache]      round 16-bit latents to fp16 as they enter the cache (off by default)
//
// Numerics: every tensor the model holds is float32 (Float32Array). Each operation accumulates in
// float64 (dot products, norms' sums, softmax) and rounds its result to float32 once (Math.fround),
// i.e. each op's output is the correctly rounded fp32 of a float64 computation. The NLL uses
// float64 log-sum-exp of the fp32 logits; the mean NLL is a float64 sum / count.
'use strict';
const fs = require('fs');
const path = require('path');
const fr = Math.fround;

// ---------- safetensors ----------
function f16ToF32(h) {
  const s = (h & 0x8000) ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e === 0) return s * m * Math.pow(2, -24);
  if (e === 31) return m ? NaN : s * Infinity;
  return s * (1 + m / 1024) * Math.pow(2, e - 15);
}
function loadSafetensors(file) {
  const buf = fs.readFileSync(file);
  const n = Number(buf.readBigUInt64LE(0));
  const hdr = JSON.parse(buf.toString('utf8', 8, 8 + n));
  const base = 8 + n, out = {};
  for (const [name, t] of Object.entries(hdr)) {
    if (name === '__metadata__') continue;
    const [a, b] = t.data_offsets, cnt = t.shape.reduce((x, y) => x * y, 1);
    const data = new Float32Array(cnt);
    if (t.dtype === 'F32') {
      data.set(new Float32Array(buf.buffer.slice(buf.byteOffset + base + a, buf.byteOffset + base + b)));
    } else if (t.dtype === 'F16') {
      for (let i = 0; i < cnt; i++) data[i] = f16ToF32(buf.readUInt16LE(base + a + 2 * i));
    } else if (t.dtype === 'BF16') {
      const tmp = Buffer.alloc(4);
      for (let i = 0; i < cnt; i++) { tmp.writeUInt32LE(buf.readUInt16LE(base + a + 2 * i) << 16 >>> 0); data[i] = tmp.readFloatLE(0); }
    } else throw new Error(`${file}: ${name}: dtype ${t.dtype} not supported`);
    if (b - a !== cnt * (t.dtype === 'F32' ? 4 : 2)) throw new Error(`${name}: size mismatch`);
    out[name] = { shape: t.shape, data };
  }
  return out;
}

// ---------- fp16 rounding (round to nearest even, subnormals, overflow to inf) ----------
function rintEven(x) {
  const f = Math.floor(x), d = x - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return (f % 2 === 0) ? f : f + 1;
}
function f16round(v) {
  if (!isFinite(v) || v === 0) return v;
  const s = v < 0 ? -1 : 1, a = Math.abs(v);
  let q;
  if (a < Math.pow(2, -14)) q = Math.pow(2, -24);
  else {
    let e = Math.floor(Math.log2(a));
    while (Math.pow(2, e) > a) e--;
    while (Math.pow(2, e + 1) <= a) e++;
    q = Math.pow(2, e - 10);
  }
  const r = rintEven(a / q) * q;
  if (r > 65504) return s * Infinity;
  return s * r;
}

// ---------- linear algebra ----------
// Y[T,out] = X[T,in] W[out,in]^T (+ b); float64 accumulation, one fp32 rounding.
function linear(X, T, din, W, dout, b) {
  if (W.length !== dout * din) throw new Error(`linear: weight size ${W.length} != ${dout}x${din}`);
  const Y = new Float32Array(T * dout);
  let t = 0;
  for (; t + 3 < T; t += 4) {         // 4 tokens per pass over W (same float64 sums, faster)
    const x0 = t * din, x1 = x0 + din, x2 = x1 + din, x3 = x2 + din;
    for (let o = 0; o < dout; o++) {
      const wo = o * din;
      let s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (let i = 0; i < din; i++) {
        const w = W[wo + i];
        s0 += X[x0 + i] * w; s1 += X[x1 + i] * w; s2 += X[x2 + i] * w; s3 += X[x3 + i] * w;
      }
      const bb = b ? b[o] : 0;
      Y[t * dout + o] = s0 + bb; Y[(t + 1) * dout + o] = s1 + bb;
      Y[(t + 2) * dout + o] = s2 + bb; Y[(t + 3) * dout + o] = s3 + bb;
    }
  }
  for (; t < T; t++) {
    const xo = t * din;
    for (let o = 0; o < dout; o++) {
      const wo = o * din; let s = 0;
      for (let i = 0; i < din; i++) s += X[xo + i] * W[wo + i];
      Y[t * dout + o] = s + (b ? b[o] : 0);
    }
  }
  return Y;
}
function transpose(data, rows, cols) { // [rows, cols] -> [cols, rows]
  const o = new Float32Array(rows * cols);
  for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) o[c * rows + r] = data[r * cols + c];
  return o;
}

function normRows(X, T, d, kind, w, b, eps) {
  const Y = new Float32Array(T * d);
  for (let t = 0; t < T; t++) {
    const o = t * d;
    if (kind === 'rmsnorm') {
      let ss = 0;
      for (let i = 0; i < d; i++) ss += X[o + i] * X[o + i];
      const inv = 1 / Math.sqrt(ss / d + eps);
      for (let i = 0; i < d; i++) Y[o + i] = X[o + i] * inv * w[i];
    } else {
      let m = 0;
      for (let i = 0; i < d; i++) m += X[o + i];
      m /= d;
      let v = 0;
      for (let i = 0; i < d; i++) { const c = X[o + i] - m; v += c * c; }
      v /= d;
      const inv = 1 / Math.sqrt(v + eps);
      for (let i = 0; i < d; i++) Y[o + i] = (X[o + i] - m) * inv * w[i] + b[i];
    }
  }
  return Y;
}

// ---------- model loading ----------
function loadBase(dir) {
  const cfg = JSON.parse(fs.readFileSync(path.join(dir, 'config.json'), 'utf8'));
  const W = loadSafetensors(path.join(dir, 'model.safetensors'));
  const g = n => { if (!W[n]) throw new Error(`missing tensor ${n}`); return W[n].data; };
  const opt = n => W[n] ? W[n].data : null;
  let arch = cfg.model_type || ((cfg.architectures || []).includes('GPT2LMHeadModel') ? 'gpt2' : null);
  const M = { arch, layers: [] };
  if (arch === 'gpt2') {
    const d = cfg.n_embd, h = cfg.n_head;
    Object.assign(M, { dim: d, n_heads: h, n_kv_heads: h, head_dim: d / h, n_layers: cfg.n_layer,
      hidden: cfg.n_inner || 4 * d, vocab: cfg.vocab_size, eps: cfg.layer_norm_epsilon ?? 1e-5,
      norm: 'layernorm', mlp: 'plain', positions: 'learned', rope: null });
    M.embed = g('transformer.wte.weight'); M.wpe = g('transformer.wpe.weight');
    M.lnf_w = g('transformer.ln_f.weight'); M.lnf_b = g('transformer.ln_f.bias');
    M.lm_head = opt('lm_head.weight') || M.embed;
    for (let l = 0; l < M.n_layers; l++) {
      const p = `transformer.h.${l}.`;
      const ca = transpose(g(p + 'attn.c_attn.weight'), d, 3 * d); // [3d, d]: rows q, k, v
      const cb = g(p + 'attn.c_attn.bias');
      M.layers.push({
        ln1_w: g(p + 'ln_1.weight'), ln1_b: g(p + 'ln_1.bias'),
        ln2_w: g(p + 'ln_2.weight'), ln2_b: g(p + 'ln_2.bias'),
        q: ca.slice(0, d * d), qb: cb.slice(0, d), q_cols: d,
        kmode: 'full', k: ca.slice(d * d, 2 * d * d), kb: cb.slice(d, 2 * d),
        vmode: 'full', v: ca.slice(2 * d * d, 3 * d * d), vb: cb.slice(2 * d, 3 * d),
        o: transpose(g(p + 'attn.c_proj.weight'), d, d), ob: g(p + 'attn.c_proj.bias'), o_cols: d,
        fc: transpose(g(p + 'mlp.c_fc.weight'), d, M.hidden), fcb: g(p + 'mlp.c_fc.bias'),
        proj: transpose(g(p + 'mlp.c_proj.weight'), M.hidden, d), projb: g(p + 'mlp.c_proj.bias'),
      });
    }
  } else if (arch === 'llama') {
    const d = cfg.hidden_size, h = cfg.num_attention_heads;
    Object.assign(M, { dim: d, n_heads: h, n_kv_heads: cfg.num_key_value_heads || h,
      head_dim: cfg.head_dim || d / h, n_layers: cfg.num_hidden_layers, hidden: cfg.intermediate_size,
      vocab: cfg.vocab_size, eps: cfg.rms_norm_eps, norm: 'rmsnorm', mlp: 'gated', positions: 'rope',
      rope: { layout: 'half', theta: cfg.rope_theta ?? 10000 } });
    M.embed = g('model.embed_tokens.weight'); M.lnf_w = g('model.norm.weight');
    M.lm_head = opt('lm_head.weight') || M.embed;
    for (let l = 0; l < M.n_layers; l++) {
      const p = `model.layers.${l}.`;
      M.layers.push({
        ln1_w: g(p + 'input_layernorm.weight'), ln2_w: g(p + 'post_attention_layernorm.weight'),
        q: g(p + 'self_attn.q_proj.weight'), qb: opt(p + 'self_attn.q_proj.bias'),  q_cols: h * M.head_dim,
        kmode: 'full', k: g(p + 'self_attn.k_proj.weight'), kb: opt(p + 'self_attn.k_proj.bias'),
        vmode: 'full', v: g(p + 'self_attn.v_proj.weight'), vb: opt(p + 'self_attn.v_proj.bias'),
        o: g(p + 'self_attn.o_proj.weight'), ob: null, o_cols: h * M.head_dim,
        gate: g(p + 'mlp.gate_proj.weight'), up: g(p + 'mlp.up_proj.weight'), down: g(p + 'mlp.down_proj.weight'),
      });
    }
  } else throw new Error(`unsupported model_type ${arch}`);
  M.kv_head_of_query = [];
  for (let i = 0; i < M.n_heads; i++) M.kv_head_of_query.push(Math.floor(i / (M.n_heads / M.n_kv_heads)));
  M.bits = 16;
  return M;
}

function loadCompressed(dir) {
  const man = JSON.parse(fs.readFileSync(path.join(dir, 'kvcal.json'), 'utf8'));
  if (man.format !== 'kvcal.manifest' || man.version !== 1) throw new Error('not a kvcal manifest v1');
  const W = loadSafetensors(path.join(dir, man.weights || 'model.safetensors'));
  const g = n => { if (!W[n]) throw new Error(`missing tensor ${n}`); return W[n].data; };
  const gn = n => (n == null ? null : g(n));
  const mc = man.model, arch = mc.arch;
  const M = { arch, dim: mc.dim, n_heads: mc.n_heads, n_kv_heads: mc.n_kv_heads, head_dim: mc.head_dim,
    n_layers: mc.n_layers, hidden: mc.hidden_dim, vocab: mc.vocab_size, eps: mc.norm_eps,
    norm: mc.norm || (arch === 'gpt2' ? 'layernorm' : 'rmsnorm'),
    mlp: mc.mlp || (arch === 'gpt2' ? 'plain' : 'gated'),
    positions: mc.positions || (arch === 'gpt2' ? 'learned' : 'rope'),
    rope: man.rope, layers: [], bits: man.latent.bits, hadamard: man.latent.hadamard };
  M.kv_head_of_query = mc.kv_head_of_query ||
    Array.from({ length: M.n_heads }, (_, i) => Math.floor(i / (M.n_heads / M.n_kv_heads)));
  const d = M.dim;
  if (arch === 'gpt2') {
    M.embed = g('transformer.wte.weight'); M.wpe = g('transformer.wpe.weight');
    M.lnf_w = g('transformer.ln_f.weight'); M.lnf_b = g('transformer.ln_f.bias');
    M.lm_head = mc.tied_embeddings ? M.embed : g('lm_head.weight');
  } else {
    M.embed = g('model.embed_tokens.weight'); M.lnf_w = g('model.norm.weight');
    M.lm_head = mc.tied_embeddings ? M.embed : g('lm_head.weight');
  }
  for (const L of man.layers) {
    const l = L.index;
    const P = arch === 'gpt2' ? `transformer.h.${l}.` : `model.layers.${l}.`;
    const lay = {};
    if (arch === 'gpt2') {
      Object.assign(lay, { ln1_w: g(P + 'ln_1.weight'), ln1_b: g(P + 'ln_1.bias'),
        ln2_w: g(P + 'ln_2.weight'), ln2_b: g(P + 'ln_2.bias'),
        fc: g(P + 'mlp.c_fc.weight'), fcb: g(P + 'mlp.c_fc.bias'),
        proj: g(P + 'mlp.c_proj.weight'), projb: g(P + 'mlp.c_proj.bias') });
    } else {
      Object.assign(lay, { ln1_w: g(P + 'input_layernorm.weight'), ln2_w: g(P + 'post_attention_layernorm.weight'),
        gate: g(P + 'mlp.gate_proj.weight'), up: g(P + 'mlp.up_proj.weight'), down: g(P + 'mlp.down_proj.weight') });
    }
    lay.q = g(L.q_proj); lay.qb = gn(L.q_proj_bias);
    lay.o = g(L.o_proj); lay.ob = gn(L.o_proj_bias);
    const K = L.k, V = L.v;
    lay.kmode = K.mode; lay.vmode = V.mode;
    lay.q_cols = (K.mode === 'fused_query') ? K.q_cols : M.n_heads * M.head_dim;
    if (K.mode === 'full') { lay.k = g(K.proj); lay.kb = gn(K.proj_bias); }
    else if (K.mode === 'postrope_rotation') {
      lay.k = g(K.proj); lay.kb = gn(K.proj_bias);
      lay.kunits = K.units.map(u => ({ heads: u.heads, rank: u.rank, off: u.latent_offset, rot: g(u.rot),
        bands: u.bands }));
      lay.krank = K.rank;
    } else if (K.mode === 'prerope_latent' || K.mode === 'fused_query') {
      lay.kdown = g(K.down); lay.kdownb = gn(K.down_bias); lay.krank = K.rank;
      lay.kunits = K.units.map(u => ({ heads: u.heads, rank: u.rank, off: u.latent_offset, up: g(u.up),
        upb: gn(u.up_bias), bands: u.bands }));
    } else throw new Error(`unknown k mode ${K.mode}`);
    if (V.mode === 'full') { lay.v = g(V.proj); lay.vb = gn(V.proj_bias); lay.o_cols = M.n_heads * M.head_dim; }
    else if (V.mode === 'fused_output') {
      lay.vdown = g(V.down); lay.vdownb = gn(V.down_bias); lay.vrank = V.rank; lay.o_cols = V.o_cols;
      lay.vob = gn(V.o_proj_bias); // centred values: their mean through the output projection
      lay.vunits = V.units.map(u => ({ heads: u.heads, rank: u.rank, off: u.latent_offset, bands: u.bands }));
    } else throw new Error(`unknown v mode ${V.mode}`);
    M.layers[l] = lay;
  }
  M.manifest = man;
  return M;
}

// ---------- latent cache storage ----------
// store one unit's r numbers of one token: returns what the cache reads back.
function quantizeInto(z, off, r, bits, out) {
  let mn = Infinity, mx = -Infinity;
  for (let i = 0; i < r; i++) { const v = z[off + i]; if (v < mn) mn = v; if (v > mx) mx = v; }
  const qmax = Math.pow(2, bits) - 1;
  const zero = f16round(mn);                       // fp16 zero point first
  const scale = f16round(fr(fr(mx - zero) / qmax)); // from the rounded zero, fp32 ops then fp16
  for (let i = 0; i < r; i++) {
    let code = 0;
    if (scale > 0) {
      const y = fr(fr(z[off + i] - zero) / scale);
      code = rintEven(y);
      if (code < 0) code = 0; else if (code > qmax) code = qmax;
    }
    out[off + i] = fr(fr(code * scale) + zero);    // product rounded to fp32 before the sum
  }
}
function storeLatents(Z, T, rank, units, bits, opts) {
  if (bits >= 16) {
    if (opts.f16cache) for (let i = 0; i < Z.length; i++) Z[i] = f16round(Z[i]);
    return Z;
  }
  // bits 0 (mixed): each unit's bands in order, each quantized on its own;
  // an fp16 band is stored as it is (rounded to fp16 in an fp16 cache)
  const out = new Float32Array(Z.length);
  for (let t = 0; t < T; t++) {
    const row = t * rank;
    for (const u of units) {
      const bands = bits === 0 ? u.bands : [{ n: u.rank, bits }];
      let at = row + u.off;
      for (const b of bands) {
        if (b.bits < 16) quantizeInto(Z, at, b.n, b.bits, out);
        else for (let i = 0; i < b.n; i++) out[at + i] = opts.f16cache ? f16round(Z[at + i]) : Z[at + i];
        at += b.n;
      }
    }
  }
  return out;
}

// ---------- RoPE ----------
function ropeTables(M, T) {
  if (M.positions !== 'rope') return null;
  const dh = M.head_dim, half = dh / 2, th = M.rope.theta;
  const cos = new Float64Array(T * half), sin = new Float64Array(T * half);
  for (let t = 0; t < T; t++) for (let p = 0; p < half; p++) {
    const ang = t * Math.pow(th, -2 * p / dh);
    cos[t * half + p] = Math.cos(ang); sin[t * half + p] = Math.sin(ang);
  }
  return { cos, sin, half, inter: M.rope.layout === 'interleaved' };
}
// rotate heads of X [T, nh*dh] in place
function applyRope(X, T, nh, dh, R) {
  for (let t = 0; t < T; t++) for (let h = 0; h < nh; h++) {
    const o = t * nh * dh + h * dh;
    for (let p = 0; p < R.half; p++) {
      const i = R.inter ? o + 2 * p : o + p, j = R.inter ? o + 2 * p + 1 : o + p + R.half;
      const c = R.cos[t * R.half + p], s = R.sin[t * R.half + p];
      const a = X[i], b = X[j];
      X[i] = a * c - b * s; X[j] = a * s + b * c;
    }
  }
}

// ---------- attention of one layer over one window ----------
function attention(M, lay, Xn, T, R, opts) {
  const d = M.dim, h = M.n_heads, g = M.n_kv_heads, dh = M.head_dim, kvh = M.kv_head_of_query;
  const isc = 1 / Math.sqrt(dh);
  const Q = linear(Xn, T, d, lay.q, lay.q_cols, lay.qb);
  // scores S[i][t][s] computed from the cache
  const scoreFns = []; // per query head: (t, s) -> float64 score (before softmax)
  if (lay.kmode === 'full' || lay.kmode === 'prerope_latent') {
    let Kf;
    if (lay.kmode === 'full') Kf = linear(Xn, T, d, lay.k, g * dh, lay.kb);
    else {
      let Z = linear(Xn, T, d, lay.kdown, lay.krank, lay.kdownb);
      Z = storeLatents(Z, T, lay.krank, lay.kunits, M.bits, opts);  // the cache
      Kf = new Float32Array(T * g * dh);                         // rebuilt keys
      for (const u of lay.kunits) {
        for (let hi = 0; hi < u.heads.length; hi++) {
          const j = u.heads[hi];
          for (let t = 0; t < T; t++) for (let e = 0; e < dh; e++) {
            const w = (hi * dh + e) * u.rank; let s = 0;
            for (let r = 0; r < u.rank; r++) s += Z[t * lay.krank + u.off + r] * u.up[w + r];
            if (u.upb) s += u.upb[hi * dh + e]; // centred keys: the mean, before RoPE
            Kf[t * g * dh + j * dh + e] = s;
          }
        }
      }
    }
    if (R) { applyRope(Q, T, h, dh, R); applyRope(Kf, T, g, dh, R); }
    for (let i = 0; i < h; i++) {
      const j = kvh[i];
      scoreFns.push((t, s) => { let a = 0; const qo = t * h * dh + i * dh, ko = s * g * dh + j * dh;
        for (let e = 0; e < dh; e++) a += Q[qo + e] * Kf[ko + e]; return fr(fr(a) * isc); });
    }
  } else if (lay.kmode === 'fused_query') {
    let Z = linear(Xn, T, d, lay.kdown, lay.krank, lay.kdownb);
    Z = storeLatents(Z, T, lay.krank, lay.kunits, M.bits, opts);
    const unitOf = []; for (const u of lay.kunits) for (const j of u.heads) unitOf[j] = u;
    let qoff = 0;
    for (let i = 0; i < h; i++) {
      const u = unitOf[kvh[i]], qo0 = qoff; qoff += u.rank;
      scoreFns.push((t, s) => { let a = 0; const qo = t * lay.q_cols + qo0, zo = s * lay.krank + u.off;
        for (let r = 0; r < u.rank; r++) a += Q[qo + r] * Z[zo + r]; return fr(fr(a) * isc); });
    }
    if (qoff !== lay.q_cols) throw new Error('q_cols mismatch');
  } else if (lay.kmode === 'postrope_rotation') {
    const Kf = linear(Xn, T, d, lay.k, g * dh, lay.kb);
    if (R) { applyRope(Q, T, h, dh, R); applyRope(Kf, T, g, dh, R); }
    let Z = new Float32Array(T * lay.krank);
    const unitOf = [];
    for (const u of lay.kunits) {
      if (u.heads.length !== 1) throw new Error('postrope_rotation unit with several heads');
      const j = u.heads[0]; unitOf[j] = u;
      for (let t = 0; t < T; t++) for (let r = 0; r < u.rank; r++) {
        let s = 0; for (let e = 0; e < dh; e++) s += Kf[t * g * dh + j * dh + e] * u.rot[r * dh + e];
        Z[t * lay.krank + u.off + r] = s;
      }
    }
    Z = storeLatents(Z, T, lay.krank, lay.kunits, M.bits, opts);
    for (let i = 0; i < h; i++) {
      const u = unitOf[kvh[i]];
      const QR = new Float32Array(T * u.rank); // q_i · k_rot.U^T
      for (let t = 0; t < T; t++) for (let r = 0; r < u.rank; r++) {
        let s = 0; for (let e = 0; e < dh; e++) s += Q[t * h * dh + i * dh + e] * u.rot[r * dh + e];
        QR[t * u.rank + r] = s;
      }
      scoreFns.push((t, s) => { let a = 0; const qo = t * u.rank, zo = s * lay.krank + u.off;
        for (let r = 0; r < u.rank; r++) a += QR[qo + r] * Z[zo + r]; return fr(fr(a) * isc); });
    }
  } else throw new Error('k mode ' + lay.kmode);

  // values
  let Vc, vstride, vblocks = []; // per query head: offset and width in Vc row
  if (lay.vmode === 'full') {
    Vc = linear(Xn, T, d, lay.v, g * dh, lay.vb); vstride = g * dh;
    for (let i = 0; i < h; i++) vblocks.push({ off: kvh[i] * dh, w: dh });
  } else {
    Vc = linear(Xn, T, d, lay.vdown, lay.vrank, lay.vdownb);
    Vc = storeLatents(Vc, T, lay.vrank, lay.vunits, M.bits, opts);
    vstride = lay.vrank;
    const unitOf = []; for (const u of lay.vunits) for (const j of u.heads) unitOf[j] = u;
    for (let i = 0; i < h; i++) { const u = unitOf[kvh[i]]; vblocks.push({ off: u.off, w: u.rank }); }
  }
  const ocols = vblocks.reduce((a, b) => a + b.w, 0);
  if (ocols !== lay.o_cols) throw new Error(`o_cols ${ocols} != ${lay.o_cols}`);
  const A = new Float32Array(T * ocols);
  const sc = new Float64Array(T), acc = new Float64Array(d);
  for (let t = 0; t < T; t++) {
    let col = 0;
    for (let i = 0; i < h; i++) {
      const f = scoreFns[i]; let mx = -Infinity;
      for (let s = 0; s <= t; s++) { sc[s] = f(t, s); if (sc[s] > mx) mx = sc[s]; }
      let sum = 0;
      for (let s = 0; s <= t; s++) { sc[s] = Math.exp(sc[s] - mx); sum += sc[s]; }
      const { off, w } = vblocks[i];
      for (let e = 0; e < w; e++) acc[e] = 0;
      for (let s = 0; s <= t; s++) { const p = sc[s] / sum, vo = s * vstride + off;
        for (let e = 0; e < w; e++) acc[e] += p * Vc[vo + e]; }
      for (let e = 0; e < w; e++) A[t * ocols + col + e] = acc[e];
      col += w;
    }
  }
  const out = linear(A, T, ocols, lay.o, d, lay.ob);
  if (lay.vob) for (let t = 0; t < T; t++) for (let e = 0; e < d; e++) out[t * d + e] = fr(out[t * d + e] + lay.vob[e]);
  return out;
}

function gelu_new(a) { return 0.5 * a * (1 + Math.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))); }

// forward of one window: returns logits [T, vocab]
function forward(M, toks, opts) {
  const T = toks.length, d = M.dim;
  const X = new Float32Array(T * d);
  for (let t = 0; t < T; t++) for (let i = 0; i < d; i++) {
    X[t * d + i] = M.wpe ? M.embed[toks[t] * d + i] + M.wpe[t * d + i] : M.embed[toks[t] * d + i];
  }
  const R = ropeTables(M, T);
  for (const lay of M.layers) {
    const Xn = normRows(X, T, d, M.norm, lay.ln1_w, lay.ln1_b, M.eps);
    const Ao = attention(M, lay, Xn, T, R, opts);
    for (let i = 0; i < X.length; i++) X[i] = X[i] + Ao[i];
    const Hn = normRows(X, T, d, M.norm, lay.ln2_w, lay.ln2_b, M.eps);
    let Mo;
    if (M.mlp === 'gated') {
      const G = linear(Hn, T, d, lay.gate, M.hidden, null), U = linear(Hn, T, d, lay.up, M.hidden, null);
      for (let i = 0; i < G.length; i++) { const a = G[i]; G[i] = fr(a / (1 + Math.exp(-a))) * U[i]; }
      Mo = linear(G, T, M.hidden, lay.down, d, null);
    } else {
      const F = linear(Hn, T, d, lay.fc, M.hidden, lay.fcb);
      for (let i = 0; i < F.length; i++) F[i] = gelu_new(F[i]);
      Mo = linear(F, T, M.hidden, lay.proj, d, lay.projb);
    }
    for (let i = 0; i < X.length; i++) X[i] = X[i] + Mo[i];
  }
  const Xf = normRows(X, T, d, M.norm, M.lnf_w, M.lnf_b, M.eps);
  return linear(Xf, T, d, M.lm_head, M.vocab, null);
}

function main() {
  const args = process.argv.slice(2);
  const kind = args[0], dir = args[1], tokf = args[2];
  const opt = (n, def) => { const i = args.indexOf(n); return i >= 0 ? args[i + 1] : def; };
  const flag = n => args.includes(n);
  const seq = parseInt(opt('--seq-len', '128'));
  const opts = { f16cache: flag('--f16-cache') };
  const M = kind === 'base' ? loadBase(dir) : loadCompressed(dir);
  const tb = fs.readFileSync(tokf);
  const ntok = tb.length / 4, toks = new Uint32Array(ntok);
  for (let i = 0; i < ntok; i++) toks[i] = tb.readUInt32LE(4 * i);
  let nw = Math.floor(ntok / seq);
  const mw = opt('--max-windows', null); if (mw != null) nw = Math.min(nw, parseInt(mw));
  let nll = 0, cnt = 0;
  const t0 = Date.now();
  for (let w = 0; w < nw; w++) {
    const win = toks.subarray(w * seq, (w + 1) * seq);
    const L = forward(M, win, opts);
    const V = M.vocab;
    // score positions 1..seq-1: token at position t given tokens 0..t-1 (logits of position t-1)
    for (let t = 1; t < seq; t++) {
      const lp = t - 1, target = win[t];
      let mx = -Infinity; for (let v = 0; v < V; v++) if (L[lp * V + v] > mx) mx = L[lp * V + v];
      let s = 0; for (let v = 0; v < V; v++) s += Math.exp(L[lp * V + v] - mx);
      nll += mx + Math.log(s) - L[lp * V + target]; cnt++;
    }
    if (!flag('--json') && (w + 1) % 50 === 0) process.stderr.write(`window ${w + 1}/${nw} nll ${(nll / cnt).toFixed(8)} ${((Date.now() - t0) / 1000).toFixed(1)}s\n`);
  }
  const mean = nll / cnt;
  const res = { kind, dir, windows: nw, scored: cnt, nll: mean, ppl: Math.exp(mean), bits: M.bits,
    modes: M.layers.map(l => `${l.kmode}/${l.vmode}`), seconds: (Date.now() - t0) / 1000 };
  console.log(JSON.stringify(res));
}
main();
