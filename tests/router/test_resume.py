"""Streams that resume, without Ray (router.resume, router.ha ``adopt``, worker.fence ``handovers``):
what a worker hands over, the job rebuilt from it, the client's attach, the resume deadline's
abort, and the reports that come before the adoption's answer; the client library's replay."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from engine.request import RequestStatus, SamplingParams
from pdserve.v1 import pdserve_pb2 as pb
from router import ha
from router.client import ResumeMismatch, _Delivered, astream, make_request, stream
from router.config import ConfigError, load_config
from router.jobs import JobState
from router.resume import Resumable, rebuild
from router.worker_state import Role, Worker
from worker.fence import Adopted, Handover, handovers
from worker.protocol import Key


def _engine_request(prompt, out, status=RequestStatus.RUNNING, prefill_only=False, **params):
    return SimpleNamespace(prompt_token_ids=prompt, output_token_ids=out, status=status, prefill_only=prefill_only,
                           is_finished=status.is_finished, sampling_params=SamplingParams(max_tokens=50, **params))


def test_a_worker_hands_over_what_decodes_and_nothing_it_could_not_resume():
    reqs = {"a#0": _engine_request([1, 2], [3, 4], seed=7), "b#0": _engine_request([1], []),  # mid-prefill
            "c#0": _engine_request([1], [2], RequestStatus.WAITING_FOR_KV),  # its KV in transit
            "d#0": _engine_request([1], [2], prefill_only=True),  # the prefill side's copy
            "e#0": _engine_request([1], [2], logprobs=2),  # logprobs: none kept to replay
            "f#0": _engine_request([1], [2])}  # no key: not a request of a router
    keys = {eid: Key(eid[0]) for eid in "a#0 b#0 c#0 d#0 e#0".split()}
    (h,) = handovers(reqs, keys)
    assert (h.key, h.prompt_ids, h.output_ids, h.params.seed) == (Key("a"), [1, 2], [3, 4], 7)


def test_a_rebuilt_job_is_the_request_itself_even_after_a_rerun():
    w = SimpleNamespace(worker_id="decode-0")
    # attempt 1 ran after 3 tokens were streamed: they are its prompt's tail (params.resumed)
    h = Handover(Key("r~tag", 1), [1, 2, 10, 11, 12], [13, 14], SamplingParams(max_tokens=7, resumed=3, seed=5))
    job = rebuild(h, w)
    assert (job.prompt_ids, job.generated, job.base, job.attempt) == ([1, 2], [10, 11, 12, 13, 14], 3, 1)
    assert (job.params.max_tokens, job.params.resumed, job.params.seed) == (10, 0, 5)
    assert job.state is JobState.RUNNING and job.decode is w and job.prefill is None and not job.prefilling
    # its next record (start: the attempt's own output count) is the next in order
    assert job.in_order(SimpleNamespace(start=2, tokens=[15])) and job.inputs()[1].resumed == 5


def _adopted(*handed: Handover, held=()) -> Adopted:
    requests = {h.key.engine_id: 2 for h in handed} | {eid: 1 for eid in held}
    return Adopted("decode-0", "inc", "decode", 3, requests, 2 * len(requests), "addr", list(handed))


def test_kept_jobs_wait_for_their_client_then_are_aborted_and_freed():
    released = []

    async def main():
        jobs = {"running": object()}
        r = Resumable(jobs, 0.2, released.append)
        w = SimpleNamespace(worker_id="decode-0")
        hs = [Handover(Key(rid), [1], [2], SamplingParams(max_tokens=9)) for rid in ("a", "b", "running")]
        kept = r.handover(w, _adopted(*hs))
        assert kept == {"a#0", "b#0"}  # one of the same id runs here already: not taken over
        assert r.find("a") is not None and r.find("running") is None and r.find("zzz") is None
        job = r.claim("a", "alice", "lease")
        assert (job.owner, job.lease, r.find("a")) == ("alice", "lease", None)
        await asyncio.sleep(0.4)
        assert "a" in jobs and "b" not in jobs and [j.request_id for j in released] == ["b"]
        assert (r.rebuilt, r.attached, r.expired) == (2, 1, 1)
        assert Resumable({}, 0.0, released.append).handover(w, _adopted(*hs)) == set()  # resume_s 0: none kept
    asyncio.run(main())


def test_adopt_keeps_what_is_rebuilt_releases_the_rest_and_replays_early_reports_first():
    events = []

    class Actor:
        def adopt(self, link, grace_s):
            return "adopt"

        class release:
            @staticmethod
            def remote(ids):
                return ("release", tuple(ids))

    w = Worker("decode-0", Role.DECODE, Actor())
    h = Handover(Key("a"), [1], [2], SamplingParams(max_tokens=9))

    async def call(worker, ref, timeout_s=None):
        if ref == "adopt":
            assert w.keep_early(b"report-1")  # a report that overtook the answer: kept, not dropped
            return _adopted(h, held=["b#0"])
        events.append(ref)
        return 3

    def handover(worker, adopted):
        events.append(("handover", worker.incarnation))
        return {"a#0"}

    asyncio.run(ha.adopt(w, None, 30.0, call, 60.0, handover, lambda msg: events.append(msg)))
    assert events == [("handover", "inc"), b"report-1", ("release", ("b#0",))] and w.early is None
    assert not w.keep_early(b"late")  # (adopted: reports go the usual way)


def test_resume_s_is_checked():
    assert load_config(None, {"ha.resume_s": 12}).ha.resume_s == 12.0
    for bad in (-1, 601):
        with pytest.raises(ConfigError, match="ha.resume_s"):
            load_config(None, {"ha.resume_s": bad})


def _responses(*parts):
    return [pb.GenerateResponse(request_id="r", token_ids=ids, text=text, finish_reason=f) for ids, text, f in parts]


def _replay(responses, got: list[int], chars: int):
    delivered = _Delivered()
    delivered.add(pb.GenerateResponse(token_ids=got, text="x" * chars))
    trim = delivered.replay()
    return [x for r in responses if (x := trim(r)) is not None]


def test_a_replayed_stream_drops_what_was_delivered_and_refuses_other_tokens():
    stream = _responses(([1, 2], "ab", 0), ([3, 4], "cd", 0), ([], "", pb.FINISH_REASON_LENGTH))
    out = _replay(stream, [1, 2, 3], 3)
    assert [(list(r.token_ids), r.text, r.finish_reason) for r in out] == \
        [([4], "d", 0), ([], "", pb.FINISH_REASON_LENGTH)]
    with pytest.raises(ResumeMismatch):
        _replay(stream, [1, 9], 2)
    with pytest.raises(ResumeMismatch):  # ended before what was delivered
        _replay(_responses(([1], "a", pb.FINISH_REASON_STOP)), [1, 2], 2)


class _Unavailable(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE) -> None:
        self._code = code

    def code(self):
        return self._code


class _Stub:
    """Generate streams ``answer`` but breaks after ``cut`` responses the first time (its router
    lost); Resume answers from ``resume`` (a list, or an error code)."""

    def __init__(self, answer, cut: int, resume) -> None:
        self.answer, self.cut, self.resume, self.calls = answer, cut, list(resume), []

    def Generate(self, request, timeout=None):
        self.calls.append(("Generate", request.request_id))
        first = len(self.calls) == 1
        for i, r in enumerate(self.answer):
            if first and i == self.cut:
                raise _Unavailable()
            yield r

    def Resume(self, request, timeout=None):
        self.calls.append(("Resume", request.request_id, request.received_tokens))
        what = self.resume.pop(0)
        if isinstance(what, grpc.StatusCode):
            raise _Unavailable(what)
        yield from what


ANSWER = _responses(([1, 2], "ab", 0), ([3], "c", 0), ([4, 5], "de", 0), ([], "", pb.FINISH_REASON_LENGTH))


def _collect(responses):
    out = [(list(r.token_ids), r.text) for r in responses]
    return [t for ids, _ in out for t in ids], "".join(text for _, text in out)


def test_a_stream_whose_router_is_lost_resumes_after_what_it_received():
    stub = _Stub(ANSWER, 2, [grpc.StatusCode.UNAVAILABLE, ANSWER[2:]])  # no router yet, then the new one
    assert _collect(stream(stub, make_request("hi", request_id="r1"))) == ([1, 2, 3, 4, 5], "abcde")
    assert stub.calls == [("Generate", "r1"), ("Resume", "r1", 3), ("Resume", "r1", 3)]


def test_a_stream_no_router_kept_runs_again_less_what_was_delivered():
    stub = _Stub(ANSWER, 2, [grpc.StatusCode.NOT_FOUND])
    assert _collect(stream(stub, make_request("hi"))) == ([1, 2, 3, 4, 5], "abcde")
    rid = stub.calls[0][1]
    assert rid and stub.calls == [("Generate", rid), ("Resume", rid, 3), ("Generate", rid)]  # (an id of its own)


def test_a_stream_kept_with_fewer_tokens_than_delivered_runs_again_less_what_was_delivered():
    # (a run sent again before, whose router was lost too: the new one kept it shorter)
    stub = _Stub(ANSWER, 2, [grpc.StatusCode.OUT_OF_RANGE])
    assert _collect(stream(stub, make_request("hi", request_id="r3"))) == ([1, 2, 3, 4, 5], "abcde")
    assert stub.calls == [("Generate", "r3"), ("Resume", "r3", 3), ("Generate", "r3")]


def test_a_stream_broken_before_its_first_token_is_sent_again_under_its_id():
    stub = _Stub(ANSWER, 0, [])  # (no router serves for now: a standby taking over)
    assert _collect(stream(stub, make_request("hi", request_id="r4"))) == ([1, 2, 3, 4, 5], "abcde")
    assert stub.calls == [("Generate", "r4"), ("Generate", "r4")]


def test_a_client_of_one_server_is_not_kept_waiting_before_its_first_token():
    """unanswered_s=0 (``pdserve generate --server one``): UNAVAILABLE before any token is the
    caller's at once, not after sending the request again for RESUME_WAIT_S."""
    stub = _Stub(ANSWER, 0, [])
    with pytest.raises(grpc.RpcError) as e:
        _collect(stream(stub, make_request("hi", request_id="r5"), unanswered_s=0))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and stub.calls == [("Generate", "r5")]


