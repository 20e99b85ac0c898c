"""Rank side of tests/test_elastic_horovodrun.py: examples/elastic_digits.py under
``horovodrun`` elastic, resized by rewriting the discovery script's hosts file at given
steps and with a worker killed (SIGKILL) while its gradients are in flight. Every step
every rank's parameters are compared (a digest through ``allgather_object``); rank 0
writes the accuracy, the resets, the world sizes seen and any mismatch to ``--out``."""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import time

import horovod.torch as hvd
import torch
from horovod.common.elastic import State

from examples.digits import accuracy, load_split
from examples.elastic_digits import build, train
from hvd_compress.torch.elastic import TorchState


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def parse_resize(spec: str) -> dict[int, str]:
    """``STEP=HOST:SLOTS+HOST:SLOTS;...`` as the hosts file's text to write at each step."""
    return {int(step): hosts.replace("+", "\n") + "\n"
            for step, hosts in (item.split("=") for item in spec.split(";") if item)}


def await_notification(state: State, step: int, timeout: float = 120.0) -> None:
    """Block until the driver's hosts-updated notification has reached this worker, so the
    next commit acts on it. The driver runs the discovery script about once a second, but
    on a loaded machine (the suite beside other jobs) a fixed sleep was not always enough:
    the resize once landed a commit late. Horovod queues the notification in the state's
    ``_host_messages`` (horovod/common/elastic.py); rank 0's queue is what the commit
    broadcasts."""
    deadline = time.monotonic() + timeout
    while state._host_messages.empty():
        if time.monotonic() > deadline:
            raise RuntimeError(f"step {step}: rewrote the hosts file, but no hosts-updated "
                               f"notification reached rank 0 within {timeout:.0f} s")
        time.sleep(0.05)


def after_step(seen: dict, state: State, digests: list[str], rank: int, size: int,
               resize: dict[int, str], hosts: str | None) -> None:
    """Record in ``seen`` whether every rank's digest agreed and the world's size; rank 0
    rewrites the hosts file at the steps of ``resize`` and waits until the driver has
    noticed."""
    step = state.step
    seen["checks"] += 1
    if len(set(digests)) != 1:
        seen["mismatches"].append(step)
    if not seen["sizes"] or seen["sizes"][-1][1] != size:
        seen["sizes"].append((step, size))
    if rank == 0 and step in resize and hosts:
        with open(hosts, "w") as f:
            f.write(resize[step])
        await_notification(state, step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheme", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hosts", help="the discovery script's hosts file")
    parser.add_argument("--resize", default="",
                        help="STEP=HOST:SLOTS+HOST:SLOTS;... written by rank 0 at STEP")
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--ps", default=None)
    parser.add_argument("--ps-workers", type=int, default=None)
    parser.add_argument("--pool-on-commit", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    resize = parse_resize(args.resize)

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run's stacks
    hvd.init()
    torch.set_num_threads(1)
    state = build(args.scheme, 0.1, 0.5, 0, args.ps, args.pool_on_commit, args.ps_workers)
    seen = {"sizes": [], "mismatches": [], "checks": 0}

    def hook(state: TorchState, where: str) -> None:
        host = os.environ.get("HOROVOD_HOSTNAME")
        if where == "backward":
            if state.step == args.kill_step and host == args.kill_host:
                os.kill(os.getpid(), signal.SIGKILL)
            return
        after_step(seen, state, hvd.allgather_object(digest(state.model)), hvd.rank(),
                   hvd.size(), resize, args.hosts)

    resets = train(state, args.steps, hook=hook)
    _, _, x_test, y_test = load_split(0)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"accuracy": accuracy(state.model, x_test, y_test),
                       "resets": resets, "size": hvd.size(), **seen}, f)


if __name__ == "__main__":
    main()
