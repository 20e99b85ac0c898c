"""Run one pipeline per rank on threads of a ThreadGroup (in-process multi-rank tests)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hvd_compress import Pipeline, Policy
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import Collective
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.pipeline import DEFAULT_BUCKET_BYTES
from hvd_compress.schemes.base import Scheme

T = TypeVar("T")


class RecordingCommunicator:
    """Wraps a communicator and records the name and request of every ``start``, the
    request as it was handed over (a copy: an in-place all-reduce overwrites its tensor)."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.started: list[tuple[str, Collective]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.started]

    def start(self, name: str, op: Collective) -> Any:
        tensor = getattr(op, "tensor", None)
        copy = op if tensor is None else dataclasses.replace(op, tensor=tensor.clone())
        self.started.append((name, copy))
        return self.inner.start(name, op)

    def wait(self, handle: Any) -> torch.Tensor | list[torch.Tensor]:
        return self.inner.wait(handle)


def make_pipelines(scheme: Scheme, size: int, policy: Policy | None = None,
                   average: bool = False, timeout: float = 30,
                   bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                   record: bool = False) -> list[Pipeline]:
    """One pipeline per rank of a new :class:`ThreadGroup`. ``record``: each pipeline's
    ``comm`` is a :class:`RecordingCommunicator`."""
    group = ThreadGroup(size, timeout=timeout)
    policy = policy or Policy(min_numel=1, compress_1d=True)
    comms: list[Any] = [group.communicator(r) for r in range(size)]
    if record:
        comms = [RecordingCommunicator(c) for c in comms]
    return [Pipeline(scheme, comms[r], policy, average=average, bucket_bytes=bucket_bytes)
            for r in range(size)]


def on_threads(size: int, work: Callable[[int], T]) -> list[T]:
    """Run ``work(rank)`` on one thread per rank; re-raise the first error."""
    results: list[T | None] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # handed to the caller below
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results  # type: ignore[return-value]
