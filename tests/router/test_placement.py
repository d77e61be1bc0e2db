"""Placement policy on synthetic cluster states."""

from __future__ import annotations

from router.placement import WorkerLoad, pick_decode, pick_prefill, prefill_where


def decode(wid, free, total=1000, remaining=0, accepting=True):
    return WorkerLoad(wid, "decode", free, total, 16, remaining_decode_tokens=remaining, accepting=accepting)


def prefill(wid, queued, free=1000):
    return WorkerLoad(wid, "prefill", free, 1000, 16, queued_prompt_tokens=queued)


def test_nearly_full_decode_worker_gets_no_new_work():
    ws = [decode("full", free=20, remaining=0), decode("roomy", free=600, remaining=3000)]
    assert pick_decode(ws, prompt_tokens=200, max_tokens=100).worker_id == "roomy"


def test_equal_memory_less_remaining_work_wins():
    ws = [decode("busy", free=500, remaining=2000), decode("idle", free=500, remaining=100)]
    assert pick_decode(ws, 100, 100).worker_id == "idle"
    ws = [decode("idle", free=500, remaining=100), decode("busy", free=500, remaining=2000)]
    assert pick_decode(ws, 100, 100).worker_id == "idle"  # not positional


def test_decode_none_when_nobody_can_reserve_and_reserve_fraction():
    ws = [decode("a", free=10), decode("b", free=12)]
    # 100 + 300 tokens need 25 blocks: nobody now; with a 10% reservation 9 blocks fit.
    assert pick_decode(ws, 100, 300) is None
    assert pick_decode(ws, 100, 300, reserve_fraction=0.1).worker_id == "b"


def test_draining_and_wrong_role_are_skipped():
    ws = [decode("drain", free=900, accepting=False), prefill("p", 0), decode("ok", free=100)]
    assert pick_decode(ws, 10, 10).worker_id == "ok"
    assert pick_prefill(ws, 10).worker_id == "p"


def test_prefill_least_queued_tokens_with_room_for_the_prompt():
    ws = [prefill("long-queue", 5000), prefill("short-queue", 100), prefill("no-room", 0, free=2)]
    assert pick_prefill(ws, 512).worker_id == "short-queue"
    assert pick_prefill([prefill("no-room", 0, free=2)], 512) is None
    # Ties on queued tokens go to more free memory.
    assert pick_prefill([prefill("x", 0, free=100), prefill("y", 0, free=900)], 64).worker_id == "y"


def test_not_round_robin_repeated_picks_follow_load():
    ws = [decode("a", free=900, remaining=0), decode("b", free=100, remaining=0)]
    assert {pick_decode(ws, 50, 50).worker_id for _ in range(5)} == {"a"}


def test_memory_promised_to_running_requests_is_not_free():
    # 100 free blocks = 1600 tokens, but the running requests may still generate 1500 of them.
    promised = decode("promised", free=100, remaining=1500)
    assert pick_decode([promised], 100, 100) is None
    assert pick_decode([promised], 100, 100, reserve_fraction=0.5).worker_id == "promised"
    assert pick_decode([promised, decode("other", free=20)], 100, 100).worker_id == "other"


def test_a_preferred_worker_wins_only_if_it_can_take_the_request():
    ws = [decode("roomy", free=900), decode("holder", free=100)]
    assert pick_decode(ws, 100, 100, prefer="holder").worker_id == "holder"
    assert pick_decode(ws, 100, 2000, prefer="holder").worker_id == "roomy"  # does not fit there
    assert pick_decode(ws, 100, 100, prefer="gone").worker_id == "roomy"
    ps = [prefill("idle", 0), prefill("holder", 4000), prefill("full", 0, free=2)]
    assert pick_prefill(ps, 512, prefer="holder").worker_id == "holder"
    assert pick_prefill(ps, 512, prefer="full").worker_id == "idle"


def test_prefill_where_keeps_short_prompts_on_their_decode_worker():
    d = WorkerLoad("d", "decode", 500, 1000, 16)
    assert prefill_where(40, d, local_tokens=0) == ("pool", "off")  # the default: every prompt to the pool
    assert prefill_where(64, d, local_tokens=64) == ("local", "short")
    assert prefill_where(65, d, local_tokens=64) == ("pool", "long")
    # a worker already prefilling a backlog locally: its streams would stall past twice the knob
    busy = WorkerLoad("d", "decode", 500, 1000, 16, queued_prompt_tokens=100)
    assert prefill_where(28, busy, local_tokens=64) == ("local", "short")  # 128 = 2 x 64: still allowed
    assert prefill_where(29, busy, local_tokens=64) == ("pool", "decode_busy")


def test_a_long_prompt_is_prefilled_by_an_idle_decode_worker_when_the_pool_has_a_queue():
    idle = WorkerLoad("d", "decode", 500, 1000, 16)
    streaming = WorkerLoad("d", "decode", 500, 1000, 16, remaining_decode_tokens=40)
    prefilling = WorkerLoad("d", "decode", 500, 1000, 16, queued_prompt_tokens=30)
    assert prefill_where(1500, idle, 64, pool_queued=800) == ("local", "pool_busy")
    assert prefill_where(1500, idle, 64, pool_queued=0) == ("pool", "long")  # the pool starts it at once
    assert prefill_where(1500, idle, 64, pool_queued=None) == ("pool", "long")
    assert prefill_where(1500, idle, 0, pool_queued=800) == ("pool", "off")
    # a stream there would stall for the whole prompt; a prompt there would wait for this one
    assert prefill_where(1500, streaming, 64, pool_queued=800) == ("pool", "long")
    assert prefill_where(1500, prefilling, 64, pool_queued=800) == ("pool", "long")


