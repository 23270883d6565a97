"""Sampling the video-16 workload's video (16 frames of a 16 s 640x360 mp4v clip, read by seeking, as
app.media.video.sample_video reads it) in several processes at once, as preparing workers do, with FFmpeg decoding
on one thread or more (tuning.VIDEO_DECODE_THREADS; OpenCV's default is one a core). For each, the median ms a
video in each process and the videos a second all together. Every seek drains and refills a frame-threaded
decoder, so threads cost more the busier the cores are (docs/DECISIONS.md D69). CPU only:

    python benchmarks/experiments/video_decode_threads.py --processes 2,4 --threads 1,2,16
"""

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.report import write_json  # noqa: E402


def sample_many(path: str, threads: int, runs: int) -> float:
    """Median ms to sample the video at `path`, `runs` times in this process."""
    import cv2

    from app.media.video import sampled_frame_indices

    probe = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    wanted = sampled_frame_indices(int(probe.get(cv2.CAP_PROP_FRAME_COUNT)), probe.get(cv2.CAP_PROP_FPS), 1.0, 16)
    probe.release()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, threads])
        for index in wanted:
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
            capture.read()
        capture.release()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _sample_many(arguments: tuple[str, int, int]) -> float:
    return sample_many(*arguments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="2,4")
    parser.add_argument("--threads", default="1,2,16")
    parser.add_argument("--runs", type=int, default=12, help="videos each process samples")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    from benchmarks.workloads import make_video

    path = make_video()
    rows = []
    for processes in (int(n) for n in args.processes.split(",")):
        for threads in (int(n) for n in args.threads.split(",")):
            with multiprocessing.get_context("spawn").Pool(processes) as pool:
                pool.map(_sample_many, [(path, threads, 1)] * processes)  # imports and a first decode, untimed
                started = time.perf_counter()
                medians = pool.map(_sample_many, [(path, threads, args.runs)] * processes)
                seconds = time.perf_counter() - started
            row = {"processes": processes, "threads": threads, "ms_a_video": [round(m, 1) for m in medians],
                   "videos_per_s": round(processes * args.runs / seconds, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
