"""Run one pipeline per rank on threads of a ThreadGroup (in-process multi-rank tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from hvd_compress import Pipeline, Policy
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.base import Scheme

T = TypeVar("T")


def make_pipelines(scheme: Scheme, size: int, policy: Policy | None = None,
                   average: bool = False, timeout: float = 30) -> list[Pipeline]:
    group = ThreadGroup(size, timeout=timeout)
    policy = policy or Policy(min_numel=1, compress_1d=True)
    return [Pipeline(scheme, group.communicator(r), policy, average=average)
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
