"""`python app.py` as an OpenAI-compatible server in a process of its own (its engine in another, as it runs by
default), with a key and room for one request and one in line: the key, the busy line (429), a model process that restarts
(503), and the closed loop: this app with --backend openai pointed at it, its UI and its /ask working through."""

import io
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from gradio_client import Client
from openai import OpenAI

from app.config import AppConfig
from app.engine.openai_backend import OpenAIEngine
from app.messages import MSG_API_KEY_MISSING, MSG_API_KEY_WRONG, MSG_ENGINE_DOWN
from app.media.images import load_image
from tests import test_browser
from tests.conftest import ROOT, free_port, interruptible, make_image, wait_for
from tests.test_api import FIXED, stream
from tests.test_openai_api import data_url, direct, said

KEY = "sk-test-7c1e"
LONG = {"max_tokens": 4000, "extra_body": {"min_tokens": 4000}}
browser = test_browser.browser  # the fixture, shared


class Upstream:
    """`python app.py --model tiny-random` serving one request at a time, with one place in its wait line."""

    def __init__(self, log_path):
        self.port, self.log_path = free_port(), log_path
        self.url = f"http://127.0.0.1:{self.port}/"
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "app.py", "--model", "tiny-random", "--port", str(self.port), "--max-batch-size", "1",
                 "--queue-size", "1", "--no-warmup"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "MINICPMV_API_KEY": KEY}, preexec_fn=interruptible)

    def log(self) -> str:
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        return int(re.findall(r"Engine process (\d+) serves", self.log())[-1])

    def client(self, key: str | None = KEY, **options) -> OpenAI:
        return OpenAI(base_url=self.url + "v1", api_key=key, max_retries=0, **options)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    upstream = Upstream(tmp_path_factory.mktemp("upstream") / "app.log")
    assert wait_for(lambda: "* OpenAI-compatible API at" in upstream.log() or upstream.process.poll() is not None, 240)
    assert upstream.process.poll() is None, upstream.log()
    yield upstream
    upstream.process.send_signal(signal.SIGINT)
    assert upstream.process.wait(60) == 0, upstream.log()
    assert "Traceback" not in upstream.log()


@pytest.fixture(scope="module")
def frontend(upstream):
    """This app with --backend openai pointed at the upstream app, in this process: its URL."""
    from app.web.server import launch

    os.environ["OPENAI_API_KEY"] = KEY  # what --backend openai sends (read when the engine is made)
    try:
        engine = OpenAIEngine(AppConfig(backend="openai", openai_base_url=upstream.url + "v1",
                                        openai_model="tiny-random", port=free_port()))
    finally:
        del os.environ["OPENAI_API_KEY"]
    engine.load()
    demo = launch(engine.config, engine, prevent_thread_lock=True, quiet=True)
    yield demo.local_url
    demo.close()


def as_sent_upstream(path: str, folder) -> str:
    """The image as --backend openai sends it (a JPEG of quality 92), as a file."""
    buffer = io.BytesIO()
    load_image(path).save(buffer, format="JPEG", quality=92)
    copy = folder / (os.path.basename(path) + ".jpg")
    copy.write_bytes(buffer.getvalue())
    return str(copy)


def test_the_api_needs_its_key(upstream):
    with pytest.raises(openai.AuthenticationError, match=re.escape(MSG_API_KEY_WRONG)):
        upstream.client("sk-wrong").models.list()
    for path in ("v1/models", "v1/chat/completions"):
        response = httpx.request("GET" if path.endswith("models") else "POST", upstream.url + path, timeout=30)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"] == {"message": MSG_API_KEY_MISSING, "type": "invalid_request_error",
                                            "param": None, "code": "invalid_api_key"}
    assert httpx.get(upstream.url + "gradio_api/info", timeout=30).status_code == 200  # the key is the API's alone
    assert [model.id for model in upstream.client().models.list().data] == ["tiny-random"]


