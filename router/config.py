"""Cluster config (``deploy/local.yaml``): small frozen dataclasses, validated when loaded.

Unknown keys and bad values fail at start with a message naming the key (``decode.replicas``),
never deep inside a worker. What the engine and the transfer layer own is not re-declared
here: an engine setting's default is the engine config's (``_engine``), valid dtypes,
speculative methods, transports and quantization names are their registries', and the lease
default is kvtransfer's. router.engine_configs maps the pools onto EngineConfig.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import DTYPES, MAX_JUMP_FORWARD, SPECULATIVE_METHODS, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvtransfer.auth import INTEGRITY
from kvtransfer.base import BUILTIN_TRANSPORTS, LEASE_S
from router.autoscale import DecodeTargets, PrefillTargets
from router.ha_config import HA_CHECKS, HAConfig  # (also imported from here)
from router.roles import RolesConfig


def _engine(cls: type, name: str) -> Any:
    """The engine's default for one of its config fields (declared there, once)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


class ConfigError(ValueError):
    """A config file the cluster cannot start with; the message names the key."""


@dataclass(frozen=True)
class PrefillPool:
    replicas: int = 1
    threads: int = 1
    kv_cache_gb: float | str = "auto"  # GiB, or "auto": what the node has left, by role (engine/kv_budget.py)
    block_size: int = _engine(CacheConfig, "block_size")
    max_batched_tokens: int = _engine(SchedulerConfig, "max_num_batched_tokens")
    # Cores (of its node) for each worker's KV transfer: a thread gathering and sending each
    # layer while the next ones compute, and the UCX progress thread; the forward runs on the
    # node's other cores. Empty: sent between layers on the forward's thread (prefill_worker/kv_stream.py).
    transfer_cpus: tuple[int, ...] = ()
    # prefill weights, the decode pool's names: none serves the model as loaded (fp32, or a GGUF's
    # own formats); the decode pool's value makes both pools serve one format, so the workers of
    # one node map one copy of it from the served-weights cache (engine/weight_cache.py)
    quantization: str = "none"


@dataclass(frozen=True)
class DecodeSpeculative:
    """``decode.speculative``: speculative decoding on the decode workers (engine/spec)."""

    method: str = "none"  # none | engine.config.SPECULATIVE_METHODS
    num_speculative_tokens: int = _engine(SpeculativeConfig, "num_speculative_tokens")
    draft_model: str = ""  # method draft: an HF-format folder with the target's tokenizer
    draft_layers: int = 0  # method layer_skip: 0 = half the target's layers
    draft_quantization: str = _engine(SpeculativeConfig, "draft_quantization")  # method quant_self
    adaptive: bool = _engine(SpeculativeConfig, "adaptive")

    def to_engine(self):
        """The engine's SpeculativeConfig, or None when off. Raises ValueError on bad values."""
        if self.method == "none":
            return None
        return SpeculativeConfig(method=self.method, num_speculative_tokens=self.num_speculative_tokens,
                                 draft_model=self.draft_model or None, draft_layers=self.draft_layers or None,
                                 draft_quantization=self.draft_quantization, adaptive=self.adaptive)


@dataclass(frozen=True)
class DecodePool:
    replicas: int = 1
    threads: int = 1
    kv_cache_gb: float | str = "auto"  # GiB, or "auto" (engine/kv_budget.py)
    block_size: int = _engine(CacheConfig, "block_size")
    max_num_seqs: int = _engine(SchedulerConfig, "max_num_seqs")
    max_batched_tokens: int = _engine(SchedulerConfig, "max_num_batched_tokens")
    chunked_prefill: bool = _engine(SchedulerConfig, "enable_chunked_prefill")
    reserve_fraction: float = 1.0
    speculative: DecodeSpeculative = field(default_factory=DecodeSpeculative)
    # decode weights: none | int8 | int4 | int4-g64 | w8a8 (RTN at load) or a quantized checkpoint folder
    quantization: str = "none"
    # small steps through the fast path (native kernels, or compiled graphs where those do not
    # build; fp32, INT8, INT4 on CPU): faster decode over the same weights (no second copy)
    compile_decode: bool = _engine(EngineConfig, "compile_decode")
    # ... for steps of up to this many tokens (a verify step always): 1..32, or None (32 native,
    # 4 compiled)
    compile_decode_rows: int | None = _engine(EngineConfig, "compile_decode_rows")
    # structured outputs: up to this many tokens a request's grammar forces are appended at once
    # (EngineConfig.jump_forward; 0: off)
    jump_forward: int = _engine(EngineConfig, "jump_forward")


