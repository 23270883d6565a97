"""A public link receives everything: each hostile or unlucky input is refused clearly and the app keeps serving."""

import os
import threading
import time

import cv2
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from app import limits
from tests.conftest import make_image, make_video, picture_requests, truncated_png
from tests.test_api import FIXED, stream


def write(path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


def bomb_png(tmp_path) -> str:
    path = str(tmp_path / "bomb.png")
    Image.new("1", (20000, 20000)).save(path)  # 400 megapixels in a few kilobytes
    return path


def empty_video(tmp_path) -> str:
    path = str(tmp_path / "empty.mp4")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 24, (64, 48))
    writer.release()
    if not os.path.exists(path):
        open(path, "wb").close()
    return path


BAD_INPUTS = {
    "random bytes named .jpg": (lambda tmp: [write(tmp / "noise.jpg", os.urandom(4096))], "could not be read as an image"),
    "zero-byte file": (lambda tmp: [write(tmp / "zero.png", b"")], "could not be read as an image"),
    "truncated PNG": (lambda tmp: [truncated_png(tmp)], "could not be read as an image"),
    "20000x20000 PNG": (lambda tmp: [bomb_png(tmp)], "more than 64,000,000 pixels"),
    "text file named .mp4": (lambda tmp: [write(tmp / "notes.mp4", b"just text" * 100)], "could not be decoded|no frames"),
    "video with no frames": (lambda tmp: [empty_video(tmp)], "could not be decoded|no frames"),
    "50 images": (lambda tmp: [make_image(tmp, f"{i}.png", (32, 32)) for i in range(50)], "50 images in one request; the limit is 16"),
    "executable": (lambda tmp: [write(tmp / "run.sh", b"#!/bin/sh\necho hi")], "not a supported file"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_then_the_next_request_works(client, tmp_path, red_image, case):
    make_files, message = BAD_INPUTS[case]
    started = time.monotonic()
    with pytest.raises(AppError, match=message):
        stream(client, "What is this?", make_files(tmp_path), FIXED)
    _, (_, stats) = stream(client, "What is this?", [red_image], FIXED)
    assert stats["visual_tokens"] == 640
    assert time.monotonic() - started < 60


def test_huge_prompt_and_bad_settings_are_refused(client, red_image):
    with pytest.raises(AppError, match="200,000 characters; the limit is 20,000"):
        stream(client, "x" * 200_000, [], FIXED)
    for settings, message in (({"max_new_tokens": 10**9}, "max_new_tokens"), ({"top_k": -3}, "top_k"),
                              ({"downsample_mode": "1x"}, "downsample_mode"), ({"video_fps": "fast"}, "video_fps"),
                              ({"stream": True}, "Unknown setting"), ([1, 2], "JSON object"), ("fast", "JSON object")):
        with pytest.raises(AppError, match=message):
            stream(client, "Hello", [red_image], settings)
    _, (_, stats) = stream(client, "Hello", [red_image], FIXED)
    assert stats["new_tokens"] == FIXED["max_new_tokens"]


def test_a_one_pixel_image_is_answered(client, tmp_path):
    _, (_, stats) = stream(client, "What is this?", [make_image(tmp_path, "dot.png", (1, 1))], FIXED)
    assert stats["visual_tokens"] == 64  # upscaled to one 448-px source view


def test_a_30_minute_video_is_sampled_not_decoded_whole(client, tmp_path):
    path = make_video(tmp_path, "long.mp4", seconds=30 * 60, fps=5, size=(64, 48))
    started = time.monotonic()
    _, (_, stats) = stream(client, "What happens?", [path], FIXED)
    assert stats["video_frames"] == limits.DEFAULT_VIDEO_MAX_FRAMES
    assert time.monotonic() - started < 30  # 64 seeks, not 9,000 decoded frames


def test_history_that_outgrows_the_context_is_trimmed_oldest_first(manager, tmp_path):
    from app.engine.settings import GenerationSettings

    small = make_image(tmp_path, "small.png", (448, 448))  # 64 tokens whatever the budget does
    turns = []
    for i in range(6):
        turns.append({"role": "user", "content": [{"type": "image", "path": small}, {"type": "text", "text": f"Question {i}"}]})
        turns.append({"role": "assistant", "content": [{"type": "text", "text": f"Answer {i}"}]})
    turns.append({"role": "user", "content": [{"type": "text", "text": "And now?"}]})
    settings = GenerationSettings(max_new_tokens=16)
    whole = manager.prepare(turns, settings)
    limit = whole.prompt_tokens + 16 - 1  # the whole history misses by one token
    from app.engine.inputs import prepare_inputs

    trimmed = prepare_inputs(manager.processor, turns, settings, limit)
    assert trimmed.prompt_tokens + 16 <= limit
    assert trimmed.notices[0].startswith("The 2 oldest messages were left out")
    assert len(trimmed.image_tokens) == 5  # the first turn's image went with it
    with pytest.raises(Exception, match="context"):
        prepare_inputs(manager.processor, turns[-3:], settings, 20)


def solo_and_concurrent(server_url, requests, clients):
    """Each request's answer alone, then all of them at once from `clients` threads."""
    solo = {}
    client = Client(server_url, verbose=False)
    for key, (text, path) in requests.items():
        solo[key] = stream(client, text, [path], FIXED)[1][0]
    together, failures = {}, []

    def run(keys):
        own = Client(server_url, verbose=False)
        for key in keys:
            try:
                together[key] = stream(own, requests[key][0], [requests[key][1]], FIXED)[1][0]
            except Exception as error:  # recorded, asserted below
                failures.append((key, error))

    keys = list(requests)
    threads = [threading.Thread(target=run, args=(keys[i::clients],)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return solo, together, failures


def test_32_concurrent_users_each_get_their_own_answer(server_url, tmp_path):
    requests = picture_requests(tmp_path, 32, seed=0, question="User {i}: describe picture number {i}.")
    solo, together, failures = solo_and_concurrent(server_url, requests, clients=32)
    assert not failures
    assert len(set(solo.values())) > 16  # the answers really differ from user to user
    assert together == solo  # greedy: the same answer as alone, so nothing leaked between users


def test_full_line_answers_busy_at_once_and_the_line_still_finishes(server_url, manager, red_image, monkeypatch):
    monkeypatch.setattr(manager.scheduler, "max_waiting", 2)
    monkeypatch.setattr(manager.scheduler, "max_batch", 1)
    slow = {"max_new_tokens": 600, "min_new_tokens": 600, "do_sample": False}
    clients = [Client(server_url, verbose=False) for _ in range(3)]
    # One running, two waiting (submitted together, so the first is still answering when the others join).
    jobs = [client.submit("Long answer please.", [handle_file(red_image)], slow, api_name="/ask") for client in clients]
    deadline = time.monotonic() + 30
    while manager.scheduler.waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.scheduler.waiting == 2
    started = time.monotonic()
    with pytest.raises(AppError, match="busy.*try again"):
        stream(Client(server_url, verbose=False), "Me too!", [red_image], FIXED)
    assert time.monotonic() - started < 5  # at once, not after the line
    for job in jobs:
        assert job.result()[1]["new_tokens"] == 600

    def places(job):
        return {stats.get("waiting_ahead") for _, stats in job.outputs() if isinstance(stats, dict)}

    assert any(1 in places(job) for job in jobs)  # the last in line was told how many were ahead of it


def test_out_of_memory_frees_memory_answers_clearly_and_recovers(client, manager, red_image, monkeypatch):
    import torch

    freed = []

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(manager.scheduler.runner, "decode", out_of_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(True))
    with pytest.raises(AppError, match="ran out of memory"):
        stream(client, "What is this?", [red_image], FIXED)
    assert freed
    monkeypatch.undo()
    _, (_, stats) = stream(client, "What is this?", [red_image], FIXED)
    assert stats["new_tokens"] == FIXED["max_new_tokens"]


def test_soak_500_requests_from_20_clients(server_url, tmp_path):
    import psutil
    from gradio.utils import get_upload_folder

    images = [make_image(tmp_path, f"soak{i}.png", (64 + 16 * i, 64), (i * 20, 100, 200)) for i in range(5)]
    settings = {"max_new_tokens": 2, "do_sample": False}
    process = psutil.Process()
    uploads = get_upload_folder()

    def files_under(folder):
        return sum(len(files) for _, _, files in os.walk(folder))

    def run(per_client, clients):
        failures, done = [], []

        def worker(index):
            own = Client(server_url, verbose=False)
            for n in range(per_client):
                try:
                    stream(own, f"Client {index} request {n}", [images[(index + n) % len(images)]], settings)
                    done.append(1)
                except Exception as error:  # recorded, asserted below
                    failures.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return failures, len(done)

    run(5, 20)  # warm every path before measuring
    rss_before, files_before = process.memory_info().rss, files_under(uploads)
    failures, done = run(12, 20)
    rss_middle = process.memory_info().rss
    more_failures, more_done = run(13, 20)
    rss_after, files_after = process.memory_info().rss, files_under(uploads)
    print(f"soak: {done + more_done} requests, RSS {rss_before / 2**20:.0f} -> {rss_middle / 2**20:.0f} -> "
          f"{rss_after / 2**20:.0f} MiB, upload files {files_before} -> {files_after}")
    assert not failures and not more_failures and done + more_done == 500
    assert rss_after - rss_middle < 100 * 2**20  # the second half adds (almost) nothing: no leak per request
    deadline = time.monotonic() + limits.UPLOAD_MAX_AGE_S + 3 * limits.UPLOAD_CLEAN_EVERY_S
    while files_under(uploads) > files_before and time.monotonic() < deadline:
        time.sleep(1)
    print(f"soak: upload files {files_under(uploads)} once the clean-up ran")
    assert files_under(uploads) <= files_before  # every upload is kept once, then expires: bounded
