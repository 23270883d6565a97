"""The OpenAI-compatible API (/v1) of the live app with the tiny model, driven by the official `openai` client:
replies are the engine's own (token for token what the manager streams), with images, videos, reasoning and
usage; bad input gets OpenAI's error shape with the UI's messages; a client that leaves takes its request
out of the batch."""

import base64
import json
import mimetypes
import os
import re
import shutil
import subprocess
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from app import limits
from app.engine.api import ReplyUpdate
from app.messages import MSG_API_NOT_READY, MSG_EMPTY_REQUEST, MSG_IMAGE_TOO_THIN, MSG_TOO_MANY_IMAGES, MSG_UNREADABLE_IMAGE
from tests.conftest import ROOT, make_image, make_video, wait_for
from tests.test_batching import metric
from tests.test_engine_process import answers_at_once, reply
from tests.test_switch import switchable  # noqa: F401 (the fixture, shared)

GREEDY = {"max_tokens": 24, "temperature": 0}
EXACT = {"min_tokens": 24}  # sent in extra_body: not a parameter of OpenAI's own client


def data_url(path: str) -> str:
    media_type = mimetypes.guess_type(path)[0]
    with open(path, "rb") as file:
        return f"data:{media_type};base64,{base64.b64encode(file.read()).decode()}"


def image(path: str) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(path)}}


def said(text: str, *parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def api(server_url) -> OpenAI:
    return OpenAI(base_url=server_url + "v1", api_key="not-needed-on-loopback", max_retries=0)


def direct(manager, messages: list[dict], **settings) -> ReplyUpdate:
    """The reply the manager streams itself, from the settings the API starts from (the model's)."""
    base = {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False}
    return reply(manager, messages, manager.default_settings().with_overrides({**base, **settings}))


def ask(api: OpenAI, messages: list[dict], **parameters):
    extra = {key: parameters.pop(key) for key in list(parameters) if key not in ("max_tokens", "temperature", "seed", "stop",
                                                                             "stream", "stream_options", "top_p")}
    return api.chat.completions.create(model="tiny-random", messages=messages, **{**GREEDY, **parameters},
                                       extra_body={**EXACT, **extra})


def streamed(api: OpenAI, messages: list[dict], **parameters) -> tuple[list, str, str]:
    """(the chunks, the answer and the reasoning they add up to) of a streamed reply."""
    chunks = list(ask(api, messages, stream=True, stream_options={"include_usage": True}, **parameters))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    answer = "".join(delta.content or "" for delta in deltas)
    reasoning = "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas)
    return chunks, answer, reasoning


def test_the_model_is_listed(api):
    models = api.models.list().data
    assert [model.id for model in models] == ["tiny-random"] and models[0].object == "model"
    assert api.models.retrieve("tiny-random").id == "tiny-random"
    with pytest.raises(openai.NotFoundError, match="“openbmb/other” is not served here"):
        api.models.retrieve("openbmb/other")


def test_a_reply_is_the_engines_own_whole_or_streamed(api, manager):
    messages = said("Tell me about lighthouses.")
    expected = direct(manager, [{"role": "user", "content": [{"type": "text", "text": "Tell me about lighthouses."}]}])
    whole = ask(api, messages)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.stats["prompt_tokens"], 24)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24 and whole.usage.visual_tokens == 0
    chunks, answer, _ = streamed(api, messages)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert answer == expected.text and len(chunks) >= 4  # the role, pieces of the answer, the end, the usage
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 24
    assert all(chunk.usage is None for chunk in chunks[:-1])
    without_usage = list(ask(api, messages, stream=True))
    assert all(chunk.choices and chunk.usage is None for chunk in without_usage)


