"""The UCX transport's peer table (kvtransfer/ucx_peers.py): it stays bounded as peers come and
go, and never forgets a peer whose next message would not bring its address back."""

from __future__ import annotations

from kvtransfer import ucx_peers
from kvtransfer.ucx_peers import ENDPOINT_IDLE_S, PEER_IDLE_S, PRUNE_EVERY_S, PeerTable


def test_idle_endpoints_are_closed_and_idle_heard_peers_forgotten():
    t = PeerTable()
    t.dial(1, b"dialed", 0.0)
    assert t.heard(2, b"heard", 0.0) == []
    t.get(1).ep, t.get(2).ep = "ep1", "ep2"
    assert t.prune(ENDPOINT_IDLE_S) == []  # idle exactly that long: kept
    assert sorted(t.prune(ENDPOINT_IDLE_S + PRUNE_EVERY_S)) == ["ep1", "ep2"]
    assert t.get(1).ep is None and t.get(2).ep is None and len(t) == 2  # endpoints recycled only
    assert t.prune(PEER_IDLE_S + 2 * PRUNE_EVERY_S) == []
    assert t.get(2) is None and t.get(1).address == b"dialed"  # a dialed peer stays until disconnect


def test_activity_keeps_a_peer_and_a_hello_updates_its_address():
    t = PeerTable()
    t.heard(7, b"old", 0.0)
    t.heard(7, b"new", PEER_IDLE_S)  # its next hello: active again
    t.prune(PEER_IDLE_S + PRUNE_EVERY_S)
    assert t.get(7).address == b"new"
    t.prune(PEER_IDLE_S + PRUNE_EVERY_S + 1)  # within PRUNE_EVERY_S of the last look: nothing done
    assert t.get(7) is not None


def test_past_max_peers_the_least_recently_active_heard_one_goes(monkeypatch):
    monkeypatch.setattr(ucx_peers, "MAX_PEERS", 3)
    t = PeerTable()
    t.dial(1, b"d", 0.0)  # oldest, but dialed: never evicted
    t.heard(2, b"x", 1.0)
    t.heard(3, b"y", 2.0)
    t.get(2).ep = "ep2"
    evicted = t.heard(4, b"z", 3.0)
    assert [p.ep for p in evicted] == ["ep2"]
    assert t.get(2) is None and len(t) == 3 and t.get(1) is not None and t.get(4) is not None
