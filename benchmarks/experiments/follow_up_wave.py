"""What one wave of follow-ups costs the GPU, part by part, as app.engine.conversations.prefill_wave runs it:
the kept states restored into the slots, the new turns prefilled from them (the last reply and the new
question), the states at the new turns' starts kept, then the generation prompts prefilled. Each part is
timed alone (wall time with the GPU waited for, the host's launches included) and profiled (its kernels'
GPU time by kind and the costliest by name), for waves of --prompts follow-ups to the benchmarks' 1344x1344
photo (the follow-up workload's second turn: a 128-token reply and a question).

    python benchmarks/experiments/follow_up_wave.py --prompts 1,8,16 --runs 10
    python benchmarks/experiments/follow_up_wave.py --model tiny-random --prompts 2 --runs 2   # a quick CPU check
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from app.config import AppConfig  # noqa: E402
from app.engine.core import ModelManager  # noqa: E402
from app.engine.settings import GenerationSettings  # noqa: E402
from benchmarks.real_shape import QUESTION, benchmark_parser, benchmark_request, chosen_model  # noqa: E402
from benchmarks.workloads import FOLLOW_UP_QUESTION, assistant_turn, user_turn  # noqa: E402

REPLY_TOKENS = 128  # the benchmarks' replies: exactly 128 new tokens a turn
SENTENCE = "The picture is a field of grey noise with no object in it, evenly spread. "


def part_times(run, cuda: bool, runs: int) -> tuple[float, dict]:
    """(median wall ms of run(), its kernels in one profiled run: GPU ms by kind and the costliest)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from app.model.gpu_profile import spans_of, summary

    times = []
    for _ in range(runs):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    if not cuda:
        return statistics.median(times), {}
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        run()
        torch.cuda.synchronize()
    spans, _ = spans_of(profiled)
    report = summary(spans)
    return statistics.median(times), {"gpu_busy_ms": report["busy_ms"], "by_kind": report["kernel_ms_by_kind"],
                                      "top": {name: value["ms"] for name, value in list(report["top_kernels"].items())[:6]}}


def kept_follow_up(manager, reply: str):
    """The benchmarks' follow-up to their 1344x1344 photo after `reply`, its opening prefilled into slot 0 and
    the state at the follow-up's kept length snapshotted (call within manager.runner.serving()): (its input ids,
    the kept length, where its generation prompt starts, the columns a slot needs, the kept state)."""
    image, _ = benchmark_request("jpeg")
    opening = [user_turn({"type": "image", "path": image}, QUESTION)]
    follow_up = [*opening, assistant_turn(reply), user_turn(None, FOLLOW_UP_QUESTION)]
    settings = GenerationSettings(max_new_tokens=128, enable_thinking=False)
    first, second = manager.prepare(opening, settings), manager.prepare(follow_up, settings)
    kept_at, turn = first.turn_starts[-1], second.turn_starts[-1]
    ids = second.tensors["input_ids"]
    columns = ids.shape[1] + 128
    runner = manager.runner
    features = runner.encode_media([(first.tensors, settings.downsample_mode)])[0]
    runner.prefill([(ids[:, :kept_at], features, None)], 0, columns)
    return ids, kept_at, turn, columns, runner.snapshots([0], [kept_at])[0]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", default="1,8,16", help="waves' sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()

    manager = ModelManager(AppConfig(model=chosen_model(args), engine_process=False))
    manager.load()
    manager.warm_up()
    cuda = str(manager.device).startswith("cuda")
    tokenizer = manager.processor.tokenizer
    reply = tokenizer.decode(tokenizer(SENTENCE * REPLY_TOKENS)["input_ids"][:REPLY_TOKENS])
    runner = manager.runner
    with runner.serving():
        ids, kept_at, turn, columns, kept = kept_follow_up(manager, reply)
        print(f"follow-up: {ids.shape[1]} prompt tokens, kept {kept_at}, new turn {kept_at}-{turn}, generation prompt "
              f"{turn}-{ids.shape[1]}; {columns} columns a slot")
        print("| prompts | part | wall ms | GPU busy ms | GPU ms by kind | costliest kernels (ms) |")
        print("|---|---|---|---|---|---|")
        for count in [int(n) for n in args.prompts.split(",")]:
            slots = list(range(count))
            parts = {
                "restore": lambda: runner.restore([kept] * count, slots, columns),
                "new turn": lambda: (runner.restore([kept] * count, slots, columns),
                                     runner.prefill_continued([(ids[:, kept_at:turn], None)] * count, [kept_at] * count,
                                                              slots, columns)),
                "keep": lambda: runner.snapshots(slots, [turn] * count),
                "generation prompt": lambda: runner.prefill_continued([(ids[:, turn:], None)] * count, [turn] * count,
                                                                      slots, columns),
            }
            for name, run in parts.items():
                ms, kernels = part_times(run, cuda, args.runs)
                print(f"| {count} | {name} | {ms:.2f} | {kernels.get('gpu_busy_ms', '-')} | {kernels.get('by_kind', '-')} "
                      f"| {kernels.get('top', '-')} |")
    runner.release()


if __name__ == "__main__":
    main()
