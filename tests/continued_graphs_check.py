"""A wave of generation prompts of conversations past 2,048 tokens through the captured continued prefills
(app.model.continued_graphs: 64 of them gather too many keys and values for one graph, so they run as halves of
32 that share one graph) against the same wave launched from Python, packed, on a CUDA machine: each prompt's
next-token logits and the states it leaves in its slot must agree within bf16's rounding, row for row, and each
row must differ more from the row half a wave on than from itself: every row's generation prompt differs from
the others' in its last tokens, so a half that ran another half's inputs shows. The real-shape checkpoint with
random weights, or --model:

    python tests/continued_graphs_check.py --prompts 64,48
    python tests/continued_graphs_check.py --prompts 16,5,1 --turn-tokens 150
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.config import AppConfig  # noqa: E402
from app.engine.core import ModelManager  # noqa: E402
from benchmarks.experiments.follow_up_wave import kept_follow_up  # noqa: E402
from benchmarks.real_shape import benchmark_parser, chosen_model  # noqa: E402


def states(store, slots: list[int]) -> list:
    """Copies of the slots' DeltaNet states (recurrent and convolution), every layer."""
    return [t[slots].float().clone() for layers in (store.recurrent, store.conv) for t in layers.values()]


def main() -> None:
    import torch

    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", default="64,48", help="waves' sizes, comma-separated")
    parser.add_argument("--turn-tokens", default="0", help="tokens of a new turn before each generation prompt, "
                        "comma-separated (150: a follow-up's, run as graphs of 192 places)")
    args = parser.parse_args()
    manager = ModelManager(AppConfig(model=chosen_model(args), engine_process=False))
    manager.load()
    manager.warm_up()
    runner = manager.runner
    failures = []
    with runner.serving():
        ids, kept_at, turn, columns, kept = kept_follow_up(manager, "A grey field. " * 200)
        runner.restore([kept], [0], columns)  # the follow-up's state at its generation prompt, past 2,048 tokens
        runner.prefill_continued([(ids[:, kept_at:turn], None)], [kept_at], [0], columns)
        long = runner.snapshots([0], [turn])[0]
        print(f"generation prompts of {ids.shape[1] - turn} tokens after {turn}")
        known = ids[0].unique().tolist()
        waves = [(int(n), int(extra)) for extra in args.turn_tokens.split(",") for n in args.prompts.split(",")]
        for count, extra in waves:
            slots = list(range(count))
            prompts = []
            for row in slots:  # each row's generation prompt its own: its last tokens changed to others the prompt has
                generation_prompt = torch.cat([ids[:, 1:1 + extra], ids[:, turn:]], dim=1)
                generation_prompt[0, -3:] = torch.tensor([known[(row + shift) % len(known)] for shift in range(3)])
                prompts.append((generation_prompt, None))
            results = []
            for captured in (True, False):
                runner.restore([long] * count, slots, columns)
                if captured:
                    logits = runner.prefill_continued(prompts, [turn] * count, slots, columns)
                else:  # the fused model's packed prefill, past the graphs
                    embeddings = runner.text.embedded(torch.cat([p for p, _ in prompts], dim=1), None)[0]
                    logits = runner.text.fused.prefill_continued(embeddings, [p.shape[1] for p, _ in prompts],
                                                                 [turn] * count, slots)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                results.append((logits.float().clone(), states(runner.store, slots)))
            (graphs, graph_states), (packed, packed_states) = results
            scale = packed.abs().max().item()
            worst = (graphs - packed).abs().max().item() / scale
            rows_apart = [(graphs[row] - packed[row]).abs().max().item() / scale for row in slots]
            state_worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                              for a, b in zip(graph_states, packed_states))
            same_choice = (graphs.argmax(-1) == packed.argmax(-1)).float().mean().item()
            # What another row's inputs would have given: each row against the packed result of the row half a wave on.
            other = packed.roll(count // 2, dims=0) if count > 1 else packed
            swapped = (graphs - other).abs().amax(-1).min().item() / scale
            print(f"{count} prompts of {prompts[0][0].shape[1]} tokens: logits' largest difference {worst:.4f} of their largest value (row "
                  f"{rows_apart.index(max(rows_apart))}), states' {state_worst:.4f}; the same next token in "
                  f"{same_choice:.0%} of rows; against the rows half a wave on, at least {swapped:.4f}")
            if worst > 0.05 or state_worst > 0.05 or (count > 1 and swapped <= 2 * worst):
                failures.append((count, extra))
    runner.release()
    if failures:
        sys.exit(f"Captured continued prefills differ from the packed ones for waves (prompts, turn tokens) of {failures}")
    print("The captured continued prefills agree with the packed ones.")


if __name__ == "__main__":
    main()
