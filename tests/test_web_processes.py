"""python app.py --web-processes 2 --front-processes 2: two web processes behind one address (two proxy
processes taking turns at it), sharing one engine process."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
from openai import OpenAI
from gradio.server_messages import (EstimationMessage, HeartbeatMessage, ProcessCompletedMessage,
                                    ProcessGeneratingMessage, ProcessStartsMessage)
from gradio_client import Client
from gradio_client.exceptions import AppError

from app.messages import MSG_WEB_PROCESS_DOWN
from app.config import parse_config
from app.engine.settings import GenerationSettings
from app.web.proxy import EventsInProgress, MovedSessions, SessionRouter, routing_key, tag, untag
from tests.conftest import ROOT, free_port, interruptible, make_image, picture_requests, wait_for
from tests.test_api import FIXED, stream
from tests import test_browser
from tests.test_browser import STATS_LINE, ask_about_an_image, open_page, set_max_new_tokens
from tests.test_engine_process import answers_at_once, reply, user
from tests.test_openai_api import data_url, direct, said

PROCESSES = 2
FRONTS = 2
LONG = {"max_new_tokens": 2000, "min_new_tokens": 2000, "do_sample": False}
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
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=interruptible)

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


def test_the_openai_api_streams_through_the_fronts_from_either_web_process(app, manager, tmp_path):
    api = OpenAI(base_url=app.url + "/v1", api_key="not-needed-on-loopback", max_retries=0)
    picture = make_image(tmp_path, "small.png", size=(200, 160))
    messages = said("What is this?", {"type": "image_url", "image_url": {"url": data_url(picture)}})
    expected = direct(manager, [{"role": "user", "content": [{"type": "image", "path": picture},
                                                             {"type": "text", "text": "What is this?"}]}]).text
    exact = {"model": "tiny-random", "messages": messages, "max_tokens": 24, "temperature": 0, "extra_body": {"min_tokens": 24}}
    for _ in range(2 * PROCESSES):  # the requests go to the processes in turn
        assert api.chat.completions.create(**exact).choices[0].message.content == expected
    chunks = list(api.chat.completions.create(**exact, stream=True))
    # The role, then the text (one chunk or more: a busy machine's engine hands over 24 tokens at once), then the end.
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected and len(chunks) >= 3
    # A client that leaves in the middle of a reply takes it out of the batch behind the fronts too.
    long = api.chat.completions.create(model="tiny-random", messages=said("Go on and on."), stream=True,
                                       max_tokens=4000, extra_body={"min_tokens": 4000})
    pieces = iter(long)
    for _ in range(3):
        next(pieces)
    assert wait_for(lambda: app.metric("minicpmv_batch_size") == 1, 30)
    long.close()
    assert wait_for(lambda: app.metric("minicpmv_batch_size") == 0, 20)  # well before 4000 tokens


def test_an_api_request_that_no_web_process_takes_gets_openais_error_shape():
    import asyncio

    from app.web.proxy import Front

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=Front([f"http://127.0.0.1:{free_port()}"]))
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            return await client.post("/v1/chat/completions", json={"messages": []})

    response = asyncio.run(ask())
    assert response.status_code == 503 and response.json()["error"]["message"] == MSG_WEB_PROCESS_DOWN


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


def new_session_on(url: str, index: int) -> Client:
    """A new client whose session's own web process (by the front's hash) is `index`."""
    router = SessionRouter(PROCESSES)
    while True:
        client = Client(url, verbose=False)
        if router.pick(client.session_hash) == index:
            return client
        client.close()


def failures_at_once(ask, count: int) -> list[tuple[int, str]]:
    """Run ask(i) for i < count, each on a thread of its own, all at once: (i, error) for each that failed."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(ask, i) for i in range(count)]
    return [(i, repr(future.exception())) for i, future in enumerate(futures) if future.exception() is not None]


def error_of(job) -> BaseException:
    try:
        job.result(timeout=60)
    except BaseException as error:  # concurrent.futures.CancelledError is one
        return error
    raise AssertionError("The reply ended without an error")


