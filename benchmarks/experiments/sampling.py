"""The next-token choice of a decode step (`app/model/sampling.py`) by batch size and decoding settings.

Logits are random at the real vocabulary size (248,094); what the choice costs does not depend on the
model. Greedy, plain sampling (the checkpoint's default: temperature 0.7, no top-k or top-p), top-k with
top-p, and top-p alone (which needs the whole vocabulary in order). Runs on the GPU when there is one:

    python benchmarks/experiments/sampling.py --batches 1 32 200 --json sampling.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.prefill import timed  # noqa: E402
from benchmarks.report import write_json  # noqa: E402

VOCAB = 248094


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 200])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch

    from app.model.sampling import RowSettings, next_tokens

    device = "cuda" if torch.cuda.is_available() else "cpu"
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    settings = {
        "greedy": RowSettings(False, 1.0, 0, 1.0, 1.0),
        "sampling": RowSettings(True, 0.7, 0, 1.0, 1.0),
        "top-k 100, top-p 0.8": RowSettings(True, 0.7, 100, 0.8, 1.0),
        "top-p 0.8": RowSettings(True, 0.7, 0, 0.8, 1.0),
    }
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
               "torch": torch.__version__, "rows": []}
    end_token_ids = torch.tensor([0, 1], device=device)
    for batch in args.batches:
        logits = torch.randn(batch, VOCAB, device=device, dtype=torch.bfloat16)
        row = {"batch": batch}
        for name, setting in settings.items():
            milliseconds, _ = timed(synchronize, lambda: next_tokens(
                logits, [setting] * batch, [None] * batch, [False] * batch, end_token_ids), args.runs)
            row[f"{name} ms"] = round(milliseconds, 2)
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
