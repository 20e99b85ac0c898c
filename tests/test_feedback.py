"""Error-feedback diagnostics: the compression error and residual norm per tensor and
step, and the warning that names a tensor whose residual keeps growing."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.feedback import (
    FEEDBACK,
    NO_RESIDUAL,
    ErrorFeedback,
    FeedbackStats,
    ResidualGrowthWarning,
)
from hvd_compress.schemes.base import Scattered, Scheme
from tests import convergence_harness as harness
from tests.harness import run_ranks
from tests.threaded import make_pipelines, on_threads


def test_report_gives_the_compression_error_and_residual_norm() -> None:
    feedback = ErrorFeedback()
    g = torch.tensor([3.0, -4.0, 0.0, 12.0])
    x = feedback.compensate("w", g)
    sent = Scattered(torch.tensor([3]), torch.tensor([12.0]), g.shape)  # top-1
    feedback.commit_sent("w", x, sent)
    stats = feedback.report()["w"]
    assert stats.steps == 1 and stats.input_norm == pytest.approx(13.0)
    assert stats.residual_norm == pytest.approx(5.0)  # what was not sent: (3, -4, 0, 0)
    assert stats.compression_error == pytest.approx(5.0 / 13.0)
    # Next step: g + e = (6, -8, 0, 12); half of it is sent.
    x = feedback.compensate("w", g)
    torch.testing.assert_close(x, torch.tensor([6.0, -8.0, 0.0, 12.0]))
    expected_error = float((x / 2).norm() / x.norm())
    feedback.commit_sent("w", x, x / 2)
    stats = feedback.report()["w"]
    assert stats.steps == 2 and stats.compression_error == pytest.approx(expected_error)
    assert stats.residual_norm == pytest.approx(float(feedback.get("w").norm()))
    # Sent exactly: no residual, no error.
    feedback.commit_sent("b", feedback.compensate("b", g), None)
    assert feedback.report()["b"].compression_error == 0.0
    assert list(feedback.report()) == ["b", "w"]


def test_a_residual_growing_without_bound_is_named_once() -> None:
    """A compressor that sends half of each new gradient and nothing of the residual: the
    residual grows by ``g / 2`` a step, passes 30x its size at step 20 (the end of the
    window) at step 601, and the warning names the tensor once. A contractive compressor
    (90% of ``g + e`` sent) keeps its residual bounded and is not named."""
    feedback = ErrorFeedback(window=20)
    g = torch.ones(100)
    warned_at = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 1000):
            x = feedback.compensate("layer.weight", g)
            feedback.commit_sent("layer.weight", x, g * 0.5)
            x = feedback.compensate("bounded", g)
            feedback.commit_sent("bounded", x, x * 0.9)
            if caught and not warned_at:
                warned_at.append(step)
    growth = [w for w in caught if issubclass(w.category, ResidualGrowthWarning)]
    assert len(growth) == 1
    message = str(growth[0].message)
    assert "'layer.weight'" in message and "lower the learning rate" in message
    assert warned_at == [601]
    assert feedback.report()["layer.weight"].growth > 30
    assert feedback.report()["bounded"].growth < 1.2


def test_warning_can_stop_the_run_and_can_be_off() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResidualGrowthWarning)
        feedback = ErrorFeedback(growth=2.0, window=1)
        with pytest.raises(ResidualGrowthWarning, match="'w'"):
            for _ in range(10):
                feedback.commit_sent("w", feedback.compensate("w", torch.ones(4)),
                                     torch.zeros(4))
        quiet = ErrorFeedback(growth=None, window=1)
        for _ in range(10):
            quiet.commit_sent("w", quiet.compensate("w", torch.ones(4)), torch.zeros(4))
        assert quiet.report()["w"].growth > 2
    with pytest.raises(ValueError, match="growth must be > 1"):
        ErrorFeedback(growth=0.5)


def test_failing_training_is_warned_about_and_healthy_training_is_not() -> None:
    """1-bit under SGD momentum 0.9 (test accuracy about 62%) against momentum 0.5 (96%),
    digits on 2 ranks: only the first warns, naming a weight."""
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = harness.train(Compression.onebit(), harness.sgd(0.1, 0.9), steps=300,
                            check=False)[0]
    names = [str(w.message).split("'")[1] for w in caught
             if issubclass(w.category, ResidualGrowthWarning)]
    assert names and all(n.endswith(".weight") for n in names), names
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        good = harness.train(Compression.onebit(), harness.sgd(0.1, 0.5), steps=300)[0]
    assert not [w for w in caught if issubclass(w.category, ResidualGrowthWarning)]
    assert good.accuracy > bad.accuracy + 10
    report = good.pipeline.feedback.report()
    assert set(report) == {"0.weight", "2.weight", "4.weight"}  # the compressed tensors
    assert all(0 < s.compression_error < 1 for s in report.values())


def test_the_optimizer_reports_its_feedback() -> None:
    import horovod.torch as hvd

    from hvd_compress import Policy
    from hvd_compress.torch import DistributedOptimizer

    hvd.init()
    model = harness.make_model()
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=Compression.onebit(), policy=Policy())
    x, y = harness.digits()[:2]
    torch.nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
    optimizer.step()
    report = optimizer.compression_feedback
    assert set(report) == {"0.weight", "2.weight", "4.weight"}
    weight = model[2].weight
    assert report["2.weight"].steps == 1 and 0 < report["2.weight"].compression_error < 1
    assert report["2.weight"].residual_norm > 0 and weight.grad is not None


# Every compressed tensor is reported, whatever its scheme -----------------------------------
def reported(scheme: Scheme, tensors: list[torch.Tensor], steps: int = 1
             ) -> list[FeedbackStats]:
    """Run ``steps`` steps of ``len(tensors)`` ranks (rank ``r`` sends ``tensors[r]`` as
    ``"w"``, every step); each rank's report of ``"w"``."""
    pipes = make_pipelines(scheme, len(tensors))
    for pipe in pipes:
        pipe.report_every = 1
    for _ in range(steps):
        on_threads(len(tensors), lambda r: pipes[r].reduce({"w": tensors[r].clone()}))
    return [p.feedback.report()["w"] for p in pipes]


