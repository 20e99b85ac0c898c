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

``device="cuda"`` (``--device cuda``) runs the same schemes' torch code on a CUDA tensor,
against a device-to-device ``dst.copy_(src)``, timed with CUDA events (the seconds from an
event recorded before the call to one recorded after it, the host waiting for the second;
host work inside the call, such as a scheme reading a flag back, counts), after
:data:`CUDA_WARMUP` warm-up runs. The random codecs draw from a CUDA generator.
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
from hvd_compress.bench.report import Column, Row, Target, field, optional_field
from hvd_compress.comm.ops import AllReduce
from hvd_compress.schemes.base import (
    Exchange,
    ExchangeContext,
    Outcome,
    materialize,
)
from hvd_compress.schemes.dense import FP16
from hvd_compress.schemes.packed import PackedScheme
from hvd_compress.schemes.powersgd import PowerSGD

KERNEL_SCHEMES = tuple(spec for spec in SCHEMES if spec != "none")
"""Every benchmarked scheme but ``none``, which has nothing to encode."""

DEVICES = ("cpu", "cuda")
CUDA_WARMUP = 3
"""Untimed runs of each kernel and copy before timing on CUDA (kernel loading, the caching
allocator's first blocks); one on the CPU."""

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
        gen = torch.Generator(device=x.device).manual_seed(1)
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


def _cuda_seconds(fn: Callable[[], object]) -> float:
    """Seconds between CUDA events recorded before and after ``fn()`` on the current
    stream, once the second has completed."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_against_copy(kernel: Kernel, x: torch.Tensor, repeat: int) -> tuple[float, float]:
    """Median seconds of the kernel and of copying ``x`` (on its device), timed alternately
    after a warm-up (one run each on the CPU, :data:`CUDA_WARMUP` on CUDA, where CUDA
    events time them)."""
    dst = torch.empty_like(x)
    cuda = x.device.type == "cuda"
    seconds = _cuda_seconds if cuda else _seconds
    for _ in range(CUDA_WARMUP if cuda else 1):
        kernel.run()
        dst.copy_(x)
    if cuda:
        torch.cuda.synchronize(x.device)
    kernel_times, copy_times = [], []
    for _ in range(repeat):
        copy_times.append(seconds(lambda: dst.copy_(x)))
        kernel_times.append(seconds(kernel.run))
    return statistics.median(kernel_times), statistics.median(copy_times)


COLUMNS = (
    Column("device", field("device")),
    Column("scheme", field("scheme")),
    Column("elements", field("numel", "{:,}")),
    Column("timed", field("op")),
    Column("seconds", field("seconds", "{:.4g}")),
    Column("GB/s", lambda row: f"{row['bytes_per_second'] / 1e9:.3f}"),
    Column("copy GB/s", lambda row: f"{row['copy_bytes_per_second'] / 1e9:.3f}"),
    Column("ratio to copy", field("ratio_to_copy", "{:.3f}")),
)

TARGETS = tuple(Target({"device": "cpu", "scheme": spec, "numel": 64 << 20}, "ratio_to_copy",
                       ">=", 0.5) for spec in ("fp16", "onebit", "qsgd:bits=4"))
"""On the CPU only: nothing has been measured on CUDA to set a goal by."""


def device_name(device: str) -> str:
    """The device as the title and rows name it: the CPU's threads, or the GPU's name with
    torch's CUDA version."""
    if device == "cuda":
        return (f"{torch.cuda.get_device_name()} (torch {torch.__version__}, "
                f"CUDA {torch.version.cuda})")
    return f"CPU, {torch.get_num_threads()} threads"


