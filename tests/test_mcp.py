"""--mcp: the model as MCP tools through Gradio's MCP server, reached with the official `mcp` SDK over streamable
HTTP and SSE, behind --auth; files as base64 or uploads, links refused with nothing fetched."""

import ast
import asyncio
import base64
import contextlib
import http.server
import io
import os
import re
import threading
import time

import httpx
import pytest
from gradio_client import handle_file
from mcp import ClientSession, types
from mcp.shared.exceptions import McpError
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

from app import limits
from app.chat import strip_reasoning
from app.config import AppConfig, parse_config
from tests.conftest import ROOT, free_port, make_image, make_video, truncated_png, wait_for
from tests.test_sharing import OPEN_ROUTES, served_routes, status_of

USER, PASSWORD = "agent", "t00ls"
BASIC = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
TOOLS = {"describe_image", "ask_about_images", "ask_about_video"}
TRANSPORTS = ("streamable-http", "sse")
LINK_REFUSED = "is a link, and this app never fetches links"


@pytest.fixture(scope="module")
def greedy(manager):
    """The server's defaults, greedy and short, while this module runs: a tool's answer can then be compared
    with /ask's, and replies are quick."""
    settings = manager.default_settings().with_overrides({"do_sample": False, "max_new_tokens": 24})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manager, "default_settings", lambda: settings)
        yield settings


@pytest.fixture(scope="module")
def mcp_demo(manager, greedy):
    """`python app.py --mcp --auth agent:t00ls`, in this process (on the session's engine)."""
    from app.web.server import launch

    config = AppConfig(model="tiny-random", port=free_port(), engine_process=False, mcp=True, auth=f"{USER}:{PASSWORD}")
    demo = launch(config, manager, prevent_thread_lock=True, quiet=True)
    yield demo
    demo.close()


@pytest.fixture(scope="module")
def mcp_url(mcp_demo) -> str:
    return mcp_demo.local_url


@contextlib.asynccontextmanager
async def mcp_session(url: str, transport: str, headers=None):
    headers = BASIC if headers is None else headers
    async with contextlib.AsyncExitStack() as stack:
        if transport == "sse":
            opened = sse_client(url + "gradio_api/mcp/sse", headers=headers)
        else:
            http = await stack.enter_async_context(httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, read=300)))
            opened = streamable_http_client(url + "gradio_api/mcp/", http_client=http)
        read, write, *_ = await stack.enter_async_context(opened)
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        yield session


def calls(url: str, transport: str, *requests: tuple[str, dict]) -> list:
    """Each (tool, arguments) called in turn in one session: their results."""
    async def run():
        async with mcp_session(url, transport) as session:
            return [await session.call_tool(tool, arguments) for tool, arguments in requests]

    return asyncio.run(run())


def answer(result) -> str:
    assert not result.isError, result.content
    return "".join(part.text for part in result.content)


def refusal(result) -> str:
    assert result.isError, result.content
    return "".join(part.text for part in result.content)


def base64_of(path: str) -> str:
    with open(path, "rb") as file:
        return base64.b64encode(file.read()).decode()


def upload_files(upload_folder: str) -> set[str]:
    return {os.path.join(root, name) for root, _, names in os.walk(upload_folder) for name in names}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mcp-media")
    return {"red": make_image(folder, "red.png", (640, 480)), "blue": make_image(folder, "blue.jpg", (300, 500), (20, 40, 220)),
            "video": make_video(folder, "clip.mp4", seconds=4), "truncated": truncated_png(folder),
            "thin": make_image(folder, "thin.png", (1, 300)), "folder": str(folder)}


