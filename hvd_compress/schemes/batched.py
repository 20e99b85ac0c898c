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

    def views(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``flat`` cut per member and per group, as views: each member's factor in its
        stored form (``r x rows`` when transposed, else ``rows x r``), and each group's
        factors as one ``(b, rows, r)`` block (a transposed view when transposed)."""
        members: list[torch.Tensor] = [flat] * self.members
        blocks: list[torch.Tensor] = []
        offset = 0
        for (rows, r, transposed), ix in self.groups:
            size = len(ix) * rows * r
            segment = flat[offset:offset + size]
            offset += size
            if transposed:
                stored = segment.view(len(ix), r, rows)
                blocks.append(stored.transpose(1, 2))
            else:
                stored = segment.view(len(ix), rows, r)
                blocks.append(stored)
            for j, i in enumerate(ix):
                members[i] = stored[j]
        return members, blocks

    def factors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each member's factor as a ``rows x r`` matrix (a view of ``flat``)."""
        stored = self.views(flat)[0]
        for (_, _, transposed), ix in self.groups:
            if transposed:
                for i in ix:
                    stored[i] = stored[i].t()
        return stored

    def orthonormal(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each member's ``rows x r`` orthonormal basis (reduced QR), one batched QR per
        group of :meth:`views`' blocks; the same bases as one QR per member."""
        bases: list[torch.Tensor] = [blocks[0]] * self.members if blocks else []
        for (_, ix), block in zip(self.groups, blocks, strict=True):
            q = torch.linalg.qr(block).Q
            for j, i in enumerate(ix):
                bases[i] = q[j]
        return bases
