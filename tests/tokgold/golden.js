#!/usr/bin/env node
'use strict';
// Encodes the test corpora with @huggingface/tokenizers (the JS port of
// Hugging Face's tokenizers) and writes the ids as golden files beside this
// script, for the C tests to compare against without node.
//
//   node tests/tokgold/golden.js TOKDIR [NODE_MODULES] [--only=gpt2,llama3] [--full-gpt3]
//
// TOKDIR is what build.js wrote (deps/tokenizers). For each tokenizer and
// corpus it writes <tokenizer>-<corpus>-<mode>.ids.gz: gzip of a text file
// whose first line is
//   # <tokenizer> <corpus> <mode> <number of ids> <sha256 of the corpus file>
// followed by one decimal id per line. Modes:
//   plain    special added tokens are not parsed out of the text (kvcal's
//            default): the Tokenizer is built from a copy of tokenizer.json
//            whose added_tokens keeps only the entries with special false.
//   special  the tokenizer.json as it is (kvcal --parse-special); hard.txt only.
// It also writes manifest.txt: the package versions, the sha256 of each
// tokenizer.json used, and one line per golden file.
//
// --full-gpt3 times gpt-3-encoder's encode() on the whole wiki file once
// (about four minutes: it concatenates arrays in a loop); without it
// gpt-3-encoder is timed on the file cut into pieces at safe boundaries.

const fs = require('fs');
const path = require('path');
const zlib = require('zlib');
const crypto = require('crypto');
const C = require('./common');

const args = process.argv.slice(2);
const pos = args.filter((a) => !a.startsWith('--'));
const flags = args.filter((a) => a.startsWith('--'));
const tokDir = pos[0];
if (!tokDir) C.die('usage: node tests/tokgold/golden.js TOKDIR [NODE_MODULES] [--only=a,b] [--full-gpt3]');
const nm = C.nodeModulesDir(pos[1]);
let only = null;
let fullGpt3 = false;
for (const f of flags) {
  if (f.startsWith('--only=')) only = new Set(f.slice(7).split(',').filter(Boolean));
  else if (f === '--full-gpt3') fullGpt3 = true;
  else C.die(`unknown option ${f}`);
}
const P = C.loadPackages(nm);
const { Tokenizer } = P.tokenizers;

// round trip: 'exact' means decode(encode(text)) must equal text (an error
// otherwise); 'nfc' means it must equal the NFC form of text (which is text
// itself when text is already NFC); null means it
// is only reported (lossy normalizer, <unk>, or a Metaspace decoder that drops
// a leading space).
const TOKENIZERS = [
  { name: 'gpt2', roundTrip: 'exact' },
  { name: 'llama3', roundTrip: 'exact' },
  { name: 'qwen2', roundTrip: 'nfc' },
  { name: 'gpt2mix', roundTrip: null },
  { name: 'tinystories', roundTrip: null },
  { name: 'metaspace', roundTrip: null },
  // kvcal's own fixture tokenizer (kvcal train-tokenizer), committed with
  // data/kjv-bpe-llama, on its held-out Gospels and the hard cases
  { name: 'kjvbpe', roundTrip: 'exact', dir: path.join(C.REPO, 'data', 'kjv-bpe-llama'),
    corpora: ['gospels', 'hard'] },
];

const sha256 = (buf) => crypto.createHash('sha256').update(buf).digest('hex');
const escapeRegex = (s) => s.replace(/[.*+?^${}()|[\]\\\/-]/g, '\\$&');

