"""Starting Horovod in an MPMD ``mpirun`` whose other ranks are parameter servers.

``mpirun -np 2 python train.py : -np 1 python -m ps_server --transport mpi --workers 2``
puts the workers and the server in one ``MPI.COMM_WORLD``. Horovod must then run on the
workers' communicator only: plain ``hvd.init()`` starts it on ``MPI.COMM_WORLD``, whose
collective (``MPI_Comm_dup``) the server ranks never join, and it blocks for ever.

The design, the same for both bindings:

- :func:`init` (``hvd_compress.torch.init`` and ``hvd_compress.tensorflow.init``) is the
  documented way: with ``ps="mpi"`` it splits the server ranks off ``MPI.COMM_WORLD``
  (:func:`~hvd_compress.comm.ps_transport.mpi.init_mpi_workers`, the collective the servers
  call at start-up) and starts Horovod on the workers' communicator.
- Importing a binding under an MPMD ``mpirun`` (:func:`launched_mpmd`) wraps that
  binding's Horovod ``init`` (:func:`guard`). A call without ``comm=`` first takes part in
  the servers' start-up collective; if the world has server ranks, it raises at once with
  what to call instead, rather than entering Horovod's ``init``. In an MPMD world without
  servers (every app context a worker importing hvd-compress) the collective finds none and
  Horovod starts on ``MPI.COMM_WORLD`` as before. Outside MPMD ``mpirun`` nothing is wrapped.

MPMD is recognised by Open MPI's ``$OMPI_NUM_APP_CTX`` (the number of ``:``-separated app
contexts), which ``mpirun`` sets in every rank without any communication. Nothing runs at
import: the check is one collective at the moment ``hvd.init()`` is called, which is why it
costs nothing when it is not needed and answers within that collective's time when it is.
Its one requirement: in an MPMD launch, every app context that calls ``hvd.init()`` imports
hvd-compress first (an app context that starts Horovod without it would enter Horovod's
collective while the others enter the servers').
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import Any

from hvd_compress.comm.ps_transport import find
from hvd_compress.comm.ps_transport.base import Transport
from hvd_compress.comm.ps_transport.mpi import init_mpi_workers, joined_client
from hvd_compress.ps_protocol import PS_ENV

MPMD_EXAMPLE = ("mpirun --allow-run-as-root --oversubscribe -np 2 python train.py --ps mpi "
                ": -np 1 python -m ps_server --transport mpi --workers 2")
"""The launch that ``ps="mpi"`` needs, for error messages."""

_GUARDED = "_hvd_compress_guarded"

DEFAULT_CYCLE_TIME_MS = "10"
"""``HOROVOD_CYCLE_TIME`` that :func:`init` sets unless the environment sets one. Horovod's
background thread runs a negotiation cycle every 1 ms by default, each one a small
collective among all ranks even when nothing is pending, whose bytes and CPU compete with
the gradients'; 10 ms batches that traffic (measured in docs/benchmarks.md, "Horovod's own
knobs, measured here")."""


MPI_DEFAULTS = {"OMPI_MCA_mpi_yield_when_idle": "1"}
"""Open MPI settings that :func:`init` sets unless the environment (or ``mpirun --mca``,
which exports them the same way) sets them; Open MPI reads them at ``MPI_Init``.

``mpi_yield_when_idle``: a rank waiting inside MPI (Horovod's background thread in every
collective, the MPI parameter-server client) polls for progress without pause, which takes
a whole core; with it set, every idle poll calls ``sched_yield()`` so the ranks' compute,
data loaders and Python threads sharing those cores run. ``mpirun`` turns it on by itself
only when it knows a node is oversubscribed. With a core to spare per rank the cost is one
system call per idle poll (``python -m hvd_compress.bench cluster --controllers gloo mpi``
measures both routes)."""


def app_contexts() -> int | None:
    """The number of app contexts of this ``mpirun`` (Open MPI's ``$OMPI_NUM_APP_CTX``), or
    ``None`` when not launched by Open MPI's ``mpirun``."""
    value = os.environ.get("OMPI_NUM_APP_CTX", "").strip()
    return int(value) if value.isdigit() else None


def launched_mpmd() -> bool:
    """Whether this process is one rank of an MPMD ``mpirun`` (two or more app contexts)."""
    return (app_contexts() or 0) > 1


def _under_mpi_launcher() -> bool:
    return any(key in os.environ for key in ("OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK"))


