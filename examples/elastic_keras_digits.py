"""Elastic training with Keras 3 on scikit-learn's digits: workers may come and go.

Launch with Horovod's elastic mode, as examples/elastic_digits.py (the PyTorch one)::

    printf '#!/bin/sh\\ncat /tmp/hosts\\n' > /tmp/discover.sh && chmod +x /tmp/discover.sh
    echo localhost:2 > /tmp/hosts
    horovodrun -np 2 --min-np 2 --max-np 3 --host-discovery-script /tmp/discover.sh \\
        --network-interface lo --gloo python examples/elastic_keras_digits.py --scheme onebit

``printf 'localhost:2\\n127.0.0.1:1\\n' > /tmp/hosts`` adds a worker at the next commit,
``echo localhost:2 > /tmp/hosts`` removes it. The model, the optimizer's variables and the
compression state travel in :class:`hvd_compress.tensorflow.elastic.KerasState`;
docs/elastic.md says what happens to each at a resize. ``--scheme onebit_adam`` trains with
:class:`hvd_compress.tensorflow.keras.OneBitAdam` instead (its frozen variance is one of
its Keras variables).

Each step every rank draws its batch from its shard of the training set (``rank::size``
of the current world) with a generator seeded by the step. The loop runs eagerly (a
``tf.GradientTape`` and ``optimizer.apply``); rank 0 prints the test accuracy at the end.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvd_compress import Compression, Policy
from hvd_compress.tensorflow.elastic import KerasState, run
from hvd_compress.tensorflow.keras import DistributedOptimizer, OneBitAdam

try:
    from examples.digits import load_split
    from examples.elastic_digits import count_resets, report
except ImportError:  # run as a script: examples/ itself is on sys.path
    from digits import load_split  # type: ignore[no-redef]
    from elastic_digits import count_resets, report  # type: ignore[no-redef]

StepHook = Callable[[KerasState, list, str], None]
"""Called on every rank with the state, the step's local gradients and ``"backward"``
(before ``optimizer.apply``) or ``"step"`` (after it): tests use it to resize the job and
to check the replicas."""


def build(scheme: str, lr: float = 0.1, seed: int = 0, pool_on_commit: bool = False
          ) -> KerasState:
    """The model, its optimizer and their elastic state (step 0)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    if scheme.startswith("onebit_adam"):
        optimizer = OneBitAdam(learning_rate=lr / 50, freeze_step=10, seed=seed)
    else:
        optimizer = DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr),
                                         compression=Compression.parse(scheme),
                                         policy=Policy(min_numel=256), seed=seed)
    return KerasState(model, optimizer, pool_on_commit=pool_on_commit, step=0)


def train(state: KerasState, steps: int, batch_size: int = 32, seed: int = 0,
          commit_every: int = 5, hook: StepHook | None = None) -> int:
    """``steps`` optimizer steps whatever the world's size, committing every
    ``commit_every`` steps. Returns the number of resets this process went through."""
    x_train, y_train, _, _ = (t.numpy() for t in load_split(seed))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @run
    def loop(state: KerasState) -> None:
        while state.step < steps:
            rank, size = hvd.rank(), hvd.size()
            x_shard, y_shard = x_train[rank::size], y_train[rank::size]
            gen = np.random.default_rng(seed * 1_000_003 + state.step * 101 + rank)
            idx = gen.integers(0, len(x_shard), batch_size)
            variables = state.model.trainable_variables
            with tf.GradientTape() as tape:
                loss = loss_fn(y_shard[idx], state.model(x_shard[idx], training=True))
            grads = tape.gradient(loss, variables)
            if hook is not None:
                hook(state, grads, "backward")
            state.optimizer.apply(grads, variables)
            state.step += 1
            if hook is not None:
                hook(state, grads, "step")
            if state.step % commit_every == 0:
                state.commit()

    return count_resets(state, loop)


def accuracy(model: keras.Model, seed: int = 0) -> float:
    """Test accuracy in percent on the held-out digits."""
    _, _, x_test, y_test = (t.numpy() for t in load_split(seed))
    predicted = np.argmax(np.asarray(model(x_test, training=False)), axis=1)
    return 100.0 * float(np.mean(predicted == y_test))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="onebit",
                        help="compression scheme (see Compression.parse), or onebit_adam")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--pool-on-commit", action="store_true",
                        help="pool the owed state at every commit (one all-reduce each)")
    parser.add_argument("--json", help="write rank 0's result to this file")
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    state = build(args.scheme, args.lr, args.seed, args.pool_on_commit)
    resets = train(state, args.steps, seed=args.seed, commit_every=args.commit_every)
    acc = accuracy(state.model, args.seed)
    if hvd.rank() == 0:
        report(args.scheme, args.steps, resets, hvd.size(), acc, args.json)


if __name__ == "__main__":
    main()
