"""Switching models at run time (--allow-model-switch): replies in progress finish, a failed load keeps serving."""

import dataclasses
import gc
import shutil
import threading
import time
import weakref

import gradio as gr
import pytest
from gradio_client import handle_file

from app.ui.handlers import Handlers
from tests.test_api import FIXED, stream


@pytest.fixture
def switchable(manager, monkeypatch):
    monkeypatch.setattr(manager, "config", dataclasses.replace(manager.config, allow_model_switch=True))
    handlers = Handlers(manager)
    yield handlers
    if manager.source.name != "tiny-random":
        handlers.switch_model("tiny-random")


def test_switch_is_off_unless_allowed(manager):
    with pytest.raises(gr.Error, match="--allow-model-switch"):
        Handlers(manager).switch_model("tiny-random")


def test_switch_waits_for_replies_in_progress_then_serves_the_new_model(switchable, manager, client, red_image, tmp_path):
    copy = str(tmp_path / "my-local-minicpmv")
    shutil.copytree(manager.source.path, copy)
    job = client.submit("Long answer.", [handle_file(red_image)], {"max_new_tokens": 300, "min_new_tokens": 300,
                                                                    "do_sample": False}, api_name="/ask")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    headers = []
    switcher = threading.Thread(target=lambda: headers.append(switchable.switch_model(copy)))
    switcher.start()
    assert job.result()[1]["new_tokens"] == 300  # the reply in progress was not broken
    switcher.join(120)
    assert manager.source.name == copy and "my-local-minicpmv" in headers[0][0]
    _, (_, stats) = stream(client, "And now?", [red_image], FIXED)
    assert stats["visual_tokens"] == 640


def test_a_switch_releases_the_old_model_though_the_warm_up_froze_it(switchable, manager, tmp_path):
    assert gc.get_freeze_count() > 0  # the warm-up took what was loaded out of the collector's full collections
    copy = str(tmp_path / "another-minicpmv")
    shutil.copytree(manager.source.path, copy)
    old_model = weakref.ref(manager.model)
    switchable.switch_model(copy)
    assert manager.source.name == copy
    assert old_model() is None


def test_failed_switch_keeps_serving(switchable, manager, client, red_image):
    with pytest.raises(gr.Error, match="Could not load .*Still serving"):
        switchable.switch_model("/no/such/checkpoint")
    assert manager.source.name == "tiny-random"
    _, (_, stats) = stream(client, "Still there?", [red_image], FIXED)
    assert stats["new_tokens"] == FIXED["max_new_tokens"]


def test_engine_only_checkpoint_points_to_the_openai_backend(switchable):
    with pytest.raises(gr.Error, match="--backend openai"):
        switchable.switch_model("openbmb/MiniCPM-V-2_6")
