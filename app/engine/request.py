"""A request's life in the engine: what it holds while it waits and runs, and how its tokens reach its
caller (app.engine.scheduler decides when it runs)."""

import functools
import threading
from dataclasses import dataclass, field
from typing import Callable

from app import tuning
from app.engine.api import ReplyEvent
from app.engine.inputs import PreparedInputs
from app.engine.settings import GenerationSettings, RowSettings


@dataclass(eq=False)
class Request:
    """One reply asked for: its inputs and settings, then its tokens as they come."""
    messages: list[dict]  # the conversation, to prepare again if the model is switched while it waits
    prepared: PreparedInputs
    settings: GenerationSettings
    version: int  # the model load the inputs were prepared for
    requested_at: float
    emit: Callable[[str, object], None]  # hands the caller an event (app.engine.api.ReplyEvent)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started_at: float | None = None
    first_token_at: float | None = None
    generated: list[int] = field(default_factory=list)
    last_token: int | None = None
    done: bool = False  # it ended: it leaves at the next step boundary
    seen: object = None  # token ids seen so far (on the device), kept only under a repetition penalty
    generator: object = None  # its own random draws (a torch.Generator on the device), for a sampled reply with a seed
    finish_reason: str = "stop"  # "length" when it ends at its max_new_tokens
    delivered: int = 0  # generated tokens already handed to the caller
    delivered_at: float = 0.0
    place: int | None = None

    @property
    def tokens_held(self) -> int:  # at least as many as its slot holds: the prompt, a column a token since the first
        return self.prepared.prompt_tokens + len(self.generated)

    @functools.cached_property
    def row(self) -> RowSettings:
        s = self.settings
        return RowSettings(s.do_sample, s.temperature, s.top_k, s.top_p, s.repetition_penalty)

    def deliver(self, ended: bool, now: float, interval: float) -> None:
        """Hand new tokens to the caller: the first at once, then at most every `interval` seconds.

        Waking hundreds of callers at every step would cost the GIL more than the step itself.
        """
        if len(self.generated) > self.delivered and (
                ended or not self.delivered or now - self.delivered_at >= interval):
            if not self.delivered:  # what a reply ended early by its caller (a stop text) needs for its stats
                self.emit(ReplyEvent.FIRST_TOKEN, {"started_at": self.started_at, "first_token_at": self.first_token_at})
            self.emit(ReplyEvent.TOKENS, self.generated[self.delivered:])
            self.delivered, self.delivered_at = len(self.generated), now
        if ended:
            self.emit(ReplyEvent.END, {"new_tokens": len(self.generated), "started_at": self.started_at,
                                       "first_token_at": self.first_token_at, "finish_reason": self.finish_reason})


def stream_update_interval(running: int) -> float:
    """Seconds between two updates of one reply while `running` replies stream (see STREAM_UPDATES_PER_S)."""
    return max(tuning.STREAM_UPDATE_INTERVAL_S, running / tuning.STREAM_UPDATES_PER_S)
