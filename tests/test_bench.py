"""The benchmarks (``python -m hvd_compress.bench``), run in-process on small inputs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.bench import SCHEMES, SPARSE_SCHEMES, hosts, link
from hvd_compress.bench.cli import main
from hvd_compress.bench.cluster_rank import MODELS
from hvd_compress.bench.kernels import KERNEL_SCHEMES, make_kernel, parse_count
from hvd_compress.bench.wire_bytes import LAYER_SETS

MATRIX = torch.Size((4096, 4096))
TINY_DENSE_NUMEL = 16 + 16 + 64 + 100  # bn.weight, bn.bias, embed.weight (small), fc.bias
TINY_COMPRESSED_NUMEL = 16 * 8 * 3 * 3 + 1024 * 2 + 100 * 64


def run_bench(tmp_path: Path, *argv: str) -> list[dict[str, Any]]:
    out = tmp_path / "rows.json"
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def wire_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    rows = run_bench(tmp_path_factory.mktemp("wire"), "wire", "--layers", "matrix,tiny")
    assert [(r["layers"], r["scheme"]) for r in rows] == [
        (layers, spec) for layers in ("matrix", "tiny") for spec in SCHEMES + SPARSE_SCHEMES]
    return {(r["layers"], r["scheme"]): r for r in rows}


def test_scheme_names_are_parseable_specs() -> None:
    assert Compression.parse("qsgd:bits=4").bits == 4
    assert Compression.parse("powersgd:rank=1,start_iter=0").rank == 1
    assert [Compression.parse(spec).name for spec in SCHEMES] == [
        spec.partition(":")[0] for spec in SCHEMES]


@pytest.mark.parametrize("spec", SCHEMES)
def test_matrix_bytes_are_payload_bytes(wire_rows: dict, spec: str) -> None:
    row = wire_rows["matrix", spec]
    assert row["bytes"] == row["predicted_bytes"] == Compression.parse(spec).payload_bytes(MATRIX)
    assert row["dense_bytes"] == 4 * MATRIX.numel()
    assert row["ratio"] == row["dense_bytes"] / row["bytes"]
    compressed = spec != "none"
    assert (row["compressed_tensors"], row["dense_tensors"]) == (compressed, not compressed)


def test_matrix_ratios_meet_targets(wire_rows: dict) -> None:
    assert wire_rows["matrix", "onebit"]["ratio"] > 31
    assert wire_rows["matrix", "qsgd:bits=4"]["ratio"] >= 7.5
    assert wire_rows["matrix", "powersgd:rank=4,start_iter=0"]["ratio"] == 512
    assert wire_rows["matrix", "fp16"]["ratio"] == 2
    checked = [r for r in wire_rows.values() if "target" in r]
    assert {r["scheme"] for r in checked} == {"onebit", "qsgd:bits=4", "fp16",
                                              "powersgd:rank=4,start_iter=0",
                                              "topk:ratio=0.001,values=fp16"}
    assert all(r["layers"] == "matrix" and r["target_met"] for r in checked)


def test_sparse_rows_count_coded_indices_and_values(wire_rows: dict) -> None:
    k = 16_778  # ceil(0.001 * 4096 * 4096)
    fp32, fp16 = wire_rows["matrix", "topk:ratio=0.001"], wire_rows["matrix",
                                                                   "topk:ratio=0.001,values=fp16"]
    # Same gradients, same indices: fp16 values save exactly 2 bytes per pair.
    assert fp32["bytes"] - fp16["bytes"] == 2 * k
    # Each varint index takes 1 to 3 bytes for gaps below 2**21 (4-byte prediction).
    assert k * (1 + 4) <= fp32["bytes"] < fp32["predicted_bytes"] == k * (4 + 4)
    assert fp16["ratio"] >= 800
    assert fp32["collective_bytes"] == {"sparse": fp32["bytes"]}


def test_matrix_collective_rounds(wire_rows: dict) -> None:
    onebit = wire_rows["matrix", "onebit"]
    # Each rank encodes every chunk for the scatter, then gathers its own (half) re-encoded.
    assert onebit["collective_bytes"] == {"scatter": onebit["bytes"],
                                          "gather": onebit["bytes"] // 2}
    assert wire_rows["matrix", "powersgd:rank=4,start_iter=0"]["collective_bytes"] == {
        "P": 4 * 4096 * 4, "Q": 4 * 4096 * 4}
    assert wire_rows["matrix", "none"]["collective_bytes"] == {"dense": 4 * MATRIX.numel()}


@pytest.mark.parametrize("spec", SCHEMES)
def test_tiny_policy_sends_vectors_and_small_tensors_dense(wire_rows: dict, spec: str) -> None:
    row = wire_rows["tiny", spec]
    if spec == "none":  # everything is dense
        assert (row["compressed_tensors"], row["dense_tensors"]) == (0, 7)
        assert row["collective_bytes"] == {"dense": row["dense_bytes"]}
        return
    powersgd = spec.startswith("powersgd")
    # PowerSGD also leaves proj.weight dense: rank 2 of a 1024x2 matrix saves nothing.
    assert row["dense_tensors"] == 4 + powersgd
    assert row["compressed_tensors"] == 3 - powersgd
    dense_round = 4 * (TINY_DENSE_NUMEL + powersgd * 1024 * 2)
    assert row["collective_bytes"]["dense"] == dense_round
    assert row["dense_bytes"] == 4 * (TINY_DENSE_NUMEL + TINY_COMPRESSED_NUMEL)


def test_tiny_fp16_bytes(wire_rows: dict) -> None:
    assert wire_rows["tiny", "fp16"]["bytes"] == 2 * TINY_COMPRESSED_NUMEL + 4 * TINY_DENSE_NUMEL


@pytest.mark.parametrize("spec", SCHEMES)
def test_tiny_bytes_match_prediction(wire_rows: dict, spec: str) -> None:
    """payload_bytes() is exact for one chunk; with 2 ranks each compressed tensor is two
    chunks, each padded to whole bytes, so at most one byte more per compressed tensor."""
    row = wire_rows["tiny", spec]
    assert 0 <= row["bytes"] - row["predicted_bytes"] <= row["compressed_tensors"]


def test_resnet_layer_set_is_resnet18() -> None:
    shapes = LAYER_SETS["resnet"]
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 11_689_512  # torchvision's
    assert sum(len(s) == 1 for s in shapes.values()) == 41  # 20 batchnorms and the fc bias


def test_kernels_rows(tmp_path: Path) -> None:
    every = run_bench(tmp_path, "kernels", "--sizes", "64K,1000", "--repeat", "2", "--no-tf",
                      "--selection-sizes", "200K")
    rows = [r for r in every if r["benchmark"] == "codecs"]
    selection = [r for r in every if r["benchmark"] == "selection"]
    assert len(rows) + len(selection) == len(every)
    assert [(r["numel"], r["density"], r["k"]) for r in selection] == [
        (204800, 0.001, 205), (204800, 0.01, 2048)]
    for row in selection:
        assert row["speedup"] == pytest.approx(row["topk_ms"] / row["threshold_ms"])
        assert 0.9 <= row["recall"] <= 1.0 and row["target_met"]
    assert [(r["numel"], r["scheme"]) for r in rows] == [
        (n, spec) for n in (65536, 1000) for spec in KERNEL_SCHEMES]
    for row in rows:
        assert row["bytes_per_second"] == pytest.approx(4 * row["numel"] / row["seconds"])
        assert row["copy_bytes_per_second"] == pytest.approx(
            4 * row["numel"] / row["copy_seconds"])
        assert row["ratio_to_copy"] == pytest.approx(
            row["bytes_per_second"] / row["copy_bytes_per_second"])
        assert row["torch_threads"] == torch.get_num_threads()
        assert "target" not in row  # the targets are for 64M elements
    shapes = {(r["numel"], r["scheme"]): r["shape"] for r in rows}
    assert shapes[65536, "powersgd:rank=4,start_iter=0"] == [256, 256]
    assert shapes[1000, "powersgd:rank=1,start_iter=0"] == [25, 40]
    assert shapes[1000, "onebit"] == [1000]


def test_kernels_markdown_and_device(tmp_path: Path) -> None:
    markdown = tmp_path / "kernels.md"
    main(["kernels", "--sizes", "1000", "--repeat", "1", "--no-tf", "--selection-sizes", "1000",
          "--markdown", str(markdown)])
    text = markdown.read_text()
    assert text.count("### ") == 2 and "| device | scheme | elements |" in text
    assert "| cpu | onebit | 1,000 | decode(encode(x)) |" in text
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"torch\.cuda\.is_available\(\) is False"):
            main(["kernels", "--device", "cuda", "--sizes", "1000"])


@pytest.mark.gpu
def test_cuda_kernels_rows() -> None:
    from hvd_compress.bench import kernels

    rows = kernels.run([1000, 1 << 16], 2, "cuda")
    assert [(r["numel"], r["scheme"]) for r in rows] == [
        (n, spec) for n in (1000, 1 << 16) for spec in KERNEL_SCHEMES]
    assert all(r["device"] == "cuda" and r["seconds"] > 0 and r["copy_seconds"] > 0
               for r in rows)


@pytest.mark.parametrize(("spec", "max_error"), [
    ("fp16", 2**-11), ("bf16", 2**-8), ("onebit", 0.65),  # sqrt(1 - 2/pi) for a Gaussian
    ("qsgd:bits=4", 0.25), ("qsgd:bits=8", 0.02), ("terngrad", 1.35)])
def test_codec_kernels_round_trip(spec: str, max_error: float) -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    out = make_kernel(spec, x).run()
    assert out.shape == x.shape
    assert (out - x).norm() / x.norm() < max_error
    assert bool((out * x >= 0).all())  # no codec flips a sign
    assert out.abs().max() <= x.abs().max()


@pytest.mark.parametrize("spec", ["powersgd:rank=4,start_iter=0", "powersgd:rank=1,start_iter=0"])
def test_powersgd_kernel_is_a_whole_step(spec: str) -> None:
    # A rank-1 matrix comes back exactly from one step: P, its QR, Q and the product all ran.
    gen = torch.Generator().manual_seed(0)
    x = torch.outer(torch.randn(256, generator=gen), torch.randn(256, generator=gen)).view(-1)
    torch.testing.assert_close(make_kernel(spec, x).run(), x, rtol=1e-4, atol=1e-4)


def test_parse_count() -> None:
    assert [parse_count(t) for t in ("64K", "4M", "64m", "1000")] == [
        1 << 16, 1 << 22, 1 << 26, 1000]
    for bad in ("0", "4X", "K", ""):
        with pytest.raises(ValueError):
            parse_count(bad)


@pytest.mark.parametrize("argv", [["wire", "--layers", "vgg"], ["wire", "--ranks", "0"],
                                  ["kernels", "--sizes", "4Q"], ["kernels", "--repeat", "0"]])
def test_cli_rejects_bad_options(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


@pytest.mark.multiprocess
def test_ps_bench_rows_count_the_pushed_pairs(tmp_path: Path) -> None:
    rows = run_bench(tmp_path, "ps", "--workers", "2,3", "--shards", "2", "--numel", "64K",
                     "--density", "0.05", "--rounds", "2")
    assert [(r["transport"], r["shards"], r["workers"]) for r in rows] == [
        ("in-process", 1, 2), ("in-process", 1, 3),
        ("grpc", 2, 2), ("grpc, no work", 2, 2), ("mpi", 2, 2),
        ("grpc", 2, 3), ("grpc, no work", 2, 3), ("mpi", 2, 3)]
    for row in rows:
        pairs = row["workers"] * int(0.05 * 65536) * row["rounds"]
        assert row["pairs_per_round"] * row["rounds"] == pairs
        assert row["mpairs_per_s_per_server"] == pytest.approx(
            pairs / row["seconds"] / row["shards"] / 1e6)
        # Server CPU: the round's thread time in-process, the server processes' otherwise.
        assert row["server_cpu_seconds"] is not None and row["server_cpu_seconds"] >= 0
        # The goals: per server CPU-second over gRPC, and ns per pair in-process at 2
        # workers; the other rows are reported only.
        assert ("target_met" in row) == (row["transport"] == "grpc" or (
            row["transport"] == "in-process" and row["workers"] == 2))
        if row["transport"] == "grpc":
            cpu_rate = row["mpairs_per_server_cpu_s"]  # None: too short to see CPU ticks
            assert row["target_met"] == (cpu_rate is not None and cpu_rate >= 60)


def leftover_network_objects() -> list[str]:
    """Namespaces and root-namespace links of this process's emulated hosts."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True)
    names = [line.split()[0] for line in (namespaces.stdout + links.stdout).splitlines()]
    return [name for name in names if name.startswith(hosts.network_name_prefixes())]


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, ip and tc for network namespaces")
def test_link_bench_runs_ranks_on_throttled_namespaces_and_cleans_up(tmp_path: Path) -> None:
    rows = run_bench(tmp_path, "link", "--layers", "tiny", "--rate", "1mbit", "--steps", "2",
                     "--schemes", "none", "onebit", "--timeout", "240")
    assert [r["scheme"] for r in rows] == ["none", "onebit"]
    none, onebit = rows
    assert none["bytes"] == none["dense_bytes"] > 10 * onebit["bytes"] > 0
    # The link is the bottleneck: an ideal ring needs 0.31 s for these 39 KB at 1 Mbit/s,
    # of which at most a 16 KiB burst may pass at once; 1-bit's 2 KB do not wait for it.
    assert none["step_seconds"] >= 0.5 * none["ideal_fp32_seconds"]
    assert onebit["speedup"] > 2
    assert leftover_network_objects() == []


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, ip and tc for network namespaces")
def test_link_bench_past_its_timeout_fails_with_the_ranks_stacks_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mark = f"HVDC_TEST_{os.getpid()}_{time.monotonic_ns()}"
    monkeypatch.setenv(mark, "1")  # inherited by mpirun, its daemons and the ranks
    # 39 KB per step through an 8 kbit/s link: each step needs about 20 s.
    with pytest.raises(RuntimeError, match="time limit") as failure:
        link.run("tiny", ["none"], "8kbit", steps=5, timeout=20)
    assert "in rank_main" in str(failure.value)  # the ranks' Python stacks
    assert leftover_network_objects() == []
    assert not [proc for proc in Path("/proc").glob("[0-9]*") if mark.encode() in environ(proc)]


