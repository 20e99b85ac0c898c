"""Checkpoints of a shard's state: a snapshot plus an append-only journal of changes.

Files, in the checkpoint directory, for shard ``i`` of ``n``:

``shard-<i>-of-<n>.npz``
    The snapshot: a numpy ``.npz`` (no pickle) holding a JSON ``meta`` entry (the
    :func:`~ps_server.durability.snapshot` without arrays, with its worker
    ``bindings``, plus the journal ``generation`` it continues with) and, per tensor
    ``j``, arrays ``residual.<j>``, ``indices.<j>`` and ``values.<j>`` when present.
    Written to a temporary file, flushed to disk (``fsync``) and renamed over the previous
    one, so a crash at any moment leaves the old or the new snapshot, never a torn one.
``shard-<i>-of-<n>.journal-<g>``
    The changes since snapshot generation ``g``: records of ``<u32 body length><u32 CRC-32
    of body>`` then the body, ``<u32 JSON length>``, a JSON list of entries (tensor, round,
    numel, k, error, dropped, pair count; a worker bound or freed has an eighth item,
    ``[worker, key hex or null, first peer, first seen]``, and its session as tensor) and
    each entry's int64 indices and float32 sums back to back. The first record is a JSON
    object with the server's configuration. Each write appends only the rounds that
    finished since the previous write (what changed, not every tensor), so its cost
    follows the traffic, not the number of tensors.

Restoring loads the snapshot and replays its generation's journal up to the first torn
or corrupt record (a write cut short by a crash: its rounds were never answered, since
pulls wait for the write). Compaction writes a new snapshot of generation ``g + 1``,
then starts journal ``g + 1`` and deletes journal ``g``; a journal of another generation
than the snapshot's is stale and deleted at start.

Appends reach the operating system at once (``write``), which is what survives a kill of
the server process; ``fsync=True`` also flushes each append to the disk, to survive a
crash of the host, at the cost of one ``fsync`` per write.

Fault injection, for tests of crash consistency: with ``HVD_COMPRESS_PS_FAULT=STEP`` (or
``STEP:N`` for the ``N``-th time), the process kills itself with SIGKILL at that step of
the close and checkpoint sequence: ``closed`` (rounds closed in memory, nothing written),
``journal-write`` (half a record written), ``journal-written`` (record written, rounds not
yet answered), ``snapshot-write`` (half the temporary snapshot written),
``snapshot-renamed`` (new snapshot in place, old journal not yet deleted), ``answered``
(a round's aggregate sent to the first of its pullers).
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ps_server.durability import Change

FORMAT = 2
FAULT_ENV = "HVD_COMPRESS_PS_FAULT"
FAULT_STEPS = ("closed", "journal-write", "journal-written", "snapshot-write",
               "snapshot-renamed", "answered")
_RECORD = struct.Struct("<II")
_JSON = struct.Struct("<I")
_CONFIG = ("workers", "shard", "shards", "mode")


def _parse_fault(spec: str | None) -> tuple[str | None, int]:
    if not spec:
        return None, 0
    step, _, count = spec.partition(":")
    if step not in FAULT_STEPS or not (count or "1").isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected STEP or STEP:N with STEP one of "
                         f"{', '.join(FAULT_STEPS)}")
    return step, int(count or 1)


_fault_step, _fault_left = _parse_fault(os.environ.get(FAULT_ENV))


def fault_due(step: str) -> bool:
    """Whether ``$HVD_COMPRESS_PS_FAULT`` asks to die at this occurrence of ``step``
    (each call counts one occurrence)."""
    global _fault_left
    if step != _fault_step:
        return False
    _fault_left -= 1
    return _fault_left == 0


def fault_point(step: str, partial: tuple[int, bytes | memoryview] | None = None) -> None:
    """Kill this process (SIGKILL) if this occurrence of ``step`` is the one
    ``$HVD_COMPRESS_PS_FAULT`` asks for, first writing ``partial`` = (file descriptor,
    the first half of what was about to be written) when given; otherwise nothing."""
    if fault_due(step):
        if partial is not None:
            fd, data = partial
            os.write(fd, data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)


def path_for(directory: str | Path, shard: int, shards: int) -> Path:
    return Path(directory) / f"shard-{shard}-of-{shards}.npz"


def journal_path(path: Path, generation: int) -> Path:
    """The journal of snapshot ``path`` for ``generation``."""
    return path.with_name(f"{path.stem}.journal-{generation}")


def save(path: Path, snapshot: dict[str, Any], generation: int = 0) -> int:
    """Atomically write a :meth:`ShardStore.snapshot` to ``path``, continued by journal
    ``generation``; returns the bytes written."""
    arrays: dict[str, np.ndarray] = {}
    tensors = []
    for j, (name, t) in enumerate(snapshot["tensors"].items()):
        last = t["last"]
        entry = {"name": name, "numel": t["numel"], "round": t["round"], "last": None}
        if t["residual"] is not None:
            arrays[f"residual.{j}"] = t["residual"]
        if last is not None:
            entry["last"] = {"round": last["round"], "error": last["error"]}
            if last.get("contributors"):  # a round closed by quorum
                entry["last"]["contributors"] = list(last["contributors"])
            if last["error"] is None:
                arrays[f"indices.{j}"] = last["indices"]
                arrays[f"values.{j}"] = last["values"]
        tensors.append(entry)
    meta = {key: snapshot[key] for key in _CONFIG}
    meta.update(format=FORMAT, generation=generation, tensors=tensors,
                bindings=snapshot.get("bindings", []))
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    data = buffer.getbuffer()
    try:
        with open(tmp, "wb") as f:
            fault_point("snapshot-write", (f.fileno(), data))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # the previous snapshot stays in place; free what the attempt used
        tmp.unlink(missing_ok=True)
        raise
    fault_point("snapshot-renamed")
    return len(data)


def load(path: Path) -> dict[str, Any] | None:
    """The snapshot saved at ``path`` (with its ``generation``), or None if there is
    none."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        meta = json.loads(arrays.pop("meta").tobytes())
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {path} is unreadable ({err}); move it away to start "
                         "from scratch") from err
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')}, this server "
                         f"reads format {FORMAT}; move it away to start from scratch")
    tensors = {}
    for j, entry in enumerate(meta["tensors"]):
        last = entry["last"]
        if last is not None:
            last = dict(last, indices=arrays.get(f"indices.{j}"),
                        values=arrays.get(f"values.{j}"))
        tensors[entry["name"]] = {"numel": entry["numel"], "round": entry["round"],
                                  "residual": arrays.get(f"residual.{j}"), "last": last}
    snapshot = {key: meta[key] for key in (*_CONFIG, "generation")}
    snapshot["tensors"] = tensors
    snapshot["bindings"] = meta.get("bindings", [])  # none in snapshots of older servers
    return snapshot