def test_an_image_two_images_and_one_in_an_earlier_turn(api, manager, tmp_path):
    red, blue = make_image(tmp_path, "red.png"), make_image(tmp_path, "blue.jpg", (640, 480), (20, 40, 220))
    one = ask(api, said("What is this?", image(red)))
    expected = direct(manager, [{"role": "user", "content": [{"type": "image", "path": red}, {"type": "text", "text": "What is this?"}]}])
    assert one.choices[0].message.content == expected.text and one.usage.visual_tokens == 640 == expected.stats["visual_tokens"]
    two = ask(api, said("Compare them.", image(red), image(blue)))
    swapped = ask(api, said("Compare them.", image(blue), image(red)))
    assert two.usage.visual_tokens == swapped.usage.visual_tokens == 640 + direct(
        manager, [{"role": "user", "content": [{"type": "image", "path": blue}, {"type": "text", "text": "?"}]}]).stats["visual_tokens"]
    assert two.choices[0].message.content != swapped.choices[0].message.content  # in the order sent
    follow_up = said("What is this?", image(red)) + [{"role": "assistant", "content": one.choices[0].message.content},
                                                      {"role": "user", "content": "And its colour?"}]
    assert ask(api, follow_up).usage.visual_tokens == 640  # the first turn's image is still in the prompt


def test_a_video_is_sampled_by_the_apps_own_sampler(api, manager, tmp_path):
    video = make_video(tmp_path, seconds=4, fps=8)
    part = {"type": "video_url", "video_url": {"url": data_url(video)}}
    answer = ask(api, said("What happens?", part), video_max_frames=3)
    expected = direct(manager, [{"role": "user", "content": [{"type": "video", "path": video},
                                                             {"type": "text", "text": "What happens?"}]}], video_max_frames=3)
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.visual_tokens == expected.stats["visual_tokens"] > 0 and expected.stats["video_frames"] == 3


def test_a_system_message_is_kept(api, manager):
    system = {"role": "system", "content": "You answer in rhymes."}
    answer = ask(api, [system] + said("Hello"))
    expected = direct(manager, [{"role": "system", "content": [{"type": "text", "text": "You answer in rhymes."}]},
                                {"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == expected.stats["prompt_tokens"] > ask(api, said("Hello")).usage.prompt_tokens


def test_reasoning_comes_apart_from_the_answer(api, manager):
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    expected = direct(manager, [{"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]}],
                      enable_thinking=True)
    assert expected.opens_thinking and "</think>" not in expected.text  # the tiny model never ends its reasoning
    whole = ask(api, said("Why is the sky blue?"), **thinking)
    assert whole.choices[0].message.reasoning_content == expected.text and whole.choices[0].message.content == ""
    chunks, answer, reasoning = streamed(api, said("Why is the sky blue?"), **thinking)
    assert reasoning == expected.text and answer == ""
    assert ask(api, said("Why is the sky blue?")).choices[0].message.reasoning_content is None  # off: the 4.6 default


def test_a_stop_text_ends_the_reply_before_it_and_the_request_leaves(api, manager):
    full = ask(api, said("Count."), max_tokens=60, min_tokens=60).choices[0].message.content
    stop = full[20:24]
    expected = full[:full.index(stop)]
    answer = ask(api, said("Count."), max_tokens=60, min_tokens=0, stop=[stop, "never in it \u2603"])
    assert answer.choices[0].message.content == expected and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens < 60
    _, streamed_answer, _ = streamed(api, said("Count."), max_tokens=60, min_tokens=0, stop=stop)
    assert streamed_answer == expected  # nothing of the stop text was sent before it was whole
    assert wait_for(lambda: manager.active_generations == 0, 5)


def test_a_seed_repeats_a_sampled_reply_even_beside_another(api):
    sampled = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 20, "min_tokens": 20}
    first = ask(api, said("Surprise me."), seed=1234, **sampled).choices[0].message.content
    assert ask(api, said("Surprise me."), seed=1234, **sampled).choices[0].message.content == first
    assert ask(api, said("Surprise me."), seed=4321, **sampled).choices[0].message.content != first
    with ask(api, said("Keep going."), stream=True, max_tokens=2000, min_tokens=2000) as neighbour:
        next(iter(neighbour))
        assert ask(api, said("Surprise me."), seed=1234, **sampled).choices[0].message.content == first


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "never fetches a link"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "never fetches a link"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "valid base64"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}], "must hold base64"),
    ([{"type": "image_url", "image_url": {"url": "data:application/pdf;base64,JVBERi0="}}], "not a supported image type"),
    ([{"type": "video_url", "video_url": {"url": "data:image/png;base64,iVBO"}}], "not a supported video type"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}],
     MSG_UNREADABLE_IMAGE.format(name="messages-0-content-0.png")),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "not a part this server reads"),
])
def test_bad_media_gets_a_clear_400(api, content, message):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(api, [{"role": "user", "content": content + [{"type": "text", "text": "What is it?"}]}])
    error = refused.value.body
    assert refused.value.status_code == 400 and message in error["message"] and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_media_limits_are_the_uis(api, tmp_path):
    thin = image(make_image(tmp_path, "thin.png", (2, 400)))
    with pytest.raises(openai.BadRequestError, match=re.escape(MSG_IMAGE_TOO_THIN.format(
            name="messages-0-content-0.png", width=2, height=400, limit=limits.MAX_IMAGE_ASPECT_RATIO))):
        ask(api, said("Thin?", thin))
    many = [image(make_image(tmp_path, "small.png", (64, 64)))] * (limits.MAX_IMAGES_PER_REQUEST + 1)
    with pytest.raises(openai.BadRequestError, match=re.escape(MSG_TOO_MANY_IMAGES.format(
            count=limits.MAX_IMAGES_PER_REQUEST + 1, limit=limits.MAX_IMAGES_PER_REQUEST))):
        ask(api, said("So many?", *many))


