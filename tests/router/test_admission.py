"""The admission policy (router.admission, router.policy) with a fake clock: weighted fair share
within a priority, strict priority across, the concurrency cap and tokens per minute; the
policy file's format."""

from __future__ import annotations

import pytest

from router.admission import Admission, Lease, Refused
from router.policy import Policy, PolicyError, TokenPolicy, load_policy, parse_policy


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _lease(adm: Admission, name: str, prompt: int = 10) -> Lease:
    got = adm.admit(name, prompt)
    assert isinstance(got, Lease), got
    return got


def _dispatch(adm: Admission, entries) -> object:
    """The entry whose turn it is, placed (as the router does: turn, trying, leave)."""
    head = [e for e in entries if adm.turn(e)]
    assert len(head) == 1, "exactly one waiting entry has the turn"
    e = head[0]
    adm.trying(e)
    adm.leave(e, placed=True)
    entries.remove(e)
    return e


def test_two_tokens_at_3_to_1_weights_get_3_to_1_admissions_under_overload():
    adm = Admission(Policy({"a": TokenPolicy(weight=3), "b": TokenPolicy(weight=1)}), Clock())
    entries = []
    for _ in range(8):  # both keep a backlog: overload
        for name in ("a", "b"):
            entries.append(adm.enqueue(_lease(adm, name), 100))
    placed = {"a": 0, "b": 0}
    for _ in range(400):
        e = _dispatch(adm, entries)
        placed[e.lease.name] += 1
        adm.release(e.lease)
        entries.append(adm.enqueue(_lease(adm, e.lease.name), 100))  # the backlog stays
    assert placed["a"] / placed["b"] == pytest.approx(3.0, rel=0.15), placed
    assert adm.queued == 16 and all(s.in_flight == 8 for s in adm.stats().values())


def test_fair_share_counts_tokens_not_requests():
    # equal weights, b's requests four times as big: b gets a quarter as many placements
    adm = Admission(Policy(), Clock())
    entries = [adm.enqueue(_lease(adm, n), c) for n, c in (("a", 100), ("b", 400)) for _ in range(8)]
    placed = {"a": 0, "b": 0}
    for _ in range(250):
        e = _dispatch(adm, entries)
        placed[e.lease.name] += 1
        entries.append(adm.enqueue(e.lease, 100 if e.lease.name == "a" else 400))
    assert placed["a"] / placed["b"] == pytest.approx(4.0, rel=0.15), placed


def test_a_token_that_was_idle_banks_no_credit():
    adm = Admission(Policy(), Clock())
    entries = [adm.enqueue(_lease(adm, "a"), 10) for _ in range(4)]
    for _ in range(50):  # a alone for a while
        e = _dispatch(adm, entries)
        entries.append(adm.enqueue(e.lease, 10))
    entries += [adm.enqueue(_lease(adm, "b"), 10) for _ in range(4)]
    first = [_dispatch(adm, entries).lease.name for _ in range(8)]
    assert first.count("b") <= 5, first  # interleaved from now on, not b's 50 first


def test_priority_is_strict():
    adm = Admission(Policy({"hi": TokenPolicy(priority="high", weight=0.01),
                            "lo": TokenPolicy(priority="low", weight=100)}), Clock())
    entries = [adm.enqueue(_lease(adm, "lo"), 1) for _ in range(5)]
    entries += [adm.enqueue(_lease(adm, "hi"), 1000) for _ in range(3)]
    order = [_dispatch(adm, entries).lease.name for _ in range(8)]
    assert order == ["hi"] * 3 + ["lo"] * 5


def test_a_waiting_head_that_does_not_fit_holds_the_rest_but_a_trying_one_does_not():
    adm = Admission(Policy(), Clock())
    first, second = adm.enqueue(_lease(adm, "a"), 10), adm.enqueue(_lease(adm, "b"), 10)
    assert adm.turn(first) and not adm.turn(second)  # first found no room: second waits too
    adm.trying(first)  # first found room, its reserve call is in flight
    assert adm.turn(second)
    assert adm.turn(first) and not adm.turn(second)  # the call did not place it: back in front
    adm.leave(first, placed=False)  # it gave up (cancelled, timed out)
    assert adm.turn(second)
    adm.leave(second, placed=True)
    assert adm.queued == 0


def test_a_cancelled_entry_gives_its_share_back():
    adm = Admission(Policy(), Clock())
    other = adm.enqueue(_lease(adm, "b"), 10)
    e = adm.enqueue(_lease(adm, "a"), 10_000)
    adm.leave(e, placed=False)
    again = adm.enqueue(_lease(adm, "a"), 10)
    assert again.start == e.start  # not pushed back by the request that never ran
    assert other.start == 0.0


