"""Load generator over gRPC streaming: workloads, open/closed-loop runs, latency statistics.

``bench/serving.py`` and ``pdserve bench`` drive it. Every time is taken by the client:

- TTFT: request sent -> first token received; e2e: sent -> last message;
- TPOT: a request's (last token - first token) / (tokens - 1); ITL: every gap between
  successive token batches of a request (the stall a user sees);
- goodput: requests per second that met both SLOs (TTFT <= target and TPOT <= target) ; over a
  sweep of rates, ``max_goodput_rate`` is the highest offered rate up to which >= 90% met both
  at every rate.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from router.aio import within

SLO_ATTAINMENT = 0.9  # a rate counts toward goodput when this share of requests meets both SLOs


class BenchError(ValueError):
    """A benchmark the user asked for that cannot run (bad rate, empty dataset...)."""


@dataclass(frozen=True)
class RequestSpec:
    kind: str  # "chat", "long", "fixed", "shared", "file": stats are also reported per kind
    max_tokens: int
    token_ids: tuple[int, ...] = ()
    prompt: str | None = None


@dataclass
class Result:
    spec: RequestSpec
    sent: float
    token_times: list[float] = field(default_factory=list)  # one entry per token
    batch_times: list[float] = field(default_factory=list)  # one entry per streamed message with tokens
    end: float = 0.0
    error: str | None = None  # gRPC status name of a failed request
    detail: str = ""  # ... and its message (the server's reason)
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage)
    prefill_worker: str = ""  # the worker that prefilled it (usage)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.batch_times, self.batch_times[1:])]

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        return self.error is None and self.ttft is not None and self.ttft <= ttft_s and (
            self.tpot is None or self.tpot <= tpot_s)


# ---- workloads ---------------------------------------------------------------------------------
def _random_ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, vocab) for _ in range(n))


def parse_range(text: str, what: str) -> tuple[int, int]:
    """``"256"`` or ``"128:512"`` (uniform) -> (lo, hi)."""
    try:
        parts = [int(x) for x in str(text).split(":")]
    except ValueError:
        raise BenchError(f"{what}: expected N or LO:HI, got {text!r}") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1]) if len(parts) == 2 else (0, -1)
    if not 1 <= lo <= hi:
        raise BenchError(f"{what}: expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def make_workload(n: int, dataset: str, vocab: int, seed: int = 0, prompt_tokens: str = "256",
                  max_tokens: str = "64", long_share: float = 0.2, long_tokens: int = 1536,
                  prefix_groups: int = 6, prefix_tokens: int = 1536, token_seed: int = 0,
                  phase_answer_tokens: str = "128:256") -> list[RequestSpec]:
    """``n`` requests from a dataset: ``random`` (random token prompts of ``prompt_tokens``,
    ``max_tokens`` new tokens), ``mix`` (short chat turns with ``long_share`` long documents
    of ``long_tokens`` that want short answers), ``shared-prefix`` (as SGLang's generated
    shared prefix: ``prefix_groups`` system prompts of ``prefix_tokens``, each request one of
    them, drawn at random, plus a question of its own of 32-96 tokens; 16-48 new tokens; the
    first ``prefix_groups`` requests take each group once, in order), ``phase`` (a phase-shifting
    load: the first half long documents and chat turns, the second half chat turns wanting
    long answers, ``phase_answer_tokens``), or a JSONL file path
    (``{"prompt": ...}`` or ``{"token_ids": [...]}`` per line, optional ``"max_tokens"``; used
    round-robin). Prompts of the other datasets are distinct: the prefix cache never helps.
    ``seed`` draws the shape (kinds, lengths, ``max_tokens``, groups), ``token_seed`` the
    tokens: the same shape with other prompts (a sweep's rates) is another ``token_seed``."""
    if n < 1:
        raise BenchError(f"the number of requests must be >= 1, got {n}")
    rng, ids = random.Random(seed), random.Random(f"{seed}/{token_seed}")
    if dataset == "shared-prefix":
        if prefix_groups < 1 or prefix_tokens < 1:
            raise BenchError(f"shared-prefix: groups and prefix tokens must be >= 1, got {prefix_groups}, "
                             f"{prefix_tokens}")
        systems = [_random_ids(ids, prefix_tokens, vocab) for _ in range(prefix_groups)]
        return [RequestSpec("shared", rng.randint(16, 48),
                            systems[i if i < prefix_groups else rng.randrange(prefix_groups)]
                            + _random_ids(ids, rng.randint(32, 96), vocab)) for i in range(n)]
    if dataset == "random":
        (plo, phi), (mlo, mhi) = parse_range(prompt_tokens, "prompt tokens"), parse_range(max_tokens, "max tokens")
        return [RequestSpec("fixed", rng.randint(mlo, mhi), _random_ids(ids, rng.randint(plo, phi), vocab))
                for _ in range(n)]
    if dataset == "phase":
        # Prompt-heavy, then decode-heavy. The first half: long documents (half to all of
        # ``long_tokens``, wanting 8-16 tokens) and chat turns (24-96 tokens, wanting 48-96)
        # in equal shares: streams to protect from prompt stalls. The second half: only chat
        # turns, wanting long answers (``phase_answer_tokens``, 128-256 by default): decode is
        # all the work, and longer answers at the same rate mean more streams at once.
        alo, ahi = parse_range(phase_answer_tokens, "phase answer tokens")
        out = []
        for i in range(n):
            if i < n // 2 and rng.random() < 0.5:
                out.append(RequestSpec("long", rng.randint(8, 16),
                                       _random_ids(ids, rng.randint(long_tokens // 2, long_tokens), vocab)))
            else:
                out.append(RequestSpec("chat", rng.randint(48, 96) if i < n // 2 else rng.randint(alo, ahi),
                                       _random_ids(ids, rng.randint(24, 96), vocab)))
        return out
    if dataset == "mix":
        if not 0 <= long_share <= 1:
            raise BenchError(f"long share must be in [0, 1], got {long_share}")
        out = []
        for i in range(n):
            if rng.random() < long_share:
                out.append(RequestSpec("long", 8, _random_ids(ids, long_tokens, vocab)))
            else:
                out.append(RequestSpec("chat", rng.randint(48, 96), _random_ids(ids, rng.randint(24, 96), vocab)))
        return out
    path = Path(dataset)
    if not path.is_file():
        raise BenchError(f"dataset {dataset!r} is neither 'random', 'mix' nor a readable JSONL file")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{path}:{lineno}: not JSON: {e}") from None
        if not isinstance(row, dict) or not (row.get("prompt") or row.get("token_ids")):
            raise BenchError(f"{path}:{lineno}: expected an object with a non-empty 'prompt' or 'token_ids'")
        mt = int(row.get("max_tokens", parse_range(max_tokens, "max tokens")[1]))
        rows.append(RequestSpec("file", mt, tuple(row.get("token_ids") or ()), row.get("prompt")))
    if not rows:
        raise BenchError(f"dataset {path} is empty")
    return [rows[i % len(rows)] for i in range(n)]


# ---- running -----------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """When each of ``n`` open-loop requests is sent, in seconds after the run starts: Poisson
    arrivals at ``rate`` req/s drawn from ``seed``. One place for the schedule: ``run`` sends
    by it and the simulator's validation (bench/sim/validate.py) replays it."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(at)
    return out


async def _one(stub, spec: RequestSpec, results: list[Result], done: Callable[[], None]) -> None:
    # (heavy: gRPC, loaded only by what uses them)
    import grpc

    # (heavy: gRPC, loaded only by what uses them)
    from router.client import ResumeMismatch, astream, make_request
    kw = dict(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    req = make_request(spec.prompt, **kw) if spec.prompt is not None else make_request(token_ids=spec.token_ids, **kw)
    r = Result(spec, time.perf_counter())
    results.append(r)
    try:
        async for msg in astream(stub, req):  # (through a lost router: resumed, router.client)
            if msg.token_ids:
                now = time.perf_counter()
                r.token_times.extend([now] * len(msg.token_ids))
                r.batch_times.append(now)
            if msg.HasField("usage"):
                r.cached_tokens, r.prefill_worker = msg.usage.cached_prompt_tokens, msg.usage.prefill_worker
    except grpc.aio.AioRpcError as e:
        r.error, r.detail = e.code().name, e.details() or ""
    except ResumeMismatch as e:  # sent again after its router was lost, it answered other tokens
        r.error, r.detail = "RESUME_MISMATCH", str(e)
    r.end = time.perf_counter()
    done()


async def run(server: str, specs: Sequence[RequestSpec], rate: float | None = None, concurrency: int | None = None,
              duration_s: float | None = None, seed: int = 0,
              progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[list[Result], float]:
    """Send ``specs``: open loop at ``rate`` req/s (Poisson arrivals) or closed loop with
    ``concurrency`` requests in flight. Stops issuing after ``duration_s`` (if set).

    Returns:
        (one Result per request sent, wall seconds from the first send to the last end)
    """
    # (heavy: gRPC, loaded only by what uses them)
    import grpc

    # (heavy: gRPC, loaded only by what uses them)
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    if (rate is None) == (concurrency is None):
        raise BenchError("give exactly one of a rate (open loop) or a concurrency (closed loop)")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise BenchError(f"the request rate must be > 0, got {rate}")
    if concurrency is not None and concurrency < 1:
        raise BenchError(f"the concurrency must be >= 1, got {concurrency}")
    results: list[Result] = []
    finished = [0]

    def done() -> None:
        finished[0] += 1
        progress(finished[0], len(specs))

    # (heavy: the router's client and gRPC stubs; a list of servers gets the CLI's failover)
    from router.client import target
    uri, options = target(server)
    async with grpc.aio.insecure_channel(uri, options=options) as channel:
        try:
            await within(channel.channel_ready(), 10)
        except TimeoutError:
            raise BenchError(f"cannot reach a pdserve server at {server}") from None
        stub = pb_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        deadline = t0 + duration_s if duration_s else math.inf
        if rate is not None:
            tasks = []
            for spec, offset in zip(specs, poisson_arrivals(len(specs), rate, seed)):
                at = t0 + offset
                if at > deadline:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.create_task(_one(stub, spec, results, done)))
            await asyncio.gather(*tasks)
        else:
            queue = list(reversed(specs))

            async def worker() -> None:
                while queue and time.perf_counter() < deadline:
                    await _one(stub, queue.pop(), results, done)
            await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = max((r.end for r in results), default=t0) - t0
    return results, wall


# ---- statistics --------------------------------------------------------------------------------
def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def summarize(results: Sequence[Result], wall_s: float, ttft_slo_s: float, tpot_slo_s: float,
              kind: str | None = None, ttft_slo_by_kind: Mapping[str, float] | None = None) -> dict:
    """Flat stats (ms for latencies) over all requests, or those of one ``kind``.

    ``ttft_slo_by_kind``: a TTFT target of its own for requests of a kind (DistServe sets one
    per application: a summary of a long document is not held to a chat's first token), the
    others ``ttft_slo_s``."""
    by_kind = ttft_slo_by_kind or {}
    rs = [r for r in results if kind is None or r.spec.kind == kind]
    ok = [r for r in rs if r.error is None]
    out: dict = {"requests": len(rs), "completed": len(ok), "failed": len(rs) - len(ok),
                 # which statuses the failed ones got, most first ("RESOURCE_EXHAUSTED 4"); None: none failed
                 "errors": ", ".join(f"{code} {n}" for code, n in collections.Counter(
                     r.error for r in rs if r.error is not None).most_common()) or None}
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itls], "e2e": [r.end - r.sent for r in ok]}
    for name, xs in series.items():
        for q in (50, 90, 99):
            v = percentile(xs, q)
            out[f"{name}_ms_p{q}"] = None if v is None else v * 1e3
    tokens = sum(len(r.token_times) for r in ok)
    met = sum(r.meets(by_kind.get(r.spec.kind, ttft_slo_s), tpot_slo_s) for r in rs)
    out.update({"output_tokens": tokens, "wall_s": wall_s,
                "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
                "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
                "slo_attainment": met / len(rs) if rs else 0.0,
                "goodput_rps": met / wall_s if wall_s > 0 else 0.0,
                # share of the prompt tokens found in the server's prefix cache
                "prefix_hit_rate": (sum(r.cached_tokens for r in ok) / max(1, sum(len(r.spec.token_ids) for r in ok))
                                    if ok and all(r.spec.prompt is None for r in ok) else None)})
    return out


def max_goodput_rate(sweep: Sequence[tuple[float, dict]]) -> float:
    """Highest offered rate up to which every run of the sweep met both SLOs for >= 90% of
    requests (0 if the lowest rate did not): a rate that met them above one that missed is
    noise or luck, not capacity (a system holds every load below its goodput), so it does not
    count."""
    best = 0.0
    for rate, s in sorted(sweep, key=lambda rs: rs[0]):
        if s["slo_attainment"] < SLO_ATTAINMENT:
            break
        best = rate
    return best
