"""PyTorch binding: a drop-in for ``horovod.torch.DistributedOptimizer`` taking any scheme.

Start Horovod with :func:`init` (``init(ps="mpi")`` in an MPMD ``mpirun`` with
parameter-server ranks). Imported under an MPMD ``mpirun``, this module makes a plain
``horovod.torch.init()`` in a world with server ranks raise at once instead of blocking
(see :mod:`hvd_compress.mpmd`).
"""

import horovod.torch as _horovod

from hvd_compress.mpmd import guard as _guard
from hvd_compress.torch.broadcast import broadcast_parameters
from hvd_compress.torch.onebit_adam import OneBitAdam
from hvd_compress.torch.onebit_lamb import OneBitLamb
from hvd_compress.torch.optimizer import DistributedOptimizer, broadcast_optimizer_state, init
from hvd_compress.torch.zero_one_adam import ZeroOneAdam

_guard(_horovod, "hvd_compress.torch")

__all__ = ["DistributedOptimizer", "OneBitAdam", "OneBitLamb", "ZeroOneAdam",
           "broadcast_optimizer_state", "broadcast_parameters", "init"]
