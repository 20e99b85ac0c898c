"""``collectives="gloo"``: the communicator over a ``torch.distributed`` Gloo group beside
Horovod.

The communicator and the group's set-up are :mod:`hvd_compress.comm.torch_dist`'s, shared
with ``collectives="nccl"``; this module keeps the Gloo names.
"""

from __future__ import annotations

from typing import Any

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.torch_dist import (
    DEFAULT_TIMEOUT_S,
    TorchDistCommunicator,
    horovod_group,
    interface_address,
)

__all__ = ["DEFAULT_TIMEOUT_S", "GlooCommunicator", "horovod_gloo_group", "interface_address"]


class GlooCommunicator(TorchDistCommunicator):
    """:class:`~hvd_compress.comm.torch_dist.TorchDistCommunicator` on a Gloo ``group``,
    with ``fallback`` (Horovod) for the sparse sums and self-delimiting all-gathers."""

    def __init__(self, group: Any, fallback: Communicator) -> None:
        super().__init__(group, fallback)
        if self.backend != "gloo":
            raise ValueError(f"GlooCommunicator needs a Gloo group, got a {self.backend} one")


def horovod_gloo_group(hvd: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A Gloo process group over Horovod's global ranks, made once per process
    (:func:`~hvd_compress.comm.torch_dist.horovod_group`)."""
    return horovod_group(hvd, "gloo", timeout_s)
