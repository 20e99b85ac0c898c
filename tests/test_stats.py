"""``compression_stats``: readable, a plain dict, and logged every N steps to TensorBoard
or a callable."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from hvd_compress import Compression, Policy
from hvd_compress.pipeline import StepStats
from hvd_compress.stats import (
    FEEDBACK_FIELDS,
    CompressionStats,
    StatsLogger,
    feedback_scalars,
    feedback_summary,
)
from tests.harness import run_ranks
from tests.threaded import make_pipelines


def sample() -> StepStats:
    stats = StepStats(payload_bytes=1500, dense_bytes=48_000, compressed_tensors=2,
                      dense_tensors=1, collectives=3)
    stats.collective_bytes["scatter"] += 1000
    stats.collective_bytes["gather"] += 500
    stats.seconds["wait scatter"] += 0.004
    stats.seconds["scheme"] += 0.001
    return stats


def test_summary_and_plain_dict() -> None:
    stats = CompressionStats.of(sample(), 1)
    text = str(stats)
    assert text.splitlines()[0] == ("1 step: sent 1.5 kB for 48.0 kB of float32 gradients "
                                    "(32.0x smaller)")
    assert "2 compressed, 1 dense; 3 collectives" in text
    assert "by round: gather 500 B, scatter 1.0 kB" in text
    assert "exchange time 5.0 ms: wait scatter 4.0, scheme 1.0" in text
    as_dict = stats.to_dict()
    assert as_dict["density"] is None and as_dict["sparse_entries"] == 0
    assert type(as_dict["collective_bytes"]) is dict and type(as_dict["seconds"]) is dict
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["ratio"] == 32.0 and as_dict["collective_bytes"] == {"gather": 500,
                                                                       "scatter": 1000}
    assert stats.scalars("x")["x/bytes/scatter"] == 1000
    assert stats.scalars("x")["x/seconds/scheme"] == pytest.approx(0.001)
    totals = CompressionStats.of(sample(), 3)
    assert "3 steps:" in str(totals) and "500 B per step" in str(totals)


def test_logger_checks_its_arguments_and_logs_every_n_steps() -> None:
    with pytest.raises(ValueError, match="every must be a positive number"):
        StatsLogger(print, every=0)
    with pytest.raises(TypeError, match="add_scalar"):
        StatsLogger(5)
    seen: list[int] = []
    logger = StatsLogger(lambda step, stats: seen.append(step), every=3)
    for step in range(1, 10):
        logger(step, sample(), sample())
    assert seen == [3, 6, 9]

    written: dict[str, list[tuple[int, float]]] = defaultdict(list)

    class Writer:
        def add_scalar(self, tag: str, value: float, global_step: int) -> None:
            written[tag].append((global_step, value))

    StatsLogger(Writer(), every=1, prefix="p")(4, sample(), sample())
    assert written["p/ratio"] == [(4, 32.0)] and written["p/total_ratio"] == [(4, 32.0)]
    assert written["p/bytes/gather"] == [(4, 500)]


def test_a_threshold_steps_density_is_the_share_of_entries_above_tau() -> None:
    """Per step: ``density`` is the count of ``|g + e| > tau`` over the entries of the
    tensors sent sparse (the 1-D bias goes dense and counts in neither); the totals are
    the sums of the steps' counts."""
    tau = 1.0
    pipe = make_pipelines(Compression.threshold(tau=tau, max_ratio=1.0), 1,
                          policy=Policy(min_numel=64))[0]
    gen = torch.Generator().manual_seed(4)
    sent = 0
    for step in range(3):
        grads = {"weight": torch.randn(16, 20, generator=gen),
                 "bias": torch.randn(16, generator=gen)}
        residual = pipe.feedback.get("weight")
        x = grads["weight"] + (0 if residual is None else residual)
        above = int((x.abs() > tau).sum())
        assert 0 < above < x.numel()
        pipe.reduce(grads)
        stats = CompressionStats.of(pipe.last_step, 1)
        assert (stats.sparse_entries, stats.sent_entries) == (320, above), step
        assert stats.density == above / 320
        assert stats.to_dict()["density"] == above / 320
        assert stats.scalars()["hvd_compress/density"] == above / 320
        assert f"  sparse: {above} of 320 entries sent (density {100 * above / 320:.3g}%)" \
            in str(stats).splitlines()
        assert (stats.compressed_tensors, stats.dense_tensors) == (1, 1)
        sent += above
    totals = CompressionStats.of(pipe.total, 3)
    assert (totals.sparse_entries, totals.sent_entries) == (3 * 320, sent)
    # No tensor sent sparse: no density, and no scalar a writer could not take.
    dense = CompressionStats.of(sample(), 1)
    assert dense.density is None and dense.to_dict()["density"] is None
    assert "hvd_compress/density" not in dense.scalars() and "sparse:" not in str(dense)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "randomk:ratio=0.1", "dgc:ratio=0.1"])
