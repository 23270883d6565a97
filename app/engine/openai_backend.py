"""The same model-manager interface over an external OpenAI-compatible server (vLLM, SGLang, Ollama,
`transformers serve`): no weights load here; images travel as base64 data URLs, a video as its sampled frames.

How MiniCPM-V 2.6 runs (its Hub code predates transformers 5) and how users scale past one GPU.
"""

import base64
import io
import json
import logging
import os
import threading
import time
from typing import Iterator

from app import limits
from app.messages import (
    MSG_COSTS_ON_SERVER,
    MSG_EMPTY_REQUEST,
    MSG_ENGINE_BROKE,
    MSG_ENGINE_DOWN,
    MSG_ENGINE_REFUSED,
    MSG_ENGINE_SLOW,
)
from app.config import AppConfig
from app.engine.api import ModelInfo, ReplyUpdate
from app.engine.replies import timing_stats
from app.engine.metrics import EngineMetrics
from app.engine.settings import GenerationSettings
from app.engine.stop_signal import StopSignal
from app.errors import Busy, NotReady, ServingFailed, UserError
from app.media.images import load_image
from app.media.video import sample_video

log = logging.getLogger(__name__)


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def _openai_messages(messages: list[dict], settings: GenerationSettings) -> tuple[list[dict], int]:
    """Model messages as OpenAI chat messages, and the number of video frames sent."""
    from PIL import Image

    converted, frames_sent = [], 0
    for message in messages:
        parts = []
        for part in message["content"]:
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif part["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": _data_url(load_image(part["path"]))}})
            else:
                video = sample_video(part["path"], settings.video_fps, settings.video_max_frames)
                frames_sent += len(video.frames)
                parts.extend({"type": "image_url", "image_url": {"url": _data_url(Image.fromarray(frame))}}
                             for frame in video.frames)
        converted.append({"role": message["role"], "content": parts})
    return converted, frames_sent


