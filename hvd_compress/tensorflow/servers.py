"""Parameter servers for the TensorFlow binding: the session id broadcast and the
communicator for ``ps=`` (resolved, with its ``$HVD_COMPRESS_PS`` default, by
:func:`hvd_compress.binding.resolve_ps`, as for the PyTorch binding), and :func:`init` for
MPMD launches with server ranks.

The servers (``python -m ps_server``) and their clients are the PyTorch binding's
(:mod:`hvd_compress.comm.parameter_server`): a sparse scheme's pairs travel in the same
frames, and every other collective still goes through Horovod's TensorFlow ops.
"""

from __future__ import annotations

import os
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvd_compress import mpmd
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect
from hvd_compress.tensorflow.comm import BROADCAST, Request, run_requests

SESSION_BYTES = 4



def broadcast_session(process_set: Any, root_rank: int = 0) -> str:
    """A random session id drawn on ``root_rank`` and broadcast to the process set.

    Runs eagerly even while a ``tf.function`` is being traced (a tape made inside the
    training step creates its exchange then): the id is needed when the step is built.
    """
    with tf.init_scope():
        local = tf.constant(np.frombuffer(os.urandom(SESSION_BYTES), np.uint8))
        request = Request(BROADCAST, "hvdc.ps_session", (local,), root_rank=root_rank)
        run_requests([request], process_set)
        assert request.outputs is not None
        return bytes(request.outputs[0].numpy()).hex()


def with_servers(dense: Communicator, ps: str | None, process_set: Any,
                 connect_timeout: float | None = None) -> Communicator:
    """``dense``, or, when ``ps`` names servers, a communicator sending the sparse sums to
    them under a session id broadcast from rank 0 (every other collective through
    ``dense``); ``ps`` as :func:`~hvd_compress.binding.resolve_ps` returns it.
    ``connect_timeout``: seconds to wait for a gRPC server never reached
    (:func:`~hvd_compress.comm.parameter_server.connect`; ``None`` for
    ``$HVD_COMPRESS_PS_CONNECT_TIMEOUT`` or 10 s)."""
    if not ps:
        return dense
    # Under horovodrun elastic a rank that joins later builds its exchange alone: no
    # collective here; hvd_compress.tensorflow.elastic.KerasState's sync gives the session.
    session = (os.urandom(SESSION_BYTES).hex() if os.environ.get("HOROVOD_ELASTIC") == "1"
               else broadcast_session(process_set))
    return ParameterServerCommunicator(
        dense, connect(ps, dense.rank, connect_timeout=connect_timeout), session)


def init(ps: str | None = None, controller: str | None = None, **kwargs: Any) -> None:
    """Start Horovod: ``horovod.tensorflow.init(**kwargs)``, or, for ``ps="mpi"`` (default
    ``$HVD_COMPRESS_PS``), split the parameter-server ranks of an MPMD ``mpirun`` off
    ``MPI.COMM_WORLD`` and start Horovod on the workers' communicator::

        mpirun -np 2 python train.py : -np 1 python -m ps_server --transport mpi --workers 2

    ``controller`` (``"auto"``, ``"gloo"`` or ``"horovod"``; default
    ``$HVD_COMPRESS_CONTROLLER``, else ``"auto"``: Horovod's Gloo controller in ranks that
    ``mpirun`` started, unless something needs its MPI controller) as in
    :func:`hvd_compress.mpmd.init`.

    See :func:`hvd_compress.mpmd.init` (shared with ``hvd_compress.torch.init``). In a
    process that also runs Horovod's PyTorch library, both may call their ``init`` (the MPI
    split happens once; both get the same workers' communicator)."""
    mpmd.init(hvd, "hvd_compress.tensorflow", ps, controller, **kwargs)