def ask_a_new_session(clients: list, i: int, url: str, process: int) -> None:
    clients[i] = new_session_on(url, process)
    assert stream(clients[i], f"User {i}, new here.", [], FIXED)[1][1]["new_tokens"] == 24


def test_a_web_process_that_dies_says_so_and_others_serve_its_new_sessions_until_it_is_back(app, browser, red_image):
    # A page and an API client of one web process, each in the middle of a long reply.
    page = open_page(browser, app.url)
    set_max_new_tokens(page, 4000)
    page.locator("#chat-input textarea").fill("Write a very long essay.")
    # ...with its stream of messages open: the front learns an event's id from the messages that pass.
    with page.expect_request(lambda request: "/queue/join" in request.url) as join, \
            page.expect_response(lambda response: "/queue/data" in response.url):
        page.locator("#chat-input textarea").press("Enter")
    dead = SessionRouter(PROCESSES).pick(json.loads(join.value.post_data)["session_hash"])
    client = clients_on_each_process(app.url, 1)[dead]
    old_pid = app.web_pids()[dead]
    stopped_before = app.metric('minicpmv_requests_total{outcome="stopped"}')
    job = client.submit("Go on and on.", [], LONG, api_name="/ask")
    assert wait_for(lambda: job.outputs() and app.metric("minicpmv_batch_size") == 2, 30)
    # The parent, which starts a dead web process again, is held meanwhile: the process stays down for as long
    # as this part takes, however slow the machine.
    os.kill(app.process.pid, signal.SIGSTOP)
    try:
        os.kill(old_pid, signal.SIGKILL)
        # Both are told what happened (it was a bare CancelledError), and the engine drops both replies.
        error = error_of(job)
        assert isinstance(error, AppError) and str(error) == MSG_WEB_PROCESS_DOWN, repr(error)
        page.get_by_text(MSG_WEB_PROCESS_DOWN).first.wait_for(timeout=30_000)
        page.close()
        assert wait_for(lambda: app.metric("minicpmv_batch_size") == 0, 20)
        assert app.metric('minicpmv_requests_total{outcome="stopped"}') == stopped_before + 2

        # New sessions whose own process is the dead one are served by the other one (they got 502 Bad
        # Gateway); one asks about a picture.
        clients = [None] * 10
        failures = failures_at_once(lambda i: ask_a_new_session(clients, i, app.url, dead), len(clients))
        assert not failures, f"{len(failures)} of 10 new sessions failed while web process {dead} was down: {failures}"
        moved = new_session_on(app.url, dead)
        assert stream(moved, "What is in this picture?", [red_image], FIXED)[1][1]["visual_tokens"] > 0
    finally:
        os.kill(app.process.pid, signal.SIGCONT)

    assert wait_for(lambda: app.web_pids()[dead] != old_pid, 120), app.log()
    # Back: every process serves, and the sessions that went elsewhere meanwhile are still served there, through
    # either front (when only the front that moved a session knew, its queue/join and queue/data could reach
    # different processes); the process that is back does not have this one's picture.
    for fresh in clients_on_each_process(app.url, 1):
        assert stream(fresh, "Back?", [], FIXED)[1][1]["new_tokens"] == 24
    failures = failures_at_once(lambda i: stream(clients[i], "Still there?", [], FIXED), len(clients))
    assert not failures, f"{len(failures)} of 10 moved sessions failed once web process {dead} was back: {failures}"
    _, (_, stats) = stream(moved, "And what colour is it?", [], {**FIXED, "follow_up": True})
    assert stats["visual_tokens"] > 0


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


