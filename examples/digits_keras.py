"""Train a small Keras 3 network on scikit-learn's digits with Horovod's TensorFlow
collectives and a compression scheme.

Launch on 2 ranks (each rank trains on its half of the training set)::

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_keras.py --scheme onebit
    mpirun --allow-run-as-root -np 2 python examples/digits_keras.py --scheme qsgd:bits=4

Sparse schemes (top-k, DGC) send their pairs to a parameter server, over gRPC::

    python -m ps_server --workers 2 --bind 127.0.0.1:7070 &
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_keras.py \
        --scheme topk:ratio=0.01 --ps grpc://127.0.0.1:7070

or as extra ranks of one MPMD launch, over MPI::

    mpirun --allow-run-as-root --oversubscribe -np 2 python examples/digits_keras.py \
        --scheme topk:ratio=0.01 \
        --ps mpi : -np 1 python -m ps_server --transport mpi --workers 2

Rank 0 prints, per epoch and at the end, the loss, test accuracy and the bytes its
gradients took per step against float32; ``--compare`` first trains uncompressed with the
same seed and epochs. The network, data split and hyper-parameters are those of
``examples/digits.py`` (the PyTorch version).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import horovod.tensorflow as hvd
import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from hvd_compress import Compression, Policy
from hvd_compress.schemes.dgc import DGC
from hvd_compress.tensorflow import init
from hvd_compress.tensorflow.keras import (
    BroadcastGlobalVariablesCallback,
    DistributedOptimizer,
)


@dataclass
class KerasResult:
    scheme: str
    test_accuracy: float
    final_loss: float
    ratio: float
    seconds: float


def digits_arrays(seed: int = 0) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test): the 80/20 split of ``examples/digits.py``."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32) / 16.0, digits.target.astype(np.int64), test_size=0.2,
        random_state=seed, stratify=digits.target)
    return x_train, y_train, x_test, y_test


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(10)])


class EpochProgress(keras.callbacks.Callback):
    """After each epoch, on rank 0: the loss, the test accuracy and the bytes the last
    step's gradients took against float32 (the optimizer's ``compression_stats``)."""

    def __init__(self, scheme: str, epochs: int, optimizer: Any, x_test: np.ndarray,
                 y_test: np.ndarray) -> None:
        super().__init__()
        self.scheme, self.epochs, self.optimizer = scheme, epochs, optimizer
        self.x_test, self.y_test = x_test, y_test

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if hvd.rank() != 0:
            return
        stats = self.optimizer.compression_stats
        print(f"[{self.scheme}] epoch {epoch + 1:3d}/{self.epochs}  "
              f"loss {(logs or {}).get('loss', float('nan')):.4f}  "
              f"test acc {accuracy(self.model, self.x_test, self.y_test):6.2f}%  "
              f"bytes/step {stats.payload_bytes:,} (fp32 {stats.dense_bytes:,}, "
              f"{stats.ratio:.1f}x)", flush=True)


def accuracy(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    predicted = np.argmax(model.predict(x, verbose=0), axis=1)
    return 100.0 * float(np.mean(predicted == y))


def train(scheme: str = "none", epochs: int = 20, batch_size: int = 32, lr: float = 0.25,
          momentum: float = 0.5, seed: int = 0, min_numel: int = 1024,
          ps: str | None = None, verbose: bool = False) -> KerasResult:
    """Train with ``model.fit`` on this rank's shard; every rank returns the same accuracy.
    ``ps`` is the optimizer's ``ps=`` (parameter servers for the sparse schemes);
    ``verbose``: rank 0 prints a line per epoch (:class:`EpochProgress`).

    Every rank takes the same number of steps per epoch (the shard is cut to whole batches
    of the smallest shard), as Horovod requires.
    """
    keras.utils.set_random_seed(seed)
    x_train, y_train, x_test, y_test = digits_arrays(seed)
    rank, size = hvd.rank(), hvd.size()
    keep = len(x_train) // size // batch_size * batch_size
    x_shard, y_shard = x_train[rank::size][:keep], y_train[rank::size][:keep]

    compression = Compression.parse(scheme)
    optimizer = DistributedOptimizer(
        keras.optimizers.SGD(lr, momentum=0.0 if isinstance(compression, DGC) else momentum),
        compression=compression, policy=Policy(min_numel=min_numel), seed=seed, ps=ps)
    model = make_model()
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    callbacks: list[keras.callbacks.Callback] = [BroadcastGlobalVariablesCallback(root_rank=0)]
    if verbose:
        callbacks.append(EpochProgress(scheme, epochs, optimizer, x_test, y_test))
    history = model.fit(x_shard, y_shard, batch_size=batch_size, epochs=epochs, verbose=0,
                        callbacks=callbacks)
    seconds = time.perf_counter() - start
    return KerasResult(scheme, accuracy(model, x_test, y_test),
                       float(history.history["loss"][-1]), optimizer.compression_totals.ratio,
                       seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="onebit",
                        help="compression scheme, e.g. fp16, onebit, qsgd:bits=4, powersgd, "
                             "topk:ratio=0.01 (see Compression.parse)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.25)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="train uncompressed first and print both results")
    parser.add_argument("--ps", default=None,
                        help="parameter servers for top-k/DGC: grpc://HOST:PORT[,HOST:PORT] "
                             "or mpi (default: $HVD_COMPRESS_PS; none: Horovod allgather)")
    args = parser.parse_args()

    init(ps=args.ps)
    schemes = (["none"] if args.compare else []) + [args.scheme]
    results = [train(s, args.epochs, lr=args.lr, momentum=args.momentum, seed=args.seed,
                     ps=args.ps, verbose=True) for s in schemes]
    if hvd.rank() == 0:
        print(f"\n{'scheme':<28} {'test acc':>9} {'loss':>8} {'ratio':>7} {'time':>7}")
        for r in results:
            print(f"{r.scheme:<28} {r.test_accuracy:8.2f}% {r.final_loss:8.4f} "
                  f"{r.ratio:6.1f}x {r.seconds:6.1f}s")


if __name__ == "__main__":
    main()
