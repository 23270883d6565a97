"""A chat completion request of the OpenAI-compatible API, read and checked: its body in, the engine's model
messages (app.chat's format) and settings (app.engine.settings) out, with what the reply should look like.

The parameters are OpenAI's, and those vLLM adds (top_k, repetition_penalty, min_tokens,
chat_template_kwargs.enable_thinking), and MiniCPM-V's own settings under their names in the app's
settings (SETTINGS). A field this server does not know is refused with its name, and one that it knows but
cannot honour (n above 1, tools) with what it can do. Every value is checked by the engine's own settings,
so a bad one gets the message the UI's users get, naming the field as the request named it.
"""

import json
from dataclasses import dataclass

from app import limits
from app.chat import strip_reasoning
from app.engine.settings import GenerationSettings
from app.errors import UserError
from app.messages import (
    MSG_EMPTY_REQUEST,
    MSG_API_BAD_JSON,
    MSG_API_BAD_MESSAGE,
    MSG_API_BAD_PART,
    MSG_API_FIELD_NOT_SUPPORTED,
    MSG_API_LAST_NOT_USER,
    MSG_API_MAX_TOKENS_DIFFER,
    MSG_API_MEDIA_IN_SYSTEM,
    MSG_API_NO_MESSAGES,
    MSG_API_SYSTEM_LATE,
    MSG_API_TOO_MANY_MEDIA,
    MSG_API_TOOLS,
    MSG_API_UNKNOWN_FIELDS,
    MSG_API_WRONG_TYPE,
)
from app.web.openai_errors import ApiError

# Body fields set on the engine's settings as they are, by the name the engine knows them by.
SETTINGS = {"top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repetition_penalty",
            "min_tokens": "min_new_tokens", "seed": "seed", "stop": "stop",
            "max_slice_nums": "max_slice_nums", "downsample_mode": "downsample_mode",
            "visual_token_budget": "visual_token_budget", "video_fps": "video_fps",
            "video_max_frames": "video_max_frames", "video_slices_per_frame": "video_slices_per_frame"}
# Read here: the model, the conversation, the stream's form, the length and temperature, the template's
# switch; and `user` (an end user's id, for the caller's own records), which is taken and ignored.
READ_HERE = ("model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
             "chat_template_kwargs", "user")
# Known, but only with the value that changes nothing (or null): (the values allowed, how to say it).
ONLY_DEFAULT = {
    "n": ((1,), "1 (one reply a request)"),
    "frequency_penalty": ((0,), "0 (use repetition_penalty)"),
    "presence_penalty": ((0,), "0 (use repetition_penalty)"),
    "logprobs": ((False,), "false"),
    "top_logprobs": ((0,), "0"),
    "logit_bias": (({},), "{}"),
    "response_format": (({"type": "text"},), '{"type": "text"}'),
    "tools": (([],), "[] (this server calls no tools)"),
    "tool_choice": (("none",), '"none" (this server calls no tools)'),
    "parallel_tool_calls": ((True, False), "true or false"),
}
KNOWN = sorted(set(SETTINGS) | set(READ_HERE) | set(ONLY_DEFAULT))
CHAT_TEMPLATE_KWARGS = ("enable_thinking",)
STREAM_OPTIONS = ("include_usage",)


@dataclass
class ChatRequest:
    messages: list[dict]  # model messages (app.chat)
    settings: GenerationSettings
    stream: bool
    include_usage: bool  # a streamed reply ends with a chunk of usage


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise ApiError(400, MSG_API_BAD_JSON.format(error=str(error)[:200])) from None
    if not isinstance(body, dict):
        raise ApiError(400, MSG_API_BAD_JSON.format(error=f"got {type(body).__name__}"))
    return body


def chat_request(body: dict, defaults: GenerationSettings, store_media) -> ChatRequest:
    """The request `body` as the engine takes it, from `defaults` (the model's); `store_media(url, kind,
    where)` turns a data URL into the path of a checked file (app.web.data_urls). Raises ApiError."""
    unknown = sorted(set(body) - set(KNOWN))
    if unknown:
        raise ApiError(400, MSG_API_UNKNOWN_FIELDS.format(names=_names(unknown), known=_names(KNOWN)), param=unknown[0])
    for name, (allowed, shown) in ONLY_DEFAULT.items():
        if body.get(name) is not None and body[name] not in allowed:
            raise ApiError(400, MSG_API_FIELD_NOT_SUPPORTED.format(name=name, allowed=shown), param=name)
    stream = _typed(body, "stream", bool, False)
    options = _object(body, "stream_options", STREAM_OPTIONS)
    settings = _settings(body, defaults)
    try:
        messages = model_messages(body.get("messages"), store_media)
    except UserError as error:
        raise ApiError.of(error) from None
    return ChatRequest(messages, settings, stream, stream and _typed(options, "include_usage", bool, False))


