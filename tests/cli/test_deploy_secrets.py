"""What each node of every `ray up` file in deploy/ receives of what deploy/make-secrets.sh writes
(the file mounts as Ray's rsync applies them), and the certificates: the router's names the head,
each node's Ray certificate names its IP and is what a peer checks (checked with
openssl and with gRPC's own TLS, as Ray's channels use it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from cli.deploy import Mounts, _prepared

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_UP_FILES = sorted(DEPLOY.glob("cluster-*.yaml")) + [DEPLOY / "onprem-loopback.yaml"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of deploy/ (as the root of a checkout) after `make-secrets.sh head.example 10.0.0.5`."""
    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(DEPLOY, root / "deploy", ignore=shutil.ignore_patterns("secrets"))
    r = subprocess.run(["bash", str(root / "deploy" / "make-secrets.sh"), "head.example", "10.0.0.5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return root


def _openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=lambda p: p.name)
def test_workers_get_no_private_key_but_the_node_issuer_and_no_client_token(checkout, path):
    mounts = Mounts(_prepared(path), checkout)
    secrets = checkout / "deploy" / "secrets"
    files = [p.relative_to(checkout).as_posix() for p in secrets.rglob("*") if p.is_file()]
    to_workers = {p for p in files if mounts.reaches_workers(p)}
    assert to_workers == {f"deploy/secrets/nodes/{n}" for n in ("ray_auth_token", "ray-ca.pem", "ray-issuer.pem",
                                                                "ray-issuer.key")}
    tokens = (secrets / "head" / "tokens").read_text().split()[0]
    for p in to_workers:
        text = (checkout / p).read_text()
        assert tokens not in text
        if "PRIVATE KEY" in text:
            assert p == "deploy/secrets/nodes/ray-issuer.key"
    # the head gets its files by `ray rsync-up` only; the CAs' keys reach no node
    for p in ("deploy/secrets/ca.key", "deploy/secrets/ray-ca.key", "deploy/secrets/head/server.key",
              "deploy/secrets/head/tokens"):
        assert not mounts.reaches_head(p) and not mounts.reaches_workers(p), p
    # ...while the rest of the checkout still reaches every node
    assert mounts.reaches_workers("deploy/cluster.yaml") and mounts.reaches_workers("cli/deploy.py")


def test_the_node_issuer_signs_node_certificates_only_and_not_for_clients(checkout):
    nodes = checkout / "deploy" / "secrets" / "nodes"
    text = _openssl("x509", "-in", str(nodes / "ray-issuer.pem"), "-noout", "-text")
    assert "CA:TRUE, pathlen:0" in text
    # under Ray's root, not the router's CA: nothing it signs is trusted by a pdserve client
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(nodes / "ray-ca.pem"), str(nodes / "ray-issuer.pem")],
                        capture_output=True, text=True)
    no = subprocess.run(["openssl", "verify", "-CAfile", str(checkout / "deploy/secrets/ca.pem"),
                         str(nodes / "ray-issuer.pem")], capture_output=True, text=True)
    assert ok.returncode == 0 and no.returncode != 0


