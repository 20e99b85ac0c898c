"""``python -m hvd_compress.launch``: start one Horovod (Gloo) rank per host without SSH.

``horovodrun`` reaches every host over SSH and starts the ranks itself. Where each rank is
started by something else instead (one container per worker in ``docker/compose.yaml``, a
job scheduler), every host runs::

    python -m hvd_compress.launch --hosts worker0,worker1 --index I -- python train.py ...

Host ``--index 0`` serves Horovod's Gloo rendezvous on ``--port`` (default 29400) with
the same slot plan ``horovodrun -H worker0:1,worker1:1`` would make (``--slots`` ranks per
host, default 1); every host then runs its ranks with the environment ``horovodrun`` gives
them (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_HOSTNAME``, ``HOROVOD_GLOO_*``...),
so ``hvd.init()`` works unchanged. ``--iface`` (default ``eth0``, a container's interface)
is the network interface Gloo uses. Host 0 keeps the rendezvous up until its own ranks
exit; the exit status is the first failing rank's, else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvd_compress.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", required=True,
                   help="comma-separated host names, the same list and order on every host")
    p.add_argument("--index", type=int, required=True, help="this host's position in --hosts")
    p.add_argument("--slots", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--port", type=int, default=29400,
                   help="rendezvous port on the first host (default 29400)")
    p.add_argument("--iface", default="eth0",
                   help="network interface for Gloo's connections (default eth0)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training command, after --")
    args = p.parse_args(argv)
    args.hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("give the training command after --, e.g. -- python train.py")
    if not 0 <= args.index < len(args.hosts):
        p.error(f"--index {args.index} is not a position in --hosts {','.join(args.hosts)}")
    if args.slots < 1:
        p.error(f"--slots must be at least 1, got {args.slots}")
    return args


def main(argv: list[str] | None = None) -> int:
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    args = parse_args(argv)
    plan = get_host_assignments(parse_hosts(",".join(f"{h}:{args.slots}" for h in args.hosts)),
                                len(args.hosts) * args.slots)
    if args.index == 0:
        server = RendezvousHTTPServer(("0.0.0.0", args.port), RendezvousHandler, False)
        server.init(plan)
        threading.Thread(target=server.serve_forever, name="rendezvous", daemon=True).start()
    run_env = {key: str(value) for key, value in
               create_run_env_vars(args.hosts[0], [args.iface], args.port).items()}
    mine = [slot for slot in plan if slot.hostname == args.hosts[args.index]]
    ranks = [subprocess.Popen(args.command, env={**os.environ, **run_env,
                                                 **create_slot_env_vars(slot)})
             for slot in mine]
    codes = [rank.wait() for rank in ranks]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
