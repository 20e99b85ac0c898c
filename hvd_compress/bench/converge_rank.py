"""One rank of ``bench converge``: trains every configuration of the plan, one after the
other, in this process.

Run by :mod:`hvd_compress.bench.converge` under ``horovodrun --gloo``, never by hand. For
each configuration the rank builds a fresh model from the plan's seed (the same weights on
every rank), wraps its optimizer for the configuration and trains the task's steps on its
own batches (drawn from a generator seeded by the seed and the rank, so every
configuration sees the same batches). Every ``eval_every`` steps, and after the last, the
ranks evaluate the held-out set together (each its share, summed by an all-reduce). Rank 0
writes one row per configuration and a progress line per evaluation. A configuration
with a ``ps`` address (a server :mod:`hvd_compress.bench.converge` started for it) sends
its sparse pairs to that server (``DistributedOptimizer(..., ps=...)``).

Tasks:

- ``lm``: a character-level transformer language model (:class:`CharTransformer`) on the
  text of CPython's ``pydoc_data.topics`` (about 465,000 characters of English), trained
  with AdamW (or 1-bit Adam); the last :data:`VALIDATION_FRACTION` of the text is the
  held-out set, scored as mean cross-entropy per character (nats) over all of it.
- ``digits``: scikit-learn's digits with the ``64-128-128-10`` MLP of
  :mod:`hvd_compress.bench.cluster_rank`, trained with SGD; the held-out set is that
  module's fixed 20% test split (360 images), scored by accuracy and loss.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvd_compress.bench.cluster_rank import digits_shard, make_model
from hvd_compress.bench.models import CharTransformer

VALIDATION_FRACTION = 0.1
"""The held-out share of the text: its last tenth (a fixed split, never trained on)."""
DIGITS_WIDTHS = (64, 128, 128, 10)
"""The digits MLP's layer widths (the convergence tests' model)."""

UNRELATED_WARNING = "The given NumPy array is not writable"
"""torch's warning when the sparse frames gathered by Horovod (read-only bytes) are viewed
as tensors: they are only read, and it says nothing about convergence."""

Batch = tuple[torch.Tensor, torch.Tensor]


def corpus() -> str:
    """The text of every topic of ``pydoc_data.topics``, in sorted key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class Task(ABC):
    """A model, this rank's training batches and the held-out score, for one task."""

    name: str
    classes: int

    @abstractmethod
    def model(self, seed: int) -> nn.Module:
        ...

    @abstractmethod
    def batch(self, generator: torch.Generator) -> Batch:
        ...

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        ...

    @abstractmethod
    def held_out(self) -> list[Batch]:
        """This rank's share of the held-out set, in batches."""

    def score(self, model: nn.Module, tag: str) -> dict[str, float]:
        """Mean loss (and accuracy, for a classifier) over the whole held-out set: each rank
        scores its share, one all-reduce sums them."""
        import horovod.torch as hvd

        totals = torch.zeros(3, dtype=torch.float64)
        model.eval()
        with torch.no_grad():
            for x, y in self.held_out():
                logits = model(x).reshape(-1, self.classes)
                target = y.reshape(-1)
                totals[0] += nn.functional.cross_entropy(logits, target,
                                                         reduction="sum").item()
                totals[1] += (logits.argmax(1) == target).sum().item()
                totals[2] += target.numel()
        model.train()
        totals = hvd.allreduce(totals, op=hvd.Sum, name=f"converge.score.{tag}")
        return {"loss": float(totals[0] / totals[2]), "accuracy": float(totals[1] / totals[2])}


