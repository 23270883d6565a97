"""The OpenAI-compatible API: GET /v1/models and POST /v1/chat/completions, served by the app's own server
beside the UI and answered by the same engine, through the manager's stream() as the UI's replies are.

A request is read (its body bounded, JSON and base64 media decoded on a worker thread, app.web.openai_request
and app.web.data_urls), then its reply is followed on worker threads, one step at a time, as Gradio follows
a streaming handler. A client that goes away sets the reply's StopSignal: the request leaves the line or
the batch at the next decode step. The key is checked before any of this, by app.web.guard.
"""

import logging
import time

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app import limits, tuning
from app.engine.stop_signal import StopSignal
from app.errors import NotReady, UserError
from app.messages import (MSG_API_BODY_BROKE_OFF, MSG_API_BODY_TOO_LARGE, MSG_API_MODEL_NOT_FOUND, MSG_API_NOT_FOUND,
                          MSG_API_NOT_READY)
from app.web.data_urls import DataUrlFiles, lift_data_urls
from app.web.openai_errors import API_ROOT, ApiError, json_bytes
from app.web.openai_reply import DONE, Reply, error_event
from app.web.openai_request import ChatRequest, chat_request, parse_json
from app.web.uploads import giving_up_on_stalls

log = logging.getLogger(__name__)

_STREAM_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # a reverse proxy (nginx) passes each chunk on at once


def served_model(manager) -> str:
    """The model's name as the API gives it: what the app was started with (--model, or --openai-model)."""
    return manager.config.openai_model if manager.config.backend == "openai" else manager.config.model


def openai_routes(manager, janitor, threads: int) -> list[Route]:
    """The API's routes, for the app's server (app.web.server.launch); `threads`: replies followed at once."""
    api = OpenAIApi(manager, janitor, threads)
    every_method = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return [Route(f"{API_ROOT}/models", api.models, methods=["GET"]),
            Route(API_ROOT + "/models/{model:path}", api.model, methods=["GET"]),  # ids hold slashes (org/name)
            Route(f"{API_ROOT}/chat/completions", api.chat_completions, methods=["POST"]),
            Route(API_ROOT + "/{rest:path}", api.not_found, methods=every_method)]


class OpenAIApi:
    def __init__(self, manager, janitor, threads: int):
        self.manager, self.janitor = manager, janitor
        self.started = int(time.time())
        # Threads following replies (each waits for the engine's next update): as many as replies can run and
        # wait at once. Reading requests (JSON, base64) takes a few at a time: a flood of large bodies must
        # not take every core from the replies in progress.
        self.following = anyio.CapacityLimiter(threads)
        self.reading = anyio.CapacityLimiter(tuning.API_REQUESTS_READ_AT_ONCE)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request):
        if request.path_params["model"] != served_model(self.manager):
            return self._not_served(request.path_params["model"]).response()
        return JSONResponse(self._model())

    def _model(self) -> dict:
        return {"id": served_model(self.manager), "object": "model", "created": self.started, "owned_by": "minicpm-v-demo"}

    def _not_served(self, model: str) -> ApiError:
        return ApiError(404, MSG_API_MODEL_NOT_FOUND.format(model=model, served=served_model(self.manager)),
                        code="model_not_found", param="model")

    async def not_found(self, request: Request):
        message = MSG_API_NOT_FOUND.format(method=request.method, path=request.url.path)
        return ApiError(404, message, code="not_found").response()

    async def chat_completions(self, request: Request):
        try:
            raw = await _body(request)
            chat = await anyio.to_thread.run_sync(self._read, raw, request.app.uploaded_file_dir, limiter=self.reading)
        except ApiError as error:
            return error.response()
        return ChatReply(self, chat, Reply(served_model(self.manager)))

    def _read(self, raw: bytearray, upload_folder: str) -> ChatRequest:
        """The request, checked, its media stored (on a worker thread). Raises ApiError."""
        raw, lifted = lift_data_urls(raw)  # the JSON left is small: parsing it holds the GIL briefly
        body = parse_json(raw)
        if body.get("model") is not None and body["model"] != served_model(self.manager):
            raise self._not_served(body["model"])
        try:
            if not self.manager.loaded:
                raise NotReady(MSG_API_NOT_READY)
            defaults = self.manager.default_settings()
        except UserError as error:
            raise ApiError.of(error) from None
        files = DataUrlFiles(upload_folder, lifted)
        chat = chat_request(body, defaults, files.store)
        if files.stored:
            self.janitor.uploaded()  # the upload folder's size is checked now
        return chat


