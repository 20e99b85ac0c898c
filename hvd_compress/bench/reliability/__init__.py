"""``python -m hvd_compress.bench.reliability [fuzz|faults|load|security|disk|all] --json OUT``:
the parameter server's reliability campaign against live ``python -m ps_server`` processes.

Each part prints its figures and the whole run is written as JSON to ``OUT``:

fuzz
    ``--requests`` (100,000) generated requests over gRPC: valid push and pull frames with
    flipped bytes, truncated, extended, header fields rewritten with the CRC recomputed
    (so the frame passes the checksum and reaches the field checks), random bytes, frames
    sent to the wrong method and calls of methods that do not exist. Counted: server
    crashes (checked every 5,000 requests and at the end), hangs (a call that outlives its
    timeout), requests answered OK although the client-side reference decoder or the job's
    shape says they are invalid ("accepted invalid"), and the server's RSS. Afterwards
    a clean round on a tensor that only ever received broken frames, and one on a fresh
    tensor, must sum exactly.
faults
    ``--trials`` (10) trials of each fault, 2 workers x 2 tensors, integer-valued pushes
    (so any sum counted twice or missed shows): a worker SIGKILLed mid-round; the server
    SIGKILLed at a random round and restarted on its port from its checkpoint; the server
    killing itself at each step of the close and checkpoint sequence
    (``$HVD_COMPRESS_PS_FAULT``, at a random occurrence) and restarted; the server stopped
    (SIGSTOP) for longer than ``--deadline``; a lossy and a stalled link (the server on an
    emulated host, :mod:`hvd_compress.bench.hosts`: a token bucket too small for the
    bursts, or the interface down for seconds; needs root, skipped otherwise). A
    trial passes when every worker applied only exact sums, the workers' aggregates are
    identical round for round, and either every worker finished or every surviving one
    stopped with an error (the job stopped cleanly); it fails when a replica diverged, a
    sum was wrong, or a worker hung.
load
    ``--workers`` (64 and 128) workers x ``--rounds`` (1,000) rounds x 2 shards: worker
    ids spread over 4 processes of one thread and one real gRPC client per id. Checked:
    every aggregate is the exact sum, and each server's count of accepted pushes is
    exactly workers x rounds (none lost, none counted twice); reported: each server's RSS
    at start and end, and the percentiles of a worker's round time (its push to its
    aggregate).
security
    No token, a wrong token, a replay of a closed round's push (by a call without
    identity, so refused: its worker is bound), a second different push
    for the same (worker, round) from clients without identity, impersonation (another
    process, with its own client, and a raw call without identity, pushing as a worker
    bound to a running client, in a round that worker has not pushed yet: both refused,
    the first before its body is read, and the round still the exact sum of the real
    workers' pushes), eight 100 MB unauthenticated pushes at once (the server's peak RSS
    measured), a worker id out of range, and TLS misconfigured both ways (wrong CA, TLS
    to a plain server), with the time each TLS error took.

disk
    ``--disk-faults`` (10) full disks (needs root: a small tmpfs holds the server's
    ``--checkpoint-dir``; skipped otherwise, and not part of ``all``): 2 workers push
    rounds while a file fills the tmpfs; checked per fault: health turns ``NOT_SERVING``
    and every worker stops with an error naming the cause within 10 s of the failed
    write; after the file is deleted health is ``SERVING`` again, the workers go on from
    the round that failed, every aggregate is the exact sum, and the journal holds every
    round once.

Run it niced on a shared machine (``nice -n 10``); the latencies are measured under
whatever else runs.

Each campaign is a module here (:mod:`~hvd_compress.bench.reliability.fuzz`,
:mod:`~hvd_compress.bench.reliability.faults`, :mod:`~hvd_compress.bench.reliability.load`,
:mod:`~hvd_compress.bench.reliability.security`, :mod:`~hvd_compress.bench.reliability.disk`)
on top of :mod:`~hvd_compress.bench.reliability.common`; figures in ``docs/reliability.md``.
"""

from __future__ import annotations

from hvd_compress.bench.reliability.cli import PARTS, main
from hvd_compress.bench.reliability.common import (
    NUMEL,
    PAIRS,
    Server,
    exact_sum,
    judge,
    push_pairs,
    servers,
    train,
)
from hvd_compress.bench.reliability.disk import disk_faults
from hvd_compress.bench.reliability.faults import faults
from hvd_compress.bench.reliability.fuzz import expected_invalid, fuzz, fuzz_case
from hvd_compress.bench.reliability.load import load
from hvd_compress.bench.reliability.security import security, self_signed

__all__ = ["NUMEL", "PAIRS", "PARTS", "Server", "disk_faults", "exact_sum",
           "expected_invalid", "faults", "fuzz", "fuzz_case", "judge", "load", "main",
           "push_pairs", "security", "self_signed", "servers", "train"]
