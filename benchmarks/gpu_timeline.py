"""Where the GPU's time goes while N users are served: every kernel and copy for a few seconds.

concurrency.py measures what users get and how the scheduler thread spends its time; this looks at the
GPU itself. The engine runs in this process (as with concurrency.py --in-process-engine: the users'
threads share its GIL), N users send the benchmark's request back to back, and after --settle seconds
torch's profiler records the GPU's activity for --seconds. Reported: how much of the window the GPU was
busy on any stream, each stream's busy time, the time two streams ran at once, the idle gaps, and the
kernels' time by kind; then the busy time per request, and the engine's counters (with the garbage
collector's pauses) over the profiled window and over as long a window just before it (what the profiler
itself costs). Needs a CUDA GPU:

    python benchmarks/gpu_timeline.py --users 200 --settle 10 --seconds 6 --json timeline.json
"""

import argparse
import gc
import json
import os
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.concurrency import drive_users, engine_request  # noqa: E402
from benchmarks.real_shape import DEFAULT_FOLDER, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.report import write_json  # noqa: E402

# Kernel names -> kind, first match wins (cuBLAS/cuBLASLt, cuDNN and flash attention, Triton's).
KINDS = (("matrix products", ("gemm", "nvjet", "cutlass", "xmma", "splitk")),
         ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
         ("Triton kernels", ("triton", "chunk_", "fused_recurrent", "l2norm")))


@dataclass(frozen=True)
class Span:
    start_ns: int
    end_ns: int
    stream: int
    name: str
    from_graph: bool  # launched by a CUDA graph's replay (the decode step, small waves' text prefill)


def kind(span: Span) -> str:
    name = span.name.lower()
    if "memcpy" in name or "memset" in name:
        return "copies"
    for label, keys in KINDS:
        if any(key in name for key in keys):
            return label
    return "other kernels"


def union(spans: list[Span]) -> list[tuple[int, int]]:
    """The spans' time merged into disjoint intervals, in order."""
    merged: list[list[int]] = []
    for span in sorted(spans, key=lambda span: span.start_ns):
        if merged and span.start_ns <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.end_ns)
        else:
            merged.append([span.start_ns, span.end_ns])
    return [(start, end) for start, end in merged]


def busy_ms(intervals: list[tuple[int, int]]) -> float:
    return sum(end - start for start, end in intervals) / 1e6


def summary(spans: list[Span], gap_ms: float = 0.05) -> dict:
    """What the GPU did over the window the spans cover."""
    if not spans:
        return {}
    window = union(spans)
    window_ms, busy = (window[-1][1] - window[0][0]) / 1e6, busy_ms(window)
    gaps = [(start - end) / 1e6 for (_, end), (start, _) in zip(window, window[1:]) if (start - end) / 1e6 >= gap_ms]
    streams = {stream: busy_ms(union([s for s in spans if s.stream == stream])) for stream in {s.stream for s in spans}}
    kinds: dict[str, float] = {}
    for span in spans:
        label = kind(span)
        kinds[label] = kinds.get(label, 0.0) + (span.end_ns - span.start_ns) / 1e6
    return {
        "window_ms": round(window_ms, 2),
        "busy_ms": round(busy, 2),
        "busy_share": round(busy / window_ms, 3),
        "busy_ms_by_stream": {str(stream): round(ms, 2) for stream, ms in sorted(streams.items(), key=lambda item: -item[1])},
        "two_streams_at_once_ms": round(sum(streams.values()) - busy, 2),
        "gaps": {"at_least_ms": gap_ms, "count": len(gaps), "total_ms": round(sum(gaps), 2),
                 "longest_ms": [round(gap, 2) for gap in sorted(gaps, reverse=True)[:5]]},
        "kernel_ms_by_kind": {label: round(ms, 2) for label, ms in sorted(kinds.items(), key=lambda item: -item[1])},
        "from_graphs_ms": round(sum((s.end_ns - s.start_ns) / 1e6 for s in spans if s.from_graph), 2),
    }


