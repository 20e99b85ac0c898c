"""A worker of an MPMD ``mpirun`` with parameter-server ranks, for tests/test_mpmd.py:
``python -m tests.workers.mpmd_init {plain|hvdc|default} {torch|tensorflow}``.

``plain`` starts Horovod the wrong way (``hvd.init()``, which would block for ever on a
world with server ranks) and prints the time just before; ``hvdc`` the documented way
(``hvd_compress.<binding>.init(ps="mpi")``) and prints ``size=N rank=R`` and an all-reduce
of the ranks over the workers' communicator; ``default`` the same with ``init()``'s
defaults (no servers), adding which controller Horovod runs.
"""

from __future__ import annotations

import importlib
import sys
import time


def main() -> None:
    how, binding = sys.argv[1], sys.argv[2]
    hvd = importlib.import_module(f"horovod.{binding}")
    hvdc = importlib.import_module(f"hvd_compress.{binding}")
    if how == "plain":
        print(f"calling hvd.init at {time.time():.3f}", flush=True)
        hvd.init()
        print("hvd.init returned", flush=True)
        return
    hvdc.init() if how == "default" else hvdc.init(ps="mpi")
    if binding == "torch":
        import torch

        total = int(hvd.allreduce(torch.tensor([hvd.rank()]), op=hvd.Sum).item())
    else:
        import tensorflow as tf

        total = int(hvd.allreduce(tf.constant([hvd.rank()]), op=hvd.Sum).numpy()[0])
    controller = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "?"
    print(f"size={hvd.size()} rank={hvd.rank()} rank_sum={total} controller={controller}",
          flush=True)


if __name__ == "__main__":
    main()
