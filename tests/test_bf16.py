"""bfloat16 models on 2 real ranks: gradients, ``broadcast_parameters`` and
``broadcast_optimizer_state`` through hvd-compress's collectives, which Horovod 0.28.1
refuses for bfloat16 ("Tensor type torch.BFloat16Tensor is not supported")."""

from __future__ import annotations

import pytest
import torch

from tests.harness import LAUNCHERS, run_ranks
from tests.workers.bf16 import bf16_value

pytestmark = pytest.mark.multiprocess

SCHEMES = ["none", "fp16", "bf16", "onebit", "qsgd", "terngrad", "powersgd:start_iter=1",
           "randomk", "topk", "dgc"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bf16_model_trains_with_every_scheme_with_identical_ranks(launcher: str) -> None:
    ranks = run_ranks("tests.workers.bf16:training", launcher=launcher, timeout=600,
                      specs=SCHEMES)
    for spec in SCHEMES:
        r0, r1 = ranks[0][spec], ranks[1][spec]
        assert r0["dtypes"] == ["torch.bfloat16"], spec
        # Each rank drew its own weights; broadcast_parameters gave every rank rank 0's.
        assert not torch.equal(r0["initial"], r1["initial"]), spec
        assert torch.equal(r1["start"], r0["initial"]) and torch.equal(r0["start"],
                                                                       r0["initial"]), spec
        assert torch.isfinite(r0["params"].float()).all(), spec
        assert not torch.equal(r0["params"], r0["start"]), f"{spec}: nothing was trained"
        assert torch.equal(r0["params"], r1["params"]), f"{spec}: ranks diverged"
        if spec != "dgc":  # DGC runs the optimizer without momentum
            # Each rank added rank+1 to its buffers; the broadcast restored rank 0's.
            assert torch.equal(r0["momentum"], r1["momentum"]), spec
    assert ranks[0]["onebit"]["ratio"] > 10


def test_bf16_collectives_are_exact() -> None:
    ranks = run_ranks("tests.workers.bf16:collectives", launcher="gloo")
    x0, x1 = bf16_value(0), bf16_value(1)
    # Summed in float32 (exact for two bfloat16 values of these magnitudes), rounded once.
    expected_sum = (x0.float() + x1.float()).to(torch.bfloat16)
    for rank, out in enumerate(ranks):
        for name in ("allreduce", "allreduce_"):
            assert out[name].dtype == torch.bfloat16, name
            assert torch.equal(out[name], expected_sum), name
        assert out["inplace_is_input"]
        assert [torch.equal(a, b) for a, b in zip(out["allgather"], (x0, x1))] == [True, True]
        own = slice(0, 400) if rank == 0 else slice(400, 1000)
        assert torch.equal(out["alltoall"][0], x0[own]) and torch.equal(out["alltoall"][1],
                                                                        x1[own])
