"""``hierarchy="host"`` on 4 real Horovod ranks as 2 emulated hosts of 2 (one launch)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.servers import ServerProcess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

SPECS = ["none", "powersgd:rank=2,start_iter=1", "onebit:bucket_size=64", "topk:ratio=0.05",
         "dgc:ratio=0.05"]
HOST_ENV = {"HVD_COMPRESS_RANKS_PER_HOST": "2", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


def test_two_hosts_of_two_ranks_agree_resume_and_match_the_flat_route() -> None:
    """Top-k through a server of 2 workers (the hosts), DGC through ``allgather``."""
    server = ServerProcess(["--bind", "127.0.0.1:0", "--workers", "2", "--deadline", "60"])
    try:
        ranks = run_ranks("tests.workers.hierarchy:steps", np=4, launcher="gloo", timeout=500,
                          env=HOST_ENV, specs=SPECS, ps=f"grpc://{server.address}")
    finally:
        server.kill()
    for spec in SPECS:
        first = ranks[0][spec]
        for rank in ranks:
            for name, value in rank[spec]["two"].items():
                assert torch.equal(value, first["two"][name]), (spec, name)
                assert torch.equal(rank[spec]["resumed"][name], value), (spec, name)
                assert value.abs().sum() > 0, (spec, name)
        stats = first["stats"]
        assert [r[spec]["stats"]["layout"]["local_rank"] for r in ranks] == [0, 1, 0, 1]
        assert first["stats"]["layout"]["hosts"] == 2
        assert stats["collective_bytes"]["host"] > 0, spec
        assert stats["compressed_tensors"] > 0 or spec == "none", spec
    # The in-host stage over shared memory (the default here) gives the loopback route's
    # bits.
    for spec in ("none", "onebit:bucket_size=64", "topk:ratio=0.05"):
        assert ranks[0][spec]["stats"]["local"] == "ShmHostCommunicator", spec
        for rank in ranks:
            for name, value in rank[spec]["loopback"].items():
                assert torch.equal(rank[spec]["two"][name], value), (spec, name)
    none = ranks[0]["none"]
    for name, value in none["flat"].items():
        assert torch.equal(none["two"][name], value), name
    # PowerSGD's rounds are summed in two levels: flat PowerSGD, the factors summed in
    # another order (sums of integer gradients times the same Q: equal to rounding).
    powersgd = ranks[0]["powersgd:rank=2,start_iter=1"]
    assert powersgd["stats"]["layout"]["split"] == "rounds"
    assert powersgd["stats"]["cross"] == "HostTwoLevelCommunicator"
    for name, value in powersgd["flat"].items():
        torch.testing.assert_close(powersgd["two"][name], value, rtol=1e-4, atol=1e-4)
    # Top-k's pairs go to the server across hosts; DGC's through Horovod's all-gather.
    assert ranks[0]["topk:ratio=0.05"]["stats"]["cross"] == "ParameterServerCommunicator"
    assert ranks[0]["dgc:ratio=0.05"]["stats"]["cross"] == "HorovodTorchCommunicator"
    assert "sparse" in ranks[0]["topk:ratio=0.05"]["stats"]["collective_bytes"]
