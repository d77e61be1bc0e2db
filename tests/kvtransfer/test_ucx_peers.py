"""The UCX transport's peer table (kvtransfer/ucx/peers.py): it stays bounded as peers come and
go, never forgets a peer whose next message would not bring its address back, and keeps one
endpoint per address for every connection to it (closed for good only when broken, when its
process has exited (at the next connection to it or the next prune), past MAX_PEERS addresses,
or at close)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtransfer.ucx import peers as ucx_peers
from kvtransfer.ucx.peers import ENDPOINT_IDLE_S, PEER_IDLE_S, PRUNE_EVERY_S, PeerTable, process_gone, this_process


class FakeUcx:
    """Endpoints as strings: ``make`` numbers them, ``close`` records them."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.closed: list[str] = []
        self.unreachable: set[bytes] = set()

    def make(self, address: bytes) -> str:
        if address in self.unreachable:
            raise ConnectionError(f"unreachable {address!r}")
        self.made.append(f"ep{len(self.made)}-{address.decode()}")
        return self.made[-1]

    def table(self) -> PeerTable:
        return PeerTable(self.make, self.closed.append)


def test_idle_connections_end_and_idle_heard_peers_are_forgotten():
    ucx = FakeUcx()
    t = ucx.table()
    t.dial(1, b"dialed", None, 0.0)
    t.heard(2, b"heard", 0.0)
    t.new_connection(t.get(1))
    t.new_connection(t.get(2))
    t.prune(ENDPOINT_IDLE_S)  # idle exactly that long: kept
    assert t.get(1).ep == "ep0-dialed" and t.get(2).ep == "ep1-heard"
    t.prune(ENDPOINT_IDLE_S + PRUNE_EVERY_S)
    assert t.get(1).ep is None and t.get(2).ep is None and len(t) == 2  # connections ended only
    assert ucx.closed == [] and t.num_endpoints == 2  # their endpoints are kept
    t.prune(PEER_IDLE_S + 2 * PRUNE_EVERY_S)
    assert t.get(2) is None and t.get(1).address == b"dialed"  # a dialed peer stays until disconnect


def test_activity_keeps_a_peer_and_a_hello_updates_its_address():
    t = FakeUcx().table()
    t.heard(7, b"old", 0.0)
    t.heard(7, b"new", PEER_IDLE_S)  # its next hello: active again
    t.prune(PEER_IDLE_S + PRUNE_EVERY_S)
    assert t.get(7).address == b"new"
    t.prune(PEER_IDLE_S + PRUNE_EVERY_S + 1)  # within PRUNE_EVERY_S of the last look: nothing done
    assert t.get(7) is not None


def test_past_max_peers_the_least_recently_active_heard_one_goes(monkeypatch):
    monkeypatch.setattr(ucx_peers, "MAX_PEERS", 3)
    t = FakeUcx().table()
    t.dial(1, b"d", None, 0.0)  # oldest, but dialed: never evicted
    t.heard(2, b"x", 1.0)
    t.heard(3, b"y", 2.0)
    t.heard(4, b"z", 3.0)
    assert t.get(2) is None and len(t) == 3 and t.get(1) is not None and t.get(4) is not None


def test_every_connection_to_an_address_reuses_its_endpoint():
    """A disconnect (forget), a drop (ep None) or a new uid at the same address: no new endpoint,
    which would map the peer's shared memory once more."""
    ucx = FakeUcx()
    t = ucx.table()
    for uid in (1, 1, 1, 2):
        t.dial(uid, b"a", None, 0.0)
        t.new_connection(t.get(uid))
        assert t.get(uid).ep == "ep0-a"
        t.get(uid).ep = None  # the connection dropped ...
        t.forget(uid)  # ... or was disconnected
    assert ucx.made == ["ep0-a"] and ucx.closed == [] and t.num_endpoints == 1
    t.close_all()
    assert ucx.closed == ["ep0-a"] and t.num_endpoints == 0 and len(t) == 0


def test_a_broken_endpoint_is_closed_for_good_and_the_next_connection_makes_a_new_one():
    ucx = FakeUcx()
    t = ucx.table()
    t.dial(1, b"a", None, 0.0)
    t.dial(2, b"a", None, 0.0)  # another uid on the same endpoint (made-up, or a stale record)
    t.new_connection(t.get(1))
    t.new_connection(t.get(2))
    broken = t.get(1).ep
    t.discard(broken)
    t.discard(broken)  # a second failed send on it: closed once
    assert ucx.closed == ["ep0-a"] and t.get(1).ep is None and t.get(2).ep is None  # never sent on again
    t.new_connection(t.get(1))
    assert t.get(1).ep == "ep1-a"


def _exited_process() -> str:
    """The identity of a process that has exited (and was reaped)."""
    code = "from kvtransfer.ucx.peers import this_process; print(this_process())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    return out.stdout.strip()


def test_process_identity_tells_an_exited_process():
    me = this_process()
    assert me is not None and not process_gone(me)
    gone = _exited_process()
    assert gone.split(".")[:2] == me.split(".")[:2] and process_gone(gone)
    boot, ns, pid, start = me.split(".")
    assert process_gone(f"{boot}.{ns}.{pid}.{int(start) + 1}")  # its pid, reused by a later process
    for unknowable in ("0" * 32 + f".{ns}.{pid}.1", f"{boot}.1.{pid}.1", "garbage", f"{boot}.{ns}.x.1"):
        assert not process_gone(unknowable)  # another host or PID namespace, or malformed


