"""The public address in front of several web processes (app.web.processes): an HTTP proxy that keeps
each Gradio session on one web process.

A Gradio session lives in the process that serves it: its state, its queue of events, the stream of its
events' messages and its heartbeat. Every request of a session names it (a `session_hash` in the query
or the JSON body, or in the path of the heartbeat), and so does an upload's progress (`upload_id`); the
proxy sends requests that name the same key to the same process (by a hash of the key). The REST API's
POST /call hands out an event id and names no session; the proxy tags that id with its process
(`abc.w1`), so the GET that follows it finds the process whichever proxy process takes it (several can
share the address: app.web.processes.Fronts). Everything else (the page, its assets, uploads, files,
/metrics, the OpenAI-compatible API's requests, whose streams are relayed as they come) goes to the processes
in turn: they share the upload folder and one engine process.

A web process that dies is started again (seconds later). Meanwhile the sessions it held are gone, and the
proxy tells their clients so (EventsInProgress); a session whose process does not take connections goes to
the next live one, and stays there once its process is back (SessionRouter, MovedSessions).
"""

import ctypes
import hashlib
import itertools
import json
import logging
import multiprocessing
import re
import zlib

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from app.messages import MSG_WEB_PROCESS_DOWN
from app.web.openai_errors import ApiError, is_api_path

log = logging.getLogger(__name__)

# Headers of one connection, not of the request: not passed on (RFC 9110, 7.6.1).
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
               b"transfer-encoding", b"upgrade"}
_KEYS_IN_QUERY = ("session_hash", "upload_id")
_KEY_IN_BODY = ("/queue/join", "/cancel", "/component_server", "/component_server/")  # POSTs whose JSON names the session
_HANDS_OUT_EVENT_IDS = re.compile(r"/call/.+$")  # the REST API's POST /call/{api} (and /call/v2/{api})
_TAG = re.compile(r"^(.+)\.w(\d+)$")  # an event id tagged with its process; Gradio's own ids are hex
_REST_EVENT_STREAM = re.compile(r"/call/(v2/)?[^/]+/[^/]+$")  # GET /call/{api}/{event}: one event's messages
# The head of a queue message as Gradio writes it (orjson, msg and event_id first: gradio.server_messages.BaseMessage):
# read instead of parsing every streamed message, whose output can be a whole conversation.
_MESSAGE_HEAD = re.compile(rb'data: ?\{"msg":"(\w+)","event_id":"([^"]+)"')


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


class MovedSessions:
    """Sessions served by another web process than their own (it was down), and by which: a table in memory shared
    by the front processes. Every front must send a session's requests to one process; a front that sent its
    queue/join to one and its queue/data to another would break its event.

    Bounded: a session has the slot of its key's hash, and a later one of the same slot takes it (the earlier one
    then goes back to its own process, without its state)."""

    SLOTS = 1 << 17  # 1 MiB

    def __init__(self, context=multiprocessing):
        # Made by the fronts' parent (app.web.processes.Fronts) and handed to each front as it starts.
        self.table = context.RawArray(ctypes.c_uint64, self.SLOTS)

    def get(self, key: str) -> int | None:
        slot, fingerprint = self._place(key)
        entry = self.table[slot]  # one aligned 8-byte word: read and written whole
        return (entry & 0xFFFF) - 1 if entry and entry >> 16 == fingerprint else None

    def put(self, key: str, index: int) -> None:
        slot, fingerprint = self._place(key)
        self.table[slot] = fingerprint << 16 | (index + 1)

    def forget(self, key: str) -> None:
        if self.get(key) is not None:
            self.table[self._place(key)[0]] = 0

    def _place(self, key: str) -> tuple[int, int]:
        """(its slot, its fingerprint, 48 bits)."""
        digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
        return digest % self.SLOTS, digest >> 16