@dataclass(frozen=True)
class KVTransferConfig:
    transport: str = "ucx"
    lease_s: float = LEASE_S
    integrity: str = "header"  # what each KV frame's MAC covers (kvtransfer.auth): header | full (+ K/V bytes)
    # Chaos testing only (bench/chaos.py): prefill workers take inject() calls that corrupt,
    # drop or cut their next KV message. Never on in production.
    fault_injection: bool = False


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # The OpenAI-compatible HTTP API (router.openai_http) on the same host; 0: a free port;
    # null: off. Same tokens and TLS as gRPC.
    http_port: int | None = 8000
    # The model's name in the OpenAI API (``model`` in requests, GET /v1/models); "": the
    # catalogue name, the .gguf file's stem, the Hugging Face id or the model folder's name.
    served_model_name: str = ""
    max_queue: int = 256
    default_max_tokens: int = 256
    # A worker silent this long (no report; Ray still says ALIVE), or a call to it unanswered
    # this long, is stalled: its requests re-run elsewhere and its process is replaced. Workers
    # report between a step's layers too (worker/step_loop.py MID_STEP_BEAT_S), but a call waits
    # for the step in progress: longer than any one engine step.
    stall_s: float = 120.0
    # The longest a request waits for KV capacity or a sequence slot (a worker's max_num_seqs:
    # router/placement.py WorkerLoad.free_seqs) before RESOURCE_EXHAUSTED.
    queue_timeout_s: float = 60.0
    # How often the router asks every worker which requests hold KV blocks and frees those of
    # no live request (a leak any other path missed; counted in pdserve_router_swept_blocks).
    sweep_s: float = 30.0
    # Place prompts by the prefill tokens a worker would actually compute: its queue plus the
    # prompt's part not in its prefix cache (router/prefix_index.py). false: by the queue alone.
    prefix_aware: bool = True
    # Disaggregated mode: a prompt of at most this many tokens is prefilled by the decode worker
    # chosen for it (no prefill-pool queue, no KV transfer), between its decode steps: the most
    # prompt tokens its running streams wait for (router/placement.py prefill_where). 0: off,
    # every prompt goes through the prefill pool.
    local_prefill_tokens: int = 0
    # A request waiting for KV whose turn it is preempts running requests of a lower priority
    # class (router/preempt.py: aborted on their workers, re-queued, re-run from their prompt
    # plus the tokens streamed); one request is preempted at most this many times, then runs
    # to its end (no starvation by a stream of higher-priority requests). 0: no preemption.
    max_preemptions: int = 2


@dataclass(frozen=True)
class InputLimits:
    """``limits``: the most one request may carry. Beyond: INVALID_ARGUMENT naming the field,
    before the request touches the tokenizer or a worker (gRPC's own: RESOURCE_EXHAUSTED)."""

    request_id_chars: int = 128  # printable ASCII; the id rides in every KV frame header
    prompt_bytes: int = 262144  # UTF-8 bytes of the prompt text, or of all chat messages together
    messages: int = 256  # chat messages per request
    stop_strings: int = 16  # each decode step looks for every one
    stop_string_chars: int = 256
    stop_token_ids: int = 64
    top_logprobs: int = 20  # alternatives per token a request may ask logprobs of
    concurrent_rpcs: int = 1024  # gRPC calls in progress at once; beyond: RESOURCE_EXHAUSTED
    message_bytes: int = 4194304  # the largest request message (gRPC) or body (HTTP) the server reads
    choices: int = 16  # OpenAI API: choices per request (prompts x n)