class LanguageModel(Task):
    """Next-character prediction on :func:`corpus`: random windows of ``context + 1``
    characters from the training part (each rank its own), the held-out part cut into
    consecutive windows split between the ranks."""

    name = "lm"

    def __init__(self, settings: dict[str, Any], rank: int, size: int) -> None:
        text = corpus()
        chars = sorted(set(text))
        ids = _encode(text, chars)
        cut = int(len(ids) * (1 - VALIDATION_FRACTION))
        self.train_ids, val = ids[:cut], ids[cut:]
        self.context, self.batch_size = settings["context"], settings["batch"]
        self.d, self.layers = settings["d"], settings["layers"]
        self.classes = len(chars)
        windows = (len(val) - 1) // self.context
        starts = torch.arange(windows) * self.context
        mine = starts[rank::size]
        offsets = torch.arange(self.context + 1)
        chunks = val[mine.unsqueeze(1) + offsets]
        self._held_out = [(c[:, :-1], c[:, 1:]) for c in chunks.split(64)]

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return CharTransformer(self.classes, self.context, self.d, self.layers)

    def batch(self, generator: torch.Generator) -> Batch:
        starts = torch.randint(len(self.train_ids) - self.context - 1, (self.batch_size,),
                               generator=generator)
        chunk = self.train_ids[starts.unsqueeze(1) + torch.arange(self.context + 1)]
        return chunk[:, :-1], chunk[:, 1:]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x).reshape(-1, self.classes), y.reshape(-1))

    def held_out(self) -> list[Batch]:
        return self._held_out


def _encode(text: str, chars: list[str]) -> torch.Tensor:
    """``text`` as indices into ``chars`` (a sorted lookup of its code points)."""
    import numpy as np

    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = {ord(c): i for i, c in enumerate(chars)}
    keys = np.array(sorted(table), dtype=np.uint32)
    values = np.array([table[k] for k in keys], dtype=np.int64)
    return torch.from_numpy(values[np.searchsorted(keys, codes)])


class Digits(Task):
    """scikit-learn's digits: random batches of this rank's training shard; the test set
    split between the ranks."""

    name = "digits"
    classes = 10

    def __init__(self, settings: dict[str, Any], rank: int, size: int) -> None:
        self.x, self.y, x_test, y_test = digits_shard(rank, size)
        self.batch_size = settings["batch"]
        self._held_out = [(x_test[rank::size], y_test[rank::size])]

    def model(self, seed: int) -> nn.Module:
        return make_model(DIGITS_WIDTHS, seed)

    def batch(self, generator: torch.Generator) -> Batch:
        idx = torch.randint(len(self.x), (self.batch_size,), generator=generator)
        return self.x[idx], self.y[idx]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def held_out(self) -> list[Batch]:
        return self._held_out


TASKS: dict[str, Callable[[dict[str, Any], int, int], Task]] = {
    "lm": LanguageModel, "digits": Digits}


def schedule(step: int, steps: int, warmup: int, final: float) -> float:
    """The learning-rate factor at ``step``: linear warm-up over ``warmup`` steps, then a
    cosine from 1 down to ``final`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: nn.Module, config: dict[str, Any]) -> torch.optim.Optimizer:
    """The configuration's optimizer: ``adamw`` or ``sgd`` wrapped by
    :func:`hvd_compress.torch.DistributedOptimizer` with ``Compression.parse(scheme)``, the
    configuration's :class:`~hvd_compress.Policy` and its parameter server (``ps``, a
    ``grpc://`` address, or none), or :class:`OneBitAdam`."""
    import hvd_compress.torch as hvdc
    from hvd_compress import Compression, Policy

    options = dict(config["optimizer"])
    kind = options.pop("kind")
    policy = Policy(**config.get("policy", {}))
    if kind in ("onebit_adam", "zero_one_adam"):
        optimizer = hvdc.OneBitAdam if kind == "onebit_adam" else hvdc.ZeroOneAdam
        return optimizer(model.parameters(), named_parameters=model.named_parameters(),
                         policy=policy, **options)
    inner = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind](model.parameters(),
                                                                     **options)
    return hvdc.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                     compression=Compression.parse(config["scheme"]),
                                     policy=policy, ps=config.get("ps"))


def _checksum(model: nn.Module) -> torch.Tensor:
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


