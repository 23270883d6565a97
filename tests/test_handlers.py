"""UI handlers called directly, without a server: history in, history out."""

import gradio as gr
import pytest

from app.ui.handlers import SETTING_KEYS, Handlers, stats_message
from app.ui.layout import question_then_answer
from app.ui.previews import Previews
from tests.conftest import make_image, truncated_png


@pytest.fixture
def handlers(manager):
    return Handlers(manager)


def ui_settings(manager, **overrides) -> dict:
    """The settings as the UI's components hold them (SETTING_KEYS), by name."""
    values = {**manager.default_settings().as_dict(), "max_new_tokens": 12, "min_new_tokens": 12, **overrides}
    return {key: values[key] for key in SETTING_KEYS}


def settings_values(manager, **overrides):
    """The same, in the order an event passes them."""
    return list(ui_settings(manager, **overrides).values())


def run(handlers, manager, history, **overrides):
    updates = list(handlers.respond(history, ui_settings(manager, **overrides)))
    return updates, updates[-1]


def test_chat_turn_streams_then_adds_stats(handlers, manager, red_image):
    history, box, camera = handlers.add_chat_message({"text": "What is it?", "files": [red_image]}, None, [])
    assert box is None and camera is None
    assert [m["role"] for m in history] == ["user", "user"]
    # Long enough to span several stream intervals (tokens that arrive together go out as one update).
    updates, final = run(handlers, manager, history, max_new_tokens=256, min_new_tokens=256)
    assert len(updates) >= 3
    reply, stats = final[-2], final[-1]
    assert reply["role"] == "assistant" and reply["content"]
    assert stats["metadata"]["title"].startswith("640 visual tokens")
    assert "| Images | #1 640 tokens |" in stats["content"]


def test_text_only_follow_up_keeps_the_image(handlers, manager, red_image):
    history, _, _ = handlers.add_chat_message({"text": "What is it?", "files": [red_image]}, None, [])
    _, history = run(handlers, manager, history)
    history, _, _ = handlers.add_chat_message({"text": "Sure?", "files": []}, None, history)
    _, history = run(handlers, manager, history)
    assert history[-1]["metadata"]["title"].startswith("640 visual tokens")


def test_camera_photo_is_attached(handlers, tmp_path):
    photo = make_image(tmp_path, "camera.png", (640, 480))
    history, _, _ = handlers.add_chat_message({"text": "Hi", "files": []}, photo, [])
    assert history[0]["content"] == {"path": photo}