def test_fp16_and_bf16_report_their_rounding_exactly() -> None:
    """Values whose float16 (bfloat16) rounding is known: 1 + 2^-12 rounds to 1 (float16
    spacing 2^-10 at 1), 3 + 2^-11 to 3 and -2 - 2^-11 to -2 (spacing 2^-9 in [2, 4)), 0.5
    is exact; bfloat16 keeps 7 mantissa bits, so 1 + 2^-9 rounds to 1 and 3 + 2^-8 to 3.
    On 2 ranks each rank reports its own tensor's error (its payload spans both chunks),
    0 for a tensor that bfloat16 holds exactly."""
    half = torch.tensor([1 + 2**-12, 3 + 2**-11, 0.5, -2 - 2**-11])
    brain = torch.tensor([1 + 2**-9, 3 + 2**-8, 0.5, -2.0])
    exact = torch.tensor([1.0, 3.0, 0.5, -2.0])
    for scheme, tensors, errors in (
            (Compression.fp16, [half, 2 * half], [(2**-12, 2**-11, 0, 2**-11)] * 2),
            (Compression.bf16, [brain, exact], [(2**-9, 2**-8, 0, 0), (0, 0, 0, 0)])):
        stats = reported(scheme, tensors)
        for rank, (s, x, error) in enumerate(zip(stats, tensors, errors)):
            if rank == 1 and scheme is Compression.fp16:  # 2x: every error doubles
                error = tuple(2 * e for e in error)
            expected = math.sqrt(sum(e * e for e in error))
            x_norm = math.sqrt(sum(float(v) ** 2 for v in x.double()))
            assert s.compression_error == pytest.approx(expected / x_norm, rel=1e-5), scheme
            assert (s.residual, s.residual_norm, s.scheme) == (NO_RESIDUAL, 0.0, scheme.name)
            assert s.input_norm == pytest.approx(x_norm, rel=1e-6) and s.growth == 0.0
    # On a GPU float16 goes through the ring and hands over its float16 values as ``sent``.
    ring = ErrorFeedback()
    ring.observe_sent("w", half, half.half(), "fp16")
    expected = math.sqrt(2**-24 + 2 * 2**-22) / float(half.double().norm())
    assert ring.report()["w"].compression_error == pytest.approx(expected, rel=1e-5)


def test_topk_error_is_the_norm_of_the_dropped_entries() -> None:
    (stats,) = reported(Compression.topk(ratio=0.5), [torch.tensor([3.0, -4.0, 1.0, 2.0])])
    assert stats.compression_error == pytest.approx(math.sqrt(1 + 4) / math.sqrt(30))
    assert (stats.residual, stats.scheme, stats.density) == (FEEDBACK, "topk", 0.5)


