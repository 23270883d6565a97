"""The batching engine's decode step alone: milliseconds per step by batch size, eager and CUDA-graph.

Slots are filled with one prefilled prompt (copied slot to slot), then the shared decode step is timed.
Also compares the captured step's next tokens with those of transformers' layers run eagerly. Run on a GPU machine:

    python benchmarks/decode_step.py --batches 1,8,32,64,128,200,256 --json decode.json
    python benchmarks/decode_step.py --model /tmp/real-shape-gptq --batches 1,64 --no-eager   # an int4 checkpoint
    python benchmarks/decode_step.py --batches 1,200 --no-eager --profile 12   # the kernels a replayed step runs
    python benchmarks/decode_step.py --batches 1,64,200 --no-eager --compile   # torch.compile'd step, then captured
    MINICPMV_FUSED_TEXT_MODEL=0 python benchmarks/decode_step.py --batches 1,200   # through transformers' layers
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.real_shape import benchmark_parser, chosen_model  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def timed_steps(step, count: int) -> float:
    """Milliseconds per call of `step`, after two untimed calls."""
    import torch

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(count):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / count * 1000


def kernel_profile(step, steps: int, top: int) -> dict:
    """Kernels run by `steps` calls of `step` (CUDA-graph replays included): count per step and the
    `top` kernels by GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [event for event in profiler.key_averages() if event.self_device_time_total > 0]
    total_us = sum(event.self_device_time_total for event in kernels)
    kernels.sort(key=lambda event: event.self_device_time_total, reverse=True)
    return {
        "kernels_per_step": round(sum(event.count for event in kernels) / steps),
        "gpu_ms_per_step": round(total_us / steps / 1000, 3),
        "top": [{"name": event.key[:90], "per_step": round(event.count / steps, 1),
                 "ms_per_step": round(event.self_device_time_total / steps / 1000, 3)} for event in kernels[:top]],
    }


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 while loading")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="time the CUDA-graph step only")
    parser.add_argument("--batches", default="1,8,32,64,128,200,256")
    parser.add_argument("--prompt-tokens", type=int, default=676)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="torch.compile the step before it is captured")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP", help="list the TOP kernels of a replayed step")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    from app.config import AppConfig
    from app.engine.core import ModelManager
    model = chosen_model(args)
    manager = ModelManager(AppConfig(model=model, load_in_4bit=args.load_in_4bit))
    manager.load()
    runner = manager.runner
    eager_step = runner.text.decode_step
    if args.compile:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = 64  # one graph per batch bucket
        runner.steps.step = torch.compile(eager_step, dynamic=False)  # what the captured graphs run
    batches = [int(b) for b in args.batches.split(",")]
    room = args.prompt_tokens + 4 * (args.steps + 2) + 16
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "prompt_tokens": args.prompt_tokens,
               "model": args.model or "random weights, real MiniCPM-V 4.6 shape", "dtype": manager.info().dtype,
               "batches": []}
    with torch.inference_mode():
        prompt = torch.randint(1000, 100000, (1, args.prompt_tokens))
        runner.store.reserve(max(batches), room)
        runner.prefill([(prompt, None, None)], 0, room)
        runner.store.move([0] * (max(batches) - 1), list(range(1, max(batches))))
        start_lengths = runner.store.lengths.clone()

        def snapshot():
            store = runner.store
            return [{k: t.clone() for k, t in d.items()} for d in (store.keys, store.values, store.conv, store.recurrent)]

        def restore(saved):
            store = runner.store
            for d, s in zip((store.keys, store.values, store.conv, store.recurrent), saved):
                for k, t in s.items():
                    d[k].copy_(t)
            store.lengths.copy_(start_lengths)

        # The captured step (fused kernels unless MINICPMV_FUSED_TEXT_MODEL=0) must choose what transformers'
        # layers choose, eagerly. Random weights leave near-ties, so the share of equal choices is reported.
        check = min(64, max(batches))
        tokens = torch.randint(1000, 100000, (check,), device="cuda")
        saved = snapshot()
        from app.model.backends import FusedText
        from app.model.text.layers import PromptEmbedder, TransformersText

        through_transformers = TransformersText(runner.model, runner.store, PromptEmbedder(runner.model))
        eager = through_transformers.decode_step(tokens, runner.store.lengths[:check].clone()).float()
        restore(saved)
        graphed = runner.steps.run(tokens).float()
        restore(saved)
        results["fused"] = isinstance(runner.text, FusedText)
        results["graph_same_choice_as_transformers"] = float((eager.argmax(-1) == graphed.argmax(-1)).float().mean())
        results["graph_max_abs_logit_diff"] = float((eager - graphed).abs().max())
        results["logit_scale"] = float(eager.abs().max())
        print(json.dumps({k: results[k] for k in ("fused", "graph_same_choice_as_transformers",
                                                  "graph_max_abs_logit_diff", "logit_scale")}), flush=True)

        for batch in batches:
            tokens = torch.randint(1000, 100000, (batch,), device="cuda")
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            runner.steps.run(tokens)  # capture outside the timing
            torch.cuda.synchronize()
            capture_ms = (time.perf_counter() - started) * 1000
            restore(saved)
            graph_ms = timed_steps(lambda: runner.steps.run(tokens), args.steps)
            restore(saved)
            eager_ms = None
            if args.eager:
                eager_ms = round(timed_steps(lambda: eager_step(tokens, runner.store.lengths[:batch].clone()), 10), 2)
                restore(saved)
            profiled = None
            if args.profile:
                profiled = {"graph": kernel_profile(lambda: runner.steps.run(tokens), 10, args.profile)}
                restore(saved)
                profiled["eager"] = kernel_profile(lambda: eager_step(tokens, runner.store.lengths[:batch].clone()), 3, args.profile)
                restore(saved)
            row = {"batch": batch, "graph_ms_per_step": round(graph_ms, 3), "eager_ms_per_step": eager_ms,
                   "graph_tokens_per_s": round(batch / graph_ms * 1000), "first_capture_ms": round(capture_ms),
                   "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "compiled": args.compile}
            if profiled:
                row["profile"] = profiled
            results["batches"].append(row)
            print(json.dumps(row), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
