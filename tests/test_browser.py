"""The page in headless Chromium, as a person uses it: attach an image, send, watch the reply grow."""

import os
import re
import time

import pytest

from app import limits
from tests.conftest import ARTIFACTS, make_image, make_video, truncated_png, wait_for

CHROMIUM = "/usr/bin/chromium"
STATS_LINE = re.compile(r"\d[\d,]* visual tokens · first token")
WIDTHS = (1366, 390)  # a laptop and a phone
# Only local runs may skip; in CI (CI=true) a missing browser must fail the run.
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                                reason="Debian's chromium is not installed (scripts/test.sh installs it)")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield browser
        browser.close()


def open_page(browser, server_url, width: int = 1280):
    page = browser.new_page(viewport={"width": width, "height": 1100})
    page.goto(server_url)
    page.wait_for_selector("#chat-input textarea")
    return page


@pytest.fixture
def page(browser, server_url):
    page = open_page(browser, server_url)
    yield page
    page.close()


def set_max_new_tokens(page, value: int) -> None:
    """As a user does it: beside the input. The settings sidebar is opened too, for the other settings the
    tests after it change."""
    page.locator(".sidebar .toggle-button").first.click()
    box = page.get_by_label("Max new tokens", exact=True)
    box.fill(str(value))
    box.press("Enter")


def chat_text(page) -> str:
    return page.locator("#chat").inner_text()


def reply_after(page, question: str) -> str:
    """The chat's text after `question`; empty until the question is on the page (before it, the chat's
    placeholder would pass for a reply)."""
    text = chat_text(page)
    return text.split(question)[-1] if question in text else ""


def settled_reply_after(page, question: str, quiet_s: float = 1.0, timeout_s: float = 30) -> str | None:
    """reply_after once it has not changed for `quiet_s` (a reply's reasoning block folds when marked done),
    or None if it kept changing for `timeout_s`."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        text = reply_after(page, question)
        if text != last:
            last, since = text, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return text
        time.sleep(0.05)
    return None


def ask_about_an_image(page, image: str) -> list[int]:
    """Attach `image`, ask about it, and follow the reply until its stats line: the chat's lengths seen."""
    page.locator("#chat-input input[type=file]").set_input_files(image)
    page.locator("#chat-input textarea").fill("What is in this picture?")
    page.wait_for_timeout(500)  # the upload finishes before sending
    page.locator("#chat-input textarea").press("Enter")
    lengths = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lengths.append(len(chat_text(page)))
        if page.get_by_text(STATS_LINE).count():
            break
        time.sleep(0.05)
    return lengths


def test_chat_with_an_image_streams_a_reply(page, red_image):
    os.makedirs(ARTIFACTS, exist_ok=True)
    lengths = ask_about_an_image(page, red_image)
    page.screenshot(path=os.path.join(ARTIFACTS, "chat.png"), full_page=True)
    growing = sorted(set(lengths))
    assert len(growing) >= 4, lengths  # the reply was seen at several lengths while it streamed
    assert page.get_by_text(STATS_LINE).inner_text().startswith("640 visual tokens")
    assert page.locator("img[src*='red']").count() >= 1  # the attached image is shown in the chat
    assert page.locator("#chat button[aria-label='Share']").count() == 1  # Gradio's, under the picture
    assert page.locator("button[aria-label='Share']:visible").count() == 0  # off Spaces it can only fail


def test_a_question_whose_image_fails_stays_in_its_box_and_retries(browser, server_url, tmp_path):
    """A PNG cut short passes the attachment check (its header is whole) and fails in the engine: the turn
    stays in the chat with the reason as its reply, and the typed question and its attachment are back in
    the box, ready to fix and send again. Retry sends the turn again (the page once threw "Cannot read
    properties of undefined (reading 'role')" for an error with no question before it)."""
    cut = truncated_png(tmp_path, "cut.png")
    page = open_page(browser, server_url)
    thrown = []
    page.on("pageerror", lambda error: thrown.append(str(error)))
    try:
        page.locator("#chat-input input[type=file]").set_input_files(cut)
        page.locator("#chat-input textarea").fill("What does this page say?")
        page.wait_for_timeout(500)  # the upload finishes before sending
        page.locator("#chat-input textarea").press("Enter")
        failed = page.locator("#chat").get_by_text("could not be read as an image")
        failed.first.wait_for(timeout=30_000)
        assert wait_for(lambda: page.locator("#chat-input textarea").input_value() == "What does this page say?", 10)
        assert page.locator("#chat-input [aria-label='File thumbnail'] img[src$='/cut.png']").count() == 1
        assert "What does this page say?" in chat_text(page)  # the failed turn, above its reason
        assert page.locator("[data-testid=toast-body]").count() == 0  # said once, in the chat
        page.screenshot(path=os.path.join(ARTIFACTS, "failed-question.png"), full_page=True)
        with page.expect_response(lambda response: "/gradio_api/queue/join" in response.url):
            page.locator("#chat button[aria-label='Retry']").click()
        assert wait_for(lambda: page.locator("#chat-input .submit-button").count() == 1, 30)
        page.wait_for_timeout(500)
        assert failed.count() == 1 and chat_text(page).count("What does this page say?") == 1 and not thrown
    finally:
        page.close()


