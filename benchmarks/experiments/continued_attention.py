"""A continued prefill's attention (app.model.text.prefill_attention.continued) alone, at MiniCPM-V 4.6's shape (8
query heads on 2 key heads of 256), over a slot store of 4,096 columns: the Triton kernel, by its layout (query rows
and columns a program takes, warps, pipeline stages; "app" marks CONTINUED_LAYOUT), against PyTorch's version (each
slot's first 2,048 columns gathered, then masked attention: what the captured graphs ran before D61). Cases are
the waves a follow-up workload meets: a few follow-ups' new turns (up to 256 tokens, about 164 real), and waves of
generation prompts (16), after 1,000-1,600 kept tokens. For each, microseconds a layer and the largest
difference from an fp32 reference on the real rows. On CUDA:

    python benchmarks/experiments/continued_attention.py --json continued.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.experiments.decode_attention import layout_grid  # noqa: E402
from benchmarks.experiments.vision_fp8 import timed  # noqa: E402
from benchmarks.report import write_json  # noqa: E402

HEADS, KV_HEADS, D, CAPACITY, COLUMNS = 8, 2, 256, 4096, 2048
# name: (prompts, padded length, real tokens, kept tokens from, to)
CASES = {"1 x 256 (164)": (1, 256, 164, 1000, 1600), "4 x 256 (164)": (4, 256, 164, 1000, 1600),
         "16 x 256 (164)": (16, 256, 164, 1000, 1600), "1 x 16 (7)": (1, 16, 7, 1000, 1600),
         "4 x 64 (30)": (4, 64, 30, 1000, 1600), "32 x 16 (7)": (32, 16, 7, 1000, 1600),
         "64 x 16 (7)": (64, 16, 7, 1000, 1600)}


def main() -> None:
    import torch

    from app.model.text import prefill_attention, prefill_kernels
    from app.model.text.rows import ContinuedRows

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,128", help="query rows a program")
    parser.add_argument("--blocks", default="32,64", help="columns a program takes at a time")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2")
    parser.add_argument("--json")
    args = parser.parse_args()
    app_layout = prefill_kernels.CONTINUED_LAYOUT
    layouts = layout_grid([args.rows, args.blocks, args.warps, args.stages], app_layout)
    generator = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(64, KV_HEADS, CAPACITY, D, device="cuda", dtype=torch.bfloat16, generator=generator)
    values = torch.randn(64, KV_HEADS, CAPACITY, D, device="cuda", dtype=torch.bfloat16, generator=generator)
    scale = D ** -0.5
    results = []
    for case, (prompts, length, real, shortest, longest) in CASES.items():
        query = torch.randn(prompts * length, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=generator)
        slots = torch.randperm(64, device="cuda", generator=generator)[:prompts]
        starts = torch.randint(shortest, longest + 1, (prompts,), device="cuda", generator=generator)
        lengths = torch.full((prompts,), real, device="cuda")
        rows = ContinuedRows.padded(lengths, starts, slots, length, COLUMNS)
        exact = prefill_attention.padded(query.float(), keys.float(), values.float(), rows, HEADS, KV_HEADS, D, scale)
        timings = {"pytorch": lambda: prefill_attention.padded(query, keys, values, rows, HEADS, KV_HEADS, D, scale)}
        timings.update({layout: (lambda layout=layout: prefill_kernels.continued_attention(
            query, keys, values, slots, starts, lengths, scale, layout)) for layout in layouts})
        for layout, run in timings.items():
            try:
                error = (run()[rows.real].float() - exact[rows.real]).abs().max().item()
            except Exception as failure:  # a layout past the card's shared memory, say
                print(json.dumps({"case": case, "layout": str(layout), "failed": str(failure)[:200]}), flush=True)
                continue
            row = {"case": case, "layout": layout if layout == "pytorch" else list(layout), "app": layout == app_layout,
                   "us": round(timed(run, 50) * 1000, 1), "max_error": round(error, 4)}
            results.append(row)
            print(json.dumps(row), flush=True)
    for case in CASES:
        rows = sorted((r for r in results if r["case"] == case and r["layout"] != "pytorch"), key=lambda r: r["us"])
        app = next((r for r in rows if r["app"]), None)
        pytorch = next((r for r in results if r["case"] == case and r["layout"] == "pytorch"), None)
        print(f"{case}: pytorch {pytorch and pytorch['us']} us; app {app and app['us']} us; best {rows[0]['layout']} "
              f"{rows[0]['us']} us; next {[(r['layout'], r['us']) for r in rows[1:4]]}", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
