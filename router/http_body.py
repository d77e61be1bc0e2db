"""An HTTP request's JSON body, read within bounds: every way it can be wrong is a 4xx.

In order, before anything is parsed into a request (router.openai_api.parse):

- ``Content-Type`` other than JSON (``application/json``, ``application/*+json``): 415. A body
  without one is read as JSON (curl without ``-H``); a browser's cross-site "simple request"
  (text/plain, forms) is refused here and by its Origin (router.http_guard).
- more than ``limits.message_bytes``: 413, from ``Content-Length`` or while reading. The rest of
  the body is read and dropped first, up to ``DRAIN_BYTES`` more: answering and closing with
  bytes unread makes the kernel reset the connection, and the client may lose the 413 (seen on
  a loaded machine: a protocol error instead of the answer), as nginx's lingering close avoids.
- not all in within ``front_door.body_timeout_s`` of its headers (a slow upload): 408.
- arrays and objects nested deeper than ``front_door.json_depth``: 400, counted on the bytes
  before ``json.loads`` (which would recurse: 100 KB of ``[`` is a RecursionError).
- not JSON, or not UTF-8: 400.

Lone UTF-16 surrogates (``"\\ud800"``: valid JSON, not valid text) are refused by
router.openai_api.parse, which knows which parameter holds them.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import numpy as np

from router.aio import within
from router.openai_api import ApiError

# A JSON string, its closing quote optional: an unterminated one ends at the end of the body
# instead of failing, so that no input makes the scan quadratic (the body is invalid anyway).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
DRAIN_BYTES = 16 << 20  # of a refused body, read and dropped before the 413 (module doc)


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def too_deep(data: bytes, most: int) -> bool:
    """Whether the JSON text ``data`` nests arrays/objects deeper than ``most``: the running
    count of brackets outside strings (C-speed scans; a body with few brackets is not scanned).
    Unbalanced brackets (not JSON: json.loads reports it) count as they open."""
    if data.count(b"[") + data.count(b"{") <= most:
        return False
    s = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    if not s:
        return False
    b = np.frombuffer(s, np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max()) > most


def loads(data: bytes, most_depth: int) -> Any:
    """``data`` as JSON (ApiError 400 when too deep or not JSON)."""
    if too_deep(data, most_depth):
        raise ApiError(400, f"the request body nests arrays and objects more than {most_depth} deep "
                            "(front_door.json_depth)")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


async def read_json(request, most_bytes: int, most_depth: int, timeout_s: float) -> Any:
    """The JSON body of ``request`` (a Starlette Request), checked as the module doc says.

    Raises:
        ApiError: 400, 408, 413 or 415.
        starlette.requests.ClientDisconnect: the client left while sending it.
    """
    ctype = request.headers.get("content-type")
    if ctype is not None and not is_json_type(ctype):
        raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), not {ctype[:100]!r}",
                       code="unsupported_media_type")
    too_big = ApiError(413, f"the request body is over {most_bytes} bytes (limits.message_bytes)")
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        raise ApiError(400, "Content-Length is not a number")
    data = bytearray()
    over = length is not None and int(length) > most_bytes
    if over and request.headers.get("expect", "").lower() == "100-continue":
        raise too_big  # (its client sends the body only if asked: reading would ask for it)

    async def read() -> None:
        nonlocal over
        seen = 0
        async for part in request.stream():
            seen += len(part)
            if not over:
                data.extend(part)
                over = len(data) > most_bytes
            if over and seen > most_bytes + DRAIN_BYTES:
                break  # (the rest is dropped with the connection)

    try:
        await within(read(), timeout_s)
    except asyncio.TimeoutError:
        if over:
            raise too_big from None
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s "
                            "(front_door.body_timeout_s)", code="timeout") from None
    if over:
        raise too_big
    return loads(bytes(data), most_depth)
