"""Where the GPU's time goes while N users are served: every kernel and copy over a window.

concurrency.py measures what users get and how the scheduler's thread spends its time; this looks at the
GPU itself. The engine runs in a process of its own, as `python app.py` runs it (`--in-process-engine`:
in this process, the users' threads sharing its GIL), N users send the benchmark's request back to back,
and after --settle seconds the engine's counters are read over --seconds, then the engine profiles its
GPU over as long a window (`ModelManager.profile_gpu`, app/model/gpu_profile.py: torch's profiler, GPU
side only). Reported: how much of the window the GPU was busy on any stream, each stream's busy time,
the time two streams ran at once, the idle gaps, the kernels' time by kind, the garbage collector's pauses
in the engine's process, the busy time per request, and what the engine served in both windows (the
unprofiled one shows what the profiler itself costs). Needs a CUDA GPU:

    python benchmarks/gpu_timeline.py --users 200 --settle 10 --seconds 6 --json timeline.json
    python benchmarks/gpu_timeline.py --workload text --users 200 --settle 8 --seconds 4   # concurrency.py's workloads
"""

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.requesters import engine_request, engine_requester  # noqa: E402
from benchmarks.users import drive_users  # noqa: E402
from benchmarks.real_shape import DEFAULT_FOLDER, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.workloads import WORKLOADS, make_workload  # noqa: E402


def served(start: dict, end: dict, seconds: float) -> dict:
    """What the engine did between two readings of its counters, `seconds` apart."""
    tokens, steps = end["tokens_generated"] - start["tokens_generated"], end["decode_steps"] - start["decode_steps"]
    return {"prefill_waves": end["prefill_waves"] - start["prefill_waves"], "decode_steps": steps, "tokens": tokens,
            "requests_finished": end["requests"]["finished"] - start["requests"]["finished"],
            "tokens_per_s": round(tokens / seconds, 1), "tokens_per_step": round(tokens / steps, 1) if steps else None}


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of load before the windows")
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="seconds of each window (more than one cycle of waves and decode steps at 200 users)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--workload", choices=WORKLOADS,
                        help="each user's requests, as concurrency.py's --workload (default: benchmark_request's 1344x1344 PNG)")
    parser.add_argument("--in-process-engine", action="store_true", help="the engine in this process (the first runs')")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    from app.config import AppConfig
    from app.engine.client import EngineProcess
    from app.engine.core import ModelManager
    from app.engine.settings import GenerationSettings

    if not torch.cuda.is_available():
        sys.exit("gpu_timeline.py needs a CUDA GPU")
    config = AppConfig(model=ensure_real_shape_checkpoint(args.checkpoint), queue_size=args.users + 1,
                       engine_process=not args.in_process_engine)
    manager = (EngineProcess if config.engine_process else ModelManager)(config)
    manager.load()
    manager.warm_up()
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if args.workload:
        workload = make_workload(args.workload)
        generation = GenerationSettings(**settings, **workload.settings)
        requesters = [engine_requester(manager, workload, generation, user) for user in range(args.users)]
    else:
        _, messages = benchmark_request()
        generation = GenerationSettings(**settings)
        requesters = [lambda abort: engine_request(manager, messages, generation, abort)] * args.users
    stop_at = time.time() + args.settle + 2 * args.seconds + 6.5  # the profile starts 1.5 s after its call
    users = threading.Thread(target=drive_users, daemon=True, args=(requesters, stop_at, stop_at + 30))
    users.start()
    time.sleep(args.settle)
    start = manager.metrics.snapshot()
    time.sleep(args.seconds)
    unprofiled = served(start, manager.metrics.snapshot(), args.seconds)
    timeline = manager.profile_gpu(args.seconds)
    counters = timeline.pop("counters")
    profiled = served(counters["start"], counters["end"], args.seconds)
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "users": args.users, "workload": args.workload or "image-1344 (benchmark_request)", "seconds": args.seconds,
              "engine": "process of its own" if config.engine_process else "in-process", **timeline,
              "profiled": profiled, "unprofiled": unprofiled,
              # A request's worth: its new tokens among those decoded in the window (the requests finished in
              # a window of a few seconds are a poor count of the work done in it: they come in bursts).
              "gpu_busy_ms_per_request": round(timeline["busy_ms"] * args.new_tokens / profiled["tokens"], 2)
              if profiled["tokens"] and timeline.get("busy_ms") else None}
    print(json.dumps(report), flush=True)
    write_json(args.json, report)
    users.join()
    if config.engine_process:
        manager.close()


if __name__ == "__main__":
    main()
