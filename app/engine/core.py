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
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator

from app import limits, startup, tuning
from app.messages import MSG_SWITCHING, MSG_SWITCH_FAILED
from app.config import AppConfig
from app.engine.conversations import ConversationCache, without_media_before
from app.engine.encoded_images import EncodedImages, held_media, take_held_media
from app.engine.inputs import PreparedInputs, canvas_positions, thinks_by_default
from app.model.checkpoint.loader import ModelSource, load_model_and_processor, pick_device, pick_dtype, resolve_model
from app.engine.metrics import EngineMetrics
from app.engine.replies import follow_reply, prepared_summary
from app.engine.preparers import ProcessPreparer, ThreadPreparer, preparer_processes
from app.model.checkpoint.presets import find_preset
from app.engine.request import Request
from app.engine.scheduler import Scheduler
from app.engine.api import ModelInfo, ReplyEvent, ReplyUpdate
from app.engine.settings import GenerationSettings
from app.engine.stop_signal import StopSignal
from app.errors import Busy, NotReady, UserError
from app.media.budget import SlicePlan, plan_slices
from app.media.images import image_size
from app.zerogpu import zero_gpu_enabled

log = logging.getLogger(__name__)


class ModelManager:
    def __init__(self, config: AppConfig):
        self.config = config
        self.model = None
        self.processor = None
        self.thinking_by_default = False  # the loaded checkpoint's chat template's (app.engine.inputs.thinks_by_default)
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
        self.runner = None  # app.model.runner.BatchRunner: the model's side of batching, handed to the scheduler
        self._version = 0  # bumped by every load, so a request prepared for an older model is prepared again

    # Loading ---------------------------------------------------------------------------------------

    def load(self) -> None:
        started = time.perf_counter()
        self.source = resolve_model(self.config.model)
        self.device = pick_device(self.config.device)
        startup.engine_device_chosen(self.device)
        dtype = pick_dtype(self.config.dtype, self.device)
        self.model, self.processor = load_model_and_processor(
            self.source, self.device, dtype, self.config.attn_implementation, self.config.trust_remote_code,
            self.config.load_in_4bit)
        self._version += 1
        self.thinking_by_default = thinks_by_default(self.processor)
        # On ZeroGPU the GPU (and the work) stays inside the callers' functions: no processes of ours.
        workers = 0 if self.scheduler.inline else preparer_processes(self.config.prepare_processes, self.device)
        pixel_dtype = self.model.model.vision_tower.dtype
        self.preparer = (ProcessPreparer(self.source.path, self.config.trust_remote_code, workers, pixel_dtype) if workers
                         else ThreadPreparer(self.processor, pixel_dtype))
        # On ZeroGPU each request runs in a fresh GPU worker: captured graphs would not outlive it.
        from app.model.runner import BatchRunner  # the GPU side (torch): with the model, not at import

        self.runner = BatchRunner(self.model, use_cuda_graphs=False if self.scheduler.inline else None)
        self.scheduler.attach(self.runner, self._version, self._prepare_again, self._conversation_cache(),
                              self._encoded_images())
        self._ready.set()
        log.info("Loaded %s on %s (%s) in %.1f s", self.source.name, self.device, dtype, time.perf_counter() - started)

    def _conversation_cache(self) -> ConversationCache:
        """Where the new model's conversations are kept between turns: nowhere (a capacity of 0) when turned
        off, on a text path that cannot go on from a kept state, or on ZeroGPU, whose GPU memory is the
        callers' only during their calls."""
        keeps = tuning.CONVERSATION_CACHE and self.runner.continues and not self.scheduler.inline
        if tuning.CONVERSATION_CACHE and not keeps:
            log.info("Conversations are not kept between turns on this model's text path: every prompt is prefilled whole")
        return ConversationCache(self._conversation_cache_bytes() if keeps else 0, tuning.CONVERSATION_CACHE_MIN_TOKENS)

    def _encoded_images(self) -> EncodedImages:
        """Where the new model's images are kept encoded: where conversations are kept (MINICPMV_CONVERSATION_CACHE=0
        turns both off: docs/SECURITY.md), not on ZeroGPU, whose GPU memory is the callers' only during their calls."""
        keeps = tuning.CONVERSATION_CACHE and not self.scheduler.inline
        return EncodedImages(tuning.ENCODED_IMAGES_MB * 2**20 if keeps else 0)

    def _conversation_cache_bytes(self) -> int:
        """tuning.CONVERSATION_CACHE_GB, or where it is left to the app (negative) a share of the GPU's memory
        (tuning.CONVERSATION_CACHE_SHARE), 4 GB on the CPU."""
        if tuning.CONVERSATION_CACHE_GB >= 0:
            return int(tuning.CONVERSATION_CACHE_GB * 2**30)
        if not self._on_cuda:
            return 4 * 2**30
        import torch

        return int(tuning.CONVERSATION_CACHE_SHARE * torch.cuda.get_device_properties(self.device).total_memory)

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
            settings = GenerationSettings(max_new_tokens=4, do_sample=False)

            def one_reply(number: int = 0):
                # Each its own question, as users' first questions are: none repeats another's prompt.
                question = [{"role": "user", "content": [{"type": "image", "path": file.name},
                                                         {"type": "text", "text": f"Describe the image ({number})."}]}]
                for _ in self.stream(question, settings):
                    pass

            one_reply()
            # No wave larger than the batch and its wait line together, which would be refused as busy.
            waves = tuning.WARM_UP_WAVES + (tuning.WARM_UP_WAVES_ON_CUDA if self._on_cuda else ())
            for wave in sorted({min(wave, self.config.max_batch_size + self.config.queue_size) for wave in waves}):
                with ThreadPoolExecutor(wave) as pool:
                    list(pool.map(one_reply, range(wave)))
        self.scheduler.forget_kept()  # the warm-up's questions and images come no more
        if self.runner.uses_cuda_graphs:
            self._warm_up_shapes()
        self.warmup_s = time.perf_counter() - started
        log.info("Warm-up took %.2f s", self.warmup_s)
        # What is loaded by now (modules, the model, kernels: 483,000 objects with the tiny model): 0.46-0.49 s
        # a full collection on the dev machine. _unload unfreezes it, for the old model's cycles.
        startup.started()
        return self.warmup_s

    def _warm_up_shapes(self) -> None:
        """BatchRunner.warm_up_shapes with the scheduler paused (after a model switch users may be waiting)."""
        if not self.scheduler.pause(limits.SWITCH_WAIT_S):
            log.warning("Replies kept running: the kernel warm-up for every batch shape was skipped")
            return
        try:
            shapes = self.runner.warm_up_shapes(self.config.max_batch_size, tuning.PREFILL_TOKENS_PER_STEP)
            log.info("Warmed up %d prefill shapes and the decode step up to batch %d", len(shapes), self.config.max_batch_size)
        except Exception as error:  # out of memory on a small card, say: serve anyway, kernels build on first use
            log.error("The warm-up of every batch shape stopped; serving without it", exc_info=error)
            self.runner.release()
            self.runner.after_error(error)
        finally:
            self.scheduler.resume()

    @property
    def loaded(self) -> bool:
        """A model is loaded and takes requests (not while one is switched in)."""
        return self._ready.is_set()

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
            raise UserError(MSG_SWITCHING)
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
            raise UserError(MSG_SWITCH_FAILED.format(model=model, error=failure, current=previous.model)) from failure
        return {"freed_gpu_bytes": freed, "warmup_s": self.warmup_s}

    def _unload(self) -> int:
        """Drop model and processor; GPU bytes released (0 on the CPU)."""
        import torch

        before = self.gpu_memory_bytes() or 0
        self._ready.clear()
        self.scheduler.detach()
        self.scheduler.forget_kept()  # the old model's states and features, in GPU memory the new one needs
        self.runner.close()
        self.runner.release()
        self.runner = None
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
            raise NotReady(MSG_SWITCHING)

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
            gpu_memory_bytes=self.gpu_memory_bytes(), thinking_by_default=self.thinking_by_default,
        )

    def profile_gpu(self, seconds: float) -> dict:
        """Where the GPU's time goes over the next `seconds` while requests are served as usual
        (app/model/gpu_profile.py; benchmarks/gpu_timeline.py reports it)."""
        from app.model import gpu_profile

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
        return GenerationSettings(
            max_new_tokens=self.config.max_new_tokens,
            do_sample=bool(generation.do_sample),
            temperature=float(generation.temperature if generation.temperature is not None else 1.0),
            top_p=float(generation.top_p if generation.top_p is not None else 1.0),
            top_k=int(generation.top_k or 0),
            repetition_penalty=float(generation.repetition_penalty or 1.0),
            visual_token_budget=self.config.visual_token_budget,
        )

    @property
    def max_context_tokens(self) -> int:
        text_config = self.model.config.get_text_config()
        return min(limits.MAX_CONTEXT_TOKENS, getattr(text_config, "max_position_embeddings", limits.MAX_CONTEXT_TOKENS))

    @property
    def active_generations(self) -> int:
        """Requests in the running batch: zero once every request has left the GPU."""
        return self.scheduler.running

    # Serving ---------------------------------------------------------------------------------------

    def plan_images(self, paths: list[str], settings: GenerationSettings) -> SlicePlan:
        """How these images would be cut together under `settings` and what each would cost, without running
        the model or decoding their pixels (the UI shows it before a question is sent)."""
        self._wait_until_ready()
        return plan_slices(self.processor.image_processor, [image_size(path) for path in paths],
                           settings.max_slice_nums, settings.downsample_mode, settings.visual_token_budget)

    def prepare(self, messages: list[dict], settings: GenerationSettings) -> PreparedInputs:
        self._wait_until_ready()
        asked = time.perf_counter()
        images = self.scheduler.images
        prepared = self._prepared(messages, settings, held_media(messages, self.scheduler.conversations, images))
        if prepared.pixels_left_out and not take_held_media(prepared, images):  # let go meanwhile
            prepared = self._prepared(messages, settings, frozenset())
        prepared.timeline["asked"] = asked
        if prepared.kept is not None:  # its earlier media are in the kept state: not encoded again
            without_media_before(prepared, prepared.kept.length)
        runner = self.runner
        if runner is not None:  # None while a model is switched: the request is prepared again for the next
            runner.stage_media(prepared.tensors)
        return prepared

    def _prepared(self, messages: list[dict], settings: GenerationSettings, kept_media: frozenset) -> PreparedInputs:
        """The preparer's inputs, with the kept conversation they go on from (if any). Where the engine makes
        images' slices on its GPU, the preparer leaves them to runner.stage_media; images that kept
        conversations hold (`kept_media`) it does not decode."""
        runner = self.runner  # None while a model is switched in
        prepared = self.preparer.prepare(messages, settings, self.max_context_tokens,
                                         jpegs_on_device=runner is not None and runner.jpegs.enabled, kept_media=kept_media)
        # Also CPU work on the prompt, so done here rather than on the thread that drives the GPU.
        prepared.canvas = canvas_positions(self.model, prepared.tensors, settings.downsample_mode)
        if prepared.canvas is None:
            prepared.kept = self.scheduler.conversations.find(prepared)
        return prepared

    def start(self, messages: list[dict], settings: GenerationSettings, emit: Callable[[str, object], None],
              requested_at: float, cancelled: threading.Event | None = None) -> Request | None:
        """Prepare a request and put it in line; its events go to `emit(kind, value)` (see follow_reply),
        and setting `cancelled` takes it out. Raises UserError for bad input; a full line is emitted
        ("refused") and counted, not raised (None is returned then). The line is asked before the request
        is prepared too: a crowd beyond it hears so without costing the engine any image decoding.
        """
        version = self._version
        try:
            self.scheduler.check_room()
            request = Request(messages=messages, prepared=self._prepare_and_tell(messages, settings, emit),
                              settings=settings, version=version, requested_at=requested_at, emit=emit,
                              cancelled=cancelled or threading.Event())
            self.scheduler.submit(request)
        except Busy as error:
            self.metrics.request_done("busy")
            emit(ReplyEvent.REFUSED, error)
            return None
        return request

    def _prepare_and_tell(self, messages: list[dict], settings: GenerationSettings,
                          emit: Callable[[str, object], None]) -> PreparedInputs:
        prepared = self.prepare(messages, settings)
        emit(ReplyEvent.PREPARED, prepared_summary(prepared, self.source.path, time.perf_counter()))
        return prepared

    def _prepare_again(self, request: Request) -> PreparedInputs:
        """For the scheduler: a request that waited through a model switch, prepared for the new model."""
        return self._prepare_and_tell(request.messages, request.settings, request.emit)

    def stream(self, messages: list[dict], settings: GenerationSettings,
               stop: StopSignal | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply to `messages`; `stop` ends it at once, wherever it is. Raises UserError for bad
        input and for failures the user should see."""
        requested_at = time.perf_counter()
        events = queue.SimpleQueue()
        cancelled = threading.Event()
        if stop is not None:
            stop.on_set(cancelled.set)  # one still being prepared is not put in line
            stop.on_set(lambda: events.put((ReplyEvent.STOPPED, None)))
        self.start(messages, settings, lambda kind, value: events.put((kind, value)), requested_at, cancelled)

        yield from follow_reply(events, lambda path: self.processor.tokenizer, requested_at,
                                lambda outcome: self.end_request(cancelled, outcome),
                                self.scheduler.drive if self.scheduler.inline else None, settings)

    def end_request(self, cancelled: threading.Event, outcome: str) -> None:
        """The caller is done with a request (`outcome` as in metrics.OUTCOMES): it leaves the batch."""
        cancelled.set()
        if outcome != "busy":  # counted when refused
            self.metrics.request_done(outcome)
