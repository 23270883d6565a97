"""int4: GPTQ and AWQ checkpoints made here with GPT-QModel load through the app's normal path and stream."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from gradio_client import Client, handle_file

from app.model.checkpoint.quantized import complete_quantization_config, load_in_4bit_config
from app.errors import UserError
from tests.conftest import ROOT, free_port


@pytest.fixture(scope="module", params=["gptq", "awq"])
def method(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def int4_checkpoint(method, tmp_path_factory):
    """The tiny random model quantized to int4 on the CPU (a subprocess: GPT-QModel patches libraries)."""
    work = tmp_path_factory.mktemp(method)  # GPT-QModel writes a logs/ folder where it runs
    out = str(work / f"tiny-{method}")
    # One torch thread: GPT-QModel's capture of the calibration inputs, in torch's pool of a thread per
    # core, took 4-40 s (0.4-1.3 s alone) whenever anything else ran on a 2-core machine, a test server say.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "quantize.py"), "--model", "tiny-random",
                           "--method", method, "--out", out], cwd=work, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@contextlib.contextmanager
def serving(folder: str, log_path):
    """`python app.py --model <folder>`, as a user starts it: its URL once it answers."""
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port)}
    env.pop("GRADIO_TEMP_DIR", None)
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--model", folder], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                urllib.request.urlopen(url + "gradio_api/info", timeout=5)
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def ask(url: str, image: str) -> dict:
    """A greedy 24-token answer about `image`, streamed; returns its stats."""
    job = Client(url, verbose=False).submit("What is in this picture?", [handle_file(image)],
                                            {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False},
                                            api_name="/ask")
    updates = list(job)
    reply, stats = job.result()
    assert len(updates) >= 2 and reply
    assert stats["new_tokens"] == 24 and stats["visual_tokens"] == 640
    return stats


def header(url: str) -> str:
    return urllib.request.urlopen(url + "config", timeout=10).read().decode()


@pytest.fixture(scope="module")
def int4_app(int4_checkpoint, tmp_path_factory):
    with serving(int4_checkpoint, tmp_path_factory.mktemp("int4-app") / "app.log") as url:
        yield url


def test_the_checkpoint_is_int4_with_16_bit_gates(int4_checkpoint, method):
    with open(os.path.join(int4_checkpoint, "config.json")) as file:
        quantization = json.load(file)["quantization_config"]
    assert quantization["quant_method"] == method and quantization["bits"] == 4

    from safetensors import safe_open

    with safe_open(os.path.join(int4_checkpoint, "model.safetensors"), framework="pt") as tensors:
        names = set(tensors.keys())
    assert any(name.endswith("mlp.down_proj.qweight") for name in names)
    assert any(name.endswith("linear_attn.in_proj_a.weight") for name in names)  # left in 16 bits


def test_int4_checkpoint_loads_and_streams_an_answer(int4_app, method, red_image):
    ask(int4_app, red_image)
    assert f"{method} 4-bit weights" in header(int4_app)  # the header says what is loaded


def test_a_missing_quantization_package_is_named(monkeypatch):
    class Config:
        quantization_config = {"quant_method": "gptq", "bits": 4}

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "optimum" else find_spec(name))
    with pytest.raises(UserError, match="\\(gptq\\) and needs optimum: .*requirements-quant.txt"):
        complete_quantization_config("/nonexistent", Config(), "cpu", None)


def test_load_in_4bit_says_what_it_needs(tmp_path):
    class Plain:
        quantization_config = None

    class Quantized:
        quantization_config = {"quant_method": "gptq", "bits": 4}

    with pytest.raises(UserError, match="already quantized \\(gptq\\)"):
        load_in_4bit_config("some/MiniCPM-V-4.6-GPTQ", Quantized(), "cuda", None)
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        load_in_4bit_config("openbmb/MiniCPM-V-4.6", Plain(), "cpu", None)
    if not importlib.util.find_spec("bitsandbytes"):
        with pytest.raises(UserError, match="pip install bitsandbytes"):
            load_in_4bit_config("openbmb/MiniCPM-V-4.6", Plain(), "cuda", None)

    # As a user meets it: the app stops at start with the reason.
    done = subprocess.run([sys.executable, "app.py", "--model", "tiny-random", "--device", "cpu", "--load-in-4bit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--load-in-4bit needs a CUDA GPU" in done.stderr
