"""What :func:`hvd_compress.torch.init` set up under ``mpirun``: Open MPI's own value of the
settings it defaults, read back through MPI's tool interface (``MPI_T``) after Horovod
started, and which controller Horovod runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any


def control_variable(lib: ctypes.CDLL, name: str) -> int:
    """The value Open MPI uses for its integer or boolean MCA parameter ``name``."""
    index, handle, count = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int()
    calls = (("MPI_T_cvar_get_index", (name.encode(), ctypes.byref(index))),
             ("MPI_T_cvar_handle_alloc", (index, None, ctypes.byref(handle),
                                          ctypes.byref(count))))
    for function, args in calls:
        code = getattr(lib, function)(*args)
        if code != 0:
            raise RuntimeError(f"{function}({name!r}) returned {code}")
    value = (ctypes.c_int * 4)()  # a bool or an int, zero-padded
    if lib.MPI_T_cvar_read(handle, value) != 0:
        raise RuntimeError(f"MPI_T_cvar_read({name!r}) failed")
    lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    return int(value[0])


def open_mpi_settings() -> dict[str, Any]:
    """``mpi_yield_when_idle`` as Open MPI read it at ``MPI_Init``, and the environment's
    ``HOROVOD_CYCLE_TIME``."""
    path = ctypes.util.find_library("mpi")
    if path is None:
        raise RuntimeError("libmpi not found")
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # the one Horovod loaded
    provided = ctypes.c_int()
    if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
        raise RuntimeError("MPI_T_init_thread failed")
    try:
        return {"yield_when_idle": control_variable(lib, "mpi_yield_when_idle"),
                "cycle_time": os.environ.get("HOROVOD_CYCLE_TIME")}
    finally:
        lib.MPI_T_finalize()


def horovod_controller() -> dict[str, Any]:
    """Which controller Horovod runs (and what ``init`` said about it), its ranks and sizes,
    and the MPI rank beside them."""
    import horovod.torch as hvd
    from mpi4py import MPI

    from hvd_compress import mpmd

    return {"chosen": mpmd.chosen, "gloo": hvd.gloo_enabled(), "mpi": hvd.mpi_enabled(),
            "rank": hvd.rank(),
            "mpi_rank": MPI.COMM_WORLD.Get_rank(), "size": hvd.size(),
            "local": (hvd.local_rank(), hvd.local_size()),
            "cross": (hvd.cross_rank(), hvd.cross_size())}