def test_a_session_whose_process_is_down_goes_to_the_next_and_stays_there():
    moved = MovedSessions()
    router, other_front = SessionRouter(3, moved), SessionRouter(3, moved)
    key = next(key for key in map(str, range(100)) if router.pick(key) == 1)
    assert router.candidates(key) == [1, 2, 0]  # its own process, then the next ones: every front agrees
    assert router.candidates(tag("0f3a9c", 2)) == [2]  # an event is held by its process only
    router.served(key, 2)  # 1 took no connection
    assert router.candidates(key) == other_front.candidates(key) == [2, 1, 0]  # 1, back, does not take it
    assert SessionRouter(3).candidates(key) == [1, 2, 0]  # fronts that do not share the table would not agree
    other_front.served(key, 1)  # 2 died too, and 1 served it
    assert router.candidates(key) == [1, 2, 0]
    # Bounded: a later session whose key has the same slot takes it, and the earlier one goes home.
    same_slot = next(other for other in map(str, range(10**6))
                     if other != key and moved._place(other)[0] == moved._place(key)[0])
    router.served(key, 2)
    router.served(same_slot, (router.pick(same_slot) + 1) % 3)
    assert router.pick(key) == 1 and moved.get(same_slot) is not None


def gradio_stream(*messages) -> bytes:
    """Messages as gradio.routes' queue_data writes them."""
    return b"".join(b"data: " + orjson.dumps(message.model_dump(), default=str) + b"\n\n" for message in messages)


def test_a_broken_event_stream_ends_its_events_in_progress_with_a_clear_error():
    sse = httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"})
    events = EventsInProgress.of("GET", "/gradio_api/queue/data", sse)
    generating = ProcessGeneratingMessage(event_id="a", output={"data": [["append", [0], "word"]]}, success=True)
    relayed = gradio_stream(EstimationMessage(event_id="a", rank=0, queue_size=1), ProcessStartsMessage(event_id="b"),
                            HeartbeatMessage(), generating,
                            ProcessCompletedMessage(event_id="b", output={}, success=True))
    unfinished = gradio_stream(ProcessStartsMessage(event_id="c"))[:20]
    passed = b"".join(events.whole_messages(relayed[start:start + 7]) for start in range(0, len(relayed), 7))
    assert passed == relayed and events.whole_messages(unfinished) == b""  # whole messages only
    messages = [json.loads(message[len("data: "):]) for message in events.farewell().split(b"\n\n")[:-1]]
    error = {"error": MSG_WEB_PROCESS_DOWN, "duration": None, "visible": True, "title": "Error"}
    ended = {"msg": "process_completed", "event_id": "a", "output": error, "success": False, "title": "Error"}
    assert messages == [ended, {"msg": "close_stream", "event_id": None}]  # "b" completed, "c" never started

    # The REST API's stream carries one event, in its path.
    events = EventsInProgress.of("GET", "/gradio_api/call/ask/0f3a9c.w1", sse)
    events.whole_messages(b'event: generating\ndata: ["w", {}]\n\n')
    assert events.open and events.farewell() == f"event: error\ndata: {json.dumps(error)}\n\n".encode()
    events.whole_messages(b'event: complete\ndata: ["words", {}]\n\n')
    assert not events.open
    assert EventsInProgress.of("GET", "/gradio_api/heartbeat/s1", sse) is None
    assert EventsInProgress.of("GET", "/gradio_api/queue/data", httpx.Response(404, json={})) is None


@pytest.mark.parametrize("flag", [["--share"], ["--auth", "a:b"], ["--allow-model-switch"], ["--in-process-engine"],
                                  ["--backend", "openai"]])
def test_web_processes_refuse_what_lives_in_one_process(flag, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--web-processes", "2", *flag])
    assert f"does not go with {' '.join(flag[:1] if flag[0] != '--backend' else flag)}" in capsys.readouterr().err
    assert parse_config(["--web-processes", "2"]).web_processes == 2


def test_front_processes_follow_the_web_processes_unless_set(capsys):
    from app.web.processes import front_processes

    assert [front_processes(parse_config(["--web-processes", str(count)])) for count in (2, 3, 4, 8)] == [1, 1, 2, 3]
    assert front_processes(parse_config(["--web-processes", "8", "--front-processes", "5"])) == 5
    with pytest.raises(SystemExit):
        parse_config(["--web-processes", "2", "--front-processes", "-1"])
    assert "--front-processes is 0 (automatic) or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--front-processes", "2"])
    assert "--front-processes goes with --web-processes above 1" in capsys.readouterr().err