def _record(header: Any, arrays: list[np.ndarray]) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([_JSON.pack(len(text)), text, *(a.tobytes() for a in arrays)])
    return _RECORD.pack(len(body), zlib.crc32(body)) + body


class Journal:
    """A new journal file (emptied if it exists), appended to by one writer thread.

    A failed append (``OSError``: disk full, I/O error) is cut off again, so the file ends
    with whole records and a later append is readable; if even that fails, ``broken`` is
    set and the journal must not be appended to again (write a snapshot instead).
    """

    def __init__(self, path: Path, config: dict[str, Any], fsync: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.fsync = path, fsync
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        self.records = self.bytes = self.size = 0
        self.broken = False
        try:
            self._write(_record({"format": FORMAT, **config}, []))
        except OSError:
            os.close(self._fd)
            raise

    def append(self, changes: list[Change]) -> int:
        """Write one record of ``changes``; returns its size in bytes. On ``OSError`` the
        file is as before the call (or ``broken``) and the error is raised."""
        entries, arrays = [], []
        for c in changes:
            count = 0 if c.indices is None else int(c.indices.size)
            entry = [c.tensor, c.round, c.numel, c.k, c.error, c.dropped, count]
            if c.binding is not None:
                entry.append(list(c.binding))
            elif c.contributors is not None:  # a round closed by quorum
                entry += [None, list(c.contributors)]
            entries.append(entry)
            if count:
                arrays += [c.indices.astype(np.int64, copy=False),
                           c.values.astype(np.float32, copy=False)]
        data = _record(entries, arrays)
        fault_point("journal-write", (self._fd, data))
        self._write(data)
        self.records += 1
        self.bytes += len(data)
        return len(data)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
            if self.fsync:
                os.fsync(self._fd)
        except OSError:
            self._cut(self.size)
            raise
        self.size += len(data)

    def _cut(self, size: int) -> None:
        """Drop what a failed write left after ``size`` bytes."""
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            self.broken = True

    def close(self) -> None:
        os.close(self._fd)


def read_journal(path: Path, config: dict[str, Any]) -> tuple[list[Change], int]:
    """The changes in journal ``path`` and the number of trailing bytes ignored (a torn
    or corrupt record and anything after it). Raises ValueError if the journal was
    written by a differently configured server."""
    data = path.read_bytes() if path.exists() else b""
    changes: list[Change] = []
    offset, first = 0, True
    while offset + _RECORD.size <= len(data):
        size, crc = _RECORD.unpack_from(data, offset)
        body = data[offset + _RECORD.size: offset + _RECORD.size + size]
        if len(body) != size or zlib.crc32(body) != crc:
            break
        (text_len,) = _JSON.unpack_from(body)
        header = json.loads(body[_JSON.size: _JSON.size + text_len])
        offset += _RECORD.size + size
        if first:
            theirs = {key: header.get(key) for key in config}
            if theirs != config or header.get("format") != FORMAT:
                raise ValueError(f"journal {path} was written by a server with {theirs}, "
                                 f"this one has {config}: use a matching configuration or "
                                 "another --checkpoint-dir")
            first = False
            continue
        at = _JSON.size + text_len
        for tensor, round, numel, k, error, dropped, count, *bound in header:
            indices = values = None
            if count:
                indices = np.frombuffer(body, np.int64, count, at)
                values = np.frombuffer(body, np.float32, count, at + 8 * count)
                at += 12 * count
            binding = tuple(bound[0]) if bound and bound[0] is not None else None
            contributors = tuple(bound[1]) if len(bound) > 1 else None
            changes.append(Change(tensor, round, numel, indices, values, k, error, dropped,
                                  binding, contributors))
    return changes, len(data) - offset