def test_bad_upload_is_refused_before_the_model(handlers, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(gr.Error, match="could not be read"):
        handlers.add_chat_message({"text": "What?", "files": [str(broken)]}, None, [])
    with pytest.raises(gr.Error, match="Type a question"):
        handlers.add_chat_message({"text": " ", "files": []}, None, [])


def test_an_image_broken_past_its_header_is_explained_in_the_reply(handlers, manager, red_image, tmp_path):
    """Only the header is read when a file is attached (decoding it there would put a second decoding
    before every first token): a PNG cut short gets into the chat, and the reply says it is unreadable."""
    cut = truncated_png(tmp_path)
    history, _, _ = handlers.add_chat_message({"text": "What?", "files": [cut]}, None, [])
    _, final = run(handlers, manager, history)
    assert final[-1]["metadata"]["title"].startswith("⚠️") and "could not be read" in final[-1]["content"]
    history, _, _ = handlers.add_chat_message({"text": "And this?", "files": [red_image]}, None, final)
    _, after = run(handlers, manager, history)
    assert after[-1]["metadata"]["title"].startswith("640 visual tokens")


def test_a_failed_question_goes_back_to_its_box(handlers, manager, red_image, tmp_path):
    """As wired in the page: when the reply fails, the question's turn is removed and the box gets back
    what was sent (its text and files, and the camera's photo); a question answered leaves them cleared."""
    cut = truncated_png(tmp_path)
    answer = question_then_answer(handlers.add_chat_message, 3, handlers.respond, cleared=2)
    sent = {"text": "What is on this page?", "files": [cut]}
    updates = list(answer(sent, red_image, [], *settings_values(manager)))
    assert updates[0][1:] == (None, None)  # cleared as it was sent
    history, box, camera = updates[-1]
    assert history[-1]["metadata"]["title"].startswith("⚠️") and len(history) == 1
    assert box == sent and camera == red_image

    updates = list(answer({"text": "And now?", "files": [red_image]}, None, history, *settings_values(manager)))
    history, box, camera = updates[-1]
    assert history[-1]["metadata"]["title"].startswith("640 visual tokens")
    assert isinstance(box, type(gr.skip())) and isinstance(camera, type(gr.skip()))

    ask_multi = question_then_answer(handlers.add_multi_image_question, 3, handlers.respond, cleared=1)
    history, box = list(ask_multi("Compare them.", [cut, red_image], [], *settings_values(manager)))[-1]
    assert history[-1]["metadata"]["title"].startswith("⚠️") and box == "Compare them."


def test_a_question_refused_before_it_is_asked_is_explained_in_the_chat_and_stays_in_its_box(
        handlers, manager, red_image, tmp_path):
    """A file that is no image, or an empty question, is refused before the engine sees it: the reason is
    in the chat (not only in a toast that goes), the conversation is as it was, the question is back in
    its box. Raised instead, Gradio covered the chat and the box with "Error" boxes."""
    answer = question_then_answer(handlers.add_chat_message, 3, handlers.respond, cleared=2)
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    fake = tmp_path / "notimage.png"
    fake.write_text("just some text")
    for sent, photo, why in (({"text": "What is this?", "files": [str(fake)]}, red_image, "could not be read as an image"),
                             ({"text": "  ", "files": []}, None, "Type a question")):
        updates = list(answer(sent, photo, earlier, *settings_values(manager)))
        assert len(updates) == 1
        history, box, camera = updates[0]
        assert history[:2] == earlier and len(history) == 3 and why in history[-1]["content"]
        assert history[-1]["metadata"]["title"].startswith("⚠️")
        assert box == sent and camera == photo
    ask_video = question_then_answer(handlers.add_video_question, 3, handlers.respond, cleared=1)
    history, box = list(ask_video("What happens?", None, [], *settings_values(manager)))[0]
    assert history[-1]["metadata"]["title"].startswith("⚠️") and box == "What happens?"


def test_an_image_whose_upload_expired_is_explained(handlers, manager, tmp_path):
    """Uploads are deleted after a while (app.web.uploads): a follow-up about a conversation whose image has
    gone says so, rather than calling it a file that was never uploaded."""
    gone = str(tmp_path / "expired.png")
    history = [{"role": "user", "content": {"path": gone}}, {"role": "user", "content": "And now?"}]
    _, final = run(handlers, manager, history)
    assert "“expired.png” is no longer on the server" in final[-1]["content"]


def test_failed_turn_is_removed_and_explained(handlers, manager, red_image, tmp_path):
    _, good = run(handlers, manager, [{"role": "user", "content": {"path": red_image}}, {"role": "user", "content": "Hi"}])
    broken = tmp_path / "vanished.png"
    broken.write_bytes(b"garbage")
    history = good + [{"role": "user", "content": {"path": str(broken)}}, {"role": "user", "content": "And this?"}]
    _, final = run(handlers, manager, history)
    assert final[: len(good)] == good  # the earlier conversation is intact
    assert final[-1]["metadata"]["title"].startswith("⚠️") and len(final) == len(good) + 1
    _, after = run(handlers, manager, final + [{"role": "user", "content": "Next question"}])
    assert after[-1]["metadata"]["title"].startswith("640 visual tokens")  # the conversation goes on


def test_retry_and_undo(handlers, manager, red_image):
    history = [{"role": "user", "content": {"path": red_image}}, {"role": "user", "content": "First"}]
    _, history = run(handlers, manager, history)
    history = history + [{"role": "user", "content": "Second"}]
    _, history = run(handlers, manager, history)
    # image, "First", reply, stats, "Second", reply, stats
    assert [m["role"] for m in history] == ["user", "user", "assistant", "assistant", "user", "assistant", "assistant"]
    retried = handlers.retry(history, gr.RetryData(None, {"index": 4, "value": "Second"}))
    assert retried == history[:5] and retried[-1]["content"] == "Second"
    kept, box = handlers.undo(history, gr.UndoData(None, {"index": 4, "value": "Second"}))
    assert kept == history[:4] and box == {"text": "Second", "files": []}
    kept, box = handlers.undo(history[:4], gr.UndoData(None, {"index": 1, "value": "First"}))
    assert kept == [] and box == {"text": "First", "files": [red_image]}


def test_multi_image_order_costs_and_questions(handlers, manager, tmp_path):
    paths = [make_image(tmp_path, f"{name}.png", size) for name, size in (("a", (1344, 1344)), ("b", (448, 448)), ("c", (1920, 1080)))]
    gallery = [(path, None) for path in paths]
    moved, selected = Handlers.move_image(gallery, 2, -1)
    assert moved == [paths[0], paths[2], paths[1]] and selected == 1
    removed, selected = Handlers.remove_image(moved, 0)
    assert removed == [paths[2], paths[1]] and selected is None
    pictures, costs = Previews(manager).gallery_images(moved, ui_settings(manager))
    assert "1. **a.png**: 640 tokens" in costs and "2. **c.png**: 578 tokens" in costs and "3. **b.png**: 64 tokens" in costs
    assert len(pictures["value"]) == 3
    history, box = handlers.add_multi_image_question("What changed?", moved, [])
    assert [m["content"] for m in history] == [{"path": paths[0]}, {"path": paths[2]}, {"path": paths[1]}, "What changed?"]
    _, history = run(handlers, manager, history)
    assert "| Images | #1 640, #2 578, #3 64 tokens |" in history[-1]["content"]
    history, _ = handlers.add_multi_image_question("And now?", moved, history)
    assert history[-1] == {"role": "user", "content": "And now?"}  # follow-up: images are not attached twice
    with pytest.raises(gr.Error, match="Add at least one image"):
        handlers.add_multi_image_question("Hi", [], [])


def test_thinking_renders_as_a_reasoning_block(handlers, manager, red_image):
    history = [{"role": "user", "content": {"path": red_image}}, {"role": "user", "content": "Think first."}]
    _, final = run(handlers, manager, history, enable_thinking=True)
    assert final[-2]["content"].startswith("<think>")  # the template opened the block; the display shows it
    _, final = run(handlers, manager, history, enable_thinking=False)
    assert not final[-2]["content"].startswith("<think>")


def test_a_reply_that_ends_while_thinking_closes_its_reasoning(handlers, manager, red_image):
    history = [{"role": "user", "content": {"path": red_image}}, {"role": "user", "content": "Think first."}]
    _, final = run(handlers, manager, history, enable_thinking=True, max_new_tokens=4)
    shown = final[-2]["content"]  # the token limit came inside the reasoning block: the last reply closes it
    assert shown.rfind("</think>") > shown.rfind("<think>")


def test_stop_marks_the_reasoning_it_cut_off_as_done():
    pending = {"title": "Reasoning", "status": "pending"}
    earlier = {"role": "assistant", "metadata": dict(pending), "content": "an older turn's, left as it is"}
    history = [{"role": "user", "content": "First?"}, earlier, {"role": "user", "content": "Think."},
               {"role": "assistant", "metadata": dict(pending), "content": [{"type": "text", "text": "Hmm"}]}]
    ended = Handlers.end_stopped_reply(history)
    assert ended[-1]["metadata"] == {"title": "Reasoning", "status": "done"}
    assert ended[-1]["content"] == history[-1]["content"] and ended[:3] == history[:3]
    assert history[-1]["metadata"]["status"] == "pending"  # the input is not changed in place
    assert Handlers.end_stopped_reply(None) == []


def test_the_stats_say_when_preprocessing_waited_for_a_free_preparer():
    stats = {"tokens_per_s": 50.0, "visual_tokens": 640, "ttft_ms": 900.0, "new_tokens": 8, "prompt_tokens": 700,
             "image_tokens": [640], "video_frames": 0, "video_tokens": 0, "preprocess_ms": 700.0, "queue_ms": 100.0,
             "total_ms": 1200.0}
    waiting = {"to_preparer": 400.0, "for_a_worker": 120.0, "work": 70.0, "way_back": 2.0, "staging": 1.0}
    assert "| Preprocessing | 700 ms (520 ms of it waiting for a free preparer) |\n| Waiting for the model | 100 ms |" in \
        stats_message({**stats, "preparation_ms": waiting}, [])["content"]
    idle = {**waiting, "to_preparer": 0.5, "for_a_worker": 0.1}
    for quiet in ({**stats, "preparation_ms": idle}, stats):  # no wait worth saying; an external server's stats
        assert "| Preprocessing | 700 ms |\n| Waiting for the model | 100 ms |" in stats_message(quiet, [])["content"]


def test_an_empty_question_is_told_what_its_tab_takes(handlers):
    """The Chat tab takes images (videos go to the Video tab); Multi-image and Video hold their media already."""
    with pytest.raises(gr.Error) as refused:
        handlers.add_chat_message({"text": "  ", "files": []}, None, [])
    assert refused.value.message == "Type a question or attach an image first."
    with pytest.raises(gr.Error) as refused:
        handlers.add_multi_image_question(" ", ["/nowhere/a.png"], [])
    assert refused.value.message == "Type a question first."


def test_help_shows_no_default_for_flags():
    """`--no-warmup` and `--in-process-engine` are off until given (argparse read their fields' True)."""
    from app.config import build_parser

    text = build_parser().format_help()
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "(default: 1)" in text  # options with a value still show theirs
