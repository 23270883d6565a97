"""What a long streamed reply costs the browser: the page's main thread while one reply streams.

Starts `python app.py --model tiny-random` on a free port, opens the Chat tab in headless Chromium,
asks for a reply of exactly --tokens tokens, and while it streams asks the page a trivial question
every 100 ms (how long `page.evaluate` takes to come back: what a click or a keystroke waits for). It
also counts the chat's updates (DOM mutations of the reply) and the main thread's long tasks (over
50 ms, PerformanceObserver). Runs on any machine with Chromium:

    python benchmarks/browser_stream.py --tokens 1500 --json browser.json

The random model's replies are plain words. With --markdown the reply is what a real model writes at
length (headings, lists, code blocks, tables), --tokens of about 4 characters streamed at --rate tokens a
second by a stand-in OpenAI-compatible server that this script runs, which the app reaches through
`--backend openai`, its real path to an external engine:

    python benchmarks/browser_stream.py --markdown --tokens 3000 --rate 800
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import write_json  # noqa: E402
from scripts.screenshot import CHROMIUM, free_port, stop, wait_until_answering  # noqa: E402

WATCH = """() => {
    window.__longTasks = [];
    new PerformanceObserver(list => window.__longTasks.push(...list.getEntries().map(e => e.duration)))
        .observe({entryTypes: ["longtask"]});
    window.__updates = 0;
    new MutationObserver(() => window.__updates++).observe(document.querySelector("#chat"),
        {childList: true, subtree: true, characterData: true});
}"""


def markdown_reply(tokens: int) -> list[str]:
    """A long reply as a real model writes one, in pieces of about 4 characters (a token each)."""
    blocks, index = [], 0
    while sum(map(len, blocks)) < 4 * tokens:
        kind, index = index % 5, index + 1
        if kind == 0:
            blocks.append(f"## Part {index}\n\nWhat **this part** covers, with `inline code`, *emphasis* and a [link](#part).")
        elif kind == 1:
            blocks.append("\n".join(f"{n}. Point {n}, with `code` and **bold** words" for n in range(1, 7)))
        elif kind == 2:
            blocks.append("```python\n" + "\n".join(f"def step_{n}(x):\n    return x * {n}  # scaled" for n in range(6)) + "\n```")
        elif kind == 3:
            blocks.append("| name | value | note |\n|---|---|---|\n" + "\n".join(f"| row {n} | {n * index} | `n{n}` |" for n in range(6)))
        else:
            blocks.append("A plain sentence that goes on for a while. " * 8)
    text = "\n\n".join(blocks)[: 4 * tokens]
    return [text[start:start + 4] for start in range(0, len(text), 4)]


def markdown_server(tokens: int, rate: float, per_event: int) -> ThreadingHTTPServer:
    """A stand-in OpenAI-compatible server that streams markdown_reply(tokens) at `rate` pieces a second,
    `per_event` pieces to an event (vLLM sends one; this app's engine, at 800 tokens/s, about 40)."""
    pieces = markdown_reply(tokens)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self._send(json.dumps({"object": "list", "data": [{"id": "markdown", "object": "model"}]}).encode(), "application/json")

        def do_POST(self):
            asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            started = time.perf_counter()
            sent = pieces[: asked.get("max_tokens", len(pieces))]
            for n in range(0, len(sent), per_event):
                time.sleep(max(0.0, started + n / rate - time.perf_counter()))
                self._event({"choices": [{"index": 0, "delta": {"content": "".join(sent[n:n + per_event])}}]})
            self._event({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": len(pieces)}})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, data: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            self.wfile.flush()

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


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
        send = page.locator("#chat-input .submit-button")
        page.evaluate(WATCH)
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        before = main_thread_seconds(cdp)
        page.locator("#chat-input textarea").fill("Tell me a long story.")
        started = time.perf_counter()
        page.locator("#chat-input textarea").press("Enter")
        page.locator("#chat-input .stop-button").wait_for(timeout=60_000)
        replies = []
        while not send.count():  # Send comes back when the reply has ended
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
    parser.add_argument("--markdown", action="store_true", help="a markdown reply from a stand-in OpenAI-compatible server")
    parser.add_argument("--rate", type=float, default=800.0, help="--markdown: its tokens a second")
    parser.add_argument("--per-event", type=int, default=1, help="--markdown: tokens in each of its events")
    parser.add_argument("--json")
    args = parser.parse_args()
    port = free_port()
    log_path = os.path.join("/tmp", f"browser-stream-{port}.log")
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port)}
    model = ["--model", "tiny-random"]
    if args.markdown:
        server = markdown_server(args.tokens, args.rate, args.per_event)
        model = ["--backend", "openai", "--openai-model", "markdown",
                 "--openai-base-url", f"http://127.0.0.1:{server.server_port}/v1"]

    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", *model], cwd=os.path.dirname(
            os.path.dirname(os.path.abspath(__file__))), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until_answering(url, process, log_path, 600)
        result = measure(url, args.tokens, args.width)
    finally:
        stop(process)
    result.update(markdown=args.markdown, per_event=args.per_event, chat_update_chars_per_s=os.environ.get("MINICPMV_CHAT_UPDATE_CHARS_PER_S", "default"))
    print(json.dumps(result))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
