"""A reply in the OpenAI-compatible API's shapes: the whole chat completion, or its stream of chunks
(server-sent events), with reasoning apart from the answer as vLLM's reasoning parsers give it
(`reasoning_content`), the finish reason and the usage (with the visual tokens as a field of its own)."""

import time
import uuid

from app.chat import THINK_CLOSE, THINK_OPEN, reply_text
from app.engine.api import ReplyUpdate
from app.web.openai_errors import json_bytes


def split_reasoning(text: str, finished: bool) -> tuple[str, str]:
    """(reasoning, answer) of a reply's text (app.chat.reply_text's: a reasoning block made explicit). While
    it is not `finished`, what could still be the start of a reasoning tag is left for later, so that what
    each part shows only ever grows."""
    start = text.lstrip()
    if not start.startswith(THINK_OPEN):
        return ("", "") if not finished and THINK_OPEN.startswith(start) else ("", text)
    inside = start[len(THINK_OPEN):]
    end = inside.find(THINK_CLOSE)
    if end < 0:
        return (inside if finished else _without_a_tag_begun(inside, THINK_CLOSE)), ""
    return inside[:end], inside[end + len(THINK_CLOSE):].lstrip()


def _without_a_tag_begun(text: str, tag: str) -> str:
    for length in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:length]):
            return text[:-length]
    return text


def usage_of(stats: dict) -> dict:
    prompt, completion = stats.get("prompt_tokens") or 0, stats["new_tokens"]
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if stats.get("visual_tokens") is not None:  # an external server (--backend openai) counts them itself
        usage["visual_tokens"] = stats["visual_tokens"]
    if stats.get("reused_prompt_tokens") is not None:  # held by a kept conversation: OpenAI's cached tokens
        usage["prompt_tokens_details"] = {"cached_tokens": stats["reused_prompt_tokens"]}
    return usage


class Reply:
    """One reply's id, time and model, and its text as sent so far (a stream sends what is new)."""

    def __init__(self, model: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.sent = ("", "")  # reasoning, answer

    def completion(self, update: ReplyUpdate) -> dict:
        """The whole chat completion, from the reply's last update."""
        reasoning, answer = split_reasoning(reply_text(update.text, update.opens_thinking), finished=True)
        message = {"role": "assistant", "content": answer, "reasoning_content": reasoning or None}
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": update.stats["finish_reason"]}],
                "usage": usage_of(update.stats)}
        if update.notices:  # what the app tells about the request (oldest turns left out, slices lowered)
            body["notices"] = update.notices
        return body

    # A stream ----------------------------------------------------------------------------------------------

    def first_chunk(self, usage: bool) -> bytes:
        return self._chunk({"role": "assistant", "content": ""}, usage=usage)

    def chunks_for(self, update: ReplyUpdate, usage: bool) -> bytes:
        """The chunks that carry what `update` adds to the reply (none while it waits in line: a comment then,
        which keeps the connection seen as alive); after the last update, the finish reason and the usage."""
        if update.waiting_ahead is not None:
            return f": waiting, {update.waiting_ahead} requests ahead\n\n".encode()
        finished = update.stats is not None
        reasoning, answer = split_reasoning(reply_text(update.text, update.opens_thinking), finished)
        out = []
        for key, now, before in (("reasoning_content", reasoning, self.sent[0]), ("content", answer, self.sent[1])):
            if len(now) > len(before):
                out.append(self._chunk({key: now[len(before):]}, usage=usage))
        self.sent = (reasoning, answer)
        if finished:
            extra = {"notices": update.notices} if update.notices else {}
            out.append(self._chunk({}, update.stats["finish_reason"], usage=usage, **extra))
            if usage:
                out.append(_event({**self._head(), "choices": [], "usage": usage_of(update.stats)}))
        return b"".join(out)

    def _head(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    def _chunk(self, delta: dict, finish_reason: str | None = None, usage: bool = False, **extra) -> bytes:
        chunk = {**self._head(), "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                 **extra}
        if usage:  # with stream_options.include_usage every chunk has the field, null until the last (OpenAI's form)
            chunk["usage"] = None
        return _event(chunk)


def _event(data: dict) -> bytes:
    return b"data: " + json_bytes(data, separators=(",", ":")) + b"\n\n"


def error_event(body: dict) -> bytes:
    """An error in the middle of a stream, as vLLM sends it (the OpenAI SDK raises it as an APIError)."""
    return _event(body)


DONE = b"data: [DONE]\n\n"
