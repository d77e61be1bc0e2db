"""Role switching policy (mode: adaptive) on synthetic signal traces: which way, when, limits,
no flapping; a phase-shifting load moves workers one way and then back."""

from __future__ import annotations

import dataclasses

from router.autoscale import DecodeTargets, PrefillTargets, Signals
from router.roles import RolesConfig, RoleState, decide

P = PrefillTargets(target_queued_tokens=1000, target_ttft_ms=2000)
D = DecodeTargets(kv_high=0.8, kv_low=0.3, target_tpot_ms=100)
CFG = RolesConfig(switch_delay_s=5, idle_delay_s=20, min_prefill=1, min_decode=1)
CFG0 = dataclasses.replace(CFG, min_prefill=0)  # the last prefill worker may go too
BUSY_PREFILL = ({"queued_prompt_tokens": 50_000}, {"kv_utilization": 0.2})
BUSY_DECODE = ({}, {"kv_utilization": 0.95})


def replay(trace, prefill=2, decode=2, cfg=CFG, dt=1.0):
    """Feed ``trace`` (per second: (prefill Signals kwargs, decode Signals kwargs)); a switch
    takes effect at once here. Returns the (prefill, decode) sizes after each second."""
    state, sizes = RoleState(), []
    for i, (p, d) in enumerate(trace):
        want, why = decide(i * dt, Signals(workers=prefill, **p), Signals(workers=decode, **d), P, D, cfg, state)
        if want == ("decode", "prefill"):
            prefill, decode = prefill + 1, decode - 1
            assert why.startswith(("prefill: queued prompt tokens", "prefill: TTFT p90"))
        elif want == ("prefill", "decode"):
            prefill, decode = prefill - 1, decode + 1
            assert why.startswith(("decode: KV utilization", "decode: TPOT p90", "prefill: no prompt backlog")) \
                or why.startswith("decode: ") and "waiting for admission" in why
        sizes.append((prefill, decode))
    return sizes


def test_a_prompt_backlog_with_idle_decode_moves_decode_workers_to_prefill_one_at_a_time_down_to_min():
    sizes = replay([BUSY_PREFILL] * 30)
    assert sizes[4] == (2, 2) and sizes[5] == (3, 1)  # held 5 s before the first switch
    assert sizes[-1] == (3, 1)  # min_decode: the last decode worker stays


def test_full_decode_memory_with_no_prompt_backlog_moves_prefill_workers_to_decode():
    sizes = replay([BUSY_DECODE] * 30, prefill=3, decode=1)
    assert sizes[5] == (2, 2) and sizes[10] == (2, 2) and sizes[11] == (1, 3) and sizes[-1] == (1, 3)


def test_both_pools_busy_or_in_the_dead_band_switch_nothing():
    both = ({"queued_prompt_tokens": 50_000}, {"kv_utilization": 0.95})
    assert set(replay([both] * 30)) == {(2, 2)}
    between = ({"queued_prompt_tokens": 500, "ttft_p90_s": 1.5}, {"kv_utilization": 0.5})  # neither up nor idle
    assert set(replay([between] * 30)) == {(2, 2)}


def test_an_idle_prefill_pool_moves_its_workers_to_decode_down_to_min():
    idle = ({"ttft_p90_s": 0.2}, {"kv_utilization": 0.5})
    sizes = replay([idle] * 60, prefill=3, decode=1)
    assert sizes[19] == (3, 1) and sizes[20] == (2, 2)  # idle_delay_s, longer than switch_delay_s
    assert sizes[40] == (2, 2) and sizes[41] == (1, 3) and sizes[-1] == (1, 3)
    history = _history([idle] * 60, prefill=3, decode=1)
    assert all("prefill: no prompt backlog" in h for h in history)
    # each says how long its want held: the first from the trace's start, the next from the
    # switch before it (where the want broke off)
    assert [h.rsplit("(", 1)[1] for h in history] == ["wanted for 20 s)", "wanted for 20 s)"]


def test_an_idle_prefill_pool_keeps_its_worker_while_decode_is_idle_too():
    both_idle = ({"ttft_p90_s": 0.2}, {"kv_utilization": 0.1, "tpot_p90_s": 0.05})
    assert set(replay([both_idle] * 60, prefill=1, decode=1, cfg=CFG0)) == {(1, 1)}
    # decode's TPOT over 0.7x target (its batch, no prompt backlog anywhere): the worker goes
    busy_batch = ({"ttft_p90_s": 0.2}, {"kv_utilization": 0.1, "tpot_p90_s": 0.09})
    sizes = replay([busy_batch] * 30, prefill=1, decode=1, cfg=CFG0)
    assert sizes[19] == (1, 1) and sizes[20] == (0, 2) and sizes[-1] == (0, 2)


def test_a_pause_between_prompt_bursts_keeps_the_prefill_worker():
    burst, pause = BUSY_PREFILL, ({"ttft_p90_s": 0.2}, {"kv_utilization": 0.2})
    trace = ([burst] * 10 + [pause] * 15) * 4
    assert set(replay(trace, prefill=1, decode=2)[10:]) == {(2, 1)}


