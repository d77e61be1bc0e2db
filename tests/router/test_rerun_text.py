"""A job re-run after a lost worker: the new worker sees the streamed tokens as prompt, so the
router makes the text itself. Characters split across the boundary and stop strings that
straddle it must come out as if one worker had run the whole request."""

from __future__ import annotations

from engine.detokenizer import TextStream
from engine.request import SamplingParams
from router.jobs import Job
from worker.protocol import Key, Tokens

KEY = Key("r")  # Job.tokens reads only what the records carry

TEXT = "Weather: 🦩 sunny, then STOP and more words after it."  # the flamingo takes 3 tokens


def _worker_records(tokenizer, ids, stop, finish_at=None, prefilled=False):
    """What a worker streams for output ``ids``: one token per record, its own text deltas.
    ``prefilled``: the first record comes from a prefill worker (the first token, finish
    "prefilled"; the decode worker streams the rest)."""
    s = TextStream(tokenizer, stop)
    recs = []
    for k in range(1, len(ids) + 1):
        done = k == finish_at
        s.step(ids[:k], final=done)
        finish = "length" if done else "prefilled" if prefilled and k == 1 else None
        recs.append(Tokens(KEY, k - 1, [ids[k - 1]], s.delta(done), finish))
    return recs


def _run(tokenizer, ids, cut, stop, prefilled=False):
    job = Job("r", [1, 2, 3], SamplingParams(max_tokens=len(ids), stop=stop))
    out_ids, out_text = [], ""
    for r in _worker_records(tokenizer, ids[:cut], stop):  # attempt 0, lost after `cut` tokens
        resp = job.tokens(r)
        if resp is not None:
            out_ids += resp.token_ids
            out_text += resp.text
    job.rerun(tokenizer)
    assert job.attempt == 1
    for r in _worker_records(tokenizer, ids[cut:], stop, finish_at=len(ids) - cut, prefilled=prefilled):
        resp = job.tokens(r)
        if resp is not None:
            out_ids += resp.token_ids
            out_text += resp.text
        if job.stopped:
            break
    return job, out_ids, out_text


def test_a_character_split_by_the_rerun_is_whole(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    job, out_ids, out_text = _run(tokenizer, ids, cut, [])
    assert out_ids == ids and out_text == TEXT and not job.stopped


def test_a_stop_string_straddling_the_rerun_ends_the_request(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    # lose the worker right after "ST" of "STOP" was generated (and held back by it)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("ST"))
    job, out_ids, out_text = _run(tokenizer, ids, cut, ["STOP"])
    assert job.stopped
    assert out_text == TEXT[:TEXT.index("STOP")]
    assert "STOP" in tokenizer.decode(out_ids) and "STOP" not in tokenizer.decode(out_ids[:-1])


def test_the_prefill_record_of_a_rerun_does_not_flush_held_back_text(tokenizer):
    """Disaggregated re-run: its first token comes from the prefill worker with finish
    "prefilled". It ends nothing: half a character stays held back until decode completes it,
    and a stop string begun there is still found."""
    ids = tokenizer(TEXT)["input_ids"]
    # the re-run's first token (the prefill's) is the first of the flamingo's 3 tokens
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k + 1]).endswith("\ufffd"))
    job, out_ids, out_text = _run(tokenizer, ids, cut, [], prefilled=True)
    assert out_ids == ids and out_text == TEXT and not job.stopped
    # the prefill's first token is "ST" of "STOP" (or the token that starts it)
    cut = next(k for k in range(1, len(ids)) if "ST" in tokenizer.decode(ids[:k + 1])[len(TEXT[:TEXT.index("STOP")]):])
    job, out_ids, out_text = _run(tokenizer, ids, cut, ["STOP"], prefilled=True)
    assert job.stopped and out_text == TEXT[:TEXT.index("STOP")]


def test_without_a_rerun_the_worker_text_is_passed_through(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    job = Job("r", [1], SamplingParams(max_tokens=len(ids)))
    recs = _worker_records(tokenizer, ids, [], finish_at=len(ids))
    recs[0].text = "<worker text>"  # whatever the worker says is what the client gets
    text = "".join(r.text for r in map(job.tokens, recs) if r is not None)
    assert job.stream is None and text.startswith("<worker text>")
