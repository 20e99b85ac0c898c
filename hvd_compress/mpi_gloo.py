"""Horovod's Gloo controller in ranks that ``mpirun`` started.

Under ``mpirun`` Horovod takes its MPI controller, and then waits inside MPI in every
negotiation cycle and every collective, where Open MPI polls for progress on the CPU the
ranks train on (``mpi_yield_when_idle`` softens that; docs/benchmarks.md compares the
launchers). ``horovodrun --gloo`` gives Horovod a Gloo controller instead, whose waits block
in the kernel. :func:`start_gloo_controller` gives ranks that ``mpirun`` started the same:
MPI carries every rank's host name and rank 0's address once, rank 0 serves Horovod's Gloo
rendezvous in a thread of its own process (as ``horovodrun`` serves it), and each rank gets
the environment ``horovodrun --gloo`` gives its ranks, with Horovod's rank equal to the MPI
rank. MPI is then idle for the rest of the job.

Called by ``hvd_compress.torch.init(controller="gloo")`` (and the TensorFlow binding's)
before ``hvd.init()``.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

GLOO_ENV = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")
"""Where the interface for Gloo's connections is read from, in this order."""


def slot_plan(hostnames: list[str]) -> list[Any]:
    """Horovod's slot of every rank (``horovod.runner``'s ``SlotInfo``), rank ``r`` on host
    ``hostnames[r]``: local ranks in rank order within a host, cross ranks in the order the
    hosts first appear, as ``horovodrun`` numbers them."""
    from horovod.runner.common.util.hosts import SlotInfo

    hosts = list(dict.fromkeys(hostnames))
    local_ranks = [hostnames[:r].count(h) for r, h in enumerate(hostnames)]
    local_sizes = {h: hostnames.count(h) for h in hosts}
    slots = []
    for rank, (host, local_rank) in enumerate(zip(hostnames, local_ranks)):
        peers = [h for h in hosts if local_sizes[h] > local_rank]  # hosts with that slot
        slots.append(SlotInfo(hostname=host, rank=rank, local_rank=local_rank,
                              cross_rank=peers.index(host), size=len(hostnames),
                              local_size=local_sizes[host], cross_size=len(peers)))
    return slots


def interface(hostnames: list[str]) -> str:
    """The network interface Horovod's Gloo connects over: ``$GLOO_SOCKET_IFNAME``, else
    ``$HOROVOD_GLOO_IFACE``, else Open MPI's ``btl_tcp_if_include`` when it names one
    interface, else loopback when every rank is on one host. Raises ``ValueError`` saying
    what to set otherwise."""
    for key in GLOO_ENV:
        if os.environ.get(key):
            return os.environ[key]
    tcp = os.environ.get("OMPI_MCA_btl_tcp_if_include", "")
    if tcp and "," not in tcp and "/" not in tcp:
        return tcp
    if len(set(hostnames)) == 1:
        return "lo"
    raise ValueError(f"controller='gloo' under mpirun: the job spans "
                     f"{len(set(hostnames))} hosts and no network interface is named; set "
                     "GLOO_SOCKET_IFNAME to the interface between the hosts (e.g. mpirun "
                     "-x GLOO_SOCKET_IFNAME=eth0)")


def start_gloo_controller(comm: Any = None) -> None:
    """Prepare this ``mpirun`` rank's environment so that ``hvd.init()`` starts Horovod's
    Gloo controller (module docstring). A collective over ``comm`` (default
    ``MPI.COMM_WORLD``): every rank calls it, before ``hvd.init()``."""
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("controller='gloo' under mpirun exchanges the ranks' host names "
                          "over MPI and needs mpi4py: pip install 'hvd-compress[mpi]'") from exc

    from hvd_compress.comm.gloo_torch import interface_address

    comm = comm if comm is not None else MPI.COMM_WORLD
    rank = comm.Get_rank()
    hostnames = comm.allgather(socket.gethostname())
    plan = slot_plan(hostnames)
    found: tuple[str, str, int] | str
    try:
        nic = interface(hostnames)
        found = ""
        if rank == 0:
            server = RendezvousHTTPServer(("0.0.0.0", 0), RendezvousHandler, False)
            server.init(plan)
            threading.Thread(target=server.serve_forever, name="hvdc-gloo-rendezvous",
                             daemon=True).start()
            found = (nic, interface_address(nic), server.server_address[1])
    except (OSError, ValueError) as exc:
        found = str(exc)
    found = comm.bcast(found, root=0)
    if isinstance(found, str):  # rank 0 could not serve: every rank says why
        raise ValueError(f"controller='gloo' under mpirun: rank 0 could not serve Horovod's "
                         f"Gloo rendezvous: {found}")
    _, address, port = found
    nic = interface(hostnames)
    env = {**create_run_env_vars(address, [nic], port), **create_slot_env_vars(plan[rank])}
    os.environ.update({key: str(value) for key, value in env.items()})
