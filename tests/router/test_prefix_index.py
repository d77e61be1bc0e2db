"""Prefix-aware placement: the router's estimate of cached prefixes (router.prefix_index) and
the scoring that uses it (router.placement), on synthetic loads."""

from __future__ import annotations

import random

from router.placement import PrefixView, WorkerLoad, admission_tokens, pick_decode, pick_prefill
from router.prefix_index import PrefixIndex, block_hashes

BS = 16


def view(cached=None, held=None, in_use=None) -> PrefixView:
    return PrefixView(cached or {}, held or {}, in_use or {})


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50000) for _ in range(n)]


def test_hashes_name_whole_prefixes_of_full_blocks():
    a = tokens(100, 1)
    assert len(block_hashes(a, BS)) == 6  # the partial 7th block is never shared
    b = a[:64] + tokens(36, 2)
    assert block_hashes(a, BS)[:4] == block_hashes(b, BS)[:4] and block_hashes(a, BS)[4] != block_hashes(b, BS)[4]
    # equal block contents after a different start: not the same prefix
    c = tokens(16, 3) + a[16:]
    assert block_hashes(c, BS)[1] != block_hashes(a, BS)[1]
    assert block_hashes(a, BS) == block_hashes(list(a), BS)  # deterministic


def test_hits_are_a_leading_run_and_capacity_evicts_least_recent():
    idx = PrefixIndex()
    sys_a, sys_b = tokens(64, 10), tokens(64, 11)
    idx.record("w0", block_hashes(sys_a + tokens(32, 12), BS), capacity_blocks=10)
    assert idx.hit_blocks("w0", block_hashes(sys_a + tokens(40, 13), BS)) == 4
    assert idx.hit_blocks("w1", block_hashes(sys_a, BS)) == 0
    # a prompt whose first block differs hits nothing, even if later blocks were seen
    assert idx.hit_blocks("w0", block_hashes(tokens(16, 14) + sys_a[16:], BS)) == 0
    idx.record("w0", block_hashes(sys_b, BS), capacity_blocks=10)  # 6 + 4 = 10 blocks: all kept
    assert idx.size("w0") == 10 and idx.hit_blocks("w0", block_hashes(sys_a, BS)) == 4
    idx.record("w0", block_hashes(sys_a, BS), capacity_blocks=10)  # sys_a now most recent
    idx.record("w0", block_hashes(tokens(48, 15), BS), capacity_blocks=10)  # 3 more: the oldest 3 go
    assert idx.size("w0") == 10
    assert idx.hit_blocks("w0", block_hashes(sys_a, BS)) == 4  # refreshed: kept
    # LRU order was tail(2), sys_b(4), sys_a(4): the tail and sys_b's first block went, and a
    # prefix without its first block is no hit at all
    assert idx.hit_blocks("w0", block_hashes(sys_b, BS)) == 0
    idx.forget("w0")
    assert idx.hit_blocks("w0", block_hashes(sys_a, BS)) == 0
    idx.record("w1", block_hashes(sys_a, BS), 10)
    idx.prune({"w2"})
    assert idx.size("w1") == 0


def prefill(wid, queued, free=1000):
    return WorkerLoad(wid, "prefill", free, 1000, BS, queued_prompt_tokens=queued)


def test_prefill_scored_by_tokens_it_would_compute():
    ws = [prefill("a", 0), prefill("b", 300)]
    # blind: the empty queue wins
    assert pick_prefill(ws, 1000).worker_id == "a"
    # b holds 800 of the prompt's 1000 tokens: 300 + 200 < 0 + 1000
    assert pick_prefill(ws, 1000, prefix=view(cached={"b": 800})).worker_id == "b"
    # until its queue costs more than computing the prompt elsewhere
    ws = [prefill("a", 0), prefill("b", 900)]
    assert pick_prefill(ws, 1000, prefix=view(cached={"b": 800})).worker_id == "a"
    # a cached count beyond the prompt (a stale estimate) never makes the cost negative
    assert pick_prefill([prefill("a", 0), prefill("b", 150)], 100, prefix=view(cached={"b": 10**6})).worker_id == "a"
    # a worker without room is never chosen for its cache
    assert pick_prefill([prefill("a", 0), prefill("b", 0, free=3)], 1000, prefix=view(cached={"b": 1000})).worker_id == "a"