// Refuses configurations that the JS package would run but get wrong
// relative to the Rust crate, so that no golden file records such ids.
// Rewrites the one it can express differently: Metaspace with split true.
function adaptForJs(name, tok) {
  const problems = [];
  const adaptPre = (pt) => {
    if (pt === null || pt === undefined) return pt;
    switch (pt.type) {
      case 'Sequence':
        return { ...pt, pretokenizers: pt.pretokenizers.map(adaptPre) };
      case 'Split':
        if (pt.invert) problems.push('Split with invert true (the JS package keeps only the matches)');
        if (pt.behavior !== 'Isolated' && !(pt.behavior === 'Removed' && pt.pattern.Regex !== undefined)) {
          problems.push(`Split behavior ${pt.behavior} (the JS package runs it as Isolated)`);
        }
        return pt;
      case 'Punctuation':
        if ((pt.behavior ?? 'Isolated') !== 'Contiguous') {
          problems.push(`Punctuation behavior ${pt.behavior ?? 'Isolated'} (the JS package always groups runs, i.e. Contiguous)`);
        }
        return pt;
      case 'Metaspace':
        if (pt.split === false) return pt;
        // The JS package ignores "split" and always returns one piece. The
        // Rust crate splits on the replacement, each replacement starting a
        // new piece (MergedWithNext). A Split whose regex tiles the text into
        // exactly those pieces gives the same result.
        return {
          type: 'Sequence',
          pretokenizers: [
            { ...pt, split: false },
            {
              type: 'Split',
              pattern: { Regex: `${escapeRegex(pt.replacement)}[^${escapeRegex(pt.replacement)}]*|[^${escapeRegex(pt.replacement)}]+` },
              behavior: 'Isolated',
              invert: false,
            },
          ],
        };
      case 'ByteLevel':
      case 'Digits':
        return pt;
      default:
        problems.push(`pre-tokenizer ${pt.type} has not been checked against the Rust crate`);
        return pt;
    }
  };
  const out = { ...tok, pre_tokenizer: adaptPre(tok.pre_tokenizer) };
  if (problems.length) throw new Error(`${name}: ${problems.join('; ')}`);
  return out;
}

function plainCopy(tok) {
  return { ...tok, added_tokens: tok.added_tokens.filter((t) => !t.special) };
}

function timeBest(n, fn) {
  let best = Infinity;
  let result;
  for (let i = 0; i < n; i++) {
    const t0 = process.hrtime.bigint();
    const r = fn(i);
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    if (ms < best) best = ms;
    if (i === 0) result = r;
    else if (!sameIds(result, r)) throw new Error('encode gave different ids on a repeated run');
  }
  return { best, result };
}

