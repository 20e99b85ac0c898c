"""What :mod:`hvd_compress.mpi_gloo` decides from what the ranks of an ``mpirun`` tell each
other: Horovod's hosts, and when Horovod's Gloo controller cannot start (no launch here;
tests/test_mpmd.py starts it under ``mpirun``)."""

from __future__ import annotations

import pytest

from hvd_compress.mpi_gloo import RankInfo, gloo_hosts, host_names, named_interface, slot_plan


def info(host: str, leader: int, refusal: str | None = None,
         interface: str | None = None) -> RankInfo:
    return RankInfo(host, leader, refusal, interface)


def test_one_host_needs_no_interface() -> None:
    hostnames, reason = gloo_hosts([info("a", 0), info("a", 0)])
    assert (hostnames, reason) == (["a", "a"], None)


def test_several_hosts_without_an_interface_say_what_to_set() -> None:
    _, reason = gloo_hosts([info("a", 0, interface="eth0"), info("b", 1)])
    assert reason is not None and reason.startswith("rank 1: the job spans 2 hosts")
    assert "GLOO_SOCKET_IFNAME" in reason
    assert gloo_hosts([info("a", 0, interface="eth0"), info("b", 1, interface="eth0")]) \
        == (["a", "b"], None)


def test_a_rank_that_needs_mpi_is_the_reason_every_rank_gets() -> None:
    _, reason = gloo_hosts([info("a", 0), info("a", 0, refusal="HOROVOD_CONTROLLER=mpi")])
    assert reason == "rank 1: HOROVOD_CONTROLLER=mpi"


def test_hosts_are_mpis_even_where_host_names_say_otherwise() -> None:
    """Two hosts with one host name (copied containers) stay two hosts; ranks of one host
    reporting names of their own (a UTS namespace each) stay one host."""
    assert host_names(["box", "box", "box", "box"], [0, 0, 2, 2]) \
        == ["box.0", "box.0", "box.2", "box.2"]
    assert host_names(["a", "b", "c"], [0, 0, 2]) == ["a", "a", "c"]
    slots = slot_plan(host_names(["box"] * 4, [0, 2, 0, 2]))  # mpirun placed round-robin
    assert [(s.local_rank, s.cross_rank, s.local_size) for s in slots] \
        == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]


@pytest.mark.parametrize(("setting", "expected"), [
    ({"GLOO_SOCKET_IFNAME": "eth7"}, "eth7"),
    ({"OMPI_MCA_btl_tcp_if_include": "lo"}, "lo"),
    ({"OMPI_MCA_btl_tcp_if_include": "127.0.0.0/8"}, "lo"),
    ({"OMPI_MCA_btl_tcp_if_include": "no-such-nic,lo"}, "lo"),
    ({"OMPI_MCA_btl_tcp_if_include": "0.0.0.1/32"}, None),  # no interface has it
    ({}, None),
])
def test_the_interface_a_rank_was_told(monkeypatch: pytest.MonkeyPatch,
                                       setting: dict[str, str], expected: str | None) -> None:
    for key in ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "OMPI_MCA_btl_tcp_if_include"):
        monkeypatch.delenv(key, raising=False)
    for key, value in setting.items():
        monkeypatch.setenv(key, value)
    assert named_interface() == expected
