"""How one benchmark user sends its requests (benchmarks/concurrency.py), in each mode: a requester is a
function of the level's abort event that sends the user's next request and returns (its time to first token
in ms, its stats: the engine's, or the API's token counts). Each user's requests are a workload's
(benchmarks/workloads.py); a follow-up's user opens its conversation as its requester is made."""

import json
import threading
import time
from contextlib import closing

from benchmarks.streaming_client import streamed_outputs
from benchmarks.workloads import UserRequests, answer_text, engine_reply, openai_messages, text_and_files


class Aborted(Exception):
    """The level's time ran out while this request was still waiting or streaming."""


def engine_request(manager, messages: list[dict], settings, abort: threading.Event) -> tuple[float, dict]:
    """(time to first token in ms, the reply's stats) of a request of `messages`, in-process."""
    update = _last_update(manager, messages, settings, abort)
    return update.stats["ttft_ms"], update.stats


def _last_update(manager, messages: list[dict], settings, abort: threading.Event):
    with closing(manager.stream(messages, settings)) as updates:
        for update in updates:
            if abort.is_set():
                raise Aborted
    return update


def _next_engine_request(manager, requests: UserRequests, settings, abort: threading.Event) -> tuple[float, dict]:
    """engine_request of the user's next request, whose answer goes into the user's conversation."""
    update = _last_update(manager, requests.next_messages(), settings, abort)
    requests.answered(answer_text(update))
    return update.stats["ttft_ms"], update.stats


def engine_requester(manager, workload, settings, user: int):
    """User `user`'s requests of `workload` (its conversation opened first, if a follow-up), in-process."""
    requests = UserRequests(workload, user)
    requests.open(lambda messages: engine_reply(manager, messages, settings)[0])
    return lambda abort: _next_engine_request(manager, requests, settings, abort)


def app_request(client, text: str, paths: list[str], settings, abort: threading.Event) -> tuple[float, dict]:
    """(time to first token in ms as the client saw it, the reply's stats), through gradio_client."""
    from gradio_client import handle_file

    started, submitted_at = time.perf_counter(), time.time()
    first = None
    job = client.submit(text, [handle_file(path) for path in paths], settings, api_name="/ask")
    for reply, _ in streamed_outputs(job, poll_s=0.01):  # 200 users' threads: 10 ms polls
        if abort.is_set():
            job.cancel()
            raise Aborted
        if reply and first is None:
            first = time.perf_counter()
    return round(((first or time.perf_counter()) - started) * 1000, 1), {**job.result()[1], "submitted_at": submitted_at,
                                                                         **status_times(job)}


def app_requester(client, workload, settings: dict, user: int):
    """User `user`'s requests through /ask; a follow-up's conversation is this client's, kept by the server."""
    from gradio_client import handle_file

    requests = UserRequests(workload, user)
    asked = {**settings, **workload.settings}

    def answer(messages):
        text, paths = text_and_files(messages[-1])
        return client.predict(text, [handle_file(path) for path in paths], asked, api_name="/ask")[0]

    requests.open(answer)
    timed = {**asked, "follow_up": True} if workload.follow_up else asked
    return lambda abort: app_request(client, *text_and_files(requests.next_messages()[-1]), timed, abort)


def openai_request(client, model: str, messages: list[dict], fields: dict, abort: threading.Event) -> tuple[float, dict]:
    """(time to first token in ms as the client saw it, the reply's token counts), streamed through the
    OpenAI-compatible API; `fields`: the body's other fields (api_fields)."""
    started, first, usage = time.perf_counter(), None, None
    extra = {key: value for key, value in fields.items() if key not in ("model", "max_tokens", "temperature")}
    with client.chat.completions.create(model=model, messages=messages, max_tokens=fields["max_tokens"], temperature=0,
                                        stream=True, stream_options={"include_usage": True}, extra_body=extra) as stream:
        for chunk in stream:
            if abort.is_set():
                raise Aborted
            delta = chunk.choices[0].delta if chunk.choices else None
            if first is None and delta is not None and (delta.content or getattr(delta, "reasoning_content", None)):
                first = time.perf_counter()
            usage = chunk.usage or usage
    return (round(((first or time.perf_counter()) - started) * 1000, 1),
            {"new_tokens": usage.completion_tokens, "prompt_tokens": usage.prompt_tokens})


