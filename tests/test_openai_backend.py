"""--backend openai against a real OpenAI-compatible server: `transformers serve` on loopback with the tiny model."""

import os
import subprocess
import sys
import time
import urllib.request

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from app.config import AppConfig
from app.engine.openai_backend import OpenAIEngine
from tests.conftest import free_port, make_image, make_video
from tests.test_api import stream

SHORT = {"max_new_tokens": 16, "do_sample": False}


class Server:
    """A `transformers serve` process that the tests can kill and start again on the same port."""

    def __init__(self, checkpoint: str, folder):
        self.checkpoint, self.port, self.folder = checkpoint, free_port(), folder
        self.process = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(self.folder)}
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.checkpoint,
                   "--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "transformers serve exited"
            try:
                urllib.request.urlopen(self.base_url + "/models", timeout=2)
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("transformers serve did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)


@pytest.fixture(scope="module")
def server(manager, tmp_path_factory):
    server = Server(manager.source.path, tmp_path_factory.mktemp("hf-cache"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def engine(server, manager):
    engine = OpenAIEngine(AppConfig(backend="openai", openai_base_url=server.base_url,
                                    openai_model=manager.source.path, port=free_port()))
    engine.load()
    return engine


@pytest.fixture(scope="module")
def engine_client(engine):
    from app.web.server import launch

    demo = launch(engine.config, engine, prevent_thread_lock=True)
    yield Client(demo.local_url, verbose=False)
    demo.close()


def test_image_answer_streams_through_the_server(engine_client, red_image):
    updates, (reply, stats) = stream(engine_client, "What is in this picture?", [red_image], SHORT)
    assert len(updates) >= 3 and reply
    assert stats["new_tokens"] == 16 and stats["prompt_tokens"] > 640  # the server counted the image's tokens
    assert stats["visual_tokens"] is None  # ... which only it knows


def test_several_images_and_a_video(engine_client, tmp_path):
    one = stream(engine_client, "Compare.", [make_image(tmp_path, "a.png")], SHORT)[1][1]
    three = stream(engine_client, "Compare.", [make_image(tmp_path, f"{n}.png") for n in "abc"], SHORT)[1][1]
    assert three["prompt_tokens"] > 2 * one["prompt_tokens"] - 100
    video = make_video(tmp_path, seconds=4, fps=8, size=(448, 448))
    stats = stream(engine_client, "What happens?", [video], {**SHORT, "video_max_frames": 3})[1][1]
    assert stats["video_frames"] == 3


def test_stop_closes_the_stream(engine_client, engine, red_image):
    job = engine_client.submit("Long please.", [handle_file(red_image)], {"max_new_tokens": 4000}, api_name="/ask")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.active_generations == 1
    job.cancel()
    deadline = time.monotonic() + 10
    while engine.active_generations and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.active_generations == 0


def test_server_killed_mid_answer_then_back(engine_client, server, red_image):
    job = engine_client.submit("Long please.", [handle_file(red_image)], {"max_new_tokens": 4000}, api_name="/ask")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.kill()
    with pytest.raises(AppError, match="stopped answering|not reachable"):
        job.result()
    with pytest.raises(AppError, match="not reachable"):
        stream(engine_client, "Anyone there?", [], SHORT)
    server.start()  # the server comes back: the next request works, no restart of the app
    _, (_, stats) = stream(engine_client, "Back?", [red_image], SHORT)
    assert stats["new_tokens"] == 16
