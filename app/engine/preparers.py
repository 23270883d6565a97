"""Where a request's inputs are prepared (images decoded and sliced, the prompt rendered): threads or processes.

Preparing one 1344x1344 image takes 60-80 ms of CPU, much of it Python holding the GIL. In the
engine's process that time is taken from the scheduler thread that drives the GPU, and however many
cores the machine has, one process prepares about one request at a time: at 200 users on an H200 the
preparation waited 3.6 s at the median (docs/DECISIONS.md D7). So on a GPU box requests are prepared
in worker processes, each with its own processor. A worker writes the pixels into one of a few
shared-memory buffers made at start (`PixelSlots`), and everything else comes back by value through
the pool's pipe. On the CPU, where the cores run the model, a few threads of the engine's process do it.
"""

import logging
import os
import queue
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context, parent_process

from app import tuning
from app.engine.inputs import PreparedInputs, prepare_inputs
from app.engine.processor import load_processor
from app.engine.settings import GenerationSettings
from app.errors import UserError
from app.messages import MSG_PREPARER_LOST

log = logging.getLogger(__name__)

BY_VALUE_BYTES = 2**20  # a worker's tensors smaller than this come back through the pipe (see _prepare)
# One image at the full slice budget (6 MB in uint8), or the decoded images a request hands the engine to slice
# (app.engine.jpegs_on_device.DECODED_PIXELS_MAX_BYTES); more takes the slow way back.
PIXEL_SLOT_BYTES = 8 * 2**20


def preparer_processes(requested: int, device) -> int:
    """Worker processes to prepare inputs: `requested`, or for -1 half the cores (at most 8) on CUDA, none elsewhere."""
    if requested >= 0:
        return requested
    if not str(device).startswith("cuda"):
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class ThreadPreparer:
    """A few requests at a time on the caller's thread: hundreds at once would fight over the GIL and the cores."""

    def __init__(self, processor, pixel_dtype=None):
        self.processor = processor
        self.pixel_dtype = pixel_dtype
        self._slots = threading.BoundedSemaphore(tuning.PREPARE_CONCURRENCY)

    def prepare(self, messages: list[dict], settings: GenerationSettings, max_context_tokens: int,
                jpegs_on_device: bool = False, kept_media: frozenset = frozenset()) -> PreparedInputs:
        with self._slots:
            started = time.perf_counter()
            prepared = prepare_inputs(self.processor, messages, settings, max_context_tokens, self.pixel_dtype,
                                      jpegs_on_device, kept_media)
        done = time.perf_counter()
        prepared.timeline.update(work_started=started, work_done=done, received=done)  # no way back here
        return prepared

    def close(self) -> None:
        pass


class ProcessPreparer:
    """Worker processes, each loading the checkpoint's processor once, all started and ready on return.

    The pool would start a worker only when a request finds none idle, so some started during the
    warm-up's last wave could still be importing torch (about 5 s of CPU each) as the first users came:
    the likely cause of the workers' 2.3-3.9 cores while serving one user on a 16-core H200 box (0.15 later).
    """

    def __init__(self, processor_path: str, trust_remote_code: bool, workers: int, pixel_dtype=None,
                 slot_bytes: int = PIXEL_SLOT_BYTES):
        self.workers = workers
        self.pixel_dtype = pixel_dtype
        self._processor_source = (processor_path, trust_remote_code)
        # A slot for each request being prepared and two more, for those whose pixels are being taken out.
        self._slots = PixelSlots.made(workers + 2, slot_bytes) if slot_bytes else None
        self._pool_lock = threading.Lock()  # held while a pool starts, so that no request meets a broken one
        self._pool = self._started_pool()
        log.info("Inputs are prepared in %d worker processes", workers)

    def _started_pool(self) -> ProcessPoolExecutor:
        context = get_context("spawn")
        ready = context.Queue()
        pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_load_processor,
                                   initargs=(*self._processor_source, ready, self._slots.buffers if self._slots else []))
        # One task each while none is idle yet starts every worker; each says when its processor is loaded.
        for future in [pool.submit(os.getpid) for _ in range(self.workers)]:
            future.result()
        for _ in range(self.workers):
            ready.get(timeout=tuning.PREPARER_START_TIMEOUT_S)
        return pool

    def prepare(self, messages: list[dict], settings: GenerationSettings, max_context_tokens: int,
                jpegs_on_device: bool = False, kept_media: frozenset = frozenset()) -> PreparedInputs:
        """`jpegs_on_device`: the engine slices the images, and decodes the JPEGs it can (app.engine.jpegs_on_device);
        `kept_media`: the media kept conversations hold (app.engine.inputs.prepare_inputs)."""
        if self._slots is None:
            return self._through_a_worker(messages, settings, max_context_tokens, None, jpegs_on_device, kept_media)
        slot = self._slots.take()
        try:
            return self._through_a_worker(messages, settings, max_context_tokens, slot, jpegs_on_device, kept_media)
        finally:
            self._slots.give_back(slot)

    def _through_a_worker(self, messages, settings, max_context_tokens, slot: int | None,
                          jpegs_on_device: bool, kept_media: frozenset) -> PreparedInputs:
        with self._pool_lock:
            pool = self._pool
        try:
            prepared = pool.submit(_prepare, messages, settings, max_context_tokens, self.pixel_dtype, slot,
                                   jpegs_on_device, kept_media).result()
        except BrokenProcessPool:
            self._replace(pool)
            raise UserError(MSG_PREPARER_LOST) from None
        prepared.tensors = _from_the_way_back(prepared.tensors, self._slots.buffers[slot] if slot is not None else None)
        prepared.timeline["received"] = time.perf_counter()
        return prepared

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """A worker that dies (a decoder's crash, the kernel's out-of-memory killer) breaks the whole pool, and
        every request after it failed until a restart: the first request to meet it starts a new one. The
        requests it was preparing fail, each with MSG_PREPARER_LOST."""
        with self._pool_lock:
            if self._pool is broken:
                log.warning("A preparing worker process ended; starting %d new ones", self.workers)
                broken.shutdown(wait=False, cancel_futures=True)
                self._pool = self._started_pool()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


