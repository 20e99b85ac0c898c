"""The parameter-server transport registry: a ``ps=`` spec's scheme chooses the transport,
an unknown scheme is refused naming every accepted form, and a transport registered from
outside the package (an in-process one defined here) is chosen by its scheme and carries a
communicator's sparse sums. One process, no server."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hvd_compress import mpmd, ps_protocol
from hvd_compress.binding import resolve_ps
from hvd_compress.comm import ps_client, ps_transport
from hvd_compress.comm.ops import SparseSum
from hvd_compress.comm.parameter_server import ParameterServerCommunicator
from hvd_compress.comm.ps_transport.base import (
    PendingRound,
    PSError,
    ShardedClient,
    SpecError,
    Transport,
)
from hvd_compress.comm.ps_transport.grpc import GrpcTransport, PSClient
from hvd_compress.comm.ps_transport.mpi import MPITransport
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame


@pytest.mark.parametrize(("spec", "kind"), [
    ("grpc://a:1,b:2", GrpcTransport),
    ("GRPCS://a:1", GrpcTransport),
    ("a:1", GrpcTransport),            # a bare host:port is grpc://
    ("a:1,grpcs://b:2", GrpcTransport),
    (" MPI ", MPITransport),
])
def test_the_scheme_chooses_the_transport(spec: str, kind: type[Transport]) -> None:
    assert isinstance(ps_transport.transport_for(spec), kind)


def test_the_built_in_specs_are_checked_by_their_transport() -> None:
    assert ps_transport.check_spec(" MPI ") == "mpi"
    assert ps_transport.check_spec("grpcs://a:1,b:2 ") == "grpcs://a:1,b:2"
    with pytest.raises(SpecError, match="the MPI transport takes no address"):
        ps_transport.check_spec("mpi://host:1")
    with pytest.raises(SpecError, match="the port 'x' is not a number"):
        ps_transport.check_spec("grpc://a:x")


def test_an_unknown_scheme_names_every_accepted_form() -> None:
    with pytest.raises(SpecError) as err:
        ps_transport.check_spec("nccl://h:1,h:2", "$HVD_COMPRESS_PS")
    message = str(err.value)
    assert message.startswith("invalid parameter server address 'nccl://h:1' in "
                              "$HVD_COMPRESS_PS='nccl://h:1,h:2': 'nccl://' is not supported;")
    for transport in ps_transport.transports():
        for form in transport.forms:
            assert form in message
    assert "'grpc://host:port" in message and "'grpcs://host:port" in message
    assert message.endswith(" or 'mpi'")
    assert ps_transport.find("nccl://h:1") is None and ps_transport.find(None) is None


def test_the_environment_names_have_one_home() -> None:
    """The old places re-export ps_protocol's names (the same objects, not copies)."""
    from hvd_compress import binding
    from hvd_compress.comm import parameter_server

    assert binding.PS_ENV is parameter_server.PS_ENV is ps_protocol.PS_ENV
    assert parameter_server.CA_ENV is ps_protocol.CA_ENV
    assert ps_client.CONNECT_TIMEOUT_ENV is ps_protocol.CONNECT_TIMEOUT_ENV
    assert ps_client.RETRY_TIMEOUT_ENV is ps_protocol.RETRY_TIMEOUT_ENV
    names = [value for key, value in vars(ps_protocol).items() if key.endswith("_ENV")]
    assert parameter_server.PARTIAL_ENV is ps_protocol.PARTIAL_ENV
    assert len(names) == len(set(names)) == 6
    assert all(name.startswith("HVD_COMPRESS_PS") for name in names)


def test_the_client_module_keeps_its_names() -> None:
    assert ps_client.PSClient is PSClient and ps_client.PSError is PSError
    assert issubclass(ps_client.MPIPSClient, ShardedClient)
    assert ps_client.ACCEPTED_FORMS == ps_transport.accepted_forms()


