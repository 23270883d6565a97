"""A lone request's time to first token with a 1344x1344 JPEG photo and with RESULTS.md's noise PNG (4.6 MB),
the engine making JPEGs' pixels on the GPU (MINICPMV_JPEG_ON_DEVICE=1: nvJPEG, then the processor's resize
and slices, app/model/jpegs.py) and not (0: the preparers decode every image), each engine in a process of
its own as `python app.py` runs it; where each request's time went; and how far the GPU path's pixels are
from the CPU path's (docs/DECISIONS.md D43). Random weights at the real MiniCPM-V 4.6 shape. On a GPU machine:

    python benchmarks/jpeg_on_device.py --runs 30 --json jpeg.json
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.photo import write_photo  # noqa: E402
from benchmarks.real_shape import DEFAULT_FOLDER, QUESTION, asked_anew, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def question(path: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "path": path}, {"type": "text", "text": QUESTION}]}]


def images(folder: str) -> dict[str, str]:
    """The requests' images: the photo (baseline and progressive, and one whose refined view is resized
    too) as JPEGs of quality 90, the noise PNG, and a JPEG whose compressed data is broken."""
    made = {"photo_jpeg": write_photo(os.path.join(folder, "photo-1344.jpg"), 1344, 1344),
            "progressive_jpeg": write_photo(os.path.join(folder, "photo-1344-progressive.jpg"), 1344, 1344, progressive=True),
            "photo_1000x750_jpeg": write_photo(os.path.join(folder, "photo-1000x750.jpg"), 1000, 750, seed=1),
            "noise_png": benchmark_request("png")[0]}
    data = bytearray(open(made["photo_1000x750_jpeg"], "rb").read())
    start = data.find(b"\xff\xda") + 20
    data[start:-2:7] = b"\xff" * len(range(start, len(data) - 2, 7))
    made["corrupt_jpeg"] = os.path.join(folder, "corrupt.jpg")
    open(made["corrupt_jpeg"], "wb").write(bytes(data))
    return made


def pixel_check(checkpoint: str, paths: dict[str, str], runs: int) -> dict:
    """For each JPEG: the GPU path's pixel_values against the CPU path's (the processor's), in uint8 levels;
    nvJPEG's decoded image against libjpeg-turbo's; the GPU path's code on CPU tensors against the
    processor (bit for bit expected); and the GPU path's decode and slice times (CUDA events, medians)."""
    import torch

    from app.engine.inputs import prepare_inputs
    from app.engine.processor import load_processor
    from app.engine.jpegs_on_device import DEFERRED_IMAGES
    from app.engine.settings import GenerationSettings
    from app.media.images import load_image_pixels
    from app.model.jpegs import CPU, decoded, image_views, resized, slices

    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    processor, settings, cuda = load_processor(checkpoint, False), GenerationSettings(max_new_tokens=8), torch.device("cuda")
    report = {}
    for name in ("photo_jpeg", "progressive_jpeg", "photo_1000x750_jpeg"):
        path = paths[name]
        expected = prepare_inputs(processor, question(path), settings, 32768).tensors["pixel_values"]
        deferred = prepare_inputs(processor, question(path), settings, 32768, jpegs_on_device=True).tensors[DEFERRED_IMAGES]
        made = slices(deferred, cuda).cpu()
        image = decode_jpeg(read_file(path), mode=ImageReadMode.RGB, device=cuda)  # nvJPEG's alone, no fallback
        report[name] = {
            "bytes": os.path.getsize(path),
            "pixel_values": levels(made, expected),
            "decoded_nvjpeg_vs_libjpeg": levels(image.cpu(), load_image_pixels(path)),
            "gpu_code_on_the_cpu_bit_for_bit": bool(torch.equal(slices(deferred, CPU, resize=resized), expected)),
            "gpu_decode_ms": gpu_ms(lambda: decoded(deferred.paths, cuda), runs),
            "gpu_slice_ms": gpu_ms(lambda: image_views(image, deferred.slicings[0], deferred.patch_size, resized), runs),
        }
    try:
        decode_jpeg(read_file(paths["corrupt_jpeg"]), mode=ImageReadMode.RGB, device=cuda)
        report["corrupt_jpeg_by_nvjpeg"] = "decoded without an error (the engine then serves what nvJPEG made of it)"
    except RuntimeError as error:
        report["corrupt_jpeg_by_nvjpeg"] = f"refused: {str(error)[:120]} (the engine then tries the CPU, which refuses it)"
    return report


def levels(made, expected) -> dict:
    """How far two uint8 tensors of one shape are apart."""
    difference = (made.int() - expected.int()).abs()
    return {"max_levels": int(difference.max()), "mean_levels": round(float(difference.float().mean()), 4),
            "share_differing": round(float((difference > 0).float().mean()), 5),
            "share_over_1_level": round(float((difference > 1).float().mean()), 5)}


def gpu_ms(work, runs: int) -> float:
    """Median GPU time of `work` in ms, from its launch to the end of its last kernel (after one run to warm up)."""
    import torch

    work()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 3)


