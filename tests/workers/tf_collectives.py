"""Rank-side halves of tests/test_tensorflow.py that compare the TensorFlow binding's
aggregates with the torch binding's (run under horovodrun or mpirun, optionally with
parameter servers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import horovod.tensorflow as hvd_tf
import horovod.torch as hvd
import tensorflow as tf
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.binding import resolve_ps
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect
from hvd_compress.tensorflow import compression_state, init
from hvd_compress.tensorflow.comm import to_tf, to_torch


@contextmanager
def horovod_tf() -> Iterator[None]:
    """Horovod's TensorFlow library, started next to the torch one ``tests.rank_main``
    starts (on the workers' communicator when ``$HVD_COMPRESS_PS=mpi`` puts server ranks in
    the launch), and shut down first: under MPI, the torch library's shutdown finalises MPI
    while the TensorFlow library's background thread still calls it (a segfault)."""
    init()
    try:
        yield
    finally:
        hvd_tf.shutdown()


SHAPES = [(33, 17), (256, 40), (1000,), (6, 3, 3, 3)]
POLICY = Policy(min_numel=1, compress_1d=True)


def _inputs(steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    # Names with "/" as Keras paths have: the collectives' names must keep them apart.
    return [{f"layer{i}/kernel": torch.randn(shape, generator=gen)
             for i, shape in enumerate(SHAPES)} for _ in range(steps)]


def _zero_copy() -> dict[str, bool]:
    """Whether DLPack hands tensors over without copies, both ways."""
    x = torch.randn(1000)
    t = tf.zeros([1000]) + 1.0
    view = to_torch(t)
    view[0] = 5.0  # visible from TensorFlow only if the memory is shared
    return {"torch_to_tf": to_torch(to_tf(x)).data_ptr() == x.data_ptr(),
            "tf_to_torch": float(t[0]) == 5.0}


def _tf_steps(spec: str, steps: list[dict[str, torch.Tensor]], traced: bool,
              ps: str | None) -> tuple[list[dict[str, torch.Tensor]], str]:
    """The TensorFlow binding's aggregates, and the class of its communicator."""
    compression = Compression.parse(spec)
    names = list(steps[0])

    def reduce(*grads: tf.Tensor) -> list[tf.Tensor]:
        # As DistributedGradientTape does: the exchange is made on first use, so traced it
        # is made (and, with servers, its session id broadcast) while tf.function traces.
        exchange = compression_state(compression).exchange_for(
            op=hvd_tf.Average, gradient_predivide_factor=1.0,
            process_set=hvd_tf.global_process_set, policy=POLICY, seed=0,
            sparse_as_dense=False, ps=ps)
        return exchange.reduce(names, list(grads))

    run = tf.function(reduce) if traced else reduce
    out = []
    for tensors in steps:
        result = run(*[tf.constant(t.numpy()) for t in tensors.values()])
        out.append({n: torch.from_numpy(r.numpy()) for n, r in zip(names, result)})
    exchange = compression_state(compression).exchange
    assert exchange is not None
    return out, type(exchange.pipeline.comm).__name__


def aggregates(specs: list[str], steps: int = 2, ps_specs: tuple[str, ...] = (),
               ps: str | None = None) -> dict[str, Any]:
    """Per scheme and step: the torch binding's aggregate, and the TensorFlow binding's,
    eager and inside ``tf.function``, for the same rank-specific inputs, sparse sums by
    Horovod ``allgather``. For ``ps_specs`` also both bindings' with the sums on the
    parameter servers ``ps`` (default ``$HVD_COMPRESS_PS``), under ``*_ps`` keys."""
    inputs = _inputs(steps)
    out: dict[str, Any] = {"zero_copy": _zero_copy(), "communicators": set()}
    with horovod_tf():
        for spec in specs:
            pipe = Pipeline(Compression.parse(spec), HorovodTorchCommunicator(), POLICY)
            out[spec] = {"torch": [pipe.reduce(t) for t in inputs]}
            for path in ("eager", "function"):
                out[spec][path], name = _tf_steps(spec, inputs, path == "function", ps="")
                out["communicators"].add(name)
        for i, spec in enumerate(ps_specs):
            comm: Communicator = ParameterServerCommunicator(
                HorovodTorchCommunicator(), connect(resolve_ps(ps), hvd.rank()), f"torch.{i}")
            pipe = Pipeline(Compression.parse(spec), comm, POLICY)
            out[spec]["torch_ps"] = [pipe.reduce(t) for t in inputs]
            for path in ("eager", "function"):
                out[spec][f"{path}_ps"], name = _tf_steps(spec, inputs, path == "function", ps)
                out["communicators"].add(f"{name} (ps)")
    return out
