"""The worker ↔ router protocol: every message is a declared type, encoded and decoded here.

Router → worker calls are Ray actor methods whose arguments are these types (``Key``) or the
engine's (``SamplingParams``). Worker → router traffic is one message type, :class:`Report`,
pushed over zmq after every step with outputs and at least every heartbeat::

    Report(worker_id, incarnation, records=[Tokens | Failed, ...], status=WorkerStatus, seq)

With the cluster key (``WorkerOptions.key``; the router makes it) each report travels behind
its MAC, under a key of its own incarnation (``report_key``: derived from the cluster key, the
worker id and the incarnation, which the process draws at random when it starts): only a
worker of this cluster can speak on the report socket, a report of an earlier process cannot
verify as one of the current one, and ``seq`` (per process, from 1, never reset) lets the
router drop a replay within one. Wire form::

    [MAC (16 bytes, with a key)] [n (1 byte)] [origin: n bytes, msgpack [worker_id, incarnation]] [body: the Report]

The origin is in the clear so that the router picks the key, or drops a report of another
incarnation, before any MAC or body is computed; the MAC covers origin and body, and the body
must name the same origin. The status rides along, so the router's view of each worker's
load is never older than one step, without polls. ``ModelInfo`` answers the router's
``model_info()`` call.

Size. No message exceeds ``MAX_REPORT_BYTES`` (the router's socket refuses bigger ones,
zmq MAXMSGSIZE): the worker sends a batch whose encoding passes ``REPORT_TARGET_BYTES`` as
several reports (``split_records``), and a record's prompt logprobs of more than
``PIECE_ENTRIES`` positions as pieces (``Tokens.more``: more of this record follows), which
the router joins before anything reads the record. A piece is at most ``PIECE_ENTRIES`` x
``LOGPROB_ENTRY_BYTES`` (1.3 MB); the cap leaves 2x margin over the target for what one
record beyond its logprobs holds (a step's text, its tokens).

Ids. One client request is known by one name per layer, and each name is one value::

    router     request_id  the client's id scoped to its owner (``router.admin.scoped_id``; ``rid=`` in logs)
    router ↔   Key         one attempt of it: (request_id, attempt); a re-run is a new attempt
    worker     engine_id   ``Key.engine_id`` = "<request_id>#<attempt>": what a worker knows the
                           attempt by (``worker.requests``, the worker cores, ``release``, ``held``)
    engine     request_id  the engine's own id of a ``Request``; a worker passes its engine_id
    kvtransfer transfer_id the id of a KV transfer; a worker passes its engine_id (one per attempt)

So a worker that reads ``output.request_id`` (the engine's) holds an engine id, and ``key.request_id``
is always the router's. Nothing parses an engine id back: records carry the ``Key``.

Why msgspec: typed msgpack structs that validate while they decode (a wrong type, a missing
field or a garbage frame raises ``ProtocolError`` for that one message, which the router
drops and counts), one declaration per message instead of string keys read in six files, and
no cost for it: a report of 8 records plus status encodes 3-4x faster than msgpack of the
equivalent dicts, decodes (validated) 2.5x faster and is 40% smaller (536 vs 872 bytes;
measured on the 2-core dev box). Records are arrays (fields by position: records are many),
the status a map. Ray pickles the same structs for actor calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

from kvtransfer.auth import MAC_BYTES, derive, mac, verify
from kvtransfer.base import TransferStats

# None while the request goes on; "prefilled": the prefill side's part is done (first token
# out, decode goes on elsewhere); the rest end the request.
Finish = Literal["stop", "length", "abort", "prefilled"]


# ---- how the router starts a worker (Ray actor arguments, not wire messages) --------------------
@dataclass(frozen=True)
class RouterLink:
    """Where a worker pushes its reports, and the id the router knows it by."""

    address: str  # the router's zmq PULL socket
    worker_id: str


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker actor runs, besides its engine config."""

    transport: str = "ucx"  # KV transport by name (kvtransfer.base.get_transport)
    lease_s: float | None = None  # KV transfer lease, the same on both sides; None: kvtransfer's LEASE_S
    threads: int = 1  # torch threads: several workers share a node's cores
    router: RouterLink | None = None  # None: records wait for poll()
    metrics: tuple[str, int] | None = None  # serve /metrics on (host, port; 0 = a free port)
    colocated: bool = False  # decode workers only: also prefill (mode: colocated)
    # prefill workers only: cores for the KV transfer thread and the UCX progress thread; the
    # forward runs on the process's other cores (prefill_worker/kv_stream.py). Empty: inline.
    transfer_cpus: tuple[int, ...] = ()
    # The cluster key (the router's; at least 16 bytes): MACs reports and every KV message
    # (kvtransfer.auth). None: trust the network (tests in one process). Never in a repr.
    key: bytes | None = field(default=None, repr=False)
    kv_integrity: str = "header"  # what a KV data frame's MAC covers: header | full (kvtransfer.auth)
    faults: bool = False  # chaos testing only: accept inject() (kv_transfer.fault_injection)
    # Resolve the config's ``model:`` (None: the bundled one) on this node and load that, not
    # the router's path: the bundled model sits in each node's own cache, and ``~`` is each
    # node's own HOME (router.nodes checks that every node holds the same weights).
    resolve_model: bool = False
    model: str | None = None
    # kv_cache_gb: auto: size the engine's KV cache from what this node has left, this worker's
    # share by role (engine/kv_budget.py), instead of the config's cache.memory_gb
    kv_cache_auto: bool = False
    # ha.enabled (router.ha): the creating router's epoch; the worker obeys only the router
    # that adopted it last (worker.fence). None: no fence, no grace period (the router owns it).
    epoch: int | None = None
    grace_s: float = 30.0  # ha.grace_s: no router call this long, it drops everything (worker.fence)


