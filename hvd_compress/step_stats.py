"""``StepStats``: the pipeline's counters of one step (or of all steps so far)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class StepStats:
    """Bytes of one step on this rank, all measured from the tensors actually handed over.

    ``payload_bytes``: encoded size of this rank's gradients (what a ring all-reduce would
    circulate; the wire-saving ratio is ``dense_bytes / payload_bytes``). ``dense_bytes``:
    the same gradients as float32. ``collective_bytes``: bytes of each tensor's requests,
    by round name (``dense``, ``fp16``, ``scatter``, ``gather``, ``P``, ``Q``...), counted
    per tensor whether or not the request travelled fused with others. ``collectives``:
    collectives started (a fused one counts once), i.e. Horovod negotiations.
    ``seconds``: where this rank's time went, by part: ``feedback`` (adding residuals),
    ``scheme`` (the schemes' own code: encoding, decoding, products), ``fuse`` (cutting and
    joining fused requests and starting collectives), ``wait <round>`` (blocked until a
    round's collectives finished: the transfer, Horovod's negotiation and cycle, and the
    slowest rank), ``settle`` (a bucket's finite check, residual updates and writes done
    as its last round ended while another bucket's rounds were still in flight:
    :meth:`~hvd_compress.pipeline.Pipeline._settle`), ``commit`` (the rest of that work,
    after the step's last round: the last buckets' share, installing the residuals and
    state), ``report``
    (the compression error of the tensors without error feedback, whose residual update
    does not measure it: :meth:`~hvd_compress.feedback.ErrorFeedback.observe_sent`).
    ``sparse_entries``: the entries of the tensors a sparse scheme sent as (index, value)
    pairs (top-k, random-k, threshold, DGC); ``sent_entries``: the pairs this rank sent for
    them; ``density``: ``sent_entries / sparse_entries``, the fraction of those tensors'
    entries that travelled (fixed by the ratio for top-k, random-k and DGC after warm-up;
    following the gradients for threshold), ``None`` when no tensor went sparse.
    """

    payload_bytes: int = 0
    dense_bytes: int = 0
    collective_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    compressed_tensors: int = 0
    dense_tensors: int = 0
    collectives: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sparse_entries: int = 0
    sent_entries: int = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes / max(self.payload_bytes, 1)

    @property
    def density(self) -> float | None:
        return self.sent_entries / self.sparse_entries if self.sparse_entries else None

    def add(self, other: StepStats) -> None:
        self.payload_bytes += other.payload_bytes
        self.dense_bytes += other.dense_bytes
        self.compressed_tensors += other.compressed_tensors
        self.dense_tensors += other.dense_tensors
        self.collectives += other.collectives
        self.sparse_entries += other.sparse_entries
        self.sent_entries += other.sent_entries
        for key, value in other.collective_bytes.items():
            self.collective_bytes[key] += value
        for key, seconds in other.seconds.items():
            self.seconds[key] += seconds
