"""One user at a time through the app's own model manager: load, warm-up, time to first token, decode speed.

Random weights at the real MiniCPM-V 4.6 shape (timings do not depend on the weights' values), built once
into --checkpoint from the reference config. Each request: one 1344x1344 image (640 visual tokens), a short
question, exactly --new-tokens new tokens, greedy. Run on a GPU machine:

    python benchmarks/single_request.py --runs 5 --json results.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.config import AppConfig  # noqa: E402
from app.engine.manager import ModelManager  # noqa: E402
from app.engine.random_checkpoint import build_random_checkpoint  # noqa: E402
from app.engine.settings import GenerationSettings  # noqa: E402

REFERENCE_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minicpm-v-4.6.config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "minicpmv4_6-real-shape-random"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch
    import transformers
    from PIL import Image

    started = time.perf_counter()
    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        with open(REFERENCE_CONFIG) as file:
            build_random_checkpoint(args.checkpoint, json.load(file), dtype=torch.bfloat16,
                                    device="cuda" if torch.cuda.is_available() else "cpu")
    build_s = time.perf_counter() - started

    manager = ModelManager(AppConfig(model=args.checkpoint, device=args.device, dtype=args.dtype))
    started = time.perf_counter()
    manager.load()
    load_s = time.perf_counter() - started
    warmup_s = manager.warm_up()

    image_path = os.path.join(tempfile.gettempdir(), "benchmark-1344.png")
    Image.effect_noise((1344, 1344), 64).convert("RGB").save(image_path)
    messages = [{"role": "user", "content": [{"type": "image", "path": image_path},
                                             {"type": "text", "text": "Describe this image in detail."}]}]
    settings = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    cuda = str(manager.device).startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for _ in range(args.runs):
        for update in manager.stream(messages, settings):
            pass
        runs.append(update.stats)

    def median(key):
        return statistics.median(run[key] for run in runs)

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fla": _version("fla"),
        "dtype": manager.info().dtype,
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
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