def launch_transport(ps: str | None) -> Transport | None:
    """The transport of ``ps`` (``$HVD_COMPRESS_PS`` when ``None``) when its servers are
    ranks of this launch (``Transport.in_launch``: ``"mpi"``), else ``None``."""
    spec = ps if ps is not None else os.environ.get(PS_ENV, "")
    transport = find(spec)
    return transport if transport is not None and transport.in_launch else None


def wants_servers(ps: str | None) -> bool:
    """Whether ``ps`` (``$HVD_COMPRESS_PS`` when ``None``) names servers that are ranks of
    this launch (:func:`launch_transport`)."""
    return launch_transport(ps) is not None


CONTROLLER_ENV = "HVD_COMPRESS_CONTROLLER"
"""Default of :func:`init`'s ``controller``."""
CONTROLLERS = ("auto", "horovod", "gloo")
MPI_ONLY_ENV = ("HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER")
"""Horovod settings whose operations run on MPI: with one of them on, ``"auto"`` keeps
Horovod's MPI controller."""

chosen: tuple[str, str] | None = None
"""What the last :func:`init` under ``mpirun`` chose: ``("gloo" or "mpi", why)``, as rank 0
printed it; ``None`` before, or outside ``mpirun``."""


def _mpi_rank() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _choose(controller: str, reason: str, rank: int | None = None) -> None:
    """Record the controller chosen under ``mpirun`` and say it at rank 0, one line."""
    global chosen
    chosen = (controller, reason)
    if (_mpi_rank() if rank is None else rank) == 0:
        name = {"gloo": "Gloo", "mpi": "MPI"}[controller]
        print(f"hvd_compress: Horovod runs its {name} controller ({reason}); see "
              "docs/user-guide.md#launching-with-mpirun", file=sys.stderr, flush=True)


def _refusal(horovod: ModuleType, transport: Transport | None,
               kwargs: dict[str, Any]) -> str | None:
    """Why this rank must keep Horovod's MPI controller under ``controller="auto"``, or
    ``None`` when nothing here needs it."""
    if transport is not None:
        return f"ps={transport.schemes[0]!r}: its servers are MPI ranks"
    if "comm" in kwargs:
        return "comm= names an MPI communicator"
    if os.environ.get("HOROVOD_CONTROLLER", "gloo") != "gloo":
        return f"HOROVOD_CONTROLLER={os.environ['HOROVOD_CONTROLLER']} is set"
    for key in MPI_ONLY_ENV:
        if os.environ.get(key, "").strip() not in ("", "0"):
            return f"{key} is set and runs on MPI"
    if not horovod.gloo_built():
        return "this Horovod was built without Gloo"
    return None


