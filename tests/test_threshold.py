"""Threshold sparsification: exactly the entries above tau, what is kept back, its edge cases
(nothing or everything above tau, the cap, NaN), its density in the statistics, parsing,
the allgather and parameter-server routes, and convergence on digits."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.errors import NonFiniteGradientError
from hvd_compress.schemes.threshold import Threshold, ThresholdCapWarning
from hvd_compress.schemes.topk import sparse_count
from tests import convergence_harness as harness
from tests.harness import run_ranks
from tests.test_multiprocess import check_aggregates
from tests.threaded import make_pipelines, on_threads


def _reduce(pipes: list, xs: list[torch.Tensor], name: str = "w") -> list[torch.Tensor]:
    return on_threads(len(pipes), lambda r: pipes[r].reduce({name: xs[r]})[name])


def test_aggregate_is_the_sum_of_every_ranks_entries_above_tau() -> None:
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(40, 25, generator=gen) for _ in range(3)]
    pipes = make_pipelines(Compression.threshold(tau=1.5, max_ratio=1.0), 3)
    out = _reduce(pipes, xs)
    expected = sum(torch.where(x.abs() > 1.5, x, 0.0) for x in xs)
    assert torch.equal(out[0], expected) and torch.equal(out[2], expected)
    for x, pipe in zip(xs, pipes):
        # What was not sent stays in the residual, exactly; the density is what was sent.
        assert torch.equal(pipe.feedback.get("w"), torch.where(x.abs() > 1.5, 0.0, x))
        count = int((x.abs() > 1.5).sum())
        assert pipe.feedback.report()["w"].density == count / 1000
    # About 13% of a standard normal lies beyond 1.5; the densities differ between ranks.
    densities = {p.feedback.report()["w"].density for p in pipes}
    assert len(densities) > 1 and all(0.09 < d < 0.18 for d in densities)


def test_the_residual_carries_small_entries_until_they_cross_tau() -> None:
    pipe = make_pipelines(Compression.threshold(tau=1.0, max_ratio=1.0), 1)[0]
    g = torch.tensor([0.375, -0.75, 2.0, 0.0])
    sent = [pipe.reduce({"w": g})["w"] for _ in range(3)]
    assert torch.equal(sent[0], torch.tensor([0.0, 0.0, 2.0, 0.0]))
    # Step 2: e + g = [0.75, -1.5, 2, 0]: -1.5 crosses; 0.75 waits.
    assert torch.equal(sent[1], torch.tensor([0.0, -1.5, 2.0, 0.0]))
    # Step 3: 0.375 * 3 = 1.125 crosses; -0.75 is back below.
    assert torch.equal(sent[2], torch.tensor([1.125, 0.0, 2.0, 0.0]))
    assert torch.equal(pipe.feedback.get("w"), torch.tensor([0.0, -0.75, 0.0, 0.0]))
    # Over the three steps, sent + residual = 3 g exactly.
    assert torch.equal(sum(sent) + pipe.feedback.get("w"), 3 * g)
    assert [pipe.feedback.report()["w"].density] == [0.5]


def test_nothing_above_tau_sends_an_empty_frame_and_keeps_everything() -> None:
    pipes = make_pipelines(Compression.threshold(tau=100.0), 2)
    xs = [torch.randn(300), torch.randn(300)]
    out = _reduce(pipes, xs)
    assert torch.equal(out[0], torch.zeros(300))
    for x, pipe in zip(xs, pipes):
        assert torch.equal(pipe.feedback.get("w"), x)
        assert pipe.feedback.report()["w"].density == 0.0
        assert pipe.last_step.payload_bytes == 0  # no index, no value
    # One rank above tau, the other not: the aggregate is that rank's pairs alone.
    ys = [torch.full((300,), 0.5), torch.zeros(300)]
    ys[0][7] = 500.0
    out = _reduce(pipes, ys)
    assert torch.equal(out[1].nonzero().view(-1), torch.tensor([7]))
    assert out[1][7] == 500.0 + xs[0][7]


def test_everything_above_tau_is_sent_dense_coded_without_a_residual() -> None:
    pipes = make_pipelines(Compression.threshold(tau=0.0, max_ratio=1.0), 2)
    xs = [torch.rand(5000) + 0.1, torch.rand(5000) + 0.1]
    out = _reduce(pipes, xs)
    assert torch.equal(out[0], xs[0] + xs[1])
    assert torch.count_nonzero(pipes[0].feedback.get("w")) == 0
    assert pipes[0].feedback.report()["w"].density == 1.0
    # Every index present: the frame drops its index section, float32 values only.
    assert pipes[0].last_step.payload_bytes == 4 * 5000


def test_the_cap_sends_the_largest_entries_and_warns_once_per_tensor() -> None:
    scheme = Compression.threshold(tau=0.0)  # max_ratio 0.1
    pipe = make_pipelines(scheme, 1)[0]
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(1))
    k = sparse_count(0.1, x.numel())
    with pytest.warns(ThresholdCapWarning, match=r"'w' exceed tau=0 at step 0 \(density 1\)"):
        out = pipe.reduce({"w": x})["w"]
    top = x.abs().topk(k).indices
    assert set(out.nonzero().view(-1).tolist()) == set(top.tolist())
    assert torch.equal(out[top], x[top])
    assert torch.equal(pipe.feedback.get("w"), x.index_fill(0, top, 0.0))
    assert pipe.feedback.report()["w"].density == k / x.numel()
    # The frame stays below the cap's size: at most k pairs of float32 and varint gaps.
    assert pipe.last_step.payload_bytes <= k * (4 + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThresholdCapWarning)
        pipe.reduce({"w": x})  # the same tensor: no second warning
    with pytest.warns(ThresholdCapWarning, match="'v'"):
        pipe.reduce({"v": x})


def test_a_nan_is_always_sent_so_the_step_fails_instead_of_hiding_it() -> None:
    pipes = make_pipelines(Compression.threshold(tau=10.0), 2)
    first = [torch.full((100,), 0.25), torch.full((100,), 0.25)]
    _reduce(pipes, first)
    bad = [torch.full((100,), 0.25), torch.full((100,), 0.25)]
    bad[1][3] = float("nan")  # |NaN| > 10 is False, yet it must travel
    with pytest.raises(NonFiniteGradientError, match="'w'"):
        _reduce(pipes, bad)
    for pipe in pipes:  # the failed step changed no residual
        assert torch.equal(pipe.feedback.get("w"), first[0])


def test_fp16_values_keep_their_rounding_in_the_residual() -> None:
    pipe = make_pipelines(Compression.threshold(tau=0.5, values="fp16", max_ratio=1.0), 1)[0]
    x = torch.randn(1000, generator=torch.Generator().manual_seed(8)) / 3
    out = pipe.reduce({"w": x})["w"]
    above = x.abs() > 0.5
    assert torch.equal(out, torch.where(above, x.half().float(), 0.0))
    assert torch.equal(pipe.feedback.get("w"), torch.where(above, x - x.half().float(), x))


def test_parse_checks_option_names_types_and_ranges() -> None:
    scheme = Compression.parse("threshold:tau=1e-3")
    assert isinstance(scheme, Threshold) and scheme.tau == 1e-3 and scheme.max_ratio == 0.1
    full = Compression.parse("threshold:tau=0,max_ratio=1,values=fp16,loco_beta=0.8")
    assert full.describe() == {"name": "threshold", "tau": 0.0, "max_ratio": 1,
                               "values": "fp16", "loco_beta": 0.8}
    with pytest.raises(ValueError, match=r"has no option 'ratio'.*tau, max_ratio, values"):
        Compression.parse("threshold:ratio=0.1")
    with pytest.raises(ValueError, match=r"'tau' must be a number \(float\), got 'big'"):
        Compression.parse("threshold:tau=big")
    with pytest.raises(ValueError, match="tau must be a finite number >= 0, got -1"):
        Compression.parse("threshold:tau=-1")
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 0"):
        Compression.parse("threshold:max_ratio=0")
    with pytest.raises(ValueError, match="values must be 'fp32' or 'fp16'"):
        Compression.threshold(values="int8")


def test_a_checkpoint_of_another_tau_is_refused() -> None:
    pipe = make_pipelines(Compression.threshold(tau=0.5, max_ratio=1.0), 1)[0]
    pipe.reduce({"w": torch.randn(100)})
    other = make_pipelines(Compression.threshold(tau=0.25, max_ratio=1.0), 1)[0]
    with pytest.raises(ValueError, match=re.escape("'tau': 0.5")):
        other.load_state_dict(pipe.state_dict())


@pytest.mark.filterwarnings("ignore::hvd_compress.schemes.threshold.ThresholdCapWarning")
def test_digits_trains_within_a_point_of_uncompressed_at_a_few_percent_density() -> None:
    """2 ranks, SGD lr 0.1 momentum 0.5, 300 steps. Measured: float32 96.1%, tau=0.01
    95.6%, the last step sending 1.2% to 5% of the hidden layers' weights and the output
    layer's at the 10% cap (which it reaches on some steps: the cap is exercised here)."""
    reference = harness.train(Compression.none, harness.sgd(0.1, 0.5))[0]
    runs = harness.train(Compression.threshold(tau=1e-2), harness.sgd(0.1, 0.5))
    assert torch.equal(runs[0].params, runs[1].params)
    assert runs[0].accuracy >= reference.accuracy - 1.0, (runs[0].accuracy,
                                                          reference.accuracy)
    pipeline = runs[0].pipeline
    densities = [s.density for n, s in pipeline.feedback.report().items() if "weight" in n]
    assert densities and all(0 < d < 0.101 for d in densities)  # ceil(0.1 n) at most
    assert pipeline.total.ratio > 5


SPECS = ["threshold:tau=1.5,max_ratio=1.0", "threshold:tau=2.0,values=fp16",
         "threshold:tau=100"]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ps", [None, "grpc"])
def test_two_ranks_sum_the_pairs_by_allgather_and_by_the_server(
        ps: str | None, request: pytest.FixtureRequest) -> None:
    """Through Horovod ``allgather`` and through a parameter server over gRPC, the
    aggregate is the sum of what each rank sent (x minus its residual), identical on both
    ranks; with tau=100 nothing is sent and the empty frames still close the rounds."""
    kwargs = {}
    if ps == "grpc":
        kwargs["ps"] = f"grpc://{request.getfixturevalue('grpc_server').address}"
    ranks = run_ranks("tests.workers.dense:aggregates", launcher="gloo", specs=SPECS,
                      **kwargs)
    assert not check_aggregates(ranks)
    for name, row in ranks[0].items():
        if name.startswith("threshold:tau=100"):
            assert torch.count_nonzero(row["aggregate"]) == 0, name
        elif name.startswith("threshold:tau=1.5"):
            expected = sum(torch.where(r[name]["x"].abs() > 1.5, r[name]["x"], 0.0)
                           for r in ranks)
            assert torch.equal(row["aggregate"], expected), name
