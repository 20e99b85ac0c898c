"""The TensorFlow column of the kernels benchmark: what reaching the torch kernels from
TensorFlow through DLPack costs.

For each scheme and size the kernel of :mod:`hvd_compress.bench.kernels` (the same
``make_kernel``, the same tensor) is timed two ways, alternately, median of ``repeat``
after a warm-up, in one run:

* torch: ``kernel.run()`` on a torch tensor ``x``;
* TensorFlow: from a ``tf.Tensor`` over ``x``'s memory, the DLPack view into torch (checked
  to be ``x``'s memory, so nothing was copied), the same kernel, and its result handed back
  to TensorFlow through DLPack, as the TensorFlow binding does.

``tf_over_torch`` is the TensorFlow time over the torch time (the goal is at most 1.1);
the target line states it as its inverse, ``torch_over_tf >= 0.909``.

``python -m hvd_compress.bench kernels`` prints it as its second table (``--tf-sizes``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf
import torch

from hvd_compress.bench.kernels import KERNEL_SCHEMES, Kernel, make_kernel
from hvd_compress.bench.report import Column, Row, Target, field
from hvd_compress.tensorflow.comm import to_tf, to_torch

MAX_OVERHEAD = 1.1


def through_tensorflow(kernel: Kernel, x: torch.Tensor, x_tf: tf.Tensor) -> Callable[[], tf.Tensor]:
    """The kernel as the TensorFlow binding reaches it: ``x_tf`` -> torch -> kernel -> TF."""

    def run() -> tf.Tensor:
        view = to_torch(x_tf)
        if view.data_ptr() != x.data_ptr():
            raise RuntimeError("the DLPack view of the TensorFlow tensor is a copy")
        return to_tf(kernel.run())

    return run


def _median_seconds_alternating(a: Callable[[], object], b: Callable[[], object],
                                repeat: int) -> tuple[float, float]:
    a(), b()
    times_a, times_b = [], []
    for _ in range(repeat):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


COLUMNS = (
    Column("scheme", field("scheme")),
    Column("elements", field("numel", "{:,}")),
    Column("torch s", field("torch_seconds", "{:.4g}")),
    Column("TF via DLPack s", field("tf_seconds", "{:.4g}")),
    Column("TF/torch", field("tf_over_torch", "{:.3f}")),
)

TARGETS = tuple(Target({"scheme": spec, "numel": 4 << 20}, "torch_over_tf", ">=",
                       round(1 / MAX_OVERHEAD, 3))
                for spec in KERNEL_SCHEMES)


def title(repeat: int) -> str:
    return (f"DLPack path from TensorFlow against the torch path, same kernels and tensors, "
            f"median of {repeat}, alternating; torch threads: {torch.get_num_threads()}")


def run(sizes: Sequence[int], repeat: int) -> list[Row]:
    """One row per (size, scheme)."""
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        x_tf = to_tf(x)
        for spec in KERNEL_SCHEMES:
            kernel = make_kernel(spec, x)
            torch_s, tf_s = _median_seconds_alternating(
                kernel.run, through_tensorflow(kernel, x, x_tf), repeat)
            rows.append({"scheme": spec, "numel": numel, "op": kernel.op,
                         "torch_seconds": torch_s, "tf_seconds": tf_s,
                         "tf_over_torch": tf_s / torch_s, "torch_over_tf": torch_s / tf_s,
                         "repeat": repeat, "torch_threads": torch.get_num_threads()})
    return rows
