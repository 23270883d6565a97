"""int4 checkpoints: what transformers needs to load them, and a clear word when a package is missing.

GPTQ (and AWQ) checkpoints load through GPT-QModel + optimum (requirements-quant.txt). GPT-QModel's own
exports say how weights were quantized but not which linear layers were: it leaves small ones, such as
the DeltaNet gates `in_proj_a` / `in_proj_b`, in 16 bits. Told nothing, transformers (through optimum)
converts every linear layer of each block and fails on those. The quantized layers are the ones whose
weights come as `qweight`, so they are read from the checkpoint's tensor names.
"""

import glob
import importlib.util
import os
import re

from app import limits
from app.errors import UserError

_BLOCK_LAYER = re.compile(r"^(.*\.layers)\.\d+\.(.+)\.qweight$")
# quant_method -> Python packages it needs
_NEEDS = {"gptq": ("gptqmodel", "optimum"), "awq": ("gptqmodel",), "bitsandbytes": ("bitsandbytes",)}


def complete_quantization_config(path: str, config) -> None:
    """Check the packages a quantized checkpoint needs, and fill in what a GPT-QModel export leaves out."""
    settings = getattr(config, "quantization_config", None)
    if settings is None:
        return
    settings = settings if isinstance(settings, dict) else settings.to_dict()
    method = settings.get("quant_method")
    missing = [package for package in _NEEDS.get(method, ()) if importlib.util.find_spec(package) is None]
    if missing:
        raise UserError(limits.MSG_QUANT_PACKAGES_MISSING.format(method=method, packages=", ".join(missing)))
    if method != "gptq" or settings.get("modules_in_block_to_quantize"):
        return
    blocks, modules = set(), set()
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        from safetensors import safe_open

        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                match = _BLOCK_LAYER.match(name)
                if match:
                    blocks.add(match.group(1))
                    modules.add(match.group(2))
    if len(blocks) == 1:  # otherwise not a layout we can read: transformers gets the config as it is
        config.quantization_config = {**settings, "block_name_to_quantize": blocks.pop(),
                                      "modules_in_block_to_quantize": [sorted(modules)]}
