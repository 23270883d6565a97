"""The web side's end of a reply: a request's events turned into reply updates (text assembled from its
tokens, waiting places, the last update's stats). Serves a request run in this process and one run in the
engine process alike. No torch here."""

import logging
import queue
import time
from typing import Callable, Iterator

from app.messages import MSG_GENERATION_FAILED, MSG_OUT_OF_MEMORY
from app.engine.api import ReplyEvent, ReplyUpdate
from app.errors import UserError

log = logging.getLogger(__name__)


def timing_stats(new_tokens: int, requested_at: float, prepared_at: float, started_at: float | None,
                 first_token_at: float | None, finished_at: float) -> dict:
    """The timing part of a reply's stats, from perf_counter() readings; tokens_per_s is the decode rate.
    `started_at` (when its prefill began) is None for a stopped reply: the engine never said."""
    first = first_token_at or finished_at
    decode_s = finished_at - first
    return {
        "new_tokens": new_tokens,
        "ttft_ms": round((first - requested_at) * 1000, 1),
        "preprocess_ms": round((prepared_at - requested_at) * 1000, 1),
        "queue_ms": None if started_at is None else round((started_at - prepared_at) * 1000, 1),
        "tokens_per_s": round((new_tokens - 1) / decode_s, 1) if new_tokens > 1 and decode_s > 0 else None,
        "total_ms": round((finished_at - requested_at) * 1000, 1),
    }


def preparation_stages(requested_at: float, timeline: dict, prepared_at: float) -> dict:
    """Where a request's preprocessing time went, in ms: reaching the preparer (in the engine's process,
    a free preparing thread), waiting for a worker, the work itself, the way back from the worker, and
    what follows (positions, the pixels staged on the GPU)."""
    marks = [requested_at] + [timeline[stage] for stage in ("asked", "work_started", "work_done", "received")] + [prepared_at]
    names = ("to_preparer", "for_a_worker", "work", "way_back", "staging")
    return {name: round((end - start) * 1000, 1) for name, start, end in zip(names, marks, marks[1:])}


class TextAssembler:
    """Token ids in, text out: holds back a piece that ends inside a multi-byte character, and
    re-decodes only the tokens since the last line break (decoding is not token-by-token separable)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.done_text = ""
        self.line_tokens: list[int] = []

    def add(self, token: int) -> None:
        self.line_tokens.append(token)
        line = self.tokenizer.decode(self.line_tokens, skip_special_tokens=True)
        if line.endswith("\n"):
            self.done_text += line
            self.line_tokens = []

    @property
    def text(self) -> str:
        line = self.tokenizer.decode(self.line_tokens, skip_special_tokens=True) if self.line_tokens else ""
        return self.done_text + line.rstrip("\ufffd")


def prepared_summary(prepared, model_path: str, prepared_at: float) -> dict:
    """What a reply's updates and stats need to know of its prepared inputs (app.engine.inputs.PreparedInputs),
    small and picklable."""
    return {
        "model_path": model_path,  # whose tokenizer turns the reply's tokens into text
        "notices": list(prepared.notices),
        "opens_thinking": prepared.opens_thinking,
        "prepared_at": prepared_at,
        "timeline": dict(prepared.timeline),
        "counts": {  # the reply's stats start with these
            "visual_tokens": prepared.visual_tokens,
            "image_tokens": prepared.image_tokens,
            "video_tokens": prepared.video_tokens,
            "video_frames": prepared.video_frames,
            "prompt_tokens": prepared.prompt_tokens,
        },
    }


def follow_reply(events: queue.SimpleQueue, tokenizer_for: Callable[[str], object], requested_at: float,
                 close: Callable[[str], None], wait_for_events: Callable[[], None] | None = None) -> Iterator[ReplyUpdate]:
    """A request's events turned into reply updates, its tokens into text by `tokenizer_for(model path)`;
    `close(outcome)` runs when the reply ends or is dropped; `wait_for_events`, if given, is called while
    no event is there (inline mode drives the scheduler).

    Events: (app.engine.api.Event, its value). The same loop serves a request run in this process and one run
    in the engine process (app.engine.process).
    """
    outcome = "stopped"
    prepared = first_received_at = None
    received = 0
    try:
        while True:
            while wait_for_events is not None and events.empty():
                wait_for_events()
            kind, value = events.get()
            if kind == ReplyEvent.PREPARED:
                prepared, text = value, TextAssembler(tokenizer_for(value["model_path"]))
            elif kind == ReplyEvent.REFUSED:
                outcome = "busy"
                raise value
            elif kind == ReplyEvent.ERROR:
                outcome = "error"
                raise as_user_error(value)
            elif kind == ReplyEvent.PLACE:
                yield ReplyUpdate(text="", waiting_ahead=value)
            elif kind == ReplyEvent.TOKENS:
                first_received_at = first_received_at or time.perf_counter()
                received += len(value)
                for token in value:
                    text.add(token)
                if events.empty():  # else the consumer fell behind (a busy web server): one update for all
                    yield ReplyUpdate(text=text.text, notices=prepared["notices"], opens_thinking=prepared["opens_thinking"])
            elif kind == ReplyEvent.END:
                outcome = "finished"
                break
            elif kind == ReplyEvent.STOPPED:  # the caller's StopSignal
                break
    finally:
        close(outcome)
    if prepared is None:  # stopped before its inputs were ready: nothing was said
        return
    if outcome == "stopped":  # what this side saw of it: the tokens that reached it, when the first did
        ended = {"new_tokens": received, "started_at": None, "first_token_at": first_received_at}
    else:
        ended = value
    stats = dict(prepared["counts"])
    stats.update(timing_stats(ended["new_tokens"], requested_at, prepared["prepared_at"], ended["started_at"],
                              ended["first_token_at"], time.perf_counter()))
    stats["preparation_ms"] = preparation_stages(requested_at, prepared["timeline"], prepared["prepared_at"])
    if first_received_at is not None and outcome != "stopped":  # the first token's way here from the engine's loop
        stats["first_token_delivery_ms"] = round((first_received_at - ended["first_token_at"]) * 1000, 1)
    stats["requested_at"] = round(time.time() - (time.perf_counter() - requested_at), 3)  # Unix time
    yield ReplyUpdate(text=text.text, notices=prepared["notices"], opens_thinking=prepared["opens_thinking"], stats=stats,
                      stopped=outcome == "stopped")


def as_user_error(error: BaseException) -> UserError:
    """The message a user sees for a failure of their request."""
    if isinstance(error, UserError):
        return error
    if type(error).__name__ == "OutOfMemoryError" and type(error).__module__.startswith("torch"):  # not importing torch
        return UserError(MSG_OUT_OF_MEMORY)
    log.error("Generation failed", exc_info=error)
    return UserError(MSG_GENERATION_FAILED.format(error=f"{type(error).__name__}: {error}"))
