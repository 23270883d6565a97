"""What it costs a preparing worker to hand tensors back to the engine's process (app.engine.preparers).

A worker process returns its result through a pipe. Tensors are pickled by torch's rule: each one's memory
is moved to a shared-memory segment of its own, and its file descriptor passed over a socket. numpy
arrays are pickled by value, through the pipe. This times a round trip to one worker returning, like a
prepared 1344x1344 request: nothing, 4 small tensors (the prompt's 696 ids and the like) shared or by
value, and the 6 MB of uint8 pixels (and 8 times that) shared or by value. Medians; runs anywhere:

    python benchmarks/experiments/worker_hop.py --runs 11 --json hop.json
    python benchmarks/experiments/worker_hop.py --busy-thread --switch-intervals 0.005,0.001   # beside a busy thread

With --busy-thread the round trips are also timed while another thread of this process runs pure Python,
as the engine's process has threads that want its GIL while a request comes back from its worker: each
time the thread waiting for the result gives the GIL up (to wait on the pipe, the socket...), it gets it
back only when the busy one is made to let go, after Python's switch interval (5 ms by default).
"""

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.report import write_json  # noqa: E402

PIXELS_SHAPE = (1, 3, 14, 143360)  # the benchmark image's 10 slices


def small_tensors():
    import torch

    return [torch.zeros((1, 696), dtype=torch.int64) for _ in range(4)]


def small_arrays():
    return [tensor.numpy() for tensor in small_tensors()]


def pixels(scale: int = 1):
    import torch

    return torch.zeros((*PIXELS_SHAPE[:3], PIXELS_SHAPE[3] * scale), dtype=torch.uint8)


RETURNS = {
    "nothing": lambda: None,
    "4 small tensors, shared": small_tensors,
    "4 small tensors, by value": small_arrays,
    "6 MB of pixels, shared": pixels,
    "6 MB of pixels, by value": lambda: pixels().numpy(),
    "48 MB of pixels, shared": lambda: pixels(8),
    "48 MB of pixels, by value": lambda: pixels(8).numpy(),
}


def returned(name: str):
    return RETURNS[name]()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--busy-thread", action="store_true", help="also beside a thread running pure Python")
    parser.add_argument("--switch-intervals", default="0.005", help="with --busy-thread: Python's switch intervals to try")
    parser.add_argument("--json")
    args = parser.parse_args()

    pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
    pool.submit(returned, "nothing").result()  # the worker started
    result = {"alone": round_trips(pool, args.runs)}
    if args.busy_thread:
        default = sys.getswitchinterval()
        for interval in (float(value) for value in args.switch_intervals.split(",")):
            sys.setswitchinterval(interval)
            stop = threading.Event()
            busy = threading.Thread(target=run_python_until, args=(stop,))
            busy.start()
            result[f"beside a busy thread, switch interval {interval * 1000:g} ms"] = round_trips(pool, args.runs)
            stop.set()
            busy.join()
        sys.setswitchinterval(default)
    pool.shutdown()
    print(json.dumps(result, indent=1))
    write_json(args.json, result)


def round_trips(pool, runs: int) -> dict:
    """The median round trip, in ms, for each kind of return."""
    result = {}
    for name in RETURNS:
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            pool.submit(returned, name).result()
            times.append((time.perf_counter() - started) * 1000)
        result[name] = round(sorted(times)[len(times) // 2], 2)
    return result


def run_python_until(stop: threading.Event) -> None:
    total = 0
    while not stop.is_set():
        for number in range(1000):
            total += number


if __name__ == "__main__":
    main()
