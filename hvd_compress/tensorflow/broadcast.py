"""``broadcast_variables`` that works with Keras 3 variables.

Horovod 0.28.1's ``hvd.broadcast_variables`` fails on them (``'SymbolicTensor' object has
no attribute 'assign'``: it traces the assignment on the variables' graph-mode handles).
This one reads each variable as a tensor, broadcasts it, and calls the variable's own
``assign``, which both ``tf.Variable`` and ``keras.Variable`` provide. Variables of dtypes
Horovod refuses (bfloat16) travel as their bit patterns
(:func:`hvd_compress.tensorflow.comm.collective`), so every rank gets root's values bit for
bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress.tensorflow.comm import BROADCAST, Request, collective, run_requests


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0,
                        process_set: Any = hvd.global_process_set) -> Any:
    """Set every rank's ``variables`` to ``root_rank``'s values.

    Eagerly, all broadcasts run together in one graph call and the variables are assigned
    before this returns. Inside a ``tf.function`` it returns the grouped assign op (as
    Horovod's does). Every rank must pass the same variables in the same order.
    """
    variables = list(variables)
    if not variables:
        return None
    names = [f"hvdc.broadcast.{i}" for i in range(len(variables))]
    values = [tf.convert_to_tensor(v) for v in variables]
    if not tf.executing_eagerly():
        return tf.group([v.assign(collective(BROADCAST, name, x, process_set, root_rank)[0])
                         for v, x, name in zip(variables, values, names)])
    requests = [Request(BROADCAST, name, (x,), root_rank=root_rank)
                for name, x in zip(names, values)]
    run_requests(requests, process_set)
    for variable, request in zip(variables, requests):
        assert request.outputs is not None
        variable.assign(request.outputs[0])
    return None