@dataclass(frozen=True)
class SecurityConfig:
    """``security``: who may use the front door (router.auth). Paths only: tokens never sit in
    the config itself (a file, or the PDSERVE_TOKENS environment variable)."""

    tls_cert: str = ""  # PEM server certificate (with tls_key: gRPC over TLS)
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA: clients must show a certificate it signed (mTLS)
    tokens_file: str = ""  # `token` or `token name` per line: every call but health needs one
    # per token name: max_concurrent, tokens_per_minute, priority, weight (router/policy.py); "": no limits
    policy_file: str = ""
    reflection: bool = True  # gRPC server reflection (behind the tokens like every other call)
    insecure: bool = False  # serve a non-loopback host without TLS and authentication anyway
    # HTTP Host names (``name`` or ``name:port``) accepted besides loopback ones; set, every
    # request must name one of them or a loopback name (DNS rebinding: router/http_guard.py)
    allowed_hosts: tuple[str, ...] = ()
    # Browser origins (``https://app.example``) allowed besides the server's own host (CSRF)
    allowed_origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrontDoorConfig:
    """``front_door``: what one connection, body and response may take at the door, and how it
    stops (router/http_body.py, http_conn.py, http_guard.py, grpc_guard.py, drain.py)."""

    json_depth: int = 32  # nesting of arrays and objects in a JSON body; beyond: 400
    # choices x tokens x (1 + top_logprobs) an OpenAI response may carry when it asks for
    # logprobs (tokens: max_tokens, or the context length with echo); beyond: 400, before generating
    logprob_entries: int = 262144
    header_timeout_s: float = 10.0  # HTTP: a request's line and headers must arrive within this
    body_timeout_s: float = 60.0  # HTTP: ... and its body within this once the headers are in; beyond: 408
    keepalive_s: int = 5  # HTTP: an idle keep-alive connection is closed after this
    # HTTP: a response whose unsent bytes stay above the write buffer's high-water mark (64 KiB)
    # this long (its client stopped reading) is closed and its requests aborted: no slot held forever
    write_timeout_s: float = 30.0
    header_bytes: int = 16384  # HTTP: the most bytes of request line and headers (h11)
    connections_per_client: int = 256  # HTTP: open connections per client address
    connections: int = 2048  # HTTP: open connections in all (at a cap the oldest idle one is closed)
    # HTTP: new connections a second per client address, and at once; beyond: reset at once
    # (clients opening and closing connections in a tight loop: router/conn_rate.py)
    new_connections_per_client_s: float = 200.0
    new_connections_burst: int = 400
    grpc_connections: int = 2048  # gRPC: open connections in all (beyond: refused)
    grpc_streams_per_connection: int = 256  # gRPC: concurrent calls on one HTTP/2 connection
    grpc_calls_per_client: int = 512  # gRPC: calls in progress per client address (beyond: RESOURCE_EXHAUSTED)
    grpc_handshake_timeout_s: float = 10.0  # gRPC: a new connection's TLS + HTTP/2 preface must be in within this
    grpc_keepalive_s: float = 60.0  # gRPC: ping a connection quiet this long ...
    grpc_keepalive_timeout_s: float = 20.0  # ... and close it when the ping is unanswered this long
    grpc_max_idle_s: float = 300.0  # gRPC: close a connection with no call this long
    grpc_max_age_s: float = 3600.0  # gRPC: ask a connection to reconnect (GOAWAY) at this age ...
    grpc_max_age_grace_s: float = 600.0  # ... and end the calls still on it this much later
    health_watches: int = 64  # gRPC: concurrent grpc.health.v1 Watch streams (beyond: RESOURCE_EXHAUSTED)
    health_watches_per_client: int = 16  # gRPC: ... of them from one client address (beyond: RESOURCE_EXHAUSTED)
    shutdown_grace_s: float = 30.0  # SIGTERM: running requests get this long to finish, then are aborted
    # gRPC and HTTP (SSE): a streamed response whose client takes no next message this long
    # (flow control holds the writes: it stopped reading) ends its requests on every worker, their
    # KV and slots freed, with RESOURCE_EXHAUSTED (gRPC) or the connection closed (SSE) (router/unread.py)
    unread_stream_timeout_s: float = 60.0
    # ... and after this long its requests are parked: aborted on their workers (KV, seat and
    # decode steps freed) and placed again, from what was streamed, once the client takes the
    # waiting message; 0: never parked (router/parking.py)
    park_unread_s: float = 2.0
    # HTTP: a streamed answer's kernel send buffer and asyncio high-water mark, each: what a client
    # that stopped reading may leave unsent before its stream counts as not read (router/http_conn.py)
    stream_buffer_bytes: int = 16384


@dataclass(frozen=True)
class MetricsConfig:
    host: str = "127.0.0.1"  # the router's /metrics listens here (it has no authentication)
    port: int | None = 9400  # the router's /metrics; 0 = a free port; null = off
    worker_port: int | None = 0  # each worker's /metrics; 0 = a free port; null = off


@dataclass(frozen=True)
class AutoscaleConfig:
    enabled: bool = False
    interval_s: float = 2.0  # how often the controller decides
    window_s: float = 30.0  # TTFT/TPOT p90 over this recent past (TTFT at first tokens, TPOT at finishes)
    prefill: PrefillTargets = field(default_factory=PrefillTargets)
    decode: DecodeTargets = field(default_factory=DecodeTargets)


