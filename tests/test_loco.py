"""LoCo's moving-average compensator as an option of the error-feedback memory: the residual
it keeps (exact values), its statistics, its option on every scheme with error feedback,
resume, refused checkpoints, and convergence."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.feedback import Candidate, Commit, ErrorFeedback
from hvd_compress.schemes.base import Dense, Scattered, Scheme, materialize, subtract
from hvd_compress.schemes.topk import TopK
from tests import convergence_harness as harness
from tests.threaded import make_pipelines


def test_the_residual_is_the_moving_average_of_the_compression_errors() -> None:
    """e_new = beta e + (1 - beta) ((g + e) - sent), on values exact in binary."""
    fb = ErrorFeedback(beta=0.75)
    shape = torch.Size([4])
    g1 = torch.tensor([1.0, -2.0, 0.5, 4.0])
    x1 = fb.compensate("w", g1)
    assert torch.equal(x1, g1)
    fb.commit_sent("w", x1, Scattered(torch.tensor([3]), torch.tensor([4.0]), shape))
    # No residual before: e1 = 0.25 * (x1 - sent1).
    assert torch.equal(fb.get("w"), torch.tensor([0.25, -0.5, 0.125, 0.0]))
    assert fb.report()["w"].density == 0.25
    x2 = fb.compensate("w", torch.tensor([2.0, 1.0, -1.0, 0.0]))
    assert torch.equal(x2, torch.tensor([2.25, 0.5, -0.875, 0.0]))  # g + e, as always
    sent2 = torch.tensor([2.0, 0.0, -1.0, 0.0])  # a dense lossy contribution
    fb.commit_sent("w", x2, sent2)
    error2 = torch.tensor([0.25, 0.5, 0.125, 0.0])  # x2 - sent2
    e2 = torch.tensor([0.25, -0.25, 0.125, 0.0])  # 0.75 * e1 + 0.25 * error2
    assert torch.equal(fb.get("w"), e2)
    stats = fb.report()["w"]
    assert stats.steps == 2 and stats.density == 1.0
    # The compression error is this step's own, ||x - sent|| / ||x||; the residual norm
    # is the averaged residual's.
    # (x2 was the buffer the residual was computed in: it is e2 now.)
    assert x2 is fb.get("w")
    x2_norm = torch.tensor([2.25, 0.5, -0.875, 0.0]).norm()
    assert stats.input_norm == pytest.approx(float(x2_norm), rel=1e-6)
    assert stats.compression_error == pytest.approx(float(error2.norm() / x2_norm),
                                                    rel=1e-6)
    assert stats.residual_norm == pytest.approx(float(e2.norm()), rel=1e-6)


def test_beta_zero_is_the_plain_residual_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    plain, zero = ErrorFeedback(), ErrorFeedback(beta=0.0)
    for _ in range(3):
        g = torch.randn(50, generator=gen)
        keep = torch.randperm(50, generator=gen)[:5]
        for fb in (plain, zero):
            x = fb.compensate("w", g)
            fb.commit_sent("w", x, Scattered(keep, x[keep].clone(), g.shape))
    assert torch.equal(plain.get("w"), zero.get("w"))
    # and it keeps the exact accounting LoCo gives up: what was not sent, nothing more.
    assert plain.report()["w"].compression_error == pytest.approx(
        plain.report()["w"].residual_norm / plain.report()["w"].input_norm)


def test_a_scheme_option_selects_it_and_the_pipeline_applies_it() -> None:
    g = torch.tensor([0.75, 3.0, -0.5, 0.0])
    loco = make_pipelines(Compression.threshold(tau=1.0, max_ratio=1.0, loco_beta=0.5), 1)[0]
    plain = make_pipelines(Compression.threshold(tau=1.0, max_ratio=1.0), 1)[0]
    assert loco.feedback.beta == 0.5 and plain.feedback.beta == 0.0
    first = loco.reduce({"w": g})["w"]
    assert torch.equal(first, torch.tensor([0.0, 3.0, 0.0, 0.0]))
    # e1 = 0.5 * ([0.75, 0, -0.5, 0]); the plain residual would be twice that.
    assert torch.equal(loco.feedback.get("w"), torch.tensor([0.375, 0.0, -0.25, 0.0]))
    plain.reduce({"w": g})
    assert torch.equal(plain.feedback.get("w"), torch.tensor([0.75, 0.0, -0.5, 0.0]))
    # Step 2: x = [1.125, 3, -0.75, 0] sends 1.125 and 3; the error is [0, 0, -0.75, 0],
    # so e2 = 0.5 * e1 + 0.5 * error = [0.1875, 0, -0.5, 0].
    second = loco.reduce({"w": g})["w"]
    assert torch.equal(second, torch.tensor([1.125, 3.0, 0.0, 0.0]))
    assert torch.equal(loco.feedback.get("w"), torch.tensor([0.1875, 0.0, -0.5, 0.0]))
    # The plain residual sends 1.5 (0.75 twice) instead and keeps -1.0 (not above tau).
    assert torch.equal(plain.reduce({"w": g})["w"], torch.tensor([1.5, 3.0, 0.0, 0.0]))
    assert torch.equal(plain.feedback.get("w"), torch.tensor([0.0, 0.0, -1.0, 0.0]))


def test_auto_gives_its_scheme_the_memory_that_scheme_asks_for() -> None:
    assert ErrorFeedback.for_scheme(Compression.parse("auto:threshold:loco_beta=0.5")).beta \
        == 0.5
    assert ErrorFeedback.for_scheme(Compression.parse("auto:topk")).beta == 0.0
    assert ErrorFeedback.for_scheme(Compression.onebit()).beta == 0.0


def test_loco_beta_is_validated_and_recorded_in_the_checkpoint() -> None:
    for bad in (1.0, -0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match=r"loco_beta must be a number in \[0, 1\)"):
            Compression.threshold(loco_beta=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loco_beta"):
        ErrorFeedback(beta=1.0)
    with pytest.raises(ValueError, match=r"'loco_beta' must be a number \(float\)"):
        Compression.parse("threshold:loco_beta=high")
    assert Compression.parse("threshold:tau=0.1,loco_beta=0.8").loco_beta == 0.8
    saved = make_pipelines(Compression.threshold(tau=2.0, loco_beta=0.8), 1)[0]
    saved.reduce({"w": torch.randn(64)})
    other = make_pipelines(Compression.threshold(tau=2.0), 1)[0]
    with pytest.raises(ValueError, match=re.escape("'loco_beta': 0.8")):
        other.load_state_dict(saved.state_dict())


def test_resume_from_a_checkpoint_gives_the_same_next_step() -> None:
    scheme = Compression.threshold(tau=0.8, max_ratio=1.0, loco_beta=0.8)
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(200, generator=gen) for _ in range(4)]
    first = make_pipelines(scheme, 1)[0]
    for g in grads[:3]:
        first.reduce({"w": g})
    resumed = make_pipelines(scheme, 1)[0]
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(first.reduce({"w": grads[3]})["w"], resumed.reduce({"w": grads[3]})["w"])
    assert torch.equal(first.feedback.get("w"), resumed.feedback.get("w"))


@pytest.mark.filterwarnings("ignore::hvd_compress.schemes.threshold.ThresholdCapWarning")
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_digits_trains_with_it_within_a_point_of_uncompressed(optimizer: str) -> None:
    """2 ranks, 300 steps, threshold tau=0.01 with loco_beta=0.8. Measured: SGD lr 0.1
    momentum 0.5 95.3% against 96.1% uncompressed; AdamW lr 1e-3 96.1% against 95.6%."""
    make = harness.sgd(0.1, 0.5) if optimizer == "sgd" else harness.adamw(1e-3)
    reference = harness.train(Compression.none, make)[0]
    runs = harness.train(Compression.threshold(tau=1e-2, loco_beta=0.8), make)
    assert torch.equal(runs[0].params, runs[1].params)
    run = runs[0]
    assert max(run.losses) < 2 * run.losses[0], max(run.losses)
    assert run.accuracy >= reference.accuracy - 1.0, (run.accuracy, reference.accuracy)
    assert all(0 < s.density < 0.101 for n, s in run.pipeline.feedback.report().items()
               if "weight" in n)


# Every scheme whose residual is the pipeline's error-feedback memory ----------------------
LOCO_SCHEMES: dict[str, Callable[[float], Scheme]] = {
    "topk": lambda beta: Compression.topk(ratio=0.25, loco_beta=beta),
    "randomk": lambda beta: Compression.randomk(ratio=0.25, loco_beta=beta),
    "threshold": lambda beta: Compression.threshold(tau=0.5, max_ratio=1.0, loco_beta=beta),
    "onebit": lambda beta: Compression.onebit(bucket_size=8, loco_beta=beta),
    "qsgd": lambda beta: Compression.qsgd(bucket_size=8, error_feedback=True, loco_beta=beta),
    "terngrad": lambda beta: Compression.terngrad(bucket_size=8, error_feedback=True,
                                                  loco_beta=beta),
    "powersgd": lambda beta: Compression.powersgd(rank=1, start_iter=0, loco_beta=beta),
}
"""Each scheme with ``loco_beta`` on a 4 x 8 tensor, with options that make one step lossy
there (a quarter of the entries, buckets of 8, rank 1 from the first step)."""

DESCRIPTIONS = {
    "topk": {"name": "topk", "ratio": 0.25, "values": "fp32"},
    "randomk": {"name": "randomk", "ratio": 0.25},
    "threshold": {"name": "threshold", "tau": 0.5, "max_ratio": 1.0, "values": "fp32"},
    "onebit": {"name": "onebit", "bucket_size": 8},
    "qsgd": {"name": "qsgd", "bits": 4, "bucket_size": 8, "norm": "max",
             "error_feedback": True},
    "terngrad": {"name": "terngrad", "bucket_size": 8, "clip": 2.5, "error_feedback": True},
    "powersgd": {"name": "powersgd", "rank": 1, "start_iter": 0, "min_compression_rate": 2.0,
                 "warm_start": True},
}
"""The descriptions the schemes recorded in checkpoints before they had ``loco_beta``."""


@pytest.mark.parametrize("beta", [0.5, 0.8])
@pytest.mark.parametrize("name", list(LOCO_SCHEMES))
def test_every_scheme_keeps_the_moving_average_of_its_errors(
        name: str, beta: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps of one rank: what the pipeline hands the memory (``x = g + e`` and the
    scheme's contribution ``sent``) is recorded, and the residual it keeps is
    ``beta e + (1 - beta)(x - sent)`` to the bit, evaluated with the memory's operations:
    ``add`` with ``alpha`` is a fused multiply-add in ATen's vector kernels, so with a
    ``beta`` whose products round (0.8) another order of operations differs in the last
    bit at elements that depend on the CPU's vector width."""
    pipe = make_pipelines(LOCO_SCHEMES[name](beta), 1)[0]
    assert pipe.feedback.beta == beta
    handed: list[tuple[torch.Tensor, Dense]] = []
    prepare = pipe.feedback.prepare  # every commit's first half

    def record(commits: list[Commit]) -> list[Candidate]:
        for c in commits:
            assert c.sent is not None, f"{name} sent the tensor exactly"
            handed.append((c.compensated.clone(), c.sent))
        return prepare(commits)

    monkeypatch.setattr(pipe.feedback, "prepare", record)
    gen = torch.Generator().manual_seed(11)
    e = torch.zeros(4, 8)
    for step in range(3):
        g = torch.randn(4, 8, generator=gen)
        pipe.reduce({"w": g})
        assert pipe.last_step.compressed_tensors == 1, step
        x, sent = handed[-1]
        assert torch.equal(x, g + e), step
        # The step's error, as the memory subtracts it (PowerSGD's in one product).
        error = subtract(x.clone(), sent)
        torch.testing.assert_close(error, x - materialize(sent), rtol=0, atol=1e-6)
        assert bool(error.any()), f"{name} step {step} lost nothing"
        e = ((1 - beta) * error).add_(e, alpha=beta)
        assert torch.equal(pipe.feedback.get("w"), e), step
        # and it is not the plain residual the same step would keep
        assert not torch.equal(e, error), step


