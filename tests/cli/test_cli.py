"""The pdserve command line, run as a user would (a subprocess on the installed console script)."""

from __future__ import annotations

import json
import os
import ipaddress
import shutil
import socket
import subprocess
import sys

import pytest

from engine.request import SamplingParams

PDSERVE = shutil.which("pdserve", path=os.path.dirname(sys.executable)) or "pdserve"


def listeners(pid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket listening and UDP socket bound in the
    process tree under ``pid``."""
    import psutil
    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr):
                    out.append((p.name(), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone since we listed it
    return out


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return (getattr(a, "ipv4_mapped", None) or a).is_loopback  # ::ffff:127.0.0.1 is loopback too


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PDSERVE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["generate"], ["serve"], ["status"], ["convert"], ["quantize"], ["eval-ppl"]])
def test_every_command_has_help(cmd):
    r = _run(*cmd, "--help")
    assert r.returncode == 0 and "usage: pdserve" in r.stdout and len(r.stdout) > 200


def test_generate_local_json_matches_engine(make_engine):
    r = _run("generate", "--local", "The capital of France is", "--max-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) >= {"text", "token_ids", "finish_reason", "timing"}
    assert out["timing"]["ttft_s"] > 0
    ref = make_engine().generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text
    assert out["finish_reason"] == ref.finish_reason


def test_generate_streams_text_and_rejects_bad_input():
    r = _run("generate", "--local", "The capital of France is", "--max-tokens", "6")
    assert r.returncode == 0 and "Paris" in r.stdout
    r = _run("generate", "--local", "hi", "--top-p", "0")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_local_streams_answers():
    r = _run("serve", "--local", "--max-tokens", "8", "--prompt", "What is the capital of France?",
             "--prompt", "Say hello.")
    assert r.returncode == 0, r.stderr
    assert "[1/2] What is the capital of France?" in r.stdout and "[2/2] Say hello." in r.stdout
    assert "Paris" in r.stdout


def test_serve_takes_the_model_as_its_positional_argument():
    r = _run("serve", "--help")
    assert r.returncode == 0 and "[MODEL]" in r.stdout and "catalogue name" in r.stdout
    assert "HF-format model folder (Llama" not in r.stdout  # the old folder-only help
    r = _run("serve", "gemma3-270m", "--model", "qwen2.5-coder-0.5b", timeout=60)
    assert r.returncode == 2 and "two models: 'gemma3-270m' and --model 'qwen2.5-coder-0.5b'" in r.stderr, r.stderr


def test_serve_model_and_dtype_reach_the_cluster_config(monkeypatch):
    """`pdserve serve NAME --dtype X`: the config's model and dtype, and dequantize on (a GGUF's
    weights in X); without --dtype the config's dequantize stands (default: as shipped)."""
    import router.app
    from cli.main import main
    got = []
    monkeypatch.setattr(router.app, "serve", lambda cfg, *a: got.append(cfg) or 0)
    assert main(["serve", "gemma3-270m", "--dtype", "bfloat16"]) == 0
    assert main(["serve", "--model", "qwen2.5-coder-0.5b"]) == 0
    assert [(c.model, c.dtype, c.dequantize) for c in got] == [("gemma3-270m", "bfloat16", True),
                                                               ("qwen2.5-coder-0.5b", "float32", False)]


def test_kv_cache_gb_auto_reaches_both_pools_and_a_bad_value_is_refused(monkeypatch, capsys):
    """`pdserve serve --kv-cache-gb auto`: both pools size their KV cache from what the node has
    left (engine/kv_budget.py); a number stays per pool (--set), anything else is refused."""
    import router.app
    from cli.main import main
    got = []
    monkeypatch.setattr(router.app, "serve", lambda cfg, *a: got.append(cfg) or 0)
    assert main(["serve", "--kv-cache-gb", "auto"]) == 0
    assert main(["serve"]) == 0  # auto is the default
    assert main(["serve", "--set", "prefill.kv_cache_gb=0.5", "--set", "decode.kv_cache_gb=1"]) == 0
    assert [(c.prefill.kv_cache_gb, c.decode.kv_cache_gb) for c in got] == [("auto", "auto"), ("auto", "auto"),
                                                                            (0.5, 1.0)]
    with pytest.raises(SystemExit) as e:
        main(["generate", "--local", "hi", "--kv-cache-gb", "lots"])
    assert e.value.code == 2 and "expected a number of GiB > 0 or auto, got 'lots'" in capsys.readouterr().err


