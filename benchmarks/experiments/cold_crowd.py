"""A crowd arriving at a freshly started engine: what it gets, and where the scheduler's time goes.

Loads the model, warms it up as the app does, then sends --users users at once (each sending requests
back to back, as in concurrency.py) --rounds times, sampling the scheduler thread's Python stack every
few milliseconds. Prints each round's results and its most frequent stacks (Triton compiling, the
vision tower, a decode step...). Run on a GPU machine:

    python benchmarks/experiments/cold_crowd.py --users 200 --duration 10 --grace 8
"""

import argparse
import collections
import json
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.concurrency import run_level  # noqa: E402
from benchmarks.requesters import engine_request  # noqa: E402
from benchmarks.real_shape import DEFAULT_FOLDER, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402


class StackSampler:
    """Counts the innermost frames of one thread's stack, sampled from a thread of its own."""

    def __init__(self, thread_name: str, depth: int = 8, interval_s: float = 0.005):
        self.thread_name, self.depth, self.interval_s = thread_name, depth, interval_s
        self.counts: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            target = next((t for t in threading.enumerate() if t.name == self.thread_name), None)
            frame = sys._current_frames().get(target.ident) if target else None
            if frame is not None:
                stack = traceback.extract_stack(frame)[-self.depth:]
                self.counts[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(stack))] += 1
            time.sleep(self.interval_s)

    def top(self, count: int) -> list[tuple[float, str]]:
        total = sum(self.counts.values()) or 1
        return [(round(100 * n / total, 1), stack) for stack, n in self.counts.most_common(count)]

    def stop(self) -> None:
        self._stop.set()


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint instead of the real-shape random one")
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--grace", type=float, default=8.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--stacks", type=int, default=12, help="most frequent scheduler stacks shown per round")
    args = parser.parse_args()

    from app.config import AppConfig
    from app.engine.core import ModelManager
    from app.engine.settings import GenerationSettings

    model = args.model or ensure_real_shape_checkpoint(args.checkpoint)
    manager = ModelManager(AppConfig(model=model, queue_size=args.users + 1))
    manager.load()
    print(json.dumps({"warmup_s": round(manager.warm_up(), 1)}), flush=True)
    _, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    for round_number in range(1, args.rounds + 1):
        sampler = StackSampler("scheduler")
        level = run_level(args.users, args.duration, args.grace, manager.metrics,
                          lambda user: (lambda abort: engine_request(manager, messages, settings, abort)))
        sampler.stop()
        print(json.dumps({"round": round_number, **level}), flush=True)
        for share, stack in sampler.top(args.stacks):
            print(f"  {share:5.1f}%  {stack}", flush=True)


if __name__ == "__main__":
    main()
