"""The page's layout in headless Chromium, measured: at a laptop's 1366x800 and a phone's 390x844, light and
dark (?__theme=dark). Each tab's chat fills the window with its input at the bottom, nothing floats over
anything else, and the line under a reply is legible and opens on a small table."""

import os
import re

import pytest

from tests.conftest import ARTIFACTS, make_image, wait_for
from tests.test_browser import browser, pytestmark  # noqa: F401 (the module's browser, and its skip outside CI)

WINDOWS = {1366: 800, 390: 844}
TABS = (("Chat", "#chat", "#chat-input"), ("Multi-image", "#multi-chat", "#multi-input"),
        ("Video", "#video-chat", "#video-input"))
STATS = re.compile(r"^[\d,]+ visual tokens · first token after [\d.]+ m?s · [\d,]+ new tokens?( at [\d,]+ tokens/s)?$")
STATS_ROWS = ["Prompt", "Preprocessing", "Waiting for the model", "First token", "Total"]

# A rectangle of every element `selector` finds that the page draws ({x, y, width, height}).
RECTS = """(elements) => elements.map(e => e.getBoundingClientRect())
    .filter(r => r.width > 0 && r.height > 0).map(r => ({x: r.x, y: r.y, width: r.width, height: r.height}))"""
# The element's text size, its colour and the colour behind it (the first ancestor with a background), and
# its opacity all told (the product of its own and its ancestors').
LOOKS = """(e) => {
    const style = getComputedStyle(e);
    let opacity = 1, behind = null;
    for (let node = e; node; node = node.parentElement) {
        const own = getComputedStyle(node);
        opacity *= parseFloat(own.opacity);
        const colour = own.backgroundColor;
        if (!behind && colour !== "rgba(0, 0, 0, 0)" && colour !== "transparent") behind = colour;
    }
    return {size: parseFloat(style.fontSize), colour: style.color, behind, opacity};
}"""
# Whether the element lies wholly within its nearest scrolling ancestor's view (the window's, if none scrolls).
IN_VIEW = """(e) => {
    let pane = e.parentElement;
    while (pane && !(pane.scrollHeight > pane.clientHeight && /auto|scroll/.test(getComputedStyle(pane).overflowY))) {
        pane = pane.parentElement;
    }
    const box = e.getBoundingClientRect(), view = pane ? pane.getBoundingClientRect() : {top: 0, bottom: innerHeight};
    return box.top >= view.top - 1 && box.bottom <= Math.min(view.bottom, innerHeight) + 1;
}"""
# A Markdown table outside the chat (Gradio draws those in the text colour): one is put into the header.
A_TABLE = """(markdown) => {
    markdown.insertAdjacentHTML("beforeend", "<table><tbody><tr><td>cell</td></tr></tbody></table>");
    return markdown.querySelector("td");
}"""


def open_window(browser, server_url, width: int, theme: str):
    page = browser.new_page(viewport={"width": width, "height": WINDOWS[width]})
    page.goto(server_url + ("?__theme=dark" if theme == "dark" else ""))
    page.wait_for_selector("#chat-input textarea")
    page.get_by_role("button", name="Settings").wait_for()  # the page's own script has labelled the handle
    return page


def rects(page, selector: str) -> list[dict]:
    return page.locator(selector).evaluate_all(RECTS)


def rect(page, selector: str) -> dict:
    found = rects(page, selector)
    assert len(found) == 1, (selector, found)
    return found[0]


def bottom(box: dict) -> float:
    return box["y"] + box["height"]


def overlap(a: dict, b: dict) -> bool:
    """Whether two rectangles share more than a pixel's sliver."""
    return (min(a["x"] + a["width"], b["x"] + b["width"]) - max(a["x"], b["x"]) > 1
            and min(bottom(a), bottom(b)) - max(a["y"], b["y"]) > 1)


def luminance(colour: str) -> float:
    """The relative luminance (WCAG) of a CSS rgb()/rgba() colour."""
    channels = [int(value) / 255 for value in re.findall(r"[\d.]+", colour)[:3]]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(one: str, other: str) -> float:
    high, low = sorted((luminance(one), luminance(other)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def new_tokens(stats_line: str) -> int:
    return int(re.search(r"([\d,]+) new tokens?", stats_line).group(1).replace(",", ""))


def set_max_new_tokens(page, value: int) -> None:
    box = page.get_by_label("Max new tokens", exact=True)
    box.fill(str(value))
    box.press("Enter")


def ask(page, tab_input: str, chat: str, question: str, replies: int) -> None:
    """Send `question` from `tab_input` and wait until `chat` holds `replies` finished replies."""
    page.locator(f"{tab_input} textarea").fill(question)
    page.locator(f"{tab_input} textarea").press("Enter")
    assert wait_for(lambda: page.locator(f"{chat} .reply-stats").count() >= replies, 60), f"no reply in {chat}"
    page.wait_for_timeout(300)  # the last update drawn


def shot(page, name: str) -> None:
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, f"layout-{name}.png"))