def _settings(body: dict, defaults: GenerationSettings) -> GenerationSettings:
    """The engine's settings for the request, each value checked by the engine's own rules."""
    overrides = {key: body[name] for name, key in SETTINGS.items() if body.get(name) is not None}
    if overrides.get("top_k") == -1:  # vLLM's older spelling of "no top-k"
        overrides["top_k"] = 0
    lengths = {_typed(body, name, int, None) for name in ("max_tokens", "max_completion_tokens")} - {None}
    if len(lengths) > 1:
        raise ApiError(400, MSG_API_MAX_TOKENS_DIFFER, param="max_tokens")
    if lengths:
        overrides["max_new_tokens"] = lengths.pop()
    temperature = body.get("temperature")
    if temperature is not None:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            raise ApiError(400, MSG_API_WRONG_TYPE.format(name="temperature", kind="a number"), param="temperature")
        # 0 is greedy, as OpenAI and vLLM read it; so is anything too low to sample (app.limits).
        overrides["do_sample"] = temperature >= limits.MIN_SAMPLING_TEMPERATURE
        overrides["temperature"] = temperature  # held to its range either way
    thinking = _object(body, "chat_template_kwargs", CHAT_TEMPLATE_KWARGS).get("enable_thinking")
    if thinking is not None:
        overrides["enable_thinking"] = thinking
    try:
        return defaults.with_overrides(overrides)
    except UserError as error:
        raise ApiError(400, _as_named_in_the_body(str(error))) from None


def _as_named_in_the_body(message: str) -> str:
    """An engine's message about its settings with each setting named as the request names it."""
    for name, key in {**SETTINGS, "max_tokens": "max_new_tokens",
                      "chat_template_kwargs.enable_thinking": "enable_thinking"}.items():
        message = message.replace(f"“{key}”", f"“{name}”")
    return message


def model_messages(messages, store_media) -> list[dict]:
    """OpenAI chat messages as model messages: leading system (or developer) messages joined into one,
    user turns with their text, images and videos in order, assistant turns as text (reasoning left out)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, MSG_API_NO_MESSAGES, param="messages")
    _check_media_count(messages)
    system, converted = [], []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UserError(MSG_API_BAD_MESSAGE.format(where=where))
        role = message["role"]
        if role in ("system", "developer"):
            if converted:
                raise UserError(MSG_API_SYSTEM_LATE.format(where=where))
            system += _text_parts(message.get("content"), where, MSG_API_MEDIA_IN_SYSTEM)
        elif role == "user":
            converted.append({"role": "user", "content": _user_parts(message.get("content"), where, store_media)})
        elif role == "assistant" and not message.get("tool_calls") and not message.get("function_call"):
            parts = _text_parts(message.get("content"), where, MSG_API_BAD_PART)
            text = strip_reasoning("\n".join(part["text"] for part in parts))
            if text:
                converted.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        elif role in ("assistant", "tool", "function"):
            raise UserError(MSG_API_TOOLS.format(where=where))
        else:
            raise UserError(MSG_API_BAD_MESSAGE.format(where=where))
    if not converted or converted[-1]["role"] != "user":
        raise UserError(MSG_API_LAST_NOT_USER)
    if not any(part["type"] != "text" or part["text"].strip() for part in converted[-1]["content"]):
        raise UserError(MSG_EMPTY_REQUEST)  # as the UI says it
    if system:
        text = "\n\n".join(part["text"] for part in system)
        converted.insert(0, {"role": "system", "content": [{"type": "text", "text": text}]})
    return converted


def _check_media_count(messages: list) -> None:
    """Refuse more than MAX_API_MEDIA_PER_REQUEST images and videos before any is stored."""
    count = sum(1 for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
                for part in message["content"] if isinstance(part, dict) and part.get("type") in ("image_url", "video_url"))
    if count > limits.MAX_API_MEDIA_PER_REQUEST:
        raise ApiError(400, MSG_API_TOO_MANY_MEDIA.format(count=count, limit=limits.MAX_API_MEDIA_PER_REQUEST,
                                                          images=limits.MAX_IMAGES_PER_REQUEST), param="messages")


def _parts(content, where: str) -> list:
    """A message's content as a list of parts: a string is one text part."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if isinstance(content, list):
        return content
    raise UserError(MSG_API_BAD_MESSAGE.format(where=where))


def _text_parts(content, where: str, refusal: str) -> list[dict]:
    """A system or assistant message's text parts; `refusal` for any other part."""
    parts = []
    for index, part in enumerate(_parts(content, where)):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise UserError(refusal.format(where=f"{where}.content[{index}]"))
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _user_parts(content, where: str, store_media) -> list[dict]:
    parts = []
    for index, part in enumerate(_parts(content, where)):
        here = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "video_url"):
            media = "image" if kind == "image_url" else "video"
            url = part.get(kind)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise UserError(MSG_API_BAD_PART.format(where=here))
            parts.append({"type": media, "path": store_media(url, media, here)})
        else:
            raise UserError(MSG_API_BAD_PART.format(where=here))
    return parts


def _typed(values: dict, name: str, kind: type, default):
    """values[name] (`kind`: bool or int), or `default` where it is missing or null."""
    value = values.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(400, MSG_API_WRONG_TYPE.format(name=name, kind="true or false" if kind is bool else "an integer"),
                       param=name)
    return value


def _object(body: dict, name: str, known: tuple[str, ...]) -> dict:
    """A field holding an object of `known` fields (or null)."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, MSG_API_WRONG_TYPE.format(name=name, kind="an object"), param=name)
    unknown = sorted(set(value) - set(known))
    if unknown:
        names = _names(f"{name}.{key}" for key in unknown)
        raise ApiError(400, MSG_API_UNKNOWN_FIELDS.format(names=names, known=_names(f"{name}.{key}" for key in known)),
                       param=name)
    return value


def _names(names) -> str:
    return ", ".join(f"“{name}”" for name in names)
