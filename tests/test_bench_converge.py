"""``python -m hvd_compress.bench converge --quick``: the harness trains every configuration
of its plan on 2 ranks (horovodrun, Gloo), top-k also through real parameter servers in
every mode, and writes what it promises. The figures are the benchmark's to report; this
checks that they are produced and sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import psutil
import pytest

from hvd_compress.bench import cli, converge

PNGS = ["converge-lm-steps.png", "converge-lm-bytes.png", "converge-digits-steps.png",
        "converge-digits-bytes.png"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    out = tmp_path_factory.mktemp("converge")
    captured: list[str] = []
    plan = converge.Plan.quick()
    plan.progress = captured.append
    rows = converge.run(plan)
    written = converge.write(rows, out, "python -m hvd_compress.bench converge --quick")
    assert written == ["converge.json", "converge.md", *PNGS]
    return out, rows, "\n".join(captured)


@pytest.mark.multiprocess
def test_a_row_for_every_configuration_of_the_plan(quick: tuple[Path, list[dict], str]
                                                   ) -> None:
    _, rows, _ = quick
    plan = converge.Plan.quick()
    assert [(r["task"], r["name"]) for r in rows] == [(c.task, c.name) for c in plan.configs]
    assert {r["task"] for r in rows} == {"lm", "digits"}
    assert {"none", "powersgd", "onebit-adam"} <= {r["name"] for r in rows}
    assert all(r["replicas_agree"] for r in rows)


@pytest.mark.multiprocess
def test_losses_are_finite_and_fall(quick: tuple[Path, list[dict], str]) -> None:
    _, rows, _ = quick
    for r in rows:
        losses = [p["loss"] for p in r["curve"]]
        steps = [p["step"] for p in r["curve"]]
        assert steps[-1] == r["steps"] and steps == sorted(steps)
        assert all(math.isfinite(x) for x in losses), (r["name"], losses)
        assert losses[-1] < losses[0], (r["task"], r["name"], losses)
        assert r["final_loss"] == losses[-1]
        # Below the loss of a uniform guess over the classes: the models learned something.
        classes = 10 if r["task"] == "digits" else None
        if classes is not None:
            assert r["final_loss"] < math.log(classes)
            assert r["final_accuracy"] > 0.3


@pytest.mark.multiprocess
def test_bytes_come_from_the_optimizers_statistics(quick: tuple[Path, list[dict], str]
                                                   ) -> None:
    _, rows, _ = quick
    for r in rows:
        assert r["bytes_per_step"] > 0 and r["dense_bytes_per_step"] > 0
        if r["name"] == "none":  # float32 all-reduce: exactly the dense size
            assert r["bytes_per_step"] == r["dense_bytes_per_step"]
            assert r["ratio"] == 1.0 and r["loss_gap_pct"] == 0.0
        elif r["warmup_steps"] > 0:  # compression after its warm-up sends fewer bytes
            assert r["bytes_per_step_after_warmup"] < r["bytes_per_step"]
            assert r["ratio_after_warmup"] > r["ratio"] > 1.0
        else:  # top-k from the first step: 1% of the large tensors' entries
            assert r["name"].startswith("topk")
            assert r["ratio_after_warmup"] == r["ratio"] > 10
    adam = next(r for r in rows if r["name"] == "onebit-adam")
    assert adam["ratio_after_warmup"] > 16  # 1 bit per element for the large tensors


@pytest.mark.multiprocess
def test_topk_through_a_real_server_in_each_mode(quick: tuple[Path, list[dict], str]) -> None:
    """Each server row went through its own server, which closed every round of every
    step; union mode is the collectives' exact sum (the same training, step for step);
    top-k mode answers at most as many pairs as a worker pushed, union mode more."""
    out, rows, _ = quick
    by_name = {r["name"]: r for r in rows if r["task"] == "digits"}
    union, topk, gtopk, gathered = (by_name[n] for n in (
        "topk-server-union", "topk-server-topk", "topk-server-gtopk", "topk"))
    assert (union["ps_mode"], topk["ps_mode"], gtopk["ps_mode"], gathered["ps_mode"]) == \
        ("union", "topk", "gtopk", None)
    assert "server_rounds" not in gathered
    for r in (union, topk, gtopk):
        assert r["server_failed_rounds"] == 0
        assert r["server_rounds"] >= r["steps"] and r["server_rounds"] % r["steps"] == 0
    assert union["bytes_per_step"] == gathered["bytes_per_step"]  # the same pushes
    assert union["curve"] == gathered["curve"]
    assert union["final_loss"] == gathered["final_loss"]
    for r in (topk, gtopk):  # the server's top-k is another sum, of a push's size
        assert r["curve"] != gathered["curve"]
        assert r["pull_push_ratio"] <= 1.0 < union["pull_push_ratio"]
        assert r["server_out_bytes_per_step"] < union["server_out_bytes_per_step"]
    table = (out / "converge.md").read_text()
    assert "via a parameter server, `--mode topk`" in table
    assert "via a parameter server, `--mode gtopk`" in table
    assert "| topk-server-union | union | " in table
    leftover = [p.cmdline() for p in psutil.Process().children(recursive=True)]
    assert not [c for c in leftover if "ps_server" in c], leftover


@pytest.mark.multiprocess
def test_the_servers_are_stopped_when_the_launch_fails(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    plan = converge.Plan.full(["digits"], only=["topk-server-topk"])
    started = []

    def fail(plan: converge.Plan, directory: Path, servers: dict[int, str]) -> list:
        started.extend(servers.values())
        raise converge.LaunchError("horovodrun exited with 1")

    monkeypatch.setattr(converge, "_launch", fail)
    with pytest.raises(converge.LaunchError):
        converge.run(plan)
    assert len(started) == 1 and started[0].startswith("grpc://127.0.0.1:")
    leftover = [p.cmdline() for p in psutil.Process().children(recursive=True)]
    assert not [c for c in leftover if "ps_server" in c], leftover


def test_server_rows_follow_the_modes_asked_for() -> None:
    names = [c.name for c in converge.Plan.full(["lm"], ps_modes=["topk"]).configs]
    assert "topk-server-topk" in names and "topk-server-union" not in names
    plan = converge.Plan.full(["digits"], ps_modes=[])
    assert all(c.ps_mode is None for c in plan.configs)
    topk = next(c for c in converge.recommended("lm", 400) if c.name == "topk")
    for mode in converge.PS_MODES:  # the topk row's scheme and optimizer, through a server
        row = next(c for c in converge.recommended("lm", 400)
                   if c.name == f"topk-server-{mode}")
        assert (row.scheme, row.optimizer, row.ps_mode) == (topk.scheme, topk.optimizer, mode)
    args = cli.build_parser().parse_args(["converge", "--ps-modes", "none"])
    assert args.ps_modes == []
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["converge", "--ps-modes", "sum"])


@pytest.mark.multiprocess
def test_files_and_progress(quick: tuple[Path, list[dict], str]) -> None:
    out, rows, progress = quick
    assert json.loads((out / "converge.json").read_text()) == rows
    table = (out / "converge.md").read_text()
    assert table.startswith("`python -m hvd_compress.bench converge --quick`")
    for r in rows:
        assert f"| {r['name']} | " in table
    for png in PNGS:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    plan = converge.Plan.quick()
    # One progress line per evaluation of every configuration.
    expected = sum(math.ceil(plan.tasks[c.task]["steps"] / plan.tasks[c.task]["eval_every"])
                   for c in plan.configs)
    lines = progress.splitlines()
    assert len(lines) == expected
    assert lines[0].startswith("lm none: step 10/30, held-out loss ")


def test_the_command_line_rejects_an_unknown_task() -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["converge", "--tasks", "imagenet"])


def test_an_unknown_configuration_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit, match="no configuration named topkk in lm; the names are "
                       "none, fp16, bf16, powersgd, powersgd-alternate, onebit"):
        cli.main(["converge", "--tasks", "lm", "--only", "topkk"])
    plan = converge.Plan.full(["digits"], only=["dgc"])
    assert [c.name for c in plan.configs] == ["none", "dgc"]
    assert plan.configs[1].optimizer["momentum"] == 0.0  # DGC carries the momentum


def test_every_recommended_lm_scheme_takes_adamw_without_a_warning() -> None:
    """The language model's rows are the schemes' settings for AdamW: each is accepted by
    its construction check silently (1-bit with its dense warm-up and small buckets; random-k
    with its explicit opt-out), and 1-bit's warm-up is counted as the row's warm-up."""
    import warnings

    import torch

    from hvd_compress import Compression

    rows = converge.recommended("lm", converge.LM_TASK["steps"])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    checked = set()
    for config in rows:
        if config.scheme is None or config.optimizer["kind"] != "adamw":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Compression.parse(config.scheme).check_optimizer(optimizer)
        checked.add(config.name)
    assert {"onebit", "onebit-loco", "randomk"} <= checked
    for config in rows:
        if config.name.startswith("onebit") and config.scheme:
            scheme = Compression.parse(config.scheme)
            assert scheme.start_iter == config.warmup_steps == converge.LM_TASK["steps"] // 10