class ProtocolError(ValueError):
    """A message that is not a well-formed instance of its declared type."""


class Key(msgspec.Struct, frozen=True, array_like=True):
    """One attempt of one client request (``request_id``: the router's id of it). A re-run
    after a lost worker is a new attempt, so late records of the old one are told apart from
    the new one's. Module docstring, Ids: which id is which in each layer."""

    request_id: str
    attempt: int = 0

    @property
    def engine_id(self) -> str:
        """The id a worker knows this attempt by, and hands to its engine (as the engine's
        ``request_id``) and to the KV transfer (as its ``transfer_id``); never parsed back."""
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
    # A piece: more of this record follows (its prompt logprobs go on in the next one); the
    # router joins the pieces (``join_pieces``), so nothing past it sees one.
    more: bool = False


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

    def __repr__(self) -> str:  # never the secret (logs, tracebacks and Ray's errors print reprs)
        return f"Reservation(secret=<{len(self.secret)} bytes>, token_start={self.token_start})"


class Memory(msgspec.Struct, frozen=True, array_like=True):
    """A worker's memory in GB (1e9 bytes; engine/memory.py). The categories are its engine's
    account, taken once when the model is up (``account`` walks the object graph: never per
    step); the process figures are as of the latest refresh (``with_process``)."""

    weights_gb: float = 0.0  # the model's own modules: the weights as served
    packed_copies_gb: float = 0.0  # fast paths' own layouts of the weights (a second copy, or derived)
    kv_cache_gb: float = 0.0  # the paged KV cache as allocated (its pages are resident once written)
    other_gb: float = 0.0  # other tensors: scratch buffers, rotary tables
    rss_gb: float = 0.0  # resident set
    pss_gb: float = 0.0  # proportional set: pages shared with other processes split between them
    peak_rss_gb: float = 0.0  # the process's peak resident set while loading (when its engine was up)

    def with_process(self, rss_gb: float | None, pss_gb: float | None) -> Memory:
        """This account with newer process figures (a status's); None: keep the ones here."""
        return msgspec.structs.replace(self, rss_gb=self.rss_gb if rss_gb is None else rss_gb,
                                       pss_gb=self.pss_gb if pss_gb is None else pss_gb)


def memory_now(info: ModelInfo | None, status: WorkerStatus | None) -> Memory | None:
    """A worker's memory: its account at load (``info``) with its latest process figures (``status``)."""
    if info is None or info.memory is None:
        return None
    return info.memory if status is None else info.memory.with_process(status.rss_gb, status.pss_gb)


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
    # the engine's max_num_seqs (0: not reported): placement counts a worker whose running and
    # waiting requests reach it as full, so a request waits in the router's fair queue (per-token
    # weights and priorities) instead of first-come in the worker's
    max_num_seqs: int = 0
    queued_prompt_tokens: int = 0
    remaining_decode_tokens: int = 0
    tokens_per_s: float = 0.0  # over the last TOKEN_RATE_WINDOW_S
    generated_tokens: int = 0  # sent to the router since start
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    admitted: int = 0  # admitting calls (reserve, submit) taken since start: the router's reservations
    metrics_address: str | None = None
    # Its KV receiver's address now (decode, adaptive): a UCX receiver's changes when it
    # replaces its UCX worker (kvtransfer/ucx/generation.py); the router publishes the newest.
    kv_address: str | None = None
    kv_transfer: TransferStats | None = None  # sender's (prefill), receiver's (decode) or both added (adaptive)
    # engine.spec.decoder.SpecDecoder.stats(): alpha, tokens per verify, draft vs verify time
    speculative: dict[str, float | int | str | bool | None] | None = None
    # The process's resident and proportional set now, GB (refreshed every MEMORY_REFRESH_S,
    # worker.step_loop); the rest of its memory account is ModelInfo.memory
    rss_gb: float | None = None
    pss_gb: float | None = None

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
    memory: Memory | None = None  # its memory account when the model was up (memory_now: with a status's RSS)


class Report(msgspec.Struct, array_like=True):
    """Worker → router, over zmq: a step's records and the worker's status. ``seq`` counts a
    process's reports from 1: the router drops one it has seen (a replay)."""

    worker_id: str
    incarnation: str
    records: list[Record]
    status: WorkerStatus
    seq: int = 0


