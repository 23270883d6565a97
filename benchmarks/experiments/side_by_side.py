"""A wave's vision tower and the running replies' decode steps on the GPU at once, against taking turns,
by how many SMs the tower's matrix products leave free (tuning.VISION_SM_CARVEOUT).

At 200 users the scheduler encodes a wave's media on a stream of its own while the running replies keep
decoding (BatchRunner.encode_media_ahead). The tower's matrix products fill every SM, so the decode
steps mostly wait for them. This runs one wave of --wave images beside decode steps of --batch replies,
as the scheduler does (a step, then its tokens read back), and reports for each carve-out: the wave's
time, the steps done meanwhile, and the gain over taking turns: (the wave alone + that many steps
alone) / the time both took. Also how long the host waits, while a wave runs, to launch it and to copy
a request's pixels (from pageable and from pinned memory) and a step's tokens to the GPU; and how long
requests take to be prepared on other threads (as the callers do: in the preparing workers, then their
pixels staged on the GPU) while nothing runs, beside decode steps alone, and beside both, with each
step's tokens read back as the scheduler does (through pinned memory) or with .tolist() (pageable).
Random weights at the real 4.6 shape; run on a GPU machine:

    python benchmarks/experiments/side_by_side.py --carveouts 0,8,16,32 --json side.json
"""

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from app import tuning
from app.config import AppConfig  # noqa: E402
from app.engine.core import ModelManager  # noqa: E402
from app.model.transfers import TokensOnTheirWay  # noqa: E402
from app.engine.settings import GenerationSettings  # noqa: E402
from benchmarks.real_shape import DEFAULT_FOLDER, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wave", type=int, default=16, help="images encoded together")
    parser.add_argument("--batch", type=int, default=128, help="replies decoding meanwhile")
    parser.add_argument("--carveouts", default="0,8,16,32", help="SMs the tower's products leave free")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--preparing", type=int, default=4, help="threads preparing requests meanwhile")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    manager = ModelManager(AppConfig(model=ensure_real_shape_checkpoint(DEFAULT_FOLDER)))
    manager.load()
    runner = manager.runner
    _, messages = benchmark_request()
    settings = GenerationSettings(max_new_tokens=128, do_sample=False)
    prepared = manager.prepare(messages, settings)
    wave = [(prepared.tensors, settings.downsample_mode)] * args.wave
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "wave": args.wave,
               "batch": args.batch, "sms": torch.cuda.get_device_properties(0).multi_processor_count, "runs": []}

    with runner.serving():
        room = tuning.RESERVED_COLUMNS  # as served: the steps below stay within it (lengths are reset)
        runner.store.reserve(args.batch, room)
        runner.prefill([(prepared.tensors["input_ids"], runner.encode_media(wave[:1])[0], prepared.canvas)], 0, room)
        runner.store.move([0] * (args.batch - 1), list(range(1, args.batch)))
        start_lengths = runner.store.lengths.clone()
        tokens = torch.randint(1000, 100000, (args.batch,))

        readback = {"mode": "pinned"}

        def step():  # the scheduler reads each step's tokens back: as it does (pinned), or with .tolist()
            chosen = runner.decode(tokens).argmax(-1)
            if readback["mode"] == "pinned":
                TokensOnTheirWay(chosen).tolist()
            else:
                chosen.tolist()

        def median(values):
            return sorted(values)[len(values) // 2]

        def steps_alone_ms(count=30):
            step()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(count):
                step()
            runner.store.lengths.copy_(start_lengths)
            return (time.perf_counter() - started) / count * 1000

        def wave_alone_ms(carved: bool):
            encoding = runner.encode_media_ahead(wave, decoding=carved)
            encoding.ready(wait=True)
            return encoding.seconds * 1000

        # What the host waits for while a wave runs: launching the wave itself, then (each in a wave of its
        # own) copying a request's pixels to the GPU as stage_media does (pageable memory), the same from
        # pinned memory, and a decode step's tokens as the captured step takes them.
        staged = prepared.tensors["pixel_values"]
        pageable = (staged.on_device() if hasattr(staged, "on_device") else staged).cpu()
        pinned = pageable.pin_memory()
        copy_stream = torch.cuda.Stream()
        token_buffer = torch.zeros(args.batch, dtype=torch.long, device="cuda")

        def pixels_copy(source):
            with torch.cuda.stream(copy_stream):
                source.to("cuda", non_blocking=True)

        def tokens_copy():
            token_buffer[:] = tokens

        def preparing_beside(work) -> dict:
            """Median ms to prepare a request, and to copy its pixels alone as stage_media does (a copy and
            its event) and as a bare copy, on --preparing threads while `work` runs on this one."""
            prepares, stagings, pageable_copies, done = [], [], [], threading.Event()

            def prepare_again_and_again():
                while not done.is_set():
                    started = time.perf_counter()
                    manager.prepare(messages, settings)
                    staged = time.perf_counter()
                    runner.stage_media({"pixel_values": pageable})
                    copied = time.perf_counter()
                    pixels_copy(pageable)
                    prepares.append((staged - started) * 1000)
                    stagings.append((copied - staged) * 1000)
                    pageable_copies.append((time.perf_counter() - copied) * 1000)

            threads = [threading.Thread(target=prepare_again_and_again) for _ in range(args.preparing)]
            for thread in threads:
                thread.start()
            work()
            done.set()
            for thread in threads:
                thread.join()
            return {"prepare_ms_beside": round(median(prepares), 1), "stage_ms_beside": round(median(stagings), 2),
                    "pageable_copy_ms_beside": round(median(pageable_copies), 2), "prepared_beside": len(prepares)}

        def host_waits_ms() -> dict:
            waits = {}
            for name, action in (("pageable_pixels", lambda: pixels_copy(pageable)),
                                 ("pinned_pixels", lambda: pixels_copy(pinned)), ("step_tokens", tokens_copy)):
                launches, times = [], []
                for _ in range(args.runs):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    encoding = runner.encode_media_ahead(wave, decoding=True)
                    launched = time.perf_counter()
                    action()
                    times.append((time.perf_counter() - launched) * 1000)
                    launches.append((launched - started) * 1000)
                    encoding.ready(wait=True)
                waits[f"host_ms_{name}"] = round(median(times), 2)
            waits["host_ms_launching_the_wave"] = round(median(launches), 2)
            return waits

        decode_ms = steps_alone_ms()
        wave_alone_ms(False)
        turns_wave_ms = median([wave_alone_ms(False) for _ in range(args.runs)])  # every SM: as when taking turns
        print(json.dumps({"decode_ms_alone": round(decode_ms, 3), "wave_alone_ms": round(turns_wave_ms, 1)}), flush=True)
        for condition, work in (("idle", lambda: time.sleep(2)), ("decode_steps", lambda: [steps_alone_ms() for _ in range(10)])):
            results[f"preparing_while_{condition}"] = preparing_beside(work)
            print(json.dumps({f"preparing_while_{condition}": results[f"preparing_while_{condition}"]}), flush=True)
        for carveout, mode in [(int(c), mode) for c in args.carveouts.split(",") for mode in ("tolist", "pinned")]:
            tuning.VISION_SM_CARVEOUT, readback["mode"] = carveout, mode
            alone = median([wave_alone_ms(True) for _ in range(args.runs)])
            trials = []

            def waves_beside_steps():
                for _ in range(args.runs):
                    trials.append(wave_beside_steps())

            def wave_beside_steps():
                torch.cuda.synchronize()
                started = time.perf_counter()
                encoding = runner.encode_media_ahead(wave, decoding=True)
                steps = 0
                while not encoding.ready(wait=False):
                    step()
                    steps += 1
                encoding.ready(wait=True)
                both_ms = (time.perf_counter() - started) * 1000
                runner.store.lengths.copy_(start_lengths)
                return both_ms, steps, encoding.seconds * 1000

            waves_beside_steps()
            both_ms, steps, wave_ms = median(trials)
            trials.clear()
            preparing = preparing_beside(waves_beside_steps)
            run = {"carveout": carveout, "readback": readback["mode"], "wave_alone_ms": round(alone, 1), "wave_beside_steps_ms": round(wave_ms, 1),
                   "steps_meanwhile": steps, "ms_per_step_meanwhile": round(both_ms / max(steps, 1), 2),
                   "gain_over_turns": round((turns_wave_ms + steps * decode_ms) / both_ms, 3), **host_waits_ms(),
                   **preparing, "waves_ms_while_preparing": round(median(trials)[0], 1)}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    results.update(decode_ms_alone=round(decode_ms, 3), wave_alone_ms=round(turns_wave_ms, 1))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
