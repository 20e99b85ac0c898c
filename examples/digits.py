"""Train a small network on scikit-learn's digits with Horovod and a compression scheme.

Launch on 2 ranks (each rank trains on its half of the training set)::

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py --scheme onebit
    mpirun --allow-run-as-root -np 2 python examples/digits.py --scheme qsgd:bits=4

Sparse schemes (top-k, DGC) send their pairs to a parameter server, over gRPC::

    python -m ps_server --workers 2 --bind 127.0.0.1:7070 &
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py \
        --scheme topk:ratio=0.01 --ps grpc://127.0.0.1:7070

or as extra ranks of one MPMD launch, over MPI::

    mpirun --allow-run-as-root --oversubscribe -np 2 python examples/digits.py \
        --scheme topk:ratio=0.01 \
        --ps mpi : -np 1 python -m ps_server --transport mpi --workers 2

Each rank trains on its own GPU (``hvd.local_rank()``'s) when CUDA is available, else on
the CPU; ``--device cpu`` or ``--device cuda`` chooses. Rank 0 prints per-epoch loss, test
accuracy and the bytes its gradients took per step against float32. ``--compare`` first
trains uncompressed with the same seed and epochs, so the two accuracies and byte counts
stand side by side. With DGC, which applies momentum itself, the SGD optimizer runs without
momentum.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import horovod.torch as hvd
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from hvd_compress import Compression, Policy
from hvd_compress.schemes.dgc import DGC
from hvd_compress.torch import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    init,
)


@dataclass
class Result:
    scheme: str
    epochs: int
    test_accuracy: float
    final_loss: float
    payload_bytes_per_step: float
    dense_bytes_per_step: float
    ratio: float
    seconds: float


def load_split(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Digits (1797 8x8 images), scaled to [0, 1], split 80/20 with a fixed seed."""
    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.from_numpy(x_train), torch.from_numpy(y_train),
            torch.from_numpy(x_test), torch.from_numpy(y_test))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def pick_device(choice: str = "auto") -> torch.device:
    """This rank's device: its GPU, ``hvd.local_rank()``'s (made the current CUDA device),
    for ``"cuda"``, or for ``"auto"`` when CUDA is available; otherwise the CPU. Raises
    ``SystemExit`` for ``"cuda"`` without CUDA."""
    if choice not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"--device must be auto, cpu or cuda, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False here; use "
                         "--device cpu")
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def train(scheme: str = "none", epochs: int = 20, batch_size: int = 32, lr: float = 0.25,
          momentum: float = 0.5, seed: int = 0, verbose: bool = False,
          min_numel: int = 1024, ps: str | None = None,
          tensorboard: str | None = None, device: torch.device | str = "cpu") -> Result:
    """Train on this rank's shard, on ``device`` (:func:`pick_device`); every rank returns
    the same test accuracy. ``ps`` is the
    optimizer's ``ps=`` (parameter servers for the sparse schemes). ``verbose``: rank 0
    prints a line per epoch and the run's compression summary. ``tensorboard``: a directory
    where rank 0 logs the compression figures of every 10th step (``<dir>/<scheme>``, with
    ``:`` and ``,`` as ``_``)."""
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_split(seed))
    rank, size = hvd.rank(), hvd.size()
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    model = make_model().to(device)
    compression = Compression.parse(scheme)
    optimizer = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr,
                        momentum=0.0 if isinstance(compression, DGC) else momentum),
        named_parameters=model.named_parameters(), compression=compression,
        policy=Policy(min_numel=min_numel), seed=seed, ps=ps)
    broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(optimizer, root_rank=0)
    writer = None
    if tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(f"{tensorboard}/{scheme.replace(':', '_').replace(',', '_')}")
        optimizer.log_compression_stats(writer, every=10)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(seed + rank)
    steps = len(x_shard) // batch_size
    start = time.perf_counter()
    loss = torch.tensor(0.0, device=device)
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(x_shard), generator=order).to(device)
        for step in range(steps):
            idx = perm[step * batch_size:(step + 1) * batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x_shard[idx]), y_shard[idx])
            loss.backward()
            optimizer.step()
        if verbose and rank == 0:
            stats = optimizer.compression_stats
            print(f"[{scheme}] epoch {epoch + 1:3d}/{epochs}  loss {loss.item():.4f}  "
                  f"test acc {accuracy(model, x_test, y_test):6.2f}%  "
                  f"bytes/step {stats.payload_bytes:,} (fp32 {stats.dense_bytes:,}, "
                  f"{stats.ratio:.1f}x)", flush=True)
    seconds = time.perf_counter() - start
    totals = optimizer.compression_totals
    if writer is not None:
        writer.close()
    if verbose and rank == 0:
        print(f"[{scheme}] {totals}", flush=True)
    n_steps = max(epochs * steps, 1)
    return Result(scheme, epochs, accuracy(model, x_test, y_test), float(loss.item()),
                  totals.payload_bytes / n_steps, totals.dense_bytes / n_steps,
                  totals.ratio, seconds)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return 100.0 * float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="onebit",
                        help="compression scheme, e.g. fp16, onebit, qsgd:bits=4, "
                             "terngrad, powersgd:rank=2, topk:ratio=0.01, "
                             "dgc:ratio=0.001,momentum=0.5 (see Compression.parse)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.25)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="train uncompressed first and print both results")
    parser.add_argument("--ps", default=None,
                        help="parameter servers for top-k/DGC: grpc://HOST:PORT[,HOST:PORT] "
                             "or mpi (default: $HVD_COMPRESS_PS; none: Horovod allgather)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where each rank trains: auto (default) is its own GPU, "
                             "hvd.local_rank()'s, when CUDA is available, else the CPU")
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="log rank 0's compression figures every 10 steps to DIR/<scheme> "
                             "(needs the tensorboard package)")
    args = parser.parse_args()

    init(ps=args.ps)
    torch.set_num_threads(1)
    device = pick_device(args.device)
    schemes = (["none"] if args.compare else []) + [args.scheme]
    results = [train(s, args.epochs, lr=args.lr, momentum=args.momentum, seed=args.seed,
                     verbose=True, ps=args.ps, tensorboard=args.tensorboard, device=device)
               for s in schemes]
    if hvd.rank() == 0:
        print(f"\n{'scheme':<28} {'test acc':>9} {'bytes/step':>12} {'fp32 bytes':>12} "
              f"{'ratio':>7} {'time':>7}")
        for r in results:
            print(f"{r.scheme:<28} {r.test_accuracy:8.2f}% {r.payload_bytes_per_step:12,.0f} "
                  f"{r.dense_bytes_per_step:12,.0f} {r.ratio:6.1f}x {r.seconds:6.1f}s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([asdict(r) for r in results], f, indent=2)


if __name__ == "__main__":
    main()
