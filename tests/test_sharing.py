"""Sharing safely: --auth guards page, API and files; uploads are not served to strangers; remote code stays off."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import httpx
import pytest
from gradio_client import Client, handle_file

from app.config import AppConfig, parse_config
from app.web.openai_errors import is_api_path
from app.model.checkpoint.loader import ModelSource, ModelUnavailable, load_model_and_processor
from tests.conftest import ROOT, free_port

METRICS_TOKEN = "scraper-7f3a"


def http_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture(scope="module")
def protected_app(tmp_path_factory):
    """`python app.py --model tiny-random` behind a login: its address and its log."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("auth") / "app.log"
    env = {**os.environ, "MINICPMV_AUTH": "alice:s3cret", "GRADIO_SERVER_PORT": str(port),
           "MINICPMV_METRICS_TOKEN": METRICS_TOKEN}
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
            # Answering (with 401); up once launch() has returned and the app has said where (the server
            # answers a moment before that).
            if "* Running on" in log_path.read_text():
                break
            time.sleep(0.2)
        except OSError:
            time.sleep(0.1)
    yield url, log_path
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def protected_url(protected_app):
    return protected_app[0]


def test_the_start_names_this_apps_share_flag(protected_app):
    """Gradio's own start-up lines advise `share=True` in `launch()`: the app says --share."""
    log = protected_app[1].read_text()
    assert "* Running on http://" in log and "(--share for a public link)" in log
    assert "share=True" not in log


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


# Open without a login: what the login form needs (app.web.guard.OPEN_PATHS) and nothing else. A route
# Gradio adds later is not on this list, so it fails the test below until it is judged.
OPEN_ROUTES = {("GET", "/"), ("HEAD", "/"), ("POST", "/login"), ("POST", "/login/"), ("GET", "/assets/{path:path}"),
               ("GET", "/static/{path:path}"), ("GET", "/theme.css"), ("GET", "/favicon.ico"), ("GET", "/robots.txt"),
               ("GET", "/gradio_api/startup-events")}


def served_routes(routes, prefix=""):
    """(method, path) of every route an app serves, those of included routers and mounted apps too
    (FastAPI 0.165 keeps an included router as one entry that holds its routes)."""
    for route in routes:
        if getattr(route, "original_router", None) is not None:
            yield from served_routes(route.original_router.routes, prefix + route.include_context.prefix)
        elif getattr(route, "routes", None) is not None:  # a Mount
            yield from served_routes(route.routes, prefix + route.path)
        elif getattr(route, "methods", None):
            for method in route.methods:
                yield method, prefix + route.path
        else:  # a websocket route
            yield "WEBSOCKET", prefix + route.path


def status_of(http: httpx.Client, method: str, path: str) -> int:
    """The status a request gets, read from its head (an open event stream would never end)."""
    with http.stream(method, path) as response:
        return response.status_code


def log_in(url: str) -> dict:
    response = httpx.post(url.rstrip("/") + "/login", data={"username": "alice", "password": "s3cret"})
    assert response.status_code == 200
    return dict(response.cookies)


@pytest.fixture(scope="module")
def launched(manager):
    """Start the app in this process with `config` overrides (its routes can then be listed); closed at the end."""
    from app.web.server import launch

    demos = []

    def start(**overrides):
        config = AppConfig(model="tiny-random", port=free_port(), engine_process=False, **overrides)
        demos.append(launch(config, manager, prevent_thread_lock=True, quiet=True))
        return demos[-1]

    yield start
    for demo in demos:
        demo.close()


