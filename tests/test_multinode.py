"""pdserve on separate Ray nodes (tests/multinode.py): a head with the router, a prefill node and
a decode node, each with its own IP, HOME and model cache. `pytest -m multinode` runs these."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.multinode import NODES, MultiNode

pytestmark = pytest.mark.multinode
PDSERVE = shutil.which("pdserve", path=os.path.dirname(sys.executable)) or "pdserve"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def nodes():
    import tempfile
    from pathlib import Path
    # A short root: Ray's socket paths under it must fit AF_UNIX's 107 bytes (pytest's tmp
    # paths are long enough to break the second node's).
    root = Path(tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))
    c = MultiNode(root, gcs_ft=True).up()  # (GCS fault tolerance, as deploy/ sets it up: the last test restarts the head)
    yield c
    c.down()
    assert c.processes() == [], "processes of the test cluster left running"
    shutil.rmtree(root, ignore_errors=True)


def serve(c: MultiNode, *overrides: str, expect_fail: bool = False):
    """`pdserve serve --address` on the head (its environment); returns (process, port) once it
    serves, or (process, stderr) once it exits when ``expect_fail``."""
    port = _free_port()
    args = [PDSERVE, "serve", "--address", c.address, "--config", os.path.join(ROOT, "deploy", "local.yaml"),
            "--port", str(port), "--metrics-port", "0", "--http-port", "0"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(args, env=c.env(NODES[0]), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 300  # hang guard only
    while True:
        line = proc.stderr.readline()
        lines.append(line)
        if expect_fail and not line and proc.poll() is not None:
            return proc, "".join(lines)
        assert not expect_fail or "serving pdserve" not in line, "".join(lines)
        if "serving pdserve.v1.Generation" in line:
            return proc, port
        assert time.monotonic() < deadline and (proc.poll() is None or expect_fail), "".join(lines)


def stop(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(port: int) -> dict:
    r = subprocess.run([PDSERVE, "status", "--server", f"127.0.0.1:{port}", "--json"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def generate_all(port: int) -> list[list[int]]:
    from router.client import collect, connect, make_request
    stub = connect(f"127.0.0.1:{port}")
    return [collect(stub.Generate(make_request(p, max_tokens=16, temperature=0)))["token_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_reference(model_path, tokenizer):
    """HF generate's greedy tokens of PROMPTS (recorded per input: tests/hf_reference.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests import hf_reference as ref
    return ref.generate(model_path, [tokenizer(p)["input_ids"] for p in PROMPTS], 16,
                        lambda: AutoModelForCausalLM.from_pretrained(str(model_path), torch_dtype=torch.float32))


@pytest.mark.parametrize("transport", ["ucx", "zmq"])
def test_default_config_serves_across_nodes_equal_to_hf(nodes, transport, hf_reference):
    """The bundled model: each worker node converts it into its own cache; prefill on the
    prefill node, decode on the decode node, KV between their IPs; greedy equals HF."""
    proc, port = serve(nodes, f"kv_transfer.transport={transport}")
    try:
        st = status(port)
        where = {w["worker_id"]: w["metrics_address"].rsplit(":", 1)[0] for w in st["workers"]}
        assert where == {"prefill-0": "127.0.0.2", "decode-0": "127.0.0.3"}, st
        for node in NODES[1:]:  # each node's own conversion, in its own HOME
            assert (nodes.home(node) / ".cache" / "pdserve" / "SmolLM2-135M-Instruct" / "model.safetensors").is_file()
        assert generate_all(port) == hf_reference
    finally:
        stop(proc)


def test_a_user_model_folder_missing_on_one_node_fails_fast_naming_it(nodes, model_path, hf_reference):
    """`model: ~/models/smol` resolves in each node's HOME. Present on every node: serves (equal
    to HF). Missing on the decode node: serving never starts, and the error names that node."""
    for node in NODES:
        dst = nodes.home(node) / "models" / "smol"
        if not dst.exists():
            shutil.copytree(model_path, dst)
    proc, port = serve(nodes, "model=~/models/smol")
    try:
        assert generate_all(port) == hf_reference
    finally:
        stop(proc)
    shutil.rmtree(nodes.home(NODES[2]) / "models")
    proc, err = serve(nodes, "model=~/models/smol", expect_fail=True)
    assert proc.returncode != 0
    assert "127.0.0.3 (decode)" in err and "does not exist" in err and "127.0.0.2" not in err, err


