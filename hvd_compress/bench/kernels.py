"""Encode+decode throughput of each scheme, against a memory copy timed alongside it.

Throughput is float32 input bytes per second. The baseline, ``dst.copy_(src)`` of the same
tensor, is timed alternately with each scheme (copy, scheme, copy, scheme, ...) and both
take the median of ``repeat`` timings after a warm-up, so that load from other processes
tends to hit both alike. The copy, torch's casts and the native kernels all run on torch's
intra-op threads (``torch.get_num_threads()``, in the title: every core unless limited by
``OMP_NUM_THREADS`` or ``torch.set_num_threads``). What is timed per scheme:

* packed codecs (bf16, onebit, qsgd, terngrad): ``decode(encode(x, generator), n)``; on the
  CPU onebit, qsgd and terngrad run the fused kernels of :mod:`hvd_compress.native`;
* fp16: ``x.to(float16).to(float32)`` as its exchange does them (``compress`` and
  ``decompress``);
* powersgd: one step's local math through the scheme's own ``exchange`` run as the only
  rank (``P = M Q``, QR of ``P``, ``Q = M^T P``, and ``P Q^T`` twice: the aggregate and the
  part sent, for error feedback) on the tensor viewed as the squarest ``(n, m)`` matrix,
  with the warm-started ``Q`` of a previous step.

Every output is a new tensor, as in an exchange; large CPU ones are lent recycled memory
(:mod:`hvd_compress.native.buffers`), so from the warm-up on, as from a training's second
step, they are written without page faults.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hvd_compress import Compression
from hvd_compress.bench import SCHEMES
from hvd_compress.bench.report import Column, Row, Target, field
from hvd_compress.comm.ops import AllReduce
from hvd_compress.schemes.base import (
    Exchange,
    ExchangeContext,
    Outcome,
    PackedScheme,
    materialize,
)
from hvd_compress.schemes.dense import FP16
from hvd_compress.schemes.powersgd import PowerSGD

KERNEL_SCHEMES = tuple(spec for spec in SCHEMES if spec != "none")
"""Every benchmarked scheme but ``none``, which has nothing to encode."""

_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Kernel:
    """What is timed for one scheme: ``run()`` returns the decoded tensor, flat."""

    scheme: str
    op: str
    shape: tuple[int, ...]
    run: Callable[[], torch.Tensor]


def parse_count(text: str) -> int:
    """An element count such as ``64K``, ``4M`` (binary multiples) or ``1000``."""
    text = text.strip().upper()
    multiple = _SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if multiple > 1 else text
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(f"not an element count: {text!r} (examples: 64K, 4M, 1000)")
    return int(digits) * multiple


def squarest_matrix(numel: int) -> tuple[int, int]:
    """``(n, m)`` with ``n * m == numel`` and ``n <= m`` as close as possible."""
    n = next(d for d in range(math.isqrt(numel), 0, -1) if numel % d == 0)
    return n, numel // n


def _run_alone(exchange: Exchange) -> Outcome:
    """Drive an exchange as the only rank, where an all-reduce returns its input."""
    result = None
    while True:
        try:
            op = exchange.send(result)
        except StopIteration as done:
            return done.value
        if not isinstance(op, AllReduce):
            raise TypeError(f"only all-reduce exchanges run alone, got {type(op).__name__}")
        result = op.tensor


def make_kernel(spec: str, x: torch.Tensor) -> Kernel:
    """The timed operation of scheme ``spec`` on the flat float32 tensor ``x``."""
    scheme = Compression.parse(spec)
    n = x.numel()
    if isinstance(scheme, FP16):
        return Kernel(spec, "x.to(float16).to(float32)", (n,),
                      lambda: scheme.decompress(*scheme.compress(x)))
    if isinstance(scheme, PackedScheme):
        # run() draws x from seed 0; the same stream here would correlate the noise with x.
        gen = torch.Generator().manual_seed(1)
        return Kernel(spec, "decode(encode(x))", (n,),
                      lambda: scheme.decode(scheme.encode(x, gen), n))
    if isinstance(scheme, PowerSGD):
        shape = squarest_matrix(n)
        matrix = x.view(shape)
        ctx = ExchangeContext("bench", rank=0, size=1, step=scheme.start_iter)
        state = _run_alone(scheme.exchange(matrix, {}, ctx)).state
        return Kernel(spec, f"step on {shape[0]}x{shape[1]}: M@Q, qr, M.T@P, 2x P@Q.T", shape,
                      lambda: _powersgd_step(scheme, matrix, state, ctx))
    raise ValueError(f"no kernel to time for scheme {spec!r}")


def _powersgd_step(scheme: PowerSGD, matrix: torch.Tensor, state: dict[str, torch.Tensor],
                   ctx: ExchangeContext) -> torch.Tensor:
    """One exchange on one rank, with its two products (the aggregate, and this rank's
    contribution that error feedback subtracts) materialised."""
    outcome = _run_alone(scheme.exchange(matrix, state, ctx))
    assert outcome.sent is not None
    materialize(outcome.sent)
    return materialize(outcome.aggregate).view(-1)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_against_copy(kernel: Kernel, x: torch.Tensor, repeat: int) -> tuple[float, float]:
    """Median seconds of the kernel and of copying ``x``, timed alternately after a warm-up."""
    dst = torch.empty_like(x)
    kernel.run()
    dst.copy_(x)
    kernel_times, copy_times = [], []
    for _ in range(repeat):
        copy_times.append(_seconds(lambda: dst.copy_(x)))
        kernel_times.append(_seconds(kernel.run))
    return statistics.median(kernel_times), statistics.median(copy_times)


COLUMNS = (
    Column("scheme", field("scheme")),
    Column("elements", field("numel", "{:,}")),
    Column("timed", field("op")),
    Column("seconds", field("seconds", "{:.4g}")),
    Column("GB/s", lambda row: f"{row['bytes_per_second'] / 1e9:.3f}"),
    Column("copy GB/s", lambda row: f"{row['copy_bytes_per_second'] / 1e9:.3f}"),
    Column("ratio to copy", field("ratio_to_copy", "{:.3f}")),
)

TARGETS = tuple(Target({"scheme": spec, "numel": 64 << 20}, "ratio_to_copy", ">=", 0.5)
                for spec in ("fp16", "onebit", "qsgd:bits=4"))


def title(repeat: int) -> str:
    return (f"Encode+decode throughput (float32 input bytes/s), median of {repeat}, "
            f"interleaved with dst.copy_(src); threads (copy, casts and codec kernels): "
            f"{torch.get_num_threads()}")


def run(sizes: Sequence[int], repeat: int) -> list[Row]:
    """One row per (size, scheme)."""
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for spec in KERNEL_SCHEMES:
            kernel = make_kernel(spec, x)
            seconds, copy_seconds = time_against_copy(kernel, x, repeat)
            rate, copy_rate = 4 * numel / seconds, 4 * numel / copy_seconds
            rows.append({
                "scheme": spec, "numel": numel, "op": kernel.op, "shape": list(kernel.shape),
                "seconds": seconds, "bytes_per_second": rate,
                "copy_seconds": copy_seconds, "copy_bytes_per_second": copy_rate,
                "ratio_to_copy": rate / copy_rate, "repeat": repeat,
                "torch_threads": torch.get_num_threads(),
            })
    return rows
