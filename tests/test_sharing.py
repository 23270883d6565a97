"""Sharing safely: --auth guards page, API and files; uploads are not served to strangers; remote code stays off."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from gradio_client import Client, handle_file

from app.config import parse_config
from app.engine.loader import ModelSource, ModelUnavailable, load_model_and_processor
from tests.conftest import ROOT, free_port


def http_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture(scope="module")
def protected_url(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("auth") / "app.log"
    env = {**os.environ, "MINICPMV_AUTH": "alice:s3cret", "GRADIO_SERVER_PORT": str(port)}
    env.pop("GRADIO_TEMP_DIR", None)
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--model", "tiny-random"], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()
        try:
            urllib.request.urlopen(url + "gradio_api/info", timeout=5)
        except urllib.error.HTTPError:
            break  # answering (with 401): up
        except OSError:
            time.sleep(1)
    yield url
    process.terminate()
    process.wait(30)


def test_auth_protects_the_api_and_the_page(protected_url, red_image):
    assert http_status(protected_url + "gradio_api/info") == 401
    with pytest.raises(Exception):
        Client(protected_url, verbose=False)
    with pytest.raises(Exception):
        Client(protected_url, auth=("alice", "wrong"), verbose=False)
    client = Client(protected_url, auth=("alice", "s3cret"), verbose=False)
    reply, stats = client.predict("What is this?", [handle_file(red_image)], {"max_new_tokens": 4}, api_name="/ask")
    assert stats["visual_tokens"] == 640
    assert http_status(protected_url + "config") == 401  # the page's components are not given out either
    assert "MiniCPM-V" not in urllib.request.urlopen(protected_url, timeout=10).read().decode()


def test_uploads_are_not_served_to_strangers(protected_url, server_url, red_image):
    import httpx

    # Upload to the open test server as the page does: the file gets an unguessable path.
    with open(red_image, "rb") as file:
        uploaded = httpx.post(server_url + "gradio_api/upload", files={"files": file}).json()[0]
    for path in ("/etc/passwd", "../../../../etc/passwd", os.path.abspath(red_image)):
        assert http_status(server_url + "gradio_api/file=" + path) in (403, 404)
    guessed = os.path.join(os.environ.get("GRADIO_TEMP_DIR", "/tmp/gradio"), "0" * 64, "red.png")
    assert http_status(server_url + "gradio_api/file=" + guessed) in (403, 404)
    assert http_status(server_url + "gradio_api/file=" + uploaded) == 200  # only with the exact path
    # Behind --auth even a known file path needs the login.
    assert http_status(protected_url + "gradio_api/file=" + uploaded) == 401


def test_auth_option_is_checked():
    assert parse_config(["--auth", "bob:pw"]).auth_pair() == ("bob", "pw")
    with pytest.raises(SystemExit):
        parse_config(["--auth", "no-password"])


def test_remote_code_is_never_run_unless_allowed(tmp_path):
    folder = tmp_path / "sneaky-checkpoint"
    folder.mkdir()
    marker = tmp_path / "remote-code-ran"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "sneaky", "architectures": ["SneakyModel"],
        "auto_map": {"AutoConfig": "sneaky.SneakyConfig", "AutoModelForImageTextToText": "sneaky.SneakyModel"},
    }))
    (folder / "sneaky.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert parse_config([]).trust_remote_code is False
    with pytest.raises(ModelUnavailable, match="cannot read"):
        load_model_and_processor(ModelSource(name="sneaky", path=str(folder)), "cpu", None, "sdpa")
    assert not marker.exists()
