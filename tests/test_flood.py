"""A small public server under a flood: one wait line (the app's), and uploads that leave no debris and
stay under the folder's cap. One `python app.py` server for the module, with a line of 1 + 2 requests
and a 1 MB upload folder; its engine runs in the web process, which starts in half the time (what is
tested is the web side: Gradio's queue, the upload route, the janitor; tests/test_engine_process.py
covers the engine process's own "busy")."""

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from gradio_client import Client, handle_file

from app.web.uploads import STAGING_PREFIX, cap_total_size
from tests.conftest import ROOT, free_port, httpx_own_ssl_context, make_image, wait_for

LONG = {"max_new_tokens": 300, "min_new_tokens": 300, "do_sample": False}
STALL_TIMEOUT_S = 2


@dataclass
class Server:
    url: str
    port: int
    folder: str
    at_start: set  # files in the upload folder once it was up: the cached examples


def files_under(folder) -> set:
    return {os.path.join(root, name) for root, _, names in os.walk(folder) for name in names}


def bytes_under(folder) -> int:
    """The folder's size now; a file the cap removes between the listing and its size counts as gone."""
    total = 0
    for path in files_under(folder):
        try:
            total += os.path.getsize(path)
        except FileNotFoundError:
            pass
    return total


def debris(server) -> list:
    """What must not stay in the upload folder: uploads' own folders, temporary files at its top."""
    return [entry.name for entry in os.scandir(server.folder)
            if entry.name.startswith(STAGING_PREFIX) or entry.is_file()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    work = tmp_path_factory.mktemp("flood")
    folder = str(work / "uploads")
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_TEMP_DIR": folder,
           "MINICPMV_UPLOAD_MAX_TOTAL_MB": "1", "MINICPMV_UPLOAD_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
           # No expiry by age while the module runs: what goes, goes for the reasons tested here.
           "MINICPMV_UPLOAD_MAX_AGE_S": "36000", "MINICPMV_UPLOAD_CLEAN_EVERY_S": "36000"}
    log_path = work / "app.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--model", "tiny-random", "--queue-size", "2",
                                    "--max-batch-size", "1", "--no-warmup", "--in-process-engine"], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                urllib.request.urlopen(url + "gradio_api/info", timeout=5)
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        yield Server(url, port, folder, files_under(folder))
    finally:
        process.terminate()
        process.wait(30)


def test_a_crowd_beyond_the_line_is_told_the_demo_is_busy(server):
    # 30 users at once on a line of 3 (one answering, two waiting): Gradio lets every one through to the
    # engine, whose line takes the first and tells the rest, at once, that the demo is busy.
    with ThreadPoolExecutor(10) as pool:
        clients = list(pool.map(lambda _: Client(server.url, verbose=False), range(30)))
    jobs = [client.submit("Tell me a long story.", [], LONG, api_name="/ask") for client in clients]
    finished, refusals = [], []
    for job in jobs:
        try:
            finished.append(job.result(timeout=300)[1]["new_tokens"])
        except Exception as error:  # recorded, asserted below
            refusals.append(str(error))
    busy = [text for text in refusals if "The demo is busy" in text]
    print(f"crowd: {len(finished)} answered, {len(busy)} told the demo is busy, "
          f"{sum('queue is full' in text.lower() for text in refusals)} told Gradio's queue is full")
    assert busy == refusals, refusals  # nobody hears Gradio's "Queue is full", nor anything else
    assert len(finished) >= 3 and refusals
    assert finished == [LONG["max_new_tokens"]] * len(finished)  # whoever got in was answered whole


