"""Screenshots of every tab in each state, for review and for the README.

Starts `python app.py --model tiny-random` on a free port, then in headless Chromium, for each tab (Chat,
Multi-image, Video), each width and each theme, goes through the states a user meets and saves one PNG each:

    empty      the tab as it opens
    attached   media attached, what the model will see shown, a question typed
    streaming  the reply coming in (Stop in place of Send)
    finished   the reply done, with its stats line
    stopped    a second reply stopped half-way, marked stopped
    error      a broken file sent: the turn, its reason as the reply, the question back in its box

    python scripts/screenshots.py                                   # test-artifacts/screenshots/
    python scripts/screenshots.py --tabs chat --widths 390 --themes dark

Files are named TAB-STATE-WIDTH-THEME.png. Needs Playwright and Chromium (bash scripts/test.sh installs both).
The tiny model has random weights, so the replies are noise, as the page itself says; the pictures are of the UI.
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.screenshot import CHROMIUM, ROOT, free_port, shrink, start_app, stop  # noqa: E402

EXAMPLES = os.path.join(ROOT, "assets", "examples")
DEFAULT_OUT = os.path.join(ROOT, "test-artifacts", "screenshots")
TABS = ("chat", "multi", "video")
STATES = ("empty", "attached", "streaming", "finished", "stopped", "error")
MAX_BYTES = 400 * 1024


def broken_files(folder: str) -> dict:
    """A PNG cut short (its header whole, so that it fails in the engine) and a file that is no video."""
    from PIL import Image

    whole = os.path.join(folder, "whole.png")
    Image.new("RGB", (800, 600), (200, 40, 40)).save(whole)
    cut = os.path.join(folder, "scan.png")
    with open(whole, "rb") as source, open(cut, "wb") as target:
        data = source.read()
        target.write(data[: len(data) // 3])
    video = os.path.join(folder, "clip.mp4")
    with open(video, "wb") as target:
        target.write(b"not a video at all" * 100)
    return {"image": cut, "video": video}


class Tab:
    """One tab's controls, as a user reaches them."""

    def __init__(self, page, name: str):
        self.page, self.name = page, name
        self.box = page.locator(f"#{name}-input textarea")
        self.send = page.locator(f"#{name}-input .submit-button")
        self.stop = page.locator(f"#{name}-input .stop-button")
        self.chat = page.locator({"chat": "#chat", "multi": "#multi-chat", "video": "#video-chat"}[name])

    def open(self) -> None:
        if self.name != "chat":
            self.page.get_by_role("tab", name={"multi": "Multi-image", "video": "Video"}[self.name]).click()
        self.box.wait_for(timeout=30_000)

    def attach(self, files: list[str]) -> None:
        target = {"chat": "#chat-input", "multi": "#multi-gallery", "video": "#video-player"}[self.name]
        self.page.locator(f"{target} input[type=file]").first.set_input_files(files if self.name != "video" else files[0])
        seen = {"chat": "#chat-previews", "multi": "#multi-previews", "video": "#video-frames"}[self.name]
        self.page.locator(seen).wait_for(state="visible", timeout=60_000)
        self.page.wait_for_timeout(800)  # the previews' pictures loaded

    def ask(self, question: str) -> None:
        """Send `question`; back once its reply streams."""
        self.box.fill(question)
        self.box.press("Enter")
        self.stop.wait_for(timeout=60_000)

    def wait_until_done(self, timeout_s: float = 180) -> None:
        self.send.wait_for(timeout=timeout_s * 1000)
        self.page.wait_for_timeout(800)  # the last update rendered


def shots_of_a_tab(browser, url: str, tab_name: str, width: int, theme: str, out: str, broken: dict) -> list[str]:
    height = 900 if width > 600 else 844
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(url + ("?__theme=dark" if theme == "dark" else "?__theme=light"))
    tab = Tab(page, tab_name)
    saved = []

    def shot(state: str) -> None:
        path = os.path.join(out, f"{tab_name}-{state}-{width}-{theme}.png")
        page.screenshot(path=path)
        shrink(path, MAX_BYTES)
        saved.append(path)

    try:
        tab.open()
        shot("empty")
        media = {"chat": [os.path.join(EXAMPLES, "shapes.jpg")],
                 "multi": [os.path.join(EXAMPLES, "shapes.jpg"), os.path.join(EXAMPLES, "shapes-moved.jpg")],
                 "video": [os.path.join(EXAMPLES, "ball.webm")]}[tab_name]
        tab.attach(media)
        question = {"chat": "What is in this picture?", "multi": "What changed between the two images?",
                    "video": "Describe what happens in this video."}[tab_name]
        tab.box.fill(question)
        shot("attached")
        tab.ask(question)
        page.wait_for_timeout(700)
        shot("streaming")
        tab.wait_until_done()
        shot("finished")
        for _ in range(3):  # a random model's reply may end on its own before Stop
            tab.ask("Tell me much more, at length.")
            page.wait_for_timeout(700)
            # A click from the page itself: Playwright's waits for the busy page to settle outlast the reply.
            if page.evaluate(f"() => document.querySelector('#{tab_name}-input .stop-button')?.click() !== undefined"):
                break
            tab.wait_until_done()
        page.get_by_text("■ Stopped").first.wait_for(timeout=30_000)
        page.wait_for_timeout(800)
        shot("stopped")
        page.goto(page.url)  # a fresh conversation for the broken file
        tab.open()
        broken_media = {"chat": broken["image"], "multi": broken["image"], "video": broken["video"]}[tab_name]
        target = {"chat": "#chat-input", "multi": "#multi-gallery", "video": "#video-player"}[tab_name]
        page.locator(f"{target} input[type=file]").first.set_input_files(broken_media)
        page.wait_for_timeout(1500)  # the upload done
        tab.box.fill("What does this say?")
        tab.box.press("Enter")
        tab.chat.get_by_text("could not be").first.wait_for(timeout=60_000)
        page.wait_for_timeout(800)
        shot("error")
    finally:
        page.close()
    return saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=DEFAULT_OUT)
    parser.add_argument("--tabs", nargs="+", choices=TABS, default=list(TABS))
    parser.add_argument("--widths", nargs="+", type=int, default=[1366, 390])
    parser.add_argument("--themes", nargs="+", choices=("light", "dark"), default=["light", "dark"])
    parser.add_argument("--max-new-tokens", type=int, default=1200,
                        help="the replies' length: long enough to be caught streaming and stopped")
    parser.add_argument("--start-timeout", type=float, default=600)
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)
    url, process, log_file = start_app(free_port(), args.max_new_tokens, args.start_timeout)
    try:
        with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
            broken = broken_files(folder)
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            for tab in args.tabs:
                for width in args.widths:
                    for theme in args.themes:
                        for path in shots_of_a_tab(browser, url, tab, width, theme, out, broken):
                            print(f"saved {os.path.relpath(path, ROOT)}", flush=True)
            browser.close()
    finally:
        stop(process)
        log_file.close()


if __name__ == "__main__":
    main()