def test_an_empty_message_is_told_in_its_box(browser, server_url):
    page = open_page(browser, server_url)
    try:
        box = page.locator("#chat-input textarea")
        box.fill("   ")  # spaces alone are no question either: emptied, so that the placeholder shows
        box.press("Enter")
        assert wait_for(lambda: box.get_attribute("placeholder") == "⚠️ Type a question or attach an image first.", 10)
        assert wait_for(lambda: box.input_value() == "", 10)
        assert page.locator("#chat .message").count() == 0 and page.locator("[data-testid=toast-body]").count() == 0
        box.fill("Hello")
        box.press("Enter")
        page.get_by_text(STATS_LINE).first.wait_for(timeout=60_000)
        own = "Message MiniCPM-V… (attach or paste images)"  # its own again, with the question that was asked
        assert wait_for(lambda: box.get_attribute("placeholder") == own, 10), box.get_attribute("placeholder")
    finally:
        page.close()


def test_a_file_that_is_no_image_is_refused_in_the_chat_without_covering_it(browser, server_url, tmp_path):
    """Refused before the engine sees it: the reason stays in the chat after the toast has gone, the earlier
    conversation stays visible (Gradio's "Error" boxes once covered the chat and the box), and the question
    and its attachment are back in the box."""
    fake = tmp_path / "notimage.png"
    fake.write_text("just some text")
    page = open_page(browser, server_url)
    try:
        page.locator("#chat-input textarea").fill("Hello")
        page.locator("#chat-input textarea").press("Enter")
        page.get_by_text(STATS_LINE).first.wait_for(timeout=60_000)
        page.locator("#chat-input input[type=file]").set_input_files(str(fake))
        page.locator("#chat-input textarea").fill("And this?")
        page.wait_for_timeout(500)  # the upload finishes before sending
        page.locator("#chat-input textarea").press("Enter")
        page.locator("#chat").get_by_text("could not be read as an image").first.wait_for(timeout=30_000)
        # In the chat itself, not in a toast that goes (Gradio's toasts are outside #chat).
        assert page.locator("#chat").get_by_text("could not be read as an image").count() >= 1
        assert "Hello" in chat_text(page) and page.get_by_text(STATS_LINE).count() >= 1
        assert page.locator("#chat .error, #chat-input .error").count() == 0  # no "Error" box over them
        assert page.locator("#chat-input textarea").input_value() == "And this?"
        # The refused file is shown by its name, not drawn as a broken picture.
        assert page.locator("#chat").get_by_text("notimage.png").count() >= 1
        assert page.locator("#chat img[src*='notimage'], #chat-input img").count() == 0
        page.screenshot(path=os.path.join(ARTIFACTS, "refused-file.png"), full_page=True)
    finally:
        page.close()