class OpenAIEngine:
    def __init__(self, config: AppConfig):
        self.config = config
        self.base_url = config.openai_base_url.rstrip("/")
        self.api_key = os.environ.get("OPENAI_API_KEY") or "none"
        self.warmup_s = None
        self._loaded = False
        self._running = 0
        self._running_lock = threading.Lock()
        self.metrics = EngineMetrics()  # requests, errors and time to first token as seen from here
        self.metrics.gauges["requests_in_flight"] = lambda: self._running

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        """Nothing to load; a server that is down now is reported per request, and used once it is back."""
        self._loaded = True
        try:
            self._client(timeout=5).get(self.base_url + "/models").raise_for_status()
        except Exception as error:
            log.warning("The model server at %s does not answer yet (%s); requests will say so until it does.",
                        self.base_url, error)

    def warm_up(self) -> float | None:
        started = time.perf_counter()
        messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
        try:
            for _ in self.stream(messages, GenerationSettings(max_new_tokens=2, do_sample=False)):
                pass
        except UserError as error:
            log.warning("Warm-up skipped: %s", error)
            return None
        self.warmup_s = time.perf_counter() - started
        return self.warmup_s

    def info(self) -> ModelInfo:
        return ModelInfo(name=self.config.openai_model, path=self.base_url, model_type="OpenAI-compatible server",
                         device=self.base_url, dtype="remote", parameters=None, weight_bytes=None,
                         random_weights=False, warmup_s=self.warmup_s, gpu_memory_bytes=None)

    def default_settings(self) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.config.max_new_tokens,
                                  visual_token_budget=self.config.visual_token_budget)

    def plan_images(self, paths: list[str], settings: GenerationSettings):
        raise UserError(MSG_COSTS_ON_SERVER)

    @property
    def active_generations(self) -> int:
        return self._running

    def _client(self, timeout: float):
        import httpx

        return httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0),
                            headers={"Authorization": f"Bearer {self.api_key}"})

    def _payload(self, messages: list[dict], settings: GenerationSettings) -> dict:
        payload = {
            "model": self.config.openai_model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature if settings.do_sample else 0.0,
            "top_p": settings.top_p if settings.do_sample else 1.0,
        }
        # Not in OpenAI's own API but read by vLLM, SGLang and others; sent only when they change something.
        if settings.do_sample and settings.top_k:
            payload["top_k"] = settings.top_k
        if settings.repetition_penalty != 1.0:
            payload["repetition_penalty"] = settings.repetition_penalty
        if settings.min_new_tokens:
            payload["min_tokens"] = settings.min_new_tokens
        if settings.enable_thinking is not None:  # unset: the server's chat template decides
            payload["chat_template_kwargs"] = {"enable_thinking": settings.enable_thinking}
        if settings.stop:
            payload["stop"] = list(settings.stop)
        if settings.seed is not None and settings.do_sample:
            payload["seed"] = settings.seed
        return payload

    def stream(self, messages: list[dict], settings: GenerationSettings,
               stop: StopSignal | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply from the server; `stop` ends it at once (its connection is closed)."""
        import httpx

        if not messages or messages[-1]["role"] != "user":
            raise UserError(MSG_EMPTY_REQUEST)
        requested_at = time.perf_counter()
        converted, frames = _openai_messages(messages, settings)
        prepared_at = time.perf_counter()
        text, reasoning, usage, first_at, chunks, finish_reason = "", "", {}, None, 0, None
        with self._running_lock:
            self._running += 1
        outcome = "error"  # unless it finishes, or the caller stops it
        try:
            with self._client(timeout=limits.ENGINE_READ_TIMEOUT_S) as client, client.stream(
                    "POST", self.base_url + "/chat/completions", json=self._payload(converted, settings)) as response:
                if stop is not None:
                    stop.on_set(response.close)
                if response.status_code >= 400:
                    raise _refusal(response.status_code, response.read().decode(errors="replace")[:300])
                for event in _events(response):
                    usage = event.get("usage") or usage
                    for choice in event.get("choices", []):
                        finish_reason = choice.get("finish_reason") or finish_reason
                        delta = choice.get("delta", {})
                        piece = delta.get("content") or ""
                        thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
                        if piece or thought:
                            if first_at is None:
                                first_at = time.perf_counter()
                                self.metrics.first_token(first_at - requested_at)
                            chunks += 1
                            text += piece
                            reasoning += thought
                            yield ReplyUpdate(text=self._joined(reasoning, text))
            outcome = "finished"
        except GeneratorExit:
            outcome = "stopped"
            raise
        except Busy:  # the server's line is full: turned away, as this app's own engine counts it
            outcome = "busy"
            raise
        except httpx.ConnectError as error:
            raise NotReady(MSG_ENGINE_DOWN.format(url=self.base_url)) from error
        except httpx.TimeoutException as error:
            raise ServingFailed(MSG_ENGINE_SLOW.format(url=self.base_url, seconds=limits.ENGINE_READ_TIMEOUT_S)) from error
        except (httpx.TransportError, httpx.StreamClosed, json.JSONDecodeError) as error:
            if stop is not None and stop.is_set:
                outcome = "stopped"
                return
            raise ServingFailed(MSG_ENGINE_BROKE.format(url=self.base_url)) from error
        finally:
            self.metrics.request_done(outcome)
            with self._running_lock:
                self._running -= 1
        stats = _stats(usage, frames, usage.get("completion_tokens", chunks), requested_at, prepared_at, first_at)
        stats["finish_reason"] = finish_reason or "stop"
        yield ReplyUpdate(text=self._joined(reasoning, text), stats=stats)

    @staticmethod
    def _joined(reasoning: str, text: str) -> str:
        """Servers that split reasoning into its own field get it back as a <think> block for display."""
        return f"<think>{reasoning}</think>{text}" if reasoning else text


def _refusal(status: int, detail: str) -> UserError:
    """The server's refusal of a request, as the error of its kind: busy, not ready, bad input, or a failure."""
    message = MSG_ENGINE_REFUSED.format(status=status, detail=detail)
    kind = {429: Busy, 503: NotReady}.get(status, UserError if 400 <= status < 500 else ServingFailed)
    return kind(message)


def _events(response) -> Iterator[dict]:
    """The server-sent events of a streamed chat completion, parsed."""
    for line in response.iter_lines():
        if line.startswith("data:") and line.strip() != "data: [DONE]":
            yield json.loads(line[len("data:"):])


def _stats(usage: dict, frames: int, new_tokens: int, requested_at: float, prepared_at: float,
           first_at: float | None) -> dict:
    """A reply's stats, from what the server reported (`usage`) and the times seen here."""
    return {
        "visual_tokens": None,  # counted by the server
        "image_tokens": [],
        "video_tokens": None,
        "video_frames": frames,
        "prompt_tokens": usage.get("prompt_tokens"),
        # The server queues on its own side: from here, waiting is part of the time to first token.
        **timing_stats(new_tokens, requested_at, prepared_at, prepared_at, first_at, time.perf_counter()),
    }
