"""tests/workers/torch_dist.py's rank with every dense all-reduce of at most ``argv[4]``
bytes on the one-hop path (:attr:`TorchDistCommunicator.small_sum_bytes`)."""

from __future__ import annotations

import sys

from hvd_compress.comm.torch_dist import TorchDistCommunicator
from tests.workers.torch_dist import main

if __name__ == "__main__":
    TorchDistCommunicator.small_sum_bytes = int(sys.argv.pop(4))
    main()