class SessionRouter:
    """Which web processes may serve a request, in order: the same first one for every request of a session or
    tagged event, unless that process did not take the connection."""

    def __init__(self, count: int, moved: MovedSessions | None = None):
        self.count = count
        self.moved = moved if moved is not None else MovedSessions()
        self._turns = itertools.count()

    def pick(self, key: str | None) -> int:
        return self.candidates(key)[0]

    def candidates(self, key: str | None) -> list[int]:
        if key is None:
            first = next(self._turns) % self.count
            return [(first + step) % self.count for step in range(self.count)]
        _, tagged = untag(key)
        if tagged is not None and tagged < self.count:
            return [tagged]  # the event is held there, nowhere else
        # Its own process, then the next ones, in an order every front agrees on, for when its own is down.
        home = self._home(key)
        order = [(home + step) % self.count for step in range(self.count)]
        moved = self.moved.get(key)
        if moved is None:
            return order
        return [moved] + [index for index in order if index != moved]

    def served(self, key: str | None, index: int) -> None:
        """Process `index` took a request of `key`: a session served away from its own process stays there, so
        that its own, back, does not take it without its state."""
        if key is None or untag(key)[1] is not None:
            return
        if index == self._home(key):
            self.moved.forget(key)
        else:
            self.moved.put(key, index)

    def _home(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.count


def tag(event_id: str, index: int) -> str:
    return f"{event_id}.w{index}"


def untag(key: str) -> tuple[str, int | None]:
    """(the event id as its process knows it, that process) for a tagged id; (key, None) for any other key."""
    match = _TAG.match(key)
    return (match.group(1), int(match.group(2))) if match else (key, None)


class Front:
    """The proxy, an ASGI app: `backends` are the web processes' base URLs; `moved`, shared with the other fronts."""

    def __init__(self, backends: list[str], moved: MovedSessions | None = None):
        self.backends = backends
        self.router = SessionRouter(len(backends), moved)
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
            refusal = (ApiError(503, MSG_WEB_PROCESS_DOWN, "service_unavailable_error").response()  # in OpenAI's shape
                       if is_api_path(scope["path"]) else PlainTextResponse(MSG_WEB_PROCESS_DOWN, status_code=502))
            await refusal(scope, receive, send)
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
            events = EventsInProgress.of(request.method, scope["path"], incoming)
            response = StreamingResponse(self._relay(incoming, index, events), status_code=incoming.status_code,
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
        failure, index = None, None
        for index in self.router.candidates(key):
            try:
                incoming = await self._send_to(index, request, target, headers, body, streamed_body)
            except httpx.HTTPError as error:
                failure = error
                # On to the next process when this one is down (it took no connection: restarting); one of no
                # session also after any failure. Part of a streamed body may be gone, though.
                if isinstance(error, httpx.ConnectError) or (key is None and not streamed_body):
                    continue
                break
            self.router.served(key, index)
            return incoming, index
        log.warning("Web process %d did not answer %s %s: %r", index, request.method, scope["path"], failure)
        return None, index

    async def _send_to(self, index: int, request: Request, target: str, headers: list, body: bytes | None,
                       streamed_body: bool) -> httpx.Response:
        """Send the request to web process `index`; its response, streaming. Raises httpx.HTTPError."""
        client = self._clients[index]
        # A request that can be sent again (no body, or one read here) is tried twice: a kept-alive connection
        # that the process has just closed fails the first time. Not when nothing listens there.
        again = not streamed_body
        while True:
            outgoing = client.build_request(request.method, target, headers=headers,
                                            content=request.stream() if streamed_body else body)
            try:
                return await client.send(outgoing, stream=True)
            except httpx.HTTPError as error:
                if not again or isinstance(error, httpx.ConnectError):
                    raise
                again = False

    async def _relay(self, incoming: httpx.Response, index: int, events: "EventsInProgress | None"):
        """The body of a web process's response as it comes. If the process goes away meanwhile, an event stream's
        events in progress end with an error that says so; any other response is cut short."""
        try:
            async for chunk in incoming.aiter_raw():
                if events is not None:
                    chunk = events.whole_messages(chunk)
                if chunk:
                    yield chunk
        except httpx.HTTPError as error:
            if self.closing:  # an orderly stop: the clients are not told that this part restarts
                return
            log.warning("Web process %d broke off a response: %s", index, error)
            if events is not None and events.open:
                yield events.farewell()

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


class EventsInProgress:
    """The events of a Gradio event stream (server-sent events) relayed from a web process that have not completed,
    read from its messages as they pass, and the messages that end them with an error if the stream breaks off.

    Gradio's clients take a stream that just ends for a cancelled event: gradio_client raised CancelledError with
    no message. A `process_completed` message with `success: false` and `output: {"error": ...}` is how Gradio
    itself ends an event that failed (gradio.queueing.Queue.process_events, gradio.utils.error_payload):
    gradio_client raises AppError(output["error"]) and the page shows it.
    """

    def __init__(self, rest_event: str | None = None):
        # The REST API's stream (GET /call/{api}/{event}) carries one event, the one in its path, until its
        # `event: complete` or `event: error`; the queue's (GET /queue/data) every event of a session, each
        # message naming its own (gradio.routes, queue_data and simple_predict_get).
        self.rest = rest_event is not None
        self.open: dict[str, None] = {rest_event: None} if self.rest else {}  # event ids, in order (an ordered set)
        self._tail = b""

    @classmethod
    def of(cls, method: str, path: str, response: httpx.Response) -> "EventsInProgress | None":
        """For a response that is one of Gradio's event streams; None for any other."""
        streams = response.headers.get("content-type", "").startswith("text/event-stream")
        if method != "GET" or not streams or "content-encoding" in response.headers:
            return None
        if path.endswith("/queue/data"):
            return cls()
        return cls(rest_event=path.rsplit("/", 1)[1]) if _REST_EVENT_STREAM.search(path) else None

    def whole_messages(self, chunk: bytes) -> bytes:
        """What to pass on of a chunk: the messages it completes. The rest waits for the next chunk, so that a
        message of farewell() never follows half of one (a stream's unfinished last message is dropped by any
        client of server-sent events anyway)."""
        self._tail += chunk
        end = self._tail.rfind(b"\n\n") + 2
        if end < 2:
            return b""
        messages, self._tail = self._tail[:end], self._tail[end:]
        for message in messages.split(b"\n\n")[:-1]:
            self._note(message)
        return messages

    def _note(self, message: bytes) -> None:
        if self.rest:
            if message.startswith((b"event: complete", b"event: error")):
                self.open.clear()
            return
        head = _MESSAGE_HEAD.match(message)
        if head is None:  # a heartbeat, or a message of no event
            return
        kind, event_id = head.group(1), head.group(2).decode()
        if kind == b"process_completed":
            self.open.pop(event_id, None)
        else:
            self.open[event_id] = None

    def farewell(self) -> bytes:
        """The messages that end every event in progress (self.open) with MSG_WEB_PROCESS_DOWN, then the stream."""
        error = {"error": MSG_WEB_PROCESS_DOWN, "duration": None, "visible": True, "title": "Error"}
        if self.rest:
            return f"event: error\ndata: {json.dumps(error)}\n\n".encode()
        messages = [{"msg": "process_completed", "event_id": event_id, "output": error, "success": False,
                     "title": "Error"} for event_id in self.open]
        messages.append({"msg": "close_stream", "event_id": None})  # as Gradio ends a stream whose events are done
        return b"".join(b"data: " + json.dumps(message).encode() + b"\n\n" for message in messages)
