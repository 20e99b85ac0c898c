"""A gRPC server like ``python -m ps_server`` that does no work, for ``bench ps``.

It runs the same transport (:func:`ps_server.grpc_transport.serve`: options, thread pool,
message limits), but answers every push ``accepted`` unread and every pull at once with a
fixed payload the size of the real aggregate: what moving the bytes alone costs on this
machine, with no decoding, no sums and no waiting for a round to close::

    python -m hvd_compress.bench.null_server --reply-bytes N
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from ps_server.grpc_transport import serve
from ps_server.rounds import HeapKeeper
from ps_server.service import ACCEPTED


class NullHandler:
    """Answers pushes ``accepted`` and pulls with ``reply_bytes`` zero bytes; its heap keeps
    the pages of ``workers`` pulls' replies as the real server's does
    (:class:`~ps_server.rounds.HeapKeeper`), so both map pages alike."""

    def __init__(self, reply_bytes: int, workers: int = 1) -> None:
        self.reply = bytes(reply_bytes)
        HeapKeeper().fit("null", reply_bytes, workers)

    def push(self, data: bytes, peer: str) -> bytes:
        return ACCEPTED

    def pull(self, data: bytes, peer: str, timeout: float) -> bytes:
        return self.reply


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_compress.bench.null_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--reply-bytes", type=int, required=True,
                        help="size of every pull's answer")
    parser.add_argument("--workers", type=int, default=1,
                        help="pulls a round answers (sizes the heap it keeps)")
    parser.add_argument("--max-message-mb", type=int, default=512)
    args = parser.parse_args(argv)
    server, port = serve(NullHandler(args.reply_bytes, args.workers), "127.0.0.1:0", 600.0,
                         max_message_bytes=args.max_message_mb << 20)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"serving shard 0/1 on 127.0.0.1:{port} (no work, replies of "
          f"{args.reply_bytes} bytes)", flush=True)
    stop.wait()
    server.stop(grace=1.0).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
