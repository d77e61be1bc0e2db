"""Which router a worker obeys (fencing by epoch), and when it gives up on it (the grace period).

Only the workers of a cluster with ``ha.enabled`` (router.config) have a fence: they are
detached actors that outlive the router that made them, and the next router adopts them
(router.ha). Each router start takes a new epoch, higher than every earlier one (router.ha
``next_epoch``). Every call a router makes carries its epoch (``WorkerActor.call``); the
worker checks it here, in one place::

    FOLLOWING epoch E ──a call of epoch E──► FOLLOWING (the grace clock restarts)
        │   a call of another epoch: FencedError (an older router is fenced off; a newer one adopts first)
        │   adopt(E' >= E) ──► FOLLOWING epoch E' (reports go to the new router's socket; its grace_s)
        └─ no call for grace_s ──► ORPHANED: every request aborted, every KV block freed, no
                                   report sent; each call is refused until ``adopt(E' >= E)``

Time spent in a step longer than a second does not count (the step loop's ``credit``): a
router's pings queue behind a call that waits for such a step, and a worker must not give up on
a live router because its own step was long. The grace period is what keeps a worker decoding
while its router restarts: the requests it holds keep running, and the router that adopts it
takes over those that decode (``Adopted.handover``: router.resume rebuilds them for their
clients); a router that never comes does not strand their blocks. An orphaned worker does not exit: the next router adopts it without reloading its model.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import msgspec

from engine.request import RequestStatus, SamplingParams
from worker.protocol import Key


# A request that ended here is handed over this long after (its router may have died before its
# last record arrived: ``Ended``): a takeover's 3-10 s, with room; at most ENDED_KEPT of them.
ENDED_KEEP_S, ENDED_KEPT = 30.0, 256


class FencedError(RuntimeError):
    """A router call refused by a worker's fence: an older epoch than the one it follows, one
    that did not adopt it, or any call while it is orphaned (only an adoption brings it back).

    Attributes:
        epoch: the caller's epoch.
        current: the epoch the worker follows.
        orphaned: the worker gave up on every router (the grace period passed).
    """

    def __init__(self, epoch: int, current: int, orphaned: bool = False) -> None:
        self.epoch, self.current, self.orphaned = epoch, current, orphaned
        if orphaned:
            why = "its router was gone past the grace period (ha.grace_s); adopt it again"
        elif epoch < current:
            why = f"a newer router (epoch {current}) adopted it: this router is fenced off"
        else:
            why = "this router has not adopted it yet"
        super().__init__(f"worker refused a call of router epoch {epoch} (it follows epoch {current}): {why}")

    def __reduce__(self):  # (Ray pickles it back to the caller with its fields)
        return FencedError, (self.epoch, self.current, self.orphaned)


class Handover(msgspec.Struct, frozen=True):
    """One request a worker decodes for a router that is gone, as the new router rebuilds it
    (router.resume): the attempt's inputs and every output token so far. Its key's request id
    is the old router's scoped id, which names the token that sent it (router.admin.scoped_id),
    so the new router hands it to that token alone; nothing else of the owner is kept."""

    key: Key
    prompt_ids: list[int]  # this attempt's prompt: after a re-run, the tail of it is ``params.resumed`` outputs
    output_ids: list[int]  # this attempt's output tokens so far (the first among them)
    params: SamplingParams  # this attempt's (max_tokens: what was left when it began)
    finish: str | None = None  # it ended here ("stop", "length": ``Ended``); None: it decodes still


def _handover(key: Key | None, r: Any, finish: str | None = None) -> Handover | None:
    """Engine request ``r`` as a new router can resume it, or None: a request of a router
    (``key``), a first token out, not the prefill side's copy, without logprobs (a resumed
    stream could not replay them)."""
    p = r.sampling_params
    if key is None or r.prefill_only or not r.output_token_ids or p.logprobs is not None \
            or p.prompt_logprobs is not None:
        return None
    return Handover(key, list(r.prompt_token_ids), list(r.output_token_ids), p, finish)


def handovers(engine_requests: dict, keys: dict[str, Key]) -> list[Handover]:
    """The requests of ``engine_requests`` (engine id -> engine Request) a new router can
    resume (``_handover``) that decode still (not finished, not waiting for their KV).
    ``keys``: engine id -> key (worker.requests)."""
    out = []
    for eid, r in engine_requests.items():
        if not r.is_finished and r.status != RequestStatus.WAITING_FOR_KV and (h := _handover(keys.get(eid), r)):
            out.append(h)
    return out


class Ended:
    """The requests that ended here lately (stop, length), as handovers with their finish.

    A request can end while no router hears: its last record goes to a router that died or
    stopped, and the adopting router never learns it ended (the old socket's queue is dropped
    at adoption). Handed over with its finish, the new router answers its client's Resume (or
    its retry under the same id) with the rest of the answer and the end, instead of "not found"
    and a run from the first token (bench/chaos router faults: OpenAI clients waited up to 125 s
    between new tokens, answers run again after each fault). One that its router did hear is
    rebuilt too, and forgotten after ``ha.resume_s`` (it holds no block).

    Args:
        clock: monotonic seconds (injectable: tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._kept: collections.deque[tuple[float, Handover]] = collections.deque(maxlen=ENDED_KEPT)

    def keep(self, records: list, engine_requests: dict) -> None:
        """A step's ``records``: each that ends a request (stop, length) whose engine request was
        in ``engine_requests`` before the step (it has left the engine since) is kept."""
        now = self.clock()
        # Past ``ENDED_KEEP_S`` one is handed over no more: gone now, not when 256 newer push it
        # out (each holds its prompt's and answer's ids: 256 documents' worth, held for nothing)
        while self._kept and now - self._kept[0][0] > ENDED_KEEP_S:
            self._kept.popleft()
        for rec in records:
            finish = getattr(rec, "finish", None)
            if finish in ("stop", "length") and (r := engine_requests.get(rec.key.engine_id)) is not None \
                    and (h := _handover(rec.key, r, finish)) is not None:
                self._kept.append((now, h))

    def recent(self) -> list[Handover]:
        """Those that ended within ``ENDED_KEEP_S``, oldest first."""
        now = self.clock()
        return [h for t, h in self._kept if now - t <= ENDED_KEEP_S]


class Adopted(msgspec.Struct, frozen=True):
    """A worker's answer to ``adopt``: what it holds when a new router takes it over."""

    worker_id: str
    incarnation: str
    role: str  # its role's name (WorkerStatus.role): prefill, decode, colocated or adaptive
    epoch: int  # the epoch it follows now
    requests: dict[str, int]  # engine id -> KV blocks of every request it holds (the old router's)
    kv_blocks_used: int
    kv_address: str | None  # its KV receiver's (decode, colocated, adaptive); None for prefill
    # of ``requests``, those it can hand over (they keep decoding); the router releases the rest
    handover: list[Handover] = []


class Fence:
    """The epoch a worker follows and when its router last called (module docstring).

    Args:
        epoch: the epoch of the router that created it.
        grace_s: how long it waits without a call before it drops everything.
        clock: monotonic seconds (injectable: tests).
    """

    def __init__(self, epoch: int, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.epoch, self.grace_s, self.clock = epoch, grace_s, clock
        self.last_call = clock()
        self.orphaned = False

    def admit(self, epoch: int) -> None:
        """A router call of ``epoch``: raises FencedError unless it is the epoch followed and
        the worker is not orphaned; else the grace clock restarts."""
        if epoch != self.epoch or self.orphaned:
            raise FencedError(epoch, self.epoch, self.orphaned)
        self.last_call = self.clock()

    def check_adopt(self, epoch: int) -> None:
        """Raises FencedError if a router of ``epoch`` may not adopt this worker (an older one)."""
        if epoch < self.epoch:
            raise FencedError(epoch, self.epoch)

    def adopt(self, epoch: int, grace_s: float | None = None) -> None:
        """Follow ``epoch`` from now on (``check_adopt`` first): not orphaned, the clock restarts;
        ``grace_s``: the adopting router's grace period (None: keep the one it has)."""
        self.check_adopt(epoch)
        self.epoch, self.orphaned, self.last_call = epoch, False, self.clock()
        self.grace_s = self.grace_s if grace_s is None else grace_s

    def credit(self, seconds: float) -> None:
        """The worker could not take calls for ``seconds`` (a long step held the calls queued
        behind it): that time does not count against the grace period."""
        self.last_call += seconds

    def expired(self) -> bool:
        """Following a router that has not called for ``grace_s`` (time to drop everything)."""
        return not self.orphaned and self.clock() - self.last_call > self.grace_s
