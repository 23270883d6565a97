"""The documented /ask endpoint, driven by gradio_client against the live app with the tiny model."""

import contextlib
import io
import os
import re
import time

import pytest
from gradio_client import handle_file
from gradio_client.exceptions import AppError

from benchmarks.streaming_client import streamed_outputs
from tests.conftest import make_image, make_video

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIXED = {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False}


def stream(client, text, files=(), settings=None):
    job = client.submit(text, [handle_file(path) for path in files], settings or {}, api_name="/ask")
    updates = list(streamed_outputs(job))
    return updates, job.result()  # raises AppError when the app refused the request


def test_streamed_image_answer(client, red_image):
    # Long enough to span several stream intervals (tokens that arrive together go out as one update).
    long = {**FIXED, "max_new_tokens": 64, "min_new_tokens": 64}
    updates, (reply, stats) = stream(client, "What is in this picture?", [red_image], long)
    assert len(updates) >= 3  # several updates arrived before the end
    assert stats["done"] and stats["visual_tokens"] == 640 and stats["image_tokens"] == [640]
    assert stats["new_tokens"] == 64 and stats["ttft_ms"] > 0 and stats["tokens_per_s"] > 0
    assert 0 <= stats["first_token_delivery_ms"] < stats["ttft_ms"]
    assert time.time() - 60 < stats["requested_at"] <= time.time()
    assert stats["requested_at"] - 1 < stats["handler_started_at"] <= stats["requested_at"]  # the handler, then the engine
    assert reply and updates[0][0] != reply  # the reply grew


