"""The model manager: one per process, owns the model and processor, and runs every request.

A request's lifecycle: prepare inputs on the calling thread (CPU work: images decoded and sliced,
prompt rendered), join the scheduler's bounded wait line (app.engine.scheduler), run in a batch with
everyone else's requests, turn the tokens it is handed into text as they arrive. Closing the stream at
any point (user pressed Stop, client went away) marks the request cancelled, and it leaves the batch
at the next step.
"""

import gc
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from app import limits
from app.config import AppConfig
from app.engine.batch_runner import BatchRunner, canvas_positions
from app.engine.inputs import PreparedInputs
from app.engine.loader import ModelSource, load_model_and_processor, pick_device, pick_dtype, resolve_model
from app.engine.metrics import EngineMetrics
from app.engine.preparers import ProcessPreparer, ThreadPreparer, preparer_processes
from app.engine.presets import find_preset
from app.engine.scheduler import Request, Scheduler, release_gpu_memory
from app.engine.settings import GenerationSettings
from app.engine.stop_signal import StopSignal
from app.errors import Busy, UserError
from app.media.budget import SlicePlan, plan_slices
from app.media.images import load_image
from app.zerogpu import zero_gpu_enabled

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


def preparation_stages(requested_at: float, timeline: dict, prepared_at: float) -> dict:
    """Where a request's preprocessing time went, in ms: reaching the preparer (in the engine's process,
    a free preparing thread), waiting for a worker, the work itself, the way back from the worker, and
    what follows (positions, the pixels staged on the GPU)."""
    marks = [requested_at] + [timeline[stage] for stage in ("asked", "work_started", "work_done", "received")] + [prepared_at]
    names = ("to_preparer", "for_a_worker", "work", "way_back", "staging")
    return {name: round((end - start) * 1000, 1) for name, start, end in zip(names, marks, marks[1:])}


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


class _TextAssembler:
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


