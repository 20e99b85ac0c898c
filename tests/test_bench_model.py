"""The scale model (``python -m hvd_compress.bench model``, docs/scale-model.md): its byte
counts against a real exchange on in-process ranks, its monotonicity, the two-level and
server routes, Auto's choice, the fit against a cluster run, and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from hvd_compress import Compression, Policy, cost_model
from hvd_compress.bench import model
from hvd_compress.bench.cli import main
from hvd_compress.bench.wire_bytes import measure_step

SHAPES = {"w": (64, 256), "v": (128, 128), "b": (64,)}


def flat(hosts: int = 4, **options: object) -> model.Cluster:
    return model.Cluster(hosts=hosts, per_host=1, copy_bytes_per_s=1e10, **options)


@pytest.mark.parametrize("spec", ["none", "onebit", "qsgd:bits=4", "topk:ratio=0.01"])
def test_host_bytes_equal_the_collectives_of_a_real_exchange(spec: str) -> None:
    """Four in-process ranks run the pipeline; the bytes of each round's requests, put
    through the textbook per-rank counts (ring all-reduce 2 (p - 1) / p, all-to-all
    (p - 1) / p, all-gather p - 1), equal what the model says a host sends."""
    ranks = 4
    stats = measure_step(Compression.parse(spec), Policy(min_numel=1024), SHAPES, ranks)
    factor = {"dense": 2 * (ranks - 1) / ranks, "scatter": (ranks - 1) / ranks,
              "gather": ranks - 1, "sparse": ranks - 1}
    by_hand = sum(factor[name] * sent for name, sent in stats.collective_bytes.items())
    predicted = model.predict_job(model.Job(SHAPES, spec), flat(ranks)).host_bytes
    # top-k's index coding depends on which indices were chosen: the random data differ
    assert predicted == pytest.approx(by_hand, rel=0.1 if "topk" in spec else 1e-9)


def test_dense_bytes_and_transfer_follow_the_ring_formula() -> None:
    pred = model.predict_job(model.Job({"w": (1000, 1000)}), flat(8, rate_bits=1e9))
    assert pred.host_bytes == pytest.approx(2 * 7 / 8 * 4e6)
    assert pred.terms["transfer"] == pytest.approx(2 * 7 / 8 * 4e6 * 8 / 1e9)


def test_step_time_falls_as_the_link_gets_faster() -> None:
    for spec in ("none", "onebit", "powersgd:rank=4"):
        steps = [model.predict_job(model.Job(SHAPES, spec), flat(rate_bits=r)).step_s
                 for r in (1e8, 1e9, 1e10, 1e11)]
        assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]


def test_latency_adds_once_per_hop_of_each_collective() -> None:
    job = model.Job({"w": (256, 256)})
    slow = model.predict_job(job, flat(8, latency_s=1e-3)).step_s
    fast = model.predict_job(job, flat(8)).step_s
    assert slow - fast == pytest.approx(2 * 7 * 1e-3)  # one ring all-reduce: 2 (p - 1) hops


def test_two_level_carries_one_gather_per_host_instead_of_one_per_rank() -> None:
    """All-gathered payloads (1-bit's gather, top-k's pairs) cross a host link once per
    host in two-level, once per rank when flat: about L times fewer bytes."""
    cluster = model.Cluster(hosts=4, per_host=4, copy_bytes_per_s=1e10)
    shapes = {"w": (1024, 1024)}
    for spec in ("topk:ratio=0.01",):
        flat_bytes = model.predict_job(model.Job(shapes, spec), cluster).host_bytes
        two = model.predict_job(model.Job(shapes, spec, two_level=True), cluster).host_bytes
        assert flat_bytes / two == pytest.approx(15 / 3, rel=0.15)  # (p - 1) / (W - 1)


def test_server_traffic_per_worker_does_not_grow_with_workers_in_topk_mode() -> None:
    shapes = {"w": (1024, 1024)}
    job = model.Job(shapes, "topk:ratio=0.01", route="ps", server_mode="topk")
    union = dataclasses.replace(job, server_mode="union")
    small, large = (model.predict_job(job, flat(w)).terms["transfer"] for w in (2, 16))
    grows = model.predict_job(union, flat(16)).terms["transfer"]
    assert grows > large
    # the shard's link carries every worker's push and pull: w / shards of them
    sharded = dataclasses.replace(job, shards=16)
    assert model.predict_job(sharded, flat(16)).terms["transfer"] < large
    assert small < large


def test_auto_sends_dense_on_a_fast_link_and_compresses_on_a_slow_one() -> None:
    shapes = {"w": (2048, 2048), "b": (2048,)}
    slow = model.predict_job(model.Job(shapes, "auto:powersgd:rank=4"), flat(rate_bits=1e8))
    fast = model.predict_job(model.Job(shapes, "auto:powersgd:rank=4"),
                             flat(rate_bits=1e13, codec_scale=100.0))
    assert slow.routes["w"] == "scheme"
    assert fast.routes["w"] != "scheme"
    assert slow.routes["b"] != "scheme"  # the policy keeps a bias off the scheme


def test_fit_recovers_the_parameters_that_made_the_rows() -> None:
    """Rows made by the model with known terms: fitting them gives the terms back, and
    every row is then predicted exactly."""
    tensors = model.model_tensors("tiny")
    truth = model.Cluster(hosts=4, copy_bytes_per_s=1e10, compute_s=0.01,
                          codec_scale=3.0, cpu_s_per_byte=2e-9, gather_factor=1.4,
                          stock_s_per_byte=3e-9, reduce_s_per_byte=1e-8)
    rows = []
    for system, scheme in [("hvd-compress", "none"), ("hvd-compress", "fp16"),
                           ("hvd-compress", "powersgd:rank=4,start_iter=2"),
                           ("hvd-compress", "onebit"), ("horovod", "fp16"),
                           ("horovod-mpi", "none"), ("ddp", "none")]:
        for link, bits in (("100mbit", 1e8), ("1gbit", 1e9), ("10gbit", 1e10)):
            row = {"system": system, "scheme": scheme, "link": link, "link_bits": bits,
                   "ranks": 4, "model": "tiny", "settings": {"HOROVOD_CYCLE_TIME": "10"}}
            job, cluster = model.row_case(row, tensors, truth, 0.1)
            rows.append({**row, "step_s": model.predict_job(job, cluster).step_s})
    start = dataclasses.replace(truth, codec_scale=1.0, cpu_s_per_byte=0.0,
                                gather_factor=1.0, stock_s_per_byte=0.0,
                                reduce_s_per_byte=0.0)
    checked, fitted = model.check(rows, start)
    assert fitted.cpu_s_per_byte == pytest.approx(2e-9, rel=0.05)
    assert fitted.gather_factor == pytest.approx(1.4, rel=0.05)
    assert fitted.stock_s_per_byte == pytest.approx(3e-9, rel=0.05)
    assert max(abs(r["error"]) for r in checked) < 0.02
    assert fitted.server_round_s == 0  # the run has no server row: left as given

    # a server row: its round's fixed cost is fitted on it with the other terms given
    served = dataclasses.replace(truth, server_round_s=4e-3)
    ps_rows = []
    for link, bits in (("100mbit", 1e8), ("10gbit", 1e10)):
        row = {"system": "hvd-compress", "scheme": "topk:ratio=0.001@gloo@ps", "link": link,
               "link_bits": bits, "ranks": 4, "model": "tiny",
               "settings": {"HOROVOD_CYCLE_TIME": "100"}}
        job, cluster = model.row_case(row, tensors, served, 0.1)
        ps_rows.append({**row, "step_s": model.predict_job(job, cluster).step_s})
    checked, fitted = model.check(ps_rows, truth, fitted=False, refit=("server_round_s",))
    assert fitted.server_round_s == pytest.approx(4e-3, rel=0.01)
    assert [r["fitted_here"] for r in checked] == [False, True]
    assert max(abs(r["error"]) for r in checked) < 1e-6


def test_gpt_tensors_have_about_the_parameters_asked() -> None:
    tensors = model.gpt_tensors(1.3e9)
    total = sum(math.prod(s) for s in tensors.values())
    assert abs(total - 1.3e9) / 1.3e9 < 0.05


def test_command_line_predicts_a_job_and_refuses_a_bad_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"a": [256, 512], "a_bias": [256]}))
    out = tmp_path / "pred.json"
    assert main(["model", "--plan", str(plan), "--hosts", "2", "--per-host", "2",
                 "--scheme", "onebit", "--two-level", "--copy-gbps", "5",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["step_s"] > 0 and row["routes"] == {"a": "scheme", "a_bias": "dense"}
    with pytest.raises(SystemExit):
        main(["model", "--plan", str(plan), "--route", "nowhere"])
    assert "--route" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="hosts"):
        main(["model", "--plan", str(plan), "--hosts", "0", "--copy-gbps", "5"])


def test_crossover_separates_where_compression_pays_from_where_it_does_not() -> None:
    base = model.Cluster(hosts=1, per_host=2, copy_bytes_per_s=1e10,
                         codec_bytes_per_s=2e9, cycle_s=1e-4)
    shapes = {"w": (512, 512)}
    rate = model.crossover(shapes, ["none", "onebit"], 8, base)
    assert rate is not None and rate > 0

    def fastest(gbit: float) -> str:
        rows = model.table(shapes, ["none", "onebit"], [8], [gbit], base)
        return min(rows, key=lambda r: r["step_s"])["scheme"]

    assert fastest(rate / 2) == "onebit"
    assert fastest(rate * 2) == "none"


def test_server_transfer_is_the_shard_link_carrying_every_push_and_pull() -> None:
    """Through one shard in ``topk`` mode (a pull the size of a push) the busiest link is
    the shard's: ``w`` pushes in, then ``w`` pulls out; the push measured on real ranks."""
    shapes = {"w": (256, 256)}
    workers = 4
    stats = measure_step(Compression.parse("topk:ratio=0.01"), Policy(), shapes, workers)
    push = stats.collective_bytes["sparse"]
    job = model.Job(shapes, "topk:ratio=0.01", route="ps", server_mode="topk")
    pred = model.predict_job(job, flat(workers, rate_bits=1e9))
    assert pred.terms["transfer"] == pytest.approx(2 * workers * push * 8 / 1e9, rel=0.1)
    assert pred.host_bytes == pytest.approx(push, rel=0.1)  # a worker sends its push