@pytest.mark.multiprocess
def test_importing_the_transports_imports_no_grpc_or_mpi() -> None:
    """grpcio and mpi4py load when a client is made, not when a spec is checked."""
    import subprocess

    code = ("import sys; from hvd_compress.comm.parameter_server import check_spec; "
            "check_spec('grpc://a:1'); check_spec('mpi'); "
            "print(sorted(m for m in ('grpc', 'mpi4py') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class LoopServers:
    """In-process servers for :class:`LoopTransport`: per (tensor, round, shard), the
    pushes by worker; a pull answers the sum once ``workers`` workers have pushed."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.pushes: dict[tuple[str, int, int], dict[int, tuple[np.ndarray, np.ndarray]]] = \
            defaultdict(dict)

    def push(self, data: bytes) -> None:
        frame = decode_frame(data)
        key = (frame.tensor, frame.round, frame.shard)
        self.pushes[key][frame.worker] = (frame.indices, frame.values.astype(np.float32))

    def pull(self, data: bytes) -> bytes:
        frame = decode_frame(data)
        pushed = self.pushes[(frame.tensor, frame.round, frame.shard)]
        if len(pushed) < self.workers:
            raise LookupError(f"{len(pushed)} of {self.workers} workers pushed")
        dense = np.zeros(frame.numel, np.float32)
        for worker in sorted(pushed):
            indices, values = pushed[worker]
            dense[indices] += values
        indices = np.flatnonzero(dense)
        return encode_frame(Kind.AGGREGATE, frame.tensor, frame.shard, frame.shards,
                            frame.round, frame.worker, frame.numel, indices, dense[indices])


class LoopClient(ShardedClient):
    def __init__(self, servers: LoopServers, shards: int, worker: int) -> None:
        super().__init__(worker, None)
        self.servers = servers
        self.told: list[int] = []
        self.addresses = [f"loop shard {s}" for s in range(shards)]

    def expect_workers(self, workers: int) -> None:
        self.told.append(workers)

    def _send_pushes(self, pending: PendingRound) -> None:
        for frame in pending.pushes:
            self.servers.push(frame)

    def _pull(self, pending: PendingRound) -> list[bytes]:
        try:
            return [self.servers.pull(frame) for frame in pending.pulls]
        except LookupError as err:
            raise self._error(pending.tensor, pending.round, 0, "DEADLINE_EXCEEDED",
                              str(err)) from None

    def close(self) -> None:
        self.addresses = []


class LoopTransport(Transport):
    """``loop://<shards>``: servers in this process."""

    schemes = ("loop",)
    forms = ("'loop://<shards>' (in-process, for tests)",)

    def __init__(self, workers: int) -> None:
        self.servers = LoopServers(workers)

    def check(self, spec: str, origin: str) -> str:
        shards = spec.partition("://")[2]
        if not shards.isdigit() or int(shards) < 1:
            raise SpecError(f"{origin}={spec!r}: the shard count {shards!r} is not a positive "
                            "number", self.forms[0])
        return spec

    def connect(self, spec: str, worker: int, *, workers: int | None = None,
                connect_timeout: float | None = None, retry_timeout: float | None = None
                ) -> LoopClient:
        return LoopClient(self.servers, int(spec.partition("://")[2]), worker)


@pytest.fixture
def loop() -> Iterator[LoopTransport]:
    transport = LoopTransport(workers=2)
    ps_transport.register(transport)
    try:
        yield transport
    finally:
        ps_transport.unregister(transport)
    assert ps_transport.find("loop://2") is None


def test_a_registered_transport_is_chosen_by_its_scheme(loop: LoopTransport) -> None:
    assert ps_transport.transport_for("LOOP://3") is loop
    assert resolve_ps("loop://3") == "loop://3"  # what the optimizers check at construction
    assert "'loop://<shards>' (in-process, for tests)" in ps_transport.accepted_forms()
    with pytest.raises(SpecError) as err:
        resolve_ps("loop://none")
    # the transport's own problem, with every registered transport's forms
    assert "the shard count 'none' is not a positive number" in str(err.value)
    assert "'mpi'" in str(err.value) and "'loop://<shards>'" in str(err.value)
    assert not mpmd.wants_servers("loop://3")  # its servers are not ranks of the launch


def test_a_scheme_is_served_by_one_transport(loop: LoopTransport) -> None:
    class Other(LoopTransport):
        schemes = ("loop", "other")

    with pytest.raises(ValueError, match="'loop' is served by LoopTransport already"):
        ps_transport.register(Other(workers=1))
    assert ps_transport.find("other://1") is None  # nothing of the refused one was kept


def test_a_registered_transport_carries_a_communicators_sparse_sums(
        loop: LoopTransport) -> None:
    """Two workers in one process, three shards: each gets the sum of both workers' pairs,
    and the communicator told the client the job's size."""
    numel = 10
    pairs = [(torch.tensor([0, 4, 9]), torch.tensor([1.0, 2.0, 3.0])),
             (torch.tensor([4, 5]), torch.tensor([10.0, 20.0]))]
    comms = []
    for rank in range(2):
        client = ps_transport.connect("loop://3", rank, workers=2)
        assert isinstance(client, LoopClient)
        dense = SimpleNamespace(rank=rank, size=2)
        comms.append(ParameterServerCommunicator(dense, client, "s"))  # type: ignore[arg-type]
        assert client.told == [2]
    handles = [comm.start("grad", SparseSum("grad", numel, *pairs[rank]))
               for rank, comm in enumerate(comms)]
    want = torch.zeros(numel)
    for indices, values in pairs:
        want[indices] += values
    for comm, handle in zip(comms, handles, strict=True):
        assert torch.equal(comm.wait(handle), want)


def test_a_pull_before_every_worker_pushed_raises_the_transports_error(
        loop: LoopTransport) -> None:
    client = ps_transport.connect("loop://2", 0)
    pending = client.start("s/t", 0, 4, np.array([1]), np.array([1.0], np.float32))
    with pytest.raises(PSError, match=r"shard 0 \(loop shard 0\) failed tensor 's/t' round 0: "
                                      "DEADLINE_EXCEEDED: 1 of 2 workers pushed"):
        client.finish(pending)
