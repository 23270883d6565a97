"""Serving metrics in Prometheus text format (for /metrics), as a snapshot for the UI's live panel, and as
the last minutes' history for the panel's charts."""

import logging
import math
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from typing import Callable

from app import tuning

log = logging.getLogger(__name__)

TTFT_BUCKETS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
TOKEN_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)
OUTCOMES = ("finished", "stopped", "error", "busy")


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (None before any observation)."""
        if not self.count:
            return None
        target, running = q * self.count, 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            if running >= target:
                return bound
        return float("inf")

    def lines(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            label = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{le="{label}"}} {running}')
        return lines + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


def _nearest_rank(ordered: list[float], q: float) -> float | None:
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)] if ordered else None


def _sample_on_a_clock(metrics_ref: weakref.ref) -> None:
    """The history's clock: a sample every LOAD_SAMPLE_S, until the metrics are dropped (a weak reference, so
    that a test's engine is not kept alive by its sampler)."""
    while True:
        time.sleep(tuning.LOAD_SAMPLE_S)
        metrics = metrics_ref()
        if metrics is None:
            return
        try:
            metrics.sample()
        except Exception:  # a gauge that fails (the GPU lost, say) must not stop the clock
            log.exception("Sampling the load for the Server load panel failed")
        del metrics


class EngineMetrics:
    """Counters the engine updates as it works; gauges are read from the engine when rendered. A thread of
    its own samples the load on a clock into a bounded history, the one every web process reads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.gauges: dict[str, Callable[[], float | None]] = {}
        self.on_reset: list[Callable[[], None]] = []  # e.g. the GPU's peak memory starts again
        self._history: deque[dict] = deque(maxlen=round(tuning.LOAD_HISTORY_S / tuning.LOAD_SAMPLE_S))
        self.reset()
        threading.Thread(target=_sample_on_a_clock, args=(weakref.ref(self),), name="metrics-history",
                         daemon=True).start()

    def reset(self) -> None:
        """Counters, histograms and the history back to zero (gauges stay)."""
        for hook in self.on_reset:
            hook()
        with self._lock:
            self.started = time.monotonic()
            self.requests = dict.fromkeys(OUTCOMES, 0)
            self.decode_steps = 0
            self.prefill_waves = 0
            # The scheduler's time on the GPU by phase, and the media encoder's (on CUDA it overlaps the others).
            self.busy_seconds = {"prefill": 0.0, "decode": 0.0, "vision": 0.0}
            self.tokens_generated = 0
            self.ttft = Histogram(TTFT_BUCKETS_S)
            self.token_latency = Histogram(TOKEN_BUCKETS_S)
            self._recent_tokens: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
            self._recent_first_tokens: deque[tuple[float, float]] = deque()  # (time, seconds), for the history
            self._history.clear()

    def request_done(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)
            self._recent_first_tokens.append((time.monotonic(), seconds))

    def prefill_work(self, seconds: float) -> None:
        """The scheduler's thread spent `seconds` starting a wave's media encoding, or prefilling it."""
        with self._lock:
            self.busy_seconds["prefill"] += seconds

    def wave_encoded(self, seconds: float) -> None:
        """A wave's media took `seconds` to encode (on CUDA on a stream of their own, alongside the rest)."""
        with self._lock:
            self.busy_seconds["vision"] += seconds
            self.prefill_waves += 1

    def decode_work(self, seconds: float) -> None:
        """The scheduler's thread spent `seconds` on decode steps (launching one, handing out another)."""
        with self._lock:
            self.busy_seconds["decode"] += seconds

    def decode_step(self, seconds: float, count: int) -> None:
        """A decode step gave `count` tokens, `seconds` after it was launched."""
        with self._lock:
            self.decode_steps += 1
            self.token_latency.observe(seconds, count)
        self.tokens(count)

    def tokens(self, count: int) -> None:
        """`count` tokens were generated."""
        now = time.monotonic()
        with self._lock:
            self.tokens_generated += count
            self._recent_tokens.append((now, count))
            while self._recent_tokens and self._recent_tokens[0][0] < now - 10:
                self._recent_tokens.popleft()

    def tokens_per_s(self) -> float:
        """Aggregate generation rate over the last 10 seconds."""
        now = time.monotonic()
        with self._lock:
            recent = sum(tokens for at, tokens in self._recent_tokens if at >= now - 10)
        return recent / min(10.0, max(now - self.started, 1e-3))

    def snapshot(self) -> dict:
        gauges = {name: read() for name, read in self.gauges.items()}
        rate = round(self.tokens_per_s(), 1)
        with self._lock:
            return {
                **gauges,
                "tokens_per_s": rate,
                "requests": dict(self.requests),
                "decode_steps": self.decode_steps,
                "prefill_waves": self.prefill_waves,
                "busy_seconds": dict(self.busy_seconds),
                "tokens_generated": self.tokens_generated,
                "ttft_p50_s": self.ttft.quantile(0.5),
                "ttft_p95_s": self.ttft.quantile(0.95),
                "token_latency_p50_s": self.token_latency.quantile(0.5),
            }

    def sample(self) -> None:
        """One point of the history: the load now, and exact percentiles of the first tokens of the last
        LOAD_FIRST_TOKEN_WINDOW_S (None if none came; the snapshot's are the histogram's, since the reset)."""
        snapshot = self.snapshot()
        since = time.monotonic() - tuning.LOAD_FIRST_TOKEN_WINDOW_S
        with self._lock:
            while self._recent_first_tokens and self._recent_first_tokens[0][0] < since:
                self._recent_first_tokens.popleft()
            first_tokens = [seconds for _, seconds in self._recent_first_tokens]
        first_tokens.sort()  # outside the lock, which the scheduler's thread takes at every step
        sample = {
            "time": time.time(),
            "tokens_per_s": snapshot["tokens_per_s"],
            # The OpenAI backend has no batch or wait line of its own: its requests in flight are running.
            "running": snapshot.get("batch_size", snapshot.get("requests_in_flight", 0)),
            "waiting": snapshot.get("queue_depth", 0),
            "ttft_p50_s": _nearest_rank(first_tokens, 0.5),
            "ttft_p95_s": _nearest_rank(first_tokens, 0.95),
            "gpu_memory_bytes": snapshot.get("gpu_memory_bytes"),
        }
        with self._lock:
            self._history.append(sample)

    def history(self) -> list[dict]:
        """The samples of the last LOAD_HISTORY_S, oldest first."""
        with self._lock:
            return list(self._history)

    def prometheus(self) -> str:
        gauges = {name: read() for name, read in self.gauges.items()}
        with self._lock:
            lines = ["# HELP minicpmv_requests_total Requests by outcome.", "# TYPE minicpmv_requests_total counter"]
            lines += [f'minicpmv_requests_total{{outcome="{outcome}"}} {count}' for outcome, count in self.requests.items()]
            lines += ["# HELP minicpmv_decode_steps_total Decode steps run (each serves every sequence in the batch).",
                      "# TYPE minicpmv_decode_steps_total counter", f"minicpmv_decode_steps_total {self.decode_steps}",
                      "# HELP minicpmv_prefill_waves_total Prefill waves run (newcomers encoded and prefilled together).",
                      "# TYPE minicpmv_prefill_waves_total counter", f"minicpmv_prefill_waves_total {self.prefill_waves}",
                      "# HELP minicpmv_engine_busy_seconds_total Time spent running the model, by phase "
                      "(vision: encoding media, on a GPU alongside the other phases).",
                      "# TYPE minicpmv_engine_busy_seconds_total counter",
                      *(f'minicpmv_engine_busy_seconds_total{{phase="{phase}"}} {seconds}'
                        for phase, seconds in self.busy_seconds.items()),
                      "# HELP minicpmv_tokens_generated_total Tokens generated for all requests.",
                      "# TYPE minicpmv_tokens_generated_total counter", f"minicpmv_tokens_generated_total {self.tokens_generated}",
                      "# HELP minicpmv_time_to_first_token_seconds From request to first token, preprocessing included.",
                      "# TYPE minicpmv_time_to_first_token_seconds histogram", *self.ttft.lines("minicpmv_time_to_first_token_seconds"),
                      "# HELP minicpmv_token_latency_seconds Time between two tokens of one request (a decode step).",
                      "# TYPE minicpmv_token_latency_seconds histogram", *self.token_latency.lines("minicpmv_token_latency_seconds")]
        for name, value in gauges.items():
            if value is not None:
                lines += [f"# TYPE minicpmv_{name} gauge", f"minicpmv_{name} {value}"]
        return "\n".join(lines) + "\n"
