"""Elastic training on scikit-learn's digits: workers may come and go during the run.

Launch with Horovod's elastic mode; the discovery script prints ``host:slots`` lines and
may print others while the job runs::

    printf '#!/bin/sh\\ncat /tmp/hosts\\n' > /tmp/discover.sh && chmod +x /tmp/discover.sh
    echo localhost:2 > /tmp/hosts
    horovodrun -np 2 --min-np 2 --max-np 3 --host-discovery-script /tmp/discover.sh \\
        --network-interface lo --gloo python examples/elastic_digits.py --scheme powersgd

(``--network-interface`` spares Horovod's interface check, which otherwise waits for a
second host.) Top-k through parameter servers: start them with ``--workers`` equal to
``--max-np`` and pass ``--scheme topk:ratio=0.01 --ps grpc://127.0.0.1:7070
--ps-workers 3``. ``echo "localhost:2
127.0.0.1:1" > /tmp/hosts`` adds a worker at the next commit, writing ``localhost:2``
again removes it; a worker killed outright is dropped and the others go on from the last
commit. The model, the SGD state and the compression state (residuals, PowerSGD's ``Q``)
travel in :class:`hvd_compress.torch.elastic.TorchState` (``--scheme onebit_adam``:
:class:`hvd_compress.torch.OneBitAdam`, its frozen variance with its Adam state);
docs/elastic.md says what happens to each at a resize.

Each step every rank draws its batch from its shard of the training set (``rank::size``
of the current world) with a generator seeded by the step, so a step recomputed after a
failure uses the same batches. Rank 0 prints the test accuracy at the end.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from hvd_compress import Compression, Policy
from hvd_compress.schemes.dgc import DGC
from hvd_compress.torch import DistributedOptimizer, OneBitAdam
from hvd_compress.torch.elastic import TorchState

try:
    from examples.digits import accuracy, load_split, make_model
except ImportError:  # run as a script: examples/ itself is on sys.path
    from digits import accuracy, load_split, make_model  # type: ignore[no-redef]

StepHook = Callable[[TorchState, str], None]
"""Called with the state and ``"backward"`` (gradients in flight) or ``"step"`` (after
``optimizer.step()``), on every rank: tests use it to resize the job or kill a worker."""


def build(scheme: str, lr: float, momentum: float, seed: int, ps: str | None,
          pool_on_commit: bool, ps_workers: int | None = None) -> TorchState:
    """The model, its :func:`DistributedOptimizer` and their elastic state (step 0).
    ``ps_workers``: the servers' ``--workers`` (``--max-np``) when ``ps`` is given."""
    torch.manual_seed(seed)
    model = make_model()
    if scheme == "onebit_adam":  # exchanges by itself; its variance freezes at step 10
        adam = OneBitAdam(model.parameters(), lr=lr / 50, freeze_step=10,
                          named_parameters=model.named_parameters(), seed=seed)
        return TorchState(model, adam, pool_on_commit=pool_on_commit, step=0)
    compression = Compression.parse(scheme)
    optimizer = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr,
                        momentum=0.0 if isinstance(compression, DGC) else momentum),
        named_parameters=model.named_parameters(), compression=compression,
        policy=Policy(min_numel=1024), seed=seed, ps=ps)
    return TorchState(model, optimizer, pool_on_commit=pool_on_commit, ps_workers=ps_workers,
                      step=0)


def train(state: TorchState, steps: int, batch_size: int = 32, seed: int = 0,
          commit_every: int = 5, hook: StepHook | None = None) -> int:
    """``steps`` optimizer steps in total whatever the world's size, committing every
    ``commit_every`` steps (a resize or a failure goes back at most that far). Returns the
    number of resets this process went through."""
    x_train, y_train, _, _ = load_split(seed)
    loss_fn = nn.CrossEntropyLoss()

    @hvd.elastic.run
    def loop(state: TorchState) -> None:
        while state.step < steps:
            rank, size = hvd.rank(), hvd.size()
            x_shard, y_shard = x_train[rank::size], y_train[rank::size]
            gen = torch.Generator().manual_seed(seed * 1_000_003 + state.step * 101 + rank)
            idx = torch.randint(len(x_shard), (batch_size,), generator=gen)
            state.optimizer.zero_grad()
            loss_fn(state.model(x_shard[idx]), y_shard[idx]).backward()
            if hook is not None:
                hook(state, "backward")
            state.optimizer.step()
            state.step += 1
            if hook is not None:
                hook(state, "step")
            if state.step % commit_every == 0:
                state.commit()

    return count_resets(state, loop)


def count_resets(state: Any, loop: Callable[[Any], None]) -> int:
    """Run the elastic function ``loop`` on ``state``; the number of resets this process
    went through (counted outside the state: a restore would roll it back)."""
    resets = [0]
    state.register_reset_callbacks([lambda: resets.__setitem__(0, resets[0] + 1)])
    loop(state)
    return resets[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="powersgd:rank=2,start_iter=0",
                        help="compression scheme (see Compression.parse), or onebit_adam "
                             "for hvd_compress.torch.OneBitAdam")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--ps", default=None,
                        help="parameter servers for top-k/DGC (grpc://HOST:PORT,...), "
                             "started with --workers equal to --max-np")
    parser.add_argument("--ps-workers", type=int, default=None,
                        help="the servers' --workers (horovodrun's --max-np)")
    parser.add_argument("--pool-on-commit", action="store_true",
                        help="pool the owed state at every commit, so that a killed "
                             "worker's is not lost (one all-reduce per commit)")
    parser.add_argument("--json", help="write rank 0's result to this file")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    state = build(args.scheme, args.lr, args.momentum, args.seed, args.ps,
                  args.pool_on_commit, args.ps_workers)
    resets = train(state, args.steps, seed=args.seed, commit_every=args.commit_every)
    _, _, x_test, y_test = load_split(args.seed)
    if hvd.rank() == 0:
        report(args.scheme, args.steps, resets, hvd.size(),
               accuracy(state.model, x_test, y_test), args.json)


def report(scheme: str, steps: int, resets: int, size: int, acc: float,
           json_path: str | None) -> None:
    """Print rank 0's result, and write it to ``json_path`` as JSON if given."""
    print(f"[{scheme}] {steps} steps, {resets} resets, final world {size}: test acc "
          f"{acc:.2f}%", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"scheme": scheme, "accuracy": acc, "resets": resets, "size": size}, f)


if __name__ == "__main__":
    main()
