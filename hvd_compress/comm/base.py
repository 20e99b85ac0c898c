"""The Communicator protocol: how the pipeline reaches a collective library."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from hvd_compress.comm.ops import Collective


class Communicator(Protocol):
    """Asynchronous collectives among ``size`` ranks, matched across ranks by name.

    ``start`` must not block on other ranks; ``wait`` returns the result in the shape the
    request documents (see :mod:`hvd_compress.comm.ops`). Every rank starts the same names,
    in any order.
    """

    rank: int
    size: int

    def start(self, name: str, op: Collective) -> Any: ...

    def wait(self, handle: Any) -> torch.Tensor | list[torch.Tensor]: ...


def split_gathered(
    gathered: torch.Tensor, sizes: tuple[int, ...] | None
) -> list[torch.Tensor]:
    """Turn a concatenated all-gather result into the per-rank list ``AllGather`` promises."""
    if sizes is None:
        return [gathered]
    if sum(sizes) != gathered.numel():
        raise RuntimeError(f"all-gather returned {gathered.numel()} elements, "
                           f"expected {sum(sizes)} ({list(sizes)} per rank)")
    return list(torch.split(gathered, list(sizes)))


def poll_until(ready: Callable[[], bool], longest_sleep: float = 5e-4) -> None:
    """Return once ``ready()`` is true, sleeping between polls (1 µs, doubling up to
    ``longest_sleep`` seconds, the most latency this adds).

    Horovod's ``synchronize`` and a blocking MPI receive spin until their message arrives,
    keeping a core busy that Horovod's background thread, the other ranks on the host and
    the parameter-server client need; waiting through this function leaves it to them.
    """
    sleep = 1e-6
    while not ready():
        time.sleep(sleep)
        sleep = min(2 * sleep, longest_sleep)
