"""Scheduler lifecycle with a fake runner: schedule -> fake forward -> update, then no leaks.

The fake runner keeps a fake paged KV store (slot -> token id). For every scheduled request it
checks that the slots of the already-computed tokens hold exactly the request's tokens (so a
prefix-cache hit or a recompute that went wrong shows up at once), writes the new tokens, and
samples a token that depends only on the request's token history, like a greedy model. So a
request must produce the same tokens however it was batched, chunked, cached or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.kv_cache import BlockManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, StepPlan, StepResult


def fake_token(token_ids: list[int]) -> int:
    """A deterministic "greedy model": the next token is a function of the history only."""
    h = 0
    for t in token_ids:
        h = (h * 31 + t + 1) % 1_000_003
    return h % 50 + 10


@dataclass
class FakeRunner:
    """Turns a StepPlan into a StepResult, checking the paged KV layout as a real runner needs it."""

    bm: BlockManager
    slots: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # slot -> (rid, pos, tok)
    steps: int = 0

    def slot(self, req: Request, pos: int) -> int:
        bs = self.bm.block_size
        return req.block_ids[pos // bs] * bs + pos % bs

    def __call__(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for s in plan.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            assert s.num_new_tokens >= 1 and end <= r.num_tokens
            assert len(r.block_ids) >= self.bm.blocks_needed(end), "blocks do not cover the step"
            tokens = r.all_token_ids
            for pos in range(start):  # the KV we attend to is this request's own prefix
                _, p, tok = self.slots[self.slot(r, pos)]
                assert (p, tok) == (pos, tokens[pos]), f"{r.request_id}: wrong KV at position {pos}"
            for pos in range(start, end):
                b = r.block_ids[pos // self.bm.block_size]
                assert self.bm.ref_count[b] == 1, "writing into a block another request shares"
                self.slots[self.slot(r, pos)] = (r.request_id, pos, tokens[pos])
            if s.samples:
                result.sampled[r.request_id] = [fake_token(tokens)]
        self.steps += 1
        return result


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_num_seqs: int = 16,
         chunked: bool = True, max_model_len: int = 10_000, prefix_caching: bool = True
         ) -> tuple[Scheduler, FakeRunner]:
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, bm, min(max_model_len, num_blocks * block_size)), FakeRunner(bm)


def req(rid: str, prompt: list[int], max_tokens: int = 8, eos: tuple[int, ...] = (),
        **sp: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, **sp),
                   eos_token_ids=eos)


def alone(r: Request, max_model_len: int = 10_000) -> tuple[list[int], str]:
    """What ``r`` generates on its own: the oracle every batched run must match."""
    sp = r.sampling_params
    tokens, out = list(r.prompt_token_ids), []
    while True:
        t = fake_token(tokens)
        tokens.append(t)
        out.append(t)
        if (not sp.ignore_eos and t in r.eos_token_ids) or t in sp.stop_token_ids:
            return out, "stop"
        if len(out) >= sp.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


def check(s: Scheduler) -> None:
    """Bookkeeping is consistent: each block's ref count is the number of requests holding it."""
    s.bm.check_invariants()
    held: dict[int, int] = {}
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        for b in r.block_ids:
            held[b] = held.get(b, 0) + 1
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_ids == []
    assert all(s.bm.ref_count[b] == held.get(b, 0) for b in range(s.bm.num_blocks))
    assert {r.request_id for r in s.running} | {r.request_id for r in s.waiting} == set(s.requests)
    assert len(s.running) + len(s.waiting) == len(s.requests)


def step(s: Scheduler, runner: FakeRunner) -> StepPlan:
    """One engine step, with the per-step rules checked."""
    was_running = [r.request_id for r in s.running]
    plan = s.schedule()
    cfg = s.config
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert len(s.running) <= cfg.max_num_seqs
    ids = [x.request.request_id for x in plan.scheduled]
    assert len(ids) == len(set(ids))
    # Running requests come first (in running order), newly admitted ones after them.
    old = [i for i in ids if i in was_running]
    assert ids[:len(old)] == old
    if plan.preempted:
        assert len(old) == len(ids), "admitted a request in a step that had to preempt"
    if s.requests:
        assert not plan.is_empty, "no progress: requests left but nothing scheduled"
    s.update(plan, runner(plan))
    check(s)
    return plan


