"""bf16 against int4 at the real MiniCPM-V 4.6 shape: GPU memory, time to first token, decode speed.

Variants: bf16 (the random-weight checkpoint), gptq and awq (that checkpoint quantized by
scripts/quantize.py with GPT-QModel, on the GPU), bnb-4bit (bitsandbytes NF4 while loading,
--load-in-4bit). `gptq:KERNEL` picks GPT-QModel's kernel by writing `backend` into the checkpoint's
quantization_config, as a user would: the default ("auto") compiles the Marlin kernel with nvcc on the
first load on a machine (minutes); gptq_triton / gemm_triton (AWQ) / gptq_torch need no compiler. Each variant runs benchmarks/single_request.py and benchmarks/decode_step.py in
processes of their own, so that memory figures do not mix. Needs requirements-quant.txt, and
bitsandbytes for bnb-4bit. Run on a GPU machine:

    python benchmarks/int4.py --json int4.json
    python benchmarks/int4.py --variants bf16,gptq:gptq_triton,awq:gemm_triton,bnb-4bit --json int4.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.real_shape import DEFAULT_FOLDER, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.report import write_json  # noqa: E402

VARIANTS = ("bf16", "gptq", "awq", "bnb-4bit")


def choose_kernel(folder: str, kernel: str | None) -> None:
    """Set (or, for None, remove) the GPT-QModel kernel a quantized checkpoint loads with."""
    path = os.path.join(folder, "config.json")
    with open(path) as file:
        config = json.load(file)
    config["quantization_config"].pop("backend", None)
    if kernel:
        config["quantization_config"]["backend"] = kernel
    with open(path, "w") as file:
        json.dump(config, file, indent=2)


def run_logged(command: list[str], cwd: str, timeout: float, log_path: str) -> str | None:
    """Run `command` with its output in `log_path`; None if it succeeded, else the log's tail."""
    with open(log_path, "w") as log:
        try:
            failed = subprocess.run(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode != 0
        except subprocess.TimeoutExpired:
            failed = True
    if not failed:
        return None
    with open(log_path) as log:
        return log.read()[-1500:]


def run_json(command: list[str], out: str, timeout: float, log_path: str) -> dict:
    """Run a benchmark script that writes --json `out`; its output goes to `log_path`."""
    started = time.perf_counter()
    error = run_logged([sys.executable, *command, "--json", out], ROOT, timeout, log_path)
    if error is not None or not os.path.exists(out):
        with open(log_path) as log:
            return {"error": log.read()[-1500:], "seconds": round(time.perf_counter() - started, 1)}
    with open(out) as file:
        return json.load(file)


def quantize(checkpoint: str, method: str, work: str, timeout: float) -> dict:
    """`checkpoint` quantized by scripts/quantize.py into work/<method> (reused if already there)."""
    folder = os.path.join(work, method)
    if os.path.exists(os.path.join(folder, "config.json")):
        return {"folder": folder, "seconds": None}
    started = time.perf_counter()
    error = run_logged([sys.executable, os.path.join(ROOT, "scripts", "quantize.py"), "--model", checkpoint,
                        "--method", method, "--out", folder, "--device", "cuda"],
                       work, timeout, os.path.join(work, f"quantize-{method}.log"))
    if error is not None:
        return {"error": error}
    return {"folder": folder, "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS) + "; gptq:KERNEL, awq:KERNEL")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                        help="run single_request.py (--no-single: the decode step only)")
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER)
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "int4-benchmark"),
                        help="quantized checkpoints and logs go here")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batches", default="1,64,200")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for each step")
    parser.add_argument("--json")
    args = parser.parse_args()

    os.makedirs(args.work, exist_ok=True)
    checkpoint = ensure_real_shape_checkpoint(args.checkpoint)
    report = {"date": time.strftime("%Y-%m-%d"), "variants": {}}
    for variant in args.variants.split(","):
        result = report["variants"][variant] = {}
        method, _, kernel = variant.partition(":")
        model = ["--model", checkpoint]
        if method in ("gptq", "awq"):
            result["quantize"] = quantize(checkpoint, method, args.work, args.timeout)
            model = ["--model", result["quantize"].get("folder")]
            if "error" not in result["quantize"]:
                choose_kernel(result["quantize"]["folder"], kernel or None)
        elif method == "bnb-4bit":
            model.append("--load-in-4bit")
        name = os.path.join(args.work, variant.replace(":", "-"))
        if "error" not in result.get("quantize", {}):
            if args.single:
                result["single"] = run_json(["benchmarks/single_request.py", *model, "--runs", str(args.runs)],
                                            f"{name}-single.json", args.timeout, f"{name}-single.log")
            result["decode"] = run_json(["benchmarks/decode_step.py", *model, "--batches", args.batches, "--no-eager"],
                                        f"{name}-decode.json", args.timeout, f"{name}-decode.log")
        print(json.dumps({variant: result}), flush=True)
        write_json(args.json, report)  # after each variant, so that a run cut short keeps what it measured


if __name__ == "__main__":
    main()
