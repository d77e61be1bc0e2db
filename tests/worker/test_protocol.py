"""The worker ↔ router protocol: typed records survive the codec; anything else is refused as
a ProtocolError for that one message, and the router's report loop goes on past it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from kvtransfer.base import TransferStats
from worker.protocol import (Failed, Key, ProtocolError, Report, Tokens, WorkerStatus, decode_report,
                             encode_report)


def _status(**kw) -> WorkerStatus:
    return WorkerStatus(**{"role": "decode", "incarnation": "inc", "pid": 7, "kv_blocks_used": 3,
                           "kv_blocks_total": 10, "block_size": 16, **kw})


def _report(records=(), seq: int = 0, **kw) -> Report:
    return Report("decode-0", "inc", list(records), _status(**kw), seq)


def test_records_and_status_round_trip_with_their_types():
    sent = _report([Tokens(Key("r1", 2), 1, [5, 6], "hi", None, 9, 4), Failed(Key("r2"), "lease expired"),
                    Tokens(Key("r3"), 0, [7], "x", "prefilled")],
                   kv_transfer=TransferStats(done=1, bytes=10, seconds=0.5), speculative={"acceptance_rate": 0.5})
    got = decode_report(encode_report(sent))
    assert got == sent
    assert [type(r) for r in got.records] == [Tokens, Failed, Tokens]
    assert got.records[0].key.attempt == 2 and got.records[0].key.engine_id == "r1#2"
    assert isinstance(got.status.kv_transfer, TransferStats) and got.status.kv_blocks_free == 7


@pytest.mark.parametrize("bad", [
    b"",
    b"\xc1 garbage",
    msgspec.msgpack.encode(["decode-0", "inc", [], {"role": "decode"}]),  # status fields missing
    msgspec.msgpack.encode(["decode-0", "inc", [{"type": "tokens", "key": {"request_id": "r"}, "start": 0,
                                                 "tokens": "not a list", "text": ""}], msgspec.to_builtins(_status())]),
    msgspec.msgpack.encode(["decode-0", "inc", [{"type": "nope"}], msgspec.to_builtins(_status())]),
    msgspec.msgpack.encode(["decode-0", "inc", [], msgspec.to_builtins(_status(kv_blocks_used="3"))]),
    msgspec.msgpack.encode(["decode-0", "inc", [{"type": "tokens", "key": {"request_id": "r"}, "start": 0,
                                                 "tokens": [], "text": "", "finish": "exploded"}],
                            msgspec.to_builtins(_status())]),
])
def test_malformed_reports_are_protocol_errors(bad):
    with pytest.raises(ProtocolError):
        decode_report(bad)


def test_the_router_drops_a_bad_report_and_takes_the_next():
    """Only a worker of this cluster speaks on the report socket: without the cluster key's MAC
    (garbage, a stranger's report, a report MAC'd with another key) or replayed (a seq already
    seen), a message is dropped and counted; the next good one is taken."""
    from kvtransfer.auth import new_secret
    from router.pools import Pools, Worker

    seen = []
    pools = Pools(SimpleNamespace(), "model", on_records=lambda w, rs: seen.extend(rs), on_lost=lambda w: None)
    first = _report([Tokens(Key("r"), 0, [1], "a", None)], seq=1)
    good = _report([Tokens(Key("r"), 1, [2], "b", "length")], seq=2)
    messages = [b"\x00garbage", msgspec.msgpack.encode(["decode-0"]), encode_report(first, pools.key),
                encode_report(good),  # no MAC: what anyone on the network could send
                encode_report(good, new_secret()),  # another cluster's key
                encode_report(first, pools.key),  # a replay
                encode_report(good, pools.key)]

    class Socket:
        async def recv(self):
            if not messages:
                raise asyncio.CancelledError
            return messages.pop(0)

    pools._sock = Socket()
    pools.workers["decode-0"] = Worker("decode-0", "decode", actor=None, state="ready", incarnation="inc")

    async def run():
        with pytest.raises(asyncio.CancelledError):
            await pools._receive()
    asyncio.run(run())
    assert pools.bad_reports == 5 and seen == first.records + good.records
    assert pools.workers["decode-0"].status == good.status and pools.workers["decode-0"].seq == 2


def test_a_report_with_the_key_round_trips_and_any_flipped_bit_is_refused():
    key = bytes(range(32))
    wire = encode_report(_report(seq=3), key)
    assert decode_report(wire, key).seq == 3
    for i in (0, 20, len(wire) - 1):  # the MAC, then the body
        bad = bytearray(wire)
        bad[i] ^= 1
        with pytest.raises(ProtocolError, match="MAC"):
            decode_report(bytes(bad), key)
    with pytest.raises(ProtocolError, match="MAC"):
        decode_report(wire[:10], key)


def test_a_report_sent_before_a_reserve_keeps_its_reservation():
    """The race that put two whole-cache requests on one worker: a report the worker sent before
    it took a reserve must not erase the router's count of that reserve's blocks."""
    from router.pools import Worker
    w = Worker("decode-0", "decode", actor=None, state="ready")
    w.reported(_status(kv_blocks_used=0, kv_blocks_total=100))
    w.calls += 1
    w.pending.append((w.calls, 90, 0))  # what Pools.reserved records for one reserve call
    assert w.load().free_blocks == 10
    w.reported(_status(kv_blocks_used=0, kv_blocks_total=100, admitted=0))  # in flight before it
    assert w.load().free_blocks == 10
    w.reported(_status(kv_blocks_used=90, kv_blocks_total=100, admitted=1))  # shows it now
    assert w.load().free_blocks == 10 and w.reserved_blocks == 0
