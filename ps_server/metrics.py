"""Prometheus metrics in the text exposition format, served by the standard library.

``GET /metrics`` on ``--metrics-port`` returns counters kept by the server and gauges read
from the store at scrape time (format 0.0.4, as Prometheus scrapes it).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HELP = {
    "hvd_ps_requests_total": ("counter", "Requests handled, by method and outcome."),
    "hvd_ps_received_bytes_total": ("counter", "Frame bytes received."),
    "hvd_ps_sent_bytes_total": ("counter", "Frame bytes sent."),
    "hvd_ps_rounds_closed_total": ("counter", "Rounds closed with every worker's push."),
    "hvd_ps_rounds_failed_total": ("counter", "Rounds failed at their deadline."),
    "hvd_ps_checkpoints_total": ("counter", "Checkpoints written."),
    "hvd_ps_open_round": ("gauge", "The open round of each tensor."),
}


class Metrics:
    """Thread-safe counters plus gauges computed on scrape by ``gauges()``."""

    def __init__(self, labels: dict[str, str],
                 gauges: Callable[[], dict[tuple[str, tuple[tuple[str, str], ...]], float]]
                 ) -> None:
        self.labels = labels
        self._gauges = gauges
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = \
            defaultdict(float)
        self._lock = threading.Lock()

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        with self._lock:
            self._counters[(name, tuple(sorted(labels.items())))] += amount

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def render(self) -> str:
        with self._lock:
            samples = dict(self._counters)
        samples.update(self._gauges())
        lines = []
        for name in sorted({name for name, _ in samples}):
            kind, text = _HELP.get(name, ("untyped", name))
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            for (sample, labels), value in sorted(samples.items()):
                if sample == name:
                    pairs = {**self.labels, **dict(labels)}
                    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items())
                    lines.append(f"{name}{{{body}}} {value:g}")
        return "\n".join(lines) + "\n"

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = metrics.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes are not worth a log line each

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return server


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
