"""What the web side and the engine say to each other: the reply updates, the model's description and the
events of a request (the same in one process and across the engine process's pipe). No torch here."""

from dataclasses import dataclass, field
from enum import Enum


class ReplyEvent(str, Enum):
    """What a request tells its caller (app.engine.replies.follow_reply reads them), with its value."""

    PREPARED = "prepared"  # app.engine.replies.prepared_summary: the inputs are ready
    PLACE = "place"  # requests ahead of it in the wait line
    FIRST_TOKEN = "first_token"  # {"started_at", "first_token_at"}: just before the first tokens
    TOKENS = "tokens"  # [token ids] since the last
    END = "end"  # {"new_tokens", "started_at", "first_token_at", "finish_reason": "stop" or "length"}: the reply is whole
    REFUSED = "refused"  # Busy: the wait line is full
    ERROR = "error"  # the exception that ended it
    STOPPED = "stopped"  # None: the caller's StopSignal was set; the reply ends at once, its stats so far


class EngineCall(str, Enum):
    """What a web process may ask of the engine process besides replies (app.engine.process answers each)."""

    WARM_UP = "warm_up"
    INFO = "info"
    DEFAULT_SETTINGS = "default_settings"
    PLAN_IMAGES = "plan_images"
    MAX_CONTEXT_TOKENS = "max_context_tokens"
    ACTIVE_GENERATIONS = "active_generations"
    PROFILE_GPU = "profile_gpu"
    SWITCH = "switch"
    METRICS_SNAPSHOT = "metrics.snapshot"
    METRICS_PROMETHEUS = "metrics.prometheus"
    METRICS_RESET = "metrics.reset"
    METRICS_HISTORY = "metrics.history"


@dataclass
class ReplyUpdate:
    """The reply so far; `stats` is set on the last update only."""

    text: str
    notices: list[str] = field(default_factory=list)
    opens_thinking: bool = False  # the prompt already opened a reasoning block: `text` starts inside it
    stats: dict | None = None
    waiting_ahead: int | None = None  # set while the request waits in line: requests ahead of it
    stopped: bool = False  # the last update of a reply its caller's StopSignal ended: `stats` are so far


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    model_type: str
    device: str
    dtype: str
    parameters: int | None  # None for a model served elsewhere
    weight_bytes: int | None
    random_weights: bool
    warmup_s: float | None
    gpu_memory_bytes: int | None
    # What the chat template does when a request does not say (app.engine.inputs.thinks_by_default); the
    # UI's switch shows it.
    thinking_by_default: bool = False
