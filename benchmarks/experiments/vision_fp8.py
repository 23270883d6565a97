"""The vision tower's matrix products in bf16 against FP8 (e4m3, a scale per row of activations and per
output channel of weights, through torch._scaled_mm), at the shapes of a wave of 1344x1344 images
(10,240 patches each before the window merger, 2,560 after): what FP8 would save, and its error against
fp32. Also the cost of quantizing activations with PyTorch operations. On CUDA (compute capability 8.9+).
docs/DECISIONS.md D26 ("Midday run") has why the app does not use it.

    python benchmarks/experiments/vision_fp8.py --images 16
"""

import argparse
import json

import torch
import torch.nn.functional as F

HIDDEN, WIDE = 1152, 4304
PRODUCTS = {"qkv": (HIDDEN, 3 * HIDDEN), "out": (HIDDEN, HIDDEN), "fc1": (HIDDEN, WIDE), "fc2": (WIDE, HIDDEN)}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def timed(run, repeats: int = 10) -> float:
    for _ in range(2):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {}
    for tokens_per_image, layers in ((10240, 7), (2560, 20)):
        m = tokens_per_image * args.images
        for name, (k, n) in PRODUCTS.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            w8, w_scale = quantize_rows(weight)
            x8, x_scale = quantize_rows(x)
            bf16 = timed(lambda: F.linear(x, weight, bias))
            fp8 = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), bias=bias,
                                                 out_dtype=torch.bfloat16))
            quantize = timed(lambda: quantize_rows(x))
            exact = F.linear(x.float(), weight.float(), bias.float())

            def error(y):
                return ((y.float() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()

            y8 = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), bias=bias, out_dtype=torch.bfloat16)
            flops = 2 * m * k * n
            row = {"m": m, "k": k, "n": n, "layers": layers, "bf16_ms": round(bf16, 3), "fp8_ms": round(fp8, 3),
                   "quantize_torch_ms": round(quantize, 3), "bf16_tflops": round(flops / bf16 / 1e9, 1),
                   "fp8_tflops": round(flops / fp8 / 1e9, 1),
                   "bf16_rel_error": round(error(F.linear(x, weight, bias)), 5), "fp8_rel_error": round(error(y8), 5)}
            if name == "fc1":
                row["bf16_gelu_epilogue_ms"] = round(timed(lambda: torch._addmm_activation(bias, x, weight.t(), use_gelu=True)), 3)
            results[f"{name}@{tokens_per_image}"] = row
            print(name, row, flush=True)
    totals = {kind: sum(r[f"{kind}_ms"] * r["layers"] for r in results.values()) for kind in ("bf16", "fp8", "quantize_torch")}
    print("per wave, all layers (ms):", {k: round(v, 1) for k, v in totals.items()})
    if args.json:
        json.dump({"images": args.images, "products": results, "totals_ms": totals}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
