"""Multi-worker behaviour on 2 real ranks, under horovodrun (Gloo) and mpirun (MPI)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hvd_compress.schemes.packed import chunk_sizes
from tests.harness import LAUNCHERS, run_ranks

pytestmark = pytest.mark.multiprocess

EXACT_SPECS = ["none", "fp16", "onebit:bucket_size=64", "qsgd:bucket_size=64,error_feedback=True",
               "terngrad:bucket_size=64,error_feedback=True", "powersgd:rank=2,start_iter=0"]
STAT_SPECS = ["bf16", "qsgd", "terngrad"]
TRAIN_SPECS = ["none", "fp16", "bf16", "onebit", "qsgd", "terngrad", "powersgd:start_iter=2"]


def check_aggregates(ranks: list[dict[str, Any]]
                     ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Assert every rank got the same aggregates and, where each rank reported what it sent,
    that the aggregate is their sum. Returns (aggregate, true sum) of the other schemes."""
    unbiased: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, row0 in ranks[0].items():
        rows = [r[name] for r in ranks]
        # Every rank receives bit-identical aggregates.
        assert all(torch.equal(r["aggregate"], row0["aggregate"]) for r in rows), name
        if row0["sent"] is None:
            total = sum(r["x"] for r in rows)
            unbiased.setdefault(name.split("/")[0], []).append((row0["aggregate"], total))
            continue
        sent = sum(r["sent"] for r in rows)
        applied = row0["aggregate"].clone().reshape(-1)
        if row0["chunk_residual"] is not None:
            # What the reducing ranks kept back in their own residuals, chunk by chunk.
            applied += torch.cat([r["chunk_residual"] for r in rows])
        tol = 2e-3 if name.startswith("fp16") else 1e-5
        torch.testing.assert_close(applied, sent.reshape(-1), rtol=tol, atol=tol, msg=name)
    return unbiased


# The fast tier's smoke launches of horovodrun (Gloo) and mpirun (MPI).
@pytest.mark.parametrize("launcher", [pytest.param(name, marks=pytest.mark.smoke)
                                      for name in LAUNCHERS])
def test_aggregate_is_sum_of_decoded_contributions(launcher: str) -> None:
    ranks = run_ranks("tests.workers.dense:aggregates", launcher=launcher,
                      specs=EXACT_SPECS + STAT_SPECS)
    unbiased = check_aggregates(ranks)
    # Unbiased schemes: projecting the aggregate on the true sum gives 1 up to noise whose
    # standard deviation is (relative error) / sqrt(n), about 0.02 for these ~12k elements.
    assert set(unbiased) == set(STAT_SPECS)
    for spec, pairs in unbiased.items():
        agg = torch.cat([a.reshape(-1) for a, _ in pairs])
        total = torch.cat([t.reshape(-1) for _, t in pairs])
        coefficient = float(agg @ total / (total @ total))
        assert abs(coefficient - 1) < 0.15, (spec, coefficient)


def check_training(ranks: list[dict[str, Any]], specs: list[str]) -> None:
    """Assert the ranks ended with identical, finite parameters and that resuming from the
    checkpoint reproduced the last step bit for bit, for every scheme."""
    for spec in specs:
        params = [r[spec]["params"] for r in ranks]
        assert torch.isfinite(params[0]).all(), spec
        assert all(torch.equal(p, params[0]) for p in params), f"{spec}: ranks diverged"
        for r in ranks:
            assert torch.equal(r[spec]["resumed_params"], r[spec]["params"]), \
                f"{spec}: resuming from the checkpoint changed the next step"


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_training_keeps_ranks_identical_and_resumes_exactly(launcher: str) -> None:
    ranks = run_ranks("tests.workers.dense:training", launcher=launcher, specs=TRAIN_SPECS)
    check_training(ranks, TRAIN_SPECS)
    assert ranks[0]["onebit"]["ratio"] > 10


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_nonfinite_gradient_raises_on_every_rank_and_changes_nothing(launcher: str) -> None:
    ranks = run_ranks("tests.workers.dense:nonfinite", launcher=launcher, spec="onebit")
    for rank, result in enumerate(ranks):
        assert result["error"] is not None, f"rank {rank} did not raise"
        assert result["error"]["names"] == ["w"]
        assert result["error"]["local"] == (["w"] if rank == 1 else [])
        assert "step 1" in result["error"]["message"]
        assert result["unchanged"], f"rank {rank} changed its state on a failed step"
        assert result["recovered_finite"]


def check_idle_wait(ranks: list[dict[str, Any]], delay: float) -> None:
    """Rank 0 waited about ``delay`` seconds for rank 1 with its waiting thread mostly
    asleep, and both got the sum of their pairs."""
    assert all(torch.equal(r["sum"], torch.tensor([1.0, 2.0, 0.0, 0.0])) for r in ranks)
    waiting = ranks[0]
    assert waiting["wall"] > 0.8 * delay
    assert waiting["cpu"] < 0.1 * waiting["wall"], waiting


def test_waiting_for_a_late_rank_leaves_the_core_idle() -> None:
    """Horovod's synchronize spins until a collective completes; the communicator's wait
    sleeps between polls, so a rank waiting a second for its partner uses little CPU
    (which the other processes on the host need)."""
    ranks = run_ranks("tests.workers.dense:late_partner", launcher="gloo", delay=1.0)
    check_idle_wait(ranks, 1.0)


def test_stock_horovod_optimizer_takes_fp16_and_refuses_the_rest() -> None:
    ranks = run_ranks("tests.workers.dense:stock_optimizer", launcher="gloo")
    for name, agg in ranks[0]["fp16_aggregate"].items():
        expected = sum(r["fp16_local"][name].half().float() for r in ranks) / 2
        torch.testing.assert_close(agg, expected, rtol=2e-3, atol=2e-3)
        assert torch.equal(agg, ranks[1]["fp16_aggregate"][name])
    for spec in ("onebit", "bf16"):
        message = ranks[0][spec]
        assert message is not None and "hvd_compress.torch.DistributedOptimizer" in message


def test_chunking_used_by_the_workers_covers_the_tensor() -> None:
    for numel in (0, 1, 63, 64, 65, 33 * 17, 1000):
        sizes = chunk_sizes(numel, 2, 64)
        assert sum(sizes) == numel and all(s >= 0 for s in sizes)
        assert all(s % 64 == 0 for s in sizes[:-1] if sizes[-1])


def test_every_scheme_converges_on_digits_like_uncompressed() -> None:
    """Same seed, same epochs: each scheme within 1.0 point of float32 test accuracy."""
    ranks = run_ranks("tests.workers.dense:digits", launcher="gloo", timeout=600,
                      specs=[*TRAIN_SPECS[:-1], "powersgd"], epochs=20)
    accuracy = ranks[0]
    assert accuracy == ranks[1]
    baseline = accuracy["none"]
    assert baseline > 94, accuracy
    for spec, acc in accuracy.items():
        assert acc >= baseline - 1.0, f"{spec}: {acc:.2f}% vs uncompressed {baseline:.2f}%"