def test_a_request_waits_in_line_then_a_full_line_is_busy_429(upstream, frontend):
    client = upstream.client()
    with client.chat.completions.create(model="tiny-random", messages=said("Go on."), stream=True, **LONG) as running:
        next(iter(running))
        # The one place in line: its stream starts, and says so while it waits (comments, which clients skip).
        waiting = httpx.stream("POST", upstream.url + "v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                               json={"messages": said("After you."), "max_tokens": 3, "stream": True}, timeout=60)
        with waiting as second:
            lines = second.iter_lines()
            assert second.status_code == 200 and json.loads(next(lines)[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
            assert next(line for line in lines if line) == ": waiting, 0 requests ahead"
            with pytest.raises(openai.RateLimitError, match="The demo is busy") as busy:
                client.chat.completions.create(model="tiny-random", messages=said("Me too?"), max_tokens=4)
            assert busy.value.status_code == 429 and busy.value.response.headers["retry-after"]
            assert busy.value.body["type"] == "rate_limit_error"
            # Through --backend openai, the external server's busy answer is this app's busy answer.
            with pytest.raises(openai.RateLimitError, match="HTTP 429"):
                OpenAI(base_url=frontend + "v1", api_key="none", max_retries=0).chat.completions.create(
                    model="tiny-random", messages=said("Me too?"), max_tokens=4)
            assert 'minicpmv_requests_total{outcome="busy"} 1' in httpx.get(frontend + "metrics", timeout=30).text
            running.close()  # the long reply leaves: the one in line is served
            assert "data: [DONE]" in list(lines)


def test_stop_texts_and_seeds_work_through_the_model_process(upstream, manager):
    client = upstream.client()
    full = client.chat.completions.create(model="tiny-random", messages=said("Count."), max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": 40}).choices[0].message.content
    assert full == direct(manager, [{"role": "user", "content": [{"type": "text", "text": "Count."}]}],
                          max_new_tokens=40, min_new_tokens=40).text
    stop = full[15:19]
    cut = client.chat.completions.create(model="tiny-random", messages=said("Count."), max_tokens=40, temperature=0, stop=stop)
    assert cut.choices[0].message.content == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = {"model": "tiny-random", "messages": said("Surprise me."), "max_tokens": 12, "temperature": 1.0, "seed": 7}
    assert len({client.chat.completions.create(**sampled).choices[0].message.content for _ in range(2)}) == 1


def test_a_model_process_that_dies_ends_the_reply_clearly_and_is_503_until_back(upstream):
    client = upstream.client()
    first = upstream.engine_pid()
    with pytest.raises(openai.APIError, match="stopped in the middle of this reply"):
        with client.chat.completions.create(model="tiny-random", messages=said("Go on."), stream=True, **LONG) as running:
            for count, _ in enumerate(running):
                if count == 2:
                    os.kill(first, signal.SIGKILL)
    statuses = []

    def answered() -> bool:
        response = httpx.post(upstream.url + "v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                              json={"model": "tiny-random", "messages": said("Back?"), "max_tokens": 3})
        statuses.append(response.status_code)
        return response.status_code == 200

    assert wait_for(answered, 120), statuses
    assert 503 in statuses and set(statuses) <= {503, 200}, statuses  # the restart was said, no other failure
    assert upstream.engine_pid() != first


def test_the_closed_loop_serves_ask_and_the_api_with_the_upstreams_replies(upstream, frontend, manager, tmp_path):
    """This app with --backend openai, pointed at this app: /ask and its own API answer what the model answers."""
    picture = make_image(tmp_path, "red.png", (448, 448))
    expected = direct(manager, [{"role": "user", "content": [{"type": "image", "path": as_sent_upstream(picture, tmp_path)},
                                                             {"type": "text", "text": "What is in this picture?"}]}])
    _, (answer, stats) = stream(Client(frontend, verbose=False), "What is in this picture?", [picture], FIXED)
    assert answer == expected.text and stats["new_tokens"] == 24
    assert stats["prompt_tokens"] == expected.stats["prompt_tokens"]  # counted upstream, images included
    question = "Why is the sky blue?"
    _, (thought, _) = stream(Client(frontend, verbose=False), question, [], {**FIXED, "enable_thinking": True})
    reasoning = direct(manager, [{"role": "user", "content": [{"type": "text", "text": question}]}], enable_thinking=True).text
    assert "</think>" not in reasoning  # the tiny model reasons to the end of this reply
    assert thought == f"<think>{reasoning}</think>"  # the upstream's reasoning_content, shown as reasoning
    looped = OpenAI(base_url=frontend + "v1", api_key="none", max_retries=0).chat.completions.create(
        model="tiny-random", messages=said("What is in this picture?", {"type": "image_url", "image_url": {"url": data_url(picture)}}),
        max_tokens=24, temperature=0, extra_body={"min_tokens": 24})
    assert looped.choices[0].message.content == expected.text and looped.choices[0].finish_reason == "length"
    assert looped.usage.prompt_tokens == expected.stats["prompt_tokens"] and "visual_tokens" not in looped.usage.model_dump()


def test_the_ui_works_through_the_closed_loop(browser, frontend, tmp_path):
    page = test_browser.open_page(browser, frontend)
    try:
        page.locator("#chat-input input[type=file]").set_input_files(make_image(tmp_path, "blue.png", (300, 200), (0, 0, 200)))
        page.locator("#chat-input textarea").fill("What is in this picture?")
        page.wait_for_timeout(500)  # the upload finishes before sending
        page.locator("#chat-input textarea").press("Enter")
        stats = page.get_by_text(re.compile(r"first token after .* new tokens?")).first
        stats.wait_for(timeout=60_000)
        assert "visual tokens" not in stats.inner_text()  # counted by the external server
        assert len(test_browser.chat_text(page)) > len("What is in this picture?") + 20
    finally:
        page.close()


def test_an_external_server_that_is_down_is_503(tmp_path):
    from app.web.server import launch

    engine = OpenAIEngine(AppConfig(backend="openai", openai_base_url=f"http://127.0.0.1:{free_port()}/v1",
                                    openai_model="tiny-random", port=free_port()))
    engine.load()
    demo = launch(engine.config, engine, prevent_thread_lock=True, quiet=True)
    try:
        with pytest.raises(openai.InternalServerError) as down:
            OpenAI(base_url=demo.local_url + "v1", api_key="none", max_retries=0).chat.completions.create(
                model="tiny-random", messages=said("Anyone?"), max_tokens=4)
        assert down.value.status_code == 503 and MSG_ENGINE_DOWN.split("{")[0] in down.value.message
        assert down.value.body["type"] == "service_unavailable_error"
    finally:
        demo.close()