def lone_requests(model: str, on_device: int, paths: dict[str, str], runs: int, new_tokens: int) -> dict:
    """An engine process started with MINICPMV_JPEG_ON_DEVICE=`on_device`: each image's requests one at a time."""
    from app.config import AppConfig
    from app.engine.client import EngineProcess
    from app.engine.settings import GenerationSettings

    os.environ["MINICPMV_JPEG_ON_DEVICE"] = str(on_device)  # read by the engine process as it starts
    engine = EngineProcess(AppConfig(model=model, port=7898))
    started = time.perf_counter()
    engine.load()
    engine.warm_up()
    result = {"load_and_warm_up_s": round(time.perf_counter() - started, 1)}
    settings = GenerationSettings(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    numbers = itertools.count()
    for name in ("photo_jpeg", "noise_png"):
        for _ in range(3):  # the first of each kind meets new shapes and, on the GPU path, nvJPEG's first batch
            reply(engine, paths[name], settings, next(numbers))
        engine.metrics.reset()
        stats = [reply(engine, paths[name], settings, next(numbers)) for _ in range(runs)]
        result[name] = summary(stats, engine.metrics.snapshot())
    try:
        reply(engine, paths["corrupt_jpeg"], settings, next(numbers))
        result["corrupt_jpeg"] = "answered"
    except Exception as error:  # the app's message for an unreadable image, or what went wrong
        result["corrupt_jpeg"] = f"refused: {error}"
    result["after_the_corrupt_jpeg"] = "answered" if reply(engine, paths["photo_jpeg"], settings, next(numbers)) else "failed"
    engine.close()
    return result


def reply(engine, path: str, settings, number: int) -> dict:
    """Request `number`'s stats: each a first question of its own (asked_anew)."""
    for update in engine.stream(asked_anew(question(path), number), settings):
        pass
    return update.stats


def summary(stats: list[dict], metrics: dict) -> dict:
    """Medians of a kind's requests, the stages of their time to first token, and the engine's GPU figures."""
    def median(values):
        return round(statistics.median(values), 1)

    waves = metrics["prefill_waves"] or 1
    stages = {stage: median([s["preparation_ms"][stage] for s in stats]) for stage in stats[0]["preparation_ms"]}
    return {
        "requests": len(stats), "prompt_tokens": stats[0]["prompt_tokens"], "visual_tokens": stats[0]["visual_tokens"],
        "ttft_ms_median": median([s["ttft_ms"] for s in stats]), "ttft_ms_min": min(s["ttft_ms"] for s in stats),
        "ttft_ms_p90": round(sorted(s["ttft_ms"] for s in stats)[int(0.9 * (len(stats) - 1))], 1),
        # In engine mode nothing is uploaded: the request starts in the engine with the file on disk.
        "stages_ms_median": {"upload": None, "preprocess": median([s["preprocess_ms"] for s in stats]),
                             "preparation": stages, "queue": median([s["queue_ms"] for s in stats]),
                             "wave_to_first_token": median([s["ttft_ms"] - s["preprocess_ms"] - s["queue_ms"] for s in stats]),
                             "vision_per_wave": round(1000 * metrics["busy_seconds"]["vision"] / waves, 1),
                             "prefill_host_per_wave": round(1000 * metrics["busy_seconds"]["prefill"] / waves, 1)},
    }


def main() -> None:
    from app.config import apply_environment

    apply_environment()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER)
    parser.add_argument("--runs", type=int, default=30, help="requests of each kind for each setting (medians)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--paths", default="1,0", help="MINICPMV_JPEG_ON_DEVICE settings to run, in order (1: the GPU path)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    settings = [int(flag) for flag in args.paths.split(",")]

    import torch
    import torchvision
    import transformers

    model = ensure_real_shape_checkpoint(args.checkpoint)
    paths = images(tempfile.mkdtemp(prefix="jpeg-on-device-"))
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "torchvision": torchvision.__version__, "transformers": transformers.__version__,
              "model": "random weights, real MiniCPM-V 4.6 shape", "runs": args.runs, "new_tokens": args.new_tokens}
    report["pixels"] = pixel_check(model, paths, args.runs)
    print(json.dumps(report["pixels"], indent=2), flush=True)
    for on_device in settings:
        report[f"jpeg_on_device_{on_device}"] = lone_requests(model, on_device, paths, args.runs, args.new_tokens)
        print(json.dumps({f"jpeg_on_device_{on_device}": report[f"jpeg_on_device_{on_device}"]}, indent=2), flush=True)
    for name in ("photo_jpeg", "noise_png"):
        medians = [f"{report[f'jpeg_on_device_{flag}'][name]['ttft_ms_median']} ms with MINICPMV_JPEG_ON_DEVICE={flag}"
                   for flag in settings]
        print(f"{name}: first token {', '.join(medians)} (medians of {args.runs})", flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
