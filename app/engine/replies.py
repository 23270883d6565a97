"""The web side's end of a reply: a request's events turned into reply updates (text assembled from its
tokens, waiting places, the last update's stats). Serves a request run in this process and one run in the
engine process alike. No torch here."""

import logging
import queue
import time
from typing import Callable, Iterator

from app.messages import MSG_GENERATION_FAILED, MSG_OUT_OF_MEMORY
from app.engine.api import ReplyEvent, ReplyUpdate
from app.errors import ServingFailed, UserError

log = logging.getLogger(__name__)


def timing_stats(new_tokens: int, requested_at: float, prepared_at: float, started_at: float | None,
                 first_token_at: float | None, finished_at: float) -> dict:
    """The timing part of a reply's stats, from perf_counter() readings; tokens_per_s is the decode rate.
    `started_at` (when its prefill began) is None where the engine never said (stopped before its first token)."""
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
    """Token ids in, text out, a piece at a time as vLLM's incremental detokenizer does: each piece decodes
    only a short window of the last tokens, since decoding is not token-by-token separable (a character
    split over tokens), and a piece that ends inside a multi-byte character waits for the rest of it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.done_text = ""
        # The window: ids[window:said] gave the text's last piece, ids[said:] are not in done_text yet.
        self.window = self.said = 0

    @property
    def tokens(self) -> int:
        """Added so far."""
        return len(self.ids)

    def add(self, token: int) -> None:
        self.extend((token,))

    def extend(self, tokens) -> None:
        self.ids.extend(tokens)
        piece = self._unsaid()
        if piece and not piece.endswith("\ufffd"):
            self.done_text += piece
            self.window, self.said = self.said, len(self.ids)

    def _unsaid(self) -> str:
        """The text of ids[said:], decoded with the window's tokens before them."""
        if self.said == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.window:self.said], skip_special_tokens=True)
        return decode(self.ids[self.window:], skip_special_tokens=True)[len(before):]

    @property
    def text(self) -> str:
        return self.done_text + self._unsaid().rstrip("\ufffd")

    def cut(self, length: int) -> None:
        """Keep the first `length` characters of the text: the reply ends there (a stop text began)."""
        self.done_text = self.text[:length]
        self.window = self.said = len(self.ids)


class StopTexts:
    """Where a reply first holds one of its stop texts, looked for as each token comes, as vLLM's
    detokenizer does: only once the reply has its minimum length, and only in the text new since the last
    look (with room for a stop text that began before it). The reply ends there, without the stop text."""

    def __init__(self, stop: tuple[str, ...], min_tokens: int):
        self.stop, self.min_tokens = stop, min_tokens
        # An update shows all but this many last characters: they could be the start of a stop text.
        self.held = max(len(text) for text in stop) - 1
        self.looked = 0  # characters of the text already looked through

    def find(self, text: str, tokens: int) -> int | None:
        """Where the first stop text starts in `text` (a reply of `tokens` tokens), if it holds one now."""
        start, self.looked = self.looked, len(text)
        if tokens < self.min_tokens:
            return None
        found = [at for at in (text.find(stop, max(0, start - len(stop) + 1)) for stop in self.stop) if at >= 0]
        return min(found) if found else None

    def shown(self, text: str) -> str:
        return text[:len(text) - self.held] if self.held else text


def _add_tokens(text: TextAssembler, tokens: list[int], stops: StopTexts | None) -> bool:
    """Add `tokens` to the text; True if a stop text ended the reply (the text is then cut before it)."""
    if stops is None:
        text.extend(tokens)
        return False
    for token in tokens:
        text.add(token)
        at = stops.find(text.text, text.tokens)
        if at is not None:
            text.cut(at)
            return True
    return False


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
            # Held by a kept conversation (app.engine.conversations): neither prefilled nor their media encoded.
            "reused_prompt_tokens": prepared.kept.length if prepared.kept is not None else 0,
            # Earlier turns' images whose features were kept (app.engine.encoded_images): prefilled, not encoded.
            "reused_image_tokens": sum(features.shape[0] for features in prepared.image_features or ()),
        },
    }


