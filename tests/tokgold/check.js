#!/usr/bin/env node
'use strict';
// Checks, before trusting golden.js's output:
//  1. what @huggingface/tokenizers (JS) does with the components the golden
//     tokenizers use, beside what the Rust tokenizers crate does (the crate's
//     results are written down here from its source code, not computed);
//  2. that the built gpt2/tokenizer.json encodes the corpora to the same ids
//     as gpt-3-encoder's encode(), and llama3/tokenizer.json to the same ids
//     as llama3-tokenizer-js's encode() without bos/eos.
//
//   node tests/tokgold/check.js TOKDIR [NODE_MODULES] [--full-gpt3]
//
// gpt-3-encoder is fed the text cut into pieces at places where its regex
// must have a match boundary (see common.js), because its encode() takes
// quadratic time on a whole file; --full-gpt3 also encodes each whole file
// with it (minutes) and compares. Exits nonzero if any cross-check differs.

const fs = require('fs');
const path = require('path');
const C = require('./common');

const args = process.argv.slice(2);
const pos = args.filter((a) => !a.startsWith('--'));
const fullGpt3 = args.includes('--full-gpt3');
const tokDir = pos[0];
if (!tokDir) C.die('usage: node tests/tokgold/check.js TOKDIR [NODE_MODULES] [--full-gpt3]');
const P = C.loadPackages(C.nodeModulesDir(pos[1]));
const T = P.tokenizers;
// JSON, with invisible characters (controls, format characters, separators
// other than the space) written as \uXXXX so that they show.
const show = (x) => JSON.stringify(x).replace(/[\p{C}\p{Z}]/gu, (ch) =>
  (ch === ' ' ? ch : `\\u${ch.codePointAt(0).toString(16).padStart(4, '0')}`));

// ---- 1. Components.
console.log('== components: JS package vs the Rust crate');
const probes = [];
const probe = (what, js, rust) => probes.push({ what, js, rust });
const split = (cfg, s) => new T.SplitPreTokenizer(cfg).pre_tokenize_text(s);
for (const [behavior, rust] of [
  ['Isolated', ['a', '-', 'b', '-', '-', 'c']],
  ['Removed', ['a', 'b', 'c']],
  ['MergedWithPrevious', ['a-', 'b-', '-', 'c']],
  ['MergedWithNext', ['a', '-b', '-', '-c']],
  ['Contiguous', ['a', '-', 'b', '--', 'c']],
]) {
  probe(`Split String "-" ${behavior} on "a-b--c"`,
        split({ pattern: { String: '-' }, behavior, invert: false }, 'a-b--c'), rust);
}
probe('Split Regex "-+" Removed on "a-b--c"',
      split({ pattern: { Regex: '-+' }, behavior: 'Removed', invert: false }, 'a-b--c'), ['a', 'b', 'c']);
probe('Split String "-" Isolated invert on "a-b--c"',
      split({ pattern: { String: '-' }, behavior: 'Isolated', invert: true }, 'a-b--c'), ['a', '-', 'b', '-', '-', 'c']);
const punct = new T.PunctuationPreTokenizer({ behavior: 'Isolated' });
probe('Punctuation Isolated on "Hey!?! (a)..."', punct.pre_tokenize_text('Hey!?! (a)...'),
      ['Hey', '!', '?', '!', ' ', '(', 'a', ')', '.', '.', '.']);
probe('Punctuation Contiguous on "Hey!?! (a)..."',
      new T.PunctuationPreTokenizer({ behavior: 'Contiguous' }).pre_tokenize_text('Hey!?! (a)...'),
      ['Hey', '!?!', ' ', '(', 'a', ')...']);
const digits = new T.DigitsPreTokenizer({ individual_digits: true });
probe('Digits individual on "a12x"', digits.pre_tokenize_text('a12x'), ['a', '1', '2', 'x']);
probe('Digits individual on "a1\u0663\u096b\u3007b" (Arabic-Indic 3, Devanagari 5, ideographic zero)',
      digits.pre_tokenize_text('a1\u0663\u096b\u3007b'), ['a', '1', '\u0663', '\u096b', '\u3007', 'b']);
