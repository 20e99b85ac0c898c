"""1-bit Adam on real ranks, side by side with Horovod-averaged ``torch.optim.Adam``."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from hvd_compress.torch import OneBitAdam
from tests import convergence_harness as harness
from tests.workers.onebit_lamb import side_by_side


def against_adam(freeze_step: int, steps: int) -> dict[str, Any]:
    """Two copies of the digits model from the same start: one stepped by
    ``hvd.DistributedOptimizer(torch.optim.Adam)``, one by ``OneBitAdam``, on the same
    batches. The parameters of both after each step, and the 1-bit bytes."""
    torch.set_num_threads(1)
    initial = harness.make_model().state_dict()
    models = [harness.make_model(), harness.make_model()]
    for model in models:
        model.load_state_dict(initial)
    adam = hvd.DistributedOptimizer(torch.optim.Adam(models[0].parameters(), lr=1e-3),
                                    named_parameters=models[0].named_parameters())
    onebit = OneBitAdam(models[1].parameters(), lr=1e-3, freeze_step=freeze_step,
                        named_parameters=models[1].named_parameters())
    return side_by_side(models, adam, onebit, steps, "adam")
