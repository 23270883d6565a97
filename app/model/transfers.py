"""Small data between the host and the GPU without waiting for the GPU's queue.

The scheduler's thread launches every decode step. A copy that synchronizes its stream makes that
thread wait for the step just launched (or, behind a wave of images, for the wave), and the GPU then
waits for the thread's bookkeeping before the next step. These two go through pinned memory instead.
"""

import torch


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, without waiting for the GPU.

    A plain copy to a GPU from pageable memory synchronizes the stream: whatever was launched on it (a
    decode step, a prefill) would have to end before the host could go on. Choosing tokens that way
    undid the scheduler's pipelining (docs/DECISIONS.md D19).
    Through pinned memory the copy is queued behind that work like any kernel."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TokensOnTheirWay:
    """Chosen tokens on their way to the host: the copy starts at once, and tolist() waits for it alone,
    not for what the GPU was given since.

    From a GPU, through pinned memory and a CUDA event rather than `.tolist()`: its synchronous copy to
    pageable memory, while a decode step waited behind a wave of images, also held up other threads' CUDA
    calls. On an H200, staging a request's pixels took 25-28 ms instead of 1.4, and preparing a request
    132-134 ms instead of 74 (benchmarks/experiments/side_by_side.py)."""

    def __init__(self, chosen: torch.Tensor):
        self._copied = None
        if chosen.is_cuda:
            self._host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
            self._host.copy_(chosen, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(chosen.device))
        else:
            self._host = chosen

    def tolist(self) -> list[int]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()