async def _body(request: Request) -> bytearray:
    """The request's body, refused past limits.MAX_API_REQUEST_MB (before it is all read) or when the client
    stalls or leaves."""
    limit = limits.MAX_API_REQUEST_MB * 2**20
    too_large = ApiError(413, MSG_API_BODY_TOO_LARGE.format(limit=limits.MAX_API_REQUEST_MB), code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()  # grown chunk by chunk: joining 300 MB at the end would hold the GIL for it
    try:
        async for chunk in giving_up_on_stalls(request).stream():
            if len(body) + len(chunk) > limit:
                raise too_large
            body += chunk
    except ClientDisconnect:
        raise ApiError(400, MSG_API_BODY_BROKE_OFF) from None
    return body


class ChatReply:
    """The answer to a chat completion request, as an ASGI app: the whole completion, or a stream of chunks
    that starts once the request is in line (a request refused before that gets its error's status)."""

    def __init__(self, api: OpenAIApi, chat: ChatRequest, reply: Reply):
        self.api, self.chat, self.reply = api, chat, reply

    async def __call__(self, scope, receive, send) -> None:
        stop = StopSignal()
        async with anyio.create_task_group() as group:
            group.start_soon(_stop_when_gone, receive, stop)
            try:
                await (self._stream if self.chat.stream else self._whole)(send, stop)
            except Exception as error:  # a fault of this module: the server goes on, the client hears of it
                log.error("The API's reply failed", exc_info=error)
                stop.set()
            finally:
                group.cancel_scope.cancel()

    async def _follow(self, stop: StopSignal, on_update) -> None:
        """Run the reply, `await on_update(update)` for each of its updates; raises UserError as stream() does."""
        updates = self.api.manager.stream(self.chat.messages, self.chat.settings, stop)
        try:
            while (update := await anyio.to_thread.run_sync(next, updates, None, limiter=self.api.following)) is not None:
                await on_update(update)
        finally:
            with anyio.CancelScope(shield=True):  # its clean-up takes the request out of the batch
                await anyio.to_thread.run_sync(updates.close, limiter=self.api.following)

    async def _whole(self, send, stop: StopSignal) -> None:
        last = []
        try:
            await self._follow(stop, lambda update: _keep(last, update))
        except UserError as error:
            await _send_error(send, ApiError.of(error))
            return
        if last and last[0].stats is not None:  # else the client has gone
            await _send_json(send, 200, self.reply.completion(last[0]))

    async def _stream(self, send, stop: StopSignal) -> None:
        usage = self.chat.include_usage
        started = False

        async def on_update(update) -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": _STREAM_HEADERS})
                await _send_body(send, self.reply.first_chunk(usage))
            await _send_body(send, self.reply.chunks_for(update, usage))

        try:
            await self._follow(stop, on_update)
        except UserError as error:
            if not started:
                await _send_error(send, ApiError.of(error))
                return
            await _send_body(send, error_event(ApiError.of(error).body()))
        if started:
            await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def _keep(kept: list, update) -> None:
    kept[:] = [update]


async def _stop_when_gone(receive, stop: StopSignal) -> None:
    """Set `stop` when the client disconnects (the body has been read: the next message is that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stop.set()


async def _send_body(send, data: bytes) -> None:
    if data:
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _send_error(send, error: ApiError) -> None:
    await _send_json(send, error.status, error.body(), error.headers())


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    data = json_bytes(body)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