def colocated(wid, free, queued=0, remaining=0):
    return WorkerLoad(wid, "colocated", free, 1000, BS, queued_prompt_tokens=queued,
                      remaining_decode_tokens=remaining)


def test_colocated_cost_before_headroom_but_it_must_fit():
    ws = [colocated("busy", free=300, remaining=2000), colocated("idle", free=900)]
    assert pick_decode(ws, 600, 64).worker_id == "idle"  # blind: headroom
    assert pick_decode(ws, 600, 64, prefix=view(cached={"busy": 592})).worker_id == "busy"
    # no room once its promised growth counts: the cache does not matter
    ws = [colocated("busy", free=300, remaining=4790), colocated("idle", free=900)]
    assert pick_decode(ws, 600, 64, prefix=view(cached={"busy": 592})).worker_id == "idle"
    # no hits anywhere: equal costs, headroom decides as before
    ws = [colocated("a", free=500), colocated("b", free=900)]
    assert pick_decode(ws, 100, 64, prefix=view(cached={})).worker_id == "b"


def test_prompts_cached_nowhere_spread_by_what_each_worker_holds():
    """Equal costs (no hit anywhere): the worker believed to cache less takes the new prefix,
    so distinct system prompts spread over the pool instead of evicting each other on one."""
    ws = [prefill("a", 0), prefill("b", 0)]
    assert pick_prefill(ws, 1000, prefix=view(cached={}, held={"a": 96})).worker_id == "b"
    cs = [colocated("a", free=900), colocated("b", free=900)]
    assert pick_decode(cs, 600, 64, prefix=view(cached={}, held={"a": 96, "b": 10})).worker_id == "b"
    # a hit still beats an empty worker
    assert pick_decode(cs, 600, 64, prefix=view(cached={"a": 592}, held={"a": 96, "b": 10})).worker_id == "a"


def test_blocks_live_requests_hold_are_not_reserved_again():
    """A colocated worker busy with prompts that share a system prompt: its free blocks cannot
    hold the whole prompt again, but the part its live requests hold is shared, so it still
    takes the prompt. A prefix only cached there sits in blocks the worker counts as free:
    taking it uses them up, so nothing is subtracted then."""
    ws = [colocated("holder", free=39), colocated("empty", free=900)]
    assert pick_decode(ws, 600, 32).worker_id == "empty"  # 632 tokens do not fit in 39 x 16 = 624
    assert pick_decode(ws, 600, 32, prefix=view(cached={"holder": 576})).worker_id == "empty"
    live = view(cached={"holder": 576}, in_use={"holder": 576})
    assert pick_decode(ws, 600, 32, prefix=live).worker_id == "holder"
    w = ws[0]
    assert admission_tokens(w, 600, 32, 1.0, live) == 600 - 576 + 32
    assert admission_tokens(w, 600, 32, 1.0, view(cached={"holder": 576})) == 600 + 32
    # a stale estimate: the prompt's last token is always computed, and max_tokens reserved
    assert admission_tokens(w, 600, 32, 1.0, view(in_use={"holder": 10**6})) == 1 + 32


