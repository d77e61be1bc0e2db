"""The UCX transport's header and address formats on their own (no UCX needed)."""

from __future__ import annotations

import msgpack
import pytest

from kvtransfer.ucx import wire


def test_header_round_trip_host_and_device():
    assert wire.parse_header(wire.pack_header(7, [4, 0, 9], "hhh", b"addr")) == (7, [4, 0, 9], b"addr", "hhh", None, 0)
    assert wire.parse_header(wire.pack_header(8, [4, 8], "hd", None)) == (8, [4, 8], None, "hd", None, 0)
    assert len(msgpack.unpackb(wire.pack_header(8, [4], "h", None))) == 4  # host-only: the old 4 fields
    # A header with the sender's address names its process and worker generation too.
    hello = wire.pack_header(9, [], "", b"addr", "b00t.4026.77.123", 3)
    assert msgpack.unpackb(hello) == [1, 9, [], b"addr", "", "b00t.4026.77.123", 3]
    assert wire.parse_header(hello) == (9, [], b"addr", "", "b00t.4026.77.123", 3)
    # An older peer's header with an address and no process or generation: unknown, 0.
    assert wire.parse_header(msgpack.packb([1, 9, [2], b"addr"])) == (9, [2], b"addr", "h", None, 0)


@pytest.mark.parametrize("fields", [
    [2, 0, [1], None],  # unknown version
    [1, "0", [1], None],  # seq not an int
    [1, 0, 5, None],  # lengths not a list
    [1, 0, [wire.MAX_FRAME_BYTES + 1], None],
    [1, 0, [1] * (wire.MAX_FRAMES + 1), None],
    [1, 0, [-1], None],
    [1, 0, [1], "not bytes"],
    [1, 0, [1, 2], None, "h"],  # kinds of the wrong length
    [1, 0, [1], None, "x"],  # unknown memory kind
    [1, 0, [1], None, "h", "extra"],
    [1, 0, [1], None, "h", None, 0],  # a process and generation, but no address
    [1, 0, [1], b"a", "h", None, -1],  # generation out of range
    [1, 0, [1], b"a", "h", None, 1 << 32],
    [1, 0, [1], b"a", "h", None, "1"],
    [1, 0, [1], b"a", "h", 7, 0],  # process not a str
    [1, 0, [1], b"a", "h", "p" * (wire.MAX_PROCESS_CHARS + 1), 0],
], ids=lambda f: str(f)[:30])
def test_bad_headers_are_refused(fields):
    with pytest.raises(ValueError):
        wire.parse_header(msgpack.packb(fields))


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgpack.packb(12), msgpack.packb("abcd")])
def test_garbage_is_refused(raw):
    with pytest.raises(ValueError):
        wire.parse_header(raw)


def test_address_round_trip_and_refusals():
    addr = wire.format_address(0xDEADBEEF, b"\x00worker\xff")
    assert addr.startswith("ucx://deadbeef/")
    assert wire.parse_address(addr) == (0xDEADBEEF, b"\x00worker\xff", None, 0)
    with_process = wire.format_address(0xDEADBEEF, b"\x00worker\xff", "b00t.4026.77.123")
    assert with_process == addr + "/b00t.4026.77.123"
    assert wire.parse_address(with_process) == (0xDEADBEEF, b"\x00worker\xff", "b00t.4026.77.123", 0)
    later = wire.format_address(0xDEADBEEF, b"\x00worker\xff", "b00t.4026.77.123", 2)  # a replaced worker's
    assert later == with_process + "/2"
    assert wire.parse_address(later) == (0xDEADBEEF, b"\x00worker\xff", "b00t.4026.77.123", 2)
    assert wire.parse_address(wire.format_address(0xDEADBEEF, b"w", None, 2)) == (0xDEADBEEF, b"w", None, 2)
    for bad in ("tcp://x/y", "ucx://nothex/AAAA", "ucx://deadbeef", "ucx://deadbeef/", 42,
                with_process + "/x", with_process + "/-1", "ucx://deadbeef/AAAA/" + "p" * 200):
        with pytest.raises(ValueError):
            wire.parse_address(bad)
