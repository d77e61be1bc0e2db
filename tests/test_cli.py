"""The pdserve command line, run as a user would (a subprocess on the installed console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from engine.request import SamplingParams

PDSERVE = shutil.which("pdserve", path=os.path.dirname(sys.executable)) or "pdserve"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PDSERVE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["generate"], ["serve"], ["convert"]])
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
