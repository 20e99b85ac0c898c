"""The Communicator protocol: how the pipeline reaches a collective library."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hvd_compress.comm.ops import Collective
from hvd_compress.ps_protocol import poll_until  # noqa: F401 (defined there, torch-free)

SUM_AS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.float32}
"""Dtypes summed in a wider dtype that holds every sum exactly, then rounded back once (the
same on every rank): Horovod 0.28.1 cannot sum bfloat16, and every communicator sums it
this way so that the result does not depend on which one carried it."""
MOVE_AS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
"""Dtypes Horovod cannot move, and the same-sized dtype whose bits stand in for them."""


class Communicator(Protocol):
    """Asynchronous collectives among ``size`` ranks, matched across ranks by name.

    ``start`` must not block on other ranks; ``wait`` returns the result in the shape the
    request documents (see :mod:`hvd_compress.comm.ops`). Every rank starts the same names,
    in any order, unless the communicator has a true ``ordered`` attribute: it matches
    collectives by the order they are started (Gloo's), and the pipeline then starts them
    in an order every rank reproduces.
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
