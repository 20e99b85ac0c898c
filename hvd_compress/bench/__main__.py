"""``python -m hvd_compress.bench``: see :mod:`hvd_compress.bench.cli`."""

from hvd_compress.bench.cli import main

raise SystemExit(main())
