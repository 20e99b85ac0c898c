"""Rank-side half of tests/test_tensorflow_hierarchy.py: the TensorFlow tape and Keras
optimizer with ``hierarchy="host"`` on 4 Horovod ranks grouped into 2 emulated hosts.

Run as ``python -m tests.workers.tf_hierarchy OUT JSON_KWARGS`` under ``horovodrun``: it
starts Horovod's TensorFlow library only. (``tests.rank_main`` starts the torch library
first; with both on Horovod's Gloo rendezvous, the second library's start on 4 ranks failed
2 times in 3 here with ``connect ... Connection refused``.)"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import horovod.tensorflow as hvd_tf
import keras
import numpy as np
import tensorflow as tf

from hvd_compress import Compression, Policy
from hvd_compress.schemes.dense import NoCompression
from hvd_compress.tensorflow import DistributedGradientTape, compression_state, init
from hvd_compress.tensorflow.keras import DistributedOptimizer

SHAPES = {"w": (64, 48), "v": (33, 40), "b": (48,), "row": (1, 512)}
POLICY = Policy(min_numel=64)


def _coefficients(step: int) -> list[tf.Tensor]:
    """This rank's gradients at ``step``: the loss ``sum(p * c)`` has gradient ``c``, small
    integers, so every sum of them is exact in float32."""
    gen = np.random.default_rng(1000 * step + hvd_tf.rank())
    return [tf.constant(gen.integers(-8, 9, shape).astype(np.float32))
            for shape in SHAPES.values()]


def _stats(pipeline: Any, hierarchy: str | None) -> dict[str, Any]:
    last = pipeline.last_step
    return {"cross": type(pipeline.comm).__name__,
            "layout": pipeline.layout() if hierarchy else None,
            "collective_bytes": dict(last.collective_bytes),
            "compressed": sorted(pipeline.feedback.report())}


def _tape(spec: str, hierarchy: str | None, first: int, count: int, traced: bool = False,
          start: dict[str, Any] | None = None, ps: str | None = None
          ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """The tape's variables after steps ``first .. first+count-1`` (SGD, learning rate 1),
    from zeros or from ``start`` (variables and this rank's serialized compression state);
    the state to resume from; the exchange's stats. ``ps``: the tape's servers."""
    # A new object per run (Compression.parse("none") is the shared Compression.none): the
    # exchange state belongs to the compression object.
    compression = NoCompression() if spec == "none" else Compression.parse(spec)
    state = compression_state(compression)
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES.items()]
    if start is not None:
        for variable, value in zip(variables, start["variables"]):
            variable.assign(value)
        state.deserialize(start["state"])

    def step(coefficients: list[tf.Tensor]) -> None:
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, coefficients)])
        tape = DistributedGradientTape(tape, compression=compression, policy=POLICY,
                                       hierarchy=hierarchy, ps=ps or "")
        for variable, grad in zip(variables, tape.gradient(loss, variables)):
            variable.assign_sub(grad)

    run = tf.function(step, autograph=False) if traced else step
    for s in range(first, first + count):
        run(_coefficients(s))
    values = {name: v.numpy() for name, v in zip(SHAPES, variables)}
    resume = {"variables": [v.numpy() for v in variables], "state": state.serialize()}
    return values, resume, _stats(state.exchange.pipeline, hierarchy)


def _keras(spec: str, steps: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The Keras optimizer's variables after ``steps`` eager ``apply`` calls (SGD, 1.0)."""
    variables = [keras.Variable(np.zeros(shape, np.float32), name=name)
                 for name, shape in SHAPES.items()]
    optimizer = DistributedOptimizer(keras.optimizers.SGD(1.0),
                                     compression=Compression.parse(spec), policy=POLICY,
                                     hierarchy="host")
    for s in range(steps):
        optimizer.apply(_coefficients(s), variables)
    pipeline = optimizer.hvd_compress_state.exchange.pipeline
    return ({name: np.asarray(v.numpy()) for name, v in zip(SHAPES, variables)},
            _stats(pipeline, "host"))


def steps(specs: list[str], keras_specs: list[str], ps: str | None = None) -> dict[str, Any]:
    """Per tape scheme: the variables after 3 two-level steps under ``tf.function``, after
    steps 1-2 eagerly resumed from each rank's own state after step 0, and (``none``) after
    3 flat steps; top-k's pairs go to the servers ``ps``. Per Keras scheme: the variables
    after 3 two-level steps."""
    out: dict[str, Any] = {"tape": {}, "keras": {}}
    for spec in specs:
        server = ps if spec.startswith("topk") else None
        two, _, stats = _tape(spec, "host", 0, 3, traced=True, ps=server)
        _, state, _ = _tape(spec, "host", 0, 1, ps=server)
        resumed, _, _ = _tape(spec, "host", 1, 2, start=state, ps=server)
        out["tape"][spec] = {"two": two, "resumed": resumed, "stats": stats}
        if spec == "none":
            out["tape"][spec]["flat"] = _tape(spec, None, 0, 3)[0]
    for spec in keras_specs:
        values, stats = _keras(spec, 3)
        out["keras"][spec] = {"two": values, "stats": stats}
    # No rank shuts Horovod down while another host's last all-gather still runs.
    hvd_tf.allreduce(tf.zeros([1]), name="hvdc.test.barrier")
    return out


def main() -> None:
    out_dir, kwargs = Path(sys.argv[1]), json.loads(sys.argv[2])
    init()
    try:
        result = steps(**kwargs)
        (out_dir / f"rank{hvd_tf.rank()}.pkl").write_bytes(pickle.dumps(result))
    finally:
        hvd_tf.shutdown()


if __name__ == "__main__":
    main()
