"""What a scheme asks to have communicated.

A scheme's :meth:`~hvd_compress.schemes.base.Scheme.exchange` is a generator: it yields one
of these requests per communication round and receives the result. The pipeline names each
round ``hvdc.<tensor>.<round>`` (deterministic, identical on every rank, which is how
Horovod matches collectives), starts it asynchronously and counts its bytes, so codecs never
call a collective themselves and run unchanged in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AllReduce:
    """Element-wise **sum** over ranks of a dense tensor. Result: a tensor of the same shape."""

    round: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class AllGather:
    """Concatenate every rank's flat tensor in rank order.

    Result: a list with one tensor per rank. ``sizes`` gives each rank's element count when
    the scheme knows it (fixed-rate codecs); otherwise every rank's payload must be
    self-delimiting and the result is a one-element list holding the concatenation.
    """

    round: str
    tensor: torch.Tensor
    sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class AllToAll:
    """Send ``splits[r]`` consecutive elements of a flat tensor to rank ``r``.

    Result: a list with the tensor received from each rank, in rank order.
    """

    round: str
    tensor: torch.Tensor
    splits: tuple[int, ...]


@dataclass(frozen=True)
class SparseSum:
    """Sum over ranks of sparse vectors of length ``numel`` given as (index, value) pairs,
    each rank with its own indices. Result: the dense sum, a flat float32 tensor.

    A ring cannot sum these; the communicator gathers every rank's pairs (Horovod
    ``allgather``) or sends them to a parameter server.
    """

    round: str
    numel: int
    indices: torch.Tensor
    values: torch.Tensor


Collective = AllReduce | AllGather | AllToAll | SparseSum


def nbytes(op: Collective) -> int:
    """Bytes this rank hands to the collective (int32 index + float32 value per pair)."""
    if isinstance(op, SparseSum):
        return 8 * op.indices.numel()
    return op.tensor.numel() * op.tensor.element_size()


def sum_pairs(numel: int, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The dense float32 sum of (index, value) pairs; repeated indices add up."""
    total = torch.zeros(numel, dtype=torch.float32, device=values.device)
    return total.index_add_(0, indices.to(torch.long), values.to(torch.float32))
