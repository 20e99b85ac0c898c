"""``broadcast_parameters`` for tensors of any dtype, bfloat16 included.

Horovod 0.28.1's ``hvd.broadcast_parameters`` (and so ``hvd.broadcast_optimizer_state``)
refuses bfloat16 tensors ("Tensor type torch.BFloat16Tensor is not supported"). A broadcast
only moves bits, so this one broadcasts such a tensor through a view of its bits as a
same-sized integer type (:func:`hvd_compress.comm.horovod_torch.as_movable`): the receivers
get root's values bit for bit, in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import horovod.torch as hvd
import horovod.torch.functions as hvd_functions
import torch

from hvd_compress.comm.base import poll_until
from hvd_compress.comm.horovod_torch import as_movable


def broadcast_parameters(params: dict[str, torch.Tensor] | Iterable[Any], root_rank: int,
                         process_set: Any = None) -> None:
    """Set every rank's tensors to ``root_rank``'s, in place: ``hvd.broadcast_parameters``
    for any dtype Horovod can hold in memory (bfloat16 travels as its int16 bit patterns).

    ``params`` is what Horovod's takes: a dict (``model.state_dict()``, broadcast in sorted
    key order), or a sequence of tensors or of ``(name, tensor)`` pairs
    (``model.parameters()``, ``model.named_parameters()``). Every rank must pass the same
    names, shapes and dtypes. ``process_set`` defaults to Horovod's global one. Tensors
    must be contiguous (parameters and optimizer states are).
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"params must be a dict or a sequence of tensors or (name, tensor) "
                         f"pairs, such as model.state_dict(); got {type(params).__name__}")
    process_set = process_set if process_set is not None else hvd.global_process_set
    handles = []
    for name, tensor in items:
        if not tensor.is_contiguous():
            raise ValueError(f"cannot broadcast {name or 'a tensor'} in place: it is not "
                             "contiguous; broadcast a contiguous copy and assign it")
        handles.append(hvd.broadcast_async_(as_movable(tensor.data), root_rank, name=name,
                                            process_set=process_set))
    for handle in handles:
        poll_until(lambda handle=handle: hvd.poll(handle))
        hvd.synchronize(handle)


@contextmanager
def any_dtype_broadcasts() -> Iterator[None]:
    """Within this context Horovod's ``broadcast_optimizer_state`` broadcasts its tensors
    through :func:`broadcast_parameters` (it looks the function up in its module at each
    call); outside, Horovod's own is restored. Not for use from several threads at once."""
    original = hvd_functions.broadcast_parameters
    hvd_functions.broadcast_parameters = broadcast_parameters
    try:
        yield
    finally:
        hvd_functions.broadcast_parameters = original
