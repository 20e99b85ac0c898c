"""The ``faults`` campaign: workers and servers killed, stopped and cut off mid-round
(see :mod:`hvd_compress.bench.reliability`)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from hvd_compress.bench.launch import ROOT, process_env
from hvd_compress.bench.reliability.common import (
    Progress,
    fresh,
    judge,
    run_threads,
    servers,
    tally,
    train,
)


def worker_kill_trial(work: Path, seed: int, rounds: int) -> dict[str, Any]:
    """Worker 1 is a process SIGKILLed after a random number of rounds plus a random
    delay (often mid-push or mid-pull); worker 0 must stop with one clear error."""
    rng = random.Random(seed)
    deadline = 3.0
    with servers(work, ("wk", ["--workers", "2", "--deadline", str(deadline)], {})) as (srv,):
        victim = subprocess.Popen(
            [sys.executable, "-m", "hvd_compress.bench.reliability", "_worker", srv.address,
             "1", str(rounds), str(seed)], cwd=ROOT, env=process_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        if victim.stdout.readline().strip() != "ready":  # its imports take seconds
            raise RuntimeError("the worker process failed to start")
        victim.stdin.write("go\n")
        victim.stdin.flush()
        progress = Progress()
        box: list[dict[str, Any]] = []
        thread = threading.Thread(target=lambda: box.append(
            train(srv.address, 0, rounds, seed, progress)), daemon=True)
        thread.start()
        at = rng.randint(3, rounds // 2)
        progress.wait_for(at, 120)
        time.sleep(rng.uniform(0, 0.02))
        victim.kill()
        killed = time.monotonic()
        victim.wait()
        thread.join(deadline + 60)
        result = box[0] if box else {"hung": True, "applied": [], "error": None}
    outcome, detail = judge([result], rounds)
    if outcome == "exact":
        outcome, detail = "wrong-sum", "worker 0 finished although worker 1 was killed"
    error = result.get("error") or {}
    return {"seed": seed, "killed_after_round": at, "outcome": outcome, "detail": detail,
            "error_code": error.get("code"),
            "error_s_after_kill": round(time.monotonic() - killed, 2) if error else None,
            "names_worker_1": "worker 1 did not push" in error.get("message", "")}


def worker_main(argv: list[str]) -> None:
    """``_worker ADDRESS WORKER ROUNDS SEED``: one worker of :func:`train` as a process;
    prints ``ready`` once imported and starts when a line comes on its standard input."""
    import torch  # noqa: F401 (the import that takes seconds, before ready)

    address, worker, rounds, seed = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(train(address, worker, rounds, seed)), flush=True)


def server_kill_trial(work: Path, seed: int, rounds: int, fault: str | None) -> dict[str, Any]:
    """The server dies (SIGKILL from here at a random round, or by itself at ``fault`` =
    ``STEP:N``) and is restarted on its port 1 s later from its checkpoint."""
    rng = random.Random(seed)
    args = ["--workers", "2", "--deadline", "30", "--checkpoint-dir", str(work / "ckpt"),
            "--checkpoint-every", "5"]
    with servers(work, ("sk", args, {"env": {"HVD_COMPRESS_PS_FAULT": fault} if fault
                                     else None})) as (srv,):
        progress = Progress()
        stop = threading.Event()
        restarts = [0]
        at = rng.randint(2, rounds - 3)

        def killer() -> None:
            if fault is None and progress.wait_for(at, 120):
                time.sleep(rng.uniform(0, 0.01))
                srv.signal(signal.SIGKILL)
            while not stop.is_set():
                if not srv.alive():
                    srv.proc.wait()
                    time.sleep(1.0)
                    srv.start()
                    restarts[0] += 1
                stop.wait(0.05)

        watcher = threading.Thread(target=killer, daemon=True)
        watcher.start()
        results = run_threads([lambda w=w: train(srv.address, w, rounds, seed, progress)
                               for w in range(2)], 240)
        stop.set()
        watcher.join()
        resumed = srv.text().count("resumed from")
    outcome, detail = judge(results, rounds)
    if not restarts[0]:
        outcome, detail = "not-reached", "the server was never killed"
    return {"seed": seed, "fault": fault or f"SIGKILL after round {at}", "outcome": outcome,
            "detail": detail, "restarts": restarts[0], "resumed": resumed}


def freeze_trial(work: Path, seed: int, rounds: int) -> dict[str, Any]:
    """The server is stopped (SIGSTOP) for 1.5 to 3 times its 2 s deadline at a random
    round, then continued."""
    rng = random.Random(seed)
    deadline = 2.0
    with servers(work, ("fr", ["--workers", "2", "--deadline", str(deadline)], {})) as (srv,):
        progress = Progress()
        at, frozen = rng.randint(2, rounds - 3), rng.uniform(1.5, 3.0) * deadline

        def freezer() -> None:
            if progress.wait_for(at, 120):
                srv.signal(signal.SIGSTOP)
                time.sleep(frozen)
                srv.signal(signal.SIGCONT)

        threading.Thread(target=freezer, daemon=True).start()
        results = run_threads([lambda w=w: train(srv.address, w, rounds, seed, progress)
                               for w in range(2)], 180)
        srv.signal(signal.SIGCONT)
        moved = "deadlines move by as much" in srv.text()
    outcome, detail = judge(results, rounds)
    return {"seed": seed, "frozen_s": round(frozen, 2), "after_round": at,
            "outcome": outcome, "detail": detail, "server_saw_freeze": moved}


def link_trials(work: Path, trials: int, rounds: int) -> list[dict[str, Any]]:
    """The server on an emulated host. Even trials: its link is a token bucket of 1 Mbit/s
    whose queue holds 2 ms (``tbf ... latency 2ms``), so bursts lose packets (counted by
    the kernel and reported); odd trials: its interface goes down for 1-4 s at a random
    round (a stalled link: every packet meanwhile is lost). (``netem`` would be the usual
    tool; this kernel has no ``sch_netem``, so the loss comes from the token bucket.)"""
    from hvd_compress.bench.hosts import INTERFACE, emulated_hosts, host_namespace

    out = []
    with emulated_hosts(1, "1gbit") as addresses:
        ns = host_namespace(0)

        def shape(*tbf: str) -> None:
            subprocess.run(["tc", "-n", ns, "qdisc", "change", "dev", INTERFACE, "root",
                            "tbf", *tbf], check=True, capture_output=True)

        def dropped() -> int:
            text = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", INTERFACE],
                                  capture_output=True, text=True).stdout
            return sum(map(int, re.findall(r"dropped (\d+)", text)))

        for trial in range(trials):
            seed = 9000 + trial
            rng = random.Random(seed)
            kw = {"host": addresses[0], "prefix": ("ip", "netns", "exec", ns)}
            with servers(work, (f"net{trial}", ["--workers", "2", "--deadline", "5"], kw)
                         ) as (srv,):
                progress = Progress()
                drops = dropped()
                if trial % 2 == 0:
                    what = "tbf 1mbit, 2 ms queue (lossy)"
                    shape("rate", "1mbit", "burst", "2kb", "latency", "2ms")
                else:
                    at, stall = rng.randint(2, rounds - 3), rng.uniform(1.0, 4.0)
                    what = f"link down {stall:.1f} s after round {at}"

                    def staller(at: int = at, stall: float = stall,
                                progress: Progress = progress) -> None:
                        if progress.wait_for(at, 120):
                            subprocess.run(["ip", "-n", ns, "link", "set", INTERFACE, "down"],
                                           check=True)
                            time.sleep(stall)
                            subprocess.run(["ip", "-n", ns, "link", "set", INTERFACE, "up"],
                                           check=True)

                    threading.Thread(target=staller, daemon=True).start()
                results = run_threads(
                    [partial(train, srv.address, w, rounds, seed, progress, timeout=30.0,
                             retry_timeout=30.0) for w in range(2)], 240)
                drops = dropped() - drops
                shape("rate", "1gbit", "burst", "500kb", "latency", "100ms")
            outcome, detail = judge(results, rounds)
            out.append({"seed": seed, "link": what, "outcome": outcome, "detail": detail,
                        "packets_dropped": drops})
    return out


def faults(work: Path, trials: int, rounds: int) -> dict[str, Any]:
    from ps_server.checkpoint import FAULT_STEPS

    print("faults (2 workers x 2 tensors, integer-valued pushes):", flush=True)
    report: dict[str, Any] = {}
    report["worker_kill"] = tally("worker SIGKILL mid-round", [
        worker_kill_trial(fresh(work, f"wk{i}"), 100 + i, rounds) for i in range(trials)])
    report["server_kill_random"] = tally("server SIGKILL + restart", [
        server_kill_trial(fresh(work, f"sk{i}"), 200 + i, rounds, None)
        for i in range(trials)])
    for step in FAULT_STEPS:
        rng = random.Random(step)
        top = 4 if step.startswith("snapshot") else 25
        report[f"server_kill_at_{step}"] = tally(f"server killed at {step}", [
            server_kill_trial(fresh(work, f"{step}{i}"), 300 + i, rounds,
                              f"{step}:{rng.randint(2, top)}") for i in range(trials)])
    report["freeze"] = tally("server SIGSTOP > deadline", [
        freeze_trial(fresh(work, f"fr{i}"), 400 + i, rounds) for i in range(trials)])
    if os.geteuid() == 0:
        report["link"] = tally("lossy / stalled link",
                                link_trials(fresh(work, "net"), trials, rounds))
    else:
        print("  link trials skipped: they need root (network namespaces)", flush=True)
    return report


