"""``bench ps``: the modes side by side, the bytes each worker pulls against its push, the
memcpy beside the in-process round, and the no-work ceiling beside each gRPC row."""

from __future__ import annotations

import pytest

from hvd_compress.bench import ps
from hvd_compress.bench.report import format_table

NUMEL, DENSITY = 200_000, 0.01


@pytest.mark.parametrize("workers", [2, 4])
def test_in_process_rows_give_each_modes_traffic_and_the_memcpy_beside_it(workers):
    union = ps.measure_in_process(workers, NUMEL, DENSITY, 3, "union")
    topk = ps.measure_in_process(workers, NUMEL, DENSITY, 3, "topk")
    assert union["mode"] == "union" and topk["mode"] == "topk"
    # Random supports barely overlap: the union pulls about W pushes, top-k about one.
    assert union["pull_vs_push"] > 0.8 * workers
    assert 0.95 < topk["pull_vs_push"] < 1.05
    for row in (union, topk):
        assert row["server_ns_per_pair"] >= row["memcpy_ns_per_pair"] > 0
        assert row["vs_memcpy"] == pytest.approx(row["server_ns_per_pair"]
                                                 / row["memcpy_ns_per_pair"])
        assert row["median_ns_per_pair"] >= row["server_ns_per_pair"]
    # The table renders them, with "-" for what only a gRPC row measures (page faults).
    table = format_table([union, topk], ps.COLUMNS).splitlines()
    assert [c.header for c in ps.COLUMNS[-2:]] == ["server faults/round",
                                                   "server switches/round"]
    assert len(table) == 4 and all(line.split()[-2:] == ["-", "-"] for line in table[2:])


def test_rounds_shrink_above_eight_workers():
    assert [ps.rounds_for(w, 20) for w in (2, 8, 16, 32, 200)] == [20, 20, 10, 5, 2]


def test_unknown_modes_and_transports_are_refused():
    with pytest.raises(ValueError, match="modes must be among union, topk, gtopk, got sum"):
        ps.run([2], [1], NUMEL, DENSITY, 1, modes=["sum"], transports=["in-process"])
    with pytest.raises(ValueError, match="transports must be among"):
        ps.run([2], [1], NUMEL, DENSITY, 1, transports=["tcp"])


def test_the_null_servers_reply_is_the_size_of_the_modes_aggregate():
    pushes, _ = ps.make_frames(4, 1, NUMEL, DENSITY, 2)
    union, topk, gtopk = (ps.aggregate_nbytes(pushes, 1, 0, mode)
                          for mode in ("union", "topk", "gtopk"))
    push = len(pushes[0][1][0])
    assert union > 3.5 * push and 0.95 * push < topk < 1.05 * push
    assert 0.95 * push < gtopk < 1.05 * push


@pytest.mark.multiprocess
def test_grpc_rows_stand_beside_their_no_work_ceiling():
    rows = ps.run([2], [1], NUMEL, DENSITY, 3, modes=["union", "topk"], transports=["grpc"])
    assert [(r["transport"], r["mode"]) for r in rows] == [
        ("grpc", "union"), (ps.TRANSPORT_ONLY, "union"),
        ("grpc", "topk"), (ps.TRANSPORT_ONLY, "topk")]
    for real, ceiling in (rows[:2], rows[2:]):
        assert real["pull_bytes_per_worker"] == pytest.approx(ceiling["pull_bytes_per_worker"],
                                                              rel=0.05)
        assert real["server_ns_per_pair"] > 0 and ceiling["server_ns_per_pair"] > 0
        assert real["vs_no_work"] == pytest.approx(real["mpairs_per_server_cpu_s"]
                                                   / ceiling["mpairs_per_server_cpu_s"])
