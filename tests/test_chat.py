"""Gradio history to model messages, settings validation, reasoning tags."""

import pytest

from app.chat import close_reasoning, history_to_messages, reply_for_display, strip_reasoning, ends_in_error, error_message
from app.engine.settings import GenerationSettings
from app.errors import UserError


def file_part(path):
    return {"type": "file", "file": {"path": path}}


def test_history_as_gradio_sends_it():
    history = [
        {"role": "user", "content": [file_part("/tmp/a.png")]},
        {"role": "user", "content": [file_part("/tmp/b.jpg")]},
        {"role": "user", "content": [{"type": "text", "text": "Compare them."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<think>hmm</think>\n\nThe first is red."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "640 tokens"}], "metadata": {"title": "stats"}},
        {"role": "user", "content": [{"type": "text", "text": "And the second?"}]},
    ]
    assert history_to_messages(history) == [
        {"role": "user", "content": [{"type": "image", "path": "/tmp/a.png"}, {"type": "image", "path": "/tmp/b.jpg"},
                                     {"type": "text", "text": "Compare them."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The first is red."}]},
        {"role": "user", "content": [{"type": "text", "text": "And the second?"}]},
    ]


def test_history_as_handlers_build_it():
    history = [{"role": "user", "content": "Look:"}, {"role": "user", "content": {"path": "/tmp/clip.webm"}}]
    assert history_to_messages(history) == [
        {"role": "user", "content": [{"type": "video", "path": "/tmp/clip.webm"}, {"type": "text", "text": "Look:"}]}]


def test_unsupported_file_in_history():
    with pytest.raises(UserError, match="not a supported file"):
        history_to_messages([{"role": "user", "content": {"path": "/tmp/x.exe"}}])


def test_reasoning():
    assert strip_reasoning("<think>a\nb</think>\n\nAnswer") == "Answer"
    assert strip_reasoning("<think>still thinking") == ""
    assert reply_for_display("step 1</think>done", prompt_opens_thinking=True) == "<think>step 1</think>done"
    assert reply_for_display("done", prompt_opens_thinking=False) == "done"


def test_markup_in_replies_is_shown_as_text():
    shown = reply_for_display("<b>hi</b> <think>x</think> `a<b` and\n```html\n<div>\n```\n<script>", False)
    assert shown == "&lt;b>hi&lt;/b> <think>x</think> `a<b` and\n```html\n<div>\n```\n&lt;script>"
    back = history_to_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": shown}])
    assert back[1]["content"][0]["text"] == "<b>hi</b>  `a<b` and\n```html\n<div>\n```\n<script>"  # the model sees what it wrote


def test_settings_overrides_are_checked():
    base = GenerationSettings()
    assert base.with_overrides({"max_new_tokens": "32", "do_sample": "false", "top_p": 0.5}).max_new_tokens == 32
    for bad in ({"max_new_tokens": 0}, {"max_new_tokens": 1.5}, {"temperature": -1}, {"do_sample": "maybe"},
                {"downsample_mode": "8x"}, {"max_slice_nums": 37}, {"top_p": float("nan")}, {"video_max_frames": float("inf")},
                {"nonsense": 1}):
        with pytest.raises(UserError):
            base.with_overrides(bad)


def test_a_finished_reply_never_shows_as_still_thinking():
    assert reply_for_display("still reasoning when the limit came", True, finished=True) == (
        "<think>still reasoning when the limit came</think>")
    assert reply_for_display("still reasoning", True) == "<think>still reasoning"  # streaming: left open
    assert reply_for_display("<think>a</think>done", False, finished=True) == "<think>a</think>done"
    assert close_reasoning("plain answer") == "plain answer"


def test_turns_answered_by_an_error_stay_out_of_the_conversation():
    """A failed turn stays on the page under its reason, and the model is asked as if it had not been sent;
    a reply that is reasoning alone (a message with metadata, as Gradio hands it back) still answers its turn."""
    reasoning = {"role": "assistant", "content": "hmm", "metadata": {"title": "Reasoning", "status": "done"}}
    stats = {"role": "assistant", "content": "", "metadata": {"title": "12 new tokens", "status": "done"}}
    history = [{"role": "user", "content": "First"}, reasoning, stats,
               {"role": "user", "content": {"path": "/up/a.txt"}}, {"role": "user", "content": "Failed"},
               error_message("“a.txt” is not a supported file."),
               {"role": "user", "content": "Second"}, {"role": "assistant", "content": "Answer"}]
    assert history_to_messages(history) == [
        {"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "text", "text": "Second"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Answer"}]}]
    assert ends_in_error(history[:6]) and not ends_in_error(history) and not ends_in_error([])
