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

from hvd_compress import registry

SCHEMES = registry.bench_specs(sparse=False)
"""The dense schemes benchmarked, as :meth:`hvd_compress.Compression.parse` spec strings
(each scheme's ``bench`` specs in :data:`hvd_compress.registry.TABLE`)."""

SPARSE_SCHEMES = registry.bench_specs(sparse=True)
"""The sparse schemes of the wire benchmark (their pairs' coded index and value bytes)."""
