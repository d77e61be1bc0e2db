"""The front door's locks (router.auth) on a real gRPC server over real sockets: tokens,
TLS, client certificates, and the refusal to serve an open door beyond loopback."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.auth import Auth, SecurityError, front_door, load_tls, load_tokens, parse_tokens
from router.client import channel
from router.config import SecurityConfig

ALICE, BOB = "a" * 16 + "-alice-token", "b" * 16 + "-bob-token"


def test_tokens_name_their_holders_and_short_ones_are_refused():
    tokens = parse_tokens(f"# ops\n{ALICE} alice\n\n{BOB}\n", "t")
    auth = Auth(tokens)
    assert auth.caller([("authorization", f"Bearer {ALICE}")]) == "alice"
    assert auth.caller([("authorization", f"bearer {BOB}")]).startswith("token-")  # unnamed: a hash
    assert auth.caller([("authorization", "Bearer " + "c" * 20)]) is None
    assert auth.caller([]) is None and auth.caller(None) is None
    assert Auth({}).caller([]) == ""  # auth off: everyone is the same nobody
    with pytest.raises(SecurityError, match="line 1: a token must be at least 16"):
        parse_tokens("short", "t")
    with pytest.raises(SecurityError, match="the same token twice"):
        parse_tokens(f"{ALICE}\n{ALICE} again", "t")


def test_tokens_come_from_a_file_or_the_environment(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"{ALICE} alice\n")
    f.chmod(0o600)
    assert set(load_tokens(str(f), env={"PDSERVE_TOKENS": BOB}).values()) >= {"alice"}
    assert len(load_tokens(str(f), env={"PDSERVE_TOKENS": BOB})) == 2
    assert load_tokens("", env={}) == {}
    with pytest.raises(SecurityError, match="cannot read tokens file"):
        load_tokens(str(tmp_path / "absent"), env={})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(SecurityError, match="holds no token"):
        load_tokens(str(tmp_path / "empty"), env={})


def test_an_open_door_beyond_loopback_needs_insecure(certs, tmp_path):
    f = tmp_path / "tokens"
    f.write_text(ALICE + "\n")
    open_ = SecurityConfig()
    assert not front_door(open_, "127.0.0.1", env={}).auth.enabled  # loopback: open is fine
    with pytest.raises(SecurityError, match=r"refusing to serve 0\.0\.0\.0 .*TLS.*authentication.*--insecure"):
        front_door(open_, "0.0.0.0", env={})
    with pytest.raises(SecurityError, match="without TLS"):  # tokens in plaintext would leak
        front_door(SecurityConfig(tokens_file=str(f)), "10.1.2.3", env={})
    with pytest.raises(SecurityError, match="without authentication"):
        front_door(SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"])), "::", env={})
    door = front_door(SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]),
                                     tokens_file=str(f)), "0.0.0.0", env={})
    assert door.tls is not None and door.auth.enabled
    assert front_door(SecurityConfig(insecure=True), "0.0.0.0", env={}).tls is None
    mtls = SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]),
                          tls_client_ca=str(certs["ca"]))
    assert front_door(mtls, "0.0.0.0", env={}).tls.client_ca  # client certificates authenticate too
    with pytest.raises(SecurityError, match="both a certificate"):
        load_tls(str(certs["server"]), "", "")
    with pytest.raises(SecurityError, match="is not PEM"):
        load_tls(str(certs["server"]), str(f), "")


class _Server:
    """grpc.health.v1 plus a Generation-like method behind the door, on a real port."""

    def __init__(self, door) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server, self.port = asyncio.run_coroutine_threadsafe(self._start(door), self.loop).result(30)

    async def _start(self, door):
        server = grpc.aio.server(interceptors=[door.auth.interceptor()] if door.auth.enabled else [])
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        auth = door.auth

        async def whoami(request: bytes, context) -> bytes:
            return (auth.caller(context.invocation_metadata()) or "").encode()

        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Who", {"Am": grpc.unary_unary_rpc_method_handler(whoami)})])
        port = server.add_secure_port("127.0.0.1:0", door.tls.server_credentials()) if door.tls else \
            server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        return server, port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _who(ch: grpc.Channel) -> str:
    return ch.unary_unary("/test.Who/Am")(b"", timeout=10).decode()


def _health(ch: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_tokens_and_tls_on_real_sockets(certs, tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"{ALICE} alice\n{BOB} bob\n")
    door = front_door(SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]),
                                     tokens_file=str(f)), "127.0.0.1", env={})
    srv = _Server(door)
    addr, ca = f"127.0.0.1:{srv.port}", str(certs["ca"])
    try:
        assert _who(channel(addr, tls_ca=ca, token=ALICE)) == "alice"
        assert _who(channel(addr, tls_ca=ca, token=BOB)) == "bob"
        for token, says in ((None, "needs `authorization: Bearer"), ("x" * 20, "not valid")):
            with pytest.raises(grpc.RpcError) as e:
                _who(channel(addr, tls_ca=ca, token=token))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and says in e.value.details()
        assert _health(channel(addr, tls_ca=ca)) == health_pb2.HealthCheckResponse.SERVING  # no token needed
        with pytest.raises(grpc.RpcError) as e:  # plaintext to a TLS port: no handshake, no call
            _who(channel(addr, token=ALICE))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as e:  # a CA that did not sign the server's certificate
            _who(channel(addr, tls_ca=str(certs["other-ca"]), token=ALICE))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def test_client_certificates_are_required_with_a_client_ca(certs):
    door = front_door(SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]),
                                     tls_client_ca=str(certs["ca"])), "0.0.0.0", env={})
    srv = _Server(door)
    addr, ca = f"127.0.0.1:{srv.port}", str(certs["ca"])
    try:
        assert _who(channel(addr, tls_ca=ca, tls_cert=str(certs["client"]), tls_key=str(certs["client_key"]))) == ""
        with pytest.raises(grpc.RpcError) as e:
            _health(channel(addr, tls_ca=ca))  # no client certificate: the handshake fails
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()
