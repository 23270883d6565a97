"""UI handlers called directly, without a server: history in, history out."""

import gradio as gr
import pytest

from app.chat import box_value, history_to_messages, is_error, plain_file
from app.engine.stop_signal import StopSignal
from app.ui.handlers import SETTING_KEYS, Handlers, stats_message
from app.ui.replying import question_then_answer
from app.ui.previews import Previews
from tests.conftest import make_image, truncated_png, wait_for


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
    """The turn stays, its reply says why, and the box keeps what was sent; an empty message is no turn."""
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    sent = {"text": "What?", "files": [str(broken)]}
    history, box, camera = handlers.add_chat_message(sent, None, [])
    # The refused file is shown by its name, not drawn as a picture (a broken-image icon was all the chat showed).
    assert [m["content"] for m in history[:2]] == [plain_file(str(broken)), "What?"]
    assert history[0]["content"]["file"]["mime_type"] == "application/octet-stream"
    assert is_error(history[-1]) and "could not be read" in history[-1]["content"] and len(history) == 3
    assert box == {"text": "What?", "files": [plain_file(str(broken))["file"]]} and camera is None  # by its name too
    assert history_to_messages(history) == []  # a failed turn never reaches the model
    assert box_value(history[:2]) == {"text": "What?", "files": [str(broken)]}  # what Undo hands back
    with pytest.raises(gr.Error, match="Type a question"):
        handlers.add_chat_message({"text": " ", "files": []}, None, [])


