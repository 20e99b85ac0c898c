"""Deprecated: ``Compression.auto`` and its cost model moved to :mod:`hvd_compress.policy`.

Importing this module warns (``DeprecationWarning``) and gives :mod:`hvd_compress.policy`
itself, so its names (and a test's patches of them) are the routing module's. It will be
removed in the next release.
"""

from __future__ import annotations

import sys
import warnings

from hvd_compress import policy

warnings.warn("hvd_compress.schemes.auto moved to hvd_compress.policy (Auto, LinkModel, "
              "Decision, measure_route, ...); import them from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = policy