def test_terngrad_qsgd_and_the_vote_report_the_error_of_their_decoded_payload() -> None:
    """Hand-made buckets where the stochastic schemes' error is the same whatever they
    draw. TernGrad (no clipping, scale 1): +-1 are sent exactly and each +-0.5 becomes 0
    or +-1, an error of 0.5 either way. QSGD (4 bits: 7 levels of max |v| / 7 = 1): the
    levels 7 and 0 are exact and 3.5 becomes 3 or 4. The vote sends signs (0 as +1)."""
    cases = (
        (Compression.terngrad(bucket_size=4, clip=None), [1.0, -1.0, 0.5, -0.5],
         math.sqrt(0.5)),
        (Compression.qsgd(bucket_size=4), [7.0, 3.5, -7.0, 0.0], 0.5),
        (Compression.vote(), [0.5, -2.0, 0.0, 3.0, 1.0, 1.0, 1.0, 1.0], 2.5),
    )
    for scheme, values, error in cases:
        x = torch.tensor(values)
        for steps in (1, 3):  # another draw each step, the same error
            (stats,) = reported(scheme, [x], steps)
            assert stats.steps == steps
            assert stats.compression_error == pytest.approx(error / float(x.norm()),
                                                            rel=1e-6), scheme
            assert (stats.residual, stats.scheme) == (NO_RESIDUAL, scheme.name)
    # With error feedback the residual is the same error, kept: ||e|| = 0.5 * sqrt(2).
    (stats,) = reported(Compression.terngrad(bucket_size=4, clip=None, error_feedback=True),
                        [torch.tensor([1.0, -1.0, 0.5, -0.5])])
    assert stats.residual == FEEDBACK and stats.residual_norm == pytest.approx(math.sqrt(0.5))


def test_terngrad_error_has_its_expected_size() -> None:
    """Unclipped TernGrad sends ``s sign(v_i)`` with probability ``|v_i| / s`` (``s`` the
    bucket's max), so ``E ||T(v) - v||^2 = sum_i |v_i| (s - |v_i|)``: over 400 Gaussian
    buckets of 512 the reported squared error is within 2% of it (its relative standard
    deviation is about 0.2%), on both ranks of a 2-rank exchange."""
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(400, 512, generator=gen) for _ in range(2)]
    for x, stats in zip(tensors, reported(Compression.terngrad(clip=None), tensors)):
        s = x.abs().amax(dim=1, keepdim=True)
        expected = float((x.abs() * (s - x.abs())).sum())
        measured = (stats.compression_error * stats.input_norm) ** 2
        assert measured == pytest.approx(expected, rel=0.02)
        assert stats.input_norm == pytest.approx(float(x.norm()), rel=1e-5)


def test_dgc_reports_its_velocity_as_its_residual() -> None:
    """DGC with k = 1 of 4 and momentum 0.9, g = (3, -4, 0, 12) twice: step 1 sends the 12
    and keeps v = (3, -4, 0, 0); step 2 has u = 0.9 (3, -4, 0, 0) + g = (5.7, -7.6, 0, 12),
    v = (8.7, -11.6, 0, 12), sends the 12 again and keeps (8.7, -11.6, 0, 0), of norm
    14.5."""
    g = torch.tensor([3.0, -4.0, 0.0, 12.0])
    (first,) = reported(Compression.dgc(ratio=0.25), [g])
    assert (first.residual, first.scheme, first.density) == ("velocity", "dgc", 0.25)
    assert first.residual_norm == pytest.approx(5.0)
    assert first.input_norm == pytest.approx(13.0)
    assert first.compression_error == pytest.approx(5.0 / 13.0)
    (second,) = reported(Compression.dgc(ratio=0.25), [g], steps=2)
    assert second.steps == 2 and second.residual_norm == pytest.approx(14.5, rel=1e-6)
    assert second.input_norm == pytest.approx(math.hypot(14.5, 12.0), rel=1e-6)


