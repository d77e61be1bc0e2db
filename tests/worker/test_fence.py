"""worker.fence: the epoch a worker follows, and its grace period (a fake clock; no Ray)."""

from __future__ import annotations

import pickle

import pytest

from worker.fence import Fence, FencedError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_calls_of_the_followed_epoch_pass_and_restart_the_grace_clock():
    clock = Clock()
    f = Fence(3, grace_s=5.0, clock=clock)
    clock.now += 4
    f.admit(3)
    clock.now += 4  # 8 s after start, 4 after the last call
    assert not f.expired()
    clock.now += 1.5
    assert f.expired()


def test_an_older_epoch_is_refused_calls_and_adoption():
    f = Fence(2, grace_s=5.0, clock=Clock())
    f.adopt(5)
    for call in (lambda: f.admit(4), lambda: f.adopt(4), lambda: f.check_adopt(1)):
        with pytest.raises(FencedError) as e:
            call()
        assert e.value.current == 5 and not e.value.orphaned and "fenced off" in str(e.value)
    f.admit(5)
    f.adopt(5)  # the same router adopting again (a restarted process, a lost worker back)


def test_a_newer_epoch_must_adopt_before_it_calls():
    f = Fence(2, grace_s=5.0, clock=Clock())
    with pytest.raises(FencedError, match="has not adopted"):
        f.admit(3)
    f.adopt(3)
    f.admit(3)


def test_orphaned_it_refuses_every_call_until_an_adoption():
    clock = Clock()
    f = Fence(1, grace_s=5.0, clock=clock)
    clock.now += 6
    assert f.expired()
    f.orphaned = True  # (the step loop drops everything, then marks it)
    assert not f.expired()  # (once)
    with pytest.raises(FencedError) as e:
        f.admit(1)
    assert e.value.orphaned and "grace period" in str(e.value)
    f.adopt(1, grace_s=9.0)  # the same router, back: adopts it again (its grace period from now on)
    f.admit(1)
    assert not f.orphaned and f.grace_s == 9.0


def test_the_error_keeps_its_fields_across_processes():
    e = pickle.loads(pickle.dumps(FencedError(1, 4, orphaned=False)))
    assert (e.epoch, e.current, e.orphaned) == (1, 4, False) and "epoch 4" in str(e)


def test_a_long_step_does_not_count_against_the_grace_period():
    clock = Clock()
    f = Fence(1, grace_s=5.0, clock=clock)
    clock.now += 20  # a step of 20 s, with the router's calls queued behind it
    f.credit(20)
    assert not f.expired()
    clock.now += 6
    assert f.expired()