def init(horovod: ModuleType, binding: str, ps: str | None = None,
         controller: str | None = None, **kwargs: Any) -> None:
    """``horovod.init(**kwargs)`` with ``HOROVOD_CYCLE_TIME`` at
    :data:`DEFAULT_CYCLE_TIME_MS` and Open MPI's :data:`MPI_DEFAULTS` unless the
    environment sets them (they reach MPI only if it starts here), or, for ``ps="mpi"``
    (default ``$HVD_COMPRESS_PS``), split the parameter-server ranks of an MPMD ``mpirun``
    off ``MPI.COMM_WORLD`` and start Horovod on the workers' communicator (``comm=``,
    which must then not be given).

    ``controller`` (default ``$HVD_COMPRESS_CONTROLLER``, else ``"auto"``) matters only in
    ranks that ``mpirun`` started (elsewhere the launcher chose, and nothing changes):

    - ``"auto"``: Horovod's Gloo controller, as ``horovodrun --gloo`` gives it
      (:mod:`hvd_compress.mpi_gloo`), unless something needs its MPI controller: an MPMD
      launch, ``ps="mpi"``, ``comm=``, ``$HOROVOD_CONTROLLER`` set,
      :data:`MPI_ONLY_ENV` set, a Horovod without Gloo, or ranks on several hosts with no
      interface named (``$GLOO_SOCKET_IFNAME``). One collective decides, so every rank
      takes the same controller; rank 0 prints which one and why, one line on stderr
      (also in :data:`chosen`).
    - ``"gloo"``: the Gloo controller, or ``ValueError`` saying why it cannot run.
    - ``"horovod"``: Horovod's own choice (its MPI controller under ``mpirun``).

    What each costs: docs/user-guide.md, "Launching with mpirun".

    ``horovod`` is ``horovod.torch`` or ``horovod.tensorflow``; ``binding`` names the
    caller's module in messages. ``ps="mpi"`` outside an MPMD ``mpirun`` raises
    ``ValueError`` at once with the launch it needs (Open MPI: one app context; no MPI
    launcher at all), instead of failing inside MPI.
    """
    controller = (controller or os.environ.get(CONTROLLER_ENV, "").strip().lower()
                  or "auto")
    if controller not in CONTROLLERS:
        raise ValueError(f"{binding}.init: controller must be one of {CONTROLLERS}, got "
                         f"{controller!r}")
    prepared = (os.environ.get("HOROVOD_CONTROLLER") == "gloo"
                and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ)  # horovodrun, or done
    decide = (controller != "horovod" and _under_mpi_launcher() and not prepared
              and not horovod.is_initialized())
    transport = launch_transport(ps)
    if decide and controller == "gloo" and (transport is not None or "comm" in kwargs):
        raise ValueError(f"{binding}.init(controller='gloo') starts Horovod on every rank of "
                         "MPI.COMM_WORLD; it cannot be combined with ps='mpi' or comm= (use "
                         "gRPC servers, or controller='horovod')")
    for key, value in MPI_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if transport is not None:
        name = transport.schemes[0]
        if "comm" in kwargs:
            raise ValueError(f"{binding}.init(ps={name!r}) makes the workers' communicator "
                             "itself; do not pass comm=")
        contexts = app_contexts()
        if contexts == 1 or (contexts is None and not _under_mpi_launcher()):
            where = ("this mpirun has one app context" if contexts == 1
                     else "this process was not started by mpirun")
            raise ValueError(f"{binding}.init(ps={name!r}) needs parameter-server ranks in the "
                             f"same MPMD mpirun, but {where}; launch e.g. {MPMD_EXAMPLE}, "
                             "or use gRPC servers (ps='grpc://host:port')")
    os.environ.setdefault("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS)
    if decide and controller == "gloo":
        from hvd_compress.mpi_gloo import start_gloo_controller

        start_gloo_controller()
        _choose("gloo", "controller='gloo'")
    elif decide and (launched_mpmd() or transport is not None or "comm" in kwargs):
        # No collective on MPI.COMM_WORLD: some of its ranks may never join one.
        _choose("mpi", _refusal(horovod, transport, kwargs)
                or "an MPMD launch (its other app contexts may be MPI servers)")
    elif decide:
        from hvd_compress.mpi_gloo import start_gloo_controller

        refused = start_gloo_controller(refusal=_refusal(horovod, transport, kwargs),
                                        fallback=True)
        _choose("mpi" if refused else "gloo", refused or "mpirun started the ranks and "
                "nothing needs MPI's; controller='horovod' keeps MPI's")
    elif (controller == "horovod" and _under_mpi_launcher() and not prepared
          and not horovod.is_initialized()):
        _choose("mpi", "controller='horovod'")
    if transport is not None:
        kwargs["comm"] = transport.start_workers()
    horovod.init(**kwargs)


def guard(horovod: ModuleType, binding: str) -> None:
    """Under an MPMD ``mpirun``, make ``horovod.init()`` without ``comm=`` refuse, within
    the time of one MPI collective, to start Horovod on a world that has parameter-server
    ranks (where it would block for ever). A call once Horovod runs is passed through (it
    does nothing). Does nothing outside MPMD or when already installed."""
    original = horovod.init
    if not launched_mpmd() or getattr(original, _GUARDED, False):
        return

    @functools.wraps(original)
    def guarded_init(*args: Any, **kwargs: Any) -> Any:
        comm = args[0] if args else kwargs.get("comm")
        if comm is None and not horovod.is_initialized():
            _refuse_world_with_servers(binding)
        return original(*args, **kwargs)

    setattr(guarded_init, _GUARDED, True)
    horovod.init = guarded_init


def _refuse_world_with_servers(binding: str) -> None:
    """Join the servers' start-up collective; raise ``RuntimeError`` if there are servers.

    The workers' side of the collective (:func:`init_mpi_workers`) raises ``ValueError``
    when the world has no consistent set of server ranks: then there is nothing to refuse
    (misconfigured servers report it themselves and exit, which ends the job).
    """
    try:
        init_mpi_workers()
    except ValueError:
        return
    client = joined_client()
    servers = client.servers if client is not None else []
    raise RuntimeError(
        f"hvd.init() was called without comm= in an MPMD mpirun whose MPI.COMM_WORLD ranks "
        f"{servers} are parameter servers (python -m ps_server --transport mpi): Horovod "
        "would start on MPI.COMM_WORLD, which those ranks never join, and block for ever. "
        f"Start Horovod with {binding}.init(ps='mpi') instead of hvd.init(): it splits the "
        "servers off and starts Horovod on the workers. The servers exit once every worker "
        "has.")
