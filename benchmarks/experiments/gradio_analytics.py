"""What Gradio's queue spends, each time an event ends, on the summary behind its /monitoring page.

A Gradio server keeps its last GRADIO_ANALYTICS_MAX_EVENTS events (10,000) and, by default, summarizes
all of them with pandas when any event ends (GRADIO_ANALYTICS_CACHE_FREQUENCY=1), in the web process.
This times that summary on a queue as `demo.queue()` makes it, for a server that has seen 100, 1,000
and 10,000 events. The app turns it off (app.web.server.launch); --as-the-app times it with the app's setting.
Runs anywhere:

    python benchmarks/experiments/gradio_analytics.py
    python benchmarks/experiments/gradio_analytics.py --as-the-app
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.report import write_json  # noqa: E402


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--as-the-app", action="store_true", help="with the setting app.web.server.launch makes")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.as_the_app:
        from app.web.server import GRADIO_SETTINGS

        os.environ.update(GRADIO_SETTINGS)
    import gradio as gr

    with gr.Blocks() as demo:
        gr.Markdown("queue only")
    queue = demo.queue()._queue
    results = {"gradio": gr.__version__, "as_the_app": args.as_the_app, "ms_per_ended_event": {}}
    for seen in (100, 1_000, 10_000):
        records = [{"time": time.time(), "status": ("success", "failed")[i % 17 == 0], "process_time": 0.5 + i % 7,
                    "function": ("ask", "added_then_answered", "respond")[i % 3], "session_hash": f"s{i % 500}"}
                   for i in range(seen)]
        times = []
        for _ in range(args.runs):
            queue.events_recorded += 1  # an event ended: as the queue counts them
            started = time.perf_counter()
            queue.compute_analytics_summary(records)
            times.append((time.perf_counter() - started) * 1000)
        results["ms_per_ended_event"][seen] = round(sorted(times)[len(times) // 2], 3)
    print(json.dumps(results))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