def environ(process: Path) -> bytes:
    try:
        return (process / "environ").read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_of_the_cluster_zoo_trains(name: str) -> None:
    """Each model of ``bench cluster --models`` builds the same weights from one seed, takes
    its batches, and a few SGD steps on one batch lower its loss; it has the tensors the
    zoo is for (vectors everywhere, 4-D kernels in the CNN)."""
    from hvd_compress.bench.cluster_rank import _loss

    workload = MODELS[name]
    model, again = workload.build(0), workload.build(0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert workload.parameters() == sum(p.numel() for p in model.parameters())
    x, y = workload.batch(torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    dims = {p.dim() for p in model.parameters()}
    assert 1 in dims and (4 in dims) == (name == "cnn")


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, ip and tc for network namespaces")
def test_cluster_bench_quick_trains_every_system_on_emulated_hosts(tmp_path: Path) -> None:
    """The harness, not the speed-ups: every system trains on the emulated hosts, the
    interfaces' counters see the bytes, the report files are written, nothing is left."""
    assert main(["cluster", "--quick", "--out-dir", str(tmp_path), "--timeout", "300"]) == 0
    everything = json.loads((tmp_path / "cluster.json").read_text())
    rows = [r for r in everything if r.get("task") != "digits"]
    digits = [r for r in everything if r.get("task") == "digits"]
    got = {(r["system"], r["scheme"]) for r in rows}
    assert got == {("ddp", "none"), ("ddp", "powersgd:rank=4,start_iter=2"),
                   ("horovod", "none"), ("horovod-mpi", "none"), ("hvd-compress", "none"),
                   ("hvd-compress", "powersgd:rank=4,start_iter=2"),
                   ("hvd-compress", "topk:ratio=0.01@ps"),
                   ("hvd-compress", "auto:powersgd:rank=4,start_iter=2"), ("floor", "none")}
    by = {(r["system"], r["scheme"]): r for r in rows}
    dense_bytes = 4 * by["horovod", "none"]["parameters"]
    # The compute floor: the same ranks and model, nothing sent; every row's CPU beyond it.
    floor = by["floor", "none"]
    assert floor["replicas_agree"] is None and floor["tx_payload_bytes_per_step"] < 1000
    for row in rows:
        assert row["replicas_agree"] or row is floor, row
        assert row["floor_s"] == floor["step_s"]
        assert row["cpu_over_floor_s"] == pytest.approx(row["cpu_s_per_step"]
                                                        - floor["cpu_s_per_step"])
        assert row["link"] == "1gbit" and row["ranks"] == 2
        assert len(row["step_times_s"]) == 3
        assert 0 < row["step_s"] <= row["step_p90_s"] <= max(row["step_times_s"])
        fastest = min(by["horovod", "none"]["step_s"], by["horovod-mpi", "none"]["step_s"])
        assert row["speedup"] == pytest.approx(fastest / row["step_s"])
        if row["system"] == "hvd-compress":  # where the exchange's time went, within the step
            parts = row["exchange_s"]
            assert {"feedback", "scheme", "fuse", "commit"} <= set(parts)
            assert any(part.startswith("wait ") for part in parts)
            assert min(parts.values()) >= 0
            mean_step = sum(row["step_times_s"]) / len(row["step_times_s"])
            assert sum(parts.values()) <= mean_step
    # A ring all-reduce of 2 ranks sends each rank's whole gradient once: the interface
    # counters (headers included) see at least that, and compressed runs far less.
    for system in ("ddp", "horovod", "horovod-mpi", "hvd-compress"):
        assert by[system, "none"]["tx_bytes_per_step"] >= dense_bytes
        # What TCP carried for the processes, the packets' headers taken off: still the
        # whole gradient, and less than the interface's bytes.
        none = by[system, "none"]
        assert dense_bytes <= none["tx_payload_bytes_per_step"] < none["tx_bytes_per_step"]
        if system in ("ddp", "hvd-compress"):
            powersgd = by[system, "powersgd:rank=4,start_iter=2"]
            assert powersgd["tx_bytes_per_step"] < dense_bytes / 3
    server = by["hvd-compress", "topk:ratio=0.01@ps"]
    assert server["settings"]["ps"].startswith("grpc://")
    assert server["tx_bytes_per_step"] < dense_bytes / 3
    assert "| hvd-compress | `powersgd:rank=4,start_iter=2` |" in (
        tmp_path / "cluster.md").read_text()
    for picture in ("cluster-steps.png", "cluster-accuracy.png"):
        assert (tmp_path / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    auto = by["hvd-compress", "auto:powersgd:rank=4,start_iter=2"]["auto"]
    assert sum(auto["routes"].values()) == 6 and auto["bandwidth_bytes_s"] > 0
    # Time to accuracy: the same systems train digits; each evaluation is recorded and the
    # target is uncompressed Horovod's final accuracy minus one point. Horovod trains its 2
    # epochs; the others at least 2, then on (at most 3) within its time unless they are
    # at the target.
    assert {(r["system"], r["scheme"]) for r in digits} == got - {("floor", "none")}
    base = next(r for r in digits if r["system"] == "horovod")
    assert base["epochs"] == 2 and base["budget_s"] is None
    for row in digits:
        assert row["replicas_agree"] and len(row["curve_s"]) == row["epochs"]
        assert 2 <= row["epochs"] <= 3
        if row is not base:
            assert row["budget_s"] == pytest.approx(base["curve_s"][-1])
            assert row["epochs"] == 2 or (row["curve_s"][1] < row["budget_s"] and
                                          row["curve_accuracy"][1] < row["target_accuracy"])
        assert row["curve_s"] == sorted(row["curve_s"]) and row["curve_s"][0] > 0
        assert 0.05 < row["final_accuracy"] <= 1
        assert row["target_accuracy"] == pytest.approx(base["final_accuracy"] - 0.01)
        reached = [s for s, a in zip(row["curve_s"], row["curve_accuracy"])
                   if a >= row["target_accuracy"]]
        assert row["time_to_target_s"] == (reached[0] if reached else None)
    assert base["time_to_target_s"] is not None
    assert "seconds to target" in (tmp_path / "cluster.md").read_text()
    assert leftover_network_objects() == []


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, ip and tc for network namespaces")
def test_cluster_bench_reports_a_failed_launch_with_its_cause_and_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A launch that fails (here: our ranks refuse an unknown controller) becomes a row
    with its cause, the next launch (the floor) still runs, the report names the failure,
    and the command exits with 1."""
    out = tmp_path / "rows.json"
    assert main(["cluster", "--quick", "--epochs", "0", "--ddp", "--horovod", "--schemes",
                 "none", "--env", "HVD_COMPRESS_CONTROLLER=bogus", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())
    assert [(r.get("task"), r["system"]) for r in rows] == [(None, "floor"),
                                                            ("failed", "hvd-compress")]
    assert "controller must be one of ('auto', 'horovod', 'gloo'), got 'bogus'" in rows[1]["cause"]
    assert rows[0]["step_s"] > 0
    printed = capsys.readouterr()
    assert "FAILED LAUNCH  tiny 1gbit: hvd-compress none:" in printed.out
    assert "1 launch(es) failed" in printed.err
    assert leftover_network_objects() == []


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, ip and tc for network namespaces")
def test_cluster_bench_repeats_take_turns_and_pool_their_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--repeats 2``: the systems launch in turn (DDP, ours, DDP, ours), each row pools
    the timed steps of both its launches, and the spread target reports the interval of
    the difference; ``--pin-cores`` runs each rank on one core; ``@gloo`` runs the dense
    rounds on a Gloo group set up on the emulated hosts' interfaces; ``--controllers gloo
    mpi mpi-gloo`` runs ours on Horovod's Gloo controller, under ``mpirun``, and under
    ``mpirun`` with Horovod's Gloo controller."""
    powersgd = "powersgd:rank=4,start_iter=2"
    assert main(["cluster", "--quick", "--repeats", "2", "--pin-cores", "--schemes", powersgd,
                 f"{powersgd}@gloo", "--ddp", powersgd, "--horovod", "--epochs", "0",
                 "--controllers", "gloo", "mpi", "mpi-gloo", "--no-floor", "--steps", "4",
                 "--env", "OMPI_MCA_mpi_yield_when_idle=0",
                 "--json", str(tmp_path / "rows.json"), "--timeout", "300"]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    systems = ("hvd-compress", "hvd-compress-mpi", "hvd-compress-mpi-gloo")
    ours = [(system, scheme) for system in systems for scheme in (powersgd, f"{powersgd}@gloo")]
    assert [(r["system"], r["scheme"]) for r in rows] == [("ddp", powersgd), *ours]
    assert [r["controller"] for r in rows] == [None, "gloo", "gloo", "mpi", "mpi", "mpi-gloo",
                                              "mpi-gloo"]
    assert [r["settings"]["collectives"] for r in rows[1:]] == ["horovod", "gloo"] * 3
    assert all(r["collective_bytes"] == rows[1]["collective_bytes"] for r in rows[1:])
    assert all(r["floor_s"] is None for r in rows)
    # --env reaches Horovod's systems (the row records it), not DDP's.
    assert [r["settings"].get("OMPI_MCA_mpi_yield_when_idle") for r in rows] == [
        None, *["0"] * 6]
    for row in rows:
        assert row["runs"] == 2 and len(row["run_step_s"]) == 2
        assert len(row["step_times_s"]) == 8 and row["replicas_agree"]
        assert len(row["cpu_affinity"]) == 1  # --pin-cores: rank 0 on one core
        assert min(row["run_step_s"]) <= row["step_p90_s"] <= max(row["step_times_s"])
        # Per-step phases, pooled in launch order: forward + backward + step is the step.
        assert len(row["step_phases_s"]) == 8
        for phases, total in zip(row["step_phases_s"], row["step_times_s"]):
            assert len(phases) == 3 and min(phases) >= 0
            assert sum(phases) == pytest.approx(total, abs=1e-6)
        assert set(row["tail_excess_s"]) == {"forward", "backward", "step"}
        # Garbage collections during the timed steps, both launches counted.
        assert len(row["gc"]["per_step_s"]) == 8 and len(row["gc"]["collections"]) == 3
        assert sum(row["gc"]["per_step_s"]) == pytest.approx(sum(row["gc"]["seconds"]))
    printed = capsys.readouterr()
    starts = [line.split(": ")[0].split("] ")[1] for line in printed.err.splitlines()
              if "configuration(s) on" in line]
    assert starts == ["tiny ddp", *(f"tiny {system}" for system in systems
                                    for _ in range(2))] * 2
    spread = [line for line in printed.out.splitlines() if "spread (p90/median)" in line]
    assert len(spread) == 6 and f"{powersgd}@gloo spread" in spread[1]
    hook = [line for line in printed.out.splitlines() if "x DDP powersgd" in line]
    assert [line.split(": ")[1].split(" powersgd")[0] for line in hook] == list(
        systems)  # the faster route of each launcher
    assert all("95% interval" in line and "8 and 8 steps" in line for line in spread)
    assert "Steps slower than p90, mean excess of each phase over its median:" in printed.out
    assert leftover_network_objects() == []


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, ip and tc for network namespaces")
def test_cluster_bench_hosts_of_two_ranks_keep_their_own_traffic_off_the_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--hosts 2 --ranks-per-host 2``: each launcher (DDP started directly, ours on
    Horovod's Gloo controller, flat and two-level, stock Horovod hierarchical under
    ``mpirun``) runs 4 ranks that agree, grouped two per host; the host's link counts the
    bytes between hosts, and what a host's two ranks send each other goes over its
    loopback, not the link: a ring of 4 ranks placed two per host crosses each host link
    once per direction (1.5x the gradient per step; two-level 1x), where the link would
    carry both local ranks' sends (3x) if their own traffic went over it."""
    assert main(["cluster", "--quick", "--hosts", "2", "--ranks-per-host", "2", "--epochs",
                 "0", "--schemes", "none", "none@host", "--ddp", "none", "--horovod", "none",
                 "--horovod-controllers", "mpi-hierarchical", "--no-floor",
                 "--json", str(tmp_path / "rows.json"), "--timeout", "300"]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["system"], r["scheme"]) for r in rows] == [
        ("horovod-mpi-hierarchical", "none"), ("ddp", "none"), ("hvd-compress", "none"),
        ("hvd-compress", "none@host")]
    dense_bytes = 4 * rows[0]["parameters"]
    for row in rows:
        assert (row["hosts"], row["ranks_per_host"], row["ranks"]) == (2, 2, 4)
        assert row["local_size"] == 2  # Horovod (or DDP's launch) groups ranks by host
        assert row["replicas_agree"] and row["step_s"] > 0
        assert dense_bytes <= row["tx_bytes_per_step"] < 2 * dense_bytes, row["system"]
        if row["scheme"] == "none@host":  # the in-host sum goes through shared memory
            assert row["loopback_tx_bytes_per_step"] < dense_bytes / 10, row["system"]
            assert row["in_host"] == "shm"  # recorded for the scale model's check
        else:
            assert row["loopback_tx_bytes_per_step"] >= dense_bytes / 2, row["system"]
        assert row["expected_tx_bytes"] is None  # per rank, not per host link
    assert rows[0]["settings"]["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert rows[3]["settings"]["hierarchy"] == "host"
    printed = capsys.readouterr().out
    assert "| hvd-compress | `none@host` | 1gbit |" in printed
    assert "Bytes per step of host 0 (2 emulated hosts x 2 ranks;" in printed
    assert "| hvd-compress | `none` | 1gbit |" in printed
    assert leftover_network_objects() == []


@pytest.mark.parametrize("spec", ["topk:ratio=0.001@ps@host", "onebit@host",
                                  "powersgd:rank=4@gloo", "none"])
def test_cluster_spec_suffixes_round_trip_through_the_row_label(spec: str) -> None:
    """``SPEC@host`` asks for two-level (the optimizer's ``hierarchy="host"``); a row's label
    is rebuilt from the settings the ranks report, so it names the same configuration."""
    from hvd_compress.bench.cluster import spec_label, split_spec

    scheme, options = split_spec(spec)
    assert options.get("hierarchy") == ("host" if spec.endswith("@host") else None)
    settings = {"ps": "grpc://h:1" if options["server"] else "allgather",
                "collectives": options["collectives"], "hierarchy": options.get("hierarchy")}
    assert spec_label(scheme, settings) == spec
    with pytest.raises(ValueError, match="unknown suffix"):
        split_spec(f"{spec}@hosts")


@pytest.mark.parametrize("times", [[0.1, 0.2, 0.3, 0.5, 0.5], [0.2] * 4, [0.1, 0.4]])
def test_tail_excess_takes_the_slowest_steps_even_when_they_tie(times: list[float]) -> None:
    """The tail is the steps at or above the row's p90, which is one of the steps: never
    empty, however the slowest steps tie; each phase's excess is over its own median."""
    from hvd_compress.bench.cluster import tail_excess
    from hvd_compress.bench.cluster_rank import p90

    phases = [(0.01, t - 0.02, 0.01) for t in times]  # the time all in backward
    row = {"step_times_s": times, "step_phases_s": phases, "step_p90_s": p90(times)}
    excess = tail_excess(row)
    slowest = [t for t in times if t >= p90(times)]
    median = sorted(times)[len(times) // 2] if len(times) % 2 else \
        sum(sorted(times)[len(times) // 2 - 1:len(times) // 2 + 1]) / 2
    assert excess == pytest.approx({"forward": 0.0, "step": 0.0,
                                    "backward": sum(slowest) / len(slowest) - median})
    assert tail_excess({**row, "step_phases_s": None}) is None


def test_cluster_targets_compare_the_hook_with_our_powersgd_at_its_bytes() -> None:
    """The hook's target applies to our PowerSGD at its rank and start, and to
    ``alternate=True`` at twice the rank (the same bytes per step), nothing else."""
    from hvd_compress.bench.cluster import sends_as_hook

    hook = "powersgd:rank=4,start_iter=2"
    assert sends_as_hook(hook, hook)
    assert sends_as_hook("powersgd:rank=8,start_iter=2,alternate=True", hook)
    assert not sends_as_hook("powersgd:rank=4,start_iter=2,alternate=True", hook)
    assert not sends_as_hook("powersgd:rank=4,start_iter=10", hook)
    assert not sends_as_hook("onebit", hook)


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, ip and tc for network namespaces")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_emulated_hosts_are_removed_when_the_benchmark_is_terminated(signum: int) -> None:
    # The signal's default action, as a shell gives it: under nohup (SIGHUP ignored, and
    # inherited) emulated_hosts rightly leaves the ignored signal alone.
    code = ("import signal, time\nfrom hvd_compress.bench.hosts import emulated_hosts\n"
            f"signal.signal({int(signum)}, signal.SIG_DFL)\n"
            "with emulated_hosts(2, '1gbit'):\n    print('up', flush=True)\n    time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        prefix = f"hvdc-{child.pid % 100000}-"
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert sum(line.startswith(prefix) for line in listed.splitlines()) == 3
        child.send_signal(signum)
        assert child.wait(timeout=60) == 128 + signum
    finally:
        child.kill()
        child.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert [line for line in listed.splitlines() if line.startswith(prefix)] == []
    assert [line for line in links.splitlines()
            if line.startswith(f"hv{child.pid % 100000}up")] == []


def test_cluster_targets_take_each_scheme_on_its_faster_route() -> None:
    """1-bit and top-k, like PowerSGD, are held against DDP's hook on the faster of their
    routes (Horovod's collectives or ``@gloo``), one line per scheme; the server route and
    the two-level route stay scheme variants of their own."""
    from hvd_compress.bench import cluster

    def row(system: str, scheme: str, step_s: float) -> dict[str, Any]:
        return {"model": "mlp8m", "link": "100mbit", "system": system, "scheme": scheme,
                "step_s": step_s, "step_p90_s": step_s}

    rows = [row("ddp", "powersgd:rank=4,start_iter=2", 0.20),
            row("hvd-compress", "onebit", 0.30), row("hvd-compress", "onebit@gloo", 0.19),
            row("hvd-compress", "topk:ratio=0.001", 0.25),
            row("hvd-compress", "topk:ratio=0.001@ps", 0.18)]
    lines = [line for line in cluster._hook_targets(rows, "mlp8m", "100mbit")
             if "<= DDP powerSGD_hook" in line]
    assert len(lines) == 3, lines
    assert any(line.startswith("PASS") and "onebit@gloo 0.190 s" in line for line in lines)
    assert not any(" onebit 0.300 s" in line for line in lines)
    assert any(line.startswith("FAIL") and "topk:ratio=0.001 0.250 s" in line
               for line in lines)
    assert any(line.startswith("PASS") and "topk:ratio=0.001@ps 0.180 s" in line
               for line in lines)


def test_cluster_report_measures_powersgd_over_its_rounds_alone() -> None:
    """With a ``rounds-powersgd`` floor row, the report gives per model and link the step
    0.9x the hook leaves over the floor and each of our PowerSGD rows at the hook's
    settings over it, on any route; other schemes and other links are left out, and
    without a floor row there is no such line."""
    from hvd_compress.bench import cluster

    def row(system: str, scheme: str, step_s: float, link: str = "100mbit"
            ) -> dict[str, Any]:
        return {"model": "transformer", "link": link, "system": system, "scheme": scheme,
                "step_s": step_s}

    spec = "powersgd:rank=4,start_iter=2"
    rows = [row("ddp", spec, 0.200), row("ddp", f"rounds-{spec}", 0.150),
            row("hvd-compress", f"{spec}@gloo", 0.170),
            row("hvd-compress-mpi-gloo", spec, 0.190), row("hvd-compress", "onebit", 0.160),
            row("ddp", spec, 0.300, "1gbit"), row("hvd-compress", spec, 0.250, "1gbit")]
    lines = cluster.rounds_floor_lines(rows)
    assert len(lines) == 1 and lines[0].startswith("- transformer 100mbit:"), lines
    assert "rounds alone 0.150 s, 0.75 x the hook's 0.200 s" in lines[0]
    assert "ours may spend 30.0 ms over them" in lines[0]
    assert f"hvd-compress {spec}@gloo 0.170 s, 20.0 ms over them" in lines[0]
    assert f"hvd-compress-mpi-gloo {spec} 0.190 s, 40.0 ms over them" in lines[0]
    assert "onebit" not in lines[0]
    assert cluster.rounds_floor_lines([r for r in rows if "rounds" not in r["scheme"]]) == []


def test_cluster_report_gives_each_launch_over_the_hook() -> None:
    """Launched several times, each of our PowerSGD (at the hook's settings), 1-bit and
    top-k rows is set against the hook launch by launch, with the launches that met its
    target; other schemes, rows of another link and rows launched once are left out."""
    from hvd_compress.bench import cluster

    def row(system: str, scheme: str, runs: list[float], link: str = "1gbit"
            ) -> dict[str, Any]:
        return {"model": "transformer", "link": link, "system": system, "scheme": scheme,
                "step_s": sorted(runs)[len(runs) // 2], "run_step_s": runs}

    spec = "powersgd:rank=4,start_iter=2"
    rows = [row("ddp", spec, [0.200, 0.160]), row("hvd-compress", f"{spec}@gloo", [0.170, 0.150]),
            row("hvd-compress", "onebit", [0.190, 0.170]),
            row("hvd-compress", "qsgd:bits=4", [0.100, 0.100]),
            row("hvd-compress", spec, [0.150, 0.150], "100mbit")]
    lines = cluster.launch_lines(rows)
    assert lines == [
        f"- transformer 1gbit: hvd-compress {spec}@gloo over DDP {spec} hook: 0.850, 0.938; "
        "mean 0.894 (SD 0.062); at most 0.9 in 1 of 2 launches",
        f"- transformer 1gbit: hvd-compress onebit over DDP {spec} hook: 0.950, 1.062; "
        "mean 1.006 (SD 0.080); at most 1 in 1 of 2 launches"], lines
    once = [{**r, "run_step_s": r["run_step_s"][:1]} for r in rows]
    assert cluster.launch_lines(once) == []


def test_thread_cpu_is_told_apart_by_thread_name() -> None:
    """A row's ``cpu_threads_s_per_step``: a named thread's CPU goes to its name, not to the
    main thread's, per step; a thread that has ended is not counted."""
    import ctypes
    import threading

    from hvd_compress.bench.cluster_rank import _thread_cpu, thread_cpu_per_step

    spun, release = threading.Event(), threading.Event()

    def busy() -> None:
        ctypes.CDLL(None).prctl(15, b"hvdc_spin", 0, 0, 0)  # PR_SET_NAME
        began = time.thread_time()
        while time.thread_time() - began < 0.3:
            pass
        spun.set()
        release.wait()

    before = _thread_cpu()
    spinner = threading.Thread(target=busy)
    spinner.start()
    spun.wait()
    seen = thread_cpu_per_step(before, _thread_cpu(), 2)
    release.set()
    spinner.join()
    assert seen["hvdc_spin"] >= 0.14  # 0.3 s over 2 steps, less a clock tick
    assert seen["main"] < 0.1  # it waited
    assert "hvdc_spin" not in thread_cpu_per_step(before, _thread_cpu(), 2)