function sameIds(a, b) {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

function firstDiff(a, b) {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}

function writeGolden(file, header, ids) {
  const text = `${header}\n${ids.join('\n')}\n`;
  fs.writeFileSync(file, zlib.gzipSync(Buffer.from(text, 'utf8'), { level: 9 }));
  return fs.statSync(file).size;
}

const manifestFile = path.join(C.HERE, 'manifest.txt');
const manifest = new Map();
if (only && fs.existsSync(manifestFile)) {
  for (const line of fs.readFileSync(manifestFile, 'utf8').split('\n')) {
    const m = /^(tokenizer|golden) (\S+) /.exec(line);
    if (m) manifest.set(`${m[1]} ${m[2]}`, line);
  }
}

console.log(`packages: ${Object.entries(P.versions).map(([k, v]) => `${k} ${v}`).join(', ')}; node ${process.version}`);
const corpora = [];
for (const c of C.corpora()) {
  if (!fs.existsSync(c.file)) { console.log(`corpus ${c.name}: skipped, ${c.file} is missing`); continue; }
  const { bytes, text } = C.readCorpus(c.file);
  corpora.push({ ...c, bytes, text, sha: sha256(bytes) });
}

let failures = 0;
let totalSize = 0;
const fmt = (ms) => ms.toFixed(1).padStart(9);
console.log('tokenizer    corpus mode      ids      encode_ms  round_trip  gz_bytes');

for (const spec of TOKENIZERS) {
  if (only && !only.has(spec.name)) continue;
  const dir = spec.dir || path.join(tokDir, spec.name);
  const tjFile = path.join(dir, 'tokenizer.json');
  if (!fs.existsSync(tjFile)) { console.log(`${spec.name}: skipped, ${tjFile} is missing (run build.js)`); continue; }
  const tjBytes = fs.readFileSync(tjFile);
  const cfgFile = path.join(dir, 'tokenizer_config.json');
  const config = fs.existsSync(cfgFile) ? C.readJson(cfgFile) : {};
  const tok = adaptForJs(spec.name, JSON.parse(tjBytes.toString('utf8')));
  manifest.set(`tokenizer ${spec.name}`, `tokenizer ${spec.name} ${sha256(tjBytes)} tokenizer.json`);

  for (const c of corpora) {
    if (spec.corpora ? !spec.corpora.includes(c.name) : c.name === 'gospels') continue;
    const modes = c.name === 'hard' ? ['plain', 'special'] : ['plain'];
    for (const mode of modes) {
      const json = mode === 'plain' ? plainCopy(tok) : tok;
      // A fresh Tokenizer for each run, so that each timed encode starts
      // with an empty BPE cache, as a program encoding one file would.
      const tokenizers = [0, 1, 2].map(() => new Tokenizer(json, config));
      const { best, result: ids } = timeBest(3, (i) =>
        tokenizers[i].encode(c.text, { add_special_tokens: false }).ids);
      if (!ids.every((x) => Number.isInteger(x) && x >= 0)) throw new Error(`${spec.name} ${c.name}: non-integer id`);
      const decoded = tokenizers[0].decode(ids, { clean_up_tokenization_spaces: false });
      let rt = decoded === c.text ? 'exact' : 'differs';
      if (rt === 'differs' && decoded === c.text.normalize('NFC')) rt = 'nfc';
      let note = '';
      if (rt === 'differs') {
        const i = firstDiff([...decoded], [...c.text]);
        note = ` first difference at char ${i}: ${JSON.stringify([...c.text].slice(i, i + 12).join(''))} ` +
               `-> ${JSON.stringify([...decoded].slice(i, i + 12).join(''))}`;
      }
      const want = spec.roundTrip === 'exact' ? c.text : spec.roundTrip === 'nfc' ? c.text.normalize('NFC') : null;
      if (want !== null && decoded !== want) {
        console.log(`ERROR: ${spec.name} ${c.name} ${mode}: decode(encode(text)) is not ${spec.roundTrip === 'nfc' ? 'NFC(text)' : 'text'}`);
        failures++;
      }
      const fileName = `${spec.name}-${c.name}-${mode}.ids.gz`;
      const header = `# ${spec.name} ${c.name} ${mode} ${ids.length} ${c.sha}`;
      const size = writeGolden(path.join(C.HERE, fileName), header, ids);
      const gzSha = sha256(fs.readFileSync(path.join(C.HERE, fileName)));
      manifest.set(`golden ${fileName}`, `golden ${fileName} ${ids.length} ${c.sha} ${rt} ${gzSha}`);
      console.log(`${spec.name.padEnd(12)} ${c.name.padEnd(6)} ${mode.padEnd(8)} ${String(ids.length).padStart(7)} ` +
                  `${fmt(best)}  ${rt.padEnd(10)} ${String(size).padStart(8)}${note}`);
    }
  }
}

// The packages' own encoders on the wiki file, for comparison with the
// JS port's time above (and the C implementation's).
const wiki = corpora.find((c) => c.name === 'wiki');
if (wiki && (!only || only.has('llama3'))) {
  const { best, result } = timeBest(3, () => P.llama3.encode(wiki.text, { bos: false, eos: false }));
  console.log(`llama3-tokenizer-js encode, wiki: ${result.length} ids, ${best.toFixed(1)} ms (best of 3)`);
}
if (wiki && (!only || only.has('gpt2'))) {
  const pieces = C.gpt2SafePieces(wiki.text);
  const { best, result } = timeBest(3, () => pieces.flatMap((p) => P.gpt3enc.encode(p)));
  console.log(`gpt-3-encoder encode, wiki in ${pieces.length} pieces: ${result.length} ids, ${best.toFixed(1)} ms (best of 3)`);
  if (fullGpt3) {
    const t0 = process.hrtime.bigint();
    const full = P.gpt3enc.encode(wiki.text);
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    console.log(`gpt-3-encoder encode, wiki whole file: ${full.length} ids, ${ms.toFixed(1)} ms (one run); ` +
                `same ids as the pieces: ${sameIds(full, result)}`);
  }
}

const lines = [
  '# tests/tokgold manifest, written by golden.js',
  `# packages: ${Object.entries(P.versions).map(([k, v]) => `${k}@${v}`).join(' ')}`,
  '# tokenizer <name> <sha256 of tokenizer.json as built by build.js> tokenizer.json',
  '# golden <file> <ids> <sha256 of corpus> <round trip: exact|nfc|differs> <sha256 of the .gz>',
  ...[...manifest.entries()].filter(([k]) => k.startsWith('tokenizer ')).sort().map(([, v]) => v),
  ...[...manifest.entries()].filter(([k]) => k.startsWith('golden ')).sort().map(([, v]) => v),
];
fs.writeFileSync(manifestFile, lines.join('\n') + '\n');
for (const f of fs.readdirSync(C.HERE)) if (f.endsWith('.ids.gz')) totalSize += fs.statSync(path.join(C.HERE, f)).size;
console.log(`golden files in tests/tokgold: ${totalSize} bytes in all`);
if (failures) { console.log(`${failures} round-trip failure(s)`); process.exit(1); }