def test_a_runaway_dgc_velocity_is_warned_about_and_a_healthy_one_is_not() -> None:
    """Gradients that grow by 10% a step (a diverging run) make DGC's velocity grow past
    30x its size over the first 20 steps: the warning names the tensor and its velocity.
    Fresh Gaussian gradients of constant size for 400 steps do not warn."""
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(1000, generator=gen)
    runaway, healthy = (make_pipelines(Compression.dgc(ratio=0.01), 1)[0] for _ in range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(400):
            runaway.reduce({"layer.weight": direction * 1.1 ** step})
            healthy.reduce({"w": torch.randn(1000, generator=gen)})
    messages = [str(w.message) for w in caught if issubclass(w.category, ResidualGrowthWarning)]
    assert len(messages) == 1, messages
    assert "dgc: its velocity" in messages[0] and "'layer.weight'" in messages[0]
    assert runaway.feedback.report()["layer.weight"].growth > 30
    assert healthy.feedback.report()["w"].growth < 30


def test_report_every_measures_every_nth_step_and_zero_never() -> None:
    x = torch.tensor([1 + 2**-12, 3.0])
    # By default every 10th step of a tensor (its first included), but DGC's velocity,
    # one norm of a tensor at hand, at every step.
    default, dgc = (make_pipelines(scheme, 1)[0] for scheme in (
        Compression.fp16, Compression.dgc(ratio=0.5, momentum=0.0)))
    for _ in range(12):
        default.reduce({"w": x})
        dgc.reduce({"w": x})
    assert default.report_every == 10
    assert default.feedback.report()["w"].steps == 2  # steps 0 and 10
    assert dgc.feedback.report()["w"].steps == 12
    pipe = make_pipelines(Compression.fp16, 1)[0]
    pipe.report_every = 2
    for _ in range(3):
        pipe.reduce({"w": x})
    assert pipe.feedback.report()["w"].steps == 2  # steps 0 and 2 of the tensor
    never = Pipeline(Compression.terngrad(), pipe.comm, Policy(min_numel=1, compress_1d=True),
                     report_every=0)
    never.reduce({"w": x})
    assert never.feedback.report() == {}
    with pytest.raises(ValueError, match="report_every must be a number of steps >= 0"):
        Pipeline(Compression.fp16, pipe.comm, report_every=-1)


def test_error_feedback_is_measured_through_its_window_then_every_nth_step() -> None:
    """A tensor with error feedback has its norms measured at each of its first ``window``
    (20) commits, then at every ``report_every``-th; its residual is updated at every step
    all the same (the accounting ``sum sent + e = sum g`` holds after 45 steps)."""
    gen = torch.Generator().manual_seed(3)
    for every, measured in ((10, 20 + 3), (0, 20), (1, 45)):
        pipe = make_pipelines(Compression.topk(ratio=0.25), 1)[0]
        pipe.report_every = every
        grads, applied = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
        for _ in range(45):
            g = torch.randn(64, generator=gen)
            grads += g.double()
            applied += pipe.reduce({"w": g})["w"].double()
        assert pipe.feedback.report()["w"].steps == measured, every
        residual = pipe.feedback.get("w")
        assert residual is not None
        assert torch.allclose(applied + residual.double(), grads, atol=1e-4)


@pytest.mark.multiprocess
def test_two_ranks_read_compression_feedback_after_steps() -> None:
    """Under horovodrun, 2 ranks and 3 steps of the torch optimizer: every compressed
    tensor (the 64x32 weight; the rest goes dense) is reported on each rank with that
    rank's own figures: float16's error is its rounding of the rank's local gradient,
    TernGrad's input norm is that gradient's norm, DGC reports its velocity and density."""
    ranks = run_ranks("tests.workers.feedback:reports", np=2, launcher="gloo", steps=3)
    norms = []
    for out in ranks:
        for label in ("fp16", "terngrad", "dgc"):
            report = out[label]["report"]
            assert list(report) == ["0.weight"], (label, list(report))
            assert report["0.weight"].steps == 3 and report["0.weight"].scheme == label
        g = out["fp16"]["local"].double()
        fp16 = out["fp16"]["report"]["0.weight"]
        expected = float((g.half().double() - g).norm() / g.norm())
        assert fp16.compression_error == pytest.approx(expected, rel=1e-4)
        assert 0 < fp16.compression_error < 2**-11 and fp16.residual == NO_RESIDUAL
        tern = out["terngrad"]["report"]["0.weight"]
        assert tern.input_norm == pytest.approx(float(out["terngrad"]["local"].norm()),
                                                rel=1e-5)
        assert 0.1 < tern.compression_error < 3 and tern.residual_norm == 0.0
        dgc = out["dgc"]["report"]["0.weight"]
        assert dgc.residual == "velocity" and dgc.density == math.ceil(0.01 * 2048) / 2048
        assert 0 < dgc.residual_norm < dgc.input_norm and dgc.compression_error < 1
        norms.append(tern.input_norm)
    assert norms[0] != norms[1]  # each rank reports its own gradients
