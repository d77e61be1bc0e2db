"""Arrival traces for the simulator, generated from a seed, shaped like public ones.

Classes (each with its own SLOs, ``SLO``; DistServe sets one per application):

- ``chat``: ShareGPT-like, prompts 24..512 tokens (log-uniform: many short, a long tail),
  answers 16..256;
- ``document``: long-document QA / summary (LongBench-like), prompts 1024..3072, answers 8..64;
- ``agent``: agentic multi-turn sessions: every session of an agent shares its 512..1024-token
  system/tool prompt, and each turn's prompt is the previous turn's prompt, its answer and a
  new 32..256-token observation (so prefixes grow and repeat: prefix-aware placement's case);
  turns follow each other after the answer's expected time plus a think time.

Lengths are the public traces' shapes scaled to what a CPU engine serves (a 3k-token prompt is
~10 s of prefill for smollm2-135m on one core here); the SLOs likewise.

Workloads (``WORKLOADS``) mix them: ``chat``, ``long-document`` (70% documents), ``agentic``,
``bursty`` (chat + 20% documents whose rate switches between 4x for 20% of the time and 0.25x,
as production traces burst), ``mix`` (80% chat, 20% documents), ``phase`` (what is scarce
shifts: ``PHASE_S`` of prompt-heavy traffic, half documents and half chats wanting short answers,
then ``PHASE_S`` of chats wanting long answers (256..1024 tokens), and again; bench/loadgen.py's
``phase`` dataset over an hour instead of once: the load a fixed P:D split cannot fit both
halves of, role switching's case). Arrivals are open loop (the
same for every mode, so modes compare on the same requests), Poisson at ``rate`` req/s.

A prompt is token ids only for its block hashes (router.prefix_index ``block_hashes``): made
of segments (``range``s of ids), so repeated segments are repeated prefixes and nothing else is.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

CLASSES = ("chat", "document", "agent")
# (TTFT s, TPOT s) per class; override with bench/simulate.py --slo CLASS=TTFT,TPOT
SLO = {"chat": (3.0, 0.25), "document": (20.0, 0.25), "agent": (5.0, 0.25)}
WORKLOADS = ("chat", "long-document", "agentic", "bursty", "mix", "phase")
PHASE_S = 300.0  # each half of the phase workload


@dataclass
class Spec:
    """One request of a trace: when it arrives, its class, its prompt and its answer length."""

    rid: int
    arrival: float
    cls: str
    prompt: list[int] = field(repr=False)  # token ids (segments of ranges)
    max_tokens: int  # the answer's length (answers run to max_tokens: no early stop)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


class _Ids:
    """Fresh token-id ranges: every segment distinct from every other (its own id range)."""

    def __init__(self) -> None:
        self.next = 1000

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n + 1
        return out


def _arrivals(rng: random.Random, rate: float, duration_s: float, bursty: bool):
    t = 0.0
    while True:
        if bursty:  # 10 s periods: 20% of them at 4x the rate, the rest at 0.25x (mean ~ rate)
            period = int(t // 10)
            hot = random.Random(period * 7919 + 17).random() < 0.2
            r = rate * (4.0 if hot else 0.25)
        else:
            r = rate
        t += rng.expovariate(r)
        if t >= duration_s:
            return
        yield t


def make_trace(workload: str, rate: float, duration_s: float, seed: int = 0) -> list[Spec]:
    """Requests arriving over ``duration_s`` seconds at ``rate`` req/s on average (module doc).

    Raises:
        ValueError: an unknown workload (the message lists the known ones), a rate <= 0.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be > 0")
    rng, ids = random.Random(seed), _Ids()
    if workload == "agentic":
        return _agentic(rng, ids, rate, duration_s)
    doc_share = {"chat": 0.0, "long-document": 0.7, "bursty": 0.2, "mix": 0.2, "phase": 0.5}[workload]
    answers = (16, 256)
    out = []
    for t in _arrivals(rng, rate, duration_s, bursty=workload == "bursty"):
        if workload == "phase":  # (the prompt-heavy half first, as bench/loadgen.py's)
            prompts_half = int(t // PHASE_S) % 2 == 0
            doc_share, answers = (0.5, (16, 64)) if prompts_half else (0.0, (256, 1024))
        if rng.random() < doc_share:
            cls, n, m = "document", _log_uniform(rng, 1024, 3072), _log_uniform(rng, 8, 64)
        else:
            cls, n, m = "chat", _log_uniform(rng, 24, 512), _log_uniform(rng, *answers)
        out.append(Spec(len(out), t, cls, ids.fresh(n), m))
    return out


def _agentic(rng: random.Random, ids: _Ids, rate: float, duration_s: float) -> list[Spec]:
    """Sessions of 2..8 turns over 8 agents; ``rate`` is turns per second on average."""
    agents = [ids.fresh(_log_uniform(rng, 512, 1024)) for _ in range(8)]
    turns_mean = 5.0
    out: list[Spec] = []
    for start in _arrivals(rng, rate / turns_mean, duration_s, bursty=False):
        prompt, t = list(agents[rng.randrange(len(agents))]), start
        for _ in range(rng.randint(2, 8)):
            prompt = prompt + ids.fresh(_log_uniform(rng, 32, 256))
            m = _log_uniform(rng, 16, 128)
            if t >= duration_s:
                break
            out.append(Spec(0, t, "agent", prompt, m))
            # the next turn: after this answer (about 150 ms a token here) and a think time
            t += 0.15 * m + rng.expovariate(1 / 3.0)
            prompt = prompt + ids.fresh(m)  # the answer becomes context
    out.sort(key=lambda s: s.arrival)
    for i, s in enumerate(out):
        s.rid = i
    return out
