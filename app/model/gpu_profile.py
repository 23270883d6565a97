"""Where the GPU's time goes while the engine serves: every kernel and copy over a window, summed up.

An operator's diagnostic (and `benchmarks/gpu_timeline.py`'s): `ModelManager.profile_gpu(seconds)` runs
torch's profiler, GPU side only, in the process that drives the GPU (the engine's process by default),
while users are served as usual, and answers with how much of the window the GPU was busy on any stream,
each stream's busy time, the time two streams ran at once, the idle gaps (and which kernels they followed),
the kernels' time by kind and the costliest kernels by name, the garbage collector's pauses in the window,
and the engine's counters at its start and end.
"""

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass

from app import tuning
from app.messages import MSG_PROFILE_NEEDS_CUDA, MSG_PROFILE_SECONDS
from app.errors import UserError

# Kernel names -> kind, first match wins (cuBLAS/cuBLASLt, cuDNN and flash attention, Triton's).
KINDS = (("matrix products", ("gemm", "nvjet", "cutlass", "xmma", "splitk")),
         ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
         ("Triton kernels", ("triton", "chunk_", "fused_recurrent", "l2norm")))
NAME_CHARS = 120
TOP_NAMES = 12


@dataclass(frozen=True)
class Span:
    start_ns: int
    end_ns: int
    stream: int
    name: str
    from_graph: bool  # launched by a CUDA graph's replay (the decode step, text prefills of few tokens)


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


def short(name: str) -> str:
    """A kernel's name, cut to what tells it apart in a report (templated names run to thousands of characters)."""
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS - 3] + "..."


def idle_gaps(spans: list[Span], gap_ms: float) -> list[tuple[float, str]]:
    """Each idle gap of at least `gap_ms` (ms), with the kernel that ran last before it: what the GPU
    finished before it ran out of work, so which launches the host was late with."""
    gaps = []
    last_end, last_name = None, ""
    for span in sorted(spans, key=lambda span: span.start_ns):
        if last_end is not None and (span.start_ns - last_end) / 1e6 >= gap_ms:
            gaps.append(((span.start_ns - last_end) / 1e6, last_name))
        if last_end is None or span.end_ns > last_end:
            last_end, last_name = span.end_ns, short(span.name)
    return gaps


def top(ms_by_name: dict[str, float], counts: dict[str, int] | None = None) -> dict:
    names = sorted(ms_by_name, key=lambda name: -ms_by_name[name])[:TOP_NAMES]
    if counts is None:
        return {name: round(ms_by_name[name], 2) for name in names}
    return {name: {"ms": round(ms_by_name[name], 2), "count": counts[name]} for name in names}


def summary(spans: list[Span], gap_ms: float = 0.05) -> dict:
    """What the GPU did over the window the spans cover."""
    if not spans:
        return {}
    window = union(spans)
    window_ms, busy = (window[-1][1] - window[0][0]) / 1e6, busy_ms(window)
    gaps = idle_gaps(spans, gap_ms)
    idle_after: dict[str, float] = {}
    for ms, name in gaps:
        idle_after[name] = idle_after.get(name, 0.0) + ms
    streams = {stream: busy_ms(union([s for s in spans if s.stream == stream])) for stream in {s.stream for s in spans}}
    kinds: dict[str, float] = {}
    by_name: dict[str, float] = {}
    counts: dict[str, int] = {}
    for span in spans:
        ms, name, label = (span.end_ns - span.start_ns) / 1e6, short(span.name), kind(span)
        kinds[label] = kinds.get(label, 0.0) + ms
        by_name[name] = by_name.get(name, 0.0) + ms
        counts[name] = counts.get(name, 0) + 1
    return {
        "window_ms": round(window_ms, 2),
        "busy_ms": round(busy, 2),
        "busy_share": round(busy / window_ms, 3),
        "busy_ms_by_stream": {str(stream): round(ms, 2) for stream, ms in sorted(streams.items(), key=lambda item: -item[1])},
        "two_streams_at_once_ms": round(sum(streams.values()) - busy, 2),
        "gaps": {"at_least_ms": gap_ms, "count": len(gaps), "total_ms": round(sum(ms for ms, _ in gaps), 2),
                 "longest_ms": [round(ms, 2) for ms, _ in sorted(gaps, reverse=True)[:5]]},
        "kernel_ms_by_kind": {label: round(ms, 2) for label, ms in sorted(kinds.items(), key=lambda item: -item[1])},
        "from_graphs_ms": round(sum((s.end_ns - s.start_ns) / 1e6 for s in spans if s.from_graph), 2),
        "top_kernels": top(by_name, counts),
        "idle_ms_after": top(idle_after),
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


@contextmanager
def collector_pauses():
    """The garbage collector's pauses while the block runs, in ms by generation. A collection holds the GIL,
    so the scheduler waits for it; a pause also counts any wait for the GIL after a finalizer let go of it."""
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = []

    def timed_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses[info["generation"]].append((time.perf_counter() - started.pop()) * 1000)

    gc.callbacks.append(timed_collection)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timed_collection)


def record(seconds: float, read_counters) -> dict:
    """The GPU's activity over the next `seconds`, summed up, with the collector's pauses and the engine's
    counters (`read_counters()`) at the window's start and end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not 0 < seconds <= tuning.PROFILE_GPU_MAX_S:
        raise UserError(MSG_PROFILE_SECONDS.format(max=tuning.PROFILE_GPU_MAX_S))
    if not torch.cuda.is_available():
        raise UserError(MSG_PROFILE_NEEDS_CUDA)
    # A first short profile starts CUPTI outside the window: its start stalled the GPU's work (the first
    # 2 s window at 200 users, 2026-12-01, saw a third of the engine's tokens/s).
    with profile(activities=[ProfilerActivity.CUDA]):
        time.sleep(0.5)
    time.sleep(1.0)
    with profile(activities=[ProfilerActivity.CUDA]) as run, collector_pauses() as pauses:
        start = read_counters()
        time.sleep(seconds)
        end = read_counters()
    spans, graph_launches = spans_of(run)
    return {**summary(spans), "graph_launches": graph_launches,
            "gc_pauses": {f"generation {generation}": {"count": len(times), "total_ms": round(sum(times), 1),
                                                       "longest_ms": round(max(times, default=0.0), 1)}
                          for generation, times in pauses.items()},
            "counters": {"start": start, "end": end}}