def start_upload(port: int, name: str = "files", length: int = 10 * 2**20) -> socket.socket:
    """A multipart upload of one file, its headers sent and its `length` bytes announced."""
    connection = socket.create_connection(("127.0.0.1", port))
    head = (b"--cut\r\nContent-Disposition: form-data; name=\"" + name.encode() + b"\"; filename=\"big.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n")
    connection.sendall(f"POST /gradio_api/upload HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                       f"boundary=cut\r\nContent-Length: {length + len(head) + 10}\r\n\r\n".encode() + head)
    return connection


def test_uploads_broken_off_or_stalled_leave_nothing(server):
    before = files_under(server.folder)
    connections = []
    for sent in (0, 1, 64 * 2**10, 4 * 2**20, 4 * 2**20 + 7):  # several at once, broken off at different points
        connection = start_upload(server.port)
        connection.sendall(b"\x89" * sent)
        connections.append(connection)
    time.sleep(0.5)  # let the server take in what was sent before the connections go
    for connection in connections:
        connection.close()
    assert wait_for(lambda: files_under(server.folder) == before and not debris(server), 15), debris(server)
    # A client that stops sending, its connection left open: given up after the stall timeout.
    stalled = start_upload(server.port)
    stalled.sendall(b"x" * 2**20)
    assert wait_for(lambda: debris(server), 5)  # its own folder, while it comes in
    started = time.monotonic()
    stalled.settimeout(STALL_TIMEOUT_S + 30)
    reply = stalled.recv(200)
    assert reply.startswith(b"HTTP/1.1 400") and time.monotonic() - started < STALL_TIMEOUT_S + 30
    stalled.close()
    assert wait_for(lambda: files_under(server.folder) == before and not debris(server), 10), debris(server)
    # A part Gradio does not keep (not named "files") and a malformed body leave nothing either.
    response = httpx.post(server.url + "gradio_api/upload", files={"file": ("x.png", b"abc" * 1000)})
    assert response.status_code == 200 and response.json() == []
    response = httpx.post(server.url + "gradio_api/upload", content=b"--cut\r\nnonsense",
                          headers={"Content-Type": "multipart/form-data; boundary=cut"})
    assert response.status_code in (200, 400)
    assert wait_for(lambda: files_under(server.folder) == before and not debris(server), 10), debris(server)


@pytest.fixture
def clients_at_their_own_pace(monkeypatch):
    """Clients that build a TLS context for each request, as gradio_client's do outside this suite
    (tests/conftest.py shares one): the bound below on empty files at a time is the rate of requests
    times the janitor's 1 s sweep, set for such clients; without that work they send about twice as
    many requests a second."""
    import httpx._transports.default as transports

    if httpx_own_ssl_context is not None:
        monkeypatch.setattr(transports, "create_ssl_context", httpx_own_ssl_context)


def test_uploads_leave_no_empty_temporary_files(server, tmp_path, clients_at_their_own_pace):
    # gr.File (the /ask API's files) made an empty temporary file for every file of every request.
    seen = []

    def ask(first):  # three users (the line's length), each asking about its own new images in turn
        client = Client(server.url, verbose=False)
        for i in range(first, 51, 3):
            image = make_image(tmp_path, f"tiny{i}.png", (16 + i, 16), (i * 5, 80, 160))
            client.predict(f"Picture {i}?", [handle_file(image)], {"max_new_tokens": 1}, api_name="/ask")
            seen.append(len(debris(server)))

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(ask, range(3)))
    assert wait_for(lambda: not debris(server), 10), debris(server)
    print(f"empty temporary files: at most {max(seen)} at a time over {len(seen)} requests")
    assert len(seen) == 51 and max(seen) <= 15  # each goes within about a second: bounded by the rate, not the count
    uploads = [path for path in files_under(server.folder) - server.at_start if "tiny" in path]
    assert len(uploads) == 51  # the uploads themselves stay


def test_the_folder_stays_under_its_cap_oldest_first(server):
    cap = 2**20
    stored = []
    for i in range(8):  # 8 x 200 kB past the 1 MB cap
        response = httpx.post(server.url + "gradio_api/upload", files={"files": (f"fill{i}.bin", os.urandom(200_000))})
        stored.extend(response.json())
        time.sleep(0.05)  # distinct modification times

    assert wait_for(lambda: bytes_under(server.folder) <= cap, 10), bytes_under(server.folder)
    kept = [os.path.exists(path) for path in stored]
    print(f"cap: {kept.count(True)} of {len(stored)} uploads kept, {bytes_under(server.folder):,} bytes in the folder")
    assert kept[-1] and not kept[0]
    assert kept == sorted(kept)  # the oldest went first
    assert server.at_start <= files_under(server.folder)  # the cached examples stay
    client = Client(server.url, verbose=False)  # and the demo still works
    assert client.predict("Hi", [], {"max_new_tokens": 1}, api_name="/ask")[1]["new_tokens"] == 1


def test_cap_total_size_spares_kept_files_and_uploads_coming_in(tmp_path):
    folder = tmp_path / "uploads"
    paths, now = [], time.time()
    names = ("example/a.jpg", "h0/.stale.png", "h1/old.png", ".upload-x/part", "h2/.copy.png", "h3/new.png")
    for i, name in enumerate(names):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
        made = now - 100 + i if name != "h2/.copy.png" else now  # the copy on its way into place is young
        os.utime(path, (made, made))
        paths.append(str(path))
    assert cap_total_size(str(folder), 3000, keep={paths[0]}) == 2  # an old dot-file is no copy: it goes
    assert [os.path.exists(path) for path in paths] == [True, False, False, True, True, True]
    assert cap_total_size(str(folder), 0, keep={paths[0]}) == 1  # never the kept, a young dot-file or one coming in
    assert [os.path.exists(path) for path in paths] == [True, False, False, True, True, False]


def test_an_upload_named_as_a_dot_file_is_stored_without_the_dots(server):
    # Else it would pass for Gradio's copy on its way into place, which the folder's cap spares.
    response = httpx.post(server.url + "gradio_api/upload", files={"files": ("..hidden.png", b"x" * 100)})
    assert response.status_code == 200
    stored = response.json()[0]
    assert os.path.basename(stored) == "hidden.png" and os.path.exists(stored)
    assert os.path.dirname(stored).startswith(server.folder)


def test_many_uploads_at_once_all_land(server):
    # The upload route runs beside the janitor: a burst of uploads is stored whole (then capped).
    results = []

    def upload(i):
        response = httpx.post(server.url + "gradio_api/upload", files={"files": (f"burst{i}.txt", f"{i}".encode() * 100)})
        results.append((response.status_code, response.json()))

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(status == 200 and len(paths) == 1 for status, paths in results)
    assert all(os.path.exists(paths[0]) for _, paths in results)
    assert wait_for(lambda: not debris(server), 10), debris(server)
