"""One user through the web app: when does each streamed update of a reply reach the client?

Starts `python app.py` with the real-shape random checkpoint (or --model), sends --requests requests one
after another through gradio_client (the 1344x1344 image, 128 new tokens, greedy) and prints, per request,
when the client saw its updates and what the server's own stats say, so that time spent in the engine can
be told from time spent between the web server and the client. Last, the CPU time of app.py's own
process per request after the first (the web server; with --web-processes, the proxy in front of them).
Extra arguments go to app.py:

    python benchmarks/experiments/lone_user.py
    python benchmarks/experiments/lone_user.py --in-process-engine
    python benchmarks/experiments/lone_user.py --model tiny-random --requests 21 --new-tokens 8   # the web path's CPU, on a CPU
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.cpu_use import process_cpu_seconds  # noqa: E402
from benchmarks.real_shape import DEFAULT_FOLDER, QUESTION, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.streaming_client import streamed_outputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint instead of the real-shape random one")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=7870)
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "lone-user-server.log"))
    args, app_args = parser.parse_known_args()

    model = args.model or ensure_real_shape_checkpoint(DEFAULT_FOLDER)
    image, _ = benchmark_request()
    with open(args.log, "w") as log:
        server = subprocess.Popen([sys.executable, "app.py", "--model", model, "--port", str(args.port), *app_args],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    started = time.time()
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/metrics", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit(f"the app stopped; see {args.log}")
                time.sleep(1)
        print(f"app up after {time.time() - started:.1f} s {app_args}", flush=True)
        from gradio_client import Client, handle_file

        client = Client(url, verbose=False)
        settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
        for index in range(args.requests):
            if index == 1:
                cpu_seconds, wall = process_cpu_seconds(server.pid), time.perf_counter()
            sent = time.perf_counter()
            job = client.submit(QUESTION, [handle_file(image)], settings, api_name="/ask")
            arrivals = [(round((time.perf_counter() - sent) * 1000), len(reply)) for reply, _ in streamed_outputs(job)]
            stats = job.result()[1]
            print(json.dumps({
                "request": index, "client_total_ms": round((time.perf_counter() - sent) * 1000),
                "updates": len(arrivals), "first_updates_ms_chars": arrivals[:3], "last_updates_ms_chars": arrivals[-3:],
                "server": {key: stats.get(key) for key in ("ttft_ms", "total_ms", "preprocess_ms", "tokens_per_s")},
            }), flush=True)
        if args.requests > 1:
            measured = args.requests - 1
            print(json.dumps({"app_process_cpu_ms_per_request": round((process_cpu_seconds(server.pid) - cpu_seconds) / measured * 1000, 1),
                              "wall_ms_per_request": round((time.perf_counter() - wall) / measured * 1000)}), flush=True)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