def test_a_kept_endpoint_is_not_reused_once_its_process_has_exited():
    """A kept endpoint would take messages to a dead peer silently; making a new one fails at once."""
    ucx = FakeUcx()
    t = ucx.table()
    t.dial(1, b"a", this_process(), 0.0)
    t.new_connection(t.get(1))
    t.get(1).ep = None
    t.new_connection(t.get(1))  # alive: reused
    assert ucx.made == ["ep0-a"]
    t.get(1).ep = None
    t.dial(1, b"a", _exited_process(), 0.0)  # (as if the address had named a process now gone)
    ucx.unreachable.add(b"a")
    try:
        t.new_connection(t.get(1))
        raise AssertionError("a new endpoint to a dead process was expected to fail")
    except ConnectionError:
        pass
    assert ucx.closed == ["ep0-a"] and t.num_endpoints == 0 and t.get(1).ep is None


def test_a_kept_endpoint_whose_process_exited_is_closed_by_the_next_prune():
    """A restarted peer comes back at a new address: nothing would ever connect to the dead one's
    again, so its endpoint (and what UCX holds for it) goes once its process is surely gone."""
    ucx = FakeUcx()
    t = ucx.table()
    for uid, address, process in ((1, b"dead", _exited_process()), (2, b"alive", this_process()), (3, b"unknown", None)):
        t.dial(uid, address, process, 0.0)
        t.new_connection(t.get(uid))  # (the dead one's made before its process is checked: a new endpoint)
        t.forget(uid)  # disconnected: the endpoint stays for the next connection to the address
    assert t.num_endpoints == 3 and ucx.closed == []
    t.prune(0.0)
    assert ucx.closed == ["ep0-dead"] and t.num_endpoints == 2  # alive and unknowable: kept
    t.dial(2, b"alive", None, 1.0)  # a later connection that does not say its process: the kept one's is used
    t.new_connection(t.get(2))
    assert t.get(2).ep == "ep1-alive" and ucx.made == ["ep0-dead", "ep1-alive", "ep2-unknown"]


def test_past_max_peers_endpoints_the_least_recently_connected_one_is_closed(monkeypatch):
    monkeypatch.setattr(ucx_peers, "MAX_PEERS", 2)
    ucx = FakeUcx()
    t = ucx.table()
    for uid, address in ((1, b"a"), (2, b"b")):
        t.dial(uid, address, None, 0.0)
        t.new_connection(t.get(uid))
    t.get(1).ep = None
    t.new_connection(t.get(1))  # a reconnection: "a" is now the most recently connected
    t.dial(3, b"c", None, 0.0)
    t.new_connection(t.get(3))
    assert ucx.closed == ["ep1-b"] and t.get(2).ep is None  # its connection ended with it
    assert t.get(1).ep == "ep0-a" and t.get(3).ep == "ep2-c" and t.num_endpoints == 2


def test_peers_gone_for_good_are_counted_stale_and_the_bound_follows_the_live_ones():
    """What UCX holds for a peer stays until our worker is replaced: the table counts the peers
    surely gone (an endpoint whose process exited, a heard peer whose process exited), and asks
    for a new worker at twice the live peers, at least RECYCLE_MIN_STALE."""
    ucx = FakeUcx()
    t = ucx.table()
    dead = _exited_process()
    t.dial(1, b"dialed-dead", dead, 0.0)
    t.new_connection(t.get(1))
    t.heard(2, b"heard-dead", 0.0, dead)  # its hello named its process
    t.heard(3, b"heard-alive", 0.0, this_process())
    t.dial(4, b"unknown", None, 0.0)
    t.prune(0.0)
    assert t.stale == 2 and ucx.closed == ["ep0-dialed-dead"]
    assert t.get(2) is None and t.get(1) is not None  # heard: forgotten; dialed: kept until disconnect
    assert sorted(t.live_uids()) == [3, 4] and t.recycle_at == ucx_peers.RECYCLE_MIN_STALE
    for uid in range(10, 13):
        t.heard(uid, b"p%d" % uid, 0.0, this_process())
    t.prune(PRUNE_EVERY_S)
    assert t.recycle_at == 2 * 5  # five live peers


def test_a_newer_generation_moves_a_peer_and_a_stale_address_changes_nothing():
    """A peer that replaced its UCX worker says so in its next hello (a higher generation): our
    connection to it ends, the endpoint to its old address is counted stale and closed once no
    send uses it; a
    dial of its older address afterwards (a copy from the control plane) keeps the newer."""
    ucx = FakeUcx()
    t = ucx.table()
    t.heard(7, b"gen0", 0.0, None, 0)
    t.new_connection(t.get(7))
    t.heard(7, b"gen0", 1.0, None, 0)  # another connection of the same worker: nothing moves
    assert t.get(7).ep == "ep0-gen0" and t.stale == 0
    t.heard(7, b"gen1", 2.0, None, 1)
    assert t.get(7).address == b"gen1" and t.get(7).ep is None and t.get(7).gen == 1
    assert t.stale == 1 and t.num_endpoints == 0 and t.superseded == ["ep0-gen0"]
    t.close_superseded(lambda ep: True)  # a send still in flight on it: kept (closing cancels it)
    assert ucx.closed == []
    t.close_superseded(lambda ep: False)
    assert ucx.closed == ["ep0-gen0"] and t.superseded == []
    t.dial(7, b"gen0", None, 3.0, 0)  # stale
    t.heard(7, b"gen0", 3.0, None, 0)  # a late hello of its old worker
    assert t.get(7).address == b"gen1" and t.get(7).dialed
    t.new_connection(t.get(7))
    assert t.get(7).ep == "ep1-gen1"
    assert t.take_endpoints() == ["ep1-gen1"]  # our worker is replaced: its endpoints go with it
    assert t.get(7).ep is None and t.num_endpoints == 0 and t.stale == 0 and len(t) == 1
