"""Buckets and fused rounds: how the pipeline (:mod:`hvd_compress.pipeline`) cuts a step's
tensors into buckets and sends a bucket's requests of one round as one collective.

Buckets and fused rounds
------------------------
Every Horovod collective costs a negotiation with Horovod's coordinator and its own
latency, whatever its size; on a slow, high-latency or CPU-starved cluster that, not the
bytes, dominates the step of a model with many tensors. PyTorch DDP's ``powerSGD_hook``
therefore flattens all ``P`` matrices of a bucket into one all-reduce and all ``Q`` matrices
into another. The pipeline does the same for every scheme, in this one place: schemes still
yield one request per round (:mod:`hvd_compress.comm.ops`) and never see the fusion.

1. ``Pipeline.plan`` (:class:`~hvd_compress.pipeline.Pipeline`) lists the tensors in the
   order their gradients are expected to become ready (backward order). Consecutive
   tensors form buckets of at most ``bucket_bytes`` float32 bytes; a larger tensor is a
   bucket of its own (:func:`assign_buckets`, DDP's assignment). Tensors that no plan
   names (a plan-less ``Pipeline.reduce``) are bucketed the same way when
   ``Pipeline.wait`` is called, in sorted-name order.
2. ``Pipeline.submit`` runs a tensor's exchange up to its first request. Once every
   member of a planned bucket has been submitted, the bucket's first *phase* starts, so the
   last layers' bucket is in flight while backward still runs for the first layers.
3. Phase ``k`` of a bucket is its members' ``k``-th requests. Those of the same kind, dtype
   and device travel as one collective (:func:`fusion_key`, :func:`fuse`): all-reduces are
   concatenated (a dense bias's ``dense`` round and PowerSGD's ``P`` share one, as in DDP),
   all-gathers with known ``sizes`` are concatenated and their results cut per rank,
   all-to-alls are concatenated per destination. A :class:`~hvd_compress.comm.ops.SparseSum`
   (its communicator may send it to a parameter server keyed by the tensor) and a
   self-delimiting all-gather (``sizes=None``) travel alone, as does a request that is the
   only one of its kind in the phase; except that when the communicator gathers frames
   (``gathers_frames``, Horovod's), top-k's :class:`~hvd_compress.comm.sparse_frames.
   PairsSum` requests of one value dtype travel as one
   :class:`~hvd_compress.comm.sparse_frames.FramesSum`, one all-gather of each rank's
   frames. Members whose exchange has ended drop out of later phases.
4. ``Pipeline.wait`` starts the buckets not yet started, then drives all of them phase by
   phase, in launch order: it waits on a phase's collectives, hands every member its
   slice (:func:`split_result`), which runs the member's exchange to its next request, and
   starts the bucket's next phase at once. It waits only on started collectives, and each
   rank starts phase ``k + 1`` of a bucket as soon as phase ``k`` is done, so ranks whose
   backward passes completed the buckets in different orders cannot deadlock. A
   communicator that matches collectives by start order rather than by name
   (:class:`~hvd_compress.comm.gloo_torch.GlooCommunicator`, ``ordered``) gets them in an
   order every rank reproduces: complete buckets start in plan order only, as DDP's do.

Fusion changes no result: an all-reduce sums each element over the same ranks whether its
neighbours in the buffer belong to its own tensor or to another. On
:class:`~hvd_compress.comm.threads.ThreadGroup` fused and unfused aggregates are bit for bit
identical; under Horovod they differ only by the summation order of its ring, which depends
on an element's position in the buffer (Horovod's own tensor fusion does the same). The cost
is one copy of each request into the fused buffer; the results are views of the fused
result, without a copy.

Collective names
----------------
Horovod matches collectives by name, so names are deterministic and identical on every
rank: ``hvdc.b<bucket>.<phase>.<kind>.<digest>`` for a fused collective, where ``<digest>``
hashes the members' names, round names and sizes and the dtype, and
``hvdc.<tensor>.<round>`` for a request travelling alone. Names are unique within a step
and repeat from step to step, as Horovod's own names do (that keeps Horovod's response
cache and the TensorFlow binding's traced graphs valid). Ranks that disagree on a bucket's
content (different plans, a tensor submitted on one rank only, another shape) start
different names: Horovod's stall warning then lists them (a ``ThreadGroup`` raises a
``TimeoutError`` naming them) instead of ranks summing misaligned slices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective
from hvd_compress.comm.sparse_frames import FramesSum, PairsSum
from hvd_compress.native import buffers

Result = torch.Tensor | list[torch.Tensor]
"""What a collective returns: a tensor (all-reduce), or one tensor per rank (a
:class:`~hvd_compress.comm.sparse_frames.FramesSum`: one sum per member instead)."""
T = TypeVar("T")


def assign_buckets(names: Sequence[str], numels: Sequence[int],
                   bucket_bytes: int | None) -> list[list[str]]:
    """Cut ``names`` (in order) into consecutive buckets of at most ``bucket_bytes`` float32
    bytes (``4 * numel`` each), as DDP assigns parameters to buckets.

    A tensor that does not fit in the current bucket starts the next one; a tensor larger
    than ``bucket_bytes`` is a bucket of its own. ``None`` or 0: a single bucket.
    """
    buckets: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, numel in zip(names, numels, strict=True):
        size = 4 * int(numel)
        if current and bucket_bytes and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def fusion_key(request: Collective, gathers_frames: bool = False
               ) -> tuple[str, torch.dtype, torch.device] | None:
    """Requests with equal keys may travel as one collective; ``None``: never fused.

    :class:`~hvd_compress.comm.ops.SparseSum` is not fused (its communicator may send it to
    a parameter server that keys rounds by tensor), except a
    :class:`~hvd_compress.comm.sparse_frames.PairsSum` when ``gathers_frames`` (the
    communicator's attribute of that name: it all-gathers frames, which are
    self-delimiting), keyed by its values' dtype and device. Nor is a self-delimiting
    :class:`~hvd_compress.comm.ops.AllGather` fused (``sizes=None``: there is no way to
    tell where one member's part of a rank's bytes ends).
    """
    if isinstance(request, PairsSum):
        if not gathers_frames:
            return None
        return "frames", request.values.dtype, request.values.device
    if isinstance(request, AllReduce):
        kind = "allreduce"
    elif isinstance(request, AllGather) and request.sizes is not None:
        kind = "allgather"
    elif isinstance(request, AllToAll):
        kind = "alltoall"
    else:
        return None
    return kind, request.tensor.dtype, request.tensor.device


def fused_name(bucket: int, phase: int, names: Sequence[str],
               requests: Sequence[Collective]) -> str:
    """``hvdc.b<bucket>.<phase>.<kind>.<digest>``: the same on every rank that agrees on
    the members, their rounds and sizes (not a device index, which differs between ranks)."""
    key = fusion_key(requests[0], gathers_frames=True)
    assert key is not None
    digest = hashlib.blake2b(digest_size=4)
    digest.update(str(key[1]).encode())
    for name, request in zip(names, requests, strict=True):
        if isinstance(request, PairsSum):
            extent: Any = request.numel
        elif isinstance(request, AllToAll):  # sizes are checked when the result arrives
            extent: Any = len(request.splits)
        elif isinstance(request, AllGather):
            extent = request.sizes
        else:
            extent = request.tensor.numel()
        digest.update(f"\0{name}\0{request.round}\0{extent}".encode())
    return f"hvdc.b{bucket}.{phase}.{key[0]}.{digest.hexdigest()}"


def _all(requests: Sequence[Collective], kind: type[T]) -> list[T]:
    """``requests`` typed as their (common) kind."""
    typed = [r for r in requests if isinstance(r, kind)]
    assert len(typed) == len(requests), f"mixed requests in one fused group: {requests}"
    return typed


def fuse(requests: Sequence[Collective], rank: int, size: int,
         where: str) -> Collective | FramesSum:
    """One request carrying all of ``requests`` (equal :func:`fusion_key`), in order.

    * :class:`AllReduce`: the flattened tensors concatenated.
    * :class:`AllGather`: the flat tensors concatenated; rank ``r`` contributes
      ``sum(req.sizes[r])`` elements.
    * :class:`AllToAll`: for each destination ``r``, every member's split ``r`` in turn;
      ``splits[r]`` is the members' total for ``r``.

    The fused request's round is the members' distinct round names joined by ``+``. The
    concatenation goes into recycled memory (:func:`hvd_compress.native.buffers.cat`), lent
    to one tensor and its views at a time, and a fused all-reduce may sum in place into it,
    so a step touches no fresh pages (a page fault per 4 KiB on first touch) and a result or
    state that is a view of a fused buffer keeps it from being lent again.
    * :class:`~hvd_compress.comm.sparse_frames.PairsSum`: a
      :class:`~hvd_compress.comm.sparse_frames.FramesSum` of them (the communicator
      encodes the frames; nothing is copied here).

    Raises :class:`RuntimeError` naming ``where`` if a member's sizes do not describe its
    own tensor (a scheme bug the unfused path would have hit in the collective).
    """
    round_name = "+".join(dict.fromkeys(r.round for r in requests))
    if isinstance(requests[0], PairsSum):
        return FramesSum(round_name, tuple(_all(requests, PairsSum)))
    if isinstance(requests[0], AllReduce):
        reduces = _all(requests, AllReduce)
        return AllReduce(round_name, buffers.cat([r.tensor for r in reduces]), inplace=True)
    if isinstance(requests[0], AllGather):
        gathers = _all(requests, AllGather)
        known: list[tuple[int, ...]] = []
        for r in gathers:
            if r.sizes is None or len(r.sizes) != size or r.sizes[rank] != r.tensor.numel():
                raise RuntimeError(f"{where}: all-gather round {r.round!r} has "
                                   f"{r.tensor.numel()} elements on rank {rank} but sizes "
                                   f"{r.sizes} for {size} ranks")
            known.append(r.sizes)
        sizes = tuple(sum(s[k] for s in known) for k in range(size))
        return AllGather(round_name, buffers.cat([r.tensor for r in gathers]), sizes)
    scatters = _all(requests, AllToAll)
    pieces = []
    for r in scatters:
        if len(r.splits) != size or sum(r.splits) != r.tensor.numel():
            raise RuntimeError(f"{where}: all-to-all round {r.round!r} has "
                               f"{r.tensor.numel()} elements but splits {list(r.splits)} for "
                               f"{size} ranks")
        pieces.append(torch.split(r.tensor.reshape(-1), list(r.splits)))
    tensor = buffers.cat([p[dest] for dest in range(size) for p in pieces])
    splits = tuple(sum(r.splits[dest] for r in scatters) for dest in range(size))
    return AllToAll(round_name, tensor, splits)


def split_result(requests: Sequence[Collective], result: Result, rank: int, size: int,
                 where: str) -> list[Result]:
    """Cut the result of :func:`fuse`'s request back into one result per member, each in
    the form its own request documents (views of ``result``, no copies).

    For :class:`AllToAll` this relies on its contract (:mod:`hvd_compress.comm.ops`): every
    sender uses the same ``splits``, so member ``m``'s piece from any source has
    ``m.splits[rank]`` elements. A source whose total differs raises :class:`RuntimeError`
    naming ``where`` instead of cutting wrongly. (A sender that divided the same total
    among the members differently cannot be told apart by sizes alone; the contract rules
    it out.)
    """
    if isinstance(requests[0], AllReduce):
        assert isinstance(result, torch.Tensor)
        reduces = _all(requests, AllReduce)
        numels = [r.tensor.numel() for r in reduces]
        flat = result.reshape(-1)
        if flat.numel() != sum(numels):
            raise RuntimeError(f"{where}: the fused all-reduce returned {flat.numel()} "
                               f"elements, expected {sum(numels)}")
        return [piece.view(r.tensor.shape) for piece, r in zip(torch.split(flat, numels),
                                                                reduces)]
    assert isinstance(result, list)
    if isinstance(requests[0], PairsSum):  # the communicator split it by member
        if len(result) != len(requests):
            raise RuntimeError(f"{where}: the fused sparse sum returned {len(result)} "
                               f"results for {len(requests)} tensors")
        return list(result)
    if len(result) != size:
        raise RuntimeError(f"{where}: the fused collective returned {len(result)} parts for "
                           f"{size} ranks")
    if isinstance(requests[0], AllGather):
        known = [r.sizes for r in _all(requests, AllGather) if r.sizes is not None]
        lengths = [[s[source] for s in known] for source in range(size)]
        what = "gathered from"
    else:
        mine = [r.splits[rank] for r in _all(requests, AllToAll)]
        lengths = [mine] * size
        what = "received from"
    parts = []
    for source, (piece, expected) in enumerate(zip(result, lengths)):
        if piece.numel() != sum(expected):
            raise RuntimeError(
                f"{where}: rank {rank} {what} rank {source} {piece.numel()} elements, but the "
                f"members expect {sum(expected)} ({expected} per tensor). AllToAll splits and "
                "AllGather sizes must be the same on every rank (a function of what every "
                "rank knows, such as the shape) for requests to be fused; see "
                "hvd_compress.comm.ops")
        parts.append(torch.split(piece.reshape(-1), expected))
    return [[parts[source][i] for source in range(size)] for i in range(len(requests))]
