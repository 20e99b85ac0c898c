"""The gRPC transport: ``grpc://host:port[,host:port...]`` (one server per shard, in
shard order) or ``grpcs://...`` for TLS; a bare ``host:port`` is ``grpc://``.

The client retries what is safe to retry, with exponential back-off: a server that
is unreachable (it may be restarting from its checkpoint), a call cut off or timed out,
and a tensor the server does not know (it restarted without its state). Each retry
pushes again (an identical push is a no-op) and pulls; a server that keeps its
checkpoint answers no round before it is on disk, so after a restart every worker gets
the same aggregates. A server never reached is given up after ``connect_timeout``
seconds (nothing listens there), one that answered before after ``retry_timeout``. A
TLS handshake failure is not retried. A server that says it cannot make rounds durable
(its checkpoint writes fail, :data:`NOT_DURABLE`) is retried for :data:`NOT_DURABLE_WAIT`
seconds only, then its reason is raised. Every tensor's pulls start with its pushes and run
on their own, so one tensor waiting or retrying does not hold back the others. Anything
else raises :class:`~hvd_compress.comm.ps_transport.base.PSError` naming the tensor,
round, shard and server, and saying what it means.

Identity: a :class:`PSClient` draws a random secret when it is made
(:data:`~hvd_compress.ps_protocol.WORKER_SECRET_BYTES` from :mod:`secrets`) and sends it
with every push and pull, with its worker id and the tensor's session
(:func:`~hvd_compress.ps_protocol.identity_metadata`). Each server binds the worker of
the session to the first secret it sees, so another process using the same worker id
(two ranks launched with one id, or any token holder) is refused with
``PERMISSION_DENIED`` before its push is read, while this client's own reconnects and
retries, which carry the same secret, go on.
"""

from __future__ import annotations

import logging
import os
import random
import re
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from hvd_compress.comm.ps_transport.base import (
    LATE,
    PendingRound,
    ShardedClient,
    SpecError,
    Transport,
    join_forms,
)
from hvd_compress.ps_protocol import (
    CA_ENV,
    CONNECT_TIMEOUT_ENV,
    GRPC_SERVICE,
    JOB_SIZE_METADATA,
    RETRY_TIMEOUT_ENV,
    TOKEN_ENV,
    TOKEN_METADATA,
    WORKER_SECRET_BYTES,
    identity_metadata,
    session_of,
)

log = logging.getLogger("hvd_compress.ps_client")  # its name before the split

CONNECT_TIMEOUT = 10.0
"""Default seconds to reach a server never reached before: long enough for a server
started at the same time as the workers, short for an address where nothing listens."""
RETRY_TIMEOUT = 60.0
"""Default seconds to keep retrying a server that answered before (a restart)."""
NOT_DURABLE = "the server keeps retrying and refuses pushes and pulls"
"""In the detail of an ``UNAVAILABLE``: the server runs but cannot make rounds durable
(its checkpoint writes fail; ``ps_server.service.write_failure`` words it), so this is no
restart to wait out."""
NOT_DURABLE_WAIT = 5.0
"""Seconds to retry a server that cannot make rounds durable before failing with its
reason: a fault that passes this soon goes unnoticed, a full disk stops the job in
seconds with the server's message instead of after ``retry_timeout``."""
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "NOT_FOUND"})
"""Codes after which pushing again and pulling again cannot change a sum: the server was
unreachable or the call was cut off (``UNAVAILABLE``, ``CANCELLED``), the pull timed out
while its round was open (``DEADLINE_EXCEEDED``), the server lost the tensor
(``NOT_FOUND``, a restart without checkpoint; the push registers it again)."""

FORMS = ("'grpc://host:port[,host:port...]' (one address per shard, in shard order)",
         "'grpcs://host:port[,host:port...]' (TLS)")
"""The forms of a gRPC ``ps=`` spec, for error messages."""
_FORMS = join_forms(list(FORMS))


def timeout_setting(value: float | None, env: str, default: float, name: str) -> float:
    """``value``, else ``$env``, else ``default``: a positive number of seconds."""
    origin = name
    if value is None and os.environ.get(env):
        origin, text = f"${env}", os.environ[env]
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{origin}={text!r} is not a number of seconds") from None
    value = default if value is None else value
    if not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{origin} must be a positive number of seconds, got {value!r}")
    return float(value)


_HOST = re.compile(r"\[[0-9A-Fa-f:.]+(%[\w.-]+)?\]|[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?")