@pytest.mark.parametrize("width, theme", [(1366, "light"), (390, "dark")])
def test_each_tab_fills_the_window_with_its_input_at_the_bottom(browser, server_url, tmp_path, width, theme):
    """The header is compact and the settings handle labelled, off the page's content; in every tab the chat
    takes the window's height down to its input, which with the reply controls under it ends the window, no
    scrolling needed (with three images in the gallery too); the camera sits above the chat's input, the
    examples inside the empty chats, and the galleries' labels above their pictures. The Server load panel
    is below, a link away that opens it."""
    height = WINDOWS[width]
    page = open_window(browser, server_url, width, theme)
    try:
        header = rect(page, "#model-header")
        assert bottom(header) <= (70 if width > 1000 else 120), header
        assert "Random weights" in page.locator("#model-header").inner_text()  # the banner is in the header
        handle = rect(page, "#settings .toggle-button")
        assert page.locator("#settings .toggle-button").inner_text().strip() == "Settings"
        content = rect(page, "#workspace")
        assert handle["x"] + handle["width"] <= content["x"], (handle, content)  # in the page's margin
        for tab, chat, box in TABS:
            page.get_by_role("tab", name=tab).click()
            page.locator(chat).wait_for()
            if tab == "Multi-image":
                paths = [make_image(tmp_path, f"layout{i}.png", (600, 400)) for i in range(3)]
                page.locator("#multi-gallery input[type=file]").set_input_files(paths)
                page.locator("#multi-previews img").nth(2).wait_for(timeout=30_000)
                # A long label on a phone wraps above the pictures, not over them.
                for gallery, pictures in (("#multi-gallery", ".thumbnail-item"), ("#multi-previews", "img")):
                    label = rect(page, f"{gallery} [data-testid=block-label]")
                    assert not any(overlap(label, picture) for picture in rects(page, f"{gallery} {pictures}")), gallery
                # The buttons that order the images show whole in their pane, beside one another.
                pane = rect(page, "#multi-gallery >> xpath=ancestor::*[contains(@class, 'media-pane')][1]")
                moves = rects(page, ".gallery-moves button")
                assert len(moves) == 3 and len({round(move["y"]) for move in moves}) == 1, moves
                assert all(pane["y"] <= move["y"] and bottom(move) <= bottom(pane) for move in moves), (pane, moves)
            else:
                examples = rects(page, f"{chat} .example")
                assert examples and all(overlap(example, rect(page, chat)) for example in examples), tab
            chat_box, input_box, controls = rect(page, chat), rect(page, box), rect(page, "#reply-controls")
            assert page.evaluate("window.scrollY") == 0
            assert height - 40 <= bottom(controls) <= height, (tab, controls)
            assert 0 <= controls["y"] - bottom(input_box) <= 16, (tab, input_box, controls)  # under the input
            between = 70 if tab == "Chat" else 16  # the Chat tab's camera bar lies between
            assert 0 <= input_box["y"] - bottom(chat_box) <= between, (tab, chat_box, input_box)
            assert chat_box["height"] >= (0.55 if width > 1000 else 0.3) * height, (tab, chat_box)
            assert page.evaluate("document.documentElement.scrollWidth") <= width
            shot(page, f"{tab.lower()}-{width}-{theme}")
        page.get_by_role("tab", name="Chat").click()
        camera = rect(page, "#camera")
        assert bottom(rect(page, "#chat")) <= camera["y"] and bottom(camera) <= rect(page, "#chat-input")["y"]
        if width > 768:  # a link beside the reply controls opens the Server load panel, a scroll away
            page.get_by_role("link", name="How busy is the server?").click()
            assert wait_for(lambda: page.locator("#server-load").is_visible(), 10)  # opened
            assert wait_for(lambda: 0 <= rect(page, "#server-load-panel")["y"] < height, 10)  # and scrolled to
            page.evaluate("window.scrollTo(0, 0)")
        page.get_by_role("button", name="Settings").click()
        assert wait_for(lambda: page.get_by_label("Sample (off: greedy)").is_visible(), 10)
    finally:
        page.close()


