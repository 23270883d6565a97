"""The scheduler's own time per decode step: what the thread that launches the GPU's steps spends between
two of them, choosing and handing out every running request's token.

The model is replaced by a stand-in whose decode step returns fixed logits at once, so that only the
scheduler's host work is timed (on a GPU the next step cannot start before it ends). Runs anywhere:

    python benchmarks/experiments/scheduler_step.py --running 200 --json step.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from app.engine.metrics import EngineMetrics  # noqa: E402
from app.engine.scheduler import Request, Scheduler  # noqa: E402
from app.engine.settings import GenerationSettings  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


class FixedLogits:
    """A stand-in for BatchRunner: every decode step returns the same logits."""

    device = "cpu"

    def __init__(self, rows: int, vocabulary: int):
        import torch

        self.logits = torch.randn(rows, vocabulary)
        self.end_tokens = torch.tensor([vocabulary - 1])

    def decode(self, tokens):
        return self.logits[: tokens.shape[0]]

    def choose(self, logits, rows, seen, barred, generators=None):
        from app.model.sampling import choose

        return choose(logits, rows, seen, barred, self.end_tokens, generators)

    def tokens_on_device(self, tokens):
        import torch

        return torch.tensor(tokens)

    def move(self, sources: list[int], targets: list[int], columns: int) -> None:
        pass


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=200)
    parser.add_argument("--vocabulary", type=int, default=1000, help="small: the choice itself runs on the GPU in service")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    scheduler = Scheduler(max_batch=args.running, max_waiting=0, metrics=EngineMetrics())
    scheduler.runner = FixedLogits(args.running, args.vocabulary)
    scheduler._end_token_set = {args.vocabulary - 1}
    settings = GenerationSettings(max_new_tokens=10**9, min_new_tokens=10**9, do_sample=False)
    for _ in range(args.running):
        request = Request(messages=[], prepared=None, settings=settings, version=0,
                          requested_at=time.perf_counter(), emit=lambda kind, value: None)
        request.last_token = 1
        scheduler._running.append(request)
    runs = []
    with torch.inference_mode():
        for _ in range(args.runs):
            started = time.perf_counter()
            for _ in range(args.steps):
                scheduler._decode_step()
            runs.append((time.perf_counter() - started) / args.steps * 1000)
    result = {"running": args.running, "ms_per_step_median": round(sorted(runs)[len(runs) // 2], 3),
              "ms_per_step_runs": [round(ms, 3) for ms in runs], "torch_threads": torch.get_num_threads()}
    print(json.dumps(result))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
