"""The one-row decode products (app.model.text.kernels.linear) against a variant that keeps a 2-D running sum
(one reduction at the end, not one a step) and software-pipelines its loads (Triton's tl.range num_stages), at
the 4.6 text model's shapes: ms a decode step for each product, the app's kernel at its chosen layout and the
variant's best of a sweep (outputs a program, inputs a step, warps, stages), and the largest difference between
the two outputs. Times as benchmarks/one_row_linear.py takes them (distinct weights, one captured graph). On CUDA:

    python benchmarks/experiments/one_row_pipelined.py --runs 30 --json pipelined.json
"""

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.one_row_linear import CONFIG, graph_ms, step_shapes  # noqa: E402
from benchmarks.report import write_json  # noqa: E402

SWEEP = [layout for layout in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8), (1, 3))
         if layout[0] * layout[1] <= 8192]


def variant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _pipelined_kernel(x_ptr, weight_ptr, out_ptr, out_features, in_features,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        output_mask = outputs < out_features
        total = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in tl.range(0, in_features, BLOCK_K, num_stages=STAGES):
            cols = start + tl.arange(0, BLOCK_K)
            col_mask = cols < in_features
            weight = tl.load(weight_ptr + outputs.to(tl.int64)[:, None] * in_features + cols[None, :],
                             mask=output_mask[:, None] & col_mask[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
            total += weight.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(out_ptr + outputs, tl.sum(total, axis=1).to(out_ptr.dtype.element_ty), mask=output_mask)

    def linear(x, weight, layout):
        import torch

        outputs, step, warps, stages = layout
        out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
        _pipelined_kernel[(triton.cdiv(weight.shape[0], outputs),)](
            x, weight, out, weight.shape[0], weight.shape[1], BLOCK_N=outputs, BLOCK_K=step, STAGES=stages,
            num_warps=warps)
        return out

    return linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    from app.model.text import kernels

    pipelined = variant_kernel()
    with open(CONFIG) as file:
        shapes = step_shapes(json.load(file)["text_config"])
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "products": {}}
    for name, (out_features, in_features, count) in shapes.items():
        weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(min(count, 24))]
        x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)

        def timed(linear):
            return round(graph_ms([lambda weight=weight: linear(x, weight) for weight in weights], args.runs)
                         * count / len(weights), 4)

        swept = {"x".join(map(str, layout)): timed(lambda x, w, layout=layout: pipelined(x, w, layout)) for layout in SWEEP}
        best = min(swept, key=swept.get)
        layout = tuple(int(part) for part in best.split("x"))
        difference = (pipelined(x, weights[0], layout).float() - kernels.linear(x, weights[0]).float()).abs().max().item()
        row = {"app_ms": timed(kernels.linear), "variant_best": best, "variant_ms": swept[best],
               "gb_a_step": round(out_features * in_features * 2 * count / 1e9, 4), "largest_difference": difference,
               "swept": swept}
        report["products"][name] = row
        print(name, json.dumps({key: value for key, value in row.items() if key != "swept"}), flush=True)
        del weights
        torch.cuda.empty_cache()
    report["total"] = {key: round(sum(row[key] for row in report["products"].values()), 4) for key in ("app_ms", "variant_ms")}
    print("total", json.dumps(report["total"]))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
