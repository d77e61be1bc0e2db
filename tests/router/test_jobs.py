"""A job's records in output order: a decode worker's tokens may overtake the prefill's first
token (two sockets into the router); the client still sees every token once, in order."""

from __future__ import annotations

from engine.request import SamplingParams
from router.jobs import Job, JobState
from worker.protocol import Key, Tokens


def _stream(job: Job, records: list[Tokens]) -> list[int]:
    out: list[int] = []
    for rec in records:
        for r in job.in_order(rec):
            resp = job.tokens(r)
            if resp is not None:
                out += resp.token_ids
    return out


def test_decode_records_wait_for_the_prefill_first_token():
    job = Job("r", [1, 2], SamplingParams(max_tokens=8))
    k = job.key
    first = Tokens(k, 0, [10], "a", "prefilled")
    decode = [Tokens(k, 1, [11, 12], "bc"), Tokens(k, 3, [13], "d")]
    assert _stream(job, decode) == []  # held: token 0 is not here yet
    assert _stream(job, [first]) == [10, 11, 12, 13]
    assert job.text == "abcd" and not job.pending


def test_a_token_already_streamed_is_dropped_and_a_rerun_counts_from_its_own_start(tokenizer):
    job = Job("r", [1, 2], SamplingParams(max_tokens=8))
    k = job.key
    assert _stream(job, [Tokens(k, 0, [10], "a", "prefilled"), Tokens(k, 0, [10], "a"),
                         Tokens(k, 1, [11], "b")]) == [10, 11]
    job.rerun(tokenizer)
    assert job.key == Key("r", 1) and job.state is JobState.PLACING
    # the new attempt's outputs count from 0 again: its prompt holds the tokens streamed so far
    k1 = job.key
    assert _stream(job, [Tokens(k1, 1, [13], "d"), Tokens(k1, 0, [12], "c", "prefilled")]) == [12, 13]
    assert job.generated == [10, 11, 12, 13]
