"""engine.detokenizer.TextStream: deltas that never split a character or give back text, stop
strings cut the text before them, and a stream resumed from text someone else sent."""

from __future__ import annotations

from engine.detokenizer import TextStream, tokens_through_stop

TEXT = "Weather: 🦩 sunny, then STOP and more words after it."  # the flamingo takes 3 tokens


def _split_char_prefix(tokenizer, ids):
    """A token count whose decoded prefix ends inside the emoji."""
    return next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))


def _deltas(stream, ids, start=0, final_at=None):
    out = ""
    for k in range(start + 1, len(ids) + 1):
        done = final_at is not None and k == final_at
        stream.step(ids[:k], final=done)
        out += stream.delta(done or stream.stopped)
        if stream.stopped:
            break
    return out


def test_deltas_add_up_to_the_decoded_text(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    s = TextStream(tokenizer)
    k = _split_char_prefix(tokenizer, ids)
    s.step(ids[:k])
    head = s.delta(False)
    assert "\ufffd" not in head and "🦩" not in head  # half an emoji is held back, not sent
    assert head + _deltas(s, ids, k, final_at=len(ids)) == tokenizer.decode(ids) == TEXT


def test_stop_string_cuts_before_it_and_holds_back_a_possible_start(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    s = TextStream(tokenizer, ["STOP"])
    sent = ""
    for k in range(1, len(ids) + 1):
        stopped = s.step(ids[:k])
        sent += s.delta(stopped)
        assert not sent.endswith("ST") or stopped  # "ST" could begin "STOP": not sent early
        if stopped:
            break
    assert sent == TEXT[:TEXT.index("STOP")]
    assert tokens_through_stop(tokenizer, ids[:k], k, ["STOP"]) == k  # the k-th token completed it
    many = ids[:k + 3]  # three tokens too many arrived at once: keep up to the completing one
    assert tokens_through_stop(tokenizer, many, 5, ["STOP"]) == 2


def test_resume_continues_after_what_was_sent(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    k = _split_char_prefix(tokenizer, ids)
    first = TextStream(tokenizer, ["STOP"])
    first.step(ids[:k])
    sent = first.delta(False)  # what a lost worker managed to send
    resumed = TextStream(tokenizer, ["STOP"])
    resumed.step(ids[:k])
    resumed.mark_sent(len(sent))
    rest = _deltas(resumed, ids, k)
    assert resumed.stopped and sent + rest == TEXT[:TEXT.index("STOP")]
