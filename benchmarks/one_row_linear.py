"""A lone reply's decode step's matrix products (one row each): PyTorch's (cuBLAS) against the fused text
model's one-row Triton kernel (app.model.text.kernels.linear), at the real MiniCPM-V 4.6 text model's shapes.

Each shape's weights are as many distinct matrices as the model has of it (24 copies at most, so that
they do not sit in the GPU's L2 cache between products, as in a step), run back to back in one captured
CUDA graph; the time is the median of --runs replays. Each row gives the TB/s of weights read and how far
that is from the floor the benchmarks use (bytes / 4.2 TB/s; the output layer was read at 4.3). The
kernel's layouts are also swept (outputs a program, inputs a step, warps) beside the chosen one
(one_row_layout). Needs a GPU:

    python benchmarks/one_row_linear.py --runs 50 --json one_row.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import write_json  # noqa: E402

FLOOR_BYTES_PER_S = 4.2e12
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minicpm-v-4.6.config.json")
SWEEP = [(outputs, step, warps) for outputs in (1, 2, 4) for step in (512, 1024, 2048) for warps in (1, 2, 4, 8)]


def step_shapes(text: dict) -> dict[str, tuple[int, int, int]]:
    """name: (out, in, matrices a decode step) of the text model's matrix products."""
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    attention_layers = layers // text["full_attention_interval"]
    deltanet_layers = layers - attention_layers
    keys = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    values = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    return {
        "DeltaNet in": (2 * keys + 2 * values + 2 * text["linear_num_value_heads"], hidden, deltanet_layers),
        "DeltaNet out": (hidden, values, deltanet_layers),
        "attention in": (2 * heads * head_dim + 2 * kv_heads * head_dim, hidden, attention_layers),
        "attention out": (hidden, heads * head_dim, attention_layers),
        "MLP gate and up": (2 * text["intermediate_size"], hidden, layers),
        "MLP down": (hidden, text["intermediate_size"], layers),
        "lm_head": (text["vocab_size"], hidden, 1),
    }


def graph_ms(products, runs: int) -> float:
    """Median ms of one replay of a CUDA graph running `products` (callables) in order."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for product in products:
            product()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for product in products:
            product()
    times = []
    for _ in range(runs + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[runs // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--no-sweep", action="store_true", help="only the chosen layout")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from app.model.text import kernels

    with open(CONFIG) as file:
        text = json.load(file)["text_config"]
    shapes = step_shapes(text)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": args.runs, "products": {}}
    for name, (out_features, in_features, count) in shapes.items():
        weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
                   for _ in range(min(count, 24))]
        x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)

        def timed(layout=None, cublas=False):
            products = [(lambda weight=weight: F.linear(x, weight)) if cublas else
                        (lambda weight=weight: kernels.linear(x, weight, layout)) for weight in weights]
            return round(graph_ms(products, args.runs) * count / len(weights), 4)

        difference = (kernels.linear(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max().item()
        chosen = kernels.one_row_layout(out_features, in_features)
        gigabytes = out_features * in_features * 2 * count / 1e9
        row = {"matrices": count, "gb_a_step": round(gigabytes, 4), "cublas_ms": timed(cublas=True),
               "kernel_ms": timed(chosen), "chosen_layout": list(chosen), "largest_difference_from_cublas": difference,
               "floor_ms": round(gigabytes * 1e9 / FLOOR_BYTES_PER_S * 1000, 4)}
        row["kernel_tb_per_s"] = round(gigabytes / row["kernel_ms"], 2)
        if not args.no_sweep:
            swept = {f"{o}x{s}x{w}": timed((o, s, w)) for o, s, w in SWEEP}
            best = min(swept, key=swept.get)
            row["best_swept"] = {best: swept[best]}
            row["swept"] = swept
        report["products"][name] = row
        print(name, json.dumps({key: value for key, value in row.items() if key != "swept"}), flush=True)
        del weights
        torch.cuda.empty_cache()
    report["step_total"] = {key: round(sum(row[key] for row in report["products"].values()), 4)
                            for key in ("cublas_ms", "kernel_ms", "floor_ms")}
    print("| product | matrices | cuBLAS ms a step | kernel ms a step | kernel TB/s | floor ms (4.2 TB/s) |")
    print("|---|---|---|---|---|---|")
    for name, row in report["products"].items():
        print(f"| {name} | {row['matrices']} | {row['cublas_ms']} | {row['kernel_ms']} | {row['kernel_tb_per_s']} | {row['floor_ms']} |")
    total = report["step_total"]
    print(f"| all | | {total['cublas_ms']} | {total['kernel_ms']} | | {total['floor_ms']} |")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
