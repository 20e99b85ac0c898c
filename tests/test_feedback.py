"""Error-feedback diagnostics: the compression error and residual norm per tensor and
step, and the warning that names a tensor whose residual keeps growing."""

from __future__ import annotations

import warnings

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.feedback import ErrorFeedback, ResidualGrowthWarning
from hvd_compress.schemes.base import Scattered
from tests import convergence_harness as harness


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