@pytest.mark.parametrize("name", list(LOCO_SCHEMES))
def test_every_scheme_refuses_a_checkpoint_of_another_beta(name: str) -> None:
    make = LOCO_SCHEMES[name]
    assert make(0.0).describe() == DESCRIPTIONS[name]  # so old checkpoints still load
    assert make(0.8).describe() == {**DESCRIPTIONS[name], "loco_beta": 0.8}
    g = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    checkpoints = {}
    for beta in (0.0, 0.5, 0.8):
        pipe = make_pipelines(make(beta), 1)[0]
        pipe.reduce({"w": g})
        checkpoints[beta] = pipe.state_dict()
    for saved, state in checkpoints.items():
        for beta in (0.0, 0.5, 0.8):
            pipe = make_pipelines(make(beta), 1)[0]
            if beta == saved:
                pipe.load_state_dict(state)
                assert torch.equal(pipe.feedback.get("w"), state["residuals"]["w"])
                continue
            with pytest.raises(ValueError, match=re.escape(
                    f"saved with {make(saved).describe()} but this optimizer uses "
                    f"{make(beta).describe()}")):
                pipe.load_state_dict(state)
            assert pipe.feedback.get("w") is None  # and nothing was loaded


def test_parse_gives_each_scheme_the_option() -> None:
    topk = Compression.parse("topk:ratio=0.01,loco_beta=0.8")
    assert isinstance(topk, TopK) and topk.ratio == 0.01 and topk.loco_beta == 0.8
    assert make_pipelines(topk, 1)[0].feedback.beta == 0.8
    for spec in ("randomk", "threshold", "onebit", "qsgd:error_feedback=True",
                 "terngrad:error_feedback=True", "powersgd"):
        scheme = Compression.parse(f"{spec}{',' if ':' in spec else ':'}loco_beta=0.25")
        assert scheme.loco_beta == 0.25 and scheme.describe()["loco_beta"] == 0.25, spec
        assert ErrorFeedback.for_scheme(scheme).beta == 0.25, spec
    assert ErrorFeedback.for_scheme(Compression.parse("auto:onebit:loco_beta=0.5")).beta \
        == 0.5
    with pytest.raises(ValueError, match=r"topk: loco_beta must be a number in \[0, 1\)"):
        Compression.topk(loco_beta=1.0)


@pytest.mark.parametrize("factory", [Compression.qsgd, Compression.terngrad])
def test_an_unbiased_quantiser_without_error_feedback_refuses_it(
        factory: Callable[..., Scheme]) -> None:
    """QSGD and TernGrad keep a residual only with ``error_feedback=True``: without one
    there is nothing to average, and the option would silently do nothing."""
    with pytest.raises(ValueError, match=r"loco_beta=0\.8 averages the error-feedback "
                                         r"residual, .* pass error_feedback=True"):
        factory(loco_beta=0.8)
    assert factory(loco_beta=0.0).describe().get("loco_beta") is None


def test_schemes_without_the_memory_have_no_option() -> None:
    """DGC keeps what it did not send in its own velocity, majority vote keeps nothing:
    neither uses the pipeline's error-feedback memory, so neither takes ``loco_beta``."""
    for spec in ("dgc:loco_beta=0.8", "vote:loco_beta=0.8"):
        with pytest.raises(ValueError, match="has no option 'loco_beta'"):
            Compression.parse(spec)