def test_astream_resumes_and_runs_again_as_stream_does():
    from grpc import aio

    class Call:
        def __init__(self, items) -> None:
            self.items = list(items)

        async def read(self):
            x = self.items.pop(0) if self.items else aio.EOF
            if isinstance(x, grpc.StatusCode):
                raise aio.AioRpcError(x, aio.Metadata(), aio.Metadata())
            return x

    class Stub:
        def __init__(self, resume) -> None:
            self.resume, self.generated = list(resume), 0

        def Generate(self, request, timeout=None):
            self.generated += 1
            return Call(ANSWER[:2] + [grpc.StatusCode.UNAVAILABLE] if self.generated == 1 else ANSWER)

        def Resume(self, request, timeout=None):
            return Call(self.resume.pop(0))

    async def run(stub):
        return _collect([r async for r in astream(stub, make_request("hi"))])
    assert asyncio.run(run(Stub([[grpc.StatusCode.UNAVAILABLE], ANSWER[2:]]))) == ([1, 2, 3, 4, 5], "abcde")
    assert asyncio.run(run(Stub([[grpc.StatusCode.NOT_FOUND]]))) == ([1, 2, 3, 4, 5], "abcde")


def test_an_idempotency_key_names_the_request_and_a_bad_one_is_a_400():
    from router.openai_api import ApiError, CompletionRequest, parse, requests_for
    req = parse(CompletionRequest, {"model": "m", "prompt": "hi", "n": 2})
    rid, reqs = requests_for(req, "cmpl", 8, "order-42")
    assert rid == "cmpl-order-42" and [g.request_id for g in reqs] == ["cmpl-order-42-0", "cmpl-order-42-1"]
    assert requests_for(req, "cmpl", 8)[0] != requests_for(req, "cmpl", 8)[0]  # (no key: fresh ids)
    for bad in ("", "has space", "x" * 65, "é"):
        with pytest.raises(ApiError) as e:
            requests_for(req, "cmpl", 8, bad)
        assert e.value.status == 400


