"""TensorFlow 2 binding: Horovod's ``DistributedGradientTape`` and ``broadcast_variables``
with any scheme, and (in :mod:`hvd_compress.tensorflow.keras`) a Keras 3 optimizer wrapper.

The schemes are the torch ones: gradients cross to torch and payloads come back to
Horovod's TensorFlow collectives through DLPack, without copies
(:mod:`hvd_compress.tensorflow.comm`). Sparse schemes can sum their pairs on parameter
servers (``ps=``, :mod:`hvd_compress.tensorflow.servers`). Call
``horovod.tensorflow.init()`` first, or :func:`init`, which also joins parameter-server
ranks of an MPMD ``mpirun`` (``ps="mpi"``). Imported under an MPMD ``mpirun``, this
package makes a plain ``horovod.tensorflow.init()`` in a world with server ranks raise at
once instead of blocking (see :mod:`hvd_compress.mpmd`).
"""

import horovod.tensorflow as _horovod

from hvd_compress.mpmd import guard as _guard
from hvd_compress.tensorflow.broadcast import broadcast_variables
from hvd_compress.tensorflow.comm import HorovodTFCommunicator
from hvd_compress.tensorflow.exchange import (
    CompressionState,
    GradientExchange,
    XLACompileError,
    compression_state,
)
from hvd_compress.tensorflow.servers import init
from hvd_compress.tensorflow.tape import DistributedGradientTape

_guard(_horovod, "hvd_compress.tensorflow")

__all__ = ["CompressionState", "DistributedGradientTape", "GradientExchange",
           "HorovodTFCommunicator", "XLACompileError", "broadcast_variables",
           "compression_state", "init"]
