"""The gRPC transport: ``Push`` and ``Pull`` over raw ``bytes``, no generated code.

Methods of service :data:`~hvd_compress.ps_protocol.GRPC_SERVICE` are unary-unary with
a frame as request and response (``Push`` answers ``b"accepted"`` or ``b"duplicate"``).
Refusals map to gRPC status codes with a message saying what is wrong. With a token, every
call but the standard health service (``grpc.health.v1.Health``) must carry metadata
``authorization: Bearer <token>``. Message sizes are capped both ways.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hvd_compress.ps_protocol import GRPC_SERVICE, TOKEN_METADATA
from ps_server.service import ShardService
from ps_server.store import RequestError

log = logging.getLogger("ps_server")


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuse calls without the right bearer token (health checks excepted)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: bytes, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: pass the server's token (--token-file or "
                          "HVD_COMPRESS_PS_TOKEN) to the client")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return continuation(details)
        sent = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        sent = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent, self._expected):
            return continuation(details)
        log.warning("refused %s: missing or wrong token", details.method)
        return self._deny


class FrameHandler(Protocol):
    """What :func:`serve` answers requests with: a :class:`ShardService` (or, to measure
    the transport alone, a handler that does no work)."""

    def push(self, data: bytes, peer: str) -> bytes: ...

    def pull(self, data: bytes, peer: str, timeout: float) -> bytes: ...


def serve(service: FrameHandler, bind: str, pull_timeout: float, token: str | None = None,
          tls: tuple[bytes, bytes] | None = None, max_message_bytes: int = 256 << 20,
          threads: int = 64) -> tuple[grpc.Server, int]:
    """Start the gRPC server; returns it and the bound port (``bind`` may use port 0).

    A pull waits for its round up to the client's deadline, or ``pull_timeout`` seconds
    if the call has none. ``tls`` is ``(private key PEM, certificate chain PEM)``. Pulls
    hold a thread until their round finishes, so ``threads`` should exceed workers times
    tensors in flight.
    """

    def call(method: Callable[[bytes, str, grpc.ServicerContext], bytes]
             ) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                return method(request, context.peer(), context)
            except RequestError as err:
                context.abort(grpc.StatusCode[err.code], str(err))

        return handler

    def push(request: bytes, peer: str, context: grpc.ServicerContext) -> bytes:
        return service.push(request, peer)

    def pull(request: bytes, peer: str, context: grpc.ServicerContext) -> bytes:
        remaining = context.time_remaining()
        timeout = pull_timeout if remaining is None else max(remaining, 0.0)
        return service.pull(request, peer, timeout)

    handlers = {
        "Push": grpc.unary_unary_rpc_method_handler(call(push)),
        "Pull": grpc.unary_unary_rpc_method_handler(call(pull)),
    }
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0)]
    interceptors = [_TokenInterceptor(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads,
                                                    thread_name_prefix="grpc"),
                         interceptors=interceptors, options=options)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if tls is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, grpc.ssl_server_credentials([tls]))
    except RuntimeError as err:
        raise OSError(f"cannot listen on {bind}: {err} (port in use?)") from err
    if not port:
        raise OSError(f"cannot listen on {bind} (port in use?)")
    server.start()
    for name in ("", GRPC_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


def tick_forever(service: ShardService, stop: threading.Event) -> threading.Thread:
    """Expire rounds and write due checkpoints from a daemon thread until ``stop``."""
    interval = min(0.5, service.store.deadline / 4)

    def loop() -> None:
        while not stop.wait(interval):
            try:
                service.tick()
            except Exception:  # keep serving; the failure is in the log
                log.exception("periodic deadline check failed")

    thread = threading.Thread(target=loop, name="deadlines", daemon=True)
    thread.start()
    return thread