# disaggregated: prefill and decode pools; colocated: workers that do both; adaptive: workers
# that can do both, each in one role at a time, switched at run time (router/roles.py)
MODES = ("disaggregated", "colocated", "adaptive")


@dataclass(frozen=True)
class ClusterConfig:
    mode: str = "disaggregated"
    model: str | None = None
    dtype: str = _engine(EngineConfig, "dtype")
    # A GGUF model's weights dequantized to `dtype` (every worker), instead of served in their
    # precision class as shipped (4-bit blocks as INT4, 5-8 bit as INT8); no effect on other models
    dequantize: bool = _engine(EngineConfig, "dequantize")
    # "int8": INT4/INT8 weights multiply INT8-quantized activations (EngineConfig.activations)
    activations: str = _engine(EngineConfig, "activations")
    device: str = _engine(EngineConfig, "device")
    prefill: PrefillPool = field(default_factory=PrefillPool)
    decode: DecodePool = field(default_factory=DecodePool)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    limits: InputLimits = field(default_factory=InputLimits)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    front_door: FrontDoorConfig = field(default_factory=FrontDoorConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)  # mode: adaptive (router/roles.py)
    ha: HAConfig = field(default_factory=HAConfig)


def _one_of(names) -> str:
    *rest, last = names
    return f"{', '.join(rest)} or {last}"


_QUANTIZATIONS = ("none, int8, int8-asym, int4, int4-g32|g64|g128[-asym], w8a8, or a quantized checkpoint folder "
                  "(pdserve quantize --out)")


# Per key: (check, what a valid value is). Keys are dotted paths.
_RULES: dict[str, tuple[Any, str]] = {
    "mode": (lambda v: v in MODES, _one_of(MODES)),
    "model": (lambda v: v is None or (isinstance(v, str) and v),
              "null (the bundled model), a catalogue name, a .gguf file or a model folder path"),
    "dtype": (lambda v: v in DTYPES, _one_of(DTYPES)),
    "device": (lambda v: v in ("cpu", "cuda"), "cpu or cuda"),
    "kv_transfer.transport": (lambda v: v in BUILTIN_TRANSPORTS, _one_of(BUILTIN_TRANSPORTS)),
    "kv_transfer.integrity": (lambda v: v in INTEGRITY, _one_of(INTEGRITY)),
    "router.port": (lambda v: 0 <= v <= 65535, "a port number 0..65535"),
    "router.http_port": (lambda v: 0 <= v <= 65535, "a port number 0..65535 (0: a free one) or null (off)"),
    "limits.choices": (lambda v: v >= 1, ">= 1"),
    "security.allowed_hosts": (lambda v: all(isinstance(h, str) and h and " " not in h for h in v),
                               "a list of host names (name or name:port)"),
    "security.allowed_origins": (lambda v: all(isinstance(o, str) and "://" in o for o in v),
                                 "a list of origins (scheme://host[:port])"),
    "metrics.port": (lambda v: 0 <= v <= 65535, "a port number 0..65535 (0: a free one) or null (off)"),
    "metrics.worker_port": (lambda v: 0 <= v <= 65535, "a port number 0..65535 (0: a free one) or null (off)"),
    "decode.reserve_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "decode.compile_decode_rows": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                                           and 1 <= v <= 32),
                                   "null (32 with the native kernels, 4 with the compiled graphs) or an integer "
                                   "in 1..32"),
    "decode.chunked_prefill": (lambda v: isinstance(v, bool), "true or false"),
    "decode.jump_forward": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_JUMP_FORWARD,
                            f"an integer in 0..{MAX_JUMP_FORWARD} (0: off)"),
    "prefill.transfer_cpus": (lambda v: all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v)
                              and len(set(v)) == len(v), "a list of distinct core numbers (>= 0), or []"),
    "decode.speculative.method": (lambda v: v in ("none", *SPECULATIVE_METHODS),
                                  _one_of(("none", *SPECULATIVE_METHODS))),
    "decode.speculative.num_speculative_tokens": (lambda v: 1 <= v <= 8, "an integer in 1..8"),
    "decode.speculative.draft_layers": (lambda v: v >= 0, ">= 0 (0: half the target's layers)"),
    "router.local_prefill_tokens": (lambda v: v >= 0, ">= 0 (0: off)"),
    "router.max_preemptions": (lambda v: v >= 0, ">= 0 (0: no preemption)"),
    "front_door.park_unread_s": (lambda v: v >= 0, ">= 0 (0, or past unread_stream_timeout_s: never parked)"),
    "front_door.stream_buffer_bytes": (lambda v: v >= 4096, ">= 4096"),
    "roles.min_prefill": (lambda v: v >= 0, ">= 0 (0: decode workers prefill their own prompts when none is left)"),
    "roles.max_prefill": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                          "an integer >= 1, or null (no limit)"),
    "roles.max_decode": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                         "an integer >= 1, or null (no limit)"),
    "decode.speculative.adaptive": (lambda v: isinstance(v, bool), "true or false"),
    "decode.quantization": (lambda v: _quantization_ok(v), _QUANTIZATIONS),
    "prefill.quantization": (lambda v: _quantization_ok(v), _QUANTIZATIONS),
    "autoscale.enabled": (lambda v: isinstance(v, bool), "true or false"),
    **HA_CHECKS,
    "autoscale.decode.kv_high": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "autoscale.decode.kv_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


