"""Communicator over Horovod's TensorFlow collectives, for payloads made by the torch schemes.

Tensors cross between the frameworks through DLPack, without copies: a torch payload
becomes a TensorFlow tensor over the same memory, Horovod's TensorFlow op reduces it, and
the result comes back to torch the same way.

Horovod's TensorFlow ops ignore ``name=`` in eager mode (every eager all-reduce is called
``HorovodAllreduce``), so two eager collectives can never be in flight at once. This
communicator therefore starts nothing in :meth:`~HorovodTFCommunicator.start`: it queues
the request, and the first :meth:`~HorovodTFCommunicator.wait` runs every queued request
together in one traced ``tf.function`` (one graph op per request, each named after its
collective, all in flight together so Horovod fuses them). The pipeline queues all of a
step's first rounds before it waits on any, so a step costs one graph call per round.

Horovod 0.28.1's TensorFlow ops refuse bfloat16 tensors. Such tensors take the same exact
route as in the PyTorch binding (:mod:`hvd_compress.comm.horovod_torch`), inside the graph
(:func:`collective`): sums run in float32 and are rounded to bfloat16 once, identically on
every rank; collectives that only move data carry the bit patterns as int16.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
import torch
from torch.utils import dlpack as torch_dlpack

from hvd_compress.comm.base import split_gathered
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, SparseSum
from hvd_compress.comm.sparse_frames import encode_sparse_frame, sum_frames

_ALIGNMENT = 64
"""TensorFlow's kernels assume buffers aligned to 64 bytes (Eigen's aligned maps)."""


def to_torch(tensor: tf.Tensor) -> torch.Tensor:
    """The torch view of an eager TensorFlow tensor's memory (DLPack, no copy)."""
    return torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))


def to_tf(tensor: torch.Tensor) -> tf.Tensor:
    """A TensorFlow tensor over a torch tensor's memory (DLPack, no copy).

    Copies only a tensor that is not contiguous or not 64-byte aligned (a view at an odd
    offset), which TensorFlow's kernels could not read in place.
    """
    tensor = tensor.detach()
    if not tensor.is_contiguous() or tensor.data_ptr() % _ALIGNMENT:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(tensor))


def collective_name(name: str) -> str:
    """A name TensorFlow accepts for a graph op and Horovod keeps whole.

    Horovod drops everything up to the last ``/`` of an op name, and TensorFlow allows only
    ``[A-Za-z0-9_.-]`` besides; other characters become ``_`` and a short hash of the
    original keeps distinct names distinct (identically on every rank).
    """
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    if safe == name and safe[:1].isalnum():
        return name
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"hvdc.{safe.lstrip('_.-')}.{digest}"


@dataclass
class Request:
    """One queued collective: its kind, name, TensorFlow inputs and, once run, outputs."""

    kind: str
    name: str
    inputs: tuple[tf.Tensor, ...]
    op: Collective | None = None
    root_rank: int = 0
    outputs: tuple[tf.Tensor, ...] | None = None

    def signature(self) -> tuple[Any, ...]:
        return (self.kind, self.name, self.root_rank,
                tuple((t.dtype, t.shape.rank) for t in self.inputs))


ALLREDUCE, ALLGATHER, ALLTOALL, BROADCAST = "allreduce", "allgather", "alltoall", "broadcast"
_OUTPUTS = {ALLREDUCE: 1, ALLGATHER: 1, ALLTOALL: 2, BROADCAST: 1}
_programs: dict[tuple[Any, ...], Callable[..., Any]] = {}

SUM_AS: dict[tf.DType, tf.DType] = {tf.bfloat16: tf.float32}
"""Dtypes Horovod's TensorFlow ops cannot sum, and the dtype each is summed in."""
MOVE_AS: dict[tf.DType, tf.DType] = {tf.bfloat16: tf.int16}
"""Dtypes Horovod's TensorFlow ops cannot move, and the same-sized dtype whose bits stand in
for them."""


def collective(kind: str, name: str, x: tf.Tensor, process_set: Any, root_rank: int = 0,
               splits: tf.Tensor | None = None) -> list[tf.Tensor]:
    """One Horovod TensorFlow op (graph or eager) on ``x``, any floating or integer dtype:
    :data:`SUM_AS` and :data:`MOVE_AS` dtypes take their exact routes (module docstring).
    Returns the op's outputs (two for an all-to-all: the data and the received splits),
    the data in ``x``'s dtype."""
    names = {"name": name, "ignore_name_scope": True, "process_set": process_set}
    if kind == ALLREDUCE:
        wide = SUM_AS.get(x.dtype)
        if wide is None:
            return [hvd.allreduce(x, op=hvd.Sum, **names)]
        return [tf.cast(hvd.allreduce(tf.cast(x, wide), op=hvd.Sum, **names), x.dtype)]
    wire = MOVE_AS.get(x.dtype)
    sent = x if wire is None else tf.bitcast(x, wire)
    if kind == ALLGATHER:
        outputs = [hvd.allgather(sent, **names)]
    elif kind == ALLTOALL:
        outputs = list(hvd.alltoall(sent, splits=splits, **names))
    elif kind == BROADCAST:
        outputs = [hvd.broadcast(sent, root_rank, **names)]
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    if wire is not None:
        outputs[0] = tf.bitcast(outputs[0], x.dtype)
    return outputs