def run(s: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[StepPlan]:
    plans = []
    while s.has_unfinished():
        assert len(plans) < max_steps, "scheduler did not finish"
        plans.append(step(s, runner))
    return plans


def assert_clean(s: Scheduler) -> None:
    """Nothing leaked: no request left, no block held."""
    check(s)
    assert not s.requests and not s.running and not s.waiting
    assert s.bm.num_used_blocks == 0


# ---- one request ---------------------------------------------------------------------------

def test_single_request_prefill_then_decode() -> None:
    s, runner = make()
    r = req("a", range(1, 11), max_tokens=5)
    s.add(r)
    plans = run(s, runner)
    assert [p.num_tokens for p in plans] == [10, 1, 1, 1, 1]
    assert (r.output_token_ids, r.finish_reason) == alone(r) == (r.output_token_ids, "length")
    assert r.num_output_tokens == 5 and r.status == RequestStatus.FINISHED_LENGTH
    assert r.block_ids == []
    assert_clean(s)


# ---- budget, ordering, chunking, seats -----------------------------------------------------

def test_budget_respected_and_running_go_first() -> None:
    s, runner = make(budget=16)
    rs = [req(f"r{i}", [i + 1] * 10, max_tokens=6) for i in range(5)]
    for r in rs:
        s.add(r)
    first = step(s, runner)
    # r0 gets its whole prompt, r1 the 6 tokens left of the budget (chunked).
    assert [(x.request.request_id, x.num_new_tokens) for x in first.scheduled] == [("r0", 10), ("r1", 6)]
    second = step(s, runner)
    # The decode of r0 and the rest of r1's prompt before the next prompt.
    assert [(x.request.request_id, x.num_new_tokens) for x in second.scheduled][:2] == [("r0", 1), ("r1", 4)]
    assert second.num_tokens == 16
    run(s, runner)
    for r in rs:
        assert (r.output_token_ids, r.finish_reason) == alone(r)
    assert_clean(s)


def test_chunked_prefill_keeps_decodes_going() -> None:
    s, runner = make(budget=8)
    d = req("decode", [5, 6, 7], max_tokens=20)
    s.add(d)
    step(s, runner)
    assert d.num_output_tokens == 1
    long = req("long", list(range(100, 130)), max_tokens=2)
    s.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        before = d.num_output_tokens
        plan = step(s, runner)
        assert plan.scheduled[0].request is d and plan.scheduled[0].num_new_tokens == 1
        assert d.num_output_tokens == before + 1  # the decode never stalls behind the prompt
        chunks.append(plan.scheduled[1].num_new_tokens)
    assert chunks == [7, 7, 7, 7, 2]
    run(s, runner)
    for r in (d, long):
        assert (r.output_token_ids, r.finish_reason) == alone(r)
    assert_clean(s)


def test_chunked_prefill_off_keeps_long_prompt_waiting_until_it_fits() -> None:
    s, runner = make(budget=8, chunked=False)
    d = req("decode", [5, 6, 7], max_tokens=4)
    s.add(d)
    step(s, runner)
    p = req("prompt", list(range(100, 108)), max_tokens=2)  # 8 tokens: the whole budget
    s.add(p)
    while not d.is_finished:
        plan = step(s, runner)
        assert [x.request for x in plan.scheduled] == [d]  # 1 + 8 > 8: the prompt waits whole
        assert p.status == RequestStatus.WAITING and p.num_computed_tokens == 0 and p.block_ids == []
    plan = step(s, runner)
    assert [(x.request.request_id, x.num_new_tokens) for x in plan.scheduled] == [("prompt", 8)]
    run(s, runner)
    assert (p.output_token_ids, p.finish_reason) == alone(p)
    assert_clean(s)


def test_max_num_seqs_respected() -> None:
    s, runner = make(max_num_seqs=2)
    rs = [req(f"r{i}", [i + 1, 2, 3], max_tokens=3 + i) for i in range(4)]
    for r in rs:
        s.add(r)
    first = step(s, runner)
    assert [x.request for x in first.scheduled] == rs[:2]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    seen_running = set()
    for plan in run(s, runner):
        assert len(plan.scheduled) <= 2
        seen_running |= {x.request.request_id for x in plan.scheduled}
    assert seen_running == {"r0", "r1", "r2", "r3"}
    # r2 could only start once r0 (the shortest of the first two) finished.
    for r in rs:
        assert (r.output_token_ids, r.finish_reason) == alone(r)
    assert_clean(s)


# ---- prefix cache --------------------------------------------------------------------------

def test_prefix_cache_hit_after_first_request_finished() -> None:
    s, runner = make(block_size=4)
    shared = list(range(1, 17))  # four full blocks
    a = req("a", shared + [90, 91], max_tokens=3)
    s.add(a)
    run(s, runner)
    b = req("b", shared + [70, 71, 72], max_tokens=3)
    s.add(b)
    plan = step(s, runner)
    assert b.num_cached_tokens == 16
    assert [(x.request, x.num_new_tokens) for x in plan.scheduled] == [(b, 3)]
    run(s, runner)
    assert (b.output_token_ids, b.finish_reason) == alone(b)
    assert_clean(s)


def test_prefix_cache_hit_shares_blocks_with_running_request() -> None:
    s, runner = make(block_size=4)
    shared = list(range(1, 9))
    a = req("a", shared + [50], max_tokens=10)
    s.add(a)
    step(s, runner)
    b = req("b", shared + [60, 61], max_tokens=4)
    s.add(b)
    plan = step(s, runner)
    assert b.num_cached_tokens == 8 and plan.scheduled[-1].num_new_tokens == 2
    assert b.block_ids[:2] == a.block_ids[:2]
    assert all(s.bm.ref_count[x] == 2 for x in b.block_ids[:2])
    run(s, runner)
    for r in (a, b):
        assert (r.output_token_ids, r.finish_reason) == alone(r)
    assert_clean(s)


def test_identical_prompt_never_fully_cached() -> None:
    s, runner = make(block_size=4)
    prompt = list(range(1, 9))  # exactly two blocks
    a = req("a", prompt, max_tokens=2)
    s.add(a)
    run(s, runner)
    b = req("b", prompt, max_tokens=2)
    s.add(b)
    plan = step(s, runner)
    # One token must still be computed: its logits pick the first output token.
    assert b.num_cached_tokens == 4 and plan.scheduled[0].num_new_tokens == 4
    run(s, runner)
    assert b.output_token_ids == a.output_token_ids
    assert_clean(s)


# ---- preemption ----------------------------------------------------------------------------

@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempt_newest_by_recompute_when_blocks_run_out(prefix_caching: bool) -> None:
    # 6 blocks of 4 = 24 token slots; each request alone needs up to 20.
    s, runner = make(num_blocks=6, block_size=4, prefix_caching=prefix_caching)
    a = req("a", list(range(1, 9)), max_tokens=12)
    b = req("b", list(range(21, 29)), max_tokens=12)
    s.add(a)
    s.add(b)
    step(s, runner)
    c = req("c", [7, 7, 7], max_tokens=2)
    s.add(c)  # waits behind: no blocks left for it yet

    preempting = None
    for _ in range(30):
        plan = step(s, runner)
        if plan.preempted:
            preempting = plan
            break
    assert preempting is not None, "never ran out of blocks"
    assert preempting.preempted == ["b"]  # newest first
    assert [x.request for x in preempting.scheduled] == [a]
    assert list(s.waiting)[0] is b  # front of the queue, ahead of c
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and b.num_output_tokens > 0

    run(s, runner)
    for r in (a, b, c):
        assert (r.output_token_ids, r.finish_reason) == alone(r)
    assert_clean(s)


def test_step_that_preempts_admits_nothing() -> None:
    # b frees two blocks, a takes one: a 2-token chunk of b would fit the rest, but memory is
    # short, so b must wait a step rather than be thrashed straight back in.
    s, runner = make(num_blocks=4, block_size=2, budget=3, prefix_caching=False)
    a = req("a", [1, 2], max_tokens=6)
    b = req("b", [3, 4], max_tokens=6)
    s.add(a)
    s.add(b)
    plans = run(s, runner)
    preempting = [p for p in plans if p.preempted]
    assert preempting
    for p in preempting:
        assert [(x.request.request_id, x.num_new_tokens) for x in p.scheduled] == [("a", 1)]
    for r in (a, b):
        assert (r.output_token_ids, r.finish_reason) == alone(r)
    assert_clean(s)


def test_preempted_request_longer_than_budget_is_not_stuck_without_chunking() -> None:
    # Chunked prefill off, so a prompt must fit the budget; a preempted request recomputes its
    # prompt plus outputs, which can be more than the budget. It must still finish.
    s, runner = make(num_blocks=6, block_size=2, budget=6, chunked=False, prefix_caching=False)
    a = req("a", [1, 2, 3], max_tokens=9)
    b = req("b", [4, 5, 6], max_tokens=9)
    s.add(a)
    s.add(b)
    plans = run(s, runner, max_steps=100)
    assert any(p.preempted for p in plans)
    for r in (a, b):
        assert (r.output_token_ids, r.finish_reason) == alone(r)
    assert_clean(s)


# ---- abort ---------------------------------------------------------------------------------

def test_abort_waiting_and_running_frees_blocks() -> None:
    s, runner = make(budget=8)
    a = req("a", [1, 2, 3, 4, 5], max_tokens=10)
    b = req("b", list(range(10, 30)), max_tokens=10)  # chunked: running, mid-prompt
    c = req("c", [9, 9], max_tokens=10)  # still waiting
    for r in (a, b, c):
        s.add(r)
    step(s, runner)
    assert a.status == b.status == RequestStatus.RUNNING and c.status == RequestStatus.WAITING
    assert b.block_ids
    assert s.abort("b") is b
    assert s.abort("c") is c
    assert s.abort("nope") is None
    assert s.abort("b") is None  # already gone
    for r in (b, c):
        assert r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
        assert r.block_ids == []
    check(s)
    assert [x.request_id for x in s.running] == ["a"] and not s.waiting
    assert s.bm.num_used_blocks == len(a.block_ids)
    run(s, runner)
    assert (a.output_token_ids, a.finish_reason) == alone(a)
    assert_clean(s)


def test_abort_while_step_runs_is_ignored_by_update() -> None:
    s, runner = make()
    a = req("a", [1, 2, 3], max_tokens=5)
    b = req("b", [4, 5, 6], max_tokens=5)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    result = runner(plan)
    s.abort("a")  # the client went away while the forward ran
    touched = s.update(plan, result)
    assert touched == [b]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    check(s)
    run(s, runner)
    assert_clean(s)


# ---- stopping ------------------------------------------------------------------------------

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def reference_tokens(n: int = 12) -> list[int]:
    out, _ = alone(req("ref", PROMPT, max_tokens=n))
    return out


def test_stop_on_eos() -> None:
    ref = reference_tokens()
    eos = ref[3]
    s, runner = make()
    r = req("a", PROMPT, max_tokens=12, eos=(eos,))
    s.add(r)
    run(s, runner)
    assert r.output_token_ids == ref[:ref.index(eos) + 1]
    assert r.finish_reason == "stop" and r.output_token_ids[-1] == eos
    assert_clean(s)


def test_ignore_eos_runs_to_max_tokens() -> None:
    ref = reference_tokens()
    s, runner = make()
    r = req("a", PROMPT, max_tokens=12, eos=(ref[0],), ignore_eos=True)
    s.add(r)
    run(s, runner)
    assert r.output_token_ids == ref and r.finish_reason == "length"
    assert_clean(s)


def test_stop_on_stop_token_ids() -> None:
    ref = reference_tokens()
    stop = ref[5]
    s, runner = make()
    r = req("a", PROMPT, max_tokens=12, stop_token_ids=[stop])
    s.add(r)
    run(s, runner)
    assert r.output_token_ids == ref[:ref.index(stop) + 1] and r.finish_reason == "stop"
    assert_clean(s)


def test_stop_on_max_tokens() -> None:
    s, runner = make()
    r = req("a", PROMPT, max_tokens=4)
    s.add(r)
    run(s, runner)
    assert r.output_token_ids == reference_tokens()[:4] and r.finish_reason == "length"
    assert_clean(s)


def test_stop_on_max_model_len() -> None:
    s, runner = make(max_model_len=len(PROMPT) + 3)
    r = req("a", PROMPT, max_tokens=100)
    s.add(r)
    run(s, runner)
    assert r.num_tokens == len(PROMPT) + 3
    assert r.output_token_ids == reference_tokens()[:3] and r.finish_reason == "length"
    assert_clean(s)


def test_eos_before_max_tokens_on_the_same_token_reports_stop() -> None:
    ref = reference_tokens()
    s, runner = make()
    r = req("a", PROMPT, max_tokens=1, eos=(ref[0],))
    s.add(r)
    run(s, runner)
    assert r.output_token_ids == ref[:1] and r.finish_reason == "stop"
    assert_clean(s)


# ---- random workloads ----------------------------------------------------------------------

# A request: (shared prefix index, extra prompt tokens, max_tokens, variant).
REQUESTS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14), st.integers(1, 16), st.booleans()),
                    min_size=2, max_size=8)
