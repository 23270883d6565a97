"""One user's conversation, turn by turn: the time to first token of each follow-up as the conversation grows.

A run is one conversation: a 1344x1344 JPEG (a noise photo of its own) with a question, then text follow-ups,
--turns turns in all, one after the other. Each turn's answer, the text the engine gave, goes into the
conversation as the assistant's message, as the UI does; each reply is exactly --new-tokens new tokens,
greedy. Every run is a new conversation (its own image and first question), so that none can reuse another's.
The engine runs in a process of its own, as `python app.py` runs it (--in-process-engine: in this one).
Prints, for every turn, the median time to first token over --runs runs (each run's beside it), and the
engine's prompt tokens and `reused_prompt_tokens` (where the reply's stats give it; `-` otherwise), as a
markdown table. Random weights at the real MiniCPM-V 4.6 shape by default:

    python benchmarks/follow_ups.py --turns 10 --runs 3 --json follow_ups.json
    python benchmarks/follow_ups.py --model tiny-random --turns 4 --runs 1   # a quick CPU check
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.real_shape import QUESTION, benchmark_parser, chosen_model  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.workloads import assistant_turn, engine_reply, image_part, noise_image, user_turn  # noqa: E402

FOLLOW_UPS = ("And what about the left corner?", "What colours stand out?", "Is there any text in it?",
              "What is in the middle?", "How would you describe the light?", "What is at the top right?",
              "Does anything repeat?", "What would you crop out?", "What is the texture like?",
              "Sum it up in one line.")


def conversation(manager, settings, run: int, turns: int) -> list[dict]:
    """One run's conversation: each turn's time to first token (ms), prompt tokens and reused prompt tokens."""
    messages = [user_turn(image_part(noise_image(1344, "jpeg", tag=f"-run{run}")), f"Run {run}: {QUESTION}")]
    measured = []
    for turn in range(1, turns + 1):
        if turn > 1:
            messages.append(user_turn(None, FOLLOW_UPS[(turn - 2) % len(FOLLOW_UPS)]))
        answer, stats = engine_reply(manager, messages, settings)
        messages.append(assistant_turn(answer))
        measured.append({"turn": turn, "ttft_ms": stats["ttft_ms"], "prompt_tokens": stats["prompt_tokens"],
                         "reused_prompt_tokens": stats.get("reused_prompt_tokens"), "new_tokens": stats["new_tokens"]})
    return measured


def median_or_dash(values: list) -> str:
    known = [value for value in values if value is not None]
    return f"{statistics.median(known):,.0f}" if known else "-"


def turns_table(runs: list[list[dict]]) -> str:
    """Turns as rows: the median first token over the runs, each run's, the prompt and reused prompt tokens."""
    rows = ["| turn | first token, median (ms) | each run (ms) | prompt tokens | reused prompt tokens |",
            "|---|---|---|---|---|"]
    for index in range(len(runs[0])):
        turn = [run[index] for run in runs]
        each = " / ".join(f"{t['ttft_ms']:.0f}" for t in turn)
        rows.append(f"| {index + 1} | {median_or_dash([t['ttft_ms'] for t in turn])} | {each} | "
                    f"{median_or_dash([t['prompt_tokens'] for t in turn])} | "
                    f"{median_or_dash([t['reused_prompt_tokens'] for t in turn])} |")
    return "\n".join(rows)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--turns", type=int, default=10, help="turns of each conversation, the first with the image")
    parser.add_argument("--runs", type=int, default=3, help="conversations, one after the other")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="each answer's tokens (issue 32's measurement grew about 80 prompt tokens a turn)")
    parser.add_argument("--in-process-engine", action="store_true", help="the engine in this process (as before the split)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch
    import transformers

    from app.config import AppConfig
    from app.engine.client import EngineProcess
    from app.engine.core import ModelManager
    from app.engine.settings import GenerationSettings

    model = chosen_model(args)
    config = AppConfig(model=model, engine_process=not args.in_process_engine)
    manager = (EngineProcess if config.engine_process else ModelManager)(config)
    manager.load()
    manager.warm_up()
    settings = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

    runs = []
    for run in range(1, args.runs + 1):
        runs.append(conversation(manager, settings, run, args.turns))
        print(f"run {run}: first token " + " / ".join(f"{t['ttft_ms']:.0f}" for t in runs[-1]) + " ms", flush=True)
    print(turns_table(runs), flush=True)
    write_json(args.json, {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": args.model or "random weights, real MiniCPM-V 4.6 shape",
        "engine": "process of its own" if config.engine_process else "in-process",
        "new_tokens": args.new_tokens, "turns": args.turns,
        "median_ttft_ms": [statistics.median(run[index]["ttft_ms"] for run in runs) for index in range(args.turns)],
        "runs": runs,
    })


if __name__ == "__main__":
    main()