def http_request(client, url: str, body: bytes, abort: threading.Event) -> tuple[float, dict]:
    """The same request as openai_request, as plain HTTP: its JSON body made ahead (StreamedBodies), the
    server-sent events read line by line (what the server can do, without the SDK's work in the client)."""
    started, first, usage = time.perf_counter(), None, {}
    with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if abort.is_set():
                raise Aborted
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            deltas = [choice.get("delta") or {} for choice in event.get("choices", [])]
            if first is None and any(delta.get("content") or delta.get("reasoning_content") for delta in deltas):
                first = time.perf_counter()
            usage = event.get("usage") or usage
    return (round(((first or time.perf_counter()) - started) * 1000, 1),
            {"new_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens")})


class StreamedBodies:
    """openai-http mode's bodies: the JSON of the messages made once, with a mark where the last turn's text
    goes, so that no request encodes the media's base64 again. For one user's requests (a follow-up's opening
    and media are the same in each: UserRequests), or every user's where all send the same media."""

    MARK = "@@the-question@@"

    def __init__(self, fields: dict):
        self.fields = {**fields, "stream": True, "stream_options": {"include_usage": True}}
        self.parts = None
        self.last = (None, b"")  # the last body made, by its text: a request sent again takes the same bytes

    def body(self, messages: list[dict]) -> bytes:
        last = messages[-1]
        text = text_and_files(last)[0]
        if text == self.last[0]:
            return self.last[1]
        if self.parts is None:
            marked = {**last, "content": [{"type": "text", "text": self.MARK} if part["type"] == "text" else part
                                          for part in last["content"]]}
            encoded = json.dumps({**self.fields, "messages": openai_messages(messages[:-1] + [marked])}).encode()
            self.parts = encoded.split(self.MARK.encode())
        body = json.dumps(text)[1:-1].encode().join(self.parts)
        self.last = (text, body)
        return body


def api_fields(model: str, settings: dict, workload) -> dict:
    """A request body's fields beside its messages: exactly the benchmark's new tokens, greedy, and the
    workload's own settings (MiniCPM-V's, docs/OPENAI_API.md)."""
    return {"model": model, "max_tokens": settings["max_new_tokens"], "min_tokens": settings["min_new_tokens"],
            "temperature": 0, **workload.settings}


def http_answer(http, url: str, fields: dict, messages: list[dict]) -> str:
    """The text of the API's whole reply to `messages` (a follow-up's opening)."""
    response = http.post(url, json={**fields, "messages": openai_messages(messages)})
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


def status_times(job) -> dict:
    """When this client heard (Unix time) that its request joined Gradio's queue, after the upload and the
    join. gradio_client keeps every status update it got, each stamped on arrival, in a queue that nothing
    reads unless the job is iterated."""
    from gradio_client.utils import Status, StatusUpdate

    heard = {}
    updates = job.communicator.updates
    while not updates.empty():
        update = updates.get_nowait()
        if isinstance(update, StatusUpdate):
            heard.setdefault(update.code, update.time.timestamp())
    return {"joined_at": heard[Status.IN_QUEUE]} if Status.IN_QUEUE in heard else {}


def openai_requesters(base_url: str, model: str, plain_http: bool, workload, settings: dict, users: int):
    """make_requester for openai mode: one client a user (a follow-up's conversation opened through plain
    HTTP, untimed); `plain_http` (openai-http mode): httpx alone, each user's bodies made ahead."""
    import httpx
    from openai import OpenAI

    # One connection a user, as each of them would hold (the SDK's default pool is shared and kept small).
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    http = httpx.Client(limits=limits, timeout=600)
    client = None if plain_http else OpenAI(base_url=base_url, api_key="benchmark", max_retries=0, timeout=600,
                                            http_client=httpx.Client(limits=limits, timeout=600))
    url = base_url + "/chat/completions"
    fields = api_fields(model, settings, workload)
    shared = StreamedBodies(fields)  # the users of a single-turn workload share its media, each request its own words

    def make_requester(user):
        requests = UserRequests(workload, user)
        requests.open(lambda messages: http_answer(http, url, fields, messages))
        if plain_http:
            bodies = StreamedBodies(fields) if workload.follow_up else shared
            return lambda abort: http_request(http, url, bodies.body(requests.next_messages()), abort)
        return lambda abort: openai_request(client, model, openai_messages(requests.next_messages()), fields, abort)

    return make_requester
