"""SIGTERM to a live `pdserve serve` (issue 42: "a SIGTERM during 16 streams completes all 16"):
the bundled model, its own free ports, two tokens (bench/probe.py's server). 16 streams (8 over
the OpenAI HTTP API, 8 over gRPC) are running when the signal comes; each ends with all its
tokens and finish reason `length`, a request sent during the drain is refused with the
documented retry hint (HTTP 503 + Retry-After, gRPC UNAVAILABLE + retry-after), and the
process exits 0 once they are done, well within the grace period."""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time

import grpc

from bench.probe_wire import PROMPT, http_request, serve, split
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.client import make_request

MAX_TOKENS = 48
# front_door.shutdown_grace_s, 4x its default: the check is that the process exits once the
# streams are done, not when the grace runs out. With the default 30 s the 16 streams took nearly
# all of it on a loaded 2-core machine (exit at 31.0 s in a `make test`), which a drain that
# waited out its grace would also give.
GRACE_S = 120.0


async def _http_stream(addr: str, token: str, model: str, started: asyncio.Event) -> tuple[int, str | None]:
    """(completion tokens, finish reason) of one streamed completion, over SSE."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection(*split(addr))
    writer.write(http_request("POST", "/v1/completions", addr, token, body))
    n, finish = 0, None
    try:
        assert (await reader.readline()).split()[1] == b"200"
        async for line in reader:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                started.set()
                finish = chunk["choices"][0]["finish_reason"] or finish
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    finally:
        writer.close()
    return n, finish


async def _grpc_stream(stub, token: str, started: asyncio.Event) -> tuple[int, str | None]:
    n, finish = 0, None
    async for r in stub.Generate(make_request(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0),
                                 metadata=(("authorization", f"Bearer {token}"),), timeout=120):
        n += len(r.token_ids)
        started.set()
        if r.finish_reason:
            finish = pb.FinishReason.Name(r.finish_reason)
    return n, finish


def test_sigterm_during_16_streams_completes_all_16_refuses_new_ones_and_exits_0():
    with tempfile.TemporaryDirectory() as d, serve(2, ["mode=colocated", "decode.compile_decode=false",
                                                       f"front_door.shutdown_grace_s={GRACE_S}"], d) as t:
        async def run():
            from bench.probe_wire import served_model
            model = await served_model(t)
            async with grpc.aio.insecure_channel(t.grpc) as ch:
                stub = pb_grpc.GenerationStub(ch)
                started = [asyncio.Event() for _ in range(16)]
                streams = [asyncio.create_task(_http_stream(t.http, t.victim, model, started[i])) for i in range(8)]
                streams += [asyncio.create_task(_grpc_stream(stub, t.victim, started[i])) for i in range(8, 16)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                assert not any(s.done() for s in streams), "streams ended before the signal: make them longer"
                t.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                # during the drain: a new request is refused with the retry hint, on both ports
                await asyncio.sleep(0.3)  # (the signal handler runs on the server's loop)
                reader, writer = await asyncio.open_connection(*split(t.http))
                body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2}).encode()
                writer.write(http_request("POST", "/v1/completions", t.http, t.victim, body))
                raw = await asyncio.wait_for(reader.read(), 30)
                writer.close()
                head = raw.partition(b"\r\n\r\n")[0].decode().lower()
                refused_grpc = None
                try:
                    async for _ in stub.Generate(make_request(PROMPT, max_tokens=2),
                                                 metadata=(("authorization", f"Bearer {t.victim}"),), timeout=30):
                        pass
                except grpc.aio.AioRpcError as e:
                    refused_grpc = e
                running = sum(not s.done() for s in streams)
                results = await asyncio.wait_for(asyncio.gather(*streams), GRACE_S)
            return head, refused_grpc, running, results, signalled

        head, refused_grpc, running, results, signalled = asyncio.run(run())
        rc = t.proc.wait(timeout=GRACE_S + 30)
        exited_after = time.monotonic() - signalled
    assert head.startswith("http/1.1 503") and "\r\nretry-after: 1\r\n" in head, head
    assert refused_grpc is not None and refused_grpc.code() == grpc.StatusCode.UNAVAILABLE, refused_grpc
    assert ("retry-after", "1") in tuple(refused_grpc.trailing_metadata())
    assert running > 0, "no stream was still running when the new requests were refused"
    assert results == [(MAX_TOKENS, "length")] * 8 + [(MAX_TOKENS, "FINISH_REASON_LENGTH")] * 8, results
    assert rc == 0 and exited_after < GRACE_S, (rc, exited_after)
