"""The model manager: one per process, owns the model and processor, and runs every request.

A request's lifecycle: prepare inputs on the calling thread (CPU work), wait in line for the GPU
(app.engine.gate: bounded, first come first served, reporting its place), hand `generate()` to the
manager's one generation thread, which feeds a streamer, yield text as it arrives, release.
Closing the stream at any point (user pressed Stop, client went away) sets the request's stop event,
which a StoppingCriteria reads at every decode step, so `generate()` itself ends within one step.
"""

import functools
import gc
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Iterator

from app import limits
from app.config import AppConfig
from app.engine.gate import GpuGate
from app.engine.inputs import PreparedInputs, prepare_inputs
from app.engine.loader import ModelSource, load_model_and_processor, pick_device, pick_dtype, resolve_model
from app.engine.presets import find_preset
from app.engine.settings import GenerationSettings
from app.errors import UserError
from app.media.budget import SlicePlan, plan_slices
from app.media.images import load_image

log = logging.getLogger(__name__)


@dataclass
class ReplyUpdate:
    """The reply so far; `stats` is set on the last update only."""

    text: str
    notices: list[str] = field(default_factory=list)
    opens_thinking: bool = False  # the prompt already opened a reasoning block: `text` starts inside it
    stats: dict | None = None
    waiting_ahead: int | None = None  # set while the request waits in line: requests ahead of it


def timing_stats(new_tokens: int, requested_at: float, prepared_at: float, started_at: float,
                 first_token_at: float | None, finished_at: float) -> dict:
    """The timing part of a reply's stats, from perf_counter() readings; tokens_per_s is the decode rate."""
    first = first_token_at or finished_at
    decode_s = finished_at - first
    return {
        "new_tokens": new_tokens,
        "ttft_ms": round((first - requested_at) * 1000, 1),
        "preprocess_ms": round((prepared_at - requested_at) * 1000, 1),
        "queue_ms": round((started_at - prepared_at) * 1000, 1),
        "tokens_per_s": round((new_tokens - 1) / decode_s, 1) if new_tokens > 1 and decode_s > 0 else None,
        "total_ms": round((finished_at - requested_at) * 1000, 1),
    }


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