@pytest.mark.parametrize("width, theme", [(1366, "dark"), (390, "light")])
def test_nothing_covers_the_messages(browser, server_url, width, theme):
    """A conversation longer than its chat: the chat's label and buttons are above the scrolled messages, not
    over them (nor over an image's buttons); the scroll-to-bottom arrow covers no message, and the settings
    sidebar, where it meets the arrow, is over it."""
    page = open_window(browser, server_url, width, theme)
    try:
        set_max_new_tokens(page, 300)
        page.locator("#chat-input input[type=file]").set_input_files(os.path.join("assets", "examples", "shapes.jpg"))
        page.wait_for_timeout(500)  # the upload finishes before sending
        messages = page.locator("#chat .bubble-wrap")
        for replies in range(1, 5):  # a sampled reply of the random model may end early: until the chat scrolls
            ask(page, "#chat-input", "#chat", "What is in this picture?" if replies == 1 else "And then?", replies)
            if messages.evaluate("e => e.scrollHeight > e.clientHeight + 200"):
                break
        assert messages.evaluate("e => e.scrollHeight > e.clientHeight + 200")
        widest = max(box["width"] for box in rects(page, "#chat .bot-row"))
        assert widest >= 0.75 * rect(page, "#chat")["width"], widest  # replies use the chat's width, on a phone too
        scrolled_area = rect(page, "#chat .bubble-wrap")
        label, buttons = rect(page, "#chat > .wrapper > [data-testid=block-label]"), rect(page, "#chat > .wrapper > .top-panel")
        assert not overlap(label, scrolled_area) and not overlap(buttons, scrolled_area)
        messages.evaluate("e => e.scrollTop = 0")
        page.wait_for_timeout(300)
        image_buttons = rects(page, "#chat .image-container .icon-button-wrapper")
        assert image_buttons and not any(overlap(buttons, each) for each in image_buttons)
        arrow = page.locator("#chat .scroll-down-button-container button")  # shown while far from the end
        arrow.wait_for(timeout=10_000)
        page.wait_for_timeout(300)  # arrived
        shot(page, f"scrolled-{width}-{theme}")
        arrow_box = rect(page, "#chat .scroll-down-button-container button")
        covered = [box for box in rects(page, "#chat .message, #chat .thought-group, #chat .message-buttons")
                   if overlap(box, arrow_box)]
        assert not covered, (arrow_box, covered)
        page.get_by_role("button", name="Settings").click()
        page.wait_for_timeout(600)  # the sidebar has slid in
        arrow_box, sidebar = rect(page, "#chat .scroll-down-button-container button"), rect(page, "#settings")
        assert overlap(arrow_box, sidebar) == (width < 768)  # a phone's sidebar takes the whole window
        if overlap(arrow_box, sidebar):
            centre = [arrow_box["x"] + arrow_box["width"] / 2, arrow_box["y"] + arrow_box["height"] / 2]
            assert page.evaluate("([x, y]) => !!document.elementFromPoint(x, y).closest('#settings')", centre)
    finally:
        page.close()


@pytest.mark.parametrize("width, theme", [(1366, "dark"), (390, "light")])
def test_the_stats_line_is_legible_and_opens_on_a_table(browser, server_url, width, theme):
    """The line under a reply: plain words at the chat's own text size, full strength, readable against its
    background, unlike the reasoning block above it; opened, a small table whose lines are soft in dark mode
    too, as are those of a Markdown table anywhere on the page. Thinking and max new tokens, set beside the Chat tab's input, hold for the Multi-image tab's
    question: one control each for all tabs."""
    page = open_window(browser, server_url, width, theme)
    try:
        set_max_new_tokens(page, 6)
        page.get_by_label("Thinking", exact=True).check()
        # Greedy: a sampled reply of the random model can close its reasoning at once, leaving no block to compare.
        page.get_by_role("button", name="Settings").click()
        page.get_by_label("Sample (off: greedy)").uncheck()
        page.get_by_role("button", name="Settings").click()
        ask(page, "#chat-input", "#chat", "Think.", 1)
        stats = page.locator("#chat .thought-group:has(.reply-stats)")
        title = stats.locator(".title .md")
        assert STATS.match(title.inner_text().strip()), title.inner_text()
        assert new_tokens(title.inner_text()) <= 6  # the limit set beside the input (the random model may end sooner)
        text, line = page.locator("#chat .user .md").first.evaluate(LOOKS), title.evaluate(LOOKS)
        assert line["size"] >= 0.95 * text["size"] and line["opacity"] >= 0.99, (line, text)
        assert contrast(line["colour"], line["behind"]) >= 4.5, line
        reasoning = page.locator("#chat .thought-group:not(:has(.reply-stats))").first
        assert reasoning.locator(".title .md").evaluate(LOOKS)["size"] < line["size"]  # the two look different
        title.click()
        table = stats.locator("table")
        table.wait_for()
        # The same first question in another window (an earlier case of this test) goes on from what the engine
        # kept of it, and says so in a row of its own.
        rows = [cell.strip() for cell in table.locator("tbody tr td:first-child").all_inner_texts()]
        assert [row for row in rows if row not in ("Kept from the conversation", "Images kept encoded")] == STATS_ROWS
        assert not table.locator("thead").is_visible()  # the table's header is empty: no row for it
        for cell in (table.locator("td").first, page.locator("#model-header span.md").evaluate_handle(A_TABLE)):
            line_colour, behind = cell.evaluate("e => getComputedStyle(e).borderTopColor"), cell.evaluate(LOOKS)["behind"]
            assert contrast(line_colour, behind) < 2.5, (line_colour, behind)  # a soft line, not a white one on dark
        assert table.locator("td").first.evaluate(LOOKS)["size"] >= 0.85 * text["size"]  # small, yet near it
        shot(page, f"stats-{width}-{theme}")
        page.get_by_role("tab", name="Multi-image").click()
        page.locator("#multi-chat .example").first.click()
        assert wait_for(lambda: page.locator("#multi-input textarea").input_value() != "", 20)
        # What the model will see, as for images put there by hand (a gallery filled by an event fires no change).
        assert wait_for(lambda: "tokens" in page.locator("#multi-costs").inner_text(), 20)
        assert page.get_by_label("Thinking", exact=True).is_checked()
        ask(page, "#multi-input", "#multi-chat", "What changed?", 1)
        assert new_tokens(page.locator("#multi-chat .thought-group:has(.reply-stats)").inner_text()) <= 6
        assert page.locator("#multi-chat .thought-group:not(:has(.reply-stats))").count() >= 1  # it reasoned
    finally:
        page.close()


