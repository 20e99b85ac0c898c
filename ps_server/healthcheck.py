"""``python -m ps_server.healthcheck [HOST:PORT]``: exit 0 if the server says SERVING.

Asks the standard gRPC health service (``grpc.health.v1.Health/Check``, which needs no
token) about :data:`~hvd_compress.ps_protocol.GRPC_SERVICE`; the container image's
``HEALTHCHECK``. The address defaults to the server's own ``$HVD_PS_BIND`` (a wildcard
host becomes 127.0.0.1; default 127.0.0.1:7070). With ``$HVD_PS_TLS_CERT`` set the check
uses TLS and trusts that certificate, checking it for the name ``$HVD_PS_HEALTH_TLS_NAME``
(default ``localhost``). Exit status 1 names the status or the error on stderr.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hvd_compress.ps_protocol import GRPC_SERVICE


def target(bind: str) -> str:
    """The address to probe for a ``--bind`` address: wildcard hosts mean loopback."""
    host, _, port = bind.rpartition(":")
    return f"{'127.0.0.1' if host in ('', '0.0.0.0', '[::]', '::') else host}:{port}"


def check(address: str, timeout: float = 5.0) -> str:
    """The health status name (``SERVING``...) of the server at ``address``."""
    cert = os.environ.get("HVD_PS_TLS_CERT")
    if cert:
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        name = os.environ.get("HVD_PS_HEALTH_TLS_NAME", "localhost")
        channel = grpc.secure_channel(address, creds,
                                      options=[("grpc.ssl_target_name_override", name)])
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=GRPC_SERVICE), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str]) -> int:
    address = target(argv[0] if argv else os.environ.get("HVD_PS_BIND", "127.0.0.1:7070"))
    try:
        status = check(address)
    except (grpc.RpcError, OSError) as err:
        detail = err.details() if isinstance(err, grpc.RpcError) else err
        print(f"hvd-ps-server at {address} unhealthy: {detail}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"hvd-ps-server at {address} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
