"""Per-request settings: decoding, visual budget and video sampling, validated in one place."""

from dataclasses import asdict, dataclass, fields, replace

from app import limits
from app.messages import MSG_BAD_SETTING, MSG_UNKNOWN_SETTING
from app.errors import UserError


@dataclass(frozen=True)
class RowSettings:
    """What the token choice reads of one batch row's settings (app.model.sampling)."""
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = limits.DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    do_sample: bool = True
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_slice_nums: int = limits.DEFAULT_MAX_SLICE_NUMS
    downsample_mode: str = "16x"
    visual_token_budget: int = limits.DEFAULT_VISUAL_TOKEN_BUDGET
    enable_thinking: bool | None = None  # None: not passed, the chat template's own default decides
    video_fps: float = limits.DEFAULT_VIDEO_FPS
    video_max_frames: int = limits.DEFAULT_VIDEO_MAX_FRAMES
    video_slices_per_frame: int = limits.DEFAULT_VIDEO_SLICES_PER_FRAME
    # Texts that end the reply where the first of them appears, left out of it (app.engine.replies).
    stop: tuple[str, ...] = ()
    seed: int | None = None  # a sampled reply's draws repeat with the same seed (app.model.sampling)

    def with_overrides(self, overrides: dict, also_known: tuple[str, ...] = ()) -> "GenerationSettings":
        """These settings with `overrides` applied, each checked; unknown keys and bad values raise UserError,
        whose list of known settings adds `also_known` (those the caller reads itself: /ask's follow_up)."""
        known = {field.name: field.type for field in fields(self)}
        values = {}
        for key, value in (overrides or {}).items():
            if key not in known:
                raise UserError(MSG_UNKNOWN_SETTING.format(key=key, known=", ".join(sorted([*known, *also_known]))))
            values[key] = _coerce(key, value, known[key])
        updated = replace(self, **values)
        updated.check()
        return updated

    def check(self) -> None:
        _in_range("max_new_tokens", self.max_new_tokens, 1, limits.MAX_NEW_TOKENS_LIMIT)
        _in_range("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        _in_range("temperature", self.temperature, 0.0, 5.0)
        if self.do_sample and self.temperature < limits.MIN_SAMPLING_TEMPERATURE:
            raise UserError(MSG_BAD_SETTING.format(
                key="temperature", problem=f"must be at least {limits.MIN_SAMPLING_TEMPERATURE} when sampling "
                                           f"(for greedy decoding set do_sample to false), got {self.temperature}"))
        _in_range("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise UserError(MSG_BAD_SETTING.format(key="top_p", problem="must be above 0"))
        _in_range("top_k", self.top_k, 0, 1000)
        _in_range("repetition_penalty", self.repetition_penalty, 0.5, 2.0)
        _in_range("max_slice_nums", self.max_slice_nums, 1, limits.MAX_SLICE_NUMS)
        if self.downsample_mode not in limits.DOWNSAMPLE_MODES:
            raise UserError(MSG_BAD_SETTING.format(
                key="downsample_mode", problem=f"must be one of {', '.join(limits.DOWNSAMPLE_MODES)}"))
        _in_range("visual_token_budget", self.visual_token_budget, 64, limits.MAX_VISUAL_TOKEN_BUDGET)
        _in_range("video_fps", self.video_fps, 0.01, limits.MAX_VIDEO_FPS)
        _in_range("video_max_frames", self.video_max_frames, 1, limits.MAX_VIDEO_FRAMES)
        _in_range("video_slices_per_frame", self.video_slices_per_frame, 1, limits.MAX_VIDEO_SLICES_PER_FRAME)
        _check_stop(self.stop)
        if self.seed is not None:
            _in_range("seed", self.seed, -2**63, 2**64 - 1)

    def as_dict(self) -> dict:
        return asdict(self)


def parse_flag(key: str, value) -> bool:
    """A true/false setting outside GenerationSettings (the /ask API's follow_up), read as its flags are."""
    return _coerce(key, value, bool)


def _coerce(key: str, value, kind):
    if kind in (bool | None, int | None):  # None: left to its default (the template's, or no seed)
        return None if value is None else _coerce(key, value, kind.__args__[0])
    if kind == tuple[str, ...]:
        return _texts(key, value)
    try:
        if kind in (bool, "bool"):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError
        if kind in (int, "int"):
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        if kind in (float, "float"):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError, OverflowError):
        expected = {"bool": "true or false", "int": "a whole number", "float": "a number"}.get(
            getattr(kind, "__name__", kind), "text")
        raise UserError(MSG_BAD_SETTING.format(key=key, problem=f"expected {expected}, got {value!r}")) from None


def _texts(key: str, value) -> tuple[str, ...]:
    """One text or a list of texts (a stop setting) as a tuple; None: none."""
    if value is None:
        return ()
    texts = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if texts is None or not all(isinstance(text, str) for text in texts):
        raise UserError(MSG_BAD_SETTING.format(key=key, problem=f"expected a text or a list of texts, got {value!r}"))
    return texts


def _check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > limits.MAX_STOP_STRINGS:
        raise UserError(MSG_BAD_SETTING.format(key="stop", problem=f"at most {limits.MAX_STOP_STRINGS} texts, got {len(stop)}"))
    for text in stop:
        if not 1 <= len(text) <= limits.MAX_STOP_STRING_CHARS:
            raise UserError(MSG_BAD_SETTING.format(
                key="stop", problem=f"each text is 1 to {limits.MAX_STOP_STRING_CHARS} characters, got {len(text)}"))


def _in_range(key: str, value, low, high) -> None:
    if not low <= value <= high:
        raise UserError(MSG_BAD_SETTING.format(key=key, problem=f"must be between {low} and {high}, got {value}"))