def spans_of(profile) -> tuple[list[Span], int]:
    """The GPU's kernels, copies and fills of a torch.profiler run, each with the stream it ran on, and the
    number of CUDA graph replays launched. A graph's kernels carry the correlation id of the runtime call
    that launched the graph (CUPTI's), as any kernel carries its launch's."""
    from torch.autograd import DeviceType

    events = list(profile.profiler.kineto_results.events())
    graph_launches = {event.correlation_id() for event in events
                      if event.device_type() == DeviceType.CPU and event.name().startswith("cudaGraphLaunch")}
    spans = [Span(event.start_ns(), event.start_ns() + event.duration_ns(), event.device_resource_id(), event.name(),
                  event.correlation_id() in graph_launches)
             for event in events if event.device_type() == DeviceType.CUDA and event.duration_ns() > 0]
    return spans, len(graph_launches)


def served(manager, seconds: float) -> dict:
    """What the engine did over the next `seconds`, from its counters, and the garbage collector's pauses
    (a collection holds the GIL, so the scheduler waits for it; a pause also counts any wait for the GIL
    after a finalizer let go of it)."""
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = []

    def timed_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses[info["generation"]].append((time.perf_counter() - started.pop()) * 1000)

    before = manager.metrics.snapshot()
    gc.callbacks.append(timed_collection)
    time.sleep(seconds)
    gc.callbacks.remove(timed_collection)
    after = manager.metrics.snapshot()
    tokens, steps = after["tokens_generated"] - before["tokens_generated"], after["decode_steps"] - before["decode_steps"]
    return {"prefill_waves": after["prefill_waves"] - before["prefill_waves"], "decode_steps": steps, "tokens": tokens,
            "requests_finished": after["requests"]["finished"] - before["requests"]["finished"],
            "tokens_per_s": round(tokens / seconds, 1), "tokens_per_step": round(tokens / steps, 1) if steps else None,
            "gc_pauses": {f"generation {generation}": {"count": len(times), "total_ms": round(sum(times), 1),
                                                       "longest_ms": round(max(times, default=0.0), 1)}
                          for generation, times in pauses.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of load before the profile")
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="seconds profiled (more than one cycle of waves and decode steps at 200 users)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from app.config import AppConfig
    from app.engine.manager import ModelManager
    from app.engine.settings import GenerationSettings

    if not torch.cuda.is_available():
        sys.exit("gpu_timeline.py needs a CUDA GPU")
    config = AppConfig(model=ensure_real_shape_checkpoint(args.checkpoint), queue_size=args.users + 1, engine_process=False)
    manager = ModelManager(config)
    manager.load()
    manager.warm_up()
    _, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    stop_at = time.time() + args.settle + 2 * args.seconds + 6.5
    users = threading.Thread(target=drive_users, daemon=True, args=(
        args.users, stop_at, stop_at + 30, lambda: lambda abort: engine_request(manager, messages, settings, abort)))
    users.start()
    time.sleep(args.settle)
    # The same length of time unprofiled, then profiled: how much the profiler itself slowed the engine.
    # A first short profile starts CUPTI outside the window (the first run, 2026-12-01, recorded a third
    # of the tokens/s the engine reaches unprofiled).
    unprofiled = served(manager, args.seconds)
    with profile(activities=[ProfilerActivity.CUDA]):
        time.sleep(0.5)
    time.sleep(1.0)
    # The GPU's side only: recording every CPU op of 200 users' threads would slow the scheduler down.
    with profile(activities=[ProfilerActivity.CUDA]) as run:
        profiled = served(manager, args.seconds)
    spans, graph_launches = spans_of(run)
    timeline = summary(spans)
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "users": args.users, "seconds": args.seconds, **timeline, "graph_launches": graph_launches,
              "profiled": profiled, "unprofiled": unprofiled,
              # A request's worth: its new tokens among those decoded in the window (the requests finished in
              # a window of a few seconds are a poor count of the work done in it: they come in bursts).
              "gpu_busy_ms_per_request": round(timeline["busy_ms"] * args.new_tokens / profiled["tokens"], 2)
              if profiled["tokens"] and spans else None}
    print(json.dumps(report), flush=True)
    write_json(args.json, report)
    users.join()


if __name__ == "__main__":
    main()
