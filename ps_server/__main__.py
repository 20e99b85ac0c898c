"""``python -m ps_server`` / ``hvd-ps-server``: one parameter-server shard.

Example, two shards for two workers over gRPC with a token::

    echo s3cret > token; hvd-ps-server --workers 2 --shard 0/2 --bind 0.0.0.0:7070 \\
        --token-file token --checkpoint-dir ckpt
    hvd-ps-server --workers 2 --shard 1/2 --bind 0.0.0.0:7071 --token-file token ...

and workers use ``PSClient("grpc://host:7070,host:7071", worker=rank, token=...)``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from hvd_compress import __version__
from hvd_compress.ps_protocol import TOKEN_ENV
from ps_server.rounds import HeapKeeper
from ps_server.service import CHECKPOINT_EVERY, ShardService
from ps_server.store import MODES, Quorum, ShardStore

log = logging.getLogger("ps_server")


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/2, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


ENV_PREFIX = "HVD_PS_"
"""Every option ``--some-flag`` may also be given as ``$HVD_PS_SOME_FLAG`` (a container's
environment); the command line wins over the environment, which wins over the default."""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_var(flag: str) -> str:
    """The environment variable of a long option: ``--max-message-mb`` ->
    ``HVD_PS_MAX_MESSAGE_MB``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class EnvArgumentParser(argparse.ArgumentParser):
    """An argument parser whose long options default to their :func:`env_var`, with the
    variable and the default shown in ``--help``.

    ``show_default=`` (an extra keyword of :meth:`add_argument`) is the default as help
    shows it, when the value itself reads badly (a tuple, ``None`` meaning something). A
    value from the environment is converted and checked like one from the command line,
    and a bad one is an error naming the variable.
    """

    def add_argument(self, *names: str, **kw: Any) -> argparse.Action:
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is None or kw.get("action") in ("help", "version"):
            return super().add_argument(*names, **kw)
        env = env_var(flag)
        shown = kw.pop("show_default", kw.get("default"))
        notes = [f"env {env}"] + ([] if shown in (None, False) else [f"default {shown}"])
        kw["help"] = f"{kw.get('help', '')} [{'; '.join(notes)}]".strip()
        value = os.environ.get(env, "")
        if value:
            kw["default"] = self._from_env(env, value, kw)
            kw["required"] = False
        return super().add_argument(*names, **kw)

    def _from_env(self, env: str, value: str, kw: dict[str, Any]) -> Any:
        if kw.get("action") == "store_true":
            if value.lower() not in _TRUE + _FALSE:
                self.error(f"${env}={value!r}: expected one of {', '.join(_TRUE + _FALSE)}")
            return value.lower() in _TRUE
        try:
            converted = kw.get("type", str)(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
            self.error(f"${env}={value!r}: {err}")
        if kw.get("choices") is not None and converted not in kw["choices"]:
            self.error(f"${env}={value!r}: expected one of {', '.join(map(str, kw['choices']))}")
        return converted


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (and :data:`ENV_PREFIX` environment variables), checked."""
    p = EnvArgumentParser(
        prog="hvd-ps-server",
        description="Parameter-server shard aggregating sparse gradient pushes by round. "
        f"Every option can also be set by the environment variable shown with it; the "
        f"token itself may come from ${TOKEN_ENV}.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--transport", choices=("grpc", "mpi"), default="grpc",
                   help="gRPC server, or ranks of an MPMD mpirun with the workers")
    p.add_argument("--bind", type=_host_port, default=("127.0.0.1", 7070),
                   show_default="127.0.0.1:7070", metavar="HOST:PORT",
                   help="gRPC listen address (and the metrics' host); port 0 picks a free "
                   "port; 0.0.0.0:7070 in a container")
    p.add_argument("--workers", type=int, required=True, metavar="N",
                   help="number of workers pushing every round (required)")
    p.add_argument("--shard", type=_shard, default=None, show_default="0/1", metavar="I/N",
                   help="this server's shard of N (with MPI, default: the server's rank "
                   "among server ranks)")
    p.add_argument("--deadline", type=float, default=120.0, metavar="SECONDS",
                   help="a round missing a worker this long after its first request fails")
    p.add_argument("--quorum", metavar="K", show_default="all workers",
                   help="close a round once K workers (or a fraction, 0.75) have pushed and "
                   "--grace has passed; a later push for it is refused as late and its "
                   "worker sends those pairs in a later round")
    p.add_argument("--grace", type=float, default=0.0, metavar="SECONDS",
                   help="with --quorum: how long after its first request a round waits for "
                   "the workers beyond the quorum")
    p.add_argument("--late-rounds", type=int, default=64, metavar="ROUNDS",
                   help="with --quorum: closed rounds kept for late workers' pulls")
    p.add_argument("--mode", choices=MODES, default="union",
                   help="union: exact sum over the union of indices; topk: global top-k "
                   "with a server-side residual; gtopk: global top-k of the sum, the rest "
                   "kept in the workers' residuals, no server state; both top-k modes pull "
                   "no more than a push (for many workers; docs/parameter-server.md, "
                   "Choosing the mode)")
    p.add_argument("--token-file", type=Path, metavar="PATH", show_default=f"${TOKEN_ENV}",
                   help="require the token in this file from gRPC clients")
    p.add_argument("--tls-cert", type=Path, metavar="PEM", show_default="no TLS",
                   help="TLS certificate chain")
    p.add_argument("--tls-key", type=Path, metavar="PEM", show_default="no TLS",
                   help="TLS private key")
    p.add_argument("--checkpoint-dir", metavar="DIR", show_default="no checkpoints",
                   help="journal rounds and write snapshots shard-I-of-N.npz here, and resume "
                   "from them; a final snapshot is written on SIGTERM/SIGINT")
    p.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY, metavar="ROUNDS",
                   help="full snapshot after this many journaled rounds")
    p.add_argument("--checkpoint-fsync", action="store_true",
                   help="fsync every journal write (survives a host crash, not only a "
                   "server kill; one fsync per write)")
    p.add_argument("--idle-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="free a tensor (and log its session) when nobody pushed or pulled it "
                   "this long; must exceed --deadline")
    p.add_argument("--metrics-port", type=int, metavar="PORT", show_default="off",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any port)")
    p.add_argument("--metrics-host", metavar="HOST", show_default="the --bind host",
                   help="address the metrics endpoint listens on, e.g. 127.0.0.1 to keep it "
                   "off the network the gRPC port faces")
    p.add_argument("--metrics-hide-names", action="store_true",
                   help="no tensor or session names in metric labels (hvd_ps_open_round "
                   "then gives the lowest and highest open round, stat=min/max)")
    p.add_argument("--max-message-mb", type=int, default=256, metavar="MB",
                   help="largest gRPC message accepted or sent")
    p.add_argument("--max-push-mb", type=float, metavar="MB", show_default="no limit",
                   help="refuse a push when the open rounds' decoded pushes would hold more")
    p.add_argument("--max-shard-numel", type=int, default=1 << 28, show_default="2**28",
                   metavar="N", help="refuse tensors whose shard has more elements")
    p.add_argument("--threads", type=int, default=64,
                   help="threads decoding and summing gRPC pushes at once (waiting pulls "
                   "hold none)")
    p.add_argument("--log-level", default="INFO",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity")
    args = p.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    if args.deadline <= 0:
        p.error(f"--deadline must be positive, got {args.deadline}")
    try:
        args.quorum = Quorum.parse(args.quorum, args.workers, args.grace, args.late_rounds)
    except ValueError as err:
        p.error(str(err))
    if args.quorum.partial and args.grace >= args.deadline:
        p.error(f"--grace ({args.grace:g}) must be below --deadline ({args.deadline:g})")
    if args.max_push_mb is not None and args.max_push_mb <= 0:
        p.error(f"--max-push-mb must be positive, got {args.max_push_mb:g}")
    if args.idle_timeout <= args.deadline:
        p.error(f"--idle-timeout ({args.idle_timeout:g}) must exceed --deadline "
                f"({args.deadline:g})")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        p.error(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if args.metrics_port is None and (args.metrics_host is not None or
                                      args.metrics_hide_names):
        p.error("--metrics-host and --metrics-hide-names need --metrics-port")
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    for option, path in (("--token-file", args.token_file), ("--tls-cert", args.tls_cert),
                         ("--tls-key", args.tls_key)):
        if path is not None and (problem := _unreadable(path)):
            p.error(f"{option} {path}: {problem}")
    if args.token_file is not None and not args.token_file.read_bytes().strip():
        p.error(f"--token-file {args.token_file} is empty")
    for option, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and (problem := _not_pem(path.read_bytes())):
            p.error(f"{option} {path}: {problem}")
    return args


def _not_pem(data: bytes) -> str | None:
    """Why ``data`` cannot be a PEM certificate or key (gRPC would only fail later, on the
    first handshake), or ``None``."""
    if not data.strip():
        return "is empty"
    if b"-----BEGIN " not in data:
        return "is not PEM (no '-----BEGIN ...' line)"
    return None


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file, or ``None`` when it can."""
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "not a regular file"
    try:
        with path.open("rb"):
            pass
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise SystemExit(f"hvd-ps-server: cannot read --token-file {args.token_file}: "
                             f"{err}") from None
        if not token:
            raise SystemExit(f"hvd-ps-server: token file {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = workers = None
    shard, shards = args.shard or (None, None)
    if args.transport == "mpi":
        from mpi4py import MPI

        from hvd_compress.ps_protocol import split_world

        world = MPI.COMM_WORLD
        try:  # every rank learns of a wrong --workers here, and says so
            _, _, servers, workers = split_world(world, "server", shard, shards,
                                                 args.workers)
        except ValueError as err:
            raise SystemExit(f"hvd-ps-server: {err}") from None
        shard = servers.index(world.Get_rank())
        shards = len(servers)
    shard, shards = (0, 1) if shard is None else (shard, shards)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format=f"%(asctime)s ps-server[{shard}/{shards}] %(levelname)s %(message)s")
    store = ShardStore(args.workers, shard, shards, args.mode, args.deadline,
                       args.max_shard_numel, idle_timeout=args.idle_timeout,
                       push_budget=None if args.max_push_mb is None else
                       int(args.max_push_mb * 2**20), quorum=args.quorum,
                       heap=HeapKeeper())
    service = ShardService(store, args.checkpoint_dir, args.checkpoint_every,
                           args.checkpoint_fsync, hide_names=args.metrics_hide_names)
    try:
        service.restore()
    except (ValueError, OSError) as err:
        raise SystemExit(f"hvd-ps-server: {err}") from None
    host, port = args.bind
    if args.metrics_port is not None:
        metrics_host = args.metrics_host or host
        try:
            metrics_server = service.metrics.serve(metrics_host, args.metrics_port)
        except OSError as err:
            raise SystemExit(f"hvd-ps-server: cannot serve metrics on "
                             f"{metrics_host}:{args.metrics_port}: {err}") from None
        log.info("metrics at http://%s:%d/metrics%s", metrics_host,
                 metrics_server.server_address[1],
                 " (tensor and session names hidden)" if args.metrics_hide_names else "")
    quorum = args.quorum
    desc = (f"{args.workers} workers"
            + (f" (quorum {quorum.size}, grace {quorum.grace:g} s)" if quorum.partial else "")
            + f", mode {args.mode}, deadline {args.deadline:g} s, "
            f"checkpoints {args.checkpoint_dir or 'off'}")
    if args.transport == "mpi":
        from ps_server import mpi_transport

        log.info("serving shard %d/%d over MPI (rank %d): %s", shard, shards,
                 world.Get_rank(), desc)
        _before_serving()
        mpi_transport.serve(service, world, workers)
        service.close()
        log.info("all workers done; exiting: %s", service.summary())
        return 0
    return _serve_grpc(args, service, host, port, desc)


def _before_serving() -> None:
    """Once everything is set up: move what is alive then (modules, the store, the
    transport's objects) out of the garbage collector's reach (``gc.freeze``), so its
    collections walk only what requests allocate, not the tens of thousands of objects of
    numpy's, gRPC's and our modules, which live until exit anyway."""
    gc.collect()
    gc.freeze()


def _serve_grpc(args: argparse.Namespace, service: ShardService, host: str, port: int,
                desc: str) -> int:
    from ps_server import grpc_transport

    token = _token(args)
    tls = None
    if args.tls_cert is not None:
        tls = (args.tls_key.read_bytes(), args.tls_cert.read_bytes())
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no token: anyone who reaches %s:%d can push gradients (use "
                    "--token-file)", host, port)
    try:
        server, port = grpc_transport.serve(service, f"{host}:{port}", args.deadline + 1.0,
                                            token, tls, args.max_message_mb << 20,
                                            args.threads)
    except OSError as err:
        raise SystemExit(f"hvd-ps-server: {err}") from None
    stop = threading.Event()
    grpc_transport.tick_forever(service, stop)
    _before_serving()

    def shut_down(signum: int, _frame: object) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, shut_down)
    signal.signal(signal.SIGINT, shut_down)
    log.info("serving shard %d/%d on %s:%d (grpc%s, token %s): %s", service.store.shard,
             service.store.shards, host, port, "+tls" if tls else "",
             "required" if token else "off", desc)
    stop.wait()
    server.stop(grace=1.0).wait()
    service.close()
    log.info("stopped: %s", service.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
