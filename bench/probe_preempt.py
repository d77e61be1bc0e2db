"""``bench/probe.py --preemption``: preemption seen from outside (router/preempt.py), over both
protocols.

The server it starts has one colocated worker with a KV cache of ``kv_cache_gb`` (0.01 GiB: a
few hundred tokens, the context as long) and the policy ``greedy: {priority: low}``,
``victim: {priority: high}``. First an undisturbed run of the greedy token's long request
(its reference text), and the victim's requests on the idle server (the baseline). Then, per
round, twice: the greedy token starts a stream whose prompt and ``max_tokens`` take the whole
KV cache but a few tokens, reads its first ``LEAD`` tokens (it runs, holding the cache), and
the victim's request is timed while it waits for room; then the greedy stream is read to its
end. Once the greedy stream is SSE and the victim asks over gRPC, once the other way round.

Tallied: each victim request (``victim http (preempting)`` ...), each greedy stream against the
reference (``greedy sse stream``, ``greedy grpc stream``: ``identical`` is one stream, nothing
repeated or lost, the text of the undisturbed run), and the greedy token's preemptions from the
router's ``/metrics`` (``preempted_greedy``, where its address is known). Summary keys
``preempt_victim_{http,grpc}_p50_ratio``: the victim's p50 while preempting against idle.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import time
from dataclasses import dataclass

from bench.probe_wire import PROMPT, Tally, Target, aim, http_call, http_request, log, report, split

LEAD = 4  # greedy tokens read before the victim asks: the greedy stream runs and holds the cache
MARGIN = 4  # tokens of KV left beside the greedy request: too few for the victim's


@dataclass
class Preemption:
    """``--preemption``: rounds, the victim's request size, and the KV cache of the server it starts."""

    rounds: int = 2
    victim_max_tokens: int = 8
    kv_cache_gb: float = 0.01

    @staticmethod
    def policy() -> str:
        return "tokens:\n  greedy: {priority: low}\n  victim: {priority: high}\n"


async def sse(t: Target, token: str, body: dict):
    """A streamed completion over a connection of its own (HTTP/1.0: the body ends at the close);
    yields each event's JSON (status other than 200: a dict with ``status``)."""
    host, port = split(t.http)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST /v1/completions HTTP/1.0\r\nHost: {t.http}\r\nAuthorization: Bearer {token}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            yield {"status": status, "body": (await reader.read())[:200].decode(errors="replace")}
            return
        buf = b""
        while chunk := await reader.read(65536):
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: ") and event != b"data: [DONE]":
                    yield json.loads(event[6:])
    finally:
        writer.close()


class Stream:
    """The greedy token's long stream over one protocol: ``lead`` reads its first tokens, ``rest``
    the others; ``text`` and ``tokens`` are what it streamed."""

    def __init__(self, t: Target, proto: str, model: str, max_tokens: int, stub) -> None:
        self.t, self.proto, self.model, self.max_tokens, self.stub = t, proto, model, max_tokens, stub
        self.text, self.tokens, self.error = "", 0, ""
        self._events = None

    async def lead(self) -> None:
        if self.proto == "sse":
            self._events = sse(self.t, self.t.greedy, {
                "model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}})
        else:
            # (heavy: gRPC, loaded only by what uses them)
            from router.client import make_request
            self._events = self.stub.Generate(make_request(PROMPT, max_tokens=self.max_tokens, temperature=0,
                                                           ignore_eos=True),
                                              metadata=(("authorization", f"Bearer {self.t.greedy}"),), timeout=600)
            self._events = self._events.__aiter__()
        while self.tokens < LEAD and await self._next():
            pass

    async def rest(self) -> None:
        while await self._next():
            pass

    async def _next(self) -> bool:
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            return False
        except grpc.aio.AioRpcError as e:
            self.error = e.code().name
            return False
        if self.proto == "grpc":
            self.text += event.text
            self.tokens += len(event.token_ids)
        elif "status" in event:
            self.error = str(event["status"])
            return False
        else:
            for choice in event.get("choices") or []:
                self.text += choice.get("text") or ""
            if event.get("usage"):
                self.tokens = event["usage"]["completion_tokens"]
            elif event.get("choices"):
                self.tokens += 1  # (one token an event until the usage says)
        return True

    def verdict(self, reference: str) -> str:
        if self.error:
            return f"ended {self.error}"
        if self.tokens != self.max_tokens:
            return f"{self.tokens} of {self.max_tokens} tokens"
        return "identical" if self.text == reference else "other text"


async def victim(t: Target, proto: str, model: str, max_tokens: int, stub, tally: Tally, phase: str) -> None:
    """One victim request, timed."""
    # (heavy: gRPC, loaded only by what uses them)
    import grpc
    from router.client import make_request
    t0 = time.perf_counter()
    if proto == "http":
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0}).encode()
        status, _ = await http_call(t.http, http_request("POST", "/v1/completions", t.http, t.victim, body), 600)
        outcome = str(status)
    else:
        try:
            async for _ in stub.Generate(make_request("Hi", max_tokens=max_tokens, temperature=0),
                                         metadata=(("authorization", f"Bearer {t.victim}"),), timeout=600):
                pass
            outcome = "OK"
        except grpc.aio.AioRpcError as e:
            outcome = e.code().name
    tally.add(f"victim {proto} ({phase})", outcome)
    if outcome in ("200", "OK"):
        tally.latency[f"{proto} {phase}"].append(time.perf_counter() - t0)
    else:
        tally.victim_failures.append(f"{proto} {phase}: {outcome}")