def test_stop_button_halts_generation(page, manager):
    set_max_new_tokens(page, 4000)  # a reply long enough to be stopped mid-way
    stats_lines = page.get_by_text(STATS_LINE).count()
    # The engine is shared with earlier tests: a request of theirs still leaving would pass for this one.
    assert wait_for(lambda: manager.active_generations == 0, 30)
    question = "Tell me a very long story."
    send, stop = page.locator("#chat-input .submit-button"), page.locator("#chat-input .stop-button")
    assert (send.count(), stop.count()) == (1, 0)  # idle: Send, no Stop
    page.locator("#chat-input textarea").fill(question)
    page.locator("#chat-input textarea").press("Enter")
    assert wait_for(lambda: manager.active_generations == 1, 30), "the reply never reached the engine"
    # Part of the reply has streamed to the page (however slow the machine).
    assert wait_for(lambda: reply_after(page, question).strip(), 60), (
        f"no part of the reply reached the page: {manager.metrics.snapshot().get('tokens_generated')} tokens generated")
    assert manager.active_generations == 1
    # Streaming: Stop in place of Send (the box's update can render a moment after the chat's on a busy machine).
    assert wait_for(lambda: (send.count(), stop.count()) == (0, 1), 10)
    stop.click()
    # The engine dropped it, not only the page's loop.
    assert wait_for(lambda: manager.active_generations == 0, 30), "the stopped reply stayed in the batch"
    stopped = page.locator("#chat").get_by_text(re.compile(r"^■ Stopped · .* new tokens"))
    stopped.wait_for(timeout=30_000)  # marked, with its stats so far
    assert wait_for(lambda: (send.count(), stop.count()) == (1, 0), 10)
    assert page.get_by_text(STATS_LINE).count() == stats_lines + 1
    # Once still: the random model's reply can hold a reasoning block of its own, which folds when marked done.
    stopped_reply = settled_reply_after(page, question)
    assert stopped_reply is not None, "the stopped reply kept changing"
    assert stopped_reply.strip()  # what had streamed stays on the page
    page.wait_for_timeout(500)
    assert reply_after(page, question) == stopped_reply  # and nothing more arrives
    page.screenshot(path=os.path.join(ARTIFACTS, "stopped.png"), full_page=True)


def test_clearing_the_chat_mid_reply_ends_the_reply_and_it_stays_clear(browser, server_url, manager):
    page = open_page(browser, server_url)
    try:
        set_max_new_tokens(page, 4000)
        assert wait_for(lambda: manager.active_generations == 0, 30)
        question = "Tell me a very long story."
        page.locator("#chat-input textarea").fill(question)
        page.locator("#chat-input textarea").press("Enter")
        assert wait_for(lambda: reply_after(page, question).strip(), 60), "no part of the reply reached the page"
        page.locator("#chat").get_by_label("Clear").click()
        assert wait_for(lambda: manager.active_generations == 0, 30), "the cleared reply stayed in the batch"
        assert wait_for(lambda: question not in chat_text(page), 15), chat_text(page)[:200]
        page.wait_for_timeout(1000)
        assert question not in chat_text(page)  # nothing of it came back
        send, stop = page.locator("#chat-input .submit-button"), page.locator("#chat-input .stop-button")
        assert wait_for(lambda: (send.count(), stop.count()) == (1, 0), 10)  # ready for the next question
    finally:
        page.close()


def test_multi_image_replies_are_retried_undone_and_cleared_as_in_chat(browser, server_url, manager, tmp_path):
    """Retry answers the question again, Undo puts it back in the box (the images stay in the gallery and go
    with it again), and Clear mid-reply ends the reply, which never comes back; so does moving an image."""
    page = open_page(browser, server_url)
    try:
        set_max_new_tokens(page, 4000)
        assert wait_for(lambda: manager.active_generations == 0, 30)
        page.get_by_role("tab", name="Multi-image").click()
        paths = [make_image(tmp_path, f"two{i}.png", (300, 200), colour) for i, colour in enumerate([(200, 30, 30), (30, 30, 200)])]
        page.locator("#multi-gallery input[type=file]").set_input_files(paths)
        assert wait_for(lambda: page.locator("#multi-gallery .thumbnail-item.thumbnail-lg img").count() == 2, 20)
        chat, box = page.locator("#multi-chat"), page.locator("#multi-input textarea")
        send = page.locator("#multi-input .submit-button")
        question = "Compare them, at length."
        box.fill(question)
        box.press("Enter")
        assert wait_for(lambda: question in chat.inner_text() and chat.inner_text().split(question)[-1].strip(), 60)
        page.locator("#multi-input .stop-button").dispatch_event("click")  # re-drawn by each update under load
        assert wait_for(lambda: chat.get_by_text(STATS_LINE).count() == 1 and send.count() == 1, 30)
        with page.expect_response(lambda response: "/gradio_api/queue/join" in response.url):
            chat.locator("button[aria-label=Retry]").click()
        assert wait_for(lambda: page.locator("#multi-input .stop-button").count() == 1, 30)  # answering again
        page.locator("#multi-input .stop-button").dispatch_event("click")
        assert wait_for(lambda: chat.get_by_text(STATS_LINE).count() == 1 and send.count() == 1, 30)
        assert chat.inner_text().count(question) == 1
        chat.locator("button[aria-label=Undo]").click()
        assert wait_for(lambda: box.input_value() == question and question not in chat.inner_text(), 10)
        box.press("Enter")
        assert wait_for(lambda: question in chat.inner_text() and chat.inner_text().split(question)[-1].strip(), 60)
        chat.get_by_label("Clear").click()
        assert wait_for(lambda: manager.active_generations == 0, 30), "the cleared reply stayed in the batch"
        assert wait_for(lambda: question not in chat.inner_text(), 15)
        page.wait_for_timeout(1000)
        assert question not in chat.inner_text()  # nothing of it came back
        # Moving an image starts a new conversation as Clear does: the reply in progress ends, and stays gone.
        box.fill(question)
        box.press("Enter")
        assert wait_for(lambda: question in chat.inner_text() and chat.inner_text().split(question)[-1].strip(), 60)
        page.locator("#multi-gallery .thumbnail-item.thumbnail-lg").first.click()
        page.get_by_role("button", name="Move later ▶").click()
        assert wait_for(lambda: manager.active_generations == 0, 30), "the reply went on after the images changed"
        assert wait_for(lambda: question not in chat.inner_text(), 15)
        page.wait_for_timeout(1000)
        assert question not in chat.inner_text()
    finally:
        page.close()


