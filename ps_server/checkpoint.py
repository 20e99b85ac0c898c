"""Checkpoints of a shard's state: rounds, server residuals, last aggregates.

One file per shard, ``shard-<i>-of-<n>.npz`` in the checkpoint directory: a numpy ``.npz``
(no pickle) holding a JSON ``meta`` entry (the :meth:`ShardStore.snapshot` without arrays)
and, per tensor ``j``, arrays ``residual.<j>``, ``indices.<j>`` and ``values.<j>`` when
present. It is written to a temporary file, flushed to disk and renamed over the previous
one, so a crash at any moment leaves the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1


def path_for(directory: str | Path, shard: int, shards: int) -> Path:
    return Path(directory) / f"shard-{shard}-of-{shards}.npz"


def save(path: Path, snapshot: dict[str, Any]) -> None:
    """Atomically write a :meth:`ShardStore.snapshot` to ``path``."""
    arrays: dict[str, np.ndarray] = {}
    tensors = []
    for j, (name, t) in enumerate(snapshot["tensors"].items()):
        last = t["last"]
        entry = {"name": name, "numel": t["numel"], "round": t["round"], "last": None}
        if t["residual"] is not None:
            arrays[f"residual.{j}"] = t["residual"]
        if last is not None:
            entry["last"] = {"round": last["round"], "error": last["error"]}
            if last["error"] is None:
                arrays[f"indices.{j}"] = last["indices"]
                arrays[f"values.{j}"] = last["values"]
        tensors.append(entry)
    meta = {key: snapshot[key] for key in ("workers", "shard", "shards", "mode")}
    meta.update(format=FORMAT, tensors=tensors)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any] | None:
    """The snapshot saved at ``path``, or None if there is none."""
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
                         f"reads format {FORMAT}")
    tensors = {}
    for j, entry in enumerate(meta["tensors"]):
        last = entry["last"]
        if last is not None:
            last = dict(last, indices=arrays.get(f"indices.{j}"),
                        values=arrays.get(f"values.{j}"))
        tensors[entry["name"]] = {"numel": entry["numel"], "round": entry["round"],
                                  "residual": arrays.get(f"residual.{j}"), "last": last}
    snapshot = {key: meta[key] for key in ("workers", "shard", "shards", "mode")}
    snapshot["tensors"] = tensors
    return snapshot
