"""The engine's history of its load (EngineMetrics.sample, on a clock) and the Server load panel's charts
drawn from it (app.ui.load_charts)."""

import math

from app import tuning
from app.engine.metrics import EngineMetrics
from app.ui.load_charts import MINUTES, chart_values
from tests.conftest import wait_for


def quiet_metrics(monkeypatch, samples_kept: int) -> EngineMetrics:
    """Metrics whose clock does not tick during the test (the test samples), keeping `samples_kept`."""
    monkeypatch.setattr(tuning, "LOAD_SAMPLE_S", 3600.0)
    monkeypatch.setattr(tuning, "LOAD_HISTORY_S", 3600.0 * samples_kept)
    return EngineMetrics()


def test_the_history_keeps_the_newest_samples_in_order(monkeypatch):
    metrics = quiet_metrics(monkeypatch, samples_kept=3)
    running = iter(range(5))
    metrics.gauges["batch_size"] = lambda: next(running)
    for _ in range(5):
        metrics.sample()
    history = metrics.history()
    assert [sample["running"] for sample in history] == [2, 3, 4]
    assert [sample["time"] for sample in history] == sorted(sample["time"] for sample in history)


def test_a_sample_holds_the_load_and_the_recent_first_tokens(monkeypatch):
    metrics = quiet_metrics(monkeypatch, samples_kept=10)
    metrics.gauges.update(batch_size=lambda: 3, queue_depth=lambda: 2, gpu_memory_bytes=lambda: 2**30)
    metrics.tokens(50)
    for tenths in range(1, 11):
        metrics.first_token(tenths / 10)
    metrics.sample()
    sample = metrics.history()[-1]
    assert (sample["running"], sample["waiting"], sample["gpu_memory_bytes"]) == (3, 2, 2**30)
    assert sample["tokens_per_s"] > 0
    assert (sample["ttft_p50_s"], sample["ttft_p95_s"]) == (0.5, 1.0)  # nearest rank, exact
    # Once they are older than the window, a sample has no first-token percentiles.
    monkeypatch.setattr(tuning, "LOAD_FIRST_TOKEN_WINDOW_S", 0.05)
    assert wait_for(lambda: metrics.sample() or metrics.history()[-1]["ttft_p50_s"] is None, 30)
    assert metrics.history()[-1]["ttft_p95_s"] is None


def test_the_openai_backends_requests_in_flight_count_as_running(monkeypatch):
    metrics = quiet_metrics(monkeypatch, samples_kept=2)
    metrics.gauges["requests_in_flight"] = lambda: 4  # app.engine.openai_backend's only gauge
    metrics.sample()
    sample = metrics.history()[-1]
    assert (sample["running"], sample["waiting"], sample["gpu_memory_bytes"]) == (4, 0, None)


def test_the_history_is_sampled_on_a_clock_and_emptied_by_a_reset(monkeypatch):
    monkeypatch.setattr(tuning, "LOAD_SAMPLE_S", 0.01)
    metrics = EngineMetrics()
    assert wait_for(lambda: len(metrics.history()) >= 3, 30)
    times = [sample["time"] for sample in metrics.history()]
    assert times == sorted(times)
    metrics.reset()  # after the warm-up: the panel shows users' load only
    assert len(metrics.history()) < 3


def test_a_failing_gauge_does_not_stop_the_clock(monkeypatch):
    monkeypatch.setattr(tuning, "LOAD_SAMPLE_S", 0.01)
    metrics = EngineMetrics()
    failures = iter([RuntimeError("the GPU is gone")])

    def batch_size():
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return 1

    metrics.gauges["batch_size"] = batch_size
    assert wait_for(lambda: any(sample["running"] == 1 for sample in metrics.history()), 30)


def test_the_charts_show_the_history_by_minutes_before_the_newest_sample():
    assert chart_values([]) == [None] * 4
    history = [{"time": 1000.0 + 30 * i, "tokens_per_s": 10.0 * i, "running": i, "waiting": 1,
                "ttft_p50_s": None if i == 1 else 0.2, "ttft_p95_s": None if i == 1 else 0.4, "gpu_memory_bytes": None}
               for i in range(3)]
    tokens, replies, first_token, gpu = chart_values(history)
    assert list(tokens[MINUTES]) == [-1.0, -0.5, 0.0] and list(tokens["tokens/s"]) == [0.0, 10.0, 20.0]
    assert sorted(set(replies["replies"])) == ["answering", "waiting"]
    assert list(replies[replies["replies"] == "answering"]["count"]) == [0, 1, 2]
    p95 = list(first_token[first_token["percentile"] == "p95"]["ms"])
    assert p95[0] == 400 and math.isnan(p95[1]) and p95[2] == 400  # the line breaks where none came
    assert gpu is None  # no GPU: the chart stays empty under its label
