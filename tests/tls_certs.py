"""Real certificates for TLS tests, made by the openssl command line: a CA, a server
certificate for 127.0.0.1 and localhost, and a client certificate, all signed by the CA."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> dict[str, Path]:
    """Writes ca.pem, server.pem/server.key, client.pem/client.key and other-ca.pem (a CA that
    signed nothing here) into ``d``; returns their paths by stem."""
    d.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=pdserve test {ca}",
                 cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                 f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pdserve test {name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return {p.stem if p.suffix == ".pem" else p.stem + "_key": p for p in d.iterdir() if p.suffix in (".pem", ".key")}
