"""Identity at the router and in reprs (issue 42): request ids are the caller's own (no
cross-token ALREADY_EXISTS oracle, Abort reaches only one's own), GetClusterStatus needs an
admin token, and no repr prints a key or a secret."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from router.admin import is_admin, scoped_id
from router.admission import Admission
from router.auth import Auth, FrontDoor, _digest
from router.holdings import Holdings
from router.parking import Hold
from router.server import Reject, Router

TOKENS = {"alice": "a" * 32, "bob": "b" * 32, "admin-ops": "c" * 32}


class Aborted(Exception):
    def __init__(self, code):
        self.code = code


class Context:
    def __init__(self, token: str | None) -> None:
        self.token = token

    def invocation_metadata(self):
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    async def abort(self, code, message):
        raise Aborted(code)


def _router(monkeypatch, tokens: dict[str, str] = TOKENS) -> Router:
    """A Router without workers or a tokenizer: generate() runs up to a fake stream."""
    import router.server as server
    monkeypatch.setattr(server, "prompt_ids", lambda req, tok, limits: [1, 2, 3])
    monkeypatch.setattr(server, "sampling_params", lambda s, limits, n: SimpleNamespace(max_tokens=4))
    r = object.__new__(Router)
    r.door = FrontDoor(auth=Auth({_digest(t): name for name, t in tokens.items()}))
    r.jobs, r._tokenizing, r.tokenizer, r._tool_token = {}, None, None, False
    r.placer = SimpleNamespace(queued=0, live=Holdings())  # (generate drops its job from router.holdings)
    r.admission = Admission()  # no per-token policy (router.admission)
    r.limits = SimpleNamespace(input=SimpleNamespace(request_id_chars=128))
    r.metrics = SimpleNamespace(prompt_tokens=SimpleNamespace(inc=lambda n: None))
    r._release = r._observe = lambda *a: None
    r.stream_hold = lambda: Hold(lambda w, key: None)  # (no workers to park on)

    async def run(job):
        yield pb.GenerateResponse(request_id=job.request_id, token_ids=[7])
        await asyncio.Event().wait()  # still running until the client goes

    r._run = run
    return r


def test_a_request_id_is_the_callers_own(monkeypatch):
    r = _router(monkeypatch)

    async def main():
        alice = r.generate(pb.GenerateRequest(request_id="job-1"), "alice", None)
        first = await alice.__anext__()
        assert first.request_id == "job-1"  # the client's id, not the scoped one
        # Bob with Alice's id: a request of his own, not ALREADY_EXISTS (no oracle, no squatting)
        bob = r.generate(pb.GenerateRequest(request_id="job-1"), "bob", None)
        assert (await bob.__anext__()).request_id == "job-1"
        assert len(r.jobs) == 2 and {j.owner for j in r.jobs.values()} == {"alice", "bob"}
        with pytest.raises(Reject) as e:  # the same token twice: still refused
            await r.generate(pb.GenerateRequest(request_id="job-1"), "alice", None).__anext__()
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        # Abort reaches only one's own
        assert not (await r.Abort(pb.AbortRequest(request_id="nobody"), Context(TOKENS["bob"]))).found
        assert (await r.Abort(pb.AbortRequest(request_id="job-1"), Context(TOKENS["bob"]))).found
        assert r.job("bob", "job-1").events.qsize() == 1 and r.job("alice", "job-1").events.qsize() == 0
        await alice.aclose()
        await bob.aclose()
        assert r.jobs == {}
    asyncio.run(main())


def test_resume_checks_the_id_as_generate_does(monkeypatch):
    """Resume's request id has Generate's limits (it is echoed in the answer and logged): too long
    or unprintable is INVALID_ARGUMENT; a valid id nobody keeps is NOT_FOUND."""
    from router.resume import Resumable
    r = _router(monkeypatch)
    r.resumable = Resumable(r.jobs, 30.0, lambda job: None)

    async def resume(rid: str):
        await r.resume(pb.ResumeRequest(request_id=rid, received_tokens=1), "alice").__anext__()

    for rid, code in (("x" * 129, grpc.StatusCode.INVALID_ARGUMENT), ("a b", grpc.StatusCode.INVALID_ARGUMENT),
                      ("job-1", grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(Reject) as e:
            asyncio.run(resume(rid))
        assert e.value.code == code, rid


def test_scoped_ids_never_meet():
    assert scoped_id("", "x") == "x"  # auth off: one identity
    ids = {scoped_id(o, rid) for o in ("alice", "bob", "a") for rid in ("x", "x~" + "0" * 16)}
    assert len(ids) == 6 and all(len(i) <= 128 + 17 for i in ids)


def test_cluster_status_needs_an_admin_token(monkeypatch):
    r = _router(monkeypatch)
    r.pools = SimpleNamespace(workers={})
    r.cfg, r.metrics = SimpleNamespace(mode="colocated"), SimpleNamespace(address=None)
    r.placer = SimpleNamespace(queued=0)
    r.autoscaler = r.roles_controller = None

    async def call(token):
        return await r.GetClusterStatus(pb.GetClusterStatusRequest(check_blocks=False), Context(token))

    for token in (TOKENS["alice"], TOKENS["bob"]):
        with pytest.raises(Aborted) as e:
            asyncio.run(call(token))
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(Aborted) as e:
        asyncio.run(call("z" * 32))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(call(TOKENS["admin-ops"])).mode == "colocated"
    r.door = FrontDoor()  # auth off: the operator's own loopback server
    assert asyncio.run(call(None)).mode == "colocated"


def test_is_admin_asks_auth_when_it_knows_classes():
    auth = Auth({_digest("a" * 32): "alice"})
    assert not is_admin(auth, "alice") and not is_admin(auth, None) and is_admin(auth, "admin")
    auth.is_admin = lambda name: name == "alice"
    assert is_admin(auth, "alice") and not is_admin(auth, "admin")


def test_no_repr_prints_a_key_or_a_secret():
    from kvtransfer.auth import PlaneAuth
    from router.pools import Worker
    from worker.protocol import Reservation
    from worker.step_loop import RouterLink, WorkerOptions
    key, secret = bytes(range(100, 132)), bytes(range(200, 232))
    objects = [PlaneAuth(key), WorkerOptions(key=key, router=RouterLink("tcp://r:1", "decode-0")),
               Reservation(secret, 3), Worker("decode-0", "decode", None, rkey=("inc", key))]
    for o in objects:
        for text in (repr(o), str(o), f"{o!r}", repr([o])):
            assert key.hex() not in text and repr(key) not in text and repr(secret) not in text
            assert repr(key)[2:-1] not in text and repr(secret)[2:-1] not in text
    assert "decode-0" in repr(objects[1]) and "token_start=3" in repr(objects[2])