def test_concurrency_cap():
    adm = Admission(Policy({"a": TokenPolicy(max_concurrent=2)}), Clock())
    one, two = _lease(adm, "a"), _lease(adm, "a")
    third = adm.admit("a", 10)
    assert isinstance(third, Refused) and third.limit == "max_concurrent" and third.retry_after_s > 0
    assert isinstance(adm.admit("b", 10), Lease)  # another token is not held by a's cap
    adm.release(one)
    adm.release(one)  # idempotent
    assert isinstance(adm.admit("a", 10), Lease)
    assert isinstance(adm.admit("a", 10), Refused)
    s = adm.stats()["a"]
    assert (s.admitted, s.refused, s.in_flight) == (3, {"max_concurrent": 2}, 2)
    del two


def test_tokens_per_minute_with_an_injected_clock():
    clock = Clock()
    adm = Admission(Policy({"a": TokenPolicy(tokens_per_minute=600)}), clock)  # 10 tokens a second
    lease = _lease(adm, "a", prompt=400)
    adm.charge(lease, 200)  # generated: 600 used, the bucket is empty
    refused = adm.admit("a", 1)
    assert isinstance(refused, Refused) and refused.limit == "tokens_per_minute"
    assert 0 < refused.retry_after_s <= 0.1
    clock.t += 0.5  # 5 tokens back
    big = _lease(adm, "a", prompt=1000)  # admitted while above zero, and goes into debt
    refused = adm.admit("a", 1)
    assert isinstance(refused, Refused) and refused.retry_after_s == pytest.approx(99.5, abs=0.01)
    assert "retry in 100 s" in refused.message
    clock.t += 99.6
    assert isinstance(adm.admit("a", 1), Lease)
    assert adm.stats()["a"].tokens == 400 + 200 + 1000 + 1
    clock.t += 3600  # an hour idle refills the bucket to its size, no more
    lease = _lease(adm, "a", prompt=600)
    assert isinstance(adm.admit("a", 1), Refused)
    assert isinstance(adm.admit("b", 10**9), Lease)  # no limit for the rest
    del big


def test_reload_changes_new_requests_and_keeps_the_bucket_level():
    clock = Clock()
    adm = Admission(Policy({"a": TokenPolicy(tokens_per_minute=1000, max_concurrent=1)}), clock)
    running = _lease(adm, "a", prompt=990)
    adm.reload(Policy({"a": TokenPolicy(tokens_per_minute=500, max_concurrent=3)}))
    assert running.policy.max_concurrent == 1  # the running one keeps what it was admitted with
    assert isinstance(adm.admit("a", 10), Lease)  # max_concurrent 3 now; 10 left of the bucket
    assert adm.admit("a", 10).limit == "tokens_per_minute"  # reloading did not refill it
    adm.reload(Policy())  # no limits at all
    assert all(isinstance(adm.admit("a", 10**6), Lease) for _ in range(5))
    adm.reload(Policy({"a": TokenPolicy(priority="high")}))
    assert adm.enqueue(_lease(adm, "a"), 1).rank == 0


def test_policy_file_format(tmp_path):
    f = tmp_path / "policy.yaml"
    f.write_text("default: {priority: low}\n"
                 "tokens:\n"
                 "  alice: {max_concurrent: 16, tokens_per_minute: 200000, priority: high, weight: 3}\n"
                 "  batch:\n")
    p = load_policy(str(f))
    assert p.of("alice") == TokenPolicy(16, 200000, "high", 3.0)
    assert p.of("batch") == TokenPolicy()  # named without fields: no limits, normal
    assert p.of("someone") == TokenPolicy(priority="low")
    assert load_policy("") == Policy() and Policy().of("x") == TokenPolicy()


@pytest.mark.parametrize("doc, names", [
    ({"tokens": {"a": {"max_concurent": 1}}}, "tokens.a: unknown field 'max_concurent'"),
    ({"tokens": {"a": {"max_concurrent": 0}}}, "tokens.a.max_concurrent"),
    ({"tokens": {"a": {"tokens_per_minute": "lots"}}}, "tokens.a.tokens_per_minute"),
    ({"tokens": {"a": {"priority": "urgent"}}}, "tokens.a.priority: one of high, normal, low"),
    ({"tokens": {"a": {"weight": -1}}}, "tokens.a.weight"),
    ({"default": {"weight": True}}, "default.weight"),
    ({"tokens": ["a"]}, "tokens: a mapping"),
    ({"limits": {}}, "a mapping with `default` and `tokens`"),
])
def test_a_bad_policy_names_the_field(doc, names):
    with pytest.raises(PolicyError, match=names.replace("(", r"\(")):
        parse_policy(doc, "policy file p.yaml")


def test_an_unreadable_policy_file_is_refused(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(str(tmp_path / "absent.yaml"))
    (tmp_path / "bad.yaml").write_text("tokens: [")
    with pytest.raises(PolicyError, match="not valid YAML"):
        load_policy(str(tmp_path / "bad.yaml"))