def _history(trace, prefill=2, decode=2):
    state = RoleState()
    for i, (p, d) in enumerate(trace):
        want, _ = decide(float(i), Signals(workers=prefill, **p), Signals(workers=decode, **d), P, D, CFG, state)
        if want is not None:
            prefill, decode = (prefill + 1, decode - 1) if want[1] == "prefill" else (prefill - 1, decode + 1)
    return state.history


def test_a_want_that_breaks_before_the_delay_switches_nothing():
    trace = [BUSY_PREFILL if (i // 3) % 2 else BUSY_DECODE for i in range(120)]
    assert set(replay(trace)) == {(2, 2)}


def test_a_phase_shifting_load_moves_workers_there_and_back():
    sizes = replay([BUSY_PREFILL] * 20 + [BUSY_DECODE] * 40, prefill=1, decode=3)
    assert sizes[19] == (3, 1)  # prompt-heavy: two decode workers became prefill workers
    assert sizes[-1] == (1, 3)  # decode-heavy: back, down to min_prefill


def test_minimums_hold_whatever_the_load():
    cfg = RolesConfig(switch_delay_s=1, min_prefill=2, min_decode=2)
    assert set(replay([BUSY_PREFILL] * 20, cfg=cfg)) == {(2, 2)}
    assert set(replay([BUSY_DECODE] * 20, cfg=cfg)) == {(2, 2)}


def test_tpot_over_target_from_prompt_stalls_does_not_hold_a_worker_in_decode():
    """Decode workers that prefill (no prefill worker left) see TPOT over target from the
    prompts' stalls: that is no reason to keep them decoding; a prompt backlog moves one."""
    stalls = ({"queued_prompt_tokens": 50_000}, {"kv_utilization": 0.2, "tpot_p90_s": 0.5})
    cfg = RolesConfig(switch_delay_s=5, min_prefill=0, min_decode=1)
    assert replay([stalls] * 10, prefill=0, decode=2, cfg=cfg)[-1] == (1, 1)


def test_min_prefill_zero_lets_the_last_prefill_worker_decode():
    cfg = RolesConfig(switch_delay_s=5, min_prefill=0, min_decode=1)
    assert replay([BUSY_DECODE] * 10, prefill=1, decode=1, cfg=cfg)[-1] == (0, 2)
    assert replay([BUSY_DECODE] * 10, prefill=1, decode=1)[-1] == (1, 1)  # the default keeps one


# ---- issue 44: the decision's inputs (bugs 3 and 8) ------------------------------------------
def test_decode_tpot_over_target_with_a_prefill_pool_gains_a_decode_worker():
    """A steady trickle of long prompts keeps the prefill pool from being idle (a queue at
    each decision, TTFT in the dead band) while decode's batch runs over its TPOT target:
    with a prefill pool taking the prompts, the slow steps are the batch's, and a prefill
    worker moves to decode."""
    trickle = ({"queued_prompt_tokens": 500, "ttft_p90_s": 1.5}, {"kv_utilization": 0.5, "tpot_p90_s": 0.3})
    sizes = replay([trickle] * 30, prefill=2, decode=1)
    assert sizes[4] == (2, 1) and sizes[5] == (1, 2) and sizes[-1] == (1, 2)  # min_prefill stays


def test_max_per_role_holds_whatever_the_load():
    cfg = dataclasses.replace(CFG, max_prefill=2, max_decode=3)
    assert set(replay([BUSY_PREFILL] * 30, prefill=2, decode=2, cfg=cfg)) == {(2, 2)}
    sizes = replay([BUSY_DECODE] * 60, prefill=3, decode=1, cfg=dataclasses.replace(cfg, max_prefill=None))
    assert sizes[-1] == (1, 3)  # (min_prefill would allow (1, 3) anyway; max_decode 3 stops at 3)
    sizes = replay([BUSY_DECODE] * 60, prefill=3, decode=1, cfg=dataclasses.replace(CFG, max_decode=2))
    assert sizes[-1] == (2, 2)


def test_a_decode_worker_goes_to_prefill_only_if_the_rest_hold_the_kv_in_use():
    """Decode's headroom: at 60% KV over two workers, one alone would hold 120%: moving it to
    prefill only turns the want around. At 30% the other holds it at 60%."""
    tight = ({"queued_prompt_tokens": 50_000}, {"kv_utilization": 0.6})
    assert set(replay([tight] * 30, prefill=1, decode=2)) == {(1, 2)}
    roomy = ({"queued_prompt_tokens": 50_000}, {"kv_utilization": 0.3})
    assert replay([roomy] * 30, prefill=1, decode=2)[-1] == (2, 1)


def test_max_per_role_is_read_from_the_config_and_checked():
    import pytest

    from router.config import ConfigError, load_config
    cfg = load_config(None, {"mode": "adaptive", "roles.max_prefill": 3, "roles.max_decode": None})
    assert (cfg.roles.max_prefill, cfg.roles.max_decode) == (3, None)
    with pytest.raises(ConfigError, match="roles.max_decode"):
        load_config(None, {"roles.max_decode": 0})
    with pytest.raises(ConfigError, match="min_prefill 2 > max_prefill 1"):
        load_config(None, {"roles.min_prefill": 2, "roles.max_prefill": 1})


def test_requests_waiting_for_decode_admission_are_decode_s_want_not_a_ttft_miss_of_prefill():
    """Requests held in the router's admission queue (no decode KV for them) get their first
    token late: the TTFT p90 is over target while the prefill pool has no backlog. That miss
    is the decode pool's shortage, and it must not cancel the decode pool's want (both wanting
    was "no change": measured in the simulator on the phase load, 16 workers, 15 prefill : 1
    decode through the whole decode-heavy half)."""
    starved = ({"ttft_p90_s": 6.0, "awaiting_first_token": 3},
               {"kv_utilization": 0.7, "waiting_admission": 16})
    sizes = replay([starved] * 30, prefill=3, decode=1)
    assert sizes[4] == (3, 1) and sizes[5] == (2, 2) and sizes[-1] == (1, 3)
    history = _history([starved] * 30, prefill=3, decode=1)
    assert history and all("waiting for admission" in h for h in history)
    # a real prompt backlog as well: both pools short, no change (as before)
    both = ({"ttft_p90_s": 6.0, "queued_prompt_tokens": 50_000}, {"kv_utilization": 0.7, "waiting_admission": 16})
    assert set(replay([both] * 30, prefill=3, decode=1)) == {(3, 1)}


def test_both_pools_late_by_latency_alone_the_one_further_over_its_target_gains_the_worker():
    """No request waits for decode memory; the prompts' TTFT and the streams' TPOT are both
    over target: the larger excess wins (it was "no change", a prompt backlog of minutes
    behind streams 1.3x over theirs)."""
    docs = ({"ttft_p90_s": 60.0, "queued_prompt_tokens": 500}, {"kv_utilization": 0.2, "tpot_p90_s": 0.13})
    assert replay([docs] * 12, prefill=1, decode=3)[-1] == (3, 1)
    streams = ({"ttft_p90_s": 2.4, "queued_prompt_tokens": 500}, {"kv_utilization": 0.2, "tpot_p90_s": 0.5})
    assert replay([streams] * 12, prefill=3, decode=1)[-1] == (1, 3)
    # within the margin (TTFT 1.6x its target, TPOT 1.3x): no change, not one worker to and fro
    close = ({"ttft_p90_s": 3.2, "queued_prompt_tokens": 500}, {"kv_utilization": 0.2, "tpot_p90_s": 0.13})
    assert set(replay([close] * 30, prefill=2, decode=2)) == {(2, 2)}


def test_while_workers_drain_more_go_the_same_way_counted_in_the_pool_they_join():
    """A decode worker drains its streams before it prefills (a minute of long answers): more
    may follow the same way meanwhile, each counted where it goes; the other way waits until
    they have joined; a worker retiring (the autoscaler's) holds every decision."""
    from router.roles import decide_moving
    p, d = Signals(workers=1, queued_prompt_tokens=50_000), Signals(workers=3, kv_utilization=0.2)
    state = RoleState()
    assert decide_moving(0.0, p, d, ["prefill"], P, D, CFG, state) == (None, "")  # (the want starts)
    want, why = decide_moving(5.0, p, d, ["prefill"], P, D, CFG, state)
    assert want == ("decode", "prefill") and "queued prompt tokens 25000/worker" in why  # 2 counted
    # max_prefill counts the one on its way
    capped = dataclasses.replace(CFG, max_prefill=2)
    state = RoleState()
    assert all(decide_moving(t, p, d, ["prefill"], P, D, capped, state)[0] is None for t in range(0, 30, 5))
    # the other way waits for the drain, and its want starts holding only then
    state = RoleState()
    full = Signals(workers=3, kv_utilization=0.95)
    assert all(decide_moving(t, Signals(workers=2), full, ["prefill"], P, D, CFG, state)[0] is None
               for t in range(0, 30, 5))
    assert decide_moving(30.0, Signals(workers=3), full, [], P, D, CFG, state)[0] is None
    assert decide_moving(35.0, Signals(workers=3), full, [], P, D, CFG, state)[0] == ("prefill", "decode")
    # while they drain, a want by latency alone moves no more (the signals do not show the
    # drain yet); a backlog does (above)
    late = Signals(workers=1, ttft_p90_s=60.0)
    state = RoleState()
    assert all(decide_moving(t, late, d, ["prefill"], P, D, CFG, state)[0] is None for t in range(0, 30, 5))
    assert decide_moving(30.0, late, d, [], P, D, CFG, state)[0] is None  # (it starts holding now)
    assert decide_moving(35.0, late, d, [], P, D, CFG, state)[0] == ("decode", "prefill")
    # a worker retiring: no decision at all, and a want held before it keeps holding
    state = RoleState()
    assert decide_moving(0.0, p, d, [], P, D, CFG, state)[0] is None
    assert all(decide_moving(t, p, d, [None], P, D, CFG, state)[0] is None for t in (1.0, 3.0))
    assert state.want == ("decode", "prefill") and state.since == 0.0
    assert decide_moving(5.0, p, d, [], P, D, CFG, state)[0] == ("decode", "prefill")