def _trace(signature: tuple[tuple[Any, ...], ...], process_set: Any) -> Callable[..., Any]:
    """A graph running one Horovod op per request, all concurrently."""
    specs = [tf.TensorSpec([None] * rank, dtype)
             for *_, inputs in signature for dtype, rank in inputs]

    def program(*inputs: tf.Tensor) -> list[tf.Tensor]:
        args = iter(inputs)
        outputs: list[tf.Tensor] = []
        for kind, name, root_rank, _ in signature:
            x = next(args)
            splits = next(args) if kind == ALLTOALL else None
            outputs.extend(collective(kind, name, x, process_set, root_rank, splits))
        return outputs

    return tf.function(program, input_signature=specs, autograph=False,
                       jit_compile=False).get_concrete_function()


def run_requests(requests: Sequence[Request], process_set: Any) -> None:
    """Run the requests' collectives together; fill each request's ``outputs``."""
    if not requests:
        return
    signature = tuple(r.signature() for r in requests)
    key = (process_set.process_set_id, signature)
    program = _programs.get(key)
    if program is None:
        program = _programs[key] = _trace(signature, process_set)
    outputs = program(*[x for r in requests for x in r.inputs])
    position = 0
    for request in requests:
        count = _OUTPUTS[request.kind]
        request.outputs = tuple(outputs[position:position + count])
        position += count


class HorovodTFCommunicator:
    """The pipeline's collectives over ``horovod.tensorflow`` (Gloo or MPI).

    ``start`` queues a request (see the module docstring); ``wait`` runs all queued requests
    in one graph call if its own has not run yet, and returns torch tensors. A
    :class:`~hvd_compress.comm.ops.SparseSum` goes as an ``allgather`` of each rank's pairs
    as one parameter-server push frame (:mod:`hvd_compress.sparse_wire`, values in their
    wire dtype, fp16 or fp32), byte for byte what the PyTorch binding's communicator
    gathers; every rank sums the gathered frames. A
    :class:`~hvd_compress.comm.parameter_server.ParameterServerCommunicator` can wrap this
    one and send the sparse sums to parameter servers instead (the ``ps=`` option).
    """

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self._queued: list[Request] = []

    def start(self, name: str, op: Collective) -> Request:
        tf_name = collective_name(name)
        if isinstance(op, AllReduce):
            request = Request(ALLREDUCE, tf_name, (to_tf(op.tensor),), op)
        elif isinstance(op, AllGather):
            request = Request(ALLGATHER, tf_name, (to_tf(op.tensor.reshape(-1)),), op)
        elif isinstance(op, SparseSum):
            # Each rank's pairs as one frame (the parameter server's format, named after the
            # collective as the PyTorch binding names it): frames are self-delimiting, so
            # the gathered bytes split back into one frame per rank.
            frame = encode_sparse_frame(name, self.rank, op)
            request = Request(ALLGATHER, tf_name, (tf.constant(np.frombuffer(frame, np.uint8)),),
                              op)
        elif isinstance(op, AllToAll):
            splits = tf.constant(op.splits, dtype=tf.int32)
            request = Request(ALLTOALL, tf_name, (to_tf(op.tensor.reshape(-1)), splits), op)
        else:
            raise TypeError(f"unknown collective request {op!r}")
        self._queued.append(request)
        return request

    def flush(self) -> None:
        """Run every queued request now."""
        queued, self._queued = self._queued, []
        run_requests(queued, self.process_set)

    def wait(self, request: Request) -> torch.Tensor | list[torch.Tensor]:
        if request.outputs is None:
            self.flush()
        assert request.outputs is not None
        op = request.op
        if isinstance(op, SparseSum):
            return sum_frames(op, request.outputs[0].numpy())
        result = to_torch(request.outputs[0])
        if isinstance(op, AllReduce):
            return result
        if isinstance(op, AllGather):
            return split_gathered(result, op.sizes)
        received = request.outputs[1].numpy().tolist()
        return list(torch.split(result, received))
