'use strict';
// Shared helpers for build.js, golden.js and check.js: where the test data
// and the node packages are, how to load them, and a JSON writer that keeps
// the vocabulary in id order.

const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

const REPO = path.resolve(__dirname, '..', '..');
const HERE = __dirname;

// ../shared beside the repository, unless KVCAL_SHARED says otherwise.
function sharedDir() {
  if (process.env.KVCAL_SHARED) return path.resolve(process.env.KVCAL_SHARED);
  return path.join(REPO, '..', 'shared');
}

// deps/node/node_modules, unless an argument or KVCAL_NODE_MODULES says otherwise.
function nodeModulesDir(arg) {
  return path.resolve(arg || process.env.KVCAL_NODE_MODULES ||
                      path.join(REPO, 'deps', 'node', 'node_modules'));
}

function die(msg) {
  process.stderr.write(`error: ${msg}\n`);
  process.exit(1);
}

// Loads the three packages from one node_modules folder (never from a global install
// first: resolution starts inside that folder).
function loadPackages(nm) {
  if (!fs.existsSync(nm)) die(`no node_modules at ${nm} (run 'make deps')`);
  const req = createRequire(path.join(nm, '_resolve_from_here.js'));
  const out = {};
  try {
    out.tokenizers = req('@huggingface/tokenizers');
    out.gpt3enc = req('gpt-3-encoder');
    out.llama3 = req(path.join(nm, 'llama3-tokenizer-js', 'bundle',
                               'commonjs-llama3-tokenizer-with-baked-data.cjs')).llama3Tokenizer;
  } catch (e) {
    die(`cannot load the node packages from ${nm}: ${e.message}`);
  }
  out.versions = {};
  for (const name of ['@huggingface/tokenizers', 'gpt-3-encoder', 'llama3-tokenizer-js']) {
    out.versions[name] = JSON.parse(fs.readFileSync(path.join(nm, name, 'package.json'), 'utf8')).version;
  }
  out.dir = nm;
  return out;
}

// Pretty JSON in the style of the tokenizer.json files on the Hub (two-space
// indent, "key": value), with two differences that keep it readable: arrays of
// scalars (merge pairs, id lists) stay on one line, and a Map is written as an
// object in its own insertion order (so a vocabulary comes out in id order;
// a plain object would put integer-like keys such as "0" first).
function toJson(value, indent = '') {
  const inner = indent + '  ';
  if (value instanceof Map) {
    if (value.size === 0) return '{}';
    const parts = [];
    for (const [k, v] of value) parts.push(`${inner}${JSON.stringify(String(k))}: ${toJson(v, inner)}`);
    return `{\n${parts.join(',\n')}\n${indent}}`;
  }
  if (Array.isArray(value)) {
    if (value.length === 0) return '[]';
    if (value.every((x) => x === null || typeof x !== 'object')) {
      return `[${value.map((x) => JSON.stringify(x)).join(', ')}]`;
    }
    return `[\n${value.map((x) => inner + toJson(x, inner)).join(',\n')}\n${indent}]`;
  }
  if (value !== null && typeof value === 'object') {
    const keys = Object.keys(value);
    if (keys.length === 0) return '{}';
    return `{\n${keys.map((k) => `${inner}${JSON.stringify(k)}: ${toJson(value[k], inner)}`).join(',\n')}\n${indent}}`;
  }
  return JSON.stringify(value);
}

function writeJson(file, value) {
  fs.mkdirSync(path.dirname(file), { recursive: true });
  fs.writeFileSync(file, toJson(value) + '\n');
}

function readJson(file) {
  return JSON.parse(fs.readFileSync(file, 'utf8'));
}

// The corpora: name -> file. hard.txt lives beside this script.
function corpora() {
  const shared = sharedDir();
  return [
    { name: 'wiki', file: path.join(shared, 'text', 'wikitext-2-raw', 'wiki.test.raw') },
    { name: 'tiny', file: path.join(shared, 'text', 'tinystories', 'val1k.txt') },
    { name: 'hard', file: path.join(HERE, 'hard.txt') },
    // the held-out text of the fixtures (make data), for kjvbpe only
    { name: 'gospels', file: path.join(REPO, 'data', 'kjv', 'gospels.txt') },
  ];
}

// Reads a corpus as UTF-8 and refuses files that would not survive the trip
// (invalid UTF-8 would be replaced by U+FFFD and the ids would not describe the bytes).
function readCorpus(file) {
  const bytes = fs.readFileSync(file);
  const text = bytes.toString('utf8');
  if (!Buffer.from(text, 'utf8').equals(bytes)) throw new Error(`${file} is not valid UTF-8`);
  return { bytes, text };
}

// Splits a text into pieces at places where GPT-2's pre-tokenizer regex is
// certain to have a match boundary, so that encoding the pieces one by one
// gives the same ids as encoding the whole text. A place p qualifies when
//   - text[p] is "\n" and text[p-1] is not white space: only the white-space
//     alternatives can match a "\n", and none of them can start before p; or
//   - text[p-1] is white space, text[p] is " " and text[p+1] is not: the
//     white-space run ending at p is matched by \s+(?!\S) up to p (and up to
//     the end of the piece when the piece is encoded alone), and " X" starts
//     the next match.
// Used only to feed gpt-3-encoder, whose encode() concatenates arrays in a
// loop and so takes quadratic time on a whole file.
function gpt2SafePieces(text, target = 4096) {
  const ws = (ch) => ch !== undefined && /\s/u.test(ch);
  const safe = (p) => (text[p] === '\n' && !ws(text[p - 1])) ||
                      (ws(text[p - 1]) && text[p] === ' ' && p + 1 < text.length && !ws(text[p + 1]));
  const pieces = [];
  let start = 0;
  for (let p = target; p < text.length; p++) {
    if (p - start >= target && safe(p)) {
      pieces.push(text.slice(start, p));
      start = p;
    }
  }
  pieces.push(text.slice(start));
  return pieces;
}

module.exports = {
  REPO, HERE, sharedDir, nodeModulesDir, die, loadPackages, toJson, writeJson, readJson,
  corpora, readCorpus, gpt2SafePieces,
};
