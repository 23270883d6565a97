"""Shared fixtures: the tiny random checkpoint, the process-wide model manager, and one live server."""

import os
import signal
import socket
import tempfile
import time

# Before anything imports huggingface_hub or gradio: no network, no telemetry, a private checkpoint cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ.setdefault("MINICPMV_DEMO_CACHE", os.path.join(tempfile.gettempdir(), "minicpmv-demo-tests"))
# Uploads expire quickly here so that the soak test can see the clean-up keep the cache bounded.
os.environ.setdefault("MINICPMV_UPLOAD_MAX_AGE_S", "20")
os.environ.setdefault("MINICPMV_UPLOAD_CLEAN_EVERY_S", "5")
# The engine samples its load (and an open Server load panel refreshes) every second: charts fill quickly.
os.environ.setdefault("MINICPMV_LOAD_SAMPLE_S", "1")

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from app.config import AppConfig, apply_environment  # noqa: E402

apply_environment()  # as every process of the app does when it starts (app.startup), for the servers run here


def _share_one_tls_context():
    """gradio_client opens a new httpx client for every upload and every request, and httpx builds each
    of them a TLS context from certifi's bundle: about 20 ms of CPU on a small machine, taken from the
    server that runs in this process, for URLs that are all plain http on the loopback. In this process
    (the test runner; not the app's own processes) the default context is built once and shared, as
    httpx advises; any other `verify` or `cert` still gets its own. Returns httpx's own builder (None where an
    httpx of another layout has none: then nothing is shared, and the suite is only slower)."""
    import functools

    import httpx._transports.default as transports

    build = getattr(transports, "create_ssl_context", None)
    if build is None:
        return None

    @functools.lru_cache(maxsize=None)
    def default_context(trust_env: bool, cert_file, cert_dir):
        return build(verify=True, trust_env=trust_env)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return default_context(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context
    return build


# httpx's own, for a test whose clients must keep the pace of clients that build their TLS contexts
httpx_own_ssl_context = _share_one_tls_context()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "test-artifacts")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def config() -> AppConfig:
    # The engine in this process, so that tests can look inside it; tests/test_engine_process.py covers
    # the engine in a process of its own (what `python app.py` runs).
    return AppConfig(model="tiny-random", port=free_port(), max_new_tokens=256, engine_process=False)


@pytest.fixture(scope="session")
def manager(config):
    from app.engine.backends import load_manager

    return load_manager(config)


@pytest.fixture(scope="session")
def server_url(config, manager):
    from app.web.server import launch

    demo = launch(config, manager, prevent_thread_lock=True)
    yield demo.local_url
    demo.close()


@pytest.fixture
def client(server_url):
    from gradio_client import Client

    return Client(server_url, verbose=False)


def make_image(folder, name: str, size=(1344, 1344), color=(200, 30, 30)) -> str:
    path = os.path.join(str(folder), name)
    image = Image.new("RGB", size, color)
    # A shape so that differently sized images are not just flat colour.
    image.paste((20, 90, 200), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    image.save(path)
    return path


def truncated_png(folder, name: str = "truncated.png") -> str:
    """A PNG cut to its first third: its header is whole, its pixels are not."""
    data = open(make_image(folder, "whole-" + name, (800, 600)), "rb").read()
    path = os.path.join(str(folder), name)
    with open(path, "wb") as file:
        file.write(data[: len(data) // 3])
    return path


def normalized_as_the_engine_does(tensors: dict) -> dict:
    """A request's tensors from the app's processor, whose images' and video's pixels it leaves in uint8, with those
    normalized as the engine normalizes them (app.model.runner) and their normalizations taken out: what the
    processor as shipped gives. Each such pixels' tensor is checked to be uint8."""
    import torch

    from app.engine.processor import normalized_pixels

    tensors = dict(tensors)
    for key, normalization in (("pixel_values", "pixel_normalization"),
                               ("pixel_values_videos", "video_pixel_normalization")):
        if normalization in tensors:
            assert tensors[key].dtype == torch.uint8, key
            tensors[key] = normalized_pixels(tensors[key], tensors.pop(normalization))
    return tensors


def make_video(folder, name: str = "clip.mp4", seconds: float = 10, fps: int = 24, size=(320, 240),
               fourcc: str = "mp4v") -> str:
    """A video whose frame i shows i in binary as 8 black/white stripes, so a decoded frame tells its index."""
    path = os.path.join(str(folder), name)
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), fps, size)
    assert writer.isOpened()
    stripe = size[0] // 8
    for index in range(int(seconds * fps)):
        frame = np.zeros((size[1], size[0], 3), np.uint8)
        for bit in range(8):
            if (index % 256) >> bit & 1:
                frame[:, bit * stripe:(bit + 1) * stripe] = 255
        writer.write(frame)
    writer.release()
    return path


def picture_requests(folder, count: int, seed: int, question: str) -> dict[int, tuple[str, str]]:
    """`count` users' requests, {i: (question with {i} filled in, image path)}: images of random sizes and colours."""
    rng = np.random.default_rng(seed)
    requests = {}
    for i in range(count):
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        size = (int(rng.integers(32, 900)), int(rng.integers(32, 900)))
        requests[i] = (question.format(i=i), make_image(folder, f"user{i}.png", size, color))
    return requests


def interruptible() -> None:
    """A Popen preexec_fn: Ctrl+C (SIGINT) reaches `python app.py` as in a terminal. A shell without job control
    starts a background command with SIGINT ignored, its children inherit that, and Python then installs no
    KeyboardInterrupt for it: a suite run in the background would see the app ignore its SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition, seconds: float) -> bool:
    """Poll `condition` until it holds or `seconds` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def frame_index(frame) -> int:
    """Read back the index that make_video drew into a frame (modulo 256)."""
    stripe = frame.shape[1] // 8
    return sum(1 << bit for bit in range(8) if frame[:, bit * stripe + stripe // 4:(bit + 1) * stripe - stripe // 4].mean() > 127)


@pytest.fixture
def red_image(tmp_path) -> str:
    return make_image(tmp_path, "red.png")