def test_on_shared_cores_a_server_rounds_transfer_hides_under_the_ranks_cpu() -> None:
    """Ranks sharing cores (``cores``): the server rounds' transfer runs while ranks
    compute, up to the ranks' CPU times ``1 - 1 / contention``; with a processor per rank
    (``cores`` 0, or as many as ranks) and on a route without a server nothing changes."""
    shapes = {"w": (256, 256), "v": (128, 256), "b": (64,)}
    server = model.Job(shapes, "topk:ratio=0.01", route="ps")
    gather = model.Job(shapes, "topk:ratio=0.01")
    with pytest.raises(ValueError, match="cores"):
        flat(4, cores=-1)
    for rate, compute in ((1e6, 0.05), (1e6, 0.5), (1e9, 0.05)):
        own = flat(4, rate_bits=rate, compute_s=compute, codec_scale=2.0)
        for dedicated in (own, dataclasses.replace(own, cores=4)):
            assert dedicated.contention == 1
            assert model.predict_job(server, dedicated).terms["server_overlap"] == 0
        shared = dataclasses.replace(own, cores=2)
        assert shared.contention == 2
        alone, sharing = model.Model(server, own), model.Model(server, shared)
        a, b = alone.predict(), sharing.predict()
        link = alone._link()
        served = sum(alone.server_sent[(n, r)] for n, r in a.routes.items())
        summing = sum(alone.summing[(n, r)] for n, r in a.routes.items())
        assert served > 0 and summing > 0
        cpu = compute + a.terms["passes"] + a.terms["codec"] - summing
        hidden = min(served * link.seconds_per_byte, cpu / 2)
        assert b.terms["server_overlap"] == pytest.approx(hidden)
        assert b.step_s == pytest.approx(a.step_s - hidden)
        assert b.step_s >= cpu  # never less than the ranks' CPU on the shared cores
        assert model.predict_job(gather, shared).step_s == \
            model.predict_job(gather, own).step_s
    # a slow link: the CPU bounds what hides; a fast one: the whole transfer hides
    slow = model.predict_job(server, flat(4, rate_bits=1e6, compute_s=0.05, cores=2))
    assert slow.terms["server_overlap"] < slow.terms["transfer"]