# Interleaving: add the next request, run some steps, or abort a live request.
OPS = st.lists(st.one_of(st.just(("add",)), st.tuples(st.just("step"), st.integers(1, 6)),
                         st.tuples(st.just("abort"), st.integers(0, 50))),
               max_size=30)
# A few shared prefixes so the prefix cache gets hits.
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5] * 8]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=REQUESTS, ops=OPS, num_blocks=st.integers(4, 10), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(3, 20), max_num_seqs=st.integers(1, 5), chunked=st.booleans(),
       prefix_caching=st.booleans(), eos=st.sampled_from([(), (10,), (33, 47)]))
def test_random_workload_matches_running_alone(reqs: list[tuple], ops: list[tuple], num_blocks: int,
                                               block_size: int, budget: int, max_num_seqs: int,
                                               chunked: bool, prefix_caching: bool,
                                               eos: tuple[int, ...]) -> None:
    s, runner = make(num_blocks=num_blocks, block_size=block_size, budget=budget,
                     max_num_seqs=max_num_seqs, chunked=chunked, prefix_caching=prefix_caching)
    max_len = s.max_model_len
    pending = list(reqs)
    added: list[Request] = []
    aborted: set[str] = set()

    def add() -> None:
        pre, extra, max_tokens, alt = pending.pop(0)
        n = len(added)
        prompt = PREFIXES[pre] + [20 + (n + i) % 7 + alt for i in range(extra)]
        # The engine refuses prompts that leave no room to generate, or exceed the budget unchunked.
        prompt = prompt[:max_len - 1]
        if not chunked:
            prompt = prompt[:budget]
        r = req(f"r{n}", prompt, max_tokens=max_tokens, eos=eos)
        s.add(r)
        added.append(r)

    for op in ops:
        if op[0] == "add" and pending:
            add()
        elif op[0] == "step":
            for _ in range(op[1]):
                if s.has_unfinished():
                    step(s, runner)
        elif op[0] == "abort" and s.requests:
            live = sorted(s.requests)
            rid = live[op[1] % len(live)]
            assert s.abort(rid).status == RequestStatus.FINISHED_ABORTED
            aborted.add(rid)
            check(s)
    while pending:
        add()
    run(s, runner, max_steps=2000)

    assert_clean(s)
    for r in added:
        assert r.is_finished
        ref = alone(r, max_len)
        if r.request_id in aborted:
            assert r.output_token_ids == ref[0][:r.num_output_tokens]  # cut short, never wrong
        else:
            assert (r.output_token_ids, r.finish_reason) == ref


