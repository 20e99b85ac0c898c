"""Command line: ``python -m hvd_compress.bench
{wire,kernels,ps,link,cluster,overhead,converge,model} [options]``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from hvd_compress import Compression, bench
from hvd_compress.bench import (
    cluster,
    cluster_rank,
    converge,
    kernels,
    link,
    model,
    overhead,
    ps,
    selection,
    wire_bytes,
)
from hvd_compress.bench.report import check_targets, markdown_table, publish

T = TypeVar("T")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _comma_list(parse_item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: a comma-separated list, each item checked by ``parse_item``."""

    def parse(text: str) -> list[T]:
        try:
            return [parse_item(item) for item in text.split(",")]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return parse


def _layer_set(name: str) -> str:
    if name not in wire_bytes.LAYER_SETS:
        raise ValueError(f"unknown layer set {name!r}; choose from "
                         f"{', '.join(wire_bytes.LAYER_SETS)}")
    return name


def _scheme_spec(text: str) -> str:
    Compression.parse(text)  # raises ValueError with the reason, which argparse reports
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hvd_compress.bench",
                                     description=bench.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    wire = commands.add_parser("wire", help="bytes per step and ratio to float32, measured")
    wire.add_argument("--json", type=Path, help="write the rows to this file")
    wire.add_argument("--ranks", type=_positive_int, default=2,
                      help="in-process ranks exchanging (default 2)")
    wire.add_argument("--layers", type=_comma_list(_layer_set), default=["matrix", "resnet"],
                      help="layer sets, comma-separated, from "
                           f"{', '.join(wire_bytes.LAYER_SETS)} (default matrix,resnet)")

    kern = commands.add_parser("kernels", help="encode+decode throughput against a copy")
    kern.add_argument("--json", type=Path, help="write the rows to this file")
    kern.add_argument("--sizes", type=_comma_list(kernels.parse_count),
                      default=[4 << 20, 64 << 20],
                      help="float32 element counts, comma-separated (default 4M,64M)")
    kern.add_argument("--repeat", type=_positive_int, default=5,
                      help="timings per scheme and size; the median is reported (default 5)")
    kern.add_argument("--tf-sizes", type=_comma_list(kernels.parse_count), default=[4 << 20],
                      help="sizes of the TensorFlow (DLPack) overhead table (default 4M)")
    kern.add_argument("--no-tf", action="store_true",
                      help="skip the TensorFlow table (TensorFlow is not imported)")
    kern.add_argument("--selection-sizes", type=_comma_list(kernels.parse_count),
                      help="sizes of the top-k selection table (default: --sizes)")
    kern.add_argument("--device", choices=kernels.DEVICES, default="cpu",
                      help="where the codecs run (default cpu); cuda times them with CUDA "
                           "events against a device-to-device copy, and runs the codec "
                           "table and the Triton kernels' (no TensorFlow or selection table)")
    kern.add_argument("--markdown", type=Path,
                      help="also write the tables as Markdown to this file")

    server = commands.add_parser("ps", help="parameter-server aggregation throughput")
    server.add_argument("--json", type=Path, help="write the rows to this file")
    server.add_argument("--workers", type=_comma_list(_positive_int), default=[2, 4, 8],
                        help="simulated worker counts, comma-separated (default 2,4,8)")
    server.add_argument("--shards", type=_comma_list(_positive_int), default=[1, 2],
                        help="server process counts, comma-separated (default 1,2)")
    server.add_argument("--numel", type=kernels.parse_count, default=16 << 20,
                        help="elements of the sparse tensor (default 16M)")
    server.add_argument("--density", type=float, default=0.01,
                        help="fraction of the elements each worker pushes (default 0.01)")
    server.add_argument("--rounds", type=_positive_int, default=20,
                        help="rounds timed per configuration (default 20; fewer above 8 "
                        "workers: max(2, rounds * 8 // workers))")
    server.add_argument("--modes", type=_comma_list(str), default=["union"],
                        help="server modes side by side, comma-separated: union, topk, "
                        "gtopk (default union)")
    server.add_argument("--transports", type=_comma_list(str), default=list(ps.TRANSPORTS),
                        help="comma-separated subset of in-process,grpc,mpi (default all)")

    links = commands.add_parser("link", help="step time on emulated hosts with throttled "
                                "links (root; network namespaces and tc)")
    links.add_argument("--json", type=Path, help="write the rows to this file")
    links.add_argument("--layers", type=_layer_set, default="resnet",
                       help="the layer set whose gradients are reduced (default resnet)")
    links.add_argument("--schemes", type=_scheme_spec, nargs="+",
                       default=list(link.LINK_SCHEMES),
                       help=f"scheme specs (default: {' '.join(link.LINK_SCHEMES)})")
    links.add_argument("--rate", default="100mbit", help="link rate for tc (default 100mbit)")
    links.add_argument("--steps", type=_positive_int, default=3,
                       help="timed steps per scheme (default 3)")
    links.add_argument("--ranks", type=_positive_int, default=2,
                       help="ranks, one per emulated host (default 2)")
    links.add_argument("--allreduce", choices=["ring", "default"], default="ring",
                       help="OpenMPI's ring all-reduce (default) or its default choice")
    links.add_argument("--timeout", type=_positive_int, default=1800,
                       help="seconds before the launch is aborted, with the state of its "
                       "ranks and their Python stacks printed (default 1800)")
    clus = commands.add_parser("cluster", help="training step time of hvd-compress, PyTorch "
                               "DDP and stock Horovod on an emulated cluster (root)")
    clus.add_argument("--json", type=Path, help="write the rows to this file")
    clus.add_argument("--out-dir", type=Path, help="write cluster.json, cluster.md, "
                      "cluster-steps.png and cluster-accuracy.png here")
    clus.add_argument("--quick", action="store_true",
                      help="a tiny model on 2 hosts at one rate, 3 steps: checks the harness "
                      "in about a minute (the options below still apply when given)")
    clus.add_argument("--ranks", "--hosts", type=_positive_int, dest="ranks",
                      help="worker hosts (default 4)")
    clus.add_argument("--ranks-per-host", type=_positive_int,
                      help="ranks on each worker host, sharing its network namespace: "
                      "unthrottled loopback between them, the throttled link to other "
                      "hosts (default 1)")
    clus.add_argument("--rates", type=_comma_list(_rate),
                      help="link rates, comma-separated (default 100mbit,1gbit,10gbit)")
    clus.add_argument("--latency-ms", type=float, default=0.0,
                      help="one-way delay added to every host's traffic (default 0)")
    clus.add_argument("--models", type=_comma_list(_model),
                      help="the models trained, comma-separated, each with every system: "
                      f"{', '.join(cluster_rank.MODELS)} (default mlp, 14.7 M parameters)")
    clus.add_argument("--steps", type=_positive_int, help="timed steps (default 12)")
    clus.add_argument("--repeats", type=_positive_int,
                      help="launches of every configuration per link, taken in turn (all "
                      "systems, then all again): their timed steps are pooled into one row, "
                      "so a slow spell of the shared machine falls on every system alike "
                      "(default 1)")
    clus.add_argument("--pin-cores", action="store_true",
                      help="pin every rank of every system to one core (rank r to core r "
                      "modulo the cores), so that each emulated host keeps its share of the "
                      "CPU instead of the scheduler moving ranks between cores")
    clus.add_argument("--warmup", type=int,
                      help="untimed steps first (default 5: they include PowerSGD's first "
                      "compressed steps, with their new collectives and buffers)")
    clus.add_argument("--schemes", type=_cluster_spec, nargs="*",
                      help="hvd-compress schemes; SPEC@ps sends sparse pairs to a gRPC "
                      "server on its own host, SPEC@gloo the dense rounds on a Gloo group "
                      "(collectives='gloo'), SPEC@gloo@ps both; SPEC@host is two-level "
                      "(hierarchy='host') "
                      f"(default: {' '.join(cluster.DEFAULT_SCHEMES)})")
    clus.add_argument("--ddp", nargs="*", choices=["none", "fp16"] + [
        s for s in cluster.DDP_SCHEMES if "powersgd" in s] + list(cluster.DDP_FLOORS),
        metavar="SCHEME",
        help="DDP configurations: none, fp16, powersgd:... (powerSGD_hook), "
             "batched-powersgd:... (batched_powerSGD_hook), rounds-powersgd:... (a floor: "
             "our PowerSGD's collectives with nothing computed) (default: "
             f"{' '.join(cluster.DDP_SCHEMES)})")
    clus.add_argument("--horovod", nargs="*", choices=["none", "fp16"],
                      help="stock Horovod configurations (default: none fp16)")
    clus.add_argument("--controllers", nargs="+", choices=["gloo", "mpi", "mpi-gloo"],
                      help="how hvd-compress's Horovod runs, one row each: its Gloo "
                      "controller (as horovodrun --gloo, rows 'hvd-compress'), mpirun "
                      "with OpenMPI's ring all-reduce ('hvd-compress-mpi'), or mpirun with "
                      "Horovod's Gloo controller, init(controller='gloo') "
                      "('hvd-compress-mpi-gloo'); the ranks start Horovod with "
                      "hvd_compress.torch.init() (default gloo)")
    clus.add_argument("--env", type=_assignment, action="append", metavar="KEY=VALUE",
                      help="more environment for every Horovod-based system's ranks, stock "
                      "and ours (repeatable), e.g. OMPI_MCA_mpi_yield_when_idle=0 to measure "
                      "what hvd_compress.torch.init's default buys under mpirun")
    clus.add_argument("--no-floor", action="store_true",
                      help="skip the compute floor (the same model and ranks with no "
                      "communication; default: measured for every model and link)")
    clus.add_argument("--cycle-time-ms", type=float,
                      help="HOROVOD_CYCLE_TIME for every Horovod-based system, stock and "
                      "hvd-compress alike (default 10, what hvd_compress.torch.init sets; 0: "
                      "Horovod's own default, 1 ms)")
    clus.add_argument("--shared-processes", action="store_true",
                      help="run each system's configurations one after the other in the same "
                      "processes (default: fresh processes for every configuration)")
    clus.add_argument("--horovod-controllers", nargs="+",
                      choices=["gloo", "mpi", cluster.HIERARCHICAL],
                      help="stock Horovod's controllers, one row each; "
                      f"{cluster.HIERARCHICAL}: mpirun with HOROVOD_HIERARCHICAL_ALLREDUCE=1 "
                      "and HOROVOD_HIERARCHICAL_ALLGATHER=1 (default: gloo mpi)")
    clus.add_argument("--max-epochs", type=_positive_int,
                      help="most digits epochs of a configuration that has not reached the "
                      "target within the time budget (default 60)")
    clus.add_argument("--bucket-mb", type=float,
                      help="hvd-compress's bucket size (default: the optimizer's)")
    clus.add_argument("--accuracy-rate", type=_rate,
                      help="link rate of the time-to-accuracy runs on digits (default 100mbit)")
    clus.add_argument("--epochs", type=int,
                      help="digits epochs per configuration; 0 skips time to accuracy "
                      "(default 12)")
    clus.add_argument("--hidden", type=_positive_int,
                      help="width of the digits MLP's two hidden layers (default 1024)")
    clus.add_argument("--timeout", type=_positive_int, default=1800,
                      help="seconds before a launch is aborted (default 1800)")
    over = commands.add_parser("overhead", help="our PowerSGD's CPU time per step against "
                               "DDP's powerSGD_hook's, in one process on one rank")
    over.add_argument("--json", type=Path, help="write the rows to this file")
    over.add_argument("--models", type=_comma_list(_model),
                      default=list(overhead.DEFAULT_MODELS),
                      help=f"comma-separated (default {','.join(overhead.DEFAULT_MODELS)})")
    over.add_argument("--steps", type=_positive_int, default=20,
                      help="timed steps per system and turn (default 20)")
    over.add_argument("--warmup", type=_positive_int, default=5,
                      help="untimed steps first, past PowerSGD's start (default 5)")
    over.add_argument("--repeats", type=_positive_int, default=3,
                      help="turns of all systems (default 3)")
    over.add_argument("--rank", type=_positive_int, default=4,
                      help="PowerSGD's rank, both systems (default 4)")
    model.add_parser(commands)
    conv = commands.add_parser("converge", help="held-out loss and accuracy of every scheme "
                               "at its recommended settings against uncompressed, 2 ranks")
    conv.add_argument("--out-dir", type=Path, help="write converge.json, converge.md, "
                      "converge-<task>-steps.png and converge-<task>-bytes.png here")
    conv.add_argument("--json", type=Path, help="write the rows to this file")
    conv.add_argument("--quick", action="store_true",
                      help="a few dozen steps of both tasks, three configurations each "
                      "(digits also top-k, by the collectives and through a server per "
                      "--ps-modes mode): checks the harness in a minute or two")
    conv.add_argument("--tasks", type=_comma_list(_task), default=list(converge.TASKS),
                      help="lm (character transformer), digits, or both (default lm,digits)")
    conv.add_argument("--only", type=_comma_list(str),
                      help="configurations to train, by row name, comma-separated "
                      "(uncompressed always runs: it is the reference)")
    conv.add_argument("--lm-steps", type=_positive_int,
                      help=f"language-model steps (default {converge.LM_TASK['steps']})")
    conv.add_argument("--digits-steps", type=_positive_int,
                      help=f"digits steps (default {converge.DIGITS_TASK['steps']})")
    conv.add_argument("--every", type=_positive_int,
                      help="steps between held-out evaluations, each also a progress line "
                      "on stderr (default: lm 25, digits 50)")
    conv.add_argument("--timeout", type=_positive_int, default=1800,
                      help="seconds before the launch is aborted (default 1800)")
    conv.add_argument("--ps-modes", type=_ps_modes, default=list(converge.PS_MODES),
                      help="server modes of the topk-server-<mode> rows (top-k through a "
                      "parameter server started for the row), comma-separated: union, "
                      "topk, gtopk (default union,topk,gtopk), or none")
    return parser


