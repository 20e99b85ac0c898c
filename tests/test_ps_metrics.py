"""ps_server.metrics: counters through the cached labelled children."""

from __future__ import annotations

import pytest

from ps_server.metrics import Metrics


def make() -> Metrics:
    return Metrics({"shard": "0/1"}, lambda: {})


def test_cached_counters_count_per_label_set():
    m = make()
    for _ in range(3):
        m.inc("hvd_ps_requests_total", method="push", outcome="accepted")
    m.inc("hvd_ps_requests_total", method="pull", outcome="ok")
    m.inc("hvd_ps_sent_bytes_total", 100)
    m.inc("hvd_ps_sent_bytes_total", 23)
    assert m.value("hvd_ps_requests_total", method="push", outcome="accepted") == 3
    assert m.value("hvd_ps_requests_total", method="pull", outcome="ok") == 1
    assert m.value("hvd_ps_requests_total", method="push", outcome="duplicate") == 0
    assert m.value("hvd_ps_sent_bytes_total") == 123
    text = m.render()
    assert 'hvd_ps_requests_total{method="push",outcome="accepted",shard="0/1"} 3.0' in text


def test_two_services_in_one_process_keep_their_own_counts():
    a, b = make(), make()
    a.inc("hvd_ps_rounds_closed_total")
    assert (a.value("hvd_ps_rounds_closed_total"), b.value("hvd_ps_rounds_closed_total")) \
        == (1, 0)


def test_an_unknown_counter_is_refused_every_time():
    m = make()
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown metric 'hvd_ps_nope'"):
            m.inc("hvd_ps_nope")


def test_round_latencies_observe_each_accepted_push():
    now = [10.0]
    m = Metrics({"shard": "0/1"}, lambda: {}, clock=lambda: now[0])
    m.pushed("t", 1, True)
    now[0] = 10.5
    m.pushed("t", 1, True)
    m.pushed("t", 1, False)
    now[0] = 11.0
    m.round_finished("t", 1, None)
    get = m.registry.get_sample_value
    assert get("hvd_ps_round_latency_seconds_count", {"shard": "0/1"}) == 1
    assert get("hvd_ps_round_latency_seconds_sum", {"shard": "0/1"}) == pytest.approx(1.0)
    assert get("hvd_ps_push_to_close_seconds_count", {"shard": "0/1"}) == 2
    assert get("hvd_ps_push_to_close_seconds_sum", {"shard": "0/1"}) == pytest.approx(1.5)
    assert m.value("hvd_ps_pushes_total", outcome="duplicate") == 1
