"""Horovod's Gloo controller in ranks that ``mpirun`` started.

Under ``mpirun`` Horovod takes its MPI controller, and then waits inside MPI in every
negotiation cycle and every collective, where Open MPI polls for progress on the CPU the
ranks train on (``mpi_yield_when_idle`` softens that; docs/benchmarks.md compares the
launchers). ``horovodrun --gloo`` gives Horovod a Gloo controller instead, whose waits block
in the kernel. :func:`start_gloo_controller` gives ranks that ``mpirun`` started the same:
MPI carries every rank's host and rank 0's address once, rank 0 serves Horovod's Gloo
rendezvous in a thread of its own process (as ``horovodrun`` serves it), and each rank gets
the environment ``horovodrun --gloo`` gives its ranks, with Horovod's rank equal to the MPI
rank. MPI is then idle for the rest of the job.

What it needs, and what happens without it:

- **Hosts** are MPI's own (the ranks that share memory, ``MPI_COMM_TYPE_SHARED``), named
  after the host name of their first rank; two hosts with one host name (containers with a
  copied name) get the name suffixed with that rank, so Horovod's local and cross ranks
  follow the hosts ``mpirun`` placed the ranks on.
- **An interface** (:func:`interface`) when the ranks span several hosts: Gloo connects
  every pair of ranks over it. Without one named, nothing is started (``fallback``) or
  ``ValueError`` says what to set.
- **Ports**: the rendezvous listens on a port the kernel picks (port 0) and Gloo's own
  connections too, so two jobs on one host do not clash; rank 0's port must be reachable
  from every host (a firewall that only lets ``mpirun``'s ports through stops it).

Called by ``hvd_compress.torch.init`` (and the TensorFlow binding's, through
:func:`hvd_compress.mpmd.init`) before ``hvd.init()``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from typing import Any, NamedTuple

GLOO_ENV = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")
"""Where the interface for Gloo's connections is read from, in this order."""

NO_INTERFACE = ("the job spans {hosts} hosts and no network interface is named; set "
                "GLOO_SOCKET_IFNAME to the interface between the hosts (e.g. mpirun "
                "-x GLOO_SOCKET_IFNAME=eth0)")


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


def host_names(names: list[str], leaders: list[int]) -> list[str]:
    """Every rank's host name for Horovod, rank ``r`` on the host whose first rank is
    ``leaders[r]`` (MPI's grouping) and reporting host name ``names[r]``: a host is named
    after its first rank's host name, suffixed ``.<that rank>`` where two hosts share it."""
    firsts = list(dict.fromkeys(leaders))
    taken = [names[first] for first in firsts]
    unique = {first: names[first] if taken.count(names[first]) == 1
              else f"{names[first]}.{first}" for first in firsts}
    return [unique[leader] for leader in leaders]


def _in_subnet(subnet: str) -> str | None:
    """The local interface with an IPv4 address in ``subnet`` (``10.0.0.0/24``), if any."""
    from hvd_compress.comm.torch_dist import interface_address

    network = ipaddress.ip_network(subnet, strict=False)
    for _, name in socket.if_nameindex():
        try:
            if ipaddress.ip_address(interface_address(name)) in network:
                return name
        except ValueError:  # no IPv4 address
            continue
    return None


def named_interface() -> str | None:
    """The interface this rank was told to use: ``$GLOO_SOCKET_IFNAME``, else
    ``$HOROVOD_GLOO_IFACE``, else Open MPI's ``btl_tcp_if_include`` (the first interface
    of its list that this host has, or the one holding an address in a subnet it names);
    ``None`` when none is named."""
    for key in GLOO_ENV:
        if os.environ.get(key):
            return os.environ[key]
    for entry in filter(None, os.environ.get("OMPI_MCA_btl_tcp_if_include", "").split(",")):
        entry = entry.strip()
        try:
            found = _in_subnet(entry) if "/" in entry else (
                entry if socket.if_nametoindex(entry) else None)
        except (OSError, ValueError):
            found = None
        if found:
            return found
    return None


