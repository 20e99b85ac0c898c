"""The gRPC transport: ``Push`` and ``Pull`` over raw ``bytes``, no generated code.

Methods of service :data:`~hvd_compress.ps_protocol.GRPC_SERVICE` are unary-unary with a
frame as request and response (``Push`` answers ``b"accepted"`` or ``b"duplicate"``).
Refusals map to gRPC status codes with a message saying what is wrong.

The server is gRPC's asyncio server, running its event loop in a thread of its own. A
pull that waits for its round is a coroutine parked on a per-tensor future (resolved when the
store says the tensor's round finished, failed, or became durable), not a thread: any
number of workers can wait at once, and pushes never queue behind waiting pulls. Pushes
are decoded and summed in a pool of ``threads`` threads, so one large push does not stall
the loop.

Before any request body is read, an interceptor checks the call's metadata: with a
token, every call but the standard health service (``grpc.health.v1.Health``) must carry
``authorization: Bearer <token>``; a call stating its job size
(:data:`~hvd_compress.ps_protocol.JOB_SIZE_METADATA`) must match ``--workers``; a call
carrying a worker identity (:data:`~hvd_compress.ps_protocol.IDENTITY_METADATA`) for a
worker of a session bound to another process is refused (``PERMISSION_DENIED``, see
:mod:`ps_server.store`), so an impersonating push never reaches a round. A refused
call is answered by a streaming handler that never reads the request, so an
unauthenticated client cannot make the server buffer its message; the refusal is logged
with the peer's address. Message sizes are capped both ways, and what a stream may send
before it is read is fixed (:data:`RECEIVE_WINDOW_BYTES`).

Health (``grpc.health.v1``): ``SERVING``, and ``NOT_SERVING`` while the server's checkpoint
writes fail (:attr:`ShardService.failing`); pushes and pulls are then refused with
``UNAVAILABLE`` and that message.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from functools import partial
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hvd_compress.ps_protocol import (
    GRPC_SERVICE,
    IDENTITY_METADATA,
    JOB_SIZE_METADATA,
    TOKEN_METADATA,
    parse_identity,
)
from ps_server.service import ShardService
from ps_server.store import RequestError

log = logging.getLogger("ps_server")

INLINE_PUSH_BYTES = 1 << 20
"""Pushes up to this size are handled on the event loop itself, larger ones in the
``threads`` pool, so one huge push does not stall every other call; below it the hand-off
to a thread costs about as much as decoding the push. Raise it if the pool shows up in
profiles of small pushes; the figures are in ``docs/benchmarks.md``."""

_TOKEN_HELP = ("missing or wrong token: pass the server's token (--token-file or "
               "HVD_COMPRESS_PS_TOKEN) to the client")


class FrameHandler(Protocol):
    """What :func:`serve` answers requests with: a :class:`ShardService` (or, to measure
    the transport alone, a handler that does no work and answers pulls at once)."""

    def push(self, data: bytes, peer: str) -> bytes: ...

    def pull(self, data: bytes, peer: str, timeout: float) -> bytes: ...


def _refusal(code: grpc.StatusCode, message: Callable[[str], str]) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request (a stream it never
    iterates), logging the peer."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        text = message(context.peer())
        await context.abort(code, text)

    return grpc.stream_unary_rpc_method_handler(refuse)


def call_identity(metadata: Any) -> tuple[str, int, bytes] | None:
    """The parsed :data:`~hvd_compress.ps_protocol.IDENTITY_METADATA` of a call's
    metadata (pairs), None without one; raises :class:`RequestError` for a bad one."""
    for key, value in metadata or ():
        if key == IDENTITY_METADATA:
            try:
                return parse_identity(value)
            except ValueError as err:
                raise RequestError(str(err)) from None
    return None


RECEIVE_WINDOW_BYTES = 1 << 20
"""What a stream may send the server before the server reads it (HTTP/2 flow control).
gRPC's default tunes it to the bandwidth-delay product it measures (BDP probing), and
then buffers megabytes per stream whether or not the call is ever read, refused calls
included. Fixed here (probing off), a refused call buffers at most about this much, and
one stream still carries 1 MB per round trip (25 Gbit/s at 300 us); a worker's pushes
are one stream per tensor, side by side. Replies are not limited by it: their window is
the client's. Memory and throughput before and after:
docs/results/ps-window-33e0495/README.md."""


class _Gate(grpc.aio.ServerInterceptor):
    """Refuse, on metadata alone, calls without the right token (health checks excepted),
    calls from a job whose size differs from the server's ``--workers`` and calls for a
    worker bound to another process."""

    def __init__(self, token: str | None, service: FrameHandler) -> None:
        self._expected = None if token is None else f"Bearer {token}".encode()
        self._service = service

        def unauthenticated(peer: str) -> str:
            log.warning("refused a call from %s: missing or wrong token", peer)
            if isinstance(service, ShardService):
                service.metrics.rejected("any", "Unauthenticated")
            return _TOKEN_HELP

        self._deny = _refusal(grpc.StatusCode.UNAUTHENTICATED, unauthenticated)

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if self._expected is not None:
            sent = metadata.get(TOKEN_METADATA, "")
            sent = sent.encode() if isinstance(sent, str) else sent
            if not hmac.compare_digest(sent, self._expected):
                return self._deny
        size = metadata.get(JOB_SIZE_METADATA)
        store = getattr(self._service, "store", None)
        if size is not None and store is not None and size != str(store.workers):
            return _refusal(grpc.StatusCode.FAILED_PRECONDITION,
                            lambda peer: self._mismatch(size, peer))
        if store is not None:
            refusal = self._bound_elsewhere(details)
            if refusal is not None:
                return refusal
        return await continuation(details)

    def _bound_elsewhere(self, details: grpc.HandlerCallDetails
                         ) -> grpc.RpcMethodHandler | None:
        """A refusal of a call whose identity is malformed or names a worker bound to
        another process; None to go on."""
        try:
            identity = call_identity(details.invocation_metadata)
        except RequestError as err:
            text = str(err)
            return _refusal(grpc.StatusCode.INVALID_ARGUMENT, lambda peer: text)
        if identity is None:
            return None
        session, worker, key = identity
        binding = self._service.store.bound_elsewhere(session, worker, key)
        if binding is None:
            return None
        method = details.method.rpartition("/")[2].lower()
        return _refusal(grpc.StatusCode.PERMISSION_DENIED,
                        lambda peer: self._service.identity_refused(method, session, worker,
                                                                    binding, peer))


    def _mismatch(self, size: str, peer: str) -> str:
        """The logged refusal of a job of ``size`` workers."""
        if not size.isdigit():
            return f"metadata {JOB_SIZE_METADATA}={size!r} is not a number of workers"
        try:
            self._service.check_job_size(int(size), peer)
        except RequestError as err:
            return str(err)
        return f"job size {size} accepted"  # not reached: the sizes differ


class GrpcServer:
    """A running :func:`serve`: its event loop thread and the gRPC server on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 server: grpc.aio.Server, executor: futures.ThreadPoolExecutor) -> None:
        self.loop, self.thread, self.server, self.executor = loop, thread, server, executor

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving (calls in flight get ``grace`` seconds); the returned event is set
        once the server and its loop have stopped."""
        done = threading.Event()

        async def shut_down() -> None:
            await self.server.stop(grace)
            self.loop.call_soon(self.loop.stop)

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(shut_down(), self.loop)
            self.thread.join()
        self.executor.shutdown(wait=False)
        done.set()
        return done


def serve(service: FrameHandler, bind: str, pull_timeout: float, token: str | None = None,
          tls: tuple[bytes, bytes] | None = None, max_message_bytes: int = 256 << 20,
          threads: int = 64) -> tuple[GrpcServer, int]:
    """Start the gRPC server; returns it and the bound port (``bind`` may use port 0).

    A pull waits for its round up to the client's deadline, or ``pull_timeout`` seconds
    if the call has none. ``tls`` is ``(private key PEM, certificate chain PEM)``.
    ``threads`` bounds the pushes processed at once (waiting pulls hold no thread).
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True)
    thread.start()
    executor = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc")
    try:
        server, port = asyncio.run_coroutine_threadsafe(
            _start(service, bind, pull_timeout, token, tls, max_message_bytes, executor),
            loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        executor.shutdown(wait=False)
        raise
    return GrpcServer(loop, thread, server, executor), port


async def _start(service: FrameHandler, bind: str, pull_timeout: float, token: str | None,
                 tls: tuple[bytes, bytes] | None, max_message_bytes: int,
                 executor: futures.ThreadPoolExecutor) -> tuple[grpc.aio.Server, int]:
    loop = asyncio.get_running_loop()
    # One future per tensor that pulls wait on, resolved (and replaced) when the store
    # says a pull of that tensor may have an answer: no task or event per waiting pull.
    waiters: dict[str, asyncio.Future[None]] = {}

    def wake(tensor: str) -> None:
        future = waiters.pop(tensor, None)
        if future is not None and not future.done():
            future.set_result(None)

    def waiter(tensor: str) -> asyncio.Future[None]:
        future = waiters.get(tensor)
        if future is None:
            future = waiters[tensor] = loop.create_future()
        return future

    loop_thread = threading.get_ident()

    def changed(tensor: str) -> None:  # called from any thread, with the store's lock
        if threading.get_ident() == loop_thread:  # an inline push closed the round:
            loop.call_soon(wake, tensor)  # no write to the loop's wake-up socket
            return
        try:
            loop.call_soon_threadsafe(wake, tensor)
        except RuntimeError:  # the loop has stopped
            pass

    store = getattr(service, "store", None)
    if store is not None:
        store.listeners.append(changed)

    async def refuse(context: grpc.aio.ServicerContext, err: RequestError) -> None:
        await context.abort(grpc.StatusCode[err.code], str(err))

    def identity(context: grpc.aio.ServicerContext) -> dict[str, Any]:
        """The call's worker identity as keywords of ``service.push``/``decode_pull``
        (none for a handler without a store, which takes none)."""
        if store is None:
            return {}
        return {"identity": call_identity(context.invocation_metadata())}

    async def push(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            who = identity(context)
            if len(request) <= INLINE_PUSH_BYTES:
                return service.push(request, context.peer(), **who)
            return await loop.run_in_executor(executor, partial(
                service.push, request, context.peer(), **who))
        except RequestError as err:
            await refuse(context, err)

    async def pull(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        peer = context.peer()
        remaining = context.time_remaining()
        timeout = pull_timeout if remaining is None else max(remaining, 0.0)
        try:
            if not isinstance(service, ShardService):  # answers at once (no rounds)
                return await loop.run_in_executor(executor, service.pull, request, peer,
                                                  timeout)
            frame = service.decode_pull(request, peer, **identity(context))
            result = service.try_pull(frame, peer)  # most pulls: the round has closed
            if result is not None:
                return result
            give_up = loop.time() + timeout
            while True:
                future = waiter(frame.tensor)  # before asking: a wake-up between is kept
                result = service.try_pull(frame, peer)
                if result is not None:
                    return result
                left = give_up - loop.time()
                if left <= 0:
                    service.timed_out(frame, peer, timeout)
                grace = service.store.quorum_wait(frame.tensor)  # closes then, unpushed
                # asyncio.wait neither cancels the shared future on timeout nor wraps it
                # in a task; a timeout or a wake-up for another round just asks again.
                await asyncio.wait((future,), timeout=left if grace is None else
                                   min(left, grace + 1e-3))
        except RequestError as err:
            await refuse(context, err)

    handlers = {
        "Push": grpc.unary_unary_rpc_method_handler(push),
        "Pull": grpc.unary_unary_rpc_method_handler(pull),
    }
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0),
               ("grpc.http2.lookahead_bytes", RECEIVE_WINDOW_BYTES)]
    server = grpc.aio.server(interceptors=[_Gate(token, service)], options=options)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    health_servicer = health.aio.HealthServicer()
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
    await server.start()
    await _set_health(health_servicer, getattr(service, "failing", None) is None)
    if isinstance(service, ShardService):
        service.health_listeners.append(lambda serving: asyncio.run_coroutine_threadsafe(
            _set_health(health_servicer, serving), loop))
    return server, port


async def _set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    """SERVING or NOT_SERVING for the server as a whole and for the PS service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else \
        health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", GRPC_SERVICE):
        await servicer.set(name, status)


def tick_forever(service: ShardService, stop: threading.Event) -> threading.Thread:
    """Expire rounds and idle tensors from a daemon thread until ``stop`` (and let the
    store tell a stopped process from missing pushes, see ``ShardStore.freeze_gap``)."""
    interval = min(0.5, service.store.deadline / 4)
    service.store.freeze_gap = max(2.0, 4 * interval)

    def loop() -> None:
        while not stop.wait(interval):
            try:
                service.tick()
            except Exception:  # keep serving; the failure is in the log
                log.exception("periodic deadline check failed")

    thread = threading.Thread(target=loop, name="deadlines", daemon=True)
    thread.start()
    return thread
