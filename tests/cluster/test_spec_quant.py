"""The cluster with decode-side speculative decoding, and with quantization too.

Speculation must not change greedy output: through prefill -> decode with n-gram drafts the
tokens equal HF generate's. With INT8 decode weights as well, the API reports both features
and the measured acceptance; the output is the INT8 model's (not bit-equal to fp32 in general:
INT8 kernels round differently), checked on a prompt whose continuation is unambiguous.

Acceptance under adaptive K depends on measured step times (the CPU, its load): the first
cluster asserts only what adaptivity guarantees (the output); the second fixes K, so the
acceptance is a function of the tokens alone and can be asserted.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pdserve.v1 import pdserve_pb2 as pb
from router.client import collect, connect, make_request

REPETITIVE = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
              "The cat sat on the mat. The cat sat on the mat. The cat sat on the"]
BASE = {"prefill__kv_cache_gb": 0.1, "decode__kv_cache_gb": 0.1, "kv_transfer__transport": "ucx",
        "decode__speculative__method": "ngram", "decode__speculative__num_speculative_tokens": 4}


def generate_all(stub, prompts, max_tokens):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: collect(stub.Generate(make_request(p, max_tokens=max_tokens, temperature=0))),
                             prompts))


def decode_status(stub):
    return next(w for w in stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers if w.role == "decode")


def test_speculative_decode_keeps_hf_greedy_output_then_with_int8(make_cluster, greedy_reference, wait_idle):
    spec = make_cluster(**BASE)
    stub = connect(f"127.0.0.1:{spec.port}")
    outs = generate_all(stub, [p for p, _ in greedy_reference] + REPETITIVE, 64)
    assert [o["token_ids"] for o in outs[:len(greedy_reference)]] == [ids for _, ids in greedy_reference]
    counting = outs[len(greedy_reference)]["token_ids"][:40]
    assert "ngram" in stub.GetModelInfo(pb.GetModelInfoRequest()).speculative
    wait_idle(stub, spec)
    spec.stop()

    both = make_cluster(**BASE, decode__quantization="int8", decode__speculative__adaptive=False)
    stub = connect(f"127.0.0.1:{both.port}")
    outs = generate_all(stub, REPETITIVE, 40)
    assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == 40 for o in outs)
    assert outs[0]["token_ids"] == counting  # "14, 15, 16, ...": no near-tie for INT8 to flip
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.quantization.startswith("int8") and info.speculative == "ngram-k4-fixed"
    assert info.kernels.startswith("cpu ") and "int8: " in info.kernels
    st = decode_status(stub)
    # K = 4 on repetitive text: drafts land. How many depends on the second prompt's INT8
    # continuation, which the kernels of each CPU class may change (acceptance 0.22 under AVX2
    # dispatch, above 0.3 with AVX-512); on every class each verify yields over 1.5 tokens.
    assert st.speculative_acceptance > 0 and st.speculative_tokens_per_verify > 1.5
    wait_idle(stub, both)
    both.stop()
