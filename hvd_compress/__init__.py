"""Gradient compression for Horovod.

``from hvd_compress import Compression`` and pass a scheme as ``compression=`` to
:func:`hvd_compress.torch.DistributedOptimizer`.

Importing the package itself loads no deep-learning framework: the names below are
imported on first access (PEP 562), so the parameter server (:mod:`ps_server`), the
sparse frames (:mod:`hvd_compress.sparse_wire`) and the protocol's names
(:mod:`hvd_compress.ps_protocol`) run where torch is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hvd_compress.lazy import attributes

if TYPE_CHECKING:
    from hvd_compress.compression import Compression
    from hvd_compress.errors import NonFiniteGradientError
    from hvd_compress.pipeline import Pipeline, StepStats
    from hvd_compress.policy import Policy

__all__ = ["Compression", "NonFiniteGradientError", "Pipeline", "Policy", "StepStats"]
__version__ = "0.1.0"

_LAZY = {"Compression": "compression", "NonFiniteGradientError": "errors",
         "Pipeline": "pipeline", "StepStats": "pipeline", "Policy": "policy"}


__getattr__ = attributes(__name__, _LAZY, globals())
"""Import ``Compression`` and the other public names (which need torch) on first use."""


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
