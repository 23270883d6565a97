"""What every process of the app does as it starts, and once it has started, in one place: the limits and
knobs the environment sets, logging tagged with the process's kind, signals, Python's GIL switch interval,
torch's threads (for the engine once its device is known: engine_device_chosen), and gc.freeze. The processes: the one started by `python app.py` (the only one, or the
parent of the others), the engine process, the web processes, the fronts and the preparing workers."""

import ctypes
import gc
import logging
import signal
import sys
from typing import Callable

from app import tuning
from app.config import apply_environment


def start_process(kind: str | None = None, on_sigterm: Callable[[], None] | None = None,
                  torch_threads: int | None = None) -> None:
    """Set this process up. `kind` names a child process (its log lines say so, and Ctrl+C, which reaches
    every process of the terminal, is left to the parent that stops it); `on_sigterm` is how it stops;
    `torch_threads` bounds torch's pool where many processes share the cores (docs/DECISIONS.md D13)."""
    apply_environment()
    tag = f" [{kind}]" if kind else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")
    logging.getLogger("mcp").setLevel(logging.WARNING)  # --mcp: the MCP SDK logs a line for every request
    if kind is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if on_sigterm is not None:
        signal.signal(signal.SIGTERM, lambda *_: on_sigterm())
    # Threads that waited (for the GPU, a pipe, a file write) get the GIL back sooner (docs/DECISIONS.md D14).
    sys.setswitchinterval(tuning.SWITCH_INTERVAL_S)
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)


def hold_freed_memory(megabytes: int) -> bool:
    """glibc's malloc keeps up to `megabytes` of freed memory for reuse: blocks below that size (at most 32 MB,
    the most older glibc takes) come from the heap, not from fresh pages, and a free heap top below it is not
    handed back. Without this, glibc's thresholds follow the last large block freed, and memory handed back
    is faulted in again page by page at the next use. Whether it was done: not elsewhere than on glibc."""
    if megabytes <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    held = min(megabytes, 1024) << 20
    # The mmap threshold first: setting either one stops glibc adjusting the other, so neither is set unless it
    # takes this one.
    if not mallopt(_M_MMAP_THRESHOLD, min(held, 32 << 20)):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, held))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def engine_device_chosen(device: str) -> None:
    """The process that drives the model knows its device (at its model's load). On a GPU, its own tensor
    work is small index lists, which torch's pool of a thread per core made slower while it kept 15
    threads spinning (1.1 cores at 200 users on a 16-core H200 box, docs/DECISIONS.md D13), cores the
    preparers need: one thread."""
    if str(device).startswith("cuda"):
        import torch

        torch.set_num_threads(1)


def started() -> None:
    """The process is set up (its server built, its model warm): what it made stays out of the collector's
    full collections, each of which walked it all and stopped every stream of the process meanwhile
    (docs/DECISIONS.md D15)."""
    gc.freeze()
