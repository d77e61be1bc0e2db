"""A cluster whose workers outlive its router (``ha.enabled``): names, epochs, the cluster key.

Workers are detached, named Ray actors in the namespace ``pdserve``, named
``<ha.cluster_name>/<worker id>`` (``pdserve/<cluster>/<worker id>`` in full): a router that
starts finds them by name (``find_workers``) and adopts them (router.pools) instead of creating
new ones, so a router restart reloads no model.

Every router start takes an epoch (``next_epoch``), higher than every earlier router's of its
cluster; each call it makes carries it (``FencedActor``), and a worker refuses the calls of an
older epoch than the one that adopted it last (worker.fence). The epochs and the cluster key
live in Ray's GCS internal KV, under the namespace ``pdserve`` and the cluster's name: the GCS
outlives every router process (and, with Ray's GCS fault tolerance backed by Redis, a restart
of the head node), every router of the cluster reaches it already (it is Ray's own store: no
other service to run), and it offers one atomic operation, a put that creates a key only if
it is absent, which is enough to hand out each epoch once (``next_epoch``). What it does not
offer, a lease with a deadline, is a later step's (active-standby routers, issue 46).

The cluster key (reports' and KV messages' MACs, kvtransfer.auth) must be the same for every
router of the cluster: the workers keep the one they were made with. It is kept beside the
epochs; whoever can read the GCS can already run code on every worker, so it hides nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvtransfer.auth import new_secret
from router.config import ClusterConfig, HAConfig
from router.worker_state import Role, Worker
from worker.fence import Adopted
from worker.protocol import RouterLink

log = logging.getLogger("pdserve.router")

NAMESPACE = "pdserve"  # the Ray namespace of the named workers, and the GCS KV's of the epochs and key
LEADER = "leader"  # the name, in place of a worker id, of the cluster's leader lease (router.leader): no worker's


def actor_name(cluster: str, worker_id: str) -> str:
    """A worker's Ray actor name within ``NAMESPACE`` (unique per worker, derived from its id)."""
    return f"{cluster}/{worker_id}"


def current_epoch(cluster: str) -> int:
    """The newest epoch a router of ``cluster`` took (0: none yet)."""
    # (heavy: Ray, loaded when the cluster starts) Ray's GCS KV has no public API: internal_kv
    # is what Ray's own libraries (Serve, the job manager) keep their state in
    from ray.experimental import internal_kv as kv
    n = int(kv._internal_kv_get(f"{cluster}/epoch", namespace=NAMESPACE) or 0)
    # (the hint may lag: two routers starting at once write it in any order; the keys do not)
    while kv._internal_kv_exists(f"{cluster}/epoch/{n + 1}", namespace=NAMESPACE):
        n += 1
    return n


def next_epoch(cluster: str) -> int:
    """Take a new epoch for a router of ``cluster``: above every one taken before, never the
    same for two routers (each is a key created only if absent)."""
    from ray.experimental import internal_kv as kv  # (heavy: Ray; no public API: current_epoch)
    n = current_epoch(cluster)
    while True:
        n += 1
        if not kv._internal_kv_put(f"{cluster}/epoch/{n}", b"1", overwrite=False, namespace=NAMESPACE):
            kv._internal_kv_put(f"{cluster}/epoch", str(n).encode(), namespace=NAMESPACE)
            return n


def cluster_key(cluster: str) -> bytes:
    """The cluster key of ``cluster``: the first router's, made once (module docstring)."""
    from ray.experimental import internal_kv as kv  # (heavy: Ray; no public API: current_epoch)
    kv._internal_kv_put(f"{cluster}/key", new_secret(), overwrite=False, namespace=NAMESPACE)
    return kv._internal_kv_get(f"{cluster}/key", namespace=NAMESPACE)


def find_workers(cluster: str) -> dict[str, Any]:
    """The live named workers of ``cluster``: worker id -> Ray actor handle."""
    import ray  # (heavy: Ray, loaded when the cluster starts)
    prefix = actor_name(cluster, "")
    found = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix) and a["name"] != prefix + LEADER:
            try:
                found[a["name"][len(prefix):]] = ray.get_actor(a["name"], namespace=NAMESPACE)
            except ValueError:  # ended since it was listed
                pass
    return found


def find(cfg: ClusterConfig, workers: dict[str, Worker], next_index: dict[Role, int]) -> tuple[int, bytes]:
    """Take a new epoch for this router and read the cluster key; add every running worker of
    the cluster to ``workers`` (STARTING, behind a ``FencedActor``; ``next_index``: past their
    ids). Returns (epoch, key). Blocking (Ray's GCS)."""
    name = cfg.ha.cluster_name
    epoch, key = next_epoch(name), cluster_key(name)
    colocated, adaptive = cfg.mode == "colocated", cfg.mode == "adaptive"
    for wid, handle in sorted(find_workers(name).items()):
        pool, _, index = wid.rpartition("-")
        if pool not in ("prefill", "decode") or not index.isdigit():
            log.warning("ignoring the named actor %s of cluster %s: not a worker id", wid, name)
            continue
        role = Role.PREFILL if pool == "prefill" else Role.COLOCATED if colocated else Role.DECODE
        next_index[role] = max(next_index[role], int(index) + 1)
        workers[wid] = Worker(wid, role, FencedActor(handle, epoch), adaptive=adaptive)
    log.info("router epoch %d of cluster %s: %d running workers to adopt", epoch, name, len(workers))
    return epoch, key


