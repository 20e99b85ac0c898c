"""Prometheus metrics of one shard, through ``prometheus_client``.

Every server has its own :class:`~prometheus_client.CollectorRegistry` (so several
services in one process never mix their counts), served at ``GET /metrics`` on
``--metrics-port`` (on ``--metrics-host``, by default the gRPC ``--bind`` host) by
``prometheus_client``'s HTTP server. Every sample carries the label
``shard="I/N"``. Exposed:

============================================  =========  ==========================================
name                                          type       what
============================================  =========  ==========================================
``hvd_ps_requests_total``                     counter    requests by ``method`` and ``outcome``
``hvd_ps_pushes_total``                       counter    pushes by ``outcome`` (accepted, duplicate)
``hvd_ps_rejected_requests_total``            counter    refusals by ``method`` and ``reason``
``hvd_ps_received_bytes_total``               counter    frame bytes received
``hvd_ps_sent_bytes_total``                   counter    frame bytes sent
``hvd_ps_rounds_closed_total``                counter    rounds closed with every worker's push
``hvd_ps_rounds_failed_total``                counter    rounds failed (deadline, conflict)
``hvd_ps_checkpoints_total``                  counter    checkpoints written
``hvd_ps_checkpoint_write_failures_total``    counter    failed checkpoint writes by ``what``
                                                         (journal, snapshot)
``hvd_ps_round_latency_seconds``              histogram  first accepted push of a round to its close
``hvd_ps_push_to_close_seconds``              histogram  each accepted push to its round's close
``hvd_ps_open_round``                         gauge      the open round of each ``tensor`` (with
                                                         ``--metrics-hide-names``: ``stat="min"``
                                                         and ``"max"`` over tensors, no names)
``hvd_ps_open_sessions``                      gauge      sessions holding state (tensor-name prefix)
``hvd_ps_held_bytes``                         gauge      bytes of arrays the store holds
``hvd_ps_checkpoint_failing``                 gauge      1 while checkpoint writes fail (requests
                                                         are refused, health NOT_SERVING), else 0
============================================  =========  ==========================================

The gauges are read from the store at scrape time through the ``gauges`` callable.
``reason`` is the refusal's kind in snake case (``stale_round``, ``future_round``,
``unknown_tensor``, ``round_failed``, ``pull_timeout``, ``invalid`` for malformed or
inconsistent frames, ``unauthenticated`` for a missing or wrong token...).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # no `_created` sample beside every counter and histogram

GaugeSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hvd_ps_requests_total": ("Requests handled, by method and outcome.",
                              ("method", "outcome")),
    "hvd_ps_pushes_total": ("Pushes, by outcome (accepted or duplicate).", ("outcome",)),
    "hvd_ps_rejected_requests_total": ("Requests refused, by method and reason.",
                                       ("method", "reason")),
    "hvd_ps_received_bytes_total": ("Frame bytes received.", ()),
    "hvd_ps_sent_bytes_total": ("Frame bytes sent.", ()),
    "hvd_ps_rounds_closed_total": ("Rounds closed with every worker's push.", ()),
    "hvd_ps_rounds_failed_total": ("Rounds failed (deadline passed or conflicting pushes).",
                                   ()),
    "hvd_ps_checkpoints_total": ("Checkpoints written.", ()),
    "hvd_ps_checkpoint_write_failures_total": ("Failed checkpoint writes (each retried), by "
                                               "what was written.", ("what",)),
}
GAUGES: dict[str, str] = {
    "hvd_ps_open_round": "The open round of each tensor.",
    "hvd_ps_open_sessions": "Sessions (tensor-name prefixes before '/') holding state.",
    "hvd_ps_held_bytes": "Bytes of arrays the store holds (pushes, residuals, aggregates).",
    "hvd_ps_checkpoint_failing": "1 while checkpoint writes fail and requests are refused.",
}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
"""Histogram bounds in seconds: 1 ms (a loopback round) to 300 s (past the default
120 s deadline)."""
MAX_TRACKED_ROUNDS = 65536
"""Open rounds whose push times are kept for the latency histograms; beyond this the
oldest are forgotten (a tensor that expired never closes its round)."""


def reason(err: BaseException | str) -> str:
    """The ``reason`` label of a refusal: its class name in snake case, ``invalid`` for
    the base ``RequestError``."""
    name = err if isinstance(err, str) else type(err).__name__
    if name == "RequestError":
        return "invalid"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _Gauges(Collector):
    def __init__(self, labels: dict[str, str], gauges: Callable[[], GaugeSamples]) -> None:
        self._labels, self._gauges = labels, gauges

    def collect(self) -> Iterator[GaugeMetricFamily]:
        samples = self._gauges()
        for name, text in GAUGES.items():
            rows = [(dict(labels), value) for (sample, labels), value in samples.items()
                    if sample == name]
            extra = sorted({key for labels, _ in rows for key in labels})
            family = GaugeMetricFamily(name, text, labels=[*self._labels, *extra])
            for labels, value in rows:
                family.add_metric([*self._labels.values(), *(labels[k] for k in extra)],
                                  value)
            yield family


class Metrics:
    """One shard's counters and latency histograms, plus gauges computed on scrape.

    ``labels`` (``{"shard": "I/N"}``) go on every sample; ``gauges()`` returns the gauge
    samples as ``{(name, ((label, value), ...)): value}`` for names in :data:`GAUGES`.
    ``clock`` times the histograms (``time.monotonic``).
    """

    def __init__(self, labels: dict[str, str], gauges: Callable[[], GaugeSamples],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.labels = dict(labels)
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        names = tuple(self.labels)
        self._counters = {name: Counter(name, text, (*names, *extra), registry=self.registry)
                          for name, (text, extra) in COUNTERS.items()}
        self.round_latency = Histogram(
            "hvd_ps_round_latency_seconds", "Time from a round's first accepted push to its "
            "close.", names, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.push_to_close = Histogram(
            "hvd_ps_push_to_close_seconds", "Time from each accepted push to the close of its "
            "round.", names, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_Gauges(self.labels, gauges))
        self._pushes: OrderedDict[tuple[str, int], list[float]] = OrderedDict()
        self._lock = threading.Lock()
        # (name, label values) -> the labelled counter: prometheus_client's labels() checks
        # and merges the label names on every call, several times each request.
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._round_latency = self.round_latency.labels(**self.labels)
        self._push_to_close = self.push_to_close.labels(**self.labels)

    def _counter(self, name: str, labels: dict[str, str]) -> Any:
        key = (name, tuple(labels.items()))
        child = self._children.get(key)
        if child is None:
            if name not in self._counters:
                raise ValueError(f"unknown metric {name!r}; known: {sorted(self._counters)}")
            child = self._counters[name].labels(**self.labels, **labels)
            self._children[key] = child  # a race stores the same child twice: harmless
        return child

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` to counter ``name`` (one of :data:`COUNTERS`) with ``labels``."""
        self._counter(name, labels).inc(amount)

    def value(self, name: str, **labels: str) -> float:
        """The current value of counter ``name`` with ``labels`` (0 if never counted)."""
        if name not in self._counters:
            raise ValueError(f"unknown metric {name!r}; known: {sorted(self._counters)}")
        sample = self.registry.get_sample_value(name, {**self.labels, **labels})
        return 0.0 if sample is None else sample

    def pushed(self, tensor: str, round: int, accepted: bool) -> None:
        """Count a push; an accepted one starts its clock for the latency histograms."""
        self.inc("hvd_ps_pushes_total", outcome="accepted" if accepted else "duplicate")
        if not accepted:
            return
        with self._lock:
            self._pushes.setdefault((tensor, round), []).append(self.clock())
            while len(self._pushes) > MAX_TRACKED_ROUNDS:
                self._pushes.popitem(last=False)

    def round_finished(self, tensor: str, round: int, error: str | None) -> None:
        """Count a closed (``error`` None) or failed round; observe a closed one's
        latencies from the pushes recorded by :meth:`pushed`."""
        with self._lock:
            times = self._pushes.pop((tensor, round), [])
        if error is not None:
            self.inc("hvd_ps_rounds_failed_total")
            return
        self.inc("hvd_ps_rounds_closed_total")
        now = self.clock()
        if times:
            self._round_latency.observe(now - min(times))
        for start in times:
            self._push_to_close.observe(now - start)

    def rejected(self, method: str, err: BaseException | str) -> None:
        """Count a refused request by ``method`` and :func:`reason`."""
        self.inc("hvd_ps_rejected_requests_total", method=method, reason=reason(err))

    def render(self) -> str:
        """The exposition text a scrape returns."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def serve(self, host: str, port: int) -> Any:
        """Serve ``/metrics`` on ``host:port`` (port 0 picks one) from a daemon thread;
        returns the HTTP server (``server_address`` has the bound port)."""
        server, _ = start_http_server(port, host, registry=self.registry)
        return server
