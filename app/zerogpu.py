"""Hugging Face ZeroGPU support: a GPU is attached only inside functions decorated with spaces.GPU."""

import os


def zero_gpu_enabled() -> bool:
    return bool(os.environ.get("SPACES_ZERO_GPU"))


def on_zero_gpu(function):
    """Run `function` (a whole streaming generator included) under spaces.GPU on ZeroGPU; elsewhere, unchanged."""
    if not zero_gpu_enabled():
        return function
    import spaces

    return spaces.GPU(function)