def interface(hostnames: list[str]) -> str:
    """The network interface Horovod's Gloo connects over: :func:`named_interface`, else
    loopback when every rank is on one host. Raises ``ValueError`` saying what to set
    otherwise."""
    named = named_interface()
    if named:
        return named
    if len(set(hostnames)) == 1:
        return "lo"
    raise ValueError("controller='gloo' under mpirun: "
                     + NO_INTERFACE.format(hosts=len(set(hostnames))))


class RankInfo(NamedTuple):
    """What one rank tells the others before the Gloo controller starts."""

    hostname: str
    leader: int
    """The first rank of the ranks that share this rank's memory (MPI's host)."""
    refusal: str | None
    """Why this rank cannot run the Gloo controller; ``None``: it can."""
    interface: str | None
    """:func:`named_interface` on this rank."""


def gloo_hosts(ranks: list[RankInfo]) -> tuple[list[str], str | None]:
    """Every rank's host name for Horovod (:func:`host_names`) and why the Gloo controller
    cannot start (``"rank R: ..."``, the first refusal, else the first rank that names no
    interface when the ranks span several hosts), ``None`` when it can."""
    hostnames = host_names([r.hostname for r in ranks], [r.leader for r in ranks])
    hosts = len(set(hostnames))
    reasons = [f"rank {i}: {r.refusal}" for i, r in enumerate(ranks) if r.refusal]
    if hosts > 1:
        reasons += [f"rank {i}: " + NO_INTERFACE.format(hosts=hosts)
                    for i, r in enumerate(ranks) if not r.interface]
    return hostnames, (reasons[0] if reasons else None)


def start_gloo_controller(comm: Any = None, refusal: str | None = None,
                          fallback: bool = False) -> str | None:
    """Prepare this ``mpirun`` rank's environment so that ``hvd.init()`` starts Horovod's
    Gloo controller (module docstring); return ``None`` once it is prepared.

    A collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank calls it, before
    ``hvd.init()``, and every rank reaches the same outcome. ``refusal``: why this rank
    cannot run the Gloo controller (``None``: it can). When a rank refused, the ranks span
    several hosts with no interface named, or rank 0 cannot serve the rendezvous, nothing
    is changed and the reason (``"rank R: ..."``, the same on every rank) is returned with
    ``fallback``, raised as ``ValueError`` without."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        if fallback:
            return "mpi4py is not installed (pip install 'hvd-compress[mpi]')"
        raise ImportError("controller='gloo' under mpirun exchanges the ranks' host names "
                          "over MPI and needs mpi4py: pip install 'hvd-compress[mpi]'") from exc

    comm = comm if comm is not None else MPI.COMM_WORLD
    rank = comm.Get_rank()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    leader = local.bcast(rank, root=0)
    local.Free()
    named = named_interface()
    hostnames, reason = gloo_hosts(comm.allgather(
        RankInfo(socket.gethostname(), leader, refusal, named)))
    plan = slot_plan(hostnames)
    nic = named or "lo"
    found: tuple[str, int] | str = reason or ""
    if rank == 0 and not reason:
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        from hvd_compress.comm.torch_dist import interface_address

        try:
            address = interface_address(nic)
            server = RendezvousHTTPServer(("0.0.0.0", 0), RendezvousHandler, False)
            server.init(plan)
            threading.Thread(target=server.serve_forever, name="hvdc-gloo-rendezvous",
                             daemon=True).start()
            found = (address, server.server_address[1])
        except (OSError, ValueError) as exc:
            found = f"rank 0 could not serve Horovod's Gloo rendezvous: {exc}"
    found = comm.bcast(found, root=0)
    if isinstance(found, str):
        if fallback:
            return found
        raise ValueError(f"controller='gloo' under mpirun: {found}")
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

    address, port = found
    env = {**create_run_env_vars(address, [nic], port), **create_slot_env_vars(plan[rank])}
    os.environ.update({key: str(value) for key, value in env.items()})
    return None
