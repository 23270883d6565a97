"""One screenshot: the demo's Chat tab with an image, a question and a finished streamed reply (the README's
four, of every tab in each state: scripts/screenshots.py).

Starts `python app.py --model tiny-random` on a free port, waits until it answers, opens it in headless
Chromium (Playwright), attaches the first image found under assets/, asks a question, waits for the
streamed reply to finish (its stats line), saves the page as a PNG, and stops the app.

    python scripts/screenshot.py                                # test-artifacts/screenshot.png, 1366x900
    python scripts/screenshot.py --out /tmp/shot.png --width 1280

Needs Playwright and Chromium (bash scripts/test.sh installs both). The tiny model has random weights, so
the reply is noise, as the page itself says; the picture is of the UI.
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = "/usr/bin/chromium"
DEFAULT_OUT = os.path.join(ROOT, "test-artifacts", "screenshot.png")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
STATS_LINE = re.compile(r"\d[\d,]* visual tokens · first token")  # the line that ends every finished reply
MAX_BYTES = 400 * 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def first_image(out: str) -> str | None:
    """The first image under assets/ (sorted, the screenshot itself left out), or None."""
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "assets")):
        for name in names:
            path = os.path.join(folder, name)
            if name.lower().endswith(IMAGE_SUFFIXES) and os.path.abspath(path) != os.path.abspath(out):
                found.append(path)
    # The examples folder first: they are the demo's own example media.
    found.sort(key=lambda path: (os.sep + "examples" + os.sep not in path, os.path.splitext(path)[0]))
    return found[0] if found else None


def wait_until_answering(url: str, process: subprocess.Popen, log_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the app exited with code {process.returncode} before answering:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the app did not answer at {url} within {timeout_s:.0f} s:\n{tail(log_path)}")


def tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as file:
        return "".join(file.readlines()[-lines:])


def stop(process: subprocess.Popen) -> None:
    """Stop the app and whatever it started (its own process group, made for it)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    try:
        os.killpg(process.pid, signal.SIGTERM)  # its engine process, should one outlive it
    except (ProcessLookupError, PermissionError):
        pass


def shrink(path: str, max_bytes: int) -> int:
    """Re-save the PNG optimized; if it is still over max_bytes, as a 256-colour palette image. Its size."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
    image.save(path, optimize=True)
    if os.path.getsize(path) > max_bytes:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return os.path.getsize(path)


def take(url: str, out: str, width: int, height: int, scale: float, question: str, image: str | None,
         reply_timeout_s: float) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height}, device_scale_factor=scale)
            page.goto(url)
            box = page.locator("#chat-input textarea")
            box.wait_for(timeout=60_000)
            if image:
                page.locator("#chat-input input[type=file]").set_input_files(image)
                page.locator("#chat-input [aria-label='File thumbnail']").first.wait_for(timeout=30_000)
                page.wait_for_timeout(500)  # the upload finishes before sending
            box.fill(question)
            box.press("Enter")
            page.get_by_text(STATS_LINE).first.wait_for(timeout=reply_timeout_s * 1000)
            page.wait_for_timeout(800)  # the last update rendered, the spinner gone
            page.screenshot(path=out)
        finally:
            browser.close()


def start_app(port: int, max_new_tokens: int, timeout_s: float):
    """`python app.py --model tiny-random` on `port`, once it answers: (its URL, its process, its log file)."""
    url = f"http://127.0.0.1:{port}/"
    log_file = tempfile.NamedTemporaryFile("w", prefix="screenshot-app-", suffix=".log", delete=False)
    command = [sys.executable, "app.py", "--model", "tiny-random", "--port", str(port),
               "--max-new-tokens", str(max_new_tokens)]
    print(f"starting: {' '.join(command)} (log: {log_file.name})", flush=True)
    process = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_answering(url, process, log_file.name, timeout_s)
    except BaseException:
        stop(process)
        log_file.close()
        raise
    return url, process, log_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the PNG goes")
    parser.add_argument("--width", type=int, default=1366, help="viewport width in CSS pixels")
    parser.add_argument("--height", type=int, default=900, help="viewport height in CSS pixels")
    parser.add_argument("--scale", type=float, default=1.0, help="device pixels per CSS pixel (below 1: a smaller file)")
    parser.add_argument("--port", type=int, default=0, help="the app's port (0: a free one)")
    parser.add_argument("--image", default=None, help="the image to attach (default: the first under assets/)")
    parser.add_argument("--question", default="What is in this picture?")
    parser.add_argument("--max-new-tokens", type=int, default=96,
                        help="the reply's length (the app's --max-new-tokens), so that the reply fits the page")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for the app to start answering")
    parser.add_argument("--reply-timeout", type=float, default=180, help="seconds for the reply to finish")
    args = parser.parse_args(argv)

    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    image = os.path.abspath(args.image) if args.image else first_image(out)
    url, process, log_file = start_app(args.port or free_port(), args.max_new_tokens, args.start_timeout)
    try:
        print(f"answering at {url}; asking about {os.path.relpath(image, ROOT) if image else 'no image'}", flush=True)
        take(url, out, args.width, args.height, args.scale, args.question, image, args.reply_timeout)
    finally:
        stop(process)
        log_file.close()
    size = shrink(out, MAX_BYTES)
    print(f"saved {out} ({size / 1024:.0f} KB)")
    if size > MAX_BYTES:
        print(f"warning: over {MAX_BYTES // 1024} KB; try --scale 0.8", file=sys.stderr)


if __name__ == "__main__":
    main()