def test_taking_the_video_out_mid_reply_ends_the_reply_and_the_chat_stays_clear(browser, server_url, manager, tmp_path):
    video = make_video(tmp_path, "clip.webm", seconds=3, fps=8, fourcc="VP80")
    page = open_page(browser, server_url)
    try:
        set_max_new_tokens(page, 4000)
        assert wait_for(lambda: manager.active_generations == 0, 30)
        page.get_by_role("tab", name="Video").click()
        page.locator("#video-player input[type=file]").set_input_files(video)
        assert wait_for(lambda: page.locator("#video-frames .caption-label").count() == 3, 60)
        chat, question = page.locator("#video-chat"), "What happens, at length?"
        page.locator("#video-input textarea").fill(question)
        page.locator("#video-input textarea").press("Enter")
        assert wait_for(lambda: question in chat.inner_text() and chat.inner_text().split(question)[-1].strip(), 60)
        page.locator("#video-player").get_by_label("Clear").click()
        assert wait_for(lambda: manager.active_generations == 0, 30), "the reply went on without its video"
        assert wait_for(lambda: question not in chat.inner_text(), 15)
        page.wait_for_timeout(1000)
        assert question not in chat.inner_text()  # nothing of it came back
    finally:
        page.close()


def test_a_reply_length_out_of_range_is_brought_within_it_and_never_covers_the_chat(browser, server_url):
    page = open_page(browser, server_url)
    try:
        box = page.get_by_label("Max new tokens", exact=True)
        for typed, kept in (("0", "1"), ("99999", str(limits.MAX_NEW_TOKENS_LIMIT)), ("", "256"), ("12", "12")):
            box.fill(typed)
            page.locator("#chat-input textarea").click()  # the field is left
            assert wait_for(lambda: box.input_value() == kept, 10), (typed, box.input_value())
        box.fill("0")  # then straight to the question: the field is left on the way
        page.locator("#chat-input textarea").fill("Hello?")
        page.locator("#chat-input textarea").press("Enter")
        assert wait_for(lambda: "· 1 new token" in chat_text(page), 30), chat_text(page)
        assert page.get_by_text("Error", exact=True).count() == 0  # Gradio's badge over the chat and the box
    finally:
        page.close()


def test_closing_the_tab_stops_generation(browser, server_url, manager):
    page = open_page(browser, server_url)
    set_max_new_tokens(page, 4000)
    page.locator("#chat-input textarea").fill("Write a very long essay.")
    page.locator("#chat-input textarea").press("Enter")
    assert wait_for(lambda: manager.active_generations == 1, 30)
    page.wait_for_timeout(500)
    page.close()
    assert wait_for(lambda: manager.active_generations == 0, 20)  # the GPU is free again, well before 4000 tokens
    assert manager.scheduler.waiting == 0


