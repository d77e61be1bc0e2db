// llama.cpp (prebuilt, via node-llama-cpp) as a benchmark peer, driven by bench/llamacpp_peer.py.
// usage: node llamacpp_peer.mjs MODEL.gguf THREADS   (from a folder with node-llama-cpp installed)
// Loads the model once, prints {"ready": ...}, then answers one JSON line per command line on stdin:
//   {"op": "decode",  "prompt": P, "new": N, "seed": S, "warmup": W}  batch-1 greedy decode
//   {"op": "prefill", "prompt": P, "seed": S}                         time to the first token of P tokens
//   {"op": "batch",   "n": B, "prompt": P, "new": N, "seed": S, "warmup": W}  B sequences at once
// Each command first runs a warm-up of the same shape (W new tokens; a prefill warms with a whole
// prefill), then one timed run. Rates are the steady decode rate, as bench/engine.py counts it:
// tokens made after every sequence has its first token, over the time since then. An end-of-
// generation token does not stop a sequence (as pdserve's ignore_eos): every run makes all its tokens.
import {getLlama} from "node-llama-cpp";
import readline from "node:readline";

const [path, threadsArg] = process.argv.slice(2);
const threads = Number(threadsArg ?? 2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: path});
const contexts = new Map();  // shape -> its sequences; one context per shape, allocated once

async function sequences(n, size, batchSize) {
  const key = `${n}:${size}:${batchSize}`;
  if (!contexts.has(key)) {
    const ctx = await model.createContext({contextSize: size, batchSize, threads, sequences: n});
    contexts.set(key, Array.from({length: n}, () => ctx.getSequence()));
  }
  return contexts.get(key);
}

// distinct token ids per seed, clear of the special tokens at the start of every vocabulary here
const prompt = (len, seed) => Array.from({length: len}, (_, i) => 1000 + ((i * 7919 + seed * 104729) % 40000));

// All sequences decode at once (the context batches their evaluations into shared steps).
async function generate(seqs, len, newTokens, seed) {
  const s = {count: 0, started: 0, tDec: 0, atDec: 0, tokens: []};
  const t0 = performance.now();
  let tFirst = 0;
  await Promise.all(seqs.map(async (seq, j) => {
    await seq.clearHistory();
    let k = 0;
    for await (const tok of seq.evaluate(prompt(len, seed * 64 + j), {temperature: 0, yieldEogToken: true})) {
      k++; s.count++;
      if (k === 1 && ++s.started === seqs.length) { s.tDec = performance.now(); s.atDec = s.count; tFirst = s.tDec; }
      if (k >= newTokens) break;
    }
    s.tokens.push(k);
  }));
  const tEnd = performance.now();
  const dec = s.count - s.atDec;
  return {tok_s: dec > 0 ? dec / ((tEnd - s.tDec) / 1000) : null, ttft_s: (tFirst - t0) / 1000,
          tokens: s.count, min_tokens: Math.min(...s.tokens)};
}

async function run(cmd) {
  const P = cmd.prompt, N = cmd.new ?? 1, W = Math.max(1, cmd.warmup ?? 8), seed = cmd.seed ?? 0;
  if (cmd.op === "decode" || cmd.op === "batch") {
    const n = cmd.op === "batch" ? cmd.n : 1;
    const seqs = await sequences(n, P + N + 16, 512);
    await generate(seqs, P, W, 2 * seed + 1);  // warm-up, same shapes
    return generate(seqs, P, N, 2 * seed);
  }
  if (cmd.op === "prefill") {
    const seqs = await sequences(1, P + 64, P);  // one batch of P tokens, as llama-bench's pp
    await generate(seqs, P, 1, 2 * seed + 1);
    const r = await generate(seqs, P, 1, 2 * seed);
    return {tok_s: P / r.ttft_s, ttft_s: r.ttft_s};
  }
  throw new Error(`unknown op ${JSON.stringify(cmd.op)}`);
}

console.log(JSON.stringify({ready: true, model: path.split("/").pop(), threads}));
for await (const line of readline.createInterface({input: process.stdin})) {
  if (!line.trim()) continue;
  try {
    console.log(JSON.stringify(await run(JSON.parse(line))));
  } catch (e) {
    console.log(JSON.stringify({error: String(e && e.stack || e)}));
  }
}
process.exit(0);
