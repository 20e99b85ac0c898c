"""Native CPU kernels: the packed codecs (``codecs.cpp``), PowerSGD's products and
commit (``lowrank.cpp``) and the parameter server's sparse index coding and aggregation
(``sparse.cpp``, used through :mod:`hvd_compress.native.sparse`, and for a whole round
through :mod:`hvd_compress.native.round`).

Importing this package needs no torch: finding, building and loading the library is
:mod:`hvd_compress.native.loader` (compiled at install, with a run-time ``g++`` build as a
fallback that warns), and the parameter server uses only that and
:mod:`~hvd_compress.native.sparse`. The torch entry points (:func:`active`, :func:`seed`,
:func:`encode`, :func:`decode`, :func:`empty`) live in :mod:`hvd_compress.native.tensors`
and :mod:`hvd_compress.native.buffers`, imported on first access.
"""

from __future__ import annotations

from hvd_compress.lazy import attributes
from hvd_compress.native.loader import (
    SOURCES,
    available,
    build,
    cache_dir,
    compiler,
    disabled,
    installed_path,
    library,
    library_path,
    source_hash,
)

__all__ = ["SOURCES", "active", "available", "build", "cache_dir", "compiler", "decode",
           "disabled", "empty", "encode", "installed_path", "library", "library_path",
           "seed", "source_hash"]

_TORCH_NAMES = {"active": "tensors", "seed": "tensors", "encode": "tensors",
                "decode": "tensors", "empty": "buffers"}


__getattr__ = attributes(__name__, _TORCH_NAMES, globals())
"""Import the torch entry points on first use, so the server needs no torch."""