def test_view_counts_only_what_waits_and_what_live_requests_hold():
    """prefix_view over the router's jobs: the queue is the uncached tokens of prompts still
    waiting for their first token; in_use is the prompt's leading blocks that running
    requests on a worker hold; hits stop before the prompt's last token."""
    from router.holdings import Holdings
    from router.jobs import Job, JobState
    from router.prefix_index import expect_prefix, prefix_view
    from engine.request import SamplingParams
    idx, live = PrefixIndex(), Holdings()
    system = tokens(64, 20)
    a = [colocated("a", free=900), colocated("b", free=900)]

    def job(rid, ids, worker):
        j = Job(rid, list(ids), SamplingParams(max_tokens=8))
        j.prefill_id = j.decode_id = worker
        j.state = JobState.RUNNING
        return j

    j1 = job("r1", system + tokens(20, 21), "a")
    assert expect_prefix(idx, j1, a[0], block_hashes(j1.prompt_ids, BS), len(j1.prompt_ids), BS) == 0
    idx.record("a", j1.prefix_hashes, 1000)  # (the placement succeeded: router.place records it)
    live.update(j1)
    prompt = system + tokens(16, 22)  # 80 tokens: 5 whole blocks, the engine looks up 4
    loads, v = prefix_view(idx, live, a, block_hashes(prompt, BS), len(prompt), BS)
    assert [w.queued_prompt_tokens for w in loads] == [84, 0]  # j1 waits for its first token
    assert v.cached == {"a": 64, "b": 0} and v.in_use == {"a": 64}
    j1.generated.append(7)  # its first token: no longer queued, still holding its blocks
    live.update(j1)
    loads, v = prefix_view(idx, live, a, block_hashes(prompt, BS), len(prompt), BS)
    assert [w.queued_prompt_tokens for w in loads] == [0, 0] and v.in_use == {"a": 64}
    j1.state = JobState.DONE  # ended: its blocks are only cached now
    live.update(j1)
    _, v = prefix_view(idx, live, a, block_hashes(prompt, BS), len(prompt), BS)
    assert v.in_use == {} and v.cached["a"] == 64
    whole = system  # exactly 4 blocks: 3 can be found cached
    _, v = prefix_view(idx, Holdings(), a, block_hashes(whole, BS), len(whole), BS)
    assert v.cached["a"] == 48


def test_a_decode_worker_caching_the_prefix_wins_by_at_most_its_length_in_headroom():
    """Disaggregated: a decode worker that caches the prompt's prefix is sent only the rest, so
    its cached tokens count as headroom; no more than that, so a popular prefix cannot draw
    every stream onto one worker. A running request there that holds the prefix shares it:
    the blocks are not reserved again, and that worker is scored as a disaggregated one."""
    from router.holdings import Holdings
    from router.jobs import Job, JobState
    from router.prefix_index import prefix_view
    from engine.request import SamplingParams

    def dec(wid, free):
        return WorkerLoad(wid, "decode", free, 1000, BS)
    near = [dec("holder", 500), dec("other", 520)]  # 320 tokens more headroom on "other"
    assert pick_decode(near, 600, 64).worker_id == "other"
    assert pick_decode(near, 600, 64, prefix=view(cached={"holder": 592})).worker_id == "holder"
    far = [dec("holder", 500), dec("other", 600)]  # 1,600 tokens more: more than the prefix is worth
    assert pick_decode(far, 600, 64, prefix=view(cached={"holder": 592})).worker_id == "other"

    idx, system = PrefixIndex(), tokens(64, 30)
    j = Job("r1", system + tokens(10, 31), SamplingParams(max_tokens=8))
    j.prefill_id, j.decode_id, j.state = "prefill-0", "holder", JobState.RUNNING
    j.prefix_hashes = block_hashes(j.prompt_ids, BS)
    idx.record("holder", j.prefix_hashes, 1000)
    prompt = system + tokens(20, 32)
    _, v = prefix_view(idx, Holdings.of([j]), near, block_hashes(prompt, BS), len(prompt), BS)
    assert v.in_use == {"prefill-0": 64}  # its KV is not at the decode worker before its first token
    j.generated.append(7)
    _, v = prefix_view(idx, Holdings.of([j]), near, block_hashes(prompt, BS), len(prompt), BS)
    assert v.in_use == {"prefill-0": 64, "holder": 64} and v.cached == {"holder": 64, "other": 0}
    assert admission_tokens(near[0], len(prompt), 64, 1.0, v) == len(prompt) - 64 + 64
    # held by a live request: in the headroom already, not counted twice
    held = [dec("holder", 500), dec("other", 504)]  # 64 tokens more headroom on "other"
    assert pick_decode(held, len(prompt), 64, prefix=v).worker_id == "other"  # 64 back, a tie: less held wins
    assert pick_decode(held, len(prompt), 64, prefix=view(cached={"holder": 64})).worker_id == "holder"