def test_off_by_default(manager, monkeypatch):
    """Without --mcp: no MCP routes and no tools among the API's endpoints, even with Gradio's own GRADIO_MCP_SERVER."""
    from app.web.server import launch

    assert not parse_config([]).mcp
    monkeypatch.setenv("GRADIO_MCP_SERVER", "True")
    demo = launch(AppConfig(model="tiny-random", port=free_port(), engine_process=False), manager,
                  prevent_thread_lock=True, quiet=True)
    try:
        for path in ("gradio_api/mcp/", "gradio_api/mcp/sse", "gradio_api/mcp/schema"):
            assert httpx.get(demo.local_url + path).status_code == 404
        endpoints = httpx.get(demo.local_url + "gradio_api/info").json()["named_endpoints"]
        assert "/ask" in endpoints and not TOOLS & {name.lstrip("/") for name in endpoints}
        assert not httpx.get(demo.local_url + "config").json()["mcp_server"]
    finally:
        demo.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_tools_are_listed_with_their_arguments_documented(mcp_url, transport):
    async def run():
        async with mcp_session(mcp_url, transport) as session:
            return (await session.list_tools()).tools, await session.call_tool("ask", {"text": "Hi"})

    tools, ask = asyncio.run(run())
    assert {tool.name for tool in tools} == TOOLS  # /ask is gradio_client's, not a tool (its files are components)
    for tool in tools:
        assert "MiniCPM-V" in tool.description and "Links are refused" in tool.description
        properties = tool.inputSchema["properties"]
        assert all(len(argument["description"]) > 20 for argument in properties.values()), tool.name
        assert "question" in properties
    schemas = {tool.name: tool.inputSchema for tool in tools}
    assert schemas["ask_about_images"]["properties"]["images"]["type"] == "array"
    assert schemas["describe_image"]["required"] == ["image"]
    assert "Unknown tool" in refusal(ask)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_tool_answers_as_the_api_does(mcp_url, client, media, transport):
    """Greedy, each tool's answer is /ask's answer to the same question about the same files: the same engine.
    The files it decoded are gone from the upload folder once it has answered."""
    from gradio.utils import get_upload_folder

    before = upload_files(get_upload_folder())
    video = f"data:video/mp4;base64,{base64_of(media['video'])}"
    described, compared, watched = calls(
        mcp_url, transport,
        ("describe_image", {"image": base64_of(media["red"]), "question": "What colour is it?"}),
        ("ask_about_images", {"images": [f"data:image/jpeg;base64,{base64_of(media['blue'])}", base64_of(media["red"])],
                              "question": "What changed?"}),
        ("ask_about_video", {"video": video, "question": "What happens?"}))
    expected = [client.predict(question, [handle_file(path) for path in paths], {}, api_name="/ask")[0]
                for question, paths in (("What colour is it?", [media["red"]]),
                                        ("What changed?", [media["blue"], media["red"]]),
                                        ("What happens?", [media["video"]]))]
    assert [answer(described), answer(compared), answer(watched)] == [strip_reasoning(text) for text in expected]
    assert all(answer(result) for result in (described, compared, watched))
    decoded = {"image.png", "image-1.jpg", "image-2.png", "video.mp4"}
    assert not {os.path.basename(path) for path in upload_files(get_upload_folder()) - before} & decoded


def test_a_question_about_an_uploaded_file(mcp_url, media, greedy):
    """A file too large to send inline is uploaded first (with the same login, as HTTP Basic), then named."""
    with open(media["video"], "rb") as file:
        uploaded = httpx.post(mcp_url + "gradio_api/upload", files=[("files", ("clip.mp4", file))], auth=(USER, PASSWORD))
    assert uploaded.status_code == 200, uploaded.text
    path = uploaded.json()[0]
    watched, described = calls(mcp_url, "streamable-http",
                               ("ask_about_video", {"video": path, "question": "What happens?"}),
                               ("describe_image", {"image": f"data:video/mp4;base64,{base64_of(media['video'])}"}))
    assert answer(watched)
    assert os.path.isfile(path)  # an upload stays for later questions, as in the chat
    assert "is a video, and describe_image takes images: use ask_about_video" in refusal(described)


async def no_prompt_nor_resource(url: str, transport: str, arguments: dict):
    """Gradio's MCP server also answers for prompts and resources, of which there are none."""
    async with mcp_session(url, transport) as session:
        assert (await session.list_prompts()).prompts == [] and (await session.list_resources()).resources == []
        with pytest.raises(McpError):
            await session.read_resource(arguments["video"])
        with pytest.raises(McpError):
            await session.get_prompt("ask_about_video", arguments)


