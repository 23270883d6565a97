"""The engine's history of its load (EngineMetrics.sample, on a clock)."""

from app import tuning
from app.engine.metrics import EngineMetrics
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