def test_the_router_certificate_names_the_head_and_is_renewed_for_a_new_name(checkout, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(checkout, root)
    pem = root / "deploy/secrets/head/server.pem"
    san = _openssl("x509", "-in", str(pem), "-noout", "-ext", "subjectAltName")
    assert all(n in san for n in ("DNS:head.example", "IP Address:10.0.0.5", "DNS:localhost", "IP Address:127.0.0.1"))
    before = pem.read_bytes()
    subprocess.run(["bash", str(root / "deploy/make-secrets.sh"), "head.example"], check=True, capture_output=True)
    assert pem.read_bytes() == before  # every name asked for is in it: kept
    subprocess.run(["bash", str(root / "deploy/make-secrets.sh"), "54.1.2.3"], check=True, capture_output=True)
    assert "IP Address:54.1.2.3" in _openssl("x509", "-in", str(pem), "-noout", "-ext", "subjectAltName")
    r = subprocess.run(["openssl", "verify", "-CAfile", str(root / "deploy/secrets/ca.pem"), str(pem)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_old_layout_is_refused(tmp_path):
    shutil.copytree(DEPLOY, tmp_path / "deploy", ignore=shutil.ignore_patterns("secrets"))
    (tmp_path / "deploy/secrets").mkdir()
    (tmp_path / "deploy/secrets/tokens").write_text("x admin\n")
    r = subprocess.run(["bash", str(tmp_path / "deploy/make-secrets.sh")], capture_output=True, text=True)
    assert r.returncode == 1 and "treat those as exposed" in r.stderr


def _node_cert(checkout: Path, ip: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "deploy/ray-node-cert.sh"), ip, str(out)],
                          capture_output=True, text=True)


def test_a_node_certificate_names_its_ip(checkout, tmp_path):
    assert _node_cert(checkout, "10.1.2.3", tmp_path / "a").returncode == 0
    san = _openssl("x509", "-in", str(tmp_path / "a/node.pem"), "-noout", "-ext", "subjectAltName")
    assert "IP Address:10.1.2.3" in san
    assert oct(os.stat(tmp_path / "a/node.key").st_mode & 0o777) == "0o600"
    r = subprocess.run(["bash", str(checkout / "deploy/ray-node-cert.sh"), "10.1.2.3", str(tmp_path / "b")],
                       capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)},
                       cwd=tmp_path)  # (the secrets are found beside the script, wherever it runs from)
    assert r.returncode == 0, r.stderr
    missing = tmp_path / "empty" / "deploy"
    shutil.copytree(DEPLOY, missing, ignore=shutil.ignore_patterns("secrets"))
    r = subprocess.run(["bash", str(missing / "ray-node-cert.sh"), "10.1.2.3", str(tmp_path / "c")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "run deploy/make-secrets.sh" in r.stderr


def _serve(cert: Path, key: Path, ca: Path) -> tuple[grpc.Server, int]:
    """A gRPC server with Ray's credentials (add_port_to_grpc_server: mutual TLS against the CA)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})])
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())], root_certificates=ca.read_bytes(),
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    return server, port


def _call(port: int, cert: Path, key: Path, ca: Path) -> bool:
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        try:
            return ch.unary_unary("/t.T/Echo")(b"x", timeout=5) == b"x"
        except grpc.RpcError:
            return False


def _leaf(tmp: Path, name: str, san: str, ca_pem: Path, ca_key: Path, chain: Path | None) -> Path:
    d = tmp / name
    d.mkdir()
    subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(d / "node.key"), "-out", str(d / "csr"), "-subj", "/CN=x"], check=True,
                   capture_output=True)
    (d / "ext").write_text(f"subjectAltName={san}\n")
    subprocess.run(["openssl", "x509", "-req", "-in", str(d / "csr"), "-CA", str(ca_pem), "-CAkey", str(ca_key),
                    "-set_serial", "7", "-extfile", str(d / "ext"), "-out", str(d / "leaf.pem")], check=True,
                   capture_output=True)
    (d / "node.pem").write_text((d / "leaf.pem").read_text() + (chain.read_text() if chain else ""))
    return d


def test_ray_style_mutual_tls_between_two_node_certificates(checkout, tmp_path):
    """Two nodes' certificates (leaf + issuer chain) talk over gRPC's TLS as Ray's channels do; a
    server whose certificate names another IP than the one dialled, or from another CA, is refused."""
    nodes = checkout / "deploy/secrets/nodes"
    ca = nodes / "ray-ca.pem"
    assert _node_cert(checkout, "127.0.0.1", tmp_path / "head").returncode == 0
    assert _node_cert(checkout, "10.0.0.7", tmp_path / "worker").returncode == 0
    head, worker = tmp_path / "head", tmp_path / "worker"
    other = _leaf(tmp_path, "other-ip", "IP:10.0.0.9", nodes / "ray-issuer.pem", nodes / "ray-issuer.key",
                  nodes / "ray-issuer.pem")
    foreign = _leaf(tmp_path, "foreign", "IP:127.0.0.1", checkout / "deploy/secrets/ca.pem",
                    checkout / "deploy/secrets/ca.key", None)
    for server_dir, want in ((head, True), (other, False), (foreign, False)):
        server, port = _serve(server_dir / "node.pem", server_dir / "node.key", ca)
        try:
            assert _call(port, worker / "node.pem", worker / "node.key", ca) is want, server_dir.name
        finally:
            server.stop(None)
    # and the server turns away a client without a certificate from Ray's CA
    server, port = _serve(head / "node.pem", head / "node.key", ca)
    try:
        assert not _call(port, foreign / "node.pem", foreign / "node.key", ca)
    finally:
        server.stop(None)