def test_saved_codec_measurements_give_the_same_prediction(tmp_path: Path) -> None:
    job = model.Job(SHAPES, "onebit")
    before = model.predict_job(job, flat()).step_s
    path = tmp_path / "profiles.json"
    model.save_profiles(path)
    saved = dict(model.PROFILES)
    model.PROFILES.clear()
    try:
        assert model.load_profiles(path) == len(saved)
        assert model.PROFILES == saved
        assert model.predict_job(job, flat()).step_s == before
    finally:
        model.PROFILES.update(saved)


def test_a_row_of_hosts_of_several_ranks_is_predicted_as_that_cluster() -> None:
    """A ``bench cluster --hosts 2 --ranks-per-host 2`` row: the cluster is 2 hosts x 2
    ranks (not 4 hosts of one), and ``SPEC@host`` is the two-level route, whose host link
    carries less than the flat route's for the same scheme."""
    tensors = model.model_tensors("tiny")
    base = model.Cluster(hosts=1, copy_bytes_per_s=1e10)
    row = {"system": "hvd-compress", "scheme": "onebit", "link": "100mbit",
           "link_bits": 1e8, "ranks": 4, "hosts": 2, "ranks_per_host": 2, "model": "tiny"}
    flat_job, flat = model.row_case(row, tensors, base, 0.1)
    two_job, two = model.row_case({**row, "scheme": "onebit@host"}, tensors, base, 0.1)
    assert (flat.hosts, flat.per_host) == (2, 2) == (two.hosts, two.per_host)
    assert not flat_job.two_level and two_job.two_level
    assert model.predict_job(two_job, two).host_bytes < model.predict_job(
        flat_job, flat).host_bytes
    old = {k: v for k, v in row.items() if k not in ("hosts", "ranks_per_host")}
    _, one_each = model.row_case(old, tensors, base, 0.1)  # runs before --ranks-per-host
    assert (one_each.hosts, one_each.per_host) == (4, 1)