def test_a_refused_image_among_several_is_the_only_one_shown_by_its_name(handlers, red_image, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    history, box = handlers.add_multi_image_question("Which?", [red_image, str(broken)], [])
    assert [m["content"] for m in history[:3]] == [{"path": red_image}, plain_file(str(broken)), "Which?"]
    assert is_error(history[-1]) and box == "Which?"


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


SKIP = type(gr.skip())


def last_history(updates: list) -> list:
    """The chat as the page last got it (the last update may change the box only)."""
    return next(update[0] for update in reversed(updates) if isinstance(update[0], list))


def test_a_failed_question_stays_under_its_error_and_goes_back_to_its_box(handlers, manager, red_image, tmp_path):
    """As wired in the page: when the reply fails, the question's turn stays with the reason as its reply, and
    the box gets back what was sent (its text and files, and the camera's photo), Send in place of Stop; a
    question answered leaves them cleared."""
    cut = truncated_png(tmp_path)
    answer = question_then_answer(handlers.add_chat_message, 3, handlers.respond, cleared=2, placeholder="Ask")
    sent = {"text": "What is on this page?", "files": [cut]}
    updates = list(answer(sent, red_image, [], *settings_values(manager)))
    box, camera = updates[0][1:]
    assert box == {"__type__": "update", "value": None, "placeholder": "Ask", "submit_btn": False, "stop_btn": True}
    assert camera is None  # cleared as it was sent
    history = last_history(updates)
    assert [m["content"] for m in history[:-1]] == [{"path": cut}, {"path": red_image}, "What is on this page?"]
    assert is_error(history[-1]) and "could not be read" in history[-1]["content"]
    _, box, camera = updates[-1]
    assert box["value"] == sent and (box["submit_btn"], box["stop_btn"]) == (True, False) and camera == red_image

    updates = list(answer({"text": "And now?", "files": [red_image]}, None, history, *settings_values(manager)))
    history = last_history(updates)
    assert history[-1]["metadata"]["title"].startswith("640 visual tokens")
    _, box, camera = updates[-1]
    assert "value" not in box and (box["submit_btn"], box["stop_btn"]) == (True, False) and isinstance(camera, SKIP)
    # The failed turn is on the page, not in what the model was asked.
    assert [part["type"] for m in history_to_messages(history) for part in m["content"]] == ["image", "text", "text"]

    ask_multi = question_then_answer(handlers.add_multi_image_question, 3, handlers.respond, cleared=1, placeholder="Ask")
    updates = list(ask_multi("Compare them.", [cut, red_image], [], *settings_values(manager)))
    assert is_error(last_history(updates)[-1]) and updates[-1][1]["value"] == "Compare them."


def test_a_question_refused_before_it_is_asked_is_explained_in_the_chat_and_stays_in_its_box(
        handlers, manager, red_image, tmp_path):
    """A file that is no image is refused before the engine sees it: the turn and its reason are in the chat
    (no toast), the conversation before it is as it was, the question is back in its box. Raised instead,
    Gradio covered the chat and the box with "Error" boxes. An empty question is no turn: the box says so."""
    answer = question_then_answer(handlers.add_chat_message, 3, handlers.respond, cleared=2, placeholder="Ask")
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    fake = tmp_path / "notimage.png"
    fake.write_text("just some text")
    sent = {"text": "What is this?", "files": [str(fake)]}
    updates = list(answer(sent, red_image, earlier, *settings_values(manager)))
    assert len(updates) == 1
    history, box, camera = updates[0]
    assert history[:2] == earlier and [m["content"] for m in history[2:5]] == [plain_file(str(fake)), {"path": red_image},
                                                                               "What is this?"]
    assert is_error(history[-1]) and "could not be read as an image" in history[-1]["content"] and len(history) == 6
    assert box == {**sent, "files": [plain_file(str(fake))["file"]]} and camera == red_image
    assert history_to_messages(history) == history_to_messages(earlier)

    updates = list(answer({"text": "  ", "files": []}, None, earlier, *settings_values(manager)))
    assert len(updates) == 1
    history, box, camera = updates[0]
    assert isinstance(history, SKIP) and isinstance(camera, SKIP)
    assert box == {"__type__": "update", "placeholder": "⚠️ Type a question or attach an image first.",
                   "value": {"text": "", "files": []}}  # its spaces gone, so that the placeholder shows

    ask_video = question_then_answer(handlers.add_video_question, 3, handlers.respond, cleared=1, placeholder="Ask")
    history, box = list(ask_video("What happens?", None, [], *settings_values(manager)))[0]
    assert [m["content"] for m in history] == ["What happens?", "Upload a video first."] and is_error(history[-1])
    assert box == "What happens?"
    _, box = list(ask_video(" ", None, [], *settings_values(manager)))[0]
    assert box["placeholder"] == "⚠️ Upload a video first." and box["value"] == ""


def test_an_image_whose_upload_expired_is_explained(handlers, manager, tmp_path):
    """Uploads are deleted after a while (app.web.uploads): a follow-up about a conversation whose image has
    gone says so, rather than calling it a file that was never uploaded."""
    gone = str(tmp_path / "expired.png")
    history = [{"role": "user", "content": {"path": gone}}, {"role": "user", "content": "And now?"}]
    _, final = run(handlers, manager, history)
    assert "“expired.png” is no longer on the server" in final[-1]["content"]


def test_a_failed_turn_stays_under_its_reason_and_out_of_the_conversation(handlers, manager, red_image, tmp_path):
    _, good = run(handlers, manager, [{"role": "user", "content": {"path": red_image}}, {"role": "user", "content": "Hi"}])
    broken = tmp_path / "vanished.png"
    broken.write_bytes(b"garbage")
    history = good + [{"role": "user", "content": {"path": str(broken)}}, {"role": "user", "content": "And this?"}]
    _, final = run(handlers, manager, history)
    assert final[: len(history)] == history  # the earlier conversation and the failed turn are intact
    assert is_error(final[-1]) and len(final) == len(history) + 1
    follow_up = final + [{"role": "user", "content": "Next question"}]
    asked = history_to_messages(follow_up)
    assert asked[:-1] == history_to_messages(good) and asked[-1]["content"] == [{"type": "text", "text": "Next question"}]
    _, after = run(handlers, manager, follow_up)
    assert after[-1]["metadata"]["title"].startswith("640 visual tokens")  # the conversation goes on
    retried = handlers.retry(final, gr.RetryData(None, {"index": len(history) - 1, "value": "And this?"}))
    assert retried == history  # Retry sends the failed turn again
    _, again = run(handlers, manager, retried)
    assert is_error(again[-1]) and again[:-1] == history


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
    # Undo gives the box its question back; the images stay in the gallery, and go with the next first question.
    undone = len(history) - 1
    kept, box = handlers.undo_question(history, gr.UndoData(None, {"index": undone, "value": "And now?"}))
    assert kept == history[:undone] and box == "And now?"
    kept, box = handlers.undo_question(kept, gr.UndoData(None, {"index": 3, "value": "What changed?"}))
    assert kept == [] and box == "What changed?"
    assert handlers.add_multi_image_question(box, moved, kept)[0] == history[:4]
    history, box = handlers.add_multi_image_question("Hi", [], [])
    assert is_error(history[-1]) and history[-1]["content"] == "Add at least one image to the gallery first." and box == "Hi"
    with pytest.raises(gr.Error, match="Add at least one image"):
        handlers.add_multi_image_question(" ", [], [])


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


def test_stop_ends_a_reply_with_what_it_said_marked_stopped_and_its_stats(handlers, manager):
    """Stop ends the reply through its own handler (app.ui.cancellable.StopControl): the text so far stays,
    reasoning it cut off is closed, and the stats line says it was stopped, with the tokens it had."""
    for thinking in (False, True):
        stop, updates = StopSignal(), []
        history = [{"role": "user", "content": "Tell me a very long story."}]
        settings = ui_settings(manager, max_new_tokens=4000, min_new_tokens=4000, do_sample=False, enable_thinking=thinking)
        for update in handlers.respond(history, settings, stop=stop):
            updates.append([dict(message) for message in update])
            if len(updates) == 3:
                stop.set()
        reply, stats = updates[-1][-2], updates[-1][-1]
        assert reply["content"].startswith(updates[2][-1]["content"][:20]) and reply["content"]
        assert stats["metadata"]["title"].startswith("■ Stopped · ")
        new_tokens = int(stats["metadata"]["title"].split(" new tokens")[0].rsplit(" ", 1)[-1])
        assert 0 < new_tokens < 4000
        if thinking:  # reasoning cut off would show as still thinking on the page
            assert reply["content"].startswith("<think>")
            assert reply["content"].rfind("</think>") > reply["content"].rfind("<think>")
    assert wait_for(lambda: manager.active_generations == 0, 30)


def test_a_reply_stopped_before_its_first_word_is_marked_stopped(handlers, manager):
    stop = StopSignal()
    stop.set()
    history = [{"role": "user", "content": "Hi"}]
    final = list(handlers.respond(history, ui_settings(manager), stop=stop))[-1]
    assert final == history + [{"role": "assistant", "content": "", "metadata": {"title": "■ Stopped", "status": "done"}}]
    assert history_to_messages(final) == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


class SteadyStream:
    """A manager whose replies grow by `step` characters every `every_s` seconds of `clock`, for `updates`
    updates, then end with stats: the engine's stream as respond sees it, on a clock the test turns."""

    def __init__(self, manager, step: int, every_s: float, updates: int):
        self.real, self.step, self.every_s, self.updates, self.now = manager, step, every_s, updates, 0.0

    def default_settings(self):
        return self.real.default_settings()

    def clock(self) -> float:
        return self.now

    def stream(self, messages, settings, stop=None):
        from app.engine.api import ReplyUpdate

        for n in range(1, self.updates + 1):
            self.now += self.every_s
            yield ReplyUpdate(text="word " * (self.step * n // 5))
        stats = {"visual_tokens": 0, "image_tokens": [], "video_tokens": None, "video_frames": 0, "prompt_tokens": 9,
                 "new_tokens": self.updates, "ttft_ms": 50.0, "preprocess_ms": 1.0, "queue_ms": 0.0,
                 "tokens_per_s": 100.0, "total_ms": 1000.0}
        yield ReplyUpdate(text="word " * (self.step * self.updates // 5), stats=stats)


def test_a_long_reply_reaches_the_page_in_fewer_larger_updates(manager):
    """The page renders a reply's whole Markdown at every update: a short reply shows every update the engine
    sends (every 50 ms), a long one fewer as it grows (at most one a second), and its last in full."""
    history = [{"role": "user", "content": "Go."}]
    short = SteadyStream(manager, step=10, every_s=0.05, updates=100)  # 1,000 characters in 5 s
    shown = list(Handlers(short, clock=short.clock).respond(history, {}))
    assert len(shown) == 101  # every update, and the last with its stats
    long = SteadyStream(manager, step=100, every_s=0.05, updates=600)  # 60,000 characters in 30 s
    shown = [list(update) for update in Handlers(long, clock=long.clock).respond(history, {})]
    # Every update up to 1,250 characters, then further apart, one a second past 25,000: 62 of 601.
    assert 40 <= len(shown) <= 80, len(shown)
    assert shown[-1][-2]["content"] == "word " * 12000 and shown[-1][-1]["metadata"]["title"]


def test_the_stats_say_what_the_conversation_kept():
    stats = {"tokens_per_s": 50.0, "visual_tokens": 640, "ttft_ms": 18.0, "new_tokens": 8, "prompt_tokens": 798,
             "image_tokens": [640], "video_frames": 0, "video_tokens": 0, "preprocess_ms": 2.0, "queue_ms": 0.3,
             "total_ms": 30.0}
    assert "| Prompt | 798 tokens |\n| Kept from the conversation | 686 tokens, not read again |" in \
        stats_message({**stats, "reused_prompt_tokens": 686}, [])["content"]
    assert "Kept" not in stats_message({**stats, "reused_prompt_tokens": 0}, [])["content"]
    assert "Kept" not in stats_message(stats, [])["content"]  # an external server's
    assert "| Images kept encoded | 640 tokens, not encoded again |" in \
        stats_message({**stats, "reused_prompt_tokens": 0, "reused_image_tokens": 640}, [])["content"]
