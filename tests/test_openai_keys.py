"""Who may use the OpenAI-compatible API: its own key (--api-key, `Authorization: Bearer`), never the page's
login; open without a key on loopback only, and closed with --auth or beyond loopback until a key is set."""

import os
import subprocess
import sys

import httpx
import pytest

from app.config import AppConfig, api_key_needed, parse_config
from app.messages import MSG_API_KEY_MISSING, MSG_API_KEY_NOT_SET, MSG_API_KEY_WRONG
from tests.conftest import ROOT
from tests.test_sharing import launched, log_in  # noqa: F401 (the fixture, shared)

CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}


def answers(url: str, **headers) -> tuple[int, str | None]:
    """(status, error message) of a chat completion request to the app at `url`."""
    response = httpx.post(url + "v1/chat/completions", json=CHAT, headers=headers, timeout=60)
    return response.status_code, (response.json().get("error") or {}).get("message")


def test_with_auth_the_login_does_not_open_the_api_and_no_key_keeps_it_closed(launched):
    demo = launched(auth="alice:s3cret")
    url = demo.local_url
    with httpx.Client(cookies=log_in(url), timeout=60) as user:
        assert user.get(url + "gradio_api/info").status_code == 200  # the login opens the page's API
        response = user.post(url + "v1/chat/completions", json=CHAT)
        assert response.status_code == 401 and response.json()["error"]["message"] == MSG_API_KEY_NOT_SET
        assert user.get(url + "v1/models").status_code == 401
    assert answers(url, Authorization="Bearer anything") == (401, MSG_API_KEY_NOT_SET)


def test_with_auth_and_a_key_only_the_key_opens_the_api(launched):
    url = launched(auth="alice:s3cret", api_key="sk-k3y").local_url
    assert answers(url, Authorization="Bearer sk-k3y")[0] == 200
    with httpx.Client(cookies=log_in(url), timeout=60) as user:
        assert user.post(url + "v1/chat/completions", json=CHAT).status_code == 401
    assert answers(url) == (401, MSG_API_KEY_MISSING)
    for header in ("Bearer sk-k3y-", "Bearer sk-k3", "Basic sk-k3y", "sk-k3y"):
        assert answers(url, Authorization=header)[0] == 401, header
    assert answers(url, Authorization="Bearer sk-wrong") == (401, MSG_API_KEY_WRONG)
    assert httpx.get(url + "gradio_api/info", headers={"Authorization": "Bearer sk-k3y"}, timeout=30).status_code == 401


def test_a_key_is_needed_beyond_loopback_and_whenever_one_is_set(launched):
    # A web process behind --web-processes listens on loopback for fronts at the public address.
    closed = launched(public_host="0.0.0.0").local_url
    assert answers(closed) == (401, MSG_API_KEY_NOT_SET)
    assert httpx.get(closed + "gradio_api/info", timeout=30).status_code == 200  # the page is as open as before
    keyed = launched(public_host="0.0.0.0", api_key="sk-lan").local_url
    assert answers(keyed, Authorization="Bearer sk-lan")[0] == 200
    on_loopback = launched(api_key="sk-local").local_url
    assert answers(on_loopback) == (401, MSG_API_KEY_MISSING) and answers(on_loopback, Authorization="Bearer sk-local")[0] == 200


@pytest.mark.parametrize("host, auth, needed", [("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
                                                ("0.0.0.0", None, True), ("192.168.1.20", None, True), ("myhost", None, True),
                                                ("127.0.0.1", "a:b", True)])
def test_when_a_key_is_needed(host, auth, needed):
    assert api_key_needed(AppConfig(host=host, auth=auth)) is needed


def test_the_key_comes_from_the_flag_or_the_environment_and_is_never_logged():
    assert parse_config(["--api-key", "sk-flag"]).api_key == "sk-flag"
    script = "from app.config import parse_config; c = parse_config([]); print(c.api_key, 'sk-env' in repr(c))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MINICPMV_API_KEY": "sk-env"})
    assert result.stdout.split() == ["sk-env", "False"], result.stderr[-2000:]
    assert parse_config([]).api_key is None


@pytest.mark.parametrize("key", ["", " ", " sk-padded", "sk-padded "])
def test_a_key_that_no_header_could_send_is_refused_at_the_start(key, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--api-key", key])
    assert "--api-key takes a key without spaces at its ends" in capsys.readouterr().err