def test_two_level_powersgd_sums_its_factors_inside_the_host_not_the_gradient() -> None:
    """Under two-level PowerSGD (``linear_rounds``) takes the ``rounds`` route: its in-host
    bytes are the reduce-scatter and all-gather of its rounds' requests (the factors and
    the dense biases), far below the dense gradient's, its host link carries the flat
    all-reduces' bytes over ``W`` hosts, and each round takes three collectives. A
    scheme without ``linear_rounds`` (1-bit) still sums the dense gradient in the host."""
    shapes = {"w": (512, 256), "v": (256, 256), "b": (64,)}
    numel = sum(math.prod(s) for s in shapes.values())
    hosts, per_host = 3, 4
    cluster = model.Cluster(hosts=hosts, per_host=per_host, copy_bytes_per_s=1e10,
                            intra_bits=1e9, cycle_s=1e-3)
    share = 2 * (per_host - 1) / per_host
    dense = share * 4 * numel
    job = model.Job(shapes, "powersgd:rank=4", two_level=True)
    mine = model.Model(job, cluster)
    pred = mine.predict()
    costs = mine.costs()
    requests = sum(sum(costs[n][r].payloads) for n, r in pred.routes.items())
    assert mine.split == "rounds"
    # P and Q of rank 4 for each matrix, the bias dense, float32
    assert requests == pytest.approx(4 * (4 * (512 + 256) + 4 * (256 + 256) + 64))
    assert mine.in_host_bytes(costs, pred.routes) == pytest.approx(share * requests)
    assert mine.in_host_bytes(costs, pred.routes) < dense / 20
    assert pred.terms["intra"] == pytest.approx(share * requests * 8 / 1e9)
    assert pred.host_bytes == pytest.approx(2 * (hosts - 1) / hosts * requests)
    flat_pred = model.predict_job(dataclasses.replace(job, two_level=False), cluster)
    assert pred.collectives == 3 * flat_pred.collectives
    # the route before linear_rounds (split="tensors"): the dense sum inside the host
    old = model.Model(dataclasses.replace(job, split="tensors"), cluster)
    old_pred = old.predict()
    assert old.in_host_bytes(old.costs(), old_pred.routes) == pytest.approx(dense)
    assert old_pred.terms["intra"] > 20 * pred.terms["intra"]
    onebit = model.Model(model.Job(shapes, "onebit", two_level=True), cluster)
    assert onebit.split == "slices"
    assert onebit.in_host_bytes(onebit.costs(), onebit.predict().routes) == pytest.approx(dense)