def test_catch_up_sends_the_text_after_what_the_client_has_and_sees_a_stop_string(tokenizer):
    from engine.detokenizer import TextStream
    from router.resume import catch_up
    ids = tokenizer("Grüße aus Köln, the café is open. Done.")["input_ids"]
    whole = TextStream(tokenizer)
    whole.step(ids)
    for k in range(len(ids) + 1):  # the client has k tokens and the text a stream sent with them
        had = TextStream(tokenizer)
        had.step(ids[:k])
        job = rebuild(Handover(Key("r"), [1], ids, SamplingParams(max_tokens=99)), SimpleNamespace(worker_id="d"))
        r = catch_up(job, tokenizer, k, "mine")
        assert had.delta(False) + (r.text if r else "") == whole.text, k  # nothing twice, nothing lost
        assert (list(r.token_ids) if r else []) == ids[k:] and (r is None or r.request_id == "mine")
        assert not job.stopped
    job = rebuild(Handover(Key("r"), [1], ids, SamplingParams(max_tokens=99, stop=["open"])),
                  SimpleNamespace(worker_id="d"))
    r = catch_up(job, tokenizer, 2, "mine")
    assert job.stopped and not r.text.endswith("open") and "open" not in r.text  # (the router then ends it: stop)


# ---- requests that ended while no router heard (worker.fence ``Ended``) ---------------------------
def test_a_request_that_ended_is_handed_over_with_its_end_for_a_while():
    from worker.fence import ENDED_KEEP_S, Ended
    from worker.protocol import Failed, Tokens
    now = [100.0]
    ended = Ended(clock=lambda: now[0])
    before = {"a#0": _engine_request([1, 2], [3, 4]), "b#0": _engine_request([1], [2]),
              "c#0": _engine_request([1], [2], prefill_only=True), "d#0": _engine_request([1], [2], logprobs=1),
              "e#0": _engine_request([5], [6])}
    ended.keep([Tokens(Key("a"), 1, [4], "", "stop"), Tokens(Key("b"), 0, [2], "", None),  # b decodes still
                Tokens(Key("c"), 0, [2], "", "length"), Tokens(Key("d"), 0, [2], "", "length"),  # not resumable
                Tokens(Key("e"), 0, [6], "", "abort"), Failed(Key("f"), "gone"),  # not ended by the model
                Tokens(Key("g"), 0, [1], "", "stop")], before)  # g was not in the engine before the step
    (h,) = ended.recent()
    assert (h.key, h.prompt_ids, h.output_ids, h.finish) == (Key("a"), [1, 2], [3, 4], "stop")
    now[0] += ENDED_KEEP_S + 1  # (long after any takeover: forgotten)
    assert ended.recent() == []
    ended.keep([], {})  # (and no longer held: the next step lets it go)
    assert len(ended._kept) == 0


