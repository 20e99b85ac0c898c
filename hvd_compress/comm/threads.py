"""An in-process group of ranks, one thread each, for tests and benchmarks.

It implements the :class:`~hvd_compress.comm.base.Communicator` protocol with the same
name matching as Horovod: rank ``r``'s ``k``-th request named ``n`` meets every other rank's
``k``-th request of that name. A rank that waits for peers who never arrive gets a
``TimeoutError`` naming the collective and the missing ranks instead of hanging.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, SparseSum, sum_pairs


@dataclass
class _Meeting:
    requests: dict[int, Collective] = field(default_factory=dict)
    results: dict[int, torch.Tensor | list[torch.Tensor]] | None = None
    collected: int = 0


class ThreadGroup:
    """``size`` ranks living in one process; hand ``communicator(r)`` to rank ``r``'s thread."""

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got size={size}")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._meetings: dict[tuple[str, int], _Meeting] = {}
        self._sequence: dict[int, defaultdict[str, int]] = {
            r: defaultdict(int) for r in range(size)
        }

    def communicator(self, rank: int) -> ThreadCommunicator:
        return ThreadCommunicator(self, rank)

    def _start(self, rank: int, name: str, op: Collective) -> tuple[str, int, int]:
        with self._cond:
            seq = self._sequence[rank][name]
            self._sequence[rank][name] += 1
            meeting = self._meetings.setdefault((name, seq), _Meeting())
            meeting.requests[rank] = op
            if len(meeting.requests) == self.size:
                meeting.results = _combine([meeting.requests[r] for r in range(self.size)])
                self._cond.notify_all()
        return name, seq, rank

    def _wait(self, handle: tuple[str, int, int]) -> torch.Tensor | list[torch.Tensor]:
        name, seq, rank = handle
        with self._cond:
            meeting = self._meetings[(name, seq)]
            if not self._cond.wait_for(lambda: meeting.results is not None, self.timeout):
                missing = sorted(set(range(self.size)) - set(meeting.requests))
                raise TimeoutError(f"collective {name!r} (call {seq}) waited {self.timeout}s "
                                   f"for rank(s) {missing}")
            assert meeting.results is not None
            result = meeting.results[rank]
            meeting.collected += 1
            if meeting.collected == self.size:
                del self._meetings[(name, seq)]
            return result


class ThreadCommunicator:
    """One rank's view of a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.size = group.size

    def start(self, name: str, op: Collective) -> tuple[str, int, int]:
        return self._group._start(self.rank, name, op)

    def wait(self, handle: tuple[str, int, int]) -> torch.Tensor | list[torch.Tensor]:
        return self._group._wait(handle)


def _combine(requests: list[Collective]) -> dict[int, torch.Tensor | list[torch.Tensor]]:
    """Every rank's result of one collective, given every rank's request (rank order)."""
    kinds = {type(op) for op in requests}
    if len(kinds) != 1:
        kinds_seen = [type(op).__name__ for op in requests]
        raise RuntimeError(f"ranks disagree on the collective: {kinds_seen}")
    size = len(requests)
    first = requests[0]
    if isinstance(first, AllReduce):
        total = torch.stack([op.tensor for op in requests]).sum(dim=0)
        # In place where the request allows it, as Horovod's allreduce_async_ does.
        return {r: op.tensor.copy_(total) if op.inplace else total.clone()
                for r, op in enumerate(requests)}
    if isinstance(first, AllGather):
        pieces = [op.tensor.reshape(-1) for op in requests]
        sizes = first.sizes
        if sizes is None:
            return {r: [torch.cat(pieces)] for r in range(size)}  # a new tensor per rank
        return {r: [p.clone() for p in pieces] for r in range(size)}
    if isinstance(first, SparseSum):
        total = sum_pairs(first.numel, [(op.indices.reshape(-1), op.values.reshape(-1))
                                        for op in requests], first.values.device)
        return {r: total.clone() for r in range(size)}
    assert isinstance(first, AllToAll)
    sent = [torch.split(op.tensor.reshape(-1), list(op.splits)) for op in requests]
    return {r: [sent[src][r].clone() for src in range(size)] for r in range(size)}