def test_the_in_host_stage_through_shared_memory_is_memory_passes_without_a_cycle() -> None:
    """``intra_shm``: two-level's in-host bytes cost ``SHM_PASSES`` passes each at the
    pass throughput times ``codec_scale`` (not ``intra_bits``), and the ``rounds`` route's
    in-host collectives pay no Horovod cycle; a flat ring is priced as before. ``--check``
    reads the route from the run: a row's ``in_host``, or an older row's ``peers host``."""
    shapes = {"w": (512, 256), "v": (256, 256), "b": (64,)}
    tcp = model.Cluster(hosts=2, per_host=2, copy_bytes_per_s=1e10, codec_scale=2.0,
                        intra_bits=1e9, cycle_s=1e-2)
    shm = dataclasses.replace(tcp, intra_shm=True)
    assert shm.in_host_s_per_byte == pytest.approx(model.SHM_PASSES * 2.0 / 1e10)
    for spec in ("onebit", "powersgd:rank=4"):
        job = model.Job(shapes, spec, two_level=True)
        over_tcp, over_shm = model.Model(job, tcp), model.Model(job, shm)
        a, b = over_tcp.predict(), over_shm.predict()
        moved = over_shm.in_host_bytes(over_shm.costs(), b.routes)
        assert b.terms["intra"] == pytest.approx(moved * shm.in_host_s_per_byte)
        assert a.terms["intra"] == pytest.approx(moved * 8 / 1e9)
        cycles = 2 * tcp.cycle_s * cost_model.step_cycles(over_tcp.costs(), a.routes)
        saved = cycles if over_shm.split == "rounds" else 0.0
        assert a.terms["collectives"] - b.terms["collectives"] == pytest.approx(saved)
    flat_job = model.Job(shapes, "onebit")
    assert model.predict_job(flat_job, shm).step_s == model.predict_job(flat_job, tcp).step_s
    assert model.ran_shm([{"exchange_s": {"wait host": 0.1, "peers host": 0.01}}])
    assert model.ran_shm([{"scheme": "powersgd:rank=4@host", "in_host": "shm"}])
    assert not model.ran_shm([{"exchange_s": {"wait host": 0.1}}, {"in_host": "horovod"}])


def test_check_prices_the_in_host_stage_by_the_route_the_run_recorded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench model --check`` of a run whose two-level row recorded ``in_host: shm``
    prices that stage as shared memory and says so; ``--no-host-shm --intra-gbit`` prices
    it as that link instead (a slower one: a longer step)."""
    row = {"system": "hvd-compress", "scheme": "onebit@host", "link": "100mbit",
           "link_bits": 1e8, "ranks": 4, "hosts": 2, "ranks_per_host": 2, "model": "tiny",
           "step_s": 0.05, "in_host": "shm", "settings": {"HOROVOD_CYCLE_TIME": "10"}}
    floor = {**row, "system": "floor", "scheme": "none", "step_s": 0.01}
    run = tmp_path / "cluster.json"
    run.write_text(json.dumps([row, floor]))
    overhead = tmp_path / "overhead.json"
    overhead.write_text(json.dumps([{"model": "tiny", "step_s": {"floor": 0.005},
                                     "hook_wall_s": 0.01, "parameters": 10_000,
                                     "ours_phases_s": {"feedback": 1e-5}}]))
    common = ["model", "--check", str(run), "--overhead", str(overhead), "--no-fit",
              "--profiles", str(tmp_path / "profiles.json")]
    predicted = []
    for extra in ([], ["--no-host-shm", "--intra-gbit", "0.01"]):
        out = tmp_path / f"check{len(extra)}.json"
        assert main([*common, *extra, "--json", str(out)]) == 0
        checked = json.loads(out.read_text())
        assert checked["parameters"]["tiny"]["intra_shm"] == (not extra)
        predicted.append(checked["rows"][0]["predicted_s"])
    printed = capsys.readouterr().out
    assert "in-host stage: shared memory (the run's)" in printed
    assert "in-host stage: 0.01 Gbit/s" in printed
    assert predicted[1] > predicted[0]


def test_the_two_level_route_follows_linear_rounds_not_the_scheme_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The route is read from the scheme's ``linear_rounds`` (and ``sliceable``), as
    ``hierarchy.two_level_pipeline`` chooses: the same scheme with the flag off is not
    modelled as ``rounds``."""
    from hvd_compress.schemes.powersgd import PowerSGD

    scheme = Compression.parse("powersgd:rank=4")
    assert model.two_level_split(scheme) == "rounds"
    monkeypatch.setattr(PowerSGD, "linear_rounds", False)
    assert model.two_level_split(scheme) == ("slices" if scheme.sliceable else "tensors")
    onebit = Compression.parse("onebit")
    monkeypatch.setattr(type(onebit), "linear_rounds", True)
    assert model.two_level_split(onebit) == "rounds"