def test_the_readme_scripting_example_runs_as_written(server_url, monkeypatch):
    with open(os.path.join(ROOT, "README.md")) as file:
        section = file.read().split("## Scripting API", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    monkeypatch.chdir(ROOT)  # the example's image path is relative to the repository
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(example.replace("http://127.0.0.1:7860/", server_url), {})
    lines = printed.getvalue().splitlines()
    assert len(lines) >= 3  # streamed replies, the final stats, the follow-up's answer
    assert "'visual_tokens'" in printed.getvalue() and "'ttft_ms'" in printed.getvalue()


def test_the_api_page_names_asks_inputs_and_a_call_by_name_runs(client, red_image):
    info = client.view_api(return_format="dict", print_info=False)
    assert [p["parameter_name"] for p in info["named_endpoints"]["/ask"]["parameters"]] == ["text", "files", "settings"]
    _, stats = client.predict(text="What is this?", files=[handle_file(red_image)], settings={"max_new_tokens": 2},
                              api_name="/ask")
    assert stats["new_tokens"] == 2 and stats["visual_tokens"] == 640


def test_several_images_keep_their_order_and_cost(client, tmp_path):
    paths = [make_image(tmp_path, "a.png"), make_image(tmp_path, "b.png", (448, 448)),
             make_image(tmp_path, "c.png", (1920, 1080))]
    _, (_, stats) = stream(client, "Compare these.", paths, FIXED)
    assert stats["image_tokens"] == [640, 64, 578]
    assert stats["visual_tokens"] == 640 + 64 + 578


def test_budget_lowers_slices_and_says_so(client, tmp_path):
    paths = [make_image(tmp_path, f"{i}.png") for i in range(5)]
    _, (_, stats) = stream(client, "Compare these.", paths, FIXED)
    assert stats["image_tokens"] == [484] * 5
    assert any("lowered from 9 to 7" in notice for notice in stats["notices"])


def test_video(client, tmp_path):
    path = make_video(tmp_path, seconds=6, fps=12, size=(448, 448))
    _, (_, stats) = stream(client, "What happens?", [path], {**FIXED, "video_fps": 1, "video_max_frames": 4})
    assert stats["video_frames"] == 4 and stats["video_tokens"] == 4 * 64 and stats["visual_tokens"] == 256


def test_follow_up_keeps_the_image_in_the_conversation(client, red_image):
    _, (first, first_stats) = stream(client, "What colour is it?", [red_image], FIXED)
    _, (_, stats) = stream(client, "Are you sure?", [], {**FIXED, "follow_up": True})
    assert stats["visual_tokens"] == 640  # the image of the first turn is still in the prompt
    assert stats["prompt_tokens"] > first_stats["prompt_tokens"] + first_stats["new_tokens"]
    _, (_, fresh) = stream(client, "Are you sure?", [], FIXED)  # without follow_up: a new conversation
    assert fresh["visual_tokens"] == 0
    assert not any("follow_up" in notice for notice in stats["notices"] + fresh["notices"])


def test_a_follow_up_with_nothing_before_it_starts_a_conversation_and_says_so(client):
    _, (_, stats) = stream(client, "And then?", [], {**FIXED, "follow_up": True})
    assert stats["notices"][0] == "follow_up: this client had no earlier /ask conversation to go on with, so this " \
                                  "question starts one."


@pytest.mark.parametrize("name, content, message", [
    ("broken.jpg", b"\x00\x01 definitely not a jpeg", "could not be read as an image"),
    ("empty.png", b"", "could not be read as an image"),
    ("notes.mp4", b"plain text, not a video", "could not be decoded"),
    ("script.sh", b"echo hi", "not a supported file"),
])
def test_bad_file_then_good_request(client, tmp_path, red_image, name, content, message):
    bad = tmp_path / name
    bad.write_bytes(content)
    with pytest.raises(AppError, match=message):
        stream(client, "What is this?", [str(bad)], FIXED)
    _, (_, stats) = stream(client, "What is this?", [red_image], FIXED)
    assert stats["visual_tokens"] == 640


@pytest.mark.parametrize("settings, message", [
    ({"temperature": -1}, "temperature"), ({"max_slice_nums": 37}, "max_slice_nums"), ({"colour": "red"}, "Unknown setting"),
])
def test_bad_settings_are_refused(client, settings, message):
    with pytest.raises(AppError, match=message):
        stream(client, "Hello", [], settings)


def test_an_unknown_settings_refusal_lists_follow_up_among_the_known(client):
    """/ask reads follow_up itself: the list of known settings a refusal gives still names it."""
    with pytest.raises(AppError, match="Unknown setting “colour”") as refused:
        stream(client, "Hello", [], {"colour": "red"})
    known = str(refused.value).split("Known settings: ")[1].rstrip(".").split(", ")
    assert "follow_up" in known and "max_new_tokens" in known and known == sorted(known)


@pytest.mark.parametrize("files, what", [("photo.png", "it was a string"), ({"name": "photo.png"}, "it was an object"),
                                         (7, "it was a number"), ([None], "its item 0 was null"),
                                         ([{"path": "x.png"}], "its item 0 is no file as handle_file makes one")])
def test_files_that_are_not_a_list_of_files_are_refused_with_a_message(server_url, files, what):
    """Over raw HTTP, as a script would send them: Gradio's own check answered {"error": null}."""
    from gradio.utils import get_upload_folder

    if files == [{"path": "x.png"}]:  # an upload's path (no matter that it has gone) without its "meta"
        files = [{"path": os.path.join(get_upload_folder(), "x.png")}]

    said = raw_ask(server_url, ["Hello", files, None])
    assert "event: error" in said and "files must be a list of uploaded files" in said and what in said, said


@pytest.mark.parametrize("data", [[], ["Hello"], ["Hello", None]])
def test_too_few_values_are_refused_with_a_message(server_url, data):
    """Gradio's own check of the count answered {"error": null}."""
    said = raw_ask(server_url, data)
    assert "event: error" in said and "Too few values: this call takes 3 (text, files, settings)." in said, said


@pytest.mark.parametrize("route", ["gradio_api/run/ask", "gradio_api/api/ask"])
def test_direct_calls_that_would_skip_the_queue_are_refused(server_url, client, route):
    """Gradio's direct routes ran a queued event outside the queue: past its bound and concurrency limits."""
    import httpx

    answer = httpx.post(server_url + route, json={"data": ["Hello", None, None, None]}, timeout=30)
    assert answer.status_code == 404 and "join the queue" in answer.text, answer.text
    _, (_, stats) = stream(client, "Hello", [], FIXED)
    assert stats["new_tokens"] == FIXED["max_new_tokens"]


def test_a_queue_join_without_the_state_value_a_lone_surrogate_in_a_setting_name_and_wrong_page_values(server_url):
    """As a page or a script joins Gradio's queue. /ask's State input needs no value there (as on /call/ask); an
    unknown setting's name is quoted with its lone surrogate as "?" (the session's event stream broke off on it);
    a page event's values that its components cannot take are refused by name ({"error": null} before)."""
    import httpx

    config = httpx.get(server_url + "config", timeout=30).json()
    events = {dependency["api_name"]: index for index, dependency in enumerate(config["dependencies"])}
    assert joined(server_url, events["ask"], ["Hello", None, FIXED])["data"][1]["done"]
    said = joined(server_url, events["ask"], ["Hello", None, {"a\ud800b": 1}])
    assert said["error"].startswith("Unknown setting “a?b”."), said
    page_event = config["dependencies"][events["added_then_answered"]]
    components = {component["id"]: component for component in config["components"]}
    values = [components[block]["props"].get("value") for block in page_event["inputs"]]
    values[0] = {"text": "Hello", "files": []}
    for label, wrong in (("Max new tokens", "abc"), ("Chat", "notalist")):
        sent = [wrong if components[block]["props"].get("label") == label else value
                for block, value in zip(page_event["inputs"], values)]
        said = joined(server_url, events["added_then_answered"], sent)
        assert said["error"] == f"{label} cannot take the value {wrong!r}.", said


def joined(server_url: str, fn_index: int, data: list) -> dict:
    """Join Gradio's queue as the page does: the event's output (its data, or its error)."""
    import json
    import uuid

    import httpx

    session = uuid.uuid4().hex
    with httpx.Client(base_url=server_url, timeout=60) as http:
        body = json.dumps({"data": data, "fn_index": fn_index, "session_hash": session})  # a lone surrogate escaped
        http.post("gradio_api/queue/join", content=body, headers={"Content-Type": "application/json"})
        with http.stream("GET", f"gradio_api/queue/data?session_hash={session}") as stream_:
            for line in stream_.iter_lines():
                message = json.loads(line[len("data: "):]) if line.startswith("data: ") else {}
                if message.get("msg") == "process_completed":
                    return message["output"]
    raise AssertionError("the event stream ended without the event's output")


def raw_ask(server_url: str, data: list) -> str:
    """/ask over raw HTTP, as a script would call it: what its event stream said."""
    import httpx

    call = server_url + "gradio_api/call/ask"
    event = httpx.post(call, json={"data": data}, timeout=30).json()["event_id"]
    with httpx.stream("GET", f"{call}/{event}", timeout=60) as events:
        return "".join(events.iter_text())


def test_empty_request_is_refused(client):
    with pytest.raises(AppError, match="Type a question"):
        stream(client, "   ", [], {})


def test_cancel_stops_generate_itself(client, manager, red_image):
    job = client.submit("Describe it at length.", [handle_file(red_image)],
                        {"max_new_tokens": 4000, "min_new_tokens": 4000}, api_name="/ask")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(job.outputs()) >= 3 and manager.active_generations == 1
    job.cancel()
    deadline = time.monotonic() + 10
    while manager.active_generations and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.active_generations == 0  # it left the running batch, long before 4000 tokens
    _, (_, stats) = stream(client, "Still there?", [], FIXED)
    assert stats["new_tokens"] == 24


def test_an_event_the_app_does_not_have_is_404_with_a_message(server_url, client):
    """Gradio had answered 500 and logged a traceback; the app goes on serving."""
    import httpx

    from app.messages import MSG_UNKNOWN_EVENT

    unknown_name = httpx.post(server_url + "gradio_api/call/no_such_event", json={"data": []}, timeout=30)
    unknown_index = httpx.post(server_url + "gradio_api/queue/join", timeout=30,
                               json={"data": [], "fn_index": 99999, "session_hash": "unknown-event-test"})
    for answer in (unknown_name, unknown_index):
        assert answer.status_code == 404 and answer.json() == {"detail": MSG_UNKNOWN_EVENT}
    reply, stats = stream(client, "Still there?", [], FIXED)[1]
    assert reply.strip() and stats["done"]
