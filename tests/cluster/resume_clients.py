"""Clients for the resume tests (tests/cluster/test_ha.py): a TCP proxy whose loss is a router's
loss to its clients, and an OpenAI streaming client that retries with its Idempotency-Key."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """A TCP forwarder to ``127.0.0.1:target`` whose ``close`` drops every connection at once."""

    def __init__(self, target: int) -> None:
        self.target, self.socks, self.closed = target, [], False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client = self.listener.accept()[0]
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        for s in [self.listener, *self.socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def http_stream(port: int, token: str, prompt: str, max_tokens: int, key: str | None = None,
                on_chunk=lambda: None, stream: bool = True) -> str:
    """A greedy completion's text through the OpenAI API on ``port``, streamed unless ``stream``
    is false, with ``key`` as its Idempotency-Key. Raises ConnectionError if a stream breaks
    before its end."""
    headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
    if key is not None:
        headers["idempotency-key"] = key
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), headers)
    text = ""
    with urllib.request.urlopen(req, timeout=60) as r:
        if not stream:
            return json.loads(r.read())["choices"][0]["text"]
        for line in r:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                on_chunk()
            elif line.startswith(b"data: [DONE]"):
                return text
    raise ConnectionError("the stream ended without [DONE]: its server was lost")


def http_retrying(ports: list[int], *args, **kwargs) -> str:
    """``http_stream`` as an HTTP client with retries sends it: the same request to each address
    in turn until one answers it whole (within a minute)."""
    deadline = time.monotonic() + 60
    while True:
        for port in ports:
            try:
                return http_stream(port, *args, **kwargs)
            except (urllib.error.URLError, OSError, http.client.HTTPException):  # (refused, cut, 503)
                assert time.monotonic() < deadline, "no router answered the retried request"
        time.sleep(0.2)
