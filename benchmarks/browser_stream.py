"""What a long streamed reply costs the browser: the page's main thread while one reply streams.

Starts `python app.py --model tiny-random` on a free port, opens the Chat tab in headless Chromium,
asks for a reply of exactly --tokens tokens, and while it streams asks the page a trivial question
every 100 ms (how long `page.evaluate` takes to come back: what a click or a keystroke waits for). It
also counts the chat's updates (DOM mutations of the reply) and the main thread's long tasks (over
50 ms, PerformanceObserver). Runs on any machine with Chromium:

    python benchmarks/browser_stream.py --tokens 1500 --json browser.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import write_json  # noqa: E402
from scripts.screenshot import CHROMIUM, STATS_LINE, free_port, stop, wait_until_answering  # noqa: E402

WATCH = """() => {
    window.__longTasks = [];
    new PerformanceObserver(list => window.__longTasks.push(...list.getEntries().map(e => e.duration)))
        .observe({entryTypes: ["longtask"]});
    window.__updates = 0;
    new MutationObserver(() => window.__updates++).observe(document.querySelector("#chat"),
        {childList: true, subtree: true, characterData: true});
}"""


def measure(url: str, tokens: int, width: int) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.goto(url)
        page.wait_for_selector("#chat-input textarea", timeout=60_000)
        page.locator(".sidebar .toggle-button").first.click()
        box = page.get_by_label("number input for Max new tokens")
        box.fill(str(tokens))
        box.press("Enter")
        page.get_by_label("Sample (off: greedy)").uncheck()
        page.evaluate(WATCH)
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        before = main_thread_seconds(cdp)
        page.locator("#chat-input textarea").fill("Tell me a long story.")
        started = time.perf_counter()
        page.locator("#chat-input textarea").press("Enter")
        replies = []
        while not page.get_by_text(STATS_LINE).count():
            asked = time.perf_counter()
            page.evaluate("1")
            replies.append((time.perf_counter() - asked) * 1000)
            time.sleep(0.1)
            if time.perf_counter() - started > 300:
                raise TimeoutError("the reply did not finish in 300 s")
        elapsed = time.perf_counter() - started
        work = {name: round(seconds - before[name], 3) for name, seconds in main_thread_seconds(cdp).items()}
        long_tasks = page.evaluate("window.__longTasks")
        updates = page.evaluate("window.__updates")
        characters = len(page.locator("#chat").inner_text())
        browser.close()
    return {"tokens": tokens, "width": width, "reply_s": round(elapsed, 2), "characters": characters,
            "chat_mutations": updates, "page_query_ms_p50": round(statistics.median(replies), 1),
            "page_query_ms_max": round(max(replies), 1), "long_tasks": len(long_tasks),
            "long_task_ms_total": round(sum(long_tasks), 1), "main_thread_s": work,
            "main_thread_ms_per_update": round(1000 * work["TaskDuration"] / max(updates, 1), 2)}


def main_thread_seconds(cdp) -> dict:
    """Chromium's own count of the page's main-thread work so far (CDP Performance.getMetrics): all tasks,
    scripts, layout and style, in seconds."""
    metrics = {metric["name"]: metric["value"] for metric in cdp.send("Performance.getMetrics")["metrics"]}
    return {name: metrics[name] for name in ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--width", type=int, default=1366)
    parser.add_argument("--json")
    args = parser.parse_args()
    port = free_port()
    log_path = os.path.join("/tmp", f"browser-stream-{port}.log")
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port)}

    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--model", "tiny-random"], cwd=os.path.dirname(
            os.path.dirname(os.path.abspath(__file__))), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until_answering(url, process, log_path, 600)
        result = measure(url, args.tokens, args.width)
    finally:
        stop(process)
    print(json.dumps(result))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