def _assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _model(name: str) -> str:
    if name not in cluster_rank.MODELS:
        raise ValueError(f"unknown model {name!r}; choose from "
                         f"{', '.join(cluster_rank.MODELS)}")
    return name


def _task(name: str) -> str:
    if name not in converge.TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(converge.TASKS)}")
    return name


def _ps_modes(text: str) -> list[str]:
    """``--ps-modes``: ``none``, or server modes, comma-separated."""
    from ps_server.store import MODES

    modes = [] if text == "none" else text.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown server mode {', '.join(unknown)}; choose "
                                         f"from {', '.join(MODES)}, or none")
    return modes


def _converge(args: argparse.Namespace, argv: Sequence[str]) -> None:
    steps = {task: count for task, count in (("lm", args.lm_steps),
                                             ("digits", args.digits_steps))
             if count is not None and task in args.tasks}
    if args.quick:
        plan = converge.Plan.quick(args.ps_modes)
        plan.tasks = {t: s for t, s in plan.tasks.items() if t in args.tasks}
        plan.configs = [c for c in plan.configs if c.task in args.tasks]
    else:
        try:
            plan = converge.Plan.full(args.tasks, steps, args.every, args.only,
                                      args.ps_modes)
        except ValueError as err:
            raise SystemExit(f"--only: {err}") from err
    plan.timeout = args.timeout
    plan.progress = lambda text: print(text, file=sys.stderr, flush=True)
    rows = converge.run(plan)
    print(converge.summary(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nwrote {len(rows)} rows to {args.json}")
    if args.out_dir is not None:
        command = " ".join(["python -m hvd_compress.bench", *argv])
        written = converge.write(rows, args.out_dir, command)
        print(f"wrote {', '.join(written)} to {args.out_dir}")


def _rate(text: str) -> str:
    link.rate_bits(text)
    return text


def _cluster_spec(text: str) -> str:
    try:
        Compression.parse(cluster.split_spec(text)[0])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _cluster(args: argparse.Namespace) -> int:
    """Run the plan and write its report; 1 if a launch failed (the others' rows are still
    written, and the report gives the failure's cause), else 0."""
    plan = cluster.Plan.quick() if args.quick else cluster.Plan()
    given = {"ranks": args.ranks, "ranks_per_host": args.ranks_per_host,
             "rates": args.rates, "models": args.models,
             "steps": args.steps, "warmup": args.warmup, "schemes": args.schemes,
             "ddp": args.ddp, "horovod": args.horovod, "bucket_mb": args.bucket_mb,
             "accuracy_rate": args.accuracy_rate, "epochs": args.epochs, "hidden": args.hidden,
             "horovod_controllers": args.horovod_controllers, "max_epochs": args.max_epochs,
             "cycle_time_ms": args.cycle_time_ms, "repeats": args.repeats,
             "pin_cores": args.pin_cores or None, "controllers": args.controllers,
             "floor": False if args.no_floor else None,
             "horovod_env": dict(args.env) if args.env else None,
             "separate": False if args.shared_processes else None}
    plan = dataclasses.replace(
        plan, latency_ms=args.latency_ms, timeout=args.timeout,
        progress=lambda text: print(text, file=sys.stderr, flush=True),
        **{key: value for key, value in given.items() if value is not None})
    rows = cluster.run(plan)
    text = cluster.summary(rows)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nwrote {len(rows)} rows to {args.json}")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "cluster.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out_dir / "cluster.md").write_text(text + "\n")
        written = ["cluster.json", "cluster.md"]
        if cluster.step_rows(rows):
            cluster.plot_steps(cluster.step_rows(rows), args.out_dir / "cluster-steps.png")
            written.append("cluster-steps.png")
        if cluster.accuracy_rows(rows):
            cluster.plot_accuracy(cluster.accuracy_rows(rows),
                                  args.out_dir / "cluster-accuracy.png")
            written.append("cluster-accuracy.png")
        print(f"wrote {', '.join(written)} to {args.out_dir}")
    failed = cluster.failed_rows(rows)
    if failed:
        print(f"{len(failed)} launch(es) failed; their causes are in the report",
              file=sys.stderr)
    return 1 if failed else 0


def _kernels(args: argparse.Namespace) -> None:
    """Three tables: codec throughput against a copy, the TensorFlow path's overhead, and
    DGC's threshold selection against torch.topk (with ``--device cuda``: the first, and
    the Triton kernels against torch ops, :func:`kernels.run_triton`).
    The JSON holds every row, each with its table's name under ``benchmark``; the Markdown
    file (``--markdown``) each table under its title, with the target lines."""
    try:
        kernels.check_device(args.device)
    except ValueError as err:
        raise SystemExit(f"kernels: {err}") from None
    tables = [("codecs", kernels.title(args.repeat, args.device), kernels.COLUMNS,
               kernels.TARGETS, lambda: kernels.run(args.sizes, args.repeat, args.device))]
    if args.device == "cuda":
        tables.append(("triton", kernels.triton_title(args.repeat), kernels.TRITON_COLUMNS,
                       kernels.TRITON_TARGETS,
                       lambda: kernels.run_triton(args.sizes, args.repeat)))
    if args.device == "cpu" and not args.no_tf:
        from hvd_compress.bench import kernels_tf  # imports TensorFlow

        tables.append(("tensorflow", kernels_tf.title(args.repeat), kernels_tf.COLUMNS,
                       kernels_tf.TARGETS, lambda: kernels_tf.run(args.tf_sizes, args.repeat)))
    if args.device == "cpu":
        tables.append(("selection", selection.title(args.repeat), selection.COLUMNS,
                       selection.TARGETS,
                       lambda: selection.run(args.selection_sizes or args.sizes, args.repeat)))
    all_rows: list[dict] = []
    markdown: list[str] = []
    for name, heading, columns, targets, run in tables:
        rows = [{"benchmark": name, **row} for row in run()]
        publish(heading, rows, columns, targets, None)
        print()
        all_rows += rows
        lines = check_targets(rows, targets)
        markdown += [f"### {heading}", "", markdown_table(rows, columns), "",
                     *(f"- {line}" for line in lines), *([""] if lines else [])]
    if args.json is not None:
        args.json.write_text(json.dumps(all_rows, indent=2) + "\n")
        print(f"wrote {len(all_rows)} rows to {args.json}")
    if args.markdown is not None:
        args.markdown.write_text("\n".join(markdown).rstrip("\n") + "\n")
        print(f"wrote {len(tables)} table(s) to {args.markdown}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "wire":
        rows = wire_bytes.run(args.layers, args.ranks)
        publish(wire_bytes.title(args.ranks), rows, wire_bytes.COLUMNS, wire_bytes.TARGETS,
                args.json)
    elif args.command == "kernels":
        _kernels(args)
    elif args.command == "cluster":
        return _cluster(args)
    elif args.command == "model":
        return model.main(args)
    elif args.command == "converge":
        _converge(args, argv)
    elif args.command == "overhead":
        if args.warmup < 3:
            raise SystemExit("--warmup must be at least 3: PowerSGD starts at step 2")
        rows = overhead.run(args.models, args.steps, args.warmup, args.repeats, args.rank,
                            progress=lambda text: print(text, file=sys.stderr, flush=True))
        publish(overhead.title(args.steps, args.repeats, args.rank), rows, overhead.COLUMNS,
                [], args.json)
        print("\nTargets:\n" + "\n".join(overhead.targets(rows)))
    elif args.command == "link":
        link.rate_bits(args.rate)
        ring = args.allreduce == "ring"
        rows = link.run(args.layers, args.schemes, args.rate, args.steps, ring, args.ranks,
                        args.timeout)
        publish(link.title(args.ranks, args.rate, args.steps, ring), rows, link.COLUMNS,
                link.TARGETS, args.json)
    else:
        if not 0 < args.density <= 1:
            raise SystemExit(f"--density must be in (0, 1], got {args.density}")
        rows = ps.run(args.workers, args.shards, args.numel, args.density, args.rounds,
                      args.modes, args.transports)
        publish(ps.title(args.numel, args.density, args.rounds, args.modes), rows, ps.COLUMNS,
                ps.TARGETS, args.json)
    return 0
