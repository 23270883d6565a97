"""The DeltaNet layers' decode kernel (app.model.text.kernels.gated_delta_step) alone, at MiniCPM-V 4.6's
shape (16 heads of 128x128 fp32 states), by batch size and by how the state is split between programs
(value columns and warps a program; "app" marks text_kernels.delta_step_layout's choice): microseconds a
layer, the bandwidth it reaches reading and writing the states, the same bytes read and written by a
plain in-place multiply (what the card reaches on this traffic), and the largest difference from the
first layout's output and state. On CUDA:

    python benchmarks/experiments/delta_step.py --batches 1,32,100,200,256 --json delta.json
"""

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.report import write_json  # noqa: E402
from benchmarks.experiments.vision_fp8 import timed  # noqa: E402

HEADS, K, V = 16, 128, 128
DELTANET_LAYERS = 18  # of the text model's 24: every fourth is full attention


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    import torch

    from app.model.text import kernels as text_kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,32,100,200,256")
    parser.add_argument("--blocks", default="8,16,32,64,128", help="value columns per program")
    parser.add_argument("--warps", default="1,2,4,8")
    parser.add_argument("--json")
    args = parser.parse_args()
    layouts = list(itertools.product([int(b) for b in args.blocks.split(",")], [int(w) for w in args.warps.split(",")]))
    results = []
    for n in [int(b) for b in args.batches.split(",")]:
        generator = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(n, 2 * HEADS * K + HEADS * V, device="cuda", dtype=torch.bfloat16, generator=generator)
        projection = torch.randn(n, 2 * HEADS, device="cuda", dtype=torch.bfloat16, generator=generator)
        a_log = torch.randn(HEADS, device="cuda", generator=generator)
        dt_bias = torch.randn(HEADS, device="cuda", generator=generator)
        start_state = torch.randn(n, HEADS, K, V, device="cuda", generator=generator) * 0.1
        columns = torch.ones(n, dtype=torch.long, device="cuda")  # no padding row
        state_bytes = start_state.numel() * 4 * 2  # read and written once
        copy_state = start_state.clone()
        copy_us = timed(lambda: copy_state.mul_(0.999), 50) * 1000
        reference = None
        for layout in layouts:
            state = start_state.clone()
            out = text_kernels.gated_delta_step(qkv, projection, 0, HEADS, a_log, dt_bias, state, HEADS, columns,
                                                layout)
            if reference is None:
                reference = (out, state.clone())
            difference = max((out.float() - reference[0].float()).abs().max().item(),
                             (state - reference[1]).abs().max().item())
            us = timed(lambda: text_kernels.gated_delta_step(qkv, projection, 0, HEADS, a_log, dt_bias, state, HEADS,
                                                             columns, layout), 50) * 1000
            row = {"batch": n, "block_v": layout[0], "warps": layout[1],
                   "app": layout == text_kernels.delta_step_layout(n), "us_a_layer": round(us, 1),
                   "ms_a_step": round(us * DELTANET_LAYERS / 1000, 3), "tb_per_s": round(state_bytes / us / 1e6, 2),
                   "copy_us": round(copy_us, 1), "copy_tb_per_s": round(state_bytes / copy_us / 1e6, 2),
                   "max_difference": difference}
            results.append(row)
            print(json.dumps(row), flush=True)
        best = min((r for r in results if r["batch"] == n), key=lambda r: r["us_a_layer"])
        print(f"batch {n}: best {best}", flush=True)
    write_json(args.json, {"results": results})


if __name__ == "__main__":
    main()