_NULLABLE = {"metrics.port", "metrics.worker_port", "router.http_port", "roles.max_prefill", "roles.max_decode"}


def _quantization_ok(v: Any) -> bool:
    from engine.quant import split_quantization  # (heavy: torch, through the engine)
    try:
        split_quantization(v, "")
    except ValueError:
        return False
    return True


def _check_number(path: str, value: Any, kind: type) -> None:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{path}: expected {'a finite number' if kind is float else 'an integer'}, "
                          f"got {value!r}")
    if path not in _RULES and value <= 0:
        raise ConfigError(f"{path}: must be > 0, got {value!r}")
    if path.endswith("block_size") and value & (value - 1):
        raise ConfigError(f"{path}: must be a power of two, got {value!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]!s}; valid keys here: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}{name}"
        default = fields[name].default_factory() if fields[name].default_factory is not dataclasses.MISSING \
            else fields[name].default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value if value is not None else {}, path + ".")
            continue
        if value is None and path in _NULLABLE:
            kwargs[name] = None
            continue
        if name == "kv_cache_gb":  # auto (the default) or a number of GiB, checked as any other float
            if isinstance(value, str) and value != "auto":
                raise ConfigError(f"{path}: must be a number of GiB or auto, got {value!r}")
            default = value if value == "auto" else 0.0
        if isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {value!r}")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        if isinstance(default, tuple):
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{path}: must be a list, got {value!r}")
            value = tuple(value)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            _check_number(path, value, type(default))
            value = float(value) if isinstance(default, float) else value
        rule = _RULES.get(path)
        if rule is not None and not rule[0](value):
            raise ConfigError(f"{path}: must be {rule[1]}, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read and validate a cluster config (defaults when ``path`` is None).

    Raises:
        ConfigError: unreadable file, unknown key or bad value (the message names it).
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path} is not valid YAML: {e}") from e
    for key, value in (overrides or {}).items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):  # absent, or an empty section (None)
                node[p] = {}
            node = node[p]
        node[last] = value
    cfg = _build(ClusterConfig, data, "")
    for name in ("prefill", "decode"):
        t = getattr(cfg.autoscale, name)
        if t.min_replicas > t.max_replicas:
            raise ConfigError(f"autoscale.{name}: min_replicas {t.min_replicas} > max_replicas {t.max_replicas}")
    for name in ("prefill", "decode"):
        least, most = getattr(cfg.roles, f"min_{name}"), getattr(cfg.roles, f"max_{name}")
        if most is not None and least > most:
            raise ConfigError(f"roles: min_{name} {least} > max_{name} {most}")
    if cfg.autoscale.decode.kv_low >= cfg.autoscale.decode.kv_high:
        raise ConfigError("autoscale.decode: kv_low must be below kv_high (the band between them holds the size)")
    try:
        cfg.decode.speculative.to_engine()
    except ValueError as e:
        raise ConfigError(f"decode.speculative: {e}") from e
    if cfg.mode == "adaptive" and cfg.autoscale.enabled:
        raise ConfigError("autoscale.enabled: not with mode: adaptive (its workers switch roles instead; "
                          "the pools' size is prefill.replicas + decode.replicas)")
    for pool in ("prefill", "decode"):
        if cfg.device == "cuda" and getattr(cfg, pool).kv_cache_gb == "auto":  # (auto sizes from the node's RAM)
            raise ConfigError(f"{pool}.kv_cache_gb: auto sizes a CPU worker's cache from its node's memory; "
                              "with device: cuda give a number of GiB of GPU memory")
    if cfg.kv_transfer.transport == "inproc" and cfg.mode != "colocated":
        raise ConfigError("kv_transfer.transport: inproc works only with mode: colocated")
    return cfg
