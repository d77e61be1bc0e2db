"""Who a call is, beyond "a valid token": request ids scoped per token, and the admin class.

Request ids. A client names its request (``request_id``) so that it can abort it; two tokens'
names must not meet. The router keys its jobs by ``scoped_id(owner, request_id)``: the id
itself when auth is off (one identity: the operator's), else the id and a 16-hex-digit tag of
the token's name. So ``Generate`` with another token's id starts a request of its own instead
of answering ALREADY_EXISTS (no oracle of who runs what, no claiming another's predictable
id), and ``Abort`` reaches only the caller's own. The scoped id is what workers and KV frame
headers see (its length: the id's limit, 128, plus 17, within a KV header's 256); clients see
their own id.

Admin class. ``GetClusterStatus`` (worker and metrics addresses) and its ``check_blocks`` (a
call on every worker) are for operators: ``is_admin`` says whether the caller may. With auth
off every caller is the operator (the server listens on loopback only, or was started
``--insecure``). With tokens, the class comes from ``router.auth``: ``Auth.is_admin(name)``
when it offers one; until it does, a token named ``admin`` or ``admin-...`` in the tokens file
(names are the operator's, never the client's).
"""

from __future__ import annotations

import hashlib
from typing import Any

ADMIN_NAME = "admin"


def scoped_id(owner: str, request_id: str) -> str:
    """The id the router and the workers know ``owner``'s request ``request_id`` by (module doc).
    Injective: the tag has a fixed length, so (id, tag) is read back from the end."""
    if not owner:
        return request_id
    return f"{request_id}~{hashlib.sha256(owner.encode()).hexdigest()[:16]}"


def is_admin(auth: Any, owner: str | None) -> bool:
    """Whether the caller ``owner`` (``Auth.caller``: "" with auth off, None: no valid token)
    may call the operator's RPCs."""
    if owner is None:
        return False
    if not getattr(auth, "enabled", False):
        return True
    check = getattr(auth, "is_admin", None)
    if callable(check):
        return bool(check(owner))
    return owner == ADMIN_NAME or owner.startswith(ADMIN_NAME + "-")
