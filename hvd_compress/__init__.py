"""Gradient compression for Horovod.

``from hvd_compress import Compression`` and pass a scheme as ``compression=`` to
:func:`hvd_compress.torch.DistributedOptimizer`.
"""

from hvd_compress.compression import Compression
from hvd_compress.errors import NonFiniteGradientError
from hvd_compress.pipeline import Pipeline, StepStats
from hvd_compress.policy import Policy

__all__ = ["Compression", "NonFiniteGradientError", "Pipeline", "Policy", "StepStats"]
__version__ = "0.1.0"
