"""python app.py --web-processes 2 --front-processes 2: two web processes behind one address (two proxy
processes taking turns at it), sharing one engine process."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import httpx
import pytest
from gradio_client import Client

from app.config import parse_config
from app.engine.settings import GenerationSettings
from app.front import SessionRouter, routing_key, tag, untag
from tests.conftest import ROOT, free_port, make_image, picture_requests, wait_for
from tests.test_api import FIXED, stream
from tests import test_browser
from tests.test_browser import STATS_LINE, ask_about_an_image, open_page, set_max_new_tokens
from tests.test_engine_process import answers_at_once, reply, user

PROCESSES = 2
FRONTS = 2
browser = test_browser.browser  # the fixture, shared


class App:
    def __init__(self, port: int, log_path):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = {**os.environ, "MINICPMV_UPLOAD_MAX_AGE_S": "3600"}
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "app.py", "--model", "tiny-random", "--port", str(port), "--web-processes", str(PROCESSES),
                 "--front-processes", str(FRONTS)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def web_pids(self) -> dict[int, int]:
        """Web process index -> pid, the latest of each (from the log)."""
        return self.pids("Web process")

    def pids(self, kind: str) -> dict[int, int]:
        return {int(index): int(pid) for index, pid in re.findall(rf"{kind} (\d+) \(pid (\d+)\) serves", self.log())}

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def descendants(pid: int) -> set[int]:
    children = {int(child) for task in os.listdir(f"/proc/{pid}/task")
                for child in open(f"/proc/{pid}/task/{task}/children").read().split()}
    return children.union(*(descendants(child) for child in children if os.path.exists(f"/proc/{child}")))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    app = App(free_port(), tmp_path_factory.mktemp("web-processes") / "app.log")
    assert wait_for(lambda: "Running on" in app.log() or app.process.poll() is not None, 240), app.log()
    assert app.process.poll() is None, app.log()
    processes = descendants(app.process.pid)
    yield app
    # Ctrl+C in the terminal: every process of the app ends, cleanly.
    app.process.send_signal(signal.SIGINT)
    assert app.process.wait(60) == 0, app.log()
    assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in processes), 30)
    assert "Traceback" not in app.log()


def clients_on_each_process(url: str, per_process: int) -> list[Client]:
    """Clients whose sessions the front sends to each web process, `per_process` of each."""
    router, chosen = SessionRouter(PROCESSES), {index: [] for index in range(PROCESSES)}
    while any(len(clients) < per_process for clients in chosen.values()):
        client = Client(url, verbose=False)
        clients = chosen[router.pick(client.session_hash)]
        if len(clients) < per_process:
            clients.append(client)
    return [client for clients in chosen.values() for client in clients]


def test_each_user_gets_their_own_answer_from_either_web_process(app, manager, tmp_path):
    clients = clients_on_each_process(app.url, 4)
    requests = picture_requests(tmp_path, len(clients), seed=3, question="User {i}: what is in picture {i}?")
    settings = GenerationSettings(**FIXED)
    expected = {key: reply(manager, user(text, path), settings).text for key, (text, path) in requests.items()}
    answers = answers_at_once(lambda key: stream(clients[key], requests[key][0], [requests[key][1]], FIXED)[1][0], requests)
    assert len(set(expected.values())) > 4 and answers == expected  # nobody got anybody else's answer
    # A follow-up goes to the process that holds the session's conversation: it still has the picture.
    _, (_, stats) = stream(clients[-1], "And what colour is it?", [], {**FIXED, "follow_up": True})
    assert stats["visual_tokens"] > 0
    _, (_, stats) = stream(clients[-1], "A new question.", [], FIXED)
    assert stats["visual_tokens"] == 0


def test_the_rest_api_finds_its_event_on_either_process(app, tmp_path):
    """POST /call/ask hands out an event id; the GET that follows it must reach the process that holds it."""
    image = make_image(tmp_path, "small.png", size=(200, 160))
    with httpx.Client(base_url=app.url, timeout=60) as http:
        uploaded = http.post("/gradio_api/upload", files={"files": open(image, "rb")}).json()[0]
        for _ in range(2 * PROCESSES):  # the POSTs go to the processes in turn
            data = ["What is this?", [{"path": uploaded, "meta": {"_type": "gradio.FileData"}}], FIXED]
            event_id = http.post("/gradio_api/call/ask", json={"data": data}).json()["event_id"]
            events = http.get(f"/gradio_api/call/ask/{event_id}").text
            assert "event: complete" in events, events
            assert '"new_tokens": 24' in events


def test_the_page_streams_through_the_front_and_a_closed_tab_frees_the_batch(app, browser, red_image):
    page = open_page(browser, app.url)
    lengths = ask_about_an_image(page, red_image)
    assert len(set(lengths)) >= 4, lengths  # seen at several lengths while it streamed, through the proxy
    assert page.get_by_text(STATS_LINE).inner_text().startswith("640 visual tokens")
    assert page.locator("img[src*='red']").count() >= 1  # the upload is shown, served by either process

    set_max_new_tokens(page, 4000)
    page.locator("#chat-input textarea").fill("Write a very long essay.")
    page.locator("#chat-input textarea").press("Enter")
    assert wait_for(lambda: app.metric("minicpmv_batch_size") == 1, 30)
    page.close()
    assert wait_for(lambda: app.metric("minicpmv_batch_size") == 0, 20)  # well before 4000 tokens


def test_a_web_process_that_dies_is_replaced_and_its_request_leaves_the_batch(app):
    client = clients_on_each_process(app.url, 1)[1]  # a session of process 1
    old_pid = app.web_pids()[1]
    stopped_before = app.metric('minicpmv_requests_total{outcome="stopped"}')
    job = client.submit("Go on and on.", [], {"max_new_tokens": 4000, "min_new_tokens": 4000}, api_name="/ask")
    assert wait_for(lambda: app.metric("minicpmv_batch_size") == 1, 30)
    os.kill(old_pid, signal.SIGKILL)
    assert wait_for(lambda: app.metric("minicpmv_batch_size") == 0, 20)  # the engine dropped its request
    assert app.metric('minicpmv_requests_total{outcome="stopped"}') == stopped_before + 1
    with pytest.raises(Exception):
        job.result(timeout=30)
    assert wait_for(lambda: app.web_pids()[1] != old_pid, 120), app.log()
    fresh = clients_on_each_process(app.url, 1)[1]
    assert stream(fresh, "Back?", [], FIXED)[1][1]["new_tokens"] == 24


def test_a_front_that_dies_is_replaced_and_the_other_serves_meanwhile(app):
    fronts = app.pids("Front")
    assert sorted(fronts) == list(range(FRONTS))
    os.kill(fronts[0], signal.SIGKILL)
    for _ in range(10):  # new connections, at once: the other front takes them all
        assert httpx.get(app.url + "/metrics", timeout=30).status_code == 200
    assert wait_for(lambda: app.pids("Front")[0] != fronts[0], 60), app.log()
    for client in clients_on_each_process(app.url, 1):
        assert stream(client, "Still there?", [], FIXED)[1][1]["new_tokens"] == 24


def test_a_crashed_engine_process_is_restarted_and_both_web_processes_reconnect(app):
    def engine_pids():
        return re.findall(r"Engine process (\d+) serves", app.log())

    os.kill(int(engine_pids()[-1]), signal.SIGKILL)
    assert wait_for(lambda: len(engine_pids()) == 2, 120), app.log()
    for client in clients_on_each_process(app.url, 1):  # a request waits for its process to reconnect
        assert stream(client, "Back?", [], FIXED)[1][1]["new_tokens"] == 24


def test_routing_keys_of_gradio_requests():
    assert routing_key("/gradio_api/queue/data", {"session_hash": "s1"}, None) == "s1"
    assert routing_key("/gradio_api/heartbeat/s2", {}, None) == "s2"
    assert routing_key("/gradio_api/upload", {"upload_id": "u1"}, None) == "u1"
    assert routing_key("/gradio_api/queue/join", {}, json.dumps({"session_hash": "s3", "data": []}).encode()) == "s3"
    assert routing_key("/gradio_api/call/ask/e1", {}, None) == "e1"
    assert routing_key("/gradio_api/call/v2/ask/e2", {}, None) == "e2"
    assert routing_key("/gradio_api/call/ask", {}, b'{"data": []}') is None
    assert routing_key("/gradio_api/upload", {}, None) is None
    router = SessionRouter(3)
    assert {router.pick(None) for _ in range(3)} == {0, 1, 2}  # no session: in turn
    assert len({router.pick("same") for _ in range(5)}) == 1
    # The REST API's event ids come back tagged with their process, which any front can read.
    assert untag(tag("0f3a9c", 2)) == ("0f3a9c", 2) and router.pick(tag("0f3a9c", 2)) == 2
    assert untag("0f3a9c") == ("0f3a9c", None)
    assert router.pick(tag("0f3a9c", 7)) in (0, 1, 2)  # a process this layout does not have: hashed like any key


@pytest.mark.parametrize("flag", [["--share"], ["--auth", "a:b"], ["--allow-model-switch"], ["--in-process-engine"],
                                  ["--backend", "openai"]])
def test_web_processes_refuse_what_lives_in_one_process(flag, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--web-processes", "2", *flag])
    assert f"does not go with {' '.join(flag[:1] if flag[0] != '--backend' else flag)}" in capsys.readouterr().err
    assert parse_config(["--web-processes", "2"]).web_processes == 2


def test_front_processes_follow_the_web_processes_unless_set(capsys):
    from app.web_processes import front_processes

    assert [front_processes(parse_config(["--web-processes", str(count)])) for count in (2, 3, 4, 8)] == [1, 1, 2, 3]
    assert front_processes(parse_config(["--web-processes", "8", "--front-processes", "5"])) == 5
    with pytest.raises(SystemExit):
        parse_config(["--web-processes", "2", "--front-processes", "-1"])
    assert "--front-processes is 0 (automatic) or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--front-processes", "2"])
    assert "--front-processes goes with --web-processes above 1" in capsys.readouterr().err
