"""Client keepalive (router.client) against the router's port options (router.grpc_guard), on
real sockets: a stream whose server is SIGSTOPped ends UNAVAILABLE (what lets ``stream`` resume
on a standby) instead of waiting for the process to wake, and a list with a stopped server in it
reaches the one that serves; a call the server keeps silent for
longer than three of the client's pings lives (the server permits them); a client pinging
faster than the server permits is sent away (no ping flood)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from router.client import KEEPALIVE_S, channel
from router.grpc_guard import MIN_PING_INTERVAL_S, PING_STRIKES
from tests.router.keepalive_server import call, served

HANG_GUARD_S = 60.0  # only against a hang: each of these ends in seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stream_to_a_stopped_server_ends_unavailable_instead_of_hanging():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.router.keepalive_server", str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "serving"
        with channel(f"127.0.0.1:{port}") as ch:
            responses = call(ch, HANG_GUARD_S)
            assert [next(responses), next(responses)] == [b"tick", b"tick"]
            proc.send_signal(signal.SIGSTOP)  # no FIN, no RST: only a ping finds out
            with pytest.raises(grpc.RpcError) as e:
                for _ in responses:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value  # (not DEADLINE_EXCEEDED: a hang)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def test_a_list_with_a_stopped_server_reaches_the_one_that_serves():
    # A stopped router's kernel accepts connections that never shake hands: gRPC's pick_first
    # waits for that attempt (20 s by default) before it uses another address; the client's
    # CONNECT_TIMEOUT_MS (2 s) bounds it, so the call gets through well within gRPC's 20 s
    stopped, serving = _free_port(), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.router.keepalive_server", str(stopped)],
                            stdout=subprocess.PIPE, text=True)
    server = None
    try:
        assert proc.stdout.readline().strip() == "serving"
        proc.send_signal(signal.SIGSTOP)
        with channel(f"127.0.0.1:{serving},127.0.0.1:{stopped}") as ch:
            with pytest.raises(grpc.RpcError):  # (the first refuses, as a standby does; the second hangs)
                next(call(ch, 1))
            deadline = time.monotonic() + 15  # (below gRPC's own 20 s)
            server = served(serving, None)  # (then the first leads)
            while True:  # (as router.client ``stream`` asks again: UNAVAILABLE until a connection is up)
                try:
                    assert next(call(ch, max(0.1, deadline - time.monotonic()))) == b"tick"
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    time.sleep(0.2)
    finally:
        if server is not None:
            server.stop(0)
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def test_the_server_permits_the_clients_pings_on_a_silent_call():
    # Past the third ping sooner than the server permits (gRPC's default: one per 5 min), a
    # GOAWAY would end the call: 3 strikes at KEEPALIVE_S apart take 4 pings
    silent = KEEPALIVE_S * (PING_STRIKES + 2) + 1
    server = served(0, silent)
    try:
        with channel(f"127.0.0.1:{server.port}") as ch:
            assert list(call(ch, HANG_GUARD_S)) == [b"done"]
    finally:
        server.stop(0)


def test_a_client_that_pings_faster_than_permitted_is_sent_away():
    # A hostile client speaks raw HTTP/2 (gRPC's own holds its pings a second apart): pings back
    # to back, no call. GOAWAY ENHANCE_YOUR_CALM "too_many_pings" after PING_STRIKES + 1 of them
    server = served(0, None)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, b""))  # preface, SETTINGS
            for i in range(PING_STRIKES + 2):
                s.sendall(_frame(6, 0, i.to_bytes(8, "big")))
            goaway = None
            while goaway is None:
                kind, payload = _read_frame(s)
                if kind == 7:
                    goaway = payload
        code = int.from_bytes(goaway[4:8], "big")
        assert code == 0xB and b"too_many_pings" in goaway[8:], goaway  # ENHANCE_YOUR_CALM
    finally:
        server.stop(0)


def _frame(kind: int, flags: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + (0).to_bytes(4, "big") + payload


def _read_frame(s: socket.socket) -> tuple[int, bytes]:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = s.recv(n - len(out))
            assert chunk, "the server closed the connection without a GOAWAY"
            out += chunk
        return out
    head = exactly(9)
    return head[3], exactly(int.from_bytes(head[:3], "big"))