def test_a_two_level_powersgd_row_is_checked_by_the_route_it_recorded() -> None:
    """``bench model --check``: a ``powersgd@host`` row whose in-host collectives were
    handed about its factors' bytes ran the factor route, one handed the dense gradient
    the route before it; a row recording neither is not checked (its settings are the
    same for both routes)."""
    tensors = model.model_tensors("tiny")
    base = model.Cluster(hosts=1, copy_bytes_per_s=1e10)
    row = {"system": "hvd-compress", "scheme": "powersgd:rank=4@host", "link": "100mbit",
           "link_bits": 1e8, "ranks": 4, "hosts": 2, "ranks_per_host": 2, "model": "tiny",
           "step_s": 0.1, "collective_bytes": {"P": 800, "Q": 800, "dense": 100,
                                               "host": 2550}}
    job, _ = model.row_case(row, tensors, base, 0.1)
    assert job.split == "rounds"
    dense = {**row["collective_bytes"], "host": 4 * 1_000_000}
    assert model.row_case({**row, "collective_bytes": dense}, tensors, base, 0.1)[0].split \
        == "tensors"
    unknown = {k: v for k, v in row.items() if k != "collective_bytes"}
    with pytest.raises(model.UnknownRoute, match="in-host bytes"):
        model.row_case(unknown, tensors, base, 0.1)
    rows, _ = model.check([row, unknown], base, fitted=False)
    assert rows[0]["split"] == "rounds" and rows[0]["error"] is not None
    assert rows[1]["error"] is None and "in-host bytes" in rows[1]["not_checked"]


def test_a_round_and_kind_of_collectives_costs_one_cycle_fused_or_not() -> None:
    """Horovod starts every request that is ready in one cycle: the top-k all-gathers of
    one round (never fused) take one cycle between them, the dense all-reduce of the same
    round another. A server round waits for no cycle: it costs ``server_round_s`` per
    tensor instead."""
    shapes = {f"w{i}": (256, 256) for i in range(5)} | {"b": (256,)}
    cycle = 1e-2
    job = model.Job(shapes, "topk:ratio=0.01")
    with_cycle = model.predict_job(job, flat(cycle_s=cycle))
    without = model.predict_job(job, flat())
    assert with_cycle.collectives == 6  # five all-gathers and one all-reduce
    assert with_cycle.step_s - without.step_s == pytest.approx(2 * cycle)
    costs, routes = _costs_and_routes(job, flat())
    assert cost_model.step_cycles(costs, routes) == 2
    assert cost_model.collectives(costs, routes) == 6  # Compression.auto's count
    ps = dataclasses.replace(job, route="ps")
    cycled = model.predict_job(ps, flat(cycle_s=cycle)).step_s - model.predict_job(
        ps, flat()).step_s
    assert cycled == pytest.approx(cycle)  # the all-reduce's; the five server rounds none
    served = model.predict_job(ps, flat(server_round_s=cycle))
    assert served.terms["server_rounds"] == pytest.approx(5 * cycle)
    assert served.step_s - model.predict_job(ps, flat()).step_s == pytest.approx(5 * cycle)