def test_a_reply_that_ends_while_reasoning_leaves_no_spinner(browser, server_url):
    page = open_page(browser, server_url)
    set_max_new_tokens(page, 24)  # the limit comes inside the reasoning block
    page.get_by_label("Thinking", exact=True).check()
    page.locator("#chat-input textarea").fill("Think it through.")
    page.locator("#chat-input textarea").press("Enter")
    page.get_by_text(STATS_LINE).wait_for(timeout=30_000)
    reasoning = page.locator("#chat .thought-group")
    assert reasoning.count() >= 1
    page.wait_for_timeout(500)
    assert reasoning.locator(".loading-spinner").count() == 0  # finished, so not "still thinking"
    page.close()


def test_stopping_a_reply_while_it_reasons_leaves_no_spinner(browser, server_url, manager):
    page = open_page(browser, server_url)
    set_max_new_tokens(page, 4000)
    # Greedy: a sampled reply of the random model can close its reasoning within its first tokens (CI, once).
    page.get_by_label("Sample (off: greedy)").uncheck()
    page.get_by_label("Thinking", exact=True).check()
    page.locator("#chat-input textarea").fill("Think about it for a long time.")
    page.locator("#chat-input textarea").press("Enter")
    reasoning = page.locator("#chat .thought-group")
    reasoning.first.wait_for(timeout=60_000)
    reasoning.locator(".loading-spinner").first.wait_for(timeout=60_000)  # streaming inside the reasoning block
    page.locator("#chat-input .stop-button").click()
    assert wait_for(lambda: manager.active_generations == 0, 30), "the stopped reply stayed in the batch"
    assert reasoning.count() >= 1  # what it had reasoned stays on the page
    # Stopped, so not "still thinking": the spinner goes once the page has the stop (a wait, not a sleep).
    assert wait_for(lambda: reasoning.locator(".loading-spinner").count() == 0, 15), "the spinner stayed after Stop"
    assert page.locator("#chat").get_by_text(re.compile(r"^■ Stopped")).count() == 1  # ended by its own handler
    page.close()


def test_html_in_a_reply_is_shown_as_text_never_run(browser, server_url, manager, monkeypatch):
    from app.engine.api import ReplyUpdate

    payload = ('<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2">'
               '<iframe src="javascript:window.__pwned = 3"></iframe> and plain words after')

    def hostile_stream(messages, settings, stop=None):
        yield ReplyUpdate(text=payload)

    monkeypatch.setattr(manager, "stream", hostile_stream)
    page = open_page(browser, server_url)
    page.locator("#chat-input textarea").fill("Say something nasty.")
    page.locator("#chat-input textarea").press("Enter")
    page.get_by_text("and plain words after").wait_for(timeout=20_000)
    page.wait_for_timeout(1000)
    page.screenshot(path=os.path.join(ARTIFACTS, "html-reply.png"), full_page=True)
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#chat script, #chat iframe, #chat img, #chat [onerror]").count() == 0
    assert page.get_by_text('<script>window.__pwned = 1</script><img src="x"').count() == 1  # shown as text
    page.close()


