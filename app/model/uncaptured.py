"""What runs where nothing is captured as a CUDA graph (the CPU; ZeroGPU, where the GPU exists only inside the
callers' functions): app.model.cuda_graphs' interfaces, every step and prefill launched from Python."""

from typing import Callable

import torch


class EagerDecode:
    """The decode step launched from Python each time: DecodeGraphs' interface."""

    captures = False

    def __init__(self, store, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.store, self.step = store, step

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.step(tokens.to(self.store.device), self.store.lengths[:tokens.shape[0]].clone())

    def capture_all(self, max_rows: int, above: int = 0) -> None:
        """Nothing to capture."""

    def clear(self) -> None:
        """Nothing captured to forget."""


class LaunchedPrefills:
    """PrefillGraphs' (and ContinuedPrefillGraphs') interface where nothing is captured: every prefill is
    launched from Python."""

    def run(self, *prompts) -> None:
        return None

    def capture_all(self, max_rows: int) -> None:
        """Nothing to capture."""

    def clear(self) -> None:
        """Nothing captured to forget."""
