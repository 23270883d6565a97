"""The decode step's attention (app.model.text.kernels.attend) alone, at MiniCPM-V 4.6's shape (8 query heads on 2
key heads of 256), over a slot store of 4,096 columns (D49), by how its work is split: parts of the columns, columns
per inner step, warps and pipeline stages ("app" marks attention_layout's choice). For each case, microseconds a
layer, the bandwidth it reaches on the keys and values it reads, and the largest difference from PyTorch's
attention. Cases: 200 sequences of 1,000-1,600 columns (follow-ups in a conversation about a 1344x1344 photo),
200 of 676-800 (first turns), 50 of 1,300, one of 1,300. On CUDA:

    python benchmarks/experiments/decode_attention.py --json attention.json
"""

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.report import write_json  # noqa: E402
from benchmarks.experiments.vision_fp8 import timed  # noqa: E402

HEADS, KV_HEADS, D, CAPACITY = 8, 2, 256, 4096
CASES = {"200 x 1000-1600": (200, 1000, 1600), "200 x 676-800": (200, 676, 800), "50 x 1300": (50, 1300, 1300),
         "1 x 1300": (1, 1300, 1300)}


def layout_grid(lists: list[str], app_layout: tuple) -> list[tuple]:
    """Every layout of the comma-separated values in `lists` (one list a field), the app's first."""
    layouts = list(itertools.product(*[[int(value) for value in text.split(",")] for text in lists]))
    return layouts if app_layout in layouts else [app_layout, *layouts]


def main() -> None:
    import torch

    from app.model.text import kernels as text_kernels
    from app.model.text import ops as text_ops

    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="16,32,64")
    parser.add_argument("--blocks", default="32,64", help="columns per inner step")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--json")
    args = parser.parse_args()
    app_layout = text_kernels.attention_layout(CAPACITY)
    layouts = layout_grid([args.parts, args.blocks, args.warps, args.stages], app_layout)
    generator = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(200, KV_HEADS, CAPACITY, D, device="cuda", dtype=torch.bfloat16, generator=generator)
    values = torch.randn(200, KV_HEADS, CAPACITY, D, device="cuda", dtype=torch.bfloat16, generator=generator)
    results = []
    for case, (n, shortest, longest) in CASES.items():
        query = torch.randn(n, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=generator)
        projection = torch.randn(n, HEADS * 2 * D, device="cuda", dtype=torch.bfloat16, generator=generator)
        positions = torch.randint(shortest, longest + 1, (n,), device="cuda", generator=generator) - 1
        # PyTorch's attention in fp32 (text_ops.attend would run the kernel on CUDA)
        visible = torch.arange(CAPACITY, device="cuda")[None, :] <= positions[:, None]
        grouped = query.float().view(n, KV_HEADS, HEADS // KV_HEADS, D)
        plain = torch.nn.functional.scaled_dot_product_attention(
            grouped, keys[:n].float(), values[:n].float(), attn_mask=visible[:, None, None, :], scale=D ** -0.5)
        reference = text_ops.output_gated(plain.reshape(n, HEADS * D), projection.float(), HEADS, D)
        read_bytes = (positions + 1).sum().item() * KV_HEADS * D * 2 * 2
        for layout in layouts:
            run = lambda: text_kernels.attend(query, keys, values, positions, D ** -0.5, projection, layout)  # noqa: E731
            try:
                error = (run().float() - reference).abs().max().item()
            except Exception as failure:  # a layout past the card's shared memory, say
                print(json.dumps({"case": case, "layout": list(layout), "failed": str(failure)[:200]}), flush=True)
                continue
            ms = timed(run, 50)
            row = {"case": case, "layout": list(layout), "app": layout == app_layout, "us": round(ms * 1000, 1),
                   "tb_s": round(read_bytes / ms / 1e9, 2), "max_error": round(error, 4)}
            results.append(row)
            print(json.dumps(row), flush=True)
    for case in CASES:
        rows = sorted((r for r in results if r["case"] == case), key=lambda r: r["us"])
        app = next(r for r in rows if r["app"])
        print(f"{case}: app {app['us']} us ({app['tb_s']} TB/s); best {rows[0]['layout']} {rows[0]['us']} us "
              f"({rows[0]['tb_s']} TB/s); next {[(r['layout'], r['us']) for r in rows[1:4]]}", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
