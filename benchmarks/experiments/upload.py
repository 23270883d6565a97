"""How long an image's upload to a Gradio server takes beside threads that want the server's GIL.

Gradio writes an upload to disk chunk by chunk as the request's body arrives, each chunk through a
thread of its pool (Starlette's `UploadFile.write` for a file on disk), so one upload of the benchmark's
5.4 MB PNG is many round trips between the event loop and a thread. In a web process of the app those
threads share the GIL with the replies' streaming threads. Each round trip may then wait for Python's
switch interval (5 ms by default) once or more. This serves a bare Gradio app in this process, with
`--busy-threads` threads running pure Python beside it, and times uploads of the benchmark's PNG from
another process, at each switch interval asked for, `--at-once` of them at the same time (as a web
process's users send theirs when their replies end together). Without busy threads it also reports the
server's CPU per upload. With --fronts N the uploads go through N processes of the app's proxy
(app.web.proxy, as `python app.py --web-processes` serves them), and their CPU per upload is reported too.
Medians; runs anywhere:

    python benchmarks/experiments/upload.py --busy-threads 0,1,4 --switch-intervals 0.005,0.0005 --json upload.json
    python benchmarks/experiments/upload.py --runs 50 --busy-threads 0 --switch-intervals 0.0005 --at-once 1,8,25
    python benchmarks/experiments/upload.py --runs 100 --busy-threads 0 --switch-intervals 0.0005 --fronts 1
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
from multiprocessing import get_context

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.real_shape import benchmark_request  # noqa: E402
from benchmarks.cpu_use import process_cpu_seconds  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def _uploads(url: str, path: str, runs: int, at_once: int, out) -> None:
    """In a process of its own: `runs` uploads of `path`, `at_once` at a time, each timed (seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    clients = threading.local()  # one kept-alive connection per uploading thread

    def upload(_) -> float:
        if not hasattr(clients, "client"):
            clients.client = httpx.Client(timeout=120)
        with open(path, "rb") as file:
            started = time.perf_counter()
            clients.client.post(f"{url}/gradio_api/upload", files=[("files", (os.path.basename(path), file))]).raise_for_status()
            return time.perf_counter() - started

    with ThreadPoolExecutor(at_once) as pool:
        out.put(list(pool.map(upload, range(runs))))


def timed_uploads(url: str, path: str, runs: int, at_once: int) -> list[float]:
    context = get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_uploads, args=(url, path, runs, at_once, out))
    process.start()
    times = out.get(timeout=600)
    process.join()
    return times


def busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--busy-threads", default="0,1,4")
    parser.add_argument("--switch-intervals", default="0.005,0.0005")
    parser.add_argument("--image-format", choices=["png", "jpeg"], default="png")
    parser.add_argument("--at-once", default="1", help="uploads sent at the same time, e.g. 1,8,25 (a web process's "
                                                      "users coming back together)")
    parser.add_argument("--fronts", type=int, default=0, help="proxy processes (app.web.proxy) the uploads go through")
    parser.add_argument("--json")
    args = parser.parse_args()

    import gradio as gr
    import starlette.datastructures

    writes = []  # the chunks written through a thread, counted on the way
    write = starlette.datastructures.UploadFile.write

    async def counted_write(self, data: bytes) -> None:
        writes.append(len(data))
        await write(self, data)

    starlette.datastructures.UploadFile.write = counted_write
    with gr.Blocks() as demo:
        gr.File()
    demo.launch(prevent_thread_lock=True, quiet=True, server_port=7898)
    url, fronts = "http://127.0.0.1:7898", None
    if args.fronts:
        from app.web.processes import Fronts

        fronts = Fronts("127.0.0.1", 7897, [url], args.fronts)
        fronts.start()
        url = "http://127.0.0.1:7897"
    path, _ = benchmark_request(args.image_format)
    report = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "image_bytes": os.path.getsize(path),
              "gradio": gr.__version__, "fronts": args.fronts, "rows": []}
    for interval in [float(value) for value in args.switch_intervals.split(",")]:
        sys.setswitchinterval(interval)
        for threads in [int(value) for value in args.busy_threads.split(",")]:
            for at_once in [int(value) for value in args.at_once.split(",")]:
                stop = threading.Event()
                workers = [threading.Thread(target=busy, args=(stop,), daemon=True) for _ in range(threads)]
                for worker in workers:
                    worker.start()
                writes.clear()
                cpu_started = time.process_time()
                fronts_started = sum(map(process_cpu_seconds, fronts.pids)) if fronts else 0.0
                times = timed_uploads(url, path, args.runs, at_once)
                cpu_ms = (time.process_time() - cpu_started) * 1000
                fronts_ms = (sum(map(process_cpu_seconds, fronts.pids)) - fronts_started) * 1000 if fronts else None
                stop.set()
                for worker in workers:
                    worker.join()
                row = {"switch_interval_ms": interval * 1000, "busy_threads": threads, "at_once": at_once,
                       "upload_ms_median": round(1000 * statistics.median(times), 1),
                       "upload_ms_max": round(1000 * max(times), 1),
                       # The server's CPU for one upload (this process's, so only without busy threads).
                       "server_cpu_ms_per_upload": round(cpu_ms / args.runs, 1) if not threads else None,
                       "fronts_cpu_ms_per_upload": round(fronts_ms / args.runs, 1) if fronts else None,
                       "chunk_writes_per_upload": round(len(writes) / args.runs, 1),
                       "chunk_kib_median": round(statistics.median(writes) / 1024, 1) if writes else None}
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
    sys.setswitchinterval(0.005)
    if fronts:
        fronts.close()
    demo.close()
    write_json(args.json, report)


if __name__ == "__main__":
    main()
