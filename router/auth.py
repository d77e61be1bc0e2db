"""Who may call the front door: TLS credentials and bearer tokens (``security:`` in the config).

Threat model at this door: the network between client and router is not trusted (TLS keeps the
prompt, the output and the token private; a client CA makes it mutual), and neither is any
caller without a token from the operator's tokens file. A token names its holder (``token
name`` per line, or the token alone: then its name is a short hash of it); the router keeps each
request's holder and answers ``Abort`` only to it. ``grpc.health.v1`` stays open: it is what
load balancers probe, and it says nothing but SERVING or NOT_SERVING (its ``Watch`` streams are
capped: router.grpc_guard). The door also holds the drain gate (router.drain) that both servers
ask before letting a request in, and the per-token policy (``security.policy_file``, by token
name: router.policy) that admission applies (router.admission). SIGHUP re-reads the tokens and
the policy (router.app ``reload_security``): a removed token is refused from the next call on.

Tokens come from a file or the ``PDSERVE_TOKENS`` environment variable (one per line, or comma
separated), never from the config file, which is meant to be shared and committed. The router
compares SHA-256 digests of tokens (a dict lookup on a digest does not leak the secret through
timing the way comparing secrets byte by byte would).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.drain import Gate
from router.policy import Policy, PolicyError, load_policy

log = logging.getLogger("pdserve.router")

TOKENS_ENV = "PDSERVE_TOKENS"
MIN_TOKEN_CHARS = 16  # a guessable token is no token: refuse short ones at start
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


class SecurityError(ValueError):
    """A TLS or token setting the server cannot start with; the message says which."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, source: str) -> dict[bytes, str]:
    """``{sha256(token): name}`` from lines of ``token`` or ``token name`` (``#`` comments).

    Raises:
        SecurityError: a token shorter than MIN_TOKEN_CHARS, outside printable ASCII, or twice.
    """
    out: dict[bytes, str] = {}
    for n, line in enumerate(text.replace(",", "\n").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        token, _, name = line.partition(" ")
        if len(token) < MIN_TOKEN_CHARS or not all(33 <= ord(c) < 127 for c in token):
            raise SecurityError(f"{source} line {n}: a token must be at least {MIN_TOKEN_CHARS} printable "
                                "ASCII characters without spaces (e.g. `openssl rand -hex 32`)")
        d = _digest(token)
        name = name.strip() or "token-" + d.hex()[:8]
        if d in out:
            raise SecurityError(f"{source} line {n}: the same token twice")
        out[d] = name
    return out


def load_tokens(path: str | None, env: dict[str, str] | None = None) -> dict[bytes, str]:
    """The tokens from ``path`` and the PDSERVE_TOKENS environment variable ({} = no auth)."""
    env = os.environ if env is None else env
    tokens: dict[bytes, str] = {}
    if path:
        p = Path(path).expanduser()
        try:
            text = p.read_text()
        except OSError as e:
            raise SecurityError(f"cannot read tokens file {path}: {e.strerror}") from e
        if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("tokens file %s is readable by other users (chmod 600 it)", path)
        tokens |= parse_tokens(text, f"tokens file {path}")
        if not tokens:
            raise SecurityError(f"tokens file {path} holds no token")
    if env.get(TOKENS_ENV):
        tokens |= parse_tokens(env[TOKENS_ENV], TOKENS_ENV)
    return tokens


@dataclass(frozen=True)
class Tls:
    cert: bytes
    key: bytes
    client_ca: bytes | None  # set: clients must present a certificate it signed (mTLS)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


def load_tls(cert: str, key: str, client_ca: str) -> Tls | None:
    """TLS from PEM files (None when neither cert nor key is set)."""
    if not cert and not key:
        if client_ca:
            raise SecurityError("security.tls_client_ca needs tls_cert and tls_key (mTLS is TLS first)")
        return None
    if not (cert and key):
        raise SecurityError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")

    def read(path: str, what: str) -> bytes:
        try:
            data = Path(path).expanduser().read_bytes()
        except OSError as e:
            raise SecurityError(f"cannot read {what} {path}: {e.strerror}") from e
        if b"-----BEGIN" not in data:
            raise SecurityError(f"{what} {path} is not PEM")
        return data

    return Tls(read(cert, "TLS certificate"), read(key, "TLS key"),
               read(client_ca, "client CA") if client_ca else None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard: reachable from elsewhere, as far as we can tell


class Auth:
    """Bearer tokens: who a call comes from (``caller``), and an interceptor that turns away
    every call without a known token (but health checks)."""

    def __init__(self, tokens: dict[bytes, str]) -> None:
        self.tokens = tokens

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The calling token's name; "" when auth is off; None for no or an unknown token."""
        if not self.tokens:
            return ""
        for k, v in metadata or ():
            if k == "authorization" and isinstance(v, str) and v[:7].lower() == "bearer ":
                return self.tokens.get(_digest(v[7:].strip()))
        return None

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _Interceptor(self)


class _Interceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Auth) -> None:
        self.auth = auth

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        if self.auth.caller(details.invocation_metadata) is not None:
            return handler
        has = any(k == "authorization" for k, _ in details.invocation_metadata or ())
        return _refuse(handler, "this token is not valid here" if has else
                       "this server needs `authorization: Bearer TOKEN` metadata (pdserve --token, PDSERVE_TOKEN)")


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler,
             "unary_stream": grpc.unary_stream_rpc_method_handler,
             "stream_unary": grpc.stream_unary_rpc_method_handler,
             "stream_stream": grpc.stream_stream_rpc_method_handler}
    make = next(make for kind, make in kinds.items() if getattr(handler, kind) is not None)
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class FrontDoor:
    """How the gRPC server listens and whom it lets in (``front_door`` builds it)."""

    tls: Tls | None = None
    auth: Auth = dataclasses.field(default_factory=lambda: Auth({}))
    reflection: bool = True
    gate: Gate = dataclasses.field(default_factory=Gate, compare=False)  # stopping: router.drain
    policy: Policy = dataclasses.field(default_factory=Policy)  # at start; reloads go to router.admission


def front_door(sec, host: str, env: dict[str, str] | None = None) -> FrontDoor:
    """The front door for ``security:`` (a router.config.SecurityConfig) serving on ``host``.

    Secure by default: on a host other than loopback, serving without TLS and without a way
    to authenticate callers (tokens or client certificates) needs ``security.insecure``
    (``pdserve serve --insecure``), and then says so loudly.

    Raises:
        SecurityError: an unreadable or malformed file, a short token, or an open door refused.
    """
    tls = load_tls(sec.tls_cert, sec.tls_key, sec.tls_client_ca)
    auth = Auth(load_tokens(sec.tokens_file, env))
    try:
        policy = load_policy(sec.policy_file)
    except PolicyError as e:
        raise SecurityError(str(e)) from e
    if not is_loopback(host):
        missing = [what for what, ok in (("TLS (--tls-cert, --tls-key)", tls is not None),
                                         ("authentication (--tokens-file, PDSERVE_TOKENS or --tls-client-ca)",
                                          auth.enabled or (tls is not None and tls.client_ca is not None)))
                   if not ok]
        if missing and not sec.insecure:
            raise SecurityError(f"refusing to serve {host} (reachable from other machines) without "
                                f"{' and '.join(missing)}; pass --insecure (security.insecure: true) to "
                                "serve it open anyway")
        if missing:
            log.warning("!!! serving %s WITHOUT %s: anyone who reaches this port can use the cluster !!!",
                        host, " and ".join(missing))
    return FrontDoor(tls, auth, sec.reflection, policy=policy)
