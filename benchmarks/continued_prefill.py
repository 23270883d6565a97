"""What a kept conversation changes in the numbers, and what its prefill costs: a prompt prefilled whole
against the same prompt prefilled in two parts (up to its last turn's start, then the rest from the kept
state), by each way the second part can run: a captured graph (1, 4 or 8 prompts:
app.model.continued_graphs.CONTINUED_GRAPH_LENGTHS) and packed, launched from Python (3 prompts, a count with no
graph). Prints the largest logit difference, whether the chosen token agrees, and the GPU time of each way,
median over --runs.

Random weights at the real MiniCPM-V 4.6 shape by default; the prompt is the benchmarks' 1344x1344 image
and question (benchmarks/real_shape.py), prepared as the engine prepares it:

    python benchmarks/continued_prefill.py --runs 20
    python benchmarks/continued_prefill.py --model tiny-random --runs 2      # a quick CPU check
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.config import AppConfig  # noqa: E402
from app.engine.core import ModelManager  # noqa: E402
from app.engine.settings import GenerationSettings  # noqa: E402
from benchmarks.real_shape import benchmark_parser, benchmark_request, chosen_model  # noqa: E402


def timed(run, cuda: bool, runs: int):
    """(run()'s last result, its median milliseconds)."""
    import torch

    times = []
    for _ in range(runs):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = run()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return result, statistics.median(times)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--image-format", choices=("png", "jpeg"), default="jpeg")
    args = parser.parse_args()

    model = chosen_model(args)
    manager = ModelManager(AppConfig(model=model, engine_process=False))
    manager.load()
    manager.warm_up()
    cuda = str(manager.device).startswith("cuda")
    _, messages = benchmark_request(args.image_format)
    prepared = manager.prepare(messages, GenerationSettings(max_new_tokens=8, enable_thinking=False))
    runner = manager.runner
    ids = prepared.tensors["input_ids"]
    turn = prepared.turn_starts[-1]
    columns = ids.shape[1] + 64
    with runner.serving():
        features = runner.encode_media([(prepared.tensors, "16x")])[0]
        whole, whole_ms = timed(lambda: runner.prefill([(ids, features, None)], 0, columns).clone(), cuda, args.runs)
        head, head_ms = timed(lambda: runner.prefill([(ids[:, :turn], features, None)], 0, columns), cuda, args.runs)
        kept = runner.snapshots([0], [turn])[0]
        rows = {}
        ways = (("1 prompt (a captured graph on CUDA)", 1), ("4 prompts (a captured graph on CUDA)", 4),
                ("8 prompts (a captured graph on CUDA)", 8), ("3 prompts, packed", 3))
        for name, count in ways:
            def going_on():
                runner.restore([kept] * count, list(range(count)), columns)
                return runner.prefill_continued([(ids[:, turn:], None)] * count, [turn] * count, list(range(count)), columns)

            logits, ms = timed(going_on, cuda, args.runs)
            rows[name] = (logits[:1].clone(), ms)
    print(f"prompt: {ids.shape[1]} tokens, its last turn from {turn}; kept state {kept.nbytes / 2**20:.1f} MiB")
    print(f"whole prompt prefill: {whole_ms:.2f} ms; up to the turn's start: {head_ms:.2f} ms")
    print("| second part | ms (restores included) | largest logit difference | same token |")
    print("|---|---|---|---|")
    for name, (logits, ms) in rows.items():
        difference = (logits.float() - whole.float()).abs().max().item()
        same = bool((logits.argmax(-1) == whole.argmax(-1)).all())
        print(f"| {name} | {ms:.2f} | {difference:.4f} (logits up to {whole.float().abs().max().item():.1f}) | {same} |")
    manager.runner.release()


if __name__ == "__main__":
    main()