def test_a_request_rebuilt_after_it_ended_gets_the_rest_and_its_end_and_nothing_runs(tokenizer):
    from router.resume import catch_up
    from tests.router.fake_pools import FakePools
    from tests.router.test_preemption import _router
    pools = FakePools(("decode-0", "colocated", 4))
    r = _router(pools, tokenizer)
    ids = tokenizer("The end of the answer.")["input_ids"]
    for finish, max_tokens, want in (("stop", 99, pb.FINISH_REASON_STOP), ("length", len(ids), pb.FINISH_REASON_LENGTH)):
        job = rebuild(Handover(Key("r"), [1], ids, SamplingParams(max_tokens=max_tokens), finish),
                      pools.workers["decode-0"])
        first = catch_up(job, tokenizer, 2, "mine")  # the client had 2 tokens when its router was lost

        async def rest():
            return [x async for x in r._run(job)]
        (last,) = asyncio.run(rest())
        assert list(first.token_ids) == ids[2:] and last.finish_reason == want and job.state is JobState.DONE
    assert pools.calls == []  # nothing placed, nothing run again


def test_an_ended_request_waits_outside_the_live_jobs_until_its_client_claims_it():
    async def main():
        jobs: dict = {}
        r = Resumable(jobs, 0.2, lambda job: None)
        w = SimpleNamespace(worker_id="decode-0")
        live = Handover(Key("a"), [1], [2], SamplingParams(max_tokens=9))
        twin = Handover(Key("a"), [1], [2, 3], SamplingParams(max_tokens=9), "stop")  # an older attempt's end
        hs = [live, twin, *(Handover(Key(x), [1], [2], SamplingParams(max_tokens=9), "length") for x in "bc")]
        assert r.handover(w, _adopted(*hs)) == {"a#0"}  # (nothing of the ended ones to keep on the worker)
        assert set(jobs) == {"a"} and (r.rebuilt, r.ended) == (3, 2)  # ended: no live request
        assert r.find("b").ended == "length" and r.find("a").ended is None
        assert r.claim("b", "alice", "lease") is jobs["b"]  # claimed: live now, its stream ends it
        await asyncio.sleep(0.4)
        assert set(jobs) == {"b"} and r.find("c") is None and r.expired == 1  # (only "a" was aborted)
    asyncio.run(main())