def check_device(device: str) -> torch.device:
    """``device`` as a torch device; ``ValueError`` saying what is missing if it cannot
    run here."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False here (torch "
                         f"{torch.__version__}, built with CUDA {torch.version.cuda})")
    return torch.device(device)


def title(repeat: int, device: str = "cpu") -> str:
    if device == "cuda":
        return (f"Encode+decode throughput on {device_name(device)} (float32 input bytes/s), "
                f"median of {repeat} timed with CUDA events after {CUDA_WARMUP} warm-ups, "
                "interleaved with a device-to-device dst.copy_(src)")
    return (f"Encode+decode throughput (float32 input bytes/s), median of {repeat}, "
            f"interleaved with dst.copy_(src); threads (copy, casts and codec kernels): "
            f"{torch.get_num_threads()}")


def run(sizes: Sequence[int], repeat: int, device: str = "cpu",
        schemes: Sequence[str] = KERNEL_SCHEMES) -> list[Row]:
    """One row per (size, scheme), on ``device`` (``cpu`` or ``cuda``)."""
    where = check_device(device)
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(where)
        for spec in schemes:
            kernel = make_kernel(spec, x)
            seconds, copy_seconds = time_against_copy(kernel, x, repeat)
            rate, copy_rate = 4 * numel / seconds, 4 * numel / copy_seconds
            rows.append({
                "device": device, "device_name": device_name(device),
                "scheme": spec, "numel": numel, "op": kernel.op, "shape": list(kernel.shape),
                "seconds": seconds, "bytes_per_second": rate,
                "copy_seconds": copy_seconds, "copy_bytes_per_second": copy_rate,
                "ratio_to_copy": rate / copy_rate, "repeat": repeat,
                "torch_threads": torch.get_num_threads(),
            })
            del kernel
    return rows


# --- The Triton kernels on CUDA (``--device cuda``: the table ``triton``) ------------------

TRITON_CODECS = ("onebit", "qsgd:bits=4", "terngrad", "fp16", "bf16", "onebit+ef",
                 "qsgd:bits=4+ef", "fp16+ef", "randomk:ratio=0.01", "topk:ratio=0.001")
"""The rows of the Triton table: the packed codecs' encode+decode (``+ef``: with the
residual fused, against torch's ``x + e``, encode, decode and ``x - decoded``), random-k's
gather and top-k's selection (against ``torch.topk`` of the whole tensor, with recall)."""

GRACE_CODECS = {"onebit": ("onebit", "OneBitCompressor", ()),
                "qsgd:bits=4": ("qsgd", "QSGDCompressor", (7,)),
                "terngrad": ("terngrad", "TernGradCompressor", ()),
                "fp16": ("fp16", "FP16Compressor", ()),
                "randomk:ratio=0.01": ("randomk", "RandomKCompressor", (0.01,)),
                "topk:ratio=0.001": ("topk", "TopKCompressor", (0.001,))}
"""Our codec -> GRACE's torch compressor (module under ``grace_dl.torch.compressor``,
class, arguments), timed as ``decompress(*compress(x, name))`` where GRACE imports."""


def grace_status() -> str | None:
    """Why GRACE's compressors cannot be timed here (``None`` if they can)."""
    try:
        import grace_dl.torch  # noqa: F401
    except Exception as err:
        return (f"GRACE not timed: grace_dl does not import ({type(err).__name__}: {err}); it "
                "is not on PyPI (pip finds no grace-dl), and the GPU machine is offline")
    return None


def _grace(spec: str) -> Callable[[torch.Tensor], object] | None:
    if spec not in GRACE_CODECS or grace_status() is not None:
        return None
    import importlib

    module, cls, args = GRACE_CODECS[spec]
    compressor = getattr(importlib.import_module(f"grace_dl.torch.compressor.{module}"),
                         cls)(*args)
    return lambda x: compressor.decompress(*compressor.compress(x, "bench"))


@dataclass(frozen=True)
class TritonKernel:
    """One row of the Triton table: ``triton()`` and its torch-ops counterpart ``torch()``
    on the same tensor; ``grace()`` where GRACE has the codec and imports."""

    spec: str
    op: str
    triton: Callable[[], object]
    torch: Callable[[], object]
    grace: Callable[[], object] | None = None


