"""A parameter-server client made only of the wire and protocol modules (no torch).

``python tests/frameworks_blocked.py tests.torch_free_client HOST:PORT WORKERS [TOKEN]``
pushes one round of tensor ``"t"`` (numel :data:`NUMEL`) from every worker id
concurrently, pulls the aggregate as worker 0 and prints it as JSON
``{"indices": [...], "values": [...], "health": "SERVING", "frameworks": [...]}``
(``frameworks``: any of torch/tensorflow/horovod found loaded, which must be none).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hvd_compress.ps_protocol import GRPC_PULL, GRPC_PUSH, GRPC_SERVICE, token_metadata
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame

NUMEL = 1000


def pairs(worker: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``w`` pushes indices ``{w, 10, 500 + w}`` with values ``w + 1``."""
    indices = np.array(sorted({worker, 10, 500 + worker}), np.int64)
    return indices, np.full(len(indices), worker + 1.0, np.float32)


def expected(workers: int) -> dict[int, float]:
    """The exact aggregate of :func:`pairs` over ``workers`` workers."""
    total: dict[int, float] = {}
    for w in range(workers):
        for i, v in zip(*pairs(w)):
            total[int(i)] = total.get(int(i), 0.0) + float(v)
    return total


def run_round(address: str, workers: int, token: str | None = None, tensor: str = "t",
              round: int = 0) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Push ``round`` of ``tensor`` from every worker, then pull it as each worker; returns
    worker 0's aggregate pairs and the byte sizes of every frame sent (pushes, pulls)."""
    metadata = token_metadata(token)
    sent: list[int] = []
    with grpc.insecure_channel(address) as channel:
        push = channel.unary_unary(GRPC_PUSH)
        pull = channel.unary_unary(GRPC_PULL)
        frames = [encode_frame(Kind.PUSH, tensor, 0, 1, round, w, NUMEL, *pairs(w))
                  for w in range(workers)]
        with ThreadPoolExecutor(workers) as pool:
            replies = list(pool.map(lambda f: push(f, timeout=30, metadata=metadata), frames))
        assert replies == [b"accepted"] * workers, replies
        pulls = [encode_frame(Kind.PULL, tensor, 0, 1, round, w, NUMEL)
                 for w in range(workers)]
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda f: pull(f, timeout=30, metadata=metadata), pulls))
        sent = [len(f) for f in frames + pulls]
    aggregate = decode_frame(results[0])
    assert all(r == results[0] for r in results), "workers got different aggregates"
    assert aggregate.kind is Kind.AGGREGATE and aggregate.round == round
    return aggregate.indices, aggregate.values.astype(np.float32), sent


def health(address: str) -> str:
    """The server's status for :data:`GRPC_SERVICE` by the standard gRPC health service."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=GRPC_SERVICE), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


if __name__ == "__main__":
    address, workers = sys.argv[1], int(sys.argv[2])
    token = sys.argv[3] if len(sys.argv) > 3 else None
    indices, values, _ = run_round(address, workers, token)
    print(json.dumps({"indices": indices.tolist(), "values": values.tolist(),
                      "health": health(address),
                      "frameworks": sorted({m.split(".")[0] for m in sys.modules}
                                           & {"torch", "tensorflow", "horovod"})}))