class PixelSlots:
    """Shared-memory buffers that workers write a request's pixels into, one per request in flight.

    A torch tensor sent back through the pool is copied into a shared-memory segment of its own (5 ms
    for 6 MB in the worker), and its file descriptor is passed over a socket. On the engine's side that
    is several waits for its GIL, each as long as Python's switch interval when another thread holds it.
    The round trip of 6 MB of pixels took 21 ms alone and 152 ms beside a busy thread
    (benchmarks/experiments/worker_hop.py), while small data by value took 0.7 and 34. The buffers are made once and
    reach every worker at its start; a request then writes into a free one and only its place comes back.
    A whole preparation through a worker, dev machine: 64-74 ms against 73-83 alone, 145-160 against
    191-230 beside a busy thread (benchmarks/experiments/pixel_slots.py).
    """

    def __init__(self, buffers: list):
        self.buffers = buffers
        self._free = queue.SimpleQueue()
        for slot in range(len(buffers)):
            self._free.put(slot)

    @classmethod
    def made(cls, count: int, size: int) -> "PixelSlots | None":
        """`count` buffers of `size` bytes, or None where shared memory is too small for them (a
        container's /dev/shm, say): the pixels then come back the slow way."""
        import torch

        try:
            return cls([torch.empty(size, dtype=torch.uint8).share_memory_() for _ in range(count)])
        except RuntimeError as error:
            log.warning("No shared buffers for the preparing workers' pixels (%s): each request's go through a segment of its own", error)
            return None

    def take(self) -> int:
        return self._free.get()

    def give_back(self, slot: int) -> None:
        self._free.put(slot)


@dataclass(frozen=True)
class InSlot:
    """Where a tensor lies in a request's pixel slot."""
    offset: int
    shape: tuple
    dtype: object


_processor = None  # a worker process's own
_slot_buffers: list = []  # the PixelSlots' buffers, as this worker sees them


def _load_processor(path: str, trust_remote_code: bool, ready, slot_buffers: list) -> None:
    global _processor, _slot_buffers
    from app.startup import hold_freed_memory, start_process

    start_process("preparer", torch_threads=1)  # many workers side by side: one core each
    hold_freed_memory(tuning.PREPARER_HELD_MEMORY_MB)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    _processor = load_processor(path, trust_remote_code)
    _slot_buffers = slot_buffers
    ready.put(os.getpid())


def _exit_with_parent() -> None:
    """End this worker when the engine's process ends, even killed (then nobody shuts the pool down)."""
    parent_process().join()
    os._exit(0)


def _prepare(messages: list[dict], settings: GenerationSettings, max_context_tokens: int, pixel_dtype,
             slot: int | None, jpegs_on_device: bool, kept_media: frozenset) -> PreparedInputs:
    """In a worker: the pixels go back in the request's slot (see PixelSlots), the small tensors (the
    prompt's ids, the slices' sizes...) by value, as numpy arrays. Shared, each of those takes a segment
    of its own and about 1 ms to pass its file descriptor: returning 4 of them took 3.3-6.0 ms against
    0.6-0.8 by value, and a whole preparation through a worker 1-2 ms less at the median (a dev core).
    Pixels that do not fit the slot go back in a segment of their own, as torch sends tensors."""
    started = time.perf_counter()
    prepared = prepare_inputs(_processor, messages, settings, max_context_tokens, pixel_dtype, jpegs_on_device,
                              kept_media, may_hold_gil=True)  # this worker's one thread prepares one request
    prepared.tensors = _for_the_way_back(prepared.tensors, _slot_buffers[slot] if slot is not None else None)
    prepared.timeline.update(work_started=started, work_done=time.perf_counter())
    return prepared


def _for_the_way_back(tensors: dict, slot_buffer) -> dict:
    """Small tensors as numpy arrays; the large ones into `slot_buffer` while they fit (InSlot), 64-byte aligned."""
    import torch

    sent, offset = {}, 0
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            sent[key] = value
        elif value.nbytes < BY_VALUE_BYTES and value.dtype != torch.bfloat16:  # numpy has no bfloat16
            sent[key] = value.numpy()
        elif slot_buffer is not None and offset + value.nbytes <= slot_buffer.numel():
            slot_buffer[offset:offset + value.nbytes].view(value.dtype).view(value.shape).copy_(value)
            sent[key] = InSlot(offset, tuple(value.shape), value.dtype)
            offset += -(-value.nbytes // 64) * 64
        else:
            sent[key] = value
    return sent


def _from_the_way_back(tensors: dict, slot_buffer) -> dict:
    """Torch tensors again, those in the slot copied out of it (the slot is then free for another request)."""
    import numpy
    import torch

    def received(value):
        if isinstance(value, numpy.ndarray):
            return torch.from_numpy(value)
        if isinstance(value, InSlot):
            size = torch.Size(value.shape).numel() * value.dtype.itemsize
            return slot_buffer[value.offset:value.offset + size].view(value.dtype).view(value.shape).clone()
        return value

    return {key: received(value) for key, value in tensors.items()}
