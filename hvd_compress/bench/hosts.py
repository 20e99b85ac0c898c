"""An emulated cluster on one machine: hosts in network namespaces behind throttled links.

Each host is a network namespace with one interface, ``eth0``, joined to the others by a
veth pair on a bridge; several ranks may share a host (its namespace), and their traffic
to each other goes over the namespace's loopback, unthrottled, as inside a real host. A
token-bucket filter (``tc ... tbf rate RATE``) sits on both ends of every link, so each
host sends and receives at most ``RATE``; an optional ``netem`` delay is added to each
host's outgoing traffic. Processes are started inside a host with ``ip netns exec``
(:func:`host_command`), or by ``mpirun`` through an agent script that maps a host address
to its namespace (:func:`mpirun_host_args`). Every namespace, link and process made here is
removed when :func:`emulated_hosts` exits, even on an error, Ctrl-C, ``SIGTERM`` or
``SIGHUP``, and traffic stays between the namespaces.

Needs root, ``ip`` and ``tc`` (Debian's ``iproute2``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

INTERFACE = "eth0"
"""Every emulated host's one network interface."""

NO_TOPOLOGY_SHMEM = ("--mca", "rtc_hwloc_vmhole", "none")
"""Daemons do not publish their hwloc topology in shared memory: two of them doing so on
one machine crashed one now and then (a segfault in ``hwloc_shmem_topology_write``), and a
daemon that dies before it reports leaves ``mpirun`` waiting for ever."""


def require_root(what: str) -> None:
    """Exit with a message unless this process can make namespaces and ``tc`` rules."""
    if os.geteuid() != 0:
        raise SystemExit(f"the {what} benchmark needs root (network namespaces and tc); "
                         "run it as root, e.g. with sudo")


def rate_bits(rate: str) -> float:
    """``100mbit``, ``1gbit``, ``10gbit`` -> bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for suffix, scale in units.items():
        if rate.endswith(suffix) and rate[:-len(suffix)].replace(".", "", 1).isdigit():
            return float(rate[:-len(suffix)]) * scale
    raise ValueError(f"link rate must look like 100mbit or 1gbit, got {rate!r}")


def network_name_prefixes() -> tuple[str, str]:
    """The prefixes of the names of every namespace (``hvdc-<pid>-``) and root-namespace
    link (``hv<pid>``) that :func:`emulated_hosts` creates in this process."""
    tag = f"{os.getpid() % 100000}"
    return f"hvdc-{tag}-", f"hv{tag}"


def host_namespace(i: int) -> str:
    """The namespace of emulated host ``i``."""
    return f"{network_name_prefixes()[0]}{i}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


def kill_processes_in(namespace: str) -> None:
    """SIGKILL whatever still runs in ``namespace``; deleting a namespace does not end its
    processes."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout.split()
    for pid in map(int, pids):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextmanager
