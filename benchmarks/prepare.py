"""Preparing one request's inputs on one CPU core (`app/engine/inputs.py`), as a preparing worker does it:
the benchmark's 1344x1344 PNG decoded, sliced (10 slices), cut into patches and cast to bf16, the prompt
rendered and tokenized. The processor as transformers ships it (given a PIL image) against the one the
app loads (patches cut by a reshape, slices kept in uint8, given the decoded tensor), and the app's processor
through one worker process (app.engine.preparers, as on a GPU box: the hop and the pixels' way back included);
the decoding of the PNG alone is timed apart (the app's decoders: OpenCV on a thread, and in a preparing worker
process libspng with the rows inflated by libdeflate (D58); libspng inflating them itself, as before; PIL), and
the same pixels as a JPEG. `MINICPMV_PREPARER_HELD_MEMORY_MB=0` runs the worker as before D54. Then the video-16
workload's video (16 frames sampled from a 16 s 640x360 clip): through the app's processor (uint8 frames, D68), with
its frames normalized in float32 as the processor as shipped does (the app's before D68), and through a worker
process. Only the processor's configuration matters here, so the tiny checkpoint (same image and video processors
as the real one) stands in:

    python benchmarks/prepare.py --runs 9 --json prepare.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.prefill import timed  # noqa: E402
from benchmarks.real_shape import benchmark_request  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import torch
    from transformers import AutoProcessor

    from app.engine.inputs import prepare_inputs
    from app.engine.processor import load_processor
    from app.engine.preparers import ProcessPreparer
    from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint
    from app.engine.settings import GenerationSettings
    from app.media.images import load_image, load_image_pixels

    torch.set_num_threads(1)  # as in a preparing worker
    folder = ensure_tiny_checkpoint()
    image, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=128)
    row = {"decode_png_ms": round(timed(lambda: None, lambda: load_image_pixels(image), args.runs)[0], 1),
           "decode_png_libspng_ms": round(timed(lambda: None, lambda: load_image_pixels(image, True), args.runs)[0], 1),
           "decode_png_libspng_alone_ms": round(timed(lambda: None, lambda: libspng_alone(image), args.runs)[0], 1),
           "decode_png_pil_ms": round(timed(lambda: None, lambda: load_image(image), args.runs)[0], 1)}
    shipped = AutoProcessor.from_pretrained(folder)
    prompt = shipped.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    as_shipped = lambda: shipped(text=[prompt], images=[[load_image(image)]], return_tensors="pt")  # noqa: E731
    row["as_shipped_ms"] = round(timed(lambda: None, as_shipped, args.runs)[0], 1)
    processor = load_processor(folder, False)
    prepare = lambda: prepare_inputs(processor, messages, settings, 32768, pixel_dtype=torch.bfloat16)  # noqa: E731
    row["app_ms"] = round(timed(lambda: None, prepare, args.runs)[0], 1)
    # The benchmark's noise PNG is the slow case to decode (no redundancy); the same pixels as a JPEG.
    jpeg, jpeg_messages = benchmark_request("jpeg")
    row["jpeg_mb"] = round(os.path.getsize(jpeg) / 1e6, 2)
    row["decode_jpeg_ms"] = round(timed(lambda: None, lambda: load_image_pixels(jpeg), args.runs)[0], 1)
    row["app_jpeg_ms"] = round(timed(lambda: None, lambda: prepare_inputs(processor, jpeg_messages, settings, 32768,
                                                                          pixel_dtype=torch.bfloat16), args.runs)[0], 1)
    video_messages, video_settings = video_request()
    prepare_video = lambda with_processor: lambda: prepare_inputs(  # noqa: E731
        with_processor, video_messages, video_settings, 32768, pixel_dtype=torch.bfloat16)
    row["video_app_ms"] = round(timed(lambda: None, prepare_video(processor), args.runs)[0], 1)
    normalizing = load_processor(folder, False)
    normalizing.video_processor.do_rescale = normalizing.video_processor.do_normalize = True
    row["video_normalized_in_float_ms"] = round(timed(lambda: None, prepare_video(normalizing), args.runs)[0], 1)
    worker = ProcessPreparer(folder, False, 1, torch.bfloat16)
    row["video_app_in_a_worker_process_ms"] = round(timed(
        lambda: None, lambda: worker.prepare(video_messages, video_settings, 32768), args.runs)[0], 1)
    row["app_in_a_worker_process_ms"] = round(timed(lambda: None, lambda: worker.prepare(messages, settings, 32768), args.runs)[0], 1)
    # As on a GPU box (JPEG_ON_DEVICE): the engine slices the image, the worker decodes it.
    gpu_path = lambda: worker.prepare(messages, settings, 32768, jpegs_on_device=True)  # noqa: E731
    row["app_in_a_worker_process_gpu_path_ms"] = round(timed(lambda: None, gpu_path, args.runs)[0], 1)
    worker.close()
    print(json.dumps(row), flush=True)
    write_json(args.json, row)


def video_request():
    """The video-16 workload's request and settings (benchmarks/workloads.py)."""
    from app.engine.settings import GenerationSettings
    from benchmarks.workloads import VIDEO_QUESTION, VIDEO_SETTINGS, make_video, user_turn

    return [user_turn({"type": "video", "path": make_video()}, VIDEO_QUESTION)], \
        GenerationSettings(max_new_tokens=128, **VIDEO_SETTINGS)


def libspng_alone(path: str):
    """libspng inflating the rows itself, as before D58."""
    import pyspng

    with open(path, "rb") as file:
        return pyspng.load(file.read(), "RGB")


if __name__ == "__main__":
    main()
