"""The vision tower's attention calls under each SDPA kernel, at the shapes of a prefill wave.

A 1344x1344 image is 10 slices of 1,024 patches (16 heads of dimension 72): 7 layers attend within
slices of 1,024 tokens, the merger within 2x2 windows (2,560 of 4 tokens a slice), and 20 layers within
slices of 256 tokens. `app/model/vision/tower.py` makes one call per run of equal slices (split under
CUDA's grid limit); this times such calls for --images images under each kernel PyTorch offers, and
checks that each gives the flash kernel's output; "tower" is the call as the tower makes it (SDPA's
default choice, one call per run of equal segments). Run on a GPU machine:

    python benchmarks/experiments/vision_attention.py --images 1 16 32 --json vision_attention.json

With --first-calls it times instead the tower's own attention (`fused_vision._attend_slices`, cuDNN's
kernel from 16 slices) the first and the second time this process meets each shape: cuDNN builds a
graph for every new one, and a wave's slice count is a new shape until the process has seen it.

    python benchmarks/experiments/vision_attention.py --first-calls --images 2 3 5 8 13 21
"""

import argparse
import json
import os
import sys
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.report import write_json  # noqa: E402

HEADS, DIM = 16, 72
SLICES_PER_IMAGE = 10
# (name, tokens per segment, segments per image, calls per wave)
STAGES = [("before the merger", 1024, SLICES_PER_IMAGE, 7), ("merger windows", 4, SLICES_PER_IMAGE * 256, 1),
          ("after the merger", 256, SLICES_PER_IMAGE, 20)]


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--first-calls", action="store_true",
                        help="time the tower's attention on each shape's first and second call (host and GPU)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.first_calls:
        write_json(args.json, first_calls(args.images))
        return

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from app.model.vision.tower import MAX_GRID_ROWS, grouped_varlen_attention

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "memory-efficient": SDPBackend.EFFICIENT_ATTENTION}
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for images in args.images:
        for stage, length, per_image, calls in STAGES:
            segments = images * per_image
            # As the tower hands them over: [segments, heads, length, dim] views of [segments, length, heads, dim].
            q, k, v = (torch.randn(segments, length, HEADS, DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                       for _ in range(3))
            most = MAX_GRID_ROWS // HEADS

            def attend():  # with the tower's reshape to [tokens, heads, dim] (a copy unless the layout allows)
                parts = [scaled_dot_product_attention(q[i:i + most], k[i:i + most], v[i:i + most])
                         .transpose(1, 2).reshape(-1, HEADS, DIM) for i in range(0, segments, most)]
                return parts[0] if len(parts) == 1 else torch.cat(parts)

            bounds = torch.arange(0, segments * length + 1, length, device="cuda")
            packed = [t.transpose(1, 2).reshape(1, segments * length, HEADS, DIM).transpose(1, 2) for t in (q, k, v)]

            def tower():
                return grouped_varlen_attention(None, *packed, scaling=DIM ** -0.5, cu_seq_lens_q=bounds)[0][0]

            row = {"images": images, "stage": stage, "segments": segments, "length": length, "calls_per_wave": calls}
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                reference = attend()
            variants = [(name, lambda backend=backend: sdpa_kernel(backend), attend) for name, backend in backends.items()]
            for name, context, function in [*variants, ("tower", nullcontext, tower)]:
                try:
                    with context():
                        output = function()
                        torch.cuda.synchronize()
                        times = []
                        for _ in range(args.runs):
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            start.record()
                            function()
                            end.record()
                            torch.cuda.synchronize()
                            times.append(start.elapsed_time(end))
                    row[f"{name}_ms"] = round(sorted(times)[len(times) // 2], 3)
                    row[f"{name}_max_diff"] = round(float((output - reference).abs().max()), 4)
                except RuntimeError as error:
                    row[f"{name}_ms"] = f"unavailable: {str(error)[:80]}"
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    write_json(args.json, results)


def first_calls(images_per_wave: list[int]) -> dict:
    """Wall time of the tower's attention on shapes this process has not met, then on the same again."""
    import time

    import torch

    from app.model.vision.fused import _attend_slices

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "rows": []}
    for images in images_per_wave:
        for stage, length, per_image, _ in STAGES:
            if length == 4:
                continue  # the merger's windows go to a Triton kernel of the app's own, no cuDNN
            segments = images * per_image
            qkv = torch.randn(segments * length, 3 * HEADS * DIM, device="cuda", dtype=torch.bfloat16)
            row = {"images": images, "stage": stage, "segments": segments, "length": length}
            for call in ("first", "second"):
                torch.cuda.synchronize()
                started = time.perf_counter()
                _attend_slices(qkv, [(length, segments)], HEADS, DIM ** -0.5)
                torch.cuda.synchronize()
                row[f"{call}_ms"] = round((time.perf_counter() - started) * 1000, 2)
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    return results


if __name__ == "__main__":
    main()