def make_triton_kernel(spec: str, x: torch.Tensor, residual: torch.Tensor) -> TritonKernel:
    """The Triton and torch-ops operations of ``spec`` (one of :data:`TRITON_CODECS`) on
    the flat float32 ``x`` (``residual``: the error-feedback memory of the ``+ef`` rows)."""
    from hvd_compress import native
    from hvd_compress import triton as gpu
    from hvd_compress.schemes.topk import largest, sparse_count

    n, device = x.numel(), x.device
    base, fused = spec.removesuffix("+ef"), spec.endswith("+ef")
    grace_fn = _grace(spec)
    grace = (lambda: grace_fn(x)) if grace_fn is not None else None

    def torch_route(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with native.disabled(), gpu.disabled():
                return fn()
        return run

    if base.startswith("topk"):
        k = sparse_count(0.001, n)
        gen = torch.Generator().manual_seed(3)
        mag = x.abs()
        return TritonKernel(spec, f"top-{k} of |x|: sampled threshold, compaction, topk of "
                            "the candidates", lambda: largest(mag, k, gen),
                            lambda: mag.topk(k, sorted=False).indices, grace)
    if base.startswith("randomk"):
        k = sparse_count(0.01, n)
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(4))[:k].to(device)
        sparse = gpu.kernels("sparse")
        return TritonKernel(spec, f"x[indices] * (n / k), k = {k}",
                            lambda: sparse.gather(x, idx, n / k),
                            lambda: x[idx] * (n / k), grace)
    if base in ("fp16", "bf16"):
        dtype = torch.float16 if base == "fp16" else torch.bfloat16
        cast = gpu.kernels("cast")
        if fused:
            def triton_fn() -> object:
                payload, new = cast.encode(x, dtype, residual)
                return payload.view(dtype).float(), new

            def torch_fn() -> object:
                y = x + residual
                back = y.to(dtype).float()
                return back, y - back
            return TritonKernel(spec, f"x + e -> {base}, residual; back to float32",
                                triton_fn, torch_fn)
        return TritonKernel(spec, f"x -> {base} -> float32",
                            lambda: cast.encode(x, dtype)[0].view(dtype).float(),
                            lambda: x.to(dtype).float(), grace)
    scheme = Compression.parse(base)
    assert isinstance(scheme, PackedScheme)
    options = {"bits": getattr(scheme, "bits", 1), "l2": getattr(scheme, "norm", "") == "l2",
               "clip": getattr(scheme, "clip", None)}
    codec, bucket = scheme.name, scheme.bucket_size
    packed = gpu.kernels("packed")
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(1)

    def decode(payload: torch.Tensor) -> torch.Tensor:
        return packed.decode(codec, payload, n, bucket, options["bits"])
    if fused:
        def triton_fn() -> object:
            payload, new = packed.encode(codec, x, bucket, seed=seed, residual=residual,
                                         **options)
            return decode(payload), new

        def torch_fn() -> object:
            y = x + residual
            back = scheme.decode(scheme.encode(y, gen), n)
            return back, y - back
        return TritonKernel(spec, "encode(x + e) with the residual, decode", triton_fn,
                            torch_route(torch_fn))
    return TritonKernel(spec, "decode(encode(x))",
                        lambda: decode(packed.encode(codec, x, bucket, seed=seed, **options)[0]),
                        torch_route(lambda: scheme.decode(scheme.encode(x, gen), n)), grace)


