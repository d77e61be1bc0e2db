"""The worker ↔ router protocol: every message is a declared type, encoded and decoded here.

Router → worker calls are Ray actor methods whose arguments are these types (``Key``) or the
engine's (``SamplingParams``). Worker → router traffic is one message type, :class:`Report`,
pushed over zmq after every step with outputs and at least every heartbeat::

    Report(worker_id, incarnation, records=[Tokens | Failed, ...], status=WorkerStatus, seq)

With the cluster key (``WorkerOptions.key``; the router makes it) each report travels behind
its MAC: only a worker of this cluster can speak on the report socket, and ``seq`` (per
process, from 1) lets the router drop a replayed one. The status rides along, so the
router's view of each worker's load is never older than one
step, without polls. ``ModelInfo`` answers the router's ``model_info()`` call.

Why msgspec: typed msgpack structs that validate while they decode (a wrong type, a missing
field or a garbage frame raises ``ProtocolError`` for that one message, which the router
drops and counts), one declaration per message instead of string keys read in six files, and
no cost for it: a report of 8 records plus status encodes 3-4x faster than msgpack of the
equivalent dicts, decodes (validated) 2.5x faster and is 40% smaller (536 vs 872 bytes;
measured on the 2-core dev box). Records are arrays (fields by position: records are many),
the status a map. Ray pickles the same structs for actor calls.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvtransfer.auth import MAC_BYTES, mac, verify
from kvtransfer.base import TransferStats

# None while the request goes on; "prefilled": the prefill side's part is done (first token
# out, decode goes on elsewhere); the rest end the request.
Finish = Literal["stop", "length", "abort", "prefilled"]


class ProtocolError(ValueError):
    """A message that is not a well-formed instance of its declared type."""


class Key(msgspec.Struct, frozen=True, array_like=True):
    """One attempt of one client request. A re-run after a lost worker is a new attempt, so
    late records of the old one are told apart from the new one's."""

    request_id: str
    attempt: int = 0

    @property
    def engine_id(self) -> str:
        """The id the engine and the KV transfer know this attempt by (never parsed back)."""
        return f"{self.request_id}#{self.attempt}"


class Tokens(msgspec.Struct, tag="tokens", array_like=True):
    """One request's output of one step."""

    key: Key
    start: int  # output tokens of this attempt before these: the router puts them in order
    tokens: list[int]
    text: str  # the text delta (held back: a partial character, a possible stop-string start)
    finish: Finish | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # per token (SamplingParams.logprobs): (token, log probability, [(token, log probability)])
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # with the first token (SamplingParams.prompt_logprobs): per prompt token from the second on
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """A request this worker dropped for a reason other than its own finish; its blocks are
    freed. ``invalid``: bad input for this worker (re-running cannot help); otherwise, e.g.,
    its KV transfer failed (a re-run elsewhere can)."""

    key: Key
    error: str
    invalid: bool = False


Record = Tokens | Failed


class Reservation(msgspec.Struct, frozen=True, array_like=True):
    """A decode worker's answer to ``reserve``: what the prefill worker must send it.

    ``secret``: the transfer's MAC secret (b"" without a cluster key). ``token_start``: the
    first prompt position whose KV it lacks; the positions before it are a prefix it already
    held in its prefix cache (whole blocks, now shared with this request), so the transfer
    carries only ``[token_start, prompt)``. Always below the prompt's length: the last
    prompt position is sent, and the first token with it."""

    secret: bytes = b""
    token_start: int = 0


class WorkerStatus(msgspec.Struct):
    """A worker's load and identity, for placement, autoscaling, metrics and GetClusterStatus.

    ``queued_prompt_tokens``: prompt tokens not yet computed (its TTFT backlog);
    ``remaining_decode_tokens``: tokens its requests may still generate.
    """

    role: str
    incarnation: str
    pid: int
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    running: int = 0
    waiting: int = 0  # for compute or for their KV
    queued_prompt_tokens: int = 0
    remaining_decode_tokens: int = 0
    tokens_per_s: float = 0.0  # over the last TOKEN_RATE_WINDOW_S
    generated_tokens: int = 0  # sent to the router since start
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    admitted: int = 0  # admitting calls (reserve, submit) taken since start: the router's reservations
    metrics_address: str | None = None
    # Its KV receiver's address now (decode, adaptive): a UCX receiver's changes when it
    # replaces its UCX worker (kvtransfer/ucx_generation.py); the router publishes the newest.
    kv_address: str | None = None
    kv_transfer: TransferStats | None = None  # sender's (prefill), receiver's (decode) or both added (adaptive)
    # engine.spec.decoder.SpecDecoder.stats(): alpha, tokens per verify, draft vs verify time
    speculative: dict[str, float | int | str | bool | None] | None = None

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used


class ModelInfo(msgspec.Struct, frozen=True):
    """What the router needs to validate requests and answer GetModelInfo."""

    model: str
    fingerprint: str
    incarnation: str
    context_length: int
    vocab_size: int
    dtype: str
    block_size: int
    speculative: str = "none"
    quantization: str = "none"
    kernels: str = ""
    weights: str = ""  # engine.models.loader.weights_digest of the folder it loaded: every worker's must match


class Report(msgspec.Struct, array_like=True):
    """Worker → router, over zmq: a step's records and the worker's status. ``seq`` counts a
    process's reports from 1: the router drops one it has seen (a replay)."""

    worker_id: str
    incarnation: str
    records: list[Record]
    status: WorkerStatus
    seq: int = 0


MAX_REPORT_BYTES = 64 << 20  # the router's socket drops bigger messages (zmq MAXMSGSIZE)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Report)


def encode_report(report: Report, key: bytes | None = None) -> bytes:
    """The wire form: with the cluster ``key``, its MAC (kvtransfer.auth) and then the body."""
    body = _encoder.encode(report)
    return mac(key, [body]) + body if key else body


def decode_report(data: bytes, key: bytes | None = None) -> Report:
    """Raises:
        ProtocolError: with ``key``, no valid MAC (not from a worker of this cluster: checked
            before a byte is parsed); not a well-formed Report (garbage, a missing field, a
            wrong type).
    """
    if key:
        body = memoryview(data)[MAC_BYTES:]
        if len(data) < MAC_BYTES or not verify(key, [body], bytes(data[:MAC_BYTES])):
            raise ProtocolError("report without a valid MAC: not from a worker of this cluster")
        data = body
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProtocolError(f"bad worker report: {e}") from None