def test_a_long_markdown_reply_reaches_the_page_in_fewer_larger_updates(browser, server_url, manager, monkeypatch):
    """Every update renders the whole reply's Markdown again in the page: a reply of 30,000 characters of lists,
    code and tables sent in 300 updates reaches the page in far fewer (app.ui.handlers.page_update_interval),
    and whole. The page counts the lengths its chat's text took as it changed."""
    from app.engine.api import ReplyUpdate

    block = "## Part\n\n1. a point with `code`\n2. another\n\n```python\nx = 1\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
    text = (block * (30_000 // len(block) + 1))[:30_000]

    def long_stream(messages, settings, stop=None):
        for n in range(1, 301):
            time.sleep(0.01)
            yield ReplyUpdate(text=text[: n * 100])
        stats = {"visual_tokens": 0, "image_tokens": [], "video_tokens": None, "video_frames": 0, "prompt_tokens": 9,
                 "new_tokens": 7500, "ttft_ms": 10.0, "preprocess_ms": 1.0, "queue_ms": 0.0, "tokens_per_s": 2500.0,
                 "total_ms": 3000.0}
        yield ReplyUpdate(text=text + "\n\nTHE END", stats=stats)

    monkeypatch.setattr(manager, "stream", long_stream)
    page = open_page(browser, server_url)
    try:
        page.evaluate("""() => { window.__lengths = new Set(); const chat = document.querySelector('#chat');
            new MutationObserver(() => window.__lengths.add(chat.innerText.length))
                .observe(chat, {childList: true, subtree: true, characterData: true}); }""")
        page.locator("#chat-input textarea").fill("Write at length.")
        page.locator("#chat-input textarea").press("Enter")
        page.get_by_text(STATS_LINE).wait_for(timeout=60_000)
        page.wait_for_timeout(500)
        assert page.evaluate("document.querySelector('#chat').textContent.includes('THE END')")  # the whole reply
        assert page.evaluate("window.__lengths.size") <= 60  # about 30 updates, against 300 sent
    finally:
        page.close()


def test_server_load_panel_follows_the_engine(browser, server_url, manager):
    page = open_page(browser, server_url)
    page.get_by_text("How busy is the server? ↓").click()  # the link under the input opens the panel
    panel = page.locator("#server-load")
    assert wait_for(lambda: "answered" in panel.inner_text(), 10)
    before = manager.metrics.requests["finished"]
    page.locator("#chat-input textarea").fill("Count to three.")
    page.locator("#chat-input textarea").press("Enter")
    assert wait_for(lambda: manager.metrics.requests["finished"] > before, 60)
    # The panel refreshes itself (as often as the engine samples its load, while open) to the engine's new count.
    expected = f"{manager.metrics.requests['finished']:,} answered"
    assert wait_for(lambda: expected in panel.inner_text(), 10), panel.inner_text()
    assert re.search(r"\d+ answering now · \d+ waiting · [\d,]+ tokens/s", panel.inner_text())
    page.close()


@pytest.mark.parametrize("width", [1366, 390])
def test_server_load_charts_fill_with_the_engines_history(browser, server_url, client, width):
    """The panel's charts of the last minutes, drawn from the engine's history after some requests: side by
    side on a desktop, one above the other on a phone, none wider than the page; no GPU here, and the GPU
    chart says so."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(server_url)
    page.get_by_text("Server load").click()
    for _ in range(2):
        client.predict("Count to three.", [], {"max_new_tokens": 8}, api_name="/ask")
    charts = {name: page.locator(f"#load-{name}") for name in ("tokens", "replies", "first-token", "gpu")}
    # A chart with points is drawn by Vega; one without shows Gradio's empty box.
    for name in ("tokens", "replies", "first-token"):
        assert wait_for(lambda: charts[name].locator(".vega-embed").count() == 1, 60), name
    assert charts["gpu"].get_by_text("GPU memory: no GPU").is_visible()
    assert charts["gpu"].locator(".vega-embed").count() == 0
    boxes = {name: chart.bounding_box() for name, chart in charts.items()}
    assert all(box["x"] >= 0 and box["x"] + box["width"] <= width for box in boxes.values()), boxes
    side_by_side = boxes["tokens"]["y"] == boxes["replies"]["y"]
    assert side_by_side == (width >= 1000), boxes
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.locator("#server-load").scroll_into_view_if_needed()
    page.screenshot(path=os.path.join(ARTIFACTS, f"server-load-{width}.png"), full_page=True)
    page.close()


def test_high_detail_raises_the_slices_and_the_budget_together(browser, server_url, manager, tmp_path):
    """The sidebar's Image detail choice: High detail sets 36 slices and an 8,192-token budget, and a
    large image's reply then counts what 36 slices cost."""

    page = open_page(browser, server_url)
    set_max_new_tokens(page, 4)
    slices = page.get_by_label("number input for Max slices per image")
    budget = page.get_by_label("number input for Visual token budget per request")
    assert (slices.input_value(), budget.input_value()) == ("9", str(manager.default_settings().visual_token_budget))
    page.get_by_text("High detail", exact=True).click()
    assert wait_for(lambda: slices.input_value() == str(limits.HIGH_DETAIL_SLICE_NUMS), 10)
    assert budget.input_value() == str(limits.HIGH_DETAIL_VISUAL_TOKEN_BUDGET)
    page.locator("#chat-input input[type=file]").set_input_files(make_image(tmp_path, "page.png", (4000, 3000)))
    page.locator("#chat-input textarea").fill("Read the page.")
    page.locator("#chat-input textarea").press("Enter")
    page.get_by_text(STATS_LINE).wait_for(timeout=60_000)
    visual = int(re.search(r"([\d,]+) visual tokens", chat_text(page)).group(1).replace(",", ""))
    assert visual > 9 * 64 + 64  # more slices than the standard 9 allow
    page.get_by_text("Standard", exact=True).click()
    assert wait_for(lambda: slices.input_value() == "9", 10)
    page.close()


def test_the_multi_image_highlight_follows_the_image_it_moves(browser, server_url, tmp_path):
    """Select the 3rd image, move it earlier twice: the highlight and the preview follow it to the front,
    and Remove then removes it, not the image that took its old slot."""
    page = open_page(browser, server_url)
    names = [f"colour{i}.png" for i in range(3)]
    paths = [make_image(tmp_path, name, (300, 200), colour)
             for name, colour in zip(names, [(200, 30, 30), (30, 200, 30), (30, 30, 200)])]
    page.get_by_role("tab", name="Multi-image").click()
    page.locator("#multi-gallery input[type=file]").set_input_files(paths)
    # The grid's thumbnails (under the preview too), and the preview's strip, whose highlight is the selection.
    grid = page.locator("#multi-gallery .thumbnail-item.thumbnail-lg img")

    def shown() -> list[str]:
        return [src.rsplit("/", 1)[-1] for src in grid.evaluate_all("images => images.map(image => image.src)")]

    def highlighted() -> list[str]:
        return [src.rsplit("/", 1)[-1] for src in page.locator("#multi-gallery .thumbnail-item.thumbnail-small.selected img").evaluate_all(
            "images => images.map(image => image.src)")]

    assert wait_for(lambda: shown() == names, 20), shown()
    grid.nth(2).click()
    assert wait_for(lambda: highlighted() == [names[2]], 20), highlighted()
    assert page.locator("#multi-gallery button[aria-label='Download']:visible").count() == 1
    assert page.locator("#multi-gallery button[aria-label='Share']").count() == 0
    for order in ([names[0], names[2], names[1]], [names[2], names[0], names[1]]):
        page.get_by_role("button", name="◀ Move earlier").click()
        assert wait_for(lambda: shown() == order, 20), shown()  # a click reads the gallery as the page holds it
    assert wait_for(lambda: highlighted() == [names[2]], 10), highlighted()
    page.get_by_role("button", name="✕ Remove").click()
    assert wait_for(lambda: shown() == names[:2], 20), shown()
    page.close()


def test_deleting_an_image_with_the_gallerys_own_x_starts_a_new_conversation(browser, server_url, tmp_path):
    """The gallery's x on a thumbnail, like Remove: the conversation about the images it held is gone, so the
    next question is about the images the page shows (a follow-up took its images from the first turn)."""
    page = open_page(browser, server_url)
    try:
        paths = [make_image(tmp_path, f"pair{i}.png", (300, 200), colour) for i, colour in enumerate([(200, 30, 30), (30, 30, 200)])]
        page.get_by_role("tab", name="Multi-image").click()
        page.locator("#multi-gallery input[type=file]").set_input_files(paths)
        grid = page.locator("#multi-gallery .thumbnail-item.thumbnail-lg img")
        assert wait_for(lambda: grid.count() == 2, 20)
        box = page.locator("#multi-input textarea")
        box.fill("Compare them.")
        box.press("Enter")
        page.locator("#multi-chat").get_by_text(STATS_LINE).wait_for(timeout=60_000)
        page.locator("#multi-gallery").get_by_label("Delete image").first.click()
        assert wait_for(lambda: grid.count() == 1, 20)
        assert wait_for(lambda: "Compare them." not in page.locator("#multi-chat").inner_text(), 20)
    finally:
        page.close()


def set_max_slices(page, value: int) -> None:
    page.locator(".sidebar .toggle-button").first.click()
    box = page.get_by_label("number input for Max slices per image")
    box.fill(str(value))
    box.press("Enter")


@pytest.mark.parametrize("width", WIDTHS)
def test_an_attached_image_shows_its_cut_and_cost_before_it_is_sent(browser, server_url, manager, tmp_path,
                                                                   monkeypatch, width):
    """Attached, and before anything is sent, an image shows the cut the processor will make (its source view
    and 3x3 slices, drawn on it) and its 640 tokens; lowering max slices redraws both; typing does not."""
    plans, plan_images = [], manager.plan_images
    monkeypatch.setattr(manager, "plan_images", lambda *args: plans.append(args) or plan_images(*args))
    page = open_page(browser, server_url, width)
    try:
        page.locator("#chat-input input[type=file]").set_input_files(make_image(tmp_path, "square.png"))
        costs, pictures = page.locator("#chat-costs"), page.locator("#chat-previews img")
        costs.wait_for(timeout=30_000)
        assert wait_for(lambda: "640 tokens" in costs.inner_text(), 30)
        assert "3×3 slices of 448×448" in costs.inner_text() and "max 9 slices per image" in costs.inner_text()
        assert pictures.count() == 1 and pictures.first.get_attribute("alt") == "square.png · 640 tokens"
        page.screenshot(path=os.path.join(ARTIFACTS, f"image-preview-{width}.png"), full_page=True)
        planned, drawn = len(plans), pictures.first.get_attribute("src")
        page.locator("#chat-input textarea").press_sequentially("What is in it", delay=20)
        set_max_slices(page, 4)
        assert wait_for(lambda: "320 tokens" in costs.inner_text(), 30), costs.inner_text()
        assert len(plans) == planned + 1  # the box changed at every key typed: only the slices asked for a plan
        assert "2×2 slices" in costs.inner_text() and pictures.first.get_attribute("src") != drawn
        assert page.get_by_text(STATS_LINE).count() == 0  # nothing was sent
        assert page.locator("#chat-input [aria-label='File thumbnail']").count() == 1
        page.locator(".sidebar .toggle-button").first.click()  # closed again, to see the page
        page.screenshot(path=os.path.join(ARTIFACTS, f"image-preview-4-slices-{width}.png"), full_page=True)
    finally:
        page.close()


PLAYER = "() => { const v = document.querySelector('#video-player video'); return v && [v.src, v.readyState, v.currentTime] }"


@pytest.mark.parametrize("width", WIDTHS)
def test_a_video_chromium_cannot_play_shows_its_frames_and_plays_a_copy(browser, server_url, manager, tmp_path,
                                                                        monkeypatch, width):
    """An mp4v video (OpenCV's, a phone editor's): the strip of the frames the model will see, with their times,
    and a WebM copy that plays in the player, with no "not playable" left on the page; the model, asked, reads
    the original."""
    asked, stream = [], manager.stream

    def recording(messages, settings, stop=None):
        asked.append(messages)
        yield from stream(messages, settings, stop)

    monkeypatch.setattr(manager, "stream", recording)
    video = make_video(tmp_path, "phone.mp4", seconds=4, fps=8)
    page = open_page(browser, server_url, width)
    try:
        set_max_new_tokens(page, 8)
        page.locator(".sidebar .toggle-button").first.click()  # closed again
        page.get_by_role("tab", name="Video").click()
        page.locator("#video-player input[type=file]").set_input_files(video)
        frames = page.locator("#video-frames .caption-label")
        assert wait_for(lambda: frames.count() == 4, 60)
        assert frames.all_inner_texts() == ["0.5 s", "1.5 s", "2.5 s", "3.5 s"]
        assert wait_for(lambda: (page.evaluate(PLAYER) or [""])[0].endswith("/phone.mp4.browser.webm"), 60)
        assert wait_for(lambda: page.evaluate(PLAYER)[1] >= 2, 30)  # HAVE_CURRENT_DATA: it decodes
        page.evaluate("document.querySelector('#video-player video').play()")
        assert wait_for(lambda: page.evaluate(PLAYER)[2] > 0, 30), "the copy did not play"
        assert wait_for(lambda: page.get_by_text("not playable").count() == 0, 15)
        note = page.locator("#video-player-note")
        assert wait_for(lambda: "copy made for the browser" in note.inner_text(), 30), note.inner_text()
        page.screenshot(path=os.path.join(ARTIFACTS, f"video-copy-{width}.png"), full_page=True)
        page.locator("#video-input textarea").fill("What happens?")
        page.locator("#video-input textarea").press("Enter")
        page.locator("#video-chat").get_by_text(STATS_LINE).wait_for(timeout=60_000)
        part = asked[-1][0]["content"][0]
        assert part["type"] == "video" and part["path"].endswith("/phone.mp4")  # the original, not the copy
    finally:
        page.close()
