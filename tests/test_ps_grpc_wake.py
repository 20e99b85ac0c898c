"""Pulls over a real gRPC server (in process, threads) get their round's aggregate whichever
way the round closes: a pull parked before the last push is woken by a push handled on
the event loop (``loop.call_soon``, no wake-up socket) or by one handled in the thread pool
(``call_soon_threadsafe``), and a pull after the round closed is answered at once; every
answer is the frame an in-process :class:`ShardService` gives for the same pushes."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from hvd_compress.ps_protocol import GRPC_SERVICE
from hvd_compress.sparse_wire import Frame, Kind, encode_frame
from ps_server import grpc_transport
from ps_server.service import ShardService
from ps_server.store import ShardStore

WORKERS = 3


class ParkedPulls(ShardService):
    """A service that says (``parked``) when a pull found its round still open."""

    def __init__(self, store: ShardStore) -> None:
        super().__init__(store)
        self.parked = threading.Semaphore(0)

    def try_pull(self, frame: Frame, peer: str) -> bytes | None:
        result = super().try_pull(frame, peer)
        if result is None:
            self.parked.release()
        return result


def pushes_of(round: int, numel: int, pairs: int, seed: int) -> list[bytes]:
    """Every worker's push of ``pairs`` random pairs for ``round`` (overlapping indices)."""
    rng = np.random.default_rng(seed)
    frames = []
    for w in range(WORKERS):
        idx = np.sort(rng.choice(numel, pairs, replace=False)).astype(np.int64)
        val = rng.standard_normal(pairs).astype(np.float32)
        frames.append(encode_frame(Kind.PUSH, "w", 0, 1, round, w, numel, idx, val))
    return frames


def pull_of(round: int, worker: int, numel: int) -> bytes:
    return encode_frame(Kind.PULL, "w", 0, 1, round, worker, numel)


def expected(rounds: list[list[bytes]], numel: int, mode: str) -> list[bytes]:
    """The aggregate frame of each round from an in-process service."""
    service = ShardService(ShardStore(WORKERS, 0, 1, mode))
    answers = []
    for r, frames in enumerate(rounds):
        for data in frames:
            service.push(data, "reference")
        answers.append(service.pull(pull_of(r, 0, numel), "reference", timeout=5.0))
    return answers


@pytest.mark.parametrize("mode", ["union", "topk"])
@pytest.mark.parametrize("where", ["inline", "pool"])
def test_parked_and_late_pulls_get_the_exact_aggregate(mode: str, where: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round: workers 0 and 1 push and pull (both pulls park), worker 2's push closes
    the round (on the event loop, or with ``where`` "pool" every push in the thread pool),
    then worker 2 pulls the closed round. Every pull returns the reference frame's bytes."""
    numel, pairs = 1 << 20, 5000
    rounds = [pushes_of(r, numel, pairs, seed=r) for r in range(3)]
    reference = expected(rounds, numel, mode)
    service = ParkedPulls(ShardStore(WORKERS, 0, 1, mode, deadline=30.0))
    if where == "pool":
        monkeypatch.setattr(grpc_transport, "INLINE_PUSH_BYTES", 0)
    server, port = grpc_transport.serve(service, "127.0.0.1:0", 30.0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        push = channel.unary_unary(f"/{GRPC_SERVICE}/Push")
        pull = channel.unary_unary(f"/{GRPC_SERVICE}/Pull")
        for r, frames in enumerate(rounds):
            waiting = []
            for w in (0, 1):
                assert push(frames[w], timeout=10) == b"accepted"
                waiting.append(pull.future(pull_of(r, w, numel), timeout=10))
            for _ in waiting:  # both pulls found the round open and wait on it
                assert service.parked.acquire(timeout=10)
            assert push(frames[2], timeout=10) == b"accepted"
            answers = [f.result() for f in waiting] + [pull(pull_of(r, 2, numel), timeout=10)]
            assert answers == [reference[r]] * WORKERS
    finally:
        channel.close()
        server.stop(0)
        service.close()
