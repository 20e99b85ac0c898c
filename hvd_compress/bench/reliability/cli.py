"""The command line of :mod:`hvd_compress.bench.reliability`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hvd_compress.bench.reliability.common import (
    fresh,
)
from hvd_compress.bench.reliability.disk import disk_faults
from hvd_compress.bench.reliability.faults import faults, worker_main
from hvd_compress.bench.reliability.fuzz import fuzz
from hvd_compress.bench.reliability.load import load, load_worker_main
from hvd_compress.bench.reliability.security import impostor_main, security

PARTS = ("fuzz", "faults", "load", "security", "disk")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        worker_main(argv[1:])
        return 0
    if argv[:1] == ["_load"]:
        load_worker_main(argv[1:])
        return 0
    if argv[:1] == ["_impostor"]:
        impostor_main(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m hvd_compress.bench.reliability",
                                description="The parameter server's reliability campaigns "
                                "against live python -m ps_server processes.")
    p.add_argument("parts", nargs="*", default=["all"], choices=(*PARTS, "all"),
                   metavar="PART", help=f"one or more of {', '.join(PARTS)}, or all (default)")
    p.add_argument("--json", type=Path, required=True, metavar="OUT",
                   help="write every figure and trial here")
    p.add_argument("--requests", type=int, default=100_000, help="fuzz requests")
    p.add_argument("--trials", type=int, default=10, help="trials of each fault")
    p.add_argument("--fault-rounds", type=int, default=30, help="rounds of a fault trial")
    p.add_argument("--workers", default="64,128", help="load: worker counts, comma-separated")
    p.add_argument("--rounds", type=int, default=1000, help="load: rounds")
    p.add_argument("--disk-faults", type=int, default=10,
                   help="disk: full-disk episodes (needs root)")
    args = p.parse_args(argv)
    logging.getLogger("hvd_compress.ps_client").setLevel(logging.ERROR)  # retries expected
    parts = PARTS if "all" in args.parts else tuple(dict.fromkeys(args.parts))
    report: dict[str, Any] = {"command": " ".join(sys.argv), "started": time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="hvdc-reliability-") as tmp:
        work = Path(tmp)
        for part in parts:
            began = time.monotonic()
            if part == "fuzz":
                report[part] = fuzz(fresh(work, part), args.requests)
            elif part == "faults":
                report[part] = faults(fresh(work, part), args.trials, args.fault_rounds)
            elif part == "load":
                report[part] = load(fresh(work, part),
                                    [int(n) for n in args.workers.split(",")], args.rounds)
            elif part == "disk":
                report[part] = disk_faults(fresh(work, part), args.disk_faults)
            else:
                report[part] = security(fresh(work, part))
            report[f"{part}_seconds"] = round(time.monotonic() - began, 1)
            args.json.write_text(json.dumps(report, indent=1, default=str))
    report["load_average_end"] = os.getloadavg()
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json}", flush=True)
    return 0

