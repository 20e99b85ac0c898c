"""Rank side of tests/test_elastic_keras.py: examples/elastic_keras_digits.py under
``horovodrun`` elastic, resized by rewriting the discovery script's hosts file at given
steps. Every step every rank's weights are compared (a digest through
``allgather_object``). For a :func:`DistributedOptimizer` scheme, rank 0 also sums what
was applied (every aggregate times the world's size, in the units the ranks submit) and
every gradient submitted (an all-reduce per step), and at the end what the ranks still owe
(chunk residuals folded, summed over the ranks): applied + owed must equal submitted.
Rank 0 writes it all to ``--out``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from examples.elastic_keras_digits import accuracy, build, train
from hvd_compress.tensorflow.elastic import KerasState
from tests.workers.elastic import after_step, parse_resize


def digest(state: KerasState) -> str:
    h = hashlib.sha256()
    for v in state.model.variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheme", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hosts", help="the discovery script's hosts file")
    parser.add_argument("--resize", default="",
                        help="STEP=HOST:SLOTS+HOST:SLOTS;... written by rank 0 at STEP")
    parser.add_argument("--kill-step", type=int, default=-1,
                        help="the worker on --kill-host kills itself (SIGKILL) after the "
                        "backward pass of this step")
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    resize = parse_resize(args.resize)

    hvd.init()
    state = build(args.scheme)
    compression = state.compression
    assert compression is not None
    conserve = not args.scheme.startswith("onebit_adam")
    names = sorted(compression.shapes())
    sums = {"applied": {n: 0.0 for n in names}, "given": {n: 0.0 for n in names}}
    seen: dict = {"sizes": [], "mismatches": [], "checks": 0}

    if conserve:  # every aggregate, in the units the ranks submit
        exchange = compression.exchange
        reduce = exchange.reduce

        def recording(keys, grads):  # type: ignore[no-untyped-def]
            out = reduce(keys, grads)
            for key, agg in zip(keys, out):
                sums["applied"][key] = sums["applied"][key] + agg.numpy().astype(np.float64) \
                    * hvd.size()
            return out

        exchange.reduce = recording

    def hook(state: KerasState, grads: list, where: str) -> None:
        if where == "backward":
            if state.step == args.kill_step \
                    and os.environ.get("HOROVOD_HOSTNAME") == args.kill_host:
                os.kill(os.getpid(), signal.SIGKILL)
            if conserve:
                opt = state.optimizer
                for var, grad in zip(state.model.trainable_variables, grads):
                    key = f"var.{opt._get_variable_index(var)}"
                    total = hvd.allreduce(grad, op=hvd.Sum, name=f"test.given.{key}")
                    sums["given"][key] = sums["given"][key] + total.numpy().astype(np.float64)
            return
        after_step(seen, state, hvd.allgather_object(digest(state)), hvd.rank(),
                   hvd.size(), resize, args.hosts)

    resets = train(state, args.steps, hook=hook)
    result = {"accuracy": accuracy(state.model), "resets": resets, "size": hvd.size(), **seen}
    if conserve:
        compression.fold()
        still = {n: v.double().numpy() for n, v in compression.pool().items()}
        worst, scale = 0.0, 0.0
        for n in names:
            owed = still.get(n, 0.0)
            worst = max(worst, float(np.max(np.abs(sums["applied"][n] + owed
                                                     - sums["given"][n]))))
            scale = max(scale, float(np.max(np.abs(sums["given"][n]))))
        result.update(conservation_error=worst, given_scale=scale,
                      owed_norm=float(sum(np.linalg.norm(v) for v in still.values())))
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    tf.config.threading.set_intra_op_parallelism_threads(1)
    main()
