"""The router chaos run's clients (bench/chaos_router.py): greedy streams through each client a
user has, over both routers' addresses, checked against their undisturbed runs.

``--clients`` names the kinds, dealt to the streams in turn (the long prompts too):

- ``asyncio``: router.client ``astream`` on a ``grpc.aio`` channel (bench/loadgen's), every such
  stream on one event loop, each on its own channel to ``--server a,b``.
- ``threads``: router.client ``stream`` on a sync channel of its own, in a thread of its own (the
  CLI's path).
- ``openai``: ``POST /v1/completions`` streamed (SSE) with an ``Idempotency-Key``, in a thread of
  its own. A stream that breaks (connection refused or cut, no ``[DONE]``, no byte for
  ``READ_TIMEOUT_S``: a stopped router) or is refused (503: a standby; 409: the id still runs
  where it was cut) is sent again, the same body and key, to each router's HTTP port in turn.
  The router that leads answers it whole from its first token (router.resume): the text is
  checked against the reference as it comes, so a retried answer that diverged counts ``wrong``
  even before its end.

Each request counts once: ``identical``, ``wrong``, ``hung`` (no end within ``--hang-s``) or
its final error's name. Every kind waits up to ``--hang-s`` for a router to lead (the gRPC
clients' ``wait_s``, the OpenAI client's retries), so a slow takeover counts as a long wait in
each alike, not as an error of the gRPC clients only: router.client's default (RESUME_WAIT_S)
can be shorter than a head restart takes on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter

from router.aio import within

CLIENT_KINDS = ("asyncio", "threads", "openai")

# What every chaos stream is made of (bench/chaos.py's load and bench/chaos_router.py's prompts)
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
        "books were made, how ideas travelled and who could read them. ")
SHORT = ["The capital of France is", "Write a haiku about rain.", "def fibonacci(n):",
         "List three uses of copper.", "Why is the sky blue?", "Translate 'good morning' to Spanish."]

READ_TIMEOUT_S = 10.0  # an OpenAI stream silent this long is cut and sent again (a stopped router)
LONG_GAP_S = 30.0  # a stream's wait between two new tokens this long is named, with its router log lines


def log(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


class Streams:
    """The streams of a run: their prompts, clients and tallies (module docstring)."""

    def __init__(self, args, prompts: list[str], model: str = "SmolLM2-135M-Instruct") -> None:
        self.args, self.prompts, self.model = args, prompts, model
        kinds = args.clients
        # (i + i // 3: every third prompt is long (bench/chaos_router ``greedy_prompts``); this
        # deals the long ones to every kind too, not to one kind of three)
        self.kind = [kinds[(i + i // 3) % len(kinds)] for i in range(len(prompts))]
        self.status: Counter = Counter()
        self.by_kind: dict[str, Counter] = {k: Counter() for k in kinds}
        self.gaps: list[float] = []
        self.long_gaps: list[tuple[str, float]] = []  # (request id, seconds) over LONG_GAP_S
        self.in_flight = self.requests = 0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def sampling(self) -> dict:
        return dict(max_tokens=self.args.max_tokens, temperature=0.0, ignore_eos=True)

    def _begin(self) -> None:
        with self.lock:
            self.requests += 1
            self.in_flight += 1

    def _end(self, i: int, rid: str, status: str, gap: float | None) -> None:
        with self.lock:
            self.status[status] += 1
            self.by_kind[self.kind[i]][status] += 1
            self.in_flight -= 1
            if gap is not None:
                self.gaps.append(gap)
                if gap > LONG_GAP_S:
                    self.long_gaps.append((rid, gap))
                    log(f"stream {i} ({self.kind[i]}) {rid}: {gap:.1f} s without a new token")

    # ---- references -----------------------------------------------------------------------------
    def reference(self, server: str, http_port: int) -> list:
        """Each stream's undisturbed answer: token ids (gRPC kinds) or text (openai)."""
        async def grpc_ones():
            async with _channel(server) as stub:
                return {i: (await self._one(stub, i, f"ref{i}"))[0] for i in range(len(self.prompts))
                        if self.kind[i] != "openai"}
        ids = asyncio.run(grpc_ones())
        return [ids[i] if i in ids else "".join(self._sse(http_port, i, f"ref{i}", time.monotonic() + 300))
                for i in range(len(self.prompts))]

    # ---- the run ------------------------------------------------------------------------------
    def run(self, want: list, servers: str, http_ports: list[int]) -> None:
        """Every stream until ``done`` is set (the caller's), each request checked against ``want``."""
        threads = [threading.Thread(target=self._thread_client if self.kind[i] == "threads" else self._openai_client,
                                    args=(i, want[i], servers if self.kind[i] == "threads" else http_ports),
                                    daemon=True, name=f"stream-{i}")
                   for i in range(len(want)) if self.kind[i] != "asyncio"]
        for t in threads:
            t.start()

        async def every():
            await asyncio.gather(*(self._async_client(i, want[i], servers) for i in range(len(want))
                                   if self.kind[i] == "asyncio"))
        asyncio.run(every())
        for t in threads:
            t.join()

    # ---- asyncio: router.client astream ---------------------------------------------------------
    async def _one(self, stub, i: int, rid: str) -> tuple[list[int], float]:
        # (heavy: gRPC, loaded only by what uses them)
        from router.client import astream, make_request
        ids, gap, last = [], 0.0, time.monotonic()
        async for r in astream(stub, make_request(self.prompts[i], request_id=rid, **self.sampling()),
                               timeout=self.args.hang_s, wait_s=self.args.hang_s):
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            ids += r.token_ids
        return ids, gap

    async def _async_client(self, i: int, want: list[int], servers: str) -> None:
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        from router.client import ResumeMismatch
        async with _channel(servers) as stub:
            k = 0
            while not self.done.is_set():
                self._begin()
                gap, rid = None, f"s{i}-{k}-{uuid.uuid4().hex[:6]}"
                try:  # (our own bound too: a call gRPC failed to end would still count, as hung)
                    ids, gap = await within(self._one(stub, i, rid), self.args.hang_s + 30)
                    status = "identical" if ids == want else "wrong"
                except grpc.aio.AioRpcError as e:
                    status = "hung" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name
                    log(f"stream {i}: {status}: {e.details()}")
                except asyncio.TimeoutError:
                    status = "hung"
                    log(f"stream {i}: hung: no end within {self.args.hang_s + 30:g} s")
                except ResumeMismatch as e:
                    status = "ResumeMismatch"
                    log(f"stream {i}: {e}")
                self._end(i, rid, status, gap)
                k += 1

    # ---- threads: router.client stream ----------------------------------------------------------
    def _thread_client(self, i: int, want: list[int], servers: str) -> None:
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
        from router.client import ResumeMismatch, make_request, stream, target
        uri, options = target(servers)
        with grpc.insecure_channel(uri, options=options) as ch:
            stub, k = pb_grpc.GenerationStub(ch), 0
            while not self.done.is_set():
                self._begin()
                ids, gap, last = [], 0.0, time.monotonic()
                request = make_request(self.prompts[i], request_id=f"t{i}-{k}-{uuid.uuid4().hex[:6]}",
                                       **self.sampling())
                try:  # (the call's deadline is the bound: no second one around a thread)
                    for r in stream(stub, request, timeout=self.args.hang_s, wait_s=self.args.hang_s):
                        now = time.monotonic()
                        gap, last = max(gap, now - last), now
                        ids += r.token_ids
                    status = "identical" if ids == want else "wrong"
                except grpc.RpcError as e:
                    status, gap = "hung" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name, None
                    log(f"stream {i} (threads): {status}: {e.details()}")
                except ResumeMismatch as e:
                    status, gap = "ResumeMismatch", None
                    log(f"stream {i} (threads): {e}")
                self._end(i, request.request_id, status, gap)
                k += 1

    # ---- openai: SSE with an Idempotency-Key ----------------------------------------------------
    def _sse(self, port: int, i: int, key: str, deadline: float):
        """The text deltas of one streamed completion of prompt ``i`` on ``port``. Raises
        ConnectionError if the stream ends without ``[DONE]``, urllib/OSError as they come."""
        body = {"model": self.model, "prompt": self.prompts[i], "stream": True, **self.sampling()}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json", "idempotency-key": key})
        with urllib.request.urlopen(req, timeout=min(READ_TIMEOUT_S, max(deadline - time.monotonic(), 0.1))) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    yield json.loads(line[6:])["choices"][0]["text"]
                elif line.startswith(b"data: [DONE]"):
                    return
        raise ConnectionError("the stream ended without [DONE]")

    def _openai_client(self, i: int, want: str, ports: list[int]) -> None:
        k = 0
        while not self.done.is_set():
            self._begin()
            key, deadline = f"o{i}-{k}-{uuid.uuid4().hex[:6]}", time.monotonic() + self.args.hang_s
            status, gap, tries, seen, last = None, 0.0, 0, 0, time.monotonic()
            # Named on a long wait: the tries that delivered text (port, start s, what ended it,
            # characters), and those that did not by (port, what ended them): [first start s, times]
            t0, attempts, empty = last, [], {}
            while status is None:
                port = ports[tries % len(ports)]
                tries += 1
                text, began, ended = "", time.monotonic() - t0, "end"
                try:
                    for delta in self._sse(port, i, key, deadline):
                        text += delta
                        if not want.startswith(text):  # (a sent-again answer is the same from its start)
                            status = "wrong"
                            break
                        if len(text) > seen:  # (the wait a reader sees: until text it had not yet)
                            now = time.monotonic()
                            gap, last, seen = max(gap, now - last), now, len(text)
                    else:
                        status = "identical" if text == want else "wrong"
                except urllib.error.HTTPError as e:
                    ended = str(e.code)
                    if e.code not in (409, 503):  # (409: still running where it was cut; 503: a standby)
                        status = f"HTTP {e.code}"
                        log(f"stream {i} (openai): {status}: {e.read()[:200]!r}")
                except (urllib.error.URLError, OSError, http.client.HTTPException, ConnectionError) as e:
                    ended = type(getattr(e, "reason", e)).__name__  # refused, cut, silent: sent again
                if text:
                    attempts.append([port, round(began, 1), ended, len(text)])
                else:
                    empty.setdefault((port, ended), [round(began, 1), 0])[1] += 1
                if status is None:
                    if time.monotonic() > deadline:
                        status = "hung"
                        log(f"stream {i} (openai): hung: no whole answer within {self.args.hang_s:g} s")
                    else:
                        time.sleep(0.2)
            if gap > LONG_GAP_S:
                log(f"stream {i} (openai) {key}: tries with text [port, at s, ended by, characters]: {attempts}; "
                    f"without (port, ended by): [first at s, times]: {empty}")
            self._end(i, key, status, gap if status == "identical" else None)
            k += 1


@contextlib.asynccontextmanager
async def _channel(server: str):
    """A Generation stub on a ``grpc.aio`` channel to ``server`` (router.client's target and options)."""
    # (heavy: gRPC, loaded only by what uses them)
    import grpc
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    from router.client import target
    uri, options = target(server)
    async with grpc.aio.insecure_channel(uri, options=options) as ch:
        yield pb_grpc.GenerationStub(ch)
