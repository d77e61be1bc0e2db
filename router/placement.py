"""Placement: which prefill worker and which decode worker take a request.

Pure functions over a snapshot of worker loads, so the policy is unit-testable on synthetic
cluster states. Never round-robin:

- prefill: the worker with the fewest queued prompt tokens (its TTFT backlog), among those
  with room for the prompt's KV; ties go to more free memory.
- decode: among workers whose free KV, after the growth already promised to their running
  requests (the tokens they may still generate, times ``reserve_fraction``), still holds this
  request's prompt plus that share of ``max_tokens``, the one with the most of it left (the
  *projected headroom*). A nearly full worker loses; with equal memory the one with less work
  left wins; a worker whose memory is all promised takes nothing new.

Both take a ``prefer``red worker id (another choice of the same prompt, router.openai_http):
it wins if it can take the request at all, so that the prompt's blocks, in its prefix cache
by then, are shared instead of computed again.

Conditional disaggregation (``prefill_where``): in disaggregated mode a prompt whose uncached
part is short is prefilled by the decode worker chosen for it instead of the prefill pool: no
queue at the pool, no transfer, no second hop, at the price of that many prompt tokens computed
between the worker's decode steps (the bound on the stall its running streams see, so it is the
one knob: ``router.local_prefill_tokens``). A decode worker already holding a backlog of local
prompt tokens sends the next ones to the pool; an idle one (no stream, no queue, no
reservation on its way) takes a long prompt too while the pool has a queue.

Disaggregated, a decode worker that caches a prompt's prefix shares those blocks and is sent
only the rest (its ``reserve`` answers where the transfer starts); prefix-aware, its cached
tokens count as headroom when a decode worker is picked.

Prefix-aware (a ``PrefixView``, router.prefix_index): a worker that prefills is scored by the
prompt tokens it would actually compute, queued ones plus this prompt's uncached ones, so a
cached prefix draws its prompts until the queue there costs more than computing the prompt
elsewhere. A colocated worker still must fit the request; among equal costs more headroom
wins, then the worker believed to cache least (so distinct prefixes spread over idle workers
instead of evicting each other on one). It reserves no new blocks for the part of the prompt
that live requests there already hold (shared blocks); a prefix only cached, not in use,
sits in blocks the worker counts as free, and taking it uses them up. Without a view
(prefix-blind): as above.

``plan`` puts these together for one try of one request: over a ``PoolView`` (the router's
snapshot) and a ``Demand``, it answers ``Local`` (the decode or colocated worker prefills the
prompt itself), ``Remote`` (a prefill worker prefills it and sends the KV to the decode worker)
or ``Wait`` (no worker can take it now, or another waiting request goes first). The router
carries the answer out (router.place).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    """What the router knows of one worker (refreshed from the workers' status reports)."""

    worker_id: str
    role: str  # "prefill", "decode" or "colocated"
    free_blocks: int
    total_blocks: int
    block_size: int
    queued_prompt_tokens: int = 0  # prompt tokens waiting to be prefilled
    remaining_decode_tokens: int = 0  # sum over running requests of tokens still to generate
    accepting: bool = True  # False while starting, draining or dead
    in_flight: int = 0  # admitting calls (reserve, submit) made there that its reports do not show yet
    # requests it can still take before reaching its max_num_seqs (running, waiting and in flight
    # counted); None: not reported, no limit here
    free_seqs: int | None = None

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class PrefixView:
    """What prefix-aware placement knows of one prompt, per worker id (router.prefix_index)."""

    cached: Mapping[str, int]  # the prompt's tokens each likely holds in its prefix cache
    held: Mapping[str, int]  # blocks each is believed to cache, of every prompt
    in_use: Mapping[str, int]  # the prompt's tokens each holds in blocks of live requests there


def prefill_cost(w: WorkerLoad, prompt_tokens: int, prefix: PrefixView | None) -> int:
    """Prompt tokens ``w`` computes before this prompt's first token: its queue, plus the
    prompt's uncached part with a ``prefix`` view, else the queue alone (prefix-blind)."""
    if prefix is None:
        return w.queued_prompt_tokens
    return w.queued_prompt_tokens + prompt_tokens - min(prefix.cached.get(w.worker_id, 0), prompt_tokens)


def pick_prefill(workers: Sequence[WorkerLoad], prompt_tokens: int, prefer: str | None = None,
                 prefix: PrefixView | None = None) -> WorkerLoad | None:
    """Least prefill cost (``prefill_cost``) among workers with room for the prompt
    (``prefer`` first; then the least held); None if none can."""
    held = prefix.held if prefix is not None else {}
    ok = [w for w in workers if w.accepting and w.role in ("prefill", "colocated")
          and w.free_blocks >= w.blocks_for(prompt_tokens)]
    if not ok:
        return None
    return min(ok, key=lambda w: (w.worker_id != prefer, prefill_cost(w, prompt_tokens, prefix),
                                  held.get(w.worker_id, 0), -w.free_blocks, w.worker_id))


def admission_tokens(w: WorkerLoad, prompt_tokens: int, max_tokens: int, reserve_fraction: float,
                     prefix: PrefixView | None = None) -> int:
    """Tokens of new KV ``w`` must reserve for a request: its prompt and that share of
    ``max_tokens``, less the prompt's part that live requests there hold (shared blocks are
    not allocated again; counting them would turn a worker away from the prompts it is best
    at). A prefix merely cached is not subtracted: its blocks count as free there."""
    shared = min(prefix.in_use.get(w.worker_id, 0), prompt_tokens - 1) if prefix is not None else 0
    return prompt_tokens - max(0, shared) + int(round(reserve_fraction * max_tokens))


def pick_decode(workers: Sequence[WorkerLoad], prompt_tokens: int, max_tokens: int,
                reserve_fraction: float = 1.0, prefer: str | None = None,
                prefix: PrefixView | None = None) -> WorkerLoad | None:
    """Most projected headroom among workers that can reserve the request now.

    Args:
        workers: current loads.
        prompt_tokens: the request's prompt length (its KV arrives from prefill).
        max_tokens: the request's generation limit.
        reserve_fraction: share of ``max_tokens`` that must fit at admission (1.0: all of it;
            smaller admits more requests and relies on preemption if they all run long).
        prefer: a worker id that wins if it can take the request.
        prefix: prefix-aware placement. Colocated workers (they prefill too): the least
            prefill cost wins, then headroom, then the least held. Decode workers: headroom
            plus the prompt's tokens the worker caches (their KV is not sent again: a cached
            prefix is worth its length in headroom, no more, so one worker does not draw every
            stream of a popular prefix) (module doc).
    Returns:
        The chosen worker, or None when no worker can take the request now (the router
        queues it).
    """
    best, best_key = None, None
    for w in workers:
        if not (w.accepting and w.role in ("decode", "colocated")):
            continue
        if w.free_seqs is not None and w.free_seqs <= 0:  # full: the router's queue holds it
            continue
        need_tokens = admission_tokens(w, prompt_tokens, max_tokens, reserve_fraction, prefix)
        # Tokens still free once the running requests have grown by (the same share of) what
        # they may still generate: with reserve_fraction 1 no admitted request is ever preempted.
        promised = int(round(reserve_fraction * w.remaining_decode_tokens))
        headroom = w.free_blocks * w.block_size - promised - need_tokens
        if w.free_blocks < w.blocks_for(need_tokens) or headroom < 0:
            continue
        # A decode worker's queue is its local prefills' (conditional disaggregation, below): a
        # request placed there waits for them, and its prompt, if local too, stalls the
        # streams there longer; the worker with the shorter one wins among those that fit.
        cost, score = w.queued_prompt_tokens if w.role == "decode" else 0, headroom
        if prefix is not None and w.role == "colocated":
            cost = prefill_cost(w, prompt_tokens, prefix)
        elif prefix is not None:  # (the part live requests hold is in the headroom already)
            shared = min(prefix.in_use.get(w.worker_id, 0), prompt_tokens - 1)
            score += max(0, min(prefix.cached.get(w.worker_id, 0), prompt_tokens - 1) - shared)
        held = prefix.held.get(w.worker_id, 0) if prefix is not None else 0
        key = (w.worker_id != prefer, cost, -score, held, w.remaining_decode_tokens, w.worker_id)
        if best_key is None or key < best_key:
            best, best_key = w, key
    return best


def prefill_where(uncached_tokens: int, decode: WorkerLoad, local_tokens: int,
                  pool_queued: int | None = None) -> tuple[str, str]:
    """Where a disaggregated request's prompt is prefilled: ("pool" | "local", reason).

    ``local_tokens`` (``router.local_prefill_tokens``; 0: off) is the most uncached prompt
    tokens a decode worker prefills itself between its decode steps; ``pool_queued`` the
    prompt tokens the least busy prefill worker still has to compute (None: unknown). Reasons:

    - ``short`` (local): at most ``local_tokens``;
    - ``pool_busy`` (local): longer, but the decode worker is idle (no stream to stall, no
      prompt of its own queued, no admitting call on its way: a reservation made since its
      last report is a stream about to start there) while the pool has a queue: here it
      starts at once, with no wait, no transfer and no second hop; there it would wait for
      the queue;
    - ``off``, ``long`` (pool): more than ``local_tokens``, and the decode worker has streams
      (they would stall for the whole prompt) or the pool is free;
    - ``decode_busy`` (pool): the worker's queued prompt tokens plus these would pass twice
      the limit: its streams would stall for longer than the knob allows.

    (The router adds ``cache_miss``: local by a prefix the worker turned out not to hold.)
    """
    if local_tokens <= 0:
        return "pool", "off"
    if uncached_tokens > local_tokens:
        idle = decode.queued_prompt_tokens == 0 and decode.remaining_decode_tokens == 0 and not decode.in_flight
        if idle and pool_queued:
            return "local", "pool_busy"
        return "pool", "long"
    if decode.queued_prompt_tokens + uncached_tokens > 2 * local_tokens:
        return "pool", "decode_busy"
    return "local", "short"


@dataclass(frozen=True)
class Demand:
    """One request as placement sees it, for one try."""

    prompt_tokens: int
    max_tokens: int
    prefer: tuple[str, str] = ("", "")  # (prefill, decode) worker ids that win if they can take it
    missed: bool = False  # a decode worker did not hold the prefix the index said: the pool prefills it


@dataclass(frozen=True)
class PoolView:
    """What placement reads for one try: the router's snapshot of its pools."""

    colocated: bool
    decode: Sequence[WorkerLoad]  # decode (or colocated) workers; colocated prefix-aware: prefix_view's queues
    prefill: Sequence[WorkerLoad] = ()  # prefill workers (prefix-aware: prefix_view's queues)
    # Colocated: the prompt's prefix view over ``decode``; disaggregated: what the decode workers
    # cache (shared, not sent), None where they are not indexed
    decode_prefix: PrefixView | None = None
    prefill_prefix: PrefixView | None = None
    pool_queued: int | None = None  # the least busy accepting prefill worker's reported queue (None: none)
    no_prefill_pool: bool = False  # adaptive with no prefill worker: decode workers prefill their own prompts
    turn: bool = True  # the fair order (router.admission) lets this request try now
    reserve_fraction: float = 1.0
    local_prefill_tokens: int = 0  # router.local_prefill_tokens (prefill_where)


@dataclass(frozen=True)
class Local:
    """The decode (or colocated) worker prefills the prompt itself."""

    decode: WorkerLoad
    blocks: int  # KV blocks to reserve there
    where: str  # "colocated" or "local"
    why: str  # "" (colocated), a ``prefill_where`` reason, or "no_pool"
    check: int | None = None  # local by a prefix believed cached there: the worker checks it holds it


@dataclass(frozen=True)
class Remote:
    """A prefill worker prefills the prompt and sends its KV to the decode worker."""

    prefill: WorkerLoad
    decode: WorkerLoad
    blocks: int  # KV blocks to reserve on the decode worker
    why: str  # a ``prefill_where`` reason, or "cache_miss"


@dataclass(frozen=True)
class Wait:
    """No worker can take the request now (or another waiting one goes first): wait for a change."""


WAIT = Wait()


def plan(view: PoolView, job: Demand) -> Local | Remote | Wait:
    """Where one try of ``job`` goes (module docstring); pure."""
    n = job.prompt_tokens
    prefix = view.decode_prefix
    d = pick_decode(view.decode, n, job.max_tokens, view.reserve_fraction,
                    job.prefer[1] if view.colocated else None, prefix) if view.turn else None
    if d is None:
        return WAIT
    blocks = d.blocks_for(admission_tokens(d, n, job.max_tokens, view.reserve_fraction, prefix))
    if view.colocated:
        return Local(d, blocks, "colocated", "")
    # (from the prompt's part not cached on the decode worker)
    cached = min(prefix.cached.get(d.worker_id, 0), n - 1) if prefix is not None else 0
    where, why = ("local", "no_pool") if view.no_prefill_pool else ("pool", "cache_miss") if job.missed \
        else prefill_where(n - cached, d, view.local_prefill_tokens, view.pool_queued)
    if where == "local":
        return Local(d, blocks, where, why, view.local_prefill_tokens if why == "short" and cached else None)
    # No prefill worker has room now: the least loaded queues it in its own engine.
    p = pick_prefill(view.prefill, n, job.prefer[0], view.prefill_prefix) or min(
        (w for w in view.prefill if w.accepting), key=lambda w: w.queued_prompt_tokens, default=None)
    return WAIT if p is None else Remote(p, d, blocks, why)
