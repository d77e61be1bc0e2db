"""A gRPC server with the router's port options (router.grpc_guard) and one streaming method,
for tests of keepalive on real sockets: ``python -m tests.router.keepalive_server PORT``
streams a message every 0.2 s forever (a process a test can SIGSTOP); ``served(silent_s)``
answers once after ``silent_s`` of silence (what a queued request looks like on the wire)."""

from __future__ import annotations

import sys
import time
from concurrent import futures

import grpc

from router.config import load_config
from router.grpc_guard import server_options

METHOD = "/t.T/S"


def served(port: int, silent_s: float | None) -> grpc.Server:
    """Started on 127.0.0.1:``port`` (0: a free one, in ``server.port``)."""
    def stream(request: bytes, context):
        if silent_s is not None:
            time.sleep(silent_s)
            yield b"done"
            return
        while context.is_active():
            yield b"tick"
            time.sleep(0.2)

    cfg = load_config(None)
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(cfg.front_door, cfg.limits))
    handler = grpc.method_handlers_generic_handler("t.T", {"S": grpc.unary_stream_rpc_method_handler(stream)})
    server.add_generic_rpc_handlers((handler,))
    server.port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def call(channel: grpc.Channel, timeout: float):
    return channel.unary_stream(METHOD)(b"", timeout=timeout)


if __name__ == "__main__":
    s = served(int(sys.argv[1]), None)
    print("serving", flush=True)
    s.wait_for_termination()