class RecordingServer:
    """An HTTP server on loopback that serves an image to whoever asks, and notes every request."""

    def __init__(self, image_path: str):
        requests, data = self.requests, self.data = [], open(image_path, "rb").read()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                requests.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_links_are_refused_and_nothing_is_fetched(mcp_url, media, transport):
    recording = RecordingServer(media["red"])
    try:
        good = base64_of(media["red"])
        links = [f"{recording.url}/red.png", f"  {recording.url.replace('http', 'HTTP')}/red.png", "file:///etc/passwd",
                 f"rtsp://127.0.0.1:{recording.server.server_port}/clip", "concat:/etc/passwd|/etc/hosts",
                 f"https://127.0.0.1:{recording.server.server_port}/red.png"]
        results = calls(mcp_url, transport,
                        *[("describe_image", {"image": link}) for link in links],
                        ("ask_about_images", {"images": [good, f"{recording.url}/second.png"], "question": "Compare"}),
                        ("ask_about_video", {"video": f"{recording.url}/clip.mp4", "question": "What happens?"}),
                        # Gradio's own tool for /ask would take a URL for its files and fetch it: there is none.
                        ("ask", {"text": "What is it?", "files": [f"{recording.url}/ask.png"], "settings": {}}))
        for result in results[:-1]:
            assert LINK_REFUSED in refusal(result)
        assert "Unknown tool" in refusal(results[-1])
        asyncio.run(no_prompt_nor_resource(mcp_url, transport, {"video": f"{recording.url}/prompt.mp4", "question": "Hi"}))
        time.sleep(0.2)
        assert recording.requests == []
        assert httpx.get(f"{recording.url}/probe").status_code == 200 and recording.requests == ["/probe"]  # it records
    finally:
        recording.server.shutdown()


@pytest.mark.parametrize("tool, arguments, message", [
    ("describe_image", {"image": "/etc/passwd"}, "“passwd” was not uploaded to this app"),
    ("describe_image", {"image": "/tmp/../etc/hosts"}, "“hosts” was not uploaded to this app"),
    ("describe_image", {"image": "not base64, just words"}, "is neither base64 data (or a data: URL) nor the path"),
    ("describe_image", {"image": "data:image/png,%89PNG"}, "is neither base64 data"),
    ("describe_image", {"image": base64.b64encode(b"%PDF-1.7 not an image").decode()}, "“image” is not a supported file"),
    ("describe_image", {"image": "truncated"}, "“image.png” could not be read as an image"),
    ("describe_image", {"image": "thin"}, "“image.png” is 1x300 pixels, longer than 100 times"),
    ("describe_image", {"image": "red", "question": "  "}, "Type a question first."),
    ("describe_image", {"image": 42}, "Input validation error"),
    ("ask_about_images", {"images": [], "question": "Compare"}, "Send at least one image."),
    ("ask_about_images", {"images": ["red"] * 17, "question": "Compare"}, "17 images in one request; the limit is 16."),
    ("ask_about_images", {"images": "red", "question": "Compare"}, "Input validation error"),
    ("ask_about_video", {"video": "red", "question": "What happens?"}, "is an image, and ask_about_video takes videos"),
    ("ask_about_video", {"video": base64.b64encode(b"\0\0\0\x18ftypmp42" + b"\0" * 200).decode(), "question": "What?"},
     "“video.mp4” could not be decoded as a video"),
])
def test_bad_input_is_a_tool_error(mcp_url, media, tool, arguments, message):
    """Each refused with the app's message; the server answers the next call as before."""
    def filled(value):  # a media name stands for that file, in base64
        return base64_of(media[value]) if isinstance(value, str) and value in media else value

    arguments = {key: [filled(item) for item in value] if isinstance(value, list) else filled(value)
                 for key, value in arguments.items()}
    refused, next_one = calls(mcp_url, "streamable-http", (tool, arguments),
                              ("describe_image", {"image": base64_of(media["red"])}))
    assert message in refusal(refused)
    assert answer(next_one)


def test_a_file_over_the_upload_limit_is_refused_before_it_is_stored(mcp_url, media, monkeypatch):
    from gradio.utils import get_upload_folder

    monkeypatch.setattr(limits, "MAX_UPLOAD_MB", 1)
    noise = os.path.join(media["folder"], "noise.png")
    with open(noise, "wb") as file:
        file.write(open(media["red"], "rb").read() + os.urandom(3 * 2**19))  # a PNG of 1.5 MB
    before = upload_files(get_upload_folder())
    (refused,) = calls(mcp_url, "sse", ("describe_image", {"image": base64_of(noise)}))
    assert "“image” is 1.5 MB; the limit is 1 MB." in refusal(refused)
    assert not {path for path in upload_files(get_upload_folder()) - before if "image" in os.path.basename(path)}


