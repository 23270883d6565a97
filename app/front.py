"""The public address in front of several web processes (app.web_processes): an HTTP proxy that keeps
each Gradio session on one web process.

A Gradio session lives in the process that serves it: its state, its queue of events, the stream of its
events' messages and its heartbeat. Every request of a session names it (a `session_hash` in the query
or the JSON body, or in the path of the heartbeat), and so does an upload's progress (`upload_id`); the
proxy sends requests that name the same key to the same process (by a hash of the key). The REST API's
POST /call hands out an event id and names no session; the proxy tags that id with its process
(`abc.w1`), so the GET that follows it finds the process whichever proxy process takes it (several can
share the address: app.web_processes.Fronts). Everything else (the page, its assets, uploads, files,
/metrics) goes to the processes in turn: they share the upload folder and one engine process.
"""

import itertools
import json
import logging
import re
import zlib

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from app import limits

log = logging.getLogger(__name__)

# Headers of one connection, not of the request: not passed on (RFC 9110, 7.6.1).
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
               b"transfer-encoding", b"upgrade"}
_KEYS_IN_QUERY = ("session_hash", "upload_id")
_KEY_IN_BODY = ("/queue/join", "/cancel", "/component_server", "/component_server/")  # POSTs whose JSON names the session
_HANDS_OUT_EVENT_IDS = re.compile(r"/call/.+$")  # the REST API's POST /call/{api} (and /call/v2/{api})
_TAG = re.compile(r"^(.+)\.w(\d+)$")  # an event id tagged with its process; Gradio's own ids are hex


def routing_key(path: str, query: dict, body: bytes | None) -> str | None:
    """The session (or upload, or event) a request belongs to; None if it belongs to none."""
    for name in _KEYS_IN_QUERY:
        if query.get(name):
            return query[name]
    parts = path.strip("/").split("/")
    for marker in ("heartbeat", "stream"):  # heartbeat/{session}, stream/{session or event}/...
        if marker in parts[:-1]:
            return parts[parts.index(marker) + 1]
    if "call" in parts:  # call/{api}/{event} and call/v2/{api}/{event}
        rest = parts[parts.index("call") + 1:]
        rest = rest[1:] if rest[:1] == ["v2"] else rest
        if len(rest) == 2:
            return rest[1]
    if body:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if isinstance(value, dict) and isinstance(value.get("session_hash"), str):
            return value["session_hash"]
    return None


class SessionRouter:
    """Which web process serves a request: the same one for every request of a session or tagged event."""

    def __init__(self, count: int):
        self.count = count
        self._turns = itertools.count()

    def pick(self, key: str | None) -> int:
        if key is None:
            return next(self._turns) % self.count
        _, tagged = untag(key)
        if tagged is not None and tagged < self.count:
            return tagged
        return zlib.crc32(key.encode()) % self.count


def tag(event_id: str, index: int) -> str:
    return f"{event_id}.w{index}"


def untag(key: str) -> tuple[str, int | None]:
    """(the event id as its process knows it, that process) for a tagged id; (key, None) for any other key."""
    match = _TAG.match(key)
    return (match.group(1), int(match.group(2))) if match else (key, None)


class Front:
    """The proxy, an ASGI app: `backends` are the web processes' base URLs."""

    def __init__(self, backends: list[str]):
        self.backends = backends
        self.router = SessionRouter(len(backends))
        self.closing = False  # set when the processes are being stopped: their streams end then
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
        # Idle connections are dropped here before a web process drops them (uvicorn: after 5 s), so that
        # a request is not sent down one that the process is closing at that moment.
        pool = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2)
        self._clients = [httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=10), limits=pool)
                         for url in backends]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # Gradio's pages use HTTP only (server-sent events, no websockets)
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        request = Request(scope, receive)
        body = await request.body() if request.method == "POST" and scope["path"].endswith(_KEY_IN_BODY) else None
        key = routing_key(scope["path"], request.query_params, body)
        incoming, index = await self._send_on(request, body, key)
        if incoming is None:
            await PlainTextResponse(limits.MSG_WEB_PROCESS_DOWN, status_code=502)(scope, receive, send)
            return
        response_headers = [(name, value) for name, value in incoming.headers.raw if name.lower() not in _HOP_BY_HOP]
        if request.method == "POST" and incoming.status_code == 200 and _HANDS_OUT_EVENT_IDS.search(scope["path"]):
            content = b"".join([chunk async for chunk in incoming.aiter_raw()])
            await incoming.aclose()
            content = self._tagged_event(content, incoming.headers.get("content-encoding"), index)
            response = Response(content, status_code=incoming.status_code)
            response_headers = [(name, value) for name, value in response_headers if name.lower() != b"content-length"]
            response_headers.append((b"content-length", str(len(content)).encode()))
        else:
            # Streamed as it comes (server-sent events); when the client goes, the stream to the process is closed.
            response = StreamingResponse(self._relay(incoming, index), status_code=incoming.status_code,
                                         background=BackgroundTask(incoming.aclose))
        response.raw_headers = response_headers
        await response(scope, receive, send)

    async def _send_on(self, request: Request, body: bytes | None, key: str | None) -> tuple[httpx.Response | None, int]:
        """Send the request to its web process; (its response, streaming, or None if none answered; the process)."""
        scope = request.scope
        names = {name for name, _ in scope["headers"]}
        streamed_body = body is None and (b"content-length" in names or b"transfer-encoding" in names)
        headers = [(name, value) for name, value in scope["headers"]
                   if name not in _HOP_BY_HOP and not name.startswith(b"x-forwarded-")]
        headers += [(b"x-forwarded-for", (scope["client"][0] if scope.get("client") else "").encode()),
                    (b"x-forwarded-proto", scope["scheme"].encode())]
        target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        if key is not None:
            event_id, tagged = untag(key)
            if tagged is not None:  # the process knows the event by its own id
                target = target.replace(key, event_id)
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        # A request that can be sent again (no body, or one read here) is tried twice on its process: a kept-alive
        # connection that the process has just closed fails the first time. One of no session may then go to
        # the next process (past one that is restarting).
        index = self.router.pick(key)
        attempts = [index] * (1 if streamed_body else 2)
        if key is None:
            attempts += [(index + step) % len(self.backends) for step in range(1, len(self.backends))]
        failure = None
        for index in attempts:
            client = self._clients[index]
            outgoing = client.build_request(request.method, target, headers=headers,
                                            content=request.stream() if streamed_body else body)
            try:
                return await client.send(outgoing, stream=True), index
            except httpx.HTTPError as error:
                failure = error
                if streamed_body and not isinstance(error, httpx.ConnectError):  # part of the body may be gone
                    break
        log.warning("Web process %d did not answer %s %s: %r", index, request.method, scope["path"], failure)
        return None, index

    async def _relay(self, incoming: httpx.Response, index: int):
        """The body of a web process's response as it comes; cut short, quietly, if the process goes away."""
        try:
            async for chunk in incoming.aiter_raw():
                yield chunk
        except httpx.HTTPError as error:
            if not self.closing:
                log.warning("Web process %d broke off a response: %s", index, error)

    def _tagged_event(self, content: bytes, encoding: str | None, index: int) -> bytes:
        """The response to POST /call with its event id tagged with the process that holds the event."""
        if encoding:  # compressed: Gradio compresses only large responses, and event ids are small
            return content
        try:
            answer = json.loads(content)
        except ValueError:
            return content
        if not isinstance(answer, dict) or not isinstance(answer.get("event_id"), str):
            return content
        return json.dumps({**answer, "event_id": tag(answer["event_id"], index)}).encode()