class ModelManager:
    def __init__(self, config: AppConfig):
        self.config = config
        self.model = None
        self.processor = None
        self.source: ModelSource | None = None
        self.device = None
        self.warmup_s = None
        self.metrics = EngineMetrics()
        self.metrics.gauges["gpu_memory_bytes"] = self.gpu_memory_bytes
        self.metrics.gauges["gpu_memory_peak_bytes"] = self.gpu_memory_peak_bytes
        self.metrics.on_reset.append(self._reset_gpu_memory_peak)
        self.scheduler = Scheduler(config.max_batch_size, config.queue_size, self.metrics, inline=zero_gpu_enabled())
        self._ready = threading.Event()  # a model is loaded (cleared while switching)
        self.preparer = None  # app.engine.preparers: threads here, or worker processes
        self._version = 0  # bumped by every load, so a request prepared for an older model is prepared again

    # Loading ---------------------------------------------------------------------------------------

    def load(self) -> None:
        started = time.perf_counter()
        self.source = resolve_model(self.config.model)
        self.device = pick_device(self.config.device)
        if self._on_cuda:
            # The model runs on the GPU: this process's own tensor work is small index lists, which torch's
            # pool of a thread per core made slower while it kept 15 threads spinning (1.1 cores at 200
            # users on a 16-core H200 box, benchmarks/RESULTS.md), cores the preparers need.
            import torch

            torch.set_num_threads(1)
        sys.setswitchinterval(limits.SWITCH_INTERVAL_S)
        dtype = pick_dtype(self.config.dtype, self.device)
        self.model, self.processor = load_model_and_processor(
            self.source, self.device, dtype, self.config.attn_implementation, self.config.trust_remote_code,
            self.config.load_in_4bit)
        self._version += 1
        # On ZeroGPU the GPU (and the work) stays inside the callers' functions: no processes of ours.
        workers = 0 if self.scheduler.inline else preparer_processes(self.config.prepare_processes, self.device)
        pixel_dtype = self.model.model.vision_tower.dtype
        self.preparer = (ProcessPreparer(self.source.path, self.config.trust_remote_code, workers, pixel_dtype) if workers
                         else ThreadPreparer(self.processor, pixel_dtype))
        # On ZeroGPU each request runs in a fresh GPU worker: captured graphs would not outlive it.
        runner = BatchRunner(self.model, use_cuda_graphs=False if self.scheduler.inline else None)
        self.scheduler.attach(runner, self._end_token_ids(), self._version)
        self._ready.set()
        log.info("Loaded %s on %s (%s) in %.1f s", self.source.name, self.device, dtype, time.perf_counter() - started)

    def warm_up(self) -> float:
        """Short generations with an image, alone and in waves, so kernels are ready before the first user.

        On CUDA it then runs every prefill and decode shape the scheduler can use
        (BatchRunner.warm_up_shapes): Triton kernels (flash-linear-attention's) are compiled and tuned
        for each new shape, and on an H200 a first crowd of 200 users otherwise spent 97% of the
        scheduler's time compiling. Kernels are cached on disk, so later starts are faster.
        """
        import tempfile
        from concurrent.futures import ThreadPoolExecutor

        from PIL import Image

        started = time.perf_counter()
        with tempfile.NamedTemporaryFile(suffix=".png") as file:
            Image.new("RGB", (448, 448), (120, 160, 200)).save(file.name)
            messages = [{"role": "user", "content": [{"type": "image", "path": file.name},
                                                     {"type": "text", "text": "Describe the image."}]}]
            settings = GenerationSettings(max_new_tokens=4, do_sample=False)

            def one_reply(_=None):
                for _ in self.stream(messages, settings):
                    pass

            one_reply()
            # No wave larger than the batch and its wait line together, which would be refused as busy.
            for wave in sorted({min(wave, self.config.max_batch_size + self.config.queue_size) for wave in limits.WARM_UP_WAVES}):
                with ThreadPoolExecutor(wave) as pool:
                    list(pool.map(one_reply, range(wave)))
        if self.scheduler.runner.graphs is not None:
            self._warm_up_shapes()
        self.warmup_s = time.perf_counter() - started
        log.info("Warm-up took %.2f s", self.warmup_s)
        # What is loaded by now (modules, the model, kernels: 483,000 objects with the tiny model) stays: out
        # of the collector's full collections, which otherwise walk it all: 0.46-0.49 s on the dev machine,
        # a 0.3 s stop of every stream in the engine process on an H200 box at 200 users (benchmarks/
        # RESULTS.md, "Morning run (2026-12-02)"). _unload unfreezes it, for the old model's cycles.
        gc.freeze()
        return self.warmup_s

    def _warm_up_shapes(self) -> None:
        """BatchRunner.warm_up_shapes with the scheduler paused (after a model switch users may be waiting)."""
        import torch

        if not self.scheduler.pause(limits.SWITCH_WAIT_S):
            log.warning("Replies kept running: the kernel warm-up for every batch shape was skipped")
            return
        try:
            with torch.inference_mode():
                shapes = self.scheduler.runner.warm_up_shapes(self.config.max_batch_size, limits.PREFILL_TOKENS_PER_STEP)
            log.info("Warmed up %d prefill shapes and the decode step up to batch %d", len(shapes), self.config.max_batch_size)
        except Exception as error:  # out of memory on a small card, say: serve anyway, kernels build on first use
            log.error("The warm-up of every batch shape stopped; serving without it", exc_info=error)
            self.scheduler.runner.release()
            release_gpu_memory(error)
        finally:
            self.scheduler.resume()

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
        if not self.scheduler.pause(limits.SWITCH_WAIT_S):
            raise UserError(limits.MSG_SWITCHING)
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
            self.scheduler.resume()
        self.warm_up()
        if failure is not None:
            raise UserError(limits.MSG_SWITCH_FAILED.format(model=model, error=failure, current=previous.model)) from failure
        return {"freed_gpu_bytes": freed, "warmup_s": self.warmup_s}

    def _unload(self) -> int:
        """Drop model and processor; GPU bytes released (0 on the CPU)."""
        import torch

        before = self.gpu_memory_bytes() or 0
        self._ready.clear()
        self.scheduler.runner.release()
        self.scheduler.runner = None
        self.preparer.close()
        self.model = self.processor = self.preparer = None
        gc.unfreeze()
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
        # Quantized layers keep their packed weights in buffers, not parameters.
        weight_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        dtype = str(self.model.dtype).replace("torch.", "")
        quantization = getattr(self.model.config, "quantization_config", None)
        if quantization is not None:
            quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
            bits = quantization.get("bits") or ("4" if quantization.get("load_in_4bit") else "?")
            method = quantization.get("quant_method", "quantized")
            dtype = f"{getattr(method, 'value', method)} {bits}-bit weights, {dtype} compute"
        return ModelInfo(
            name=self.source.name, path=self.source.path, model_type=self.model.config.model_type,
            device=str(self.device), dtype=dtype, parameters=parameters,
            weight_bytes=weight_bytes, random_weights=self.source.random_weights, warmup_s=self.warmup_s,
            gpu_memory_bytes=self.gpu_memory_bytes(),
        )

    def profile_gpu(self, seconds: float) -> dict:
        """Where the GPU's time goes over the next `seconds` while requests are served as usual
        (app/engine/gpu_profile.py; benchmarks/gpu_timeline.py reports it)."""
        from app.engine import gpu_profile

        return gpu_profile.record(seconds, self.metrics.snapshot)

    def gpu_memory_bytes(self) -> int | None:
        import torch

        return torch.cuda.memory_allocated(self.device) if self._on_cuda else None

    @property
    def _on_cuda(self) -> bool:
        return str(self.device).startswith("cuda")

    def gpu_memory_peak_bytes(self) -> int | None:
        """The most GPU memory allocated at once since the metrics were last reset."""
        import torch

        return torch.cuda.max_memory_allocated(self.device) if self._on_cuda else None

    def _reset_gpu_memory_peak(self) -> None:
        import torch

        if self._on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

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
        """Requests in the running batch: zero once every request has left the GPU."""
        return self.scheduler.running

    def _end_token_ids(self):
        import torch

        end = self.model.generation_config.eos_token_id
        end = [] if end is None else [end] if isinstance(end, int) else list(end)
        return torch.tensor(end, dtype=torch.long, device=self.model.device)

    # Serving ---------------------------------------------------------------------------------------

    def plan_images(self, paths: list[str], settings: GenerationSettings) -> SlicePlan:
        """What these images would cost together under `settings`, without running the model."""
        self._wait_until_ready()
        images = [load_image(path) for path in paths]
        return plan_slices(self.processor.image_processor, [(image.height, image.width) for image in images],
                           settings.max_slice_nums, settings.downsample_mode, settings.visual_token_budget)

    def prepare(self, messages: list[dict], settings: GenerationSettings) -> PreparedInputs:
        self._wait_until_ready()
        asked = time.perf_counter()
        prepared = self.preparer.prepare(messages, settings, self.max_context_tokens)
        prepared.timeline["asked"] = asked
        # Also CPU work on the prompt, so done here rather than on the thread that drives the GPU.
        prepared.canvas = canvas_positions(self.model, prepared.tensors, settings.downsample_mode)
        runner = self.scheduler.runner
        if runner is not None:  # None while a model is switched: the request is prepared again for the next
            runner.stage_media(prepared.tensors)
        return prepared

    def start(self, messages: list[dict], settings: GenerationSettings, emit: Callable[[str, object], None],
              requested_at: float, cancelled: threading.Event | None = None) -> Request | None:
        """Prepare a request and put it in line; its events go to `emit(kind, value)` (see follow_reply),
        and setting `cancelled` takes it out. Raises UserError for bad input; a full line is emitted
        ("refused") and counted, not raised (None is returned then). The line is asked before the request
        is prepared too: a crowd beyond it hears so without costing the engine any image decoding.
        """
        version = self._version

        def prepare_and_tell() -> PreparedInputs:  # again if the model was switched while the request waited
            prepared = self.prepare(messages, settings)
            emit("prepared", prepared_summary(prepared, self.source.path, time.perf_counter()))
            return prepared

        try:
            self.scheduler.check_room()
            request = Request(prepared=prepare_and_tell(), settings=settings, version=version, requested_at=requested_at,
                              prepare_again=prepare_and_tell, emit=emit, cancelled=cancelled or threading.Event())
            self.scheduler.submit(request)
        except Busy as error:
            self.metrics.request_done("busy")
            emit("refused", error)
            return None
        return request

    def stream(self, messages: list[dict], settings: GenerationSettings,
               stop: StopSignal | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply to `messages`; `stop` ends it at once, wherever it is. Raises UserError for bad
        input and for failures the user should see."""
        requested_at = time.perf_counter()
        events = queue.SimpleQueue()
        cancelled = threading.Event()
        if stop is not None:
            stop.on_set(cancelled.set)  # one still being prepared is not put in line
            stop.on_set(lambda: events.put(("stopped", None)))
        self.start(messages, settings, lambda kind, value: events.put((kind, value)), requested_at, cancelled)

        yield from follow_reply(events, lambda path: self.processor.tokenizer, requested_at,
                                lambda outcome: self.end_request(cancelled, outcome),
                                self.scheduler.drive if self.scheduler.inline else None)

    def end_request(self, cancelled: threading.Event, outcome: str) -> None:
        """The caller is done with a request (`outcome` as in metrics.OUTCOMES): it leaves the batch."""
        cancelled.set()
        if outcome != "busy":  # counted when refused
            self.metrics.request_done(outcome)


def prepared_summary(prepared: PreparedInputs, model_path: str, prepared_at: float) -> dict:
    """What a reply's updates and stats need to know of its prepared inputs (small and picklable)."""
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

    Events: ("prepared", prepared_summary), ("place", requests ahead), ("tokens", [ids]), ("end", timing),
    ("refused", UserError: the line is full), ("error", exception) and ("stopped", None) (the caller's
    StopSignal: the reply ends with no last update). The same loop serves a request run
    in this process and one run in the engine process (app.engine.engine_process).
    """
    outcome = "stopped"
    prepared = first_received_at = None
    try:
        while True:
            while wait_for_events is not None and events.empty():
                wait_for_events()
            kind, value = events.get()
            if kind == "prepared":
                prepared, text = value, _TextAssembler(tokenizer_for(value["model_path"]))
            elif kind == "refused":
                outcome = "busy"
                raise value
            elif kind == "error":
                outcome = "error"
                raise as_user_error(value)
            elif kind == "place":
                yield ReplyUpdate(text="", waiting_ahead=value)
            elif kind == "tokens":
                first_received_at = first_received_at or time.perf_counter()
                for token in value:
                    text.add(token)
                if events.empty():  # else the consumer fell behind (a busy web server): one update for all
                    yield ReplyUpdate(text=text.text, notices=prepared["notices"], opens_thinking=prepared["opens_thinking"])
            elif kind == "end":
                break
            elif kind == "stopped":  # the caller's StopSignal
                return
        outcome = "finished"
    finally:
        close(outcome)
    stats = dict(prepared["counts"])
    stats.update(timing_stats(value["new_tokens"], requested_at, prepared["prepared_at"], value["started_at"],
                              value["first_token_at"], time.perf_counter()))
    stats["preparation_ms"] = preparation_stages(requested_at, prepared["timeline"], prepared["prepared_at"])
    if first_received_at is not None:  # how long the first token took to come here from the engine's loop
        stats["first_token_delivery_ms"] = round((first_received_at - value["first_token_at"]) * 1000, 1)
    stats["requested_at"] = round(time.time() - (time.perf_counter() - requested_at), 3)  # Unix time
    yield ReplyUpdate(text=text.text, notices=prepared["notices"], opens_thinking=prepared["opens_thinking"], stats=stats)


def as_user_error(error: BaseException) -> UserError:
    """The message a user sees for a failure of their request."""
    if isinstance(error, UserError):
        return error
    import torch

    if isinstance(error, torch.cuda.OutOfMemoryError):
        return UserError(limits.MSG_OUT_OF_MEMORY)
    log.error("Generation failed", exc_info=error)
    return UserError(limits.MSG_GENERATION_FAILED.format(error=f"{type(error).__name__}: {error}"))


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
            elif config.engine_process and not zero_gpu_enabled():  # on ZeroGPU the GPU exists only in this process
                from app.engine.engine_process import EngineProcess

                _manager = EngineProcess(config)
            else:
                _manager = ModelManager(config)
        return _manager