def test_a_fixed_ratio_schemes_density_is_its_k_over_n(spec: str) -> None:
    """``k = ceil(0.1 * 320) = 32`` pairs a step; DGC's counted from the pairs it returns
    although it keeps its residual itself."""
    pipe = make_pipelines(Compression.parse(spec), 1)[0]
    for _ in range(2):
        pipe.reduce({"w": torch.randn(16, 20)})
        assert (pipe.last_step.sparse_entries, pipe.last_step.sent_entries) == (320, 32)
    assert pipe.total.density == 0.1


@pytest.mark.multiprocess
def test_optimizer_logs_to_a_callable_and_to_tensorboard() -> None:
    pytest.importorskip("tensorboard")
    ranks = run_ranks("tests.workers.stats:logged", np=2, launcher="gloo", steps=6, every=2)
    for out in ranks:
        numel = out["numel"]
        assert out["before"].startswith("0 steps: sent 0 B")
        # Every step sends the same bytes: the totals are 6 times one step's.
        payload = out["last_dict"]["payload_bytes"]
        assert out["totals"]["steps"] == 6 and out["last_dict"]["steps"] == 1
        assert out["totals"]["payload_bytes"] == 6 * payload
        assert out["totals"]["dense_bytes"] == 6 * 4 * numel
        # fp16 through the compressed all-reduce: 2 bytes per element plus chunk scales.
        assert 2 * numel <= payload < 2.1 * numel
        ratio = 4 * numel / payload
        assert [step for step, _, _ in out["calls"]] == [2]
        for _, as_dict, text in out["calls"]:
            assert {k: v for k, v in as_dict.items() if k != "seconds"} == \
                {k: v for k, v in out["last_dict"].items() if k != "seconds"}
            assert as_dict["seconds"] and all(v >= 0 for v in as_dict["seconds"].values())
            assert f"({ratio:.1f}x smaller)" in text
        # The writer replaced the callable after step 3: steps 4 and 6 reached it.
        assert [step for step, _ in out["scalars"]["hvd_compress/ratio"]] == [4, 6]
        assert [v for _, v in out["scalars"]["hvd_compress/ratio"]] == \
            pytest.approx([ratio] * 2)
        assert [v for _, v in out["scalars"]["hvd_compress/payload_bytes"]] == [payload] * 2
        assert [v for _, v in out["scalars"]["hvd_compress/total_ratio"]] == \
            pytest.approx([ratio] * 2)
        assert str(out["last"]).startswith(f"1 step: sent {payload / 1000:.1f} kB")
        assert "per step" in out["totals_str"]


def test_feedback_report_as_scalars_and_a_summary() -> None:
    """Top-k of 2 of (3, -4, 1, 2) drops (1, 2), and float16 rounds 1 + 2^-12 to 1: the
    scalars carry those exact figures under the tensors' names, the summary one line each."""
    topk = make_pipelines(Compression.topk(ratio=0.5), 1)[0]
    topk.reduce({"0.weight": torch.tensor([3.0, -4.0, 1.0, 2.0])})
    half = make_pipelines(Compression.fp16, 1)[0]
    half.reduce({"1.weight": torch.tensor([1 + 2**-12, 0.0])})
    report = {**topk.feedback.report(), **half.feedback.report()}
    scalars = feedback_scalars(report, "p")
    assert set(scalars) == {f"p/feedback/{n}/{f}" for n in ("0.weight", "1.weight")
                            for f in FEEDBACK_FIELDS}
    assert scalars["p/feedback/0.weight/compression_error"] == pytest.approx((5 / 30) ** 0.5)
    assert scalars["p/feedback/0.weight/residual_norm"] == pytest.approx(5 ** 0.5)
    assert scalars["p/feedback/0.weight/density"] == 0.5
    assert scalars["p/feedback/1.weight/compression_error"] == pytest.approx(
        2**-12 / (1 + 2**-12), rel=1e-6)
    assert scalars["p/feedback/1.weight/residual_norm"] == 0.0
    lines = feedback_summary(report).splitlines()
    assert lines[0] == ("0.weight  topk: error 0.408, error feedback 2.24 (1.0x early), "
                        "density 50%, step 1")
    assert lines[1] == "1.weight  fp16: error 0.000244, no residual, density 100%, step 1"
    assert feedback_summary({}) == "no compressed tensor"
