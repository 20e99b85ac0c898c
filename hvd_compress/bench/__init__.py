"""Benchmarks, ``python -m hvd_compress.bench COMMAND``: ``wire`` measures the bytes each
scheme puts on the wire per step; ``kernels`` times encoding and decoding against a memory
copy, the TensorFlow (DLPack) path against the torch path, and DGC's threshold selection
against ``torch.topk``; ``ps`` measures the parameter server's pairs per second; ``link``
times steps on emulated hosts with throttled links (root); ``cluster`` trains on emulated
hosts against PyTorch DDP and stock Horovod in the same run (root); ``converge`` trains a
character transformer and the digits MLP on 2 ranks with every scheme against
uncompressed. Each prints a table, reports PASS/FAIL against its targets (never failing the
process) and can write its rows as JSON (``--json FILE`` or ``--out-dir``).
``python -m hvd_compress.bench.reliability`` is the parameter server's fault, fuzz, load
and security campaign.
"""

from __future__ import annotations

SCHEMES = (
    "none",
    "fp16",
    "bf16",
    "onebit",
    "qsgd:bits=4",
    "qsgd:bits=8",
    "terngrad",
    "powersgd:rank=4,start_iter=0",
    "powersgd:rank=1,start_iter=0",
)
"""The dense schemes benchmarked, as :meth:`hvd_compress.Compression.parse` spec strings."""

SPARSE_SCHEMES = (
    "topk:ratio=0.001",
    "topk:ratio=0.001,values=fp16",
    "dgc:ratio=0.001",
    "randomk:ratio=0.01",
)
"""The sparse schemes of the wire benchmark (their pairs' coded index and value bytes)."""