async def preempted(t: Target, name: str) -> int | None:
    """The token's preemptions from the router's /metrics (None: address unknown or no answer)."""
    if not t.metrics:
        return None
    try:
        status, body = await http_call(t.metrics, http_request("GET", "/metrics", t.metrics, None, ctype=None), 30)
    except OSError:
        return None
    m = re.search(rb'pdserve_token_requests_preempted_total\{token="%s"\} ([0-9.e+]+)' % name.encode(), body)
    return int(float(m.group(1))) if status == 200 and m else (0 if status == 200 else None)


async def run(t: Target, p: Preemption) -> tuple[Tally, dict]:
    """The module doc's rounds; the tally and a flat summary."""
    # (heavy: gRPC, loaded only by what uses them)
    import grpc
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    from router.client import make_request
    tally = Tally()
    status, body = await http_call(t.http, http_request("GET", "/v1/models", t.http, t.victim, ctype=None))
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {body[:200]!r}")
    model = json.loads(body)["data"][0]
    async with grpc.aio.insecure_channel(t.grpc) as ch:
        stub = pb_grpc.GenerationStub(ch)
        prompt_tokens = 0
        async for r in stub.Generate(make_request(PROMPT, max_tokens=1), timeout=600,
                                     metadata=(("authorization", f"Bearer {t.greedy}"),)):
            prompt_tokens = r.usage.prompt_tokens or prompt_tokens
        max_tokens = model["max_model_len"] - prompt_tokens - MARGIN
        log(f"preemption: greedy streams of {max_tokens} tokens (context {model['max_model_len']}), "
            f"{p.rounds} rounds ...")
        reference = Stream(t, "grpc", model["id"], max_tokens, stub)
        await reference.lead()
        await reference.rest()
        for _ in range(p.rounds):
            for proto in ("http", "grpc"):
                await victim(t, proto, model["id"], p.victim_max_tokens, stub, tally, "idle")
        before = await preempted(t, "greedy")
        for _ in range(p.rounds):
            for greedy_proto, victim_proto in (("sse", "grpc"), ("grpc", "http")):
                s = Stream(t, greedy_proto, model["id"], max_tokens, stub)
                await s.lead()
                await victim(t, victim_proto, model["id"], p.victim_max_tokens, stub, tally, "preempting")
                await s.rest()
                tally.add(f"greedy {greedy_proto} stream", s.verdict(reference.text))
        after = await preempted(t, "greedy")

    summary: dict = {"preempt_greedy_max_tokens": max_tokens, "preempt_rounds": p.rounds}
    for proto in ("http", "grpc"):
        idle, busy = (statistics.median(tally.latency[f"{proto} {ph}"]) * 1e3 if tally.latency[f"{proto} {ph}"]
                      else None for ph in ("idle", "preempting"))
        summary[f"preempt_victim_{proto}_p50_ms_idle"] = idle
        summary[f"preempt_victim_{proto}_p50_ms_preempting"] = busy
        summary[f"preempt_victim_{proto}_p50_ratio"] = busy / idle if idle and busy else None
    summary["preempted_greedy"] = after - before if after is not None and before is not None else None
    summary["victim_failures"] = len(tally.victim_failures)
    summary["http_500_or_grpc_internal"] = tally.bad()
    for attack, counter in tally.outcomes.items():
        for outcome, n in counter.items():
            summary[f"{attack.replace(' ', '_').replace('(', '').replace(')', '')}.{outcome.replace(' ', '_')}"] = n
    return tally, summary


def table(tally: Tally, s: dict) -> str:
    rows = [(name, ", ".join(f"{k}: {n}" for k, n in sorted(c.items()))) for name, c in tally.outcomes.items()]
    for proto in ("http", "grpc"):
        i, b, r = (s[f"preempt_victim_{proto}_p50_{x}"] for x in ("ms_idle", "ms_preempting", "ratio"))
        rows.append((f"victim {proto} p50", "-" if r is None else f"idle {i:.0f} ms, preempting {b:.0f} ms, "
                                                                   f"ratio {r:.2f}x"))
    rows.append(("greedy preempted", str(s["preempted_greedy"])))
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def ok(s: dict, tally: Tally) -> bool:
    """No victim failure, no 500/INTERNAL, every greedy stream identical to the reference."""
    streams = [c for name, c in tally.outcomes.items() if name.startswith("greedy ")]
    return (not s["victim_failures"] and not s["http_500_or_grpc_internal"]
            and all(set(c) == {"identical"} for c in streams))


def main(args: argparse.Namespace) -> int:
    """``bench/probe.py --preemption``: exit 1 unless every case held (``ok``)."""
    p = Preemption(args.rounds, args.victim_max_tokens, args.preempt_kv_cache_gb)
    with contextlib.ExitStack() as stack:
        t = aim(args, stack, ["mode=colocated", "decode.compile_decode=false", f"decode.kv_cache_gb={p.kv_cache_gb}"],
                policy_yaml=p.policy())
        if t is None:
            return 2
        tally, summary = asyncio.run(run(t, p))
    report(table(tally, summary), tally, summary)
    return 0 if ok(summary, tally) else 1