@functools.cache
def _streamer_class():
    from transformers import TextIteratorStreamer

    class CountingStreamer(TextIteratorStreamer):
        """Also counts generated tokens and notes when the first one arrived."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.new_tokens = 0
            self.first_token_at = None

        def put(self, value):
            if not (self.skip_prompt and self.next_tokens_are_prompt):
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                self.new_tokens += value.numel()
            super().put(value)

    return CountingStreamer


def _stop_criteria(stop_event: threading.Event):
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOnEvent(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), stop_event.is_set(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopOnEvent()])


class _GenerationThread:
    """One long-lived thread runs every generate() call.

    CUDA libraries keep per-thread state (cuDNN attention graphs, library handles): a fresh thread per
    request rebuilt it for every new sequence length and decoded about 3x slower on an H200
    (benchmarks/RESULTS.md).
    """

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="generate", daemon=True)
        self._thread.start()

    def submit(self, job) -> threading.Event:
        done = threading.Event()
        self._jobs.put((job, done))
        return done

    def _serve(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                job()
            finally:
                done.set()


class ModelManager:
    def __init__(self, config: AppConfig):
        self.config = config
        self.model = None
        self.processor = None
        self.source: ModelSource | None = None
        self.device = None
        self.warmup_s = None
        self.gate = GpuGate(max_waiting=config.queue_size)
        self._generation_thread: _GenerationThread | None = None
        self._ready = threading.Event()  # a model is loaded (cleared while switching)
        self._version = 0  # bumped by every load, so a request prepared for an older model is prepared again
        self._running = 0  # generate() calls in progress

    # Loading ---------------------------------------------------------------------------------------

    def load(self) -> None:
        started = time.perf_counter()
        self.source = resolve_model(self.config.model)
        self.device = pick_device(self.config.device)
        dtype = pick_dtype(self.config.dtype, self.device)
        self.model, self.processor = load_model_and_processor(
            self.source, self.device, dtype, self.config.attn_implementation, self.config.trust_remote_code)
        self._version += 1
        self._ready.set()
        log.info("Loaded %s on %s (%s) in %.1f s", self.source.name, self.device, dtype, time.perf_counter() - started)

    def warm_up(self) -> float:
        """One short generation with an image, so kernels and caches are ready before the first user."""
        import tempfile

        from PIL import Image

        started = time.perf_counter()
        with tempfile.NamedTemporaryFile(suffix=".png") as file:
            Image.new("RGB", (448, 448), (120, 160, 200)).save(file.name)
            messages = [{"role": "user", "content": [{"type": "image", "path": file.name},
                                                     {"type": "text", "text": "Describe the image."}]}]
            settings = GenerationSettings(max_new_tokens=4, do_sample=False)
            for _ in self.stream(messages, settings):
                pass
        self.warmup_s = time.perf_counter() - started
        log.info("Warm-up took %.2f s", self.warmup_s)
        return self.warmup_s

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def switch(self, model: str) -> dict:
        """Serve `model` instead of the current one; replies in progress finish first.

        The switch takes the GPU in line like a request: replies in progress complete, later ones wait
        (new requests wait until a model is ready). If the new model fails to load, the previous one is
        loaded again and the error is raised.
        """
        preset = find_preset(model)
        if preset is not None and not preset.native:
            raise UserError(preset.note)
        for _ in self.gate.line_up():
            pass
        previous = self.config
        failure = None
        try:
            freed = self._unload()
            self.config = replace(previous, model=model)
            try:
                self.load()
            except Exception as error:
                failure = error
                self.config = previous
                self.load()
        finally:
            self.gate.release()
        self.warm_up()
        if failure is not None:
            raise UserError(limits.MSG_SWITCH_FAILED.format(model=model, error=failure, current=previous.model)) from failure
        return {"freed_gpu_bytes": freed, "warmup_s": self.warmup_s}

    def _unload(self) -> int:
        """Drop model and processor; GPU bytes released (0 on the CPU)."""
        import torch

        before = self.gpu_memory_bytes() or 0
        self._ready.clear()
        self.model = self.processor = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        freed = before - (self.gpu_memory_bytes() or 0)
        log.info("Unloaded %s, %.2f GiB of GPU memory released", self.source.name, freed / 2**30)
        return freed

    def _wait_until_ready(self) -> None:
        if not self._ready.wait(limits.SWITCH_WAIT_S):
            raise UserError(limits.MSG_SWITCHING)

    def info(self) -> ModelInfo:
        self._wait_until_ready()
        parameters = sum(p.numel() for p in self.model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return ModelInfo(
            name=self.source.name, path=self.source.path, model_type=self.model.config.model_type,
            device=str(self.device), dtype=str(self.model.dtype).replace("torch.", ""), parameters=parameters,
            weight_bytes=weight_bytes, random_weights=self.source.random_weights, warmup_s=self.warmup_s,
            gpu_memory_bytes=self.gpu_memory_bytes(),
        )

    def gpu_memory_bytes(self) -> int | None:
        import torch

        if not str(self.device).startswith("cuda"):
            return None
        return torch.cuda.memory_allocated(self.device)

    def default_settings(self) -> GenerationSettings:
        """The checkpoint's own generation_config as the starting point for every request."""
        self._wait_until_ready()
        generation = self.model.generation_config
        preset = find_preset(self.source.name)
        return GenerationSettings(
            max_new_tokens=self.config.max_new_tokens,
            do_sample=bool(generation.do_sample),
            temperature=float(generation.temperature if generation.temperature is not None else 1.0),
            top_p=float(generation.top_p if generation.top_p is not None else 1.0),
            top_k=int(generation.top_k or 0),
            repetition_penalty=float(generation.repetition_penalty or 1.0),
            visual_token_budget=self.config.visual_token_budget,
            enable_thinking=bool(preset and preset.thinking_by_default),
        )

    @property
    def max_context_tokens(self) -> int:
        text_config = self.model.config.get_text_config()
        return min(limits.MAX_CONTEXT_TOKENS, getattr(text_config, "max_position_embeddings", limits.MAX_CONTEXT_TOKENS))

    @property
    def active_generations(self) -> int:
        """generate() calls still running: zero once every request has left the GPU."""
        return self._running

    # Serving ---------------------------------------------------------------------------------------

    def plan_images(self, paths: list[str], settings: GenerationSettings) -> SlicePlan:
        """What these images would cost together under `settings`, without running the model."""
        self._wait_until_ready()
        images = [load_image(path) for path in paths]
        return plan_slices(self.processor.image_processor, [(image.height, image.width) for image in images],
                           settings.max_slice_nums, settings.downsample_mode, settings.visual_token_budget)

    def prepare(self, messages: list[dict], settings: GenerationSettings) -> PreparedInputs:
        self._wait_until_ready()
        return prepare_inputs(self.processor, messages, settings, self.max_context_tokens)

    def _generate_kwargs(self, prepared: PreparedInputs, settings: GenerationSettings, streamer, stop_event) -> dict:
        tensors = {name: value.to(self.model.device) if hasattr(value, "to") else value
                   for name, value in prepared.tensors.items()}
        kwargs = dict(
            **tensors,
            streamer=streamer,
            stopping_criteria=_stop_criteria(stop_event),
            max_new_tokens=settings.max_new_tokens,
            min_new_tokens=settings.min_new_tokens or None,
            repetition_penalty=settings.repetition_penalty,
            downsample_mode=settings.downsample_mode,
            do_sample=settings.do_sample,
        )
        if settings.do_sample:
            kwargs.update(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs

    def stream(self, messages: list[dict], settings: GenerationSettings) -> Iterator[ReplyUpdate]:
        """Stream a reply to `messages`. Raises UserError for bad input and for failures the user should see."""
        import torch

        requested_at = time.perf_counter()
        version = self._version
        prepared = self.prepare(messages, settings)
        prepared_at = time.perf_counter()
        stop_event = threading.Event()
        failure: list[BaseException] = []

        def run_generate():
            self._running += 1
            try:
                with torch.inference_mode():
                    self.model.generate(**kwargs)
            except BaseException as error:  # reported to the waiting request below
                failure.append(error)
            finally:
                self._running -= 1
                streamer.end()

        for ahead in self.gate.line_up():
            yield ReplyUpdate(text="", waiting_ahead=ahead)
        try:
            started_at = time.perf_counter()
            if self._version != version:  # the model was switched while this request waited
                prepared = self.prepare(messages, settings)
            streamer = _streamer_class()(self.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
            kwargs = self._generate_kwargs(prepared, settings, streamer, stop_event)
            if self._generation_thread is None:
                self._generation_thread = _GenerationThread()
            done = self._generation_thread.submit(run_generate)
            text = ""
            try:
                for chunk in streamer:
                    text += chunk
                    yield ReplyUpdate(text=text, notices=prepared.notices, opens_thinking=prepared.opens_thinking)
            finally:
                stop_event.set()
                if not done.wait(limits.WORKER_JOIN_TIMEOUT_S):
                    log.error("generate() did not stop within %.0f s", limits.WORKER_JOIN_TIMEOUT_S)
        finally:
            self.gate.release()
        finished_at = time.perf_counter()
        if failure:
            self._raise_for(failure[0])
        stats = {
            "visual_tokens": prepared.visual_tokens,
            "image_tokens": prepared.image_tokens,
            "video_tokens": prepared.video_tokens,
            "video_frames": prepared.video_frames,
            "prompt_tokens": prepared.prompt_tokens,
            **timing_stats(streamer.new_tokens, requested_at, prepared_at, started_at, streamer.first_token_at, finished_at),
        }
        yield ReplyUpdate(text=text, notices=prepared.notices, opens_thinking=prepared.opens_thinking, stats=stats)

    def _raise_for(self, error: BaseException) -> None:
        import torch

        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            raise UserError(limits.MSG_OUT_OF_MEMORY) from error
        log.error("generate() failed", exc_info=error)
        raise UserError(limits.MSG_GENERATION_FAILED.format(error=f"{type(error).__name__}: {error}")) from error


_manager: ModelManager | None = None
_manager_lock = threading.Lock()


def get_manager(config: AppConfig | None = None):
    """The process-wide manager; the first call creates it from `config` (a local model, or an OpenAI server)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            if config is None:
                raise RuntimeError("the model manager has not been created yet")
            if config.backend == "openai":
                from app.engine.openai_engine import OpenAIEngine

                _manager = OpenAIEngine(config)
            else:
                _manager = ModelManager(config)
        return _manager
