"""What Open MPI itself holds for the settings :func:`hvd_compress.torch.init` defaults,
read back through MPI's tool interface (``MPI_T``) after Horovod started."""

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