def test_a_tool_called_over_http_with_too_few_values_is_told_its_parameters(mcp_url):
    """gr.api's inputs are labelled "1st", "2nd": the refusal names the function's parameters instead."""
    call = mcp_url + "gradio_api/call/describe_image"
    with httpx.Client(cookies=httpx.post(mcp_url + "login", data={"username": USER, "password": PASSWORD}).cookies,
                      timeout=60) as http:
        event = http.post(call, json={"data": []}).json()["event_id"]
        with http.stream("GET", f"{call}/{event}") as events:
            said = "".join(events.iter_text())
    assert "Too few values: this call takes 2 (image, question)." in said, said


def test_the_mcp_routes_need_the_login(mcp_demo, mcp_url):
    """Every route but the login form's answers 401 without the login; an MCP client sends it as HTTP Basic
    (or the cookie of POST /login); a wrong or malformed one is refused."""
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    wrong = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}x".encode()).decode()
    with httpx.Client(base_url=mcp_url, timeout=30) as http:
        for headers in ({}, {"Authorization": wrong}, {"Authorization": "Basic !!"}, {"Authorization": f"Bearer {PASSWORD}"}):
            assert http.post("/gradio_api/mcp/", json=initialize, headers={**accept, **headers}).status_code == 401
            assert status_of(http, "GET", "/gradio_api/mcp/sse") == 401
            assert http.post("/gradio_api/mcp/messages/?session_id=0", json=initialize).status_code == 401
            assert http.get("/gradio_api/mcp/schema").status_code == 401
        assert http.post("/gradio_api/mcp/", json=initialize, headers={**accept, **BASIC}).status_code == 200
        assert {tool["name"] for tool in http.get("/gradio_api/mcp/schema", headers=BASIC).json()} == TOOLS
        # The MCP SDK bounds a request at 4 MiB: a larger inline file is uploaded first (docs/MCP.md).
        too_large = {**initialize, "params": {**initialize["params"], "padding": "A" * 4 * 2**20}}
        assert http.post("/gradio_api/mcp/", json=too_large, headers={**accept, **BASIC}).status_code == 413
        routes = set(served_routes(mcp_demo.app.routes))
        assert len(routes) > 50 and {("GET", "/gradio_api/mcp/sse"), ("GET", "/gradio_api/mcp/schema")} <= routes
        for method, path in sorted(routes - OPEN_ROUTES):
            if method != "WEBSOCKET":
                assert status_of(http, method, re.sub(r"{[^}]*}", "x", path)) == 401, (method, path)
    cookies = httpx.post(mcp_url + "login", data={"username": USER, "password": PASSWORD}).cookies
    cookie = "; ".join(f"{name}={value}" for name, value in cookies.items())

    async def listed_with_the_cookie():
        async with mcp_session(mcp_url, "streamable-http", headers={"Cookie": cookie}) as session:
            return {tool.name for tool in (await session.list_tools()).tools}

    assert asyncio.run(listed_with_the_cookie()) == TOOLS


@pytest.mark.parametrize("transport, how", [("streamable-http", "client gone"), ("sse", "client gone"),
                                            ("sse", "notifications/cancelled")])
def test_a_call_cancelled_leaves_the_batch(mcp_url, manager, media, greedy, monkeypatch, transport, how):
    """The client gone mid-answer, or MCP's cancel (which a stateless streamable HTTP request cannot hear: it
    comes in a request of its own), and the call's request leaves the running batch at once, long before 4,000
    tokens; the session goes on."""
    long = greedy.with_overrides({"max_new_tokens": 4000, "min_new_tokens": 4000})
    monkeypatch.setattr(manager, "default_settings", lambda: long)
    stopped = manager.metrics.snapshot()["requests"]["stopped"]

    async def run():
        async with mcp_session(mcp_url, transport) as session:
            call = asyncio.ensure_future(session.call_tool("describe_image", {"image": base64_of(media["red"])}))
            assert await asyncio.to_thread(wait_for, lambda: manager.active_generations == 1, 60)
            if how == "client gone":
                call.cancel()
                return
            cancel = types.CancelledNotificationParams(requestId=1, reason="the user changed their mind")  # after initialize's 0
            await session.send_notification(types.ClientNotification(types.CancelledNotification(params=cancel)))
            assert await asyncio.to_thread(wait_for, lambda: manager.active_generations == 0, 10)
            assert {tool.name for tool in (await session.list_tools()).tools} == TOOLS
            call.cancel()

    asyncio.run(run())
    assert wait_for(lambda: manager.active_generations == 0, 10)
    assert wait_for(lambda: manager.metrics.snapshot()["requests"]["stopped"] == stopped + 1, 10)