def run_config(task: Task, settings: dict[str, Any], config: dict[str, Any], seed: int,
               rank: int, tag: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Train one configuration; its row (every rank computes it, rank 0 keeps it)."""
    import horovod.torch as hvd

    steps, every = settings["steps"], settings["eval_every"]
    model = task.model(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = build_optimizer(model, config)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: schedule(s, steps, settings["lr_warmup"],
                                          settings["lr_final"]))
        generator = torch.Generator().manual_seed(seed * 1000 + rank + 1)
        curve: list[dict[str, float]] = []
        sent = dense = 0
        per_step: list[int] = []
        window: list[float] = []
        start = time.perf_counter()
        for step in range(steps):
            optimizer.zero_grad()
            loss = task.loss(model, task.batch(generator))
            loss.backward()
            optimizer.step()
            scheduler.step()
            window.append(loss.item())
            stats = optimizer.compression_stats
            per_step.append(int(stats.payload_bytes))
            sent += stats.payload_bytes
            dense += stats.dense_bytes
            if (step + 1) % every == 0 or step + 1 == steps:
                score = task.score(model, f"{tag}.{step}")
                train = hvd.allreduce(torch.tensor([sum(window) / len(window)]),
                                      name=f"converge.train.{tag}.{step}").item()
                window = []
                curve.append({"step": step + 1, "loss": score["loss"],
                              "accuracy": score["accuracy"], "train_loss": train,
                              "bytes": sent})
                shown = f"accuracy {100 * score['accuracy']:.2f}%, " \
                    if task.name == "digits" else ""
                progress(f"{task.name} {config['name']}: step {step + 1}/{steps}, held-out "
                         f"loss {score['loss']:.4f}, {shown}train loss {train:.4f}, "
                         f"{sent / (step + 1) / 1e3:.1f} kB/step, "
                         f"{time.perf_counter() - start:.0f} s")
        seconds = time.perf_counter() - start
    local = _checksum(model)
    gathered = hvd.allgather(local.unsqueeze(0), name=f"converge.check.{tag}")
    agree = all(torch.equal(g, gathered[0]) for g in gathered.unbind(0))
    after = config.get("warmup_steps", 0)
    tail = per_step[after:] or per_step
    return {"task": task.name, "name": config["name"], "scheme": config.get("scheme"),
            "ps_mode": config.get("ps_mode"),
            "optimizer": config["optimizer"], "policy": config.get("policy", {}),
            "warmup_steps": after, "steps": steps, "seconds": seconds,
            "final_loss": curve[-1]["loss"], "final_accuracy": curve[-1]["accuracy"],
            "bytes_per_step": sent / steps, "dense_bytes_per_step": dense / steps,
            "bytes_per_step_after_warmup": sum(tail) / len(tail),
            "curve": curve, "replicas_agree": agree,
            "warnings": sorted({f"{w.category.__name__}: {str(w.message)[:240]}"
                                for w in caught if issubclass(w.category, UserWarning)
                                and not str(w.message).startswith(UNRELATED_WARNING)})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", type=Path, required=True, help="the plan, as JSON")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes rows here")
    parser.add_argument("--progress", type=Path, required=True,
                        help="rank 0 appends a line per evaluation here")
    args = parser.parse_args()
    import horovod.torch as hvd

    import hvd_compress.torch as hvdc

    plan = json.loads(args.plan.read_text())
    torch.set_num_threads(1)
    hvdc.init()
    rank, size = hvd.rank(), hvd.size()

    def progress(text: str) -> None:
        if rank == 0:
            with args.progress.open("a") as sink:
                sink.write(text + "\n")

    tasks: dict[str, Task] = {}
    rows = []
    for index, config in enumerate(plan["configs"]):
        name = config["task"]
        if name not in tasks:
            tasks[name] = TASKS[name](plan["tasks"][name], rank, size)
        rows.append(run_config(tasks[name], plan["tasks"][name], config, plan["seed"], rank,
                               str(index), progress))
        if rank == 0:
            args.out.write_text(json.dumps(rows, indent=2))
    hvd.shutdown()


if __name__ == "__main__":
    main()
