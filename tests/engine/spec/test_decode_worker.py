"""Speculation inside the decode worker: prompt KV from a prefill worker, drafts verified on the
decode side (its draft catches up on the prompt itself), greedy output unchanged; with the
decode engine quantized too, speculation still changes nothing."""

from __future__ import annotations

import time

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from kvtransfer.base import get_transport
from prefill_worker.worker import PrefillWorker

PROMPTS = ["Repeat exactly: red, green, blue, red, green, blue, red, green,",
           "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"]
SP = SamplingParams(max_tokens=16, temperature=0)


def _engine(model_path, spec=None, quantization=None) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=str(model_path), num_threads=1, quantization=quantization,
                                 cache=CacheConfig(memory_gb=0.05), speculative=spec), progress=False)
    if quantization:
        # INT8 in fp32 arithmetic in every step: decode steps of up to compile_decode_rows
        # tokens run the compiled fp32 GEMV, larger ones (here the verify steps, 2 x 5 tokens)
        # the int8pack kernel, by default with bf16 activations: a 2^-8 rounding the small
        # steps do not have, which flips near-ties (seen on a Xeon with AMX). Speculation
        # changes nothing only where verify computes what a plain step computes.
        from engine.quant.linear import QuantLinear
        for mod in eng.model.modules():
            if isinstance(mod, QuantLinear):
                mod.set_act_dtype(torch.float32)
        if eng.model.single_token is not None:
            eng.model.single_token.sync()
    return eng


def _run_pair(model_path, tokenizer, decode: LLMEngine, connect) -> tuple[list[list[int]], DecodeWorker]:
    pw = PrefillWorker(_engine(model_path), get_transport("zmq"))
    dw = DecodeWorker(decode, get_transport("zmq"))
    try:
        connect(pw.sender, dw.receiver)
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        for i, p in enumerate(PROMPTS):
            rid, ids = f"r{i}", tokenizer(p)["input_ids"]
            assert (got := dw.reserve(rid, ids, SP)) is not None
            pw.submit(rid, ids, SP, dw.address, got)
        deadline = time.monotonic() + 120
        while len(finished) < len(PROMPTS) or pw.transfers:
            assert time.monotonic() < deadline, "workers did not finish"
            for o in pw.step()[0]:  # decode gets the first token with the KV
                tokens[o.request_id] = list(o.token_ids)
            for o in dw.step():
                tokens[o.request_id] = list(o.token_ids)
                if o.finished:
                    finished.add(o.request_id)
        assert pw.engine.block_manager.num_used_blocks == 0
        assert dw.engine.block_manager.num_used_blocks == 0 and not dw.failed
        return [tokens[f"r{i}"] for i in range(len(PROMPTS))], dw
    finally:
        pw.close()
        dw.close()


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_worker_speculates_without_changing_output(model_path, tokenizer, quantization, connect_kv):
    plain, _ = _run_pair(model_path, tokenizer, _engine(model_path, quantization=quantization), connect_kv)
    spec = SpeculativeConfig(method="ngram" if quantization else "draft", num_speculative_tokens=4,
                             adaptive=False, draft_model=None if quantization else str(model_path))
    got, dw = _run_pair(model_path, tokenizer, _engine(model_path, spec, quantization), connect_kv)
    assert got == plain
    st = dw.engine.spec.stats()
    assert st["verify_steps"] > 0 and st["accepted_tokens"] > 0