def test_the_decode_worker_with_the_shorter_local_prefill_queue_wins():
    ws = [WorkerLoad("roomy", "decode", 900, 1000, 16, queued_prompt_tokens=1500),
          WorkerLoad("free", "decode", 500, 1000, 16)]
    assert pick_decode(ws, 60, 64).worker_id == "free"
    ws = [WorkerLoad("roomy", "decode", 900, 1000, 16), WorkerLoad("free", "decode", 500, 1000, 16)]
    assert pick_decode(ws, 60, 64).worker_id == "roomy"  # no queues: headroom


def test_pending_calls_count_in_a_workers_queue_until_its_report_shows_them():
    """A submit that prefills on a worker is in its queue estimate from the moment the router
    makes the call, not only once a report shows it (placements in the round trip see it)."""
    from router.pools import Worker
    from worker.protocol import WorkerStatus
    w = Worker("decode-0", "decode", actor=None, state="ready")
    w.reported(_status(WorkerStatus, admitted=0, queued=10))
    w.calls, w.pending = 1, [(1, 4, 30)]  # what Pools.reserved(.., 4, prompt_tokens=30) records
    load = w.load()
    assert load.queued_prompt_tokens == 40 and load.free_blocks == 96
    w.reported(_status(WorkerStatus, admitted=1, queued=40))  # the worker took the call
    assert w.load().queued_prompt_tokens == 40 and w.load().free_blocks == 100


def _status(cls, admitted: int, queued: int):
    return cls(role="decode", incarnation="i", pid=1, kv_blocks_used=100, kv_blocks_total=200, block_size=16,
               queued_prompt_tokens=queued, admitted=admitted)


def test_a_reported_kv_address_replaces_the_published_one():
    """A decode worker whose UCX receiver replaced its worker reports its newest address: the
    router publishes that one from then on (new prefill workers dial it; older copies still
    reach the worker a while, kvtransfer/ucx_generation.py). A worker whose address was
    forgotten (lost) gets none back from a report: its bring-up asks for it."""
    import msgspec

    from router.pools import Worker
    from worker.protocol import WorkerStatus
    w = Worker("decode-0", "decode", actor=None, state="ready")
    w.address = "ucx://0000abcd/AAAA/p"
    w.reported(_status(WorkerStatus, admitted=0, queued=0))  # no address in it: kept
    assert w.address == "ucx://0000abcd/AAAA/p"
    w.reported(msgspec.structs.replace(_status(WorkerStatus, 0, 0), kv_address="ucx://0000abcd/BBBB/p/1"))
    assert w.address == "ucx://0000abcd/BBBB/p/1"
    w.address = None
    w.reported(msgspec.structs.replace(_status(WorkerStatus, 0, 0), kv_address="ucx://0000abcd/CCCC/p/2"))
    assert w.address is None


def test_an_idle_decode_worker_with_reservations_in_flight_takes_no_long_prompt():
    """Issue 44, bug 5: "idle" was the last report's, blind to the reservations made since
    (their KV, and their streams, are on the way there): a 1,536-token local prefill would stall
    them for seconds. Calls its reports do not show yet count against idleness."""
    from router.worker_state import Worker
    from worker.protocol import WorkerStatus
    w = Worker("d", "decode", actor=None, state="ready")
    w.reported(WorkerStatus("decode", "i", 1, kv_blocks_used=0, kv_blocks_total=1000,
                            block_size=16))
    assert prefill_where(1536, w.load(), 64, pool_queued=800) == ("local", "pool_busy")
    w.calls += 1
    w.pending.append((w.calls, 100, 0))  # a reserve made, not yet reported (Pools.reserved)
    assert prefill_where(1536, w.load(), 64, pool_queued=800) == ("pool", "long")
    assert w.load().in_flight == 1
    w.reported(WorkerStatus("decode", "i", 1, kv_blocks_used=100, kv_blocks_total=1000,
                            block_size=16, remaining_decode_tokens=64, admitted=1))
    assert w.load().in_flight == 0 and prefill_where(1536, w.load(), 64, pool_queued=800) == ("pool", "long")


def test_a_worker_at_its_max_num_seqs_takes_no_request_while_its_kv_has_room():
    """A decode worker whose running, waiting and in-flight requests reach its max_num_seqs is
    full whatever its free KV: the request waits in the router's queue, where per-token weights
    and priorities order it, not first-come in the worker's (issue 42's 3:1 check held 1:1 past
    max_num_seqs). A worker that reports no limit is judged by KV alone, as before."""
    from router.worker_state import Worker
    from worker.protocol import WorkerStatus
    w = Worker("d", "decode", actor=None, state="ready")
    w.reported(WorkerStatus("decode", "i", 1, kv_blocks_used=0, kv_blocks_total=1000, block_size=16,
                            running=6, waiting=1, max_num_seqs=8))
    assert w.load().free_seqs == 1
    assert pick_decode([w.load()], 32, 16) is not None
    w.calls += 1
    w.pending.append((w.calls, 3, 0))  # a reserve made there, not yet reported
    assert w.load().free_seqs == 0
    assert pick_decode([w.load()], 32, 16) is None
    w.reported(WorkerStatus("decode", "i", 1, kv_blocks_used=0, kv_blocks_total=1000, block_size=16,
                            running=8, waiting=0, max_num_seqs=0))  # an older worker: no limit reported
    assert w.load().free_seqs is None and pick_decode([w.load()], 32, 16) is not None
