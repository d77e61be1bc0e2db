"""The ``ha`` section of the cluster config (router.config reads it, with its checks here).

What survives a router's loss, and for how long: workers (router.ha, worker.fence: ``grace_s``),
the lead (router.leader: ``lease_s``) and the requests decoding on the workers, which the new
leader keeps for their clients to resume (router.resume: ``resume_s``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class HAConfig:
    """``ha``: workers that outlive the router (router.ha), routers that stand by (router.leader)."""

    enabled: bool = False  # detached, named workers that a restarted router adopts (router.ha)
    cluster_name: str = "default"  # the routers of one cluster share it (worker names, epochs, key)
    grace_s: float = 30.0  # a worker no router called this long aborts and frees everything (worker.fence)
    lease_s: float = 3.0  # `pdserve serve`: a standby leads at most this long (+ its start) after the leader is lost
    # A router that adopts a worker decoding requests of the router before keeps each (decoding,
    # its records buffered) this long for its client to resume it (gRPC Resume, or the OpenAI
    # API's retry with the same Idempotency-Key); then it is aborted and its blocks freed (router.resume)
    resume_s: float = 30.0


# key -> (check, what a valid value is): router.config's _CHECKS includes these
HA_CHECKS = {
    "ha.grace_s": (lambda v: v >= 1.0, ">= 1 (a router calls each worker every min(1, grace_s / 4) s)"),
    "ha.lease_s": (lambda v: 0.5 <= v <= 60, "in [0.5, 60] (the leader renews it every lease_s / 3)"),
    "ha.resume_s": (lambda v: 0 <= v <= 600, "in [0, 600] seconds (0: requests of the router before are aborted "
                                             "when it is adopted, none resumes)"),
    "ha.cluster_name": (lambda v: bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", v)),
                        "1 to 63 letters, digits, '_', '.' or '-' (a Ray actor name's part), starting with a "
                        "letter or digit"),
}
