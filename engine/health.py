"""The standard gRPC health service (grpc.health.v1.Health; proto.standard's stubs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from proto.standard import health_pb2 as pb
from proto.standard import health_pb2_grpc

SERVING = pb.HealthCheckResponse.SERVING
NOT_SERVING = pb.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = pb.HealthCheckResponse.SERVICE_UNKNOWN
ECHO_CHARS = 256  # the most of a request's service name an error message repeats


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Per-service status ("" = the whole server); Check answers NOT_FOUND for an unknown service, Watch
    streams the current status and every change."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._watchers: dict[str, set[asyncio.Queue[int]]] = {}

    def set(self, service: str, status: int) -> None:
        """Call on the server's event loop."""
        self._status[service] = status
        for queue in self._watchers.get(service, ()):
            queue.put_nowait(status)

    def set_all(self, status: int) -> None:
        for service in list(self._status):
            self.set(service, status)

    async def Check(self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> pb.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:  # (the name echoed at most ECHO_CHARS long: trailing metadata has a hard size limit)
            name = request.service
            shown = repr(name) if len(name) <= ECHO_CHARS else f"{name[:ECHO_CHARS]!r}... ({len(name)} characters)"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {shown}")
        return pb.HealthCheckResponse(status=status)

    async def List(self, request: "pb.HealthListRequest", context: grpc.aio.ServicerContext
                   ) -> "pb.HealthListResponse":
        """Every service's status ("" = the whole server)."""
        return pb.HealthListResponse(statuses={name: pb.HealthCheckResponse(status=status)
                                               for name, status in self._status.items()})

    async def Watch(self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.HealthCheckResponse]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._watchers.setdefault(request.service, set()).add(queue)
        try:
            last = self._status.get(request.service, SERVICE_UNKNOWN)
            yield pb.HealthCheckResponse(status=last)
            while True:
                status = await queue.get()
                if status != last:
                    last = status
                    yield pb.HealthCheckResponse(status=status)
        finally:
            self._watchers[request.service].discard(queue)
