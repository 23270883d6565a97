"""A whole preparation through a preparing worker (app.engine.preparers), the pixels coming back in one
of the shared slots made at start or, as before them, in a shared-memory segment of their own; alone, and
while another thread of the engine's side runs pure Python (as the engine's process has threads that
want its GIL). The benchmark's 1344x1344 PNG, one worker, medians; the two ways alternate, --rounds times.
Runs anywhere (the tiny checkpoint's processor is the real one's):

    python benchmarks/experiments/pixel_slots.py --rounds 4 --json slots.json
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.real_shape import benchmark_request  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.experiments.worker_hop import run_python_until  # noqa: E402


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    from app.engine.preparers import PIXEL_SLOT_BYTES, ProcessPreparer
    from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint
    from app.engine.settings import GenerationSettings

    torch.set_num_threads(1)
    folder = ensure_tiny_checkpoint()
    _, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=128)

    def median_ms(preparer) -> float:
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            preparer.prepare(messages, settings, 32768)
            times.append((time.perf_counter() - started) * 1000)
        return round(statistics.median(times), 1)

    ways = {"in a slot": PIXEL_SLOT_BYTES, "in a segment of their own": 0}
    result = {way: {"alone": [], "beside a busy thread": []} for way in ways}
    for round_ in range(args.rounds):
        for way in (list(ways) if round_ % 2 == 0 else list(reversed(ways))):
            preparer = ProcessPreparer(folder, False, 1, torch.bfloat16, slot_bytes=ways[way])
            median_ms(preparer)  # the worker's first requests
            result[way]["alone"].append(median_ms(preparer))
            stop = threading.Event()
            busy = threading.Thread(target=run_python_until, args=(stop,))
            busy.start()
            result[way]["beside a busy thread"].append(median_ms(preparer))
            stop.set()
            busy.join()
            preparer.close()
    print(json.dumps(result, indent=1))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