def test_two_decode_workers_on_one_node_and_a_killed_one_recovers_mid_stream(nodes, hf_reference):
    """Every port per actor: two decode workers share the decode node (their metrics ports and
    KV endpoints are their own). SIGKILL one mid-stream: its streams re-run on the other node
    worker and still equal HF; Ray restarts it on its node."""
    import threading

    import psutil

    from router.client import connect, make_request
    proc, port = serve(nodes, "decode.replicas=2")
    try:
        st = status(port)
        decode = [w for w in st["workers"] if w["role"] == "decode"]
        assert len(decode) == 2 and all(w["state"] == "ready" for w in decode)
        addrs = [w["metrics_address"] for w in decode]
        assert all(a.startswith("127.0.0.3:") for a in addrs) and len(set(addrs)) == 2, addrs
        stub = connect(f"127.0.0.1:{port}")
        results: dict[int, list[int]] = {}
        progress: dict[int, int] = {}

        def one(i: int) -> None:
            ids: list[int] = []
            for r in stub.Generate(make_request(PROMPTS[i], max_tokens=16, temperature=0)):
                ids += list(r.token_ids)
                progress[i] = len(ids)
            results[i] = ids
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120  # hang guard only
        while not any(n >= 2 for n in progress.values()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victims = [p for p in map(psutil.Process, nodes.processes()) if "DecodeActor" in p.name()]
        assert len(victims) == 2
        victims[0].kill()
        for t in threads:
            t.join(timeout=300)
        assert [results[i] for i in range(len(PROMPTS))] == hf_reference
        deadline = time.monotonic() + 180  # hang guard only: the restart loads the model
        while not all(w["state"] == "ready" for w in status(port)["workers"]):
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        stop(proc)


def test_a_prompt_burst_adds_a_prefill_worker_on_the_prefill_node_and_it_drains_away(nodes, make_engine):
    """Autoscaling across nodes: long prompts at once grow the prefill pool; the new actor lands
    on the prefill node (the only one advertising `prefill`), every answer equals one engine's,
    and once the load stops the extra worker drains and its process exits."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    from router.client import collect, connect, make_request
    from engine.request import SamplingParams
    fast = ["autoscale.enabled=true", "autoscale.interval_s=0.3", "autoscale.window_s=5",
            "autoscale.prefill.max_replicas=2", "autoscale.prefill.up_delay_s=1", "autoscale.prefill.down_delay_s=3",
            "autoscale.prefill.target_ttft_ms=10000000", "autoscale.prefill.target_queued_tokens=500",
            "autoscale.decode.max_replicas=1", "prefill.kv_cache_gb=0.1", "decode.kv_cache_gb=0.2"]
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49000) for _ in range(400)] for _ in range(6)]
    want = [o.token_ids for o in make_engine().generate(prompts, SamplingParams(max_tokens=4, temperature=0))]
    proc, port = serve(nodes, *fast)
    try:
        stub = connect(f"127.0.0.1:{port}")
        seen: set[str] = set()
        stop_watch = False

        def watch() -> None:
            while not stop_watch:
                for w in status(port)["workers"]:
                    if w["role"] == "prefill" and w["metrics_address"] != "-":
                        seen.add(w["metrics_address"])
                time.sleep(0.2)
        import threading
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ids: collect(stub.Generate(make_request(
                token_ids=ids, max_tokens=4, temperature=0, ignore_eos=True))), prompts))
        assert [o["token_ids"] for o in outs] == want
        assert any("prefill +1" in e for e in status(port)["autoscale_events"])
        # The added worker comes up (maybe after the burst), then drains once the load is gone.
        deadline = time.monotonic() + 180  # hang guard only
        while True:
            st = status(port)
            prefill = [w for w in st["workers"] if w["role"] == "prefill"]
            actors = [p for p in map(psutil.Process, nodes.processes()) if "PrefillActor" in p.name()]
            if len(seen) == 2 and len(prefill) == 1 and len(actors) == 1:
                break
            assert time.monotonic() < deadline, (seen, prefill, actors, st["autoscale_events"])
            time.sleep(0.5)
        stop_watch = True
        watcher.join()
        assert all(a.startswith("127.0.0.2:") for a in seen), seen  # both on the prefill node
        assert any("prefill -1" in e for e in st["autoscale_events"]), st["autoscale_events"]
    finally:
        stop(proc)


def test_a_head_restart_ends_no_worker_and_every_stream_completes_identical(nodes):
    """bench/chaos_router.py's ``restart_head``, small (last here: it restarts the module's head).
    An HA pair of ``pdserve serve`` on the head, one prefill and one decode worker on their own
    nodes; while 3 greedy streams run (asyncio, threaded and OpenAI clients), every process of the
    head is SIGKILLed, the routers with it, and the head's Ray and two routers start again. The
    workers live through it (the GCS's tables come back from Redis; their raylets wait for it):
    the same processes, adopted by the new leader, which the clients' streams resume on, each
    identical to its undisturbed run; no block held after, no worker left after the routers stop."""
    from bench.chaos import parse
    from bench.chaos_router import run_router_chaos
    from bench.chaos_router import table as router_table
    args = parse(["--kinds", "restart_head", "--faults-per-kind", "1", "--fault-gap-s", "3", "--concurrency", "3",
                  "--max-tokens", "24", "--long-words", "120", "--hang-s", "120", "--seed", "0"])
    assert args.kinds == [] and args.router_kinds == ["restart_head"]
    out = run_router_chaos(args, nodes.address, nodes)
    print(router_table(out), json.dumps(out))  # shown on failure
    assert out["faults_by_kind"] == {"restart_head": 1} and out["head_restarts"] == 1, out
    assert {k: c["streams"] for k, c in out["by_client"].items()} == {"asyncio": 1, "threads": 1, "openai": 1}, out
    assert out["completed_identical"] >= 3 and out["wrong"] == 0 and out["hung"] == 0 and out["errored"] == 0, out
    assert out["leaked_blocks"] == 0 and out["stranded_blocks"] == 0, out
    assert out["workers_replaced"] == 0 and out["workers_left"] == 0, out  # the same workers throughout, then none
