"""A step's large buffers come from the heap and stay there for the next step
(engine.memory.keep_step_buffers): counted in page faults, not in time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process: it changes the allocator's settings for the whole process.
CHILD = r"""
import json, resource, torch
from engine.memory import keep_step_buffers, release_freed_memory

WIDE = 10 << 20  # floats: a 40 MiB output, as a 1.5B prefill's gate/up is (glibc maps over 32 MiB)

def faults_of_a_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(1 << 20)
    for _ in range(4):  # layers: a wide output, a narrower one made from it, the next hidden state
        wide = torch.ones(WIDE) + x[0]
        mid = wide[: WIDE // 2] * 2
        del wide
        x = mid[: 1 << 20] + 1
        del mid
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = [faults_of_a_step() for _ in range(3)]
kept = keep_step_buffers()
steady = [faults_of_a_step() for _ in range(8)]  # the heap grows to the steps' size, then holds
trimmed = release_freed_memory()
after_trim = faults_of_a_step()
print(json.dumps({"wide_pages": WIDE * 4 // 4096, "default": default, "kept": kept, "steady": steady,
                  "trimmed": trimmed, "after_trim": after_trim}))
"""


def test_a_steps_buffers_are_faulted_in_once_not_every_step():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["kept"] is True and r["trimmed"] is True  # glibc, as on every machine of this project's kind
    wide = 4 * r["wide_pages"]  # a step's four wide buffers: one fault per page when mapped afresh
    # glibc's default: each wide buffer is mapped afresh every step (over its 32 MiB ceiling)
    assert r["default"][-1] >= wide, r
    # kept in the heap: once it has grown to a step's size, a step reuses its pages (a few
    # faults for whatever else the allocator touches: under a fiftieth of one step's)
    assert r["steady"][-1] < wide // 50, r
    # the trim hands them back to the OS: the next step faults the wide buffers in again, once
    assert r["after_trim"] >= wide // 2, r


def test_the_engine_keeps_step_buffers_once_loaded(make_engine, monkeypatch):
    import engine.llm_engine as llm_engine
    calls = []
    monkeypatch.setattr(llm_engine, "keep_step_buffers", lambda: calls.append(1) or True)
    make_engine(memory_gb=0.05)
    assert calls == [1]