def _drain(s, bm, limit: int = 200) -> None:
    """Step with a trivial runner until nothing is left; every step must make progress."""
    for _ in range(limit):
        if not s.has_work():
            break
        plan = s.schedule()
        assert not plan.is_empty, "schedule() returned nothing while work remains"
        s.update(plan, StepResult({x.request.request_id: [9] for x in plan.scheduled if x.samples}))
    assert not s.has_unfinished() and bm.num_used_blocks == 0
    bm.check_invariants()


def test_remote_kv_requests_never_deadlock_the_decode_side():
    # Two remote prompts that exactly fill a block each: the +1 reservation keeps the second out.
    bm = BlockManager(num_blocks=2, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, max_model_len=8)
    a = Request("A", [1, 2, 3, 4], SamplingParams(max_tokens=3))
    a.append_output_token(5)
    assert s.add_remote(a)
    b = Request("B", [1, 2, 3, 4], SamplingParams(max_tokens=3))
    assert not s.add_remote(b) and "B" not in s.requests  # "not now", nothing changed
    s.kv_arrived("A")
    _drain(s, bm)

    # A local request preempted behind remote requests that hold their KV while waiting.
    bm = BlockManager(num_blocks=6, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, max_model_len=16)
    local = Request("L", [1] * 7, SamplingParams(max_tokens=8, ignore_eos=True))
    s.add(local)
    s.update(s.schedule(), StepResult({"L": [9]}))
    for rid in "AB":
        r = Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=3))
        r.append_output_token(5)
        assert s.add_remote(r)
    for _ in range(3):
        plan = s.schedule()
        s.update(plan, StepResult({x.request.request_id: [9] for x in plan.scheduled if x.samples}))
    assert local.num_preemptions > 0  # it gave its blocks up while A and B hold theirs
    for rid in "AB":
        s.kv_arrived(rid)
    _drain(s, bm)
    assert local.num_output_tokens == 8
