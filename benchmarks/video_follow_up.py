"""A follow-up about a video, prepared on one CPU core as a preparing worker prepares it (`app/engine/inputs.py`):
its video sampled again, as every follow-up did before D70, against its kept conversation holding it
(app.engine.held_videos: the frames planned from the header, none decoded). Both give the same prompt tokens;
the engine encodes none of the frames either way, as its conversation's kept state holds what they gave. Clips
of 16, 60 and 120 seconds (1 frame a second, the model card's sampling) at 640x360 and 1280x720, made by
benchmarks/workloads.py. Only the processor's configuration matters, so the tiny checkpoint (the real one's
image and video processors) stands in:

    python benchmarks/video_follow_up.py --runs 5 --json video_follow_up.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.prefill import timed  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", default="16,60,120", help="the clips' lengths")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch

    from app.engine.conversations import video_key
    from app.engine.inputs import prepare_inputs
    from app.engine.processor import load_processor
    from app.engine.settings import GenerationSettings
    from app.media.video import planned_frames
    from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint
    from benchmarks.workloads import VIDEO_QUESTION, assistant_turn, make_video, user_turn

    torch.set_num_threads(1)  # as in a preparing worker
    processor = load_processor(ensure_tiny_checkpoint(), False)
    settings = GenerationSettings(max_new_tokens=128, video_fps=1.0, video_max_frames=128)
    rows = []
    for size in ((640, 360), (1280, 720)):
        for seconds in (int(s) for s in args.seconds.split(",")):
            path = make_video(seconds, size=size)
            messages = [user_turn({"type": "video", "path": path}, VIDEO_QUESTION),
                        assistant_turn("A square crosses a gradient."), user_turn(None, "Which way does it go?")]
            held = frozenset({video_key(path, planned_frames(path, settings.video_fps, settings.video_max_frames),
                                        settings)})

            def prepared(kept_media: frozenset):
                return lambda: prepare_inputs(processor, messages, settings, 32768, pixel_dtype=torch.bfloat16,
                                              kept_media=kept_media)

            sampled_ms, sampled = timed(lambda: None, prepared(frozenset()), args.runs)
            held_ms, planned = timed(lambda: None, prepared(held), args.runs)
            assert planned.pixels_left_out and planned.tensors["input_ids"].equal(sampled.tensors["input_ids"])
            rows.append({"size": f"{size[0]}x{size[1]}", "seconds": seconds, "frames": sampled.video_frames,
                         "prompt_tokens": sampled.prompt_tokens, "sampled_again_ms": round(sampled_ms, 1),
                         "held_ms": round(held_ms, 1)})
            print(json.dumps(rows[-1]), flush=True)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