async def adopt(w: Worker, link: RouterLink, grace_s: float, call: Callable[..., Awaitable[Any]],
                timeout_s: float, handover: Callable[[Worker, Adopted], set[str]] | None = None,
                replay: Callable[[bytes], None] | None = None) -> None:
    """The first step of an HA worker's bring-up: it reports to ``link``, obeys this epoch and
    waits ``grace_s`` (this router's ``ha.grace_s``) for a call from now on. At this router's
    first adoption of it, the requests it decodes for the router before are ``handover``'s
    to rebuild (router.resume: it returns the engine ids it keeps); the others it held are
    aborted and their blocks freed, and that is logged. Tried again within the same bring-up
    (a later step failed: router.liveness), it keeps what the first try kept (``Worker.kept``).
    Raises RuntimeError if it plays another role than the cluster's config gives it.

    Args:
        call: ``Liveness.call`` (each call with the stall deadline; ``timeout_s`` for the adoption,
            which waits while a new worker loads its model).
        replay: takes a report again (router.pools ``take_report``): those it sent to this
            router before the answer came, which the pools kept (``Worker.early``), go
            through it after the rebuild and before any later report, in the order sent.
    """
    first = w.incarnation is None and handover is not None  # (a worker this router never knew)
    w.early = [] if first else None
    try:
        a = await call(w, w.actor.adopt(link, grace_s), timeout_s)
    finally:
        early, w.early = w.early or [], None
    want = "adaptive" if w.adaptive else w.role.value
    if a.role != want:
        raise RuntimeError(f"{w.worker_id} is a {a.role} worker, this cluster's config makes it {want}")
    kept: set[str] = set(w.kept)  # (a try again of a first adoption: what it kept, still kept)
    if first:  # (no await from here to the replay: a later report must not overtake the kept ones)
        w.incarnation = a.incarnation
        kept = handover(w, a)
        w.kept = frozenset(kept)
        for msg in early:
            replay(msg)
    drop = [eid for eid in a.requests if eid not in kept]
    if drop:
        freed = await call(w, w.actor.release.remote(drop))
        log.warning("worker %s adopted (epoch %d) holding %d requests of the router before: kept %d to resume, "
                    "aborted %d, freed %d of its %d KV blocks", w.worker_id, a.epoch, len(a.requests), len(kept),
                    len(drop), freed, a.kv_blocks_used)


def may_kill(cluster: str, epoch: int) -> bool:
    """Whether the router of ``epoch`` may end worker processes: unless a newer router of the
    cluster took an epoch. A fenced-off router's calls are refused by the workers, but Ray
    would carry out its kills. Blocking (Ray's GCS)."""
    newest = current_epoch(cluster)
    if newest != epoch:
        log.error("router epoch %d is fenced off (a newer router took epoch %d): it ends no worker", epoch, newest)
    return newest == epoch


def actor_options(cfg: HAConfig, worker_id: str) -> dict[str, Any]:
    """Ray actor options of a new worker: with ``cfg.enabled`` detached (it outlives this
    router) and named (the next router finds it by its name); none otherwise."""
    if not cfg.enabled:
        return {}
    return {"name": actor_name(cfg.cluster_name, worker_id), "namespace": NAMESPACE, "lifetime": "detached"}


def fenced(actor: Any, epoch: int | None) -> Any:
    """A new worker's handle as the router keeps it: behind a ``FencedActor`` in an HA cluster
    (``epoch``: this router's), the Ray handle itself otherwise (None)."""
    return actor if epoch is None else FencedActor(actor, epoch)


def ray_handle(actor: Any) -> Any:
    """The Ray handle itself (for ``ray.kill``, Ray's state API) of a worker's actor, fenced or not."""
    return actor.handle if isinstance(actor, FencedActor) else actor


class FencedActor:
    """A worker's Ray handle whose every call carries this router's epoch: ``a.reserve.remote(...)``
    is ``handle.call.remote(epoch, "reserve", ...)`` (worker.actor.WorkerActor.call checks it)."""

    def __init__(self, handle: Any, epoch: int) -> None:
        self.handle, self.epoch = handle, epoch

    def __getattr__(self, method: str) -> _FencedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _FencedMethod(self.handle, self.epoch, method)

    def adopt(self, link: RouterLink, grace_s: float) -> Any:
        """The object ref of ``adopt`` (worker.step_loop.StepLoop.adopt) under this epoch."""
        return self.handle.adopt.remote(self.epoch, link, grace_s)


class _FencedMethod:
    def __init__(self, handle: Any, epoch: int, method: str) -> None:
        self.handle, self.epoch, self.method = handle, epoch, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.handle.call.remote(self.epoch, self.method, *args, **kwargs)
