"""``python -m hvd_compress.bench.reliability``: see :mod:`hvd_compress.bench.reliability`."""

import sys

from hvd_compress.bench.reliability.cli import main

sys.exit(main())
