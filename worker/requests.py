"""The requests a worker holds, by engine id: the table its step loop and its role's calls share.

A request is here from the call that brought it (``admit``: the router's ``reserve``,
``submit`` or ``prefill``) until it leaves (``forget``, or the record that ends it), so records
carry its :class:`~worker.protocol.Key` as a field and nothing parses ids. One that came with
the client's deadline is due when it passes (``due``), even if the router's abort never
arrives. Both tables are pruned as requests leave; only the step loop's thread touches them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from worker.protocol import Failed, Key, Tokens

if TYPE_CHECKING:
    from engine.llm_engine import RequestOutput

log = logging.getLogger("pdserve.worker")


class Requests:
    """Engine id → key, and engine id → deadline, of the requests live on this worker."""

    def __init__(self) -> None:
        self._keys: dict[str, Key] = {}
        self._deadlines: dict[str, float] = {}  # monotonic time the client stops waiting
        self.admitted = 0  # calls that brought a request here (WorkerStatus.admitted)

    def admit(self, key: Key, timeout_s: float | None = None) -> str:
        """A request arrives under ``key`` (counted: the router holds its reservation until a
        status shows it), due ``timeout_s`` from now (None: never); returns its engine id."""
        self.admitted += 1
        self._keys[key.engine_id] = key
        if timeout_s is not None:
            self._deadlines[key.engine_id] = time.monotonic() + timeout_s
        return key.engine_id

    def forget(self, engine_id: str) -> Key | None:
        """The request left (its deadline goes with it at the next ``due``); its key, or None
        if it had already left. Idempotent."""
        return self._keys.pop(engine_id, None)

    def due(self, now: float) -> list[Key]:
        """The requests whose deadline passed by ``now`` (their deadlines are forgotten: each
        is due once)."""
        out = []
        for eid, at in list(self._deadlines.items()):
            key = self._keys.get(eid)
            if key is None:  # it left
                del self._deadlines[eid]
            elif now >= at:
                del self._deadlines[eid]
                out.append(key)
        return out

    def keys(self) -> dict[str, Key]:
        """Engine id -> key of every request live here (a copy)."""
        return dict(self._keys)

    def live(self) -> list[str]:
        """The engine ids of every request live here."""
        return list(self._keys)

    @property
    def has_deadlines(self) -> bool:
        return bool(self._deadlines)

    def tokens(self, o: RequestOutput, leaves: bool) -> Tokens | None:
        """The record of one step's output; ``leaves``: the request is done here. None for a
        request not here (a bug, logged: it must not end the worker)."""
        key = self._keys.pop(o.request_id, None) if leaves else self._keys.get(o.request_id)
        if key is None:
            log.error("output for unknown request %r dropped", o.request_id)
            return None
        return Tokens(key, len(o.token_ids) - len(o.new_token_ids), list(o.new_token_ids), o.new_text,
                      o.finish_reason if o.finished else None, o.num_prompt_tokens, o.num_cached_tokens,
                      o.new_logprobs, o.prompt_logprobs)

    def failed(self, engine_id: str, error: str, invalid: bool = False) -> Failed | None:
        """The record of a request dropped here; it leaves (None if it already had)."""
        key = self._keys.pop(engine_id, None)
        return None if key is None else Failed(key, error, invalid)