def test_every_route_needs_the_login_but_the_login_form(launched):
    demo = launched(auth="alice:s3cret")
    routes = set(served_routes(demo.app.routes))
    assert len(routes) > 50 and ("POST", "/gradio_api/queue/join") in routes  # Gradio's own, not just the app's
    assert OPEN_ROUTES <= routes
    cookies = log_in(demo.local_url)
    open_routes, refused_with_login = set(), set()
    with httpx.Client(base_url=demo.local_url, timeout=30) as stranger, \
            httpx.Client(base_url=demo.local_url, timeout=30, cookies=cookies) as user:
        for method, path in sorted(routes):
            if method == "WEBSOCKET":
                continue  # none in Gradio 6.31; the guard closes one before accepting it
            concrete = re.sub(r"{[^}]*}", "x", path)  # any value: the login is checked before the route runs
            if status_of(stranger, method, concrete) != 401:
                open_routes.add((method, path))
            elif method == "GET" and "{" not in path and path not in ("/logout", "/gradio_api/dev/reload") \
                    and not is_api_path(path) and status_of(user, method, concrete) == 401:  # /v1: its own key
                refused_with_login.add(path)
        assert open_routes <= OPEN_ROUTES, f"open without a login: {sorted(open_routes - OPEN_ROUTES)}"
        assert not refused_with_login  # the login opens them
        for path in ("/docs", "/redoc", "/gradio_api/no-such-route", "//gradio_api/info", "/assets/../gradio_api/info"):
            assert status_of(stranger, "GET", path) in (401, 404), path  # unknown paths too
        assert status_of(stranger, "GET", "/docs") == 401
        assert status_of(user, "GET", "/metrics") == 200


def test_auth_guards_metrics_openapi_cancel_and_reset(protected_url):
    base = protected_url.rstrip("/")
    cancel = {"session_hash": "abc", "fn_index": 0, "event_id": "0" * 32}
    with httpx.Client(base_url=base, timeout=30) as stranger:
        for method, path, body in (("GET", "/metrics", None), ("GET", "/openapi.json", None), ("GET", "/docs", None),
                                   ("GET", "/redoc", None), ("GET", "/gradio_api/openapi.json", None),
                                   ("POST", "/gradio_api/cancel", cancel), ("POST", "/gradio_api/reset", {"event_id": "0" * 32}),
                                   ("GET", "/gradio_api/heartbeat/abc", None), ("POST", "/gradio_api/upload", None),
                                   ("GET", "/gradio_api/queue/data?session_hash=abc", None)):
            response = stranger.request(method, path, json=body)
            assert response.status_code == 401, (method, path, response.text[:200])
            assert "success" not in response.text
        # A scraper's token opens /metrics, and nothing else.
        for header in (f"Bearer {METRICS_TOKEN}x", f"Basic {METRICS_TOKEN}", "Bearer", METRICS_TOKEN):
            assert stranger.get("/metrics", headers={"Authorization": header}).status_code == 401
        scraped = stranger.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert scraped.status_code == 200 and "minicpmv" in scraped.text.lower()
        assert stranger.get("/openapi.json", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).status_code == 401
    with httpx.Client(base_url=base, timeout=30, cookies=log_in(protected_url)) as user:
        assert user.get("/metrics").status_code == 200
        assert user.get("/openapi.json").status_code == 200


def test_metrics_token_without_auth(launched, server_url):
    assert httpx.get(server_url + "metrics").status_code == 200  # no token, no login: open as before
    url = launched(metrics_token="t0ken").local_url
    assert httpx.get(url + "metrics").status_code == 401
    assert httpx.get(url + "metrics", headers={"Authorization": "Bearer t0ken-"}).status_code == 401
    assert httpx.get(url + "metrics", headers={"Authorization": "Bearer t0ken"}).status_code == 200
    assert httpx.get(url + "gradio_api/info").status_code == 200  # only /metrics wants it
    assert parse_config([]).metrics_token is None


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium") and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (scripts/test.sh installs it)")
def test_the_login_form_shows_and_logs_in_in_a_browser(protected_url):
    from playwright.sync_api import sync_playwright

    refused = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.on("response", lambda response: response.status == 401 and refused.append(response.url))
        page.goto(protected_url)
        page.locator("input[type=password]").fill("s3cret")
        page.locator("input:not([type=password])").first.fill("alice")
        page.get_by_role("button", name="Login").click()
        page.wait_for_selector("#chat-input textarea", timeout=60_000)
        browser.close()
    assert not refused  # nothing the form or the page needs was refused


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