def test_a_bad_gguf_or_model_name_is_a_clear_error_before_any_load(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    for model, needle in ((str(bad), "is not a GGUF file"), (str(tmp_path / "missing.gguf"), "does not exist"),
                          ("qwen9-nonesuch", "catalogue name (smollm2-135m")):
        r = _run("generate", "--local", "--model", model, "hi", timeout=60)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "loading" not in r.stderr  # refused before the model load
    r = _run("serve", "--local", str(bad), timeout=60)
    assert r.returncode == 2 and "is not a GGUF file" in r.stderr, r.stderr


def test_chat_with_a_base_model_and_quantizing_a_gguf_are_refused_saying_why():
    from engine.models import catalog
    if catalog.pulled_file("gemma3-270m") is None:
        pytest.skip("gemma3-270m is not pulled (`pdserve pull gemma3-270m`)")
    r = _run("generate", "--local", "--model", "gemma3-270m", "--chat", "hi", timeout=120)
    assert r.returncode == 2 and "has no chat template" in r.stderr and "no --chat" in r.stderr, r.stderr
    assert "loading" not in r.stderr  # before the model load
    r = _run("quantize", "--model", "gemma3-270m", "--out", "/nonexistent/q", timeout=120)
    assert r.returncode == 2 and "is a GGUF model, quantized already" in r.stderr, r.stderr


def test_serve_with_a_bad_config_fails_at_start_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  replica: 2\n")
    r = _run("serve", "--config", str(bad), timeout=60)
    assert r.returncode == 2 and "unknown key decode.replica" in r.stderr and "Traceback" not in r.stderr


def test_serve_refuses_engine_flags_it_would_ignore_and_applies_model_and_dtype(tmp_path):
    r = _run("serve", "--kv-cache-gb", "2", "--threads", "1", timeout=60)
    assert r.returncode == 2 and "--threads, --kv-cache-gb apply to --local only" in r.stderr, r.stderr
    assert "--set decode.kv_cache_gb" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.yaml"  # the config check sees --model/--dtype: they are not ignored
    bad.write_text("mode: colocated\n")
    r = _run("serve", "--config", str(bad), "--model", "", timeout=60)
    assert r.returncode == 2 and "model" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_client_commands_without_a_server_say_so():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for cmd in (["status"], ["generate", "hi"]):
        r = _run(*cmd, "--server", f"127.0.0.1:{port}", timeout=60)
        assert r.returncode == 1 and "cannot reach a server" in r.stderr, r.stderr


def test_serve_generate_status_and_ctrl_c(tmp_path):
    """`pdserve serve` as `make serve` runs it (1 prefill + 1 decode worker): a client gets an
    answer, `status` shows both workers, Ctrl-C stops everything cleanly."""
    import signal
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([PDSERVE, "serve", "--config", os.path.join(root, "deploy", "local.yaml"),
                             "--port", str(port), "--metrics-port", "0", "--http-port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while not any("serving pdserve.v1.Generation" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
        server = f"127.0.0.1:{port}"
        r = _run("generate", "The capital of France is", "--server", server, "--max-tokens", "8", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert "Paris" in out["text"] and out["finish_reason"] == "length" and len(out["token_ids"]) == 8
        assert out["prefill_worker"] == "prefill-0" and out["decode_worker"] == "decode-0"
        r = _run("status", "--server", server)
        assert r.returncode == 0 and "prefill-0" in r.stdout and "decode-0" in r.stdout and "ready" in r.stdout
        # Secure by default: no process of the cluster (Ray's too) listens beyond loopback.
        listening = listeners(proc.pid)
        assert len(listening) >= 5, listening  # gRPC, /metrics, control socket, Ray's GCS and raylet at least
        assert all(_loopback(ip) for _, ip, _ in listening), listening
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0 and "shutting down" in rest, rest


def _serve(port: int):
    """`pdserve serve` on ``port`` (deploy/local.yaml), once it says it serves."""
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([PDSERVE, "serve", "--config", os.path.join(root, "deploy", "local.yaml"),
                             "--port", str(port), "--metrics-port", "0", "--http-port", "0"],
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 240  # hang guard only
    while not any("serving pdserve.v1.Generation" in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stderr.readline())
    return proc


def test_a_killed_router_takes_its_whole_cluster_with_it_and_a_new_one_serves(exit_later):
    """Router death: SIGKILL `pdserve serve` (no shutdown runs). Its workers and Ray's GCS and
    raylet go with it (Ray fate-shares actors with their owner, the router, and reaps the local
    cluster it started), so nothing keeps KV blocks, memory or ports; a new router on the same
    port serves at once. Ray's two agents outlive their raylet by about a minute (they give up
    on it then: measured 60-70 s here); their exit, within 180 s, is checked when the session
    ends (``exit_later``: the minute passes while other tests run)."""
    import signal
    import time

    import psutil
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _serve(port)
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 4, tree  # Ray's GCS and raylet, a prefill and a decode worker at least
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        killed = time.monotonic()
        agents = [p for p in tree if p.name() in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")]
        _, alive = psutil.wait_procs([p for p in tree if p not in agents], timeout=60)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = _serve(port)
    try:
        r = _run("generate", "The capital of France is", "--server", f"127.0.0.1:{port}", "--max-tokens", "4",
                 "--json")
        assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["finish_reason"] == "length", \
            r.stderr
        exit_later(agents, killed + 180, "Ray's agents of the killed router's cluster")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