def test_the_docs_example_runs_as_written(mcp_url, monkeypatch):
    with open(os.path.join(ROOT, "docs", "MCP.md")) as file:
        example = re.search(r"```python\n(.*?)```", file.read(), re.DOTALL).group(1)
    monkeypatch.chdir(ROOT)  # the example's image path is relative to the repository
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(example.replace("http://127.0.0.1:7860/", mcp_url).replace('"user", "password"', f"{USER!r}, {PASSWORD!r}"), {})
    tools, _, reply = printed.getvalue().partition("\n")
    assert set(ast.literal_eval(tools)) == TOOLS and reply.strip() and not reply.startswith("refused")


def test_the_flag_and_what_it_does_not_go_with(monkeypatch, capsys):
    assert parse_config(["--mcp"]).mcp
    monkeypatch.setenv("MINICPMV_MCP", "1")
    assert parse_config([]).mcp
    monkeypatch.delenv("MINICPMV_MCP")
    assert not parse_config([]).mcp
    monkeypatch.setenv("GRADIO_MCP_SERVER", "True")  # what the API page's MCP tab says to set, without --mcp
    assert parse_config([]).mcp
    with pytest.raises(SystemExit):
        parse_config(["--web-processes", "2"])
    assert "does not go with --mcp (on by MINICPMV_MCP or GRADIO_MCP_SERVER)" in capsys.readouterr().err
    monkeypatch.delenv("GRADIO_MCP_SERVER")
    with pytest.raises(SystemExit):
        parse_config(["--mcp", "--web-processes", "2"])
    assert "--web-processes above 1 does not go with --mcp" in capsys.readouterr().err
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "mcp" else found(name, *args))
    with pytest.raises(SystemExit):
        parse_config(["--mcp"])
    assert "--mcp needs the mcp package: pip install -r requirements.txt" in capsys.readouterr().err


@pytest.mark.parametrize("image_format, extension", [("JPEG", ".jpg"), ("PNG", ".png"), ("WEBP", ".webp"), ("GIF", ".gif"),
                                                     ("BMP", ".bmp"), ("TIFF", ".tiff")])
def test_an_image_is_known_by_its_first_bytes(image_format, extension):
    from PIL import Image

    from app.ui.inline_files import sniffed_extension

    encoded = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 30)).save(encoded, image_format)
    assert sniffed_extension(encoded.getvalue()) == extension


@pytest.mark.parametrize("name, fourcc", [("a.mp4", "mp4v"), ("a.mov", "mp4v"), ("a.avi", "MJPG"), ("a.webm", "VP80"),
                                          ("a.mkv", "MJPG")])
def test_a_video_is_known_by_its_first_bytes(tmp_path, name, fourcc):
    from app.ui.inline_files import sniffed_extension

    with open(make_video(tmp_path, name, seconds=1, fps=4, fourcc=fourcc), "rb") as file:
        assert sniffed_extension(file.read()) == os.path.splitext(name)[1]


def test_base64_wrapped_in_lines_or_url_safe_decodes_to_the_file(tmp_path, media):
    from app.ui.inline_files import InlineFiles

    data = open(media["blue"], "rb").read()
    inline = InlineFiles(str(tmp_path))
    wrapped = inline.path_of(base64.encodebytes(data).decode(), "image 1")  # MIME's lines of 76 characters
    url_safe_text = base64.urlsafe_b64encode(data).decode().rstrip("=")
    assert {"-", "_"} & set(url_safe_text)
    url_safe = inline.path_of(f"data:image/jpeg;base64,{url_safe_text}", "image 2")
    assert [os.path.basename(wrapped), os.path.basename(url_safe)] == ["image-1.jpg", "image-2.jpg"]
    assert open(wrapped, "rb").read() == data == open(url_safe, "rb").read()
    inline.remove()
    assert not os.listdir(tmp_path)