const ms = new T.MetaspacePreTokenizer({ replacement: '\u2581', prepend_scheme: 'first', split: true });
probe('Metaspace split true on "Hey  friend"', ms.pre_tokenize_text('Hey  friend', { section_index: 0 }),
      ['\u2581Hey', '\u2581', '\u2581friend']);
probe('Metaspace emulated by golden.js (split false + Split "\u2581[^\u2581]*|[^\u2581]+")',
      new T.SequencePreTokenizer({ pretokenizers: [
        { type: 'Metaspace', replacement: '\u2581', prepend_scheme: 'first', split: false },
        { type: 'Split', pattern: { Regex: '\u2581[^\u2581]*|[^\u2581]+' }, behavior: 'Isolated', invert: false },
      ] }).pre_tokenize_text('Hey  friend', { section_index: 0 }),
      ['\u2581Hey', '\u2581', '\u2581friend']);
probe('Lowercase on "\u039f\u0394\u039f\u03a3 \u03a3\u0391" (final capital sigma)',
      new T.LowercaseNormalizer({}).normalize('\u039f\u0394\u039f\u03a3 \u03a3\u0391'), '\u03bf\u03b4\u03bf\u03c3 \u03c3\u03b1');
probe('Strip both on "\\u0085x\\ufeff"',
      new T.StripNormalizer({ strip_left: true, strip_right: true }).normalize('\u0085x\ufeff'), 'x\ufeff');
probe('NFKC+Lowercase on "\ufb01 \u2460 \uff28\uff49 \u2122"',
      new T.SequenceNormalizer({ normalizers: [{ type: 'NFKC' }, { type: 'Lowercase' }] }).normalize('\ufb01 \u2460 \uff28\uff49 \u2122'),
      'fi 1 hi tm');
const bl = new T.ByteLevelPreTokenizer({ add_prefix_space: false, use_regex: true });
probe('ByteLevel regex on "a\\ufeff\\ufeffb a\\u0085\\u0085b" (\\s: U+FEFF and U+0085)',
      bl.pre_tokenize_text('a\ufeff\ufeffb a\u0085\u0085b'),
      ['a', '\u00ef\u00bb\u00bf\u00ef\u00bb\u00bf', 'b', '\u0120a', '\u00c2\u0127', '\u00c2\u0127', 'b']);
const l3 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
probe('Llama 3 Split regex on "IT\'S we\'Ll 12345 a\\u0085\\u0085b"',
      split({ pattern: { Regex: l3 }, behavior: 'Isolated', invert: false }, "IT'S we'Ll 12345 a\u0085\u0085b"),
      ['IT', "'S", ' we', "'Ll", ' ', '123', '45', ' a', '\u0085', '\u0085b']);
probe('Llama 3 Split regex on "it\'\\u017fx" (long s: full case folding)',
      split({ pattern: { Regex: l3 }, behavior: 'Isolated', invert: false }, "it'\u017fx"),
      ['it', "'\u017f", 'x']);
let diffs = 0;
for (const p of probes) {
  const same = show(p.js) === show(p.rust);
  if (!same) diffs++;
  console.log(`${same ? 'same   ' : 'DIFFERS'} ${p.what}\n        js:   ${show(p.js)}${same ? '' : `\n        rust: ${show(p.rust)}`}`);
}
console.log(`${probes.length} probes, ${diffs} differ\n`);

// ---- 2. Cross-checks.
function loadTok(name) {
  const file = path.join(tokDir, name, 'tokenizer.json');
  if (!fs.existsSync(file)) return null;
  const json = C.readJson(file);
  const cfgFile = path.join(tokDir, name, 'tokenizer_config.json');
  const config = fs.existsSync(cfgFile) ? C.readJson(cfgFile) : {};
  const byId = [];
  for (const [t, id] of Object.entries(json.model.vocab)) byId[id] = t.length; // byte-level: one char per byte
  for (const a of json.added_tokens) byId[a.id] = Buffer.byteLength(a.content, 'utf8');
  return {
    json, byteLen: byId,
    plain: new T.Tokenizer({ ...json, added_tokens: json.added_tokens.filter((a) => !a.special) }, config),
    special: new T.Tokenizer(json, config),
  };
}

