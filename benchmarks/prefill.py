"""Where a prefill wave's time goes: the vision tower against the text model, by wave size, and the kernels.

At 50-200 users the scheduler spends most of its time prefilling newcomers (docs/DECISIONS.md D22), so
this times the two halves of a wave exactly as the scheduler runs them (BatchRunner.encode_media, then
BatchRunner.prefill; the fused vision tower and text model against transformers' modules too, with
their features and next tokens compared, and a small wave's captured text prefill against the same
kernels launched from Python) for waves of --rows requests of the benchmark's 1344x1344
image, and lists the GPU kernels of the smallest and the largest wave (their busy time against the
wave's: launch-bound or not).
Random weights at the real 4.6 shape; run on a GPU machine:

    python benchmarks/prefill.py --rows 1 4 16 --json prefill.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.config import AppConfig  # noqa: E402
from app.model.backends import FusedText  # noqa: E402
from app.model.cuda_graphs import PREFILL_GRAPH_LENGTHS  # noqa: E402
from app.model.uncaptured import LaunchedPrefills  # noqa: E402
from app.engine.core import ModelManager  # noqa: E402
from app.engine.settings import GenerationSettings  # noqa: E402
from app.model.text.layers import PromptEmbedder, TransformersText  # noqa: E402
from app.model.vision.fused import FusedVisionTower  # noqa: E402
from app.model.vision.tower import TransformersVisionTower  # noqa: E402
from benchmarks.decode_step import kernel_profile  # noqa: E402
from benchmarks.real_shape import DEFAULT_FOLDER, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def timed(synchronize, function, runs: int) -> tuple[float, object]:
    """Median GPU-inclusive milliseconds of `function` over `runs` runs (after one untimed run), and its result."""
    result = function()
    times = []
    for _ in range(runs):
        synchronize()
        started = time.perf_counter()
        result = function()
        synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[len(times) // 2], result


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint instead of the real-shape random one")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kernels", type=int, default=25, help="top kernels of the largest wave to list")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch

    manager = ModelManager(AppConfig(model=args.model or ensure_real_shape_checkpoint(DEFAULT_FOLDER), prepare_processes=0))
    manager.load()
    runner = manager.runner
    _, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=128, do_sample=False)
    prepared = manager.prepare(messages, settings)
    mode = settings.downsample_mode
    cuda = torch.cuda.is_available()
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "prompt_tokens": prepared.prompt_tokens, "visual_tokens": prepared.visual_tokens, "waves": []}

    def vision(rows):
        return runner.encode_media([(prepared.tensors, mode)] * rows)

    fused_vision = runner.vision if isinstance(runner.vision, FusedVisionTower) else None
    if fused_vision is not None:  # transformers' modules as the runner tunes them when it does not fuse
        transformers_vision = TransformersVisionTower(runner.model)

    def vision_through_transformers(rows):
        runner.vision = transformers_vision
        try:
            return vision(rows)
        finally:
            runner.vision = fused_vision

    def prompts(features):
        return [(prepared.tensors["input_ids"], feature, prepared.canvas) for feature in features]

    def text(rows, features):
        return runner.prefill(prompts(features), 0, prepared.prompt_tokens + 128)

    fused_text = runner.text if isinstance(runner.text, FusedText) else None
    prefill_graphs = fused_text.prefill_graphs if fused_text else LaunchedPrefills()
    through_transformers = TransformersText(runner.model, runner.store, PromptEmbedder(runner.model))

    def text_eager(rows, features):  # the fused text model launched from Python, where a graph would replay
        fused_text.prefill_graphs = LaunchedPrefills()
        try:
            return text(rows, features)
        finally:
            fused_text.prefill_graphs = prefill_graphs

    def text_through_transformers(rows, features):
        runner.store.reserve(rows, prepared.prompt_tokens + 128)
        return through_transformers.prefill(prompts(features), 0)

    with torch.inference_mode():
        for rows in args.rows:
            vision_ms, features = timed(synchronize, lambda: vision(rows), args.runs)
            text_ms, logits = timed(synchronize, lambda: text(rows, features), args.runs)
            wave = {"rows": rows, "vision_ms": round(vision_ms, 1), "text_ms": round(text_ms, 1),
                    "per_request_ms": round((vision_ms + text_ms) / rows, 1)}
            if fused_vision is not None:  # the fused vision tower against transformers' modules
                theirs_ms, theirs = timed(synchronize, lambda: vision_through_transformers(rows), args.runs)
                difference = max(float((ours.float() - reference.float()).abs().max()) for ours, reference in zip(features, theirs))
                wave.update(vision_ms_through_transformers=round(theirs_ms, 1), max_abs_feature_diff=difference,
                            max_abs_feature=float(theirs[0].float().abs().max()))
            captured = any(size >= prepared.prompt_tokens for size in PREFILL_GRAPH_LENGTHS.get(rows, ()))
            if not isinstance(prefill_graphs, LaunchedPrefills) and captured:  # the captured prefill against launches
                logits = logits.clone()  # the graph's output, overwritten by its next replay
                eager_ms, eager = timed(synchronize, lambda: text_eager(rows, features), args.runs)
                wave.update(text_ms_launched=round(eager_ms, 1),
                            launched_same_choice=float((logits.argmax(-1) == eager.argmax(-1)).float().mean()),
                            launched_max_abs_logit_diff=float((logits.float() - eager.float()).abs().max()))
            if fused_text is not None:  # the fused text model against transformers' layers
                theirs_ms, theirs = timed(synchronize, lambda: text_through_transformers(rows, features), args.runs)
                wave.update(text_ms_through_transformers=round(theirs_ms, 1),
                            same_choice=float((logits.argmax(-1) == theirs.argmax(-1)).float().mean()),
                            max_abs_logit_diff=float((logits.float() - theirs.float()).abs().max()))
            runner.release()  # the next wave size's memory
            results["waves"].append(wave)
            print(json.dumps(wave), flush=True)

        profiles = []
        for rows in sorted({min(args.rows), max(args.rows)}) if cuda else ():
            # One whole wave as the "step": its kernel launches and GPU busy time against the wave's time.
            profiles.append({"rows": rows, **kernel_profile(lambda: text(rows, vision(rows)), 1, args.kernels)})
            print(json.dumps(profiles[-1], indent=1))
    results["profiles"] = profiles
    write_json(args.json, results)


if __name__ == "__main__":
    main()