def time_interleaved(fns: dict[str, Callable[[], object]], x: torch.Tensor,
                     repeat: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` and of ``copy`` (``dst.copy_(x)``), timed in turn
    (copy, then each) ``repeat`` times after the warm-ups of :func:`time_against_copy`."""
    dst = torch.empty_like(x)
    fns = {"copy": lambda: dst.copy_(x), **fns}
    cuda = x.device.type == "cuda"
    seconds = _cuda_seconds if cuda else _seconds
    for _ in range(CUDA_WARMUP if cuda else 1):
        for fn in fns.values():
            fn()
    if cuda:
        torch.cuda.synchronize(x.device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(seconds(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def _recall(chosen: torch.Tensor, exact: torch.Tensor, n: int) -> float:
    marked = torch.zeros(n, dtype=torch.bool, device=exact.device)
    marked[exact] = True
    return float(marked[chosen].sum()) / exact.numel()


def run_triton(sizes: Sequence[int], repeat: int, device: str = "cuda",
               codecs: Sequence[str] = TRITON_CODECS) -> list[Row]:
    """One row per (size, codec): the Triton kernels against the torch ops of the same
    operation (:func:`make_triton_kernel`), a device copy and GRACE's compressor where it
    imports, timed in turn. On the CPU (Triton's interpreter) only to check this code."""
    from hvd_compress import triton as gpu

    where = torch.device(device)
    rows = []
    for numel in sizes:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(numel, generator=gen).to(where)
        residual = (torch.randn(numel, generator=gen) / 16).to(where)
        for spec in codecs:
            kernel = make_triton_kernel(spec, x, residual)
            fns = {"triton": kernel.triton, "torch": kernel.torch}
            if kernel.grace is not None:
                fns["grace"] = kernel.grace
            t = time_interleaved(fns, x, repeat)
            rate, copy_rate = 4 * numel / t["triton"], 4 * numel / t["copy"]
            row: Row = {
                "device": device, "device_name": device_name(device), "scheme": spec,
                "numel": numel, "op": kernel.op,
                "route": "triton" if gpu.available() else f"torch ops ({gpu.reason()})",
                "seconds": t["triton"], "bytes_per_second": rate,
                "copy_seconds": t["copy"], "copy_bytes_per_second": copy_rate,
                "ratio_to_copy": rate / copy_rate, "torch_seconds": t["torch"],
                "speedup_vs_torch": t["torch"] / t["triton"],
                "grace_seconds": t.get("grace"),
                "speedup_vs_grace": t["grace"] / t["triton"] if "grace" in t else None,
                "recall": None, "repeat": repeat,
            }
            if spec.startswith("topk"):
                exact = kernel.torch()
                assert isinstance(exact, torch.Tensor)
                chosen = kernel.triton()
                assert isinstance(chosen, torch.Tensor)
                row["recall"] = _recall(chosen, exact, numel)
            rows.append(row)
            del kernel
    return rows


def triton_title(repeat: int, device: str = "cuda") -> str:
    grace = grace_status()
    return (f"Triton kernels on {device_name(device)} against the torch ops of the same "
            f"operation (float32 input bytes/s), median of {repeat} timed with CUDA events "
            f"after {CUDA_WARMUP} warm-ups (the first compiles), interleaved with a "
            f"device-to-device copy; top-k: against torch.topk of the whole tensor"
            + (f". {grace}" if grace else ""))


TRITON_COLUMNS = (
    Column("scheme", field("scheme")),
    Column("elements", field("numel", "{:,}")),
    Column("route", field("route")),
    Column("timed", field("op")),
    Column("seconds", field("seconds", "{:.4g}")),
    Column("ratio to copy", field("ratio_to_copy", "{:.3f}")),
    Column("torch ops s", field("torch_seconds", "{:.4g}")),
    Column("vs torch ops", field("speedup_vs_torch", "{:.2f}x")),
    Column("vs GRACE", optional_field("speedup_vs_grace", "{:.1f}x")),
    Column("recall", optional_field("recall", "{:.4f}")),
)

TRITON_TARGETS = (
    *(Target({"scheme": spec, "numel": 64 << 20, "route": "triton"}, "ratio_to_copy", ">=", 0.5)
      for spec in ("onebit", "qsgd:bits=4", "fp16")),
    Target({"scheme": "topk:ratio=0.001", "numel": 64 << 20}, "speedup_vs_torch", ">=", 1.0),
    Target({"scheme": "topk:ratio=0.001", "numel": 64 << 20}, "recall", ">=", 0.999),
    *(Target({"scheme": spec, "numel": 64 << 20}, "speedup_vs_grace", ">=", 10.0)
      for spec in GRACE_CODECS),
)
"""The issue's targets on CUDA (64 M elements): 1-bit, QSGD 4-bit and FP16 at half the
copy's throughput or more; top-k faster than torch.topk with recall 0.999; every codec 10x
GRACE's (rows without a GRACE time are reported as not measured)."""