def follow_reply(events: queue.SimpleQueue, tokenizer_for: Callable[[str], object], requested_at: float,
                 close: Callable[[str], None], wait_for_events: Callable[[], None] | None = None,
                 settings=None) -> Iterator[ReplyUpdate]:
    """A request's events turned into reply updates, its tokens into text by `tokenizer_for(model path)`;
    `close(outcome)` runs when the reply ends or is dropped (the request then leaves the batch: so does one
    that a stop text of `settings` ended); `wait_for_events`, if given, is called while no event is there
    (inline mode drives the scheduler).

    Events: (app.engine.api.Event, its value). The same loop serves a request run in this process and one run
    in the engine process (app.engine.process).
    """
    outcome = "stopped"
    prepared = first_received_at = timing = None
    stops = StopTexts(settings.stop, settings.min_new_tokens) if settings is not None and settings.stop else None
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
            elif kind == ReplyEvent.FIRST_TOKEN:
                timing = value
            elif kind == ReplyEvent.TOKENS:
                first_received_at = first_received_at or time.perf_counter()
                if _add_tokens(text, value, stops):
                    value = {**timing, "new_tokens": text.tokens, "finish_reason": "stop"}
                    outcome = "finished"
                    break
                if events.empty():  # else the consumer fell behind (a busy web server): one update for all
                    shown = stops.shown(text.text) if stops is not None else text.text
                    yield ReplyUpdate(text=shown, notices=prepared["notices"], opens_thinking=prepared["opens_thinking"])
            elif kind == ReplyEvent.END:
                outcome = "finished"
                break
            elif kind == ReplyEvent.STOPPED:  # the caller's StopSignal
                break
    finally:
        close(outcome)
    if prepared is None:  # stopped before its inputs were ready: nothing was said
        return
    if outcome == "stopped":  # what it had said when the caller stopped it
        timing = timing or {"started_at": None, "first_token_at": first_received_at}
        value = {**timing, "new_tokens": text.tokens, "finish_reason": "stop"}
    yield _last_update(text.text, prepared, value, requested_at, first_received_at, stopped=outcome == "stopped")


def _last_update(text: str, prepared: dict, ended: dict, requested_at: float, first_received_at: float | None,
                 stopped: bool) -> ReplyUpdate:
    """The whole reply with its stats, from its prepared summary and how it ended (the END event's value, or
    the same made here for a reply its caller stopped)."""
    stats = dict(prepared["counts"])
    stats.update(timing_stats(ended["new_tokens"], requested_at, prepared["prepared_at"], ended["started_at"],
                              ended["first_token_at"], time.perf_counter()))
    stats["finish_reason"] = ended["finish_reason"]
    stats["preparation_ms"] = preparation_stages(requested_at, prepared["timeline"], prepared["prepared_at"])
    if first_received_at is not None and ended["first_token_at"] is not None:  # its way here from the engine's loop
        stats["first_token_delivery_ms"] = round((first_received_at - ended["first_token_at"]) * 1000, 1)
    stats["requested_at"] = round(time.time() - (time.perf_counter() - requested_at), 3)  # Unix time
    return ReplyUpdate(text=text, notices=prepared["notices"], opens_thinking=prepared["opens_thinking"], stats=stats,
                       stopped=stopped)


def as_user_error(error: BaseException) -> UserError:
    """The message a user sees for a failure of their request."""
    if isinstance(error, UserError):
        return error
    if type(error).__name__ == "OutOfMemoryError" and type(error).__module__.startswith("torch"):  # not importing torch
        return ServingFailed(MSG_OUT_OF_MEMORY)
    log.error("Generation failed", exc_info=error)
    return ServingFailed(MSG_GENERATION_FAILED.format(error=f"{type(error).__name__}: {error}"))
