"""Hugging Face ZeroGPU support: a GPU is attached only inside functions decorated with spaces.GPU."""

import os


def on_zero_gpu(function):
    """Run `function` (a whole streaming generator included) under spaces.GPU on ZeroGPU; elsewhere, unchanged."""
    if not os.environ.get("SPACES_ZERO_GPU"):
        return function
    import spaces

    return spaces.GPU(function)