def address_problem(address: str) -> str | None:
    """What is wrong with ``HOST:PORT`` (no scheme), or ``None`` when it is well formed."""
    if not address:
        return "the address is empty"
    host, sep, port = address.rpartition(":")
    if not sep:
        return "it has no port (HOST:PORT)"
    if not port.isdigit():
        return f"the port {port!r} is not a number"
    if not 1 <= int(port) <= 65535:
        return f"the port {port} is not in 1..65535"
    if not host:
        return "it has no host (HOST:PORT)"
    if ":" in host and not host.startswith("["):
        return f"an IPv6 host goes in brackets, [{host}]:{port}"
    if not _HOST.fullmatch(host):
        return f"the host {host!r} is not a host name or IP address"
    return None


def parse_addresses(spec: str | Sequence[str], origin: str | None = None
                    ) -> tuple[list[str], bool]:
    """``"grpc://h:p,h:p"`` (or ``grpcs://`` for TLS, or a list; a bare ``h:p`` is
    ``grpc://``) -> (["h:p", ...], tls).

    Raises :class:`~hvd_compress.comm.ps_transport.base.SpecError` (a ``ValueError``)
    naming the bad address and the accepted forms for anything else:
    another scheme (``http://``), a port that is not a number in 1..65535, an empty
    address, ``grpc://`` mixed with ``grpcs://``, or one address listed twice. ``origin``
    (such as ``"ps"``) names where ``spec`` came from in the message.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    where = f"{origin}={spec!r}" if origin else repr(spec)
    schemes: set[str] = set()
    addresses: list[str] = []
    for item in (i.strip() for i in items):
        scheme, sep, rest = item.partition("://")
        if sep:
            if scheme.lower() not in ("grpc", "grpcs"):
                raise SpecError(f"invalid parameter server address {item!r} in {where}: "
                                f"{scheme + '://'!r} is not supported", _FORMS)
            schemes.add(scheme.lower())
        address = rest if sep else item
        problem = address_problem(address)
        if problem is not None:
            raise SpecError(f"invalid parameter server address {item!r} in {where}: "
                            f"{problem}", _FORMS)
        if address in addresses:
            raise ValueError(f"parameter server address {address!r} is listed twice in "
                             f"{where}; give each shard its own server")
        addresses.append(address)
    if not addresses:
        raise SpecError(f"no parameter server address given in {where}", _FORMS)
    if len(schemes) > 1:
        raise ValueError(f"{where} mixes grpc:// and grpcs://; every shard is reached the same "
                         "way (grpcs:// for TLS)")
    return addresses, schemes == {"grpcs"}


class PSClient(ShardedClient):
    """gRPC client of one parameter server per shard.

    Args:
        addresses: ``"grpc://h:p,h:p"`` (shard order), ``grpcs://`` for TLS, or a list.
        worker: this worker's id, ``0 <= worker < --workers``.
        token: the servers' token; defaults to ``$HVD_COMPRESS_PS_TOKEN`` when set.
        root_certificates: PEM of the CA (or self-signed certificate) to trust; turns on
            TLS. ``tls_server_name`` overrides the name checked in the certificate.
        value_dtype: ``"fp32"`` or ``"fp16"`` values on the wire, both directions; by
            default pushes in the values' own (fp16 for float16 values, fp32 otherwise) and
            aggregates in fp32.
        timeout: seconds one call may take (a pull waits for the slowest worker).
        connect_timeout: how long to retry a server this client never reached
            (``$HVD_COMPRESS_PS_CONNECT_TIMEOUT``, else :data:`CONNECT_TIMEOUT`).
        retry_timeout: how long to keep retrying a server that answered before
            (``$HVD_COMPRESS_PS_RETRY_TIMEOUT``, else :data:`RETRY_TIMEOUT`).
        workers: the job's number of workers, sent with every call: a server started
            with another ``--workers`` refuses the first call at once, naming both.

    Each client draws its own secret (see the module docstring), so one client per
    worker process: a second client made with the same ``worker`` for the same session
    is another process to the servers and is refused (``PERMISSION_DENIED``) once the
    first has called. The secret travels in the call metadata beside the token, so it is
    as exposed as the token: use TLS where the network is not trusted.
    """

    def __init__(self, addresses: str | Sequence[str], worker: int, *,
                 token: str | None = None, root_certificates: bytes | None = None,
                 tls_server_name: str | None = None, value_dtype: str | None = None,
                 timeout: float = 300.0, retry_timeout: float | None = None,
                 connect_timeout: float | None = None, workers: int | None = None,
                 max_message_bytes: int = 256 << 20) -> None:
        import grpc

        super().__init__(worker, value_dtype)
        self._grpc = grpc
        self.addresses, tls = parse_addresses(addresses)
        self.timeout = timeout
        self.retry_timeout = timeout_setting(retry_timeout, RETRY_TIMEOUT_ENV, RETRY_TIMEOUT,
                                             "retry_timeout")
        self.connect_timeout = timeout_setting(connect_timeout, CONNECT_TIMEOUT_ENV,
                                               CONNECT_TIMEOUT, "connect_timeout")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._token = ((TOKEN_METADATA, f"Bearer {token}"),) if token else ()
        self._secret = secrets.token_bytes(WORKER_SECRET_BYTES)  # this process's identity
        self._session_metadata: dict[str, tuple[tuple[str, Any], ...]] = {}
        self.job_size = workers
        self._reached = [False] * len(self.addresses)
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        self._channels = []
        self._tls = tls or root_certificates is not None
        for address in self.addresses:
            if self._tls:
                creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
                self._channels.append(grpc.secure_channel(address, creds, options=options))
            else:
                self._channels.append(grpc.insecure_channel(address, options=options))
        self._push = [c.unary_unary(f"/{GRPC_SERVICE}/Push") for c in self._channels]
        self._pulls = [c.unary_unary(f"/{GRPC_SERVICE}/Pull") for c in self._channels]
        # Pushes never wait for other workers and pulls only for pushes already sent, so
        # two bounded pools cannot deadlock whatever order workers start tensors in. Each
        # tensor's pulls start with its pushes (see the module docstring): up to
        # PULLS_IN_FLIGHT rounds per shard wait or retry side by side.
        self._push_pool = ThreadPoolExecutor(max_workers=len(self.addresses),
                                             thread_name_prefix="ps-push")
        self._pull_pool = ThreadPoolExecutor(
            max_workers=self.PULLS_IN_FLIGHT * len(self.addresses),
            thread_name_prefix="ps-pull")

    PULLS_IN_FLIGHT = 16
    """Rounds per shard whose pulls wait at once (threads of the pull pool, per shard)."""

    @property
    def job_size(self) -> int | None:
        """The job's number of workers as told to the servers (None: not told)."""
        return self._job_size

    @job_size.setter
    def job_size(self, workers: int | None) -> None:
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive number, got {workers!r}")
        self._job_size = workers
        size = () if workers is None else ((JOB_SIZE_METADATA, str(workers)),)
        self._metadata = self._token + size
        self._session_metadata.clear()

    def expect_workers(self, workers: int) -> None:
        """Set :attr:`job_size` to ``workers`` unless it was given."""
        if self.job_size is None:
            self.job_size = workers

    def metadata(self, tensor: str) -> tuple[tuple[str, Any], ...]:
        """The metadata of every call for ``tensor``: the token, the job size and this
        worker's identity in the tensor's session (made once per session)."""
        session = session_of(tensor)
        metadata = self._session_metadata.get(session)
        if metadata is None:
            metadata = (*self._metadata,
                        identity_metadata(session, self.worker, self._secret))
            self._session_metadata[session] = metadata
        return metadata

    def _send_pushes(self, pending: PendingRound) -> None:
        metadata = self.metadata(pending.tensor)
        pending.pushed = [self._push_pool.submit(self._push[s], frame, timeout=self.timeout,
                                                 metadata=metadata)
                          for s, frame in enumerate(pending.pushes)]  # none if pull_only
        pending.pulled = [self._pull_pool.submit(self._shard_pull, pending, s)
                          for s in range(len(pending.pulls))]

    def _pull(self, pending: PendingRound) -> list[bytes]:
        return [job.result() for job in pending.pulled]

    def _shard_pull(self, pending: PendingRound, shard: int) -> bytes:
        """Wait for the shard's push, then pull; after a failure that is safe to retry
        (:data:`RETRYABLE`), push again and pull, with exponential back-off, until
        ``connect_timeout`` (a server never reached) or ``retry_timeout`` has passed."""
        grpc, tensor, round = self._grpc, pending.tensor, pending.round
        start, delay = time.monotonic(), 0.05
        push = _nothing if pending.pull_only else pending.pushed[shard].result
        metadata = self.metadata(tensor)
        while True:
            try:
                self._push_or_late(push, pending, shard)
                reply = self._pulls[shard](pending.pulls[shard], timeout=self.timeout,
                                           metadata=metadata)
                self._reached[shard] = True
                return reply
            except grpc.RpcError as err:
                code, detail = err.code(), err.details() or ""
                if code is not grpc.StatusCode.UNAVAILABLE:
                    self._reached[shard] = True  # the server answered
                waited = time.monotonic() - start
                limit = self.retry_timeout if self._reached[shard] else self.connect_timeout
                not_durable = code is grpc.StatusCode.UNAVAILABLE and NOT_DURABLE in detail
                if not_durable:
                    limit = min(limit, NOT_DURABLE_WAIT)
                tls = _tls_failure(detail)
                if code is grpc.StatusCode.UNAVAILABLE and not self._reached[shard] and \
                        not self._tls and _plain_to_tls(detail, self.addresses[shard]):
                    raise self._error(tensor, round, shard, code.name, _PLAIN_TO_TLS
                                      + detail) from None
                if code.name in RETRYABLE and not tls and waited + delay < limit:
                    log.warning("parameter server shard %d (%s): %s (%s); retrying tensor %r "
                                "round %d in %.2f s", shard, self.addresses[shard], code.name,
                                detail, tensor, round, delay)
                    time.sleep(delay * (1 + 0.2 * random.random()))
                    delay = min(2 * delay, 2.0)
                    if not pending.pull_only:
                        push = partial(self._push[shard], pending.pushes[shard],
                                       timeout=self.timeout, metadata=metadata)
                    continue
                if tls:
                    detail = (f"TLS handshake failed: {detail} (check the certificate "
                              f"(root_certificates, ${CA_ENV}) and the name it is "
                              "issued to (tls_server_name))")
                elif not_durable:
                    detail = f"the server cannot make rounds durable ({waited:.1f} s): {detail}"
                elif code is grpc.StatusCode.UNAVAILABLE and self._reached[shard]:
                    detail = (f"unreachable for {waited:.1f} s (retry_timeout "
                              f"{self.retry_timeout:g} s): {detail}")
                elif code is grpc.StatusCode.UNAVAILABLE:
                    detail = (f"nothing answered at this address for {waited:.1f} s "
                              f"(connect_timeout {self.connect_timeout:g} s; is the server "
                              f"running there?): {detail}")
                elif code.name in RETRYABLE:
                    detail = f"still failing after {waited:.1f} s of retries: {detail}"
                raise self._error(tensor, round, shard, code.name, detail) from None

    def _push_or_late(self, push: Any, pending: PendingRound, shard: int) -> None:
        """Run ``push`` (wait for, or send, the shard's push); a refusal as late
        (:data:`~hvd_compress.comm.ps_transport.base.LATE`) is kept in ``pending.late``."""
        try:
            push()
        except self._grpc.RpcError as err:
            if err.code().name != LATE:
                raise
            pending.late[shard] = err.details() or LATE

    def health(self, timeout: float = 5.0) -> list[str]:
        """Each server's health status name (``SERVING``...), by the standard service."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        statuses = []
        for channel in self._channels:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=GRPC_SERVICE),
                               timeout=timeout)
            statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        return statuses

    def close(self) -> None:
        self._push_pool.shutdown(wait=False)
        self._pull_pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tls_failure(detail: str) -> bool:
    """Whether a gRPC error's details describe a failed TLS handshake (not worth a retry:
    the certificate or the server name is wrong)."""
    text = detail.lower()
    return any(word in text for word in ("handshake", "ssl", "certificate"))


_PLAIN_TO_TLS = ("a server accepts connections at this address but closes plaintext gRPC "
                 "connections: it probably serves TLS (started with --tls-cert), so reach it "
                 "with grpcs:// and root_certificates: ")


def _plain_to_tls(detail: str, address: str, timeout: float = 2.0) -> bool:
    """Whether a plaintext client's failure to reach ``address`` is a TLS server hanging
    up on it: gRPC says the socket was closed (a TCP connection was accepted, then
    dropped), and a TCP connection there opens but, sent an HTTP/2 preface, does not
    answer with the SETTINGS frame a plaintext gRPC server sends (a TLS server closes it
    or answers a TLS alert). Only asked for a server this client never reached, so a
    server that restarts (refused connections) is still retried."""
    import socket

    if "socket closed" not in detail.lower():
        return False
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            reply = sock.recv(9)  # an HTTP/2 frame header: type (byte 3) 4 is SETTINGS
            return not (len(reply) >= 4 and reply[3] == 4)
    except OSError:
        return False




class GrpcTransport(Transport):
    """``grpc://`` and ``grpcs://`` specs: :class:`PSClient`, trusting the certificate in
    ``$HVD_COMPRESS_PS_CA`` (:data:`~hvd_compress.ps_protocol.CA_ENV`) when set."""

    schemes = ("grpc", "grpcs")
    forms = FORMS

    def check(self, spec: str, origin: str) -> str:
        parse_addresses(spec, origin)
        return spec

    def connect(self, spec: str, worker: int, *, workers: int | None = None,
                connect_timeout: float | None = None, retry_timeout: float | None = None
                ) -> PSClient:
        ca = os.environ.get(CA_ENV)
        return PSClient(spec, worker, root_certificates=Path(ca).read_bytes() if ca else None,
                        workers=workers, connect_timeout=connect_timeout,
                        retry_timeout=retry_timeout)


def _nothing() -> None:
    """The push of a pull-only round (a skipped round: nothing to send)."""