@pytest.mark.parametrize("parameters, message", [
    ({"frobnicate": 1, "zeal": 2}, "Unknown field(s) “frobnicate”, “zeal”"),
    ({"n": 2}, "“n” can only be 1"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "calls no tools"),
    ({"logprobs": True}, "“logprobs” can only be false"),
    ({"max_tokens": 0}, "Setting “max_tokens”: must be between 1 and"),
    ({"max_tokens": limits.MAX_NEW_TOKENS_LIMIT + 1}, "Setting “max_tokens”: must be between 1 and"),
    ({"max_tokens": 10, "max_completion_tokens": 12}, "differ"),
    ({"max_tokens": [10]}, "“max_tokens” must be an integer"),
    ({"max_completion_tokens": {"n": 10}}, "“max_completion_tokens” must be an integer"),
    ({"max_tokens": 10.5}, "“max_tokens” must be an integer"),
    ({"max_tokens": True}, "“max_tokens” must be an integer"),
    ({"temperature": "warm"}, "“temperature” must be a number"),
    ({"temperature": -1}, "Setting “temperature”: must be between 0.0 and 5.0, got -1"),
    ({"top_p": 0}, "Setting “top_p”: must be above 0"),
    ({"min_tokens": 30, "max_tokens": 20}, "Setting “min_tokens”: must be between 0 and 20"),
    ({"downsample_mode": "8x"}, "Setting “downsample_mode”: must be one of 16x, 4x"),
    ({"max_slice_nums": 99}, "Setting “max_slice_nums”"),
    ({"stop": [""]}, "Setting “stop”: each text is 1 to"),
    ({"seed": "abc"}, "Setting “seed”: expected a whole number"),
    ({"chat_template_kwargs": {"enable_thinking": True, "tools": []}}, "“chat_template_kwargs.tools”"),
    ({"chat_template_kwargs": {"enable_thinking": "maybe"}}, "“chat_template_kwargs.enable_thinking”: expected true or false"),
    ({"stream_options": {"continuous_usage_stats": True}}, "“stream_options.continuous_usage_stats”"),
])
def test_bad_parameters_are_refused_with_their_names(api, parameters, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        ask(api, said("Hello"), **parameters)


@pytest.mark.parametrize("messages, message", [
    ([], "“messages” must be a list"),
    ([{"role": "assistant", "content": "Hi."}], "The last message must be the user's"),
    ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], "The last message must be the user's"),
    ([{"role": "user", "content": "Hi."}, {"role": "system", "content": "Late."}, {"role": "user", "content": "?"}],
     "messages[1]: system messages come first"),
    ([{"role": "tool", "content": "42", "tool_call_id": "x"}, {"role": "user", "content": "?"}], "calls no tools"),
    ([{"role": "wizard", "content": "Hi."}], "messages[0] must be an object with a “role”"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]},
      {"role": "user", "content": "?"}], "a system message holds text only"),
    ([{"role": "user", "content": "x" * (limits.MAX_PROMPT_CHARS + 1)}], "characters; the limit is"),
    ([{"role": "user", "content": "  "}], MSG_EMPTY_REQUEST),
    ([{"role": "user", "content": []}], MSG_EMPTY_REQUEST),
])
def test_bad_conversations_are_refused_clearly(api, messages, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        api.chat.completions.create(model="tiny-random", messages=messages, max_tokens=4)


def files_in_the_upload_folder() -> set[str]:
    from gradio.utils import get_upload_folder

    return {os.path.join(root, name) for root, _, names in os.walk(get_upload_folder()) for name in names}


def test_other_models_paths_and_bodies_get_openais_error_shape(api, server_url, monkeypatch):
    with pytest.raises(openai.NotFoundError, match="“gpt-4o” is not served here; this server serves “tiny-random”"):
        api.chat.completions.create(model="gpt-4o", messages=said("Hi"))
    base = server_url + "v1"
    for method, path in (("GET", "/embeddings"), ("POST", "/completions"), ("GET", "/chat/completions")):
        response = httpx.request(method, base + path, timeout=30)
        assert response.status_code == 404 and "is not an endpoint" in response.json()["error"]["message"], path
    response = httpx.post(base + "/chat/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and "must be a JSON object" in response.json()["error"]["message"]
    response = httpx.post(base + "/chat/completions", json=[1, 2], timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"].endswith("(got list).")
    lone_surrogate = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'  # JSON carries it, no tokenizer takes it
    response = httpx.post(base + "/chat/completions", content=lone_surrogate, timeout=30)
    assert response.status_code == 400 and "not valid text" in response.json()["error"]["message"]
    for repeated in (b'{"model": "x\\ud800", "messages": []}', b'{"zeal\\ud800": 1, "messages": []}'):
        response = httpx.post(base + "/chat/completions", content=repeated, timeout=30)  # its error repeats it
        assert response.status_code in (400, 404) and "\ud800" in response.json()["error"]["message"]
    many = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * (limits.MAX_API_MEDIA_PER_REQUEST + 1)
    uploads = files_in_the_upload_folder()
    response = httpx.post(base + "/chat/completions", json={"messages": [{"role": "user", "content": many}]}, timeout=30)
    assert response.status_code == 400 and "65 images and videos; the limit is 64" in response.json()["error"]["message"]
    assert files_in_the_upload_folder() <= uploads  # refused before any was stored
    monkeypatch.setattr(limits, "MAX_API_REQUEST_MB", 1)
    big = json.dumps({"model": "tiny-random", "messages": said("x" * (2 * 2**20))})
    response = httpx.post(base + "/chat/completions", content=big, timeout=30)
    assert response.status_code == 413 and "over 1 MB" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert ask(api, said("Still serving?"), max_tokens=3, min_tokens=3).usage.completion_tokens == 3


def test_a_client_that_leaves_takes_its_request_out_of_the_batch(api, manager, server_url):
    stopped = manager.metrics.snapshot()["requests"]["stopped"]
    stream = ask(api, said("Go on and on."), stream=True, max_tokens=4000, min_tokens=4000)
    pieces = iter(stream)
    for _ in range(4):
        next(pieces)
    assert metric(server_url, "minicpmv_batch_size") == 1
    stream.close()
    assert wait_for(lambda: metric(server_url, "minicpmv_batch_size") == 0, 10)  # long before 4000 tokens
    # A client waiting for a whole completion that gives up leaves too.
    with pytest.raises(openai.APITimeoutError):
        api.with_options(timeout=2).chat.completions.create(model="tiny-random", messages=said("And on."),
                                                            max_tokens=4000, extra_body={"min_tokens": 4000})
    assert wait_for(lambda: metric(server_url, "minicpmv_batch_size") == 0, 10)
    assert manager.metrics.snapshot()["requests"]["stopped"] == stopped + 2


def test_16_clients_at_once_are_batched_and_each_gets_its_own_reply(api, manager, tmp_path):
    questions = {key: said(f"User {key}: what is in picture {key}?", image(make_image(
        tmp_path, f"user{key}.png", (64 + 37 * key, 300), (10 * key, 255 - 9 * key, 90)))) for key in range(16)}
    alone = {key: ask(api, questions[key]).choices[0].message.content for key in (0, 7, 15)}
    steps = manager.metrics.snapshot()["decode_steps"]
    together = answers_at_once(lambda key: ask(api, questions[key]), questions)
    steps = manager.metrics.snapshot()["decode_steps"] - steps
    assert all(answer.usage.completion_tokens == 24 for answer in together.values())
    assert {key: together[key].choices[0].message.content for key in alone} == alone
    assert len({answer.choices[0].message.content for answer in together.values()}) > 8
    assert steps < 16 * 24 / 2  # one decode step served many of them at once


def examples(path: str, heading: str) -> str:
    """The text of a document's section (to the next heading of its level or above)."""
    with open(os.path.join(ROOT, path)) as file:
        return file.read().split(heading + "\n", 1)[1].split("\n" + heading.split()[0] + " ", 1)[0]


@pytest.mark.parametrize("path, heading", [("README.md", "## OpenAI-compatible API"),
                                           ("docs/OPENAI_API.md", "## More examples")])
def test_the_documented_examples_run_as_written(server_url, monkeypatch, path, heading):
    section = examples(path, heading).replace("http://127.0.0.1:7860/", server_url)
    monkeypatch.chdir(ROOT)  # the examples' media paths are relative to the repository
    printed = []
    exec(re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1),
         {"print": lambda *values, **_: printed.append(" ".join(map(str, values)))})
    assert "".join(printed).strip()
    curl = re.search(r"```bash\n(curl .*?)```", section, re.DOTALL).group(1).replace("openbmb/MiniCPM-V-4.6", "tiny-random")
    result = subprocess.run(["bash", "-c", curl], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "finish_reason" in result.stdout and '"error"' not in result.stdout, result.stdout


def test_while_the_model_is_switched_the_api_is_503_then_it_serves_the_new_one(switchable, manager, server_url, tmp_path):
    copy = str(tmp_path / "another-minicpmv")
    shutil.copytree(manager.source.path, copy)
    switcher = threading.Thread(target=switchable.switch_model, args=(copy,))
    answers = []
    switcher.start()
    while switcher.is_alive():
        answers.append(httpx.post(server_url + "v1/chat/completions", timeout=60,
                                  json={"messages": said("Ready?"), "max_tokens": 2}))
        time.sleep(0.02)
    switcher.join()
    refused = [answer for answer in answers if answer.status_code == 503]
    assert refused and {answer.status_code for answer in answers} <= {200, 503}
    assert refused[0].json()["error"]["message"] == MSG_API_NOT_READY and refused[0].headers["retry-after"]
    assert [model.id for model in OpenAI(base_url=server_url + "v1", api_key="-").models.list().data] == [copy]
    assert httpx.post(server_url + "v1/chat/completions", json={"model": copy, "messages": said("And now?"),
                                                                 "max_tokens": 2}, timeout=60).status_code == 200


def test_vllms_and_minicpm_vs_own_parameters_are_taken(api, manager, tmp_path):
    red = image(make_image(tmp_path, "red.png"))
    penalised = ask(api, said("Tell me more."), repetition_penalty=1.3).choices[0].message.content
    assert penalised == direct(manager, [{"role": "user", "content": [{"type": "text", "text": "Tell me more."}]}],
                               repetition_penalty=1.3).text != ask(api, said("Tell me more.")).choices[0].message.content
    sampled = {"temperature": 1.0, "seed": 3, "max_tokens": 10, "min_tokens": 10}
    assert ask(api, said("Hi"), top_k=-1, **sampled).choices[0].message.content == \
        ask(api, said("Hi"), top_k=0, **sampled).choices[0].message.content  # -1 is vLLM's "no top-k"
    assert ask(api, said("What?", red), max_slice_nums=1).usage.visual_tokens == 64  # the source view alone
    assert ask(api, said("What?", red), downsample_mode="4x").usage.visual_tokens > 640
    squeezed = ask(api, said("What?", red), visual_token_budget=300)
    assert squeezed.usage.visual_tokens <= 300 and squeezed.model_extra["notices"]  # the reply says it lowered the slices


def test_a_large_body_is_read_while_other_replies_stream_on(api, server_url):
    """A 64 MB body is parsed and its base64 decoded a few MB at a time, off the event loop: the replies
    streaming meanwhile keep coming (in one json.loads and one b64decode it held the GIL for seconds)."""
    payload = base64.b64encode(os.urandom(48 * 2**20)).decode()
    content = json.dumps({"messages": said("Big?", {"type": "image_url", "image_url": {"url": "data:image/png;base64," + payload}}),
                          "max_tokens": 2}).encode()
    del payload
    arrivals, done = [], threading.Event()
    with ask(api, said("Go on and on."), stream=True, max_tokens=4000, min_tokens=4000) as running:
        pieces = iter(running)
        next(pieces)

        def follow():
            for _ in pieces:
                arrivals.append(time.perf_counter())
                if done.is_set():
                    return

        follower = threading.Thread(target=follow)
        follower.start()
        started = time.perf_counter()
        # The body is sent twice, one after the other: a stall in each read would leave a gap of half the
        # window, while a busy machine's own pauses (up to 0.4 s seen) stay well under a third of it.
        responses = [httpx.post(server_url + "v1/chat/completions", content=content, timeout=300) for _ in range(2)]
        took = time.perf_counter() - started
        done.set()
        follower.join(30)
    for response in responses:
        assert response.status_code == 400 and "could not be read as an image" in response.json()["error"]["message"]
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:]) if started < later < started + took]
    assert len(gaps) > 5 and max(gaps) < took / 3, (took, max(gaps), len(gaps))


