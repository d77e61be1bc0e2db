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


def test_the_prefill_stops_mattering_once_decode_streams():
    """Blame: a lost or failed worker re-runs the job only while the job depends on it."""
    p, d = _W("p"), _W("d")
    job = Job("r", [1, 2], SamplingParams(max_tokens=8))
    job.placed(p, d)
    assert job.depends_on(p) and job.depends_on(d) and not job.depends_on(_W("o"))
    assert not job.depends_on(None)  # Abort and shutdown carry no worker
    job.heard_from(p)  # the prefill's first token: still needed until decode runs
    assert job.depends_on(p)
    job.heard_from(d)
    assert not job.depends_on(p) and job.depends_on(d) and job.prefill_id == "p"


def test_a_colocated_worker_stays_needed():
    job = Job("r", [1, 2], SamplingParams(max_tokens=8))
    w = _W("c")
    job.placed(w, w)
    job.heard_from(w)
    assert job.depends_on(w) and job.prefill is w


class _W:
    """A worker as a job sees one: compared by identity, named by its id."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
