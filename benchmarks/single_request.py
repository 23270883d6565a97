"""One user at a time through the app's own model manager: load, warm-up, time to first token, decode speed.

Random weights at the real MiniCPM-V 4.6 shape (timings do not depend on the weights' values), built once
into --checkpoint from the reference config. Each request: one 1344x1344 image (640 visual tokens), a short
question, exactly --new-tokens new tokens, greedy. Run on a GPU machine:

    python benchmarks/single_request.py --runs 5 --json results.json
    python benchmarks/single_request.py --model /tmp/real-shape-gptq      # any other checkpoint (int4, ...)
"""

import collections
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.config import AppConfig  # noqa: E402
from app.engine.core import ModelManager  # noqa: E402
from app.engine.settings import GenerationSettings  # noqa: E402
from benchmarks.real_shape import asked_anew, benchmark_parser, benchmark_request, chosen_model  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 while loading (CUDA)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--count-syncs", action="store_true",
                        help="also count the CUDA calls that wait for the GPU during the runs, by the app's line making them")
    args = parser.parse_args()

    import torch
    import transformers

    started = time.perf_counter()
    model = chosen_model(args)
    build_s = time.perf_counter() - started

    manager = ModelManager(AppConfig(model=model, device=args.device, dtype=args.dtype, load_in_4bit=args.load_in_4bit))
    started = time.perf_counter()
    manager.load()
    load_s = time.perf_counter() - started
    cuda = str(manager.device).startswith("cuda")
    loaded_gib = round(torch.cuda.memory_allocated() / 2**30, 2) if cuda else None
    warmup_s = manager.warm_up()

    _, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runs = []
    syncs = waits_for_the_gpu() if args.count_syncs and cuda else None
    for run in range(args.runs):
        for update in manager.stream(asked_anew(messages, run), settings):
            pass
        runs.append(update.stats)
    if syncs is not None:
        torch.cuda.set_sync_debug_mode(0)

    def median(key):
        return statistics.median(run[key] for run in runs)

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fla": _version("fla"),
        "model": args.model or "random weights, real MiniCPM-V 4.6 shape",
        "dtype": manager.info().dtype,
        "weight_gib": round(manager.info().weight_bytes / 2**30, 2),
        "loaded_gpu_gib": loaded_gib,
        "attn": manager.config.attn_implementation,
        "build_s": round(build_s, 1),
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "visual_tokens": runs[0]["visual_tokens"],
        "prompt_tokens": runs[0]["prompt_tokens"],
        "new_tokens": runs[0]["new_tokens"],
        "ttft_ms_median": median("ttft_ms"),
        "ttft_ms_all": [run["ttft_ms"] for run in runs],
        "preprocess_ms_median": median("preprocess_ms"),
        "decode_tokens_per_s_median": median("tokens_per_s"),
        "ms_per_token_median": round(1000 / median("tokens_per_s"), 2),
        "total_ms_median": median("total_ms"),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }
    if syncs is not None:
        result["syncs_per_request"] = {where: round(count / args.runs, 1) for where, count in syncs.most_common()}
    print(json.dumps(result, indent=2))
    write_json(args.json, result)



def waits_for_the_gpu() -> collections.Counter:
    """From now on, count the CUDA calls that synchronize (torch's sync debug mode), by the innermost line
    of the app's own code on the calling thread's stack. Waits on an event are not counted."""
    import torch

    counts = collections.Counter()
    app_folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "app")

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        ours = [frame for frame in traceback.extract_stack()[:-1] if frame.filename.startswith(app_folder)]
        counts[f"{os.path.relpath(ours[-1].filename)}:{ours[-1].lineno}" if ours else "outside app/"] += 1

    warnings.simplefilter("always")
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    return counts


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