# One logprob entry, msgpack at most: [token (5), logprob (9), [20 x [token (5), logprob (9)] + headers]]
LOGPROB_ENTRY_BYTES = 318
PIECE_ENTRIES = 4096  # prompt logprob positions per piece: 1.3 MB at most
REPORT_TARGET_BYTES = 2 << 20  # a worker splits a batch that encodes to more into several reports
MAX_REPORT_BYTES = 4 << 20  # the router's socket refuses bigger messages (zmq MAXMSGSIZE): 2x the target
MAX_ORIGIN_BYTES = 255  # (one length byte)
_ORIGIN_LABEL = b"pdserve report v2"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Report)
_origin_decoder = msgspec.msgpack.Decoder(tuple[str, str])


def report_key(key: bytes, worker_id: str, incarnation: str) -> bytes:
    """The key one worker process's reports are MAC'd under (see the module doc)."""
    return derive(key, _ORIGIN_LABEL, worker_id.encode(), incarnation.encode())


def encode_report(report: Report, key: bytes | None = None) -> bytes:
    """The wire form (module doc); ``key``: the cluster key, or None (no MAC: tests)."""
    origin = _encoder.encode((report.worker_id, report.incarnation))
    if len(origin) > MAX_ORIGIN_BYTES:
        raise ValueError(f"worker id and incarnation too long for a report ({len(origin)} bytes encoded)")
    head = bytes([len(origin)]) + origin
    body = _encoder.encode(report)
    if not key:
        return head + body
    return mac(report_key(key, report.worker_id, report.incarnation), [head, body]) + head + body


def report_origin(data: bytes, keyed: bool = True) -> tuple[str, str]:
    """(worker id, incarnation) a report claims, unverified; cheap (no MAC, no body parsed).

    Raises:
        ProtocolError: no readable origin.
    """
    start = MAC_BYTES if keyed else 0
    n = data[start] if len(data) > start else 0
    if not n or len(data) < start + 1 + n:
        raise ProtocolError("report without a readable origin")
    try:
        return _origin_decoder.decode(data[start + 1:start + 1 + n])
    except msgspec.DecodeError as e:
        raise ProtocolError(f"report without a readable origin: {e}") from None


def decode_report(data: bytes, key: bytes | None = None, rkey: bytes | None = None) -> Report:
    """The report in ``data``. ``key``: the cluster key (the report key is derived from the
    origin); ``rkey``: the report key itself, already derived for the origin the caller
    expects (the router's, cached per incarnation); neither: no MAC (tests).

    Raises:
        ProtocolError: with a key, no valid MAC (not from this process of a worker of this
            cluster: checked before the body is parsed); not a well-formed Report (garbage, a
            missing field, a wrong type), or a body naming another origin than its head.
    """
    keyed = bool(key or rkey)
    try:
        origin = report_origin(data, keyed)
    except ProtocolError as e:
        raise ProtocolError(f"report without a valid MAC ({e})" if keyed else str(e)) from None
    start = (MAC_BYTES if keyed else 0) + 1 + data[MAC_BYTES if keyed else 0]
    view = memoryview(data)
    if keyed:
        rkey = rkey or report_key(key, *origin)
        if not verify(rkey, [view[MAC_BYTES:start], view[start:]], bytes(view[:MAC_BYTES])):
            raise ProtocolError("report without a valid MAC: not from this process of a worker of this cluster")
    try:
        report = _decoder.decode(view[start:])
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProtocolError(f"bad worker report: {e}") from None
    if (report.worker_id, report.incarnation) != origin:
        raise ProtocolError("a report whose body names another origin than its head")
    return report


def split_records(records: list[Record]) -> list[Record]:
    """``records`` with each record's prompt logprobs beyond ``PIECE_ENTRIES`` positions sent
    ahead as pieces (``Tokens.more``), in order: no record then encodes to much more than a
    piece. ``join_pieces`` undoes it."""
    out: list[Record] = []
    for r in records:
        lps = r.prompt_logprobs if isinstance(r, Tokens) else None
        if lps is None or len(lps) <= PIECE_ENTRIES:
            out.append(r)
            continue
        cut = len(lps) - (len(lps) - 1) % PIECE_ENTRIES - 1  # (the last piece: the record itself)
        for i in range(0, cut, PIECE_ENTRIES):
            out.append(Tokens(r.key, r.start, [], "", None, prompt_logprobs=lps[i:i + PIECE_ENTRIES], more=True))
        out.append(msgspec.structs.replace(r, prompt_logprobs=lps[cut:]))
    return out


def join_pieces(pieces: dict[Key, list], records: list[Record]) -> list[Record]:
    """The whole records among ``records``: a piece's prompt logprobs wait in ``pieces`` (the
    caller's, per sender process: it comes from one authenticated worker, whose context
    length bounds them) and go in front of the record's own when it arrives."""
    out: list[Record] = []
    for r in records:
        held = pieces.pop(r.key, None)
        if isinstance(r, Tokens) and r.more:
            pieces[r.key] = (held or []) + (r.prompt_logprobs or [])
            continue
        if held and isinstance(r, Tokens):
            r = msgspec.structs.replace(r, prompt_logprobs=held + (r.prompt_logprobs or []))
        out.append(r)
    return out
