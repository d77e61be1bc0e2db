"""The router's decisions in the simulator: the real policy functions, called as the router calls them.

Nothing here decides anything itself. ``place`` is one try of ``router/place.py``
(``Placer``): the same snapshot (``_view``: ``prefix_index.prefix_view`` over each pool, into a
``placement.PoolView``), the pure ``placement.plan`` for the answer (``Local`` / ``Remote`` /
``Wait``), then ``prefix_index.expect_prefix`` on the worker that prefills, as ``_local`` and
``_remote`` call it (the cluster records the prompt in the index once it commits the
placement, as the router does once the worker took the call). What is left out is what cannot
happen here: RPCs, their failures and deadlines, workers lost meanwhile.

``role_signals`` builds the two ``autoscale.Signals`` that ``autoscale.pool_signals`` builds
from a ``router.cluster_view.ClusterView`` (whose workers carry the workers' status messages:
not worth faking), with the latencies from the same ``autoscale.latency_p90s``, and
``roles.decide`` makes the decision.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bench.sim.workers import SimJob, SimWorker
from router.autoscale import Latency, PrefillTargets, Signals, latency_p90s
from router.holdings import Holdings
from router.placement import Demand, Local, PoolView, Remote, plan
from router.prefix_index import PrefixIndex, expect_prefix, prefix_view


@dataclass(frozen=True)
class RouterSettings:
    colocated: bool
    adaptive: bool = False
    prefix_aware: bool = True
    local_prefill_tokens: int = 0
    reserve_fraction: float = 1.0


@dataclass(frozen=True)
class Decision:
    """Where one attempt goes: decode (or colocated) worker, prefill worker (None: the decode
    worker prefills), where/why (``prefill_where``'s answer), blocks to reserve, index hit."""

    decode: str
    prefill: str | None
    where: str
    why: str
    need_blocks: int
    hit: int
    check: int | None  # local by a prefix believed cached there: the most it may compute (else a miss)


def _count(calls: dict | None, name: str) -> None:
    if calls is not None:
        calls[name] = calls.get(name, 0) + 1


def place(s: RouterSettings, index: PrefixIndex | None, workers: dict[str, SimWorker], job: SimJob,
          live: Holdings, missed: bool = False, calls: dict | None = None) -> Decision | None:
    """One placement try (module doc); None: no worker can take it now (the router queues it).

    ``live``: what the live jobs hold (router.holdings, kept by the cluster as the router's
    Placer keeps it); ``calls`` counts each real function called (tests read it)."""
    n, bs = job.prompt_tokens, next(iter(workers.values())).cost.block_size
    decode_view = not s.colocated and index is not None

    def pview(loads):
        if index is None:
            return loads, None
        index.prune(set(workers))
        _count(calls, "prefix_view")
        return prefix_view(index, live, loads, job.hashes, n, bs)

    roles = ("colocated",) if s.colocated else ("decode",)
    loads, prefix = [w.load() for w in workers.values() if w.role in roles], None
    if s.colocated:
        loads, prefix = pview(loads)
    elif decode_view:  # (the reported queues stay: prefill_where reads them)
        prefix = pview(loads)[1]
    prefill, prefill_prefix, pool_queued = [], None, None
    if not s.colocated:
        raw = [w.load() for w in workers.values() if w.role == "prefill"]
        pool_queued = min((w.queued_prompt_tokens for w in raw if w.accepting), default=None)
        prefill, prefill_prefix = pview(raw)
    no_pool = s.adaptive and not any(w.role == "prefill" and w.state == "ready" for w in workers.values())
    view = PoolView(s.colocated, loads, prefill, prefix, prefill_prefix, pool_queued, no_prefill_pool=no_pool,
                    reserve_fraction=s.reserve_fraction, local_prefill_tokens=s.local_prefill_tokens)
    _count(calls, "plan")
    step = plan(view, Demand(n, job.spec.max_tokens, missed=missed))
    hit = 0
    if isinstance(step, Local):
        if index is not None and (step.where == "colocated" or decode_view):
            _count(calls, "expect_prefix")
            hit = expect_prefix(index, job, step.decode, job.hashes, n, bs)
        return Decision(step.decode.worker_id, None, step.where, step.why, step.blocks, hit, step.check)
    if isinstance(step, Remote):
        if index is not None:
            _count(calls, "expect_prefix")
            hit = expect_prefix(index, job, step.prefill, job.hashes, n, bs)
        return Decision(step.decode.worker_id, step.prefill.worker_id, "pool", step.why, step.blocks, hit, None)
    return None


def role_signals(workers: dict[str, SimWorker], recent: Iterable[Latency], live_paces: list[float], waiting: int,
                 awaiting: list[tuple[float, int]], now: float, window_s: float,
                 targets: PrefillTargets) -> tuple[Signals, Signals]:
    """(prefill, decode) pool signals as ``autoscale.pool_signals`` and ``RoleController.step``
    compute them: ready workers; TTFT and TPOT p90 by ``autoscale.latency_p90s`` over the
    ``recent`` samples, the requests ``awaiting`` a first token ((waited s, prompt tokens)) and
    the running streams' paces; KV utilization; the router's admission queue; the prompt
    backlog at the prefill pool (at the decode workers once none is left)."""
    def pool(role_set):
        return [w for w in workers.values() if w.role in role_set and w.state == "ready"]
    pre, dec = pool(("prefill",)), pool(("decode", "colocated"))
    ttft, tpot = latency_p90s(recent, awaiting, live_paces, now, window_s, targets)
    kv_total = sum(w.total for w in dec)
    queued = sum(w.queued_tokens for w in (pre if pre else dec))
    s_p = Signals(workers=len(pre), queued_prompt_tokens=queued, ttft_p90_s=ttft,
                  awaiting_first_token=len(awaiting),
                  kv_utilization=sum(w.used for w in pre) / max(1, sum(w.total for w in pre)),
                  waiting_admission=waiting, tpot_p90_s=tpot)
    s_d = Signals(workers=len(dec), queued_prompt_tokens=sum(w.queued_tokens for w in dec),
                  ttft_p90_s=ttft, awaiting_first_token=len(awaiting),
                  kv_utilization=sum(w.used for w in dec) / kv_total if kv_total else 0.0,
                  waiting_admission=waiting, tpot_p90_s=tpot)
    return s_p, s_d
