"""Where media pixels and the vision tower's work meet the GPU's streams: pixels staged on the GPU ahead of
their wave (pinned host memory, copied on a side stream), a wave's media encoded on a stream of its own
beside the decode steps, launched from a thread of its own (MediaEncoding), and the scheduler's own
high-priority stream."""

import contextlib
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from app import tuning


class MediaEncoding:
    """A wave's visual features (encode_media's list): computed at once, or still being launched (a Future
    of the list) and computed on the vision stream; `events` (started, done) there, `seconds` the time taken
    where known at once."""

    def __init__(self, features: list | Future, events: tuple | None, seconds: float | None):
        self._features, self._events, self._seconds = features, events, seconds

    def ready(self, wait: bool) -> bool:
        """Whether the features are computed, or their launch failed (features() then raises the error, for
        this wave alone); with `wait`, once either is so (the host waits for the GPU)."""
        if isinstance(self._features, Future):
            if not wait and not self._features.done():
                return False
            if self._features.exception() is not None:  # waits for the launch to end
                return True
        if self._events is None:
            return True
        if wait:
            self._events[1].synchronize()
            return True
        return self._events[1].query()

    @property
    def seconds(self) -> float:
        """The encoding's time, once ready and its features() given (on CUDA the vision stream's, alongside
        other work)."""
        return self._seconds if self._events is None else self._events[0].elapsed_time(self._events[1]) / 1000

    def features(self) -> list[torch.Tensor | None]:
        """The features, for use on the current stream (which waits for them, without the host waiting);
        raises what failed their launch."""
        features = self._features.result() if isinstance(self._features, Future) else self._features
        if self._events is not None:
            stream = torch.cuda.current_stream(self._events[1].device)
            stream.wait_event(self._events[1])
            for feature in features:
                if feature is not None:
                    feature.record_stream(stream)  # made on the vision stream: not to be reused before this use
        return features


class StagedPixels:
    """A request's pixels copied to the GPU on the staging stream (BatchRunner.stage_media)."""

    def __init__(self, tensor: torch.Tensor, copied, release: Callable[[], None]):
        self.tensor, self.copied = tensor, copied
        self._release = release

    def on_device(self) -> torch.Tensor:
        """The pixels, once the current stream has waited for their copy (the host does not wait)."""
        stream = torch.cuda.current_stream(self.tensor.device)
        stream.wait_event(self.copied)
        self.tensor.record_stream(stream)  # the allocator must not hand its memory out before this use
        return self.tensor

    def __del__(self):
        self._release()


class PixelStaging:
    """The side stream pixels are copied on, and how many bytes wait on the GPU (CUDA, with captured
    steps: on ZeroGPU the GPU exists only inside the callers' functions)."""

    def __init__(self, device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.limit = tuning.STAGED_PIXELS_MB * 2**20
        self.staged = 0
        self._lock = threading.Lock()
        self._building = threading.Lock()  # make(): one build at a time

    def stage(self, pixels: torch.Tensor) -> StagedPixels | None:
        release = self._reserved(pixels.numel() * pixels.element_size())
        if release is None:
            return None
        with torch.cuda.stream(self.stream):
            tensor = pixels.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return StagedPixels(tensor, copied, release)

    def make(self, size: int, build: Callable[[], torch.Tensor]) -> StagedPixels | None:
        """Pixels of `size` bytes that `build()` makes on the GPU (app.model.jpegs), on the staging stream,
        held as staged pixels; None when they would pass the limit.

        nvJPEG (torchvision's decoder) writes its output from a stream of its own, into memory the
        allocator handed out on this one, with no wait for what this stream still has to run there
        (pytorch/vision#9606): memory freed by an earlier build, whose kernels may still be queued. So each
        build starts once the stream has run everything before it, one build at a time."""
        release = self._reserved(size)
        if release is None:
            return None
        try:
            with self._building, torch.cuda.stream(self.stream):
                self.stream.synchronize()
                tensor = build()
                made = torch.cuda.Event()
                made.record(self.stream)
        except BaseException:
            release()
            raise
        return StagedPixels(tensor, made, release)

    def _reserved(self, size: int) -> Callable[[], None] | None:
        """Room for `size` more bytes, and what gives it back; None when they would pass the limit."""
        with self._lock:
            if self.staged + size > self.limit:
                return None
            self.staged += size
        return functools.partial(self._release, size)

    def _release(self, size: int) -> None:
        with self._lock:
            self.staged -= size


class NoStaging:
    """PixelStaging's interface where pixels are not staged: they are copied in their wave."""

    def stage(self, pixels: torch.Tensor) -> None:
        return None

    def make(self, size: int, build: Callable[[], torch.Tensor]) -> None:
        return None


class SideStreams:
    """CUDA: prefills and decode steps on the serving stream, a wave's media encoded on the vision stream
    beside them (app.model.runner says why), launched from a thread of its own.

    On the scheduler's thread, a wave's launch took as long as its tower (14-35 ms for 448x448 photos at 10-200
    users on an H100), and no decode step was launched meanwhile: every running reply waited for each newcomer
    (docs/DECISIONS.md D63).
    """

    def __init__(self, device):
        self.device = device
        self._serving = serving_stream(device)
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="vision-launcher")

    def serving(self):
        """A context in which GPU work goes to the serving stream."""
        return torch.cuda.stream(self._serving)

    def encode_ahead(self, encode: Callable[[], list], decoding: bool) -> MediaEncoding:
        """encode() launched on the vision stream from the launcher's thread, neither waited for; `decoding`:
        replies decode meanwhile, and the tower's matrix products leave them tuning.VISION_SM_CARVEOUT SMs.
        The carve-out is a setting of the whole process, which a decode graph captured meanwhile would keep:
        with one, the tower is launched on the caller's thread, as before D63."""
        stream = vision_stream(self.device)
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        carveout = tuning.VISION_SM_CARVEOUT if decoding else 0

        def launch() -> list:
            with torch.inference_mode(), torch.cuda.stream(stream), matmuls_leaving_sms(carveout):
                started.record(stream)
                features = encode()
                done.record(stream)
            return features

        return MediaEncoding(launch() if carveout else self._launcher.submit(launch), (started, done), None)

    def close(self) -> None:
        """Wait for a launch in progress (a model being unloaded), and end the launcher's thread."""
        self._launcher.shutdown(wait=True)


class OneStream:
    """Elsewhere (the CPU, ZeroGPU, or MINICPMV_MEDIA_ALONGSIDE_DECODING=0): all work on the thread's
    current stream, media encoded at once."""

    def serving(self):
        return contextlib.nullcontext()

    def encode_ahead(self, encode: Callable[[], list], decoding: bool) -> MediaEncoding:
        started = time.perf_counter()
        features = encode()
        return MediaEncoding(features, None, time.perf_counter() - started)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def matmuls_leaving_sms(count: int):
    """cuBLAS's matrix products launched meanwhile use all SMs but `count` (0: all)."""
    if not count:
        yield
        return
    previous = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(count)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)


@functools.cache
def vision_stream(device) -> torch.cuda.Stream:
    """The stream media are encoded on, one for the life of the process (see app.model.cuda_graphs.capture_stream), at the
    default priority, which is the lowest: the vision tower takes what the decode steps leave of the GPU."""
    return torch.cuda.Stream(device)


@functools.cache
def serving_stream(device) -> torch.cuda.Stream:
    """The scheduler's stream for prefills and decode steps, one for the life of the process, at the
    highest priority: a decode step's thread blocks go before the vision tower's waiting ones."""
    return torch.cuda.Stream(device, priority=-100)  # beyond the range: its highest
