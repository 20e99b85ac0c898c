"""Exchanges that take a whole bucket at once: many tensors, one request per round.

A scheme whose tensors' exchanges share their structure (PowerSGD: two products and an
orthogonalisation per matrix, two rounds) pays, per tensor and step, a generator, its
resumptions, a request that fusion copies into the bucket's buffer and cuts back out, and
one small LAPACK call per orthogonalisation. On a model with many small tensors (the
character transformer of ``bench overhead``) that Python work costs as much as the
products. A scheme offering

``batches(x, state, ctx) -> bool``
    whether this step of this tensor takes the batched path (PowerSGD: past its dense
    warm-up), decided from what every rank knows alike;
``exchange_many(xs, states, ctxs) -> Generator[Collective, Any, list[Outcome]]``
    the exchange of all those tensors together: it yields one request per round and
    returns one :class:`~hvd_compress.schemes.base.Outcome` per tensor, in order, each
    what :meth:`~hvd_compress.schemes.base.Scheme.exchange` would have returned;

gets them from the pipeline (:mod:`hvd_compress.pipeline`) as one exchange per bucket,
scheme, dtype and device, started when the bucket is complete. Its requests fuse with the
bucket's other requests as usual (the biases' ``dense`` round travels with PowerSGD's
``P``).

:class:`FlatLayout` is the packing: factors of equal shape lie next to each other in one
flat buffer, so that the buffer is the round's request as it is (no copy into a fused
buffer) and each group of equal shapes is one ``(b, rows, r)`` block for a batched
orthogonalisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FactorKey = tuple[int, int, bool]
"""A factor's ``(rows, r, transposed)``: ``rows x r``, kept as the ``r x rows`` matrix
``F^T`` when ``transposed``."""


def batches(scheme: object) -> bool:
    """Whether ``scheme`` offers ``exchange_many`` (the module notes)."""
    return callable(getattr(scheme, "exchange_many", None))


@dataclass(frozen=True)
class FlatLayout:
    """Where each member's factor lies in one flat buffer: members grouped by
    :data:`FactorKey`, each group contiguous, in order of each key's first member.

    ``groups``: ``(key, member indices)`` in buffer order; ``numel``: the buffer's length.
    Built from shapes alone, so every rank lays the buffer out alike.
    """

    groups: tuple[tuple[FactorKey, tuple[int, ...]], ...]
    numel: int
    members: int

    @staticmethod
    def of(keys: Sequence[FactorKey]) -> FlatLayout:
        grouped: dict[FactorKey, list[int]] = {}
        for i, key in enumerate(keys):
            grouped.setdefault(key, []).append(i)
        groups = tuple((key, tuple(ix)) for key, ix in grouped.items())
        numel = sum(len(ix) * rows * r for (rows, r, _), ix in groups)
        return FlatLayout(groups, numel, len(keys))

    def _stored(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """Each group's segment of ``flat`` as one stored block (``(b, r, rows)`` when
        transposed, else ``(b, rows, r)``), with its ``transposed`` flag."""
        out = []
        offset = 0
        for (rows, r, transposed), ix in self.groups:
            size = len(ix) * rows * r
            segment = flat[offset:offset + size]
            offset += size
            out.append((segment.view(len(ix), r, rows) if transposed
                        else segment.view(len(ix), rows, r), transposed))
        return out

    def _scatter(self, per_group: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """Per-group sequences of member tensors put back in member order."""
        members: list[torch.Tensor] = [per_group[0][0]] * self.members if per_group else []
        for (_, ix), tensors in zip(self.groups, per_group, strict=True):
            for i, t in zip(ix, tensors, strict=True):
                members[i] = t
        return members

    def member_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each member's factor in its stored form (``r x rows`` when transposed, else
        ``rows x r``), as views of ``flat``."""
        return self._scatter([block.unbind(0) for block, _ in self._stored(flat)])

    def blocks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each group's factors as one ``(b, rows, r)`` block (a transposed view when
        transposed), as views of ``flat``, in buffer order."""
        return [block.transpose(1, 2) if transposed else block
                for block, transposed in self._stored(flat)]

    def views(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``flat`` cut per member and per group, as views: :meth:`member_views` and
        :meth:`blocks`."""
        return self.member_views(flat), self.blocks(flat)

    def factors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each member's factor as a ``rows x r`` matrix (a view of ``flat``)."""
        return self._scatter([block.unbind(0) for block in self.blocks(flat)])

    def orthonormal(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each member's ``rows x r`` orthonormal basis (reduced QR), one batched QR per
        group of :meth:`blocks`; the same bases as one QR per member."""
        return self._scatter([torch.linalg.qr(block).Q.unbind(0) for block in blocks])