// Compares two id sequences for the same text; a mismatch is a stretch of
// bytes that the two tokenize differently (between common token boundaries).
function compare(label, a, b, byteLen, text, nameA, nameB) {
  const regions = [];
  let i = 0, j = 0, oa = 0, ob = 0;
  while (i < a.length || j < b.length) {
    if (i < a.length && j < b.length && oa === ob && a[i] === b[j]) {
      oa += byteLen[a[i++]]; ob += byteLen[b[j++]];
      continue;
    }
    const start = Math.min(oa, ob);
    const i0 = i, j0 = j;
    do {
      if (j >= b.length || (i < a.length && oa <= ob)) oa += byteLen[a[i++]];
      else ob += byteLen[b[j++]];
    } while ((oa !== ob) && (i < a.length || j < b.length));
    regions.push({ start, end: oa, a: a.slice(i0, i), b: b.slice(j0, j) });
  }
  const ok = regions.length === 0;
  console.log(`${ok ? 'same   ' : 'DIFFERS'} ${label}: ${nameA} ${a.length} ids, ${nameB} ${b.length} ids, ` +
              `${regions.length} differing stretch(es)`);
  const bytes = Buffer.from(text, 'utf8');
  for (const r of regions.slice(0, 5)) {
    console.log(`        bytes ${r.start}..${r.end} ${show(bytes.subarray(r.start, r.end).toString('utf8'))}: ` +
                `${nameA} ${show(r.a)} vs ${nameB} ${show(r.b)}`);
  }
  return ok;
}

console.log('== cross-checks: built tokenizer.json (JS package) vs the packages\' own encoders');
let bad = 0;
const gpt2 = loadTok('gpt2');
const llama3 = loadTok('llama3');
if (!gpt2 || !llama3) C.die(`run build.js first: ${tokDir} lacks gpt2/ or llama3/`);
for (const c of C.corpora()) {
  if (!fs.existsSync(c.file)) { console.log(`corpus ${c.name}: skipped, ${c.file} is missing`); continue; }
  const { text } = C.readCorpus(c.file);

  const hf = gpt2.plain.encode(text, { add_special_tokens: false }).ids;
  const pieces = C.gpt2SafePieces(text);
  const g = pieces.flatMap((p) => P.gpt3enc.encode(p));
  if (!compare(`gpt2 ${c.name}`, hf, g, gpt2.byteLen, text, 'tokenizer.json', 'gpt-3-encoder')) bad++;
  if (fullGpt3) {
    const t0 = Date.now();
    const whole = P.gpt3enc.encode(text);
    const same = whole.length === g.length && whole.every((x, k) => x === g[k]);
    console.log(`${same ? 'same   ' : 'DIFFERS'} gpt-3-encoder on ${c.name}: whole file vs ${pieces.length} pieces ` +
                `(${Date.now() - t0} ms for the whole file)`);
    if (!same) bad++;
  }

  // llama3-tokenizer-js always parses its special tokens, so compare with
  // the tokenizer.json as is (special mode).
  const lsp = llama3.special.encode(text, { add_special_tokens: false }).ids;
  const lj = P.llama3.encode(text, { bos: false, eos: false });
  if (!compare(`llama3 ${c.name}`, lsp, lj, llama3.byteLen, text, 'tokenizer.json', 'llama3-tokenizer-js')) bad++;
  const lpl = llama3.plain.encode(text, { add_special_tokens: false }).ids;
  const same = lpl.length === lsp.length && lpl.every((x, k) => x === lsp[k]);
  console.log(`        llama3 ${c.name}: plain and special modes ${same ? 'agree' : 'differ'} ` +
              `(${lpl.length} vs ${lsp.length} ids)`);
}
if (bad) { console.log(`${bad} cross-check(s) differ`); process.exit(1); }
console.log('all cross-checks agree');
