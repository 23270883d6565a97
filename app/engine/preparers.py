"""Where a request's inputs are prepared (images decoded and sliced, the prompt rendered): threads or processes.

Preparing one 1344x1344 image takes about 75 ms of CPU, much of it Python holding the GIL. In the
engine's process that time is taken from the scheduler thread that drives the GPU, and however many
cores the machine has, one process prepares about one request at a time: at 200 users on an H200 the
preparation waited 3.6 s at the median (benchmarks/RESULTS.md). So on a GPU box requests are prepared
in worker processes, each with its own processor, and their tensors come back through shared memory
(torch's pickling for multiprocessing) rather than copied through a pipe. On the CPU, where the cores
run the model, a few threads of the engine's process do it.
"""

import logging
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context, parent_process

from app import limits
from app.engine.inputs import PreparedInputs, load_processor, prepare_inputs
from app.engine.settings import GenerationSettings

log = logging.getLogger(__name__)

BY_VALUE_BYTES = 2**20  # a worker's tensors smaller than this come back through the pipe (see _prepare)


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
        self._slots = threading.BoundedSemaphore(limits.PREPARE_CONCURRENCY)

    def prepare(self, messages: list[dict], settings: GenerationSettings, max_context_tokens: int) -> PreparedInputs:
        with self._slots:
            return prepare_inputs(self.processor, messages, settings, max_context_tokens, self.pixel_dtype)

    def close(self) -> None:
        pass


class ProcessPreparer:
    """Worker processes, each loading the checkpoint's processor once, all started and ready on return.

    The pool would start a worker only when a request finds none idle, so some started during the
    warm-up's last wave could still be importing torch (about 5 s of CPU each) as the first users came:
    the likely cause of the workers' 2.3-3.9 cores while serving one user on a 16-core H200 box (0.15 later).
    """

    def __init__(self, processor_path: str, trust_remote_code: bool, workers: int, pixel_dtype=None):
        self.workers = workers
        self.pixel_dtype = pixel_dtype
        context = get_context("spawn")
        ready = context.Queue()
        self._pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_load_processor,
                                         initargs=(processor_path, trust_remote_code, ready))
        # One task each while none is idle yet starts every worker; each says when its processor is loaded.
        for future in [self._pool.submit(os.getpid) for _ in range(workers)]:
            future.result()
        for _ in range(workers):
            ready.get(timeout=limits.PREPARER_START_TIMEOUT_S)
        log.info("Inputs are prepared in %d worker processes", workers)

    def prepare(self, messages: list[dict], settings: GenerationSettings, max_context_tokens: int) -> PreparedInputs:
        prepared = self._pool.submit(_prepare, messages, settings, max_context_tokens, self.pixel_dtype).result()
        prepared.tensors = _from_arrays(prepared.tensors)
        return prepared

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


_processor = None  # a worker process's own


def _load_processor(path: str, trust_remote_code: bool, ready) -> None:
    global _processor
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches every process of the terminal: the engine stops us
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    torch.set_num_threads(1)  # many workers side by side: one core each
    _processor = load_processor(path, trust_remote_code)
    ready.put(os.getpid())


def _exit_with_parent() -> None:
    """End this worker when the engine's process ends, even killed (then nobody shuts the pool down)."""
    parent_process().join()
    os._exit(0)


def _prepare(messages: list[dict], settings: GenerationSettings, max_context_tokens: int, pixel_dtype) -> PreparedInputs:
    """In a worker: the pixels go back in shared memory, the small tensors (the prompt's ids, the slices'
    sizes...) by value, as numpy arrays. Shared, each of those takes a segment of its own and about 1 ms to
    pass its file descriptor: returning 4 of them took 3.3-6.0 ms against 0.6-0.8 by value, and a whole
    preparation through a worker 1-2 ms less at the median (a dev core). The pixels through the pipe
    instead: 32-36 ms against 11-13 for 6 MB (benchmarks/worker_hop.py)."""
    prepared = prepare_inputs(_processor, messages, settings, max_context_tokens, pixel_dtype)
    prepared.tensors = _small_as_arrays(prepared.tensors)
    return prepared


def _small_as_arrays(tensors: dict) -> dict:
    import torch

    return {key: value.numpy() if isinstance(value, torch.Tensor) and value.nbytes < BY_VALUE_BYTES
            and value.dtype != torch.bfloat16 else value  # numpy has no bfloat16
            for key, value in tensors.items()}


def _from_arrays(tensors: dict) -> dict:
    import numpy
    import torch

    return {key: torch.from_numpy(value) if isinstance(value, numpy.ndarray) else value for key, value in tensors.items()}
