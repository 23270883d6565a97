"""Switching models at run time: GPU memory before, released by the unload, and after the new load.

Serves one checkpoint, answers a request (so the engine holds its slots and captured graphs), then
switches to another (ModelManager.switch, as the UI's picker does) and answers again. Defaults: the
real-shape random checkpoint, switched to itself (a full unload and load). Run on a GPU machine:

    python benchmarks/switch.py --to /tmp/int4-benchmark/gptq --json switch.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.real_shape import DEFAULT_FOLDER, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def gib(count: int | None) -> float | None:
    return None if count is None else round(count / 2**30, 2)


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the checkpoint served first (default: the real-shape random one)")
    parser.add_argument("--to", help="the checkpoint switched to (default: the first one again)")
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    from app.config import AppConfig
    from app.engine.core import ModelManager
    from app.engine.settings import GenerationSettings

    first = args.model or ensure_real_shape_checkpoint(args.checkpoint)
    manager = ModelManager(AppConfig(model=first))
    manager.load()
    manager.warm_up()
    _, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=32, min_new_tokens=32, do_sample=False)

    def answer() -> dict:
        for update in manager.stream(messages, settings):
            pass
        return update.stats

    cuda = torch.cuda.is_available()
    answer()
    before = manager.gpu_memory_bytes()
    reserved_before = torch.cuda.memory_reserved() if cuda else None
    started = time.perf_counter()
    switched = manager.switch(args.to or first)
    switch_s = time.perf_counter() - started
    stats = answer()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "from": args.model or "random weights, real MiniCPM-V 4.6 shape", "to": args.to or "the same checkpoint",
        "allocated_before_gib": gib(before),
        "reserved_before_gib": gib(reserved_before),
        "released_by_unload_gib": gib(switched["freed_gpu_bytes"]),
        "allocated_after_switch_gib": gib(manager.gpu_memory_bytes()),
        "switch_s": round(switch_s, 1),
        "warmup_s": round(switched["warmup_s"], 1),
        "answer_after_switch": {key: stats[key] for key in ("ttft_ms", "new_tokens")},
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
