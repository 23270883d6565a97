"""What the Server load panel costs a web process: its CPU seconds a minute with N browsers keeping the
panel open, against the same minute with none.

A server of the app (tiny-random) runs in a process of its own, with the engine in that process so that
its load history can be filled to its 120 samples at once; so the history reaches the handler by a call,
not over the engine process's pipe (8 KB pickled, 0.06 ms to unpickle). Each client here does what the
page does while the panel is open: one call of the panel's expand event, then its timer's event every
LOAD_SAMPLE_S (POST /gradio_api/run/predict, as Chromium sends it), the clients' calls spread over the
interval. The server's CPU is read from /proc. Runs anywhere:

    python benchmarks/experiments/load_panel.py --clients 1,10,50 --seconds 60
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.cpu_use import process_cpu_seconds  # noqa: E402
from benchmarks.report import write_json  # noqa: E402


def serve(port: int) -> None:
    """The server's process: the app with its history full."""
    from app import tuning
    from app.config import AppConfig, apply_environment
    from app.engine.backends import load_manager
    from app.web.server import launch

    apply_environment()
    manager = load_manager(AppConfig(model="tiny-random", port=port, engine_process=False))
    for _ in range(round(tuning.LOAD_HISTORY_S / tuning.LOAD_SAMPLE_S)):
        manager.metrics.sample()
    launch(manager.config, manager)


def post(url: str, body: dict) -> tuple[int, int]:
    """The status and the length of the answer."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, len(response.read())


def panel_events(base: str) -> tuple[dict, dict]:
    """The expand event's and the timer's (fn_index and trigger_id), as the page finds them in /config,
    once the server answers."""
    deadline = time.monotonic() + 600
    while True:
        try:
            config = json.loads(urllib.request.urlopen(base + "/config", timeout=30).read())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    labels = {component["id"]: component.get("props", {}).get("label") for component in config["components"]}
    found = {}
    for dependency in config["dependencies"]:
        for target, event in dependency["targets"]:
            if event == "tick" or (event == "expand" and labels.get(target) == "Server load"):
                found[event] = {"fn_index": dependency["id"], "trigger_id": target}
    return found["expand"], found["tick"]


def keep_panel_open(base: str, events: tuple[dict, dict], client: int, clients: int, interval: float, until: float,
                    served: list) -> None:
    """One browser with the panel open until `until`: (time, status, bytes) of each refresh into `served`."""
    expand, tick = events
    session = {"data": [], "session_hash": f"load-panel-{client}"}
    url = base + "/gradio_api/run/predict"
    post(url, {**session, **expand})
    time.sleep(interval * client / clients)  # spread over the interval, as browsers opened at random times are
    while time.monotonic() < until:
        started = time.monotonic()
        served.append((started, *post(url, {**session, **tick})))
        time.sleep(max(0.0, interval - (time.monotonic() - started)))


def measure(base: str, events: tuple, pid: int, clients: int, seconds: float, interval: float) -> dict:
    """The server's CPU seconds a minute over `seconds` with `clients` keeping the panel open (after one
    interval, in which they open it)."""
    served: list[tuple[float, int, int]] = []
    until = time.monotonic() + interval + seconds
    threads = [threading.Thread(target=keep_panel_open, args=(base, events, n, clients, interval, until, served))
               for n in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(interval)
    before, started = process_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    used, ended = process_cpu_seconds(pid) - before, time.monotonic()
    for thread in threads:
        thread.join()
    assert all(status == 200 for _, status, _ in served), served
    refreshes = sum(started <= at < ended for at, _, _ in served)
    return {"clients": clients, "cpu_s_per_minute": round(used * 60 / (ended - started), 2), "refreshes": refreshes,
            "kb_per_refresh": round(max((size for _, _, size in served), default=0) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,10,50")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    from app import tuning
    from app.config import apply_environment

    apply_environment()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        events = panel_events(base)
        interval = tuning.LOAD_SAMPLE_S
        idle = measure(base, events, server.pid, 0, args.seconds, interval)["cpu_s_per_minute"]
        results = {"load_sample_s": interval, "idle_cpu_s_per_minute": idle, "levels": []}
        for clients in map(int, args.clients.split(",")):
            level = measure(base, events, server.pid, clients, args.seconds, interval)
            level["panel_cpu_s_per_minute"] = round(level["cpu_s_per_minute"] - idle, 2)
            level["ms_per_refresh"] = round(level["panel_cpu_s_per_minute"] * args.seconds / 60 * 1000
                                            / max(level["refreshes"], 1), 2)
            results["levels"].append(level)
            print(json.dumps(level), flush=True)
    finally:
        server.kill()
    print(json.dumps(results))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