def test_on_gloo_collectives_no_collective_pays_horovods_cycle() -> None:
    """``SPEC@gloo``: every round goes on a Gloo group, top-k's sums too, so a job saves
    every cycle it paid on Horovod's collectives."""
    shapes = {f"w{i}": (256, 256) for i in range(5)} | {"b": (256,)}
    cycle = 1e-2
    cluster = flat(cycle_s=cycle)
    for spec in ("topk:ratio=0.01", "powersgd:rank=2"):
        job = model.Job(shapes, spec)
        on_gloo = dataclasses.replace(job, gloo=True)
        saved = model.predict_job(job, cluster).step_s - model.predict_job(on_gloo, cluster).step_s
        horovod = cost_model.step_cycles(*_costs_and_routes(job, cluster))
        assert horovod > 0 and saved == pytest.approx(horovod * cycle)
        assert cost_model.step_cycles(*_costs_and_routes(job, cluster),
                                      cycled=on_gloo.cycled) == 0


def _costs_and_routes(job: model.Job, cluster: model.Cluster) -> tuple[Any, Any]:
    m = model.Model(job, cluster)
    costs = m.costs()
    return costs, m.routes(costs)


def test_the_compute_floor_is_the_mean_of_the_runs_floor_rows_of_a_model() -> None:
    """A floor row sends nothing, so its rows at several links measure one quantity: every
    row of the model is predicted on their mean, whatever its link."""
    base = model.Cluster(hosts=1, copy_bytes_per_s=1e10, compute_s=5.0)
    floors = [{"system": "floor", "scheme": "none", "model": "tiny", "link": link,
               "step_s": s} for link, s in (("100mbit", 0.10), ("1gbit", 0.14))]
    assert model.compute_floors(floors) == {"tiny": pytest.approx(0.12)}
    row = {"system": "hvd-compress", "scheme": "none", "link": "1gbit", "link_bits": 1e9,
           "ranks": 4, "model": "tiny", "step_s": 0.2}
    rows, _ = model.check([*floors, row, {**row, "link": "10gbit", "link_bits": 1e10}],
                          base, fitted=False)
    assert [r["compute_s"] for r in rows] == [pytest.approx(0.12)] * 2


def test_passes_left_beside_a_measured_codec_are_error_feedbacks_own() -> None:
    """With the codec measured (its route's commit inside it), the passes are error
    feedback's ``g + e`` over the tensors the scheme compresses, and nothing for a scheme
    without error feedback; with a given codec throughput, every tensor's write and the
    residual's subtraction count as passes too."""
    copy, scale = 1e10, 2.0  # flat()'s copy throughput
    cluster = flat(codec_scale=scale)
    onebit = model.predict_job(model.Job(SHAPES, "onebit"), cluster)
    compressed = sum(math.prod(SHAPES[n]) for n, r in onebit.routes.items() if r == "scheme")
    assert 0 < compressed < sum(math.prod(s) for s in SHAPES.values())  # the bias stays dense
    assert onebit.terms["passes"] == pytest.approx(4 * compressed / copy * scale)
    assert model.predict_job(model.Job(SHAPES, "qsgd:bits=4"), cluster).terms["passes"] == 0
    given = model.predict_job(model.Job(SHAPES, "onebit"),
                              flat(codec_scale=scale, codec_bytes_per_s=1e9))
    everything = sum(math.prod(s) for s in SHAPES.values())
    assert given.terms["passes"] == pytest.approx(3 * 4 * everything / copy * scale)


def test_measurements_without_the_commit_are_measured_again(tmp_path: Path) -> None:
    """A profiles file from before the codec held the route's commit (rows without
    ``commit``) loads nothing; its routes are measured anew."""
    model.predict_job(model.Job(SHAPES, "onebit"), flat())
    path = tmp_path / "profiles.json"
    model.save_profiles(path)
    rows = json.loads(path.read_text())
    assert rows and all(row["commit"] for row in rows)
    for row in rows:
        del row["commit"]
    path.write_text(json.dumps(rows))
    saved = dict(model.PROFILES)
    model.PROFILES.clear()
    try:
        assert model.load_profiles(path) == 0
        assert model.PROFILES == {}
    finally:
        model.PROFILES.update(saved)