def longest_pause(work) -> float:
    """The longest another thread waited for Python's GIL (to wake from a 1 ms sleep) while `work()` ran, at the
    serving processes' switch interval."""
    import sys

    pauses, stop = [0.0], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            pauses.append(now - last)
            last = now

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.05)
        work()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return max(pauses)


def test_reading_a_large_body_never_holds_the_gil_for_long(tmp_path):
    from app.web.data_urls import DataUrlFiles, lift_data_urls
    from app.web.openai_request import parse_json

    png = open(make_image(tmp_path, "big.png", (1344, 1344)), "rb").read()
    payload = base64.b64encode(png + os.urandom(100 * 2**20)).decode()  # a PNG with 100 MB after its end
    body = bytearray(json.dumps({"messages": said("Big?", {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + payload}})}).encode())
    del payload

    def read():
        small, lifted = lift_data_urls(body)
        url = parse_json(small)["messages"][0]["content"][0]["image_url"]["url"]
        stored.append(DataUrlFiles(str(tmp_path), lifted).store(url, "image", "messages[0].content[0]"))

    stored = []
    # The least of three tries each: on a busy machine the whole process is sometimes not scheduled for a while.
    whole = min(longest_pause(lambda: json.loads(body)) for _ in range(3))  # one call into C: the GIL held throughout
    assert min(longest_pause(read) for _ in range(3)) < whole / 3
    assert open(stored[0], "rb").read(len(png)) == png and os.path.getsize(stored[0]) == len(png) + 100 * 2**20
