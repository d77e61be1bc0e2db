"""The router's gRPC server (the Generation service, grpc.health.v1, reflection) and how a
streaming call's end becomes its status (``answer``)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.grpc_guard import server_kwargs  # limits, keepalive, connection age, Watch cap, drain
from router.reject import Reject, retry_after
from router.unread import Unread, relay

if TYPE_CHECKING:
    from router.server import Router

log = logging.getLogger("pdserve.router")


async def start_server(router: Router, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve ``router`` plus grpc.health.v1 and reflection; returns (server, bound port)."""
    lim, door = router.cfg.limits, router.door
    server = grpc.aio.server(**server_kwargs(router.cfg, door))
    pb_grpc.add_GenerationServicer_to_server(router, server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    if door.reflection:
        reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, door.tls.server_credentials()) if door.tls else \
        server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in ("", service):
        await _maybe_await(health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))
    return server, bound


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x):
        await x


async def answer(context, rid: str, responses, door: Any, hold: Any = None):
    """A streaming call's ``responses`` (router.server ``generate``, ``resume``), and its end as
    the client's status; a stream its client stops reading has ``hold`` parked after
    ``door.park_unread_s`` and ends after ``door.unread_stream_timeout_s`` (router.unread)."""
    try:  # (a stream its client stops reading ends here: router.unread)
        async for response in relay(responses, door.unread_stream_timeout_s, hold=hold, park_s=door.park_unread_s):
            yield response
    except Unread as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except Reject as e:
        if e.retry_after_s is None:
            await context.abort(e.code, str(e))
        await context.abort(e.code, str(e), trailing_metadata=(("retry-after", retry_after(e.retry_after_s)),))
    except Exception as e:  # a bug: INTERNAL naming it (not gRPC's bare UNKNOWN), the trace in the log
        log.exception("rid=%s event=internal_error", rid or "-")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in the router ({type(e).__name__}: {e}); "
                                                      "see its log")
