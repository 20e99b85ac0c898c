"""Rank-side half of tests/test_auto.py's multi-process test (run under horovodrun)."""

from __future__ import annotations

import copy
from typing import Any

from hvd_compress import policy as auto_routes
from tests.workers.dense import _batches, _flat, _setup, _train


def training(spec: str, slow_link: bool, steps: int = 5) -> dict[str, Any]:
    """Train with ``spec`` (a ``Compression.auto`` spec); ``slow_link``: the probe answers
    1 MB/s, so the large tensors take the scheme. Returns the routes, how many tensors
    travelled compressed in the last step, the parameters, and whether resuming from a
    checkpoint taken a step earlier reproduced the last step exactly."""
    if slow_link:
        auto_routes.probe_link = lambda *args: auto_routes.LinkModel(1e-3, 1e-6)
    batches = _batches(steps)
    model, optimizer = _setup(spec)
    routes = dict(optimizer._pipeline.auto_decision.routes)
    _train(model, optimizer, batches[:-1])
    checkpoint = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    _train(model, optimizer, batches[-1:])
    resumed_model, resumed_optimizer = _setup(spec, seed=99)
    resumed_model.load_state_dict(checkpoint[0])
    resumed_optimizer.load_state_dict(checkpoint[1])
    _train(resumed_model, resumed_optimizer, batches[-1:])
    return {"routes": routes, "compressed": optimizer.compression_stats.compressed_tensors,
            "params": _flat(model), "resumed_params": _flat(resumed_model)}
