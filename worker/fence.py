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

import time
from collections.abc import Callable

import msgspec

from engine.request import RequestStatus, SamplingParams
from worker.protocol import Key


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


def handovers(engine_requests: dict, keys: dict[str, Key]) -> list[Handover]:
    """The requests of ``engine_requests`` (engine id -> engine Request) a new router can
    resume: decoding (a first token out, not prefill-only, not waiting for KV), without
    logprobs (a resumed stream could not replay them). ``keys``: engine id -> key (worker.requests)."""
    out = []
    for eid, r in engine_requests.items():
        p, key = r.sampling_params, keys.get(eid)
        if key is None or r.prefill_only or r.is_finished or not r.output_token_ids \
                or r.status == RequestStatus.WAITING_FOR_KV or p.logprobs is not None or p.prompt_logprobs is not None:
            continue
        out.append(Handover(key, list(r.prompt_token_ids), list(r.output_token_ids), p))
    return out


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