@pytest.mark.parametrize("width", [1366, 390])
def test_a_long_replys_stats_opened_scroll_into_view(browser, server_url, width):
    """Under a reply that filled the chat, the stats' table opens below its fold: the chat scrolls to show it."""
    page = open_window(browser, server_url, width, "light")
    try:
        set_max_new_tokens(page, 300)
        ask(page, "#chat-input", "#chat", "Tell me a long story.", 1)
        stats = page.locator("#chat .thought-group:has(.reply-stats)")
        stats.locator(".title .md").click()
        table = stats.locator("table")
        table.wait_for()
        assert wait_for(lambda: table.evaluate(IN_VIEW), 5), table.evaluate("e => e.getBoundingClientRect().bottom")
    finally:
        page.close()


def test_the_video_tabs_example_shows_a_square_thumbnail_as_the_images_do(browser, server_url):
    page = open_window(browser, server_url, 390, "light")
    try:
        image = rects(page, "#chat .example-image")[0]
        page.get_by_role("tab", name="Video").click()
        page.locator("#video-chat video.example-image").wait_for()
        video = rect(page, "#video-chat video.example-image")
        assert (video["width"], video["height"]) == (image["width"], image["height"]) and image["width"] >= 30
    finally:
        page.close()


def test_a_phones_video_pane_shades_its_foot_while_more_lies_below(browser, server_url, tmp_path):
    """At 390 px the Video tab's media pane (40% of the height) holds the player, its settings and the frames the
    model will see: a shade at its foot says that more lies below, and is gone once scrolled to the end."""
    from tests.conftest import make_video

    page = open_window(browser, server_url, 390, "light")
    try:
        page.get_by_role("tab", name="Video").click()
        page.locator("#video-player input[type=file]").set_input_files(make_video(tmp_path, seconds=6))
        page.locator("#video-frames img").first.wait_for(timeout=30_000)
        pane = page.locator("#video-player >> xpath=ancestor::*[contains(@class, 'media-pane')][1]")
        assert pane.evaluate("e => e.scrollHeight > e.clientHeight + 100")  # the frames lie below the player
        shade = "e => parseFloat(getComputedStyle(e, '::after').opacity)"
        assert wait_for(lambda: pane.evaluate(shade) > 0.9, 5)
        pane.evaluate("e => e.scrollTop = e.scrollHeight")
        assert wait_for(lambda: pane.evaluate(shade) < 0.1, 5)
    finally:
        page.close()


def test_the_closed_settings_take_no_focus(browser, server_url):
    """Closed, the settings sidebar is only slid out of view: Tab goes round the page without entering it, and
    reaches its controls once it is opened."""
    page = open_window(browser, server_url, 1366, "light")
    inside = "() => !!document.activeElement.closest('#settings .sidebar-content')"
    try:
        page.locator("#chat-input textarea").wait_for()
        walked = []
        for _ in range(60):
            page.keyboard.press("Tab")
            walked.append(page.evaluate(inside))
        assert not any(walked)
        toggle = page.locator("#settings .toggle-button")
        toggle.click()
        assert wait_for(lambda: "open" in page.locator("#settings").get_attribute("class"), 5)
        toggle.focus()
        page.keyboard.press("Tab")
        assert page.evaluate(inside)
    finally:
        page.close()