def _exit_on_termination() -> Iterator[None]:
    """``SIGTERM`` and ``SIGHUP`` raise ``SystemExit`` inside the block, so the ``finally``
    clauses that remove namespaces run when a job scheduler or ``timeout`` ends the
    benchmark (their default action ends the process at once). Handlers a program set
    itself, and signals outside the main thread, are left alone."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    replaced = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            replaced[signum] = signal.signal(signum, leave)
    try:
        yield
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


@contextmanager
def emulated_hosts(count: int, rate: str, latency_ms: float = 0.0) -> Iterator[list[str]]:
    """``count`` namespaces joined by a bridge, each link throttled to ``rate``; yields
    their addresses (host ``i`` lives in namespace :func:`host_namespace` ``(i)``).

    ``latency_ms`` adds that one-way delay (``netem``) to every host's outgoing packets,
    under the rate limit, so a round trip between two hosts takes twice as long.

    The bridge lives in a namespace of its own (``hvdc-<pid>-sw``), so the hosts' traffic
    never passes the machine's own firewall: with ``br_netfilter`` loaded and a
    ``FORWARD`` policy of ``DROP`` (as Docker sets), a bridge in the root namespace would
    silently drop it. The root namespace (where ``mpirun`` and the benchmark's driver run)
    joins the bridge at ``<subnet>.254`` through an unthrottled link that carries only the
    launchers' control traffic.
    """
    if latency_ms < 0:
        raise ValueError(f"latency must be >= 0 ms, got {latency_ms}")
    namespace_prefix, link_prefix = network_name_prefixes()
    subnet = f"10.213.{os.getpid() % 200 + 20}"
    switch, bridge, uplink = f"{namespace_prefix}sw", "br0", f"{link_prefix}up"
    burst = max(int(rate_bits(rate) / 8 / 250), 16 << 10)  # one 4 ms tick, at least 16 KiB
    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
    with _exit_on_termination():
        namespaces = [switch]
        try:
            _ip("netns", "add", switch)
            _ip("-n", switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", switch, "link", "set", bridge, "up")
            _ip("link", "add", uplink, "type", "veth", "peer", "name", "root", "netns", switch)
            _ip("-n", switch, "link", "set", "root", "master", bridge, "up")
            _ip("addr", "add", f"{subnet}.254/24", "dev", uplink)
            _ip("link", "set", uplink, "up")
            addresses = []
            for i in range(count):
                ns, port = host_namespace(i), f"host{i}"
                _ip("netns", "add", ns)
                namespaces.append(ns)
                _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", INTERFACE,
                    "netns", ns)
                _ip("-n", switch, "link", "set", port, "master", bridge, "up")
                _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", INTERFACE)
                _ip("-n", ns, "link", "set", INTERFACE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _tc("-n", switch, "qdisc", "add", "dev", port, "root", *tbf)
                if latency_ms:
                    _tc("-n", ns, "qdisc", "add", "dev", INTERFACE, "root", "handle", "1:", *tbf)
                    _tc("-n", ns, "qdisc", "add", "dev", INTERFACE, "parent", "1:1", "handle",
                        "10:", "netem", "delay", f"{latency_ms}ms", "limit", "100000")
                else:
                    _tc("-n", ns, "qdisc", "add", "dev", INTERFACE, "root", *tbf)
                addresses.append(f"{subnet}.{i + 1}")
            yield addresses
        finally:
            for ns in namespaces:
                kill_processes_in(ns)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", uplink], capture_output=True)


def launcher_address(addresses: Sequence[str]) -> str:
    """The root namespace's address on the hosts' subnet (rendezvous servers bind here)."""
    return addresses[0].rsplit(".", 1)[0] + ".254"


def host_tmpdir(directory: Path, i: int) -> Path:
    """Host ``i``'s own ``TMPDIR`` under ``directory``, as a real host has its own ``/tmp``:
    OpenMPI's daemons keep their session directories there, named after the host name,
    which all namespaces share."""
    path = directory / f"host{i}"
    path.mkdir(exist_ok=True)
    return path


def host_command(i: int, argv: Sequence[str], directory: Path, hostname: str,
                 env: dict[str, str] | None = None) -> list[str]:
    """``argv`` run inside host ``i``, with that host's ``TMPDIR`` and ``env`` added, and a
    host name of its own (``hostname``, in a UTS namespace), as a real host has: libraries
    that find their own address from the host name (Gloo, for Horovod's process sets) must
    not all resolve the machine's one name to loopback."""
    assignments = [f"{key}={value}" for key, value in (env or {}).items()]
    return ["ip", "netns", "exec", host_namespace(i), "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', hostname, "env",
            f"TMPDIR={host_tmpdir(directory, i)}", *assignments, *argv]


def _agent_script(directory: Path, addresses: Sequence[str]) -> Path:
    """The ``plm_rsh_agent`` mpirun calls as ``agent HOST COMMAND...``: the command runs in
    the host's namespace with the host's ``TMPDIR`` and, as on a real host, a host name of
    its own (its address, in a UTS namespace), which Horovod's Gloo controller groups ranks
    by."""
    cases = [f'    {address}) ns={host_namespace(i)}; tmp={host_tmpdir(directory, i)} ;;'
             for i, address in enumerate(addresses)]
    script = directory / "netns-agent.sh"
    script.write_text(f"""#!/bin/sh
host="$1"; shift
case "$host" in
{chr(10).join(cases)}
    *) echo "unknown emulated host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c \
    'hostname "$1" && export TMPDIR="$2" && shift 2 && exec sh -c "$*"' agent "$host" "$tmp" "$@"
""")
    script.chmod(0o755)
    return script


def mpirun_host_args(addresses: Sequence[str], directory: Path,
                     ranks_per_host: int = 1) -> list[str]:
    """``mpirun`` options that start ``ranks_per_host`` ranks on each of ``addresses``
    (emulated hosts; ranks ``h L`` to ``h L + L - 1`` on host ``h``, as OpenMPI maps by
    slot), with OpenMPI's out-of-band and TCP traffic on the hosts' subnet. The ranks of
    one host share its namespace: OpenMPI (and Horovod's local ranks) see them as one node,
    and their TCP traffic to each other goes over the namespace's loopback, unthrottled."""
    subnet = addresses[0].rsplit(".", 1)[0] + ".0/24"
    return ["-np", str(len(addresses) * ranks_per_host),
            "--host", ",".join(f"{a}:{ranks_per_host}" for a in addresses),
            "--mca", "plm_rsh_agent", str(_agent_script(directory, addresses)),
            "--mca", "plm_rsh_no_tree_spawn", "1", "--mca", "routed", "direct",
            *NO_TOPOLOGY_SHMEM,
            "--mca", "oob_tcp_if_include", subnet, "--mca", "btl", "self,tcp",
            "--mca", "btl_tcp_if_include", subnet]


HEADER_BYTES = 66
"""Bytes of headers each packet counted by an emulated host's interface carries: Ethernet
14, IPv4 20, TCP 20 and its timestamp option 12. Sending 10 MB over TCP between two of
these namespaces counted 66.07 bytes per packet beyond the payload (the veth counts
segmentation-offload packets of up to 64 KB as one packet, each with one set of headers)."""


@dataclass(frozen=True)
class Counters:
    """The kernel's counters of one interface: bytes (headers included) and packets."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                        self.tx_packets - other.tx_packets, self.rx_packets - other.rx_packets)

    @property
    def tx_payload_bytes(self) -> int:
        """Bytes sent less :data:`HEADER_BYTES` per packet: what TCP carried for the
        processes (pure acknowledgements count as headers only)."""
        return self.tx_bytes - HEADER_BYTES * self.tx_packets


LOOPBACK = "lo"
"""The loopback interface of a host's namespace: what its ranks send each other (to the
host's own address too: the kernel routes a namespace's own addresses over ``lo``), never
throttled and never on the host's link."""


def interface_counters(interface: str = INTERFACE) -> Counters:
    """The counters of ``interface`` of the namespace this process runs in (``ip netns
    exec`` mounts that namespace's ``/sys``)."""
    stats = Path("/sys/class/net") / interface / "statistics"
    return Counters(*(int((stats / name).read_text())
                      for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")))
