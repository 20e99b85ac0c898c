"""Deprecated: the compressed all-reduce moved to :mod:`hvd_compress.schemes.packed`.

Importing this module warns (``DeprecationWarning``) and gives the same names; it will be
removed in the next release.
"""

from __future__ import annotations

import warnings

from hvd_compress.schemes.packed import CHUNK_RESIDUAL, chunk_sizes, compressed_allreduce

__all__ = ["CHUNK_RESIDUAL", "chunk_sizes", "compressed_allreduce"]

warnings.warn("hvd_compress.comm.compressed_allreduce moved to hvd_compress.schemes.packed; "
              "import CHUNK_RESIDUAL, chunk_sizes and compressed_allreduce from there",
              DeprecationWarning, stacklevel=2)
