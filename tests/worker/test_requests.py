"""A worker's request table and inbox, and the role calls over them, without Ray or an engine:
the calls are objects with explicit parts (worker.actor), so a fake core stands in."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from decode_worker.actor import DecodeCalls
from engine.errors import InvalidRequestError
from kvtransfer.base import TransferState
from prefill_worker.actor import PrefillCalls
from worker.inbox import Inbox
from worker.protocol import Failed, Key, Tokens
from worker.requests import Requests


def output(engine_id: str, new: list[int], finished: bool = False):
    return SimpleNamespace(request_id=engine_id, token_ids=new, new_token_ids=new, new_text="t", finished=finished,
                           finish_reason="length" if finished else None, num_prompt_tokens=3, num_cached_tokens=0,
                           new_logprobs=None, prompt_logprobs=None)


def test_a_request_is_known_from_admit_to_its_last_record_and_due_once():
    r = Requests()
    eid = r.admit(Key("a", 1), timeout_s=0.0)
    r.admit(Key("b"))
    assert eid == "a#1" and r.admitted == 2 and r.has_deadlines
    assert r.tokens(output(eid, [7]), leaves=False) == Tokens(Key("a", 1), 0, [7], "t", None, 3, 0)
    assert r.due(float("inf")) == [Key("a", 1)] and r.due(float("inf")) == []  # due once
    assert r.tokens(output(eid, [8], finished=True), leaves=True).finish == "length"
    assert r.tokens(output(eid, [9]), leaves=False) is None  # it left: logged, dropped
    assert r.failed("b#0", "gone") == Failed(Key("b"), "gone") and r.forget("b#0") is None


def _raise(e: Exception):
    raise e


def test_the_inbox_answers_calls_and_hands_back_posted_failures():
    inbox = Inbox()
    posted = []
    inbox.post(lambda: posted.append(1), Key("ok"))
    inbox.post(lambda: _raise(InvalidRequestError("bad")), Key("bad"))
    failed = inbox.run()
    assert posted == [1] and [(k, str(e)) for k, e in failed] == [(Key("bad"), "bad")] and not inbox
    answers = []
    caller = threading.Thread(target=lambda: answers.append(inbox.call(lambda: 42)))
    caller.start()
    _until_queued(inbox)
    assert inbox.run() == [] and (caller.join(5) or answers == [42])
    raiser = threading.Thread(target=lambda: answers.append(_call_or_error(inbox)))
    raiser.start()
    _until_queued(inbox)
    inbox.run()
    raiser.join(5)
    assert answers == [42, "ValueError: no"]  # a call's error goes to its caller, not the loop


def _until_queued(inbox: Inbox) -> None:
    end = time.monotonic() + 5  # hang guard only
    while not inbox:
        assert time.monotonic() < end, "the call was never queued"
        time.sleep(0.001)


def _call_or_error(inbox: Inbox) -> str:
    try:
        return inbox.call(lambda: _raise(ValueError("no")))
    except ValueError as e:
        return f"ValueError: {e}"


class FakeDecodeCore:
    def __init__(self, answer):
        self.answer, self.aborted, self.failed = answer, [], {}
        self.engine = SimpleNamespace(cached_prefix_tokens=lambda ids: 2, add_request=lambda *a, **k: None)

    def reserve(self, engine_id, prompt_ids, params):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def abort(self, engine_id):
        self.aborted.append(engine_id)

    def take_failed(self):
        failed, self.failed = self.failed, {}
        return failed


def calls_over(core, make=DecodeCalls):
    requests, inbox = Requests(), Inbox()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            inbox.run()
    threading.Thread(target=loop, daemon=True).start()
    return make(core, requests, inbox), requests, stop


def test_a_reservation_not_made_leaves_no_request_behind():
    for answer in (None, InvalidRequestError("too long")):
        calls, requests, stop = calls_over(FakeDecodeCore(answer))
        try:
            if isinstance(answer, Exception):
                with pytest.raises(InvalidRequestError):
                    calls.reserve(Key("r"), [1, 2, 3], None, timeout_s=1.0)
            else:
                assert calls.reserve(Key("r"), [1, 2, 3], None, timeout_s=1.0) is None
            assert requests.forget("r#0") is None and requests.admitted == 1
        finally:
            stop.set()


def test_decode_records_report_failed_transfers_and_a_drop_forgets():
    core = FakeDecodeCore(None)
    calls, requests, stop = calls_over(core)
    stop.set()
    requests.admit(Key("x"))
    requests.admit(Key("y"))
    core.failed = {"x#0": "lease expired"}
    assert calls.records([]) == [Failed(Key("x"), "lease expired")]
    calls.drop("y#0")
    assert core.aborted == ["y#0"] and requests.forget("y#0") is None


def test_a_prefilled_request_leaves_when_its_transfer_ends_not_at_its_first_token():
    core = SimpleNamespace(transfers={"p#0": object()}, abort=lambda eid: None)
    calls, requests, stop = calls_over(core, PrefillCalls)
    stop.set()
    requests.admit(Key("p"))
    requests.admit(Key("q"))
    first = calls.records(([output("p#0", [5])], []))
    assert [r.tokens for r in first] == [[5]] and calls.busy()
    calls.drop("p#0")  # its transfer is still going: it stays until it ends
    assert calls.records(([], [("p#0", TransferState.DONE), ("q#0", TransferState.FAILED)])) == [
        Failed(Key("q"), "KV transfer to the decode worker failed")]
    assert requests.forget("p#0") is None


def test_a_beat_inside_a_step_reports_at_most_every_mid_step_interval(monkeypatch):
    """StepLoop._beat (called between a step's layers): a report when the last one is
    MID_STEP_BEAT_S old, none before; none without a report socket."""
    import worker.step_loop as sl
    loop = object.__new__(sl.StepLoop)  # (its beat only: no thread, no engine)
    sent = []
    loop._send = lambda sink, now: (sent.append(sink), setattr(loop, "_last_beat", now))
    loop._sink, loop._last_beat = None, 0.0
    loop._beat()
    assert sent == []  # no router link: nothing to report to
    loop._sink = "sink"
    monkeypatch.setattr(sl, "MID_STEP_BEAT_S", 1e9)
    loop._beat()
    assert sent == []  # the last report is recent enough
    monkeypatch.setattr(sl, "MID_STEP_BEAT_S", 0.0)
    loop._beat()
    loop._beat()
    assert sent == ["sink", "sink"]


def test_a_steps_records_reach_the_outbox_after_a_report_sent_between_its_layers(monkeypatch):
    """A report sent by a beat inside the step takes the outbox list away; the step's records
    must join the new one (found by bench/serving.py: a long prompt's first token, produced by
    a step that reported midway, was added to the list already sent, and its request hung)."""
    import worker.step_loop as sl
    loop = object.__new__(sl.StepLoop)  # (one step only: no thread, no engine)
    sent = []

    def send(sink, now):
        batch, loop.outbox = loop.outbox, []
        sent.append(batch)
        loop._last_beat = now

    class Core:
        def step(self, beat):
            beat()  # a report between two layers
            return ["first token"]

    class Hooks:
        def records(self, result):
            return [*result, None]  # (a None is skipped)
    loop._send, loop._sink, loop._last_beat = send, "sink", 0.0
    loop.worker, loop.hooks, loop.outbox, loop.ended = Core(), Hooks(), [], None  # (ended: no HA)
    monkeypatch.setattr(sl, "MID_STEP_BEAT_S", 0.0)
    loop._step()
    assert sent == [[]] and loop.outbox == ["first token"]
